"""The front's port: a free one for a child server, and the front's own, held from the start.

Imports nothing heavy, so ``inferscale serve`` claims its port before it imports vLLM,
torch or Chroma (seconds).
"""

from __future__ import annotations

import errno
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_on(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` now, as uvicorn would (``SO_REUSEADDR``: connections
    of a server that just stopped linger in TIME-WAIT for a minute, which keeps a plain bind
    from the port but not uvicorn), and return the socket for uvicorn to serve on.

    Holding the port from the start makes a second server on it fail at once, even one
    started while the first is still starting vLLM. Connections made before the front
    serves wait in the listen backlog and are answered once it does.

    Raises:
        OSError: the port is in use, or not ours to bind (one line naming it and ``--port``).
    """
    if not host.strip():  # the empty host binds every interface: say so instead
        raise OSError("--host is empty: give an address (127.0.0.1, the default; 0.0.0.0 for every interface)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(f"cannot listen on {host}:{port} ({reason}): {host} is not an address of this machine; "
                          "give one with --host (127.0.0.1, 0.0.0.0, ::1)") from None
        raise OSError(f"cannot listen on {host}:{port} ({reason}): the port is in use or not allowed; "
                      "choose another with --port") from None
    sock.set_inheritable(True)  # uvicorn's worker processes serve on it too
    return sock
