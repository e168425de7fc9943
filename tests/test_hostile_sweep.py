"""The start-up sweep on a shared engine: real labelled containers on each runtime, owned
by this host's live and dead processes, by a reused pid, and by other hosts (another
machine on a remote engine, a dev container with its own pid namespace). Only this
host's provably dead owners may lose their sandboxes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

import mcp_server_code_execution_mode as bridge
from mcp_server_code_execution_mode import OwnerIdentity, container_name, process_start_time, sweep_orphans
from tests.conftest import Engine, bridge_client, bridge_env

# Alone: a bridge another test starts meanwhile sweeps this host's dead owners' sandboxes,
# the stand-in orphans of these tests included (seen once in CI, on Docker).
pytestmark = [pytest.mark.anyio, pytest.mark.alone]

# `sleep` as PID 1 ignores SIGTERM, which would make every `rm --force` on Podman wait 10 s.
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 300 & wait']


class Start(Protocol):
    def __call__(self, owner: OwnerIdentity, name: str | None = None) -> str: ...


def this_host() -> str:
    key = bridge.bridge_owner().host_key
    assert key is not None, "this Linux test machine must have a boot id and a pid namespace"
    return key


def other_hosts() -> dict[str, str]:
    """Host keys of bridges that share the engine but not this pid space."""
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    namespace = os.readlink("/proc/self/ns/pid")
    other_namespace = "pid:[%d]" % (int(namespace[5:-1]) + 1)
    other_boot = ("0" if boot_id[0] != "0" else "1") + boot_id[1:]
    keys = {
        "dev container on this kernel": bridge.linux_host_key(boot_id, other_namespace),
        "another machine": bridge.linux_host_key(other_boot, namespace),
    }
    assert all(keys.values()) and this_host() not in keys.values()
    return {situation: key for situation, key in keys.items() if key}


def dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    assert not bridge.process_alive(finished.pid)
    return finished.pid


def dead_bridge() -> OwnerIdentity:
    """A process of this host that has ended; its start time keeps it dead even if
    another process is given its pid meanwhile."""
    process = subprocess.Popen(["sleep", "120"])
    identity = identity_of(process, this_host())
    process.kill()
    process.wait()
    return identity


@pytest.fixture
def live_process() -> Iterator[subprocess.Popen[bytes]]:
    """Stands in for another bridge process on this host."""
    process = subprocess.Popen(["sleep", "120"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def identity_of(process: subprocess.Popen[bytes], host_key: str) -> OwnerIdentity:
    start = process_start_time(process.pid)
    assert start is not None
    return OwnerIdentity(host_key, process.pid, start)


@pytest.fixture
def start_sandbox(engine: Engine) -> Iterator[Start]:
    """Starts a labelled stand-in sandbox for an owner, exactly as the bridge labels its
    own; removes every one it started afterwards, swept or not."""
    started: list[str] = []

    def start(owner: OwnerIdentity, name: str | None = None) -> str:
        name = name or container_name(owner)
        labels = [item for label in owner.labels() for item in ("--label", label)]
        started.append(name)
        subprocess.run(
            [engine.name, "run", "-d", "--name", name, *labels, "--network", "none",
             "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512",
             "--entrypoint", SLEEPER[0], engine.image, *SLEEPER[1:]],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        assert is_running(engine, name)
        return name

    try:
        yield start
    finally:
        # One name per call: Podman 4's `rm --force A B` removes nothing if either is already
        # gone (swept by the test), and exits 0.
        for name in started:
            subprocess.run([engine.name, "rm", "--force", name], capture_output=True, timeout=60, check=False)


def is_running(engine: Engine, name: str) -> bool:
    result = subprocess.run(
        [engine.name, "inspect", "--format", "{{.State.Running}}", name],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return result.returncode == 0 and result.stdout.strip() == "true"


def exists(engine: Engine, name: str) -> bool:
    result = subprocess.run([engine.name, "inspect", name], capture_output=True, timeout=30, check=False)
    return result.returncode == 0


def real_runtime(engine: Engine) -> bridge.ContainerEngine:
    executable = shutil.which(engine.name)
    assert executable is not None
    return bridge.ENGINE_CLASSES[engine.name](executable)  # type: ignore[index]


def ipc_dir_of(ipc_root: Path, owner: OwnerIdentity, name: str) -> Path:
    path = ipc_root / bridge.session_dir_name(owner, name)
    (path / "ipc").mkdir(parents=True)
    (path / "ipc" / "session.json").write_text("{}")
    return path


# --- sweep_orphans against a real engine ----------------------------------------------


@pytest.mark.parametrize("situation", sorted(other_hosts()))
async def test_sweep_leaves_another_hosts_live_sandbox_running(
    engine: Engine, start_sandbox: Start, tmp_path: Path, situation: str
) -> None:
    # Its owner pid is dead HERE; on its own host the bridge is alive and using it.
    theirs = OwnerIdentity(other_hosts()[situation], dead_pid(), 12345)
    name = start_sandbox(theirs)
    their_ipc = ipc_dir_of(tmp_path, theirs, name)

    swept = await sweep_orphans(real_runtime(engine), tmp_path, bridge.bridge_owner())

    assert name not in swept
    assert is_running(engine, name)
    assert (their_ipc / "ipc" / "session.json").is_file()


async def test_sweep_leaves_this_hosts_live_bridges_sandbox_running(
    engine: Engine, start_sandbox: Start, live_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    other_bridge = identity_of(live_process, this_host())
    name = start_sandbox(other_bridge)
    own = start_sandbox(bridge.bridge_owner())
    live_ipc = ipc_dir_of(tmp_path, other_bridge, name)

    swept = await sweep_orphans(real_runtime(engine), tmp_path, bridge.bridge_owner())

    assert name not in swept and own not in swept
    assert is_running(engine, name)
    assert is_running(engine, own)
    assert live_ipc.is_dir()


async def test_sweep_removes_this_hosts_dead_bridges_container(
    engine: Engine, start_sandbox: Start, tmp_path: Path
) -> None:
    gone = dead_bridge()
    name = start_sandbox(gone)
    dead_ipc = ipc_dir_of(tmp_path, gone, name)

    swept = await sweep_orphans(real_runtime(engine), tmp_path, bridge.bridge_owner())

    assert name in swept
    assert not exists(engine, name)
    assert not dead_ipc.exists()


async def test_sweep_removes_an_orphan_whose_pid_was_reused(
    engine: Engine, start_sandbox: Start, live_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    # The sandbox's bridge had this pid before; the live process got it later.
    now = identity_of(live_process, this_host())
    assert now.start_time is not None and now.start_time > 0
    earlier = OwnerIdentity(now.host_key, now.pid, now.start_time - 1)
    name = start_sandbox(earlier)
    orphan_ipc = ipc_dir_of(tmp_path, earlier, name)

    swept = await sweep_orphans(real_runtime(engine), tmp_path, bridge.bridge_owner())

    assert name in swept
    assert not exists(engine, name)
    assert not orphan_ipc.exists()
    assert live_process.poll() is None  # the process that holds the pid now is untouched


async def test_sweep_leaves_this_hosts_sandbox_with_an_unparseable_owner_running(
    engine: Engine, start_sandbox: Start, tmp_path: Path
) -> None:
    labelled_ours = OwnerIdentity(this_host(), dead_pid(), None)
    name = start_sandbox(labelled_ours, "mcp-code-exec-x%d-0badcafe" % labelled_ours.pid)

    swept = await sweep_orphans(real_runtime(engine), tmp_path, bridge.bridge_owner())

    assert name not in swept
    assert is_running(engine, name)


# --- the bridge's own start-up ----------------------------------------------------------


async def test_bridge_start_up_sweeps_this_hosts_dead_sandbox_and_leaves_another_hosts(
    engine: Engine, start_sandbox: Start, state_dir: Path
) -> None:
    dead_here = dead_bridge()
    alive_elsewhere = OwnerIdentity(other_hosts()["another machine"], dead_pid(), None)
    orphan = start_sandbox(dead_here)
    foreign = start_sandbox(alive_elsewhere)
    orphan_ipc = ipc_dir_of(state_dir / "ipc", dead_here, orphan)
    foreign_ipc = ipc_dir_of(state_dir / "ipc", alive_elsewhere, foreign)

    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool("run_python", {"code": "1"})
        assert not result.is_error

    assert not exists(engine, orphan)
    assert not orphan_ipc.exists()
    assert is_running(engine, foreign)
    assert foreign_ipc.is_dir()


def test_other_host_keys_really_differ_from_this_one() -> None:
    # Guards the tests above: a "foreign" key equal to ours would make them vacuous.
    assert len({this_host(), *other_hosts().values()}) == 1 + len(other_hosts())
