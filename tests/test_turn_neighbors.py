"""Hybrid search reads the conversation a fact was drawn from: BM25 indexes the turn before
each source turn too, and a fact drawn from within a few turns of a strong match gets a
share of its score (:func:`inferscale.store.keyword.turn_neighbor_bonus`); a query that
names a month or year fuses the ranking of the memories that name it
(:func:`inferscale.store.keyword.add_date_ranking`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferscale import FactInput, Memory
from inferscale.store.keyword import add_date_ranking, date_terms, turn_neighbor_bonus
from inferscale.store.records import Scope


def _placed(positions: np.ndarray) -> np.ndarray:
    rows = np.flatnonzero(np.isfinite(positions))
    return rows[np.argsort(positions[rows], kind="stable")]


def test_the_bonus_goes_to_rows_within_reach_of_a_strong_match():
    scores = np.array([1.0, 0.1, 0.2, 0.05, -np.inf, 0.3])
    positions = np.array([10.0, 12.0, 30.0, np.nan, 11.0, 14.5])
    bonus = turn_neighbor_bonus(scores, positions, _placed(positions), share=0.5, reach=4.0, sources=64)
    # row 1 (2 turns from row 0) and row 5 (4.5 from row 0, 2.5 from row 1): the best within reach
    assert bonus[1] == pytest.approx(0.5 * 1.0)
    assert bonus[5] == pytest.approx(0.5 * 0.1)  # row 0 is 4.5 turns away: out of reach
    assert bonus[0] == pytest.approx(0.5 * 0.1)  # row 5 is 4.5 turns from row 0: out of reach; row 1 is in
    assert bonus[2] == 0.0  # nothing within 4 turns of position 30
    assert bonus[3] == 0.0  # no position: no bonus
    assert bonus[4] == 0.0  # excluded by a filter: it neither gets a bonus ...
    excluded_gives = turn_neighbor_bonus(np.array([-np.inf, 0.1]), np.array([0.0, 1.0]),
                                         _placed(np.array([0.0, 1.0])), share=0.5, reach=4.0, sources=64)
    assert excluded_gives.tolist() == [0.0, 0.0]  # ... nor gives one


def test_only_the_best_sources_give_a_bonus():
    scores = np.array([1.0, 0.9, 0.1, 0.05])
    positions = np.array([0.0, 100.0, 2.0, 101.0])
    bonus = turn_neighbor_bonus(scores, positions, _placed(positions), share=0.5, reach=4.0, sources=1)
    assert bonus.tolist() == [0.0, 0.0, 0.5, 0.0]  # only row 0 gives; row 1 is not among the best 1
    assert turn_neighbor_bonus(scores, positions, _placed(positions), share=0.0).tolist() == [0.0] * 4
    assert turn_neighbor_bonus(np.array([]), np.array([]), np.array([], dtype=np.int64)).shape == (0,)


TURNS = [
    {"id": "a", "name": "Sam", "content": "How are you spending your Sunday?"},
    {"id": "b", "name": "Jo", "content": "I went to the zoo and saw a zebra giving birth!"},
    {"id": "c", "name": "Sam", "content": "Wow. What then?"},
    {"id": "d", "name": "Jo", "content": "Then I treated myself to pistachio ice cream."},
    *({"id": f"x{i}", "name": "Sam", "content": f"Filler line number {i} about the weather."} for i in range(12)),
    {"id": "z", "name": "Jo", "content": "I drew a zebra for my neighbour's kid."},
]
QUERY = "What did Jo do after she saw the zebra at the zoo?"
ZOO, PISTACHIO, DRAWING = ("Jo saw a zebra giving birth at the zoo.", "Jo treated herself to pistachio ice cream.",
                           "Jo drew a zebra for her neighbour's kid.")


def _memory(path, facts: list[FactInput]) -> Memory:
    mem = Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)
    mem.log_turns(TURNS, user_id="jo")
    mem.add_facts(facts, user_id="jo")
    return mem


@pytest.fixture()
def memory(tmp_path):
    with _memory(tmp_path / "store", [FactInput(ZOO, ("b",)), FactInput(PISTACHIO, ("d",)),
                                      FactInput(DRAWING, ("z",)), FactInput("Jo likes pandas.")]) as mem:
        yield mem


def test_keyword_docs_hold_the_turn_before_and_the_turn_position(tmp_path):
    with _memory(tmp_path / "store", [FactInput(PISTACHIO, ("d",)), FactInput("Jo went to the zoo, then ate.", ("b", "d")),
                                      FactInput("Jo likes zebras.")]) as mem:
        facts = mem.components.facts.list(Scope("jo"))
        texts, positions = mem.components.turns.keyword_docs(Scope("jo").key, facts)
    by_text = dict(zip((f.text for f in facts), zip(texts, positions)))
    text, position = by_text[PISTACHIO]
    assert "What then?" in text and "pistachio ice cream." in text and position == 3.0
    text, position = by_text["Jo went to the zoo, then ate."]
    # source turns b and d: each with the turn before it (a, c), and none twice
    assert text.count("zebra giving birth") == 1 and "Sunday" in text and "What then?" in text
    assert position == 2.0  # the mean of positions 1 and 3
    text, position = by_text["Jo likes zebras."]
    assert text == "Jo likes zebras." and math.isnan(position)


def _ranked(memory) -> list[str]:
    return [r["memory"] for r in memory.search(QUERY, user_id="jo", limit=5)["results"]]


def test_a_fact_two_turns_after_the_match_outranks_a_lookalike_far_away(memory, monkeypatch):
    """"What did Jo do after the zoo?": the pistachio fact shares no word with the question
    but is drawn from two turns after the zoo fact; the zebra drawing shares "zebra" and is
    14 turns away. Without the bonus (share 0) the drawing ranks above it."""
    assert _ranked(memory)[:2] == [ZOO, PISTACHIO]
    import functools

    import inferscale.store.index as index

    monkeypatch.setattr(index, "turn_neighbor_bonus", functools.partial(turn_neighbor_bonus, share=0.0))
    assert _ranked(memory)[:2] == [ZOO, DRAWING]


def test_the_bonus_follows_writes(memory):
    """Deletes renumber the partition's rows and adds append to them: the positions kept with
    the keyword index stay those of the current rows, and the ranking follows."""
    assert _ranked(memory)[:2] == [ZOO, PISTACHIO]  # the keyword index and positions are built
    by_text = {r["memory"]: r["id"] for r in memory.get_all(user_id="jo")["results"]}
    memory.delete(by_text[ZOO], user_id="jo")
    memory.add_facts([FactInput(ZOO, ("b",))], user_id="jo")
    part = memory.components.facts.index._partition(Scope("jo").key)
    _, fresh_positions = memory.components.turns.keyword_docs(Scope("jo").key, part.records)
    assert len(part.positions) == len(part.records) == 4
    np.testing.assert_array_equal(part.positions, np.asarray(fresh_positions))
    assert _ranked(memory)[:2] == [ZOO, PISTACHIO]
    memory.update(by_text[PISTACHIO], "Jo treated herself to pistachio gelato.", user_id="jo")
    _, fresh_positions = memory.components.turns.keyword_docs(Scope("jo").key, part.records)
    np.testing.assert_array_equal(part.positions, np.asarray(fresh_positions))
    assert part.dates == [date_terms(r.text) for r in part.records]
    assert _ranked(memory)[1] == "Jo treated herself to pistachio gelato."


def _loop_bonus(scores, positions, share, reach, sources):
    """The bonus as the docstring defines it, one pair at a time."""
    finite = np.isfinite(scores)
    best = sorted(np.flatnonzero(finite), key=lambda i: -scores[i])[:sources]
    bonus = np.zeros(len(scores))
    for j in best:
        for i in range(len(scores)):
            if i != j and finite[i] and abs(positions[i] - positions[j]) <= reach:  # NaN compares False
                bonus[i] = max(bonus[i], share * scores[j])
    return bonus


def test_the_vectorized_bonus_matches_its_definition():
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 300))
        scores = rng.random(n)
        scores[rng.random(n) < 0.1] = -np.inf
        positions = rng.integers(0, 100, n).astype(float)
        positions[rng.random(n) < 0.1] = np.nan
        sources = int(rng.integers(0, 80))
        got = turn_neighbor_bonus(scores, positions, _placed(positions), share=0.35, reach=4.0, sources=sources)
        np.testing.assert_allclose(got, _loop_bonus(scores, positions, 0.35, 4.0, sources))


def test_date_terms_are_capitalized_months_and_years():
    assert date_terms("(7 May, 2023) Jo may move in June 1999 or 2150; Mayday.") == {"May", "2023", "June", "1999"}
    assert date_terms("no date here") == frozenset()


def test_the_date_ranking_counts_as_one_more_ranking():
    fused = np.array([0.5, 0.4, -np.inf, 0.1])
    dense = np.array([0.9, 0.2, 0.8, 0.5])
    add_date_ranking(fused, dense, np.array([1, 2, 3]), c=2)
    # rows 3 and 1 match, ranked by cosine (row 2 is excluded and stays so)
    np.testing.assert_allclose(fused, [0.5, 0.4 + 1 / 4, -np.inf, 0.1 + 1 / 3])


def test_a_question_naming_a_month_finds_that_month_s_memory(tmp_path, monkeypatch):
    """"May" is a stop word to BM25 and "2023" is in every memory: without the date ranking
    the June trip ranks first."""
    import inferscale.store.index as index

    may = "(7 May, 2023) Jo visited her aunt in Porto."
    with Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0, precompute_kv=False) as mem:
        mem.add_facts(["(2 June, 2023) Jo took a trip to Rome.", may, "(20 November, 2023) Jo took a trip to Oslo."],
                      user_id="jo")

        def first() -> str:
            return mem.search("Which trip did Jo take in May 2023?", user_id="jo", limit=3)["results"][0]["memory"]

        assert first() == may
        monkeypatch.setattr(index, "add_date_ranking", lambda *args, **kwargs: None)
        assert first() == "(2 June, 2023) Jo took a trip to Rome."
