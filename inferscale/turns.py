"""The conversation log: every raw turn of every scope, in order (SQLite, WAL mode).

Context-Window Encoding reads it: a fact's context is the w turns that precede its
source turn in its scope. Turn ids are unique within a scope; given ones (LoCoMo's
``dia_id`` such as ``"D1:3"``) are kept, missing ones become ``"t<seq>"``.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from inferscale.sqlite import ThreadConnections


@dataclass(frozen=True)
class Turn:
    """One conversation turn.

    Attributes:
        turn_id: id unique within the scope.
        role: ``"user"``, ``"assistant"``, ``"system"`` or a speaker's role.
        content: the text.
        name: speaker name, if any.
        seq: position in the scope's log (0-based).
        metadata: extra fields (e.g. LoCoMo's session date).
    """

    turn_id: str
    role: str
    content: str
    name: str | None = None
    seq: int = -1
    metadata: dict = field(default_factory=dict)

    def render(self) -> str:
        """The turn as one context line: ``"<name or role>: <content>"``."""
        return f"{self.name or self.role}: {self.content}"


class TurnLog:
    """Append-only per-scope turn log in ``<data_dir>/turns.sqlite``.

    Thread-safe; one connection per thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = ThreadConnections(path)
        self._write_lock = threading.Lock()
        with self._conn() as con:
            con.execute(
                "CREATE TABLE IF NOT EXISTS turns (scope TEXT NOT NULL, seq INTEGER NOT NULL, turn_id TEXT NOT NULL,"
                " role TEXT NOT NULL, name TEXT, content TEXT NOT NULL, metadata TEXT NOT NULL, created_at TEXT NOT NULL,"
                " PRIMARY KEY (scope, seq), UNIQUE (scope, turn_id))"
            )
            # bumped by every change that can alter an earlier turn's window (delete, clear);
            # appends only add turns after every existing one, so they change no fact's window
            con.execute("CREATE TABLE IF NOT EXISTS scope_versions (scope TEXT PRIMARY KEY, version INTEGER NOT NULL)")

    def _conn(self) -> sqlite3.Connection:
        return self._db.get()

    def append(self, scope: str, turns: list[Turn]) -> list[Turn]:
        """Append ``turns`` atomically; returns them with ``seq`` and ``turn_id`` filled.

        Raises:
            ValueError: a given turn id already exists in the scope (nothing is written).
        """
        now = datetime.now(timezone.utc).isoformat()
        with self._write_lock:
            con = self._conn()
            con.execute("BEGIN IMMEDIATE")
            try:
                (seq,) = con.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM turns WHERE scope = ?", (scope,)).fetchone()
                out = []
                for t in turns:
                    turn = Turn(t.turn_id or f"t{seq}", t.role, t.content, t.name, seq, t.metadata)
                    try:
                        con.execute(
                            "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (scope, seq, turn.turn_id, turn.role, turn.name, turn.content, json.dumps(turn.metadata), now),
                        )
                    except sqlite3.IntegrityError:
                        raise ValueError(f"turn id {turn.turn_id!r} already exists in this scope: give unique turn ids") from None
                    out.append(turn)
                    seq += 1
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return out

    def _rows(self, sql: str, args: tuple) -> list[Turn]:
        return [
            Turn(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]))
            for r in self._conn().execute(sql, args).fetchall()
        ]

    def get(self, scope: str, turn_ids: list[str]) -> dict[str, Turn]:
        """The turns of ``turn_ids`` that exist in ``scope``, by id."""
        if not turn_ids:
            return {}
        marks = ",".join("?" * len(turn_ids))
        rows = self._rows(
            f"SELECT turn_id, role, content, name, seq, metadata FROM turns WHERE scope = ? AND turn_id IN ({marks})",
            (scope, *turn_ids),
        )
        return {t.turn_id: t for t in rows}

    def window(self, scope: str, before_seq: int, w: int) -> list[Turn]:
        """The ``w`` turns of ``scope`` just before position ``before_seq``, oldest first."""
        if w <= 0:
            return []
        rows = self._rows(
            "SELECT turn_id, role, content, name, seq, metadata FROM turns WHERE scope = ? AND seq < ?"
            " ORDER BY seq DESC LIMIT ?",
            (scope, before_seq, w),
        )
        return rows[::-1]

    def clear(self) -> None:
        """Delete every turn of every scope."""
        with self._write_lock:
            con = self._conn()
            con.execute("BEGIN IMMEDIATE")
            con.execute("DELETE FROM turns")
            self._bump(con, "*")
            con.execute("COMMIT")

    @staticmethod
    def _bump(con: sqlite3.Connection, scope: str) -> None:
        con.execute("INSERT INTO scope_versions VALUES (?, 1) ON CONFLICT(scope) DO UPDATE SET version = version + 1",
                    (scope,))

    def version(self, scope: str) -> int:
        """A number that changes whenever a turn of ``scope`` that may precede a fact's source
        turn is deleted (in any process sharing the file); appends leave it as it is."""
        (v,) = self._conn().execute(
            "SELECT COALESCE(SUM(version), 0) FROM scope_versions WHERE scope IN (?, '*')", (scope,)
        ).fetchone()
        return int(v)

    def count(self, scope: str) -> int:
        (n,) = self._conn().execute("SELECT COUNT(*) FROM turns WHERE scope = ?", (scope,)).fetchone()
        return int(n)

    def scope_turns(self, scope: str) -> list[Turn]:
        """Every turn of ``scope``, oldest first."""
        return self._rows(
            "SELECT turn_id, role, content, name, seq, metadata FROM turns WHERE scope = ? ORDER BY seq", (scope,)
        )

    def delete(self, scope: str, turn_ids: list[str]) -> int:
        """Delete the turns of ``turn_ids`` from ``scope``; returns how many existed.

        Facts derived from a deleted turn keep their text; their KV is re-encoded without
        that turn's context window the next time they are served (KV keys hash the context).
        Automatic ids (``t<seq>``) can be reused once the newest turns are deleted: give
        your own unique ids to turns you may delete.
        """
        if not turn_ids:
            return 0
        marks = ",".join("?" * len(turn_ids))
        with self._write_lock:
            con = self._conn()
            con.execute("BEGIN IMMEDIATE")
            try:
                cur = con.execute(f"DELETE FROM turns WHERE scope = ? AND turn_id IN ({marks})", (scope, *turn_ids))
                if cur.rowcount:
                    self._bump(con, scope)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return int(cur.rowcount)
