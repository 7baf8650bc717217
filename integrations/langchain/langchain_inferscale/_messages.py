"""Conversions between LangChain messages and InferScale's session and prompt formats."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from inferscale.sessions import SessionMessage

_ROLE_OF = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
_CLASS_OF = {"user": HumanMessage, "assistant": AIMessage, "system": SystemMessage}


def _text(message: BaseMessage, i: int) -> str:
    text = str(message.text)
    if not text.strip():
        raise ValueError(f"message {i} ({message.type}) has no text: InferScale stores and serves text messages")
    return text


def to_session_message(message: BaseMessage, i: int = 0) -> SessionMessage:
    """A LangChain message as a :class:`SessionMessage` (human -> user, ai -> assistant)."""
    if not isinstance(message, BaseMessage):
        raise TypeError(f"message {i} must be a LangChain BaseMessage, got {type(message).__name__}")
    role = _ROLE_OF.get(message.type, getattr(message, "role", message.type))
    return SessionMessage(role, _text(message, i))


def from_session_message(message: SessionMessage) -> BaseMessage:
    """A stored session message as the LangChain message of its role (``id`` = its turn id)."""
    if message.role == "tool":
        return ToolMessage(message.content, tool_call_id=message.turn_id or "", id=message.turn_id)
    return _CLASS_OF[message.role](message.content, id=message.turn_id)


def split_prompt(messages: Sequence[BaseMessage]) -> tuple[str, list[dict], str | None]:
    """Split a chat prompt into InferScale's request parts.

    Returns:
        ``(query, history, instructions)``: the last message (a human message) is the
        query; earlier human/AI messages are the history (``{"role", "content"}``,
        oldest first); system messages' texts, joined, are the instructions.

    Raises:
        ValueError: no messages, the last is not a human message, or a message of
            another kind (tool messages: InferScale serves text chat).
    """
    if not messages:
        raise ValueError("messages is empty: give at least one HumanMessage (the question)")
    *earlier, last = messages
    if not isinstance(last, HumanMessage):
        raise ValueError(f"the last message must be a HumanMessage (the question), got {type(last).__name__}")
    history, system = [], []
    for i, m in enumerate(earlier):
        if isinstance(m, SystemMessage):
            system.append(_text(m, i))
        elif isinstance(m, (HumanMessage, AIMessage)):
            history.append({"role": _ROLE_OF[m.type], "content": _text(m, i)})
        else:
            raise ValueError(f"message {i} is a {type(m).__name__}: ChatInferScale takes system, human and AI "
                             "messages (no tool calls)")
    return _text(last, len(earlier)), history, "\n\n".join(system) or None
