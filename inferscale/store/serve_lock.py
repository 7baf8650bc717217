"""``<data_dir>/serve.lock``: the one ``inferscale serve`` (or ``inferscale mcp``) that writes a
data dir holds it (``flock``, released when its process ends, even on SIGKILL); others check
it. The file says who holds it: ``"<pid> <command>"``. A lock left by a dead process never
blocks (the kernel drops the ``flock``); a clean stop removes the file (:func:`release`); a
forked child does not inherit its parent's hold."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

from inferscale.store.open_lock import take_file, unlock

LOCK_FILE = "serve.lock"
#: the data dirs whose lock this process took (resolved) -> the open lock file: while it is
#: open, this process's own stores may open the data dir (:func:`check_free`'s ``own_ok``)
_held: dict[Path, IO] = {}


class DataDirServed(RuntimeError):
    """Another process holds the data dir's serve lock.

    Attributes:
        pid: the holder's process id as it wrote it (``"?"`` when unreadable).
        command: the holder's command (``"inferscale serve"`` when it wrote none).
    """

    def __init__(self, data_dir: Path, pid: str, command: str = "inferscale serve") -> None:
        super().__init__(f"an {command} (pid {pid}) is serving {data_dir}")
        self.pid = pid
        self.command = command


#: tries to take a busy lock before giving up, a pause apart (seconds): a :func:`check_free`
#: holds it for a moment, which must not refuse a server starting then
_TRIES, _PAUSE_S = 5, 0.02


def _take(f: IO, data_dir: Path, tries: int = 1) -> None:
    for attempt in range(tries):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if attempt + 1 < tries:
                time.sleep(_PAUSE_S)
    f.seek(0)
    said = f.buffer.read().decode("utf-8", "replace").strip()  # whatever bytes it holds
    pid, _, command = said.partition(" ")
    raise DataDirServed(data_dir, pid or "?", command or "inferscale serve") from None


def hold(data_dir: Path, command: str = "inferscale serve") -> IO:
    """Take the lock for this process's life (creating the data dir) and write our pid and
    ``command`` in it.

    Returns:
        The open lock file (keep a reference).

    Raises:
        DataDirServed: another process holds it.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(_TRIES):
        f = take_file(data_dir / LOCK_FILE)
        if f is not None:
            break
        if attempt + 1 < _TRIES:
            time.sleep(_PAUSE_S)
    else:
        with open(data_dir / LOCK_FILE, "a+") as busy:
            _take(busy, data_dir)  # raises DataDirServed naming the holder
        return hold(data_dir, command)  # freed just now
    f.truncate(0)
    f.write(f"{os.getpid()} {command}")
    f.flush()
    _held[data_dir.resolve()] = f
    return f


def release(data_dir: Path) -> None:
    """End this process's hold of ``data_dir`` (:func:`hold`) and remove the lock file: a clean
    stop leaves no ``serve.lock`` behind."""
    f = _held.pop(Path(data_dir).resolve(), None)
    if f is not None:
        unlock(f, Path(data_dir) / LOCK_FILE)


def check_free(data_dir: Path, *, own_ok: bool = False) -> None:
    """Raise :class:`DataDirServed` while the lock is held (nothing else changes).

    Args:
        own_ok: let a lock this process holds (:func:`hold`, its file still open) through: a
            server's own stores open its data dir.
    """
    path = Path(data_dir) / LOCK_FILE
    if not path.is_file():
        return
    mine = _held.get(Path(data_dir).resolve())
    if own_ok and mine is not None and not mine.closed:
        return
    try:
        f = open(path, "r+")  # never created here: a server that stopped cleanly removed it
    except FileNotFoundError:
        return
    with f:
        _take(f, data_dir)
        fcntl.flock(f, fcntl.LOCK_UN)


os.register_at_fork(after_in_child=_held.clear)  # a forked child does not hold its parent's data dir
