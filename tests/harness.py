"""What the tests and the benchmarks share to drive the bridge as an MCP host does: the
installed console script, the environment of one isolated bridge, the MCP SDK's own stdio
client, and the text of a tool result. No pytest here: benchmarks/ imports it too.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import mcp_types as types
from mcp.client.client import Client
from mcp.client.session import ClientSession, ElicitationFnT, LoggingFnT
from mcp.client.stdio import StdioServerParameters, stdio_client

CONSOLE_SCRIPT = "mcp-server-code-execution-mode"
DEFAULT_IMAGE = "localhost/mcp-sandbox-python:bookworm"
CONTAINER_LABEL = "io.github.mcp-server-code-execution-mode"


class NotInstalledError(RuntimeError):
    """The console script is not installed in this environment."""


def console_script() -> str:
    """The console script next to this interpreter: the checkout installed in the project's
    venv (never another installation that happens to be on PATH)."""
    found = shutil.which(CONSOLE_SCRIPT, path=os.path.dirname(sys.executable))
    if found is None:
        raise NotInstalledError(
            "%s is not installed next to %s; run scripts/setup.sh" % (CONSOLE_SCRIPT, sys.executable)
        )
    return found


@dataclass(frozen=True)
class Engine:
    """One container runtime the tests drive directly (to look for leftover containers);
    ``env``: how to reach it, e.g. ``{"DOCKER_HOST": "tcp://..."}`` (none: the local one)."""

    name: str
    image: str
    env: Mapping[str, str] = field(default_factory=dict)

    def containers(self, *, running_only: bool = True, owner_pid: int | None = None) -> list[str]:
        argv = [self.name, "ps", "--filter", "label=" + CONTAINER_LABEL, "--format", "{{.Names}}"]
        if not running_only:
            argv.append("--all")
        if owner_pid is not None:
            argv += ["--filter", "label=%s.owner-pid=%d" % (CONTAINER_LABEL, owner_pid)]
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, check=True, env={**os.environ, **self.env}
        )
        return result.stdout.split()


def bridge_env(engine: Engine | None, state_dir: Path, **overrides: str) -> dict[str, str]:
    """This environment without any MCP_BRIDGE_* setting, plus the bridge's state dir, a
    quiet log, ``engine`` (none: the bridge chooses) and ``overrides``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MCP_BRIDGE_")}
    env.update({"MCP_BRIDGE_STATE_DIR": str(state_dir), "MCP_BRIDGE_LOG_LEVEL": "WARNING"})
    if engine is not None:
        env.update({"MCP_BRIDGE_RUNTIME": engine.name, "MCP_BRIDGE_IMAGE": engine.image})
    env.update(overrides)
    return env


def isolated_env(engine: Engine | None, state_dir: Path, home: Path, **overrides: str) -> dict[str, str]:
    """bridge_env with HOME set to ``home``, so only its client configs are discovered."""
    env = bridge_env(engine, state_dir, HOME=str(home), **overrides)
    env.pop("XDG_CONFIG_HOME", None)
    return env


@asynccontextmanager
async def bridge_client(
    env: dict[str, str],
    cwd: Path | None = None,
    errlog: TextIO = sys.stderr,
    elicitation: ElicitationFnT | None = None,
    logging: LoggingFnT | None = None,
) -> AsyncIterator[ClientSession]:
    """The installed console script behind the MCP SDK's own stdio client, initialized;
    ``errlog``: a file for the bridge's log (stderr); ``elicitation``: the client's
    answer to elicitation requests (given, the client declares the capability);
    ``logging``: what hears the log messages (notifications/message) the bridge sends."""
    params = StdioServerParameters(command=console_script(), env=env, cwd=cwd)
    async with (
        stdio_client(params, errlog) as (read, write),
        ClientSession(read, write, elicitation_callback=elicitation, logging_callback=logging) as session,
    ):
        await session.initialize()
        yield session


@asynccontextmanager
async def modern_bridge_client(
    env: dict[str, str], elicitation: ElicitationFnT | None = None
) -> AsyncIterator[Client]:
    """The installed console script behind the MCP SDK's high-level client speaking the
    2026-07-28 protocol, which answers the bridge's input_required results itself (with
    ``elicitation``, given, as its user)."""
    params = StdioServerParameters(command=console_script(), env=env)
    async with Client(params, elicitation_callback=elicitation, mode="2026-07-28") as client:
        yield client


def bridge_pids(state_dir: Path) -> list[int]:
    """Pids of bridge processes started with this (unique) state directory."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"mcp-server-code-execution-mode" in part for part in cmdline[:2]) and (
            b"MCP_BRIDGE_STATE_DIR=" + str(state_dir).encode() in environ
        ):
            pids.append(int(proc.name))
    return pids


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


class PipeCollector(threading.Thread):
    """Collects what a process writes to one of its pipes (``fd``), in a thread of its own,
    until the end of file; ``text()`` never blocks on the process."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.fd = fd
        self._data = bytearray()
        self._lock = threading.Lock()
        self.start()

    def run(self) -> None:
        while data := os.read(self.fd, 1 << 16):
            with self._lock:
                self._data += data

    def text(self) -> str:
        with self._lock:
            return self._data.decode(errors="replace")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str, seconds: float = 60) -> None:
    """Until ``process`` listens on ``port``; AssertionError if it ends or takes too long."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, "%s ended: %s" % (what, process.returncode)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("%s never listened on port %d" % (what, port))


@contextmanager
def local_server(argv: Callable[[int], list[str]], what: str) -> Iterator[int]:
    """A server process started with ``argv(port)`` on a free loopback port, once it listens:
    the port. Stopped at the end."""
    port = free_port()
    server = subprocess.Popen(argv(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, server, what)
        yield port
    finally:
        server.terminate()
        server.wait(10)
