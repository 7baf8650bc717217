"""Dependency outages: which service an exception says is down, and one log line when an
outage starts and one when it ends.

A deployment leans on services that restart: a Chroma server, PostgreSQL, Redis and vLLM's
servers. While one is away, every call that needs it fails the same way, and a log line or a
traceback per failure drowns the log (a 30-second PostgreSQL restart under load gave 358 KV
job tracebacks). So failures are classified (:func:`dependency_of`) and reported to one
process-wide :class:`Outages`, which logs the first failure of an outage and one line saying
how long it lasted when it ends: when a probe of the service answers again
(:meth:`Outages.recheck`: Chroma's heartbeat, ``SELECT 1`` on PostgreSQL, run at most once a
second while it is down, after a request that succeeded) or a call to it succeeds
(:meth:`Outages.ok`). The server answers
such failures 503 with ``Retry-After`` naming the dependency
(:mod:`inferscale.server.errors`); the background encoder keeps the jobs queued without
counting the failure against them (:mod:`inferscale.kv.background`). The Redis KV tier
reads its outages as misses and never raises (:mod:`inferscale.kv.remote`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: What a dependency is called in logs and error messages.
NAMES = {"chroma": "the Chroma server", "postgresql": "PostgreSQL", "redis": "Redis", "vllm": "vLLM's server",
         "kv_disk": "the KV disk"}
#: Seconds a client is told to wait (``Retry-After``) before retrying a request a dependency failed.
RETRY_AFTER_S = 5


def _endpoint(url: str) -> str:
    parts = urlsplit(url if "//" in url else f"//{url}")
    return f"{(parts.hostname or '').lower()}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class Outages:
    """Process-wide outage bookkeeping; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, int]] = {}  # dependency -> (since, failed calls)
        self._endpoints: dict[str, str] = {}
        self._probes: dict[str, Callable[[], object]] = {}
        self._probed_at: dict[str, float] = {}

    def register_probe(self, dependency: str, probe: Callable[[], object]) -> None:
        """``probe()`` raises while ``dependency`` is down (:meth:`recheck` calls it)."""
        with self._lock:
            self._probes[dependency] = probe

    def recheck(self) -> None:
        """Probe each dependency in an outage (at most once a second each); those that answer
        end their outage (:meth:`ok`)."""
        now = time.monotonic()
        with self._lock:
            due = [(d, self._probes[d]) for d in self._down
                   if d in self._probes and now - self._probed_at.get(d, 0.0) >= 1.0]
            for d, _ in due:
                self._probed_at[d] = now
        for dependency, probe in due:
            try:
                probe()
            except Exception:  # noqa: BLE001 - still down, whatever it raised
                continue
            self.ok(dependency)

    def register(self, dependency: str, url: str) -> None:
        """Name the service at ``url`` (an HTTP one: a Chroma server), so an ``httpx`` error
        from it is classified as ``dependency``; other ``httpx`` errors are vLLM's."""
        with self._lock:
            self._endpoints[_endpoint(url)] = dependency

    def dependency_of(self, exc: BaseException) -> str | None:
        """``"chroma"``, ``"postgresql"``, ``"redis"`` or ``"vllm"`` when ``exc`` (or an
        exception it was raised from) says that service cannot be reached, ``"kv_disk"`` when
        the KV pool's disk has no room (:class:`inferscale.kv.disk.DiskFullError`); else ``None``."""
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            found = self._one(exc)
            if found:
                return found
            exc = exc.__cause__ or exc.__context__
        return None

    def _one(self, exc: BaseException) -> str | None:
        module = type(exc).__module__ or ""
        name = type(exc).__name__
        if module.startswith("sqlalchemy") and name in ("OperationalError", "InterfaceError", "DisconnectionError"):
            orig = getattr(exc, "orig", None)
            return "postgresql" if orig is not None and type(orig).__module__.startswith("psycopg") else None
        if module.startswith("psycopg") and name in ("OperationalError", "InterfaceError"):
            return "postgresql"
        if module.startswith("redis") and name in ("ConnectionError", "TimeoutError", "BusyLoadingError"):
            return "redis"
        if module.startswith("httpx") and name in ("ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout",
                                                    "WriteError", "RemoteProtocolError", "PoolTimeout", "NetworkError"):
            try:
                url = str(exc.request.url)  # type: ignore[attr-defined]
            except (AttributeError, RuntimeError):  # no request attached
                return "vllm"
            with self._lock:
                return self._endpoints.get(_endpoint(url), "vllm")
        if name == "DiskFullError" and module == "inferscale.kv.disk":  # no room for KV: requests use text
            return "kv_disk"
        if isinstance(exc, ValueError) and "Could not connect to a Chroma server" in str(exc):
            return "chroma"
        return None

    def failed(self, dependency: str, exc: BaseException) -> bool:
        """Count a failed call; the first of an outage is logged (one warning). Returns
        whether it was the first."""
        with self._lock:
            since, count = self._down.get(dependency, (time.monotonic(), 0))
            self._down[dependency] = (since, count + 1)
            first = count == 0
        if first and dependency == "kv_disk":
            log.warning("%s is full (%s); memories are served as text and KV encodes wait until it has room",
                        NAMES[dependency], str(exc)[:300])
        elif first:
            log.warning("%s is not answering (%s: %s); requests that need it are answered 503 with Retry-After "
                        "until it is back", NAMES.get(dependency, dependency), type(exc).__name__,
                        str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "")
        return first

    def ok(self, *dependencies: str) -> None:
        """Calls to ``dependencies`` (default: every one down) succeeded: each outage among
        them ends, with one log line."""
        with self._lock:
            names = dependencies or tuple(self._down)
            ended = [(d, *self._down.pop(d)) for d in names if d in self._down]
        for dependency, since, count in ended:
            if dependency == "kv_disk":
                log.warning("the KV disk has room again after %.0f s", time.monotonic() - since)
                continue
            log.warning("%s answers again after %.0f s (%d failed call%s meanwhile)", NAMES.get(dependency, dependency),
                        time.monotonic() - since, count, "" if count == 1 else "s")

    def down(self) -> dict[str, float]:
        """Dependencies in an outage now, with its length so far (seconds)."""
        now = time.monotonic()
        with self._lock:
            return {d: now - since for d, (since, _) in self._down.items()}


#: The process's outages (the front's workers and the background encoder share it).
OUTAGES = Outages()
