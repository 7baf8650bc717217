"""`inferscale demo`, as `make demo` runs it, on the real LoCoMo file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "inferscale.cli", "demo"]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "results" / "demo.md"


def transcript(page: str) -> list[str]:
    """The transcript block of a demo page."""
    return page.split("```\n", 1)[1].split("\n```", 1)[0].splitlines()


def skeleton(line: str) -> str:
    """A transcript line with what changes between runs masked: quoted answers, numbers,
    the data path, the dtype (``auto`` is bf16 on AMX CPUs), table rules and padding."""
    line = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "'…'", line)
    line = re.sub(r"from \S*locomo10\.json", "from …", line)
    line = re.sub(r"dtype=(float32|bfloat16)", "dtype=…", line)
    line = re.sub(r"\d+(\.\d+)?", "#", line)
    line = re.sub(r"[─━]+", "─", line)
    return re.sub(r"\s+", " ", line).strip()


def test_demo_answers_questions_and_the_committed_page_has_the_shape_of_a_run(tmp_path, locomo_path):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", COLUMNS="160")
    page = tmp_path / "demo.md"
    proc = subprocess.run(
        [*CLI, "--data", str(locomo_path), "--questions", "2", "--context-window", "0", "--data-dir",
         str(tmp_path / "store"), "--record", str(page)],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("TTFT inject") == 2
    assert "Summary over 2 questions" in out
    assert "median TTFT text / inject" in out
    assert "pid=" not in out + proc.stderr  # no vLLM log line: library use is quiet
    # while KV is encoded (a minute or two), a bar with counts and rate, not silence (issue 38)
    bars = re.findall(r"encoding KV:\s+(\d+)%\|[^|]*\|\s*(\d+)/(\d+) \[[^\]]*?([\d.?]+)(?:KV/s|s/KV)\]", proc.stderr)
    assert bars, proc.stderr[-2000:]
    assert bars[-1][0] == "100" and bars[-1][1] == bars[-1][2] and int(bars[-1][2]) > 0, bars[-1]
    # the KV bar's first estimate is honest (issue 56): within 2x of the time the rest really took
    assert first_eta_error(proc.stderr, "encoding KV") <= 2.0, proc.stderr[-2000:]
    # and the wait before it says what it waits for: vLLM's engine starting (issue 51)
    assert "inferscale: starting vLLM's engine" in proc.stderr.split("encoding KV")[0], proc.stderr[-2000:]
    store = tmp_path / "store"
    assert (store / "chroma").is_dir() and any((store / "kv").iterdir())

    fresh = page.read_text()
    assert fresh.startswith("# Demo run") and "Written by `inferscale demo " in fresh and f"--record {page}" in fresh
    ran = transcript(fresh)
    assert ran and all(line in out for line in ran if line.strip())  # the page is what the run printed
    # the committed page is such a run, longer: same kinds of lines, masked numbers and answers
    committed = transcript(PAGE.read_text())
    assert not any("pid=" in line for line in committed)
    shapes, committed_shapes = {skeleton(x) for x in ran}, {skeleton(x) for x in committed}
    assert shapes <= committed_shapes, sorted(shapes - committed_shapes)
    extra = committed_shapes - shapes
    assert all(s.startswith("Q# (cat #)") for s in extra), sorted(extra)  # only its later questions


def first_eta_error(stderr: str, desc: str) -> float:
    """How far the first estimate of a tqdm bar named ``desc`` was from the truth: its first
    update with items done shows ``elapsed<left``; the bar's last update shows when it ended.
    Returns the larger of left / truth and truth / left."""
    def seconds(clock: str) -> int:
        parts = [int(x) for x in clock.split(":")]
        return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))

    updates = re.findall(rf"{desc}:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[([\d:]+)<([\d:?]+)", stderr)
    first = next(u for u in updates if 0 < int(u[0]) < int(u[1]) and "?" not in u[3])
    end = seconds(updates[-1][2])
    truth = max(1, end - seconds(first[2]))
    left = max(1, seconds(first[3]))
    return max(left / truth, truth / left)


def test_demo_rejects_a_file_that_is_not_locomo(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": "world"}))
    proc = subprocess.run([*CLI, "--data", str(bad), "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "not a JSON list of conversation samples" in proc.stderr
    assert not (tmp_path / "d").exists()  # nothing written
