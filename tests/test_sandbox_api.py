"""The sandbox API as models write it from the original project's README: every discovery
helper used directly and awaited, before and after an ``await`` in the same cell, the
``_sync`` names and ``list_loaded_server_metadata``; against real servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Engine, bridge_client, claude_desktop_home, proxy_env, real_server, run_cell

pytestmark = pytest.mark.anyio


async def test_discovery_helpers_work_directly_and_awaited_before_and_after_an_await(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path,
        {"everything": {"command": real_server("everything")}, "time": {"command": real_server("time")}},
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(
            client,
            """
            import asyncio, json, warnings
            warnings.simplefilter("error")  # "coroutine was never awaited" would fail the cell
            import mcp.runtime as runtime_module
            from mcp import runtime
            assert runtime_module is runtime
            forms = {}
            def plain(tag):
                forms[tag] = (
                    runtime.discovered_servers(),
                    runtime.list_servers(),
                    [tool["name"] for tool in runtime.list_tools("time")],
                    runtime.query_tool_docs("time", "get_current_time")["name"],
                    runtime.search_tool_docs("current time in a timezone", limit=1)[0]["tool"],
                    runtime.capability_summary().splitlines()[0],
                    runtime.list_servers_sync(),
                    runtime.query_tool_docs_sync("time")[0]["server"],
                    runtime.search_tool_docs_sync("echo a message", limit=1)[0]["tool"],
                    [server["alias"] for server in runtime.list_loaded_server_metadata()],
                )
            async def awaited(tag):
                forms[tag] = (
                    await runtime.discovered_servers(),
                    await runtime.list_servers(),
                    [tool["name"] for tool in await runtime.list_tools("time")],
                    (await runtime.query_tool_docs("time", "get_current_time"))["name"],
                    (await runtime.search_tool_docs("current time in a timezone", limit=1))[0]["tool"],
                    (await runtime.capability_summary()).splitlines()[0],
                    await runtime.list_servers_sync(),
                    (await runtime.query_tool_docs_sync("time"))[0]["server"],
                    (await runtime.search_tool_docs_sync("echo a message", limit=1))[0]["tool"],
                    [server["alias"] for server in await runtime.list_loaded_server_metadata()],
                )
            plain("plain, before any await")
            await awaited("awaited")
            await asyncio.sleep(0)
            plain("plain, after an await")
            json.dumps(forms)  # plain values: they serialize
            forms
            """,
        )
        assert not answer["is_error"], answer
        assert "<pending" not in answer["text"] and "never awaited" not in answer["text"]
        forms = eval(answer["value"])
        expected = (
            ["everything", "time"],
            ["everything", "time"],
            ["get_current_time", "convert_time"],
            "get_current_time",
            "get_current_time",
            "MCP servers available in this sandbox (none is started until used):",
            ["everything", "time"],
            "time",
            "echo",
            ["everything", "time"],
        )
        for tag, values in forms.items():
            assert values[:2] == expected[:2], (tag, values)
            assert sorted(values[2]) == sorted(expected[2]), (tag, values)
            assert values[3:] == expected[3:], (tag, values)
        assert json.loads(json.dumps(list(forms)))  # three forms ran
