"""What a memory store shows of itself (issue 41), in-process: ``Memory.kv_entries``, the chat
log behind ``Memory.chats``, and the HTML Jupyter shows for a ``Memory``, a search result and a
``Generation`` (user content escaped). The page at ``/ui`` over a real server is tests/test_ui.py;
KV entries a request captured, and a real Generation's picture, are in tests/test_capture.py."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import pytest

from inferscale import Memory
from inferscale.kv.inventory import OTHER_SETTINGS
from inferscale.store.chat_log import KEEP_PER_SCOPE
from inferscale.store.records import Scope
from inferscale.types import Generation, MemoryNotFoundError

XSS = 'Eve wrote <script>alert("x")</script> and <img src=x onerror=alert(1)>'


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    mem = Memory(data_dir=tmp_path_factory.mktemp("inspect"), dtype="float32")
    for text in ("Eve's cat is called Pixel.", "Eve works nights.", XSS):
        mem.add(text, user_id="eve", metadata={"tag": "<b>bold</b>"})
    assert mem.wait_for_kv(timeout=600)
    yield mem
    mem.close()


def test_kv_entries_say_where_each_memorys_kv_is_and_how_it_was_made(memory):
    entries = memory.kv_entries(user_id="eve")
    assert len(entries) == 3
    for record in memory.components.facts.list(Scope("eve")):
        (e,) = entries[record.id]
        assert e["made"] == "encoded (w=5)" and e["in_use"] and e["storage"] == "model"
        assert set(e["tiers"]) == {"device", "disk"}  # encoded here: held in this process and on disk
        assert e["tokens"] == len(memory.components.prompts.fact_line_ids(record.text))
        assert e["bytes"] == (memory.components.kv_dir / f"{e['key']}.safetensors").stat().st_size
        assert e["last_use"].endswith("+00:00")
    some = next(iter(entries))
    (other,) = memory.kv_entries([some], user_id="eve", context_window=0)[some]  # at w=0 it is not the one used
    assert other["made"] == OTHER_SETTINGS and not other["in_use"]
    with pytest.raises(MemoryNotFoundError):
        memory.kv_entries([some], user_id="mallory")
    for bad in (some, some.encode()):
        with pytest.raises(TypeError, match="list of memory ids"):
            memory.kv_entries(bad, user_id="eve")
    with pytest.raises(ValueError, match="context_window"):
        memory.kv_entries([some], user_id="eve", context_window=2**70)
    items, kv, total = memory.kv_report(user_id="eve", limit=2)  # what the page at /ui lists
    assert total == 3 and [i["id"] for i in items] == list(kv) == list(entries)[:2]


def test_the_chat_log_keeps_the_newest_reports_per_scope_and_forgets_with_the_memories(memory):
    chats = memory.components.chats
    for i in range(KEEP_PER_SCOPE + 5):
        chats.record(Scope("eve").key, {"query": f"q{i}", "memories": []})
    chats.record(Scope("zed").key, {"query": "zed's", "memories": []})
    recent = memory.chats(user_id="eve", limit=1000)
    assert len(recent) == KEEP_PER_SCOPE and recent[0]["query"] == f"q{KEEP_PER_SCOPE + 4}"
    assert recent[-1]["query"] == "q5" and recent[0]["id"] > recent[1]["id"]
    assert [c["query"] for c in memory.chats(user_id="zed")] == ["zed's"]
    with pytest.raises(ValueError, match="limit"):
        memory.chats(user_id="eve", limit=0)
    memory.delete_all(user_id="zed")  # a scope's reports quote its memories: they go with them
    assert memory.chats(user_id="zed") == [] and len(memory.chats(user_id="eve", limit=1000)) == KEEP_PER_SCOPE


def test_a_search_result_is_mem0s_dict_and_shows_its_ranking_escaped(memory):
    found = memory.search("what did Eve write", user_id="eve")
    assert found == {"results": found["results"]} and json.loads(json.dumps(found)) == found
    assert pickle.loads(pickle.dumps(found)) == found
    shown = found._repr_html_()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in shown and "<script" not in shown
    assert "<img" not in shown and "hybrid ranking" in shown and "&lt;b&gt;bold&lt;/b&gt;" in shown


def test_a_memory_shows_its_scopes_and_pool(memory):
    shown = memory._repr_html_()
    assert "user_id=eve" in shown and "KV pool" in shown and "disk" in shown and "no limit" in shown
    assert repr(memory).startswith("<inferscale.memory.Memory object")  # the plain repr stays


def test_a_generations_picture_escapes_memory_text():
    g = Generation(text="<b>hi</b>", mode="inject", ttft_s=0.01, latency_s=0.1, retrieval_s=0.001,
                   num_prompt_tokens=60, num_injected_tokens=40, num_prefilled_tokens=20,
                   memories=[{"id": "a", "memory": XSS, "score": 0.5}, {"id": "b", "memory": "plain", "score": 0.2}],
                   kv_memory_ids=["a"], text_memory_ids=["b"], kv_sources={"a": "disk", "b": "text: evicted"})
    shown = g._repr_html_()
    assert "TTFT unknown" in replace(g, ttft_s=None)._repr_html_()
    assert "<script" not in shown and "<img" not in shown and "&lt;b&gt;hi&lt;/b&gt;" in shown
    assert "memory as KV (40)" in shown and "prefilled (20)" in shown and "text: evicted" in shown
    assert shown.index("plain") > shown.index("Eve wrote")  # prompt order: KV first, then text
