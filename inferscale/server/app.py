"""InferScale's HTTP front (FastAPI), in front of vLLM's own OpenAI server.

Routes:
    ``POST /v1/chat/completions``  chat with memory (:mod:`inferscale.server.chat`), streamed or not
    ``POST /v1/completions``, ``GET /v1/models``  vLLM's, passed through
    Mem0-style memory routes (:mod:`inferscale.server.memories`)
    Mem0's Platform API for Mem0's own clients: ``/v1/ping/``, ``/v1/memories/``, ``/v3/memories/add/``
    and the rest (:mod:`inferscale.server.mem0_platform`)
    ``GET /health``  the front is up; ``GET /ready``  vLLM answers too (neither needs the key)
    ``GET /metrics``  vLLM's Prometheus metrics (the connector's ``vllm:inferscale_*``
    counters among them; with several replicas, labelled ``replica``) followed by the
    front's ``inferscale_*`` ones
    ``GET /docs``  OpenAPI documentation

Every response carries ``X-InferScale-Worker`` (the front process's pid); chat and
completion responses carry ``X-InferScale-Replica`` (the index of the vLLM replica that
answered: a scope's requests go to one replica, :mod:`inferscale.server.upstream`).

Errors are JSON ``{"error": {"message", "type", "code"}, "detail"}`` (OpenAI's shape, and Mem0's
``detail`` holding the same message): 400 for bad
input, 401 for a missing or wrong API key, 404 for an unknown memory or route, 422 for a
body that does not fit a route's schema (FastAPI's validation message); vLLM's own
errors pass through with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from typing import Callable

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from inferscale.memory import Memory
from inferscale.server import mem0_platform, memories, openai_routes, ops
from inferscale.server.errors import error, install_error_handlers, install_outage_watch
from inferscale.server.metrics import FrontMetrics
from inferscale.server.upstream import Replicas

#: Largest request body accepted (bytes): 16 MiB, far above any prompt that fits a context.
MAX_BODY_BYTES = 16 << 20
#: routes answered without an API key (liveness probes carry no data)
_OPEN_PATHS = frozenset({"/health", "/ready"})  # a load balancer's probe sends no key


class BodyLimit:
    """ASGI middleware: reads a request's body before the app does and answers 413 once it
    passes ``limit`` bytes, so a body sent in chunks (no ``Content-Length``, which the key
    middleware checks up front) is cut off before any of it is parsed. The app then reads the
    buffered body; later ``receive`` calls (disconnects, while streaming) go to the server."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                response = error(413, f"the request body is over {self.limit} bytes, the most accepted",
                                 "invalid_request_error")
                return await response(scope, receive, send)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list, receive):
    """A ``receive`` that gives ``messages`` first, then the server's."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def create_app(memory: Memory, upstream: Replicas, *, api_key: str | None = None,
               on_close: Callable[[], None] | None = None) -> FastAPI:
    """The front's FastAPI app: its state (the memory, the replicas, the counters), the key
    and size checks, the error handlers, and the routers (:mod:`~inferscale.server.openai_routes`,
    :mod:`~inferscale.server.memories`, :mod:`~inferscale.server.ops`).

    Args:
        memory: the :class:`inferscale.Memory` whose data dir the replicas' connector reads.
        upstream: vLLM's OpenAI server(s).
        api_key: when set, every route but ``/health`` and ``/ready`` requires ``Authorization: Bearer <key>``
            (or ``Token <key>``, as Mem0's clients send it).
        on_close: called when the app shuts down (after the replicas' clients are closed).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # with several replicas, a hung one is passed over (with one there is nowhere else to go)
        watch = asyncio.create_task(upstream.watch()) if len(upstream) > 1 else None
        yield
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await upstream.aclose()
        if on_close is not None:
            await run_in_threadpool(on_close)

    app = FastAPI(title="InferScale", description="Memory for LLM agents, served as precomputed KV through vLLM.",
                  version="0.1.0", lifespan=lifespan)
    app.state.memory = memory
    app.state.upstream = upstream
    app.state.metrics = FrontMetrics(memory.kv_stats)
    worker = str(os.getpid())

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error(413, f"the request body is {int(length)} bytes; the most accepted is {MAX_BODY_BYTES}",
                         "invalid_request_error")
        if api_key and request.url.path not in _OPEN_PATHS:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() not in ("bearer", "token") or not hmac.compare_digest(given.encode(), api_key.encode()):
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or Mem0's "
                             "'Authorization: Token <key>')", "authentication_error")
        return await call_next(request)

    install_outage_watch(app)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.middleware("http")  # added last, so it runs outermost: 401 and 413 answers carry it too
    async def name_worker(request: Request, call_next):
        response = await call_next(request)
        response.headers["x-inferscale-worker"] = worker
        return response

    install_error_handlers(app)
    app.include_router(ops.router())
    app.include_router(openai_routes.router())
    app.include_router(memories.router())
    app.include_router(mem0_platform.router())  # last: it answers every other /v1/, /v2/, /v3/ path
    return app
