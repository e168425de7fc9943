"""MCP_BRIDGE_WORKSPACE: a host folder of the user's mounted at /workspace (read-write, or
read-only with ":ro") instead of the in-memory one; the sandbox runs as the folder's owner.
The run argv and the owner rule on the host; files that outlive a reset and the bridge
itself, through a real MCP client, on both runtimes."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import mcp_server_code_execution_mode as bridge
from mcp_server_code_execution_mode import DockerEngine, PodmanEngine, Workspace
from tests.conftest import Engine, bridge_client, bridge_env, run_cell, text_of
from tests.test_container_runtime import spec
from tests.test_guide import guide_examples

pytestmark = pytest.mark.anyio

FOLDER = Path("/home/u/work")
IN_MEMORY = ["--tmpfs", "/workspace:rw,nosuid,nodev,noexec,size=131072k,mode=1777"]
USER_UID = 1000  # the folder's owner in the tests: not the bridge's user (root here), not 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def with_mount(argv: list[str], mount: list[str]) -> list[str]:
    """`argv` with the in-memory /workspace replaced by `mount`."""
    at = argv.index(IN_MEMORY[0], argv.index(IN_MEMORY[1]) - 1)
    assert argv[at : at + 2] == IN_MEMORY
    return argv[:at] + mount + argv[at + 2 :]


# --- the run argv -------------------------------------------------------------------------


def test_a_workspace_replaces_the_in_memory_one_and_nothing_else() -> None:
    for runtime, options in (
        (PodmanEngine("podman"), ",noexec,nosuid,nodev"),
        (DockerEngine("docker"), ""),
    ):
        plain = runtime.run_argv(spec())
        assert IN_MEMORY[1] in plain and "--mount" not in plain
        mount = "type=bind,source=/home/u/work,target=/workspace"
        assert runtime.run_argv(spec(workspace=Workspace(FOLDER))) == with_mount(
            plain, ["--mount", mount + options]
        )
        assert runtime.run_argv(spec(workspace=Workspace(FOLDER, read_only=True))) == with_mount(
            plain, ["--mount", mount + ",readonly" + options]
        )


def test_rootless_podman_maps_the_users_own_uid_to_itself_for_a_workspace() -> None:
    podman = PodmanEngine("podman")
    podman.rootless = True
    argv = podman.run_argv(spec(workspace=Workspace(FOLDER)))
    assert argv.count("--userns=keep-id") == 1 and argv.index("--userns=keep-id") < argv.index("--user")
    assert "--userns=keep-id" not in podman.run_argv(spec())  # without a workspace: the default
    podman.rootless = False
    assert "--userns=keep-id" not in podman.run_argv(spec(workspace=Workspace(FOLDER)))


# --- the sandbox's user: the folder's owner, never root -------------------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "work"
    path.mkdir()
    yield path


@needs_root
def test_the_sandbox_runs_as_the_folders_owner(folder: Path) -> None:
    os.chown(folder, USER_UID, USER_UID + 1)
    config = bridge.BridgeConfig(workspace=Workspace(folder))
    assert bridge.sandbox_user(config) == "%d:%d" % (USER_UID, USER_UID + 1)
    assert bridge.sandbox_user(bridge.BridgeConfig()) == "65534:65534"


@needs_root
@pytest.mark.parametrize("owner", [(0, 0), (0, USER_UID), (USER_UID, 0)])
def test_a_folder_of_root_keeps_the_configured_user_and_warns(
    folder: Path, owner: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    os.chown(folder, *owner)
    config = bridge.BridgeConfig(workspace=Workspace(folder), container_user="65534:65534")
    assert bridge.sandbox_user(config) == "65534:65534"
    with caplog.at_level(logging.INFO, logger=bridge.logger.name):
        bridge.log_workspace(config)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [
        "The workspace folder MCP_BRIDGE_WORKSPACE=%s belongs to root (user or group), so the sandbox "
        "runs as 65534:65534, never as root: that user must be able to read and write it, or the user "
        "should give the folder to their own account (chown)." % folder
    ]
    assert bridge.workspace_warning(config) == warnings[0]  # also the first notice of each session


def test_a_workspace_folder_that_vanished_stops_the_start_with_a_clear_error(folder: Path) -> None:
    config = bridge.BridgeConfig(workspace=Workspace(folder))
    folder.rmdir()
    with pytest.raises(bridge.SandboxStartError, match="MCP_BRIDGE_WORKSPACE=%s cannot be read" % folder):
        bridge.sandbox_user(config)


# --- the manual tells the model which /workspace it has -------------------------------------


def test_the_manual_says_whether_workspace_is_in_memory_or_the_users_folder(folder: Path) -> None:
    in_memory = bridge.capabilities_manual(bridge.BridgeConfig())
    kept = bridge.capabilities_manual(bridge.BridgeConfig(workspace=Workspace(folder)))
    read_only = bridge.capabilities_manual(bridge.BridgeConfig(workspace=Workspace(folder, True)))
    assert "- Writable: /workspace (working directory) and /tmp, in memory; reset empties them." in in_memory
    assert "kept across resets and sessions" in kept and "in memory; reset empties them." not in kept
    assert "/workspace (working directory) is the\n  user's own folder, read-only" in read_only
    assert len({in_memory, kept, read_only}) == 3
    assert str(folder) not in kept + read_only  # the host path is the user's business


# --- real containers, a real MCP client -----------------------------------------------------


@needs_root
async def test_a_file_written_in_one_session_is_on_the_host_and_in_the_next(
    engine: Engine, state_dir: Path, folder: Path
) -> None:
    os.chown(folder, USER_UID, USER_UID)
    env = bridge_env(engine, state_dir, MCP_BRIDGE_WORKSPACE=str(folder))
    async with bridge_client(env) as client:
        wrote = await run_cell(
            client,
            """
            import os
            with open("/workspace/out.txt", "w") as out:
                out.write("written in session 1\\n")
            mounts = [line.split() for line in open("/proc/mounts")]
            mount = [fields[3].split(",") for fields in mounts if fields[1] == "/workspace"]
            print("as", os.getuid(), os.getgid(), "in", os.getcwd(), "home", os.environ["HOME"])
            print("noexec:", "noexec" in mount[0])
            """,
        )
        assert wrote["status"] == "ok", wrote["text"]
        assert "as %d %d in /workspace home /workspace\n" % (USER_UID, USER_UID) in wrote["text"]
        noexec = engine.name == "podman"  # Docker's bind mounts take no mount options
        assert "noexec: %s" % noexec in wrote["text"]
        on_host = folder / "out.txt"
        assert on_host.read_text() == "written in session 1\n"
        assert (on_host.stat().st_uid, on_host.stat().st_gid) == (USER_UID, USER_UID)

        after_reset = await client.call_tool(
            "run_python", {"code": "open('/workspace/out.txt').read()", "reset": True}
        )
        assert not after_reset.is_error and "Reset" in text_of(after_reset)
        assert "written in session 1" in text_of(after_reset)
        manual = await client.read_resource(bridge.CAPABILITIES_URI)
        assert "kept across resets and sessions" in manual.contents[0].text  # type: ignore[union-attr]

    async with bridge_client(env) as client:  # a new bridge process, a new container
        again = await run_cell(client, "open('out.txt', 'a').write('session 2\\n')")
        assert again["status"] == "ok", again["text"]
    assert on_host.read_text() == "written in session 1\nsession 2\n"


async def test_a_read_only_workspace_is_read_but_never_written(
    engine: Engine, state_dir: Path, folder: Path
) -> None:
    # Owned by the bridge's user; as root here, that is the owner-is-root rule: user 65534.
    (folder / "in.csv").write_text("a,b\n1,2\n")
    folder.chmod(0o755)
    (folder / "in.csv").chmod(0o644)
    env = bridge_env(engine, state_dir, MCP_BRIDGE_WORKSPACE=str(folder) + ":ro")
    async with bridge_client(env) as client:
        read = await run_cell(client, "import os; print(open('/workspace/in.csv').read(), os.getuid())")
        assert read["status"] == "ok", read["text"]
        expected_uid = 65534 if os.geteuid() == 0 else os.geteuid()
        assert "a,b\n1,2\n %d" % expected_uid in read["text"]
        if os.geteuid() == 0:  # a folder of root's: the model is told, in the first result
            assert any("belongs to root" in notice for notice in read["notices"]), read
        write = await run_cell(client, "open('/workspace/new.txt', 'w')")
        assert write["is_error"]
        assert "OSError: [Errno 30] Read-only file system: '/workspace/new.txt'" in write["text"]
        tmp = await run_cell(client, "open('/tmp/new.txt', 'w').write('ok')")
        assert tmp["status"] == "ok", tmp["text"]
    assert sorted(path.name for path in folder.iterdir()) == ["in.csv"]


@needs_root
async def test_guides_attach_example_leaves_the_file_in_the_users_folder(
    engine: Engine, state_dir: Path, folder: Path
) -> None:
    # GUIDE.md: "Files written to /workspace reach the user without attach when they have
    # set up a workspace folder": its attach example, verbatim, with one.
    (example,) = [e for e in guide_examples() if 'runtime.attach("/workspace/report.csv")' in e.code]
    os.chown(folder, USER_UID, USER_UID)
    async with bridge_client(bridge_env(engine, state_dir, MCP_BRIDGE_WORKSPACE=str(folder))) as client:
        answer = await run_cell(client, example.code)
    assert answer["files"] == 1 and not answer["is_error"], answer
    assert (folder / "report.csv").read_text() == "city,temp\nOslo,3\nLima,19\n"
