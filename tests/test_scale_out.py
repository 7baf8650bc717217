"""Beyond one process, on loopback: ``inferscale serve --workers 2 --replicas 2`` over a real
Chroma server (``chroma run``) and a real PostgreSQL (Debian's), with the real SmolLM2 in
two vLLM OpenAI servers behind vLLM's router (``vllm-router``, which ``serve`` starts).

16 users write and ask at once, every request on a new connection (so the two workers
share them): each user adds a fact, searches for it at once (through whichever worker
the kernel hands the connection to), then chats with memory. Phase one checks routing
and visibility; phase two kills a worker and a vLLM replica while the users go on, and
the users retry what failed; then kills the router. Afterwards: no acknowledged write lost, no
duplicate, no answer with another user's memories, and every failure the users saw was a 503
with ``Retry-After`` (never a bare 500). Before that, the router is checked to pass every
kind of request the front sends to the real vLLM as vLLM answers it directly. About 5
minutes here.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferscale.server.ports import free_port

pytestmark = pytest.mark.slow

KEY = "scale-out-key"
USERS = [f"user{i:02d}" for i in range(16)]
#: most seconds a client keeps retrying one request (a killed worker comes back in
#: seconds, a killed replica's users move to the other replica at once)
RETRY_FOR_S = 300.0
#: the front's head timeout here (issue 42), short enough to wait for
HEADER_TIMEOUT_S = 3.0


class Client:
    """One user's HTTP calls, each on a new connection, retried on a transport error or a
    5xx until ``RETRY_FOR_S``; records what happened."""

    def __init__(self, url: str, user: str) -> None:
        self.url, self.user = url, user
        self.retries = 0
        self.failures: list[str] = []  # the 5xx answers seen: status and Retry-After

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                r = httpx.request(method, self.url + path, timeout=300,
                                  headers={"Authorization": f"Bearer {KEY}", "Connection": "close"}, **kw)
                if r.status_code < 500:
                    return r
                error = f"{r.status_code}: {r.text[:200]}"
                self.failures.append(f"{r.status_code} Retry-After {r.headers.get('retry-after')}")
            except httpx.TransportError as exc:
                error = repr(exc)
            assert time.monotonic() < deadline, f"{self.user}: {method} {path} kept failing: {error}"
            self.retries += 1
            time.sleep(0.5)


def one_round(client: Client, n: int, log: dict) -> None:
    """Add fact ``n``, search for it at once, chat with memory; append to ``log``."""
    user = client.user
    text = f"{user} keeps the spare key number {n} in the blue box {n}."
    r = client.call("POST", "/memories", json={"messages": [{"role": "user", "content": text}], "user_id": user,
                                               "infer": False})
    assert r.status_code == 200, r.text
    (event,) = r.json()["results"]
    log["acked"].append((user, event["id"], text))
    s = client.call("POST", "/search", json={"query": text, "user_id": user, "limit": 50})
    assert s.status_code == 200, s.text
    found = event["id"] in {m["id"] for m in s.json()["results"]}
    log["visibility"].append((r.headers["x-inferscale-worker"], s.headers["x-inferscale-worker"], found))
    c = client.call("POST", "/v1/chat/completions", json={
        "user": user, "messages": [{"role": "user", "content": "Where is my spare key?"}], "max_tokens": 4,
        "temperature": 0, "memory": {"k": 5}})
    assert c.status_code == 200, c.text
    log["chats"].append((user, int(c.headers["x-inferscale-replica"]), time.monotonic(),
                         [m["id"] for m in c.json()["memory"]["memories"]], c.headers["x-inferscale-worker"]))


def run_users(url: str, rounds: range, log: dict) -> list[Client]:
    clients = [Client(url, u) for u in USERS]

    def user_loop(client: Client) -> None:
        for n in rounds:
            one_round(client, n, log)

    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        for f in [pool.submit(user_loop, c) for c in clients]:
            f.result()
    return clients


@pytest.fixture
def deployment(tmp_path, chroma, postgres_url):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "INFERSCALE_API_KEY": KEY, "INFERSCALE_DTYPE": "float32",
           "INFERSCALE_CHROMA_URL": chroma["url"], "INFERSCALE_DATABASE_URL": postgres_url,
           "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(512 << 20),
           "INFERSCALE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    cmd = [str(Path(sys.executable).with_name("inferscale")), "serve", "--port", str(port), "--data-dir",
           str(tmp_path / "data"), "--workers", "2", "--replicas", "2", "--max-num-seqs", "16"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        assert proc.poll() is None, f"inferscale serve exited:\n{log.read_text()[-3000:]}"
        try:
            r = httpx.get(url + "/ready", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
            if r.status_code == 200 and all(r.json()["replicas"]):
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready after 900 s:\n{log.read_text()[-3000:]}"
        time.sleep(1)
    yield {"url": url, "proc": proc, "log": log}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def check_limits_hold_in_every_worker(url: str) -> None:
    """8 connections at once (the kernel spreads them over the workers), each sending a head
    that never ends, or a keyless 2 MiB upload: every one is cut with a 408 within
    ``HEADER_TIMEOUT_S`` (and a little), or answered 401 with no worker named (issue 42)."""
    port = int(url.rsplit(":", 1)[1])

    def answer(data: bytes, body: bytes = b"") -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.monotonic()
            s.sendall(data + body)
            s.settimeout(HEADER_TIMEOUT_S + 10)
            return s.recv(4096), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        slow = list(pool.map(lambda _: answer(b"GET /health HTTP/1.1\r\nHost: x\r\n"), range(8)))
        keyless = list(pool.map(lambda _: answer(b"POST /memories HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                                                 % (2 << 20), b" " * (2 << 20)), range(8)))
    assert all(a.startswith(b"HTTP/1.1 408") and took < HEADER_TIMEOUT_S + 3 for a, took in slow), slow
    assert all(a.startswith(b"HTTP/1.1 401") and b"x-inferscale-worker" not in a for a, _ in keyless), keyless


def port_of(log: Path, what: str) -> int:
    """The port of ``what`` (``"vLLM replica 0"``, ``"vLLM's router"``) in the serve log."""
    (port,) = re.findall(rf"starting {re.escape(what)} .*? on http://127\.0\.0\.1:(\d+) ", log.read_text())
    return int(port)


def group_of(port: int) -> int:
    """The process group of the server listening on ``port``."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return os.getpgid(int(re.search(r"pid=(\d+)", out).group(1)))


def check_the_router_passes_what_the_front_sends(url: str, log: Path) -> None:
    """vLLM's router re-serialises bodies (it adds defaults, drops ``content: null``): every kind
    of request the front sends gets from the real vLLM through the router what it gets
    directly (greedy, so the same text), and a chat's KV plan reaches the connector."""
    headers = {"Authorization": f"Bearer {KEY}", "X-User-ID": "check"}
    router = f"http://127.0.0.1:{port_of(log, 'vLLM' + chr(39) + 's router')}"
    replica = f"http://127.0.0.1:{port_of(log, 'vLLM replica 0')}"
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    tool = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    chat = {"model": model, "max_tokens": 12, "temperature": 0, "messages": [
        {"role": "system", "content": "You are brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], "tools": [tool],
        "cache_salt": "check", "priority": 0}
    completion = {"model": model, "prompt": [1, 504, 3458, 314], "max_tokens": 8, "temperature": 0,
                  "cache_salt": "check"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        there = httpx.post(router + path, json=body, headers=headers, timeout=120)
        here = httpx.post(replica + path, json=body, headers=headers, timeout=120)
        assert there.status_code == here.status_code == 200, (path, there.text[:500], here.text[:500])
        text = (lambda r: r.json()["choices"][0].get("message", {}).get("content") or r.json()["choices"][0].get("text"))
        assert text(there) == text(here), (path, there.text[:500], here.text[:500])
    streamed = {}
    for name, base in (("router", router), ("replica", replica)):
        with httpx.stream("POST", base + "/v1/chat/completions", json={**chat, "stream": True}, headers=headers,
                          timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            streamed[name] = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                                     for line in r.iter_lines() if line.startswith("data: {") and
                                     json.loads(line[6:])["choices"])
    assert streamed["router"] == streamed["replica"], streamed
    # a chat with memory through the front: its KV plan crosses the router and is injected
    c = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=300, json={
        "user": USERS[0], "messages": [{"role": "user", "content": "Where is my spare key?"}], "max_tokens": 4,
        "temperature": 0, "memory": {"k": 5, "wait_for_kv": True}})
    assert c.status_code == 200, c.text
    memory = c.json()["memory"]
    assert memory["injected_tokens"] == memory["kv_tokens"] > 0 and memory["replica"] in (0, 1), memory


def check_store(url: str, log: dict) -> None:
    """Every acknowledged write is there once; no chat used another user's memories."""
    client = Client(url, "checker")
    acked: dict[str, dict[str, str]] = {}
    for user, memory_id, text in log["acked"]:
        acked.setdefault(user, {})[memory_id] = text
    for user in USERS:
        r = client.call("GET", "/memories", params={"user_id": user})
        assert r.status_code == 200, r.text
        stored = {m["id"]: m["memory"] for m in r.json()["results"]}
        assert set(acked[user]) <= set(stored), f"{user}: acknowledged writes lost: {set(acked[user]) - set(stored)}"
        texts = list(stored.values())
        assert len(texts) == len(set(texts)), f"{user}: duplicate memories: {sorted(texts)}"
    for user, _, _, ids, _ in log["chats"]:
        assert ids, f"{user}: a chat used no memory"
        foreign = set(ids) - set(acked[user])
        assert not foreign, f"{user}'s answer used memories of another user: {foreign}"


def test_two_workers_two_replicas_16_users_with_a_worker_and_a_replica_killed(deployment):
    url, log_path = deployment["url"], deployment["log"]

    # phase one: routing, visibility between workers, isolation
    log: dict = {"acked": [], "visibility": [], "chats": []}
    run_users(url, range(2), log)
    check_store(url, log)
    replicas = {}
    for user, replica, *_ in log["chats"]:
        replicas.setdefault(user, set()).add(replica)
    assert all(len(r) == 1 for r in replicas.values()), f"a user's requests went to several replicas: {replicas}"
    primary = {u: next(iter(r)) for u, r in replicas.items()}
    assert set(primary.values()) == {0, 1}, f"16 users all routed to one replica: {primary}"
    extra = Client(url, USERS[0])  # the kernel may hand a burst of connections to one worker:
    for n in range(100, 300):  # more add -> search pairs until two workers have answered
        if len({w for pair in log["visibility"] for w in pair[:2]}) == 2:
            break
        one_round(extra, n, log)
    workers = {w for pair in log["visibility"] for w in pair[:2]}
    assert len(workers) == 2, f"the requests reached {len(workers)} worker(s), not 2"
    cross = [v for v in log["visibility"] if v[0] != v[1]]
    assert cross, "no add and search pair went through two different workers"
    assert all(found for *_, found in log["visibility"]), \
        f"a write acknowledged by one worker was not found by the next search: {log['visibility']}"
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    for replica in ("0", "1"):  # both replicas' connector counters, told apart by a label
        assert re.search(rf'^vllm:inferscale_verified_total{{[^}}]*replica="{replica}"', metrics, re.M), metrics[:2000]
    check_limits_hold_in_every_worker(url)
    check_the_router_passes_what_the_front_sends(url, log_path)
    print(f"visibility: {len(log['visibility'])} add->search pairs, {len(cross)} across workers, "
          f"all found by the first search (delay 0 after the acknowledgement)")

    # phase two: kill a worker and a replica while the users go on
    log2: dict = {"acked": list(log["acked"]), "visibility": [], "chats": []}
    killed: dict = {}

    def kill_when_busy() -> None:
        while len(log2["chats"]) < 4:
            time.sleep(0.2)
        worker = int(log2["chats"][-1][4])
        os.kill(worker, signal.SIGKILL)
        group = group_of(port_of(log_path, "vLLM replica 0"))
        os.killpg(group, signal.SIGKILL)
        killed.update(worker=worker, replica=0, at=time.monotonic())

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    clients = run_users(url, range(2, 5), log2)
    killer.join()
    check_store(url, log2)
    assert len(log2["chats"]) == len(USERS) * 3, "a user's round did not finish"
    moved = [(u, r) for u, r, t, *_ in log2["chats"] if t > killed["at"] and primary[u] == 0 and r != 0]
    assert moved, "no request of replica 0's users was answered by replica 1 after replica 0 was killed"
    after = [(u, r) for u, r, t, *_ in log2["chats"] if t > killed["at"] and primary[u] == 1]
    assert all(r == 1 for _, r in after), "users of the replica left running were moved"
    print(f"killed worker {killed['worker']} and replica 0; {sum(c.retries for c in clients)} retried requests; "
          f"{len(moved)} requests of replica 0's users answered by replica 1")
    text = log_path.read_text()
    assert "vLLM server 0" in text and "started it again" in text, text[-2000:]

    # phase three: kill vLLM's router while the users go on; serve starts it again
    log3: dict = {"acked": list(log2["acked"]), "visibility": [], "chats": []}
    router_port = port_of(log_path, "vLLM" + chr(39) + "s router")

    def kill_router() -> None:
        while len(log3["chats"]) < 2:
            time.sleep(0.2)
        os.killpg(group_of(router_port), signal.SIGKILL)

    killer = threading.Thread(target=kill_router)
    killer.start()
    clients3 = run_users(url, range(5, 7), log3)
    killer.join()
    check_store(url, log3)
    assert len(log3["chats"]) == len(USERS) * 2, "a user's round did not finish"
    failures = [f for c in clients + clients3 for f in c.failures]
    assert all(f.startswith("503 Retry-After ") for f in failures), failures  # never a bare 500
    assert "vLLM's router on" in log_path.read_text() and log_path.read_text().count("started it again") >= 2
    print(f"killed the router: {sum(c.retries for c in clients3)} retried requests; every failure seen was a "
          f"503 with Retry-After ({len(failures)} in phases two and three)")
