"""What the per-scope version check costs a read (issue 14): ``HistoryLog.scope_version``
timed against a plain SQLite history, side by side with the search it precedes.

    .venv/bin/python scripts/scope_version_cost.py [--events 10000] [--scopes 50]

Prints microseconds per call (median of 5 runs of 2,000 calls each).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from inferscale.store.history import HistoryLog
from inferscale.store.sql import Database


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000, help="history events in the database")
    parser.add_argument("--scopes", type=int, default=50, help="scopes they are spread over")
    args = parser.parse_args()
    if args.events < 1 or args.scopes < 1:
        parser.error("--events and --scopes must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        history = HistoryLog(Database.sqlite_file(Path(tmp) / "history.sqlite"))
        per_scope = max(1, args.events // args.scopes)
        for s in range(args.scopes):
            history.record(f"scope{s}", [(f"m{i}", "ADD", None, "x") for i in range(per_scope)])
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                history.scope_version("scope7")
            runs.append((time.perf_counter() - start) / 2000 * 1e6)
        print(f"scope_version: {statistics.median(runs):.0f} us per call "
              f"({per_scope * args.scopes} events in {args.scopes} scopes, SQLite)")


if __name__ == "__main__":
    main()
