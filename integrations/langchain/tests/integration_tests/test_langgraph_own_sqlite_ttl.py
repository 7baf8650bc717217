"""``langgraph-checkpoint-sqlite`` 3.1.2's ``tests/test_ttl.py`` (written against ``SqliteStore``
and ``AsyncSqliteStore``) run on ``InferScaleStore`` (:mod:`langgraph_suites`). Its tests sleep
on real time with TTLs of 1 to 4 seconds."""

from langgraph_suites import (  # noqa: F401 (fixtures)
    SQLITE, fresh_memory, load, suite_front, suite_memory, suite_members, transport,
)

globals().update(suite_members(load(SQLITE, "test_ttl")))

#: tests of ``SqliteStore``'s own code, not of a store's behaviour: name -> reason
DESELECTED: dict[str, str] = {}
#: tests of features InferScaleStore lacks: name -> the missing feature
XFAIL: dict[str, str] = {}
