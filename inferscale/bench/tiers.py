"""The KV pool under a disk budget: a Zipf replay of LoCoMo users (issue 31).

Users are LoCoMo's ten conversations, repeated into more users (user ``i`` holds
conversation ``i mod 10``'s facts under a scope of its own, as the memory-ops benchmark
repeats facts), every fact's KV encoded once into a store of its own (``<data
dir>/bench-tiers``: a disk budget evicts, so no other benchmark's KV is put at risk).
Questions arrive with Zipf-distributed user popularity (user ``r`` asked with probability
``∝ 1 / r^s``), each one of that user's LoCoMo questions, and are served in inject mode with
``k`` facts, one after another, on one engine.

The same trace is replayed at disk budgets of 100% (no budget: the unbounded pool), 50%,
25% and 10% of the full pool's bytes, in that order, on the same store, once per eviction
policy: ``lru`` (least recently used) and ``lrfu`` (decayed use counts, the pool's default:
:mod:`inferscale.kv.disk`). Each policy starts from the full pool with every entry's
priority reset to one value; each lower budget evicts down to it at once
(:meth:`inferscale.kv.pool.KVPool.set_disk_budget`), and from then on a memory whose KV was
evicted comes as text and is encoded again in the background, evicting by the policy. The
first ``warmup`` questions of each replay fill the cache and are not counted. Per policy and
budget the page reports:

- the share of retrieved fact tokens served as KV (the rest were prefilled as text), and
  the share of retrieved memories;
- TTFT p50 / p99 (seconds, in the engine), against the unbounded pool's;
- re-encodes (KV written again after this process evicted it) and disk evictions;
- the disk tier's bytes at the end (never above the budget plus one fact);
- beside them, what a clairvoyant cache (Belady's MIN, :mod:`inferscale.bench.clairvoyant`)
  would serve on the same reference string (the facts the unbounded replay retrieved, in
  order) at each budget: the ceiling of any policy.

Reproduce: ``inferscale bench tiers --out docs/results/tiers``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from inferscale.bench.clairvoyant import belady_token_share
from inferscale.bench.common import machine, markdown_table, percentile, write_outputs
from inferscale.bench.plots import plot_tiers
from inferscale.datasets.locomo import load_locomo, store_conversation
from inferscale.memory import Memory

NAME = "tiers"
MIB = 2**20
#: eviction policies the replay compares (``lru``: the disk tier with no half-life)
POLICIES = ("lru", "lrfu")
#: how a miss gets its KV: encoded at once (``eager``) or while no request is in flight
#: (``idle``), or captured from the request's own prefill with the encoder idle (``capture``:
#: ``MemoryConfig.capture_kv``, issue 39)
ENCODERS = ("eager", "idle", "capture")
ENCODER_TEXT = {"eager": "eager: encoded as soon as a miss is queued",
                "idle": "idle: encoded only while no question is in flight",
                "capture": "capture: kept from the question's own prefill (the encoder idle, dropping jobs a "
                           "question captured)"}


def user_weights(users: int, s: float) -> list[float]:
    """Zipf popularity of users ranked 1..``users``: ``1 / r^s``, normalised to sum to 1."""
    if users < 1 or s < 0:
        raise ValueError(f"need users >= 1 and a Zipf exponent >= 0, got {users} and {s}")
    raw = [1.0 / (r ** s) for r in range(1, users + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def make_trace(question_counts: Sequence[int], n: int, s: float, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` (user, question index) pairs: users drawn by Zipf(``s``) popularity (user 0 the
    most popular), each question uniform among that user's ``question_counts[user]``."""
    rng = random.Random(seed)
    weights = user_weights(len(question_counts), s)
    users = rng.choices(range(len(question_counts)), weights=weights, k=n)
    return [(u, rng.randrange(question_counts[u])) for u in users]


def run(data: Path, out_dir: Path, store_dir: Path, *, users: int = 12, questions: int = 300, warmup: int = 100,
        zipf: float = 1.1, k: int = 10, budgets: Sequence[float] = (1.0, 0.5, 0.25, 0.1), context_window: int = 0,
        dtype: str = "auto", seed: int = 0, touch_interval_s: float = 1.0, half_life_s: float = 60.0,
        policies: Sequence[str] = POLICIES, encoders: Sequence[str] = ("eager",),
        admission_window_s: float = 0.0) -> dict:
    """Build the store (once), replay the trace at each budget; writes ``tiers.{json,md,png}``.

    Args:
        users: users (conversation ``i mod 10`` each). questions: replayed per budget, of
            which the first ``warmup`` are not counted. zipf: the popularity exponent ``s``.
        k: facts per question. budgets: shares of the full pool's bytes (1.0: no budget),
            replayed in the order given (largest first, so each run evicts from the last).
        context_window: w of the stored KV (0 by default: the budget and eviction do not
            depend on w, and w = 0 encodes thousands of facts in minutes on 2 cores).
        touch_interval_s: how often a use renews an entry's recency on disk (seconds). The
            pool renews it at most once a minute (:attr:`inferscale.kv.disk.DiskTier.TOUCH_INTERVAL_S`),
            a tiny share of the hours a production working set spans; the replay runs a
            trace in minutes, so the interval is scaled down with it (default 1 s).
        half_life_s: the ``lrfu`` policy's half-life (seconds): the pool's hour
            (:attr:`inferscale.kv.disk.DiskTier.HALF_LIFE_S`) scaled as the touch interval is
            (default 60 s).
        policies: eviction policies to replay, from :data:`POLICIES`.
        encoders: how a miss gets its KV, from :data:`ENCODERS`: ``eager`` (encoded as soon
            as a miss is queued, competing with the next questions), ``idle`` (encoded only
            while no request is in flight: ``MemoryConfig.encode_when_idle``) and ``capture``
            (kept from the request's own prefill: ``MemoryConfig.capture_kv``, the encoder
            idle). Each policy is replayed once per arm, in one process, so they compare side
            by side; every arm starts from the same encoded pool, with no captured KV.
        admission_window_s: the replay's ``kv_admission_window_s`` (default 0: every miss is
            kept, as the published pages ran; the library's day, scaled as the half-life is,
            is 1440 s).

    Returns:
        The summary written to ``tiers.json``.

    Raises:
        ValueError: bad settings.
    """
    if users < 1 or k < 1 or not 0 <= warmup < questions:
        raise ValueError(f"need users >= 1, k >= 1 and 0 <= warmup < questions, got {users}, {k}, {warmup}, "
                         f"{questions}")
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"budgets are shares of the full pool in (0, 1], got {list(budgets)}")
    if not policies or any(p not in POLICIES for p in policies) or not half_life_s > 0:
        raise ValueError(f"policies are some of {list(POLICIES)} and the half-life a positive number of seconds, "
                         f"got {list(policies)} and {half_life_s}")
    if not encoders or any(e not in ENCODERS for e in encoders):
        raise ValueError(f"encoders are some of {list(ENCODERS)}, got {list(encoders)}")
    convs = load_locomo(data)
    scopes = [f"tiers-{i}" for i in range(users)]
    asked = [[q.question for q in convs[i % len(convs)].qa if q.category in (1, 2, 3, 4)] for i in range(users)]
    trace = make_trace([len(a) for a in asked], questions, zipf, seed)
    settings = dict(dtype=dtype, context_window=context_window, top_k=k, kv_admission_window_s=admission_window_s)

    with Memory(data_dir=store_dir, precompute_kv=True, **settings) as mem:
        mem.components.pool.set_disk_budget(None)  # a budget left by an interrupted run
        for i, scope in enumerate(tqdm(scopes, desc="store users", unit="user")):
            store_conversation(mem, convs[i % len(convs)], scope)
        mem.wait_for_kv()
        pool = mem.components.pool
        pool.disk.TOUCH_INTERVAL_S = touch_interval_s  # the trace is time-compressed
        facts = sum(mem.count(user_id=s) for s in scopes)
        dtype_used = mem.config.resolved_dtype
        cells, refs, tokens = [], None, {}
        for policy, encoder in [(p, e) for p in policies for e in encoders]:
            pool.set_disk_budget(None)
            _encode_all(mem, scopes, context_window)  # what the last policy's (or run's) budgets evicted
            _reset_priorities(mem.kv_dir)  # every policy starts from the same order
            pool.disk.HALF_LIFE_S = half_life_s if policy == "lrfu" else None
            mem.components.kv.background.yield_to_requests = encoder != "eager"
            mem.components.kv.capture = encoder == "capture"
            full = _fact_bytes(mem.kv_dir)
            for share in budgets:
                budget = None if share >= 1 else max(int(full * share), 1 << 20)
                evicted = pool.set_disk_budget(budget)  # lowest priority out first, now
                record = [] if refs is None and budget is None else None
                cell = _replay(mem, share, budget, evicted, trace, asked, scopes, warmup, k, tokens, record)
                cells.append({"policy": policy, "encoder": encoder, **cell})
                if record is not None:
                    refs, sizes = record, _owner_bytes(mem.kv_dir)
        pool.set_disk_budget(None)
    by_arm: dict[tuple, dict] = {}
    for cell in cells:
        base = by_arm.setdefault((cell["policy"], cell["encoder"]), cell)  # the arm's first (largest) budget
        cell["ttft_p99_vs_first"] = cell["ttft_p99_s"] / base["ttft_p99_s"]
        cell["ttft_p50_vs_first"] = cell["ttft_p50_s"] / base["ttft_p50_s"]
    ceilings = {}
    unsized = 0
    if refs is not None:
        sizes, unsized = _sizes_of_all(refs, tokens, sizes)
        for share in budgets:
            budget = full if share >= 1 else max(int(full * share), 1 << 20)
            ceilings[f"{share:g}"] = belady_token_share(refs, tokens, sizes, budget, warmup)
    summary = {"name": NAME, "users": users, "facts": facts, "questions": questions, "warmup": warmup, "zipf": zipf,
               "k": k, "context_window": context_window, "dtype": dtype_used,
               "full_pool_bytes": full, "touch_interval_s": touch_interval_s, "half_life_s": half_life_s,
               "admission_window_s": admission_window_s,
               "policies": list(policies), "encoders": list(encoders), "clairvoyant_kv_token_share": ceilings,
               "clairvoyant_sizes_estimated": unsized,
               "cells": cells,
               "machine": machine()}
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_tiers(summary, Path(out_dir) / f"{NAME}.png")
    return summary


def _sizes_of_all(refs, tokens: dict[str, int], sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """``sizes`` completed for every fact ``refs`` reads: a fact served from memory whose file
    was gone when the folder was measured gets the pool's mean bytes per token times its
    tokens. Returns the sizes and how many were estimated so."""
    known = [k for k in sizes if k in tokens]
    per_token = sum(sizes[k] for k in known) / max(sum(tokens[k] for k in known), 1)
    missing = {key for q in refs for key in q if key not in sizes}
    return {**sizes, **{k: int(round(per_token * tokens[k])) for k in missing}}, len(missing)


def _encode_all(mem: Memory, scopes: Sequence[str], w: int) -> None:
    """Encode the preamble's KV and every fact's of ``scopes`` at ``w`` that the pool lacks, and
    drop their captured KV."""
    from inferscale.store.records import Scope

    kv = mem.components.kv
    spans = [kv.preamble_span()]
    for scope in scopes:
        key = Scope(scope).key
        records, _ = mem.components.store.load_scope(key)
        spans += kv.fact_spans(key, records, w)
        for captured in kv.captured_keys(records):  # what an earlier arm captured: every arm starts alike
            mem.components.pool.remove(captured)
    kv.ensure(spans)


def _fact_bytes(kv_dir: Path) -> int:
    """Bytes of the fact KV files (the preamble's excluded: never evicted)."""
    return sum(p.stat().st_size for p in kv_dir.glob("*/*.safetensors") if not p.parent.name.startswith("_"))


def _reset_priorities(kv_dir: Path) -> None:
    """Give every fact KV file one modification time (an hour ago): no order carried over."""
    import os

    t = time.time() - 3600
    for p in kv_dir.glob("*/*.safetensors"):
        if not p.parent.name.startswith("_"):
            os.utime(p, (t, t))


def _owner_bytes(kv_dir: Path) -> dict[str, int]:
    """Bytes of each fact's KV files, by fact (memory) id."""
    out: dict[str, int] = {}
    for p in kv_dir.glob("*/*.safetensors"):
        if not p.parent.name.startswith("_"):
            out[p.parent.name] = out.get(p.parent.name, 0) + p.stat().st_size
    return out


def _replay(mem: Memory, share: float, budget: int | None, evicted_at_open: int, trace, asked, scopes,
            warmup: int, k: int, tokens: dict[str, int], record: list | None) -> dict:
    """One replay of ``trace``; fills ``tokens`` (fact id -> tokens) and, when given, appends
    each question's retrieved fact ids to ``record``."""
    stats0 = None
    ttft, kv_tokens, text_tokens, kv_memories, all_memories = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    for n, (u, qi) in enumerate(tqdm(trace, desc=f"replay {share:.0%}", unit="question")):
        if n == warmup:
            stats0 = dict(mem.kv_stats())
        g = mem.generate(asked[u][qi], user_id=scopes[u], k=k, mode="inject", max_tokens=1)
        if record is not None:
            record.append([m["id"] for m in g.memories])
            for m in g.memories:
                if m["id"] not in tokens:
                    tokens[m["id"]] = mem.fact_tokens(m["memory"])
        if n < warmup:
            continue
        ttft.append(g.ttft_s)
        kv = set(g.kv_memory_ids)
        for m in g.memories:
            t = tokens.get(m["id"])
            if t is None:
                t = tokens[m["id"]] = mem.fact_tokens(m["memory"])
            if m["id"] in kv:
                kv_tokens += t
                kv_memories += 1
            else:
                text_tokens += t
            all_memories += 1
    counted_encode_s = mem.kv_stats()["encode_seconds"] - stats0["encode_seconds"]  # before the wait below
    mem.wait_for_kv()
    stats = mem.kv_stats()
    return {"share": share, "budget_bytes": budget, "counted": len(ttft),
            "encode_s_per_100_questions": 100 * counted_encode_s / max(len(ttft), 1),
            "kv_token_share": kv_tokens / max(kv_tokens + text_tokens, 1),
            "kv_memory_share": kv_memories / max(all_memories, 1),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "reencodes": stats["reencodes"] - stats0["reencodes"],
            "captured_served": stats["served_captured"] - stats0["served_captured"],
            "encodes_skipped_captured": stats["encodes_skipped_captured"] - stats0["encodes_skipped_captured"],
            "disk_evictions": stats["disk_evictions"] - stats0["disk_evictions"],
            "evicted_at_open": evicted_at_open, "disk_bytes_end": _fact_bytes(mem.kv_dir),
            "seconds": time.perf_counter() - t0}


def to_markdown(summary: dict) -> str:
    m = summary["machine"]
    ceilings = summary.get("clairvoyant_kv_token_share", {})
    rows = []
    for c in summary["cells"]:
        budget = "none (unbounded)" if c["budget_bytes"] is None else f"{c['budget_bytes'] / MIB:,.0f} MiB"
        ceiling = ceilings.get(f"{c['share']:g}")
        rows.append([c.get("policy", "lru"), c.get("encoder", "eager"), f"{c['share']:.0%}", budget,
                     f"{c['kv_token_share']:.1%}",
                     "" if ceiling is None else f"{ceiling:.1%}", f"{c['kv_memory_share']:.1%}",
                     f"{c['ttft_p50_s'] * 1e3:.1f} ({c['ttft_p50_vs_first']:.2f}x)",
                     f"{c['ttft_p99_s'] * 1e3:.1f} ({c['ttft_p99_vs_first']:.2f}x)",
                     c["reencodes"], f"{c.get('captured_served', 0)} / {c.get('encodes_skipped_captured', 0)}",
                     "" if "encode_s_per_100_questions" not in c else
                     f"{c['encode_s_per_100_questions']:.1f}", c["disk_evictions"],
                     f"{c['disk_bytes_end'] / MIB:,.0f}"])
    table = markdown_table(["policy", "encoder", "disk budget", "bytes", "fact tokens as KV", "clairvoyant (Belady)",
                            "memories as KV", "TTFT p50 (ms, vs unbounded)", "TTFT p99 (ms, vs unbounded)",
                            "re-encodes", "captured KV served / encodes it saved",
                            "encoder s / 100 questions", "evictions", "disk at end (MiB)"], rows)
    half_life = summary.get("half_life_s")
    return f"""# The KV pool under a disk budget: Zipf replay

{summary['users']} users (LoCoMo's conversations repeated into more users), {summary['facts']:,} facts,
full pool {summary['full_pool_bytes'] / MIB:,.0f} MiB of fact KV ({summary['dtype']}, w = {summary['context_window']});
{summary['questions']} questions a budget with Zipf user popularity (s = {summary['zipf']}), k = {summary['k']}, the first
{summary['warmup']} not counted (they fill the cache); one engine, questions one after another; a miss is
served as text and then ({'; '.join(ENCODER_TEXT[e] for e in summary.get('encoders', ['eager']))}); recency on disk renewed at most every {summary['touch_interval_s']:g} s
(the pool's 60 s scaled to the time-compressed trace){'' if half_life is None else f", lrfu's half-life {half_life:g} s (the pool's hour, scaled alike)"}.
Each policy replays every budget, largest first, from the full pool with every entry's priority
reset. "Clairvoyant" is Belady's MIN on the same reference string (the facts the unbounded replay
retrieved, in order): what a cache that knows the future would serve, the ceiling of any policy{
'' if not summary.get('clairvoyant_sizes_estimated') else f" ({summary['clairvoyant_sizes_estimated']} facts served from memory had no file when the folder was measured: their sizes are the pool's mean bytes per token times their tokens)"}.
TTFT p50 and p99 are compared with the same policy's and encoder's unbounded replay; "encoder s"
is the background encoder's busy time during the counted questions, per 100 of them.
Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; commit {m.get('commit', '?')}.

{table}

Reproduce: `inferscale bench tiers --questions {summary['questions']} --warmup {summary['warmup']} --policies {','.join(summary['policies'])} --encoders {','.join(summary.get('encoders', ['eager']))} --budgets {','.join(f"{b:g}" for b in dict.fromkeys(c['share'] for c in summary['cells']))} --out <folder>`
(module docstring of `inferscale/bench/tiers.py` for the method). The same policies on a longer trace, offline
(no model, the store's search only): [policies](../tiers/policies.md), from `scripts/tiers_policies.py`, which also
replays more users: over 120, the facts 3,000 questions ask about are a third of the pool and a quarter of
the pool serves 88% of fact tokens as KV under every policy. What a fleet needs over days, not one trace,
is the simulator's answer: [Sizing a fleet](../../sizing.md).
"""
