"""Memory over MCP (:mod:`inferscale.mcp_server`), driven by the official SDK's client:
``inferscale mcp`` over stdio (a real subprocess) and ``inferscale serve``'s front at ``/mcp``
over streamable HTTP (on loopback, behind its API key, no vLLM behind it).

Both transports serve the same tools, so one scenario checks both: two users' memories stay
apart, update and delete work by id, and bad arguments come back as tool errors naming the
cause while the server keeps answering. ``answer`` runs on vLLM once, over stdio (the
subprocess starts its own engine: about a minute here); on the front without vLLM it is a
tool error saying vLLM's server is not answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from inferscale import Memory

pytestmark = pytest.mark.slow

KEY = "mcp-test-key-51c2"
INFERSCALE = Path(sys.executable).with_name("inferscale")
TOOLS = ["add", "search", "get_all", "update", "delete", "answer"]


@contextlib.asynccontextmanager
async def stdio_server(data_dir: Path, log: Path, **env: str):
    """The SDK's stdio transport to ``inferscale mcp --data-dir data_dir`` (its stderr in ``log``);
    no KV encoder loads unless ``env`` says otherwise."""
    env = {**os.environ, "INFERSCALE_DTYPE": "float32", "INFERSCALE_PRECOMPUTE_KV": "false", **env}
    params = StdioServerParameters(command=str(INFERSCALE), args=["mcp", "--data-dir", str(data_dir)], env=env)
    with log.open("a") as errlog:
        async with stdio_client(params, errlog=errlog) as streams:
            yield streams


async def ok(client: Client, tool: str, arguments: dict) -> dict:
    """The tool's structured result (the call must succeed)."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool}({arguments}) failed: {result.content}"
    assert json.loads(result.content[0].text) == result.structured_content  # the same JSON as text, for any client
    return result.structured_content


async def refused(client: Client, tool: str, arguments: dict, *words: str) -> str:
    """The tool error's text, which must name each of ``words``."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, f"{tool}({arguments}) was accepted: {result.structured_content}"
    text = result.content[0].text
    assert all(w in text for w in words), text
    return text


async def check_memory_tools(client: Client) -> None:
    """The scenario both transports pass."""
    listed = (await client.list_tools()).tools
    assert [t.name for t in listed] == TOOLS
    for t in listed:
        assert len(t.description or "") > 60, t
        assert t.input_schema["type"] == "object" and t.input_schema["properties"], t
        assert all(p.get("description") for p in t.input_schema["properties"].values()), t
    search = next(t for t in listed if t.name == "search")
    assert search.input_schema["properties"]["limit"]["maximum"] == 1000 and search.annotations.read_only_hint
    assert next(t for t in listed if t.name == "delete").annotations.destructive_hint

    peanuts = (await ok(client, "add", {"text": "I am allergic to peanuts.", "user_id": "alice"}))["results"][0]
    home = (await ok(client, "add", {"text": "I live in Lisbon.", "user_id": "alice",
                                     "metadata": {"topic": "home"}}))["results"][0]
    bob = await ok(client, "add", {"messages": [{"role": "user", "content": "I am a vegetarian."},
                                                {"role": "user", "content": "I live in Oslo."}], "user_id": "bob"})
    assert peanuts["event"] == home["event"] == "ADD" and [r["event"] for r in bob["results"]] == ["ADD", "ADD"]

    found = (await ok(client, "search", {"query": "What can't I eat?", "user_id": "alice", "limit": 5}))["results"]
    assert found[0]["id"] == peanuts["id"] and {r["id"] for r in found} == {peanuts["id"], home["id"]}
    found = (await ok(client, "search", {"query": "Where do I live?", "user_id": "bob", "top_k": 5}))["results"]
    assert {r["memory"] for r in found} == {"I am a vegetarian.", "I live in Oslo."}  # nothing of alice's
    found = (await ok(client, "search", {"query": "home", "user_id": "alice", "filters": {"topic": "home"}}))["results"]
    assert [r["id"] for r in found] == [home["id"]]
    assert len((await ok(client, "get_all", {"user_id": "alice"}))["results"]) == 2
    assert len((await ok(client, "get_all", {"user_id": "bob", "limit": 1}))["results"]) == 1

    await ok(client, "update", {"memory_id": home["id"], "text": "I live in Porto.", "user_id": "alice"})
    assert "I live in Porto." in {r["memory"] for r in (await ok(client, "get_all", {"user_id": "alice"}))["results"]}
    await refused(client, "update", {"memory_id": home["id"], "text": "x", "user_id": "bob"},  # another scope's id
                  "not found", "search or get_all")
    await ok(client, "delete", {"memory_id": peanuts["id"], "user_id": "alice"})
    assert [r["id"] for r in (await ok(client, "get_all", {"user_id": "alice"}))["results"]] == [home["id"]]

    # bad arguments: a tool error naming the cause and the fix, and nothing written
    await refused(client, "add", {"text": "I like tea."}, "user_id", "agent_id", "run_id")
    await refused(client, "add", {"text": "   ", "user_id": "alice"}, "empty")
    await refused(client, "add", {"user_id": "alice"}, "text", "messages")
    await refused(client, "search", {"query": "tea", "user_id": "alice", "limit": 5000}, "limit", "1000")
    await refused(client, "search", {"query": "tea", "user_id": "alice", "limit": 0}, "limit", ">= 1")
    await refused(client, "search", {"user_id": "alice"}, "query")
    await refused(client, "delete", {"memory_id": "no-such-id", "user_id": "alice"}, "not found", "no-such-id")
    await refused(client, "get_all", {"user_id": "alice", "limit": 10_000}, "limit")
    await refused(client, "answer", {"question": "What do I eat?", "user_id": "carol"}, "no memories", "add")
    await refused(client, "answer", {"question": "What do I eat?", "user_id": "alice", "k": 500}, "k", "200")
    await refused(client, "answer", {"question": " ", "user_id": "alice"}, "question is empty")
    # strict, as the REST routes: no coercion, no unknown argument (issue 52)
    await refused(client, "add", {"text": "I like tea.", "user_id": "alice", "infer": "yes"}, "infer")
    await refused(client, "add", {"text": "I like tea.", "user_id": "alice", "colour": "red"}, "colour")
    await refused(client, "search", {"query": "tea", "user_id": "alice", "limit": "5"}, "limit")
    await refused(client, "search", {"query": "tea", "user_id": "alice", "limit": True}, "limit")
    assert [r["id"] for r in (await ok(client, "get_all", {"user_id": "alice"}))["results"]] == [home["id"]]


# ---------------------------------------------------------------- stdio: inferscale mcp

async def test_stdio_server_keeps_users_apart_and_reports_bad_arguments_as_tool_errors(tmp_path):
    log = tmp_path / "mcp.log"
    async with Client(stdio_server(tmp_path / "data", log), read_timeout_seconds=300) as client:
        await check_memory_tools(client)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_stdio_answers_a_line_that_is_not_json_or_a_batch_with_a_json_rpc_error(tmp_path):
    """JSON-RPC 2.0 section 5: a parse error (-32700) or an invalid request (-32600), id null;
    the SDK alone answered nothing and logged nothing. The server keeps serving."""
    env = {**os.environ, "INFERSCALE_DTYPE": "float32", "INFERSCALE_PRECOMPUTE_KV": "false"}
    proc = subprocess.Popen([str(INFERSCALE), "mcp", "--data-dir", str(tmp_path / "data")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        def ask(line: bytes) -> dict:
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)  # no answer is a failure, not a hang
            assert ready, f"no answer to {line!r} in 120 s"
            return json.loads(proc.stdout.readline())

        parse = ask(b"this is not json")
        assert parse["id"] is None and parse["error"]["code"] == -32700, parse
        batch = ask(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]')
        assert batch["id"] is None and batch["error"]["code"] == -32600 and "batch" in batch["error"]["message"], batch
        init = ask(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode())
        assert init["id"] == 2 and init["result"]["serverInfo"]["name"] == "inferscale", init
    finally:
        proc.stdin.close()
        assert proc.wait(60) == 0
    err = proc.stderr.read().decode()
    assert "not JSON" in err and "batches" in err and "Traceback" not in err, err


async def test_stdio_answer_injects_the_users_memories_as_kv(tmp_path):
    """The subprocess starts vLLM on the first answer, which (``wait_for_kv``) makes the KV of the
    memory added a moment before and injects it; the client's log says what it waited for."""
    log = tmp_path / "mcp.log"
    async with Client(stdio_server(tmp_path / "data", log, INFERSCALE_PRECOMPUTE_KV="true"),
                      read_timeout_seconds=600) as client:
        added = await ok(client, "add", {"text": "My dog is called Max.", "user_id": "alice"})
        mid = added["results"][0]["id"]
        # right after add, wait_for_kv makes the memory's KV first (issue 56): no answer over its text
        answer = await ok(client, "answer", {"question": "What is my dog called?", "user_id": "alice",
                                             "max_tokens": 16, "wait_for_kv": True})
        assert [m["id"] for m in answer["memories"]] == [mid]
        assert answer["kv_memory_ids"] == [mid] and answer["injected_tokens"] > 0, answer
        assert answer["kv_sources"][mid] == "encoded now", answer  # made for this answer
        assert answer["text"].strip(), answer
        assert "Max" in answer["text"], answer  # the greedy answer of SmolLM2-135M with the memory as KV
    said = log.read_text()  # the client's log says what the first answer waited for (issue 56)
    assert "inferscale: starting vLLM's engine" in said and "inferscale: vLLM's engine is up" in said, said[-3000:]


# ---------------------------------------------------------------- streamable HTTP: inferscale serve's /mcp

@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("mcp-front"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(scope="module")
def front(memory, loopback_front):
    with loopback_front(memory, KEY) as url:
        yield url


def http_server(url: str, key: str | None = KEY, statuses: list[int] | None = None):
    """The SDK's streamable-HTTP transport to ``url``/mcp, with the key as a bearer token; each
    response's status is appended to ``statuses``."""
    async def record(response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return streamable_http_client(f"{url}/mcp", http_client=httpx2.AsyncClient(
        headers=headers, timeout=120, event_hooks={"response": [record]}))


async def test_front_mcp_endpoint_keeps_users_apart_and_reports_bad_arguments_as_tool_errors(front):
    async with Client(http_server(front)) as client:
        await check_memory_tools(client)
        # no vLLM behind this front: answer is a tool error saying so, and the endpoint keeps answering
        await ok(client, "add", {"text": "My cat is called Tom.", "user_id": "dave"})
        await refused(client, "answer", {"question": "What is my cat called?", "user_id": "dave"},
                      "vLLM's server is not answering", "retry")
        assert len((await ok(client, "get_all", {"user_id": "dave"}))["results"]) == 1


def test_front_mcp_endpoint_needs_the_api_key(front):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        r = httpx.post(f"{front}/mcp", headers={**headers, "Content-Type": "application/json"}, content=b"{}")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text


async def test_front_mcp_client_without_the_key_gets_no_tools(front):
    statuses: list[int] = []
    with pytest.raises(BaseException) as caught:
        async with Client(http_server(front, key=None, statuses=statuses)) as client:
            await client.list_tools()
    assert any(isinstance(e, MCPError) for e in leaves(caught.value)), repr(caught.value)
    assert statuses and set(statuses) == {401}, statuses


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    return [leaf for e in exc.exceptions for leaf in leaves(e)] if isinstance(exc, BaseExceptionGroup) else [exc]


# ---------------------------------------------------------------- the README's client entries (issue 56 item 4)

def readme_mcp_entries() -> list[dict]:
    """The ``mcpServers`` entries of the README's "Switch in one line" (its JSON blocks)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Switch in one line\n", 1)[1].split("\n## ", 1)[0]
    return [json.loads(block)["mcpServers"]["inferscale"] for block in re.findall(r"```json\n(.*?)```", section, re.S)]


async def test_the_readmes_mcp_entries_reach_the_six_tools(tmp_path, front):
    stdio, http = readme_mcp_entries()
    assert stdio["args"][:2] == ["mcp", "--data-dir"] and Path(stdio["command"]).name == "inferscale"
    params = StdioServerParameters(command=str(INFERSCALE), args=[*stdio["args"][:2], str(tmp_path / "data")],
                                   env={**os.environ, "INFERSCALE_PRECOMPUTE_KV": "false"})
    with (tmp_path / "mcp.log").open("a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=300) as client:
            assert [t.name for t in (await client.list_tools()).tools] == TOOLS
    assert http["url"] == "http://127.0.0.1:8000/mcp"
    key = http["headers"]["Authorization"].replace("<key>", KEY)
    async with Client(streamable_http_client(f"{front}/mcp", http_client=httpx2.AsyncClient(
            headers={"Authorization": key}, timeout=120))) as client:
        assert [t.name for t in (await client.list_tools()).tools] == TOOLS
