"""When the engine's worker is between steps: the capture hand-off works only then.

The worker runs one step (a forward pass) at a time; the KV connector sees each one begin
(``start_load_kv``) and end (``wait_for_save``). Work done in the worker's process during a
step takes the GIL and the cores from it (on 2 cores, at a 25% disk budget, requests with no
miss took about 24 ms longer with capture on than with it off: docs/decisions.md, "Capture
off the request's path"). So the writer waits for a quiet moment, as LMCache stores off the request path and as
InferScale's background encoder waits for no request in flight, but never longer than
``max_wait_s``: an engine that never pauses still gets its captures stored (their copies
wait in memory meanwhile).
"""

from __future__ import annotations

import threading
import time


class StepGate:
    """Tracks the worker's steps; :meth:`wait_quiet` blocks a background thread until none runs.

    Args:
        quiet_s: how long after a step ends the worker must stay idle (seconds; default
            2 ms: the next step of a running request starts sooner, so a decode in progress
            keeps the writer waiting).
    """

    def __init__(self, quiet_s: float = 0.002) -> None:
        self.quiet_s = quiet_s
        self._cond = threading.Condition()
        self._in_step = False
        self._ended = 0.0

    def begin(self) -> None:
        """A step starts (the connector's ``start_load_kv``)."""
        with self._cond:
            self._in_step = True

    def end(self) -> None:
        """The step ended (the connector's ``wait_for_save``, after its reads)."""
        with self._cond:
            self._in_step = False
            self._ended = time.monotonic()
            self._cond.notify_all()

    def wait_quiet(self, max_wait_s: float) -> float:
        """Block until no step runs and none has for ``quiet_s``, or ``max_wait_s`` passed;
        returns the seconds waited."""
        start = time.monotonic()
        deadline = start + max_wait_s
        with self._cond:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    break
                if not self._in_step:
                    idle_for = now - self._ended
                    if idle_for >= self.quiet_s:
                        break
                    self._cond.wait(min(self.quiet_s - idle_for, deadline - now))
                else:
                    self._cond.wait(deadline - now)
        return time.monotonic() - start
