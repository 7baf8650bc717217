"""The first search after another worker's write: catching up vs reloading the scope.

Two ``Memory`` objects over one Chroma server (``chroma run``) and one data dir's SQLite
history, as two ``inferscale serve --workers 2`` workers are. The reader holds a scope of
N facts loaded; then, ``--rounds`` times, the writer adds one fact and the reader's next
search is timed, alternating per round between catching up (the default: the new ids from
the history, their rows from Chroma) and reloading the whole partition (``catch_up=False``,
the behaviour before). A plain search with nothing written is timed beside them, and the
writer's own search after its own add, with the BM25 index kept up to date by the write
vs rebuilt from the scope's texts (as before). Medians and ratios, one process, the modes
interleaved (the machine is noisy):

    .venv/bin/python scripts/bench_catch_up.py [--sizes 100 2000 20000] [--rounds 20] \\
        [--out docs/results/catch_up.md]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from inferscale import FactInput, Memory
from inferscale.bench.common import machine, print_page
from inferscale.server.ports import free_port
from inferscale.store.records import Scope

QUERY = "What does the user do on weekends?"


def start_chroma(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "chroma"), "run", "--path", str(root / "chroma"),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=(root / "chroma.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/api/v2/heartbeat", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    sys.exit(f"the Chroma server did not start: {(root / 'chroma.log').read_text()[-2000:]}")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def measure(writer: Memory, reader: Memory, user: str, size: int, rounds: int) -> dict:
    """Fill ``user``'s scope to ``size`` facts, load it in the reader, then time the reader's
    first search after each of the writer's adds, alternating the two modes (ms)."""
    for start in tqdm(range(0, size, 500), desc=f"{size} facts", unit="batch", leave=False):
        writer.add_facts([FactInput(f"Fact {i} about {user}: they like hobby number {i % 97} on day {i % 7}.", ())
                          for i in range(start, min(size, start + 500))], user_id=user)
    reader.search(QUERY, user_id=user)  # loads the partition (and warms the embedder)
    times: dict[str, list[float]] = {"catch up": [], "reload": [], "nothing written": []}
    for r in range(2 * rounds):
        mode = "catch up" if r % 2 == 0 else "reload"
        reader.components.index.catch_up = mode == "catch up"
        writer.add(f"New fact {r} about {user}: they went climbing on weekend {r}.", user_id=user)
        times[mode].append(timed(lambda: reader.search(QUERY, user_id=user)))
        times["nothing written"].append(timed(lambda: reader.search(QUERY, user_id=user)))
    reader.components.index.catch_up = True
    assert reader.count(user_id=user) == size + 2 * rounds, "the reader lost or duplicated a write"
    # the writer's own next search after its own add: BM25 kept up to date by the write, vs
    # rebuilt from the scope's texts as before (the partition's keyword index dropped)
    writer.search(QUERY, user_id=user)
    times |= {"own: kept": [], "own: rebuilt": []}
    part = writer.components.index._parts[Scope(user).key]  # noqa: SLF001 - the bench emulates the old behaviour
    for r in range(2 * rounds):
        writer.add(f"Own fact {r} about {user}: they went sailing on weekend {r}.", user_id=user)
        mode = "own: kept" if r % 2 == 0 else "own: rebuilt"
        if mode == "own: rebuilt":
            part.keyword = None
        times[mode].append(timed(lambda: writer.search(QUERY, user_id=user)))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 2000, 20000])
    parser.add_argument("--rounds", type=int, default=20, help="writes per mode and size")
    parser.add_argument("--out", type=Path, default=None, help="write the results as markdown here")
    args = parser.parse_args()
    if min(args.sizes) < 1 or args.rounds < 1:
        parser.error("--sizes >= 1 and --rounds >= 1")
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out} is a folder: give a file path")
    rows = []
    with tempfile.TemporaryDirectory(prefix="inferscale-catch-up-") as tmp:
        root = Path(tmp)
        chroma, url = start_chroma(root)
        try:
            settings = dict(data_dir=root / "data", dtype="float32", precompute_kv=False, chroma_url=url)
            with Memory(**settings) as writer, Memory(**settings) as reader:
                for n, size in enumerate(args.sizes):
                    rows.append((size, measure(writer, reader, f"user{n}", size, args.rounds)))
        finally:
            chroma.terminate()
            chroma.wait(timeout=60)
    m = machine()
    lines = [
        "# The first search after another worker's write",
        "",
        f"Command: `.venv/bin/python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"Machine: {m['cpu']}, {m['cores']} CPUs, commit {m['commit']}; two `Memory` objects "
        "(as two API workers) over one Chroma server and one data dir's SQLite history; medians of "
        f"{args.rounds} writes per mode, the two modes alternating.",
        "",
        "Hybrid search (the default), limit 10.",
        "",
        "| facts in the scope | search, nothing written (ms) | first search after another worker's write: "
        "catch up (ms) | same: reload the scope (ms) | reload / catch up | after the worker's own write: BM25 "
        "kept (ms) | same: BM25 rebuilt (ms) | rebuilt / kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, t in rows:
        lines.append(f"| {size:,} | {t['nothing written']:.1f} | {t['catch up']:.1f} | {t['reload']:.1f} | "
                     f"{t['reload'] / t['catch up']:.1f}x | {t['own: kept']:.1f} | {t['own: rebuilt']:.1f} | "
                     f"{t['own: rebuilt'] / t['own: kept']:.1f}x |")
    lines += ["", "Catching up reads the ids written since the partition's version from the history and "
              "those rows from Chroma; reloading reads the whole scope from Chroma (and rebuilds its BM25). "
              "The BM25 index is updated by each write; before, a write dropped it and the next hybrid search "
              "rebuilt it from every text of the scope (the rebuilt column uses today's index build; "
              "`bm25s`'s, used before, took about as long: 404 vs 464 ms for 20,000 sentences of 25 words; "
              "docs/decisions.md)."]
    print_page("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
