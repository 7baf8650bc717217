"""The benchmarks: resumable logs, and tiny real runs of every ``inferscale bench`` command.

Each command runs in a subprocess (as a user runs it) on the real model, vLLM and
LoCoMo, with one small store shared by the module. Timings are never asserted; what is
asserted is what the outputs mean (which tokens were prefilled, what was resumed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale.bench.common import ResultLog, percentile

CLI = [sys.executable, "-m", "inferscale.cli"]


def _bench(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([*CLI, "bench", *args], capture_output=True, text=True, env=env, timeout=1200)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- the result log


def test_result_log_keys_the_data_by_content_and_auto_by_the_dtype_it_means(tmp_path, locomo_path):
    """A committed run resumes from any checkout holding the same dataset (the path differs),
    not from another dataset; ``auto`` is recorded as what it means on this machine."""
    from inferscale.config import auto_dtype

    log = ResultLog(tmp_path / "r", "b", {"data": str(locomo_path), "dtype": "auto"})
    log.add("a", {"v": 1})
    kept = json.loads((tmp_path / "r" / "b.settings.json").read_text())
    assert kept["dtype"] == auto_dtype() and kept["data"].startswith("locomo10.json sha256:")
    assert str(locomo_path.parent) not in json.dumps(kept)
    moved = tmp_path / "elsewhere" / "locomo10.json"
    moved.parent.mkdir()
    moved.write_bytes(locomo_path.read_bytes())
    assert ResultLog(tmp_path / "r", "b", {"data": str(moved), "dtype": auto_dtype()}).done("a")
    moved.write_bytes(locomo_path.read_bytes().replace(b"Caroline", b"Carolyn", 1))
    with pytest.raises(ValueError, match="other settings \\(data\\)"):
        ResultLog(tmp_path / "r", "b", {"data": str(moved), "dtype": "auto"})
    other = "float32" if auto_dtype() == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match="other settings \\(dtype\\)"):
        ResultLog(tmp_path / "r", "b", {"data": str(locomo_path), "dtype": other})


def test_result_log_resumes_skips_cut_lines_and_refuses_other_settings(tmp_path):
    log = ResultLog(tmp_path, "b", {"ks": (1, 2)})
    log.add("a", {"v": 1})
    log.add("b", {"v": 2})
    with (tmp_path / "b.jsonl").open("a") as fh:
        fh.write('{"key": "c", "v"')  # a write cut short by a kill
    again = ResultLog(tmp_path, "b", {"ks": [1, 2]})
    assert again.done("a") and again.done("b") and not again.done("c")
    assert [r["v"] for r in again.all()] == [1, 2]

    before = (tmp_path / "b.jsonl").read_text()
    with pytest.raises(ValueError, match="other settings \\(ks\\).*--fresh"):
        ResultLog(tmp_path, "b", {"ks": [1, 2, 3]})
    assert (tmp_path / "b.jsonl").read_text() == before  # refused: nothing changed
    assert json.loads((tmp_path / "b.settings.json").read_text()) == {"ks": [1, 2]}

    fresh = ResultLog(tmp_path, "b", {"ks": [1, 2, 3]}, fresh=True)
    assert fresh.all() == []
    assert (tmp_path / "b.jsonl").read_text() == before  # nothing discarded before new work is done
    fresh.add("z", {"v": 9})
    assert [json.loads(x)["key"] for x in (tmp_path / "b.jsonl").read_text().splitlines()] == ["z"]
    assert json.loads((tmp_path / "b.settings.json").read_text()) == {"ks": [1, 2, 3]}

    cut = ResultLog(tmp_path / "cut", "b", {"ks": [1]})
    assert not (tmp_path / "cut").exists()  # a log that never finished any work writes nothing
    cut.add("a", {"v": 1})
    with (tmp_path / "cut" / "b.jsonl").open("a") as fh:
        fh.write('{"key": "b", "v"')
    resumed = ResultLog(tmp_path / "cut", "b", {"ks": [1]})
    resumed.add("b", {"v": 2})  # the cut row is trimmed before the new one is appended
    assert [json.loads(x)["v"] for x in (tmp_path / "cut" / "b.jsonl").read_text().splitlines()] == [1, 2]


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-store")


@pytest.fixture(scope="module")
def latency_run(tmp_path_factory, store, locomo_path):
    out = tmp_path_factory.mktemp("latency")
    args = ["latency", "--data", str(locomo_path), "--out", str(out), "--store", str(store), "--questions", "2",
            "--k", "0,5", "--modes", "text,inject-w0"]
    first = _bench(*args)
    return out, args, first


def test_latency_writes_json_md_png_and_injects(latency_run):
    out, _args, first = latency_run
    summary = json.loads((out / "latency.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(summary["machine"])
    cells = {(c["mode"], c["k"]): c for c in summary["cells"]}
    assert set(cells) == {("text", 0), ("text", 5), ("inject-w0", 0), ("inject-w0", 5)}
    assert all(c["n"] == 2 for c in cells.values())
    # same prompt in both modes; inject prefills only the question
    assert cells[("text", 5)]["prompt_tokens_mean"] == cells[("inject-w0", 5)]["prompt_tokens_mean"]
    assert cells[("text", 5)]["prefilled_tokens_mean"] == cells[("text", 5)]["prompt_tokens_mean"]
    assert cells[("inject-w0", 5)]["prefilled_tokens_mean"] < cells[("text", 5)]["prompt_tokens_mean"] - 100
    assert "text k=5 / inject-w0 k=5" in summary["ttft_median_ratios"]
    assert (out / "latency.png").stat().st_size > 10_000
    assert "| inject-w0 | 5 | 2 |" in (out / "latency.md").read_text()
    assert "Latency: TTFT vs k" in first.stdout


def test_latency_resumes_without_redoing_finished_work(latency_run):
    out, args, _first = latency_run
    log = out / "latency.jsonl"
    rows = _rows(log)
    assert len(rows) == 8
    kept, lost = rows[:5], rows[5:]
    log.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"key": "text|k=5|q=1", "ttft')  # killed mid-write
    _bench(*args)
    after = _rows_tolerant(log)
    assert [r for r in after if r["key"] in {k["key"] for k in kept}] == kept  # finished work untouched
    assert sorted(r["key"] for r in after) == sorted(r["key"] for r in rows)  # the lost work, and only it, redone
    assert len(after) == 8
    assert {r["key"] for r in after[5:]} == {r["key"] for r in lost}


def _rows_tolerant(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_latency_refuses_other_settings_in_the_same_folder(latency_run):
    out, args, _ = latency_run
    before = (out / "latency.jsonl").read_text()
    proc = _bench(*[a if a != "0,5" else "0,5,10" for a in args], check=False)
    assert proc.returncode == 2
    assert "other settings" in proc.stderr and "--fresh" in proc.stderr
    assert (out / "latency.jsonl").read_text() == before


def test_quality_pairs_text_encoded_and_captured_kv_on_the_same_answers(tmp_path, store, locomo_path, latency_run):
    _bench("quality", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--tuning", "0",
           "--held-out", "1", "--tuning-questions", "1", "--questions", "2", "--k", "5",
           "--modes", "inject-w0,captured", "--max-tokens", "4", "--capture-traffic", "12")
    rows = _rows(tmp_path / "quality.jsonl")
    answers = [r for r in rows if "seconds" in r]
    assert sorted(r["split"] for r in answers) == ["held_out", "held_out", "tuning"]
    for r in answers:
        for mode in ("text", "inject-w0", "captured"):  # text is always scored: every comparison is against it
            assert r[mode]["nll"] > 0 and 0.0 <= r[mode]["f1"] <= 1.0 and r[mode]["memories"] == 5
        assert r["text"]["injected_tokens"] == 0 and r["inject-w0"]["kv_memories"] == 5
        assert r["inject-w0"]["injected_tokens"] > 0
    traffic = [r for r in rows if "traffic_questions" in r]
    assert [t["traffic_questions"] for t in traffic] == [12, 12] and all(t["captured"] > 0 for t in traffic)  # the other questions' memories captured
    assert sum(r["captured"]["kv_memories"] for r in answers) > 0  # served from what that traffic captured
    summary = json.loads((tmp_path / "quality.json").read_text())
    cell = {(c["split"], c["mode"]): c for c in summary["cells"]}
    held = cell[("held_out", "captured")]
    assert held["n"] == 2 and held["nll_change_ci"][0] <= held["nll_change"] <= held["nll_change_ci"][1]
    assert 0 < held["kv_share"] <= 1 and cell[("held_out", "inject-w0")]["kv_share"] == 1
    assert "## Held out, k = 5" in (tmp_path / "quality.md").read_text()
    assert (tmp_path / "quality.png").stat().st_size > 10_000


def test_latency_serves_a_storage_dtype_beside_the_model_dtype(tmp_path, store, locomo_path, latency_run):
    _bench("latency", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--questions", "1",
           "--k", "5", "--modes", "inject-w0,inject-w0-int4")
    summary = json.loads((tmp_path / "latency.json").read_text())
    cells = {(c["mode"], c["k"]): c for c in summary["cells"]}
    assert set(cells) == {("inject-w0", 5), ("inject-w0-int4", 5)}
    assert cells[("inject-w0-int4", 5)]["prefilled_tokens_mean"] == cells[("inject-w0", 5)]["prefilled_tokens_mean"]
    assert "inject-w0-int4 k=5 / inject-w0 k=5" in summary["ttft_median_ratios"]


def test_kv_storage_bench_pairs_the_three_storage_dtypes(tmp_path, store, locomo_path, latency_run):
    _bench("kv-storage", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--tuning", "0",
           "--held-out", "1", "--tuning-questions", "1", "--questions", "2", "--k", "5", "--context-window", "0",
           "--max-tokens", "4")
    rows = _rows(tmp_path / "kv_storage.jsonl")
    assert sorted(r["split"] for r in rows) == ["held_out", "held_out", "tuning"]
    for r in rows:
        injected = {r[s]["injected_tokens"] for s in ("auto", "int8", "int4")}
        assert len(injected) == 1 and injected.pop() > 0  # the same facts, all injected, in every storage dtype
        assert all(r[s]["nll"] > 0 and 0 <= r[s]["f1"] <= 1 for s in ("auto", "int8", "int4"))
    summary = json.loads((tmp_path / "kv_storage.json").read_text())
    held = next(c for c in summary["cells"] if c["split"] == "held_out")
    assert held["n"] == 2
    for s in ("int8", "int4"):
        lo, hi = held[s]["nll_change_ci"]
        assert lo <= held[s]["nll_change"] <= hi
    b = summary["bytes"]
    assert b["int4"]["vs_bf16"] < b["int8"]["vs_bf16"] < 0.6 and b["int4"]["vs_bf16"] < 0.35
    assert "## Held out" in (tmp_path / "kv_storage.md").read_text()


def test_throughput_on_the_async_engine(tmp_path, store, locomo_path):
    _bench("throughput", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--users", "1,2",
           "--facts-per-user", "8", "--requests-per-user", "1", "--k", "5", "--max-tokens", "4")
    summary = json.loads((tmp_path / "throughput.json").read_text())
    cells = {(c["mode"], c["users"]): c for c in summary["cells"]}
    assert set(cells) == {("inject", 1), ("inject", 2), ("text", 1), ("text", 2)}
    for (mode, users), c in cells.items():
        assert c["requests"] == users and c["requests_per_s"] > 0
        assert 0 < c["output_tokens_mean"] <= 4
    assert cells[("inject", 2)]["prefilled_tokens_mean"] < cells[("text", 2)]["prefilled_tokens_mean"]
    assert (tmp_path / "throughput.png").stat().st_size > 10_000


def test_serve_bench_through_http(tmp_path, store, locomo_path):
    """``bench serve`` starts ``inferscale serve`` on the store and drives it with the openai client."""
    _bench("serve", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--users", "1,2",
           "--facts-per-user", "8", "--requests-per-user", "1", "--k", "5", "--max-tokens", "4")
    summary = json.loads((tmp_path / "serve.json").read_text())
    cells = {(c["mode"], c["users"]): c for c in summary["cells"]}
    assert set(cells) == {("inject", 1), ("inject", 2), ("text", 1), ("text", 2)}
    for (mode, users), c in cells.items():
        assert c["requests"] == users and c["requests_per_s"] > 0 and c["ttft_p50_ms"] > 0
        assert c["output_tokens_mean"] == 4  # --fixed-length (the default): every answer is --max-tokens long
    assert cells[("inject", 2)]["kv_tokens_mean"] > 0 and cells[("text", 2)]["kv_tokens_mean"] == 0
    assert set(summary["inject_over_text_requests_per_s"]) == {"1", "2"}
    assert (tmp_path / "serve.png").stat().st_size > 10_000


def test_footprint_formula_matches_the_stored_kv(tmp_path, store, locomo_path, latency_run):
    _bench("footprint", "--data", str(locomo_path), "--out", str(tmp_path), "--store", str(store), "--samples", "0",
           "--budgets-mib", "1024,4")
    s = json.loads((tmp_path / "footprint.json").read_text())
    from transformers import AutoConfig

    from inferscale.models.resolve import resolve_llm

    cfg = AutoConfig.from_pretrained(str(resolve_llm()))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    from inferscale.config import auto_dtype

    width = {"float32": 4, "bfloat16": 2}[auto_dtype()]  # the store's dtype is auto: fp32, or bf16 with AMX
    assert s["dtype"] == auto_dtype()
    assert s["bytes_per_token"] == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * width
    assert s["stored_files"] > 0 and s["stored_files_matching_formula"] == s["stored_files"]
    (conv,) = s["conversations"]
    assert conv["sample"] == "conv-26" and conv["kv_bytes"] == conv["fact_tokens"] * s["bytes_per_token"]
    # issue 30's budget per LoCoMo fact, scales included: int8 <= 0.55x and int4 <= 0.30x of bf16 KV
    per_fact = s["storage_bytes_per_fact_mean"]
    assert per_fact["int8"] <= 0.55 * per_fact["bfloat16"] and per_fact["int4"] <= 0.30 * per_fact["bfloat16"]
    assert conv["storage_mib"]["bfloat16"] * width / 2 == pytest.approx(conv["kv_mib"])
    big, tiny = s["split"]
    assert big["device_mib"] == pytest.approx(big["disk_mib"], rel=0.01)  # everything fits the device tier
    assert 0 < tiny["device_mib"] <= 4.0 < tiny["disk_mib"]  # LRU keeps to the budget; every fact stays on disk


def test_report_fills_the_readme_section_from_the_summaries(tmp_path):
    from inferscale.bench import latency, report

    rows = [{"mode": m, "k": k, "ttft_s": t, "retrieval_s": 0.01, "e2e_s": t + 0.01, "prompt_tokens": 30 + 25 * k,
             "prefilled_tokens": 30 + 25 * k if m == "text" else 20}
            for m, per_k in (("text", {0: 0.1, 50: 2.0}), ("inject-w20", {0: 0.1, 50: 0.125})) for k, t in per_k.items()]
    summary = latency.summarize(rows, [0, 50], ["text", "inject-w20"])
    summary["settings"] = {"questions": 1}
    (tmp_path / "latency").mkdir()
    (tmp_path / "latency" / "latency.json").write_text(json.dumps(
        {"machine": {"cpu": "test cpu", "cores": 2, "torch": "x", "gpu": None, "vllm": "y"}, **summary}))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    with pytest.raises(ValueError, match="bench-results"):
        report.update_readme(readme, tmp_path)
    assert readme.read_text() == "intro\n"
    readme.write_text(f"intro\n{report.START}\nold\n{report.END}\noutro\n")
    report.update_readme(readme, tmp_path)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "**1.25x**" in text and "**16.00x**" in text and "test cpu" in text
    # a benchmark run on another machine: every row names its own
    (tmp_path / "footprint").mkdir()
    (tmp_path / "footprint" / "footprint.json").write_text(json.dumps(
        {"machine": {"cpu": "other cpu", "cores": 4, "torch": "x", "gpu": None, "vllm": "y"}, "dtype": "float32",
         "bytes_per_fact_mean": 2048, "conversations": [{"kv_mib": 1.0}]}))
    report.update_readme(readme, tmp_path)
    lines = readme.read_text().splitlines()
    assert any("several machines" in line for line in lines)
    assert any(line.startswith("| TTFT") and line.endswith("| test cpu, 2 cores, no GPU |") for line in lines)
    assert any(line.startswith("| KV per fact") and line.endswith("| other cpu, 4 cores, no GPU |") for line in lines)


# ---------------------------------------------------------------- synthetic stores

def test_synthetic_store_grows_and_reopens_lazily(tmp_path):
    from inferscale.bench.store_scale import BIG_SCOPE, probe, write_synthetic

    assert write_synthetic(tmp_path, 250, big=200) == 250
    assert write_synthetic(tmp_path, 350, big=200) == 100  # grows, keeps what is there
    res = probe(tmp_path)  # a fresh process reopens the store and searches it
    assert res["facts"] == 350
    assert res["reopen_s"] > 0 and res["rss_after_reopen_bytes"] > 0
    assert any(k.startswith("filtered search big scope") for k in res)
    with pytest.raises(ValueError, match="at least the big scope"):
        write_synthetic(tmp_path, 10, big=200)
    from inferscale import Memory

    mem = Memory(data_dir=tmp_path, dtype="float32", precompute_kv=False)
    assert mem.count(user_id=BIG_SCOPE) == 200 and mem.count(user_id="synthetic-0") == 100 and mem.count(user_id="synthetic-1") == 50
    topic3 = mem.get_all(user_id=BIG_SCOPE, filters={"topic": "t3"}, limit=1000)["results"]
    assert len(topic3) == 20 and all(r["metadata"]["topic"] == "t3" for r in topic3)
    mem.close()


# ---------------------------------------------------------------- retrieval

def test_retrieval_bench_compares_dense_and_hybrid_on_held_out_conversations(tmp_path, locomo_path):
    """Four LoCoMo conversations (0-2 tune the fusion, the fourth is held out), a small big scope."""
    data = tmp_path / "locomo4.json"
    data.write_text(json.dumps(json.loads(locomo_path.read_text())[:4]))
    out = tmp_path / "retrieval"
    proc = _bench("retrieval", "--data", str(data), "--out", str(out), "--big", "500", "--latency-queries", "3",
                  "--repeats", "1")
    result = json.loads((out / "retrieval.json").read_text())
    assert (out / "retrieval.png").stat().st_size > 0 and "held out" in proc.stdout
    held = result["held_out"]
    assert len(held["conversations"]) == 1 and result["tuning"]["conversations"][0] == "conv-26"
    for mode in ("dense", "hybrid-fact", "hybrid-source", "hybrid-turns", "hybrid"):
        recall = [held[f"recall_{mode}"][str(k)] for k in result["ks"]]
        hit = [held[f"hit_{mode}"][str(k)] for k in result["ks"]]
        assert recall == sorted(recall) and all(0 <= r <= h <= 1 for r, h in zip(recall, hit))  # grow with k
    assert held["recall_hybrid"]["100"] >= held["recall_dense"]["10"]
    assert 0 < held["questions_1_4"] < held["questions"] and 0 <= held["recall_hybrid_1_4"]["10"] <= 1
    # the fact's source turns in BM25 (keyword_turns, the default) find more evidence on this conversation
    assert held["recall_hybrid-turns"]["10"] > held["recall_hybrid-source"]["10"] > held["recall_hybrid-fact"]["10"]
    # ... and so do the turn before each source turn and the turn-neighbour bonus; the bonus
    # settings tried on the tuning conversations are reported, the one in use among them
    neighbours = result["tuning"]["neighbors_recall_at_10"]
    assert result["tuning"]["neighbors_used"] in neighbours and len(neighbours) == 12
    assert set(result["latency_ms"]) == {"one conversation", "250 facts", "500 facts"}
    # the index alone, unfiltered (half the big scope, then all) and filtered on the big scope's
    # metadata; the query's embedding apart
    assert set(result["index_latency_ms"]) == {"250 facts", "500 facts", "500 facts, filter topic == t3 (10%)"}
    assert result["embed_query_ms"] > 0 and all(row["hybrid"] > 0 for row in result["index_latency_ms"].values())
    # the ceiling bounds every ranking's recall; each interval holds its mean; the paired
    # difference of hybrid and dense is the difference of their means
    iv = result["intervals_1_4"]
    assert iv["questions"] == held["questions_1_4"] and iv["ceiling_ci"][0] <= iv["ceiling"] <= iv["ceiling_ci"][1]
    assert iv["hybrid"]["recall_at_10"] == pytest.approx(held["recall_hybrid_1_4"]["10"])
    for mode in ("dense", "hybrid-fact", "hybrid-source", "hybrid-turns", "hybrid"):
        row = iv[mode]
        assert held[f"recall_{mode}_1_4"]["100"] <= iv["ceiling"] and row["ci"][0] <= row["recall_at_10"] <= row["ci"][1]
    assert iv["dense"]["hybrid_minus"] == pytest.approx(iv["hybrid"]["recall_at_10"] - iv["dense"]["recall_at_10"])
    page = (out / "retrieval.md").read_text()
    assert "Ceiling" in page and "0.632" in page and "The index's search alone" in page
    assert not (out / "retrieval-store").exists()  # its own store is deleted


def test_tiers_replay_keeps_each_budget_and_serves_what_it_evicted_as_text(tmp_path, locomo_path):
    """``inferscale bench tiers`` on one user, misses encoded while idle and captured: the
    unbounded pool serves every retrieved fact as KV; at 25% of the pool the disk holds to its
    budget (plus one fact) and some memories come as text, encoded again in one arm and kept
    from the questions' own prefill in the other; the page and plot are written."""
    from inferscale.bench.tiers import make_trace, run, user_weights

    weights = user_weights(3, 1.0)
    assert weights == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    trace = make_trace([5, 1, 2], 200, 1.0, seed=1)
    assert all(q < [5, 1, 2][u] for u, q in trace) and make_trace([5, 1, 2], 200, 1.0, seed=1) == trace
    assert sum(u == 0 for u, _ in trace) > sum(u == 2 for u, _ in trace)
    with pytest.raises(ValueError, match="budgets are shares"):
        run(locomo_path, tmp_path / "out", tmp_path / "store", budgets=(1.0, 0.0))
    with pytest.raises(ValueError, match="policies are some of"):
        run(locomo_path, tmp_path / "out", tmp_path / "store", policies=("fifo",))
    with pytest.raises(ValueError, match="encoders are some of"):
        run(locomo_path, tmp_path / "out", tmp_path / "store", encoders=("lazy",))
    summary = run(locomo_path, tmp_path / "out", tmp_path / "store", users=1, questions=14, warmup=4,
                  budgets=(1.0, 0.25), policies=("lrfu",), encoders=("idle", "capture"))
    assert [(c["policy"], c["encoder"], c["share"]) for c in summary["cells"]] == [
        ("lrfu", "idle", 1.0), ("lrfu", "idle", 0.25), ("lrfu", "capture", 1.0), ("lrfu", "capture", 0.25)]
    assert all(c["encode_s_per_100_questions"] >= 0 for c in summary["cells"])
    largest = max(p.stat().st_size for p in (tmp_path / "store" / "kv").glob("*/*.safetensors"))
    ceiling = summary["clairvoyant_kv_token_share"]
    assert ceiling["1"] == 1.0 and 0 < ceiling["0.25"] < 1.0
    for unbounded, quarter in (summary["cells"][:2], summary["cells"][2:]):
        assert unbounded["budget_bytes"] is None and unbounded["kv_token_share"] == 1.0
        assert unbounded["reencodes"] == 0 and unbounded["captured_served"] == 0
        assert quarter["budget_bytes"] == int(summary["full_pool_bytes"] * 0.25)
        assert quarter["evicted_at_open"] > 0 and quarter["kv_token_share"] < 1.0
        assert quarter["disk_bytes_end"] <= quarter["budget_bytes"] + largest
    idle, capture = summary["cells"][1], summary["cells"][3]
    assert idle["reencodes"] > 0 and idle["captured_served"] == 0  # misses encoded again
    assert capture["reencodes"] < idle["reencodes"]  # misses kept from the questions' own prefill instead
    assert "clairvoyant (Belady)" in (tmp_path / "out" / "tiers.md").read_text()
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"tiers.json", "tiers.md", "tiers.png"}


def test_belady_sizes_cover_facts_served_without_a_file():
    """A fact the unbounded replay served from memory but whose file was gone when the folder
    was measured gets the pool's mean bytes per token times its tokens, and is counted (the
    ceiling once raised KeyError at the end of a run)."""
    from inferscale.bench.tiers import _sizes_of_all

    sizes, estimated = _sizes_of_all([["a", "b"], ["c", "a"]], {"a": 10, "b": 30, "c": 5}, {"a": 100, "b": 300})
    assert sizes == {"a": 100, "b": 300, "c": 50} and estimated == 1
    assert _sizes_of_all([["a"]], {"a": 10}, {"a": 100}) == ({"a": 100}, 0)
