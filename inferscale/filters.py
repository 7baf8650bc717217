"""Metadata filters for ``search`` and ``get_all``, spelled as Mem0 or as Chroma spells them.

A filter is a dict; each key is a field and its value either a plain value (equality) or
an operator dict. Operators: ``eq``, ``ne``, ``gt``, ``gte``, ``lt``, ``lte``, ``in``,
``nin``, ``contains``, ``icontains`` (substring of a string field, the second ignoring
case), each also spelled with a ``$`` as Chroma and MongoDB do (``{"$gte": 2}``).
Combinators: ``AND`` / ``OR`` / ``NOT`` (or ``$and`` / ``$or`` / ``$not``) take a list of
filters; ``NOT`` matches when none of its filters does. Fields are the keys of the
memories' ``metadata`` plus ``created_at`` and ``updated_at``.

A memory that lacks a field never matches a condition on that field (``ne`` and ``nin``
included), so a filter on a field no memory has returns nothing, as in Mem0 and Chroma.
Comparing values of different types (``{"n": {"gt": 2}}`` against ``"n": "x"``) is not a
match either.

Example: ``{"category": "food", "priority": {"$gte": 2}, "OR": [{"src": "chat"}, {"src": "email"}]}``
"""

from __future__ import annotations

from typing import Any, Callable

BUILTIN_FIELDS = ("created_at", "updated_at")
_MISSING = object()
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
    "in": lambda a, b: a in b,
    "nin": lambda a, b: a not in b,
    "contains": lambda a, b: isinstance(a, str) and b in a,
    "icontains": lambda a, b: isinstance(a, str) and b.lower() in a.lower(),
}
_COMBINATORS = {"AND": "AND", "OR": "OR", "NOT": "NOT", "$and": "AND", "$or": "OR", "$not": "NOT"}
Predicate = Callable[[dict], bool]


def _op_name(op: Any) -> str | None:
    if not isinstance(op, str):
        return None
    name = op[1:] if op.startswith("$") else op
    return name if name in _OPS else None


def compile_filter(filters: dict | None) -> Predicate:
    """Check ``filters`` and turn them into a predicate over a memory's filter fields.

    Args:
        filters: a filter dict (see the module docstring) or ``None`` (everything matches).

    Returns:
        ``predicate(fields) -> bool``, where ``fields`` is a memory's metadata plus
        ``created_at`` / ``updated_at`` (:meth:`inferscale.store.FactRecord.filter_fields`).

    Raises:
        ValueError: not a dict, an unknown operator, an empty operator dict, a combinator
            without a non-empty list, ``in``/``nin`` without a list, ``contains`` without a
            string. The message names the offending key and what is accepted.
    """
    if filters is None:
        return lambda fields: True
    if not isinstance(filters, dict):
        raise ValueError(f"filters must be a dict such as {{'category': 'food'}}, got {type(filters).__name__}")
    parts: list[Predicate] = []
    for key, cond in filters.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"filter fields are non-empty strings, got {key!r}")
        if key in _COMBINATORS:
            parts.append(_combinator(_COMBINATORS[key], key, cond))
        elif isinstance(cond, dict):
            parts.append(_conditions(key, cond))
        else:
            parts.append(_condition(key, _OPS["eq"], cond))
    if len(parts) == 1:
        return parts[0]
    return lambda fields: all(p(fields) for p in parts)


def _combinator(kind: str, key: str, cond: Any) -> Predicate:
    if not isinstance(cond, list) or not cond:
        raise ValueError(f"filter {key!r} takes a non-empty list of filters, e.g. {{{key!r}: [{{'a': 1}}, {{'b': 2}}]}}")
    subs = [compile_filter(sub) for sub in cond]
    if kind == "AND":
        return lambda fields: all(s(fields) for s in subs)
    if kind == "OR":
        return lambda fields: any(s(fields) for s in subs)
    return lambda fields: not any(s(fields) for s in subs)


def _conditions(key: str, cond: dict) -> Predicate:
    names = {op: _op_name(op) for op in cond}
    bad = sorted(str(op) for op, name in names.items() if name is None)
    if bad or not cond:
        raise ValueError(f"unknown filter operator(s) {bad} on {key!r}: use {sorted(_OPS)} (optionally with a '$')")
    checks = []
    for op, arg in cond.items():
        name = names[op]
        if name in ("in", "nin") and not isinstance(arg, (list, tuple, set, frozenset)):
            raise ValueError(f"filter operator {op!r} on {key!r} takes a list, got {arg!r}")
        if name in ("contains", "icontains") and not isinstance(arg, str):
            raise ValueError(f"filter operator {op!r} on {key!r} takes a string, got {arg!r}")
        checks.append(_condition(key, _OPS[name], arg))
    if len(checks) == 1:
        return checks[0]
    return lambda fields: all(c(fields) for c in checks)


def _condition(key: str, op: Callable[[Any, Any], bool], arg: Any) -> Predicate:
    def check(fields: dict) -> bool:
        value = fields.get(key, _MISSING)
        if value is _MISSING:
            return False
        try:
            return bool(op(value, arg))
        except TypeError:  # comparing incomparable types: not a match
            return False

    return check


def validate_filters(filters: dict | None) -> None:
    """Raise :class:`ValueError` if ``filters`` is malformed (see :func:`compile_filter`)."""
    compile_filter(filters)


def matches(filters: dict | None, fields: dict) -> bool:
    """Whether a memory's ``fields`` (metadata plus built-ins) satisfy ``filters``.

    Raises:
        ValueError: malformed ``filters``.
    """
    return compile_filter(filters)(fields)
