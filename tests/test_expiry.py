"""A memory's ``expires_at`` (epoch seconds, in its metadata): search and chat skip it once
it has passed, before anything deletes it; ``get_all`` still lists it (issue 40)."""

from __future__ import annotations

import time

import pytest

from inferscale import Memory


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("expiry"), dtype="float32", precompute_kv=False) as memory:
        yield memory


def ids(result: dict) -> set[str]:
    return {m["id"] for m in result["results"]}


def test_an_expired_memory_is_not_found_but_still_listed(memory):
    past, future = time.time() - 5, time.time() + 3600
    old = memory.add("My passport number ends in 42.", user_id="exp-a", infer=False,
                     metadata={"expires_at": past})["results"][0]["id"]
    new = memory.add("My passport expires next year.", user_id="exp-a", infer=False,
                     metadata={"expires_at": future, "kind": "doc"})["results"][0]["id"]
    plain = memory.add("My passport is in the drawer.", user_id="exp-a", infer=False)["results"][0]["id"]
    found = ids(memory.search("passport", user_id="exp-a", limit=10))
    assert found == {new, plain}
    assert ids(memory.search("passport", user_id="exp-a", limit=10, filters={"kind": "doc"})) == {new}
    assert ids(memory.search("passport", user_id="exp-a", limit=10, mode="dense")) == {new, plain}
    assert ids(memory.get_all(user_id="exp-a")) == {old, new, plain}  # listed until deleted
    prompt = memory.prepare("Where is my passport?", user_id="exp-a", k=10, mode="text")
    assert {m["id"] for m in prompt.memories} == {new, plain}  # chat never sees it
    # moved into the future, it is found again; moved into the past, it goes
    memory.update_metadata(old, {"expires_at": future}, user_id="exp-a")
    assert old in ids(memory.search("passport", user_id="exp-a", limit=10))
    memory.update_metadata(new, {"expires_at": past}, user_id="exp-a")
    memory.update_metadata(old, {"expires_at": None}, user_id="exp-a")
    assert ids(memory.search("passport", user_id="exp-a", limit=10)) == {old, plain}


def test_a_memory_expires_while_the_index_is_warm(memory):
    """No write is needed for an expiry to take effect: the time passing is enough."""
    soon = memory.add("I am at the dentist today.", user_id="exp-b", infer=False,
                      metadata={"expires_at": time.time() + 1.5})["results"][0]["id"]
    assert ids(memory.search("dentist", user_id="exp-b")) == {soon}
    time.sleep(2)
    assert memory.search("dentist", user_id="exp-b")["results"] == []


@pytest.mark.parametrize("bad", ["2027-01-01", True, {"at": 1}])
def test_an_expiry_that_is_not_epoch_seconds_is_refused_and_nothing_is_written(memory, bad):
    before = memory.count(user_id="exp-c")
    with pytest.raises(ValueError, match="expires_at.*epoch seconds"):
        memory.add("I like figs.", user_id="exp-c", infer=False, metadata={"expires_at": bad})
    assert memory.count(user_id="exp-c") == before
    kept = memory.add("I like dates.", user_id="exp-c", infer=False)["results"][0]["id"]
    with pytest.raises(ValueError, match="expires_at"):
        memory.update_metadata(kept, {"expires_at": bad}, user_id="exp-c")
    assert "expires_at" not in memory.get(kept, user_id="exp-c")["metadata"]


def test_show_expired_finds_them_in_process_and_over_http(memory, loopback_front):
    import httpx

    gone = memory.add("My old locker code was 1234.", user_id="exp-d", infer=False,
                      metadata={"expires_at": time.time() - 1})["results"][0]["id"]
    assert memory.search("locker code", user_id="exp-d")["results"] == []
    assert ids(memory.search("locker code", user_id="exp-d", show_expired=True)) == {gone}
    with pytest.raises(TypeError, match="show_expired"):
        memory.search("locker code", user_id="exp-d", show_expired="yes")
    with loopback_front(memory, "k") as url:
        auth = {"Authorization": "Bearer k"}
        body = {"query": "locker code", "user_id": "exp-d"}
        assert httpx.post(url + "/search", json=body, headers=auth).json()["results"] == []
        shown = httpx.post(url + "/search", json={**body, "show_expired": True}, headers=auth).json()["results"]
        assert [m["id"] for m in shown] == [gone]
        assert httpx.post(url + "/search", json={**body, "show_expired": 1}, headers=auth).status_code == 422


def test_an_expiry_no_float_holds_is_refused_and_changes_nothing(tmp_path):
    """``10**400`` is an int, but no float: the index keeps expiries as floats, so it would
    break every search of the scope. It is refused on add and on a metadata update."""
    from inferscale import Memory

    with Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False) as memory:
        mid = memory.add("Ivy keeps a diary.", user_id="ivy", infer=False)["results"][0]["id"]
        for bad in (10**400, -(10**400), float("nan"), float("inf")):
            said = "a finite number" if isinstance(bad, int) else "NaN and Infinity have no JSON form"
            with pytest.raises(ValueError, match=said):
                memory.add("Ivy likes figs.", user_id="ivy", infer=False, metadata={"expires_at": bad})
            with pytest.raises(ValueError, match=said):
                memory.update_metadata(mid, {"expires_at": bad}, user_id="ivy")
        assert [r["memory"] for r in memory.search("diary", user_id="ivy")["results"]] == ["Ivy keeps a diary."]
        assert memory.count(user_id="ivy") == 1 and "expires_at" not in memory.get(mid, user_id="ivy")["metadata"]
