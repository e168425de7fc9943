"""Container runtime section: the hardened run argv, container naming, orphan sweeping
and runtime detection. Runtime CLIs are stood in for by harmless real commands."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import mcp_sandbox_kernel
import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import BOOTSTRAP, FailedTool
from mcp_server_code_execution_mode import (
    INSTALL_ENGINE,
    ContainerEngine,
    DockerEngine,
    EngineUnavailableError,
    LaunchSpec,
    NoEngineError,
    OwnerIdentity,
    PodmanEngine,
    build_run_argv,
    container_name,
    detect_engine,
    engine_problem,
    owner_gone,
    owner_of,
    sweep_orphans,
)

LABEL = "io.github.mcp-server-code-execution-mode"
HOST = "0123456789abcdef"
OWNER = OwnerIdentity(HOST, 4242, 987654)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def spec(**overrides: object) -> LaunchSpec:
    values: dict[str, object] = {
        "name": "mcp-code-exec-4242.987654-0badcafe",
        "image": "python:3.14-slim",
        "ipc_dir": Path("/home/u/MCPs/ipc/0123456789abcdef.mcp-code-exec-4242.987654-0badcafe/ipc"),
        "owner": OWNER,
        "memory": "512m",
        "pids": 128,
        "cpus": 1.5,
        "user": "65534:65534",
    }
    values.update(overrides)
    return LaunchSpec(**values)  # type: ignore[arg-type]


def values_of(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag` in argv (flags take their value as the next item)."""
    return [argv[index + 1] for index, item in enumerate(argv[:-1]) if item == flag]


def options_part(argv: list[str]) -> list[str]:
    """The runtime's options: everything before the image."""
    return argv[: argv.index("python:3.14-slim")]


# --- build_run_argv -------------------------------------------------------------------


def test_run_argv_is_exactly_the_hardened_command() -> None:
    assert PodmanEngine("/usr/bin/podman").run_argv(spec()) == [
        "/usr/bin/podman", "run",
        "--interactive",
        "--rm",
        "--name", "mcp-code-exec-4242.987654-0badcafe",
        "--label", "io.github.mcp-server-code-execution-mode=1",
        "--label", "io.github.mcp-server-code-execution-mode.owner-pid=4242",
        "--label", "io.github.mcp-server-code-execution-mode.owner-start=987654",
        "--label", "io.github.mcp-server-code-execution-mode.owner-host=0123456789abcdef",
        "--label", "io.github.mcp-server-code-execution-mode.session=default",
        "--network", "none",
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--user", "65534:65534",
        "--memory", "512m",
        "--memory-swap", "512m",
        "--pids-limit", "128",
        "--cpus", "1.5",
        "--ulimit", "nofile=1024:1024",
        "--ulimit", "nproc=512:512",
        "--tmpfs", "/tmp:rw,nosuid,nodev,noexec,size=131072k,mode=1777",
        "--tmpfs", "/workspace:rw,nosuid,nodev,noexec,size=131072k,mode=1777",
        "--shm-size", "65536k",
        "--tmpfs", "/dev/mqueue:ro,nosuid,nodev,noexec,size=4k",
        "--volume", "/home/u/MCPs/ipc/0123456789abcdef.mcp-code-exec-4242.987654-0badcafe/ipc:/ipc:ro",
        "--env", "HOME=/workspace",
        "--env", "PYTHONDONTWRITEBYTECODE=1",
        "--env", "PYTHONIOENCODING=utf-8",
        "--entrypoint", "python3",
        "python:3.14-slim",
        "-I",
        "/ipc/mcp_sandbox_kernel.py",
        "/ipc/session.json",
    ]  # fmt: skip


def test_run_argv_has_no_network() -> None:
    argv = build_run_argv("docker", spec())

    assert values_of(argv, "--network") == ["none"]
    assert not any(item.startswith("--network=") or item == "--net" for item in argv)


def test_run_argv_has_read_only_root() -> None:
    assert "--read-only" in options_part(build_run_argv("docker", spec()))


def test_run_argv_drops_all_capabilities() -> None:
    argv = build_run_argv("docker", spec())

    assert values_of(argv, "--cap-drop") == ["ALL"]
    assert "--cap-add" not in argv
    assert "--privileged" not in argv


def test_run_argv_forbids_new_privileges() -> None:
    assert values_of(build_run_argv("docker", spec()), "--security-opt") == ["no-new-privileges"]


def test_run_argv_memory_swap_equals_memory() -> None:
    argv = build_run_argv("docker", spec(memory="2g"))

    assert values_of(argv, "--memory") == ["2g"]
    assert values_of(argv, "--memory-swap") == ["2g"]


def test_run_argv_sets_pids_cpus_and_user_from_the_spec() -> None:
    argv = build_run_argv("docker", spec(pids=64, cpus=2.0, user="1000:1000"))

    assert values_of(argv, "--pids-limit") == ["64"]
    assert values_of(argv, "--cpus") == ["2"]
    assert values_of(argv, "--user") == ["1000:1000"]


def test_run_argv_sets_explicit_ulimits() -> None:
    ulimits = values_of(build_run_argv("docker", spec()), "--ulimit")

    assert sorted(ulimits) == ["nofile=1024:1024", "nproc=512:512"]


def test_run_argv_mounts_tmp_and_workspace_as_tmpfs_writable_by_anyone() -> None:
    tmpfs = dict(entry.split(":", 1) for entry in values_of(build_run_argv("docker", spec()), "--tmpfs"))

    assert set(tmpfs) == {"/tmp", "/workspace", "/dev/mqueue"}
    assert "ro" in tmpfs.pop("/dev/mqueue").split(",")  # hides the engines' writable mqueue mount
    for options in tmpfs.values():
        mount_options = options.split(",")
        assert "mode=1777" in mount_options
        assert "rw" in mount_options
        assert "nosuid" in mount_options
        assert "nodev" in mount_options


def test_run_argv_tmpfs_mounts_are_noexec() -> None:
    for entry in values_of(build_run_argv("docker", spec()), "--tmpfs"):
        assert "noexec" in entry.split(":", 1)[1].split(","), entry


def test_run_argv_leaves_the_workdir_to_the_kernel() -> None:
    # Docker would re-create a --workdir that is a tmpfs mount point as 0755 root.
    assert "--workdir" not in build_run_argv("docker", spec())


def test_run_argv_mounts_the_ipc_directory_read_only() -> None:
    argv = build_run_argv("docker", spec(ipc_dir=Path("/state/ipc/x/ipc")))

    assert values_of(argv, "--volume") == ["/state/ipc/x/ipc:/ipc:ro"]
    assert "--mount" not in argv
    assert not any(item == "-v" for item in argv)


def test_run_argv_labels_the_container_with_its_owner_and_session() -> None:
    labels = values_of(
        build_run_argv("docker", spec(owner=OwnerIdentity("feedfacefeedface", 77, 12), session="data")),
        "--label",
    )

    assert labels == [
        LABEL + "=1",
        LABEL + ".owner-pid=77",
        LABEL + ".owner-start=12",
        LABEL + ".owner-host=feedfacefeedface",
        LABEL + ".session=data",
    ]


def test_run_argv_labels_an_unreadable_identity_as_unknown() -> None:
    labels = values_of(build_run_argv("docker", spec(owner=OwnerIdentity(None, 77, None))), "--label")

    assert labels == [
        LABEL + "=1",
        LABEL + ".owner-pid=77",
        LABEL + ".owner-start=unknown",
        LABEL + ".owner-host=unknown",
        LABEL + ".session=default",
    ]


def test_run_argv_runs_the_kernel_isolated_from_the_image_environment() -> None:
    argv = build_run_argv("docker", spec(image="my/image:1"))

    assert argv[argv.index("my/image:1") + 1 :] == ["-I", "/ipc/mcp_sandbox_kernel.py", "/ipc/session.json"]
    assert values_of(argv, "--entrypoint") == ["python3"]


def test_run_argv_is_the_same_for_podman_and_docker_but_podmans_tmpfs_flag() -> None:
    podman = PodmanEngine("/bin/podman").run_argv(spec())
    docker = DockerEngine("/bin/docker").run_argv(spec())

    # Only Podman needs telling not to add its own writable tmpfs mounts.
    assert [item for item in podman[1:] if item != "--read-only-tmpfs=false"] == docker[1:]
    assert podman[0] == "/bin/podman"
    assert docker[0] == "/bin/docker"


def test_kill_and_list_argv_target_only_this_hosts_labelled_containers() -> None:
    runtime = DockerEngine("/bin/docker")

    assert runtime.kill_argv("c1") == ["/bin/docker", "rm", "--force", "c1"]
    # Podman would wait its 10 s stop timeout for PID 1 first.
    assert PodmanEngine("/bin/podman").kill_argv("c1") == [
        "/bin/podman",
        "rm",
        "--force",
        "--time",
        "0",
        "c1",
    ]
    assert runtime.list_argv(HOST) == [
        "/bin/docker", "ps", "--all", "--filter", "label=%s.owner-host=%s" % (LABEL, HOST),
        "--format", "{{.Names}}",
    ]  # fmt: skip


def test_runtime_classes_map_names_to_strategies() -> None:
    assert dict(bridge.ENGINE_CLASSES) == {"podman": PodmanEngine, "docker": DockerEngine}
    assert PodmanEngine.name == "podman"
    assert DockerEngine.name == "docker"


# --- owner identity -------------------------------------------------------------------

BOOT_ID = "6f1c1d2e-3a4b-4c5d-8e9f-0a1b2c3d4e5f"


def test_linux_host_key_is_16_hex_digits_and_stable() -> None:
    key = bridge.linux_host_key(BOOT_ID + "\n", "pid:[4026531836]")

    assert key is not None and len(key) == 16 and int(key, 16) >= 0
    assert bridge.linux_host_key(BOOT_ID, "pid:[4026531836]") == key


def test_linux_host_key_differs_per_pid_namespace_and_per_boot() -> None:
    key = bridge.linux_host_key(BOOT_ID, "pid:[4026531836]")
    other_boot = "0" + BOOT_ID[1:]

    assert bridge.linux_host_key(BOOT_ID, "pid:[4026532999]") != key  # a dev container, same kernel
    assert bridge.linux_host_key(other_boot, "pid:[4026531836]") != key  # the next boot, or another machine


@pytest.mark.parametrize(
    ("boot_id", "pid_namespace"),
    [
        ("", "pid:[4026531836]"),
        ("not-a-boot-id", "pid:[4026531836]"),
        (BOOT_ID.upper() + "x", "pid:[4026531836]"),
        (BOOT_ID, ""),
        (BOOT_ID, "net:[4026531836]"),
        (BOOT_ID, "pid:[]"),
        (BOOT_ID, "/proc/self/ns/pid"),
    ],
)
def test_linux_host_key_refuses_unparseable_sources(boot_id: str, pid_namespace: str) -> None:
    assert bridge.linux_host_key(boot_id, pid_namespace) is None


def test_darwin_host_key_reads_the_boot_second_not_the_microseconds() -> None:
    booted = "{ sec = 1700000000, usec = 123456 } Tue Nov 14 22:13:20 2023\n"
    key = bridge.darwin_host_key("mac.local", booted)

    assert key is not None and len(key) == 16
    assert bridge.darwin_host_key("mac.local", booted.replace("123456", "999")) == key
    assert bridge.darwin_host_key("mac.local", booted.replace("1700000000", "1700000001")) != key
    assert bridge.darwin_host_key("other.local", booted) != key


@pytest.mark.parametrize(
    ("hostname", "boottime"),
    [("mac.local", ""), ("mac.local", "sysctl: unknown oid 'kern.boottime'"), ("", "{ sec = 1, usec = 2 }")],
)
def test_darwin_host_key_refuses_unparseable_sources(hostname: str, boottime: str) -> None:
    assert bridge.darwin_host_key(hostname, boottime) is None


def stat_line(command: str, start_time: str) -> str:
    """A /proc/<pid>/stat line: pid, (comm), then fields 3..21, starttime (22), more."""
    fields_3_to_21 = ["S"] + [str(number) for number in range(4, 22)]
    return "4242 (%s) %s %s 18000000 250 0\n" % (command, " ".join(fields_3_to_21), start_time)


def test_parse_start_time_reads_field_22_even_when_the_command_name_has_spaces_and_parens() -> None:
    assert bridge.parse_start_time(stat_line("python3", "555")) == 555
    assert bridge.parse_start_time(stat_line("evil) 1 2 (x) 3", "31337")) == 31337


@pytest.mark.parametrize(
    "stat",
    [
        "",
        "4242 python3 S 1 2 3",
        "4242 (python3) S 1 2 3",
        "(x) " + "1 " * 30,
        stat_line("python3", "-5"),
        stat_line("python3", "x"),
        stat_line("python3", "555").replace("(", ""),
    ],
)
def test_parse_start_time_refuses_unparseable_lines(stat: str) -> None:
    assert bridge.parse_start_time(stat) is None


def test_process_start_time_tells_a_reused_pid_from_its_first_owner() -> None:
    mine = bridge.process_start_time(os.getpid())
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert mine is not None and mine == bridge.process_start_time(os.getpid())
        child_start = bridge.process_start_time(child.pid)
        assert child_start is not None and child_start >= mine
    finally:
        child.kill()
        child.wait()
    assert bridge.process_start_time(child.pid) is None


def test_bridge_owner_on_linux_names_this_boot_namespace_and_process() -> None:
    owner = bridge.bridge_owner()

    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text()
    assert owner.host_key == bridge.linux_host_key(boot_id, os.readlink("/proc/self/ns/pid"))
    assert owner.host_key is not None
    assert owner.pid == os.getpid()
    assert owner.start_time == bridge.process_start_time(os.getpid())
    assert bridge.bridge_owner() is owner  # read once


LIVE_PID, DEAD_PID = 1111, 2222
LIVE_START = 500


def alive(pid: int) -> bool:
    return pid == LIVE_PID


def start_time_of(pid: int) -> int | None:
    return LIVE_START if pid == LIVE_PID else None


@pytest.mark.parametrize(
    ("pid", "start", "gone"),
    [
        (DEAD_PID, None, True),  # no such process
        (DEAD_PID, 7, True),
        (LIVE_PID, LIVE_START, False),  # the owner itself
        (LIVE_PID, LIVE_START + 1, True),  # the pid now belongs to a later process
        (LIVE_PID, None, False),  # start time unknown: the alive check decides
    ],
)
def test_owner_gone_only_when_provably_dead(pid: int, start: int | None, gone: bool) -> None:
    assert owner_gone(pid, start, alive=alive, start_time_of=start_time_of) is gone


def test_owner_gone_keeps_a_live_pid_whose_start_time_cannot_be_read() -> None:
    assert owner_gone(LIVE_PID, 7, alive=alive, start_time_of=lambda pid: None) is False


# --- naming ---------------------------------------------------------------------------


def test_container_name_round_trips_through_owner_of() -> None:
    name = container_name(OwnerIdentity(HOST, 31337, 9001))

    assert name.startswith("mcp-code-exec-31337.9001-")
    assert owner_of(name) == (31337, 9001)


def test_container_name_without_a_start_time_round_trips_through_owner_of() -> None:
    name = container_name(OwnerIdentity(None, 31337, None))

    assert name.startswith("mcp-code-exec-31337-")
    assert owner_of(name) == (31337, None)


def test_container_names_are_unique_per_call() -> None:
    assert len({container_name(OWNER) for _ in range(50)}) == 50


@pytest.mark.parametrize(
    "name",
    [
        "mcp-code-exec-abc-0badcafe",
        "mcp-code-exec-123",
        "mcp-code-exec-123-",
        "mcp-code-exec-123-XYZ",
        "mcp-code-exec--0badcafe",
        "mcp-code-exec-123.-0badcafe",
        "mcp-code-exec-.5-0badcafe",
        "mcp-code-exec-123.x-0badcafe",
        "mcp-code-exec-123.5.6-0badcafe",
        "mcp-code-exec-123-5-0badcafe",
        "other-mcp-code-exec-123-0badcafe",
        "mcp-code-exec-123-0badcafe-extra",
        "mcp-code-exec-123-0badcafe\n",
        "postgres",
        "",
    ],
)
def test_owner_of_rejects_foreign_names(name: str) -> None:
    assert owner_of(name) is None


def test_process_alive_tells_live_from_reaped_processes() -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()

    assert bridge.process_alive(os.getpid()) is True
    assert bridge.process_alive(finished.pid) is False


# --- sweep_orphans --------------------------------------------------------------------


class FakeRuntime(ContainerEngine):
    """`ps` is printf emitting the given names; `rm` is `true`, recorded."""

    name = "docker"

    def __init__(self, names: list[str], list_fails: bool = False) -> None:
        super().__init__("fake-runtime")
        self.names = names
        self.list_fails = list_fails
        self.listed_hosts: list[str] = []
        self.killed: list[str] = []

    def list_argv(self, host_key: str) -> list[str]:
        self.listed_hosts.append(host_key)
        if self.list_fails:
            return ["false"]
        return ["printf", "%s\\n", *self.names]

    def kill_argv(self, container: str) -> list[str]:
        self.killed.append(container)
        return ["true", container]

    async def check_ready(self) -> None:
        pass


def make_ipc_dir(root: Path, name: str, host: str | None = HOST) -> Path:
    path = root / (name if host is None else "%s.%s" % (host, name)) / "ipc"
    path.mkdir(parents=True)
    (path / "session.json").write_text("{}")
    return path.parent


async def sweep(runtime: FakeRuntime, ipc_root: Path, owner: OwnerIdentity = OWNER) -> list[str]:
    return await sweep_orphans(runtime, ipc_root, owner, alive=alive, start_time_of=start_time_of)


@pytest.mark.anyio
async def test_sweep_lists_only_this_hosts_containers_and_removes_only_provably_dead_owners() -> None:
    names = [
        "mcp-code-exec-%d.%d-0000aaaa" % (LIVE_PID, LIVE_START),  # live owner
        "mcp-code-exec-%d-0000abab" % LIVE_PID,  # live pid, start time unknown
        "mcp-code-exec-%d.%d-0000bbbb" % (DEAD_PID, 40),  # dead owner
        "unrelated-container",
        "mcp-code-exec-%d.%d-0000cccc" % (LIVE_PID, LIVE_START - 1),  # pid reused
        "mcp-code-exec-%d-0000dddd" % DEAD_PID,  # dead owner, start time unknown
    ]
    runtime = FakeRuntime(names)

    orphans = await sweep(runtime, Path("/nonexistent/ipc-root"))

    assert runtime.listed_hosts == [HOST]
    assert orphans == [names[2], names[4], names[5]]
    assert runtime.killed == orphans


@pytest.mark.anyio
async def test_sweep_without_a_host_key_touches_nothing(tmp_path: Path) -> None:
    dead = make_ipc_dir(tmp_path, "mcp-code-exec-%d-0000bbbb" % DEAD_PID, host="unknown")
    runtime = FakeRuntime(["mcp-code-exec-%d-0000cccc" % DEAD_PID])

    assert await sweep(runtime, tmp_path, OwnerIdentity(None, os.getpid(), None)) == []
    assert runtime.listed_hosts == []
    assert runtime.killed == []
    assert dead.is_dir()


@pytest.mark.anyio
async def test_sweep_removes_only_this_hosts_dead_owners_ipc_dirs(tmp_path: Path) -> None:
    live = make_ipc_dir(tmp_path, "mcp-code-exec-%d.%d-0000aaaa" % (LIVE_PID, LIVE_START))
    dead = make_ipc_dir(tmp_path, "mcp-code-exec-%d.%d-0000bbbb" % (DEAD_PID, 40))
    reused = make_ipc_dir(tmp_path, "mcp-code-exec-%d.%d-0000cccc" % (LIVE_PID, LIVE_START + 9))
    foreign = make_ipc_dir(tmp_path, "my-notes")
    other_host = make_ipc_dir(
        tmp_path, "mcp-code-exec-%d.%d-0000eeee" % (DEAD_PID, 40), host="fedcba9876543210"
    )
    old_layout = make_ipc_dir(tmp_path, "mcp-code-exec-%d-0000ffff" % DEAD_PID, host=None)  # host unknown
    no_host = make_ipc_dir(tmp_path, "mcp-code-exec-%d-0000abcd" % DEAD_PID, host="")
    stray_file = tmp_path / ("%s.mcp-code-exec-%d-0000dddd" % (HOST, DEAD_PID))
    stray_file.write_text("a file, not a session directory")

    orphans = await sweep(FakeRuntime([]), tmp_path)

    assert orphans == []
    assert live.is_dir()
    assert (live / "ipc" / "session.json").is_file()
    assert not dead.exists()
    assert not reused.exists()
    assert foreign.is_dir()
    assert other_host.is_dir()
    assert old_layout.is_dir()
    assert no_host.is_dir()
    assert stray_file.is_file()


@pytest.mark.anyio
async def test_sweep_still_cleans_ipc_dirs_when_listing_containers_fails(tmp_path: Path) -> None:
    dead = make_ipc_dir(tmp_path, "mcp-code-exec-%d-0000bbbb" % DEAD_PID)
    runtime = FakeRuntime(["mcp-code-exec-%d-0000cccc" % DEAD_PID], list_fails=True)

    orphans = await sweep(runtime, tmp_path)

    assert orphans == []
    assert runtime.killed == []
    assert not dead.exists()


@pytest.mark.anyio
async def test_sweep_with_missing_ipc_root_does_not_fail(tmp_path: Path) -> None:
    assert await sweep(FakeRuntime([]), tmp_path / "missing") == []


# --- detect_engine -------------------------------------------------------------------


def fake_cli(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-runtime-cli"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.anyio
async def test_detect_runtime_without_any_runtime_says_how_to_install_one() -> None:
    with pytest.raises(EngineUnavailableError) as caught:
        await detect_engine(None, which=lambda name: None)

    message = str(caught.value)
    assert "podman is not installed" in message
    assert "docker is not installed" in message
    assert "Install Podman" in message
    assert "Docker" in message
    assert "https://podman.io" in message
    assert "https://docs.docker.com" in message
    assert "MCP_BRIDGE_RUNTIME" in message


@pytest.mark.anyio
async def test_no_engine_is_one_fact_each_audience_reads_in_its_own_words() -> None:
    with pytest.raises(NoEngineError) as caught:
        await detect_engine(None, which=lambda name: None)

    problems = ("podman is not installed (not on PATH)", "docker is not installed (not on PATH)")
    assert caught.value.problems == problems
    for_model, for_terminal = str(caught.value), engine_problem(caught.value)
    assert for_model.startswith(
        "No container runtime is available, so Python cannot run yet: %s; %s." % problems
    )
    assert "call run_python again" in for_model and "MCP_BRIDGE_RUNTIME=podman|docker" in for_model
    assert for_terminal.startswith("No container engine is available: %s; %s." % problems)
    assert (
        "run_python" not in for_terminal and "run this command again; --runtime podman|docker" in for_terminal
    )
    assert INSTALL_ENGINE in for_model and INSTALL_ENGINE in for_terminal


@pytest.mark.anyio
async def test_detect_runtime_with_preferred_runtime_tries_only_that_one() -> None:
    asked: list[str] = []

    def which(name: str) -> str | None:
        asked.append(name)
        return None

    with pytest.raises(EngineUnavailableError) as caught:
        await detect_engine("docker", which=which)

    assert asked == ["docker"]
    assert "podman is not installed" not in str(caught.value)


@pytest.mark.anyio
async def test_detect_runtime_reports_installed_but_failing_runtime_as_not_usable(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, "echo 'first line' >&2\necho 'Cannot connect to the engine' >&2\nexit 3\n")

    with pytest.raises(EngineUnavailableError) as caught:
        await detect_engine(None, which=lambda name: cli)

    message = str(caught.value)
    assert "podman is installed but not usable: Cannot connect to the engine" in message
    assert "docker is installed but not usable: Cannot connect to the engine" in message
    assert "Install Podman" in message


@pytest.mark.anyio
async def test_detect_runtime_failing_silently_reports_the_exit_code(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, "exit 7\n")

    with pytest.raises(EngineUnavailableError, match="docker is installed but not usable: exit 7"):
        await detect_engine("docker", which=lambda name: cli)


# What a fake Podman prints: `version` says whether it is a client of a service, `info`
# the service's facts ("rootless cgroups remote").
def fake_podman(tmp_path: Path, version: str, info: str = "false v2 true") -> str:
    return fake_cli(tmp_path, 'case "$1" in version) echo "%s";; info) echo "%s";; esac\n' % (version, info))


@pytest.mark.anyio
async def test_detect_runtime_prefers_podman_when_it_answers(tmp_path: Path) -> None:
    cli = fake_podman(tmp_path, "local")

    runtime = await detect_engine(None, which=lambda name: cli)

    assert isinstance(runtime, PodmanEngine)
    assert runtime.executable == cli
    assert runtime.warnings == []


@pytest.mark.anyio
async def test_detect_runtime_falls_back_to_docker_when_podman_is_missing(tmp_path: Path) -> None:
    cli = fake_cli(tmp_path, 'echo "27.1.0"\n')

    runtime = await detect_engine(None, which=lambda name: cli if name == "docker" else None)

    assert isinstance(runtime, DockerEngine)
    assert runtime.executable == cli


@pytest.mark.anyio
async def test_rootless_podman_on_cgroups_v1_warns_that_limits_are_not_enforced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local Podman: its facts are the host's (a user other than root, the host's cgroups).
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bridge, "host_cgroups_version", lambda: "v1")
    cli = fake_podman(tmp_path, "local", info="false v2 false")

    runtime = await detect_engine("podman", which=lambda name: cli)

    assert isinstance(runtime, PodmanEngine) and runtime.rootless is True
    assert len(runtime.warnings) == 1
    assert "NOT enforced" in runtime.warnings[0]


@pytest.mark.anyio
async def test_a_remote_rootless_podman_on_cgroups_v1_is_told_by_its_service(tmp_path: Path) -> None:
    cli = fake_podman(tmp_path, "remote", info="true v1 true")

    runtime = await detect_engine("podman", which=lambda name: cli)

    assert any("NOT enforced" in warning for warning in runtime.warnings)


@pytest.mark.parametrize(
    ("files", "version"), [(["cgroup.controllers"], "v2"), (["memory", "unified"], "v1")]
)
def test_the_hosts_cgroups_version_is_read_where_podman_reads_it(
    tmp_path: Path, files: list[str], version: str
) -> None:
    for name in files:
        (tmp_path / name).mkdir()
    assert bridge.host_cgroups_version(tmp_path) == version
    assert bridge.host_cgroups_version(tmp_path / "absent") == ""


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("endpoint", "remote"),
    [
        ("unix:///var/run/docker.sock", False),
        ("npipe:////./pipe/docker_engine", False),
        ("tcp://10.0.0.5:2376", True),
        ("ssh://me@build-box", True),
    ],
)
async def test_docker_is_remote_unless_its_endpoint_is_a_local_socket(
    tmp_path: Path, endpoint: str, remote: bool
) -> None:
    # What `docker context inspect` prints: DOCKER_HOST, or the current context's endpoint.
    cli = fake_cli(tmp_path, 'case "$1" in info) echo 27.1.0;; context) echo "%s";; esac\n' % endpoint)

    runtime = await detect_engine("docker", which=lambda name: cli)

    assert runtime.remote is remote


@pytest.mark.anyio
@pytest.mark.parametrize(("service_is_remote", "remote"), [("true", True), ("false", False)])
async def test_podman_is_remote_when_it_talks_to_a_service(
    tmp_path: Path, service_is_remote: str, remote: bool
) -> None:
    version = "remote" if service_is_remote == "true" else "local"
    cli = fake_podman(tmp_path, version, "false v2 " + service_is_remote)

    runtime = await detect_engine("podman", which=lambda name: cli)

    assert runtime.remote is (remote and sys.platform == "linux")  # a Mac's machine VM shares files


@pytest.mark.anyio
async def test_a_docker_cli_without_contexts_counts_as_local(tmp_path: Path) -> None:
    cli = fake_cli(
        tmp_path, 'case "$1" in info) echo 18.09.0;; *) echo "unknown command" >&2; exit 1;; esac\n'
    )

    runtime = await detect_engine("docker", which=lambda name: cli)

    assert runtime.remote is False


@pytest.mark.anyio
async def test_a_remote_podman_gets_no_seccomp_file_of_this_machine_and_says_so(tmp_path: Path) -> None:
    cli = fake_podman(tmp_path, "remote")
    runtime = await detect_engine("podman", which=lambda name: cli)
    runtime.remote = True  # as on Linux (a Mac's Podman is never remote here)
    session = bridge.Sandbox(
        runtime,
        bridge.BridgeConfig(state_dir=tmp_path),
        tmp_path / "ipc",
        NoServers(),
    )

    argv = runtime.run_argv(session.container.launch_spec())

    assert not any(item.startswith("seccomp=") for item in argv)  # the service would look for it there
    docker = bridge.DockerEngine("/usr/bin/docker")
    docker.remote = True  # Docker's CLI reads the file here and sends its content
    on_docker = bridge.Sandbox(
        docker,
        bridge.BridgeConfig(state_dir=tmp_path),
        tmp_path / "ipc",
        NoServers(),
    )
    assert any(item.startswith("seccomp=") for item in docker.run_argv(on_docker.container.launch_spec()))
    if sys.platform == "linux":
        assert any("default seccomp profile" in warning for warning in runtime.warnings)


@pytest.mark.parametrize(
    ("delivery", "remote", "via_stdin"),
    [("auto", False, False), ("auto", True, True), ("stdin", False, True), ("mount", True, False)],
)
def test_the_kernel_comes_on_stdin_for_a_remote_engine_or_when_asked(
    tmp_path: Path, delivery: bridge.KernelDelivery, remote: bool, via_stdin: bool
) -> None:
    runtime = bridge.DockerEngine("/usr/bin/docker")
    runtime.remote = remote
    config = bridge.BridgeConfig(state_dir=tmp_path, kernel_delivery=delivery)
    session = bridge.Sandbox(runtime, config, tmp_path / "ipc", NoServers())

    argv = runtime.run_argv(session.container.launch_spec())

    assert session.container.kernel_via_stdin is via_stdin
    assert (argv[-2:] == ["-c", BOOTSTRAP]) is via_stdin
    assert any(item.endswith(":%s:ro" % bridge.IPC_MOUNT) for item in argv) is not via_stdin
    session.container.prepare_ipc_dir()
    files = sorted(path.name for path in session.container.ipc_dir.parent.iterdir())
    assert files == (["seccomp.json"] if via_stdin else ["ipc", "seccomp.json"])  # nothing to mount


class NoServers:
    def server_list(self) -> list[dict[str, str]]:
        return [{"alias": "time", "name": "time"}]

    def config_problems(self) -> list[str]:
        return []

    async def handle(self, method: str, params: Mapping[str, object], run: object) -> object:
        raise AssertionError("no code runs here")

    def defined_tools_notice(self, names: Sequence[str]) -> str | None:
        return None

    async def quarantine_tools(self, failed: Sequence[FailedTool]) -> list[str]:
        return []


def test_ipc_directory_is_private_and_read_only_content_is_readable(tmp_path: Path) -> None:
    import json

    config = bridge.BridgeConfig(state_dir=tmp_path)
    runtime = bridge.PodmanEngine("/usr/bin/podman")
    session = bridge.Sandbox(runtime, config, tmp_path / "ipc", NoServers())
    session.container.prepare_ipc_dir()

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert (
        mode(session.container.ipc_dir.parent) == 0o700
    )  # other host users cannot reach the kernel or config
    assert mode(tmp_path / "ipc") == 0o700
    # Named with this host's key, so a sweep can tell this host's directories from others'.
    assert session.container.ipc_dir.parent == tmp_path / "ipc" / (
        "%s.%s" % (bridge.bridge_owner().host, session.name)
    )
    assert mode(session.container.ipc_dir) == 0o755  # the sandbox user (another uid) can read the mount
    kernel = session.container.ipc_dir / bridge.KERNEL_FILENAME
    assert kernel.read_bytes() == bridge.KERNEL_SOURCE.read_bytes() and mode(kernel) == 0o644
    settings = json.loads((session.container.ipc_dir / bridge.SESSION_CONFIG_FILENAME).read_text())
    assert settings["protocol"] == mcp_sandbox_kernel.PROTOCOL_VERSION
    assert settings["servers"] == [{"alias": "time", "name": "time"}]
    # The seccomp profile sits beside ipc/ (read by the engine), never inside the mount.
    assert sorted(path.name for path in session.container.ipc_dir.parent.iterdir()) == ["ipc", "seccomp.json"]
    assert json.loads(session.container.seccomp_path.read_text()) == bridge.seccomp_profile()
    assert session.container.launch_spec().seccomp_profile == session.container.seccomp_path


FAKE_PODMAN = """#!/bin/sh
echo "$*" >> "{log}"
case "$*" in
  "machine list --format json")
    echo '[{{"Name": "other", "Running": false}},'
    echo ' {{"Name": "podman-machine-default", "Running": {running}, "Default": true}}]' ;;
  info*) echo "false v2" ;;
esac
"""


@pytest.mark.parametrize("running", [False, True])
@pytest.mark.anyio
async def test_macos_podman_machine_is_started_and_only_a_started_one_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running: bool
) -> None:
    log = tmp_path / "calls.log"
    fake = tmp_path / "podman"
    fake.write_text(FAKE_PODMAN.format(log=log, running="true" if running else "false"))
    fake.chmod(0o755)
    monkeypatch.setattr("mcp_server_code_execution_mode.sys.platform", "darwin")

    runtime = bridge.PodmanEngine(str(fake))
    await runtime.check_ready()
    await runtime.release()

    calls = log.read_text().splitlines()
    if running:
        assert "machine start podman-machine-default" not in calls
        assert not any(call.startswith("machine stop") for call in calls)  # never stop the user's machine
    else:
        assert "machine start podman-machine-default" in calls  # the default one, not the first listed
        assert calls[-1] == "machine stop podman-machine-default"


def test_writable_filesystems_add_up_to_less_than_the_memory_limit() -> None:
    for memory in ("64m", "512m", "2g", "3000000k"):
        sizes = bridge.writable_sizes(memory)
        assert sum(sizes.values()) < bridge.parse_size(memory), (memory, sizes)
    assert bridge.writable_sizes("512m") == {"/tmp": 128 << 20, "/workspace": 128 << 20, "/dev/shm": 64 << 20}


# --- seccomp ------------------------------------------------------------------------------


def test_the_seccomp_profile_is_passed_to_the_engine_when_given() -> None:
    argv = build_run_argv("docker", spec(seccomp_profile=Path("/state/x/seccomp.json")))

    assert values_of(argv, "--security-opt") == ["no-new-privileges", "seccomp=/state/x/seccomp.json"]
    assert "--security-opt" in options_part(argv)


def test_the_seccomp_profile_denies_what_the_sandbox_never_needs_with_eperm() -> None:
    profile = bridge.seccomp_profile()
    rules = profile["syscalls"]
    allowed = {
        name
        for rule in rules
        if rule["action"] == "SCMP_ACT_ALLOW" and "args" not in rule
        for name in rule["names"]
    }
    denied = {
        name for rule in rules if rule.get("errnoRet") == 1 and "args" not in rule for name in rule["names"]
    }

    for name in (
        "keyctl",
        "add_key",
        "request_key",
        "userfaultfd",
        "perf_event_open",
        "bpf",
        "unshare",
        "setns",
        "mount",
    ):
        assert name in denied and name not in allowed, name
    assert not allowed & denied
    assert {"read", "write", "clone", "futex", "socketpair", "execve"} - {"clone"} <= allowed
    # Unknown syscalls fail with ENOSYS, so libc falls back (clone3 -> clone with checked flags).
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == 38


def test_the_seccomp_profile_allows_only_the_socket_families_python_needs() -> None:
    rules = [rule for rule in bridge.seccomp_profile()["syscalls"] if rule["names"] == ["socket"]]
    allowed = {rule["args"][0]["value"] for rule in rules if rule["action"] == "SCMP_ACT_ALLOW"}
    denied = {rule["args"][0]["value"] for rule in rules if rule["action"] == "SCMP_ACT_ERRNO"}

    assert allowed == {1, 2, 10, 16}  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (NETLINK_ROUTE only)
    assert {17, 40} <= denied  # AF_PACKET, AF_VSOCK
    netlink = next(rule for rule in rules if rule["args"][0]["value"] == 16)
    assert netlink["args"][1] == {"index": 2, "value": 0, "valueTwo": 0, "op": "SCMP_CMP_EQ"}
