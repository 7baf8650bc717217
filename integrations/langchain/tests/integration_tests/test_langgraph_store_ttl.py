"""``InferScaleStore``'s TTL (issue 40; docs/decisions.md, "LangGraph store: TTL"), in-process
and over HTTP (``inferscale serve``'s front on loopback), on a real ``Memory``.

Most tests move the store's clock (``langchain_inferscale.store.now``) instead of sleeping;
the sweeper's test runs on real time with fractional minutes.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from langchain_inferscale import InferScaleStore
from langchain_inferscale import store as store_module
from langgraph.store.base import PutOp

from inferscale import Memory

KEY = "store-ttl-test-key"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("lg-ttl"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(scope="module")
def front(memory, loopback_front):
    with loopback_front(memory, KEY) as url:
        yield url


class Clock:
    """The store's clock, moved by hand."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, minutes: float) -> None:
        self.t += minutes * 60


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(store_module, "now", clock)
    return clock


@pytest.fixture(params=["in-process", "http"])
def make_store(request, memory):
    """``make_store(ttl=...)``: a store with its own ``store_id`` over the module's memory."""
    store_id = f"lg-{uuid.uuid4().hex[:8]}"

    def make(**kwargs) -> InferScaleStore:
        if request.param == "in-process":
            return InferScaleStore(memory, store_id=store_id, **kwargs)
        return InferScaleStore(url=request.getfixturevalue("front"), api_key=KEY, store_id=store_id, **kwargs)

    return make


@pytest.fixture
def spies(memory, monkeypatch):
    """Counts of what a refresh must not do: write a new text and embedding to Chroma (an
    update that re-embeds), invalidate KV. The front serves the same memory, so they count
    HTTP calls too (over HTTP a listing embeds its placeholder query: embedding calls alone
    would not tell)."""
    calls = {"reembed": 0, "invalidate": 0}
    facts = memory.components.facts

    def counting(name: str, call):
        def counted(*a, **k):
            calls[name] += 1
            return call(*a, **k)
        return counted

    monkeypatch.setattr(facts.store, "update", counting("reembed", facts.store.update))
    monkeypatch.setattr(facts.kv, "invalidate", counting("invalidate", facts.kv.invalidate))
    return calls


def memories(memory: Memory, store: InferScaleStore) -> dict[str, dict]:
    """The store's items in its own scope, by key, as memories."""
    found = memory.get_all(agent_id=store.store_id, limit=1000)["results"]
    return {m["metadata"]["langgraph"]["key"]: m for m in found}


def test_expired_items_are_hidden_before_a_sweep_and_swept(make_store, memory, clock):
    store = make_store(ttl={"default_ttl": 10})
    store.put(("docs",), "default", {"text": "ten minutes"})
    store.put(("docs",), "short", {"text": "two minutes"}, ttl=2)
    store.put(("docs",), "forever", {"text": "no expiry"}, ttl=None)
    store.put(("other",), "short2", {"text": "a namespace of its own"}, ttl=2)
    stored = memories(memory, store)
    assert stored["default"]["metadata"]["lg_ttl_minutes"] == 10.0
    assert stored["default"]["metadata"]["expires_at"] == pytest.approx(clock.t + 600)
    assert stored["short"]["metadata"]["expires_at"] == pytest.approx(clock.t + 120)
    assert "expires_at" not in stored["forever"]["metadata"]
    assert store.list_namespaces() == [("docs",), ("other",)]

    clock.advance(3)  # the short ones expired; nothing swept yet
    assert store.get(("docs",), "short") is None and store.get(("other",), "short2") is None
    assert store.get(("docs",), "default").value == {"text": "ten minutes"}
    assert [i.key for i in store.search(("docs",))] == ["default", "forever"]
    assert sorted(i.key for i in store.search(("docs",), query="two minutes")) == ["default", "forever"]
    assert store.list_namespaces() == [("docs",)]
    assert len(memories(memory, store)) == 4  # still stored
    assert store.sweep_ttl() == 2
    assert sorted(memories(memory, store)) == ["default", "forever"]
    assert store.sweep_ttl() == 0

    clock.advance(10)
    assert store.get(("docs",), "default") is None
    assert asyncio.run(store.asweep_ttl()) == 1
    assert sorted(memories(memory, store)) == ["forever"]


def test_a_read_refreshes_without_embedding_invalidating_kv_or_moving_updated_at(make_store, memory, clock, spies):
    store = make_store(ttl={"default_ttl": 5, "refresh_on_read": True})
    store.put(("docs",), "a", {"text": "refreshed by reads"})
    store.put(("docs",), "b", {"text": "refreshed by a search"})
    store.put(("docs",), "c", {"text": "never refreshed"})
    before = memories(memory, store)
    spies.update(reembed=0, invalidate=0)

    clock.advance(4)
    item = store.get(("docs",), "a")
    assert (item.created_at, item.updated_at) == (store.get(("docs",), "a", refresh_ttl=False).created_at,
                                                    store.get(("docs",), "a", refresh_ttl=False).updated_at)
    assert [i.key for i in store.search(("docs",), filter={"text": "refreshed by a search"})] == ["b"]
    store.get(("docs",), "c", refresh_ttl=False)
    assert store.search(("docs",), filter={"text": "never refreshed"}, refresh_ttl=False)[0].key == "c"
    assert spies == {"reembed": 0, "invalidate": 0}  # a refresh embeds nothing and keeps the KV
    after = memories(memory, store)
    for key in ("a", "b"):
        assert after[key]["metadata"]["expires_at"] == pytest.approx(clock.t + 300)
        assert (after[key]["id"], after[key]["memory"], after[key]["updated_at"]) == \
            (before[key]["id"], before[key]["memory"], before[key]["updated_at"])
    assert after["c"]["metadata"] == before["c"]["metadata"]

    clock.advance(2)  # 6 minutes after the puts, 2 after the reads
    assert store.get(("docs",), "c", refresh_ttl=False) is None
    assert store.get(("docs",), "a", refresh_ttl=False).value == {"text": "refreshed by reads"}
    assert store.get(("docs",), "b", refresh_ttl=False) is not None
    assert store.sweep_ttl() == 1


def test_reads_refresh_only_when_refresh_on_read_is_true(make_store, memory, clock):
    """As SqliteStore: a ``ttl`` without ``refresh_on_read: True`` (or none) never refreshes."""
    for ttl in (None, {"default_ttl": 5}, {"default_ttl": 5, "refresh_on_read": False}):
        store = make_store(ttl=ttl)
        store.put(("docs",), "k", {"text": "no refresh"}, ttl=5)
        expires = memories(memory, store)["k"]["metadata"]["expires_at"]
        clock.advance(1)
        store.get(("docs",), "k", refresh_ttl=True)
        store.search(("docs",), refresh_ttl=True)
        assert memories(memory, store)["k"]["metadata"]["expires_at"] == expires
        store.delete(("docs",), "k")


def test_a_put_sets_replaces_or_clears_the_expiry(make_store, memory, clock):
    store = make_store()
    store.put(("docs",), "k", {"text": "first"}, ttl=1)
    first = memories(memory, store)["k"]
    store.put(("docs",), "k", {"text": "second"})  # no ttl, no default: no expiry
    assert "expires_at" not in memories(memory, store)["k"]["metadata"]
    clock.advance(2)
    assert store.get(("docs",), "k").value == {"text": "second"}
    store.put(("docs",), "k", {"text": "third"}, ttl=1)
    clock.advance(2)
    assert store.get(("docs",), "k") is None
    # a put of an expired key not yet swept is a new item (a new created_at), not an update
    store.put(("docs",), "k", {"text": "fourth"})
    now = memories(memory, store)["k"]
    assert now["id"] != first["id"] and len(memories(memory, store)) == 1
    assert store.get(("docs",), "k").value == {"text": "fourth"}
    store.batch([PutOp(("docs",), "b", {"text": "batched"}, ttl=0.5)])
    assert memories(memory, store)["b"]["metadata"]["lg_ttl_minutes"] == 0.5


def test_another_store_sees_the_expiry(memory, front, clock):
    """The expiry is in the memory: a store over HTTP sees what an in-process one wrote."""
    store_id = f"lg-{uuid.uuid4().hex[:8]}"
    local = InferScaleStore(memory, store_id=store_id, ttl={"default_ttl": 1})
    remote = InferScaleStore(url=front, api_key=KEY, store_id=store_id)
    local.put(("users", f"ttl-{store_id}"), "pref", {"content": "I like tea."})
    assert remote.get(("users", f"ttl-{store_id}"), "pref").value == {"content": "I like tea."}
    clock.advance(2)
    assert remote.get(("users", f"ttl-{store_id}"), "pref") is None
    assert remote.sweep_ttl() == 1
    assert memory.get_all(user_id=f"ttl-{store_id}")["results"] == []


def test_the_sweeper_thread_deletes_expired_items(make_store, memory):
    store = make_store(ttl={"default_ttl": 0.01, "sweep_interval_minutes": 0.005})  # 0.6 s, swept every 0.3 s
    future = store.start_ttl_sweeper()
    assert not future.done()
    store.put(("docs",), "k", {"text": "swept by the thread"})
    deadline = time.monotonic() + 30
    while memories(memory, store) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert memories(memory, store) == {}
    assert store.stop_ttl_sweeper(timeout=30) is True
    assert future.result(timeout=5) is None
    assert store.stop_ttl_sweeper() is True  # none running


def test_the_async_sweeper(make_store, memory):
    store = make_store(ttl={"default_ttl": 0.01})

    async def run():
        task = await store.astart_ttl_sweeper(sweep_interval_minutes=0.005)
        await store.aput(("docs",), "k", {"text": "swept by the thread, started from async code"})
        deadline = time.monotonic() + 30
        while memories(memory, store) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await store.astop_ttl_sweeper(timeout=30) is True
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert memories(memory, store) == {}


@pytest.mark.parametrize("call, error, words", [
    (lambda s: s.put(("docs",), "t", {"text": "x"}, ttl=-1), ValueError, "positive number of minutes"),
    (lambda s: s.put(("docs",), "t", {"text": "x"}, ttl=0), ValueError, "positive number of minutes"),
    (lambda s: s.put(("docs",), "t", {"text": "x"}, ttl=float("nan")), ValueError, "positive number"),
    (lambda s: s.put(("docs",), "t", {"text": "x"}, ttl="5"), TypeError, "number of minutes"),
    (lambda s: s.put(("docs",), "t", {"text": "x"}, ttl=True), TypeError, "number of minutes"),
    (lambda s: s.batch([PutOp(("docs",), "t", {"text": "x"}, ttl=-0.5)]), ValueError, "positive"),
    (lambda s: s.start_ttl_sweeper(sweep_interval_minutes=0), ValueError, "sweep_interval_minutes"),
])
def test_bad_ttls_are_refused_and_change_nothing(make_store, memory, call, error, words):
    store = make_store()
    with pytest.raises(error, match=words):
        call(store)
    assert memories(memory, store) == {}


@pytest.mark.parametrize("ttl, error, words", [
    (5, TypeError, "TTLConfig dict"),
    ({"default_ttl": -1}, ValueError, "default_ttl"),
    ({"default_ttl": "5"}, TypeError, "default_ttl"),
    ({"sweep_interval_minutes": 0}, ValueError, "sweep_interval_minutes"),
    ({"refresh_on_read": "yes"}, TypeError, "refresh_on_read"),
    ({"ttl": 5}, ValueError, "unknown key"),
])
def test_bad_ttl_configs_are_refused(memory, ttl, error, words):
    with pytest.raises(error, match=words):
        InferScaleStore(memory, ttl=ttl)
