"""The background encoder: one daemon thread that drains the KV job queue in batches.

Writes return once Chroma, the index, the history and the job queue hold them; this
thread then encodes what is pending, oldest first, in batches of at most ``batch_jobs``
jobs (the encoder packs them by tokens), and removes each batch's rows when its KV is in
the pool. :meth:`BackgroundEncoder.wait` blocks until the queue is empty. A batch that
fails is retried job by job after ``retry_s`` seconds; a job that fails ``max_attempts``
times is dropped from the queue with an error log (its fact is queued again, and
prefilled as text meanwhile, the next time a request retrieves it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from inferscale.kv.jobs import KVJob, KVJobQueue
from inferscale.runtime.lifecycle import close_at_exit

logger = logging.getLogger(__name__)


class EncoderClosing(Exception):
    """Raised inside a batch (by :meth:`BackgroundEncoder.yield_now`) when the encoder is
    closing: the batch stops there and its jobs stay queued, unclaimed."""


class BackgroundEncoder:
    """Drains a :class:`KVJobQueue` on a daemon thread.

    Args:
        queue: the durable job queue.
        run_batch: encodes and stores the KV of a batch of jobs (called on the thread).
        batch_jobs: most jobs per batch.
        retry_s: pause after a failed batch (seconds).
        max_attempts: tries of one job before it is dropped.
        gather_s: how long the thread waits after being woken before it takes a batch
            (seconds): writes arriving together are encoded in one batch, and the writer
            that woke it returns without the encoder competing for the interpreter.
        requests_in_flight: how many requests this process has in flight (planned, not yet
            finished: :attr:`inferscale.kv.pool.KVPool.requests_in_flight`); while
            :attr:`yield_to_requests`, before each batch the thread waits until there are
            none, so an encode never competes with a request for the cores or the GPU
            (issue 39), unless :meth:`wait` is waiting for the KV (someone asked for it).
        yield_to_requests: wait for requests in flight (default ``True`` when
            ``requests_in_flight`` is given; ``MemoryConfig.encode_when_idle``).

    Attributes:
        yield_to_requests: as the argument; may be changed while the thread runs.
        last_error: the last failure, ``"<job>: <exception>"`` (``None`` if none).
        encode_s: seconds spent encoding batches (wall clock, less what a batch reported
            with :meth:`not_encoding`; settled when a batch ends, so it never decreases).
            yielded_s: seconds the thread waited for requests to end before a batch.
    """

    #: how often the thread looks again while requests are in flight (seconds)
    YIELD_POLL_S = 0.01

    def __init__(self, queue: KVJobQueue, run_batch: Callable[[Sequence[KVJob]], None], *, batch_jobs: int = 64,
                 retry_s: float = 1.0, max_attempts: int = 3, gather_s: float = 0.02,
                 requests_in_flight: Callable[[], int] | None = None, yield_to_requests: bool = True) -> None:
        self.queue = queue
        self._requests_in_flight = requests_in_flight
        self.yield_to_requests = yield_to_requests and requests_in_flight is not None
        self._waiters = 0  # wait() calls under way: they want the KV now
        self.encode_s = 0.0
        self._not_encoding_s = 0.0  # of the batch under way: see not_encoding()
        self.yielded_s = 0.0
        self._run_batch = run_batch
        self.batch_jobs = batch_jobs
        self.retry_s = retry_s
        self.gather_s = gather_s
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._in_batch = False  # a batch taken from the queue is under way (wait_idle)
        self._closed = False
        self._running = threading.Event()
        self._running.set()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.max_attempts = max_attempts
        self.batches = 0
        self.failures = 0
        self.last_error: str | None = None
        self._attempts: dict[int, int] = {}
        self._outage = False  # the last batch failed because a dependency was down
        # stopped before the interpreter tears down, even when its Memory was collected while
        # the thread still ran (the thread keeps this object alive, so the weak reference holds)
        close_at_exit(self, first=True)

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
        while not self._closed:
            self._running.wait()
            if self._closed:  # paused until closed: the queued jobs stay for the next start
                break
            self._yield_to_requests()
            self._wake.clear()
            if self.gather_s and not self._closed and self.queue.pending() < self.batch_jobs:
                time.sleep(self.gather_s)
            jobs = self.queue.take(self.batch_jobs)
            if not jobs:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()
                # the thread ends when nothing is left for it (jobs another live process has
                # claimed are that process's); notify starts another
                with self._start_lock:
                    if not self._wake.is_set() and self.queue.claimable() == 0:
                        self._thread = None
                        return
                continue
            with self._idle:
                self._busy = self._in_batch = True
            try:
                self._batch(jobs)
            finally:
                with self._idle:
                    self._in_batch = False
                    self._idle.notify_all()

    def _batch(self, jobs: Sequence[KVJob]) -> None:
        """Run one batch taken from the queue; on failure, wait ``retry_s`` and find the bad job."""
        # a request may have started between the loop's wait and the take (the gather's sleep
        # is in between): checked again now the jobs are claimed, so a job queued during a
        # request never runs before it ends
        self._yield_to_requests()
        if self._run(jobs):
            return
        time.sleep(self.retry_s)
        if self._outage:  # a dependency is down, not a job bad: retry them all later
            return
        for job in jobs if len(jobs) > 1 else ():  # find the job that fails
            self._run([job])

    def wait_idle(self, timeout: float = 600.0) -> bool:
        """Wait until no batch is under way (after :meth:`pause`, none starts); ``False`` if
        ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._in_batch and time.monotonic() < deadline:
                self._idle.wait(timeout=0.2)
            return not self._in_batch

    def yield_now(self) -> None:
        """Wait, as before a batch, while this process has a request in flight (unless someone
        waits for the queue): the engine encoder calls it between its waves and while its KV lands.

        Raises:
            EncoderClosing: the encoder is closing (a ``close()``, the interpreter's exit after
                a Ctrl-C): the batch under way ends here, its jobs stay queued.
        """
        self._yield_to_requests()
        if self._closed:
            raise EncoderClosing("the KV encoder is closing: this batch's jobs stay queued")

    def _yield_to_requests(self) -> None:
        """Wait while this process has a request in flight (not while :meth:`wait` waits, nor
        once closing)."""
        while (self.yield_to_requests and self._requests_in_flight() > 0 and self._waiters == 0
               and not self._closed):
            t0 = time.monotonic()
            time.sleep(self.YIELD_POLL_S)
            self.yielded_s += time.monotonic() - t0  # counted as it goes: a scrape sees a long wait

    def not_encoding(self, seconds: float) -> None:
        """Say that ``seconds`` of the batch under way were spent waiting, not encoding (for a
        request's capture to land): :attr:`encode_s` leaves them out when the batch ends.
        Called from the batch function, on this thread."""
        self._not_encoding_s += seconds

    def _count_batch(self, t0: float) -> None:
        """Add the batch begun at ``t0`` (monotonic seconds) to :attr:`encode_s`."""
        self.encode_s += max(time.monotonic() - t0 - self._not_encoding_s, 0.0)
        self._not_encoding_s = 0.0

    def _run(self, jobs: Sequence[KVJob]) -> bool:
        """Encode ``jobs``; on failure count an attempt per job and drop those out of attempts.

        A failure that says a dependency is down (PostgreSQL, Chroma:
        :func:`inferscale.runtime.outages.Outages.dependency_of`) counts no attempt (the jobs
        are fine, and stay queued until it is back) and logs one line per outage, not a
        traceback per job."""
        from inferscale.runtime.outages import OUTAGES

        t0 = time.monotonic()
        self._not_encoding_s = 0.0
        try:
            self._run_batch(jobs)
        except EncoderClosing:  # given back, not failed: the next start (this process's or another's) takes them
            self._count_batch(t0)
            self.queue.release(jobs)
            return True
        except Exception as exc:  # noqa: BLE001 - the thread must survive a bad batch; jobs stay queued
            return self._failed(jobs, exc, t0)
        else:
            self._count_batch(t0)
            self.queue.done(jobs)
            self.batches += 1
            for job in jobs:
                self._attempts.pop(job.job_id, None)
            self._outage = False
            OUTAGES.recheck()  # a dependency this batch needed may be back
            return True

    def _failed(self, jobs: Sequence[KVJob], exc: Exception, t0: float) -> bool:
        """Count a failed batch (called in its ``except``, so its traceback is logged); ``False``."""
        from inferscale.runtime.outages import OUTAGES

        self._count_batch(t0)
        self.failures += 1
        self.last_error = f"{jobs[0] if len(jobs) == 1 else f'{len(jobs)} jobs'}: {type(exc).__name__}: {exc}"
        dependency = OUTAGES.dependency_of(exc)
        self._outage = dependency is not None
        if dependency is not None:
            OUTAGES.failed(dependency, exc)
            return False
        logger.exception("KV encoding of %d job(s) failed", len(jobs))
        if len(jobs) == 1:
            n = self._attempts[jobs[0].job_id] = self._attempts.get(jobs[0].job_id, 0) + 1
            if n >= self.max_attempts:
                logger.error("giving up on %s after %d attempts: %s", jobs[0], n, self.last_error)
                self.queue.done(jobs)
                self._attempts.pop(jobs[0].job_id, None)
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no job is queued; returns ``False`` if ``timeout`` (seconds) passed first,
        or at once when the encoder was closed with jobs queued."""
        if self._closed:
            return self.queue.pending() == 0
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.queue.pending() == 0:
            return True
        with self._idle:
            self._waiters += 1  # the encoder stops yielding to requests while anyone waits
        try:
            self.notify()
            while True:
                with self._idle:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._idle.wait(timeout=0.2 if left is None else min(0.2, left))
                if self.queue.pending() == 0:
                    return True
                if self._closed or (deadline is not None and time.monotonic() >= deadline):
                    return False
        finally:
            with self._idle:
                self._waiters -= 1

    def close(self) -> None:
        """Stop the thread after its current batch (queued jobs stay for the next start)."""
        self._closed = True
        self._running.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


def wait_with_bar(kv, timeout: float | None, poll_s: float = 0.5) -> bool:
    """:meth:`~inferscale.kv.manager.KVManager.wait` with a tqdm bar: the encodes done of
    those queued when the wait began (``kv.pending()``), and their rate in ``KV/s``.

    The bar's clock starts at the first encode that lands (the bar is shown from then, at that
    count): its rate, and so its estimate of the time left, is the encoder's steady one, not one
    that counts what comes before the first (the engine's warm-up, the preamble's encode: a
    first estimate several times too short or too long, issue 56); the rate is the average since
    then (a batch's encodes land together).

    Args:
        kv: the :class:`~inferscale.kv.manager.KVManager` whose queue is waited on.
        timeout: most seconds to wait (``None``: no limit).
        poll_s: seconds between updates of the bar.

    Returns:
        ``True`` when nothing is pending, ``False`` if ``timeout`` passed first.
    """
    from tqdm import tqdm

    total = kv.pending()
    deadline = None if timeout is None else time.monotonic() + timeout
    bar = None
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = kv.wait(poll_s if left is None else min(poll_s, left))
            n = max(0, total - kv.pending())
            if bar is None and total and (n or done):
                # smoothing=0: the rate is the average since the bar began, not tqdm's moving
                # average of the last updates (encodes land a batch at a time: 8 at once over one
                # 0.5 s poll read as 16 KV/s, a first estimate 14x too short under load)
                bar = tqdm(total=total, initial=n, desc="encoding KV", unit="KV", smoothing=0)
            elif bar is not None:
                bar.update(n - bar.n)
            if done or (left is not None and left <= poll_s):
                return done or kv.pending() == 0
    finally:
        if bar is not None:
            bar.close()
