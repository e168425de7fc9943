"""A small real MCP server (built on the SDK's MCPServer) for the failure modes and
timings that third-party servers do not offer on demand: slow calls, huge results, tool
errors, structured and image results, a changing tool list, and hostile behaviour: a
wedged event loop, a crash mid-call, a tools/list that fails, crashes or hangs once."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import time

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import Tool


class StubServer(MCPServer):
    """An MCPServer whose next tools/list can be made to misbehave once."""

    listing_trouble: str | None = None

    async def list_tools(self) -> list[Tool]:
        trouble, self.listing_trouble = self.listing_trouble, None
        if trouble == "fail":
            raise ToolError("tools/list failed on purpose")
        if trouble == "exit":
            os._exit(3)
        if trouble == "hang":
            time.sleep(3600)  # blocks the event loop: the server answers nothing any more
        return await super().list_tools()


server = StubServer("stub")

# A 1x1 transparent PNG.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep for `seconds`, then answer."""
    await asyncio.sleep(seconds)
    return "slept %g" % seconds


_meetings: dict[str, tuple[list[int], asyncio.Event]] = {}


@server.tool()
async def meet(group: str, size: int) -> str:
    """Answer once `size` calls of `group` are running at the same time: proof that calls
    overlap, without timing anything. Fails after 20 s if they never do."""
    count, everyone = _meetings.setdefault(group, ([0], asyncio.Event()))
    count[0] += 1
    if count[0] >= size:
        everyone.set()
    try:
        await asyncio.wait_for(everyone.wait(), 20)
    except TimeoutError:
        raise ToolError("only %d of %d calls of %r ran at the same time" % (count[0], size, group)) from None
    return "met"


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
def measure(text: str = "", items: list[object] | None = None) -> str:
    """The sizes of what arrived (large arguments, answered with a small result)."""
    return "text %d items %d" % (len(text), len(items or []))


@server.tool(structured_output=False)
def blob(size: int) -> str:
    """One text block of `size` characters and no structured copy: a known size on the wire."""
    return "x" * size


@server.tool()
async def wedge(seconds: float) -> str:
    """Block the server's event loop for `seconds` (time.sleep in an async tool)."""
    time.sleep(seconds)
    return "unwedged"


@server.tool()
def exit_now() -> str:
    """End the server process at once, in the middle of this call (a crash)."""
    os._exit(3)


@server.tool()
async def trouble_next_listing(mode: str, ctx: Context, add: str = "") -> str:
    """Make the next tools/list "fail", "exit" or "hang" once, optionally add a tool called
    `add` (it answers "grown"), and announce a changed tool list."""
    if add:
        server.add_tool(lambda: "grown", name=add, description="Added at run time.")
    server.listing_trouble = mode
    await ctx.session.send_tool_list_changed()
    return "the next tools/list will %s" % mode


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


@server.tool()
def environment(names: list[str]) -> dict[str, str | None]:
    """The values of the environment variables `names` in this server's process (None: unset)."""
    return {name: os.environ.get(name) for name in names}


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
    # `--http PORT` serves streamable HTTP on 127.0.0.1 instead of stdio; `--sse PORT`, the
    # older HTTP+SSE transport (GET /sse, POST /messages/) that some servers still speak.
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--sse":
        server.run("sse", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
