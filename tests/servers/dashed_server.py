"""A real MCP server whose tool has parameter names that are not Python names ("user-id",
"a-b" beside "a_b"), as servers written in other languages have: `echo` answers with the
arguments exactly as they arrived. Built on the SDK's low-level Server, which sends the
schema as written (the decorator API makes every parameter a Python name)."""

from __future__ import annotations

from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

ECHO = types.Tool(
    name="echo",
    description="Answer with the arguments as they arrived.",
    input_schema={
        "type": "object",
        "properties": {
            "user-id": {"type": "string"},
            "a-b": {"type": "integer"},
            "a_b": {"type": "integer"},
        },
        "required": ["user-id"],
    },
)


async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[ECHO])


async def call_tool(
    ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    received = dict(params.arguments or {})
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=repr(received))],
        structured_content={"received": received},
    )


async def main() -> None:
    server: Server[Any] = Server("dashed", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
