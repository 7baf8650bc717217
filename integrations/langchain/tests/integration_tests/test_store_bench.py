"""``inferscale bench store`` (issue 54): LangGraph's batch mix on InferScaleStore, InMemoryStore and
PostgresStore (on the PostgreSQL the test starts), in one run, its JSON, page and plot written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from langgraph.store.base import GetOp, ListNamespacesOp, PutOp, SearchOp


def test_the_mix_is_langgraphs_six_ops_an_item():
    from langchain_inferscale.bench_store import mix

    ops = mix(3)
    assert [type(op) for op in ops[:6]] == [PutOp, GetOp, ListNamespacesOp, SearchOp, PutOp, PutOp]
    assert len(ops) == 18 and ops[5].value is None  # the sixth deletes


def test_the_cli_measures_three_stores_at_each_batch_size(tmp_path, postgres_url):
    out = tmp_path / "store"
    cli = Path(sys.executable).with_name("inferscale")
    done = subprocess.run([str(cli), "bench", "store", "--out", str(out), "--items", "40", "--batch-sizes",
                           "1,10,1000", "--postgres-url", postgres_url], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "store.json").read_text())
    cells = {(c["store"], c["batch"]): c for c in summary["cells"]}
    assert set(cells) == {(s, b) for s in ("InferScaleStore", "InMemoryStore", "PostgresStore") for b in (1, 10, 1000)}
    assert all(c["ops"] == 240 and c["ops_per_s"] > 0 for c in cells.values())
    assert set(summary["ratios"]) == {"InMemoryStore", "PostgresStore"}
    assert summary["machine"]["cores"] and summary["machine"]["commit"]
    page = (out / "store.md").read_text()
    assert "| PostgresStore |" in page and "1,000 ops a batch" in page and "Reproduce" in page
    assert (out / "store.png").stat().st_size > 1000
    refused = subprocess.run([str(cli), "bench", "store", "--out", str(tmp_path / "x"), "--batch-sizes", "0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "at least 1" in refused.stderr and not (tmp_path / "x").exists()
