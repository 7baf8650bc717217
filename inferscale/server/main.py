"""``inferscale serve``: start (or join) vLLM's OpenAI server, open the memory, serve HTTP.

Order of start-up, each step failing with a clear message before the next: the front's
port is free; the model resolves; vLLM's server starts (its own process group, our
connector, prefix caching on) and answers ``/health`` (or, with ``vllm_url``, one that
is already running does); the :class:`inferscale.Memory` opens over the data dir; uvicorn
serves the front. Ctrl-C or SIGTERM stops uvicorn, closes the memory (queued KV encodes
stay queued for the next start) and stops the vLLM server this command started.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from inferscale.config import MemoryConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """What ``inferscale serve`` was asked for.

    Attributes:
        host, port: where the front listens (loopback by default).
        vllm_url: a running vLLM server to front instead of starting one.
        api_key: required of every client when set (and of the front by a vLLM it starts).
        served_model_name: the ``model`` name (default: from the model).
        vllm_start_timeout_s: most seconds vLLM may take to become ready.
        max_num_seqs: most requests vLLM batches at once.
        tool_call_parser: vLLM's tool-call parser for a server this command starts
            (``None``: tool calls refused).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    vllm_url: str | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    vllm_start_timeout_s: float = 900.0
    max_num_seqs: int = 64
    tool_call_parser: str | None = "hermes"


def served_name(config: MemoryConfig, model_path: Path) -> str:
    """The model name clients send: a Hugging Face id as given, else the model folder's name."""
    llm = config.llm
    if "/" in llm and not llm.startswith("pypi:") and not Path(llm).expanduser().exists():
        return llm
    return model_path.name


class _Stop(Exception):
    pass


def lock_data_dir(data_dir: Path):
    """Hold ``<data_dir>/serve.lock`` for this process's life (released at exit, even on SIGKILL).

    Returns:
        The open lock file (keep a reference).

    Raises:
        RuntimeError: another ``inferscale serve`` holds it (naming its pid).
    """
    import fcntl
    import os

    data_dir.mkdir(parents=True, exist_ok=True)
    f = open(data_dir / "serve.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RuntimeError(f"another inferscale serve (pid {holder}) is serving {data_dir}: one server per data "
                           "dir (it is the store's writer); stop it or choose another --data-dir") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


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
        inferscale.models.ModelNotFoundError: the model cannot be found.
        inferscale.server.vllm_process.VLLMStartError: vLLM's server could not start.
        RuntimeError: ``vllm_url`` does not answer; another server holds the data dir.
    """
    import httpx
    import uvicorn

    from inferscale.memory import Memory
    from inferscale.models import resolve_llm
    from inferscale.server.app import create_app
    from inferscale.server.upstream import HttpEngine, Upstream
    from inferscale.server.vllm_process import VLLMProcess, check_port_free

    check_port_free(options.host, options.port)
    lock = lock_data_dir(config.data_dir)  # noqa: F841  (held until this process exits)
    model_path = resolve_llm(config.llm)
    name = options.served_model_name or served_name(config, model_path)
    kv_dir = config.data_dir / "kv"
    vllm: VLLMProcess | None = None
    memory = None

    def stop(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if options.vllm_url is None:
            vllm = VLLMProcess(model_path, served_model_name=name, kv_dir=kv_dir, dtype=config.resolved_dtype,
                               max_model_len=config.max_model_len, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                               device_budget_bytes=config.device_kv_budget_bytes, max_num_seqs=options.max_num_seqs,
                               api_key=options.api_key, tool_call_parser=options.tool_call_parser,
                               log_path=_fresh_log(config.data_dir / "logs" / "vllm.log"))
            say(f"starting vLLM's OpenAI server for {name} on {vllm.url} (log: {vllm.log_path}) ...")
            vllm.start()
            vllm.wait_ready(options.vllm_start_timeout_s)
            url = vllm.url
        else:
            url = options.vllm_url.rstrip("/")
            headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
            try:
                r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
                r.raise_for_status()
                name = options.served_model_name or r.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise RuntimeError(f"the vLLM server at {url} does not answer /v1/models ({exc}); start it as "
                                   "docs/server.md shows, or leave out --vllm-url") from None
        memory = Memory(config, engine=HttpEngine(url, kv_dir, name, options.api_key))
        app = create_app(memory, Upstream(url, options.api_key, name), api_key=options.api_key)
        say(f"InferScale is serving {name} with memory from {config.data_dir} on "
            f"http://{options.host}:{options.port} (OpenAI API under /v1, docs at /docs)")
        # uvicorn handles SIGTERM / Ctrl-C itself and raises the signal again once it has
        # stopped: the handler above then ends this function through ``finally``
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=10)
    except (_Stop, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if memory is not None:
            memory.close()
        if vllm is not None:
            say("stopping vLLM's server ...")
            vllm.stop()
