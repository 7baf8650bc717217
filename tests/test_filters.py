"""Filtered search and get_all return exactly what a brute-force filter over the scope
returns, on the live index and after a restart (partitions reloaded from Chroma)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale import Memory
from inferscale.store.records import Scope

TOPICS = ["food", "home", "work"]
QUERIES = ["What do I like to eat?", "Where do I live?", "What is my job?", "Tell me about my family.",
           "Which sports do I play?"]
SUBJECTS = ["pasta", "a flat in Porto", "a job as a nurse", "my sister Ana", "tennis on Sundays", "green tea",
            "a garden with roses", "night shifts", "my brother Rui", "running by the river"]


def _metadata(rng: random.Random) -> dict:
    meta = {}
    if rng.random() < 0.8:
        meta["topic"] = rng.choice(TOPICS)
    if rng.random() < 0.7:
        meta["n"] = rng.choice([0, 1, 2, 3, 4, "3"])  # a string among ints: that row does not match
    if rng.random() < 0.5:
        meta["flag"] = rng.random() < 0.5
    return meta


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("filters") / "store"
    mem = Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)
    rng = random.Random(7)
    for scope, count in (("alice", 80), ("bob", 30)):  # bob shares every field and value
        for i in range(count):
            mem.add(f"Fact {i} of {scope}: I like {rng.choice(SUBJECTS)}.", user_id=scope, metadata=_metadata(rng))
    yield path, mem
    mem.close()


def _reference(flt: dict, fields: dict) -> bool:
    """The filter semantics written out plainly, independently of inferscale.store.filters."""
    for key, cond in flt.items():
        name = key.lstrip("$").upper()
        if name in ("AND", "OR", "NOT"):
            results = [_reference(sub, fields) for sub in cond]
            ok = all(results) if name == "AND" else any(results) if name == "OR" else not any(results)
        elif cond == "*":  # Mem0's wildcard: the field is present
            ok = key in fields
        else:
            conds = cond if isinstance(cond, dict) else {"eq": cond}
            ok = key in fields and all(_compare(op.lstrip("$"), fields[key], arg) for op, arg in conds.items())
        if not ok:
            return False
    return True


def _leaves(flt: dict):
    for key, cond in flt.items():
        if key.lstrip("$").upper() in ("AND", "OR", "NOT"):
            for sub in cond:
                yield from _leaves(sub)
        else:
            for op, arg in (cond.items() if isinstance(cond, dict) else [("eq", cond)]):
                yield key, op.lstrip("$"), arg


def _expected_error(flt: dict, rows: list[dict]) -> str | None:
    """The error the filter must raise over these rows' fields, if any (written out plainly)."""
    for key, op, arg in _leaves(flt):
        if op not in ("gt", "gte", "lt", "lte"):
            continue
        if isinstance(arg, bool) or not isinstance(arg, (int, float, str)):
            return "takes a number or a string"
        present = [r[key] for r in rows if key in r]
        if present and not any(_comparable(v, arg) for v in present):
            return "compare with a value of the stored type"
    return None


def _comparable(value, arg) -> bool:
    try:
        value < arg
        return True
    except TypeError:
        return False


def _compare(op: str, value, arg) -> bool:
    try:
        return {"eq": lambda: value == arg, "ne": lambda: value != arg, "gt": lambda: value > arg,
                "gte": lambda: value >= arg, "lt": lambda: value < arg, "lte": lambda: value <= arg,
                "in": lambda: value in arg, "nin": lambda: value not in arg}[op]()
    except TypeError:
        return False


FIELDS = st.sampled_from(["topic", "n", "flag", "nowhere"])  # nobody has "nowhere"
VALUES = st.one_of(st.sampled_from(TOPICS), st.integers(-1, 5), st.booleans(), st.just("3"))
OPS = st.sampled_from(["eq", "ne", "gt", "gte", "lt", "lte", "$eq", "$ne", "$gt", "$lte"])
LEAF = st.one_of(
    st.builds(lambda k, v: {k: v}, FIELDS, VALUES),
    st.builds(lambda k, op, v: {k: {op: v}}, FIELDS, OPS, VALUES),
    st.builds(lambda k, op, vs: {k: {op: vs}}, FIELDS, st.sampled_from(["in", "nin", "$in", "$nin"]),
              st.lists(VALUES, max_size=3)),
    st.builds(lambda k: {k: "*"}, FIELDS),
)
FILTERS = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.builds(lambda c, subs: {c: subs}, st.sampled_from(["AND", "OR", "NOT", "$and", "$or", "$not", "and", "or", "not"]),
                  st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda a, b: {**a, **b}, inner, inner),  # several keys in one dict: all must hold
    ),
    max_leaves=5,
)


def _rows(mem: Memory, scope: str) -> dict:
    return mem.components.store._col.get(where={"scope": Scope(scope).key}, include=["embeddings", "metadatas"])


def _fields(meta: dict) -> dict:
    return {**json.loads(meta["metadata"]), "created_at": meta["created_at"], "updated_at": meta["updated_at"]}


def _brute_force(mem: Memory, scope: str, query: str, flt: dict, limit: int) -> list[tuple[str, float]]:
    got = _rows(mem, scope)
    q = mem.components.embedder.encode([query])[0].numpy()
    rows = []
    for mid, emb, meta in zip(got["ids"], got["embeddings"], got["metadatas"]):
        if _reference(flt, _fields(meta)):
            e = np.asarray(emb, dtype=np.float64)
            rows.append((mid, float(e @ q / np.linalg.norm(e) / np.linalg.norm(q))))
    return sorted(rows, key=lambda r: -r[1])[:limit + 1]


def _check(mem: Memory, scope: str, query: str, flt: dict, limit: int) -> None:
    error = _expected_error(flt, [_fields(m) for m in _rows(mem, scope)["metadatas"]])
    if error is not None:  # an ordering on a value of another type than the field's is refused
        for mode in ("hybrid", "dense"):
            with pytest.raises(ValueError, match=error):
                mem.search(query, user_id=scope, filters=flt, limit=limit, mode=mode)
        with pytest.raises(ValueError, match=error):
            mem.get_all(user_id=scope, filters=flt)
        return
    expected = _brute_force(mem, scope, query, flt, limit)
    every = _brute_force(mem, scope, query, flt, 10_000)
    # hybrid (the default) ranks by fused rank: the filter holds, and scores are the cosines
    hybrid = mem.search(query, user_id=scope, filters=flt, limit=limit)["results"]
    cosine = dict(every)
    assert len(hybrid) == min(limit, len(every))
    assert all(r["score"] == pytest.approx(cosine[r["id"]], abs=1e-5) for r in hybrid)
    # dense: exactly the brute-force cosine top-k
    got = [(r["id"], r["score"]) for r in mem.search(query, user_id=scope, filters=flt, limit=limit,
                                                      mode="dense")["results"]]
    assert len(got) == min(limit, len(expected))
    assert [s for _, s in got] == pytest.approx([s for _, s in expected[:limit]], abs=1e-5)
    tie_at_cut = len(expected) > limit and abs(expected[limit - 1][1] - expected[limit][1]) < 1e-5
    if not tie_at_cut:
        assert {i for i, _ in got} == {i for i, _ in expected[:limit]}
    listed = {r["id"] for r in mem.get_all(user_id=scope, filters=flt, limit=10_000)["results"]}
    assert listed == {i for i, _ in every}


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flt=FILTERS, query=st.sampled_from(QUERIES), limit=st.integers(1, 30), scope=st.sampled_from(["alice", "bob"]))
def test_filtered_search_equals_brute_force(store, flt, query, limit, scope):
    _check(store[1], scope, query, flt, limit)


def test_filtered_search_after_restart_equals_brute_force(store):
    path, _ = store
    reopened = Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)
    try:
        assert not reopened.components.index.loaded(Scope("alice").key)  # nothing is loaded before first use
        for flt in ({"topic": "food"}, {"n": {"$gte": 2}}, {"OR": [{"flag": True}, {"NOT": [{"topic": "home"}]}]},
                    {"nowhere": {"ne": 1}}):
            _check(reopened, "alice", QUERIES[0], flt, 10)
        assert reopened.search(QUERIES[1], user_id="alice", filters={"nowhere": 1})["results"] == []
    finally:
        reopened.close()


def test_malformed_filters_raise_and_name_the_problem(store):
    mem = store[1]
    for flt in ({"AND": [None]}, {1: "a"}):  # wrong types: TypeError
        with pytest.raises(TypeError, match="must be a dict|filter fields are strings"):
            mem.search("food", user_id="alice", filters=flt)
    cases = [({"$nor": [{"topic": "food"}]}, "unknown filter key '\\$nor'"),
             ({"$in": [1]}, "unknown filter key"), ({"topic": {}}, "operator dict on 'topic' is empty"),
             ({"topic": {"$between": [1, 2]}}, "unknown filter operator")]
    deep: dict = {"topic": "food"}
    for _ in range(40):
        deep = {"NOT": [deep]}
    cases.append((deep, "nested deeper than"))
    for _ in range(5000):  # far past Python's recursion limit: still the same one-line error
        deep = {"NOT": [deep]}
    cases.append((deep, "nested deeper than"))
    for flt, message in cases:
        with pytest.raises(ValueError, match=message):
            mem.search("food", user_id="alice", filters=flt)
        with pytest.raises(ValueError, match=message):
            mem.get_all(user_id="alice", filters=flt)


def test_stored_metadata_is_a_copy_and_reads_the_same_after_restart(tmp_path):
    path = tmp_path / "store"
    mem = Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)
    tags = ["a", "b"]
    with pytest.raises(TypeError, match="metadata keys must be strings, got int 7"):  # JSON would make it "7"
        mem.add("I like tea.", user_id="u", metadata={"tags": tags, 7: "seven"})
    mem.add("I like tea.", user_id="u", metadata={"tags": tags, "pair": (1, 2), "7": "seven"})
    tags.append("c")  # the caller's list is not the stored one
    got = mem.get_all(user_id="u")["results"][0]
    got["metadata"]["tags"].append("HACKED")  # nor is the returned one
    want = {"tags": ["a", "b"], "pair": [1, 2], "7": "seven"}  # as JSON stores it, before and after a restart
    assert mem.get_all(user_id="u")["results"][0]["metadata"] == want
    flt = {"pair": [1, 2], "7": "seven", "tags": {"nin": ["x"]}}
    assert len(mem.get_all(user_id="u", filters=flt)["results"]) == 1
    mem.close()
    reopened = Memory(data_dir=path, dtype="float32", context_window=0, precompute_kv=False)
    assert reopened.get_all(user_id="u")["results"][0]["metadata"] == want
    assert len(reopened.get_all(user_id="u", filters=flt)["results"]) == 1
    reopened.close()


def test_keywords_win_over_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_EMBEDDER_BACKEND", "bogus")
    mem = Memory(data_dir=tmp_path / "store", dtype="float32", precompute_kv=False, embedder_backend="torch")
    assert mem.config.embedder_backend == "torch"
    mem.close()


def test_both_spellings_the_wildcard_and_a_mismatched_type(tmp_path):
    mem = Memory(data_dir=tmp_path / "store", dtype="float32", context_window=0, precompute_kv=False)
    try:
        for text, meta in (("I like tea.", {"topic": "food", "n": 1}), ("I live in Porto.", {"topic": "home", "n": 3}),
                           ("I work nights.", {"topic": "work"})):
            mem.add(text, user_id="u", metadata=meta)

        def texts(flt: dict) -> set[str]:
            return {r["memory"] for r in mem.get_all(user_id="u", filters=flt)["results"]}

        # Mem0's operator names and Chroma's / MongoDB's $-spellings give the same answers
        assert texts({"n": {"gte": 2}}) == texts({"n": {"$gte": 2}}) == {"I live in Porto."}
        assert texts({"OR": [{"topic": "food"}, {"n": {"gt": 2}}]}) == texts(
            {"$or": [{"topic": {"$eq": "food"}}, {"n": {"$gt": 2}}]}) == {"I like tea.", "I live in Porto."}
        assert texts({"AND": [{"topic": {"in": ["food", "home"]}}, {"NOT": [{"n": 1}]}]}) == texts(
            {"and": [{"topic": {"$in": ["food", "home"]}}, {"$not": [{"n": {"$eq": 1}}]}]}) == {"I live in Porto."}
        assert texts({"n": "*"}) == {"I like tea.", "I live in Porto."}  # Mem0's wildcard: the field is present
        before = mem.get_all(user_id="u")["results"]
        for flt in ({"topic": {"gt": 2}}, {"n": {"$lt": "three"}}):  # no stored value compares with it
            with pytest.raises(ValueError, match=r"which this scope's memories store as (str|int).*stored type"):
                mem.search("tea", user_id="u", filters=flt)
            with pytest.raises(ValueError, match="compare with a value of the stored type"):
                mem.get_all(user_id="u", filters=flt)
        with pytest.raises(ValueError, match="'gt' on 'n' takes a number or a string"):
            mem.search("tea", user_id="u", filters={"n": {"gt": [1]}})
        assert mem.search("tea", user_id="u", filters={"nowhere": {"gt": 1}})["results"] == []  # no such field
        assert mem.get_all(user_id="u")["results"] == before
    finally:
        mem.close()
