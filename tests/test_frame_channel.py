"""The frames' Unix socket channel (MCP_BRIDGE_FRAME_CHANNEL): where the engine runs the
container on this machine, the bridge listens on channel.sock in the session's IPC
directory, the supervisor connects once after the key frame, and the frames go over the
socket from then on; where the socket is out of reach, or the setting says stdio, they stay
on the container's stdin and stdout.

Three layers: the kernel run on the host as in test_kernel (a socket of the test's own in
its session config), the bridge's Sandbox around a "container" that is a local script (no
engine: how the bridge takes, keeps and loses the connection), and real sandboxes on each
runtime in MCP_TEST_RUNTIMES, started directly and through the installed console script."""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

import mcp_sandbox_kernel
import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import PROTOCOL_VERSION, FailedTool, FrameDecoder, encode_frame
from tests.conftest import Engine, bridge_client, bridge_env, bridge_pids, console_script, structured, text_of
from tests.harness import PipeCollector

REPO = Path(__file__).resolve().parent.parent
KERNEL_PATH = Path(mcp_sandbox_kernel.__file__).resolve()
MAX_FRAME = 8 * 1024 * 1024
WAIT = 10.0  # generous upper bound for one frame or one exit; normally milliseconds

Frame = dict[str, Any]


# =============================================================================
# the kernel on the host, with a socket named in its session config
# =============================================================================


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose socket paths fit a socket address (108 bytes: tmp_path's may not);
    the kernel connects to the path its config names, as it is."""
    path = Path(tempfile.mkdtemp(prefix="frames-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class FrameReader:
    """The frames of one of the kernel's outputs (its stdout, or the socket connection),
    read in the test's own thread when it asks, with a timeout; ``raw``: every byte read."""

    def __init__(self, fd: int, key: bytes, kernel: LocalKernel, where: str) -> None:
        self.fd = fd
        self.kernel = kernel
        self.where = where
        self.decoder = FrameDecoder(MAX_FRAME, key=key)
        self.raw = bytearray()
        self.ended = False
        self._pending: list[Frame] = []

    def _read(self, timeout: float) -> bool:
        """One read; False when nothing came within ``timeout``."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        data = os.read(self.fd, 1 << 16)
        if not data:
            self.ended = True
        self.raw += data
        self._pending.extend(self.decoder.feed(data))
        return True

    def next_frame(self, timeout: float = WAIT, expecting: str = "a frame") -> Frame:
        deadline = time.monotonic() + timeout
        while not self._pending:
            if self.ended:
                raise AssertionError(
                    self.kernel.failure("%s ended (waiting for %s)" % (self.where, expecting))
                )
            if not self._read(deadline - time.monotonic()):
                raise AssertionError(
                    self.kernel.failure(
                        "nothing on %s within %gs (waiting for %s)" % (self.where, timeout, expecting)
                    )
                )
        return self._pending.pop(0)

    def result_of(self, execute_id: str) -> tuple[list[Frame], Frame]:
        """The frames up to the result of ``execute_id``, and that result."""
        before: list[Frame] = []
        while True:
            frame = self.next_frame(expecting="the result of %s" % execute_id)
            if frame["type"] == "result" and frame.get("id") == execute_id:
                return before, frame
            before.append(frame)

    def until_end(self, timeout: float = WAIT) -> bytes:
        """Everything up to the end of the stream (all of ``raw``), which must come in ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            if not self._read(deadline - time.monotonic()):
                raise AssertionError(self.kernel.failure("%s did not end within %gs" % (self.where, timeout)))
        return bytes(self.raw)


class LocalKernel:
    """The supervisor as a subprocess of the test, as test_kernel starts it: its session
    config (naming ``socket_path`` when given), the key frame on its stdin; its stdout is a
    FrameReader, its stderr collected by a thread."""

    def __init__(self, workdir: Path, socket_path: Path | None) -> None:
        config: dict[str, Any] = {
            "protocol": PROTOCOL_VERSION,
            "max_frame_bytes": MAX_FRAME,
            "max_output_chars": 1000,
            "workdir": str(workdir),
            "output_dir": str(workdir / "outputs"),
        }
        if socket_path is not None:
            config["socket"] = str(socket_path)
        config_path = workdir / "session.json"
        config_path.write_text(json.dumps(config))
        self.process = subprocess.Popen(
            [sys.executable, str(KERNEL_PATH), str(config_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self.key = os.urandom(32)
        assert self.process.stdout is not None
        self.stdout = FrameReader(self.process.stdout.fileno(), self.key, self, "the kernel's stdout")
        assert self.process.stderr is not None
        self._stderr_reader = PipeCollector(self.process.stderr.fileno(), "kernel-stderr")
        self.send_on_stdin({"type": "key", "key": self.key.hex()})  # as the bridge does, first

    def stderr_text(self) -> str:
        return self._stderr_reader.text()

    def wait_for_stderr(self, text: str, timeout: float = WAIT) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.stderr_text():
            if time.monotonic() > deadline:
                raise AssertionError(self.failure("%r never came on the kernel's stderr" % text))
            time.sleep(0.02)
        return self.stderr_text()

    def failure(self, message: str) -> str:
        code = self.process.poll()
        state = "running" if code is None else "exited with code %d" % code
        return "%s\nkernel pid %d: %s\nkernel stderr so far: %s" % (
            message,
            self.process.pid,
            state,
            self.stderr_text()[-4000:] or "(empty)",
        )

    def send_on_stdin(self, frame: Frame) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(encode_frame(frame, MAX_FRAME))
        self.process.stdin.flush()

    def close_stdin(self) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            with suppress(OSError):  # BrokenPipeError: the kernel is already gone
                stdin.close()

    def wait_exit(self, timeout: float = WAIT) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(self.failure("the kernel did not exit within %gs" % timeout)) from None

    def close(self) -> None:
        """Stop the kernel (its stdin closing, else a kill), then close the pipes once the
        stderr reader has seen their end (see test_kernel: never close under a reader)."""
        self.close_stdin()
        try:
            self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr_reader.join(timeout=WAIT)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None and not self._stderr_reader.is_alive():
                stream.close()


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        fields = Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return fields[0] in ("Z", "X")


def wait_until_gone(pid: int, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def listening(path: Path, backlog: int = 1) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(backlog)
    return listener


class OnSocket:
    """The bridge's end of a kernel's socket: the connection the kernel made to the test's
    listener, and the frames arriving on it (the hello first)."""

    def __init__(self, kernel: LocalKernel, listener: socket.socket) -> None:
        self.kernel = kernel
        listener.settimeout(WAIT)
        try:
            self.connection, _ = listener.accept()
        except TimeoutError:
            raise AssertionError(kernel.failure("the kernel did not connect within %gs" % WAIT)) from None
        self.frames = FrameReader(self.connection.fileno(), kernel.key, kernel, "the socket")
        self.hello = self.frames.next_frame(expecting="the hello")

    def close(self) -> None:
        self.connection.close()

    def send(self, frame: Frame) -> None:
        self.connection.sendall(encode_frame(frame, MAX_FRAME))

    def run(self, code: str, execute_id: str = "exec-1") -> tuple[list[Frame], Frame]:
        self.send({"type": "execute", "id": execute_id, "code": code})
        return self.frames.result_of(execute_id)

    def start_sleeper(self) -> int:
        """Start code that prints its pid and sleeps; the executor's pid once it runs."""
        self.send({"type": "execute", "id": "sleeper", "code": SLEEPER})
        while True:
            frame = self.frames.next_frame(expecting="the sleeper's pid")
            if frame["type"] == "stream" and frame.get("id") == "sleeper":
                return int(frame["text"].split()[0])


UNREAD_FRAMES = 200
SLEEPER = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(300)"


class SocketKernel:
    """A kernel whose config names the test's listening socket; ``accepted()``: its
    connection, taken in the test (a kernel that does not connect fails the test)."""

    def __init__(self, workdir: Path, directory: Path, backlog: int = 1) -> None:
        path = directory / "channel.sock"
        self.listener = listening(path, backlog)
        self.kernel = LocalKernel(workdir, path)
        self.connections: list[OnSocket] = []

    def accepted(self) -> OnSocket:
        connection = OnSocket(self.kernel, self.listener)
        self.connections.append(connection)
        return connection

    def close(self) -> None:
        self.kernel.close()
        for connection in self.connections:
            connection.close()
        self.listener.close()


@pytest.fixture
def socket_kernel(tmp_path: Path, short_dir: Path) -> Iterator[SocketKernel]:
    started = SocketKernel(tmp_path, short_dir)
    try:
        yield started
    finally:
        started.close()


def test_the_kernel_moves_its_signed_frames_to_the_socket_its_config_names(
    socket_kernel: SocketKernel,
) -> None:
    kernel = socket_kernel.kernel
    on_socket = socket_kernel.accepted()

    before, result = on_socket.run("print('over the socket')\n6 * 7")
    second_before, second = on_socket.run("_ + 1", "exec-2")  # the same namespace, the same channel

    assert on_socket.hello["type"] == "hello", on_socket.hello
    assert on_socket.hello["protocol"] == PROTOCOL_VERSION
    assert on_socket.hello["pid"] == kernel.process.pid
    assert result["status"] == "ok" and result["value"] == "42", result
    streams = [frame for frame in before if frame["type"] == "stream"]
    assert "".join(frame["text"] for frame in streams) == "over the socket\n", before
    assert second["value"] == "43", (second_before, second)
    assert on_socket.frames.decoder.unauthentic == 0  # every line on the socket signed, in order
    assert kernel.process.poll() is None
    kernel.close_stdin()
    assert kernel.wait_exit() == 0
    # Nothing went to stdout: not the hello, not a result, not one byte.
    assert kernel.stdout.until_end() == b"", kernel.failure("frames on stdout")
    assert "frames stay on stdio" not in kernel.stderr_text()


def test_the_kernel_connects_once_and_reads_its_frames_only_from_the_socket(
    tmp_path: Path, short_dir: Path
) -> None:
    started = SocketKernel(tmp_path, short_dir, backlog=4)  # room for a second connection
    try:
        on_socket = started.accepted()
        # A frame on stdin after the move is no frame at all: stdin only tells the end.
        started.kernel.send_on_stdin({"type": "execute", "id": "via-stdin", "code": "1"})
        _, result = on_socket.run("2")
        started.listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            started.listener.accept()  # no second connection
        with pytest.raises(AssertionError, match="nothing on the socket"):
            on_socket.frames.next_frame(timeout=0.5, expecting="anything for via-stdin")
    finally:
        started.close()
    assert result["id"] == "exec-1" and result["value"] == "2", result


def test_closing_the_kernels_stdin_stops_it_with_its_code_while_its_frames_are_on_the_socket(
    socket_kernel: SocketKernel,
) -> None:
    kernel = socket_kernel.kernel
    on_socket = socket_kernel.accepted()
    executor = on_socket.start_sleeper()

    kernel.close_stdin()

    assert kernel.wait_exit() == 0
    assert wait_until_gone(executor), "the executor %d outlived its supervisor" % executor
    on_socket.frames.until_end()  # its end of the socket closed with it


@pytest.mark.parametrize("unread", [False, True], ids=["all-read", "frames-unread"])
def test_a_closed_socket_stops_the_kernel_whose_stdin_stays_open(
    socket_kernel: SocketKernel, unread: bool
) -> None:
    """A dead bridge: its end of the socket closes (with frames of the kernel's it never
    read, or none); the container's stdin is still open."""
    kernel = socket_kernel.kernel
    on_socket = socket_kernel.accepted()
    executor = on_socket.start_sleeper()
    if unread:  # each answered by an error frame, which waits unread in the test's end
        for _ in range(UNREAD_FRAMES):
            on_socket.send({"type": "no such frame"})
        time.sleep(0.5)

    on_socket.close()

    code = kernel.wait_exit()
    assert kernel.process.stdin is not None and not kernel.process.stdin.closed
    assert wait_until_gone(executor), "the executor %d outlived its supervisor" % executor
    # Frames left unread reset the kernel's end (ECONNRESET): an end of the frames all the same.
    assert code == 0, kernel.failure("the end of the frames should end the kernel cleanly")


@pytest.mark.parametrize("reach", ["stale", "missing"])
def test_without_a_listener_at_the_path_the_frames_stay_on_stdio_and_stderr_says_why(
    tmp_path: Path, short_dir: Path, reach: str
) -> None:
    path = short_dir / "channel.sock"
    if reach == "stale":  # a socket file that nobody listens on any more
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))
        stale.close()
        assert path.is_socket()
    why = os.strerror(errno.ECONNREFUSED if reach == "stale" else errno.ENOENT)
    kernel = LocalKernel(tmp_path, path)
    try:
        hello = kernel.stdout.next_frame(expecting="the hello on stdout")
        kernel.send_on_stdin({"type": "execute", "id": "e1", "code": "6 * 7"})
        _, result = kernel.stdout.result_of("e1")
        stderr = kernel.wait_for_stderr("frames stay on stdio")
    finally:
        kernel.close()
    assert hello["type"] == "hello" and hello["pid"] == kernel.process.pid, hello
    assert result["status"] == "ok" and result["value"] == "42", result
    assert "kernel: the frames stay on stdio (no socket channel: %s: %s)\n" % (path, why) in stderr, stderr
    assert kernel.stdout.decoder.unauthentic == 0


# =============================================================================
# the bridge's side without an engine: a local script as the "container"
# =============================================================================


class NoServices:
    def server_list(self) -> list[dict[str, str]]:
        return []

    def config_problems(self) -> list[str]:
        return []

    async def handle(self, method: str, params: Mapping[str, object], run: object) -> object:
        return None

    def defined_tools_notice(self, names: Sequence[str]) -> str | None:
        return None

    async def quarantine_tools(self, failed: Sequence[FailedTool]) -> list[str]:
        return []


class ScriptRuntime(bridge.PodmanEngine):
    """A local, non-remote "engine" whose container is a Python script, given the session's
    IPC directory (the container's /ipc) as its argument."""

    def __init__(self, script: Path) -> None:
        super().__init__(sys.executable)
        self.script = script

    def run_argv(self, spec: bridge.LaunchSpec) -> list[str]:
        return [sys.executable, str(self.script), str(spec.ipc_dir)]

    def kill_argv(self, container: str) -> list[str]:
        return ["true"]  # the bridge kills the script's process itself


SCRIPT_START = """
import os, socket, sys, time
sys.path.insert(0, %r)
from mcp_sandbox_kernel import PROTOCOL_VERSION, Channel

channel = Channel(0, 1, 1 << 20)
channel.key = bytes.fromhex(channel.receive()["key"])
hello = {"type": "hello", "protocol": PROTOCOL_VERSION, "python": "3.11", "pid": os.getpid()}
""" % str(REPO)

# Connects, says hello on the socket, takes the execute from it, then closes the socket and
# lives on: only the bridge can end it.
CLOSES_ITS_SOCKET = (
    SCRIPT_START
    + """
directory = os.open(sys.argv[1], os.O_PATH | os.O_DIRECTORY)
connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
connection.connect("/proc/self/fd/%d/channel.sock" % directory)
channel.move_to(connection.fileno())
channel.send(hello)
execute = channel.receive()
sys.stderr.write("got %s over the socket\\n" % execute["type"])
sys.stderr.flush()
connection.close()
time.sleep(300)
"""
)

# Never connects: says hello on stdout and answers an execute there.
STAYS_ON_STDIO = (
    SCRIPT_START
    + """
channel.send(hello)
execute = channel.receive()
channel.send({"type": "result", "id": execute["id"], "status": "ok", "value": "'over stdio'", "error": None})
channel.receive()
"""
)


def script_sandbox(tmp_path: Path, script: str) -> bridge.Sandbox:
    path = tmp_path / "kernel.py"
    path.write_text(script)
    config = bridge.BridgeConfig(state_dir=tmp_path, start_timeout=30)
    sandbox = bridge.Sandbox(ScriptRuntime(path), config, tmp_path / "ipc", NoServices())
    assert sandbox.container.frames_via_socket
    return sandbox


def connect_in(directory: Path, name: str) -> None:
    """Connect to the socket ``directory/name`` (any length of path), then hang up."""
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect("/proc/self/fd/%d/%s" % (directory_fd, name))
    finally:
        os.close(directory_fd)


@pytest.mark.anyio
async def test_a_kernel_that_closes_its_socket_and_lives_on_is_removed_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge, "SOCKET_CLOSED_GRACE", 1.0)
    sandbox = script_sandbox(tmp_path, CLOSES_ITS_SOCKET)
    async with anyio.create_task_group() as group:
        try:
            await sandbox.start(group)
            channel = sandbox.channel
            started = time.monotonic()
            with anyio.fail_after(30):
                outcome = await sandbox.execute("1", timeout=20)
            took = time.monotonic() - started
        finally:
            await sandbox.stop()
    assert channel == "socket"
    assert "got execute over the socket" in sandbox.exit.stderr_tail, sandbox.exit.stderr_tail
    assert outcome.status == "crashed", outcome
    assert sandbox.death_reason == "closed its frame channel"
    assert outcome.detail is not None and outcome.detail.startswith("The sandbox closed its frame channel.")
    assert 1.0 <= took < 10, took  # after the grace, long before the call's timeout
    assert sandbox.process is not None and sandbox.process.returncode == -signal.SIGKILL


@pytest.mark.anyio
async def test_a_hello_on_stdout_closes_the_listener_and_removes_its_file(tmp_path: Path) -> None:
    sandbox = script_sandbox(tmp_path, STAYS_ON_STDIO)
    ipc_dir = sandbox.container.ipc_dir
    async with anyio.create_task_group() as group:
        try:
            await sandbox.start(group)
            with anyio.fail_after(5):
                while (ipc_dir / bridge.CHANNEL_SOCKET_FILENAME).exists():
                    await anyio.sleep(0.01)
            outcome = await sandbox.execute("1", timeout=10)
            channel = sandbox.channel
            with pytest.raises(FileNotFoundError):
                connect_in(ipc_dir, bridge.CHANNEL_SOCKET_FILENAME)
        finally:
            await sandbox.stop()
    assert channel == "stdio"
    assert outcome.status == "ok" and outcome.value == "'over stdio'", outcome


# --- the bridge's end of the connection: FrameSocket ------------------------------------


@pytest.mark.anyio
async def test_the_frame_socket_reads_and_writes_whole_and_ends_as_an_anyio_stream() -> None:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    stream = bridge.FrameSocket(ours)
    big = b"x" * (8 << 20)  # far over the socket's buffer: the send waits for room, then goes on
    received = bytearray()

    async def read_slowly() -> None:
        while len(received) < len(big):
            await anyio.wait_readable(theirs)
            received.extend(theirs.recv(1 << 16))

    async with anyio.create_task_group() as group:
        group.start_soon(read_slowly)
        with anyio.fail_after(30):
            await stream.send(big)
    assert bytes(received) == big
    theirs.sendall(b"one\n")
    with anyio.fail_after(5):
        assert await stream.receive() == b"one\n"
    theirs.close()
    with anyio.fail_after(5), pytest.raises(anyio.EndOfStream):
        await stream.receive()
    await stream.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"late")


@pytest.mark.anyio
async def test_closing_the_frame_socket_ends_a_waiting_receive_and_a_waiting_send() -> None:
    ours, theirs = socket.socketpair()
    stream = bridge.FrameSocket(ours)
    failed: list[str] = []

    async def receive() -> None:
        with pytest.raises(anyio.ClosedResourceError):
            await stream.receive()
        failed.append("receive")

    async def send() -> None:
        with pytest.raises(anyio.ClosedResourceError):
            await stream.send(b"x" * (8 << 20))  # nobody reads: it waits for room
        failed.append("send")

    async with anyio.create_task_group() as group:
        group.start_soon(receive)
        group.start_soon(send)
        await anyio.sleep(0.1)
        stream.close()
        with anyio.fail_after(5):
            while len(failed) < 2:
                await anyio.sleep(0.01)
    assert sorted(failed) == ["receive", "send"]
    theirs.close()


@pytest.mark.anyio
async def test_a_stale_wake_of_the_frame_socket_reads_nothing_and_the_loop_runs_on() -> None:
    """The loop may call the socket's readable callback after the data it saw was read:
    the read must not block the loop (the socket is non-blocking), and the wait goes on.
    A callback while nobody waits leaves the data for the next receive and unregisters
    the socket (a readable socket nobody reads must not wake the loop again and again)."""
    ours, theirs = socket.socketpair()
    stream = bridge.FrameSocket(ours)
    theirs.sendall(b"first\n")
    assert await stream.receive() == b"first\n"
    theirs.sendall(b"unread\n")
    stream._readable()  # nobody waits
    assert stream._loop is None and not stream._chunks
    assert await stream.receive(3) == b"unr"  # what was left, cut to the size asked for
    assert await stream.receive() == b"ead\n"
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    async def stale_wake() -> None:
        await anyio.sleep(0.05)
        assert stream._waiter is not None
        stream._readable()  # as if readable, with nothing there

    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        group.start_soon(stale_wake)
        with anyio.move_on_after(0.3) as waited:
            await stream.receive()  # waits on: nothing was sent
        assert waited.cancelled_caught
        assert ticks >= 10  # the loop ran on meanwhile
        theirs.sendall(b"second\n")
        with anyio.fail_after(5):
            assert await stream.receive() == b"second\n"
        group.cancel_scope.cancel()
    await stream.aclose()
    theirs.close()


@pytest.mark.parametrize(
    ("frame_channel", "remote", "delivery", "via_socket"),
    [
        ("auto", False, "auto", True),
        ("stdio", False, "auto", False),
        ("auto", True, "auto", False),  # a remote engine cannot reach this machine's socket
        ("auto", False, "stdin", False),  # no IPC mount: nowhere to put it
    ],
)
def test_the_session_config_names_the_socket_only_where_the_bridge_listens_on_it(
    tmp_path: Path,
    frame_channel: bridge.FrameChannel,
    remote: bool,
    delivery: bridge.KernelDelivery,
    via_socket: bool,
) -> None:
    runtime = bridge.PodmanEngine("/nonexistent/podman")
    runtime.remote = remote
    config = bridge.BridgeConfig(state_dir=tmp_path, frame_channel=frame_channel, kernel_delivery=delivery)
    sandbox = bridge.Sandbox(runtime, config, tmp_path / "ipc", NoServices())
    container = sandbox.container

    container.prepare_ipc_dir()
    listener = container.take_listener()
    try:
        socket_file = container.ipc_dir / bridge.CHANNEL_SOCKET_FILENAME
        assert container.frames_via_socket is via_socket
        assert ("socket" in container.session_config()) is via_socket
        assert (listener is not None) is via_socket
        if via_socket:
            assert container.session_config()["socket"] == "/ipc/channel.sock"
            assert socket_file.is_socket() and socket_file.stat().st_mode & 0o777 == 0o666
            connect_in(container.ipc_dir, bridge.CHANNEL_SOCKET_FILENAME)  # it listens
        else:
            assert not socket_file.exists()
        if not container.kernel_via_stdin:  # the config the kernel reads from the mount
            written = json.loads((container.ipc_dir / bridge.SESSION_CONFIG_FILENAME).read_text())
            assert written.get("socket") == ("/ipc/channel.sock" if via_socket else None)
    finally:
        if listener is not None:
            listener.close()


# =============================================================================
# real sandboxes on each runtime (the `engine` fixture marks these `container`)
# =============================================================================

# What the code in the sandbox sees of the channel: the socket its session.json names, the
# socket file in /ipc, the bridge's end of the connection in the sandbox's network namespace
# (an accepted socket is listed there, with the listener's name), and a connection attempt.
CHANNEL_PROBE = """
import json, os, socket
with open('/ipc/session.json') as f:
    named = json.load(f).get('socket')
with open('/proc/net/unix') as f:
    connected = sum(line.rstrip().endswith('/channel.sock') for line in f)
probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    probe.connect('/ipc/channel.sock')
    refused = None
except OSError as exc:
    refused = type(exc).__name__
finally:
    probe.close()
{'named': named, 'file': os.path.exists('/ipc/channel.sock'), 'connected': connected, 'refused': refused}
"""

ON_SOCKET = {"named": "/ipc/channel.sock", "file": False, "connected": 1, "refused": "FileNotFoundError"}
ON_STDIO = {"named": None, "file": False, "connected": 0, "refused": "FileNotFoundError"}


@asynccontextmanager
async def direct_sandbox(
    engine: Engine, state_dir: Path, frame_channel: bridge.FrameChannel = "auto"
) -> AsyncIterator[bridge.Sandbox]:
    """A bridge.Sandbox on ``engine``, started as the bridge starts one (as `doctor` does)."""
    runtime = await bridge.detect_engine(cast(bridge.EngineName, engine.name))
    config = bridge.BridgeConfig(
        state_dir=state_dir,
        image=engine.image,
        runtime=cast(bridge.EngineName, engine.name),
        frame_channel=frame_channel,
        start_timeout=60,
    )
    async with anyio.create_task_group() as group:
        api = bridge.SandboxAPI(bridge.ClientPool(bridge.DiscoveryResult((), (), ()), config, group), config)
        sandbox = bridge.Sandbox(runtime, config, state_dir / "ipc", api)
        try:
            await sandbox.start(group)
            yield sandbox
        finally:
            await sandbox.stop()
            group.cancel_scope.cancel()


def engine_kill(engine: Engine, container: str) -> None:
    subprocess.run([engine.name, "kill", container], capture_output=True, timeout=30, check=True)


def channel_connections(engine: Engine, container: str) -> int:
    """The bridge's ends of channel.sock connections in ``container``'s network namespace,
    read from the host through its PID 1."""
    pid = subprocess.run(
        [engine.name, "inspect", "--format", "{{.State.Pid}}", container],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    lines = Path("/proc/%s/net/unix" % pid).read_text().splitlines()
    return sum(line.rstrip().endswith("/channel.sock") for line in lines)


@pytest.mark.anyio
async def test_a_sandbox_on_a_local_engine_takes_its_frames_over_the_socket(
    engine: Engine, state_dir: Path
) -> None:
    async with direct_sandbox(engine, state_dir) as sandbox:
        ipc_dir = sandbox.container.ipc_dir
        channel = sandbox.channel
        file_after_start = (ipc_dir / bridge.CHANNEL_SOCKET_FILENAME).exists()
        with pytest.raises(FileNotFoundError):
            connect_in(ipc_dir, bridge.CHANNEL_SOCKET_FILENAME)  # the one connection was taken
        named = json.loads((ipc_dir / bridge.SESSION_CONFIG_FILENAME).read_text()).get("socket")
        seen = await sandbox.execute(CHANNEL_PROBE, timeout=30)
        await sandbox.execute("x = 41", timeout=30)
        kept = await sandbox.execute("print('out'); x + 1", timeout=30)
        process = sandbox.process
    assert sandbox.container.frames_via_socket
    assert channel == "socket"
    assert not file_after_start
    assert named == "/ipc/channel.sock"
    assert seen.status == "ok" and seen.value_json == ON_SOCKET, seen
    assert kept.status == "ok" and kept.value == "42" and kept.stdout == "out\n", kept
    # The bridge closed the container's stdin and the kernel ended by itself, not by a removal.
    assert process is not None and process.returncode == 0, (process, sandbox.death_reason)


@pytest.mark.anyio
async def test_frame_channel_stdio_keeps_the_frames_on_the_containers_stdin_and_stdout(
    engine: Engine, state_dir: Path
) -> None:
    async with direct_sandbox(engine, state_dir, frame_channel="stdio") as sandbox:
        listener = sandbox.container.listener
        channel = sandbox.channel
        named = json.loads((sandbox.container.ipc_dir / bridge.SESSION_CONFIG_FILENAME).read_text())
        seen = await sandbox.execute(CHANNEL_PROBE, timeout=30)
        await sandbox.execute("x = 41", timeout=30)
        kept = await sandbox.execute("x + 1", timeout=30)
    assert not sandbox.container.frames_via_socket and listener is None
    assert channel == "stdio"
    assert "socket" not in named
    assert seen.status == "ok" and seen.value_json == ON_STDIO, seen
    assert kept.status == "ok" and kept.value == "42", kept


@pytest.mark.anyio
@pytest.mark.parametrize("frame_channel", ["auto", "stdio"])
async def test_a_container_killed_from_outside_ends_its_sandbox_and_a_running_call(
    engine: Engine, state_dir: Path, frame_channel: bridge.FrameChannel
) -> None:
    async with direct_sandbox(engine, state_dir, frame_channel) as sandbox:
        channel = sandbox.channel
        engine_kill(engine, sandbox.name)  # idle
        with anyio.fail_after(WAIT):
            await sandbox.exited.wait()
        alive, reason = sandbox.alive, sandbox.death_reason
    async with direct_sandbox(engine, state_dir, frame_channel) as running:

        async def kill_soon() -> None:
            await anyio.sleep(1.5)
            engine_kill(engine, running.name)

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(kill_soon)
            outcome = await running.execute("import time\ntime.sleep(120)", timeout=60)
        took = time.monotonic() - started
    assert channel == ("socket" if frame_channel == "auto" else "stdio")
    assert not alive
    # The engine's SIGKILL, read from the exit code (the bridge did not remove it).
    assert reason is not None and reason.startswith("was killed (SIGKILL)"), reason
    assert outcome.status == "crashed" and not outcome.state_kept, outcome
    assert outcome.detail is not None and outcome.detail.startswith("The sandbox was killed (SIGKILL)")
    assert took < 1.5 + WAIT, took  # at the kill, not at the call's timeout


@pytest.mark.anyio
async def test_through_the_bridge_a_killed_sandbox_is_reported_and_replaced(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        first = await client.call_tool("run_python", {"code": "kept = 41\n" + CHANNEL_PROBE})
        owner = bridge_pids(state_dir)[0]
        [killed] = engine.containers(owner_pid=owner)
        engine_kill(engine, killed)
        started = time.monotonic()
        after = await client.call_tool("run_python", {"code": "'kept' in globals()", "timeout": 30})
        took = time.monotonic() - started
        fresh = await client.call_tool("run_python", {"code": "kept = 1\n" + CHANNEL_PROBE})
        running = engine.containers(owner_pid=owner)
    assert structured(first)["json"] == ON_SOCKET, text_of(first)
    assert took < WAIT, took
    text = text_of(after)
    if after.is_error:  # the call came before the bridge saw the container end: it ends the call
        assert structured(after)["status"] == "crashed", text
        assert text.startswith("[crashed] The sandbox was killed (SIGKILL)"), text
        assert "the next call starts a fresh session" in text
        notices = structured(fresh)["notices"]
        assert any(
            n.startswith("Started a fresh sandbox session: the previous sandbox was killed") for n in notices
        )
    else:  # the bridge saw it end first: the call runs in a fresh sandbox, and says so
        assert structured(after)["value"] == "False", text
        assert "Started a fresh sandbox session: the previous sandbox was killed (SIGKILL)" in text, text
    assert not fresh.is_error and structured(fresh)["json"] == ON_SOCKET, text_of(fresh)
    assert len(running) == 1 and killed not in running, (killed, running)


@pytest.mark.anyio
@pytest.mark.parametrize("frame_channel", ["auto", "stdio"])
async def test_through_the_bridge_the_setting_decides_the_channel_and_state_persists(
    engine: Engine, state_dir: Path, frame_channel: str
) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_FRAME_CHANNEL=frame_channel)
    async with bridge_client(env) as client:
        first = await client.call_tool("run_python", {"code": "x = 41"})
        seen = await client.call_tool("run_python", {"code": CHANNEL_PROBE})
        kept = await client.call_tool("run_python", {"code": "print('out')\nx + 1"})
        owner = bridge_pids(state_dir)[0]
        containers = engine.containers(owner_pid=owner)
    assert not first.is_error, text_of(first)
    assert structured(seen)["json"] == (ON_SOCKET if frame_channel == "auto" else ON_STDIO), text_of(seen)
    assert not kept.is_error and text_of(kept) == "out\n42", text_of(kept)
    assert len(containers) == 1


@pytest.mark.parametrize("frame_channel", ["auto", "stdio"])
def test_a_sigkilled_bridge_leaves_no_running_container(
    engine: Engine, state_dir: Path, frame_channel: str
) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_PREWARM="1", MCP_BRIDGE_FRAME_CHANNEL=frame_channel)
    bridge_process = subprocess.Popen(
        [console_script()], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while (
            not (running := engine.containers(owner_pid=bridge_process.pid)) and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert len(running) == 1, "the pre-warmed container never appeared"
        # Pre-warmed: started, its hello read (on the socket, the bridge holds the connection).
        expected = 1 if frame_channel == "auto" else 0
        deadline = time.monotonic() + 30
        while (connections := channel_connections(engine, running[0])) != expected:
            assert time.monotonic() < deadline, "%d channel connections, not %d" % (connections, expected)
            time.sleep(0.2)
        bridge_process.send_signal(signal.SIGKILL)
        bridge_process.wait(5)
        killed = time.monotonic()
        while engine.containers(owner_pid=bridge_process.pid) and time.monotonic() < killed + 10:
            time.sleep(0.2)
        assert engine.containers(owner_pid=bridge_process.pid) == [], (
            "still running 10s after the bridge died"
        )
    finally:
        bridge_process.kill()
        bridge_process.wait()
        for leftover in engine.containers(running_only=False, owner_pid=bridge_process.pid):
            subprocess.run([engine.name, "rm", "-f", leftover], capture_output=True, check=False)
