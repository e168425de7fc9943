"""A real MCP server (the SDK's MCPServer) for approvals and relaying: a read-only tool and
tools that may write (by their annotations), each call recorded as one JSON line in the
file named by $RECORD_FILE, so a test sees exactly which calls reached the server; a
resource, a resource template and a prompt; and a tool that asks its own client for
input (elicitation) and one that reports progress."""

from __future__ import annotations

import json
import os

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations
from pydantic import BaseModel

server = MCPServer("approval-stub", instructions="Notes: read them, write them, delete them.")
READ_ONLY = ToolAnnotations(read_only_hint=True)


def record(tool: str, arguments: dict[str, object]) -> None:
    with open(os.environ["RECORD_FILE"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")


@server.tool(annotations=READ_ONLY)
def lookup(key: str) -> str:
    """Read one note (read-only)."""
    record("lookup", {"key": key})
    return "note %s" % key


@server.tool()
def write_note(key: str, text: str) -> str:
    """Write one note (no annotations: it may change things)."""
    record("write_note", {"key": key, "text": text})
    return "wrote %s" % key


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
def delete_note(key: str) -> str:
    """Delete one note."""
    record("delete_note", {"key": key})
    return "deleted %s" % key


class Confirmation(BaseModel):
    confirm: bool


@server.tool(annotations=READ_ONLY)
async def confirm_with_user(question: str, ctx: Context) -> str:
    """Ask this server's client (a form elicitation) and answer with what the user said."""
    answer = await ctx.elicit(question, Confirmation)
    record("confirm_with_user", {"question": question, "action": answer.action})
    if answer.action == "accept":
        return "confirmed" if answer.data.confirm else "refused"
    return answer.action


@server.tool(annotations=READ_ONLY)
async def count_up(steps: int, ctx: Context) -> str:
    """Report progress once per step (1 of `steps`, 2 of `steps`, ...)."""
    for step in range(1, steps + 1):
        await ctx.report_progress(step, steps, "step %d" % step)
    return "counted %d" % steps


@server.tool(annotations=READ_ONLY)
async def chatty(text: str, ctx: Context) -> str:
    """Log `text` to the client (notifications/message), then answer."""
    await ctx.info(text)
    return "said"


@server.resource("notes://index", mime_type="text/plain")
def index() -> str:
    """The list of notes."""
    return "alpha\nbeta"


@server.resource("notes://note/{key}", mime_type="text/plain")
def note(key: str) -> str:
    """One note by key."""
    return "the note %s" % key


@server.prompt()
def summarize(topic: str) -> str:
    """Ask for a summary of the notes about `topic`."""
    return "Summarize the notes about %s." % topic


if __name__ == "__main__":
    server.run()
