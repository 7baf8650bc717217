"""Chunked RoPE exactness on the real engine: real SmolLM2 (fp32), real vLLM, real LoCoMo facts.

A fact encoded after exactly the tokens that precede it in the served prompt, but at
absolute positions offset by 1,000, rotated to its served positions and injected, must
give the same next-token logprobs as a full prefill of that prompt.
"""

import itertools

import pytest
import torch

from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES
from inferscale.datasets.locomo import load_locomo
from inferscale.kv.encoder import EncodeItem
from inferscale.kv.pool import FactKV, KVPool, kv_key, to_storage
from inferscale.generation.prompt import PromptBuilder
from inferscale.kv.reference import ReferenceModel

OFFSET = 1000
_salts = itertools.count()


@pytest.fixture(scope="module")
def facts(locomo_path):
    sample = load_locomo(locomo_path)[0]
    return [(f"fact{i}", f.dated_text()) for i, f in enumerate(sample.facts[:20])]


@pytest.fixture(scope="module")
def builder(tokenizer):
    return PromptBuilder(tokenizer, "You are a helpful assistant. Use the memories below.")


@pytest.fixture(scope="module")
def pool(serving_dir):
    return KVPool.shared(serving_dir / "kv", "cpu", DEFAULT_DEVICE_KV_BUDGET_BYTES)


def inject_params(layout, encoder, pool, *, exact_context: bool, tag: str, poison: bool = False,
                  storage: str = "auto"):
    """Encode every segment and store it; returns kv_transfer_params for the layout.

    exact_context: encode each segment after all prompt tokens before it (the exact case),
    else after the preamble only (w=0: facts never see each other).
    storage: kv_storage_dtype of the facts' KV (the preamble stays dense, as in the product).
    """
    items = []
    for seg in layout.segments:
        if exact_context or seg.owner == "_preamble":
            context = layout.token_ids[: seg.start]
        else:
            context = layout.token_ids[: layout.segments[0].end]
        items.append(EncodeItem(tuple(context), seg.token_ids, OFFSET))
    segments = []
    for seg, kv in zip(layout.segments, encoder.encode(items)):
        if poison and seg.owner != "_preamble":
            gen = torch.Generator().manual_seed(1)
            kv = FactKV(torch.randn(kv.keys.shape, generator=gen), torch.randn(kv.values.shape, generator=gen),
                        kv.token_ids)
        if seg.owner != "_preamble":
            kv = to_storage(kv, storage)
        key = kv_key(seg.owner, tag=tag, ctx=exact_context, poison=poison, n=len(layout.segments), storage=storage)
        pool.put(key, kv)
        segments.append([key, seg.start, len(seg.token_ids)])
    return {"inferscale": {"memory_end": layout.memory_end, "segments": segments}}


def max_logprob_diff(a: dict, b: dict) -> float:
    common = set(a) & set(b)
    assert len(common) >= 10, "the top-20 tokens of the two runs barely overlap"
    return max(abs(a[t] - b[t]) for t in common)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_injected_kv_matches_full_prefill_in_vllm(engine, encoder, pool, builder, facts, k):
    layout = builder.build("Where did Caroline go recently, and how did it feel?", facts[:k])
    params = inject_params(layout, encoder, pool, exact_context=True, tag=f"vllm{k}")
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    injected = engine.generate(
        layout.token_ids, kv_transfer_params=params, cache_salt=f"exact-{next(_salts)}", max_tokens=1, logprobs=20
    )
    assert injected.num_injected_tokens == layout.memory_end  # the connector supplied the memory block
    assert full.num_injected_tokens == 0
    assert max_logprob_diff(full.first_logprobs, injected.first_logprobs) < 1e-3
    assert full.token_ids == injected.token_ids


@pytest.mark.parametrize("k", [1, 20])
def test_injected_kv_matches_full_prefill_in_reference_path(encoder, builder, facts, k):
    layout = builder.build("What painting did Melanie make?", facts[:k])
    items = [EncodeItem(tuple(layout.token_ids[: s.start]), s.token_ids, OFFSET) for s in layout.segments]
    kvs = encoder.encode(items)
    ref = ReferenceModel(encoder)
    full = ref.next_token_logprobs(layout.token_ids)
    injected = ref.next_token_logprobs(layout.token_ids, [(s.start, kv) for s, kv in zip(layout.segments, kvs)])
    assert (full - injected).abs().max().item() < 1e-3


def test_without_context_window_injection_differs_measurably(engine, encoder, pool, builder, facts):
    """w=0: facts encoded without each other; the exactness test above could fail."""
    layout = builder.build("Where did Caroline go recently, and how did it feel?", facts[:20])
    params = inject_params(layout, encoder, pool, exact_context=False, tag="w0")
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    injected = engine.generate(
        layout.token_ids, kv_transfer_params=params, cache_salt=f"w0-{next(_salts)}", max_tokens=1, logprobs=20
    )
    assert injected.num_injected_tokens == layout.memory_end
    assert max_logprob_diff(full.first_logprobs, injected.first_logprobs) > 1e-2


# Fact KV stored in 8 / 4 bits (issue 30), injected by the connector, vs a full prefill: the
# largest first-token logprob difference (top-20 tokens, nats) measured at k = 1 / 5 / 20
# (2026-12-04, AMD EPYC, fp32): int8 0.028 / 0.043 / 0.021, int4 0.19 / 0.44 / 0.37; the same
# prompt at w=0 (facts encoded without each other): 3.4 with either. The bounds leave ~2x
# margin, and w=0 must stay outside them: quantizing costs far less than leaving out the context.
QUANT_BOUNDS = {"int8": 0.1, "int4": 1.0}


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_kv_stays_within_its_bound_of_a_full_prefill_and_w0_does_not(engine, encoder, pool, builder,
                                                                               facts, storage):
    question = "Where did Caroline go recently, and how did it feel?"
    diffs = {}
    for k in (1, 5, 20):
        layout = builder.build(question, facts[:k])
        params = inject_params(layout, encoder, pool, exact_context=True, tag=f"q{k}", storage=storage)
        full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
        injected = engine.generate(layout.token_ids, kv_transfer_params=params, cache_salt=f"q-{next(_salts)}",
                                   max_tokens=1, logprobs=20)
        assert injected.num_injected_tokens == layout.memory_end
        diffs[k] = max_logprob_diff(full.first_logprobs, injected.first_logprobs)
    assert max(diffs.values()) < QUANT_BOUNDS[storage], diffs
    layout = builder.build(question, facts[:20])
    w0 = inject_params(layout, encoder, pool, exact_context=False, tag="qw0", storage=storage)
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    out = engine.generate(layout.token_ids, kv_transfer_params=w0, cache_salt=f"q-{next(_salts)}", max_tokens=1,
                          logprobs=20)
    assert out.num_injected_tokens == layout.memory_end
    assert max_logprob_diff(full.first_logprobs, out.first_logprobs) > QUANT_BOUNDS[storage]


def test_poisoned_kv_changes_the_output(engine, encoder, pool, builder, facts):
    """Random KV in place of the facts changes what vLLM computes: the injected KV is really read."""
    layout = builder.build("Where did Caroline go recently, and how did it feel?", facts[:5])
    good = inject_params(layout, encoder, pool, exact_context=True, tag="poison-ref")
    bad = inject_params(layout, encoder, pool, exact_context=True, tag="poison", poison=True)
    a = engine.generate(layout.token_ids, kv_transfer_params=good, cache_salt=f"p-{next(_salts)}", max_tokens=8, logprobs=20)
    b = engine.generate(layout.token_ids, kv_transfer_params=bad, cache_salt=f"p-{next(_salts)}", max_tokens=8, logprobs=20)
    assert b.num_injected_tokens == layout.memory_end
    common = set(a.first_logprobs) & set(b.first_logprobs)
    diff = max((abs(a.first_logprobs[t] - b.first_logprobs[t]) for t in common), default=float("inf"))
    assert diff > 0.5 or a.token_ids != b.token_ids


def test_missing_kv_falls_back_to_prefill(engine, builder, facts, tokenizer):
    """Segments absent from the pool: the connector claims nothing and vLLM prefills the memory text."""
    layout = builder.build("What painting did Melanie make?", facts[:3])
    params = {
        "inferscale": {
            "memory_end": layout.memory_end,
            "segments": [[kv_key(s.owner, absent=True), s.start, len(s.token_ids)] for s in layout.segments],
        }
    }
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    out = engine.generate(layout.token_ids, kv_transfer_params=params, cache_salt="absent", max_tokens=1, logprobs=20)
    assert out.num_injected_tokens == 0
    assert max_logprob_diff(full.first_logprobs, out.first_logprobs) < 1e-3


def test_teacher_forced_answer_nll_is_the_same_with_injected_kv(encoder, builder, facts, tokenizer):
    """The reference path gives answer likelihoods for injected prompts (vLLM skips connectors for prompt_logprobs)."""
    layout = builder.build("When did Caroline go to the LGBTQ support group?", facts[:10])
    items = [EncodeItem(tuple(layout.token_ids[: s.start]), s.token_ids, OFFSET) for s in layout.segments]
    segments = [(s.start, kv) for s, kv in zip(layout.segments, encoder.encode(items))]
    answer = tokenizer.encode("7 May 2023", add_special_tokens=False)
    ref = ReferenceModel(encoder)
    full = ref.answer_nll(layout.token_ids, answer)
    injected = ref.answer_nll(layout.token_ids, answer, segments)
    wrong = ref.answer_nll(layout.token_ids, tokenizer.encode("purple elephant", add_special_tokens=False), segments)
    assert abs(full - injected) < 1e-3
    assert wrong > injected  # the likelihood reads the memory: the right answer is likelier
