"""The background encoder: one daemon thread that drains the KV job queue in batches.

Writes return once Chroma, the index, the history and the job queue hold them; this
thread then encodes what is pending, oldest first, in batches of at most ``batch_jobs``
jobs (the encoder packs them by tokens), and removes each batch's rows when its KV is in
the pool. :meth:`BackgroundEncoder.wait` blocks until the queue is empty. A batch that
fails is logged and retried after ``retry_s`` seconds, doubling up to a minute while
failures repeat; its jobs stay queued.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from inferscale.kv.jobs import KVJob, KVJobQueue

logger = logging.getLogger(__name__)


class BackgroundEncoder:
    """Drains a :class:`KVJobQueue` on a daemon thread.

    Args:
        queue: the durable job queue.
        run_batch: encodes and stores the KV of a batch of jobs (called on the thread).
        batch_jobs: most jobs per batch.
        retry_s: pause after a failed batch (seconds).
    """

    def __init__(self, queue: KVJobQueue, run_batch: Callable[[Sequence[KVJob]], None], *, batch_jobs: int = 64,
                 retry_s: float = 1.0) -> None:
        self.queue = queue
        self._run_batch = run_batch
        self.batch_jobs = batch_jobs
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._closed = False
        self._running = threading.Event()
        self._running.set()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0
        self.failures = 0

    def notify(self) -> None:
        """New jobs were queued: start the thread if needed and wake it."""
        with self._start_lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="inferscale-kv-encoder", daemon=True)
                self._thread.start()
            self._wake.set()

    def pause(self) -> None:
        """Hold the encoder after its current batch (e.g. under peak load); jobs keep queuing."""
        self._running.clear()

    def resume(self) -> None:
        """Let the encoder run again."""
        self._running.set()
        self._wake.set()

    def _loop(self) -> None:
        failed_in_a_row = 0
        while not self._closed:
            self._running.wait()
            self._wake.clear()
            jobs = self.queue.take(self.batch_jobs)
            if not jobs:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()
                # the thread ends when idle (it holds the encoder's model); notify starts another
                with self._start_lock:
                    if not self._wake.is_set() and self.queue.pending() == 0:
                        self._thread = None
                        return
                continue
            with self._idle:
                self._busy = True
            try:
                self._run_batch(jobs)
                self.queue.done(jobs)
                self.batches += 1
                failed_in_a_row = 0
            except Exception:  # noqa: BLE001 - the thread must survive a bad batch; jobs stay queued
                self.failures += 1
                failed_in_a_row += 1
                pause = min(60.0, self.retry_s * 2 ** (failed_in_a_row - 1))
                logger.exception("KV encoding of %d job(s) failed; retrying in %.1f s", len(jobs), pause)
                time.sleep(pause)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is queued; returns ``False`` if ``timeout`` (seconds) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.queue.pending() == 0:
            return True
        self.notify()
        while True:
            with self._idle:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._idle.wait(timeout=0.2 if left is None else min(0.2, left))
            if self.queue.pending() == 0:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def close(self) -> None:
        """Stop the thread after its current batch (queued jobs stay for the next start)."""
        self._closed = True
        self._running.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
