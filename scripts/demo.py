"""Drive the installed server through the MCP SDK's stdio client: two run_python calls
that share state, then a reset. Prints what a model would see."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def demo() -> int:
    command = shutil.which("mcp-server-code-execution-mode", path=os.path.dirname(sys.executable))
    if command is None:
        print("the console script is not installed; run scripts/setup.sh first", file=sys.stderr)
        return 1
    params = StdioServerParameters(command=command, env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        print("tools:", [tool.name for tool in tools.tools])
        steps: list[dict[str, Any]] = [
            {"code": "import math\nx = 41\ndef double(n):\n    return 2 * n"},
            {"code": "print(x + 1)\ndouble(math.pi)"},
            {"code": "x", "reset": True},
        ]
        failures = 0
        for arguments in steps:
            result = await session.call_tool("run_python", arguments)
            print(">>> run_python(%r)\n%s\n" % (arguments, text_of(result)))
            failures += result.is_error and "reset" not in arguments
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(anyio.run(demo))
