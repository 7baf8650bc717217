"""The main job end to end: a LoCoMo conversation in, KV-injected answers out of vLLM."""

from __future__ import annotations

import statistics
import time
from datetime import date
from pathlib import Path

from rich.console import Console
from rich.table import Table

from inferscale.config import default_data_dir
from inferscale.datasets.locomo import default_locomo_path, load_locomo, store_conversation, token_f1
from inferscale.memory import Memory


def summary_table(rows: list[dict], k: int) -> Table:
    """The demo's summary: median TTFT per mode, ratio, mean token F1."""
    table = Table(title=f"Summary over {len(rows)} question{'' if len(rows) == 1 else 's'} (k={k})")
    for col in ("mode", "median TTFT (ms)", "mean TTFT (ms)", "prefilled tokens (mean)", "token F1 (mean)"):
        table.add_column(col)
    for mode in ("inject", "text"):
        ttft = [r[f"{mode}_ttft"] * 1000 for r in rows]
        table.add_row(
            mode,
            f"{statistics.median(ttft):.1f}",
            f"{statistics.mean(ttft):.1f}",
            f"{statistics.mean(r[f'{mode}_prefilled'] for r in rows):.0f}",
            f"{statistics.mean(r[f'{mode}_f1'] for r in rows):.3f}",
        )
    return table


def run_demo(
    *, data: Path | None, sample: int, questions: int, k: int, context_window: int, dtype: str,
    data_dir: Path | None, console: Console,
) -> list[dict]:
    """Run the demo and print per-question lines and a summary; returns the rows."""
    path = data or default_locomo_path()
    samples = load_locomo(path)
    if not 0 <= sample < len(samples):
        raise ValueError(f"--sample must be in 0..{len(samples) - 1}, got {sample}")
    conv = samples[sample]
    picked = [q for q in conv.qa if q.category in (1, 2, 3, 4)][:questions]
    if not picked:
        raise ValueError(f"sample {sample} has no questions of categories 1-4 to answer")
    user_id = f"locomo-{conv.sample_id}"
    console.print(f"[bold]LoCoMo {conv.sample_id}[/]: {len(conv.turns)} turns, {len(conv.facts)} facts, from {path}")
    memory = Memory(data_dir=data_dir or default_data_dir() / "demo", dtype=dtype, context_window=context_window)
    try:
        added = store_conversation(memory, conv, user_id, progress="ingest (embed + Chroma)")
        console.print(f"stored {added} new facts")
        memory.wait_for_kv(progress=True)  # the demo compares steady-state serving: every fact's KV encoded
        console.print(f"KV pool on disk: {memory.kv_footprint()['disk'] / 2**20:.1f} MiB")

        console.print("warming up both modes (the first requests pay one-off costs)...")
        for mode in ("inject", "text"):  # first requests pay one-off start-up costs
            memory.generate("What do you remember?", user_id=user_id, k=k, mode=mode, max_tokens=2)

        rows = []
        for i, qa in enumerate(picked, 1):
            inj = memory.generate(qa.question, user_id=user_id, k=k, mode="inject", max_tokens=32)
            txt = memory.generate(qa.question, user_id=user_id, k=k, mode="text", max_tokens=32)
            row = {
                "question": qa.question, "gold": qa.answer, "category": qa.category,
                "inject_answer": inj.text, "text_answer": txt.text,
                "inject_f1": token_f1(inj.text, qa.answer), "text_f1": token_f1(txt.text, qa.answer),
                "inject_ttft": inj.ttft_s, "text_ttft": txt.ttft_s,
                "inject_prefilled": inj.num_prefilled_tokens, "text_prefilled": txt.num_prefilled_tokens,
                "prompt_tokens": inj.num_prompt_tokens, "injected_tokens": inj.num_injected_tokens,
            }
            rows.append(row)
            console.print(
                f"[bold]Q{i}[/] (cat {qa.category}) {qa.question}\n"
                f"  answer: {inj.text!r}\n  gold:   {qa.answer!r}   F1 {row['inject_f1']:.2f}"
                f" (text mode F1 {row['text_f1']:.2f})\n"
                f"  TTFT inject {inj.ttft_s * 1000:.1f} ms ({inj.num_injected_tokens} of {inj.num_prompt_tokens}"
                f" prompt tokens injected) vs text {txt.ttft_s * 1000:.1f} ms"
            )
        console.print(summary_table(rows, k))
        ratio = statistics.median(r["text_ttft"] for r in rows) / statistics.median(r["inject_ttft"] for r in rows)
        console.print(f"median TTFT text / inject = {ratio:.2f}x at k={k}, w={context_window}, dtype={memory.config.resolved_dtype}")
    finally:  # now, not at exit: the engine's stop (about 10 s on a CPU) is said before the last line
        memory.close()
    return rows


def write_page(path: Path, transcript: str, command: str, wall_s: float) -> None:
    """Write the demo's results page (``docs/results/demo.md``) from a run's transcript, so the
    page shows what ``inferscale demo`` prints, never a hand-edited copy.

    Args:
        transcript: what the run printed (the console's recording).
        command: the command line that ran, as a user would type it.
        wall_s: the run's wall time (seconds).
    """
    from inferscale.bench.common import machine

    m = machine()
    where = (f"{m['cpu']}, {m['cores']} cores, {m.get('memory_gib')} GiB, {m.get('gpu') or 'no GPU'}; "
             f"torch {m['torch']}, vLLM {m.get('vllm')}, in-process engine")
    minutes, seconds = divmod(round(wall_s), 60)
    text = (
        "# Demo run: LoCoMo, KV injection vs prompt text\n\n"
        f"Written by `{command}` (the page is that run's transcript; run it again to refresh it).\n\n"
        f"Machine: {where}. Wall time {minutes} min {seconds:02d} s (ingest and KV encoding included), "
        f"{date.today():%d %B %Y}.\n\n"
        "TTFT is measured from submission to the engine to the first generated token; both modes send the "
        "same prompt token ids (inject: the memory block's KV comes from the connector; text: vLLM prefills it).\n\n"
        f"```\n{transcript.rstrip()}\n```\n\n"
        "The answers come from SmolLM2-135M (4-bit weights dequantized): often wrong, for both modes alike; the "
        "run shows the mechanism and the TTFT, not answer quality.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def timed_demo(**kwargs) -> tuple[list[dict], float]:
    """:func:`run_demo` and its wall time (seconds)."""
    start = time.perf_counter()
    rows = run_demo(**kwargs)
    return rows, time.perf_counter() - start
