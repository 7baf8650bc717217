"""InferScale's memory as MCP tools (Model Context Protocol, the official ``mcp`` SDK).

- :mod:`~inferscale.mcp_server.tools`: the tools (``add``, ``search``, ``get_all``, ``update``,
  ``delete``, ``answer``) over one memory, with Mem0's argument names;
- :mod:`~inferscale.mcp_server.answers`: how ``answer`` runs, on the memory's own engine
  (``inferscale mcp``) or on the front's vLLM servers (``inferscale serve``'s ``/mcp``);
- :mod:`~inferscale.mcp_server.app`: the SDK's server with those tools, over stdio or as the
  streamable-HTTP endpoint the front mounts.

The package is named ``mcp_server`` so that ``import mcp`` inside it is the SDK.
"""
