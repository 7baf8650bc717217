"""Capture on a miss (issue 39): a memory served as text keeps the KV its request's own
prefill computed, read back out of vLLM's paged cache by the connector; the next request
injects it and no encoder runs. On the real engine and SmolLM2 in fp32, except the layout
tests, which use writers of our own to show what the calibration accepts and refuses."""

from __future__ import annotations

import time

import pytest
import torch

from inferscale import Memory
from inferscale.kv.capture import CacheLayout, CaptureRequest, LayoutError, plan_captures, token_digest
from inferscale.kv.encoder import EncodeItem
from inferscale.kv.entry import FactKV
from inferscale.kv.quant import QuantizedKV
from inferscale.kv.reference import ReferenceModel
from inferscale.store.records import Scope

FACTS = ["I keep bees on my roof.", "My bike is a green Bianchi.", "My sister lives in Lyon.",
         "I was born in Porto in April."]
QUESTION = "What is my bike?"


# ------------------------------------------------------------------ the layout, learned from a writer


def cpu_like_writer(transpose_keys: bool):
    """A writer with vLLM's CPU block shape ``[num_blocks, H, 2 * block_size, D]`` (K rows, then
    V rows), keys stored transposed per head when asked (as its fp32 path does)."""
    def write(keys, values, cache, slots):
        block_size = cache.shape[2] // 2
        for i, slot in enumerate(slots.tolist()):
            b, t = divmod(slot, block_size)
            for h in range(keys.shape[1]):
                if transpose_keys:  # this block's K as [D, block_size] in the K half's storage
                    k_half = cache[b, h, :block_size].view(-1).view(keys.shape[2], block_size)
                    k_half[:, t] = keys[i, h]
                else:
                    cache[b, h, t] = keys[i, h]
                cache[b, h, block_size + t] = values[i, h]
    return write


@pytest.mark.parametrize("transpose_keys", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_is_learned_from_the_writer_and_reads_back_what_it_wrote(transpose_keys, dtype):
    num_blocks, heads, block_size, dim = 5, 3, 8, 16
    cache = torch.zeros(num_blocks, heads, 2 * block_size, dim, dtype=dtype)
    write = cpu_like_writer(transpose_keys)
    layout = CacheLayout.calibrate(cache, num_blocks, block_size, heads, dim, write)
    assert layout.block_dim == 0 and not cache.any()  # learned on a copy: the cache is untouched
    # a request whose blocks are 3, 1, 4: positions 5..20 span all three
    keys, values = torch.randn(24, heads, dim).to(dtype), torch.randn(24, heads, dim).to(dtype)
    blocks = [3, 1, 4]
    slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(24)])
    write(keys, values, cache, slots)
    positions = torch.arange(5, 21)
    k, v = layout.read(cache, blocks, positions)
    assert torch.equal(k, keys[5:21]) and torch.equal(v, values[5:21])


def test_a_cache_that_does_not_store_what_it_is_given_gets_no_layout():
    """An fp8-style cache that scales what it stores cannot be read back: calibration refuses it."""
    cache = torch.zeros(4, 2, 16, 8)

    def scaled(keys, values, cache, slots):
        cpu_like_writer(False)(keys * 0.5, values * 0.5, cache, slots)

    with pytest.raises(LayoutError):
        CacheLayout.calibrate(cache, 4, 8, 2, 8, scaled)
    with pytest.raises(LayoutError, match="holds its 9 blocks"):
        CacheLayout.calibrate(cache, 9, 8, 2, 8, cpu_like_writer(False))


def test_a_span_is_captured_only_where_the_prompt_holds_its_tokens():
    request = CaptureRequest({"fmt": 2}, "auto", None, (("fact-a", 2, 3, token_digest([7, 8, 9])),
                                                         ("fact-b", 5, 2, token_digest([1, 1])),
                                                         ("fact-c", 6, 4, token_digest([5, 6, 7, 8]))))
    spans, skipped = plan_captures(request, [0, 1, 7, 8, 9, 3, 4])
    assert [(s.start, s.token_ids) for s in spans] == [(2, (7, 8, 9))] and skipped == 2  # other tokens; past the end
    params = request.to_params()
    assert CaptureRequest.from_params(params) == request
    for bad in ({**params, "storage": "fp3"}, {**params, "spans": [["fact-a", 2, 0, "x"]]},
                {**params, "spans": [["../etc", 2, 3, "x"]]}, {**params, "disk_budget_bytes": True}, "capture"):
        with pytest.raises(ValueError):
            CaptureRequest.from_params(bad)


# ------------------------------------------------------------------ the real engine


def wait_stored(mem: Memory, keys: list[str], seconds: float = 60) -> None:
    """The connector stores captures from its writer thread in vLLM's process: wait for the files."""
    deadline = time.monotonic() + seconds
    while not all(mem.components.pool.contains(k) for k in keys):
        assert time.monotonic() < deadline, "the captured KV never reached the pool"
        time.sleep(0.1)


def capture_writers() -> list[int]:
    """Pids of the capture writer processes (``python -m inferscale.kv.capture_writer``)
    descended from this test process (beside vLLM's worker)."""
    import os
    from pathlib import Path

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or b"inferscale.kv.capture_writer" not in (entry / "cmdline").read_bytes():
                continue
            pid = int(entry.name)
            while pid > 1 and pid != os.getpid():
                pid = parent(pid)
        except OSError:  # gone meanwhile
            continue
        if pid == os.getpid():
            found.append(int(entry.name))
    return found


def add_unencoded(mem: Memory, user: str, facts=FACTS) -> list:
    """Add ``facts`` with the background encoder paused: every one is a miss."""
    mem.components.kv.background.pause()
    for text in facts:
        mem.add(text, user_id=user, infer=False)
    return mem.components.facts.list(Scope(user))


@pytest.fixture
def memory(serving_dir, engine):
    mem = Memory(data_dir=serving_dir, dtype="float32", context_window=0, engine=engine)
    yield mem
    mem.close()


def test_a_miss_is_captured_and_the_next_request_injects_it_with_the_same_logprobs(memory, encoder):
    records = add_unencoded(memory, "cap-a")
    first = memory.generate(QUESTION, user_id="cap-a", k=4, max_tokens=6, temperature=0, logprobs=5)
    assert set(first.kv_sources.values()) == {"text: not encoded yet"}
    by_id = {r.id: r for r in records}
    texts = [by_id[i] for i in first.text_memory_ids]  # prompt order
    keys = memory.components.kv.captured_keys(texts)
    wait_stored(memory, keys)
    assert capture_writers(), "captures are stored by a writer process beside vLLM's worker, not in it"

    # the captured KV is what a full prefill of the same prompt computes for those tokens
    inj = memory.inject(QUESTION, user_id="cap-a", k=4)
    assert set(inj.kv_sources.values()) <= {"disk (captured)", "device (captured)"}
    assert inj.kv_memory_ids == first.text_memory_ids  # same order, same positions
    prompt = list(inj.prompt_token_ids)
    for seg in inj.plan.segments[1:]:
        kv = memory.components.pool.get(seg.key)
        assert isinstance(kv, FactKV) and kv.token_ids == tuple(prompt[seg.start:seg.end])
        (ref,) = encoder.encode([EncodeItem(tuple(prompt[:seg.start]), tuple(prompt[seg.start:seg.end]))])
        torch.testing.assert_close(kv.keys, ref.keys, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(kv.values, ref.values, atol=2e-3, rtol=2e-3)

    # all memories captured, the same prefix: the capturing request's first-token logprobs again
    second = memory.generate(QUESTION, user_id="cap-a", k=4, max_tokens=6, temperature=0, logprobs=5)
    assert set(second.kv_sources.values()) <= {"disk (captured)", "device (captured)"}
    assert second.num_injected_tokens == inj.plan.memory_end > first.num_injected_tokens
    assert second.text == first.text
    assert set(second.first_logprobs) == set(first.first_logprobs)
    for token, lp in first.first_logprobs.items():
        assert abs(second.first_logprobs[token] - lp) < 1e-3
    stats = memory.kv_stats()
    assert stats["served_captured"] >= 4

    # the background encoder, resumed, drops the jobs of memories a request captured
    skipped = stats["encodes_skipped_captured"]
    memory.components.kv.background.resume()
    assert memory.wait_for_kv(timeout=600)
    assert memory.kv_stats()["encodes_skipped_captured"] == skipped + 4
    assert all(memory.components.pool.contains(k) for k in keys)  # still served as captured
    # an update drops the old text's captured KV with the rest
    memory.update(texts[0].id, "My bike is a red Colnago.", user_id="cap-a")
    assert not memory.components.pool.contains(keys[0])


def test_a_job_queued_by_a_miss_waits_for_its_capture_instead_of_encoding(memory):
    """A one-token answer ends in the step that captured its memories, while the connector's
    writer thread may still be storing them: the background encoder, let go at that moment,
    waits for the capture rather than encoding."""
    add_unencoded(memory, "cap-e", FACTS[:3])
    before = memory.kv_stats()
    memory.generate(QUESTION, user_id="cap-e", k=3, max_tokens=1, temperature=0)
    memory.components.kv.background.resume()
    assert memory.wait_for_kv(timeout=600)
    after = memory.kv_stats()
    assert after["encodes_skipped_captured"] - before["encodes_skipped_captured"] == 3
    assert after["writes"] == before["writes"]  # nothing encoded: the front wrote no KV


def test_captured_encoded_and_text_memories_are_injected_together_correctly(memory, encoder):
    records = add_unencoded(memory, "cap-b", FACTS[:2])
    memory.generate(QUESTION, user_id="cap-b", k=2, max_tokens=1, temperature=0)
    wait_stored(memory, memory.components.kv.captured_keys(records))
    encoded = memory.add(FACTS[2], user_id="cap-b", infer=False)["results"][0]["id"]
    memory.inject(QUESTION, user_id="cap-b", k=4, wait_for_kv=True)  # encodes it (and nothing captured)
    memory.components.kv.background.pause()
    text = memory.add(FACTS[3], user_id="cap-b", infer=False)["results"][0]["id"]
    inj = memory.inject(QUESTION, user_id="cap-b", k=4)
    kinds = {i: s for i, s in inj.kv_sources.items()}
    assert kinds[text] == "text: not encoded yet" and kinds[encoded] in ("disk", "device")
    assert sorted(s for i, s in kinds.items() if i not in (text, encoded)) in (
        ["disk (captured)"] * 2, ["device (captured)"] * 2, ["device (captured)", "disk (captured)"])
    # where each memory's KV is and how it was made (the page at /ui and Memory.kv_entries)
    entries = memory.kv_entries(user_id="cap-b")
    assert entries[text] == [] and [e["made"] for e in entries[encoded]] == ["encoded (w=0)"]
    for r in records:
        (e,) = entries[r.id]
        assert e["made"] == "captured" and e["in_use"] and "disk" in e["tiers"] and e["storage"] == "model"
        assert e["tokens"] == len(memory.components.prompts.fact_line_ids(r.text)) and e["bytes"] > 0
    out = memory.generate(QUESTION, user_id="cap-b", k=4, max_tokens=1, temperature=0, logprobs=5)
    assert out.num_injected_tokens == inj.plan.memory_end
    shown = out._repr_html_()  # a notebook's picture of the prompt: each memory as KV (captured) or text
    assert shown.count(">KV<") == 3 and shown.count(">text<") == 1 and "(captured)" in shown
    # vLLM's first-token logprobs match the transformers reference over the same injected KV
    ref = ReferenceModel(encoder).next_token_logprobs(
        inj.prompt_token_ids, [(s.start, memory.components.pool.get(s.key)) for s in inj.plan.segments])
    for token, lp in out.first_logprobs.items():
        assert abs(float(ref[token]) - lp) < 1e-3
    memory.components.kv.background.resume()


def test_a_text_tail_prefills_the_best_memories_after_the_injected_rest(memory, encoder):
    """``text_tail=2``: the two best-ranked memories come as text nearest the question though
    their KV is stored (nothing captured or queued for them), the rest is injected, and vLLM's
    first-token logprobs match the transformers reference over that very prompt."""
    for text in FACTS:
        memory.add(text, user_id="tail-a", infer=False)
    assert memory.wait_for_kv(timeout=600)
    full = memory.inject(QUESTION, user_id="tail-a", k=4)
    assert len(full.kv_memory_ids) == 4
    kept = memory.kv_stats()["misses_kept"]
    inj = memory.inject(QUESTION, user_id="tail-a", k=4, text_tail=2)
    assert inj.kv_memory_ids == full.kv_memory_ids[:2] and inj.text_memory_ids == full.kv_memory_ids[2:]
    assert {inj.kv_sources[i] for i in inj.text_memory_ids} == {"text: tail"} and inj.plan.capture is None
    assert list(inj.prompt_token_ids) == list(full.prompt_token_ids)  # the same prompt, less of it injected
    out = memory.generate(QUESTION, user_id="tail-a", k=4, max_tokens=1, temperature=0, logprobs=5, text_tail=2)
    assert out.num_injected_tokens == inj.plan.memory_end < full.plan.memory_end
    ref = ReferenceModel(encoder).next_token_logprobs(
        inj.prompt_token_ids, [(s.start, memory.components.pool.get(s.key)) for s in inj.plan.segments])
    for token, lp in out.first_logprobs.items():
        assert abs(float(ref[token]) - lp) < 1e-3
    everything = memory.inject(QUESTION, user_id="tail-a", k=4, text_tail=9)
    assert everything.kv_memory_ids == [] and everything.text_memory_ids == full.kv_memory_ids
    assert memory.kv_stats()["misses_kept"] == kept  # a tail is not a miss


def test_best_first_puts_the_best_memory_after_the_preamble(memory, encoder):
    """``memory_order="best_first"``: the same memories in the reverse order, the best one
    right after the preamble; with a text tail, the tail is still the best-ranked memories
    (now first among the text lines); vLLM's first-token logprobs match the transformers
    reference over that very prompt, and text mode reverses its lines alike."""
    for text in FACTS:
        memory.add(text, user_id="order-a", infer=False)
    assert memory.wait_for_kv(timeout=600)
    last = memory.inject(QUESTION, user_id="order-a", k=4)
    first = memory.inject(QUESTION, user_id="order-a", k=4, memory_order="best_first")
    best = [m["id"] for m in first.memories]  # rank order, best first, either way
    assert [m["id"] for m in last.memories] == best
    assert last.kv_memory_ids == best[::-1] and first.kv_memory_ids == best
    assert list(first.prompt_token_ids) != list(last.prompt_token_ids)
    assert sorted(first.prompt_token_ids) == sorted(last.prompt_token_ids)  # the same tokens, reordered
    tail = memory.inject(QUESTION, user_id="order-a", k=4, memory_order="best_first", text_tail=1)
    assert tail.kv_memory_ids == best[1:] and tail.text_memory_ids == best[:1]
    out = memory.generate(QUESTION, user_id="order-a", k=4, max_tokens=1, temperature=0, logprobs=5,
                          memory_order="best_first")
    assert out.num_injected_tokens == first.plan.memory_end
    ref = ReferenceModel(encoder).next_token_logprobs(
        first.prompt_token_ids, [(s.start, memory.components.pool.get(s.key)) for s in first.plan.segments])
    for token, lp in out.first_logprobs.items():
        assert abs(float(ref[token]) - lp) < 1e-3
    text = memory.prepare(QUESTION, user_id="order-a", k=4, mode="text", memory_order="best_first")
    assert list(text.prompt_token_ids) == list(first.prompt_token_ids)
    with pytest.raises(ValueError, match="memory_order"):
        memory.inject(QUESTION, user_id="order-a", k=4, memory_order="worst_first")


def test_admission_on_a_second_use_keeps_a_miss_only_when_it_comes_again(serving_dir, engine):
    """``kv_admission_window_s``: while keeping KV would evict (a disk budget nearly full), a
    first miss is served as text and only remembered; the second within the window is captured,
    and the third request injects it. Without pressure every miss is kept (the test above)."""
    mem = Memory(data_dir=serving_dir, dtype="float32", context_window=0, engine=engine, kv_admission_window_s=3600)
    pool = mem.components.pool
    try:
        records = add_unencoded(mem, "cap-f", FACTS[:2])
        assert not pool.under_pressure
        pool.set_disk_budget(max(int(pool.disk.size() / 0.95), 1 << 20))  # what the folder holds: nothing evicted
        assert pool.under_pressure
        keys = mem.components.kv.captured_keys(records)
        first = mem.inject(QUESTION, user_id="cap-f", k=2)
        assert set(first.kv_sources.values()) == {"text: not encoded yet"} and first.plan.capture is None
        stats = mem.kv_stats()
        assert (stats["misses_kept"], stats["misses_not_kept"]) == (0, 2)
        second = mem.generate(QUESTION, user_id="cap-f", k=2, max_tokens=2, temperature=0)
        assert set(second.kv_sources.values()) == {"text: not encoded yet"}
        wait_stored(mem, keys)
        third = mem.generate(QUESTION, user_id="cap-f", k=2, max_tokens=2, temperature=0)
        assert set(third.kv_sources.values()) <= {"disk (captured)", "device (captured)"}
        stats = mem.kv_stats()
        assert (stats["misses_kept"], stats["misses_not_kept"]) == (2, 2)
    finally:
        pool.set_disk_budget(None)
        mem.components.kv.background.resume()
        mem.close()


def test_int8_storage_keeps_captured_kv_in_8_bits(serving_dir, engine):
    mem = Memory(data_dir=serving_dir, dtype="float32", context_window=0, engine=engine, kv_storage_dtype="int8")
    try:
        records = add_unencoded(mem, "cap-c", FACTS[:2])
        first = mem.generate(QUESTION, user_id="cap-c", k=2, max_tokens=4, temperature=0)
        keys = mem.components.kv.captured_keys(records)
        wait_stored(mem, keys)
        assert all(isinstance(mem.components.pool.get(k), QuantizedKV) for k in keys)
        second = mem.generate(QUESTION, user_id="cap-c", k=2, max_tokens=4, temperature=0)
        assert set(second.kv_sources.values()) <= {"disk (captured)", "device (captured)"}
        assert second.text == first.text
    finally:
        mem.components.kv.background.resume()
        mem.close()


def test_captured_kv_is_written_through_to_redis_and_served_from_there(tmp_path, redis_server):
    mem = Memory(data_dir=tmp_path / "a", dtype="float32", context_window=0, kv_redis_url=redis_server["url"])
    try:
        records = add_unencoded(mem, "cap-d", FACTS[:2])
        mem.generate(QUESTION, user_id="cap-d", k=2, max_tokens=2, temperature=0)
        keys = mem.components.kv.captured_keys(records)
        wait_stored(mem, keys)
        deadline = time.monotonic() + 30
        while mem.components.pool.remote.present(keys) != set(keys):
            assert time.monotonic() < deadline, "the captured KV never reached Redis"
            time.sleep(0.1)
        for k in keys:  # gone from this machine: only Redis has it now
            mem.components.pool.remove(k, shared=False)
        inj = mem.inject(QUESTION, user_id="cap-d", k=2)
        assert set(inj.kv_sources.values()) == {"redis (captured)"}
        out = mem.generate(QUESTION, user_id="cap-d", k=2, max_tokens=2, temperature=0)
        assert out.num_injected_tokens == inj.plan.memory_end
    finally:
        mem.components.kv.background.resume()
        mem.close()
