"""The vLLM engine: ``AsyncLLM`` with InferScale's KV connector, for sync and async callers.

One implementation: every request runs as a coroutine on the engine's own event loop
(a daemon thread), so requests from any number of threads or event loops are in flight
together and vLLM batches them. :meth:`Engine.stream` / :meth:`Engine.generate` are the
synchronous faces, :meth:`Engine.astream` / :meth:`Engine.agenerate` the asynchronous
ones, over the same coroutine. vLLM's engine core (scheduler, model, and the connector's
both sides) runs in its own process and reads fact KV from the pool's disk tier.

TTFT is measured from submission (``AsyncLLM.generate``) to the first output that
carries a generated token, with ``time.perf_counter`` (seconds). The number of injected
tokens comes back through vLLM's own return path: the connector's ``request_finished``
params, delivered in the finished output's ``kv_transfer_params``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from vllm.v1.metrics.loggers import StatLoggerBase

from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES, DEFAULT_KV_CACHE_MEMORY_BYTES
from inferscale.runtime.lifecycle import close_at_exit
from inferscale.runtime.logs import quiet_vllm_logger
from inferscale.kv.injection import injected_tokens
from inferscale.serving.spawn import children_skip_main
from inferscale.serving.vllm_compat import (ENGINE_SHUTDOWN_TIMEOUT_S, check_json_schema, check_vllm_version,
                                            engine_kwargs,
                                            engine_process_environment, structured_outputs)

logger = logging.getLogger(__name__)
_ids = itertools.count()
_DONE = object()


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
        finish_reason: vLLM's: ``"stop"`` (end of answer or a stop string) or ``"length"``
            (``max_tokens`` reached: a constrained JSON answer may be cut).
    """

    text: str
    token_ids: tuple[int, ...]
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    num_injected_tokens: int
    num_cached_tokens: int
    first_logprobs: dict[int, float] = field(default_factory=dict)
    finish_reason: str | None = None

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineChunk:
    """One step of a streamed generation.

    Attributes:
        text: the whole text generated so far (vLLM's cumulative output; it only grows).
        output: the finished :class:`EngineOutput`, on the last chunk only.
    """

    text: str
    output: EngineOutput | None = None


class BatchStats(StatLoggerBase):
    """vLLM stat logger: the largest number of requests the scheduler ran in one step, and
    the connector's counters summed since the engine started.

    Attributes:
        max_running: most requests in one step. steps: scheduler steps seen.
        connector: sums of :data:`inferscale.serving.connector_stats.STAT_FIELDS` (counts, seconds).
    """

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.max_running = 0
        self.steps = 0
        self.connector: dict[str, float] = {}

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.steps += 1
            self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
            for name, value in (scheduler_stats.kv_connector_stats or {}).items():
                if isinstance(value, (int, float)):
                    self.connector[name] = self.connector.get(name, 0) + value

    def log_engine_initialized(self) -> None:
        return


class Engine:
    """vLLM's ``AsyncLLM`` configured with :class:`InferScaleConnector`; thread-safe.

    Args:
        model_path: local Hugging Face folder.
        dtype: ``"float32"`` or ``"bfloat16"``.
        kv_dir: the KV pool's disk folder (shared with the writer of the KV).
        max_model_len: context length (tokens).
        kv_cache_memory_bytes: size of vLLM's paged KV cache (bytes).
        device_budget_bytes: device tier of the connector's KV pool (bytes).
        max_num_seqs: most requests vLLM batches at once.
        verbose: let vLLM log as it does on its own (default: errors only; :mod:`inferscale.runtime.logs`).
        redis_url: the KV pool's shared Redis tier, which the connector reads on a local miss.

    Concurrent requests (from threads, or tasks of any event loop) are batched by vLLM.
    Call :meth:`close` (or use ``with Engine(...) as e:``) to stop the engine-core
    process; it is also stopped when the object is collected or the interpreter exits.

    Raises:
        ImportError: vLLM is not installed.
    """

    def __init__(self, model_path: Path, *, dtype: str, kv_dir: Path, max_model_len: int = 8192,
                 kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES,
                 device_budget_bytes: int = DEFAULT_DEVICE_KV_BUDGET_BYTES, max_num_seqs: int = 64,
                 verbose: bool = False, redis_url: str | None = None) -> None:
        check_vllm_version()
        quiet_vllm_logger(verbose)
        self._verbose = verbose
        self.kv_dir = Path(kv_dir)
        self.batch_stats = BatchStats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inferscale-engine", daemon=True)
        self._thread.start()
        kwargs = engine_kwargs(model_path, dtype=dtype, kv_dir=kv_dir, max_model_len=max_model_len,
                               kv_cache_memory_bytes=kv_cache_memory_bytes, device_budget_bytes=device_budget_bytes,
                               max_num_seqs=max_num_seqs, verbose=verbose, redis_url=redis_url)
        try:
            self._holder = [self.run_coroutine(self._start(kwargs))]
        except BaseException:
            self._stop_loop()
            raise
        # the finalizer owns the only other reference, so AsyncLLM is gone once it ran
        self._finalizer = weakref.finalize(self, _shutdown, self._holder, self._loop, self._thread)
        close_at_exit(self)  # stopped before the interpreter tears down, not during

    @property
    def llm(self):
        """vLLM's ``AsyncLLM`` (its methods run on this engine's loop: see :meth:`run_coroutine`).

        Raises:
            RuntimeError: the engine was closed.
        """
        if not self._holder:
            raise RuntimeError("this Engine was closed; start a new one")
        return self._holder[0]

    @staticmethod
    def check_json_schema(schema: dict) -> None:
        """Raise ``ValueError`` when vLLM cannot decode under ``schema`` (see
        :func:`inferscale.serving.vllm_compat.check_json_schema`); call before :meth:`stream`."""
        check_json_schema(schema)

    async def _start(self, kwargs: dict):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        stats = self.batch_stats  # not self: the engine must stay collectable
        with engine_process_environment(self._verbose), children_skip_main():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[lambda config, index: stats])

    def run_coroutine(self, coro):
        """Run ``coro`` on the engine's event loop and wait for its result, e.g. one that drives
        ``engine.llm`` (vLLM's ``AsyncLLM``) directly. Call from any thread but the loop's."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def close(self) -> None:
        """Stop the engine-core process and the engine's loop (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one request

    async def _run(self, prompt_token_ids: Sequence[int], emit: Callable[[EngineChunk], None], *,
                   kv_transfer_params: dict | None, cache_salt: str | None, max_tokens: int, temperature: float,
                   stop: Sequence[str] | None, logprobs: int | None, json_schema: dict | None,
                   priority: int = 0) -> EngineOutput:
        """The one request loop, on the engine's event loop: ``emit`` each chunk, return the output."""
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=list(stop or []),
                                logprobs=logprobs, extra_args=extra, structured_outputs=structured_outputs(json_schema))
        prompt: dict = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        t0 = time.perf_counter()
        ttft = None
        final = None
        async for out in self.llm.generate(prompt, params, f"inferscale-{next(_ids)}", priority=priority):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
            elif out.outputs and out.outputs[0].text:
                emit(EngineChunk(out.outputs[0].text))
        latency = time.perf_counter() - t0
        if final is None:
            raise RuntimeError("vLLM finished the request without output")
        completion = final.outputs[0]
        first: dict[int, float] = {}
        if logprobs and completion.logprobs:
            first = {tok: lp.logprob for tok, lp in completion.logprobs[0].items()}
        output = EngineOutput(
            text=completion.text,
            token_ids=tuple(completion.token_ids),
            ttft_s=ttft if ttft is not None else latency,
            latency_s=latency,
            num_prompt_tokens=len(prompt_token_ids),
            num_injected_tokens=injected_tokens(final.kv_transfer_params),
            num_cached_tokens=int(final.num_cached_tokens or 0),
            first_logprobs=first,
            finish_reason=completion.finish_reason,
        )
        emit(EngineChunk(completion.text, output))
        return output

    # ------------------------------------------------------------------ sync faces

    def stream(self, prompt_token_ids: Sequence[int], *, kv_transfer_params: dict | None = None,
               cache_salt: str | None = None, max_tokens: int = 64, temperature: float = 0.0,
               stop: Sequence[str] | None = None, logprobs: int | None = None,
               json_schema: dict | None = None, priority: int = 0) -> Iterator[EngineChunk]:
        """Run one request, yielding its text after each engine step that produced tokens.

        Args:
            prompt_token_ids: the prompt (tokens).
            kv_transfer_params: what the connector injects (``None``: plain prefill).
            cache_salt: separates prefix-cache entries (per scope and memory version).
            max_tokens: generation budget (tokens).
            temperature: sampling temperature; 0 is greedy.
            stop: stop strings.
            logprobs: return the top-N logprobs of the first generated position.
            json_schema: decode only JSON valid for this JSON Schema (vLLM's structured
                outputs, no free whitespace), ``None`` for free text.
            priority: vLLM's priority scheduling (lower is served first; requests 0, KV
                encodes :data:`inferscale.kv.engine_encoder.ENCODE_PRIORITY`).

        Yields:
            :class:`EngineChunk` s; the last one carries the :class:`EngineOutput`.
            Closing the iterator early aborts the request in vLLM.
        """
        chunks: queue.Queue = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._run(
            prompt_token_ids, chunks.put, kv_transfer_params=kv_transfer_params, cache_salt=cache_salt,
            max_tokens=max_tokens, temperature=temperature, stop=stop, logprobs=logprobs, json_schema=json_schema,
            priority=priority), self._loop)
        future.add_done_callback(lambda _f: chunks.put(_DONE))
        try:
            while (chunk := chunks.get()) is not _DONE:
                yield chunk
            future.result()  # raises what the request raised
        finally:
            if not future.done():  # closed early: cancelling the coroutine aborts the vLLM request
                future.cancel()

    def generate(self, prompt_token_ids: Sequence[int], **options: Any) -> EngineOutput:
        """Run one request to completion; options as :meth:`stream`.

        Returns:
            An :class:`EngineOutput`.
        """
        return self.run_coroutine(self._run(prompt_token_ids, _ignore, **_defaults(options)))

    # ------------------------------------------------------------------ async faces

    async def astream(self, prompt_token_ids: Sequence[int], **options: Any) -> AsyncIterator[EngineChunk]:
        """:meth:`stream` for a coroutine caller of any event loop; options as :meth:`stream`."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        future = asyncio.run_coroutine_threadsafe(self._run(
            prompt_token_ids, lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c), **_defaults(options)),
            self._loop)
        future.add_done_callback(lambda _f: loop.call_soon_threadsafe(chunks.put_nowait, _DONE))
        try:
            while (chunk := await chunks.get()) is not _DONE:
                yield chunk
            future.result()
        finally:
            if not future.done():
                future.cancel()

    async def agenerate(self, prompt_token_ids: Sequence[int], **options: Any) -> EngineOutput:
        """:meth:`generate` for a coroutine caller of any event loop; options as :meth:`stream`."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            self._run(prompt_token_ids, _ignore, **_defaults(options)), self._loop))


def _ignore(_chunk: EngineChunk) -> None:
    return


_OPTIONS = {"kv_transfer_params": None, "cache_salt": None, "max_tokens": 64, "temperature": 0.0, "stop": None,
            "logprobs": None, "json_schema": None, "priority": 0}


def _defaults(options: dict) -> dict:
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown engine options {sorted(unknown)}: use {sorted(_OPTIONS)}")
    return {**_OPTIONS, **options}


def _shutdown(holder: list, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the engine-core process, then the loop (the finalizer of :class:`Engine`).

    ``AsyncLLM.shutdown`` runs on the engine's loop, so its output handler is not running
    while the engine core goes away (it would report the engine dead).
    """
    if not holder:
        return
    llm = holder.pop()
    try:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(_shutdown_on_loop(llm), loop).result(timeout=120)
        else:
            llm.shutdown(timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - shutting down must not raise at interpreter exit
        logger.warning("vLLM engine shutdown: %s", exc)
    del llm
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


async def _shutdown_on_loop(llm) -> None:
    # vLLM's default gives the engine core 5 s, then kills it: under load its worker is still
    # tearing down, and the shared memory they hold leaks (the resource tracker warns at exit)
    llm.shutdown(timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
