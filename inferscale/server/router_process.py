"""vLLM's router (PyPI ``vllm-router``, the vLLM project's Rust router) as a child of
``inferscale serve``, in front of several vLLM replicas.

The front sends each request that names a memory scope with the scope's routing key in
``X-User-ID`` (:func:`inferscale.server.upstream.routing_key`: a hash, never the user's
id); the router's ``consistent_hash`` policy hashes that header onto a ring of the
replicas (160 virtual nodes each), so every front, and a second router over the same
list, sends a scope to one replica while it lives, and a replica leaving or joining moves
only the scopes it held. Requests without the header are spread by the policy's fallback.

The settings below are the ones this project tuned and tested (tests/test_router.py, on
loopback, vllm-router 0.1.17): the router's health check probes every replica's
``/health`` each second and passes over one after two failures in a row, and takes it
back after one success, so a dead replica's users move within about 2 s and come back
about 1 s after it answers again. The circuit breaker is off: with it (vllm-router's
default) a replica's users stayed away 61 s after it came back. Its log runs at
``warning`` (``RUST_LOG=warn``): at ``info`` it logs every routing key.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from inferscale.server.child_server import ChildServer, ChildStartError
from inferscale.server.ports import free_port

#: seconds between the router's probes of each replica's ``/health``, the seconds one may
#: take, and the failed (successful) probes in a row that take a replica out of (back into) the ring
HEALTH_INTERVAL_S = 1
HEALTH_TIMEOUT_S = 5
HEALTH_FAILURES = 2
HEALTH_SUCCESSES = 1
#: the longest request the router lets run (seconds; the front's own read timeout is 600)
REQUEST_TIMEOUT_S = 900


class RouterStartError(ChildStartError):
    """vLLM's router is not installed, exited, or did not become ready."""


def router_executable() -> str:
    """The ``vllm-router`` command of this Python environment (or the ``PATH``'s).

    Raises:
        RouterStartError: vllm-router is not installed.
    """
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise RouterStartError("vLLM's router is not installed: several vLLM replicas are routed by it. Install it "
                               "with `pip install 'inferscale[router]'` (or `pip install vllm-router`), or give one "
                               "--vllm-url, or --router-url for a router you run")
    return found


def router_command(executable: str, worker_urls: Sequence[str], *, host: str, port: int, metrics_port: int,
                   startup_timeout_s: float, policy: str = "consistent_hash") -> list[str]:
    """vllm-router's argv for ``worker_urls`` (``http://host:port`` each), listening on
    ``host:port``, its Prometheus metrics on ``host:metrics_port``; it waits at most
    ``startup_timeout_s`` seconds for the workers' first ``/health``. ``policy`` other than
    ``consistent_hash`` is for comparisons (``inferscale bench router``)."""
    return [executable, "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--log-level", "warning",
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
            "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
            "--health-failure-threshold", str(HEALTH_FAILURES),
            "--health-success-threshold", str(HEALTH_SUCCESSES),
            "--disable-circuit-breaker",
            "--worker-startup-timeout-secs", str(int(startup_timeout_s)), "--worker-startup-check-interval", "1",
            "--request-timeout-secs", str(REQUEST_TIMEOUT_S)]


class RouterProcess(ChildServer):
    """vLLM's router over ``worker_urls`` as a child process group
    (:class:`~inferscale.server.child_server.ChildServer`), on a loopback port.

    Args:
        worker_urls: the vLLM replicas (``http://host:port``), ready or not (the router waits).
        port: its loopback port (default: a free one).
        log_path: its log (default: a temporary file).
        startup_timeout_s: most seconds it waits for the replicas' first ``/health``.
        policy: vllm-router's routing policy (``random`` only to compare with).

    Attributes:
        metrics_url: its Prometheus metrics (``http://127.0.0.1:<port>/metrics``).

    Raises:
        RouterStartError: vllm-router is not installed; ``worker_urls`` is empty.
    """

    def __init__(self, worker_urls: Sequence[str], *, port: int | None = None, log_path: Path | None = None,
                 startup_timeout_s: float = 900.0, policy: str = "consistent_hash") -> None:
        if not worker_urls:
            raise RouterStartError("vLLM's router needs at least one vLLM server to route to")
        super().__init__("vLLM's router", port=port, log_path=log_path, log_prefix="inferscale-router-",
                         start_error=RouterStartError)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        metrics_port = free_port(self.host)
        self.metrics_url = f"http://{self.host}:{metrics_port}/metrics"
        self.command = router_command(router_executable(), self.worker_urls, host=self.host, port=self.port,
                                      metrics_port=metrics_port, startup_timeout_s=startup_timeout_s, policy=policy)

    def child_environment(self) -> dict[str, str]:
        import os

        return {**self.environment, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # a user's own level wins
