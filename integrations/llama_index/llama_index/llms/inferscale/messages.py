"""Conversions between LlamaIndex ``ChatMessage`` s and InferScale's session and prompt formats."""

from __future__ import annotations

from collections.abc import Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole

from inferscale.sessions import SessionMessage

_ROLE_OF = {
    MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant", MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system",
    MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool",
}
_MESSAGE_ROLE = {"user": MessageRole.USER, "assistant": MessageRole.ASSISTANT, "system": MessageRole.SYSTEM,
                 "tool": MessageRole.TOOL}


def _text(message: ChatMessage, i: int) -> str:
    if not isinstance(message, ChatMessage):
        raise TypeError(f"message {i} must be a llama_index ChatMessage, got {type(message).__name__}")
    text = message.content
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"message {i} ({message.role.value}) has no text: InferScale stores and serves text messages")
    return text


def to_session_message(message: ChatMessage, i: int = 0) -> SessionMessage:
    """A ``ChatMessage`` as a :class:`SessionMessage` (chatbot/model -> assistant, developer -> system)."""
    text = _text(message, i)
    return SessionMessage(_ROLE_OF[message.role], text)


def from_session_message(message: SessionMessage) -> ChatMessage:
    """A stored session message as a ``ChatMessage``."""
    return ChatMessage(role=_MESSAGE_ROLE[message.role], content=message.content)


def split_prompt(messages: Sequence[ChatMessage]) -> tuple[str, list[dict], str | None]:
    """Split chat messages into InferScale's request parts.

    Returns:
        ``(query, history, instructions)``: the last message (the user's) is the query;
        earlier user/assistant messages are the history, oldest first; system messages'
        texts, joined, are the instructions.

    Raises:
        ValueError: no messages, the last is not a user message, or a tool message.
    """
    if not messages:
        raise ValueError("messages is empty: give at least one user ChatMessage (the question)")
    roles = [_ROLE_OF[m.role] if isinstance(m, ChatMessage) else None for m in messages]
    if roles[-1] != "user":
        raise ValueError(f"the last message must be the user's (the question), got role {roles[-1]!r}")
    history, system = [], []
    for i, (m, role) in enumerate(zip(messages[:-1], roles)):
        text = _text(m, i)
        if role == "system":
            system.append(text)
        elif role in ("user", "assistant"):
            history.append({"role": role, "content": text})
        else:
            raise ValueError(f"message {i} has role {m.role.value!r}: InferScaleLLM takes system, user and assistant "
                             "messages (no tool calls)")
    return _text(messages[-1], len(messages) - 1), history, "\n\n".join(system) or None
