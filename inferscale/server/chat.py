"""Chat completions with memory: an OpenAI request in, the request vLLM gets out.

The client's request is vLLM's own (``POST /v1/chat/completions``): messages, tools,
``response_format``, streaming, sampling. InferScale adds one thing, the memory block,
as the first system turn::

    system: <system prompt>\\n\\nMemories:\\n- fact ...\\n- fact ...\\n[\\n<client's system text>]
    ...the client's other messages, unchanged...

The client's leading ``system`` / ``developer`` messages are moved after the memory
lines in that turn, so the memory block is a prefix of every prompt the template renders
and its KV can be claimed by the connector (whose token check makes any template that
renders it differently fall back to prefilling, never to wrong KV). vLLM applies the chat
template, parses tools and enforces structured outputs as it always does.

The memory options travel in the request's extra ``memory`` field (see
:class:`MemoryOptions`); the scope is the OpenAI ``user`` field, with agent and run ids in
the ``X-InferScale-Agent-Id`` / ``X-InferScale-Run-Id`` headers. ``kv_transfer_params``
and ``cache_salt`` sent by a client (at the top level or in ``vllm_xargs``) are dropped: only
the server sets them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferscale.generation.request import MemoryBlock
from inferscale.store.records import MAX_SCOPE_ID_CHARS, Scope

#: Most memories one chat request may ask for.
MAX_K = 200
AGENT_HEADER = "x-inferscale-agent-id"
RUN_HEADER = "x-inferscale-run-id"
_SCOPE_ID = re.compile(rf"^[^\x00-\x1f\x7f]{{1,{MAX_SCOPE_ID_CHARS}}}$")  # as long as the library takes
#: request fields only the server sets
_SERVER_FIELDS = ("kv_transfer_params", "cache_salt", "memory")


class MemoryOptions(BaseModel):
    """The ``memory`` field of a chat request (every field optional).

    Attributes:
        mode: ``"inject"`` (default: the memory block as precomputed KV), ``"text"`` (the
            same block prefilled as text, Mem0-style) or ``"none"`` (no memory).
        k: memories retrieved (0..200; default: the server's ``top_k``).
        context_window: w of Context-Window Encoding, in turns (default: the server's).
        wait_for_kv: encode missing KV before answering instead of prefilling those facts.
        text_tail: the best-ranked memories prefilled as text after the injected rest (0..200;
            default 0; ``GenerationOptions.text_tail``).
        memory_order: ``"best_last"`` (default: the best memory nearest the question) or
            ``"best_first"`` (``GenerationOptions.memory_order``).
    """

    model_config = ConfigDict(extra="forbid")

    mode: Literal["inject", "text", "none"] = "inject"
    k: int | None = Field(default=None, ge=0, le=MAX_K, strict=True)
    context_window: int | None = Field(default=None, ge=0, le=1000, strict=True)
    wait_for_kv: bool = Field(default=False, strict=True)
    text_tail: int = Field(default=0, ge=0, le=MAX_K, strict=True)
    memory_order: Literal["best_last", "best_first"] = "best_last"


class ChatRequestError(ValueError):
    """The chat request is malformed; the message says what to change (HTTP 400)."""


def scope_id(value: Any, name: str) -> str | None:
    """A validated scope id (``None`` stays ``None``).

    Raises:
        ChatRequestError: not a string of 1 to :data:`~inferscale.store.records.MAX_SCOPE_ID_CHARS`
            characters without control characters.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not _SCOPE_ID.fullmatch(value) or not value.strip():
        raise ChatRequestError(f"{name} must be 1-{MAX_SCOPE_ID_CHARS} characters without control characters, "
                               f"got {value!r:.80}")
    return value


def header_text(value: str | None, name: str) -> str | None:
    """A header's value as the UTF-8 text a client sent (ASGI servers hand header bytes over
    as Latin-1, so ``аlice`` in UTF-8 would arrive as ``Ð°lice`` and pass every check).

    Raises:
        ChatRequestError: bytes that are not UTF-8.
    """
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise ChatRequestError(f"the {name} header is not UTF-8: send the id as UTF-8 bytes") from None


def request_scope(body: dict, headers: Any) -> Scope:
    """The memory scope: ``user`` from the body, agent and run ids from the headers.

    Raises:
        ChatRequestError: no id at all, or a malformed one.
    """
    user = scope_id(body.get("user"), "user")
    agent = scope_id(header_text(headers.get(AGENT_HEADER), "X-InferScale-Agent-Id"), "the X-InferScale-Agent-Id header")
    run = scope_id(header_text(headers.get(RUN_HEADER), "X-InferScale-Run-Id"), "the X-InferScale-Run-Id header")
    if not (user or agent or run):
        raise ChatRequestError("say whose memory to use: set the request's 'user' field (the user id), or the "
                               "X-InferScale-Agent-Id / X-InferScale-Run-Id header; or send "
                               "\"memory\": {\"mode\": \"none\"} to chat without memory")
    return Scope.of(user, agent, run)


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string, or a list of parts whose
    ``{"type": "text", "text"}`` parts are joined with newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def check_messages(body: dict, check_chars=None) -> list[dict]:
    """The request's messages, checked for shape (vLLM checks the rest), and their texts'
    characters by ``check_chars`` (a list of strings in; raises ``ValueError``), before
    anything is tokenized.

    Raises:
        ChatRequestError: ``messages`` missing, empty, or holding something that is not a
            message object with a string ``role``.
        ValueError: from ``check_chars``.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatRequestError(f"messages[{i}] must be an object with a string 'role', got {m!r:.200}")
        if m["role"] in ("system", "developer", "user") and not _text_content(m.get("content"), m["role"] != "user"):
            kind = "a string or a list of text parts" if m["role"] != "user" else "a string or a list of content parts"
            raise ChatRequestError(f"messages[{i}] ({m['role']}) content must be {kind}, got {m.get('content')!r:.80}")
    if check_chars is not None:
        check_chars([t for m in messages for t in _texts(m.get("content"))])
    return messages


def _texts(content: Any) -> list[str]:
    """The strings of a message's content: itself, or its parts' ``text``."""
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)] \
        if isinstance(content, list) else []


def _text_content(content: Any, text_only: bool) -> bool:
    if isinstance(content, str):
        return True
    if not isinstance(content, list) or not content:
        return False
    return all(isinstance(p, dict) and (p.get("type") == "text" and isinstance(p.get("text"), str)
                                        or not text_only and isinstance(p.get("type"), str)) for p in content)


def split_messages(messages: list[dict]) -> tuple[str | None, list[dict], str]:
    """``(instructions, rest, query)``: the leading system/developer texts joined, the other
    messages, and the retrieval query (the text of the last user message).

    Raises:
        ChatRequestError: no user message with text.
    """
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    instructions = "\n\n".join(t for t in (message_text(m.get("content")).strip() for m in messages[:n]) if t)
    query = next((message_text(m.get("content")) for m in reversed(messages) if m["role"] == "user"), "")
    if not query.strip():
        unknown = sorted({str(m["role"]) for m in messages} - {"system", "developer", "user", "assistant", "tool"})
        raise ChatRequestError("memory needs a question: the request has no user message with text"
                               + (f" (roles {unknown} are none of system, developer, user, assistant, tool)"
                                  if unknown else "")
                               + " (send \"memory\": {\"mode\": \"none\"} to chat without memory)")
    return instructions or None, messages[n:], query


@dataclass(frozen=True)
class ChatPlan:
    """What the front sends to vLLM and reports back.

    Attributes:
        body: the request for vLLM's ``/v1/chat/completions``.
        block: the memory block (``None`` in mode ``"none"``).
        mode: ``"inject"``, ``"text"`` or ``"none"``.
    """

    body: dict
    block: MemoryBlock | None
    mode: str

    def report(self, injected_tokens: int | None) -> dict:
        """The response's ``memory`` field.

        Args:
            injected_tokens: prompt tokens the connector wrote into the paged cache (``None``
                when not known: a streamed response). Fewer than ``kv_tokens`` when vLLM's
                prefix cache already held some of them.
        """
        out: dict[str, Any] = {"mode": self.mode}
        if self.block is not None:
            b = self.block
            out.update(memories=[{"id": r.id, "memory": r.text, "score": s} for r, s in b.hits],
                       kv_memory_ids=list(b.kv_memory_ids), text_memory_ids=list(b.text_memory_ids),
                       kv_sources=dict(b.kv_sources),
                       kv_tokens=b.memory_tokens if b.plan is not None else 0,
                       retrieval_ms=round(b.retrieval_s * 1000, 3))
        if injected_tokens is not None:
            out["injected_tokens"] = injected_tokens
        return out

    def headers(self) -> dict[str, str]:
        """The report's gist as response headers: ``X-InferScale-Mode``, ``-Memory-Ids``
        (comma-separated, best first), ``-KV-Memory-Ids`` and ``-KV-Tokens``."""
        out = {"x-inferscale-mode": self.mode}
        if self.block is not None:
            out["x-inferscale-memory-ids"] = ",".join(r.id for r, _ in self.block.hits)
            out["x-inferscale-kv-memory-ids"] = ",".join(self.block.kv_memory_ids)
            out["x-inferscale-kv-tokens"] = str(self.block.memory_tokens if self.block.plan is not None else 0)
        return out


def without_server_fields(body: dict) -> dict:
    """``body`` without the fields only the server sets (``kv_transfer_params``, ``cache_salt``,
    ``memory``), at the top level and in ``vllm_xargs`` (which vLLM merges into the request's
    extra arguments, where its connector reads ``kv_transfer_params`` too)."""
    out = {k: v for k, v in body.items() if k not in _SERVER_FIELDS}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict):
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in _SERVER_FIELDS}
    return out


def forward_body(body: dict, block: MemoryBlock | None, rest: list[dict] | None, default_max_tokens: int) -> dict:
    """The client's request with the memory system turn in front, the server's KV fields set,
    the client's own copies of them dropped, and ``max_tokens`` set to ``default_max_tokens``
    when the client sent neither ``max_tokens`` nor ``max_completion_tokens`` (vLLM would
    generate to the end of the context: minutes on a CPU)."""
    out = without_server_fields(body)
    if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
        out["max_tokens"] = default_max_tokens
    if block is not None:
        out["messages"] = [{"role": "system", "content": block.system_text}, *(rest or [])]
        out["cache_salt"] = block.cache_salt  # the scope's, as KV or as text: no other scope shares its blocks
        if block.plan is not None:
            out["kv_transfer_params"] = block.plan.to_params()
    return out
