"""``langgraph-checkpoint-sqlite`` 3.1.2's ``tests/test_store.py`` (written against
``SqliteStore``) run on ``InferScaleStore`` (:mod:`langgraph_suites`)."""

from langgraph_suites import (  # noqa: F401 (fixtures)
    SQLITE, fresh_memory, load, suite_front, suite_memory, suite_members, transport,
)

globals().update(suite_members(load(SQLITE, "test_store")))

#: tests of ``SqliteStore``'s own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {
    "test_vector_store_initialization": "after its index_config checks (which InferScaleStore passes), reads "
                                        "SqliteStore's vector tables through store.conn",
    "test_nonnull_migrations": "reads SqliteStore.MIGRATIONS (its SQL schema)",
    "test_escape_glob_literal": "tests SqliteStore's SQL GLOB escaping helper; no store",
    "test_namespace_match_pattern": "tests SqliteStore's SQL namespace-pattern helper; no store",
    "test_list_namespaces_prefix_uses_indexable_condition": "reads the SQL BaseSqliteStore builds; no store",
    "test_sql_injection_vulnerability": "expects SqliteStore's refusal of filter keys it cannot quote in SQL "
                                        "('Invalid filter key'); InferScaleStore builds no SQL and, as InMemoryStore, "
                                        "takes any key",
}
#: parameters whose tests repeat others on InferScaleStore: parameter id -> reason
DESELECTED_PARAMS = {"file": "the same test on a file-backed SQLite database: on InferScaleStore, the [memory] "
                             "run again"}
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = {}
