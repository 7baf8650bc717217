"""``InferScaleMemoryBlock``: long-term memory for ``llama_index.core.memory.Memory``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.memory.memory import BaseMemoryBlock
from llama_index.llms.inferscale.messages import to_session_message
from pydantic import ConfigDict, Field, PrivateAttr

from inferscale import Memory
from inferscale.integration import ChatSessions, PlainErrors

#: Session id of messages flushed without one.
DEFAULT_SESSION = "llama_index"


class InferScaleMemoryBlock(PlainErrors, BaseMemoryBlock[str]):
    """A memory block backed by an InferScale :class:`~inferscale.Memory`.

    ``Memory`` flushes the messages that leave its short-term queue into the block: they
    are logged as turns of the user's conversation log (in their session) and stored as
    memories (the user's messages as given, or LLM-extracted facts with ``infer=True``),
    their KV precomputed. Reading the block retrieves the user's top-``k`` memories for
    the newest user message as ``"- <memory>"`` lines. With
    :class:`~llama_index.llms.inferscale.InferScaleLLM`, which injects the same memories
    as KV, set ``include_text=False`` so they are not prefilled a second time as text.

    Attributes:
        memory: the InferScale memory.
        user_id / agent_id: whose memory (at least one).
        k: memories returned.
        include_text: return the memories as text (``False``: write-only block).
        infer: extract facts with the served LLM instead of storing messages as given.

    Example:
        >>> block = InferScaleMemoryBlock(memory=memory, user_id="alice", k=5)
        >>> Memory.from_defaults(session_id="monday", memory_blocks=[block])
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    name: str = "inferscale"
    description: str | None = "What the user told in earlier conversations."
    memory: Memory = Field(exclude=True)
    user_id: str | None = None
    agent_id: str | None = None
    k: int = Field(default=5, ge=1, strict=True)
    include_text: bool = Field(default=True, strict=True)
    infer: bool = Field(default=False, strict=True)
    _sessions: ChatSessions = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self._sessions = ChatSessions(self.memory, user_id=self.user_id, agent_id=self.agent_id, infer=self.infer)

    def _retrieve(self, messages: Sequence[ChatMessage]) -> str:
        users = [m for m in messages if m.role == MessageRole.USER and isinstance(m.content, str) and m.content.strip()]
        if not self.include_text or not users:
            return ""
        found = self.memory.search(users[-1].content, **self._sessions.scope.as_dict(), limit=self.k)["results"]
        return "".join(f"- {item['memory']}\n" for item in found)

    def _store(self, messages: Sequence[ChatMessage]) -> None:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of ChatMessage, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, ChatMessage):
                raise TypeError(f"message {i} must be a ChatMessage, got {type(m).__name__}")
        texts = [m for m in messages if isinstance(m.content, str) and m.content.strip()]  # skip tool-call shells
        by_session: dict[str, list] = {}
        for i, m in enumerate(texts):
            own = {k: v for k, v in m.additional_kwargs.items() if k != "session_id"}  # the session is the key
            by_session.setdefault(m.additional_kwargs.get("session_id") or DEFAULT_SESSION, []).append(
                to_session_message(m.model_copy(update={"additional_kwargs": own}), i))
        for session_id, rows in by_session.items():  # every session's messages checked before any is written
            self._sessions.check(session_id, rows)
        for session_id, rows in by_session.items():
            self._sessions.add(session_id, rows)

    async def _aget(self, messages: list[ChatMessage] | None = None, **block_kwargs: Any) -> str:
        """The user's memories for the newest user message, one ``"- <memory>"`` line each."""
        return await asyncio.to_thread(self._retrieve, messages or [])

    async def _aput(self, messages: list[ChatMessage]) -> None:
        """Log the messages and store memories from them (in a worker thread)."""
        await asyncio.to_thread(self._store, messages)
