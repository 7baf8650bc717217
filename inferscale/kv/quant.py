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
injected (:func:`inferscale.kv.injection.stage`, in the connector's load path), before
rotation and the write into vLLM's cache. A :class:`QuantizedKV` answers ``keys``,
``values``, ``token_ids``, ``num_tokens``, ``nbytes`` and ``to`` as a
:class:`~inferscale.kv.pool.FactKV` does, so the pool's device tier holds the codes (2-4x
more facts in the same budget) and every reader gets dense KV on access.

On disk (:func:`to_tensors` / :func:`from_tensors`) the codes and scales sit beside the
token ids in one safetensors file whose metadata names the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Storage dtypes of fact KV besides the model's own.
QUANTIZED_DTYPES = ("int8", "int4")
#: Every ``kv_storage_dtype`` setting: ``"auto"`` stores the model's dtype (vLLM's meaning of
#: ``kv_cache_dtype="auto"``), the others quantize.
STORAGE_DTYPES = ("auto", *QUANTIZED_DTYPES)
#: Channels per value scale (KIVI's group size; not tuned: docs/decisions.md).
VALUE_GROUP = 32
_QMAX = {"int8": 127, "int4": 7}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        token_ids: the span's ``T`` token ids (``None``: unknown), as in ``FactKV``.
    """

    dtype: str
    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    out_dtype: torch.dtype
    token_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.k_codes.shape[1])

    @property
    def keys(self) -> torch.Tensor:
        """Dequantized pre-RoPE keys ``[L, T, H, D]`` in ``out_dtype`` (computed on each access)."""
        return dequantize_keys(self)

    @property
    def values(self) -> torch.Tensor:
        """Dequantized values ``[L, T, H, D]`` in ``out_dtype`` (computed on each access)."""
        return dequantize_values(self)

    def to(self, device: torch.device | str) -> "QuantizedKV":
        """The same codes and scales on ``device``."""
        return QuantizedKV(self.dtype, self.k_codes.to(device), self.k_scales.to(device), self.v_codes.to(device),
                           self.v_scales.to(device), self.out_dtype, self.token_ids)

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


def quantize(keys: torch.Tensor, values: torch.Tensor, dtype: str, value_group: int = VALUE_GROUP,
             token_ids: tuple[int, ...] | None = None) -> QuantizedKV:
    """Quantize one fact's pre-RoPE keys and values.

    Args:
        keys, values: ``[num_layers, num_tokens, num_kv_heads, head_dim]`` (any float dtype).
        dtype: ``"int8"`` or ``"int4"``.
        value_group: channels per value scale (divides ``head_dim``).
        token_ids: the span's tokens, kept with the codes.

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
    return QuantizedKV(dtype, k_codes, k_scales, v_codes, v_scales.squeeze(-1), keys.dtype, token_ids)


def dequantize(q: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values back in ``q.out_dtype``, each ``[L, T, H, D]`` (vectorized)."""
    return dequantize_keys(q), dequantize_values(q)


def dequantize_keys(q: QuantizedKV) -> torch.Tensor:
    """Keys ``[L, T, H, D]`` in ``q.out_dtype``: codes times their channel's scale."""
    return _scaled(q.k_codes, q.k_scales, q.dtype).to(q.out_dtype)


def dequantize_values(q: QuantizedKV) -> torch.Tensor:
    """Values ``[L, T, H, D]`` in ``q.out_dtype``: codes times their token group's scale."""
    layers, tokens, heads, width = q.v_codes.shape
    groups = int(q.v_scales.shape[-1])
    grouped = q.v_codes.reshape(layers, tokens, heads, groups, width // groups)
    return _scaled(grouped, q.v_scales.unsqueeze(-1), q.dtype).reshape(layers, tokens, heads, q.head_dim).to(
        q.out_dtype)


def _one_kind(entries: list[tuple[QuantizedKV, int]], what: str) -> QuantizedKV:
    """The first entry, once every entry is of its storage dtype, value group and output dtype.

    Raises:
        ValueError: no entries, or entries of different kinds.
    """
    if not entries:
        raise ValueError(f"{what} needs at least one entry")
    first = entries[0][0]
    if any((q.dtype, q.value_group, q.out_dtype) != (first.dtype, first.value_group, first.out_dtype)
           for q, _ in entries):
        raise ValueError(f"{what} takes entries of one storage dtype, value group and output dtype")
    return first


def dequantize_many(entries: list[tuple[QuantizedKV, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of several facts, from token ``lo`` of each, in one pass over all of them.

    What a GPU wants: the codes are concatenated first and dequantized by a handful of
    kernels for the whole request, instead of a handful per fact (launches, not bytes, bound
    the per-fact way there: docs/decisions.md). Each fact's per-channel key scales are
    repeated over its tokens (``repeat_interleave``); value scales are per token already.

    Args:
        entries: ``(q, lo)`` pairs, one storage dtype, value group and ``out_dtype``, all on
            one device; ``0 <= lo < q.num_tokens``.

    Returns:
        keys, values: ``[L, N, H, D]`` in ``out_dtype``, ``N`` the sum of ``q.num_tokens - lo``,
        in the entries' order; equal to concatenating each :func:`dequantize` result.

    Raises:
        ValueError: no entries, or entries of different dtypes, value groups or output dtypes.
    """
    first = _one_kind(entries, "dequantize_many")
    counts = [q.num_tokens - lo for q, lo in entries]
    k_codes = torch.cat([q.k_codes[:, lo:] for q, lo in entries], dim=1)
    v_codes = torch.cat([q.v_codes[:, lo:] for q, lo in entries], dim=1)
    v_scales = torch.cat([q.v_scales[:, lo:] for q, lo in entries], dim=1)
    k_scales = torch.repeat_interleave(torch.cat([q.k_scales for q, _ in entries], dim=1),
                                       torch.tensor(counts, device=k_codes.device), dim=1, output_size=sum(counts))
    many = QuantizedKV(first.dtype, k_codes, k_scales, v_codes, v_scales, first.out_dtype)
    return dequantize_keys(many), dequantize_values(many)


class QuantizedRun:
    """Consecutive quantized facts (one storage dtype) of a request, dequantized one layer at a
    time: the CPU's fused way. ``run[layer]`` is that layer's keys (or values), so the
    dequantized ``[N, H, D]`` (~1.1 MiB in fp32 at k=50 for SmolLM2) is made, rotated and
    written while it sits in cache, instead of every fact's every layer going through memory
    in float first (docs/decisions.md). The codes are concatenated once per request (4 or 8
    bits a value); key scales are repeated over each fact's tokens per layer, when used.

    Args:
        entries: ``(q, lo)`` pairs as :func:`dequantize_many` takes them.
        values: the values (``True``) or the keys (``False``) of the run.

    Raises:
        ValueError: as :func:`dequantize_many`.
    """

    def __init__(self, entries: list[tuple[QuantizedKV, int]], values: bool) -> None:
        first = _one_kind(entries, "a QuantizedRun")
        self.dtype, self.out_dtype, self.values = first.dtype, first.out_dtype, values
        self.head_dim, self.groups = first.head_dim, int(first.v_scales.shape[-1])
        counts = [q.num_tokens - lo for q, lo in entries]
        self.num_tokens = sum(counts)
        if values:
            self.codes = torch.cat([q.v_codes[:, lo:] for q, lo in entries], dim=1)
            self.scales = torch.cat([q.v_scales[:, lo:] for q, lo in entries], dim=1).float()
            self.repeats = None
        else:
            self.codes = torch.cat([q.k_codes[:, lo:] for q, lo in entries], dim=1)
            self.scales = torch.cat([q.k_scales for q, _ in entries], dim=1).float()  # [L, F, H, D]
            self.repeats = torch.tensor(counts, device=self.codes.device)

    @property
    def shape(self) -> torch.Size:
        """``[L, N, H, D]``, the dequantized run's shape."""
        layers, tokens, heads, _ = self.codes.shape
        return torch.Size((layers, tokens, heads, self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __getitem__(self, layer: int) -> torch.Tensor:
        """Layer ``layer``: ``[N, H, D]`` in ``out_dtype``, equal to that layer of :func:`dequantize_many`."""
        codes, scales = self.codes[layer], self.scales[layer]
        if self.values:
            tokens, heads, width = codes.shape
            grouped = codes.reshape(tokens, heads, self.groups, width // self.groups)
            out = _scaled(grouped, scales.unsqueeze(-1), self.dtype).reshape(tokens, heads, self.head_dim)
        else:
            out = _scaled(codes, torch.repeat_interleave(scales, self.repeats, dim=0, output_size=self.num_tokens),
                          self.dtype)
        return out.to(self.out_dtype)

    def full(self) -> torch.Tensor:
        """Every layer, ``[L, N, H, D]`` (a copy; tests and tools)."""
        return torch.stack([self[i] for i in range(self.shape[0])])


#: safetensors metadata ``layout`` of a quantized entry (:func:`to_tensors`).
LAYOUT = ("k_codes,v_codes: layers,tokens,kv_heads,head_dim (int4: head_dim/2, two codes a byte, low nibble "
          "first, code+8); k_scales: layers,1,kv_heads,head_dim (per channel over tokens); v_scales: "
          "layers,tokens,kv_heads,head_dim/group (per token and group); symmetric, x = code * scale")


def to_tensors(q: QuantizedKV) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors metadata that store ``q`` (token ids excluded: the pool adds them)."""
    tensors = {"k_codes": q.k_codes, "k_scales": q.k_scales, "v_codes": q.v_codes, "v_scales": q.v_scales}
    meta = {"storage": q.dtype, "out_dtype": str(q.out_dtype).removeprefix("torch."),
            "value_group": str(q.value_group), "quant_layout": LAYOUT}
    return {k: t.detach().contiguous().cpu() for k, t in tensors.items()}, meta


def from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, str],
                 token_ids: tuple[int, ...] | None) -> QuantizedKV:
    """Inverse of :func:`to_tensors`.

    Raises:
        KeyError: a tensor or metadata field is missing. ValueError: an unknown storage or
            output dtype, or shapes that do not fit together.
    """
    dtype, out = meta["storage"], meta["out_dtype"]
    if dtype not in _QMAX or out not in _DTYPES:
        raise ValueError(f"unknown quantized KV: storage {dtype!r}, out_dtype {out!r}")
    q = QuantizedKV(dtype, tensors["k_codes"], tensors["k_scales"], tensors["v_codes"], tensors["v_scales"],
                    _DTYPES[out], token_ids)
    if q.k_codes.shape != q.v_codes.shape or q.head_dim % max(int(q.v_scales.shape[-1]), 1):
        raise ValueError(f"quantized KV of inconsistent shapes: codes {tuple(q.k_codes.shape)} / "
                         f"{tuple(q.v_codes.shape)}, scales {tuple(q.k_scales.shape)} / {tuple(q.v_scales.shape)}")
    return q


def nbytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: str,
           value_group: int = VALUE_GROUP, model_bytes: int = 2) -> int:
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


def _scaled(codes: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """float32 ``code * scale``: ``codes`` ``[..., C]`` (int4: uint8 ``[..., C // 2]``), ``scales`` broadcastable.

    One pass per step, no int8 intermediate: int8 codes are cast inside the multiply; int4
    nibbles are written straight into their float32 slots (even channels from the low
    nibble, odd from the high), then shifted by 8 and scaled in place. The result is
    bit-identical to ``float(_unpack4(codes)) * scale`` (``n - 8`` is exact in float32)
    and, on the 2-core EPYC, about 1.4x faster than unpacking to int8 first (docs/decisions.md).
    """
    scale = scales.float()
    if dtype != "int4":
        return torch.mul(codes, scale)
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=torch.float32, device=codes.device)
    out[..., 0::2] = codes & 0x0F
    out[..., 1::2] = codes >> 4
    return out.sub_(8).mul_(scale)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` -> int8 codes ``[..., D]`` (inverse of :func:`_pack4`)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
