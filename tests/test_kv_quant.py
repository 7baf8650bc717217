"""Fact KV in 8 and 4 bits (issue 30, first step): the quantizer's round trip on real SmolLM2
KV of LoCoMo facts, its bytes, and its refusals. Not yet wired into the pool or the connector."""

from __future__ import annotations

import json

import pytest
import torch

from inferscale.kv.encoder import EncodeItem
from inferscale.kv.quant import _pack4, _unpack4, dequantize, nbytes, quantize

# measured on 40 facts of LoCoMo conversation 0, fp32 KV (2026-12-04): relative Frobenius error
# of keys / values, int8 0.0039 / 0.0060, int4 0.070 / 0.108 at the worst fact; bounds with margin
BOUNDS = {"int8": (0.006, 0.009), "int4": (0.10, 0.15)}


@pytest.fixture(scope="module")
def fact_kv(encoder, tokenizer, locomo_path):
    sample = json.loads(locomo_path.read_text())[0]
    facts = [item[0] for obs in sample["observation"].values() for items in obs.values() for item in items][:40]
    items = [EncodeItem((), tuple(tokenizer.encode(f"- {f}\n", add_special_tokens=False))) for f in facts]
    return encoder.encode(items)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_round_trip_error_on_real_fact_kv_is_within_the_measured_bound(fact_kv, dtype):
    k_bound, v_bound = BOUNDS[dtype]
    ratios = []
    for kv in fact_kv:
        q = quantize(kv.keys, kv.values, dtype)
        keys, values = dequantize(q)
        assert keys.dtype == values.dtype == kv.keys.dtype and keys.shape == kv.keys.shape
        assert rel(keys, kv.keys) <= k_bound and rel(values, kv.values) <= v_bound
        layers, tokens, heads, dim = kv.keys.shape
        assert q.nbytes == nbytes(layers, tokens, heads, dim, dtype)
        ratios.append(q.nbytes / nbytes(layers, tokens, heads, dim, "model", model_bytes=2))
    # the budget against bf16 KV, scales included, over these facts (9-33 tokens)
    assert sum(ratios) / len(ratios) <= {"int8": 0.55, "int4": 0.30}[dtype], ratios
    # int4 is coarser than int8 on the same KV (the test can tell them apart)
    if dtype == "int4":
        kv = fact_kv[0]
        assert rel(dequantize(quantize(kv.keys, kv.values, "int4"))[0], kv.keys) > 5 * rel(
            dequantize(quantize(kv.keys, kv.values, "int8"))[0], kv.keys)


def test_keys_are_scaled_per_channel_so_an_outlier_channel_does_not_widen_the_others():
    torch.manual_seed(0)
    keys = torch.randn(2, 16, 3, 64)
    keys[:, :, :, 5] *= 200  # one outlier channel, as pre-RoPE keys have
    values = torch.randn(2, 16, 3, 64)
    out, _ = dequantize(quantize(keys, values, "int4"))
    others = [c for c in range(64) if c != 5]
    assert rel(out[..., others], keys[..., others]) < 0.15  # a per-tensor scale would leave them near 0


def test_many_facts_dequantized_together_equal_each_dequantized_alone():
    from inferscale.kv.quant import dequantize_many
    g = torch.Generator().manual_seed(3)
    for dtype in ("int8", "int4"):
        qs = [quantize(torch.randn(2, n, 3, 64, generator=g), torch.randn(2, n, 3, 64, generator=g), dtype)
              for n in (4, 1, 7)]
        keys, values = dequantize_many([(qs[0], 0), (qs[1], 0), (qs[2], 3)])
        assert torch.equal(keys, torch.cat([qs[0].keys, qs[1].keys, qs[2].keys[:, 3:]], dim=1))
        assert torch.equal(values, torch.cat([qs[0].values, qs[1].values, qs[2].values[:, 3:]], dim=1))
    with pytest.raises(ValueError, match="one storage dtype"):
        dequantize_many([(qs[0], 0), (quantize(qs[0].keys, qs[0].values, "int8"), 0)])
    with pytest.raises(ValueError, match="at least one"):
        dequantize_many([])


def test_int4_packing_is_exact_and_bf16_stays_bf16():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(4).reshape(2, 32)
    assert torch.equal(_unpack4(_pack4(codes)), codes)
    kv = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
    keys, values = dequantize(quantize(kv, kv.clone(), "int8", value_group=8))
    assert keys.dtype == torch.bfloat16 and rel(keys, kv) < 0.02
    zeros = torch.zeros(1, 2, 1, 8)
    assert torch.equal(dequantize(quantize(zeros, zeros, "int4", value_group=4))[0], zeros)


@pytest.mark.parametrize("call,says", [
    (lambda t: quantize(t, t, "fp8"), "use one of int8, int4"),
    (lambda t: quantize(t, t[:, :1], "int8"), "must both be"),
    (lambda t: quantize(t[:, :0], t[:, :0], "int8"), "tokens > 0"),
    (lambda t: quantize(t, t, "int8", value_group=48), "must divide head_dim"),
    (lambda t: quantize(t[..., :7], t[..., :7], "int4", value_group=7), "must be even"),
])
def test_bad_input_is_refused(call, says):
    with pytest.raises(ValueError, match=says):
        call(torch.randn(1, 4, 2, 64))
