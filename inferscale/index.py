"""Device-resident exact cosine top-k index, partitioned by scope.

Each scope owns a ``[capacity, dim]`` float32 tensor of L2-normalised embeddings on
the best device (CUDA when present, else CPU), grown by doubling. A query is one
matrix-vector product over its scope's rows only, so one scope can never see another
scope's facts. Rebuilt from Chroma on start-up (:meth:`VectorIndex.from_rows`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class _Partition:
    ids: list[str] = field(default_factory=list)
    rows: torch.Tensor | None = None  # [capacity, dim]


class VectorIndex:
    """Exact top-k by cosine similarity within a scope.

    Args:
        device: where the embeddings live.

    Thread-safe.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.dim: int | None = None
        self._parts: dict[str, _Partition] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_rows(cls, device, ids: list[str], scopes: list[str], embeddings) -> "VectorIndex":
        """Build from stored rows: ``embeddings`` is ``[n, dim]`` (numpy or tensor)."""
        index = cls(device)
        by_scope: dict[str, list[int]] = {}
        for i, s in enumerate(scopes):
            by_scope.setdefault(s, []).append(i)
        emb = torch.as_tensor(embeddings, dtype=torch.float32)
        for scope, rows in by_scope.items():
            index.add(scope, [ids[r] for r in rows], emb[rows])
        return index

    def add(self, scope: str, ids: list[str], embeddings: torch.Tensor) -> None:
        """Append ``ids`` with ``embeddings`` ``[n, dim]`` to ``scope``.

        Raises:
            ValueError: the dimension differs from the index's.
        """
        if not ids:
            return
        emb = torch.nn.functional.normalize(embeddings.to(self.device, torch.float32), dim=-1)
        with self._lock:
            if self.dim is None:
                self.dim = int(emb.shape[1])
            elif emb.shape[1] != self.dim:
                raise ValueError(f"embedding dimension {emb.shape[1]} does not match the index's {self.dim}")
            part = self._parts.setdefault(scope, _Partition())
            n, need = len(part.ids), len(part.ids) + len(ids)
            if part.rows is None or part.rows.shape[0] < need:
                cap = max(need, 2 * (part.rows.shape[0] if part.rows is not None else 16))
                rows = torch.zeros((cap, self.dim), device=self.device)
                if part.rows is not None:
                    rows[:n] = part.rows[:n]
                part.rows = rows
            part.rows[n:need] = emb
            part.ids.extend(ids)

    def remove(self, scope: str, ids: set[str]) -> None:
        """Drop ``ids`` from ``scope`` (unknown ids are ignored)."""
        with self._lock:
            part = self._parts.get(scope)
            if part is None or part.rows is None:
                return
            keep = [i for i, x in enumerate(part.ids) if x not in ids]
            part.rows = part.rows[keep].clone() if keep else None
            part.ids = [part.ids[i] for i in keep]

    def search(
        self, scope: str, query: torch.Tensor, k: int, allowed: set[str] | None = None
    ) -> list[tuple[str, float]]:
        """Top ``k`` of ``scope`` for ``query`` ``[dim]``: ``(id, cosine)`` pairs, best first.

        ``allowed``: when given, only these ids can be returned.
        """
        with self._lock:
            part = self._parts.get(scope)
            if part is None or part.rows is None or k <= 0:
                return []
            n = len(part.ids)
            q = torch.nn.functional.normalize(query.to(self.device, torch.float32), dim=-1)
            scores = part.rows[:n] @ q
            if allowed is not None:
                mask = torch.tensor([i in allowed for i in part.ids], device=self.device)
                scores = scores.masked_fill(~mask, float("-inf"))
                n = int(mask.sum())
            if n == 0:
                return []
            top = torch.topk(scores, min(k, n))
            return [(part.ids[i], float(s)) for s, i in zip(top.values.tolist(), top.indices.tolist())]

    def clear(self) -> None:
        """Forget every row."""
        with self._lock:
            self._parts.clear()

    def size(self, scope: str | None = None) -> int:
        """Rows in ``scope``, or in all scopes."""
        with self._lock:
            if scope is not None:
                return len(self._parts[scope].ids) if scope in self._parts else 0
            return sum(len(p.ids) for p in self._parts.values())
