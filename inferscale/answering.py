"""Memory's answering half: requests with memory on the vLLM engine, and the KV behind them.

:class:`Answering` is a base of :class:`inferscale.memory.Memory` (the Mem0-style writes
and reads live there): the engine, generation options, :meth:`~Answering.prepare` /
:meth:`~Answering.inject` / :meth:`~Answering.memory_block` (requests built, not run),
:meth:`~Answering.generate` / :meth:`~Answering.stream` (run on the engine), and the KV
queue and pool as the benchmarks and the reference path read them. It uses the facade's
``components``, ``config``, ``model_path``, ``kv_dir`` and ``_check_open``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, ContextManager, Iterable, Iterator, Sequence

from inferscale.arguments import check_texts, check_timeout
from inferscale.components import Components
from inferscale.config import MemoryConfig
from inferscale.kv.background import wait_with_bar
from inferscale.kv.pool import KVPool, StoredKV
from inferscale.kv.reference import ReferenceModel
from inferscale.models.kv_shape import check_kv_cache_fits
from inferscale.runtime.progress import notice
from inferscale.generation.options import GenerationOptions
from inferscale.generation.request import MemoryBlock, PreparedRequest, generation_chunks
from inferscale.store.records import Scope
from inferscale.types import Generation, GenerationChunk, Injection, require_text

CLOSED = "this Memory was closed: open a new Memory(...) over the same data_dir"


def forked_message(pid: int) -> str:
    """What a forked child is told when it uses the ``Memory`` its parent (``pid``) opened."""
    return (f"this Memory was opened in process {pid}, and this process is a child forked from it "
            "(multiprocessing's default start on Linux): a child cannot use its parent's Memory (two processes "
            "writing one embedded store corrupt each other's view of it). Open a Memory in the child after the "
            "parent closed its own, start children with multiprocessing.get_context('spawn'), or share the "
            "memories through `inferscale serve` (docs/server.md) or a Chroma server (chroma_url)")


class Answering:
    """The answering half of :class:`~inferscale.memory.Memory` (not used on its own)."""

    components: Components
    config: MemoryConfig
    _engine: Any
    _engine_lock: threading.Lock
    _closed: bool
    _pid: int  # the process that opened it: a forked child may not use it

    def _check_open(self) -> None:
        if self._pid != os.getpid():
            raise RuntimeError(forked_message(self._pid))
        if self._closed:
            raise RuntimeError(CLOSED)

    # ------------------------------------------------------------------ KV

    def wait_for_kv(self, timeout: float | None = None, *, progress: bool = False) -> bool:
        """Block until the background encoder has encoded every queued KV (writes return
        before their KV exists: see :meth:`add`).

        Args:
            timeout: most seconds to wait (``None``: no limit).
            progress: show a tqdm bar on stderr while waiting: encodes done of those queued
                when the wait began, and their rate (``KV/s``).

        Returns:
            ``True`` when nothing is pending, ``False`` if ``timeout`` passed first (or at
            once when this memory was closed: the queued encodes wait for the next start).

        Raises:
            TypeError / ValueError: ``timeout`` is not ``None`` or a finite number >= 0.
        """
        timeout = check_timeout(timeout)
        kv = self.components.kv
        if kv.pending() and kv.encoder_kind == "engine" and self._owns_engine and self._engine is None:
            self._check_open()  # an embedded memory's KV is made by its engine: start it now
            started = time.monotonic()
            if not self._start_engine(timeout):
                return False
            timeout = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        pending = kv.pending()
        if pending:
            notice("making the KV of %d memor%s (%s)%s", pending, "y" if pending == 1 else "ies",
                   "on vLLM's engine" if kv.encoder_kind == "engine" else "with transformers in this process",
                   "; the bar starts with the first" if progress else "")
        return wait_with_bar(kv, timeout) if progress else kv.wait(timeout)

    def _start_engine(self, timeout: float | None) -> bool:
        """Start this memory's engine (:attr:`engine`), waiting at most ``timeout`` seconds
        (``None``: until it is up); past that the start goes on in a thread of its own (a
        later call waits for the same start; :meth:`close` waits for it, then stops it).

        Returns:
            Whether the engine is up.

        Raises:
            What the start raised (vLLM could not start; a cache too small for a request).
        """
        if timeout is None:
            self.engine  # noqa: B018 - starts it
            return True
        with self._engine_lock:
            if self._engine is not None:
                return True
            if self._engine_start is None:
                failed: list[BaseException] = []

                def start() -> None:
                    try:
                        self.engine  # noqa: B018 - starts it
                    except BaseException as exc:  # noqa: BLE001 - given to the waiting caller
                        failed.append(exc)

                thread = threading.Thread(target=start, name="inferscale-engine-start", daemon=True)
                self._engine_start = (thread, failed)
                thread.start()
        thread, failed = self._engine_start
        thread.join(timeout)
        if failed:
            self._engine_start = None
            raise failed[0]
        return not thread.is_alive()

    def pending_kv(self) -> int:
        """How many ``(memory, context window)`` KV encodings are queued."""
        return self.components.kv.pending()

    def fact_tokens(self, text: str) -> int:
        """Tokens a memory with this text occupies in a prompt (its ``"- <text>\\n"`` line)."""
        self._check_open()
        return self.components.kv.fact_tokens(require_text(text, "text"))

    def check_fact_length(self, text: str, what: str = "fact") -> None:
        """Refuse a fact longer than ``config.max_fact_tokens`` (raises ``ValueError`` with the fix)."""
        self._check_open()
        self.components.facts.check_length(require_text(text, what), what)

    def embed(self, texts: Sequence[str]):
        """The embedder's unit vectors of ``texts`` (``[len(texts), dim]`` float32, torch, on
        the CPU), as search embeds queries and memories.

        Raises:
            TypeError / ValueError: ``texts`` is not a list of non-empty strings.
        """
        self._check_open()
        return self.components.embedder.encode(check_texts(texts))

    def kv_file_bytes(self, num_tokens: int) -> int:
        """Bytes one fact's KV file of ``num_tokens`` tokens takes on disk, in this memory's
        model dtype and ``kv_storage_dtype``, from the model's ``config.json`` alone (nothing
        encoded): to size ``disk_kv_budget_bytes`` before buying disk (docs/configuration.md,
        "Sizing a disk budget"; :func:`inferscale.kv.sizing.kv_file_bytes`). A memory's tokens
        are :meth:`fact_tokens`; each context window w a fact is served at is a file of its own.

        Raises:
            ValueError: ``num_tokens`` is not a whole number >= 1.
        """
        from inferscale.kv.sizing import kv_file_bytes

        return kv_file_bytes(self.model_path, self.config.resolved_dtype, self.config.kv_storage_dtype, num_tokens)

    def kv_footprint(self) -> dict[str, int]:
        """Bytes of fact KV held by this process's pool: ``{"device": ..., "disk": ...}``."""
        self._check_open()
        return self.components.pool.footprint()

    def encode_preamble(self) -> None:
        """Encode the prompt preamble's KV now (it is otherwise encoded with the first fact)."""
        self._check_open()
        self.components.kv.ensure([self.components.kv.preamble_span()])

    def injected_kv(self, injection: Injection) -> list[tuple[int, StoredKV]]:
        """The KV an injection supplies, as ``(start position, stored KV)`` per segment (dense,
        or 8-/4-bit codes that dequantize on access), for the
        transformers reference path (:class:`~inferscale.kv.reference.ReferenceModel`).

        Raises:
            TypeError: ``injection`` is not what :meth:`inject` returned.
            ValueError: a text-mode injection (no plan), or a segment no longer in the pool.
        """
        self._check_open()
        if not isinstance(injection, Injection):
            raise TypeError(f"injection must be what Memory.inject returns, got {type(injection).__name__}")
        if injection.plan is None:
            raise ValueError("a text-mode request injects no KV")
        out = []
        for seg in injection.plan.segments:
            kv = self.components.pool.get(seg.key)
            if kv is None:
                raise ValueError(f"KV {seg.key} is no longer in the pool (its memory changed): prepare the request again")
            out.append((seg.start, kv))
        return out

    def pinned_kv(self, keys: Iterable[str]) -> ContextManager[None]:
        """A context that keeps the KV of ``keys`` (pool keys, e.g. ``Injection.plan.keys``)
        from eviction while it is open: hold it for the life of a request that injects them
        (:meth:`generate` and :meth:`stream` do)."""
        return self.components.pool.pinned(keys)

    def kv_stats(self) -> dict[str, float]:
        """This process's KV pool counters: the memories requests were planned with, per tier
        where their KV was (``served_device``, ``served_host``, ``served_disk``,
        ``served_redis``) or served as text (``served_text``); loads this process made itself
        (``device_hits``, ``host_hits``, ``disk_hits``, ``misses``: the connector loads in
        vLLM's process, so a front counts few), ``writes``, evictions per tier, ``disk_evicted_bytes``,
        ``reencodes`` (KV written again after this process evicted it), and the bytes each
        tier holds (``device_bytes``, ``host_bytes``, ``disk_bytes``: as last counted, see
        :meth:`inferscale.kv.disk.DiskTier.estimate`); with a Redis tier, ``redis_hits``,
        ``redis_misses``, ``redis_writes``, ``redis_errors`` and ``redis_up`` (1 or 0); and
        the background encoder's ``encode_seconds`` (spent encoding) and
        ``encoder_yielded_seconds`` (spent waiting for requests in flight to end), floats;
        ``engine_encodes`` (memories' KV the serving engine encoded, ``kv_encoder="engine"``) and
        ``encoder_model_loaded`` (1 when this process loaded the LLM to encode KV, else 0);
        capture on a miss (``capture_kv``): ``served_captured`` (memories planned with KV a
        request captured, also in their tier's ``served_*``) and ``encodes_skipped_captured``
        (background encodes not run because a request had captured the memory's KV);
        admission on a second use (``kv_admission_window_s``): ``misses_kept`` (misses
        captured or queued for the encoder) and ``misses_not_kept`` (first misses within the
        window, served as text and only remembered)."""
        self._check_open()
        pool = self.components.pool
        held = pool.footprint(exact=False)
        stats = {**pool.stats, **{f"{tier}_bytes": n for tier, n in held.items()}}
        background = self.components.kv.background
        kv = self.components.kv
        stats["encode_seconds"] = background.encode_s if background is not None else 0.0
        stats["encoder_yielded_seconds"] = background.yielded_s if background is not None else 0.0
        stats["encodes_skipped_captured"] = kv.jobs_captured
        stats["engine_encodes"] = kv.engine_encodes
        stats["encoder_model_loaded"] = int(kv.encoder_loaded)
        stats["misses_kept"], stats["misses_not_kept"] = kv.admission.admitted, kv.admission.refused
        if pool.remote is not None:
            remote = dict(pool.remote.stats)
            stats.update(redis_misses=remote["misses"], redis_writes=remote["writes"], redis_errors=remote["errors"],
                         redis_up=int(pool.remote.available))
        return stats

    def reference_model(self) -> ReferenceModel:
        """The transformers reference path over this memory's KV encoder (loaded on first use)."""
        self._check_open()
        return ReferenceModel(self.components.kv.encoder)

    # ------------------------------------------------------------------ serving

    def _attach_engine(self, engine) -> None:
        """The engine this memory serves with (``engine``, or its own started on first use) and,
        by ``kv_encoder``, whether that engine computes the memories' KV (no model in this process)."""
        self._engine, self._owns_engine = engine, engine is None
        self._engine_lock = threading.Lock()
        self._engine_start: tuple[threading.Thread, list[BaseException]] | None = None  # a start under way
        self._encoder_waits_for_engine = False
        if self.config.kv_encoder == "transformers":
            return
        self.components.kv.use_engine(lambda: self.engine)
        background = self.components.kv.background
        if engine is None and background is not None:
            # embedded: the engine starts when KV or an answer is first asked for (wait_for_kv,
            # generate, an inject-mode prepare), not at add: a process that only adds and
            # searches starts no model (docs/decisions.md, "The engine computes every KV")
            background.pause()
            self._encoder_waits_for_engine = True

    @property
    def engine(self):
        """The vLLM engine with InferScale's connector (:class:`~inferscale.serving.engine.Engine`,
        started on first use; stopped by :meth:`close`).

        Raises:
            RuntimeError: this memory was closed.
        """
        with self._engine_lock:
            if self._closed:
                raise RuntimeError(CLOSED)
            if self._engine is None:
                self._check_engine_settings()
                started = time.monotonic()
                notice("starting vLLM's engine (%s, %s) for answers and KV: about 20-60 s on a CPU, "
                       "the first time a process asks", self.model_path.name, self.config.resolved_dtype)
                from inferscale.serving.engine import Engine  # vLLM's import is part of the wait said above

                self._engine = Engine(
                    self.model_path, dtype=self.config.resolved_dtype, kv_dir=self.kv_dir,
                    max_model_len=self.config.max_model_len, kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
                    device_budget_bytes=self.config.device_kv_budget_bytes, verbose=self.config.verbose,
                    redis_url=self.config.kv_redis_url,
                )
                notice("vLLM's engine is up (%.0f s)", time.monotonic() - started)
                if self._encoder_waits_for_engine:  # queued encodes go to the engine now (a pause of the
                    self._encoder_waits_for_engine = False  # caller's own, benchmarks' and tests', stays)
                    self.components.kv.background.resume()
            return self._engine

    def _check_engine_settings(self) -> None:
        """Refuse, before vLLM starts (and before a request writes anything), a vLLM cache
        that cannot hold one request (:func:`~inferscale.models.kv_shape.check_kv_cache_fits`)."""
        if self._engine is None and self._owns_engine:
            check_kv_cache_fits(self.model_path, self.config.resolved_dtype, self.config.max_model_len,
                                self.config.kv_cache_memory_bytes)

    def options(self, options: GenerationOptions | None = None, **overrides: Any) -> GenerationOptions:
        """Generation options with ``overrides`` applied and ``k`` / ``context_window`` resolved
        to this memory's defaults (``config.top_k`` / ``config.context_window``).

        Raises:
            TypeError: an override is not an option. ValueError: a bad value.
        """
        if options is not None and not isinstance(options, GenerationOptions):
            raise TypeError(f"options must be a GenerationOptions, got {type(options).__name__}: pass fields as "
                            "keyword arguments (k=5) or options=GenerationOptions(k=5)")
        o = (options or GenerationOptions()).merged(**overrides)
        return o.merged(k=self.config.top_k if o.k is None else o.k,
                        context_window=self.config.context_window if o.context_window is None else o.context_window)

    def _prepare(self, query: str, user_id, agent_id, run_id, history, instructions, allow_unknown_scope,
                 options: GenerationOptions | None, followup, overrides: dict) -> PreparedRequest:
        self._check_open()
        o = self.options(options, **overrides)
        return self.components.requests.prepare(Scope.of(user_id, agent_id, run_id), query, o, history=history,
                                             instructions=instructions, allow_unknown_scope=allow_unknown_scope,
                                             followup=followup)

    def prepare(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
                allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
                followup: Sequence[dict] | None = None, **overrides: Any) -> Injection:
        """Retrieve and lay out one request without running it, in either mode (arguments as
        :meth:`generate`).

        In ``mode="inject"`` any missing KV is encoded first, so the request never falls
        back; in ``mode="text"`` the result has no ``plan`` and no ``kv_transfer_params``.
        """
        req = self._prepare(query, user_id, agent_id, run_id, history, instructions, allow_unknown_scope, options,
                            followup, overrides)
        return Injection(prompt_token_ids=req.prompt_token_ids, plan=req.plan,
                         memories=[r.to_item(s) for r, s in req.hits], memory_tokens=req.memory_tokens,
                         retrieval_s=req.retrieval_s, kv_memory_ids=list(req.kv_memory_ids),
                         text_memory_ids=list(req.text_memory_ids), kv_sources=dict(req.kv_sources),
                         scope_key=req.scope_key)

    def inject(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, k: int | None = None, context_window: int | None = None,
               wait_for_kv: bool = False, text_tail: int = 0, memory_order: str = "best_last") -> Injection:
        """Retrieve the scope's top-``k`` facts and prepare one vLLM request that injects their KV.

        Facts whose KV is not encoded yet are placed as text after the injected ones (see
        ``kv_memory_ids`` / ``text_memory_ids``) and queued for the background encoder.

        Args:
            k: facts to retrieve (default ``config.top_k``).
            context_window: w, in turns (default ``config.context_window``).
            wait_for_kv: encode missing KV first, so every fact is injected.
            text_tail: the best-ranked facts prefilled as text after the injected rest
                (:class:`~inferscale.generation.options.GenerationOptions`).
            memory_order: ``"best_last"`` (default) or ``"best_first"``.

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            ValueError: empty query, negative k or w.
        """
        return self.prepare(query, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k,
                            context_window=context_window, mode="inject", max_tokens=1, wait_for_kv=wait_for_kv,
                            text_tail=text_tail, memory_order=memory_order)

    def memory_block(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None, instructions: str | None = None, **overrides: Any) -> MemoryBlock:
        """The memory block of a chat whose template someone else applies (vLLM's chat
        endpoint, ``inferscale serve``): the system turn's text and, in inject mode, the plan
        (:meth:`~inferscale.generation.request.RequestBuilder.prepare_memory_block`). An unknown scope gets
        an empty block. ``overrides``: ``mode``, ``k``, ``context_window``, ``wait_for_kv``,
        ``text_tail``, ``memory_order``.

        Raises:
            TypeError / ValueError: a bad option, an empty query or instructions.
        """
        scope = self._scope(user_id, agent_id, run_id)
        return self.components.requests.prepare_memory_block(scope, query, self.options(**overrides),
                                                          instructions=instructions)

    def generate(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                 run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
                 allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
                 followup: Sequence[dict] | None = None, **overrides: Any) -> Generation:
        """Answer ``query`` with the scope's memory.

        Thread-safe: calls from several threads run concurrently and vLLM batches them.

        Args:
            history: earlier turns of the current conversation, ``{"role": "user" |
                "assistant" | "tool", "content"}`` dicts, oldest first (an assistant turn may
                carry ``"tool_calls"``); they are prefilled after the memory block, before ``query``.
            followup: turns after ``query``, as ``history``: the assistant's tool calls and
                the tools' results, when the model answers a question after calling tools.
            instructions: extra system text, placed after the memory block.
            allow_unknown_scope: answer a scope with no memories and no turns (a new user)
                without memories instead of raising ``UnknownScopeError``.
            options: a :class:`~inferscale.generation.options.GenerationOptions`.
            **overrides: its fields one by one: ``k``, ``context_window``, ``mode``
                (``"inject"``: the memory block as precomputed KV; ``"text"``: the same
                tokens prefilled, Mem0-style), ``max_tokens`` (default 64), ``temperature``
                (0 is greedy), ``stop``, ``logprobs``, ``json_schema`` (constrained decoding),
                ``tools`` and ``tool_choice`` (:mod:`inferscale.generation.tools`; the calls come back
                in ``Generation.tool_calls``).

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            TypeError: an unknown option. ValueError: a bad option value, an empty query, a
                bad history, or a prompt over ``max_model_len``.
        """
        for chunk in self.stream(query, user_id=user_id, agent_id=agent_id, run_id=run_id, history=history,
                                 instructions=instructions, allow_unknown_scope=allow_unknown_scope, options=options,
                                 followup=followup, **overrides):
            if chunk.generation is not None:
                return chunk.generation
        raise RuntimeError("the stream ended without a generation")

    def stream(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
               allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
               followup: Sequence[dict] | None = None, **overrides: Any) -> Iterator[GenerationChunk]:
        """:meth:`generate`, streamed: the same request, its text yielded as the engine produces it.

        Retrieval, input checks and KV encoding happen in this call (errors are raised
        here); the iterator runs the request. Closing it early aborts the request.

        Returns:
            An iterator of :class:`GenerationChunk`; their texts joined are the answer, and
            the last one carries the :class:`Generation` with its timings and counters.

        Example:
            >>> for chunk in m.stream("Suggest a snack for me.", user_id="alice"):
            ...     print(chunk.text, end="")
        """
        self._check_open()
        self._check_engine_settings()  # nothing is written for a request that cannot run
        req = self._prepare(query, user_id, agent_id, run_id, history, instructions, allow_unknown_scope, options,
                            followup, overrides)
        if req.json_schema is not None:  # refused here, not when the iterator first runs
            from inferscale.serving.vllm_compat import check_json_schema  # no engine needed: refused before one starts

            check_json_schema(req.json_schema)
        # pinned from planning on: the first request starts vLLM (tens of seconds) while the
        # background encoder writes, and evicts under a disk budget
        pins = _Pins(self.components.pool, req.plan.keys if req.plan is not None else ())
        try:
            engine = self.engine
        except BaseException:
            pins.release()
            raise
        return pins.around(generation_chunks(engine, req))


class _Pins:
    """A request's KV pinned in the pool (:meth:`KVPool.pinned`) from now until its chunks
    end, are closed, or are dropped without ever being read (no tier evicts KV a request in
    flight is about to load; planning marked it recently used before that)."""

    def __init__(self, pool: KVPool, keys: Sequence[str]) -> None:
        self._hold = pool.pinned(keys)
        self._hold.__enter__()
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        """Let the pins go (once, however often it is called)."""
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._hold.__exit__(None, None, None)

    def around(self, chunks: Iterator[GenerationChunk]) -> Iterator[GenerationChunk]:
        """``chunks``, releasing the pins when they end; also when the iterator is collected
        unread (a generator that never ran has no ``finally`` to run)."""
        def run() -> Iterator[GenerationChunk]:
            try:
                yield from chunks
            finally:
                self.release()

        it = run()
        weakref.finalize(it, self.release)
        return it
