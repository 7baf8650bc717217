"""An in-memory tier of the KV pool: entries kept under a byte budget, least recently used
out first (the device tier, and on CUDA the host tier below it)."""

from __future__ import annotations

from collections import OrderedDict

from inferscale.kv.entry import StoredKV


class MemoryTier:
    """Stored KV by key, least recently used first, within ``budget_bytes``.

    Not thread-safe on its own: :class:`~inferscale.kv.pool.KVPool` holds its lock around
    every call.

    Args:
        name: ``"device"`` or ``"host"`` (in statistics and provenance).
        budget_bytes: most bytes held (:attr:`StoredKV.nbytes` summed); 0 disables the tier.
    """

    def __init__(self, name: str, budget_bytes: int) -> None:
        self.name = name
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, StoredKV] = OrderedDict()
        self.bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def get(self, key: str) -> StoredKV | None:
        """The entry, marked most recently used (``None`` when absent)."""
        kv = self._entries.get(key)
        if kv is not None:
            self._entries.move_to_end(key)
        return kv

    def put(self, key: str, kv: StoredKV) -> list[tuple[str, StoredKV]]:
        """Hold ``kv`` as the most recently used entry (not at all when it alone exceeds the
        budget) and return what left to make room, least recently used first."""
        self.pop(key)
        if kv.nbytes > self.budget_bytes:
            return []
        self._entries[key] = kv
        self.bytes += kv.nbytes
        out = []
        while self.bytes > self.budget_bytes:
            old_key, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            out.append((old_key, old))
        return out

    def pop(self, key: str) -> StoredKV | None:
        """Remove one entry (``None`` when absent)."""
        kv = self._entries.pop(key, None)
        if kv is not None:
            self.bytes -= kv.nbytes
        return kv

    def pop_owner(self, owner: str) -> None:
        """Remove every entry whose key starts with ``"<owner>/"``."""
        prefix = f"{owner}/"
        for key in [k for k in self._entries if k.startswith(prefix)]:
            self.pop(key)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
