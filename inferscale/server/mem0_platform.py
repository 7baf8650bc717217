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
- Every other field and route Mem0 has (categories, expiration dates, graph, reranking,
  projects, exports, webhooks, batch, feedback) answers a 400 or 404 naming it: never a
  silent no-op. Errors carry Mem0's ``detail`` beside InferScale's ``error`` object.
"""

from __future__ import annotations

import ast
import json
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import RedirectResponse
from starlette.routing import Match
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferscale.server.deps import MemoryDep
from inferscale.types import MemoryNotFoundError

#: Mem0's entity ids that are InferScale scope fields.
SCOPE_KEYS = ("user_id", "agent_id", "run_id")
#: Fields of Mem0's bodies accepted and acted on as documented above (or harmless: the org
#: and project the ping names, the API version, output formats).
_ACCEPTED = frozenset({"org_id", "project_id", "version", "output_format", "async_mode", "show_expired",
                       "latest_only"})
#: The Mem0 Platform routes served, for the 404 of any other Mem0 route.
SUPPORTED = ("GET /v1/ping/, POST /v1/memories/, POST /v3/memories/add/, GET /v1/memories/, POST /v2/memories/, "
             "POST /v3/memories/, POST /v{1,2,3}/memories/search/, GET/PUT/DELETE /v1/memories/{id}/, "
             "GET /v1/memories/{id}/history/, DELETE /v1/memories/, GET /v1/entities/, "
             "DELETE /v2/entities/{type}/{id}/")
DOCS = "docs/server.md, \"Mem0's own client\""
#: The keys of a memory in the Platform's shape (:func:`platform_item`).
ITEM_FIELDS = ("id", "memory", "user_id", "agent_id", "run_id", "app_id", "metadata", "categories", "created_at",
               "updated_at", "expiration_date", "score")
#: The organisation and project ``/v1/ping/`` names (one deployment is one Mem0 project).
ORG_ID = PROJECT_ID = "inferscale"


class Mem0Body(BaseModel):
    """A Mem0 request body: the fields InferScale acts on are declared; any other field is
    refused (400, naming it) unless :data:`_ACCEPTED` lists it."""

    model_config = ConfigDict(extra="allow")

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    app_id: str | None = None
    filters: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> "Mem0Body":
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if k not in _ACCEPTED and v is not None)
        if unknown:
            raise ValueError(f"field(s) {unknown} of Mem0's API are not supported by InferScale ({DOCS} lists "
                             "what is): remove them")
        extra = self.model_extra or {}
        for name, allowed in (("output_format", ("v1.0", "v1.1")), ("version", ("v1", "v2", "v3")),
                              ("async_mode", (True, False)), ("show_expired", (True, False)),
                              ("latest_only", (True, False))):
            if name in extra and extra[name] is not None and not any(
                    extra[name] is a or (type(a) is str and extra[name] == a) for a in allowed):
                raise ValueError(f"{name}={extra[name]!r}: give one of {list(allowed)}")
        for name in ("project_id", "org_id"):
            given = (self.model_extra or {}).get(name)
            if given not in (None, PROJECT_ID):
                raise ValueError(f"{name}={given!r}: this server is the single project {PROJECT_ID!r} "
                                 "(GET /v1/ping/ names it)")
        return self

    def wants_v1_list(self) -> bool:
        """Mem0's v1 answers a bare list for ``output_format`` v1.0 (its old default)."""
        return (self.model_extra or {}).get("output_format") in ("v1.0", None)


class AddBody(Mem0Body):
    messages: list[dict[str, Any]] | str = Field(description="the conversation (or one text) to remember")
    infer: bool = Field(default=True, strict=True, description="extract facts with the served LLM (Mem0's default)")


class ListBody(Mem0Body):
    page: int | None = Field(default=None, ge=1, strict=True)
    page_size: int | None = Field(default=None, ge=1, le=10_000, strict=True)


class SearchBody(Mem0Body):
    query: str = Field(min_length=1)
    top_k: int | None = Field(default=None, ge=1, le=10_000, strict=True)
    limit: int | None = Field(default=None, ge=1, le=10_000, strict=True)
    threshold: float | None = Field(default=None, ge=0.0, le=1.0, strict=True)
    keyword_search: bool | None = Field(default=None, strict=True)
    rerank: bool | None = Field(default=None, strict=True)
    fields: list[str] | None = None


    @model_validator(mode="after")
    def _agree(self) -> "SearchBody":
        if self.top_k is not None and self.limit is not None and self.top_k != self.limit:
            raise ValueError(f"top_k={self.top_k} and limit={self.limit} disagree: give one")
        unknown = sorted(set(self.fields or ()) - set(ITEM_FIELDS))
        if unknown:
            raise ValueError(f"fields {unknown} are not fields of a memory; they are {list(ITEM_FIELDS)}")
        return self


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    metadata: dict[str, Any] | None = None


def split_filters(body: Mem0Body) -> tuple[dict[str, str], dict | None]:
    """The scope and the metadata filters of a Mem0 body: entity ids from the top level, from
    ``filters`` or from the dicts of a top-level ``AND`` list in it (a clause that mixes an
    entity id with metadata conditions is split); ``filters["metadata"]`` (Mem0's metadata
    match) and, on v1 reads, the body's ``metadata`` become metadata conditions ANDed with the rest.

    Raises:
        ValueError: ``app_id`` anywhere, an entity id below the top level other than in a
            top-level ``AND`` list, an entity id that is not a string or is Mem0's wildcard,
            two values for one id, or no scope.
    """
    scope = {k: getattr(body, k) for k in SCOPE_KEYS if getattr(body, k) is not None}
    rest: dict[str, Any] = {}
    clauses: list[dict] = []
    for key, value in (body.filters or {}).items():
        if key in ("AND", "$and", "and") and isinstance(value, list):
            for clause in value:
                if isinstance(clause, dict) and set(clause) & {*SCOPE_KEYS, "app_id"}:
                    _take_scope(scope, {k: v for k, v in clause.items() if k in (*SCOPE_KEYS, "app_id")})
                    clause = {k: v for k, v in clause.items() if k not in (*SCOPE_KEYS, "app_id")}
                    if not clause:
                        continue
                clauses.append(clause)
        elif key in SCOPE_KEYS or key == "app_id":
            _take_scope(scope, {key: value})
        elif key == "metadata" and isinstance(value, dict):
            clauses.extend({k: v} for k, v in value.items())
        else:
            rest[key] = value
    if body.app_id is not None:
        _take_scope(scope, {"app_id": body.app_id})
    nested = _scope_key_inside(rest)
    if nested:
        raise ValueError(f"filters has {nested!r} below its top level (inside OR / NOT, or not in a top-level AND "
                         f"list): InferScale reads one scope per request; give it at the top of filters "
                         f"({{{nested!r}: ...}})")
    if not scope:
        raise ValueError("say whose memories: give user_id, agent_id or run_id (Mem0's v2/v3 style: "
                         "filters={'user_id': 'alice'})")
    if body.metadata and not isinstance(body, AddBody):  # v1 search/get_all: metadata is a filter
        clauses.extend({k: v} for k, v in body.metadata.items())
    if clauses:
        rest = {"AND": [rest, *clauses] if rest else clauses}
    return scope, rest or None


def _take_scope(scope: dict[str, str], clause: dict) -> None:
    for key, value in clause.items():
        if key == "app_id":
            raise ValueError("app_id is not supported: InferScale scopes memories by user_id, agent_id and run_id; "
                             "use agent_id for an application's memories")
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{key} must be a non-empty string, got {value!r} (operators apply to metadata only)")
        if value == "*":
            raise ValueError(f"{key}='*' (Mem0's wildcard) is not supported: InferScale reads one scope per request")
        if scope.get(key, value) != value:
            raise ValueError(f"{key} is given twice, as {scope[key]!r} and {value!r}: give it once")
        scope[key] = value


def _scope_key_inside(value: Any, depth: int = 0) -> str | None:
    if depth > 32:
        return None
    if isinstance(value, dict):
        found = next((k for k in value if k in (*SCOPE_KEYS, "app_id")), None)
        return found or next(filter(None, (_scope_key_inside(v, depth + 1) for v in value.values())), None)
    if isinstance(value, list):
        return next(filter(None, (_scope_key_inside(v, depth + 1) for v in value)), None)
    return None


def platform_item(item: dict, fields: list[str] | None = None) -> dict:
    """An InferScale memory item in the Platform's shape: ``{"id", "memory", "user_id",
    "agent_id", "app_id", "run_id", "metadata", "categories", "created_at", "updated_at",
    "expiration_date"}`` (and ``score`` for a search hit); only ``fields`` (and ``id``) when given."""
    out = {"id": item["id"], "memory": item["memory"], **{k: item.get(k) for k in SCOPE_KEYS}, "app_id": None,
           "metadata": item.get("metadata") or {}, "categories": [], "created_at": item["created_at"],
           "updated_at": item["updated_at"], "expiration_date": None}
    if "score" in item:
        out["score"] = item["score"]
    if fields:
        out = {k: v for k, v in out.items() if k == "id" or k in fields}
    return out


def check_query(request: Request, allowed: tuple[str, ...] = ()) -> None:
    """Refuse query parameters the route does not read, and any given twice.

    Raises:
        ValueError: naming them.
    """
    params = request.query_params
    allowed = (*allowed, "org_id", "project_id")  # older clients send the ping's on every call
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"query parameter(s) {unknown} are not read by {request.method} {request.url.path}"
                         + (f" (it reads {list(allowed)})" if allowed else " (it reads none)") + f"; see {DOCS}")
    twice = sorted(k for k in set(params) if len(params.getlist(k)) > 1)
    if twice:
        raise ValueError(f"query parameter(s) {twice} are given more than once: give each once")


def _query_scope(request: Request, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """A scope from query parameters (``?user_id=alice``, or ``?filters=...`` as Mem0's client
    sends a dict: JSON or Python's repr)."""
    check_query(request, (*SCOPE_KEYS, "app_id", "filters", *allowed))
    params = request.query_params
    filters = None
    if "filters" in params:
        raw = params["filters"]
        try:
            filters = json.loads(raw)
        except ValueError:
            try:
                filters = ast.literal_eval(raw)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                raise ValueError(f"filters={raw[:80]!r} is neither JSON nor a dict literal") from None
        if not isinstance(filters, dict) or not all(isinstance(k, str) for k in filters):
            raise ValueError(f"filters must be an object with string keys like {{'user_id': 'alice'}}, "
                             f"got {raw[:80]!r}")
    try:
        body = Mem0Body(filters=filters, **{k: params[k] for k in (*SCOPE_KEYS, "app_id", "org_id", "project_id")
                                            if k in params})
    except ValidationError as exc:  # pydantic's own text names its internals: the first message alone
        raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    scope, rest = split_filters(body)
    if rest:
        raise ValueError("this route takes a scope only (user_id / agent_id / run_id), not metadata filters")
    return scope


def router() -> APIRouter:
    """Mem0's Platform routes over the app's :class:`inferscale.Memory`; include it after every
    other router (its last route answers every other ``/v1/``, ``/v2/`` and ``/v3/`` path)."""
    r = APIRouter(tags=["mem0 platform"])

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
        scope, filters = split_filters(body)
        return [platform_item(i) for i in memory.get_all(filters=filters, limit=100_000, **scope)["results"]]

    def paged(items: list, page: int | None, size: int | None) -> list:
        size = size or 100
        return items[((page or 1) - 1) * size:][:size]

    @r.get("/v1/memories/", summary="Mem0: get all memories of a scope (v1)")
    def get_all_v1(request: Request, memory: MemoryDep, page: int | None = Query(default=None, ge=1),
                   page_size: int | None = Query(default=None, ge=1, le=10_000),
                   limit: int | None = Query(default=None, ge=1, le=100_000)) -> list:
        items = listed(Mem0Body(**_query_scope(request, ("page", "page_size", "limit"))), memory)
        return paged(items, page, page_size)[:limit] if page or page_size else items[:limit or 100]

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
        base = str(request.url.remove_query_params(["page", "page_size"]))

        def link(n: int) -> str:
            return f"{base}?page={n}&page_size={size}"
        return {"count": len(items), "next": link(page + 1) if page * size < len(items) else None,
                "previous": link(page - 1) if page > 1 else None, "results": paged(items, page, size)}

    def search(body: SearchBody, request: Request, memory) -> list[dict]:
        check_query(request)
        if body.rerank:
            raise ValueError("rerank=True is not supported: InferScale ranks by cosine and BM25 fused (hybrid); "
                             "drop rerank")
        scope, filters = split_filters(body)
        mode = "hybrid" if body.keyword_search else None
        hits = memory.search(body.query, top_k=body.top_k or body.limit or 10, threshold=body.threshold,
                             filters=filters, mode=mode, **scope)["results"]
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
        text = body.text if body.text is not None else memory.get(memory_id, **scope)["memory"]
        memory.update(memory_id, text, metadata=body.metadata, **scope)
        return platform_item(memory.get(memory_id, **scope))

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
        return memory.delete_all(**_query_scope(request))  # "<n> memories deleted successfully!"

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
            raise HTTPException(405, f"{request.method} {path}: this route takes {', '.join(methods)}")
        if not path.endswith("/") and any(route.matches({**request.scope, "path": path + "/"})[0] != Match.NONE
                                          for route in others):
            return RedirectResponse(request.url.replace(path=path + "/"), status_code=307)  # Mem0's paths end in /
        raise MemoryNotFoundError(f"no route {request.method} {path}: InferScale serves these of Mem0's Platform API: "
                                  f"{SUPPORTED}; and OpenAI's POST /v1/chat/completions, POST /v1/completions, "
                                  f"GET /v1/models ({DOCS})")

    return r
