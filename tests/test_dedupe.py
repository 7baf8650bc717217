"""``add(..., dedupe=False)``: a text the scope already holds is stored again as a new memory
(a key-value store keeps one value under two keys), and the index keeps finding a holder of
a text while any memory holds it (issue 40; docs/decisions.md, "LangGraph store: duplicate
values, index=False")."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inferscale import AsyncMemory, Memory

KEY = "dedupe-test-key"
TEXT = "The deploy key rotates every Monday."


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("dedupe"), dtype="float32", precompute_kv=False) as memory:
        yield memory


def texts(memory: Memory, user: str) -> list[tuple[str, str]]:
    return [(r["id"], r["memory"]) for r in memory.get_all(user_id=user, limit=100)["results"]]


def test_default_keeps_one_memory_per_text(memory):
    first = memory.add(TEXT, user_id="d-default")["results"][0]
    again = memory.add(TEXT, user_id="d-default")["results"][0]
    assert (first["event"], again["event"], again["id"]) == ("ADD", "NOOP", first["id"])
    assert len(texts(memory, "d-default")) == 1


def test_dedupe_false_stores_the_text_again(memory):
    first = memory.add(TEXT, user_id="d-twice")["results"][0]
    second = memory.add(TEXT, user_id="d-twice", dedupe=False)["results"][0]
    assert second["event"] == "ADD" and second["id"] != first["id"]
    assert sorted(texts(memory, "d-twice")) == sorted([(first["id"], TEXT), (second["id"], TEXT)])
    # one call with the same message twice: two memories too
    both = memory.add([{"role": "user", "content": "x1"}, {"role": "user", "content": "x1"}], user_id="d-twice",
                      dedupe=False)["results"]
    assert [e["event"] for e in both] == ["ADD", "ADD"] and both[0]["id"] != both[1]["id"]
    hits = memory.search("deploy key", user_id="d-twice", limit=10)["results"]
    assert {h["id"] for h in hits} >= {first["id"], second["id"]}
    # the default still refuses a third copy
    assert memory.add(TEXT, user_id="d-twice")["results"][0]["event"] == "NOOP"


def test_async_memory_takes_dedupe(memory):
    async def twice() -> list[dict]:
        amemory = AsyncMemory(memory=memory)
        return [(await amemory.add(TEXT, user_id="d-async", dedupe=False))["results"][0] for _ in range(2)]

    first, second = asyncio.run(twice())
    assert (first["event"], second["event"]) == ("ADD", "ADD") and first["id"] != second["id"]


def test_a_holder_is_found_while_any_remains(memory):
    user = "d-holders"
    a = memory.add(TEXT, user_id=user)["results"][0]["id"]
    b = memory.add(TEXT, user_id=user, dedupe=False)["results"][0]["id"]
    memory.update(a, "Something else entirely.", user_id=user)  # a gives the text up; b still holds it
    assert memory.find_texts([TEXT], user_id=user) == {TEXT: b}
    assert memory.add(TEXT, user_id=user)["results"][0] == {"id": b, "memory": TEXT, "event": "NOOP"}
    c = memory.add(TEXT, user_id=user, dedupe=False)["results"][0]["id"]
    memory.delete(b, user_id=user)
    assert memory.find_texts([TEXT], user_id=user) == {TEXT: c}
    memory.delete(c, user_id=user)
    assert memory.find_texts([TEXT], user_id=user) == {}
    assert memory.add(TEXT, user_id=user)["results"][0]["event"] == "ADD"


def test_duplicates_survive_a_reload(memory):
    user = "d-reload"
    ids = [memory.add(TEXT, user_id=user, dedupe=False)["results"][0]["id"] for _ in range(2)]
    memory.components.index.clear()  # the partition reloads from Chroma
    assert sorted(i for i, _ in texts(memory, user)) == sorted(ids)
    memory.delete(ids[0], user_id=user)
    assert memory.find_texts([TEXT], user_id=user) == {TEXT: ids[1]}


def test_update_takes_a_held_text_only_with_dedupe_false(memory):
    user = "d-update"
    a = memory.add(TEXT, user_id=user)["results"][0]["id"]
    b = memory.add("Another text.", user_id=user)["results"][0]["id"]
    with pytest.raises(ValueError, match="already holds this text"):
        memory.update(b, TEXT, user_id=user)
    memory.update(b, TEXT, user_id=user, dedupe=False)
    assert sorted(texts(memory, user)) == sorted([(a, TEXT), (b, TEXT)])
    # a duplicate's metadata can be changed with its text kept, dedupe or not
    memory.update(a, TEXT, user_id=user, metadata={"n": 1})
    assert memory.get(a, user_id=user)["metadata"] == {"n": 1}


def test_add_facts_dedupe_false(memory):
    user = "d-facts"
    events = memory.add_facts([TEXT, TEXT], user_id=user, encode_kv=False, dedupe=False)["results"]
    assert [e["event"] for e in events] == ["ADD", "ADD"]
    events = memory.add_facts([TEXT], user_id=user, encode_kv=False)["results"]
    assert [e["event"] for e in events] == ["NOOP"]


@pytest.mark.parametrize("call, error, name", [
    (lambda m: m.add(TEXT, user_id="d-bad", dedupe="no"), TypeError, "dedupe must be True or False"),
    (lambda m: m.add(TEXT, user_id="d-bad", dedupe=None), TypeError, "dedupe must be True or False"),
    (lambda m: m.add(TEXT, user_id="d-bad", infer=True, dedupe=False), ValueError, "needs infer=False"),
    (lambda m: m.add_facts([TEXT], user_id="d-bad", dedupe=0), TypeError, "dedupe must be True or False"),
    (lambda m: m.update("0" * 32, TEXT, user_id="d-bad", dedupe="false"), TypeError, "dedupe must be True or False"),
])
def test_bad_dedupe_is_refused(memory, assert_refused, call, error, name):
    assert_refused(memory, "d-bad", lambda: call(memory), error, name)


def test_server_routes_take_dedupe(memory, loopback_front):
    with loopback_front(memory, KEY) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                           timeout=60) as client:
        body = {"messages": TEXT, "user_id": "d-http"}
        first = client.post("/memories", json=body).json()["results"][0]
        assert client.post("/memories", json=body).json()["results"][0]["event"] == "NOOP"
        second = client.post("/memories", json={**body, "dedupe": False}).json()["results"][0]
        assert second["event"] == "ADD" and second["id"] != first["id"]
        bad = client.post("/memories", json={**body, "dedupe": "no"})
        assert bad.status_code == 422 and "dedupe" in bad.text
        other = client.post("/memories", json={**body, "messages": "Other."}).json()["results"][0]["id"]
        refused = client.put(f"/memories/{other}", params={"user_id": "d-http"}, json={"text": TEXT})
        assert refused.status_code == 400 and "already holds this text" in refused.text
        taken = client.put(f"/memories/{other}", params={"user_id": "d-http"}, json={"text": TEXT, "dedupe": False})
        assert taken.status_code == 200
        assert sorted(r["memory"] for r in memory.get_all(user_id="d-http")["results"]) == [TEXT] * 3
