"""``InferScaleStore``'s batches at database speed (issue 54): a batch's puts are one add,
update and delete per scope; concurrent callers (coroutines of one ``asyncio.gather``, threads)
are joined into few batches (group commit); a caller that gives up is dropped, and a caller
whose batch fails gets its own error while the others' writes land. In-process and over HTTP."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from langchain_inferscale import InferScaleStore
from langgraph.store.base import PutOp

from inferscale import Memory

KEY = "store-batches-key"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("store-batches"), dtype="float32", precompute_kv=False,
                max_fact_tokens=64) as memory:
        yield memory


@pytest.fixture(params=["in-process", "http"])
def store(request, memory, loopback_front):
    """A fresh store over the module's memory, its joined runs counted (``store.runs``: ops per run)."""
    store_id = f"sb-{uuid.uuid4().hex[:8]}"
    if request.param == "in-process":
        store = InferScaleStore(memory, store_id=store_id)
        yield _counted(store)
    else:
        with loopback_front(memory, KEY) as url:
            yield _counted(InferScaleStore(url=url, api_key=KEY, store_id=store_id))


def _counted(store: InferScaleStore) -> InferScaleStore:
    store.runs = []
    run = store._joined._run

    def counting(ops):
        store.runs.append(len(ops))
        return run(ops)

    store._joined._run = counting
    return store


def test_a_batch_of_puts_is_one_write_per_kind(store, memory, monkeypatch):
    ns = ("users", f"u-{uuid.uuid4().hex[:6]}", "notes")
    store.batch([PutOp(ns, f"k{i}", {"content": f"Note number {i}."}) for i in range(40)])
    calls = {"add": 0, "update": 0, "delete": 0}
    facts = memory.components.facts
    for name in calls:
        method = getattr(facts.store, name)
        monkeypatch.setattr(facts.store, name, lambda *a, _m=method, _n=name, **k: (calls.__setitem__(
            _n, calls[_n] + 1), _m(*a, **k))[1])
    store.batch([PutOp(ns, f"k{i}", {"content": f"Note number {i}, revised."}) for i in range(20)]
                + [PutOp(ns, f"k{i}", None) for i in range(20, 30)]
                + [PutOp(ns, f"new{i}", {"content": f"New note {i}."}) for i in range(15)])
    assert calls == {"add": 1, "update": 1, "delete": 1}
    items = {i.key: i.value["content"] for i in store.search(ns, limit=100)}
    assert len(items) == 20 + 10 + 15 and items["k3"] == "Note number 3, revised." and "k25" not in items


def test_concurrent_coroutines_are_joined_into_few_batches(store):
    ns = ("test", "joined")

    async def main():
        await asyncio.gather(*[store.aput(ns, f"k{i}", {"v": i}) for i in range(300)])
        return await asyncio.gather(*[store.aget(ns, f"k{i}") for i in range(300)])

    got = asyncio.run(main())
    assert [g.value["v"] for g in got] == list(range(300))
    assert len(store.runs) <= 6 and max(store.runs) >= 100, store.runs  # not 600 runs of one op


def test_threads_are_joined_and_every_write_lands(store):
    ns = ("test", "threads")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: store.put(ns, f"k{i}", {"v": i}), range(80)))
    assert len(store.runs) < 80 and sum(store.runs) == 80, store.runs
    assert sorted(i.value["v"] for i in store.search(ns, limit=100)) == list(range(80))


def test_a_cancelled_caller_is_dropped_and_the_others_land(store):
    ns = ("test", "cancelled")

    async def main():
        tasks = [asyncio.create_task(store.aput(ns, f"k{i}", {"v": i})) for i in range(40)]
        await asyncio.sleep(0)  # every task has handed in its put
        for t in tasks[10:20]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await asyncio.wait_for(asyncio.gather(*[store.aget(ns, f"k{i}") for i in range(40)]), 60)

    got = asyncio.run(main())
    assert all(g is not None for g in got[:10] + got[20:])  # nobody waits forever for a dropped caller
    store.put(ns, "after", {"v": -1})  # and the store still runs batches
    assert store.get(ns, "after").value == {"v": -1}


def test_a_failing_caller_gets_its_own_error_and_the_others_land(store):
    ns = ("test", "failing")
    too_long = {"content": "word " * 200}  # over max_fact_tokens: refused only when its batch runs

    async def main():
        good = [store.aput(ns, f"k{i}", {"v": i}) for i in range(20)]
        return await asyncio.gather(*good[:10], store.aput(ns, "bad", too_long), *good[10:], return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[10], ValueError) and "max_fact_tokens" in str(results[10])
    assert [r for i, r in enumerate(results) if i != 10] == [None] * 20
    assert store.get(ns, "bad") is None and len(store.search(ns, limit=100)) == 20


def test_a_coroutine_and_a_full_executor_of_sync_callers_all_finish(store):
    """Sync puts filling the event loop's default executor (as LangGraph runs sync nodes) and an
    ``aput`` at the same time: the coroutine's lead runs in a thread of its own, not queued
    behind the callers waiting for it."""
    import os
    import threading

    async def main():
        loop = asyncio.get_running_loop()
        go = threading.Event()
        workers = min(32, (os.cpu_count() or 1) + 4)  # the default executor's size

        def sync_node(i):
            go.wait()
            store.put(("test", "mixed"), f"sync{i}", {"v": i})

        syncs = [loop.run_in_executor(None, sync_node, i) for i in range(workers)]
        await asyncio.sleep(0.2)
        put = asyncio.create_task(store.aput(("test", "mixed"), "async", {"v": -1}))
        await asyncio.sleep(0.2)
        go.set()
        await asyncio.wait_for(asyncio.gather(put, *syncs), 120)
        return workers

    workers = asyncio.run(main())
    assert len(store.search(("test", "mixed"), limit=100)) == workers + 1


def test_a_put_that_a_later_put_of_its_key_replaces_is_still_checked(store):
    ns = ("test", "shadowed")
    with pytest.raises(ValueError, match="max_fact_tokens"):
        store.batch([PutOp(ns, "k", {"content": "word " * 200}), PutOp(ns, "k", {"content": "fine"})])
    assert store.get(ns, "k") is None  # refused whole


def test_an_embedder_that_reads_the_store_does_not_wait_for_itself(memory):
    seen = []

    def embed(texts):
        seen.append(store.get(("users", "re"), "other"))  # runs inside the store's own batch
        return [[1.0, 2.0, 3.0] for _ in texts]

    store = InferScaleStore(memory, store_id=f"sb-{uuid.uuid4().hex[:8]}", index={"dims": 3, "embed": embed})
    with ThreadPoolExecutor(1) as pool:
        pool.submit(store.put, ("users", "re"), "k", {"content": "x"}).result(timeout=60)
    assert seen == [None] and store.get(("users", "re"), "k").value == {"content": "x"}


def test_over_http_a_batch_split_into_requests_is_taken_back_whole_when_one_fails(memory, loopback_front):
    from inferscale.server.limits import FrontLimits

    blob = "x" * (FrontLimits().max_body_bytes // 400)  # 500 of them: a request over the body limit (413)
    with loopback_front(memory, KEY) as url:
        store = InferScaleStore(url=url, api_key=KEY, store_id=f"sb-{uuid.uuid4().hex[:8]}")
        ns = ("users", f"carol-{uuid.uuid4().hex[:6]}")
        ops = [PutOp(ns, f"s{i}", {"content": f"small {i}"}) for i in range(1000)]
        ops += [PutOp(ns, f"b{i}", {"content": "big", "blob": blob}) for i in range(500)]
        with pytest.raises(ValueError):
            store.batch(ops)
        assert store.search(ns, limit=10) == []  # the first request's thousand items were taken back
        assert memory.count(user_id=ns[1]) == 0
