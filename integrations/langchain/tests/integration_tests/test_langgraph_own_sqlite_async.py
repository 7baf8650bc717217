"""``langgraph-checkpoint-sqlite`` 3.1.2's ``tests/test_async_store.py`` (written against
``AsyncSqliteStore``) run on ``InferScaleStore`` (:mod:`langgraph_suites`)."""

from langgraph_suites import (  # noqa: F401 (fixtures)
    SQLITE, fresh_memory, load, suite_front, suite_memory, suite_members, transport,
)

globals().update(suite_members(load(SQLITE, "test_async_store")))

#: tests of ``AsyncSqliteStore``'s own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {
    "test_no_running_loop": "expects AsyncSqliteStore's sync methods to refuse the event loop's thread "
                            "(InvalidStateError); InferScaleStore serves sync and async calls alike",
}
#: parameters whose tests repeat others on InferScaleStore: parameter id -> reason
DESELECTED_PARAMS = {"file": "the same test on a file-backed SQLite database: on InferScaleStore, the [memory] "
                             "run again"}
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = {}
