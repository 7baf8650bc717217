"""The durable queue of KV-encoding jobs: which facts still need their KV at which context window.

A job is ``(fact id, scope key, w)``, one row of ``<data_dir>/kv_jobs.sqlite`` (WAL), written
in the same call that acknowledges the fact's write, so a crash before the encoder ran
leaves the job for the next start. Enqueuing a fact that is already queued at that w
replaces its row with a new ``job_id``: an encoder that took the old row and finishes
later removes only the row it took, so a job for newer text is never lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from inferscale.sqlite import ThreadConnections

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
        self._db.get().executescript(_SCHEMA)

    def add(self, jobs: Iterable[tuple[str, str, int]]) -> None:
        """Enqueue ``(fact_id, scope_key, w)`` triples (durable when this returns)."""
        now = time.time()
        rows = [(f, s, int(w), now) for f, s, w in jobs]
        if rows:
            with self._db.transaction() as conn:
                conn.executemany("INSERT INTO kv_jobs (fact_id, scope, w, enqueued_at) VALUES (?, ?, ?, ?)", rows)

    def take(self, limit: int) -> list[KVJob]:
        """The oldest ``limit`` jobs (they stay queued until :meth:`done`)."""
        rows = self._db.get().execute(
            "SELECT job_id, fact_id, scope, w, enqueued_at FROM kv_jobs ORDER BY job_id LIMIT ?", (limit,)
        ).fetchall()
        return [KVJob(*r) for r in rows]

    def done(self, jobs: Sequence[KVJob]) -> None:
        """Remove exactly these rows (a fact enqueued again meanwhile has a new row and stays)."""
        with self._db.transaction() as conn:
            conn.executemany("DELETE FROM kv_jobs WHERE job_id = ?", [(j.job_id,) for j in jobs])

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
