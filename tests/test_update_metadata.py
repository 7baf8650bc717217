"""``Memory.update_metadata``: a metadata-only update (issue 40; docs/decisions.md,
"LangGraph store: TTL"). It sets and removes top-level fields, keeps the text, the
embedding, the KV and ``updated_at``, is seen by filters at once, and runs over HTTP as
``PUT /memories/{id}`` without ``text``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inferscale import AsyncMemory, Memory
from inferscale.types import MemoryNotFoundError

KEY = "update-metadata-test-key"
TEXT = "The staging database is rebuilt every night."


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("update-metadata"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture
def spies(memory, monkeypatch):
    """Counts of what a metadata-only update must not do: embed, invalidate KV."""
    calls = {"encode": 0, "invalidate": 0}
    facts = memory.components.facts
    encode, invalidate = facts.embedder.encode, facts.kv.invalidate

    def counting_encode(*a, **k):
        calls["encode"] += 1
        return encode(*a, **k)

    def counting_invalidate(*a, **k):
        calls["invalidate"] += 1
        return invalidate(*a, **k)

    monkeypatch.setattr(facts.embedder, "encode", counting_encode)
    monkeypatch.setattr(facts.kv, "invalidate", counting_invalidate)
    return calls


def test_sets_and_removes_fields_keeping_text_embedding_kv_and_updated_at(memory, spies):
    added = memory.add(TEXT, user_id="um-1", metadata={"topic": "ops", "draft": True}, infer=False)["results"][0]
    before = memory.get(added["id"], user_id="um-1")
    spies.update(encode=0, invalidate=0)
    out = memory.update_metadata(added["id"], {"expires_at": 4102444800.5, "draft": None}, user_id="um-1")
    assert out["metadata"] == {"topic": "ops", "expires_at": 4102444800.5}
    after = memory.get(added["id"], user_id="um-1")
    assert after["metadata"] == {"topic": "ops", "expires_at": 4102444800.5}
    assert (after["memory"], after["hash"], after["created_at"], after["updated_at"]) == \
        (before["memory"], before["hash"], before["created_at"], before["updated_at"])
    assert spies == {"encode": 0, "invalidate": 0}
    # the index sees the new fields at once: filters, and search ranks with the old embedding
    assert [m["id"] for m in memory.get_all(user_id="um-1", filters={"expires_at": {"gt": 1e9}})["results"]] \
        == [added["id"]]
    assert memory.get_all(user_id="um-1", filters={"draft": True})["results"] == []
    hit = memory.search("when is the staging database rebuilt?", user_id="um-1", limit=1)["results"][0]
    assert hit["id"] == added["id"] and hit["metadata"]["expires_at"] == 4102444800.5
    events = memory.history(added["id"], user_id="um-1")
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in events][-1] == ("UPDATE", TEXT, TEXT)


def test_the_fields_survive_a_reload(memory, tmp_path):
    with Memory(data_dir=tmp_path / "reload", dtype="float32", precompute_kv=False) as first:
        mid = first.add(TEXT, user_id="um-r", infer=False)["results"][0]["id"]
        first.update_metadata(mid, {"n": 3}, user_id="um-r")
    with Memory(data_dir=tmp_path / "reload", dtype="float32", precompute_kv=False) as again:
        assert again.get(mid, user_id="um-r")["metadata"] == {"n": 3}
        assert [m["id"] for m in again.get_all(user_id="um-r", filters={"n": 3})["results"]] == [mid]


def test_async_memory_takes_it(memory):
    mid = memory.add("Async memories patch too.", user_id="um-a", infer=False)["results"][0]["id"]
    out = asyncio.run(AsyncMemory(memory=memory).update_metadata(mid, {"k": "v"}, user_id="um-a"))
    assert out["metadata"] == {"k": "v"}


@pytest.mark.parametrize("metadata, error, words", [
    ({}, ValueError, "at least one field"),
    (None, TypeError, "metadata must be a dict"),
    (["k", "v"], TypeError, "must be a dict"),
    ({1: "v"}, TypeError, "keys must be strings"),
    ({"n": float("nan")}, ValueError, "NaN"),
    ({"updated_at": "x"}, ValueError, "reserved"),
])
def test_bad_input_is_refused_and_changes_nothing(memory, metadata, error, words):
    mid = memory.add("Refusals change nothing.", user_id="um-bad", infer=False,
                     metadata={"kept": 1})["results"][0]["id"]
    with pytest.raises(error, match=words):
        memory.update_metadata(mid, metadata, user_id="um-bad")
    assert memory.get(mid, user_id="um-bad")["metadata"] == {"kept": 1}


def test_another_scope_or_id_is_not_found(memory):
    mid = memory.add("Only my scope patches me.", user_id="um-own", infer=False)["results"][0]["id"]
    with pytest.raises(MemoryNotFoundError):
        memory.update_metadata(mid, {"k": 1}, user_id="um-other")
    with pytest.raises(MemoryNotFoundError):
        memory.update_metadata("0" * 32, {"k": 1}, user_id="um-own")


def test_put_without_text_updates_the_metadata_over_http(memory, loopback_front, spies):
    mid = memory.add(TEXT, user_id="um-http", metadata={"a": 1}, infer=False)["results"][0]["id"]
    before = memory.get(mid, user_id="um-http")
    spies.update(encode=0, invalidate=0)
    with loopback_front(memory, KEY) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                          timeout=60) as http:
        resp = http.put(f"/memories/{mid}", params={"user_id": "um-http"}, json={"metadata": {"b": 2, "a": None}})
        assert resp.status_code == 200, resp.text
        assert resp.json()["metadata"] == {"b": 2}
        assert spies == {"encode": 0, "invalidate": 0}
        after = memory.get(mid, user_id="um-http")
        assert (after["metadata"], after["memory"], after["updated_at"]) == ({"b": 2}, TEXT, before["updated_at"])
        for body, status, words in [({}, 400, "give text"), ({"metadata": {}}, 400, "at least one field"),
                                    ({"metadata": {"created_at": "x"}}, 400, "reserved")]:
            resp = http.put(f"/memories/{mid}", params={"user_id": "um-http"}, json=body)
            assert resp.status_code == status and words in resp.text, resp.text
        resp = http.put(f"/memories/{mid}", params={"user_id": "um-else"}, json={"metadata": {"b": 3}})
        assert resp.status_code == 404, resp.text
        # with text, PUT replaces text and metadata as before (and embeds)
        resp = http.put(f"/memories/{mid}", params={"user_id": "um-http"}, json={"text": TEXT + " Twice.",
                                                                                  "metadata": {"c": 3}})
        assert resp.status_code == 200, resp.text
        assert memory.get(mid, user_id="um-http")["metadata"] == {"c": 3}
        assert spies["encode"] == 1


def test_another_worker_sees_the_fields_at_once(postgres_url, chroma, tmp_path):
    """Two API workers over one Chroma server and one PostgreSQL: a metadata update through
    one is in the other's next filtered read, its loaded partition caught up by id."""
    from inferscale.store.records import Scope

    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres_url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "w1", **settings) as w1, Memory(data_dir=tmp_path / "w2", **settings) as w2:
        mid = w1.add(TEXT, user_id="alice", metadata={"n": 1}, infer=False)["results"][0]["id"]
        assert [m["id"] for m in w2.get_all(user_id="alice", filters={"n": 1})["results"]] == [mid]
        assert w2.components.index.loaded(Scope("alice").key)
        w1.update_metadata(mid, {"n": 2}, user_id="alice")
        assert w2.get_all(user_id="alice", filters={"n": 1})["results"] == []
        assert [m["id"] for m in w2.get_all(user_id="alice", filters={"n": 2})["results"]] == [mid]
        w2.update_metadata(mid, {"n": None, "m": 3}, user_id="alice")
        assert w1.get_all(user_id="alice")["results"][0]["metadata"] == {"m": 3}
