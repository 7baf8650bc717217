"""The fact lifecycle: add, update, delete, keeping Chroma, the index, the KV pool and
the history consistent.

Order of every write: Chroma (the system of record) first, then the device index, then
the KV invalidation, then the history; the write is acknowledged there. The fact's KV is
then queued (durably) for the background encoder (:meth:`KVManager.schedule`). KV keys
hash the fact's tokens, so a fact whose text changed can never be served its old KV even
if a crash skipped the invalidation. Writes are serialised by one lock per process;
reads run concurrently.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Iterator, Sequence

from inferscale.checks import check_bool, check_int, check_number
from inferscale.models.embedding import Embedder
from inferscale.store.filters import compile_filter
from inferscale.store.history import HistoryLog
from inferscale.store.index import VectorIndex
from inferscale.store.keyword import SEARCH_MODES
from inferscale.kv.manager import KVManager
from inferscale.store.chroma import FactStore
from inferscale.store.records import FactRecord, Scope
from inferscale.store.turns import TurnLog
from inferscale.types import FactInput, MemoryNotFoundError, WriteEvent, require_text


def stored_metadata(metadata: dict) -> dict:
    """``metadata`` as it is stored and read back (a JSON round trip: tuples become lists,
    keys strings), copied, so filters see the same values before and after a restart and
    the caller's objects are never shared with the index."""
    return json.loads(json.dumps(metadata))


def text_hash(text: str) -> str:
    """sha256 of the fact text (hex); the same text in one scope is stored once."""
    return hashlib.sha256(text.encode()).hexdigest()


_clock_lock = threading.Lock()
_last_stamp = datetime.min.replace(tzinfo=timezone.utc)


def _stamps(n: int) -> list[str]:
    """``n`` times from now a microsecond apart (UTC, ISO 8601), each later than any
    this process gave before, so the facts of one ``add`` sort in input order by
    ``created_at`` (``get_all``'s order) and after every earlier write's."""
    global _last_stamp
    with _clock_lock:
        start = max(datetime.now(timezone.utc), _last_stamp + timedelta(microseconds=1))
        stamps = [start + timedelta(microseconds=i) for i in range(max(n, 1))]
        _last_stamp = stamps[-1]
    return [t.isoformat() for t in stamps]


class FactService:
    """Owns every change to stored facts.

    Args:
        store, index, embedder, kv, history: the components kept consistent.
        default_w: context window (turns) KV is encoded at on write.
        precompute_kv: queue KV encoding on write (else on first injection).
        max_fact_tokens: longest fact accepted (tokens of its memory line).
        search_mode: default ranking, ``"hybrid"`` or ``"dense"`` (:meth:`search`).
        max_query_chars: longest query accepted (characters).
    """

    def __init__(
        self, store: FactStore, index: VectorIndex, embedder: Embedder, kv: KVManager, history: HistoryLog,
        default_w: int, precompute_kv: bool = True, max_fact_tokens: int = 512, search_mode: str = "hybrid",
        max_query_chars: int = 16_384,
    ) -> None:
        self.max_query_chars = max_query_chars
        self.search_mode = search_mode
        self.store, self.index, self.embedder, self.kv, self.history = store, index, embedder, kv, history
        self.default_w = default_w
        self.precompute_kv = precompute_kv
        self.max_fact_tokens = max_fact_tokens
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Hold the write lock: writes by other threads wait (re-entrant), reads go on."""
        with self._lock:
            yield

    # ------------------------------------------------------------------ writes

    def check_length(self, text: str, what: str = "fact") -> None:
        """Refuse a fact longer than ``max_fact_tokens``.

        Text with more characters than ``max_fact_tokens`` tokens can hold is refused before
        it is tokenized (a 15 MiB text costs milliseconds, not a worker's minute).

        Raises:
            ValueError: naming the length, the limit and the fix.
        """
        most = self.max_fact_tokens * self.kv.prompts.max_token_chars
        if len(text) > most:
            raise ValueError(f"{what} is {len(text)} characters, more than max_fact_tokens={self.max_fact_tokens} "
                             f"tokens can hold (at most {most}): split it into shorter facts (or raise max_fact_tokens)")
        n = self.kv.fact_tokens(text)
        if n > self.max_fact_tokens:
            raise ValueError(f"{what} is {n} tokens, over max_fact_tokens={self.max_fact_tokens}: split it into "
                             "shorter facts (or raise max_fact_tokens)")

    def add(self, scope: Scope, inputs: Sequence[FactInput], *, encode_kv: bool = True,
            context_window: int | None = None, dedupe: bool = True) -> list[WriteEvent]:
        """Store new facts; duplicates of stored or earlier texts are ``NOOP`` events
        (with ``dedupe=False``, each input is a new memory whatever the scope holds).

        Args:
            encode_kv: queue the new facts' KV for the background encoder (when ``precompute_kv``).
            context_window: w to encode at (default ``default_w``).
            dedupe: ``True``: one memory per text and scope; ``False``: store every input
                (a key-value store keeping one value under several keys).

        Returns:
            One :class:`WriteEvent` per input, in input order.
        """
        for i, f in enumerate(inputs):
            self.check_length(f.text, f"fact {i}")
            scope.check_metadata(f.metadata, "metadata" if len(inputs) == 1 else f"fact {i}'s metadata")
        with self._lock, self.history.scope_lock(scope.key):
            self.index.refresh(scope.key)  # another process's writes count for duplicates too
            hashes = [text_hash(f.text) for f in inputs]
            existing = self.index.find_hashes(scope.key, hashes)
            recovered = self._recover_unrecorded(scope, [h for h in hashes if h not in existing]) \
                if self.store.shared else []
            if recovered:
                existing = self.index.find_hashes(scope.key, hashes)
            results, records, seen = [], [], dict(existing) if dedupe else {}
            stamps = iter(_stamps(len(inputs)))
            for f in inputs:
                now = next(stamps)
                h = text_hash(f.text)
                if dedupe and h in seen:
                    results.append(WriteEvent(seen[h], f.text, "NOOP"))
                    continue
                rec = FactRecord(uuid.uuid4().hex, f.text, h, scope, tuple(f.source_turn_ids),
                                 stored_metadata(f.metadata), now, now)
                seen[h] = rec.id
                records.append(rec)
                results.append(WriteEvent(rec.id, f.text, "ADD"))
            if records:
                emb = self.embedder.encode([r.text for r in records])
                self.store.add(records, emb.numpy())
                self.index.add(scope.key, records, emb)
                self.index.advance(scope.key, *self.history.record(scope.key, [(r.id, "ADD", None, r.text)
                                                                               for r in records]))
        if (records or recovered) and encode_kv and self.precompute_kv:
            self.kv.schedule(scope.key, [*recovered, *records],
                             self.default_w if context_window is None else context_window)
        return results

    def _recover_unrecorded(self, scope: Scope, hashes: list[str]) -> list[FactRecord]:
        """Facts with these text hashes that are in the shared store but not in the scope's
        history: written to Chroma by a process that died before it recorded them (so no
        reader's partition reloads them, and a retried add would store the text twice).
        They are recorded now and the partition reloaded; returns them (their KV is then
        queued like a new fact's). Called under the scope lock, so no live writer is between
        its two steps."""
        found = self.store.find_hashes(scope, hashes)
        unrecorded = [r for r in found if not self.history.events(scope.key, r.id)]
        if unrecorded:
            self.history.record(scope.key, [(r.id, "ADD", None, r.text) for r in unrecorded])
            self.index.refresh(scope.key)  # the version moved past this partition's: it reloads
        return unrecorded

    def update(self, scope: Scope, memory_id: str, text: str, metadata: dict | None = None,
               dedupe: bool = True) -> FactRecord:
        """Replace a memory's text (and metadata when given); invalidates its KV everywhere.
        :meth:`update_many` with one change.

        Raises:
            MemoryNotFoundError: no such memory in ``scope``.
            ValueError: empty text, or (``dedupe``) another memory of the scope already holds
                the new text.
        """
        return self.update_many(scope, [(memory_id, text, metadata)], dedupe=dedupe, what="data")[0]

    def update_many(self, scope: Scope, changes: Sequence[tuple[str, str, dict | None]] = (),
                    patches: Sequence[tuple[str, dict]] = (), dedupe: bool = True,
                    what: str = "memory") -> list[FactRecord]:
        """Replace memories' texts (and metadata, where given), and patch other memories'
        metadata, in one write: ``changes`` are ``(memory_id, text, metadata or None)``;
        ``patches`` are ``(memory_id, fields)``, already checked
        (:func:`inferscale.arguments.check_metadata_patch`): each field set, or removed when
        ``None``, keeping the memory's other fields, text, embedding, KV and ``updated_at``.
        Everything is checked and every memory looked up before anything is written, all under
        the scope's lock (shared by every process over the database, so two patches of one
        memory never lose each other's fields); then the new texts are embedded in one call and
        written to Chroma in one update, the patches in one metadata update, every event
        recorded in the history in one transaction (a patch is an ``UPDATE`` whose text is
        unchanged), and the changed texts' KV invalidated and queued at once.

        Args:
            dedupe: ``True``: refuse a new text another memory of the scope holds (or that
                two changes give); ``False``: take it.
            what: how an error names a change (``"memory"``: ``"memory 3's text"``).

        Returns:
            The memories as now stored: the ``changes``' in their order, then the ``patches``'.

        Raises:
            MemoryNotFoundError: an id is not a memory of ``scope`` (nothing is written).
            ValueError: an empty or too long text, metadata naming another scope, a memory
                given twice, or (``dedupe``) a text another memory holds (nothing is written).
        """
        for i, (memory_id, text, metadata) in enumerate(changes):
            name = what if len(changes) == 1 else f"{what} {i}'s text"
            require_text(text, name)
            self.check_length(text, name)
            scope.check_metadata(metadata)
        for _, fields in patches:
            scope.check_metadata(fields)
        ids = [c[0] for c in changes] + [p[0] for p in patches]
        if len(set(ids)) != len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"memory {twice!r} is changed twice in one batch: give each memory once")
        with self._lock, self.history.scope_lock(scope.key):
            self.index.refresh(scope.key)
            olds = self.get_many(scope, ids)
            changed, patched = olds[:len(changes)], olds[len(changes):]
            hashes = [text_hash(text) for _, text, _ in changes]
            if dedupe:
                holders = self.index.find_hashes(scope.key, hashes)
                claimed: dict[str, str] = {}
                for old, (memory_id, _, _), h in zip(changed, changes, hashes):
                    other = holders.get(h) if h != old.hash else None
                    if other is not None and other != memory_id and other not in ids:
                        raise ValueError(f"memory {other} of this scope already holds this text (given to "
                                         f"{memory_id}): update or delete that one")
                    if claimed.setdefault(h, memory_id) != memory_id:
                        raise ValueError(f"memories {claimed[h]} and {memory_id} are given the same text: give each "
                                         "its own (or pass dedupe=False)")
            stamps = _stamps(len(changes))
            news = [replace(old, text=text, hash=h, updated_at=stamp,
                            metadata=old.metadata if metadata is None else stored_metadata(metadata))
                    for old, (_, text, metadata), h, stamp in zip(changed, changes, hashes, stamps)]
            merged = []
            for old, (_, fields) in zip(patched, patches):
                kept = {k: v for k, v in old.metadata.items() if k not in fields}
                kept.update({k: v for k, v in fields.items() if v is not None})
                merged.append(replace(old, metadata=stored_metadata(kept)))  # as deep as the stored or given
            if news:
                emb = self.embedder.encode([r.text for r in news])
                self.store.update(news, emb.numpy())
                self.index.add(scope.key, news, emb)  # replaces the rows of these ids
                for r in news:
                    self.kv.invalidate(r.id)
            if merged:
                self.store.update_metadata(merged)
                self.index.replace_records(scope.key, merged)
            events = [(r.id, "UPDATE", old.text, r.text) for old, r in zip(changed, news)] + \
                     [(r.id, "UPDATE", r.text, r.text) for r in merged]
            if events:
                self.index.advance(scope.key, *self.history.record(scope.key, events))
        if news and self.precompute_kv:
            self.kv.schedule(scope.key, news, self.default_w)
        return news + merged

    def update_metadata(self, scope: Scope, memory_id: str, fields: dict) -> FactRecord:
        """Set (or, given as ``None``, remove) top-level metadata ``fields`` of a memory:
        :meth:`update_many` with one patch.

        Raises:
            MemoryNotFoundError: no such memory in ``scope``.
        """
        return self.update_many(scope, patches=[(memory_id, fields)])[0]

    def delete(self, scope: Scope, memory_ids: Sequence[str]) -> list[FactRecord]:
        """Delete memories of ``scope`` (one Chroma delete, one history transaction); returns
        the deleted records.

        Raises:
            MemoryNotFoundError: one of the ids is not a memory of ``scope`` (nothing is deleted).
        """
        with self._lock, self.history.scope_lock(scope.key):
            return self._delete(scope, self.get_many(scope, list(dict.fromkeys(memory_ids))))

    def _delete(self, scope: Scope, records: list[FactRecord]) -> list[FactRecord]:
        """Delete ``records`` (under both locks)."""
        if records:
            self.store.delete([r.id for r in records])
            self.index.remove(scope.key, {r.id for r in records})
            self.kv.unschedule([r.id for r in records])
            for r in records:
                self.kv.invalidate(r.id)
            self.index.advance(scope.key, *self.history.record(scope.key, [(r.id, "DELETE", r.text, None)
                                                                           for r in records]))
        return records

    def delete_all(self, scope: Scope) -> list[FactRecord]:
        """Delete every memory of ``scope``; returns the deleted records."""
        with self._lock, self.history.scope_lock(scope.key):
            self.index.refresh(scope.key)
            return self._delete(scope, self.index.records(scope.key))

    def delete_turns(self, scope: Scope, turns: TurnLog, turn_ids: Sequence[str]) -> int:
        """Delete turns of the scope's log (ordered with fact writes); returns how many existed."""
        with self._lock:
            return turns.delete(scope.key, list(turn_ids))

    def reset(self, turns: TurnLog) -> None:
        """Delete everything: every scope's memories, their index and KV, the history, and ``turns``."""
        with self._lock:
            self.store.delete_everything()
            self.index.clear()
            turns.clear()
            self.history.clear()
            self.kv.clear()

    # ------------------------------------------------------------------ reads

    def find_texts(self, scope: Scope, texts: Sequence[str]) -> dict[str, str]:
        """Map each of ``texts`` that ``scope`` already stores to its memory id."""
        self.index.refresh(scope.key)
        by_hash = self.index.find_hashes(scope.key, [text_hash(t) for t in texts])
        return {t: by_hash[text_hash(t)] for t in texts if text_hash(t) in by_hash}

    def has_facts(self, scope: Scope) -> bool:
        """Whether ``scope`` holds at least one memory."""
        self.index.refresh(scope.key)
        return self.index.size(scope.key) > 0

    def count(self, scope: Scope) -> int:
        """How many memories ``scope`` holds."""
        self.index.refresh(scope.key)
        return self.index.size(scope.key)

    def get(self, scope: Scope, memory_id: str) -> FactRecord:
        """The memory ``memory_id`` of ``scope``.

        Raises:
            MemoryNotFoundError: absent, or owned by another scope (the two are not told apart).
        """
        if not isinstance(memory_id, str) or not memory_id:
            raise MemoryNotFoundError(f"memory id must be a non-empty string, got {memory_id!r}")
        found = self.store.get(scope, [memory_id])
        if not found:
            raise MemoryNotFoundError(f"memory {memory_id!r} not found for {scope.as_dict()}")
        return found[0]

    def get_many(self, scope: Scope, memory_ids: Sequence[str]) -> list[FactRecord]:
        """The memories ``memory_ids`` of ``scope``, in that order: one lookup.

        Raises:
            MemoryNotFoundError: one is absent or owned by another scope (named; the two are
                not told apart).
        """
        for memory_id in memory_ids:
            if not isinstance(memory_id, str) or not memory_id:
                raise MemoryNotFoundError(f"memory id must be a non-empty string, got {memory_id!r}")
        found = {r.id: r for r in self.store.get(scope, list(memory_ids))} if memory_ids else {}
        missing = [i for i in memory_ids if i not in found]
        if missing:
            raise MemoryNotFoundError(f"memory {missing[0]!r} not found for {scope.as_dict()}"
                                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [found[i] for i in memory_ids]

    def list(self, scope: Scope, filters: dict | None = None) -> list[FactRecord]:
        """The scope's memories matching ``filters``, oldest first (from the scope's index
        partition; a filter on a field no memory has matches nothing).

        Raises:
            ValueError: malformed ``filters``.
        """
        where = None if filters is None else compile_filter(filters)
        self.index.refresh(scope.key)
        return self.index.records(scope.key, where)

    def search(
        self, scope: Scope, query: str, limit: int, threshold: float | None = None, filters: dict | None = None,
        mode: str | None = None, show_expired: bool = False,
    ) -> list[tuple[FactRecord, float]]:
        """Top-``limit`` of ``scope`` for ``query``, best first, each with its cosine similarity.

        Args:
            threshold: drop results whose cosine similarity is below it (-1..1), after ranking.
            filters: metadata filters (:mod:`inferscale.store.filters`), applied as a mask inside
                the scope's index partition: the search runs over the matching memories
                only, so ``limit`` results come back when that many match.
            mode: ``"hybrid"`` (cosine and BM25 ranks fused by reciprocal rank fusion,
                :mod:`inferscale.store.keyword`) or ``"dense"`` (cosine order); default
                ``search_mode``. Under fusion the order is the fused rank, so scores need
                not descend.
            show_expired: also rank memories whose ``expires_at`` has passed (skipped by default).

        Raises:
            ValueError: empty query, bad limit / threshold / mode, malformed filters.
        """
        require_text(query, "query")
        if len(query) > self.max_query_chars:
            raise ValueError(f"query is {len(query)} characters, over max_query_chars={self.max_query_chars}: search "
                             "with a shorter query (or raise max_query_chars)")
        check_int("limit", limit)
        check_number("threshold", threshold, -1.0, 1.0, optional=True)  # a cosine similarity
        check_bool("show_expired", show_expired)
        mode = self.search_mode if mode is None else mode
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a string, one of {SEARCH_MODES}, got {type(mode).__name__}")
        if mode not in SEARCH_MODES:
            raise ValueError(f"mode must be one of {SEARCH_MODES}, got {mode!r}")
        where = None if filters is None else compile_filter(filters)
        self.index.refresh(scope.key)  # writes of other processes sharing the store are seen at once
        if limit == 0 or self.index.size(scope.key) == 0:
            return []
        hits = self.index.search(scope.key, self.embedder.encode([query])[0], limit, where=where,
                                 keyword_query=query if mode == "hybrid" else None, show_expired=show_expired)
        if threshold is not None:
            hits = [(r, s) for r, s in hits if s >= threshold]
        return hits
