"""Where the CPU goes when ``inferscale serve`` answers many users at once, inject vs text.

Starts ``inferscale serve`` over the benchmarks' store (as ``inferscale bench serve`` does,
after that benchmark has stored its users), warms the KV into the connector's device
tier, then runs one level of ``--users`` concurrent users per mode and prints, per mode:

- requests/s over the level;
- CPU seconds of each process of the server (the front, vLLM's API server, its engine
  core, its worker) during the level (``psutil``), so the front's share is visible;
- with ``--py-spy``: a sampling profile of vLLM's worker process (py-spy, 50 Hz, native
  frames off) over the level, folded into the model's attention, its linear layers and
  MLP, the connector's load (rotate + write of the injected KV, which the whole batch
  waits for), the logits/sampler and the rest, as shares of the samples.

Reproduce: ``inferscale bench serve`` (stores the users), then
``.venv/bin/python scripts/profile_serve.py --users 16 [--py-spy]``
(py-spy is in the dev extras). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

#: (share name, substring of a frame of the worker's stack), in priority order: a sample
#: goes to the first entry that any of its frames matches, so the connector's load counts
#: as the connector although it runs inside vLLM's execute_model, and attention as
#: attention although it runs inside the model's forward.
CATEGORIES = (
    ("connector load (rotate + write)", "start_load_kv"),
    ("attention", "unified_attention_with_output"),
    ("linear layers + MLP", "LinearBase"),
    ("linear layers + MLP", "ColumnParallelLinear.forward"),
    ("linear layers + MLP", "RowParallelLinear.forward"),
    ("linear layers + MLP", "SiluAndMul"),
    ("logits + sampling", "LogitsProcessor.forward"),
    ("logits + sampling", "sample_tokens"),
    ("rest of the forward (norms, RoPE, embedding)", "LlamaModel.forward"),
    ("rest of the forward (norms, RoPE, embedding)", "_model_forward"),
    ("input preparation", "_prepare_inputs"),
    ("input preparation", "_update_states"),
)


class _Rows:
    """A stand-in for the benchmark's ResultLog: keeps the level's row."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, _key: str, row: dict) -> None:
        self.rows.append(row)


def _cpu_seconds(root) -> dict[tuple[int, str], float]:
    import psutil

    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            times = p.cpu_times()
            name = p.name() if "VLLM" in p.name() else " ".join(p.cmdline()[1:4])
            out[(p.pid, name)] = times.user + times.system
        except psutil.Error:
            pass
    return out


def fold(raw: Path) -> Counter:
    """Shares of py-spy's raw (collapsed-stack) samples per category of :data:`CATEGORIES`."""
    shares: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        total += int(count)
        frames = stack.split(";")
        name = next((c for c, needle in CATEGORIES if any(needle in f for f in frames)),
                    "idle / waiting for the scheduler")
        shares[name] += int(count)
    return Counter({k: v / total for k, v in shares.items()}) if total else shares


def main() -> None:
    import psutil

    from inferscale.bench import serve as bench
    from inferscale.bench.throughput import user_plan
    from inferscale.config import default_data_dir
    from inferscale.datasets.locomo import default_locomo_path, load_locomo

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--requests-per-user", type=int, default=4)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="inject,text")
    ap.add_argument("--py-spy", action="store_true", help="profile vLLM's worker with py-spy during each level")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(__import__("sys").executable).with_name("py-spy"))
    if args.py_spy and not Path(spy).exists():
        raise SystemExit("py-spy not found: pip install py-spy (it is in the dev extras)")
    store = default_data_dir() / "bench"
    plan = user_plan(load_locomo(default_locomo_path()), args.users, 40, args.requests_per_user)
    tmp = Path(tempfile.mkdtemp(prefix="profile-serve-"))
    server = bench.ServerProcess(store, "auto", max(32, args.users), tmp / "serve.log")
    lines = ["| mode | users | requests/s | process | CPU s |", "|---|---|---|---|---|"]
    shares = {}
    try:
        server.wait_ready()
        root = psutil.Process(server.proc.pid)
        worker = next(p for p in root.children(recursive=True) if "Worker" in p.name())
        # the warm-up runs once, outside the timed levels
        asyncio.run(bench._measure(server, plan, [], _Rows(), k=args.k, w=0, max_tokens=1, ignore_eos=False))
        for mode in args.modes.split(","):
            rows = _Rows()
            before = _cpu_seconds(root)
            proc = None
            if args.py_spy:
                proc = subprocess.Popen([spy, "record", "-p", str(worker.pid), "-r", "50", "-f", "raw", "-o",
                                         str(tmp / f"{mode}.txt"), "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)
            asyncio.run(bench._measure(server, plan, [(args.users, mode)], rows, k=args.k, w=0,
                                       max_tokens=args.max_tokens, ignore_eos=True, warm=False))
            if proc is not None:
                proc.send_signal(2)  # SIGINT: py-spy writes what it sampled
                proc.wait(60)
                shares[mode] = fold(tmp / f"{mode}.txt")
            after = _cpu_seconds(root)
            row = rows.rows[0]
            rate = row["requests"] / row["wall_s"]
            for (pid, name), cpu in after.items():
                lines.append(f"| {mode} | {args.users} | {rate:.2f} | {name} | {cpu - before.get((pid, name), 0):.1f} |")
    finally:
        server.stop()
    print("\n".join(lines))
    for mode, share in shares.items():
        print(f"\nvLLM worker, {mode} ({args.users} users), share of py-spy samples:\n")
        print("| where | share |\n|---|---|")
        for name, v in share.most_common():
            print(f"| {name} | {v * 100:.1f}% |")


if __name__ == "__main__":
    main()
