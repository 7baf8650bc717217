"""Chat sessions over a scope's memory: what the framework adapters' chat histories store.

A session is the part of a scope's turn log whose turns carry ``{"session_id": ...}`` in
their metadata. Writing a message to a session logs it as a turn of the scope (so it is
Context-Window Encoding context for the scope's facts) and stores memories from it:
as given (``infer=False``, the messages of ``fact_roles``) or extracted by the served
LLM (``infer=True``). The facts belong to the scope, not to the session, so a fact told
in one session is retrieved in every later one.

LangChain's ``InferScaleChatMessageHistory`` and LlamaIndex's ``InferScaleChatStore`` are
thin shims over :class:`ChatSessions`; this module knows no framework.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale.checks import check_bool
from inferscale.memory import Memory
from inferscale.store.records import Scope
from inferscale.types import FactInput, require_text

#: Roles a session message may have.
ROLES = ("user", "assistant", "system", "tool")
#: Roles whose messages may have no text (an assistant's tool calls, an empty tool result).
EMPTY_OK = ("assistant", "tool")
#: The turn metadata field that keeps a message's own content and ``extra``.
MESSAGE_FIELD = "message"


@dataclass(frozen=True)
class SessionMessage:
    """One message of a session.

    Attributes:
        role: one of :data:`ROLES`.
        content: the text; may be empty for an assistant's or a tool's message (an
            assistant's message that only calls tools).
        turn_id: its turn id in the scope's log (``None`` before it is written).
        extra: what the framework's message carries besides its role and text (tool calls,
            a tool call's id, ...), JSON, given back whole; kept in the turn's metadata.
    """

    role: str
    content: str
    turn_id: str | None = None
    extra: dict | None = None


class ChatSessions:
    """The sessions of one scope of a :class:`~inferscale.Memory`.

    Args:
        memory: the memory to write to.
        user_id / agent_id: the scope whose facts every session shares (at least one).
        infer: ``False`` stores each message of ``fact_roles`` as a memory as given;
            ``True`` has the served LLM extract memories from every message written.
        fact_roles: roles whose messages become memories when ``infer`` is ``False``
            (default: the user's only; assistant replies are logged as context).

    Raises:
        ValueError: no scope, or an unknown role in ``fact_roles``.
    """

    def __init__(self, memory: Memory, *, user_id: str | None = None, agent_id: str | None = None,
                 infer: bool = False, fact_roles: Sequence[str] = ("user",)) -> None:
        if not isinstance(memory, Memory):
            raise TypeError(f"memory must be an inferscale.Memory, got {type(memory).__name__}")
        self.memory = memory
        self.scope = Scope.of(user_id, agent_id, None)
        if isinstance(fact_roles, (str, bytes)) or not isinstance(fact_roles, (list, tuple, set, frozenset)):
            raise TypeError(f"fact_roles must be a list of roles among {ROLES}, got {type(fact_roles).__name__}")
        bad = [r for r in fact_roles if r not in ROLES]
        if bad:
            raise ValueError(f"fact_roles must be a list of roles among {ROLES}, got {sorted(map(str, bad))}")
        self.infer = check_bool("infer", infer)
        self.fact_roles = tuple(fact_roles)

    def _ids(self) -> dict:
        return self.scope.as_dict()

    def messages(self, session_id: str) -> list[SessionMessage]:
        """The session's messages, oldest first."""
        session_id = _check_session(session_id)
        return [_message(t) for t in self.memory.get_turns(**self._ids()) if t.metadata.get("session_id") == session_id]

    def session_ids(self) -> list[str]:
        """Every session of the scope with at least one message, in order of first message."""
        seen: dict[str, None] = {}
        for t in self.memory.get_turns(**self._ids()):
            if isinstance(t.metadata.get("session_id"), str):
                seen.setdefault(t.metadata["session_id"], None)
        return list(seen)

    def check(self, session_id: str, messages: Sequence[SessionMessage]) -> None:
        """Raise what :meth:`add` would raise for these messages, writing nothing (for a caller
        that adds to several sessions and must write all or none)."""
        self._rows(session_id, messages)

    def add(self, session_id: str, messages: Sequence[SessionMessage]) -> dict:
        """Append messages to the session: log them as turns and store memories from them.

        Returns:
            ``{"results": [...]}`` of the memories stored, as :meth:`Memory.add`.

        Raises:
            ValueError / TypeError: an unknown role or empty content (nothing is written).
        """
        rows = self._rows(session_id, messages)
        if not rows:
            return {"results": []}
        meta = {"session_id": session_id}
        if self.infer:
            return self.memory.add(rows, **self._ids(), metadata=meta, infer=True)
        facts = [r for r in rows if r["role"] in self.fact_roles and _has_text(r["metadata"], r["content"])]
        self.memory.log_turns(rows, **self._ids())
        if not facts:
            return {"results": []}
        return self.memory.add_facts([FactInput(chunk, (r["id"],), meta) for r in facts
                                      for chunk in fact_chunks(self.memory, r["content"])], **self._ids())

    def _rows(self, session_id: str, messages: Sequence[SessionMessage]) -> list[dict]:
        """Validate messages into :meth:`Memory.add` rows with fresh turn ids (writes nothing)."""
        session_id = _check_session(session_id)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of SessionMessage, got {type(messages).__name__}")
        rows = []
        for i, m in enumerate(messages):
            if not isinstance(m, SessionMessage):
                raise TypeError(f"message {i} must be a SessionMessage, got {type(m).__name__}")
            if m.role not in ROLES:
                raise ValueError(f"message {i} has role {m.role!r}; use one of {ROLES}")
            if m.extra is not None and not isinstance(m.extra, dict):
                raise TypeError(f"message {i} extra must be a dict, got {type(m.extra).__name__}")
            meta: dict = {"session_id": session_id}
            text = m.content
            if m.role in EMPTY_OK and isinstance(text, str) and not text.strip():
                text = _placeholder(m)  # the log's turns have text: the context of the scope's facts
                meta[MESSAGE_FIELD] = {"content": m.content, "extra": m.extra}
            else:
                require_text(text, f"message {i} content")
                if m.extra:
                    meta[MESSAGE_FIELD] = {"content": m.content, "extra": m.extra}
            rows.append({"role": m.role, "content": text, "id": f"{session_id}:{uuid.uuid4().hex}", "metadata": meta})
        return rows

    def delete(self, session_id: str, turn_ids: Sequence[str] | None = None) -> int:
        """Delete the session's messages (all, or those of ``turn_ids``); returns how many.

        The memories stored from them stay: they are the scope's, not the session's
        (forget them with :meth:`Memory.delete` / :meth:`Memory.delete_all`).
        """
        own = [m.turn_id for m in self.messages(session_id)]
        wanted = own if turn_ids is None else [t for t in turn_ids if t in set(own)]
        return self.memory.delete_turns(wanted, **self._ids())

    def replace(self, session_id: str, messages: Sequence[SessionMessage]) -> None:
        """Make the session hold exactly ``messages``: messages it already holds in the
        same order are kept (their memories are not stored twice), the rest replaced."""
        current = self.messages(session_id)
        same = 0
        while (same < min(len(current), len(messages)) and current[same].role == messages[same].role
               and current[same].content == messages[same].content
               and (current[same].extra or None) == (messages[same].extra or None)):
            same += 1
        self._rows(session_id, messages[same:])  # validate before deleting anything
        self.delete(session_id, [m.turn_id for m in current[same:]])
        self.add(session_id, messages[same:])


def fact_chunks(memory: Memory, text: str) -> list[str]:
    """``text`` as memories that each fit ``max_fact_tokens``: whole when it fits, else
    consecutive windows of its tokens, cut where a word starts (a long message is kept whole
    as its turn and stored as several memories, never refused after a framework archived it).

    Args:
        memory: whose tokenizer and ``max_fact_tokens`` count.
        text: the message's text (non-empty).

    Returns:
        The chunks in order; joined with single spaces they give the text's words back.
    """
    limit = memory.config.max_fact_tokens
    if memory.fact_tokens(text) <= limit:  # the common case: one message, one memory
        return [text]
    words = text.split()
    overhead = memory.fact_tokens("x") - 1  # the line's "- " and newline
    chunks, current, used = [], [], 0
    for word in words:
        cost = len(memory.tokenizer(" " + word, add_special_tokens=False).input_ids)
        if current and used + cost > limit - overhead - 2:  # 2: merges at the joins
            chunks.append(" ".join(current))
            current, used = [], 0
        if cost > limit - overhead - 2:  # one "word" longer than a memory: cut it by characters
            step = max(1, len(word) * (limit - overhead - 2) // cost)
            chunks.extend(word[i:i + step] for i in range(0, len(word), step))
            continue
        current.append(word)
        used += cost
    if current:
        chunks.append(" ".join(current))
    out: list[str] = []
    while chunks:  # the estimate above is checked: a chunk still over the limit is halved
        chunk = chunks.pop(0)
        if memory.fact_tokens(chunk) <= limit or len(chunk) < 2:
            out.append(chunk)
        else:
            chunks[:0] = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
    return out


def _message(turn) -> SessionMessage:
    """A logged turn as the session message written (its own content and extra when kept)."""
    kept = turn.metadata.get(MESSAGE_FIELD)
    if isinstance(kept, dict):
        return SessionMessage(turn.role, kept.get("content") or "", turn.turn_id, kept.get("extra"))
    return SessionMessage(turn.role, turn.content, turn.turn_id)


def _has_text(meta: dict, content: str) -> bool:
    kept = meta.get(MESSAGE_FIELD)
    return bool((kept["content"] if isinstance(kept, dict) else content).strip())


def _placeholder(m: SessionMessage) -> str:
    """The log's text for a message without any: the tools it calls, or that it is empty."""
    calls = (m.extra or {}).get("tool_calls") or ((m.extra or {}).get("additional_kwargs") or {}).get("tool_calls")
    names = []
    for call in calls or ():
        fn = call.get("function") if isinstance(call, dict) else None
        name = (fn or {}).get("name") if isinstance(fn, dict) else (call.get("name") if isinstance(call, dict) else None)
        if isinstance(name, str) and name:
            names.append(name)
    return f"(calls {', '.join(names)})" if names else "(no text)"


def _check_session(session_id: object) -> str:
    if not isinstance(session_id, str):
        raise TypeError(f"session_id must be a string, got {type(session_id).__name__} {session_id!r}")
    if not session_id.strip():
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
    return session_id
