"""InferScale's HTTP front (FastAPI), in front of vLLM's own OpenAI server.

Routes:
    ``POST /v1/chat/completions``  chat with memory (:mod:`inferscale.server.chat`), streamed or not
    ``POST /v1/completions``, ``GET /v1/models``  vLLM's, passed through
    Mem0-style memory routes (:mod:`inferscale.server.memories`)
    Mem0's Platform API for Mem0's own clients: ``/v1/ping/``, ``/v1/memories/``, ``/v3/memories/add/``
    and the rest (:mod:`inferscale.server.mem0_platform`)
    ``/mcp``  the memory tools over MCP's streamable HTTP transport (:mod:`inferscale.mcp_server`)
    ``GET /health``  the front is up; ``GET /ready``  vLLM answers too (neither needs the key)
    ``GET /metrics``  vLLM's Prometheus metrics (the connector's ``vllm:inferscale_*``
    counters among them; with several replicas, labelled ``replica``) followed by the
    front's ``inferscale_*`` ones
    ``GET /docs``  OpenAPI documentation
    ``GET /ui``  a page of scopes, memories, their KV, chats and the pool (its files need no key;
    its data routes under ``/ui/api/`` do: :mod:`inferscale.server.ui`)

Every response to a client that sent the key (or every response, where no key is set) carries
``X-InferScale-Worker`` (the front process's pid); a whole (not streamed) chat with memory
carries ``X-InferScale-Replica``, the index of the vLLM replica that answered, as its
connector reports it (vLLM's router sends a scope's requests to one replica:
:mod:`inferscale.server.upstream`).

Errors are JSON ``{"error": {"message", "type", "code"}, "detail"}`` (OpenAI's shape, and Mem0's
``detail`` holding the same message): 400 for bad
input, 401 for a missing or wrong API key, 404 for an unknown memory or route, 422 for a
body that does not fit a route's schema (FastAPI's validation message); vLLM's own
errors pass through with its status. The key, then the announced body size, are checked
before any body byte is read; heads and bodies too large or too slow are cut with
431/413/408 (:mod:`inferscale.server.limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Callable
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from inferscale.mcp_server.answers import UpstreamAnswers
from inferscale.mcp_server.app import HttpEndpoint
from inferscale.mcp_server.tools import MemoryTools
from inferscale.memory import Memory
from inferscale.server import mem0_platform, memories, openai_routes, ops, ui
from inferscale.server.errors import BugsAnswered, install_error_handlers, install_outage_watch
from inferscale.server.limits import AUTHORIZED, FrontLimits, RequestGate
from inferscale.server.metrics import FrontMetrics
from inferscale.server.pool_history import PoolHistory
from inferscale.server.upstream import Upstream

#: routes answered without an API key (liveness probes carry no data)
_OPEN_PATHS = frozenset({"/health", "/ready"})  # a load balancer's probe sends no key


def relative_location(location: str) -> str:
    """``location`` as a path on this server: scheme and host dropped (Starlette builds the
    redirect to a path's ``/`` from the request's ``Host`` and ``X-Forwarded-Proto``, which the
    client chooses: ``Location: https://evil.example/memories``). RFC 9110 section 10.2.2
    allows a relative reference."""
    parts = urlsplit(location)
    if not (parts.scheme or parts.netloc):
        return location
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def create_app(memory: Memory, upstream: Upstream, *, api_key: str | None = None,
               on_close: Callable[[], None] | None = None, limits: FrontLimits | None = None) -> FastAPI:
    """The front's FastAPI app: its state (the memory, the replicas, the counters), the key
    and size checks, the error handlers, and the routers (:mod:`~inferscale.server.openai_routes`,
    :mod:`~inferscale.server.memories`, :mod:`~inferscale.server.ops`).

    Args:
        memory: the :class:`inferscale.Memory` whose data dir the replicas' connector reads.
        upstream: vLLM's OpenAI server(s).
        api_key: when set, every route but ``/health`` and ``/ready`` requires ``Authorization: Bearer <key>``
            (or ``Token <key>``, as Mem0's clients send it).
        on_close: called when the app shuts down (after the replicas' clients are closed).
        limits: the request body's size and time limits (default :class:`FrontLimits`'s);
            the head's are the server's (:func:`~inferscale.server.limits.uvicorn_config`).
    """
    limits = limits or FrontLimits()
    mcp = HttpEndpoint(MemoryTools(memory, UpstreamAnswers(memory, upstream)))
    pool = memory.components.pool
    history = PoolHistory(memory.kv_stats, {"device": pool.device_budget_bytes, "host": pool.host_budget_bytes,
                                            "disk": pool.disk_budget_bytes})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sampler = asyncio.create_task(history.run())  # the pool over time, for the page at /ui
        async with mcp.running():  # MCP's session manager lives as long as the app
            yield
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await upstream.aclose()
        if on_close is not None:
            await run_in_threadpool(on_close)

    app = FastAPI(title="InferScale", description="Memory for LLM agents, served as precomputed KV through vLLM.",
                  version="0.1.0", lifespan=lifespan)
    app.state.memory = memory
    app.state.upstream = upstream
    app.state.metrics = FrontMetrics(memory.kv_stats)
    worker = str(os.getpid())

    app.add_middleware(BugsAnswered)  # first, so innermost: a bug is answered and logged once
    install_outage_watch(app)

    @app.middleware("http")  # the worker's pid only to a client that sent the key (or where none is needed)
    async def name_worker(request: Request, call_next):
        response = await call_next(request)
        if request.scope.get(AUTHORIZED):
            response.headers["x-inferscale-worker"] = worker
        if "location" in response.headers:  # Starlette's slash redirects are built from the client's Host
            response.headers["location"] = relative_location(response.headers["location"])
        return response

    # added last, so it runs outermost: the key and the announced size before any body byte is read
    app.add_middleware(RequestGate, api_key=api_key, limits=limits, open_paths=_OPEN_PATHS | ui.UI_PATHS)
    install_error_handlers(app)
    app.include_router(ops.router())
    app.include_router(openai_routes.router())
    app.include_router(memories.router())
    app.include_router(ui.router(history))
    app.add_route("/mcp", mcp, include_in_schema=False)  # behind the gate's key check like every route
    app.include_router(mem0_platform.router())  # last: it answers every other /v1/, /v2/, /v3/ path
    return app
