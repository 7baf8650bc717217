"""Close what is still open before the interpreter tears down, so every process that used
InferScale exits with status 0 and prints nothing at exit, whether or not it called
``close()``.

Background work runs on daemon threads (the KV encoder, the engine's event loop). Left to
interpreter exit, a daemon thread is frozen mid-call while the interpreter and the C++
runtimes under torch and vLLM are finalized around it: seen as exit status 134
("terminate called without an active exception"), 139 (a segmentation fault), or a
traceback from work that submitted to a ``concurrent.futures`` executor already shut down.

:func:`close_at_exit` registers an object; one hook, installed with
``threading._register_atexit`` (what ``concurrent.futures`` uses, so it runs before
non-daemon threads are joined, before ``atexit`` handlers, and, being registered later,
before ``concurrent.futures`` shuts its executors down), closes the registered objects in
two rounds: ``first=True`` objects (each :class:`~inferscale.memory.Memory`: its encoder
stops after its current batch, then the engine it started) and then the rest (engines
opened on their own), newest first within a round. Queued KV jobs stay in the durable
queue and are encoded by the next process that opens the data dir.

An object is held weakly: one collected or closed before exit is skipped.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


_lock = threading.Lock()
_rounds: tuple[list[weakref.ref], list[weakref.ref]] = ([], [])
_installed = False
_done = False


def close_at_exit(obj: Closeable, *, first: bool = False) -> None:
    """Close ``obj`` (call its ``close()``) when the interpreter exits, if it is still alive.

    Args:
        obj: anything with an idempotent ``close()``; held by a weak reference.
        first: close it in the first round (objects that own others: a ``Memory`` closes
            its encoder, then the engine it started).
    """
    global _installed
    with _lock:
        if _done:
            return
        bucket = _rounds[0 if first else 1]
        bucket[:] = [r for r in bucket if r() is not None]  # drop the collected
        bucket.append(weakref.ref(obj))
        if not _installed:
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is None:
                    raise RuntimeError("no threading._register_atexit")
                register(close_all)
            except RuntimeError:  # an interpreter already shutting down, or a Python without it
                atexit.register(close_all)
            _installed = True


def exiting() -> bool:
    """Whether the interpreter's exit has begun closing the registered objects (nothing may be
    printed then: a notice of a slow close is for a ``close()`` a program calls itself)."""
    return _done


def close_all() -> None:
    """Close every registered object that is alive (first round, then the second; newest
    first in each). Called once at exit; a failure is logged and the others still close."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        rounds = [list(reversed(bucket)) for bucket in _rounds]
        for bucket in _rounds:
            bucket.clear()
    for refs in rounds:
        for ref in refs:
            obj = ref()
            if obj is None:
                continue
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - exiting must go on; the reason goes to the log
                logger.exception("closing %s at exit failed", type(obj).__name__)
