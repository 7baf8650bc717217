"""The LangChain agent example (``examples/tool_agent.py``), run on the real engine: the
tool is called with the argument the user's memory holds, and the memory reached the
model as injected KV."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from inferscale import Memory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent.py"


def _example():
    spec = importlib.util.spec_from_file_location("langchain_tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_agent_calls_the_tool_with_what_the_user_said_in_an_earlier_session(serving_dir, engine):
    memory = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    user = f"lc-agent-{uuid.uuid4().hex[:8]}"
    state = _example().run(memory, user)

    question, call, result, answer = state["messages"]
    assert isinstance(question, HumanMessage) and isinstance(result, ToolMessage) and isinstance(answer, AIMessage)
    (tool_call,) = call.tool_calls
    assert tool_call["name"] == "get_weather"
    assert "Lisbon" in tool_call["args"]["city"]  # known only from Monday's session
    assert result.tool_call_id == tool_call["id"] and "Lisbon" in result.content

    lisbon = [m["id"] for m in memory.search("I live in Lisbon.", user_id=user)["results"]
              if m["memory"] == "I live in Lisbon."]
    for reply in (call, answer):  # both model calls answered with the user's memory as KV
        meta = reply.response_metadata
        assert lisbon[0] in meta["memory_ids"] and lisbon[0] in meta["kv_memory_ids"]
        assert meta["num_injected_tokens"] > 0
    assert answer.content.strip() and not answer.tool_calls
