"""Many machines on real parts (issue 55), on loopback: HAProxy (Debian's, the configuration
of docs/deployment.md) in front of two ``inferscale serve`` fronts, each with its own data
dir as on its own machine, over a Chroma server, PostgreSQL and Redis; the fronts send to
vLLM's router (``vllm-router``) in front of two vLLM OpenAI servers with the real SmolLM2
and InferScale's connector, started as a user starts them (``--router-url``).

8 users add a fact, search for it and chat with memory, every request on a new connection
through HAProxy. Phase one checks that each user's chats land on one replica and that any
front sees any write; then a front, a replica and the router are killed (SIGKILL) in turn
while the users go on, retrying what failed; then a third replica is added to the router
at runtime. Afterwards: no acknowledged write lost, no text stored twice, no answer with
another user's memories, every failure the users saw a 503 with ``Retry-After``, and the
added replica took users without any front restarting.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferscale.config import MemoryConfig
from inferscale.kv.injection import REPLICA_ENV
from inferscale.models.resolve import resolve_llm
from inferscale.server.ports import free_port
from inferscale.server.router_process import RouterProcess
from inferscale.server.vllm_process import VLLMProcess

from test_scale_out import check_store, run_users

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY = "scale-out-key"  # the key test_scale_out's clients send
USERS = [f"user{i:02d}" for i in range(8)]
PAGED_CACHE_BYTES = 512 << 20


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


def replica(i: int, kv_dir: Path, redis_url: str, log: Path) -> VLLMProcess:
    """vLLM replica ``i`` as a user starts it (docs/server.md): the connector over its own
    KV folder and the shared Redis, its index in ``INFERSCALE_REPLICA``."""
    config = MemoryConfig(dtype="float32")
    return VLLMProcess(resolve_llm(config.llm), served_model_name="smol", kv_dir=kv_dir, dtype="float32",
                       max_model_len=config.max_model_len, kv_cache_memory_bytes=PAGED_CACHE_BYTES,
                       device_budget_bytes=config.device_kv_budget_bytes, max_num_seqs=16, api_key=KEY, log_path=log,
                       environment={REPLICA_ENV: str(i), "INFERSCALE_KV_REDIS_URL": redis_url,
                                    "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))})


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(1)


@pytest.fixture
def fleet(tmp_path, chroma, postgres_url, redis_server):
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(haproxy).exists(), "haproxy not found: scripts/install.sh installs Debian's haproxy"
    replicas = [replica(i, tmp_path / "replicas-kv", redis_server["url"], tmp_path / f"vllm-{i}.log") for i in range(2)]
    router = fronts = balancer = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready(900)
        router = RouterProcess([r.url for r in replicas], log_path=tmp_path / "router.log")
        router.start()
        router.wait_ready(60)
        env = {**os.environ, "INFERSCALE_API_KEY": KEY, "INFERSCALE_DTYPE": "float32",
               "INFERSCALE_CHROMA_URL": chroma["url"], "INFERSCALE_DATABASE_URL": postgres_url,
               "INFERSCALE_KV_REDIS_URL": redis_server["url"]}
        fronts = []
        for i in range(2):
            port, log = free_port(), tmp_path / f"front-{i}.log"
            cmd = [str(Path(sys.executable).with_name("inferscale")), "serve", "--port", str(port), "--data-dir",
                   str(tmp_path / f"front-{i}"), "--router-url", router.url,
                   *[a for r in replicas for a in ("--vllm-url", r.url)]]
            with open(log, "w") as out:
                fronts.append({"port": port, "log": log, "url": f"http://127.0.0.1:{port}",
                               "proc": subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)})
        for f in fronts:
            wait_ready(f["url"], f["proc"], f["log"])
        errors = tmp_path / "inferscale-503.http"
        errors.write_bytes(error_file())
        port = free_port()
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(haproxy_config(port, [f["port"] for f in fronts], errors))
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        balancer = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=open(tmp_path / "haproxy.log", "w"),
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, balancer, tmp_path / "haproxy.log", 60)
        yield {"url": url, "replicas": replicas, "router": router, "fronts": fronts, "redis": redis_server,
               "tmp": tmp_path}
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(30)
        for f in fronts or ():
            if f["proc"].poll() is None:
                f["proc"].send_signal(signal.SIGTERM)
                try:
                    f["proc"].wait(120)
                except subprocess.TimeoutExpired:
                    f["proc"].kill()
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def kill_when(log: dict, n_chats: int, action) -> threading.Thread:
    """A thread that runs ``action`` once ``log`` holds ``n_chats`` chats."""
    def run():
        while len(log["chats"]) < n_chats:
            time.sleep(0.2)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_fleet_keeps_every_write_and_user_through_a_front_a_replica_and_the_router_dying(fleet, monkeypatch):
    import test_scale_out

    monkeypatch.setattr(test_scale_out, "USERS", USERS)  # run_users and check_store take this module's users
    url, tmp = fleet["url"], fleet["tmp"]

    # phase one: routing and visibility across fronts
    log: dict = {"acked": [], "visibility": [], "chats": []}
    clients = run_users(url, range(2), log)
    check_store(url, log)
    replicas: dict[str, set[int]] = {}
    for user, r, *_ in log["chats"]:
        replicas.setdefault(user, set()).add(r)
    assert all(len(r) == 1 for r in replicas.values()), f"a user's chats went to several replicas: {replicas}"
    primary = {u: next(iter(r)) for u, r in replicas.items()}
    assert set(primary.values()) == {0, 1}, f"8 users all routed to one replica: {primary}"
    fronts = {w for pair in log["visibility"] for w in pair[:2]}
    assert len(fronts) == 2, f"HAProxy sent the requests to {len(fronts)} front(s), not 2"
    assert all(found for *_, found in log["visibility"]), log["visibility"]
    assert any(a != s for a, s, _ in log["visibility"]), "no add and search pair went through two fronts"

    # phase two: kill a front, then a replica, then the router, while the users go on
    killed: dict = {}

    def kill_front():
        os.kill(fleet["fronts"][0]["proc"].pid, signal.SIGKILL)
        killed["front"] = time.monotonic()

    def kill_replica():
        os.killpg(fleet["replicas"][0].pid, signal.SIGKILL)  # the server and its engine core
        killed["replica"] = time.monotonic()

    def kill_router():
        router = fleet["router"]
        os.killpg(router.pid, signal.SIGKILL)
        killed["router"] = time.monotonic()
        time.sleep(3)  # as a process manager would: started again a few seconds later, on its port
        router.restart()

    log2: dict = {"acked": list(log["acked"]), "visibility": [], "chats": []}
    threads = [kill_when(log2, 2, kill_front), kill_when(log2, 10, kill_replica), kill_when(log2, 18, kill_router)]
    clients2 = run_users(url, range(2, 6), log2)
    for t in threads:
        t.join()
    check_store(url, log2)
    assert len(log2["chats"]) == len(USERS) * 4, "a user's round did not finish"
    assert set(killed) == {"front", "replica", "router"}, killed
    after = [(u, r) for u, r, t, *_ in log2["chats"] if t > killed["replica"] + 10]
    assert all(r == 1 for _, r in after), f"a request went to the dead replica 0 after it died: {after}"
    moved = [(u, r) for u, r in after if primary[u] == 0]
    assert moved, "no chat of replica 0's users was answered after it died"
    kept = [(u, r) for u, r, t, *_ in log2["chats"] if primary[u] == 1]
    assert all(r == 1 for _, r in kept), "users of the replica left running were moved"
    failures = [f for c in clients + clients2 for f in c.failures]
    assert all(f.startswith("503 Retry-After ") for f in failures), failures  # never a bare 500 or 502

    # phase three: a replica added to the router at runtime takes users, no front restarted
    added = replica(2, tmp / "replicas-kv", fleet["redis"]["url"], tmp / "vllm-2.log")
    fleet["replicas"].append(added)
    added.start()
    added.wait_ready(900)
    r = httpx.post(f"{fleet['router'].url}/add_worker", params={"url": added.url}, timeout=30)
    assert r.status_code == 200, r.text
    log3: dict = {"acked": list(log2["acked"]), "visibility": [], "chats": []}
    clients3 = run_users(url, range(6, 7), log3)
    check_store(url, log3)
    assert 2 in {r for _, r, *_ in log3["chats"]}, f"the added replica took no user: {log3['chats']}"
    assert fleet["fronts"][1]["proc"].poll() is None
    failures = [f for c in clients3 for f in c.failures]
    assert all(f.startswith("503 Retry-After ") for f in failures), failures
    print(f"fleet: front, replica and router killed; {sum(c.retries for c in clients + clients2 + clients3)} "
          f"retried requests, every failure a 503 with Retry-After ({len(failures)}); "
          f"{len(moved)} chats of replica 0's users answered by replica 1; the added replica took "
          f"{len({u for u, r, *_ in log3['chats'] if r == 2})} of 8 users")
