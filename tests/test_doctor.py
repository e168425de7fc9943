"""`mcp-server-code-execution-mode doctor`: the installed console script, run as a user
would, in a temporary HOME, on each real engine: the engine, its limits, the image and a
real sandbox, the config files, every configured server started once (real ones), and
the clients that still start those servers themselves. Also the pure parts: what an
engine's `info` says about its limits, and which tools code cannot use well."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, claude_desktop_home, console_script, proxy_env, real_server, stub_entry

BROKEN = {"command": "sh", "args": ["-c", "echo fatal >&2; exit 3"]}


def doctor(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), "doctor", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,  # only to catch a hang: every probe inside has its own bound
        check=False,
    )


def lines_of(report: str, status: str) -> list[str]:
    return [
        line.strip()[len(status) :].strip() for line in report.splitlines() if line.startswith("  " + status)
    ]


def test_doctor_on_a_healthy_machine_exits_0_naming_engine_limits_python_and_each_server(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    bridge_entry = {"command": console_script()}
    home = claude_desktop_home(
        tmp_path,
        {"code-execution": bridge_entry, "time": {"command": real_server("time")}, "stub": stub_entry()},
    )
    done = doctor(proxy_env(engine, state_dir, home))
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout
    ok = lines_of(report, "ok")
    assert any(
        re.fullmatch(r"engine %s [0-9][^ ]* at /\S+ \(root(ful|less), cgroups v[12]\)" % engine.name, line)
        for line in ok
    ), report
    assert "memory 512m, pids 128, cpus 1 enforced" in report
    assert "image %s is on this machine" % engine.image in ok, report
    assert any(
        re.fullmatch(
            r"a sandbox started in [0-9.]+s \(Python 3\.[0-9]+\.[0-9]+ in %s\) and was removed"
            % re.escape(engine.image),
            line,
        )
        for line in ok
    ), report
    # mcp-server-time marks both its tools read-only; the stub marks none.
    assert re.search(
        r"ok +time \(mcp_time\): started in [0-9.]+s, 2 tools, 0 of them ask the user first\n", report
    )
    stub = re.search(
        r"ok +stub \(mcp_stub\): started in [0-9.]+s, ([0-9]+) tools, ([0-9]+) of them ask", report
    )
    assert stub is not None and stub.group(1) == stub.group(2), report
    assert (
        "MCP_BRIDGE_APPROVE=writes: calls of tools their servers do not mark read-only wait for the user's "
        "approval; clients without elicitation: allowed, the result says so (MCP_BRIDGE_APPROVE_FALLBACK); "
        "at most 1000 proxied calls per run_python call; call log: %s (meta)" % (state_dir / "calls.jsonl")
    ) in ok, report
    config = home / ".config" / "Claude" / "claude_desktop_config.json"
    assert str(config) in ok
    assert "%s: skipped code-execution: it launches this bridge itself" % config in ok  # as it should
    # The client starts the bridge and, beside it, the servers the bridge offers: adopt fixes that.
    (twice,) = [line for line in lines_of(report, "warn") if "again through this bridge" in line]
    assert (
        "starts time, stub itself" in twice
        and "`mcp-server-code-execution-mode adopt --client claude-desktop`" in twice
    )
    assert report.rstrip().endswith("the bridge can start here.")


def test_doctor_names_a_missing_image_and_why_and_exits_1(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {})
    done = doctor(proxy_env(engine, state_dir, home, MCP_BRIDGE_IMAGE="localhost/does-not-exist:x"))
    assert done.returncode == 1, done.stdout + done.stderr
    (failure,) = lines_of(done.stdout, "fail")
    assert failure.startswith(
        "image localhost/does-not-exist:x is not on this machine and cannot be pulled: "
    )
    assert "`%s pull localhost/does-not-exist:x` failed: " % engine.name in failure  # and the engine's reason
    assert "Set MCP_BRIDGE_IMAGE" in failure
    assert "a sandbox started" not in done.stdout
    assert done.stdout.rstrip().endswith("something would fail (exit 1).")


def test_doctor_names_a_server_that_fails_to_start_and_json_says_the_same(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"broken": BROKEN, "stub": stub_entry()})
    env = proxy_env(proxy_engine, state_dir, home)
    done = doctor(env)
    assert done.returncode == 1, done.stdout + done.stderr
    (failure,) = lines_of(done.stdout, "fail")
    assert failure.startswith(
        "MCP server 'broken' (command: sh -c 'echo fatal >&2; exit 3') could not be started: "
        "its process exited with status 3"
    ), failure
    # What the server said (its stderr) is in the report itself, on the lines that follow.
    shown = done.stdout.split(failure, 1)[1].split("\n\n", 1)[0]
    assert "\n          fatal\n" in shown and "claude_desktop_config.json" in shown, shown
    assert re.search(r"ok +stub \(mcp_stub\): started", done.stdout), done.stdout

    as_json = doctor(env, "--json")
    assert as_json.returncode == 1
    found: dict[str, Any] = json.loads(as_json.stdout)
    assert found["status"] == 1 and found["version"] == bridge.__version__
    servers = {check["subject"]: check for check in found["checks"] if check["section"] == "servers"}
    assert servers["broken"]["status"] == "fail" and servers["broken"]["message"].startswith(failure)
    assert "\n  fatal\n" in servers["broken"]["message"]
    assert (
        servers["stub"]["status"] == "ok" and servers["stub"]["tools"] > 0 and servers["stub"]["seconds"] >= 0
    )
    (start,) = [check for check in found["checks"] if check["subject"] == "start"]
    assert start["status"] == "ok" and start["python"].startswith("3.")


def test_doctor_exits_2_for_a_bad_setting(tmp_path: Path, state_dir: Path) -> None:
    env = proxy_env(Engine("podman", "x"), state_dir, claude_desktop_home(tmp_path, {}), MCP_BRIDGE_PIDS="0")
    done = doctor(env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "mcp-server-code-execution-mode doctor: MCP_BRIDGE_PIDS='0' is invalid: "
        "must be a positive whole number such as 128"
    )


def test_doctor_without_an_engine_says_what_to_run_in_a_terminal(tmp_path: Path, state_dir: Path) -> None:
    # The model reads the same fact as "... then call run_python again"; a terminal is told
    # what to run there.
    empty = tmp_path / "bin"
    empty.mkdir()
    env = proxy_env(Engine("podman", "x"), state_dir, claude_desktop_home(tmp_path, {}), PATH=str(empty))
    done = doctor(env, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    (engine,) = [check for check in found["checks"] if check["subject"] == "engine"]
    assert engine["status"] == "fail" and engine["message"] == (
        "No container engine is available: podman is not installed (not on PATH). Install Podman "
        "(https://podman.io/docs/installation; on Debian/Ubuntu: `sudo apt-get install podman`) or Docker "
        "(https://docs.docker.com/get-docker/), make sure `podman info` or `docker info` works for you, then "
        "run this command again; --runtime podman|docker chooses one (MCP_BRIDGE_RUNTIME in the MCP "
        "server's environment)."
    ), engine


# --- the pure parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rootless", "cgroups", "controllers", "unenforced"),
    [
        (True, "v1", None, ("memory", "pids", "cpus")),  # no cgroups at all
        (True, "v1", ["memory", "pids", "cpu"], ("memory", "pids", "cpus")),
        (False, "v1", ["cpuset", "cpu", "memory", "pids"], ()),
        (True, "v2", ["memory", "pids"], ("cpus",)),  # cpu not delegated to the user
        (True, "v2", None, ()),  # not known: none assumed missing
    ],
)
def test_unenforced_limits(
    rootless: bool, cgroups: str, controllers: list[str] | None, unenforced: tuple[str, ...]
) -> None:
    assert bridge.unenforced_limits(rootless, cgroups, controllers) == unenforced


def test_engine_facts_from_podman_and_docker_info() -> None:
    podman = {
        "host": {
            "security": {"rootless": True},
            "cgroupVersion": "v2",
            "cgroupControllers": ["memory", "pids"],
        },
        "version": {"Version": "5.2.1"},
    }
    assert bridge.podman_facts(podman, None) == bridge.EngineFacts("5.2.1", True, "v2", ("cpus",), None)
    docker = {
        "ServerVersion": "27.1.0",
        "CgroupVersion": "1",
        "SecurityOptions": ["name=seccomp,profile=builtin", "name=rootless"],
        "MemoryLimit": True,
        "PidsLimit": True,
        "CpuCfsQuota": True,
        "Runtimes": {"runc": {"path": "runc"}, "gvisor": {"path": "/usr/local/bin/runsc"}},
    }
    assert bridge.docker_facts(docker) == bridge.EngineFacts(
        "27.1.0", True, "v1", ("memory", "pids", "cpus"), "gvisor"
    )
    assert bridge.docker_facts({"ServerVersion": "27.1.0", "CgroupVersion": "2", "PidsLimit": False}) == (
        bridge.EngineFacts("27.1.0", False, "v2", ("pids",), None)
    )


def test_tool_problems_name_what_code_cannot_use_well() -> None:
    tools = [
        {"name": "get-sum", "inputSchema": {"type": "object"}},
        {"name": "get_sum", "inputSchema": {"type": "object"}},
        {"name": "list files", "inputSchema": {"type": "object"}},
        {"name": "raw", "inputSchema": {"type": "string"}},
        {"name": "fine", "inputSchema": {"type": "object", "properties": {}}},
    ]
    assert bridge.tool_problems(tools) == [
        "tools 'get-sum' and 'get_sum' are both .get_sum in code: one hides the other",
        "tool 'list files': the name is not 1-128 of A-Z a-z 0-9 _ . -",
        "tool 'raw': its inputSchema is not an object schema",
    ]
