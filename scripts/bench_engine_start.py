"""What starting vLLM's engine core without re-importing ``__main__`` costs (issue 28).

Starts InferScale's engine (``serving.engine.Engine``: vLLM's ``AsyncLLM``, engine core
spawned) alternately the way it is started now (``serving.spawn.children_skip_main``: the
child does not re-import this script) and the way it was before (the child re-imports it,
which needs this script's ``if __name__ == "__main__":`` guard), and prints the start time
of each and the ratio of the medians. The script imports ``inferscale.memory`` at top level,
as a user's script would, so the old way's child pays that import too.

    python scripts/bench_engine_start.py --pairs 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import inferscale.memory  # noqa: F401  (what a user's script imports; the old way's child re-imports it)
from inferscale.models.resolve import resolve_llm


def start_once(skip_main: bool, kv_dir: Path) -> float:
    import inferscale.serving.engine as engine_module
    from inferscale.serving.spawn import children_skip_main

    engine_module.children_skip_main = children_skip_main if skip_main else contextlib.nullcontext
    t0 = time.perf_counter()
    engine = engine_module.Engine(resolve_llm(), dtype="float32", kv_dir=kv_dir, max_model_len=2048,
                                  kv_cache_memory_bytes=1 << 28)
    took = time.perf_counter() - t0
    engine.generate([1, 2, 3], max_tokens=1)  # it serves
    engine.close()
    return took


if __name__ == "__main__":  # the old way needs it; the new way does not
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for skip in ((True, False) if i % 2 == 0 else (False, True)):
                times[skip].append(start_once(skip, Path(tmp) / "kv"))
                print(f"pair {i}: {'skip __main__' if skip else 're-import __main__'}: {times[skip][-1]:.2f} s",
                      flush=True)
    new, old = statistics.median(times[True]), statistics.median(times[False])
    print(f"median engine start: without re-import {new:.2f} s, with re-import {old:.2f} s, ratio {new / old:.2f}x")
