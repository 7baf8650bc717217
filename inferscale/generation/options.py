"""The knobs of one generation, declared once: used by :class:`inferscale.Memory` and, as a
pydantic base class, by the LangChain and LlamaIndex adapters."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from inferscale.checks import MAX_CONTEXT_WINDOW
from inferscale.generation.tools import check_tools, chosen_tool

#: Most top logprobs a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: Highest temperature vLLM accepts (``SamplingParams._verify_args`` in vLLM 0.32: "[0, 2]").
MAX_TEMPERATURE = 2.0


class PlainErrors:
    """Mixin for pydantic models: the constructor raises a one-line ``TypeError`` (wrong
    type) or ``ValueError`` (wrong value) naming the field (:func:`plain_error`) instead of
    pydantic's multi-line ``ValidationError``. Put it first among the bases."""

    def __init__(self, *args: Any, **data: Any) -> None:
        try:
            super().__init__(*args, **data)
        except ValidationError as exc:
            err = exc.errors()[0]
            if err["type"] == "extra_forbidden" and err["loc"]:  # as Python says of an unexpected keyword
                name, fields = str(err["loc"][0]), list(type(self).model_fields)
                near = difflib.get_close_matches(name, fields, n=1)
                raise TypeError(f"{type(self).__name__} got an unknown argument {name!r}"
                                f"{f': did you mean {near[0]!r}?' if near else ''}") from None
            raise plain_error(exc) from None


class ScopeFields(BaseModel):
    """``user_id`` / ``agent_id`` / ``run_id``: whose memories an adapter's component uses
    (at least one, here or per call); a blank one is refused at construction.

    Raises:
        ValueError: (a pydantic error, one line under :class:`PlainErrors`) a blank scope field.
    """

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None

    @field_validator("user_id", "agent_id", "run_id")
    @classmethod
    def _not_blank(cls, value: str | None, info) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} must be a non-empty string, got {value!r}")
        return value


class GenerationOptions(PlainErrors, BaseModel):
    """How to answer one query.

    Attributes:
        k: memories retrieved and placed in the prompt (default: the memory's ``top_k``).
        context_window: w of Context-Window Encoding, in conversation turns (default: the
            memory's ``context_window``).
        mode: ``"inject"`` supplies the memory block as precomputed KV; ``"text"`` prefills
            the same tokens (Mem0-style prompt injection).
        max_tokens: answer budget (tokens, at least 1).
        temperature: sampling temperature, 0 (greedy) to 2 (vLLM's limit).
        stop: strings that end the answer (not included in it).
        logprobs: also return the top-N logprobs of the first answer token (0..20).
        wait_for_kv: in inject mode, encode the KV of retrieved facts that have none yet
            before answering (every fact injected); by default such facts are prefilled as
            text and their KV is encoded in the background.
        text_tail: in inject mode, the ``text_tail`` best-ranked memories are prefilled as
            text after the injected rest, nearest the question, even when their KV is stored
            (issue 43's "text tail": their tokens then attend to every memory before them,
            as EPIC and CacheBlend recompute a few tokens to recover what separately encoded
            KV misses); default 0: every stored KV is injected.
        memory_order: where the best-ranked memory sits in the memory block: ``"best_last"``
            (default: nearest the question) or ``"best_first"`` (right after the preamble).
            Within the block, memories with stored KV still come before those prefilled as
            text (vLLM's connector injects a prefix). Measured in docs/results/memory_order.
        json_schema: constrain the answer to JSON valid for this JSON Schema (vLLM's
            structured outputs; ``{"type": "object"}`` for any JSON object).
        tools: tools the model may call, in OpenAI's function format
            (:mod:`inferscale.generation.tools`); described in the system turn after the memory block.
        tool_choice: ``"auto"`` (default: the model decides), ``"none"``, ``"required"`` /
            ``"any"`` (a call is forced by constrained decoding), a tool's name, or OpenAI's
            ``{"type": "function", "function": {"name": ...}}``.

    Raises:
        TypeError: a field of the wrong type, or an unknown field.
        ValueError: a bad value; each message is one line naming the field and why.
    """

    # unknown fields are refused (a typo such as max_token=3 must not be ignored); the
    # adapters that inherit these fields get the same strictness
    model_config = ConfigDict(extra="forbid")

    k: int | None = Field(default=None, ge=0, strict=True)
    context_window: int | None = Field(default=None, ge=0, le=MAX_CONTEXT_WINDOW, strict=True)
    mode: Literal["inject", "text"] = "inject"
    max_tokens: int = Field(default=64, ge=1, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    stop: list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, strict=True)
    wait_for_kv: bool = Field(default=False, strict=True)
    text_tail: int = Field(default=0, ge=0, strict=True)
    memory_order: Literal["best_last", "best_first"] = "best_last"
    json_schema: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return check_tools(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_type(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, dict)):
            raise TypeError(f"tool_choice must be 'auto', 'none', 'required', 'any', a tool name or an OpenAI "
                            f"tool_choice dict, got {value!r}")
        return value

    @field_validator("json_schema", mode="before")
    @classmethod
    def _json_schema(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"json_schema must be a JSON Schema dict, got {type(value).__name__}")
        return value

    @model_validator(mode="after")
    def _tool_choice(self) -> "GenerationOptions":
        forced = chosen_tool(self.tools, self.tool_choice) is not None
        if forced and self.json_schema is not None:
            raise ValueError("a forced tool call (tool_choice) and json_schema both constrain the answer: give one")
        if (forced or self.json_schema is not None) and self.stop:
            raise ValueError("stop strings would cut a constrained JSON answer (a forced tool call or json_schema): "
                             "drop stop")
        return self

    def forced_tool(self) -> str | None:
        """The tool a call is forced to (``"*"``: any tool), or ``None``."""
        return chosen_tool(self.tools, self.tool_choice)

    def offered_tools(self) -> list[dict]:
        """The tools described to the model (none with ``tool_choice="none"``)."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @field_validator("temperature", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # a TypeError is not wrapped by pydantic
            raise TypeError(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {value!r}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(
                isinstance(x, str) for x in value):
            raise TypeError(f"stop must be a list of strings, got {value!r}")
        if not all(value):
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
        try:
            return GenerationOptions(**{**{n: getattr(self, n) for n in self.option_names()}, **overrides})
        except ValidationError as exc:
            raise plain_error(exc) from None


def check_call_options(who: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    """Refuse per-call keyword arguments an adapter does not take.

    Raises:
        TypeError: naming the unknown ones and listing ``allowed``.
    """
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for {who}; valid per-call options: {', '.join(allowed)}")


def plain_error(exc: ValidationError) -> TypeError | ValueError:
    """One line naming the first bad field, what it got and what is accepted: a ``TypeError``
    for a value of the wrong type, a ``ValueError`` for a wrong value."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "options"
    msg = err["msg"].removeprefix("Value error, ")
    wrong_type = err["type"].endswith("_type") or err["type"] in ("is_instance_of", "bool_parsing", "int_parsing",
                                                                   "float_parsing")
    if not err["loc"]:  # a check across fields: the message names them, the input is every option
        text = msg or "options are invalid"
    else:
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown):,} characters)"  # a huge input
        got = "" if "got " in msg else f", got {shown}"
        text = f"{field}: {msg[0].lower() + msg[1:]}{got}" if msg else f"{field} is invalid"
    return TypeError(text) if wrong_type else ValueError(text)
