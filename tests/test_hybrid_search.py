"""Hybrid search (dense + BM25, reciprocal rank fusion): the keyword index follows every
write and restart exactly as the dense index does, keyword hits never cross scopes, and
the fusion ranks what each ranking favours."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale import Memory
from inferscale.store.keyword import KeywordIndex, fuse
from inferscale.store.records import Scope

# every text holds one rare word, so a keyword query names exactly the facts that hold it
WORDS = ["zebra", "quartz", "violet", "ember", "falcon", "maple"]
TEXTS = st.sampled_from([f"The {w} note from {day}." for w in WORDS for day in ("Monday", "Friday")])


def new_memory(path) -> Memory:
    return Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)


def test_fuse_ranks_by_reciprocal_rank_and_respects_the_filter():
    dense = np.array([0.9, 0.8, 0.1, 0.5, -np.inf], dtype=np.float32)  # row 4 filtered out
    keyword = np.array([0.0, 0.0, 3.0, 1.0, 9.0], dtype=np.float32)
    # ranks: dense 0,1,3,2 (row 4 excluded); keyword 2,3 (row 4 excluded despite its score)
    # fused (c=10): row0 1/11, row1 1/12, row2 1/14+1/11, row3 1/13+1/12
    assert fuse(dense, keyword, 10, c=10).tolist() == [2, 3, 0, 1]
    assert fuse(dense, np.zeros(5, dtype=np.float32), 2, c=10).tolist() == [0, 1]  # no keyword hit: dense order


def test_keyword_index_scores_rare_words_and_ignores_unknown_ones():
    index = KeywordIndex(["Caroline went to the LGBTQ support group on 7 May 2023.", "Melanie paints landscapes."])
    assert index.scores("When did Caroline go to the LGBTQ group?").argmax() == 0
    assert index.scores("paintings by Melanie")[1] > 0  # stemmed: paint(ing)s
    assert index.scores("zzz unknown words").tolist() == [0.0, 0.0]
    assert KeywordIndex([]).scores("anything").shape == (0,)


def _bm25s_scores(texts: list[str], query: str) -> np.ndarray:
    """``bm25s``'s own scores (defaults) over ``texts`` for ``query``, tokenized as ours are."""
    import bm25s

    from inferscale.store.keyword import tokens

    model = bm25s.BM25()
    model.index([tokens(t) for t in texts], show_progress=False)
    known = [t for t in tokens(query) if t in model.vocab_dict]
    return np.asarray(model.get_scores(known), dtype=np.float32) if known else np.zeros(len(texts), np.float32)


def test_the_kept_keyword_index_scores_as_bm25s_does_after_appends_replaces_and_deletes(locomo_path):
    """LoCoMo's facts of one conversation: the index updated write by write (appends, texts
    replaced in place, rows deleted and renumbered, as the partition does) gives ``bm25s``'s
    scores over the current texts for every question, within float32 rounding."""
    import random

    from inferscale.datasets.locomo import load_locomo

    sample = load_locomo(locomo_path)[0]
    pool = [f.dated_text() for f in sample.facts]
    questions = [qa.question for qa in sample.qa[:60]] + ["Caroline Caroline LGBTQ", "the of and"]
    rng = random.Random(0)
    texts = pool[:40]
    index = KeywordIndex(texts)
    for step in range(12):
        texts = texts + pool[40 + 10 * step: 50 + 10 * step]
        index.append(pool[40 + 10 * step: 50 + 10 * step])
        for row in rng.sample(range(len(texts)), 5):
            texts[row] = rng.choice(pool)
            index.replace(row, texts[row])
        keep = sorted(rng.sample(range(len(texts)), len(texts) - 4))
        texts = [texts[r] for r in keep]
        index.keep(keep)
        assert index.size == len(texts)
        for q in questions[step * 5: step * 5 + 5] + questions[-2:]:
            ours, theirs = index.scores(q), _bm25s_scores(texts, q)
            np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6, err_msg=q)
    assert index.scores("paintings")[[i for i, t in enumerate(texts) if "paint" in t.lower()]].min() > 0


_MEM: dict = {}
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("xy"), TEXTS),
        st.tuples(st.just("update"), st.sampled_from("xy"), st.integers(0, 11), TEXTS),
        st.tuples(st.just("delete"), st.sampled_from("xy"), st.integers(0, 11)),
        st.tuples(st.just("restart"),),
    ),
    max_size=10,
)


def _check_keyword_hits(mem: Memory, model: dict[str, dict[str, str]]) -> None:
    for scope, facts in model.items():
        assert {r.id: r.text for r in mem.components.store.list(Scope(scope))} == facts  # the model is Chroma's content
        for word in WORDS:
            holders = {mid for mid, text in facts.items() if word in text}
            found = mem.search(f"{word}?", user_id=scope, limit=2, mode="hybrid")["results"]
            top = {r["id"] for r in found[:len(holders)]}
            assert top == holders if holders else not any(word in r["memory"] for r in found)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_keyword_index_agrees_with_chroma_after_adds_updates_deletes_and_restarts(tmp_path_factory, ops):
    if "mem" not in _MEM:
        _MEM["path"] = tmp_path_factory.mktemp("hybrid") / "store"
        _MEM["mem"] = new_memory(_MEM["path"])
    mem = _MEM["mem"]
    mem.reset()
    model: dict[str, dict[str, str]] = {"x": {}, "y": {}}
    for op in ops:
        kind = op[0]
        if kind == "restart":
            mem.close()
            mem = _MEM["mem"] = new_memory(_MEM["path"])
            continue
        scope, ids = op[1], sorted(model[op[1]])
        if kind == "add":
            res = mem.add(op[2], user_id=scope, infer=False)["results"][0]
            if res["event"] == "ADD":
                model[scope][res["id"]] = op[2]
        elif kind == "update" and ids:
            mid = ids[op[2] % len(ids)]
            if op[3] not in model[scope].values():
                mem.update(mid, op[3], user_id=scope)
                model[scope][mid] = op[3]
        elif kind == "delete" and ids:
            mid = ids[op[2] % len(ids)]
            mem.delete(mid, user_id=scope)
            del model[scope][mid]
        _check_keyword_hits(mem, model)


def test_keyword_hits_stay_in_their_scope(tmp_path):
    """50 scopes whose facts share their words: a keyword query returns its own scope's only."""
    mem = new_memory(tmp_path / "store")
    for i in range(50):
        mem.add_facts([f"User {i} keeps a zebra named Stripes.", f"User {i} drinks quartz-clear water."],
                      user_id=f"s{i}")
    for i in (0, 17, 49):
        own = {r["id"] for r in mem.get_all(user_id=f"s{i}")["results"]}
        for query in ("zebra named Stripes", "quartz water", f"User {i}"):
            found = {r["id"] for r in mem.search(query, user_id=f"s{i}", limit=100, mode="hybrid")["results"]}
            assert found == own  # both facts of the scope, and nothing of the 49 others
    mem.close()


def test_search_mode_is_a_setting_and_a_per_call_choice(tmp_path):
    mem = new_memory(tmp_path / "store")
    mem.add_facts(["Caroline went to the LGBTQ support group on 7 May 2023.", "Melanie likes painting sunsets.",
                   "The weather was nice.", "We talked about art."], user_id="u")
    hybrid = mem.search("When did Caroline go to the LGBTQ group?", user_id="u", limit=4)["results"]
    dense = mem.search("When did Caroline go to the LGBTQ group?", user_id="u", limit=4, mode="dense")["results"]
    assert hybrid[0]["memory"].startswith("Caroline")
    assert [r["score"] for r in dense] == sorted((r["score"] for r in dense), reverse=True)  # cosine order
    assert {r["id"]: r["score"] for r in hybrid} == {r["id"]: r["score"] for r in dense}  # score stays the cosine
    with pytest.raises(ValueError, match="mode must be one of"):
        mem.search("art", user_id="u", mode="bm25")
    mem.close()
    dense_only = Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False, search_mode="dense")
    assert dense_only.search("When did Caroline go to the LGBTQ group?", user_id="u", limit=4)["results"] == dense
    dense_only.close()
