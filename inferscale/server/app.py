"""InferScale's HTTP front (FastAPI), in front of vLLM's own OpenAI server.

Routes:
    ``POST /v1/chat/completions``  chat with memory (:mod:`inferscale.server.chat`), streamed or not
    ``POST /v1/completions``, ``GET /v1/models``  vLLM's, passed through
    Mem0-style memory routes (:mod:`inferscale.server.memories`)
    ``GET /health``  the front is up (no key needed); ``GET /ready``  vLLM answers too
    ``GET /metrics``  vLLM's Prometheus metrics (the connector's ``vllm:inferscale_*``
    counters among them; with several replicas, labelled ``replica``) followed by the
    front's ``inferscale_*`` ones
    ``GET /docs``  OpenAPI documentation

Every response carries ``X-InferScale-Worker`` (the front process's pid); chat and
completion responses carry ``X-InferScale-Replica`` (the index of the vLLM replica that
answered: a scope's requests go to one replica, :mod:`inferscale.server.upstream`).

Errors are JSON ``{"error": {"message", "type", "code"}}`` (OpenAI's shape): 400 for bad
input, 401 for a missing or wrong API key, 404 for an unknown memory or route, 422 for a
body that does not fit a route's schema (FastAPI's validation message); vLLM's own
errors pass through with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import time
from typing import Any, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale.kv.injection import injected_tokens
from inferscale.server import memories
from inferscale.server.chat import (
    ChatPlan,
    ChatRequestError,
    MemoryOptions,
    check_messages,
    forward_body,
    request_scope,
    split_messages,
)
from inferscale.server.upstream import Replicas
from inferscale.types import MemoryNotFoundError, UnknownScopeError

#: Largest request body accepted (bytes): 16 MiB, far above any prompt that fits a context.
MAX_BODY_BYTES = 16 << 20
#: routes answered without an API key (liveness probes carry no data)
_OPEN_PATHS = frozenset({"/health"})


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class FrontMetrics:
    """The front's Prometheus counters (a registry of its own, appended to vLLM's ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("inferscale_chat_requests", "chat requests, by memory mode", ["mode"],
                                registry=self.registry)
        self.memories = Counter("inferscale_chat_memories", "memories placed in chat prompts, by how: 'kv' "
                                "(injected) or 'text' (prefilled)", ["source"], registry=self.registry)
        self.kv_tokens = Counter("inferscale_chat_planned_kv_tokens", "prompt tokens planned as KV",
                                 registry=self.registry)
        self.injected = Counter("inferscale_chat_injected_tokens", "prompt tokens the connector injected "
                                "(non-streamed responses)", registry=self.registry)
        self.prepare = Histogram("inferscale_chat_prepare_seconds", "retrieval and memory-block layout per request",
                                 registry=self.registry)

    def observe(self, plan: ChatPlan, prepare_s: float) -> None:
        self.requests.labels(plan.mode).inc()
        if plan.block is not None:
            self.memories.labels("kv").inc(len(plan.block.kv_memory_ids))
            self.memories.labels("text").inc(len(plan.block.text_memory_ids))
            if plan.block.plan is not None:
                self.kv_tokens.inc(plan.block.memory_tokens)
            self.prepare.observe(prepare_s)


def create_app(memory: Any, upstream: Replicas, *, api_key: str | None = None,
               on_close: Callable[[], None] | None = None) -> FastAPI:
    """The front's FastAPI app.

    Args:
        memory: the :class:`inferscale.Memory` whose data dir the replicas' connector reads.
        upstream: vLLM's OpenAI server(s).
        api_key: when set, every route but ``/health`` requires ``Authorization: Bearer <key>``.
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
    app.state.metrics = metrics = FrontMetrics()
    default_max_tokens = memory.config.default_max_tokens  # for chats that send no max_tokens
    worker = str(os.getpid())

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _error(413, f"the request body is {int(length)} bytes; the most accepted is {MAX_BODY_BYTES}",
                          "invalid_request_error")
        if api_key and request.url.path not in _OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              "authentication_error")
        return await call_next(request)

    @app.middleware("http")  # added last, so it runs outermost: 401 and 413 answers carry it too
    async def name_worker(request: Request, call_next):
        response = await call_next(request)
        response.headers["x-inferscale-worker"] = worker
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            return _error(400, "the request body is not valid JSON")
        parts = ["{}: {}".format(".".join(str(p) for p in e.get("loc", ())), e.get("msg")) for e in exc.errors()]
        return _error(422, "invalid request: " + "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message, "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(MemoryNotFoundError)
    @app.exception_handler(UnknownScopeError)
    async def not_found(request: Request, exc: KeyError) -> JSONResponse:
        return _error(404, str(exc.args[0]) if exc.args else str(exc), "not_found_error")

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_input(request: Request, exc: Exception) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(httpx.HTTPError)
    async def upstream_down(request: Request, exc: httpx.HTTPError) -> JSONResponse:
        return _error(503, f"the model server is not answering ({type(exc).__name__}); see /ready", "server_error")

    @app.get("/health", tags=["server"], summary="The front is up")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", tags=["server"], summary="The front and vLLM are ready")
    async def ready() -> Response:
        answering = await upstream.health()
        if any(answering):
            return JSONResponse({"status": "ready", "replicas": answering})
        return _error(503, "vLLM's server is not ready" if len(answering) == 1 else
                      "none of the vLLM replicas is ready", "server_error")

    @app.get("/metrics", tags=["server"], summary="Prometheus metrics: vLLM's, then the front's")
    async def prometheus() -> Response:
        text = await upstream.metrics() + generate_latest(metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["openai"], summary="vLLM's models")
    async def models() -> Response:
        _, r = await upstream.send("", "GET", "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions", tags=["openai"], summary="vLLM's completions, without memory")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        body = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "cache_salt")}
        key = _route_key(body, request.headers)
        return await _until_disconnected(request, _forward(upstream, key, "/v1/completions", body, None, metrics))

    @app.post("/v1/chat/completions", tags=["openai"], summary="Chat with memory")
    async def chat(request: Request) -> Response:
        body = await _json_body(request)
        options = _memory_options(body.get("memory"))
        messages = check_messages(body)
        t0 = time.perf_counter()
        if options.mode == "none":
            plan = ChatPlan(forward_body(body, None, None, default_max_tokens), None, "none")
            key = _route_key(body, request.headers)
        else:
            scope = request_scope(body, request.headers)
            key = scope.key
            instructions, rest, query = split_messages(messages)
            block = await run_in_threadpool(_memory_block, memory, scope, query, options, instructions)
            plan = ChatPlan(forward_body(body, block, rest, default_max_tokens), block, options.mode)
        metrics.observe(plan, time.perf_counter() - t0)
        if "model" not in plan.body:
            plan.body["model"] = await upstream.model_name()
        return await _until_disconnected(
            request, _forward(upstream, key, "/v1/chat/completions", plan.body, plan, metrics))

    app.include_router(memories.router())
    return app


def _route_key(body: dict, headers: Any) -> str:
    """The replica routing key of a request without memory: its scope's key when it names
    one (so a user's requests share a replica whatever their mode), else a fresh random key
    (requests of nobody in particular spread over the replicas)."""
    try:
        return request_scope(body, headers).key
    except ChatRequestError:
        return os.urandom(8).hex()


def _memory_options(value: Any) -> MemoryOptions:
    try:
        return MemoryOptions.model_validate({} if value is None else value)
    except ValidationError as exc:
        parts = ["memory.{}: {}".format(".".join(str(p) for p in e["loc"]), e["msg"]) if e["loc"] else e["msg"]
                 for e in exc.errors()]
        raise ChatRequestError("invalid 'memory' field: " + "; ".join(parts)) from None


def _memory_block(memory: Any, scope, query: str, options: MemoryOptions, instructions: str | None):
    return memory.memory_block(query, **scope.as_dict(), instructions=instructions,
                               mode="inject" if options.mode == "inject" else "text", k=options.k,
                               context_window=options.context_window, wait_for_kv=options.wait_for_kv)


def _no_constant(name: str):
    raise ChatRequestError(f"the request body holds {name}, which is not JSON: send a number or null")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ChatRequestError(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ChatRequestError("the request body is nested too deeply to read: flatten it") from None
    if not isinstance(body, dict):
        raise ChatRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("stream", False), bool):
        raise ChatRequestError(f"'stream' must be true or false, got {body['stream']!r:.40}")
    return body


async def _until_disconnected(request: Request, work):
    """Await ``work``; cancel it (closing the request to vLLM, which then aborts it) when the
    client goes away first."""
    import asyncio

    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _forward(upstream: Replicas, key: str, path: str, body: dict, plan: ChatPlan | None,
                   metrics: FrontMetrics) -> Response:
    """Send ``body`` to routing key ``key``'s vLLM replica; a streamed answer is relayed as it
    comes, with the memory report in its first chunk; a whole one gets it as a ``memory``
    field. Both carry it in ``X-InferScale-*`` headers too (clients that drop unknown body
    fields, such as LangChain's ``ChatOpenAI``, can read those: ``include_response_headers=True``)."""
    stream = bool(body.get("stream"))
    replica, r = await upstream.send(key, "POST", path, json=body, stream=stream)
    headers = {"x-inferscale-replica": str(replica.index)}
    if plan is not None:
        headers.update(plan.headers())
    if not stream:
        if r.status_code != 200 or plan is None:
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                            headers=headers)
        out = r.json()
        injected = injected_tokens(out.pop("kv_transfer_params", None))
        metrics.injected.inc(injected)
        out["memory"] = {**plan.report(injected), "replica": replica.index}
        return JSONResponse(out, headers={**headers, "x-inferscale-injected-tokens": str(injected)})
    resp = r
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                        headers=headers)

    async def relay():
        first = plan is not None
        try:
            async for line in resp.aiter_lines():
                if first and line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    chunk["memory"] = {**plan.report(None), "replica": replica.index}
                    line, first = "data: " + json.dumps(chunk), False
                yield line + "\n"
        finally:
            await resp.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

