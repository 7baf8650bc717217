"""Every public method of Memory and AsyncMemory checks its arguments before doing anything:
a wrong type is a TypeError, a wrong value a ValueError, raised by InferScale with a message
naming the argument, and the store is unchanged afterwards (issue 18)."""

from __future__ import annotations

import asyncio

import pytest

from inferscale import AsyncMemory, FactInput, Memory
from inferscale.async_memory import _METHODS
from inferscale.store.records import Scope

OK = "My dog is called Rex."
# (method, positional args, keyword args, exception, the argument the message must name)
CASES = [
    ("add", (5,), {"user_id": "u"}, TypeError, "messages"),
    ("add", ([],), {"user_id": "u"}, ValueError, "messages"),
    ("add", ("",), {"user_id": "u"}, ValueError, "content"),
    ("add", (OK,), {"user_id": 5}, TypeError, "user_id"),
    ("add", (OK,), {"user_id": " "}, ValueError, "user_id"),
    ("add", (OK,), {}, ValueError, "user_id"),
    ("add", (OK,), {"user_id": "u", "metadata": "a"}, TypeError, "metadata"),
    ("add", (OK,), {"user_id": "u", "metadata": {"created_at": 1}}, ValueError, "created_at"),
    ("add", (OK,), {"user_id": "u", "infer": "no"}, TypeError, "infer"),
    ("add", ([{"role": "robot", "content": OK}],), {"user_id": "u"}, ValueError, "role"),
    ("add", ([{"role": 1, "content": OK}],), {"user_id": "u"}, TypeError, "role"),
    ("add_facts", ("x",), {"user_id": "u"}, TypeError, "facts"),
    ("add_facts", ([FactInput(OK)],), {"user_id": "u", "encode_kv": "y"}, TypeError, "encode_kv"),
    ("add_facts", ([FactInput(OK)],), {"user_id": "u", "context_window": -1}, ValueError, "context_window"),
    ("add_facts", ([FactInput(OK)],), {"user_id": "u", "context_window": "2"}, TypeError, "context_window"),
    ("log_turns", (None,), {"user_id": "u"}, TypeError, "messages"),
    ("search", (None,), {"user_id": "u"}, TypeError, "query"),
    ("search", ("",), {"user_id": "u"}, ValueError, "query"),
    ("search", ("dog",), {"user_id": "u", "limit": "3"}, TypeError, "limit"),
    ("search", ("dog",), {"user_id": "u", "limit": -1}, ValueError, "limit"),
    ("search", ("dog",), {"user_id": "u", "threshold": "a"}, TypeError, "threshold"),
    ("search", ("dog",), {"user_id": "u", "threshold": 2}, ValueError, "threshold"),
    ("search", ("dog",), {"user_id": "u", "filters": []}, TypeError, "filters"),
    ("search", ("dog",), {"user_id": "u", "filters": {"n": float("nan")}}, ValueError, "NaN"),
    ("search", ("dog",), {"user_id": "u", "filters": {"AND": [{"AND": []}] * 2, "x": {"$gt": [1]}}}, ValueError, "AND"),
    ("add", (OK,), {"user_id": "u", "metadata": {1: "a", "1": "b"}}, TypeError, "metadata keys"),
    ("add", ([{"content": OK, "id": "  "}],), {"user_id": "u"}, ValueError, "id"),
    ("add_facts", ([FactInput(OK, (), None)],), {"user_id": "u", "context_window": 2**63}, ValueError,
     "context_window"),
    ("find_texts", (None,), {"user_id": "u"}, TypeError, "texts"),
    ("find_texts", ([1],), {"user_id": "u"}, TypeError, "texts[0]"),
    ("fact_tokens", (None,), {}, TypeError, "text"),
    ("search", ("dog",), {"user_id": "u", "filters": {"n": {"$between": 1}}}, ValueError, "operator"),
    ("search", ("dog",), {"user_id": "u", "mode": "fast"}, ValueError, "mode"),
    ("search", ("dog",), {"user_id": "u", "mode": 1}, TypeError, "mode"),
    ("search", ("dog",), {"user_id": "u", "filters": {"user_id": "v"}}, ValueError, "user_id"),
    ("get_all", (), {"user_id": "u", "limit": -1}, ValueError, "limit"),
    ("get_all", (), {"user_id": "u", "limit": 2.5}, TypeError, "limit"),
    ("get", (None,), {"user_id": "u"}, TypeError, "memory_id"),
    ("get", ("",), {"user_id": "u"}, ValueError, "memory_id"),
    ("update", (123, "x"), {"user_id": "u"}, TypeError, "memory_id"),
    ("update", ("{mid}", None), {"user_id": "u"}, TypeError, "data"),
    ("update", ("{mid}", "x"), {"user_id": "u", "metadata": 5}, TypeError, "metadata"),
    ("update_metadata", (123, {"k": 1}), {"user_id": "u"}, TypeError, "memory_id"),
    ("update_metadata", ("{mid}", 5), {"user_id": "u"}, TypeError, "metadata"),
    ("update_metadata", ("{mid}", {}), {"user_id": "u"}, ValueError, "metadata"),
    ("update_metadata", ("{mid}", {"created_at": 1}), {"user_id": "u"}, ValueError, "created_at"),
    ("update_metadata", ("{mid}", {"k": 1}), {"user_id": 5}, TypeError, "user_id"),
    ("delete", (1,), {"user_id": "u"}, TypeError, "memory_id"),
    ("delete_all", (), {}, ValueError, "user_id"),
    ("delete_all", (), {"user_id": 7}, TypeError, "user_id"),
    ("history", (None,), {"user_id": "u"}, TypeError, "memory_id"),
    ("generate", ("dog?",), {"user_id": "u", "max_tokens": 0}, ValueError, "max_tokens"),
    ("generate", ("dog?",), {"user_id": "u", "max_tokens": "8"}, TypeError, "max_tokens"),
    ("generate", ("dog?",), {"user_id": "u", "temperature": 3}, ValueError, "temperature"),
    ("generate", ("dog?",), {"user_id": "u", "k": -1}, ValueError, "k"),
    ("generate", ("dog?",), {"user_id": "u", "mode": "fast"}, ValueError, "mode"),
    ("generate", ("dog?",), {"user_id": "u", "stop": 5}, TypeError, "stop"),
    ("generate", ("dog?",), {"user_id": "u", "max_token": 8}, TypeError, "max_token"),
    ("generate", ("dog?",), {"user_id": "u", "history": "hi"}, TypeError, "history"),
    ("generate", ("dog?",), {"user_id": "u", "instructions": 5}, TypeError, "instructions"),
    ("generate", ("dog?",), {"user_id": "u", "allow_unknown_scope": "y"}, TypeError, "allow_unknown_scope"),
    ("generate", ("dog?",), {"user_id": "u", "tool_choice": 5}, TypeError, "tool_choice"),
    ("generate", (None,), {"user_id": "u"}, TypeError, "query"),
    ("inject", ("dog?",), {"user_id": "u", "k": -1}, ValueError, "k"),
    ("inject", ("dog?",), {"user_id": "u", "context_window": "a"}, TypeError, "context_window"),
    ("wait_for_kv", (), {"timeout": "a"}, TypeError, "timeout"),
    ("wait_for_kv", (), {"timeout": -1}, ValueError, "timeout"),
    ("wait_for_kv", (), {"timeout": 10**400}, ValueError, "timeout"),
]
IDS = [f"{m}-{i}" for i, (m, *_rest) in enumerate(CASES)]


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    m = Memory(data_dir=tmp_path_factory.mktemp("strict") / "store", dtype="float32", context_window=0,
               precompute_kv=False)
    mid = m.add(OK, user_id="u", metadata={"n": 1})["results"][0]["id"]
    yield m, mid
    m.close()


def snapshot(m: Memory) -> tuple:
    """Everything a call could have changed: memories, turns, history, queued KV."""
    memories = sorted((r["id"], r["memory"], str(r["metadata"]), r["updated_at"])
                      for r in m.get_all(user_id="u", limit=1000)["results"])
    return memories, m.components.turns.count(Scope("u").key), m.components.store.count(), m.pending_kv(), \
        [len(m.history(r[0], user_id="u")) for r in memories]


def _fill(args: tuple, mid: str) -> tuple:
    return tuple(a.format(mid=mid) if isinstance(a, str) else a for a in args)


@pytest.mark.parametrize("method,args,kwargs,error,name", CASES, ids=IDS)
def test_memory_refuses_bad_arguments_and_changes_nothing(mem, assert_refused, method, args, kwargs, error, name):
    m, mid = mem
    before = snapshot(m)  # the history too
    assert_refused(m, "u", lambda: getattr(m, method)(*_fill(args, mid), **kwargs), error, name)
    assert snapshot(m) == before


ASYNC = [(c, i) for c, i in zip(CASES, IDS) if c[0] in _METHODS][::3]


@pytest.mark.parametrize("method,args,kwargs,error,name", [c for c, _ in ASYNC], ids=[i for _, i in ASYNC])
def test_async_memory_refuses_the_same(mem, method, args, kwargs, error, name):
    m, mid = mem
    before = snapshot(m)
    amem = AsyncMemory(memory=m)
    with pytest.raises(error, match=name):
        asyncio.run(getattr(amem, method)(*_fill(args, mid), **kwargs))
    assert snapshot(m) == before


@pytest.mark.parametrize("kwargs,error,name", [
    ({"top_k": -1}, ValueError, "INFERSCALE_TOP_K"),
    ({"dtype": "fp16"}, ValueError, "dtype"),
    ({"topk": 3}, TypeError, "did you mean 'top_k'"),
    ({"context_window": "many"}, TypeError, "context_window"),
    ({"config": 5}, TypeError, "config"),
    ({"data_dir": ""}, ValueError, "data_dir"),
    ({"data_dir": "/tmp/a\x00b"}, ValueError, "NUL"),
    ({"top_k": True}, TypeError, "top_k"),
    ({"engine": 5}, TypeError, "engine"),
    ({"extractor": 5}, TypeError, "extractor"),
])
def test_memory_constructor_refuses_bad_settings(tmp_path, kwargs, error, name):
    kwargs = {"data_dir": tmp_path / "never", **kwargs}
    with pytest.raises(error, match=name) as caught:
        Memory(**kwargs)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "never").exists()
    with pytest.raises(error, match=name):
        AsyncMemory(**kwargs)


def test_a_failed_add_with_metadata_none_cannot_exist_and_none_means_no_metadata(mem):
    m, _ = mem
    out = m.add_facts([FactInput("Rex sleeps all day.", (), None)], user_id="u2")  # None: no metadata
    assert m.get(out["results"][0]["id"], user_id="u2")["metadata"] == {}
    assert m.search("Rex", user_id="u2", filters={"n": {"gt": 0}})["results"] == []
    m.delete_all(user_id="u2")


def test_async_memory_wants_a_memory(mem):
    with pytest.raises(TypeError, match="memory must be an inferscale.Memory"):
        AsyncMemory(memory="m")
    with pytest.raises(TypeError, match="not both"):
        AsyncMemory(memory=mem[0], top_k=3)


def test_a_mistyped_environment_variable_is_a_warning_naming_the_nearest(tmp_path, monkeypatch):
    from inferscale.config import UnknownSettingWarning, _warned

    monkeypatch.setenv("INFERSCALE_CONTEXT_WINDOWS", "3")
    _warned.discard("INFERSCALE_CONTEXT_WINDOWS")
    with pytest.warns(UnknownSettingWarning, match="INFERSCALE_CONTEXT_WINDOWS .* did you mean INFERSCALE_CONTEXT_WINDOW"):
        Memory(data_dir=tmp_path / "s", dtype="float32", precompute_kv=False).close()
    monkeypatch.setenv("INFERSCALE_TOP_K", "-2")
    with pytest.raises(ValueError, match=r"^top_k: .*got '-2' \(from the environment variable INFERSCALE_TOP_K\)$"):
        Memory(data_dir=tmp_path / "t")


def test_the_variables_inferscale_serve_reads_are_no_unknown_setting(monkeypatch):
    """``inferscale serve``'s own variables (its key and request limits, the replica index it
    gives its vLLM servers) are read by the CLI, not by ``MemoryConfig``: setting them, as
    docs/server.md says, warns of nothing."""
    import re
    import warnings

    from inferscale import cli
    from inferscale.config import MemoryConfig, _warned
    from inferscale.kv.injection import REPLICA_ENV

    source = open(cli.__file__).read()
    names = set(re.findall(r'envvar="(INFERSCALE_[A-Z_]+)"', source)) | {REPLICA_ENV}
    assert {"INFERSCALE_HEADER_TIMEOUT_S", "INFERSCALE_API_KEY"} <= names
    for name in names:
        monkeypatch.setenv(name, "1")
        _warned.discard(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryConfig()
