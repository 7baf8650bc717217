"""Chunked RoPE exactness on the real engine, as numbers (the tests assert the same bounds).

For k LoCoMo facts: next-token logprobs of a full prefill vs KV injection where each
segment was encoded after exactly the tokens before it but at positions offset by 1,000
("exact"), and vs facts encoded after the preamble only ("w=0"). fp32, SmolLM2,
vLLM, plus the transformers reference path. Reproduce with:

    .venv/bin/python scripts/exactness_report.py
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from transformers import AutoTokenizer  # noqa: E402

from inferscale.datasets.locomo import default_locomo_path, load_locomo  # noqa: E402
from inferscale.kv.encoder import EncodeItem, KVEncoder  # noqa: E402
from inferscale.kv.pool import KVPool, kv_key  # noqa: E402
from inferscale.models.resolve import resolve_llm  # noqa: E402
from inferscale.serving.engine import Engine  # noqa: E402
from inferscale.generation.prompt import PromptBuilder  # noqa: E402
from inferscale.kv.reference import ReferenceModel  # noqa: E402


def main() -> None:
    path = resolve_llm()
    tok = AutoTokenizer.from_pretrained(str(path))
    builder = PromptBuilder(tok, "You are a helpful assistant. Use the memories below.")
    facts = [(f"fact{i}", f.dated_text()) for i, f in enumerate(load_locomo(default_locomo_path())[0].facts[:50])]
    kv_dir = Path(tempfile.mkdtemp()) / "kv"
    pool = KVPool.shared(kv_dir, "cpu", 1 << 30)
    enc = KVEncoder(path, "float32")
    ref = ReferenceModel(enc)
    engine = Engine(path, dtype="float32", kv_dir=kv_dir, max_model_len=4096)
    print("| k | prompt tokens | injected | vLLM max abs dlogprob, exact | vLLM, w=0 | reference path, exact |")
    print("|---|---|---|---|---|---|")
    for k in (1, 5, 20, 50):
        layout = builder.build("Where did Caroline go recently, and how did it feel?", facts[:k])
        pre_end = layout.segments[0].end
        row = []
        for exact in (True, False):
            items = [EncodeItem(tuple(layout.token_ids[: s.start if exact or s.owner == "_preamble" else pre_end]),
                                s.token_ids, 1000) for s in layout.segments]
            kvs = enc.encode(items)
            segs = []
            for s, kv in zip(layout.segments, kvs):
                key = kv_key(s.owner, k=k, exact=exact)
                pool.put(key, kv)
                segs.append([key, s.start, len(s.token_ids)])
            params = {"inferscale": {"memory_end": layout.memory_end, "segments": segs}}
            full = engine.generate(layout.token_ids, max_tokens=1, logprobs=20)
            inj = engine.generate(layout.token_ids, kv_transfer_params=params, cache_salt=f"{k}{exact}", max_tokens=1,
                                  logprobs=20)
            common = set(full.first_logprobs) & set(inj.first_logprobs)
            row.append(max(abs(full.first_logprobs[t] - inj.first_logprobs[t]) for t in common))
            if exact:
                injected = inj.num_injected_tokens
                r_full = ref.next_token_logprobs(layout.token_ids)
                r_inj = ref.next_token_logprobs(layout.token_ids, [(s.start, kv) for s, kv in zip(layout.segments, kvs)])
                ref_diff = (r_full - r_inj).abs().max().item()
        print(f"| {k} | {len(layout.token_ids)} | {injected} | {row[0]:.2e} | {row[1]:.2e} | {ref_diff:.2e} |")


if __name__ == "__main__":
    main()
