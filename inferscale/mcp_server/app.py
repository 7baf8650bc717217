"""The MCP server over a memory: the tools of :mod:`inferscale.mcp_server.tools` on the official
SDK's :class:`~mcp.server.mcpserver.MCPServer`, served over stdio (:func:`run_stdio`,
``inferscale mcp``) or streamable HTTP (:class:`HttpEndpoint`, ``inferscale serve``'s ``/mcp``).

The HTTP endpoint is stateless and answers JSON, not an event stream: every request stands
alone, so any of ``inferscale serve --workers N``'s processes can take it (a session kept in
one worker's memory would be unknown to the others), and the front's key and size checks
(:class:`inferscale.server.limits.RequestGate`) see an ordinary request and response.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import AsyncIterator

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import ToolAnnotations

from inferscale.mcp_server.tools import TOOLS, MemoryTools

#: What the client's model reads about the server as a whole.
INSTRUCTIONS = (
    "InferScale: long-term memory of users and agents. Every call names whose memory it uses with user_id "
    "(or agent_id / run_id); use the same id for the same user in every call. Search before answering "
    "anything that may depend on earlier conversations; add what the user tells you that is worth keeping; "
    "update or delete a memory by the id that add, search or get_all returned."
)


def build_server(tools: MemoryTools) -> MCPServer:
    """The SDK's server with ``tools``' six tools (:data:`~inferscale.mcp_server.tools.TOOLS`).

    Args:
        tools: the tools over one memory.

    Returns:
        An :class:`~mcp.server.mcpserver.MCPServer` named ``inferscale``; serve it with
        :func:`run_stdio` or :class:`HttpEndpoint`.
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    server = MCPServer("inferscale", title="InferScale memory", instructions=INSTRUCTIONS, version="0.1.0",
                       log_level="WARNING")
    root.handlers[:], root.level = handlers, level  # the SDK configures the root logger: the process's own says
    for name, description, read_only, destructive in TOOLS:
        server.add_tool(getattr(tools, name), name=name, description=description,
                        annotations=ToolAnnotations(read_only_hint=read_only, destructive_hint=destructive,
                                                    open_world_hint=False))
    return server


def run_stdio(tools: MemoryTools) -> None:
    """Serve ``tools`` over stdin/stdout until the client closes stdin (``inferscale mcp``).

    While it runs, the SDK keeps the real stdout for JSON-RPC and points file descriptor 1 at
    stderr, so a stray print (or a child process, such as vLLM's engine) cannot corrupt the
    stream; logs go to stderr.

    Args:
        tools: the tools over one memory.
    """
    anyio.run(build_server(tools).run_stdio_async)


class HttpEndpoint:
    """An ASGI app answering MCP's streamable HTTP transport (stateless, JSON responses),
    for a front to mount at a path of its own (``/mcp``).

    Run it within the host app's lifespan (:meth:`running`): the SDK's session manager
    needs a task group that lives as long as the app. Each lifespan gets a fresh manager
    (the SDK's runs once), so an app started twice (tests) works.

    Args:
        tools: the tools over the front's memory.
    """

    def __init__(self, tools: MemoryTools) -> None:
        self.server = build_server(tools)
        self._manager = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The endpoint answers while this context is open (enter it in the app's lifespan)."""
        # the front checks the API key before any request gets here, and answers every Host like its other
        # routes: the SDK's DNS-rebinding check (loopback Host names only, by default) would refuse a front
        # reached by its name
        self.server.streamable_http_app(stateless_http=True, json_response=True,
                                        transport_security=TransportSecuritySettings(
                                            enable_dns_rebinding_protection=False))
        manager = self.server.session_manager
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope, receive, send) -> None:
        manager = self._manager
        if manager is None:  # a request outside the lifespan (an app served without it)
            message = "the MCP endpoint is not running: serve the app with its lifespan"
            body = json.dumps({"error": {"message": message, "type": "server_error", "code": 503},
                               "detail": message}).encode()  # the front's error shape
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await manager.handle_request(scope, receive, send)
