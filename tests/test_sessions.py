"""Sessions by handle: run_python's optional ``session`` names a sandbox of its own (own
state, idle timer and lock); calls to different sessions run side by side, calls to one
session one at a time; MCP_BRIDGE_MAX_SESSIONS caps how many hold sandboxes at once.
The registry's rules without containers; the rest through the SDK's client on both
runtimes."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from mcp.client.session import ClientSession
from pydantic import ValidationError

import mcp_server_code_execution_mode as bridge
from tests.conftest import (
    CONTAINER_LABEL,
    Engine,
    bridge_client,
    bridge_env,
    bridge_pids,
    structured,
    text_of,
)

pytestmark = pytest.mark.anyio


async def call(client: ClientSession, code: str, session: str | None = None, **more: Any) -> dict[str, Any]:
    """One run_python call in ``session`` (None: the argument left out), as data: the raw
    structuredContent (None for an error without one) and the text."""
    arguments: dict[str, Any] = {"code": textwrap.dedent(code), **more}
    if session is not None:
        arguments["session"] = session
    result = await client.call_tool("run_python", arguments)
    raw = result.structured_content
    return {
        "raw": raw,
        "view": structured(result) if isinstance(raw, dict) else None,
        "text": text_of(result),
        "is_error": result.is_error,
    }


# --- the registry, without containers ----------------------------------------------------


@pytest.mark.parametrize("name", ["default", "a", "my_session-2", "x" * 32, "0"])
def test_valid_session_names_are_accepted(name: str) -> None:
    assert bridge.valid_session_name(name) == name


@pytest.mark.parametrize("name", ["", "A", "Default", "x" * 33, "a b", "../etc", "a.b", "ü", "a\n"])
def test_session_names_reject_anything_but_short_lower_case_words(name: str) -> None:
    with pytest.raises(ValueError, match="1-32 characters of a-z, 0-9, _ and -"):
        bridge.valid_session_name(name)


def test_the_input_model_refuses_a_bad_session_name_with_the_rule() -> None:
    model = bridge.run_python_input_model(bridge.BridgeConfig())
    with pytest.raises(ValidationError) as caught:
        model.model_validate({"code": "1", "session": "No Good"})
    message = bridge.describe_validation_error(caught.value)
    assert "session: Value error, a session name is 1-32 characters of a-z, 0-9, _ and -" in message
    assert model.model_validate({"code": "1"}).session == "default"


FAKE_HOST: Any = SimpleNamespace(pool=SimpleNamespace(drain_notices=list))
LOCAL = bridge.Principal(bridge.LOCAL_PRINCIPAL, FAKE_HOST)


def registry(group: anyio.abc.TaskGroup, max_sessions: int) -> bridge.Sandboxes:
    config = bridge.BridgeConfig(max_sessions=max_sessions)
    return bridge.Sandboxes(config, group, bridge.SharedEngine(config))


async def test_one_name_is_one_manager_and_names_are_checked_again() -> None:
    async with anyio.create_task_group() as group:
        sessions = registry(group, 8)
        first = sessions.keeper(LOCAL, "a")
        assert sessions.keeper(LOCAL, "a") is first and first.name == "a"
        assert sessions.keeper(LOCAL, "b") is not first
        with pytest.raises(bridge.InvalidRequestError, match="1-32 characters"):
            sessions.keeper(LOCAL, "A")  # defense in depth: the model checks first
        group.cancel_scope.cancel()


async def test_the_cap_refuses_a_new_name_while_every_session_holds_a_sandbox() -> None:
    async with anyio.create_task_group() as group:
        sessions = registry(group, 2)
        for name in ("default", "a"):
            sessions.keeper(LOCAL, name).sandbox = object()  # type: ignore[assignment]  # as if it ran
        with pytest.raises(bridge.TooManySessionsError) as caught:
            sessions.keeper(LOCAL, "b")
        message = str(caught.value)
        assert "Session 'b' was not started: 2 sessions (a, default) already hold sandboxes" in message
        assert "MCP_BRIDGE_MAX_SESSIONS" in message and "MCP_BRIDGE_IDLE_TIMEOUT" in message
        assert set(sessions.of(LOCAL.name)) == {"default", "a"}
        group.cancel_scope.cancel()


async def test_a_session_stopped_for_idleness_makes_room_and_its_name_remembers_why() -> None:
    async with anyio.create_task_group() as group:
        sessions = registry(group, 2)
        sessions.keeper(LOCAL, "default").sandbox = object()  # type: ignore[assignment]
        idle = sessions.keeper(LOCAL, "a")  # no sandbox: as after an idle shutdown
        idle.lost_reason = "the previous sandbox was shut down after 60s without a call."
        newcomer = sessions.keeper(LOCAL, "b")
        assert set(sessions.of(LOCAL.name)) == {"default", "b"}
        newcomer.sandbox = object()  # type: ignore[assignment]
        with pytest.raises(bridge.TooManySessionsError):
            sessions.keeper(LOCAL, "a")  # no room now; when there is, it says why its state is gone
        newcomer.sandbox = None
        assert sessions.keeper(LOCAL, "a").lost_reason == idle.lost_reason
        group.cancel_scope.cancel()


async def test_a_session_in_a_call_or_with_code_running_is_never_forgotten() -> None:
    async with anyio.create_task_group() as group:
        sessions = registry(group, 2)
        sessions.keeper(LOCAL, "default").active_calls = 1
        sessions.keeper(LOCAL, "a").running = object()  # type: ignore[assignment]
        with pytest.raises(bridge.TooManySessionsError):
            sessions.keeper(LOCAL, "b")
        group.cancel_scope.cancel()


async def test_no_session_starts_once_shutdown_has_begun() -> None:
    async with anyio.create_task_group() as group:
        sessions = registry(group, 8)
        sessions.keeper(LOCAL, "a")
        await sessions.begin_shutdown(grace=1.0)
        assert sessions.of(LOCAL.name)["a"].closing.is_set()
        with pytest.raises(bridge.ShuttingDownError):
            sessions.keeper(LOCAL, "b")
        group.cancel_scope.cancel()


# --- through the SDK's client, on both runtimes -----------------------------------------


async def test_two_sessions_keep_separate_state_and_a_reset_of_one_leaves_the_other(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        assert (await call(client, "x = 'default'; runtime.session"))["view"]["value"] == "'default'"
        named = await call(client, "x = 'a'; runtime.session", session="a")
        assert named["view"]["value"] == "'a'" and named["raw"]["session"] == "a", named
        # A call that names no session is the default one, and its result stays as it was.
        plain = await call(client, "x")
        assert plain["view"]["value"] == "'default'" and "session" not in plain["raw"], plain
        assert (await call(client, "x", session="default"))["view"]["value"] == "'default'"
        assert (await call(client, "x", session="a"))["view"]["value"] == "'a'"
        reset = await call(client, "'x' in globals()", session="a", reset=True)
        assert reset["view"]["value"] == "False", reset
        assert (await call(client, "x"))["view"]["value"] == "'default'"
        owner = bridge_pids(state_dir)[0]
        assert len(engine.containers(owner_pid=owner)) == 2
        # Each container carries its session's name (`podman ps --filter label=...session=a`).
        listed = subprocess.run(
            [engine.name, "ps", "--filter", "label=%s.session=a" % CONTAINER_LABEL, "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert len(set(listed.stdout.split()) & set(engine.containers(owner_pid=owner))) == 1
    # Shutdown removes every session's sandbox, not only the default one.
    assert engine.containers(running_only=False, owner_pid=owner) == []


SLOW = """
import time
start = time.time()
time.sleep(2)
(start, time.time())
"""


async def test_calls_to_different_sessions_run_side_by_side(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        for name in ("a", "b"):  # both sandboxes up: what overlaps below is the code
            assert not (await call(client, "pass", session=name))["is_error"]
        spans: dict[str, tuple[float, float]] = {}

        async def slow(name: str) -> None:
            result = await call(client, SLOW, session=name)
            assert result["raw"]["session"] == name, result
            start, end = result["raw"]["value"]
            spans[name] = (start, end)

        async with anyio.create_task_group() as group:
            group.start_soon(slow, "a")
            group.start_soon(slow, "b")
        # Each ran while the other did: both started before either ended.
        assert max(start for start, _ in spans.values()) < min(end for _, end in spans.values()), spans


async def test_calls_to_one_session_stay_one_at_a_time(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        assert not (await call(client, "pass", session="a"))["is_error"]
        results: list[dict[str, Any]] = []

        async def slow() -> None:
            results.append(await call(client, SLOW, session="a"))

        async with anyio.create_task_group() as group:
            group.start_soon(slow)
            group.start_soon(slow)
        (_, first_end), (second_start, _) = sorted(tuple(result["raw"]["value"]) for result in results)
        assert first_end <= second_start, results


async def test_too_many_sessions_and_a_bad_name_are_clear_errors(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MAX_SESSIONS="2")
    async with bridge_client(env) as client:
        assert not (await call(client, "1"))["is_error"]
        assert not (await call(client, "1", session="a"))["is_error"]
        refused = await call(client, "1", session="b")
        assert refused["is_error"] and refused["raw"] is None, refused
        assert (
            "Session 'b' was not started: 2 sessions (a, default) already hold sandboxes" in refused["text"]
        )
        assert "MCP_BRIDGE_MAX_SESSIONS" in refused["text"]
        bad = await call(client, "1", session="Not OK")
        assert bad["is_error"], bad
        assert bad["text"].startswith("Invalid run_python arguments (session: Value error, a session name is")
        assert "1-32 characters of a-z, 0-9, _ and -" in bad["text"]
        assert not (await call(client, "1", session="a"))["is_error"]  # the others still work


async def test_runtime_progress_reaches_the_call_of_its_own_session(engine: Engine, state_dir: Path) -> None:
    # One SandboxAPI serves every session: runtime.progress() in "b" must reach b's call,
    # even while "a" runs code of its own.
    heard: dict[str, list[str]] = {"a": [], "b": []}
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        for name in ("a", "b"):
            assert not (await call(client, "pass", session=name))["is_error"]

        async def run(name: str, code: str) -> None:
            async def listen(progress: float, total: float | None, message: str | None) -> None:
                heard[name].append(message or "")

            await client.call_tool("run_python", {"code": code, "session": name}, progress_callback=listen)

        async with anyio.create_task_group() as group:
            group.start_soon(run, "a", "import time; time.sleep(3)")
            await anyio.sleep(0.5)
            group.start_soon(run, "b", "runtime.progress(1, 2, 'from b'); import time; time.sleep(1)")
    assert "from b" in heard["b"] and "from b" not in heard["a"], json.dumps(heard)


def test_sessions_are_named_in_the_kernels_session_config(tmp_path: Path) -> None:
    runtime = bridge.PodmanEngine("/nonexistent/podman")
    host: Any = SimpleNamespace(server_list=list, config_problems=list)
    session = bridge.Sandbox(runtime, bridge.BridgeConfig(), tmp_path / "ipc", host, session_name="a")
    session.container.prepare_ipc_dir()
    config = json.loads((session.container.ipc_dir / bridge.SESSION_CONFIG_FILENAME).read_text())
    assert config["session"] == "a"
