"""The conversation log: every raw turn of every scope, in order (SQL: a SQLite file in the
data dir by default, or the ``database_url`` database, :mod:`inferscale.store.sql`).

Context-Window Encoding reads it: a fact's context is the w turns that precede its
source turn in its scope; the keyword index reads a fact's own source turns
(:meth:`TurnLog.expanded_texts`). Turn ids are unique within a scope; given ones (LoCoMo's
``dia_id`` such as ``"D1:3"``) are kept, missing ones become ``"t<seq>"``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Sequence

from sqlalchemy import (Column, Integer, MetaData, PrimaryKeyConstraint, String, Table, Text, UniqueConstraint,
                        delete, func, select)
from sqlalchemy.exc import IntegrityError

from inferscale.store.sql import Database, upsert_increment

_META = MetaData()
#: turn ids per IN list (SQLite allows 32,766 bound parameters, older builds 999)
_IN_CHUNK = 500
TURNS = Table(
    "turns", _META,
    Column("scope", String, nullable=False), Column("seq", Integer, nullable=False),
    Column("turn_id", String, nullable=False), Column("role", String, nullable=False), Column("name", String),
    Column("content", Text, nullable=False), Column("metadata", Text, nullable=False),
    Column("created_at", String, nullable=False),
    PrimaryKeyConstraint("scope", "seq"), UniqueConstraint("scope", "turn_id"),
)
# bumped by every change that can alter an earlier turn's window (delete, clear); appends
# only add turns after every existing one, so they change no fact's window
SCOPE_VERSIONS = Table("scope_versions", _META, Column("scope", String, primary_key=True),
                       Column("version", Integer, nullable=False))
_COLUMNS = (TURNS.c.turn_id, TURNS.c.role, TURNS.c.content, TURNS.c.name, TURNS.c.seq, TURNS.c.metadata)


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
    """Append-only per-scope turn log, shared by every process using the same database.

    Args:
        db: the database (:class:`inferscale.store.sql.Database`); its ``turns`` and
            ``scope_versions`` tables are created when missing.

    Thread-safe.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._write_lock = threading.Lock()
        db.create(_META)

    def append(self, scope: str, turns: list[Turn]) -> list[Turn]:
        """Append ``turns`` atomically; returns them with ``seq`` and ``turn_id`` filled.

        Raises:
            ValueError: a given turn id already exists in the scope (nothing is written).
        """
        now = datetime.now(timezone.utc).isoformat()
        with self._write_lock:
            try:
                with self.db.write(lock_key=f"turns:{scope}") as con:
                    seq = con.execute(select(func.coalesce(func.max(TURNS.c.seq) + 1, 0))
                                      .where(TURNS.c.scope == scope)).scalar_one()
                    out = [Turn(t.turn_id or f"t{seq + i}", t.role, t.content, t.name, seq + i, t.metadata)
                           for i, t in enumerate(turns)]
                    ids = [t.turn_id for t in out]
                    if len(set(ids)) != len(ids):
                        dup = next(i for i in ids if ids.count(i) > 1)
                        raise ValueError(f"turn id {dup!r} is given twice: give unique turn ids")
                    if out:
                        con.execute(TURNS.insert(), [
                            {"scope": scope, "seq": t.seq, "turn_id": t.turn_id, "role": t.role, "name": t.name,
                             "content": t.content, "metadata": json.dumps(t.metadata), "created_at": now}
                            for t in out])
            except IntegrityError:
                taken = set(self.get(scope, [t.turn_id for t in turns if t.turn_id]))
                which = sorted(taken)[0] if taken else "?"
                raise ValueError(f"turn id {which!r} already exists in this scope: give unique turn ids") from None
        return out

    def _rows(self, query) -> list[Turn]:
        with self.db.read() as con:
            rows = con.execute(query).all()
        return [Turn(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    def get(self, scope: str, turn_ids: list[str]) -> dict[str, Turn]:
        """The turns of ``turn_ids`` that exist in ``scope``, by id."""
        if not turn_ids:
            return {}
        rows = self._rows(select(*_COLUMNS).where(TURNS.c.scope == scope, TURNS.c.turn_id.in_(list(turn_ids))))
        return {t.turn_id: t for t in rows}

    def expanded_texts(self, scope: str, records: Sequence) -> list[str]:
        """What the keyword index of a scope indexes for each record (:meth:`keyword_docs`'s texts)."""
        return self.keyword_docs(scope, records)[0]

    def keyword_docs(self, scope: str, records: Sequence) -> tuple[list[str], list[float]]:
        """Each record's keyword text and turn position, for hybrid search.

        The text is the record's own, then its source turns' contents, then the turn just
        before each source turn (document expansion; a turn no longer logged adds nothing).
        An observation is short, and the words a question repeats are often in the turn it
        was drawn from or in the turn that prompted it. On LoCoMo's held-out conversations
        the source turns took BM25-and-cosine hybrid evidence recall@10 from 0.632 to 0.677,
        and the turn before them to 0.688 (conversations 0-2, where it was chosen: 0.671 ->
        0.685; docs/results/retrieval).

        The position is the mean log position (``seq``) of the record's logged source turns,
        ``NaN`` when none is logged: :func:`inferscale.store.keyword.turn_neighbor_bonus`
        uses it.

        Args:
            records: :class:`~inferscale.store.records.FactRecord` s of ``scope``.

        Returns:
            ``(texts, positions)``, one of each per record.
        """
        ids = sorted({t for r in records for t in r.source_turn_ids})
        turns: dict[str, Turn] = {}
        for i in range(0, len(ids), _IN_CHUNK):  # bounded IN lists (SQLite caps bound parameters)
            turns.update(self.get(scope, ids[i:i + _IN_CHUNK]))
        before = self._at(scope, sorted({t.seq - 1 for t in turns.values() if t.seq > 0}))
        texts, positions = [], []
        for r in records:
            own = [turns[t] for t in r.source_turn_ids if t in turns]
            mine = {t.seq for t in own}
            prompts = [before[t.seq - 1].content for t in own if t.seq - 1 in before and t.seq - 1 not in mine]
            texts.append(" ".join([r.text, *(t.content for t in own), *prompts]))
            positions.append(sum(t.seq for t in own) / len(own) if own else float("nan"))
        return texts, positions

    def _at(self, scope: str, seqs: list[int]) -> dict[int, Turn]:
        """The turns of ``scope`` at these log positions, by position."""
        found: dict[int, Turn] = {}
        for i in range(0, len(seqs), _IN_CHUNK):
            rows = self._rows(select(*_COLUMNS).where(TURNS.c.scope == scope, TURNS.c.seq.in_(seqs[i:i + _IN_CHUNK])))
            found.update((t.seq, t) for t in rows)
        return found

    def window(self, scope: str, before_seq: int, w: int) -> list[Turn]:
        """The ``w`` turns of ``scope`` just before position ``before_seq``, oldest first."""
        if w <= 0:
            return []
        rows = self._rows(select(*_COLUMNS).where(TURNS.c.scope == scope, TURNS.c.seq < before_seq)
                          .order_by(TURNS.c.seq.desc()).limit(w))
        return rows[::-1]

    def clear(self) -> None:
        """Delete every turn of every scope."""
        with self._write_lock, self.db.write() as con:
            con.execute(delete(TURNS))
            upsert_increment(con, SCOPE_VERSIONS, "scope", "*", "version")

    def version(self, scope: str) -> int:
        """A number that changes whenever a turn of ``scope`` that may precede a fact's source
        turn is deleted (in any process sharing the database); appends leave it as it is."""
        with self.db.read() as con:
            v = con.execute(select(func.coalesce(func.sum(SCOPE_VERSIONS.c.version), 0))
                            .where(SCOPE_VERSIONS.c.scope.in_([scope, "*"]))).scalar_one()
        return int(v)

    def count(self, scope: str) -> int:
        with self.db.read() as con:
            return int(con.execute(select(func.count()).select_from(TURNS).where(TURNS.c.scope == scope)).scalar_one())

    def scope_turns(self, scope: str) -> list[Turn]:
        """Every turn of ``scope``, oldest first."""
        return self._rows(select(*_COLUMNS).where(TURNS.c.scope == scope).order_by(TURNS.c.seq))

    def delete(self, scope: str, turn_ids: list[str]) -> int:
        """Delete the turns of ``turn_ids`` from ``scope``; returns how many existed.

        Facts derived from a deleted turn keep their text; their KV is re-encoded without
        that turn's context window the next time they are served (KV keys hash the context).
        Automatic ids (``t<seq>``) can be reused once the newest turns are deleted: give
        your own unique ids to turns you may delete.
        """
        if not turn_ids:
            return 0
        with self._write_lock, self.db.write(lock_key=f"turns:{scope}") as con:
            n = con.execute(delete(TURNS).where(TURNS.c.scope == scope, TURNS.c.turn_id.in_(list(turn_ids)))).rowcount
            if n:
                upsert_increment(con, SCOPE_VERSIONS, "scope", scope, "version")
        return int(n)
