"""The knobs of one generation, declared once: used by :class:`inferscale.Memory` and, as a
pydantic base class, by the LangChain and LlamaIndex adapters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

#: Most top logprobs a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


class GenerationOptions(BaseModel):
    """How to answer one query.

    Attributes:
        k: memories retrieved and placed in the prompt (default: the memory's ``top_k``).
        context_window: w of Context-Window Encoding, in conversation turns (default: the
            memory's ``context_window``).
        mode: ``"inject"`` supplies the memory block as precomputed KV; ``"text"`` prefills
            the same tokens (Mem0-style prompt injection).
        max_tokens: answer budget (tokens, at least 1).
        temperature: sampling temperature; 0 is greedy.
        stop: strings that end the answer (not included in it).
        logprobs: also return the top-N logprobs of the first answer token (0..20).
        wait_for_kv: in inject mode, encode the KV of retrieved facts that have none yet
            before answering (every fact injected); by default such facts are prefilled as
            text and their KV is encoded in the background.

    Raises:
        pydantic.ValidationError: (a ``ValueError``) naming the bad field and why.
    """

    k: int | None = Field(default=None, ge=0, strict=True)
    context_window: int | None = Field(default=None, ge=0, strict=True)
    mode: Literal["inject", "text"] = "inject"
    max_tokens: int = Field(default=64, ge=1, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    stop: list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, strict=True)
    wait_for_kv: bool = Field(default=False, strict=True)

    @field_validator("temperature", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"temperature must be a number >= 0, got {value!r}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(
                isinstance(x, str) and x for x in value):
            raise ValueError(f"stop must be a list of non-empty strings, got {value!r}")
        return list(value)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The option fields, in declaration order."""
        return tuple(GenerationOptions.model_fields)

    def options(self) -> "GenerationOptions":
        """These options alone (for a subclass that adds fields, such as an adapter)."""
        return GenerationOptions(**{name: getattr(self, name) for name in self.option_names()})

    def merged(self, **overrides: Any) -> "GenerationOptions":
        """A copy with ``overrides`` applied and validated.

        Raises:
            TypeError: an override is not an option (naming the valid ones).
            pydantic.ValidationError: an override has a bad value.
        """
        unknown = sorted(set(overrides) - set(self.option_names()))
        if unknown:
            raise TypeError(f"unknown generation option(s) {unknown}: use {list(self.option_names())}")
        return GenerationOptions(**{**{n: getattr(self, n) for n in self.option_names()}, **overrides})
