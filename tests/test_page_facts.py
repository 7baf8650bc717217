"""Machine- and install-dependent facts come from one source (issue 28): every page that says
one says it between ``<!-- fact:NAME -->`` markers, filled by ``scripts/page_facts.py`` from
the code and the install script."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("page_facts", ROOT / "scripts" / "page_facts.py")
page_facts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(page_facts)


def test_every_page_says_each_fact_as_its_source_does():
    assert page_facts.stale() == []
    assert page_facts.used() == set(page_facts.FACTS)  # every fact is on a page, no page names an unknown one


def test_the_facts_come_from_the_code_and_the_install_script():
    from inferscale.config import AUTO_DTYPE_RULE
    from inferscale.serving.vllm_compat import PINNED_VLLM_VERSION

    assert page_facts.FACTS["dtype-auto"]() == AUTO_DTYPE_RULE
    assert page_facts.FACTS["vllm-version"]() == PINNED_VLLM_VERSION
    steps = int(page_facts.FACTS["install-steps"]())
    # the install that made this venv (make test runs it first) announced that many, and ran each
    log = (ROOT / ".venv" / "install.log").read_text()
    last_run = log.rsplit("===== scripts/install.sh", 1)[1]
    announced = re.findall(r"step (\d+)/(\d+)", last_run)
    assert {int(total) for _, total in announced} == {steps}
    assert max(int(n) for n, _ in announced) == steps


def test_a_stale_fact_is_reported_and_rewritten(tmp_path, monkeypatch):
    page = tmp_path / "README.md"
    page.write_text("auto is <!-- fact:dtype-auto -->float32 on CPU<!-- /fact -->.\n")
    monkeypatch.setattr(page_facts, "pages", lambda: [page])
    assert page_facts.stale() == [f"{page}: fact dtype-auto says 'float32 on CPU', should be "
                                  f"{page_facts.FACTS['dtype-auto']()!r}"]
    page_facts.stale(write=True)
    assert page_facts.stale() == [] and "Intel AMX" in page.read_text()


def test_the_check_runs_as_a_script():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "page_facts.py")], capture_output=True, text=True)
    assert done.returncode == 0 and "current" in done.stdout, done.stdout + done.stderr
