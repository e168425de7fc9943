"""The Kubernetes backend. No cluster runs on the development or CI machines, so:

- the Pod spec and the kubectl argv are pure functions, compared with a checked-in
  manifest (tests/data/kubernetes-pod.json) and an exact argv;
- the start path is run end to end through a SIMULATION: tests/kubectl_standin.py, put
  on PATH as `kubectl`, checks the Pod's hardening and forwards `kubectl run --stdin
  --attach` to `podman run --interactive`, so the bootstrap, the frame channel through
  that argv, the timeout, the reset and the Pod deletion all run for real, on a real
  engine, but never through a real API server or kubelet (STATUS says so too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path

import pytest

import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import BOOTSTRAP
from mcp_server_code_execution_mode import (
    ConfigError,
    EngineUnavailableError,
    KubernetesEngine,
    KubeTarget,
    LaunchSpec,
    OwnerIdentity,
    load_config,
    pod_manifest,
)
from tests.conftest import (
    CONTAINER_LABEL,
    DEFAULT_IMAGE,
    Engine,
    bridge_client,
    bridge_env,
    bridge_pids,
    requested_runtimes,
    structured,
    text_of,
)

HERE = Path(__file__).parent
EXPECTED_POD = HERE / "data" / "kubernetes-pod.json"
OWNER = OwnerIdentity(host_key="0123456789abcdef", pid=4242, start_time=987654)
TARGET = KubeTarget(namespace="sandboxes", context="team-cluster", runtime_class="gvisor")


def launch_spec() -> LaunchSpec:
    return LaunchSpec(
        name="mcp-code-exec-4242.987654-0badcafe",
        image="registry.example.com/python:3.12-slim",
        ipc_dir=None,
        owner=OWNER,
        memory="512m",
        pids=128,
        cpus=1.5,
        user="65534:65534",
    )


# --- the Pod and the commands, exactly ----------------------------------------------


def test_the_pod_matches_the_checked_in_manifest() -> None:
    assert pod_manifest(launch_spec(), "gvisor") == json.loads(EXPECTED_POD.read_text())


def test_the_checked_in_manifest_holds_the_promised_hardening() -> None:
    # Read from the file, so an edit of the expected manifest cannot drop a promise silently.
    pod = json.loads(EXPECTED_POD.read_text())
    spec = pod["spec"]
    (container,) = spec["containers"]
    context = container["securityContext"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["runtimeClassName"] == "gvisor"
    assert (context["runAsNonRoot"], context["runAsUser"], context["runAsGroup"]) == (True, 65534, 65534)
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"] == {"cpu": "1.5", "memory": str(512 * 1024 * 1024)}
    assert {volume["mountPath"] for volume in container["volumeMounts"]} == {"/tmp", "/workspace", "/dev/shm"}
    assert all(volume["emptyDir"]["medium"] == "Memory" for volume in spec["volumes"])
    assert container["command"] == ["python3", "-I", "-c", BOOTSTRAP]
    assert container["stdin"] is True and container["stdinOnce"] is True
    assert pod["metadata"]["labels"]["%s.owner-host" % CONTAINER_LABEL] == OWNER.host_key


def test_a_session_name_goes_in_an_annotation_where_a_label_value_could_not_hold_it() -> None:
    # "_x" is a valid session name, but a label value must start and end with a letter or digit.
    pod = pod_manifest(dataclasses.replace(launch_spec(), session="_x"))

    assert pod["metadata"]["annotations"]["%s/session" % CONTAINER_LABEL] == "_x"
    assert all(value[0].isalnum() and value[-1].isalnum() for value in pod["metadata"]["labels"].values())


def test_kubectl_run_argv_creates_and_attaches_the_pod() -> None:
    argv = KubernetesEngine("/usr/bin/kubectl", TARGET).run_argv(launch_spec())

    assert argv[:-1] == [
        "/usr/bin/kubectl",
        "--context", "team-cluster",
        "--namespace", "sandboxes",
        "run", "mcp-code-exec-4242.987654-0badcafe",
        "--image", "registry.example.com/python:3.12-slim",
        "--restart=Never",
        "--stdin",
        "--attach",
        "--quiet",
        "--pod-running-timeout=10m",
        "--override-type=merge",
        "--overrides",
    ]  # fmt: skip
    assert json.loads(argv[-1]) == json.loads(EXPECTED_POD.read_text())


def test_pods_are_deleted_and_listed_by_label_in_the_target_namespace() -> None:
    runtime = KubernetesEngine("kubectl", KubeTarget(namespace="sandboxes"))
    delete = ["kubectl", "--namespace", "sandboxes", "delete", "pod", "p1", "--ignore-not-found"]

    assert runtime.kill_argv("p1") == [*delete, "--grace-period=0", "--force", "--wait=false"]
    assert runtime.leftover_argv("p1") == runtime.kill_argv("p1")  # an ended Pod stays until deleted
    assert runtime.list_argv("0123456789abcdef")[:6] == [
        "kubectl", "--namespace", "sandboxes", "get", "pods", "--selector",
    ]  # fmt: skip
    assert runtime.list_argv("0123456789abcdef")[6] == "%s.owner-host=0123456789abcdef" % CONTAINER_LABEL
    assert runtime.remote  # the kernel always arrives on stdin


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"MCP_BRIDGE_WORKSPACE": "/tmp"}, "MCP_BRIDGE_WORKSPACE"),
        ({"MCP_BRIDGE_KERNEL_DELIVERY": "mount"}, "MCP_BRIDGE_KERNEL_DELIVERY=mount"),
        ({"MCP_BRIDGE_OCI_RUNTIME": "runsc"}, "MCP_BRIDGE_KUBE_RUNTIME_CLASS"),
        ({"MCP_BRIDGE_CONTAINER_USER": "nobody"}, "UID:GID"),
        ({"MCP_BRIDGE_CONTAINER_USER": "0:0", "MCP_BRIDGE_ALLOW_ROOT": "1"}, "runAsNonRoot"),
    ],
)
def test_settings_a_pod_cannot_honour_are_refused_at_start(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config([], {"MCP_BRIDGE_RUNTIME": "kubernetes", **environ})


@pytest.mark.anyio
async def test_without_kubectl_the_error_says_how_to_get_it() -> None:
    config = load_config([], {"MCP_BRIDGE_RUNTIME": "kubernetes"})
    with pytest.raises(EngineUnavailableError, match="kubectl is not installed"):
        await bridge.locate_kubernetes(config, which=lambda name: None)


# --- the start path, through the kubectl stand-in (a simulation) ---------------------


@pytest.fixture
def standin(tmp_path: Path) -> tuple[Path, Path]:
    """(a directory holding `kubectl` = the stand-in, the log of its argvs)."""
    folder = tmp_path / "standin-bin"
    folder.mkdir()
    script = folder / "kubectl"
    script.write_text(
        '#!/bin/sh\nexec "%s" "%s" "$@"\n' % (sys.executable, HERE / "kubectl_standin.py"), encoding="utf-8"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder, tmp_path / "kubectl.log"


def logged(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.anyio
@pytest.mark.container  # the stand-in runs the Pod on Podman
async def test_simulated_cluster_runs_a_session_over_the_stdin_bootstrap(
    standin: tuple[Path, Path], state_dir: Path
) -> None:
    folder, log = standin
    engine = requested_runtimes()[0]
    env = bridge_env(
        None,
        state_dir,
        MCP_BRIDGE_RUNTIME="kubernetes",
        MCP_BRIDGE_KUBE_NAMESPACE="sandboxes",
        MCP_BRIDGE_IMAGE=os.environ.get("MCP_BRIDGE_IMAGE", DEFAULT_IMAGE),
        MCP_BRIDGE_MEMORY="128m",
        KUBECTL_STANDIN_ENGINE=engine,
        KUBECTL_STANDIN_LOG=str(log),
    )
    env["PATH"] = "%s:%s" % (folder, env.get("PATH", ""))
    async with bridge_client(env) as client:
        owner = bridge_pids(state_dir)[0]
        first = await client.call_tool(
            "run_python", {"code": "import os\nx = 41\n(os.path.exists('/ipc'), os.getuid())"}
        )
        assert structured(first)["value"] == "(False, 65534)", text_of(first)
        assert structured(await client.call_tool("run_python", {"code": "x + 1"}))["value"] == "42"

        timed_out = await client.call_tool("run_python", {"code": "while True: pass", "timeout": 2})
        assert structured(timed_out)["status"] == "timeout", text_of(timed_out)
        oom = await client.call_tool("run_python", {"code": "blob = bytearray(256 * 1024 * 1024)"})
        assert "128m memory limit" in text_of(oom)

        runs = [argv for argv in logged(log) if argv[2:3] == ["run"]]
        assert len(runs) == 1 and runs[0][:2] == ["--namespace", "sandboxes"], runs
        assert [
            "--namespace",
            "sandboxes",
            "auth",
            "can-i",
            "create",
            "pods",
            "--subresource=attach",
        ] in logged(log)
        first_pod = runs[0][3]
        labels = json.loads(runs[0][-1])["metadata"]["labels"]
        assert labels["%s.owner-pid" % CONTAINER_LABEL] == str(owner)

        # A session name that no label value could hold ("_x"): the stand-in checks labels
        # as the API server does.
        named = await client.call_tool("run_python", {"code": "runtime.session", "session": "_x"})
        assert structured(named)["value"] == "'_x'", text_of(named)
        reset = await client.call_tool("run_python", {"code": "'x' in globals()", "reset": True})
        assert structured(reset)["value"] == "False", text_of(reset)  # a new Pod, booted over stdin
        deleted = [argv[4] for argv in logged(log) if argv[2:4] == ["delete", "pod"]]
        assert first_pod in deleted
    pods = {argv[3] for argv in logged(log) if argv[2:3] == ["run"]}
    assert len(pods) == 3  # the default session's two (before and after the reset) and "_x"
    assert pods <= {argv[4] for argv in logged(log) if argv[2:4] == ["delete", "pod"]}  # each one deleted
    # No Pod (container) outlives the bridge.
    assert Engine(engine, env["MCP_BRIDGE_IMAGE"]).containers(running_only=False, owner_pid=owner) == []
