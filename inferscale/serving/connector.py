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

The connector never saves KV (``save_kv_layer`` is a no-op): fact KV is produced by
:class:`inferscale.kv.encoder.KVEncoder`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from inferscale.runtime.sizes import DEFAULT_DEVICE_KV_BUDGET_BYTES
from inferscale.runtime.devices import best_device
from inferscale.kv.injection import (
    InjectionPlan,
    LayerWriter,
    MissingKVError,
    blocks_to_recompute,
    report_params,
    slot_mapping,
    stage,
    write_layers,
)
from inferscale.kv.pool import KVPool
from inferscale.kv.rope import RopeRotator

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class LoadSpec:
    """Worker instruction: write positions ``[start, plan.memory_end)`` into ``block_ids``."""

    req_id: str
    plan: InjectionPlan
    start: int
    block_ids: list[int]


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


#: counters of :class:`InjectionStats` (sums over the interval; seconds are wall time)
STAT_DOCS = {
    "loads": "requests whose KV was written into the paged cache (worker)",
    "injected_tokens": "tokens written into the paged cache (worker)",
    "stage_s": "seconds gathering segments from the pool, disk reads included (worker)",
    "write_s": "seconds rotating keys and writing every layer (worker)",
    "disk_reads": "segments read from the disk tier, not the device tier (worker)",
    "load_errors": "requests whose KV could not be read at load time; vLLM recomputed them (worker)",
    "lookups": "segment token look-ups that read the file system (scheduler)",
    "lookups_cached": "segment token look-ups answered from memory (scheduler)",
    "verified": "requests whose every planned segment holds the prompt's tokens (scheduler)",
    "fallbacks": "requests with a segment absent or not matching the prompt; the rest is prefilled (scheduler)",
    "missing_segments": "segments not in the pool, unreadable, or stored without token ids (scheduler)",
    "mismatched_segments": "segments whose stored tokens differ from the prompt's at their positions (scheduler)",
}
STAT_FIELDS = tuple(STAT_DOCS)


@dataclass
class InjectionStats(KVConnectorStats):
    """The connector's counters (:data:`STAT_FIELDS`), sent by vLLM from the worker and the
    scheduler to its stat loggers (``SchedulerStats.kv_connector_stats``), summed."""

    def __post_init__(self) -> None:
        for name in STAT_FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> "InjectionStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> "InjectionStats | None":
        """A copy of the counters, or ``None`` when all are zero; the counters restart at zero."""
        if self.is_empty():
            return None
        out = InjectionStats(data=dict(self.data))
        self.reset()
        return out


class InjectionPromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's ``/metrics``: one Prometheus counter per
    :data:`STAT_FIELDS` entry, named ``vllm:inferscale_<field>_total``, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:inferscale_{name}", documentation=f"InferScale KV connector: {doc}",
                                  labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in STAT_DOCS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self.counters and isinstance(value, (int, float)) and value > 0:
                self.counters[name][engine_idx].inc(value)


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
        # token ids of segments seen on disk: a key names immutable content, so it is never
        # re-read; one deleted since is caught at load time and recomputed
        # (get_block_ids_with_load_errors)
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._stats = InjectionStats()
        # worker side
        self._rotator = RopeRotator(vllm_config.model_config.hf_config) if role == KVConnectorRole.WORKER else None
        self._failed_blocks: set[int] = set()

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            plan = InjectionPlan.from_params(request.kv_transfer_params)
        except ValueError as exc:  # a bad request must never take the engine down
            logger.warning("request %s: %s; prefilling instead", request.request_id, exc)
            return 0, False
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
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        injected = self._injected.pop(request.request_id, None)
        return False, None if injected is None else report_params(injected)

    # ---------------- worker side ----------------

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleConnectorMetadata) or not meta.loads:
            return
        from vllm.model_executor.models.utils import extract_layer_index

        writers = [
            LayerWriter(extract_layer_index(name), layer.kv_cache.device, layer.kv_cache.dtype, _writer(layer))
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")
        ]
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
        return  # fact KV comes from the encoder, never from served requests

    def wait_for_save(self) -> None:
        return


def _writer(layer: Any):
    """``write(keys, values, slots)`` through the layer's attention backend (its own cache layout and ISA)."""
    def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    return write
