"""The engine computes every KV (issue 51): with ``kv_encoder="engine"`` a memory's first KV is a
prefill-only request to vLLM (Context-Window Encoding context, then the memory line), whose
connector captures the line's span under the memory's encoded key. On the real engine and
SmolLM2 in fp32: the KV equals the transformers reference of the same prompt, greedy answers
over it equal answers over transformers-made KV, int8 storage and a disk budget carry it, an
update while the encode is queued leaves the new text's KV only, and the process that adds
memories never holds the LLM's weights."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from inferscale import Memory
from inferscale.kv.quant import QuantizedKV
from inferscale.store.records import Scope

pytestmark = pytest.mark.slow

TURNS = ["I moved to Lisbon in March for a new job.", "My new job is at a bakery near the river.",
         "I adopted a grey cat named Tom last spring.", "I am allergic to peanuts.",
         "My sister Ana visits every other weekend."]
QUESTIONS = ["What is my cat called?", "Where do I work?", "What am I allergic to?"]


def llm_modules() -> set[int]:
    """The ids of every live torch module holding a causal LM (the LLM's weights in this process);
    a test compares them before and after (earlier tests of the suite may hold models of their own)."""
    gc.collect()
    return {id(o) for o in gc.get_objects()
            if isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM")}


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    held = llm_modules()
    with Memory(data_dir=tmp_path_factory.mktemp("engine-kv"), dtype="float32", kv_encoder="engine",
                context_window=3) as m:
        m.add([{"role": "user", "content": t} for t in TURNS], user_id="alice")
        assert m.wait_for_kv(timeout=900)
        m.llm_modules_after = llm_modules() - held  # before any test loads the reference
        yield m


def spans_of(m: Memory, user: str):
    kv = m.components.kv
    scope = Scope.of(user, None, None)
    records = m.components.store.get(scope, [r["id"] for r in m.get_all(user_id=user)["results"]])
    return records, [kv.preamble_span(), *kv.fact_spans(scope.key, records, m.config.context_window)]


def test_no_process_that_adds_memories_holds_the_llms_weights(memory):
    assert not memory.components.kv.encoder_loaded
    assert memory.llm_modules_after == set()  # vLLM's engine core and worker hold the model, in their own processes
    records, _ = spans_of(memory, "alice")
    entries = memory.kv_entries(user_id="alice")
    assert len(records) == len(TURNS)
    for r in records:
        assert entries[r.id][0]["made"] == "encoded (w=3)" and entries[r.id][0]["in_use"], entries[r.id]


def test_engine_made_kv_equals_the_transformers_reference_of_the_same_prompt(memory):
    kv = memory.components.kv
    _, spans = spans_of(memory, "alice")
    assert any(s.item.context_ids != spans[0].item.span_ids for s in spans[2:])  # w > 0: turns in the context
    reference = kv.encoder.encode([s.item for s in spans])  # the transformers path, the test's oracle
    for span, ref in zip(spans, reference):
        got = kv.pool.get(span.key)
        assert got is not None and got.token_ids == ref.token_ids == span.item.span_ids, span.key
        assert got.keys.dtype == ref.keys.dtype == torch.float32
        assert (got.keys - ref.keys).abs().max().item() < 2e-3, span.key  # measured: 2.5e-5
        assert (got.values - ref.values).abs().max().item() < 2e-3, span.key


def test_greedy_answers_over_engine_kv_equal_answers_over_transformers_kv(memory):
    """bob holds the same turns as alice, his KV made by transformers: the same prompts, so the
    same greedy answers."""
    kv = memory.components.kv
    kv.encoder_kind = "transformers"
    try:
        memory.add([{"role": "user", "content": t} for t in TURNS], user_id="bob")
        assert memory.wait_for_kv(timeout=600)
    finally:
        kv.encoder_kind = "engine"
    for q in QUESTIONS:
        a = memory.generate(q, user_id="alice", max_tokens=16, k=5)
        b = memory.generate(q, user_id="bob", max_tokens=16, k=5)
        assert set(a.kv_sources.values()) <= {"device", "disk"} and len(a.kv_sources) == 5, a.kv_sources
        assert a.num_injected_tokens == b.num_injected_tokens > 0
        assert a.text == b.text, (q, a.text, b.text)


def test_a_memory_updated_while_its_encode_is_queued_ends_with_the_new_texts_kv_only(memory):
    kv = memory.components.kv
    kv.background.pause()
    try:
        mid = memory.add("My favourite colour is teal.", user_id="carol")["results"][0]["id"]
        memory.update(mid, "My favourite colour is orange.", user_id="carol")
        assert kv.pending() >= 1
    finally:
        kv.background.resume()
    assert memory.wait_for_kv(timeout=600)
    entries = memory.kv_entries(user_id="carol")[mid]
    assert len(entries) == 1 and entries[0]["in_use"], entries
    record = memory.components.store.get(Scope.of("carol", None, None), [mid])[0]
    stored = kv.pool.get(entries[0]["key"])
    assert stored.token_ids == kv.prompts.fact_line_ids(record.text) and "orange" in record.text


def test_int8_storage_a_disk_budget_and_redis_carry_engine_made_kv(tmp_path, redis_server):
    held = llm_modules()
    with Memory(data_dir=tmp_path / "int8", dtype="float32", kv_encoder="engine", kv_storage_dtype="int8",
                disk_kv_budget_bytes=64 << 20, kv_redis_url=redis_server["url"]) as m:
        ids = [r["id"] for r in m.add([{"role": "user", "content": t} for t in TURNS], user_id="dora")["results"]]
        assert m.wait_for_kv(timeout=900)
        kv = m.components.kv
        _, spans = spans_of(m, "dora")
        assert isinstance(kv.pool.get(spans[1].key), QuantizedKV)  # a fact: int8 codes
        assert not isinstance(kv.pool.get(spans[0].key), QuantizedKV)  # the preamble stays in the model's dtype
        g = m.generate("What is my cat called?", user_id="dora", max_tokens=12, k=5)
        assert set(g.kv_sources) <= set(ids) and set(g.kv_sources.values()) <= {"device", "disk"}, g.kv_sources
        assert g.num_injected_tokens > 0 and "grey" in g.text.lower(), g.text  # the memory, read from int8 KV
        assert 0 < m.components.pool.footprint()["disk"] <= 64 << 20
        assert not kv.encoder_loaded and llm_modules() - held == set()
        # the capture writer wrote each engine-made entry through to Redis: another machine reads it there
        keys = [span.key for span in spans]
        deadline = time.monotonic() + 60
        while m.components.pool.remote.present(keys) != set(keys):
            assert time.monotonic() < deadline, m.components.pool.remote.present(keys)
            time.sleep(0.5)
        assert isinstance(m.components.pool.remote.get(spans[1].key), QuantizedKV)
