"""``InferScaleChatStore``: a LlamaIndex chat store that writes to InferScale memory."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.storage.chat_store.base import BaseChatStore
from llama_index.llms.inferscale.messages import from_session_message, to_session_message
from pydantic import PrivateAttr

from inferscale import Memory
from inferscale.integration import ChatSessions, check_int


class InferScaleChatStore(BaseChatStore):
    """Chat sessions of one user, stored in an InferScale :class:`~inferscale.Memory`.

    A key is a session (e.g. ``ChatMemoryBuffer.from_defaults(chat_store=store,
    chat_store_key="monday")``). Every message written is logged as a turn of the user's
    conversation log and stored as memories: the user's messages as given (``infer=False``)
    or the facts the served LLM extracts (``infer=True``), KV precomputed. Memories belong
    to the user, not the session: :class:`~llama_index.llms.inferscale.InferScaleLLM`
    injects them into every later session. Deleting messages keeps the memories stored
    from them. Async methods run the sync ones in a worker thread.

    Args:
        memory: the InferScale memory.
        user_id / agent_id: whose memory (at least one).
        infer: extract facts with the served LLM instead of storing messages as given.
        fact_roles: with ``infer=False``, roles whose messages become memories (default the user's).

    Raises:
        ValueError: no scope or an unknown role.

    Example:
        >>> store = InferScaleChatStore(memory, user_id="alice")
        >>> store.add_message("monday", ChatMessage(role="user", content="My dog's name is Biscuit."))
        >>> store.get_keys()
        ['monday']
    """

    _sessions: ChatSessions = PrivateAttr()

    def __init__(self, memory: Memory, *, user_id: str | None = None, agent_id: str | None = None,
                 infer: bool = False, fact_roles: Sequence[str] = ("user",), **kwargs: Any) -> None:
        if kwargs:  # BaseChatStore has no fields: anything else is a misspelt argument
            raise TypeError(f"InferScaleChatStore got unknown argument(s) {sorted(kwargs)}: it takes memory, user_id, "
                            "agent_id, infer and fact_roles")
        super().__init__()
        self._sessions = ChatSessions(memory, user_id=user_id, agent_id=agent_id, infer=infer, fact_roles=fact_roles)

    def __getstate__(self) -> dict:
        """What a pickle keeps: the memory (pickled as its settings, :meth:`inferscale.Memory.__reduce__`),
        the scope and the write settings; the sessions themselves live in the memory."""
        s = self._sessions
        return {"memory": s.memory, "user_id": s.scope.user_id, "agent_id": s.scope.agent_id, "infer": s.infer,
                "fact_roles": s.fact_roles}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["memory"], user_id=state["user_id"], agent_id=state["agent_id"], infer=state["infer"],
                      fact_roles=state["fact_roles"])

    @classmethod
    def class_name(cls) -> str:
        """LlamaIndex's name for this class (serialisation)."""
        return "InferScaleChatStore"

    def set_messages(self, key: str, messages: list[ChatMessage]) -> None:
        """Make the session hold exactly ``messages`` (messages it already holds in the same
        order are kept, so their memories are not stored twice)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of ChatMessage, got {type(messages).__name__}")
        self._sessions.replace(key, [to_session_message(m, i) for i, m in enumerate(messages)])

    def get_messages(self, key: str) -> list[ChatMessage]:
        """The session's messages, oldest first (empty for an unknown session)."""
        return [from_session_message(m) for m in self._sessions.messages(key)]

    def add_message(self, key: str, message: ChatMessage, idx: int | None = None) -> None:
        """Append a message to the session and store memories from it.

        Raises:
            ValueError: ``idx`` is not the end of the session (the log is in time order),
                or the message has no text.
        """
        check_int("idx", idx, optional=True)
        if idx is not None and idx != len(self._sessions.messages(key)):
            raise ValueError(f"idx={idx}: InferScale's conversation log is in time order, messages can only be "
                             "appended (idx=None)")
        self._sessions.add(key, [to_session_message(message)])

    def delete_messages(self, key: str) -> list[ChatMessage] | None:
        """Delete the session's messages; returns them (``None`` for an unknown session)."""
        current = self._sessions.messages(key)
        if not current:
            return None
        self._sessions.delete(key)
        return [from_session_message(m) for m in current]

    def delete_message(self, key: str, idx: int) -> ChatMessage | None:
        """Delete the session's message at ``idx``; returns it (``None`` when out of range)."""
        check_int("idx", idx, minimum=-(2**63))
        current = self._sessions.messages(key)
        if not -len(current) <= idx < len(current):
            return None
        self._sessions.delete(key, [current[idx].turn_id])
        return from_session_message(current[idx])

    def delete_last_message(self, key: str) -> ChatMessage | None:
        """Delete the session's newest message; returns it (``None`` when there is none)."""
        return self.delete_message(key, -1)

    def get_keys(self) -> list[str]:
        """The user's sessions, in order of their first message."""
        return self._sessions.session_ids()

    async def aset_messages(self, key: str, messages: list[ChatMessage]) -> None:
        """:meth:`set_messages` in a worker thread."""
        await asyncio.to_thread(self.set_messages, key, messages)

    async def aget_messages(self, key: str) -> list[ChatMessage]:
        """:meth:`get_messages` in a worker thread."""
        return await asyncio.to_thread(self.get_messages, key)

    async def async_add_message(self, key: str, message: ChatMessage, idx: int | None = None) -> None:
        """:meth:`add_message` in a worker thread."""
        await asyncio.to_thread(self.add_message, key, message, idx)

    async def adelete_messages(self, key: str) -> list[ChatMessage] | None:
        """:meth:`delete_messages` in a worker thread."""
        return await asyncio.to_thread(self.delete_messages, key)

    async def adelete_message(self, key: str, idx: int) -> ChatMessage | None:
        """:meth:`delete_message` in a worker thread."""
        return await asyncio.to_thread(self.delete_message, key, idx)

    async def adelete_last_message(self, key: str) -> ChatMessage | None:
        """:meth:`delete_last_message` in a worker thread."""
        return await asyncio.to_thread(self.delete_last_message, key)

    async def aget_keys(self) -> list[str]:
        """:meth:`get_keys` in a worker thread."""
        return await asyncio.to_thread(self.get_keys)
