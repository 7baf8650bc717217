"""The README's results section, built from the benchmarks' JSON summaries.

``inferscale bench report`` reads ``<results>/{latency,throughput,serve,quality,retrieval,footprint}/*.json``
and rewrites the part of ``README.md`` between the markers below, so the headline
numbers are never typed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from inferscale.bench.common import markdown_table

START = "<!-- bench-results:start -->"
END = "<!-- bench-results:end -->"


def _load(results: Path, name: str) -> dict | None:
    path = results / name / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _cell(cells: list[dict], **match) -> dict | None:
    return next((c for c in cells if all(c.get(k) == v for k, v in match.items())), None)


def summary_rows(results: Path) -> list[list[str]]:
    """One row per headline number: (what, measured, target, page)."""
    rows = []
    lat = _load(results, "latency")
    if lat:
        cells, n = lat["cells"], lat["settings"]["questions"]
        inj0, inj50 = _cell(cells, mode="inject-w20", k=0), _cell(cells, mode="inject-w20", k=50)
        txt50 = _cell(cells, mode="text", k=50)
        if inj0 and inj50 and txt50:
            rows.append([f"TTFT, inject (w=20) k=50 vs k=0 ({n} questions, median)",
                         f"{inj50['ttft_median_ms']:.0f} vs {inj0['ttft_median_ms']:.0f} ms: "
                         f"**{inj50['ttft_median_ms'] / inj0['ttft_median_ms']:.2f}x**", "<= 1.25x",
                         "[latency](docs/results/latency/latency.md)"])
            rows.append(["TTFT, text vs inject (w=20) at k=50 (median)",
                         f"{txt50['ttft_median_ms']:.0f} vs {inj50['ttft_median_ms']:.0f} ms: "
                         f"**{txt50['ttft_median_ms'] / inj50['ttft_median_ms']:.2f}x**", ">= 6x",
                         "[latency](docs/results/latency/latency.md)"])
            e_t, e_i = txt50["e2e_median_ms"], inj50["e2e_median_ms"]
            rows.append(["end to end (retrieval + TTFT), text vs inject (w=20) at k=50", f"{e_t:.0f} vs {e_i:.0f} ms: "
                         f"{e_t / e_i:.2f}x", "", "[latency](docs/results/latency/latency.md)"])
    tp = _load(results, "throughput")
    if tp:
        for users, ratio in tp["inject_over_text_requests_per_s"].items():
            if users == "16":
                i, t = _cell(tp["cells"], mode="inject", users=16), _cell(tp["cells"], mode="text", users=16)
                rows.append(["throughput at 16 concurrent users, inject vs text",
                             f"{i['requests_per_s']:.2f} vs {t['requests_per_s']:.2f} req/s: **{ratio:.2f}x**",
                             ">= 3.7x", "[throughput](docs/results/throughput/throughput.md)"])
    sv = _load(results, "serve")
    if sv and "16" in sv["inject_over_text_requests_per_s"]:
        i, t = _cell(sv["cells"], mode="inject", users=16), _cell(sv["cells"], mode="text", users=16)
        rows.append(["through `inferscale serve` (HTTP, openai client) at 16 users, inject vs text",
                     f"{i['requests_per_s']:.2f} vs {t['requests_per_s']:.2f} req/s: "
                     f"**{sv['inject_over_text_requests_per_s']['16']:.2f}x**", ">= 4x",
                     "[serve](docs/results/serve/serve.md)"])
    q = _load(results, "quality")
    if q and any("split" in c for c in q["cells"]):  # the paired run: held-out answers, changes with CIs
        for k, mode in ((10, "inject-w5"), (50, "inject-w5"), (50, "inject-w20"), (10, "captured"), (50, "captured")):
            i = _cell(q["cells"], mode=mode, k=k, split="held_out")
            if i:
                lo, hi = i["nll_change_ci"]
                flo, fhi = i["f1_change_ci"]
                rows.append([f"gold-answer NLL and token F1 at k={k}, {mode} vs text ({i['n']} held-out answers, "
                             f"paired, 95% CI)", f"NLL **{i['nll_change']:+.1%}** [{lo:+.1%}, {hi:+.1%}]; F1 "
                             f"{i['f1_change']:+.3f} [{flo:+.3f}, {fhi:+.3f}]", "NLL within 5%",
                             "[quality](docs/results/quality/quality.md)"])
    elif q:
        cells = q["cells"]
        for mode in ("inject-w20",):
            i, t = _cell(cells, mode=mode, k=50), _cell(cells, mode="text", k=50)
            if i and t:
                rows.append([f"token F1 at k=50, {mode} vs text ({i['n']} answers each)",
                             f"{i['f1_mean']:.3f} vs {t['f1_mean']:.3f}: **{i['f1_mean'] / t['f1_mean']:.0%}**"
                             if t["f1_mean"] else f"{i['f1_mean']:.3f} vs {t['f1_mean']:.3f}", ">= 95%",
                             "[quality](docs/results/quality/quality.md)"])
                rows.append([f"gold-answer NLL at k=50, {mode} vs text", f"{i['nll_mean']:.3f} vs {t['nll_mean']:.3f} "
                             f"nats/token: **{i['nll_mean'] / t['nll_mean'] - 1:+.1%}**", "within 5%",
                             "[quality](docs/results/quality/quality.md)"])
    rt = _load(results, "retrieval")
    if rt:
        h = rt["held_out"]
        d, y = h["recall_dense"]["10"], h["recall_hybrid"]["10"]
        rows.append([f"evidence recall@10, hybrid vs dense search (LoCoMo, {h['questions']} held-out questions)",
                     f"{y:.3f} vs {d:.3f}: **{y - d:+.3f}**", "hybrid > dense",
                     "[retrieval](docs/results/retrieval/retrieval.md)"])
        if "recall_hybrid_1_4" in h:  # the measure: categories 1-4, against the ceiling of about 0.79
            y4, f4 = h["recall_hybrid_1_4"]["10"], h["recall_hybrid-fact_1_4"]["10"]
            source = h.get("recall_hybrid-source_1_4", {}).get("10")
            rows.append([f"evidence recall@10, categories 1-4 ({h['questions_1_4']} held-out questions), hybrid "
                         "(source turns and the turn before them in BM25, turn neighbours, dates) vs the fact's "
                         "text alone", f"**{y4:.3f}** vs {f4:.3f}"
                         + (f" ({source:.3f} with source turns only; ceiling about 0.79)" if source else ""),
                         ">= 0.70", "[retrieval](docs/results/retrieval/retrieval.md)"])
    fp = _load(results, "footprint")
    if fp:
        sizes = [c["kv_mib"] for c in fp["conversations"]]
        rows.append(["KV per fact / per LoCoMo conversation", f"{fp['bytes_per_fact_mean'] / 1024:.0f} KiB / "
                     f"{min(sizes):.0f}-{max(sizes):.0f} MiB ({fp['dtype']})", "",
                     "[footprint](docs/results/footprint/footprint.md)"])
    return rows


def _machine_label(machine: dict) -> str:
    return f"{machine['cpu']}, {machine['cores']} cores, {machine.get('gpu') or 'no GPU'}"


def render(results: Path) -> str:
    """The Markdown that goes between the markers. When the rows were measured on more than
    one machine (benchmarks run in different sessions), each row names its own."""
    rows = summary_rows(results)
    machines = []
    for row in rows:  # the page link names the benchmark whose JSON the row came from
        name = row[3].split("docs/results/", 1)[1].split("/", 1)[0]
        machines.append((_load(results, name) or {}).get("machine"))
    known = [m for m in machines if m]
    labels = sorted({_machine_label(m) for m in known})
    if not known:
        where = "no results yet"
    elif len(labels) == 1:
        m = known[0]
        where = f"{labels[0]}, torch {m['torch']}, vLLM {m.get('vllm')}"
    else:
        where = ("several machines, each row's in its last column (compare ratios within a row, not "
                 f"across rows); torch {known[0]['torch']}, vLLM {known[0].get('vllm')}")
        rows = [[*row, _machine_label(m) if m else ""] for row, m in zip(rows, machines)]
    header = ["what", "measured", "target", "page"] + (["machine"] if len(labels) > 1 else [])
    table = markdown_table(header, rows) if rows else "(no benchmark results yet)"
    return f"{START}\nMeasured on: {where}.\n\n{table}\n{END}"


def update_readme(readme: Path, results: Path) -> str:
    """Rewrite the marked section of ``readme``; returns the new section.

    Raises:
        FileNotFoundError: no README at ``readme`` or no folder at ``results``.
        ValueError: the README lacks the markers.
    """
    if not readme.is_file():
        raise FileNotFoundError(f"no README at {readme}: run from the repository root or pass --readme")
    if not results.is_dir():
        raise FileNotFoundError(f"no results folder at {results}: run from the repository root or pass --results")
    text = readme.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{readme} has no {START} ... {END} section to fill")
    section = render(results)
    head, rest = text.split(START, 1)
    _old, tail = rest.split(END, 1)
    readme.write_text(head + section + tail)
    return section
