"""The served arm of ``inferscale bench encode``: what a front of ``inferscale serve`` holds and
how a question right after ``add`` fares, per encoder (issue 51).

Per arm (``kv_encoder`` ``engine`` or ``transformers``, set through ``INFERSCALE_KV_ENCODER``),
one ``inferscale serve`` (one front process, vLLM's OpenAI server behind it) over a fresh data
dir:

- **the front's resident memory** (RSS of the front's process, bytes, ``psutil``): once the
  server is ready, and after ``facts`` LoCoMo observations were added over HTTP and their KV
  made (a chat with ``"memory": {"wait_for_kv": true}``);
- **a question right after add**: one memory added over HTTP, then at once a streamed chat
  whose answer needs it, against the same chat once its KV is ready; TTFT measured by the
  client (request sent to the first chunk with answer text, seconds), ``samples`` times each
  (a new memory each time), and which source the chat's report gave the memory.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx
import openai
import psutil

from inferscale.bench.serve import _KEY, ServerProcess


def _stream_ttft(client: openai.OpenAI, model: str, user: str, question: str) -> tuple[float, dict]:
    """Seconds from sending a streamed chat to its first chunk with text, and its memory report."""
    t0 = time.perf_counter()
    first, report = None, {}
    stream = client.chat.completions.create(model=model, user=user, max_tokens=4, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": question}])
    for chunk in stream:
        extra = chunk.model_extra or {}
        report = extra.get("memory", report)
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), report


def served_arm(arm: str, store: Path, facts: list[str], *, dtype: str, samples: int = 5) -> dict:
    """One served arm (module docstring); returns its figures."""
    (store / "logs").mkdir(parents=True, exist_ok=True)
    server = ServerProcess(store, dtype, 8, store / "logs" / f"bench-encode-{arm}.log",
                           environment={"INFERSCALE_KV_ENCODER": arm})
    try:
        server.wait_ready()
        front = psutil.Process(server.proc.pid)
        out: dict = {"arm": arm, "front_rss_ready_bytes": front.memory_info().rss}
        http = httpx.Client(base_url=server.url, headers=server.headers, timeout=900)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=_KEY, max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        r = http.post("/memories", json={"messages": [{"role": "user", "content": f} for f in facts],
                                         "user_id": "served", "infer": False})
        r.raise_for_status()
        client.chat.completions.create(model=model, user="served", max_tokens=1, messages=[
            {"role": "user", "content": "Hello"}], extra_body={"memory": {"wait_for_kv": True}})
        out["front_rss_after_kv_bytes"] = front.memory_info().rss
        after, ready, sources = [], [], []
        for i in range(samples):
            user = f"fresh-{i}"
            http.post("/memories", json={"messages": f"My locker at the gym is number {4417 + i}.",
                                         "user_id": user}).raise_for_status()
            t, report = _stream_ttft(client, model, user, "What is my locker number?")
            after.append(t)
            sources.append(sorted(report.get("kv_sources", {}).values()))
            client.chat.completions.create(model=model, user=user, max_tokens=1, messages=[
                {"role": "user", "content": "Hello"}], extra_body={"memory": {"wait_for_kv": True}})
            ready.append(_stream_ttft(client, model, user, "What is my locker number?")[0])
        out.update(after_add_ttft_s=after, ready_ttft_s=ready, after_add_sources=sources,
                   front_rss_max_bytes=front.memory_info().rss,
                   after_add_ratio=statistics.median(after) / statistics.median(ready))
        return out
    finally:
        server.stop()
