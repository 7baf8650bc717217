"""Component behaviour: KV pool, vector index, prompt scaffold, LoCoMo loader, config, models."""

import json
import threading

import pytest
import torch

from inferscale.config import MemoryConfig, cache_dir
from inferscale.datasets.locomo import LocomoFormatError, load_locomo, token_f1
from inferscale.store.filters import compile_filter
from inferscale.store.index import VectorIndex
from inferscale.kv.pool import FactKV, KVPool, kv_key, validate_key
from inferscale.models.resolve import ModelNotFoundError, model_fingerprint, resolve_llm
from inferscale.kv.injection import InjectionPlan
from inferscale.generation.prompt import PromptBuilder
from inferscale.store.records import FactRecord, Scope

def kv(tokens: int, fill: float = 1.0) -> FactKV:
    return FactKV(torch.full((2, tokens, 3, 4), fill), torch.full((2, tokens, 3, 4), -fill))


# ---------------------------------------------------------------- KV pool

def test_pool_round_trips_through_disk_and_device(tmp_path):
    pool = KVPool(tmp_path, "cpu", device_budget_bytes=1 << 20)
    key = kv_key("fact1", fp="abc", w=0)
    pool.put(key, kv(5, 2.0))
    fresh = KVPool(tmp_path, "cpu", device_budget_bytes=1 << 20)  # a restarted process
    got = fresh.get(key)
    assert torch.equal(got.keys, kv(5, 2.0).keys) and torch.equal(got.values, kv(5, 2.0).values)
    assert fresh.stats["disk_hits"] == 1
    fresh.get(key)
    assert fresh.stats["device_hits"] == 1
    assert not list(tmp_path.rglob(".tmp-*"))  # atomic writes leave no temporaries


def test_pool_device_tier_respects_its_budget(tmp_path):
    one = kv(10).nbytes
    pool = KVPool(tmp_path, "cpu", device_budget_bytes=2 * one)
    keys = [kv_key(f"f{i}", n=i) for i in range(4)]
    for key in keys:
        pool.put(key, kv(10))
    assert pool.footprint()["device"] <= 2 * one
    assert pool.footprint()["disk"] >= 4 * one
    assert all(pool.contains(k) for k in keys)  # evicted from the device, still on disk


def test_pool_invalidates_every_variant_of_a_fact(tmp_path):
    pool = KVPool(tmp_path, "cpu", 1 << 20)
    a, b, other = kv_key("f1", w=0), kv_key("f1", w=5), kv_key("f2", w=0)
    for key in (a, b, other):
        pool.put(key, kv(3))
    pool.invalidate_owner("f1")
    assert not pool.contains(a) and not pool.contains(b) and pool.get(a) is None
    assert pool.contains(other)


@pytest.mark.parametrize("bad", ["../etc/passwd", "f1/../../x", "f1/" + "g" * 32, "f1", "", "a b/" + "0" * 32])
def test_malformed_kv_keys_are_rejected(bad):
    with pytest.raises(ValueError, match="malformed"):
        validate_key(bad)


def test_injection_plan_rejects_gaps():
    good = {"inferscale": {"memory_end": 7, "segments": [[kv_key("_preamble", a=1), 0, 3], [kv_key("f", a=1), 3, 4]]}}
    assert InjectionPlan.from_params(good).memory_end == 7
    gap = {"inferscale": {"memory_end": 8, "segments": [[kv_key("_preamble", a=1), 0, 3], [kv_key("f", a=1), 4, 4]]}}
    with pytest.raises(ValueError, match="continue"):
        InjectionPlan.from_params(gap)
    assert InjectionPlan.from_params({"other": 1}) is None


# ---------------------------------------------------------------- index

def _records(prefix: str, n: int, start: int = 0, **metadata) -> list[FactRecord]:
    return [FactRecord(f"{prefix}{i}", f"text {i}", "h", Scope(prefix), metadata=dict(metadata, n=i))
            for i in range(start, start + n)]


def test_index_top_k_is_exact_and_partitioned():
    torch.manual_seed(0)
    index = VectorIndex("cpu")
    a, b = torch.randn(300, 16), torch.randn(50, 16)
    index.add("A", _records("a", 150), a[:150])
    index.add("A", _records("a", 150, start=150), a[150:])  # grows past its capacity
    index.add("B", _records("b", 50), b)
    q = torch.randn(16)
    expected = torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(q, dim=0)
    top = torch.topk(expected, 10)
    got = index.search("A", q, 10)
    assert [g[0].id for g in got] == [f"a{i}" for i in top.indices.tolist()]
    assert all(g[0].id.startswith("b") for g in index.search("B", q, 100))
    index.remove("A", {got[0][0].id})
    assert got[0][0].id not in [g[0].id for g in index.search("A", q, 10)]
    # a filter is a mask inside the partition: top-k among the matching rows only
    even = index.search("A", q, 5, where=compile_filter({"n": {"in": list(range(0, 300, 2))}}))
    removed = int(top.indices[0])
    best_even = sorted((i for i in range(0, 300, 2) if i != removed), key=lambda i: -float(expected[i]))[:5]
    assert [g[0].id for g in even] == [f"a{i}" for i in best_even]
    # adding an id that is already there replaces its row (a load racing a write)
    index.add("B", _records("b", 1), a[:1])
    assert index.size("B") == 50 and index.search("B", a[0], 1)[0][0].id == "b0"
    with pytest.raises(ValueError, match="dimension"):
        index.add("C", _records("c", 1), torch.randn(1, 8))


def test_index_rows_stay_float32_while_a_bf16_model_loads_in_another_thread():
    """transformers sets torch's process-wide default dtype while it loads a bf16 model (the
    KV encoder's background thread in a server worker); a partition that grew then was
    allocated in bf16 and every later search of the scope failed (found by the visibility
    benchmark: ``addmv ... Float, BFloat16``). The state is set here as that load sets it."""
    torch.manual_seed(0)
    index = VectorIndex("cpu")
    emb = torch.randn(40, 16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what modeling_utils does for the load's length
    try:
        index.add("A", _records("a", 20), emb[:20])
        index.add("A", _records("a", 20, start=20), emb[20:])  # grows past its capacity
    finally:
        torch.set_default_dtype(previous)
    got = index.search("A", emb[33], 1)
    assert got[0][0].id == "a33" and got[0][1] == pytest.approx(1.0, abs=1e-6)  # exact: no bf16 rounding


def test_a_scope_past_chromas_variable_limit_loads_lists_and_catches_up(tmp_path):
    """Chroma's SQLite refuses a read of more than 32,766 ids in one query (found by the
    breaker: such a scope could not be loaded, and a catch-up on that many ids failed on
    every read); the store reads in chunks of ``IDS_PER_READ``."""
    import uuid

    import numpy as np

    from inferscale.store.chroma import IDS_PER_READ, FactStore

    store = FactStore(tmp_path / "chroma")
    scope, other = Scope("big"), Scope("other")
    n = 33_000
    assert n > 32_766 > IDS_PER_READ
    records = [FactRecord(uuid.uuid4().hex, f"fact {i}", f"h{i}", scope, (), {}, f"t{i:06d}", "t") for i in range(n)]
    emb = np.random.default_rng(0).standard_normal((n, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)  # unit vectors, as the embedder's (Chroma's cosine space)
    for i in range(0, n, 5000):
        store.add(records[i: i + 5000], emb[i: i + 5000])
    store.add([FactRecord("x1", "other fact", "hx", other, (), {}, "t", "t")], emb[:1])
    loaded, vectors = store.load_scope(scope.key)
    by_id = {r.id: j for j, r in enumerate(records)}
    assert len(loaded) == n and vectors.shape == (n, 8)
    assert all(np.allclose(vectors[j], emb[by_id[loaded[j].id]], atol=1e-6) for j in range(0, n, 997))
    assert [r.id for r in store.list(scope)] == [r.id for r in records]  # oldest first
    ids = [r.id for r in records[::-1]] + ["x1", "gone"]
    fetched, vectors = store.fetch(scope.key, ids)  # the other scope's and an absent id left out
    assert {r.id for r in fetched} == set(by_id) and vectors.shape == (n, 8)
    assert all(np.allclose(vectors[j], emb[by_id[fetched[j].id]], atol=1e-6) for j in range(0, n, 997))
    assert store.load_scope(other.key)[0][0].id == "x1" and store.fetch(scope.key, ["gone"])[0] == []
    gone = [f"gone{i}" for i in range(IDS_PER_READ)]  # a whole chunk of deleted ids, then rows
    fetched, vectors = store.fetch(scope.key, gone + [r.id for r in records[:5]])
    assert [r.id for r in fetched] == [r.id for r in records[:5]] and vectors.shape == (5, 8)


def test_a_load_racing_clear_is_discarded():
    """A partition loaded from what a concurrent clear() deleted is not published."""
    started, release = threading.Event(), threading.Event()
    stored = {"A": _records("A", 5)}

    def loader(scope):
        records = list(stored.get(scope, []))  # read before the clear
        started.set()
        release.wait(5)
        return (records, torch.randn(len(records), 8).numpy()) if records else ([], None)

    index = VectorIndex("cpu", loader=loader)
    reader = threading.Thread(target=index.size, args=("A",))
    reader.start()
    assert started.wait(5)
    stored.clear()  # reset(): the store is emptied, then the index cleared
    index.clear()
    release.set()
    reader.join(5)
    assert index.size("A") == 0 and index.records("A") == []


def test_index_partitions_load_on_first_use():
    torch.manual_seed(0)
    emb = torch.randn(20, 8)
    calls = []

    def loader(scope):
        calls.append(scope)
        return (_records(scope, 20), emb.numpy()) if scope == "A" else ([], None)

    index = VectorIndex("cpu", loader=loader)
    assert calls == [] and not index.loaded("A")
    assert index.size("A") == 20 and calls == ["A"]
    index.add("A", _records("A", 1, start=20), torch.randn(1, 8))
    assert index.size("A") == 21 and calls == ["A"]  # loaded once
    assert index.size("Z") == 0 and calls == ["A", "Z"]


# ---------------------------------------------------------------- prompt

def test_prompt_segments_tile_the_memory_block(tokenizer):
    builder = PromptBuilder(tokenizer, "Be brief.")
    layout = builder.build("What is my dog's name?", [("f1", "Alice has a dog named Rex."), ("f2", "Alice lives in Paris.")])
    assert layout.segments[0].owner == "_preamble" and layout.segments[0].start == 0
    for prev, nxt in zip(layout.segments, layout.segments[1:]):
        assert nxt.start == prev.end
    ids = layout.token_ids
    for seg in layout.segments:
        assert ids[seg.start : seg.end] == seg.token_ids
    text = tokenizer.decode(ids)
    assert text.index("Rex") < text.index("Paris") < text.index("What is my dog's name?")
    assert text.rstrip().endswith("assistant")


# ---------------------------------------------------------------- LoCoMo

def test_locomo_loader_reads_the_real_file(locomo_path):
    samples = load_locomo(locomo_path)
    assert len(samples) == 10
    assert sum(len(s.turns) for s in samples) == 5882
    assert sum(len(s.qa) for s in samples) == 1986
    assert sum(len(s.facts) for s in samples) == 2541
    first = samples[0]
    turn_ids = {t.dia_id for t in first.turns}
    assert all(set(f.dia_ids) <= turn_ids for f in first.facts)
    assert {q.category for q in first.qa} <= {1, 2, 3, 4, 5}


def test_locomo_f1_follows_its_evaluation():
    assert token_f1("The Paintings!", "painting") == 1.0
    assert token_f1("7 May 2023", "7 May, 2023") == 1.0
    assert token_f1("nothing in common", "Paris") == 0.0


def test_not_locomo_data_is_rejected(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"sample_id": "x", "conversation": {}}]))
    with pytest.raises(LocomoFormatError, match="not LoCoMo"):
        load_locomo(bad)
    bad.write_text("not json")
    with pytest.raises(LocomoFormatError, match="not JSON"):
        load_locomo(bad)
    with pytest.raises(FileNotFoundError, match="--data"):
        load_locomo(tmp_path / "missing.json")


# ---------------------------------------------------------------- config and models

def test_config_reads_environment_and_rejects_unknown_fields(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSCALE_CONTEXT_WINDOW", "7")
    monkeypatch.setenv("INFERSCALE_DATA_DIR", str(tmp_path))
    cfg = MemoryConfig()
    assert cfg.context_window == 7 and cfg.data_dir == tmp_path
    with pytest.raises(Exception, match="top_kk"):
        MemoryConfig(top_kk=3)
    with pytest.raises(Exception, match="context_window"):
        MemoryConfig(context_window=-1)


def test_default_data_dir_is_never_tmp(monkeypatch):
    monkeypatch.delenv("INFERSCALE_DATA_DIR", raising=False)
    assert not str(MemoryConfig().data_dir).startswith("/tmp")


def test_data_dir_env_reaches_the_demo_and_benchmark_stores(monkeypatch, tmp_path):
    from inferscale.cli_bench import _bench_paths
    from inferscale.config import default_data_dir

    monkeypatch.setenv("INFERSCALE_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path == MemoryConfig().data_dir
    assert _bench_paths(None, None)[1] == tmp_path / "bench"
    monkeypatch.setenv("INFERSCALE_DATA_DIR", " ")
    with pytest.raises(ValueError, match="INFERSCALE_DATA_DIR is set but empty"):
        default_data_dir()


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERSCALE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_llm(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_llm(str(tmp_path))


def test_default_model_is_prepared_offline(model_path):
    cfg = json.loads((model_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (model_path / "model.safetensors").exists()
    assert len(model_fingerprint(model_path)) == 16


def test_the_plan_pairs_kv_with_segments_by_owner_never_by_position(tokenizer):
    """Issue 29: each injected segment gets the KV of its own fact (looked up by the segment's
    owner); a layout that would pair a segment with another memory's KV, or inject after a
    text line, is refused before vLLM sees the plan."""
    import pytest

    from inferscale.generation.prompt import PREAMBLE_OWNER, PromptBuilder
    from inferscale.generation.request import plan_segments

    prompts = PromptBuilder(tokenizer, "You are helpful.")
    segments = prompts.memory_segments([("fa", "I like tea."), ("fb", "My dog is Rex."), ("fc", "I live in Porto.")])
    keys = {"fb": "fb/" + "1" * 32, PREAMBLE_OWNER: f"{PREAMBLE_OWNER}/" + "0" * 32, "fa": "fa/" + "2" * 32}
    plan = plan_segments(keys, segments)  # fc has no KV yet: it is prefilled as text, after the others
    assert [(s.key, s.start, s.num_tokens) for s in plan.segments] == [
        (keys[seg.owner], seg.start, len(seg.token_ids)) for seg in segments[:3]]
    assert plan.memory_end == segments[2].end

    with pytest.raises(ValueError, match="does not belong to segment fa"):
        plan_segments({**keys, "fa": "fb/" + "3" * 32}, segments)
    with pytest.raises(ValueError, match="does not lead with its KV segments"):
        plan_segments({PREAMBLE_OWNER: keys[PREAMBLE_OWNER], "fb": keys["fb"]}, segments)  # fa (text) before fb
    with pytest.raises(ValueError, match="does not lead with its KV segments"):
        plan_segments({**keys, "zz": "zz/" + "4" * 32}, segments)  # KV for a memory the block does not hold


def test_opens_of_one_data_dir_at_once_never_call_it_unwritable(tmp_path):
    """serve's workers open the folder together; each write probe is a file of its own."""
    from inferscale.components import check_data_dir

    errors: list[Exception] = []

    def opens() -> None:
        for _ in range(200):
            try:
                check_data_dir(tmp_path, "sentence-transformers/all-MiniLM-L6-v2", None)
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(exc)

    threads = [threading.Thread(target=opens) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".write-test")] == []


def test_the_fingerprint_follows_the_contents_not_the_install(model_path, tmp_path):
    """The same weights copied elsewhere, at another time, keep the fingerprint (the KV and
    the ONNX export stay valid after a reinstall); a byte changed in a weight file's last
    MiB, or in its config, changes it."""
    import os
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_path, copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    assert model_fingerprint(copy) == model_fingerprint(model_path)
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    changed = model_fingerprint(copy)
    assert changed != model_fingerprint(model_path)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("30", "31", 1))
    assert model_fingerprint(copy) not in (changed, model_fingerprint(model_path))
