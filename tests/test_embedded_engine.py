"""An embedded ``Memory()`` with its defaults (issue 51 item 3, issue 56 item 1), as a plain
script in a process of its own (the suite's own process keeps the transformers encoder as its
reference, conftest.py):

- its KV is made by vLLM's engine, which starts when KV or an answer is first asked for, not at
  ``add``; after ``wait_for_kv`` no torch module with the LLM's parameters lives in the script's
  process, and the answer injects the KV the engine made;
- the waits say what they wait for: a line before the engine starts, one when it is up, one
  while KV is made, and nothing else on stderr; the script exits 0 with no main guard;
- a script that only adds and searches starts no engine and prints nothing: its memories'
  encodes stay queued, and the next process that asks for KV makes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

ASKS = textwrap.dedent("""
    import gc, json, sys, warnings
    import torch
    from inferscale import Memory

    def llm_modules():
        gc.collect()
        with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated names warns
            warnings.simplefilter("ignore")
            return [type(o).__name__ for o in gc.get_objects()
                    if isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM")]

    m = Memory(data_dir=sys.argv[1], dtype="float32")
    if sys.argv[2] == "add":
        m.add("I am allergic to peanuts.", user_id="alice")
        m.add("My cat is called Tom.", user_id="alice")
    before = {"engine": m._engine is not None, "pending": m.pending_kv()}
    assert m.wait_for_kv(timeout=900)
    stats = m.kv_stats()
    g = m.generate("What is my cat called?", user_id="alice", max_tokens=8)
    print(json.dumps({"before": before, "llm": llm_modules(), "loaded": stats["encoder_model_loaded"],
                      "engine_encodes": stats["engine_encodes"], "kv": sorted(g.kv_memory_ids),
                      "text": sorted(g.text_memory_ids), "sources": sorted(set(g.kv_sources.values())),
                      "answer": g.text}))
""")

ADDS = textwrap.dedent("""
    import json, sys
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1], dtype="float32")
    m.add("I am allergic to peanuts.", user_id="alice")
    m.add("My cat is called Tom.", user_id="alice")
    hits = m.search("cat", user_id="alice")["results"]
    print(json.dumps({"engine": m._engine is not None, "pending": m.pending_kv(), "top": hits[0]["memory"]}))
""")


def run(tmp_path, name: str, text: str, *args: str) -> tuple[dict, list[str]]:
    script = tmp_path / name
    script.write_text(text)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "data"), *args], capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.splitlines()


def test_the_engine_makes_an_embedded_memorys_kv_and_every_wait_says_so(tmp_path):
    added, quiet = run(tmp_path, "adds.py", ADDS)
    assert added == {"engine": False, "pending": 2, "top": "My cat is called Tom."}
    assert quiet == []  # only adds and searches: no engine, no model, nothing said

    out, said = run(tmp_path, "asks.py", ASKS, "ask")  # the next process makes the queued KV
    assert out["before"] == {"engine": False, "pending": 2}
    assert out["llm"] == [] and out["loaded"] == 0  # vLLM's processes hold the model, this one does not
    assert out["engine_encodes"] >= 2  # two memories (and the preamble)
    assert len(out["kv"]) == 2 and out["text"] == [], out
    assert not [s for s in out["sources"] if s.startswith("text") or "captured" in s], out  # the encodes' KV
    assert "Tom" in out["answer"], out
    assert [line.split(" (")[0] for line in said] == [
        "inferscale: starting vLLM's engine", "inferscale: vLLM's engine is up",
        "inferscale: making the KV of 2 memories"], said
