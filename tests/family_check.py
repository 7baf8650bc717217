"""Run as a script: exactness of injected KV through vLLM for a tiny random model of one family.

Usage: python tests/family_check.py <family> <rope_type> <workdir>
Prints one line ``RESULT {...}`` with the max logprob difference and token counts.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from inferscale.kv.encoder import EncodeItem, KVEncoder
from inferscale.kv.pool import KVPool, kv_key
from inferscale.models.resolve import resolve_llm
from inferscale.serving.engine import Engine
from inferscale.generation.prompt import PromptBuilder

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1000000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
}


def main(family: str, rope: str, workdir: Path) -> None:
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(resolve_llm()))  # a chat template for the tiny model
    common = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  rope_parameters=ROPES[rope], tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if family == "llama" else Qwen3ForCausalLM(Qwen3Config(**common)))
    folder = workdir / f"{family}-{rope}"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)

    builder = PromptBuilder(tok, "Use the memories below.")
    facts = [(f"f{i}", f"Fact number {i}: the user likes item {i * 7}.") for i in range(8)]
    layout = builder.build("What does the user like?", facts)
    encoder = KVEncoder(folder, "float32")
    pool = KVPool.shared(workdir / "kv", "cpu", 1 << 28)
    items = [EncodeItem(tuple(layout.token_ids[: s.start]), s.token_ids, 1000) for s in layout.segments]
    segments = []
    for seg, kv in zip(layout.segments, encoder.encode(items)):
        key = kv_key(seg.owner, family=family, rope=rope)
        pool.put(key, kv)
        segments.append([key, seg.start, len(seg.token_ids)])
    params = {"inferscale": {"memory_end": layout.memory_end, "segments": segments}}
    engine = Engine(folder, dtype="float32", kv_dir=workdir / "kv", max_model_len=2048, kv_cache_memory_bytes=1 << 28)
    full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
    inj = engine.generate(layout.token_ids, kv_transfer_params=params, cache_salt="x", max_tokens=1, logprobs=20)
    common_tokens = set(full.first_logprobs) & set(inj.first_logprobs)
    diff = max(abs(full.first_logprobs[t] - inj.first_logprobs[t]) for t in common_tokens)
    print("RESULT " + json.dumps({"max_diff": diff, "common": len(common_tokens), "injected": inj.num_injected_tokens,
                                  "memory_end": layout.memory_end}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
