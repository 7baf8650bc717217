"""The turn log and the history in PostgreSQL (issue 14, second step): a real PostgreSQL
(Debian's package) on loopback, shared by two processes and two Memory objects."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from inferscale import FactInput, Memory
from inferscale.store.sql import Database
from inferscale.store.records import Scope, StoreError
from inferscale.store.turns import TurnLog


APPENDER = textwrap.dedent("""
    import sys
    from inferscale.store.sql import Database
    from inferscale.store.turns import Turn, TurnLog

    log = TurnLog(Database(sys.argv[1]))
    for i in range(40):
        log.append("shared-scope", [Turn(f"{sys.argv[2]}-{i}", "user", f"turn {i} of {sys.argv[2]}")])
""")


def test_two_processes_append_to_one_scope_without_losing_or_duplicating_turns(postgres_url, tmp_path):
    script = tmp_path / "append.py"
    script.write_text(APPENDER)
    procs = [subprocess.Popen([sys.executable, str(script), postgres_url, name]) for name in ("p1", "p2")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    turns = TurnLog(Database(postgres_url)).scope_turns("shared-scope")
    assert [t.seq for t in turns] == list(range(80))  # one order, no gap, no duplicate
    assert sorted(t.turn_id for t in turns) == sorted(f"{p}-{i}" for p in ("p1", "p2") for i in range(40))
    for p in ("p1", "p2"):  # each process's turns in its own order
        assert [t.turn_id for t in turns if t.turn_id.startswith(p)] == [f"{p}-{i}" for i in range(40)]


def test_memories_share_the_turn_log_and_history_through_postgres(postgres_url, tmp_path):
    settings = dict(dtype="float32", context_window=2, precompute_kv=False, database_url=postgres_url)
    with Memory(data_dir=tmp_path / "a", **settings) as a:
        a.log_turns([{"id": "d1", "content": "Hi!"}, {"id": "d2", "content": "I moved to Lisbon last spring."}],
                    user_id="alice")
        mid = a.add_facts([FactInput("Alice lives in Lisbon.", ("d2",))], user_id="alice")["results"][0]["id"]
        a.update(mid, "Alice lives in Porto.", user_id="alice")
        before = a.count_turns(user_id="alice")
        with pytest.raises(ValueError, match="'d1' already exists"):
            a.log_turns([{"id": "d3", "content": "x"}, {"id": "d1", "content": "again"}], user_id="alice")
        assert a.count_turns(user_id="alice") == before  # nothing of the refused batch was written
        injection = a.inject("Where does Alice live?", user_id="alice", k=1, wait_for_kv=True)
        assert injection.kv_memory_ids == [mid]  # its KV was encoded with d1..d2 read from PostgreSQL
    with Memory(data_dir=tmp_path / "b", **settings) as b:  # another data dir: the log and history are shared
        assert [t.turn_id for t in b.get_turns(user_id="alice")] == ["d1", "d2"]
        assert [e["event"] for e in b.history(mid, user_id="alice")] == ["ADD", "UPDATE"]
        # a memory by its id alone, and every scope with its count (Mem0's Platform API), from PostgreSQL
        assert b.owner_of(mid) == {"user_id": "alice"}
        gone = b.add("I like tea.", agent_id="barista")["results"][0]["id"]
        b.delete(gone, agent_id="barista")
        b.add("Espresso, no sugar.", user_id="alice", agent_id="barista")
        assert [(s.get("user_id"), s.get("agent_id"), s["memories"]) for s in b.scopes()] == [
            ("alice", None, 1), ("alice", "barista", 1)]  # the agent's only memory was deleted
        assert b.owner_of(gone) == {"agent_id": "barista"}  # a deleted memory keeps its owner (its history)
    assert not (tmp_path / "a" / "turns.sqlite").exists() and not (tmp_path / "a" / "history.sqlite").exists()


def test_a_database_that_does_not_answer_is_one_clear_error(tmp_path, unused_port):
    url = f"postgresql+psycopg://inferscale@127.0.0.1:{unused_port}/postgres"
    with pytest.raises(StoreError, match="cannot use the database at postgresql") as caught:
        Memory(data_dir=tmp_path / "m", dtype="float32", precompute_kv=False, database_url=url)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="database_url must be a PostgreSQL"):
        Memory(data_dir=tmp_path / "m", database_url="mysql://u@h/db")


def test_a_write_through_one_memory_is_seen_by_the_next_search_through_another(postgres_url, chroma, tmp_path):
    """Two API workers' Memory objects over one Chroma server and one PostgreSQL: each reads
    the scope's version (the newest history event) before a read, so a write acknowledged by
    one is in the other's very next search: the visibility delay is 0 after the ack."""
    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres_url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "w1", **settings) as w1, Memory(data_dir=tmp_path / "w2", **settings) as w2:
        w1.add("I live in Lisbon.", user_id="alice")
        assert [r["memory"] for r in w2.search("home", user_id="alice")["results"]] == ["I live in Lisbon."]
        assert w2.components.index.loaded(Scope("alice").key)  # w2 holds the scope now; later writes must still reach it
        mid = w1.add("My dog is called Rex.", user_id="alice")["results"][0]["id"]
        assert w2.search("pets", user_id="alice", limit=1)["results"][0]["id"] == mid
        w2.update(mid, "My dog is called Max.", user_id="alice")
        assert w1.search("pets", user_id="alice", limit=1)["results"][0]["memory"] == "My dog is called Max."
        assert w1.add("My dog is called Max.", user_id="alice")["results"][0]["event"] == "NOOP"  # dedup sees w2's
        w1.delete(mid, user_id="alice")
        assert [r["memory"] for r in w2.get_all(user_id="alice")["results"]] == ["I live in Lisbon."]
        assert w2.count(user_id="alice") == 1
        w2.delete_all(user_id="alice")
        assert w1.search("home", user_id="alice")["results"] == []


def test_a_worker_catches_up_on_another_workers_writes_without_reloading_the_scope(postgres_url, chroma, tmp_path,
                                                                                    monkeypatch):
    """A worker's partition catches up on the memories another worker wrote (their ids from
    the history, their rows from Chroma) instead of reloading the scope: adds, updates
    (text, embedding, hash, metadata), deletes, interleaved writes of its own, filters and
    BM25 follow; a reset elsewhere, or more changes than the partition is worth, reloads."""
    import inferscale.store.index

    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres_url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "w1", **settings) as w1, Memory(data_dir=tmp_path / "w2", **settings) as w2:
        w1.add_facts([FactInput(f"Background fact number {i}.", ()) for i in range(6)], user_id="carol")
        assert w2.count(user_id="carol") == 6
        loads = w2.components.index.loads

        w1.add("I keep bees in the garden.", user_id="carol", metadata={"topic": "hobby"})
        found = w2.search("What insects does she keep?", user_id="carol", limit=1)["results"]
        assert found[0]["memory"] == "I keep bees in the garden."
        assert [r["memory"] for r in w2.get_all(user_id="carol", filters={"topic": "hobby"})["results"]] == \
            ["I keep bees in the garden."]  # the filter columns follow the caught-up rows
        mid = found[0]["id"]
        assert (w2.components.index.loads, w2.components.index.catch_ups) == (loads, 1)

        w1.update(mid, "I keep goats behind the barn.", user_id="carol", metadata={"topic": "farm"})
        top = w2.search("goats", user_id="carol", limit=1, mode="hybrid")["results"][0]  # BM25 rebuilt too
        assert (top["id"], top["memory"], top["metadata"]) == (mid, "I keep goats behind the barn.", {"topic": "farm"})
        assert w2.get_all(user_id="carol", filters={"topic": "hobby"})["results"] == []
        assert w2.add("I keep goats behind the barn.", user_id="carol")["results"][0]["event"] == "NOOP"
        assert w2.add("I keep bees in the garden.", user_id="carol")["results"][0]["event"] == "ADD"  # old hash gone

        w1.add("My sister lives in Oslo.", user_id="carol")  # between w2's read and w2's next write
        w2.add("My brother lives in Rome.", user_id="carol")
        w1.delete(mid, user_id="carol")
        texts = sorted(r["memory"] for r in w2.get_all(user_id="carol")["results"])
        assert texts == sorted([*(f"Background fact number {i}." for i in range(6)), "I keep bees in the garden.",
                                "My sister lives in Oslo.", "My brother lives in Rome."])
        assert texts == sorted(r["memory"] for r in w1.get_all(user_id="carol")["results"])
        assert w2.components.index.loads == loads  # never reloaded: every change came as a catch-up

        monkeypatch.setattr(inferscale.store.index, "CATCH_UP_MIN", 2)  # more changes than worth catching up on
        w1.add_facts([FactInput(f"Bulk fact {i}.", ()) for i in range(8)], user_id="carol")
        assert w2.count(user_id="carol") == 17 and w2.components.index.loads == loads + 1
        monkeypatch.undo()

        w1.reset()  # deletes without events: the history's event at w2's version is gone
        w1.add("A fresh start.", user_id="carol")
        assert [r["memory"] for r in w2.get_all(user_id="carol")["results"]] == ["A fresh start."]
        assert w2.components.index.loads == loads + 2


def test_catching_up_under_concurrent_updates_and_searches_ends_on_the_last_write(postgres_url, chroma, tmp_path):
    """One worker updates a memory 25 times while the other searches from two threads and
    updates its own memory: fetches racing newer writes never leave an older row behind."""
    import threading

    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres_url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "w1", **settings) as w1, Memory(data_dir=tmp_path / "w2", **settings) as w2:
        theirs = w1.add("Dave's locker code is 0.", user_id="dave")["results"][0]["id"]
        mine = w2.add("Dave's bike has 0 gears.", user_id="dave")["results"][0]["id"]
        stop, errors = threading.Event(), []

        def search() -> None:
            try:
                while not stop.is_set():
                    w2.search("locker code", user_id="dave", limit=2)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        readers = [threading.Thread(target=search) for _ in range(2)]
        for t in readers:
            t.start()
        for i in range(1, 26):
            w1.update(theirs, f"Dave's locker code is {i}.", user_id="dave")
            if i % 5 == 0:
                w2.update(mine, f"Dave's bike has {i} gears.", user_id="dave")
        stop.set()
        for t in readers:
            t.join()
        assert errors == []
        want = sorted(["Dave's locker code is 25.", "Dave's bike has 25 gears."])
        assert sorted(r["memory"] for r in w2.get_all(user_id="dave")["results"]) == want
        assert sorted(r["memory"] for r in w1.get_all(user_id="dave")["results"]) == want


def test_a_history_table_that_reused_seqs_is_rebuilt_and_a_reset_elsewhere_is_seen(chroma, tmp_path):
    """Data dirs of commits 66945c8..b4275c2 have a history table without AUTOINCREMENT, so
    after a reset SQLite reused seqs: a worker holding version 3 saw the new events 4-5 as
    all that changed, listed deleted facts and answered NOOP for a deleted text (found by
    the breaker). Opening such a data dir rebuilds the table, its rows and seqs kept."""
    import sqlite3

    data = tmp_path / "data"
    data.mkdir()
    con = sqlite3.connect(data / "history.sqlite")
    con.execute("CREATE TABLE history (seq INTEGER NOT NULL, scope VARCHAR NOT NULL, memory_id VARCHAR NOT NULL, "
                "event VARCHAR NOT NULL, old_memory TEXT, new_memory TEXT, created_at VARCHAR NOT NULL, "
                "PRIMARY KEY (seq))")  # the table as 66945c8 made it
    con.execute("INSERT INTO history VALUES (7, 'elsewhere', 'm1', 'ADD', NULL, 'kept', '2026-12-02T00:00:00')")
    con.commit()
    con.close()
    settings = dict(data_dir=data, dtype="float32", context_window=0, precompute_kv=False, chroma_url=chroma["url"])
    with Memory(**settings) as a, Memory(**settings) as b:
        table = sqlite3.connect(data / "history.sqlite").execute(
            "SELECT sql FROM sqlite_master WHERE name = 'history'").fetchone()[0]
        assert "AUTOINCREMENT" in table.upper()
        assert [e.new_memory for e in a.components.history_log.events("elsewhere", "m1")] == ["kept"]
        for t in ["old one", "old two", "old three"]:
            a.add(t, user_id="u", infer=False)
        assert b.count(user_id="u") == 3
        a.reset()
        new = ["new one", "new two", "new three", "new four", "new five"]
        for t in new:
            a.add(t, user_id="u", infer=False)
        assert sorted(r["memory"] for r in b.get_all(user_id="u")["results"]) == sorted(new)
        assert b.add("old one", user_id="u", infer=False)["results"][0]["event"] == "ADD"


WRITER = textwrap.dedent("""
    import sys
    from inferscale import Memory

    with Memory(data_dir=sys.argv[1], dtype="float32", context_window=0, precompute_kv=False,
                database_url=sys.argv[2], chroma_url=sys.argv[3]) as m:
        for i in range(20):
            m.add(f"Shared fact number {i}.", user_id="alice", infer=False)
""")


def test_two_processes_adding_the_same_facts_store_each_once(postgres_url, chroma, tmp_path):
    """Two workers adding the same texts to one scope at once: the duplicate check and the
    write hold the scope lock (a PostgreSQL advisory lock) together, so each text is stored once."""
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / f"w{i}"), postgres_url, chroma["url"]])
             for i in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0
    with Memory(data_dir=tmp_path / "reader", dtype="float32", precompute_kv=False, database_url=postgres_url,
                chroma_url=chroma["url"]) as m:
        texts = [r["memory"] for r in m.get_all(user_id="alice")["results"]]
    assert sorted(texts) == sorted(f"Shared fact number {i}." for i in range(20))


def test_a_fact_a_dead_process_wrote_but_did_not_record_is_not_stored_twice(postgres_url, chroma, tmp_path):
    """A worker killed between its Chroma write and its history record leaves a fact no other
    worker's index holds; the client's retry of that add finds it, records it and returns it."""
    import numpy as np

    from inferscale.facts.writes import text_hash
    from inferscale.store.records import FactRecord

    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres_url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "w1", **settings) as w1, Memory(data_dir=tmp_path / "w2", **settings) as w2:
        w1.add("I live in Lisbon.", user_id="bob")
        assert w2.count(user_id="bob") == 1  # w2 has the scope loaded
        text = "My cat is called Tom."
        orphan = FactRecord("orphan0001", text, text_hash(text), Scope("bob"), (), {}, "2026-12-02T00:00:00",
                            "2026-12-02T00:00:00")
        w1.components.store.add([orphan], w1.components.embedder.encode([text]).numpy().astype(np.float32))  # then the process died
        w2.config.precompute_kv = w2.components.facts.precompute_kv = True
        w2.components.kv.background.pause()  # so the queued job stays to be seen
        retried = w2.add(text, user_id="bob")["results"][0]
        assert (retried["id"], retried["event"]) == ("orphan0001", "NOOP")
        assert w2.components.kv.pending(["orphan0001"]) == 1  # its KV is queued like a new fact's
        assert sorted(r["memory"] for r in w1.get_all(user_id="bob")["results"]) == ["I live in Lisbon.", text]
        assert [e["event"] for e in w1.history("orphan0001", user_id="bob")] == ["ADD"]
        assert w1.search("pets", user_id="bob", limit=1)["results"][0]["id"] == "orphan0001"
