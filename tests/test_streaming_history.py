"""``Memory.stream``, conversation history, instructions and stop strings through the real
engine, and the turn-log operations chat sessions rely on (added for the adapters)."""

from __future__ import annotations

import uuid

import pytest

from inferscale import Memory, UnknownScopeError
from inferscale.sessions import ChatSessions, SessionMessage

FACT, QUESTION = "My dog's name is Biscuit.", "What is my dog's name?"


@pytest.fixture(scope="module")
def memory(serving_dir, engine):
    return Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)


@pytest.fixture
def user(memory) -> str:
    name = f"st-{uuid.uuid4().hex[:8]}"
    memory.add(FACT, user_id=name)
    assert memory.wait_for_kv(timeout=120), memory.components.kv.background.last_error  # the injected path is tested
    return name


def test_stream_joins_to_the_generate_answer_with_the_same_counters(memory, user):
    chunks = list(memory.stream(QUESTION, user_id=user, k=3, max_tokens=16))  # first: nothing prefix-cached yet
    done = memory.generate(QUESTION, user_id=user, k=3, max_tokens=16)
    assert all(c.generation is None for c in chunks[:-1]) and chunks[-1].generation is not None
    assert "".join(c.text for c in chunks) == chunks[-1].generation.text == done.text
    last = chunks[-1].generation
    assert (last.num_prompt_tokens, last.num_generated_tokens) == (done.num_prompt_tokens, done.num_generated_tokens)
    assert last.num_injected_tokens > 0 and last.memories == done.memories


def test_a_stream_closed_early_frees_the_engine(memory, user):
    stream = memory.stream(QUESTION, user_id=user, k=3, max_tokens=32)
    next(stream)
    stream.close()  # aborts the request
    assert memory.generate(QUESTION, user_id=user, k=3, max_tokens=8).num_generated_tokens > 0


def test_history_and_instructions_follow_the_memory_block(memory, user):
    plain = memory.inject(QUESTION, user_id=user, k=3)
    layout = memory.components.prompts.build(QUESTION, [("x", FACT)], history=[{"role": "user", "content": "Hi"},
                                                                  {"role": "assistant", "content": "Hello"}],
                                  instructions="Answer in one word.")
    assert layout.token_ids[:plain.memory_tokens] == plain.prompt_token_ids[:plain.memory_tokens]  # same KV
    assert len(layout.token_ids) > len(plain.prompt_token_ids)
    g = memory.generate(QUESTION, user_id=user, k=3, max_tokens=16, instructions="Answer in one word.",
                        history=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert g.num_injected_tokens == plain.memory_tokens
    assert g.num_prompt_tokens > len(plain.prompt_token_ids)
    cut = memory.generate(QUESTION, user_id=user, k=3, max_tokens=16, stop=["Biscuit"])
    assert "Biscuit" not in cut.text


def test_bad_history_stop_and_unknown_scopes(memory, user):
    with pytest.raises(ValueError, match="role 'system'"):
        memory.generate(QUESTION, user_id=user, history=[{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="history message 0 content is empty"):
        memory.generate(QUESTION, user_id=user, history=[{"role": "user", "content": " "}])
    with pytest.raises(TypeError, match="stop must be a list"):
        memory.generate(QUESTION, user_id=user, stop="Biscuit")
    with pytest.raises(UnknownScopeError):
        memory.stream(QUESTION, user_id=f"new-{user}")  # raised by the call, before iterating
    new = memory.generate("Hello!", user_id=f"new-{user}", allow_unknown_scope=True, max_tokens=4)
    assert new.memories == [] and new.num_injected_tokens > 0  # the preamble alone


def test_turns_can_be_listed_and_deleted_and_sessions_share_the_scope(memory, user):
    sessions = ChatSessions(memory, user_id=user)
    sessions.add("a", [SessionMessage("user", "I live in Lisbon."), SessionMessage("assistant", "Nice.")])
    sessions.add("b", [SessionMessage("user", "I like tea.")])
    assert sessions.session_ids() == ["a", "b"]
    assert [m.content for m in sessions.messages("a")] == ["I live in Lisbon.", "Nice."]
    assert {"I live in Lisbon.", "I like tea."} <= {r["memory"] for r in memory.get_all(user_id=user)["results"]}
    sessions.replace("a", [SessionMessage("user", "I live in Lisbon."), SessionMessage("assistant", "Great.")])
    kept = sessions.messages("a")
    assert [m.content for m in kept] == ["I live in Lisbon.", "Great."]
    before = len(memory.get_turns(user_id=user))
    assert memory.delete_turns([kept[1].turn_id, "no-such-turn"], user_id=user) == 1
    assert len(memory.get_turns(user_id=user)) == before - 1
    assert sessions.delete("b") == 1 and sessions.session_ids() == ["a"]
    with pytest.raises(ValueError, match="fact_roles"):
        ChatSessions(memory, user_id=user, fact_roles=("robot",))
    with pytest.raises(ValueError, match="role 'robot'"):
        sessions.add("a", [SessionMessage("robot", "beep")])
    with pytest.raises(TypeError, match="turn_ids"):
        memory.delete_turns("t1", user_id=user)


def test_a_message_longer_than_a_memory_is_kept_whole_and_stored_in_parts(memory, user):
    """A chat framework archives a message before our store sees it: a user message over
    max_fact_tokens must not be refused (it would be lost from both). Its turn keeps it
    whole; its memories are consecutive parts, each within the limit."""
    user = f"{user}-long"
    sessions = ChatSessions(memory, user_id=user)
    words = [f"word{i}" for i in range(1500)] + ["".join(map(str, range(2000)))]  # and a "word" over a memory
    text = " ".join(words)
    sessions.add("long", [SessionMessage("user", text)])
    assert [m.content for m in sessions.messages("long")] == [text]
    parts = [r["memory"] for r in memory.get_all(user_id=user)["results"]]  # one add's memories, in order
    assert len(parts) > 2 and all(memory.fact_tokens(p) <= memory.config.max_fact_tokens for p in parts)
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")  # every character, in order
