"""A small real MCP server (built on the SDK's MCPServer) for the failure modes and
timings that third-party servers do not offer on demand: slow calls, huge results, tool
errors, structured and image results, and a changing tool list."""

from __future__ import annotations

import asyncio
import base64
import sys

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("stub")

# A 1x1 transparent PNG.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for `seconds`, then answer."""
    await asyncio.sleep(seconds)
    return "slept %g" % seconds


@server.tool()
async def slow_then_mark(seconds: float, path: str) -> str:
    """Sleep, then create the file `path`: proof that a cancelled call did not finish."""
    await asyncio.sleep(seconds)
    with open(path, "w") as marker:
        marker.write("finished")
    return "marked"


@server.tool()
def big(size: int) -> str:
    """Return a string of `size` characters."""
    return "x" * size


@server.tool()
def fail(message: str) -> str:
    """Always fails with `message`."""
    raise ToolError(message)


@server.tool()
def pair(a: int, b: int = 2) -> dict[str, int]:
    """Structured result: the sum and product of two numbers."""
    return {"sum": a + b, "product": a * b}


@server.tool()
def pixel() -> Image:
    """A tiny PNG image."""
    return Image(data=PIXEL, format="png")


@server.tool(name="kebab-name")
def kebab_name() -> str:
    """A tool whose name is not a Python identifier."""
    return "kebab"


@server.tool()
async def grow(name: str, ctx: Context) -> str:
    """Add a tool called `name` (it answers "grown") and announce the new tool list."""

    def grown() -> str:
        return "grown"

    server.add_tool(grown, name=name, description="Added at run time.")
    await ctx.session.send_tool_list_changed()
    return "added %s" % name


if __name__ == "__main__":
    # `--http PORT` serves streamable HTTP on 127.0.0.1 instead of stdio.
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
