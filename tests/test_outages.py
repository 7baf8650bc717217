"""Dependency outages read the same way (issue 31): an exception is classified by the
service it says is down; the front answers 503 naming it with ``Retry-After``; the log gets
one line when an outage starts and one when it ends; nothing acknowledged is lost. Real
PostgreSQL and a real Chroma server on loopback, stopped and started mid-traffic."""

import logging
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from inferscale import Memory
from inferscale.runtime.outages import OUTAGES, RETRY_AFTER_S, Outages


def test_exceptions_are_classified_by_the_service_they_say_is_down(unused_port):
    import redis
    import sqlalchemy

    outages = Outages()
    engine = sqlalchemy.create_engine(f"postgresql+psycopg://u@127.0.0.1:{unused_port}/db")
    with pytest.raises(sqlalchemy.exc.OperationalError) as pg:
        engine.connect()
    assert outages.dependency_of(pg.value) == "postgresql"
    lite = sqlalchemy.create_engine("sqlite:////nonexistent-dir/x.db")
    with pytest.raises(sqlalchemy.exc.OperationalError) as local:
        lite.connect()
    assert outages.dependency_of(local.value) is None  # a local file is not a service outage
    outages.register("chroma", f"http://127.0.0.1:{unused_port}")
    with pytest.raises(httpx.ConnectError) as chroma:
        httpx.get(f"http://127.0.0.1:{unused_port}/api/v2/heartbeat")
    assert outages.dependency_of(chroma.value) == "chroma"
    with pytest.raises(httpx.ConnectError) as other:
        httpx.get(f"http://localhost:{unused_port + 1 if unused_port < 65535 else 1}/v1/models")
    assert outages.dependency_of(other.value) == "vllm"
    with pytest.raises(redis.ConnectionError) as red:
        redis.Redis(port=unused_port, socket_connect_timeout=1).ping()
    assert outages.dependency_of(red.value) == "redis"
    try:  # wrapped, as the store wraps what chromadb raises
        try:
            raise chroma.value
        except httpx.ConnectError as exc:
            raise RuntimeError("cannot search") from exc
    except RuntimeError as wrapped:
        assert outages.dependency_of(wrapped) == "chroma"
    assert outages.dependency_of(ValueError("bad input")) is None


def test_outage_bookkeeping_logs_once_each_way(caplog):
    caplog.set_level(logging.WARNING, logger="inferscale.runtime.outages")
    outages = Outages()
    assert outages.failed("postgresql", OSError("refused")) is True
    assert [outages.failed("postgresql", OSError("refused")) for _ in range(50)] == [False] * 50
    assert set(outages.down()) == {"postgresql"}
    outages.ok("chroma")  # not down: nothing
    outages.ok()
    outages.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "PostgreSQL is not answering" in lines[0] and "answers again" in lines[1]
    assert "51 failed calls" in lines[1] and outages.down() == {}


def _app(memory: Memory, unused_port: int) -> TestClient:
    from inferscale.server.app import create_app
    from inferscale.server.upstream import Upstream

    return TestClient(create_app(memory, Upstream(f"http://127.0.0.1:{unused_port}")), raise_server_exceptions=False)


def _until_ok(call, seconds: float = 120):
    """Retry ``call`` as a client honouring Retry-After would (shortened), until it is not a 503."""
    deadline = time.monotonic() + seconds
    while True:
        response = call()
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.5)


def test_postgresql_and_chroma_outages_answer_503_with_retry_after_and_log_one_line_each_way(
        postgres, chroma, tmp_path, unused_port, caplog):
    OUTAGES.ok()  # an earlier test's unreachable upstream may have left one marked down in this process
    caplog.set_level(logging.WARNING)
    settings = dict(dtype="float32", context_window=0, precompute_kv=False, database_url=postgres.url,
                    chroma_url=chroma["url"])
    with Memory(data_dir=tmp_path / "front", **settings) as memory, _app(memory, unused_port) as client:
        def add(text: str):
            return client.post("/memories", json={"messages": [{"role": "user", "content": text}],
                                                      "user_id": "alice", "infer": False})

        assert add("I live in Lisbon.").status_code == 200
        kept = ["I live in Lisbon."]
        for stop, start, name in ((postgres.stop, postgres.start, "PostgreSQL"),
                                  (chroma["stop"], chroma["start"], "the Chroma server")):
            caplog.clear()
            stop()
            answers = [add(f"Fact {i} written during the outage.") for i in range(4)]
            search = client.post("/search", json={"query": "home", "user_id": "alice"})
            if name == "PostgreSQL":  # a search reads the scope's version there first
                answers.append(search)
            else:  # the index is in memory (rebuilt from Chroma at start): searches go on
                assert search.status_code == 200 and search.json()["results"][0]["memory"] == "I live in Lisbon."
                time.sleep(1.1)  # a success after the probe interval: Chroma is probed, still down
                assert client.post("/search", json={"query": "home", "user_id": "alice"}).status_code == 200
                assert "chroma" in OUTAGES.down()
            for r in answers:
                assert r.status_code == 503, (name, r.status_code, r.text)
                assert r.headers["retry-after"] == str(RETRY_AFTER_S)
                assert r.json()["error"]["message"].startswith(f"{name} is not answering"), r.text
            start()
            back = _until_ok(lambda: add(f"Written after {name} came back."))
            assert back.status_code == 200, back.text
            kept.append(f"Written after {name} came back.")
            time.sleep(1.1)  # probes run at most once a second: the next success probes again
            assert client.post("/search", json={"query": "home", "user_id": "alice"}).status_code == 200
            lines = [r.getMessage() for r in caplog.records if r.name == "inferscale.runtime.outages"]
            assert sum("is not answering" in line for line in lines) == 1, lines
            assert sum("answers again" in line for line in lines) == 1, lines
            assert not [r for r in caplog.records if r.exc_info], "no traceback for an outage"
        got = client.get("/memories", params={"user_id": "alice"}).json()
        texts = sorted(m["memory"] for m in (got["results"] if isinstance(got, dict) else got))
        assert set(kept) <= set(texts), texts  # every acknowledged write is there
    assert OUTAGES.down() == {}


def test_kv_jobs_wait_out_a_postgresql_outage_with_one_log_line_and_none_dropped(postgres, tmp_path, caplog):
    """The background encoder reads each fact's context from the turn log: with PostgreSQL
    down its batches fail, which logs one line (not a traceback a job) and counts no attempt,
    so no job is dropped however long the outage; when it is back every KV is encoded."""
    caplog.set_level(logging.WARNING)
    with Memory(data_dir=tmp_path / "m", dtype="float32", context_window=2, database_url=postgres.url) as memory:
        background = memory.components.kv.background
        background.pause()
        for i in range(6):
            memory.add(f"Fact number {i}: I have {i} cats.", user_id="bob", infer=False)
        assert memory.pending_kv() == 6
        postgres.stop()
        background.resume()
        deadline = time.monotonic() + 60
        while background.failures < background.max_attempts + 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # more failed batches than a job's attempts: none may be dropped
        assert background.failures >= background.max_attempts + 2
        postgres.start()
        assert memory.wait_for_kv(timeout=300) and memory.pending_kv() == 0
        sources = memory.inject("How many cats?", user_id="bob", k=6).kv_sources
        assert len(sources) == 6 and set(sources.values()) <= {"device", "disk"}, sources  # all encoded, none dropped
    lines = [r.getMessage() for r in caplog.records if r.name == "inferscale.runtime.outages"]
    assert sum("PostgreSQL is not answering" in line for line in lines) == 1, lines
    assert sum("PostgreSQL answers again" in line for line in lines) == 1, lines
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert not [r for r in caplog.records if "giving up" in r.getMessage()]
