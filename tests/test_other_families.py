"""Injection is exact through vLLM for other families and rope types (tiny random models)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("family_check.py")


@pytest.mark.parametrize(("family", "rope"), [("qwen3", "default"), ("llama", "llama3")])
def test_injected_kv_matches_prefill_for_family(tmp_path, family, rope):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(SCRIPT), family, rope, str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["injected"] == got["memory_end"]
    assert got["common"] >= 10
    assert got["max_diff"] < 1e-3, got
