"""Side-by-side timing of the connector's two ways to rotate and write injected KV.

``all-layers``: rotate every layer's keys at once (``[L, N, H, D]``), then write
layer by layer (the connector before "rotate one layer at a time", docs/decisions.md).
``per-layer``: :func:`inferscale.kv.injection.write_layers`, the connector's own code
(cos/sin once, then rotate and write one layer at a time). The paged cache write is
``index_copy_`` into a ``[num_slots, H, D]`` view, standing in for the attention
backend's ``do_kv_cache_update``. Shapes are SmolLM2-135M's (30
layers, 3 KV heads, head_dim 64) at k=50 facts (~1,560 tokens), fp32.

Reproduce: ``.venv/bin/python scripts/bench_connector_write.py [--tokens 1560] [--repeats 30]``.
Prints medians (ms) and their ratio; the two ways alternate so load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig

from inferscale.kv.injection import LayerWriter, StagedKV, write_layers
from inferscale.kv.rope import RopeRotator
from inferscale.models import resolve_llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1560, help="injected tokens per request")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(resolve_llm())
    rot = RopeRotator(config)
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n = args.tokens
    keys, values = torch.randn(layers, n, heads, dim), torch.randn(layers, n, heads, dim)
    pos = torch.arange(100, 100 + n)
    caches = [(torch.zeros(4 * n, heads, dim), torch.zeros(4 * n, heads, dim)) for _ in range(layers)]
    slots = torch.randperm(4 * n)[:n]

    def all_layers() -> None:
        rotated = rot.rotate(keys, pos)
        for i, (kc, vc) in enumerate(caches):
            kc.index_copy_(0, slots, rotated[i])
            vc.index_copy_(0, slots, values[i])

    def writer(i: int) -> LayerWriter:
        kc, vc = caches[i]

        def write(k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
            kc.index_copy_(0, s, k)
            vc.index_copy_(0, s, v)
        return LayerWriter(i, kc.device, kc.dtype, write)

    writers = [writer(i) for i in range(layers)]
    staged = StagedKV(keys, values, pos)

    def per_layer() -> None:
        write_layers(staged, slots, rot, writers)

    # both ways write the same keys
    assert torch.equal(rot.rotate(keys, pos)[layers // 2], rot.rotate(keys[layers // 2], pos, rot.cos_sin(pos)))
    all_layers(), per_layer()  # warm-up
    times: dict[str, list[float]] = {"all-layers": [], "per-layer": []}
    for _ in range(args.repeats):
        for name, fn in (("all-layers", all_layers), ("per-layer", per_layer)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mb = 2 * keys.numel() * keys.element_size() / 2**20
    print(f"{n} tokens, {layers} layers, {mb:.0f} MiB of KV per request, {torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:10s} median {v:7.2f} ms")
    print(f"  all-layers / per-layer = {med['all-layers'] / med['per-layer']:.2f}x")


if __name__ == "__main__":
    main()
