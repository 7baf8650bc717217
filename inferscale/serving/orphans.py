"""vLLM's engine-core process ends with the process that started it, however that one ends.

vLLM's worker watches its engine core (a death pipe) and InferScale's capture writer watches the
worker (its input pipe), but the engine core does not watch its own parent: a script that used
``Memory.generate`` and was killed (SIGKILL, SIGTERM, a notebook kernel restarted) left vLLM's
EngineCore and Worker running as orphans, at a fifth of a core each, for as long as nobody
looked. :func:`die_with_parent`, called where InferScale's code first runs in the engine-core
process (the connector's scheduler side), waits on the parent's sentinel (``multiprocessing``'s
handle that becomes ready when the parent process is gone, on every platform) in a daemon
thread; when the parent is gone, it sends the process SIGTERM, which vLLM's engine core answers
by shutting down its workers, and exits outright ``grace_s`` seconds later if that has not
finished. A process that is not a ``multiprocessing`` child (the in-process engine of
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a process started some other way) is left alone.

A Ctrl-C is the owner's, not the engine's (:func:`leave_interrupts_to_the_owner`). A terminal
sends SIGINT to its whole foreground process group, and a notebook's "Interrupt" sends it to the
kernel's group (jupyter_client's ``LocalProvisioner.send_signal``): vLLM's engine core and worker
took it as a stop, so interrupting a cell killed the engine (the next cell got
``EngineDeadError``) and a script's Ctrl-C printed two screens of their tracebacks. vLLM's own
processes (``EngineCore*``, ``VllmWorker-*``, as vLLM names them) now ignore SIGINT: the owner
decides, and its end reaches them as its ``close()`` (at exit too), its server's SIGTERM, or the
watch above.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

#: seconds between the SIGTERM and the hard exit, when vLLM's own shutdown has not ended the process
GRACE_S = 15.0
_started = False
_lock = threading.Lock()


def die_with_parent(grace_s: float = GRACE_S) -> bool:
    """End this process when its ``multiprocessing`` parent ends (module docstring); once per process.

    Returns:
        Whether a watch runs (``False``: not a ``multiprocessing`` child, or already watching).
    """
    global _started
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    with _lock:
        if _started:
            return False
        _started = True
    threading.Thread(target=_watch, args=(parent.sentinel, parent.pid, grace_s), name="inferscale-parent-watch",
                     daemon=True).start()
    return True


#: the ``multiprocessing`` names vLLM gives its engine-core and worker processes
# (vllm/v1/engine/utils.py, vllm/v1/executor/multiproc_executor.py)
VLLM_PROCESS_PREFIXES = ("EngineCore", "VllmWorker-")


def leave_interrupts_to_the_owner() -> bool:
    """Ignore SIGINT in this process when it is one of vLLM's own (engine core or worker) and
    this is its main thread (module docstring); a no-op anywhere else (an in-process engine
    shares the user's process, whose Ctrl-C stays the user's).

    Returns:
        Whether SIGINT is now ignored here.
    """
    if not multiprocessing.current_process().name.startswith(VLLM_PROCESS_PREFIXES):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True


def _watch(sentinel: int, parent_pid: int | None, grace_s: float) -> None:
    multiprocessing.connection.wait([sentinel])
    logger.warning("the process that started vLLM's engine (pid %s) is gone: stopping the engine", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)
