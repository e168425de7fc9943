"""Does a client that defers MCP tools find run_python by words? (issue 20, item 5)

Claude Code 2.1.3xx lists MCP tools to its model by name only, behind its ToolSearch
tool; a model that searches by words ("compute", "analyse data") gets the tools whose
name and description match. This runs the real Claude Code CLI against the scripted model
API of tests/clients (on loopback) with the bridge as its one MCP server; the script has
the model call ToolSearch once per query below, and prints, per query, the rank of
run_python among the tools ToolSearch returned (max 5), or "-" when it is not there.

It needs a Claude Code that defers tools, which scripts/setup.sh does not install (it pins
2.1.197, which does not defer): `npm install @anthropic-ai/claude-code@2.1.332` somewhere,
then

    .venv/bin/python benchmarks/deferred_tool_search.py PATH/node_modules/.bin/claude

It is a measurement, not a test: it exits 0 whatever it finds (not 0 when the run fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.harness import console_script  # noqa: E402
from tests.test_real_clients import SERVER, client_env, run_against_fake  # noqa: E402

QUERIES = (
    "run Python",
    "compute",
    "analyse data",
    "call my MCP tools from code",
    "python code",
    "data analysis",
    "sandbox",
    "calculate a number",
    "execute a script",
    "plot a chart",
)
TOOL = "mcp__%s__run_python" % SERVER


def run(claude: str, folder: Path) -> list[dict[str, Any]]:
    """The fake model API's turns after Claude Code ran the script in ``folder``."""
    steps = [
        {"label": "q%d" % n, "tool": "ToolSearch", "input": {"query": query, "max_results": 5}}
        for n, query in enumerate(QUERIES)
    ]
    scripted = {
        "tool": TOOL,
        "auto_tool_search": False,
        "steps": [*steps, {"label": "end", "final": "Done."}],
    }
    folder.mkdir(parents=True)
    server_env = {
        "MCP_BRIDGE_RUNTIME": os.environ.get("MCP_BRIDGE_RUNTIME", "podman"),
        "MCP_BRIDGE_IMAGE": os.environ.get("MCP_BRIDGE_IMAGE", "localhost/mcp-sandbox-python:bookworm"),
        "MCP_BRIDGE_STATE_DIR": str(folder / "state"),
        "HOME": str(folder / "bridge-home"),
        "PATH": os.environ["PATH"],
    }
    config = {
        "mcpServers": {SERVER: {"type": "stdio", "command": console_script(), "args": [], "env": server_env}}
    }
    (folder / "mcp.json").write_text(json.dumps(config))
    env = client_env(
        folder / "claude-home",
        ANTHROPIC_API_KEY="sk-ant-fake",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        MCP_CONNECTION_NONBLOCKING="false",
    )
    argv = [claude, "-p", "go", "--mcp-config", str(folder / "mcp.json"), "--strict-mcp-config"]
    argv += [
        "--allowedTools",
        TOOL,
        "--output-format",
        "stream-json",
        "--verbose",
        "--no-session-persistence",
    ]

    def with_port(port: int) -> list[str]:
        env["ANTHROPIC_BASE_URL"] = "http://127.0.0.1:%d" % port
        return argv

    return run_against_fake("fake_anthropic.py", scripted, folder / "run", with_port, env)


def found_tools(turn: dict[str, Any]) -> list[str]:
    """The tools a turn's ToolSearch result names, in its order."""
    for message in turn["tail_messages"]:
        for block in message.get("content") or []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                return [
                    str(item.get("tool_name"))
                    for item in block.get("content") or []
                    if isinstance(item, dict)
                ]
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    version = subprocess.run(
        [argv[0], "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="deferred-search-") as folder:
        turns = run(argv[0], Path(folder) / "deferred")
    print("Claude Code %s: ToolSearch by words, rank of run_python among its results (max 5)\n" % version)
    print("%-32s %s" % ("query", "rank"))
    for turn in turns[1:]:
        names = found_tools(turn)
        rank = names.index(TOOL) + 1 if TOOL in names else None
        print("%-32s %s" % (QUERIES[turn["answers_step"]], rank or "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
