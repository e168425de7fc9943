"""Runs an MCP server (the command after two tool names) and rewrites its tools/list
answers the way real servers get them wrong: the first named tool's inputSchema (and
outputSchema) becomes ``{}`` (no "type": repairable), the second's inputSchema
``{"type": "string"}`` (tool arguments are always an object: not repairable).
Everything else passes through unchanged, so the server behind still answers calls."""

from __future__ import annotations

import json
import subprocess
import sys


def rewritten(line: bytes, empty: str, hopeless: str) -> bytes:
    try:
        message = json.loads(line)
    except ValueError:
        return line
    tools = message.get("result", {}).get("tools") if isinstance(message, dict) else None
    if not isinstance(tools, list):
        return line
    for tool in tools:
        if tool.get("name") == empty:
            tool["inputSchema"] = {}
            if "outputSchema" in tool:  # its results are still checked against it, as {"type": "object"}
                tool["outputSchema"] = {}
        elif tool.get("name") == hopeless:
            tool["inputSchema"] = {"type": "string"}
    return json.dumps(message).encode() + b"\n"


def main() -> int:
    empty, hopeless, *command = sys.argv[1:]
    child = subprocess.Popen(command, stdin=sys.stdin, stdout=subprocess.PIPE)
    assert child.stdout is not None
    out = sys.stdout.buffer
    for line in child.stdout:
        out.write(rewritten(line, empty, hopeless))
        out.flush()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
