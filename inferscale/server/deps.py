"""The front's typed dependencies (FastAPI's ``Depends``): what a route needs, read from the
app's state, which :func:`inferscale.server.app.create_app` sets once."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from inferscale.memory import Memory
from inferscale.server.metrics import FrontMetrics
from inferscale.server.upstream import Upstream


def front_memory(request: Request) -> Memory:
    """The :class:`~inferscale.memory.Memory` whose data dir the replicas' connector reads."""
    return request.app.state.memory


def front_upstream(request: Request) -> Upstream:
    """vLLM's OpenAI server, or vLLM's router in front of the replicas."""
    return request.app.state.upstream


def front_metrics(request: Request) -> FrontMetrics:
    """The front's Prometheus counters."""
    return request.app.state.metrics


MemoryDep = Annotated[Memory, Depends(front_memory)]
UpstreamDep = Annotated[Upstream, Depends(front_upstream)]
MetricsDep = Annotated[FrontMetrics, Depends(front_metrics)]
