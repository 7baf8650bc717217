"""Fact KV stored in 8 and 4 bits (issue 30) through the product: the ``kv_storage_dtype``
setting, the pool's files, the connector in vLLM's process (real SmolLM2, real engine), a
storage switch that quantizes stored KV instead of encoding it again, and one request whose
segments mix storage dtypes."""

from __future__ import annotations

import itertools

import pytest
from safetensors import safe_open

from inferscale import Memory
from inferscale.config import MemoryConfig
from inferscale.kv.pool import FactKV, KVPool
from inferscale.kv.quant import QuantizedKV
from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES

USER = "kv-storage-user"
FACTS = ["My dog is called Biscuit.", "I work as a nurse in Lisbon.", "My sister Ana plays the cello.",
         "I am allergic to peanuts.", "My favourite film is Spirited Away.", "I drive a red bicycle to work."]
QUESTION = "What is my dog called?"
_salts = itertools.count()


@pytest.fixture(scope="module")
def memories(serving_dir, engine):
    """One memory per storage dtype over the same data dir and engine; the facts are added
    (and encoded) by the model-dtype one only."""
    opened = {s: Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096,
                        kv_storage_dtype=s) for s in ("auto", "int8", "int4")}
    for fact in FACTS:
        opened["auto"].add(fact, user_id=USER, infer=False)
    assert opened["auto"].wait_for_kv(timeout=600)
    yield opened
    for m in opened.values():
        m.close()


def _metadata(pool: KVPool, key: str) -> dict:
    with safe_open(pool._path(key), framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_a_storage_switch_quantizes_stored_kv_and_the_connector_serves_it(memories, storage):
    mem = memories[storage]
    g = mem.generate(QUESTION, user_id=USER, k=len(FACTS), max_tokens=8)
    inj = mem.inject(QUESTION, user_id=USER, k=len(FACTS))
    assert inj.plan is not None and g.num_injected_tokens == inj.plan.memory_end > 0
    assert "Biscuit" in g.text
    # the model-dtype KV was in the pool: quantized from it, the encoder never loaded
    assert mem.components.kv._encoder is None
    pool = mem.components.pool
    dense = memories["auto"].inject(QUESTION, user_id=USER, k=len(FACTS)).plan
    assert dense.segments[0].key == inj.plan.segments[0].key  # the preamble stays in the model's dtype
    fresh = KVPool(pool.root, "cpu", DEFAULT_DEVICE_KV_BUDGET_BYTES)  # read from disk, as vLLM's process does
    for seg, model_seg in zip(inj.plan.segments[1:], dense.segments[1:]):
        assert seg.key != model_seg.key and seg.num_tokens == model_seg.num_tokens
        assert _metadata(pool, seg.key)["storage"] == storage
        q, d = fresh.get(seg.key), fresh.get(model_seg.key)
        assert isinstance(q, QuantizedKV) and isinstance(d, FactKV) and q.token_ids == d.token_ids
        # bytes with scales, against this fp32 KV (bf16's ratios: int8 <= 0.55x, int4 <= 0.30x in
        # tests/test_kv_quant.py): a quarter and an eighth, plus the scales
        assert q.nbytes / d.nbytes < {"int8": 0.30, "int4": 0.17}[storage]


def test_a_memory_reopened_serves_its_stored_dtype(memories, serving_dir, engine):
    inj = memories["int4"].inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True)
    again = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096, kv_storage_dtype="int4")
    try:
        g = again.generate(QUESTION, user_id=USER, k=len(FACTS), max_tokens=8)
        assert g.num_injected_tokens == inj.plan.memory_end
        assert again.components.kv._encoder is None  # nothing encoded or quantized again
        assert again.inject(QUESTION, user_id=USER, k=len(FACTS)).plan.keys == inj.plan.keys
    finally:
        again.close()


def test_one_request_mixing_storage_dtypes_injects_what_the_reference_path_computes(memories, engine):
    """Preamble in the model's dtype, facts alternately int8 and int4, in one request: vLLM's
    first-token logprobs equal the transformers reference path's on the same stored KV."""
    plans = {s: memories[s].inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True) for s in ("int8", "int4")}
    ids = plans["int8"].prompt_token_ids
    assert plans["int4"].prompt_token_ids == ids
    segments = [[s.key, s.start, s.num_tokens] for s in plans["int8"].plan.segments]
    for i in range(2, len(segments), 2):
        segments[i][0] = plans["int4"].plan.segments[i].key
    params = {"inferscale": {"memory_end": plans["int8"].plan.memory_end, "segments": segments}}
    out = engine.generate(ids, kv_transfer_params=params, cache_salt=f"mixed-{next(_salts)}", max_tokens=1,
                          logprobs=20)
    assert out.num_injected_tokens == plans["int8"].plan.memory_end
    pool = memories["auto"].components.pool
    kinds = {type(pool.get(key)).__name__ + (f"/{pool.get(key).dtype}" if isinstance(pool.get(key), QuantizedKV)
                                             else "") for key, _, _ in segments}
    assert kinds == {"FactKV", "QuantizedKV/int8", "QuantizedKV/int4"}
    ref = memories["auto"].reference_model()
    expected = ref.next_token_logprobs(ids, [(start, pool.get(key)) for key, start, _ in segments])
    common = list(out.first_logprobs)
    assert max(abs(out.first_logprobs[t] - float(expected[t])) for t in common) < 1e-3


def test_a_bad_storage_dtype_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="kv_storage_dtype") as exc:
        MemoryConfig(kv_storage_dtype="int3")
    assert "INFERSCALE_KV_STORAGE_DTYPE" in str(exc.value)
