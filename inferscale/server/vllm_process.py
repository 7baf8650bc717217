"""vLLM's own OpenAI server as a child process of ``inferscale serve``.

The child runs ``python -m vllm.entrypoints.openai.api_server`` with InferScale's KV
connector (:func:`inferscale.serving.vllm_compat.openai_server_command`) on a loopback
port. It starts in a session of its own, so it and the engine-core process it spawns
form one process group that :meth:`VLLMProcess.stop` ends together (SIGTERM, then
SIGKILL after a grace period); on Linux it also gets SIGTERM when its parent dies, even
by SIGKILL, so no server outlives ``inferscale serve``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import httpx

from inferscale.server.ports import free_port

_PR_SET_PDEATHSIG = 1  # prctl(2)


class VLLMStartError(RuntimeError):
    """vLLM's server exited or did not become ready; the message carries its last log lines."""


def cpu_shares(n: int) -> list[str]:
    """This process's CPU cores split into ``n`` contiguous shares, as values of vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` (``"0,1"``): one per vLLM replica on a CPU machine, so the
    replicas' OpenMP threads do not spin on each other's cores. With fewer cores than
    replicas, replica ``i`` gets core ``i mod cores``."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < n:
        return [str(cores[i % len(cores)]) for i in range(n)]
    size, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(",".join(map(str, cores[start:end])))
        start = end
    return out


def gpu_shares(n: int, visible: str | None, count: int) -> list[str]:
    """The GPU of each of ``n`` replicas, as values of ``CUDA_VISIBLE_DEVICES``: replica ``i``
    gets the ``i mod g``-th of the GPUs this process may use (``visible``, the user's own
    ``CUDA_VISIBLE_DEVICES``, else the ``count`` devices torch sees)."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return [ids[i % len(ids)] for i in range(n)] if ids else ["" for _ in range(n)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's stop() still ends the group
        pass


class VLLMProcess:
    """Start, watch and stop vLLM's OpenAI server.

    Args:
        model_path: the served model's local folder.
        served_model_name: the ``model`` name clients use.
        kv_dir: the data dir's KV pool folder (the connector reads fact KV there).
        dtype, max_model_len (tokens), kv_cache_memory_bytes, device_budget_bytes,
            max_num_seqs: engine settings (:func:`~inferscale.serving.vllm_compat.engine_kwargs`).
        api_key: required of the server's clients (passed as ``VLLM_API_KEY``).
        tool_call_parser: vLLM's tool-call parser (``None``: tool calls refused).
        port: loopback port (default: a free one).
        log_path: where the child's stdout and stderr go (appended; default: a temporary file).
        environment: variables for the child over this process's environment and InferScale's
            engine defaults (e.g. its share of the machine's cores or GPUs).
    """

    def __init__(self, model_path: Path, *, served_model_name: str, kv_dir: Path, dtype: str, max_model_len: int,
                 kv_cache_memory_bytes: int, device_budget_bytes: int, max_num_seqs: int = 64,
                 api_key: str | None = None, port: int | None = None, log_path: Path | None = None,
                 tool_call_parser: str | None = "hermes", environment: dict[str, str] | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        self.api_key = api_key
        from inferscale.serving.vllm_compat import openai_server_command  # imports vLLM: only where one starts

        self.command = openai_server_command(
            sys.executable, model_path, served_model_name=served_model_name, host=self.host, port=self.port,
            dtype=dtype, kv_dir=kv_dir, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
            device_budget_bytes=device_budget_bytes, max_num_seqs=max_num_seqs, tool_call_parser=tool_call_parser,
        )
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="inferscale-vllm-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen | None = None
        self.environment = dict(environment or {})

    def start(self) -> None:
        """Start the child (returns at once; :meth:`wait_ready` waits for it)."""
        from inferscale.serving.vllm_compat import engine_environment

        env = {**os.environ, **engine_environment(verbose=True), **self.environment}  # its log keeps vLLM's output
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
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
        """Wait until ``/health`` answers 200.

        Raises:
            VLLMStartError: the child exited (e.g. the model cannot load) or ``timeout``
                seconds passed; the message ends with its log's last lines.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                code = None if self._proc is None else self._proc.returncode
                raise VLLMStartError(f"vLLM's server exited with code {code} before it was ready "
                                     f"(log: {self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMStartError(f"vLLM's server was not ready after {timeout:.0f} s (log: {self.log_path}):\n"
                                     f"{self.log_tail()}")
            time.sleep(poll_s)

    def restart(self) -> int | None:
        """Start the server again on its port after it exited (what was left of its process
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


class ReplicaSupervisor:
    """Start again the vLLM servers of ``inferscale serve`` that exit while it serves.

    A thread checks every ``poll_s`` seconds; a server found exited is restarted on its
    port (the front's router passes it over until it answers again). :meth:`stop` before
    stopping the servers.

    Args:
        processes: the servers (started). say: where the restarts are reported.
        poll_s: seconds between checks.
    """

    def __init__(self, processes: Sequence[VLLMProcess], say: Callable[[str], None] = print,
                 poll_s: float = 2.0) -> None:
        self.processes = list(processes)
        self.say = say
        self.poll_s = poll_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inferscale-vllm-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            for i, process in enumerate(self.processes):
                if self._stop.is_set():
                    return
                if not process.running():
                    code = process.restart()
                    self.restarts += 1
                    self.say(f"vLLM server {i} on {process.url} exited (code {code}); started it again "
                             f"(log: {process.log_path})")

    def stop(self) -> None:
        """Stop checking (waits for a restart in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
