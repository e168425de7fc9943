"""Remote engines: the bridge reaches Docker or Podman through DOCKER_HOST or CONTAINER_HOST
as it would an engine on another machine, so the kernel cannot come through a bind mount;
it arrives on the container's stdin (the bootstrap). The engines are real and local
(dockerd's loopback TCP listener, started by scripts/setup.sh; a `podman system service`
on a Unix socket, started here), reached only through those endpoints."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    DEFAULT_IMAGE,
    Engine,
    bridge_client,
    bridge_env,
    bridge_pids,
    requested_runtimes,
    structured,
    text_of,
)

pytestmark = [pytest.mark.anyio, pytest.mark.container]

DOCKER_TCP = "tcp://127.0.0.1:%s" % os.environ.get("MCP_TEST_DOCKER_TCP_PORT", "23750")


def _answers(argv: list[str], env: dict[str, str]) -> bool:
    probe = subprocess.run(argv, capture_output=True, timeout=60, check=False, env={**os.environ, **env})
    return probe.returncode == 0


@pytest.fixture(scope="module", params=requested_runtimes())
def remote(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A runtime reached only through its endpoint variable (``Engine.env``)."""
    runtime = str(request.param)
    image = os.environ.get("MCP_BRIDGE_IMAGE", DEFAULT_IMAGE)
    if runtime == "docker":
        env = {"DOCKER_HOST": DOCKER_TCP}
        if not _answers(["docker", "info"], env):
            pytest.fail("dockerd does not listen on %s; run scripts/setup.sh" % DOCKER_TCP)
        yield Engine(runtime, image, env)
        return
    assert shutil.which("podman"), "podman is not installed; run scripts/setup.sh"
    socket = tmp_path_factory.mktemp("podman-service") / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", "unix://%s" % socket],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=socket.parent,  # the service's conmon writes its "oom" marker in its working directory
    )
    env = {"CONTAINER_HOST": "unix://%s" % socket}
    try:
        deadline = time.monotonic() + 30
        while not _answers(["podman", "info", "--format", "{{.Host.ServiceIsRemote}}"], env):
            assert service.poll() is None, "podman system service exited with %s" % service.returncode
            assert time.monotonic() < deadline, "podman system service did not answer on %s" % socket
            time.sleep(0.2)
        yield Engine(runtime, image, env)
    finally:
        service.terminate()
        service.wait(timeout=30)


def remote_env(remote: Engine, state_dir: Path, **overrides: str) -> dict[str, str]:
    return {**bridge_env(remote, state_dir, **overrides), **remote.env}


async def test_a_remote_engine_runs_the_core_acceptance_with_the_kernel_on_stdin(
    remote: Engine, state_dir: Path
) -> None:
    env = remote_env(remote, state_dir, MCP_BRIDGE_MEMORY="128m")
    async with bridge_client(env) as client:
        owner = bridge_pids(state_dir)[0]
        probe = "import os\nx = 41\n(os.path.exists('/ipc'), os.getuid(), os.listdir('/sys/class/net'))"
        first = await client.call_tool("run_python", {"code": probe})
        # No mount, and the same hardening: the sandbox user, no network.
        assert structured(first)["value"] == "(False, 65534, ['lo'])", text_of(first)
        second = await client.call_tool("run_python", {"code": "x + 1"})
        assert structured(second)["value"] == "42"

        timed_out = await client.call_tool("run_python", {"code": "while True: pass", "timeout": 2})
        assert structured(timed_out)["status"] == "timeout", text_of(timed_out)
        assert structured(timed_out)["state_kept"] is True
        assert structured(await client.call_tool("run_python", {"code": "x"}))["value"] == "41"

        oom = await client.call_tool("run_python", {"code": "blob = bytearray(256 * 1024 * 1024)"})
        assert structured(oom)["status"] == "crashed", text_of(oom)
        assert "128m memory limit" in text_of(oom)
        fresh = await client.call_tool("run_python", {"code": "'x' in globals()"})
        assert structured(fresh)["value"] == "False"  # a fresh executor, booted from the payload again

        reset = await client.call_tool("run_python", {"code": "y = 2", "reset": True})
        assert not reset.is_error, text_of(reset)  # a new container, booted over stdin again
        assert len(remote.containers(running_only=False, owner_pid=owner)) == 1
    assert remote.containers(running_only=False, owner_pid=owner) == []  # none leaked


async def test_a_local_engine_keeps_the_mount_unless_stdin_is_chosen(remote: Engine, state_dir: Path) -> None:
    local = bridge_env(remote, state_dir)  # without remote.env: the engine's own socket
    async with bridge_client(local) as client:
        mounted = await client.call_tool("run_python", {"code": "import os\nos.path.exists('/ipc')"})
        assert structured(mounted)["value"] == "True", text_of(mounted)
    async with bridge_client({**local, "MCP_BRIDGE_KERNEL_DELIVERY": "stdin"}) as client:
        chosen = await client.call_tool("run_python", {"code": "import os\nos.path.exists('/ipc')"})
        assert structured(chosen)["value"] == "False", text_of(chosen)
