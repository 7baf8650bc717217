"""`inferscale demo`, as `make demo` runs it, on the real LoCoMo file."""

import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "inferscale.cli", "demo"]


def test_demo_answers_questions_with_injection(tmp_path, locomo_path):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", COLUMNS="160")
    proc = subprocess.run(
        [*CLI, "--data", str(locomo_path), "--questions", "2", "--context-window", "0", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("TTFT inject") == 2
    assert "Summary over 2 questions" in out
    assert "median TTFT text / inject" in out
    assert (tmp_path / "chroma").is_dir() and any((tmp_path / "kv").iterdir())


def test_demo_rejects_a_file_that_is_not_locomo(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": "world"}))
    proc = subprocess.run([*CLI, "--data", str(bad), "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "not a JSON list of conversation samples" in proc.stdout
    assert not (tmp_path / "d").exists()  # nothing written
