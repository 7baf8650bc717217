"""Chunked RoPE in bfloat16 on the real engine: ``dtype="auto"`` serves bf16 on CUDA and on
CPUs with AMX, so injected bf16 KV must give the answer a full bf16 prefill gives.

bf16 keeps 8 bits of mantissa: the KV encoded by transformers and the KV vLLM's own kernels
compute differ by rounding, and the pre-RoPE keys are rotated in fp32 and rounded again, so
logprobs cannot agree to fp32's 1e-3. The yardstick is bf16's own noise: the same full
prefill computed by two implementations (vLLM's CPU kernels and transformers, both bf16).
Injected KV must stay within a small multiple of that, and KV encoded without the facts'
context (w=0) must fall outside it, so the bound can fail.
"""

import pytest

from inferscale.kv.encoder import KVEncoder
from inferscale.kv.pool import KVPool
from inferscale.kv.reference import ReferenceModel
from inferscale.generation.prompt import PromptBuilder
from inferscale.serving.engine import Engine
from tests.test_exactness import inject_params, max_logprob_diff

pytestmark = pytest.mark.slow

#: Injected vs prefilled may differ by this many times the two bf16 prefills' own
#: difference (over the common top-20 tokens, nats), and by this floor at least.
NOISE_MULTIPLE = 3.0
NOISE_FLOOR = 0.05


@pytest.fixture(scope="module")
def bf16(model_path, tmp_path_factory, tokenizer, locomo_path):
    from inferscale.datasets.locomo import load_locomo

    data = tmp_path_factory.mktemp("bf16")
    facts = [(f"fact{i}", f.dated_text()) for i, f in enumerate(load_locomo(locomo_path)[0].facts[:20])]
    builder = PromptBuilder(tokenizer, "You are a helpful assistant. Use the memories below.")
    with Engine(model_path, dtype="bfloat16", kv_dir=data / "kv", max_model_len=4096,
                kv_cache_memory_bytes=1 << 28) as engine:
        yield engine, KVEncoder(model_path, "bfloat16"), KVPool.shared(data / "kv", "cpu", 1 << 28), builder, facts


@pytest.mark.parametrize("k", [5, 20])
def test_injected_bf16_kv_matches_a_bf16_prefill(bf16, k):
    engine, encoder, pool, builder, facts = bf16
    layout = builder.build("Where did Caroline go recently, and how did it feel?", facts[:k])
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    exact = engine.generate(layout.token_ids, max_tokens=1, logprobs=20, cache_salt=f"bf16-exact-{k}",
                            kv_transfer_params=inject_params(layout, encoder, pool, exact_context=True, tag=f"b{k}"))
    w0 = engine.generate(layout.token_ids, max_tokens=1, logprobs=20, cache_salt=f"bf16-w0-{k}",
                         kv_transfer_params=inject_params(layout, encoder, pool, exact_context=False, tag=f"b0{k}"))
    assert exact.num_injected_tokens == layout.memory_end and w0.num_injected_tokens == layout.memory_end
    reference = ReferenceModel(encoder).next_token_logprobs(layout.token_ids)  # transformers, bf16, no KV
    noise = max(abs(lp - reference[t].item()) for t, lp in full.first_logprobs.items())
    bound = max(NOISE_MULTIPLE * noise, NOISE_FLOOR)
    d_exact = max_logprob_diff(full.first_logprobs, exact.first_logprobs)
    d_w0 = max_logprob_diff(full.first_logprobs, w0.first_logprobs)
    report = f"bf16 noise {noise:.4f}, exact-context injection {d_exact:.4f}, w=0 {d_w0:.4f} nats"
    assert d_exact < bound, report
    assert full.token_ids == exact.token_ids, report
    if k == 20:  # with 20 facts, encoding them apart is a real change: the bound must see it
        assert d_w0 > bound, report
    print(report)
