"""How the ``answer`` tool answers: a question, the scope's memories as KV, the answer's text
and which memories came as KV and which as text.

Two ways, one result (:class:`Answer`):

- :class:`LocalAnswers` (``inferscale mcp``): :meth:`inferscale.Memory.generate` on the
  memory's own vLLM engine (started by the first answer: about a minute on a CPU);
- :class:`UpstreamAnswers` (``inferscale serve``'s ``/mcp``): the front's own path, the memory
  block (:meth:`inferscale.Memory.memory_block`) as the system turn of a chat request sent to
  the scope's vLLM replica with the injection plan, as ``POST /v1/chat/completions`` does.

Both run the memory's sync calls on a worker thread, so the event loop keeps serving.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Protocol

import anyio.to_thread
from mcp.server.mcpserver.exceptions import ToolError

from inferscale.kv.injection import injected_tokens
from inferscale.runtime.outages import OUTAGES
from inferscale.store.records import Scope
from inferscale.types import UnknownScopeError


@dataclass(frozen=True)
class Answer:
    """One answer with memory.

    Attributes:
        text: the answer.
        memories: the memories retrieved for it, best first (Mem0 items: ``id``, ``memory``,
            ``score``, ``metadata``, ...).
        kv_memory_ids: memories whose precomputed KV was injected.
        text_memory_ids: memories prefilled as text (their KV not encoded yet, or evicted).
        kv_sources: per memory id, where its KV came from or why it came as text
            (:data:`inferscale.generation.request.KV_SOURCES`).
        injected_tokens: prompt tokens supplied as KV (fewer than planned when vLLM's prefix
            cache already held some).
    """

    text: str
    memories: list[dict] = field(default_factory=list)
    kv_memory_ids: list[str] = field(default_factory=list)
    text_memory_ids: list[str] = field(default_factory=list)
    kv_sources: dict[str, str] = field(default_factory=dict)
    injected_tokens: int = 0


class Answers(Protocol):
    """What the ``answer`` tool calls (both classes below)."""

    async def __call__(self, question: str, scope: Scope, k: int | None, max_tokens: int,
                       wait_for_kv: bool = False) -> Answer: ...


class LocalAnswers:
    """Answers on the memory's own engine (:meth:`inferscale.Memory.generate`, inject mode).

    Args:
        memory: an :class:`inferscale.Memory` (anything with its ``generate``).
    """

    def __init__(self, memory: Any) -> None:
        self.memory = memory

    async def __call__(self, question: str, scope: Scope, k: int | None, max_tokens: int,
                       wait_for_kv: bool = False) -> Answer:
        """Answer ``question`` with ``scope``'s top-``k`` memories (``None``: the memory's
        ``top_k``), at most ``max_tokens`` tokens; ``wait_for_kv``: encode the KV of retrieved
        memories that have none yet first (:class:`~inferscale.generation.options.GenerationOptions`).

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            ValueError / TypeError: as :meth:`inferscale.Memory.generate`.
        """
        g = await anyio.to_thread.run_sync(functools.partial(
            self.memory.generate, question, **scope.as_dict(), k=k, max_tokens=max_tokens, mode="inject",
            wait_for_kv=wait_for_kv))
        return Answer(g.text, list(g.memories), list(g.kv_memory_ids), list(g.text_memory_ids), dict(g.kv_sources),
                      g.num_injected_tokens)


class Upstream(Protocol):
    """What :class:`UpstreamAnswers` needs of the front's replicas (:class:`inferscale.server.upstream.Upstream`)."""

    async def model_name(self) -> str: ...

    async def send(self, scope_key: str | None, method: str, path: str, *, json: dict | None = None,
                   stream: bool = False) -> Any: ...


class _BlockMemory(Protocol):
    def count(self, **scope: str) -> int: ...

    def count_turns(self, **scope: str) -> int: ...

    def memory_block(self, query: str, **kwargs: Any) -> Any: ...

    def pinned_kv(self, keys: Iterable[str]) -> ContextManager[None]: ...


class UpstreamAnswers:
    """Answers on the front's vLLM servers: the memory block as the chat's system turn, the
    question as its user turn, the plan's KV injected by the replica's connector (what
    ``POST /v1/chat/completions`` does for a chat with memory).

    Args:
        memory: the front's :class:`inferscale.Memory` (its data dir is the replicas' KV pool).
        upstream: the front's :class:`~inferscale.server.upstream.Upstream`.
    """

    def __init__(self, memory: _BlockMemory, upstream: Upstream) -> None:
        self.memory, self.upstream = memory, upstream

    async def __call__(self, question: str, scope: Scope, k: int | None, max_tokens: int,
                       wait_for_kv: bool = False) -> Answer:
        """As :meth:`LocalAnswers.__call__`.

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            ValueError / TypeError: an empty question, a memory block too long for the context.
            httpx.HTTPError: no replica answered (the tool reports vLLM's outage).
            ToolError: vLLM answered with an error (its status and message).
        """
        from inferscale.server.chat import forward_body  # the chat route's own request, one code path

        block = await anyio.to_thread.run_sync(self._block, question, scope, k, wait_for_kv)
        turn = [{"role": "user", "content": question}]
        body = forward_body({"messages": turn, "max_tokens": max_tokens, "temperature": 0.0}, block, turn, max_tokens)
        with self.memory.pinned_kv(block.plan.keys if block.plan is not None else ()):  # no eviction in flight
            body["model"] = await self.upstream.model_name()
            response = await self.upstream.send(scope.key, "POST", "/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise ToolError(f"vLLM's server answered {response.status_code}: {response.text[:500]}")
        OUTAGES.ok("vllm")
        out = response.json()
        text = (out["choices"][0]["message"].get("content") or "").strip()
        return Answer(text, [r.to_item(s) for r, s in block.hits], list(block.kv_memory_ids),
                      list(block.text_memory_ids), dict(block.kv_sources),
                      injected_tokens(out.get("kv_transfer_params")))

    def _block(self, question: str, scope: Scope, k: int | None, wait_for_kv: bool):
        ids = scope.as_dict()
        if self.memory.count(**ids) == 0 and self.memory.count_turns(**ids) == 0:  # as Memory.generate refuses it
            raise UnknownScopeError(f"no memories for {ids}")
        return self.memory.memory_block(question, **ids, mode="inject", k=k, wait_for_kv=wait_for_kv)
