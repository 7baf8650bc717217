"""Device-resident exact cosine top-k index, partitioned by scope, loaded per scope.

Each scope owns a partition: a ``[capacity, dim]`` float32 tensor of L2-normalised
embeddings on the best device (CUDA when present, else CPU), grown by doubling, beside
the scope's records and their filter fields. A query is one matrix-vector product over
its scope's rows only, so one scope can never see another scope's facts; a metadata
filter is a mask over the partition's rows (:func:`inferscale.filters.compile_filter`),
never a listing of the store.

Partitions are loaded from Chroma, the system of record, on a scope's first use (the
``loader``), so opening a store costs the same at 30 or 300,000 facts and memory holds
only the scopes in use. A write to a scope loads its partition first and is applied
after, so a load racing a write can neither lose nor duplicate it (rows are keyed by id).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from inferscale.filters import MISSING, Filter
from inferscale.keyword import KeywordIndex, fuse
from inferscale.store import FactRecord

Loader = Callable[[str], "tuple[list[FactRecord], object]"]


@dataclass
class _Partition:
    records: list[FactRecord] = field(default_factory=list)
    fields: list[dict] = field(default_factory=list)
    pos: dict[str, int] = field(default_factory=dict)  # id -> row
    by_hash: dict[str, str] = field(default_factory=dict)  # text hash -> id
    rows: torch.Tensor | None = None  # [capacity, dim]
    lock: threading.RLock = field(default_factory=threading.RLock)
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # field -> [n] object values, MISSING if absent
    keyword: KeywordIndex | None = None  # BM25 over the rows' texts, built on the first keyword search
    version: int | None = None  # the scope's version the rows are current for (VectorIndex.refresh)

    def changed(self) -> None:
        """Drop what is derived from the rows (filter columns, the keyword index)."""
        self.columns.clear()
        self.keyword = None

    def keyword_index(self) -> KeywordIndex:
        if self.keyword is None:
            self.keyword = KeywordIndex([r.text for r in self.records])
        return self.keyword

    def column(self, key: str) -> np.ndarray:
        """The values of filter field ``key`` down the rows (built once per change)."""
        col = self.columns.get(key)
        if col is None:
            col = np.fromiter((f.get(key, MISSING) for f in self.fields), dtype=object, count=len(self.fields))
            self.columns[key] = col
        return col


class VectorIndex:
    """Exact top-k by cosine similarity within a scope, with in-partition filters.

    Args:
        device: where the embeddings live.
        loader: ``loader(scope_key) -> (records, embeddings [n, dim])``, the scope's stored
            facts (:meth:`inferscale.store.FactStore.load_scope`); ``None``: scopes start empty.

    Thread-safe: one lock per partition, so a slow first load of one scope does not
    stall searches of others.
    """

    def __init__(self, device: torch.device | str, loader: Loader | None = None,
                 versioner: Callable[[str], int] | None = None) -> None:
        self.device = torch.device(device)
        self.dim: int | None = None
        self._loader = loader
        self._versioner = versioner
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
                # the version is read before the rows: a write that lands in between makes the
                # partition stale (reloaded on the next read), never silently missing
                part.version = self._versioner(scope) if self._versioner is not None else None
                if self._loader is not None:
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
        """Drop ``scope``'s partition if another process wrote to the scope since it was loaded
        (its version, :meth:`inferscale.history.HistoryLog.scope_version`, moved): the next
        read reloads it from the store. One version query; nothing without a versioner."""
        if self._versioner is None:
            return
        with self._lock:
            part = self._parts.get(scope)
        if part is None:
            return
        if part.version != self._versioner(scope):
            self._drop(scope, part)

    def advance(self, scope: str, before: int, after: int) -> None:
        """Record this process's own write, which moved the scope's version from ``before`` to
        ``after``: the partition (which holds the write) is current if it was at ``before``,
        else another process wrote too and it is dropped (reloaded on the next read)."""
        with self._lock:
            part = self._parts.get(scope)
            if part is None:
                return
            if part.version == before:
                part.version = after
            elif self._parts.get(scope) is part:
                del self._parts[scope]

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
                    if part.by_hash.get(part.records[j].hash) == r.id:
                        del part.by_hash[part.records[j].hash]
                    part.by_hash[r.hash] = r.id
                    part.records[j], part.fields[j] = r, r.filter_fields()
                    part.rows[j] = emb[i]
            if not fresh:
                return
            n, need = len(part.records), len(part.records) + len(fresh)
            if part.rows is None or part.rows.shape[0] < need:
                cap = max(need, 2 * (part.rows.shape[0] if part.rows is not None else 16))
                rows = torch.zeros((cap, self.dim), device=self.device)
                if part.rows is not None:
                    rows[:n] = part.rows[:n]
                part.rows = rows
            part.rows[n:need] = emb[fresh]
            for j, i in enumerate(fresh):
                part.pos[records[i].id] = n + j
                part.by_hash[records[i].hash] = records[i].id
                part.records.append(records[i])
                part.fields.append(records[i].filter_fields())

    # ------------------------------------------------------------------ writes

    def add(self, scope: str, records: list[FactRecord], embeddings: torch.Tensor) -> None:
        """Put ``records`` with their ``embeddings`` ``[n, dim]`` in ``scope`` (an id already
        there is replaced).

        Raises:
            ValueError: the dimension differs from the index's.
        """
        if records:
            self._put(self._partition(scope), records, embeddings)

    def remove(self, scope: str, ids: set[str]) -> None:
        """Drop ``ids`` from ``scope`` (unknown ids are ignored)."""
        part = self._partition(scope)
        with part.lock:
            keep = [i for i, r in enumerate(part.records) if r.id not in ids]
            if len(keep) == len(part.records):
                return
            part.changed()
            part.rows = part.rows[keep].clone() if keep else None
            part.records = [part.records[i] for i in keep]
            part.fields = [part.fields[i] for i in keep]
            part.pos = {r.id: j for j, r in enumerate(part.records)}
            part.by_hash = {r.hash: r.id for r in part.records}

    def clear(self) -> None:
        """Forget every partition (they reload from the loader on next use)."""
        with self._lock:
            self._parts.clear()
            self._generation += 1

    # ------------------------------------------------------------------ reads

    def search(
        self, scope: str, query: torch.Tensor, k: int, where: Filter | None = None, keyword_query: str | None = None
    ) -> list[tuple[FactRecord, float]]:
        """Top ``k`` of ``scope`` for ``query`` ``[dim]``: ``(record, cosine)`` pairs, best first.

        Args:
            where: when given, only records whose filter fields satisfy it can be returned;
                it is evaluated as a mask over the partition's columns.
            keyword_query: the query's text: rank by the fusion of cosine and BM25 over it
                (:func:`inferscale.keyword.fuse`) instead of by cosine alone; the pairs
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
            if where is not None:
                mask = torch.from_numpy(where.mask(part.column, n)).to(self.device)
                scores = scores.masked_fill(~mask, float("-inf"))
                eligible = int(mask.sum())
                if eligible == 0:
                    return []
            if keyword_query is not None:
                dense = scores.cpu().numpy()
                top = fuse(dense, part.keyword_index().scores(keyword_query), k)
                return [(part.records[i], float(dense[i])) for i in top.tolist()]
            top = torch.topk(scores, min(k, eligible))
            return [(part.records[i], float(s)) for s, i in zip(top.values.tolist(), top.indices.tolist())]

    def find_hashes(self, scope: str, hashes) -> dict[str, str]:
        """Map each of ``hashes`` (sha256 of a fact text) held in ``scope`` to its id."""
        part = self._partition(scope)
        with part.lock:
            return {h: part.by_hash[h] for h in hashes if h in part.by_hash}

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
