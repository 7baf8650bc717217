"""Facts that depend on the machine or on the install, written into the pages from one source.

A page says such a fact between markers, ``<!-- fact:NAME -->text<!-- /fact -->``; this
script fills each with the value the code or the install script holds, so the README and
the docs cannot disagree with each other or with the code (issue 28: the README, the
server page and the deployment page said three things about ``dtype auto``).

    python scripts/page_facts.py          # check: lists every stale fact, exit 1 if any
    python scripts/page_facts.py --write  # rewrite them

``tests/test_page_facts.py`` runs the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- fact:(?P<name>[a-z0-9-]+) -->(?P<text>.*?)<!-- /fact -->", re.S)


def _install_setting(name: str) -> str:
    """A shell variable set in scripts/install.sh (``NAME=value`` or ``NAME="value"``)."""
    found = re.search(rf'^{name}="?([^"\s#]+)"?', (ROOT / "scripts" / "install.sh").read_text(), re.M)
    if found is None:
        raise LookupError(f"scripts/install.sh sets no {name}")
    return found.group(1)


def _dtype_auto() -> str:
    sys.path.insert(0, str(ROOT))
    from inferscale.config import AUTO_DTYPE_RULE

    return AUTO_DTYPE_RULE


#: the fact length the sizing table shows (tokens of a memory line; LoCoMo's observations
#: average about 30 with SmolLM2's tokenizer)
SIZING_TOKENS = 30


def _kv_file_sizes() -> str:
    """The default model's KV file sizes per storage dtype, as a markdown table
    (:func:`inferscale.kv.sizing.kv_file_bytes`)."""
    sys.path.insert(0, str(ROOT))
    from inferscale.kv.sizing import kv_file_bytes
    from inferscale.models.resolve import resolve_llm

    model = resolve_llm()
    rows = ["| model dtype, storage | bytes per fact token | a 30-token fact's file | vs float32 |", "|---|---|---|---|"]
    base = kv_file_bytes(model, "float32", "auto", SIZING_TOKENS)
    for dtype, storage in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("float32", "int4")):
        per_token = (kv_file_bytes(model, dtype, storage, 64) - kv_file_bytes(model, dtype, storage, 32)) / 32
        size = kv_file_bytes(model, dtype, storage, SIZING_TOKENS)
        name = f"{dtype}, {'the model dtype (auto)' if storage == 'auto' else storage}"
        rows.append(f"| {name} | {per_token:,.0f} | {size:,} ({size / 2**20:.2f} MiB) | {size / base:.2f}x |")
    return "\n" + "\n".join(rows) + "\n"


def _min_disk_budget() -> str:
    sys.path.insert(0, str(ROOT))
    from inferscale.config import MemoryConfig

    low = MemoryConfig.model_fields["disk_kv_budget_bytes"].metadata[0].ge
    return f"{low:,} bytes ({low / 2**20:g} MiB)"


#: fact name -> where its value comes from
FACTS: dict[str, Callable[[], str]] = {
    "dtype-auto": _dtype_auto,
    "install-steps": lambda: _install_setting("TOTAL_STEPS"),
    "vllm-version": lambda: _install_setting("VLLM_VERSION"),
    "torch-cpu-version": lambda: _install_setting("TORCH_CPU_VERSION"),
    "kv-file-sizes": _kv_file_sizes,
    "min-disk-budget": _min_disk_budget,
}


def pages() -> list[Path]:
    """The pages a reader sees: the README, docs/ (decisions.md is a dated log, left as written)
    and the adapters' READMEs."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "integrations").glob("*/README.md"))]
    return [p for p in found if p.name != "decisions.md"]


def stale(write: bool = False) -> list[str]:
    """``"page: fact 'text' should be 'value'"`` for every marker whose text is not its fact's
    value (rewritten when ``write``). An unknown fact name is reported too."""
    values = {name: get() for name, get in FACTS.items()}
    out = []
    for page in pages():
        text = page.read_text()
        where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page

        def fill(m: re.Match) -> str:
            name = m.group("name")
            if name not in values:
                out.append(f"{where}: unknown fact {name!r} (known: {', '.join(values)})")
                return m.group(0)
            if m.group("text") != values[name]:
                out.append(f"{where}: fact {name} says {m.group('text')!r}, should be {values[name]!r}")
            return f"<!-- fact:{name} -->{values[name]}<!-- /fact -->"

        new = MARKER.sub(fill, text)
        if write and new != text:
            page.write_text(new)
    return out


def used() -> set[str]:
    """The fact names some page says."""
    return {m.group("name") for page in pages() for m in MARKER.finditer(page.read_text())}


if __name__ == "__main__":
    problems = stale(write="--write" in sys.argv[1:])
    print("\n".join(problems) or "every page's facts are current")
    sys.exit(1 if problems and "--write" not in sys.argv[1:] else 0)
