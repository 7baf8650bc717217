"""Library use is quiet by default and verbose on request (issue 18): a fresh process that
adds a fact and generates prints what it asked for and nothing else; INFERSCALE_VERBOSE=1
brings vLLM's logs back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys
    from inferscale import Memory

    if __name__ == "__main__":
        with Memory(data_dir=sys.argv[1], dtype="float32", context_window=0) as m:
            m.add("My dog is called Rex.", user_id="u")
            print("ANSWER:", m.generate("What is my dog called?", user_id="u", max_tokens=8).text)
""")
# what a user's shell would not have set; each would change what is printed
_OURS = ("VLLM_LOGGING_LEVEL", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", "INFERSCALE_VERBOSE")


def run_script(tmp_path: Path, name: str, **extra: str) -> tuple[list[str], int]:
    script = tmp_path / "remember.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in _OURS and not k.startswith("PYTEST")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / name)], capture_output=True, text=True,
                          timeout=900, env={**env, **extra})
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return lines, proc.returncode


def test_a_fresh_process_prints_only_its_answer_and_verbose_brings_the_logs_back(tmp_path):
    lines, code = run_script(tmp_path, "quiet")
    assert code == 0, "\n".join(lines[-40:])
    assert len(lines) <= 5, "\n".join(lines)
    assert any(line.startswith("ANSWER:") for line in lines), lines
    assert not any("INFO" in line or "WARNING" in line or "Warning" in line for line in lines), lines

    loud, code = run_script(tmp_path, "verbose", INFERSCALE_VERBOSE="1")
    assert code == 0, "\n".join(loud[-40:])
    assert any(line.startswith("ANSWER:") for line in loud)
    vllm_lines = [line for line in loud if " INFO " in line and "pid=" in line]  # vLLM's own log format
    assert len(vllm_lines) >= 10, "\n".join(loud)
    assert any("EngineCore" in line for line in vllm_lines)  # the engine process logs too
