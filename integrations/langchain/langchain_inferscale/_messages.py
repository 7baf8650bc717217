"""Conversions between LangChain messages and InferScale's session and prompt formats."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import (AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage,
                                     message_to_dict, messages_from_dict)

from inferscale.integration import SessionMessage

_ROLE_OF = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}
_CLASS_OF = {"user": HumanMessage, "assistant": AIMessage, "system": SystemMessage}


def _text(message: BaseMessage, i: int) -> str:
    text = str(message.text)
    if not text.strip():
        raise ValueError(f"message {i} ({message.type}) has no text: InferScale stores and serves text messages")
    return text


def to_session_message(message: BaseMessage, i: int = 0) -> SessionMessage:
    """A LangChain message as a :class:`SessionMessage` (human -> user, ai -> assistant). An
    AI message with tool calls or additional kwargs, and a tool message, are kept whole
    (``message_to_dict``, as LangChain's own chat histories keep them); an AI or tool
    message may have no text.

    Raises:
        TypeError: not a ``BaseMessage``. ValueError: a human or system message without text.
    """
    if not isinstance(message, BaseMessage):
        raise TypeError(f"message {i} must be a LangChain BaseMessage, got {type(message).__name__}")
    role = _ROLE_OF.get(message.type, getattr(message, "role", message.type))
    whole = isinstance(message, ToolMessage) or (isinstance(message, AIMessage) and (
        message.tool_calls or message.invalid_tool_calls or message.additional_kwargs))
    text = str(message.text) if role in ("assistant", "tool") else _text(message, i)
    return SessionMessage(role, text, extra={"langchain": message_to_dict(message)} if whole else None)


def from_session_message(message: SessionMessage) -> BaseMessage:
    """A stored session message as the LangChain message of its role (``id`` = its turn id
    when it had none); one kept whole comes back as it was written."""
    kept = (message.extra or {}).get("langchain")
    if isinstance(kept, dict):
        (restored,) = messages_from_dict([kept])
        return restored if restored.id else restored.model_copy(update={"id": message.turn_id})
    if message.role == "tool":
        return ToolMessage(message.content, tool_call_id=message.turn_id or "", id=message.turn_id)
    return _CLASS_OF[message.role](message.content, id=message.turn_id)


def _history_message(m: BaseMessage, i: int) -> dict:
    if isinstance(m, AIMessage) and m.tool_calls:
        calls = [{"name": c["name"], "arguments": c["args"]} for c in m.tool_calls]
        return {"role": "assistant", "content": str(m.text) or None, "tool_calls": calls}
    if isinstance(m, (AIMessage, ToolMessage)):  # an empty answer or tool result is valid
        return {"role": _ROLE_OF[m.type], "content": str(m.text)}
    if isinstance(m, HumanMessage):
        return {"role": "user", "content": _text(m, i)}
    raise ValueError(f"message {i} is a {type(m).__name__}: ChatInferScale takes system, human, AI and tool messages")


def split_prompt(messages: Sequence[BaseMessage]) -> tuple[str, list[dict], str | None, list[dict]]:
    """Split a chat prompt into InferScale's request parts.

    Returns:
        ``(query, history, instructions, followup)``: the last human message is the query
        (what memories are retrieved for); messages before it are the history and those
        after it (an AI message's tool calls and the tool results of an agent's loop) the
        followup, as ``{"role", "content"}`` dicts (``"tool_calls"`` on AI messages that
        call tools), oldest first; system messages' texts, joined, are the instructions.

    Raises:
        ValueError: no messages, no human message, an empty message, or a message of
            another kind.
    """
    if not messages:
        raise ValueError("messages is empty: give at least one HumanMessage (the question)")
    asked = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    if not asked:
        raise ValueError("the messages have no HumanMessage: give the question as a HumanMessage")
    q = asked[-1]
    history, followup, system = [], [], []
    for i, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            system.append(_text(m, i))
        elif i != q:
            (history if i < q else followup).append(_history_message(m, i))
    return _text(messages[q], q), history, "\n\n".join(system) or None, followup
