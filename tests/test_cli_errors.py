"""Every CLI command answers a missing file or a bad option value with one short line and
exit status 2, never a traceback (issue 18)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/inferscale-test/locomo10.json"

# (command line, a word the one line must contain)
MISSING_FILES = [
    ("demo --data {missing}", "no LoCoMo file"),
    ("bench memory-ops --data {missing}", "not found"),
    ("bench latency --data {missing}", "no LoCoMo file"),
    ("bench quality --data {missing}", "no LoCoMo file"),
    ("bench throughput --data {missing}", "no LoCoMo file"),
    ("bench footprint --data {missing}", "no LoCoMo file"),
    ("bench serve --data {missing}", "no LoCoMo file"),
    ("bench retrieval --data {missing}", "no LoCoMo file"),
    ("bench kv-storage --data {missing}", "no LoCoMo file"),
    ("bench report --readme {missing}.md", "no README"),
    ("bench report --results {missing}.d", "no results folder"),
    ("serve --data-dir {afile}", "is a file"),
]
BAD_VALUES = [
    ("demo --sample 42", "--sample must be in 0..9"),
    ("demo --dtype fp16", "--dtype must be"),
    ("demo --k -1", "--k"),
    ("bench memory-ops --scale abc", "--scale must be"),
    ("bench latency --modes bogus", "unknown mode 'bogus'"),
    ("bench latency --k abc", "--k must be"),
    ("bench latency --modes text-int4", "text mode stores no KV"),
    ("bench kv-storage --tuning 1 --held-out 1,2", "must be distinct"),
    ("bench quality --held-out 99", "distinct indices in 0..9"),
    ("bench quality --modes text,inject-wx", "unknown mode"),
    ("bench throughput --users 0", "positive user counts"),
    ("bench footprint --split-sample 42", "must be in 0..9"),
    ("bench serve --users x", "--users must be"),
    ("bench retrieval --big -1", "--big"),
    ("bench report --results {afile}", "no results folder"),
    ("serve --port 0", "--port"),
    ("serve --tool-call-parser bogus", "is not one of vLLM's"),
    ("serve --workers 2", "needs Chroma as a server"),
    ("serve --workers 0", "--workers"),
    ("serve --kv-storage-dtype int3", "--kv-storage-dtype must be auto, int8 or int4"),
    ("serve --disk-kv-budget-bytes 1000", "greater than or equal to 1048576, got 1000 (--disk-kv-budget-bytes)"),
    ("serve --kv-redis-url redis://h:99999/0", "port is a number from 1 to 65535, got 'redis://h:99999/0' (--kv-redis-url)"),
    ("serve --replicas 2 --vllm-url http://127.0.0.1:9", "--replicas starts vLLM servers"),
    ("serve --vllm-url http://127.0.0.1:9 --vllm-url http://127.0.0.1:9/", "is given more than once"),
    ("models prepare --bogus", "No such option"),
]


def run_cli(line: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = line.format(missing=MISSING, afile=afile).split()
    if args[0] == "bench" and args[1] not in ("report",):
        args += ["--out", str(tmp_path / "out")]
    return subprocess.run([sys.executable, "-m", "inferscale.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def check_one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "File \"" not in output, output
    assert len(output.strip().splitlines()) <= 6, output  # one line, or typer's usage box (5 lines)
    assert expected in output, output


@pytest.mark.parametrize("line,expected", MISSING_FILES, ids=[c[0].split(" --")[0] for c in MISSING_FILES])
def test_a_missing_file_is_one_line_and_exit_2(line, expected, tmp_path):
    check_one_line(run_cli(line, tmp_path), expected)
    assert not (tmp_path / "out").exists()  # a failed run leaves nothing at --out (issue 56)


@pytest.mark.parametrize("line,expected", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_a_bad_option_value_is_one_line_and_exit_2(line, expected, tmp_path):
    check_one_line(run_cli(line, tmp_path), expected)
    assert not (tmp_path / "out").exists()  # a failed run leaves nothing at --out (issue 56)


def test_a_vllm_cache_too_small_for_max_model_len_is_one_line_before_vllm_starts(tmp_path):
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(16 << 20), "INFERSCALE_DTYPE": "float32"}
    proc = run_cli(f"serve --data-dir {tmp_path / 'new'} --port {port}", tmp_path, env)
    check_one_line(proc, "raise kv_cache_memory_bytes to at least 383,778,816 bytes")
    assert not (tmp_path / "new").exists()  # refused before the data dir was made


def test_a_bad_setting_in_the_environment_is_one_line(tmp_path):
    import os

    env = {**os.environ, "INFERSCALE_DTYPE": "fp16"}
    proc = run_cli("serve --data-dir {afile}x", tmp_path, env)
    check_one_line(proc, "INFERSCALE_DTYPE")


def test_a_benchmark_stopped_with_sigterm_stops_as_ctrl_c_does(tmp_path):
    """SIGTERM raises KeyboardInterrupt in a benchmark (so its Memory closes and vLLM's engine
    processes end with it): the process exits through Python's handler, not killed by the
    signal (which would read as -15)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "bench", "fleet", "--out", str(tmp_path / "f"),
                             "--users", "1e4", "--validate-users", "10000", "--validate-requests", "50000000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)  # inside the exact simulation (minutes long)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode not in (-signal.SIGTERM, 0), (proc.returncode, err[-500:])
    assert not (tmp_path / "f" / "fleet.json").exists()
