"""The capture writer: stores captured KV in the pool from a process of its own.

The connector reads a missed memory's K and V out of vLLM's paged cache after the step
that computed them (:mod:`inferscale.kv.capture`) and inverse-rotates the keys. Storing
them (the storage dtype, the safetensors file, the disk budget's eviction, Redis'
write-through) is Python-heavy work that, done by a thread of vLLM's engine process,
held that process's GIL while vLLM's Python-driven step waited for it: on 2 cores at a 25%
disk budget, questions with no miss took 76.6 ms with capture on against 51.1 ms with the
writer storing nothing, whatever the writer thread's CPU priority
(docs/decisions.md, "Capture: the writer in a process of its own").

So the connector starts this module as a process of its own (``python -m
inferscale.kv.capture_writer``, with :mod:`subprocess`: vLLM's engine core may be a
daemonic ``multiprocessing`` child, which may not have children of its own) at the lowest
CPU priority on one thread, and hands it each capture through a pipe:

- parent to writer, once: a JSON line ``{"kv_dir": ..., "redis_url": ...}``; then per
  capture a JSON line ``{"req_id", "dtype", "shape": [L, N, H, D], "storage",
  "disk_budget_bytes", "spans": [[key, [token ids]], ...]}`` followed by the keys' and the
  values' raw bytes (``L * N * H * D`` elements each, in ``dtype``, pre-RoPE keys);
- writer to parent, per capture: a JSON line ``{"stored", "tokens", "errors"}``.

The writer exits when its input closes (the engine stopped, or was killed), after storing
what it was sent. Its log lines go to the engine's stderr. :func:`store_capture` is the one
way a capture is stored: the writer process calls it, and so does the connector's thread
where no writer process can start.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Callable, Sequence

import torch

from inferscale.kv.entry import FactKV, to_storage
from inferscale.kv.pool import KVPool

logger = logging.getLogger(__name__)

#: the dtypes a capture's tensors cross the pipe in (a paged cache's dtypes)
PIPE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``(stored, tokens, errors)`` of one capture
Outcome = tuple[int, int, int]


def store_capture(pool: KVPool, req_id: str, keys: torch.Tensor, values: torch.Tensor,
                  spans: Sequence[tuple[str, tuple[int, ...]]], storage: str,
                  disk_budget_bytes: int | None) -> Outcome:
    """Store each span of one capture in ``pool`` (errors logged and counted, never raised).

    Args:
        pool: the KV pool (its disk tier is set to ``disk_budget_bytes`` first).
        keys, values: ``[num_layers, num_tokens, num_kv_heads, head_dim]``, keys pre-RoPE;
            the spans' tokens one after another.
        spans: ``(pool key, token ids)`` of each span, in order.
        storage: ``kv_storage_dtype`` (``"auto"``, ``"int8"``, ``"int4"``).
        disk_budget_bytes: the front's disk budget (bytes; ``None``: none).

    Returns:
        ``(spans stored, their tokens, spans not stored)``.
    """
    stored = tokens = errors = 0
    try:
        if disk_budget_bytes != pool.disk_budget_bytes:
            pool.set_disk_budget(disk_budget_bytes)
        offset = 0
        for key, token_ids in spans:
            n = len(token_ids)
            kv = FactKV(keys[:, offset:offset + n].contiguous(), values[:, offset:offset + n].contiguous(),
                        tuple(token_ids))
            offset += n
            try:
                pool.put(key, to_storage(kv, storage))
                stored, tokens = stored + 1, tokens + n
            except Exception as exc:  # a full disk, an unwritable folder: the memory stays text
                errors += 1
                logger.warning("request %s: captured KV %s not stored: %s", req_id, key, exc)
    except Exception:  # never let a capture take the engine down
        errors = len(spans) - stored
        logger.exception("request %s: capturing KV failed", req_id)
    return stored, tokens, errors


class CaptureWriter:
    """The connector's side of the writer process: starts it, sends it captures, reads back
    what each stored.

    Args:
        kv_dir: the KV pool's folder. redis_url: the shared Redis tier (``None``: none).
        on_outcome: called with each capture's :data:`Outcome`, from a reader thread.

    Raises:
        OSError: the process cannot be started.

    :meth:`send` is called from one thread (the connector's hand-off thread).
    """

    def __init__(self, kv_dir: str, redis_url: str | None, on_outcome: Callable[[Outcome], None]) -> None:
        self._on_outcome = on_outcome
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "inferscale.kv.capture_writer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._send_line({"kv_dir": str(kv_dir), "redis_url": redis_url})
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                                        name="inferscale-capture-results")
        self._reader.start()

    def _send_line(self, obj: dict) -> None:
        self._stdin.write(json.dumps(obj).encode() + b"\n")

    def send(self, req_id: str, keys: torch.Tensor, values: torch.Tensor,
             spans: Sequence[tuple[str, tuple[int, ...]]], storage: str, disk_budget_bytes: int | None) -> None:
        """Hand one capture to the writer (blocks while the pipe is full, holding no lock).

        Args: as :func:`store_capture`'s; ``keys`` and ``values`` on any device, in a
            :data:`PIPE_DTYPES` dtype.

        Raises:
            BrokenPipeError / OSError: the writer process is gone.
        """
        keys, values = keys.detach().cpu().contiguous(), values.detach().cpu().contiguous()
        dtype = str(keys.dtype).removeprefix("torch.")
        self._send_line({"req_id": req_id, "dtype": dtype, "shape": list(keys.shape), "storage": storage,
                         "disk_budget_bytes": disk_budget_bytes, "spans": [[k, list(t)] for k, t in spans]})
        for t in (keys, values):
            self._stdin.write(memoryview(t.view(torch.uint8).numpy()))
        self._stdin.flush()

    def _read(self, out: IO[bytes]) -> None:
        for line in out:
            try:
                outcome = tuple(json.loads(line))
            except ValueError:
                continue
            self._on_outcome(outcome)  # type: ignore[arg-type]

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout: float | None = None) -> None:
        """Let the writer store what it was sent, then exit; waits up to ``timeout`` seconds
        (``None``: as long as it takes), then stops it."""
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)


# ------------------------------------------------------------------ the writer process

def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def serve(inp: IO[bytes], out: IO[str]) -> None:
    """The writer process's loop: store each capture read from ``inp``, answer on ``out``,
    return at the end of ``inp``. See the module docstring for the protocol."""
    config = json.loads(inp.readline() or b"{}")
    pool = KVPool(config["kv_dir"], "cpu", 0, 0, None, config.get("redis_url"))  # no memory tier: files, Redis
    while True:
        line = inp.readline()
        if not line:
            return
        head = json.loads(line)
        dtype = PIPE_DTYPES[head["dtype"]]
        shape = tuple(int(x) for x in head["shape"])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensors = []
        for _ in (0, 1):
            data = _read_exact(inp, nbytes)
            if data is None:
                return  # the parent stopped mid-capture: nothing half-stored
            tensors.append(torch.frombuffer(bytearray(data), dtype=dtype).view(shape))
        spans = [(str(k), tuple(int(t) for t in ids)) for k, ids in head["spans"]]
        outcome = store_capture(pool, str(head["req_id"]), tensors[0], tensors[1], spans, head["storage"],
                                head["disk_budget_bytes"])
        out.write(json.dumps(outcome) + "\n")
        out.flush()


def main() -> None:
    """Entry point of ``python -m inferscale.kv.capture_writer``: one thread, nice 19,
    Ctrl-C left to the parent (which closes the pipe), answers on the original stdout and
    everything else printed to stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(19)
    except (AttributeError, OSError):
        pass
    torch.set_num_threads(1)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format="inferscale capture writer: %(levelname)s %(message)s")
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
