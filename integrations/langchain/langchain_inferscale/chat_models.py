"""``ChatInferScale``: a LangChain chat model served by vLLM with memories injected as KV."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field

from inferscale import Generation, GenerationOptions
from inferscale.integration import check_call_options
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

    Agents: :meth:`bind_tools` (``AIMessage.tool_calls``; a forced ``tool_choice`` is
    decoded under the tool's JSON Schema by vLLM's structured outputs, so any model calls
    it) and :meth:`with_structured_output` (``json_schema``, ``function_calling`` or
    ``json_mode``). Tool calls and tool results in the messages are rendered for the next
    turn; the last human message is what memories are retrieved for.

    Attributes:
        memory: the InferScale memory (its engine starts on first use).
        user_id / agent_id / run_id: whose memories (at least one, here or per call).
        k, context_window, mode, temperature, stop, logprobs: the generation options
            (:class:`inferscale.GenerationOptions`; ``stop`` also per call as ``stop=``).
        max_tokens: answer budget (tokens, default 256).
        allow_unknown_scope: answer a user with no memories yet (a new user's first
            message) without memories; ``False`` raises ``UnknownScopeError``.
        streaming: ``invoke`` streams internally (callbacks see each token), as LangChain's
            ``streaming=True`` does for other chat models.

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

    # a misspelt argument is refused (BaseChatModel ignores unknown ones)
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=256, ge=1, strict=True)  # chat answers run longer than Memory's 64
    allow_unknown_scope: bool = Field(default=True, strict=True)
    streaming: bool = Field(default=False, strict=True)

    @property
    def _llm_type(self) -> str:
        return "inferscale"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.memory.config.llm, "mode": self.mode, "k": self.k,
                "context_window": self.context_window, "temperature": self.temperature,
                "max_tokens": self.max_tokens}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith's standard tracing parameters (provider, model name, temperature, ...); a
        ``model`` in ``kwargs`` is reported as the model name, as LangChain's tracing expects."""
        params = LangSmithParams(ls_provider="inferscale", ls_model_name=kwargs.get("model", self.memory.config.llm),
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | bool | dict | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` offered on every call.

        Args:
            tools: LangChain tools, functions, pydantic models, TypedDicts or OpenAI tool
                dicts (converted with ``convert_to_openai_tool``).
            tool_choice: ``None`` / ``"auto"`` (the model decides), ``"none"``, ``"any"`` /
                ``"required"`` / ``True`` (a call is forced), or a tool's name (that tool is
                forced); a forced call is decoded under the tool's JSON Schema.

        Raises:
            TypeError: ``tools`` is not a list of tools, or ``tool_choice`` of a wrong type.
            ValueError: a tool that cannot be converted; when the model is called, duplicate
                tool names or a ``tool_choice`` naming no bound tool.
        """
        if isinstance(tools, (str, dict)) or not isinstance(tools, Sequence):
            raise TypeError(f"tools must be a list of tools, got {type(tools).__name__}")
        for i, t in enumerate(tools):
            if not isinstance(t, (dict, type, BaseTool)) and not callable(t):
                raise TypeError(f"tool {i} must be a LangChain tool, a function, a pydantic model, a TypedDict or an "
                                f"OpenAI tool dict, got {type(t).__name__} {t!r}")
        formatted = [_openai_tool(i, t) for i, t in enumerate(tools)]
        choice = "required" if tool_choice is True else (None if tool_choice is False else tool_choice)
        if choice is not None and not isinstance(choice, (str, dict)):  # its value is checked per call
            raise TypeError(f"tool_choice must be None, True/False, 'auto', 'none', 'any', 'required', a tool name "
                            f"or an OpenAI tool_choice dict, got {type(choice).__name__} {choice!r}")
        return self.bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(self, schema: dict | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """This model returning ``schema``-shaped output.

        Args:
            schema: a pydantic model (v2 or v1), a TypedDict, or a JSON Schema / OpenAI
                function dict; a pydantic model gives instances, the others dicts.
            method: ``"json_schema"`` (default: the answer is decoded under the schema by
                vLLM's structured outputs), ``"function_calling"`` (a forced call of a tool
                with the schema as its parameters), ``"json_mode"`` (any JSON object; say
                the keys in the prompt).
            include_raw: return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.
            strict: accepted as OpenAI's chat models take it; ``json_schema`` and
                ``function_calling`` always decode under the schema here, whatever it says.

        Raises:
            ValueError: an unknown ``method``, or unexpected keyword arguments.
        """
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)} for with_structured_output")
        if not isinstance(schema, (dict, type)):
            raise TypeError(f"schema must be a pydantic model, a TypedDict or a JSON Schema dict, got "
                            f"{type(schema).__name__}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        plain = isinstance(schema, dict) and "title" not in schema and "function" not in schema
        if plain and method == "function_calling":
            raise ValueError("a JSON Schema for method='function_calling' needs a 'title' (the tool's name, letters, "
                             "digits and _): add one, or use method='json_schema'")
        json_schema = schema if plain else convert_to_json_schema(schema)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method, "strict": strict}, "schema": json_schema}}
        if method == "json_schema":
            llm = self.bind(json_schema=json_schema, **trace)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        elif method == "json_mode":
            llm = self.bind(json_schema={"type": "object"}, **trace)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        elif method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **trace)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        # parse the whole answer once (a stream yields one complete object, not partial ones)
        whole = RunnableLambda(parser.invoke, afunc=parser.ainvoke)
        if not include_raw:
            return llm | whole
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | whole, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        check_call_options("ChatInferScale", kwargs, CALL_OPTIONS)
        query, history, instructions, followup = split_prompt(messages)
        overrides = {name: kwargs[name] for name in self.option_names() if name in kwargs}
        if stop is not None:
            overrides["stop"] = stop
        scope = {name: kwargs.get(name, getattr(self, name)) for name in ("user_id", "agent_id", "run_id")}
        return dict(query=query, **scope, history=history, instructions=instructions, followup=followup,
                    allow_unknown_scope=self.allow_unknown_scope, options=self.options().merged(**overrides))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        gen = self.memory.generate(**self._request(messages, stop, kwargs))
        calls = [{"name": c["name"], "args": c["arguments"], "id": c["id"], "type": "tool_call"} for c in gen.tool_calls]
        message = AIMessage("" if calls else gen.text, tool_calls=calls,
                            response_metadata=_metadata(gen, self.memory.config.llm), usage_metadata=_usage(gen))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        # with tools offered, the text may turn out to be a call: it is sent whole, at the end
        hold = bool(request["options"].offered_tools())
        for part in self.memory.stream(**request):
            gen = part.generation
            if hold and gen is None:
                continue
            calls = gen.tool_calls if gen else []
            text = gen.text if hold and not calls else ("" if calls else part.text)
            chunk = ChatGenerationChunk(message=AIMessageChunk(
                content=text,
                tool_call_chunks=[{"name": c["name"], "args": json.dumps(c["arguments"]), "id": c["id"], "index": i,
                                   "type": "tool_call_chunk"} for i, c in enumerate(calls)],
                response_metadata=_metadata(gen, self.memory.config.llm) if gen else {},
                usage_metadata=_usage(gen) if gen else None,
                chunk_position="last" if gen else None,
            ))
            if run_manager and text:
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk


def _metadata(gen: Generation, model_name: str) -> dict:
    return {
        "model_name": model_name, "mode": gen.mode, "ttft_s": gen.ttft_s, "latency_s": gen.latency_s,
        "retrieval_s": gen.retrieval_s, "num_prompt_tokens": gen.num_prompt_tokens,
        "num_injected_tokens": gen.num_injected_tokens, "num_prefilled_tokens": gen.num_prefilled_tokens,
        "memory_ids": [m["id"] for m in gen.memories],
        "kv_memory_ids": gen.kv_memory_ids, "text_memory_ids": gen.text_memory_ids,
        "finish_reason": gen.finish_reason,
    }


def _usage(gen: Generation) -> UsageMetadata:
    return UsageMetadata(input_tokens=gen.num_prompt_tokens, output_tokens=gen.num_generated_tokens,
                         total_tokens=gen.num_prompt_tokens + gen.num_generated_tokens,
                         input_token_details={"cache_read": gen.num_prompt_tokens - gen.num_prefilled_tokens})


def _openai_tool(i: int, tool: Any) -> dict:
    """``convert_to_openai_tool(tool)``, its multi-line error turned into one line naming the tool."""
    try:
        return convert_to_openai_tool(tool)
    except (ValueError, TypeError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise ValueError(f"tool {i} cannot be converted to an OpenAI tool: {first}") from None
