"""A chat agent that remembers a user across sessions (LangChain + InferScale).

Each session is a separate conversation: the prompt carries only that session's
messages. What the user said in earlier sessions reaches the model as memories whose
KV InferScale injects into vLLM's cache, so only the new question is prefilled.

    python integrations/langchain/examples/remembering_agent.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import Runnable, RunnablePassthrough
from langchain_inferscale import ChatInferScale, InferScaleChatMessageHistory

from inferscale import Memory

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Keep answers short."),
    MessagesPlaceholder("history"),
    ("human", "{question}"),
])


def build_agent(memory: Memory, **model_options) -> Runnable:
    """The agent: ``{"question", "user_id", "session_id"}`` in, an ``AIMessage`` out.

    It loads the session's messages into the prompt, answers with the user's memories
    injected as KV, and writes the question and the answer back to the session (which
    stores the user's messages as memories, KV precomputed).
    """
    model = ChatInferScale(memory=memory, **model_options)

    def history_of(inputs: dict) -> InferScaleChatMessageHistory:
        return InferScaleChatMessageHistory(memory, inputs["session_id"], user_id=inputs["user_id"])

    def answer(inputs: dict) -> AIMessage:
        reply = (PROMPT | model.bind(user_id=inputs["user_id"])).invoke(inputs)
        history_of(inputs).add_messages([HumanMessage(inputs["question"]), reply])
        return reply

    return RunnablePassthrough.assign(history=lambda inputs: history_of(inputs).messages) | answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="memory store (default: a new temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferscale-agent-") as scratch:  # removed at exit
        run(Memory(data_dir=args.data_dir or scratch))


def run(memory: Memory) -> None:
    """Monday: tell the agent a fact. Tuesday, a new session: ask for it back."""
    agent = build_agent(memory, k=5, max_tokens=32)
    user = "alice"
    for session, question in (("monday", "My dog's name is Biscuit."), ("tuesday", "What is my dog's name?")):
        reply = agent.invoke({"question": question, "user_id": user, "session_id": session})
        meta = reply.response_metadata
        print(f"[{session}] {question}\n  -> {reply.content}\n     ({meta['num_injected_tokens']} prompt tokens "
              f"injected as KV, {meta['num_prefilled_tokens']} prefilled, TTFT {meta['ttft_s'] * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
