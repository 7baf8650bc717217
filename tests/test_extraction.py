"""add(infer=True): extraction with the served LLM, reconciliation into ADD/UPDATE/DELETE/NOOP."""

import pytest

from inferscale import Memory
from inferscale.facts.extraction import (EXTRACTION_EXAMPLE, LLMFactExtractor, SimilarityReconciler, grounding,
                                         parse_facts)
from inferscale.store.turns import Turn


@pytest.mark.parametrize(
    ("reply", "facts"),
    [
        ('["Alice lives in Paris.", "Alice likes tea."]', ["Alice lives in Paris.", "Alice likes tea."]),
        ('Sure! Here they are:\n["A.", "B."]\nHope it helps', ["A.", "B."]),
        ('{"facts": ["One.", "Two."]}', ["One.", "Two."]),
        ("- First fact\n- Second fact\n", ["First fact", "Second fact"]),
        ("1. Alpha\n2) Beta", ["Alpha", "Beta"]),
        ('["Dup.", "Dup.", "", "  "]', ["Dup."]),
        ('["unterminated", "list"', ["unterminated", "list"]),
        ("nothing to remember", []),
        ("[]", []),
    ],
)
def test_replies_are_parsed_forgivingly(reply, facts):
    assert parse_facts(reply) == facts


class Scripted:
    """An extractor plug-in that returns given facts (the LLM is exercised in the last test)."""

    def __init__(self):
        self.facts: list[str] = []
        self.seen_turns = []

    def __call__(self, turns, chat):
        self.seen_turns.append([t.content for t in turns])
        return list(self.facts)


def test_reconciliation_emits_each_event_and_records_history(tmp_path):
    extractor = Scripted()
    mem = Memory(data_dir=tmp_path, dtype="float32", context_window=0, precompute_kv=False, extractor=extractor)
    extractor.facts = ["The user lives in Paris.", "The user has a dog named Rex."]
    res = mem.add("I live in Paris and my dog is Rex.", user_id="u", infer=True)["results"]
    assert [r["event"] for r in res] == ["ADD", "ADD"]
    assert extractor.seen_turns == [["I live in Paris and my dog is Rex."]]
    paris = res[0]["id"]
    assert mem.get(paris, user_id="u")["source_turn_ids"]  # provenance: the turn it came from

    extractor.facts = ["The user lives in Paris."]
    assert mem.add("Paris is home.", user_id="u", infer=True)["results"] == [
        {"id": paris, "memory": "The user lives in Paris.", "event": "NOOP"}]

    extractor.facts = ["The user lives in Paris, in the 11th district."]
    (upd,) = mem.add("Moved within Paris.", user_id="u", infer=True)["results"]
    assert upd["event"] == "UPDATE" and upd["id"] == paris and upd["previous_memory"] == "The user lives in Paris."

    extractor.facts = ["The user does not have a dog named Rex."]
    res = mem.add("Rex is not my dog any more.", user_id="u", infer=True)["results"]
    assert [r["event"] for r in res] == ["DELETE", "ADD"]
    assert res[0]["memory"] == "The user has a dog named Rex."
    assert [e["event"] for e in mem.history(paris, user_id="u")] == ["ADD", "UPDATE"]
    assert [e["event"] for e in mem.history(res[0]["id"], user_id="u")] == ["ADD", "DELETE"]
    texts = sorted(r["memory"] for r in mem.get_all(user_id="u")["results"])
    assert texts == ["The user does not have a dog named Rex.", "The user lives in Paris, in the 11th district."]


def test_extracted_facts_must_be_grounded_in_the_conversation():
    said = "I adopted a dog called Max and I live in Lyon."
    assert grounding("The user hates coffee.", said) == 0.0
    assert grounding("The user lives in Lyon.", said) == 1.0
    assert grounding("The user adopted a dog.", said) == 1.0
    assert grounding("The user is.", said) == 0.0  # no content words at all
    assert grounding("The user no longer lives in Lyon.", said) == 1.0  # negations are not content
    assert grounding("The user moved to München.", "I moved to München last year.") == 1.0  # any script's letters
    # a small model echoing the prompt's worked example: the copied facts are dropped
    echo = EXTRACTION_EXAMPLE[1][:-1] + ', "The user has a dog called Max.", "The user lives in Lyon."]'
    seen = []
    extractor = LLMFactExtractor()
    got = extractor([Turn("t1", "user", said)], lambda messages: seen.append(messages) or echo)
    assert got == ["The user has a dog called Max.", "The user lives in Lyon."]
    assert said in seen[0][-1]["content"]
    assert LLMFactExtractor(min_grounding=0.0)([Turn("t1", "user", said)], lambda m: echo)[:1] == ["The user is called Bob."]
    with pytest.raises(ValueError, match="min_grounding"):
        LLMFactExtractor(min_grounding=1.5)


def test_reconciler_thresholds_are_validated():
    with pytest.raises(ValueError, match="related_at"):
        SimilarityReconciler(noop_at=0.5, related_at=0.9)


def test_infer_true_extracts_facts_with_the_served_llm(serving_dir, engine):
    mem = Memory(data_dir=serving_dir, dtype="float32", context_window=0, engine=engine)
    msgs = [{"role": "user", "content": "Hi, my name is Alice and I live in Paris. I am allergic to peanuts."}]
    res = mem.add(msgs, user_id="infer-alice", infer=True)["results"]
    assert res and all(r["event"] == "ADD" for r in res)
    stored = mem.get_all(user_id="infer-alice")["results"]
    assert {r["memory"] for r in stored} == {r["memory"] for r in res}
    assert any("Paris" in r["memory"] for r in stored)
    assert all(r["source_turn_ids"] for r in stored)
    again = mem.add(msgs, user_id="infer-alice", infer=True)["results"]  # same conversation, same facts
    assert {r["event"] for r in again} == {"NOOP"}
    assert len(mem.get_all(user_id="infer-alice")["results"]) == len(stored)
