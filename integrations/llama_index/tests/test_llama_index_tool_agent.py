"""The LlamaIndex agent example (``examples/tool_agent.py``), run on the real engine: the
``FunctionAgent`` calls the tool with the argument the user's memory holds, and the
memory reached the model as injected KV."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

from inferscale import Memory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_agent.py"


def _example():
    """``examples/tool_agent.py`` as a module."""
    spec = importlib.util.spec_from_file_location("llama_index_tool_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    return example


def test_function_agent_calls_the_tool_with_what_the_user_said_in_an_earlier_session(serving_dir, engine):
    example = _example()
    memory = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    user = f"li-agent-{uuid.uuid4().hex[:8]}"
    calls, outputs = example.run(memory, user)

    (call,) = calls
    assert call.tool_name == "get_weather" and "Lisbon" in call.tool_kwargs["city"]
    assert "Lisbon" in call.tool_output.content
    lisbon = [m["id"] for m in memory.get_all(user_id=user)["results"] if m["memory"] == "I live in Lisbon."]
    assert len(lisbon) == 1
    first, last = outputs[0], outputs[-1]
    assert first.tool_calls and first.tool_calls[0].tool_name == "get_weather"
    for out in (first, last):  # both LLM calls answered with the user's memory as KV
        assert lisbon[0] in out.raw.kv_memory_ids and out.raw.num_injected_tokens > 0
    assert last.response.content.strip() and not last.raw.tool_calls  # the answer is text


def test_function_agent_over_a_chat_memory_buffer_on_the_chat_store_runs_several_turns(serving_dir, engine):
    """The agent's chat memory is a ``ChatMemoryBuffer`` on ``InferScaleChatStore``: each run
    writes its tool-using turn there (an assistant message that only calls the tool, the
    tool's result) and the next run reads it back whole as its history."""
    import asyncio

    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.storage.chat_store.inferscale import InferScaleChatStore

    example = _example()
    memory = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    user = f"li-buffer-{uuid.uuid4().hex[:8]}"
    store = InferScaleChatStore(memory, user_id=user)
    buffer = ChatMemoryBuffer.from_defaults(chat_store=store, chat_store_key="tuesday", token_limit=3000)
    agent = example.build_agent(memory, user, k=5, max_tokens=32)

    async def turn(question: str):
        handler = agent.run(user_msg=question, memory=buffer)
        await handler
        return handler

    for question in ("What is the weather like in Porto?", "And in Lisbon?"):
        asyncio.run(turn(question))
    saved = store.get_messages("tuesday")
    calls = [m for m in saved if m.role.value == "assistant" and m.additional_kwargs.get("tool_calls")]
    results = [m for m in saved if m.role.value == "tool"]
    assert len(calls) == 2 and len(results) == 2  # both runs' tool-using turns, kept whole
    assert all(r.additional_kwargs.get("tool_call_id") for r in results)
    assert [m.content for m in saved if m.role.value == "user"] == ["What is the weather like in Porto?",
                                                                      "And in Lisbon?"]
    assert any("Porto" in (r.content or "") for r in results)
