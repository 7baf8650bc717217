"""The embedded store's open lock: one process at a time opens an embedded Chroma store.

Chroma's embedded store (``PersistentClient``) keeps its own view of the folder in the
process that opened it. When a second process writes the folder, the first one's reads and
writes fail from then on (``InternalError: Error finding id``) until it restarts, whether it
had written itself or only read (a hostile pass, stop 51: a parent ``Memory`` that only
searched broke after a child process added one memory). So every process that opens an
embedded store holds ``<data_dir>/chroma/inferscale-open.lock`` exclusively (``flock``) while
any of its :class:`~inferscale.memory.Memory` objects over it is open; the stores of one
process share that hold. ``inferscale reembed`` takes it too, and so never runs under an
open store. Processes that must share memories use ``inferscale serve`` (HTTP) or a Chroma
server (``chroma_url``), which has its own writer.

The file says who holds it: ``"<pid> <command>"``.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from pathlib import Path
from typing import IO

from inferscale.store.records import StoreError

OPEN_LOCK = "inferscale-open.lock"

#: the embedded stores this process has open: resolved Chroma folder -> [lock file, stores open]
_held: dict[Path, list] = {}
_guard = threading.Lock()


def lock_open(path: Path, command: str | None = None) -> IO | None:
    """Take the open lock of the embedded store in ``path`` exclusively, apart from any hold
    of this process (for a re-embed, which must not run under this process's stores either).

    Args:
        command: what the holder says it is (default: this process's command line).

    Returns:
        The open lock file (the lock ends when it is closed or the process ends), or ``None``
        when another open file holds it.
    """
    path.mkdir(parents=True, exist_ok=True)
    f = open(path / OPEN_LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"{os.getpid()} {command or _command()}")
    f.flush()
    return f


def holder(path: Path) -> str:
    """Who holds the open lock of the store in ``path``, as its file says (``"pid N (...)"``)."""
    try:
        said = (path / OPEN_LOCK).read_bytes().decode("utf-8", "replace").strip()
    except OSError:
        said = ""
    pid, _, command = said.partition(" ")
    return f"pid {pid} ({command})" if pid and command else "another process"


def hold(path: Path) -> Path:
    """Hold the embedded store in ``path`` open for this process (the first store of the
    process takes the lock; later ones share it).

    Returns:
        The key to give :func:`release`.

    Raises:
        StoreError: another process has the store open or is re-embedding it (naming it and
            the ways out); the folder cannot be written.
    """
    key = path.resolve()
    with _guard:
        held = _held.get(key)
        if held is not None and not held[0].closed:
            held[1] += 1
            return key
        try:
            f = lock_open(path)
        except PermissionError as exc:
            raise StoreError(f"cannot write the memory store at {path}: {exc}. Choose a writable data_dir.") from exc
        if f is None:
            raise StoreError(
                f"the data dir {path.parent} is open in {holder(path)}: its embedded store takes one process at a "
                "time (another process's writes break this one's view of it). Close it there, reach its memories over HTTP from "
                "`inferscale serve` (docs/server.md), or use a Chroma server (chroma_url, docs/deployment.md) for "
                "several processes")
        _held[key] = [f, 1]
        return key


def release(key: Path) -> None:
    """End one store's hold (:func:`hold`); the lock ends with the process's last."""
    with _guard:
        held = _held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            held[0].close()
            del _held[key]


def _command() -> str:
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:3] if sys.argv and sys.argv[0] else ["python"]
    return " ".join(argv)[:120]
