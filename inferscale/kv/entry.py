"""One pool entry: a fact's KV, dense in the model's dtype or quantized.

Layout of a dense entry (a :class:`FactKV`):
    keys:      ``[num_layers, num_tokens, num_kv_heads, head_dim]`` pre-RoPE keys
    values:    ``[num_layers, num_tokens, num_kv_heads, head_dim]``
    token_ids: ``[num_tokens]`` int64, the tokens the KV was encoded from
in the served model's dtype (token ids aside). Per layer this is exactly the ``[num_tokens, num_kv_heads,
head_size]`` that vLLM's ``do_kv_cache_update`` takes. An entry may instead be stored in 8 or
4 bits (a :class:`~inferscale.kv.quant.QuantizedKV`, made by :func:`to_storage`): its codes
and scales are what every tier holds, and its ``keys`` / ``values`` are dequantized on
access, so readers see the same ``[num_layers, num_tokens, ...]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferscale.kv import quant
from inferscale.kv.quant import QuantizedKV


@dataclass(frozen=True)
class FactKV:
    """Pre-RoPE keys and values of one token span, all layers.

    Attributes:
        keys: ``[num_layers, num_tokens, num_kv_heads, head_dim]``.
        values: same shape as ``keys``.
        token_ids: the span's ``num_tokens`` token ids (``None``: unknown, so the connector
            never injects the entry).
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        """Size in bytes of keys plus values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def to(self, device: torch.device | str) -> "FactKV":
        return FactKV(self.keys.to(device), self.values.to(device), self.token_ids)


#: What a pool entry is: dense KV in the model's dtype, or its 8- or 4-bit codes.
StoredKV = FactKV | QuantizedKV


def to_storage(kv: FactKV, storage: str) -> StoredKV:
    """``kv`` as the pool should hold it under the ``kv_storage_dtype`` setting ``storage``.

    Args:
        kv: dense KV (``[num_layers, num_tokens, num_kv_heads, head_dim]`` keys and values).
        storage: ``"auto"`` (kept as it is) or one of :data:`inferscale.kv.quant.QUANTIZED_DTYPES`.

    Raises:
        ValueError: another ``storage`` (see :func:`inferscale.kv.quant.quantize`).
    """
    if storage == "auto":
        return kv
    return quant.quantize(kv.keys, kv.values, storage, token_ids=kv.token_ids)


#: safetensors metadata ``format`` of a stored entry (on disk and in Redis).
FORMAT = "inferscale-kv-2"


def to_tensors(kv: StoredKV) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors metadata that store ``kv`` (a file of the disk tier, a
    value of the Redis tier): ``keys`` / ``values`` (or a quantized entry's codes and scales,
    :func:`inferscale.kv.quant.to_tensors`), ``token_ids`` when known, and metadata naming
    the format, the layout and the storage (``model`` or the quantized dtype)."""
    if isinstance(kv, QuantizedKV):
        tensors, meta = quant.to_tensors(kv)
    else:
        tensors = {"keys": kv.keys.detach().contiguous().cpu(), "values": kv.values.detach().contiguous().cpu()}
        meta = {"storage": "model"}
    if kv.token_ids is not None:
        tensors["token_ids"] = torch.tensor(kv.token_ids, dtype=torch.int64)
    return tensors, {"format": FORMAT, "layout": "layers,tokens,kv_heads,head_dim", **meta}


def from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> StoredKV:
    """Inverse of :func:`to_tensors` (entries written before ``storage`` existed read as ``model``).

    Raises:
        KeyError: a tensor or metadata field is missing. ValueError: an unknown storage or
            inconsistent shapes.
    """
    tensors = dict(tensors)
    ids = tensors.pop("token_ids", None)
    token_ids = None if ids is None else tuple(ids.tolist())
    if meta.get("storage", "model") == "model":
        return FactKV(tensors["keys"], tensors["values"], token_ids)
    return quant.from_tensors(tensors, meta, token_ids)
