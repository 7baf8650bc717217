"""What vLLM's router costs a chat, and what its routing keeps hot.

Part one, the hop: TTFT through ``vllm-router`` against straight to the replica.

One vLLM OpenAI server with InferScale's connector over the benchmark store's KV pool
(:class:`~inferscale.server.vllm_process.VLLMProcess`, as ``inferscale serve`` starts it),
and vLLM's router in front of it (:class:`~inferscale.server.router_process.RouterProcess`,
with the settings ``inferscale serve --replicas N`` uses). Each question is turned into the
chat the front would send (the memory system turn, its KV plan: ``memory_block`` and
:func:`inferscale.server.chat.forward_body`) and sent, streamed, to both: the router
with the scope's routing header, the replica without. The two arms alternate which goes
first (A-B, then B-A), and each carries its own prefix-cache salt, so neither reuses the
other's cached blocks (a warm-up pass first loads every fact's KV into the device tier
through both); at each concurrency level ``users`` users ask their questions one
after the other. TTFT is measured by the client, from sending to the first chunk with
answer text; the front's own work (retrieval, the plan) is the same in both arms and
left out.

Part two, KV kept hot (issue 55, item 4): two replicas whose device tiers each hold a
little more than half of all the users' fact KV (``hot_share`` of it), behind a router
with ``consistent_hash`` (each user on one replica) and then one with ``random`` (every
user on both). Each arm starts the replicas cold, asks every user's questions once
(warm-up), then again in an interleaved order, sequentially; the measured share of
segments served from a replica's device tier is ``1 - disk reads / segments injected``
(the connector's ``vllm:inferscale_disk_reads_total`` over both replicas, and the plans'
segment counts).

Reproduce: ``inferscale bench router`` (see ``--help``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Sequence

import httpx
from tqdm import tqdm

from inferscale.bench.common import ResultLog, machine, markdown_table, percentile, write_outputs
from inferscale.bench.throughput import store_users, user_plan
from inferscale.config import MemoryConfig
from inferscale.datasets.locomo import load_locomo
from inferscale.memory import Memory
from inferscale.server.chat import forward_body
from inferscale.server.upstream import HttpEngine, route_headers

NAME = "router"
ARMS = ("router", "direct")
POLICIES = ("consistent_hash", "random")
#: part two's device tier per replica, as a share of all the users' fact KV: one replica's
#: users (about half) fit, all of them do not
HOT_SHARE = 0.7


def run(data: Path, out_dir: Path, store_dir: Path, *, levels: Sequence[int] = (1, 4), facts_per_user: int = 40,
        requests_per_user: int = 8, k: int = 20, max_tokens: int = 8, hot_users: int = 12, dtype: str = "auto",
        fresh: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``router.{jsonl,json,md}`` to ``out_dir``.

    Args:
        data: LoCoMo's JSON. store_dir: the benchmark store (memories and KV, reused).
        levels: concurrent users per level. facts_per_user, requests_per_user, k: as
            :func:`inferscale.bench.throughput.run`. max_tokens: answer budget (tokens).
        hot_users: users of part two (spread over two replicas).

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
        inferscale.server.child_server.ChildStartError: vLLM or its router did not start.
    """
    from inferscale.server.router_process import RouterProcess

    if not levels or min(levels) < 1:
        raise ValueError(f"levels must be positive user counts, got {list(levels)}")
    if k > facts_per_user:
        raise ValueError(f"k={k} exceeds facts_per_user={facts_per_user}")
    settings = {"levels": list(levels), "facts_per_user": facts_per_user, "requests_per_user": requests_per_user,
                "k": k, "max_tokens": max_tokens, "hot_users": hot_users, "dtype": dtype, "data": str(data)}
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    plan = user_plan(load_locomo(data), max(*levels, hot_users), facts_per_user, requests_per_user)
    todo = [n for n in levels if not log.done(f"users={n}")]
    hot_todo = [p for p in POLICIES if not log.done(f"hot|policy={p}")]
    if todo or hot_todo:
        with Memory(data_dir=store_dir, dtype=dtype, precompute_kv=True) as memory:
            store_users(memory, plan, store_dir)
            memory.wait_for_kv()
        (store_dir / "logs").mkdir(parents=True, exist_ok=True)
    if todo:
        (vllm,) = _servers(store_dir, dtype, None, 1, max_num_seqs=max(levels))
        router = RouterProcess([vllm.url], log_path=store_dir / "logs" / "bench-router.log")
        try:
            vllm.start()
            vllm.wait_ready()
            router.start()
            router.wait_ready(60)
            bodies = _bodies(store_dir, dtype, vllm.url, plan[:max(levels)], k, max_tokens)
            asyncio.run(_measure(router.url, vllm.url, bodies, todo, log))
        finally:
            router.stop()
            vllm.stop()
    if hot_todo:
        _hotness(store_dir, plan[:hot_users], hot_todo, log, k=k, max_tokens=max_tokens, dtype=dtype)
    log.commit()
    summary = summarize(log.all(), levels)
    summary["settings"] = log.settings
    summary["ran"] = {"date": time.strftime("%Y-%m-%d"), **{f: machine()[f] for f in ("cpu", "cores", "commit")}}
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    return summary


def _bodies(store_dir: Path, dtype: str, url: str, plan, k: int, max_tokens: int) -> dict[str, list[tuple[str, dict]]]:
    """Per user, ``(scope key, chat body)`` of each question, as a front over ``store_dir``
    with vLLM at ``url`` builds them (the body's ``kv_transfer_params`` name its planned segments)."""
    out = {}
    engine = HttpEngine(url, store_dir / "kv", "bench")
    try:
        with Memory(MemoryConfig(data_dir=store_dir, dtype=dtype), engine=engine) as memory:
            for user_id, _conv, _facts, questions in tqdm(plan, desc="chat bodies (retrieval, KV plans)", unit="user"):
                rows = []
                for q in questions:
                    block = memory.memory_block(q, user_id=user_id, mode="inject", k=k)
                    body = forward_body({"model": "bench", "messages": [{"role": "user", "content": q}],
                                         "max_tokens": max_tokens, "temperature": 0, "stream": True},
                                        block, [{"role": "user", "content": q}], max_tokens)
                    rows.append((json.dumps({"user_id": user_id}), body))
                out[user_id] = rows
    finally:
        engine.close()
    return out


async def _ttft(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> float:
    """Seconds from sending ``body`` to the first chunk with answer text (or the end)."""
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content"):
                    return time.perf_counter() - t0
    return time.perf_counter() - t0


async def _measure(router_url: str, direct_url: str, bodies: dict, todo: Sequence[int], log: ResultLog) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for user_id in tqdm(list(bodies)[:max(todo)], desc="warm-up (KV into the device tier, both paths)",
                            unit="user"):
            for scope_key, body in bodies[user_id]:
                await _ttft(client, router_url, {**body, "cache_salt": "warm"}, route_headers(scope_key))
                await _ttft(client, direct_url, {**body, "cache_salt": "warm"}, {})
        for n in tqdm(todo, desc="levels", unit="level"):
            users = list(bodies)[:n]

            async def user(index: int, user_id: str) -> list[dict]:
                rows = []
                for i, (scope_key, body) in enumerate(bodies[user_id]):
                    order = ARMS if (index + i) % 2 == 0 else ARMS[::-1]  # A-B, then B-A
                    row = {}
                    for arm in order:
                        sent = {**body, "cache_salt": f"{body.get('cache_salt', '')}-{arm}-{n}"}
                        url, headers = (router_url, route_headers(scope_key)) if arm == "router" else (direct_url, {})
                        row[arm] = await _ttft(client, url, sent, headers)
                    rows.append(row)
                return rows

            t0 = time.perf_counter()
            per_user = await asyncio.gather(*(user(i, u) for i, u in enumerate(users)))
            rows = [r for rs in per_user for r in rs]
            log.add(f"users={n}", {"users": n, "wall_s": time.perf_counter() - t0,
                                   **{f"{arm}_ttft_s": [r[arm] for r in rows] for arm in ARMS}})


def _servers(store_dir: Path, dtype: str, device_budget_bytes: int | None, n: int, max_num_seqs: int = 4) -> list:
    """``n`` vLLM servers over ``store_dir``'s KV pool, each with ``device_budget_bytes`` of
    device tier (``None``: the configuration's) and its share of the cores."""
    from inferscale.models.resolve import resolve_llm
    from inferscale.server.vllm_process import VLLMProcess, cpu_shares

    config = MemoryConfig(data_dir=store_dir, dtype=dtype)
    return [VLLMProcess(resolve_llm(config.llm), served_model_name="bench", kv_dir=store_dir / "kv",
                        dtype=config.resolved_dtype, max_model_len=config.max_model_len,
                        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                        device_budget_bytes=config.device_kv_budget_bytes if device_budget_bytes is None
                        else device_budget_bytes,
                        max_num_seqs=max_num_seqs, log_path=store_dir / "logs" / f"bench-router-vllm-{i}.log",
                        environment={"VLLM_CPU_OMP_THREADS_BIND": share})
            for i, share in enumerate(cpu_shares(n))]


def _disk_reads(urls: Sequence[str]) -> float:
    """``vllm:inferscale_disk_reads_total`` summed over the servers at ``urls``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
            if family.name == "vllm:inferscale_disk_reads":
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _hotness(store_dir: Path, plan, policies: Sequence[str], log: ResultLog, *, k: int, max_tokens: int,
             dtype: str) -> None:
    """Part two: each policy's share of segments served from the replicas' device tiers."""
    import random

    from inferscale.server.router_process import RouterProcess

    kv_bytes = sum(f.stat().st_size for f in (store_dir / "kv").rglob("*") if f.is_file())
    budget = int(kv_bytes * HOT_SHARE)
    servers = _servers(store_dir, dtype, budget, 2)
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        bodies = _bodies(store_dir, dtype, servers[0].url, plan, k, max_tokens)
        asked = [(u, i) for u in bodies for i in range(len(bodies[u]))]
        for policy in tqdm(policies, desc="routing policies", unit="policy"):
            for server in servers:  # cold device tiers for each arm
                server.restart()
            for server in servers:
                server.wait_ready()
            router = RouterProcess([s.url for s in servers], log_path=store_dir / "logs" / f"bench-router-{policy}.log",
                                   policy=policy)
            router.start()
            try:
                router.wait_ready(60)
                order = asked[:]
                random.Random(0).shuffle(order)
                rows = asyncio.run(_hot_pass(router.url, bodies, asked, order, [s.url for s in servers]))
            finally:
                router.stop()
            log.add(f"hot|policy={policy}", {"policy": policy, "device_budget_bytes": budget, "kv_bytes": kv_bytes,
                                             **rows})
    finally:
        for server in servers:
            server.stop()


async def _hot_pass(router_url: str, bodies: dict, warm_order, order, server_urls: Sequence[str]) -> dict:
    """Warm-up over ``warm_order``, then the measured pass over ``order``: its TTFTs, the
    segments its plans inject and the disk reads it caused."""
    async with httpx.AsyncClient(timeout=600) as client:
        for user_id, i in warm_order:
            scope_key, body = bodies[user_id][i]
            await _ttft(client, router_url, {**body, "cache_salt": f"warm-{user_id}-{i}"}, route_headers(scope_key))
        before = await asyncio.to_thread(_disk_reads, server_urls)
        ttfts, segments = [], 0
        for user_id, i in order:
            scope_key, body = bodies[user_id][i]
            segments += len(body["kv_transfer_params"]["inferscale"]["segments"])
            ttfts.append(await _ttft(client, router_url, {**body, "cache_salt": f"hot-{user_id}-{i}"},
                                     route_headers(scope_key)))
        after = await asyncio.to_thread(_disk_reads, server_urls)
    return {"ttft_s": ttfts, "segments": segments, "disk_reads": after - before}


def summarize(rows: list[dict], levels: Sequence[int]) -> dict:
    """Per level: TTFT p50 / p99 of each arm (seconds) and their ratios (router / direct), and
    the per-request ratio's median (pairs of the same question)."""
    out = {"levels": []}
    for n in levels:
        row = next((r for r in rows if r.get("users") == n), None)
        if row is None:
            continue
        r, d = row["router_ttft_s"], row["direct_ttft_s"]
        pairs = sorted(a / b for a, b in zip(r, d) if b > 0)
        level = {"users": n, "requests": len(r)}
        for arm, values in (("router", r), ("direct", d)):
            level[f"{arm}_ttft_p50_s"] = percentile(values, 50)
            level[f"{arm}_ttft_p99_s"] = percentile(values, 99)
        level["ratio_p50"] = level["router_ttft_p50_s"] / level["direct_ttft_p50_s"]
        level["ratio_p99"] = level["router_ttft_p99_s"] / level["direct_ttft_p99_s"]
        level["paired_ratio_median"] = percentile(pairs, 50)
        out["levels"].append(level)
    out["hotness"] = []
    for policy in POLICIES:
        row = next((r for r in rows if r.get("policy") == policy), None)
        if row is not None:
            out["hotness"].append({
                "policy": policy, "requests": len(row["ttft_s"]), "segments": row["segments"],
                "disk_reads": row["disk_reads"], "device_share": 1 - row["disk_reads"] / max(row["segments"], 1),
                "ttft_p50_s": percentile(row["ttft_s"], 50), "device_budget_bytes": row["device_budget_bytes"],
                "kv_bytes": row["kv_bytes"]})
    return out


def to_markdown(summary: dict) -> str:
    rows = [[lv["users"], lv["requests"], f"{lv['direct_ttft_p50_s'] * 1000:.1f}", f"{lv['router_ttft_p50_s'] * 1000:.1f}",
             f"{lv['ratio_p50']:.3f}", f"{lv['direct_ttft_p99_s'] * 1000:.1f}", f"{lv['router_ttft_p99_s'] * 1000:.1f}",
             f"{lv['ratio_p99']:.3f}", f"{lv['paired_ratio_median']:.3f}"] for lv in summary["levels"]]
    head = ["users", "requests", "direct p50 ms", "router p50 ms", "p50 ratio", "direct p99 ms", "router p99 ms",
            "p99 ratio", "paired ratio (median)"]
    ran, st = summary.get("ran", {}), summary.get("settings", {})
    return ("# TTFT through vLLM's router against straight to the replica\n\n"
            f"{ran.get('date')}, {ran.get('cpu')} ({ran.get('cores')} cores), commit {ran.get('commit')}; "
            f"k={st.get('k')} facts injected as KV, {st.get('requests_per_user')} questions a user, answers of "
            f"{st.get('max_tokens')} tokens. Streamed chats, the bodies the front builds; ratio = router / direct "
            "(aim <= 1.05). Reproduce: `inferscale bench router`.\n\n" + markdown_table(head, rows) + "\n"
            + _hot_markdown(summary.get("hotness", [])))


def _hot_markdown(hot: list[dict]) -> str:
    if not hot:
        return ""
    rows = [[h["policy"], h["requests"], h["segments"], int(h["disk_reads"]), f"{h['device_share']:.1%}",
             f"{h['ttft_p50_s'] * 1000:.1f}"] for h in hot]
    budget, total = hot[0]["device_budget_bytes"], hot[0]["kv_bytes"]
    return ("\n## Fact KV served from the replica's device tier\n\n"
            f"Two replicas, each with a device tier of {budget / 2**20:.0f} MiB ({HOT_SHARE:.0%} of the users' "
            f"{total / 2**20:.0f} MiB of KV), cold at the start of each policy; every user's questions once to warm "
            "up, then again interleaved, one at a time.\n\n"
            + markdown_table(["router policy", "requests", "segments injected", "read from disk", "from the device tier",
                              "TTFT p50 ms"], rows) + "\n")
