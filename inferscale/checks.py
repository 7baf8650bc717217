"""Argument checks shared by every public entry point: one wording for every error.

A wrong type is a ``TypeError`` and a wrong value a ``ValueError``; each message names the
argument, what it got and what is accepted, and is raised before anything is written.
"""

from __future__ import annotations

import math
from typing import Any

#: Largest w (Context-Window Encoding, in turns) accepted anywhere: far beyond any context
#: length, and small enough for every integer column it is stored in.
MAX_CONTEXT_WINDOW = 100_000

#: Message roles InferScale renders with a chat template (OpenAI's and Mem0's roles).
ROLES = ("user", "assistant", "system", "tool")


def _got(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def check_int(name: str, value: Any, minimum: int = 0, *, optional: bool = False, unit: str = "",
              maximum: int | None = None) -> int | None:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]`` (or ``None`` when ``optional``).

    Raises:
        TypeError: not an integer. ValueError: out of range.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer{unit and f' ({unit})'}{' or None' if optional else ''}, "
                        f"got {_got(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{unit and f' ({unit})'}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}{unit and f' ({unit})'}, got {value}")
    return value


def result_limit(limit: Any, top_k: Any, default: int = 100) -> int:
    """How many results a read returns: ``limit`` (Mem0 2.x's name) or ``top_k`` (Mem0's current
    name, ``Memory.search(query, top_k=...)``), ``default`` when neither is given.

    Raises:
        TypeError: not an integer. ValueError: negative, or both given with different values.
    """
    check_int("limit", limit, optional=True)
    check_int("top_k", top_k, optional=True)
    if limit is not None and top_k is not None and limit != top_k:
        raise ValueError(f"limit={limit} and top_k={top_k} disagree: they are one setting (Mem0's old and new "
                         "names); give one")
    return default if limit is None and top_k is None else (limit if limit is not None else top_k)


def check_number(name: str, value: Any, low: float, high: float, *, optional: bool = False) -> float | None:
    """``value`` if it is a finite real number in ``[low, high]`` (or ``None`` when ``optional``).

    Raises:
        TypeError: not a number. ValueError: out of range or not finite.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number{' or None' if optional else ''}, got {_got(value)}")
    if isinstance(value, float) and not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Raises:
        TypeError: anything else (a string such as ``"no"`` is not a flag).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_got(value)}")
    return value


def check_id(name: str, value: Any) -> str:
    """``value`` if it is a non-empty string (a memory id, a turn id).

    Raises:
        TypeError: not a string. ValueError: empty.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string (as returned by add), got {_got(value)}")
    if not value.strip():
        raise ValueError(f"{name} is empty: give the id returned by add or get_all")
    return value


def check_role(where: str, role: Any) -> str:
    """``role`` if it is one of :data:`ROLES`.

    Raises:
        TypeError: not a string. ValueError: another role.
    """
    if not isinstance(role, str):
        raise TypeError(f"{where} role must be a string, got {_got(role)}")
    if role not in ROLES:
        raise ValueError(f"{where} role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an exception raised by a library (its driver's error when it
    wraps one, as SQLAlchemy does in ``exc.orig``), for one-line messages."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
