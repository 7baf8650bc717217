"""The OpenAI routes of the front: chat with memory, and vLLM's own routes passed through.

``POST /v1/chat/completions`` retrieves the scope's memory (:mod:`inferscale.server.chat`),
puts the memory system turn in front of the client's messages and forwards the request to
the scope's vLLM replica with the injection plan; ``POST /v1/completions`` and
``GET /v1/models`` are vLLM's, passed through. Every chat or completion response carries
``X-InferScale-Replica`` (the replica that answered).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from typing import Any, ContextManager

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from inferscale.kv.injection import cache_salt, injected_tokens, reported_replica
from inferscale.memory import Memory
from inferscale.server.bodies import PARSED_BODY, read_body
from inferscale.server.chat import (
    ChatPlan,
    ChatRequestError,
    MemoryOptions,
    check_messages,
    forward_body,
    request_scope,
    split_messages,
    without_server_fields,
)
from inferscale.server.chat_report import ChatReport
from inferscale.server.errors import upstream_error
from inferscale.server.deps import MemoryDep, MetricsDep, UpstreamDep
from inferscale.server.metrics import FrontMetrics
from inferscale.server.upstream import Upstream
from inferscale.server.query import StrictQueryRoute


def router() -> APIRouter:
    """The OpenAI routes (their memory, replicas and counters come from the app's state)."""
    r = APIRouter(tags=["openai"], route_class=StrictQueryRoute)

    @r.get("/v1/models", summary="vLLM's models")
    async def models(upstream: UpstreamDep) -> Response:
        resp = await upstream.send(None, "GET", "/v1/models")
        if resp.status_code != 200:
            return upstream_error(resp.status_code, resp.content)
        listing = resp.json()
        for card in listing.get("data", ()):  # vLLM's "root" is the model's folder: a path on the server
            card["root"] = card.get("id")
        return JSONResponse(listing)

    @r.post("/v1/completions", summary="vLLM's completions, without memory")
    async def completions(request: Request, memory: MemoryDep, upstream: UpstreamDep, metrics: MetricsDep) -> Response:
        body = await _json_body(request)
        body = without_server_fields(body)
        key = _route_key(body, request.headers)
        return await _until_disconnected(request, _forward(upstream, key, "/v1/completions", body, None, metrics,
                                                           memory.pinned_kv(())))  # in flight: the encoder waits

    @r.post("/v1/chat/completions", summary="Chat with memory")
    async def chat(request: Request, memory: MemoryDep, upstream: UpstreamDep, metrics: MetricsDep) -> Response:
        body = await _json_body(request)
        options = _memory_options(body.get("memory"))
        messages = check_messages(body, memory.components.requests.check_prompt_chars)
        default_max_tokens = memory.config.default_max_tokens  # for chats that send no max_tokens
        t0 = time.perf_counter()
        report = None
        if options.mode == "none":
            plan = ChatPlan(forward_body(body, None, None, default_max_tokens), None, "none")
            key = _route_key(plan.body, request.headers)
        else:
            scope = request_scope(body, request.headers)
            key = scope.key
            instructions, rest, query = split_messages(messages)
            block = await run_in_threadpool(_memory_block, memory, scope, query, options, instructions)
            plan = ChatPlan(forward_body(body, block, rest, default_max_tokens), block, options.mode)
            report = ChatReport(memory, scope.key, query, plan, t0)  # what it used: for the page at /ui
        metrics.observe(plan, time.perf_counter() - t0)
        if "model" not in plan.body:
            plan.body["model"] = await upstream.model_name()
        planned = plan.block.plan if plan.block is not None else None
        # held for every chat, with or without KV: a request in flight, which the encoder waits for
        pins = memory.pinned_kv(planned.keys if planned is not None else ())
        return await _until_disconnected(
            request, _forward(upstream, key, "/v1/chat/completions", plan.body, plan, metrics, pins, report))

    return r


def _route_key(body: dict, headers: Any) -> str:
    """The replica routing key of a request without memory: its scope's key when it names
    one (so a user's requests share a replica whatever their mode), else a fresh random key
    (requests of nobody in particular spread over the replicas).

    A request that names a scope also gets the scope's prefix-cache salt in ``body``
    (:func:`inferscale.kv.injection.cache_salt`): its prompt is that user's, and another
    scope's request must not learn it from ``cached_tokens``."""
    try:
        scope = request_scope(body, headers)
    except ChatRequestError:
        return os.urandom(8).hex()
    body["cache_salt"] = cache_salt(scope.key, None)
    return scope.key


def _memory_options(value: Any) -> MemoryOptions:
    try:
        return MemoryOptions.model_validate({} if value is None else value)
    except ValidationError as exc:
        parts = ["memory.{}: {}".format(".".join(str(p) for p in e["loc"]), e["msg"]) if e["loc"] else e["msg"]
                 for e in exc.errors()]
        raise ChatRequestError("invalid 'memory' field: " + "; ".join(parts)) from None


def _memory_block(memory: Memory, scope, query: str, options: MemoryOptions, instructions: str | None):
    return memory.memory_block(query, **scope.as_dict(), instructions=instructions,
                               mode="inject" if options.mode == "inject" else "text", k=options.k,
                               context_window=options.context_window, wait_for_kv=options.wait_for_kv,
                               text_tail=options.text_tail, memory_order=options.memory_order)


async def _json_body(request: Request) -> dict:
    """The body as the gate read it (:mod:`inferscale.server.bodies`: one strict reading); an app
    served without the gate (tests of the routes alone) reads it with the same reader."""
    if PARSED_BODY in request.scope:
        body = request.scope[PARSED_BODY]
    else:
        verdict = read_body(await request.body(), b"application/json")
        if verdict.status or not verdict.parsed:
            raise ChatRequestError(verdict.message or "the request body is empty: send a JSON object")
        body = verdict.value
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


async def _forward(upstream: Upstream, key: str, path: str, body: dict, plan: ChatPlan | None,
                   metrics: FrontMetrics, pins: ContextManager | None = None, report: ChatReport | None = None
                   ) -> Response:
    """Send ``body`` to routing key ``key``'s vLLM replica; a streamed answer is relayed as it
    comes, with the memory report in its first chunk; a whole one gets it as a ``memory``
    field. Both carry it in ``X-InferScale-*`` headers too (clients that drop unknown body
    fields, such as LangChain's ``ChatOpenAI``, can read those: ``include_response_headers=True``).
    ``pins`` (the request's KV kept from eviction) is held until the answer is whole; ``report``
    (a chat with memory) is written to the chat log once it is."""
    stack = ExitStack()
    if pins is not None:
        stack.enter_context(pins)
    try:
        response = await _send(upstream, key, path, body, plan, metrics, stack, report)
    except BaseException:
        stack.close()
        raise
    if not isinstance(response, StreamingResponse):
        stack.close()
    return response


async def _send(upstream: Upstream, key: str, path: str, body: dict, plan: ChatPlan | None,
                metrics: FrontMetrics, stack: ExitStack, report: ChatReport | None = None) -> Response:
    """:func:`_forward`'s work; a streamed answer closes ``stack`` when its relay ends."""
    stream = bool(body.get("stream"))
    r = await upstream.send(key, "POST", path, json=body, stream=stream)
    headers = plan.headers() if plan is not None else {}
    if not stream:
        if r.status_code != 200 or plan is None:
            if report is not None:
                await report.write(r.status_code, None)
            if r.status_code >= 400:  # vLLM's error (or its router's), with the front's detail
                answer = upstream_error(r.status_code, r.content)
                answer.headers.update(headers)
                return answer
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                            headers=headers)
        out = r.json()
        returned = out.pop("kv_transfer_params", None)
        injected, replica = injected_tokens(returned), reported_replica(returned)
        metrics.injected.inc(injected)
        out["memory"] = {**plan.report(injected), "replica": replica}
        if replica is not None:  # the replica that answered, as its connector says (inferscale serve's replicas)
            headers["x-inferscale-replica"] = str(replica)
        written = None
        if report is not None:  # written after the answer is sent: the client does not wait for it
            report.usage(out.get("usage") or {})
            report.finish(200, replica, injected)
            written = BackgroundTask(report.write)
        return JSONResponse(out, headers={**headers, "x-inferscale-injected-tokens": str(injected)},
                            background=written)
    resp = r
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        if report is not None:
            await report.write(resp.status_code, None)
        if resp.status_code >= 400:
            answer = upstream_error(resp.status_code, content)
            answer.headers.update(headers)
            return answer
        return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                        headers=headers)

    async def relay():
        first = plan is not None
        async for line in resp.aiter_lines():
            if report is not None:
                report.stream_line(line)
            if first and line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                chunk["memory"] = {**plan.report(None), "replica": None}  # a stream does not say
                line, first = "data: " + json.dumps(chunk), False
            yield line + "\n"

    async def finish():
        await resp.aclose()
        stack.close()
        if report is not None:  # after the last byte: the client does not wait for it
            await report.write(200, None)

    return Relay(relay(), finish, media_type="text/event-stream", headers=headers)


class Relay(StreamingResponse):
    """A streamed answer relayed from vLLM whose ``finish`` (closing the upstream response,
    releasing the request's KV pins) runs however the response ends: relayed whole, the
    client gone in the middle, or gone before the first byte, when the body iterator never
    starts and so its own ``finally`` would never run.

    Args:
        body: the async iterator of lines sent to the client.
        finish: awaited once when the response ends (also on errors and cancellation).
    """

    def __init__(self, body, finish, **kwargs) -> None:
        super().__init__(body, **kwargs)
        self._finish = finish

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[union-attr]
            finally:
                await self._finish()

