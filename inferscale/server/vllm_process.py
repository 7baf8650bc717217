"""vLLM's own OpenAI server as a child process of ``inferscale serve``.

The child runs ``python -m vllm.entrypoints.openai.api_server`` with InferScale's KV
connector (:func:`inferscale.serving.vllm_compat.openai_server_command`) on a loopback
port, in a process group of its own that ends with ``inferscale serve``
(:class:`~inferscale.server.child_server.ChildServer`). With several replicas on one
machine each gets its share of the cores or GPUs (:func:`cpu_shares`, :func:`gpu_shares`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from inferscale.server.child_server import ChildServer, ChildStartError


class VLLMStartError(ChildStartError):
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


class VLLMProcess(ChildServer):
    """vLLM's OpenAI server as a child (:class:`~inferscale.server.child_server.ChildServer`).

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
        super().__init__("vLLM's server", port=port, log_path=log_path, log_prefix="inferscale-vllm-",
                         environment=environment, start_error=VLLMStartError)
        self.api_key = api_key
        from inferscale.serving.vllm_compat import openai_server_command  # imports vLLM: only where one starts

        self.command = openai_server_command(
            sys.executable, model_path, served_model_name=served_model_name, host=self.host, port=self.port,
            dtype=dtype, kv_dir=kv_dir, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
            device_budget_bytes=device_budget_bytes, max_num_seqs=max_num_seqs, tool_call_parser=tool_call_parser,
        )

    def child_environment(self) -> dict[str, str]:
        from inferscale.serving.vllm_compat import engine_environment

        env = {**engine_environment(verbose=True), **self.environment}  # its log keeps vLLM's output
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env
