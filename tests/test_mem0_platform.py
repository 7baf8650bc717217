"""Mem0's Platform API on ``inferscale serve``'s front (:mod:`inferscale.server.mem0_platform`):
Mem0's real ``MemoryClient`` (``mem0ai``, in its own environment ``.venv-mem0-client``) makes
every memory call against the front on loopback; older clients' v1/v2 routes answer in their
shapes; what InferScale does not support is a clear 4xx that changes nothing.

The front runs without vLLM here (every call below is a memory call and ``infer=False``);
tests/test_server.py runs the example, chat with injected KV included, against a real
``inferscale serve``.
"""

from __future__ import annotations

import json
import json as _json
import os
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest

from inferscale import Memory

KEY = "mem0-test-key"
ROOT = Path(__file__).resolve().parent.parent
MEM0_CLIENT = ROOT / ".venv-mem0-client" / "bin" / "python"
TOKEN = {"Authorization": f"Token {KEY}"}


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("mem0"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(scope="module")
def front(memory, loopback_front):
    with loopback_front(memory, KEY) as url:
        yield url


def mem0(front: str, body: str) -> dict:
    """Run ``body`` with ``client = MemoryClient(api_key=KEY, host=front)`` in the Mem0 client's
    own environment; ``body`` sets ``out``, printed as JSON."""
    assert MEM0_CLIENT.exists(), "no .venv-mem0-client: run `bash scripts/install.sh`"
    script = "import json\nfrom mem0 import MemoryClient\n" \
             f"client = MemoryClient(api_key={KEY!r}, host={front!r})\nout = {{}}\n" \
             f"{textwrap.dedent(body)}\nprint(json.dumps(out))\n"
    run = subprocess.run([str(MEM0_CLIENT), "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MEM0_TELEMETRY": "False"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def http(front: str, method: str, path: str, json: object = None, **kw) -> httpx.Response:
    """A request with ``json`` sent as ASCII JSON (``\\ud800`` escapes reach the server as
    lone surrogates, as from any JSON client; httpx itself would refuse to encode them)."""
    if json is not None:
        kw["content"], kw["headers"] = _json.dumps(json), {**TOKEN, "Content-Type": "application/json"}
    return httpx.request(method, front + path, headers=kw.pop("headers", TOKEN), timeout=60, **kw)


def test_memory_client_makes_every_call_scoped(front, memory):
    out = mem0(front, """
        out["project"] = [client.org_id, client.project_id]
        out["add"] = client.add([{"role": "user", "content": "My cat is called Miso."},
                                 {"role": "user", "content": "I sail on weekends."}],
                                user_id="m-alice", infer=False, metadata={"topic": "life"})
        client.add("I collect stamps.", user_id="m-bob", infer=False)
        client.add("Answer in French.", agent_id="m-helper", infer=False)
        ids = [r["id"] for r in out["add"]["results"]]
        out["get_all"] = client.get_all(filters={"user_id": "m-alice"})
        out["page"] = client.get_all(filters={"AND": [{"user_id": "m-alice"}]}, page=2, page_size=1)
        out["search"] = client.search("What is the cat called?", filters={"user_id": "m-alice"}, top_k=1)
        out["filtered"] = client.search("cat", filters={"user_id": "m-alice", "topic": "work"})
        out["get"] = client.get(ids[0])
        out["update"] = client.update(ids[0], text="My cat is called Tofu.", metadata={"topic": "pets"})
        out["history"] = client.history(ids[0])
        out["users"] = client.users()
        out["delete"] = client.delete(ids[1])
        out["after_delete"] = client.get_all(filters={"user_id": "m-alice"})
        out["delete_all"] = client.delete_all(filters={"user_id": "m-alice"})
        out["delete_users"] = client.delete_users(user_id="m-bob")
        out["users_at_end"] = client.users()
    """)
    assert out["project"] == ["inferscale", "inferscale"]
    add = out["add"]
    assert add["status"] == "SUCCEEDED" and add["event_id"]
    assert [(r["event"], r["data"]["memory"]) for r in add["results"]] == [
        ("ADD", "My cat is called Miso."), ("ADD", "I sail on weekends.")]
    cat, sail = (r["id"] for r in add["results"])
    listed = out["get_all"]
    assert listed["count"] == 2 and listed["next"] is None and listed["previous"] is None
    # (one add's memories share created_at, so their order among themselves is not fixed)
    assert sorted((m["id"], m["memory"], m["user_id"], m["metadata"]) for m in listed["results"]) == sorted([
        (cat, "My cat is called Miso.", "m-alice", {"topic": "life"}),
        (sail, "I sail on weekends.", "m-alice", {"topic": "life"})])
    assert out["page"]["count"] == 2 and [m["id"] for m in out["page"]["results"]] == [listed["results"][1]["id"]]
    assert out["page"]["previous"] and out["page"]["next"] is None
    (hit,) = out["search"]["results"]
    assert hit["id"] == cat and 0 < hit["score"] <= 1
    assert out["filtered"]["results"] == []  # a metadata filter, from Mem0's filters
    assert out["get"]["memory"] == "My cat is called Miso." and out["get"]["user_id"] == "m-alice"
    assert out["update"]["memory"] == "My cat is called Tofu." and out["update"]["metadata"] == {"topic": "pets"}
    assert [(e["event"], e["old_memory"], e["new_memory"]) for e in out["history"]] == [
        ("ADD", None, "My cat is called Miso."), ("UPDATE", "My cat is called Miso.", "My cat is called Tofu.")]
    users = {(e["type"], e["name"]): e["total_memories"] for e in out["users"]["results"]}
    assert users == {("user", "m-alice"): 2, ("user", "m-bob"): 1, ("agent", "m-helper"): 1}
    assert out["users"]["total_users"] == 2 and out["users"]["total_agents"] == 1
    assert out["delete"]["message"] == "Memory deleted successfully!"
    assert [m["id"] for m in out["after_delete"]["results"]] == [cat]
    assert {(e["type"], e["name"]) for e in out["users_at_end"]["results"]} == {("agent", "m-helper")}
    # the writes are InferScale memories like any other
    assert memory.get_all(user_id="m-alice")["results"] == [] and memory.count(user_id="m-bob") == 0
    assert [m["memory"] for m in memory.get_all(agent_id="m-helper")["results"]] == ["Answer in French."]


def test_batch_update_and_batch_delete_of_memory_client_write_each_scope_in_one_write(front, memory):
    """Mem0's ``client.batch_update`` / ``client.batch_delete`` (``PUT`` / ``DELETE /v1/batch/``)
    over memories of two users: texts and metadata replaced, a metadata-only entry keeping the
    text; then both deleted."""
    a = memory.add("I row on Sundays.", user_id="m-batch-a", infer=False, metadata={"topic": "sport"})
    b = memory.add("I knit scarves.", user_id="m-batch-b", infer=False, metadata={"topic": "craft", "old": 1})
    ida, idb = a["results"][0]["id"], b["results"][0]["id"]
    out = mem0(front, f"""
        out["update"] = client.batch_update([{{"memory_id": {ida!r}, "text": "I row on Saturdays."}},
                                             {{"memory_id": {idb!r}, "metadata": {{"topic": "hobby"}}}}])
        out["a"], out["b"] = client.get({ida!r}), client.get({idb!r})
        out["delete"] = client.batch_delete([{{"memory_id": {ida!r}}}, {{"memory_id": {idb!r}}}])
    """)
    assert out["update"]["message"] == "Successfully updated 2 memories"
    assert (out["a"]["memory"], out["a"]["metadata"]) == ("I row on Saturdays.", {"topic": "sport"})
    assert (out["b"]["memory"], out["b"]["metadata"]) == ("I knit scarves.", {"topic": "hobby"})
    assert out["delete"]["message"] == "Successfully deleted 2 memories"
    assert memory.count(user_id="m-batch-a") == 0 and memory.count(user_id="m-batch-b") == 0


def test_a_metadata_only_update_replaces_the_metadata_and_keeps_text_and_kv(front, memory):
    """``PUT /v1/memories/{id}/`` with metadata alone (Mem0's ``client.update(id, metadata=...)``):
    the metadata is replaced, the text, ``updated_at`` and embedding stay (nothing re-embedded,
    the KV stays valid), and the history records an update whose text is unchanged."""
    added = memory.add("My kayak is yellow.", user_id="m-meta", infer=False, metadata={"topic": "boats", "old": 1})
    mid = added["results"][0]["id"]
    before = memory.get(mid, user_id="m-meta")
    r = http(front, "PUT", f"/v1/memories/{mid}/", json={"metadata": {"topic": "sport", "level": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["memory"] == "My kayak is yellow." and r.json()["metadata"] == {"topic": "sport", "level": 2}
    after = memory.get(mid, user_id="m-meta")
    assert after["metadata"] == {"topic": "sport", "level": 2} and after["updated_at"] == before["updated_at"]
    assert [e["event"] for e in memory.history(mid, user_id="m-meta")] == ["ADD", "UPDATE"]
    assert memory.search("kayak colour", user_id="m-meta")["results"][0]["id"] == mid
    bad = http(front, "PUT", f"/v1/memories/{mid}/", json={"metadata": {"created_at": 5}})
    assert bad.status_code == 400 and memory.get(mid, user_id="m-meta")["metadata"] == after["metadata"]


def test_older_clients_v1_and_v2_routes_answer_in_their_shapes(front, memory):
    r = http(front, "POST", "/v1/memories/", json={"messages": [{"role": "user", "content": "I own a red kayak."}],
                                                  "user_id": "v1-user", "infer": False, "output_format": "v1.1"})
    assert r.status_code == 200, r.text
    ((added,),) = [r.json()["results"]]
    assert added["event"] == "ADD" and added["memory"] == "I own a red kayak." and r.json()["relations"] == []
    bare = http(front, "POST", "/v1/memories/", json={"messages": "I fear heights.", "user_id": "v1-user",
                                                     "infer": False})
    assert isinstance(bare.json(), list) and bare.json()[0]["memory"] == "I fear heights."  # v1.0: a list
    v1_all = http(front, "GET", "/v1/memories/", params={"user_id": "v1-user"}).json()
    assert [m["memory"] for m in v1_all] == ["I own a red kayak.", "I fear heights."]
    v2_all = http(front, "POST", "/v2/memories/", json={"filters": {"user_id": "v1-user"}, "page_size": 1}).json()
    assert [m["memory"] for m in v2_all] == ["I own a red kayak."]
    v1_hits = http(front, "POST", "/v1/memories/search/", json={"query": "boat", "user_id": "v1-user",
                                                                "top_k": 1, "output_format": "v1.1"}).json()
    assert [h["memory"] for h in v1_hits["results"]] == ["I own a red kayak."]
    v2_hits = http(front, "POST", "/v2/memories/search/", json={"query": "afraid of heights", "top_k": 1,
                                                                "filters": {"AND": [{"user_id": "v1-user"}]},
                                                                "fields": ["memory"]}).json()
    assert v2_hits == [{"id": bare.json()[0]["id"], "memory": "I fear heights."}]
    assert http(front, "DELETE", "/v1/memories/", params={"user_id": "v1-user"}).status_code == 200
    assert memory.count(user_id="v1-user") == 0
    # the key as Bearer works too, and a wrong key is 401 in both schemes, with Mem0's detail
    assert httpx.get(front + "/v1/ping/", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for scheme in ("Token", "Bearer"):
        wrong = httpx.get(front + "/v1/ping/", headers={"Authorization": f"{scheme} nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["detail"]


BAD = [
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False, "app_id": "shop"}, "app_id"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False,
                                   "custom_categories": [{"food": "meals"}]}, "custom_categories"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False, "expiration_date": "2030-01-01"},
     "expiration_date"),
    ("POST", "/v3/memories/add/", {"messages": "x", "infer": False}, "user_id"),
    ("POST", "/v3/memories/add/", {"messages": [{"role": "user", "content": 5}], "user_id": "b", "infer": False},
     "content"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": "yes"}, "infer"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False, "project_id": "other"},
     "project_id"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "rerank": True}, "rerank"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"OR": [{"user_id": "b"}, {"user_id": "c"}]}},
     "one scope"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "categories": ["a"]}, "categories"),
    ("POST", "/v3/memories/search/", {"query": "", "filters": {"user_id": "b"}}, "query"),
    ("POST", "/v3/memories/", {"filters": {"user_id": {"in": ["b", "c"]}}}, "user_id must be a non-empty string"),
    ("POST", "/v3/memories/", {"filters": {"user_id": "b"}, "page": 0}, "page"),
    ("DELETE", "/v1/memories/", None, "user_id"),
    ("PUT", "/v1/memories/0123456789abcdef0123456789abcdef/", {"text": "x"}, "not found"),
    ("GET", "/v1/memories/0123456789abcdef0123456789abcdef/history/", None, "not found"),
    ("DELETE", "/v2/entities/app/shop/", None, "no apps"),
    ("PUT", "/v1/batch/", {"memories": []}, "at least 1"),
    ("PUT", "/v1/batch/", {"memories": [{"memory_id": "{kept}", "text": "x"},
                                        {"memory_id": "0123456789abcdef0123456789abcdef", "text": "y"}]}, "not found"),
    ("PUT", "/v1/batch/", {"memories": [{"memory_id": "{kept}"}]}, "text and/or metadata"),
    ("DELETE", "/v1/batch/", {"memories": [{"memory_id": "{kept}"},
                                           {"memory_id": "0123456789abcdef0123456789abcdef"}]}, "not found"),
    ("POST", "/v1/feedback/", {"memory_id": "x", "feedback": "POSITIVE"}, "no route"),
    ("POST", "/v1/exports/", {"schema": "{}"}, "no route"),
    ("GET", "/v1/event/3c90c3cc-0d44-4b50-8888-8dd25736052a/", None, "synchronously"),
    # what a hostile or careless client sends (the breaker's list, 2026-12-04)
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False, "metadata": {"k": "\ud800"}},
     "not valid Unicode"),
    ("PUT", "/v1/memories/{kept}/", {"metadata": {"\ud800": 1}}, "not valid Unicode"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "\ud800", "infer": False}, "printable"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "u" * 100_000, "infer": False}, "at most 256"),
    ("POST", "/v3/memories/add/", {"messages": "x", "user_id": "b", "infer": False,
                                   "filters": {"user_id": "b", "cat": "x"}}, "scope only"),
    ("POST", "/v3/memories/add/?user_id=eve", {"messages": "x", "user_id": "b", "infer": False}, "not read"),
    ("DELETE", "/v1/memories/?user_id=b&user_id=c", None, "more than once"),
    ("DELETE", "/v1/memories/?user_id=b&page=1", None, "not read"),
    ("DELETE", "/v1/memories/?filters={1: 2}", None, "string keys"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "threshold": True}, "threshold"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "fields": ["nosuch"]}, "nosuch"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "top_k": 1, "limit": 5},
     "disagree"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "*"}}, "wildcard"),
    ("POST", "/v3/memories/search/", {"query": "x", "filters": {"user_id": "b"}, "output_format": "v99"},
     "output_format"),
    ("POST", "/v3/memories/?page=2", {"filters": {"user_id": "b"}, "page": 1}, "give it once"),
    ("GET", "/v1/chat/completions", None, "takes POST"),
]


@pytest.mark.parametrize("method,path,body,says", BAD, ids=[f"{m} {p} {s}" for m, p, _, s in BAD])
def test_unsupported_routes_and_fields_are_a_clear_4xx_that_changes_nothing(front, memory, method, path, body, says):
    kept = memory.add("I keep this.", user_id="b", infer=False)["results"][0]["id"]
    before, scopes = memory.get_all(user_id="b")["results"], memory.scopes()
    body = _json.loads(_json.dumps(body).replace("{kept}", kept))
    r = http(front, method, path.replace("{kept}", kept), json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert says in r.json()["detail"], r.json()["detail"]
    assert memory.get_all(user_id="b")["results"] == before and kept in {m["id"] for m in before}
    assert memory.scopes() == scopes  # no scope gained or lost a memory
    assert http(front, "GET", "/v1/ping/").status_code == 200  # and the server keeps serving


def test_a_mem0_path_without_its_slash_is_redirected_to_it(front):
    r = httpx.get(front + "/v1/ping", headers=TOKEN)
    assert r.status_code == 307 and r.headers["location"].endswith("/v1/ping/")
    assert httpx.get(front + "/v1/ping", headers=TOKEN, follow_redirects=True).json()["status"] == "ok"


def test_a_body_sent_in_chunks_past_the_limit_is_413_before_it_is_parsed(front, memory):
    from inferscale.server.limits import FrontLimits

    MAX_BODY_BYTES = FrontLimits().max_body_bytes

    def chunks():  # no Content-Length: the size is known only as it arrives
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    before = memory.scopes()
    r = httpx.post(front + "/v3/memories/add/", content=chunks(), timeout=120,
                   headers={**TOKEN, "Content-Type": "application/json"})
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["detail"]
    assert memory.scopes() == before and http(front, "GET", "/v1/ping/").status_code == 200


def test_search_skips_expired_memories_unless_show_expired(front, memory):
    """A memory whose metadata ``expires_at`` has passed is not found by Mem0's search, unless
    the body says ``show_expired: true``."""
    import time

    gone = memory.add("My gym badge number is 77.", user_id="m-exp", infer=False,
                      metadata={"expires_at": time.time() - 1})["results"][0]["id"]
    body = {"query": "gym badge", "filters": {"user_id": "m-exp"}}
    assert http(front, "POST", "/v2/memories/search/", json=body).json() == []
    shown = http(front, "POST", "/v2/memories/search/", json={**body, "show_expired": True}).json()
    assert [m["id"] for m in shown] == [gone]
