"""Memories on a Chroma server (``chroma run``) instead of the embedded store (issue 14, first
step): a real server on loopback, a Memory writing to it and another reading what it wrote,
across a restart of the server."""

from __future__ import annotations

import pytest

from inferscale import Memory
from inferscale.store.records import StoreError

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


def test_a_chroma_url_never_hides_a_data_dirs_memories_and_the_copy_moves_them(tmp_path, chroma):
    """Issue 28: a data dir whose embedded store holds memories, opened with ``chroma_url``,
    is refused in one line naming how many and the command that moves them; the command
    copies them to the real server with their ids, metadata and history."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    url, data = chroma["url"], tmp_path / "data"
    settings = dict(dtype="float32", context_window=0, precompute_kv=False)
    with Memory(data_dir=data, **settings) as m:
        ids = [m.add(text, user_id="alice", metadata={"n": i})["results"][0]["id"]
               for i, text in enumerate(["I live in Lisbon.", "My dog is called Rex.", "I work as a nurse."])]
        m.add("Bob likes tea.", user_id="bob")
        m.update(ids[0], "I live in Porto.", user_id="alice")
        before = {i: m.get(i, user_id="alice") for i in ids}
        history = {i: m.history(i, user_id="alice") for i in ids}

    with pytest.raises(StoreError) as caught:
        Memory(data_dir=data, chroma_url=url, **settings)
    message = str(caught.value)
    assert "\n" not in message and "holds 4 memories" in message and "inferscale copy-to-chroma" in message, message
    assert f"--chroma-url {url}" in message and "hide_embedded_memories" in message

    exe = Path(sys.executable).with_name("inferscale")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSCALE_")}
    done = subprocess.run([str(exe), "copy-to-chroma", "--data-dir", str(data), "--chroma-url", url],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "copied 4 memories" in done.stdout, done.stdout + done.stderr
    assert not (data / "chroma").exists() and list(data.glob("chroma.copied-*"))  # the old store kept aside

    with Memory(data_dir=data, chroma_url=url, **settings) as m:
        for i in ids:
            got = m.get(i, user_id="alice")
            assert (got["memory"], got["metadata"], got["created_at"]) == (
                before[i]["memory"], before[i]["metadata"], before[i]["created_at"])
            assert m.history(i, user_id="alice") == history[i]
        assert [e["event"] for e in m.history(ids[0], user_id="alice")] == ["ADD", "UPDATE"]
        assert m.search("Where do I live?", user_id="alice", limit=1)["results"][0]["id"] == ids[0]
        assert [r["memory"] for r in m.get_all(user_id="bob")["results"]] == ["Bob likes tea."]

    again = subprocess.run([str(exe), "copy-to-chroma", "--data-dir", str(data), "--chroma-url", url],
                           capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 2 and "nothing to copy" in again.stderr, again.stderr

    other = tmp_path / "other"  # asked for explicitly, the server opens over embedded memories
    with Memory(data_dir=other, **settings) as m:
        m.add("I collect stamps.", user_id="carl")
    with Memory(data_dir=other, chroma_url=url, hide_embedded_memories=True, **settings) as m:
        assert m.get_all(user_id="carl")["results"] == []


def test_the_copy_goes_in_chromas_batches_refuses_a_served_dir_and_leaves_a_note(tmp_path, chroma):
    """From the breaker of issue 28: more memories than one Chroma write takes (5,461) are
    copied; a data dir `inferscale serve` holds is refused; the moved data dir is not opened
    without the server again (its empty embedded store would hide the memories)."""
    import numpy as np

    from inferscale.store.embedded import copy_to_server, embedded_count, embedded_path
    from inferscale.server.main import lock_data_dir
    from inferscale.store.chroma import ChromaServer, FactStore
    from inferscale.store.records import FactRecord, Scope

    data = tmp_path / "big"
    with Memory(data_dir=data, dtype="float32", context_window=0, precompute_kv=False) as m:
        m.add("I keep bees.", user_id="ann")
    local = FactStore(embedded_path(data))
    n = local.max_batch + 600
    records = [FactRecord(f"{i:032x}", f"bulk fact {i}", f"h{i}", Scope("bulk")) for i in range(n)]
    local.add(records, np.random.default_rng(0).standard_normal((n, 384)).astype(np.float32))  # more than one write
    assert embedded_count(data) == n + 1
    del local

    lock = lock_data_dir(data)  # as a running server holds it
    with pytest.raises(StoreError, match="is serving"):
        copy_to_server(data, ChromaServer(chroma["url"]))
    lock.close()
    assert embedded_count(data) == n + 1  # refused before anything moved

    copied, held, backup = copy_to_server(data, ChromaServer(chroma["url"]))
    assert (copied, held) == (n + 1, 0) and backup.is_dir()
    with pytest.raises(StoreError, match="were moved to the Chroma server at") as caught:
        Memory(data_dir=data, dtype="float32", precompute_kv=False)
    assert "\n" not in str(caught.value) and f"chroma_url={chroma['url']}" in str(caught.value)
    assert not embedded_path(data).exists()  # the refusal made no new empty store
    with Memory(data_dir=data, dtype="float32", precompute_kv=False, chroma_url=chroma["url"]) as m:
        assert m.count(user_id="bulk") == n and m.get_all(user_id="ann")["results"][0]["memory"] == "I keep bees."
