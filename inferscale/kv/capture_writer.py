"""The capture writer: stores captured KV in the pool from a process of its own.

The connector reads a missed memory's K and V out of vLLM's paged cache after the step
that computed them (:mod:`inferscale.kv.capture`). Everything after that read (the keys'
inverse RoPE, the storage dtype, the safetensors file, the disk budget's eviction, Redis'
write-through) was done by a thread of vLLM's worker process, and slowed every request of
that process: on 2 cores at a 25% disk budget, questions with no miss took 63 ms with
capture on against 44 ms with the captures read and dropped, whatever the thread's CPU
priority; the inverse RoPE alone, a few milliseconds of torch a capture, accounted for all
of it (docs/decisions.md, "Capture: the writer in a process of its own").

So the connector starts this module as a process of its own (``python -m
inferscale.kv.capture_writer``, with :mod:`subprocess`: vLLM's engine core may be a
daemonic ``multiprocessing`` child, which may not have children of its own), on one thread
and, once set up, at the lowest CPU priority (nice 19), and hands it each capture through a pipe:

- parent to writer, once: a JSON line ``{"kv_dir": ..., "redis_url": ..., "rope": ..., "spool": ...}``
  (``rope``: the model's transformers config as JSON, for :class:`~inferscale.kv.rope.RopeRotator`;
  ``null`` when it does not survive the trip, :func:`portable_rope_config`, and the parent
  sends pre-RoPE keys); then per capture a JSON line ``{"req_id", "file", "dtype", "shape":
  [L, N, H, D], "positions", "storage", "disk_budget_bytes", "spans": [[key, [token ids]],
  ...]}``, where ``file`` holds the keys' and then the values' raw bytes (``L * N * H * D``
  elements each, in ``dtype``; keys rotated at ``positions``, or pre-RoPE where it is
  ``null``) in the writer's spool folder (in ``/dev/shm`` where there is one), which the writer
  deletes once read. A file, not the pipe, carries the tensors: megabytes through a pipe
  that a nice-19 reader drains slowly would wake the sending thread for every 64 KiB, each
  time taking the GIL back from vLLM's step;
- writer to parent, per capture: a JSON line ``[stored, tokens, errors]``.

The writer exits when its input closes (the engine stopped, or was killed), after storing
what it was sent, and removes the spool folder (one that vLLM's ``SIGKILL`` left is removed
by the next writer: :func:`remove_dead_spools`). Its log lines go to the engine's stderr.
:func:`store_capture` is the one way a capture is stored: the writer process calls it, and so does the connector's thread
where no writer process can start.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import torch

from inferscale.kv.entry import FactKV, to_storage
from inferscale.kv.pool import KVPool
from inferscale.kv.rope import RopeRotator
from inferscale.runtime.processes import pid_alive

logger = logging.getLogger(__name__)

#: the dtypes a capture's tensors cross the pipe in (a paged cache's dtypes)
PIPE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``(stored, tokens, errors)`` of one capture
Outcome = tuple[int, int, int]

#: a spool folder's name: this prefix, the pid of the process that made it, ``-``, a random part
SPOOL_PREFIX = "inferscale-capture-"


def remove_dead_spools(where: Path) -> int:
    """Remove the spool folders in ``where`` whose maker's process is gone (vLLM kills its
    worker and the writer at shutdown with ``SIGKILL``, which leaves them); returns how many."""
    removed = 0
    for path in where.glob(f"{SPOOL_PREFIX}*-*"):
        pid = path.name[len(SPOOL_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


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
        rope: the model's config as JSON (:func:`portable_rope_config`) for the writer to
            inverse-rotate keys sent with their positions (``None``: only pre-RoPE keys are sent).
        on_outcome: called with each capture's :data:`Outcome`, from a reader thread.

    Raises:
        OSError: the process cannot be started.

    :meth:`send` is called from one thread (the connector's hand-off thread).
    """

    def __init__(self, kv_dir: str, redis_url: str | None, rope: str | None,
                 on_outcome: Callable[[Outcome], None]) -> None:
        self._on_outcome = on_outcome
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() else Path(tempfile.gettempdir())
        remove_dead_spools(where)
        self._spool = Path(tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=where))
        self._count = 0
        self._outstanding = 0  # captures sent and not answered yet
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "inferscale.kv.capture_writer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self.unrotates = rope is not None
        self._send_line({"kv_dir": str(kv_dir), "redis_url": redis_url, "rope": rope, "spool": str(self._spool)})
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                                        name="inferscale-capture-results")
        self._reader.start()

    def _send_line(self, obj: dict) -> None:
        self._stdin.write(json.dumps(obj).encode() + b"\n")

    def send(self, req_id: str, keys: torch.Tensor, values: torch.Tensor,
             spans: Sequence[tuple[str, tuple[int, ...]]], storage: str, disk_budget_bytes: int | None,
             positions: torch.Tensor | None = None) -> None:
        """Hand one capture to the writer (blocks while the pipe is full, holding no lock).

        Args: as :func:`store_capture`'s; ``keys`` and ``values`` on any device, in a
            :data:`PIPE_DTYPES` dtype; ``positions``: ``[num_tokens]`` prompt positions the
            keys are rotated at (only where :attr:`unrotates`), ``None`` for pre-RoPE keys.

        Raises:
            BrokenPipeError / OSError: the writer process is gone.
        """
        keys, values = keys.detach().cpu().contiguous(), values.detach().cpu().contiguous()
        dtype = str(keys.dtype).removeprefix("torch.")
        self._count += 1
        path = self._spool / f"{self._count}.kv"
        with open(path, "wb") as f:
            for t in (keys, values):
                f.write(memoryview(t.view(torch.uint8).numpy()))
        if positions is not None and not self.unrotates:
            raise ValueError("this writer has no rotary config: send pre-RoPE keys")
        self._send_line({"req_id": req_id, "file": str(path), "dtype": dtype, "shape": list(keys.shape),
                         "positions": None if positions is None else positions.tolist(),
                         "storage": storage, "disk_budget_bytes": disk_budget_bytes,
                         "spans": [[k, list(t)] for k, t in spans]})
        with self._lock:
            self._outstanding += 1
        self._stdin.flush()

    def _read(self, out: IO[bytes]) -> None:
        for line in out:
            try:
                outcome = tuple(json.loads(line))
            except ValueError:
                continue
            with self._lock:
                self._outstanding = max(self._outstanding - 1, 0)
            self._on_outcome(outcome)  # type: ignore[arg-type]
        with self._lock:  # the writer is gone: nothing more is answered
            self._outstanding = 0

    @property
    def backlog(self) -> int:
        """Captures sent and not stored yet (each waits in the spool, a few MB of memory)."""
        with self._lock:
            return self._outstanding

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
        shutil.rmtree(self._spool, ignore_errors=True)  # what a writer that was stopped left


# ------------------------------------------------------------------ the writer process

def serve(inp: IO[bytes], out: IO[str]) -> None:
    """The writer process's loop: store each capture read from ``inp``, answer on ``out``,
    return at the end of ``inp``. See the module docstring for the protocol."""
    config = json.loads(inp.readline() or b"{}")
    pool = KVPool(config["kv_dir"], "cpu", 0, 0, None, config.get("redis_url"))  # no memory tier: files, Redis
    rotator = _rotator(config["rope"]) if config.get("rope") else None
    try:  # set up at the parent's priority (an engine serving at once would starve the imports); now out of the way
        os.nice(19)
    except (AttributeError, OSError):
        pass
    try:
        _store_each(inp, out, pool, rotator)
    finally:  # the parent is gone or done: its spool goes too, whatever stopped it
        if config.get("spool"):
            shutil.rmtree(config["spool"], ignore_errors=True)


def _store_each(inp: IO[bytes], out: IO[str] | None, pool: KVPool, rotator: RopeRotator | None) -> None:
    for line in inp:
        head = json.loads(line)
        path = Path(head["file"])
        dtype = PIPE_DTYPES[head["dtype"]]
        shape = tuple(int(x) for x in head["shape"])
        try:
            data = bytearray(path.read_bytes())
        except OSError as exc:
            logger.warning("request %s: its captured KV is gone (%s); not stored", head["req_id"], exc)
            outcome: Outcome = (0, 0, len(head["spans"]))
        else:
            path.unlink(missing_ok=True)
            both = torch.frombuffer(data, dtype=dtype).view(2, *shape)
            keys = both[0]
            spans = [(str(k), tuple(int(t) for t in ids)) for k, ids in head["spans"]]
            if head.get("positions") is not None:
                assert rotator is not None, "keys with positions sent to a writer without a rotary config"
                keys = rotator.unrotate(keys, torch.tensor(head["positions"], dtype=torch.long))
            outcome = store_capture(pool, str(head["req_id"]), keys, both[1], spans, head["storage"],
                                    head["disk_budget_bytes"])
        if out is not None:
            try:
                out.write(json.dumps(outcome) + "\n")
                out.flush()
            except OSError:  # the parent is gone (killed): store what it sent, unanswered
                out = None


def _rotator(rope_json: str) -> RopeRotator:
    from transformers import CONFIG_MAPPING

    data = json.loads(rope_json)
    return RopeRotator(CONFIG_MAPPING[data["model_type"]].from_dict(data))


def portable_rope_config(config: Any, rotator: RopeRotator) -> str | None:
    """The model's transformers ``config`` as JSON for the writer process, when the
    :class:`~inferscale.kv.rope.RopeRotator` built from that JSON gives exactly ``rotator``'s
    cos/sin tables (positions 0 to 131,072); ``None`` otherwise (a config class transformers
    does not know by its ``model_type``, a field JSON cannot hold): the caller then sends
    pre-RoPE keys."""
    try:
        text = config.to_json_string(use_diff=False)
        positions = torch.arange(0, 131_072, 257)
        ours, theirs = rotator.cos_sin(positions), _rotator(text).cos_sin(positions)
        if all(torch.equal(a, b) for a, b in zip(ours, theirs)):
            return text
    except Exception as exc:  # noqa: BLE001 - any failure means: unrotate in the caller's process
        logger.info("the model's config does not survive JSON (%s); captured keys are unrotated in vLLM's process",
                    exc)
    return None


def main() -> None:
    """Entry point of ``python -m inferscale.kv.capture_writer``: one thread, nice 19 once set
    up, Ctrl-C left to the parent (which closes the pipe), answers on the original stdout and
    everything else printed to stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format="inferscale capture writer: %(levelname)s %(message)s")
    serve(sys.stdin.buffer, answers)
    try:
        answers.close()
    except OSError:  # the parent is gone: nothing to flush to
        pass


if __name__ == "__main__":
    main()
