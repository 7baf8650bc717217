"""A LangChain agent (``create_agent``) with one tool and InferScale memory: what the user
said in an earlier session decides the tool's arguments in a new one.

Monday's conversation is kept by ``InferScaleChatMessageHistory`` (the user's messages
become memories, their KV precomputed). On Tuesday, a new session with an empty prompt
history, the user asks for the weather "where I live": the model, its system turn holding
the user's memories as injected KV, calls ``get_weather`` with the city it remembers, and
answers from the tool's result.

The default model (SmolLM2-135M) does not decide to call tools on its own, so the agent's
middleware forces one tool call per question (``tool_choice="any"``, decoded under the
tool's JSON Schema), then lets the model answer in text (``tool_choice="none"``). With a
model trained for tool calling, drop ``tool_choice`` and let it decide.

    python integrations/langchain/examples/tool_agent.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_inferscale import ChatInferScale, InferScaleChatMessageHistory

from inferscale import Memory


@tool
def get_weather(city: str) -> str:
    """Get today's weather in a city."""
    return f"It is sunny and 24 degrees in {city} today."


@dataclass
class UserContext:
    """Who the agent is talking to (``agent.invoke(..., context=UserContext("alice"))``)."""

    user_id: str


@wrap_model_call
def answer_as_user(request: ModelRequest, handler) -> ModelResponse:
    """Every model call answers as the run's user (their memories injected as KV); one tool
    call per question, then a text answer."""
    called = isinstance(request.messages[-1], ToolMessage)
    return handler(request.override(
        tool_choice="none" if called else "any",
        model_settings={**request.model_settings, "user_id": request.runtime.context.user_id},
    ))


def build_agent(memory: Memory, **model_options):
    """The agent: ``{"messages": [...]}`` in with ``context=UserContext(user_id)``; its
    messages (the tool call, the tool's result, the answer) out."""
    model = ChatInferScale(memory=memory, **model_options)
    return create_agent(model, tools=[get_weather], middleware=[answer_as_user], context_schema=UserContext,
                        system_prompt="Answer in one short sentence.")


def run(memory: Memory, user: str = "alice") -> dict:
    """Monday: the user says where they live. Tuesday, a new session: ask for the weather there.

    Returns:
        The Tuesday run's final state (``{"messages": [...]}``).
    """
    monday = InferScaleChatMessageHistory(memory, "monday", user_id=user)
    monday.add_messages([HumanMessage("I live in Lisbon."), AIMessage("Noted, you live in Lisbon.")])
    memory.wait_for_kv()  # Monday's memories' KV, encoded in the background
    agent = build_agent(memory, k=5, max_tokens=48)
    state = agent.invoke({"messages": [HumanMessage("What is the weather like where I live?")]},
                         context=UserContext(user))
    for message in state["messages"]:
        calls = getattr(message, "tool_calls", None)
        print(f"[{message.type}] {calls or message.content}")
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="memory store (default: a new temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferscale-agent-") as scratch:  # removed at exit
        with Memory(data_dir=args.data_dir or scratch) as memory:  # closing it stops vLLM's engine
            run(memory)


if __name__ == "__main__":
    main()
