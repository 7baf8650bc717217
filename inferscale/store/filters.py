"""Metadata filters for ``search`` and ``get_all``, spelled as Mem0 or as Chroma spells them.

A filter is a dict; each key is a field and its value either a plain value (equality) or
an operator dict. Operators: ``eq``, ``ne``, ``gt``, ``gte``, ``lt``, ``lte``, ``in``,
``nin``, ``contains``, ``icontains`` (substring of a string field, the second ignoring
case), each also spelled with a ``$`` as Chroma and MongoDB do (``{"$gte": 2}``).
Combinators: ``AND`` / ``OR`` / ``NOT`` (or ``$and`` / ``$or`` / ``$not``, or ``and`` /
``or`` / ``not`` holding a list of filter dicts) take a list of filters; ``NOT`` matches
when none of its filters does. ``{"field": "*"}`` (Mem0's wildcard) matches every memory
that has the field. Fields are the keys of the memories' ``metadata`` plus ``created_at``
and ``updated_at``.

A memory that lacks a field never matches a condition on that field (``ne`` and ``nin``
included), so a filter on a field no memory has returns nothing, as in Mem0 and Chroma.
``gt`` / ``gte`` / ``lt`` / ``lte`` take a number or a string; when none of the scope's
memories that have the field stores a value comparable with it (``{"topic": {"gt": 2}}``
where every ``topic`` is a string) the filter is a ``ValueError`` naming the field and both
types. Where a field holds mixed types, the rows of another type do not match, and
``eq`` / ``ne`` / ``in`` / ``nin`` between different types never match. ``created_at`` / ``updated_at`` are ISO 8601 strings in UTC
(``"2026-12-01T09:30:00+00:00"``): compare them with strings of the same form. Metadata is
stored as JSON, so filters see it as JSON gives it back (tuples as lists, keys as strings).
AND / OR / NOT nest at most 32 deep. ``NOT`` is logical negation: ``{"NOT": [{"n": {"gte":
2}}]}`` also matches memories without ``n`` (write ``{"n": {"lt": 2}}`` to require it).
Metadata keys ``created_at`` and ``updated_at`` are reserved for the timestamps.

Example: ``{"category": "food", "priority": {"$gte": 2}, "OR": [{"src": "chat"}, {"src": "email"}]}``
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

BUILTIN_FIELDS = ("created_at", "updated_at")
#: the value of a field a memory lacks, in :meth:`Filter.mask` columns
MISSING = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
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
_SCALARS = (str, int, float, bool, type(None))
_ORDERING = frozenset({"gt", "gte", "lt", "lte"})
_COMBINATORS = {"AND": "AND", "OR": "OR", "NOT": "NOT", "$and": "AND", "$or": "OR", "$not": "NOT"}
#: Lower-case combinators, taken as such only when they hold a list of filter dicts (else a field).
_LOWER_COMBINATORS = {"and": "AND", "or": "OR", "not": "NOT"}
#: Mem0's wildcard value: the field is present, whatever its value.
WILDCARD = "*"


def _op_name(op: Any) -> str | None:
    if not isinstance(op, str):
        return None
    name = op[1:] if op.startswith("$") else op
    return name if name in _OPS else None


class Filter:
    """A compiled filter, evaluated on an index partition's columns at once (:meth:`mask`)."""

    def mask(self, column: Callable[[str], np.ndarray], n: int) -> np.ndarray:
        """``[n]`` bool: which rows match. ``column(field)`` is that field's values as an
        ``[n]`` object array, :data:`MISSING` where a row lacks the field."""
        raise NotImplementedError


class _All(Filter):
    def __init__(self, parts: list[Filter]) -> None:
        self.parts = parts

    def mask(self, column, n):
        out = np.ones(n, dtype=bool)
        for p in self.parts:
            out &= p.mask(column, n)
        return out


class _Any(_All):
    def mask(self, column, n):
        out = np.zeros(n, dtype=bool)
        for p in self.parts:
            out |= p.mask(column, n)
        return out


class _None(_Any):
    def mask(self, column, n):
        return ~super().mask(column, n)


class _Leaf(Filter):
    """One condition on one field; a row without the field never matches."""

    def __init__(self, key: str, op: Callable[[Any, Any], bool], arg: Any, name: str = "") -> None:
        self.key, self.op, self.arg, self.name = key, op, arg, name
        self._vector = np.frompyfunc(self.check, 1, 1)

    def check(self, value: Any) -> bool:
        if value is MISSING:
            return False
        try:
            return bool(self.op(value, self.arg))
        except TypeError:  # comparing incomparable types: not a match
            return False

    def mask(self, column, n):
        if not n:
            return np.zeros(0, dtype=bool)
        col = column(self.key)
        # numpy compares object arrays element by element with Python's own operators (no
        # interpreter frame per row); a MISSING row compares unequal to every value
        op = self.op
        if op in (_OPS["eq"], _OPS["ne"]) and isinstance(self.arg, _SCALARS):
            equal = _equal(col, self.arg)
            return equal if op is _OPS["eq"] else ~equal & _present(col)
        if op in (_OPS["in"], _OPS["nin"]) and all(isinstance(v, _SCALARS) for v in self.arg):
            if len(self.arg) <= 8:
                hit = np.zeros(n, dtype=bool)
                for v in self.arg:
                    hit |= _equal(col, v)
            else:  # a long list: one hash lookup per row (hash-equal scalars are == as well)
                lookup = frozenset(self.arg)
                hit = np.frompyfunc(lambda v: _member(v, lookup), 1, 1)(col).astype(bool)
            return hit if op is _OPS["in"] else ~hit & _present(col)
        if self.name in _ORDERING:
            present = _present(col)
            out = np.zeros(n, dtype=bool)
            try:  # raises TypeError when some present value is incomparable with the argument
                out[present] = np.asarray(op(col[present], self.arg), dtype=bool)
            except TypeError:  # mixed types: rows of another type do not match, unless none compares
                values = col[present]
                ok = np.frompyfunc(lambda v: _compares(op, v, self.arg), 1, 1)(values).astype(bool)
                if not ok.any():
                    raise self._mismatch(values[0]) from None
                out[np.flatnonzero(present)[ok]] = np.asarray(op(values[ok], self.arg), dtype=bool)
            return out
        return self._vector(col).astype(bool)

    def _mismatch(self, stored: Any) -> ValueError:
        return ValueError(f"filter {{{self.key!r}: {{{self.name!r}: {self.arg!r}}}}} compares a "
                          f"{type(self.arg).__name__} with {self.key!r}, which this scope's memories store as "
                          f"{type(stored).__name__} (e.g. {stored!r}): compare with a value of the stored type")


def _compares(op: Callable[[Any, Any], bool], a: Any, b: Any) -> bool:
    try:
        op(a, b)
        return True
    except TypeError:
        return False


class _Present(Filter):
    """Mem0's wildcard: the field is present."""

    def __init__(self, key: str) -> None:
        self.key = key

    def mask(self, column, n):
        return _present(column(self.key)) if n else np.zeros(0, dtype=bool)


def _member(value: Any, lookup: frozenset) -> bool:
    try:
        return value in lookup
    except TypeError:  # an unhashable value (a list) equals no scalar
        return False


def _equal(col: np.ndarray, value: Any) -> np.ndarray:
    return np.asarray(col == value, dtype=bool)


def _present(col: np.ndarray) -> np.ndarray:
    return ~np.asarray(col == MISSING, dtype=bool)


class _Everything(Filter):
    def mask(self, column, n):
        return np.ones(n, dtype=bool)


MAX_DEPTH = 32  # nesting of AND / OR / NOT accepted


def compile_filter(filters: dict | None, _depth: int = 0) -> Filter:
    """Check ``filters`` and compile them.

    Args:
        filters: a filter dict (see the module docstring) or ``None`` (everything matches).

    Returns:
        a :class:`Filter` over memories' filter fields (their metadata plus ``created_at`` /
        ``updated_at``, :meth:`inferscale.store.records.FactRecord.filter_fields`), evaluated on a
        whole index partition by ``filter.mask(...)``.

    Raises:
        ValueError: not a dict, an unknown operator or ``$`` key, an empty operator dict, a
            combinator without a non-empty list of filter dicts, ``in``/``nin`` without a
            list, ``contains`` without a string, nesting deeper than :data:`MAX_DEPTH`.
            The message names the offending key and what is accepted.
    """
    if filters is None and _depth == 0:
        return _Everything()
    if not isinstance(filters, dict):
        where = "filters" if _depth == 0 else "each filter inside AND / OR / NOT"
        raise TypeError(f"{where} must be a dict such as {{'category': 'food'}}, got {type(filters).__name__}")
    if _depth > MAX_DEPTH:
        raise ValueError(f"filters are nested deeper than {MAX_DEPTH} levels of AND / OR / NOT")
    parts: list[Filter] = []
    for key, cond in filters.items():
        if not isinstance(key, str):
            raise TypeError(f"filter fields are strings, got {type(key).__name__} {key!r}")
        if not key:
            raise ValueError("filter fields are non-empty strings, got ''")
        if key in _COMBINATORS:
            parts.append(_combinator(_COMBINATORS[key], key, cond, _depth))
        elif key in _LOWER_COMBINATORS and isinstance(cond, list) and cond and all(isinstance(c, dict) for c in cond):
            parts.append(_combinator(_LOWER_COMBINATORS[key], key, cond, _depth))
        elif key.startswith("$"):
            raise ValueError(f"unknown filter key {key!r}: the '$' keys are {sorted(k for k in _COMBINATORS if k[0] == '$')}"
                             " (operators such as '$gte' go inside a field: {'n': {'$gte': 2}})")
        elif isinstance(cond, dict):
            parts.extend(_conditions(key, cond))
        elif isinstance(cond, str) and cond == WILDCARD:
            parts.append(_Present(key))
        else:
            if _has_nan(cond):
                raise ValueError(f"filter on {key!r} got NaN, which equals nothing: give a number")
            parts.append(_Leaf(key, _OPS["eq"], cond))
    return parts[0] if len(parts) == 1 else _All(parts)


def _has_nan(value: Any) -> bool:
    values = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    return any(isinstance(v, float) and v != v for v in values)


def _combinator(kind: str, key: str, cond: Any, depth: int) -> Filter:
    if not isinstance(cond, list) or not cond:
        raise ValueError(f"filter {key!r} takes a non-empty list of filters, e.g. {{{key!r}: [{{'a': 1}}, {{'b': 2}}]}}")
    subs = [compile_filter(sub, depth + 1) for sub in cond]
    return {"AND": _All, "OR": _Any, "NOT": _None}[kind](subs)


def _conditions(key: str, cond: dict) -> list[Filter]:
    names = {op: _op_name(op) for op in cond}
    bad = sorted(str(op) for op, name in names.items() if name is None)
    if not cond:
        raise ValueError(f"the operator dict on {key!r} is empty: give one such as {{'eq': value}}")
    if bad:
        raise ValueError(f"unknown filter operator(s) {bad} on {key!r}: use {sorted(_OPS)} (optionally with a '$')")
    leaves = []
    for op, arg in cond.items():
        name = names[op]
        if name in ("in", "nin") and not isinstance(arg, (list, tuple, set, frozenset)):
            raise ValueError(f"filter operator {op!r} on {key!r} takes a list, got {arg!r}")
        if name in ("eq", "ne") and isinstance(arg, (set, frozenset)):  # no stored value (JSON) is a set
            raise ValueError(f"filter operator {op!r} on {key!r} takes a JSON value, got a set {arg!r:.60}: use "
                             "'in' for membership")
        if name in ("contains", "icontains") and not isinstance(arg, str):
            raise ValueError(f"filter operator {op!r} on {key!r} takes a string, got {arg!r}")
        if name in _ORDERING and (isinstance(arg, bool) or not isinstance(arg, (int, float, str))):
            raise ValueError(f"filter operator {op!r} on {key!r} takes a number or a string, got {arg!r}")
        if _has_nan(arg):
            raise ValueError(f"filter operator {op!r} on {key!r} got NaN, which equals nothing: give a number")
        if name in ("in", "nin"):
            arg = tuple(arg)  # a set and a list mean the same: membership by ==
        leaves.append(_Leaf(key, _OPS[name], arg, name))
    return leaves
