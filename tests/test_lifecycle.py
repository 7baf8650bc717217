"""The complete memory API on the real components (Chroma on disk, MiniLM, SmolLM2 KV)."""

import asyncio
import json

import pytest

from inferscale import AsyncMemory, Memory, MemoryNotFoundError
from inferscale.config import DEFAULT_EMBEDDER
from inferscale.kv.manager import KVManager
from inferscale.models.resolve import resolve_embedder
from inferscale.store.records import Scope, StoreError

def new_memory(path, **kw) -> Memory:
    return Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False, **kw)


@pytest.fixture
def mem(tmp_path):
    return new_memory(tmp_path / "store")


def test_every_method_round_trips_with_history(mem):
    added = mem.add("I live in Lisbon.", user_id="u", metadata={"topic": "home", "priority": 2})["results"][0]
    mid = added["id"]
    assert mem.get(mid, user_id="u")["memory"] == "I live in Lisbon."
    mem.update(mid, "I live in Porto.", user_id="u")
    got = mem.get(mid, user_id="u")
    assert got["memory"] == "I live in Porto." and got["metadata"] == {"topic": "home", "priority": 2}
    assert mem.search("Which city do I live in?", user_id="u")["results"][0]["memory"] == "I live in Porto."
    events = mem.history(mid, user_id="u")
    assert [e["event"] for e in events] == ["ADD", "UPDATE"]
    assert events[1]["old_memory"] == "I live in Lisbon." and events[1]["new_memory"] == "I live in Porto."
    mem.delete(mid, user_id="u")
    with pytest.raises(MemoryNotFoundError):
        mem.get(mid, user_id="u")
    assert [e["event"] for e in mem.history(mid, user_id="u")] == ["ADD", "UPDATE", "DELETE"]
    assert mem.search("city", user_id="u")["results"] == []


def test_search_filters_threshold_and_limit(mem):
    mem.add("I drink green tea every morning.", user_id="u", metadata={"topic": "food", "priority": 1})
    mem.add("I am allergic to peanuts.", user_id="u", metadata={"topic": "food", "priority": 3})
    mem.add("My sister is called Ana.", user_id="u", metadata={"topic": "family", "priority": 2})
    food = mem.search("What do I eat?", user_id="u", filters={"topic": "food"})["results"]
    assert {r["metadata"]["topic"] for r in food} == {"food"} and len(food) == 2
    urgent = mem.get_all(user_id="u", filters={"priority": {"gte": 2}})["results"]
    assert {r["memory"] for r in urgent} == {"I am allergic to peanuts.", "My sister is called Ana."}
    either = mem.get_all(user_id="u", filters={"OR": [{"topic": "family"}, {"priority": 1}]})["results"]
    assert len(either) == 2
    assert len(mem.search("tea", user_id="u", limit=1)["results"]) == 1
    strict = mem.search("What is my sister's name?", user_id="u", threshold=0.5)["results"]
    assert [r["memory"] for r in strict] == ["My sister is called Ana."]
    # a field no memory has matches nothing (as in Mem0 and Chroma), also under ne / nin
    assert mem.search("tea", user_id="u", filters={"colour": "red"})["results"] == []
    assert mem.get_all(user_id="u", filters={"colour": {"ne": "red"}})["results"] == []
    # Chroma's / MongoDB's spelling, NOT, contains
    assert mem.get_all(user_id="u", filters={"priority": {"$gte": 2}})["results"] == urgent
    spelled = mem.get_all(user_id="u", filters={"$or": [{"topic": {"$eq": "family"}}, {"priority": {"$in": [1]}}]})
    assert spelled["results"] == either
    not_food = mem.get_all(user_id="u", filters={"NOT": [{"topic": "food"}]})["results"]
    assert {r["metadata"]["topic"] for r in not_food} == {"family"}
    assert len(mem.get_all(user_id="u", filters={"topic": {"icontains": "FOO"}})["results"]) == 2
    with pytest.raises(ValueError, match="operator"):
        mem.get_all(user_id="u", filters={"priority": {"between": [1, 2]}})
    with pytest.raises(ValueError, match="non-empty list"):
        mem.search("tea", user_id="u", filters={"$and": {"topic": "food"}})


def test_scopes_by_agent_and_run(mem):
    mem.add("Prefers short answers.", agent_id="support-bot")
    mem.add("Ticket 42 is about billing.", user_id="u", run_id="session-1")
    assert len(mem.get_all(agent_id="support-bot")["results"]) == 1
    assert mem.get_all(user_id="u")["results"] == []  # (u, -, session-1) is another scope
    assert len(mem.get_all(user_id="u", run_id="session-1")["results"]) == 1
    with pytest.raises(ValueError, match="user_id, agent_id or run_id"):
        mem.get_all()


def test_same_fact_twice_is_stored_once_and_never_deleted(mem):
    first = mem.add("I have two cats.", user_id="u")["results"][0]
    second = mem.add("I have two cats.", user_id="u")["results"][0]
    assert second["event"] == "NOOP" and second["id"] == first["id"]
    assert len(mem.get_all(user_id="u")["results"]) == 1
    other = mem.add("I have three dogs.", user_id="u")["results"][0]
    with pytest.raises(ValueError, match="already holds this text"):
        mem.update(other["id"], "I have two cats.", user_id="u")
    assert mem.get(other["id"], user_id="u")["memory"] == "I have three dogs."


def test_update_and_delete_invalidate_kv_everywhere(mem):
    mid = mem.add("My favourite colour is teal.", user_id="u")["results"][0]["id"]
    mem.inject("What is my favourite colour?", user_id="u", k=1, wait_for_kv=True)
    owners = {p.name for p in mem.kv_dir.iterdir()}
    assert mid in owners
    old_keys = [k for k in mem.components.pool.memory_keys() if k.startswith(mid)]
    assert old_keys
    mem.update(mid, "My favourite colour is amber.", user_id="u")
    assert not (mem.kv_dir / mid).exists() and not any(k.startswith(mid) for k in mem.components.pool.memory_keys())
    req = mem.inject("What is my favourite colour?", user_id="u", k=1, wait_for_kv=True)
    new_key = req.kv_transfer_params["inferscale"]["segments"][1][0]
    assert new_key not in old_keys  # new text, new KV
    mem.delete(mid, user_id="u")
    assert not (mem.kv_dir / mid).exists() and not any(k.startswith(mid) for k in mem.components.pool.memory_keys())


def test_changed_model_fingerprint_recomputes_kv(mem):
    mem.add("The wifi password is on the fridge.", user_id="u")
    mem_scope = Scope("u")
    rec = mem.components.facts.list(mem_scope)
    other = KVManager(mem.model_path, "another-model", "float32", mem.components.prompts, mem.components.pool, mem.components.turns, 4096)
    other._encoder = mem.components.kv.encoder
    spans_a = mem.components.kv.fact_spans(mem_scope.key, rec, 0)
    spans_b = other.fact_spans(mem_scope.key, rec, 0)
    assert mem.components.kv.ensure(spans_a) == 1 and mem.components.kv.ensure(spans_a) == 0
    assert spans_a[0].key != spans_b[0].key
    assert other.ensure(spans_b) == 1  # never served the other model's KV


def test_delete_all_and_reset(mem):
    mem.add("A fact of u.", user_id="u")
    mem.add("A fact of v.", user_id="v")
    assert mem.delete_all(user_id="u")["message"].startswith("1 ")
    assert mem.get_all(user_id="u")["results"] == []
    assert len(mem.get_all(user_id="v")["results"]) == 1
    mem.reset()
    assert mem.get_all(user_id="v")["results"] == [] and mem.components.store.count() == 0 and mem.components.index.size() == 0


def test_unknown_ids_and_cross_scope_ids_are_not_found(mem):
    mid = mem.add("Only u may see this.", user_id="u")["results"][0]["id"]
    for call in (
        lambda: mem.get(mid, user_id="intruder"),
        lambda: mem.update(mid, "hacked", user_id="intruder"),
        lambda: mem.delete(mid, user_id="intruder"),
        lambda: mem.history(mid, user_id="intruder"),
        lambda: mem.get("no-such-id", user_id="u"),
    ):
        with pytest.raises(MemoryNotFoundError, match="not found"):
            call()
    assert mem.get(mid, user_id="u")["memory"] == "Only u may see this."
    assert [e["event"] for e in mem.history(mid, user_id="u")] == ["ADD"]


def test_bad_stores_are_refused_clearly(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="writable"):
        new_memory(blocker / "store")
    store = tmp_path / "store"
    new_memory(store).add("hello", user_id="u")
    another_embedder = resolve_embedder(DEFAULT_EMBEDDER)  # the same model under another name
    with pytest.raises(StoreError, match="embedder"):
        new_memory(store, embedder=another_embedder)
    manifest = json.loads((store / "inferscale.json").read_text())
    (store / "inferscale.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(StoreError, match="newer"):
        new_memory(store)
    for damaged, says in (("{not json", "cannot be read"), ("[1, 2]", "is not a JSON object")):
        (store / "inferscale.json").write_text(damaged)
        with pytest.raises(StoreError, match=f"manifest .*inferscale.json {says}.*delete it"):
            new_memory(store)


def test_async_memory_and_sync_inside_a_running_loop(tmp_path):
    mem = new_memory(tmp_path / "store")
    amem = AsyncMemory(memory=mem)

    async def main():
        await asyncio.gather(*(amem.add(f"Async fact number {i}.", user_id=f"s{i % 3}") for i in range(12)))
        found = await amem.search("fact number 4", user_id="s1")
        sync_inside_loop = mem.get_all(user_id="s2")  # as in a Jupyter cell
        return found, sync_inside_loop

    found, inside = asyncio.run(main())
    assert found["results"][0]["memory"] == "Async fact number 4."
    assert len(inside["results"]) == 4
    with pytest.raises(AttributeError):
        amem.no_such_method


def test_fifty_scopes_with_overlapping_facts_never_cross(tmp_path):
    mem = new_memory(tmp_path / "store")
    shared = ["I like jazz.", "My car is red.", "I was born in March.", "I speak French.", "I have a sister."]
    users = [f"user{i:02d}" for i in range(50)]
    ids: dict[str, set[str]] = {}
    for i, u in enumerate(users):
        res = mem.add_facts([*shared, f"My locker number is {i}."], user_id=u)["results"]
        ids[u] = {r["id"] for r in res}
        assert len(ids[u]) == 6
    all_ids = set().union(*ids.values())
    assert len(all_ids) == 300  # the same text in 50 scopes is 50 memories
    for i, u in enumerate(users):
        found = mem.search("What is my locker number?", user_id=u, limit=100)["results"]
        assert {r["id"] for r in found} == ids[u]
        assert found[0]["memory"] == f"My locker number is {i}."
        other = users[(i + 1) % 50]
        foreign = next(iter(ids[other]))
        with pytest.raises(MemoryNotFoundError):
            mem.get(foreign, user_id=u)
        with pytest.raises(MemoryNotFoundError):
            mem.delete(foreign, user_id=u)
        req = mem.inject("What is my locker number?", user_id=u, k=6, wait_for_kv=True)
        owners = {seg[0].split("/")[0] for seg in req.kv_transfer_params["inferscale"]["segments"]}
        assert owners == {"_preamble"} | ids[u]
    mem.delete_all(user_id=users[0])
    assert mem.get_all(user_id=users[0])["results"] == []
    for u in users[1:]:
        assert {r["id"] for r in mem.get_all(user_id=u)["results"]} == ids[u]
