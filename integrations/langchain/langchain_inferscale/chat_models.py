"""``ChatInferScale``: a LangChain chat model served by vLLM with memories injected as KV."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field

from inferscale import Generation, GenerationOptions
from langchain_inferscale._messages import split_prompt
from langchain_inferscale._scope import MemoryScope

#: Per-call overrides accepted by ``invoke`` / ``stream`` (``model.invoke(msgs, k=3)``): the
#: scope and every generation option (:class:`inferscale.GenerationOptions`); ``stop`` is
#: LangChain's own argument.
CALL_OPTIONS = ("user_id", "agent_id", "run_id",
                *(n for n in GenerationOptions.option_names() if n != "stop"))


class ChatInferScale(MemoryScope, GenerationOptions, BaseChatModel):
    """Chat model answering through InferScale's vLLM engine with the scope's memories
    supplied as precomputed KV.

    The last message is the question; earlier human/AI messages are the conversation,
    prefilled after the memory block; system messages are added to the system turn after
    the memories. The memories are the scope's top-``k`` facts for the question, their KV
    injected by the connector (``mode="inject"``) or prefilled as text (``mode="text"``).
    Sync, async (a worker thread over the same code) and streaming.

    Attributes:
        memory: the InferScale memory (its engine starts on first use).
        user_id / agent_id / run_id: whose memories (at least one, here or per call).
        k, context_window, mode, temperature, stop, logprobs: the generation options
            (:class:`inferscale.GenerationOptions`; ``stop`` also per call as ``stop=``).
        max_tokens: answer budget (tokens, default 256).
        allow_unknown_scope: answer a user with no memories yet (a new user's first
            message) without memories; ``False`` raises ``UnknownScopeError``.

    Every attribute but ``memory`` can be overridden per call (``model.invoke(msgs,
    user_id="bob", k=3)``) or made configurable (``configurable_fields``).

    ``response_metadata`` of the answer carries the engine's counters: ``ttft_s``,
    ``num_prompt_tokens``, ``num_injected_tokens`` (supplied as KV), ``num_prefilled_tokens``
    ``memory_ids`` (the memories used, best first), and ``kv_memory_ids`` /
    ``text_memory_ids`` (which came as KV, and which as text because their KV was still
    being encoded).

    Example:
        >>> model = ChatInferScale(memory=Memory(), user_id="alice", k=5, max_tokens=64)
        >>> model.invoke("What is my dog's name?").content
        "My dog's name is Biscuit."
    """

    max_tokens: int = Field(default=256, ge=1, strict=True)  # chat answers run longer than Memory's 64
    allow_unknown_scope: bool = True

    @property
    def _llm_type(self) -> str:
        return "inferscale"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.memory.config.llm, "mode": self.mode, "k": self.k,
                "context_window": self.context_window, "temperature": self.temperature,
                "max_tokens": self.max_tokens}

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        unknown = sorted(set(kwargs) - set(CALL_OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for ChatInferScale; valid per-call options: {CALL_OPTIONS}")
        query, history, instructions = split_prompt(messages)
        overrides = {name: kwargs[name] for name in self.option_names() if name in kwargs}
        if stop is not None:
            overrides["stop"] = stop
        scope = {name: kwargs.get(name, getattr(self, name)) for name in ("user_id", "agent_id", "run_id")}
        return dict(query=query, **scope, history=history, instructions=instructions,
                    allow_unknown_scope=self.allow_unknown_scope, options=self.options().merged(**overrides))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        gen = self.memory.generate(**self._request(messages, stop, kwargs))
        message = AIMessage(gen.text, response_metadata=_metadata(gen, self.memory.config.llm),
                            usage_metadata=_usage(gen))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for part in self.memory.stream(**self._request(messages, stop, kwargs)):
            gen = part.generation
            chunk = ChatGenerationChunk(message=AIMessageChunk(
                content=part.text,
                response_metadata=_metadata(gen, self.memory.config.llm) if gen else {},
                usage_metadata=_usage(gen) if gen else None,
                chunk_position="last" if gen else None,
            ))
            if run_manager and part.text:
                run_manager.on_llm_new_token(part.text, chunk=chunk)
            yield chunk


def _metadata(gen: Generation, model_name: str) -> dict:
    return {
        "model_name": model_name, "mode": gen.mode, "ttft_s": gen.ttft_s, "latency_s": gen.latency_s,
        "retrieval_s": gen.retrieval_s, "num_prompt_tokens": gen.num_prompt_tokens,
        "num_injected_tokens": gen.num_injected_tokens, "num_prefilled_tokens": gen.num_prefilled_tokens,
        "memory_ids": [m["id"] for m in gen.memories],
        "kv_memory_ids": gen.kv_memory_ids, "text_memory_ids": gen.text_memory_ids,
    }


def _usage(gen: Generation) -> UsageMetadata:
    return UsageMetadata(input_tokens=gen.num_prompt_tokens, output_tokens=gen.num_generated_tokens,
                         total_tokens=gen.num_prompt_tokens + gen.num_generated_tokens,
                         input_token_details={"cache_read": gen.num_prompt_tokens - gen.num_prefilled_tokens})
