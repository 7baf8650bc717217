"""A LangChain agent (``create_agent``) with a LangGraph store over InferScale memory: a tool
saves what the user says through the store in one session, and the next session's answer
is generated with that memory's KV injected.

``InferScaleStore`` keeps the items of the namespace ``("users", <user>, ...)`` as memories
of ``user_id=<user>``, so ``ChatInferScale`` answering as that user retrieves them and
injects their precomputed KV, with no tool call and no prompt history.

The default model (SmolLM2-135M) does not decide to call tools on its own, so in the first
session the middleware forces one ``save_memory`` call (``tool_choice="any"``, decoded under
the tool's JSON Schema), then lets the model answer in text; the second session only
answers (``tool_choice="none"``). With a model trained for tool calling, drop
``tool_choice`` and let it decide.

    python integrations/langchain/examples/store_agent.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from dataclasses import dataclass
from typing import Annotated

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain.tools import ToolRuntime
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_inferscale import ChatInferScale, InferScaleStore
from pydantic import Field

from inferscale import Memory


@dataclass
class UserContext:
    """Who the agent is talking to, and whether this session may save memories."""

    user_id: str
    save: bool = False


@tool
def save_memory(fact: Annotated[str, Field(min_length=3, max_length=60)], runtime: ToolRuntime[UserContext]) -> str:
    """Save a fact about the user for later conversations."""
    runtime.store.put(("users", runtime.context.user_id, "memories"), uuid.uuid4().hex, {"content": fact})
    return f"Saved: {fact}"


@wrap_model_call
def answer_as_user(request: ModelRequest, handler) -> ModelResponse:
    """Every model call answers as the run's user (their memories injected as KV); a saving
    session calls ``save_memory`` once, then answers in text."""
    context = request.runtime.context
    called = isinstance(request.messages[-1], ToolMessage)
    return handler(request.override(
        tool_choice="any" if context.save and not called else "none",
        model_settings={**request.model_settings, "user_id": context.user_id},
    ))


def build_agent(memory: Memory, store: InferScaleStore, **model_options):
    """The agent: ``{"messages": [...]}`` in with ``context=UserContext(user_id, save)``."""
    model = ChatInferScale(memory=memory, **model_options)
    return create_agent(model, tools=[save_memory], middleware=[answer_as_user], context_schema=UserContext,
                        store=store, system_prompt="Answer in one short sentence.")


def run(memory: Memory, store: InferScaleStore, user: str = "alice") -> tuple[dict, dict]:
    """Session 1: the user tells where they live and the agent saves it. Session 2, a new
    thread: the user asks, and the answer is generated with the saved memory as KV.

    Returns:
        The two runs' final states (``{"messages": [...]}``).
    """
    agent = build_agent(memory, store, k=5, max_tokens=64)  # the forced call's JSON fits (the fact is <= 60 chars)
    first = agent.invoke({"messages": [HumanMessage("Please remember this: I live in Lisbon.")]},
                         context=UserContext(user, save=True))
    memory.wait_for_kv()  # the saved memory's KV, encoded in the background
    second = agent.invoke({"messages": [HumanMessage("Which city do I live in?")]}, context=UserContext(user))
    for state in (first, second):
        for message in state["messages"]:
            print(f"[{message.type}] {getattr(message, 'tool_calls', None) or message.content}")
    meta = second["messages"][-1].response_metadata
    print(f"session 2: {meta['num_injected_tokens']} tokens as KV, memories {meta['kv_memory_ids']}")
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="memory store (default: a new temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferscale-store-agent-") as scratch:  # removed at exit
        with Memory(data_dir=args.data_dir or scratch) as memory:  # closing it stops vLLM's engine
            run(memory, InferScaleStore(memory))


if __name__ == "__main__":
    main()
