"""Mem0-style metadata filters for ``search`` and ``get_all``.

A filter is a dict; each key is a field and its value either a plain value (equality) or
an operator dict: ``{"eq", "ne", "gt", "gte", "lt", "lte", "in", "nin"}``. ``"AND"`` /
``"OR"`` take lists of filters. Fields are the keys of the memories' ``metadata`` plus
``created_at`` and ``updated_at``.

Example: ``{"category": "food", "priority": {"gte": 2}, "OR": [{"src": "chat"}, {"src": "email"}]}``
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

BUILTIN_FIELDS = ("created_at", "updated_at")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "gt": lambda a, b: a is not None and a > b,
    "gte": lambda a, b: a is not None and a >= b,
    "lt": lambda a, b: a is not None and a < b,
    "lte": lambda a, b: a is not None and a <= b,
    "in": lambda a, b: a in b,
    "nin": lambda a, b: a not in b,
}


def validate_filters(filters: dict | None, known_fields: Iterable[str] | None) -> None:
    """Check ``filters`` against the fields the scope's memories have (``None``: shape only).

    Raises:
        ValueError: not a dict, an unknown field or operator, or a malformed AND/OR.
    """
    if filters is None:
        return
    if not isinstance(filters, dict):
        raise ValueError(f"filters must be a dict such as {{'category': 'food'}}, got {type(filters).__name__}")
    known = None if known_fields is None else set(known_fields) | set(BUILTIN_FIELDS)
    for key, cond in filters.items():
        if key in ("AND", "OR"):
            if not isinstance(cond, list) or not cond:
                raise ValueError(f"filter {key!r} takes a non-empty list of filters")
            for sub in cond:
                validate_filters(sub, known)
            continue
        if known is not None and key not in known:
            raise ValueError(f"unknown filter field {key!r}: this scope's memories have {sorted(known)}")
        if isinstance(cond, dict):
            bad = set(cond) - set(_OPS)
            if bad or not cond:
                raise ValueError(f"unknown filter operator(s) {sorted(bad)} on {key!r}: use {sorted(_OPS)}")
            for op in ("in", "nin"):
                if op in cond and not isinstance(cond[op], (list, tuple, set)):
                    raise ValueError(f"filter operator {op!r} on {key!r} takes a list")


def matches(filters: dict | None, fields: dict) -> bool:
    """Whether a memory's ``fields`` (metadata plus built-ins) satisfy ``filters`` (validated)."""
    if not filters:
        return True
    for key, cond in filters.items():
        if key == "AND":
            ok = all(matches(sub, fields) for sub in cond)
        elif key == "OR":
            ok = any(matches(sub, fields) for sub in cond)
        elif isinstance(cond, dict):
            value = fields.get(key)
            try:
                ok = all(_OPS[op](value, arg) for op, arg in cond.items())
            except TypeError:  # comparing incomparable types: not a match
                ok = False
        else:
            ok = fields.get(key) == cond
        if not ok:
            return False
    return True
