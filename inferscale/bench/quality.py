"""Answer quality: prompt text vs KV injection at several context windows, on LoCoMo.

For each chosen conversation and question (categories 1-4) and each k, the same
top-k facts are served in every mode (``text``, ``inject-w0``, ``inject-w5``, ...), and
three numbers are recorded:

- token F1 of the generated answer (greedy, up to 32 tokens) against the gold answer,
  normalised as LoCoMo's own evaluation does (:func:`inferscale.datasets.locomo.token_f1`);
- the gold answer's negative log-likelihood per token (nats), teacher-forced through the
  transformers reference path with the same prompt and, for ``inject`` modes, the same
  injected KV (:class:`inferscale.kv.reference.ReferenceModel`);
- evidence recall@k of the retrieval: the share of the question's evidence turns
  (LoCoMo ``evidence`` dialogue ids) that are a source turn of some retrieved fact
  (questions without evidence are left out of the mean).

Reproduce: ``inferscale bench quality`` (see ``--help``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from inferscale.bench.common import (
    ResultLog, ensure_conversation, markdown_table, mean, pick_questions, scope_of, write_outputs,
)
from inferscale.bench.latency import parse_mode
from inferscale.bench.plots import plot_quality
from inferscale.datasets.locomo import CATEGORIES, load_locomo, token_f1
from inferscale.memory import Memory
from inferscale.kv.reference import ReferenceModel

NAME = "quality"


def evidence_recall(evidence: Sequence[str], memories: Sequence[dict]) -> float | None:
    """Share of ``evidence`` dialogue ids that are source turns of ``memories``; ``None`` without evidence."""
    if not evidence:
        return None
    found = {t for m in memories for t in m.get("source_turn_ids", ())}
    return sum(e in found for e in evidence) / len(evidence)


def answer_nll(memory: Memory, ref: ReferenceModel, user_id: str, question: str, answer: str, k: int,
               mode: str, w: int) -> float:
    """Mean NLL (nats per token) of ``answer`` after the prompt served in ``mode`` with top-``k`` facts."""
    answer_ids = memory.tokenizer(answer, add_special_tokens=False).input_ids
    req = memory.prepare(question, user_id=user_id, k=k, context_window=w, mode=mode, wait_for_kv=True)
    if req.plan is None:
        return ref.answer_nll(req.prompt_token_ids, answer_ids)
    return ref.answer_nll(req.prompt_token_ids, answer_ids, memory.injected_kv(req))


def run(data: Path, out_dir: Path, store_dir: Path, *, samples: Sequence[int] = (0, 1, 8),
        questions: int = 10, ks: Sequence[int] = (5, 10, 20, 50),
        modes: Sequence[str] = ("text", "inject-w0", "inject-w5", "inject-w20", "inject-w50"),
        max_tokens: int = 32, dtype: str = "auto", fresh: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``quality.{jsonl,json,md,png}`` to ``out_dir``.

    Args:
        samples: LoCoMo conversation indices. questions: per conversation (categories 1-4,
            spread evenly). ks: facts per request. modes: see
            :func:`inferscale.bench.latency.parse_mode`. max_tokens: answer budget (tokens).

    Returns:
        The summary written to ``quality.json``.

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
    """
    parsed = {m: parse_mode(m) for m in modes}
    convs = load_locomo(data)
    bad = [s for s in samples if not 0 <= s < len(convs)]
    if bad:
        raise ValueError(f"--samples must be in 0..{len(convs) - 1}, got {bad}")
    settings = {"samples": [convs[s].sample_id for s in samples], "questions": questions, "ks": list(ks),
                "modes": list(modes), "max_tokens": max_tokens, "dtype": dtype, "data": str(data)}
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    memory = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False)
    work = []
    for s in samples:
        conv = convs[s]
        if max(ks) > len(conv.facts):
            raise ValueError(f"k={max(ks)} exceeds the {len(conv.facts)} facts of {conv.sample_id}")
        work.append((conv, pick_questions(conv, questions)))
    ref = None
    for conv, picked in work:
        ensure_conversation(memory, conv)
        user_id = scope_of(conv)
        todo = [(qi, k, m) for qi in range(len(picked)) for k in ks for m in modes
                if not log.done(_key(conv.sample_id, qi, k, m))]
        for qi, qa in enumerate(picked):
            rk = f"{conv.sample_id}|q={qi}|recall"
            if not log.done(rk):
                hits = memory.search(qa.question, user_id=user_id, limit=max(ks))["results"]
                log.add(rk, {"sample": conv.sample_id, "question": qi, "category": qa.category, "recall": {
                    str(k): evidence_recall(qa.evidence, hits[:k]) for k in ks}})
        for qi, k, name in tqdm(todo, desc=f"quality {conv.sample_id}", unit="answer"):
            qa = picked[qi]
            mode, w = parsed[name]
            gold = str(qa.answer)
            t0 = time.perf_counter()
            g = memory.generate(qa.question, user_id=user_id, k=k, context_window=w, mode=mode,
                                max_tokens=max_tokens, wait_for_kv=True)
            ref = ref or memory.reference_model()
            log.add(_key(conv.sample_id, qi, k, name), {
                "sample": conv.sample_id, "question": qi, "category": qa.category, "k": k, "mode": name,
                "answer": g.text, "gold": gold, "f1": token_f1(g.text, gold),
                "nll": answer_nll(memory, ref, user_id, qa.question, gold, k, mode, w),
                "injected_tokens": g.num_injected_tokens, "prompt_tokens": g.num_prompt_tokens,
                "seconds": time.perf_counter() - t0,
            })
    log.commit()
    summary = summarize(log.all(), ks, modes)
    summary["settings"] = log.settings  # as keyed: data by content, dtype resolved
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_quality(summary, out_dir / f"{NAME}.png")
    return summary


def _key(sample: str, qi: int, k: int, mode: str) -> str:
    return f"{sample}|q={qi}|k={k}|{mode}"


def summarize(rows: list[dict], ks: Sequence[int], modes: Sequence[str]) -> dict:
    """Mean F1 and NLL per (mode, k), mean recall@k, and inject-vs-text ratios at the largest k."""
    answers = [r for r in rows if "mode" in r]
    cells = []
    for mode in modes:
        for k in ks:
            rs = [r for r in answers if r["mode"] == mode and r["k"] == k]
            if rs:
                cells.append({"mode": mode, "k": k, "n": len(rs), "f1_mean": mean(r["f1"] for r in rs),
                              "nll_mean": mean(r["nll"] for r in rs)})
    recalls = [r for r in rows if "recall" in r]
    recall = []
    for k in ks:
        vals = [r["recall"][str(k)] for r in recalls if r["recall"].get(str(k)) is not None]
        recall.append({"k": k, "n": len(vals), "recall_mean": mean(vals)})
    cell = {(c["mode"], c["k"]): c for c in cells}
    top = max(ks)
    by_category = [
        {"mode": mode, "category": cat, "n": len(rs), "f1_mean": mean(r["f1"] for r in rs),
         "nll_mean": mean(r["nll"] for r in rs)}
        for mode in modes for cat in (1, 2, 3, 4)
        if (rs := [r for r in answers if r["mode"] == mode and r["k"] == top and r["category"] == cat])
    ]
    ratios = {}
    for mode in modes:
        for k in ks:
            if mode != "text" and (mode, k) in cell and ("text", k) in cell:
                t, i = cell[("text", k)], cell[(mode, k)]
                ratios[f"{mode} k={k}"] = {
                    "f1_vs_text": i["f1_mean"] / t["f1_mean"] if t["f1_mean"] else None,
                    "nll_vs_text": i["nll_mean"] / t["nll_mean"] if t["nll_mean"] else None,
                }
    return {"cells": cells, "recall": recall, "vs_text": ratios, "by_category": by_category, "category_k": top}


def to_markdown(summary: dict) -> str:
    """Tables of the summary."""
    s = summary["settings"]
    modes = list(dict.fromkeys(c["mode"] for c in summary["cells"]))
    ks = sorted({c["k"] for c in summary["cells"]})
    cell = {(c["mode"], c["k"]): c for c in summary["cells"]}

    def grid(field: str, fmt: str) -> str:
        rows = [[m] + [format(cell[(m, k)][field], fmt) if (m, k) in cell else "" for k in ks] for m in modes]
        return markdown_table(["mode"] + [f"k={k}" for k in ks], rows)

    n = max((c["n"] for c in summary["cells"]), default=0)
    recall = markdown_table(["k", "questions with evidence", "evidence recall@k (mean)"],
                            [[r["k"], r["n"], f"{r['recall_mean']:.3f}"] for r in summary["recall"]])
    ratio_rows = [[name, "" if v["f1_vs_text"] is None else f"{v['f1_vs_text']:.1%}",
                   "" if v["nll_vs_text"] is None else f"{v['nll_vs_text']:.1%}"]
                  for name, v in summary["vs_text"].items()]
    ratios = markdown_table(["inject setting", "F1 as % of text's", "NLL as % of text's"], ratio_rows)
    cat = {(c["mode"], c["category"]): c for c in summary.get("by_category", [])}
    cats = sorted({c["category"] for c in summary.get("by_category", [])})
    by_cat = markdown_table(
        ["mode"] + [f"{c} {CATEGORIES[c]} (n={max(x['n'] for x in summary['by_category'] if x['category'] == c)})"
                    for c in cats],
        [[m] + [f"{cat[(m, c)]['f1_mean']:.3f} / {cat[(m, c)]['nll_mean']:.2f}" if (m, c) in cat else "" for c in cats]
         for m in modes])
    return (f"# Quality: prompt text vs KV injection\n\nLoCoMo {', '.join(s['samples'])}; {s['questions']} questions "
            f"per conversation (categories 1-4), {n} answers per cell; greedy, up to {s['max_tokens']} tokens; "
            f"dtype {s['dtype']}.\n\n## Token F1 (mean)\n\n{grid('f1_mean', '.3f')}\n\n"
            f"## Gold answer NLL (nats per token, mean; lower is better)\n\n{grid('nll_mean', '.3f')}\n\n"
            f"## Retrieval\n\n{recall}\n\n## Inject vs text\n\n{ratios}\n\n"
            f"## By LoCoMo category at k={summary.get('category_k')} (token F1 / gold NLL)\n\n{by_cat}\n")
