"""Per-memory event history (Mem0's ``history``): ADD, UPDATE, DELETE, in order (SQL: a
SQLite file in the data dir by default, or the ``database_url`` database)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Column, Index, Integer, MetaData, String, Table, Text, case, delete, func, select, text

from inferscale.store.sql import Database

_META = MetaData()
HISTORY = Table(
    "history", _META,
    Column("seq", Integer, primary_key=True, autoincrement=True), Column("scope", String, nullable=False),
    Column("memory_id", String, nullable=False), Column("event", String, nullable=False),
    Column("old_memory", Text), Column("new_memory", Text), Column("created_at", String, nullable=False),
    Index("history_memory", "scope", "memory_id"), Index("history_scope_seq", "scope", "seq"),
    Index("history_memory_id", "memory_id"),  # owner(): a memory addressed by its id alone
    sqlite_autoincrement=True,  # seq is never reused, even after clear(): it versions scopes
)


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
    """Append-only event log, shared by every process using the same database; thread-safe.

    Args:
        db: the database (:class:`inferscale.store.sql.Database`); its ``history`` table is
            created when missing.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        if db.dialect == "sqlite":
            _rebuild_without_reuse(db)
        db.create(_META, *HISTORY.indexes)  # indexes too: a history table of an older version lacks one

    def record(self, scope: str, events: list[tuple[str, str, str | None, str | None]]) -> tuple[int, int]:
        """Append ``(memory_id, event, old_memory, new_memory)`` tuples atomically.

        Returns:
            ``(before, after)``: :meth:`scope_version` just before and just after the write
            (writers of one scope are serialized, so ``before`` is what a reader that saw
            every earlier write of the scope holds).
        """
        if not events:
            v = self.scope_version(scope)
            return v, v
        now = datetime.now(timezone.utc).isoformat()
        with self.db.write(lock_key=f"history:{scope}") as con:
            before = con.execute(_version(scope)).scalar_one()
            con.execute(HISTORY.insert(), [
                {"scope": scope, "memory_id": m, "event": e, "old_memory": o, "new_memory": n, "created_at": now}
                for m, e, o, n in events])
            after = con.execute(_version(scope)).scalar_one()
        return int(before), int(after)

    def scope_lock(self, scope: str):
        """A lock on ``scope``'s memories shared by every process over this database
        (:meth:`inferscale.store.sql.Database.scope_lock`): a write that checks for duplicates and
        then writes Chroma, the index and the history holds it from check to history."""
        return self.db.scope_lock(f"facts:{scope}")

    def scope_version(self, scope: str) -> int:
        """A number that changes with every write to ``scope``'s memories by any process
        sharing the database (the newest event's ``seq``; 0 for none); one indexed query."""
        with self.db.read() as con:
            return int(con.execute(_version(scope)).scalar_one())

    def changes_since(self, scope: str, version: int, limit: int) -> tuple[int, list[str]] | None:
        """The memories of ``scope`` written since ``version`` (one of the scope's own versions,
        :meth:`scope_version`), for a reader to catch up on them alone; one indexed query.

        Args:
            version: the version the reader is current for (> 0).
            limit: the most events worth catching up on; more and ``None`` is returned.

        Returns:
            ``(current version, ids written after version, each once, oldest first)``, where
            ``current version == version`` and no ids means nothing changed; ``None`` when the
            reader must reload instead: ``version`` is 0, more than ``limit`` events, or the
            event at ``version`` is gone (:meth:`clear` ran: a reset deletes without events).
        """
        if version <= 0:
            return None
        with self.db.read() as con:
            rows = con.execute(
                select(HISTORY.c.seq, HISTORY.c.memory_id)
                .where(HISTORY.c.scope == scope, HISTORY.c.seq >= version)
                .order_by(HISTORY.c.seq).limit(limit + 2)).all()
        if not rows or rows[0].seq != version or len(rows) > limit + 1:
            return None
        return int(rows[-1].seq), list(dict.fromkeys(r.memory_id for r in rows[1:]))

    def events(self, scope: str, memory_id: str) -> list[HistoryEvent]:
        """The events of ``memory_id`` in ``scope``, oldest first."""
        with self.db.read() as con:
            rows = con.execute(
                select(HISTORY.c.memory_id, HISTORY.c.event, HISTORY.c.old_memory, HISTORY.c.new_memory,
                       HISTORY.c.created_at)
                .where(HISTORY.c.scope == scope, HISTORY.c.memory_id == memory_id).order_by(HISTORY.c.seq)).all()
        return [HistoryEvent(*r) for r in rows]

    def owner(self, memory_id: str) -> str | None:
        """The scope key whose events name ``memory_id`` (ids are uuid4s, unique across scopes),
        or ``None`` when no event does; one indexed query."""
        with self.db.read() as con:
            return con.execute(select(HISTORY.c.scope).where(HISTORY.c.memory_id == memory_id)
                               .order_by(HISTORY.c.seq.desc()).limit(1)).scalar_one_or_none()

    def scopes(self) -> list[tuple[str, int, str, str]]:
        """Every scope that holds memories now: ``(scope key, live memories, time of its first
        event, time of its last event)``, ISO 8601 UTC, in first-event order. A memory is live
        when its last event is not a DELETE. One query over the whole log (a window per memory)."""
        last = select(HISTORY.c.seq, HISTORY.c.scope, HISTORY.c.event, HISTORY.c.created_at,
                      func.row_number().over(partition_by=(HISTORY.c.scope, HISTORY.c.memory_id),
                                             order_by=HISTORY.c.seq.desc()).label("rn")).subquery()
        live = func.sum(case(((last.c.rn == 1) & (last.c.event != "DELETE"), 1), else_=0))
        query = (select(last.c.scope, live, func.min(last.c.created_at), func.max(last.c.created_at))
                 .group_by(last.c.scope).order_by(func.min(last.c.seq)))
        with self.db.read() as con:
            return [(s, int(n), first, latest) for s, n, first, latest in con.execute(query).all() if n]

    def clear(self) -> None:
        """Delete every event."""
        with self.db.write() as con:
            con.execute(delete(HISTORY))


def _rebuild_without_reuse(db: Database) -> None:
    """Give a SQLite ``history`` table made without ``AUTOINCREMENT`` (by the commits between
    66945c8 and b4275c2, which ``create_all`` never alters) the current schema, rows and
    ``seq`` values kept. Without it SQLite reuses the ``seq`` of deleted rows after a reset,
    so a scope's version could come back to a value a reader holds, and that reader would
    miss the reset (or catch up on part of what followed it). Once, in a write transaction;
    another process doing it at the same moment finds it done."""
    def table_sql(con) -> str | None:
        return con.execute(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'history'")).scalar()

    with db.read() as con:
        found = table_sql(con)
    if found is None or "AUTOINCREMENT" in found.upper():
        return
    with db.write() as con:
        found = table_sql(con)
        if found is None or "AUTOINCREMENT" in found.upper():
            return
        con.execute(text("ALTER TABLE history RENAME TO history_before_autoincrement"))
        for index in ("history_memory", "history_scope_seq"):  # their names move with the table
            con.execute(text(f"DROP INDEX IF EXISTS {index}"))
        _META.create_all(con)
        con.execute(text("INSERT INTO history (seq, scope, memory_id, event, old_memory, new_memory, created_at) "
                         "SELECT seq, scope, memory_id, event, old_memory, new_memory, created_at "
                         "FROM history_before_autoincrement ORDER BY seq"))
        con.execute(text("DROP TABLE history_before_autoincrement"))


def _version(scope: str):
    return select(func.coalesce(func.max(HISTORY.c.seq), 0)).where(HISTORY.c.scope == scope)
