"""LangGraph's value filters and namespace prefixes as InferScale metadata filters, over the
``lg_v:`` and ``lg_ns_<i>`` fields ``InferScaleStore`` keeps in each item's memory."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

_OPS = {"$eq": "eq", "$ne": "ne", "$gt": "gt", "$gte": "gte", "$lt": "lt", "$lte": "lte"}


def _value_field(path: list[str]) -> str:
    return "lg_v:" + json.dumps(path, ensure_ascii=False)


def _namespace_filters(prefix: tuple[str, ...]) -> dict:
    return {f"lg_ns_{i}": label for i, label in enumerate(prefix)}


def _value_filters(filters: dict, path: tuple[str, ...] = ()) -> dict:
    """A LangGraph value filter (``{"field": value}``, ``{"field": {"$gt": 2}}``, nested dicts
    matched field by field) as InferScale metadata filters on the ``lg_v:`` fields. A field
    name with dots (``"user.level"``) matches the field of that name or the nested path
    (``InMemoryStore`` reads the first, ``SqliteStore`` and ``PostgresStore`` the second).

    Raises:
        TypeError / ValueError: not a dict, or an operator other than ``$eq``, ``$ne``,
            ``$gt``, ``$gte``, ``$lt``, ``$lte``.
    """
    if not isinstance(filters, dict):
        raise TypeError(f"filter must be a dict such as {{'category': 'food'}}, got {type(filters).__name__}")
    out: dict = {}
    for key, cond in filters.items():
        if not isinstance(key, str):
            raise TypeError(f"filter fields are strings, got {key!r}")
        field = [*path, key]
        if isinstance(cond, dict) and not any(str(k).startswith("$") for k in cond):
            out.update(_value_filters(cond, tuple(field)))
            continue
        ops = _condition(key, cond)
        if ops is None:
            continue
        if "." in key:
            either = [{_value_field(field): ops}, {_value_field([*path, *key.split(".")]): ops}]
            out.setdefault("AND", []).append({"OR": either})
        else:
            out[_value_field(field)] = ops
    return out


def _condition(key: str, cond: Any) -> dict | None:
    """One field's condition as InferScale operators (``None``: no constraint)."""
    if isinstance(cond, dict):
        bad = sorted(str(k) for k in cond if k not in _OPS)
        if bad:
            raise ValueError(f"unsupported filter operator(s) {bad} on {key!r}: use {sorted(_OPS)}")
        ops = {_OPS[k]: _json(v) for k, v in cond.items() if not (k == "$ne" and _is_nan(v))}  # x != NaN: all
        if any(_is_nan(v) for v in ops.values()):
            raise _MatchesNothing
        ops = dict(item for item in (_finite(op, v) for op, v in ops.items()) if item is not None)
        return ops or None
    if _is_nan(cond) or _is_inf(cond):  # no stored value is NaN or infinite (JSON has neither)
        raise _MatchesNothing
    return {"eq": _json(cond)}


def _finite(op: str, value: Any) -> tuple[str, Any] | None:
    """A comparison with an infinity as one with the largest finite float, which JSON (and so
    a filter over HTTP) can carry: ``x < inf`` is ``x <= max``, ``x > -inf`` is ``x >= -max``;
    ``None`` when every value passes (``x != inf``).

    Raises:
        _MatchesNothing: no finite value passes (``x > inf``, ``x == -inf``).
    """
    if not _is_inf(value):
        return op, value
    big = value > 0
    if op == "ne":
        return None
    if (op in ("lt", "lte") and big) or (op in ("gt", "gte") and not big):
        return ("lte", sys.float_info.max) if big else ("gte", -sys.float_info.max)
    raise _MatchesNothing


class _MatchesNothing(Exception):
    """A filter no value can satisfy (NaN compared with ``==``, ``<`` and the like), as in
    ``InMemoryStore``, where such a comparison is simply false."""


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def _is_inf(value: Any) -> bool:
    return isinstance(value, float) and value in (math.inf, -math.inf)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value)) if isinstance(value, (list, tuple, dict)) else value
