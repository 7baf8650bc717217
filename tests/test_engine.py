"""The one engine: concurrent requests from threads and event loops are batched by vLLM,
each caller gets its own answer, and the injected-token count crosses the process
boundary through vLLM's own return path."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inferscale import Memory

PETS = ["Biscuit", "Pepper", "Mochi", "Rusty", "Juniper", "Noodle", "Ziggy", "Clover"]


@pytest.fixture(scope="module")
def memory(serving_dir, engine):
    mem = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    for i, pet in enumerate(PETS):
        mem.add(f"My dog is called {pet}.", user_id=f"batch-user-{i}")
        mem.add(f"I work as employee number {100 + i}.", user_id=f"batch-user-{i}")
    assert mem.wait_for_kv(timeout=600)
    return mem


def test_generate_from_8_threads_is_batched_and_each_gets_its_own_answer(memory, engine):
    question = "What is my dog called?"
    engine.batch_stats.max_running = 0

    def ask(i: int):
        return memory.generate(question, user_id=f"batch-user-{i}", k=2, max_tokens=24)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert engine.batch_stats.max_running > 1, "vLLM never ran two of the 8 requests in one step"
    for i, g in enumerate(answers):
        own = {m["id"] for m in memory.get_all(user_id=f"batch-user-{i}")["results"]}
        assert {m["id"] for m in g.memories} == own  # its own memories, no one else's
        assert g.num_generated_tokens > 0 and g.text
        assert g.num_injected_tokens > 0
        assert g.num_prompt_tokens == len(memory.prepare(question, user_id=f"batch-user-{i}", k=2).prompt_token_ids)
    assert sum(PETS[i] in g.text for i, g in enumerate(answers)) >= 4  # answers follow each user's own memory


def test_async_callers_on_their_own_loop_share_the_engine(memory, engine):
    reqs = [memory.inject("What is my dog called?", user_id=f"batch-user-{i}", k=2) for i in range(4)]

    async def ask_all():
        return await asyncio.gather(*(engine.agenerate(r.prompt_token_ids, kv_transfer_params=r.kv_transfer_params,
                                                       cache_salt=r.cache_salt, max_tokens=8) for r in reqs))

    outs = asyncio.run(ask_all())
    assert [o.num_prompt_tokens for o in outs] == [len(r.prompt_token_ids) for r in reqs]
    assert all(o.num_injected_tokens > 0 and o.num_output_tokens > 0 for o in outs)


def test_async_stream_joins_to_the_sync_answer(memory, engine):
    req = memory.inject("What is my dog called?", user_id="batch-user-0", k=2)
    kwargs = dict(kv_transfer_params=req.kv_transfer_params, cache_salt=req.cache_salt, max_tokens=12)

    async def collect():
        return [c async for c in engine.astream(req.prompt_token_ids, **kwargs)]

    chunks = asyncio.run(collect())
    assert chunks[-1].output is not None and all(c.output is None for c in chunks[:-1])
    assert chunks[-1].output.text == engine.generate(req.prompt_token_ids, **kwargs).text


def test_unknown_engine_options_are_refused(engine):
    with pytest.raises(TypeError, match="unknown engine options"):
        engine.generate([1, 2, 3], top_k=3)


def test_connector_counters_reach_the_stat_logger(memory, engine):
    """vLLM carries the connector's worker and scheduler counters (KVConnectorStats) to the
    engine's stat logger; a segment seen on disk once is not looked up on disk again."""
    before = dict(engine.batch_stats.connector)
    req = memory.inject("Which employee number am I?", user_id="batch-user-3", k=2)
    for salt in ("counters-a", "counters-b"):  # two salts: the second is no prefix-cache hit, so it loads again
        out = engine.generate(req.prompt_token_ids, kv_transfer_params=req.kv_transfer_params, cache_salt=salt,
                              max_tokens=2)
        assert out.num_injected_tokens > 0
    deadline = time.monotonic() + 10
    while True:  # the stat logger runs on the engine's output loop, just after the outputs
        got = {k: engine.batch_stats.connector.get(k, 0) - before.get(k, 0) for k in engine.batch_stats.connector}
        if got.get("loads", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got["loads"] >= 2 and got["injected_tokens"] >= 2 * out.num_injected_tokens
    assert got["stage_s"] > 0 and got["write_s"] > 0 and got.get("load_errors", 0) == 0
    assert got["lookups_cached"] >= len(req.plan.segments)  # the second request found every segment in memory


def test_segment_whose_prompt_tokens_differ_is_prefilled_not_injected(memory, engine):
    """The plan's keys are right, but the prompt holds other tokens where the first fact's
    line should be (a template or tokenizer that renders differently, a forged plan): the
    connector injects only the verified preamble and vLLM prefills the rest, so the answer
    is the one a plain prefill of that prompt gives."""
    req = memory.inject("What is my dog called?", user_id="batch-user-5", k=2)
    first_fact = req.plan.segments[1]
    ids = list(req.prompt_token_ids)
    ids[first_fact.start + 1] = ids[first_fact.start + 1] + 1  # one token of the fact line changed
    before = dict(engine.batch_stats.connector)
    kw = dict(max_tokens=8, logprobs=5)
    got = engine.generate(ids, kv_transfer_params=req.kv_transfer_params, cache_salt="mismatch", **kw)
    plain = engine.generate(ids, **kw)
    assert got.num_injected_tokens == req.plan.segments[0].num_tokens  # the preamble only
    assert got.text == plain.text
    common = set(got.first_logprobs) & set(plain.first_logprobs)
    assert max(abs(got.first_logprobs[t] - plain.first_logprobs[t]) for t in common) < 1e-3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        delta = {k: engine.batch_stats.connector.get(k, 0) - before.get(k, 0) for k in ("mismatched_segments",
                                                                                         "fallbacks")}
        if delta["mismatched_segments"] >= 1:
            break
        time.sleep(0.1)
    assert delta["mismatched_segments"] >= 1 and delta["fallbacks"] >= 1


def test_kv_that_fails_to_load_on_the_worker_is_recomputed(memory, engine):
    """The scheduler verified a segment's tokens, but its KV cannot be used on the worker
    (here: stored with one token fewer than its token ids say, as a damaged file would
    be). The connector reports the blocks through vLLM's load-error path, vLLM recomputes
    them (kv_load_failure_policy="recompute"), and the answer is the plain prefill's."""
    import torch
    from safetensors.torch import save_file

    from inferscale.kv.injection import InjectionPlan

    req = memory.inject("Which employee number am I?", user_id="batch-user-6", k=2)
    seg = req.plan.segments[1]
    good = memory.components.pool.get(seg.key)
    owner = seg.key.split("/")[0]
    bad_key = f"{owner}/{'d' * 32}"
    path = engine.kv_dir / owner / f"{'d' * 32}.safetensors"  # the pool's disk layout
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"keys": good.keys[:, :-1].contiguous().cpu(), "values": good.values[:, :-1].contiguous().cpu(),
               "token_ids": torch.tensor(good.token_ids, dtype=torch.int64)}, str(path))
    segments = [(s.key, s.start, s.num_tokens) for s in req.plan.segments]
    segments[1] = (bad_key, seg.start, seg.num_tokens)
    params = InjectionPlan.of(segments).to_params()
    before = dict(engine.batch_stats.connector)
    kw = dict(max_tokens=8, logprobs=5)
    got = engine.generate(req.prompt_token_ids, kv_transfer_params=params, cache_salt="load-error", **kw)
    plain = engine.generate(req.prompt_token_ids, **kw)
    assert got.text == plain.text
    common = set(got.first_logprobs) & set(plain.first_logprobs)
    assert max(abs(got.first_logprobs[t] - plain.first_logprobs[t]) for t in common) < 1e-3
    deadline = time.monotonic() + 10
    while engine.batch_stats.connector.get("load_errors", 0) <= before.get("load_errors", 0):
        assert time.monotonic() < deadline, "no load error was counted"
        time.sleep(0.1)
