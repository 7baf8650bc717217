"""The KV pool's disk tier: one safetensors file per entry, under a byte budget.

A file is ``<root>/<owner>/<variant>.safetensors`` (format ``inferscale-kv-2``): the KV
(``keys`` / ``values``, or a quantized entry's codes and scales) with the token ids it was
encoded from, and metadata ``storage`` naming ``model`` or the quantized dtype (files
written before that field existed read as ``model``). Writes go to a temporary file renamed
into place: a crash leaves no partial entry.

**Budget and eviction.** With a budget, the tier evicts the files with the lowest
*priority* when it holds more. The priority is LRFU's (Lee et al., "LRFU: a spectrum of
policies that subsumes the least recently used and least frequently used policies", IEEE
Trans. Computers 2001) with exponential decay: every use adds 1 to an entry's count, the
count halves every :attr:`DiskTier.HALF_LIFE_S`, and the priority is
``t_last + HALF_LIFE_S * log2(count at t_last)``, so ranking by it ranks by decayed count.
A use at time ``now`` turns priority ``p`` into ``HALF_LIFE_S * log2(2^(p / H) + 2^(now / H))``
(the log-sum-exp of the two), so the priority alone carries the whole state and is kept as the
file's modification time: a write sets it to now (count 1), a use counts
(:meth:`DiskTier.touch`, called by the front each time it plans a request with the KV, at
most once a minute per entry and process, so a count counts minutes of use), and every
process sharing the folder (the front's workers, the connector in vLLM's process) sees one
order. Reads do not count: the connector loads what a front planned, and a second count
from another process (whose settings the front's do not reach) would skew the order. A
frequently used entry's modification time lies in the future (an entry used in every minute
of the last hour: about 5.4 half-lives ahead). With ``HALF_LIFE_S = None`` the order is
plain least recently used (docs/results/tiers compares the two on a replay).

An eviction pass scans the folder and removes the lowest-priority files down to 90% of the
budget (so passes are rare), skipping what the caller keeps (entries pinned by requests in
flight, the entry just written). Only processes that write evict; the connector only reads.
The budget bounds the folder between passes up to what is written meanwhile.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from inferscale.kv.entry import StoredKV, from_tensors, to_tensors
from inferscale.runtime.processes import pid_alive

_SUFFIX = ".safetensors"
#: an owner folder and an entry file, as :func:`inferscale.kv.pool.kv_key` names them: anything
#: else in the folder (a stray model file, a link) is never counted, read or evicted
_OWNER_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_FILE_RE = re.compile(r"[0-9a-f]{32}\.safetensors")
#: a temporary file older than this (seconds) is a crashed writer's leftover: removed by the next scan
STALE_TMP_S = 3600.0
#: the share of the file system the pool keeps free for everything else on it (the store
#: of record first), at most :data:`MIN_FREE_MAX_BYTES` (nginx's ``proxy_cache_path
#: min_free`` does the same for its cache). Small on purpose: a laptop whose disk is 90%
#: full still caches KV; the store's writes need megabytes, not a tenth of a disk.
MIN_FREE_SHARE = 0.05
MIN_FREE_MAX_BYTES = 1 << 30
#: the folder of the pin files of requests in flight, one per request (:meth:`DiskTier.pin`)
_PINS = ".pins"
#: a pin file older than this (seconds) is a leftover, whatever its process (no request lives an hour)
STALE_PIN_S = 3600.0

log = logging.getLogger(__name__)

#: Errors that mean "this file cannot be read": the entry is treated as absent.
READ_ERRORS = (FileNotFoundError, SafetensorError, KeyError, OSError, ValueError)


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) says the file system is full
    (``ENOSPC``, ``EDQUOT``; safetensors' errors carry only the text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class DiskFullError(OSError):
    """The disk holding the KV pool has no room for an entry, and evicting every entry no
    request uses would not make it (the file system is full of other files)."""


class DiskTier:
    """Files of the pool under ``root``; see the module docstring.

    Args:
        root: the folder (created when missing).
        budget_bytes: most bytes of files kept (``None``: no limit, nothing is evicted).

    Thread-safe.
    """

    #: a use renews an entry's modification time at most this often (seconds)
    TOUCH_INTERVAL_S = 60.0
    #: a use's weight in the eviction order halves in this time (seconds); ``None``: least
    #: recently used. An hour: a user's session-scale (the replay scales it down with
    #: :attr:`TOUCH_INTERVAL_S`, docs/decisions.md).
    HALF_LIFE_S: float | None = 3600.0
    #: an eviction pass stops at this share of the budget
    LOW_WATERMARK = 0.9
    #: an over-budget check rescans the folder at least this often (seconds): other
    #: processes' writes are counted then
    RESCAN_S = 300.0

    def __init__(self, root: Path, budget_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self._lock = threading.Lock()
        self._bytes: int | None = None  # last scan plus this process's writes since
        self._scanned_at = 0.0
        self._touched: dict[str, float] = {}

    def path(self, key: str) -> Path:
        owner, variant = key.split("/")
        return self.root / owner / f"{variant}{_SUFFIX}"

    def write(self, key: str, kv: StoredKV) -> int:
        """Write ``kv`` atomically; returns the file's size (bytes).

        Raises:
            OSError, SafetensorError: the file cannot be written (a full disk, no permission).
        """
        tensors, meta = to_tensors(kv)
        path = self.path(key)
        for attempt in (1, 2):  # an eviction pass may remove the owner folder once it is empty
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=path.parent)
            except (FileNotFoundError, FileExistsError):  # removed between mkdir's steps, or after it
                if attempt == 2:
                    raise
                continue
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata=meta)
                os.replace(tmp, path)
                break
            except (FileNotFoundError, SafetensorError) as exc:
                if attempt == 2 or path.parent.exists():  # a real failure (a full disk), not the race
                    raise OSError(f"cannot write KV file {path}: {exc}") from exc
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        try:
            size = path.stat().st_size
        except OSError:  # evicted or invalidated by another process at once
            size = 0
        with self._lock:
            if self._bytes is not None:
                self._bytes += size
            self._touched[key] = time.monotonic()
        return size

    def read(self, key: str) -> StoredKV:
        """The entry, on the CPU (a read is not a use: :meth:`touch`). An unreadable file
        (truncated by a crash, corrupt) is removed, so the entry reads as absent everywhere and
        is encoded again.

        Raises:
            FileNotFoundError, OSError, SafetensorError: unreadable. KeyError, ValueError: a
                tensor or metadata field missing or unknown (see :data:`READ_ERRORS`).
        """
        path = self.path(key)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            kv = from_tensors(tensors, meta)
        except (SafetensorError, KeyError, ValueError) as exc:  # the bytes are bad; not a permission or I/O error
            self._discard(path, exc)
            raise
        return kv

    def token_ids(self, key: str) -> tuple[int, ...] | None:
        """The entry's token ids without its KV (``None``: absent, unreadable, or none stored);
        an unreadable file is removed, as :meth:`read` does."""
        path = self.path(key)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                if "token_ids" not in f.keys():
                    return None
                return tuple(f.get_tensor("token_ids").tolist())
        except (SafetensorError, ValueError) as exc:
            self._discard(path, exc)
            return None
        except OSError:  # absent, or not ours to read
            return None

    def _discard(self, path: Path, exc: BaseException) -> None:
        """Remove an unreadable entry file (a cache entry: encoded again when next needed)."""
        try:
            if not path.is_file():
                return  # a folder where a file should be: not ours to remove
            path.unlink(missing_ok=True)
        except OSError:
            return
        log.warning("KV file %s was unreadable (%s: %s) and is removed; its memory is served as text until its KV "
                    "is encoded again", path, type(exc).__name__, exc)

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def touch(self, key: str) -> None:
        """Count a use of the entry in its eviction priority (its modification time, see the
        module docstring), at most every :attr:`TOUCH_INTERVAL_S` seconds per entry in this
        process; absent is fine."""
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(key, -1e9) < self.TOUCH_INTERVAL_S:
                return
            if len(self._touched) > 1_000_000:  # bound the memory: start over
                self._touched.clear()
            self._touched[key] = now
        path = self.path(key)
        try:
            if self.HALF_LIFE_S is None:
                os.utime(path)
            else:
                wall = time.time()
                old = path.stat().st_mtime
                new = wall if old > wall + self.max_ahead_s() else used_priority(old, wall, self.HALF_LIFE_S)
                os.utime(path, (wall, new))
        except OSError:
            pass

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def remove_owner(self, owner: str) -> None:
        shutil.rmtree(self.root / owner, ignore_errors=True)

    def clear(self) -> None:
        for child in self.root.iterdir():
            if child.is_dir() and child.name != _PINS:  # requests in flight keep their pins
                shutil.rmtree(child, ignore_errors=True)
        with self._lock:
            self._bytes = 0

    def scan(self) -> list[tuple[float, int, str]]:
        """Every entry as ``(priority, bytes, key)``, lowest priority first; records the total.

        Only entry files count (names as :func:`inferscale.kv.pool.kv_key` makes them, no
        links followed); a temporary file counts while a writer may still be writing it and
        is removed once older than :data:`STALE_TMP_S` (a crashed writer's leftover). A
        priority further ahead than any use could make it (:meth:`max_ahead_s`: a clock that
        jumped, files copied with their times) means nothing: it ranks lowest (and a use
        starts its count afresh, :meth:`touch`)."""
        entries = []
        tmp_bytes = 0
        wall = time.time()
        ceiling = wall + self.max_ahead_s()
        for owner in os.scandir(self.root):
            if not owner.is_dir(follow_symlinks=False) or not _OWNER_RE.fullmatch(owner.name):
                continue
            try:
                files = list(os.scandir(owner.path))
            except OSError:  # removed meanwhile
                continue
            for f in files:
                try:
                    if not f.is_file(follow_symlinks=False):
                        continue
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if f.name.startswith(".tmp"):
                    if wall - st.st_mtime > STALE_TMP_S:
                        try:
                            os.unlink(f.path)
                        except OSError:
                            pass
                    else:
                        tmp_bytes += st.st_size
                    continue
                if not _FILE_RE.fullmatch(f.name):
                    continue
                priority = st.st_mtime if st.st_mtime <= ceiling else 0.0
                entries.append((priority, st.st_size, f"{owner.name}/{f.name[:-len(_SUFFIX)]}"))
        entries.sort()
        with self._lock:
            self._bytes = sum(size for _, size, _ in entries) + tmp_bytes
            self._scanned_at = time.monotonic()
        return entries

    def max_ahead_s(self) -> float:
        """How far ahead of now a priority can be (seconds): an entry used every
        :attr:`TOUCH_INTERVAL_S` forever has count ``1 / (1 - 2^(-I/H))``, so ``H *
        log2`` of that (6.4 half-lives at the defaults), plus a minute for clocks."""
        h = self.HALF_LIFE_S
        if h is None:
            return 60.0
        i = max(self.TOUCH_INTERVAL_S, 1e-3)
        return h * math.log2(1.0 / (1.0 - 2.0 ** (-i / h))) + 60.0

    def size(self) -> int:
        """Bytes of files held (a scan)."""
        self.scan()
        return self._bytes or 0

    def estimate(self) -> int:
        """Bytes of files held as last counted (the last scan plus this process's writes since;
        a scan when none was made)."""
        with self._lock:
            known = self._bytes
        return self.size() if known is None else known

    def over_budget(self) -> bool:
        """Whether the tier holds more than its budget (rescanning when the count is unknown or old)."""
        if self.budget_bytes is None:
            return False
        with self._lock:
            known = self._bytes is not None and time.monotonic() - self._scanned_at < self.RESCAN_S
        if not known:
            self.scan()
        return (self._bytes or 0) > self.budget_bytes

    def evict(self, keep: Callable[[str], bool], free_bytes: int = 0) -> list[tuple[str, int]]:
        """Remove the lowest-priority files (see the module docstring), skipping those
        ``keep(key)`` holds and the newest file of each shared owner (a name starting with
        ``_``: the preamble, whose older variants, such as yesterday's dated template, go as
        facts do), until the folder is at :attr:`LOW_WATERMARK` of the budget; returns
        ``(key, bytes)`` removed. An owner folder left empty is removed too.

        Args:
            keep: which keys must stay.
            free_bytes: when more than 0, remove files to free this many bytes, or
                ``1 - LOW_WATERMARK`` of what the folder holds if that is more, whatever
                the budget (the file system is full: :meth:`full`).
        """
        if self.budget_bytes is None and free_bytes <= 0:
            return []
        entries = self.scan()
        shared = _newest_shared(entries)
        total = self._bytes or 0
        target = None if self.budget_bytes is None else int(self.budget_bytes * self.LOW_WATERMARK)
        if free_bytes > 0:
            freed = total - max(int(free_bytes), int(total * (1 - self.LOW_WATERMARK)))
            target = freed if target is None else min(target, freed)
        out = []
        for _, size, key in entries:
            if total <= target:
                break
            if key in shared or keep(key):
                continue
            path = self.path(key)
            try:
                path.unlink()
            except FileNotFoundError:  # another process evicted or invalidated it
                pass
            try:
                path.parent.rmdir()  # only when empty
            except OSError:
                pass
            total -= size
            out.append((key, size))
        with self._lock:
            self._bytes = total
        return out

    def evictable(self, keep: Callable[[str], bool]) -> int:
        """Bytes an eviction pass could remove (entries ``keep`` does not hold, nor the newest
        of a shared owner)."""
        entries = self.scan()
        shared = _newest_shared(entries)
        return sum(size for _, size, key in entries if key not in shared and not keep(key))

    def room(self) -> tuple[int, int] | None:
        """``(free, reserve)``: bytes free on the folder's file system and the bytes the pool
        keeps free there (:data:`MIN_FREE_SHARE`); ``None`` when the system cannot say."""
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            return None
        return usage.free, min(int(usage.total * MIN_FREE_SHARE), MIN_FREE_MAX_BYTES)

    def pin(self, keys: Sequence[str]) -> Path | None:
        """Tell every process that evicts from this folder that a request here will load
        ``keys``: a small file ``.pins/<pid>-<n>`` naming them, which :meth:`pinned_elsewhere`
        reads before an eviction pass. Returns it for :meth:`unpin` (``None`` when it could
        not be written: a full or read-only disk; the pin then holds in this process only)."""
        global _pin_count
        with _pin_lock:
            _pin_count += 1
            n = _pin_count
        path = self.root / _PINS / f"{os.getpid()}-{n}"
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, "\n".join(keys).encode())
            finally:
                os.close(fd)
        except OSError:
            return None
        return path

    @staticmethod
    def unpin(path: Path | None) -> None:
        """Remove a pin file :meth:`pin` wrote (gone already is fine)."""
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def pinned_elsewhere(self) -> set[str]:
        """Keys the requests in flight of every live process over this folder pinned
        (:meth:`pin`); a pin file of a process that is gone, or older than
        :data:`STALE_PIN_S`, is removed instead."""
        keys: set[str] = set()
        try:
            files = list(os.scandir(self.root / _PINS))
        except OSError:
            return keys
        wall = time.time()
        for f in files:
            try:
                pid = int(f.name.split("-", 1)[0])
                stale = wall - f.stat(follow_symlinks=False).st_mtime > STALE_PIN_S or not pid_alive(pid)
                if stale:
                    os.unlink(f.path)
                    continue
                with open(f.path, encoding="utf-8", errors="replace") as fh:
                    keys.update(fh.read().split())
            except (OSError, ValueError):  # unpinned meanwhile, or not a pin file
                continue
        return keys

    def full(self, need_bytes: int) -> bool:
        """Whether the folder's file system has fewer than ``need_bytes`` free (what a failed
        write is checked against: safetensors' error carries no errno)."""
        room = self.room()
        return room is not None and room[0] < need_bytes


def _newest_shared(entries: Sequence[tuple[float, int, str]]) -> set[str]:
    """The newest entry of each shared owner (a name starting with ``_``: the preamble) in
    :meth:`DiskTier.scan`'s order, lowest priority first: kept by every eviction."""
    return set({key.split("/")[0]: key for _, _, key in entries if key.startswith("_")}.values())


_pin_lock = threading.Lock()
_pin_count = 0


def used_priority(priority: float, now: float, half_life_s: float) -> float:
    """An entry's eviction priority after a use at ``now`` (seconds since the epoch), from its
    priority before (see the module docstring): ``H * log2(2^(p / H) + 2^(now / H))``.

    Computed as ``max + H * log2(1 + 2^(-|p - now| / H))`` so no power overflows; a first use
    of an entry written at ``now`` (priority ``now``) gives ``now + H`` (count 2).

    Raises:
        ValueError: ``half_life_s`` not positive.
    """
    if not half_life_s > 0:
        raise ValueError(f"the half-life is a positive number of seconds, got {half_life_s}")
    hi, lo = max(priority, now), min(priority, now)
    return hi + half_life_s * math.log2(1.0 + 2.0 ** ((lo - hi) / half_life_s))
