"""Per-memory event history (Mem0's ``history``): ADD, UPDATE, DELETE, in order (SQLite)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from inferscale.sqlite import ThreadConnections


@dataclass(frozen=True)
class HistoryEvent:
    """One change to a memory.

    Attributes:
        memory_id: the memory changed.
        event: ``"ADD"``, ``"UPDATE"`` or ``"DELETE"``.
        old_memory: text before (``None`` for ADD).
        new_memory: text after (``None`` for DELETE).
        created_at: ISO 8601 UTC time of the event.
    """

    memory_id: str
    event: str
    old_memory: str | None
    new_memory: str | None
    created_at: str

    def to_dict(self) -> dict:
        return {
            "memory_id": self.memory_id,
            "event": self.event,
            "old_memory": self.old_memory,
            "new_memory": self.new_memory,
            "created_at": self.created_at,
        }


class HistoryLog:
    """Append-only event log in ``<data_dir>/history.sqlite``; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = ThreadConnections(path)
        self._conn().execute(
            "CREATE TABLE IF NOT EXISTS history (seq INTEGER PRIMARY KEY AUTOINCREMENT, scope TEXT NOT NULL,"
            " memory_id TEXT NOT NULL, event TEXT NOT NULL, old_memory TEXT, new_memory TEXT, created_at TEXT NOT NULL)"
        )
        self._conn().execute("CREATE INDEX IF NOT EXISTS history_memory ON history (scope, memory_id)")

    def _conn(self) -> sqlite3.Connection:
        return self._db.get()

    def record(self, scope: str, events: list[tuple[str, str, str | None, str | None]]) -> None:
        """Append ``(memory_id, event, old_memory, new_memory)`` tuples atomically."""
        if not events:
            return
        now = datetime.now(timezone.utc).isoformat()
        with self._db.transaction() as con:
            con.executemany(
                "INSERT INTO history (scope, memory_id, event, old_memory, new_memory, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                [(scope, m, e, o, n, now) for m, e, o, n in events],
            )

    def events(self, scope: str, memory_id: str) -> list[HistoryEvent]:
        """The events of ``memory_id`` in ``scope``, oldest first."""
        rows = self._conn().execute(
            "SELECT memory_id, event, old_memory, new_memory, created_at FROM history"
            " WHERE scope = ? AND memory_id = ? ORDER BY seq",
            (scope, memory_id),
        ).fetchall()
        return [HistoryEvent(*r) for r in rows]

    def clear(self) -> None:
        """Delete every event."""
        self._conn().execute("DELETE FROM history")
