"""Throughput under concurrent users: prompt text vs KV injection on vLLM's async engine.

Each simulated user has its own memory (its own ``user_id``): ``facts_per_user``
observations of one LoCoMo conversation (user ``u`` takes conversation ``u mod 10``,
slice ``u div 10``), with KV encoded at ``context_window`` (serving cost does not depend
on w: a fact's KV has as many tokens at every w). Each user asks ``requests_per_user``
questions of its conversation one after the other (a closed loop); ``users`` of them run
at once. Retrieval and prompt layout are done before a level starts (the latency
benchmark reports retrieval), so the level measures the serving engine.

Per level and mode: requests/s (finished requests over the level's wall time) and
TTFT p50 / p99. Prefix caching stays on: within a level, text requests share the cached
system preamble as a Mem0 deployment would; across levels nothing is shared (each
level's requests carry their own cache salt). Injected KV is loaded into the
engine-core's device tier by a warm-up pass before timing.

Reproduce: ``inferscale bench throughput`` (see ``--help``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from inferscale.bench.common import ResultLog, markdown_table, summarize_levels, write_outputs
from inferscale.bench.plots import plot_throughput
from inferscale.datasets.locomo import LocomoFact, LocomoSample, load_locomo, store_conversation
from inferscale.memory import Memory

NAME = "throughput"
#: vLLM's paged cache for this benchmark (2 GiB): 64 requests of ~800 tokens at 45 KiB/token.
PAGED_CACHE_BYTES = 2 << 30


def user_plan(convs: Sequence[LocomoSample], users: int, facts_per_user: int, requests_per_user: int
              ) -> list[tuple[str, LocomoSample, Sequence[LocomoFact], list[str]]]:
    """``(user_id, conversation, facts, questions)`` for each simulated user.

    Raises:
        ValueError: a conversation has too few facts or questions for the plan.
    """
    plan = []
    for u in range(users):
        conv, part = convs[u % len(convs)], u // len(convs)
        facts = conv.facts[part * facts_per_user:(part + 1) * facts_per_user]
        qs = [q.question for q in conv.qa if q.category in (1, 2, 3, 4)]
        asked = qs[part * requests_per_user:(part + 1) * requests_per_user]
        if len(facts) < facts_per_user or len(asked) < requests_per_user:
            raise ValueError(f"{conv.sample_id} has too few facts or questions for user {u}: lower --users, "
                             "--facts-per-user or --requests-per-user")
        plan.append((f"tp-user-{u:02d}", conv, facts, asked))
    return plan


def level_settings(data: Path, levels: Sequence[int], facts_per_user: int, requests_per_user: int, k: int,
                   context_window: int, max_tokens: int, dtype: str) -> dict:
    """The settings of a concurrent-users run (what its result log is keyed by), checked.

    Raises:
        ValueError: no level, a level below 1, or ``k`` above ``facts_per_user``.
    """
    if not levels or min(levels) < 1:
        raise ValueError(f"levels must be positive user counts, got {list(levels)}")
    if k > facts_per_user:
        raise ValueError(f"k={k} exceeds facts_per_user={facts_per_user}")
    return {"levels": list(levels), "facts_per_user": facts_per_user, "requests_per_user": requests_per_user,
            "k": k, "context_window": context_window, "max_tokens": max_tokens, "dtype": dtype, "data": str(data)}


def store_users(memory: Memory, plan, store_dir: Path) -> None:
    """Store each planned user's facts (KV queued); an existing user must hold exactly them.

    Raises:
        ValueError: a user of the store holds other facts (a run with another ``facts_per_user``).
    """
    for user_id, conv, facts, _qs in tqdm(plan, desc="store users' memories + KV", unit="user"):
        store_conversation(memory, conv, user_id, facts=facts, batch=len(facts))
        held = memory.count(user_id=user_id)
        if held != len({f.dated_text() for f in facts}):
            raise ValueError(f"{user_id} in {store_dir} holds {held} facts, not the "
                             f"{len(facts)} of this plan (an earlier run with another --facts-per-user): "
                             "use another --store")


async def _level(engine, requests: list[list[dict]], max_tokens: int) -> tuple[float, list]:
    """Run every user's requests (each user's one after another, users concurrently)."""
    async def user(reqs: list[dict]) -> list:
        return [await engine.agenerate(**r, max_tokens=max_tokens) for r in reqs]

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(user(r) for r in requests))
    return time.perf_counter() - t0, [o for per_user in outs for o in per_user]


def run(data: Path, out_dir: Path, store_dir: Path, *, levels: Sequence[int] = (1, 2, 4, 8, 16, 32),
        facts_per_user: int = 40, requests_per_user: int = 2, k: int = 20, context_window: int = 0,
        max_tokens: int = 32, dtype: str = "auto", fresh: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``throughput.{jsonl,json,md,png}`` to ``out_dir``.

    Args:
        levels: concurrent users per level. facts_per_user: each user's memory size (facts).
        requests_per_user: questions each user asks per level. k: facts per request.
        context_window: w the KV is encoded with. max_tokens: answer budget (tokens).

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
    """
    settings = level_settings(data, levels, facts_per_user, requests_per_user, k, context_window, max_tokens, dtype)
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    plan = user_plan(load_locomo(data), max(levels), facts_per_user, requests_per_user)
    memory = Memory(data_dir=store_dir, dtype=dtype, precompute_kv=True, context_window=context_window)
    store_users(memory, plan, store_dir)
    todo = [(n, mode) for n in levels for mode in ("inject", "text") if not log.done(f"{mode}|users={n}")]
    if todo:
        asyncio.run(_measure(memory, plan, todo, log, k=k, w=context_window, max_tokens=max_tokens))
    log.commit()
    summary = summarize(log.all(), levels)
    summary["settings"] = log.settings  # as keyed: data by content, dtype resolved
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_throughput(summary, out_dir / f"{NAME}.png")
    return summary


def _requests(memory: Memory, plan, users: int, mode: str, k: int, w: int, salt: str) -> list[list[dict]]:
    out = []
    for user_id, _conv, _facts, questions in plan[:users]:
        reqs = []
        for q in questions:
            req = memory.prepare(q, user_id=user_id, k=k, context_window=w, mode=mode, wait_for_kv=True)
            reqs.append({"prompt_token_ids": req.prompt_token_ids, "kv_transfer_params": req.kv_transfer_params,
                         "cache_salt": f"{req.cache_salt or 'text'}-{salt}"})
        out.append(reqs)
    return out


async def _measure(memory: Memory, plan, todo, log: ResultLog, *, k: int, w: int, max_tokens: int) -> None:
    from inferscale.serving.engine import Engine

    engine = Engine(memory.model_path, dtype=memory.config.resolved_dtype, kv_dir=memory.kv_dir,
                    max_model_len=memory.config.max_model_len, kv_cache_memory_bytes=PAGED_CACHE_BYTES,
                    max_num_seqs=max(n for n, _ in todo))
    try:
        warm = _requests(memory, plan, len(plan), "inject", k, w, "warm")
        for reqs in tqdm(warm, desc="warm-up (loads KV into the engine's device tier)", unit="user"):
            for r in reqs:
                await engine.agenerate(**r, max_tokens=1)
        for n, mode in tqdm(todo, desc="levels", unit="level"):
            requests = _requests(memory, plan, n, mode, k, w, f"users={n}")
            wall, outs = await _level(engine, requests, max_tokens)
            log.add(f"{mode}|users={n}", {
                "mode": mode, "users": n, "requests": len(outs), "wall_s": wall,
                "ttft_s": [o.ttft_s for o in outs], "latency_s": [o.latency_s for o in outs],
                "prompt_tokens": [o.num_prompt_tokens for o in outs],
                "cached_tokens": [o.num_cached_tokens for o in outs],
                "output_tokens": [o.num_output_tokens for o in outs],
            })
    finally:
        engine.close()


def summarize(rows: list[dict], levels: Sequence[int]) -> dict:
    """Requests/s and TTFT p50/p99 per (mode, users); inject/text throughput ratios."""
    return summarize_levels(rows, levels, lambda r: {
        "prefilled_tokens_mean": sum(p - c for p, c in zip(r["prompt_tokens"], r["cached_tokens"]))
        / len(r["prompt_tokens"])})


def to_markdown(summary: dict) -> str:
    """Tables of the summary."""
    s = summary["settings"]
    rows = [[c["mode"], c["users"], c["requests"], f"{c['requests_per_s']:.2f}", f"{c['output_tokens_per_s']:.1f}",
             f"{c['ttft_p50_ms']:.0f}",
             f"{c['ttft_p99_ms']:.0f}", f"{c['prompt_tokens_mean']:.0f}", f"{c['prefilled_tokens_mean']:.0f}",
             f"{c['output_tokens_mean']:.1f}"] for c in summary["cells"]]
    table = markdown_table(["mode", "users", "requests", "requests/s", "output tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                            "prompt tokens", "prefilled tokens", "output tokens"], rows)
    tok = summary["inject_over_text_output_tokens_per_s"]
    ratios = markdown_table(["users", "requests/s inject / text", "output tokens/s inject / text"],
                            [[n, f"{v:.2f}x", f"{tok[n]:.2f}x"]
                             for n, v in summary["inject_over_text_requests_per_s"].items()])
    return (f"# Throughput: concurrent users, vLLM async engine\n\nEach user: {s['facts_per_user']} facts of its own, "
            f"{s['requests_per_user']} questions in a row, k={s['k']}, KV at w={s['context_window']}, up to "
            f"{s['max_tokens']} answer tokens (greedy); dtype {s['dtype']}.\n\n{table}\n\n{ratios}\n")
