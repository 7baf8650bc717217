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
