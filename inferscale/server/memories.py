"""Memories over HTTP, with the routes and JSON shapes of Mem0's OSS server
(``server/main.py`` in mem0ai/mem0): ``POST /memories``, ``GET /memories``,
``GET /memories/{id}``, ``POST /search``, ``PUT /memories/{id}``,
``GET /memories/{id}/history``, ``DELETE /memories/{id}``, ``DELETE /memories``,
``POST /reset``; ``POST /memories/list`` (``get_all`` with metadata ``filters``);
``PUT /memories/batch`` and ``DELETE /memories/batch`` (the bodies of Mem0's
platform ``batch_update`` / ``batch_delete``, ``{"memories": [...]}``, scoped like ``POST``
routes); and ``POST /memories/check``, InferScale's own: the texts an add would refuse, and
why, with nothing written. ``POST /memories`` takes ``metadata`` as one object for every
message or a list of one per message.

Differences, each because InferScale's memories are scoped: the routes of one memory
take the scope as query parameters (``?user_id=alice``) and a memory of another scope is
404; ``PUT`` takes ``{"text", "metadata", "dedupe"}`` (the shape of Mem0's platform API; Mem0's
OSS server passes its body through as the text); without ``text`` it sets only the
``metadata`` fields given (``null`` removes one: :meth:`inferscale.Memory.update_metadata`). Every route is a thin call of
:class:`inferscale.Memory`; its errors become 400 (bad input) and 404 (no such memory).
Handlers are plain functions, so FastAPI runs them on its thread pool and the event
loop keeps serving chat while a write waits for its lock.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from inferscale.server.chat import ChatRequestError, scope_id
from inferscale.server.deps import MemoryDep
from inferscale.server.query import StrictQueryRoute


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1, max_length=128, description="'user' or 'assistant' (or another speaker name)")
    content: str


class ScopeFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None

    def scope(self) -> dict[str, str]:
        return _scope(self.user_id, self.agent_id, self.run_id)


class MemoryCreate(ScopeFields):
    messages: list[Message] | str = Field(description="messages to remember, or one text")
    metadata: dict[str, Any] | list[dict[str, Any] | None] | None = Field(
        default=None, description="attached to every memory; or a list of one object (or null) per message")
    infer: bool = Field(default=False, strict=True, description="extract facts with the served LLM (Mem0's infer=True)")
    dedupe: bool = Field(default=True, strict=True, description="false: store each message even when the scope "
                         "already holds its text (a new memory); needs infer=false")


class SearchRequest(ScopeFields):
    query: str
    limit: int | None = Field(default=None, ge=1, le=10_000, strict=True, description="most results (default 100)")
    top_k: int | None = Field(default=None, ge=1, le=10_000, strict=True, description="Mem0's current name for limit")
    threshold: float | None = None
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters; Mem0's current style "
                                           "puts the scope here too ({'user_id': 'alice', ...})")
    mode: Literal["hybrid", "dense"] | None = Field(default=None, description="ranking: 'hybrid' (cosine and BM25 "
                                                    "fused) or 'dense' (cosine); default the server's search_mode")
    show_expired: bool = Field(default=False, strict=True, description="also find memories whose metadata "
                               "expires_at (epoch seconds) has passed")

    def scope(self) -> dict[str, str]:
        """The body's scope fields, or none when ``filters`` carries the scope (Mem0's current style)."""
        if not any((self.user_id, self.agent_id, self.run_id)) and isinstance(self.filters, dict) and any(
                isinstance(self.filters.get(k), str) for k in ("user_id", "agent_id", "run_id")):
            return {}
        return super().scope()


class MemoryList(ScopeFields):
    filters: dict[str, Any] | None = Field(default=None, description="metadata filters, as POST /search takes them")
    limit: int = Field(default=100, ge=0, le=100_000, strict=True, description="most memories returned")


class TextsCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    texts: list[str] = Field(max_length=10_000, description="texts to check as POST /memories with infer=false "
                             "checks each message (not empty, valid Unicode, within max_fact_tokens); nothing is written")


class MemoryUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(default=None, description="the memory's new text; omitted: only the metadata fields "
                             "given are set (null removes one), keeping the text, embedding, KV and updated_at")
    metadata: dict[str, Any] | None = None
    dedupe: bool = Field(default=True, strict=True, description="false: take a text another memory of the scope "
                         "holds (else refused)")


class BatchUpdateItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_id: str
    text: str | None = Field(default=None, description="the new text; omitted: only the metadata fields given are "
                             "set (null removes one), as PUT /memories/{id} without text")
    metadata: dict[str, Any] | None = None

    def entry(self) -> dict:
        """The entry as :meth:`inferscale.Memory.batch_update` takes it (absent fields left out)."""
        return {"memory_id": self.memory_id, **({"text": self.text} if self.text is not None else {}),
                **({"metadata": self.metadata} if self.metadata is not None else {})}


class BatchUpdate(ScopeFields):
    memories: list[BatchUpdateItem] = Field(min_length=1, max_length=10_000, description="the memories to change")
    dedupe: bool = Field(default=True, strict=True, description="false: take a text another memory of the scope "
                         "holds (else refused)")


class BatchDeleteItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_id: str


class BatchDelete(ScopeFields):
    memories: list[BatchDeleteItem] = Field(min_length=1, max_length=10_000, description="the memories to delete")


def _scope(user_id: str | None, agent_id: str | None, run_id: str | None) -> dict[str, str]:
    out = {"user_id": scope_id(user_id, "user_id"), "agent_id": scope_id(agent_id, "agent_id"),
           "run_id": scope_id(run_id, "run_id")}
    out = {k: v for k, v in out.items() if v is not None}
    if not out:
        raise ChatRequestError("say whose memories: give user_id, agent_id or run_id (a query parameter, e.g. "
                               "?user_id=alice, or a field of the JSON body on POST routes)")
    return out


def router() -> APIRouter:
    """The Mem0-style routes, over the app's :class:`inferscale.Memory` (:data:`~inferscale.server.deps.MemoryDep`)."""
    r = APIRouter(tags=["memories"], route_class=StrictQueryRoute)

    @r.post("/memories", summary="Add memories")
    def add(body: MemoryCreate, memory: MemoryDep) -> dict:
        messages = body.messages if isinstance(body.messages, str) else [m.model_dump() for m in body.messages]
        return memory.add(messages, metadata=body.metadata, infer=body.infer, dedupe=body.dedupe,
                          **body.scope())

    @r.post("/memories/check", summary="Check texts as an add would, writing nothing")
    def check(body: TextsCheck, memory: MemoryDep) -> dict:
        """``{"results": [{"ok", "error"}]}``, one per text in order: a client that writes several
        memories (a LangGraph store's batch) checks them all before it writes any, since only
        the server counts tokens in its model's tokenizer."""
        results = []
        for i, text in enumerate(body.texts):
            try:
                memory.check_fact_length(text, f"text {i}")
                results.append({"ok": True, "error": None})
            except (TypeError, ValueError) as exc:
                results.append({"ok": False, "error": str(exc)})
        return {"results": results}

    @r.put("/memories/batch", summary="Update several memories in one write (Mem0's batch_update)")
    def batch_update(body: BatchUpdate, memory: MemoryDep) -> dict:
        return memory.batch_update([m.entry() for m in body.memories], dedupe=body.dedupe,
                                   **body.scope())

    @r.delete("/memories/batch", summary="Delete several memories in one write (Mem0's batch_delete)")
    def batch_delete(body: BatchDelete, memory: MemoryDep) -> dict:
        return memory.batch_delete([m.model_dump() for m in body.memories], **body.scope())

    @r.post("/memories/list", summary="Get all memories of a scope matching metadata filters")
    def get_all_filtered(body: MemoryList, memory: MemoryDep) -> dict:
        """``get_all`` with ``filters``: what ``GET /memories`` cannot carry; no query is embedded."""
        return memory.get_all(filters=body.filters, limit=body.limit, **body.scope())

    @r.get("/memories", summary="Get all memories of a scope")
    def get_all(memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None, limit: int = Query(default=100, ge=0, le=100_000)) -> dict:
        return memory.get_all(limit=limit, **_scope(user_id, agent_id, run_id))

    @r.get("/memories/{memory_id}", summary="Get a memory")
    def get(memory_id: str, memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None) -> dict:
        return memory.get(memory_id, **_scope(user_id, agent_id, run_id))

    @r.post("/search", summary="Search memories")
    def search(body: SearchRequest, memory: MemoryDep) -> dict:
        return memory.search(body.query, limit=body.limit, top_k=body.top_k, threshold=body.threshold,
                             filters=body.filters, mode=body.mode, show_expired=body.show_expired, **body.scope())

    @r.put("/memories/{memory_id}", summary="Update a memory")
    def update(memory_id: str, body: MemoryUpdate, memory: MemoryDep, user_id: str | None = None,
               agent_id: str | None = None, run_id: str | None = None) -> dict:
        scope = _scope(user_id, agent_id, run_id)
        if body.text is None:  # a metadata-only update: nothing is embedded, the KV stays valid
            if body.metadata is None:
                raise ValueError("give text (with metadata, to replace both) or metadata alone (to set those "
                                 "fields, keeping the text)")
            return memory.update_metadata(memory_id, body.metadata, **scope)
        return memory.update(memory_id, body.text, metadata=body.metadata, dedupe=body.dedupe, **scope)

    @r.get("/memories/{memory_id}/history", summary="Get a memory's history")
    def history(memory_id: str, memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None) -> list[dict]:
        return memory.history(memory_id, **_scope(user_id, agent_id, run_id))

    @r.delete("/memories/{memory_id}", summary="Delete a memory")
    def delete(memory_id: str, memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None) -> dict:
        return memory.delete(memory_id, **_scope(user_id, agent_id, run_id))

    @r.delete("/memories", summary="Delete all memories of a scope")
    def delete_all(memory: MemoryDep, user_id: str | None = None, agent_id: str | None = None,
                   run_id: str | None = None) -> dict:
        return memory.delete_all(**_scope(user_id, agent_id, run_id))

    @r.post("/reset", summary="Delete every memory, turn and KV of the store")
    def reset(memory: MemoryDep) -> dict:
        memory.reset()
        return {"message": "All memories reset"}

    return r
