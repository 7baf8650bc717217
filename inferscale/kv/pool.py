"""The KV pool: precomputed fact KV on the device (LRU, byte budget) and on disk.

Layout of one entry (a :class:`FactKV`):
    keys:      ``[num_layers, num_tokens, num_kv_heads, head_dim]`` pre-RoPE keys
    values:    ``[num_layers, num_tokens, num_kv_heads, head_dim]``
    token_ids: ``[num_tokens]`` int64, the tokens the KV was encoded from
in the served model's dtype (token ids aside). Per layer this is exactly the ``[num_tokens, num_kv_heads,
head_size]`` that vLLM's ``do_kv_cache_update`` takes. An entry may instead be stored in 8 or
4 bits (a :class:`~inferscale.kv.quant.QuantizedKV`, made by :func:`to_storage`): its codes
and scales are what the disk and device tiers hold, and its ``keys`` / ``values`` are
dequantized on access, so readers see the same ``[num_layers, num_tokens, ...]`` tensors.

Keys (:func:`kv_key`) are ``"<owner>/<variant>"``: ``owner`` is the fact id (or
``_preamble``), ``variant`` a hash of everything the KV depends on (model fingerprint,
dtype, context window w, template, the fact's text and its context tokens). The disk
tier stores ``<root>/<owner>/<variant>.safetensors`` (format ``inferscale-kv-2``: the
token ids are stored with the KV, so the connector injects a segment only where the
prompt holds those very tokens; metadata ``storage`` names ``model`` or the quantized
dtype, whose codes and scales replace ``keys`` and ``values``), so invalidating a fact removes one
folder. Writes go to a temporary file renamed into place: a crash leaves no partial
entry. One pool object exists per root folder and process (:meth:`KVPool.shared`), so
every user of a folder in a process shares its device tier; another process (vLLM's
engine core, where the connector runs) reads the disk tier and keeps a device tier of its own.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from inferscale.kv import quant
from inferscale.kv.quant import QuantizedKV

_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}/[0-9a-f]{32}$")


@dataclass(frozen=True)
class FactKV:
    """Pre-RoPE keys and values of one token span, all layers.

    Attributes:
        keys: ``[num_layers, num_tokens, num_kv_heads, head_dim]``.
        values: same shape as ``keys``.
        token_ids: the span's ``num_tokens`` token ids (``None``: unknown, so the connector
            never injects the entry).
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        """Size in bytes of keys plus values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def to(self, device: torch.device | str) -> "FactKV":
        return FactKV(self.keys.to(device), self.values.to(device), self.token_ids)


#: What a pool entry is: dense KV in the model's dtype, or its 8- or 4-bit codes.
StoredKV = FactKV | QuantizedKV


def to_storage(kv: FactKV, storage: str) -> StoredKV:
    """``kv`` as the pool should hold it under the ``kv_storage_dtype`` setting ``storage``.

    Args:
        kv: dense KV (``[num_layers, num_tokens, num_kv_heads, head_dim]`` keys and values).
        storage: ``"auto"`` (kept as it is) or one of :data:`inferscale.kv.quant.QUANTIZED_DTYPES`.

    Raises:
        ValueError: another ``storage`` (see :func:`inferscale.kv.quant.quantize`).
    """
    if storage == "auto":
        return kv
    return quant.quantize(kv.keys, kv.values, storage, token_ids=kv.token_ids)


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


class KVPool:
    """Two-tier store of :class:`FactKV` and :class:`~inferscale.kv.quant.QuantizedKV` entries
    (:data:`StoredKV`): device LRU over a disk tier.

    Args:
        root: disk-tier folder (created when missing).
        device: where the device tier lives (``cuda`` when present, else ``cpu``).
        device_budget_bytes: bytes kept in the device tier; least recently used entries
            are dropped from it (they stay on disk).

    Thread-safe.
    """

    _registry: dict[Path, "KVPool"] = {}
    _registry_lock = threading.Lock()

    def __init__(self, root: Path, device: torch.device | str, device_budget_bytes: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        self.device_budget_bytes = int(device_budget_bytes)
        self._hot: OrderedDict[str, StoredKV] = OrderedDict()
        self._hot_bytes = 0
        self._lock = threading.RLock()
        self.stats = {"device_hits": 0, "disk_hits": 0, "misses": 0, "writes": 0}

    @classmethod
    def shared(cls, root: Path, device: torch.device | str, device_budget_bytes: int) -> "KVPool":
        """The process-wide pool for ``root`` (created on first use).

        Every caller in a process shares one device tier per folder, so invalidations
        reach all of them.

        Raises:
            ValueError: the pool for ``root`` exists with another device or budget (the
                second caller's settings would be silently ignored otherwise).
        """
        key = Path(root).resolve()
        key.mkdir(parents=True, exist_ok=True)  # also fails loudly if the folder became a file
        with cls._registry_lock:
            pool = cls._registry.get(key)
            if pool is None:
                pool = cls(key, device, device_budget_bytes)
                cls._registry[key] = pool
            elif pool.device != torch.device(device) or pool.device_budget_bytes != int(device_budget_bytes):
                raise ValueError(
                    f"the KV pool at {key} is already open in this process on {pool.device} with a device budget "
                    f"of {pool.device_budget_bytes} bytes; open it with the same settings (asked: {device}, "
                    f"{device_budget_bytes} bytes)"
                )
            return pool

    def _path(self, key: str) -> Path:
        owner, variant = validate_key(key).split("/")
        return self.root / owner / f"{variant}.safetensors"

    def _remember(self, key: str, kv: StoredKV) -> None:
        old = self._hot.pop(key, None)
        if old is not None:
            self._hot_bytes -= old.nbytes
        if kv.nbytes > self.device_budget_bytes:
            return
        self._hot[key] = kv
        self._hot_bytes += kv.nbytes
        while self._hot_bytes > self.device_budget_bytes:
            _, old = self._hot.popitem(last=False)
            self._hot_bytes -= old.nbytes

    def put(self, key: str, kv: StoredKV) -> None:
        """Store ``kv`` under ``key`` on disk (atomically) and in the device tier, as it is
        (dense, or the codes of a :class:`~inferscale.kv.quant.QuantizedKV`).

        Raises:
            ValueError: ``key`` is malformed, or ``kv.token_ids`` has another length than the KV.
        """
        path = self._path(key)
        if kv.token_ids is not None and len(kv.token_ids) != kv.num_tokens:
            raise ValueError(f"{len(kv.token_ids)} token ids for KV of {kv.num_tokens} tokens")
        if isinstance(kv, QuantizedKV):
            tensors, meta = quant.to_tensors(kv)
        else:
            tensors = {"keys": kv.keys.detach().contiguous().cpu(), "values": kv.values.detach().contiguous().cpu()}
            meta = {"storage": "model"}
        if kv.token_ids is not None:
            tensors["token_ids"] = torch.tensor(kv.token_ids, dtype=torch.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "inferscale-kv-2", "layout": "layers,tokens,kv_heads,head_dim",
                                              **meta})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        with self._lock:
            self._remember(key, kv.to(self.device))
            self.stats["writes"] += 1

    def get(self, key: str) -> StoredKV | None:
        """The entry for ``key`` on the pool's device, or ``None`` when absent or unreadable.

        A quantized entry comes back quantized (:class:`~inferscale.kv.quant.QuantizedKV`:
        its ``keys`` and ``values`` dequantize on access)."""
        with self._lock:
            kv = self._hot.get(key)
            if kv is not None:
                self._hot.move_to_end(key)
                self.stats["device_hits"] += 1
                return kv
        path = self._path(key)
        try:
            kv = _read(path).to(self.device)
        except (FileNotFoundError, SafetensorError, KeyError, OSError, ValueError):
            with self._lock:
                self.stats["misses"] += 1
            return None
        with self._lock:
            self._remember(key, kv)
            self.stats["disk_hits"] += 1
        return kv

    def token_ids(self, key: str) -> tuple[int, ...] | None:
        """The tokens ``key``'s KV was encoded from, read without loading the KV (``None`` when
        the entry is absent, unreadable or has no token ids)."""
        with self._lock:
            kv = self._hot.get(key)
        if kv is not None:
            return kv.token_ids
        try:
            with safe_open(self._path(key), framework="pt", device="cpu") as f:
                if "token_ids" not in f.keys():
                    return None
                return tuple(f.get_tensor("token_ids").tolist())
        except (FileNotFoundError, SafetensorError, OSError, ValueError):
            return None

    def contains(self, key: str) -> bool:
        """Whether ``key`` is in the device tier or on disk (no load)."""
        with self._lock:
            if key in self._hot:
                return True
        return self._path(key).exists()

    def remove(self, key: str) -> None:
        """Drop one entry from the device tier and disk (absent is fine)."""
        with self._lock:
            old = self._hot.pop(key, None)
            if old is not None:
                self._hot_bytes -= old.nbytes
        self._path(key).unlink(missing_ok=True)

    def invalidate_owner(self, owner: str) -> None:
        """Drop every entry of ``owner`` (a fact id) from the device tier and disk."""
        prefix = f"{owner}/"
        with self._lock:
            for key in [k for k in self._hot if k.startswith(prefix)]:
                self._hot_bytes -= self._hot.pop(key).nbytes
        shutil.rmtree(self.root / owner, ignore_errors=True)

    def clear(self) -> None:
        """Drop every entry from the device tier and disk."""
        with self._lock:
            self._hot.clear()
            self._hot_bytes = 0
        for child in self.root.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)

    def footprint(self) -> dict[str, int]:
        """Bytes held: ``{"device": ..., "disk": ...}``."""
        with self._lock:
            device = self._hot_bytes
        disk = sum(p.stat().st_size for p in self.root.rglob("*.safetensors"))
        return {"device": device, "disk": disk}


def _read(path: Path) -> StoredKV:
    """One entry from its safetensors file, on the CPU.

    Raises:
        FileNotFoundError, OSError, SafetensorError: unreadable. KeyError, ValueError: a
            tensor or metadata field missing or unknown.
    """
    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    ids = tensors.pop("token_ids", None)
    token_ids = None if ids is None else tuple(ids.tolist())
    if meta.get("storage", "model") == "model":
        return FactKV(tensors["keys"], tensors["values"], token_ids)
    return quant.from_tensors(tensors, meta, token_ids)
