"""The capture writer process (:mod:`inferscale.kv.capture_writer`): what the connector hands
it is stored in the pool as the connector's own thread would store it, keys sent rotated
come out pre-RoPE as the connector's own rotator unrotates them, a bad span is counted and
the rest kept, and it exits quietly when its input closes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from inferscale.kv.capture_writer import CaptureWriter, portable_rope_config, store_capture
from inferscale.kv.pool import KVPool, kv_key
from inferscale.kv.rope import RopeRotator
from inferscale.runtime.processes import pid_alive

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
    writer = CaptureWriter(str(tmp_path / "process"), None, None, outcomes)
    writer.send("req-1", keys, values, spans, storage, None)
    assert outcomes.wait(1) == [(2, 7, 0)]
    with open(f"/proc/{writer._proc.pid}/stat") as f:  # set up, it keeps out of the requests' way
        assert int(f.read().rsplit(")", 1)[1].split()[16]) == 19
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
    writer = CaptureWriter(str(tmp_path), None, None, outcomes)
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
    writer = CaptureWriter(str(tmp_path), None, None, outcomes)
    sent = [key(f"fact-{i}") for i in range(5)]
    for i, k in enumerate(sent):
        writer.send(f"req-{i}", torch.randn(SHAPE), torch.randn(SHAPE), [(k, tuple(range(7)))], "auto", None)
    writer.close(timeout=60)  # no wait for the answers first: closing lets the writer finish
    assert writer._proc.returncode == 0
    pool = KVPool(tmp_path, "cpu", 0)
    assert all(pool.contains(k) for k in sent)
    assert outcomes.got == [(1, 7, 0)] * 5
    assert capfd.readouterr().err == ""


def test_a_parent_that_dies_leaves_no_writer_and_no_spool(tmp_path):
    """vLLM may kill its worker without a shutdown: the writer sees its input end, stores what
    it was sent, removes the spool and exits."""
    import subprocess
    import sys
    import time

    code = ("import torch, sys\n"
            "from inferscale.kv.capture_writer import CaptureWriter\n"
            "from inferscale.kv.pool import kv_key\n"
            "w = CaptureWriter(sys.argv[1], None, None, lambda o: None)\n"
            "k = kv_key('fact-z', fmt=2, fp='test', dtype='bfloat16', variant='captured', span='fact-z')\n"
            "w.send('req', torch.randn(3, 7, 2, 64), torch.randn(3, 7, 2, 64), [(k, tuple(range(7)))], 'auto', None)\n"
            "print(w._proc.pid, w._spool, flush=True)\n"
            "import os; os._exit(0)\n")  # no close(): as a killed worker
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid, spool = done.stdout.split()
    deadline = time.monotonic() + 60
    while pid_alive(int(pid)) or Path(spool).exists():
        assert time.monotonic() < deadline, "the writer outlived its parent, or left its spool"
        time.sleep(0.1)
    assert KVPool(tmp_path, "cpu", 0).contains(key("fact-z"))
    assert done.stderr == ""


def test_a_writer_that_died_is_an_os_error_to_the_sender(tmp_path):
    writer = CaptureWriter(str(tmp_path), None, None, Outcomes())
    writer._proc.kill()
    writer._proc.wait()
    with pytest.raises(OSError):
        for _ in range(100):  # the pipe's buffer may take the first sends
            writer.send("req", torch.randn(SHAPE), torch.randn(SHAPE), [(key("fact-x"), tuple(range(7)))],
                        "auto", None)
    writer.close(timeout=10)


def test_the_backlog_counts_captures_sent_and_not_yet_stored(tmp_path):
    """What the connector reads to drop captures rather than pile them up while the writer
    gets no CPU (here: stopped outright)."""
    import os
    import signal

    outcomes = Outcomes()
    writer = CaptureWriter(str(tmp_path), None, None, outcomes)
    os.kill(writer._proc.pid, signal.SIGSTOP)
    try:
        for i in range(3):
            writer.send(f"req-{i}", torch.randn(SHAPE), torch.randn(SHAPE), [(key(f"fact-{i}"), tuple(range(7)))],
                        "auto", None)
        assert writer.backlog == 3 and outcomes.got == []
        assert len(list(writer._spool.iterdir())) == 3  # each capture's KV waits in the spool
    finally:
        os.kill(writer._proc.pid, signal.SIGCONT)
    assert outcomes.wait(3) == [(1, 7, 0)] * 3
    assert writer.backlog == 0 and list(writer._spool.iterdir()) == []  # read and removed
    writer.close(timeout=60)
    assert not writer._spool.exists()


def test_keys_sent_rotated_are_stored_pre_rope_as_the_engines_rotator_unrotates_them(tmp_path):
    """The writer rebuilds SmolLM2's rotary embedding from its config sent as JSON; the keys
    it stores are exactly those the engine's own rotator gives back."""
    from transformers import AutoConfig

    from inferscale.models.resolve import resolve_llm

    config = AutoConfig.from_pretrained(str(resolve_llm()))
    rotator = RopeRotator(config)
    rope = portable_rope_config(config, rotator)
    assert rope is not None
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    pre = torch.randn(layers, 9, heads, dim).to(torch.bfloat16)
    positions = torch.arange(412, 421)
    rotated = rotator.rotate(pre, positions).to(torch.bfloat16)  # as the paged cache holds them
    outcomes = Outcomes()
    writer = CaptureWriter(str(tmp_path), None, rope, outcomes)
    values = torch.randn(layers, 9, heads, dim).to(torch.bfloat16)
    writer.send("req", rotated, values, [(key("fact-r"), tuple(range(9)))], "auto", None, positions)
    assert outcomes.wait(1) == [(1, 9, 0)]
    writer.close(timeout=60)
    stored = KVPool(tmp_path, "cpu", 0).get(key("fact-r"))
    assert torch.equal(stored.keys, rotator.unrotate(rotated, positions))
    assert torch.equal(stored.values, values)
    torch.testing.assert_close(stored.keys.float(), pre.float(), atol=0.05, rtol=0.02)  # bf16's round trip


def test_a_config_that_does_not_survive_json_keeps_the_inverse_rope_with_the_sender(tmp_path):
    from transformers import AutoConfig

    from inferscale.models.resolve import resolve_llm

    config = AutoConfig.from_pretrained(str(resolve_llm()))
    rotator = RopeRotator(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": config.rope_parameters["rope_theta"] * 2}
    # its JSON now gives other angles than the rotator's
    assert portable_rope_config(config, rotator) is None
    writer = CaptureWriter(str(tmp_path), None, None, Outcomes())
    with pytest.raises(ValueError, match="pre-RoPE"):
        writer.send("req", torch.randn(SHAPE), torch.randn(SHAPE), [(key("fact-s"), tuple(range(7)))], "auto",
                    None, torch.arange(7))
    writer.close(timeout=60)


def test_a_new_writer_removes_the_spools_of_dead_processes(tmp_path):
    """vLLM kills its worker and the writer with SIGKILL at shutdown: their spool folders are
    removed by the next writer; a live process's and other folders stay."""
    import subprocess
    import sys

    from inferscale.kv.capture_writer import SPOOL_PREFIX, remove_dead_spools

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{SPOOL_PREFIX}{dead.stdout.strip()}-abc123"
    live = tmp_path / f"{SPOOL_PREFIX}{os.getpid()}-def456"
    other = tmp_path / "inferscale-capturex"
    for folder in (gone, live, other):
        folder.mkdir()
    (gone / "1.kv").write_bytes(b"left")
    assert remove_dead_spools(tmp_path) == 1
    assert not gone.exists() and live.exists() and other.exists()


def test_a_spool_whose_maker_is_a_zombie_is_removed(tmp_path):
    """A SIGKILLed tree's pids stay zombies until their parent reaps them (a notebook kernel's
    manager may take its time): such a maker is gone, and its spool goes with it."""
    import subprocess
    import sys
    import time

    from inferscale.kv.capture_writer import SPOOL_PREFIX, remove_dead_spools

    child = subprocess.Popen([sys.executable, "-c", "pass"])  # never waited on until the end: a zombie
    deadline = time.monotonic() + 60
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.05)
    spool = tmp_path / f"{SPOOL_PREFIX}{child.pid}-abc123"
    spool.mkdir()
    try:
        assert not pid_alive(child.pid)
        assert remove_dead_spools(tmp_path) == 1 and not spool.exists()
    finally:
        child.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
