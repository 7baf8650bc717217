"""The page at ``/ui``: what an agent remembers, and what each chat used.

``GET /ui`` (with ``/ui/app.js`` and ``/ui/style.css``) is a static page with no data in it,
served without the key like a login form; everything it shows comes from the data routes
below, which take the API key in an ``Authorization`` header as every other route does. The
page keeps the key in the tab's ``sessionStorage`` (never a cookie: a cross-site request has
no credential to ride on) and sends it only to the server it came from: its Content Security
Policy allows scripts, styles, images and requests from that origin alone (``blob:`` images:
the pool plot), and no inline script. The page writes every value as text (``textContent``),
never as markup, so a memory whose text is a ``<script>`` shows as that text.

Data routes (all read only; edits and deletes go through the REST routes of
:mod:`inferscale.server.memories`, searches through ``POST /search``):
    ``GET /ui/api/scopes``  scopes with their memory counts (:meth:`inferscale.Memory.scopes`)
    ``GET /ui/api/memories?user_id=...``  a scope's memories (oldest first, ``limit`` of them, and
    the scope's ``total``), each with its KV entries (:meth:`inferscale.Memory.kv_report`)
    ``GET /ui/api/chats?user_id=...``  a scope's recent chat reports (:meth:`inferscale.Memory.chats`)
    ``GET /ui/api/pool``  this worker's KV pool: budgets, counters, samples
    (:class:`~inferscale.server.pool_history.PoolHistory`); ``GET /ui/api/pool.svg`` their plot
"""

from __future__ import annotations

import os
from importlib import resources

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from inferscale.server.deps import MemoryDep
from inferscale.server.memories import _scope
from inferscale.server.pool_history import PoolHistory
from inferscale.server.query import StrictQueryRoute

_STATIC = {"/ui": ("index.html", "text/html; charset=utf-8"), "/ui/app.js": ("app.js", "text/javascript"),
           "/ui/style.css": ("style.css", "text/css"), "/ui/favicon.svg": ("favicon.svg", "image/svg+xml"),
           # browsers ask every origin for /favicon.ico: the same icon, not a 404 in their console
           "/favicon.ico": ("favicon.svg", "image/svg+xml")}
#: the page's files: answered without the key (they hold no data)
UI_PATHS = frozenset(_STATIC)
#: the page's own headers: scripts, styles, images and requests from this origin only
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache",
}
#: the data routes' responses are a user's memories: never stored by a cache
_NO_STORE = {"cache-control": "no-store"}
#: most memories one page load lists (the page says how many the scope holds; search finds any)
MAX_MEMORIES = 10_000
_WORKER = str(os.getpid())


def _page(name: str) -> bytes:
    return resources.files("inferscale.server").joinpath("static", name).read_bytes()


def _static(body: bytes, media_type: str):
    """A handler answering ``body``: it takes no parameters, so any query string is refused
    (:class:`~inferscale.server.query.StrictQueryRoute`) and nothing a client sends reaches the answer."""
    def serve() -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return serve


def router(history: PoolHistory) -> APIRouter:
    """The page and its data routes over the app's :class:`inferscale.Memory`.

    Args:
        history: this worker's pool samples.
    """
    r = APIRouter(tags=["ui"], route_class=StrictQueryRoute)
    for path, (name, media_type) in _STATIC.items():
        r.add_api_route(path, _static(_page(name), media_type), methods=["GET"], include_in_schema=False)

    @r.get("/ui/api/scopes", summary="Scopes with their memory counts")
    def scopes(memory: MemoryDep) -> JSONResponse:
        return JSONResponse({"scopes": memory.scopes()}, headers=_NO_STORE)

    @r.get("/ui/api/memories", summary="A scope's memories with their KV entries")
    def memories(memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
                 run_id: str | None = None, limit: int = Query(default=1000, ge=1, le=MAX_MEMORIES)) -> JSONResponse:
        scope = _scope(user_id, agent_id, run_id)
        items, kv, total = memory.kv_report(limit=limit, **scope)
        storage = memory.config.kv_storage_dtype
        return JSONResponse({"results": [{**m, "kv": kv.get(m["id"], [])} for m in items], "total": total,
                             "context_window": memory.config.context_window,
                             "storage": "the model's dtype" if storage == "auto" else storage}, headers=_NO_STORE)

    @r.get("/ui/api/chats", summary="A scope's recent chats: what each used")
    def chats(memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
              run_id: str | None = None, limit: int = Query(default=50, ge=1, le=1000)) -> JSONResponse:
        return JSONResponse({"results": memory.chats(limit=limit, **_scope(user_id, agent_id, run_id))},
                            headers=_NO_STORE)

    @r.get("/ui/api/pool", summary="This worker's KV pool: budgets, counters and samples over time")
    async def pool(memory: MemoryDep) -> JSONResponse:
        return JSONResponse({"worker": _WORKER, "budgets": history.budgets, "stats": memory.kv_stats(),
                             "samples": history.samples()[-360:]}, headers=_NO_STORE)

    @r.get("/ui/api/pool.svg", summary="This worker's KV pool over time, drawn")
    async def pool_svg() -> Response:
        svg = await run_in_threadpool(history.plot_svg)
        return Response(svg, media_type="image/svg+xml", headers=_NO_STORE)

    return r
