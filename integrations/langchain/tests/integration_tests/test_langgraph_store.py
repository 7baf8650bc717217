"""``InferScaleStore`` against LangGraph's own ``InMemoryStore``: the same operations, table
by table, give the same results in-process and over HTTP (``inferscale serve``'s front on
loopback), sync and async; then an agent saves a memory through the store in one session
and is answered with its KV injected in the next.

LangGraph ships no store-agnostic conformance suite (``langgraph-checkpoint-conformance``
covers checkpointers; ``libs/checkpoint/tests/test_store.py`` tests ``InMemoryStore``
itself), so the table below runs every ``BaseStore`` method on both stores; its
namespaces follow ``test_store.py``'s list-namespaces cases.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import uuid
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_inferscale import InferScaleStore
from langgraph.store.base import GetOp, Item, PutOp, SearchItem
from langgraph.store.memory import InMemoryStore

from inferscale import Memory

KEY = "store-test-key"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "store_agent.py"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("lg-store"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(scope="module")
def front(memory, loopback_front):
    """``inferscale serve``'s front (its memory routes; no vLLM behind it) on a loopback port."""
    with loopback_front(memory, KEY) as url:
        yield url


@pytest.fixture(params=["in-process", "http"])
def store(request, memory):
    """A fresh store (its own ``store_id``) over the module's memory, in-process or over HTTP."""
    store_id = f"lg-{uuid.uuid4().hex[:8]}"
    if request.param == "in-process":
        return InferScaleStore(memory, store_id=store_id)
    return InferScaleStore(url=request.getfixturevalue("front"), api_key=KEY, store_id=store_id)


def table(user: str, bot: str) -> list[tuple]:
    """``(method, args, kwargs)`` rows, run in order on both stores."""
    return [
        ("put", (("docs",), "d1", {"text": "Python tutorial", "n": 1, "tags": {"lang": "py"}}), {}),
        ("put", (("docs",), "d2", {"text": "TypeScript guide", "n": 2, "tags": {"lang": "ts"}}), {}),
        ("put", (("docs", "old"), "d3", {"text": "Fortran manual", "n": 3, "list": [1, 2]}), {}),
        ("put", (("users", user, "prefs"), "food", {"content": "I am allergic to peanuts."}), {}),
        ("put", (("users", user), "name", {"content": "My name is Alice.", "n": 5}), {}),
        ("put", (("agents", bot), "style", {"rule": "answer briefly", "n": 1}), {}),
        ("put", (("a", "b", "c"), "x", {"data": "value_00"}), {}),
        ("put", (("a", "b", "d", "e"), "x", {"data": "value_01"}), {}),
        ("put", (("a", "c", "f"), "x", {"data": "value_02"}), {}),
        ("get", (("docs",), "d1"), {}),
        ("get", (("docs",), "missing"), {}),
        ("get", (("users", user, "prefs"), "food"), {}),
        ("search", (("docs",),), {}),
        ("search", (("docs",),), {"filter": {"n": {"$gte": 2}}}),
        ("search", (("docs",),), {"filter": {"tags": {"lang": "ts"}}}),
        ("search", (("docs",),), {"filter": {"list": [1, 2]}}),
        ("search", (("docs",),), {"filter": {"n": {"$gt": 1, "$lt": 3}}}),
        ("search", (("docs",),), {"filter": {"n": {"$ne": 1}}}),
        ("search", (("docs",),), {"limit": 1, "offset": 1}),
        ("search", (("docs", "old"),), {}),
        ("search", (("users", user),), {}),
        ("search", (("a",),), {"filter": {"data": "value_01"}}),
        ("search", (("nothing",),), {}),
        ("list_namespaces", (), {}),
        ("list_namespaces", (), {"prefix": ("a", "b")}),
        ("list_namespaces", (), {"suffix": ("f",)}),
        ("list_namespaces", (), {"prefix": ("a", "*", "f")}),
        ("list_namespaces", (), {"prefix": ("users", "*")}),
        ("list_namespaces", (), {"max_depth": 2}),
        ("list_namespaces", (), {"prefix": ("a",), "limit": 2, "offset": 1}),
        ("list_namespaces", (), {"prefix": ("nonexistent",)}),
        ("put", (("docs",), "d1", {"text": "Python tutorial, second edition", "n": 10}), {}),
        ("get", (("docs",), "d1"), {}),
        ("search", (("docs",),), {"filter": {"n": {"$gt": 5}}}),
        ("delete", (("docs",), "d2"), {}),
        ("get", (("docs",), "d2"), {}),
        ("delete", (("docs",), "never-stored"), {}),
        ("batch", ([PutOp(("docs", "old"), "d3", None), PutOp(("docs",), "d4", {"text": "Go book"}),
                    GetOp(("docs",), "d4"), GetOp(("docs", "old"), "d3")],), {}),
        ("get", (("docs",), "d4"), {}),
        ("search", (("docs",),), {}),
        ("batch", ([PutOp(("docs",), "d5", {"text": "first"}), PutOp(("docs",), "d5", {"text": "last"})],), {}),
        ("get", (("docs",), "d5"), {}),
        # last: InMemoryStore lists a namespace once any get names it, or after its last item is deleted
        ("get", (("elsewhere",), "d1"), {}),
    ]


def normal(result):
    """What both stores must agree on: items as ``(namespace, key, value)``, in order."""
    if isinstance(result, Item):
        return (tuple(result.namespace), result.key, result.value)
    if isinstance(result, list):
        return [normal(r) for r in result]
    return result


def run_table(store, rows: list[tuple], use_async: bool) -> list:
    async def arun():
        return [await getattr(store, "a" + method)(*args, **kwargs) for method, args, kwargs in rows]

    if use_async:
        return asyncio.run(arun())
    return [getattr(store, method)(*args, **kwargs) for method, args, kwargs in rows]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_every_store_method_matches_in_memory_store(store, use_async):
    user, bot = f"alice-{uuid.uuid4().hex[:6]}", f"bot-{uuid.uuid4().hex[:6]}"
    rows = table(user, bot)
    expected = run_table(InMemoryStore(), rows, use_async)
    got = run_table(store, rows, use_async)
    for row, want, have in zip(rows, expected, got):
        assert normal(have) == normal(want), row
        if row[0] == "search":  # a search without a query gives SearchItems without a score
            assert all(isinstance(i, SearchItem) and i.score is None for i in have), row
    # listed: the namespaces that hold items (as PostgresStore lists them; InMemoryStore still
    # lists ("docs", "old"), emptied by the batch, and ("elsewhere",), which a get named)
    assert store.list_namespaces(prefix=("docs",)) == [("docs",)]
    assert ("elsewhere",) not in store.list_namespaces()


def test_items_are_memories_of_the_namespace_scope(store, memory):
    user = f"alice-{uuid.uuid4().hex[:6]}"
    store.put(("users", user, "prefs"), "food", {"content": "I am allergic to peanuts.", "since": 2019})
    store.put(("notes",), "n1", {"title": "groceries", "items": ["milk", "eggs"]})
    (fact,) = memory.get_all(user_id=user)["results"]
    assert fact["memory"] == "I am allergic to peanuts."  # the text ChatInferScale injects
    assert fact["metadata"]["langgraph"] == {"namespace": ["users", user, "prefs"], "key": "food",
                                             "value": {"content": "I am allergic to peanuts.", "since": 2019}}
    (note,) = memory.get_all(agent_id=store.store_id)["results"]
    assert note["memory"] == '{"items":["milk","eggs"],"title":"groceries"}'  # no text field: the JSON


def test_search_ranks_by_the_query_with_scores(store):
    ns = ("docs",)
    for key, text in [("py", "Python tutorial for beginners"), ("ts", "TypeScript guide"),
                      ("cook", "A cookbook of Italian pasta recipes")]:
        store.put(ns, key, {"text": text})
    hits = store.search(ns, query="how do I cook spaghetti pasta?", limit=2)
    assert [h.key for h in hits][0] == "cook" and len(hits) == 2
    assert all(isinstance(h.score, float) for h in hits)
    hits = asyncio.run(store.asearch(ns, query="TypeScript", filter={"text": {"$ne": "x"}}))
    assert hits[0].key == "ts"


def test_put_keeps_created_at_and_moves_updated_at(store):
    store.put(("docs",), "d", {"text": "v1"})
    first = store.get(("docs",), "d")
    store.put(("docs",), "d", {"text": "v2"})
    second = store.get(("docs",), "d")
    assert second.created_at == first.created_at and second.updated_at > first.updated_at


def test_bad_input_is_refused_and_changes_nothing(store, memory):
    store.put(("docs",), "kept", {"text": "Python tutorial"})
    before = store.search(("docs",))
    for call, error, words in [
        (lambda: store.put(("docs",), "t", {"text": "x"}, ttl=-5), ValueError, "positive number of minutes"),
        (lambda: store.batch([PutOp(("docs",), "t", {"text": "x"}, ttl="5")]), TypeError, "number of minutes"),
        (lambda: store.batch([PutOp(("docs",), "t", ["not", "a", "dict"])]), TypeError, "must be a dict"),
        (lambda: store.search(("docs",), filter={"n": {"$regex": "x"}}), ValueError, "$regex"),
        (lambda: store.search(("docs",), limit=20_000), ValueError, "offset + limit"),
        (lambda: store.put(("agents", f"{store.store_id}:scopes"), "k", {"text": "x"}), ValueError, "registry"),
    ]:
        with pytest.raises(error) as caught:
            call()
        assert words in str(caught.value), str(caught.value)
        assert normal(store.search(("docs",))) == normal(before)
        assert store.list_namespaces() == [("docs",)]


def test_one_value_under_many_keys(store, memory):
    """A key-value store holds one value under many keys and namespaces (one InferScale scope,
    one text, several memories); each key lives and dies on its own, as in ``InMemoryStore``."""
    value = {"text": "The office is closed on Friday."}
    user = f"alice-{uuid.uuid4().hex[:6]}"
    rows = [
        ("put", (("docs",), "a", value), {}), ("put", (("docs",), "b", value), {}),
        ("put", (("docs", "sub"), "a", value), {}), ("put", (("other",), "a", value), {}),
        ("put", (("users", user, "x"), "k", value), {}), ("put", (("users", user, "y"), "k", value), {}),
        ("batch", ([PutOp(("docs",), "c", value), PutOp(("docs",), "d", value)],), {}),
        ("search", ((),), {}), ("get", (("docs",), "b"), {}),
        ("delete", (("docs",), "a"), {}), ("search", (("docs",),), {}),
        ("put", (("docs",), "e", {"text": "Another value."}), {}),
        ("put", (("docs",), "e", value), {}),  # an update to a value other keys hold
        ("put", (("docs",), "b", {"text": "Another value."}), {}),  # and back
        ("search", ((),), {}), ("list_namespaces", (), {}),
    ]
    def unordered(result):  # InMemoryStore lists namespace by namespace, InferScale oldest first
        return sorted(normal(result), key=repr) if isinstance(result, list) else normal(result)

    got, want = (run_table(s, rows, False) for s in (store, InMemoryStore()))
    assert [unordered(r) for r in got] == [unordered(r) for r in want]
    assert len([m for m in memory.get_all(user_id=user)["results"] if m["memory"] == value["text"]]) == 2


def test_index_false_is_stored_listed_and_never_ranked(store):
    """``put(..., index=False)``: ``get`` and a search without a query see the item; a search
    with a query ranks only the indexed items and, when its page has room, appends the others
    unscored, oldest first (``InMemoryStore``'s way, checked against it with an embedder)."""
    from langchain_core.embeddings import DeterministicFakeEmbedding

    rows = [
        ("put", (("docs",), "cats", {"text": "cats purr and sleep all day"}), {}),
        ("put", (("docs",), "hidden1", {"text": "cats are the topic here too"}), {"index": False}),
        ("put", (("docs",), "dogs", {"text": "dogs bark at the mailman"}), {}),
        ("put", (("docs",), "hidden2", {"text": "more about cats"}), {"index": False}),
    ]
    reference = InMemoryStore(index={"dims": 16, "embed": DeterministicFakeEmbedding(size=16)})
    for s in (store, reference):
        run_table(s, rows, False)
    for kwargs in [{"limit": 10}, {"limit": 3}, {"limit": 2}, {"limit": 10, "offset": 1}, {"limit": 2, "offset": 2},
                   {"limit": 10, "filter": {"text": "more about cats"}}]:
        got, want = (s.search(("docs",), query="cats", **kwargs) for s in (store, reference))
        assert [(i.key, i.score is None) for i in got if i.score is None] == \
               [(i.key, True) for i in want if i.score is None], kwargs
        assert len(got) == len(want) and all(isinstance(i.score, float) for i in got if i.key in ("cats", "dogs"))
    assert [i.key for i in store.search(("docs",))] == ["cats", "hidden1", "dogs", "hidden2"]
    assert store.get(("docs",), "hidden1").value == {"text": "cats are the topic here too"}
    store.put(("docs",), "hidden1", {"text": "cats are the topic here too"})  # indexed now
    hits = store.search(("docs",), query="cats", limit=10)
    assert [i.key for i in hits if i.score is None] == ["hidden2"] and len(hits) == 4


def test_a_label_no_scope_id_can_be_goes_to_the_store_scope(store, memory):
    """``("users", "alice\\n")`` and a 300-character user are items like any other, kept in the
    store's own scope (no user id can be such a label), apart from ``("users", "alice")``."""
    user = f"alice-{uuid.uuid4().hex[:6]}"
    odd = [("users", user + "\n"), ("users", "x" * 300), ("runs", " ")]
    for i, ns in enumerate([("users", user), *odd]):
        store.put(ns, "k", {"v": i})
    assert [store.get(ns, "k").value for ns in [("users", user), *odd]] == [{"v": i} for i in range(4)]
    assert store.list_namespaces(suffix=[user]) == [("users", user)]
    assert [m["metadata"]["langgraph"]["value"] for m in memory.get_all(user_id=user)["results"]] == [{"v": 0}]
    kept = {tuple(m["metadata"]["langgraph"]["namespace"]) for m in memory.get_all(agent_id=store.store_id)["results"]}
    assert kept == set(odd)


def test_constructor_refuses_neither_or_both_backends(memory):
    with pytest.raises(ValueError, match="either memory= .* or url="):
        InferScaleStore()
    with pytest.raises(ValueError, match="either memory= .* or url="):
        InferScaleStore(memory, url="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="inferscale.Memory"):
        InferScaleStore("not a memory")


def test_http_errors_name_the_cause(front):
    with pytest.raises(PermissionError, match="API key"):
        InferScaleStore(url=front, api_key="wrong").get(("docs",), "k")
    with pytest.raises(ConnectionError, match="did not answer"):
        from inferscale.server.ports import free_port

        InferScaleStore(url=f"http://127.0.0.1:{free_port()}", timeout=2).get(("docs",), "k")


# ---------------------------------------------------------------------- the agent, on the real engine


def _example():
    spec = importlib.util.spec_from_file_location("langgraph_store_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_agent_saves_a_memory_in_one_session_and_gets_its_kv_in_the_next(serving_dir, engine):
    served = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    user = f"lg-store-{uuid.uuid4().hex[:8]}"
    store = InferScaleStore(served)
    first, second = _example().run(served, store, user)

    saves = [m for m in first["messages"] if isinstance(m, AIMessage) and m.tool_calls]
    assert saves and saves[0].tool_calls[0]["name"] == "save_memory"
    assert any(isinstance(m, ToolMessage) and "Saved" in m.content for m in first["messages"])
    (item,) = store.search(("users", user, "memories"))
    (fact,) = served.get_all(user_id=user)["results"]  # the item is the user's one memory
    assert fact["metadata"]["langgraph"]["key"] == item.key

    answer = second["messages"][-1]
    meta = answer.response_metadata
    assert isinstance(answer, AIMessage) and answer.content.strip()
    assert fact["id"] in meta["kv_memory_ids"] and meta["num_injected_tokens"] > 0
    assert not any(isinstance(m, ToolMessage) for m in second["messages"])  # answered from memory alone


def test_concurrent_writes_to_one_key_leave_one_item(store):
    """LangGraph's suites ``gather`` puts and deletes of one key: they run one at a time, so ten
    puts leave one item (the value of one of them) and a put raced by a delete never fails."""
    async def race() -> None:
        await asyncio.gather(*(store.aput(("docs", "race"), "k", {"text": f"value {i}"}) for i in range(10)))
        items = await store.asearch(("docs", "race"), limit=20)
        assert len(items) == 1 and items[0].value["text"] in {f"value {i}" for i in range(10)}
        for i in range(5):
            await asyncio.gather(store.aput(("docs", "race"), "k", {"text": f"again {i}"}),
                                 store.adelete(("docs", "race"), "k"))
        assert len(await store.asearch(("docs", "race"), limit=20)) <= 1

    asyncio.run(race())


def test_a_nan_or_infinite_filter_matches_what_in_memory_store_matches(store):
    """NaN equals and orders against nothing (so those filters match no item), and every value
    differs from it (``$ne`` matches every item), as in ``InMemoryStore``; every finite value is
    below infinity and above minus infinity, over HTTP too (JSON has no infinity)."""
    reference = InMemoryStore()
    for s in (store, reference):
        s.put(("docs", "nan"), "a", {"text": "alpha", "x": 1.0})
        s.put(("docs", "nan"), "b", {"text": "beta", "x": 2.0})
    nan = float("nan")
    inf = float("inf")
    for flt in ({"x": nan}, {"x": {"$gt": nan}}, {"x": {"$lte": nan}}, {"x": {"$ne": nan}}, {"x": {"$ne": nan, "$gt": 1.5}},
                {"x": {"$lt": inf}}, {"x": {"$gt": -inf, "$lt": 1.5}}, {"x": {"$gte": inf}}, {"x": -inf},
                {"x": {"$ne": inf}}, {"x": {"$lte": -inf}}, {"x": {"$gt": 1.5, "$lte": inf}}):
        got = sorted(i.key for i in store.search(("docs", "nan"), filter=flt))
        assert got == sorted(i.key for i in reference.search(("docs", "nan"), filter=flt)), flt
