"""mcp-server-code-execution-mode: one MCP tool, ``run_python``, backed by a persistent,
hardened, network-less Podman or Docker container.

The model's code runs in ONE container per bridge process, started (pre-warmed) once
and kept, so variables, imports and functions survive between calls. The container's
main process is the kernel in ``mcp_sandbox_kernel.py``; bridge and kernel talk in
newline-delimited JSON frames over the container's stdin/stdout (see ARCHITECTURE.md).

Sections, in dependency order (``grep -n '^# ====' mcp_server_code_execution_mode.py``):
    configuration        -> BridgeConfig, built once in main() from flags and MCP_BRIDGE_*
    errors               -> BridgeError and the subclasses each section raises
    wire protocol        -> shared with the kernel: encode_frame / FrameDecoder
    container runtime    -> Podman / Docker strategies, detection, hardened argv, sweeping
    sandbox session      -> one container + kernel; SessionManager keeps it warm
    rendering            -> ExecutionOutcome -> text / TOON + structuredContent
    MCP server & tool    -> run_python, the capabilities resource
    command line         -> main()
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import anyio
import anyio.abc
import mcp_types as types
import toon_format
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import mcp_sandbox_kernel
from mcp_sandbox_kernel import PROTOCOL_VERSION, FrameDecoder, ProtocolError, encode_frame

__version__ = "0.1.0"
SERVER_NAME = "mcp-server-code-execution-mode"
logger = logging.getLogger("mcp_server_code_execution_mode")

# =============================================================================
# configuration
# =============================================================================

RuntimeName = Literal["podman", "docker"]
OutputMode = Literal["compact", "toon"]


@dataclass(frozen=True)
class BridgeConfig:
    """Every setting, read once in main() and passed down; nothing reads the
    environment after start-up."""

    runtime: RuntimeName | None = None
    image: str = "python:3.13-slim"
    timeout: float = 30.0
    max_timeout: float = 120.0
    state_dir: Path = field(default_factory=lambda: Path("~/MCPs").expanduser())
    output_mode: OutputMode = "compact"
    memory: str = "512m"
    pids: int = 128
    cpus: float = 1.0
    container_user: str = "65534:65534"
    idle_timeout: float = 900.0
    prewarm: bool = True
    max_output_chars: int = 50_000
    max_frame_bytes: int = 32 * 1024 * 1024
    start_timeout: float = 120.0
    interrupt_grace: float = 3.0
    log_level: str = "INFO"


class ConfigError(Exception):
    """A bad setting; the message names the variable and the accepted values."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be zero or a positive number")
    return value


def _positive_int(text: str) -> int:
    value = int(text.replace("_", ""))
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError("must be one of " + ", ".join(allowed))
        return text

    return parse


def _pattern(regex: str, what: str) -> Callable[[str], str]:
    compiled = re.compile(regex)

    def parse(text: str) -> str:
        if not compiled.fullmatch(text):
            raise ValueError("must be " + what)
        return text

    return parse


def _directory(text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True)
class Option:
    """One setting: its config field, environment variable, flag and parser. The single
    table below drives parsing, --help and the docs' option list."""

    field: str
    env: str
    parse: Callable[[str], Any]
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option(
        "runtime",
        "MCP_BRIDGE_RUNTIME",
        _choice("podman", "docker"),
        "container runtime; default: Podman if it answers, else Docker",
    ),
    Option(
        "image",
        "MCP_BRIDGE_IMAGE",
        _pattern(r"[\w./:@-]+", "an image reference"),
        "sandbox image; needs python3 >= 3.9",
    ),
    Option("timeout", "MCP_BRIDGE_TIMEOUT", _positive_float, "default per-call timeout, seconds"),
    Option("max_timeout", "MCP_BRIDGE_MAX_TIMEOUT", _positive_float, "largest timeout a call may ask for"),
    Option("state_dir", "MCP_BRIDGE_STATE_DIR", _directory, "bridge state directory"),
    Option("output_mode", "MCP_BRIDGE_OUTPUT_MODE", _choice("compact", "toon"), "result text format"),
    Option(
        "memory",
        "MCP_BRIDGE_MEMORY",
        _pattern(r"[1-9][0-9]*[bkmgBKMG]?", "a size such as 512m"),
        "container memory limit (swap is set equal: no extra swap)",
    ),
    Option("pids", "MCP_BRIDGE_PIDS", _positive_int, "container process limit"),
    Option("cpus", "MCP_BRIDGE_CPUS", _positive_float, "container CPU limit"),
    Option(
        "container_user",
        "MCP_BRIDGE_CONTAINER_USER",
        _pattern(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?", "USER or UID:GID"),
        "user inside the sandbox",
    ),
    Option(
        "idle_timeout",
        "MCP_BRIDGE_IDLE_TIMEOUT",
        _non_negative_float,
        "stop the sandbox after this many idle seconds; 0 = never",
    ),
    Option("prewarm", "MCP_BRIDGE_PREWARM", _boolean, "start the sandbox when the server starts"),
    Option(
        "max_output_chars",
        "MCP_BRIDGE_MAX_OUTPUT",
        _positive_int,
        "characters kept per stream (stdout, stderr) per call; the rest is cut with a marker",
    ),
    Option(
        "max_frame_bytes", "MCP_BRIDGE_MAX_FRAME_BYTES", _positive_int, "largest bridge<->kernel frame, bytes"
    ),
    Option(
        "start_timeout",
        "MCP_BRIDGE_START_TIMEOUT",
        _positive_float,
        "seconds a sandbox may take to start (includes an image pull)",
    ),
    Option(
        "log_level",
        "MCP_BRIDGE_LOG_LEVEL",
        _choice("DEBUG", "INFO", "WARNING", "ERROR"),
        "log level (logs go to stderr)",
    ),
)


def build_arg_parser() -> argparse.ArgumentParser:
    defaults = BridgeConfig()
    parser = argparse.ArgumentParser(
        prog=SERVER_NAME,
        description="Stdio MCP server with one tool, run_python, that runs code in a persistent, "
        "hardened Podman/Docker sandbox. Each option can also be set by the environment "
        "variable shown; the flag wins.",
    )
    parser.add_argument("--version", action="version", version="%(prog)s " + __version__)
    for option in OPTIONS:
        default = getattr(defaults, option.field)
        parser.add_argument(
            option.flag,
            dest=option.field,
            metavar=option.field.upper(),
            default=None,
            help="%s [env %s; default: %s]" % (option.help, option.env, "auto" if default is None else default),
        )
    return parser


def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> BridgeConfig:
    """Flags win over environment variables, which win over defaults. Raises ConfigError
    with a one-line message naming the offending flag or variable."""
    namespace = build_arg_parser().parse_args(list(argv))
    values: dict[str, Any] = {}
    for option in OPTIONS:
        flag_value = getattr(namespace, option.field)
        source, raw = (
            (option.flag, flag_value) if flag_value is not None else (option.env, environ.get(option.env))
        )
        if raw is None or (raw == "" and source == option.env):
            continue
        try:
            values[option.field] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError("%s=%r is invalid: %s" % (source, raw, exc)) from None
    config = BridgeConfig(**values)
    if config.timeout > config.max_timeout:
        raise ConfigError(
            "MCP_BRIDGE_TIMEOUT (%g) must not exceed MCP_BRIDGE_MAX_TIMEOUT (%g)"
            % (config.timeout, config.max_timeout)
        )
    return config


# =============================================================================
# errors
# =============================================================================


class BridgeError(Exception):
    """Root of the bridge's own errors. The message is written for the model: what
    happened and what to do next. Rendered once, at the tool boundary."""


class RuntimeUnavailableError(BridgeError):
    """No container runtime answers."""


class SandboxStartError(BridgeError):
    """The container did not start or the kernel did not say hello in time."""


class InvalidRequestError(BridgeError):
    """The model's arguments to run_python are unusable."""


# =============================================================================
# wire protocol
# =============================================================================
# Frames are built and parsed by mcp_sandbox_kernel (imported above) on both sides.

KERNEL_SOURCE = Path(mcp_sandbox_kernel.__file__)
KERNEL_FILENAME = "mcp_sandbox_kernel.py"
SESSION_CONFIG_FILENAME = "session.json"
IPC_MOUNT = "/ipc"
WORKDIR = "/workspace"


# =============================================================================
# container runtime
# =============================================================================

CONTAINER_LABEL = "io.github.mcp-server-code-execution-mode"
CONTAINER_PREFIX = "mcp-code-exec"
# Modest explicit ulimits: good hardening, and rootful Podman's defaults exceed the
# hard limits of some hosts ("setrlimit ... operation not permitted").
ULIMIT_NOFILE = 1024
ULIMIT_NPROC = 512
TMPFS_SIZE = "256m"
COMMAND_TIMEOUT = 20.0

INSTALL_HINT = (
    "Install Podman (https://podman.io/docs/installation; on Debian/Ubuntu: "
    "`sudo apt-get install podman`) or Docker (https://docs.docker.com/get-docker/), make sure "
    "`podman info` or `docker info` works for the user running this MCP server, then call "
    "run_python again. To choose one explicitly set MCP_BRIDGE_RUNTIME=podman|docker."
)


async def run_command(
    argv: Sequence[str], timeout: float = COMMAND_TIMEOUT
) -> subprocess.CompletedProcess[bytes]:
    """Run a short runtime CLI command; raises TimeoutError if it hangs."""
    with anyio.fail_after(timeout):
        return await anyio.run_process(list(argv), check=False, stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class LaunchSpec:
    """What one sandbox container needs; the argv is derived from it by a pure function."""

    name: str
    image: str
    ipc_dir: Path
    owner_pid: int
    memory: str
    pids: int
    cpus: float
    user: str


class ContainerRuntime:
    """Strategy for one container engine. The run flags are identical on both engines
    (one pure function builds them); what differs is how readiness is checked and what
    the engine needs before it can run anything."""

    name: ClassVar[RuntimeName]

    def __init__(self, executable: str) -> None:
        self.executable = executable
        self.warnings: list[str] = []

    def run_argv(self, spec: LaunchSpec) -> list[str]:
        return build_run_argv(self.executable, spec)

    def kill_argv(self, container: str) -> list[str]:
        return [self.executable, "rm", "--force", container]

    def list_argv(self) -> list[str]:
        return [
            self.executable,
            "ps",
            "--all",
            "--filter",
            "label=" + CONTAINER_LABEL,
            "--format",
            "{{.Names}}",
        ]

    async def check_ready(self) -> None:
        """Raise RuntimeUnavailableError unless the engine answers."""
        raise NotImplementedError

    async def release(self) -> None:
        """Undo what check_ready() started (only ever what the bridge itself started)."""


class DockerRuntime(ContainerRuntime):
    name = "docker"

    async def check_ready(self) -> None:
        result = await _answer(self, [self.executable, "info", "--format", "{{.ServerVersion}}"])
        logger.info("docker engine %s answers", result.stdout.decode().strip())


class PodmanRuntime(ContainerRuntime):
    name = "podman"

    def __init__(self, executable: str) -> None:
        super().__init__(executable)
        self.started_machine: str | None = None

    async def check_ready(self) -> None:
        if sys.platform == "darwin":
            await self._start_machine_if_stopped()
        result = await _answer(
            self,
            [self.executable, "info", "--format", "{{.Host.Security.Rootless}} {{.Host.CgroupsVersion}}"],
        )
        rootless, _, cgroups = result.stdout.decode().strip().partition(" ")
        if rootless == "true" and cgroups == "v1":
            self.warnings.append(
                "rootless Podman on cgroups v1 ignores resource limits: the sandbox's memory, "
                "pids and CPU caps are NOT enforced on this host"
            )
            logger.warning(self.warnings[-1])

    async def _start_machine_if_stopped(self) -> None:
        # On macOS Podman runs containers in a VM ("machine"); start a stopped one,
        # and remember it so release() stops only what the bridge started.
        result = await run_command([self.executable, "machine", "list", "--format", "json"])
        if result.returncode != 0:
            return
        machines = json.loads(result.stdout or b"[]")
        if not machines or any(machine.get("Running") for machine in machines):
            return
        chosen = next((m for m in machines if m.get("Default")), machines[0])
        logger.info("starting podman machine %s", chosen.get("Name"))
        started = await run_command([self.executable, "machine", "start", chosen["Name"]], timeout=180)
        if started.returncode == 0:
            self.started_machine = chosen["Name"]

    async def release(self) -> None:
        if self.started_machine:
            await run_command([self.executable, "machine", "stop", self.started_machine], timeout=60)
            self.started_machine = None


RUNTIME_CLASSES: dict[RuntimeName, type[ContainerRuntime]] = {
    "podman": PodmanRuntime,
    "docker": DockerRuntime,
}


async def _answer(runtime: ContainerRuntime, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    try:
        result = await run_command(argv)
    except TimeoutError:
        raise RuntimeUnavailableError(
            "%s did not answer within %gs (`%s`)." % (runtime.name, COMMAND_TIMEOUT, " ".join(argv[:2]))
        ) from None
    if result.returncode != 0:
        detail = result.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeUnavailableError(
            "%s is installed but not usable: %s"
            % (runtime.name, detail[-1] if detail else "exit %d" % result.returncode)
        )
    return result


async def detect_runtime(
    preferred: RuntimeName | None, which: Callable[[str], str | None] = shutil.which
) -> ContainerRuntime:
    """MCP_BRIDGE_RUNTIME if set, else Podman, else Docker: the first that answers."""
    candidates: list[RuntimeName] = [preferred] if preferred else ["podman", "docker"]
    problems: list[str] = []
    for name in candidates:
        executable = which(name)
        if executable is None:
            problems.append("%s is not installed (not on PATH)" % name)
            continue
        runtime = RUNTIME_CLASSES[name](executable)
        try:
            await runtime.check_ready()
        except RuntimeUnavailableError as exc:
            problems.append(str(exc))
            continue
        return runtime
    raise RuntimeUnavailableError(
        "No container runtime is available, so Python cannot run yet: %s. %s"
        % ("; ".join(problems), INSTALL_HINT)
    )


def build_run_argv(executable: str, spec: LaunchSpec) -> list[str]:
    """The hardened `run` command for one sandbox. Pure, so tests assert on it exactly."""
    tmpfs = "rw,nosuid,nodev,noexec,size=%s,mode=1777" % TMPFS_SIZE
    return [
        executable, "run",
        "--interactive",  # the kernel's stdin is the frame channel; EOF ends the container
        "--rm",
        "--name", spec.name,
        "--label", "%s=1" % CONTAINER_LABEL,
        "--label", "%s.owner-pid=%d" % (CONTAINER_LABEL, spec.owner_pid),
        "--network", "none",
        "--read-only",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--user", spec.user,
        "--memory", spec.memory,
        "--memory-swap", spec.memory,  # equal to memory: no swap on top of the limit
        "--pids-limit", str(spec.pids),
        "--cpus", "%g" % spec.cpus,
        "--ulimit", "nofile=%d:%d" % (ULIMIT_NOFILE, ULIMIT_NOFILE),
        "--ulimit", "nproc=%d:%d" % (ULIMIT_NPROC, ULIMIT_NPROC),
        "--tmpfs", "/tmp:" + tmpfs,
        "--tmpfs", WORKDIR + ":" + tmpfs,
        "--volume", "%s:%s:ro" % (spec.ipc_dir, IPC_MOUNT),
        # No --workdir: Docker re-creates a workdir that is a tmpfs mount point as 0755
        # root, making it unwritable for the sandbox user. The kernel chdirs instead.
        "--env", "HOME=" + WORKDIR,
        "--env", "PYTHONDONTWRITEBYTECODE=1",
        "--env", "PYTHONIOENCODING=utf-8",
        "--entrypoint", "python3",
        spec.image,
        "-I",  # isolated: the image's PYTHON* variables and user site cannot hijack the kernel
        "%s/%s" % (IPC_MOUNT, KERNEL_FILENAME),
        "%s/%s" % (IPC_MOUNT, SESSION_CONFIG_FILENAME),
    ]  # fmt: skip


def container_name(owner_pid: int) -> str:
    return "%s-%d-%s" % (CONTAINER_PREFIX, owner_pid, secrets.token_hex(4))


def owner_of(name: str) -> int | None:
    """The bridge pid encoded in a sandbox container or IPC directory name."""
    match = re.fullmatch(re.escape(CONTAINER_PREFIX) + r"-(\d+)-[0-9a-f]+", name)
    return int(match.group(1)) if match else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def sweep_orphans(
    runtime: ContainerRuntime, ipc_root: Path, alive: Callable[[int], bool] = process_alive
) -> list[str]:
    """Remove sandbox containers and IPC directories whose bridge process is gone."""
    result = await run_command(runtime.list_argv())
    names = result.stdout.decode().split() if result.returncode == 0 else []
    orphans = [name for name in names if (pid := owner_of(name)) is not None and not alive(pid)]
    for name in orphans:
        logger.info("removing orphaned sandbox container %s", name)
        await run_command(runtime.kill_argv(name))
    if ipc_root.is_dir():
        for entry in ipc_root.iterdir():
            pid = owner_of(entry.name)
            if pid is not None and not alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
    return orphans


# =============================================================================
# sandbox session
# =============================================================================

SIGKILL_EXIT = 128 + signal.SIGKILL


@dataclass
class ExecutionOutcome:
    """What one run_python call produced; rendered once at the tool boundary."""

    status: Literal["ok", "error", "timeout", "crashed"]
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: dict[str, str] | None = None
    truncated: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    state_kept: bool = True
    detail: str | None = None  # the status line: what happened to the run and the session
    notices: list[str] = field(default_factory=list)
    duration: float = 0.0


class PendingExecute:
    """Collects the frames of one execute until its result (or the session's death)."""

    def __init__(self, execute_id: str, max_chars: int) -> None:
        self.id = execute_id
        self.max_chars = max_chars
        self.streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.kept = {"stdout": 0, "stderr": 0}
        self.cut = {"stdout": 0, "stderr": 0}
        self.result: dict[str, Any] | None = None
        self.done = anyio.Event()

    def add_stream(self, name: str, text: str) -> None:
        # The kernel caps output already; this is the host's own cap (defense in depth
        # against code that writes frames to the channel itself).
        if name not in self.streams:
            return
        room = max(0, self.max_chars - self.kept[name])
        self.streams[name].append(text[:room])
        self.kept[name] += min(room, len(text))
        self.cut[name] += max(0, len(text) - room)


class SandboxSession:
    """One container running the kernel, and the task that reads its frames."""

    def __init__(self, runtime: ContainerRuntime, config: BridgeConfig, ipc_root: Path) -> None:
        self.runtime = runtime
        self.config = config
        self.name = container_name(os.getpid())
        self.ipc_dir = ipc_root / self.name / "ipc"
        self.process: anyio.abc.Process | None = None
        self.hello: dict[str, Any] | None = None
        self.hello_received = anyio.Event()
        self.exited = anyio.Event()
        self.pending: PendingExecute | None = None
        self.killed_by_bridge = False
        self.death_reason: str | None = None
        self.stderr_tail: list[str] = []
        self._write_lock = anyio.Lock()
        self._reader_scopes: list[anyio.CancelScope] = []

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.exited.is_set()

    # --- start ------------------------------------------------------------------
    def prepare_ipc_dir(self) -> None:
        """A private (0700) per-session directory holding a world-readable (0755) `ipc/`
        that is mounted read-only: the sandbox user can read the kernel, other host
        users cannot reach it, and nothing in it is writable from inside."""
        self.ipc_dir.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.ipc_dir.parent.mkdir(mode=0o700)
        self.ipc_dir.mkdir(mode=0o755)
        self.ipc_dir.chmod(0o755)  # undo the umask
        shutil.copyfile(KERNEL_SOURCE, self.ipc_dir / KERNEL_FILENAME)
        session_config = {
            "protocol": PROTOCOL_VERSION,
            "max_frame_bytes": self.config.max_frame_bytes,
            "max_output_chars": self.config.max_output_chars,
            "workdir": WORKDIR,
        }
        (self.ipc_dir / SESSION_CONFIG_FILENAME).write_text(json.dumps(session_config))
        for path in self.ipc_dir.iterdir():
            path.chmod(0o644)

    def launch_spec(self) -> LaunchSpec:
        return LaunchSpec(
            name=self.name,
            image=self.config.image,
            ipc_dir=self.ipc_dir,
            owner_pid=os.getpid(),
            memory=self.config.memory,
            pids=self.config.pids,
            cpus=self.config.cpus,
            user=self.config.container_user,
        )

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        self.prepare_ipc_dir()
        argv = self.runtime.run_argv(self.launch_spec())
        logger.debug("starting sandbox: %s", " ".join(argv))
        self.process = await anyio.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        task_group.start_soon(self._read_frames)
        task_group.start_soon(self._read_stderr)
        with anyio.move_on_after(self.config.start_timeout):
            await _first_of(self.hello_received, self.exited)
        if self.hello is None:
            reason = self.death_reason or "no hello from the kernel within %gs" % self.config.start_timeout
            await self.stop()
            raise SandboxStartError(
                "The sandbox container did not start: %s. Check that the image %r exists (or can be "
                "pulled) and has python3 >= 3.9; the server log has the runtime's output."
                % (reason, self.config.image)
            )
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            await self.stop()
            raise SandboxStartError(
                "The sandbox kernel speaks protocol %r, the bridge %d: reinstall the package."
                % (self.hello.get("protocol"), PROTOCOL_VERSION)
            )
        logger.info("sandbox %s ready (python %s)", self.name, self.hello.get("python"))

    # --- frame I/O ------------------------------------------------------------------
    async def send(self, frame: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        data = encode_frame(frame, self.config.max_frame_bytes)
        async with self._write_lock:
            await self.process.stdin.send(data)

    async def _read_frames(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        decoder = FrameDecoder(self.config.max_frame_bytes)
        with self._reader_scope():
            try:
                async for chunk in self.process.stdout:
                    for frame in decoder.feed(chunk):
                        self._dispatch(frame)
            except ProtocolError as exc:
                logger.error("sandbox %s broke the frame protocol: %s", self.name, exc)
                await self._kill("broke the frame protocol (%s)" % exc)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            await self._on_exit()

    async def _read_stderr(self) -> None:
        # The kernel's own diagnostics (not user output, which arrives as frames).
        assert self.process is not None and self.process.stderr is not None
        with self._reader_scope():
            try:
                async for chunk in self.process.stderr:
                    text = chunk.decode(errors="replace")
                    logger.info("sandbox %s stderr: %s", self.name, text.rstrip())
                    self.stderr_tail = (self.stderr_tail + text.splitlines())[-20:]
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _reader_scope(self) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        self._reader_scopes.append(scope)
        return scope

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        pending = self.pending
        matches = pending is not None and frame.get("id") == pending.id
        if kind == "hello":
            self.hello = frame
            self.hello_received.set()
        elif kind == "stream" and matches and pending is not None:
            pending.add_stream(str(frame.get("name")), str(frame.get("text", "")))
        elif kind == "result" and matches and pending is not None:
            pending.result = frame
            pending.done.set()
        elif kind == "error" and matches and pending is not None:
            pending.result = {
                "status": "error",
                "error": {"type": "SandboxError", "message": str(frame.get("message")), "traceback": ""},
            }
            pending.done.set()
        else:
            logger.debug("sandbox %s: ignoring frame %s", self.name, str(frame)[:200])

    async def _on_exit(self) -> None:
        assert self.process is not None
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            code = await self.process.wait()
            if self.death_reason is None:
                self.death_reason = self._explain_exit(code)
        self.exited.set()
        if self.pending is not None:
            self.pending.done.set()

    def _explain_exit(self, code: int | None) -> str:
        if self.killed_by_bridge:
            return "was stopped by the bridge"
        if code in (SIGKILL_EXIT, -signal.SIGKILL):
            return (
                "was killed (SIGKILL), almost certainly by the out-of-memory killer: the code "
                "exceeded the sandbox's %s memory limit" % self.config.memory
            )
        tail = " Last kernel output: %s" % " | ".join(self.stderr_tail[-3:]) if self.stderr_tail else ""
        return "exited unexpectedly with code %s.%s" % (code, tail)

    # --- execute ---------------------------------------------------------------------
    async def execute(self, code: str, timeout: float) -> ExecutionOutcome:
        started = time.monotonic()
        pending = PendingExecute(secrets.token_hex(8), self.config.max_output_chars)
        self.pending = pending
        try:
            await self.send({"type": "execute", "id": pending.id, "code": code})
        except ProtocolError as exc:
            self.pending = None
            raise InvalidRequestError(
                "The code is too large to send to the sandbox (%s). Split it into smaller calls, "
                "or raise MCP_BRIDGE_MAX_FRAME_BYTES." % exc
            ) from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader will notice the exit and complete `pending`
        timed_out = interrupted = False
        try:
            with anyio.move_on_after(timeout):
                await pending.done.wait()
            if not pending.done.is_set():
                timed_out = True
                interrupted = await self._stop_running(pending, "after a timeout")
        except anyio.get_cancelled_exc_class():
            # The client cancelled the call: stop the code too, or it would keep the
            # kernel busy and delay every later call.
            with anyio.CancelScope(shield=True):
                await self._stop_running(pending, "after the call was cancelled")
            raise
        finally:
            self.pending = None
        outcome = self._outcome(pending, timeout, timed_out, interrupted)
        outcome.duration = time.monotonic() - started
        return outcome

    async def _stop_running(self, pending: PendingExecute, when: str) -> bool:
        """Interrupt the running code; kill the container if it does not stop within
        the grace period. True when the interrupt worked (state kept)."""
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.send({"type": "interrupt", "id": pending.id})
        with anyio.move_on_after(self.config.interrupt_grace):
            await pending.done.wait()
        if pending.result is not None:
            return True
        if not pending.done.is_set():
            await self._kill("was killed %s because the code ignored the interrupt" % when)
            with anyio.move_on_after(10):
                await self.exited.wait()
        return False

    def _outcome(
        self, pending: PendingExecute, timeout: float, timed_out: bool, interrupted: bool
    ) -> ExecutionOutcome:
        result = pending.result or {}
        dropped = result.get("dropped") or {}
        outcome = ExecutionOutcome(
            status="ok",
            stdout="".join(pending.streams["stdout"]),
            stderr="".join(pending.streams["stderr"]),
            value=result.get("value"),
            error=result.get("error"),
            truncated={name: int(dropped.get(name, 0)) + pending.cut[name] for name in ("stdout", "stderr")},
        )
        if timed_out and interrupted:
            outcome.status = "timeout"
            outcome.detail = (
                "Timed out after %gs: the code was interrupted (KeyboardInterrupt). The session and "
                "its state were kept." % timeout
            )
        elif timed_out:
            outcome.status, outcome.state_kept = "timeout", False
            outcome.detail = (
                "Timed out after %gs and did not stop when interrupted, so the sandbox was killed. "
                "All state was lost; the next call starts a fresh session." % timeout
            )
            outcome.error = None
        elif pending.result is None:
            outcome.status, outcome.state_kept = "crashed", False
            outcome.detail = "The sandbox %s. All state was lost; the next call starts a fresh session." % (
                self.death_reason or "stopped"
            )
        elif result.get("status") != "ok":
            outcome.status = "error"
        return outcome

    # --- stop --------------------------------------------------------------------------
    async def _kill(self, reason: str) -> None:
        """Remove the container; `reason` completes "The sandbox ..." for the model."""
        self.killed_by_bridge = True
        self.death_reason = self.death_reason or reason
        try:
            await run_command(self.runtime.kill_argv(self.name))
        except TimeoutError:
            logger.warning("%s rm --force %s timed out", self.runtime.name, self.name)
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        """Close the channel (the kernel exits on EOF), make sure the container is gone,
        and remove the IPC directory. Safe to call more than once, from any task, and
        while the reader tasks are being cancelled (it waits on the process itself)."""
        with anyio.CancelScope(shield=True):
            process = self.process
            if process is not None and process.returncode is None:
                self.killed_by_bridge = True
                self.death_reason = self.death_reason or "was stopped by the bridge"
                if process.stdin is not None:
                    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await process.stdin.aclose()
                with anyio.move_on_after(2):
                    await process.wait()
                if process.returncode is None:
                    await self._kill("was stopped by the bridge")
                    with anyio.move_on_after(10):
                        await process.wait()
            for scope in self._reader_scopes:
                scope.cancel()
            self.exited.set()
            shutil.rmtree(self.ipc_dir.parent, ignore_errors=True)


async def _first_of(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as group:

        async def wait_for(event: anyio.Event) -> None:
            await event.wait()
            group.cancel_scope.cancel()

        for event in events:
            group.start_soon(wait_for, event)


class SessionManager:
    """Owns the one sandbox session of this bridge: pre-warms it, serializes executes,
    replaces it after a crash, a kill, a reset or idle shutdown, and tells the model
    whenever earlier state is gone."""

    def __init__(
        self,
        config: BridgeConfig,
        task_group: anyio.abc.TaskGroup,
        locate_runtime: Callable[[RuntimeName | None], Any] = detect_runtime,
    ) -> None:
        self.config = config
        self.task_group = task_group
        self.locate_runtime = locate_runtime
        self.ipc_root = config.state_dir / "ipc"
        self.runtime: ContainerRuntime | None = None
        self.session: SandboxSession | None = None
        self.lost_reason: str | None = None
        self.last_used = time.monotonic()
        self._lock = anyio.Lock()
        self._closed = False

    async def _ensure_runtime(self) -> ContainerRuntime:
        if self.runtime is None:
            runtime = await self.locate_runtime(self.config.runtime)
            await sweep_orphans(runtime, self.ipc_root)
            self.runtime = runtime
        return self.runtime

    async def _ensure_session(self, notices: list[str]) -> SandboxSession:
        if self.session is not None and not self.session.alive:
            self.lost_reason = self.lost_reason or "the previous sandbox %s." % self.session.death_reason
            await self.session.stop()
            self.session = None
        if self.session is None:
            runtime = await self._ensure_runtime()
            session = SandboxSession(runtime, self.config, self.ipc_root)
            await session.start(self.task_group)
            self.session = session
            if self.lost_reason:
                notices.append(
                    "Started a fresh sandbox session: %s Variables, imports and functions from "
                    "earlier calls are gone." % self.lost_reason
                )
                self.lost_reason = None
            notices.extend(runtime.warnings)
        return self.session

    async def prewarm(self) -> None:
        async with self._lock:
            try:
                await self._ensure_session([])
            except BridgeError as exc:
                logger.warning("pre-warm failed (run_python will retry): %s", exc)

    async def run(self, code: str, timeout: float, reset: bool) -> ExecutionOutcome:
        async with self._lock:
            notices: list[str] = []
            if reset and self.session is not None:
                await self.session.stop()
                self.session = None
                notices.append("Reset: started a fresh session with an empty namespace.")
            elif reset:
                self.lost_reason = None
            session = await self._ensure_session(notices)
            outcome = await session.execute(code, timeout)
            outcome.notices[:0] = notices
            if not session.alive:
                await session.stop()
                self.session = None
                self.lost_reason = "the previous sandbox %s." % session.death_reason
            self.last_used = time.monotonic()
            return outcome

    async def watch_idle(self) -> None:
        """Stop the sandbox after idle_timeout seconds without a call."""
        if self.config.idle_timeout <= 0:
            return
        while True:
            await anyio.sleep(min(self.config.idle_timeout, 30.0) / 2)
            if self.session is None or self._lock.locked():
                continue
            if time.monotonic() - self.last_used >= self.config.idle_timeout:
                async with self._lock:
                    if self.session is not None:
                        logger.info("stopping idle sandbox %s", self.session.name)
                        await self.session.stop()
                        self.session = None
                        self.lost_reason = "the previous sandbox was shut down after %gs without a call." % (
                            self.config.idle_timeout
                        )

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.session is not None:
                await self.session.stop()
                self.session = None
            if self.runtime is not None:
                await self.runtime.release()


# =============================================================================
# rendering
# =============================================================================


def structured_result(outcome: ExecutionOutcome) -> dict[str, Any]:
    return {
        "status": outcome.status,
        "stdout": outcome.stdout,
        "stderr": outcome.stderr,
        "value": outcome.value,
        "error": outcome.error,
        "truncated": outcome.truncated,
        "state_kept": outcome.state_kept,
        "detail": outcome.detail,
        "notices": outcome.notices,
        "duration_seconds": round(outcome.duration, 3),
    }


def cut_marker(stream: str, count: int, config: BridgeConfig) -> str:
    return (
        "\n[... %d more characters of %s cut: output is capped at %d characters per call "
        "(MCP_BRIDGE_MAX_OUTPUT) ...]" % (count, stream, config.max_output_chars)
    )


def render_compact(outcome: ExecutionOutcome, config: BridgeConfig) -> str:
    parts: list[str] = ["[session] " + notice for notice in outcome.notices]
    for stream in ("stdout", "stderr"):
        text = getattr(outcome, stream)
        if outcome.truncated[stream]:
            text += cut_marker(stream, outcome.truncated[stream], config)
        if text:
            parts.append(text.rstrip("\n") if stream == "stdout" else "[stderr]\n" + text.rstrip("\n"))
    if outcome.error and outcome.status in ("error", "timeout"):
        parts.append(
            outcome.error.get("traceback") or "%s: %s" % (outcome.error["type"], outcome.error["message"])
        )
    if outcome.value is not None:
        parts.append(outcome.value)
    if outcome.detail:
        parts.append("[%s] %s" % (outcome.status, outcome.detail))
    return "\n".join(parts) if parts else "(no output)"


def render_toon(outcome: ExecutionOutcome) -> str:
    data = {key: value for key, value in structured_result(outcome).items() if value not in (None, "", [])}
    return str(toon_format.encode(data))


def render_outcome(outcome: ExecutionOutcome, config: BridgeConfig) -> types.CallToolResult:
    text = render_toon(outcome) if config.output_mode == "toon" else render_compact(outcome, config)
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=structured_result(outcome),
        is_error=outcome.status != "ok",
    )


def render_error(exc: BridgeError) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=str(exc))], is_error=True)


# =============================================================================
# MCP server & tool
# =============================================================================

TOOL_NAME = "run_python"
CAPABILITIES_URI = "resource://code-execution/capabilities"
TOOL_DESCRIPTION = (
    "Run Python in a persistent, network-less sandbox. Variables, imports and functions persist "
    "across calls until reset; top-level await works; the last expression's value is shown. "
    "Writable: /workspace, /tmp. Manual: " + CAPABILITIES_URI
)

CAPABILITIES_MANUAL = """\
# run_python sandbox manual

run_python(code, timeout=None, reset=False) runs `code` in ONE long-lived Python process
inside a container. State (variables, imports, functions, open files) persists between
calls until `reset: true`, an idle shutdown, a timeout that had to kill the sandbox, or a
crash; the result says so whenever earlier state is gone.

- Like a REPL: the value of a final expression is shown; `_` holds the last value.
- Top-level `await` works (one event loop persists across calls).
- stdout and stderr are captured, including subprocesses and os.write(1, ...); each is
  capped per call and the result says how much was cut.
- Timeouts interrupt the code with KeyboardInterrupt and keep the session; code that
  ignores the interrupt is killed and the session restarts empty.
- Writable: /workspace (the working directory) and /tmp, both in memory. Everything
  else is read-only. There is no network. Memory, processes and CPU are limited.
- Python runs as an unprivileged user with no capabilities.
"""


def run_python_input_model(config: BridgeConfig) -> type[BaseModel]:
    """The tool's input model; its JSON schema is the tool's inputSchema. Built from the
    config so the schema states the real default and maximum timeout."""

    class RunPythonInput(BaseModel):
        model_config = ConfigDict(extra="forbid")
        code: str = Field(description="Python source to run.")
        timeout: float = Field(
            default=config.timeout, gt=0, le=config.max_timeout, description="Seconds before interrupting."
        )
        reset: bool = Field(default=False, description="Start from an empty namespace first.")

    return RunPythonInput


def run_python_tool(config: BridgeConfig) -> types.Tool:
    return types.Tool(
        name=TOOL_NAME,
        description=TOOL_DESCRIPTION,
        input_schema=_compact_schema(run_python_input_model(config).model_json_schema()),
        annotations=types.ToolAnnotations(
            title="Run Python", read_only_hint=False, destructive_hint=False, open_world_hint=False
        ),
    )


def _compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's auto-generated titles: they repeat the property names and cost
    tokens in every tools/list answer."""
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


def describe_validation_error(exc: ValidationError) -> str:
    problems = "; ".join(
        "%s: %s" % (".".join(str(part) for part in error["loc"]) or "arguments", error["msg"])
        for error in exc.errors()
    )
    return (
        'Invalid run_python arguments (%s). Call run_python with {"code": "..."} and optionally '
        '"timeout" (seconds) and "reset" (true/false).' % problems
    )


@dataclass
class BridgeState:
    config: BridgeConfig
    sessions: SessionManager


def build_server(
    config: BridgeConfig, locate_runtime: Callable[[RuntimeName | None], Any] = detect_runtime
) -> Server[BridgeState]:
    input_model = run_python_input_model(config)
    tool = run_python_tool(config)

    @asynccontextmanager
    async def lifespan(_: Server[BridgeState]) -> AsyncIterator[BridgeState]:
        async with anyio.create_task_group() as group:
            sessions = SessionManager(config, group, locate_runtime)
            if config.prewarm:
                group.start_soon(sessions.prewarm)
            group.start_soon(sessions.watch_idle)
            try:
                yield BridgeState(config, sessions)
            finally:
                await sessions.aclose()
                group.cancel_scope.cancel()

    async def list_tools(ctx: ServerRequestContext[BridgeState], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(
        ctx: ServerRequestContext[BridgeState], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name != TOOL_NAME:
            return render_error(
                InvalidRequestError("Unknown tool %r; the only tool is run_python." % params.name)
            )
        try:
            request = input_model.model_validate(params.arguments or {})
        except ValidationError as exc:
            return render_error(InvalidRequestError(describe_validation_error(exc)))
        try:
            outcome = await ctx.lifespan_context.sessions.run(
                request.code,  # type: ignore[attr-defined]
                request.timeout,  # type: ignore[attr-defined]
                request.reset,  # type: ignore[attr-defined]
            )
        except BridgeError as exc:
            return render_error(exc)
        return render_outcome(outcome, config)

    async def list_resources(
        ctx: ServerRequestContext[BridgeState], params: Any
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(
            resources=[
                types.Resource(
                    uri=CAPABILITIES_URI,
                    name="capabilities",
                    description="Manual of the run_python sandbox",
                    mime_type="text/markdown",
                )
            ]
        )

    async def read_resource(
        ctx: ServerRequestContext[BridgeState], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        if str(params.uri) != CAPABILITIES_URI:
            raise ValueError("Unknown resource %s; the only resource is %s" % (params.uri, CAPABILITIES_URI))
        return types.ReadResourceResult(
            contents=[
                types.TextResourceContents(
                    uri=CAPABILITIES_URI, mime_type="text/markdown", text=CAPABILITIES_MANUAL
                )
            ]
        )

    return Server(
        SERVER_NAME,
        version=__version__,
        lifespan=lifespan,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
    )


async def serve(config: BridgeConfig) -> None:
    """Serve MCP on stdio until stdin closes or SIGTERM/SIGINT arrives; the lifespan
    removes the sandbox either way."""
    server = build_server(config)
    async with anyio.create_task_group() as group, stdio_server() as (read_stream, write_stream):
        with anyio.CancelScope() as run_scope:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        logger.info("received signal %d; shutting down", signum)
                        run_scope.cancel()
                        return

            group.start_soon(stop_on_signal)
            await server.run(read_stream, write_stream, server.create_initialization_options())
        if run_scope.cancelled_caught:
            # The lifespan inside server.run has removed the sandbox, but the SDK's stdin
            # reader is a worker thread blocked in read(), which leaving stdio_server()
            # would wait for until the client writes or closes stdin.
            logging.shutdown()
            os._exit(0)
        group.cancel_scope.cancel()


# =============================================================================
# command line
# =============================================================================


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print("%s: %s" % (SERVER_NAME, exc), file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        anyio.run(serve, config)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
