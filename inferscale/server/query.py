"""Query parameters: each route reads a known set, each given once.

A gateway in front of the server may enforce a tenant's scope by the first ``user_id`` of
a URL; Starlette's ``request.query_params[...]`` reads the last. So a parameter given
twice (``?user_id=alice&user_id=bob``) is refused, never resolved, and so is one the route
does not read (``?bogus=1``): a 400 naming them, on every route (issue 42).

:func:`check_query` is the one check. :class:`StrictQueryRoute` applies it to a router's
routes with the query parameters their handlers declare; Mem0's Platform routes, which
read some parameters by hand, call it with those names (:mod:`inferscale.server.mem0_requests`).
"""

from __future__ import annotations

from typing import Callable, Iterable

from fastapi import Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.routing import APIRoute


def check_query(request: Request, allowed: Iterable[str] = (), docs: str = "/docs") -> None:
    """Refuse query parameters the route does not read, and any given more than once.

    Args:
        request: the request whose URL's query is checked.
        allowed: the parameter names the route reads.
        docs: where the route's parameters are documented (named in the message).

    Raises:
        ValueError: naming the unknown or repeated parameters (the front answers 400).
    """
    params = request.query_params
    allowed = tuple(dict.fromkeys(allowed))
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"query parameter(s) {unknown} are not read by {request.method} {request.url.path}"
                         + (f" (it reads {list(allowed)})" if allowed else " (it reads none)") + f"; see {docs}")
    twice = sorted(k for k in set(params) if len(params.getlist(k)) > 1)
    if twice:
        raise ValueError(f"query parameter(s) {twice} are given more than once: give each once")


class StrictQueryRoute(APIRoute):
    """A FastAPI route that answers 400 (via :func:`check_query`) when the URL carries a
    query parameter its handler and dependencies do not declare (or :attr:`also_read`),
    or one twice, before its body is read or validated."""

    #: parameters the router's handlers read by hand, beside those they declare
    also_read: tuple[str, ...] = ()

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        declared = tuple(field.alias for field in get_flat_dependant(self.dependant).query_params)
        allowed = (*declared, *self.also_read)

        async def checked(request: Request):
            check_query(request, allowed)
            return await handler(request)

        return checked
