"""Many machines on real parts (issues 38 and 55), on loopback: HAProxy (Debian's, the
configuration of docs/deployment.md) in front of two fronts, each with its own data dir as on
its own machine, over a real Chroma server (``chroma run``), PostgreSQL (Debian's) and Redis:

- front A, ``inferscale serve --workers 2 --replicas 2``: two uvicorn workers on one port,
  two vLLM OpenAI servers with the real SmolLM2 and InferScale's connector, and vLLM's
  router (``vllm-router``) in front of them, all started (and restarted) by ``serve``;
- front B, ``inferscale serve --router-url``: a front on another "machine" that sends to
  A's router, its fact KV reaching the replicas through Redis.

8 users add a fact, search for it at once and chat with memory, every request on a new
connection through HAProxy. Phase one checks routing (each user's chats on one replica),
visibility (a write acknowledged by one front is found by the next search through any
other), the limits in every worker, and that the router passes every kind of request the
fronts send to vLLM as vLLM answers it directly. Phase two kills (SIGKILL) one of A's
workers, front B, a replica and the router while the users go on, retrying what failed.
Phase three adds a third replica to the router at runtime. Afterwards: no acknowledged
write lost, no text stored twice, no answer with another user's memories, every failure
the users saw a 503 with ``Retry-After`` (never a bare 500 or 502), and the added replica
took users with no front restarted; a SIGTERM then stops front A and everything it started.
About 3 minutes here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from inferscale.config import MemoryConfig
from inferscale.kv.injection import REPLICA_ENV
from inferscale.models.resolve import resolve_llm
from inferscale.server.ports import free_port
from inferscale.server.upstream import route_headers
from inferscale.server.vllm_process import VLLMProcess

from test_orphans import running

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY = "fleet-key"
USERS = [f"user{i:02d}" for i in range(8)]
#: most seconds a client keeps retrying one request (a killed worker comes back in
#: seconds, a killed replica's users move to the other replica within seconds)
RETRY_FOR_S = 300.0
#: the fronts' head timeout here (issue 42), short enough to wait for
HEADER_TIMEOUT_S = 3.0
PAGED_CACHE_BYTES = 512 << 20


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


def haproxy_config(port: int, fronts: list[int], errors: Path) -> str:
    """docs/deployment.md's HAProxy configuration, on loopback: its listening port, the
    fronts' ports and the error file's path replaced."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    config = re.search(r"```haproxy\n(.*?)```", text, re.S).group(1)
    config = config.replace("bind :8080", f"bind 127.0.0.1:{port}")
    config = config.replace("/etc/haproxy/errors/inferscale-503.http", str(errors))
    servers = "".join(f"    server front{i + 1} 127.0.0.1:{p} check\n" for i, p in enumerate(fronts))
    config = re.sub(r"(    server front\d+ [^\n]*\n)+", servers, config)
    assert config.count("server front") == len(fronts), config
    return config


def error_file() -> bytes:
    """docs/deployment.md's error file, with HTTP's CRLF line ends."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    body = re.search(r"```http\n(.*?)```", text, re.S).group(1)
    head, payload = body.split("\n\n", 1)
    return (head.replace("\n", "\r\n") + "\r\n\r\n" + payload.strip() + "\n").encode()


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


def wait_ready(url: str, proc: subprocess.Popen, log: Path, replicas: int = 1, timeout_s: float = 900) -> None:
    """Until ``url``'s ``/ready`` answers 200 with ``replicas`` replicas answering."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"exited:\n{log.read_text()[-3000:]}"
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200 and sum(r.json()["replicas"]) >= replicas:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(1)


def serve(tmp_path: Path, name: str, env: dict, *args: str) -> dict:
    """``inferscale serve`` with ``args`` over the data dir ``tmp_path/name``, its log beside it."""
    port, log = free_port(), tmp_path / f"{name}.log"
    cmd = [str(Path(sys.executable).with_name("inferscale")), "serve", "--port", str(port), "--data-dir",
           str(tmp_path / name), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return {"port": port, "log": log, "url": f"http://127.0.0.1:{port}", "proc": proc, "data": tmp_path / name}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def fleet(tmp_path, chroma, postgres_url, redis_server):
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(haproxy).exists(), "haproxy not found: scripts/install.sh installs Debian's haproxy"
    env = {**os.environ, "INFERSCALE_API_KEY": KEY, "INFERSCALE_DTYPE": "float32",
           "INFERSCALE_CHROMA_URL": chroma["url"], "INFERSCALE_DATABASE_URL": postgres_url,
           "INFERSCALE_KV_REDIS_URL": redis_server["url"], "INFERSCALE_KV_CACHE_MEMORY_BYTES": str(PAGED_CACHE_BYTES),
           "INFERSCALE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    a = serve(tmp_path, "front-a", env, "--workers", "2", "--replicas", "2", "--max-num-seqs", "16")
    b = balancer = None
    extra: list[VLLMProcess] = []
    try:
        wait_ready(a["url"], a["proc"], a["log"], replicas=2)
        router = f"http://127.0.0.1:{port_of(a['log'], 'vLLM' + chr(39) + 's router')}"
        replicas = [f"http://127.0.0.1:{port_of(a['log'], f'vLLM replica {i}')}" for i in range(2)]
        b = serve(tmp_path, "front-b", env, "--router-url", router, *[x for r in replicas for x in ("--vllm-url", r)])
        wait_ready(b["url"], b["proc"], b["log"], replicas=2)
        errors = tmp_path / "inferscale-503.http"
        errors.write_bytes(error_file())
        port = free_port()
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(haproxy_config(port, [a["port"], b["port"]], errors))
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(tmp_path / "haproxy.log", "w") as out:
            balancer = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, balancer, tmp_path / "haproxy.log", replicas=2, timeout_s=60)
        yield {"url": url, "a": a, "b": b, "router": router, "replicas": replicas, "redis": redis_server,
               "tmp": tmp_path, "extra": extra}
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(30)
        if b is not None:
            stop(b["proc"])
        stop(a["proc"])
        for r in extra:
            r.stop()


def check_the_router_passes_what_the_front_sends(url: str, router: str, replica: str) -> None:
    """vLLM's router re-serialises bodies (it adds defaults, drops ``content: null``): every kind
    of request a front sends gets from the real vLLM through the router what it gets
    directly (greedy, so the same text), and a chat's KV plan reaches the connector
    (through ``url``, the load balancer, so through either front)."""
    headers = {"Authorization": f"Bearer {KEY}", "X-User-ID": "check"}
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

    def text(r: httpx.Response) -> str:
        choice = r.json()["choices"][0]
        return (choice.get("message") or {}).get("content") or choice.get("text")

    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        there = httpx.post(router + path, json=body, headers=headers, timeout=120)
        here = httpx.post(replica + path, json=body, headers=headers, timeout=120)
        assert there.status_code == here.status_code == 200, (path, there.text[:500], here.text[:500])
        assert text(there) == text(here), (path, there.text[:500], here.text[:500])
    streamed = {}
    for name, base in (("router", router), ("replica", replica)):
        with httpx.stream("POST", base + "/v1/chat/completions", json={**chat, "stream": True}, headers=headers,
                          timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            streamed[name] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed["router"] == streamed["replica"], streamed
    for _ in range(2):  # a chat with memory through each front: its KV plan crosses the router and is injected
        c = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}",
                                                              "Connection": "close"}, timeout=300, json={
            "user": USERS[0], "messages": [{"role": "user", "content": "Where is my spare key?"}], "max_tokens": 4,
            "temperature": 0, "memory": {"k": 5, "wait_for_kv": True}})
        assert c.status_code == 200, c.text
        memory = c.json()["memory"]
        assert memory["injected_tokens"] == memory["kv_tokens"] > 0 and memory["replica"] in (0, 1), memory


def kill_when(log: dict, n_chats: int, action, errors: list) -> threading.Thread:
    """A thread that runs ``action`` once ``log`` holds ``n_chats`` chats; what it raises goes
    to ``errors`` (the test checks it is empty)."""
    def run():
        try:
            while len(log["chats"]) < n_chats:
                time.sleep(0.2)
            action()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_fleet_keeps_every_write_and_user_through_a_worker_a_front_a_replica_and_the_router_dying(fleet):
    url, a = fleet["url"], fleet["a"]

    # phase one: routing, visibility across fronts and workers, limits, the router's rewrite
    log: dict = {"acked": [], "visibility": [], "chats": []}
    clients = run_users(url, range(2), log)
    check_store(url, log)
    replicas: dict[str, set[int]] = {}
    for user, r, *_ in log["chats"]:
        replicas.setdefault(user, set()).add(r)
    assert all(len(r) == 1 for r in replicas.values()), f"a user's chats went to several replicas: {replicas}"
    primary = {u: next(iter(r)) for u, r in replicas.items()}
    assert set(primary.values()) == {0, 1}, f"8 users all routed to one replica: {primary}"
    extra = Client(url, USERS[0])  # more add -> search pairs until three front processes have answered
    for n in range(100, 300):
        if len({w for pair in log["visibility"] for w in pair[:2]}) == 3:
            break
        one_round(extra, n, log)
    fronts = {w for pair in log["visibility"] for w in pair[:2]}
    assert len(fronts) == 3, f"the requests reached {len(fronts)} front process(es), not A's two workers and B"
    assert any(v[0] != v[1] for v in log["visibility"]), "no add and search pair went through two front processes"
    assert all(found for *_, found in log["visibility"]), \
        f"a write acknowledged by one front was not found by the next search: {log['visibility']}"
    metrics = httpx.get(a["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    for replica in ("0", "1"):  # both replicas' connector counters, told apart by a label
        assert re.search(rf'^vllm:inferscale_verified_total{{[^}}]*replica="{replica}"', metrics, re.M), metrics[:2000]
    check_limits_hold_in_every_worker(a["url"])
    check_the_router_passes_what_the_front_sends(url, fleet["router"], fleet["replicas"][0])

    # phase two: kill one of A's workers, front B, replica 0 and the router while the users go on
    killed: dict = {}

    def kill_worker_and_front():
        worker = a_workers[0]  # one of A's two workers (phase one heard from both)
        os.kill(worker, signal.SIGKILL)  # uvicorn starts another
        os.kill(fleet["b"]["proc"].pid, signal.SIGKILL)  # HAProxy stops sending to it
        killed.update(worker=worker, front=time.monotonic())

    def kill_replica():
        os.killpg(group_of(int(fleet["replicas"][0].rsplit(":", 1)[1])), signal.SIGKILL)  # serve starts it again
        killed["replica"] = time.monotonic()

    def kill_router():
        os.killpg(group_of(int(fleet["router"].rsplit(":", 1)[1])), signal.SIGKILL)  # serve starts it again
        killed["router"] = time.monotonic()

    a_workers = sorted({int(w) for pair in log["visibility"] for w in pair[:2]} - {fleet["b"]["proc"].pid})
    assert len(a_workers) == 2, a_workers
    log2: dict = {"acked": list(log["acked"]), "visibility": [], "chats": []}
    errors: list[str] = []
    threads = [kill_when(log2, 2, kill_worker_and_front, errors), kill_when(log2, 8, kill_replica, errors),
               kill_when(log2, 16, kill_router, errors)]
    clients2 = run_users(url, range(2, 6), log2)
    for t in threads:
        t.join()
    assert errors == [], errors
    check_store(url, log2)
    assert len(log2["chats"]) == len(USERS) * 4, "a user's round did not finish"
    assert set(killed) == {"worker", "front", "replica", "router"}, killed
    moved = [(u, r) for u, r, t, *_ in log2["chats"] if t > killed["replica"] and primary[u] == 0 and r != 0]
    assert moved, "no chat of replica 0's users was answered by replica 1 after replica 0 was killed"
    # until the router is killed: a router that serve restarts learns its replicas' health anew
    # (one probe each, under load a replica may miss it), so its first chats may go elsewhere
    kept = [(u, r) for u, r, t, *_ in log2["chats"] if primary[u] == 1 and t < killed["router"]]
    assert kept and all(r == 1 for _, r in kept), f"users of the replica left running were moved: {kept}"
    failures = [f for c in clients + clients2 for f in c.failures]
    assert all(f.startswith("503 Retry-After ") for f in failures), failures  # never a bare 500 or 502
    text = a["log"].read_text()
    assert "vLLM server 0 on" in text and "vLLM's router on" in text and text.count("started it again") >= 2, text[-2000:]
    print(f"killed a worker, front B, replica 0 and the router: {sum(c.retries for c in clients2)} retried requests, "
          f"every failure a 503 with Retry-After ({len(failures)}); {len(moved)} chats of replica 0's users "
          "answered by replica 1")

    # phase three: a replica added to the router at runtime takes users, no front restarted
    wait_ready(a["url"], a["proc"], a["log"], replicas=2)  # replica 0, started again, answers
    config = MemoryConfig(dtype="float32")
    added = VLLMProcess(resolve_llm(config.llm), served_model_name=served_model(a["log"]), kv_dir=a["data"] / "kv",
                        dtype="float32", max_model_len=config.max_model_len, kv_cache_memory_bytes=PAGED_CACHE_BYTES,
                        device_budget_bytes=config.device_kv_budget_bytes, max_num_seqs=16, api_key=KEY,
                        log_path=fleet["tmp"] / "vllm-2.log",
                        environment={REPLICA_ENV: "2", "INFERSCALE_KV_REDIS_URL": fleet["redis"]["url"]})
    fleet["extra"].append(added)
    added.start()
    added.wait_ready(900)
    r = httpx.post(f"{fleet['router']}/add_worker", params={"url": added.url}, timeout=30)
    assert r.status_code == 200, r.text
    log3: dict = {"acked": list(log2["acked"]), "visibility": [], "chats": []}
    clients3 = run_users(url, range(6, 7), log3)
    check_store(url, log3)
    failures = [f for c in clients3 for f in c.failures]
    assert all(f.startswith("503 Retry-After ") for f in failures), failures
    # 30 routing keys as the fronts send them: the added replica takes its share (a third)
    answered = collections.Counter()
    for i in range(30):
        c = httpx.post(fleet["router"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                                     **route_headers(f"key{i}")},
                       json={"model": served_model(a["log"]), "prompt": [1, 2], "max_tokens": 1}, timeout=600)
        assert c.status_code == 200, c.text
        answered[c.json()["kv_transfer_params"]["inferscale_replica"]] += 1
    assert answered[2] >= 3 and set(answered) <= {0, 1, 2}, answered
    users_on_2 = {u for u, r, *_ in log3["chats"] if r == 2}
    print(f"the replica added at runtime took {answered[2]} of 30 routing keys ({len(users_on_2)} of the 8 users)")

    # the end: SIGTERM stops front A and all it started, its workers, replicas and router (issue 53)
    tree = psutil.Process(a["proc"].pid).children(recursive=True)
    names = [p.name() for p in tree]
    assert sum("EngineCore" in n for n in names) == 2 and any("router" in n for n in names), names
    said = len(a["log"].read_text())
    a["proc"].send_signal(signal.SIGTERM)
    assert a["proc"].wait(120) == 0, a["log"].read_text()[said:]
    deadline = time.monotonic() + 20
    while (alive := running(tree)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [(p.pid, p.name()) for p in alive]
    after = a["log"].read_text()[said:]
    assert "Traceback" not in after and "InferScale stopped" in after, after


def served_model(log: Path) -> str:
    """The served model's name, from ``InferScale is serving <name> ...`` in a serve log."""
    return re.search(r"InferScale is serving (\S+) ", log.read_text()).group(1)
