"""Memories on a Chroma server (``chroma run``) instead of the embedded store (issue 14, first
step): a real server on loopback, a Memory writing to it and another reading what it wrote,
across a restart of the server."""

from __future__ import annotations

import pytest

from inferscale import Memory
from inferscale.store import StoreError

def test_memories_live_on_the_chroma_server(tmp_path, chroma):
    url = chroma["url"]
    settings = dict(dtype="float32", context_window=0, precompute_kv=False, chroma_url=url)
    with Memory(data_dir=tmp_path / "a", **settings) as a:
        ids = [a.add(text, user_id="alice", metadata={"n": i})["results"][0]["id"]
               for i, text in enumerate(["I live in Lisbon.", "My dog is called Rex.", "I work as a nurse."])]
        a.add("Bob likes tea.", user_id="bob")
        assert a.search("Where do I live?", user_id="alice", limit=1)["results"][0]["id"] == ids[0]
    assert not (tmp_path / "a" / "chroma").exists()  # nothing embedded: the server holds the memories

    chroma["restart"]()  # the server keeps them on its own disk
    with Memory(data_dir=tmp_path / "b", **settings) as b:  # another process's data dir, same server
        got = b.get_all(user_id="alice")["results"]
        assert sorted(r["id"] for r in got) == sorted(ids)
        assert b.search("pets", user_id="alice", filters={"n": {"$gte": 1}}, limit=1)["results"][0]["id"] == ids[1]
        assert [r["memory"] for r in b.get_all(user_id="bob")["results"]] == ["Bob likes tea."]
        b.update(ids[0], "I live in Porto.", user_id="alice")
    with Memory(data_dir=tmp_path / "a", **settings) as a:
        assert a.get(ids[0], user_id="alice")["memory"] == "I live in Porto."


def test_an_unreachable_chroma_server_is_one_clear_error(tmp_path, unused_port):
    url = f"http://127.0.0.1:{unused_port}"  # nothing listens there
    with pytest.raises(StoreError, match=f"cannot reach the Chroma server at {url}") as caught:
        Memory(data_dir=tmp_path / "m", dtype="float32", precompute_kv=False, chroma_url=url)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="chroma_url must look like http://host:port"):
        Memory(data_dir=tmp_path / "m", chroma_url="localhost:8000")
