"""Writes of many memories in one call (issue 54): ``add`` with a metadata list,
``batch_update`` and ``batch_delete`` (Mem0's platform names), in process and over HTTP
(``POST /memories``, ``PUT`` / ``DELETE /memories/batch``). Each is one embedding call, one
Chroma write and one history transaction, and all or nothing: a bad entry is refused with
nothing written."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inferscale import AsyncMemory, Memory
from inferscale.types import MemoryNotFoundError

KEY = "batch-writes-test-key"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("batch-writes"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture
def calls(memory, monkeypatch):
    """How many embedding calls, Chroma writes and history transactions a write makes."""
    facts = memory.components.facts
    counts = {"encode": 0, "chroma": 0, "history": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(facts.embedder, "encode", counting("encode", facts.embedder.encode))
    for method in ("add", "update", "update_metadata", "delete"):
        monkeypatch.setattr(facts.store, method, counting("chroma", getattr(facts.store, method)))
    monkeypatch.setattr(facts.history, "record", counting("history", facts.history.record))
    return counts


def _state(memory: Memory, user_id: str) -> list[tuple]:
    return sorted((m["id"], m["memory"], repr(m["metadata"])) for m in memory.get_all(user_id=user_id)["results"])


def test_a_batch_is_one_embedding_one_chroma_write_and_one_history_transaction(memory, calls):
    texts = [f"Item {i} of the batch is a note about topic {i}." for i in range(50)]
    added = memory.add([{"role": "user", "content": t} for t in texts], user_id="bw-1", infer=False, dedupe=False,
                       metadata=[{"n": i} for i in range(50)])["results"]
    assert [a["event"] for a in added] == ["ADD"] * 50 and calls == {"encode": 1, "chroma": 1, "history": 1}
    stored = {m["id"]: m for m in memory.get_all(user_id="bw-1")["results"]}
    assert [stored[a["id"]]["metadata"] for a in added] == [{"n": i} for i in range(50)]

    calls.update(encode=0, chroma=0, history=0)
    out = memory.batch_update([{"memory_id": a["id"], "text": a["memory"] + " Revised.", **({"metadata": {"v": 2}}
                                                                                             if i % 2 else {})}
                               for i, a in enumerate(added[:20])], user_id="bw-1")
    assert out["message"] == "20 memories updated successfully!" and calls == {"encode": 1, "chroma": 1, "history": 1}
    assert [r["id"] for r in out["results"]] == [a["id"] for a in added[:20]]
    stored = {m["id"]: m for m in memory.get_all(user_id="bw-1")["results"]}
    assert stored[added[0]["id"]]["memory"].endswith("Revised.") and stored[added[0]["id"]]["metadata"] == {"n": 0}
    assert stored[added[1]["id"]]["metadata"] == {"v": 2}  # metadata given replaces; omitted keeps
    assert [h["event"] for h in memory.history(added[1]["id"], user_id="bw-1")] == ["ADD", "UPDATE"]
    hits = memory.search("topic 3 revised", user_id="bw-1", limit=1)["results"]
    assert hits[0]["id"] == added[3]["id"]  # re-embedded: the new text is what search finds

    calls.update(encode=0, chroma=0, history=0)
    out = memory.batch_delete([{"memory_id": a["id"]} for a in added[:30]], user_id="bw-1")
    assert out["message"] == "30 memories deleted successfully!" and calls == {"encode": 0, "chroma": 1, "history": 1}
    assert {m["id"] for m in memory.get_all(user_id="bw-1")["results"]} == {a["id"] for a in added[30:]}


def _kv_keys(memory: Memory) -> dict[str, set[str]]:
    return {mid: {e["key"] for e in entries if e["tiers"]} for mid, entries in memory.kv_entries(user_id="bw-kv").items()}


def test_entries_without_text_set_metadata_fields_in_one_write_keeping_text_and_kv(memory, calls):
    added = memory.add([{"role": "user", "content": f"Session note {i}."} for i in range(10)], user_id="bw-meta",
                       infer=False, metadata=[{"n": i, "draft": True} for i in range(10)])["results"]
    before = {m["id"]: m for m in memory.get_all(user_id="bw-meta")["results"]}
    calls.update(encode=0, chroma=0, history=0)
    out = memory.batch_update([{"memory_id": a["id"], "metadata": {"expires_at": 4102444800.0 + i, "draft": None}}
                               for i, a in enumerate(added)], user_id="bw-meta")
    assert out["message"] == "10 memories updated successfully!"
    assert calls == {"encode": 0, "chroma": 1, "history": 1}  # nothing embedded: one metadata write
    after = {m["id"]: m for m in memory.get_all(user_id="bw-meta")["results"]}
    for i, a in enumerate(added):
        assert after[a["id"]]["metadata"] == {"n": i, "expires_at": 4102444800.0 + i}
        assert (after[a["id"]]["memory"], after[a["id"]]["updated_at"]) == (before[a["id"]]["memory"],
                                                                          before[a["id"]]["updated_at"])


def test_a_batch_update_invalidates_and_queues_the_kv_of_each_memory(tmp_path):
    with Memory(data_dir=tmp_path, dtype="float32", kv_encoder="transformers") as memory:
        ids = [a["id"] for a in memory.add([{"role": "user", "content": "The cat is grey."}, {"role": "user", "content": "The dog is brown."}], user_id="bw-kv",
                                           infer=False)["results"]]
        memory.wait_for_kv()
        before = _kv_keys(memory)
        memory.batch_update([{"memory_id": ids[0], "text": "The cat is black."},
                             {"memory_id": ids[1], "text": "The dog is white."}], user_id="bw-kv")
        memory.wait_for_kv()
        after = _kv_keys(memory)
        assert all(before[i] and after[i] and not before[i] & after[i] for i in ids)  # new KV, made again


@pytest.mark.parametrize("method, body, error, words", [
    ("batch_update", "not a list", TypeError, "list of dicts"),
    ("batch_update", [], ValueError, "empty list"),
    ("batch_update", [{"text": "a"}], ValueError, "lacks ['memory_id']"),
    ("batch_update", [{"memory_id": "X"}], ValueError, "neither 'text' nor 'metadata'"),
    ("batch_update", [{"memory_id": "X", "metadata": {}}], ValueError, "at least one"),
    ("batch_update", [{"memory_id": "X", "metadata": {"a": 1}}, {"memory_id": "X", "text": "b"}], ValueError,
     "twice"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "gone", "metadata": {"a": 1}}],
     MemoryNotFoundError, "'gone' not found"),
    ("batch_update", [{"memory_id": "X", "text": "a", "tags": 1}], ValueError, "unknown keys ['tags']"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "X", "text": "b"}], ValueError, "twice"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "Y", "text": "a"}], ValueError, "same text"),
    ("batch_update", [{"memory_id": "X", "text": "  "}], ValueError, "empty"),
    ("batch_update", [{"memory_id": "X", "text": "a", "metadata": {"v": float("nan")}}], ValueError, "NaN"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "gone", "text": "b"}], MemoryNotFoundError,
     "'gone' not found"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "Y", "metadata": {"user_id": "bob"}}],
     ValueError, "batch_update entry 1: "),  # a patch refused after a text change: the change is not written
    ("batch_update", [{"memory_id": "X", "text": None}], TypeError, "batch_update entry 0: its text must be a string"),
    ("batch_update", [{"memory_id": "X", "text": "a"}, {"memory_id": "Y", "text": "b", "metadata": {"created_at": 1}}],
     ValueError, "batch_update entry 1: "),
    ("batch_delete", [{"memory_id": "X"}, {"memory_id": "gone"}], MemoryNotFoundError, "'gone' not found"),
    ("batch_delete", ["X"], TypeError, "must be a dict"),
    ("add", None, ValueError, "2 entries for 3 messages"),
])
def test_bad_input_is_refused_and_changes_nothing(memory, method, body, error, words):
    ids = [a["id"] for a in memory.add([{"role": "user", "content": t} for t in ("First note.", "Second note.", "Third note.")], user_id="bw-bad",
                                       infer=False)["results"]]
    body = [{**e, "memory_id": {"X": ids[0], "Y": ids[1]}.get(e["memory_id"], e["memory_id"])}
            if isinstance(e, dict) and "memory_id" in e else e for e in body] if isinstance(body, list) else body
    before = _state(memory, "bw-bad")
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        if method == "add":
            memory.add([{"role": "user", "content": t} for t in "ABC"], metadata=[{}, {}], user_id="bw-bad", infer=False)
        else:
            getattr(memory, method)(body, user_id="bw-bad")
    assert _state(memory, "bw-bad") == before
    memory.delete_all(user_id="bw-bad")


def test_a_text_change_and_a_patch_racing_a_delete_write_both_or_neither(memory):
    """A batch_update of one text and one memory's metadata, while another thread deletes the
    second: either the delete comes first (the update is refused whole) or after (both written)."""
    import threading

    for round_ in range(6):
        ids = [a["id"] for a in memory.add([{"role": "user", "content": f"Race {round_} {t}."} for t in "ab"],
                                           user_id="bw-race", infer=False)["results"]]
        errors = []

        def update():
            try:
                memory.batch_update([{"memory_id": ids[0], "text": f"Race {round_} a, changed."},
                                     {"memory_id": ids[1], "metadata": {"p": 1}}], user_id="bw-race")
            except MemoryNotFoundError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=update),
                   threading.Thread(target=lambda: memory.batch_delete([{"memory_id": ids[1]}], user_id="bw-race"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        text = memory.get(ids[0], user_id="bw-race")["memory"]
        assert text == (f"Race {round_} a." if errors else f"Race {round_} a, changed."), (errors, text)
        memory.delete_all(user_id="bw-race")


def test_another_scopes_memory_is_not_found_and_stays(memory):
    theirs = memory.add("Bob's note.", user_id="bw-bob", infer=False)["results"][0]["id"]
    with pytest.raises(MemoryNotFoundError):
        memory.batch_update([{"memory_id": theirs, "text": "Mallory's now."}], user_id="bw-mallory")
    with pytest.raises(MemoryNotFoundError):
        memory.batch_delete([{"memory_id": theirs}], user_id="bw-mallory")
    assert memory.get(theirs, user_id="bw-bob")["memory"] == "Bob's note."


def test_async_memory_takes_them(memory):
    async def main():
        m = AsyncMemory(memory=memory)
        mid = (await m.add("Async note.", user_id="bw-async", infer=False))["results"][0]["id"]
        await m.batch_update([{"memory_id": mid, "text": "Async note, revised."}], user_id="bw-async")
        assert (await m.get(mid, user_id="bw-async"))["memory"] == "Async note, revised."
        await m.batch_delete([{"memory_id": mid}], user_id="bw-async")
        assert (await m.get_all(user_id="bw-async"))["results"] == []

    asyncio.run(main())


def test_the_batch_routes_over_http(memory, loopback_front):
    with loopback_front(memory, KEY) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                          timeout=60) as http:
        resp = http.post("/memories", json={"messages": [{"role": "user", "content": "Red."},
                                                         {"role": "user", "content": "Blue."}],
                                            "metadata": [{"c": "r"}, None], "user_id": "bw-http"})
        assert resp.status_code == 200, resp.text
        ids = [r["id"] for r in resp.json()["results"]]
        assert [m["metadata"] for m in memory.get_all(user_id="bw-http")["results"]] == [{"c": "r"}, {}]
        resp = http.put("/memories/batch", json={"user_id": "bw-http", "memories": [
            {"memory_id": ids[0], "text": "Crimson."}, {"memory_id": ids[1], "text": "Navy.", "metadata": {"c": "n"}}]})
        assert resp.status_code == 200 and resp.json()["message"] == "2 memories updated successfully!", resp.text
        assert [(m["memory"], m["metadata"]) for m in memory.get_all(user_id="bw-http")["results"]] == \
            [("Crimson.", {"c": "r"}), ("Navy.", {"c": "n"})]
        resp = http.put("/memories/batch", json={"user_id": "bw-http", "memories": [
            {"memory_id": ids[0], "metadata": {"tag": "warm", "c": None}}]})
        assert resp.status_code == 200, resp.text
        assert memory.get(ids[0], user_id="bw-http")["metadata"] == {"tag": "warm"}
        assert memory.get(ids[0], user_id="bw-http")["memory"] == "Crimson."
        before = _state(memory, "bw-http")
        for method, body, status, words in [
                ("PUT", {"user_id": "bw-http", "memories": []}, 422, "at least 1"),
                ("PUT", {"user_id": "bw-http", "memories": [{"memory_id": ids[0], "text": "x", "extra": 1}]}, 422,
                 "extra"),
                ("PUT", {"memories": [{"memory_id": ids[0], "text": "x"}]}, 400, "user_id"),
                ("PUT", {"user_id": "bw-http", "memories": [{"memory_id": ids[0], "text": "Green."},
                                                            {"memory_id": "gone", "text": "y"}]}, 404, "gone"),
                ("DELETE", {"user_id": "bw-other", "memories": [{"memory_id": ids[0]}]}, 404, ids[0]),
                ("POST", {"user_id": "bw-http", "messages": "One.", "metadata": [{}, {}]}, 400, "2 entries")]:
            path = "/memories" if method == "POST" else "/memories/batch"
            resp = http.request(method, path, json=body)
            assert resp.status_code == status and words in resp.text, (method, body, resp.status_code, resp.text)
            assert _state(memory, "bw-http") == before
        resp = http.request("DELETE", "/memories/batch", json={"user_id": "bw-http", "memories": [
            {"memory_id": i} for i in ids]})
        assert resp.status_code == 200 and resp.json()["message"] == "2 memories deleted successfully!", resp.text
        assert memory.get_all(user_id="bw-http")["results"] == []
        assert http.get("/health").status_code == 200  # still serving
