"""KV footprint: bytes per fact and per conversation, and where the bytes live.

A fact's KV is its memory line's tokens times the bytes per token of the model's KV,

    bytes/token = num_hidden_layers x 2 (K and V) x num_key_value_heads x head_dim x dtype bytes

(the layout of :class:`inferscale.kv.pool.FactKV`); it does not depend on the context
window w, which changes what the KV holds, not its size. The benchmark

1. checks the formula against every KV file already in the store's pool (the sizes of
   their tensors, and of the safetensors files with their headers); files stored in 8 or 4
   bits against :func:`inferscale.kv.quant.nbytes` (codes plus float16 scales);
2. sizes all 10 LoCoMo conversations from their facts' token counts, in the model's dtype,
   in bf16, and in each quantized ``kv_storage_dtype``;
3. shows the device / CPU / disk split of the pool for the stored KV of one conversation
   at two device-tier budgets: the tier keeps the most recently used KV up to its budget,
   and every fact stays on disk. On a machine without a GPU the device tier is host
   memory, so device and CPU are one place; on a GPU the device tier is GPU memory and
   there is no separate CPU tier (the OS page cache holds recently read files).

Reproduce: ``inferscale bench footprint`` (after ``inferscale bench latency`` has stored
KV in the same store).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from safetensors import safe_open
from tqdm import tqdm

from inferscale.bench.common import ensure_conversation, markdown_table, scope_of, write_outputs
from inferscale.bench.plots import plot_footprint
from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES
from inferscale.datasets.locomo import load_locomo
from inferscale.kv import quant
from inferscale.kv.pool import KVPool
from inferscale.models.kv_shape import bytes_per_token, kv_dims
from inferscale.memory import Memory

NAME = "footprint"
MIB = 2**20


def stored_files(kv_dir: Path) -> list[dict]:
    """Each KV file in the pool: its storage (``model``, ``int8``, ``int4``), tokens, tensor
    bytes (token ids left out) and file bytes."""
    rows = []
    for path in sorted(Path(kv_dir).rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            storage = (fh.metadata() or {}).get("storage", "model")
            shapes = {name: fh.get_slice(name).get_shape() for name in fh.keys()}
            dtypes = {name: fh.get_slice(name).get_dtype() for name in fh.keys()}
        first = "keys" if storage == "model" else "k_codes"
        if first not in shapes:
            continue
        item = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}
        tensor_bytes = 0
        for name, shape in shapes.items():
            if name == "token_ids":  # format 2 stores them too (file overhead)
                continue
            n = 1
            for d in shape:
                n *= d
            tensor_bytes += n * item[dtypes[name]]
        rows.append({"owner": path.parent.name, "key": path.stem, "storage": storage, "tokens": shapes[first][1],
                     "shape": shapes[first], "tensor_bytes": tensor_bytes, "file_bytes": path.stat().st_size})
    return rows


def _formula_bytes(f: dict, per_token: int) -> int:
    if f["storage"] == "model":
        return f["tokens"] * per_token
    layers, tokens, heads, dim = f["shape"]
    return quant.nbytes(layers, tokens, heads, dim * (2 if f["storage"] == "int4" else 1), f["storage"])


def run(data: Path, out_dir: Path, store_dir: Path, *, samples: Sequence[int] | None = None, split_sample: int = 0,
        budgets: Sequence[int] = (DEFAULT_DEVICE_KV_BUDGET_BYTES, 64 * MIB), dtype: str = "auto") -> dict:
    """Write ``footprint.{json,md,png}`` (no long work, so nothing to resume).

    Args:
        samples: conversation indices to size (default: all).
        split_sample: the conversation whose stored KV is loaded for the split.
        budgets: device-tier budgets (bytes) to show the split at.

    Raises:
        ValueError: bad settings.
    """
    settings = {"samples": None if samples is None else list(samples), "split_sample": split_sample, "budgets": list(budgets), "dtype": dtype, "data": str(data)}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    memory = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=False)
    dt = memory.config.resolved_dtype
    hf_config = AutoConfig.from_pretrained(str(memory.model_path))
    per_token = bytes_per_token(hf_config, dt)
    layers, heads, dim = kv_dims(hf_config)
    files = stored_files(memory.kv_dir)
    mismatched = [f for f in files if f["tensor_bytes"] != _formula_bytes(f, per_token)]
    every = load_locomo(data)
    picked = list(range(len(every))) if samples is None else list(samples)
    if split_sample not in picked:
        picked.append(split_sample)
    bad = [i for i in picked if not 0 <= i < len(every)]
    if bad:
        raise ValueError(f"conversation indices must be in 0..{len(every) - 1}, got {bad}")
    convs = [every[i] for i in sorted(set(picked))]
    rows = []
    fact_ids: dict[str, set[str]] = {}
    for conv in tqdm(convs, desc="size conversations", unit="conversation"):
        ensure_conversation(memory, conv)
        stored = memory.get_all(user_id=scope_of(conv), limit=100_000)["results"]
        fact_ids[conv.sample_id] = {f["id"] for f in stored}
        tokens = [memory.fact_tokens(f["memory"]) for f in stored]
        storage = {s: sum(quant.nbytes(layers, t, heads, dim, s) for t in tokens) for s in quant.QUANTIZED_DTYPES}
        storage["bfloat16"] = sum(quant.nbytes(layers, t, heads, dim, "model", model_bytes=2) for t in tokens)
        rows.append({"sample": conv.sample_id, "facts": len(tokens), "fact_tokens": sum(tokens),
                     "tokens_per_fact": sum(tokens) / len(tokens), "kv_bytes": sum(tokens) * per_token,
                     "kv_mib": sum(tokens) * per_token / MIB,
                     "storage_mib": {s: b / MIB for s, b in storage.items()}})
    owners = fact_ids[every[split_sample].sample_id]  # a fact's KV files live under its id
    owner_files = [f for f in files if f["owner"] in owners]
    split = []
    for budget in budgets:
        pool = KVPool(memory.kv_dir, memory.device, budget)  # a fresh pool, as a new server process has
        for f in owner_files:
            pool.get(f"{f['owner']}/{f['key']}")
        fp = pool.footprint()
        on_gpu = memory.device.type == "cuda"
        split.append({"budget_mib": budget / MIB, "device_mib": fp["device"] / MIB,
                      "cpu_mib": 0.0 if on_gpu else fp["device"] / MIB,
                      "disk_mib": sum(f["file_bytes"] for f in owner_files) / MIB,
                      "device_is_host_memory": not on_gpu})
    total_facts = sum(r["facts"] for r in rows)
    by_storage = {s: sum(r["storage_mib"][s] for r in rows) * MIB / total_facts
                  for s in ("bfloat16", *quant.QUANTIZED_DTYPES)}
    summary = {
        "settings": settings, "dtype": dt, "bytes_per_token": per_token,
        "bytes_per_fact_mean": sum(r["kv_bytes"] for r in rows) / total_facts,
        "stored_files": len(files), "stored_files_matching_formula": len(files) - len(mismatched),
        "file_overhead_bytes_mean": (sum(f["file_bytes"] - f["tensor_bytes"] for f in files) / len(files)
                                     if files else None),
        "storage_bytes_per_fact_mean": by_storage,
        "stored_files_by_storage": {s: sum(f["storage"] == s for f in files) for s in ("model", *quant.QUANTIZED_DTYPES)},
        "conversations": rows, "split_sample": every[split_sample].sample_id,
        "split_files": len(owner_files), "split": split,
    }
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_footprint(summary, out_dir / f"{NAME}.png")
    return summary


def to_markdown(summary: dict) -> str:
    """Tables of the summary."""
    conv = markdown_table(
        ["conversation", "facts", "fact tokens", "tokens per fact", f"KV (MiB, {summary['dtype']})", "bf16 (MiB)",
         "int8 (MiB)", "int4 (MiB)"],
        [[r["sample"], r["facts"], r["fact_tokens"], f"{r['tokens_per_fact']:.1f}", f"{r['kv_mib']:.1f}",
          f"{r['storage_mib']['bfloat16']:.1f}", f"{r['storage_mib']['int8']:.1f}", f"{r['storage_mib']['int4']:.1f}"]
         for r in summary["conversations"]])
    per_fact = summary["storage_bytes_per_fact_mean"]
    bf16 = per_fact["bfloat16"]
    storage = markdown_table(
        ["kv_storage_dtype", "KiB per fact (mean)", "vs bf16"],
        [["bfloat16", f"{bf16 / 1024:.1f}", "1.000x"]]
        + [[s, f"{per_fact[s] / 1024:.1f}", f"{per_fact[s] / bf16:.3f}x"] for s in quant.QUANTIZED_DTYPES])
    split = markdown_table(
        ["device-tier budget (MiB)", "device (MiB)", "CPU (MiB)", "disk (MiB)"],
        [[f"{s['budget_mib']:.0f}", f"{s['device_mib']:.1f}", f"{s['cpu_mib']:.1f}", f"{s['disk_mib']:.1f}"]
         for s in summary["split"]])
    host = summary["split"] and summary["split"][0]["device_is_host_memory"]
    return (
        f"# KV footprint\n\ndtype {summary['dtype']}: **{summary['bytes_per_token']:,} bytes per token** "
        f"(layers x 2 x KV heads x head dim x dtype bytes); a LoCoMo fact averages "
        f"**{summary['bytes_per_fact_mean'] / 1024:.0f} KiB** of KV at every context window w.\n\n"
        f"The formula matches {summary['stored_files_matching_formula']} of {summary['stored_files']} KV files in "
        f"the store; a safetensors file adds {summary['file_overhead_bytes_mean'] or 0:.0f} bytes of header on "
        f"average (files by storage: {summary['stored_files_by_storage']}).\n\n"
        f"## Bytes per fact by storage dtype (scales included; `kv_storage_dtype`)\n\n{storage}\n\n"
        f"## Per conversation (all facts, one context window)\n\n{conv}\n\n"
        f"## Where the KV of {summary['split_sample']} lives ({summary['split_files']} stored KV files, all "
        f"context windows)\n\n{split}\n\n"
        + ("No GPU here: the device tier is host memory, so its bytes are also the CPU column.\n" if host else
           "The device tier is GPU memory; there is no separate CPU tier (the OS page cache holds recent files).\n")
    )
