"""The front's errors: OpenAI's JSON shape, ``{"error": {"message", "type", "code"}}``, and
the handlers that map exceptions to it: 400 for bad input (``ValueError`` / ``TypeError``),
404 for an unknown memory, scope or route, 422 for a body that does not fit a route's
schema (FastAPI's validation message), 503 when vLLM does not answer.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale.types import MemoryNotFoundError, UnknownScopeError


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error response: ``{"error": {"message", "type", "code"}}`` with HTTP status ``status``."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every known exception in the error shape above."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return error(400, "the request body is not valid JSON")
        parts = ["{}: {}".format(".".join(str(p) for p in e.get("loc", ())), e.get("msg")) for e in exc.errors()]
        return error(422, "invalid request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return error(exc.status_code, message, "not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    @app.exception_handler(MemoryNotFoundError)
    @app.exception_handler(UnknownScopeError)
    async def not_found(request: Request, exc: KeyError) -> JSONResponse:
        return error(404, str(exc.args[0]) if exc.args else str(exc), "not_found_error")

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_input(request: Request, exc: Exception) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(httpx.HTTPError)
    async def upstream_down(request: Request, exc: httpx.HTTPError) -> JSONResponse:
        return error(503, f"the model server is not answering ({type(exc).__name__}); see /ready", "server_error")
