"""The turn log and the history in PostgreSQL (issue 14, second step): a real PostgreSQL
(Debian's package) on loopback, shared by two processes and two Memory objects."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from inferscale import FactInput, Memory
from inferscale.sql import Database
from inferscale.store import Scope, StoreError
from inferscale.turns import Turn, TurnLog


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    assert found[-1], f"{name} not found: scripts/install.sh installs Debian's postgresql"
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A fresh PostgreSQL cluster on 127.0.0.1 (trust auth), stopped and deleted afterwards."""
    root = Path(tempfile.mkdtemp(prefix="inferscale-pg-"))
    root.chmod(0o755)
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses root
    if as_user:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()
    subprocess.run([*as_user, _pg_bin("initdb"), "-D", str(data), "-U", "inferscale", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "120", "-o",
                    f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"],
                   check=True, capture_output=True, timeout=300)
    try:
        yield f"postgresql+psycopg://inferscale@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


APPENDER = textwrap.dedent("""
    import sys
    from inferscale.sql import Database
    from inferscale.turns import Turn, TurnLog

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
    assert not (tmp_path / "a" / "turns.sqlite").exists() and not (tmp_path / "a" / "history.sqlite").exists()


def test_a_database_that_does_not_answer_is_one_clear_error(tmp_path):
    url = f"postgresql+psycopg://inferscale@127.0.0.1:{_free_port()}/postgres"
    with pytest.raises(StoreError, match="cannot use the database at postgresql") as caught:
        Memory(data_dir=tmp_path / "m", dtype="float32", precompute_kv=False, database_url=url)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="database_url must be a PostgreSQL"):
        Memory(data_dir=tmp_path / "m", database_url="mysql://u@h/db")
