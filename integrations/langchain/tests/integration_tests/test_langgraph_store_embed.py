"""``InferScaleStore(index={"dims", "embed", "fields"})``: a store-level embedder ranks as
LangGraph's ``InMemoryStore`` with the same config does (one vector per field match, max
pooling, cosine scores), in-process and over HTTP; a bad config or embedder is refused and
writes nothing. The embedder is a real one: InferScale's all-MiniLM-L6-v2, as LangChain
``Embeddings``."""

from __future__ import annotations

import uuid

import pytest
from langchain_core.embeddings import Embeddings
from langchain_inferscale import InferScaleStore
from langgraph.store.memory import InMemoryStore

from inferscale import Memory

KEY = "store-embed-key"


class MemoryEmbeddings(Embeddings):
    """LangChain ``Embeddings`` over a memory's own embedder ([n, 384] float32, unit norm)."""

    def __init__(self, memory: Memory, dims: int | None = None) -> None:
        self.memory, self.dims = memory, dims

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        vectors = self.memory.embed(texts)
        return (vectors if self.dims is None else vectors[:, :self.dims]).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("lg-embed"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(params=["in-process", "http"])
def make_store(request, memory, loopback_front):
    """Makes fresh stores (each its own ``store_id``) over the module's memory, in-process or over HTTP."""
    if request.param == "in-process":
        yield lambda **kwargs: InferScaleStore(memory, store_id=f"lg-{uuid.uuid4().hex[:8]}", **kwargs)
        return
    with loopback_front(memory, KEY) as url:
        yield lambda **kwargs: InferScaleStore(url=url, api_key=KEY, store_id=f"lg-{uuid.uuid4().hex[:8]}", **kwargs)


DOCS = [
    ("pets", {"title": "Pets", "body": "Alice has a cat named Tom.", "tags": ["cat", "animals"]}, None),
    ("food", {"title": "Food", "body": "Alice is allergic to peanuts.", "tags": ["health"]}, None),
    ("trip", {"title": "Travel", "body": "Alice flies to Lisbon in May.", "tags": ["travel", "portugal"]},
     ["title"]),  # this put embeds its title alone
    ("note", {"title": "Scratch", "body": "Kitten food is in the cupboard."}, False),  # never ranked
    ("empty", {"other": "nothing the fields name"}, None),  # no field matches: never ranked
]


def put_all(store) -> None:
    for key, value, index in DOCS:
        store.put(("users", "alice", "notes"), key, value, index=index)


def ranked(results) -> list[tuple[str, float | None]]:
    return [(r.key, None if r.score is None else round(r.score, 5)) for r in results]


@pytest.mark.parametrize("use_async", [False, True])
def test_ranks_as_in_memory_store_with_the_same_embedder(make_store, memory, use_async):
    config = {"dims": 384, "embed": MemoryEmbeddings(memory), "fields": ["body", "tags[*]"]}
    store, reference = make_store(index=config), InMemoryStore(index=config)
    put_all(store)
    put_all(reference)
    for query in ("a pet cat", "what can't alice eat?", "Travel", "kitten"):
        for offset, limit in ((0, 10), (1, 2), (3, 10)):
            if use_async:
                import asyncio

                got = asyncio.run(store.asearch(("users", "alice"), query=query, offset=offset, limit=limit))
            else:
                got = store.search(("users", "alice"), query=query, offset=offset, limit=limit)
            want = reference.search(("users", "alice"), query=query, offset=offset, limit=limit)
            assert ranked(got) == ranked(want), (query, offset, limit)
    top = store.search(("users", "alice"), query="a pet cat", limit=1)[0]
    assert top.key == "pets" and top.score == pytest.approx(max(
        float(memory.embed(["a pet cat"])[0] @ v) for v in memory.embed(["Alice has a cat named Tom.", "cat", "animals"])),
        abs=1e-5)


def test_the_memory_text_is_the_fields_and_chat_finds_it(make_store, memory):
    """The memory's own text (what chat injects and InferScale's search ranks) is the indexed
    fields' strings; the vectors stay out of the value."""
    store = make_store(index={"dims": 384, "embed": MemoryEmbeddings(memory), "fields": ["body"]})
    store.put(("users", "bea", "notes"), "pets", {"title": "Pets", "body": "Bea has a parrot named Kiwi."})
    texts = [m["memory"] for m in memory.get_all(user_id="bea")["results"]]
    assert "Bea has a parrot named Kiwi." in texts
    assert store.get(("users", "bea", "notes"), "pets").value == {"title": "Pets", "body": "Bea has a parrot named Kiwi."}
    hits = memory.search("parrot", user_id="bea")["results"]
    assert hits and hits[0]["memory"] == "Bea has a parrot named Kiwi."
    memory.delete_all(user_id="bea")


def test_a_bad_config_or_embedder_is_refused_and_writes_nothing(make_store, memory):
    good = MemoryEmbeddings(memory)
    for config, error, words in [
        ({"dims": 384, "embed": good, "fields": ["body"], "metric": "dot"}, ValueError, "unknown keys ['metric']"),
        ({"dims": "384", "embed": good}, ValueError, "positive int"),
        ({"dims": 384, "embed": good, "distance_type": "hamming"}, ValueError, "must be one of ['cosine', "
                                                                                 "'inner_product', 'l2']"),
        ({"dims": 384, "embed": good, "ann_index_config": {"vector_type": "bit"}}, ValueError, "'vector', 'halfvec'"),
        ({"dims": 384, "embed": good, "ann_index_config": {"kind": "hnsw", "mm": 16}}, ValueError, "unknown keys ['mm']"),
        ({"dims": 384, "embed": good, "ann_index_config": "hnsw"}, TypeError, "must be a dict"),
        ({"dims": 384, "embed": good, "ann_index_config": {"kind": "bogus"}}, ValueError, "'hnsw', 'ivfflat', 'flat'"),
        ({"dims": 384, "embed": good, "ann_index_config": {"kind": "hnsw", "m": "x"}}, ValueError,
         "['m'] must be an integer"),
        ({"dims": 384}, ValueError, "index['embed'] is required"),
        ({"dims": 384, "embed": good, "fields": [""]}, TypeError, "list of field paths"),
        ("body", TypeError, "IndexConfig"),
    ]:
        with pytest.raises(error) as caught:
            make_store(index=config)
        assert words in str(caught.value), str(caught.value)
    store = make_store(index={"dims": 384, "embed": MemoryEmbeddings(memory, dims=100), "fields": ["body"]})
    with pytest.raises(ValueError, match=r"shape \(1, 100\) for the item texts: expected 1 lists of index\['dims'\] = 384"):
        store.put(("users", "cid", "notes"), "a", {"body": "Cid plays chess."})
    for embed, words in [(lambda texts: [[float("nan")] * 384 for _ in texts], "NaN or infinite"),
                         (lambda texts: [[1e39] + [0.0] * 383 for _ in texts], "beyond float32's range"),
                         (lambda texts: None, "expected 1 lists"),
                         (lambda texts: [[0.1] * 384, [0.2] * 10], "expected 1 lists")]:
        with pytest.raises(ValueError, match=words):
            make_store(index={"dims": 384, "embed": embed}).put(("users", "cid", "notes"), "a", {"body": "Cid."})
    with pytest.raises(TypeError, match="index\\['embed'\\] must be an Embeddings object"):
        make_store(index={"dims": 384, "embed": 42})
    with pytest.raises(TypeError, match="list of field paths"):
        store.put(("users", "cid", "notes"), "a", {"body": "Cid plays chess."}, index=[1])
    assert memory.get_all(user_id="cid")["results"] == []
    assert store.search(("users", "cid")) == []


def test_a_batch_with_one_bad_put_writes_none_of_it(make_store, memory):
    """Each put's memory is built and checked before any is written: a value JSON cannot hold
    (NaN), or a text over ``max_fact_tokens``, refuses the batch whole. Over HTTP only the
    server counts a text's tokens, so the store asks it (``POST /memories/check``) before the
    batch writes: the items keep their ids and ``created_at`` (an undo would re-add a deleted
    one anew), and a new scope is not registered."""
    from langgraph.store.base import PutOp

    store = make_store(index={"dims": 384, "embed": MemoryEmbeddings(memory), "fields": ["text"]})
    ns = ("users", "dee", "notes")
    store.put(ns, "old", {"text": "Dee rows."})
    store.put(ns, "gone", {"text": "Dee owns a kayak."}, ttl=None)
    before = {i.key: (i.value, i.created_at) for i in store.search(("users", "dee"))}
    namespaces = store.list_namespaces()
    for value, match in (({"text": "fine", "x": float("nan")}, "users/dee/notes/zz: .*nothing of this batch was written"),
                         ({"text": "word " * 3000}, "users/dee/notes/zz: .*max_fact_tokens.*nothing of this batch"),
                         ({"text": "word " * 30000}, "users/dee/notes/zz: .*characters.*nothing of this batch")):
        with pytest.raises(ValueError, match=match):
            store.batch([PutOp(ns, "old", {"text": "Dee rows daily."}), PutOp(ns, "new", {"text": "Dee swims."}),
                         PutOp(ns, "gone", None), PutOp(("users", "fay"), "f", {"text": "Fay sails."}),
                         PutOp(ns, "zz", value)])
        after = {i.key: (i.value, i.created_at) for i in store.search(("users", "dee"))}
        assert after == before
        assert store.list_namespaces() == namespaces  # no scope of the batch's registered
    assert store.get(ns, "old").created_at == before["old"][1]  # updated back, not made anew
    hits = store.search(("users", "dee"), query="kayak")
    assert hits[0].key == "gone" and hits[0].score is not None  # the deleted item is back, still ranked


def test_an_empty_index_list_and_another_embedders_items_are_listed_unscored(make_store, memory):
    """``index=[]`` embeds nothing (``InMemoryStore``'s way); items another store embedded with
    another size are listed after the ranked ones, unscored, instead of failing the search."""
    small = make_store(index={"dims": 100, "embed": MemoryEmbeddings(memory, dims=100), "fields": ["text"]})
    small.put(("users", "eve", "notes"), "small", {"text": "Eve grows tomatoes."})
    store = make_store(index={"dims": 384, "embed": MemoryEmbeddings(memory), "fields": ["text"]})
    store.put(("users", "eve", "notes"), "big", {"text": "Eve grows basil."})
    store.put(("users", "eve", "notes"), "none", {"text": "Eve grows mint."}, index=[])
    got = ranked(store.search(("users", "eve"), query="tomatoes"))
    assert got[0][0] == "big" and got[0][1] is not None
    assert sorted(got[1:]) == [("none", None), ("small", None)]


def test_bad_limits_depths_ttls_and_values_are_refused_by_name_before_anything_runs(make_store):
    """Found by a hostile pass: these reached Python's own errors (a comparison of str and int,
    a slice of a float, float()'s overflow) or were taken (``limit=True`` as 1, a negative
    ``max_depth``)."""
    from langgraph.store.base import PutOp

    store = make_store()
    ns = ("users", "gil", "notes")
    for call, error, words in [
        (lambda: store.search(("users",), limit="3"), TypeError, "limit must be an integer, got str"),
        (lambda: store.search(("users",), limit=None), TypeError, "limit must be an integer, got NoneType"),
        (lambda: store.search(("users",), limit=True), TypeError, "limit must be an integer, got bool"),
        (lambda: store.search(("users",), limit=5, offset=2.5), TypeError, "offset must be an integer, got float 2.5"),
        (lambda: store.list_namespaces(limit=2.5), TypeError, "limit must be an integer, got float"),
        (lambda: store.list_namespaces(max_depth=-1), ValueError, "max_depth must be a whole number >= 0"),
        (lambda: store.batch([PutOp(ns, "t", {"text": "x"}, ttl=10 ** 400)]), ValueError,
         "ttl of ('users', 'gil', 'notes')/t must be a positive number of minutes"),
        (lambda: store.put(ns, "b", {"text": "x", "v": b"raw"}), TypeError,
         "the value of ('users', 'gil', 'notes')/b cannot be stored as JSON"),
    ]:
        with pytest.raises(error) as caught:
            call()
        assert words in str(caught.value), str(caught.value)
    assert store.search(("users", "gil")) == []


def test_scores_stay_finite_for_vectors_float32_cannot_multiply():
    """PostgresStore's three distances on vectors whose float32 products overflow (1e20 per
    component): cosine 1 for parallel vectors, the inner product and L2 as float64 give them."""
    import numpy as np
    from langchain_inferscale._store_index import StoreIndex

    block = np.full((1, 3), 1e20, dtype=np.float32)
    q = np.full(3, 2e20, dtype=np.float32)
    for distance, expected in (("cosine", 1.0), ("inner_product", 3 * 2e40), ("l2", -np.sqrt(3) * 1e20)):
        index = StoreIndex({"dims": 3, "embed": lambda texts: [[1.0] * 3 for _ in texts], "distance_type": distance,
                            "ann_index_config": {"kind": "ivfflat", "lists": 100}})
        score = float(index.scores(block, q)[0])
        assert np.isfinite(score) and score == pytest.approx(expected, rel=1e-5), (distance, score)
