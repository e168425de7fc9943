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
                    runtime.search_tool_docs("current time in a timezone", 1, "summary")[0]["tool"],
                    runtime.capability_summary().splitlines()[0],
                    runtime.list_servers_sync(),
                    runtime.query_tool_docs_sync("time")[0]["server"],
                    runtime.search_tool_docs_sync("echo a message", 1, "summary")[0]["tool"],
                    [server["alias"] for server in runtime.list_loaded_server_metadata()],
                )
            async def awaited(tag):
                forms[tag] = (
                    await runtime.discovered_servers(),
                    await runtime.list_servers(),
                    [tool["name"] for tool in await runtime.list_tools("time")],
                    (await runtime.query_tool_docs("time", "get_current_time"))["name"],
                    (await runtime.search_tool_docs("current time in a timezone", 1, "summary"))[0]["tool"],
                    (await runtime.capability_summary()).splitlines()[0],
                    await runtime.list_servers_sync(),
                    (await runtime.query_tool_docs_sync("time"))[0]["server"],
                    (await runtime.search_tool_docs_sync("echo a message", 1, "summary"))[0]["tool"],
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


# Every use the issue lists, applied to a tool call's result (a dict from mcp-server-time,
# a str from server-everything): the same answers however the call was written.
TOOL_CALL_USES = """
import io, json, contextlib
def uses(now, echo):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print(now["timezone"], echo)
    return (
        printed.getvalue(),
        f"{echo}|{now['timezone']}",
        now["timezone"],
        echo.upper(),
        echo + "x",
        len(echo),
        [letter for letter in echo][:4],
        json.dumps(echo),
        json.loads(json.dumps(now))["timezone"],
        isinstance(now, dict) and type(now) is dict,
        isinstance(echo, str) and type(echo) is str,
        echo == "Echo: hi",
        echo < "F",
        sorted(now)[:1],
    )
"""


async def test_a_tool_call_is_its_value_however_written_and_gather_still_overlaps(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path,
        {"everything": {"command": real_server("everything")}, "time": {"command": real_server("time")}},
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        setup = await run_cell(client, TOOL_CALL_USES)
        assert not setup["is_error"], setup
        plain = await run_cell(
            client,
            """
            import warnings
            warnings.simplefilter("error")
            uses(mcp_time.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi"))
            """,
        )
        awaited = await run_cell(
            client,
            """
            import asyncio, warnings
            warnings.simplefilter("error")
            from mcp import runtime
            from mcp.servers import time as time_server
            forms = {}
            forms["before any await"] = uses(
                mcp_time.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi")
            )
            forms["awaited"] = uses(
                await mcp_time.get_current_time(timezone="UTC"), await mcp_everything.echo(message="hi")
            )
            forms["after an await"] = uses(
                time_server.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi")
            )
            forms["call_tool"] = uses(
                runtime.call_tool("time", "get_current_time", {"timezone": "UTC"}),
                await runtime.call_tool("everything", "echo", {"message": "hi"}),
            )
            now, echo = await asyncio.gather(
                mcp_time.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi")
            )
            forms["gathered"] = uses(now, echo)
            calls = [mcp_time.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi")]
            forms["a list of calls, gathered"] = uses(*(await asyncio.gather(*calls)))
            # Used before it is gathered, such a call runs there and then and stands for its
            # value (not for type checks or json: gather first for those).
            calls = [mcp_time.get_current_time(timezone="UTC"), mcp_everything.echo(message="hi")]
            early = (calls[0]["timezone"], calls[1].upper(), f"{calls[1]}", calls[1] + "!", len(calls[1]))
            assert early == ("UTC", "ECHO: HI", "Echo: hi", "Echo: hi!", 8), early
            assert (await asyncio.gather(*calls))[1] == "Echo: hi"
            task = asyncio.create_task(mcp_everything.echo(message="hi"))
            forms["a task"] = uses(mcp_time.get_current_time(timezone="UTC"), await task)
            async def timed(coro):
                return await coro
            forms["handed to a coroutine"] = uses(
                await timed(mcp_time.get_current_time(timezone="UTC")),
                await timed(mcp_everything.echo(message="hi")),
            )
            forms
            """,
        )
        for answer in (plain, awaited):
            assert not answer["is_error"], answer
            assert "<pending" not in answer["text"] and "Warning" not in answer["text"], answer
        expected = (
            "UTC Echo: hi\n",
            "Echo: hi|UTC",
            "UTC",
            "ECHO: HI",
            "Echo: hix",
            8,
            ["E", "c", "h", "o"],
            '"Echo: hi"',
            "UTC",
            True,
            True,
            True,
            True,
            ["datetime"],
        )
        assert eval(plain["value"]) == expected
        forms = eval(awaited["value"])
        assert len(forms) == 8
        for form, values in forms.items():
            assert values == expected, form


async def test_tool_functions_have_docs_a_signature_and_help(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"time": {"command": real_server("time")}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(
            client,
            """
            import inspect, io, contextlib, warnings
            warnings.simplefilter("error")
            shown = io.StringIO()
            with contextlib.redirect_stdout(shown):
                help(mcp_time.convert_time)
            tool = mcp_time.get_current_time
            (str(inspect.signature(tool)), tool.__doc__.splitlines()[0], tool.__name__, shown.getvalue())
            """,
        )
        assert not answer["is_error"], answer
        signature, first_line, name, shown = eval(answer["value"])
        assert signature == "(*, timezone: str, raw: bool = False) -> dict"
        assert first_line == "Get current time in a specific timezone"
        assert name == "get_current_time"
        assert (
            "convert_time(*, source_timezone: str, time: str, target_timezone: str, raw: bool = False)"
            in shown
        )
        assert "Convert time between timezones" in shown and "target_timezone: " in shown
        assert "ToolFunction object" not in shown and "never awaited" not in answer["text"]


async def test_a_deny_pattern_that_matches_no_tool_is_reported_to_the_code(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"time": {"command": real_server("time")}})
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_DENY_TOOLS="time.convrt_*,tim.*")
    async with bridge_client(env) as client:
        answer = await run_cell(
            client,
            """
            from mcp import runtime
            before = runtime.discovered_servers(detailed=True)["problems"]
            mcp_time.get_current_time(timezone="UTC")
            (before, runtime.discovered_servers(detailed=True)["problems"])
            """,
        )
        before, after = eval(answer["value"])
        assert before == ["MCP_BRIDGE_DENY_TOOLS: 'tim.*' matches no configured server"]
        assert after == [*before, "MCP_BRIDGE_DENY_TOOLS: 'time.convrt_*' matches no tool of time"]
