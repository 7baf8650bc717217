"""``inferscale serve``: start (or join) vLLM's OpenAI servers, open the memory, serve HTTP.

Order of start-up, each step failing with a clear message before the next: the front's
port is free; the model resolves; ``replicas`` vLLM servers start (each its own process
group, our connector, prefix caching on, one shared KV pool folder) and answer
``/health`` (or, with ``vllm_urls``, servers already running do); with several, vLLM's
router starts in front of them (:mod:`inferscale.server.router_process`; or, with
``router_url``, one already running routes); the front serves with
uvicorn: in this process over one :class:`inferscale.Memory` (``workers=1``), or as
``workers`` uvicorn worker processes sharing the port, each with its own ``Memory``
over the same store (:mod:`inferscale.server.worker`; that needs Chroma as a server,
since the embedded store is one process's). A vLLM server this command started that
or router this command started that exits is started again on its port; uvicorn starts a
worker that dies again. Ctrl-C or SIGTERM stops the front, closes the memory (queued KV
encodes stay queued for the next start) and stops the servers this command started.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from inferscale.config import MemoryConfig
from inferscale.kv.injection import REPLICA_ENV
from inferscale.server.limits import FrontLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """What ``inferscale serve`` was asked for.

    Attributes:
        host, port: where the front listens (loopback by default).
        vllm_urls: running vLLM servers to front instead of starting them (replicas of
            one model; with several, vLLM's router is started in front of them).
        router_url: a running vLLM router to send every request to (``vllm_urls`` then
            name the replicas behind it, for ``/ready`` and ``/metrics``; optional).
        replicas: how many vLLM servers to start when ``vllm_urls`` is empty.
        workers: front processes (uvicorn workers on one port); more than one needs
            ``chroma_url`` (docs/deployment.md).
        api_key: required of every client when set (and of the front by a vLLM it starts).
        served_model_name: the ``model`` name (default: from the model).
        vllm_start_timeout_s: most seconds vLLM may take to become ready.
        max_num_seqs: most requests vLLM batches at once.
        tool_call_parser: vLLM's tool-call parser for a server this command starts
            (``None``: tool calls refused).
        limits: what the front reads of a request before and after the key, and how long
            it waits (:class:`~inferscale.server.limits.FrontLimits`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    vllm_urls: tuple[str, ...] = ()
    router_url: str | None = None
    replicas: int = 1
    workers: int = 1
    api_key: str | None = None
    served_model_name: str | None = None
    vllm_start_timeout_s: float = 900.0
    max_num_seqs: int = 64
    tool_call_parser: str | None = "hermes"
    limits: FrontLimits = field(default_factory=FrontLimits)

    def check(self, config: MemoryConfig) -> None:
        """Raises:
            ValueError: ``workers`` or ``replicas`` below 1, ``replicas`` with ``vllm_urls``
                or ``router_url``, a ``router_url`` that is not an HTTP URL, several
                workers over the embedded Chroma store, a tool-call parser vLLM does not
                have, or a vLLM cache too small for one request of ``max_model_len``.
            inferscale.server.router_process.RouterStartError: several servers to route
                and vllm-router is not installed.
        """
        if self.workers < 1 or self.replicas < 1:
            raise ValueError(f"--workers and --replicas must be at least 1, got {self.workers} and {self.replicas}")
        if self.vllm_urls and self.replicas != 1:
            raise ValueError("--replicas starts vLLM servers; with --vllm-url give each running server's URL instead")
        if self.router_url is not None and self.replicas != 1:
            raise ValueError("--replicas starts vLLM servers and a router; with --router-url the router you run "
                             "routes to the servers you run (name them with --vllm-url for /ready and /metrics)")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"--router-url must be an http:// or https:// URL, got {self.router_url!r}")
        urls = [u.rstrip("/") for u in self.vllm_urls]
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"--vllm-url {twice[0]} is given more than once: give each vLLM server once")
        if self.workers > 1 and config.chroma_url is None:
            raise ValueError(f"--workers {self.workers} needs Chroma as a server: the embedded store in the data dir "
                             "is one process's. Start `chroma run --path <dir> --port 8001` and set "
                             "INFERSCALE_CHROMA_URL=http://127.0.0.1:8001 (docs/deployment.md), or use --workers 1")
        if self.router_url is None and (self.replicas > 1 or len(self.vllm_urls) > 1):
            from inferscale.server.router_process import router_executable

            router_executable()  # several servers are routed by vLLM's router: is it installed?
        if not self.vllm_urls and self.router_url is None:  # the servers this starts must hold one request (vLLM says so only after a minute)
            from inferscale.models.kv_shape import check_kv_cache_fits
            from inferscale.models.resolve import resolve_llm

            check_kv_cache_fits(resolve_llm(config.llm), config.resolved_dtype, config.max_model_len,
                                config.kv_cache_memory_bytes)
        if self.tool_call_parser is not None and not self.vllm_urls and self.router_url is None:
            from inferscale.serving.vllm_compat import tool_call_parsers  # imports vLLM: seconds

            if self.tool_call_parser not in tool_call_parsers():
                raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not one of vLLM's: "
                                 f"{', '.join(tool_call_parsers())} (or 'none')")


def served_name(config: MemoryConfig, model_path: Path) -> str:
    """The model name clients send: a Hugging Face id as given, else the model folder's name."""
    llm = config.llm
    if "/" in llm and not llm.startswith("pypi:") and not Path(llm).expanduser().exists():
        return llm
    return model_path.name


class _Stop(Exception):
    pass


def lock_data_dir(data_dir: Path):
    """Hold ``<data_dir>/serve.lock`` for this process's life (:func:`inferscale.store.serve_lock.hold`).

    Returns:
        The open lock file (keep a reference).

    Raises:
        RuntimeError: another ``inferscale serve`` holds it (naming its pid).
    """
    from inferscale.store import serve_lock

    try:
        return serve_lock.hold(data_dir)
    except serve_lock.DataDirServed as exc:
        raise RuntimeError(f"another {exc.command} (pid {exc.pid}) is serving {data_dir}: one server per data "
                           "dir (it is the store's writer); stop it or choose another --data-dir") from None


def _fresh_log(path: Path) -> Path:
    """``path``, after moving an earlier run's log to ``<path>.1``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))
    return path


def serve(config: MemoryConfig, options: ServeOptions, say: Callable[[str], None] = print) -> None:
    """Run the server until Ctrl-C or SIGTERM.

    Raises:
        OSError: the front's port is in use.
        ValueError: options that do not fit together (:meth:`ServeOptions.check`).
        inferscale.models.resolve.ModelNotFoundError: the model cannot be found.
        inferscale.server.vllm_process.VLLMStartError: vLLM's server could not start.
        RuntimeError: a ``vllm_urls`` server does not answer; another server holds the data dir.
    """
    import os

    from inferscale.server.ports import listen_on

    # the port first, held from here on: a second server on it fails now, in about a second,
    # not after a minute of starting vLLM (even one started a moment later, before uvicorn
    # runs); then the data dir's lock when the dir exists (another server may hold it), else
    # after the options (the tool-call parser's check imports vLLM: seconds), so a refused
    # option leaves no data dir behind
    sock = listen_on(options.host, options.port)
    try:
        existed = config.data_dir.is_dir()
        lock = lock_data_dir(config.data_dir) if existed else None  # noqa: F841  (held until exit)
        options.check(config)
        if not existed:
            lock = lock_data_dir(config.data_dir)  # noqa: F841
    except BaseException:
        sock.close()
        raise

    import uvicorn

    from inferscale.memory import Memory
    from inferscale.models.resolve import resolve_llm
    from inferscale.server.limits import uvicorn_config
    from inferscale.server.child_server import ChildServer, Supervisor
    from inferscale.server.upstream import HttpEngine
    from inferscale.server.router_process import RouterProcess
    from inferscale.server.vllm_process import VLLMProcess
    from inferscale.server.worker import WORKER_ENV, WorkerSpec, open_front
    model_path = resolve_llm(config.llm)
    name = options.served_model_name or served_name(config, model_path)
    kv_dir = config.data_dir / "kv"
    # the store opens before vLLM starts, so its errors come first (and once, not once per worker)
    engine = HttpEngine(None, kv_dir, name, options.api_key)  # its server is set once it answers
    try:
        memory = Memory(config, engine=engine)
    except BaseException:
        sock.close()
        if lock is not None:
            from inferscale.store import serve_lock

            serve_lock.release(config.data_dir)  # a refused start leaves no lock behind
        raise
    if options.workers > 1:
        memory.close()
        engine.close()
    started: list[tuple[str, ChildServer]] = []  # (what the supervisor calls it, the child)
    supervisor: Supervisor | None = None
    front = None

    def stop(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        router_metrics: tuple[str, ...] = ()
        if not options.vllm_urls and options.router_url is None:
            shares = _device_shares(options.replicas)
            servers = []
            for i in range(options.replicas):
                log = "vllm.log" if i == 0 else f"vllm-{i}.log"
                servers.append(VLLMProcess(
                    model_path, served_model_name=name, kv_dir=kv_dir, dtype=config.resolved_dtype,
                    max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                    device_budget_bytes=config.device_kv_budget_bytes, max_num_seqs=options.max_num_seqs,
                    api_key=options.api_key, tool_call_parser=options.tool_call_parser,
                    log_path=_fresh_log(config.data_dir / "logs" / log),
                    environment={**shares[i], REPLICA_ENV: str(i),
                                 **({"INFERSCALE_KV_REDIS_URL": config.kv_redis_url} if config.kv_redis_url else {})}))
            for i, vllm in enumerate(servers):
                what = "vLLM's OpenAI server" if len(servers) == 1 else f"vLLM replica {i}"
                say(f"starting {what} for {name} on {vllm.url} (log: {vllm.log_path}) ...")
                vllm.start()
                started.append((f"vLLM server {i}", vllm))
            for vllm in servers:
                vllm.wait_ready(options.vllm_start_timeout_s)
            replica_urls = tuple(v.url for v in servers)
        else:
            replica_urls = tuple(u.rstrip("/") for u in options.vllm_urls)
            asked = replica_urls or (options.router_url.rstrip("/"),)
            name = options.served_model_name or _running_model(asked, options.api_key)
        if options.router_url is not None:
            url = options.router_url.rstrip("/")
        elif len(replica_urls) > 1:
            router = RouterProcess(replica_urls, log_path=_fresh_log(config.data_dir / "logs" / "router.log"),
                                   startup_timeout_s=options.vllm_start_timeout_s)
            say(f"starting vLLM's router over {len(replica_urls)} vLLM servers on {router.url} "
                f"(log: {router.log_path}) ...")
            router.start()
            router.wait_ready(60.0)
            started.append(("vLLM's router", router))
            url, router_metrics = router.url, (router.metrics_url,)
        else:
            url = replica_urls[0]
        if started:
            supervisor = Supervisor(started, say)
            supervisor.start()
        spec = WorkerSpec(url=url, served_model_name=name, api_key=options.api_key, replica_urls=replica_urls,
                          metrics_urls=router_metrics, limits=options.limits)
        where = f"http://{options.host}:{options.port}"
        if options.workers == 1:
            engine.point_at(url, name)
            front = open_front(config, spec, memory=memory, engine=engine)
            say(f"InferScale is serving {name} with memory from {config.data_dir} on {where} "
                "(OpenAI API under /v1, docs at /docs)")
            # uvicorn handles SIGTERM / Ctrl-C itself and raises the signal again once it has
            # stopped: the handler above then ends this function through ``finally``
            uvicorn.Server(uvicorn_config(front.app, options.limits, host=options.host, port=options.port,
                                          log_level="warning", timeout_graceful_shutdown=10)).run(sockets=[sock])
        else:
            # the workers are spawned processes: they read their settings from the environment
            os.environ.update(config.environment())
            os.environ[WORKER_ENV] = spec.to_json()
            say(f"InferScale is serving {name} with memory from {config.data_dir} on {where} with "
                f"{options.workers} workers and {max(len(replica_urls), 1)} vLLM server(s) (OpenAI API under /v1, "
                "docs at /docs)")
            _run_workers(options, sock)
    except (_Stop, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        if front is not None:
            front.close()
        elif options.workers == 1:
            memory.close()
            engine.close()
        if supervisor is not None:
            supervisor.stop()
        if started:
            say("stopping vLLM's server ..." if len(started) == 1 else f"stopping {len(started)} servers "
                "(vLLM's and its router) ...")
            threads = [threading.Thread(target=child.stop) for _, child in started]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if lock is not None:
            from inferscale.store import serve_lock

            serve_lock.release(config.data_dir)  # a clean stop leaves no serve.lock
    say("InferScale stopped")  # only after a stop asked for: an error propagates past this line


def _device_shares(replicas: int) -> list[dict[str, str]]:
    """Per replica, its engine's extra environment when several share one machine: on CUDA
    its own GPU (``CUDA_VISIBLE_DEVICES``, :func:`~inferscale.server.vllm_process.gpu_shares`),
    on a CPU its own share of the cores (``VLLM_CPU_OMP_THREADS_BIND``,
    :func:`~inferscale.server.vllm_process.cpu_shares`). A binding the user set for the
    cores wins; a user's ``CUDA_VISIBLE_DEVICES`` is split among the replicas."""
    import os

    import torch

    from inferscale.server.vllm_process import cpu_shares, gpu_shares

    if replicas == 1:
        return [{}]
    if torch.cuda.is_available():
        shares = gpu_shares(replicas, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        return [{"CUDA_VISIBLE_DEVICES": g} for g in shares]
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [{} for _ in range(replicas)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": share} for share in cpu_shares(replicas)]


def _supervisor_events(record: logging.LogRecord) -> bool:
    """uvicorn's supervisor messages worth a line at our quiet log level: warnings, and a
    worker that died (uvicorn then starts another) or failed to start."""
    message = record.getMessage()
    return record.levelno >= logging.WARNING or " died" in message or "failed to start" in message


def _run_workers(options: ServeOptions, sock) -> None:
    """uvicorn's multi-process supervisor over :func:`~inferscale.server.worker.app_from_environment`
    (what ``uvicorn.run(..., workers=N)`` does, keeping the workers to read their exit codes),
    on ``sock``, the front's listening socket.

    Raises:
        RuntimeError: a worker failed to start (uvicorn then stops them all).
    """
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    from inferscale.server.limits import uvicorn_config
    from inferscale.server.worker import app_from_environment

    config = uvicorn_config(f"{app_from_environment.__module__}:{app_from_environment.__name__}", options.limits,
                            factory=True, workers=options.workers, host=options.host, port=options.port,
                            log_level="warning", timeout_graceful_shutdown=10)
    events = logging.getLogger("uvicorn.error")  # the supervisor's logger (in this process only)
    events.setLevel(logging.INFO)
    events.addFilter(_supervisor_events)
    supervisor = Multiprocess(config, sockets=[sock])  # the workers inherit the listening socket
    supervisor.run()
    if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes):
        raise RuntimeError("a worker could not start (its error is above), so the server stopped")


def _running_model(urls: tuple[str, ...], api_key: str | None) -> str:
    """The model ``urls`` serve (``/v1/models`` of each).

    Raises:
        RuntimeError: a server does not answer, or they serve different models.
    """
    import httpx

    from inferscale.checks import first_line
    from inferscale.server.upstream import auth_headers

    headers = auth_headers(api_key)
    names = []
    for url in urls:
        try:
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
            r.raise_for_status()
            names.append(r.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise RuntimeError(f"the vLLM server at {url} does not answer /v1/models ({first_line(exc)}); start it as "
                               "docs/server.md shows, or leave out --vllm-url") from None
    if len(set(names)) > 1:
        raise RuntimeError(f"the vLLM servers serve different models ({', '.join(names)}): replicas must serve one")
    return names[0]
