"""Retrieval quality and latency: dense vs hybrid search on LoCoMo, side by side, one process.

For every LoCoMo conversation, its observations are stored as facts (KV off: retrieval
only) in one scope of a fresh store, and every question with evidence is searched in
both modes through :meth:`inferscale.Memory.search`:

- rankings :data:`MODES`: ``dense``, ``hybrid-fact``, ``hybrid-source`` (earlier defaults),
  ``hybrid-turns`` (the product's without its date ranking), rebuilt here side by side, and
  ``hybrid`` (the product's);
- **evidence recall@k**: the share of a question's evidence turns that are a source turn
  of one of the top-k facts; **hit@k**: whether at least one is (k = 5, 10, 20, 50, 100);
- the **fusion constant** of :func:`inferscale.store.keyword.fuse` and the **turn-neighbour**
  settings of :func:`inferscale.store.keyword.turn_neighbor_bonus`, chosen on conversations 0-2
  only (recall@10 for c in :data:`TUNE_C`, for :data:`TUNE_NEIGHBORS`); conversations 3-9 are
  reported as held out;
- **search latency** (median of timed searches, query embedding included, the two modes
  alternating query by query) at one
  conversation and in one scope of 10,000 then 20,000 facts (LoCoMo's facts repeated, each copy
  numbered so texts stay distinct, each with a logged source turn), and the index's search
  alone (the query embedded beforehand) there, unfiltered and filtered.

Writes ``retrieval.json``, ``retrieval.md`` and ``retrieval.png`` to the output folder.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from inferscale.config import DEFAULT_EMBEDDER
from inferscale.datasets.locomo import LocomoSample, load_locomo, store_conversation
from inferscale.store.keyword import (NEIGHBOR_SHARE, NEIGHBOR_TURNS, RRF_C, KeywordIndex, fuse, fused_scores,
                                      top_rows, turn_neighbor_bonus)
from inferscale.types import FactInput

KS = (5, 10, 20, 50, 100)
#: rankings compared: cosine alone; cosine fused with BM25 over each fact's own text; the
#: same with BM25 over the fact's text and its source turns' (the default until stop 47); and
#: ``hybrid-turns``: BM25 also over the turn before each source turn, plus the turn-neighbour
#: bonus; and the product's hybrid: that, plus the date ranking of a query naming a month or year
MODES = ("dense", "hybrid-fact", "hybrid-source", "hybrid-turns", "hybrid")
#: the categories the issue's target counts (5, adversarial, asks about what was never said)
ANSWERABLE = (1, 2, 3, 4)
TUNE_C = (1, 2, 5, 10, 20, 60)
#: turn-neighbour settings tried on the tuning conversations: (share, reach in turns)
TUNE_NEIGHBORS = tuple((share, reach) for share in (0.0, 0.2, 0.35, 0.5) for reach in (2.0, 4.0, 8.0))
TUNE_CONVERSATIONS = (0, 1, 2)
#: held-out evidence recall@10 on categories 1-4 when issue 43 was filed (2026-12-05)
ISSUE_43_BASELINE = 0.632


def _recall(sample: LocomoSample, ids: list[str], evidence: tuple[str, ...], by_id: dict) -> tuple[float, bool]:
    found = {d for i in ids for d in by_id[i]}
    hits = sum(e in found for e in evidence)
    return hits / len(evidence), hits > 0


def _conversation(memory, sample: LocomoSample, user: str) -> dict:
    """Recall@k and hit@k per mode, and recall@10 per fusion constant, for one conversation."""
    from inferscale.store.records import Scope

    store_conversation(memory, sample, user)
    records = memory.get_all(user_id=user, limit=100_000)["results"]
    by_id = {r["id"]: r["source_turn_ids"] for r in records}
    questions = [qa for qa in sample.qa if qa.evidence]
    out = {"sample": sample.sample_id, "facts": len(records), "questions": len(questions),
           "categories": [qa.category for qa in questions],
           "recall": {m: {k: [] for k in KS} for m in MODES}, "hit": {m: {k: [] for k in KS} for m in MODES},
           "tune_recall_at_10": {c: [] for c in TUNE_C},
           # the most any ranking can find: the share of each question's evidence turns that
           # are a source turn of some memory of the scope (recall@k as k grows to every memory)
           "ceiling": [sum(e in {d for r in records for d in r["source_turn_ids"]} for e in qa.evidence)
                       / len(qa.evidence) for qa in questions],
           "tune_neighbors_recall_at_10": {f"{a}/{d}": [] for a, d in TUNE_NEIGHBORS}}
    texts = [r["memory"] for r in records]
    fact_only = KeywordIndex(texts)  # what hybrid search indexed before keyword_turns
    facts_in_order = memory.components.facts.list(Scope(user))
    assert [f.id for f in facts_in_order] == [r["id"] for r in records]
    turns = {t.dia_id: t.text for t in sample.turns}
    source_only = KeywordIndex([" ".join([r["memory"], *(turns[t] for t in r["source_turn_ids"] if t in turns)])
                                for r in records])  # the default until stop 47
    docs, positions = memory.components.turns.keyword_docs(Scope(user).key, facts_in_order)
    expanded, positions = KeywordIndex(docs), np.asarray(positions, dtype=np.float64)
    placed = np.flatnonzero(np.isfinite(positions))
    placed = placed[np.argsort(positions[placed], kind="stable")]
    facts = memory.embed(texts).numpy()
    for qa in questions:
        dense = facts @ memory.embed([qa.question])[0].numpy()
        ranked = {mode: [r["id"] for r in memory.search(qa.question, user_id=user, limit=max(KS), mode=mode)["results"]]
                  for mode in ("dense", "hybrid")}
        ranked["hybrid-fact"] = [records[i]["id"] for i in fuse(dense, fact_only.scores(qa.question), max(KS))]
        ranked["hybrid-source"] = [records[i]["id"] for i in fuse(dense, source_only.scores(qa.question), max(KS))]
        turned = fused_scores(dense, expanded.scores(qa.question))
        turned += turn_neighbor_bonus(turned, positions, placed)
        ranked["hybrid-turns"] = [records[i]["id"] for i in top_rows(turned, dense, max(KS))]
        for mode in MODES:
            for k in KS:
                recall, hit = _recall(sample, ranked[mode][:k], qa.evidence, by_id)
                out["recall"][mode][k].append(recall)
                out["hit"][mode][k].append(hit)
        scores = expanded.scores(qa.question)
        for c in TUNE_C:
            fused = fused_scores(dense, scores, c)
            top = top_rows(fused + turn_neighbor_bonus(fused, positions, placed), dense, 10)
            out["tune_recall_at_10"][c].append(_recall(sample, [records[i]["id"] for i in top], qa.evidence, by_id)[0])
        fused = fused_scores(dense, scores)
        for share, reach in TUNE_NEIGHBORS:
            top = top_rows(fused + turn_neighbor_bonus(fused, positions, placed, share=share, reach=reach), dense, 10)
            out["tune_neighbors_recall_at_10"][f"{share}/{reach}"].append(
                _recall(sample, [records[i]["id"] for i in top], qa.evidence, by_id)[0])
    return out


def _medians(calls: dict, queries: list[str], repeats: int) -> dict[str, float]:
    """Median time (ms) of each of ``calls`` (name -> ``f(i, query)``) over ``repeats`` passes of
    ``queries`` (one warm-up pass); the calls alternate query by query, so all see the same
    machine state."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats + 1):
        for i, q in enumerate(queries):
            for name in (names if (i + rep) % 2 == 0 else names[::-1]):
                t = time.perf_counter()
                calls[name](i, q)
                if rep:
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1000 for name, v in times.items()}


def _timed(memory, user: str, queries: list[str], repeats: int) -> dict[str, float]:
    """Median search time (ms) per mode of :meth:`inferscale.Memory.search` (query embedding included)."""
    return _medians({mode: lambda i, q, mode=mode: memory.search(q, user_id=user, limit=10, mode=mode)
                     for mode in ("dense", "hybrid")}, queries, repeats)


def _timed_index(memory, user: str, queries: list[str], repeats: int, filters: dict | None = None) -> dict[str, float]:
    """Median time (ms) of the index's top-10 search alone, the queries embedded beforehand
    (what search costs beyond its one query embedding), per mode; ``filters`` as
    :meth:`inferscale.Memory.search` takes them."""
    from inferscale.store.filters import compile_filter
    from inferscale.store.records import Scope

    key, index = Scope(user).key, memory.components.facts.index
    where = None if filters is None else compile_filter(filters)
    vectors = memory.embed(queries)
    return _medians({"dense": lambda i, q: index.search(key, vectors[i], 10, where=where),
                     "hybrid": lambda i, q: index.search(key, vectors[i], 10, where=where, keyword_query=q)},
                    queries, repeats)


def _timed_embedding(memory, queries: list[str], repeats: int) -> float:
    """Median time (ms) to embed one query."""
    return _medians({"embed": lambda i, q: memory.embed([q])}, queries, repeats)["embed"]


def _big_scope(memory, samples: list[LocomoSample], user: str, size: int) -> None:
    """One scope of ``size`` facts: LoCoMo's observations repeated, each copy numbered, each
    drawn from a turn of its own (its observation's first source turn, logged again), so
    hybrid search reads source turns and turn positions as it does on a conversation; each
    has metadata ``topic`` ``t0``..``t9`` (fact ``i`` has ``t{i % 10}``) for filtered search."""
    base = []
    for s in samples:
        turns = {t.dia_id: t.text for t in s.turns}
        base += [(f.dated_text(), next((turns[d] for d in f.dia_ids if d in turns), f.text)) for f in s.facts]
    have = memory.count(user_id=user)  # grown from what it holds: facts are numbered, so texts stay distinct
    for start in tqdm(range(have, size, 256), desc=f"storing facts up to {size:,}", leave=False):
        batch = range(start, min(size, start + 256))
        memory.log_turns([{"id": f"big{i}", "content": base[i % len(base)][1]} for i in batch], user_id=user)
        memory.add_facts([FactInput(f"{base[i % len(base)][0]} (copy {i // len(base)})", (f"big{i}",),
                                    {"topic": f"t{i % 10}"}) for i in batch], user_id=user)


def run(data: Path, out_dir: Path, *, big: int = 20_000, latency_queries: int = 50, repeats: int = 3,
        store: Path | None = None, embedder: str = DEFAULT_EMBEDDER) -> dict:
    """Run the benchmark (see the module docstring); returns what ``retrieval.json`` holds.

    Args:
        data: locomo10.json. out_dir: results folder.
        big: facts in the large scope timed for latency (0: skip).
        latency_queries: LoCoMo questions timed per mode; repeats: timed passes over them.
        store: the benchmark's memory store (default: ``out_dir/retrieval-store``, deleted
            at the end).
        embedder: the embedder measured (:class:`inferscale.Config`'s ``embedder``).
    """
    from inferscale import Memory

    samples = load_locomo(data)
    own_store = store is None
    store = store or out_dir / "retrieval-store"
    memory = Memory(data_dir=store, dtype="float32", precompute_kv=False, embedder=embedder)
    try:
        convs = [_conversation(memory, s, f"retrieval-{s.sample_id}") for s in tqdm(samples, desc="conversations")]
        queries = [qa.question for qa in samples[0].qa[:latency_queries]]
        latency = {"one conversation": {"facts": convs[0]["facts"],
                                        **_timed(memory, f"retrieval-{samples[0].sample_id}", queries, repeats)}}
        index_latency = {}
        for size in (big // 2, big) if big else ():  # the scope grown in two steps: half, then all
            _big_scope(memory, samples, "retrieval-big", size)
            latency[f"{size:,} facts"] = {"facts": size, **_timed(memory, "retrieval-big", queries, repeats)}
            index_latency[f"{size:,} facts"] = {"facts": size,
                                                **_timed_index(memory, "retrieval-big", queries, repeats)}
        if big:
            index_latency[f"{big:,} facts, filter topic == t3 (10%)"] = {
                "facts": big, **_timed_index(memory, "retrieval-big", queries, repeats, {"topic": "t3"})}
        embed_ms = _timed_embedding(memory, queries, repeats)
    finally:
        memory.close()
        if own_store:
            shutil.rmtree(store, ignore_errors=True)
    from inferscale.bench.common import machine

    result = {**_summarize(convs, latency), "machine": machine(), "embedder": embedder, "embed_query_ms": embed_ms,
              "index_latency_ms": index_latency}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "retrieval.json").write_text(json.dumps(result, indent=2))
    (out_dir / "retrieval.md").write_text(_markdown(result))
    _plot(result, out_dir / "retrieval.png")
    return result


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def _summarize(convs: list[dict], latency: dict) -> dict:
    held = [c for i, c in enumerate(convs) if i not in TUNE_CONVERSATIONS]
    tune = [c for i, c in enumerate(convs) if i in TUNE_CONVERSATIONS]

    def pooled(group: list[dict], what: str, mode: str, categories=None) -> dict:
        return {k: _mean([v for c in group for v, cat in zip(c[what][mode][k], c["categories"])
                          if categories is None or cat in categories]) for k in KS}

    return {
        "ks": list(KS), "rrf_c": RRF_C,
        "tuning": {"conversations": [c["sample"] for c in tune],
                   "recall_at_10": {c: _mean([v for conv in tune for v in conv["tune_recall_at_10"][c]])
                                    for c in TUNE_C},
                   "neighbors_recall_at_10": {
                       key: _mean([v for conv in tune for v in conv["tune_neighbors_recall_at_10"][key]])
                       for key in tune[0]["tune_neighbors_recall_at_10"]} if tune else {},
                   "neighbors_used": f"{NEIGHBOR_SHARE}/{NEIGHBOR_TURNS}"},
        "held_out": {"conversations": [c["sample"] for c in held], "questions": sum(c["questions"] for c in held),
                     "questions_1_4": sum(cat in ANSWERABLE for c in held for cat in c["categories"]),
                     **{f"{what}_{mode}": pooled(held, what, mode) for what in ("recall", "hit") for mode in MODES},
                     **{f"recall_{mode}_1_4": pooled(held, "recall", mode, ANSWERABLE) for mode in MODES}},
        "per_conversation": [{"sample": c["sample"], "facts": c["facts"], "questions": c["questions"],
                              "held_out": i not in TUNE_CONVERSATIONS,
                              **{f"recall_at_10_{m}": _mean(c["recall"][m][10]) for m in MODES}}
                             for i, c in enumerate(convs)],
        "latency_ms": latency,
        "intervals_1_4": _intervals(held),
    }


def _intervals(held: list[dict]) -> dict:
    """Held-out recall@10 on categories 1-4: the ceiling, each mode's mean with its 95%
    bootstrap interval over questions, and ``hybrid`` minus each other mode, paired by question
    (:func:`inferscale.bench.common.bootstrap`)."""
    from inferscale.bench.common import bootstrap

    def answerable(values):
        return [v for c in held for v, cat in zip(values(c), c["categories"]) if cat in ANSWERABLE]

    if not held:
        return {}
    ceiling = answerable(lambda c: c["ceiling"])
    at_10 = {m: answerable(lambda c, m=m: c["recall"][m][10]) for m in MODES}
    out = {"questions": len(ceiling), "ceiling": _mean(ceiling),
           "ceiling_ci": list(bootstrap([(v, 0.0) for v in ceiling], lambda p: _mean([a for a, _ in p])))}
    for m in MODES:
        out[m] = {"recall_at_10": _mean(at_10[m]),
                  "ci": list(bootstrap([(v, 0.0) for v in at_10[m]], lambda p: _mean([a for a, _ in p])))}
        if m != "hybrid":
            pairs = list(zip(at_10["hybrid"], at_10[m]))
            out[m]["hybrid_minus"] = _mean([a - b for a, b in pairs])
            out[m]["hybrid_minus_ci"] = list(bootstrap(pairs, lambda p: _mean([a - b for a, b in p])))
    return out


def _markdown(r: dict) -> str:
    h = r["held_out"]
    lines = ["# Retrieval: dense vs hybrid (dense + BM25, reciprocal rank fusion)", "",
             "Rankings: `dense` (cosine), `hybrid-fact` (cosine fused with BM25 over each fact's own text, the "
             "default before `keyword_turns`), `hybrid-source` (BM25 over each fact's text and its source turns', "
             "the default until stop 47), `hybrid-turns` (BM25 also over the turn before each source turn, and "
             "each fact gets a share of the fused score of strong matches drawn from within a few turns of its "
             "own), `hybrid` (the default: that, and a query naming a month or year fuses the ranking of the "
             "memories naming it).", "",
             f"LoCoMo, every question with evidence; held out: {', '.join(h['conversations'])} "
             f"({h['questions']} questions, {h.get('questions_1_4', '?')} of categories 1-4). Reproduce: "
             f"`inferscale bench retrieval`"
             + (f" (embedder `{r['embedder']}`)." if r.get("embedder") else ".")
             + (f" Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, commit {r['machine']['commit']}."
                if r.get("machine") else ""), "",
             "## Held-out evidence recall@k and hit@k", "",
             "| k | " + " | ".join(f"recall {m}" for m in MODES) + " | hybrid - dense | "
             + " | ".join(f"hit {m}" for m in MODES) + " |",
             "|---|" + "---|" * (2 * len(MODES) + 1)]
    for k in r["ks"]:
        k = str(k) if str(k) in h["recall_dense"] else k
        rec = [h[f"recall_{m}"][k] for m in MODES]
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in rec) + f" | {rec[-1] - rec[0]:+.3f} | "
                     + " | ".join(f"{h[f'hit_{m}'][k]:.3f}" for m in MODES) + " |")
    if "recall_hybrid_1_4" in h:
        lines += ["", "## Held-out evidence recall@k, categories 1-4 (multi-hop, temporal, open-domain, single-hop)", "",
                  "| k | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
        for k in r["ks"]:
            k = str(k) if str(k) in h["recall_hybrid_1_4"] else k
            lines.append(f"| {k} | " + " | ".join(f"{h[f'recall_{m}_1_4'][k]:.3f}" for m in MODES) + " |")
    iv = r.get("intervals_1_4")
    if iv:
        lines += ["", f"## Held-out recall@10, categories 1-4, with 95% intervals ({iv['questions']} questions)", "",
                  f"Ceiling (evidence turns that are the source of any memory at all, recall@k as k reaches every "
                  f"memory): **{iv['ceiling']:.3f}** [{iv['ceiling_ci'][0]:.3f}, {iv['ceiling_ci'][1]:.3f}]. When "
                  f"issue 43 was filed, hybrid search found {ISSUE_43_BASELINE} (BM25 over each memory's own text; "
                  "`hybrid-fact` rebuilds it). Intervals: 2,000 bootstrap resamples of the questions; the "
                  "difference is paired by question.", "",
                  "| ranking | recall@10 [95% CI] | share of the ceiling | hybrid minus it [95% CI] |", "|---|---|---|---|"]
        for m in MODES:
            row = iv[m]
            diff = (f"{row['hybrid_minus']:+.3f} [{row['hybrid_minus_ci'][0]:+.3f}, {row['hybrid_minus_ci'][1]:+.3f}]"
                    if "hybrid_minus" in row else "")
            lines.append(f"| {m} | {row['recall_at_10']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}] | "
                         f"{row['recall_at_10'] / iv['ceiling']:.0%} | {diff} |")
    lines += ["", "## Per conversation: recall@10", "",
              "| conversation | facts | questions | held out | " + " | ".join(MODES) + " |", "|---|---|---|---|" +
              "---|" * len(MODES)]
    for c in r["per_conversation"]:
        lines.append(f"| {c['sample']} | {c['facts']} | {c['questions']} | {'yes' if c['held_out'] else 'tuning'} | "
                     + " | ".join(f"{c[f'recall_at_10_{m}']:.3f}" for m in MODES) + " |")
    t = r["tuning"]
    lines += ["", f"## Fusion constant (hybrid), tuned on {', '.join(t['conversations'])} only", "",
              "| c | recall@10 |", "|---|---|"]
    lines += [f"| {c}{' (used)' if int(c) == r['rrf_c'] else ''} | {v:.3f} |" for c, v in t["recall_at_10"].items()]
    if t.get("neighbors_recall_at_10"):
        lines += ["", f"## Turn neighbours (hybrid), tuned on {', '.join(t['conversations'])} only", "",
                  "share 0 is no bonus; reach in turns.", "", "| share | reach | recall@10 |", "|---|---|---|"]
        for key, v in t["neighbors_recall_at_10"].items():
            share, reach = key.split("/")
            used = " (used)" if key == t["neighbors_used"] else ""
            lines.append(f"| {share}{used} | {reach} | {v:.3f} |")
    lines += ["", "## Search latency (median, query embedding included, limit 10)", "",
              "| scope | facts | dense (ms) | hybrid (ms) | hybrid - dense (ms) | hybrid / dense |", "|---|---|---|---|---|---|"]
    for name, row in r["latency_ms"].items():
        lines.append(f"| {name} | {row['facts']:,} | {row['dense']:.2f} | {row['hybrid']:.2f} | "
                     f"{row['hybrid'] - row['dense']:+.2f} | {row['hybrid'] / row['dense']:.2f}x |")
    if r.get("index_latency_ms"):
        lines += ["", "## The index's search alone (median, top-10, query embedded beforehand)", "",
                  f"Embedding one query takes {r['embed_query_ms']:.2f} ms (median) on top. Goals: top-10 within "
                  "5 ms at 10,000 memories, filtered within 20 ms at 20,000 (issue 11).", "",
                  "| scope | facts | dense (ms) | hybrid (ms) |", "|---|---|---|---|"]
        for name, row in r["index_latency_ms"].items():
            lines.append(f"| {name} | {row['facts']:,} | {row['dense']:.2f} | {row['hybrid']:.2f} |")
    return "\n".join(lines) + "\n"


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = r["held_out"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange", "tab:purple", "tab:olive", "tab:green")):
        for what, style in (("recall", "-o"), ("hit", ":s")):
            values = h[f"{what}_{mode}"]
            ax.plot(r["ks"], [values[k] for k in values], style, color=color, label=f"{what}@k, {mode}")
    ax.set_xscale("log")
    ax.set_xticks(r["ks"], [str(k) for k in r["ks"]])
    ax.set_xlabel("k (facts retrieved)")
    ax.set_ylabel("held-out LoCoMo questions")
    ax.set_title("Evidence recall@k and hit@k: dense vs hybrid")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
