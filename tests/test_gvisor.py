"""The core acceptance again under gVisor (MCP_BRIDGE_OCI_RUNTIME=runsc), on every runtime
of MCP_TEST_RUNTIMES: state, timeouts (interrupt and hard kill), out of memory, the
hardening probes, exactly the documented writable paths, and the containment checks (a
fork bomb, zombies, forged frames). scripts/setup.sh installs runsc
and registers it with dockerd; a runtime that cannot run it FAILS these tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import IGNORES_INTERRUPTS, Engine, bridge_client, bridge_env, run_cell, text_of
from tests.test_containment import (
    DOCUMENTED_WRITABLE,
    WRITABLE_PATHS,
    check_a_fork_bomb_times_out_and_leaves_no_process_behind,
    check_background_shells_leave_no_zombies,
    check_children_killed_at_a_timeout_do_not_linger_as_zombies,
    check_forged_frames_cannot_make_a_second_result_or_carry_bad_fields,
)
from tests.test_hostile import KERNEL
from tests.test_integration import HARDENING_CHECKS

pytestmark = pytest.mark.anyio


def gvisor_env(engine: Engine, state_dir: Path, **overrides: str) -> dict[str, str]:
    return bridge_env(engine, state_dir, MCP_BRIDGE_OCI_RUNTIME="runsc", **overrides)


run = run_cell


async def test_the_sandbox_really_runs_under_gvisor_and_keeps_state(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(gvisor_env(engine, state_dir)) as client:
        # gVisor's own kernel reports itself in the kernel log it fakes.
        first = await run(client, "import os\nx = 41\nos.uname().release, open('/proc/version').read()")
        assert not first["is_error"], first
        assert "gVisor" in first["value"] or "4.4.0" in first["value"], first
        second = await run(client, "x + 1")
        assert second["value"] == "42", second
        after_reset = await client.call_tool("run_python", {"code": "x", "reset": True})
        assert "NameError" in text_of(after_reset)


async def test_timeouts_under_gvisor_interrupt_then_kill(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(gvisor_env(engine, state_dir)) as client:
        await run(client, "kept = 'yes'\nopen('/tmp/file', 'w').write('kept')")
        interrupted = await run(client, "while True: pass", timeout=2)
        assert interrupted["status"] == "timeout" and interrupted["state_kept"] is True, interrupted
        assert (await run(client, "kept"))["value"] == "'yes'"
        stubborn = await run(client, IGNORES_INTERRUPTS, timeout=2)
        assert stubborn["status"] == "timeout" and stubborn["state_kept"] is False, stubborn
        assert (await run(client, "open('/tmp/file').read()"))["value"] == "'kept'"


async def test_out_of_memory_under_gvisor_is_reported(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(gvisor_env(engine, state_dir, MCP_BRIDGE_MEMORY="128m")) as client:
        await run(client, "kept = 1")
        result = await run(client, "blob = bytearray(256 * 1024 * 1024)")
        assert result["status"] in ("crashed", "error"), result
        if result["status"] == "error":  # gVisor may refuse the allocation instead of killing
            assert "MemoryError" in result["text"], result
        else:
            assert "128m memory limit" in result["text"], result
        after = await run(client, "6 * 7")
        assert after["value"] == "42", after


async def test_hardening_and_writable_paths_hold_under_gvisor(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(gvisor_env(engine, state_dir)) as client:
        hardened = await run(client, HARDENING_CHECKS)
        assert hardened["value"] == "'hardened'", hardened
        writable = await run(client, WRITABLE_PATHS + "writable")
        assert eval(writable["value"]) == DOCUMENTED_WRITABLE, writable


# --- containment: the same bodies as tests/test_containment.py ------------------------------


async def test_a_fork_bomb_under_gvisor_times_out_and_leaves_no_process_behind(
    engine: Engine, state_dir: Path
) -> None:
    # Under gVisor the host's pids limit counts the Sentry's threads, not the code's
    # processes; reaching it used to end the whole sandbox ("exited with code 2").
    await check_a_fork_bomb_times_out_and_leaves_no_process_behind(gvisor_env(engine, state_dir))


# Reaping and frame validation happen inside the sandbox, under the same runsc on either
# engine: checked on the first runtime only (the fork bomb, which meets each engine's pids
# accounting, runs on both).


async def test_children_killed_at_a_timeout_under_gvisor_do_not_linger_as_zombies(
    proxy_engine: Engine, state_dir: Path
) -> None:
    await check_children_killed_at_a_timeout_do_not_linger_as_zombies(gvisor_env(proxy_engine, state_dir))


async def test_background_shells_under_gvisor_leave_no_zombies(proxy_engine: Engine, state_dir: Path) -> None:
    await check_background_shells_leave_no_zombies(gvisor_env(proxy_engine, state_dir))


async def test_forged_frames_under_gvisor_cannot_make_a_second_result_or_carry_bad_fields(
    proxy_engine: Engine, state_dir: Path
) -> None:
    await check_forged_frames_cannot_make_a_second_result_or_carry_bad_fields(
        gvisor_env(proxy_engine, state_dir)
    )


async def test_an_unusable_oci_runtime_is_explained(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_OCI_RUNTIME="/nonexistent/runsc")
    async with bridge_client(env) as client:
        result = await client.call_tool("run_python", {"code": "1"})
        assert result.is_error
        assert "MCP_BRIDGE_OCI_RUNTIME=/nonexistent/runsc" in text_of(result), text_of(result)


# gVisor does not honour PR_SET_DUMPABLE: the code can open /proc/1/fd/1, the channel to the
# bridge itself. The supervisor signs its frames, so what the code writes there is dropped.
FORGE_ON_THE_BRIDGES_CHANNEL = f"""
import json, os
execute_id = {KERNEL}.running_id
try:
    fd = os.open('/proc/1/fd/1', os.O_WRONLY)
except OSError as exc:
    reached = type(exc).__name__
else:
    for frame in (
        {{"type": "stream", "id": execute_id, "name": "stdout", "text": "FORGED OUTPUT"}},
        {{"type": "result", "id": execute_id, "status": "ok", "value": "'FORGED RESULT'"}},
    ):
        os.write(fd, (json.dumps(frame) + "\\n").encode())
        os.write(fd, (json.dumps({{"mac": "0" * 32, "seq": 10**9, **frame}}) + "\\n").encode())
    reached = 'written'
reached
"""


async def test_frames_the_code_writes_on_the_bridges_channel_are_dropped(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(gvisor_env(engine, state_dir)) as client:
        answer = await run(client, FORGE_ON_THE_BRIDGES_CHANNEL)
        assert answer["status"] == "ok", answer
        # Where the channel can be reached at all (gVisor), nothing written there counts.
        assert answer["value"] in ("'written'", "'PermissionError'"), answer
        assert "FORGED" not in answer["text"], answer
        assert (await run(client, "6 * 7"))["value"] == "42"
