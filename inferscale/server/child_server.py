"""A server ``inferscale serve`` runs as a child process: vLLM's OpenAI server
(:mod:`inferscale.server.vllm_process`) and vLLM's router (:mod:`inferscale.server.router_process`).

A child starts in a session of its own, so it and the processes it spawns (vLLM's engine
core) form one process group that :meth:`ChildServer.stop` ends together (SIGTERM, then
SIGKILL after a grace period); on Linux it also gets SIGTERM when its parent dies, even by
SIGKILL (``prctl(PR_SET_PDEATHSIG)``), so no child outlives ``inferscale serve``.
:class:`Supervisor` starts again, on its port, a child that exits while the front serves.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import httpx

from inferscale.server.ports import free_port

_PR_SET_PDEATHSIG = 1  # prctl(2)


class ChildStartError(RuntimeError):
    """A child server exited or did not become ready; the message carries its last log lines."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's stop() still ends the group
        pass


class ChildServer:
    """Start, watch and stop one HTTP server child on a loopback port.

    Subclasses set :attr:`command` (the argv) and may extend :meth:`child_environment`.

    Args:
        name: what messages call it (``"vLLM's server"``).
        port: loopback port (default: a free one).
        log_path: where the child's stdout and stderr go (appended; default: a temporary file).
        log_prefix: the temporary log file's name prefix.
        environment: variables for the child over this process's environment.
        health_path: the path that answers 200 once the child is ready.
        start_error: the exception class :meth:`wait_ready` raises.
    """

    command: list[str]

    def __init__(self, name: str, *, port: int | None = None, log_path: Path | None = None,
                 log_prefix: str = "inferscale-", environment: dict[str, str] | None = None,
                 health_path: str = "/health", start_error: type[ChildStartError] = ChildStartError) -> None:
        self.name = name
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        if log_path is None:
            fd, path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
            os.close(fd)
            log_path = Path(path)
        self.log_path = Path(log_path)
        self.environment = dict(environment or {})
        self.health_path = health_path
        self.start_error = start_error
        self._proc: subprocess.Popen | None = None

    def child_environment(self) -> dict[str, str]:
        """The variables set for the child over this process's environment."""
        return dict(self.environment)

    def start(self) -> None:
        """Start the child (returns at once; :meth:`wait_ready` waits for it)."""
        env = {**os.environ, **self.child_environment()}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the child's log."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 900.0, poll_s: float = 1.0) -> None:
        """Wait until :attr:`health_path` answers 200 (seconds: ``timeout``, polled every ``poll_s``).

        Raises:
            ChildStartError: (:attr:`start_error`) the child exited or ``timeout`` seconds
                passed (it is stopped then); the message ends with its log's last lines.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                code = None if self._proc is None else self._proc.returncode
                raise self.start_error(f"{self.name} exited with code {code} before it was ready "
                                       f"(log: {self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self.start_error(f"{self.name} was not ready after {timeout:.0f} s (log: {self.log_path}):\n"
                                       f"{self.log_tail()}")
            time.sleep(poll_s)

    def restart(self) -> int | None:
        """Start the child again on its port after it exited (what was left of its process
        group is stopped first). Returns the exit code it had."""
        code = None if self._proc is None else self._proc.poll()
        self.stop(grace_s=5.0)
        self.start()
        return code

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the child's process group, SIGKILL it after ``grace_s`` seconds (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; reap the rest of its group (the engine core) as well
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)


class Supervisor:
    """Start again the children of ``inferscale serve`` that exit while it serves.

    A thread checks every ``poll_s`` seconds; a child found exited is restarted on its
    port (vLLM's router passes a replica over until it answers again; the front answers
    503 with ``Retry-After`` while the router is away). :meth:`stop` before stopping them.

    Args:
        children: ``(name, child)`` pairs, started; the name is what the restart's line says
            (``"vLLM server 0"``). say: where the restarts are reported.
        poll_s: seconds between checks.
    """

    def __init__(self, children: Sequence[tuple[str, ChildServer]], say: Callable[[str], None] = print,
                 poll_s: float = 2.0) -> None:
        self.children = list(children)
        self.say = say
        self.poll_s = poll_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferscale-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name, child in self.children:
                if self._stop.is_set():
                    return
                if not child.running():
                    code = child.restart()
                    self.restarts += 1
                    self.say(f"{name} on {child.url} exited (code {code}); started it again (log: {child.log_path})")

    def stop(self) -> None:
        """Stop checking (waits for a restart in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
