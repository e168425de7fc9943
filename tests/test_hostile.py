"""Nothing the sandbox, a proxied server or a client sends may kill, freeze or bloat the
bridge. Each test drives the installed bridge through the MCP SDK's real stdio client,
on real containers, does something hostile, and asserts the property that must hold:
the call is answered, the next call works, the event loop keeps answering pings, memory
stays bounded, shutdown is prompt and leaves nothing behind.

Sandbox code reaches its raw frame channel (to the supervisor, which validates what it
forwards) as ``runtime.call_tool.__self__._requests.channel``."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.conftest import (
    REPO,
    Engine,
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
    env = hostile_env(
        engine, state_dir, home, MCP_BRIDGE_SERVER_START_TIMEOUT="3", MCP_BRIDGE_TOOL_TIMEOUT="3"
    )
    async with client_with_log(env, tmp_path / "bridge.log") as client:
        answer = await run(
            client,
            """
            from mcp import runtime
            outcomes = {"bytes": mcp_hostile.raw_bytes()}
            for name, call in (("result", mcp_hostile.surrogate), ("docs", lambda: mcp_bad_docs.surrogate)):
                try:
                    outcomes[name] = call()
                except (runtime.MCPError, AttributeError) as exc:
                    outcomes[name] = "failed: " + str(exc)
            outcomes["search"] = [hit["tool"] for hit in runtime.search_tool_docs("surrogate", 5, "summary")]
            outcomes
            """,
        )
        outcomes = eval(answer["value"])
        # Bytes that are not UTF-8 arrive replaced; JSON with lone surrogates is refused by
        # the SDK's client as invalid, so those calls fail within their timeouts.
        assert outcomes["bytes"] == "bad \ufffd\ufffd bytes", outcomes
        assert outcomes["result"].startswith("failed: "), outcomes
        assert outcomes["docs"].startswith("failed: "), outcomes
        assert outcomes["search"] == ["surrogate", "raw_bytes"][: len(outcomes["search"])], outcomes
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
        assert max(latencies) < 2.0, latencies
        await assert_still_serves(client)


# --- 4. bounded memory ------------------------------------------------------------------


async def test_many_distinct_searches_do_not_grow_bridge_memory(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"everything": {"command": real_server("everything")}})
    async with client_with_log(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        searches = """
            import random, string
            from mcp import runtime
            for _ in range(%d):
                words = ["".join(random.choice(string.ascii_lowercase) for _ in range(9)) for _ in range(50)]
                runtime.search_tool_docs(" ".join(words)[:500])
            """
        await run(client, searches % 50)  # warm-up: servers started, allocator settled
        bridge = bridge_pids(state_dir)[0]
        before = rss_kib(bridge)
        answer = await run(client, searches % 2000, timeout=120)
        assert not answer["is_error"], answer
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
        grown_mib = (rss_kib(bridge) - before) / 1024
        # A cache keyed by query text grew by over 300 MB in those 20 queries; bounded
        # work grows by a few MB at most.
        assert grown_mib < 30, grown_mib


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
                           "dropped": {{"stdout": "lots"}}, "value": 12345, "error": "str"}})
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


async def test_stdin_eof_exits_promptly_with_many_servers_configured_never_started(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub%d" % n: stub_entry() for n in range(20)})
    async with client_with_log(hostile_env(engine, state_dir, home), tmp_path / "bridge.log") as client:
        await assert_still_serves(client)
        owner = bridge_pids(state_dir)[0]
        closing = time.monotonic()
    exit_seconds = time.monotonic() - closing
    # Each never-started server used to add a 10 s wait.
    assert exit_seconds < 5, exit_seconds
    assert engine.containers(running_only=False, owner_pid=owner) == []


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
        assert exit_seconds < 4, exit_seconds
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
