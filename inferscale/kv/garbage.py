"""KV files no longer served are collected when a data dir is opened (issue 53, item 3).

A fact's KV file is named by a hash of everything it depends on (the model's fingerprint, the
dtype, the storage dtype, w, the tokens: :func:`inferscale.kv.pool.kv_key`), so KV made for a
model, a dtype or a storage dtype the data dir no longer serves is never read again, and without
a disk budget nothing ever removed it. ``<kv_dir>/served.json`` says what the folder was last
opened to serve (``{"fingerprint", "dtype", "storage"}``); the first ``Memory`` of a process
over the folder compares it with its own settings and, on a change:

- **another model or dtype**: every entry file is removed (none can be served: its key names
  the old fingerprint or dtype); pins of requests in flight stay;
- **another storage dtype**: the files of a storage no longer served are removed: quantized
  files (int8, int4) when the folder now serves the model's dtype, the other quantized dtype's
  when it serves int8 or int4. Files in the model's dtype stay under a quantized storage: each
  is the source its memory's int8 / int4 KV is made from without an encode, and the write of
  that replaces it (:meth:`inferscale.kv.manager.KVManager.drop_other_variants`).

A folder with no ``served.json`` (written before this) is only given one: its files are of
unknown settings, and are left. Stale temporary files and pins of dead processes are the disk
tier's own scans' (:class:`~inferscale.kv.disk.DiskTier`); spools in ``/dev/shm`` the capture
writer's (:func:`inferscale.kv.capture_writer.remove_dead_spools`). What was removed is said in
one line (:func:`inferscale.runtime.progress.notice`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import safe_open

from inferscale.kv.disk import DiskTier
from inferscale.runtime.progress import notice

#: the file naming what the folder was last opened to serve
SERVED = "served.json"


@dataclass(frozen=True)
class Served:
    """What a KV folder serves: the model's fingerprint
    (:func:`inferscale.models.resolve.model_fingerprint`), its dtype name and ``kv_storage_dtype``."""

    fingerprint: str
    dtype: str
    storage: str


def read_served(kv_dir: Path) -> Served | None:
    """The folder's ``served.json`` (``None`` when missing or unreadable)."""
    try:
        return Served(**json.loads((kv_dir / SERVED).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_served(kv_dir: Path, served: Served) -> None:
    """Write ``served.json`` atomically (a temporary file renamed into place)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-served-", dir=kv_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(served), f)
    os.replace(tmp, kv_dir / SERVED)


def file_storage(path: Path) -> str | None:
    """The storage a KV file says it holds (``"model"``, ``"int8"``, ``"int4"``; files written
    before the field: ``"model"``), ``None`` when it cannot be read (gone meanwhile, damaged)."""
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("storage", "model")
    except Exception:  # noqa: BLE001 - safetensors raises its own errors on a damaged header
        return None


def collect(disk: DiskTier, served: Served) -> int:
    """Remove the entries of ``disk`` that ``served`` cannot serve (module docstring), record
    ``served`` in the folder, and log one line when anything was removed.

    Returns:
        Entry files removed.
    """
    before = read_served(disk.root)
    removed = 0
    if before is not None and (before.fingerprint, before.dtype) != (served.fingerprint, served.dtype):
        removed = len(disk.scan())
        disk.clear()
        why = "another model" if before.fingerprint != served.fingerprint else f"dtype {before.dtype}"
    elif before is not None and before.storage != served.storage:
        kept = {"model"} if served.storage == "auto" else {"model", served.storage}
        for _, _, key in disk.scan():
            storage = file_storage(disk.path(key))
            if storage is not None and storage not in kept:
                disk.remove(key)
                removed += 1
        why = f"kv_storage_dtype {before.storage}"
    if before != served:
        try:
            write_served(disk.root, served)
        except OSError:  # a read-only folder: nothing is written there anyway; the next open tries again
            pass
    if removed:
        notice("removed %d KV file(s) of %s from %s: it now serves %s KV stored as %s", removed, why, disk.root,
               served.dtype, served.storage)
    return removed
