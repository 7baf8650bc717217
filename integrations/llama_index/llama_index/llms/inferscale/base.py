"""``InferScaleLLM``: a LlamaIndex LLM served by vLLM with the scope's memories injected as KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.llms.inferscale.messages import split_prompt
from pydantic import BaseModel, Field

from inferscale import Generation, GenerationChunk, GenerationOptions, Memory
from inferscale.integration import ScopeFields, check_call_options

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

#: Per-call overrides accepted by every method (``llm.complete(q, k=3)``): the scope and
#: every generation option (:class:`inferscale.GenerationOptions`).
CALL_OPTIONS = ("user_id", "agent_id", "run_id", *GenerationOptions.option_names())


class InferScaleLLM(ScopeFields, GenerationOptions, FunctionCallingLLM):
    """LLM answering through InferScale's vLLM engine with the scope's memories supplied
    as precomputed KV.

    ``complete(prompt)`` answers ``prompt`` with the scope's top-``k`` memories for it;
    ``chat(messages)`` answers the last (user) message, with the earlier user/assistant
    messages as the conversation (prefilled after the memory block) and system messages
    added to the system turn after the memories. Streaming variants yield the same answer
    in pieces; async variants run the same code in a worker thread.

    Agents: a ``FunctionCallingLLM`` (``chat_with_tools``, ``predict_and_call``,
    ``FunctionAgent``): tools are described in the system turn after the memory block, a
    required tool call is decoded under the tool's JSON Schema (vLLM's structured outputs),
    and the calls come back in ``message.additional_kwargs["tool_calls"]``.
    ``structured_predict`` / ``as_structured_llm`` decode the answer under the output
    class's JSON Schema.

    Each response's ``additional_kwargs`` carry the engine's counters: ``ttft_s``,
    ``num_prompt_tokens``, ``num_injected_tokens`` (supplied as KV),
    ``num_prefilled_tokens``, ``num_generated_tokens``, ``memory_ids``, and ``kv_memory_ids`` /
    ``text_memory_ids`` (which memories came as KV, and which as text because their KV was
    still being encoded).

    Attributes:
        memory: the InferScale memory (its engine starts on first use).
        user_id / agent_id / run_id: whose memories (at least one, here or per call).
        k, context_window, mode, temperature, stop, logprobs: the generation options
            (:class:`inferscale.GenerationOptions`).
        max_tokens: answer budget (tokens, default 256).
        allow_unknown_scope: answer a user with no memories yet without memories
            (``False`` raises ``UnknownScopeError``).
        call_tools_first: in ``chat_with_tools`` (and so in a ``FunctionAgent``), force one
            round of tool calls per question, then answer in text with the tools withheld:
            for models that do not call tools on their own, such as the 135M default
            (llama-index-core 0.12 agents cannot set a tool choice per step).

    Example:
        >>> llm = InferScaleLLM(memory=Memory(), user_id="alice", k=5)
        >>> llm.complete("What is my dog's name?").text
        "My dog's name is Biscuit."
    """

    memory: Memory = Field(exclude=True)
    max_tokens: int = Field(default=256, ge=1, strict=True)  # chat answers run longer than Memory's 64
    allow_unknown_scope: bool = Field(default=True, strict=True)
    call_tools_first: bool = Field(default=False, strict=True)

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name for this class (serialisation)."""
        return "InferScaleLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window and answer budget of the served model."""
        return LLMMetadata(context_window=self.memory.config.max_model_len, num_output=self.max_tokens,
                           is_chat_model=True, is_function_calling_model=True, model_name=self.memory.config.llm)

    # one request path: every method goes through _request and Memory.stream / Memory.generate

    def _request(self, query: str, history: Sequence[dict], instructions: str | None, followup: Sequence[dict],
                 kwargs: dict) -> dict:
        check_call_options("InferScaleLLM", kwargs, CALL_OPTIONS)
        overrides = {name: kwargs[name] for name in self.option_names() if name in kwargs}
        scope = {name: kwargs.get(name, getattr(self, name)) for name in ("user_id", "agent_id", "run_id")}
        return dict(query=query, **scope, history=list(history), instructions=instructions, followup=list(followup),
                    allow_unknown_scope=self.allow_unknown_scope, options=self.options().merged(**overrides))

    def _complete(self, prompt: str, kwargs: dict) -> CompletionResponse:
        gen = self.memory.generate(**self._request(prompt, (), None, (), kwargs))
        return CompletionResponse(text=gen.text, raw=gen, additional_kwargs=_counters(gen))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> ChatResponse:
        gen = self.memory.generate(**self._request(*split_prompt(messages), kwargs))
        return ChatResponse(message=_answer(gen.text, gen), raw=gen, additional_kwargs=_counters(gen))

    def _stream_complete(self, prompt: str, kwargs: dict) -> CompletionResponseGen:
        parts = self.memory.stream(**self._request(prompt, (), None, (), kwargs))  # checks and retrieval happen here
        return (CompletionResponse(text=text, delta=delta, raw=gen, additional_kwargs=_counters(gen) if gen else {})
                for text, delta, gen in _accumulate(parts))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> ChatResponseGen:
        request = self._request(*split_prompt(messages), kwargs)
        parts = self.memory.stream(**request)
        # with tools offered, the text may turn out to be a call: it is sent whole, at the end
        hold = bool(request["options"].offered_tools())
        return (ChatResponse(message=_answer(text, gen), delta=delta, raw=gen,
                             additional_kwargs=_counters(gen) if gen else {})
                for text, delta, gen in _accumulate(parts, hold))

    # ------------------------------------------------------------------ tools and structured output

    def _prepare_chat_with_tools(self, tools: Sequence["BaseTool"], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
        """``chat`` arguments offering ``tools`` (OpenAI format, from each tool's metadata); a
        call is forced by ``tool_required=True``, a ``tool_choice`` (``"required"`` or a
        name), or ``call_tools_first`` while the question has no tool result yet."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        if tool_choice is None and tool_required:
            tool_choice = "required"
        if tool_choice is None and self.call_tools_first and tools:
            asked = max((i for i, m in enumerate(messages) if m.role == MessageRole.USER), default=-1)
            answered = any(m.role == MessageRole.TOOL for m in messages[asked + 1:])
            tool_choice = "none" if answered else "required"
        return {"messages": messages, "tools": [t.metadata.to_openai_tool() for t in tools] or None,
                "tool_choice": tool_choice, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The tool calls of a response (``message.additional_kwargs["tool_calls"]``).

        Raises:
            ValueError: no call, with ``error_on_no_tool_call``.
        """
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got the text {response.message.content!r:.200}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]

    def structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """An ``output_cls`` instance answering ``prompt``: the answer is decoded under the
        class's JSON Schema (vLLM's structured outputs) and validated.

        Raises:
            pydantic.ValidationError: the answer ran out of ``max_tokens`` before the object closed.
        """
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = self.chat(messages, json_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content)

    async def astructured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> BaseModel:
        """:meth:`structured_predict` in a worker thread."""
        return await asyncio.to_thread(self.structured_predict, output_cls, prompt, llm_kwargs, **prompt_args)

    def stream_structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
                                  ) -> Iterator[BaseModel]:
        """:meth:`structured_predict` as a stream of one complete object (partial objects of a
        constrained answer are not validated, so none is yielded)."""
        yield self.structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

    async def astream_structured_predict(self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
                                         llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
                                         ) -> AsyncIterator[BaseModel]:
        """:meth:`stream_structured_predict` for coroutines."""
        async def one() -> AsyncIterator[BaseModel]:
            yield await self.astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return one()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` with the scope's memories injected."""
        return self._complete(prompt, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """:meth:`complete`, streamed (each response has the text so far and its ``delta``)."""
        return self._stream_complete(prompt, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the last (user) message; earlier messages are the conversation."""
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """:meth:`chat`, streamed."""
        return self._stream_chat(messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """:meth:`complete` in a worker thread."""
        return await asyncio.to_thread(self._complete, prompt, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """:meth:`chat` in a worker thread."""
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                               ) -> CompletionResponseAsyncGen:
        """:meth:`stream_complete`, each step in a worker thread."""
        return _in_thread(await asyncio.to_thread(self._stream_complete, prompt, kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """:meth:`stream_chat`, each step in a worker thread."""
        return _in_thread(await asyncio.to_thread(self._stream_chat, messages, kwargs))


def _accumulate(parts: Iterator[GenerationChunk], hold: bool = False) -> Iterator[tuple[str, str, Generation | None]]:
    """``(text so far, delta, generation on the last chunk)`` of a streamed answer; with
    ``hold``, only the last (the whole answer, or ``""`` when it is a tool call)."""
    text = ""
    for part in parts:
        text += part.text
        if not hold:
            yield text, part.text, part.generation
        elif part.generation is not None:
            whole = "" if part.generation.tool_calls else text
            yield whole, whole, part.generation


def _answer(text: str, gen: Generation | None) -> ChatMessage:
    """The assistant's message; tool calls (``{"id", "name", "arguments"}``) in ``additional_kwargs``."""
    calls = gen.tool_calls if gen else []
    return ChatMessage(role=MessageRole.ASSISTANT, content="" if calls else text,
                       additional_kwargs={"tool_calls": calls} if calls else {})


async def _in_thread(iterator: Iterator) -> AsyncIterator:
    done = object()
    while (item := await asyncio.to_thread(next, iterator, done)) is not done:
        yield item


def _counters(gen: Generation) -> dict:
    return {
        "mode": gen.mode, "ttft_s": gen.ttft_s, "latency_s": gen.latency_s, "retrieval_s": gen.retrieval_s,
        "num_prompt_tokens": gen.num_prompt_tokens, "num_injected_tokens": gen.num_injected_tokens,
        "num_prefilled_tokens": gen.num_prefilled_tokens, "num_generated_tokens": gen.num_generated_tokens,
        "memory_ids": [m["id"] for m in gen.memories],
        "kv_memory_ids": gen.kv_memory_ids, "text_memory_ids": gen.text_memory_ids,
        "finish_reason": gen.finish_reason,
    }
