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


def test_function_agent_calls_the_tool_with_what_the_user_said_in_an_earlier_session(serving_dir, engine):
    spec = importlib.util.spec_from_file_location("llama_index_tool_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
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
