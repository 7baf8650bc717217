"""Throughput through ``inferscale serve``: concurrent users over HTTP with the ``openai`` client.

The same users, memories and questions as :mod:`inferscale.bench.throughput` (user ``u``
holds ``facts_per_user`` observations of LoCoMo conversation ``u mod 10``), but every
request goes the way a deployed agent's does: the ``openai`` SDK's async client, streamed
``/v1/chat/completions`` to InferScale's front (retrieval, memory block, plan), and
vLLM's own OpenAI server with the connector behind it (chat template, batching). Each
user asks ``requests_per_user`` questions one after the other (a closed loop); ``users``
of them run at once.

Every answer is exactly ``max_tokens`` tokens by default (vLLM's ``ignore_eos``, as its
own serving benchmark fixes output lengths), so both modes decode the same and the
comparison is what memory costs; ``fixed_length=False`` lets answers stop at EOS (text
answers then run shorter than injected ones, which favours text in requests/s).

Per level and mode: requests/s (finished requests over the level's wall time), output
tokens/s, and TTFT p50 / p99 measured by the client (from sending the request to the
first chunk that carries answer text: retrieval, the HTTP hops and the prefill
included). vLLM's prefix cache is emptied before each level (its dev-mode
``/reset_prefix_cache``), so no level reuses another's blocks; within a level, text
requests share the cached system preamble as a Mem0 deployment would. Fact KV is loaded
into the engine-core's device tier by a warm-up pass first.

Reproduce: ``inferscale bench serve`` (see ``--help``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx
from tqdm import tqdm

from inferscale.bench.common import ResultLog, markdown_table, summarize_levels, write_outputs
from inferscale.bench.plots import plot_throughput
from inferscale.bench.throughput import PAGED_CACHE_BYTES, level_settings, store_users, user_plan
from inferscale.datasets.locomo import load_locomo
from inferscale.memory import Memory
from inferscale.server.ports import free_port

NAME = "serve"
_KEY = "bench-serve"


class ServerProcess:
    """``inferscale serve`` over ``data_dir`` on a free loopback port (dev mode, for
    ``/reset_prefix_cache``); :meth:`stop` sends it SIGTERM."""

    def __init__(self, data_dir: Path, dtype: str, max_num_seqs: int, log: Path,
                 environment: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "INFERSCALE_API_KEY": _KEY, "VLLM_SERVER_DEV_MODE": "1",
               "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(PAGED_CACHE_BYTES), **(environment or {})}
        cmd = [str(Path(sys.executable).with_name("inferscale")), "serve", "--port", str(self.port), "--data-dir",
               str(data_dir), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inferscale serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"inferscale serve was not ready after {timeout:.0f} s (log: {self.log})")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {_KEY}"}

    @property
    def vllm_url(self) -> str:
        found = re.search(r"on (http://127\.0\.0\.1:\d+) \(log", self.log.read_text())
        if not found:
            raise RuntimeError(f"no vLLM address in {self.log}")
        return found.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run(data: Path, out_dir: Path, store_dir: Path, *, levels: Sequence[int] = (1, 2, 4, 8, 16, 32),
        facts_per_user: int = 40, requests_per_user: int = 4, k: int = 20, context_window: int = 0,
        max_tokens: int = 32, dtype: str = "auto", fixed_length: bool = True, fresh: bool = False) -> dict:
    """Run (or resume) the benchmark; writes ``serve.{jsonl,json,md,png}`` to ``out_dir``.

    Args: as :func:`inferscale.bench.throughput.run`; ``fixed_length``: every answer is
    ``max_tokens`` tokens long (``ignore_eos``) instead of stopping at EOS.

    Raises:
        ValueError: bad settings, or results in ``out_dir`` made with other settings.
        RuntimeError: the server did not start.
    """
    settings = level_settings(data, levels, facts_per_user, requests_per_user, k, context_window, max_tokens, dtype)
    settings["fixed_length"] = fixed_length
    log = ResultLog(out_dir, NAME, settings, fresh=fresh)
    plan = user_plan(load_locomo(data), max(levels), facts_per_user, requests_per_user)
    todo = [(n, mode) for n in levels for mode in ("inject", "text") if not log.done(f"{mode}|users={n}")]
    if todo:
        with Memory(data_dir=store_dir, dtype=dtype, precompute_kv=True, context_window=context_window) as memory:
            store_users(memory, plan, store_dir)
            memory.wait_for_kv()
        (store_dir / "logs").mkdir(parents=True, exist_ok=True)  # beside the server's vLLM log
        server = ServerProcess(store_dir, dtype, max(levels), store_dir / "logs" / "bench-serve.log")
        try:
            server.wait_ready()
            asyncio.run(_measure(server, plan, todo, log, k=k, w=context_window, max_tokens=max_tokens,
                                 ignore_eos=fixed_length))
        finally:
            server.stop()
    log.commit()
    summary = summarize(log.all(), levels)
    summary["settings"] = log.settings  # as keyed: data by content, dtype resolved
    write_outputs(out_dir, NAME, summary, to_markdown(summary))
    plot_throughput(summary, out_dir / f"{NAME}.png")
    return summary


async def _ask(client, model: str, user_id: str, question: str, mode: str, k: int, w: int, max_tokens: int,
               ignore_eos: bool) -> dict:
    t0 = time.perf_counter()
    ttft, usage, report = None, None, None
    stream = await client.chat.completions.create(
        model=model, user=user_id, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"memory": {"mode": mode, "k": k, "context_window": w}, "ignore_eos": ignore_eos})
    async for chunk in stream:
        if report is None:
            report = (chunk.model_extra or {}).get("memory")
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - t0
    return {"ttft_s": latency if ttft is None else ttft, "latency_s": latency,
            "prompt_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "kv_tokens": (report or {}).get("kv_tokens", 0)}


async def _measure(server: ServerProcess, plan, todo, log: ResultLog, *, k: int, w: int, max_tokens: int,
                   ignore_eos: bool, warm: bool = True) -> None:
    """Run each ``(users, mode)`` level of ``todo`` into ``log``, after a warm-up pass over
    ``plan`` that loads every fact's KV into the connector's device tier (``warm``)."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=_KEY, max_retries=0, timeout=600)
    async with httpx.AsyncClient(headers=server.headers, timeout=60) as http:
        model = (await client.models.list()).data[0].id
        for user_id, _conv, _facts, questions in tqdm(plan if warm else [], unit="user",
                                                      desc="warm-up (KV into the engine's device tier)"):
            for q in questions:
                await client.chat.completions.create(
                    model=model, user=user_id, messages=[{"role": "user", "content": q}], max_tokens=1,
                    extra_body={"memory": {"k": k, "context_window": w, "wait_for_kv": True}})
        for n, mode in tqdm(todo, desc="levels", unit="level"):
            (await http.post(server.vllm_url + "/reset_prefix_cache")).raise_for_status()

            async def user(user_id: str, questions: list[str]) -> list[dict]:
                return [await _ask(client, model, user_id, q, mode, k, w, max_tokens, ignore_eos) for q in questions]

            t0 = time.perf_counter()
            per_user = await asyncio.gather(*(user(u, qs) for u, _c, _f, qs in plan[:n]))
            wall = time.perf_counter() - t0
            outs = [o for rows in per_user for o in rows]
            log.add(f"{mode}|users={n}", {"mode": mode, "users": n, "requests": len(outs), "wall_s": wall,
                                          **{f: [o[f] for o in outs] for f in outs[0]}})
    await client.close()


def summarize(rows: list[dict], levels: Sequence[int]) -> dict:
    """Requests/s, output tokens/s and TTFT p50/p99 per (mode, users); inject/text ratios."""
    return summarize_levels(rows, levels, lambda r: {"kv_tokens_mean": sum(r["kv_tokens"]) / len(r["kv_tokens"])})


def to_markdown(summary: dict) -> str:
    """Tables of the summary."""
    s = summary["settings"]
    length = (f"exactly {s['max_tokens']} answer tokens (`ignore_eos`: both modes decode the same)"
              if s.get("fixed_length") else f"up to {s['max_tokens']} answer tokens (stopping at EOS)")
    rows = [[c["mode"], c["users"], c["requests"], f"{c['requests_per_s']:.2f}", f"{c['output_tokens_per_s']:.1f}",
             f"{c['ttft_p50_ms']:.0f}", f"{c['ttft_p99_ms']:.0f}", f"{c['prompt_tokens_mean']:.0f}",
             f"{c['kv_tokens_mean']:.0f}", f"{c['output_tokens_mean']:.1f}"] for c in summary["cells"]]
    table = markdown_table(["mode", "users", "requests", "requests/s", "output tokens/s", "TTFT p50 (ms)",
                            "TTFT p99 (ms)", "prompt tokens", "as KV", "output tokens"], rows)
    tok = summary["inject_over_text_output_tokens_per_s"]
    ratios = markdown_table(["users", "requests/s inject / text", "output tokens/s inject / text"],
                            [[n, f"{v:.2f}x", f"{tok[n]:.2f}x"]
                             for n, v in summary["inject_over_text_requests_per_s"].items()])
    from inferscale.bench.common import machine

    m = machine()
    flags = "" if s.get("fixed_length", True) else " --natural-length"
    reproduce = (f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('gpu') or 'no GPU'}. Reproduce: `inferscale bench "
                 f"serve --users {','.join(map(str, s['levels']))} --facts-per-user {s['facts_per_user']} "
                 f"--requests-per-user {s['requests_per_user']} --k {s['k']} --context-window {s['context_window']} "
                 f"--max-tokens {s['max_tokens']} --dtype {s['dtype']}{flags} --out <folder>`.")
    return (f"# Throughput through `inferscale serve`: concurrent users over HTTP\n\nThe `openai` SDK's async "
            f"client, streamed chat completions, through InferScale's front to vLLM's OpenAI server. Each user: "
            f"{s['facts_per_user']} facts of its own, {s['requests_per_user']} questions in a row, k={s['k']}, KV at "
            f"w={s['context_window']}, {length}, greedy; dtype {s['dtype']}. TTFT is "
            f"the client's (retrieval and both HTTP hops included).\n\n{reproduce}\n\n{table}\n\n{ratios}\n")
