"""The in-sandbox kernel of mcp-server-code-execution-mode.

The bridge copies this file into the session's read-only IPC mount and starts it as
the container's main process: ``python3 /ipc/mcp_sandbox_kernel.py /ipc/session.json``.
It is standard library only and runs on any CPython >= 3.9, because users pick the
image. The bridge imports the wire-protocol section on the host too, so frames are
built and parsed in exactly one place.

Sections (``grep -n '^# ====' mcp_sandbox_kernel.py``):
    wire protocol   -> newline-delimited JSON frames, size-capped, no line limit
    output capture  -> fd 1 / fd 2 become pipes pumped into ``stream`` frames
    code execution  -> one persistent namespace, top-level await, REPL-style value
    kernel          -> the frame loop: execute / interrupt, exactly one result each
    entry point

The frame channel is a private duplicate of the container's original stdin/stdout,
taken before any user code runs; user code writing to fd 1 (``print``,
``os.write(1, ...)``, subprocesses) only ever reaches the capture pipe.
"""

from __future__ import annotations

import ast
import asyncio
import codecs
import inspect
import json
import linecache
import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any, Callable

# =============================================================================
# wire protocol
# =============================================================================

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 32 * 1024 * 1024

Frame = dict[str, Any]


class ProtocolError(Exception):
    """A frame that cannot be accepted: not JSON, not an object, or over the size cap."""


def encode_frame(frame: Frame, max_frame_bytes: int) -> bytes:
    """One frame = one JSON object on one line. JSON escapes newlines inside strings,
    so the only raw newline is the terminator."""
    data = json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if len(data) + 1 > max_frame_bytes:
        raise ProtocolError(
            "frame of %d bytes exceeds the maximum frame size of %d bytes" % (len(data) + 1, max_frame_bytes)
        )
    return data + b"\n"


class FrameDecoder:
    """Incremental parser for a byte stream of frames. Has no line-length limit of its
    own; the only limit is ``max_frame_bytes``, checked before a frame is complete so a
    runaway sender cannot make the reader buffer without bound."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            frames.append(self._parse(bytes(self._buffer[start:end])))
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) >= self.max_frame_bytes:
            raise ProtocolError(
                "incoming frame exceeds the maximum frame size of %d bytes" % self.max_frame_bytes
            )
        return frames

    def _parse(self, line: bytes) -> Frame:
        if len(line) + 1 > self.max_frame_bytes:
            raise ProtocolError(
                "incoming frame of %d bytes exceeds the maximum frame size of %d bytes"
                % (len(line) + 1, self.max_frame_bytes)
            )
        try:
            frame = json.loads(line.decode("utf-8", "surrogatepass"))
        except ValueError as exc:
            raise ProtocolError(f"malformed frame ({exc}): {line[:80]!r}") from None
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            raise ProtocolError(f"frame is not an object with a string 'type': {line[:80]!r}")
        return frame


class Channel:
    """The kernel's end of the frame channel: thread-safe sends, blocking reads."""

    def __init__(self, in_fd: int, out_fd: int, max_frame_bytes: int) -> None:
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._pending: list[Frame] = []
        self._lock = threading.Lock()

    def send(self, frame: Frame) -> None:
        try:
            data = encode_frame(frame, self.max_frame_bytes)
        except ProtocolError as exc:
            # Report instead of sending; the id lets the bridge fail the right request.
            data = encode_frame(
                {"type": "error", "id": frame.get("id"), "message": str(exc)}, self.max_frame_bytes
            )
        with self._lock:
            view = memoryview(data)
            while view:
                written = os.write(self.out_fd, view)
                view = view[written:]

    def receive(self) -> Frame | None:
        """The next frame, or None at end of input (the bridge has gone)."""
        while not self._pending:
            data = os.read(self.in_fd, 1 << 16)
            if not data:
                return None
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)


# =============================================================================
# output capture
# =============================================================================


class OutputLimiter:
    """Per-execute output cap shared by the stdout and stderr pumps: text past the
    cap is counted, not sent, so a ten-megabyte print costs the channel nothing."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self.reset(None)

    def reset(self, execute_id: str | None) -> None:
        with self._lock:
            self.execute_id = execute_id
            self.sent = {"stdout": 0, "stderr": 0}
            self.dropped = {"stdout": 0, "stderr": 0}

    def admit(self, name: str, text: str) -> str:
        with self._lock:
            room = max(0, self.max_chars - self.sent[name])
            kept = text[:room]
            self.sent[name] += len(kept)
            self.dropped[name] += len(text) - len(kept)
            return kept


class OutputPump(threading.Thread):
    """Reads one capture pipe and turns it into ``stream`` frames.

    ``sync()`` lets the executing thread wait until everything written to the pipe
    before the call has been forwarded: it writes a random marker through the pipe
    itself, so ordering holds for every writer, including subprocesses. The pump keeps
    a private write end, so ``reattach()`` can repair ``target_fd`` after user code
    closed or redirected it."""

    def __init__(
        self, name: str, read_fd: int, write_fd: int, target_fd: int, channel: Channel, limiter: OutputLimiter
    ):
        super().__init__(name="pump-" + name, daemon=True)
        self.stream_name = name
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.target_fd = target_fd
        self.channel = channel
        self.limiter = limiter
        self.marker = b"\x00MCP-SYNC-" + os.urandom(12).hex().encode() + b"\x00"
        self._synced = threading.Event()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def reattach(self) -> None:
        os.dup2(self.write_fd, self.target_fd)

    def sync(self, timeout: float = 5.0) -> None:
        self._synced.clear()
        os.write(self.write_fd, self.marker)
        self._synced.wait(timeout)

    def run(self) -> None:
        carry = b""
        while True:
            data = os.read(self.read_fd, 1 << 16)
            if not data:
                return
            buffer = carry + data
            while True:
                index = buffer.find(self.marker)
                if index < 0:
                    break
                self._forward(buffer[:index])
                buffer = buffer[index + len(self.marker) :]
                self._synced.set()
            keep = _partial_suffix(buffer, self.marker)
            carry = buffer[len(buffer) - keep :] if keep else b""
            self._forward(buffer[: len(buffer) - keep])

    def _forward(self, data: bytes) -> None:
        if not data:
            return
        text = self.limiter.admit(self.stream_name, self._decoder.decode(data))
        if text:
            self.channel.send(
                {"type": "stream", "id": self.limiter.execute_id, "name": self.stream_name, "text": text}
            )


def _partial_suffix(buffer: bytes, marker: bytes) -> int:
    """Length of the longest tail of ``buffer`` that could start ``marker``."""
    for size in range(min(len(buffer), len(marker) - 1), 0, -1):
        if marker.startswith(buffer[-size:]):
            return size
    return 0


def capture_fd(fd: int, name: str, channel: Channel, limiter: OutputLimiter) -> OutputPump:
    """Point ``fd`` at a fresh pipe and start a pump on the pipe's read end."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: children only get ``fd``
    pump = OutputPump(name, read_fd, write_fd, fd, channel, limiter)
    pump.reattach()
    pump.start()
    return pump


# =============================================================================
# code execution
# =============================================================================

CELL_PREFIX = "<cell-"


class Executor:
    """One persistent namespace. Each execute is compiled as a cell that allows
    top-level ``await``; a final expression is evaluated separately so its value can
    be shown like a REPL."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        self.loop = asyncio.new_event_loop()
        self.cell_count = 0

    def run(self, source: str) -> Any:
        """Run ``source``; return the final expression's value (None if there is none).
        Exceptions from user code propagate unchanged."""
        self.cell_count += 1
        filename = "%s%d>" % (CELL_PREFIX, self.cell_count)
        # Registered so tracebacks can show the user's own lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = ast.parse(source, filename, "exec")
        last: ast.expr | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = tree.body.pop().value  # type: ignore[attr-defined]
        if tree.body:
            self._evaluate(compile(tree, filename, "exec", flags=flags, dont_inherit=True))
        if last is None:
            return None
        expression = ast.Expression(last)
        return self._evaluate(compile(expression, filename, "eval", flags=flags, dont_inherit=True))

    def _evaluate(self, code: Any) -> Any:
        result = eval(code, self.namespace)
        if code.co_flags & inspect.CO_COROUTINE:
            result = self._run_coroutine(result)
        return result

    def _run_coroutine(self, coroutine: Any) -> Any:
        asyncio.set_event_loop(self.loop)  # user code may have run asyncio.run() in between
        task = self.loop.create_task(coroutine)
        try:
            return self.loop.run_until_complete(task)
        except KeyboardInterrupt:
            task.cancel()
            try:
                self.loop.run_until_complete(task)
            except BaseException:
                pass
            raise


def format_user_exception(exc: BaseException, kernel_file: str) -> str:
    """The traceback the model sees: user frames only, with the user's line numbers."""
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next
    details = traceback.TracebackException(type(exc), exc, tb)
    _drop_kernel_frames(details, kernel_file, set())
    return "".join(details.format())


def _drop_kernel_frames(details: traceback.TracebackException, kernel_file: str, seen: set[int]) -> None:
    if id(details) in seen:
        return
    seen.add(id(details))
    details.stack = traceback.StackSummary.from_list(
        [frame for frame in details.stack if frame.filename != kernel_file]
    )
    for chained in (details.__cause__, details.__context__):
        if chained is not None:
            _drop_kernel_frames(chained, kernel_file, seen)


def safe_repr(value: Any, limit: int) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the result frame
        text = f"<unrepresentable {type(value).__name__}: {type(exc).__name__}: {exc}>"
    if len(text) > limit:
        text = text[:limit] + "... [%d more characters of the value cut]" % (len(text) - limit)
    return text


# =============================================================================
# kernel
# =============================================================================


class Kernel:
    """Owns the channel, the capture pumps and the executor. The main thread runs
    user code (so Ctrl-C semantics hold); a reader thread receives frames, so an
    interrupt can arrive while code runs and end of input stops the container."""

    def __init__(self, channel: Channel, config: dict[str, Any]) -> None:
        self.channel = channel
        self.max_output_chars = int(config.get("max_output_chars", 50000))
        self.limiter = OutputLimiter(self.max_output_chars)
        self.executor = Executor()
        self.pumps: list[OutputPump] = []
        self.std_streams: dict[str, Any] = {}
        self.executes: queue.Queue[Frame | None] = queue.Queue()
        self.running_id: str | None = None
        self._state_lock = threading.Lock()
        self.handlers: dict[str, Callable[[Frame], None]] = {
            "execute": self.executes.put,
            "interrupt": self._on_interrupt,
        }

    # --- set-up ---------------------------------------------------------------
    def capture_output(self) -> None:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        self.pumps = [
            capture_fd(1, "stdout", self.channel, self.limiter),
            capture_fd(2, "stderr", self.channel, self.limiter),
        ]
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - lives as long as the process
        self.reattach_output()
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def reattach_output(self) -> None:
        """Before each execute: repair what earlier user code may have closed or
        replaced (fd 1/2, sys.stdout/sys.stderr), so one call cannot silence the next."""
        for pump in self.pumps:
            pump.reattach()
        for name, fd in (("stdout", 1), ("stderr", 2)):
            ours = self.std_streams.get(name)
            if ours is None or ours.closed:
                # Line buffering streams prints promptly; closefd=False keeps fd 1/2 open.
                ours = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
                self.std_streams[name] = ours
            setattr(sys, name, ours)

    # --- threads ------------------------------------------------------------------
    def read_frames(self) -> None:
        """Reader thread: dispatch frames; end of input means the bridge is gone, so
        exit at once, even if user code is still running."""
        try:
            while True:
                frame = self.channel.receive()
                if frame is None:
                    break
                handler = self.handlers.get(frame["type"])
                if handler is None:
                    message = "unknown frame type %r" % frame["type"]
                    self.channel.send({"type": "error", "message": message})
                else:
                    handler(frame)
        except ProtocolError as exc:
            self.channel.send({"type": "error", "message": str(exc)})
        finally:
            os._exit(0)

    def _on_interrupt(self, frame: Frame) -> None:
        with self._state_lock:
            if self.running_id is not None and frame.get("id") == self.running_id:
                os.kill(os.getpid(), signal.SIGINT)

    def _on_sigint(self, signum: int, stack: Any) -> None:
        # Only user code is interruptible; a late interrupt between executes is dropped.
        if self.running_id is not None:
            raise KeyboardInterrupt

    # --- main loop ------------------------------------------------------------------
    def serve(self) -> None:
        self.channel.send(
            {
                "type": "hello",
                "protocol": PROTOCOL_VERSION,
                "python": "%d.%d.%d" % sys.version_info[:3],
                "pid": os.getpid(),
            }
        )
        threading.Thread(target=self.read_frames, name="frame-reader", daemon=True).start()
        while True:
            frame = self.executes.get()
            if frame is None:
                return
            self.channel.send(self.execute(frame))

    def execute(self, frame: Frame) -> Frame:
        execute_id = frame.get("id")
        self.reattach_output()
        self.limiter.reset(execute_id)
        result: Frame = {"type": "result", "id": execute_id, "status": "ok", "value": None, "error": None}
        code = frame.get("code")
        try:
            if not isinstance(code, str):
                raise TypeError("execute frame has no 'code' string")
            with self._state_lock:
                self.running_id = execute_id
            value = self.executor.run(code)
            self.running_id = None
            if value is not None:
                self.executor.namespace["_"] = value
                result["value"] = safe_repr(value, self.max_output_chars)
        except BaseException as exc:
            self.running_id = None
            result["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
            result["error"] = {
                "type": type(exc).__name__,
                "message": safe_repr(exc, 2000) if not str(exc) else str(exc)[:2000],
                "traceback": format_user_exception(exc, __file__),
            }
        finally:
            self.running_id = None
        self.flush_output()
        result["dropped"] = dict(self.limiter.dropped)
        return result

    def flush_output(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # user code may have closed or replaced it
                pass
        for pump in self.pumps:
            pump.sync()


# =============================================================================
# entry point
# =============================================================================


def main(argv: list[str]) -> int:
    config: dict[str, Any] = {}
    if len(argv) > 1:
        with open(argv[1], encoding="utf-8") as handle:
            config = json.load(handle)
    # Private duplicates of the original stdin/stdout carry the frames; fd 0/1/2 are
    # then repointed so nothing user code does can reach the channel by accident.
    channel = Channel(os.dup(0), os.dup(1), int(config.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES)))
    kernel = Kernel(channel, config)
    kernel.capture_output()
    os.chdir(config.get("workdir", os.getcwd()))
    kernel.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
