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

A body the gate cannot read is refused there, with a 400 saying why: not UTF-8 (or declared in
another charset: 415; a byte order mark), not JSON, nested deeper than the reader goes, a number
no float holds. No route ever reads a body the gate could not (a route's own, more lenient
reader read one the gate gave up on, and kept the second of two keys). The gate then tells the
app the body is ``application/json``, so every route's reader takes it as the gate did.
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


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: valid JSON, but no float holds it
        raise NotJsonConstantError(text[:40])
    return value


def strict_json(raw: bytes | str) -> Any:
    """``raw`` parsed as JSON, refusing what JSON readers disagree on.

    Raises:
        RepeatedKeyError: an object names a key twice.
        NotJsonConstantError: ``NaN`` or ``Infinity`` (Python's reader takes them, JSON has none),
            or a number too large for a float (``1e999``).
        ValueError: not JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``).
        RecursionError: nested deeper than the interpreter's recursion limit.
    """
    return json.loads(raw, object_pairs_hook=_refuse_repeats, parse_constant=_refuse_constant,
                      parse_float=_finite_float)


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
    charset = _charset(content_type)
    if charset not in (None, "utf-8", "utf8"):
        return BodyVerdict(415, f"the request body is declared as charset {charset!r}; JSON is UTF-8 (RFC 8259, "
                                "section 8.1): send it as UTF-8, with 'charset=utf-8' or no charset")
    if raw.startswith(b"\xef\xbb\xbf"):
        return BodyVerdict(400, "the request body starts with a byte order mark, which JSON must not have (RFC 8259, "
                                "section 8.1): send UTF-8 without it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BodyVerdict(400, f"the request body is not UTF-8 ({exc.reason} at byte {exc.start}): JSON is UTF-8 "
                                "(RFC 8259, section 8.1)")
    try:
        return BodyVerdict(value=strict_json(text))
    except RepeatedKeyError as exc:
        return BodyVerdict(400, f"the request body names {exc.key!r:.80} twice in one JSON object: send each key "
                                "once (which one would count is a parser's guess)")
    except NotJsonConstantError as exc:
        return BodyVerdict(400, f"the request body holds {exc}, which is not a JSON number this server reads: send "
                                "a finite number or null")
    except RecursionError:
        return BodyVerdict(400, "the request body is nested too deeply to read: flatten it")
    except ValueError as exc:  # every route reads this one reading: a body it cannot read goes no further
        return BodyVerdict(400, f"the request body is not valid JSON ({exc})")


def _charset(content_type: bytes | None) -> str | None:
    """The ``charset`` parameter of a ``Content-Type`` value, lower case (``None``: none given)."""
    if content_type is None:
        return None
    for param in content_type.split(b";")[1:]:
        name, _, value = param.partition(b"=")
        if name.strip().lower() == b"charset":
            return value.strip().strip(b'"').decode("latin-1").lower()
    return None
