"""The front's own routes: ``GET /health`` (the front is up; no key needed), ``GET /ready``
(vLLM answers too) and ``GET /metrics`` (vLLM's Prometheus metrics, the connector's
``vllm:inferscale_*`` counters among them, then the front's ``inferscale_*`` ones)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inferscale.server.deps import MetricsDep, UpstreamDep
from inferscale.server.errors import error
from inferscale.server.query import StrictQueryRoute


def router() -> APIRouter:
    """The health, readiness and metrics routes."""
    r = APIRouter(tags=["server"], route_class=StrictQueryRoute)

    @r.get("/health", summary="The front is up")
    async def health() -> dict:
        return {"status": "ok"}

    @r.get("/ready", summary="The front and vLLM are ready")
    async def ready(upstream: UpstreamDep) -> Response:
        answering = await upstream.health()
        if any(answering):
            return JSONResponse({"status": "ready", "replicas": answering})
        return error(503, "vLLM's server is not ready" if len(answering) == 1 else
                     "none of the vLLM replicas is ready", "server_error")

    @r.get("/metrics", summary="Prometheus metrics: vLLM's, then the front's")
    async def prometheus(upstream: UpstreamDep, metrics: MetricsDep) -> Response:
        text = await upstream.metrics() + generate_latest(metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return r
