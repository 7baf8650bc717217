"""Public result and input types of the memory API, and its input checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferscale.kv.injection import InjectionPlan, cache_salt


class UnknownScopeError(KeyError):
    """The scope has no memories and no turns."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


class MemoryNotFoundError(KeyError):
    """No memory with this id in this scope (a memory of another scope is "not found" too)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class FactInput:
    """A fact to store (see :meth:`Memory.add_facts`).

    Attributes:
        text: the fact, non-empty.
        source_turn_ids: turns of the scope's log it was derived from (provenance);
            Context-Window Encoding counts back from the earliest.
        metadata: user metadata (JSON-serialisable).
    """

    text: str
    source_turn_ids: tuple[str, ...] = ()
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WriteEvent:
    """What one write did to one memory (Mem0's ``add`` result item).

    Attributes:
        id: the memory's id.
        memory: its text after the write (before it, for ``DELETE``).
        event: ``"ADD"``, ``"UPDATE"``, ``"DELETE"`` or ``"NOOP"``.
        previous_memory: the text before an ``UPDATE``.
    """

    id: str
    memory: str
    event: str
    previous_memory: str | None = None

    def to_dict(self) -> dict:
        """Mem0's item: ``{"id", "memory", "event"}`` (+ ``previous_memory`` for UPDATE)."""
        item = {"id": self.id, "memory": self.memory, "event": self.event}
        if self.previous_memory is not None:
            item["previous_memory"] = self.previous_memory
        return item


def write_results(events: list[WriteEvent]) -> dict:
    """Mem0's ``{"results": [...]}`` of a write, from its typed events."""
    return {"results": [e.to_dict() for e in events]}


@dataclass(frozen=True)
class Injection:
    """One vLLM request prepared by :meth:`Memory.inject` / :meth:`Memory.prepare`.

    Attributes:
        prompt_token_ids: the whole prompt (tokens).
        plan: what the connector injects (:class:`~inferscale.kv.injection.InjectionPlan`);
            ``None`` for a text-mode request.
        memories: the retrieved facts, best first (Mem0's search result items).
        memory_tokens: tokens supplied as KV in inject mode (preamble plus the injected
            fact lines); in text mode, the preamble and every fact line.
        retrieval_s: time to embed the query and search (seconds).
        kv_memory_ids: memories whose KV the plan injects.
        text_memory_ids: memories placed as prompt text (in inject mode: not encoded yet).
        kv_sources: in inject mode, per memory id, where its KV came from or why it came as
            text (:data:`inferscale.generation.request.KV_SOURCES`).
        scope_key: the scope whose memory the prompt carries (its prefix-cache salt's).
    """

    prompt_token_ids: tuple[int, ...]
    plan: InjectionPlan | None
    memories: list[dict]
    memory_tokens: int
    retrieval_s: float
    kv_memory_ids: list[str] = field(default_factory=list)
    text_memory_ids: list[str] = field(default_factory=list)
    kv_sources: dict[str, str] = field(default_factory=dict)
    scope_key: str = ""

    @property
    def kv_transfer_params(self) -> dict | None:
        """Pass as ``SamplingParams(extra_args={"kv_transfer_params": ...})`` (or the OpenAI
        server's ``kv_transfer_params`` field)."""
        return None if self.plan is None else self.plan.to_params()

    @property
    def cache_salt(self) -> str:
        """Pass in the prompt dict (or the OpenAI server's ``cache_salt`` field), in either mode:
        the prefix cache keeps this scope's blocks, and injected KV, apart
        (:func:`inferscale.kv.injection.cache_salt`)."""
        return cache_salt(self.scope_key, self.plan)

    def vllm_prompt(self) -> dict:
        """The prompt dict for ``LLM.generate`` / ``AsyncLLM.generate``."""
        return {"prompt_token_ids": list(self.prompt_token_ids), "cache_salt": self.cache_salt}


@dataclass(frozen=True)
class Generation:
    """An answer with its timings.

    Attributes:
        text: the answer.
        mode: ``"inject"`` (memory as KV) or ``"text"`` (memory prefilled as prompt text).
        ttft_s: time to first token in the engine (seconds).
        latency_s: engine time to the last token (seconds).
        retrieval_s: query embedding plus search (seconds).
        num_prompt_tokens: prompt length (tokens).
        num_injected_tokens: prompt tokens supplied as KV by the connector.
        num_prefilled_tokens: prompt tokens vLLM computed.
        memories: the facts used, best first.
        first_logprobs: ``{token_id: logprob}`` of the first answer position (when asked).
        num_generated_tokens: answer length (tokens).
        kv_memory_ids: memories whose KV was injected.
        text_memory_ids: memories prefilled as text (in inject mode: their KV was not
            encoded yet, or was evicted; it is being encoded in the background).
        kv_sources: in inject mode, per memory id, where its KV came from or why it came as
            text (:data:`inferscale.generation.request.KV_SOURCES`).
        tool_calls: the calls of offered tools parsed from ``text`` (``{"id", "name",
            "arguments"}`` dicts; :mod:`inferscale.generation.tools`), empty when none.
        finish_reason: ``"stop"`` (the answer ended) or ``"length"`` (``max_tokens`` ran
            out: a forced call or JSON answer cut there is not parsed, raise ``max_tokens``).
    """

    text: str
    mode: str
    ttft_s: float
    latency_s: float
    retrieval_s: float
    num_prompt_tokens: int
    num_injected_tokens: int
    num_prefilled_tokens: int
    memories: list[dict]
    first_logprobs: dict[int, float] = field(default_factory=dict)
    num_generated_tokens: int = 0
    kv_memory_ids: list[str] = field(default_factory=list)
    text_memory_ids: list[str] = field(default_factory=list)
    kv_sources: dict[str, str] = field(default_factory=dict)
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the prompt's layout and each memory's source (:mod:`inferscale.display`)."""
        from inferscale.display import generation_html

        return generation_html(self)


class SearchResults(dict):
    """:meth:`Memory.search`'s answer: Mem0's ``{"results": [...]}`` dict, which Jupyter shows as
    a ranking table (:func:`inferscale.display.search_html`); ``query`` and ``mode`` say what was
    searched. A plain dict in every other way (JSON, equality, pickling)."""

    def __init__(self, results: list[dict], query: str | None = None, mode: str | None = None) -> None:
        super().__init__(results=results)
        self.query, self.mode = query, mode

    def _repr_html_(self) -> str:
        from inferscale.display import search_html

        return search_html(self.get("results", []), self.query, self.mode)


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of a streamed answer (:meth:`Memory.stream`).

    Attributes:
        text: the new text since the previous chunk; the chunks' texts joined are the
            answer, exactly as :meth:`Memory.generate` returns it.
        generation: the finished :class:`Generation` (timings, counters), on the last chunk only.
    """

    text: str
    generation: Generation | None = None


def require_text(text: Any, what: str = "text") -> str:
    """Return ``text`` if it is a non-empty, encodable string.

    Raises:
        TypeError: not a string.
        ValueError: empty, whitespace or invisible characters only (``"\\u200b"``), a NUL
            character, or not valid Unicode (lone surrogates).
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty: give a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode ({exc.reason} at {exc.start}): fix its encoding") from exc
    if not any(ch.isprintable() and not ch.isspace() for ch in text):  # zero-width characters alone are empty too
        raise ValueError(f"{what} is empty: give a non-empty string")
    if "\x00" in text:  # PostgreSQL's text refuses it; SQLite and Chroma would keep it where PostgreSQL cannot
        raise ValueError(f"{what} holds a NUL character (\\x00) at {text.index(chr(0))}: remove it")
    return text
