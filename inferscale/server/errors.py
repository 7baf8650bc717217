"""The front's errors: OpenAI's JSON shape, ``{"error": {"message", "type", "code"}}``, and
the handlers that map exceptions to it (with ``detail``, the same message, for Mem0's clients): 400 for bad input (``ValueError`` / ``TypeError``),
404 for an unknown memory, scope or route, 422 for a body that does not fit a route's
schema (FastAPI's validation message), 503 with ``Retry-After`` when a dependency does not
answer (vLLM, the Chroma server, PostgreSQL: :mod:`inferscale.runtime.outages`, which logs
one line when an outage starts and one when it ends).
"""

from __future__ import annotations

import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale.runtime.outages import NAMES, OUTAGES, RETRY_AFTER_S
from inferscale.server.upstream import relayed_failure
from inferscale.types import MemoryNotFoundError, UnknownScopeError


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error response: ``{"error": {"message", "type", "code"}, "detail": message}`` with HTTP
    status ``status`` (OpenAI's shape; ``detail`` is where Mem0's clients read the message)."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, "detail": message},
                        status_code=status)


def upstream_error(status: int, content: bytes) -> JSONResponse:
    """vLLM's error answer (``status`` >= 400, body ``content``) in the front's shape: its own
    ``{"error": {...}}`` kept, ``detail`` added with its message; a body that is not vLLM's
    JSON (a proxy's text, an empty body) becomes the message, and a 5xx of that kind (vLLM's
    router's, a replica having gone under the request) a 503 with ``Retry-After``."""
    if relayed_failure(status, content):  # not vLLM's own answer: a replica went under the request
        message = content.decode("utf-8", "replace").strip()[:500] or "no body"
        response = error(503, f"vLLM's router or a proxy answered {status} ({message}); retry in "
                              f"{RETRY_AFTER_S} s", "server_error")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = str(body["error"].get("message") or f"vLLM answered {status}")
        return JSONResponse({**body, "detail": body.get("detail", message)}, status_code=status)
    if isinstance(body, dict) and "detail" in body:  # FastAPI's own shape (vLLM's 404 for an unknown route)
        message = body["detail"] if isinstance(body["detail"], str) else json.dumps(body["detail"])
    else:
        message = content.decode("utf-8", "replace").strip()[:2000] or f"vLLM answered {status} with no body"
    return error(status, f"vLLM: {message}", "server_error" if status >= 500 else "invalid_request_error")


def outage(exc: BaseException) -> JSONResponse | None:
    """503 naming the dependency ``exc`` says is down, with ``Retry-After`` (``None``: not an outage)."""
    dependency = OUTAGES.dependency_of(exc)
    if dependency is None:
        return None
    OUTAGES.failed(dependency, exc)
    hint = "; see /ready" if dependency == "vllm" else ""
    response = error(503, f"{NAMES[dependency]} is not answering ({type(exc).__name__}); retry in {RETRY_AFTER_S} s"
                          f"{hint}", "server_error")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


#: Routes answered by vLLM: their success ends a vLLM outage.
_VLLM_ROUTES = ("/v1/chat/", "/v1/completions")


def _allowed_methods(request: Request) -> str:
    """The methods of every route of the app whose path matches the request's, ``", "``-joined
    (``""`` when one takes the request's method too: the 405 was not the router's)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        match = route.matches(request.scope)[0]
        if match == Match.FULL:
            return ""
        if match == Match.PARTIAL:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


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
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and "Allow" in headers:  # the router's: Allow names every method of the
            allow = _allowed_methods(request)  # path (RFC 9110, 15.5.6); Starlette's, those of its first route
            if allow:
                headers["Allow"] = allow
                message = f"{request.method} is not a method of {request.url.path}: it takes {allow}"
        response = error(exc.status_code, message, "not_found_error" if exc.status_code == 404 else
                         "invalid_request_error")
        response.headers.update(headers)
        return response

    @app.exception_handler(MemoryNotFoundError)
    @app.exception_handler(UnknownScopeError)
    async def not_found(request: Request, exc: KeyError) -> JSONResponse:
        return error(404, str(exc.args[0]) if exc.args else str(exc), "not_found_error")

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_input(request: Request, exc: Exception) -> JSONResponse:
        return outage(exc) or error(400, str(exc))  # chromadb says "could not connect" as a ValueError

    @app.exception_handler(httpx.HTTPError)
    async def upstream_down(request: Request, exc: httpx.HTTPError) -> JSONResponse:
        return outage(exc) or error(503, f"vLLM's server is not answering ({type(exc).__name__}); see /ready",
                                    "server_error")

    @app.exception_handler(Exception)
    async def dependency_down(request: Request, exc: Exception) -> JSONResponse:
        # anything else is a bug: 500, and Starlette re-raises it after this answer, so the
        # server logs its traceback
        return outage(exc) or error(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")


class BugsAnswered:
    """The innermost of the front's middlewares (add it before the others): an exception no
    handler took is answered here, a 503 naming the dependency that is down (:func:`outage`) or
    a 500 in the front's shape, and a bug's traceback is logged once (``uvicorn.error``, as
    uvicorn logs). Left to Starlette's outermost handler, it was re-raised through every
    middleware on the way out and logged as a chain of the same traceback (issue 53). An
    exception after the answer began (a stream) cannot be answered: it goes on up, as before."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # noqa: BLE001 - every bug gets an answer and one log entry
            if started:
                raise
            response = outage(exc)
            if response is None:
                logging.getLogger("uvicorn.error").error("%s %s failed: %s: %s", scope.get("method"),
                                                         scope.get("path"), type(exc).__name__, exc, exc_info=exc)
                response = error(500, f"internal error ({type(exc).__name__}); see the server log", "server_error")
            await response(scope, receive, send)


def install_outage_watch(app: FastAPI) -> None:
    """After a request that succeeded while an outage lasts, probe the dependencies that are
    down (:meth:`~inferscale.runtime.outages.Outages.recheck`); a chat answered ends a vLLM
    outage. Each outage that ends logs one line."""

    @app.middleware("http")
    async def outages_end(request: Request, call_next):
        response = await call_next(request)
        if response.status_code < 400 and OUTAGES.down():
            if request.url.path.startswith(_VLLM_ROUTES):
                OUTAGES.ok("vllm")
            await run_in_threadpool(OUTAGES.recheck)
        return response
