"""Shared fixtures: the real default model, one fp32 encoder and one vLLM engine.

vLLM's engine (``AsyncLLM``, its engine core in a process of its own) is started once per
test session; every test that serves requests shares it and the KV pool folder its
connector reads.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest

from inferscale.models import resolve_llm


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_llm()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="session")
def encoder(model_path):
    from inferscale.kv.encoder import KVEncoder

    return KVEncoder(model_path, "float32")


@pytest.fixture(scope="session")
def serving_dir(tmp_path_factory) -> Path:
    """The data dir whose ``kv/`` folder the session's engine reads."""
    return tmp_path_factory.mktemp("serving")


@pytest.fixture(scope="session")
def engine(model_path, serving_dir):
    from inferscale.serving.engine import Engine

    with Engine(model_path, dtype="float32", kv_dir=serving_dir / "kv", max_model_len=4096,
                kv_cache_memory_bytes=1 << 30) as engine:
        yield engine


@pytest.fixture(scope="session")
def locomo_path() -> Path:
    path = Path(__file__).resolve().parents[1] / "shared" / "data" / "locomo" / "locomo10.json"
    assert path.is_file(), f"LoCoMo data expected at {path} (../shared beside the checkout)"
    return path


@pytest.fixture(scope="session")
def assert_refused():
    """``assert_refused(memory, user_id, call, error, name)``: ``call()`` raises exactly
    ``error`` (a ``TypeError`` is not a ``ValueError`` and back), in one line naming ``name``,
    and changes none of ``user_id``'s memories, turns, nor the store's size (issue 18)."""
    from inferscale.store import Scope

    def snapshot(memory, user_id: str) -> tuple:
        return (sorted((r["id"], r["memory"], str(r["metadata"]), r["updated_at"])
                       for r in memory.get_all(user_id=user_id, limit=1000)["results"]),
                memory.turns.count(Scope(user_id).key), memory.store.count(), memory.pending_kv())

    def check(memory, user_id: str, call, error: type[Exception], name: str) -> None:
        before = snapshot(memory, user_id)
        with pytest.raises(error) as caught:
            call()
        assert not isinstance(caught.value, ValueError if error is TypeError else TypeError), repr(caught.value)
        assert name in str(caught.value), str(caught.value)
        assert "\n" not in str(caught.value).strip(), str(caught.value)  # one line
        assert snapshot(memory, user_id) == before

    return check
