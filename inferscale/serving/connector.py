"""InferScale's vLLM v1 KV connector: injects precomputed fact KV into the paged cache.

Load it in any vLLM engine with::

    KVTransferConfig(
        kv_connector="InferScaleConnector",
        kv_connector_module_path="inferscale.serving.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kv_dir": "<data_dir>/kv"},
    )

and send requests whose ``kv_transfer_params`` carry an ``"inferscale"`` entry, as built
by :meth:`inferscale.Memory.inject`::

    {"inferscale": {"memory_end": 412,
                    "segments": [["_preamble/<hash>", 0, 31], ["<fact_id>/<hash>", 31, 18], ...]}}

Scheduler side: the request's first ``memory_end`` prompt tokens are claimed as
externally computed when every segment's KV is in the pool; otherwise nothing is
claimed and vLLM prefills the memory text (the fallback). Worker side: before the
forward pass, each segment's pre-RoPE keys are rotated to their prompt positions and
written, with the values, into the request's blocks through the attention backend's own
``do_kv_cache_update`` (slot = block_id * block_size + offset). A segment that cannot be
read at that point reports its blocks through ``get_block_ids_with_load_errors`` so
vLLM recomputes them: attention never reads claimed-but-unwritten blocks.

The connector never saves KV (``save_kv_layer`` is a no-op): fact KV is produced by
:class:`inferscale.kv.encoder.KVEncoder`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inferscale.kv.encoder import best_device
from inferscale.kv.pool import KVPool, validate_key
from inferscale.kv.rope import RopeRotator

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PARAMS_KEY = "inferscale"

#: Process-wide record of what the connectors injected, by request id (read by the
#: engine's timings; in-process engines only). Bounded: the oldest entries are dropped.
INJECTION_LOG: "OrderedDict[str, dict[str, int]]" = OrderedDict()
_INJECTION_LOG_MAX = 10_000


@dataclass(frozen=True)
class InjectionPlan:
    """What one request asks the connector to inject (parsed ``kv_transfer_params``).

    Attributes:
        memory_end: prompt tokens covered by the segments.
        segments: ``(pool key, start position, num tokens)`` triples, contiguous from 0.
    """

    memory_end: int
    segments: tuple[tuple[str, int, int], ...]

    @classmethod
    def from_params(cls, params: dict | None) -> "InjectionPlan | None":
        """Parse and validate; ``None`` when the request carries no InferScale entry.

        Raises:
            ValueError: the entry is malformed (bad key, gaps or overlaps between segments).
        """
        if not isinstance(params, dict) or PARAMS_KEY not in params:
            return None
        entry = params[PARAMS_KEY]
        try:
            if not isinstance(entry, dict):
                raise TypeError(f"expected a dict, got {type(entry).__name__}")
            segments = tuple((validate_key(k), _count(s), _count(n)) for k, s, n in entry["segments"])
            memory_end = _count(entry["memory_end"])
        except Exception as exc:  # anything malformed must be rejected, never crash the engine
            raise ValueError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from exc
        pos = 0
        for key, start, num in segments:
            if start != pos or num <= 0:
                raise ValueError(f"segment {key} at {start} (+{num}) does not continue at position {pos}")
            pos += num
        if pos != memory_end:
            raise ValueError(f"segments cover {pos} tokens but memory_end is {memory_end}")
        return cls(memory_end, segments)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


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


class InferScaleConnector(KVConnectorBase_V1):
    """vLLM KV connector serving InferScale's fact KV; see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "kv_dir" not in extra:
            raise ValueError("InferScaleConnector needs kv_connector_extra_config={'kv_dir': <KV pool folder>}")
        self._block_size = vllm_config.cache_config.block_size
        self._pool = KVPool.shared(
            extra["kv_dir"], best_device(), int(extra.get("device_budget_bytes", 2 << 30))
        )
        # scheduler side
        self._pending: dict[str, tuple[InjectionPlan, int]] = {}
        self._to_load: dict[str, tuple[InjectionPlan, int, list[int]]] = {}
        # worker side
        self._rotator: RopeRotator | None = None
        self._failed_blocks: set[int] = set()
        if role == KVConnectorRole.WORKER:
            self._rotator = RopeRotator(vllm_config.model_config.hf_config)

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        try:
            plan = InjectionPlan.from_params(request.kv_transfer_params)
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the engine down
            logger.warning("request %s: %s; prefilling instead", request.request_id, exc)
            return 0, False
        if plan is None:
            return 0, False
        if plan.memory_end >= request.num_prompt_tokens:
            logger.warning("request %s: memory block covers the whole prompt; prefilling", request.request_id)
            return 0, False
        if plan.memory_end <= num_computed_tokens:
            return 0, False
        missing = [key for key, _, _ in plan.segments if not self._pool.contains(key)]
        if missing:
            logger.warning("request %s: %d segment(s) not in the KV pool; prefilling", request.request_id, len(missing))
            return 0, False
        self._pending[request.request_id] = (plan, num_computed_tokens)
        return plan.memory_end - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens > 0 and pending is not None:
            plan, start = pending
            self._to_load[request.request_id] = (plan, start, [])
            INJECTION_LOG[request.request_id] = {"injected_tokens": num_external_tokens, "start": start}
            while len(INJECTION_LOG) > _INJECTION_LOG_MAX:
                INJECTION_LOG.popitem(last=False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = InferScaleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            entry = self._to_load.pop(new_req.req_id, None)
            if entry is not None:
                plan, start, _ = entry
                meta.loads.append(LoadSpec(new_req.req_id, plan, start, list(new_req.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._to_load and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                plan, start, _ = self._to_load.pop(req_id)
                meta.loads.append(LoadSpec(req_id, plan, start, list(cached.new_block_ids[i][0])))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ---------------- worker side ----------------

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, InferScaleConnectorMetadata) or not meta.loads:
            return
        from vllm.model_executor.models.utils import extract_layer_index

        layers = {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")
        }
        assert self._rotator is not None
        for load in meta.loads:
            staged = self._stage(load)
            if staged is None:
                continue
            keys, values, pos, slots = staged
            tables = self._rotator.cos_sin(pos)  # once per request, shared by every layer
            slots_on: dict[torch.device, torch.Tensor] = {}
            # One layer at a time: its rotated keys ([N, H, D], ~1.1 MiB in fp32 at k=50
            # for SmolLM2) stay in cache between the rotation and the write, instead of a
            # rotated copy of every layer's keys going through memory first.
            for name, layer in layers.items():
                cache = layer.kv_cache
                idx = extract_layer_index(name)
                layer_slots = slots_on.get(cache.device)
                if layer_slots is None:
                    layer_slots = slots_on[cache.device] = slots.to(cache.device)
                layer.impl.do_kv_cache_update(
                    layer, self._rotator.rotate(keys[idx], pos, tables).to(cache.device, cache.dtype),
                    values[idx].to(cache.device, cache.dtype), cache, layer_slots,
                )

    def _stage(self, load: LoadSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Gather the pre-RoPE KV for ``load``, or ``None``.

        Returns:
            ``(keys, values, positions, slots)``: keys and values ``[L, N, H, D]`` on the
            pool's device, the ``N`` prompt positions they are served at (on that device)
            and their ``N`` slots (block_id * block_size + offset, on the CPU).
        """
        parts_k, parts_v, positions = [], [], []
        for key, seg_start, num in load.plan.segments:
            seg_end = seg_start + num
            if seg_end <= load.start:
                continue  # already computed (prefix cache)
            kv = self._pool.get(key)
            if kv is None or kv.num_tokens != num:
                logger.error("request %s: KV %s unreadable at load time; recomputing", load.req_id, key)
                self._fail(load)
                return None
            lo = max(load.start, seg_start) - seg_start
            parts_k.append(kv.keys[:, lo:])
            parts_v.append(kv.values[:, lo:])
            positions.append(torch.arange(seg_start + lo, seg_end))
        if not positions:
            return None
        pos = torch.cat(positions)
        keys = torch.cat(parts_k, dim=1)
        values = torch.cat(parts_v, dim=1)
        block_ids = torch.tensor(load.block_ids, dtype=torch.long)
        slots = block_ids[pos // self._block_size] * self._block_size + pos % self._block_size
        return keys, values, pos.to(keys.device), slots

    def _fail(self, load: LoadSpec) -> None:
        first = load.start // self._block_size
        last = (load.plan.memory_end - 1) // self._block_size
        self._failed_blocks.update(load.block_ids[first : last + 1])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # fact KV comes from the encoder, never from served requests

    def wait_for_save(self) -> None:
        return
