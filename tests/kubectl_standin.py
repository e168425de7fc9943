"""A SIMULATION of `kubectl` for the Kubernetes backend's tests: no cluster can run on the
development or CI machines. It takes exactly the commands KubernetesEngine sends and
forwards them to a real local engine (Podman; KUBECTL_STANDIN_ENGINE=docker for Docker):

- `run NAME --stdin --attach --overrides POD` runs the Pod's one container with
  `podman run --interactive`, its securityContext, resources and in-memory emptyDir
  volumes translated to the engine's flags, and REPLACES itself with that process, so
  its stdin and stdout are the container's, as kubectl's attach makes them. A Pod
  without the hardening the backend promises is refused (exit 2), not run.
- `delete pod NAME` removes the container; `get pods --selector L=V` lists them by
  label; `auth can-i create pods --subresource=attach` says yes.

What it cannot show: the API server's admission and validation, the kubelet, a real
NetworkPolicy (here `--network none` stands in for the deny-all egress policy), the
node's pids limit (here `--pids-limit`). Every argv is appended, as a JSON line, to
KUBECTL_STANDIN_LOG when that is set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, NoReturn

ENGINE = os.environ.get("KUBECTL_STANDIN_ENGINE", "podman")
# This machine's node defaults, as a kubelet would apply them (see MACHINE.md: rootful
# Podman needs explicit ulimits here).
NODE_FLAGS = ["--pids-limit", "128", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512"]


def refuse(message: str) -> NoReturn:
    print("kubectl stand-in: %s" % message, file=sys.stderr)
    sys.exit(2)


def take(args: list[str], name: str) -> str | None:
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            value = args[index + 1]
            del args[index : index + 2]
            return value
        if arg.startswith(name + "="):
            del args[index]
            return arg.split("=", 1)[1]
    return None


LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # the API server's rule
POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def hardened(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The Pod's one container, once every promise of the backend is checked (and the
    names an API server would validate)."""
    spec = pod.get("spec", {})
    if pod.get("metadata", {}).get("name") != name or not POD_NAME.fullmatch(name) or len(name) > 253:
        refuse("the Pod's name is not %s, or not a valid Pod name" % name)
    for key, value in pod["metadata"].get("labels", {}).items():
        if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
            refuse("label %s has a value the API server refuses: %r" % (key, value))
    if spec.get("restartPolicy") != "Never" or spec.get("automountServiceAccountToken") is not False:
        refuse("the Pod must not restart and must not mount a service account token")
    if spec.get("securityContext", {}).get("seccompProfile") != {"type": "RuntimeDefault"}:
        refuse("the Pod has no RuntimeDefault seccomp profile")
    containers = spec.get("containers", [])
    if len(containers) != 1:
        refuse("the Pod must have exactly one container")
    container: dict[str, Any] = containers[0]
    context = container.get("securityContext", {})
    checks = {
        "stdin and stdinOnce": container.get("stdin") is True and container.get("stdinOnce") is True,
        "readOnlyRootFilesystem": context.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": context.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": context.get("capabilities") == {"drop": ["ALL"]},
        "runAsNonRoot": context.get("runAsNonRoot") is True and int(context.get("runAsUser", 0)) > 0,
        "memory and cpu limits": {"memory", "cpu"} <= set(container.get("resources", {}).get("limits", {})),
    }
    missing = [what for what, ok in checks.items() if not ok]
    if missing:
        refuse("the container lacks: %s" % ", ".join(missing))
    return container


def engine_run_argv(pod: dict[str, Any], name: str, image: str) -> list[str]:
    container = hardened(pod, name)
    context = container["securityContext"]
    limits = container["resources"]["limits"]
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
    argv = [ENGINE, "run", "--interactive", "--rm", "--name", name]
    for key, value in pod["metadata"].get("labels", {}).items():
        argv += ["--label", "%s=%s" % (key, value)]
    argv += ["--network", "none", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    argv += ["--read-only-tmpfs=false"] if ENGINE == "podman" else []
    argv += ["--user", "%d:%d" % (context["runAsUser"], context["runAsGroup"])]
    argv += ["--memory", limits["memory"], "--memory-swap", limits["memory"], "--cpus", limits["cpu"]]
    argv += NODE_FLAGS
    for mount in container.get("volumeMounts", []):
        empty_dir = volumes[mount["name"]].get("emptyDir")
        if empty_dir is None or empty_dir.get("medium") != "Memory":
            refuse("volume %s is not an in-memory emptyDir" % mount["name"])
        size = int(empty_dir["sizeLimit"]) // 1024
        if mount["mountPath"] == "/dev/shm":
            argv += ["--shm-size", "%dk" % size]
        else:
            argv += ["--tmpfs", "%s:rw,nosuid,nodev,size=%dk,mode=1777" % (mount["mountPath"], size)]
    for variable in container.get("env", []):
        argv += ["--env", "%s=%s" % (variable["name"], variable["value"])]
    command = container["command"]
    return [*argv, "--entrypoint", command[0], container.get("image", image), *command[1:]]


def main(args: list[str]) -> int:
    log = os.environ.get("KUBECTL_STANDIN_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(args) + "\n")
    args = list(args)
    take(args, "--context")
    take(args, "--namespace")
    if args == ["auth", "can-i", "create", "pods", "--subresource=attach"]:
        print("yes")
        return 0
    if args[:1] == ["run"] and {"--stdin", "--attach"} <= set(args):
        name, image, overrides = args[1], take(args, "--image"), take(args, "--overrides")
        if overrides is None or image is None:
            refuse("run needs --image and --overrides")
        argv = engine_run_argv(json.loads(overrides), name, image)
        os.execvp(argv[0], argv)
    if args[:2] == ["delete", "pod"]:
        force = ["--time", "0"] if ENGINE == "podman" else []
        subprocess.run([ENGINE, "rm", "--force", *force, args[2]], capture_output=True, check=False)
        return 0
    if args[:2] == ["get", "pods"]:
        selector = take(args, "--selector")
        listed = subprocess.run(
            [ENGINE, "ps", "--all", "--filter", "label=%s" % selector, "--format", "{{.Names}}"],
            capture_output=True,
            text=True,
            check=False,
        )
        sys.stdout.write(listed.stdout)
        return listed.returncode
    refuse("unsupported command: %s" % " ".join(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
