"""Where each memory's KV is, and how it was made: the report behind ``Memory.kv_entries``
and the page at ``/ui``.

A memory may have several KV entries (pool keys ``"<memory id>/<variant>"``, :func:`inferscale.kv.pool.kv_key`):
the one Context-Window Encoding made at the store's context window w, one a request captured
when it served the memory as text (:mod:`inferscale.kv.capture`), and leftovers of other
settings (another w, storage dtype, or turns since changed) until eviction or a switch removes
them. The report lists each entry found in this process's memory tiers, on disk, or (for the
two keys a request would use) in Redis, and reads the rest from the entry's file header
without loading its tensors.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from safetensors import safe_open

from inferscale.kv.disk import READ_ERRORS
from inferscale.kv.manager import KVManager
from inferscale.store.records import FactRecord

#: what ``made`` says of an entry whose key is neither of the two a request would use now
OTHER_SETTINGS = "encoded (another context window, storage dtype or turn log)"


def kv_entries(kv: KVManager, scope_key: str, records: Sequence[FactRecord], w: int) -> dict[str, list[dict]]:
    """Each memory's KV entries, by memory id.

    Args:
        kv: the store's KV manager (its pool, key naming and storage dtype).
        scope_key: the memories' scope. records: the memories. w: the context window (turns)
            a request uses by default (``MemoryConfig.context_window``).

    Returns:
        ``{memory id: [entry, ...]}``, the entry a request would use first; an entry is
        ``{"key", "made" ("encoded (w=5)", "captured", or :data:`OTHER_SETTINGS`), "in_use"
        (a request at w injects this one now), "tiers" (of "device", "host", "disk", "redis"),
        "storage" ("model", "int8", "int4"; ``None`` when only Redis holds it), "bytes" (the
        file's, else the in-memory tensors'; ``None`` when only Redis holds it), "tokens",
        "last_use" (ISO 8601 UTC: the file's last write or counted use, from its status-change
        time; ``None`` off disk)}``.
    """
    pool = kv.pool
    encoded = kv.fact_keys(scope_key, records, w)  # cached: a scope's thousand memories read fast again
    captured = kv.captured_keys(records)
    wanted = [key for pair in zip(encoded, captured) for key in pair]
    in_redis = pool.remote.present(wanted) if pool.remote is not None else set()
    out: dict[str, list[dict]] = {}
    for record, ekey, ckey in zip(records, encoded, captured):
        held = pool.held(record.id)
        folder = pool.disk.root / record.id
        files = {f"{record.id}/{p.stem}": p for p in sorted(folder.glob("*.safetensors"))} if folder.is_dir() else {}
        keys = list(dict.fromkeys([*(k for k in (ekey, ckey) if k in files or k in held or k in in_redis),
                                   *files, *held]))
        use = ekey if ekey in keys else ckey if ckey in keys else None
        entries = []
        for key in keys:
            made = f"encoded (w={w})" if key == ekey else "captured" if key == ckey else OTHER_SETTINGS
            tiers = [held[key][0]] if key in held else []
            entry = {"key": key, "made": made, "in_use": key == use, "tiers": tiers, "storage": None, "bytes": None,
                     "tokens": None, "last_use": None}
            if key in held:
                stored = held[key][1]
                entry.update(storage=getattr(stored, "dtype", "model"), bytes=stored.nbytes, tokens=stored.num_tokens)
            if key in files and (header := _file_header(files[key])) is not None:
                tiers.append("disk")
                entry.update(header)
            if key in in_redis:
                tiers.append("redis")
            if tiers:
                entries.append(entry)
        out[record.id] = sorted(entries, key=lambda e: not e["in_use"])
    return out


def _file_header(path: Path) -> dict | None:
    """Storage dtype, tokens, bytes and last use of one entry file; ``None`` when it cannot be
    read (being replaced, or evicted since the folder was listed)."""
    try:
        stat = path.stat()
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tokens = f.get_slice("token_ids").get_shape()[0] if "token_ids" in f.keys() else None
    except READ_ERRORS:
        return None
    return {"storage": meta.get("storage", "model"), "bytes": stat.st_size, "tokens": tokens,
            "last_use": datetime.fromtimestamp(stat.st_ctime, timezone.utc).isoformat()}
