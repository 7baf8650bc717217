"""Side-by-side timing of two ways to gather and write a request's injected KV.

Both take the KV of ``--facts`` segments as the pool holds them (one
``[layers, n_i, heads, head_dim]`` pair per fact) and write it into a paged cache,
rotating keys one layer at a time (:func:`inferscale.kv.injection.write_layers`):

``concat-first``: every segment is first concatenated into one ``[layers, N, ...]`` copy
of the whole request (the connector before issue 11), then written layer by layer;
``per-layer``: :func:`inferscale.kv.injection.stage` as the connector runs it now: views
of the segments, concatenated one layer at a time (~1.1 MiB in fp32 at k=50), so each
layer's slices are rotated and written while in cache.

The paged cache write is ``index_copy_`` into a ``[num_slots, H, D]`` view, standing in
for the attention backend's ``do_kv_cache_update``. Shapes are SmolLM2-135M's (30
layers, 3 KV heads, head_dim 64) at k=50 facts of ~31 tokens (~1,560 tokens), fp32.

Reproduce: ``.venv/bin/python scripts/bench_connector_write.py [--facts 50] [--tokens 31] [--repeats 30]``.
Prints medians (ms) and their ratio; the two ways alternate so load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

from inferscale.kv.injection import InjectionPlan, LayerWriter, PlannedSegment, StagedKV, stage, write_layers
from inferscale.kv.pool import FactKV, kv_key
from inferscale.kv.rope import RopeRotator
from inferscale.models.resolve import resolve_llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--facts", type=int, default=50, help="segments (facts) per request")
    ap.add_argument("--tokens", type=int, default=31, help="tokens per fact")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(resolve_llm())
    rot = RopeRotator(config)
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = {kv_key(f"f{i}", i=i): FactKV(torch.randn(layers, args.tokens, heads, dim),
                                         torch.randn(layers, args.tokens, heads, dim)) for i in range(args.facts)}
    start = 0
    plan = InjectionPlan(start + args.facts * args.tokens, tuple(
        PlannedSegment(key, start + i * args.tokens, args.tokens) for i, key in enumerate(pool)))
    n = args.facts * args.tokens
    caches = [(torch.zeros(4 * n, heads, dim), torch.zeros(4 * n, heads, dim)) for _ in range(layers)]
    slots = torch.randperm(4 * n)[:n]

    def writer(i: int) -> LayerWriter:
        kc, vc = caches[i]

        def write(k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
            kc.index_copy_(0, s, k)
            vc.index_copy_(0, s, v)
        return LayerWriter(i, kc.device, kc.dtype, write)

    writers = [writer(i) for i in range(layers)]

    def concat_first() -> None:
        staged = stage(plan, start, pool.get)
        write_layers(StagedKV.of(staged.keys, staged.values, staged.positions), slots, rot, writers)

    def per_layer() -> None:
        write_layers(stage(plan, start, pool.get), slots, rot, writers)

    concat_first()
    expected = [(k.clone(), v.clone()) for k, v in caches]
    per_layer()  # warm-up, and both ways write the same cache
    assert all(torch.equal(k, ek) and torch.equal(v, ev) for (k, v), (ek, ev) in zip(caches, expected))
    times: dict[str, list[float]] = {"concat-first": [], "per-layer": []}
    for _ in range(args.repeats):
        for name, fn in (("concat-first", concat_first), ("per-layer", per_layer)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mb = 2 * layers * n * heads * dim * 4 / 2**20
    print(f"{args.facts} facts x {args.tokens} tokens, {layers} layers, {mb:.0f} MiB of KV per request, "
          f"{torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:12s} median {v:7.2f} ms")
    print(f"  concat-first / per-layer = {med['concat-first'] / med['per-layer']:.2f}x")


if __name__ == "__main__":
    main()
