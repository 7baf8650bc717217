"""vLLM's router in front of the replicas (issue 55): the real ``vllm-router`` (PyPI), started
as ``inferscale serve`` starts it (:class:`~inferscale.server.router_process.RouterProcess`),
over loopback HTTP servers that stand in for vLLM (they answer ``/health`` and say who they
are). The real vLLM behind it: tests/test_fleet.py."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from inferscale.config import MemoryConfig
from inferscale.kv.injection import cache_salt
from inferscale.runtime.outages import RETRY_AFTER_S
from inferscale.server.errors import upstream_error
from inferscale.server.main import ServeOptions
from inferscale.server.ports import free_port
from inferscale.server.router_process import RouterProcess
from inferscale.server.upstream import ROUTE_HEADER, HttpEngine, Upstream, merge_metrics, relayed_failure, route_headers, routing_key

SCOPES = [f'{{"user_id": "user{i:03d}"}}' for i in range(60)]


class _Worker(BaseHTTPRequestHandler):
    """A stand-in for one vLLM server: ``/health`` answers 200, any other request is answered
    with the port that served it, and its routing header is kept."""

    def do_POST(self):  # noqa: N802 - http.server's name
        if self.path != "/health":
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            self.server.seen.append(self.headers.get(ROUTE_HEADER))
        body = json.dumps({"served_by": self.server.server_port,
                           "choices": [{"text": f"from {self.server.server_port}"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args):
        pass


class Workers:
    """``n`` stand-ins on loopback ports; :meth:`kill` and :meth:`revive` one on its port."""

    def __init__(self, n: int) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.servers: list[ThreadingHTTPServer | None] = [None] * n
        for i in range(n):
            self.revive(i)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def revive(self, i: int) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", self.ports[i]), _Worker)
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers[i] = server

    def kill(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        server.shutdown()
        server.server_close()

    def close(self) -> None:
        for i, server in enumerate(self.servers):
            if server is not None:
                self.kill(i)


@pytest.fixture
def workers():
    w = Workers(3)
    yield w
    w.close()


@pytest.fixture
def router(workers, tmp_path):
    r = RouterProcess(workers.urls, log_path=tmp_path / "router.log", startup_timeout_s=30)
    r.start()
    r.wait_ready(60)
    yield r
    r.stop()


def served_by(url: str, scopes: list[str]) -> dict[str, int | str]:
    """Each scope's chat request through :class:`Upstream` at ``url``: the port that answered it,
    or, for an answer that was not 200, the front's status for it and its ``Retry-After``."""
    upstream = Upstream(url)

    async def go():
        out = {}
        try:
            for scope in scopes:
                r = await upstream.send(scope, "POST", "/v1/chat/completions", json={"model": "m", "messages": []})
                if r.status_code == 200:
                    out[scope] = r.json()["served_by"]
                else:  # what the front answers in its place (:func:`upstream_error`)
                    answer = upstream_error(r.status_code, r.content)
                    out[scope] = f"{answer.status_code} Retry-After {answer.headers.get('retry-after')}"
        finally:
            await upstream.aclose()
        return out

    return asyncio.run(go())


def until(check, timeout_s: float = 20.0):
    """``check()`` once it is truthy (polled every 0.25 s); the last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def test_routing_keys_are_the_same_everywhere_and_hold_no_user_id():
    here = [route_headers(s) for s in SCOPES[:20]]
    code = ("import json; from inferscale.server.upstream import route_headers; "
            f"print(json.dumps([route_headers(s) for s in {SCOPES[:20]!r}]))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert here == there
    assert len({h[ROUTE_HEADER] for h in here}) == 20  # one key per scope
    assert not any("user" in h[ROUTE_HEADER] for h in here)  # a hash, not the id
    assert route_headers(None) == {} and route_headers("") == {}  # no scope: no key
    # a scope's KV encodes (HttpEngine, which sees the scope's salt) carry its chats' key
    assert routing_key(cache_salt(SCOPES[0], None)) == here[0][ROUTE_HEADER]


def test_the_router_keeps_each_scope_on_one_replica_and_moves_only_a_dead_ones_scopes(workers, router, tmp_path):
    first = served_by(router.url, SCOPES)
    assert first == served_by(router.url, SCOPES)  # the same replica every time
    spread = collections.Counter(first.values())
    assert set(spread) == set(workers.ports) and min(spread.values()) >= 5, spread
    # a second router over the same list (another machine's front) makes the same map
    other = RouterProcess(workers.urls, log_path=tmp_path / "other.log", startup_timeout_s=30)
    other.start()
    try:
        other.wait_ready(60)
        assert served_by(other.url, SCOPES) == first
    finally:
        other.stop()

    dead = workers.ports[0]
    workers.kill(0)
    t0 = time.monotonic()
    during: list[str] = []  # answers that were not 200 while the router found the replica dead

    def moved_map():
        m = served_by(router.url, SCOPES)
        during.extend(v for v in m.values() if not isinstance(v, int))
        return m if all(isinstance(v, int) and v != dead for v in m.values()) else None

    moved = until(moved_map)
    took = time.monotonic() - t0
    assert moved, "the dead replica's scopes did not move within 20 s"
    assert all(moved[s] == p for s, p in first.items() if p != dead), "scopes of the living replicas moved"
    assert all(v == f"503 Retry-After {RETRY_AFTER_S}" for v in during), during  # never a bare 500
    workers.revive(0)
    back = until(lambda: (lambda m: m if m == first else None)(served_by(router.url, SCOPES)))
    assert back == first, "the revived replica's scopes did not come back within 20 s"
    print(f"a dead replica's {spread[dead]} scopes moved within {took:.1f} s ({len(during)} answers 503 meanwhile) "
          "and came back")
    log = router.log_path.read_text()
    # the router logs at warning: no scope, no routing key, no worker choice per request
    assert not any(routing_key(cache_salt(s, None)) in log or "user0" in log for s in SCOPES), log[-2000:]


def test_a_request_cut_before_its_answer_is_sent_once_more_then_is_the_transport_error(unused_port):
    upstream = Upstream(f"http://127.0.0.1:{unused_port}")
    late: dict = {}

    def start_late():  # the router coming back within the resend's pause
        late["server"] = ThreadingHTTPServer(("127.0.0.1", unused_port), _Worker)
        late["server"].seen = []
        threading.Thread(target=late["server"].serve_forever, daemon=True).start()

    async def go():
        try:
            with pytest.raises(httpx.ConnectError):  # nobody there, twice
                await upstream.send("s", "POST", "/v1/chat/completions", json={})
            assert upstream.resent == 1
            threading.Timer(0.3, start_late).start()
            r = await upstream.send("s", "POST", "/v1/chat/completions", json={})
            return r.json()["served_by"], upstream.resent
        finally:
            await upstream.aclose()

    try:
        assert asyncio.run(go()) == (unused_port, 2)
    finally:
        late["server"].shutdown()
        late["server"].server_close()


def test_a_5xx_that_is_not_vllms_own_is_a_503_with_retry_after():
    routers = upstream_error(500, b"Failed to send request to worker http://127.0.0.1:1: connection refused")
    assert routers.status_code == 503 and routers.headers["retry-after"]
    assert "answered 500" in json.loads(routers.body)["error"]["message"]
    vllms = upstream_error(500, json.dumps({"error": {"message": "engine dead", "type": "x", "code": 500}}).encode())
    assert vllms.status_code == 500  # vLLM's own error passes through as it said it
    assert upstream_error(400, b"plain").status_code == 400
    fastapis = upstream_error(502, json.dumps({"detail": "Bad gateway"}).encode())
    assert fastapis.status_code == 502  # FastAPI's shape is vLLM's server's own too
    empty = upstream_error(502, b"")
    assert empty.status_code == 503 and "no body" in json.loads(empty.body)["detail"]
    # the engine client's resend reads the same rule
    assert relayed_failure(500, b"upstream gone") and relayed_failure(502, b"") and relayed_failure(500, b'"text"')
    assert not relayed_failure(500, json.dumps({"error": {"message": "x"}}).encode())
    assert not relayed_failure(500, b'{"detail": "x"}') and not relayed_failure(404, b"gone")


def test_the_memory_engine_routes_an_encode_by_its_scope(workers, router, tmp_path):
    engine = HttpEngine(router.url, tmp_path, "m")
    salt = cache_salt(SCOPES[3], None)
    try:
        texts = {engine.generate([1, 2], max_tokens=1, cache_salt=salt).text for _ in range(4)}
    finally:
        engine.close()
    (text,) = texts  # one replica for the scope
    port = int(text.split()[-1])
    chats = served_by(router.url, [SCOPES[3]])
    assert chats[SCOPES[3]] == port  # the replica its chats go to
    seen = workers.servers[workers.ports.index(port)].seen
    assert routing_key(salt) in seen


def test_serve_refuses_a_router_url_beside_replicas_and_one_that_is_not_http(tmp_path):
    config = MemoryConfig(data_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="--router-url the router you run"):
        ServeOptions(router_url="http://127.0.0.1:9", replicas=2).check(config)
    with pytest.raises(ValueError, match="http:// or https:// URL"):
        ServeOptions(router_url="127.0.0.1:9").check(config)


def test_metrics_of_several_replicas_are_merged_with_a_replica_label():
    text = ("# HELP vllm:inferscale_loads_total loads\n# TYPE vllm:inferscale_loads_total counter\n"
            'vllm:inferscale_loads_total{engine="0"} 3.0\n')
    merged = merge_metrics([(0, text), (1, text.replace("3.0", "5.0"))]).decode()
    assert merged.count("# TYPE vllm:inferscale_loads") == 1
    assert 'vllm:inferscale_loads_total{engine="0",replica="0"} 3.0' in merged
    assert 'vllm:inferscale_loads_total{engine="0",replica="1"} 5.0' in merged


def test_the_memory_engine_sends_once_more_after_a_5xx_that_is_not_vllms_own(tmp_path):
    """A replica gone under an encode: the router answers 500 in plain text, and the encode is
    sent once more (the router has moved the scope by then); vLLM's own JSON 500 is not."""
    answers: list[tuple[int, bytes]] = []

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length") or 0))
            status, body = answers.pop(0)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = HttpEngine(f"http://127.0.0.1:{server.server_port}", tmp_path, "m")
    ok = json.dumps({"choices": [{"text": "fine"}]}).encode()
    try:
        answers[:] = [(500, b"Request failed: error sending request for url"), (200, ok)]
        assert engine.generate([1], max_tokens=1).text == "fine" and answers == []
        answers[:] = [(500, json.dumps({"error": {"message": "engine dead"}}).encode()), (200, ok)]
        with pytest.raises(RuntimeError, match="engine dead"):
            engine.generate([1], max_tokens=1)
        assert len(answers) == 1  # not sent again
    finally:
        engine.close()
        server.shutdown()
        server.server_close()
