"""``langgraph-checkpoint-postgres`` 3.2.0's ``tests/test_store.py`` (written against
``PostgresStore``) run on ``InferScaleStore`` (:mod:`langgraph_suites`): a PostgresStore user's
code, index config (``PostgresIndexConfig``: ``ann_index_config``, ``distance_type``) and TTL
config unchanged.

The module's ``store`` fixture and ``_create_vector_store`` create a PostgreSQL database
(on the sdist's docker-compose port) before they build the store; here they build the same
store, with the same ``index`` and ``ttl``, through the module's ``PostgresStore`` name
(swapped for :class:`langgraph_suites.PostgresStoreShim`), without a database.
"""

import contextlib

import pytest

from langgraph_suites import (  # noqa: F401 (fixtures)
    POSTGRES, POSTGRES_DESELECTED, POSTGRES_DESELECTED_PARAMS, POSTGRES_XFAIL, expire_now, fresh_memory, load, row_exists, stored_expires_at, suite_front, suite_memory,
    suite_members, transport,
)

module = load(POSTGRES, "test_store")
globals().update(suite_members(module))


@pytest.fixture
def fake_embeddings():
    """The sdist's conftest fixture: its character-count embedder, 500 dims."""
    return module.CharacterEmbeddings(dims=500)


@pytest.fixture(params=["default", "pipe", "pool"])
def store(request):
    """The module's ``store``: its TTL config, its sweeper started, without its database."""
    ttl = {"default_ttl": module.TTL_MINUTES, "refresh_on_read": True,
           "sweep_interval_minutes": module.TTL_MINUTES / 2}
    with module.PostgresStore.from_conn_string("postgres://unused", ttl=ttl) as store:
        store.setup()
        store.start_ttl_sweeper()
        yield store
        store.stop_ttl_sweeper()


@contextlib.contextmanager
def _create_vector_store(vector_type, distance_type, fake_embeddings, text_fields=None, enable_ttl=True):
    """The module's ``_create_vector_store``: the same ``PostgresIndexConfig`` and TTL, no database."""
    index_config = {"dims": fake_embeddings.dims, "embed": fake_embeddings,
                    "ann_index_config": {"vector_type": vector_type}, "distance_type": distance_type,
                    "fields": text_fields}
    with module.PostgresStore.from_conn_string("postgres://unused", index=index_config, ttl={
            "default_ttl": 2, "refresh_on_read": True} if enable_ttl else None) as store:
        store.setup()
        yield store


module._create_vector_store = _create_vector_store
# the helpers that read and backdate a row through PostgresStore's SQL, on the item's memory
module._expire_now, module._row_exists, module._stored_expires_at = expire_now, row_exists, stored_expires_at

#: tests of ``PostgresStore``'s own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {
    **POSTGRES_DESELECTED,
    "test_nonnull_migrations": "reads PostgresStore.MIGRATIONS (its SQL schema)",
    "test_escape_like_literal": "tests PostgresStore's SQL LIKE escaping helper; no store",
    "test_namespace_match_pattern": "tests PostgresStore's SQL namespace-pattern helper; no store",
}
#: parameters whose tests repeat others on InferScaleStore: parameter id -> reason
DESELECTED_PARAMS = POSTGRES_DESELECTED_PARAMS
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = POSTGRES_XFAIL
