"""LangGraph's own store tests, run on ``InferScaleStore`` (issue 40).

The tests ship in the sdists of the releases we test against (``langgraph-checkpoint``'s
``tests/test_store.py``, written against ``InMemoryStore``; ``langgraph-checkpoint-sqlite``'s
``tests/test_store.py``, ``tests/test_async_store.py`` and ``tests/test_ttl.py``, against
``SqliteStore`` and ``AsyncSqliteStore``; ``langgraph-checkpoint-postgres``'s ``tests/test_store.py``
and ``tests/test_async_store.py``, against ``PostgresStore`` and ``AsyncPostgresStore``). ``scripts/install.sh`` downloads and unpacks them into
``.venv/langgraph-suites/`` (``LANGGRAPH_SUITES_DIR`` names another folder). Each
harness (``integration_tests/test_langgraph_own_*.py``) loads one module with :func:`load`,
which swaps the store class the module names for one that makes an ``InferScaleStore``
over the session's memory, and takes its tests and fixtures as its own. Each test starts on
an empty store (:func:`fresh_memory` resets the memory). A harness's ``DESELECTED`` names the
tests of another store's internals, each with its reason; ``DESELECTED_PARAMS`` the
parameters whose runs repeat others on InferScale (SQLite's ``file`` database); ``XFAIL``
the tests of features InferScale lacks (none today) (``integrations/langchain/tests/conftest.py``
applies them). Every test runs twice (:func:`transport`): on a store over the memory
in-process (``[in-process]``) and on one over HTTP, through ``inferscale serve``'s front on a
loopback port (``[http]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import itertools
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from langchain_inferscale import InferScaleStore

from inferscale import Memory

ROOT = Path(__file__).resolve().parents[3]
#: where scripts/install.sh unpacks the sdists
SUITES = Path(os.environ.get("LANGGRAPH_SUITES_DIR", ROOT / ".venv" / "langgraph-suites"))
CHECKPOINT = "langgraph_checkpoint-4.3.2"
SQLITE = "langgraph_checkpoint_sqlite-3.1.2"
POSTGRES = "langgraph_checkpoint_postgres-3.2.0"

#: the loopback front's API key
KEY = "lg-suite-key"
_memory: Memory | None = None
#: the front's URL while a test runs over HTTP
_url: str | None = None
#: numbers each SuiteStore's store_id
_instances = itertools.count()


class SuiteStore(InferScaleStore):
    """``InMemoryStore(index=...)`` as the suites call it: an ``InferScaleStore`` over the
    session's memory, in-process or over HTTP (:func:`transport`), with the suites' ``index``
    (their fake embedder and fields) as its store-level embedder and ``ttl`` as its TTL. Each
    instance is a store of its own, as each new ``InMemoryStore`` (or SQLite ``:memory:``
    database) is: its own ``store_id``, so namespaces that name no scope do not meet."""

    def __init__(self, *, index: dict | None = None, ttl: dict | None = None) -> None:
        if _memory is None:
            raise RuntimeError("no suite memory: use the harness's fresh_memory fixture")
        store_id = f"langgraph-{next(_instances)}"
        if _url is None:
            super().__init__(_memory, ttl=ttl, index=index, store_id=store_id)
        else:
            super().__init__(url=_url, api_key=KEY, ttl=ttl, index=index, store_id=store_id)

    def setup(self) -> None:
        """``SqliteStore.setup()``: nothing to create."""


class AsyncSuiteStore(SuiteStore):
    """``AsyncSqliteStore``'s names: its TTL methods are coroutines under the sync names
    (``await store.sweep_ttl()``); ``InferScaleStore`` has them as ``asweep_ttl`` and the like."""

    async def setup(self) -> None:  # type: ignore[override]
        """``await AsyncSqliteStore.setup()``: nothing to create."""

    async def sweep_ttl(self) -> int:  # type: ignore[override]
        return await self.asweep_ttl()

    async def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None):  # type: ignore[override]
        return await self.astart_ttl_sweeper(sweep_interval_minutes)

    async def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        return await self.astop_ttl_sweeper(timeout)


class SqliteStoreShim:
    """``SqliteStore.from_conn_string(conn, index=...)`` yields a :class:`SuiteStore`."""

    @staticmethod
    @contextlib.contextmanager
    def from_conn_string(conn_string: str, *, index: dict | None = None, ttl: dict | None = None):
        yield SuiteStore(index=index, ttl=ttl)


class AsyncSqliteStoreShim:
    """``AsyncSqliteStore.from_conn_string(...)`` (``async with``) yields an :class:`AsyncSuiteStore`."""

    @staticmethod
    @contextlib.asynccontextmanager
    async def from_conn_string(conn_string: str, *, index: dict | None = None, ttl: dict | None = None):
        yield AsyncSuiteStore(index=index, ttl=ttl)


class PostgresStoreShim:
    """``PostgresStore.from_conn_string(conn_string, *, pipeline=..., pool_config=..., index=...,
    ttl=...)`` yields a :class:`SuiteStore` with that ``index`` (a ``PostgresIndexConfig``, as
    given) and ``ttl``; the connection string, pipeline mode and pool are PostgreSQL's
    connection settings, which an ``InferScaleStore`` over a memory has no use for."""

    @staticmethod
    @contextlib.contextmanager
    def from_conn_string(conn_string: str, *, pipeline: bool = False, pool_config: dict | None = None,
                         index: dict | None = None, ttl: dict | None = None):
        yield SuiteStore(index=index, ttl=ttl)


class AsyncPostgresStoreShim:
    """``AsyncPostgresStore.from_conn_string(...)`` (``async with``) yields an :class:`AsyncSuiteStore`."""

    @staticmethod
    @contextlib.asynccontextmanager
    async def from_conn_string(conn_string: str, *, pipeline: bool = False, pool_config: dict | None = None,
                               index: dict | None = None, ttl: dict | None = None):
        yield AsyncSuiteStore(index=index, ttl=ttl)


#: the Postgres suites' parameters that repeat others on InferScaleStore: parameter id -> reason
POSTGRES_DESELECTED_PARAMS = {
    "pipe": "the same test with PostgresStore's connection in pipeline mode: on InferScaleStore, the [default] "
            "run again",
    "pool": "the same test over a PostgreSQL connection pool: on InferScaleStore, the [default] run again",
    **{f"halfvec_{d}": "the vector_store test with half-precision vectors (ann_index_config's vector_type "
                       "'halfvec'): InferScaleStore keeps float32 vectors, so the [vector_...] run again"
       for d in ("l2", "inner_product", "cosine")},
}
#: the Postgres suites' tests that both deselect: name -> reason
POSTGRES_DESELECTED = {
    "test_omit_expired_search_pagination": "reorders rows by rewriting their updated_at through PostgresStore's "
                                           "SQL, then expects its updated_at-descending listing; InferScaleStore "
                                           "lists by creation, oldest first, as InMemoryStore does",
}
#: the Postgres suites' tests of a feature InferScaleStore lacks: name -> the missing feature
POSTGRES_XFAIL = {
    "test_omit_expired_disabled_preserves_expired_rows": "ttl={'omit_expired': False}: InferScaleStore never "
        "returns an expired item, swept or not (PostgresStore's omit_expired=True; docs/decisions.md)",
}


def expire_now(store: InferScaleStore, ns: tuple[str, ...], key: str) -> None:
    """The Postgres suites' ``_expire_now``: the item's expiry a minute in the past, the item
    kept (unswept): its memory's ``expires_at``, set with a metadata-only update (their
    ``UPDATE store SET expires_at = NOW() - INTERVAL '1 minute'``)."""
    memory = store._lookup([(ns, key)])[(ns, key)]
    store.backend.update_metadata(memory["id"], {"expires_at": time.time() - 60}, store.scope_of(ns))


def row_exists(store: InferScaleStore, ns: tuple[str, ...], key: str) -> bool:
    """The Postgres suites' ``_row_exists``: whether the item's memory is stored, expired or not."""
    return (ns, key) in store._lookup([(ns, key)])


def stored_expires_at(store: InferScaleStore, ns: tuple[str, ...], key: str) -> float:
    """The Postgres suites' ``_stored_expires_at``: the item's stored expiry (epoch seconds)."""
    return store._lookup([(ns, key)])[(ns, key)]["metadata"]["expires_at"]


async def aexpire_now(store: InferScaleStore, ns: tuple[str, ...], key: str) -> None:
    """:func:`expire_now`, awaited (``_aexpire_now``)."""
    await asyncio.to_thread(expire_now, store, ns, key)


async def arow_exists(store: InferScaleStore, ns: tuple[str, ...], key: str) -> bool:
    """:func:`row_exists`, awaited (``_arow_exists``)."""
    return await asyncio.to_thread(row_exists, store, ns, key)


async def astored_expires_at(store: InferScaleStore, ns: tuple[str, ...], key: str) -> float:
    """:func:`stored_expires_at`, awaited (``_astored_expires_at``)."""
    return await asyncio.to_thread(stored_expires_at, store, ns, key)


@functools.cache
def load(sdist: str, module: str) -> ModuleType:
    """``tests/<module>.py`` of the unpacked ``sdist``, its store class swapped for InferScale's.

    Raises:
        FileNotFoundError: the sdist is not unpacked (run ``bash scripts/install.sh``).
    """
    root = SUITES / sdist
    if not (root / "tests" / f"{module}.py").is_file():
        raise FileNotFoundError(f"{root}/tests/{module}.py is missing: run `bash scripts/install.sh` (it unpacks "
                                f"LangGraph's sdists into {SUITES}), or set LANGGRAPH_SUITES_DIR")
    # the sdist's tests import each other as the package `tests`: give them that name while they load
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "tests" or k.startswith("tests.")}
    sys.path.insert(0, str(root))
    try:
        loaded = importlib.import_module(f"tests.{module}")
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "tests" or k.startswith("tests.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    for name, shim in (("InMemoryStore", SuiteStore), ("SqliteStore", SqliteStoreShim),
                       ("AsyncSqliteStore", AsyncSqliteStoreShim), ("PostgresStore", PostgresStoreShim),
                       ("AsyncPostgresStore", AsyncPostgresStoreShim)):
        if hasattr(loaded, name):
            setattr(loaded, name, shim)
    return loaded


def suite_members(module: ModuleType) -> dict:
    """The module's tests, test classes and fixtures, to be a harness's globals."""
    return {name: obj for name, obj in vars(module).items()
            if name.startswith(("test_", "Test")) or hasattr(obj, "_fixture_function_marker")
            or type(obj).__name__ == "FixtureFunctionDefinition"}


@pytest.fixture(scope="session")
def suite_memory(tmp_path_factory):
    with Memory(data_dir=tmp_path_factory.mktemp("lg-own-suite"), dtype="float32", precompute_kv=False) as memory:
        yield memory


@pytest.fixture(autouse=True)
def fresh_memory(suite_memory):
    """Each test starts on an empty memory (the suites' stores start empty)."""
    global _memory
    suite_memory.reset()
    _memory = suite_memory
    yield suite_memory
    _memory = None


@pytest.fixture(scope="session")
def suite_front(suite_memory, loopback_front):
    """``inferscale serve``'s front (its memory routes; no vLLM behind it) over the suite memory."""
    with loopback_front(suite_memory, KEY) as url:
        yield url


@pytest.fixture(autouse=True, params=["in-process", "http"])
def transport(request, fresh_memory):
    """Each test on a store over the memory in-process, then over HTTP (the front)."""
    global _url
    _url = request.getfixturevalue("suite_front") if request.param == "http" else None
    yield request.param
    _url = None
