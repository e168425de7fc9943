"""Issue 3 acceptance: the user's MCP servers, discovered from real client config
files, proxied into real containers and driven by a real MCP client. Third-party
servers (server-everything, server-filesystem, mcp-server-time) plus a stub server for
the failure modes and timings they cannot produce on demand."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import (
    JUNK_WRAPPER,
    LISTING_WRAPPER,
    Engine,
    bridge_client,
    bridge_pids,
    claude_desktop_home,
    proxy_env,
    real_server,
    run_cell,
    structured,
    stub_entry,
    text_of,
)
from tests.harness import local_server

pytestmark = pytest.mark.anyio


async def run_ok(client: Any, code: str, timeout: float = 60) -> dict[str, Any]:
    result = await client.call_tool("run_python", {"code": textwrap.dedent(code), "timeout": timeout})
    assert not result.is_error, text_of(result)
    return structured(result)


async def test_real_servers_are_discovered_searched_documented_and_called(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    home = claude_desktop_home(
        tmp_path,
        {
            "everything": {"command": real_server("everything")},
            "filesystem": {"command": real_server("filesystem"), "args": [str(files)]},
            "time": {"command": real_server("time")},
        },
    )
    async with bridge_client(proxy_env(engine, state_dir, home)) as client:
        listed = await run_ok(
            client,
            """
            from mcp import runtime
            detailed = runtime.discovered_servers(detailed=True)
            assert [s["running"] for s in detailed["servers"]] == [False, False, False], detailed
            runtime.discovered_servers()
            """,
        )
        assert listed["value"] == "['everything', 'filesystem', 'time']"
        found = await run_ok(client, "runtime.search_tool_docs('current time in a timezone')[0]")
        assert found["value"].startswith("mcp_time.get_current_time(timezone: str) -> dict  # "), found
        docs = await run_ok(client, "[doc['signature'] for doc in runtime.query_tool_docs('time')]")
        assert (
            "get_current_time(timezone: str) -> dict  # Get current time in a specific timezone"
            in docs["value"]
        )
        full = await run_ok(client, "runtime.query_tool_docs('filesystem', 'write_file', detail='full')")
        assert "'input_schema'" in full["value"] and "'output_schema'" in full["value"]
        calls = await run_ok(
            client,
            f"""
            now = mcp_time.get_current_time(timezone="UTC")
            assert now["timezone"] == "UTC", now
            total = mcp_everything.get_sum(a=2, b=3)
            assert "5" in str(total), total
            mcp_filesystem.write_file(path={str(files / "note.txt")!r}, content="written from the sandbox")
            mcp_filesystem.read_text_file(path={str(files / "note.txt")!r})
            """,
        )
        assert calls["value"] == "{'content': 'written from the sandbox'}"
        assert (files / "note.txt").read_text() == "written from the sandbox"
        awaited = await run_ok(
            client,
            """
            from mcp.servers import time as time_server
            paris = await time_server.get_current_time(timezone="Europe/Paris")
            utc = mcp_time.get_current_time(timezone="UTC")  # after an await: still its value
            (paris["timezone"], utc["timezone"])
            """,
        )
        assert awaited["value"] == "('Europe/Paris', 'UTC')"


async def test_codex_toml_and_vscode_configs_are_read(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        '[mcp_servers.clock]\ncommand = "%s"\nargs = []\n' % real_server("time")
    )
    vscode_user = home / ".config" / "Code" / "User"
    vscode_user.mkdir(parents=True)
    (vscode_user / "mcp.json").write_text(
        '{\n  // VS Code writes comments and trailing commas\n  "servers": {"stubby": %s,},\n}'
        % json.dumps(dict(stub_entry(), type="stdio"))
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            assert runtime.list_servers() == ["clock", "stubby"], runtime.list_servers()
            (mcp_clock.get_current_time(timezone="UTC")["timezone"], mcp_stubby.pair(a=3))
            """,
        )
        assert result["value"] == "('UTC', {'sum': 5, 'product': 6})"


async def test_concurrent_calls_overlap_and_a_slow_server_blocks_no_other(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry(), "time": {"command": real_server("time")}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        await run_ok(client, "mcp_stub.pair(a=1)\nmcp_time.get_current_time(timezone='UTC')")  # both started
        result = await run_ok(
            client,
            """
            import asyncio, time
            started = time.monotonic()
            results = await asyncio.gather(*(mcp_stub.slow(seconds=1) for _ in range(3)))
            elapsed = time.monotonic() - started
            assert results == ["slept 1"] * 3, results
            finished = []
            async def timed(name, coro):
                await coro
                finished.append(name)
            await asyncio.gather(
                timed("slow", mcp_stub.slow(seconds=2)),
                timed("time", mcp_time.get_current_time(timezone="UTC")),
            )
            (round(elapsed, 2), finished)
            """,
        )
        elapsed, order = eval(result["value"])
        assert order == ["time", "slow"]
        # Three 1-second calls one after another take >= 3 s; overlapping, about 1 s (the
        # bound sits between the two, with room for a loaded machine).
        assert elapsed < 2.5, elapsed


async def test_tool_failures_are_exceptions_the_code_can_catch(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            try:
                mcp_stub.fail(message="boom")
            except runtime.MCPToolError as exc:
                caught = (str(exc), exc.server, exc.tool, isinstance(exc, runtime.MCPError))
            try:
                runtime.call_tool("nowhere", "x", {})
            except runtime.MCPError as exc:
                unknown = str(exc)
            try:
                mcp_stub.slo
            except AttributeError as exc:
                typo = str(exc)
            try:
                mcp_stub.pair(1)
            except TypeError as exc:
                positional = str(exc)
            (caught, unknown, typo, positional)
            """,
        )
        caught, unknown, typo, positional = eval(result["value"])
        assert "boom" in caught[0] and tuple(caught[1:]) == ("stub", "fail", True)  # JSON: a list
        assert "Unknown MCP server 'nowhere'" in unknown and "stub" in unknown
        assert "has no tool 'slo'. The nearest: mcp_stub.slow(" in typo, typo
        assert "keyword arguments only" in positional


async def test_results_are_unwrapped_and_raw_is_available(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path, {"stub": stub_entry(), "everything": {"command": real_server("everything")}}
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            image = mcp_everything.get_tiny_image()
            blocks = image if isinstance(image, list) else [image]
            images = [item for item in blocks if isinstance(item, runtime.ToolImage)]
            raw = mcp_stub.pair(a=2, raw=True)
            (
                mcp_stub.pair(a=2),
                mcp_stub.kebab_name(),
                images[0].mime_type,
                images[0].data[:4],
                sorted(raw),
                runtime.call_tool("stub", "pair", {"a": 1, "b": 1}),
            )
            """,
        )
        assert result["value"] == (
            "({'sum': 4, 'product': 4}, 'kebab', 'image/png', b'\\x89PNG', "
            "['content', 'isError', 'resultType', 'structuredContent'], {'sum': 2, 'product': 1})"
        )


async def test_a_tool_result_of_text_image_text_keeps_its_text_and_shows_its_image(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # server-everything's get-tiny-image answers [text, image, text]: in the sandbox a
    # list of the three; as a cell's value (or displayed) its text stays in the repr and
    # its image reaches the client as an image, not only as "<ToolImage ...>".
    home = claude_desktop_home(tmp_path, {"everything": {"command": real_server("everything")}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        parts = await run_cell(client, "[type(part).__name__ for part in mcp_everything.get_tiny_image()]")
        assert parts["value"] == "['str', 'ToolImage', 'str']", parts
        for code in ("mcp_everything.get_tiny_image()", "display(await mcp_everything.get_tiny_image())"):
            answer = await run_cell(client, code)
            assert not answer["is_error"] and answer["images"] == 1, answer
            text = answer["text"]
            assert """["Here's the image you requested:", <ToolImage image/png, """ in text, text
            assert "'The image above is the MCP logo.']" in text, text


DASHED_SERVER = Path(__file__).resolve().parent / "servers" / "dashed_server.py"


async def test_parameters_renamed_for_python_reach_the_server_under_their_schema_names(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path, {"dashed": {"command": sys.executable, "args": [str(DASHED_SERVER)]}}
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            shown = runtime.query_tool_docs("dashed", "echo")["signature"]
            python_names = mcp_dashed.echo(user_id="u1", a_b_=1, a_b=2)["received"]
            schema_names = runtime.call_tool("dashed", "echo", {"user-id": "u2", "a_b": 3})["received"]
            twice = None
            try:
                mcp_dashed.echo(user_id="u3", **{"user-id": "u4"})
            except runtime.MCPError as exc:
                twice = str(exc)
            (shown, python_names, schema_names, twice)
            """,
        )
        shown, python_names, schema_names, twice = eval(result["value"])
        assert shown.startswith("echo(user_id: str, a_b_: int | None = None, a_b: int | None = None) -> Any")
        assert python_names == {"user-id": "u1", "a-b": 1, "a_b": 2}
        assert schema_names == {"user-id": "u2", "a_b": 3}
        assert "'user-id' is given twice, as 'user_id' and as 'user-id'" in twice, twice


async def test_a_five_megabyte_result_arrives_intact_and_the_cap_is_clear(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_MAX_TOOL_RESULT_BYTES="12000000")
    async with bridge_client(env) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            text = mcp_stub.big(size=5_000_000)
            assert text == "x" * 5_000_000
            try:
                mcp_stub.big(size=7_000_000)
            except runtime.MCPError as exc:
                refused = str(exc)
            refused
            """,
        )
        assert "over the 12000000-byte cap" in result["value"]
        assert "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES" in result["value"]


def _children_running(pid: int, marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and marker.encode() in cmdline:
            found.append(int(proc.name))
    return found


async def test_a_server_killed_from_outside_is_restarted_on_next_use(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        await run_ok(client, "mcp_stub.pair(a=1)")
        bridge = bridge_pids(state_dir)[0]
        (server_pid,) = _children_running(bridge, "stub_server.py")
        os.kill(server_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _children_running(bridge, "stub_server.py") == [server_pid] and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        await anyio.sleep(0.5)
        again = await client.call_tool("run_python", {"code": "mcp_stub.pair(a=2)"})
        assert not again.is_error, text_of(again)
        assert structured(again)["value"] == "{'sum': 4, 'product': 4}"
        assert any("restarted" in notice for notice in structured(again)["notices"]), structured(again)
        assert len(_children_running(bridge, "stub_server.py")) == 1


async def test_a_server_that_never_initializes_fails_within_its_start_timeout(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    import sys

    home = claude_desktop_home(
        tmp_path, {"mute": {"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]}}
    )
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_SERVER_START_TIMEOUT="3")
    async with bridge_client(env) as client:
        await run_ok(client, "1")
        started = time.monotonic()
        result = await run_ok(
            client,
            """
            from mcp import runtime
            try:
                mcp_mute.anything()
            except runtime.MCPError as exc:
                message = str(exc)
            message
            """,
        )
        assert time.monotonic() - started < 15
        assert (
            "'mute' (command: %s -c 'import time; time.sleep(600)') could not be started" % sys.executable
            in (result["json"])
        )
        assert "did not finish initializing within 3s" in result["value"]


async def test_a_server_writing_junk_to_stdout_does_not_take_the_bridge_down(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    import sys

    entry = {"command": sys.executable, "args": [str(JUNK_WRAPPER), *stub_entry()["args"][:0], sys.executable,
                                                  str(stub_entry()["args"][0])]}  # fmt: skip
    home = claude_desktop_home(tmp_path, {"junky": entry})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await client.call_tool("run_python", {"code": "mcp_junky.pair(a=5)"})
        assert structured(result)["value"] == "{'sum': 7, 'product': 10}", text_of(result)
        still = await run_ok(client, "6 * 7")
        assert still["value"] == "42"


async def test_self_reference_is_skipped_and_reported(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(
        tmp_path,
        {"me": {"command": "uvx", "args": ["mcp-server-code-execution-mode"]}, "stub": stub_entry()},
    )
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            "from mcp import runtime\n"
            "(runtime.list_servers(), runtime.discovered_servers(detailed=True)['problems'])",
        )
        servers, problems = eval(result["value"])
        assert servers == ["stub"]
        assert any("me" in problem and "launches this bridge itself" in problem for problem in problems), (
            problems
        )


async def test_policy_hides_and_refuses_denied_servers_and_tools(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry(), "time": {"command": real_server("time")}})
    env = proxy_env(
        proxy_engine, state_dir, home, MCP_BRIDGE_DENY_SERVERS="time", MCP_BRIDGE_DENY_TOOLS="stub.fail,*.big"
    )
    async with bridge_client(env) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            names = [doc["tool"] for doc in runtime.query_tool_docs("stub")]
            hits = [hit["tool"] for hit in runtime.search_tool_docs("fail always", 10, "summary")]
            try:
                runtime.call_tool("stub", "fail", {"message": "x"})
            except runtime.MCPError as exc:
                refused = str(exc)
            try:
                runtime.call_tool("time", "get_current_time", {"timezone": "UTC"})
            except runtime.MCPError as exc:
                hidden = str(exc)
            try:
                runtime.call_tool("stub", "fair", {"message": "x"})  # no such tool; close to pair too
            except runtime.MCPError as exc:
                missing = str(exc)
            try:
                runtime.call_tool("nowhere", "get_current_time", {"timezone": "UTC"})
            except runtime.MCPError as exc:
                unknown = str(exc)
            (runtime.list_servers(), "mcp_time" in globals(), names, hits, refused, hidden, missing, unknown)
            """,
        )
        servers, has_time, names, hits, refused, hidden, missing, unknown = eval(result["value"])
        assert servers == ["stub"] and not has_time
        assert "fail" not in names and "big" not in names and "pair" in names
        assert "fail" not in hits
        # Denied and missing tools get the same answer: the policy's names stay hidden.
        assert "has no tool 'fail'" in refused and "fail" not in refused.split("Its tools:")[1]
        assert "Unknown MCP server 'time'" in hidden
        # The same answer but for the nearest tools (which depend on the name asked for,
        # and are drawn from the allowed tools only): nothing tells denied from missing.
        assert missing.startswith("MCP server 'stub' has no tool 'fair'. The nearest: "), missing
        assert refused.split("Its tools:")[1] == missing.split("Its tools:")[1], (refused, missing)
        assert refused.startswith("MCP server 'stub' has no tool 'fail'. The nearest: "), refused
        assert "fail(" not in refused and "fail(" not in missing
        assert hidden.replace("'time'", "'nowhere'") == unknown, (hidden, unknown)


async def test_a_timeout_cancels_the_runs_outstanding_tool_calls(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        await run_ok(client, "kept = mcp_stub.pair(a=1)")
        result = await client.call_tool(
            "run_python",
            {
                "code": "import asyncio\ncalls = [mcp_stub.slow(seconds=60) for _ in range(4)]\n"
                "await asyncio.gather(*calls)",
                "timeout": 2,
            },
        )
        assert structured(result)["status"] == "timeout" and structured(result)["state_kept"] is True
        sync_call = await client.call_tool("run_python", {"code": "mcp_stub.slow(seconds=60)", "timeout": 2})
        assert structured(sync_call)["status"] == "timeout" and structured(sync_call)["state_kept"] is True
        started = time.monotonic()
        after = await run_ok(client, "(kept, mcp_stub.pair(a=2))")
        assert time.monotonic() - started < 5
        assert after["value"] == "({'sum': 3, 'product': 2}, {'sum': 4, 'product': 4})"


async def test_tool_list_changes_are_picked_up(proxy_engine: Engine, state_dir: Path, tmp_path: Path) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        before = await run_ok(client, "[tool['tool'] for tool in runtime.list_tools('stub')]")
        assert "fresh_tool" not in before["value"]
        await run_ok(client, "mcp_stub.grow(name='fresh_tool')")
        after = await run_ok(
            client,
            """
            import time
            for _ in range(50):  # the notification races the call's own result
                if "fresh_tool" in [tool["tool"] for tool in runtime.list_tools("stub")]:
                    break
                time.sleep(0.1)
            mcp_stub.fresh_tool()
            """,
        )
        assert after["value"] == "'grown'"


@contextmanager
def _http_stub() -> Iterator[str]:
    """The stub server serving streamable HTTP on a free local port: its URL."""

    def argv(port: int) -> list[str]:
        return [sys.executable, stub_entry()["args"][0], "--http", str(port)]

    with local_server(argv, "the stub") as port:
        yield "http://127.0.0.1:%d/mcp" % port


async def test_a_streamable_http_server_is_proxied(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    with _http_stub() as url:
        home = claude_desktop_home(tmp_path, {"remote": {"type": "http", "url": url}})
        async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
            result = await run_ok(
                client,
                "servers = runtime.discovered_servers(detailed=True)['servers']\n"
                "(servers[0]['transport'], mcp_remote.pair(a=4))",
            )
            assert result["value"] == "('http', {'sum': 6, 'product': 8})"


async def test_an_sse_server_is_proxied(proxy_engine: Engine, state_dir: Path, tmp_path: Path) -> None:
    """The older HTTP+SSE transport (a config's "type": "sse"), against the SDK's own SSE
    server: discovery, a structured result, a tool's error, and a search by its tool list."""

    def argv(port: int) -> list[str]:
        return [sys.executable, stub_entry()["args"][0], "--sse", str(port)]

    with local_server(argv, "the stub over SSE") as port:
        url = "http://127.0.0.1:%d/sse" % port
        home = claude_desktop_home(tmp_path, {"older": {"type": "sse", "url": url}})
        async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
            result = await run_ok(
                client,
                """
                from mcp import runtime
                servers = runtime.discovered_servers(detailed=True)['servers']
                try:
                    mcp_older.fail(message='broken on purpose')
                except runtime.MCPError as exc:
                    failed = str(exc)
                hits = [hit['tool'] for hit in runtime.search_tool_docs('sum and product of two numbers')]
                (servers[0]['transport'], mcp_older.pair(a=4), 'broken on purpose' in failed, hits[0])
                """,
            )
            assert result["value"] == "('sse', {'sum': 6, 'product': 8}, True, 'pair')"


async def test_a_tool_call_that_outlives_its_timeout_fails_clearly(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_TOOL_TIMEOUT="1")
    async with bridge_client(env) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            try:
                mcp_stub.slow(seconds=5)
            except runtime.MCPError as exc:
                message = str(exc)
            (message, mcp_stub.pair(a=1))
            """,
        )
        message, after = eval(result["value"])
        assert "did not answer the call to slow within 1s" in message and "MCP_BRIDGE_TOOL_TIMEOUT" in message
        assert after == {"sum": 3, "product": 2}


async def test_a_timed_out_run_cancels_its_calls_on_the_server_too(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "finished.txt"
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        await run_ok(client, "mcp_stub.pair(a=1)")
        code = "await mcp_stub.slow_then_mark(seconds=4, path=%r)" % str(marker)
        result = await client.call_tool("run_python", {"code": code, "timeout": 1})
        assert structured(result)["status"] == "timeout"
        await anyio.sleep(6)
        assert not marker.exists(), "the server finished a call whose run had timed out"
        control = await run_ok(client, "mcp_stub.slow_then_mark(seconds=0.1, path=%r)" % str(marker))
        assert control["value"] == "'marked'" and marker.exists()


async def test_requests_beyond_the_in_flight_limit_are_refused_not_queued(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            import asyncio
            from mcp import runtime
            calls = [mcp_stub.slow(seconds=1) for _ in range(300)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, runtime.MCPError)]
            (outcomes.count("slept 1"), len(refused), str(refused[0]) if refused else "")
            """,
        )
        served, refused, message = eval(result["value"])
        assert (served, refused) == (256, 44)
        assert refused > 0 and "Too many MCP requests in flight" in message
        after = await run_ok(client, "mcp_stub.pair(a=1)")
        assert after["value"] == "{'sum': 3, 'product': 2}"


# --- issue 17 items 4, 5, 7: start failures, the servers' environment, malformed tools -----

CATCH = """
from mcp import runtime
try:
    %s
except runtime.MCPError as exc:
    message = str(exc)
message
"""


async def test_a_server_that_cannot_start_is_named_with_its_command_exit_status_and_stderr(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    code = (
        "import sys; print('starting up', file=sys.stderr); "
        "print('fatal: missing API_KEY \\x1b[31m', file=sys.stderr); sys.exit(3)"
    )
    home = claude_desktop_home(tmp_path, {"keyless": {"command": sys.executable, "args": ["-c", code]}})
    log = tmp_path / "bridge.log"
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_LOG_LEVEL="INFO")
    with log.open("w") as errlog:
        async with bridge_client(env, errlog=errlog) as client:
            first = await run_ok(client, CATCH % "mcp_keyless.anything()")
            message = first["json"]
            assert message.startswith("MCP server 'keyless' (command: %s -c " % sys.executable), message
            assert "could not be started: its process exited with status 3 before it finished" in message
            # Its last stderr lines, control characters escaped.
            assert "starting up\n  fatal: missing API_KEY \\x1b[31m\n" in message, message
            assert "\x1b" not in message
            # Called again: it is tried again and fails the same way; nothing says "restarted".
            again = await run_ok(client, CATCH % "mcp_keyless.anything()")
            assert "could not be started: its process exited with status 3" in again["json"]
            assert not any("restarted" in notice for notice in again["notices"]), again["notices"]
            detailed = await run_ok(client, "runtime.discovered_servers(detailed=True)['servers'][0]")
            assert (detailed["json"]["running"], detailed["json"]["tools"]) == (False, None)
            assert "exited with status 3" in detailed["json"]["failure"], detailed
    # The bridge's log names the server on each of its stderr lines.
    assert "MCP server keyless: fatal: missing API_KEY \\x1b[31m" in log.read_text()


async def test_a_server_that_could_not_start_and_then_does_is_not_said_to_be_restarted(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "second-try"
    # Fails its first start (leaving a marker), starts as the stub server the next time.
    code = (
        "import os, sys, runpy; m = %r\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close(); print('first start fails', file=sys.stderr); sys.exit(1)\n"
        "sys.argv = [%r]; runpy.run_path(%r, run_name='__main__')"
    ) % (str(marker), stub_entry()["args"][0], stub_entry()["args"][0])
    home = claude_desktop_home(tmp_path, {"flaky": {"command": sys.executable, "args": ["-c", code]}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        first = await run_ok(client, CATCH % "mcp_flaky.pair(a=1)")
        assert "'flaky'" in first["json"] and "exited with status 1" in first["json"], first
        second = await run_ok(client, "mcp_flaky.pair(a=1)")
        assert second["value"] == "{'sum': 3, 'product': 2}"
        # The other notice: this client cannot be asked to approve the call (the stub's tools may write).
        (notice,) = [said for said in second["notices"] if "Approvals are not available" not in said]
        assert "could not be started before" in notice and "it has started now" in notice, notice
        assert "restarted" not in notice


async def test_servers_get_the_certificate_proxy_and_locale_variables_and_their_entry_env_wins(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    entry = dict(stub_entry(), env={"HTTPS_PROXY": "http://entry-proxy:3128"})
    home = claude_desktop_home(tmp_path, {"stub": entry})
    env = proxy_env(
        proxy_engine,
        state_dir,
        home,
        SSL_CERT_FILE="/etc/corp/ca.pem",
        NODE_EXTRA_CA_CERTS="/etc/corp/ca.pem",
        HTTPS_PROXY="http://user-proxy:3128",
        no_proxy="localhost,.corp",
        TZ="Europe/Paris",
        CORP_TOKEN="not for every server",
        MCP_BRIDGE_PASS_ENV="EXTRA_SETTING,MY_TOOL_*",
        EXTRA_SETTING="passed by name",
        MY_TOOL_HOME="passed by prefix",
    )
    names = [
        "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "HTTPS_PROXY", "no_proxy", "TZ", "CORP_TOKEN",
        "EXTRA_SETTING", "MY_TOOL_HOME", "PATH",
    ]  # fmt: skip
    async with bridge_client(env) as client:
        result = await run_ok(client, "mcp_stub.environment(names=%r)" % names)
    seen = result["json"]
    assert seen["SSL_CERT_FILE"] == seen["NODE_EXTRA_CA_CERTS"] == "/etc/corp/ca.pem"
    assert seen["HTTPS_PROXY"] == "http://entry-proxy:3128"  # the entry's own env wins
    assert (seen["no_proxy"], seen["TZ"]) == ("localhost,.corp", "Europe/Paris")
    assert (seen["EXTRA_SETTING"], seen["MY_TOOL_HOME"]) == ("passed by name", "passed by prefix")
    assert seen["CORP_TOKEN"] is None  # not on the list: not passed
    assert seen["PATH"]  # the SDK's default stays


async def test_a_malformed_tool_is_repaired_or_left_out_and_the_rest_of_its_server_works(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # The stub's "pair" is listed with inputSchema and outputSchema {} (repairable: its
    # structured result is still checked against the repaired one), "blob" with a
    # schema of type "string" (not: arguments are an object); the stub still serves both.
    stub = stub_entry()
    entry = {
        "command": sys.executable,
        "args": [str(LISTING_WRAPPER), "pair", "blob", stub["command"], *stub["args"]],
    }
    home = claude_desktop_home(tmp_path, {"shaky": entry, "time": {"command": real_server("time")}})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        listed = await run_ok(
            client,
            """
            from mcp import runtime
            names = [tool["name"] for tool in runtime.list_tools("shaky")]
            (sorted(names), runtime.query_tool_docs("shaky", "pair")["signature"])
            """,
        )
        names, signature = listed["json"]
        assert "pair" in names and "slow" in names and "blob" not in names, names
        assert signature.startswith("pair("), signature
        (notice,) = listed["notices"]
        assert "'shaky'" in notice and "'blob'" in notice and "inputSchema.type" in notice, notice
        calls = await run_ok(
            client,
            """
            hits = [hit["tool"] for hit in runtime.search_tool_docs("sleep then answer", 10)]
            try:
                mcp_shaky.blob(size=1)
            except AttributeError as exc:
                gone = str(exc)
            (mcp_shaky.pair(a=3), mcp_shaky.slow(seconds=0), "slow" in hits, gone)
            """,
        )
        pair, slow, found, gone = calls["json"]
        assert (pair, slow, found) == ({"sum": 5, "product": 6}, "slept 0", True), calls
        assert "blob" in gone


async def test_search_says_which_servers_it_left_out_and_why(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    broken = {"command": sys.executable, "args": ["-c", "import sys; sys.exit('no config file')"]}
    home = claude_desktop_home(tmp_path, {"broken": broken, "stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            from mcp import runtime
            first = [hit["tool"] for hit in runtime.search_tool_docs("sum of two numbers")]
            again = runtime.search_tool_docs("product")
            first
            """,
        )
        assert "pair" in result["json"]
        (notice,) = result["notices"]  # two searches, one notice
        assert "runtime.search_tool_docs(...) left out the tools of MCP server 'broken'" in notice, notice
        assert "exited with status 1" in notice and "no config file" in notice, notice
