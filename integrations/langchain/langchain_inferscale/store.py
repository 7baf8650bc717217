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
- the scopes the store has written to are recorded as memories of one more scope
  (``agent_id=<store_id>:scopes``), so ``list_namespaces`` and searches under a prefix
  that names no scope find them.

Memories written here are memories like any other: ``ChatInferScale(user_id="alice")``
(or an OpenAI client through ``inferscale serve``) injects the KV of the items of
``("users", "alice", ...)``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import httpx
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
)
from langgraph.store.base import validate_op_namespace
from langgraph.store.base.embed import get_text_at_path, tokenize_path

from inferscale import Memory
from inferscale.integration import Scope

#: namespace heads that name an InferScale scope field: ``("users", "alice")`` -> ``user_id="alice"``
SCOPE_HEADS = {"users": "user_id", "agents": "agent_id", "runs": "run_id"}
#: most results one InferScale search returns (the server's bound)
MAX_RESULTS = 10_000
#: value fields whose string becomes the memory's text, first present wins
TEXT_FIELDS = ("content", "text", "memory")
_OPS = {"$eq": "eq", "$ne": "ne", "$gt": "gt", "$gte": "gte", "$lt": "lt", "$lte": "lte"}
_ANY_QUERY = "item"  # a search needs a query; with filters only, every matching memory is returned


class InferScaleStore(BaseStore):
    """A LangGraph store over an InferScale memory, in-process (``memory=``) or over
    ``inferscale serve`` (``url=``).

    Items are memories (see the module docstring for the namespace -> scope mapping):
    ``put`` adds or updates one (``value=None`` deletes it), ``get`` reads it back,
    ``search`` runs InferScale's hybrid search (``query``) with the namespace prefix and the
    value ``filter`` as metadata filters, ``list_namespaces`` lists the namespaces that hold
    items. A batch reads first (one lookup per scope for all its gets and puts, one search
    per scope a search covers), then writes (one add, update or delete per put, the last
    put of a key winning), as ``InMemoryStore`` does. ``abatch`` runs the same code in a
    worker thread. Batches that write the same key run one at a time in this process (two
    concurrent puts of a key leave one item); two processes writing one key still race.

    Not supported: TTL (``ttl=`` is refused), ``$ne`` on a field an item lacks (InferScale
    never matches a missing field; ``InMemoryStore`` does).

    Args:
        memory: the InferScale :class:`~inferscale.Memory` (in-process); or
        url: the base URL of ``inferscale serve`` (``http://127.0.0.1:8000``), with
        api_key: its key (``INFERSCALE_API_KEY``), if it has one;
        timeout: seconds an HTTP call may take (default 60).
        store_id: names the scope of namespaces that name no user, agent or run
            (``agent_id=store_id``) and the registry of scopes (``agent_id=store_id + ":scopes"``).
        text_fields: value fields whose string is the memory's text, first present wins.

    Raises:
        TypeError / ValueError: (constructor) neither or both of ``memory`` and ``url``, or
            an argument of the wrong type. ``put`` / ``batch``: a value that is not a dict,
            a ``ttl``, a namespace that maps to the store's registry scope, a malformed
            filter, ``offset + limit`` over 10,000 (nothing of that op is written). Over HTTP:
            ``PermissionError`` (wrong key), ``ConnectionError`` (no server), ``RuntimeError``
            (a 5xx answer).

    Example:
        >>> store = InferScaleStore(memory)            # or InferScaleStore(url="http://127.0.0.1:8000", api_key=key)
        >>> store.put(("users", "alice", "prefs"), "food", {"content": "I am allergic to peanuts."})
        >>> store.search(("users", "alice"), query="what can't I eat?")[0].value
        {'content': 'I am allergic to peanuts.'}
    """

    supports_ttl = False

    def __init__(self, memory: Memory | None = None, *, url: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, store_id: str = "langgraph", text_fields: Iterable[str] = TEXT_FIELDS) -> None:
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
        self.backend = _Local(memory) if memory is not None else _Http(url, api_key, timeout)
        self.store_id = store_id
        self.text_fields = fields
        self.default_scope = {"agent_id": store_id}
        self.registry_scope = {"agent_id": f"{store_id}:scopes"}
        self._registered: set[str] = set()
        self._writing = _AddressLocks()

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
            texts = [t for path in index for t in get_text_at_path(value, tokenize_path(path)) if t.strip()]
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
        search and list sees the store as it was before the batch's puts.

        Raises:
            TypeError / ValueError / NotImplementedError: an op is malformed (a non-dict
                value, a ``ttl``, a bad filter or limit); checked before anything is read
                or written. Over HTTP, as the class says.
        """
        ops = list(ops)
        for op in ops:
            self._check(op)
        puts = {(op.namespace, op.key): op for op in ops if isinstance(op, PutOp)}  # the last put of a key wins
        addressed = [(op.namespace, op.key) for op in ops if isinstance(op, GetOp)] + list(puts)
        texts = {address: self.text_of(op.value, op.index or None) for address, op in puts.items()
                 if op.value is not None}
        # one key's writes, from any thread of this process, run one at a time: each looks the
        # item up and writes it before the next looks (two puts of a key leave one item)
        with self._writing.hold(_address(*address) for address in puts):
            found = self._lookup(addressed)
            everything: dict[str, list[dict]] = {}  # scope -> its items, shared by the batch's list ops
            results: list[Result] = []
            for op in ops:
                if isinstance(op, GetOp):
                    results.append(_item(found.get((op.namespace, op.key))))
                elif isinstance(op, SearchOp):
                    results.append(self._search(op))
                elif isinstance(op, ListNamespacesOp):
                    results.append(self._list_namespaces(op, everything))
                else:
                    results.append(None)
            for address, op in puts.items():
                self._write(op, found.get(address), texts.get(address))
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` in a worker thread (the event loop keeps running)."""
        return await asyncio.to_thread(self.batch, list(ops))

    def _check(self, op: Op) -> None:
        if not isinstance(op, (GetOp, SearchOp, ListNamespacesOp, PutOp)):
            raise TypeError(f"unknown store operation {type(op).__name__}")
        validate_op_namespace(op)
        if isinstance(op, PutOp):
            if op.value is not None and not isinstance(op.value, dict):
                raise TypeError(f"the value of {op.namespace}/{op.key} must be a dict, got {type(op.value).__name__}")
            if op.ttl is not None:
                raise NotImplementedError("InferScaleStore does not support TTL: put without ttl= (delete the item "
                                          "yourself when it expires)")
            if op.index is not False and op.index is not None and not isinstance(op.index, list):
                raise TypeError(f"index must be False or a list of field paths, got {op.index!r}")
            self._check_scope(op.namespace)
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

    def _scopes_under(self, prefix: tuple[str, ...]) -> list[dict]:
        """The scopes that may hold namespaces starting with ``prefix`` (``*`` matches any label)."""
        head = prefix[0] if prefix else "*"
        if head in SCOPE_HEADS and len(prefix) >= 2 and prefix[1] != "*":
            return [self.scope_of(prefix)]
        if head not in SCOPE_HEADS and head != "*":
            return [dict(self.default_scope)]
        return self._all_scopes()

    def _all_scopes(self) -> list[dict]:
        found = self.backend.list(self.registry_scope, None)
        scopes = [m["metadata"]["langgraph_scope"] for m in found if "langgraph_scope" in m["metadata"]]
        self._registered.update(_scope_key(s) for s in scopes)
        return sorted(scopes, key=_scope_key)

    def _search(self, op: SearchOp) -> list[SearchItem]:
        """A query ranks the indexed items (best first) and pages over them; when a page has
        room left, the items put with ``index=False`` fill it, oldest first and unscored
        (``InMemoryStore``'s way: they are never ranked, and the offset skips none of them).
        Without a query: every match, oldest first."""
        try:
            filters = {"lg_item": "*", **_namespace_filters(op.namespace_prefix), **_value_filters(op.filter or {})}
        except _MatchesNothing:  # a NaN compared: no value equals or orders against it
            return []
        wanted = op.offset + op.limit
        scopes = self._scopes_under(op.namespace_prefix)
        if not op.query:
            return [_item(h, search=True) for h in self._listing(scopes, filters)[op.offset:wanted]]
        indexed = {**filters, "NOT": [{"lg_indexed": False}]}  # items from before lg_indexed have no field
        hits = [h for scope in scopes for h in self.backend.search(op.query, scope, indexed, wanted)]
        if len({_scope_key(_memory_scope(h)) for h in hits}) > 1:  # best first across scopes; one scope's
            hits.sort(key=lambda h: -h.get("score", 0.0))            # hybrid rank is kept
        found = [_item(h, search=True, score=h.get("score")) for h in hits[op.offset:wanted]]
        if len(found) < op.limit:
            unindexed = self._listing(scopes, {**filters, "lg_indexed": False})
            found += [_item(h, search=True) for h in unindexed[:op.limit - len(found)]]
        return found

    def _listing(self, scopes: list[dict], filters: dict) -> list[dict]:
        """Every memory of ``scopes`` matching ``filters``, oldest first (as ``InMemoryStore`` lists)."""
        hits = [h for scope in scopes for h in self.backend.list(scope, filters)]
        return sorted(hits, key=lambda h: (h["created_at"], h["id"]))

    def _list_namespaces(self, op: ListNamespacesOp, everything: dict[str, list[dict]]) -> list[tuple[str, ...]]:
        prefix = next((c.path for c in op.match_conditions or () if c.match_type == "prefix"), ())
        namespaces = set()
        for scope in self._scopes_under(tuple(prefix)):
            key = _scope_key(scope)
            if key not in everything:
                everything[key] = self.backend.list(scope, {"lg_item": "*"})
            namespaces.update(tuple(m["metadata"]["langgraph"]["namespace"]) for m in everything[key])
        kept = [ns for ns in namespaces if all(_matches(c, ns) for c in op.match_conditions or ())]
        if op.max_depth is not None:
            kept = {ns[:op.max_depth] for ns in kept}
        return sorted(kept)[op.offset:op.offset + op.limit]

    # ------------------------------------------------------------------ writes

    def _write(self, op: PutOp, stored: dict | None, text: str | None) -> None:
        scope = self.scope_of(op.namespace)
        if op.value is None:
            if stored is not None:
                self.backend.delete(stored["id"], scope)
            return
        metadata = _metadata(op.namespace, op.key, op.value, op.index is not False)
        if stored is not None:
            self.backend.update(stored["id"], text, metadata, scope)
            return
        self._register(scope)
        self.backend.add(text, scope, metadata)

    def _register(self, scope: dict) -> None:
        key = _scope_key(scope)
        if key in self._registered:
            return
        if key not in {_scope_key(s) for s in self._all_scopes()}:
            self.backend.add(key, self.registry_scope, {"langgraph_scope": scope}, dedupe=True)  # a repeat: NOOP
        self._registered.add(key)


# ---------------------------------------------------------------------- backends


class _Local:
    """The store's calls on an in-process :class:`~inferscale.Memory`."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory

    def add(self, text: str, scope: dict, metadata: dict, dedupe: bool = False) -> dict:
        return self.memory.add(text, metadata=metadata, infer=False, dedupe=dedupe, **scope)["results"][0]

    def update(self, memory_id: str, text: str, metadata: dict, scope: dict) -> None:
        self.memory.update(memory_id, text, metadata=metadata, dedupe=False, **scope)

    def delete(self, memory_id: str, scope: dict) -> None:
        self.memory.delete(memory_id, **scope)

    def search(self, query: str, scope: dict, filters: dict | None, limit: int) -> list[dict]:
        return self.memory.search(query, limit=limit, filters=filters, **scope)["results"]

    def list(self, scope: dict, filters: dict | None) -> list[dict]:
        """Every memory of ``scope`` matching ``filters`` (at most 10,000), oldest first; no query embedded."""
        return self.memory.get_all(limit=MAX_RESULTS, filters=filters, **scope)["results"]


class _Http:
    """The same calls on ``inferscale serve``'s memory routes."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be the server's base URL, e.g. 'http://127.0.0.1:8000', got {url!r}")
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError(f"api_key must be a string, got {type(api_key).__name__}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"inferscale serve at {self.client.base_url} did not answer: {exc}") from None
        if response.status_code < 400:
            return response.json()
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        if response.status_code == 401:
            raise PermissionError(f"inferscale serve refused the API key: {message}")
        if response.status_code in (400, 404, 413, 422):
            raise ValueError(message)
        raise RuntimeError(f"inferscale serve answered {response.status_code}: {message}")

    def add(self, text: str, scope: dict, metadata: dict, dedupe: bool = False) -> dict:
        body = {"messages": text, "metadata": metadata, "infer": False, "dedupe": dedupe, **scope}
        return self._call("POST", "/memories", json=body)["results"][0]

    def update(self, memory_id: str, text: str, metadata: dict, scope: dict) -> None:
        body = {"text": text, "metadata": metadata, "dedupe": False}
        self._call("PUT", f"/memories/{memory_id}", params=scope, json=body)

    def delete(self, memory_id: str, scope: dict) -> None:
        self._call("DELETE", f"/memories/{memory_id}", params=scope)

    def search(self, query: str, scope: dict, filters: dict | None, limit: int) -> list[dict]:
        body = {"query": query, "limit": max(limit, 1), "filters": filters, **scope}
        return self._call("POST", "/search", json=body)["results"][:limit]

    def list(self, scope: dict, filters: dict | None) -> list[dict]:
        """Every match (at most 10,000), in any order: ``GET /memories`` takes no filters, so a
        search with a placeholder query reads them all (the callers sort)."""
        return self.search(_ANY_QUERY, scope, filters, MAX_RESULTS)


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


def _is_scope_id(label: str) -> bool:
    """Whether InferScale takes ``label`` as a scope id (:meth:`inferscale.integration.Scope.of`)."""
    try:
        Scope.of(label, None, None)
    except (TypeError, ValueError):
        return False
    return True


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


def _value_field(path: list[str]) -> str:
    return "lg_v:" + json.dumps(path, ensure_ascii=False)


def _namespace_filters(prefix: tuple[str, ...]) -> dict:
    return {f"lg_ns_{i}": label for i, label in enumerate(prefix)}


def _value_filters(filters: dict, path: tuple[str, ...] = ()) -> dict:
    """A LangGraph value filter (``{"field": value}``, ``{"field": {"$gt": 2}}``, nested dicts
    matched field by field) as InferScale metadata filters on the ``lg_v:`` fields. A field
    name with dots (``"user.level"``) matches the field of that name or the nested path
    (``InMemoryStore`` reads the first, ``SqliteStore`` and ``PostgresStore`` the second).

    Raises:
        TypeError / ValueError: not a dict, or an operator other than ``$eq``, ``$ne``,
            ``$gt``, ``$gte``, ``$lt``, ``$lte``.
    """
    if not isinstance(filters, dict):
        raise TypeError(f"filter must be a dict such as {{'category': 'food'}}, got {type(filters).__name__}")
    out: dict = {}
    for key, cond in filters.items():
        if not isinstance(key, str):
            raise TypeError(f"filter fields are strings, got {key!r}")
        field = [*path, key]
        if isinstance(cond, dict) and not any(str(k).startswith("$") for k in cond):
            out.update(_value_filters(cond, tuple(field)))
            continue
        ops = _condition(key, cond)
        if ops is None:
            continue
        if "." in key:
            either = [{_value_field(field): ops}, {_value_field([*path, *key.split(".")]): ops}]
            out.setdefault("AND", []).append({"OR": either})
        else:
            out[_value_field(field)] = ops
    return out


def _condition(key: str, cond: Any) -> dict | None:
    """One field's condition as InferScale operators (``None``: no constraint)."""
    if isinstance(cond, dict):
        bad = sorted(str(k) for k in cond if k not in _OPS)
        if bad:
            raise ValueError(f"unsupported filter operator(s) {bad} on {key!r}: use {sorted(_OPS)}")
        ops = {_OPS[k]: _json(v) for k, v in cond.items() if not (k == "$ne" and _is_nan(v))}  # x != NaN: all
        if any(_is_nan(v) for v in ops.values()):
            raise _MatchesNothing
        return ops or None
    if _is_nan(cond):
        raise _MatchesNothing
    return {"eq": _json(cond)}


class _MatchesNothing(Exception):
    """A filter no value can satisfy (NaN compared with ``==``, ``<`` and the like), as in
    ``InMemoryStore``, where such a comparison is simply false."""


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value)) if isinstance(value, (list, tuple, dict)) else value


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
