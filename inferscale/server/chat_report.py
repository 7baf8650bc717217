"""The report of one chat the front served with memory, written to the chat log when its
answer is whole (:class:`inferscale.store.chat_log.ChatLog`; the page at ``/ui`` shows it).

It says what the chat used: the question, each retrieved memory in rank order with how it
came (``"kv"`` and its tier, or ``"text"`` and why: the ``kv_sources`` of
:data:`inferscale.generation.request.KV_SOURCES`), tokens planned as KV, injected by the
connector and prefilled by vLLM, and timings measured at the front: for a streamed answer the
time to its first token (``ttft_s``, from the request's arrival to the first content chunk
from vLLM), for every answer the time to its end (``latency_s``). Token counts come from
vLLM's ``usage`` (a streamed answer has it when the client asks for it with
``stream_options.include_usage``); prefilled tokens are the prompt's minus those vLLM had
computed before the prefill (``prompt_tokens_details.cached_tokens``: injected KV and its
own prefix cache).
"""

from __future__ import annotations

import json
import logging
import time

from starlette.concurrency import run_in_threadpool

from inferscale.memory import Memory
from inferscale.server.chat import ChatPlan

log = logging.getLogger(__name__)
#: characters of the question kept in a report
QUERY_CHARS = 2000


class ChatReport:
    """Collects one chat's report while it is answered; :meth:`write` stores it.

    Args:
        memory: whose chat log it goes to. scope_key: the chat's scope. query: its question
            (the last user message). plan: what the front sent (its memory block).
        started: :func:`time.perf_counter` when the request arrived.
    """

    def __init__(self, memory: Memory, scope_key: str, query: str, plan: ChatPlan, started: float) -> None:
        self.memory, self.scope_key, self.plan, self.started = memory, scope_key, plan, started
        block = plan.block
        assert block is not None, "a chat without memory has nothing to report"
        kv = set(block.kv_memory_ids)
        self.report: dict = {
            "query": query[:QUERY_CHARS], "mode": plan.mode, "stream": bool(plan.body.get("stream")),
            "memories": [{"id": r.id, "memory": r.text, "score": s, "as": "kv" if r.id in kv else "text",
                          "source": block.kv_sources.get(r.id, "text (text mode)" if plan.mode == "text" else "")}
                         for r, s in block.hits],
            "kv_tokens": block.memory_tokens if block.plan is not None else 0,
            "retrieval_ms": round(block.retrieval_s * 1000, 3),
            "injected_tokens": None, "prompt_tokens": None, "prefilled_tokens": None, "completion_tokens": None,
            "ttft_s": None, "latency_s": None, "replica": None, "status": None,
        }

    def first_token(self) -> None:
        """A streamed answer's first content chunk arrived (the first call counts)."""
        if self.report["ttft_s"] is None:
            self.report["ttft_s"] = time.perf_counter() - self.started

    def stream_line(self, line: str) -> None:
        """Read one line of a relayed stream: the first content chunk's time, and ``usage``."""
        if not line.startswith("data: {") or (self.report["ttft_s"] is not None and '"usage"' not in line):
            return
        try:
            chunk = json.loads(line[len("data: "):])
        except ValueError:
            return
        if self.report["ttft_s"] is None:
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {} if isinstance(choice, dict) else {}
                if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
                    self.first_token()
        if isinstance(chunk.get("usage"), dict):
            self.usage(chunk["usage"])

    def usage(self, usage: dict) -> None:
        """vLLM's ``usage``: prompt, completion and cached (computed before prefill) tokens."""
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.report.update(prompt_tokens=prompt, completion_tokens=usage.get("completion_tokens"))
        if isinstance(prompt, int) and isinstance(cached, int):
            self.report["prefilled_tokens"] = prompt - cached

    def finish(self, status: int, replica: int | None, injected_tokens: int | None = None) -> None:
        """The answer is whole (or the request ended with ``status``): its latency is now."""
        self.report.update(status=status, replica=replica, latency_s=time.perf_counter() - self.started)
        if injected_tokens is not None:
            self.report["injected_tokens"] = injected_tokens

    async def write(self, status: int | None = None, replica: int | None = None) -> None:
        """Store the report (:meth:`finish` first, or here with ``status``); a failure to write
        is logged, never raised: the client has its answer."""
        if status is not None:
            self.finish(status, replica)
        try:
            await run_in_threadpool(self.memory.components.chats.record, self.scope_key, self.report)
        except Exception as exc:  # noqa: BLE001 - a full disk, a database gone: the chat was answered
            log.warning("could not write the chat report of %s (%s: %s)", self.scope_key, type(exc).__name__, exc)
