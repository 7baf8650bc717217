"""Mem0's Platform requests, read into InferScale's terms: the bodies Mem0's clients send
(pydantic models that refuse what InferScale does not act on), their entity ids and filters
split into a scope and metadata filters, query parameters checked, and InferScale's memory
items written in the Platform's shape. The routes are :mod:`inferscale.server.mem0_platform`.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inferscale.server import query

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


class BatchUpdateEntry(UpdateBody):
    memory_id: str


class BatchDeleteEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_id: str


class BatchUpdateBody(BaseModel):
    """``PUT /v1/batch/`` (``client.batch_update``): at most 1,000 memories, as Mem0's platform takes."""
    model_config = ConfigDict(extra="forbid")

    memories: list[BatchUpdateEntry] = Field(min_length=1, max_length=1000)


class BatchDeleteBody(BaseModel):
    """``DELETE /v1/batch/`` (``client.batch_delete``): at most 1,000 memories."""
    model_config = ConfigDict(extra="forbid")

    memories: list[BatchDeleteEntry] = Field(min_length=1, max_length=1000)


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
    """Refuse query parameters the route does not read, and any given twice
    (:func:`inferscale.server.query.check_query`, the check every route shares); Mem0's older
    clients send the ping's ``org_id`` and ``project_id`` on every call, so those are read too.

    Raises:
        ValueError: naming them.
    """
    query.check_query(request, (*allowed, "org_id", "project_id"), DOCS)


class Mem0QueryRoute(query.StrictQueryRoute):
    """The Platform routes' first check, before their bodies: no parameter twice, none that
    no Platform route reads (each route then checks its own with :func:`check_query`)."""

    also_read = (*SCOPE_KEYS, "app_id", "filters", "org_id", "project_id", "page", "page_size", "limit",
                 "delete_linked")


def query_scope(request: Request, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """A scope from query parameters (``?user_id=alice``, or ``?filters=...`` as Mem0's client
    sends a dict: JSON or Python's repr)."""
    check_query(request, (*SCOPE_KEYS, "app_id", "filters", *allowed))
    params = request.query_params
    filters = None
    if "filters" in params:
        raw = params["filters"]
        try:
            filters = json.loads(raw)
        except RecursionError:
            raise ValueError("filters are nested too deeply to read: flatten them") from None
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
    except RecursionError:
        raise ValueError("filters are nested too deeply to read: flatten them") from None
    scope, rest = split_filters(body)
    if rest:
        raise ValueError("this route takes a scope only (user_id / agent_id / run_id), not metadata filters")
    return scope
