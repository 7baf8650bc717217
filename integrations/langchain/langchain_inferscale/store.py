"""``InferScaleStore``: a LangGraph ``BaseStore`` whose items are InferScale memories.

The mapping (decided in docs/adapters.md, "LangGraph store"):

- a namespace ``("users", X, ...)`` is stored in the scope ``user_id=X``, ``("agents", X, ...)``
  in ``agent_id=X``, ``("runs", X, ...)`` in ``run_id=X``; every other namespace in the
  store's own scope ``agent_id=<store_id>`` (default ``"langgraph"``);
- an item is one memory: its text is the value's ``content`` / ``text`` / ``memory`` string
  (the ``index`` fields when the put names them; else the value as compact JSON), and its
  metadata keeps the namespace, the key and the value whole (``metadata["langgraph"]``),
  so ``get`` / ``search`` give the value back as written (as JSON gives it back); items
  may share a text (puts add with ``dedupe=False``), as a key-value store's values may;
- an item put with ``index=False`` is stored with ``lg_indexed: False``: a search with a
  query ranks the other items and lists these after them, unscored, as ``InMemoryStore`` does;
- a store given LangGraph's ``index={"dims", "embed", "fields"}`` embeds each field path of an
  item with that embedder and ranks by the best cosine, as LangGraph's stores do (the vectors
  kept in the item's metadata, :mod:`langchain_inferscale._store_index`); without one, a
  query search is InferScale's own hybrid search;
- the scopes the store has written to are recorded as memories of one more scope
  (``agent_id=<store_id>:scopes``), so ``list_namespaces`` and searches under a prefix
  that names no scope find them;
- an item with a TTL keeps its expiry in its metadata (``expires_at``, epoch seconds, and
  ``lg_ttl_minutes``), so every process and client of the memory sees it: reads skip expired
  items before any sweep, and so do InferScale's own search and chat (the core's expiry,
  :data:`inferscale.store.records.EXPIRES_AT`), a read that refreshes moves ``expires_at`` with a metadata-only
  update (:meth:`inferscale.Memory.update_metadata`: nothing re-embedded, the KV kept,
  ``updated_at`` unmoved) and :meth:`InferScaleStore.sweep_ttl` deletes expired items.

Memories written here are memories like any other: ``ChatInferScale(user_id="alice")``
(or an OpenAI client through ``inferscale serve``) injects the KV of the items of
``("users", "alice", ...)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
)
from langgraph.store.base import validate_op_namespace
from langgraph.store.base.embed import get_text_at_path

from inferscale import Memory
from inferscale.integration import Scope, check_metadata
from langchain_inferscale._group_commit import GroupCommit
from langchain_inferscale._store_backends import MAX_RESULTS, _Http, _Local
from langchain_inferscale._store_filters import (_MatchesNothing, _namespace_filters, _value_field,
                                                 _value_filters)
from langchain_inferscale._store_index import VECTORS, StoreIndex

logger = logging.getLogger(__name__)

#: namespace heads that name an InferScale scope field: ``("users", "alice")`` -> ``user_id="alice"``
SCOPE_HEADS = {"users": "user_id", "agents": "agent_id", "runs": "run_id"}
#: value fields whose string becomes the memory's text, first present wins
TEXT_FIELDS = ("content", "text", "memory")
#: the keys of LangGraph's ``TTLConfig``
TTL_KEYS = ("default_ttl", "refresh_on_read", "sweep_interval_minutes", "omit_expired")
#: the longest TTL (minutes, about 1.9 million years): its expiry must stay a finite JSON number
MAX_TTL_MINUTES = 1e12
#: minutes between sweeps when neither ``start_ttl_sweeper`` nor ``ttl=`` says (SqliteStore's default)
DEFAULT_SWEEP_MINUTES = 5.0


def now() -> float:
    """The store's clock: epoch seconds (every expiry is written and compared with it)."""
    return time.time()


class InferScaleStore(BaseStore):
    """A LangGraph store over an InferScale memory, in-process (``memory=``) or over
    ``inferscale serve`` (``url=``).

    Items are memories (see the module docstring for the namespace -> scope mapping):
    ``put`` adds or updates one (``value=None`` deletes it), ``get`` reads it back,
    ``search`` runs InferScale's hybrid search (``query``) with the namespace prefix and the
    value ``filter`` as metadata filters, ``list_namespaces`` lists the namespaces that hold
    items. A batch reads first (one lookup per scope for all its gets and puts, one search
    per scope a search covers), then writes (per scope, one delete, one update and one add
    for all its puts, each embedded in one call and recorded in one transaction; the last
    put of a key winning), as ``InMemoryStore`` does. Concurrent batches (threads, or the
    coroutines of an ``asyncio.gather``) are joined into one (group commit); ``abatch`` runs
    the same code in a worker thread. Batches that write the same key run one at a time in
    this process (two concurrent puts of a key leave one item); two processes writing one
    key still race.

    TTL, as ``SqliteStore`` has it: ``put(..., ttl=minutes)`` gives the item an expiry (``ttl``
    omitted: ``ttl["default_ttl"]``, if the store has one; ``ttl=None``: none); ``get`` /
    ``search`` never return an expired item, nor ``list_namespaces`` its namespace, even
    before a sweep; with
    ``ttl={"refresh_on_read": True}`` a ``get`` or ``search`` (unless ``refresh_ttl=False``)
    pushes each returned item's expiry ``ttl`` minutes past now, without re-embedding it,
    invalidating its KV or moving its ``updated_at``; ``sweep_ttl()`` deletes the expired
    items (returning how many) and ``start_ttl_sweeper()`` runs it in a daemon thread every
    ``sweep_interval_minutes`` (``astart_ttl_sweeper`` / ``astop_ttl_sweeper`` /
    ``asweep_ttl`` from async code). A put of a key whose item expired unswept stores a new item.
    Until swept, an expired item is still a memory: ``ChatInferScale`` and the server inject it.

    Not supported: ``$ne`` on a field an item lacks (InferScale never matches a missing
    field; ``InMemoryStore`` does).

    Args:
        memory: the InferScale :class:`~inferscale.Memory` (in-process); or
        url: the base URL of ``inferscale serve`` (``http://127.0.0.1:8000``), with
        api_key: its key (``INFERSCALE_API_KEY``), if it has one;
        timeout: seconds an HTTP call may take (default 60).
        store_id: names the scope of namespaces that name no user, agent or run
            (``agent_id=store_id``) and the registry of scopes (``agent_id=store_id + ":scopes"``).
        text_fields: value fields whose string is the memory's text, first present wins.
        ttl: LangGraph's ``TTLConfig``: ``default_ttl`` (minutes, > 0, for puts that give no
            ``ttl``), ``refresh_on_read`` (bool, default ``False`` as in ``SqliteStore``: reads
            refresh only when it is ``True``), ``sweep_interval_minutes`` (> 0, for
            :meth:`start_ttl_sweeper`; default 5), ``omit_expired`` (taken, and always in effect:
            an expired item is never read, swept or not, as ``PostgresStore`` does with
            ``omit_expired=True``).
        index: LangGraph's ``IndexConfig`` (``dims``, ``embed``, ``fields``): a store-level
            embedder, as ``InMemoryStore(index=...)`` takes it. Each put embeds one vector per
            text its field paths match (the put's ``index`` list, else ``fields``, else the
            value as JSON), in one ``embed_documents`` call a batch; a query search embeds the
            query with ``embed_query`` and ranks the matching items by their best cosine (score
            in [-1, 1]). The memory's own text is the same fields' strings joined. ``None``
            (default): InferScale's own embedder and hybrid search rank (scores are cosines of
            its embedder, the order its fusion's).

    Raises:
        TypeError / ValueError: (constructor) neither or both of ``memory`` and ``url``, an
            argument of the wrong type, a ``ttl`` that is not a ``TTLConfig`` (an unknown key,
            a minute count that is not a positive number). ``put`` / ``batch``: a value that
            is not a dict, a ``ttl`` that is not a positive number of minutes, a namespace
            that maps to the store's registry scope, a malformed filter, ``offset + limit``
            over 10,000 (nothing of that op is written). Over HTTP:
            ``PermissionError`` (wrong key), ``ConnectionError`` (no server), ``RuntimeError``
            (a 5xx answer). ``put`` with ``index=``: whatever the embedder raises, and
            ``ValueError`` for vectors of another size than ``dims`` (nothing written).

    Example:
        >>> store = InferScaleStore(memory)            # or InferScaleStore(url="http://127.0.0.1:8000", api_key=key)
        >>> store.put(("users", "alice", "prefs"), "food", {"content": "I am allergic to peanuts."})
        >>> store.search(("users", "alice"), query="what can't I eat?")[0].value
        {'content': 'I am allergic to peanuts.'}
        >>> session = InferScaleStore(memory, ttl={"default_ttl": 60, "refresh_on_read": True})
        >>> session.put(("runs", "r1"), "scratch", {"content": "draft plan"})   # gone an hour after its last read
    """

    supports_ttl = True
    ttl_config: TTLConfig | None = None
    #: the ``index`` given (LangGraph's ``IndexConfig``), ``None`` without a store-level embedder
    index_config: dict | None = None
    #: its ``embed`` as LangChain ``Embeddings`` (``ensure_embeddings``), ``None`` without one
    embeddings: Any = None

    def __init__(self, memory: Memory | None = None, *, url: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, store_id: str = "langgraph", text_fields: Iterable[str] = TEXT_FIELDS,
                 ttl: TTLConfig | None = None, index: dict | None = None) -> None:
        if (memory is None) == (url is None):
            raise ValueError("give either memory= (an inferscale.Memory, in-process) or url= (inferscale serve), "
                             "not both or neither")
        if memory is not None and not isinstance(memory, Memory):
            raise TypeError(f"memory must be an inferscale.Memory, got {type(memory).__name__}")
        if not isinstance(store_id, str) or not store_id.strip() or len(store_id) > 100:
            raise ValueError(f"store_id must be a non-empty string of at most 100 characters, got {store_id!r}")
        fields = tuple(text_fields) if not isinstance(text_fields, str) else None
        if not fields or not all(isinstance(f, str) and f for f in fields):
            raise TypeError(f"text_fields must be a list of field names, got {text_fields!r}")
        self.ttl_config = _ttl_config(ttl)
        self.index = StoreIndex(index) if index is not None else None
        self.index_config = dict(index) if index is not None else None
        self.embeddings = self.index.embeddings if self.index is not None else None
        self.backend = _Local(memory) if memory is not None else _Http(url, api_key, timeout)
        self.store_id = store_id
        self.text_fields = fields
        self.default_scope = {"agent_id": store_id}
        self.registry_scope = {"agent_id": f"{store_id}:scopes"}
        self._registered: set[str] = set()
        self._writing = _AddressLocks()
        self._joined = GroupCommit(self._batch)
        self._sweeper: threading.Thread | None = None
        self._sweeper_stop = threading.Event()

    # ------------------------------------------------------------------ the mapping

    def scope_of(self, namespace: tuple[str, ...]) -> dict[str, str]:
        """The InferScale scope a namespace's items are stored in (``("users", "alice", ...)``
        -> ``{"user_id": "alice"}``; the store's own scope for other namespaces, and for a
        label no scope id can be: over 256 characters, blank, or with control characters,
        such as ``("users", "alice\\n")``)."""
        if len(namespace) >= 2 and namespace[0] in SCOPE_HEADS and _is_scope_id(namespace[1]):
            return {SCOPE_HEADS[namespace[0]]: namespace[1]}
        return dict(self.default_scope)

    def text_of(self, value: dict, index: list[str] | None = None) -> str:
        """The memory text of a value: the strings at the ``index`` paths, joined by spaces,
        when given and present; else the first string of ``text_fields``; else compact JSON."""
        if index:
            texts = [t for path in index for t in get_text_at_path(value, path) if t.strip()]
            if texts:
                return " ".join(texts)
        for name in self.text_fields:
            text = value.get(name)
            if isinstance(text, str) and text.strip():
                return text
        return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))

    # ------------------------------------------------------------------ batches

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order of reads then writes, as ``InMemoryStore`` does: every get,
        search and list sees the store as it was before the batch's puts. Batches that other
        threads (or coroutines, :meth:`abatch`) hand in while one runs are joined and run as
        one (:mod:`langchain_inferscale._group_commit`), as LangGraph's async stores gather the
        operations of one event-loop tick: a joined batch's reads see the store before all
        of its writes, and a failure runs each caller's batch again alone.

        Raises:
            TypeError / ValueError: an op is malformed (a non-dict value, a ``ttl`` that is
                not a positive number of minutes, a bad filter or limit); checked before
                anything is read or written. Over HTTP, as the class says.
        """
        ops = list(ops)
        for op in ops:
            self._check(op)
        return self._joined.call(ops)

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` from async code: the coroutines of one ``asyncio.gather`` are joined
        into few batches, each run in a worker thread (the event loop keeps running).

        Raises:
            As :meth:`batch`.
        """
        ops = list(ops)
        for op in ops:
            self._check(op)
        future, lead = self._joined.submit(ops)
        if lead:
            self._joined.lead_in_thread()
        return await asyncio.wrap_future(future)

    def _batch(self, ops: list[Op]) -> list[Result]:
        """One batch of checked ops (a joined one, from :meth:`batch`)."""
        puts = {(op.namespace, op.key): op for op in ops if isinstance(op, PutOp)}  # the last put of a key wins
        addressed = [(op.namespace, op.key) for op in ops if isinstance(op, GetOp)] + list(puts)
        fields = self.index.fields if self.index is not None else None
        texts = {address: self.text_of(op.value, op.index or fields) for address, op in puts.items()
                 if op.value is not None}
        vectors = dict(zip(puts, self.index.vectors(list(puts.values())))) if self.index is not None else {}
        # every put's memory is built and checked before any is written: a batch is refused whole
        prepared = {address: self._prepare(op, texts[address], vectors.get(address)) for address, op in puts.items()
                    if op.value is not None}
        # a put that a later put of its key replaces is checked too: its caller (in a joined batch,
        # another caller) is told it was bad, as it would be alone
        shadowed = [(op, self.text_of(op.value, op.index or fields)) for op in ops if isinstance(op, PutOp)
                    and op.value is not None and puts[(op.namespace, op.key)] is not op]
        for op, text in shadowed:
            self._prepare(op, text, None)
        self.backend.check_all({**{"/".join(op.namespace) + f"/{op.key} (replaced)": text for op, text in shadowed},
                                **{"/".join(ns) + f"/{key}": texts[(ns, key)] for ns, key in prepared}})
        refreshed: dict[tuple, dict] = {}  # address -> the memory read, for the reads that refresh its expiry
        # one key's writes, from any thread of this process, run one at a time: each looks the
        # item up and writes it before the next looks (two puts of a key leave one item)
        with self._writing.hold(_address(*address) for address in puts):
            found = self._lookup(addressed)
            at = now()
            everything: dict = {}  # the batch's shared reads: scope -> its items; "scopes": the registry
            searched: dict[str, list[dict]] = {}  # a search's key -> its hits
            results: list[Result] = []
            for op in ops:
                if isinstance(op, GetOp):
                    memory = found.get((op.namespace, op.key))
                    memory = None if memory is None or _expired(memory, at) else memory
                    if memory is not None and self._refreshes(op):
                        refreshed[(op.namespace, op.key)] = memory
                    results.append(_item(memory))
                elif isinstance(op, SearchOp):
                    asked = _search_key(op)  # a joined batch often repeats a search: run each once
                    if asked not in searched:
                        searched[asked] = self._search(op, at, everything)
                    hits = searched[asked]
                    if self._refreshes(op):
                        refreshed.update(((tuple(h["metadata"]["langgraph"]["namespace"]),
                                           h["metadata"]["langgraph"]["key"]), h) for h in hits)
                    results.append([_item(h, search=True, score=h.get("score")) for h in hits])
                elif isinstance(op, ListNamespacesOp):
                    results.append(self._list_namespaces(op, everything, at))
                else:
                    results.append(None)
            self._write_all(puts, found, texts, prepared)
        self._refresh({a: m for a, m in refreshed.items() if a not in puts and "lg_ttl_minutes" in m["metadata"]})
        return results

    def _check(self, op: Op) -> None:
        if not isinstance(op, (GetOp, SearchOp, ListNamespacesOp, PutOp)):
            raise TypeError(f"unknown store operation {type(op).__name__}")
        validate_op_namespace(op)
        if isinstance(op, PutOp):
            if op.value is not None and not isinstance(op.value, dict):
                raise TypeError(f"the value of {op.namespace}/{op.key} must be a dict, got {type(op.value).__name__}")
            if op.value is not None:
                try:
                    json.dumps(op.value)
                except (TypeError, ValueError) as exc:  # bytes, a set, an object; a value that holds itself
                    raise TypeError(f"the value of {op.namespace}/{op.key} cannot be stored as JSON ({exc}): use "
                                    "strings, numbers, booleans, None, lists and dicts") from None
            if op.ttl is not None:
                _minutes(f"the ttl of {op.namespace}/{op.key}", op.ttl)
            if op.index is not False and op.index is not None and (
                    not isinstance(op.index, list) or not all(isinstance(p, str) and p for p in op.index)):
                raise TypeError(f"index must be False or a list of field paths such as ['text', 'tags[*]'], got "
                                f"{op.index!r}")
            self._check_scope(op.namespace)
        if isinstance(op, (SearchOp, ListNamespacesOp)):
            for name in ("limit", "offset"):
                value = getattr(op, name)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
        if isinstance(op, ListNamespacesOp) and op.max_depth is not None and (
                isinstance(op.max_depth, bool) or not isinstance(op.max_depth, int) or op.max_depth < 0):
            raise ValueError(f"max_depth must be a whole number >= 0 or None, got {op.max_depth!r:.40}")
        if isinstance(op, SearchOp):
            if op.limit < 0 or op.offset < 0 or op.offset + op.limit > MAX_RESULTS:
                raise ValueError(f"search limit and offset must be >= 0 with offset + limit <= {MAX_RESULTS}, got "
                                 f"limit={op.limit}, offset={op.offset}")
            try:
                _value_filters(op.filter or {})  # a malformed filter is refused before anything runs
            except _MatchesNothing:
                pass
        if isinstance(op, ListNamespacesOp) and (op.limit < 0 or op.offset < 0):
            raise ValueError(f"limit and offset must be >= 0, got limit={op.limit}, offset={op.offset}")

    def _check_scope(self, namespace: tuple[str, ...]) -> None:
        scope = self.scope_of(namespace)
        if scope == self.registry_scope:
            raise ValueError(f"namespace {namespace} maps to the store's registry scope {scope}: use another name")

    # ------------------------------------------------------------------ reads

    def _lookup(self, addresses: list[tuple[tuple[str, ...], str]]) -> dict:
        """The stored memory of each address that has one: one listing per scope."""
        by_scope: dict[str, tuple[dict, set[str]]] = {}
        for namespace, key in addresses:
            scope = self.scope_of(namespace)
            by_scope.setdefault(_scope_key(scope), (scope, set()))[1].add(_address(namespace, key))
        found = {}
        for scope, wanted in by_scope.values():
            for memory in self.backend.list(scope, {"lg_item": {"in": sorted(wanted)}}):
                stored = memory["metadata"]["langgraph"]
                found[(tuple(stored["namespace"]), stored["key"])] = memory
        return found

    def _scopes_under(self, prefix: tuple[str, ...], reads: dict | None = None) -> list[dict]:
        """The scopes that may hold namespaces starting with ``prefix`` (``*`` matches any label);
        the registry is read once per batch (``reads``: the batch's shared reads)."""
        head = prefix[0] if prefix else "*"
        if head in SCOPE_HEADS and len(prefix) >= 2 and prefix[1] != "*":
            return [self.scope_of(prefix)]
        if head not in SCOPE_HEADS and head != "*":
            return [dict(self.default_scope)]
        if reads is None:
            return self._all_scopes()
        if "scopes" not in reads:
            reads["scopes"] = self._all_scopes()
        return reads["scopes"]

    def _all_scopes(self) -> list[dict]:
        found = self.backend.list(self.registry_scope, None)
        scopes = [m["metadata"]["langgraph_scope"] for m in found if "langgraph_scope" in m["metadata"]]
        self._registered.update(_scope_key(s) for s in scopes)
        return sorted(scopes, key=_scope_key)

    def _search(self, op: SearchOp, at: float, reads: dict | None = None) -> list[dict]:
        """The memories of the search's items, in order (a ranked one with its ``score``). A
        query ranks the indexed items (best first) and pages over them; when a page has
        room left, the items put with ``index=False`` fill it, oldest first and unscored
        (``InMemoryStore``'s way: they are never ranked, and the offset skips none of them).
        Without a query: every match, oldest first. Items expired at ``at`` match nothing.
        With a store-level embedder (``index=``), a query ranks every match by its vectors
        (:meth:`StoreIndex.rank`) and those without vectors fill the page the same way."""
        try:
            filters = {"lg_item": "*", **_namespace_filters(op.namespace_prefix), **_value_filters(op.filter or {}),
                       "NOT": [_expired_by(at)]}
        except _MatchesNothing:  # a NaN compared: no value equals or orders against it
            return []
        wanted = op.offset + op.limit
        scopes = self._scopes_under(op.namespace_prefix, reads)
        if not op.query:
            return [{**h, "score": None} for h in self._listing(scopes, filters)[op.offset:wanted]]
        if self.index is not None:
            ranked, scoreless = self.index.rank(op.query, self._listing(scopes, filters))
            found = ranked[op.offset:wanted]
            return found + [{**h, "score": None} for h in scoreless[:max(0, op.limit - len(found))]]
        indexed = {**filters, "NOT": [*filters["NOT"], {"lg_indexed": False}]}  # items from before lg_indexed
        hits = [h for scope in scopes for h in self.backend.search(op.query, scope, indexed, wanted)]  # lack it
        if len({_scope_key(_memory_scope(h)) for h in hits}) > 1:  # best first across scopes; one scope's
            hits.sort(key=lambda h: -h.get("score", 0.0))            # hybrid rank is kept
        found = hits[op.offset:wanted]
        if len(found) < op.limit:
            unindexed = self._listing(scopes, {**filters, "lg_indexed": False})
            found += [{**h, "score": None} for h in unindexed[:op.limit - len(found)]]
        return found

    def _listing(self, scopes: list[dict], filters: dict) -> list[dict]:
        """Every memory of ``scopes`` matching ``filters``, oldest first (as ``InMemoryStore`` lists)."""
        hits = [h for scope in scopes for h in self.backend.list(scope, filters)]
        return sorted(hits, key=lambda h: (h["created_at"], h["id"]))

    def _list_namespaces(self, op: ListNamespacesOp, everything: dict[str, list[dict]],
                         at: float) -> list[tuple[str, ...]]:
        prefix = next((c.path for c in op.match_conditions or () if c.match_type == "prefix"), ())
        namespaces = set()
        for scope in self._scopes_under(tuple(prefix), everything):
            key = _scope_key(scope)
            if key not in everything:
                everything[key] = self.backend.list(scope, {"lg_item": "*", "NOT": [_expired_by(at)]})
            namespaces.update(tuple(m["metadata"]["langgraph"]["namespace"]) for m in everything[key])
        kept = [ns for ns in namespaces if all(_matches(c, ns) for c in op.match_conditions or ())]
        if op.max_depth is not None:
            kept = {ns[:op.max_depth] for ns in kept}
        return sorted(kept)[op.offset:op.offset + op.limit]

    # ------------------------------------------------------------------ writes

    def _prepare(self, op: PutOp, text: str, vectors: dict | None) -> dict:
        """The metadata of a put's memory, its text and metadata checked as ``add`` checks them.

        Raises:
            TypeError / ValueError: what ``add`` would refuse (a text over ``max_fact_tokens``,
                not valid Unicode; a value JSON cannot hold, NaN or infinite), naming the item.
        """
        what = f"the text of {'/'.join(op.namespace)}/{op.key}"
        try:
            metadata = _metadata(op.namespace, op.key, op.value, op.index is not False)
            if vectors is not None:
                metadata[VECTORS] = vectors
            if op.ttl is not None:
                metadata.update(lg_ttl_minutes=float(op.ttl), expires_at=now() + op.ttl * 60)
            self.backend.check(text, what)
            check_metadata(metadata)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{'/'.join(op.namespace)}/{op.key}: {exc} (nothing of this batch was written)") from None
        return metadata

    def _write_all(self, puts: dict[tuple, PutOp], found: dict, texts: dict, prepared: dict) -> None:
        """Write a batch's puts: per scope, one delete of the items deleted (or expired and put
        again, unswept), one update of the items replaced and one add of the new ones, in that
        order. When a write fails, the writes before it are taken back (:meth:`_undo`) and the
        error is raised: a batch is written whole or not at all."""
        by_scope: dict[str, dict] = {}
        at = now()
        for address, op in puts.items():
            scope = self.scope_of(op.namespace)
            plan = by_scope.setdefault(_scope_key(scope), {"scope": scope, "delete": [], "update": [], "add": []})
            stored = found.get(address)
            if stored is not None and (op.value is None or _expired(stored, at)):
                plan["delete"].append(stored)  # expired, not yet swept: a new item replaces it
                stored = None
            if op.value is None:
                continue
            metadata = prepared[address]
            if "lg_ttl_minutes" in metadata:  # the expiry counts from the write, as SqliteStore's does, not from
                metadata["expires_at"] = now() + metadata["lg_ttl_minutes"] * 60  # the batch's checks and lookups
            if stored is not None:
                plan["update"].append((stored, texts[address], metadata))
            else:
                plan["add"].append((texts[address], metadata))
        undo: list[Callable[[], None]] = []
        size = self.backend.write_size  # items a write carries (over HTTP, a request's worth)
        try:
            for plan in by_scope.values():
                scope = plan["scope"]
                for deleted in _chunks(plan["delete"], size):  # each write's undo is kept as soon as it lands
                    self.backend.delete_many([m["id"] for m in deleted], scope)
                    undo.append(lambda d=deleted, s=scope: self.backend.add_many(
                        [m["memory"] for m in d], [m["metadata"] for m in d], s))
                for changed in _chunks(plan["update"], size):
                    self.backend.update_many([(m["id"], text, meta) for m, text, meta in changed], scope)
                    undo.append(lambda c=changed, s=scope: self.backend.update_many(
                        [(m["id"], m["memory"], m["metadata"]) for m, _, _ in c], s))
                if plan["add"]:
                    self._register(scope)
                for new in _chunks(plan["add"], size):
                    added = self.backend.add_many([t for t, _ in new], [m for _, m in new], scope)
                    undo.append(lambda a=added, s=scope: self.backend.delete_many([m["id"] for m in a], s))
        except BaseException:
            self._undo(undo)
            raise

    def _undo(self, undo: list[Callable[[], None]]) -> None:
        """Take back a batch's writes, newest first, after one failed (the server refused a text
        only it can measure, or stopped answering): a batch is written whole or not at all. An
        undo that fails too is logged; the batch's own error is the one raised."""
        for take_back in reversed(undo):
            try:
                take_back()
            except Exception as exc:  # noqa: BLE001 - the write's error matters more
                logger.warning("taking back a write of a failed batch failed: %s", exc)

    def _register(self, scope: dict) -> None:
        key = _scope_key(scope)
        if key in self._registered:
            return
        if key not in {_scope_key(s) for s in self._all_scopes()}:
            self.backend.add(key, self.registry_scope, {"langgraph_scope": scope}, dedupe=True)  # a repeat: NOOP
        self._registered.add(key)


    # ------------------------------------------------------------------ TTL

    def _refreshes(self, op: GetOp | SearchOp) -> bool:
        """Whether ``op`` refreshes the expiry of what it returns: it asks to (``refresh_ttl``,
        by default ``True``) and the store's ``ttl`` says ``refresh_on_read: True`` (as
        ``SqliteStore`` decides)."""
        return bool(op.refresh_ttl and self.ttl_config and self.ttl_config.get("refresh_on_read", False))

    def _refresh(self, read: dict[tuple, dict]) -> None:
        """Push the expiry of the items read (address -> the memory as read) ``lg_ttl_minutes``
        past now: under the items' locks, each is looked up again and refreshed if it is the
        same memory, still unexpired and still has a TTL (a put or a sweep since the read wins),
        with a metadata-only update of ``expires_at`` alone."""
        if not read:
            return
        with self._writing.hold(_address(*address) for address in read):
            current = self._lookup(list(read))
            at = now()
            by_scope: dict[str, tuple[dict, list]] = {}
            for address, memory in current.items():
                meta = memory["metadata"]
                if memory["id"] != read[address]["id"] or _expired(memory, at) or "lg_ttl_minutes" not in meta:
                    continue
                scope = _memory_scope(memory)
                by_scope.setdefault(_scope_key(scope), (scope, []))[1].append(
                    (memory["id"], {"expires_at": at + meta["lg_ttl_minutes"] * 60}))
            for scope, patches in by_scope.values():  # one metadata-only write a scope
                self.backend.update_metadata_many(patches, scope)

    def sweep_ttl(self) -> int:
        """Delete the items whose TTL has expired; returns how many were deleted. Each scope
        the store has written to is listed for expired items; under the items' locks each is
        looked up again and deleted if still expired (a refresh or a put since wins).

        Raises:
            Over HTTP: ``PermissionError``, ``ConnectionError``, ``RuntimeError``, as the class says.
        """
        return self._sweep()

    def _sweep(self) -> int:
        deleted = 0
        for scope in self._all_scopes():
            expired = self.backend.list(scope, {"lg_item": "*", **_expired_by(now())})
            addresses = [(tuple(m["metadata"]["langgraph"]["namespace"]), m["metadata"]["langgraph"]["key"])
                         for m in expired]
            if not addresses:
                continue
            with self._writing.hold(_address(*address) for address in addresses):
                at = now()
                for memory in self._lookup(addresses).values():
                    if _expired(memory, at):
                        deleted += self.backend.delete_if_present(memory["id"], scope)
        return deleted

    async def asweep_ttl(self) -> int:
        """:meth:`sweep_ttl` in a worker thread."""
        return await asyncio.to_thread(self._sweep)

    def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> concurrent.futures.Future[None]:
        """Run :meth:`sweep_ttl` every ``sweep_interval_minutes`` (default ``ttl``'s, else 5) in a
        daemon thread, as ``SqliteStore`` does (a failed sweep is logged and the next one runs).
        Unlike ``SqliteStore`` it runs without a ``ttl=`` config too (puts may give ``ttl``).

        Returns:
            A future that completes when the sweeper stops (:meth:`stop_ttl_sweeper`);
            cancelling it stops the sweeper. A sweeper already running is kept (the future
            returned then only stops it when cancelled).

        Raises:
            TypeError / ValueError: ``sweep_interval_minutes`` not a positive number.
        """
        return self._start_sweeper(sweep_interval_minutes)

    def _start_sweeper(self, sweep_interval_minutes: float | None) -> concurrent.futures.Future[None]:
        if sweep_interval_minutes is not None:
            _minutes("sweep_interval_minutes", sweep_interval_minutes)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.add_done_callback(lambda f: self._sweeper_stop.set() if f.cancelled() else None)
        if self._sweeper is not None and self._sweeper.is_alive():
            logger.info("the TTL sweeper is already running")
            return future
        interval = float(sweep_interval_minutes or (self.ttl_config or {}).get("sweep_interval_minutes")
                         or DEFAULT_SWEEP_MINUTES)
        stop = self._sweeper_stop = threading.Event()  # a new event: a stopped sweeper's thread keeps its own

        def sweep_loop() -> None:
            try:
                while not stop.wait(interval * 60):
                    try:
                        swept = self._sweep()
                        if swept:
                            logger.info("swept %d expired store items", swept)
                    except Exception:  # noqa: BLE001 (the next sweep may succeed: a server restarting)
                        logger.exception("a TTL sweep failed")
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001
                future.set_exception(exc)

        self._sweeper = threading.Thread(target=sweep_loop, daemon=True, name="inferscale-store-ttl-sweeper")
        self._sweeper.start()
        return future

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        """Stop the sweeper thread, waiting up to ``timeout`` seconds (``None``: until it
        stops; a sweep under way finishes first). Returns whether it stopped (``True`` when
        none was running)."""
        return self._stop_sweeper(timeout)

    def _stop_sweeper(self, timeout: float | None) -> bool:
        thread = self._sweeper
        if thread is None or not thread.is_alive():
            return True
        self._sweeper_stop.set()
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the TTL sweeper did not stop within %s s", timeout)
            return False
        self._sweeper = None
        return True

    async def astart_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> asyncio.Future[None]:
        """:meth:`start_ttl_sweeper` from async code (the sweeper is the same thread); returns
        an asyncio future of its end."""
        return asyncio.wrap_future(self._start_sweeper(sweep_interval_minutes))

    async def astop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        """:meth:`stop_ttl_sweeper`, waiting in a worker thread."""
        return await asyncio.to_thread(self._stop_sweeper, timeout)

    def __del__(self) -> None:
        if getattr(self, "_sweeper", None) is not None:
            self._stop_sweeper(0.1)


# ---------------------------------------------------------------------- helpers


class _AddressLocks:
    """A lock per item address, held by the batches that write it (in a fixed order, so two
    batches writing the same keys never wait on each other crosswise)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, list] = {}  # address -> [lock, holders waiting or holding]

    @contextmanager
    def hold(self, addresses: Iterable[str]) -> Iterator[None]:
        keys = sorted(set(addresses))
        with self._guard:
            entries = []
            for key in keys:
                entry = self._locks.setdefault(key, [threading.Lock(), 0])
                entry[1] += 1
                entries.append(entry)
        taken = []
        try:
            for entry in entries:
                entry[0].acquire()
                taken.append(entry)
            yield
        finally:
            for entry in reversed(taken):
                entry[0].release()
            with self._guard:
                for key, entry in zip(keys, entries):
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._locks[key]


def _minutes(name: str, value: Any) -> float:
    """``value`` as a number of minutes: a finite number > 0.

    Raises:
        TypeError: not a number (``True`` is not one). ValueError: zero, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of minutes, such as 30 or 0.5, got {type(value).__name__} "
                        f"{value!r:.40}")
    if isinstance(value, int) and abs(value) > MAX_TTL_MINUTES:  # past float's range, too
        value = math.inf if value > 0 else -math.inf
    if not math.isfinite(value) or value <= 0 or value > MAX_TTL_MINUTES:
        raise ValueError(f"{name} must be a positive number of minutes, at most {MAX_TTL_MINUTES:.0e}, got {value!r} "
                         "(put ttl=None for an item that never expires)")
    return float(value)


def _ttl_config(ttl: Any) -> TTLConfig | None:
    """A copy of a checked ``TTLConfig`` (``None`` stays ``None``).

    Raises:
        TypeError: not a dict, ``refresh_on_read`` not a bool, a minute count not a number.
        ValueError: a key ``TTLConfig`` lacks, a minute count not positive.
    """
    if ttl is None:
        return None
    if not isinstance(ttl, dict):
        raise TypeError(f"ttl must be a TTLConfig dict such as {{'default_ttl': 60, 'refresh_on_read': True}}, "
                        f"got {type(ttl).__name__}")
    unknown = sorted(str(k) for k in ttl if k not in TTL_KEYS)
    if unknown:
        raise ValueError(f"ttl has unknown key(s) {unknown}: TTLConfig's keys are {list(TTL_KEYS)}")
    for key in ("default_ttl", "sweep_interval_minutes"):
        if ttl.get(key) is not None:
            _minutes(f"ttl[{key!r}]", ttl[key])
    for key in ("refresh_on_read", "omit_expired"):
        if key in ttl and not isinstance(ttl[key], bool):
            raise TypeError(f"ttl[{key!r}] must be True or False, got {ttl[key]!r}")
    return TTLConfig(**ttl)


def _expired(memory: dict, at: float) -> bool:
    """Whether the item of ``memory`` had expired at ``at`` (epoch seconds)."""
    expires = memory["metadata"].get("expires_at")
    return expires is not None and expires <= at


def _expired_by(at: float) -> dict:
    """The metadata filter of the items expired at ``at`` (items without a TTL lack the field)."""
    return {"expires_at": {"lte": at}}


def _is_scope_id(label: str) -> bool:
    """Whether InferScale takes ``label`` as a scope id (:meth:`inferscale.integration.Scope.of`)."""
    try:
        Scope.of(label, None, None)
    except (TypeError, ValueError):
        return False
    return True


def _chunks(items: list, size: int | None) -> Iterator[list]:
    """``items`` in lists of at most ``size`` (all in one list when ``size`` is ``None``); none when empty."""
    step = size or max(len(items), 1)
    for start in range(0, len(items), step):
        yield items[start:start + step]


def _search_key(op: SearchOp) -> str:
    """What a search asks, as a string: two searches of one batch with the same key have the same hits."""
    return json.dumps([op.namespace_prefix, op.filter, op.query, op.limit, op.offset], sort_keys=True, default=repr)


def _address(namespace: tuple[str, ...], key: str) -> str:
    return json.dumps([*namespace, key], ensure_ascii=False)


def _scope_key(scope: dict) -> str:
    return json.dumps(scope, sort_keys=True)


def _memory_scope(memory: dict) -> dict:
    return {k: memory[k] for k in ("user_id", "agent_id", "run_id") if memory.get(k)}


def _metadata(namespace: tuple[str, ...], key: str, value: dict, indexed: bool) -> dict:
    """What a memory keeps of an item: the item whole, its address, whether a query search
    ranks it (``lg_indexed``: ``False`` for a put with ``index=False``), its namespace labels
    (``lg_ns_<i>``, for prefix filters) and every dict path of the value (``lg_v:<path>``)."""
    value = json.loads(json.dumps(value))  # as JSON gives it back (tuples as lists); refuses what JSON cannot hold
    meta = {"langgraph": {"namespace": list(namespace), "key": key, "value": value},
            "lg_item": _address(namespace, key), "lg_indexed": indexed, "lg_ns_depth": len(namespace)}
    meta.update({f"lg_ns_{i}": label for i, label in enumerate(namespace)})

    def flatten(node: dict, path: list[str]) -> None:
        for k, v in node.items():
            meta[_value_field([*path, k])] = v
            if isinstance(v, dict):
                flatten(v, [*path, k])

    flatten(value, [])
    return meta


def _matches(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    path = tuple(condition.path)
    if len(namespace) < len(path):
        return False
    part = namespace[:len(path)] if condition.match_type == "prefix" else namespace[len(namespace) - len(path):]
    return all(p == "*" or p == n for p, n in zip(path, part))


def _item(memory: dict | None, *, search: bool = False, score: float | None = None) -> Item | None:
    if memory is None:
        return None
    stored = memory["metadata"]["langgraph"]
    fields = dict(value=stored["value"], key=stored["key"], namespace=tuple(stored["namespace"]),
                  created_at=datetime.fromisoformat(memory["created_at"]),
                  updated_at=datetime.fromisoformat(memory["updated_at"]))
    return SearchItem(**fields, score=score) if search else Item(**fields)
