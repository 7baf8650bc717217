"""The durable queue of KV-encoding jobs: which facts still need their KV at which context window.

A job is ``(fact id, scope key, w)``, one row of ``<data_dir>/kv_jobs.sqlite`` (WAL), written
in the same call that acknowledges the fact's write, so a crash before the encoder ran
leaves the job for the next start. Enqueuing a fact that is already queued at that w
replaces its row with a new ``job_id``: an encoder that took the old row and finishes
later removes only the row it took, so a job for newer text is never lost.

Several processes may drain one queue (``inferscale serve --workers N`` over one data dir):
:meth:`KVJobQueue.take` claims the rows it returns for its process, so no two processes
encode the same job; a claim whose process has exited (crash, SIGKILL) is released by the
next ``take`` of any process, so its jobs are finished by the others or by the next start.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from inferscale.runtime.processes import pid_alive, start_ticks
from inferscale.store.sqlite import ThreadConnections

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv_jobs (
    job_id INTEGER PRIMARY KEY AUTOINCREMENT,
    fact_id TEXT NOT NULL,
    scope TEXT NOT NULL,
    w INTEGER NOT NULL,
    enqueued_at REAL NOT NULL,
    UNIQUE (fact_id, w) ON CONFLICT REPLACE
);
"""
#: added in the multi-process version; a queue file written before it gains the column
_CLAIM_COLUMN = "claimed_by"


def process_owner(pid: int | None = None) -> str:
    """This process's name on a claim: ``host:pid:start`` (the start time tells a reused pid apart)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{start_ticks(pid) or '-'}"


def owner_alive(owner: str) -> bool:
    """Whether the process that wrote claim ``owner`` (:func:`process_owner`) still runs.

    A claim from another host is taken to be alive (the queue is a file of one machine's
    data dir, so that happens only when a data dir is copied between machines)."""
    try:
        host, pid_s, start = owner.rsplit(":", 2)
        pid = int(pid_s)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    if start != "-":
        return start_ticks(pid) == start and pid_alive(pid)
    return pid_alive(pid)


@dataclass(frozen=True)
class KVJob:
    """One fact to encode at one context window.

    Attributes:
        job_id: the row (changes when the fact is enqueued again).
        fact_id: the memory id. scope: its scope key. w: context window (turns).
        enqueued_at: ``time.time()`` of the enqueue (seconds).
    """

    job_id: int
    fact_id: str
    scope: str
    w: int
    enqueued_at: float


class KVJobQueue:
    """SQLite-backed queue of :class:`KVJob` s; thread-safe, one connection per thread.

    Args:
        path: the database file (created when missing).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = ThreadConnections(self.path, timeout=30)
        self.owner = process_owner()
        with self._db.transaction() as conn:
            conn.execute(_SCHEMA.strip().rstrip(";"))
            columns = {row[1] for row in conn.execute("PRAGMA table_info(kv_jobs)")}
            if _CLAIM_COLUMN not in columns:
                conn.execute(f"ALTER TABLE kv_jobs ADD COLUMN {_CLAIM_COLUMN} TEXT")

    def add(self, jobs: Iterable[tuple[str, str, int]]) -> None:
        """Enqueue ``(fact_id, scope_key, w)`` triples (durable when this returns)."""
        now = time.time()
        rows = [(f, s, int(w), now) for f, s, w in jobs]
        if rows:
            with self._db.transaction() as conn:
                conn.executemany("INSERT INTO kv_jobs (fact_id, scope, w, enqueued_at) VALUES (?, ?, ?, ?)", rows)

    def take(self, limit: int) -> list[KVJob]:
        """Claim and return the oldest ``limit`` jobs no other live process has claimed
        (this process's own unfinished claims included). They stay queued until :meth:`done`;
        claims of processes that have exited are released first."""
        with self._db.transaction() as conn:
            owners = [o for (o,) in conn.execute(
                "SELECT DISTINCT claimed_by FROM kv_jobs WHERE claimed_by IS NOT NULL AND claimed_by != ?",
                (self.owner,))]
            dead = [o for o in owners if not owner_alive(o)]
            if dead:
                conn.executemany("UPDATE kv_jobs SET claimed_by = NULL WHERE claimed_by = ?", [(o,) for o in dead])
            rows = conn.execute(
                "SELECT job_id, fact_id, scope, w, enqueued_at FROM kv_jobs WHERE claimed_by IS NULL "
                "OR claimed_by = ? ORDER BY job_id LIMIT ?", (self.owner, limit)).fetchall()
            conn.executemany("UPDATE kv_jobs SET claimed_by = ? WHERE job_id = ?",
                             [(self.owner, r[0]) for r in rows])
        return [KVJob(*r) for r in rows]

    def claimable(self) -> int:
        """How many queued jobs this process could take now (unclaimed, or its own)."""
        (n,) = self._db.get().execute(
            "SELECT COUNT(*) FROM kv_jobs WHERE claimed_by IS NULL OR claimed_by = ?", (self.owner,)).fetchone()
        return int(n)

    def done(self, jobs: Sequence[KVJob]) -> None:
        """Remove exactly these rows (a fact enqueued again meanwhile has a new row and stays)."""
        with self._db.transaction() as conn:
            conn.executemany("DELETE FROM kv_jobs WHERE job_id = ?", [(j.job_id,) for j in jobs])

    def release(self, jobs: Sequence[KVJob]) -> None:
        """Give back this process's claims on ``jobs`` (they stay queued, for any process to take)."""
        with self._db.transaction() as conn:
            conn.executemany("UPDATE kv_jobs SET claimed_by = NULL WHERE job_id = ? AND claimed_by = ?",
                             [(j.job_id, self.owner) for j in jobs])

    def drop_facts(self, fact_ids: Iterable[str]) -> None:
        """Remove every job of these facts (they were deleted)."""
        with self._db.transaction() as conn:
            conn.executemany("DELETE FROM kv_jobs WHERE fact_id = ?", [(f,) for f in fact_ids])

    def pending(self, fact_ids: Sequence[str] | None = None) -> int:
        """How many jobs are queued (of ``fact_ids`` only, when given)."""
        if fact_ids is None:
            (n,) = self._db.get().execute("SELECT COUNT(*) FROM kv_jobs").fetchone()
            return int(n)
        n = 0
        ids = list(fact_ids)
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            (c,) = self._db.get().execute(
                f"SELECT COUNT(*) FROM kv_jobs WHERE fact_id IN ({','.join('?' * len(chunk))})", chunk
            ).fetchone()
            n += int(c)
        return n

    def clear(self) -> None:
        """Remove every job."""
        with self._db.transaction() as conn:
            conn.execute("DELETE FROM kv_jobs")
