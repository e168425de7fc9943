"""Nothing the sandbox, a proxied server or a client sends may kill, freeze or bloat the
bridge. Each test drives the installed bridge through the MCP SDK's real stdio client,
on real containers, does something hostile, and asserts the property that must hold:
the call is answered, the next call works, the event loop keeps answering pings, memory
stays bounded, shutdown is prompt and leaves nothing behind. (The shutdown tests drive the
bridge by hand over stdin, to time an exit on EOF; the last section hands the bridge's
own checks hostile frames directly, without a supervisor in front.)

Sandbox code reaches its raw frame channel (to the supervisor, which validates what it
forwards) as ``runtime.call_tool.__self__._requests.channel``."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import FailedTool, FrameDecoder
from tests.conftest import (
    REPO,
    Engine,
    bridge_client,
    bridge_env,
    bridge_pids,
    claude_desktop_home,
    console_script,
    proxy_env,
    real_server,
    run_cell,
    stub_entry,
    text_of,
)

pytestmark = pytest.mark.anyio

HOSTILE_SERVER = REPO / "tests" / "servers" / "hostile_server.py"
CHANNEL = "runtime.call_tool.__self__._requests.channel"
# The executor object of this session (its running execute id is what a forged result needs).
KERNEL = "[o for o in __import__('gc').get_objects() if type(o).__name__ == 'ExecutorProcess'][0]"


def hostile_env(
    engine: Engine, state_dir: Path, home: Path | None = None, **overrides: str
) -> dict[str, str]:
    return proxy_env(engine, state_dir, home or state_dir, **overrides)


@asynccontextmanager
async def client_with_log(env: dict[str, str], log: Path) -> AsyncIterator[ClientSession]:
    """The installed bridge behind the SDK's stdio client, its stderr (the log) in `log`."""
    with log.open("w") as errlog:
        params = StdioServerParameters(command=console_script(), env=env)
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


run = run_cell


async def assert_still_serves(client: ClientSession) -> None:
    answer = await run(client, "6 * 7")
    assert not answer["is_error"] and answer["value"] == "42", answer


async def run_while_pinging(
    client: ClientSession, code: str, timeout: float = 60
) -> tuple[dict[str, Any], list[float]]:
    """One run_python call while the client pings the bridge every 0.1 s: the answer and
    each ping's latency (a ping waits as long as the bridge's event loop is held)."""
    latencies: list[float] = []
    done = anyio.Event()

    async def ping_until_done() -> None:
        while not done.is_set():
            started = time.monotonic()
            await client.send_ping()
            latencies.append(time.monotonic() - started)
            with anyio.move_on_after(0.1):
                await done.wait()

    async with anyio.create_task_group() as group:
        group.start_soon(ping_until_done)
        try:
            answer = await run(client, code, timeout=timeout)
        finally:
            done.set()
    return answer, latencies


def rss_kib(pid: int) -> int:
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS for pid %d" % pid)


# --- 1. lone surrogates -------------------------------------------------------------


async def test_lone_surrogates_in_results_never_break_the_server(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        raised = await run(client, "raise ValueError('\\udcff')")
        assert raised["status"] == "error" and "\\udcff" in raised["error"]["message"], raised
        valued = await run(
            client,
            """
            class Odd:
                def __repr__(self):
                    return 'v\\udcff'
            Odd()
            """,
        )
        assert valued["value"] == "v\\udcff", valued
        # By accident: a file name that is not UTF-8, from os.listdir, in an error message.
        listed = await run(
            client,
            """
            import os
            open(b'/tmp/name-\\xff', 'w').close()
            name = [n for n in os.listdir('/tmp') if n.startswith('name-')][0]
            print(name)
            raise FileNotFoundError(name)
            """,
        )
        assert listed["status"] == "error" and "name-\\udcff" in listed["error"]["message"], listed
        assert "name-" in listed["stdout"]
        await assert_still_serves(client)


async def test_a_proxied_server_sending_lone_surrogates_or_bad_bytes_cannot_break_the_server(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    hostile = {"command": sys.executable, "args": [str(HOSTILE_SERVER)]}
    bad_docs = {"command": sys.executable, "args": [str(HOSTILE_SERVER), "--bad-docs"]}
    home = claude_desktop_home(tmp_path, {"hostile": hostile, "bad_docs": bad_docs})
    # Long timeouts: a message the bridge could not read used to leave its request
    # unanswered until the timeout; each call must now be answered at once.
    env = hostile_env(
        engine, state_dir, home, MCP_BRIDGE_SERVER_START_TIMEOUT="120", MCP_BRIDGE_TOOL_TIMEOUT="120"
    )
    async with client_with_log(env, tmp_path / "bridge.log") as client:
        await assert_still_serves(client)  # the sandbox is up: what follows is the proxy's time
        started = time.monotonic()
        answer = await run(
            client,
            """
            from mcp import runtime
            doc = runtime.query_tool_docs("bad_docs", "surrogate", "full")
            outcomes = {
                "bytes": mcp_hostile.raw_bytes(),
                "result": mcp_hostile.surrogate(),
                "docs": mcp_bad_docs.surrogate(),
                "doc": doc[0]["description"] if isinstance(doc, list) else doc["description"],
                "invalid": [],
            }
            for name in ("no_result", "bad_version"):
                try:
                    runtime.call_tool("hostile", name, {})
                except runtime.MCPError as exc:
                    outcomes["invalid"].append(str(exc))
            outcomes["search"] = [hit["tool"] for hit in runtime.search_tool_docs("surrogate", 5, "summary")]
            outcomes
            """,
        )
        elapsed = time.monotonic() - started
        outcomes = eval(answer["value"])
        # Bytes that are not UTF-8 arrive replaced; lone surrogates (valid JSON escapes
        # the SDK's validator refuses) are written out as text, in results and in docs.
        assert outcomes["bytes"] == "bad \ufffd\ufffd bytes", outcomes
        assert outcomes["result"] == "bad \\udcff text", outcomes
        assert outcomes["docs"] == "bad \\udcff text", outcomes
        assert "lone surrogate \\udcff in it" in outcomes["doc"], outcomes
        # An answer that is not valid MCP even then fails its call at once.
        assert len(outcomes["invalid"]) == 2, outcomes
        for message in outcomes["invalid"]:
            assert "answered the call to" in message and "not valid MCP" in message, outcomes
        assert "surrogate" in outcomes["search"], outcomes
        assert elapsed < 10, elapsed
        await assert_still_serves(client)


# --- 2. frames with huge or malformed ids ---------------------------------------------


async def test_a_request_with_a_huge_id_is_dropped_and_the_server_survives(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        answer = await run(
            client,
            f"""
            from mcp import runtime
            channel = {CHANNEL}
            channel.send({{"type": "request", "id": [0] * 11_500_000, "method": "capability_summary",
                          "params": {{}}}})
            channel.send({{"type": "request", "id": "x" * 100_000, "method": "capability_summary",
                          "params": {{}}}})
            channel.send({{"type": "request", "id": "ok-id", "method": ["not", "a", "name"], "params": 1}})
            channel.send({{"type": "cancel", "id": {{"nested": "object"}}}})
            channel.send({{"type": "stream", "id": 1.5, "name": "stdout", "text": 3}})
            "sent"
            """,
        )
        assert answer["value"] == "'sent'", answer
        assert any("rejected" in notice for notice in answer["notices"]), answer["notices"]
        await assert_still_serves(client)
        # The id-valid malformed request was answered, so nothing in the sandbox waits forever.
        probe = await run(client, "runtime.capability_summary()[:20]")
        assert not probe["is_error"], probe


async def test_a_deeply_nested_or_endless_frame_is_rejected_and_the_server_survives(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        answer = await run(
            client,
            f"""
            import os
            channel = {CHANNEL}
            nested = b'{{"type":"request","id":"x","method":"list_tools","params":{{"server":'
            os.write(channel.out_fd, nested + b"[" * 200_000 + b"]" * 200_000 + b"}}}}\\n")
            os.write(channel.out_fd, b"not json at all\\n" + b"x" * (40 * 1024 * 1024) + b"\\n")
            "survived"
            """,
        )
        assert answer["value"] == "'survived'", answer
        assert any("rejected" in notice for notice in answer["notices"]), answer["notices"]
        await assert_still_serves(client)


async def test_a_flood_of_request_frames_cannot_wedge_the_bridge(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        for _ in range(3):
            flood = await run(
                client,
                f"""
                channel = {CHANNEL}
                for n in range(10_000):
                    channel.send({{"type": "request", "id": "f%d" % n, "method": "capability_summary",
                                  "params": {{}}}})
                "flooded"
                """,
                timeout=30,
            )
            assert flood["status"] in ("ok", "timeout"), flood
            await assert_still_serves(client)


async def test_tool_arguments_a_server_would_choke_on_are_refused_and_the_server_stays_up(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"everything": {"command": real_server("everything")}})
    async with client_with_log(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        answer = await run(
            client,
            """
            from mcp import runtime
            refusals = []
            nested = "deep"
            for _ in range(500):
                nested = [nested]
            for message in ("a\\udcffb", nested):
                try:
                    mcp_everything.echo(message=message)
                except runtime.MCPError as exc:
                    refusals.append(str(exc))
            (refusals, mcp_everything.echo(message="still up"))
            """,
        )
        refusals, echoed = eval(answer["value"])
        assert "not valid Unicode" in refusals[0] and "nested deeper than" in refusals[1], refusals
        assert "still up" in str(echoed), echoed
        assert not any("restarted" in notice for notice in answer["notices"]), answer["notices"]


# --- 3. a search cannot freeze the bridge ---------------------------------------------


async def test_a_huge_search_is_refused_and_searches_never_freeze_the_event_loop(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"everything": {"command": real_server("everything")}})
    async with client_with_log(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        refused = await run(
            client,
            """
            from mcp import runtime
            query = " ".join("w%dq" % i for i in range(150_000))  # about 1 MB of distinct words
            try:
                runtime.search_tool_docs(query)
            except runtime.MCPError as exc:
                message = str(exc)
            message
            """,
        )
        assert "at most 500 characters" in refused["value"], refused
        # The worst a search may ask within the caps, from 64 threads at once, while the
        # client pings the bridge and the run's own timeout must still hold.
        flood = """
            import threading, random, string
            from mcp import runtime
            def search():
                words = ["".join(random.choice(string.ascii_lowercase) for _ in range(8)) for _ in range(55)]
                while True:
                    try:
                        runtime.search_tool_docs(" ".join(words)[:500], limit=50)
                    except Exception:
                        pass
            for _ in range(64):
                threading.Thread(target=search, daemon=True).start()
            import time
            time.sleep(60)
            """
        latencies: list[float] = []
        timeout = 4.0
        async with anyio.create_task_group() as group:

            async def ping_while_running() -> None:
                await anyio.sleep(1.0)
                for _ in range(10):
                    started = time.monotonic()
                    await client.send_ping()
                    latencies.append(time.monotonic() - started)
                    await anyio.sleep(0.2)

            group.start_soon(ping_while_running)
            started = time.monotonic()
            answer = await run(client, flood, timeout=timeout)
            elapsed = time.monotonic() - started
        assert answer["status"] == "timeout", answer
        # The timeout held (plus the interrupt grace and slack for a loaded machine);
        # before the fix one search held the event loop for minutes.
        assert elapsed < timeout + 3 + 10, elapsed
        # Measured: at most 0.08 s on a shared 2-core machine (load average 20-30).
        assert max(latencies) < 1.0, latencies
        await assert_still_serves(client)


async def test_large_tool_arguments_are_capped_and_never_hold_the_event_loop(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with client_with_log(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        await run(client, "mcp_stub.pair(a=1)")  # the server is started
        answer, latencies = await run_while_pinging(
            client,
            f"""
            from mcp import runtime
            outcomes = []
            for arguments in (
                {{"text": "x" * 15_000_000}},  # a 15 MB request, under the 16 MiB cap
                {{"items": [[]] * {bridge.MAX_ARGUMENT_VALUES - 10}}},  # costliest values, under the cap
                {{"text": "y" * 20_000_000}},  # over the cap
                {{"items": [0] * 6_000_000}},  # the issue's 12 MB of small values
                {{"items": [[]] * {bridge.MAX_ARGUMENT_VALUES + 10}}},
            ):
                try:
                    outcomes.append(str(runtime.call_tool("stub", "measure", arguments)))
                except runtime.MCPError as exc:
                    outcomes.append("refused: " + str(exc)[:300])
            outcomes
            """,
            timeout=120,
        )
        assert answer["status"] == "ok", answer
        outcomes = eval(answer["value"])
        under = "text 0 items %d" % (bridge.MAX_ARGUMENT_VALUES - 10)
        assert "text 15000000 items 0" in outcomes[0] and under in outcomes[1], outcomes
        assert "over the 16777216-byte cap for a request to the host" in outcomes[2], outcomes
        for over in outcomes[3:]:
            assert "refused: Tool arguments hold more than 250000 values" in over, outcomes
        # Before the fix the 12 MB call alone held the event loop for about 3 s on an idle
        # machine (its arguments were walked on it); decoding, checking and measuring now
        # run in worker threads, and what the SDK serializes on the loop is bounded by the
        # caps (about 0.3 s, which three test workers on two cores stretched to 1.16 s).
        assert len(latencies) >= 5 and max(latencies) < 2.0, latencies
        await assert_still_serves(client)


# --- 4. bounded memory ------------------------------------------------------------------


async def test_many_distinct_searches_do_not_grow_bridge_memory(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # The bridge's own memory: the same on every runtime, so measured on the first only.
    home = claude_desktop_home(tmp_path, {"everything": {"command": real_server("everything")}})
    # 4,000 searches may take longer than respond_after on a loaded machine: wait for the end.
    env = hostile_env(proxy_engine, state_dir, home, MCP_BRIDGE_RESPOND_AFTER="0")
    async with client_with_log(env, tmp_path / "bridge.log") as client:
        searches = """
            import random, string, threading
            from mcp import runtime
            def search(count):
                for _ in range(count):
                    words = ["".join(random.choices(string.ascii_lowercase, k=9)) for _ in range(50)]
                    runtime.search_tool_docs(" ".join(words)[:500])
            threads = [threading.Thread(target=search, args=(%d,)) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            """
        await run(client, searches % 25)  # warm-up: servers started, allocator settled
        bridge_pid = bridge_pids(state_dir)[0]
        before = rss_kib(bridge_pid)
        answer = await run(client, searches % 1000, timeout=300)
        assert answer["status"] == "ok", answer
        huge = await run(
            client,
            """
            from mcp import runtime
            refused = 0
            for n in range(20):  # the issue's reproduction: 1 MB queries of distinct words
                try:
                    runtime.search_tool_docs(" ".join("q%d_%d" % (n, i) for i in range(100_000)))
                except runtime.MCPError:
                    refused += 1
            refused
            """,
        )
        assert huge["value"] == "20", huge
        grown_mib = (rss_kib(bridge_pid) - before) / 1024
        # 4000 distinct 500-character queries. A cache keyed by query text holds 4-7 KB per
        # query (the text and its stems or terms), so a 16384-entry one (64-110 MB when
        # full) grows by 16-29 MB here: an lru_cache(16384) put back on query_terms grew
        # the bridge by 29 MB in this test. Without one it grows by 0.3 MB. (The issue's
        # cache grew by over 300 MB on the 20 huge queries, which are now refused.)
        assert grown_mib < 8, grown_mib


# --- 5. malformed result frames ----------------------------------------------------------


async def test_a_malformed_result_frame_is_rejected_and_the_session_survives(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        await run(client, "kept = 'yes'")
        forged = await run(
            client,
            f"""
            from mcp import runtime
            kernel = {KERNEL}
            {CHANNEL}.send({{"type": "result", "id": kernel.running_id, "status": "ok",
                           "cut": {{"stdout": "lots"}}, "value": 12345, "error": "str"}})
            "real result"
            """,
        )
        # Wrong field types never get past the supervisor: the call ends with its own
        # result, and says that a frame was rejected.
        assert forged["status"] == "ok" and forged["value"] == "'real result'", forged
        assert any("rejected" in notice for notice in forged["notices"]), forged
        assert "internal" not in forged["text"], forged
        after = await run(client, "kept")
        assert after["value"] == "'yes'", after


# --- 6. oversized tool-call arguments ------------------------------------------------------


async def test_oversized_tool_arguments_fail_at_once_instead_of_hanging(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env = hostile_env(
        engine,
        state_dir,
        MCP_BRIDGE_MAX_FRAME_BYTES=str(1024 * 1024),
        MCP_BRIDGE_MAX_TOOL_RESULT_BYTES=str(256 * 1024),
    )
    async with client_with_log(env, tmp_path / "bridge.log") as client:
        answer = await run(
            client,
            """
            from mcp import runtime
            try:
                runtime.call_tool("anything", "echo", {"message": "x" * 2_000_000})
            except runtime.MCPError as exc:
                message = str(exc)
            message
            """,
            timeout=30,
        )
        # Before the fix the call waited for the run's timeout (status "timeout").
        assert answer["status"] == "ok", answer
        assert "too large to send" in answer["value"], answer


# --- 7. sandbox request arguments ----------------------------------------------------------


async def test_bad_sandbox_request_arguments_are_clear_errors_without_log_floods(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "bridge.log"
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    async with client_with_log(hostile_env(engine, state_dir, home), log) as client:
        answer = await run(
            client,
            f"""
            from mcp import runtime
            errors = []
            for call in (
                lambda: runtime.list_tools(server=["x"]),
                lambda: runtime.search_tool_docs("time", limit="many"),
                lambda: runtime.query_tool_docs("stub", detail="everything"),
                lambda: runtime.call_tool("stub", "pair", ["not", "a", "dict"]),
            ):
                try:
                    call()
                except runtime.MCPError as exc:
                    errors.append(str(exc))
            for n in range(200):  # the same mistake, many times
                try:
                    {CHANNEL}.send({{"type": "request", "id": "bad%d" % n, "method": "nope", "params": {{}}}})
                    runtime.search_tool_docs(123)
                except runtime.MCPError:
                    pass
            errors
            """,
        )
        errors = eval(answer["value"])
        assert len(errors) == 4, errors
        assert errors[0].startswith("Bad arguments for runtime.list_tools: server:"), errors
        assert "runtime.search_tool_docs: limit:" in errors[1], errors
        assert "runtime.query_tool_docs: detail:" in errors[2], errors
        assert "runtime.call_tool: arguments:" in errors[3], errors
        assert not any("internal" in error for error in errors), errors
        await assert_still_serves(client)
    text = log.read_text()
    assert "Traceback" not in text and "internal bridge error" not in text, text[-3000:]


# --- 8. shutdown ------------------------------------------------------------------------------


class RawClient:
    """The installed bridge driven by hand, one JSON-RPC message per line. Unlike the
    SDK's client it can close stdin with a call in flight and still read the answers,
    and it times the exit itself (the SDK's client sends SIGTERM 2 s after closing stdin,
    which would hide a slow exit on EOF)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)

    async def send(self, message: dict[str, Any]) -> None:
        await self.stdin.send(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")

    async def answer(self, request_id: int) -> dict[str, Any]:
        with anyio.fail_after(120):
            while True:
                message = json.loads(await self.stdout.receive_until(b"\n", 1 << 26))
                if message.get("id") == request_id:
                    return dict(message)

    async def call(self, request_id: int, code: str) -> None:
        arguments = {"code": textwrap.dedent(code), "timeout": 90}
        await self.send(
            {
                "id": request_id,
                "method": "tools/call",
                "params": {"name": "run_python", "arguments": arguments},
            }
        )

    async def close_stdin(self) -> float:
        """Close stdin; the seconds until the bridge has exited."""
        closed = time.monotonic()
        await self.stdin.aclose()
        with anyio.fail_after(30):
            while self.process.returncode is None:
                await anyio.sleep(0.01)
        return time.monotonic() - closed


@asynccontextmanager
async def raw_client(env: dict[str, str], log: Path) -> AsyncIterator[RawClient]:
    with log.open("w") as errlog:
        async with await anyio.open_process([console_script()], env=env, stderr=errlog) as process:
            client = RawClient(process)
            initialize = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw"}}
            await client.send({"id": 0, "method": "initialize", "params": initialize})
            await client.answer(0)
            await client.send({"method": "notifications/initialized"})
            try:
                yield client
            finally:
                if process.returncode is None:
                    process.kill()


@pytest.mark.parametrize("started", [False, True], ids=["none-started", "one-started"])
async def test_stdin_eof_exits_promptly_with_many_servers_configured(
    engine: Engine, state_dir: Path, tmp_path: Path, started: bool
) -> None:
    home = claude_desktop_home(tmp_path, {"stub%d" % n: stub_entry() for n in range(20)})
    async with raw_client(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        await client.call(1, "mcp_stub0.pair(a=1)" if started else "6 * 7")
        answer = await client.answer(1)
        assert not answer["result"]["isError"], answer
        owner = client.process.pid
        servers = [pid for pid in _pids_with("stub_server.py") if _parent_of(pid) == owner]
        assert len(servers) == int(started), servers
        exit_seconds = await client.close_stdin()
    # Each never-started server used to add a 10 s wait; a started one is stopped
    # (stdin closed, then SIGTERM, SIGKILL) within 2 s. Measured 0.4 s on an idle machine,
    # up to 3.9 s under load (mostly the interpreter's own shutdown): the bound is below
    # one such wait, not a speed target.
    assert exit_seconds < 8, exit_seconds
    assert not [pid for pid in servers if Path("/proc/%d" % pid).exists()], servers
    assert engine.containers(running_only=False, owner_pid=owner) == []


async def test_stdin_eof_mid_call_answers_the_call_and_exits_promptly_leaving_no_container(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with raw_client(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        await client.call(1, "6 * 7")
        await client.answer(1)  # the sandbox is up
        owner = client.process.pid
        await client.call(2, "import time\ntime.sleep(60)")
        await anyio.sleep(1.0)  # the call is running in the sandbox
        exit_seconds = await client.close_stdin()
        answer = await client.answer(2)
    # The client learns the call is over (the MCP SDK answers "Connection closed").
    assert "error" in answer or answer["result"]["isError"], answer
    assert exit_seconds < 8, exit_seconds  # not the call's 60 s, nor a client's SIGTERM (none is sent)
    assert engine.containers(running_only=False, owner_pid=owner) == []


def _pids_with(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _parent_of(pid: int) -> int:
    try:
        return int(Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


async def test_sigterm_mid_call_answers_the_call_and_exits_promptly_leaving_no_container(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        await assert_still_serves(client)
        owner = bridge_pids(state_dir)[0]
        answers: list[dict[str, Any]] = []

        async def long_call() -> None:
            # Answered by the shutdown (a bridge error, no structuredContent) or by the
            # abandoned run's outcome, whichever comes first: both say why.
            result = await client.call_tool(
                "run_python", {"code": "import time\ntime.sleep(60)", "timeout": 90}
            )
            answers.append({"is_error": result.is_error, "text": text_of(result)})

        async with anyio.create_task_group() as group:
            group.start_soon(long_call)
            await anyio.sleep(1.0)  # the call is running in the sandbox
            signalled = time.monotonic()
            os.kill(owner, signal.SIGTERM)
            with anyio.fail_after(10):
                while answers == []:
                    await anyio.sleep(0.02)
        answered_seconds = time.monotonic() - signalled
        assert answers[0]["is_error"] is True
        assert "shutting down" in answers[0]["text"], answers[0]
        assert answered_seconds < 2, answered_seconds
        deadline = time.monotonic() + 10
        while owner in bridge_pids(state_dir) and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        exit_seconds = time.monotonic() - signalled
        assert owner not in bridge_pids(state_dir)
        assert exit_seconds < 2, exit_seconds
    assert engine.containers(running_only=False, owner_pid=owner) == []


# --- 11. the kernel's own errors ----------------------------------------------------------------


async def test_the_kernels_reason_for_stopping_reaches_the_model(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async with client_with_log(hostile_env(engine, state_dir), tmp_path / "bridge.log") as client:
        died = await run(
            client,
            f"""
            import os
            from mcp import runtime
            {CHANNEL}.send({{"type": "error", "message": "kernel stopped: the channel broke (simulated)"}})
            os._exit(0)
            """,
        )
        assert died["status"] == "crashed", died
        assert "it reported: kernel stopped: the channel broke (simulated)" in died["text"], died
        assert "exited with code 0" in died["text"], died
        fresh = await run(client, "1 + 1")
        assert fresh["value"] == "2", fresh


# --- the bridge's own checks, driven directly -------------------------------------------
# The supervisor validates what the code sends before passing it on; the bridge checks
# every frame again. These tests hand the bridge's session hostile frames themselves,
# without a supervisor in front, and prove that second line holds on its own.


class RecordingStdin:
    """The container's stdin as the session sees it: records every frame sent."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.broken = False

    async def send(self, data: bytes) -> None:
        if self.broken:
            raise anyio.BrokenResourceError
        self.data += data

    def frames(self) -> list[dict[str, Any]]:
        return FrameDecoder(1 << 26).feed(bytes(self.data))


class FakeProcess:
    def __init__(self) -> None:
        self.stdin = RecordingStdin()
        self.returncode: int | None = None


class FakeHost:
    """Serves requests the way a test needs: some hold, one fails with a bug."""

    def server_list(self) -> list[dict[str, str]]:
        return []

    def config_problems(self) -> list[str]:
        return []

    def defined_tools_notice(self, names: Sequence[str]) -> str | None:
        return None

    async def quarantine_tools(self, failed: Sequence[FailedTool]) -> list[str]:
        return []

    async def handle(self, method: str, params: Mapping[str, object], run: object) -> Any:
        if method == "boom":
            raise RuntimeError("a bug in the bridge")
        if method == "hold":
            await anyio.sleep(3600)
        if method == "huge":
            return "x" * (2 << 20)  # an answer larger than a frame
        if method == "unserializable":
            return {"value": object()}
        if method == "deep":  # encoding it raises RecursionError, whatever the Python
            value: Any = []
            for _ in range(100_000):
                value = [value]
            return value
        return {"served": method}


CAP = 256 * 1024


def direct_session(tmp_path: Path) -> tuple[bridge.Sandbox, RecordingStdin]:
    config = bridge.BridgeConfig(state_dir=tmp_path, max_frame_bytes=1 << 20, max_tool_result_bytes=CAP)
    runtime = bridge.PodmanEngine("/nonexistent/podman")
    session = bridge.Sandbox(runtime, config, tmp_path / "ipc", FakeHost())
    process = FakeProcess()
    session.process = process  # type: ignore[assignment]
    session.pending = bridge.PendingExecute("e1", 10_000)
    return session, process.stdin


async def answers(stdin: RecordingStdin, count: int) -> dict[Any, dict[str, Any]]:
    """The responses sent so far, by id, once there are `count` of them."""
    with anyio.fail_after(10):
        while len(frames := stdin.frames()) < count:
            await anyio.sleep(0.01)
    return {frame["id"]: frame for frame in frames}


async def test_an_execute_on_a_sandbox_that_already_ended_answers_at_once(tmp_path: Path) -> None:
    # Between a session's alive check and its execute the container may end; nothing would
    # then end the execute but its timeout (and the interrupt's grace after it).
    session, _ = direct_session(tmp_path)
    session.pending = None
    session.exit.ended(137)
    session.exited.set()
    with anyio.fail_after(3):
        outcome = await session.execute("1", timeout=30)
    assert outcome.status == "crashed" and not outcome.state_kept


async def test_the_bridge_rejects_hostile_frames_without_the_supervisor(tmp_path: Path) -> None:
    session, stdin = direct_session(tmp_path)
    async with anyio.create_task_group() as group:
        session.desk.task_group = group
        hostile: list[dict[str, Any]] = [
            # ids that are not short strings or integers: dropped, never echoed back
            {"type": "request", "id": [0] * 1_000_000, "method": "capability_summary", "params": {}},
            {"type": "request", "id": "x" * 100_000, "method": "capability_summary", "params": {}},
            {"type": "request", "id": True, "method": "capability_summary", "params": {}},
            {"type": "request", "id": 2**60, "method": "capability_summary", "params": {}},
            {"type": "cancel", "id": {"nested": "object"}},
            {"type": "stream", "id": 1.5, "name": "stdout", "text": 3},
            {"type": "stream", "id": "e1", "name": "stdin", "text": "not a stream"},
            {"type": "no such type"},
            {"type": "execute", "id": "e2", "code": "sent the wrong way"},
            {"type": "error", "message": ["not", "text"]},
            # a valid id: answered with an error, so nothing in the sandbox waits forever
            {"type": "request", "id": "bad-method", "method": ["not", "a", "name"], "params": 1},
            {"type": "request", "id": "bad-params", "method": "list_tools", "params": "a string"},
            # well-formed, but the host fails, or its answer cannot be sent
            {"type": "request", "id": "bug", "method": "boom", "params": {}},
            {"type": "request", "id": "too-big", "method": "huge", "params": {}},
            {"type": "request", "id": "not-json", "method": "unserializable", "params": {}},
            {"type": "request", "id": 7, "method": "capability_summary", "params": {}},
        ]
        for frame in hostile:
            await session._dispatch(frame, 100)
        sent = await answers(stdin, 6)
        group.cancel_scope.cancel()
    assert set(sent) == {"bad-method", "bad-params", "bug", "too-big", "not-json", 7}, list(sent)
    assert (
        "the request was malformed: request frame: field 'method'" in sent["bad-method"]["error"]["message"]
    )
    assert "field 'params' must be an object" in sent["bad-params"]["error"]["message"]
    assert sent["bug"]["error"]["message"].startswith("internal bridge error (RuntimeError)")
    for request_id in ("too-big", "not-json"):
        message = sent[request_id]["error"]["message"]
        assert message.startswith("the answer could not be sent into the sandbox"), message
    assert sent[7] == {"type": "response", "id": 7, "result": {"served": "capability_summary"}}
    assert session.malformed_frames == 12
    assert session.desk.in_flight == 0 and session.desk.request_bytes == 0 and session.desk.requests == {}
    assert session.pending is not None and session.pending.result is None  # no frame ended the call


async def test_an_answer_that_cannot_be_encoded_still_gets_one_error_answer(tmp_path: Path) -> None:
    session, stdin = direct_session(tmp_path)
    async with anyio.create_task_group() as group:
        session.desk.task_group = group
        await session._dispatch({"type": "request", "id": "deep", "method": "deep", "params": {}}, 100)
        await session._dispatch({"type": "request", "id": "after", "method": "other", "params": {}}, 100)
        sent = await answers(stdin, 2)  # at once: the code waiting for it must not wait its timeout
        group.cancel_scope.cancel()
    message = sent["deep"]["error"]["message"]
    assert message.startswith("the answer could not be sent into the sandbox: RecursionError"), message
    assert sent["after"]["result"] == {"served": "other"}
    assert session.desk.in_flight == 0 and session.desk.requests == {}


@pytest.mark.parametrize(
    "forged",
    [
        {"cut": {"stdout": "lots"}},
        {"value": 12345},
        {"error": "str"},
        {"status": "finished"},
        {"notices": "one"},
        {"images": [{"mime_type": "image/png", "data": 5}]},
    ],
)
async def test_a_result_with_bad_field_types_fails_the_call_at_once(
    tmp_path: Path, forged: dict[str, Any]
) -> None:
    session, _ = direct_session(tmp_path)
    pending = session.pending
    assert pending is not None
    # A result for another execute is ignored; one for this execute with a bad field
    # ends the call with a protocol error instead of letting it wait for a result.
    await session._dispatch({"type": "result", "id": "other", "status": "ok", **forged})
    assert pending.result is None
    await session._dispatch({"type": "result", "id": "e1", "status": "ok", **forged})
    assert pending.done.is_set() and pending.result is not None
    error = pending.result["error"]
    assert error["type"] == "ProtocolError" and "malformed result" in error["message"], error


async def test_large_requests_are_refused_beyond_the_cap_alone_or_together(tmp_path: Path) -> None:
    session, stdin = direct_session(tmp_path)
    async with anyio.create_task_group() as group:
        session.desk.task_group = group
        await session._dispatch(
            {"type": "request", "id": "over", "method": "call_tool", "params": {}}, CAP + 1
        )
        await session._dispatch({"type": "request", "id": "held", "method": "hold", "params": {}}, CAP // 2)
        await session._dispatch(
            {"type": "request", "id": "more", "method": "hold", "params": {}}, CAP // 2 + 1
        )
        await session._dispatch({"type": "request", "id": "small", "method": "echo", "params": {}}, 100)
        sent = await answers(stdin, 3)
        assert session.desk.request_bytes == CAP // 2  # "held" is still in flight
        session.cancel_requests()
        sent = await answers(stdin, 4)
        group.cancel_scope.cancel()
    assert (
        "runtime.call_tool: the request is %d bytes, over the %d-byte cap" % (CAP + 1, CAP)
        in (sent["over"]["error"]["message"])
    )
    assert "requests still in flight hold %d bytes" % (CAP // 2) in sent["more"]["error"]["message"]
    assert "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES" in sent["more"]["error"]["message"]
    assert sent["small"]["result"] == {"served": "echo"}
    assert sent["held"]["error"]["message"].startswith("cancelled")
    assert session.desk.request_bytes == 0 and session.desk.in_flight == 0


async def test_an_answer_to_a_sandbox_that_is_gone_never_raises(tmp_path: Path) -> None:
    session, stdin = direct_session(tmp_path)
    stdin.broken = True
    await session.desk.respond("r1", result={"ok": True})
    await session.desk.respond("r2", result="x" * (2 << 20))  # too big, then the fallback fails too
    await session.desk.respond([0] * 10, error="an id that is not an id")  # type: ignore[arg-type]
    assert stdin.data == b""


def test_tool_arguments_over_the_value_cap_are_refused_without_walking_them() -> None:
    arguments = {"items": [0] * 6_000_000}  # the 12 MB request
    started = time.monotonic()
    with pytest.raises(bridge.ProxyError, match="more than 250000 values"):
        bridge.check_tool_arguments(arguments)
    assert time.monotonic() - started < 0.5  # refused by its length, not by visiting 6M values
    bridge.check_tool_arguments({"items": [[]] * (bridge.MAX_ARGUMENT_VALUES - 10)})
    with pytest.raises(bridge.ProxyError, match="more than 250000 values"):
        bridge.check_tool_arguments({"keys": {str(n): n for n in range(bridge.MAX_ARGUMENT_VALUES // 2)}})


def test_nothing_keyed_by_sandbox_text_is_cached() -> None:
    """A cache keyed by query text grew the bridge by 300 MB (issue 6, item 4). The search
    functions, which take the sandbox's text, keep no cache, and every cache in the bridge
    and the kernel takes no arguments at all (so nothing the sandbox sends can key it)."""
    import inspect

    import mcp_sandbox_kernel

    for function in (
        bridge._tokens,
        bridge._stem,
        bridge.query_terms,
        bridge.query_intent,
        bridge.search_terms,
        bridge._similarity,
        bridge.rank_tools,
        bridge.search_tools,
    ):
        assert not hasattr(function, "cache_info"), function
    cached = []
    for module in (bridge, mcp_sandbox_kernel):
        members = list(vars(module).values())
        members += [
            member
            for value in vars(module).values()
            if isinstance(value, type) and value.__module__ == module.__name__
            for member in vars(value).values()
        ]
        for member in members:
            function = getattr(member, "__func__", member)  # staticmethod, classmethod
            if hasattr(function, "cache_info") and hasattr(function, "__wrapped__"):
                cached.append(function)
                assert not inspect.signature(function.__wrapped__).parameters, function
    assert cached, "no cached functions found: the scan is broken"


class ScriptRuntime(bridge.PodmanEngine):
    """A "container" that is a local Python script: the session's real launch, reader
    and exit handling, with a kernel that misbehaves on purpose."""

    def __init__(self, script: Path) -> None:
        super().__init__(sys.executable)
        self.script = script

    def run_argv(self, spec: bridge.LaunchSpec) -> list[str]:
        return [sys.executable, str(self.script)]

    def kill_argv(self, container: str) -> list[str]:
        return ["true"]


STOPPING_KERNEL = """
import sys
sys.path.insert(0, %r)
from mcp_sandbox_kernel import PROTOCOL_VERSION, Channel

channel = Channel(0, 1, 1 << 20)
channel.key = bytes.fromhex(channel.receive()["key"])
channel.send({"type": "hello", "protocol": PROTOCOL_VERSION, "python": "3.11"})
channel.receive()  # the execute
channel.send({"type": "error", "message": "kernel stopped: the channel broke (simulated)"})
sys.exit(0)
"""


async def test_the_kernels_reason_for_stopping_reaches_the_model_from_the_reader(tmp_path: Path) -> None:
    script = tmp_path / "kernel.py"
    script.write_text(STOPPING_KERNEL % str(REPO))
    config = bridge.BridgeConfig(state_dir=tmp_path, start_timeout=30)
    host = FakeHost()
    session = bridge.Sandbox(ScriptRuntime(script), config, tmp_path / "ipc", host)
    async with anyio.create_task_group() as group:
        await session.start(group)
        outcome = await session.execute("1 + 1", timeout=30)
        await session.stop()
    # An id-less error frame, then exit code 0: the model reads the kernel's reason.
    assert outcome.status == "crashed", outcome
    assert session.death_reason == (
        "stopped (exit code 0); the kernel reported: kernel stopped: the channel broke (simulated)"
    )
    text = text_of(bridge.render_outcome(outcome, config))
    assert "the kernel reported: kernel stopped: the channel broke (simulated)" in text, text
    assert "exited unexpectedly" not in text


# Code that patches the kernel's executor so its result frame carries far more than any
# budget: 8 MB of notices, a 3 MB error message and traceback, 3 MB of "JSON value" behind
# a short repr. The supervisor passes each on as it is (within the frame cap).
INFLATED_RESULT_CELL = """
channel = runtime.call_tool.__self__._requests.channel
send = channel.send
def inflate(frame):
    if frame.get("type") == "result":
        channel.send = send
        frame.update(
            status="error", value="short", json=["y" * 1000] * 3000,
            error={"type": "Boom", "message": "m" * 3_000_000, "traceback": "t" * 3_000_000,
                   "extra": "x" * 10**6},
            notices=["n" * 1_000_000] * 8,
        )
    send(frame)
channel.send = inflate
"""


async def test_a_patched_kernel_cannot_pass_the_output_budget(engine: Engine, state_dir: Path) -> None:
    budget = bridge.BridgeConfig().max_output_chars
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool("run_python", {"code": INFLATED_RESULT_CELL})
        text = text_of(result)
        structured = json.dumps(result.structured_content, ensure_ascii=False)
        after = await run_cell(client, "1 + 1")
    # Within the one budget (markers and the bridge's own lines aside), whatever the kernel said.
    assert len(text) < budget + 1000, len(text)
    assert len(structured) < budget + 2000, len(structured)
    assert "characters of a notice cut" in text and "more notice(s) left out" in text, text[:300]
    data = result.structured_content
    assert data is not None and "characters of the message cut" in data["error"]["message"]
    assert set(data["error"]) == {"type", "message", "traceback"} and "value" not in data
    assert data["value_repr"] == "short"
    assert after["value"] == "2" and not after["is_error"], after  # the bridge is fine
