"""``InferScaleChatMessageHistory``: a LangChain chat history that writes to InferScale memory."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.messages import BaseMessage

from inferscale import Memory
from inferscale.integration import ChatSessions
from langchain_inferscale._messages import from_session_message, to_session_message


class InferScaleChatMessageHistory(BaseChatMessageHistory):
    """One chat session of a user, stored in an InferScale :class:`~inferscale.Memory`.

    Every message written is logged as a turn of the user's conversation log (the
    context Context-Window Encoding reads) and stored as memories: the user's messages as
    given (``infer=False``, the default) or facts the served LLM extracts from every
    message (``infer=True``); their KV is precomputed at once. Memories belong to the
    user, not to the session, so :class:`~langchain_inferscale.ChatInferScale` injects
    what was said in one session into the answers of every later one.

    Args:
        memory: the InferScale memory.
        session_id: the conversation (any non-empty string).
        user_id / agent_id: whose memory (at least one).
        infer: extract facts with the served LLM instead of storing messages as given.
        fact_roles: with ``infer=False``, roles whose messages become memories
            (``"user"``, ``"assistant"``, ``"system"``, ``"tool"``; default the user's).

    Raises:
        ValueError: no scope, an empty ``session_id`` or an unknown role.

    Example:
        >>> history = InferScaleChatMessageHistory(memory, session_id="s1", user_id="alice")
        >>> history.add_user_message("My dog's name is Biscuit.")
        >>> history.messages
        [HumanMessage(content="My dog's name is Biscuit.", id='s1:...')]
    """

    def __init__(self, memory: Memory, session_id: str, *, user_id: str | None = None, agent_id: str | None = None,
                 infer: bool = False, fact_roles: Sequence[str] = ("user",)) -> None:
        self.sessions = ChatSessions(memory, user_id=user_id, agent_id=agent_id, infer=infer, fact_roles=fact_roles)
        self.session_id = session_id
        self.sessions.messages(session_id)  # validates the session id now

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The session's messages, oldest first (each message's ``id`` is its turn id)."""
        return [from_session_message(m) for m in self.sessions.messages(self.session_id)]

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Log the messages and store memories from them (nothing is written if one is invalid).

        Raises:
            TypeError / ValueError: a message is not a LangChain message or has no text.
        """
        if isinstance(messages, (str, bytes, BaseMessage)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of LangChain messages, got {type(messages).__name__}")
        self.sessions.add(self.session_id, [to_session_message(m, i) for i, m in enumerate(messages)])

    def clear(self) -> None:
        """Delete the session's messages; the memories stored from them stay the user's."""
        self.sessions.delete(self.session_id)
