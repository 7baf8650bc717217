"""The search-visibility delay between API workers (issue 14): how long after a write is
acknowledged by one ``inferscale serve`` worker a search through another finds it.

Starts a Chroma server (``chroma run``) and ``inferscale serve --workers N`` over it (the
turn log and history in SQLite in the data dir, or in ``--database-url``), then runs
``--pairs`` add -> search pairs from ``--threads`` client threads, each request on a new
connection so the kernel spreads them over the workers (``X-InferScale-Worker`` says which
one answered). After each acknowledged add, the client searches at once and, if the fact is
not found, again every 5 ms for up to 5 s. The delay is from receiving the add's response
to receiving the first search response that holds the fact.

    .venv/bin/python scripts/visibility_delay.py [--pairs 400] [--workers 2] [--threads 4] \\
        [--database-url postgresql+psycopg://...] [--out docs/results/visibility.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferscale.bench.common import machine, print_page
from inferscale.server.ports import free_port

KEY = "visibility-bench"
HEADERS = {"Authorization": f"Bearer {KEY}", "Connection": "close"}


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[0]} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, headers=HEADERS, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"not ready after {timeout:.0f} s: {url}")


def one_pair(base: str, n: int) -> dict:
    user = f"user{n % 8}"
    text = f"{user} parked the car on level {n} of the garage."
    t0 = time.perf_counter()
    r = httpx.post(base + "/memories", headers=HEADERS, timeout=120,
                   json={"messages": [{"role": "user", "content": text}], "user_id": user, "infer": False})
    r.raise_for_status()
    acked = time.perf_counter()
    memory_id = r.json()["results"][0]["id"]
    tries = 0
    while True:
        tries += 1
        s = httpx.post(base + "/search", headers=HEADERS, timeout=120,
                       json={"query": text, "user_id": user, "limit": 100})
        s.raise_for_status()
        if memory_id in {m["id"] for m in s.json()["results"]}:
            break
        if time.perf_counter() - acked > 5:
            raise RuntimeError(f"{memory_id} not visible 5 s after its add was acknowledged")
        time.sleep(0.005)
    return {"add_ms": (acked - t0) * 1e3, "delay_ms": (time.perf_counter() - acked) * 1e3, "tries": tries,
            "cross": r.headers["x-inferscale-worker"] != s.headers["x-inferscale-worker"]}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--database-url", default=None, help="default: SQLite files in the data dir")
    parser.add_argument("--out", type=Path, default=None, help="write the results as markdown here")
    args = parser.parse_args()
    if args.pairs < 1 or args.workers < 2 or args.threads < 1:
        parser.error("--pairs >= 1, --workers >= 2, --threads >= 1")
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out} is a folder: give a file path")
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="inferscale-visibility-") as tmp:
        root = Path(tmp)
        chroma_port, port = free_port(), free_port()
        chroma_log, serve_log = root / "chroma.log", root / "serve.log"
        chroma = subprocess.Popen([str(bin_dir / "chroma"), "run", "--path", str(root / "chroma"), "--host",
                                   "127.0.0.1", "--port", str(chroma_port)], stdout=chroma_log.open("w"),
                                  stderr=subprocess.STDOUT)
        env = {**os.environ, "INFERSCALE_API_KEY": KEY, "INFERSCALE_CHROMA_URL": f"http://127.0.0.1:{chroma_port}",
               "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(512 << 20)}
        if args.database_url:
            env["INFERSCALE_DATABASE_URL"] = args.database_url
        serve = None
        try:
            wait_for(f"http://127.0.0.1:{chroma_port}/api/v2/heartbeat", chroma, chroma_log)
            serve = subprocess.Popen([str(bin_dir / "inferscale"), "serve", "--port", str(port), "--data-dir",
                                      str(root / "data"), "--workers", str(args.workers)],
                                     stdout=serve_log.open("w"), stderr=subprocess.STDOUT, env=env)
            base = f"http://127.0.0.1:{port}"
            wait_for(base + "/ready", serve, serve_log)
            with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
                rows = list(pool.map(lambda n: one_pair(base, n), range(args.pairs)))
        finally:
            for proc in (serve, chroma):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=120)
    cross = [r for r in rows if r["cross"]]
    same = [r for r in rows if not r["cross"]]
    lines = [
        "# Search visibility between API workers",
        "",
        f"Command: `.venv/bin/python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"Machine: {machine()['cpu']}, {os.cpu_count()} CPUs, commit {machine()['commit']}; {args.workers} workers, one vLLM server, "
        f"Chroma server, {'the given database' if args.database_url else 'SQLite'} for turns and history; "
        f"{args.threads} client threads, every request on a new connection.",
        "",
        "| pairs | add and search through | found by the first search | delay p50 (ms) | delay p99 (ms) "
        "| delay max (ms) | add p50 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, group in (("two different workers", cross), ("the same worker", same)):
        if group:
            first = sum(r["tries"] == 1 for r in group)
            d = [r["delay_ms"] for r in group]
            lines.append(f"| {len(group)} | {name} | {first} of {len(group)} | {statistics.median(d):.1f} | "
                         f"{pct(d, 0.99):.1f} | {max(d):.1f} | {statistics.median(r['add_ms'] for r in group):.1f} |")
    lines += ["", "The delay is the search's own latency when the first search finds the fact: a write is "
              "visible to every worker as soon as it is acknowledged (each read compares the scope's version "
              "with its index partition's first; docs/decisions.md)."]
    print_page("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
