"""A script is just a script (issue 28): the README's ``Use`` block runs as a plain file
with no main guard, and every process that used ``Memory`` exits 0 with nothing on stderr but
the notices of its waits (``inferscale: ...``, issue 56), whether or not it closed it, with KV still encoding; what it left queued is encoded by the
next process that opens the data dir."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a user's shell would not have set; each would change what is printed
_OURS = ("VLLM_LOGGING_LEVEL", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", "INFERSCALE_VERBOSE")


def run(script: Path, *args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python script args`` in a fresh process, with a user's environment."""
    env = {k: v for k, v in os.environ.items() if k not in _OURS and not k.startswith("PYTEST")}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def unasked(stderr: str) -> list[str]:
    """The lines on stderr that are not InferScale's notices of a wait (the engine starting, KV
    being made: :mod:`inferscale.runtime.progress`)."""
    return [line for line in stderr.splitlines() if not line.startswith("inferscale: ")]


def readme_use_block() -> str:
    """The first Python block under the README's ``## Use`` heading."""
    section = (ROOT / "README.md").read_text().split("\n## Use\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_use_block_runs_as_a_plain_script(tmp_path):
    code = readme_use_block()
    assert "__main__" not in code and "Memory(" in code and ".generate(" in code
    script = tmp_path / "use.py"
    script.write_text(code)
    proc = run(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert unasked(proc.stderr) == [], proc.stderr[-3000:]
    assert "inferscale: starting vLLM's engine" in proc.stderr  # the README's wait_for_kv starts it, and says so
    lines = proc.stdout.strip().splitlines()
    # the answer line: text, then TTFT (seconds), injected and prefilled tokens
    text, ttft, injected, prefilled = lines[-2].rsplit(" ", 3)
    assert text.strip() and float(ttft) > 0 and int(injected) > 0 and int(prefilled) > 0, lines[-2]
    assert "peanut" in text.lower(), text  # the headline example answers from its memory (issue 56)
    # then where each memory's KV came from: the fact just added, as KV or as text and why
    sources = ast.literal_eval(lines[-1])
    assert len(sources) == 1 and all(s in ("device", "host", "disk", "redis", "quantized now", "encoded now")
                                     or s.startswith("text: ") for s in sources.values()), lines[-1]
    assert (tmp_path / "memory" / "chroma").is_dir()  # ./memory, relative to where it ran


def test_the_readmes_in_process_one_liner_runs_as_a_plain_script(tmp_path):
    """The last block of the README's "Switch in one line": Mem0's ``Memory`` API and
    LangChain's chat model over it, in-process (the server blocks run in tests/test_server.py)."""
    section = (ROOT / "README.md").read_text().split("\n## Switch in one line\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[-1]
    assert "from inferscale import Memory" in code and "127.0.0.1" not in code
    script = tmp_path / "one_liner.py"
    script.write_text(code)
    proc = run(script, cwd=tmp_path)
    assert proc.returncode == 0 and unasked(proc.stderr) == [], proc.stderr[-3000:]
    assert "peanut" in proc.stdout.lower(), proc.stdout  # the answer, from the memory
    assert (tmp_path / "memory" / "chroma").is_dir()


ADD_AND_UPDATE = """
    import sys
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1])
    mid = m.add("I live in Lisbon.", user_id=sys.argv[2])["results"][0]["id"]
    m.update(mid, "I live in Porto.", user_id=sys.argv[2])
"""
TWELVE_ADDS = """
    import sys
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1])
    for i in range(12):
        m.add(f"Trip {i}: I visited city number {i} in spring {2000 + i}.", user_id=sys.argv[2])
"""
OPENED_TWICE = """
    import sys
    from inferscale import Memory

    a = Memory(data_dir=sys.argv[1])
    b = Memory(data_dir=sys.argv[1])
    a.add("I like green tea.", user_id=sys.argv[2])
    print(len(b.get_all(user_id=sys.argv[2])["results"]))
"""
CHECK_QUEUED_KV = """
    import json, sys
    from inferscale import Memory

    m = Memory(data_dir=sys.argv[1])
    pending = m.pending_kv()
    assert m.wait_for_kv(600)
    out = {"pending_on_open": pending, "users": {}}
    for user in sys.argv[2:]:
        req = m.inject("Which cities did I visit?", user_id=user, k=12)
        g = m.generate("Which cities did I visit?", user_id=user, k=12, max_tokens=4)
        out["users"][user] = {"memories": len(g.memories), "kv": len(g.kv_memory_ids), "text": len(g.text_memory_ids),
                              "injected": g.num_injected_tokens, "planned": req.memory_tokens}
    print(json.dumps(out))
"""

RUNS = 3  # runs of each never-closing script, one user each


@pytest.mark.parametrize("name,body", [("add_and_update", ADD_AND_UPDATE), ("twelve_adds", TWELVE_ADDS),
                                       ("opened_twice", OPENED_TWICE)])
def test_scripts_that_never_close_exit_0_with_nothing_on_stderr(tmp_path_factory, name, body, request):
    data = tmp_path_factory.getbasetemp() / f"plain-{name}"
    script = data.parent / f"{name}.py"
    script.write_text(textwrap.dedent(body))
    for i in range(RUNS):  # the crashes were intermittent: 2 runs of 3, 1 of 2 (three runs of three scripts)
        proc = run(script, str(data), f"user{i}", cwd=data.parent, timeout=600)
        assert (proc.returncode, proc.stderr) == (0, ""), f"run {i}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        if name == "opened_twice":
            assert proc.stdout.strip() == "1"  # the second Memory over the dir sees the first's write


def test_kv_left_queued_by_a_script_is_encoded_and_injected_by_the_next_process(tmp_path_factory):
    data = tmp_path_factory.getbasetemp() / "plain-twelve_adds"
    if not data.is_dir():  # this test alone: write the store the way the script test does
        script = data.parent / "twelve_adds.py"
        script.write_text(textwrap.dedent(TWELVE_ADDS))
        for i in range(RUNS):
            assert run(script, str(data), f"user{i}", cwd=data.parent, timeout=600).returncode == 0
    check = data.parent / "check_queued_kv.py"
    check.write_text(textwrap.dedent(CHECK_QUEUED_KV))
    users = [f"user{i}" for i in range(RUNS)]  # one per run of the script test
    proc = run(check, str(data), *users, cwd=data.parent)
    assert (proc.returncode, unasked(proc.stderr)) == (0, []), proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pending_on_open"] > 0, out  # the scripts ended with KV still queued
    for user in users:
        got = out["users"][user]
        assert (got["memories"], got["kv"], got["text"]) == (12, 12, 0), (user, got)
        assert got["injected"] == got["planned"] > 0, (user, got)
