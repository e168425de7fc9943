"""The kernel promises any CPython >= 3.9 in the user's image. This runs the whole
kernel (execution, capture, interrupts, the sandbox API) on Debian bullseye's Python 3.9,
through a real MCP client and a real container."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import (
    Engine,
    bridge_client,
    bridge_env,
    claude_desktop_home,
    requested_runtimes,
    structured,
    stub_entry,
    text_of,
)
from tests.test_proxy import run_ok
from tests.test_server_config import broken_servers_json, check_a_broken_config_file_is_named

pytestmark = [pytest.mark.anyio, pytest.mark.container]

OLDEST_IMAGE = os.environ.get("MCP_TEST_OLDEST_IMAGE", "localhost/mcp-sandbox-python:bullseye")


@pytest.fixture(scope="module")
def oldest_engine() -> Engine:
    engine = Engine(requested_runtimes()[0], OLDEST_IMAGE)
    probe = subprocess.run([engine.name, "image", "inspect", OLDEST_IMAGE], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.fail("%s cannot see %s; run scripts/setup.sh" % (engine.name, OLDEST_IMAGE))
    return engine


async def test_the_kernel_works_on_python_3_9(oldest_engine: Engine, state_dir: Path, tmp_path: Path) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    env = bridge_env(oldest_engine, state_dir, HOME=str(home))
    async with bridge_client(env) as client:
        version = await run_ok(client, "import sys\nsys.version_info[:2]")
        assert version["value"] == "(3, 9)"
        await run_ok(client, "import subprocess, os\ndef double(n):\n    return 2 * n\nx = 21")
        mixed = await run_ok(
            client,
            "import asyncio\nawait asyncio.sleep(0)\nos.write(1, b'fd\\n')\n"
            "subprocess.run(['echo', 'child'])\nprint(double(x))\nx",
        )
        assert mixed["stdout"] == "fd\nchild\n42\n" and mixed["value"] == "21"
        failed = await client.call_tool("run_python", {"code": "y = 1\nraise KeyError('k')"})
        assert 'File "<cell-4>", line 2' in text_of(failed) and "mcp_sandbox_kernel" not in text_of(failed)
        timed = await client.call_tool("run_python", {"code": "while True: pass", "timeout": 1})
        assert structured(timed)["status"] == "timeout" and structured(timed)["state_kept"] is True
        proxied = await run_ok(
            client,
            """
            import asyncio
            from mcp import runtime
            sync_value = None
            pairs = await asyncio.gather(*(mcp_stub.pair(a=n) for n in range(3)))
            try:
                await mcp_stub.fail(message="old python")
            except runtime.MCPToolError as exc:
                failure = str(exc)
            (pairs[2], failure)
            """,
        )
        assert (
            proxied["value"]
            == "({'sum': 4, 'product': 4}, 'stub.fail failed: Error executing tool fail: old python')"
        )
        plain = await run_ok(client, "mcp_stub.pair(a=5)['sum']")
        assert plain["value"] == "7"


async def test_the_stdin_bootstrap_works_on_python_3_9(oldest_engine: Engine, state_dir: Path) -> None:
    # BOOTSTRAP and the boot payload, as a remote engine or a Pod receives the kernel.
    env = bridge_env(oldest_engine, state_dir, MCP_BRIDGE_KERNEL_DELIVERY="stdin")
    async with bridge_client(env) as client:
        booted = await run_ok(
            client, "import os, sys\nx = 1\nprint(sys.version_info[:2], os.path.exists('/ipc'))"
        )
        assert booted["stdout"] == "(3, 9) False\n", booted
        killed = await client.call_tool("run_python", {"code": "import os\nos._exit(1)"})
        assert structured(killed)["status"] == "crashed", text_of(killed)
        assert (await run_ok(client, "'x' in globals()"))[
            "value"
        ] == "False"  # a fresh executor, booted again


async def test_a_missing_server_is_explained_on_python_3_9(
    oldest_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # 3.9's NameError has no .name: the kernel reads the name from Python's message.
    home, _, problem = broken_servers_json(tmp_path, state_dir)
    async with bridge_client(bridge_env(oldest_engine, state_dir, HOME=str(home))) as client:
        await check_a_broken_config_file_is_named(client, problem)
