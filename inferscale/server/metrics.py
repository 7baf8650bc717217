"""The front's own Prometheus counters, appended to vLLM's on ``GET /metrics``."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferscale.server.chat import ChatPlan


class KVPoolCollector(Collector):
    """The front's KV pool on ``/metrics``, read at each scrape from ``kv_stats``
    (:meth:`inferscale.Memory.kv_stats`): ``inferscale_kv_hits_total{tier}``,
    ``inferscale_kv_misses_total``, ``inferscale_kv_evictions_total{tier}``,
    ``inferscale_kv_evicted_bytes_total{tier="disk"}``, ``inferscale_kv_writes_total``,
    ``inferscale_kv_reencodes_total``, ``inferscale_kv_encode_seconds_total``,
    ``inferscale_kv_encoder_yielded_seconds_total``, ``inferscale_kv_engine_encodes_total``,
    ``inferscale_kv_encoder_model_loaded`` and ``inferscale_kv_bytes{tier}`` (held now); with a
    Redis tier, ``inferscale_kv_hits_total{tier="redis"}``, ``inferscale_kv_redis_misses_total``,
    ``inferscale_kv_redis_writes_total``, ``inferscale_kv_redis_errors_total`` and
    ``inferscale_kv_redis_up`` (0 during an outage)."""

    def __init__(self, kv_stats: Callable[[], dict[str, float]]) -> None:
        self.kv_stats = kv_stats

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.kv_stats()
        except RuntimeError:  # the memory closed (shutting down)
            return
        hits = CounterMetricFamily("inferscale_kv_hits", "retrieved memories served as KV, by the tier that held it "
                                   "when the request was planned", labels=["tier"])
        evictions = CounterMetricFamily("inferscale_kv_evictions", "fact KV entries evicted from a tier past its "
                                        "budget", labels=["tier"])
        held = GaugeMetricFamily("inferscale_kv_bytes", "bytes of fact KV a tier holds", labels=["tier"])
        for tier in ("device", "host", "disk"):
            hits.add_metric([tier], s[f"served_{tier}"])
            evictions.add_metric([tier], s[f"{tier}_evictions"])
            held.add_metric([tier], s[f"{tier}_bytes"])
        if "redis_up" in s:
            hits.add_metric(["redis"], s["served_redis"])
        evicted = CounterMetricFamily("inferscale_kv_evicted_bytes", "bytes of fact KV evicted", labels=["tier"])
        evicted.add_metric(["disk"], s["disk_evicted_bytes"])
        yield hits
        yield evictions
        yield evicted
        yield held
        yield CounterMetricFamily("inferscale_kv_misses", "retrieved memories whose KV was in no tier when the request "
                                  "was planned (served as text, or encoded or quantized on the request path)",
                                  s["served_text"])
        yield CounterMetricFamily("inferscale_kv_writes", "fact KV entries written", s["writes"])
        yield CounterMetricFamily("inferscale_kv_captured_hits", "retrieved memories served as KV that an earlier "
                                  "request captured when it served them as text (also in inferscale_kv_hits)",
                                  s["served_captured"])
        yield CounterMetricFamily("inferscale_kv_encodes_skipped_captured", "background encodes not run because a "
                                  "request had captured the memory's KV", s["encodes_skipped_captured"])
        yield CounterMetricFamily("inferscale_kv_misses_not_kept", "misses served as text and not kept as KV: their "
                                  "first use within kv_admission_window_s", s["misses_not_kept"])
        yield CounterMetricFamily("inferscale_kv_reencodes", "fact KV written again after it was evicted",
                                  s["reencodes"])
        yield CounterMetricFamily("inferscale_kv_encode_seconds", "seconds the background encoder spent encoding "
                                  "fact KV", s["encode_seconds"])
        yield CounterMetricFamily("inferscale_kv_encoder_yielded_seconds", "seconds the background encoder waited "
                                  "for requests in flight to end before a batch", s["encoder_yielded_seconds"])
        yield CounterMetricFamily("inferscale_kv_engine_encodes", "memory KV encoded by the serving engine "
                                  "(kv_encoder engine: a prefill-only request below every request)", s["engine_encodes"])
        yield GaugeMetricFamily("inferscale_kv_encoder_model_loaded", "1 when this front process loaded the LLM's "
                                "weights to encode KV (kv_encoder transformers), 0 when the engine encodes",
                                s["encoder_model_loaded"])
        if "redis_up" in s:
            yield CounterMetricFamily("inferscale_kv_redis_misses", "fact KV asked of Redis and not found there "
                                      "(or Redis down)", s["redis_misses"])
            yield CounterMetricFamily("inferscale_kv_redis_writes", "fact KV written through to Redis",
                                      s["redis_writes"])
            yield CounterMetricFamily("inferscale_kv_redis_errors", "Redis calls that failed (timeouts, refused "
                                      "connections)", s["redis_errors"])
            yield GaugeMetricFamily("inferscale_kv_redis_up", "1 while the Redis KV tier answers, 0 during an outage",
                                    s["redis_up"])


class FrontMetrics:
    """The front's Prometheus counters (a registry of its own, appended to vLLM's ``/metrics``).

    Args:
        kv_stats: the KV pool's counters (:meth:`inferscale.Memory.kv_stats`); ``None``: not exported.
    """

    def __init__(self, kv_stats: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry()
        if kv_stats is not None:
            self.registry.register(KVPoolCollector(kv_stats))
        self.requests = Counter("inferscale_chat_requests", "chat requests, by memory mode", ["mode"],
                                registry=self.registry)
        self.memories = Counter("inferscale_chat_memories", "memories placed in chat prompts, by how: 'kv' "
                                "(injected) or 'text' (prefilled)", ["source"], registry=self.registry)
        self.kv_tokens = Counter("inferscale_chat_planned_kv_tokens", "prompt tokens planned as KV",
                                 registry=self.registry)
        self.injected = Counter("inferscale_chat_injected_tokens", "prompt tokens the connector injected "
                                "(non-streamed responses)", registry=self.registry)
        self.prepare = Histogram("inferscale_chat_prepare_seconds", "retrieval and memory-block layout per request",
                                 registry=self.registry)

    def observe(self, plan: ChatPlan, prepare_s: float) -> None:
        self.requests.labels(plan.mode).inc()
        if plan.block is not None:
            self.memories.labels("kv").inc(len(plan.block.kv_memory_ids))
            self.memories.labels("text").inc(len(plan.block.text_memory_ids))
            if plan.block.plan is not None:
                self.kv_tokens.inc(plan.block.memory_tokens)
            self.prepare.observe(prepare_s)
