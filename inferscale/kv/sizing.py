"""What a fact's KV file takes on disk, before any is written: for sizing ``disk_kv_budget_bytes``.

A fact of ``n`` tokens is one safetensors file (:mod:`inferscale.kv.disk`): its keys and
values, ``[num_layers, n, num_kv_heads, head_dim]`` each, in the model's dtype or as 8-/4-bit
codes with their scales (:mod:`inferscale.kv.quant`: the keys' scales are per channel over
the fact's tokens, so a quantized file has a fixed part per fact), its ``n`` token ids
(8 bytes each) and a JSON header. :func:`kv_file_bytes` builds such an entry of zeros from
the model's ``config.json`` (no weights loaded) and returns the exact size its file has.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from inferscale.kv.entry import FactKV, to_storage, to_tensors
from inferscale.kv.quant import STORAGE_DTYPES
from inferscale.models.kv_shape import _Config, kv_dims
from inferscale.runtime.devices import torch_dtype


def kv_file_bytes(model_path: Path, dtype: str, storage: str, num_tokens: int) -> int:
    """Bytes of the KV file of one fact of ``num_tokens`` tokens (its memory line's tokens:
    :meth:`inferscale.Memory.fact_tokens`).

    Args:
        model_path: the model's folder (its ``config.json`` is read).
        dtype: the model's dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
        storage: ``"auto"`` (the model's dtype), ``"int8"`` or ``"int4"``.
        num_tokens: tokens of the fact, at least 1.

    Returns:
        The file's size in bytes (tensors, token ids and header), as the disk tier writes it.

    Raises:
        ValueError: an unknown dtype or storage, or ``num_tokens`` below 1.
        OSError: the model's ``config.json`` cannot be read.
    """
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a whole number of tokens >= 1, got {num_tokens!r}")
    layers, heads, dim = kv_dims(_Config(json.loads((Path(model_path) / "config.json").read_text())))
    zeros = torch.zeros(layers, num_tokens, heads, dim, dtype=torch_dtype(dtype))
    entry = to_storage(FactKV(zeros, zeros.clone(), tuple(range(num_tokens))), storage)
    tensors, meta = to_tensors(entry)
    return len(save(tensors, metadata=meta))
