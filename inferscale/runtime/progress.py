"""One line on stderr for every wait longer than a moment: vLLM's engine starting, KV being made.

A newcomer's script used to wait two silent minutes for its first answer (issue 56). These
notices go through the ``inferscale.progress`` logger at INFO, which writes
``inferscale: <message>`` to the ``sys.stderr`` of the moment (so pytest's and Jupyter's
captures see it) and does not propagate. Silence them the standard way::

    logging.getLogger("inferscale.progress").setLevel(logging.WARNING)

or route them elsewhere by replacing the logger's handlers. Nothing here prints at exit.
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

#: The logger every notice goes through.
LOGGER_NAME = "inferscale.progress"
#: seconds a wait may last before it is said (issue 56: "every wait longer than two seconds")
SLOW_S = 2.0


class _StderrNow(logging.StreamHandler):
    """A stream handler over whatever ``sys.stderr`` is when a record is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _logger() -> logging.Logger:
    log = logging.getLogger(LOGGER_NAME)
    if not log.handlers:
        handler = _StderrNow()
        handler.setFormatter(logging.Formatter("inferscale: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log


def notice(message: str, *args: object) -> None:
    """Write one notice line (``%``-style ``args``, as :mod:`logging` takes them)."""
    _logger().info(message, *args)


@contextmanager
def when_slow(message: str, *args: object, after_s: float = SLOW_S) -> Iterator[None]:
    """Say ``message`` once if the block is still running ``after_s`` seconds after it began
    (a daemon timer; nothing is said when it ends sooner, nor once the interpreter's exit has
    begun closing what is open: nothing is printed at exit, :func:`inferscale.runtime.lifecycle.exiting`)."""
    from inferscale.runtime.lifecycle import exiting

    def say() -> None:
        if not exiting():
            notice(message, *args)

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
