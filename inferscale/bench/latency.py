"""TTFT vs k: Mem0-style prompt text vs KV injection (w=0 and w=20), side by side in one run.

One LoCoMo conversation is stored (its observations are the facts); for each question
and each k, the same retrieved facts are served three ways; a question is asked at every
k in every mode back to back, so drift on a shared machine hits every cell alike:

- ``text``: the facts are prompt text, prefilled by vLLM (prefix caching on, as in a
  Mem0 deployment; only the system preamble is shared between requests);
- ``inject-w0`` / ``inject-w20``: the facts' KV, encoded with w = 0 / 20 preceding
  turns, is injected by the connector; only the question is prefilled;
- ``inject-w20-int8`` / ``inject-w20-int4``: the same KV stored in 8 / 4 bits
  (``kv_storage_dtype``), dequantized by the connector before its cache write: served by
  a second :class:`~inferscale.Memory` over the same store and the same engine.

Every fact's KV is encoded and loaded into the pool's device tier before timing starts
(the steady state of a memory server), so timings exclude encoding. Per request:

- TTFT: submission to the engine to the first generated token (vLLM, seconds);
- retrieval: query embedding plus top-k search (seconds);
- end to end: the whole ``Memory.generate`` call with ``max_tokens=1``, which is
  retrieval, prompt layout, KV lookup and TTFT.

Reproduce: ``inferscale bench latency`` (see ``--help``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from inferscale.bench.common import (
    ResultLog, ensure_conversation, markdown_table, median, mean, percentile, pick_questions, scope_of,
    write_outputs,
)
from inferscale.bench.plots import plot_latency
from inferscale.datasets.locomo import load_locomo
from inferscale.kv.quant import QUANTIZED_DTYPES
from inferscale.bench.quality import memory_order_of, parse_mode as quality_mode, text_tail_of
from inferscale.memory import Memory

NAME = "latency"


def parse_mode(mode: str) -> tuple[str, int]:
    """``"text"`` -> ``("text", 0)``; ``"inject-w20"`` (or ``"inject-w20-tail2"``: the 2 best
    memories as text after the injected rest, :func:`~inferscale.bench.quality.text_tail_of`;
    either may end in ``-bestfirst``) -> ``("inject", 20)``.

    Raises:
        ValueError: anything else (``captured`` too: this benchmark encodes its KV).
    """
    kind, w = quality_mode(mode)
    if kind == "captured":
        raise ValueError(f"unknown mode {mode!r}: the latency benchmark takes text or inject-w<N>[-tail<M>]"
                         "[-bestfirst]")
    return kind, w or 0


def split_storage(mode: str) -> tuple[str, str]:
    """``"inject-w20-int4"`` -> ``("inject-w20", "int4")``; a mode without a storage suffix
    -> ``(mode, "auto")``.

    Raises:
        ValueError: a storage suffix on ``text`` (text has no KV).
    """
    for storage in QUANTIZED_DTYPES:
        if mode.endswith(f"-{storage}"):
            base = mode[: -len(storage) - 1]
            if base == "text":
                raise ValueError(f"mode {mode!r}: text mode stores no KV; use inject-w<N>-{storage}")
            return base, storage
    return mode, "auto"


def warm_kv(memory: Memory, user_id: str, questions: Sequence[str], k: int, windows: Sequence[int]) -> None:
    """Encode (where missing) the KV of every fact to be injected, and load it into the
    device tier of the engine's connector by serving it once.

    Covers the top ``k`` facts of each question at each context window in ``windows``.
    The warm-up requests carry their own cache salt, so no measured request reuses
    their prefix-cache blocks.
    """
    jobs = [(q, w) for w in windows for q in questions]
    for q, w in tqdm(jobs, desc=f"encode + load KV (top {k})", unit="question"):
        inj = memory.inject(q, user_id=user_id, k=k, context_window=w, wait_for_kv=True)
        memory.engine.generate(inj.prompt_token_ids, kv_transfer_params=inj.kv_transfer_params,
                               cache_salt=f"warm-{inj.cache_salt}", max_tokens=1)


def run(data: Path, out_dir: Path, store_dir: Path, *, sample: int = 0, questions: int = 20,
        ks: Sequence[int] = (0, 5, 10, 20, 50, 100), modes: Sequence[str] = ("text", "inject-w0", "inject-w20"),
        dtype: str = "auto", fresh: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``latency.{jsonl,json,md,png}`` to ``out_dir``.

    Args:
        data: ``locomo10.json``.
        out_dir: results folder.
        store_dir: the benchmark memory store (shared by the benchmarks; KV is reused).
        sample: conversation index. questions: how many (categories 1-4, spread evenly).
        ks: facts per request. modes: see :func:`parse_mode`.

    Returns:
        The summary written to ``latency.json``.

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
    """
    parsed = [parse_mode(split_storage(m)[0]) for m in modes]
    samples = load_locomo(data)
    if not 0 <= sample < len(samples):
        raise ValueError(f"--sample must be in 0..{len(samples) - 1}, got {sample}")
    conv = samples[sample]
    if max(ks) > len(conv.facts):
        raise ValueError(f"k={max(ks)} exceeds the {len(conv.facts)} facts of {conv.sample_id}")
    picked = pick_questions(conv, questions)
    settings = {"sample": conv.sample_id, "questions": questions, "ks": list(ks), "modes": list(modes),
                "dtype": dtype, "data": str(data)}
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    memory = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False)
    memories = {"auto": memory}
    for storage in dict.fromkeys(split_storage(m)[1] for m in modes):
        if storage != "auto":  # same store, same engine: only the stored KV's dtype differs
            memories[storage] = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False,
                                       kv_storage_dtype=storage, engine=memory.engine)
    for m in memories.values():  # storage dtypes side by side: none replaces another's files
        m.components.kv.keep_other_storages = True
    user_id = scope_of(conv)
    ensure_conversation(memory, conv)
    windows = sorted({w for m, w in parsed if m == "inject"})
    for storage, mem in memories.items():
        warm_kv(mem, user_id, [q.question for q in picked], max(ks), windows)
    for name, (mode, w) in zip(modes, parsed):  # engine start-up and first-request costs, on a question not measured
        memories[split_storage(name)[1]].generate("What do you remember about me?", user_id=user_id, k=1,
                                                  context_window=w, mode=mode, max_tokens=1, wait_for_kv=True)
    # question-major: each question is asked at every k in every mode back to back, so
    # drift on a shared machine hits every (mode, k) cell alike
    todo = [(k, qi, m) for qi in range(len(picked)) for k in ks for m in modes if not log.done(_key(m, k, qi))]
    for k, qi, name in tqdm(todo, desc="TTFT", unit="request"):
        base, storage = split_storage(name)
        mode, w = parse_mode(base)
        t0 = time.perf_counter()
        g = memories[storage].generate(picked[qi].question, user_id=user_id, k=k, context_window=w, mode=mode,
                                       max_tokens=1, wait_for_kv=True, text_tail=text_tail_of(base),
                                       memory_order=memory_order_of(base))
        e2e = time.perf_counter() - t0
        log.add(_key(name, k, qi), {
            "mode": name, "k": k, "question": qi, "ttft_s": g.ttft_s, "retrieval_s": g.retrieval_s, "e2e_s": e2e,
            "prompt_tokens": g.num_prompt_tokens, "prefilled_tokens": g.num_prefilled_tokens,
            "injected_tokens": g.num_injected_tokens,
        })
    log.commit()
    for mem in list(memories.values())[1:]:
        mem.close()
    summary = summarize(log.all(), ks, modes)
    summary["settings"] = log.settings  # as keyed: data by content, dtype resolved
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_latency(summary, out_dir / f"{NAME}.png")
    return summary


def _key(mode: str, k: int, qi: int) -> str:
    return f"{mode}|k={k}|q={qi}"


def summarize(rows: list[dict], ks: Sequence[int], modes: Sequence[str]) -> dict:
    """Median / p90 of TTFT, retrieval and end to end per (mode, k), and the target ratios."""
    cells = []
    for mode in modes:
        for k in ks:
            rs = [r for r in rows if r["mode"] == mode and r["k"] == k]
            if not rs:
                continue
            cells.append({
                "mode": mode, "k": k, "n": len(rs),
                "ttft_median_ms": 1000 * median(r["ttft_s"] for r in rs),
                "ttft_p90_ms": 1000 * percentile([r["ttft_s"] for r in rs], 90),
                "retrieval_median_ms": 1000 * median(r["retrieval_s"] for r in rs),
                "e2e_median_ms": 1000 * median(r["e2e_s"] for r in rs),
                "e2e_p90_ms": 1000 * percentile([r["e2e_s"] for r in rs], 90),
                "prompt_tokens_mean": mean(r["prompt_tokens"] for r in rs),
                "prefilled_tokens_mean": mean(r["prefilled_tokens"] for r in rs),
            })
    cell = {(c["mode"], c["k"]): c for c in cells}
    ratios = {}
    for mode in modes:
        if mode == "text":
            continue
        hi = max(ks)
        for k_hi in sorted({hi, 50} & set(ks)):
            if (mode, k_hi) in cell and (mode, 0) in cell:
                ratios[f"{mode} k={k_hi} / {mode} k=0"] = cell[(mode, k_hi)]["ttft_median_ms"] / cell[(mode, 0)][
                    "ttft_median_ms"]
            base, storage = split_storage(mode)
            if storage != "auto" and (mode, k_hi) in cell and (base, k_hi) in cell:
                ratios[f"{mode} k={k_hi} / {base} k={k_hi}"] = cell[(mode, k_hi)]["ttft_median_ms"] / cell[
                    (base, k_hi)]["ttft_median_ms"]
            if ("text", k_hi) in cell and (mode, k_hi) in cell:
                ratios[f"text k={k_hi} / {mode} k={k_hi}"] = cell[("text", k_hi)]["ttft_median_ms"] / cell[
                    (mode, k_hi)]["ttft_median_ms"]
    return {"cells": cells, "ttft_median_ratios": ratios}


def to_markdown(summary: dict) -> str:
    """Tables of the summary."""
    s = summary["settings"]
    rows = [[c["mode"], c["k"], c["n"], f"{c['ttft_median_ms']:.1f}", f"{c['ttft_p90_ms']:.1f}",
             f"{c['retrieval_median_ms']:.1f}", f"{c['e2e_median_ms']:.1f}", f"{c['e2e_p90_ms']:.1f}",
             f"{c['prompt_tokens_mean']:.0f}", f"{c['prefilled_tokens_mean']:.0f}"] for c in summary["cells"]]
    table = markdown_table(
        ["mode", "k", "n", "TTFT median (ms)", "TTFT p90 (ms)", "retrieval median (ms)", "end-to-end median (ms)",
         "end-to-end p90 (ms)", "prompt tokens", "prefilled tokens"], rows)
    ratios = markdown_table(["ratio of median TTFT", "value"],
                            [[k, f"{v:.2f}x"] for k, v in summary["ttft_median_ratios"].items()])
    return (f"# Latency: TTFT vs k\n\nLoCoMo {s['sample']}, {s['questions']} questions (categories 1-4), "
            f"dtype {s['dtype']}.\n\n{table}\n\n{ratios}\n")
