"""The sandbox API as models write it from the original project's README: every discovery
helper used directly and awaited, before and after an ``await`` in the same cell, the
``_sync`` names and ``list_loaded_server_metadata``; against real servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    Engine,
    bridge_client,
    claude_desktop_home,
    proxy_env,
    real_server,
    run_cell,
    stub_entry,
)

pytestmark = pytest.mark.anyio


# Each form as the original project's README writes it, and the value it must give here
# (everything + time configured). The cell below writes each one out at the top level,
# plain before any await, awaited, and plain again after an await.
DISCOVERY_FORMS = [
    ("runtime.discovered_servers()", "['everything', 'time']"),
    ("runtime.list_servers()", "['everything', 'time']"),
    (
        "sorted(tool['name'] for tool in {}runtime.list_tools('time'){})",
        "['convert_time', 'get_current_time']",
    ),
    ("{}runtime.query_tool_docs('time', 'get_current_time'){}['name']", "'get_current_time'"),
    ("{}runtime.search_tool_docs('current time in a timezone'){}[0]['tool']", "'get_current_time'"),
    (
        "{}runtime.capability_summary(){}.splitlines()[0]",
        "'MCP servers available in this sandbox (none is started until used):'",
    ),
    ("runtime.list_servers_sync()", "['everything', 'time']"),
    ("{}runtime.query_tool_docs_sync('time'){}[0]['server']", "'time'"),
    ("{}runtime.search_tool_docs_sync('echo a message'){}[0]['tool']", "'echo'"),
    ("[server['alias'] for server in {}runtime.list_loaded_server_metadata(){}]", "['everything', 'time']"),
]


def written(form: str, awaited: bool) -> str:
    """The form with its helper call plain, or awaited: `(await runtime.x(...))`."""
    if "{}" not in form:
        call = form
        return "(await %s)" % call if awaited else call
    return form.format("(await " if awaited else "", ")" if awaited else "")


async def test_discovery_helpers_work_directly_and_awaited_before_and_after_an_await(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path,
        {"everything": {"command": real_server("everything")}, "time": {"command": real_server("time")}},
    )
    lines = [
        "import asyncio, json, warnings",
        'warnings.simplefilter("error")  # "coroutine was never awaited" would fail the cell',
        "import mcp.runtime as runtime_module",
        "from mcp import runtime",
        "assert runtime_module is runtime",
        "forms = []",
    ]
    lines += ["forms.append(%s)" % written(form, False) for form, _ in DISCOVERY_FORMS]
    lines += ["forms.append(%s)" % written(form, True) for form, _ in DISCOVERY_FORMS]
    lines += ["await asyncio.sleep(0)"]
    lines += ["forms.append(%s)" % written(form, False) for form, _ in DISCOVERY_FORMS]
    lines += [
        # The original README's search loop, verbatim.
        'matches = runtime.search_tool_docs("current time")',
        "for hit in matches:",
        '    print(hit["server"], hit["tool"], hit.get("description"))',
        "json.dumps(forms)  # plain values: they serialize",
        "forms",
    ]
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(client, "\n".join(lines))
    assert not answer["is_error"], answer
    assert "Warning" not in answer["text"], answer["text"]
    values = eval(answer["value"])
    expected = [eval(value) for _, value in DISCOVERY_FORMS]
    assert values == expected * 3
    assert answer["stdout"].splitlines()[0] == "time get_current_time None"


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
            assert "Warning" not in answer["text"], answer
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
            assert tuple(values) == expected, form  # a dict of tuples comes back as JSON: lists


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
        assert shown.startswith("Help on function convert_time"), shown
        assert "never awaited" not in answer["text"]


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


async def test_calls_handed_to_asyncio_run_at_the_same_time_however_written(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # mcp_stub.meet answers only once `size` calls of its group run at the same time, so
    # each form below proves overlap without timing anything (it fails after 20 s).
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(
            client,
            """
            import asyncio
            met = {}
            met["inline"] = await asyncio.gather(
                mcp_stub.meet(group="a", size=2), mcp_stub.meet(group="a", size=2)
            )
            met["generator"] = await asyncio.gather(*(mcp_stub.meet(group="b", size=3) for _ in range(3)))
            calls = [mcp_stub.meet(group="c", size=3) for _ in range(3)]
            met["a list"] = await asyncio.gather(*calls)
            tasks = []
            for _ in range(2):
                tasks.append(mcp_stub.meet(group="d", size=2))
            met["appended"] = await asyncio.gather(*tasks)
            by_key = {key: mcp_stub.meet(group="e", size=2) for key in "xy"}
            met["dict values"] = await asyncio.gather(*by_key.values())
            first = asyncio.create_task(mcp_stub.meet(group="f", size=2))
            second = asyncio.create_task(mcp_stub.meet(group="f", size=2))
            met["tasks"] = [await first, await second]
            async with asyncio.TaskGroup() as group:
                started = [group.create_task(mcp_stub.meet(group="g", size=2)) for _ in range(2)]
            met["task group"] = [task.result() for task in started]
            done, _ = await asyncio.wait([mcp_stub.meet(group="h", size=2), mcp_stub.meet(group="h", size=2)])
            met["wait"] = [task.result() for task in done]
            pair = [mcp_stub.meet(group="i", size=2) for _ in "xy"]
            met["as_completed"] = [await c for c in asyncio.as_completed(pair)]
            async def timed(coro):
                return await coro
            met["handed to a coroutine"] = await asyncio.gather(
                timed(mcp_stub.meet(group="j", size=2)), timed(mcp_stub.meet(group="j", size=2))
            )
            met
            """,
            timeout=120,
        )
    assert not answer["is_error"], answer["text"]
    met = eval(answer["value"])
    assert len(met) == 10 and all(set(values) == {"met"} for values in met.values()), met


async def test_a_kept_call_awaited_twice_or_after_failing_gives_the_same_outcome(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(
            client,
            """
            import asyncio, copy
            from mcp import runtime
            task = mcp_stub.pair(a=2)
            once, twice = await task, await task
            failing = [mcp_stub.fail(message="no")]
            outcome = await asyncio.gather(*failing, return_exceptions=True)
            try:
                failing[0]["x"]
            except runtime.MCPToolError as exc:
                later = str(exc)
            value = await 7  # a plain value awaited is itself
            (once, twice, type(outcome[0]).__name__, later, value, copy.deepcopy([1]))
            """,
        )
    assert not answer["is_error"], answer["text"]
    assert eval(answer["value"]) == (
        {"sum": 4, "product": 4},
        {"sum": 4, "product": 4},
        "MCPToolError",
        "stub.fail failed: Error executing tool fail: no",
        7,
        [1],
    )
    assert answer["stderr"] == "", answer


async def test_a_tool_error_in_plain_code_reads_cleanly(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"time": {"command": real_server("time")}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(client, 'mcp_time.get_current_time(timezone="Nowhere/Foo")')
    assert answer["is_error"] and answer["error"]["type"] == "MCPToolError", answer
    traceback = answer["error"]["traceback"]
    assert traceback.splitlines()[:3] == [
        "Traceback (most recent call last):",
        '  File "<cell-1>", line 1, in <module>',
        '    mcp_time.get_current_time(timezone="Nowhere/Foo")',
    ], traceback
    assert "During handling" not in traceback and "event loop" not in traceback, traceback
