"""The documentation site builds with warnings as errors, and its API reference covers
the public classes of the core and of both adapters."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("quickstart", "concepts", "adapters", "configuration", "server", "deployment", "benchmarks",
                 "architecture", "decisions"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("inferscale.Memory", "inferscale.Memory.generate", "inferscale.Memory.stream",
                 "inferscale.AsyncMemory",
                 "inferscale.types.Generation", "inferscale.types.GenerationChunk", "inferscale.sessions.ChatSessions",
                 "langchain_inferscale.ChatInferScale", "langchain_inferscale.InferScaleChatMessageHistory",
                 "langchain_inferscale.InferScaleRetriever", "langchain_inferscale.InferScaleStore",
                 "llama_index.llms.inferscale.InferScaleLLM",
                 "llama_index.storage.chat_store.inferscale.InferScaleChatStore",
                 "llama_index.memory.inferscale.InferScaleMemoryBlock", "inferscale.server.chat.MemoryOptions"):
        assert f'id="{name}"' in api, f"{name} missing from the API reference"
    assert "allow_unknown_scope" in api  # parameters come from the docstrings
    assert "img/kv-injection.svg" in (site / "concepts" / "index.html").read_text()  # the diagram


# ------------------------------------------------------------------ pip lines and environments (issue 38)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("integrations/*/README.md"))]
#: a line's ``pip install`` and what follows it, up to a backtick, ``#`` or the line's end
PIP_LINE = re.compile(r"(\S*pip) install ([^`#\n]+)")
#: a block that runs in an environment of its own says so
NAMED_ENV = re.compile(r"Run with (\.venv-[\w-]+)/bin/python")


def _satisfied_in_venv(spec: str) -> bool:
    """Whether ``spec`` (a requirement, ``-e <folder>`` or ``-r <file>``) is already met by
    this environment, so installing it here changes nothing."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    if spec.startswith("-e "):
        name = tomllib.loads((ROOT / spec[3:].strip() / "pyproject.toml").read_text())["project"]["name"]
        return _satisfied_in_venv(name)
    req = Requirement(spec.strip("'\""))
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        return False
    if not req.specifier.contains(dist.version, prereleases=True):
        return False
    for extra in req.extras:  # each requirement of the extra met too
        for line in dist.requires or ():
            r = Requirement(line)
            if r.marker is not None and r.marker.evaluate({"extra": extra}) and not _satisfied_in_venv(
                    f"{r.name}{r.specifier}"):
                return False
    return True


def test_every_pip_line_of_the_pages_is_a_no_op_in_venv_or_names_its_own_environment():
    """A ``pip install`` pasted as a page shows it never changes ``.venv``: what it installs
    into ``.venv`` is already there (so ``pip check`` cannot get worse), and anything else
    goes to an environment of its own that the install creates (``<env>/bin/pip``)."""
    install = (ROOT / "scripts" / "install.sh").read_text()
    seen = 0
    for page in PAGES:
        if page.name == "decisions.md":  # a log of what was done, not instructions
            continue
        for line in page.read_text().splitlines():
            for pip, args in PIP_LINE.findall(line):
                seen += 1
                where = pip.split("/bin/")[0] if "/bin/" in pip else ".venv"
                if where != ".venv":
                    assert where in install or "python -m venv " + where in line, (page.name, line)
                    continue
                specs = re.findall(r"-[er] \S+|'[^']+'|\"[^\"]+\"|[^\s-]\S*", args)
                assert specs and all(s.startswith("-r") is False for s in specs), (page.name, line)
                for spec in specs:
                    assert _satisfied_in_venv(spec), f"{page.name}: `{pip} install {args.strip()}` would change " \
                                                     f".venv ({spec} is not installed there as asked)"
    assert seen >= 6


def test_each_readme_block_names_the_environment_it_runs_in_and_that_environment_is_sound():
    """Every Python block of the README: its imports resolve in the environment it names
    (``Run with .venv-X/bin/python``, created by scripts/install.sh) or in ``.venv``; each
    named environment's ``pip check`` is clean."""
    install = (ROOT / "scripts" / "install.sh").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    named = 0
    for block in blocks:
        found = NAMED_ENV.search(block)
        python = ROOT / found.group(1) / "bin" / "python" if found else Path(sys.executable)
        if found:
            named += 1
            assert found.group(1) in install, found.group(1)
            check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
            assert check.returncode == 0, (found.group(1), check.stdout)
        modules = sorted(set(re.findall(r"^\s*(?:from|import) ([\w.]+)", block, re.M)) - {"__future__"})
        probe = "import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]" \
                "; print(missing); sys.exit(bool(missing))"
        run = subprocess.run([str(python), "-c", probe, *modules], capture_output=True, text=True)
        assert run.returncode == 0, (python, block[:200], run.stdout, run.stderr[-500:])
    assert named == 2, "the Mem0 and LlamaIndex blocks name their environments"
