"""The no-op reference server of benchmarks/bench_floors.py: the MCP SDK's low-level Server
over stdio with one tool, `noop`, that answers with the text "1" and does nothing else.
What an MCP server costs at the least on this machine (interpreter start, SDK imports,
handshake, one JSON-RPC round trip), the floor the bridge's own figures are set against.

    .venv/bin/python benchmarks/noop_server.py
"""

from __future__ import annotations

from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

TOOL_NAME = "noop"
NOOP = types.Tool(
    name=TOOL_NAME,
    description='Do nothing; answer "1".',
    input_schema={"type": "object", "properties": {}},
)


async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[NOOP])


async def call_tool(
    ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text="1")])


async def main() -> None:
    server: Server[Any] = Server("noop", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
