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
