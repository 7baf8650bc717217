"""``inferscale serve`` on loopback: the real vLLM OpenAI server (its own processes), the real
SmolLM2 weights, Chroma on disk, driven with the ``openai`` client and plain HTTP.

One server is started for the module (about a minute here); the last test kills it with
SIGKILL in the middle of a stream of adds and starts another over the same data dir.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from inferscale.server.ports import free_port

pytestmark = pytest.mark.slow

KEY = "test-key-7d1f"
AUTH = {"Authorization": f"Bearer {KEY}"}
FACTS = {
    "alice": ["My dog is called Rex.", "I am allergic to peanuts."],
    "bob": ["My cat is called Tom.", "I work as a pilot."],
}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    data_dir: Path
    log: Path

    @property
    def vllm_url(self) -> str:
        found = re.search(r"on (http://127\.0\.0\.1:\d+) \(log", self.log.read_text())
        assert found, self.log.read_text()
        return found.group(1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def http(self, method: str, path: str, **kw) -> httpx.Response:
        kw.setdefault("timeout", 300)
        return httpx.request(method, self.url + path, headers={**AUTH, **kw.pop("headers", {})}, **kw)

    def counter(self, name: str) -> float:
        text = self.http("GET", "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"vllm:inferscale_{name}_total{{"))


def start_server(data_dir: Path, port: int | None = None) -> Server:
    port = port or free_port()
    log = data_dir.parent / f"serve-{port}.log"
    exe = Path(sys.executable).with_name("inferscale")
    env = {**os.environ, "INFERSCALE_API_KEY": KEY, "VLLM_SERVER_DEV_MODE": "1", "INFERSCALE_DTYPE": "float32"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--data-dir", str(data_dir)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, data_dir, log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"inferscale serve exited:\n{log.read_text()[-3000:]}"
        try:
            if server.http("GET", "/ready").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError(f"inferscale serve not ready after 600 s:\n{log.read_text()[-3000:]}")


def listening(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    s = start_server(root / "data")
    ids = {}
    for user, facts in FACTS.items():
        r = s.http("POST", "/memories", json={"messages": [{"role": "user", "content": f} for f in facts],
                                              "user_id": user})
        assert r.status_code == 200, r.text
        ids[user] = {e["id"] for e in r.json()["results"]}
    s.ids = ids
    yield s
    if s.proc.poll() is None:  # the last test may have killed it already
        s.proc.kill()


def chat(server: Server, question: str, user: str = "alice", **extra):
    memory = extra.pop("memory", {})
    return server.client().chat.completions.create(
        model=server.client().models.list().data[0].id, messages=[{"role": "user", "content": question}],
        user=user, max_tokens=extra.pop("max_tokens", 16), temperature=0, extra_body={"memory": memory}, **extra)


def report(resp) -> dict:
    return resp.model_extra["memory"]


def test_chat_injects_the_users_memory_then_text_and_none_modes(server):
    first = chat(server, "What is my dog called?", memory={"wait_for_kv": True})
    mem = report(first)
    assert mem["mode"] == "inject" and set(mem["kv_memory_ids"]) == server.ids["alice"]
    assert {m["id"] for m in mem["memories"]} == server.ids["alice"]
    assert mem["kv_tokens"] > 0 and mem["injected_tokens"] == mem["kv_tokens"]
    assert set(mem["kv_sources"]) == server.ids["alice"]  # where each memory's KV came from (issue 31)
    assert set(mem["kv_sources"].values()) <= {"device", "disk", "encoded now"}
    assert "Rex" in first.choices[0].message.content
    metrics = server.http("GET", "/metrics").text  # the front's KV pool, per tier
    assert 'inferscale_kv_bytes{tier="disk"}' in metrics and 'inferscale_kv_hits_total{tier="device"}' in metrics
    assert "inferscale_kv_reencodes_total" in metrics

    text = chat(server, "What is my dog called?", memory={"mode": "text"})
    tm = report(text)
    assert tm["mode"] == "text" and tm["kv_tokens"] == 0 and tm["injected_tokens"] == 0
    assert set(tm["text_memory_ids"]) == server.ids["alice"] and "Rex" in text.choices[0].message.content

    none = chat(server, "What is my dog called?", memory={"mode": "none"})
    assert report(none) == {"mode": "none", "injected_tokens": 0, "replica": 0}


def test_streaming_chat_carries_the_memory_report_first(server):
    stream = server.client().chat.completions.create(
        model=server.client().models.list().data[0].id, user="bob", max_tokens=16, temperature=0, stream=True,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is my job?"}])
    chunks = list(stream)
    assert set(chunks[0].model_extra["memory"]["kv_memory_ids"]) <= server.ids["bob"]
    assert all("memory" not in (c.model_extra or {}) for c in chunks[1:])
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.strip()


def test_exact_context_injection_matches_prefill_logprobs(server):
    """One memory at w=0 is encoded after exactly the preamble that precedes it in the
    prompt: the exact-context case, so injected and prefilled logprobs agree (fp32)."""
    kw = dict(max_tokens=1, logprobs=True, top_logprobs=5)
    inj = chat(server, "Which food must I avoid?", memory={"k": 1, "context_window": 0, "wait_for_kv": True}, **kw)
    assert report(inj)["injected_tokens"] > 0 and len(report(inj)["kv_memory_ids"]) == 1
    txt = chat(server, "Which food must I avoid?", memory={"k": 1, "context_window": 0, "mode": "text"}, **kw)
    a = {t.token: t.logprob for t in inj.choices[0].logprobs.content[0].top_logprobs}
    b = {t.token: t.logprob for t in txt.choices[0].logprobs.content[0].top_logprobs}
    common = set(a) & set(b)
    assert len(common) >= 3 and max(abs(a[t] - b[t]) for t in common) < 1e-3
    # text_tail=1: the one memory comes as text after the injected preamble, the prompt text mode prefills
    tail = chat(server, "Which food must I avoid?", memory={"k": 1, "context_window": 0, "text_tail": 1}, **kw)
    assert report(tail)["kv_memory_ids"] == [] and 0 < report(tail)["injected_tokens"] < report(inj)["injected_tokens"]
    c = {t.token: t.logprob for t in tail.choices[0].logprobs.content[0].top_logprobs}
    assert max(abs(c[t] - b[t]) for t in set(c) & set(b)) < 1e-3


def test_text_request_after_injection_gets_its_own_kv(server):
    """The injected request's blocks are salted: a text request with the same tokens is
    prefilled (its logprobs equal those from a cold prefix cache), never served that KV."""
    kw = dict(max_tokens=1, logprobs=True, top_logprobs=5)
    q = "Tell me about my pets and my allergies."
    reset = lambda: httpx.post(server.vllm_url + "/reset_prefix_cache", headers=AUTH, timeout=60)  # noqa: E731
    assert reset().status_code == 200
    cold = chat(server, q, memory={"mode": "text", "context_window": 3}, **kw)
    assert reset().status_code == 200
    inj = chat(server, q, memory={"context_window": 3, "wait_for_kv": True}, **kw)
    assert report(inj)["injected_tokens"] > 0
    after = chat(server, q, memory={"mode": "text", "context_window": 3}, **kw)
    top = lambda r: [(t.token, t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs]  # noqa: E731
    assert top(after) == top(cold)


def test_the_front_encodes_on_vllm_and_never_loads_the_model(server):
    """Issue 51: a front's memories get their KV from vLLM (prefill-only requests below every
    request); the front process holds no copy of the LLM's weights."""
    r = server.http("POST", "/memories", json={"messages": "My boat is called Sea Breeze.", "user_id": "sailor"})
    mid = r.json()["results"][0]["id"]
    deadline = time.monotonic() + 300
    while not next(m for m in server.http("GET", "/ui/api/memories?user_id=sailor").json()["results"]
                   if m["id"] == mid)["kv"]:
        assert time.monotonic() < deadline
        time.sleep(1)
    metrics = server.http("GET", "/metrics").text
    loaded = [line for line in metrics.splitlines() if line.startswith("inferscale_kv_encoder_model_loaded")]
    assert loaded and all(line.endswith(" 0.0") for line in loaded), loaded
    encodes = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("inferscale_kv_engine_encodes_total")]
    assert encodes and sum(encodes) >= 1, encodes
    answer = chat(server, "What is my boat called?", user="sailor")
    assert report(answer)["kv_memory_ids"] == [mid] and report(answer)["injected_tokens"] > 0, report(answer)


def test_no_scope_is_served_another_scopes_cached_blocks_as_text_kv_or_without_memory(server):
    """Issue 52: with the memory as text (not encoded yet, or mode text), every scope's requests
    carried the same cache salt, so ``cached_tokens`` confirmed a guess of another scope's
    memory a block at a time. Now each scope has its own salt, in every mode; a scope's own
    repeat still hits the prefix cache."""
    secret = ("My locker code is 4417, my bank PIN is 9921, my passport number is X5508812, my locker is in "
              "hall B near the north stairs, and my spare key hides under the blue flower pot by the back door.")
    for user in ("salt-a", "salt-b"):
        r = server.http("POST", "/memories", json={"messages": secret, "user_id": user, "infer": False})
        assert r.status_code == 200, r.text
    question = "What is my locker code? Answer with the digits only, please, and nothing else."

    def cached(user: str, mode: str) -> int:
        # without memory, the secret is in the user's own message (their conversation is theirs too)
        # (the question is long enough that the prompt's first whole block holds the memory lines)
        content = f"{question} {question}" if mode == "text" else f"{secret} {secret} {question}"
        r = server.client().chat.completions.create(
            model=server.client().models.list().data[0].id, messages=[{"role": "user", "content": content}],
            user=user, max_tokens=1, temperature=0, extra_body={"memory": {"mode": mode}})
        assert r.usage.prompt_tokens > 128, r.usage  # a whole block at least
        assert mode == "none" or report(r)["memories"], report(r)
        return r.usage.prompt_tokens_details.cached_tokens or 0

    for mode in ("text", "none"):
        first = cached("salt-a", mode)
        again = cached("salt-a", mode)
        other = cached("salt-b", mode)
        assert again >= 128, (mode, first, again)  # a block (128 tokens on CPU) of salt-a's own prompt
        assert other == 0, (mode, again, other)  # salt-b shares no block with salt-a, whatever their tokens


def test_eight_users_at_once_each_get_their_own_memories(server):
    users = {f"user{i}": f"My locker number is {1000 + 37 * i}." for i in range(8)}
    owned = {}
    for user, fact in users.items():
        r = server.http("POST", "/memories", json={"messages": fact, "user_id": user})
        owned[user] = {e["id"] for e in r.json()["results"]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = dict(zip(users, pool.map(lambda u: chat(server, "What is my locker number?", user=u), users)))
    for user, resp in got.items():
        mem = report(resp)
        assert {m["id"] for m in mem["memories"]} == owned[user]
        assert set(mem["kv_memory_ids"]) | set(mem["text_memory_ids"]) == owned[user]


def test_a_memory_added_over_http_is_used_by_the_next_chat(server):
    r = server.http("POST", "/memories", json={"messages": "My favourite colour is teal.", "user_id": "carol"})
    new_id = r.json()["results"][0]["id"]
    resp = chat(server, "What is my favourite colour?", user="carol")
    assert [m["id"] for m in report(resp)["memories"]] == [new_id]
    assert "teal" in resp.choices[0].message.content.lower()


def test_memories_a_chat_serves_as_text_are_captured_in_vllms_process(server):
    """Capture on a miss through ``inferscale serve`` (issue 39): a chat right after an add
    serves the new memories as text; the connector in vLLM's process reads their KV out of the
    paged cache (its chat template put each memory line where the front planned it: nothing
    skipped), and the next chat serves every one as KV."""
    facts = [f"My colleague number {i} is called {name}." for i, name in enumerate(
        ("Ana", "Bruno", "Chloe", "Dmitri", "Eva", "Farid", "Greta", "Hugo", "Ines", "Jonas"))]
    skipped = server.counter("capture_skipped")
    r = server.http("POST", "/memories", json={"messages": [{"role": "user", "content": f} for f in facts],
                                              "user_id": "colleagues"})
    assert r.status_code == 200, r.text
    first = report(chat(server, "Who is my colleague number 3?", user="colleagues", memory={"k": 10}))
    as_text = {i for i, s in first["kv_sources"].items() if s.startswith("text")}
    assert as_text, first["kv_sources"]  # the encoder cannot have stored ten memories' KV already
    # the capture writer beside vLLM's worker stores them at the lowest CPU priority: once the
    # engine is idle, each memory served as text has its KV (the page at /ui shows the same)
    deadline = time.monotonic() + 120
    while True:
        listed = server.http("GET", "/ui/api/memories", params={"user_id": "colleagues"}).json()["results"]
        if all(m["kv"] for m in listed if m["id"] in as_text):
            break
        assert time.monotonic() < deadline, "the memories served as text never got their KV"
        time.sleep(0.2)
    second = report(chat(server, "Who is my colleague number 3?", user="colleagues", memory={"k": 10}))
    assert not [s for s in second["kv_sources"].values() if s.startswith("text")], second["kv_sources"]
    assert {second["kv_sources"][i] for i in as_text} <= {"device (captured)", "disk (captured)", "device", "disk"}
    assert second["injected_tokens"] == second["kv_tokens"] > first["injected_tokens"]
    # no exact count of captures: vLLM publishes the connector's counters only on an engine step
    # after the writer reports (here 0 when the page already showed the KV; 18 for 10 in the full
    # suite, twice), and the background encoder may store a memory's KV first
    assert server.counter("capture_errors") == 0
    assert server.counter("capture_skipped") == skipped
    assert "inferscale_kv_captured_hits_total" in server.http("GET", "/metrics").text


def test_missing_and_corrupted_kv_fall_back_to_the_text_answer(server):
    """Deleting or corrupting a user's fact KV on disk: the front sees the deleted file gone
    (as it sees a file another process evicted) and serves that memory as text; the connector
    cannot verify the corrupted segment, injects only the preamble, and the answer is the
    text-mode answer."""
    user = "dave"
    messages = [{"role": "user", "content": t} for t in ("I live in Lisbon.", "I play the cello.")]
    r = server.http("POST", "/memories", json={"messages": messages, "user_id": user})
    ids = [e["id"] for e in r.json()["results"]]
    q, kw = "Where do I live?", dict(max_tokens=12, logprobs=True, top_logprobs=3)
    text = chat(server, q, user=user, memory={"mode": "text"}, **kw)
    files = {i: sorted((server.data_dir / "kv" / i).glob("*.safetensors")) for i in ids}
    for fid in ids:  # wait until the background encoder wrote both facts' KV
        deadline = time.monotonic() + 120
        while not files[fid] and time.monotonic() < deadline:
            time.sleep(0.5)
            files[fid] = sorted((server.data_dir / "kv" / fid).glob("*.safetensors"))
        assert files[fid], f"no KV written for {fid}"
    files[ids[0]][0].unlink()                                   # deleted
    data = files[ids[1]][0].read_bytes()
    files[ids[1]][0].write_bytes(data[: len(data) // 2])        # corrupted (truncated)
    missing, fallbacks = server.counter("missing_segments"), server.counter("fallbacks")
    got = chat(server, q, user=user, **kw)
    mem = report(got)
    assert mem["kv_sources"][ids[0]] == "text: evicted"        # the front sees the deleted file gone ...
    assert mem["kv_memory_ids"] == [ids[1]]                    # ... and plans the corrupted one as KV ...
    assert 0 < mem["injected_tokens"] < mem["kv_tokens"]       # ... which the connector refuses: the preamble only
    assert got.choices[0].message.content == text.choices[0].message.content
    assert server.counter("missing_segments") > missing and server.counter("fallbacks") > fallbacks


def test_bad_requests_are_4xx_and_the_server_keeps_serving(server):
    model = server.client().models.list().data[0].id
    cases = [
        ("POST", "/v1/chat/completions", dict(content=b"{not json", headers={"content-type": "application/json"}), 400),
        ("GET", "/v1/no-such-route", {}, 404),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "memory": {"k": 10_000},
                                                    "messages": [{"role": "user", "content": "hi"}]}), 400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "memory": {"mode": "loud"},
                                                    "messages": [{"role": "user", "content": "hi"}]}), 400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "messages": [{"role": "user", "content": "hi"}]}),
         400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "max_tokens": 16, "messages": [
            {"role": "user", "content": "word " * 9000}]}), 400),
        ("POST", "/search", dict(json={"query": "x", "user_id": "alice", "filters": {"a": {"$bogus": 1}}}), 400),
        ("GET", "/memories/nope?user_id=alice", {}, 404),
        ("POST", "/memories", dict(json={"messages": "x"}), 400),
        ("POST", "/memories", dict(json={"messages": "x", "user_id": "a\x00b"}), 400),
        ("POST", "/memories", dict(content=b"{not json", headers={"content-type": "application/json"}), 400),
        ("DELETE", "/memories", {}, 400),
        # from the breaker
        ("POST", "/v1/chat/completions", dict(content=b'{"user": "alice", "x": ' + b"[" * 5000 + b"]" * 5000
                                               + b', "messages": [{"role": "user", "content": "hi"}]}',
                                               headers={"content-type": "application/json"}), 400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "stream": "no",
                                                    "messages": [{"role": "user", "content": "hi"}]}), 400),
        ("POST", "/v1/chat/completions", dict(content=b'{"user": "alice", "temperature": NaN, "messages": '
                                               b'[{"role": "user", "content": "hi"}]}',
                                               headers={"content-type": "application/json"}), 400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "messages": [
            {"role": "system", "content": {"x": 1}}, {"role": "user", "content": "hi"}]}), 400),
        ("POST", "/memories", dict(json={"messages": "x", "user_id": "alice", "metadata": {"a": [[[[[[[[[[[[[[[[[
            [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}), 400),
        ("POST", "/memories", dict(json={"messages": "x", "user_id": "alice", "infer": "yes"}), 422),
        # vLLM's own refusals, in the front's shape (issue 53: they had no detail)
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "max_tokens": -1,
                                                    "messages": [{"role": "user", "content": "hi"}]}), 400),
        ("POST", "/v1/chat/completions", dict(json={"model": model, "user": "alice", "max_tokens": -1, "stream": True,
                                                    "messages": [{"role": "user", "content": "hi"}]}), 400),
        ("POST", "/v1/completions", dict(json={"model": model, "prompt": "hi", "max_tokens": -1}), 400),
    ]
    for method, path, kw, status in cases:
        r = server.http(method, path, **kw)
        assert r.status_code == status, (path, kw, r.text)
        assert r.json()["error"]["message"], r.text
        assert r.json()["detail"] == r.json()["error"]["message"], r.text  # one shape, vLLM's errors too
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert "x-inferscale-worker" not in wrong.headers  # no pid to a client without the key (issue 42)
    assert server.http("GET", "/v1/models").headers["x-inferscale-worker"].isdigit()  # with it, the front's pid
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # liveness needs no key
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"  # nor readiness (a probe sends none)
    assert httpx.get(server.url + "/memories", params={"user_id": "alice"}).status_code == 401  # data does
    assert "Rex" in chat(server, "What is my dog called?").choices[0].message.content
    assert "user_id=alice" in server.http("DELETE", "/memories").json()["error"]["message"]  # HTTP, not Python, advice


def test_server_only_fields_in_vllm_xargs_are_dropped_and_models_name_no_path(server):
    """vLLM reads ``kv_transfer_params`` from ``vllm_xargs`` too: a client's copy there is
    dropped like a top-level one (it was a 500, and a way to ask for any KV); ``/v1/models``
    shows no folder of the server's (issue 42)."""
    model = server.client().models.list().data[0].id
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                       ("/v1/chat/completions", {"user": "alice", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hello"}]})):
        for xargs in ({"kv_transfer_params": "x"}, {"kv_transfer_params": {"inferscale": {"segments": "x"}},
                                                    "cache_salt": "y"}):
            r = server.http("POST", path, json={"model": model, **body, "vllm_xargs": xargs})
            assert r.status_code == 200, (path, xargs, r.text)
    cards = server.http("GET", "/v1/models").json()["data"]
    assert cards and all(c["root"] == c["id"] for c in cards), cards
    text = json.dumps(cards)
    assert str(Path.home()) not in text and os.sep + "models" + os.sep not in text, text


def test_mcp_answer_on_the_front_injects_the_users_memories(server):
    """``/mcp``'s ``answer`` tool on a real ``inferscale serve``: the chat route's own request
    (memory block, injection plan) sent to vLLM; alice's memories come as KV and are used."""
    import asyncio

    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def ask() -> dict:
        transport = streamable_http_client(f"{server.url}/mcp", http_client=httpx2.AsyncClient(headers=AUTH,
                                                                                               timeout=300))
        async with Client(transport) as client:
            result = await client.call_tool("answer", {"question": "What is my dog called?", "user_id": "alice",
                                                       "max_tokens": 16})
            assert not result.is_error, result.content
            return result.structured_content

    answer = asyncio.run(ask())
    assert set(answer["kv_memory_ids"]) == server.ids["alice"] and answer["injected_tokens"] > 0, answer
    assert "Rex" in answer["text"], answer


def test_one_server_per_data_dir_and_front_metrics(server):
    exe = Path(sys.executable).with_name("inferscale")
    second = subprocess.run([str(exe), "serve", "--port", str(free_port()), "--data-dir", str(server.data_dir)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "INFERSCALE_API_KEY": KEY})
    assert second.returncode == 2 and f"pid {server.proc.pid}" in second.stderr, second.stdout + second.stderr
    metrics = server.http("GET", "/metrics").text
    injected = [line for line in metrics.splitlines() if line.startswith("inferscale_chat_injected_tokens_total")]
    assert injected and float(injected[0].split()[-1]) > 0
    assert (server.data_dir / "logs" / "vllm.log").stat().st_size > 0


def test_a_second_server_on_a_busy_port_fails_in_seconds_with_one_line(server, tmp_path):
    """On the running server's port, and on the port of a server that is still starting vLLM
    (the race of issue 28: the second one spent 36 s starting vLLM before it failed)."""
    exe = Path(sys.executable).with_name("inferscale")
    port = int(server.url.rsplit(":", 1)[1])

    def second(on: int, name: str) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        proc = subprocess.run([str(exe), "serve", "--port", str(on), "--data-dir", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=120)
        return proc, time.monotonic() - t0

    busy, took = second(port, "busy")
    assert busy.returncode == 2 and took < 10, (took, busy.stdout, busy.stderr)
    assert busy.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in busy.stderr and "--port" in busy.stderr
    assert not (tmp_path / "busy").exists()  # refused before it touched its data dir

    starting_port = free_port()
    log = tmp_path / "first.log"
    with open(log, "w") as out:  # a first server, still starting vLLM while the second tries its port
        first = subprocess.Popen([str(exe), "serve", "--port", str(starting_port), "--data-dir", str(tmp_path / "a")],
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "starting vLLM" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        raced, took = second(starting_port, "b")
        assert raced.returncode == 2 and took < 10, (took, raced.stdout, raced.stderr)
        assert f"127.0.0.1:{starting_port}" in raced.stderr and raced.stderr.strip().count("\n") == 0
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(120) == 0, log.read_text()


def test_memory_routes_follow_mem0(server):
    r = server.http("POST", "/memories", json={"messages": "I drink green tea.", "user_id": "erin",
                                               "metadata": {"topic": "food"}})
    mid = r.json()["results"][0]["id"]
    assert server.http("GET", f"/memories/{mid}?user_id=erin").json()["memory"] == "I drink green tea."
    assert [m["id"] for m in server.http("GET", "/memories?user_id=erin").json()["results"]] == [mid]
    found = server.http("POST", "/search", json={"query": "tea", "user_id": "erin", "filters": {"topic": "food"}})
    assert [m["id"] for m in found.json()["results"]] == [mid]
    current = server.http("POST", "/search", json={"query": "tea", "filters": {"user_id": "erin", "topic": "food"}})
    assert current.json() == found.json()  # Mem0's current style: the scope inside filters
    top = server.http("POST", "/search", json={"query": "tea", "filters": {"user_id": "erin"}, "top_k": 1})
    assert [m["id"] for m in top.json()["results"]] == [mid]  # and its top_k
    clash = server.http("POST", "/search", json={"query": "tea", "user_id": "erin", "top_k": 1, "limit": 2})
    assert clash.status_code == 400 and "disagree" in clash.json()["error"]["message"]
    dense = server.http("POST", "/search", json={"query": "tea", "user_id": "erin", "mode": "dense"})
    assert [m["id"] for m in dense.json()["results"]] == [mid]  # the ranking is chosen per request, as in search()
    bad = server.http("POST", "/search", json={"query": "tea", "user_id": "erin", "mode": "bm25"})
    assert bad.status_code == 422 and "mode" in bad.json()["error"]["message"]
    assert server.http("POST", "/search", json={"query": "tea", "filters": {"topic": "food"}}).status_code == 400
    assert server.http("PUT", f"/memories/{mid}?user_id=erin", json={"text": "I drink black tea."}).status_code == 200
    events = server.http("GET", f"/memories/{mid}/history?user_id=erin").json()
    assert [e["event"] for e in events] == ["ADD", "UPDATE"]
    assert server.http("GET", f"/memories/{mid}?user_id=bob").status_code == 404  # another scope
    assert server.http("DELETE", f"/memories/{mid}?user_id=erin").status_code == 200
    assert server.http("GET", "/memories?user_id=erin").json()["results"] == []
    assert server.http("GET", "/docs").status_code == 200 and "/search" in server.http("GET", "/openapi.json").text


def langchain_chat(server: Server, user: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=server.client().models.list().data[0].id,
                      temperature=0, max_tokens=kw.pop("max_tokens", 24), max_retries=0,
                      model_kwargs={"user": user}, **kw)


def test_langchain_chatopenai_remembers_across_sessions(server):
    # session 1: the agent stores what the user said (as it would after every turn)
    said = "Remember this: my sister is called Ingrid."
    r = server.http("POST", "/memories", json={"messages": [{"role": "user", "content": said}], "user_id": "frank"})
    assert r.status_code == 200
    # session 2: a new chat model, no history; the memory comes from the server
    answer = langchain_chat(server, "frank", include_response_headers=True).invoke(
        [("user", "What is my sister called?")])
    assert "Ingrid" in answer.content
    headers = answer.response_metadata["headers"]  # the memory report, for clients that drop unknown fields
    assert headers["x-inferscale-mode"] == "inject" and int(headers["x-inferscale-kv-tokens"]) > 0
    assert headers["x-inferscale-memory-ids"] == r.json()["results"][0]["id"]


def test_langchain_forced_tool_call_and_structured_output_through_the_server(server):
    from pydantic import BaseModel, Field

    class Allergy(BaseModel):
        """A food the user must avoid."""

        food: str = Field(description="the food, one word")

    llm = langchain_chat(server, "alice", max_tokens=200)  # room for the whole <tool_call> envelope
    tooled = llm.bind_tools([Allergy], tool_choice="Allergy")
    msg = tooled.invoke([("user", "Which food am I allergic to?")])
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Allergy"
    assert isinstance(msg.tool_calls[0]["args"]["food"], str)
    parsed = llm.with_structured_output(Allergy, method="json_schema").invoke([("user", "Which food am I allergic to?")])
    assert isinstance(parsed, Allergy) and parsed.food


ROOT = Path(__file__).resolve().parent.parent
LLAMAINDEX_CLIENT = ROOT / ".venv-llamaindex-client" / "bin" / "python"


def test_llamaindex_openailike_in_its_own_environment_through_the_server(server):
    """The documented LlamaIndex example, run by the client environment ``scripts/install.sh``
    makes (``OpenAILike``, llama-index-core 0.14, no InferScale or vLLM in it)."""
    assert LLAMAINDEX_CLIENT.exists(), "no .venv-llamaindex-client: run `bash scripts/install.sh`"
    run = subprocess.run([str(LLAMAINDEX_CLIENT), str(ROOT / "integrations/llama_index/examples/server_openailike.py"),
                          "--base-url", server.url, "--api-key", KEY, "--user", "gina", "--wait-for-kv", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    (added,) = out["added_ids"]
    for step in ("chat", "stream"):  # session 2 remembers session 1's fact, as injected KV
        report = out[step]["memory"]
        assert report["mode"] == "inject" and report["kv_memory_ids"] == [added] and report["kv_tokens"] > 0
        assert "peanut" in out[step]["text"].lower()
    assert out["stream"]["chunks"] > 1
    (call,) = out["tool_calls"]
    assert call["name"] == "record_allergy" and isinstance(call["kwargs"]["food"], str)
    assert isinstance(out["structured"]["food"], str) and out["structured"]["food"]
    # a wrong key is the script's clear failure, not a traceback
    bad = subprocess.run([str(LLAMAINDEX_CLIENT), str(ROOT / "integrations/llama_index/examples/server_openailike.py"),
                          "--base-url", server.url, "--api-key", "wrong", "--user", "gina"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "401" in bad.stderr and "Traceback" not in bad.stderr
    assert "wrong API key" in bad.stderr  # the server's own message, not only the status


MEM0_CLIENT = ROOT / ".venv-mem0-client" / "bin" / "python"


def test_mem0s_own_client_in_its_own_environment_then_its_memories_as_kv(server):
    """The documented Mem0 example (docs/server.md): Mem0's ``MemoryClient`` with only ``host``
    changed makes every memory call, and a chat as that user gets the memories as injected KV."""
    assert MEM0_CLIENT.exists(), "no .venv-mem0-client: run `bash scripts/install.sh`"
    # one of the example's facts is there already (docs/server.md's example ran first): it still runs
    (cat,) = [e["id"] for e in server.http("POST", "/memories", json={"messages": "My cat is called Miso.",
                                                                      "user_id": "mem0-user"}).json()["results"]]
    run = subprocess.run([str(MEM0_CLIENT), str(ROOT / "integrations/mem0/examples/mem0_client.py"),
                          "--base-url", server.url, "--api-key", KEY, "--user", "mem0-user", "--json"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "MEM0_TELEMETRY": "False"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    (job,) = (r["id"] for r in out["add"]["results"])  # only what was new
    assert sorted(m["id"] for m in out["get_all"]["results"]) == sorted([cat, job])
    assert [h["id"] for h in out["search"]["results"]] == [cat]
    assert out["get"]["memory"] == "I work as a lighthouse keeper."
    assert out["update"]["memory"] == "I work as a ferry captain."
    assert [e["event"] for e in out["history"]] == ["ADD", "UPDATE"]
    assert ("user", "mem0-user") in {(e["type"], e["name"]) for e in out["users"]["results"]}
    chat_report = out["chat"]["memory"]
    assert chat_report["mode"] == "inject" and set(chat_report["kv_memory_ids"]) == {cat, job}
    assert chat_report["kv_tokens"] > 0 and "Miso" in out["chat"]["text"]
    assert [m["id"] for m in out["get_all_after_delete"]["results"]] == [cat]
    assert out["get_all_at_end"]["results"] == []
    # Mem0's default infer=True: the served LLM extracts the facts, and the answer is the Platform's
    r = server.http("POST", "/v3/memories/add/", headers={"Authorization": f"Token {KEY}"},
                    json={"messages": [{"role": "user", "content": "I am allergic to shellfish."}],
                          "user_id": "mem0-infer"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "SUCCEEDED" and all(e["event"] == "ADD" for e in r.json()["results"])
    stored = server.http("POST", "/v3/memories/", headers={"Authorization": f"Token {KEY}"},
                         json={"filters": {"user_id": "mem0-infer"}}).json()["results"]
    assert {m["id"] for m in stored} == {e["id"] for e in r.json()["results"]}
    # a wrong key is the client's clear failure, not a traceback
    bad = subprocess.run([str(MEM0_CLIENT), str(ROOT / "integrations/mem0/examples/mem0_client.py"),
                          "--base-url", server.url, "--api-key", "wrong"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "MEM0_TELEMETRY": "False"})
    assert bad.returncode == 1 and "wrong API key" in bad.stderr and "Traceback" not in bad.stderr


def readme_one_liners() -> list[str]:
    """The Python blocks under the README's ``## Switch in one line`` heading."""
    section = (ROOT / "README.md").read_text().split("\n## Switch in one line\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readmes_one_liners_run_as_written_against_the_server(server, tmp_path):
    """Each server block of the README's "Switch in one line", in the environment its user has
    (Mem0's SDK and LlamaIndex's client in their own), with the default address and ``<key>``
    replaced by this server's; the in-process block runs in tests/test_plain_scripts.py."""
    blocks = [b for b in readme_one_liners() if "127.0.0.1:8000" in b]
    assert len(blocks) == 4, "the README's one-liners changed: update this test"
    for i, block in enumerate(blocks):
        named = re.search(r"Run with (\.venv-[\w-]+)/bin/python", block)  # the environment the block names
        python = ROOT / named.group(1) / "bin" / "python" if named else Path(sys.executable)
        script = tmp_path / f"one_liner_{i}.py"
        script.write_text(block.replace("http://127.0.0.1:8000", server.url).replace("<key>", KEY))
        run = subprocess.run([str(python), str(script)], capture_output=True, text=True, timeout=600,
                             env={k: v for k, v in os.environ.items() if k != "MEM0_TELEMETRY"})  # as a user runs it
        assert run.returncode == 0, (block, run.stderr[-3000:])
        assert "posthog" not in run.stderr.lower() and "telemetry" not in run.stderr.lower(), run.stderr[-3000:]
        printed = run.stdout.strip()
        if "MemoryClient" in block:
            assert printed == "I am allergic to peanuts."
        elif "InferScaleStore" in block:
            assert printed == "{'avoid': 'peanuts'}"
        else:  # a chat answer from alice's memories (as KV, tests above check): the default model names it
            assert "peanut" in printed.lower(), (block, printed)
    # the store's item is one of alice's memories, so the chats above had it too
    assert any("avoid" in m["memory"] and "peanuts" in m["memory"]
               for m in server.http("GET", "/memories", params={"user_id": "alice"}).json()["results"])


def test_sigkill_during_adds_then_restart_keeps_every_acknowledged_add(server):
    """Runs last: kills the module's server."""
    acked, stop = [], threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            try:
                r = server.http("POST", "/memories", json={"messages": f"Note number {i} of the crash test.",
                                                           "user_id": "crash"}, timeout=10)
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                acked.append(r.json()["results"][0]["id"])
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(3)
    vllm = server.vllm_url
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    stop.set()
    t.join(30)
    assert len(acked) >= 5
    deadline = time.monotonic() + 120  # its vLLM server got SIGTERM when it died (PDEATHSIG) and stops
    while listening(vllm) and time.monotonic() < deadline:
        time.sleep(1)
    assert not listening(vllm), "the killed server's vLLM child is still serving"
    again = start_server(server.data_dir)
    try:
        stored = {m["id"] for m in again.http("GET", "/memories?user_id=crash&limit=100000").json()["results"]}
        assert set(acked) <= stored
        resp = again.client().chat.completions.create(
            model=again.client().models.list().data[0].id, user="crash", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Which notes do I have?"}])
        assert report(resp)["memories"]
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(120) == 0
        assert not listening(again.vllm_url), "SIGTERM left vLLM's server running"


def test_fronting_a_vllm_server_that_is_already_running(tmp_path):
    """``--vllm-url``: the front joins a vLLM OpenAI server started as docs/server.md shows
    (here by the same helper, whose command is that one), injects into it, and leaves it
    running when it stops."""
    from inferscale.config import MemoryConfig
    from inferscale.models.resolve import resolve_llm
    from inferscale.server.vllm_process import VLLMProcess

    data = tmp_path / "data"
    config = MemoryConfig(data_dir=data, dtype="float32")
    vllm = VLLMProcess(resolve_llm(config.llm), served_model_name="smol", kv_dir=data / "kv", dtype="float32",
                       max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                       device_budget_bytes=config.device_kv_budget_bytes, log_path=tmp_path / "vllm.log")
    vllm.start()
    try:
        vllm.wait_ready(600)
        port = free_port()
        exe = Path(sys.executable).with_name("inferscale")
        with open(tmp_path / "front.log", "w") as out:
            front = subprocess.Popen([str(exe), "serve", "--port", str(port), "--data-dir", str(data), "--vllm-url",
                                      vllm.url, "--default-max-tokens", "5"], stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "INFERSCALE_DTYPE": "float32"})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while not listening(url):
            assert front.poll() is None and time.monotonic() < deadline, (tmp_path / "front.log").read_text()
            time.sleep(1)
        httpx.post(url + "/memories", json={"messages": "My bike is red.", "user_id": "gus"}, timeout=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(model="smol", user="gus", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "What colour is my bike?"}],
                                              extra_body={"memory": {"wait_for_kv": True}})
        assert report(resp)["injected_tokens"] > 0 and report(resp)["kv_memory_ids"]
        # a chat that sends no max_tokens ends at the front's default (--default-max-tokens 5),
        # not at the end of the context; one that sends it keeps its own
        uncapped = client.chat.completions.create(model="smol", user="gus", temperature=0, messages=[
            {"role": "user", "content": "Write a long story about my bike, with many details."}])
        assert uncapped.usage.completion_tokens == 5 and uncapped.choices[0].finish_reason == "length", uncapped
        own = client.chat.completions.create(model="smol", user="gus", temperature=0, max_tokens=9, messages=[
            {"role": "user", "content": "Write a long story about my bike, with many details."}])
        assert own.usage.completion_tokens == 9, own
        front.send_signal(signal.SIGTERM)
        assert front.wait(120) == 0
        assert listening(vllm.url), "the front stopped a vLLM server it did not start"
    finally:
        vllm.stop()
