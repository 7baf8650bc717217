"""The LangChain classes check their arguments before doing anything: a wrong type is a
TypeError, a wrong value a ValueError, naming the argument in one line, raised by InferScale;
the store is unchanged afterwards (issue 18)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from langchain_inferscale import ChatInferScale, InferScaleChatMessageHistory, InferScaleRetriever

USER = "strict-user"


@pytest.fixture
def memory(unit_memory):
    if not unit_memory.get_all(user_id=USER)["results"]:
        unit_memory.add("My dog is called Rex.", user_id=USER)
        # its KV is encoded in the background: let that finish (the encoder's first model load
        # imports modules while LangChain's constructors walk them, which raced once)
        assert unit_memory.wait_for_kv(timeout=600)
    return unit_memory


def chat(m, **kw):
    return ChatInferScale(memory=m, user_id=USER, **kw)


def retriever(m, **kw):
    return InferScaleRetriever(memory=m, user_id=USER, **kw)


def history(m, **kw):
    return InferScaleChatMessageHistory(**{"memory": m, "session_id": "s1", "user_id": USER, **kw})


# (what, call on the memory, exception, the argument the message must name)
CASES = [
    ("chat memory", lambda m: ChatInferScale(memory="m", user_id=USER), TypeError, "memory"),
    ("chat k", lambda m: chat(m, k=-1), ValueError, "k"),
    ("chat k type", lambda m: chat(m, k="3"), TypeError, "k"),
    ("chat max_tokens", lambda m: chat(m, max_tokens=0), ValueError, "max_tokens"),
    ("chat temperature", lambda m: chat(m, temperature="hot"), TypeError, "temperature"),
    ("chat mode", lambda m: chat(m, mode="fast"), ValueError, "mode"),
    ("chat user_id", lambda m: ChatInferScale(memory=m, user_id=5), TypeError, "user_id"),
    ("chat allow_unknown_scope", lambda m: chat(m, allow_unknown_scope="y"), TypeError, "allow_unknown_scope"),
    ("chat stop", lambda m: chat(m, stop="END"), TypeError, "stop"),
    ("chat unknown option", lambda m: chat(m, max_token=3), TypeError, "max_token"),
    ("chat per-call k", lambda m: chat(m).invoke("dog?", k=-1), ValueError, "k"),
    ("chat per-call user_id", lambda m: chat(m).invoke("dog?", user_id=5), TypeError, "user_id"),
    ("chat per-call option", lambda m: chat(m).invoke("dog?", max_token=3), TypeError, "max_token"),
    ("chat no scope", lambda m: ChatInferScale(memory=m).invoke("dog?"), ValueError, "user_id"),
    ("bind_tools", lambda m: chat(m).bind_tools([5]), TypeError, "tool"),
    ("tool_choice", lambda m: chat(m).bind_tools([], tool_choice=5), TypeError, "tool_choice"),
    ("retriever k", lambda m: retriever(m, k=0), ValueError, "k"),
    ("retriever k type", lambda m: retriever(m, k="2"), TypeError, "k"),
    ("retriever threshold", lambda m: retriever(m, threshold=2), ValueError, "threshold"),
    ("retriever mode", lambda m: retriever(m, mode="fast"), ValueError, "mode"),
    ("retriever filters", lambda m: retriever(m, filters={"n": {"$between": 1}}), ValueError, "filters"),
    ("retriever per-call k", lambda m: retriever(m).invoke("dog", k=0), ValueError, "k"),
    ("retriever per-call k type", lambda m: retriever(m).invoke("dog", k="1"), TypeError, "k"),
    ("retriever per-call filters", lambda m: retriever(m).invoke("dog", filters=[]), TypeError, "filters"),
    ("retriever unknown argument", lambda m: retriever(m, filter={"n": 1}), TypeError, "did you mean 'filters'"),
    ("retriever blank user_id", lambda m: InferScaleRetriever(memory=m, user_id=" "), ValueError, "user_id"),
    ("retriever threshold flag", lambda m: retriever(m, threshold=True), TypeError, "threshold"),
    ("bind_tools unconvertible", lambda m: chat(m).bind_tools([{"bad": 1}]), ValueError, "tool 0"),
    ("with_structured_output", lambda m: chat(m).with_structured_output(5), TypeError, "schema"),
    ("history add_messages None", lambda m: history(m).add_messages(None), TypeError, "messages"),
    ("history fact_roles str", lambda m: history(m, fact_roles="user"), TypeError, "fact_roles"),
    ("history memory", lambda m: InferScaleChatMessageHistory("m", "s1", user_id=USER), TypeError, "memory"),
    ("history session_id", lambda m: history(m, session_id=""), ValueError, "session_id"),
    ("history session_id type", lambda m: history(m, session_id=5), TypeError, "session_id"),
    ("history no scope", lambda m: history(m, user_id=None), ValueError, "user_id"),
    ("history fact_roles", lambda m: history(m, fact_roles=["robot"]), ValueError, "fact_roles"),
    ("history infer", lambda m: history(m, infer="y"), TypeError, "infer"),
    ("history add_messages", lambda m: history(m).add_messages(["My cat is Tom."]), TypeError, "message"),
    ("history empty message", lambda m: history(m).add_messages([HumanMessage("")]), ValueError, "message 0"),
]


@pytest.mark.parametrize("what,call,error,name", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_are_refused_and_change_nothing(memory, assert_refused, what, call, error, name):
    assert_refused(memory, USER, lambda: call(memory), error, name)
