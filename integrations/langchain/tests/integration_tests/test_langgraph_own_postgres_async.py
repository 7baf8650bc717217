"""``langgraph-checkpoint-postgres`` 3.2.0's ``tests/test_async_store.py`` (written against
``AsyncPostgresStore``) run on ``InferScaleStore`` (:mod:`langgraph_suites`), its fixtures
and helpers rebuilt without a database as :mod:`test_langgraph_own_postgres` does."""

import contextlib

import pytest

from langgraph_suites import (  # noqa: F401 (fixtures)
    POSTGRES, POSTGRES_DESELECTED, POSTGRES_DESELECTED_PARAMS, POSTGRES_XFAIL, aexpire_now, arow_exists, astored_expires_at, fresh_memory, load, suite_front, suite_memory,
    suite_members, transport,
)

module = load(POSTGRES, "test_async_store")
globals().update(suite_members(module))


@pytest.fixture
def fake_embeddings():
    """The sdist's conftest fixture: its character-count embedder, 500 dims."""
    return module.CharacterEmbeddings(dims=500)


@pytest.fixture(params=["default", "pipe", "pool"])
async def store(request):
    """The module's ``store``: its TTL config, its sweeper started, without its database."""
    ttl = {"default_ttl": module.TTL_MINUTES, "refresh_on_read": True,
           "sweep_interval_minutes": module.TTL_MINUTES / 2}
    async with module.AsyncPostgresStore.from_conn_string("postgres://unused", ttl=ttl) as store:
        await store.setup()
        await store.start_ttl_sweeper()
        yield store
        await store.stop_ttl_sweeper()


@contextlib.asynccontextmanager
async def _create_vector_store(vector_type, distance_type, fake_embeddings, text_fields=None):
    """The module's ``_create_vector_store``: the same ``PostgresIndexConfig``, no database."""
    index_config = {"dims": fake_embeddings.dims, "embed": fake_embeddings,
                    "ann_index_config": {"vector_type": vector_type}, "distance_type": distance_type,
                    "fields": text_fields}
    async with module.AsyncPostgresStore.from_conn_string("postgres://unused", index=index_config) as store:
        await store.setup()
        yield store


module._create_vector_store = _create_vector_store
module._aexpire_now, module._arow_exists, module._astored_expires_at = aexpire_now, arow_exists, astored_expires_at

#: tests of ``AsyncPostgresStore``'s own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {
    **POSTGRES_DESELECTED,
    "test_no_running_loop": "expects AsyncPostgresStore's sync methods to refuse the event loop's thread "
                            "(InvalidStateError); InferScaleStore serves sync and async calls alike "
                            "(docs/decisions.md)",
    "test_abatch_uses_single_pool_checkout": "counts PostgresStore's connection-pool checkouts "
                                             "(langgraph.store.postgres._ainternal); no pool here",
}
#: parameters whose tests repeat others on InferScaleStore: parameter id -> reason
DESELECTED_PARAMS = {**POSTGRES_DESELECTED_PARAMS,
                     "halfvec": "test_search_sorting with half-precision vectors: InferScaleStore keeps float32 "
                                "vectors, so the [vector-...] run again"}
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = POSTGRES_XFAIL
