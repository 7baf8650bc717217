"""Prefill vs injection of k facts' KV, at Llama-3.1-8B shapes, with random weights: no vLLM.

What a memory server pays per request for k retrieved facts of ``--fact-tokens`` tokens:

- ``prefill``: the model's forward pass over the facts' tokens (what prompt injection,
  Mem0-style, costs on every request), batch 1, with the KV cache kept;
- ``inject``: InferScale's connector work for the same tokens, the very functions the
  connector runs (:mod:`inferscale.kv.injection`): gather the stored pre-RoPE KV
  (``stage``), map positions to paged-cache slots (``slot_mapping``), and rotate each
  layer's keys and write keys and values into a paged cache (``write_layers``, with an
  ``index_copy_`` into ``[num_blocks * block_size, kv_heads, head_dim]`` per layer
  standing in for vLLM's ``do_kv_cache_update``).

``inject`` is timed for each storage dtype (``--storage``: the model's dtype ``auto``,
``int8``, ``int4``; the facts are stored with :func:`inferscale.kv.quant.quantize` and
dequantized inside ``stage``, as in the connector) and each tier the facts are read from
(``--tiers``): ``device`` (the pool's device tier: already on the GPU) and ``host`` (its
pinned host-memory tier: each request copies the facts' stored bytes to the GPU first, as
``KVPool.get`` does on a host hit). The preamble stays in the model's dtype on the device.

The model is ``LlamaForCausalLM`` built from a ``LlamaConfig`` with Llama-3.1-8B's shapes
(32 layers, hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336, llama3 rope
scaling; from its public config.json) and random weights, so no hub is needed; only torch
and transformers are imported (``inferscale`` loads its public names lazily). Timing uses
``torch.cuda.synchronize`` on CUDA; the two ways alternate, and medians are printed with
their ratio, plus one JSON line.

    python scripts/gpu_injection_microbench.py                 # CUDA, 8B shapes, bf16, all dtypes and tiers
    python scripts/gpu_injection_microbench.py --tiny --device cpu --dtype float32   # what the tests run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inferscale.kv.injection import InjectionPlan, LayerWriter, slot_mapping, stage, write_layers  # noqa: E402
from inferscale.kv.pool import FactKV, kv_key  # noqa: E402
from inferscale.kv.quant import VALUE_GROUP, QuantizedKV, quantize  # noqa: E402
from inferscale.kv.rope import RopeRotator  # noqa: E402

LLAMA_31_8B = dict(  # meta-llama/Llama-3.1-8B config.json
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=4096,
            rope_parameters=LLAMA_31_8B["rope_parameters"])
BLOCK_SIZE = 16  # vLLM's default block size on CUDA


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pinned(kv: FactKV | QuantizedKV) -> FactKV | QuantizedKV:
    """``kv`` in pinned host memory, as the pool's host tier holds it (``kv.pool._to_host``; pinned
    only where CUDA is)."""
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.cpu().pin_memory() if torch.cuda.is_available() else t.cpu().clone()
    if isinstance(kv, QuantizedKV):
        return QuantizedKV(kv.dtype, *(host(t) for t in (kv.k_codes, kv.k_scales, kv.v_codes, kv.v_scales)),
                           kv.out_dtype, kv.token_ids)
    return FactKV(host(kv.keys), host(kv.values), kv.token_ids)


def run(*, tiny: bool, device: str, dtype: str, k: int, fact_tokens: int, preamble_tokens: int, repeats: int,
        storages: tuple[str, ...] = ("auto",), tiers: tuple[str, ...] = ("device",),
        per_segment: bool = False) -> dict:
    """Time prefill and injection (per storage dtype and tier) side by side; returns the medians (ms)."""
    dev = torch.device(device)
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    config = LlamaConfig(**(TINY if tiny else LLAMA_31_8B))
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config).to(dt).eval()
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    n = preamble_tokens + k * fact_tokens
    ids = torch.randint(0, config.vocab_size, (1, n), device=dev)

    # the pool's view: one stored FactKV per segment, on the device (its device tier)
    lengths = [preamble_tokens] + [fact_tokens] * k
    dense, segments, pos = {}, [], 0
    for i, length in enumerate(lengths):
        key = kv_key("_preamble" if i == 0 else f"fact{i}", n=i)
        dense[key] = FactKV(torch.randn(layers, length, heads, dim, device=dev, dtype=dt),
                            torch.randn(layers, length, heads, dim, device=dev, dtype=dt))
        segments.append((key, pos, length))
        pos += length
    plan = InjectionPlan.of(segments)
    preamble = segments[0][0]
    pools: dict[str, dict[str, FactKV | QuantizedKV]] = {}  # (storage, tier) -> the pool's entries
    stored_bytes: dict[str, int] = {}
    for storage in storages:
        on_device = {key: kv if storage == "auto" or key == preamble else quantize(kv.keys, kv.values, storage, min(VALUE_GROUP, dim))
                     for key, kv in dense.items()}
        stored_bytes[storage] = sum(kv.nbytes for key, kv in on_device.items() if key != preamble)
        for tier in tiers:
            pools[f"{storage}-{tier}"] = on_device if tier == "device" else {
                key: kv if key == preamble else _pinned(kv) for key, kv in on_device.items()}
    stored = pools[next(iter(pools))]
    rotator = RopeRotator(config)
    num_blocks = (n + BLOCK_SIZE - 1) // BLOCK_SIZE + 8
    block_ids = list(torch.randperm(num_blocks)[: (n + BLOCK_SIZE - 1) // BLOCK_SIZE].tolist())
    caches = [(torch.zeros(num_blocks * BLOCK_SIZE, heads, dim, device=dev, dtype=dt),
               torch.zeros(num_blocks * BLOCK_SIZE, heads, dim, device=dev, dtype=dt)) for _ in range(layers)]

    def writer(i: int) -> LayerWriter:
        kc, vc = caches[i]

        def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
            kc.index_copy_(0, slots, keys)
            vc.index_copy_(0, slots, values)
        return LayerWriter(i, dev, dt, write)

    writers = [writer(i) for i in range(layers)]

    @torch.no_grad()
    def prefill() -> None:
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    def injector(entries: dict[str, FactKV | QuantizedKV], batched: bool | None = None):
        def fetch(key: str) -> FactKV | QuantizedKV:
            kv = entries[key]
            return kv.to(dev)  # no copy on the device tier; a host hit's copy to the GPU

        def inject() -> None:
            staged = stage(plan, 0, fetch, batched=batched)
            write_layers(staged, slot_mapping(staged.positions, block_ids, BLOCK_SIZE), rotator, writers)
        return inject

    ways = {"prefill": prefill, **{f"inject-{name}": injector(entries) for name, entries in pools.items()}}
    if per_segment:  # the CPU's way (stage(batched=False)) on this device, for comparison
        ways.update({f"inject-{name}-per-segment": injector(entries, False) for name, entries in pools.items()})
    for fn in ways.values():  # warm-up (kernels, allocator)
        fn()
    _sync(dev)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    first = f"inject-{next(iter(pools))}"
    kv_bytes = 2 * layers * n * heads * dim * torch.finfo(dt).bits // 8
    return {
        "shapes": "tiny" if tiny else "Llama-3.1-8B", "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype, "k": k, "tokens": n, "kv_mib": kv_bytes / 2**20, "repeats": repeats,
        "prefill_median_ms": med["prefill"], "inject_median_ms": med[first],
        "prefill_over_inject": med["prefill"] / med[first],
        "inject_ms": {name.removeprefix("inject-"): v for name, v in med.items() if name != "prefill"},
        "fact_mib": {storage: b / 2**20 for storage, b in stored_bytes.items()},
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model instead of Llama-3.1-8B's shapes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--k", type=int, default=50, help="facts per request")
    ap.add_argument("--fact-tokens", type=int, default=31, help="tokens per fact (LoCoMo conv-26 averages ~31)")
    ap.add_argument("--preamble-tokens", type=int, default=34)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--storage", default="auto,int8,int4", help="storage dtypes of the facts' KV, comma-separated")
    ap.add_argument("--per-segment", action="store_true", help="also time the CPU's way of staging "
                    "(per segment, per layer) on this device")
    ap.add_argument("--tiers", default=None, help="tiers the facts are read from: device,host (default: both on "
                    "CUDA, device on the CPU, whose device tier is host memory)")
    args = ap.parse_args(argv)
    if args.k < 0 or args.fact_tokens < 1 or args.preamble_tokens < 1 or args.repeats < 1:
        ap.error("--k must be >= 0; --fact-tokens, --preamble-tokens and --repeats >= 1")
    storages = tuple(s.strip() for s in args.storage.split(",") if s.strip())
    if not storages or any(s not in ("auto", "int8", "int4") for s in storages):
        ap.error(f"--storage takes auto, int8 and int4, comma-separated; got {args.storage!r}")
    tiers = tuple(t.strip() for t in (args.tiers or ("device,host" if args.device.startswith("cuda") else "device"))
                  .split(",") if t.strip())
    if not tiers or any(t not in ("device", "host") for t in tiers):
        ap.error(f"--tiers takes device and host, comma-separated; got {args.tiers!r}")
    result = run(tiny=args.tiny, device=args.device, dtype=args.dtype, k=args.k, fact_tokens=args.fact_tokens,
                 preamble_tokens=args.preamble_tokens, repeats=args.repeats, storages=storages, tiers=tiers,
                 per_segment=args.per_segment)
    print(f"{result['shapes']} on {result['device_name']} ({result['dtype']}), k={result['k']}: "
          f"{result['tokens']} tokens, {result['kv_mib']:.1f} MiB of KV")
    print(f"  prefill median {result['prefill_median_ms']:8.2f} ms")
    first = next(iter(result["inject_ms"]))
    for name, ms in result["inject_ms"].items():
        storage = name.split("-")[0]
        print(f"  inject {name:24s} median {ms:8.2f} ms ({ms / result['inject_ms'][first]:.2f}x of {first}; "
              f"facts stored in {result['fact_mib'][storage]:.1f} MiB; prefill / inject "
              f"{result['prefill_median_ms'] / ms:.1f}x)")
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
