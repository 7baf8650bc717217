"""A LlamaIndex ``FunctionAgent`` with one tool and InferScale memory: what the user said in
an earlier session decides the tool's arguments in a new one.

Monday's conversation is stored in the user's InferScale memory (their messages become
memories, KV precomputed). On Tuesday, a new agent run with no chat history, the user
asks for the weather "where I live": ``InferScaleLLM``, the user's memories injected as
KV, calls ``get_weather`` with the city it remembers and answers from the tool's result.

The default model (SmolLM2-135M) does not decide to call tools on its own, so the LLM is
made with ``call_tools_first=True``: one forced tool call per question (decoded under the
tool's JSON Schema), then a text answer. With a model trained for tool calling, leave it off.

    python integrations/llama_index/examples/tool_agent.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool
from llama_index.llms.inferscale import InferScaleLLM

from inferscale import Memory


def get_weather(city: str) -> str:
    """Get today's weather in a city."""
    return f"It is sunny and 24 degrees in {city} today."


def build_agent(memory: Memory, user_id: str, **llm_options) -> FunctionAgent:
    """The agent, answering as ``user_id`` with their memories injected as KV."""
    llm = InferScaleLLM(memory=memory, user_id=user_id, call_tools_first=True, **llm_options)
    return FunctionAgent(tools=[FunctionTool.from_defaults(get_weather)], llm=llm,
                         system_prompt="Answer in one short sentence.")


async def ask(agent: FunctionAgent, question: str) -> tuple[list[ToolCallResult], list[AgentOutput]]:
    """Run the agent on ``question``; the tool calls it made and the LLM's outputs, in order."""
    handler = agent.run(user_msg=question)
    calls, outputs = [], []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            calls.append(event)
        elif isinstance(event, AgentOutput):
            outputs.append(event)
    await handler
    return calls, outputs


def run(memory: Memory, user: str = "alice") -> tuple[list[ToolCallResult], list[AgentOutput]]:
    """Monday: the user says where they live. Tuesday, a new run: ask for the weather there."""
    memory.add([{"role": "user", "content": "I live in Lisbon."},
                {"role": "assistant", "content": "Noted, you live in Lisbon."}],
               user_id=user, infer=False, metadata={"session_id": "monday"})
    memory.wait_for_kv()  # Monday's memories' KV, encoded in the background
    agent = build_agent(memory, user, k=5, max_tokens=48)
    calls, outputs = asyncio.run(ask(agent, "What is the weather like where I live?"))
    for call in calls:
        print(f"[tool] {call.tool_name}({call.tool_kwargs}) -> {call.tool_output.content}")
    print(f"[answer] {outputs[-1].response.content}")
    return calls, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="memory store (default: a new temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferscale-agent-") as scratch:  # removed at exit
        with Memory(data_dir=args.data_dir or scratch) as memory:  # closing it stops vLLM's engine
            run(memory)


if __name__ == "__main__":
    main()
