"""The MCP server over a memory: the tools of :mod:`inferscale.mcp_server.tools` on the official
SDK's :class:`~mcp.server.mcpserver.MCPServer`, served over stdio (:func:`run_stdio`,
``inferscale mcp``) or streamable HTTP (:class:`HttpEndpoint`, ``inferscale serve``'s ``/mcp``).

The HTTP endpoint is stateless and answers JSON, not an event stream (a GET, which would open
one, is a 405, as MCP's transport allows): every request stands alone, so any of ``inferscale serve --workers N``'s processes can take it (a session kept in
one worker's memory would be unknown to the others), and the front's key and size checks
(:class:`inferscale.server.limits.RequestGate`) see an ordinary request and response.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.server.transport_security import TransportSecuritySettings
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage
from mcp.types import ToolAnnotations
from mcp_types import INVALID_REQUEST, PARSE_ERROR, ErrorData, JSONRPCError
from pydantic import ConfigDict, ValidationError

from inferscale.mcp_server.tools import TOOLS, MemoryTools
from inferscale.server.limits import error_body

logger = logging.getLogger("inferscale.mcp")

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
        _strict_arguments(server._tool_manager.get_tool(name))
    return server


def _strict_arguments(tool) -> None:
    """Validate ``tool``'s arguments as the REST routes do: no coercion (``"yes"`` is not
    ``true``, ``"5"`` and ``true`` are not 5) and no unknown argument (a misspelt ``limt`` is
    refused, not dropped). The SDK's argument model is lax and ignores extras; its strict
    subclass replaces it, and the input schema says ``additionalProperties: false``.

    The SDK also reads a string argument as JSON first when the parameter is not a plain
    string (its ``pre_parse_json``, for clients that send ``"[...]"``), so ``"null"`` became
    ``None`` (``user_id: "null"`` wrote to the run's scope alone) and a list in a string was
    read by a lenient parser (a repeated key kept its last value): that step is skipped, and a
    string is a string.
    """
    lax = tool.fn_metadata.arg_model
    strict = type(lax.__name__, (lax,), {"__module__": lax.__module__,
                                         "model_config": ConfigDict(**{**lax.model_config, "strict": True,
                                                                       "extra": "forbid"})})
    meta = tool.fn_metadata
    tool.fn_metadata = _AsSent(arg_model=strict, output_schema=meta.output_schema, output_model=meta.output_model,
                               wrap_output=meta.wrap_output)
    tool.parameters = strict.model_json_schema(by_alias=True)


class _AsSent(FuncMetadata):
    """The SDK's argument handling without its JSON-in-a-string reading (:func:`_strict_arguments`)."""

    def pre_parse_json(self, data: dict) -> dict:
        return data


def run_stdio(tools: MemoryTools) -> None:
    """Serve ``tools`` over stdin/stdout until the client closes stdin (``inferscale mcp``).

    While it runs, the SDK keeps the real stdout for JSON-RPC and points file descriptor 1 at
    stderr, so a stray print (or a child process, such as vLLM's engine) cannot corrupt the
    stream; logs go to stderr.

    A line that is not JSON is answered with JSON-RPC's parse error (-32700), and one that is
    JSON but not one JSON-RPC message (a batch, which MCP no longer has; a bare value) with an
    invalid request (-32600), both with ``"id": null`` (JSON-RPC 2.0, section 5), and each is
    logged to stderr in one line; the SDK itself drops them unanswered.

    Args:
        tools: the tools over one memory.
    """
    anyio.run(_serve_stdio, build_server(tools))


async def _serve_stdio(server: MCPServer) -> None:
    lowlevel = server._lowlevel_server
    async with stdio_server() as (read_stream, write_stream):
        checked_send, checked_receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)

        async def relay() -> None:  # the SDK's reader passes on what it cannot read as an exception
            async with checked_send:
                async for item in read_stream:
                    if isinstance(item, Exception):
                        await write_stream.send(SessionMessage(unreadable_line_error(item)))
                    else:
                        await checked_send.send(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            await lowlevel.run(checked_receive, write_stream, lowlevel.create_initialization_options())


def unreadable_line_error(exc: Exception) -> JSONRPCError:
    """The JSON-RPC error answering a line the SDK could not read (``exc``, its validation
    error): -32700 where the line is not JSON, -32600 where it is JSON but not one message.
    Logged at WARNING (stderr), one line."""
    kinds = {e.get("type") for e in exc.errors()} if isinstance(exc, ValidationError) else {"json_invalid"}
    if "json_invalid" in kinds:
        code, message = PARSE_ERROR, "Parse error: the line is not JSON; send one JSON-RPC message per line"
    else:
        code, message = INVALID_REQUEST, ("Invalid Request: the line is JSON but not one JSON-RPC 2.0 message "
                                          "(MCP has no batches: send each message on its own line)")
    logger.warning("mcp stdio: %s", message)
    return JSONRPCError(jsonrpc="2.0", id=None, error=ErrorData(code=code, message=message))


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
        if scope.get("method") != "POST":  # no event stream to GET, no session to DELETE: stateless, JSON answers
            return await _error(send, 405, f"/mcp takes POST only (MCP's streamable HTTP without an event stream: "
                                           f"this server answers every request in its response), not "
                                           f"{scope.get('method')}", [(b"allow", b"POST")])
        if manager is None:  # a request outside the lifespan (an app served without it)
            return await _error(send, 503, "the MCP endpoint is not running: serve the app with its lifespan")
        await manager.handle_request(scope, receive, send)


async def _error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """An answer in the front's error shape (:func:`inferscale.server.limits.error_body`)."""
    body = error_body(status, message, "server_error" if status >= 500 else "invalid_request_error")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
