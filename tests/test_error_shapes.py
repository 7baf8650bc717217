"""One error shape (issue 53, item 4), in-process: a bug in a route is a JSON 500 whose
traceback is logged once (it was logged as a chain of the same traceback, re-raised through
every middleware); metadata that names another scope than the one a memory is stored under is
refused by every write of the library, naming both, and changes nothing (the server's 400s and
405s: tests/test_hostile_clients.py)."""

from __future__ import annotations

import logging

import httpx
import pytest

from inferscale import Memory
from inferscale.types import FactInput


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("shapes"), dtype="float32", precompute_kv=False) as m:
        m.add("Ana keeps bees.", user_id="ana", infer=False)
        yield m


def test_a_bug_in_a_route_is_a_json_500_logged_once(memory, loopback_front, caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in get_all")

    monkeypatch.setattr(memory, "get_all", broken)
    with caplog.at_level(logging.ERROR), loopback_front(memory) as url:
        # uvicorn's loggers do not propagate to the root, and its config (read as the front
        # starts) replaces their handlers: caplog's is added now, and removed after the test
        uvicorn_log = logging.getLogger("uvicorn.error")
        monkeypatch.setattr(uvicorn_log, "handlers", [*uvicorn_log.handlers, caplog.handler])
        r = httpx.get(url + "/memories", params={"user_id": "ana"}, timeout=60)
        assert httpx.get(url + "/health", timeout=60).status_code == 200  # and it keeps serving
    assert r.status_code == 500
    assert r.json()["detail"] == r.json()["error"]["message"] == "internal error (RuntimeError); see the server log"
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1, [rec.getMessage() for rec in caplog.records]
    assert logged[0].getMessage() == "GET /memories failed: RuntimeError: a bug in get_all"
    assert not [rec for rec in caplog.records if "Exception in ASGI application" in rec.getMessage()]


def test_metadata_naming_another_scope_is_refused_by_every_write(memory, assert_refused):
    mid = memory.get_all(user_id="ana")["results"][0]["id"]
    calls = {
        "add": lambda: memory.add("Ana keeps goats.", user_id="ana", metadata={"user_id": "bob"}),
        "add_facts": lambda: memory.add_facts([FactInput("Ana keeps goats.", metadata={"run_id": "r1"})],
                                              user_id="ana"),
        "update": lambda: memory.update(mid, "Ana keeps wasps.", user_id="ana", metadata={"agent_id": "helper"}),
        "update_metadata": lambda: memory.update_metadata(mid, {"user_id": "bob"}, user_id="ana"),
    }
    for name, call in calls.items():
        assert_refused(memory, "ana", call, ValueError, "but the memory is stored under")
    with pytest.raises(ValueError, match=r"metadata names user_id='bob', but the memory is stored under "
                                         r"user_id='ana': drop user_id from the metadata, or store"):
        memory.add("Ana keeps goats.", user_id="ana", metadata={"user_id": "bob"})
    # the scope's own ids, or a field removed, pass
    memory.update_metadata(mid, {"user_id": "ana"}, user_id="ana")
    assert memory.update_metadata(mid, {"user_id": None}, user_id="ana")["metadata"].get("user_id") is None
