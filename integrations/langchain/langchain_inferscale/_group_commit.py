"""Group commit: concurrent batches of one store run as one.

A store's write costs about the same for one item as for a thousand (one embedding call, one
Chroma write, one history transaction), so the batches that callers hand in while another
batch runs are joined and run together as the next one, the way a database commits the
transactions that queued behind a log flush in one flush. Threads (``batch`` from a thread
pool) and coroutines (``abatch``, ``aput`` and friends gathered by ``asyncio.gather``) are
joined alike: every call queues its ops; the first caller that finds no batch running leads,
runs what is queued, and keeps running until the queue is empty; the others wait for their
own results.

A joined batch that raises is run again group by group, so each caller gets its own
result or its own error (a store's batch is all or nothing, so nothing of the failed joined
run is left written).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: most ops one joined run holds (the rest wait for the next run)
MAX_JOINED_OPS = 20_000
#: seconds a leader waits before a run when the last run joined several callers: the callers it
#: just answered hand in their next batch meanwhile (a lone caller never waits)
LINGER_S = 0.003


class GroupCommit:
    """Joins concurrent calls of ``run`` (a list of ops -> a list of results, one per op).

    Args:
        run: runs one batch; all or nothing (a failure leaves nothing of it written).
    """

    def __init__(self, run: Callable[[list], list]) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._queue: list[tuple[list, concurrent.futures.Future]] = []
        self._leading = False
        self._leader: int | None = None  # the leading thread's ident, while one leads
        self._joined_last = False  # the last run joined several callers: concurrency was seen

    def submit(self, ops: Sequence[Any]) -> tuple[concurrent.futures.Future, bool]:
        """Queue ``ops``. Returns the future of their results and whether the caller must lead
        (call :meth:`lead`, in a thread that may block: the first caller finding none running)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queue.append((list(ops), future))
            lead = not self._leading
            self._leading = True
        return future, lead

    def lead(self) -> None:
        """Run what is queued, joined, until the queue is empty (then the next caller leads)."""
        self._leader = threading.get_ident()
        try:
            while True:
                if self._joined_last:
                    time.sleep(LINGER_S)
                with self._lock:
                    groups, taken = [], 0
                    while self._queue and (not groups or taken + len(self._queue[0][0]) <= MAX_JOINED_OPS):
                        groups.append(self._queue.pop(0))
                        taken += len(groups[-1][0])
                    if not groups:
                        self._leading, self._leader = False, None
                        return
                self._joined_last = len(groups) > 1
                self._run_groups(groups)
        except BaseException:  # never left leading with nobody running the queue
            with self._lock:
                self._leading, self._leader = False, None
            raise

    def lead_in_thread(self) -> None:
        """:meth:`lead` in a thread of its own (a coroutine's lead): never in a pool that the
        callers waiting for it may fill (the event loop's default executor running sync
        calls of the same store would wait for a leader queued behind them)."""
        threading.Thread(target=self.lead, name="inferscale-store-batches", daemon=True).start()

    def _run_groups(self, groups: list[tuple[list, concurrent.futures.Future]]) -> None:
        # a caller that gave up (its coroutine cancelled) is dropped before the run, not after
        groups = [(ops, future) for ops, future in groups if future.set_running_or_notify_cancel()]
        if len(groups) > 1:
            try:
                results = self._run([op for ops, _ in groups for op in ops])
            except BaseException:  # noqa: BLE001 - each group again, alone: its caller gets its own error
                pass
            else:
                start = 0
                for ops, future in groups:
                    future.set_result(results[start:start + len(ops)])
                    start += len(ops)
                return
        for ops, future in groups:
            try:
                result = self._run(ops)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def call(self, ops: Sequence[Any]) -> list:
        """Run ``ops`` joined with whatever else is queued; returns their results.

        Raises:
            Whatever the run of this caller's own ops raises.
        """
        if self._leader == threading.get_ident():  # called from a run (an embedder that reads the store):
            return self._run(list(ops))             # run now, or the leader would wait for itself
        future, lead = self.submit(ops)
        if lead:
            self.lead()
        return future.result()
