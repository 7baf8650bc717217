"""``inferscale bench ...``: the benchmark commands; each writes JSON and Markdown to a results
folder (a failed run leaves no folder it made) and stops as Ctrl-C does on SIGTERM."""

from __future__ import annotations

import math
import shutil
import signal
from pathlib import Path
from typing import Optional

import typer

from inferscale.cli_common import DTYPE_OPTION as _DTYPE, console, fail as _fail
from inferscale.config import DEFAULT_EMBEDDER

bench_app = typer.Typer(help="Benchmarks; each writes JSON and Markdown to a results folder.")


@bench_app.callback()
def _stop_on_sigterm() -> None:
    """A benchmark stopped with SIGTERM (``kill``, a job's timeout) stops as Ctrl-C stops it:
    the resumable ones summarize what they answered, and every ``Memory`` closes, so vLLM's
    engine processes end with the benchmark instead of running on as orphans."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@bench_app.command("memory-ops")
def bench_memory_ops(
    data: Optional[Path] = typer.Option(None, help="locomo10.json (default: ../shared/data/locomo)."),
    out: Path = typer.Option(Path("results/memory-ops"), help="Results folder; the run's temporary stores are "
                             "its memory-ops-store/ and synthetic-store/ subfolders, deleted at the end."),
    stored: int = typer.Option(2500, min=1, help="Facts stored before timing (LoCoMo has 2,541; 2 x timed adds are held out)."),
    timed_adds: int = typer.Option(20, min=1, help="Timed single-fact adds per w."),
    searches: int = typer.Option(100, min=1, help="Timed searches."),
    scale: str = typer.Option("30000,300000", help="Synthetic store sizes for reopen and filtered search "
                              "(comma-separated, each >= 20000; empty: skip)."),
) -> None:
    """Per-call time of add (acknowledged, KV ready), search and inject() at ~2,500 LoCoMo facts; the
    embedder backends side by side; reopen and filtered search on large synthetic stores."""
    from inferscale.bench.memory_ops import run

    sizes = _ints(scale, "scale") if scale.strip() else []
    if any(s < 20_000 for s in sizes):
        _fail(f"--scale sizes must each be at least 20000 (the big scope's size), got {scale!r}")
    data, _ = _bench_paths(data, None)
    if not data.is_file():
        _fail(f"LoCoMo data not found at {data} (not a file): pass --data path/to/locomo10.json")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"cannot create --out {out}: {exc}")
    try:
        run(data, out, stored=stored, timed_adds=timed_adds, searches=searches, scale_sizes=tuple(sizes))
    except ValueError as exc:
        _fail(str(exc))
    console.print((out / "memory_ops.md").read_text())


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"--{name} must be comma-separated integers like 0,5,10, got {text!r}")
    if not values or any(v < 0 for v in values):
        _fail(f"--{name} must list at least one integer >= 0, got {text!r}")
    return values


def _bench_paths(data: Optional[Path], store: Optional[Path]) -> tuple[Path, Path]:
    from inferscale.config import default_data_dir
    from inferscale.datasets.locomo import default_locomo_path

    try:
        return data or default_locomo_path(), store or default_data_dir() / "bench"
    except (FileNotFoundError, ValueError) as exc:  # no LoCoMo data; a blank INFERSCALE_DATA_DIR
        _fail(str(exc))


_DATA = typer.Option(None, help="locomo10.json (default: ../shared/data/locomo).")
_STORE = typer.Option(None, help="Benchmark memory store, shared by the benchmarks so KV is encoded once "
                                 "(default: <data dir>/bench; data dir: $INFERSCALE_DATA_DIR or ~/.local/share/inferscale).")
_FRESH = typer.Option(False, "--fresh", help="Discard earlier results in --out instead of resuming.")


# the options of the two concurrent-users benchmarks (throughput, serve)
_USERS = typer.Option("1,2,4,8,16,32", help="Concurrent users per level, comma-separated.")
_FACTS_PER_USER = typer.Option(40, min=1, help="Facts in each user's own memory.")
_REQUESTS_PER_USER = typer.Option(2, min=1, help="Questions each user asks in a row, per level.")
_LEVEL_K = typer.Option(20, min=0, max=200, help="Facts per request.")
_LEVEL_W = typer.Option(0, min=0, help="w the KV is encoded with (serving cost does not depend on it).")
_LEVEL_MAX_TOKENS = typer.Option(32, min=1, help="Answer budget (tokens).")


def _run_bench(name: str, out: Path, call) -> None:
    from inferscale.datasets.locomo import LocomoFormatError
    from inferscale.models.resolve import ModelNotFoundError
    from inferscale.store.records import StoreError

    created = not out.exists()  # a failed run leaves no folder it made (issue 56)
    try:  # before the benchmark runs, not after
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _fail(f"cannot use --out {out}: {exc.strerror or exc} (give a folder)")
    try:
        call()
    except (FileNotFoundError, LocomoFormatError, ModelNotFoundError, StoreError, ValueError) as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        _fail(str(exc))
    console.print((out / f"{name}.md").read_text(), markup=False)
    written = sorted(p.name for p in out.glob(f"{name}.*"))
    console.print(f"results in {out}: {', '.join(written)}")


@bench_app.command("encode")
def bench_encode(
    data: Optional[Path] = typer.Option(None, help="locomo10.json (default: ../shared/data/locomo)."),
    out: Path = typer.Option(Path("results/encode"), help="Results folder (encode.json, encode.md); the run's "
                             "temporary stores are its encode-store-*/ subfolders, deleted at the end."),
    facts: int = typer.Option(1000, min=1, help="Facts queued at once while the questions are timed."),
    throughput_facts: int = typer.Option(200, min=1, help="Facts queued alone, for encodes per second."),
    questions: int = typer.Option(40, min=2, help="Questions timed with nothing queued, then with the queue."),
    dtype: str = typer.Option("auto", help="Model dtype (auto, float32, bfloat16)."),
    served: bool = typer.Option(True, "--served/--no-served", help="Also run both encoders through `inferscale "
                                "serve`: the front's resident memory, a question right after add over HTTP."),
) -> None:
    """Who computes the KV: the serving engine (priority 1, below every request) against a
    transformers copy in the process. Encodes per second, TTFT p50/p99 with encodes queued
    against none, a question right after add against one on ready KV, LLM weights held; served:
    the front's resident memory and a question right after add."""
    from inferscale.bench.encode import run

    data, _ = _bench_paths(data, None)
    if not data.is_file():
        _fail(f"LoCoMo data not found at {data} (not a file): pass --data path/to/locomo10.json")
    try:
        run(data, out, facts=facts, questions=questions, dtype=dtype, served=served, throughput_facts=throughput_facts)
    except ValueError as exc:
        _fail(str(exc))
    console.print((out / "encode.md").read_text())


@bench_app.command("latency")
def bench_latency(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/latency"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    sample: int = typer.Option(0, help="LoCoMo conversation index (0-9)."),
    questions: int = typer.Option(20, min=1, help="Questions (categories 1-4, spread over the conversation)."),
    k: str = typer.Option("0,5,10,20,50,100", help="Facts per request, comma-separated."),
    modes: str = typer.Option("text,inject-w0,inject-w20", help="text and/or inject-w<N>, comma-separated."),
    dtype: str = _DTYPE,
    fresh: bool = _FRESH,
) -> None:
    """TTFT, retrieval and end-to-end latency vs k: prompt text vs KV injection, one run."""
    from inferscale.bench.latency import run

    data, store = _bench_paths(data, store)
    ks, mode_list = _ints(k, "k"), [m.strip() for m in modes.split(",") if m.strip()]
    _run_bench("latency", out, lambda: run(data, out, store, sample=sample, questions=questions, ks=ks,
                                           modes=mode_list, dtype=dtype, fresh=fresh))


@bench_app.command("quality")
def bench_quality(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/quality"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    tuning: str = typer.Option("0,1,2", help="Tuning-set conversation indices, comma-separated."),
    held_out: str = typer.Option("3,4,5,6,7,8,9", help="Held-out conversation indices, comma-separated."),
    tuning_questions: int = typer.Option(5, min=1, help="Questions per tuning conversation."),
    questions: int = typer.Option(29, min=1, help="Questions per held-out conversation (7 x 29 = 203 answers a cell)."),
    k: str = typer.Option("10,50", help="Memories per request, comma-separated."),
    modes: str = typer.Option("text,inject-w0,inject-w5,inject-w20,inject-w50,captured",
                              help="text, inject-w<N>, inject-w<N>-tail<M> (the M best memories as text after the injected rest) and/or captured, each optionally ending in -bestfirst (the best memory first, not last), comma-separated (text is always scored)."),
    max_tokens: int = typer.Option(24, min=1, help="Answer budget (tokens)."),
    concurrency: int = typer.Option(4, min=1, help="Questions in flight (vLLM batches their generations)."),
    capture_traffic: Optional[int] = typer.Option(
        None, min=1, help="Other questions of a conversation served first in mode captured (default: all)."),
    dtype: str = _DTYPE,
    fresh: bool = _FRESH,
    report_only: bool = typer.Option(False, "--report-only", help="Summarize the answers in --out without answering more."),
) -> None:
    """Prompt text vs injected KV (encoded at w, or captured) on LoCoMo: paired gold-answer NLL and token F1
    with bootstrap CIs, held-out and tuning conversations apart, by category; evidence recall@k."""
    from inferscale.bench.quality import run

    data, store = _bench_paths(data, store)
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    _run_bench("quality", out, lambda: run(
        data, out, store, tuning=_ints(tuning, "tuning"), held_out=_ints(held_out, "held-out"),
        tuning_questions=tuning_questions, questions=questions, ks=_ints(k, "k"), modes=mode_list,
        max_tokens=max_tokens, concurrency=concurrency, capture_traffic=capture_traffic, dtype=dtype, fresh=fresh,
        report_only=report_only))


@bench_app.command("kv-storage")
def bench_kv_storage(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/kv_storage"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    tuning: str = typer.Option("0,1,2", help="Tuning-set conversation indices, comma-separated."),
    held_out: str = typer.Option("3,4,5,6,7,8,9", help="Held-out conversation indices, comma-separated."),
    tuning_questions: int = typer.Option(5, min=1, help="Questions per tuning conversation."),
    questions: int = typer.Option(29, min=1, help="Questions per held-out conversation (7 x 29 = 203 answers a cell)."),
    k: str = typer.Option("10,50", help="Facts per request, comma-separated."),
    context_window: str = typer.Option("5,20", help="Context windows w (turns), comma-separated."),
    max_tokens: int = typer.Option(24, min=1, help="Answer budget (tokens)."),
    dtype: str = _DTYPE,
    fresh: bool = _FRESH,
    report_only: bool = typer.Option(False, "--report-only", help="Summarize the answers in --out without answering more."),
) -> None:
    """Fact KV in int8 and int4 vs the model's dtype: paired gold-answer NLL and token F1 on LoCoMo, with bootstrap CIs."""
    from inferscale.bench.kv_storage import run

    data, store = _bench_paths(data, store)
    _run_bench("kv_storage", out, lambda: run(
        data, out, store, tuning=_ints(tuning, "tuning"), held_out=_ints(held_out, "held-out"),
        tuning_questions=tuning_questions, questions=questions, ks=_ints(k, "k"),
        windows=_ints(context_window, "context-window"), max_tokens=max_tokens, dtype=dtype, fresh=fresh,
        report_only=report_only))


@bench_app.command("throughput")
def bench_throughput(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/throughput"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    users: str = _USERS,
    facts_per_user: int = _FACTS_PER_USER,
    requests_per_user: int = _REQUESTS_PER_USER,
    k: int = _LEVEL_K,
    context_window: int = _LEVEL_W,
    max_tokens: int = _LEVEL_MAX_TOKENS,
    dtype: str = _DTYPE,
    fresh: bool = _FRESH,
) -> None:
    """Requests/s and TTFT p50/p99 for 1-32 concurrent users on vLLM's async engine: inject vs text."""
    from inferscale.bench.throughput import run

    data, store = _bench_paths(data, store)
    levels = _ints(users, "users")
    _run_bench("throughput", out, lambda: run(
        data, out, store, levels=levels, facts_per_user=facts_per_user, requests_per_user=requests_per_user, k=k,
        context_window=context_window, max_tokens=max_tokens, dtype=dtype, fresh=fresh))


@bench_app.command("tiers")
def bench_tiers(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/tiers"), help="Results folder."),
    store: Optional[Path] = typer.Option(None, help="The replay's own store (a disk budget evicts there; default: <data dir>/bench-tiers)."),
    users: int = typer.Option(12, min=1, help="Users (LoCoMo conversation i mod 10 each)."),
    questions: int = typer.Option(300, min=2, help="Questions replayed per budget."),
    warmup: int = typer.Option(100, min=0, help="First questions of each replay not counted (they fill the cache)."),
    zipf: float = typer.Option(1.1, min=0.0, help="Zipf exponent of user popularity."),
    k: int = typer.Option(10, min=1, help="Facts per question."),
    budgets: str = typer.Option("1,0.5,0.25,0.1", help="Disk budgets as shares of the full pool, comma-separated, largest first (1: none)."),
    context_window: int = typer.Option(0, min=0, help="w of the stored KV (budgets do not depend on it)."),
    touch_interval: float = typer.Option(1.0, min=0.0, help="Seconds between renewals of an entry's recency on disk (the pool's 60 s, scaled to the time-compressed trace)."),
    half_life: float = typer.Option(60.0, min=0.001, help="Seconds in which a use's weight halves under the lrfu policy (the pool's hour, scaled as the touch interval is)."),
    admission_window: float = typer.Option(0.0, min=0, help="kv_admission_window_s of the replay (seconds; 0: every miss kept, as the published pages ran; the library's day is 1440 s scaled as the half-life is)."),
    policies: str = typer.Option("lru,lrfu", help="Eviction policies to replay, comma-separated: lru, lrfu."),
    encoders: str = typer.Option("eager", help="How a miss gets its KV, comma-separated: eager (encoded at once), idle (encoded only while no request is in flight), capture (kept from the request's own prefill, the encoder idle); each policy is replayed once per arm."),
    dtype: str = _DTYPE,
) -> None:
    """The KV pool under disk budgets: share of fact tokens served as KV, TTFT p50/p99 and re-encodes on a Zipf replay."""
    from inferscale.bench.tiers import run
    from inferscale.config import default_data_dir

    data, _ = _bench_paths(data, store)
    try:
        shares = [float(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        _fail(f"--budgets takes shares of the full pool such as 1,0.5,0.25, got {budgets!r}")
    _run_bench("tiers", out, lambda: run(data, out, store or default_data_dir() / "bench-tiers", users=users,
                                         questions=questions, warmup=warmup, zipf=zipf, k=k, budgets=shares,
                                         context_window=context_window, dtype=dtype,
                                         touch_interval_s=touch_interval, half_life_s=half_life,
                                         admission_window_s=admission_window,
                                         policies=[p.strip() for p in policies.split(",") if p.strip()],
                                         encoders=[e.strip() for e in encoders.split(",") if e.strip()]))


@bench_app.command("footprint")
def bench_footprint(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/footprint"), help="Results folder."),
    store: Optional[Path] = _STORE,
    samples: str = typer.Option("0,1,2,3,4,5,6,7,8,9", help="Conversations to size, comma-separated."),
    split_sample: int = typer.Option(0, help="Conversation whose stored KV shows the device / CPU / disk split."),
    budgets_mib: str = typer.Option("2048,64", help="Device-tier budgets (MiB) for the split, comma-separated."),
    dtype: str = _DTYPE,
) -> None:
    """KV bytes per fact and per conversation, and the device / CPU / disk split of the pool."""
    from inferscale.bench.footprint import run

    data, store = _bench_paths(data, store)
    budgets = [b * 2**20 for b in _ints(budgets_mib, "budgets-mib")]
    _run_bench("footprint", out, lambda: run(data, out, store, samples=_ints(samples, "samples"), split_sample=split_sample,
                                             budgets=budgets,
                                             dtype=dtype))


@bench_app.command("report")
def bench_report(
    results: Path = typer.Option(Path("docs/results"), help="Folder holding <bench>/<bench>.json."),
    readme: Path = typer.Option(Path("README.md"), help="README with the bench-results markers to fill."),
) -> None:
    """Rewrite the README's results section from the benchmarks' JSON summaries."""
    from inferscale.bench.report import update_readme

    try:
        console.print(update_readme(readme, results), markup=False)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))




@bench_app.command("fleet")
def bench_fleet(
    ctx: typer.Context,
    out: Path = typer.Option(Path("results/fleet"), help="Results folder (fleet.json, fleet.md, fleet.png)."),
    users: str = typer.Option("1e4,1e5,1e6,1e7", help="Fleet sizes (users), comma-separated."),
    dtypes: str = typer.Option("bfloat16,int8,int4", help="KV storage dtypes, comma-separated."),
    k: str = typer.Option("10,50", help="Facts retrieved per request, comma-separated."),
    user_zipf: str = typer.Option("0.8,0.6,1.0", help="Zipf exponents of user activity, comma-separated "
                                  "(the first leads; the others form the sensitivity table)."),
    fact_zipf: str = typer.Option("0.5,0.3,0.8", help="Zipf exponents of retrieval over one user's facts, "
                                  "comma-separated (the first leads; the others form a sensitivity table)."),
    questions_per_day: float = typer.Option(5.0, help="Questions a user asks a day, on average."),
    users_per_machine: int = typer.Option(100_000, help="Users one serving machine (one H200) takes."),
    device_gib: float = typer.Option(32.0, help="Fact KV on each machine's GPU (GiB)."),
    host_gib: float = typer.Option(128.0, help="Fact KV in each machine's pinned host memory (GiB)."),
    disk_gib: float = typer.Option(3576.0, help="Fact KV on each machine's disk (GiB; 3.84 TB)."),
    redis_gib: float = typer.Option(1024.0, help="The shared Redis tier (GiB; 0: none)."),
    target: float = typer.Option(0.9, help="Share of retrieved fact tokens to serve as KV when sizing."),
    tokens_per_fact: float = typer.Option(30.1, help="Mean tokens of a fact's KV."),
    context_window: int = typer.Option(5, help="w: turns re-encoded with a missed fact."),
    tokens_per_turn: float = typer.Option(37.1, help="Tokens of one rendered turn."),
    us_per_token: float = typer.Option(46.5e3 / 1584, show_default="29.36: 46.5 ms / 1,584 tokens",
                                       help="GPU microseconds per prefilled token (H200, bf16)."),
    data: Optional[Path] = typer.Option(None, help="locomo10.json for the facts per user (default: ../shared/"
                                        "data/locomo/locomo10.json when there, else LoCoMo's counts built in)."),
    validate_users: int = typer.Option(10_000, help="Users of the exact-vs-analytic check (0: skip)."),
    validate_requests: int = typer.Option(1_500_000, help="Requests of that check's trace (two thirds warm up)."),
    admission_requests: int = typer.Option(600_000, min=0, help="Requests of the admission study's trace at --validate-users users (0: none)."),
) -> None:
    """Fleet sizing by simulation (no model): KV bytes per tier, hit rates and re-encode GPU time per hour
    for 10^4-10^7 users."""
    from inferscale.bench.fleet import GIB, LOCOMO_FACT_COUNTS, EncodeCost, locomo_fact_counts
    from inferscale.bench.fleet_report import FleetSettings, run

    default_data = Path("../shared/data/locomo/locomo10.json")
    if data is not None and not data.is_file():
        _fail(f"--data {data} is not a file: give LoCoMo's locomo10.json, or leave it out")
    source = data or (default_data if default_data.is_file() else None)
    try:
        counts = LOCOMO_FACT_COUNTS if source is None else locomo_fact_counts(source)
        settings = FleetSettings(
            users=tuple(_counts(users, "users", "1e4,1e6")), dtypes=tuple(_words(dtypes)),
            ks=tuple(_counts(k, "k", "10,50")),
            user_zipfs=tuple(_floats(user_zipf, "user-zipf")), fact_zipfs=tuple(_floats(fact_zipf, "fact-zipf")),
            requests_per_user_day=questions_per_day, users_per_machine=users_per_machine,
            device_bytes=device_gib * GIB, host_bytes=host_gib * GIB, disk_bytes=disk_gib * GIB,
            redis_bytes=redis_gib * GIB, target=target, memory_counts=counts,
            memory_counts_source="built-in" if source is None else str(source), tokens_per_fact=tokens_per_fact,
            cost=EncodeCost(seconds_per_token=us_per_token * 1e-6, context_turns=context_window,
                            tokens_per_turn=tokens_per_turn),
            validate_users=validate_users, validate_requests=validate_requests,
            admission_requests=admission_requests)
    except ValueError as exc:
        _fail(str(exc))
    command = " ".join(["inferscale bench fleet"] + [
        f"--{p.name.replace('_', '-')} {ctx.params[p.name]}" for p in ctx.command.params
        if p.name in ctx.params and ctx.params[p.name] != p.default])
    _run_bench("fleet", out, lambda: run(out, settings, command=command))


def _counts(text: str, name: str, example: str) -> list[int]:
    """Comma-separated whole numbers, ``1e6`` allowed."""
    values = _floats(text, name)
    if any(not math.isfinite(v) or v != int(v) or v < 1 for v in values):
        _fail(f"--{name} must be whole numbers >= 1 like {example}, got {text!r}")
    return [int(v) for v in values]


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _fail(f"--{name} must be comma-separated numbers, got {text!r}")
    if not values:
        _fail(f"--{name} must list at least one number, got {text!r}")
    return values


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


@bench_app.command("serve")
def bench_serve(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/serve"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    users: str = _USERS,
    facts_per_user: int = _FACTS_PER_USER,
    requests_per_user: int = typer.Option(4, min=1, help="Questions each user asks in a row, per level."),
    k: int = _LEVEL_K,
    context_window: int = _LEVEL_W,
    max_tokens: int = _LEVEL_MAX_TOKENS,
    dtype: str = _DTYPE,
    fixed_length: bool = typer.Option(True, "--fixed-length/--natural-length", help="Every answer exactly "
                                      "--max-tokens tokens (vLLM's ignore_eos), or stopping at EOS."),
    fresh: bool = _FRESH,
) -> None:
    """Requests/s, output tokens/s and TTFT p50/p99 for 1-32 users through `inferscale serve` (HTTP, openai client)."""
    from inferscale.bench.serve import run

    data, store = _bench_paths(data, store)
    levels = _ints(users, "users")
    _run_bench("serve", out, lambda: run(
        data, out, store, levels=levels, facts_per_user=facts_per_user, requests_per_user=requests_per_user, k=k,
        context_window=context_window, max_tokens=max_tokens, dtype=dtype, fixed_length=fixed_length,
        fresh=fresh))


@bench_app.command("router")
def bench_router(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/router"), help="Results folder (resumes what it holds)."),
    store: Optional[Path] = _STORE,
    users: str = typer.Option("1,4", help="Concurrent users per level, comma-separated."),
    facts_per_user: int = _FACTS_PER_USER,
    requests_per_user: int = typer.Option(8, min=1, help="Questions each user asks in a row, per level."),
    k: int = _LEVEL_K,
    max_tokens: int = typer.Option(8, min=1, help="Answer budget (tokens)."),
    hot_users: int = typer.Option(12, min=2, help="Users of the KV-hotness part (two replicas)."),
    dtype: str = _DTYPE,
    fresh: bool = _FRESH,
) -> None:
    """TTFT of chats with memory through vLLM's router against straight to the vLLM server, side by side; and the
    share of fact KV served from the replicas' device tiers with consistent-hash routing against random."""
    from inferscale.bench.router_hop import run

    data, store = _bench_paths(data, store)
    levels = _ints(users, "users")
    _run_bench("router", out, lambda: run(
        data, out, store, levels=levels, facts_per_user=facts_per_user, requests_per_user=requests_per_user, k=k,
        max_tokens=max_tokens, hot_users=hot_users, dtype=dtype, fresh=fresh))


@bench_app.command("retrieval")
def bench_retrieval(
    data: Optional[Path] = _DATA,
    out: Path = typer.Option(Path("results/retrieval"), help="Results folder; the run's temporary store is its "
                             "retrieval-store/ subfolder, deleted at the end."),
    big: int = typer.Option(20_000, min=0, help="Facts in the large scope timed for latency (0: skip)."),
    latency_queries: int = typer.Option(50, min=1, help="LoCoMo questions timed per mode."),
    repeats: int = typer.Option(3, min=1, help="Timed passes over those questions."),
    embedder: str = typer.Option(DEFAULT_EMBEDDER, help="The embedder measured: a sentence-transformers folder, a hub "
                                 "id, or pypi:<package>."),
) -> None:
    """Evidence recall@k and hit@k on LoCoMo, dense vs hybrid search, plus search latency at one
    conversation and at 20,000 facts."""
    from inferscale.bench.retrieval import run
    from inferscale.models.resolve import ModelNotFoundError, resolve_embedder

    data, _ = _bench_paths(data, None)
    try:
        resolve_embedder(embedder)
    except ModelNotFoundError as exc:
        _fail(str(exc))
    _run_bench("retrieval", out, lambda: run(data, out, big=big, latency_queries=latency_queries, repeats=repeats,
                                             embedder=embedder))


@bench_app.command("store")
def bench_store(
    out: Path = typer.Option(Path("results/store"), help="Results folder (store.json, store.md, store.png)."),
    postgres_url: Optional[str] = typer.Option(None, help="A PostgreSQL database for the PostgresStore arm (its "
                                               "store tables are created there and emptied); without it, that arm "
                                               "is left out."),
    items: int = typer.Option(2000, min=1, help="Items of LangGraph's batch mix (6 ops each)."),
    batch_sizes: str = typer.Option("1,100,10000", help="Ops a batch, comma-separated."),
) -> None:
    """LangGraph's batch mix: ops a second of InferScaleStore, InMemoryStore and PostgresStore at 1,
    100 and 10,000 ops a batch. Runs langchain-inferscale's benchmark (``python -m
    langchain_inferscale.bench_store``) in its own process: LangGraph is imported only there."""
    import subprocess
    import sys

    sizes = _ints(batch_sizes, "batch-sizes")
    if min(sizes) < 1:
        _fail(f"--batch-sizes must each be at least 1, got {batch_sizes!r}")
    command = [sys.executable, "-m", "langchain_inferscale.bench_store", "--out", str(out), "--items", str(items),
               "--batch-sizes", ",".join(map(str, sizes))] + (["--postgres-url", postgres_url] if postgres_url else [])
    try:
        done = subprocess.run(command, check=False)
    except OSError as exc:
        _fail(f"cannot run the store benchmark: {exc}")
    if done.returncode:
        _fail("the store benchmark failed (above); is langchain-inferscale installed? "
              "(`pip install -e integrations/langchain`)")
