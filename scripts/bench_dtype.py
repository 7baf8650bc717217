"""TTFT of SmolLM2 in vLLM and KV-encoding time in transformers, fp32 vs bf16.

One script, both dtypes, same prompts: each dtype runs in a child process (one vLLM
engine per process), the parent prints the ratios. Reproduce with:

    .venv/bin/python scripts/bench_dtype.py
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (30, 300, 1000)


def child(dtype: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import tempfile

    from inferscale.kv.encoder import EncodeItem, KVEncoder
    from inferscale.models.resolve import resolve_llm
    from inferscale.serving.engine import Engine

    path = resolve_llm()
    rng = random.Random(0)
    enc = KVEncoder(path, dtype)
    items = [EncodeItem(tuple(rng.randrange(1000, 40000) for _ in range(300)), tuple(range(500, 520)))] * 8
    enc.encode(items[:1])
    t0 = time.perf_counter()
    enc.encode(items)
    encode_s = time.perf_counter() - t0
    del enc
    engine = Engine(path, dtype=dtype, kv_dir=Path(tempfile.mkdtemp()) / "kv", max_model_len=4096)
    engine.generate([rng.randrange(1000, 40000) for _ in range(50)], max_tokens=1)  # warm-up
    ttft = {}
    for n in LENGTHS:
        runs = [engine.generate([rng.randrange(1000, 40000) for _ in range(n)], max_tokens=1).ttft_s for _ in range(3)]
        ttft[n] = statistics.median(runs)
    print("RESULT " + json.dumps({"encode_8x320_s": encode_s, "ttft_s": ttft}))


def main() -> None:
    results = {}
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, __file__, dtype], capture_output=True, text=True, check=True).stdout
        results[dtype] = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
    fp, bf = results["float32"], results["bfloat16"]
    print("| measure | float32 | bfloat16 | bf16 / fp32 |\n|---|---|---|---|")
    print(f"| KV encode 8 x 320 tokens (s) | {fp['encode_8x320_s']:.2f} | {bf['encode_8x320_s']:.2f} | "
          f"{bf['encode_8x320_s'] / fp['encode_8x320_s']:.1f}x |")
    for n in LENGTHS:
        a, b = fp["ttft_s"][str(n)], bf["ttft_s"][str(n)]
        print(f"| vLLM TTFT, {n} prompt tokens (ms) | {a * 1000:.0f} | {b * 1000:.0f} | {b / a:.1f}x |")


if __name__ == "__main__":
    child(sys.argv[1]) if len(sys.argv) > 1 else main()
