"""What each chat used: a bounded log of chat reports per scope (SQL, in the history's database).

The front writes one report per chat it served with memory (:mod:`inferscale.server.openai_routes`):
the question, the memories retrieved with where each came from (KV and its tier, or text and
why), tokens planned as KV, injected and prefilled, and the time to the first token. The page at
``/ui`` reads them back (:mod:`inferscale.server.ui`). Every process over the data dir (the
front's workers) shares the log. Each scope keeps its newest :data:`KEEP_PER_SCOPE` reports;
deleting a scope's memories or resetting the store drops its reports too (they quote memory text).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from sqlalchemy import Column, Index, Integer, MetaData, String, Table, Text, delete, select

from inferscale.store.sql import Database

#: reports kept per scope (the oldest are dropped as new ones come)
KEEP_PER_SCOPE = 200
_META = MetaData()
CHATS = Table(
    "chat_reports", _META,
    Column("seq", Integer, primary_key=True, autoincrement=True), Column("scope", String, nullable=False),
    Column("created_at", String, nullable=False), Column("report", Text, nullable=False),
    Index("chat_reports_scope_seq", "scope", "seq"),
    sqlite_autoincrement=True,
)


class ChatLog:
    """Chat reports per scope, newest kept; shared by every process over one database; thread-safe.

    Args:
        db: the database (the history's: :class:`inferscale.store.sql.Database`); its
            ``chat_reports`` table is created when missing.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        db.create(_META, *CHATS.indexes)

    def record(self, scope: str, report: dict) -> int:
        """Append ``report`` (a JSON-serializable dict) to ``scope``'s log, dropping reports past
        the newest :data:`KEEP_PER_SCOPE`.

        Returns:
            The report's id (increasing across the database).

        Raises:
            TypeError: ``report`` is not JSON-serializable.
        """
        body = json.dumps(report)
        now = datetime.now(timezone.utc).isoformat()
        with self.db.write(lock_key=f"chats:{scope}") as con:
            seq = con.execute(CHATS.insert().values(scope=scope, created_at=now, report=body)).inserted_primary_key[0]
            floor = con.execute(select(CHATS.c.seq).where(CHATS.c.scope == scope).order_by(CHATS.c.seq.desc())
                                .offset(KEEP_PER_SCOPE).limit(1)).scalar_one_or_none()
            if floor is not None:
                con.execute(delete(CHATS).where(CHATS.c.scope == scope, CHATS.c.seq <= floor))
        return int(seq)

    def recent(self, scope: str, limit: int = 50) -> list[dict]:
        """``scope``'s newest reports, newest first: each report's fields plus ``id`` and
        ``created_at`` (ISO 8601 UTC)."""
        with self.db.read() as con:
            rows = con.execute(select(CHATS.c.seq, CHATS.c.created_at, CHATS.c.report).where(CHATS.c.scope == scope)
                               .order_by(CHATS.c.seq.desc()).limit(limit)).all()
        return [{**json.loads(r.report), "id": int(r.seq), "created_at": r.created_at} for r in rows]

    def delete_scope(self, scope: str) -> None:
        """Drop ``scope``'s reports."""
        with self.db.write(lock_key=f"chats:{scope}") as con:
            con.execute(delete(CHATS).where(CHATS.c.scope == scope))

    def clear(self) -> None:
        """Drop every report."""
        with self.db.write() as con:
            con.execute(delete(CHATS))
