"""Answer quality: prompt text vs injected KV (encoded at several context windows, or captured),
paired, on LoCoMo's held-out conversations.

For each chosen question (categories 1-4) and each k, the same top-k memories are served in
every mode, and each answer is scored twice:

- the gold answer's negative log-likelihood per token (nats), teacher-forced through the
  transformers reference path with the same prompt and, in KV modes, the same KV
  (:class:`inferscale.kv.reference.ReferenceModel`);
- token F1 of the greedy answer vLLM generates from that very request (LoCoMo's normalisation,
  :func:`inferscale.datasets.locomo.token_f1`).

Modes: ``text`` (the memory block prefilled, Mem0-style), ``inject-w<N>`` (every memory's KV
encoded with Context-Window Encoding after the N turns before it, encoded first if missing),
and ``captured``: what a store serves with capture on a miss and no encoder
(:mod:`inferscale.kv.capture`): memories whose KV an earlier request captured are injected, the
rest come as text (and are captured by this request). Before a conversation's answers, its other
questions (every category, the chosen ones left out) are served once at the largest k as that
earlier traffic; each answer records the share of its memories that came as captured KV.

Conversations are split into a **tuning** set (default 0-2: where settings were chosen) and a
**held-out** set (3-9), reported apart. Each mode is compared with ``text`` on the same answers:
the relative change of the mean NLL (ratio of means minus 1) and the absolute change of the mean
F1, each with a 95% bootstrap interval over answers resampled in pairs
(:func:`inferscale.bench.common.bootstrap`). Evidence recall@k of the retrieval is kept too.

Reproduce: ``inferscale bench quality`` (see ``--help``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from inferscale.bench.common import (
    ResultLog, bootstrap, ensure_conversation, machine, markdown_table, mean, pick_questions, scope_of, write_outputs,
)
from inferscale.bench.plots import plot_quality
from inferscale.datasets.locomo import CATEGORIES, load_locomo, token_f1
from inferscale.generation.request import PreparedRequest, generation_chunks
from inferscale.kv.reference import ReferenceModel
from inferscale.memory import Memory
from inferscale.store.records import Scope

NAME = "quality"
#: the longest the capture traffic waits for its captures to be stored (seconds)
CAPTURE_LAND_S = 120.0
MODES = ("text", "inject-w0", "inject-w5", "inject-w20", "inject-w50", "captured")
#: the context window the ``captured`` mode's memory asks for: one no mode here encodes (and
#: the run checks that none of its memories came as encoded KV), so only captured KV is found
CAPTURE_ONLY_W = 1


#: a mode name's suffix that puts the best-ranked memory first (``GenerationOptions.memory_order``)
BEST_FIRST = "-bestfirst"


def memory_order_of(name: str) -> str:
    """The memory order a mode names: ``"inject-w5-bestfirst"`` -> ``"best_first"``; else ``"best_last"``."""
    return "best_first" if name.endswith(BEST_FIRST) else "best_last"


def _without_order(name: str) -> str:
    return name[:-len(BEST_FIRST)] if name.endswith(BEST_FIRST) else name


def parse_mode(name: str) -> tuple[str, int | None]:
    """``"text"`` -> ``("text", None)``; ``"inject-w20"`` (or ``"inject-w20-tail2"``, see
    :func:`text_tail_of`) -> ``("inject", 20)``; ``"captured"`` -> ``("captured", None)``.
    Any of them may end in ``-bestfirst`` (:func:`memory_order_of`).

    Raises:
        ValueError: anything else.
    """
    name = _without_order(name)
    if name in ("text", "captured"):
        return name, None
    head, _, tail = name.partition("-tail")
    if head.startswith("inject-w") and head[len("inject-w"):].isdigit() and (not _ or tail.isdigit()):
        return "inject", int(head[len("inject-w"):])
    raise ValueError(f"unknown mode {name!r}: use text, inject-w<N> (N = context window in turns), "
                     "inject-w<N>-tail<M> (the M best memories as text after the injected rest) or captured, "
                     "each optionally ending in -bestfirst (the best memory first, not last)")


def text_tail_of(name: str) -> int:
    """The text tail a mode names: ``"inject-w5-tail2"`` -> 2 (``GenerationOptions.text_tail``); else 0."""
    _, sep, tail = _without_order(name).partition("-tail")
    return int(tail) if sep and tail.isdigit() else 0


def evidence_recall(evidence: Sequence[str], memories: Sequence[dict]) -> float | None:
    """Share of ``evidence`` dialogue ids that are source turns of ``memories``; ``None`` without evidence."""
    if not evidence:
        return None
    found = {t for m in memories for t in m.get("source_turn_ids", ())}
    return sum(e in found for e in evidence) / len(evidence)


def answer_nll(memory: Memory, ref: ReferenceModel, user_id: str, question: str, answer: str, k: int,
               mode: str, w: int) -> float:
    """Mean NLL (nats per token) of ``answer`` after the prompt served in ``mode`` with top-``k``
    facts at context window ``w`` (missing KV encoded first)."""
    answer_ids = memory.tokenizer(answer, add_special_tokens=False).input_ids
    req = memory.prepare(question, user_id=user_id, k=k, context_window=w, mode=mode, wait_for_kv=True)
    if req.plan is None:
        return ref.answer_nll(req.prompt_token_ids, answer_ids)
    return ref.answer_nll(req.prompt_token_ids, answer_ids, memory.injected_kv(req))


def request_nll(memory: Memory, ref: ReferenceModel, req: PreparedRequest, answer_ids: Sequence[int]) -> float:
    """Mean NLL (nats per token) of ``answer_ids`` after the prompt of ``req``, with its planned KV."""
    if req.plan is None:
        return ref.answer_nll(req.prompt_token_ids, answer_ids)
    pool = memory.components.pool
    segments = [(seg.start, pool.get(seg.key)) for seg in req.plan.segments]
    missing = [seg.key for seg, (_, kv) in zip(req.plan.segments, segments) if kv is None]
    if missing:
        raise RuntimeError(f"planned KV left the pool before it was read: {missing[:3]}")
    return ref.answer_nll(req.prompt_token_ids, answer_ids, segments)


def run(data: Path, out_dir: Path, store_dir: Path, *, tuning: Sequence[int] = (0, 1, 2),
        held_out: Sequence[int] = (3, 4, 5, 6, 7, 8, 9), tuning_questions: int = 5, questions: int = 29,
        ks: Sequence[int] = (10, 50), modes: Sequence[str] = MODES, max_tokens: int = 24, dtype: str = "auto",
        concurrency: int = 4, capture_traffic: int | None = None, fresh: bool = False,
        report_only: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``quality.{jsonl,json,md,png}`` to ``out_dir``.

    Args:
        tuning / held_out: LoCoMo conversation indices of each split.
        tuning_questions / questions: questions per conversation in each split (categories
            1-4, spread evenly; conversations with fewer give all they have).
        ks: memories per request. modes: see :func:`parse_mode` (``text`` is always scored:
            every comparison is against it). max_tokens: answer budget (tokens).
        concurrency: questions in flight (vLLM batches their generations; greedy answers).
        capture_traffic: how many of a conversation's other questions are served before its
            answers in the ``captured`` mode (spread evenly; ``None``: all of them).
        report_only: summarize what ``out_dir`` holds without answering more.

    Returns:
        The summary written to ``quality.json``.

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
    """
    modes = list(dict.fromkeys(["text", *modes]))
    parsed = {m: parse_mode(m) for m in modes}
    convs = load_locomo(data)
    bad = [s for s in (*tuning, *held_out) if not 0 <= s < len(convs)]
    if bad or set(tuning) & set(held_out):
        raise ValueError(f"conversations must be distinct indices in 0..{len(convs) - 1}, got tuning {list(tuning)} "
                         f"and held-out {list(held_out)}")
    settings = {"tuning": [convs[s].sample_id for s in tuning], "held_out": [convs[s].sample_id for s in held_out],
                "tuning_questions": tuning_questions, "questions": questions, "ks": list(ks), "modes": modes,
                "max_tokens": max_tokens, "dtype": dtype, "data": str(data), "capture_traffic": capture_traffic}
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    picked: dict[int, list] = {}
    todo: list[tuple[str, int, int, int]] = []
    for split, indices, n in (("tuning", tuning, tuning_questions), ("held_out", held_out, questions)):
        for s in indices:
            picked[s] = pick_questions(convs[s], min(n, sum(q.category in (1, 2, 3, 4) for q in convs[s].qa)))
        for qi in range(n):  # question-major: a stopped run has answers from every conversation
            todo += [(split, s, qi, k) for s in indices if qi < len(picked[s]) for k in ks
                     if not log.done(_key(convs[s].sample_id, qi, k))]
    planned = sum(len(picked[s]) for s in (*tuning, *held_out)) * len(ks)
    memories: list[Memory] = []
    interrupted = False
    try:
        if todo and not report_only:
            # capture off: the inject modes serve encoded KV, never what the capture traffic captured
            base = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False, capture_kv=False)
            memories.append(base)
            base.components.kv.background.pause()  # KV is encoded on the request path (wait_for_kv)
            base.components.kv.keep_other_storages = True  # an encode keeps the captured KV beside it
            captured = None
            if "captured" in modes:
                captured = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False, engine=base.engine,
                                  context_window=CAPTURE_ONLY_W, capture_kv=True)
                memories.append(captured)
                captured.components.kv.background.pause()  # nothing encoded: captured KV or text
                captured.components.kv.keep_other_storages = True
            for s in sorted({job[1] for job in todo}):
                ensure_conversation(base, convs[s])
                _recall_rows(base, log, convs[s], picked[s], ks)
                if captured is not None:
                    _capture_traffic(captured, log, convs[s], picked[s], max(ks), capture_traffic)
            ref = base.reference_model()
            nll_lock = threading.Lock()

            def answer(job: tuple[str, int, int, int]) -> tuple[str, dict]:
                split, s, qi, k = job
                conv, qa = convs[s], picked[s][qi]
                gold = str(qa.answer)
                answer_ids = base.tokenizer(gold, add_special_tokens=False).input_ids
                t0 = time.perf_counter()
                row = {"split": split, "sample": conv.sample_id, "question": qi, "category": qa.category, "k": k,
                       "gold": gold}
                for name, (mode, w) in parsed.items():
                    mem = captured if mode == "captured" else base
                    options = mem.options(k=k, mode="text" if mode == "text" else "inject", max_tokens=max_tokens,
                                          temperature=0, context_window=CAPTURE_ONLY_W if w is None else w,
                                          wait_for_kv=mode == "inject", text_tail=text_tail_of(name),
                                          memory_order=memory_order_of(name))
                    req = mem.components.requests.prepare(Scope(scope_of(conv)), qa.question, options)
                    _check_sources(name, mode, req)
                    with nll_lock:  # one transformers forward at a time; vLLM batches the generations
                        nll = request_nll(mem, ref, req, answer_ids)
                    g = next(c.generation for c in generation_chunks(mem.engine, req) if c.generation is not None)
                    row[name] = {"answer": g.text, "f1": token_f1(g.text, gold), "nll": nll,
                                 "injected_tokens": g.num_injected_tokens, "prompt_tokens": g.num_prompt_tokens,
                                 "kv_memories": len(req.kv_memory_ids), "memories": len(req.hits)}
                row["seconds"] = time.perf_counter() - t0
                return _key(conv.sample_id, qi, k), row

            with ThreadPoolExecutor(concurrency) as pool:
                for key, row in tqdm(pool.map(answer, todo), total=len(todo), desc="quality", unit="question"):
                    log.add(key, row)
        log.commit()
    except KeyboardInterrupt:  # stopped by hand: summarize what is done (the run resumes later)
        interrupted = True
    finally:
        if len(memories) > 1:  # the captured mode's misses queued encodes at CAPTURE_ONLY_W: never to be run
            ids = [r.id for s in {job[1] for job in todo} for r in memories[1].components.facts.list(
                Scope(scope_of(convs[s])))]
            memories[1].components.kv.unschedule(ids)
        for mem in reversed(memories):
            mem.close()
    summary = summarize(log.all(), ks, modes)
    summary["settings"] = log.settings
    summary["answers_done"] = sum(1 for r in log.all() if "k" in r and "seconds" in r)
    summary["answers_planned"], summary["interrupted"] = planned, interrupted
    summary["machine"] = machine()
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_quality(summary, out_dir / f"{NAME}.png")
    return summary


def _check_sources(name: str, mode: str, req: PreparedRequest) -> None:
    """Each mode serves what it names: inject modes encoded KV only, ``captured`` captured KV or text.

    Raises:
        RuntimeError: another kind of KV was planned (the run would measure the wrong thing).
    """
    sources = set(req.kv_sources.values())
    if mode == "inject":
        wrong = {v for v in sources if v.endswith("(captured)") or (v.startswith("text") and v != "text: tail")}
    elif mode == "captured":
        wrong = {v for v in sources if not v.endswith("(captured)") and not v.startswith("text")}
    else:
        wrong = set()
    if wrong:
        raise RuntimeError(f"mode {name} was planned with {sorted(wrong)}: it must serve "
                           f"{'encoded KV only' if mode == 'inject' else 'captured KV or text only'} (a store with "
                           f"KV encoded at w={CAPTURE_ONLY_W} misleads the captured mode: use a fresh --store)")


def _key(sample: str, qi: int, k: int) -> str:
    return f"{sample}|q={qi}|k={k}"


def _recall_rows(memory: Memory, log: ResultLog, conv, picked: list, ks: Sequence[int]) -> None:
    """Evidence recall@k of each chosen question's retrieval (once per question)."""
    for qi, qa in enumerate(picked):
        key = f"{conv.sample_id}|q={qi}|recall"
        if not log.done(key):
            hits = memory.search(qa.question, user_id=scope_of(conv), limit=max(ks))["results"]
            log.add(key, {"sample": conv.sample_id, "question": qi, "category": qa.category,
                          "recall": {str(k): evidence_recall(qa.evidence, hits[:k]) for k in ks}})


def _capture_traffic(captured: Memory, log: ResultLog, conv, picked: list, k: int, n: int | None) -> None:
    """Serve ``n`` of the conversation's other questions (all: ``None``; spread evenly) once, one
    token each at top-``k``: the earlier traffic whose text-served memories are captured before
    the chosen questions are answered."""
    key = f"{conv.sample_id}|capture-traffic"
    user = scope_of(conv)

    def held() -> tuple[int, int]:
        records = captured.components.facts.list(Scope(user))
        return len(records), len(captured.components.pool.present(captured.components.kv.captured_keys(records)))

    logged = next((r for r in log.all() if r.get("key") == key), None)
    if logged is not None and held()[1] >= 0.9 * logged["captured"]:
        return  # done, and the store still holds what it captured (a resumed run on another store serves it again)
    chosen = {id(q) for q in picked}
    others = [q for q in conv.qa if id(q) not in chosen]
    if n is not None and n < len(others):
        others = [others[i * len(others) // n] for i in range(n)]
    start = time.monotonic()
    for qa in tqdm(others, desc=f"capture traffic {conv.sample_id}", unit="question"):
        captured.generate(qa.question, user_id=user, k=k, mode="inject", max_tokens=1, temperature=0)
    # the capture writer stores them at the lowest CPU priority: wait until they land (a
    # capture whose tokens the prompt did not hold never does, hence the bound)
    captured.components.kv.wait_for_captures(captured.components.kv.asked_captures(since=start), CAPTURE_LAND_S)
    memories, count = held()
    if logged is None:
        log.add(key, {"sample": conv.sample_id, "traffic_questions": len(others), "memories": memories,
                      "captured": count})


def _nll_change(pairs: Sequence[tuple[float, float]]) -> float:
    """Relative change of the mean NLL: ``mean(mode) / mean(text) - 1``."""
    return sum(m for _, m in pairs) / sum(t for t, _ in pairs) - 1


def _f1_change(pairs: Sequence[tuple[float, float]]) -> float:
    """Absolute change of the mean F1: ``mean(mode) - mean(text)``."""
    return sum(m - t for t, m in pairs) / len(pairs)


def _compare(rows: list[dict], mode: str) -> dict:
    """Mean NLL and F1 of ``mode`` over ``rows`` and, for a mode other than text, its paired change to text."""
    out = {"n": len(rows), "nll_mean": mean(r[mode]["nll"] for r in rows), "f1_mean": mean(r[mode]["f1"] for r in rows)}
    if mode != "text":
        nll = [(r["text"]["nll"], r[mode]["nll"]) for r in rows]
        f1 = [(r["text"]["f1"], r[mode]["f1"]) for r in rows]
        out.update(nll_change=_nll_change(nll), nll_change_ci=bootstrap(nll, _nll_change),
                   f1_change=_f1_change(f1), f1_change_ci=bootstrap(f1, _f1_change),
                   kv_share=mean(r[mode]["kv_memories"] / r[mode]["memories"] for r in rows if r[mode]["memories"]))
    return out


def summarize(rows: list[dict], ks: Sequence[int], modes: Sequence[str]) -> dict:
    """Per split, k and mode: mean NLL and F1 and the paired change to text with its interval;
    the same per LoCoMo category (held out); mean evidence recall@k; the capture traffic."""
    answers = [r for r in rows if "seconds" in r and "k" in r]
    cells, by_category = [], []
    for split in ("held_out", "tuning"):
        for k in ks:
            rs = [r for r in answers if r["split"] == split and r["k"] == k and all(m in r for m in modes)]
            if not rs:
                continue
            cells += [{"split": split, "k": k, "mode": m, **_compare(rs, m)} for m in modes]
            if split == "held_out":
                for cat in (1, 2, 3, 4):
                    if cr := [r for r in rs if r["category"] == cat]:
                        by_category += [{"k": k, "category": cat, "mode": m, **_compare(cr, m)} for m in modes]
    recalls = [r for r in rows if "recall" in r]
    recall = []
    for k in ks:
        vals = [r["recall"][str(k)] for r in recalls if r["recall"].get(str(k)) is not None]
        recall.append({"k": k, "n": len(vals), "recall_mean": mean(vals) if vals else float("nan")})
    traffic = [r for r in rows if "traffic_questions" in r]
    return {"cells": cells, "by_category": by_category, "recall": recall, "capture_traffic": traffic}


def _pct(value: float) -> str:
    return f"{value:+.1%}"


def _cell_row(c: dict) -> list:
    if c["mode"] == "text":
        return [c["mode"], c["n"], f"{c['nll_mean']:.3f}", "", f"{c['f1_mean']:.3f}", "", ""]
    lo, hi = c["nll_change_ci"]
    flo, fhi = c["f1_change_ci"]
    return [c["mode"], c["n"], f"{c['nll_mean']:.3f}", f"{_pct(c['nll_change'])} [{_pct(lo)}, {_pct(hi)}]",
            f"{c['f1_mean']:.3f}", f"{c['f1_change']:+.3f} [{flo:+.3f}, {fhi:+.3f}]", f"{c['kv_share']:.0%}"]


_HEAD = ["mode", "answers", "gold NLL (nats/token)", "NLL vs text [95% CI]", "token F1", "F1 vs text [95% CI]",
         "memories as KV"]


def to_markdown(summary: dict) -> str:
    """Tables of the summary: held out and tuning set per k, held out by category, recall."""
    s = summary["settings"]
    parts = [f"# Quality: prompt text vs injected KV\n\nLoCoMo, paired answers (the same question and memories in "
             f"every mode); greedy answers of up to {s['max_tokens']} tokens; dtype {s['dtype']}. Held out "
             f"{', '.join(s['held_out'])} ({s['questions']} questions each); tuning set {', '.join(s['tuning'])} "
             f"({s['tuning_questions']} each). NLL change: mean NLL of the mode over text's, minus 1 (negative is "
             f"better); F1 change: mode minus text; 95% bootstrap intervals over answers resampled in pairs. "
             f"\"memories as KV\": the share injected (the rest prefilled as text)."]
    machine = summary.get("machine")
    modes = ",".join(s["modes"])
    parts.append(f"Reproduce: `inferscale bench quality --out <folder>"
                 + ("" if modes == ",".join(MODES) else f" --modes {modes}") + "` (it resumes what the folder holds)."
                 + (f" Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, vLLM "
                    f"{machine.get('vllm')}; report written at commit {machine['commit']}." if machine else ""))
    if summary.get("answers_done", 0) < summary.get("answers_planned", 0):
        parts.append(f"**Partial run**: {summary['answers_done']} of {summary['answers_planned']} (question, k) "
                     f"pairs answered so far; `inferscale bench quality --out <this folder>` resumes it.")
    for split, title in (("held_out", "Held out"), ("tuning", "Tuning set (where settings were chosen)")):
        for k in s["ks"]:
            cells = [c for c in summary["cells"] if c["split"] == split and c["k"] == k]
            if cells:
                parts.append(f"## {title}, k = {k}\n\n" + markdown_table(_HEAD, [_cell_row(c) for c in cells]))
    for k in s["ks"]:
        cats = [c for c in summary.get("by_category", []) if c["k"] == k]
        if cats:
            rows = [[f"{c['category']} {CATEGORIES[c['category']]}", *_cell_row(c)] for c in cats]
            parts.append(f"## Held out by LoCoMo category, k = {k}\n\n" + markdown_table(["category", *_HEAD], rows))
    parts.append("## Retrieval (evidence recall@k of the chosen questions)\n\n" + markdown_table(
        ["k", "questions with evidence", "recall@k"],
        [[r["k"], r["n"], f"{r['recall_mean']:.3f}"] for r in summary["recall"]]))
    if summary.get("capture_traffic"):
        parts.append("## Capture traffic (mode `captured`)\n\nBefore a conversation's answers, its other questions "
                     "were served once at the largest k with capture on and no encoder:\n\n" + markdown_table(
                         ["conversation", "traffic questions", "memories", "with captured KV"],
                         [[t["sample"], t["traffic_questions"], t["memories"], t["captured"]]
                          for t in summary["capture_traffic"]]))
    return "\n\n".join(parts) + "\n"
