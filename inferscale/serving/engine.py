"""vLLM engine wiring: one in-process engine with InferScale's KV connector.

Everything that imports vLLM at module level lives in ``inferscale/serving/`` (this
file and ``connector.py``); version differences belong here.

TTFT is measured from submission to the engine (``add_request``) to the step whose
output first carries a generated token, with ``time.perf_counter`` (seconds).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from inferscale.serving.connector import INJECTION_LOG

_ids = itertools.count()


@dataclass(frozen=True)
class EngineOutput:
    """One finished generation.

    Attributes:
        text: generated text.
        token_ids: generated token ids.
        ttft_s: time to first token (seconds), submission to first generated token.
        latency_s: submission to the last token (seconds).
        num_prompt_tokens: prompt length (tokens).
        num_injected_tokens: prompt tokens whose KV the connector supplied.
        num_cached_tokens: prompt tokens not prefilled (prefix cache plus injected), as vLLM reports.
        first_logprobs: ``{token_id: logprob}`` for the first generated position (top-N
            when ``logprobs=N`` was asked, else empty).
    """

    text: str
    token_ids: tuple[int, ...]
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_injected_tokens: int
    num_cached_tokens: int
    first_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineChunk:
    """One step of a streamed generation.

    Attributes:
        text: the whole text generated so far (vLLM's cumulative output; it only grows).
        output: the finished :class:`EngineOutput`, on the last chunk only.
    """

    text: str
    output: EngineOutput | None = None


class Engine:
    """An in-process vLLM ``LLMEngine`` configured with :class:`InferScaleConnector`.

    Args:
        model_path: local Hugging Face folder.
        dtype: ``"float32"`` or ``"bfloat16"``.
        kv_dir: the KV pool's disk folder (shared with the writer of the KV).
        max_model_len: context length (tokens).
        kv_cache_memory_bytes: size of vLLM's paged KV cache (bytes).
        device_budget_bytes: device tier of the connector's KV pool (bytes).

    Thread-safe: requests are served one at a time.
    """

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str,
        kv_dir: Path,
        max_model_len: int = 8192,
        kv_cache_memory_bytes: int = 1 << 30,
        device_budget_bytes: int = 2 << 30,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.kv_dir = Path(kv_dir)
        from vllm import LLM

        from inferscale.serving.async_engine import engine_kwargs

        self.llm = LLM(**engine_kwargs(model_path, dtype=dtype, kv_dir=kv_dir, max_model_len=max_model_len,
                                       kv_cache_memory_bytes=kv_cache_memory_bytes,
                                       device_budget_bytes=device_budget_bytes))
        self._engine = self.llm.llm_engine
        self._lock = threading.Lock()

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        kv_transfer_params: dict | None = None,
        cache_salt: str | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
    ) -> EngineOutput:
        """Run one request to completion (consumes :meth:`stream`).

        Args:
            prompt_token_ids: the prompt (tokens).
            kv_transfer_params: what the connector injects (``None``: plain prefill).
            cache_salt: separates prefix-cache entries (per scope and memory version).
            max_tokens: generation budget (tokens).
            temperature: sampling temperature; 0 is greedy.
            stop: stop strings.
            logprobs: return the top-N logprobs of the first generated position.

        Returns:
            An :class:`EngineOutput`.
        """
        for chunk in self.stream(prompt_token_ids, kv_transfer_params=kv_transfer_params, cache_salt=cache_salt,
                                 max_tokens=max_tokens, temperature=temperature, stop=stop, logprobs=logprobs):
            if chunk.output is not None:
                return chunk.output
        raise RuntimeError("the engine's stream ended without an output")

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        *,
        kv_transfer_params: dict | None = None,
        cache_salt: str | None = None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
    ) -> Iterator[EngineChunk]:
        """Run one request, yielding its text after each engine step that produced tokens.

        Arguments as :meth:`generate`. The engine serves one request at a time: it is held
        until the iterator is exhausted or closed; closing it early aborts the request.

        Yields:
            :class:`EngineChunk` s; the last one carries the :class:`EngineOutput`.
        """
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, stop=list(stop or []), logprobs=logprobs, extra_args=extra
        )
        prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        req_id = f"inferscale-{next(_ids)}"
        with self._lock:
            t0 = time.perf_counter()
            internal_id = self._engine.add_request(req_id, prompt, params)
            ttft = None
            final = None
            try:
                while final is None and self._engine.has_unfinished_requests():
                    for out in self._engine.step():
                        if out.request_id not in (req_id, internal_id):
                            continue
                        if ttft is None and out.outputs and out.outputs[0].token_ids:
                            ttft = time.perf_counter() - t0
                        if out.finished:
                            final = out
                        elif out.outputs and out.outputs[0].text:
                            yield EngineChunk(out.outputs[0].text)
            finally:
                if final is None:  # closed early or failed: free the request's blocks
                    self._engine.abort_request([req_id])
                    INJECTION_LOG.pop(internal_id, None)
            latency = time.perf_counter() - t0
        if final is None:
            raise RuntimeError(f"vLLM finished without output for request {req_id}")
        completion = final.outputs[0]
        first: dict[int, float] = {}
        if logprobs and completion.logprobs:
            first = {tok: lp.logprob for tok, lp in completion.logprobs[0].items()}
        injected = INJECTION_LOG.pop(internal_id, {}).get("injected_tokens", 0)
        yield EngineChunk(completion.text, EngineOutput(
            text=completion.text,
            token_ids=tuple(completion.token_ids),
            ttft_s=ttft if ttft is not None else latency,
            latency_s=latency,
            num_prompt_tokens=len(prompt_token_ids),
            num_injected_tokens=injected,
            num_cached_tokens=int(final.num_cached_tokens or 0),
            first_logprobs=first,
        ))
