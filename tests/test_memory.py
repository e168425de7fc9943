"""Memory that survives sessions, bridge restarts and two bridges at once: real bridges
(the installed console script behind the SDK's stdio client) on real containers, one
shared state directory, and the store read back by the test itself."""

from __future__ import annotations

import ast
import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError

import mcp_sandbox_kernel as sandbox_kernel
import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, bridge_pids, run_cell, structured

pytestmark = pytest.mark.anyio
# Memory and saved tools live on the host (SQLite, files): the first requested runtime is enough.
ONE_RUNTIME = True


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
            [load_memory("project"), runtime.load_memory("missing", "fallback"), memory_exists("project"),
             [[e["key"], e["metadata"], e["size"]] for e in entries]]
            """,
        )
        value, fallback, exists, entries = eval(answer["value"])
        assert value == {"name": "x", "n": 1}
        assert fallback == "fallback" and exists is True
        # size: the value's and the metadata's JSON together, as both caps count them
        assert entries == [["project", {"about": "demo"}, len('{"name":"x","n":1}{"about":"demo"}')]]
        info = await run_cell(client, 'get_memory_info("project")')
        assert "'created'" in info["value"] and "'updated'" in info["value"], info
        deleted = await run_cell(
            client, '[delete_memory("project"), memory_exists("project"), list_memories()]'
        )
        assert deleted["value"] == "[True, False, []]", deleted


async def test_memory_helpers_are_awaitable_in_code_that_uses_await(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run_cell(
            client,
            """
            import asyncio
            await save_memory("a", [1, 2])
            await asyncio.gather(*(update_memory("n", lambda v: (v or 0) + 1) for _ in range(10)))
            [await load_memory("a"), await load_memory("n")]
            """,
        )
        assert answer["value"] == "[[1, 2], 10]", answer


# Released at one wall-clock moment (containers share the host's clock), like
# benchmarks/bench_memory.py; fn counts its own invocations: one per attempt.
CONTENDED_CELL = """
import json, threading, time
calls, errors, lock, go = [0], [], threading.Lock(), threading.Event()
def increment(value):
    with lock:
        calls[0] += 1
    return (value or 0) + 1
def work():
    go.wait()
    for _ in range(50):
        try:
            update_memory("counter", increment)
        except Exception as exc:
            errors.append("%s: %s" % (type(exc).__name__, exc))
threads = [threading.Thread(target=work) for _ in range(4)]
for thread in threads:
    thread.start()
late = time.time() - START_AT
time.sleep(max(0.0, START_AT - time.time()))
began = time.time()
go.set()
for thread in threads:
    thread.join()
json.dumps({"calls": calls[0], "errors": errors[:3], "began": began, "ended": time.time(), "late": late})
"""


async def test_two_bridges_updating_one_counter_lose_no_update(engine: Engine, state_dir: Path) -> None:
    # 2 bridges x 4 threads x 50 updates: every read-modify-write must land exactly once.
    async with (
        bridge_client(bridge_env(engine, state_dir)) as first,
        bridge_client(bridge_env(engine, state_dir)) as second,
    ):
        for client in (first, second):  # both sandboxes up before the clock starts
            assert (await run_cell(client, "1"))["value"] == "1"
        cell = CONTENDED_CELL.replace("START_AT", repr(time.time() + 2.0))
        results: list[dict[str, Any]] = []

        async def one_bridge(client: ClientSession) -> None:
            answer = await run_cell(client, cell, timeout=120)
            assert not answer["is_error"], answer
            results.append(json.loads(ast.literal_eval(answer["value"])))

        async with anyio.create_task_group() as group:
            group.start_soon(one_bridge, first)
            group.start_soon(one_bridge, second)
        assert [result["errors"] for result in results] == [[], []], results
        assert (await run_cell(first, 'load_memory("counter")'))["value"] == "400"
    assert all(result["late"] < 0 for result in results), results  # both waited for the moment
    assert max(r["began"] for r in results) < min(r["ended"] for r in results), results  # overlapped
    assert sum(result["calls"] for result in results) > 400, results  # and conflicted: retries


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
        assert (await run_cell(client, "[delete_tool('circle_area'), list_saved_tools()]"))[
            "value"
        ] == "[True, []]"


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


# --- review of issue 8: caps, every helper, forged frames, saved tools -----------------------


def store_rows(state_dir: Path) -> list[tuple[str, str, str | None, int, int]]:
    """Every memory row as the store file holds it (read-only, beside a running bridge)."""
    database = sqlite3.connect("file:%s?mode=ro" % store_path(state_dir), uri=True)
    try:
        return database.execute(
            "SELECT key, value, metadata, version, size FROM memories ORDER BY key"
        ).fetchall()
    finally:
        database.close()


def tool_files(state_dir: Path) -> dict[str, str]:
    folder = state_dir / bridge.MEMORY_DIRNAME
    return {path.name: path.read_text() for path in sorted(folder.glob("*.py"))} if folder.is_dir() else {}


ATTEMPT = """
def attempt(call):
    try:
        call()
        return "accepted"
    except Exception as exc:
        return "%s: %s" % (type(exc).__name__, exc)
"""


async def test_metadata_counts_against_both_memory_caps(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(
        engine, state_dir, MCP_BRIDGE_MAX_MEMORY_BYTES="300", MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES="2800"
    )
    async with bridge_client(env) as client:
        await run_cell(client, ATTEMPT)
        answer = await run_cell(
            client,
            """
            huge = attempt(lambda: save_memory("m", 1, metadata={"pad": "y" * 5_000_000}))
            over = attempt(lambda: save_memory("m", 1, metadata={"pad": "y" * 400}))
            save_memory("u", "a", metadata={"pad": "z" * 200})
            kept_metadata = attempt(lambda: update_memory("u", lambda v: v * 100))
            (huge, over, kept_metadata, load_memory("u"), delete_memory("u"), list_memories())
            """,
        )
        huge, over, kept_metadata, u_value, deleted, entries = eval(answer["value"])
        for outcome in (huge, over, kept_metadata):
            assert outcome.startswith("MCPError: The value (") and "and its metadata (" in outcome, outcome
            assert "MCP_BRIDGE_MAX_MEMORY_BYTES" in outcome, outcome
        assert (u_value, deleted, entries) == ("a", True, [])

        # Fill the store until the total cap refuses. Each entry is 116 bytes of value, 19 of
        # metadata, 2 of key and MEMORY_ENTRY_OVERHEAD (256): 393 bytes, so 7 fit in 2800
        # (counting only values and metadata, 20 would).
        answer = await run_cell(
            client,
            """
            saved, refusal = {}, None
            for n in range(100):
                value = {"n": n, "pad": "x" * 100}
                refusal = attempt(lambda: save_memory("k%d" % n, value, metadata={"about": "entry %d" % n}))
                if refusal != "accepted":
                    break
                saved["k%d" % n] = value
            bigger = attempt(lambda: save_memory("k0", {"n": 0, "pad": "x" * 250}))
            (refusal, bigger, {key: load_memory(key) for key in saved} == saved, sorted(saved),
             [entry["key"] for entry in list_memories()])
            """,
        )
        refusal, bigger, equal, keys, listed = eval(answer["value"])
        assert len(keys) == 7 and equal and listed == keys, answer
        for outcome in (refusal, bigger):
            assert outcome.startswith("MCPError: Storing ") and "(value and metadata;" in outcome, outcome
            assert "MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES" in outcome, outcome
        rows = store_rows(state_dir)
        assert [row[0] for row in rows] == keys  # no row for the refused key
        assert [row[3] for row in rows] == [1] * 7  # k0 was not rewritten
        assert all(row[4] == len(row[1].encode()) + len((row[2] or "").encode()) for row in rows)
        assert sum(row[4] + len(row[0]) + bridge.MEMORY_ENTRY_OVERHEAD for row in rows) <= 2800


async def test_saved_tools_are_bounded_in_number(engine: Engine, state_dir: Path) -> None:
    folder = state_dir / bridge.MEMORY_DIRNAME
    folder.mkdir()
    for n in range(bridge.SavedTools.MAX_TOOLS):  # written by hand, as a user may
        (folder / ("t%d.py" % n)).write_text("def t%d():\n    return %d\n" % (n, n))
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, ATTEMPT)
        answer = await run_cell(
            client,
            """
            def one_more():
                return 0
            def t5():
                return "new"
            (attempt(lambda: save_tool(one_more)), attempt(lambda: save_tool(t5)), t999())
            """,
        )
        refused, replaced, last = eval(answer["value"])
        assert refused.startswith("MCPError: There are already 1000 saved tools"), refused
        assert "delete_tool()" in refused and (replaced, last) == ("accepted", 999)
    files = tool_files(state_dir)
    assert len(files) == 1000 and "one_more.py" not in files and '"new"' in files["t5.py"]


async def test_saved_tools_are_bounded_in_bytes(state_dir: Path) -> None:
    tools = bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME)
    body = "def t{n}():\n    return {n}\n# " + "x" * (bridge.SavedTools.MAX_SOURCE_BYTES - 60) + "\n"
    count = bridge.SavedTools.MAX_TOTAL_BYTES // bridge.SavedTools.MAX_SOURCE_BYTES
    for n in range(count):
        tools.save("t%d" % n, body.format(n=n))
    used = sum(len(source.encode()) for source in tool_files(state_dir).values())
    assert used <= bridge.SavedTools.MAX_TOTAL_BYTES
    room = bridge.SavedTools.MAX_TOTAL_BYTES - used
    with pytest.raises(bridge.MemoryStoreError, match="over 10485760 bytes together"):
        tools.save("one_more", "def one_more():\n    return '%s'\n" % ("x" * room))
    assert tools.save("t0", body.format(n=0).replace("return 0", "return 10"))["name"] == "t0"
    assert len(tool_files(state_dir)) == count and "return 10" in tool_files(state_dir)["t0.py"]


HELPER_STEPS = """
steps = [
    ("save_memory", ("k", [1])),
    ("load_memory", ("k",)),
    ("update_memory", ("n", lambda v: (v or 0) + 1)),
    ("list_memories", ()),
    ("memory_exists", ("k",)),
    ("get_memory_info", ("k",)),
    ("save_tool", (helper_tool,)),
    ("list_saved_tools", ()),
    ("delete_tool", ("helper_tool",)),
    ("delete_memory", ("k",)),
]
def brief(value):  # what a result says, without its timestamps and versions
    if isinstance(value, dict):
        return value.get("key", value.get("name"))
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [brief(item) for item in value]
    return value
"""


async def test_every_memory_helper_is_a_global_and_on_runtime_plain_and_awaited(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, 'def helper_tool():\n    """For the test."""\n    return 7\n' + HELPER_STEPS)
        answer = await run_cell(
            client,
            """
            from mcp import runtime as imported
            report = {}
            for name, args in steps:
                as_global, on_runtime = globals()[name], getattr(runtime, name)
                same = as_global == on_runtime and on_runtime is getattr(imported, name)
                results = [as_global(*args), on_runtime(*args)]
                results += [await as_global(*args), await on_runtime(*args)]
                report[name] = (same, [brief(result) for result in results])
            report
            """,
        )
        report = eval(answer["value"])
    assert sorted(report) == sorted(sandbox_kernel.MEMORY_HELPERS) and len(report) == 10
    assert {name: same for name, (same, _) in report.items()} == dict.fromkeys(report, True)
    assert {name: results for name, (_, results) in report.items()} == {
        "save_memory": ["k"] * 4,
        "load_memory": [[1]] * 4,
        "update_memory": [1, 2, 3, 4],
        "list_memories": [["k", "n"]] * 4,
        "memory_exists": [True] * 4,
        "get_memory_info": ["k"] * 4,
        "save_tool": ["helper_tool"] * 4,
        "list_saved_tools": [["helper_tool"]] * 4,
        "delete_tool": [True, False, False, False],
        "delete_memory": [True, False, False, False],
    }


# (method, params) a hostile cell sends straight into the request channel.
FORGED_STORE_REQUESTS = {
    "load key=5": ("memory_load", {"key": 5}),
    "delete key=5": ("memory_delete", {"key": 5}),
    "info key=5": ("memory_info", {"key": 5}),
    "save key=5": ("memory_save", {"key": 5, "value": 1}),
    "put_if negative generation": ("memory_put_if", {"key": "kept", "value": 2, "generation": -1}),
    "put_if generation as text": ("memory_put_if", {"key": "kept", "value": 2, "generation": "1"}),
    "put_if version only": ("memory_put_if", {"key": "kept", "value": 2, "version": 1}),
    "list limit=0": ("memory_list", {"limit": 0}),
    "save unknown field": ("memory_save", {"key": "x", "value": 1, "other": 1}),
    "tool_save name=1": ("tool_save", {"name": 1, "source": "def f():\n    return 1\n"}),
    "tool_save source=[]": ("tool_save", {"name": "f", "source": []}),
    "tool_save name ../evil": ("tool_save", {"name": "../evil", "source": "def f():\n    return 1\n"}),
    "tool_save bad source": ("tool_save", {"name": "f", "source": "def f(:\n"}),
    "tool_delete name=None": ("tool_delete", {"name": None}),
    "tool_delete name ../kept_tool": ("tool_delete", {"name": "../user_tools/kept_tool"}),
}


async def test_forged_store_requests_are_refused_and_change_nothing(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, 'save_memory("kept", 1, metadata={"a": 1})\ndef kept_tool():\n    return 1')
        await run_cell(client, "save_tool(kept_tool)")
        rows, files = store_rows(state_dir), tool_files(state_dir)
        answer = await run_cell(
            client,
            """
            import asyncio
            requests = runtime.call_tool.__self__._requests  # the raw channel, as hostile code may use it
            outcomes = {}
            for name, (method, params) in FORGED.items():
                try:
                    requests.call(method, params)
                    outcomes[name] = "accepted"
                except Exception as exc:
                    outcomes[name] = "%s: %s" % (type(exc).__name__, exc)
            # Params that are not an object: the supervisor refuses the frame at once (and
            # reports it in the call's notices); the caller never waits for its timeout.
            async def as_list(method):
                try:
                    await asyncio.wait_for(requests.call_async(method, ["kept", 2]), 2)
                    outcomes[method + " list"] = "answered"
                except Exception as exc:
                    outcomes[method + " list"] = "%s: %s" % (type(exc).__name__, exc)
            await asyncio.gather(*map(as_list, ("memory_save", "memory_delete", "tool_save", "tool_delete")))
            outcomes
            """.replace("FORGED", repr(FORGED_STORE_REQUESTS)),
            timeout=60,
        )
        outcomes = eval(answer["value"])
        bad_arguments = [name for name in FORGED_STORE_REQUESTS if "=" in name or "put_if" in name]
        bad_arguments.append("save unknown field")
        for name in bad_arguments:
            assert outcomes[name].startswith("MCPError: Bad arguments for runtime."), (name, outcomes[name])
        assert "Python identifier" in outcomes["tool_save name ../evil"], outcomes
        assert "Python identifier" in outcomes["tool_delete name ../kept_tool"], outcomes
        assert "does not compile" in outcomes["tool_save bad source"], outcomes
        for method in ("memory_save", "memory_delete", "tool_save", "tool_delete"):
            assert outcomes[method + " list"].startswith(
                "MCPError: refused: request frame: field 'params'"
            ), outcomes
        assert store_rows(state_dir) == rows and tool_files(state_dir) == files
        after = await run_cell(client, '[save_memory("next", 2)["key"], load_memory("kept"), kept_tool()]')
        assert after["value"] == "['next', 1, 1]", after
        assert any("rejected" in notice for notice in answer["notices"] + after["notices"]), (answer, after)


async def test_save_tool_does_not_warn_about_other_saved_tools(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, "def double(x):\n    return 2 * x")
        await run_cell(client, "save_tool(double)")
        answer = await run_cell(
            client,
            """
            def quadruple(x):
                return double(double(x))
            def shifted(x):
                return double(x) + OFFSET
            (save_tool(quadruple)["warnings"], save_tool(shifted)["warnings"])
            """,
        )
        quadruple, shifted = eval(answer["value"])
        assert quadruple == [], quadruple
        assert len(shifted) == 1 and shifted[0].startswith("OFFSET is not defined"), shifted
        fresh = await client.call_tool("run_python", {"code": "quadruple(3)", "reset": True})
        assert not fresh.is_error and structured(fresh)["value"] == "12", fresh


async def test_a_decorated_function_is_refused_with_a_reason(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, ATTEMPT)
        answer = await run_cell(
            client,
            """
            import functools
            def same(func):
                return func
            def logged(func):
                @functools.wraps(func)
                def wrapper(*args):
                    return func(*args)
                return wrapper
            @same
            def plain_decorated(x):
                return x
            @logged
            def wrapped(x):
                return x
            @functools.lru_cache
            def cached(x):
                return x
            ([attempt(lambda: save_tool(f)) for f in (plain_decorated, wrapped, cached)], list_saved_tools())
            """,
        )
        reasons, tools = eval(answer["value"])
        for reason, name in zip(reasons, ("plain_decorated", "wrapped", "cached"), strict=True):
            assert reason == (
                "TypeError: save_tool cannot save decorated functions (%s): save the plain function" % name
            ), reasons
        assert tools == [] and tool_files(state_dir) == {}


async def test_saving_a_tool_again_replaces_its_file_and_function(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, 'def greet():\n    """First."""\n    return "v1"')
        assert not (await run_cell(client, "save_tool(greet)"))["is_error"]
        await run_cell(client, 'def greet():\n    """Second."""\n    return "v2"')
        assert not (await run_cell(client, "save_tool(greet)"))["is_error"]
        fresh = await client.call_tool(
            "run_python", {"code": "[greet(), [t['doc'] for t in list_saved_tools()]]", "reset": True}
        )
        assert not fresh.is_error, fresh
        assert structured(fresh)["value"] == "['v2', ['Second.']]", fresh.structured_content
    assert list(tool_files(state_dir)) == ["greet.py"]
    assert '"v2"' in tool_files(state_dir)["greet.py"] and "v1" not in tool_files(state_dir)["greet.py"]


async def test_saved_tools_are_back_after_a_crash_without_reset(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, "def good():\n    return 'good'")
        await run_cell(client, "save_tool(good)")
        (state_dir / bridge.MEMORY_DIRNAME / "needs_missing.py").write_text(
            "import nonexistent_module_xyz\n\n\ndef needs_missing():\n    return 1\n"
        )
        crashed = await run_cell(client, "import os\nos._exit(1)")
        assert crashed["status"] == "crashed", crashed
        after = await run_cell(client, "[good(), 'needs_missing' in globals()]")
        assert after["value"] == "['good', False]", after
        assert any(
            "Saved tool needs_missing could not be loaded (ModuleNotFoundError" in notice
            for notice in after["notices"]
        ), after["notices"]
        assert any("Saved tools defined in this fresh session: good." in n for n in after["notices"]), after


async def test_the_saved_tools_a_fresh_session_defines_are_named_once_per_change(
    engine: Engine, state_dir: Path
) -> None:
    bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME).save("good", "def good():\n    return 'good'\n")
    named = "Saved tools defined in this fresh session: "

    async def naming(code: str, **arguments: Any) -> list[str]:
        result = await client.call_tool("run_python", {"code": code, "timeout": 60, **arguments})
        assert not result.is_error, result
        return [notice for notice in structured(result)["notices"] if notice.startswith(named)]

    async with bridge_client(bridge_env(engine, state_dir)) as client:
        assert await naming("good()") == [named + "good."]
        # The same tools again: a reset, another session, a session after a crash.
        assert await naming("good()", reset=True) == []
        assert await naming("good()", session="other") == []
        assert (await run_cell(client, "import os\nos._exit(1)", timeout=60))["status"] == "crashed"
        assert await naming("good()") == []
        # A change of the set is named, once.
        await run_cell(client, "def second():\n    return 2\nsave_tool(second)")
        assert await naming("second()", reset=True) == [named + "good, second."]
        assert await naming("second()", session="other", reset=True) == []


async def test_update_memory_gives_up_clearly_when_every_attempt_is_overtaken(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, ATTEMPT)
        answer = await run_cell(
            client,
            """
            import time
            calls = [0]
            def meddle(value):  # writes the key itself: the version always moves on
                calls[0] += 1
                save_memory("hot", {"n": calls[0]})
                return {"n": -1}
            save_memory("hot", {"n": 0})
            started = time.perf_counter()
            outcome = attempt(lambda: update_memory("hot", meddle))
            (outcome, calls[0], load_memory("hot"), time.perf_counter() - started)
            """,
        )
        outcome, calls, value, seconds = eval(answer["value"])
    attempts = sandbox_kernel.UPDATE_MEMORY_ATTEMPTS
    assert outcome == (
        "MCPError: update_memory('hot'): other writers changed the value on each of %d attempts; try again"
        % attempts
    )
    assert calls == attempts and value == {"n": attempts} and seconds < 10, (calls, value, seconds)
    assert [json.loads(row[1]) for row in store_rows(state_dir)] == [{"n": attempts}]


async def test_tools_list_stays_under_200_tokens_with_saved_tools_and_memories(
    engine: Engine, state_dir: Path
) -> None:
    from anthropic_tokenizer import count_tokens

    folder = state_dir / bridge.MEMORY_DIRNAME
    tools = bridge.SavedTools(folder)
    for n in range(20):
        tools.save(
            "saved_tool_%d" % n, 'def saved_tool_%d():\n    """Tool number %d."""\n    return 1\n' % (n, n)
        )
    store = bridge.MemoryStore(folder, 1024 * 1024, 100 * 1024 * 1024)
    for n in range(20):
        store.save("memory-%d" % n, n, metadata={"about": "memory %d" % n})
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        listing = await client.list_tools()
    text = json.dumps(
        listing.model_dump(by_alias=True, exclude_none=True, mode="json"), separators=(",", ":")
    )
    assert [tool.name for tool in listing.tools] == ["run_python"]
    assert "saved_tool_" not in text and "memory-" not in text
    assert count_tokens(text) < 200, count_tokens(text)


def memory_folder(state_dir: Path) -> Path:
    return state_dir / bridge.MEMORY_DIRNAME


def test_update_memory_commit_is_refused_after_a_delete_and_a_new_save(state_dir: Path) -> None:
    store = bridge.MemoryStore(memory_folder(state_dir), 1024 * 1024, 100 * 1024 * 1024)
    store.save("k", 1)
    read = store.load("k")  # update_memory's read; its function runs in the sandbox now
    store.delete("k")  # another writer deletes and saves anew: the version is 1 again (ABA)
    store.save("k", 2)
    assert store.load("k")["version"] == read["version"] == 1
    assert store.put_if("k", 99, read["generation"])["ok"] is False
    assert store.load("k")["value"] == 2
    absent = store.load("new")  # read while absent, then saved by another writer
    store.save("new", 1)
    assert absent["generation"] == 0 and store.put_if("new", 5, absent["generation"])["ok"] is False
    current = store.load("k")
    assert store.put_if("k", 3, current["generation"]) == {"ok": True, "version": 2}
    assert store.load("k")["value"] == 3 and store.load("k")["generation"] > current["generation"]


OLD_MEMORY_SCHEMA = """
CREATE TABLE memories (
    key TEXT PRIMARY KEY, value TEXT NOT NULL, metadata TEXT, version INTEGER NOT NULL,
    size INTEGER NOT NULL, created REAL NOT NULL, updated REAL NOT NULL
)"""


def test_a_store_from_before_generations_is_migrated_in_place(state_dir: Path) -> None:
    folder = memory_folder(state_dir)
    folder.mkdir()
    database = sqlite3.connect(folder / bridge.MEMORY_FILENAME)
    database.execute(OLD_MEMORY_SCHEMA)
    database.executemany(
        "INSERT INTO memories VALUES (?, ?, ?, ?, ?, ?, ?)",
        [("a", '"one"', '{"m":1}', 3, 12, 1.0, 2.0), ("b", "[2]", None, 1, 3, 1.0, 1.0)],
    )
    database.commit()
    database.close()
    store = bridge.MemoryStore(folder, 1024 * 1024, 100 * 1024 * 1024)
    assert [(e["key"], e["metadata"], e["version"], e["size"]) for e in store.entries()] == [
        ("a", {"m": 1}, 3, 12),
        ("b", {}, 1, 3),
    ]
    a, b = store.load("a"), store.load("b")
    assert (a["value"], b["value"]) == ("one", [2])
    assert 0 < a["generation"] != b["generation"] > 0  # each its own, none "absent"
    store.delete("b")
    store.save("b", "again")  # version 1 again, as before the migration
    assert store.put_if("b", "lost", b["generation"])["ok"] is False
    assert store.put_if("a", "two", a["generation"])["ok"] is True
    reopened = bridge.MemoryStore(folder, 1024 * 1024, 100 * 1024 * 1024)
    assert {key: entry["value"] for key, entry in reopened.snapshot().items()} == {"a": "two", "b": "again"}
    database = sqlite3.connect(folder / bridge.MEMORY_FILENAME)
    assert database.execute("PRAGMA user_version").fetchone()[0] == bridge.MEMORY_SCHEMA_VERSION
    database.close()


def test_keys_and_a_per_entry_overhead_count_against_the_total(state_dir: Path) -> None:
    store = bridge.MemoryStore(memory_folder(state_dir), 1024 * 1024, 20_000)
    refusal = ""
    for n in range(200):
        try:
            store.save(("k%03d" % n).ljust(bridge.MAX_MEMORY_KEY_CHARS, "x"), 1)
        except bridge.MemoryStoreError as exc:
            refusal = str(exc)
            break
    # Counting values alone, 20,000 one-byte memories would fit; each costs its key too.
    assert n == 20_000 // (bridge.MAX_MEMORY_KEY_CHARS + 1 + bridge.MEMORY_ENTRY_OVERHEAD), n
    assert "MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES" in refusal and "key" in refusal, refusal
    assert len(store.entries()) == n


def test_a_listing_page_is_bounded_in_bytes(state_dir: Path) -> None:
    store = bridge.MemoryStore(memory_folder(state_dir), 1024 * 1024, 100 * 1024 * 1024)
    pad = "x" * 200_000
    for n in range(30):  # 6 MB of metadata: more than one page holds
        store.save("k%02d" % n, n, metadata={"pad": pad})
    first = store.page()
    assert first["more"] and 1 <= len(first["memories"]) < 30
    held = sum(
        len(e["key"]) + len(json.dumps(e["metadata"], separators=(",", ":"))) for e in first["memories"]
    )
    assert held <= bridge.MEMORY_PAGE_BYTES
    second = store.page(after=first["memories"][-1]["key"], limit=1000)
    assert [e["key"] for e in first["memories"] + second["memories"]] == ["k%02d" % n for n in range(30)]
    assert second["more"] is False and store.page(after="k29") == {"memories": [], "more": False}
    assert [e["key"] for e in store.page(after="k03", limit=2)["memories"]] == ["k04", "k05"]


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_memories_are_counted_paged_and_kept_shallow_through_the_sandbox(
    engine: Engine, state_dir: Path
) -> None:
    store = bridge.MemoryStore(memory_folder(state_dir), 1024 * 1024, 100 * 1024 * 1024)
    with store._transaction(write=True) as database:  # 2,400 memories at once: fast
        for n in range(2400):
            store._write(database, "m%05d" % n, json.dumps({"n": n}), '{"about":"m"}')
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MAX_MEMORIES="2402")
    async with bridge_client(env) as client:
        await run_cell(client, ATTEMPT)
        answer = await run_cell(
            client,
            """
            requests = runtime.call_tool.__self__._requests
            everything = list_memories()
            raw = requests.call("memory_list", {})
            part = [entry["key"] for entry in list_memories(after="m01000", limit=5)]
            deep_meta = attempt(lambda: save_memory("deep", 1, metadata={"a": NESTED}))
            deep_value = attempt(lambda: save_memory("deep", NESTED))
            calls = []
            def bump(value):
                calls.append(value)
                if len(calls) == 1:  # another writer deletes the key and saves it anew meanwhile
                    delete_memory("m00000")
                    save_memory("m00000", {"n": 100})
                return {"n": value["n"] + 1}
            updated = update_memory("m00000", bump)
            saves = [attempt(lambda: save_memory("new%d" % n, n)) for n in range(3)]
            again = attempt(lambda: save_memory("m00001", "replaced"))
            ([e["key"] for e in everything] == ["m%05d" % n for n in range(2400)],
             everything[7]["metadata"], len(raw["memories"]), raw["more"], part, deep_meta, deep_value,
             updated, calls, load_memory("m00000"), saves, again)
            """.replace("NESTED", repr(nested(150))),
            timeout=120,
        )
        assert not answer["is_error"], answer
        (ordered, metadata, page, more, part, deep_meta, deep_value, updated, calls, value, saves, again) = (
            eval(answer["value"])
        )
    assert ordered and metadata == {"about": "m"}
    assert (page, more) == (sandbox_kernel.MEMORY_PAGE_ENTRIES, True)  # one bounded answer per request
    assert part == ["m01001", "m01002", "m01003", "m01004", "m01005"]
    for outcome in (deep_meta, deep_value):
        assert outcome.startswith("MCPError: The ") and "deeper than %d levels" % bridge.MAX_MEMORY_DEPTH in (
            outcome
        ), outcome
    # The delete-then-save in between made the first commit fail: fn ran again on the new value.
    assert calls == [{"n": 0}, {"n": 100}] and updated == value == {"n": 101}
    assert saves[:2] == ["accepted", "accepted"]
    assert (
        saves[2].startswith("MCPError: There are already 2402 memories")
        and "MCP_BRIDGE_MAX_MEMORIES" in (saves[2])
    ), saves
    assert again == "accepted"  # replacing a memory needs no room for another


async def test_deep_metadata_already_in_a_store_is_listed_as_unreadable_not_a_hang(
    engine: Engine, state_dir: Path
) -> None:
    # Issue 16 item 12: a store written before depth was checked at save (or by hand) holds
    # metadata 1,500 levels deep. Encoding the answer raised RecursionError, the answer was
    # dropped, and list_memories() waited out the call's timeout in every session.
    store = bridge.MemoryStore(memory_folder(state_dir), 1024 * 1024, 100 * 1024 * 1024)
    with store._transaction(write=True) as database:
        store._write(database, "deep", "1", '{"a": %s1%s}' % ("[" * 1500, "]" * 1500))
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        listed = await run_cell(client, "[(m['key'], m['metadata']) for m in list_memories()]", timeout=60)
        assert listed["status"] == "ok", listed  # answered, not timed out
        ((key, metadata),) = listed["json"]
        assert key == "deep" and "cannot be read back (RecursionError" in metadata["unreadable"], listed
        assert "delete_memory('deep')" in metadata["unreadable"], listed
        assert (await run_cell(client, "delete_memory('deep')"))["value"] == "True"
        assert (await run_cell(client, "6 * 7"))["value"] == "42"


def test_the_depth_check_refuses_only_past_max_memory_depth() -> None:
    limit = bridge.MAX_MEMORY_DEPTH
    for accepted in (1, nested(limit), {"a": nested(limit - 1)}, [{"a": 1}] * 3):
        bridge.check_memory_depth(accepted, "value")
    for refused in (nested(limit + 1), {"a": nested(limit)}, [1, [nested(limit)]]):
        with pytest.raises(bridge.MemoryStoreError, match="deeper than %d levels" % limit):
            bridge.check_memory_depth(refused, "value")
