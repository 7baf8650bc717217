"""``inferscale serve``: memory as a service on vLLM's own OpenAI server (docs/server.md).

The front (FastAPI) talks to vLLM over HTTP only; it imports no vLLM.
"""
