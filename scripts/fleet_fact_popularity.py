"""How unevenly a user's facts are retrieved: the source of the fleet simulator's ``fact_zipf``.

For each LoCoMo conversation, every question (1,986 in all) retrieves its top k of the
conversation's facts (dense cosine with the library's default embedder,
all-MiniLM-L6-v2, over the dated fact texts the benchmarks store). Per conversation, the
facts sorted by how often they were retrieved give the share of retrievals that went to
the top 10% and the top half of the facts. The same shares are then computed for a
Zipf(s) popularity under the simulator's model (Poisson sampling of k facts a request,
:func:`inferscale.bench.fleet.inclusion_probabilities`), drawn with the same number of
questions, so sampling noise is on both sides; the closest s is the fit.

    python scripts/fleet_fact_popularity.py --out docs/results/fleet/fact_popularity.md

CPU only; about a minute on two cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from inferscale.bench.common import markdown_table, print_page
from inferscale.bench.fleet import inclusion_probabilities
from inferscale.config import DEFAULT_EMBEDDER
from inferscale.datasets.locomo import load_locomo
from inferscale.models.embedding import Embedder

EXPONENTS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0)


def top_shares(counts: np.ndarray) -> tuple[float, float]:
    """Shares of all retrievals that went to the top 10% and the top half of the facts."""
    ranked = np.sort(counts)[::-1] / counts.sum()
    return float(ranked[: len(ranked) // 10].sum()), float(ranked[: len(ranked) // 2].sum())


def measured(data: Path, ks: tuple[int, ...]) -> dict[int, list[tuple[int, int, float, float]]]:
    """Per k, per conversation: (facts, questions, top-10% share, top-half share)."""
    embedder = Embedder(DEFAULT_EMBEDDER, "cpu")
    out: dict[int, list] = {k: [] for k in ks}
    for sample in load_locomo(data):
        facts = embedder.encode([f.dated_text() for f in sample.facts]).numpy()
        questions = embedder.encode([q.question for q in sample.qa]).numpy()
        order = np.argsort(-(questions @ facts.T), axis=1)
        for k in ks:
            counts = np.bincount(order[:, :k].ravel(), minlength=len(facts))
            out[k].append((len(facts), len(questions), *top_shares(counts)))
    return out


def simulated(facts: int, questions: int, k: int, zipf: float, rng: np.random.Generator,
              repeats: int = 20) -> tuple[float, float]:
    """The same shares under Zipf(``zipf``) with Poisson sampling of k facts, ``questions`` draws."""
    pi = inclusion_probabilities(facts, k, zipf)
    shares = [top_shares((rng.random((questions, facts)) < pi).sum(axis=0)) for _ in range(repeats)]
    return tuple(np.mean(shares, axis=0))


def page(data: Path, ks: tuple[int, ...]) -> str:
    rng = np.random.default_rng(0)
    found = measured(data, ks)
    lines = ["# How unevenly a user's facts are retrieved (LoCoMo)", "",
             "Dense top-k retrieval of each LoCoMo question over its conversation's facts (all-MiniLM-L6-v2); "
             "shares of the retrievals that went to the most retrieved 10% and 50% of a conversation's facts, "
             "mean over the 10 conversations; then the same under the fleet simulator's Zipf(s) model with the "
             "same facts and questions.", "",
             "```bash", "python scripts/fleet_fact_popularity.py --out docs/results/fleet/fact_popularity.md", "```", ""]
    for k in ks:
        rows = found[k]
        top10, top50 = np.mean([r[2] for r in rows]), np.mean([r[3] for r in rows])
        table = [["LoCoMo, measured", f"{100 * top10:.1f}%", f"{100 * top50:.1f}%", ""]]
        best = None
        for s in EXPONENTS:
            sims = [simulated(r[0], r[1], k, s, rng) for r in rows]
            s10, s50 = np.mean([x[0] for x in sims]), np.mean([x[1] for x in sims])
            miss = abs(s10 - top10) + abs(s50 - top50)
            best = (miss, s) if best is None or miss < best[0] else best
            table.append([f"Zipf {s}", f"{100 * s10:.1f}%", f"{100 * s50:.1f}%", f"{100 * miss:.1f}"])
        lines += [f"## k = {k}", "", markdown_table(["popularity", "top 10% of facts", "top 50% of facts",
                                                     "distance (points)"], table), "",
                  f"Closest: **Zipf {best[1]}**.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo10.json"))
    parser.add_argument("--k", default="10,50", help="facts retrieved per question, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the page here")
    args = parser.parse_args()
    if not args.data.is_file():
        parser.error(f"--data {args.data} is not a file: give LoCoMo's locomo10.json")
    print_page(page(args.data, tuple(int(k) for k in args.k.split(","))), args.out)


if __name__ == "__main__":
    main()
