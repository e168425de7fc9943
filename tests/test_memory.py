"""Memory that survives sessions, bridge restarts and two bridges at once: real bridges
(the installed console script behind the SDK's stdio client) on real containers, one
shared state directory, and the store read back by the test itself."""

from __future__ import annotations

import os
import signal
import sqlite3
import textwrap
from pathlib import Path

import anyio
import pytest
from mcp.shared.exceptions import MCPError

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, bridge_pids, run_cell

pytestmark = pytest.mark.anyio


def store_path(state_dir: Path) -> Path:
    return state_dir / bridge.MEMORY_DIRNAME / bridge.MEMORY_FILENAME


async def test_a_memory_saved_by_one_bridge_is_there_for_the_next(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        saved = await run_cell(
            client, 'save_memory("project", {"name": "x", "n": 1}, metadata={"about": "demo"})'
        )
        assert not saved["is_error"], saved
    async with bridge_client(bridge_env(engine, state_dir)) as client:  # a new bridge process
        answer = await run_cell(
            client,
            """
            from mcp import runtime
            entries = list_memories()
            (load_memory("project"), runtime.load_memory("missing", "fallback"), memory_exists("project"),
             [(e["key"], e["metadata"], e["size"]) for e in entries])
            """,
        )
        value, fallback, exists, entries = eval(answer["value"])
        assert value == {"name": "x", "n": 1}
        assert fallback == "fallback" and exists is True
        assert entries == [("project", {"about": "demo"}, len('{"name":"x","n":1}'))]
        info = await run_cell(client, 'get_memory_info("project")')
        assert "'created'" in info["value"] and "'updated'" in info["value"], info
        deleted = await run_cell(
            client, 'delete_memory("project"), memory_exists("project"), list_memories()'
        )
        assert deleted["value"] == "(True, False, [])", deleted


async def test_memory_helpers_are_awaitable_in_code_that_uses_await(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(
            client,
            """
            import asyncio
            await save_memory("a", [1, 2])
            await asyncio.gather(*(update_memory("n", lambda v: (v or 0) + 1) for _ in range(10)))
            (await load_memory("a"), await load_memory("n"))
            """,
        )
        assert answer["value"] == "([1, 2], 10)", answer


async def test_two_bridges_updating_one_counter_lose_no_update(engine: Engine, state_dir: Path) -> None:
    # 2 bridges x 4 threads x 50 updates: every read-modify-write must land exactly once.
    cell = textwrap.dedent(
        """
        import threading
        def work():
            for _ in range(50):
                update_memory("counter", lambda v: (v or 0) + 1)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        "done"
        """
    )
    results: list[dict[str, object]] = []

    async def one_bridge() -> None:
        async with bridge_client(bridge_env(engine, state_dir)) as client:
            results.append(await run_cell(client, cell, timeout=120))

    async with anyio.create_task_group() as group:
        group.start_soon(one_bridge)
        group.start_soon(one_bridge)
    assert [result["value"] for result in results] == ["'done'", "'done'"], results
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        assert (await run_cell(client, 'load_memory("counter")'))["value"] == "400"


async def test_a_sigkilled_bridge_leaves_every_acknowledged_write(engine: Engine, state_dir: Path) -> None:
    acknowledged: list[int] = []
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, "1")
        owner = bridge_pids(state_dir)[0]

        async def writer() -> None:
            for n in range(10_000):
                try:
                    result = await run_cell(
                        client, 'save_memory("k%d", {"n": %d, "pad": "x" * 1000})' % (n, n)
                    )
                except MCPError:  # the kill lands while a call is in flight: "Connection closed"
                    return
                if result["is_error"]:
                    return
                acknowledged.append(n)

        with anyio.move_on_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(writer)
                while len(acknowledged) < 20:
                    await anyio.sleep(0.01)
                os.kill(owner, signal.SIGKILL)
                with anyio.move_on_after(10):
                    while owner in bridge_pids(state_dir):
                        await anyio.sleep(0.02)
                group.cancel_scope.cancel()
    assert len(acknowledged) >= 20
    database = sqlite3.connect(store_path(state_dir))
    try:
        assert database.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        keys = {row[0] for row in database.execute("SELECT key FROM memories")}
    finally:
        database.close()
    assert {"k%d" % n for n in acknowledged} <= keys


async def test_bad_memory_input_is_refused_clearly_and_changes_nothing(
    engine: Engine, state_dir: Path
) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MAX_MEMORY_BYTES=str(1024 * 1024))
    async with bridge_client(env) as client:
        await run_cell(client, 'save_memory("kept", 1)')
        answer = await run_cell(
            client,
            """
            import socket
            from mcp import runtime
            attempts = {
                "set": lambda: save_memory("x", {1, 2}),
                "socket": lambda: save_memory("x", socket.socket()),
                "2 MiB": lambda: save_memory("x", "y" * (2 * 1024 * 1024)),
                "empty key": lambda: save_memory("", 1),
                "newline key": lambda: save_memory("a\\nb", 1),
                "long key": lambda: save_memory("k" * 10_000, 1),
                "fn raises": lambda: update_memory("kept", lambda v: 1 / 0),
            }
            requests = runtime.call_tool.__self__._requests
            forged = {
                "key type": {"key": 5, "value": 1},
                "metadata type": {"key": "x", "value": 1, "metadata": [1]},
                "version type": {"key": "x", "value": 1, "version": "1"},
                "extra field": {"key": "x", "value": 1, "other": 1},
            }
            outcomes = {}
            for name, attempt in attempts.items():
                try:
                    attempt()
                    outcomes[name] = "accepted"
                except Exception as exc:
                    outcomes[name] = "%s: %s" % (type(exc).__name__, exc)
            for name, params in forged.items():
                method = "memory_put_if" if "version" in params else "memory_save"
                try:
                    requests.call(method, params)
                    outcomes[name] = "accepted"
                except Exception as exc:
                    outcomes[name] = "%s: %s" % (type(exc).__name__, exc)
            (outcomes, list_memories(), load_memory("kept"))
            """,
        )
        outcomes, entries, kept = eval(answer["value"])
        assert "set is not JSON serializable" in outcomes["set"], outcomes
        assert "socket is not JSON serializable" in outcomes["socket"], outcomes
        assert "MCP_BRIDGE_MAX_MEMORY_BYTES" in outcomes["2 MiB"], outcomes
        for name in ("empty key", "newline key", "long key"):
            assert outcomes[name].startswith("MCPError:") and "key" in outcomes[name], outcomes
        assert outcomes["fn raises"].startswith("ZeroDivisionError"), outcomes
        for name in ("key type", "metadata type", "version type", "extra field"):
            assert outcomes[name].startswith("MCPError: Bad arguments for runtime.memory_"), outcomes
        assert [entry["key"] for entry in entries] == ["kept"] and kept == 1


async def test_a_corrupt_store_is_reported_and_left_untouched(engine: Engine, state_dir: Path) -> None:
    path = store_path(state_dir)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a database" * 100)
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(client, 'save_memory("x", 1)')
        assert answer["is_error"] and "cannot be used" in answer["text"], answer
        assert "left untouched" in answer["text"]
        assert (await run_cell(client, "6 * 7"))["value"] == "42"
    assert path.read_bytes() == b"this is not a database" * 100


# --- saved tools ------------------------------------------------------------------------------


async def test_a_saved_tool_is_defined_after_reset_and_in_a_new_bridge(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(
            client,
            '''
            SCALE = 2
            def circle_area(radius):
                """Area of a circle of the given radius."""
                import math
                return round(math.pi * radius ** 2, 2)
            def scaled(x):
                return x * SCALE
            ''',
        )
        saved = await run_cell(client, "save_tool(circle_area)")
        assert not saved["is_error"] and "'warnings': []" in saved["value"], saved
        warned = await run_cell(client, "save_tool(scaled)['warnings']")
        assert "SCALE is not defined inside the function" in warned["value"], warned
        await run_cell(client, "delete_tool('scaled')")
        fresh = await run_cell(client, "circle_area(1)", timeout=60)
        reset = await client.call_tool("run_python", {"code": "circle_area(2)", "reset": True})
        assert not reset.is_error, reset
        assert "12.57" in str(reset.structured_content), reset.structured_content
        assert fresh["value"] == "3.14"
    path = state_dir / bridge.MEMORY_DIRNAME / "circle_area.py"
    assert '"""Area of a circle of the given radius."""' in path.read_text()
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(client, "import math\n(circle_area(1), list_saved_tools())")
        value, tools = eval(answer["value"])
        assert value == 3.14
        assert [(tool["name"], tool["doc"]) for tool in tools] == [
            ("circle_area", "Area of a circle of the given radius.")
        ]
        assert any("Saved tools defined" in notice for notice in answer["notices"]), answer["notices"]
        assert (await run_cell(client, "delete_tool('circle_area'), list_saved_tools()"))[
            "value"
        ] == "(True, [])"


async def test_lambdas_closures_and_builtins_are_refused_with_a_reason(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(
            client,
            """
            def outer():
                base = 10
                def inner(x):
                    return x + base
                return inner
            reasons = {}
            for name, candidate in (("lambda", lambda x: x), ("closure", outer()), ("builtin", len)):
                try:
                    save_tool(candidate)
                    reasons[name] = "saved"
                except TypeError as exc:
                    reasons[name] = str(exc)
            (reasons, list_saved_tools())
            """,
        )
        reasons, tools = eval(answer["value"])
        assert "cannot save a lambda" in reasons["lambda"], reasons
        assert "defined inside another function" in reasons["closure"], reasons
        assert "needs a function defined with def" in reasons["builtin"], reasons
        assert tools == []


async def test_a_hand_broken_saved_tool_is_reported_and_the_others_still_load(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, "def good():\n    return 'good'\ndef bad():\n    return 'bad'")
        await run_cell(client, "save_tool(good)\nsave_tool(bad)")
    broken = state_dir / bridge.MEMORY_DIRNAME / "bad.py"
    broken.write_text("def bad(:\n    return 'broken by hand'\n")
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(client, "good()")
        assert answer["value"] == "'good'", answer
        assert any(
            "Saved tool bad could not be loaded (SyntaxError" in notice for notice in answer["notices"]
        ), answer
