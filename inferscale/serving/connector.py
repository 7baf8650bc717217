"""InferScale's vLLM v1 KV connector: injects precomputed fact KV into the paged cache.

Load it in any vLLM engine with::

    KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kv_dir": "<data_dir>/kv"},
    )

and send requests whose ``kv_transfer_params`` carry the plan built by
:meth:`inferscale.Memory.inject` (the wire format is owned by
:mod:`inferscale.kv.injection`).

A thin shim: each method delegates to vLLM-free code in :mod:`inferscale.kv.injection`.
Scheduler side: the plan's segments are checked in order against the prompt: a segment
is claimed only when its KV is in the pool and the tokens stored with it are the
prompt's tokens at its positions, so no chat template, tokenizer boundary, stale or
forged plan makes attention read KV for other tokens. The longest verified prefix of
segments is claimed as externally computed and vLLM prefills the rest (all of it when
the first segment fails: the text fallback). ``request_finished`` returns
how many tokens were injected, which vLLM hands back in the request's output. Worker
side: before the forward pass, the staged keys are rotated to their prompt positions and
written, with the values, through the attention backend's own ``do_kv_cache_update``. A
segment that cannot be read at that point reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them.

Capture on a miss (:mod:`inferscale.kv.capture`): a request may also name the memory lines
it carries as text. The scheduler side tracks the request's blocks until those lines are
computed and sends them to the worker, which, after that step's forward pass
(``wait_for_save``), reads their K and V back out of the paged cache, hands them to one
thread, and returns: between steps the thread hands them to the capture writer process
(:mod:`inferscale.kv.capture_writer`), which inverse-rotates the keys to pre-RoPE, converts
to the storage dtype and stores them in the pool, so the next request injects them. Nothing a request waits for: a capture that fails is logged and counted, never raised.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES
from inferscale.runtime.devices import best_device
from inferscale.kv.capture import CAPTURE_FIELD, CacheLayout, CaptureRequest, CaptureSpan, LayoutError, plan_captures
from inferscale.kv.capture_writer import CaptureWriter, portable_rope_config, store_capture
from inferscale.kv.injection import (
    PARAMS_KEY,
    InjectionPlan,
    LayerWriter,
    MissingKVError,
    blocks_to_recompute,
    replica_index,
    report_params,
    slot_mapping,
    stage,
    write_layers,
)
from inferscale.kv.pool import KVPool
from inferscale.kv.rope import RopeRotator
from inferscale.serving.connector_stats import InjectionPromMetrics, InjectionStats
from inferscale.serving.orphans import die_with_parent, leave_interrupts_to_the_owner
from inferscale.serving.step_gate import StepGate

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
#: the longest a capture waits for a pause between the worker's steps before it is stored
#: anyway (seconds): a busy engine still gets its captures, whose copies wait in memory meanwhile
MAX_CAPTURE_DEFER_S = 1.0
#: captures the writer process may have waiting before new ones are dropped (each holds its
#: KV in the spool: 64 of SmolLM2's 100-token captures are about 150 MB; a memory dropped
#: stays a miss, and a later request captures it)
MAX_CAPTURE_BACKLOG = 64


@dataclass
class LoadSpec:
    """Worker instruction: write positions ``[start, plan.memory_end)`` into ``block_ids``."""

    req_id: str
    plan: InjectionPlan
    start: int
    block_ids: list[int]


@dataclass
class CaptureSpec:
    """Worker instruction: after this step, read ``spans`` (computed by then) out of ``block_ids``
    and store them in ``storage`` (the pool's folder kept to ``disk_budget_bytes``)."""

    req_id: str
    spans: list[CaptureSpan]
    block_ids: list[int]
    storage: str
    disk_budget_bytes: int | None


@dataclass
class _Capturing:
    """Scheduler side: a request's spans still to capture, and its blocks so far."""

    request: CaptureRequest
    spans: list[CaptureSpan]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)


class InferScaleConnector(KVConnectorBase_V1):
    """vLLM KV connector serving InferScale's fact KV; see the module docstring.

    ``kv_connector_extra_config``: ``kv_dir`` (the KV pool's folder, required) and
    ``device_budget_bytes`` (the pool's device tier in this process, bytes),
    ``host_budget_bytes`` (its pinned host tier on CUDA, bytes; default 0) and ``redis_url``
    (the shared Redis tier, read on a local miss; default: ``INFERSCALE_KV_REDIS_URL``, how
    ``inferscale serve`` passes it to vLLM's server, off the command line).

    Raises:
        ValueError: ``kv_dir`` is missing.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if role == KVConnectorRole.SCHEDULER:  # the engine-core process: it ends with whoever started it
            die_with_parent()
        leave_interrupts_to_the_owner()  # a terminal's or a notebook's Ctrl-C is its owner's to act on
        if "kv_dir" not in extra:
            raise ValueError("InferScaleConnector needs kv_connector_extra_config={'kv_dir': <KV pool folder>}")
        self._block_size = vllm_config.cache_config.block_size
        self._pool = KVPool.shared(  # reads the disk tier; never counts a use or evicts
            extra["kv_dir"], best_device(), int(extra.get("device_budget_bytes", DEFAULT_DEVICE_KV_BUDGET_BYTES)),
            int(extra.get("host_budget_bytes", 0)), None,
            extra.get("redis_url") or os.environ.get("INFERSCALE_KV_REDIS_URL") or None,
        )
        # scheduler side: claimed, allocated, and injected (reported at request_finished)
        self._pending: dict[str, tuple[InjectionPlan, int]] = {}
        self._to_load: dict[str, tuple[InjectionPlan, int]] = {}
        self._injected: dict[str, int] = {}
        self._replica = replica_index()  # reported with each finished request (inferscale serve's replicas)
        # token ids of segments seen on disk: a key names immutable content, so it is never
        # re-read; one deleted since is caught at load time and recomputed
        # (get_block_ids_with_load_errors)
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._stats = InjectionStats()
        # worker side
        self._hf_config = vllm_config.model_config.hf_config
        self._rotator = RopeRotator(self._hf_config) if role == KVConnectorRole.WORKER else None
        self._failed_blocks: set[int] = set()
        # capture on a miss: scheduler-side state per request; worker-side layers, the
        # learned cache layout (None: not learned yet; False: this cache cannot be read)
        self._capturing: dict[str, _Capturing] = {}
        self._layers: list[tuple[int, Any]] = []
        self._layout: CacheLayout | bool | None = None
        self._num_blocks = getattr(kv_cache_config, "num_blocks", 0)
        self._writer: ThreadPoolExecutor | None = None  # the hand-off thread
        self._process: CaptureWriter | bool | None = None  # the writer process (False: none can start)
        self._gate = StepGate()  # captures are handed over between the worker's steps
        self._stats_lock = threading.Lock()

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            plan = InjectionPlan.from_params(request.kv_transfer_params)
        except ValueError as exc:  # a bad request must never take the engine down
            logger.warning("request %s: %s; prefilling instead", request.request_id, exc)
            return 0, False
        if plan is not None:
            self._track_capture(request)
        if plan is None or plan.memory_end <= num_computed_tokens:
            return 0, False
        if plan.memory_end >= request.num_prompt_tokens:
            logger.warning("request %s: memory block covers the whole prompt; prefilling", request.request_id)
            return 0, False
        plan = self._verified(request, plan)
        if plan is None or plan.memory_end <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (plan, num_computed_tokens)
        return plan.memory_end - num_computed_tokens, False

    def _track_capture(self, request: "Request") -> None:
        """Note the memory lines ``request`` asks to capture (those whose tokens are the prompt's)."""
        try:
            capture = CaptureRequest.from_params(request.kv_transfer_params[PARAMS_KEY].get(CAPTURE_FIELD))
        except ValueError as exc:
            logger.warning("request %s: %s; nothing captured", request.request_id, exc)
            return
        if capture is None or request.request_id in self._capturing or request.prompt_token_ids is None:
            return
        spans, skipped = plan_captures(capture, request.prompt_token_ids)
        self._stats.data["capture_skipped"] += skipped
        if spans:
            self._capturing[request.request_id] = _Capturing(capture, spans)

    def _verified(self, request: "Request", plan: InjectionPlan) -> InjectionPlan | None:
        """The plan cut to its longest prefix of segments whose stored tokens are the prompt's
        tokens at their positions (``None`` when not even the first one is)."""
        prompt = request.prompt_token_ids
        stats = self._stats.data
        n_ok = 0
        for seg in plan.segments:
            stored = self._stored_tokens(seg.key)
            if stored is None:
                stats["missing_segments"] += 1
                break
            if prompt is None or tuple(prompt[seg.start:seg.start + seg.num_tokens]) != stored:
                stats["mismatched_segments"] += 1
                break
            n_ok += 1
        if n_ok == len(plan.segments):
            stats["verified"] += 1
            return plan
        logger.warning("request %s: %d of %d KV segment(s) verified against the prompt's tokens; the rest is "
                       "prefilled", request.request_id, n_ok, len(plan.segments))
        stats["fallbacks"] += 1
        if n_ok == 0:
            return None
        kept = plan.segments[:n_ok]
        return InjectionPlan(kept[-1].start + kept[-1].num_tokens, kept)

    def _stored_tokens(self, key: str) -> tuple[int, ...] | None:
        tokens = self._tokens.get(key)
        if tokens is not None:
            self._stats.data["lookups_cached"] += 1
            return tokens
        self._stats.data["lookups"] += 1
        tokens = self._pool.token_ids(key)
        if tokens is None:
            return None
        if len(self._tokens) >= 1_000_000:  # bound the memory: start over
            self._tokens.clear()
        self._tokens[key] = tokens
        return tokens

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens > 0 and pending is not None:
            self._to_load[request.request_id] = pending
            self._injected[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = InferScaleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            entry = self._to_load.pop(new_req.req_id, None)
            if entry is not None:
                meta.loads.append(LoadSpec(new_req.req_id, *entry, list(new_req.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._to_load and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                meta.loads.append(LoadSpec(req_id, *self._to_load.pop(req_id), list(cached.new_block_ids[i][0])))
        if self._capturing:
            self._due_captures(scheduler_output, meta)
        return meta

    def _due_captures(self, scheduler_output: "SchedulerOutput", meta: InferScaleConnectorMetadata) -> None:
        """Follow capturing requests' blocks; send the worker each span computed by the end of this step."""
        steps: list[tuple[str, int, list[int] | None, bool]] = [
            (r.req_id, r.num_computed_tokens, list(r.block_ids[0]), True) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            steps.append((req_id, cached.num_computed_tokens[i], None if new is None else list(new[0]),
                          req_id in cached.resumed_req_ids))
        for req_id, computed, blocks, replace in steps:
            state = self._capturing.get(req_id)
            if state is None:
                continue
            if blocks is not None:
                state.block_ids = blocks if replace else state.block_ids + blocks
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            due = [s for s in state.spans if s.end <= done]
            if not due:
                continue
            state.spans = [s for s in state.spans if s.end > done]
            meta.captures.append(CaptureSpec(req_id, due, list(state.block_ids), state.request.storage,
                                             state.request.disk_budget_bytes))
            if not state.spans:
                del self._capturing[req_id]

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        self._capturing.pop(request.request_id, None)
        injected = self._injected.pop(request.request_id, None)
        return False, report_params(injected, self._replica)

    # ---------------- worker side ----------------

    def _attention_layers(self, forward_context: "ForwardContext") -> list[tuple[int, Any]]:
        """``(layer index, attention layer)`` of every layer with a paged cache, in index order (kept)."""
        if not self._layers:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layers = sorted(
                ((extract_layer_index(name), layer) for name, layer in forward_context.no_compile_layers.items()
                 if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")),
                key=lambda pair: pair[0])
        return self._layers

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._gate.begin()
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleConnectorMetadata):
            return
        if meta.captures:
            self._attention_layers(forward_context)  # wait_for_save reads them after the forward pass
        if not meta.loads:
            return
        writers = [LayerWriter(index, layer.kv_cache.device, layer.kv_cache.dtype, _writer(layer))
                   for index, layer in self._attention_layers(forward_context)]
        assert self._rotator is not None, "start_load_kv runs on the worker side only"
        stats = self._stats.data
        for load in meta.loads:
            t0, disk_before = time.perf_counter(), self._pool.stats["disk_hits"]
            try:
                staged = stage(load.plan, load.start, self._pool.get)
            except MissingKVError as exc:
                logger.error("request %s: %s at load time; recomputing", load.req_id, exc)
                self._failed_blocks.update(
                    blocks_to_recompute(load.start, load.plan.memory_end, load.block_ids, self._block_size))
                stats["load_errors"] += 1
                continue
            t1 = time.perf_counter()
            stats["stage_s"] += t1 - t0
            stats["disk_reads"] += self._pool.stats["disk_hits"] - disk_before
            if staged is not None:
                slots = slot_mapping(staged.positions, load.block_ids, self._block_size)
                write_layers(staged, slots, self._rotator, writers)
                stats["write_s"] += time.perf_counter() - t1
                stats["loads"] += 1
                stats["injected_tokens"] += staged.num_tokens

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (vLLM sums worker and scheduler sides)."""
        with self._stats_lock:
            return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return InjectionStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> InjectionPromMetrics:
        """The connector's counters for vLLM's Prometheus ``/metrics`` (:class:`InjectionPromMetrics`)."""
        return InjectionPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # captures are read once the step's forward pass is done (wait_for_save)

    def wait_for_save(self) -> None:
        """After the step's forward pass: read the due captures out of the paged cache (copies)
        and queue them for the writer thread, which stores them between steps; the step goes on at once."""
        try:
            self._read_captures()
        finally:
            self._gate.end()

    def _read_captures(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleConnectorMetadata) or not meta.captures or not self._layers:
            return
        layout = self._cache_layout()
        if layout is None:
            with self._stats_lock:
                self._stats.data["capture_errors"] += sum(len(c.spans) for c in meta.captures)
            return
        t0 = time.perf_counter()
        for capture in meta.captures:
            positions = torch.cat([torch.arange(s.start, s.end) for s in capture.spans])
            index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # by cache shape: one per capture
            pairs = []
            for _, layer in self._layers:
                cache = layer.kv_cache
                shape = tuple(cache.shape)
                if shape not in index:
                    index[shape] = layout.gather_index(shape, capture.block_ids, positions)
                pairs.append((cache, index[shape]))
            keys = torch.stack([cache.take(k) for cache, (k, _) in pairs])  # [L, N, H, D], rotated
            values = torch.stack([cache.take(v) for cache, (_, v) in pairs])
            self._hand_off().submit(self._store_captures, capture, keys, values, positions)
        with self._stats_lock:
            self._stats.data["capture_read_s"] += time.perf_counter() - t0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The worker's caches exist: start the capture writer process now, off any request's
        path, from this thread (the hand-off thread's nice 19 would pass to the process, whose
        imports then starve behind an engine that serves at once; it lowers itself once set up)."""
        self._writer_process()

    def _hand_off(self) -> ThreadPoolExecutor:
        """The thread that hands captures to the writer process between steps (started on first use)."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferscale-capture",
                                              initializer=_yield_to_requests)
        return self._writer

    def _cache_layout(self) -> CacheLayout | None:
        """The paged cache's layout, learned once from the first layer's writer (``None``:
        it cannot be read, and nothing is captured; said once)."""
        if self._layout is None:
            _, layer = self._layers[0]
            cache = layer.kv_cache
            impl = layer.impl
            num_kv_heads = getattr(impl, "num_kv_heads", None)
            head_size = getattr(impl, "head_size", None)
            try:
                if not (num_kv_heads and head_size and self._num_blocks):
                    raise LayoutError("the attention layer does not say its KV heads and head size")
                self._layout = CacheLayout.calibrate(
                    cache, self._num_blocks, self._block_size, num_kv_heads, head_size,
                    lambda k, v, c, s: impl.do_kv_cache_update(layer, k, v, c, s))
            except (LayoutError, RuntimeError, TypeError, ValueError) as exc:
                logger.warning("InferScale cannot read this engine's paged cache (%s): memories served as text are "
                               "not captured; the background encoder stores their KV", exc)
                self._layout = False
        return self._layout or None

    def _store_captures(self, capture: CaptureSpec, keys: torch.Tensor, values: torch.Tensor,
                        positions: torch.Tensor) -> None:
        """The hand-off thread: between steps, to the writer process, which inverse-rotates the
        keys and stores them (:mod:`inferscale.kv.capture_writer`; this thread unrotates them
        where the model's config cannot travel, and stores them where no process starts)."""
        assert self._rotator is not None
        spans = [(span.key, span.token_ids) for span in capture.spans]
        try:
            self._gate.wait_quiet(MAX_CAPTURE_DEFER_S)
            process = self._writer_process()
            if process is not None and process.backlog >= MAX_CAPTURE_BACKLOG:
                # the engine has kept the CPUs busy for long: drop rather than pile copies up in memory
                self._count_outcome((0, 0, 0), dropped=len(spans))
                return
            if process is None or not process.unrotates:  # its inverse RoPE, in this process after all
                keys = self._rotator.unrotate(keys, positions.to(keys.device))
            if process is not None:
                try:
                    process.send(capture.req_id, keys, values, spans, capture.storage, capture.disk_budget_bytes,
                                 positions if process.unrotates else None)
                    return
                except OSError as exc:  # the writer process died: this thread stores from now on
                    logger.warning("the capture writer process stopped (%s); captures are stored in vLLM's process",
                                   exc)
                    self._process = False
            outcome = store_capture(self._pool, capture.req_id, keys, values, spans, capture.storage,
                                    capture.disk_budget_bytes)
        except Exception:  # never let a capture take the engine down
            logger.exception("request %s: capturing KV failed", capture.req_id)
            outcome = (0, 0, len(spans))
        self._count_outcome(outcome)

    def _writer_process(self) -> CaptureWriter | None:
        """The writer process, started on first use (``None``: it could not start; said once)."""
        if self._process is None:
            try:
                assert self._rotator is not None
                rope = portable_rope_config(self._hf_config, self._rotator)
                self._process = CaptureWriter(str(self._pool.root), self._pool.redis_url, rope, self._count_outcome)
            except OSError as exc:
                logger.warning("the capture writer process cannot start (%s); captures are stored in vLLM's process",
                               exc)
                self._process = False
        return self._process or None

    def _count_outcome(self, outcome: tuple[int, int, int], dropped: int = 0) -> None:
        stored, tokens, errors = outcome
        with self._stats_lock:
            self._stats.data["captures"] += stored
            self._stats.data["captured_tokens"] += tokens
            self._stats.data["capture_errors"] += errors
            self._stats.data["capture_dropped"] += dropped

    def shutdown(self) -> None:
        """Hand over the queued captures, stop the hand-off thread, then let the writer process
        store what it was sent and exit."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._process:
            self._process.close()
            self._process = None


def _yield_to_requests() -> None:
    """The capture hand-off thread's setup, to keep its work (the hand-over; the keys' inverse
    RoPE only where no writer process unrotates them) out of the requests' way: its torch work
    runs on one thread (a second OpenMP team beside the forward pass's makes both wait at
    their barriers) and, on Linux, at the lowest CPU priority (nice 19, this thread only).
    docs/decisions.md, "Capture off the request's path", says what it changed."""
    torch.set_num_threads(1)  # this thread's OpenMP setting: the forward pass's thread keeps its own
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: only the thread count changes
        pass


def _writer(layer: Any):
    """``write(keys, values, slots)`` through the layer's attention backend (its own cache layout and ISA)."""
    def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    return write
