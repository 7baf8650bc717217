"""The KV connector's counters: what :class:`~inferscale.serving.connector.InferScaleConnector`
counts on each side (:data:`STAT_DOCS`), how vLLM sums them (:class:`InjectionStats`, sent from
the worker and the scheduler to its stat loggers) and how they reach ``/metrics``
(:class:`InjectionPromMetrics`, ``vllm:inferscale_<field>_total``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

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
    "captures": "memory lines served as text whose KV was read out of the paged cache and stored (worker)",
    "captured_tokens": "tokens of those lines (worker)",
    "capture_read_s": "seconds reading captured KV out of the paged cache, on the request's step (worker)",
    "capture_errors": "captures that could not be stored (a full disk, an unreadable cache layout) (worker)",
    "capture_dropped": "memory lines not captured because the writer process was too far behind (worker)",
    "capture_skipped": "memory lines named for capture whose tokens are not the prompt's there (scheduler)",
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
