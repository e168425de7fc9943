"""Proxied servers that misbehave: a wedged event loop, a crash in the middle of a call
or of tools/list, a tools/list that fails once, a result far over the cap. Driven like
tests/test_proxy.py (the real bridge, a real MCP client, a real container and the stub
server), plus unit tests of the capped stdio reader's line splitting."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp.client.stdio import StdioServerParameters
from mcp.shared.message import SessionMessage

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_pids, claude_desktop_home, proxy_env, stub_entry
from tests.test_proxy import _children_running, _http_stub, run_ok

pytestmark = pytest.mark.anyio


async def _wait_until_gone(parent: int, pid: int, marker: str, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while pid in _children_running(parent, marker):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.2)
    return True


async def test_a_wedged_server_is_restarted_after_a_tool_timeout(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_TOOL_TIMEOUT="2")
    async with bridge_client(env) as client:
        await run_ok(client, "mcp_stub.pair(a=1)")
        bridge_pid = bridge_pids(state_dir)[0]
        (wedged,) = _children_running(bridge_pid, "stub_server.py")
        # wedge() blocks the server's event loop for 10 minutes: without a restart, the
        # call after it would wait out the tool timeout too.
        result = await run_ok(
            client,
            """
            from mcp import runtime
            try:
                mcp_stub.wedge(seconds=600)
            except runtime.MCPError as exc:
                message = str(exc)
            (message, mcp_stub.pair(a=1))
            """,
        )
        message, after = eval(result["value"])
        assert "did not answer the call to wedge within 2s (MCP_BRIDGE_TOOL_TIMEOUT)" in message
        assert "restarted on the next call" in message
        assert after == {"sum": 3, "product": 2}
        assert any("wedge" in notice and "restarted" in notice for notice in result["notices"]), result
        assert await _wait_until_gone(bridge_pid, wedged, "stub_server.py"), (
            "the wedged server is still running"
        )


async def test_a_failed_tool_list_refresh_is_retried(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        result = await run_ok(
            client,
            """
            import time
            from mcp import runtime
            # Adds fresh_tool, makes the next tools/list fail, announces a changed list.
            mcp_stub.trouble_next_listing(mode="fail", add="fresh_tool")
            errors = []
            for _ in range(100):  # the notification races the call's own result
                try:
                    names = [tool["tool"] for tool in runtime.list_tools("stub")]
                except runtime.MCPError as exc:
                    errors.append(str(exc))
                    continue
                if "fresh_tool" in names:
                    break
                time.sleep(0.1)
            (errors, mcp_stub.fresh_tool())
            """,
        )
        errors, fresh = eval(result["value"])
        assert fresh == "grown"
        assert len(errors) == 1, errors
        assert "rejected tools/list" in errors[0] and "failed on purpose" in errors[0], errors


async def test_a_dropped_transport_is_a_clear_error_and_the_server_restarts(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        listing = await run_ok(
            client,
            """
            import time
            from mcp import runtime
            mcp_stub.trouble_next_listing(mode="exit")  # the next tools/list ends the process
            message = "no error"
            for _ in range(100):
                try:
                    runtime.list_tools("stub")
                except runtime.MCPError as exc:
                    message = str(exc)
                    break
                time.sleep(0.1)
            (message, mcp_stub.pair(a=1))
            """,
        )
        message, after = eval(listing["value"])
        assert "MCP server 'stub' went away during tools/list" in message, message
        assert "restarted on the next call" in message
        assert after == {"sum": 3, "product": 2}
        assert any("restarted" in notice for notice in listing["notices"]), listing
        crash = await run_ok(
            client,
            """
            import asyncio
            from mcp import runtime
            outcomes = await asyncio.gather(
                mcp_stub.exit_now(), *(mcp_stub.slow(seconds=0.5) for _ in range(20)), return_exceptions=True
            )
            errors = [o for o in outcomes if isinstance(o, Exception)]
            failures = [(isinstance(error, runtime.MCPError), str(error)) for error in errors]
            served = [o for o in outcomes if not isinstance(o, Exception)]
            (failures, served, mcp_stub.pair(a=2))
            """,
        )
        failures, served, after = eval(crash["value"])
        assert failures[0][1].startswith("MCP server 'stub' went away during the call to exit_now"), failures
        # Calls in flight at the crash fail clearly; calls made after it reach the restarted server.
        for is_mcp_error, text in failures:
            assert is_mcp_error, failures
            assert "went away" in text and "restarted on the next call" in text, failures
        assert set(served) <= {"slept 0.5"} and len(failures) + len(served) == 21
        assert after == {"sum": 4, "product": 4}


async def test_an_oversized_result_is_refused_while_reading(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_MAX_TOOL_RESULT_BYTES="1000000")
    async with bridge_client(env) as client:
        await run_ok(client, "mcp_stub.pair(a=1)")
        bridge_pid = bridge_pids(state_dir)[0]
        (server,) = _children_running(bridge_pid, "stub_server.py")
        peak_before = _peak_rss_mib(bridge_pid)
        result = await run_ok(
            client,
            """
            from mcp import runtime
            try:
                mcp_stub.blob(size=100_000_000)
            except runtime.MCPError as exc:
                refused = str(exc)
            (refused, mcp_stub.blob(size=900_000) == "x" * 900_000, mcp_stub.pair(a=2))
            """,
            timeout=120,
        )
        refused, small_ok, after = eval(result["value"])
        assert "over the 1000000-byte cap (MCP_BRIDGE_MAX_TOOL_RESULT_BYTES)" in refused, refused
        assert "100000" in refused and "blob" in refused
        assert small_ok and after == {"sum": 4, "product": 4}
        # Refused while reading: the 100 MB line never sat in the bridge's memory, and the
        # connection survived (the server was answered, not restarted).
        growth = _peak_rss_mib(bridge_pid) - peak_before
        assert growth < 64, "the bridge's peak memory grew by %d MiB" % growth
        assert _children_running(bridge_pid, "stub_server.py") == [server]
        assert not result.get("notices"), result


async def test_an_oversized_streamable_http_result_costs_bounded_time_and_memory(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    """Streamable HTTP is the SDK's transport: the bridge caps an SSE event at
    MCP_BRIDGE_MAX_FRAME_BYTES while it is read (the connection is then dropped and
    restarted); a result under that is read whole and refused after arrival."""
    with _http_stub() as url:
        home = claude_desktop_home(tmp_path, {"remote": {"type": "http", "url": url}})
        async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
            await run_ok(client, "mcp_remote.pair(a=1)")
            bridge_pid = bridge_pids(state_dir)[0]
            measured = []
            for size in (50_000_000, 30_000_000):  # over the 32 MiB event cap, then under it
                peak_before, started = _peak_rss_mib(bridge_pid), time.monotonic()
                result = await run_ok(
                    client,
                    """
                    from mcp import runtime
                    try:
                        mcp_remote.blob(size=%d)
                    except runtime.MCPError as exc:
                        refused = str(exc)
                    (refused, mcp_remote.pair(a=2))
                    """
                    % size,
                )
                refused, after = eval(result["value"])
                assert after == {"sum": 4, "product": 4}, result
                measured.append(
                    (time.monotonic() - started, _peak_rss_mib(bridge_pid) - peak_before, refused)
                )
        (over_seconds, over_mib, over_refused), (under_seconds, under_mib, under_refused) = measured
        # Measured on a loaded 2-core machine: 1.8 s and 44 MiB of peak growth for the
        # 50 MB result, 1.1 s and 184 MiB for the 30 MB one (held whole, then refused).
        assert "MCP server 'remote' went away during the call to blob" in over_refused, measured
        assert over_seconds < 15 and over_mib < 128, measured
        assert "over the 16777216-byte cap (MCP_BRIDGE_MAX_TOOL_RESULT_BYTES)" in under_refused, measured
        assert under_seconds < 15 and under_mib < 400, measured


def _peak_rss_mib(pid: int) -> int:
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM for %d" % pid)


# --- the capped reader's line splitting ------------------------------------------------


def _split(data: bytes, cap: int, step: int) -> list[bytes | bridge.OversizedLine]:
    splitter = bridge.LineSplitter(cap)
    lines: list[bytes | bridge.OversizedLine] = []
    for start in range(0, len(data), step):
        lines += splitter.feed(data[start : start + step])
    return lines


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_the_line_splitter_keeps_lines_under_the_cap_and_the_ends_of_longer_ones(step: int) -> None:
    long = b"<" + b"x" * 5000 + b">"
    lines = _split(b"one\n" + long + b"\n\ntwo\npartial", cap=4000, step=step)
    assert lines[0] == b"one" and lines[2:] == [b"", b"two"]
    oversized = lines[1]
    assert isinstance(oversized, bridge.OversizedLine) and oversized.size == len(long)
    assert oversized.head == long[: len(oversized.head)] and oversized.head.startswith(b"<x")
    assert oversized.tail == long[-len(oversized.tail) :] and oversized.tail.endswith(b"x>")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # Python SDK servers: the id before the result.
        (b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"%s"}]}}', 7),
        # TypeScript SDK servers: the id after the result.
        (b'{"result":{"content":[{"type":"text","text":"%s"}]},"jsonrpc":"2.0","id":"req-7"}', "req-7"),
        (b'{"jsonrpc": "2.0", "id": 8, "error": {"code": 1, "message": "%s"}}', 8),
        # Not a response: a request from the server, or no id in the kept ends.
        (b'{"jsonrpc":"2.0","id":7,"method":"sampling/createMessage","params":{"x":"%s"}}', None),
        (b'{"jsonrpc":"2.0","result":{"text":"%s","id":3}}', None),
        (b"not json at all %s", None),
    ],
)
def test_a_discarded_line_is_answered_only_when_it_is_a_response_with_an_id(
    line: bytes, expected: int | str | None
) -> None:
    (oversized,) = _split(line % (b"y" * 10_000) + b"\n", cap=1000, step=3000)
    assert isinstance(oversized, bridge.OversizedLine)
    assert bridge.oversized_response_id(oversized) == expected


# --- lines the SDK's validator refuses ----------------------------------------------------


def test_a_response_with_lone_surrogates_is_repaired_not_dropped() -> None:
    line = (
        b'{"jsonrpc": "2.0", "id": 3, "result": {"tools": [{"name": "s", "description": "bad \\udcff doc",'
        b' "inputSchema": {"type": "object"}}]}}'
    )
    item = bridge._server_item(line, 1000)
    assert isinstance(item, SessionMessage), item
    assert item.message.model_dump(by_alias=True)["result"]["tools"][0]["description"] == "bad \\udcff doc"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b'{"jsonrpc": "2.0", "id": 4}', "JSONRPCResponse.result: Field required"),
        (b'{"jsonrpc": "1.0", "id": "r4", "result": {}}', "JSONRPCResponse.jsonrpc: Input should be '2.0'"),
    ],
)
def test_an_invalid_response_answers_its_request_at_once(line: bytes, problem: str) -> None:
    item = bridge._server_item(line, 1000)
    assert isinstance(item, SessionMessage), item
    error = item.message.model_dump(by_alias=True)
    assert error["id"] == json.loads(line)["id"] and error["error"]["data"] == {bridge.INVALID: problem}


@pytest.mark.parametrize(
    "line",
    [
        b"not json at all",
        b'{"jsonrpc": "2.0", "method": "notifications/message", "params": 5}',  # answers nothing
        b'{"jsonrpc": "2.0", "id": [4], "result": {}}',  # no id to answer
        b'{"jsonrpc": "2.0", "id": true, "result": {}}',
    ],
)
def test_other_unreadable_lines_are_reported_to_the_session(line: bytes) -> None:
    assert isinstance(bridge._server_item(line, 1000), ValueError)


# --- tool lists, tool by tool; a server's environment; its stderr --------------------------

GOOD = {"name": "good", "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
def test_a_valid_tool_list_passes_unchanged(version: str) -> None:
    result = {"tools": [GOOD], "nextCursor": "2"}
    assert bridge.check_tool_listing(result, version).result is result


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
def test_a_tool_without_schema_type_is_repaired_and_a_hopeless_one_left_out(version: str) -> None:
    listing = {
        "tools": [
            GOOD,
            {"name": "empty", "inputSchema": {}},
            {"name": "untyped", "inputSchema": {"properties": {"q": {"type": "string"}}}, "outputSchema": {}},
            {"name": "string", "inputSchema": {"type": "string"}},
            {"description": "no name", "inputSchema": {"type": "object"}},
            "not even an object",
        ],
        "nextCursor": "2",
    }
    checked = bridge.check_tool_listing(listing, version)
    assert checked.result["nextCursor"] == "2"
    assert [tool["name"] for tool in checked.result["tools"]] == ["good", "empty", "untyped"]
    assert checked.result["tools"][1]["inputSchema"] == {"type": "object"}
    assert checked.result["tools"][2]["outputSchema"] == {"type": "object"}
    assert checked.result["tools"][2]["inputSchema"] == {
        "type": "object",
        "properties": {"q": {"type": "string"}},
    }
    assert checked.repaired == ("'empty'", "'untyped'")
    assert [name for name, _ in checked.dropped] == ["'string'", "#5 (no name)", "#6 (no name)"]
    assert "inputSchema.type" in checked.dropped[0][1] and "name" in checked.dropped[1][1]
    notice = bridge.dropped_tools_notice("srv", checked.dropped, 3)
    assert notice.startswith(
        "MCP server 'srv' lists 3 tools that MCP clients cannot use, left out: 'string' ("
    )
    assert "Its other 3 tools work" in notice


def test_a_list_whose_fault_is_outside_its_tools_is_left_to_the_session() -> None:
    listing = {"tools": [{"name": "empty", "inputSchema": {}}], "nextCursor": 7}
    assert bridge.check_tool_listing(listing, "2025-11-25").result is listing


def test_a_servers_environment_is_the_allowlist_the_pass_env_names_and_its_entry() -> None:
    environ = {
        "SSL_CERT_FILE": "/ca.pem",
        "https_proxy": "http://proxy:1",
        "LANG": "de_DE.UTF-8",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "GITHUB_TOKEN": "token",
        "MY_APP_HOME": "/app",
        "BASH_FUNC_x%%": "() { :; }",
        "TZ": "() { evil; }",
    }
    env = bridge.server_environment(("GITHUB_TOKEN", "MY_APP_*"), environ, {"LANG": "C.UTF-8"})
    assert env == {
        "SSL_CERT_FILE": "/ca.pem",
        "https_proxy": "http://proxy:1",
        "LANG": "C.UTF-8",
        "GITHUB_TOKEN": "token",
        "MY_APP_HOME": "/app",
    }


def test_a_servers_stderr_is_logged_with_its_name_and_its_last_lines_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = bridge.ServerProcessLog("gh\x1bserver")
    with caplog.at_level("INFO"):
        for number in range(bridge.STDERR_TAIL_LINES + 2):
            log.add(b"line %d \x1b[2J\r" % number)
        log.add(b"")
        log.add(bridge.OversizedLine(100_000, b"x" * 1024, b"y"))
    assert caplog.messages[0] == "MCP server gh\\x1bserver: line 0 \\x1b[2J"
    assert log.tail[0] == "line 3 \\x1b[2J"
    assert log.tail[-1] == "x" * bridge.MAX_STDERR_LINE_CHARS + "..."
    assert log.ending is None
    log.returncode = 2
    assert log.ending == "exited with status 2"
    log.returncode = -9
    assert log.ending == "was killed by signal 9 (SIGKILL)"


# Reads one line, closes its stdin, says so on stdout, and stays alive without reading.
_STOPS_READING = (
    "import os, sys, time\n"
    "sys.stdin.buffer.readline()\n"
    "os.close(0)\n"
    'print(\'{"jsonrpc": "2.0", "method": "notifications/message", '
    '"params": {"level": "info", "data": "stopped reading"}}\', flush=True)\n'
    "time.sleep(60)\n"
)


async def test_a_server_that_stops_reading_ends_its_session_at_once() -> None:
    """Messages go straight into the server's stdin from the sender's task: a write the
    server no longer reads fails that send and ends the session's reading, without
    waiting for the process to end."""
    params = StdioServerParameters(command=sys.executable, args=["-c", _STOPS_READING])
    ping = SessionMessage(types.JSONRPCRequest(jsonrpc="2.0", id=1, method="ping"))
    with anyio.fail_after(20):
        transport = bridge.capped_stdio_transport(params, 1_000_000, bridge.ServerProcessLog("quitter"))
        async with transport as (read, write):
            await write.send(ping)
            said = await read.receive()
            assert isinstance(said, SessionMessage) and "stopped reading" in said.message.model_dump_json()
            with pytest.raises(anyio.BrokenResourceError):
                for _ in range(100):  # the first write may still fit the pipe's buffer of a closed end
                    await write.send(ping)
            with pytest.raises(anyio.EndOfStream):
                await read.receive()


# Writes a line over the cap that answers nothing (no id), then a megabyte more, then
# waits for its stdin to end and exits by itself.
_FLOODS_AFTER_AN_OVERSIZED_LINE = (
    "import sys\n"
    "out = sys.stdout.buffer\n"
    'out.write(b\'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"pad": "\''
    " + b'x' * 200000 + b'\"}}\\n')\n"
    "out.write(b'y' * 1000000 + b'\\n')\n"
    "out.flush()\n"
    "sys.stdin.buffer.read()\n"
)


async def test_after_the_session_ends_the_rest_of_a_servers_output_is_read_and_dropped() -> None:
    """An oversized line without an id ends the session; the server's later output is
    still read (and dropped), so the server is not left blocked writing and exits by itself
    once its stdin ends."""
    params = StdioServerParameters(command=sys.executable, args=["-c", _FLOODS_AFTER_AN_OVERSIZED_LINE])
    log = bridge.ServerProcessLog("flood")
    with anyio.fail_after(20):
        async with bridge.capped_stdio_transport(params, 1000, log) as (read, _):
            assert isinstance(await read.receive(), bridge.OversizedMessageError)
            with pytest.raises(anyio.EndOfStream):
                await read.receive()
            await anyio.sleep(0.5)  # the megabyte is read meanwhile, not left in the pipe
    assert log.returncode == 0, log.ending  # exited on its own: not blocked writing, not killed


async def test_a_send_stuck_on_a_server_that_reads_nothing_fails_when_its_output_ends() -> None:
    """A request the server's stdin cannot take (it reads nothing) waits to be written; once
    the server's output ends, that send fails at once (it would never be answered), not
    when the process is killed or the pipe breaks."""
    quiet = "import os, time\nos.close(1)\ntime.sleep(60)\n"  # no output, stdin left unread
    params = StdioServerParameters(command=sys.executable, args=["-c", quiet])
    big = SessionMessage(
        types.JSONRPCRequest(jsonrpc="2.0", id=1, method="ping", params={"pad": "x" * 1_000_000})
    )
    failed: list[float] = []
    with anyio.fail_after(20):
        async with bridge.capped_stdio_transport(params, 1_000_000, bridge.ServerProcessLog("quiet")) as (
            read,
            write,
        ):

            async def send_big() -> None:
                with pytest.raises(anyio.BrokenResourceError):
                    await write.send(big)
                failed.append(time.monotonic())

            async with anyio.create_task_group() as sending:
                sending.start_soon(send_big)
                await anyio.sleep(0.5)
                assert not failed  # stuck: the pipe is full
                with pytest.raises(anyio.EndOfStream):
                    await read.receive()
                ended = time.monotonic()
            assert failed and failed[0] - ended < 1.0
