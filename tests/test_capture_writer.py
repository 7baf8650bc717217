"""The capture writer process (:mod:`inferscale.kv.capture_writer`): what the connector hands
it is stored in the pool as the connector's own thread would store it, a bad span is
counted and the rest kept, and it exits quietly when its input closes."""

from __future__ import annotations

import threading

import pytest
import torch

from inferscale.kv.capture_writer import CaptureWriter, store_capture
from inferscale.kv.pool import KVPool, kv_key

SHAPE = (3, 7, 2, 64)  # [layers, tokens, kv heads, head dim]


class Outcomes:
    """Collects the writer's answers (from its reader thread)."""

    def __init__(self) -> None:
        self.got: list[tuple[int, int, int]] = []
        self._cond = threading.Condition()

    def __call__(self, outcome) -> None:
        with self._cond:
            self.got.append(tuple(outcome))
            self._cond.notify_all()

    def wait(self, n: int, seconds: float = 60) -> list[tuple[int, int, int]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.got) >= n, seconds), f"{len(self.got)} of {n} answers"
            return list(self.got)


def key(owner: str) -> str:
    return kv_key(owner, fmt=2, fp="test", dtype="bfloat16", variant="captured", span=owner)


@pytest.mark.parametrize("dtype,storage", [(torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.float32, "int8")])
def test_the_writer_process_stores_each_span_as_the_thread_would(tmp_path, dtype, storage):
    keys, values = torch.randn(SHAPE).to(dtype), torch.randn(SHAPE).to(dtype)
    spans = [(key("fact-a"), (11, 12, 13)), (key("fact-b"), (21, 22, 23, 24))]
    outcomes = Outcomes()
    writer = CaptureWriter(str(tmp_path / "process"), None, outcomes)
    writer.send("req-1", keys, values, spans, storage, None)
    assert outcomes.wait(1) == [(2, 7, 0)]
    writer.close(timeout=60)
    assert not writer.alive()
    # the same capture stored by this process's own code path
    thread_pool = KVPool(tmp_path / "thread", "cpu", 0)
    assert store_capture(thread_pool, "req-1", keys, values, spans, storage, None) == (2, 7, 0)
    process_pool = KVPool(tmp_path / "process", "cpu", 0)
    offset = 0
    for k, ids in spans:
        got, want = process_pool.get(k), thread_pool.get(k)
        assert got is not None and got.token_ids == ids == want.token_ids
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        if storage == "auto":  # stored as sent
            assert torch.equal(got.keys, keys[:, offset:offset + len(ids)])
            assert torch.equal(got.values, values[:, offset:offset + len(ids)])
        offset += len(ids)


def test_a_span_that_cannot_be_stored_is_counted_and_the_rest_kept(tmp_path):
    keys, values = torch.randn(SHAPE), torch.randn(SHAPE)
    outcomes = Outcomes()
    writer = CaptureWriter(str(tmp_path), None, outcomes)
    # the second span names more tokens than the KV has left: the pool refuses that span only
    writer.send("req-2", keys, values, [(key("fact-c"), (1, 2, 3)), (key("fact-d"), (4, 5, 6, 7, 8))], "auto", None)
    writer.send("req-3", keys, values, [(key("fact-e"), (1, 2)), (key("fact-f"), (3, 4, 5, 6, 7))], "int9", None)
    assert outcomes.wait(2) == [(1, 3, 1), (0, 0, 2)]
    writer.close(timeout=60)
    pool = KVPool(tmp_path, "cpu", 0)
    assert pool.contains(key("fact-c")) and not pool.contains(key("fact-d"))
    assert not pool.contains(key("fact-e")) and not pool.contains(key("fact-f"))


def test_closing_stores_what_was_sent_and_the_writer_exits_quietly(tmp_path, capfd):
    outcomes = Outcomes()
    writer = CaptureWriter(str(tmp_path), None, outcomes)
    sent = [key(f"fact-{i}") for i in range(5)]
    for i, k in enumerate(sent):
        writer.send(f"req-{i}", torch.randn(SHAPE), torch.randn(SHAPE), [(k, tuple(range(7)))], "auto", None)
    writer.close(timeout=60)  # no wait for the answers first: closing lets the writer finish
    assert writer._proc.returncode == 0
    pool = KVPool(tmp_path, "cpu", 0)
    assert all(pool.contains(k) for k in sent)
    assert outcomes.got == [(1, 7, 0)] * 5
    assert capfd.readouterr().err == ""


def test_a_writer_that_died_is_an_os_error_to_the_sender(tmp_path):
    writer = CaptureWriter(str(tmp_path), None, Outcomes())
    writer._proc.kill()
    writer._proc.wait()
    with pytest.raises(OSError):
        for _ in range(100):  # the pipe's buffer may take the first sends
            writer.send("req", torch.randn(SHAPE), torch.randn(SHAPE), [(key("fact-x"), tuple(range(7)))],
                        "auto", None)
    writer.close(timeout=10)
