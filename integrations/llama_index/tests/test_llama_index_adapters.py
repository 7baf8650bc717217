"""LlamaIndex adapter (``llama-index-inferscale``) driven the way LlamaIndex drives it, on
the real engine: ``SimpleChatEngine`` over ``ChatMemoryBuffer`` / ``Memory``."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.memory import Memory as LlamaMemory
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.inferscale import InferScaleLLM
from llama_index.memory.inferscale import InferScaleMemoryBlock
from llama_index.storage.chat_store.inferscale import InferScaleChatStore
from pydantic import BaseModel, Field

from inferscale import Memory

FACT, QUESTION = "My dog's name is Biscuit.", "What is my dog's name?"


class ChatEnds(BaseEventHandler):
    """Collects the LLM chat responses LlamaIndex's instrumentation reports."""

    responses: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "ChatEnds"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.responses.append(event.response)


@pytest.fixture(scope="module")
def memory(serving_dir, engine):
    return Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)


@pytest.fixture(scope="module")
def chat_ends():
    handler = ChatEnds()
    get_dispatcher().add_event_handler(handler)
    return handler


@pytest.fixture
def user() -> str:
    return f"li-{uuid.uuid4().hex[:8]}"


def _user(role: str, text: str) -> ChatMessage:
    return ChatMessage(role=role, content=text)


def test_simple_chat_engine_over_the_chat_store_remembers_across_sessions(memory, user, chat_ends):
    store = InferScaleChatStore(memory, user_id=user)
    llm = InferScaleLLM(memory=memory, user_id=user, k=5, max_tokens=24)

    def engine(session: str) -> SimpleChatEngine:
        buffer = ChatMemoryBuffer.from_defaults(chat_store=store, chat_store_key=session, token_limit=2000)
        return SimpleChatEngine.from_defaults(llm=llm, memory=buffer)

    engine("monday").chat(FACT)
    assert memory.wait_for_kv(timeout=600)  # the fact's KV, encoded in the background
    answer = engine("tuesday").chat(QUESTION)
    response = chat_ends.responses[-1]
    assert "Biscuit" in answer.response and response.message.content == answer.response
    fact = next(r for r in memory.get_all(user_id=user)["results"] if r["memory"] == FACT)
    counters = response.additional_kwargs
    assert fact["id"] in counters["memory_ids"]
    # the memory block came as KV, not prefilled: the preamble and every stored line whose KV
    # was encoded (the question itself is stored in the same turn, so it may come as text)
    assert fact["id"] in counters["kv_memory_ids"]
    kv_lines = {r["id"]: r["memory"] for r in memory.get_all(user_id=user)["results"]}
    assert counters["num_injected_tokens"] == len(memory.components.prompts.preamble_ids) + sum(
        memory.fact_tokens(kv_lines[i]) for i in counters["kv_memory_ids"])
    assert counters["num_prefilled_tokens"] <= counters["num_prompt_tokens"] - counters["num_injected_tokens"]
    assert [m.content for m in store.get_messages("tuesday")] == [QUESTION, answer.response]
    assert store.get_keys() == ["monday", "tuesday"]

    later = asyncio.run(engine("wednesday").achat(QUESTION))
    assert "Biscuit" in later.response and chat_ends.responses[-1].additional_kwargs["num_injected_tokens"] > 0


def test_memory_block_writes_flushed_messages_and_feeds_the_next_session(memory, user):
    block = InferScaleMemoryBlock(memory=memory, user_id=user, k=3)
    monday = LlamaMemory.from_defaults(session_id="monday", token_limit=40, chat_history_token_ratio=0.5,
                                       token_flush_size=10, memory_blocks=[block])
    for role, text in (("user", FACT), ("assistant", "What a lovely name!"), ("user", "I also like tea."),
                       ("assistant", "Noted."), ("user", "Thanks, bye for now.")):
        monday.put(_user(role, text))  # the oldest turns overflow into the block
    stored = {r["memory"] for r in memory.get_all(user_id=user)["results"]}
    assert FACT in stored and "What a lovely name!" not in stored  # user messages become memories
    turns = memory.get_turns(user_id=user)
    assert turns[0].content == FACT and turns[0].metadata == {"session_id": "monday"}

    tuesday = LlamaMemory.from_defaults(session_id="tuesday", token_limit=2000, memory_blocks=[block])
    shown = tuesday.get(input=QUESTION)
    assert any(FACT in (m.content or "") for m in shown if m.role == MessageRole.SYSTEM)

    silent = InferScaleMemoryBlock(memory=memory, user_id=user, include_text=False)
    llm = InferScaleLLM(memory=memory, user_id=user, k=3, max_tokens=24)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=LlamaMemory.from_defaults(
        session_id="thursday", token_limit=2000, memory_blocks=[silent]))
    answer = chat.chat(QUESTION)
    assert "Biscuit" in answer.response


def test_llm_complete_stream_and_chat(memory, user):
    memory.add(FACT, user_id=user)
    llm = InferScaleLLM(memory=memory, user_id=user, k=3, max_tokens=16)
    done = llm.complete(QUESTION)
    assert "Biscuit" in done.text
    assert done.additional_kwargs["num_injected_tokens"] > 0 and done.additional_kwargs["num_generated_tokens"] > 0
    parts = list(llm.stream_complete(QUESTION))
    assert len(parts) > 1 and "".join(p.delta for p in parts) == parts[-1].text == done.text
    assert parts[-1].additional_kwargs["num_injected_tokens"] > 0

    chat = llm.chat([_user("system", "Answer briefly."), _user("user", "Hi!"), _user("assistant", "Hello!"),
                     _user("user", QUESTION)])
    assert chat.message.role == MessageRole.ASSISTANT and chat.additional_kwargs["num_injected_tokens"] > 0
    streamed = list(llm.stream_chat([_user("user", QUESTION)]))
    assert streamed[-1].message.content == "".join(r.delta for r in streamed)

    async def run():
        a = await llm.acomplete(QUESTION)
        gen = await llm.astream_complete(QUESTION)
        b = [r async for r in gen]
        c = await llm.achat([_user("user", QUESTION)])
        gen = await llm.astream_chat([_user("user", QUESTION)])
        d = [r async for r in gen]
        return a, b, c, d

    a, b, c, d = asyncio.run(run())
    assert a.text == b[-1].text == done.text and c.message.content == d[-1].message.content
    text_mode = llm.complete(QUESTION, mode="text").additional_kwargs
    assert text_mode["num_injected_tokens"] == 0
    assert "Biscuit" not in llm.complete(QUESTION, stop=["Biscuit"]).text
    assert llm.metadata.is_chat_model and llm.metadata.context_window == 4096


def test_llm_bad_input_gets_a_clear_error(memory, user):
    memory.add(FACT, user_id=user)
    llm = InferScaleLLM(memory=memory, user_id=user)
    with pytest.raises(TypeError, match="valid per-call options"):
        llm.complete(QUESTION, top_p=0.5)
    with pytest.raises(ValueError, match="no user message"):
        llm.chat([_user("system", "Be brief."), _user("assistant", "Biscuit")])
    with pytest.raises(TypeError, match="message 1 must be a llama_index ChatMessage"):
        llm.chat([_user("user", QUESTION), {"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="names no given tool"):
        llm.chat([_user("user", QUESTION)], tools=[_ADD.metadata.to_openai_tool()], tool_choice="multiply")
    with pytest.raises(ValueError, match="has no text"):
        llm.chat([_user("user", "  ")])
    with pytest.raises(TypeError, match="memory"):
        InferScaleLLM(memory=None)


class Pet(BaseModel):
    """A pet and its owner."""

    name: str = Field(max_length=40)
    species: str = Field(max_length=20)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


_ADD = FunctionTool.from_defaults(add)


def test_structured_predict_and_as_structured_llm_decode_under_the_schema(memory, user):
    memory.add(FACT, user_id=user)
    llm = InferScaleLLM(memory=memory, user_id=user, k=3, max_tokens=64)
    pet = llm.structured_predict(Pet, PromptTemplate("Describe my dog as a {kind}."), kind="pet record")
    assert isinstance(pet, Pet) and pet.name and pet.species
    structured = llm.as_structured_llm(Pet).chat([_user("user", "Describe my dog.")])
    assert isinstance(structured.raw, Pet) and Pet.model_validate_json(structured.message.content) == structured.raw
    assert isinstance(asyncio.run(llm.astructured_predict(Pet, PromptTemplate("Describe my dog."))), Pet)
    (streamed,) = list(llm.stream_structured_predict(Pet, PromptTemplate("Describe my dog.")))
    assert isinstance(streamed, Pet) and streamed.name


def test_function_calling_llm_calls_a_forced_tool_and_answers_from_its_result(memory, user):
    memory.add(FACT, user_id=user)
    llm = InferScaleLLM(memory=memory, user_id=user, k=3, max_tokens=48)
    assert llm.metadata.is_function_calling_model
    response = llm.chat_with_tools([_ADD], user_msg="What is 2 + 3?", tool_required=True)
    (selection,) = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "add" and set(selection.tool_kwargs) == {"a", "b"}
    assert not response.message.content and response.additional_kwargs["memory_ids"]  # a call, no text
    called = llm.predict_and_call([_ADD], user_msg="What is 2 + 3?", tool_required=True)
    assert called.sources[0].tool_name == "add" and called.response == str(add(**selection.tool_kwargs))

    # the call and its result go back as the conversation; the answer is text
    answer = llm.chat([_user("user", "What is 2 + 3?"), response.message,
                       ChatMessage(role=MessageRole.TOOL, content=called.response,
                                   additional_kwargs={"tool_call_id": selection.tool_id})])
    assert answer.message.content.strip() and "tool_calls" not in answer.message.additional_kwargs
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(answer)
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []

    class SdkCall:  # what OpenAI's LlamaIndex LLM leaves in a history: SDK objects, not dicts
        def model_dump(self):
            return {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}

    again = llm.chat([_user("user", "What is 2 + 3?"),
                      ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [SdkCall()]}),
                      ChatMessage(role=MessageRole.TOOL, content="", additional_kwargs={"tool_call_id": "c1"})])
    assert again.additional_kwargs["memory_ids"]  # an SDK-object call and an empty tool result are rendered


def test_chat_store_implements_every_method(memory, user):
    store = InferScaleChatStore(memory, user_id=user)
    msgs = [_user("user", "I live in Lisbon."), _user("assistant", "Nice."), _user("user", "I like tea.")]
    store.set_messages("a", msgs)
    assert [(m.role, m.content) for m in store.get_messages("a")] == [(m.role, m.content) for m in msgs]
    store.add_message("a", _user("assistant", "Noted."))
    with pytest.raises(ValueError, match="appended"):
        store.add_message("a", _user("user", "x"), idx=0)
    assert store.delete_message("a", 1).content == "Nice."
    assert store.delete_message("a", 9) is None
    assert store.delete_last_message("a").content == "Noted."
    assert [m.content for m in store.get_messages("a")] == ["I live in Lisbon.", "I like tea."]
    before = len(memory.get_all(user_id=user)["results"])
    store.set_messages("a", [msgs[0], _user("user", "I like coffee.")])  # keeps the common prefix
    assert [m.content for m in store.get_messages("a")] == ["I live in Lisbon.", "I like coffee."]
    assert len(memory.get_all(user_id=user)["results"]) == before + 1

    async def run():
        await store.async_add_message("b", _user("user", "I run marathons."))
        await store.aset_messages("c", [_user("user", "I have two cats.")])
        got = await store.aget_messages("b")
        keys = await store.aget_keys()
        last = await store.adelete_last_message("c")
        one = await store.adelete_message("b", 0)
        gone = await store.adelete_messages("a")
        return got, keys, last, one, gone

    got, keys, last, one, gone = asyncio.run(run())
    assert [m.content for m in got] == ["I run marathons."] and keys == ["a", "b", "c"]
    assert last.content == "I have two cats." and one.content == "I run marathons."
    assert [m.content for m in gone] == ["I live in Lisbon.", "I like coffee."]
    assert store.get_keys() == [] and store.delete_messages("a") is None
    assert {"I live in Lisbon.", "I run marathons."} <= {r["memory"] for r in memory.get_all(user_id=user)["results"]}
    with pytest.raises(ValueError, match="has no text"):
        store.add_message("a", _user("user", ""))


def test_chat_store_keeps_tool_call_messages_whole(memory, user):
    """An agent's tool-using turn: an assistant message that only calls a tool (no text), the
    tool's results (one empty) with their call ids, then the answer. Each comes back as
    written, additional_kwargs included; only the user's message becomes a memory."""
    store = InferScaleChatStore(memory, user_id=user)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Lisbon\"}"}}
    msgs = [_user("user", "What is the weather in Lisbon?"),
            ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [call]}),
            ChatMessage(role="tool", content="sunny, 24 C", additional_kwargs={"tool_call_id": "call_1",
                                                                              "name": "get_weather"}),
            ChatMessage(role="tool", content="", additional_kwargs={"tool_call_id": "call_2"}),
            ChatMessage(role="assistant", content="It is sunny.")]
    for m in msgs:
        store.add_message("t", m)
    got = store.get_messages("t")
    assert [(m.role, m.content or "", m.additional_kwargs) for m in got] == \
        [(m.role, m.content or "", m.additional_kwargs) for m in msgs]
    turns = memory.get_turns(user_id=user)
    assert [t.content for t in turns][1] == "(calls get_weather)"  # the log's text: the context of later facts
    assert [r["memory"] for r in memory.get_all(user_id=user)["results"]] == ["What is the weather in Lisbon?"]
    store.set_messages("t", got)  # the same messages: nothing is written again
    assert len(memory.get_turns(user_id=user)) == len(turns)
    with pytest.raises(TypeError, match="additional_kwargs"):
        store.add_message("t", ChatMessage(role="assistant", content="x", additional_kwargs={"o": object()}))
    with pytest.raises(ValueError, match="has no text"):
        store.add_message("t", _user("user", ""))
    assert len(store.get_messages("t")) == len(msgs)  # refused messages wrote nothing


def test_chat_store_pickles_and_deep_copies_over_the_same_memory(memory, user):
    """LlamaIndex copies and pickles its components: an unpickled (or deep-copied) store
    works at once, over the same open memory, with the same user and write settings."""
    import copy
    import pickle

    store = InferScaleChatStore(memory, user_id=user, fact_roles=("user", "assistant"))
    store.add_message("p", _user("user", "My bike is green."))
    said = ["My bike is green."]
    for clone in (pickle.loads(pickle.dumps(store)), copy.deepcopy(store)):
        assert clone._sessions.memory is memory and clone._sessions.fact_roles == ("user", "assistant")
        assert [m.content for m in clone.get_messages("p")] == said
        clone.add_message("p", _user("assistant", f"Noted ({len(said)})."))
        said.append(f"Noted ({len(said)}).")
    assert [m.content for m in store.get_messages("p")] == said
