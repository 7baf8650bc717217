"""``InferScaleRetriever``: a scope's memories as LangChain ``Document`` s."""

from __future__ import annotations

import asyncio
from typing import Literal

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, field_validator

from inferscale.integration import check_int, compile_filter
from langchain_inferscale._scope import MemoryScope


class InferScaleRetriever(MemoryScope, BaseRetriever):
    """Retrieves the scope's memories best matching the query (:meth:`inferscale.Memory.search`:
    hybrid dense + BM25 by default, or dense cosine; top-``k``).

    Each ``Document`` has the memory's text as ``page_content``, its memory id as ``id``,
    and as ``metadata`` the memory's own metadata plus ``id``, ``score`` (cosine
    similarity), ``created_at``, ``updated_at``, ``source_turn_ids`` and the scope fields
    (these win over user metadata of the same name). Async calls run the same search in
    a worker thread.

    Attributes:
        memory: the InferScale memory.
        user_id / agent_id / run_id: whose memories (at least one).
        k: number of documents.
        threshold: minimum cosine similarity of a result.
        filters: metadata filters, as :meth:`inferscale.Memory.search` takes them.
        mode: ``"hybrid"`` or ``"dense"`` (default: the memory's ``search_mode``).

    Example:
        >>> retriever = InferScaleRetriever(memory=memory, user_id="alice", k=3)
        >>> retriever.invoke("pets")[0].page_content
        "My dog's name is Biscuit."
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt argument is refused, not ignored

    k: int = Field(default=4, ge=1, strict=True)
    threshold: float | None = Field(default=None, ge=-1.0, le=1.0, strict=True)
    filters: dict | None = None
    mode: Literal["hybrid", "dense"] | None = None

    @field_validator("filters")
    @classmethod
    def _filters(cls, value: dict | None) -> dict | None:
        compile_filter(value)  # a malformed filter is refused here, not at the first search
        return value

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, threshold: float | None = None,
                                filters: dict | None = None, mode: str | None = None) -> list[Document]:
        """The documents; ``k``, ``threshold``, ``filters`` and ``mode`` may be given per call
        (``retriever.invoke(query, k=1)``) and override the attributes."""
        check_int("k", k, 1, optional=True)
        found = self.memory.search(query, user_id=self.user_id, agent_id=self.agent_id, run_id=self.run_id,
                                   limit=self.k if k is None else k,
                                   threshold=self.threshold if threshold is None else threshold,
                                   filters=self.filters if filters is None else filters,
                                   mode=self.mode if mode is None else mode)["results"]
        return [_document(item) for item in found]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None, threshold: float | None = None,
                                       filters: dict | None = None, mode: str | None = None) -> list[Document]:
        """As :meth:`_get_relevant_documents` (per-call ``k`` ... ``mode`` too), in a worker thread."""
        return await asyncio.to_thread(self._get_relevant_documents, query, run_manager=run_manager.get_sync(), k=k,
                                       threshold=threshold, filters=filters, mode=mode)


def _document(item: dict) -> Document:
    fields = {key: item[key] for key in ("id", "score", "created_at", "updated_at", "source_turn_ids", "user_id",
                                         "agent_id", "run_id") if key in item}
    return Document(page_content=item["memory"], id=item["id"], metadata={**item["metadata"], **fields})
