"""Public result and input types of the memory API, and its input checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
class Injection:
    """What one vLLM request needs to be served with injected memory.

    Attributes:
        prompt_token_ids: the whole prompt (tokens).
        kv_transfer_params: pass as ``SamplingParams(extra_args={"kv_transfer_params": ...})``.
        cache_salt: pass in the prompt dict so the prefix cache keeps injected KV apart.
        memories: the retrieved facts, best first (Mem0's search result items).
        memory_tokens: tokens supplied as KV (preamble plus fact lines).
        retrieval_s: time to embed the query and search (seconds).
    """

    prompt_token_ids: tuple[int, ...]
    kv_transfer_params: dict
    cache_salt: str
    memories: list[dict]
    memory_tokens: int
    retrieval_s: float

    def vllm_prompt(self) -> dict:
        """The prompt dict for ``LLM.generate`` / ``LLMEngine.add_request``."""
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
        ValueError: empty or whitespace only, or not valid Unicode (lone surrogates).
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty: give a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode ({exc.reason} at {exc.start}): fix its encoding") from exc
    return text
