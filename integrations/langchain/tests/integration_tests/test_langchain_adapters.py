"""LangChain adapter (``langchain-inferscale``) driven the way LangChain drives it, on the
real engine: runnables, ``invoke`` / ``ainvoke`` / ``stream`` / ``astream``."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
from pathlib import Path

import langchain_inferscale
import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from langchain_inferscale import ChatInferScale, InferScaleChatMessageHistory, InferScaleRetriever

from inferscale import Memory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "remembering_agent.py"
FACT, QUESTION = "My dog's name is Biscuit.", "What is my dog's name?"


@pytest.fixture(scope="module")
def memory(serving_dir, engine):
    return Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)


@pytest.fixture
def user() -> str:
    return f"lc-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def agent(memory):
    spec = importlib.util.spec_from_file_location("remembering_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_agent(memory, k=5, max_tokens=24)


def test_public_names():
    assert sorted(langchain_inferscale.__all__) == ["ChatInferScale", "InferScaleChatMessageHistory",
                                                   "InferScaleRetriever", "InferScaleStore"]


def test_fact_told_in_one_session_is_injected_in_the_next(memory, agent, user):
    agent.invoke({"question": FACT, "user_id": user, "session_id": "monday"})
    assert memory.wait_for_kv(timeout=600)  # the fact's KV, encoded in the background
    (fact,) = memory.get_all(user_id=user)["results"]
    assert fact["memory"] == FACT and fact["metadata"] == {"session_id": "monday"}
    expected = memory.inject(QUESTION, user_id=user, k=5)  # what the next request must carry as KV

    reply = agent.invoke({"question": QUESTION, "user_id": user, "session_id": "tuesday"})
    meta = reply.response_metadata
    assert "Biscuit" in reply.content
    assert meta["memory_ids"] == [fact["id"]]
    assert meta["num_injected_tokens"] == expected.memory_tokens  # preamble + the fact line, as KV
    assert meta["num_prefilled_tokens"] <= meta["num_prompt_tokens"] - expected.memory_tokens
    assert reply.usage_metadata["output_tokens"] > 0
    tuesday = InferScaleChatMessageHistory(memory, "tuesday", user_id=user).messages
    assert [type(m) for m in tuesday] == [HumanMessage, AIMessage]  # Monday's words were not in the prompt
    assert [m.content for m in tuesday] == [QUESTION, reply.content]


def test_ainvoke_and_astream_use_the_memory_too(memory, agent, user):
    agent.invoke({"question": FACT, "user_id": user, "session_id": "s1"})
    reply = asyncio.run(agent.ainvoke({"question": QUESTION, "user_id": user, "session_id": "s2"}))
    assert "Biscuit" in reply.content and reply.response_metadata["num_injected_tokens"] > 0
    model = ChatInferScale(memory=memory, user_id=user, k=5, max_tokens=24)

    async def collect():
        return [chunk async for chunk in model.astream(QUESTION)]

    chunks = asyncio.run(collect())
    assert "".join(c.content for c in chunks) == model.invoke(QUESTION).content
    assert chunks[-1].response_metadata["num_injected_tokens"] > 0


def test_stream_yields_the_invoke_answer_in_pieces(memory, user):
    memory.add(FACT, user_id=user)
    model = ChatInferScale(memory=memory, user_id=user, k=3, max_tokens=16)
    chunks = list(model.stream([HumanMessage(QUESTION)]))
    assert len([c for c in chunks if c.content]) > 1
    assert "".join(c.content for c in chunks) == model.invoke([HumanMessage(QUESTION)]).content
    last = chunks[-1]
    assert last.response_metadata["num_injected_tokens"] > 0 and last.usage_metadata["output_tokens"] > 0


def test_langchain_knobs_and_per_call_options(memory, user):
    memory.add(FACT, user_id=user)
    model = ChatInferScale(memory=memory, user_id=user, k=3, max_tokens=16)
    assert "Biscuit" not in model.invoke(QUESTION, stop=["Biscuit"]).content
    assert model.invoke(QUESTION, max_tokens=2).usage_metadata["output_tokens"] <= 2
    text = model.invoke(QUESTION, mode="text").response_metadata
    assert text["num_injected_tokens"] == 0 and text["num_prefilled_tokens"] == text["num_prompt_tokens"]
    none = model.invoke(QUESTION, k=0).response_metadata
    assert none["memory_ids"] == [] and none["num_injected_tokens"] > 0  # the preamble alone
    sys = model.invoke([SystemMessage("Answer in one word."), HumanMessage(QUESTION)]).response_metadata
    assert sys["num_injected_tokens"] > 0  # system text goes after the memories: their KV is unchanged
    chain = ChatPromptTemplate.from_messages([("human", "{q}")]) | model.bind(temperature=0.7, k=1)
    assert isinstance(chain.invoke({"q": QUESTION}), AIMessage)


@tool
def add_numbers(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_bad_input_gets_a_clear_error(memory, user):
    memory.add(FACT, user_id=user)
    model = ChatInferScale(memory=memory, user_id=user)
    with pytest.raises(TypeError, match="valid per-call options"):
        model.invoke(QUESTION, top_p=0.9)
    with pytest.raises(ValueError, match="no HumanMessage"):
        model.invoke([SystemMessage("Be brief."), AIMessage("Biscuit.")])
    with pytest.raises(ValueError, match="message 0 .* has no text"):
        model.invoke([HumanMessage(" "), AIMessage("Hi"), HumanMessage(QUESTION)])
    with pytest.raises(ValueError, match="names no given tool"):
        model.bind_tools([add_numbers], tool_choice="multiply").invoke(QUESTION)
    with pytest.raises(ValueError, match="method must be"):
        model.with_structured_output({"title": "Pet", "type": "object", "properties": {}}, method="xml")
    with pytest.raises(ValueError, match="k must be >= 1"):
        InferScaleRetriever(memory=memory, user_id=user).invoke("pets", k=0)
    with pytest.raises(ValueError, match="user_id, agent_id or run_id"):
        ChatInferScale(memory=memory).invoke(QUESTION)
    with pytest.raises(TypeError, match="memory"):
        ChatInferScale(memory="not a memory")
    unknown = ChatInferScale(memory=memory, user_id=f"new-{user}", allow_unknown_scope=False)
    with pytest.raises(KeyError, match="no memories"):
        unknown.invoke(QUESTION)


def test_chat_history_logs_turns_and_stores_user_messages_as_memories(memory, user):
    history = InferScaleChatMessageHistory(memory, "s1", user_id=user)
    history.add_user_message("I live in Lisbon.")
    history.add_ai_message("Lisbon is lovely.")
    asyncio.run(history.aadd_messages([HumanMessage("I am allergic to peanuts.")]))
    msgs = history.messages
    assert [(type(m), m.content) for m in msgs] == [(HumanMessage, "I live in Lisbon."), (AIMessage, "Lisbon is lovely."),
                                                    (HumanMessage, "I am allergic to peanuts.")]
    assert asyncio.run(history.aget_messages()) == msgs
    stored = memory.get_all(user_id=user)["results"]
    assert sorted(r["memory"] for r in stored) == ["I am allergic to peanuts.", "I live in Lisbon."]
    assert {tuple(r["source_turn_ids"]) for r in stored} == {(msgs[0].id,), (msgs[2].id,)}  # provenance
    assert [t.content for t in memory.get_turns(user_id=user)] == [m.content for m in msgs]

    other = InferScaleChatMessageHistory(memory, "s2", user_id=user)
    assert other.messages == []
    with pytest.raises(ValueError, match="has no text"):
        other.add_messages([HumanMessage("fine"), HumanMessage("")])
    assert other.messages == []  # nothing written

    # an agent's tool-using turn comes back whole: an AI message that only calls a tool, its result
    turn = [HumanMessage("What is 2 + 3?"),
            AIMessage("", tool_calls=[{"name": "add_numbers", "args": {"a": 2, "b": 3}, "id": "c1"}]),
            ToolMessage("5", tool_call_id="c1", name="add_numbers"), ToolMessage("", tool_call_id="c2"),
            AIMessage("It is 5.")]
    other.add_messages(turn)
    back = other.messages
    assert [type(m) for m in back] == [type(m) for m in turn]
    assert back[1].tool_calls == turn[1].tool_calls and back[1].content == ""
    assert (back[2].tool_call_id, back[2].name, back[2].content) == ("c1", "add_numbers", "5")
    assert back[3].tool_call_id == "c2" and back[3].content == ""
    other.clear()
    history.clear()
    assert history.messages == [] and memory.get_turns(user_id=user) == []
    assert len(memory.get_all(user_id=user)["results"]) == 3  # memories are the user's, not the session's
    with pytest.raises(ValueError, match="session_id"):
        InferScaleChatMessageHistory(memory, "", user_id=user)


def test_retriever_returns_scored_documents(memory, user):
    memory.add(FACT, user_id=user, metadata={"topic": "pets"})
    memory.add("I live in Lisbon.", user_id=user, metadata={"topic": "home"})
    retriever = InferScaleRetriever(memory=memory, user_id=user, k=2)
    docs = retriever.invoke("my pet dog")
    assert all(isinstance(d, Document) for d in docs)
    assert [d.page_content for d in docs] == [FACT, "I live in Lisbon."]
    assert docs[0].metadata["score"] > docs[1].metadata["score"]
    assert docs[0].metadata["topic"] == "pets" and docs[0].metadata["user_id"] == user and docs[0].id
    assert asyncio.run(retriever.ainvoke("my pet dog")) == docs
    filtered = InferScaleRetriever(memory=memory, user_id=user, filters={"topic": "home"}).invoke("my pet dog")
    assert [d.page_content for d in filtered] == ["I live in Lisbon."]
    assert InferScaleRetriever(memory=memory, user_id=f"other-{user}").invoke("dog") == []


def test_empty_tool_results_untitled_schemas_and_search_mode(memory, user):
    from langchain_core.messages import ToolMessage

    memory.add(FACT, user_id=user)
    model = ChatInferScale(memory=memory, user_id=user, k=3, max_tokens=24)
    call = AIMessage("", tool_calls=[{"name": "add_numbers", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}])
    reply = model.bind_tools([add_numbers]).invoke([HumanMessage("What is 1 + 2?"), call,
                                                    ToolMessage("", tool_call_id="c1")])  # the tool returned nothing
    assert isinstance(reply, AIMessage) and reply.response_metadata["memory_ids"]
    pet = model.with_structured_output({"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}},
                                        "required": ["name"]}).invoke("What is my dog's name?")
    assert set(pet) == {"name"}
    with pytest.raises(ValueError, match="needs a 'title'"):
        model.with_structured_output({"type": "object", "properties": {}}, method="function_calling")
    retriever = InferScaleRetriever(memory=memory, user_id=user, k=1)
    dense = retriever.invoke("dog", mode="dense")
    assert [d.id for d in dense] == [d.id for d in InferScaleRetriever(memory=memory, user_id=user, k=1,
                                                                      mode="dense").invoke("dog")]
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
