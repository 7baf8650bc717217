"""One front process of ``inferscale serve``: a :class:`inferscale.Memory` and the FastAPI app.

With ``--workers 1`` the front runs in the ``inferscale serve`` process itself
(:func:`open_front`). With ``--workers N`` uvicorn spawns N processes that share the
listening socket; each imports :func:`app_from_environment`, which reads the memory's
settings from the ``INFERSCALE_*`` variables the parent set
(:meth:`inferscale.config.MemoryConfig.environment`) and the vLLM servers to use from
``INFERSCALE_SERVE_WORKER`` (:class:`WorkerSpec`). The workers share the store through
Chroma's server and the SQL database, and see each other's writes on their next read
(the per-scope version, :mod:`inferscale.store.index`); the KV job queue in the data dir is
drained by all of them, each job by one (:mod:`inferscale.kv.jobs`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from inferscale.config import MemoryConfig
from inferscale.server.limits import FrontLimits

#: the environment variable that carries a :class:`WorkerSpec` to spawned workers
WORKER_ENV = "INFERSCALE_SERVE_WORKER"


@dataclass(frozen=True)
class WorkerSpec:
    """What a front process needs besides the memory settings.

    Attributes:
        url: where its vLLM requests go (``http://host:port``): a vLLM server, or vLLM's
            router in front of the replicas.
        served_model_name: the ``model`` name. api_key: the clients' and vLLM's key.
        replica_urls: the vLLM servers behind ``url`` when known (``/ready``, ``/metrics``).
        metrics_urls: more Prometheus endpoints for ``/metrics`` (the router's).
        limits: what the front reads of a request, and how long it waits (:class:`FrontLimits`).
    """

    url: str
    served_model_name: str
    api_key: str | None = None
    replica_urls: tuple[str, ...] = ()
    metrics_urls: tuple[str, ...] = ()
    limits: FrontLimits = field(default_factory=FrontLimits)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "replica_urls": list(self.replica_urls),
                           "metrics_urls": list(self.metrics_urls)})

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        return cls(d["url"], d["served_model_name"], d.get("api_key"), tuple(d.get("replica_urls", ())),
                   tuple(d.get("metrics_urls", ())), FrontLimits(**d.get("limits", {})))


@dataclass
class Front:
    """A front's app and what it opened (:meth:`close` closes the memory and its engine client)."""

    app: Any
    memory: Any
    engine: Any
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.memory.close()
            self.engine.close()


def open_front(config: MemoryConfig, spec: WorkerSpec, memory: Any = None, engine: Any = None) -> Front:
    """Build the front's app for ``spec``'s servers over ``memory`` (default: open one over
    ``config``'s store, with an :class:`~inferscale.server.upstream.HttpEngine` as ``engine``)."""
    from inferscale.memory import Memory
    from inferscale.server.app import create_app
    from inferscale.server.upstream import HttpEngine, Upstream

    if memory is None:
        engine = HttpEngine(spec.url, config.data_dir / "kv", spec.served_model_name, spec.api_key)
        memory = Memory(config, engine=engine)
    front = Front(None, memory, engine)
    upstream = Upstream(spec.url, spec.api_key, spec.served_model_name, spec.replica_urls, spec.metrics_urls)
    front.app = create_app(memory, upstream,
                           api_key=spec.api_key, on_close=front.close, limits=spec.limits)
    return front


def app_from_environment():
    """The app of a spawned worker (uvicorn's ``factory``): settings from the environment.

    Raises:
        RuntimeError: ``INFERSCALE_SERVE_WORKER`` is not set (this is started by ``inferscale serve``).
    """
    text = os.environ.get(WORKER_ENV)
    if not text:
        raise RuntimeError(f"{WORKER_ENV} is not set: worker processes are started by `inferscale serve --workers N`")
    return open_front(MemoryConfig(), WorkerSpec.from_json(text)).app
