"""What the front reads of a request before it knows who sent it, and how long it waits.

Two layers, each the first to see its part of a request:

- :class:`GuardedHttpProtocol`, uvicorn's httptools protocol with nginx's head limits: a
  request head (request line and headers) over ``max_header_bytes`` is answered 431, one
  that has not arrived whole ``header_timeout_s`` after its first byte is answered 408
  (nginx's ``large_client_header_buffers`` and ``client_header_timeout``), both within a
  read of the limit and before the app runs; a connection that sends nothing is closed
  after ``header_timeout_s``. A body the app answered without reading is read and
  dropped for at most ``body_timeout_s`` (nginx's ``lingering_time``), then the
  connection closes.
- :class:`RequestGate`, the app's outermost ASGI middleware: the API key is checked, then
  ``Content-Length`` against ``max_body_bytes`` (413), before one body byte is read; then
  the body is read whole (the app parses it after) and cut with 413 past
  ``max_body_bytes`` (a chunked body announces no length) or 408 when it has not all
  arrived ``body_timeout_s`` after the head (a total deadline, so a byte every few
  seconds does not hold a connection); then the body is read once, as JSON, whatever its
  ``Content-Type`` (:mod:`inferscale.server.bodies`: 415 for another type, 400 for a key given
  twice) and its value handed on. A header that names the key, the body's type or the scope
  (:data:`SINGLE_HEADERS`) given twice is a 400. Early answers carry ``Connection: close``.

:class:`FrontLimits` holds the four settings (``inferscale serve --max-body-bytes`` ...,
or ``INFERSCALE_MAX_BODY_BYTES`` ...; docs/server.md, "Limits"); every worker process
gets them through its uvicorn config (:func:`uvicorn_config`) and its app's (:mod:`inferscale.server.worker`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inferscale.server.bodies import PARSED_BODY, read_body

#: the ASGI scope key :class:`RequestGate` sets on a request that carried the key (or needs none)
AUTHORIZED = "inferscale.authorized"
#: headers a request may carry once: the key, the body's type and the scope (which one would count is a guess)
SINGLE_HEADERS = {b"authorization": "Authorization", b"content-type": "Content-Type",
                  b"x-inferscale-agent-id": "X-InferScale-Agent-Id", b"x-inferscale-run-id": "X-InferScale-Run-Id"}
#: the head's end: the blank line after the last header (RFC 9112, section 2.1)
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class FrontLimits:
    """The front's limits on what a client sends, and how slowly.

    Attributes:
        max_body_bytes: largest request body (bytes; default 16 MiB, far above any prompt
            that fits a context); larger is 413.
        max_header_bytes: largest request head, request line and headers together (bytes;
            default 64 KiB: nginx's default allows 4 x 8 KiB buffers, Node.js 16 KiB); larger is 431.
        header_timeout_s: most seconds from a head's first byte to its last (default 10 s;
            nginx waits 60 s); slower is 408.
        body_timeout_s: most seconds from the head's end to the body's last byte (default
            30 s: 16 MiB at 4.5 Mbit/s); slower is 408.

    Raises:
        ValueError: a limit that is not positive.
    """

    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r} (--{name.replace('_', '-')})")


def error_body(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    """The front's error shape (:func:`inferscale.server.errors.error`) as JSON bytes."""
    return json.dumps({"error": {"message": message, "type": kind, "code": status}, "detail": message}).encode()


_REASONS = {400: b"Bad Request", 401: b"Unauthorized", 408: b"Request Timeout", 413: b"Content Too Large",
            431: b"Request Header Fields Too Large"}


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head size and time limits (module docstring).

    The limits come from the uvicorn config's ``front_limits`` attribute
    (:func:`uvicorn_config`), so spawned worker processes get them with their config.
    """

    def __init__(self, config: uvicorn.Config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.limits: FrontLimits = getattr(config, "front_limits", None) or FrontLimits()
        self._in_head = True      # the bytes arriving belong to a request head
        self._head_bytes = 0      # bytes of the current head seen so far
        self._tail = b""          # the last bytes seen, for a head end split across reads
        self._in_body = False     # a body is still arriving
        self._timer: asyncio.TimerHandle | None = None

    # -------------------------------------------------------------- timers

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_too_slow(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._in_head and self._head_bytes > 0:
            self._refuse(408, f"the request head did not arrive within {self.limits.header_timeout_s:g} s "
                              "(header_timeout_s): send it whole")
        elif self._in_head and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()  # a connection that never sent a request

    def _linger_over(self) -> None:
        self._timer = None
        if self.transport is not None and not self.transport.is_closing() and self._in_body:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser cannot read (uvicorn's answer is plain text): the front's
        JSON error shape, with parser's words, then the connection closes."""
        self._refuse(400, f"the request is not valid HTTP/1.1 ({msg}): send a well-formed request line and headers")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``message`` in the error shape and close the connection."""
        body = error_body(status, message)
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self._disarm()
        self.transport.write(head + body)
        self.transport.close()

    # -------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._in_head and data:
            if self._head_bytes == 0:
                self._arm(self.limits.header_timeout_s, self._head_too_slow)
            seen = self._tail + data
            end = seen.find(_HEAD_END)
            size = self._head_bytes + (len(data) if end < 0 else end + len(_HEAD_END) - len(self._tail))
            if size > self.limits.max_header_bytes:
                self._refuse(431, f"the request head (request line and headers) is over "
                                  f"{self.limits.max_header_bytes} bytes (max_header_bytes): send smaller headers")
                return
            self._head_bytes, self._tail = size, seen[-(len(_HEAD_END) - 1):]
        super().data_received(data)

    # -------------------------------------------------------------- parser callbacks

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head, self._in_body = False, True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        if self._timer is not None:  # a linger for this message's body
            self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_body and not self.transport.is_closing():  # answered without reading the body: drop it a while
            self._arm(self.limits.body_timeout_s, self._linger_over)


class RequestGate:
    """ASGI middleware, outermost: the key, then the announced size, then the body within
    its limits (module docstring); the app sees the body already read.

    Args:
        app: the ASGI app behind it.
        api_key: the key every route but ``open_paths`` requires (``None``: no key).
        limits: the body's size and time limits.
        open_paths: paths answered without a key (liveness probes carry none).
    """

    def __init__(self, app, *, api_key: str | None, limits: FrontLimits, open_paths: frozenset[str]) -> None:
        self.app, self.api_key, self.limits, self.open_paths = app, api_key, limits, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        repeated = _repeated_header(scope["headers"])
        if repeated is not None:  # which one counts is a proxy's guess
            return await _answer(send, 400, f"the request has more than one {repeated} header: send one")
        if self.api_key and scope["path"] not in self.open_paths and not self._authorized(headers):
            return await _answer(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or "
                                            "Mem0's 'Authorization: Token <key>')", "authentication_error")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limits.max_body_bytes:
            return await _answer(send, 413, f"the request body is {int(length)} bytes; the most accepted is "
                                            f"{self.limits.max_body_bytes} (max_body_bytes)")
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await _answer(send, 408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout_s:g} s (body_timeout_s): send it whole")
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limits.max_body_bytes:
                return await _answer(send, 413, f"the request body is over {self.limits.max_body_bytes} bytes, "
                                                "the most accepted (max_body_bytes)")
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        verdict = read_body(body["body"], headers.get(b"content-type"))
        if verdict.status:
            return await _answer(send, verdict.status, verdict.message)
        if verdict.parsed:
            scope[PARSED_BODY] = verdict.value
            # the app reads what the gate read: JSON (a body sent with no type, or a +json type, too)
            scope["headers"] = [(n, v) for n, v in scope["headers"] if n != b"content-type"] + [
                (b"content-type", b"application/json")]
        if self.api_key is None or b"authorization" in headers and self._authorized(headers):
            scope[AUTHORIZED] = True
        await self.app(scope, _replay([body], receive), send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() in (b"bearer", b"token") and hmac.compare_digest(given, self.api_key.encode())


async def _answer(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """An early answer in the error shape. A body still arriving is read and dropped by
    :class:`GuardedHttpProtocol` for at most ``body_timeout_s`` (a client that sends its whole
    body before reading, as most do, then reads this answer, not a reset); a 408 closes the
    connection at once (``Connection: close``), since its body has stalled."""
    body = error_body(status, message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"connection", b"close")] if status == 408 else headers})
    await send({"type": "http.response.body", "body": body})


def _repeated_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that ``headers`` carry more than once (by name, in any
    case: ASGI servers give names in lower case), as :data:`SINGLE_HEADERS` spells it, or ``None``."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in SINGLE_HEADERS:
            if name in seen:
                return SINGLE_HEADERS[name]
            seen.add(name)
    return None


def _replay(messages: list, receive):
    """A ``receive`` that gives ``messages`` first, then the server's."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def uvicorn_config(app: Any, limits: FrontLimits, **kwargs) -> uvicorn.Config:
    """uvicorn's config for the front: :class:`GuardedHttpProtocol` with ``limits`` (carried
    to worker processes with the config), and ``kwargs`` as uvicorn takes them."""
    config = uvicorn.Config(app, http=f"{__name__}:{GuardedHttpProtocol.__name__}", **kwargs)
    config.front_limits = limits
    return config
