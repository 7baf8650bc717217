"""Per-call cost of ``add``, KV readiness, ``search`` and ``inject()`` at ~2,500 facts, the
embedder backends side by side, and large synthetic stores.

First, both embedder backends (sentence-transformers on torch, ONNX Runtime) embed every
LoCoMo conversation's facts and questions in this process: evidence recall@10 of each
(exact cosine top-10 within the conversation), how often their top-10s agree, and the
median time to embed one question. Then all 10 LoCoMo conversations are loaded (5,882 turns, one scope per conversation); the
first 2,500 observations are stored without KV. Then, per w in (0, 20), single-fact adds
of held-out observations are timed twice: until ``add`` returns (acknowledged: Chroma,
index, history and the durable KV job hold it) and until the fact's KV is encoded by the
background encoder (``wait_for_kv``). ``search`` (limit 10) is timed over LoCoMo
questions, and ``inject()`` (retrieval, layout, KV naming; no engine) over conv-26's
questions at k = 10 / 50 and w = 5 / 20 with every fact's KV encoded (steady state).
Last, :mod:`inferscale.bench.store_scale`: reopen time, resident set and first searches at
30,000 and 300,000 synthetic facts, and filtered search in a 20,000-fact scope.
Reproduce with ``inferscale bench memory-ops``.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

import numpy as np

from inferscale.bench import store_scale
from inferscale.config import DEFAULT_EMBEDDER
from inferscale.datasets.locomo import LocomoSample, load_locomo
from inferscale.models.embedding import Embedder
from inferscale.memory import Memory
from inferscale.models.resolve import resolve_embedder
from inferscale.types import FactInput


@dataclass(frozen=True)
class OpTiming:
    """Per-call wall time of one operation (milliseconds)."""

    op: str
    calls: int
    median_ms: float
    p90_ms: float
    mean_ms: float


def _summary(op: str, seconds: list[float]) -> OpTiming:
    ms = sorted(s * 1000 for s in seconds)
    return OpTiming(op, len(ms), statistics.median(ms), ms[min(len(ms) - 1, int(0.9 * len(ms)))], statistics.mean(ms))


def compare_embedders(samples: list[LocomoSample], embedder: str) -> list[dict]:
    """Evidence recall@10 and one-question embed time of each backend on every conversation.

    Returns:
        one dict per backend: ``backend``, ``questions`` (with evidence), ``recall_at_10``
        (mean share of a question's evidence turns that are a source turn of one of the
        top-10 facts), ``top10_agreement`` (share of questions whose top-10 ids equal the
        torch backend's, in order), ``embed_question_ms`` (median over questions).
    """
    source = resolve_embedder(embedder)
    rows, tops = [], {}
    for backend in ("torch", "onnx"):
        emb = Embedder(embedder, "cpu", source=source, backend=backend)
        emb.encode(["warm-up"])
        recalls, times, top = [], [], []
        for s in tqdm(samples, desc=f"embedder backend {backend}: LoCoMo recall@10"):
            facts = emb.encode([f.dated_text() for f in s.facts]).numpy()
            for qa in s.qa:
                t = time.perf_counter()
                q = emb.encode([qa.question])[0].numpy()
                times.append(time.perf_counter() - t)
                best = np.argsort(-(facts @ q), kind="stable")[:10]
                top.append(best.tolist())
                if qa.evidence:
                    found = {d for i in best for d in s.facts[i].dia_ids}
                    recalls.append(sum(e in found for e in qa.evidence) / len(qa.evidence))
        tops[backend] = top
        rows.append({"backend": backend, "questions": len(recalls), "recall_at_10": statistics.mean(recalls),
                     "embed_question_ms": statistics.median(times) * 1000})
    for row in rows:
        row["top10_agreement"] = statistics.mean(a == b for a, b in zip(tops["torch"], tops[row["backend"]]))
    return rows


def run(data: Path, out_dir: Path, *, stored: int = 2500, timed_adds: int = 20, searches: int = 100,
        inject_questions: int = 12, dtype: str = "auto", scale_sizes: tuple[int, ...] = (30_000, 300_000),
        ) -> list[OpTiming]:
    """Run the benchmark; writes ``memory_ops.json`` and ``memory_ops.md`` to ``out_dir``.

    Args:
        scale_sizes: synthetic store sizes for the reopen / filtered-search part (empty: skip it).
    """
    samples = load_locomo(data)
    facts = [(f"locomo-{s.sample_id}", f) for s in samples for f in s.facts]
    if len(facts) < stored + 2 * timed_adds:  # checked before the long parts start
        raise ValueError(f"--stored {stored} and --timed-adds {timed_adds} need {stored + 2 * timed_adds} facts; "
                         f"LoCoMo has {len(facts)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    backends = compare_embedders(samples, DEFAULT_EMBEDDER)
    rng = random.Random(0)
    rng.shuffle(facts)
    store_dir = out_dir / "memory-ops-store"
    shutil.rmtree(store_dir, ignore_errors=True)
    mem = Memory(data_dir=store_dir, dtype=dtype, context_window=0)
    for s in tqdm(samples, desc="log turns"):
        mem.log_turns([{"id": t.dia_id, "name": t.speaker, "content": t.text} for t in s.turns],
                      user_id=f"locomo-{s.sample_id}")
    t0 = time.perf_counter()
    by_user: dict[str, list[FactInput]] = {}
    for user, f in facts[:stored]:
        by_user.setdefault(user, []).append(FactInput(f.dated_text(), f.dia_ids))
    for user, batch in tqdm(by_user.items(), desc=f"store {stored} facts (embed + Chroma, no KV)"):
        mem.add_facts(batch, user_id=user, encode_kv=False)
    bulk_s = time.perf_counter() - t0

    results = []
    held_out = facts[stored:]
    mem.encode_preamble()
    for w, chunk in ((0, held_out[:timed_adds]), (20, held_out[timed_adds : 2 * timed_adds])):
        acked, ready = [], []
        for user, f in tqdm(chunk, desc=f"add, then KV ready, w={w}"):
            t = time.perf_counter()
            mem.add_facts([FactInput(f.dated_text(), f.dia_ids)], user_id=user, context_window=w)
            acked.append(time.perf_counter() - t)
            mem.wait_for_kv()
            ready.append(time.perf_counter() - t)
        results.append(_summary(f"add, acknowledged (w={w})", acked))
        results.append(_summary(f"add, until its KV is ready (w={w})", ready))
    questions = [(f"locomo-{s.sample_id}", q.question) for s in samples for q in s.qa]
    mem.search("warm-up", user_id=questions[0][0], limit=10)
    times = []
    for user, q in rng.sample(questions, searches):
        t = time.perf_counter()
        mem.search(q, user_id=user, limit=10)
        times.append(time.perf_counter() - t)
    results.append(_summary("search (limit 10)", times))

    conv = next(s for s in samples if s.sample_id == "conv-26")
    user = f"locomo-{conv.sample_id}"
    asked = [q.question for q in conv.qa[:inject_questions]]
    for w in (5, 20):
        for k in (10, 50):
            for q in tqdm(asked, desc=f"encode KV for inject(), k={k}, w={w}"):
                mem.inject(q, user_id=user, k=k, context_window=w, wait_for_kv=True)
            times = []
            for q in asked:
                t = time.perf_counter()
                inj = mem.inject(q, user_id=user, k=k, context_window=w)
                times.append(time.perf_counter() - t)
                assert not inj.text_memory_ids, "steady state: every fact's KV is encoded"
            results.append(_summary(f"inject() (k={k}, w={w})", times))

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"stored_facts": sum(mem.count(user_id=u) for u in {u for u, _ in facts}), "bulk_store_s": bulk_s,
            "dtype": mem.config.resolved_dtype, "device": str(mem.device),
            "embedder_backend": mem.components.embedder.backend_in_use}
    mem.close()
    shutil.rmtree(store_dir, ignore_errors=True)
    scale_dir = out_dir / "synthetic-store"
    shutil.rmtree(scale_dir, ignore_errors=True)
    scale = store_scale.run(scale_dir, list(scale_sizes)) if scale_sizes else []
    shutil.rmtree(scale_dir, ignore_errors=True)
    (out_dir / "memory_ops.json").write_text(json.dumps(
        {"meta": meta, "results": [asdict(r) for r in results], "embedder_backends": backends, "store_scale": scale},
        indent=2))
    (out_dir / "memory_ops.md").write_text(_markdown(meta, results, backends, scale))
    return results


def _markdown(meta: dict, results: list[OpTiming], backends: list[dict], scale: list[dict]) -> str:
    lines = [f"Stored facts: {meta['stored_facts']} (bulk store without KV: {meta['bulk_store_s']:.1f} s), dtype "
             f"{meta['dtype']}, device {meta['device']}, embedder backend {meta['embedder_backend']}.", "",
             "| operation | calls | median (ms) | p90 (ms) | mean (ms) |", "|---|---|---|---|---|"]
    lines += [f"| {r.op} | {r.calls} | {r.median_ms:.1f} | {r.p90_ms:.1f} | {r.mean_ms:.1f} |" for r in results]
    lines += ["", "Embedder backends on all LoCoMo conversations (exact top-10 within each conversation):", "",
              "| backend | questions with evidence | evidence recall@10 | top-10 equal to torch's | embed one question, "
              "median (ms) |", "|---|---|---|---|---|"]
    lines += [f"| {b['backend']} | {b['questions']} | {b['recall_at_10']:.4f} | {b['top10_agreement']:.3f} | "
              f"{b['embed_question_ms']:.2f} |" for b in backends]
    if scale:
        keys = [k for k in scale[0] if k not in ("facts",)]
        lines += ["", "Synthetic stores (fresh process each; see `inferscale/bench/store_scale.py`):", "",
                  "| measure | " + " | ".join(f"{s['facts']:,} facts" for s in scale) + " |",
                  "|---|" + "---|" * len(scale)]
        for k in keys:
            cells = []
            for s in scale:
                v = s[k]
                cells.append(f"{v / 2**20:.0f} MiB" if k.endswith("_bytes") else f"{v:.3f}" if k.endswith("_s")
                             else f"{v:.1f}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
