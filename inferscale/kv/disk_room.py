"""The pool's disk budget and free space (:class:`DiskRoom`, a part of
:class:`~inferscale.kv.pool.KVPool`): evicting down to a budget, keeping room on a nearly
full disk, and saying when the disk is full, so a write never fails for a cause an eviction
could have removed, and a write that cannot fit fails before its KV is made.

Evictions follow the disk tier's order (:class:`~inferscale.kv.disk.DiskTier`) and never take
a key a request pins, here or in another process over the folder.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from inferscale.kv.disk import DiskFullError

log = logging.getLogger("inferscale.kv.pool")

#: Keys remembered as evicted, for provenance (~150 bytes each); the oldest are forgotten first.
EVICTED_KEPT = 100_000


class DiskRoom:
    """The disk-budget half of :class:`~inferscale.kv.pool.KVPool` (its state is the pool's:
    ``disk``, ``_lock``, ``_pins``, ``stats``, the tiers and the warning flags)."""

    def set_disk_budget(self, budget_bytes: int | None) -> int:
        """Change the disk tier's budget now (``None``: no limit), evicting down to it at once
        (an operator resizing a live pool; the replay benchmark); returns entries evicted.

        Raises:
            TypeError: not an ``int`` or ``None``. ValueError: a budget under 1 MiB (as
                ``disk_kv_budget_bytes`` refuses).
        """
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)):
            raise TypeError(f"a disk budget is a whole number of bytes or None (no limit), got {budget_bytes!r}")
        if budget_bytes is not None and budget_bytes < 1 << 20:
            raise ValueError(f"a disk budget must be at least 1 MiB, got {budget_bytes} bytes")
        with self._lock:
            self.disk_budget_bytes = self.disk.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        return self.enforce_budget()

    def enforce_budget(self) -> int:
        """Evict past the disk budget now, as a write would (a writer opening a folder that
        holds more than its budget: a lowered setting); returns how many entries went."""
        if not self.disk.over_budget():
            return 0
        before = self.stats["disk_evictions"]
        self._evict_disk(protect="")
        return self.stats["disk_evictions"] - before

    def _keep(self, protect: str) -> Callable[[str], bool]:
        """What an eviction pass must leave: ``protect`` (the entry being written) and every
        key a request in flight pinned, here or in another process over the folder."""
        with self._lock:
            pinned = set(self._pins)
        pinned |= self.disk.pinned_elsewhere()
        return lambda k: k == protect or k in pinned

    def _make_room(self, protect: str, need: int) -> None:
        """Keep ``need`` bytes and the disk's reserve free (:meth:`DiskTier.room`), evicting
        by the disk's order; warns once, with what to set.

        Raises:
            DiskFullError: even evicting every entry no request uses would not free ``need``
                (nothing is evicted then).
        """
        room = self.disk.room()
        if room is None or room[0] >= need + room[1]:
            return
        free, reserve = room
        keep = self._keep(protect)
        evictable = self.disk.evictable(keep)
        if free + evictable < need:
            raise self._full_error(need, evictable)
        with self._lock:
            warn, self._warned_full_disk = not self._warned_full_disk, True
        if warn:
            log.warning("the disk holding the KV pool at %s has %d bytes free, fewer than a %d-byte KV file and the "
                        "%d the pool keeps free (5%% of the disk, at most 1 GiB): evicting KV files to make "
                        "room; set disk_kv_budget_bytes (now %s) to keep the pool below that", self.root, free, need,
                        reserve, self.disk.budget_bytes or "no limit")
        self._evict_disk(protect, free_bytes=need + reserve - free, keep=keep)

    def _full_error(self, need: int, evictable: int) -> DiskFullError:
        room = self.disk.room() or (0, 0)
        self._disk_full_need = need
        return DiskFullError(
            f"no room for KV on the disk of {self.root}: {room[0]:,} bytes free, {need:,} needed, and evicting "
            f"every KV file no request uses would free {evictable:,}: free space on that disk (memories are "
            "served as text meanwhile)")

    @property
    def under_pressure(self) -> bool:
        """Whether keeping more KV on disk now soon evicts other KV: the disk holds at least
        :attr:`DiskTier.LOW_WATERMARK` (90%) of its budget (bytes as last counted; an eviction
        pass leaves that much), or the last write found the disk full. Without a budget, only
        a full disk."""
        if self.disk_full:
            return True
        budget = self.disk.budget_bytes
        return budget is not None and self.disk.estimate() >= self.disk.LOW_WATERMARK * budget

    @property
    def disk_full(self) -> bool:
        """Whether the last write found no room on the disk (until one fits again)."""
        return bool(self._disk_full_need)

    def check_writable(self) -> None:
        """After a :class:`DiskFullError`, raise it again while the disk still has no room
        (a ``statvfs``; a folder scan at most every 5 s): the background encoder asks before
        it spends an encode on KV it could not store.

        Raises:
            DiskFullError: as above.
        """
        need = self._disk_full_need
        if not need:
            return
        room = self.disk.room()
        if room is None or room[0] >= need:
            return
        now = time.monotonic()
        if now - self._full_checked_at < 5.0:
            raise self._full_error(need, 0)
        self._full_checked_at = now
        evictable = self.disk.evictable(self._keep(""))
        if room[0] + evictable < need:
            raise self._full_error(need, evictable)

    def check_room(self, need: int) -> None:
        """Before KV this process does not write itself is made (the serving engine's capture
        writer stores it): raise :class:`DiskFullError` when the disk has fewer than ``need``
        bytes free even after evicting every KV file no request uses, as a write would.

        Raises:
            DiskFullError: as above (and :meth:`check_writable` raises it again until there is room).
        """
        room = self.disk.room()
        if room is None or room[0] >= need:
            return
        evictable = self.disk.evictable(self._keep(""))
        if room[0] + evictable < need:
            raise self._full_error(need, evictable)

    def _evict_disk(self, protect: str, free_bytes: int = 0, keep: Callable[[str], bool] | None = None) -> None:
        keep = keep or self._keep(protect)
        # the preamble's newest file (owner "_preamble": in every request) is kept by the disk tier
        gone = self.disk.evict(keep=keep, free_bytes=free_bytes)
        with self._lock:
            for key, size in gone:
                self._device.pop(key)
                self._host.pop(key)
                self._evicted[key] = None
                self.stats["disk_evictions"] += 1
                self.stats["disk_evicted_bytes"] += size
            while len(self._evicted) > EVICTED_KEPT:
                self._evicted.popitem(last=False)
            left, budget = self.disk.estimate(), self.disk.budget_bytes
            warn = budget is not None and left > budget and not self._warned_small_budget
            self._warned_small_budget |= warn
        if warn:
            log.warning("disk_kv_budget_bytes (%d bytes) is smaller than the KV the pool must keep (%d bytes after "
                        "evicting all it could: the preamble's and KV in use), so every write evicts what was just "
                        "encoded and memories come as text; raise it to several times that", budget, left)
