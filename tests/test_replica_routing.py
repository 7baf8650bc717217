"""Routing scopes to vLLM replicas (issue 14): rendezvous hashing and failover, against real
loopback HTTP servers (a refused port is a replica that is down)."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from inferscale.server.upstream import HttpEngine, Replicas, merge_metrics, rendezvous_order
from inferscale.server.ports import free_port

KEYS = [f"user:u{i}" for i in range(2000)]


def test_the_order_is_the_same_in_every_process():
    here = [rendezvous_order(k, 3) for k in KEYS[:50]]
    code = ("import json; from inferscale.server.upstream import rendezvous_order; "
            f"print(json.dumps([rendezvous_order(k, 3) for k in {KEYS[:50]!r}]))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert here == there


def test_scopes_spread_over_replicas_and_a_replica_leaving_moves_only_its_own():
    first = collections.Counter(rendezvous_order(k, 4)[0] for k in KEYS)
    assert all(400 <= n <= 600 for n in first.values()), first  # 500 each, give or take
    for k in KEYS:
        order = rendezvous_order(k, 4)
        without_3 = [i for i in order if i != 3]
        assert without_3 == rendezvous_order(k, 3)  # the others keep their order: only 3's scopes move


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.dumps({"served_by": self.server.server_port}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def live_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_a_scope_whose_replica_is_down_goes_to_its_next_one(live_server):
    live = f"http://127.0.0.1:{live_server.server_port}"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    replicas = Replicas([dead, live], retry_after_s=60)
    key = next(k for k in KEYS if rendezvous_order(k, 2)[0] == 0)  # a scope of the dead replica

    async def go():
        try:
            first = await replicas.send(key, "POST", "/v1/chat/completions", json={})
            again = await replicas.send(key, "POST", "/v1/chat/completions", json={})
            return first, again
        finally:
            await replicas.aclose()

    (r1, resp1), (r2, _) = asyncio.run(go())
    assert (r1.index, r2.index) == (1, 1)
    assert resp1.json() == {"served_by": live_server.server_port}
    assert replicas.replicas[0].failovers == 1  # passed over for retry_after_s: tried once, not twice


class _Hanging(_Handler):
    """A replica whose port is open but whose server does not answer until ``release`` is set."""

    release = threading.Event()

    def do_POST(self):  # noqa: N802
        self.release.wait(60)
        try:
            super().do_POST()
        except OSError:
            pass  # the client gave up on it

    do_GET = do_POST  # noqa: N815


def test_a_replica_that_hangs_is_passed_over_after_failed_health_probes(live_server):
    hung = ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    threading.Thread(target=hung.serve_forever, daemon=True).start()
    _Hanging.release.clear()
    replicas = Replicas([f"http://127.0.0.1:{hung.server_port}", f"http://127.0.0.1:{live_server.server_port}"],
                        retry_after_s=60)
    key = next(k for k in KEYS if rendezvous_order(k, 2)[0] == 0)  # a scope of the hung replica

    async def go():
        try:
            assert await replicas.probe(timeout_s=0.5) == [False, True]
            assert replicas.order(key)[0].index == 0  # one slow answer is not a hang (a busy server)
            await replicas.probe(timeout_s=0.5)
            assert replicas.order(key)[0].index == 1  # two in a row: passed over
            served = await replicas.send(key, "POST", "/v1/chat/completions", json={})
            _Hanging.release.set()  # it answers again: the next probe lifts the pause
            return served, await replicas.probe(timeout_s=10)
        finally:
            await replicas.aclose()

    try:
        (replica, response), after = asyncio.run(go())
    finally:
        _Hanging.release.set()
        hung.shutdown()
    assert replica.index == 1 and response.json() == {"served_by": live_server.server_port}
    assert after == [True, True] and replicas.replicas[0].up()


def test_the_health_watch_runs_until_cancelled_and_marks_a_hung_replica(live_server):
    hung = ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    threading.Thread(target=hung.serve_forever, daemon=True).start()
    _Hanging.release.clear()
    replicas = Replicas([f"http://127.0.0.1:{hung.server_port}", f"http://127.0.0.1:{live_server.server_port}"])

    async def go():
        task = asyncio.create_task(replicas.watch(interval_s=0.05, timeout_s=0.3))
        try:
            for _ in range(200):  # up to ~20 s on a loaded machine; ~0.7 s here
                if not replicas.replicas[0].up():
                    break
                await asyncio.sleep(0.1)
            return [r.up() for r in replicas.replicas]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await replicas.aclose()

    try:
        assert asyncio.run(go()) == [False, True]
    finally:
        _Hanging.release.set()
        hung.shutdown()


def test_no_replica_answering_is_the_transport_error():
    replicas = Replicas([f"http://127.0.0.1:{free_port()}"])

    async def go():
        try:
            await replicas.send("user:a", "POST", "/v1/chat/completions", json={})
        finally:
            await replicas.aclose()

    with pytest.raises(httpx.ConnectError):
        asyncio.run(go())
    with pytest.raises(ValueError, match="at least one"):
        Replicas([])


def test_the_memory_engine_skips_a_replica_that_is_down(live_server, tmp_path):
    class Completions(_Handler):
        def do_POST(self):  # noqa: N802
            body = json.dumps({"choices": [{"text": "from the live one"}]}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    live_server.RequestHandlerClass = Completions
    engine = HttpEngine([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{live_server.server_port}"],
                        tmp_path, "m")
    try:
        assert [engine.generate([1, 2], max_tokens=4).text for _ in range(3)] == ["from the live one"] * 3
    finally:
        engine.close()


def test_metrics_of_several_replicas_are_merged_with_a_replica_label():
    text = ("# HELP vllm:inferscale_loads_total loads\n# TYPE vllm:inferscale_loads_total counter\n"
            'vllm:inferscale_loads_total{engine="0"} 3.0\n')
    merged = merge_metrics([(0, text), (1, text.replace("3.0", "5.0"))]).decode()
    assert merged.count("# TYPE vllm:inferscale_loads") == 1
    assert 'vllm:inferscale_loads_total{engine="0",replica="0"} 3.0' in merged
    assert 'vllm:inferscale_loads_total{engine="0",replica="1"} 5.0' in merged
