"""``inferscale bench store``: LangGraph's batch mix on ``InferScaleStore``, ``InMemoryStore`` and
``PostgresStore``, in one run, at several ops a batch (issue 54).

The mix is that of LangGraph's own ``test_large_batches`` (``langgraph-checkpoint-postgres``'s
``tests/test_async_store.py``): for each item, ``put``, ``get``, ``list_namespaces(max_depth)``,
``search(("test",))``, ``put`` again and ``delete``, over two namespaces. The ops are handed to
each store's ``batch`` in batches of B ops (B = 1: one call per op, as ``store.put`` makes;
B = 10,000: one call for many), the stores one after another on the same op list, each
started empty. The measure is ops a second (ops / wall-clock seconds of the ``batch`` calls).

Run: ``inferscale bench store --postgres-url postgresql://user@127.0.0.1:5432/db --out
docs/results/store`` (``python -m langchain_inferscale.bench_store`` takes the same options).
Without ``--postgres-url`` the PostgresStore arm is left out, and the page says so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from langgraph.store.base import BaseStore, GetOp, ListNamespacesOp, Op, PutOp, SearchOp
from langgraph.store.memory import InMemoryStore

from inferscale import Memory
from inferscale.integration import machine, write_outputs
from langchain_inferscale.store import InferScaleStore

#: ops a batch measured by default
BATCH_SIZES = (1, 100, 10_000)
#: the stores, in the page's order
STORES = ("InferScaleStore", "InMemoryStore", "PostgresStore")


def mix(items: int) -> list[Op]:
    """LangGraph's ``test_large_batches`` mix for ``items`` items: 6 ops an item.

    Raises:
        ValueError: ``items`` < 1.
    """
    if items < 1:
        raise ValueError(f"items must be at least 1, got {items}")
    ops: list[Op] = []
    for i in range(items):
        ns = ("test", "foo", "bar", "baz", str(i % 2))
        key, value = f"key{i % 100}", {"foo": f"bar{i}"}
        ops += [PutOp(ns, key, value), GetOp(ns, key), ListNamespacesOp(max_depth=i % 10 + 1),
                SearchOp(("test",)), PutOp(ns, key, value), PutOp(ns, key, None)]
    return ops


def ops_per_second(store: BaseStore, ops: Sequence[Op], batch: int) -> dict:
    """Run ``ops`` through ``store.batch`` ``batch`` ops at a time; ``{"ops", "seconds", "ops_per_s"}``."""
    t0 = time.perf_counter()
    for start in range(0, len(ops), batch):
        store.batch(ops[start:start + batch])
    seconds = time.perf_counter() - t0
    return {"ops": len(ops), "seconds": seconds, "ops_per_s": len(ops) / seconds}


@contextmanager
def _inferscale(folder: Path) -> Iterator[BaseStore]:
    with Memory(data_dir=folder, dtype="float32") as memory:
        yield InferScaleStore(memory)


@contextmanager
def _in_memory(_: Path) -> Iterator[BaseStore]:
    yield InMemoryStore()


def _postgres(url: str) -> Callable[[Path], object]:
    @contextmanager
    def open_store(_: Path) -> Iterator[BaseStore]:
        from langgraph.store.postgres import PostgresStore

        with PostgresStore.from_conn_string(url.replace("postgresql+psycopg://", "postgresql://", 1)) as store:
            store.setup()
            with store._cursor() as cur:  # every cell starts empty
                cur.execute("DELETE FROM store")
            yield store
    return open_store


def run(out: Path, *, postgres_url: str | None = None, items: int = 2000,
        batch_sizes: Sequence[int] = BATCH_SIZES) -> dict:
    """Measure every store at every batch size on ``mix(items)``; writes ``store.json``,
    ``store.md`` and ``store.png`` into ``out``; returns the summary.

    Raises:
        ValueError: ``items`` < 1 or a batch size < 1.
    """
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must each be at least 1, got {list(batch_sizes)}")
    ops = mix(items)
    opens = {"InferScaleStore": _inferscale, "InMemoryStore": _in_memory}
    if postgres_url:
        opens["PostgresStore"] = _postgres(postgres_url)
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        for name, open_store in opens.items():
            for batch in batch_sizes:
                with open_store(Path(tmp) / f"{name}-{batch}") as store:
                    cells.append({"store": name, "batch": batch, **ops_per_second(store, ops, batch)})
    summary = {"date": dt.date.today().isoformat(), "items": items, "ops": len(ops),
               "batch_sizes": list(batch_sizes), "postgres": bool(postgres_url), "cells": cells,
               "ratios": _ratios(cells)}
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, "store", summary, page(summary, machine()))
    plot(cells, out / "store.png")
    return summary


def _ratios(cells: list[dict]) -> dict:
    """InferScaleStore's ops a second over each other store's, per batch size."""
    rate = {(c["store"], c["batch"]): c["ops_per_s"] for c in cells}
    return {other: {str(b): rate[("InferScaleStore", b)] / rate[(other, b)]
                    for (s, b) in rate if s == other and ("InferScaleStore", b) in rate}
            for other in STORES[1:] if any(s == other for s, _ in rate)}


def page(summary: dict, where: dict) -> str:
    """The Markdown page of a run."""
    rows = ["| store | " + " | ".join(f"{b:,} op{'s' if b > 1 else ''} a batch" for b in summary["batch_sizes"])
            + " |", "|---|" + "---|" * len(summary["batch_sizes"])]
    rate = {(c["store"], c["batch"]): c["ops_per_s"] for c in summary["cells"]}
    for name in STORES:
        if any(s == name for s, _ in rate):
            rows.append(f"| {name} | " + " | ".join(f"{rate[(name, b)]:,.0f}" for b in summary["batch_sizes"]) + " |")
    ratio_rows = [f"- InferScaleStore / {other}: " + ", ".join(f"{r:.2g}x at {int(b):,}" for b, r in by.items())
                  for other, by in summary["ratios"].items()]
    missing = "" if summary["postgres"] else ("\nPostgresStore was not measured: the run had no "
                                               "`--postgres-url`.\n")
    return f"""# LangGraph stores: ops a second by batch size

{summary['date']}, {where.get('cpu')} ({where.get('cores')} cores), commit {where.get('commit')}.
LangGraph's `test_large_batches` mix (put, get, list_namespaces, search, put, delete for each of
{summary['items']:,} items: {summary['ops']:,} ops), handed to each store's `batch` B ops at a time;
each store starts empty. InferScaleStore is in-process over a `Memory` (float32, its defaults:
each put is embedded with all-MiniLM-L6-v2 and written to Chroma and the history; KV is queued
for the engine, which this run never starts); PostgresStore runs on the PostgreSQL the command
names, on the same machine. At one op a batch every put is a memory write of its own (an
embedding call, a Chroma write, a history transaction: tens of milliseconds on a CPU, where a
PostgreSQL row is a fraction of one); a batch shares them, and concurrent callers' batches are
joined into one (group commit), so the larger batches are where a store's callers meet it.
{missing}
Ops a second (higher is better):

{chr(10).join(rows)}

{chr(10).join(ratio_rows)}

Reproduce: `inferscale bench store --postgres-url postgresql://USER@127.0.0.1:PORT/DB --items {summary['items']}
--out docs/results/store`. One run, one process; these machines are noisy: read the ratios.
"""


def plot(cells: list[dict], path: Path) -> None:
    """Ops a second against batch size, one line per store (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in STORES:
        mine = sorted((c["batch"], c["ops_per_s"]) for c in cells if c["store"] == name)
        if mine:
            ax.plot([b for b, _ in mine], [r for _, r in mine], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops a batch")
    ax.set_ylabel("ops a second")
    ax.set_title("LangGraph's batch mix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m langchain_inferscale.bench_store``: the options of ``inferscale bench store``."""
    parser = argparse.ArgumentParser(prog="inferscale bench store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/store"), help="results folder")
    parser.add_argument("--postgres-url", default=None, help="a PostgreSQL database for PostgresStore (its "
                        "store tables are created there and emptied; libpq's postgresql:// URL, or SQLAlchemy's "
                        "postgresql+psycopg://); without it, that arm is left out")
    parser.add_argument("--items", type=int, default=2000, help="items of the mix (6 ops each)")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), help="ops a batch, comma-separated")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
        summary = run(args.out, postgres_url=args.postgres_url, items=args.items, batch_sizes=sizes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
