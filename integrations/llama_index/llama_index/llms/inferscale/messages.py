"""Conversions between LlamaIndex ``ChatMessage`` s and InferScale's session and prompt formats."""

from __future__ import annotations

from collections.abc import Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole

from inferscale.integration import SessionMessage

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


def _history_message(m: ChatMessage, role: str, i: int) -> dict:
    calls = m.additional_kwargs.get("tool_calls") if role == "assistant" else None
    if calls:
        # OpenAI SDK objects (another LLM's history) as their dicts
        calls = [c.model_dump() if hasattr(c, "model_dump") else c for c in calls]
        return {"role": "assistant", "content": m.content or None, "tool_calls": calls}
    if role in ("assistant", "tool"):  # an empty answer or tool result is valid
        return {"role": role, "content": m.content or ""}
    if role == "user":
        return {"role": role, "content": _text(m, i)}
    raise ValueError(f"message {i} has role {m.role.value!r}: InferScaleLLM takes system, user, assistant and tool "
                     "messages")


def to_session_message(message: ChatMessage, i: int = 0) -> SessionMessage:
    """A ``ChatMessage`` as a :class:`SessionMessage` (chatbot/model -> assistant, developer ->
    system), its ``additional_kwargs`` (an assistant's ``tool_calls``, a tool result's
    ``tool_call_id``) kept as JSON. An assistant's or a tool's message may have no text.

    Raises:
        TypeError: not a ``ChatMessage``, or ``additional_kwargs`` JSON cannot hold.
        ValueError: a user or system message without text.
    """
    if not isinstance(message, ChatMessage):
        raise TypeError(f"message {i} must be a llama_index ChatMessage, got {type(message).__name__}")
    role = _ROLE_OF[message.role]
    text = message.content or "" if role in ("assistant", "tool") else _text(message, i)
    kwargs = _jsonable(message.additional_kwargs, i)
    return SessionMessage(role, text, extra={"additional_kwargs": kwargs} if kwargs else None)


def from_session_message(message: SessionMessage) -> ChatMessage:
    """A stored session message as a ``ChatMessage`` (with its ``additional_kwargs`` back)."""
    kwargs = (message.extra or {}).get("additional_kwargs") or {}
    return ChatMessage(role=_MESSAGE_ROLE[message.role], content=message.content, additional_kwargs=kwargs)


def _jsonable(kwargs: dict, i: int) -> dict:
    """``additional_kwargs`` as JSON (OpenAI SDK objects as their dicts)."""
    def plain(value):
        if hasattr(value, "model_dump"):
            return value.model_dump()
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise TypeError(f"message {i} additional_kwargs hold a {type(value).__name__}, which a chat store cannot "
                        "keep: give JSON values")
    return plain(dict(kwargs or {}))


def split_prompt(messages: Sequence[ChatMessage]) -> tuple[str, list[dict], str | None, list[dict]]:
    """Split chat messages into InferScale's request parts.

    Returns:
        ``(query, history, instructions, followup)``: the last user message is the query
        (what memories are retrieved for); messages before it are the history and those
        after it (an assistant's tool calls, in ``additional_kwargs["tool_calls"]``, and the
        tool results of an agent's loop) the followup, ``{"role", "content"}`` dicts oldest
        first; system messages' texts, joined, are the instructions.

    Raises:
        TypeError: a message that is not a ``ChatMessage``.
        ValueError: no messages, no user message, an empty message.
    """
    if not messages:
        raise ValueError("messages is empty: give at least one user ChatMessage (the question)")
    roles = [_ROLE_OF[m.role] if isinstance(m, ChatMessage) else None for m in messages]
    for i, (m, role) in enumerate(zip(messages, roles)):
        if role is None:
            raise TypeError(f"message {i} must be a llama_index ChatMessage, got {type(m).__name__}")
    asked = [i for i, role in enumerate(roles) if role == "user"]
    if not asked:
        raise ValueError("the messages have no user message: give the question as a user ChatMessage")
    q = asked[-1]
    history, followup, system = [], [], []
    for i, (m, role) in enumerate(zip(messages, roles)):
        if role == "system":
            system.append(_text(m, i))
        elif i != q:
            (history if i < q else followup).append(_history_message(m, role, i))
    return _text(messages[q], q), history, "\n\n".join(system) or None, followup
