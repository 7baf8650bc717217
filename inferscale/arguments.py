"""The Mem0-style arguments of every entry point, checked and translated before anything is
written: the scope (as keywords or inside Mem0's ``filters``), messages into turns, metadata,
facts with provenance, result limits and timeouts. Built on :mod:`inferscale.checks` (the
primitive checks: integers, numbers, ids, roles). Wrong type: ``TypeError``; wrong value:
``ValueError``; one line each, naming the argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

from inferscale.checks import MAX_CONTEXT_WINDOW, check_int, check_role
from inferscale.store.filters import MAX_DEPTH as MAX_FILTER_DEPTH
from inferscale.store.records import EXPIRES_AT, Scope
from inferscale.store.turns import Turn
from inferscale.types import FactInput, require_text

#: Longest ``wait_for_kv`` timeout accepted, in seconds (a year; ``None`` waits without limit).
MAX_TIMEOUT_S = 365 * 24 * 3600.0

#: The scope's fields, which Mem0's current API also takes inside ``filters``.
SCOPE_FIELDS = frozenset({"user_id", "agent_id", "run_id"})


def messages_to_turns(messages: Any) -> list[Turn]:
    """``add``'s ``messages`` (a string, a message dict or a list of them) as turns.

    Raises:
        TypeError: another type, or a malformed message. ValueError: no messages, or a bad one.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif isinstance(messages, dict):
        messages = [messages]
    if isinstance(messages, bytes) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a string, a message dict or a list of message dicts, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give a string, a message dict or a list of message dicts")
    return [turn_from_message(i, m) for i, m in enumerate(messages)]


def message_list_to_turns(messages: Any) -> list[Turn]:
    """``log_turns``' ``messages`` (a list of message dicts) as turns.

    Raises:
        TypeError / ValueError: not a list, or a malformed message.
    """
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    return [turn_from_message(i, m) for i, m in enumerate(messages)]


def fact_inputs(facts: Any) -> list[FactInput]:
    """``add_facts``' ``facts`` (:class:`FactInput` s or strings) checked, metadata normalised.

    Raises:
        TypeError: not a list, a fact of another type, source turn ids not a tuple of strings.
        ValueError: empty text, bad metadata.
    """
    if isinstance(facts, (str, bytes, FactInput)) or not isinstance(facts, Sequence):
        raise TypeError(f"facts must be a list of FactInput or strings, got {type(facts).__name__}")
    inputs = [FactInput(f) if isinstance(f, str) else f for f in facts]
    for i, f in enumerate(inputs):
        if not isinstance(f, FactInput):
            raise TypeError(f"fact {i} must be a FactInput or a string, got {type(f).__name__}")
        require_text(f.text, f"fact {i} text")
        inputs[i] = dataclasses.replace(f, metadata=check_metadata(f.metadata))  # None -> {}
        ids = f.source_turn_ids
        if isinstance(ids, str) or not isinstance(ids, (tuple, list)) or not all(
                isinstance(t, str) and t for t in ids):
            raise TypeError(f"fact {i} source_turn_ids must be a tuple of turn id strings, got {ids!r}")
    return inputs


def check_texts(texts: Any, name: str = "texts") -> list[str]:
    """A list of non-empty strings.

    Raises:
        TypeError: not a list of strings. ValueError: an empty one.
    """
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        require_text(t, f"{name}[{i}]")
    return list(texts)


def check_turn_ids(turn_ids: Any) -> list[str]:
    """A list of turn id strings.

    Raises:
        TypeError: anything else.
    """
    if isinstance(turn_ids, (str, bytes)) or not isinstance(turn_ids, Sequence) or not all(
            isinstance(t, str) for t in turn_ids):
        raise TypeError(f"turn_ids must be a list of turn id strings, got {turn_ids!r}")
    return list(turn_ids)


def check_timeout(timeout: Any) -> float | None:
    """Seconds to wait (``None``: no limit), at most :data:`MAX_TIMEOUT_S`.

    Raises:
        TypeError: not a number or ``None``. ValueError: negative, too long or not finite.
    """
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise TypeError(f"timeout must be seconds (a number) or None, got {timeout!r}")
    if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be between 0 and {MAX_TIMEOUT_S:g} seconds (None: no limit), got {timeout!r}")
    return timeout


def check_context_window(context_window: Any) -> int | None:
    """w in turns, or ``None`` for the configured default.

    Raises:
        TypeError: not an integer. ValueError: out of range.
    """
    return check_int("context_window", context_window, optional=True, unit="turns", maximum=MAX_CONTEXT_WINDOW)


def scope_and_filters(user_id: str | None, agent_id: str | None, run_id: str | None,
                      filters: dict | None) -> tuple[Scope, dict | None]:
    """The scope from keywords and/or the top-level ``user_id`` / ``agent_id`` / ``run_id`` keys
    of Mem0-style ``filters``, and the filters left for metadata.

    Raises:
        ValueError: a scope key in ``filters`` is not a non-empty string (operators do not
            apply to the scope), or disagrees with the keyword of the same name; no scope.
    """
    nested = _nested_scope_key(filters.values() if isinstance(filters, dict) else ())
    if nested:
        raise ValueError(f"filters has {nested!r} inside an AND / OR / NOT: the scope goes at the top level "
                         f"(filters={{{nested!r}: ..., 'AND': [...]}}) or as a keyword ({nested}=...)")
    if not isinstance(filters, dict) or not SCOPE_FIELDS & filters.keys():
        return Scope.of(user_id, agent_id, run_id), filters
    given = {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}
    rest = dict(filters)
    for name in SCOPE_FIELDS & filters.keys():
        value = rest.pop(name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"filters[{name!r}] is the scope and must be a non-empty string, got {value!r}: "
                             "operators apply to metadata fields only")
        if given[name] is not None and given[name] != value:
            raise ValueError(f"{name}={given[name]!r} and filters[{name!r}]={value!r} disagree: give the scope once")
        given[name] = value
    return Scope.of(**given), rest or None


def _nested_scope_key(values, depth: int = 0) -> str | None:
    """A scope field used as a key below the top level of filters (inside a logical operator);
    nesting past the filters' own limit is left to :func:`inferscale.store.filters.compile_filter`."""
    if depth > MAX_FILTER_DEPTH:
        return None
    for value in values:
        children = value if isinstance(value, list) else [value]
        for child in children:
            if isinstance(child, dict):
                found = next((k for k in child if k in SCOPE_FIELDS), None) or _nested_scope_key(child.values(),
                                                                                                   depth + 1)
                if found:
                    return found
    return None


def turn_from_message(i: int, m: Any) -> Turn:
    """Message ``i`` of a call as a :class:`~inferscale.store.turns.Turn` (its id ``""`` when the message has none).

    Raises:
        TypeError: not a dict, or a field of the wrong type. ValueError: empty content, a
            bad role, a blank or out-of-range id, bad metadata.
    """
    if not isinstance(m, dict):
        raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
    content = require_text(m.get("content"), f"message {i} content")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise TypeError(f"message {i} name must be a string, got {type(m['name']).__name__}")
    role = check_role(f"message {i}", m.get("role", "user"))
    turn_id = m.get("id")
    if turn_id is not None and (isinstance(turn_id, bool) or not isinstance(turn_id, (str, int))):
        raise TypeError(f"message {i} id must be a string (or an int), got {type(turn_id).__name__}")
    if isinstance(turn_id, str) and not turn_id.strip():
        raise ValueError(f"message {i} id is blank: give a non-empty turn id, or leave it out for an automatic one")
    if isinstance(turn_id, int) and not -2**63 <= turn_id < 2**63:
        raise ValueError(f"message {i} id {turn_id} is out of range: give a string id")
    return Turn(str(turn_id) if turn_id is not None else "", role, content, m.get("name"),
                metadata=check_metadata(m.get("metadata")))


#: Deepest metadata accepted (levels of dicts and lists): deeper values could be stored
#: but not read back (JSON encoders stop at ~250 levels).
MAX_METADATA_DEPTH = 32


def metadata_depth(value: Any, level: int = 0) -> int:
    """Levels of dicts and lists in ``value`` (counting stops past :data:`MAX_METADATA_DEPTH`)."""
    if level > MAX_METADATA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((metadata_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, (list, tuple)):
        return max((metadata_depth(v, level + 1) for v in value), default=level + 1)
    return level


def _non_string_key(value: Any, level: int = 0) -> Any:
    """The first dict key below ``value`` that is not a string (``None`` if every key is one)."""
    if level > MAX_METADATA_DEPTH + 1:
        return None  # too deep: refused by the depth check
    if isinstance(value, dict):
        for key, child in value.items():
            if not isinstance(key, str):
                return key
            found = _non_string_key(child, level + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for child in value:
            found = _non_string_key(child, level + 1)
            if found is not None:
                return found
    return None


def check_metadata_patch(metadata: Any) -> dict:
    """A metadata patch (:meth:`inferscale.Memory.update_metadata`): checked as
    :func:`check_metadata`, with at least one field (``None`` values: fields to remove).

    Raises:
        TypeError / ValueError: as :func:`check_metadata`; ``TypeError`` for ``None`` (a patch is
            a dict); ``ValueError`` when it names no field.
    """
    if metadata is None:
        raise TypeError("metadata must be a dict of the fields to set (or to remove, as None), e.g. {'topic': "
                        "'food'}, got None")
    fields = check_metadata(metadata)
    if metadata is None or not fields:
        raise ValueError("metadata must name at least one field to set (or to remove, as None), e.g. "
                         "{'topic': 'food'}")
    return fields


def check_metadata(metadata: Any) -> dict:
    """``metadata`` as stored (``None`` -> ``{}``): a JSON object with string keys, at most
    :data:`MAX_METADATA_DEPTH` levels deep, without the reserved timestamp keys; its
    ``expires_at`` (:data:`~inferscale.store.records.EXPIRES_AT`), when given, in epoch seconds.

    Raises:
        TypeError: not a dict, a non-string key, not JSON-serialisable. ValueError: NaN or
            Infinity, not valid Unicode (a lone surrogate), too deep, a reserved key, an
            ``expires_at`` that is not a number.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    bad_key = _non_string_key(metadata)
    if bad_key is not None:  # JSON would turn it into a string, and could merge it with another key
        raise TypeError(f"metadata keys must be strings, got {type(bad_key).__name__} {bad_key!r}")
    try:
        json.dumps(metadata, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: stored, it would break every read of the scope
        raise ValueError(f"metadata is not valid Unicode ({exc.reason}): fix its encoding") from None
    except ValueError as exc:  # NaN / Infinity: not JSON, and a JSON reader would see null
        raise ValueError(f"metadata must be JSON: {exc} (NaN and Infinity have no JSON form)") from None
    except (TypeError, RecursionError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable: {exc}") from None
    if metadata_depth(metadata) > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep: flatten it")
    reserved = sorted({"created_at", "updated_at"} & {str(k) for k in metadata})
    if reserved:
        raise ValueError(f"metadata keys {reserved} are reserved: every memory has them as timestamps (filters "
                         "read those); rename the keys")
    _check_expiry(metadata.get(EXPIRES_AT))
    return dict(metadata)


def _check_expiry(value: Any) -> None:
    """``metadata["expires_at"]`` is the memory's expiry: epoch seconds, or ``None`` (none).

    Raises:
        ValueError: anything else (a date string, a bool, a number no float holds: ``10**400``,
            NaN, infinity).
    """
    if value is None:
        return
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:  # an int beyond float's range: the index keeps expiries as floats
        finite = False
    if not finite:
        raise ValueError(f"metadata[{EXPIRES_AT!r}] is the memory's expiry in epoch seconds (a finite number such "
                         f"as {4102444800}; search and chat skip the memory after it), got {value!r:.60}")


def per_message_metadata(metadata: Any, n_messages: int, infer: bool) -> list[dict] | None:
    """``add``'s ``metadata`` when it is a list: one checked dict per message (``None`` -> ``{}``);
    ``None`` when it is not a list (one dict for every message, checked by the caller).

    Raises:
        ValueError: a list whose length is not ``n_messages``, or a list with ``infer=True``
            (the extracted facts are not the messages). TypeError: an entry that is not a dict.
    """
    if not isinstance(metadata, (list, tuple)):
        return None
    if infer:
        raise ValueError("a metadata list gives each message's memory its own metadata, so it needs infer=False "
                         "(with infer=True the facts are extracted, not the messages): pass one dict")
    if len(metadata) != n_messages:
        raise ValueError(f"metadata has {len(metadata)} entries for {n_messages} messages: give one dict (or None) "
                         "per message, or one dict for all")
    out = []
    for i, m in enumerate(metadata):
        try:
            out.append(check_metadata(m))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"metadata[{i}]: {exc}") from None
    return out


def batch_items(method: str, items: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> list[dict]:
    """``batch_update`` / ``batch_delete``'s ``memories``: a non-empty list of dicts with the
    ``required`` keys and no keys beyond ``optional``.

    Raises:
        TypeError: not a list, an entry not a dict. ValueError: empty, a key missing or unknown.
    """
    shape = "{" + ", ".join(f"'{k}': ..." for k in required) + "}"
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Sequence):
        raise TypeError(f"{method} takes a list of dicts such as [{shape}], got {type(items).__name__}")
    if not items:
        raise ValueError(f"{method} got an empty list: give at least one {shape}")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TypeError(f"{method}: entry {i} must be a dict such as {shape}, got {type(item).__name__} "
                            f"{item!r:.40}")
        missing = [k for k in required if k not in item]
        unknown = sorted(str(k) for k in item if k not in required and k not in optional)
        if missing or unknown:
            raise ValueError(f"{method}: entry {i} " + (f"lacks {missing}" if missing else f"has unknown keys {unknown}")
                             + f": each entry is {shape}" + (f" with optional {list(optional)}" if optional else ""))
    return list(items)
