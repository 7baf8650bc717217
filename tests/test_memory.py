"""Memory end to end on the real components: SmolLM2, vLLM, Chroma on disk, LoCoMo."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
from vllm import SamplingParams

from inferscale import FactInput, Memory, UnknownScopeError
from inferscale.datasets.locomo import load_locomo, store_conversation
from inferscale.store.records import Scope

USER = "locomo-conv-26-s12"


@pytest.fixture(scope="module")
def sample(locomo_path):
    """LoCoMo sample 0 cut to its first two sessions (keeps the test in minutes)."""
    full = load_locomo(locomo_path)[0]
    return dataclasses.replace(
        full,
        turns=tuple(t for t in full.turns if t.session <= 2),
        facts=tuple(f for f in full.facts if f.session <= 2),
        qa=tuple(q for q in full.qa if q.evidence and all(e.split(":")[0] in ("D1", "D2") for e in q.evidence)),
    )


@pytest.fixture(scope="module")
def memory(serving_dir, engine, sample):
    mem = Memory(data_dir=serving_dir, dtype="float32", context_window=3, engine=engine)
    added = store_conversation(mem, sample, USER)
    assert added == len({f.dated_text() for f in sample.facts})
    assert mem.wait_for_kv(timeout=1200)
    return mem


def test_add_search_get_all_round_trip(memory):
    res = memory.add("I am allergic to peanuts and love hiking in the Alps.", user_id="hiker", metadata={"src": "chat"})
    (item,) = res["results"]
    assert item["event"] == "ADD"
    again = memory.add("I am allergic to peanuts and love hiking in the Alps.", user_id="hiker")
    assert again["results"][0] == {"id": item["id"], "memory": item["memory"], "event": "NOOP"}
    found = memory.search("Which food allergy do I have?", user_id="hiker", limit=5)["results"]
    assert [r["id"] for r in found] == [item["id"]]
    assert 0.2 < found[0]["score"] <= 1.0
    (stored,) = memory.get_all(user_id="hiker")["results"]
    assert stored["metadata"] == {"src": "chat"}
    assert stored["user_id"] == "hiker"
    assert len(stored["source_turn_ids"]) == 1  # provenance: its own turn
    # Mem0's current spelling: top_k, the scope in filters (mem0 main.py, Memory.search / get_all)
    memory.add("I also love cycling.", user_id="hiker")
    assert len(memory.search("hobbies", filters={"user_id": "hiker"}, top_k=1)["results"]) == 1
    assert len(memory.search("hobbies", user_id="hiker", top_k=5, limit=5)["results"]) == 2
    assert len(memory.get_all(filters={"user_id": "hiker"}, top_k=1)["results"]) == 1
    with pytest.raises(ValueError, match="limit=1 and top_k=2 disagree"):
        memory.search("hobbies", user_id="hiker", limit=1, top_k=2)
    with pytest.raises(TypeError, match="top_k must be an integer"):
        memory.get_all(user_id="hiker", top_k="3")


def test_get_all_lists_one_adds_memories_in_the_order_given(memory):
    texts = [f"Fact {word} about the reader." for word in ("zulu", "alpha", "mike", "bravo", "yankee", "charlie")]
    for _ in range(2):  # however the random ids fall
        memory.add([{"role": "user", "content": t} for t in texts], user_id="ordered", infer=False)
        memory.add("A later fact.", user_id="ordered", infer=False)
        listed = [m["memory"] for m in memory.get_all(user_id="ordered")["results"]]
        assert listed == texts + ["A later fact."]
        memory.delete_all(user_id="ordered")


def test_locomo_facts_keep_their_provenance(memory, sample):
    stored = memory.get_all(user_id=USER, limit=1000)["results"]
    by_text = {f.dated_text(): f.dia_ids for f in sample.facts}
    assert len(stored) == len(by_text)
    for item in stored:
        assert tuple(item["source_turn_ids"]) == by_text[item["memory"]]
    turns = memory.components.turns.count(Scope(USER).key)
    assert turns == len(sample.turns)
    assert store_conversation(memory, sample, USER) == 0  # a second load adds nothing, logs nothing
    assert memory.components.turns.count(Scope(USER).key) == turns
    assert len(memory.get_all(user_id=USER, limit=1000)["results"]) == len(by_text)


def test_generate_inject_prefills_only_the_question(memory, sample):
    question = sample.qa[0].question
    inj = memory.generate(question, user_id=USER, k=10, mode="inject", max_tokens=24)
    txt = memory.generate(question, user_id=USER, k=10, mode="text", max_tokens=24)
    assert inj.num_prompt_tokens == txt.num_prompt_tokens
    assert inj.num_injected_tokens > 0.8 * inj.num_prompt_tokens
    assert inj.num_prefilled_tokens == inj.num_prompt_tokens - inj.num_injected_tokens
    assert txt.num_injected_tokens == 0
    assert inj.num_prefilled_tokens < txt.num_prefilled_tokens
    assert inj.text and txt.text
    assert [m["id"] for m in inj.memories] == [m["id"] for m in txt.memories]


def test_inject_gives_a_request_any_connector_engine_can_serve(memory, engine, sample):
    question = sample.qa[1].question
    req = memory.inject(question, user_id=USER, k=8, context_window=3)
    assert len(req.memories) == 8
    owners = {seg[0].split("/")[0] for seg in req.kv_transfer_params["inferscale"]["segments"]}
    assert owners == {"_preamble"} | {m["id"] for m in req.memories}
    params = SamplingParams(max_tokens=16, temperature=0, extra_args={"kv_transfer_params": req.kv_transfer_params})

    async def plain_vllm_request():
        async for out in engine.llm.generate(req.vllm_prompt(), params, "plain-vllm-request"):
            final = out
        return final

    out = engine.run_coroutine(plain_vllm_request())
    ours = memory.generate(question, user_id=USER, k=8, context_window=3, max_tokens=16)
    assert out.outputs[0].text.strip() == ours.text


def test_scopes_never_see_each_other(memory):
    memory.add("My cat is called Whiskers.", user_id="alice")
    memory.add("My cat is called Shadow.", user_id="bob")
    alice_ids = {m["id"] for m in memory.get_all(user_id="alice")["results"]}
    for r in memory.search("What is my cat called?", user_id="bob")["results"]:
        assert r["id"] not in alice_ids and r["user_id"] == "bob"
    req = memory.inject("What is my cat called?", user_id="bob", k=50)
    owners = {seg[0].split("/")[0] for seg in req.kv_transfer_params["inferscale"]["segments"]}
    assert not owners & alice_ids
    assert "Shadow" in " ".join(m["memory"] for m in req.memories)


RESTART = textwrap.dedent(
    """
    import json, sys
    from inferscale.memory import Memory
    question, user = sys.argv[1], sys.argv[2]
    mem = Memory(data_dir=sys.argv[3], dtype="float32", context_window=3)
    loaded_before_search = mem.components.embedder._model is not None
    hits = mem.search(question, user_id=user, limit=10)["results"]
    embedded_by_search = mem.components.embedder.num_encoded_texts
    gen = mem.generate(question, user_id=user, k=10, max_tokens=24)
    print("RESULT" + json.dumps({
        "loaded_before_search": loaded_before_search,
        "embedded_texts": embedded_by_search,
        "hits": [[h["id"], h["score"]] for h in hits],
        "answer": gen.text, "injected": gen.num_injected_tokens,
        "encoder_loaded": mem.components.kv._encoder is not None, "kv_writes": mem.components.pool.stats["writes"],
    }))
    """
)


def test_restart_rebuilds_index_from_chroma_and_reuses_kv(memory, serving_dir, sample, tmp_path):
    """A new process over the same data dir: same search results without re-embedding, answers
    without re-encoding. The new process opens a copy of the data dir, as a restart would find
    it: while this process has the store open, another may not (tests/test_open_lock.py)."""
    import shutil

    question = sample.qa[2].question
    hits = [[h["id"], h["score"]] for h in memory.search(question, user_id=USER, limit=10)["results"]]
    answer = memory.generate(question, user_id=USER, k=10, max_tokens=24).text
    # nothing queued in the shared data dir (other tests' writes), or the new process would encode it
    assert memory.wait_for_kv(timeout=600), memory.components.kv.background.last_error
    restarted = shutil.copytree(serving_dir, tmp_path / "restarted")
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", RESTART, question, USER, str(restarted)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    got = json.loads(line[len("RESULT"):])
    assert got["loaded_before_search"] is False
    assert got["embedded_texts"] == 1  # the query only: no fact was re-embedded
    assert [h[0] for h in got["hits"]] == [h[0] for h in hits]
    assert [h[1] for h in got["hits"]] == pytest.approx([h[1] for h in hits], abs=1e-6)
    assert got["encoder_loaded"] is False and got["kv_writes"] == 0  # KV came from disk, none re-encoded
    assert got["injected"] > 0
    assert got["answer"] == answer


def test_bad_input_is_rejected_and_changes_nothing(memory):
    before = memory.get_all(user_id="hiker")["results"]
    turns_before = memory.components.turns.count('["hiker", null, null]')
    with pytest.raises(ValueError, match="empty"):
        memory.add("   ", user_id="hiker")
    with pytest.raises(TypeError, match="string"):
        memory.add({"role": "user", "content": 42}, user_id="hiker")
    with pytest.raises(ValueError, match="user_id"):
        memory.add("a fact without an owner")
    with pytest.raises(ValueError, match="not in this scope"):
        memory.add_facts([FactInput("x", source_turn_ids=("D99:1",))], user_id="hiker")
    with pytest.raises(ValueError, match="mode"):
        memory.generate("hi", user_id="hiker", mode="telepathy")
    # found by a hostile pass (stop 51): stored before, and PostgreSQL's text cannot hold a NUL
    with pytest.raises(ValueError, match=r"NUL character \(\\x00\) at 2"):
        memory.add("ab\x00cd", user_id="hiker")
    with pytest.raises(ValueError, match="empty"):
        memory.add("\u200b\u200b\ufeff", user_id="hiker")  # invisible characters alone
    with pytest.raises(TypeError, match="metadata must be a dict"):
        memory.update_metadata(memory.get_all(user_id=USER, limit=1)["results"][0]["id"], None, user_id=USER)
    with pytest.raises(ValueError, match="takes a JSON value, got a set"):
        memory.search("peanuts", user_id="hiker", filters={"src": {"eq": {"chat", "web"}}})
    assert memory.get_all(user_id="hiker")["results"] == before
    assert memory.components.turns.count('["hiker", null, null]') == turns_before


def test_unknown_user_gets_a_clear_error(memory):
    assert memory.search("anything", user_id="nobody-here")["results"] == []
    with pytest.raises(UnknownScopeError, match="no memories"):
        memory.generate("What do you know about me?", user_id="nobody-here")
