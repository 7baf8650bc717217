"""The one reading of a request body: every body the front takes is JSON, read by one strict parser.

:class:`inferscale.server.limits.RequestGate` calls :func:`read_body` on every body it lets in,
before any route sees it, whatever the ``Content-Type`` says:

- a body declared as something other than JSON (``application/x-www-form-urlencoded``, curl's
  default for ``--data``; ``text/plain``; ``multipart/form-data``) is a 415: no route of the
  front takes anything but JSON, and a body that one reader calls form data and another JSON
  is the ambiguity a gateway can be bypassed with (issue 52);
- a body with no ``Content-Type``, or a JSON one, is parsed here with :func:`strict_json`, which
  refuses a key given twice in one object (RFC 8259 section 4: names "SHOULD be unique", and
  parsers differ on which value counts: Python's keeps the last, a gateway may check the first);
- the parsed value travels with the request (:data:`PARSED_BODY` in the ASGI scope), so the chat
  route reads that value instead of parsing the bytes again. The memory routes' pydantic models
  read the same bytes the gate has found unambiguous, so both readings agree.

A body that is not JSON at all (a syntax error, bytes that are not UTF-8) is left to the route,
which answers it in its own words (400 or 422).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: the ASGI scope key holding the body's parsed value (set by the gate when it parsed one)
PARSED_BODY = "inferscale.parsed_body"
_NOTHING = object()


class RepeatedKeyError(ValueError):
    """A JSON object names ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class NotJsonConstantError(ValueError):
    """The body holds ``NaN``, ``Infinity`` or ``-Infinity``, which JSON does not have (RFC 8259 section 6)."""


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise RepeatedKeyError(key)
        seen.add(key)
    return dict(pairs)


def _refuse_constant(name: str) -> Any:
    raise NotJsonConstantError(name)


def strict_json(raw: bytes | str) -> Any:
    """``raw`` parsed as JSON, refusing what JSON readers disagree on.

    Raises:
        RepeatedKeyError: an object names a key twice.
        NotJsonConstantError: ``NaN`` or ``Infinity`` (Python's reader takes them, JSON has none).
        ValueError: not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``).
        RecursionError: nested deeper than the interpreter's recursion limit.
    """
    return json.loads(raw, object_pairs_hook=_refuse_repeats, parse_constant=_refuse_constant)


def is_json_type(content_type: bytes | None) -> bool:
    """Whether a ``Content-Type`` value names JSON: ``application/json`` or any ``+json``
    structured syntax (RFC 6839 section 3.1), parameters such as ``charset`` aside.
    ``None`` (no header) counts as JSON: the body is read strictly as JSON then."""
    if content_type is None:
        return True
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


@dataclass(frozen=True)
class BodyVerdict:
    """What the gate makes of a body: refuse it with ``status`` and ``message``, or pass it on
    with its parsed ``value`` (:data:`_NOTHING` where it is empty or not JSON: the route answers)."""

    status: int = 0
    message: str = ""
    value: Any = _NOTHING

    @property
    def parsed(self) -> bool:
        return self.value is not _NOTHING


def read_body(raw: bytes, content_type: bytes | None) -> BodyVerdict:
    """The gate's one reading of a request body (module docstring).

    Args:
        raw: the whole body (bytes).
        content_type: the request's ``Content-Type`` header value, ``None`` when it sent none.

    Returns:
        A :class:`BodyVerdict`: ``status`` 415 (a body declared as another type than JSON) or
        400 (a key given twice, ``NaN`` / ``Infinity``), or 0 with the parsed value.
    """
    if not raw:
        return BodyVerdict()
    if not is_json_type(content_type):
        shown = content_type.decode("latin-1")[:80]
        return BodyVerdict(415, f"the request body is sent as {shown!r}; every route of this server takes JSON: "
                                "send it with 'Content-Type: application/json' (curl: --json, or -H 'Content-Type: "
                                "application/json')")
    try:
        return BodyVerdict(value=strict_json(raw))
    except RepeatedKeyError as exc:
        return BodyVerdict(400, f"the request body names {exc.key!r:.80} twice in one JSON object: send each key "
                                "once (which one would count is a parser's guess)")
    except NotJsonConstantError as exc:
        return BodyVerdict(400, f"the request body holds {exc}, which is not JSON: send a number or null")
    except (ValueError, RecursionError):  # not JSON: the route says so in its own words
        return BodyVerdict()
