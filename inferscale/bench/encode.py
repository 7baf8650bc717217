"""``inferscale bench encode``: who computes the KV, the serving engine or a transformers copy.

Both arms in one run, on one machine, each an embedded :class:`~inferscale.Memory` over LoCoMo
(its turns logged, its observations stored as facts at the configured context window), the
``engine`` arm with ``kv_encoder="engine"`` (a prefill-only request per fact at priority 1 in
vLLM's priority scheduling, :mod:`inferscale.kv.engine_encoder`), the ``transformers`` arm with
the model loaded in the process (the encoder before issue 51). Per arm:

- **TTFT under encoding**: ``questions`` LoCoMo questions of a scope whose KV is ready, asked
  one after another with nothing queued, then again right after ``facts`` more facts were
  queued (the encoder busy): p50 and p99 of each, and their ratio; what is still queued when
  the questions end is dropped (the queue stays busy through every question: checked);
- **encode throughput**: ``throughput_facts`` other facts queued, then the seconds until
  ``wait_for_kv`` returns (facts per second; the engine already started, the transformers
  model already loaded);
- **a question right after ``add``** against the same question once its KV is ready (TTFT);
- **weights in the adding process**: bytes of causal-LM parameters alive in this process
  after the encodes (the transformers copy; 0 when the engine encodes).

Writes ``encode.json`` and ``encode.md`` to ``out``. TTFT is vLLM's (submission to first token,
:class:`~inferscale.types.Generation`), seconds; ratios compare arms of one run.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from pathlib import Path

import torch

from inferscale.bench.common import machine, markdown_table, percentile, write_outputs
from inferscale.datasets.locomo import load_locomo
from inferscale.memory import Memory
from inferscale.types import FactInput

#: facts of the scope whose questions are timed (its KV encoded before any timing)
READY_FACTS = 60
ARMS = ("engine", "transformers")  # the engine first: the transformers arm's model outlives its memory


def llm_weight_bytes() -> int:
    """Bytes of the parameters of every causal LM alive in this process."""
    total = 0
    for o in gc.get_objects():
        if isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM"):
            total += sum(p.numel() * p.element_size() for p in o.parameters())
    return total


def _ttfts(m: Memory, questions: list[str], user: str) -> list[float]:
    return [m.generate(q, user_id=user, max_tokens=1, k=10).ttft_s for q in questions]


def run_arm(arm: str, data: Path, store: Path, *, facts: int, questions: int, dtype: str,
            throughput_facts: int = 200) -> dict:
    """One arm (module docstring); returns its figures."""
    samples = load_locomo(data)
    ready, busy = samples[0], samples[1:]
    shutil.rmtree(store, ignore_errors=True)
    out: dict = {"arm": arm}
    with Memory(data_dir=store, dtype=dtype, kv_encoder=arm) as m:
        kv = m.components.kv
        for s in samples:
            m.log_turns([{"id": t.dia_id, "name": t.speaker, "content": t.text} for t in s.turns],
                        user_id=f"locomo-{s.sample_id}")
        asker = f"locomo-{ready.sample_id}"
        m.add_facts([FactInput(f.dated_text(), f.dia_ids) for f in ready.facts[:READY_FACTS]], user_id=asker)
        m.wait_for_kv()  # starts the engine (engine arm) or loads the model (transformers arm)
        qs = [q.question for q in ready.qa[:questions]]
        _ttfts(m, qs[:3], asker)  # warm
        calm = _ttfts(m, qs, asker)
        pool = [(f"locomo-{s.sample_id}", FactInput(f.dated_text(), f.dia_ids)) for s in busy for f in s.facts]
        if len(pool) < facts + throughput_facts:
            raise ValueError(f"--facts {facts} and --throughput-facts {throughput_facts}: LoCoMo's other "
                             f"conversations hold {len(pool)} facts, fewer than {facts + throughput_facts}")

        def queue(batch):
            by_user: dict[str, list[FactInput]] = {}
            for user, f in batch:
                by_user.setdefault(user, []).append(f)
            for user, fs in by_user.items():
                m.add_facts(fs, user_id=user)

        kv.background.pause()
        queue(pool[:facts])
        kv.background.resume()
        loaded = _ttfts(m, qs, asker)  # while the encoder works through the queue
        pending_after = m.pending_kv()
        if pending_after == 0:
            raise ValueError(f"--facts {facts}: the queue ran dry before the {questions} questions ended; queue more")
        kv.background.pause()
        kv.jobs.clear()  # the rest of the queue is not timed: dropped, not waited for
        kv.background.wait_idle()
        out.update(ttft_calm_s=calm, ttft_encoding_s=loaded, pending_after_questions=pending_after, queued=facts)
        queue(pool[facts:facts + throughput_facts])
        t0 = time.perf_counter()
        kv.background.resume()
        m.wait_for_kv()
        out["encode_s"] = time.perf_counter() - t0
        out["throughput_facts"] = throughput_facts
        out["facts_per_s"] = throughput_facts / out["encode_s"]
        fresh = m.add("My locker at the gym is number 4417.", user_id="fresh")["results"][0]["id"]
        right_after = m.generate("What is my locker number?", user_id="fresh", max_tokens=1)
        m.wait_for_kv()
        ready_kv = m.generate("What is my locker number?", user_id="fresh", max_tokens=1)
        out.update(after_add_ttft_s=right_after.ttft_s, after_add_sources=right_after.kv_sources.get(fresh),
                   ready_ttft_s=ready_kv.ttft_s, ready_sources=ready_kv.kv_sources.get(fresh),
                   llm_weight_bytes=llm_weight_bytes(), engine_encodes=kv.engine_encodes)
    shutil.rmtree(store, ignore_errors=True)
    return out


def run(data: Path, out: Path, *, facts: int = 1000, questions: int = 40, dtype: str = "auto",
        served: bool = True, served_facts: int = 50, throughput_facts: int = 200) -> dict:
    """Both arms (module docstring), embedded and (``served``) through ``inferscale serve``
    (:mod:`inferscale.bench.encode_served`, ``served_facts`` LoCoMo observations added over
    HTTP); writes ``encode.json`` and ``encode.md`` to ``out``.

    Raises:
        ValueError: ``facts`` or ``questions`` more than LoCoMo holds.
        RuntimeError: a served arm's server did not start.
    """
    out.mkdir(parents=True, exist_ok=True)
    arms = {arm: run_arm(arm, data, out / f"encode-store-{arm}", facts=facts, questions=questions, dtype=dtype,
                         throughput_facts=throughput_facts)
            for arm in ARMS}
    fronts = {}
    if served:
        from inferscale.bench.encode_served import served_arm

        texts = [f.dated_text() for f in load_locomo(data)[0].facts[:served_facts]]
        for arm in ARMS:
            store = out / f"encode-store-served-{arm}"
            shutil.rmtree(store, ignore_errors=True)
            try:
                fronts[arm] = served_arm(arm, store, texts, dtype=dtype)
            finally:
                shutil.rmtree(store, ignore_errors=True)
    rows = []
    for arm, r in arms.items():
        p50c, p99c = percentile(r["ttft_calm_s"], 50), percentile(r["ttft_calm_s"], 99)
        p50l, p99l = percentile(r["ttft_encoding_s"], 50), percentile(r["ttft_encoding_s"], 99)
        r.update(p50_ratio=p50l / p50c, p99_ratio=p99l / p99c, after_add_ratio=r["after_add_ttft_s"] / r["ready_ttft_s"])
        rows.append([arm, f"{r['facts_per_s']:.1f}", f"{p50c * 1000:.0f} / {p99c * 1000:.0f}",
                     f"{p50l * 1000:.0f} / {p99l * 1000:.0f}", f"{r['p50_ratio']:.2f}x / {r['p99_ratio']:.2f}x",
                     f"{r['after_add_ttft_s'] * 1000:.0f} ({r['after_add_sources']}) vs {r['ready_ttft_s'] * 1000:.0f}: "
                     f"{r['after_add_ratio']:.2f}x", f"{r['llm_weight_bytes'] / 2**20:.0f} MiB"])
    served_rows = [[arm, f"{r['front_rss_ready_bytes'] / 2**20:.0f}", f"{r['front_rss_after_kv_bytes'] / 2**20:.0f}",
                    f"{statistics.median(r['after_add_ttft_s']) * 1000:.0f} vs "
                    f"{statistics.median(r['ready_ttft_s']) * 1000:.0f}: {r['after_add_ratio']:.2f}x",
                    ", ".join(sorted({s for ss in r["after_add_sources"] for s in ss}))]
                   for arm, r in fronts.items()]
    where = machine()
    page = "\n\n".join([
        "# Who computes the KV: the serving engine against a transformers copy",
        f"`inferscale bench encode --facts {facts} --questions {questions} --throughput-facts {throughput_facts}`: "
        "both arms in one run, embedded "
        "(module docstring of `inferscale/bench/encode.py`). TTFT in ms, vLLM's. "
        f"Run {time.strftime('%Y-%m-%d', time.gmtime())} on {where['cpu']}, {where['cores']} cores, "
        f"{where['gpu'] or 'no GPU'}, torch {where['torch']}, vLLM {where['vllm']}, commit {where['commit']}, "
        f"dtype {dtype}.",
        markdown_table(["encoder", f"encodes / s ({throughput_facts} queued)", "TTFT p50 / p99, nothing queued",
                        f"TTFT p50 / p99, {facts} encodes queued", "ratio p50 / p99",
                        "question right after add vs on ready KV", "LLM weights in the adding process"], rows),
        *([f"## Served: one `inferscale serve` per encoder ({served_facts} facts added over HTTP)\n\n"
           "The front's resident memory (MiB) once ready and once the facts' KV is made; a question right "
           "after add against the same question on ready KV, TTFT in ms measured by the client (streamed, "
           "medians of 5), and the sources the chat's report gave the new memory right after add.",
           markdown_table(["encoder", "front RSS ready", "front RSS after KV", "question right after add vs ready",
                           "source right after add"], served_rows)] if fronts else []),
    ])
    write_outputs(out, "encode", {"facts": facts, "questions": questions, "throughput_facts": throughput_facts,
                                  "dtype": dtype, "arms": arms,
                                  "served": fronts}, page)
    return arms
