"""Injecting 50 facts' KV for one request on the CPU: dense vs int8 vs int4, three ways.

What the connector's work costs for one request, at SmolLM2-135M's shapes (30 layers, 3 KV
heads of 64) in fp32, with random KV of 20-40 tokens a fact, as the pool's device tier holds
it (dense tensors, or 8- / 4-bit codes and scales): ``stage``, then ``write_layers`` (each
layer's keys rotated by SmolLM2's RoPE and written with the values into a paged cache by
``index_copy_``, standing in for vLLM's cache update). The ways:

- ``fused``: the CPU's way, runs of quantized facts dequantized a layer at a time inside
  the write loop (:class:`inferscale.kv.quant.QuantizedRun`);
- ``per segment``: each fact dequantized whole first (the CPU's way before 2026-12-04 evening);
- ``batched``: the GPU's way (one dequantization per storage dtype, one concatenation).

Each way is timed ``--repeats`` times, interleaved; the best time is printed (the machine is
shared, so the minimum is the stable figure), with its ratio to dense fused.

    .venv/bin/python scripts/bench_dequant.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inferscale.kv.injection import InjectionPlan, stage  # noqa: E402
from inferscale.kv.pool import FactKV, kv_key  # noqa: E402
from inferscale.kv.quant import quantize  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--facts", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    layers, heads, dim = 30, 3, 64
    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(20, 40, (1,), generator=g)) for _ in range(args.facts)]
    dense = {kv_key(f"f{i}", i=i): FactKV(torch.randn(layers, n, heads, dim, generator=g),
                                          torch.randn(layers, n, heads, dim, generator=g)) for i, n in enumerate(lengths)}
    pools = {"dense": dense, **{d: {k: quantize(kv.keys, kv.values, d) for k, kv in dense.items()}
                                for d in ("int8", "int4")}}
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    plan = InjectionPlan.of([(k, s, n) for k, s, n in zip(dense, starts, lengths)])

    from transformers import LlamaConfig

    from inferscale.kv.injection import LayerWriter, slot_mapping, write_layers
    from inferscale.kv.rope import RopeRotator

    rotator = RopeRotator(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=dim,
                                      num_hidden_layers=layers, rope_theta=100000.0))  # SmolLM2-135M's RoPE
    tokens = sum(lengths)
    blocks = torch.randperm(tokens // 16 + 8, generator=g)[: (tokens + 15) // 16].tolist()
    caches = [(torch.zeros((tokens // 16 + 8) * 16, heads, dim), torch.zeros((tokens // 16 + 8) * 16, heads, dim))
              for _ in range(layers)]

    def writer(i: int) -> LayerWriter:
        def write(keys, values, slots):
            caches[i][0].index_copy_(0, slots, keys)
            caches[i][1].index_copy_(0, slots, values)
        return LayerWriter(i, torch.device("cpu"), torch.float32, write)
    writers = [writer(i) for i in range(layers)]

    def way(pool, how):
        def run():
            staged = stage(plan, 0, pool.get, batched=how == "batched", fused=how == "fused")
            write_layers(staged, slot_mapping(staged.positions, blocks, 16), rotator, writers)
        return run

    ways = {f"{name} {how}": way(pool, how) for how in ("fused", "per segment", "batched")
            for name, pool in pools.items()}
    best = {name: float("inf") for name in ways}
    for fn in ways.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    base = best["dense fused"]
    print(f"{args.facts} facts, {sum(lengths)} tokens, {torch.get_num_threads()} threads, best of {args.repeats}:")
    for name, s in best.items():
        print(f"  {name:22s} {s * 1e3:7.1f} ms  ({s / base:.2f}x of dense)")
    return best


if __name__ == "__main__":
    main()
