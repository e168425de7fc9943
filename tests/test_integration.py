"""The acceptance of the core bridge, end to end: a real MCP stdio client drives the
installed console script, which starts real hardened containers on each runtime."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from tests.conftest import Engine, bridge_client, bridge_env, bridge_pids, console_script, structured, text_of

pytestmark = pytest.mark.anyio


async def test_state_persists_across_calls_until_reset(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        first = await client.call_tool(
            "run_python", {"code": "import math\nx = 41\ndef double(n):\n    return 2 * n"}
        )
        assert not first.is_error, text_of(first)
        second = await client.call_tool("run_python", {"code": "print(x + 1)\ndouble(math.floor(2.5))"})
        assert not second.is_error, text_of(second)
        assert structured(second)["stdout"] == "42\n"
        assert structured(second)["value"] == "4"
        assert text_of(second) == "42\n4"
        after_reset = await client.call_tool("run_python", {"code": "x", "reset": True})
        assert after_reset.is_error
        assert "NameError" in text_of(after_reset)
        assert "Reset" in text_of(after_reset)
        assert len(engine.containers(owner_pid=bridge_pids(state_dir)[0])) == 1


async def test_top_level_await_and_error_traceback_shows_user_code(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        awaited = await client.call_tool(
            "run_python", {"code": "import asyncio\nawait asyncio.sleep(0.01)\n'done'"}
        )
        assert structured(awaited)["value"] == "'done'"
        failed = await client.call_tool("run_python", {"code": "a = 1\n\nraise ValueError('bad value')"})
        assert failed.is_error
        text = text_of(failed)
        assert 'File "<cell-2>", line 3' in text and "ValueError: bad value" in text
        assert "mcp_sandbox_kernel" not in text


async def test_timeout_interrupts_and_keeps_state(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await client.call_tool("run_python", {"code": "kept = 'yes'"})
        owner = bridge_pids(state_dir)[0]
        started = time.monotonic()
        result = await client.call_tool("run_python", {"code": "while True: pass", "timeout": 2})
        elapsed = time.monotonic() - started
        assert result.is_error and structured(result)["status"] == "timeout"
        assert structured(result)["state_kept"] is True
        assert "interrupted" in text_of(result)
        assert elapsed < 10
        assert len(engine.containers(owner_pid=owner)) == 1
        after = await client.call_tool("run_python", {"code": "kept"})
        assert structured(after)["value"] == "'yes'"
        assert structured(after)["notices"] == []


async def test_timeout_kills_code_that_ignores_the_interrupt(engine: Engine, state_dir: Path) -> None:
    stubborn = textwrap.dedent(
        """
        while True:
            try:
                while True:
                    pass
            except KeyboardInterrupt:
                pass
        """
    )
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await client.call_tool("run_python", {"code": "kept = 1"})
        owner = bridge_pids(state_dir)[0]
        container = engine.containers(owner_pid=owner)
        result = await client.call_tool("run_python", {"code": stubborn, "timeout": 1})
        assert structured(result)["status"] == "timeout"
        assert structured(result)["state_kept"] is False
        assert "its processes were killed; a fresh Python process was ready" in text_of(result)
        # The supervisor replaced the executor: the container itself (and its files) stays.
        assert engine.containers(owner_pid=owner) == container
        after = await client.call_tool("run_python", {"code": "'kept' in globals()"})
        assert structured(after)["value"] == "False"


async def test_out_of_memory_is_reported_and_next_call_starts_fresh(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MEMORY="128m")
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    async with bridge_client(env, cwd=workdir) as client:
        await client.call_tool("run_python", {"code": "kept = 1"})
        result = await client.call_tool("run_python", {"code": "blob = bytearray(256 * 1024 * 1024)"})
        assert structured(result)["status"] == "crashed", text_of(result)
        assert "128m memory limit" in text_of(result)
        # The out-of-memory killer picks the executor (it raised its own oom_score_adj), so
        # the supervisor reports it and starts a fresh one in the same container.
        assert "Variables, imports and functions are gone" in text_of(result), text_of(result)
        after = await client.call_tool("run_python", {"code": "'kept' in globals()"})
        assert not after.is_error
        assert structured(after)["value"] == "False"
    assert list(workdir.iterdir()) == []  # nothing (e.g. conmon's "oom" marker) left in the cwd


HARDENING_CHECKS = textwrap.dedent(
    """
    import os, socket, pathlib
    def status(field):
        for line in open('/proc/self/status'):
            if line.startswith(field + ':'):
                return line.split()[1]
    try:
        socket.create_connection(('1.1.1.1', 53), timeout=2)
        outbound = 'connected'
    except OSError as exc:
        outbound = 'blocked'
    try:
        open('/usr/evil', 'w')
        usr = 'writable'
    except OSError:
        usr = 'read-only'
    for directory in ('/tmp', '/workspace'):
        pathlib.Path(directory, 'probe.txt').write_text('ok')
        assert pathlib.Path(directory, 'probe.txt').read_text() == 'ok'
    assert outbound == 'blocked', outbound
    assert sorted(os.listdir('/sys/class/net')) == ['lo'], os.listdir('/sys/class/net')
    assert usr == 'read-only', usr
    assert os.getuid() == 65534 and os.getgid() == 65534, (os.getuid(), os.getgid())
    assert int(status('CapEff'), 16) == 0, status('CapEff')
    import ctypes  # prctl(PR_GET_NO_NEW_PRIVS): gVisor's /proc/self/status has no NoNewPrivs line
    assert ctypes.CDLL(None).prctl(39, 0, 0, 0, 0) == 1
    assert os.getcwd() == '/workspace'
    try:
        open('/ipc/mcp_sandbox_kernel.py', 'a')
        ipc = 'writable'
    except OSError:
        ipc = 'read-only'
    assert ipc == 'read-only'
    'hardened'
    """
)


async def test_sandbox_is_hardened(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool("run_python", {"code": HARDENING_CHECKS})
        assert not result.is_error, text_of(result)
        assert structured(result)["value"] == "'hardened'"


async def test_hostile_output_leaves_channel_intact(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        flood = await client.call_tool("run_python", {"code": "print('<' + 'y' * 10_000_000 + '>')"})
        assert not flood.is_error, text_of(flood)[:500]
        # At most the budget, its head and its tail, and where the whole of it is.
        cut = structured(flood)["truncated"]["stdout"]
        assert cut["characters"] == 10_000_003 - 20_000
        head, marker, tail = text_of(flood).split("\n")
        assert head == "<" + "y" * 9_999 and tail == "y" * 9_998 + ">"  # the final newline is cut off
        assert "9,980,003 characters of stdout cut" in marker and cut["file"] in marker
        whole = await client.call_tool(
            "run_python", {"code": "text = open(%r).read()\nlen(text), text[:2], text[-3:]" % cut["file"]}
        )
        assert structured(whole)["value"] == "(10000003, '<y', 'y>\\n')"
        hostile = (
            "import os, subprocess\n"
            "os.write(1, b'{not a frame\\n')\n"
            "os.write(1, bytes(range(256)))\n"
            "subprocess.run(['echo', 'hi'])\n"
            "print('after')"
        )
        junk = await client.call_tool("run_python", {"code": hostile})
        assert not junk.is_error, text_of(junk)
        stdout = structured(junk)["stdout"]
        assert stdout.startswith("{not a frame\n") and stdout.endswith("hi\nafter\n")
        still = await client.call_tool("run_python", {"code": "6 * 7"})
        assert structured(still)["value"] == "42"


async def test_idle_shutdown_then_fresh_session_says_so(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_IDLE_TIMEOUT="2")) as client:
        await client.call_tool("run_python", {"code": "kept = 1"})
        owner = bridge_pids(state_dir)[0]
        await anyio.sleep(5)
        assert engine.containers(owner_pid=owner) == []
        after = await client.call_tool("run_python", {"code": "'kept' in globals()"})
        assert structured(after)["value"] == "False"
        assert "without a call" in text_of(after)


async def test_clean_exit_leaves_no_container(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await client.call_tool("run_python", {"code": "1"})
        owner = bridge_pids(state_dir)[0]
        assert len(engine.containers(owner_pid=owner)) == 1
    assert engine.containers(running_only=False, owner_pid=owner) == []
    assert not (state_dir / "ipc").exists() or list((state_dir / "ipc").iterdir()) == []


def test_sigkilled_bridge_leaves_no_running_container(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_PREWARM="1")
    bridge = subprocess.Popen([console_script()], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not engine.containers(owner_pid=bridge.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.containers(owner_pid=bridge.pid), "the pre-warmed container never appeared"
        bridge.send_signal(signal.SIGKILL)
        bridge.wait(5)
        time.sleep(10)
        assert engine.containers(owner_pid=bridge.pid) == []
    finally:
        bridge.kill()
        bridge.wait()
        # One name per call: Podman 4's `rm -f A B` removes nothing if either is gone (exit 0).
        for leftover in engine.containers(running_only=False, owner_pid=bridge.pid):
            subprocess.run([engine.name, "rm", "-f", leftover], capture_output=True, check=False)


def test_sigterm_removes_the_container(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir)
    bridge = subprocess.Popen([console_script()], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not engine.containers(owner_pid=bridge.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.containers(owner_pid=bridge.pid)
    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(20) == 0
    assert engine.containers(running_only=False, owner_pid=bridge.pid) == []


async def test_without_a_runtime_the_server_starts_and_explains(state_dir: Path, tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = bridge_env(None, state_dir, PATH=str(empty_bin))
    async with bridge_client(env) as client:
        tools = await client.list_tools()
        assert [tool.name for tool in tools.tools] == ["run_python"]
        result = await client.call_tool("run_python", {"code": "print(1)"})
        assert result.is_error
        text = text_of(result)
        assert "No container runtime is available" in text
        assert "Install Podman" in text and "Docker" in text


async def test_invalid_arguments_get_a_clear_error(state_dir: Path, tmp_path: Path) -> None:
    env = bridge_env(None, state_dir, PATH=str(tmp_path), MCP_BRIDGE_MAX_TIMEOUT="60")
    async with bridge_client(env) as client:
        too_long = await client.call_tool("run_python", {"code": "1", "timeout": 600})
        assert too_long.is_error and "timeout" in text_of(too_long) and "60" in text_of(too_long)
        missing = await client.call_tool("run_python", {"source": "1"})
        assert missing.is_error and "code" in text_of(missing)


async def test_capabilities_resource_and_small_tool_listing(state_dir: Path, tmp_path: Path) -> None:
    env = bridge_env(None, state_dir, PATH=str(tmp_path))
    async with bridge_client(env) as client:
        resources = await client.list_resources()
        uris = [str(resource.uri) for resource in resources.resources]
        assert uris == ["resource://code-execution/capabilities"]
        manual = await client.read_resource(uris[0])
        assert "persists" in manual.contents[0].text  # type: ignore[union-attr]
        tools = await client.list_tools()
        description = tools.tools[0].description or ""
        assert "resource://code-execution/capabilities" in description
        assert len(description) < 400


def test_bad_configuration_stops_startup_with_one_line(state_dir: Path) -> None:
    env = bridge_env(None, state_dir, MCP_BRIDGE_TIMEOUT="soon")
    result = subprocess.run(
        [console_script()],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "MCP_BRIDGE_TIMEOUT" in result.stderr and "Traceback" not in result.stderr


async def test_user_code_closing_stdout_does_not_silence_later_calls(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        closing = await client.call_tool(
            "run_python", {"code": "import os, sys\nsys.stdout.close()\nos.close(1)\nos.close(2)"}
        )
        assert not closing.is_error, text_of(closing)
        after = await client.call_tool(
            "run_python", {"code": "import sys\nprint('visible')\nprint('err', file=sys.stderr)"}
        )
        assert structured(after)["stdout"] == "visible\n"
        assert structured(after)["stderr"] == "err\n"


async def test_code_larger_than_the_frame_cap_gets_a_clear_error(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(
        engine, state_dir, MCP_BRIDGE_MAX_FRAME_BYTES="100000", MCP_BRIDGE_MAX_TOOL_RESULT_BYTES="40000"
    )
    async with bridge_client(env) as client:
        big = await client.call_tool("run_python", {"code": "x = '" + "a" * 200_000 + "'"})
        assert big.is_error
        assert "too large" in text_of(big) and "MCP_BRIDGE_MAX_FRAME_BYTES" in text_of(big)
        fine = await client.call_tool("run_python", {"code": "len('" + "a" * 50_000 + "')"})
        assert structured(fine)["value"] == "50000"


async def test_a_large_value_and_output_arrive_intact_below_the_caps(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MAX_OUTPUT="3100000")
    async with bridge_client(env) as client:
        result = await client.call_tool("run_python", {"code": "print('z' * 2_000_000)\n'v' * 1_000_000"})
        assert not result.is_error
        assert structured(result)["stdout"] == "z" * 2_000_000 + "\n"
        assert structured(result)["value"] == repr("v" * 1_000_000)


async def test_cancelled_call_stops_the_code(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await client.call_tool("run_python", {"code": "kept = 1"})
        with anyio.move_on_after(1):
            await client.call_tool("run_python", {"code": "import time\ntime.sleep(60)", "timeout": 100})
        started = time.monotonic()
        after = await client.call_tool("run_python", {"code": "kept"})
        assert time.monotonic() - started < 10
        assert structured(after)["value"] == "1"


async def test_an_unusable_state_directory_is_reported_not_fatal(engine: Engine, tmp_path: Path) -> None:
    not_a_directory = tmp_path / "state-file"
    not_a_directory.write_text("")
    async with bridge_client(bridge_env(engine, not_a_directory)) as client:
        await anyio.sleep(1)  # let the pre-warm fail in the background
        result = await client.call_tool("run_python", {"code": "1"})
        assert result.is_error
        assert "MCP_BRIDGE_STATE_DIR" in text_of(result)
        tools = await client.list_tools()  # the server is still up
        assert [tool.name for tool in tools.tools] == ["run_python"]


async def test_a_missing_image_is_explained_once_then_not_retried_until_it_exists(
    engine: Engine, state_dir: Path
) -> None:
    missing = "localhost/mcp-test-missing-%d:latest" % time.monotonic_ns()
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_IMAGE=missing)) as client:
        first = await client.call_tool("run_python", {"code": "1"})
        again = await client.call_tool("run_python", {"code": "1"})
        assert first.is_error and again.is_error
        assert "Set MCP_BRIDGE_IMAGE" in text_of(first) and "Tried: `%s run ... %s`" % (
            engine.name,
            missing,
        ) in (text_of(first))
        assert "not retried: the image %s is not on this machine" % missing in text_of(again)
        subprocess.run([engine.name, "tag", engine.image, missing], check=True, capture_output=True)
        try:
            recovered = await client.call_tool("run_python", {"code": "6 * 7"})
            assert not recovered.is_error and structured(recovered)["value"] == "42", text_of(recovered)
        finally:
            subprocess.run([engine.name, "rmi", missing], check=False, capture_output=True)


async def test_a_container_that_fails_to_start_from_a_present_image_does_not_blame_the_image(
    engine: Engine, state_dir: Path
) -> None:
    # The image is there; the engine refuses the run itself (no such user in the image).
    user = "no-such-user-%d" % time.monotonic_ns()
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_CONTAINER_USER=user)) as client:
        for _ in range(2):  # and it is retried, not answered from the first failure
            result = await client.call_tool("run_python", {"code": "1"})
            text = text_of(result)
            assert result.is_error
            assert "The sandbox container did not start: " in text, text
            assert user in text, text  # the engine's reason, from its output
            assert "(the image is on this machine)" in text, text
            assert "MCP_BRIDGE_IMAGE" not in text and "could not be found or pulled" not in text, text
            assert "not retried" not in text, text
