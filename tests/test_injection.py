"""The injection plan and its tensor work without vLLM: wire format, staging, slot mapping,
per-layer rotate-and-write into a paged cache, and the blocks reported on a failed load."""

import pytest
import torch
from transformers import LlamaConfig

from inferscale.kv.injection import (
    InjectionPlan,
    LayerWriter,
    MissingKVError,
    blocks_to_recompute,
    injected_tokens,
    report_params,
    slot_mapping,
    stage,
    write_layers,
)
from inferscale.kv.pool import FactKV, kv_key
from inferscale.kv.rope import RopeRotator

LAYERS, HEADS, DIM, BLOCK = 3, 2, 16, 4


def fact_kv(n: int, seed: int) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    return FactKV(torch.randn(LAYERS, n, HEADS, DIM, generator=g), torch.randn(LAYERS, n, HEADS, DIM, generator=g))


@pytest.fixture
def stored():
    """A preamble of 5 tokens and two facts of 3 and 6 tokens: 14 memory tokens."""
    kvs = {kv_key("_preamble", a=1): fact_kv(5, 0), kv_key("f1", a=1): fact_kv(3, 1), kv_key("f2", a=1): fact_kv(6, 2)}
    plan = InjectionPlan.of([(k, s, kv.num_tokens) for (k, kv), s in zip(kvs.items(), (0, 5, 8))])
    return plan, kvs


def test_plan_round_trips_through_the_wire_format(stored):
    plan, _ = stored
    params = plan.to_params()
    assert InjectionPlan.from_params(params) == plan
    assert plan.memory_end == 14 and plan.keys == tuple(params["inferscale"]["segments"][i][0] for i in range(3))
    assert plan.cache_salt() == InjectionPlan.from_params(params).cache_salt()
    other = InjectionPlan.of([(kv_key("_preamble", a=2), 0, 5)])
    assert other.cache_salt() != plan.cache_salt()
    assert injected_tokens(report_params(14)) == 14 and injected_tokens(None) == 0 and injected_tokens({}) == 0


def test_plans_with_gaps_are_refused_when_built_too():
    with pytest.raises(ValueError, match="continue"):
        InjectionPlan.of([(kv_key("_preamble", a=1), 0, 3), (kv_key("f", a=1), 4, 2)])


def test_stage_gathers_from_the_first_uncomputed_position(stored):
    plan, kvs = stored
    whole = stage(plan, 0, kvs.get)
    assert whole.num_tokens == 14 and whole.positions.tolist() == list(range(14))
    assert torch.equal(whole.keys[:, 5:8], kvs[plan.keys[1]].keys)
    part = stage(plan, 6, kvs.get)  # the prefix cache computed 6 tokens: start inside fact 1
    assert part.positions.tolist() == list(range(6, 14))
    assert torch.equal(part.values, whole.values[:, 6:])
    assert stage(plan, 14, kvs.get) is None


def mixed_plan() -> tuple[InjectionPlan, dict]:
    """A dense preamble, then facts alternately int8 and int4 (DIM 16, value groups of 8)."""
    from inferscale.kv.quant import quantize
    kvs = {kv_key("_preamble", a=3): fact_kv(5, 0)}
    for i, (n, dtype) in enumerate([(3, "int8"), (6, "int4"), (4, "int8"), (2, "int4"), (5, "int4")]):
        dense = fact_kv(n, 10 + i)
        kvs[kv_key(f"f{i}", a=3)] = quantize(dense.keys, dense.values, dtype, value_group=8)
    starts, pos = [], 0
    for kv in kvs.values():
        starts.append(pos)
        pos += kv.num_tokens
    return InjectionPlan.of([(k, s, kv.num_tokens) for (k, kv), s in zip(kvs.items(), starts)]), kvs


@pytest.mark.parametrize("start", [0, 6, 10, 16])
def test_the_gpu_way_stages_the_same_kv_as_the_cpu_way(start):
    """Batched (one dequantization per storage dtype, one concatenation: the GPU way) and per
    segment (the CPU way) give bit-identical keys, values and positions, from any start."""
    from inferscale.kv.quant import QuantizedRun

    plan, kvs = mixed_plan()
    per_segment = stage(plan, start, kvs.get, batched=False)  # fused: runs dequantized a layer at a time
    unfused = stage(plan, start, kvs.get, batched=False, fused=False)  # each segment whole first
    batched = stage(plan, start, kvs.get, batched=True)
    assert len(batched.key_parts) == 1 and len(per_segment.key_parts) > 1
    runs = [p for p in per_segment.key_parts if isinstance(p, QuantizedRun)]
    assert runs and runs[-1].num_tokens == 7 and len(per_segment.key_parts) < len(unfused.key_parts)  # f3+f4: one run
    assert torch.equal(batched.positions, per_segment.positions)
    assert batched.positions.tolist() == list(range(start, plan.memory_end))
    for other in (per_segment, unfused):
        assert torch.equal(batched.keys, other.keys) and torch.equal(batched.values, other.values)
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(batched.layer(layer), other.layer(layer)))
    # and each fact's slice is its own dequantized KV
    seg = plan.segments[3]
    lo = max(seg.start, start) - start
    assert torch.equal(batched.keys[:, lo:lo + seg.end - max(seg.start, start)],
                       kvs[seg.key].keys[:, max(seg.start, start) - seg.start:])


def test_stage_refuses_missing_or_wrong_length_kv(stored):
    plan, kvs = stored
    with pytest.raises(MissingKVError, match="not in the pool"):
        stage(plan, 0, lambda key: None if key == plan.keys[2] else kvs[key])
    with pytest.raises(MissingKVError, match="planned 6"):
        stage(plan, 0, lambda key: fact_kv(2, 9) if key == plan.keys[2] else kvs[key])
    assert stage(plan, 8, lambda key: None if key == plan.keys[0] else kvs[key]) is not None  # computed: not read


def test_slot_mapping_follows_vllms_paged_layout():
    slots = slot_mapping(torch.arange(2, 11), [7, 3, 9], BLOCK)
    assert slots.tolist() == [30, 31, 12, 13, 14, 15, 36, 37, 38]
    with pytest.raises(ValueError, match="past the request"):
        slot_mapping(torch.arange(0, 13), [7, 3, 9], BLOCK)
    assert blocks_to_recompute(6, 14, [7, 3, 9, 4], BLOCK) == [3, 9, 4]
    assert blocks_to_recompute(0, 3, [7, 3], BLOCK) == [7]


def test_write_layers_puts_rotated_keys_and_values_in_each_layers_slots(stored):
    plan, kvs = stored
    rotator = RopeRotator(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=HEADS, head_dim=DIM))
    block_ids = [5, 2, 7, 1]
    # a paged cache per layer, [num_blocks * block_size, H, D] for K and for V
    caches = [(torch.zeros(8 * BLOCK, HEADS, DIM), torch.zeros(8 * BLOCK, HEADS, DIM)) for _ in range(LAYERS)]

    def writer(i):
        def write(k, v, slots):
            caches[i][0].index_copy_(0, slots, k)
            caches[i][1].index_copy_(0, slots, v)
        return LayerWriter(i, torch.device("cpu"), torch.float32, write)

    staged = stage(plan, 3, kvs.get)
    slots = slot_mapping(staged.positions, block_ids, BLOCK)
    write_layers(staged, slots, rotator, [writer(i) for i in range(LAYERS)])
    expected_keys = rotator.rotate(stage(plan, 0, kvs.get).keys, torch.arange(14))  # all layers at once
    for layer in range(LAYERS):
        for pos in range(14):
            slot = block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
            k, v = caches[layer][0][slot], caches[layer][1][slot]
            if pos < 3:  # computed by the prefix cache: untouched
                assert not k.any() and not v.any()
            else:
                assert torch.allclose(k, expected_keys[layer, pos], atol=1e-6)
                assert torch.equal(v, staged.values[layer, pos - 3])
