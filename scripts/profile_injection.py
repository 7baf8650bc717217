"""Where the TTFT of an injected request goes: KV load vs the forward pass over a longer context.

For each question of one LoCoMo conversation, three requests are served back to back
through one engine (``max_tokens=1``, every fact's KV encoded and in the connector's
device tier beforehand):

1. ``inject k=0``: only the preamble and the question;
2. ``inject k=K``: K facts' KV gathered, rotated and written by the connector, then the
   question prefilled over the longer context;
3. the same request again: vLLM's prefix cache now holds the memory block (same plan,
   same cache salt), so nothing is loaded and only the question is prefilled: the forward
   pass over the longer context, without the injection.

The connector's own counters (vLLM's ``KVConnectorStats``: time gathering the segments
from the pool, time rotating and writing every layer, tokens) come back through the
engine's stat logger. So ``TTFT(2) - TTFT(3)`` is the injection's cost and
``TTFT(3) - TTFT(1)`` the cost of attending to K more facts, which no connector can remove.

Reproduce: ``.venv/bin/python scripts/profile_injection.py [--k 50] [--questions 12] [--w 20]``
(uses the benchmarks' store under ``<data dir>/bench``; prints a Markdown table).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from inferscale.bench.common import ensure_conversation, pick_questions, scope_of
    from inferscale.bench.latency import warm_kv
    from inferscale.config import default_data_dir
    from inferscale.datasets.locomo import default_locomo_path, load_locomo
    from inferscale.memory import Memory

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--w", type=int, default=20)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--sample", type=int, default=0)
    args = ap.parse_args()

    conv = load_locomo(default_locomo_path())[args.sample]
    memory = Memory(data_dir=default_data_dir() / "bench", dtype="float32", precompute_kv=False)
    user = scope_of(conv)
    ensure_conversation(memory, conv)
    questions = [q.question for q in pick_questions(conv, args.questions)]
    warm_kv(memory, user, questions, args.k, [args.w])
    memory.generate("What do you remember about me?", user_id=user, k=1, context_window=args.w, max_tokens=1)
    stats = memory.engine.batch_stats

    def serve(question: str, k: int) -> tuple[float, dict]:
        time.sleep(0.2)  # let the stat logger see the previous step
        before = dict(stats.connector)
        g = memory.generate(question, user_id=user, k=k, context_window=args.w, max_tokens=1)
        time.sleep(0.2)
        delta = {name: stats.connector.get(name, 0) - before.get(name, 0) for name in stats.connector}
        return g.ttft_s * 1000, delta

    rows = {"k0": [], "inject": [], "cached": [], "stage": [], "write": [], "tokens": [], "disk": []}
    for q in questions:
        rows["k0"].append(serve(q, 0)[0])
        ttft, d = serve(q, args.k)
        rows["inject"].append(ttft)
        rows["stage"].append(d.get("stage_s", 0) * 1000)
        rows["write"].append(d.get("write_s", 0) * 1000)
        rows["tokens"].append(d.get("injected_tokens", 0))
        rows["disk"].append(d.get("disk_reads", 0))
        rows["cached"].append(serve(q, args.k)[0])
    med = {name: statistics.median(v) for name, v in rows.items()}
    print(f"\nLoCoMo {conv.sample_id}, {len(questions)} questions, k={args.k}, w={args.w}, "
          f"{med['tokens']:.0f} injected tokens (median), disk reads during loads: {sum(rows['disk'])}\n")
    print("| what | median (ms) |\n|---|---|")
    print(f"| TTFT inject k=0 | {med['k0']:.1f} |")
    print(f"| TTFT inject k={args.k} | {med['inject']:.1f} |")
    print(f"| TTFT k={args.k}, memory block from vLLM's prefix cache (no load) | {med['cached']:.1f} |")
    print(f"| connector: gather segments from the pool (stage) | {med['stage']:.1f} |")
    print(f"| connector: rotate + write all layers | {med['write']:.1f} |")
    print(f"\nratios of medians: inject k={args.k} / k=0 = {med['inject'] / med['k0']:.2f}x; "
          f"prefix-cached k={args.k} / k=0 = {med['cached'] / med['k0']:.2f}x")
    memory.close()


if __name__ == "__main__":
    main()
