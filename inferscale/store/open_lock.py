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

The file says who holds it: ``"<pid> <command>"``. A lock left by a dead process never blocks
(the kernel drops a ``flock`` with its process); a clean close removes the file
(:func:`unlock`). A child forked while a store is open inherits neither the hold nor the
right to open the store: its own ``Memory`` is refused, naming the parent (issue 53).
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
    f = take_file(path / OPEN_LOCK)
    if f is None:
        return None
    f.truncate(0)
    f.write(f"{os.getpid()} {command or _command()}")
    f.flush()
    return f


def take_file(path: Path) -> IO | None:
    """Open ``path`` (created when missing) and ``flock`` it exclusively, without waiting.

    The file that is locked is the one at ``path`` now: a holder that ends cleanly removes it
    (:func:`unlock`), and a process that opened it before then would otherwise hold a lock on a
    file no longer there; it opens the new one instead.

    Returns:
        The open, locked file, or ``None`` when another open file holds the lock.
    """
    for _ in range(10):
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()  # removed by the holder that just ended: lock the file there now
    return None


def unlock(f: IO, path: Path) -> None:
    """Remove the lock file ``f`` (held, at ``path``) and close it: a clean stop leaves nothing."""
    try:
        if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
            path.unlink()
    except (FileNotFoundError, ValueError):  # gone already, or f closed
        pass
    f.close()


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
            unlock(held[0], key / OPEN_LOCK)
            del _held[key]


def _forget_after_fork() -> None:
    """In a forked child: the parent's holds are not the child's (a new ``Memory`` of the child
    over the same store asks for the lock itself, and is refused while the parent holds it).
    The inherited files stay open: closing them would be harmless, but nothing needs it."""
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _command() -> str:
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:3] if sys.argv and sys.argv[0] else ["python"]
    return " ".join(argv)[:120]
