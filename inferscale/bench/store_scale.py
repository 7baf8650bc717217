"""Large synthetic stores: reopen time and memory flat in store size, filtered search at 20k.

A store of N synthetic facts is written straight to Chroma (random unit embeddings, no
KV): one scope of ``big`` facts (20,000 by default) and the rest in scopes of 100. Every
fact has metadata ``{"topic": "t0".."t9", "n": 0..6}``. Then, in a fresh process each
time (so nothing is warm and the resident set is the reopened store's own):

- ``Memory(data_dir)`` is timed (reopen; after importing chromadb and transformers, which
  costs seconds and is the same for any store), with the process's resident set after it
  (``VmRSS``) and at the end, when the big scope's partition is loaded;
- the first search of all, in an empty scope (it loads the embedder, and Chroma loads its
  own HNSW segment on the collection's first read, which grows with the store: a cost of
  embedded Chroma that a Chroma server pays once at its own start);
- the first search of a 100-fact scope (its partition loads) and of the big scope;
- searches of the big scope, unfiltered and filtered (``topic == "t3"``, 10% of it, and
  ``{"$and": [{"topic": {"$in": ["t1", "t2"]}}, {"n": {"$gte": 3}}]}``), medians of 30.

Used by ``inferscale bench memory-ops``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from tqdm import tqdm

from inferscale.store.chroma import FactStore


from inferscale.store.records import FactRecord, Scope
BIG_SCOPE = "synthetic-big"
_FILTERS = {
    "topic == t3 (10%)": {"topic": "t3"},
    "topic in [t1,t2] and n >= 3 (9%)": {"$and": [{"topic": {"$in": ["t1", "t2"]}}, {"n": {"$gte": 3}}]},
}

_PROBE = r"""
import json, statistics, sys, time
def rss():  # this process's resident set now (bytes); ru_maxrss would include the forking parent's
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
t0 = time.perf_counter()
import chromadb, transformers
from transformers import AutoTokenizer
from inferscale import Memory
imported = time.perf_counter() - t0
t = time.perf_counter()
mem = Memory(data_dir=sys.argv[1], dtype="float32", precompute_kv=False)
reopen = time.perf_counter() - t
rss_reopen = rss()
def timed(**kw):
    t = time.perf_counter(); mem.search("What does the user like to eat?", limit=10, **kw); return time.perf_counter() - t
out = {"import_s": imported, "reopen_s": reopen, "rss_after_reopen_bytes": rss_reopen,
       "first_search_empty_scope_s": timed(user_id="nobody"),
       "first_search_small_scope_s": timed(user_id="synthetic-0"),
       "first_search_big_scope_s": timed(user_id=sys.argv[2])}
out["search_big_scope_ms"] = statistics.median(timed(user_id=sys.argv[2]) for _ in range(30)) * 1000
for name, flt in json.loads(sys.argv[3]).items():
    out[f"filtered search big scope, {name} ms"] = statistics.median(
        timed(user_id=sys.argv[2], filters=flt) for _ in range(30)) * 1000
out["rss_end_bytes"] = rss()
out["facts"] = mem.components.store.count()
print("RESULT " + json.dumps(out))
"""


def write_synthetic(path: Path, total: int, big: int = 20_000, dim: int = 384, seed: int = 0) -> int:
    """Grow the store at ``path`` to ``total`` synthetic facts (see the module docstring);
    returns how many were written now. Batches of 5,000 (under Chroma's batch limit).

    Raises:
        ValueError: ``total`` smaller than ``big``.
    """
    if total < big:
        raise ValueError(f"total ({total}) must be at least the big scope's size ({big})")
    store = FactStore(path / "chroma")
    have = store.count()
    rng = np.random.default_rng(seed + have)
    written = 0
    with tqdm(total=total - have, desc=f"write synthetic facts to {total}") as bar:
        for start in range(have, total, 5000):
            n = min(5000, total - start)
            records = []
            for i in range(start, start + n):
                scope = Scope(BIG_SCOPE) if i < big else Scope(f"synthetic-{(i - big) // 100}")
                records.append(FactRecord(uuid.uuid4().hex, f"synthetic fact {i}", f"{i:064x}", scope, (),
                                          {"topic": f"t{i % 10}", "n": i % 7}, "2026-01-01T00:00:00+00:00",
                                          "2026-01-01T00:00:00+00:00"))
            emb = rng.standard_normal((n, dim)).astype(np.float32)
            store.add(records, emb / np.linalg.norm(emb, axis=1, keepdims=True))
            written += n
            bar.update(n)
    return written


def probe(path: Path) -> dict:
    """Reopen the store at ``path`` in a fresh process and time it (see the module docstring).

    Raises:
        RuntimeError: the probe process failed (its output is in the message).
    """
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(path), BIG_SCOPE, json.dumps(_FILTERS)],
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"the reopen probe failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run(path: Path, sizes: list[int]) -> list[dict]:
    """Write the store up to each of ``sizes`` (ascending) and probe it; returns one dict per size."""
    results = []
    for total in sorted(sizes):
        t = time.perf_counter()
        write_synthetic(path, total)
        res = probe(path)
        res["write_s"] = time.perf_counter() - t
        results.append(res)
    return results
