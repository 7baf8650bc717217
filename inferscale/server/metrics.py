"""The front's own Prometheus counters, appended to vLLM's on ``GET /metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from inferscale.server.chat import ChatPlan


class FrontMetrics:
    """The front's Prometheus counters (a registry of its own, appended to vLLM's ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
