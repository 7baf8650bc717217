"""Device-resident exact cosine top-k index, partitioned by scope, loaded per scope.

Each scope owns a partition: a ``[capacity, dim]`` float32 tensor of L2-normalised
embeddings on the best device (CUDA when present, else CPU), grown by doubling, beside
the scope's records and their filter fields. A query is one matrix-vector product over
its scope's rows only, so one scope can never see another scope's facts; a metadata
filter is a mask over the partition's rows (:func:`inferscale.store.filters.compile_filter`),
never a listing of the store.

Partitions are loaded from Chroma, the system of record, on a scope's first use (the
``loader``), so opening a store costs the same at 30 or 300,000 facts and memory holds
only the scopes in use. A write to a scope loads its partition first and is applied
after, so a load racing a write can neither lose nor duplicate it (rows are keyed by id).

Processes sharing a store (API workers over a Chroma server) see each other's writes at
once: every read first compares its partition's version with the scope's (the newest
history event, :meth:`inferscale.store.history.HistoryLog.scope_version`). When it moved, the
partition catches up on the memories written since (``changes``: their ids from the
history; ``fetch``: those rows from Chroma), so a search after another worker's add costs
one more small query, not a reload of the whole scope; a reset, or more changes than half
the partition, reloads it instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from inferscale.store.filters import MISSING, Filter
from inferscale.store.keyword import (KeywordIndex, add_date_ranking, date_terms, fused_scores, top_rows,
                                      turn_neighbor_bonus)
from inferscale.store.records import EXPIRES_AT, FactRecord

Loader = Callable[[str], "tuple[list[FactRecord], object]"]
Changes = Callable[[str, int, int], "tuple[int, list[str]] | None"]
Fetcher = Callable[[str, "list[str]"], "tuple[list[FactRecord], object]"]

CATCH_UP_MIN = 256  # a partition catches up on at most max(this, half its rows) changed ids, else reloads


@dataclass
class _Partition:
    records: list[FactRecord] = field(default_factory=list)
    fields: list[dict] = field(default_factory=list)
    pos: dict[str, int] = field(default_factory=dict)  # id -> row
    #: text hash -> the ids holding it, oldest first (several when a text was added with dedupe=False)
    by_hash: dict[str, list[str]] = field(default_factory=dict)
    rows: torch.Tensor | None = None  # [capacity, dim]
    lock: threading.RLock = field(default_factory=threading.RLock)
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # field -> [n] object values, MISSING if absent
    keyword: KeywordIndex | None = None  # BM25 over the rows' texts: built on the first keyword search, then kept
    version: int | None = None  # the scope's version the rows are current for (VectorIndex.refresh)
    #: the text BM25 indexes for each record (its own text and its source turns'), default its text
    keyword_docs: Callable[[Sequence[FactRecord]], tuple[list[str], list[float]]] | None = None
    #: each row's turn position (NaN: none), kept with the keyword index
    positions: np.ndarray | None = None
    placed: np.ndarray | None = None  # the rows with a position, sorted by it: built on use
    dates: list[frozenset[str]] | None = None  # each row's own months and years, kept with the keyword index
    #: each row's expiry (epoch seconds, inf: none); ``False`` when no row has one; built on use
    expiry: np.ndarray | bool | None = None

    def changed(self) -> None:
        """Drop what is derived from the rows and rebuilt on use (the filter columns, the
        expiries); the keyword index is updated by the writes themselves."""
        self.columns.clear()
        self.expiry = None

    def live(self, at: float) -> np.ndarray | None:
        """``[n]`` bool: the rows not expired at ``at`` (epoch seconds): a row expires when its
        metadata's :data:`~inferscale.store.records.EXPIRES_AT` is a number ``<= at``.
        ``None`` when no row has an expiry (the common case costs nothing per search)."""
        if self.expiry is None:
            ex = np.fromiter((_expiry(v) for v in self.column(EXPIRES_AT)), dtype=np.float64, count=len(self.fields))
            self.expiry = ex if np.isfinite(ex).any() else False
        return None if self.expiry is False else self.expiry > at

    def keyword_index(self) -> KeywordIndex:
        if self.keyword is None:
            texts, positions = self.docs(self.records)
            self.keyword = KeywordIndex(texts)
            self.positions = np.asarray(positions, dtype=np.float64)
            self.placed = None
            self.dates = [date_terms(r.text) for r in self.records]
        return self.keyword

    def docs(self, records: Sequence[FactRecord]) -> tuple[list[str], list[float]]:
        """What BM25 indexes for ``records``, and their turn positions (NaN: none)."""
        if self.keyword_docs is not None:
            return self.keyword_docs(records)
        return [r.text for r in records], [float("nan")] * len(records)

    def placed_rows(self) -> np.ndarray:
        """The rows that have a turn position, sorted by it (after :meth:`keyword_index`)."""
        if self.placed is None:
            rows = np.flatnonzero(np.isfinite(self.positions))
            self.placed = rows[np.argsort(self.positions[rows], kind="stable")]
        return self.placed

    def rows_dated(self, terms: frozenset[str]) -> np.ndarray:
        """The rows whose own text mentions every one of ``terms`` (after :meth:`keyword_index`)."""
        return np.flatnonzero(np.fromiter((terms <= d for d in self.dates), dtype=bool, count=len(self.dates)))

    def column(self, key: str) -> np.ndarray:
        """The values of filter field ``key`` down the rows (built once per change)."""
        col = self.columns.get(key)
        if col is None:
            col = np.fromiter((f.get(key, MISSING) for f in self.fields), dtype=object, count=len(self.fields))
            self.columns[key] = col
        return col


def _unhold(by_hash: dict[str, list[str]], h: str, memory_id: str) -> None:
    """Drop ``memory_id`` from the holders of hash ``h`` (the hash goes with its last holder)."""
    ids = by_hash.get(h)
    if ids and memory_id in ids:
        ids.remove(memory_id)
        if not ids:
            del by_hash[h]


def _holders(records: Sequence[FactRecord]) -> dict[str, list[str]]:
    """text hash -> the ids of ``records`` holding it, in row order."""
    out: dict[str, list[str]] = {}
    for r in records:
        out.setdefault(r.hash, []).append(r.id)
    return out


class VectorIndex:
    """Exact top-k by cosine similarity within a scope, with in-partition filters.

    Args:
        device: where the embeddings live.
        loader: ``loader(scope_key) -> (records, embeddings [n, dim])``, the scope's stored
            facts (:meth:`inferscale.store.chroma.FactStore.load_scope`); ``None``: scopes start empty.
        versioner: ``versioner(scope_key) -> version`` of the scope's memories in the
            store shared with other processes; ``None``: only this process writes.
        changes: ``changes(scope_key, version, limit) -> (version now, ids written since)``
            or ``None`` to reload (:meth:`inferscale.store.history.HistoryLog.changes_since`).
        fetch: ``fetch(scope_key, ids) -> (records, embeddings [n, dim])`` of those ids
            still in the scope (:meth:`inferscale.store.chroma.FactStore.fetch`). Without
            ``changes`` and ``fetch`` a moved version reloads the partition.
        keyword_docs: ``keyword_docs(scope_key, records) -> (texts, positions)``: what BM25
            indexes for each record (document expansion: a fact's text with its source turns'
            words) and its turn position for the turn-neighbour bonus
            (:meth:`inferscale.store.turns.TurnLog.keyword_docs`); ``None``: each record's
            text, no positions.

    Thread-safe: one lock per partition, so a slow first load of one scope does not
    stall searches of others. ``loads`` and ``catch_ups`` count partitions loaded in
    full and caught up on another process's writes.
    """

    def __init__(self, device: torch.device | str, loader: Loader | None = None,
                 versioner: Callable[[str], int] | None = None, changes: Changes | None = None,
                 fetch: Fetcher | None = None,
                 keyword_docs: Callable[[str, Sequence[FactRecord]], tuple[list[str], list[float]]] | None = None
                 ) -> None:
        self.device = torch.device(device)
        self._keyword_docs = keyword_docs
        self.dim: int | None = None
        self._loader = loader
        self._versioner = versioner
        self._changes = changes if fetch is not None else None
        self._fetch = fetch
        self.catch_up = True  # False: reload a partition after any other process's write (benchmarks compare)
        self.loads = 0
        self.catch_ups = 0
        self._parts: dict[str, _Partition] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._generation = 0  # bumped by clear(): a load begun before it is discarded

    # ------------------------------------------------------------------ partitions

    def _partition(self, scope: str) -> _Partition:
        while True:
            with self._lock:
                part = self._parts.get(scope)
                if part is not None:
                    return part
                gate = self._loading.setdefault(scope, threading.Lock())
            with gate:
                with self._lock:
                    part = self._parts.get(scope)
                    generation = self._generation
                if part is not None:
                    return part
                part = _Partition()
                if self._keyword_docs is not None:
                    part.keyword_docs = lambda records, scope=scope: self._keyword_docs(scope, records)
                # the version is read before the rows: a write that lands in between makes the
                # partition stale (reloaded on the next read), never silently missing
                part.version = self._versioner(scope) if self._versioner is not None else None
                if self._loader is not None:
                    self.loads += 1
                    records, embeddings = self._loader(scope)
                    if records:
                        self._put(part, records, torch.as_tensor(embeddings, dtype=torch.float32))
                with self._lock:
                    if self._loading.get(scope) is gate:
                        del self._loading[scope]
                    if generation == self._generation:  # no clear() while loading: publish
                        self._parts[scope] = part
                        return part
            # a clear() ran during the load, which may have read what it deleted: load again

    def refresh(self, scope: str) -> None:
        """Bring ``scope``'s partition up to date with other processes' writes: when the
        scope's version moved since it was loaded, catch up on the memories written since
        (their ids from ``changes``, their rows from ``fetch``: rows added, replaced or
        removed), or drop it to be reloaded on the next read when catching up is not possible
        (a reset) or not worth it (more changed ids than ``max(CATCH_UP_MIN, rows / 2)``).
        One indexed query when nothing changed; nothing without a versioner.

        A check that finds nothing new takes no partition lock (reads of one scope stay
        parallel); otherwise the check is repeated, and the fetch and the apply done, under the
        partition's lock, as this process's own writes to it are, so a row fetched before a
        newer write can never overwrite it.
        """
        if self._versioner is None:
            return
        with self._lock:
            part = self._parts.get(scope)
        if part is None:
            return
        catch_up = self.catch_up and self._changes is not None
        if catch_up and part.version:  # the hot path: nothing written since, no partition lock taken
            got = self._changes(scope, part.version, max(CATCH_UP_MIN, len(part.records) // 2))
            if got is not None and not got[1]:
                return
        with part.lock:  # asked again under the lock: another thread may have caught up meanwhile
            if catch_up and part.version:
                got = self._changes(scope, part.version, max(CATCH_UP_MIN, len(part.records) // 2))
                if got is not None:
                    version, ids = got
                    if ids:
                        records, embeddings = self._fetch(scope, ids)
                        present = {r.id for r in records}
                        self._remove_rows(part, {i for i in ids if i not in present})
                        if records:
                            self._put(part, records, torch.as_tensor(embeddings, dtype=torch.float32))
                        self.catch_ups += 1
                    part.version = max(part.version, version)
                    return
            if part.version != self._versioner(scope):
                self._drop(scope, part)

    def advance(self, scope: str, before: int, after: int) -> None:
        """Record this process's own write, which moved the scope's version from ``before`` to
        ``after``: the partition (which holds the write) is current if it was at ``before``.
        Otherwise another process wrote in between: with catch-up the version is left where it
        was (the next read catches up on both writes, its own fetched again), without it the
        partition is dropped (reloaded on the next read)."""
        with self._lock:
            part = self._parts.get(scope)
        if part is None:
            return
        with part.lock:
            if part.version == before:
                part.version = after
            elif not self.catch_up or self._changes is None:
                self._drop(scope, part)

    def _drop(self, scope: str, part: _Partition) -> None:
        with self._lock:
            if self._parts.get(scope) is part:
                del self._parts[scope]

    def loaded(self, scope: str) -> bool:
        """Whether ``scope``'s partition is in memory."""
        with self._lock:
            return scope in self._parts

    def _put(self, part: _Partition, records: list[FactRecord], embeddings: torch.Tensor) -> None:
        emb = torch.nn.functional.normalize(embeddings.to(self.device, torch.float32), dim=-1)
        with self._lock:
            if self.dim is None:
                self.dim = int(emb.shape[1])
            elif emb.shape[1] != self.dim:
                raise ValueError(f"embedding dimension {emb.shape[1]} does not match the index's {self.dim}")
        with part.lock:
            part.changed()
            fresh = [i for i, r in enumerate(records) if r.id not in part.pos]
            for i, r in enumerate(records):
                if r.id in part.pos:  # a load already brought it: replace in place
                    j = part.pos[r.id]
                    _unhold(part.by_hash, part.records[j].hash, r.id)
                    part.by_hash.setdefault(r.hash, []).append(r.id)
                    part.records[j], part.fields[j] = r, r.filter_fields()
                    part.rows[j] = emb[i]
                    if part.keyword is not None:
                        (text,), (position,) = part.docs([r])
                        part.keyword.replace(j, text)
                        part.positions[j], part.placed = position, None
                        part.dates[j] = date_terms(r.text)
            if not fresh:
                return
            n, need = len(part.records), len(part.records) + len(fresh)
            if part.rows is None or part.rows.shape[0] < need:
                cap = max(need, 2 * (part.rows.shape[0] if part.rows is not None else 16))
                # float32 explicitly: a model loading in another thread (the KV encoder, in bf16)
                # sets torch's process-wide default dtype for the length of its load
                rows = torch.zeros((cap, self.dim), device=self.device, dtype=torch.float32)
                if part.rows is not None:
                    rows[:n] = part.rows[:n]
                part.rows = rows
            part.rows[n:need] = emb[fresh]
            for j, i in enumerate(fresh):
                part.pos[records[i].id] = n + j
                part.by_hash.setdefault(records[i].hash, []).append(records[i].id)
                part.records.append(records[i])
                part.fields.append(records[i].filter_fields())
            if part.keyword is not None:
                texts, positions = part.docs([records[i] for i in fresh])
                part.keyword.append(texts)
                part.positions, part.placed = np.concatenate([part.positions, positions]), None
                part.dates += [date_terms(records[i].text) for i in fresh]

    # ------------------------------------------------------------------ writes

    def add(self, scope: str, records: list[FactRecord], embeddings: torch.Tensor) -> None:
        """Put ``records`` with their ``embeddings`` ``[n, dim]`` in ``scope`` (an id already
        there is replaced).

        Raises:
            ValueError: the dimension differs from the index's.
        """
        if records:
            self._put(self._partition(scope), records, embeddings)

    def replace_records(self, scope: str, records: list[FactRecord]) -> None:
        """Replace the rows of ``records`` in ``scope`` by these records, keeping each row's
        embedding and keyword text (a metadata-only change: the text must be the stored one).
        A record whose id the partition lacks is ignored (the partition is not loaded, or the
        id is gone: the next load reads the store)."""
        with self._lock:
            part = self._parts.get(scope)
        if part is None:
            return
        with part.lock:
            part.changed()
            for r in records:
                j = part.pos.get(r.id)
                if j is not None:
                    part.records[j], part.fields[j] = r, r.filter_fields()

    def remove(self, scope: str, ids: set[str]) -> None:
        """Drop ``ids`` from ``scope`` (unknown ids are ignored)."""
        self._remove_rows(self._partition(scope), ids)

    @staticmethod
    def _remove_rows(part: _Partition, ids: set[str]) -> None:
        if not ids:
            return
        with part.lock:
            keep = [i for i, r in enumerate(part.records) if r.id not in ids]
            if len(keep) == len(part.records):
                return
            part.changed()
            part.rows = part.rows[keep].clone() if keep else None
            part.records = [part.records[i] for i in keep]
            part.fields = [part.fields[i] for i in keep]
            part.pos = {r.id: j for j, r in enumerate(part.records)}
            part.by_hash = _holders(part.records)
            if part.keyword is not None:
                part.keyword.keep(keep)
                part.positions, part.placed = part.positions[keep], None
                part.dates = [part.dates[i] for i in keep]

    def clear(self) -> None:
        """Forget every partition (they reload from the loader on next use)."""
        with self._lock:
            self._parts.clear()
            self._generation += 1

    # ------------------------------------------------------------------ reads

    def search(
        self, scope: str, query: torch.Tensor, k: int, where: Filter | None = None, keyword_query: str | None = None,
        show_expired: bool = False,
    ) -> list[tuple[FactRecord, float]]:
        """Top ``k`` of ``scope`` for ``query`` ``[dim]``: ``(record, cosine)`` pairs, best first.

        Records whose metadata's ``expires_at`` (epoch seconds) has passed are not returned
        unless ``show_expired``.

        Args:
            where: when given, only records whose filter fields satisfy it can be returned;
                it is evaluated as a mask over the partition's columns.
            keyword_query: the query's text: rank by the fusion of cosine and BM25 over it
                (:func:`inferscale.store.keyword.fused_scores`; a query naming a month or year
                adds the ranking of the rows that name it too,
                :func:`inferscale.store.keyword.add_date_ranking`), plus each row's share of its
                turn neighbours' (:func:`inferscale.store.keyword.turn_neighbor_bonus`),
                instead of by cosine alone; the pairs
                still carry the cosine.
        """
        part = self._partition(scope)
        with part.lock:
            n = len(part.records)
            if n == 0 or k <= 0:
                return []
            q = torch.nn.functional.normalize(query.to(self.device, torch.float32), dim=-1)
            scores = part.rows[:n] @ q
            eligible = n
            keep = None if where is None else where.mask(part.column, n)
            live = None if show_expired else part.live(time.time())  # expired: not found, swept or not
            if live is not None:
                keep = live if keep is None else keep & live
            if keep is not None:
                mask = torch.from_numpy(keep).to(self.device)
                scores = scores.masked_fill(~mask, float("-inf"))
                eligible = int(mask.sum())
                if eligible == 0:
                    return []
            if keyword_query is not None:
                dense = scores.cpu().numpy()
                keyword = part.keyword_index()
                fused = fused_scores(dense, keyword.scores(keyword_query))
                asked = date_terms(keyword_query)
                if asked:
                    add_date_ranking(fused, dense, part.rows_dated(asked))
                fused += turn_neighbor_bonus(fused, part.positions, part.placed_rows())
                top = top_rows(fused, dense, k)
                return [(part.records[i], float(dense[i])) for i in top.tolist()]
            top = torch.topk(scores, min(k, eligible))
            return [(part.records[i], float(s)) for s, i in zip(top.values.tolist(), top.indices.tolist())]

    def find_hashes(self, scope: str, hashes) -> dict[str, str]:
        """Map each of ``hashes`` (sha256 of a fact text) held in ``scope`` to the id of a
        memory holding it (the first held, while any does: a text added more than once with
        ``dedupe=False`` keeps being found after one of its holders is replaced or deleted)."""
        part = self._partition(scope)
        with part.lock:
            return {h: part.by_hash[h][0] for h in hashes if part.by_hash.get(h)}

    def records(self, scope: str, where: Filter | None = None) -> list[FactRecord]:
        """The records of ``scope`` satisfying ``where`` (all when ``None``), oldest first."""
        part = self._partition(scope)
        with part.lock:
            if where is None:
                found = list(part.records)
            else:
                keep = where.mask(part.column, len(part.records))
                found = [r for r, ok in zip(part.records, keep) if ok]
        return sorted(found, key=lambda r: (r.created_at, r.id))

    def size(self, scope: str | None = None) -> int:
        """Rows in ``scope`` (loading it), or in all loaded scopes."""
        if scope is not None:
            return len(self._partition(scope).records)
        with self._lock:
            return sum(len(p.records) for p in self._parts.values())


def _expiry(value) -> float:
    """A row's expiry as a float (``inf``: none); a value no float holds (an int past its range,
    stored before :func:`inferscale.arguments.check_metadata` refused it) counts as far future."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return np.inf
    try:
        return float(value)
    except OverflowError:
        return np.inf if value > 0 else -np.inf
