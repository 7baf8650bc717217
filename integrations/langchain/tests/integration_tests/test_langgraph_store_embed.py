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
        ({"dims": 384, "embed": good, "distance_type": "l2"}, ValueError, "ranks by cosine"),
        ({"dims": 384}, ValueError, "index['embed'] is required"),
        ({"dims": 384, "embed": good, "fields": [""]}, TypeError, "list of field paths"),
        ("body", TypeError, "IndexConfig"),
    ]:
        with pytest.raises(error) as caught:
            make_store(index=config)
        assert words in str(caught.value), str(caught.value)
    store = make_store(index={"dims": 384, "embed": MemoryEmbeddings(memory, dims=100), "fields": ["body"]})
    with pytest.raises(ValueError, match="vectors of 100 dims .* expected 1 of index\\['dims'\\] = 384"):
        store.put(("users", "cid", "notes"), "a", {"body": "Cid plays chess."})
    assert memory.get_all(user_id="cid")["results"] == []
    assert store.search(("users", "cid")) == []
