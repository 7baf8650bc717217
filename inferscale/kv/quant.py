"""Fact KV in 8 and 4 bits: keys per channel (pre-RoPE), values per token in groups.

The layout follows KVQuant (Hooper et al., arXiv 2401.18079) and KIVI (Liu et al., ICML
2024): keys are quantized **per channel** (one scale per layer, KV head and head-dim
channel, over the fact's tokens), which keeps the few outlier channels of pre-RoPE keys from
widening every other channel's step; values are quantized **per token**, in groups of
``value_group`` channels along the head dimension. Both are symmetric (a scale, no zero
point): ``code = round(x / scale)``, ``scale = max|x| / qmax`` with ``qmax`` 127 for int8 and
7 for int4 (codes -8..7, two to a byte, low nibble first). Scales are float16.

Bytes per element, with ``T`` tokens in the fact and ``G`` the value group:
int8 ``(1 + 2/T) / 2 + (1 + 2/G) / 2`` and int4 ``(0.5 + 2/T) / 2 + (0.5 + 2/G) / 2``, against
2 for bf16 and 4 for fp32 (:func:`nbytes`).

Dequantization is two vectorized multiplies (and, for int4, an unpack), run where the KV is
injected, before rotation and the write into vLLM's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Storage dtypes of fact KV besides the model's own.
QUANTIZED_DTYPES = ("int8", "int4")
_QMAX = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class QuantizedKV:
    """The quantized keys and values of one fact (all layers).

    Attributes:
        dtype: ``"int8"`` or ``"int4"``.
        k_codes: int8 ``[L, T, H, D]`` (int4: uint8 ``[L, T, H, D // 2]``, two codes a byte).
        k_scales: float16 ``[L, 1, H, D]``: one per channel over the fact's tokens.
        v_codes: as ``k_codes``.
        v_scales: float16 ``[L, T, H, D // value_group]``: one per token and group.
        out_dtype: the dtype :func:`dequantize` returns (the model's).
    """

    dtype: str
    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    out_dtype: torch.dtype

    @property
    def value_group(self) -> int:
        """Channels per value scale."""
        return self.head_dim // int(self.v_scales.shape[-1])

    @property
    def head_dim(self) -> int:
        return int(self.k_scales.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_scales, self.v_codes, self.v_scales))


def quantize(keys: torch.Tensor, values: torch.Tensor, dtype: str, value_group: int = 32) -> QuantizedKV:
    """Quantize one fact's pre-RoPE keys and values.

    Args:
        keys, values: ``[num_layers, num_tokens, num_kv_heads, head_dim]`` (any float dtype).
        dtype: ``"int8"`` or ``"int4"``.
        value_group: channels per value scale (divides ``head_dim``).

    Raises:
        ValueError: another dtype, shapes that differ or are not 4-D, an empty span, a
            ``value_group`` that does not divide ``head_dim``, or int4 with an odd ``head_dim``.
    """
    if dtype not in _QMAX:
        raise ValueError(f"cannot quantize KV to {dtype!r}: use one of {', '.join(QUANTIZED_DTYPES)}")
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[1] == 0:
        raise ValueError(f"keys and values must both be [layers, tokens > 0, kv_heads, head_dim], got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    layers, tokens, heads, dim = keys.shape
    if value_group <= 0 or dim % value_group:
        raise ValueError(f"value_group {value_group} must divide head_dim {dim}")
    if dtype == "int4" and dim % 2:
        raise ValueError(f"int4 packs two codes a byte: head_dim {dim} must be even")
    qmax = _QMAX[dtype]
    k = keys.float()
    k_scales = _scales(k.abs().amax(dim=1, keepdim=True), qmax)  # [L, 1, H, D]
    k_codes = torch.round(k / k_scales.float()).clamp_(-qmax - (dtype == "int4"), qmax).to(torch.int8)
    v = values.float().reshape(layers, tokens, heads, dim // value_group, value_group)
    v_scales = _scales(v.abs().amax(dim=-1, keepdim=True), qmax)  # [L, T, H, D/G, 1]
    v_codes = torch.round(v / v_scales.float()).clamp_(-qmax - (dtype == "int4"), qmax).to(torch.int8)
    v_codes = v_codes.reshape(layers, tokens, heads, dim)
    if dtype == "int4":
        k_codes, v_codes = _pack4(k_codes), _pack4(v_codes)
    return QuantizedKV(dtype, k_codes, k_scales, v_codes, v_scales.squeeze(-1), keys.dtype)


def dequantize(q: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values back in ``q.out_dtype``, each ``[L, T, H, D]`` (vectorized)."""
    k_codes, v_codes = (_unpack4(q.k_codes), _unpack4(q.v_codes)) if q.dtype == "int4" else (q.k_codes, q.v_codes)
    keys = k_codes.float() * q.k_scales.float()
    layers, tokens, heads, dim = v_codes.shape
    group = q.value_group
    values = (v_codes.float().reshape(layers, tokens, heads, dim // group, group)
              * q.v_scales.float().unsqueeze(-1)).reshape(layers, tokens, heads, dim)
    return keys.to(q.out_dtype), values.to(q.out_dtype)


def nbytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: str,
           value_group: int = 32, model_bytes: int = 2) -> int:
    """Bytes one fact's keys and values take in ``dtype`` (``"model"``: ``model_bytes`` an
    element, 2 for bf16, 4 for fp32), scales included; as :attr:`QuantizedKV.nbytes`."""
    elements = num_layers * num_tokens * num_kv_heads * head_dim
    if dtype == "model":
        return 2 * elements * model_bytes
    code_bytes = elements if dtype == "int8" else elements // 2
    k_scales = num_layers * num_kv_heads * head_dim * 2
    v_scales = num_layers * num_tokens * num_kv_heads * (head_dim // value_group) * 2
    return 2 * code_bytes + k_scales + v_scales


def _scales(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """float16 scales ``amax / qmax``; an all-zero channel gets scale 1 (its codes are 0)."""
    scales = (amax / qmax).to(torch.float16)
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in -8..7, ``[..., D]`` -> uint8 ``[..., D // 2]``, low nibble first."""
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` -> int8 codes ``[..., D]`` (inverse of :func:`_pack4`)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
