"""Mem0's Platform API (``api.mem0.ai``) on ``inferscale serve``, for Mem0's own clients:
``mem0.MemoryClient(api_key=..., host="http://127.0.0.1:8000")`` (Python, ``mem0ai``) and the
``mem0ai`` npm client work against InferScale unchanged, and the memories they write are
injected as KV into chats like any other.

Routes (paths, bodies and answers as Mem0's OpenAPI description, ``docs/openapi.json`` in
mem0ai/mem0, gives them; ``Authorization: Token <key>`` is accepted beside ``Bearer``):

    ``GET /v1/ping/``                           the key works: ``{"status", "org_id", "project_id", "user_email"}``
    ``POST /v1/memories/``, ``POST /v3/memories/add/``          add
    ``GET /v1/memories/``, ``POST /v2/memories/``, ``POST /v3/memories/``   get_all
    ``POST /v1/memories/search/``, ``/v2/memories/search/``, ``/v3/memories/search/``   search
    ``GET`` / ``PUT`` / ``DELETE /v1/memories/{memory_id}/``    get, update, delete
    ``GET /v1/memories/{memory_id}/history/``   history
    ``DELETE /v1/memories/``                     delete_all of a scope
    ``GET /v1/entities/``, ``DELETE /v2/entities/{type}/{id}/``  users / delete_users

How Mem0's model maps onto InferScale's (docs/server.md, "Mem0's own client"):

- A scope is Mem0's entity ids, given at the top level (``user_id=``) or in ``filters``
  (``{"user_id": "alice"}``, also inside a top-level ``AND``). ``app_id`` has no InferScale
  counterpart and is refused. get_all and search read exactly one scope: ``{"user_id": "a"}``
  is the memories added with ``user_id="a"`` alone, not those added with an agent too.
- A memory is addressed by its id alone (Mem0's ids are global; so are InferScale's uuid4s).
- ``add`` is synchronous: the answer's ``status`` is ``"SUCCEEDED"`` with the written
  memories in ``results`` (Mem0 answers ``"PENDING"`` and an ``event_id`` to poll; ours is
  returned too, and ``GET /v1/event/{id}/`` says nothing is pending). ``infer`` defaults to
  ``True`` as in Mem0: the served LLM extracts facts; ``infer=False`` stores each message.
- ``threshold`` is a cosine similarity; ``keyword_search=True`` is InferScale's hybrid
  ranking (cosine and BM25 fused); ``fields`` keeps those keys of each result.
- ``batch_update`` / ``batch_delete`` (``PUT`` / ``DELETE /v1/batch/``) write each scope's
  memories in one write (:meth:`inferscale.Memory.batch_update`); every id is looked up
  before anything is written (an unknown one: 404, nothing changed); memories of several
  scopes are one write per scope. A metadata-only entry replaces the metadata, as ``update`` does.
- Every other field and route Mem0 has (categories, expiration dates, graph, reranking,
  projects, exports, webhooks, feedback) answers a 400 or 404 naming it: never a
  silent no-op. Errors carry Mem0's ``detail`` beside InferScale's ``error`` object.

The bodies, the reading of scopes and filters, and the item shape are
:mod:`inferscale.server.mem0_requests`; this module is the routes.
"""

from __future__ import annotations

import json
import uuid
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import RedirectResponse
from starlette.routing import Match

from inferscale.server.deps import MemoryDep
from inferscale.server.mem0_requests import (DOCS, ORG_ID, PROJECT_ID, SCOPE_KEYS, SUPPORTED, AddBody,
                                             BatchDeleteBody, BatchUpdateBody, ListBody,
                                             Mem0Body, Mem0QueryRoute, SearchBody, UpdateBody, check_query,
                                             platform_item, query_scope, split_filters)
from inferscale.types import MemoryNotFoundError


def router() -> APIRouter:
    """Mem0's Platform routes over the app's :class:`inferscale.Memory`; include it after every
    other router (its last route answers every other ``/v1/``, ``/v2/`` and ``/v3/`` path)."""
    r = APIRouter(tags=["mem0 platform"], route_class=Mem0QueryRoute)

    @r.get("/v1/ping/", summary="Mem0: check the API key")
    def ping(request: Request) -> dict:
        check_query(request)
        return {"status": "ok", "org_id": ORG_ID, "project_id": PROJECT_ID, "user_email": None}

    def add(body: AddBody, request: Request, memory) -> list[dict]:
        check_query(request)
        scope, conditions = split_filters(body)
        if conditions:
            raise ValueError(f"filters on add name the scope only (user_id / agent_id / run_id); got conditions "
                             f"{json.dumps(conditions)[:120]}: put metadata in 'metadata'")
        messages = body.messages
        if isinstance(messages, list):  # Mem0's messages may carry more keys (name, ...): role and content only
            messages = [{"role": m.get("role", "user"), "content": m.get("content")} for m in messages]
        written = memory.add(messages, metadata=body.metadata, infer=body.infer, **scope)["results"]
        return [e for e in written if e["event"] != "NOOP"]  # Mem0 reports changes only

    @r.post("/v3/memories/add/", summary="Mem0: add memories (v3)")
    def add_v3(body: AddBody, request: Request, memory: MemoryDep) -> dict:
        events = add(body, request, memory)
        return {"message": f"{len(events)} memories written", "status": "SUCCEEDED", "event_id": str(uuid.uuid4()),
                "results": [{"id": e["id"], "data": {"memory": e["memory"]}, "event": e["event"]} for e in events]}

    @r.post("/v1/memories/", summary="Mem0: add memories (v1)")
    def add_v1(body: AddBody, request: Request, memory: MemoryDep) -> Any:
        events = [{"id": e["id"], "memory": e["memory"], "event": e["event"], "data": {"memory": e["memory"]}}
                  for e in add(body, request, memory)]
        return events if body.wants_v1_list() else {"results": events, "relations": []}

    def listed(body: Mem0Body, memory) -> list[dict]:
        """The scope's memories as InferScale's items (shaped per page, by :func:`paged`)."""
        scope, filters = split_filters(body)
        return memory.get_all(filters=filters, limit=100_000, **scope)["results"]

    def paged(items: list, page: int | None, size: int | None) -> list[dict]:
        """One page of ``items``, in the Platform's shape."""
        size = size or 100
        return [platform_item(i) for i in items[((page or 1) - 1) * size:][:size]]

    @r.get("/v1/memories/", summary="Mem0: get all memories of a scope (v1)")
    def get_all_v1(request: Request, memory: MemoryDep, page: int | None = Query(default=None, ge=1),
                   page_size: int | None = Query(default=None, ge=1, le=10_000),
                   limit: int | None = Query(default=None, ge=1, le=100_000)) -> list:
        items = listed(Mem0Body(**query_scope(request, ("page", "page_size", "limit"))), memory)
        return paged(items, page, page_size)[:limit] if page or page_size else paged(items, 1, limit or 100)

    @r.post("/v2/memories/", summary="Mem0: get all memories (v2)")
    def get_all_v2(body: ListBody, request: Request, memory: MemoryDep) -> list:
        check_query(request)
        return paged(listed(body, memory), body.page, body.page_size)

    @r.post("/v3/memories/", summary="Mem0: get all memories, paginated (v3)")
    def get_all_v3(body: ListBody, request: Request, memory: MemoryDep, page: int | None = Query(default=None, ge=1),
                   page_size: int | None = Query(default=None, ge=1, le=10_000)) -> dict:
        check_query(request, ("page", "page_size"))
        for name, in_query, in_body in (("page", page, body.page), ("page_size", page_size, body.page_size)):
            if in_query is not None and in_body is not None and in_query != in_body:
                raise ValueError(f"{name} is {in_query} in the query and {in_body} in the body: give it once")
        page, size = body.page or page or 1, body.page_size or page_size or 100
        items = listed(body, memory)
        kept = urlencode([(k, v) for k, v in request.query_params.multi_items() if k not in ("page", "page_size")])

        def link(n: int) -> str:  # relative: a link built from the client's Host header would send it elsewhere
            return f"{request.url.path}?{kept + '&' if kept else ''}page={n}&page_size={size}"
        return {"count": len(items), "next": link(page + 1) if page * size < len(items) else None,
                "previous": link(page - 1) if page > 1 else None, "results": paged(items, page, size)}

    def search(body: SearchBody, request: Request, memory) -> list[dict]:
        check_query(request)
        if body.rerank:
            raise ValueError("rerank=True is not supported: InferScale ranks by cosine and BM25 fused (hybrid); "
                             "drop rerank")
        scope, filters = split_filters(body)
        mode = "hybrid" if body.keyword_search else None
        expired = (body.model_extra or {}).get("show_expired") is True  # Mem0's: metadata expires_at passed
        hits = memory.search(body.query, top_k=body.top_k or body.limit or 10, threshold=body.threshold,
                             filters=filters, mode=mode, show_expired=expired, **scope)["results"]
        return [platform_item(h, body.fields) for h in hits]

    @r.post("/v1/memories/search/", summary="Mem0: search (v1)")
    def search_v1(body: SearchBody, request: Request, memory: MemoryDep) -> Any:
        hits = search(body, request, memory)
        return hits if body.wants_v1_list() else {"results": hits}

    @r.post("/v2/memories/search/", summary="Mem0: search (v2)")
    def search_v2(body: SearchBody, request: Request, memory: MemoryDep) -> list:
        return search(body, request, memory)

    @r.post("/v3/memories/search/", summary="Mem0: search (v3)")
    def search_v3(body: SearchBody, request: Request, memory: MemoryDep) -> dict:
        return {"results": search(body, request, memory)}

    @r.get("/v1/memories/{memory_id}/", summary="Mem0: get a memory")
    def get(memory_id: str, request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        return platform_item(memory.get(memory_id, **memory.owner_of(memory_id)))

    @r.put("/v1/memories/{memory_id}/", summary="Mem0: update a memory")
    def update(memory_id: str, body: UpdateBody, request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        scope = memory.owner_of(memory_id)
        if body.text is None and body.metadata is None:
            raise ValueError("give text and/or metadata to update (timestamp and expiration_date are not supported)")
        if body.text is None:  # metadata alone: replaced as a patch, so the text, embedding and KV stay
            current = memory.get(memory_id, **scope).get("metadata") or {}
            patch = {**{k: None for k in current if k not in body.metadata}, **body.metadata}
            if patch:
                memory.update_metadata(memory_id, patch, **scope)
        else:
            memory.update(memory_id, body.text, metadata=body.metadata, **scope)
        return platform_item(memory.get(memory_id, **scope))

    @r.put("/v1/batch/", summary="Mem0: update up to 1,000 memories (batch_update)")
    def batch_update(body: BatchUpdateBody, request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        entries: dict[str, tuple[dict, list[dict]]] = {}
        for e in body.memories:  # every memory found, in its scope, before anything is written
            if e.text is None and e.metadata is None:
                raise ValueError(f"memory {e.memory_id}: give text and/or metadata to update")
            scope = memory.owner_of(e.memory_id)
            current = memory.get(e.memory_id, **scope).get("metadata") or {}
            if e.text is not None:
                entry = {"memory_id": e.memory_id, "text": e.text,
                         **({"metadata": e.metadata} if e.metadata is not None else {})}
            else:  # metadata alone: replaced, as update() does, through a patch that keeps the text and KV
                patch = {**{k: None for k in current if k not in e.metadata}, **e.metadata}
                if not patch:
                    continue  # {} over {}: nothing changes
                entry = {"memory_id": e.memory_id, "metadata": patch}
            entries.setdefault(json.dumps(scope, sort_keys=True), (scope, []))[1].append(entry)
        for scope, batch in entries.values():
            memory.batch_update(batch, **scope)
        return {"message": f"Successfully updated {len(body.memories)} memories"}

    @r.delete("/v1/batch/", summary="Mem0: delete up to 1,000 memories (batch_delete)")
    def batch_delete(body: BatchDeleteBody, request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        by_scope: dict[str, tuple[dict, list[dict]]] = {}
        for e in body.memories:  # every memory found, in its scope, before anything is deleted
            scope = memory.owner_of(e.memory_id)
            memory.get(e.memory_id, **scope)
            by_scope.setdefault(json.dumps(scope, sort_keys=True), (scope, []))[1].append({"memory_id": e.memory_id})
        for scope, batch in by_scope.values():
            memory.batch_delete(batch, **scope)
        return {"message": f"Successfully deleted {len(body.memories)} memories"}

    @r.delete("/v1/memories/{memory_id}/", summary="Mem0: delete a memory")
    def delete(memory_id: str, request: Request, memory: MemoryDep, delete_linked: bool = False) -> dict:
        check_query(request, ("delete_linked",))
        memory.delete(memory_id, **memory.owner_of(memory_id))  # InferScale links no memories: nothing cascades
        return {"message": "Memory deleted successfully!", "cascade_count": 0}

    @r.get("/v1/memories/{memory_id}/history/", summary="Mem0: a memory's history")
    def history(memory_id: str, request: Request, memory: MemoryDep) -> list[dict]:
        check_query(request)
        scope = memory.owner_of(memory_id)
        return [{"id": f"{memory_id}:{n}", "memory_id": memory_id, "input": [], "old_memory": e["old_memory"],
                 "new_memory": e["new_memory"], "event": e["event"], "categories": [], "metadata": {},
                 **{k: scope.get(k) for k in SCOPE_KEYS}, "app_id": None, "created_at": e["created_at"],
                 "updated_at": e["created_at"]} for n, e in enumerate(memory.history(memory_id, **scope))]

    @r.delete("/v1/memories/", summary="Mem0: delete every memory of a scope")
    def delete_all(request: Request, memory: MemoryDep) -> dict:
        return memory.delete_all(**query_scope(request))  # "<n> memories deleted successfully!"

    @r.get("/v1/entities/", summary="Mem0: users, agents and runs that hold memories")
    def entities(request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        found: dict[tuple[str, str], dict] = {}
        for s in memory.scopes():
            for key in SCOPE_KEYS:
                if key in s:
                    kind = key.removesuffix("_id")
                    e = found.setdefault((kind, s[key]), {"id": s[key], "name": s[key], "type": kind,
                                                          "owner": PROJECT_ID, "metadata": None, "total_memories": 0,
                                                          "created_at": s["created_at"], "updated_at": s["updated_at"]})
                    e["total_memories"] += s["memories"]
                    e["created_at"], e["updated_at"] = min(e["created_at"], s["created_at"]), \
                        max(e["updated_at"], s["updated_at"])
        results = list(found.values())
        counts = {f"total_{kind}s": sum(e["type"] == kind for e in results) for kind in ("user", "agent", "run")}
        return {"count": len(results), "next": None, "previous": None, "results": results, **counts,
                "total_apps": 0}

    @r.delete("/v2/entities/{entity_type}/{entity_id}/", summary="Mem0: delete a user's (agent's, run's) memories")
    def delete_entity(entity_type: str, entity_id: str, request: Request, memory: MemoryDep) -> dict:
        check_query(request)
        if entity_type not in ("user", "agent", "run"):
            raise ValueError(f"entity type {entity_type!r}: InferScale has users, agents and runs (no apps)")
        key = f"{entity_type}_id"
        owned = [s for s in memory.scopes() if s.get(key) == entity_id]
        if not owned:
            raise MemoryNotFoundError(f"no {entity_type} {entity_id!r} holds memories")
        for s in owned:  # every scope with this id: Mem0 deletes the entity's memories wherever they are
            memory.delete_all(**{k: s[k] for k in SCOPE_KEYS if k in s})
        return {"message": "Entity deleted successfully."}

    @r.get("/v1/event/{event_id}/", summary="Mem0: an add's event")
    def event(event_id: str) -> dict:
        raise MemoryNotFoundError(f"event {event_id!r} is not kept: InferScale adds synchronously, so an add's answer "
                                  "holds its results and status SUCCEEDED; nothing is pending")

    @r.api_route("/v{version:int}/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                 include_in_schema=False)
    def unsupported(version: int, rest: str, request: Request):
        path = request.url.path
        others = [route for route in request.app.routes if getattr(route, "endpoint", None) is not unsupported]
        methods = sorted({m for route in others if route.matches({**request.scope, "path": path})[0] == Match.PARTIAL
                          for m in getattr(route, "methods", ()) if m != "HEAD"})
        if methods:
            raise HTTPException(405, f"{request.method} is not a method of {path}: it takes {', '.join(methods)}",
                                headers={"Allow": ", ".join(methods)})  # RFC 9110, 15.5.6
        if not path.endswith("/") and any(route.matches({**request.scope, "path": path + "/"})[0] != Match.NONE
                                          for route in others):
            query = f"?{request.url.query}" if request.url.query else ""  # relative: the Host header is the client's
            return RedirectResponse(path + "/" + query, status_code=307)  # Mem0's paths end in /
        raise MemoryNotFoundError(f"no route {request.method} {path}: InferScale serves these of Mem0's Platform API: "
                                  f"{SUPPORTED}; and OpenAI's POST /v1/chat/completions, POST /v1/completions, "
                                  f"GET /v1/models ({DOCS})")

    return r
