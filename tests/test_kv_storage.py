"""Fact KV stored in 8 and 4 bits (issue 30) through the product: the ``kv_storage_dtype``
setting, the pool's files, the connector in vLLM's process (real SmolLM2, real engine), a
storage switch that quantizes stored KV instead of encoding it again and replaces each
fact's file (issue 38), and one request whose segments mix storage dtypes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from safetensors import safe_open

from inferscale import Memory
from inferscale.config import MemoryConfig
from inferscale.kv.pool import FactKV, KVPool, to_storage
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


def _kv_files(pool: KVPool) -> dict[str, int]:
    """The pool folder's KV files: key -> bytes."""
    return {f"{p.parent.name}/{p.stem}": p.stat().st_size for p in Path(pool.root).glob("*/*.safetensors")}


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_a_storage_switch_quantizes_stored_kv_replaces_its_files_and_the_connector_serves_it(memories, storage):
    """The model-dtype KV is in the pool (encoded again if an earlier switch replaced it):
    the switched memory quantizes it instead of encoding, each fact's model-dtype file is
    gone once its quantized one exists (issue 38: a switch no longer grows the folder), and
    vLLM's connector serves the quantized KV."""
    mem, pool = memories[storage], memories[storage].components.pool
    dense = memories["auto"].inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True).plan
    stored = KVPool(pool.root, "cpu", DEFAULT_DEVICE_KV_BUDGET_BYTES)  # read from disk, as vLLM's process does
    dense_kv = {seg.key: stored.get(seg.key) for seg in dense.segments[1:]}
    before = _kv_files(pool)
    assert all(key in before for key in dense_kv)

    g = mem.generate(QUESTION, user_id=USER, k=len(FACTS), max_tokens=8)
    inj = mem.inject(QUESTION, user_id=USER, k=len(FACTS))
    assert inj.plan is not None and g.num_injected_tokens == inj.plan.memory_end > 0
    assert "Biscuit" in g.text
    # the model-dtype KV was in the pool: quantized from it, the encoder never loaded
    assert mem.components.kv._encoder is None
    assert dense.segments[0].key == inj.plan.segments[0].key  # the preamble stays in the model's dtype
    after = _kv_files(pool)
    fresh = KVPool(pool.root, "cpu", DEFAULT_DEVICE_KV_BUDGET_BYTES)
    for seg, model_seg in zip(inj.plan.segments[1:], dense.segments[1:]):
        assert seg.key != model_seg.key and seg.num_tokens == model_seg.num_tokens
        assert _metadata(pool, seg.key)["storage"] == storage
        assert seg.key in after and model_seg.key not in after  # replaced, not added to
        # the size Memory.kv_file_bytes predicts, before anything was encoded, is the file's
        assert after[seg.key] == mem.kv_file_bytes(seg.num_tokens)
        assert before[model_seg.key] == memories["auto"].kv_file_bytes(model_seg.num_tokens)
        q, d = fresh.get(seg.key), dense_kv[model_seg.key]
        assert isinstance(q, QuantizedKV) and isinstance(d, FactKV) and q.token_ids == d.token_ids
        # bytes with scales, against this fp32 KV (bf16's ratios: int8 <= 0.55x, int4 <= 0.30x in
        # tests/test_kv_quant.py): a quarter and an eighth, plus the scales
        assert q.nbytes / d.nbytes < {"int8": 0.30, "int4": 0.17}[storage]
    assert sum(after.values()) < sum(before.values())


def test_switching_back_to_the_model_dtype_replaces_the_quantized_files(memories):
    quantized = memories["int8"].inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True).plan
    pool = memories["auto"].components.pool
    assert all(seg.key in _kv_files(pool) for seg in quantized.segments[1:])
    dense = memories["auto"].inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True).plan
    files = _kv_files(pool)
    assert all(seg.key in files for seg in dense.segments[1:])
    assert not any(seg.key in files for seg in quantized.segments[1:])


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
    first-token logprobs equal the transformers reference path's on the same stored KV. (A
    memory keeps one storage dtype per fact on disk, so the mix is stored here by hand, each
    fact's KV quantized from its model-dtype KV under a key of its own.)"""
    auto = memories["auto"]
    inj = auto.inject(QUESTION, user_id=USER, k=len(FACTS), wait_for_kv=True)
    pool, ids = auto.components.pool, inj.prompt_token_ids
    segments = [[s.key, s.start, s.num_tokens] for s in inj.plan.segments]
    for i in range(1, len(segments)):
        owner = segments[i][0].split("/")[0]
        key = f"{owner}/{next(_salts) + 0xC0FFEE:032x}"  # a key nothing else writes
        pool.put(key, to_storage(pool.get(segments[i][0]), "int8" if i % 2 else "int4"))
        segments[i][0] = key
    params = {"inferscale": {"memory_end": inj.plan.memory_end, "segments": segments}}
    out = engine.generate(ids, kv_transfer_params=params, cache_salt=f"mixed-{next(_salts)}", max_tokens=1,
                          logprobs=20)
    assert out.num_injected_tokens == inj.plan.memory_end
    kinds = {type(pool.get(key)).__name__ + (f"/{pool.get(key).dtype}" if isinstance(pool.get(key), QuantizedKV)
                                             else "") for key, _, _ in segments}
    assert kinds == {"FactKV", "QuantizedKV/int8", "QuantizedKV/int4"}
    ref = auto.reference_model()
    expected = ref.next_token_logprobs(ids, [(start, pool.get(key)) for key, start, _ in segments])
    common = list(out.first_logprobs)
    assert max(abs(out.first_logprobs[t] - float(expected[t])) for t in common) < 1e-3


def test_a_bad_storage_dtype_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="kv_storage_dtype") as exc:
        MemoryConfig(kv_storage_dtype="int3")
    assert "INFERSCALE_KV_STORAGE_DTYPE" in str(exc.value)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "30"])
def test_kv_file_bytes_refuses_what_is_not_a_token_count(memories, bad):
    with pytest.raises(ValueError, match="num_tokens"):
        memories["int4"].kv_file_bytes(bad)
