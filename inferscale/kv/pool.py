"""The KV pool: precomputed fact KV in three tiers, each under a byte budget.

- **device** (:class:`~inferscale.kv.tiers.MemoryTier`): on the GPU when there is one, else
  host memory; least recently used entries leave it first;
- **host** (CUDA only, ``host_budget_bytes``): pinned host memory between the device and
  disk; what the device tier lets go lands here, and a host hit moves back up;
- **disk** (:class:`~inferscale.kv.disk.DiskTier`, ``disk_budget_bytes``): the files every
  process over the data dir shares; past the budget the files with the fewest recent uses
  are evicted (LRFU: decayed use counts, kept in each file's modification time);
- **redis** (:class:`~inferscale.kv.remote.RedisTier`, ``redis_url``; optional): shared by
  every machine that names it. Writes go through to it; a read that misses every local tier
  asks it, and a hit is kept in the device tier (not written to the local disk: Redis is
  the shared copy). Redis evicts by its own ``maxmemory-policy``; Redis down reads as a miss.

KV is a cache of the memory's text, which stays the system of record: an entry evicted from
every tier is a miss, and the request path serves that memory as text and queues its KV to
be encoded again (:meth:`KVPool.was_evicted` tells why it was missing). Entries a request in
flight uses are pinned (:meth:`KVPool.pinned`) and never evicted by this process, nor is the
newest preamble's KV (every request uses it). Pins reach every process over the folder:
while the disk has a budget, a request's pins are also a pin file in the folder, which
every eviction pass reads (a dead process's pin files are dropped), so another front
worker does not evict KV a request of this one is about to load (docs/decisions.md).

An entry is a :class:`~inferscale.kv.entry.FactKV` (``[num_layers, num_tokens,
num_kv_heads, head_dim]`` pre-RoPE keys and values in the model's dtype, with their token
ids) or its 8- / 4-bit codes (:class:`~inferscale.kv.quant.QuantizedKV`), held as such in
every tier.

Keys (:func:`kv_key`) are ``"<owner>/<variant>"``: ``owner`` is the fact id (or
``_preamble``), ``variant`` a hash of everything the KV depends on (model fingerprint,
dtype, storage dtype, context window w, template, the fact's text and its context tokens),
so invalidating a fact removes one folder. One pool object exists per root folder and
process (:meth:`KVPool.shared`), so every user of a folder in a process shares its memory
tiers; another process (vLLM's engine core, where the connector runs) reads the disk tier
and keeps memory tiers of its own.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from inferscale.kv.disk import READ_ERRORS, DiskTier, no_space
from inferscale.kv.disk_room import EVICTED_KEPT, DiskRoom
from inferscale.kv.entry import FactKV, StoredKV, to_storage
from inferscale.kv.quant import QuantizedKV
from inferscale.kv.remote import RedisTier, redacted
from inferscale.kv.tiers import MemoryTier

log = logging.getLogger(__name__)

__all__ = ["FactKV", "KVPool", "StoredKV", "kv_key", "to_storage", "validate_key"]

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}/[0-9a-f]{32}$")

#: a file's bytes beyond its tensors (safetensors header, token ids): what a write needs free
_FILE_SLACK_BYTES = 64 << 10


def kv_key(owner: str, **parts: object) -> str:
    """Build a pool key ``"<owner>/<variant>"`` from the owner id and what the KV depends on.

    Args:
        owner: fact id (letters, digits, ``-`` and ``_``) or ``"_preamble"``.
        **parts: every input the KV depends on (fingerprint, dtype, w, tokens...).

    Raises:
        ValueError: ``owner`` has characters outside ``[A-Za-z0-9_-]``.
    """
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", owner):
        raise ValueError(f"KV owner id {owner!r} must be 1-128 letters, digits, '-' or '_'")
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}={parts[name]!r};".encode())
    return f"{owner}/{h.hexdigest()[:32]}"


def validate_key(key: str) -> str:
    """Return ``key`` if it is a well-formed pool key, else raise ``ValueError``."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"malformed KV key {key!r}: expected '<owner>/<32 hex digits>'")
    return key


class KVPool(DiskRoom):
    """Stored fact KV in a device, a host (CUDA) and a disk tier; see the module docstring.

    Args:
        root: disk-tier folder (created when missing).
        device: where the device tier lives (``cuda`` when present, else ``cpu``).
        device_budget_bytes: bytes kept in the device tier.
        host_budget_bytes: bytes kept in pinned host memory below a CUDA device tier (0: no
            host tier; ignored when the device is the CPU, whose tier is host memory).
        disk_budget_bytes: bytes of files kept on disk (``None``: no limit).
        redis_url: the shared Redis tier's URL (``None``: none).

    Raises:
        ValueError: ``redis_url`` is not a Redis URL.

    Thread-safe.
    """

    _registry: dict[Path, "KVPool"] = {}
    _registry_lock = threading.Lock()

    def __init__(self, root: Path, device: torch.device | str, device_budget_bytes: int,
                 host_budget_bytes: int = 0, disk_budget_bytes: int | None = None,
                 redis_url: str | None = None) -> None:
        self.root = Path(root)
        self.device = torch.device(device)
        self.device_budget_bytes = int(device_budget_bytes)
        self.host_budget_bytes = int(host_budget_bytes) if self.device.type != "cpu" else 0
        self.disk_budget_bytes = None if disk_budget_bytes is None else int(disk_budget_bytes)
        self._device = MemoryTier("device", self.device_budget_bytes)
        self._host = MemoryTier("host", self.host_budget_bytes)
        self.disk = DiskTier(self.root, self.disk_budget_bytes)
        self.redis_url = redis_url or None
        # deletes Redis missed during an outage wait in a file of the folder (one per Redis)
        self.remote = RedisTier(self.redis_url, self.root / (".redis-pending-" + hashlib.sha256(
            redacted(self.redis_url).encode()).hexdigest()[:16])) if self.redis_url else None
        self._requests = 0  # pinned() blocks open: requests in flight in this process
        self._lock = threading.RLock()
        # one disk write and its eviction at a time in this process: a write burst (the
        # encoder and the request path both writing) holds the folder to its budget plus one entry
        self._write_lock = threading.Lock()
        self._pins: dict[str, int] = {}
        self._users = 0  # holders from shared(); the last release() unregisters the pool
        self._warned_small_budget = False
        self._warned_full_disk = False
        self._disk_full_need = 0  # bytes the last write found no room for (0: none)
        self._full_checked_at = 0.0
        self._evicted: OrderedDict[str, None] = OrderedDict()
        # keys another process stored at this one's request (the engine's encodes): known stored,
        # so a file of theirs that is gone reads as evicted, not as never encoded
        self._stored_elsewhere: OrderedDict[str, None] = OrderedDict()
        self.stats = {"device_hits": 0, "host_hits": 0, "disk_hits": 0, "misses": 0, "writes": 0,
                      "device_evictions": 0, "host_evictions": 0, "disk_evictions": 0, "disk_evicted_bytes": 0,
                      "reencodes": 0, "redis_hits": 0,
                      "served_device": 0, "served_host": 0, "served_disk": 0, "served_redis": 0, "served_text": 0,
                      "served_captured": 0}

    @classmethod
    def shared(cls, root: Path, device: torch.device | str, device_budget_bytes: int, host_budget_bytes: int = 0,
               disk_budget_bytes: int | None = None, redis_url: str | None = None) -> "KVPool":
        """The process-wide pool for ``root`` (created on first use).

        Every caller in a process shares one set of tiers per folder, so invalidations and
        pins reach all of them. Each call holds the pool until a matching :meth:`release`;
        when the last holder releases it, the next call opens the folder afresh (with its
        own settings).

        Raises:
            ValueError: the pool for ``root`` exists with another device or budget (the
                second caller's settings would be silently ignored otherwise).
        """
        key = Path(root).resolve()
        key.mkdir(parents=True, exist_ok=True)  # also fails loudly if the folder became a file
        with cls._registry_lock:
            pool = cls._registry.get(key)
            if pool is None:
                pool = cls(key, device, device_budget_bytes, host_budget_bytes, disk_budget_bytes, redis_url)
                cls._registry[key] = pool
                pool._users = 1
                return pool
            asked = _settings(torch.device(device), device_budget_bytes, host_budget_bytes, disk_budget_bytes,
                              redis_url)
            if pool.settings() != asked:
                shown = {k: redacted(v) if k == "redis_url" and v else v for k, v in pool.settings().items()}
                asked = {k: redacted(v) if k == "redis_url" and v else v for k, v in asked.items()}
                raise ValueError(
                    f"the KV pool at {key} is already open in this process with {shown}; open it with the "
                    f"same settings (asked: {asked}), or close the Memory that opened it first"
                )
            pool._users += 1
            return pool

    @property
    def holders(self) -> int:
        """How many :meth:`shared` holds of this pool are open in this process."""
        return self._users

    def release(self) -> None:
        """Let go of one :meth:`shared` hold (``Memory.close`` does, once). The last hold takes
        the pool out of the process's registry and closes its Redis connection, so the folder
        can be opened again with other settings; the files stay. A pool made with the
        constructor, or released past zero, is left as it is."""
        with self._registry_lock:
            if self._users <= 0:
                return
            self._users -= 1
            if self._users > 0:
                return
            if self._registry.get(self.root) is self:
                del self._registry[self.root]
        if self.remote is not None:
            self.remote.close()

    def settings(self) -> dict:
        """Device, budgets (bytes) and Redis URL, as :meth:`shared` compares them."""
        return _settings(self.device, self.device_budget_bytes, self.host_budget_bytes, self.disk_budget_bytes,
                         self.redis_url)

    def _path(self, key: str) -> Path:
        return self.disk.path(validate_key(key))

    def _remember(self, key: str, kv: StoredKV) -> None:
        """Hold ``kv`` in the device tier; what leaves it goes to the host tier (when there is one)."""
        for old_key, old in self._device.put(key, kv):
            self.stats["device_evictions"] += 1
            if self._host.budget_bytes > 0:
                self.stats["host_evictions"] += len(self._host.put(old_key, _to_host(old)))
        self._host.pop(key)

    def put(self, key: str, kv: StoredKV) -> None:
        """Store ``kv`` under ``key`` on disk (atomically) and in the device tier, as it is
        (dense, or the codes of a :class:`~inferscale.kv.quant.QuantizedKV`); past the disk
        budget, evict the lowest-priority files (fewest recent uses) that no request pins;
        short of the disk's reserve (:meth:`DiskTier.room`: 5% of the file system, at most
        1 GiB), evict to keep it free.

        Raises:
            ValueError: ``key`` is malformed, or ``kv.token_ids`` has another length than the KV.
            DiskFullError: no room on the disk even after evicting all that no request pins
                (nothing is evicted then); an outage of "the KV disk" (:mod:`inferscale.runtime.outages`).
            OSError: the file cannot be written for another reason (no permission).
        """
        validate_key(key)
        if kv.token_ids is not None and len(kv.token_ids) != kv.num_tokens:
            raise ValueError(f"{len(kv.token_ids)} token ids for KV of {kv.num_tokens} tokens")
        need = kv.nbytes + _FILE_SLACK_BYTES
        with self._write_lock:
            # a filling file system (no budget, one larger than the disk, other files growing)
            # is a smaller budget: the pool keeps a reserve free, evicting by its order
            self._make_room(key, need)
            for attempt in (1, 2, 3):
                try:
                    self.disk.write(key, kv)
                    break
                except OSError as exc:
                    if not (no_space(exc) or self.disk.full(need)):
                        raise
                    if attempt == 3:  # other writers keep taking the space
                        raise self._full_error(need, 0) from exc
                    self._make_room(key, need)
            if self._disk_full_need:
                from inferscale.runtime.outages import OUTAGES  # only writers get here: not vLLM's process

                self._disk_full_need = 0
                OUTAGES.ok("kv_disk")
            if self.disk.over_budget():
                self._evict_disk(protect=key)
        if self.remote is not None:
            self.remote.put(key, kv)  # write-through; skipped while Redis is down
        with self._lock:
            self._remember(key, kv.to(self.device))
            self.stats["writes"] += 1
            if key in self._evicted:  # evicted earlier, now encoded again
                del self._evicted[key]
                self.stats["reencodes"] += 1

    def get(self, key: str) -> StoredKV | None:
        """The entry for ``key`` on the pool's device, or ``None`` when absent or unreadable.

        A quantized entry comes back quantized (:class:`~inferscale.kv.quant.QuantizedKV`:
        its ``keys`` and ``values`` dequantize on access)."""
        with self._lock:
            kv = self._device.get(key)
            if kv is not None:
                self.stats["device_hits"] += 1
                return kv
            kv = self._host.get(key)
            if kv is not None:
                self.stats["host_hits"] += 1
                kv = kv.to(self.device)
                self._remember(key, kv)
                return kv
        try:
            kv = self.disk.read(validate_key(key)).to(self.device)
            tier = "disk_hits"
        except READ_ERRORS:
            kv = self.remote.get(key) if self.remote is not None else None
            if kv is None:
                with self._lock:
                    self.stats["misses"] += 1
                return None
            kv, tier = kv.to(self.device), "redis_hits"
        with self._lock:
            self._remember(key, kv)
            self.stats[tier] += 1
        return kv

    def token_ids(self, key: str) -> tuple[int, ...] | None:
        """The tokens ``key``'s KV was encoded from, read without loading the KV (``None`` when
        the entry is absent, unreadable or has no token ids)."""
        with self._lock:
            kv = self._device.get(key) or self._host.get(key)
        if kv is not None:
            return kv.token_ids
        try:
            tokens = self.disk.token_ids(validate_key(key))
        except ValueError:
            return None
        if tokens is None and self.remote is not None and not self.disk.exists(key):
            kv = self.get(key)  # from Redis: kept in the device tier for the load that follows
            return None if kv is None else kv.token_ids
        return tokens

    def contains(self, key: str) -> bool:
        """Whether ``key`` is on disk or in Redis, where every process reads it (no load).

        Those are the tiers the connector in vLLM's process reads, so an entry counts as
        stored only there; an entry evicted from disk is dropped from this process's memory
        tiers at once, so the two agree."""
        return key in self.present([key])

    def present(self, keys: Iterable[str]) -> set[str]:
        """The ``keys`` that :meth:`contains` holds, with one Redis round trip for all those
        not on disk (none without Redis)."""
        found: set[str] = set()
        rest = []
        for key in keys:
            if self._path(key).exists():
                found.add(key)
            else:
                rest.append(key)
        if rest and self.remote is not None:
            found |= self.remote.present(rest)
        return found

    def tier(self, key: str) -> str | None:
        """Where ``key`` is: ``"device"``, ``"host"``, ``"disk"``, ``"redis"`` or ``None``."""
        return self.tiers([key])[0]

    def tiers(self, keys: Sequence[str]) -> list[str | None]:
        """:meth:`tier` of each key, with one Redis round trip for all those not on disk.

        An entry in this process's memory tiers counts only while it is still on disk or in
        Redis, where vLLM's connector reads it: another process over the folder (the
        connector storing captured KV, another worker of the front) may have evicted its
        file. Such an entry is dropped from the memory tiers and reads as evicted
        (:meth:`was_evicted`)."""
        found: list[str | None] = []
        with self._lock:
            for key in keys:
                found.append("device" if key in self._device else "host" if key in self._host else None)
        on_disk = [self._path(key).exists() for key in keys]
        for i in range(len(keys)):
            if found[i] is None and on_disk[i]:
                found[i] = "disk"
        elsewhere = [i for i in range(len(keys)) if not on_disk[i]]
        present = self.remote.present([keys[i] for i in elsewhere]) if elsewhere and self.remote is not None else set()
        stale = []
        with self._lock:
            stored_elsewhere = [i for i in elsewhere if keys[i] in self._stored_elsewhere]
        for i in elsewhere:
            if keys[i] in present:
                found[i] = found[i] or "redis"
            elif found[i] is not None or i in stored_elsewhere:
                stale.append(keys[i])
                found[i] = None
        if stale:
            with self._lock:
                for key in stale:
                    self._device.pop(key)
                    self._host.pop(key)
                    self._stored_elsewhere.pop(key, None)
                    self._evicted[key] = None
        return found

    def memory_keys(self) -> list[str]:
        """The keys this process holds in memory (device tier, then host tier)."""
        with self._lock:
            return self._device.keys() + self._host.keys()

    def held(self, owner: str) -> dict[str, tuple[str, StoredKV]]:
        """This process's in-memory entries of ``owner`` (a fact id): ``{key: (tier, entry)}``,
        read without counting a use (for reports: :mod:`inferscale.kv.inventory`)."""
        prefix = f"{owner}/"
        with self._lock:
            return {key: (tier.name, tier._entries[key]) for tier in (self._device, self._host)
                    for key in tier.keys() if key.startswith(prefix)}

    def use(self, keys: Iterable[str]) -> None:
        """Mark ``keys`` as used by a request now (their disk recency, :meth:`DiskTier.touch`)."""
        for key in keys:
            self.disk.touch(validate_key(key))

    def count_served(self, tiers: Iterable[str | None]) -> None:
        """Count the memories a request was planned with: each one's tier (``"device"``,
        ``"host"``, ``"disk"``, ``"redis"``) or ``None`` for one served as text. These are
        the ``served_*`` counters, the front's hits and misses (``/metrics``); the
        ``*_hits`` counters count loads, made where the KV is read (vLLM's process)."""
        with self._lock:
            for tier in tiers:
                self.stats[f"served_{tier or 'text'}"] += 1

    def count_captured(self, n: int) -> None:
        """Count ``n`` memories planned with KV a request captured (``served_captured``, also
        counted in their tier's ``served_*``)."""
        if n:
            with self._lock:
                self.stats["served_captured"] += n

    def note_stored_elsewhere(self, keys: Iterable[str]) -> None:
        """Note ``keys`` as stored for this process by another one (the serving engine's connector,
        for an encode this process asked for, :mod:`inferscale.kv.engine_encoder`): if one's file
        later goes (another process evicted it), :meth:`was_evicted` says so, as for an entry
        this process stored itself."""
        with self._lock:
            for key in keys:
                self._stored_elsewhere[key] = None
                self._stored_elsewhere.move_to_end(key)
                self._evicted.pop(key, None)
            while len(self._stored_elsewhere) > EVICTED_KEPT:
                self._stored_elsewhere.popitem(last=False)

    def was_evicted(self, key: str) -> bool:
        """Whether this process evicted ``key`` (and has not stored it again since)."""
        with self._lock:
            return key in self._evicted

    @contextmanager
    def pinned(self, keys: Iterable[str]) -> Iterator[None]:
        """Keep ``keys`` from eviction while the block runs (a request's life): in this
        process and in every other process that evicts from the folder (a pin file,
        :meth:`DiskTier.pin`: the front's other workers). Each block counts as a request in
        flight (:attr:`requests_in_flight`), with or without keys: every request of this
        process, in any mode, holds one from planning to its last token."""
        keys = list(keys)
        with self._lock:
            self._requests += 1
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1
        pin_file = self.disk.pin(keys) if keys else None  # the disk's reserve evicts even without a budget
        try:
            yield
        finally:
            self.disk.unpin(pin_file)
            with self._lock:
                self._requests -= 1
                for key in keys:
                    left = self._pins[key] - 1
                    if left:
                        self._pins[key] = left
                    else:
                        del self._pins[key]

    @property
    def requests_in_flight(self) -> int:
        """Requests of this process now between planning and their last token (:meth:`pinned`
        blocks open): the background encoder waits for none before each batch."""
        return self._requests

    def remove(self, key: str, *, shared: bool = True) -> None:
        """Drop one entry from every tier (absent is fine); from this machine's tiers only
        (device, host, disk) when ``shared`` is false."""
        with self._lock:
            self._device.pop(key)
            self._host.pop(key)
        self.disk.remove(validate_key(key))
        if shared and self.remote is not None:
            self.remote.remove(key)

    def invalidate_owner(self, owner: str) -> None:
        """Drop every entry of ``owner`` (a fact id) from every tier."""
        with self._lock:
            self._device.pop_owner(owner)
            self._host.pop_owner(owner)
        self.disk.remove_owner(owner)
        if self.remote is not None:
            self.remote.remove_owner(owner)

    def clear(self) -> None:
        """Drop every entry from every tier."""
        with self._lock:
            self._device.clear()
            self._host.clear()
        self.disk.clear()
        if self.remote is not None:
            self.remote.clear()

    def footprint(self, exact: bool = True) -> dict[str, int]:
        """Bytes held: ``{"device": ..., "host": ..., "disk": ...}``; the disk's by a scan, or
        (``exact=False``) as last counted (:meth:`DiskTier.estimate`)."""
        with self._lock:
            device, host = self._device.bytes, self._host.bytes
        return {"device": device, "host": host, "disk": self.disk.size() if exact else self.disk.estimate()}


def _to_host(kv: StoredKV) -> StoredKV:
    """``kv`` in host memory, pinned (page-locked, for fast copies back to the GPU)."""
    kv = kv.to("cpu")
    if not torch.cuda.is_available():
        return kv
    if isinstance(kv, QuantizedKV):
        return QuantizedKV(kv.dtype, kv.k_codes.pin_memory(), kv.k_scales.pin_memory(), kv.v_codes.pin_memory(),
                           kv.v_scales.pin_memory(), kv.out_dtype, kv.token_ids)
    return FactKV(kv.keys.pin_memory(), kv.values.pin_memory(), kv.token_ids)


def _settings(device: torch.device, device_budget_bytes: int, host_budget_bytes: int,
              disk_budget_bytes: int | None, redis_url: str | None) -> dict:
    """A pool's device, budgets and Redis URL as :meth:`KVPool.settings` reports them (no host
    tier on a CPU device)."""
    return {"device": str(device), "device_budget_bytes": int(device_budget_bytes),
            "host_budget_bytes": int(host_budget_bytes) if device.type != "cpu" else 0,
            "disk_budget_bytes": None if disk_budget_bytes is None else int(disk_budget_bytes),
            "redis_url": redis_url or None}
