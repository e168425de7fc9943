"""Work that runs longer than clients wait: after MCP_BRIDGE_RESPOND_AFTER seconds a call
answers "still running" with the output so far, the code goes on, and the next call
waits for the rest (its output and result), then runs its own code. The code's own
timeout, reset and a cancelled wait still stop it. Through the SDK's client."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession

import mcp_server_code_execution_mode as bridge
from tests.conftest import NPM_BIN, Engine, bridge_client, bridge_env, console_script, run_cell, structured

pytestmark = pytest.mark.anyio
# still-running answers and their bookkeeping are the bridge's: the first requested runtime is enough.
ONE_RUNTIME = True

# Timings leave a second of slack each way: respond after 2 s, code that takes 3 s or 5 s.
TICKS = "import time\nfor n in range(10):\n    print('tick', n, flush=True)\n    time.sleep(0.3)\n'done'"


@asynccontextmanager
async def warm_bridge(engine: Engine, state_dir: Path) -> AsyncIterator[ClientSession]:
    """A bridge answering "still running" after 2 s, its sandbox already up: the timings
    of a test are then its code's, not the sandbox's start."""
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_RESPOND_AFTER="2")) as client:
        await run_cell(client, "pass")
        yield client


async def test_a_long_call_answers_still_running_and_the_next_call_gets_the_rest(
    engine: Engine, state_dir: Path
) -> None:
    async with warm_bridge(engine, state_dir) as client:
        first = await run_cell(client, TICKS, timeout=30)
        assert first["status"] == "running" and not first["is_error"], first
        assert first["detail"].startswith("Still running after 2s (its timeout of 30s still applies)"), first
        # The time it has run so far, as the detail says (not 0.0).
        assert 1.9 <= first["duration_seconds"] < 30, first
        second = await run_cell(client, "after = 'mine'\nafter")
        assert second["status"] == "ok" and second["value"] == "'mine'", second
        earlier = second["earlier"]
        assert earlier["status"] == "ok" and earlier["value"] == "'done'", second
        ticks = first["stdout"] + earlier["stdout"]
        assert ticks == "".join("tick %d\n" % n for n in range(10)), (first["stdout"], earlier["stdout"])
        assert "[earlier call, now finished]" in second["text"]


async def test_a_call_made_while_earlier_code_still_runs_does_not_run_its_own(
    engine: Engine, state_dir: Path
) -> None:
    async with warm_bridge(engine, state_dir) as client:
        first = await run_cell(client, "import time\ntime.sleep(5)\n'slept'", timeout=30)
        assert first["status"] == "running", first
        second = await run_cell(client, "skipped = True")
        assert second["status"] == "running" and second["detail"].startswith("Your code was not run"), second
        third = await run_cell(client, "'skipped' in globals()")
        assert third["earlier"]["value"] == "'slept'" and third["value"] == "False", third


async def test_a_call_that_waits_its_turn_still_answers_within_respond_after(
    engine: Engine, state_dir: Path
) -> None:
    # The client's clock runs from when it sent the call. Two calls at once: the second
    # waits for the first's turn, and must still answer by respond_after (4 s), not 8 s.
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_RESPOND_AFTER="4")) as client:
        await run_cell(client, "pass")  # the sandbox is up
        answers: dict[str, tuple[float, dict[str, Any]]] = {}

        async def call(name: str, code: str) -> None:
            started = time.monotonic()
            answer = await run_cell(client, code, timeout=60)
            answers[name] = (time.monotonic() - started, answer)

        async with anyio.create_task_group() as group:
            group.start_soon(call, "first", "import time\ntime.sleep(15)")
            await anyio.sleep(0.2)
            group.start_soon(call, "second", "queued = True")
        seconds, second = answers["second"]
        assert second["status"] == "running" and second["detail"].startswith("Your code was not run"), second
        assert seconds < 6.5, seconds  # 4 s from its arrival (8 s before this was fixed)
        assert answers["first"][1]["status"] == "running"


async def test_the_timeout_still_ends_code_that_runs_on_in_the_background(
    engine: Engine, state_dir: Path
) -> None:
    async with warm_bridge(engine, state_dir) as client:
        first = await run_cell(client, "import time\nkept = 1\ntime.sleep(60)", timeout=3)
        assert first["status"] == "running", first
        second = await run_cell(client, "kept")
        assert second["earlier"]["status"] == "timeout" and second["earlier"]["state_kept"], second
        assert second["value"] == "1", second


async def test_reset_and_a_cancelled_wait_stop_code_that_runs_on(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_RESPOND_AFTER="3")) as client:
        await run_cell(client, "pass")  # the sandbox is up: what follows times the code, not its start
        first = await run_cell(client, "import time\ntime.sleep(60)", timeout=120)
        assert first["status"] == "running", first
        reset = await client.call_tool("run_python", {"code": "'fresh'", "reset": True})
        assert not reset.is_error and "Reset: started a fresh session" in str(reset.content), reset
        notices = structured(reset)["notices"]
        stopped = "Reset stopped the code of an earlier call, still running after "
        assert notices[0].startswith(stopped) and "its result is gone" in notices[0], structured(reset)
        await run_cell(client, "marker = 'before'")
        slow = await run_cell(client, "import time\nfor _ in range(600):\n    time.sleep(0.1)", timeout=120)
        assert slow["status"] == "running", slow
        with anyio.move_on_after(1):  # the client gives up while waiting: the code is stopped
            await run_cell(client, "pass")
        after = await run_cell(client, "marker")
        assert after["value"] == "'before'" and "earlier" not in after, after
        assert after["notices"] == [
            "The code of an earlier call was stopped: the call waiting for it was cancelled."
        ], after


def test_the_typescript_client_gets_still_running_before_its_60_second_timeout(
    proxy_engine: Engine, state_dir: Path
) -> None:
    # The official TypeScript client (the inspector's CLI mode) gives up on a request after
    # 60 s by default; with default settings a 70 s loop must answer before that.
    inspector = NPM_BIN / "mcp-inspector"
    if not inspector.exists():
        pytest.fail("the MCP inspector is not installed at %s; run scripts/setup.sh" % inspector)
    env = bridge_env(proxy_engine, state_dir)
    variables = [part for key in ("MCP_BRIDGE_RUNTIME", "MCP_BRIDGE_IMAGE", "MCP_BRIDGE_STATE_DIR")
                 for part in ("-e", "%s=%s" % (key, env[key]))]  # fmt: skip
    loop = "import time\nfor n in range(70):\n    print('tick', n, flush=True)\n    time.sleep(1)"
    argv = [str(inspector), "--cli", *variables, console_script(), "--method", "tools/call"]
    argv += ["--tool-name", "run_python", "--tool-arg", "code=" + loop, "--tool-arg", "timeout=120"]
    # Past 60 s the client itself fails ("Request timed out"): an answer at all is the proof.
    answer = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    result = json.loads(answer.stdout)
    assert result["isError"] is False and result["structuredContent"]["status"] == "running", result
    assert result["structuredContent"]["stdout"].startswith("tick 0\ntick 1\n"), result


class FakeSession:
    """A sandbox for unit tests of the manager: code named in ``seconds`` runs that long,
    printing "started CODE" first; any other code ends at once; the value is its repr."""

    alive = True
    config = bridge.BridgeConfig()

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    async def execute(
        self, code: str, timeout: float, pending: Any, saved_tools: bool = True
    ) -> bridge.ExecutionOutcome:
        pending.streams["stdout"].append("started %s\n" % code)
        await anyio.sleep(self.seconds.get(code, 0))
        return bridge.ExecutionOutcome(status="ok", value=repr(code))


async def run(manager: bridge.SandboxKeeper, code: str, reset: bool = False) -> bridge.ExecutionOutcome:
    """One call to ``manager``, as the tool boundary makes it, with a 10 s timeout."""
    principal = bridge.Principal(bridge.LOCAL_PRINCIPAL, manager.api)
    return await manager.answer(bridge.RunRequest(code, 10, reset, bridge.DEFAULT_SESSION, principal))


def keeper_with_fake_sandbox(group: anyio.abc.TaskGroup) -> bridge.SandboxKeeper:
    """A keeper answering "still running" after 1 s; the test replaces its _ensure_sandbox."""
    config = bridge.BridgeConfig(respond_after=1.0)
    api: Any = SimpleNamespace(pool=SimpleNamespace(drain_notices=list))
    engine = bridge.SharedEngine(config)
    return bridge.SandboxKeeper(
        config,
        group,
        api,
        engine,
        bridge.DEFAULT_SESSION,
        bridge.ProblemLog(),
        bridge.Closing(),
        bridge.TaskBoard(),
    )


async def test_the_end_of_earlier_code_is_kept_when_the_call_collecting_it_fails() -> None:
    # Unit test of the manager with a fake sandbox: the call that collects the earlier
    # code's end fails to start its own sandbox; the next call still gets that end.
    failed = bridge.SandboxStartError("no sandbox this time")
    starts: list[Any] = [FakeSession({"slow": 1.3}), failed, FakeSession({"slow": 1.3})]

    async def ensure_session() -> tuple[Any, list[str]]:
        start = starts.pop(0)
        if isinstance(start, Exception):
            raise start
        return start, []

    async with anyio.create_task_group() as group:
        manager = keeper_with_fake_sandbox(group)
        manager._ensure_sandbox = ensure_session  # type: ignore[method-assign]
        assert (await run(manager, "slow")).status == "running"
        with pytest.raises(bridge.SandboxStartError):
            await run(manager, "collects the end, then fails")
        third = await run(manager, "third")
        assert third.value == "'third'"
        assert third.earlier is not None and third.earlier.value == "'slow'"
        group.cancel_scope.cancel()


async def test_a_reset_says_what_became_of_code_an_earlier_call_left_running() -> None:
    # Unit test of the manager with a fake sandbox: code still running when a reset comes
    # is stopped, and the reset's result says so; code that ended before the reset (its
    # end not yet returned) is returned with the reset's result, not dropped.
    async def ensure_session() -> tuple[Any, list[str]]:
        return FakeSession({"forever": 600, "short": 1.5}), []

    async with anyio.create_task_group() as group:
        manager = keeper_with_fake_sandbox(group)
        manager._ensure_sandbox = ensure_session  # type: ignore[method-assign]
        first = await run(manager, "forever")
        assert first.status == "running" and first.duration >= 0.9, first
        reset = await run(manager, "after", reset=True)
        assert reset.value == "'after'" and reset.earlier is None, reset
        stopped = "Reset stopped the code of an earlier call, still running after 1s; its result is gone."
        assert reset.notices[0].startswith(stopped), reset.notices
        assert (await run(manager, "short")).status == "running"
        await anyio.sleep(1.0)  # "short" ends meanwhile; no call has returned its end
        again = await run(manager, "again", reset=True)
        assert again.earlier is not None and again.earlier.value == "'short'", again
        assert not any("Reset stopped" in notice for notice in again.notices), again.notices
        group.cancel_scope.cancel()


def state(task: bridge.McpTask) -> str:
    return task.state  # read anew (mypy would keep an earlier assert's narrowing)


async def as_task(manager: bridge.SandboxKeeper, code: str) -> bridge.ExecutionOutcome:
    """One call to ``manager`` from a client of the MCP Tasks extension."""
    principal = bridge.Principal(bridge.LOCAL_PRINCIPAL, manager.api)
    request = bridge.RunRequest(
        code, 10, False, bridge.DEFAULT_SESSION, principal, as_task=True, round_trip=True
    )
    return await manager.answer(request)


async def test_an_mcp_task_ends_by_itself_and_a_cancelled_second_call_does_not_stop_it() -> None:
    # Unit test of the keeper with a fake sandbox (issue 20, item 3): the code of a task
    # goes on when another call that waits for it is cancelled, ends its task when it
    # ends (nobody polls), and the task's end, once set, stands.
    async def ensure_session() -> tuple[Any, list[str]]:
        return FakeSession({"slow": 2.5}), []

    async with anyio.create_task_group() as group:
        manager = keeper_with_fake_sandbox(group)
        manager._ensure_sandbox = ensure_session  # type: ignore[method-assign]
        first = await as_task(manager, "slow")
        task = first.task
        assert (
            task is not None
            and task.state == "working"
            and manager.board.get(task.principal, task.id) is task
        )
        with anyio.move_on_after(0.3):  # a second call, given up by its client while it waits
            await run(manager, "impatient")
        await anyio.sleep(2.5)  # nobody polls: the task still ends, with its whole output
        assert state(task) == "completed" and task.outcome is not None, task.state
        assert task.outcome.value == "'slow'" and task.running.shown == {"stdout": 0, "stderr": 0}
        assert manager.running is None  # the session is free for the next call
        task.end(None, cancelled="too late")
        assert state(task) == "completed"  # the first end stands
        mine = await run(manager, "next")
        assert mine.value == "'next'" and mine.earlier is None  # the task's end is the task's alone
        group.cancel_scope.cancel()


async def test_a_cancelled_task_stays_cancelled_and_frees_its_session() -> None:
    async def ensure_session() -> tuple[Any, list[str]]:
        return FakeSession({"forever": 600}), []

    async with anyio.create_task_group() as group:
        manager = keeper_with_fake_sandbox(group)
        manager._ensure_sandbox = ensure_session  # type: ignore[method-assign]
        task = (await as_task(manager, "forever")).task
        assert task is not None
        manager.cancel_task(task)  # answered at once
        assert task.state == "cancelled" and "tasks/cancel" in task.reason
        with anyio.fail_after(5):
            while manager.running is not None:  # its code stops, and is finished by itself
                await anyio.sleep(0.05)
        assert state(task) == "cancelled" and (await run(manager, "after")).value == "'after'"
        group.cancel_scope.cancel()
