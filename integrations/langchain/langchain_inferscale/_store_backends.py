"""The calls ``InferScaleStore`` makes on an InferScale memory: in-process (:class:`_Local`, a
:class:`~inferscale.Memory`) or over ``inferscale serve``'s memory routes (:class:`_Http`), the
same methods on both."""

from __future__ import annotations

from typing import Any

import httpx

from inferscale import Memory, MemoryNotFoundError
from inferscale.integration import require_text

#: most results one InferScale search returns (the server's bound)
MAX_RESULTS = 10_000
#: most items one HTTP write carries (a larger batch is several requests, taken back together on failure)
HTTP_BATCH = 1_000


class _Local:
    """The store's calls on an in-process :class:`~inferscale.Memory`."""

    #: items one write carries: all of a batch's (one embedding call, one Chroma write)
    write_size: int | None = None

    def __init__(self, memory: Memory) -> None:
        self.memory = memory

    def add(self, text: str, scope: dict, metadata: dict, dedupe: bool = False) -> dict:
        return self.memory.add(text, metadata=metadata, infer=False, dedupe=dedupe, **scope)["results"][0]

    def delete_if_present(self, memory_id: str, scope: dict) -> int:
        """1 when deleted, 0 when it was gone (another process deleted it)."""
        try:
            self.memory.delete(memory_id, **scope)
        except MemoryNotFoundError:
            return 0
        return 1

    def add_many(self, texts: list[str], metadatas: list[dict], scope: dict) -> list[dict]:
        """One memory per text, each with its metadata, in one write (one embedding call, one
        Chroma add, one history transaction); returns ``[{"id", "memory", "event"}]``."""
        messages = [{"role": "user", "content": text} for text in texts]
        return self.memory.add(messages, metadata=metadatas, infer=False, dedupe=False, **scope)["results"]

    def update_many(self, changes: list[tuple[str, str, dict]], scope: dict) -> None:
        """``(memory_id, text, metadata)`` changes in one write (:meth:`inferscale.Memory.batch_update`)."""
        self.memory.batch_update([{"memory_id": i, "text": t, "metadata": m} for i, t, m in changes],
                                 dedupe=False, **scope)

    def delete_many(self, memory_ids: list[str], scope: dict) -> None:
        """The memories ``memory_ids`` deleted in one write (:meth:`inferscale.Memory.batch_delete`)."""
        self.memory.batch_delete([{"memory_id": i} for i in memory_ids], **scope)

    def update_metadata(self, memory_id: str, fields: dict, scope: dict) -> None:
        self.memory.update_metadata(memory_id, fields, **scope)

    def update_metadata_many(self, patches: list[tuple[str, dict]], scope: dict) -> None:
        """``(memory_id, fields)`` metadata-only patches in one write (``batch_update`` without texts)."""
        self.memory.batch_update([{"memory_id": i, "metadata": f} for i, f in patches], **scope)

    def check(self, text: str, what: str) -> None:
        """What ``add`` refuses in a text, its length in this memory's tokens included."""
        self.memory.check_fact_length(text, what)

    def check_all(self, texts: dict[str, str]) -> None:
        """Nothing more: :meth:`check` has checked each text whole."""

    def search(self, query: str, scope: dict, filters: dict | None, limit: int) -> list[dict]:
        return self.memory.search(query, limit=limit, filters=filters, **scope)["results"]

    def list(self, scope: dict, filters: dict | None) -> list[dict]:
        """Every memory of ``scope`` matching ``filters`` (at most 10,000), oldest first; no query embedded."""
        return self.memory.get_all(limit=MAX_RESULTS, filters=filters, **scope)["results"]


class _Http:
    """The same calls on ``inferscale serve``'s memory routes."""

    #: items one write request carries (:data:`HTTP_BATCH`)
    write_size: int | None = HTTP_BATCH

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
        if response.status_code == 404:
            raise _NotFound(message)
        if response.status_code in (400, 413, 422):
            raise ValueError(message)
        raise RuntimeError(f"inferscale serve answered {response.status_code}: {message}")

    def add(self, text: str, scope: dict, metadata: dict, dedupe: bool = False) -> dict:
        body = {"messages": text, "metadata": metadata, "infer": False, "dedupe": dedupe, **scope}
        return self._call("POST", "/memories", json=body)["results"][0]

    def delete_if_present(self, memory_id: str, scope: dict) -> int:
        """1 when deleted, 0 when the server says it was gone (404)."""
        try:
            self._call("DELETE", f"/memories/{memory_id}", params=scope)
        except _NotFound:
            return 0
        return 1

    def add_many(self, texts: list[str], metadatas: list[dict], scope: dict) -> list[dict]:
        """``POST /memories`` with a message and a metadata object per text (the store sends at
        most :attr:`write_size` a request)."""
        body = {"messages": [{"role": "user", "content": t} for t in texts], "metadata": metadatas, "infer": False,
                "dedupe": False, **scope}
        return self._call("POST", "/memories", json=body)["results"]

    def update_many(self, changes: list[tuple[str, str, dict]], scope: dict) -> None:
        """``PUT /memories/batch``."""
        memories = [{"memory_id": i, "text": t, "metadata": m} for i, t, m in changes]
        self._call("PUT", "/memories/batch", json={"memories": memories, "dedupe": False, **scope})

    def delete_many(self, memory_ids: list[str], scope: dict) -> None:
        """``DELETE /memories/batch``."""
        self._call("DELETE", "/memories/batch", json={"memories": [{"memory_id": i} for i in memory_ids], **scope})

    def update_metadata(self, memory_id: str, fields: dict, scope: dict) -> None:
        """``PUT /memories/{id}`` without ``text``: a metadata-only update."""
        self._call("PUT", f"/memories/{memory_id}", params=scope, json={"metadata": fields})

    def update_metadata_many(self, patches: list[tuple[str, dict]], scope: dict) -> None:
        """``PUT /memories/batch`` with entries without ``text``, at most :data:`HTTP_BATCH` a request."""
        for start in range(0, len(patches), HTTP_BATCH):
            memories = [{"memory_id": i, "metadata": f} for i, f in patches[start:start + HTTP_BATCH]]
            self._call("PUT", "/memories/batch", json={"memories": memories, **scope})

    def check(self, text: str, what: str) -> None:
        """What ``add`` refuses in a text that can be told here (not valid Unicode, empty); the
        server counts its tokens (:meth:`check_all`)."""
        require_text(text, what)

    def check_all(self, texts: dict[str, str]) -> None:
        """Ask the server (``POST /memories/check``) whether it would take each of a batch's
        texts (item address -> text), before the batch writes any: only the server counts
        tokens in its model's tokenizer.

        Raises:
            ValueError: the first text it refuses, naming the item.
        """
        if not texts:
            return
        items = list(texts.items())
        answers = [a for start in range(0, len(items), 500)  # a body of at most 500 texts
                   for a in self._call("POST", "/memories/check",
                                       json={"texts": [text for _, text in items[start:start + 500]]})["results"]]
        for (address, _), answer in zip(items, answers):
            if not answer["ok"]:
                raise ValueError(f"{address}: {answer['error']} (nothing of this batch was written)")

    def search(self, query: str, scope: dict, filters: dict | None, limit: int,
               show_expired: bool = False) -> list[dict]:
        body = {"query": query, "limit": max(limit, 1), "filters": filters, "show_expired": show_expired, **scope}
        return self._call("POST", "/search", json=body)["results"][:limit]

    def list(self, scope: dict, filters: dict | None) -> list[dict]:
        """Every match (at most 10,000), oldest first, expired ones too: ``POST /memories/list``
        (``get_all`` with filters; nothing embedded)."""
        return self._call("POST", "/memories/list", json={"filters": filters, "limit": MAX_RESULTS, **scope})["results"]


class _NotFound(ValueError):
    """The server answered 404 (a ``ValueError``, as other bad input over HTTP)."""
