"""One process at a time opens an embedded store (:mod:`inferscale.store.open_lock`).

Chroma's embedded store breaks the view of every other process that has the folder open as
soon as one writes it ("Error finding id" on every later call, until a restart), so a second
process's ``Memory`` is refused, naming the first, and the first keeps working."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from inferscale import Memory
from inferscale.store.records import StoreError

CHILD = textwrap.dedent("""
    import sys
    from inferscale import Memory
    try:
        m = Memory(data_dir=sys.argv[1], dtype="float32", precompute_kv=False)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc)
    else:
        m.add("The child process was here.", user_id="u", infer=False)
        print("OPENED", m.count(user_id="u"))
        m.close()
""")


def child(data_dir) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(data_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_second_process_is_refused_naming_the_first_which_keeps_working(tmp_path):
    first = Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False)
    try:
        first.add("The parent process keeps bees.", user_id="u", infer=False)
        said = child(tmp_path)
        assert said.startswith("REFUSED StoreError") and f"pid {__import__('os').getpid()}" in said, said
        assert "one process at a time" in said and "inferscale serve" in said and "chroma_url" in said
        # the first process reads and writes as before (it broke here when the second could write)
        assert [r["memory"] for r in first.search("bees", user_id="u")["results"]] == ["The parent process keeps bees."]
        first.add("The parent process keeps goats.", user_id="u", infer=False)
        assert first.count(user_id="u") == 2
    finally:
        first.close()
    assert child(tmp_path) == "OPENED 3"  # closed: the next process opens it, and sees everything


def test_the_stores_of_one_process_share_the_hold_until_the_last_closes(tmp_path):
    a = Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False)
    b = Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False)  # the same process: allowed
    a.add("Shared within one process.", user_id="u", infer=False)
    a.close()
    assert child(tmp_path).startswith("REFUSED")  # b still holds it
    assert b.count(user_id="u") == 1
    b.close()
    assert child(tmp_path) == "OPENED 2"
    with Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False) as again:  # and this process again
        assert again.count(user_id="u") == 2


def test_a_refused_open_creates_nothing_and_names_the_data_dir(tmp_path):
    first = Memory(data_dir=tmp_path / "d", dtype="float32", precompute_kv=False)
    try:
        said = child(tmp_path / "d")
        assert f"the data dir {tmp_path / 'd'} is open in pid" in said, said
    finally:
        first.close()
    with pytest.raises(StoreError, match="one process at a time"):
        # the lock is per process, not per object: a file description held elsewhere refuses too
        from inferscale.store import open_lock

        held = open_lock.lock_open(tmp_path / "e" / "chroma", "a test holder")
        try:
            Memory(data_dir=tmp_path / "e", dtype="float32", precompute_kv=False)
        finally:
            held.close()
