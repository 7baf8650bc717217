"""The LlamaIndex classes check their arguments before doing anything: a wrong type is a
TypeError, a wrong value a ValueError, naming the argument in one line, raised by InferScale;
the store is unchanged afterwards (issue 18)."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.llms.inferscale import InferScaleLLM
from llama_index.memory.inferscale import InferScaleMemoryBlock
from llama_index.storage.chat_store.inferscale import InferScaleChatStore

from inferscale import Memory

USER = "strict-user"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("llama-strict"), dtype="float32", precompute_kv=False) as m:
        m.add("My dog is called Rex.", user_id=USER)
        yield m  # no engine is started: every call below is refused first


def llm(m, **kw):
    return InferScaleLLM(memory=m, user_id=USER, **kw)


def block(m, **kw):
    return InferScaleMemoryBlock(memory=m, user_id=USER, **kw)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


CASES = [
    ("llm memory", lambda m: InferScaleLLM(memory="m", user_id=USER), TypeError, "memory"),
    ("llm k", lambda m: llm(m, k=-1), ValueError, "k"),
    ("llm k type", lambda m: llm(m, k="3"), TypeError, "k"),
    ("llm max_tokens", lambda m: llm(m, max_tokens=0), ValueError, "max_tokens"),
    ("llm temperature", lambda m: llm(m, temperature="hot"), TypeError, "temperature"),
    ("llm mode", lambda m: llm(m, mode="fast"), ValueError, "mode"),
    ("llm user_id", lambda m: InferScaleLLM(memory=m, user_id=5), TypeError, "user_id"),
    ("llm blank user_id", lambda m: InferScaleLLM(memory=m, user_id=""), ValueError, "user_id"),
    ("llm call_tools_first", lambda m: llm(m, call_tools_first="y"), TypeError, "call_tools_first"),
    ("llm unknown argument", lambda m: llm(m, max_token=3), TypeError, "max_token"),
    ("llm per-call k", lambda m: llm(m).complete("dog?", k=-1), ValueError, "k"),
    ("llm per-call option", lambda m: llm(m).chat(user("dog?"), max_token=3), TypeError, "max_token"),
    ("llm per-call user_id", lambda m: llm(m).chat(user("dog?"), user_id=5), TypeError, "user_id"),
    ("llm no scope", lambda m: InferScaleLLM(memory=m).complete("dog?"), ValueError, "user_id"),
    ("llm empty prompt", lambda m: llm(m).complete(""), ValueError, "query"),
    ("block memory", lambda m: InferScaleMemoryBlock(memory="m", user_id=USER), TypeError, "memory"),
    ("block k", lambda m: block(m, k=0), ValueError, "k"),
    ("block k type", lambda m: block(m, k="5"), TypeError, "k"),
    ("block include_text", lambda m: block(m, include_text="no"), TypeError, "include_text"),
    ("block infer", lambda m: block(m, infer=1), TypeError, "infer"),
    ("block no scope", lambda m: InferScaleMemoryBlock(memory=m), ValueError, "user_id"),
    ("block user_id", lambda m: InferScaleMemoryBlock(memory=m, user_id=5), TypeError, "user_id"),
    ("block unknown argument", lambda m: block(m, foo=1), TypeError, "foo"),
    ("block put not messages", lambda m: asyncio.run(block(m).aput([5])), TypeError, "message 0"),
    ("block put second session bad", lambda m: asyncio.run(block(m).aput([
        ChatMessage(role=MessageRole.USER, content="I like tea.", additional_kwargs={"session_id": "s1"}),
        ChatMessage(role=MessageRole.USER, content="I like coffee.", additional_kwargs={"session_id": "s2",
                                                                                    "o": object()})])),
     TypeError, "additional_kwargs"),
    ("chat store unknown argument", lambda m: InferScaleChatStore(m, user_id=USER, foo=1), TypeError, "foo"),
    ("chat store idx", lambda m: InferScaleChatStore(m, user_id=USER).add_message(
        "s", ChatMessage(role=MessageRole.USER, content="hi"), idx="a"), TypeError, "idx"),
    ("chat store fact_roles None", lambda m: InferScaleChatStore(m, user_id=USER, fact_roles=None), TypeError,
     "fact_roles"),
]


@pytest.mark.parametrize("what,call,error,name", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_are_refused_and_change_nothing(memory, assert_refused, what, call, error, name):
    assert_refused(memory, USER, lambda: call(memory), error, name)
