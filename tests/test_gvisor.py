"""The core acceptance again under gVisor (MCP_BRIDGE_OCI_RUNTIME=runsc), on every runtime
of MCP_TEST_RUNTIMES: state, timeouts (interrupt and hard kill), out of memory, the
hardening probes, exactly the documented writable paths. scripts/setup.sh installs runsc
and registers it with dockerd; a runtime that cannot run it FAILS these tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import IGNORES_INTERRUPTS, Engine, bridge_client, bridge_env, run_cell, text_of
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
        writable = await run(
            client,
            """
            import os
            writable = []
            for path in ("/", "/etc", "/usr", "/var/tmp", "/run", "/ipc", "/tmp", "/workspace", "/dev/shm"):
                try:
                    with open(os.path.join(path, "probe"), "w"):
                        pass
                    writable.append(path)
                except OSError:
                    pass
            writable
            """,
        )
        assert writable["value"] == "['/tmp', '/workspace', '/dev/shm']", writable


async def test_an_unusable_oci_runtime_is_explained(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_OCI_RUNTIME="/nonexistent/runsc")
    async with bridge_client(env) as client:
        result = await client.call_tool("run_python", {"code": "1"})
        assert result.is_error
        assert "MCP_BRIDGE_OCI_RUNTIME=/nonexistent/runsc" in text_of(result), text_of(result)
