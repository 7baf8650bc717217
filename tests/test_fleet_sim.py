"""The fleet simulator (``inferscale bench fleet``): the exact LRU engine against a trace counted
by hand, the analytic engine (Che's approximation) against the exact one and against a case
with a closed form, bad parameters refused, and the command writing its three files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from inferscale.bench.fleet import (Analytic, EncodeCost, KVShape, Tiers, Workload, analytic_served,
                                    inclusion_probabilities)
from inferscale.bench.fleet_exact import request_trace, simulate_lru, validate
from inferscale.bench.fleet_report import FleetSettings, analytic_cell
from inferscale.cli import app
from inferscale.kv import quant

A, B, C = 0, 1, 2


def test_exact_lru_serves_a_hand_counted_trace_from_the_tiers_counted_by_hand():
    """Facts A and B of 1 byte and 1 token, C of 2 bytes and 2 tokens. Device 2 bytes, host 1
    more (exclusive: depth 3), disk 4 (inclusive: depth 4), no Redis. A reference is served by
    the first tier whose depth holds the bytes of the LRU stack down to the fact:

        ref    stack before (most recent first)   bytes down to it   served by
        A      -                                   new                miss
        B      A                                   new                miss
        A      B A                                 1+1 = 2            device
        C      A B                                 new                miss
        A      C A B                               2+1 = 3            host
        B      A C B                               1+2+1 = 4          disk
        C      B A C                               1+1+2 = 4          disk
        B      C B A                               2+1 = 3            host
        A      B C A                               1+2+1 = 4          disk
        B      A B C                               1+1 = 2            device

    By count: device 2, host 2, disk 3, miss 3 of 10; by tokens (A, B 1, C 2; 12 in all):
    device 2, host 2, disk 1+2+1 = 4, miss 1+1+2 = 4.
    """
    refs = [A, B, A, C, A, B, C, B, A, B]
    sizes, tokens = [1, 1, 2], [1, 1, 2]
    tiers = Tiers(machines=1, device_bytes=2, host_bytes=1, disk_bytes=4, redis_bytes=0)
    assert tiers.depths() == (2, 3, 4, 4)

    by_tokens = simulate_lru(refs, sizes, tiers.depths(), tokens=tokens, tiers=("device", "host", "disk", "redis"))
    assert by_tokens.shares == pytest.approx((2 / 12, 2 / 12, 4 / 12, 0.0), abs=1e-15)
    assert by_tokens.miss_share == pytest.approx(4 / 12, abs=1e-15)
    assert by_tokens.kv_share == pytest.approx(8 / 12, abs=1e-15)
    # hit rate of a tier: what it serves of what reaches it; nothing reaches Redis's share of the stack
    assert by_tokens.hit_rates()[:3] == pytest.approx((2 / 12, 2 / 10, 4 / 8), abs=1e-15)

    by_count = simulate_lru(refs, sizes, tiers.depths())
    assert by_count.shares == pytest.approx((0.2, 0.2, 0.3, 0.0), abs=1e-15)
    assert by_count.miss_share == pytest.approx(0.3, abs=1e-15)

    # the first four references only warm the caches: A host, B disk, C disk, B host, A disk, B device
    warmed = simulate_lru(refs, sizes, tiers.depths(), warmup=4)
    assert warmed.shares == pytest.approx((1 / 6, 2 / 6, 3 / 6, 0.0), abs=1e-15)
    assert warmed.miss_share == pytest.approx(0.0, abs=1e-15)

    # one LRU of 2 bytes (a budget of 2 one-byte facts): only the two device hits
    assert simulate_lru(refs, sizes, [2]).shares == pytest.approx((0.2,), abs=1e-15)


def test_tier_depths_stack_exclusive_memory_over_inclusive_disk_and_redis():
    """Device and host add up (the device's evictions go to the host); disk and Redis hold
    copies, so they reach only as deep as their own budget; local tiers count per machine."""
    assert Tiers(machines=3, device_bytes=1, host_bytes=2, disk_bytes=5, redis_bytes=100).depths() == (3, 9, 15, 100)
    assert Tiers(machines=1, device_bytes=4, host_bytes=4, disk_bytes=2, redis_bytes=0).depths() == (4, 8, 8, 8)
    assert Tiers(machines=2, device_bytes=1, host_bytes=0, disk_bytes=3, redis_bytes=4).budgets() == (2, 0, 6, 4)


def test_analytic_engine_matches_the_closed_form_of_equal_rates():
    """n facts of one user, all retrieved alike: Che's equation n (1 - e^{-rate T}) = C gives a hit
    probability of exactly C / n for an LRU of C facts."""
    workload = Workload(users=1, fact_zipf=0.0, memory_counts=(10,), k=2, tokens_per_fact=4)
    model = Analytic(workload)
    assert model.num_facts == 10 and model.refs_per_request == pytest.approx(2)
    per_fact = KVShape().fact_bytes(4, "bfloat16")
    served = analytic_served(model, [3 * per_fact, 4 * per_fact, 7 * per_fact, 7 * per_fact], per_fact)
    assert served.shares == pytest.approx((0.3, 0.1, 0.3, 0.0), abs=1e-9)
    assert served.kv_share == pytest.approx(0.7, abs=1e-9)
    assert model.depth_for_hit(0.55, per_fact) == pytest.approx(5.5 * per_fact, rel=1e-9)
    assert analytic_served(model, [10 * per_fact], per_fact).kv_share == 1.0  # all fit


def test_inclusion_probabilities_retrieve_k_facts_on_average_never_more_than_once():
    pi = inclusion_probabilities(5, 3, 2.0)  # weights 1, 1/4, 1/9, ...: the first is capped
    assert pi.sum() == pytest.approx(3.0) and pi.max() == pytest.approx(1.0) and np.all(np.diff(pi) <= 1e-15)
    assert inclusion_probabilities(4, 10, 0.5).tolist() == [1.0] * 4  # fewer facts than k: all of them
    assert inclusion_probabilities(100, 10, 0.0) == pytest.approx(np.full(100, 0.1))


def test_fact_bytes_are_the_pools_bytes_for_each_storage_dtype():
    shape = KVShape()
    assert shape.fact_bytes(1, "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    for dtype, stored in (("bfloat16", "model"), ("int8", "int8"), ("int4", "int4")):
        for tokens in (1, 17, 30, 31, 50):
            assert shape.fact_bytes(tokens, dtype) == quant.nbytes(32, tokens, 8, 128, stored), (dtype, tokens)
    # a mean token count gives the mean bytes (affine in tokens)
    halfway = (shape.fact_bytes(30, "int4") + shape.fact_bytes(31, "int4")) / 2
    assert shape.fact_bytes(30.5, "int4") == pytest.approx(halfway)


def test_the_trace_draws_users_by_zipf_and_k_facts_a_request():
    workload = Workload(users=50, user_zipf=1.0, memory_counts=(20, 40), k=5)
    trace = request_trace(workload, 20_000, seed=3)
    assert trace.num_facts == int(np.asarray(workload.memory_counts)[workload.user_classes()].sum())
    assert len(trace.refs) / trace.requests == pytest.approx(5, rel=0.02)
    owner = np.searchsorted(trace.first_fact, trace.refs, side="right") - 1
    share = np.bincount(owner, minlength=50) / len(trace.refs)
    assert share[0] == pytest.approx(workload.user_shares()[0], rel=0.05)  # the top user: 22% of requests
    assert share[0] > 1.8 * share[1]


def test_analytic_engine_agrees_with_exact_lru_on_a_random_2000_user_trace():
    """Within 1.5 percentage points per tier and for the KV share (trace noise is ~0.5)."""
    workload = Workload(users=2000, memory_counts=(20, 30, 40), k=5, user_zipf=0.8, fact_zipf=0.5)
    check = validate(workload, requests=150_000, seed=1, depth_shares=(0.1, 0.3, 0.6))
    assert check.references > 700_000 and check.warmup == int(check.references * 2 / 3)
    assert check.tokens_range == (17, 43)
    assert 0.7 < check.exact.kv_share < 0.95  # a regime where the tiers matter
    assert all(s > 0.1 for s in check.exact.shares)
    assert check.max_gap < 0.015, (check.exact, check.analytic)


def test_bytes_for_the_target_scale_with_the_storage_dtype_and_gpu_time_with_k():
    model = Analytic(Workload(users=20_000, k=10))
    tiers = Tiers(machines=2, device_bytes=2**30, host_bytes=2**32, disk_bytes=2**40, redis_bytes=0)
    cells = {d: analytic_cell(model, tiers, d, target=0.9) for d in ("bfloat16", "int8", "int4")}
    for cell in cells.values():
        assert cell.target_served.kv_share == pytest.approx(0.9, abs=1e-6)
        assert cell.served.kv_share <= 1 and cell.lru_hours > 0
    ratio = cells["int4"].target_depth_bytes / cells["bfloat16"].target_depth_bytes
    assert ratio == pytest.approx(cells["int4"].fact_bytes / cells["bfloat16"].fact_bytes)
    assert 0.25 < ratio < 0.3
    # at the target 10% of the references miss: re-encodes per hour = 0.1 x refs x tokens x seconds
    cost = EncodeCost()
    refs_per_hour = 20_000 * 5 / 24 * 10
    expected = 0.1 * refs_per_hour * cost.tokens_per_miss(30.1) * cost.seconds_per_token
    assert cells["int8"].target_gpu_s_per_hour == pytest.approx(expected, rel=1e-6)
    # what misses cost as text, and what hits save, at the budgets: shares of the same references
    cell = cells["int8"]
    miss = cell.served.miss_share
    per_token = cost.seconds_per_token * 30.1
    assert cell.miss_text_gpu_s_per_hour == pytest.approx(refs_per_hour * miss * per_token, rel=1e-6)
    assert cell.hit_saved_gpu_s_per_hour == pytest.approx(refs_per_hour * (1 - miss) * per_token, rel=1e-6)
    assert cell.reencode_gpu_s_per_hour / cell.miss_text_gpu_s_per_hour == pytest.approx(
        cost.tokens_per_miss(30.1) / 30.1)


def test_the_break_even_share_of_kv_is_where_hits_save_what_re_encodes_cost():
    from inferscale.bench.fleet_report import break_even_kv_share

    # 34 + 5 x 37.1 + 30.1 = 249.6 tokens a re-encode against 30.1 a hit saves: 89.2%
    assert break_even_kv_share(EncodeCost(), 30.1) == pytest.approx(249.6 / 279.7)
    assert break_even_kv_share(EncodeCost(context_turns=0, preamble_tokens=0), 30.1) == pytest.approx(0.5)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Workload(users=0), "users must be"),
    (lambda: Workload(users=10, user_zipf=-1), "user_zipf must be"),
    (lambda: Workload(users=10, fact_zipf=float("nan")), "fact_zipf must be"),
    (lambda: Workload(users=10, k=0), "k must be"),
    (lambda: Workload(users=10, memory_counts=()), "memory_counts must be"),
    (lambda: Workload(users=10, memory_counts=(10, 0)), "memory_counts must be"),
    (lambda: Workload(users=10, requests_per_user_day=0), "requests_per_user_day must be"),
    (lambda: Workload(users=10**9), "users must be"),
    (lambda: Tiers(machines=0, device_bytes=1, host_bytes=1, disk_bytes=1), "machines must be"),
    (lambda: Tiers(machines=1, device_bytes=-1, host_bytes=1, disk_bytes=1), "device_bytes must be"),
    (lambda: EncodeCost(seconds_per_token=-1), "seconds_per_token must be"),
    (lambda: KVShape().fact_bytes(30, "fp8"), "storage dtype must be one of"),
    (lambda: KVShape().fact_bytes(0, "int8"), "tokens per fact must be"),
    (lambda: simulate_lru([0, 1], [1, 1], [2, 1]), "non-decreasing"),
    (lambda: simulate_lru([0, 5], [1, 1], [2]), "item ids"),
    (lambda: simulate_lru([0, 1], [1, 1], [2], warmup=2), "warmup"),
    (lambda: simulate_lru([0, 1], [1, 1], [2], tokens=[1]), "one count per item"),
    (lambda: request_trace(Workload(users=3), 0), "requests must be"),
    (lambda: FleetSettings(dtypes=("fp16",)), "storage dtypes must be among"),
    (lambda: FleetSettings(users=()), "users must list"),
    (lambda: FleetSettings(fact_zipfs=()), "fact_zipfs must list"),
    (lambda: FleetSettings(target=1.0), "target must be"),
    (lambda: analytic_cell(Analytic(Workload(users=5)), Tiers(1, 1, 1, 1), "int8", target=0), "target must be"),
])
def test_bad_parameters_are_refused_with_a_message_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_command_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "fleet"
    done = CliRunner().invoke(app, ["bench", "fleet", "--out", str(out), "--users", "1e3,2e3", "--k", "10",
                                    "--user-zipf", "0.8,1.0", "--fact-zipf", "0.5,0.8", "--dtypes", "bfloat16,int4",
                                    "--validate-users", "300", "--validate-requests", "20000",
                                    "--admission-requests", "20000"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in out.iterdir()) == ["fleet.json", "fleet.md", "fleet.png"]
    summary = json.loads((out / "fleet.json").read_text())
    # (0.8, 0.5) leads; (1.0, 0.5) and (0.8, 0.8) vary one exponent each: 3 pairs x 2 users x 1 k x 2 dtypes
    assert len(summary["cells"]) == 3 * 2 * 1 * 2
    assert {(c["user_zipf"], c["fact_zipf"]) for c in summary["cells"]} == {(0.8, 0.5), (1.0, 0.5), (0.8, 0.8)}
    assert summary["validation"]["users"] == 300 and summary["validation"]["max_gap"] < 0.05
    page = (out / "fleet.md").read_text()
    assert "inferscale bench fleet --out" in page and "--users 1e3,2e3" in page
    assert "Analytic vs exact LRU" in page and "Sensitivity to user popularity" in page
    assert "Sensitivity to retrieval over a user's facts" in page
    assert [a["hours"] for a in summary["admission"]] == [None, 1.0, 24.0, 96.0]
    assert "Admission on a second use (300 users" in page
    assert (out / "fleet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--users", "abc"], "--users must be"),
    (["--users", "2.5"], "--users must be whole numbers"),
    (["--users", "inf"], "--users must be whole numbers"),
    (["--dtypes", "fp8"], "storage dtypes must be among"),
    (["--fact-zipf", "-0.5"], "fact_zipf must be"),
    (["--target", "1.2"], "target must be"),
    (["--device-gib", "-1"], "device_bytes must be"),
])
def test_the_command_refuses_bad_options_with_one_line_and_status_2(tmp_path, args, message):
    done = CliRunner().invoke(app, ["bench", "fleet", "--out", str(tmp_path / "f"), *args])
    assert done.exit_code == 2, done.output
    assert message in done.output and "Traceback" not in done.output
    assert not (tmp_path / "f").exists()


def test_belady_keeps_what_is_used_soonest_counted_by_hand():
    """a b a c a b, room for two, starting warm (a and b, first used soonest): c is never used
    again, so it is not kept: 5 hits of 6 (LRU would evict b for c and miss b at the end).
    Tokens weigh hits: with b worth 3 tokens, 9 of 10."""
    from inferscale.bench.clairvoyant import belady_token_share

    refs = [["a"], ["b"], ["a"], ["c"], ["a"], ["b"]]
    ones = {"a": 1, "b": 1, "c": 1}
    assert belady_token_share(refs, ones, ones, budget_bytes=2) == pytest.approx(5 / 6)
    assert belady_token_share(refs, {"a": 1, "b": 3, "c": 1}, ones, budget_bytes=2) == pytest.approx(9 / 10)
    assert belady_token_share(refs, ones, ones, budget_bytes=2, warmup=3) == pytest.approx(2 / 3)  # c, a, b
    # room for one: a is kept (used again sooner than b each time b comes): a a a hit, b b c miss
    assert belady_token_share(refs, ones, ones, budget_bytes=1) == pytest.approx(3 / 6)
    # a never fits, and nothing is given up for it: b and c stay, and hit
    assert belady_token_share(refs, ones, {"a": 5, "b": 1, "c": 1}, budget_bytes=2) == pytest.approx(3 / 6)
    assert belady_token_share(refs, ones, ones, budget_bytes=3) == 1.0  # everything fits: all hit
    with pytest.raises(ValueError, match="budget_bytes >= 0"):
        belady_token_share(refs, ones, ones, budget_bytes=-1)


def test_the_exact_engine_admits_a_miss_that_evicts_only_on_its_second_use_within_the_window():
    """Hand-counted: budget 2 items of size 1. Keeping every miss: 3 hits, 5 misses kept.
    Window 8: 2 is refused at its first miss (the cache is full), kept at its second (evicting
    0), 0 is refused later: 3 hits, 3 kept. Window 1: 2's misses at 2 and 4 are too far apart,
    it is kept at 5: 2 hits."""
    from inferscale.bench.fleet_exact import simulate_lru

    refs = [0, 1, 2, 1, 2, 2, 0, 1]
    every = simulate_lru(refs, [1, 1, 1], [2])
    assert (every.kv_share, every.stored_share) == (3 / 8, 5 / 8)
    wide = simulate_lru(refs, [1, 1, 1], [2], admit_window=8)
    assert (wide.kv_share, wide.stored_share) == (3 / 8, 3 / 8)
    narrow = simulate_lru(refs, [1, 1, 1], [2], admit_window=1)
    assert (narrow.kv_share, narrow.stored_share) == (2 / 8, 3 / 8)


def test_the_admission_study_prices_each_window_and_refuses_a_bad_one():
    from inferscale.bench.fleet import Workload
    from inferscale.bench.fleet_exact import admission_study

    w = Workload(users=200, memory_counts=(40,), k=5)
    rows = admission_study(w, [0.0, 0.0, 5e9, 5e9], hours=(None, 24.0), requests=4000)
    every, day = rows
    assert every["hours"] is None and every["stored_share"] == pytest.approx(1 - every["kv_share"])
    assert day["stored_share"] <= every["stored_share"]  # a window never keeps more
    assert every["miss_text_gpu_s_per_hour"] + every["hit_saved_gpu_s_per_hour"] == pytest.approx(
        day["miss_text_gpu_s_per_hour"] + day["hit_saved_gpu_s_per_hour"])  # the same tokens, split otherwise
    with pytest.raises(ValueError, match="windows are hours"):
        admission_study(w, [1e9], hours=(0.0,))
