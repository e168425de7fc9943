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
import base64
import codecs
import difflib
import inspect
import json
import linecache
import os
import queue
import signal
import sys
import threading
import traceback
import types
from typing import Any, Callable, NamedTuple

# =============================================================================
# wire protocol
# =============================================================================

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 32 * 1024 * 1024

Frame = dict[str, Any]


class ProtocolError(Exception):
    """A frame that cannot be accepted: not JSON, not an object, over the size cap, or
    with a field of the wrong type or size."""


# --- frame schemas -------------------------------------------------------------------
# Every frame is checked against its type's fields before anyone uses it: the bridge
# checks what comes out of the sandbox (hostile code may write frames of its own), the
# kernel what comes from the bridge. Unknown fields are ignored; unknown types refused.

MAX_ID_CHARS = 64  # ids are short strings or integers: a reply echoes the id
MAX_NAME_CHARS = 200  # method names, error type names
STREAM_NAMES = ("stdout", "stderr")
RESULT_STATUSES = ("ok", "error", "interrupted")


class FieldRule(NamedTuple):
    check: Callable[[Any], bool]
    expected: str  # completes "field X must be ..."
    required: bool = True


def is_frame_id(value: Any) -> bool:
    if isinstance(value, str):
        return 0 < len(value) <= MAX_ID_CHARS
    return type(value) is int and abs(value) < 2**53


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_optional_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_stream_counts(value: Any) -> bool:
    return isinstance(value, dict) and all(
        name in STREAM_NAMES and _is_count(count) for name, count in value.items()
    )


def _is_error_info(value: Any) -> bool:
    """{"type": name, "message": text, "traceback": text (optional)}"""
    return (
        isinstance(value, dict)
        and _is_name(value.get("type"))
        and _is_text(value.get("message"))
        and _is_optional_text(value.get("traceback"))
    )


def _is_optional_error_info(value: Any) -> bool:
    return value is None or _is_error_info(value)


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in choices


_ID = FieldRule(is_frame_id, "a string of 1-%d characters or an integer" % MAX_ID_CHARS)
_ERROR_INFO = "null or an object with string fields type, message (and traceback)"

FRAME_SCHEMAS: dict[str, dict[str, FieldRule]] = {
    # bridge -> kernel
    "execute": {"id": _ID, "code": FieldRule(_is_text, "a string")},
    "interrupt": {"id": _ID},
    "response": {
        "id": _ID,
        "error": FieldRule(_is_optional_error_info, _ERROR_INFO, required=False),
    },
    # kernel -> bridge
    "hello": {
        "protocol": FieldRule(_is_count, "a non-negative integer"),
        "python": FieldRule(_is_name, "a version string"),
    },
    "stream": {
        "id": _ID,
        "name": FieldRule(_one_of(*STREAM_NAMES), " or ".join(STREAM_NAMES)),
        "text": FieldRule(_is_text, "a string"),
    },
    "result": {
        "id": _ID,
        "status": FieldRule(_one_of(*RESULT_STATUSES), ", ".join(RESULT_STATUSES)),
        "value": FieldRule(_is_optional_text, "null or a string", required=False),
        "error": FieldRule(_is_optional_error_info, _ERROR_INFO, required=False),
        "dropped": FieldRule(_is_stream_counts, "an object of stdout/stderr counts", required=False),
    },
    "error": {
        "id": FieldRule(lambda value: value is None or is_frame_id(value), "null or an id", required=False),
        "message": FieldRule(_is_text, "a string"),
    },
    "request": {
        "id": _ID,
        "method": FieldRule(_is_name, "a method name of 1-%d characters" % MAX_NAME_CHARS),
        "params": FieldRule(_is_object, "an object"),
    },
    "cancel": {"id": _ID},
}
BRIDGE_FRAME_TYPES = frozenset({"execute", "interrupt", "response"})
KERNEL_FRAME_TYPES = frozenset({"hello", "stream", "result", "error", "request", "cancel"})


def validate_frame(frame: Frame, accepted: frozenset[str]) -> Frame:
    """``frame`` itself when its type is one of ``accepted`` and every field has the
    right type and size; else ProtocolError saying which field is wrong."""
    kind = frame.get("type")
    if kind not in accepted:
        known = "unexpected" if kind in FRAME_SCHEMAS else "unknown"
        raise ProtocolError("%s frame type %s" % (known, _preview(kind)))
    for name, rule in FRAME_SCHEMAS[kind].items():
        if name not in frame:
            if rule.required:
                raise ProtocolError("%s frame has no field %r" % (kind, name))
        elif not rule.check(frame[name]):
            raise ProtocolError("%s frame: field %r must be %s" % (kind, name, rule.expected))
    return frame


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        # A KeyboardInterrupt between two partial writes would leave half a frame on the
        # channel; while the main thread writes, the SIGINT handler only records it.
        self.main_thread_writing = False
        self.deferred_interrupt = False

    def send(self, frame: Frame) -> None:
        """Send one frame whole; ProtocolError (nothing sent) when it is over the cap,
        so the sender can tell its own caller at once."""
        data = encode_frame(frame, self.max_frame_bytes)
        in_main = threading.current_thread() is threading.main_thread()
        with self._lock:
            self.main_thread_writing = in_main
            try:
                view = memoryview(data)
                while view:
                    written = os.write(self.out_fd, view)
                    view = view[written:]
            finally:
                self.main_thread_writing = False
        if in_main and self.deferred_interrupt:
            self.deferred_interrupt = False
            raise KeyboardInterrupt

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

    def uncount(self, name: str, chars: int) -> None:
        with self._lock:
            self.sent[name] -= chars
            self.dropped[name] += chars

    def admit(self, name: str, text: str) -> str:
        with self._lock:
            room = max(0, self.max_chars - self.sent[name])
            kept = text[:room]
            self.sent[name] += len(kept)
            self.dropped[name] += len(text) - len(kept)
            return kept


class OutputPump(threading.Thread):
    """Reads one capture pipe and turns it into ``stream`` frames.

    ``start_sync()`` + ``wait_synced()`` let the executing thread wait until everything
    written to the pipe before the call has been forwarded: it writes a random marker through the pipe
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

    def start_sync(self) -> None:
        self._synced.clear()
        os.write(self.write_fd, self.marker)

    def wait_synced(self, timeout: float = 5.0) -> None:
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
            frame = {"type": "stream", "id": self.limiter.execute_id, "name": self.stream_name, "text": text}
            try:
                self.channel.send(frame)
            except ProtocolError:  # only with a frame cap below the chunk size: count it as cut
                self.limiter.uncount(self.stream_name, len(text))


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
    # Drop the kernel's frames and whatever they called (asyncio, threading) until user
    # code appears again: the model should see its own lines, not our plumbing.
    kept, in_kernel = [], False
    for frame in details.stack:
        if frame.filename == kernel_file:
            in_kernel = True
        elif not in_kernel or frame.filename.startswith(CELL_PREFIX):
            in_kernel = False
            kept.append(frame)
    details.stack = traceback.StackSummary.from_list(kept)
    for chained in (details.__cause__, details.__context__):
        if chained is not None:
            _drop_kernel_frames(chained, kernel_file, seen)


def describe_user_exception(exc: BaseException, limit: int) -> dict[str, str]:
    """type, message and traceback of an exception from user code, each safe to compute
    (a broken ``__str__`` must not kill the kernel) and capped: the traceback keeps its
    end, where the error is."""
    try:
        message = str(exc)
    except Exception:
        message = safe_repr(exc, 2000)
    try:
        text = format_user_exception(exc, __file__)
    except Exception:
        text = "%s: %s\n" % (type(exc).__name__, message)
    if len(text) > limit:
        text = "[... %d characters of the traceback cut ...]\n%s" % (len(text) - limit, text[-limit:])
    return {"type": type(exc).__name__[:MAX_NAME_CHARS], "message": message[:2000], "traceback": text}


def safe_repr(value: Any, limit: int) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the result frame
        text = f"<unrepresentable {type(value).__name__}: {type(exc).__name__}: {exc}>"
    if len(text) > limit:
        text = text[:limit] + "... [%d more characters of the value cut]" % (len(text) - limit)
    return text


# =============================================================================
# sandbox API: host requests, `from mcp import runtime`, mcp_<alias> objects
# =============================================================================


class MCPError(Exception):
    """A call the bridge could not complete: unknown or denied server or tool, a server
    that failed to start or crashed, a timeout, a result over the size cap."""


class MCPToolError(MCPError):
    """The tool ran and reported failure (``isError``); ``result`` is the raw result."""

    def __init__(self, message: str, server: str = "", tool: str = "", result: Any = None) -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool
        self.result = result


ERROR_TYPES = {"MCPError": MCPError, "MCPToolError": MCPToolError}


class ToolImage:
    """Image content from a tool: ``data`` is the decoded bytes."""

    def __init__(self, data: bytes, mime_type: str) -> None:
        self.data = data
        self.mime_type = mime_type

    def __repr__(self) -> str:
        return "<ToolImage %s, %d bytes>" % (self.mime_type, len(self.data))


class HostRequests:
    """Requests from sandbox code to the bridge, multiplexed by id over the channel, so
    many can be in flight at once. Synchronous callers block on a threading.Event;
    asynchronous ones await a future resolved from the reader thread."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        self._counter = 0
        self._waiting: dict[str, Callable[[Frame], None]] = {}

    def _register(self, deliver: Callable[[Frame], None]) -> str:
        with self._lock:
            self._counter += 1
            request_id = "r%d" % self._counter
            self._waiting[request_id] = deliver
        return request_id

    def _send_request(self, request_id: str, method: str, params: dict[str, Any]) -> None:
        try:
            self.channel.send({"type": "request", "id": request_id, "method": method, "params": params})
        except ProtocolError as exc:
            self._forget(request_id, cancel=False)  # never sent: nothing to cancel
            raise MCPError(
                "%s: the arguments are too large to send to the host (%s). Pass less data per call "
                "(split it over several calls)." % (method, exc)
            ) from None
        except (TypeError, ValueError) as exc:  # not JSON-serializable
            self._forget(request_id, cancel=False)
            raise TypeError(
                "%s: arguments must be JSON values (str, int, float, bool, None, list, dict): %s"
                % (method, exc)
            ) from None

    def _forget(self, request_id: str, cancel: bool) -> None:
        with self._lock:
            pending = self._waiting.pop(request_id, None)
        if cancel and pending is not None:
            self.channel.send({"type": "cancel", "id": request_id})

    def resolve(self, frame: Frame) -> None:
        """Reader thread: hand a ``response`` frame to whoever waits for it."""
        with self._lock:
            deliver = self._waiting.pop(str(frame.get("id")), None)
        if deliver is not None:
            deliver(frame)

    def call(self, method: str, params: dict[str, Any]) -> Any:
        done = threading.Event()
        box: list[Frame] = []

        def deliver(frame: Frame) -> None:
            box.append(frame)
            done.set()

        request_id = self._register(deliver)
        try:
            self._send_request(request_id, method, params)
            done.wait()  # interruptible: a timeout's KeyboardInterrupt lands here
        finally:
            self._forget(request_id, cancel=not box)
        return _response_value(box[0])

    async def call_async(self, method: str, params: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Frame] = loop.create_future()

        def deliver(frame: Frame) -> None:
            loop.call_soon_threadsafe(_settle, future, frame)

        request_id = self._register(deliver)
        try:
            self._send_request(request_id, method, params)
            frame = await future
        finally:
            self._forget(request_id, cancel=not future.done())
        return _response_value(frame)


def _settle(future: asyncio.Future[Frame], frame: Frame) -> None:
    if not future.done():
        future.set_result(frame)


def _response_value(frame: Frame) -> Any:
    error = frame.get("error")
    if error:
        kind = ERROR_TYPES.get(str(error.get("type")), MCPError)
        raise kind(str(error.get("message")))
    return frame.get("result")


def unwrap_tool_result(server: str, tool: str, result: dict[str, Any], raw: bool) -> Any:
    """A tool result as plain Python: structuredContent when sent, else the content
    (JSON text parsed, images as ToolImage); one item alone, several as a list."""
    if result.get("isError"):
        texts = [
            block.get("text", "") for block in result.get("content") or [] if block.get("type") == "text"
        ]
        message = "\n".join(texts) or "the tool reported an error without a message"
        raise MCPToolError("%s.%s failed: %s" % (server, tool, message), server, tool, result)
    if raw:
        return result
    items = [_unwrap_block(block) for block in result.get("content") or []]
    content = None if not items else items[0] if len(items) == 1 else items
    structured = result.get("structuredContent")
    if structured is None:
        return content
    # Python servers (FastMCP) wrap a plain return value as {"result": value} and send the
    # value as text too; when both agree, the value itself is what the caller wants.
    if isinstance(structured, dict) and list(structured) == ["result"] and structured["result"] == content:
        return content
    return structured


def _unwrap_block(block: dict[str, Any]) -> Any:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text", "")
        try:
            return json.loads(text)
        except ValueError:
            return text
    if kind in ("image", "audio"):
        return ToolImage(base64.b64decode(block.get("data", "")), str(block.get("mimeType", "")))
    if kind == "resource":
        return block.get("resource")
    return block


class SandboxRuntime:
    """What ``from mcp import runtime`` gives. Discovery helpers are plain functions that
    return values in any code; ``call_tool`` (like every ``mcp_<alias>.<tool>``) returns
    the value directly in plain code, and an awaitable in code that uses ``await``."""

    MCPError = MCPError
    MCPToolError = MCPToolError
    ToolImage = ToolImage

    def __init__(self, requests: HostRequests, servers: list[dict[str, str]]) -> None:
        self._requests = requests
        self._servers = servers

    def discovered_servers(self, detailed: bool = False) -> Any:
        """Configured servers (none is started by this): aliases, or dicts with details."""
        return self._requests.call("discovered_servers", {"detailed": detailed})

    def list_servers(self) -> list[str]:
        """Aliases of the servers this sandbox may call."""
        return [server["alias"] for server in self._servers]

    def list_tools(self, server: str) -> Any:
        """Tool names and one-line descriptions of one server (starts it if needed)."""
        return self._requests.call("list_tools", {"server": server})

    def query_tool_docs(self, server: str, tool: str | None = None, detail: str = "summary") -> Any:
        """Python signatures of a server's tools (or one tool); detail="full" adds schemas."""
        return self._requests.call("query_tool_docs", {"server": server, "tool": tool, "detail": detail})

    def search_tool_docs(self, query: str, limit: int = 5) -> Any:
        """Best-matching tools across all configured servers for a plain-words query."""
        return self._requests.call("search_tool_docs", {"query": query, "limit": limit})

    def capability_summary(self) -> str:
        """A short text: servers, how to discover and call their tools."""
        return str(self._requests.call("capability_summary", {}))

    def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, raw: bool = False
    ) -> Any:
        """Call one tool. In code that uses ``await``, ``await`` it."""
        label = "runtime.call_tool(%r, %r, ...)" % (server, tool)
        return self._dispatch_call(server, tool, arguments or {}, raw, label)

    def _dispatch_call(self, server: str, tool: str, arguments: dict[str, Any], raw: bool, label: str) -> Any:
        params = {"server": server, "tool": tool, "arguments": arguments}
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return unwrap_tool_result(server, tool, self._requests.call("call_tool", params), raw)
        return PendingToolCall(self._call_async(params, raw), label)

    async def _call_async(self, params: dict[str, Any], raw: bool) -> Any:
        result = await self._requests.call_async("call_tool", params)
        return unwrap_tool_result(params["server"], params["tool"], result, raw)


class PendingToolCall:
    """What a tool call gives in code that uses ``await``: an awaitable, so several calls
    can run at once (``asyncio.gather``). Using it as a value instead is a mistake with a
    clear message, not a confusing error about coroutines."""

    def __init__(self, coroutine: Any, label: str) -> None:
        self._coroutine = coroutine
        self._label = label
        self._awaited = False

    def __await__(self) -> Any:
        self._awaited = True
        return self._coroutine.__await__()

    def _misuse(self, *args: Any) -> Any:
        raise TypeError(
            "%s has not run yet: this code uses await, so tool calls must be awaited. Write "
            "`result = await %s`, or `await asyncio.gather(...)` for several at once."
            % (self._label, self._label)
        )

    __getitem__ = __iter__ = __len__ = __contains__ = __bool__ = __int__ = __float__ = _misuse

    def __repr__(self) -> str:
        return "<pending tool call %s: await it>" % self._label

    def __del__(self) -> None:
        if not self._awaited:
            self._coroutine.close()  # never started, so nothing was sent


class ServerProxy:
    """``mcp_<alias>``: one attribute per tool, called with keyword arguments."""

    def __init__(self, runtime: SandboxRuntime, alias: str) -> None:
        self._runtime = runtime
        self._alias = alias
        self._tools: dict[str, str] | None = None  # python name -> tool name

    def _tool_names(self, refresh: bool = False) -> dict[str, str]:
        if self._tools is None or refresh:
            tools = self._runtime.list_tools(self._alias)
            self._tools = {tool["name"]: tool["tool"] for tool in tools}
        return self._tools

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        tools = self._tool_names()
        if name not in tools:
            tools = self._tool_names(refresh=True)
        if name not in tools:
            close = difflib.get_close_matches(name, list(tools), n=3, cutoff=0.5)
            hint = "did you mean %s? " % ", ".join(close) if close else ""
            raise AttributeError(
                "mcp_%s has no tool %r; %sits tools: %s"
                % (self._alias, name, hint, ", ".join(sorted(tools)) or "(none)")
            )
        return ToolFunction(self._runtime, self._alias, tools[name], name)

    def __dir__(self) -> list[str]:
        return sorted(self._tool_names())

    def __repr__(self) -> str:
        return "<MCP server %s: use dir() or runtime.query_tool_docs(%r)>" % (self._alias, self._alias)


class ToolFunction:
    def __init__(self, runtime: SandboxRuntime, server: str, tool: str, name: str) -> None:
        self._runtime = runtime
        self._server = server
        self._tool = tool
        self.__name__ = name

    def __call__(self, *args: Any, raw: bool = False, **arguments: Any) -> Any:
        if args:
            raise TypeError(
                "mcp_%s.%s takes keyword arguments only, e.g. %s(name=value); see "
                "runtime.query_tool_docs(%r, %r)"
                % (self._server, self.__name__, self.__name__, self._server, self._tool)
            )
        label = "mcp_%s.%s(...)" % (self._server, self.__name__)
        return self._runtime._dispatch_call(self._server, self._tool, arguments, raw, label)

    def __repr__(self) -> str:
        return "<MCP tool %s.%s>" % (self._server, self._tool)


def install_sandbox_api(
    namespace: dict[str, Any], requests: HostRequests, servers: list[dict[str, str]]
) -> None:
    """Make ``from mcp import runtime``, ``from mcp.servers import <alias>`` and the
    ``mcp_<alias>`` globals work, whatever ``mcp`` package the image may carry."""
    runtime = SandboxRuntime(requests, servers)
    package = types.ModuleType("mcp", "Sandbox API: runtime and servers")
    package.__path__ = []  # a package, so ``mcp.servers`` imports
    servers_module = types.ModuleType("mcp.servers", "One object per configured MCP server")
    runtime_module = types.ModuleType("mcp.runtime", SandboxRuntime.__doc__)
    for name in dir(runtime):
        if not name.startswith("_"):
            setattr(runtime_module, name, getattr(runtime, name))
    package.runtime = runtime_module  # type: ignore[attr-defined]
    package.servers = servers_module  # type: ignore[attr-defined]
    for server in servers:
        proxy = ServerProxy(runtime, server["alias"])
        setattr(servers_module, server["alias"], proxy)
        namespace["mcp_" + server["alias"]] = proxy
    sys.modules.update({"mcp": package, "mcp.runtime": runtime_module, "mcp.servers": servers_module})
    namespace["runtime"] = runtime_module


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
        self.requests = HostRequests(channel)
        install_sandbox_api(self.executor.namespace, self.requests, list(config.get("servers", [])))
        self.handlers: dict[str, Callable[[Frame], None]] = {
            "execute": self.executes.put,
            "interrupt": self._on_interrupt,
            "response": self.requests.resolve,
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
                try:
                    validate_frame(frame, BRIDGE_FRAME_TYPES)
                except ProtocolError as exc:  # one bad frame is reported; the channel is intact
                    if frame["type"] == "execute" and is_frame_id(frame.get("id")):
                        self.executes.put(frame)  # every execute gets its result, in order: an error
                    else:
                        self.channel.send({"type": "error", "message": "kernel ignored a frame: %s" % exc})
                    continue
                self.handlers[frame["type"]](frame)
        except ProtocolError as exc:  # the byte stream itself is broken: nothing later can be trusted
            self.channel.send({"type": "error", "message": "kernel stopped: %s" % exc})
        finally:
            os._exit(0)

    def _on_interrupt(self, frame: Frame) -> None:
        with self._state_lock:
            if self.running_id is not None and frame.get("id") == self.running_id:
                os.kill(os.getpid(), signal.SIGINT)

    def _on_sigint(self, signum: int, stack: Any) -> None:
        # Only user code is interruptible; a late interrupt between executes is dropped.
        if self.running_id is None:
            return
        if self.channel.main_thread_writing:
            self.channel.deferred_interrupt = True  # raised once the frame is complete
            return
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
            result = self.execute(frame)
            try:
                self.channel.send(result)
            except ProtocolError as exc:  # only with a tiny frame cap; exactly one result still goes out
                result.update(
                    value=None, error={"type": "ProtocolError", "message": str(exc), "traceback": ""}
                )
                result["status"] = "error"
                self.channel.send(result)

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
            result["error"] = describe_user_exception(exc, self.max_output_chars)
        finally:
            self.running_id = None
        self.flush_output()
        result["dropped"] = dict(self.limiter.dropped)
        return result

    def flush_output(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # user code may have closed or replaced it (even with None)
                pass
        # Both markers first, then both waits: the pumps drain concurrently.
        for pump in self.pumps:
            pump.start_sync()
        for pump in self.pumps:
            pump.wait_synced()


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
