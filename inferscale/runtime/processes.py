"""Whether a process of this machine still runs, by its pid: the one rule for every file
that names its owner by pid (pin files, capture spools, the KV queue's claims).

A zombie (a process that ended and that its parent has not reaped yet, state ``Z`` in
``/proc/<pid>/stat``, proc(5)) counts as gone: it runs no code and holds no file open,
and a SIGKILLed tree's pids stay zombies until their parent (often a notebook kernel's
manager, or init after a reparent) waits on them, which can be long after the next
process looks.
"""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after ``(comm)``, the first being field 3 (the state),
    or ``None`` when there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def start_ticks(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat``
    field 22, proc(5)), or ``None`` when there is no such process or no ``/proc``."""
    fields = _stat_fields(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine and is not a zombie.

    A process of another user is alive (``kill`` answers ``EPERM``); where there is no
    ``/proc``, a zombie cannot be told apart and counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    fields = _stat_fields(pid)
    return not (fields and fields[0] == "Z")
