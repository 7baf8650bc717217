"""Fixtures of the adapter's tests: a ``Memory`` without an engine for the unit tests, and
one over the session's engine with a user who has a memory (so the standard suites'
requests carry injected KV) for the integration tests."""

from __future__ import annotations

import pytest

from inferscale import Memory


@pytest.fixture(scope="session")
def suite_user() -> str:
    """The user the standard suites' models answer as."""
    return "langchain-standard-suite"


@pytest.fixture(scope="session")
def unit_memory(tmp_path_factory):
    """A memory whose engine is never started (the unit tests generate nothing)."""
    with Memory(data_dir=tmp_path_factory.mktemp("langchain-unit"), dtype="float32") as memory:
        yield memory


@pytest.fixture(scope="session")
def suite_memory(serving_dir, engine, suite_user):
    memory = Memory(data_dir=serving_dir, dtype="float32", engine=engine, max_model_len=4096)
    if not memory.get_all(user_id=suite_user)["results"]:
        memory.add("My favourite colour is green.", user_id=suite_user, infer=False)
    assert memory.wait_for_kv(timeout=600)
    return memory


def pytest_configure(config):
    config.addinivalue_line("markers", "flaky(retries): LangGraph's TTL suite marks its timing tests for "
                            "pytest-retry, which is not installed: they run once")


def pytest_collection_modifyitems(config, items):
    """LangGraph's own store tests (``integration_tests/test_langgraph_own_*.py``): drop those
    their harness's ``DESELECTED`` names (tests of another store's internals, each with its
    reason) or whose parameter ids ``DESELECTED_PARAMS`` names (a variant that repeats
    another on InferScale), and mark those its ``XFAIL`` names (features InferScale lacks)."""
    kept, dropped = [], []
    for item in items:
        module = getattr(item, "module", None)
        deselected, xfail = getattr(module, "DESELECTED", {}), getattr(module, "XFAIL", {})
        name = getattr(item, "originalname", item.name)
        if getattr(item, "cls", None) is not None:
            name = f"{item.cls.__name__}::{name}"
        ids = set(item.callspec.id.split("-")) if hasattr(item, "callspec") else set()
        if name in deselected or ids & set(getattr(module, "DESELECTED_PARAMS", {})):
            dropped.append(item)
            continue
        if name in xfail:
            item.add_marker(pytest.mark.xfail(reason=xfail[name], strict=False))
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
