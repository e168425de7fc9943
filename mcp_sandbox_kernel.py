"""The in-sandbox kernel of mcp-server-code-execution-mode: a supervisor and an executor.

The bridge copies this file into the session's read-only IPC mount and starts it as the
container's main process: ``python3 -I /ipc/mcp_sandbox_kernel.py /ipc/session.json``.
Where the engine cannot see the host's files (a remote engine, a Kubernetes Pod), the
container runs ``python3 -I -c BOOTSTRAP`` instead and receives this source and the
session config as the first bytes of its stdin (see "entry point").
That process is the SUPERVISOR (PID 1): it owns the frame channel to the bridge (its
stdin and stdout), runs no user code, and starts the EXECUTOR, the same file run as
``... --executor SESSION_JSON IN_FD OUT_FD``, which holds the user's namespace and talks
to the supervisor over pipes of its own. The executor never holds a descriptor of the
bridge's channel, and the supervisor is non-dumpable, so code in the sandbox cannot
reach that channel; everything the executor sends is validated like untrusted input.

Standard library only, any CPython >= 3.9 (users pick the image). The bridge imports the
wire-protocol section on the host too, so frames are built, parsed and validated in
exactly one place.

Sections (``grep -n '^# ====' mcp_sandbox_kernel.py``):
    wire protocol    -> newline-delimited JSON frames, size-capped, schema per frame type;
                        the host request methods (REQUEST_METHODS)
    output capture   -> the supervisor's pumps on the executor's stdout/stderr pipes
    code execution   -> one persistent namespace, top-level await, REPL-style value
    sandbox API      -> ``from mcp import runtime``, ``mcp_<alias>``, host requests
    executor process -> runs the code: execute frames in, exactly one result each
    supervisor       -> PID 1: routing, validation, reaping, timeouts, fresh executors
    entry point
"""

from __future__ import annotations

import ast
import base64
import builtins
import codecs
import collections
import collections.abc
import contextlib
import contextvars
import difflib
import errno
import fcntl
import functools
import hashlib
import hmac
import importlib.abc
import inspect
import io
import json
import linecache
import mimetypes
import operator
import os
import queue
import random
import select
import signal
import socket
import stat
import subprocess
import sys
import termios
import textwrap
import threading
import time
import traceback
import types
import urllib.parse
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, TypedDict, Union

if TYPE_CHECKING:  # typing.NotRequired is new in 3.11; annotations here are never evaluated
    # asyncio serves only the executor (the code's event loop, awaited tool calls); the
    # supervisor, PID 1, never uses it, so the executor imports it as it starts (main()):
    # about 50 ms that every sandbox's start no longer pays twice.
    import asyncio
    from typing import NotRequired, TypeGuard

# =============================================================================
# wire protocol
# =============================================================================

PROTOCOL_VERSION = 3  # 3: the supervisor signs its frames
DEFAULT_MAX_FRAME_BYTES = 32 * 1024 * 1024

Frame = dict[str, Any]


class ProtocolError(Exception):
    """A frame that cannot be accepted: not JSON, not an object, over the size cap, or
    with a field of the wrong type or size."""


# --- frame schemas -------------------------------------------------------------------
# Every frame is checked against its type's fields before anyone uses it: the bridge
# checks what comes out of the sandbox (hostile code may write frames of its own), the
# kernel what comes from the bridge. Unknown fields are ignored; unknown types refused.

DEFAULT_SESSION = "default"  # run_python's session when a call names none
MAX_REQUESTS_IN_FLIGHT = 256  # per session; more are refused on arrival, never queued
TOO_MANY_REQUESTS = (
    "Too many MCP requests in flight (more than %d); await some before starting more."
    % MAX_REQUESTS_IN_FLIGHT
)
MAX_ID_CHARS = 64  # ids are short strings or integers: a reply echoes the id
MAX_NAME_CHARS = 200  # method names, error type names
KEY_CHARS = 64  # hex digits of the key that signs the supervisor's frames (see below)
STREAM_NAMES = ("stdout", "stderr")
CUT_PARTS = (*STREAM_NAMES, "value")  # what a result may cut from its middle
RESULT_STATUSES = ("ok", "error", "interrupted", "killed", "crashed")


class FieldRule(NamedTuple):
    check: Callable[[Any], bool]
    expected: str  # completes "field X must be ..."
    required: bool = True


def is_frame_id(value: object) -> TypeGuard[FrameId]:
    if isinstance(value, str):
        return 0 < len(value) <= MAX_ID_CHARS
    return type(value) is int and abs(value) < 2**53


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _is_hex(value: str, length: int) -> bool:
    return len(value) == length and all(char in "0123456789abcdef" for char in value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_optional_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_cut(value: Any) -> bool:
    """{"count": chars cut from the middle, "tail": the text after them, "file": where all
    of it was saved (optional)}"""
    return (
        isinstance(value, dict)
        and set(value) - {"file"} == {"count", "tail"}
        and _is_count(value["count"])
        and _is_text(value["tail"])
        and (value.get("file") is None or (_is_text(value["file"]) and len(value["file"]) <= 4096))
    )


def _is_cuts(value: Any) -> bool:
    return isinstance(value, dict) and all(part in CUT_PARTS and _is_cut(cut) for part, cut in value.items())


def _is_error_info(value: Any) -> bool:
    """{"type": name, "message": text, and optional texts: "traceback", "module", and
    "server" and "tool" (those of a refused tool call)}"""
    return (
        isinstance(value, dict)
        and _is_name(value.get("type"))
        and _is_text(value.get("message"))
        and all(_is_optional_text(value.get(key)) for key in ("traceback", "module", "server", "tool"))
    )


def _is_optional_error_info(value: Any) -> bool:
    return value is None or _is_error_info(value)


def _is_texts(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 100 and all(isinstance(item, str) for item in value)


MAX_DEFINED_TOOLS = 1000  # names in a result's defined_tools (the host saves at most 1000 tools)


def _is_listed(value: Any, item_is: Callable[[Any], bool]) -> bool:
    """A list of at most 100 items, each of which ``item_is`` accepts."""
    return isinstance(value, list) and len(value) <= 100 and all(item_is(item) for item in value)


def _is_image(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and set(item) == {"mime_type", "data"}
        and _is_name(item["mime_type"])
        and isinstance(item["data"], str)
    )


def _is_attachment(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and set(item) in ({"uri", "mime_type", "text"}, {"uri", "mime_type", "blob"})
        and all(isinstance(field, str) for field in item.values())
        and _is_name(item["mime_type"])
        and len(item["uri"]) <= 4096
    )


def _is_failed_tool(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and _is_name(item.get("name"))
        and _is_name(item.get("digest"))
        and _is_text(item.get("reason"))
    )


def _is_grace(value: Any) -> bool:
    return type(value) in (int, float) and 0 < value <= 3600


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in choices


_ID = FieldRule(is_frame_id, "a string of 1-%d characters or an integer" % MAX_ID_CHARS)
_ERROR_INFO = "null or an object with string fields type, message (and traceback, module, server, tool)"

FRAME_SCHEMAS: dict[str, dict[str, FieldRule]] = {
    # bridge -> kernel ("key" only as the very first line; see frame authentication)
    "key": {"key": FieldRule(lambda value: _is_text(value) and _is_hex(value, KEY_CHARS), "64 hex digits")},
    "execute": {
        "id": _ID,
        "code": FieldRule(_is_text, "a string"),
        # false: a fresh namespace starts without the saved tools (run_python's saved_tools)
        "saved_tools": FieldRule(lambda value: isinstance(value, bool), "true or false", required=False),
        # supervisor -> executor only: saved tools not to define (they failed in an earlier executor)
        "skip": FieldRule(_is_texts, "a list of at most 100 strings", required=False),
    },
    "interrupt": {"id": _ID, "grace": FieldRule(_is_grace, "a number of seconds (0-3600]", required=False)},
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
        "json": FieldRule(lambda value: value is not None, "the value as JSON data", required=False),
        "error": FieldRule(_is_optional_error_info, _ERROR_INFO, required=False),
        "cut": FieldRule(
            _is_cuts, "an object of stdout/stderr/value cuts {count, tail, file}", required=False
        ),
        "notices": FieldRule(_is_texts, "a list of at most 100 strings", required=False),
        "images": FieldRule(
            lambda value: _is_listed(value, _is_image),
            "a list of at most 100 {mime_type, data} objects",
            required=False,
        ),
        "attachments": FieldRule(
            lambda value: _is_listed(value, _is_attachment),
            "a list of at most 100 {uri, mime_type, text or blob} objects",
            required=False,
        ),
        # executor -> bridge: the saved tools a fresh executor defined (the bridge tells the
        # model once per change of these names, not in every fresh session)
        "defined_tools": FieldRule(
            lambda value: (
                isinstance(value, list)
                and len(value) <= MAX_DEFINED_TOOLS
                and all(_is_name(name) for name in value)
            ),
            "a list of at most %d tool names" % MAX_DEFINED_TOOLS,
            required=False,
        ),
        # supervisor -> bridge: saved tools whose definition killed or hung an executor
        "failed_tools": FieldRule(
            lambda value: _is_listed(value, _is_failed_tool),
            "a list of at most 100 {name, digest, reason} objects",
            required=False,
        ),
    },
    # executor -> supervisor: the saved tool it defines now (null: done), so the supervisor
    # can bound the time each takes and knows which one to blame if the process dies.
    "loading": {
        "tool": FieldRule(lambda value: value is None or _is_name(value), "null or a tool name"),
        "digest": FieldRule(
            lambda value: value is None or _is_name(value), "null or a digest", required=False
        ),
    },
    "error": {
        "id": FieldRule(lambda value: value is None or is_frame_id(value), "null or an id", required=False),
        "message": FieldRule(_is_text, "a string"),
    },
    "request": {
        "id": _ID,
        "method": FieldRule(_is_name, "a method name of 1-%d characters" % MAX_NAME_CHARS),
        "params": FieldRule(_is_object, "an object"),
        # executor -> supervisor only: the execute whose code made the request (CURRENT_CALL)
        "call": FieldRule(lambda value: value is None or is_frame_id(value), "null or an id", required=False),
    },
    "cancel": {"id": _ID},
}
# What a result may carry besides its status, value and error; the supervisor passes it on.
RESULT_EXTRAS = ("json", "images", "attachments", "defined_tools")
# Who may send what: bridge -> supervisor, supervisor -> bridge, supervisor -> executor,
# executor -> supervisor.
BRIDGE_FRAME_TYPES = frozenset({"execute", "interrupt", "response"})
KERNEL_FRAME_TYPES = frozenset({"hello", "stream", "result", "error", "request", "cancel"})
SUPERVISOR_FRAME_TYPES = frozenset({"execute", "response"})
EXECUTOR_FRAME_TYPES = frozenset({"hello", "result", "error", "request", "cancel", "loading"})


# --- frames as types ------------------------------------------------------------------
# The fields of each frame type for a type checker, as FRAME_SCHEMAS checks them at run
# time (annotations are never evaluated here, so they may use syntax newer than 3.9).
FrameId = Union[str, int]


class KeyFrame(TypedDict):
    type: Literal["key"]
    key: str


class ExecuteFrame(TypedDict):
    type: Literal["execute"]
    id: FrameId
    code: str
    saved_tools: NotRequired[bool]
    skip: NotRequired[list[str]]


class InterruptFrame(TypedDict):
    type: Literal["interrupt"]
    id: FrameId
    grace: NotRequired[float]


class ErrorInfo(TypedDict):
    type: str
    message: str
    traceback: NotRequired[str | None]
    module: NotRequired[str | None]
    server: NotRequired[str]  # a refused tool call's (ApprovalDenied)
    tool: NotRequired[str]


class ResponseFrame(TypedDict):
    type: Literal["response"]
    id: FrameId
    result: NotRequired[object]  # JSON data: what the method answers
    error: NotRequired[ErrorInfo | None]


class HelloFrame(TypedDict):
    type: Literal["hello"]
    protocol: int
    python: str
    pid: NotRequired[int]


class StreamFrame(TypedDict):
    type: Literal["stream"]
    id: FrameId
    name: Literal["stdout", "stderr"]
    text: str


class Cut(TypedDict):
    count: int
    tail: str
    file: NotRequired[str | None]


class Image(TypedDict):
    mime_type: str
    data: str  # base64


class Attachment(TypedDict):
    uri: str
    mime_type: str
    text: NotRequired[str]
    blob: NotRequired[str]  # base64


class FailedTool(TypedDict):
    name: str
    digest: str
    reason: str


class ResultFrame(TypedDict):
    type: Literal["result"]
    id: FrameId
    status: Literal["ok", "error", "interrupted", "killed", "crashed"]
    value: NotRequired[str | None]
    json: NotRequired[object]  # the value as JSON data
    error: NotRequired[ErrorInfo | None]
    cut: NotRequired[dict[str, Cut]]
    notices: NotRequired[list[str]]
    images: NotRequired[list[Image]]
    attachments: NotRequired[list[Attachment]]
    defined_tools: NotRequired[list[str]]
    failed_tools: NotRequired[list[FailedTool]]


class LoadingFrame(TypedDict):
    type: Literal["loading"]
    tool: str | None
    digest: NotRequired[str | None]


class ErrorFrame(TypedDict):
    type: Literal["error"]
    id: NotRequired[FrameId | None]
    message: str


class RequestFrame(TypedDict):
    type: Literal["request"]
    id: FrameId
    method: str  # one of REQUEST_METHODS (the bridge answers any other with an error)
    params: dict[str, object]  # that method's parameters (JSON data), by name
    call: NotRequired[FrameId | None]


class CancelFrame(TypedDict):
    type: Literal["cancel"]
    id: FrameId


# --- host requests --------------------------------------------------------------------
# What code in the sandbox may ask the bridge: a ``request`` frame names one of these
# methods and carries its parameters by name; the bridge answers with one ``response``.
# This table is the protocol: the bridge validates each method's params with a model of
# its own (strict JSON types), and a test checks that its methods and their parameter
# names and kinds (JSON types) are exactly these.
DISCOVERED_SERVERS = "discovered_servers"
LIST_TOOLS = "list_tools"
QUERY_TOOL_DOCS = "query_tool_docs"
SEARCH_TOOL_DOCS = "search_tool_docs"
CALL_TOOL = "call_tool"
LIST_RESOURCES = "list_resources"
READ_RESOURCE = "read_resource"
LIST_PROMPTS = "list_prompts"
GET_PROMPT = "get_prompt"
CAPABILITY_SUMMARY = "capability_summary"
MEMORY_SAVE = "memory_save"
MEMORY_LOAD = "memory_load"
MEMORY_PUT_IF = "memory_put_if"
MEMORY_DELETE = "memory_delete"
MEMORY_INFO = "memory_info"
MEMORY_LIST = "memory_list"
TOOL_SAVE = "tool_save"
TOOL_LIST = "tool_list"
TOOL_DELETE = "tool_delete"
TOOL_SOURCES = "tool_sources"
PROGRESS = "progress"  # about the asking sandbox's own call: its session answers it

REQUEST_METHODS: dict[str, dict[str, str]] = {
    DISCOVERED_SERVERS: {"detailed": "boolean"},
    LIST_TOOLS: {"server": "string"},
    QUERY_TOOL_DOCS: {"server": "string", "tool": "string or null", "detail": "string"},
    SEARCH_TOOL_DOCS: {"query": "string", "limit": "integer", "detail": "string"},
    CALL_TOOL: {"server": "string", "tool": "string", "arguments": "object or null"},
    LIST_RESOURCES: {"server": "string"},
    READ_RESOURCE: {"server": "string", "uri": "string"},
    LIST_PROMPTS: {"server": "string"},
    GET_PROMPT: {"server": "string", "name": "string", "arguments": "object or null"},
    CAPABILITY_SUMMARY: {},
    MEMORY_SAVE: {"key": "string", "value": "JSON", "metadata": "object or null"},
    MEMORY_LOAD: {"key": "string"},
    MEMORY_PUT_IF: {"key": "string", "value": "JSON", "generation": "integer"},
    MEMORY_DELETE: {"key": "string"},
    MEMORY_INFO: {"key": "string"},
    MEMORY_LIST: {"after": "string or null", "limit": "integer"},
    TOOL_SAVE: {"name": "string", "source": "string"},
    TOOL_LIST: {},
    TOOL_DELETE: {"name": "string"},
    TOOL_SOURCES: {},
    PROGRESS: {"done": "number", "total": "number or null", "message": "string or null"},
}


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


# --- frame authentication -------------------------------------------------------------
# What the supervisor sends the bridge is signed. Its channel is the container's stdin and
# stdout, which the code could reach through /proc/1/fd where PR_SET_DUMPABLE is not
# honoured (gVisor). The bridge sends a fresh random key as the first line on stdin; the
# supervisor reads it before any code runs and keeps it only in its memory. Each frame it
# then sends starts with a MAC over the rest of the line, and carries a sequence number
# that must grow, so a frame the code read off the pipe cannot be replayed (a tool call
# twice) and one it wrote cannot pass at all.

MAC_PREFIX = b'{"mac":"'
MAC_CHARS = 32  # hex digits: 128 bits of HMAC-SHA256


def frame_mac(key: bytes, signed: bytes) -> bytes:
    return hmac.new(key, signed, hashlib.sha256).hexdigest()[:MAC_CHARS].encode("ascii")


def sign_frame(data: bytes, key: bytes) -> bytes:
    """``data`` (one JSON object, no newline) with a MAC over all but its opening brace."""
    signed = data[1:]
    return MAC_PREFIX + frame_mac(key, signed) + b'",' + signed


def authentic_part(line: bytes, key: bytes) -> bool:
    """Whether ``line`` starts with a MAC, under ``key``, of the rest of it."""
    start = len(MAC_PREFIX)
    if not line.startswith(MAC_PREFIX) or line[start + MAC_CHARS : start + MAC_CHARS + 2] != b'",':
        return False
    return hmac.compare_digest(line[start : start + MAC_CHARS], frame_mac(key, line[start + MAC_CHARS + 2 :]))


def encode_frame(frame: Mapping[str, object], max_frame_bytes: int, key: bytes | None = None) -> bytes:
    """One frame = one JSON object on one line (signed with ``key`` when given). JSON
    escapes newlines inside strings, so the only raw newline is the terminator."""
    data = json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if key is not None:
        data = sign_frame(data, key)
    if len(data) + 1 > max_frame_bytes:
        raise ProtocolError(
            "frame of %d bytes exceeds the maximum frame size of %d bytes" % (len(data) + 1, max_frame_bytes)
        )
    return data + b"\n"


class FrameDecoder:
    """Incremental parser for a byte stream of frames. Has no line-length limit of its
    own; the only limit is ``max_frame_bytes``, checked before a frame is complete so a
    runaway sender cannot make the reader buffer without bound. Each byte is scanned for
    the end of line once (a rescan per chunk would be quadratic in the frame size).

    Strict (the default): a line that is not a JSON object with a string ``type``, or is
    over the cap, raises ProtocolError. Tolerant (for a sender that may be hostile, whose
    stream the reader must survive): such a line is skipped and counted in ``rejected``,
    an oversized one discarded as it arrives."""

    def __init__(self, max_frame_bytes: int, tolerant: bool = False, key: bytes | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.tolerant = tolerant
        self.rejected = 0
        # With a key: only signed frames with a growing "seq" are frames; any other line
        # is dropped and counted in ``unauthentic`` (the code may have written it).
        self.key = key
        self.unauthentic = 0
        self._last_seq = 0
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._discarding = False  # tolerant: inside an oversized line, dropping it

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished frame held until its newline arrives."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        return [frame for frame, _ in self.feed_sized(data)]

    def feed_sized(self, data: bytes) -> list[tuple[Frame, int]]:
        """Like feed, with each frame's size on the wire (bytes, its newline included)."""
        frames: list[tuple[Frame, int]] = []
        if self._discarding:
            end = data.find(b"\n")
            if end < 0:
                return frames
            self._discarding = False
            data = data[end + 1 :]
        self._buffer += data
        start = 0
        while True:
            end = self._buffer.find(b"\n", max(start, self._scanned))
            if end < 0:
                break
            frame = self._parse(bytes(self._buffer[start:end]))
            if frame is not None:
                frames.append((frame, end + 1 - start))
            start = end + 1
        del self._buffer[:start]
        self._scanned = len(self._buffer)
        if len(self._buffer) >= self.max_frame_bytes:
            if not self.tolerant:
                raise ProtocolError(
                    "incoming frame exceeds the maximum frame size of %d bytes" % self.max_frame_bytes
                )
            self.rejected += 1
            self._buffer.clear()
            self._scanned = 0
            self._discarding = True
        return frames

    def _parse(self, line: bytes) -> Frame | None:
        if self.key is not None and not authentic_part(line, self.key):
            self.unauthentic += 1
            return None
        try:
            if len(line) + 1 > self.max_frame_bytes:
                raise ProtocolError(
                    "incoming frame of %d bytes exceeds the maximum frame size of %d bytes"
                    % (len(line) + 1, self.max_frame_bytes)
                )
            try:
                frame = json.loads(line.decode("utf-8", "surrogatepass"))
            except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
                raise ProtocolError(
                    "malformed frame (%s: %s): %r" % (type(exc).__name__, str(exc)[:200], line[:80])
                ) from None
            if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
                raise ProtocolError("frame is not an object with a string 'type': %r" % line[:80])
            if self.key is not None:
                del frame["mac"]
                seq = frame.pop("seq", None)
                if type(seq) is not int or seq <= self._last_seq:  # replayed or reordered
                    self.unauthentic += 1
                    return None
                self._last_seq = seq
        except ProtocolError:
            if not self.tolerant:
                raise
            self.rejected += 1
            return None
        return frame


class Channel:
    """The kernel's end of the frame channel: thread-safe sends, blocking reads."""

    def __init__(self, in_fd: int, out_fd: int, max_frame_bytes: int, tolerant: bool = False) -> None:
        self.in_fd = in_fd
        self.out_fd = out_fd
        self.max_frame_bytes = max_frame_bytes
        self.decoder = FrameDecoder(max_frame_bytes, tolerant)
        self.key: bytes | None = None  # set: every frame sent is signed and numbered
        self.seq = 0
        self._pending: list[Frame] = []
        self._lock = threading.Lock()
        # A KeyboardInterrupt between two partial writes would leave half a frame on the
        # channel; while the main thread writes, the SIGINT handler only records it.
        self.main_thread_writing = False
        self.deferred_interrupt = False
        self.output_closed = False

    def send(self, frame: Mapping[str, object]) -> None:
        """Send one frame whole; ProtocolError (nothing sent) when it is over the cap,
        so the sender can tell its own caller at once."""
        in_main = threading.current_thread() is threading.main_thread()
        data = encode_frame(frame, self.max_frame_bytes) if self.key is None else b""
        with self._lock:
            if self.key is not None:  # numbered under the lock: they go out in that order
                data = encode_frame({"seq": self.seq + 1, **frame}, self.max_frame_bytes, self.key)
                self.seq += 1
            if self.output_closed:
                raise OSError(9, "the channel is closed")
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

    def close_output(self) -> None:
        """Close the sending side; later sends raise OSError (never write to a reused fd)."""
        with self._lock:
            if not self.output_closed:
                self.output_closed = True
                os.close(self.out_fd)

    def move_to(self, fd: int) -> None:
        """Send and receive on ``fd`` (a connected socket) from now on; numbering goes on."""
        with self._lock:
            self.in_fd = self.out_fd = fd

    def receive(self) -> Frame | None:
        """The next frame, or None at end of input (the bridge has gone)."""
        while not self._pending:
            try:
                data = os.read(self.in_fd, 1 << 16)
            except ConnectionResetError:  # a socket whose peer went away with frames unread
                return None
            if not data:
                return None
            self._pending.extend(self.decoder.feed(data))
        return self._pending.pop(0)


# =============================================================================
# output capture (supervisor side)
# =============================================================================


# One budget for a result's text (MCP_BRIDGE_MAX_OUTPUT characters), shared by stdout,
# stderr and the value. Whatever does not fit is cut from the middle, so the head and the
# tail both stay: the start says what the code began doing, the end how it finished. The
# supervisor streams each stream's head live (half the budget), keeps the last half of the
# budget as the tail, and counts the middle; the bridge fits all parts into the budget and
# marks each cut with cut_marker. When a call's output did not fit, every stream is saved
# whole in OUTPUT_DIR so the code can page through it.

DEFAULT_MAX_OUTPUT = 20_000
OUTPUT_DIR = "/tmp/outputs"
SAVED_CALLS = 10  # calls whose full output stays in OUTPUT_DIR; older files are removed


def cut_marker(
    count: int, what: str, budget: int, saved: str | None = None, why: str = "MCP_BRIDGE_MAX_OUTPUT"
) -> str:
    """The one marker for text cut from a result (a stream, the value, a traceback); ``why``:
    what sets the budget (the setting, or the client's own limit)."""
    text = "[... %s characters of %s cut (a result shows %s characters, %s)" % (
        format(count, ","),
        what,
        format(budget, ","),
        why,
    )
    return text + ("; all of it is in %s ...]" % saved if saved else " ...]")


def head_and_tail(text: str, keep: int) -> tuple[str, int, str]:
    """``text`` as (head, characters cut from the middle, tail) within ``keep`` characters."""
    if len(text) <= keep:
        return text, 0, ""
    head = keep - keep // 2
    return text[:head], len(text) - keep, text[len(text) - keep // 2 :]


def open_for_saving(path: str) -> io.TextIOWrapper:
    """``path`` (in a folder the code can write to) opened afresh to save a stream to. Never
    through a symlink, and never a FIFO the code put there: opening one to write blocks until
    it is read, and the supervisor opens it holding its lock (OSError instead)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file: %s" % path)
        os.set_blocking(fd, True)
        return open(fd, "w", encoding="utf-8")  # closed by finish_saving
    except BaseException:
        os.close(fd)
        raise


class StreamKeeper:
    """One output stream of one execute: the head (streamed live), the tail (held back
    until the result) and the count of what lies between. Once saving starts, the file
    gets the whole stream in order: the head, each piece as it is cut, then the tail."""

    def __init__(self, room: int) -> None:
        self.room = room  # characters of head, and of tail
        self.sent = 0
        self.head: list[str] = []  # a copy of what was sent, for the file
        self.tail: collections.deque[str] = collections.deque()
        self.tail_chars = 0
        self.cut = 0
        self.file: Any = None
        self.saving = False  # saving started (the file may have failed since)
        self.save_error: str | None = None

    def would_cut(self, chars: int) -> bool:
        return self.sent + self.tail_chars + chars > 2 * self.room

    def admit(self, text: str) -> str:
        """The part of ``text`` to stream live now; the rest joins the tail."""
        kept = text[: max(0, self.room - self.sent)]
        if kept:
            self.sent += len(kept)
            self.head.append(kept)
            self._save(kept)
        rest = text[len(kept) :]
        if rest:
            self.tail.append(rest)
            self.tail_chars += len(rest)
            while self.tail_chars > self.room:  # the oldest tail text is cut
                excess = self.tail_chars - self.room
                oldest = self.tail[0]
                if len(oldest) <= excess:
                    self.tail.popleft()
                else:
                    self.tail[0], oldest = oldest[excess:], oldest[:excess]
                self.tail_chars -= len(oldest)
                self.cut += len(oldest)
                self._save(oldest)
        return kept

    def unsend(self, chars: int) -> None:
        """Text admitted but not delivered (a frame cap below the chunk size) is cut."""
        self.sent -= chars
        self.cut += chars

    def start_saving(self, path: str) -> None:
        self.saving = True
        try:
            self.file = open_for_saving(path)
        except OSError as exc:
            self.save_error = "%s: %s" % (type(exc).__name__, exc)
            return
        self._save("".join(self.head))

    def finish_saving(self) -> None:
        self._save("".join(self.tail))
        self._close()

    def _save(self, text: str) -> None:
        if self.file is None or not text:
            return
        try:
            self.file.write(text)
        except (OSError, ValueError) as exc:  # disk full, or the code removed the folder
            self.save_error = "%s: %s" % (type(exc).__name__, exc)
            self._close()

    def _close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError, ValueError):
                self.file.close()
            self.file = None

    def total(self) -> int:
        return self.sent + self.cut + self.tail_chars


class OutputKeeper:
    """The output of the running execute, both streams, within the budget (see above)."""

    def __init__(self, budget: int, directory: str = OUTPUT_DIR) -> None:
        self.budget = budget
        self.directory = directory
        self._lock = threading.Lock()
        self.calls = 0  # executes so far in this container: names the saved files
        self.saved_calls: collections.deque[int] = collections.deque()
        self.streams = {name: StreamKeeper(budget // 2) for name in STREAM_NAMES}

    def reset(self) -> None:
        """A new execute begins."""
        with self._lock:
            for stream in self.streams.values():
                stream.finish_saving()
            self.calls += 1
            self.streams = {name: StreamKeeper(self.budget // 2) for name in STREAM_NAMES}

    def path(self, call: int, name: str) -> str:
        return os.path.join(self.directory, "%d.%s" % (call, name))

    def admit(self, name: str, text: str) -> str:
        with self._lock:
            stream = self.streams[name]
            if not stream.saving and stream.would_cut(len(text)):
                self._start_saving(name)
            return stream.admit(text)

    def unsend(self, name: str, chars: int) -> None:
        with self._lock:
            self.streams[name].unsend(chars)

    def _start_saving(self, name: str) -> None:
        """Save stream ``name`` of this call, removing the files of calls beyond SAVED_CALLS."""
        with contextlib.suppress(OSError):  # start_saving says why, if it matters
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if not self.saved_calls or self.saved_calls[-1] != self.calls:
            self.saved_calls.append(self.calls)
            while len(self.saved_calls) > SAVED_CALLS:
                old = self.saved_calls.popleft()
                for stream in STREAM_NAMES:
                    with contextlib.suppress(OSError):
                        os.unlink(self.path(old, stream))
        self.streams[name].start_saving(self.path(self.calls, name))

    def finish(self, other_chars: int) -> dict[str, Any]:
        """The result's ``cut`` entries for the streams (count, tail and saved file).
        ``other_chars`` (the value's length) shares the budget: when the whole does not
        fit, every stream with text is saved, since the bridge will cut it."""
        with self._lock:
            over = sum(stream.total() for stream in self.streams.values()) + other_chars > self.budget
            cuts: dict[str, Any] = {}
            for name, stream in self.streams.items():
                if over and stream.total() and not stream.saving:
                    self._start_saving(name)
                tail = "".join(stream.tail)
                stream.finish_saving()
                if tail or stream.cut or stream.saving:
                    cuts[name] = {"count": stream.cut, "tail": tail}
                    if stream.saving and stream.save_error is None:
                        cuts[name]["file"] = self.path(self.calls, name)
            return cuts


class OutputPump(threading.Thread):
    """Reads one of the executor's output pipes (its fd 1 or fd 2) and hands the text to
    ``deliver(name, text)``.

    It reads only while it holds its lock, and only what the pipe holds then (FIONREAD),
    so ``drain()``, taking the same lock, delivers everything written to the pipe before
    that moment, by the executor or any process it started, from the caller's own thread:
    no hand-off to this thread on every result, and nothing is ever read but not yet
    delivered."""

    def __init__(self, name: str, read_fd: int, write_fd: int, deliver: Callable[[str, str], None]) -> None:
        super().__init__(name="pump-" + name, daemon=True)
        self.stream_name = name
        self.read_fd = read_fd
        os.set_blocking(read_fd, False)  # reads take what FIONREAD says is there, never wait
        self.write_fd = write_fd  # the supervisor's copy: end of file only once retire() closes it
        self.deliver = deliver
        self._lock = threading.Lock()
        self._ended = False  # set (under the lock) before read_fd is closed
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def drain(self, timeout: float = 5.0) -> bool:
        """Deliver what the pipe holds now; False if the pump stayed busy for ``timeout``
        (a client that does not read: that output is then counted as background)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            if not self._ended:
                pending = _unread_bytes(self.read_fd)
                while pending > 0:
                    pending -= self._deliver_some(pending)
        finally:
            self._lock.release()
        return True

    def close_write_end(self) -> None:
        """Once every other writer is gone the pump reads end of file and stops."""
        fd, self.write_fd = self.write_fd, -1
        if fd >= 0:
            os.close(fd)

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN)
        try:
            while True:
                # POLLHUP: every writer is gone; what is left in the pipe is read first.
                hung_up = any(flags & ~select.POLLIN for _, flags in poller.poll())
                with self._lock:
                    pending = _unread_bytes(self.read_fd)
                    if pending:
                        self._deliver_some(pending)
                    elif hung_up:
                        return
                    # else drain() took it between the poll and the lock
        finally:
            with self._lock:
                self._ended = True
                os.close(self.read_fd)

    def _deliver_some(self, pending: int) -> int:
        try:
            data = os.read(self.read_fd, min(pending, 1 << 16))  # it is in the pipe
        except BlockingIOError:  # FIONREAD said more than there was: never wait, holding the lock
            return pending
        if data:
            self.deliver(self.stream_name, self._decoder.decode(data))
        return len(data) or pending


def _unread_bytes(fd: int) -> int:
    """How many bytes a pipe holds, unread."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder)


# =============================================================================
# code execution
# =============================================================================

CELL_PREFIX = "<cell-"

# --- deferred calls: the one rule for `await` ---------------------------------------------
# A tool call (or host helper) gives its value, in any code. Only where the code itself
# awaits the call or hands it to asyncio (`await f()`, `asyncio.gather(f(), g())`,
# `create_task(f())`, a name or list of calls it awaits or gathers later) does the call
# start later instead, as an awaitable, so several run at once. The syntax tree of each
# cell says which calls those are: each is rewritten to `__mcp_defer__(f, ...)`, which
# tells a deferrable callee to return an awaitable; every other callee runs as written.
# And whatever the code awaits or hands to asyncio passes through `__mcp_awaitable__`,
# so a plain value there (a call that already ran) is awaited as itself, not an error.
# Names are matched per scope (a function's own awaits decide for its own names).

DEFER_NAME = "__mcp_defer__"
AWAITABLE_NAME = "__mcp_awaitable__"
AWAITABLES_NAME = "__mcp_awaitables__"
# asyncio functions that take awaitables: each positional argument ("each"), the first
# ("first"), or the first as an iterable of them ("iterable").
_ASYNCIO_TAKERS = {
    "gather": "each", "create_task": "first", "ensure_future": "first", "shield": "first",
    "wait_for": "first", "run_until_complete": "first", "run_coroutine_threadsafe": "first",
    "as_completed": "iterable",
}  # fmt: skip
_ASYNCIO_ONLY = {"run": "first", "wait": "iterable"}  # common names: only as asyncio.run / asyncio.wait
_COLLECTORS = ("append", "add", "extend", "insert")  # tasks.append(f()): a list later gathered
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_deferral = threading.local()


def defer_call(func: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``__mcp_defer__(f, ...)``: call ``f``; a deferrable ``f`` returns a PendingCall."""
    if isinstance(func, types.MethodType):
        target = func.__func__
    else:
        target = func if isinstance(func, types.FunctionType) else type(func)
    if getattr(target, "_mcp_deferrable", False) is not True:
        return func(*args, **kwargs)
    _deferral.next = True
    try:
        return func(*args, **kwargs)
    finally:
        _deferral.next = False


def take_deferral() -> bool:
    """Whether the deferrable call now running was written to be awaited (see defer_call)."""
    deferred = getattr(_deferral, "next", False)
    _deferral.next = False
    return deferred


async def _ready(value: Any) -> Any:
    return value


def make_awaitable(value: Any) -> Any:
    """``__mcp_awaitable__(x)``: ``x`` if it can be awaited, else a coroutine that gives it."""
    return value if inspect.isawaitable(value) else _ready(value)


def make_awaitables(values: Any) -> list[Any]:
    """``__mcp_awaitables__(xs)``: each item awaitable; as tasks when a loop runs, since
    asyncio.wait takes nothing else (and gather and as_completed take them too)."""
    awaitables = [make_awaitable(value) for value in values]
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return awaitables
    return [asyncio.ensure_future(awaitable) for awaitable in awaitables]


def _taker(call: ast.Call) -> str:
    """How ``call`` takes awaitables, if it is one of asyncio's functions that do ("" if not)."""
    func = call.func
    if isinstance(func, ast.Attribute):
        if func.attr in _ASYNCIO_ONLY and isinstance(func.value, ast.Name) and func.value.id == "asyncio":
            return _ASYNCIO_ONLY[func.attr]
        return _ASYNCIO_TAKERS.get(func.attr, "")
    return _ASYNCIO_TAKERS.get(func.id, "") if isinstance(func, ast.Name) else ""


def _taken(call: ast.Call) -> list[ast.expr]:
    kind = _taker(call)
    return list(call.args) if kind == "each" else call.args[:1] if kind else []


def _named(node: ast.AST) -> str | None:
    """The name an awaited expression refers to: `t`, `*ts`, `ts[0]`, `*ts.values()`."""
    if isinstance(node, ast.Starred):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values":
        node = node.func.value
    if isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _in_scope(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``node``'s own scope: nested functions are other scopes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, _SCOPES):
            yield from _in_scope(child)


def _awaited_names(scope: ast.AST) -> set[str]:
    """Names the scope awaits or hands to asyncio (`await task`, `gather(*tasks)`), and
    the lists a loop over them draws from (`for task in tasks: await task`)."""
    names: set[str] = set()
    loops: list[tuple[ast.AST, ast.AST]] = []
    for node in _in_scope(scope):
        if isinstance(node, ast.Await):
            candidates: list[ast.AST] = [node.value]
        elif isinstance(node, ast.Call):
            candidates = list(_taken(node))
        else:
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                loops.append((node.target, node.iter))
            continue
        names.update(name for name in map(_named, candidates) if name)
    for target, source in loops:
        if _named(target) in names and _named(source):
            names.add(str(_named(source)))
    return names


def _call(name: str, argument: ast.expr) -> ast.expr:
    return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), [argument], []), argument)


def _defer(node: ast.expr) -> ast.expr:
    """A call becomes `__mcp_defer__(f, ...)`; so do the calls a display or comprehension holds."""
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id == DEFER_NAME:
            return node
        marker = ast.Name(DEFER_NAME, ast.Load())
        return ast.copy_location(ast.Call(marker, [node.func, *node.args], node.keywords), node)
    if isinstance(node, (ast.Starred, ast.NamedExpr)):
        node.value = _defer(node.value)
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        node.elts = [_defer(element) for element in node.elts]
    elif isinstance(node, ast.Dict):
        node.values = [_defer(value) for value in node.values]
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        node.elt = _defer(node.elt)
    elif isinstance(node, ast.DictComp):
        node.value = _defer(node.value)
    elif isinstance(node, ast.IfExp):
        node.body, node.orelse = _defer(node.body), _defer(node.orelse)
    return node


def _defer_items(node: ast.expr) -> ast.expr:
    """The calls an iterable expression holds (`[f(), g()]`, `(f(i) for i in r)`), not a
    call that makes the iterable (`tasks.values()`)."""
    return node if isinstance(node, ast.Call) else _defer(node)


# function name -> (its positional parameters, the parameters it awaits)
AwaitingFunctions = dict[str, tuple[list[str], set[str]]]


class DeferAwaitedCalls(ast.NodeTransformer):
    """Rewrites the calls a cell awaits or hands to asyncio (see the section's comment):
    directly, through a name it awaits later (`task = f()` ... `await task`, a list of
    calls it gathers), or as the argument of a function that awaits that parameter
    (`async def timed(coro): await coro` ... `timed(f())`). ``functions`` carries the
    functions defined so far from cell to cell."""

    def __init__(self, tree: ast.AST, functions: AwaitingFunctions) -> None:
        self.functions = functions
        self.scopes: list[set[str]] = []
        # Each scope's awaited names, read once from the tree as written (before any rewrite).
        self.awaited_in: dict[ast.AST, set[str]] = {
            node: _awaited_names(node) for node in ast.walk(tree) if isinstance(node, (ast.Module, *_SCOPES))
        }
        for node, names in self.awaited_in.items():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = [argument.arg for argument in node.args.posonlyargs + node.args.args]
                awaited = names & (set(positional) | {argument.arg for argument in node.args.kwonlyargs})
                if awaited:
                    functions[node.name] = (positional, awaited)
                else:
                    functions.pop(node.name, None)

    def _scope(self, node: ast.AST) -> ast.AST:
        self.scopes.append(self.awaited_in[node])
        self.generic_visit(node)
        self.scopes.pop()
        return node

    visit_Module = visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def _awaited(self, target: ast.AST) -> bool:
        name = _named(target)
        return bool(self.scopes) and name is not None and name in self.scopes[-1]

    def visit_Await(self, node: ast.Await) -> ast.AST:
        self.generic_visit(node)
        node.value = _call(AWAITABLE_NAME, _defer(node.value))
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        kind, func = _taker(node), node.func
        if kind == "each":
            node.args = [self._handed(argument) for argument in node.args]
        elif kind and node.args and not isinstance(node.args[0], ast.Starred):
            if kind == "iterable":
                node.args[0] = _call(AWAITABLES_NAME, _defer_items(node.args[0]))
            else:
                node.args[0] = _call(AWAITABLE_NAME, _defer(node.args[0]))
        if isinstance(func, ast.Attribute) and func.attr in _COLLECTORS and self._awaited(func.value):
            node.args = [_defer(argument) for argument in node.args]
        if isinstance(func, ast.Name) and func.id in self.functions:
            positional, awaited = self.functions[func.id]
            for index, argument in enumerate(node.args[: len(positional)]):
                if isinstance(argument, ast.Starred):
                    break
                if positional[index] in awaited:
                    node.args[index] = _defer(argument)
            for keyword in node.keywords:
                if keyword.arg in awaited:
                    keyword.value = _defer(keyword.value)
        return node

    @staticmethod
    def _handed(argument: ast.expr) -> ast.expr:
        if isinstance(argument, ast.Starred):
            argument.value = _call(AWAITABLES_NAME, _defer_items(argument.value))
            return argument
        return _call(AWAITABLE_NAME, _defer(argument))

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        self.generic_visit(node)
        if any(self._awaited(target) for target in node.targets):
            node.value = _defer(node.value)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        self.generic_visit(node)
        if node.value is not None and self._awaited(node.target):
            node.value = _defer(node.value)
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        self.generic_visit(node)
        if self._awaited(node.target):
            node.value = _defer(node.value)
        return node


def _may_defer(tree: ast.Module, functions: AwaitingFunctions) -> bool:
    """Whether DeferAwaitedCalls could change ``tree`` or ``functions``: only through an
    ``await``, a function or lambda (a scope of its own, or a definition to record), a call
    that hands awaitables to asyncio, or a call of a function known to await a parameter.
    Most cells have none of them; one walk is cheaper than the rewrite (a sixth of an
    executor's work on a short cell)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Await, *_SCOPES)):
            return True
        if isinstance(node, ast.Call) and (
            _taker(node) or (isinstance(node.func, ast.Name) and node.func.id in functions)
        ):
            return True
    return False


def defer_awaited_calls(tree: ast.Module, functions: AwaitingFunctions) -> ast.Module:
    if _may_defer(tree, functions):
        DeferAwaitedCalls(tree, functions).visit(tree)
        ast.fix_missing_locations(tree)
    return tree


SANDBOX_BUILTINS = {DEFER_NAME: defer_call, AWAITABLE_NAME: make_awaitable, AWAITABLES_NAME: make_awaitables}


class Executor:
    """One persistent namespace. Each execute is compiled as a cell that allows
    top-level ``await``; a final expression is evaluated separately so its value can
    be shown like a REPL."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        # In builtins, not the namespace: code that clears its globals keeps working.
        for name, helper in SANDBOX_BUILTINS.items():
            setattr(builtins, name, helper)
        self.loop = asyncio.new_event_loop()
        self.cell_count = 0
        self.awaiting_functions: AwaitingFunctions = {}

    def run(self, source: str) -> Any:
        """Run ``source``; return the final expression's value (None if there is none).
        Exceptions from user code propagate unchanged."""
        self.cell_count += 1
        filename = "%s%d>" % (CELL_PREFIX, self.cell_count)
        # Registered so tracebacks can show the user's own lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = defer_awaited_calls(ast.parse(source, filename, "exec"), self.awaiting_functions)
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
            # Raised in the code's own frames, the task has ended with it, and asyncio
            # never stops the loop for such a task: running it again would never return.
            # Raised elsewhere (the loop waiting), the task is cancelled and let finish.
            if not task.done():
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
    end, where the error is. A ModuleNotFoundError adds ``module``, the name not found
    (the bridge says how to get a common package into the image)."""
    try:
        message = str(exc)
    except Exception:
        message = safe_repr(exc)
    try:
        text = format_user_exception(exc, __file__)
    except Exception:
        text = "%s: %s\n" % (type(exc).__name__, message)
    if len(text) > limit:
        text = "%s\n%s" % (cut_marker(len(text) - limit, "the traceback", limit), text[-limit:])
    info = {"type": type(exc).__name__[:MAX_NAME_CHARS], "message": message[:2000], "traceback": text}
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if isinstance(missing, str):
        info["module"] = missing[:MAX_NAME_CHARS]
    return info


_JSON_SCALARS = (str, int, float, bool, type(None))


def plain_json(value: Any, budget: int) -> Any:
    """``value`` as JSON data when it is plain JSON (dicts with string keys, lists, tuples,
    strings, numbers, booleans, None: exactly those types, so a namedtuple or a dict
    subclass keeps its repr) and its JSON text fits ``budget`` characters; else None.
    The bridge gives it to the client as structured data instead of a repr."""
    nodes = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        nodes += 1
        if nodes > budget or depth > 64:
            return None
        kind = type(item)
        if kind is dict:
            if not all(type(key) is str for key in item):
                return None
            pending.extend((child, depth + 1) for child in item.values())
        elif kind is list or kind is tuple:
            pending.extend((child, depth + 1) for child in item)
        elif kind not in _JSON_SCALARS:
            return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (ValueError, TypeError):  # NaN or infinity; an int too long to print
        return None
    return json.loads(text) if len(text) <= budget else None


def safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a broken __repr__ must not break the result frame
        return f"<unrepresentable {type(value).__name__}: {type(exc).__name__}: {exc}>"


# =============================================================================
# rich output: images (plots, display(), show_image(), image values) and files
# =============================================================================
# What a call shows besides text: matplotlib figures (as Jupyter's inline backend does:
# `plt.show()` and figures still open when the cell ends become PNGs, then are closed),
# `display(obj)`, `runtime.show_image(...)`, and an image as the cell's final value (also
# each ToolImage in a list or tuple value: a tool's result of several parts). They
# travel in the result frame, capped in number and size, and reach the client as image
# content after the text. `runtime.attach(path)` sends a file the same way, as an
# embedded resource (text or base64 blob, with its mime type).

IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
MAX_ATTACHMENTS = 10  # files per call
MAX_LISTED_IMAGES = 100  # a longer list or tuple value is shown as its repr only
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript", "application/x-yaml")
_IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)  # fmt: skip


class ToolImage:
    """An image: from a tool's result, or made by code (``runtime.ToolImage(data, mime)``).
    ``data`` is the decoded bytes. As a cell's final value, or given to display(), it is shown."""

    def __init__(self, data: bytes, mime_type: str) -> None:
        self.data = data
        self.mime_type = mime_type

    def __repr__(self) -> str:
        return "<ToolImage %s, %d bytes>" % (self.mime_type, len(self.data))


def sniff_image_type(data: bytes) -> str | None:
    for signature, mime_type in _IMAGE_SIGNATURES:
        if data.startswith(signature):
            return mime_type
    return "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else None


def image_of(value: Any) -> tuple[bytes, str] | None:
    """(bytes, mime type) when ``value`` is an image this sandbox knows how to show:
    a ToolImage, a matplotlib Figure, a PIL image, or anything with ``_repr_png_``."""
    if isinstance(value, ToolImage):
        return bytes(value.data), value.mime_type
    kind = type(value)
    module = getattr(kind, "__module__", "") or ""
    if module.startswith("matplotlib.") and kind.__name__ == "Figure":
        return _png_of(value.savefig, bbox_inches="tight"), "image/png"
    if module.startswith("PIL.") and hasattr(value, "save"):
        return _png_of(value.save), "image/png"
    render = getattr(kind, "_repr_png_", None)
    if callable(render):
        data = render(value)
        return (data, "image/png") if isinstance(data, bytes) else None
    return None


def _png_of(save: Callable[..., Any], **options: Any) -> bytes:
    buffer = io.BytesIO()
    save(buffer, format="png", **options)
    return buffer.getvalue()


class ImageCollector:
    """The images of the running execute, within the caps; a note for each one dropped."""

    def __init__(
        self, max_images: int, max_bytes: int, max_attachment_bytes: int = 5_000_000, max_total: int = 2**24
    ) -> None:
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.max_attachment_bytes = max_attachment_bytes
        # Images and files of one call together, in base64, must fit in one result frame.
        self.max_total = max_total
        self.total = 0
        self.images: list[dict[str, str]] = []
        self.attachments: list[dict[str, str]] = []
        self.notes: list[str] = []
        self.offered = 0

    def take(self) -> tuple[list[dict[str, str]], list[dict[str, str]], list[str]]:
        taken = (self.images, self.attachments, self.notes)
        self.images, self.attachments, self.notes, self.offered, self.total = [], [], [], 0, 0
        return taken

    def _room(self, size: int) -> bool:
        """Whether ``size`` more bytes (base64 grows them by a third) still fit in the frame."""
        encoded = (size + 2) // 3 * 4
        if self.total + encoded > self.max_total:
            return False
        self.total += encoded
        return True

    def attach(self, path: Any, mime_type: str | None = None) -> str:
        """Send the file at ``path`` to the client with the result; returns its URI."""
        if len(self.attachments) >= MAX_ATTACHMENTS:
            raise ValueError("attach: at most %d files per call" % MAX_ATTACHMENTS)
        real = os.path.realpath(os.fspath(path))
        with open(real, "rb") as handle:
            data = handle.read(self.max_attachment_bytes + 1)
        if len(data) > self.max_attachment_bytes:
            raise ValueError(
                "attach: %s is larger than %d bytes (MCP_BRIDGE_MAX_ATTACHMENT_BYTES); compress it or "
                "send a part" % (real, self.max_attachment_bytes)
            )
        if not self._room(len(data)):
            raise ValueError(
                "attach: %s does not fit in this call's result with the images and files before it; "
                "attach it in another call" % real
            )
        kind = mime_type or mimetypes.guess_type(real)[0] or "application/octet-stream"
        entry = {"uri": "file://" + urllib.parse.quote(real), "mime_type": kind}
        text = None
        if kind.startswith("text/") or kind in _TEXT_TYPES:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                pass  # not really text: sent as a blob
        if text is None:
            entry["blob"] = base64.b64encode(data).decode("ascii")
        else:
            entry["text"] = text
        self.attachments.append(entry)
        return entry["uri"]

    def add(self, data: bytes, mime_type: str) -> None:
        self.offered += 1
        if len(self.images) >= self.max_images:
            self.notes.append(
                "Image %d was not returned: at most %d images per call (MCP_BRIDGE_MAX_IMAGES)."
                % (self.offered, self.max_images)
            )
        elif len(data) > self.max_bytes:
            self.notes.append(
                "Image %d was not returned: %d bytes, over the %d-byte cap (MCP_BRIDGE_MAX_IMAGE_BYTES); "
                "save it smaller (a lower dpi, a smaller figure) or to a file."
                % (self.offered, len(data), self.max_bytes)
            )
        elif mime_type not in IMAGE_TYPES:
            self.notes.append(
                "Image %d was not returned: %s is not one of %s."
                % (self.offered, mime_type, ", ".join(IMAGE_TYPES))
            )
        elif not self._room(len(data)):
            self.notes.append(
                "Image %d was not returned: the call's images and files together would not fit in one "
                "result; show fewer or smaller images per call." % self.offered
            )
        else:
            self.images.append({"mime_type": mime_type, "data": base64.b64encode(data).decode("ascii")})

    def add_value(self, value: Any) -> bool:
        """Show ``value`` if it is an image (closing it if it is an open figure)."""
        found = image_of(value)
        if found is None:
            return False
        self.add(*found)
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and type(value).__name__ == "Figure":
            pyplot.close(value)
        return True

    def add_tool_images(self, value: Any) -> None:
        """Show the ToolImages in a short list or tuple: a tool's result with several parts
        (text, image, text) is one, and its repr alone would show the image only as
        ``<ToolImage ...>``. Only ToolImages: rendering other items (``_repr_png_``) could
        be slow, and Jupyter shows none of them either."""
        if isinstance(value, (list, tuple)) and len(value) <= MAX_LISTED_IMAGES:
            for item in value:
                if isinstance(item, ToolImage):
                    self.add(bytes(item.data), item.mime_type)

    def capture_figures(self) -> None:
        """Every open matplotlib figure becomes an image, then is closed (memory stays flat)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            try:
                self.add(_png_of(figure.savefig, bbox_inches="tight"), "image/png")
            except Exception as exc:  # a figure that cannot be drawn must not lose the result
                self.notes.append("Figure %d could not be drawn: %s: %s" % (number, type(exc).__name__, exc))
        pyplot.close("all")

    def display(self, *values: Any) -> None:
        """Jupyter's display(): images are shown; anything else is printed as its repr (and
        the images in a tool's result with several parts are shown too)."""
        for value in values:
            if not self.add_value(value):
                self.add_tool_images(value)
                print(repr(value))

    def show_image(self, data_or_path: Any, mime_type: str | None = None) -> None:
        """Show an image given as bytes or as a file path; the type is sniffed when not given."""
        if isinstance(data_or_path, (bytes, bytearray, memoryview)):
            data = bytes(data_or_path)
        else:
            with open(os.fspath(data_or_path), "rb") as handle:
                data = handle.read(self.max_bytes + 1)
        found = mime_type or sniff_image_type(data)
        if found is None:
            raise ValueError(
                "show_image: not a PNG, JPEG, GIF or WebP image; pass mime_type=... if it is one"
            )
        self.add(data, found)


class _PyplotHook(importlib.abc.MetaPathFinder):
    """When code imports matplotlib.pyplot, make its show() hand the figures to the
    collector, as Jupyter's inline backend does (and the Agg backend never opens a window)."""

    def __init__(self, collector: ImageCollector) -> None:
        self.collector = collector

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "matplotlib.pyplot":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.collector)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, collector: ImageCollector) -> None:
        self.loader = loader
        self.collector = collector

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        collector = self.collector

        def show(*args: Any, **kwargs: Any) -> None:
            collector.capture_figures()

        module.show = show


def capture_images(collector: ImageCollector) -> None:
    """Send matplotlib to the Agg backend, its cache to /tmp, and its show() to ``collector``."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("MPLCONFIGDIR", "/tmp/matplotlib")
    sys.meta_path.insert(0, _PyplotHook(collector))


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


class ApprovalDenied(MCPToolError):
    """The user did not approve this tool call (denied it, or did not answer in time, or
    could not be asked): the tool was not called. Catch it to go on without the call."""


APPROVAL_DENIED = "ApprovalDenied"  # the bridge's name for it in a response's error
ERROR_TYPES: dict[str, type[MCPError]] = {
    "MCPError": MCPError,
    "MCPToolError": MCPToolError,
    APPROVAL_DENIED: ApprovalDenied,
}


# The execute whose code is running here: set by the executor around each cell and
# inherited by what the cell starts: asyncio tasks (they copy the context), threads and
# thread-pool jobs (see inherit_current_call). Every host request carries it, and the
# supervisor refuses one whose call is not the running execute, so a thread left over
# from an earlier call cannot act during a later one. Code can set it to anything: this
# stops accidents, not malice (the supervisor still refuses all requests between calls).
CURRENT_CALL: contextvars.ContextVar[Any] = contextvars.ContextVar("mcp_current_call", default=None)


def inherit_current_call() -> None:
    """Executor only: a thread runs for the call that started it, a ThreadPoolExecutor
    job for the call that submitted it (a pool's threads outlive calls; asyncio's
    run_in_executor uses one), as Python 3.14 threads can inherit the context."""
    import concurrent.futures  # noqa: PLC0415 - asyncio imports it anyway

    start, submit = threading.Thread.start, concurrent.futures.ThreadPoolExecutor.submit

    def start_in_call(self: threading.Thread) -> None:
        call, run = CURRENT_CALL.get(), self.run

        def run_in_call() -> None:
            CURRENT_CALL.set(call)  # this thread's own context: no reset needed
            run()

        self.run = run_in_call  # type: ignore[method-assign]
        start(self)

    def submit_in_call(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return submit(self, contextvars.copy_context().run, fn, *args, **kwargs)

    threading.Thread.start = start_in_call  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = submit_in_call  # type: ignore[method-assign]


class HostRequests:
    """Requests from sandbox code to the bridge, multiplexed by id over the channel, so
    many can be in flight at once. Synchronous callers block on a lock the reader thread
    releases; asynchronous ones await a future resolved from the reader thread."""

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
        frame: RequestFrame = {
            "type": "request",
            "id": request_id,
            "method": method,
            "params": params,
            "call": CURRENT_CALL.get(),
        }
        try:
            self.channel.send(frame)
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
        # A held lock the reader releases: the hand-off of threading.Event (a Condition, a
        # fresh lock per wait) costs more, on every proxied call.
        done = threading.Lock()
        done.acquire()
        box: list[Frame] = []

        def deliver(frame: Frame) -> None:
            box.append(frame)
            done.release()

        request_id = self._register(deliver)
        try:
            self._send_request(request_id, method, params)
            done.acquire()  # interruptible: a timeout's KeyboardInterrupt lands here
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
        if issubclass(kind, MCPToolError):  # the bridge names the call it refused
            raise kind(str(error.get("message")), str(error.get("server", "")), str(error.get("tool", "")))
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


def _resource_value(result: dict[str, Any]) -> Any:
    """A read resource as plain Python: each part's text, or its bytes (a blob); one part
    alone, several as a list."""
    parts = [
        base64.b64decode(part["blob"]) if "blob" in part else part.get("text", "")
        for part in (result.get("contents") if isinstance(result, dict) else None) or []
    ]
    return parts[0] if len(parts) == 1 else parts


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


def deferrable(method: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a sandbox API callable that returns a PendingCall when written to be awaited."""
    method._mcp_deferrable = True  # type: ignore[attr-defined]
    return method


class SandboxRuntime:
    """What ``from mcp import runtime`` gives. Every helper, like every ``mcp_<alias>.<tool>``,
    returns its value, in any code; ``await helper(...)`` works too, and calls handed to
    ``asyncio.gather`` run at the same time (see "deferred calls")."""

    MCPError = MCPError
    MCPToolError = MCPToolError
    ApprovalDenied = ApprovalDenied
    ToolImage = ToolImage

    def __init__(
        self,
        requests: HostRequests,
        servers: list[dict[str, str]],
        images: ImageCollector,
        problems: list[str] | None = None,
    ) -> None:
        self._requests = requests
        self._servers = servers
        self._images = images
        self._problems = problems or []  # config files the bridge could not use

    # --- images: shown to the client after the text --------------------------------------
    def display(self, *values: Any) -> None:
        """Show images (plots, PIL images, ToolImage, figures); print anything else's repr."""
        self._images.display(*values)

    def show_image(self, data_or_path: Any, mime_type: str | None = None) -> None:
        """Show an image from bytes or a file (PNG, JPEG, GIF, WebP; sniffed unless given)."""
        self._images.show_image(data_or_path, mime_type)

    def attach(self, path: Any, mime_type: str | None = None) -> str:
        """Return the file at ``path`` to the client with this call's result, as an embedded
        resource (text when it is text, else base64), its type guessed from the name unless
        given. Returns the file's URI. At most 10 files per call."""
        return self._images.attach(path, mime_type)

    def _now_or_deferred(
        self, run: Callable[[], Any], run_async: Callable[[], Coroutine[Any, Any, Any]], label: str
    ) -> Any:
        return PendingCall(run, run_async, label) if take_deferral() else run()

    def _host(
        self, method: str, params: dict[str, Any], label: str, then: Callable[[Any], Any] = lambda r: r
    ) -> Any:
        """One host request (a tool call, a memory helper): its value, or a PendingCall."""

        async def run_async() -> Any:
            return then(await self._requests.call_async(method, params))

        return self._now_or_deferred(lambda: then(self._requests.call(method, params)), run_async, label)

    @deferrable
    def discovered_servers(self, detailed: bool = False) -> Any:
        """Configured servers (none is started by this): aliases, or dicts with details."""
        params, label = {"detailed": detailed}, "runtime.discovered_servers()"
        if detailed:  # the details carry every configuration problem
            return self._host(DISCOVERED_SERVERS, params, label)
        return self._host(DISCOVERED_SERVERS, params, label, self._aliases)

    def _aliases(self, aliases: list[str]) -> list[str]:
        """Aliases as a list that also prints the config files that could not be used, if any."""
        return ServerAliases(aliases, self._problems) if self._problems else aliases

    @deferrable
    def list_servers(self) -> Any:
        """Aliases of the servers this sandbox may call."""
        aliases = [server["alias"] for server in self._servers]

        async def run_async() -> Any:
            return self._aliases(list(aliases))

        return self._now_or_deferred(
            lambda: self._aliases(list(aliases)), run_async, "runtime.list_servers()"
        )

    @deferrable
    def list_tools(self, server: str) -> Any:
        """Tool names and one-line descriptions of one server (starts it if needed)."""
        return self._host(LIST_TOOLS, {"server": server}, "runtime.list_tools(%r)" % (server,))

    @deferrable
    def query_tool_docs(self, server: str, tool: str | None = None, detail: str = "summary") -> Any:
        """Python signatures of a server's tools (or one tool); detail="full" adds schemas."""
        params = {"server": server, "tool": tool, "detail": detail}
        return self._host(QUERY_TOOL_DOCS, params, "runtime.query_tool_docs(%r)" % (server,))

    @deferrable
    def search_tool_docs(self, query: str, limit: int = 5, detail: str = "summary") -> Any:
        """The tools of all configured servers that best match a plain-words query, best
        first: dicts (server, tool, name, signature, score, line) that print as their one
        ``line``, ``mcp_<alias>.<tool>(...) -> T  # summary``; ``detail="line"``: just the
        lines; ``detail="full"``: with descriptions and schemas."""
        params = {"query": query, "limit": limit, "detail": detail}
        label = "runtime.search_tool_docs(%r)" % (query,)
        return self._host(SEARCH_TOOL_DOCS, params, label, _search_hits)

    @deferrable
    def capability_summary(self) -> Any:
        """A short text: servers, how to discover and call their tools."""
        return self._host(CAPABILITY_SUMMARY, {}, "runtime.capability_summary()")

    @deferrable
    def list_loaded_server_metadata(self) -> Any:
        """The original project's name: details of every configured server."""
        params = {"detailed": True}
        label = "runtime.list_loaded_server_metadata()"
        return self._host(DISCOVERED_SERVERS, params, label, lambda result: result["servers"])

    # The original project's synchronous names: the same helpers.
    list_servers_sync = list_servers
    query_tool_docs_sync = query_tool_docs
    search_tool_docs_sync = search_tool_docs

    @deferrable
    def call_tool(
        self, server: str, tool: str, arguments: dict[str, Any] | None = None, raw: bool = False
    ) -> Any:
        """Call one tool: its result as plain Python (see unwrap_tool_result)."""
        label = "runtime.call_tool(%r, %r, ...)" % (server, tool)
        return self._dispatch_call(server, tool, arguments or {}, raw, label)

    def _dispatch_call(self, server: str, tool: str, arguments: dict[str, Any], raw: bool, label: str) -> Any:
        params = {"server": server, "tool": tool, "arguments": arguments}
        return self._host(
            CALL_TOOL, params, label, lambda result: unwrap_tool_result(server, tool, result, raw)
        )

    # --- what else a server offers: resources and prompts -----------------------------------
    @deferrable
    def list_resources(self, server: str) -> Any:
        """A server's resources (dicts: uri, name, description, mimeType) and templates."""
        return self._host(LIST_RESOURCES, {"server": server}, "runtime.list_resources(%r)" % (server,))

    @deferrable
    def read_resource(self, server: str, uri: str) -> Any:
        """A server's resource at ``uri``: its text (a str) or its bytes (a blob); a list
        of them when the resource has several parts."""
        return self._host(
            READ_RESOURCE,
            {"server": server, "uri": uri},
            "runtime.read_resource(%r, %r)" % (server, uri),
            _resource_value,
        )

    @deferrable
    def list_prompts(self, server: str) -> Any:
        """A server's prompts (dicts: name, description, arguments)."""
        return self._host(LIST_PROMPTS, {"server": server}, "runtime.list_prompts(%r)" % (server,))

    @deferrable
    def get_prompt(self, server: str, name: str, arguments: dict[str, str] | None = None) -> Any:
        """A server's prompt filled in with ``arguments``: {description, messages}."""
        params = {"server": server, "name": name, "arguments": arguments}
        return self._host(GET_PROMPT, params, "runtime.get_prompt(%r, %r)" % (server, name))

    @deferrable
    def progress(self, done: float, total: float | None = None, message: str | None = None) -> Any:
        """Tell the client how far the work is (``done`` of ``total``, and a short message),
        if it asked for progress: a notification it shows while the call runs. Values
        must grow; reports closer than a quarter second apart are thinned out."""
        params = {"done": done, "total": total, "message": message}
        return self._host(PROGRESS, params, "runtime.progress(%r)" % (done,))

    # --- memory: kept on the host, across sessions and bridges ------------------------------
    @deferrable
    def save_memory(self, key: str, value: Any, metadata: dict[str, Any] | None = None) -> Any:
        """Remember ``value`` (JSON: dict, list, str, int, float, bool, None) under ``key`` for
        future sessions; ``metadata`` (a dict) describes it. Returns the entry's info."""
        _require_json(value, "save_memory: the value")
        _require_json(metadata, "save_memory: the metadata")
        params = {"key": key, "value": value, "metadata": metadata}
        return self._host(MEMORY_SAVE, params, "save_memory(%r, ...)" % (key,))

    @deferrable
    def load_memory(self, key: str, default: Any = None) -> Any:
        """The value saved under ``key``, or ``default`` when there is none."""
        return self._host(
            MEMORY_LOAD,
            {"key": key},
            "load_memory(%r)" % (key,),
            lambda r: r["value"] if r["found"] else default,
        )

    @deferrable
    def delete_memory(self, key: str) -> Any:
        """Forget ``key``; True when it existed."""
        return self._host(MEMORY_DELETE, {"key": key}, "delete_memory(%r)" % (key,))

    @deferrable
    def memory_exists(self, key: str) -> Any:
        return self._host(MEMORY_INFO, {"key": key}, "memory_exists(%r)" % (key,), lambda r: r is not None)

    @deferrable
    def get_memory_info(self, key: str) -> Any:
        """{key, metadata, size, version, created, updated} of ``key``, or None."""
        return self._host(MEMORY_INFO, {"key": key}, "get_memory_info(%r)" % (key,))

    @deferrable
    def list_memories(self, after: str | None = None, limit: int | None = None) -> Any:
        """Saved keys with their metadata, size and timestamps, in key order: every one, or
        the first ``limit`` after the key ``after`` (for the part that follows, call again
        with ``after`` = the last key you got). The host answers MEMORY_PAGE_ENTRIES at most
        at a time; this asks for the pages in turn."""
        if limit is not None and (type(limit) is not int or limit < 0):
            raise ValueError("list_memories: limit must be a whole number >= 0 or None, not %r" % (limit,))

        def run() -> Any:
            entries: list[Any] = []
            while (params := _next_memory_page(after, limit, entries)) is not None:
                if not _take_memory_page(entries, self._requests.call(MEMORY_LIST, params)):
                    break
            return entries

        async def run_async() -> Any:
            entries: list[Any] = []
            while (params := _next_memory_page(after, limit, entries)) is not None:
                if not _take_memory_page(entries, await self._requests.call_async(MEMORY_LIST, params)):
                    break
            return entries

        return self._now_or_deferred(run, run_async, "list_memories()")

    @deferrable
    def update_memory(self, key: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Atomically replace the value of ``key`` with ``fn(value)`` (``fn(default)`` when
        there is none), even with other sessions and bridges updating it at the same time:
        the host commits only if nobody wrote in between, else ``fn`` runs again on the new
        value. ``fn`` raising leaves the value unchanged. Returns the new value."""
        return self._now_or_deferred(
            lambda: self._update_sync(key, fn, default),
            lambda: self._update_async(key, fn, default),
            "update_memory(%r, ...)" % (key,),
        )

    def _update_sync(self, key: str, fn: Callable[[Any], Any], default: Any) -> Any:
        for attempt in range(UPDATE_MEMORY_ATTEMPTS):
            current = self._requests.call(MEMORY_LOAD, {"key": key})
            value = fn(current["value"] if current["found"] else default)
            _require_json(value, "update_memory: the new value")
            params = {"key": key, "value": value, "generation": current["generation"]}
            if self._requests.call(MEMORY_PUT_IF, params)["ok"]:
                return value
            time.sleep(_backoff(attempt))
        raise MCPError(_CONTENDED % (key, UPDATE_MEMORY_ATTEMPTS))

    async def _update_async(self, key: str, fn: Callable[[Any], Any], default: Any) -> Any:
        for attempt in range(UPDATE_MEMORY_ATTEMPTS):
            current = await self._requests.call_async(MEMORY_LOAD, {"key": key})
            value = fn(current["value"] if current["found"] else default)
            _require_json(value, "update_memory: the new value")
            params = {"key": key, "value": value, "generation": current["generation"]}
            if (await self._requests.call_async(MEMORY_PUT_IF, params))["ok"]:
                return value
            await asyncio.sleep(_backoff(attempt))
        raise MCPError(_CONTENDED % (key, UPDATE_MEMORY_ATTEMPTS))

    # --- saved tools: functions kept on the host, defined in every future session ------------
    @deferrable
    def save_tool(self, func: Callable[..., Any]) -> Any:
        """Save a function defined with ``def`` at the top level of a cell, so every future
        session (and every other bridge) has it. Saving the same name again replaces it.
        Returns {"name", "path", "warnings"}: names it uses that a fresh session may lack."""
        source, unbound = tool_source(func)
        params = {"name": func.__name__, "source": source}

        def answer(info: dict[str, Any]) -> dict[str, Any]:
            saved = info.pop("tools", [])  # every saved tool's name: a fresh session has them
            return dict(info, warnings=unbound_name_warnings(unbound, saved))

        return self._host(TOOL_SAVE, params, "save_tool(%s)" % func.__name__, answer)

    @deferrable
    def list_saved_tools(self) -> Any:
        """[{"name", "doc", "path"}] of the saved tools (``doc``: the docstring's first line)."""
        return self._host(TOOL_LIST, {}, "list_saved_tools()")

    @deferrable
    def delete_tool(self, name: str) -> Any:
        """Forget a saved tool (sessions that have it keep it until they end); True if it existed."""
        return self._host(TOOL_DELETE, {"name": name}, "delete_tool(%r)" % (name,))


class SearchHit(dict):  # type: ignore[type-arg]
    """One search hit: a dict that prints as its one-line summary, to keep output short."""

    def __repr__(self) -> str:
        return str(self.get("line", dict.__repr__(self)))


def _hit(hit: Any) -> Any:
    return SearchHit(hit) if isinstance(hit, dict) and isinstance(hit.get("line"), str) else hit


def _search_hits(answer: Any) -> Any:
    """A search's hits, each printing as its line; where no tool matches the query well,
    the host's notice is printed to stderr, in the code's output where the search was."""
    if not isinstance(answer, dict):
        return answer
    if isinstance(answer.get("notice"), str):
        print(answer["notice"], file=sys.stderr)
    return [_hit(hit) for hit in answer.get("hits") or []]


UPDATE_MEMORY_ATTEMPTS = 100
MEMORY_PAGE_ENTRIES = 1000  # the most memories the host lists in one answer (also by size)


def _next_memory_page(after: str | None, limit: int | None, entries: list[Any]) -> dict[str, Any] | None:
    """The params of list_memories' next request, or None when ``limit`` entries are in."""
    left = MEMORY_PAGE_ENTRIES if limit is None else limit - len(entries)
    if left <= 0:
        return None
    return {"after": entries[-1]["key"] if entries else after, "limit": min(left, MEMORY_PAGE_ENTRIES)}


def _take_memory_page(entries: list[Any], page: dict[str, Any]) -> bool:
    """Add a page to ``entries``; whether more follow."""
    entries.extend(page["memories"])
    return bool(page["more"] and page["memories"])


_CONTENDED = "update_memory(%r): other writers changed the value on each of %d attempts; try again"
MEMORY_HELPERS = (
    "save_memory", "load_memory", "update_memory", "list_memories", "delete_memory", "memory_exists",
    "get_memory_info", "save_tool", "list_saved_tools", "delete_tool",
)  # fmt: skip
SAVED_TOOL_PREFIX = "<saved tool "


def tool_source(func: Any) -> tuple[str, list[str]]:
    """The source of a function fit to save, and the names it uses that it does not define
    (see _unbound_names). TypeError says why a function cannot be saved."""
    name = getattr(func, "__name__", type(func).__name__)
    if hasattr(func, "__wrapped__"):  # functools.wraps, lru_cache, ...: the wrapper is not the source
        raise TypeError("save_tool cannot save decorated functions (%s): save the plain function" % name)
    if not inspect.isfunction(func):
        raise TypeError(
            "save_tool needs a function defined with def; %s is a %s" % (name, type(func).__name__)
        )
    if name == "<lambda>":
        raise TypeError("save_tool cannot save a lambda: define the function with def at the top level")
    if "<locals>" in func.__qualname__ or func.__closure__:
        raise TypeError(
            "save_tool cannot save %s: it is defined inside another function (it may use that function's "
            "variables); define it at the top level of a cell" % name
        )
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as exc:
        raise TypeError("save_tool cannot find the source of %s (%s)" % (name, exc)) from None
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError("save_tool needs a single function definition; the source of %s is not one" % name)
    definition = tree.body[0]
    if definition.decorator_list:
        raise TypeError("save_tool cannot save decorated functions (%s): save the plain function" % name)
    return source, _unbound_names(definition)


def _unbound_names(definition: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Names the function reads that are not its parameters, its own assignments or imports,
    or builtins (sorted): a fresh session will not have them unless they are saved tools."""
    bound = {definition.name}
    arguments = definition.args
    for arg in (
        *arguments.posonlyargs,
        *arguments.args,
        *arguments.kwonlyargs,
        arguments.vararg,
        arguments.kwarg,
    ):
        if arg is not None:
            bound.add(arg.arg)
    used: list[str] = []
    for node in ast.walk(definition):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                used.append(node.id)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted({name for name in used if name not in bound and not hasattr(builtins, name)})


def unbound_name_warnings(names: list[str], saved_tools: collections.abc.Collection[str]) -> list[str]:
    """save_tool's warnings: the unbound ``names`` that are not saved tools either."""
    return [
        "%s is not defined inside the function; a fresh session will not have it unless it is a saved "
        "tool or you define it again" % name
        for name in names
        if name not in saved_tools
    ]


def _backoff(attempt: int) -> float:
    """Jittered wait before update_memory retries, so contending writers spread out."""
    return random.uniform(0, 0.002 * min(attempt + 1, 25))


def _require_json(value: Any, what: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except RecursionError:
        raise ValueError("%s is nested too deeply to be sent to the host as JSON" % what) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(
            "%s must be JSON (dict, list, str, int, float, bool or None): %s" % (what, exc)
        ) from None


class PendingCall(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A call the code awaits or hands to asyncio (see "deferred calls"): a coroutine that
    sends nothing until it runs, so the calls of one ``gather`` overlap. Awaited again, it
    gives the same value (or raises the same error) without a second call. Should the
    code use it as a value after all (a list of calls it also gathers, say), it runs then
    and there and stands for its value: printing, indexing, methods, operators."""

    def __init__(
        self, run: Callable[[], Any], run_async: Callable[[], Coroutine[Any, Any, Any]], label: str
    ) -> None:
        self._run = run
        self._run_async = run_async
        self._label = label
        self.__name__ = self.__qualname__ = label  # what asyncio shows for a task running it
        self._coroutine: Coroutine[Any, Any, Any] | None = None
        self._outcome: tuple[bool, Any] | None = None  # (ok, value or exception), once settled

    # --- as a coroutine: await, gather, create_task ---------------------------------------
    def _started(self) -> Coroutine[Any, Any, Any]:
        coroutine = self._coroutine
        if coroutine is None or inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED:
            coroutine = self._coroutine = self._settle()  # a fresh one gives the settled outcome
        return coroutine

    async def _settle(self) -> Any:
        if self._outcome is None:
            try:
                self._outcome = (True, await self._run_async())
            except Exception as exc:
                self._outcome = (False, exc)
        return self._result()

    def _result(self) -> Any:
        assert self._outcome is not None
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def __await__(self) -> Any:
        return self._started().__await__()

    def send(self, value: Any) -> Any:
        return self._started().send(value)

    def throw(self, *args: Any) -> Any:
        return self._started().throw(*args)

    def close(self) -> None:
        if self._coroutine is not None:
            self._coroutine.close()

    def __del__(self) -> None:
        coroutine = self.__dict__.get("_coroutine")  # absent in a copy made without __init__
        if coroutine is not None and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()  # never ran: nothing was sent, and Python need not warn

    # --- as its value ---------------------------------------------------------------------
    def _resolve(self) -> Any:
        if self._outcome is None:
            coroutine = self._coroutine
            if coroutine is not None and inspect.getcoroutinestate(coroutine) != inspect.CORO_CREATED:
                raise TypeError("%s is still running: await it before using its value" % self._label)
            try:
                self._outcome = (True, self._run())
            except Exception as exc:
                self._outcome = (False, exc)
        return self._result()

    def __getattr__(self, name: str) -> Any:
        # Private and coroutine attributes (asyncio probes cr_code, cr_frame) do not run the call.
        if name.startswith(("_", "cr_", "gi_", "ag_")):
            raise AttributeError(name)
        return getattr(self._resolve(), name)

    def __repr__(self) -> str:
        return repr(self._resolve())

    def __format__(self, spec: str) -> str:
        return format(self._resolve(), spec)

    __hash__ = object.__hash__  # identity: asyncio.wait puts awaitables in a set


def _on_value(operation: Callable[..., Any], reflected: bool = False) -> Callable[..., Any]:
    if reflected:
        return lambda self, other: operation(other, self._resolve())
    return lambda self, *args: operation(self._resolve(), *args)


_OPERATIONS: dict[str, Callable[..., Any]] = {
    "__str__": str, "__bytes__": bytes, "__bool__": bool, "__len__": len, "__iter__": iter,
    "__reversed__": reversed, "__int__": int, "__float__": float, "__index__": operator.index,
    "__abs__": abs, "__neg__": operator.neg, "__getitem__": operator.getitem,
    "__contains__": operator.contains, "__eq__": operator.eq, "__ne__": operator.ne,
    "__lt__": operator.lt, "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge,
    "__add__": operator.add, "__sub__": operator.sub, "__mul__": operator.mul,
    "__truediv__": operator.truediv, "__floordiv__": operator.floordiv, "__mod__": operator.mod,
    "__or__": operator.or_, "__and__": operator.and_,
}  # fmt: skip
_REFLECTED_OPERATIONS: dict[str, Callable[..., Any]] = {
    "__radd__": operator.add, "__rsub__": operator.sub, "__rmul__": operator.mul,
    "__rtruediv__": operator.truediv, "__rmod__": operator.mod, "__ror__": operator.or_,
}  # fmt: skip
for _name, _operation in _OPERATIONS.items():
    setattr(PendingCall, _name, _on_value(_operation))
for _name, _operation in _REFLECTED_OPERATIONS.items():
    setattr(PendingCall, _name, _on_value(_operation, reflected=True))


class TypeText:
    """A parameter's type as the host renders it (``list[str] | None``), shown unquoted."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature_from_text(text: str) -> inspect.Signature | None:
    """An inspect.Signature from the host's ``name(a: str, b: int = 1) -> T  # summary``;
    every parameter is keyword-only, as tools take them, plus the ``raw`` option."""
    try:
        definition = ast.parse("def %s: pass" % text.split("  # ", 1)[0]).body[0]
        assert isinstance(definition, ast.FunctionDef)
        arguments = definition.args
        defaults = [None] * (len(arguments.args) - len(arguments.defaults)) + list(arguments.defaults)
        parameters = [
            inspect.Parameter(
                argument.arg,
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if default is None else ast.literal_eval(default),
                annotation=TypeText(ast.unparse(argument.annotation))
                if argument.annotation
                else inspect.Parameter.empty,
            )
            for argument, default in zip(arguments.args, defaults)
        ]
        if "raw" not in {parameter.name for parameter in parameters}:
            parameters.append(
                inspect.Parameter(
                    "raw", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=TypeText("bool")
                )
            )
        if arguments.kwarg is not None:
            annotation = arguments.kwarg.annotation
            kind = inspect.Parameter.VAR_KEYWORD
            parameters.append(
                inspect.Parameter(
                    arguments.kwarg.arg,
                    kind,
                    annotation=TypeText(ast.unparse(annotation)) if annotation else inspect.Parameter.empty,
                )
            )
        returns = TypeText(ast.unparse(definition.returns)) if definition.returns else inspect.Signature.empty
        return inspect.Signature(parameters, return_annotation=returns)
    except (SyntaxError, ValueError, TypeError, AssertionError):
        return None


class ServerProxy:
    """``mcp_<alias>``: one attribute per tool, called with keyword arguments."""

    def __init__(self, runtime: SandboxRuntime, alias: str) -> None:
        self._runtime = runtime
        self._alias = alias
        self._tools: dict[str, str] | None = None  # python name -> tool name
        self._functions: dict[str, Callable[..., Any]] = {}  # python name -> its function

    def _tool_names(self, refresh: bool = False) -> dict[str, str]:
        if self._tools is None or refresh:
            tools = self._runtime.list_tools(self._alias)
            self._tools = {tool["name"]: tool["tool"] for tool in tools}
            self._functions.clear()
        return self._tools

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        tools = self._tool_names()
        if name not in tools and name.startswith("_"):
            raise AttributeError(name)  # a probe (IPython's _repr_html_...): no tool, no host request
        if name not in tools:
            tools = self._tool_names(refresh=True)
        if name not in tools:
            # The host's answer names the nearest tools by meaning and by name, with their
            # signatures, so the model fixes its call in the same run.
            try:
                self._runtime._requests.call(QUERY_TOOL_DOCS, {"server": self._alias, "tool": name})
            except MCPError as exc:
                raise AttributeError(str(exc)) from None
            raise AttributeError("mcp_%s has no tool %r; see dir(mcp_%s)" % (self._alias, name, self._alias))
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = tool_function(self._runtime, self._alias, tools[name], name)
        return function

    def __dir__(self) -> list[str]:
        return sorted(self._tool_names())

    def __repr__(self) -> str:
        return "<MCP server %s: use dir() or runtime.query_tool_docs(%r)>" % (self._alias, self._alias)


def tool_function(runtime: SandboxRuntime, server: str, tool: str, name: str) -> Callable[..., Any]:
    """``mcp_<alias>.<tool>``: a function called with keyword arguments, whose __doc__ and
    __signature__ (so help() and inspect) come from the tool's docs on the host."""
    label = "mcp_%s.%s(...)" % (server, name)

    def call(*args: Any, raw: bool = False, **arguments: Any) -> Any:
        if args:
            raise TypeError(
                "mcp_%s.%s takes keyword arguments only, e.g. %s(name=value); see help(mcp_%s.%s)"
                % (server, name, name, server, name)
            )
        return runtime._dispatch_call(server, tool, arguments, raw, label)

    call.__name__ = name
    call.__qualname__ = "mcp_%s.%s" % (server, name)
    call.__module__ = "mcp.servers.%s" % server
    call._mcp_deferrable = True  # type: ignore[attr-defined]
    try:
        docs = runtime._requests.call(QUERY_TOOL_DOCS, {"server": server, "tool": tool, "detail": "full"})
    except MCPError as exc:
        call.__doc__ = "The docs of %s.%s are unavailable: %s" % (server, tool, exc)
        return call
    call.__doc__ = tool_doc_text(docs)
    call.__signature__ = signature_from_text(str(docs.get("signature", "")))  # type: ignore[attr-defined]
    return call


def tool_doc_text(docs: dict[str, Any]) -> str:
    """The docstring of a tool function: description, parameters, what comes back."""
    lines = [str(docs.get("description") or "(The tool has no description.)").strip(), ""]
    schema = docs.get("input_schema")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    described = [
        (name, prop["description"])
        for name, prop in (properties.items() if isinstance(properties, dict) else ())
        if isinstance(prop, dict) and isinstance(prop.get("description"), str)
    ]
    if described:
        lines += ["Parameters:"] + ["  %s: %s" % (name, text.strip()) for name, text in described] + [""]
    lines.append(
        "Returns the result as plain Python (structuredContent, or the content with JSON text "
        "parsed); raw=True gives the MCP result dict. Raises runtime.MCPToolError when the "
        "tool reports failure."
    )
    return "\n".join(lines)


# --- servers that are not here: said where the name fails ----------------------------------
# A config file the bridge could not use leaves its servers out, and the model meets that
# as a NameError for ``mcp_time``. The error it sees names the servers there are and the
# files that could not be used. A bare name cannot be hooked (a module's globals are a
# plain dict), so the executor completes the message of the NameError (or ImportError)
# itself, keeping its type and traceback: see explain_missing_server.


class ServerAliases(list):  # type: ignore[type-arg]
    """Server aliases (runtime.discovered_servers(), runtime.list_servers()) when config
    files could not be used: a list that prints with them, since their servers are missing."""

    def __init__(self, aliases: Iterable[str], problems: list[str]) -> None:
        super().__init__(aliases)
        self.problems = problems

    def __repr__(self) -> str:
        lines = [list.__repr__(self), "# Servers are missing: a configuration file could not be used:"]
        return "\n".join(lines + ["#   " + problem for problem in self.problems])


def unknown_server_message(alias: str, servers: list[dict[str, str]], problems: list[str]) -> str:
    """Why ``mcp_<alias>`` does not exist: the servers there are, and the config files the
    bridge could not use (only the user can fix those; the bridge reads them at start-up)."""
    aliases = sorted(str(server["alias"]) for server in servers)
    close = difflib.get_close_matches(alias, aliases, n=3, cutoff=0.6)
    text = "There is no MCP server %r in this sandbox%s. Its servers: %s." % (
        alias,
        " (did you mean %s?)" % ", ".join("mcp_" + name for name in close) if close else "",
        ", ".join("mcp_" + name for name in aliases) or "none",
    )
    if problems:
        text += (
            " A configuration file could not be used, so the servers it configures are missing: %s. "
            "Tell the user: once it is fixed, restart the MCP server (or the client) to read it."
            % "; ".join(problems)
        )
    return text + " runtime.discovered_servers(detailed=True) shows where each server came from."


def _quoted_name(message: str, before: str, after: str) -> str | None:
    """The name in one of Python's own messages, ``<before>'<name>'<after>...``."""
    if not message.startswith(before + "'"):
        return None
    end = message.find("'" + after, len(before) + 1)
    return message[len(before) + 1 : end] if end > len(before) else None


def _alias_of_global(name: str | None) -> str | None:
    """``x`` for the global ``mcp_x`` a server would be; None for any other name."""
    return name[len("mcp_") :] if name and name.startswith("mcp_") and len(name) > 4 else None


def missing_server_alias(exc: BaseException) -> str | None:
    """The server alias user code looked for, when ``exc`` is Python's error for a name of
    a server: ``mcp_x`` (NameError), ``from mcp.servers import x`` and ``from mcp import
    mcp_x`` (ImportError), ``import mcp.servers.x`` (ModuleNotFoundError)."""
    if type(exc) is NameError:
        return _alias_of_global(
            getattr(exc, "name", None) or _quoted_name(str(exc), "name ", " is not defined")
        )
    if type(exc) is ModuleNotFoundError:
        module = exc.name or ""
        return module[len("mcp.servers.") :] if module.startswith("mcp.servers.") else None
    if type(exc) is ImportError and exc.name in ("mcp", "mcp.servers"):
        name = _quoted_name(str(exc), "cannot import name ", " from ")
        return _alias_of_global(name) if exc.name == "mcp" else name
    return None


def explain_missing_server(exc: BaseException, servers: list[dict[str, str]], problems: list[str]) -> None:
    """Complete the message of Python's error for a server that is not here (in place:
    the type and the traceback stay as they are)."""
    alias = missing_server_alias(exc)
    if alias is None or alias in {server["alias"] for server in servers} or hasattr(exc, "_mcp_explained"):
        return  # not about a missing server, or completed already (code may raise it again)
    message = "%s. %s" % (str(exc).rstrip("."), unknown_server_message(alias, servers, problems))
    if isinstance(exc, ImportError):
        exc.msg = message  # what str() of an ImportError shows
    exc.args = (message,)
    exc._mcp_explained = True  # type: ignore[attr-defined]


def install_sandbox_api(
    namespace: dict[str, Any],
    requests: HostRequests,
    servers: list[dict[str, str]],
    images: ImageCollector | None = None,
    session: str = DEFAULT_SESSION,
    problems: list[str] | None = None,
) -> None:
    """Make ``from mcp import runtime``, ``from mcp.servers import <alias>`` and the
    ``mcp_<alias>`` globals work, whatever ``mcp`` package the image may carry; and
    ``display()`` / ``runtime.show_image()`` hand images to ``images``. ``runtime.session``
    is the name of the bridge's session this sandbox is (run_python's ``session``);
    ``problems``: the config files the bridge could not use, named where a server is missing."""
    problems = problems or []
    runtime = SandboxRuntime(requests, servers, images or ImageCollector(10, 2**21), problems)
    package = types.ModuleType("mcp", "Sandbox API: runtime and servers")
    package.__path__ = []  # a package, so ``mcp.servers`` imports
    servers_module = types.ModuleType("mcp.servers", "One object per configured MCP server")
    runtime_module = types.ModuleType("mcp.runtime", SandboxRuntime.__doc__)
    for name in dir(runtime):
        if not name.startswith("_"):
            setattr(runtime_module, name, getattr(runtime, name))
    runtime_module.session = session  # type: ignore[attr-defined]
    package.runtime = runtime_module  # type: ignore[attr-defined]
    package.servers = servers_module  # type: ignore[attr-defined]
    for server in servers:
        proxy = ServerProxy(runtime, server["alias"])
        setattr(servers_module, server["alias"], proxy)
        namespace["mcp_" + server["alias"]] = proxy

    def missing_server(name: str) -> Any:  # mcp.servers.<alias> of a server that is not here
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            "module 'mcp.servers' has no attribute %r. %s"
            % (name, unknown_server_message(name, servers, problems))
        )

    servers_module.__getattr__ = missing_server  # type: ignore[method-assign]
    sys.modules.update({"mcp": package, "mcp.runtime": runtime_module, "mcp.servers": servers_module})
    namespace["runtime"] = runtime_module
    for name in MEMORY_HELPERS:  # globals too, as users of the original project know them
        namespace[name] = getattr(runtime, name)
    namespace["display"] = runtime.display


# =============================================================================
# executor process: runs the user's code
# =============================================================================

SAVED_TOOLS_SECONDS = 10.0  # defining the saved tools, in all; the rest are left out after it
WITHOUT_SAVED_TOOLS = (
    "This fresh session started without the saved tools; list_saved_tools() names them, "
    "delete_tool(name) removes one, and a reset (without saved_tools: false) defines them."
)


class ExecutorProcess:
    """The child process that holds the user's namespace. It talks to the supervisor
    over two pipes of its own; its fd 1 and fd 2 are pipes the supervisor reads. It never
    holds a descriptor of the bridge's channel. The main thread runs user code (so
    Ctrl-C semantics hold: the supervisor interrupts with SIGINT); a reader thread
    receives frames, and end of input (the supervisor is gone) ends the process."""

    def __init__(self, channel: Channel, config: dict[str, Any]) -> None:
        self.channel = channel
        self.max_output_chars = int(config.get("max_output_chars", DEFAULT_MAX_OUTPUT))
        self.executor = Executor()
        self.std_streams: dict[str, Any] = {}
        # Private copies of the output pipes, to repair fd 1/2 if user code closes them.
        self.output_fds = {1: os.dup(1), 2: os.dup(2)}
        # SimpleQueue: each hand-off from the reader costs a lock, where queue.Queue's costs
        # a Condition (a fresh lock per wait): the executor's CPU per call is 10% less.
        self.executes: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()
        self.running_id: str | None = None
        self.requests = HostRequests(channel)
        self.images = ImageCollector(
            int(config.get("max_images", 10)),
            int(config.get("max_image_bytes", 2**21)),
            int(config.get("max_attachment_bytes", 5_000_000)),
            int(config.get("max_frame_bytes", 2**25)) // 2,
        )
        self.servers = list(config.get("servers", []))
        self.config_problems = [str(problem) for problem in config.get("config_problems") or []]
        session = str(config.get("session", DEFAULT_SESSION))
        install_sandbox_api(
            self.executor.namespace, self.requests, self.servers, self.images, session, self.config_problems
        )
        self.handlers: dict[str, Callable[[Frame], None]] = {
            "execute": self.executes.put,
            "response": self.requests.resolve,
        }
        # The bridge says whether there is a store of saved tools to ask (a kernel run on its
        # own, in tests, has none).
        self.tools_loaded = not config.get("saved_tools", False)
        self.defined_tools: list[str] = []  # the saved tools load_saved_tools() defined
        self.reap_children = False  # set after an interrupt (see reap_killed_children)

    def load_saved_tools(self, skip: collections.abc.Collection[str] = ()) -> list[str]:
        """Define every saved tool in the namespace; one that fails (hand-edited into a
        syntax error, a missing import) is reported and the others still load. Before
        each, the supervisor hears which (a "loading" frame): it kills a tool that takes
        over SAVED_TOOL_SECONDS or ends the process, and starts the execute again in a
        fresh executor with that tool in ``skip``. Past SAVED_TOOLS_SECONDS in all, the
        rest are left out. The names defined are kept in ``defined_tools``: the bridge,
        not each fresh session, says which they are."""
        try:
            answer = self.requests.call(TOOL_SOURCES, {})
        except MCPError as exc:
            return ["Saved tools could not be loaded: %s" % exc]
        notices: list[str] = [str(notice) for notice in answer.get("skipped") or []]
        loaded: list[str] = []
        tools = [tool for tool in answer.get("tools") or [] if str(tool.get("name")) not in skip]
        started = time.monotonic()
        for number, tool in enumerate(tools):
            name, source = str(tool.get("name")), str(tool.get("source"))
            if time.monotonic() - started > SAVED_TOOLS_SECONDS:
                notices.append(
                    "Saved tools took over %gs to define, so these were left out of this session: %s."
                    % (SAVED_TOOLS_SECONDS, ", ".join(str(other.get("name")) for other in tools[number:]))
                )
                break
            filename = "%s%s>" % (SAVED_TOOL_PREFIX, name)
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            self.channel.send({"type": "loading", "tool": name, "digest": str(tool.get("digest"))})
            try:
                tree = ast.parse(source, filename, "exec")
                tree = defer_awaited_calls(tree, self.executor.awaiting_functions)
                exec(compile(tree, filename, "exec", dont_inherit=True), self.executor.namespace)
                loaded.append(name)
            except KeyboardInterrupt:  # the call's timeout: the call is interrupted, not the tool
                raise
            except BaseException as exc:  # SystemExit too: a tool must not end the call
                notices.append(
                    "Saved tool %s could not be loaded (%s: %s); fix %s or delete_tool(%r)."
                    % (name, type(exc).__name__, exc, tool.get("path"), name)
                )
            finally:  # a tool that ignored SIGINT must not make the call's code uninterruptible
                signal.signal(signal.SIGINT, self._on_sigint)
        self.defined_tools = loaded
        return notices

    def prepare(self) -> None:
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        self.reattach_output()
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        capture_images(self.images)
        inherit_current_call()
        try:  # if memory runs out, the kernel's OOM killer should pick this process, not PID 1
            with open("/proc/self/oom_score_adj", "w") as handle:
                handle.write("500")
        except OSError:
            pass

    def reattach_output(self) -> None:
        """Before each execute: repair what earlier user code may have closed or
        replaced (fd 1/2, sys.stdout/sys.stderr), so one call cannot silence the next."""
        for fd, private in self.output_fds.items():
            os.dup2(private, fd)
        for name, fd in (("stdout", 1), ("stderr", 2)):
            ours = self.std_streams.get(name)
            if ours is None or ours.closed:
                # Line buffering streams prints promptly; closefd=False keeps fd 1/2 open.
                ours = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
                self.std_streams[name] = ours
            setattr(sys, name, ours)

    def read_frames(self) -> None:
        """Reader thread: dispatch frames; end of input means the supervisor is gone,
        so exit at once, even if user code is still running."""
        # The supervisor's SIGINT must wake the main thread (blocked in time.sleep, say),
        # not this one.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        code = 0
        try:
            while True:
                frame = self.channel.receive()
                if frame is None:
                    break
                try:
                    validate_frame(frame, SUPERVISOR_FRAME_TYPES)
                except ProtocolError as exc:
                    if frame["type"] == "execute" and is_frame_id(frame.get("id")):
                        self.executes.put(frame)  # every execute gets its result, in order: an error
                    else:
                        self.channel.send({"type": "error", "message": "executor ignored a frame: %s" % exc})
                    continue
                self.handlers[frame["type"]](frame)
        except ProtocolError as exc:
            self.channel.send({"type": "error", "message": "executor stopped: %s" % exc})
        except BaseException as exc:  # a bug of ours: its last words explain the crash
            code = 1
            try:
                self.channel.send({"type": "error", "message": "executor failed: %r" % exc})
            except BaseException:
                pass
        finally:
            os._exit(code)

    def _on_sigint(self, signum: int, stack: Any) -> None:
        # Only user code is interruptible; a late interrupt between executes is dropped.
        if self.running_id is None:
            return
        if self.channel.main_thread_writing:
            self.channel.deferred_interrupt = True  # raised once the frame is complete
            return
        raise KeyboardInterrupt

    def serve(self) -> None:
        self.channel.send(
            {"type": "hello", "protocol": PROTOCOL_VERSION, "python": _python_version(), "pid": os.getpid()}
        )
        threading.Thread(target=self.read_frames, name="frame-reader", daemon=True).start()
        while True:
            frame = self.executes.get()
            if frame is None:
                return
            result = self.execute(frame)
            try:
                self.channel.send(result)
            except ProtocolError as exc:  # too big for a frame: exactly one result still goes out
                error = {"type": "ProtocolError", "message": str(exc), "traceback": ""}
                result.update(status="error", value=None, error=error)
                for key in (*RESULT_EXTRAS, "cut"):
                    result.pop(key, None)
                self.channel.send(result)

    def execute(self, frame: Frame) -> Frame:
        execute_id = frame.get("id")
        self.reattach_output()
        result: Frame = {"type": "result", "id": execute_id, "status": "ok", "value": None, "error": None}
        code = frame.get("code")
        if self.reap_children:
            self.reap_children = False
            reap_killed_children()
        try:
            if not isinstance(code, str):
                raise TypeError("execute frame has no 'code' string")
            self.running_id = execute_id
            CURRENT_CALL.set(execute_id)  # inherited by the tasks and threads the cell starts
            if not self.tools_loaded:  # a fresh namespace: the saved tools first
                self.tools_loaded = True
                if frame.get("saved_tools", True):
                    notices = self.load_saved_tools(frame.get("skip") or ())
                    result["defined_tools"] = self.defined_tools[:MAX_DEFINED_TOOLS]
                else:
                    notices = [WITHOUT_SAVED_TOOLS]
                # The code starts now: the supervisor heeds no "loading" frame after this one.
                self.channel.send({"type": "loading", "tool": None})
                if notices:
                    result["notices"] = notices
            value = self.executor.run(code)
            if value is not None:  # still interruptible: a __repr__ may never return
                self.executor.namespace["_"] = value
                if not self.images.add_value(value):
                    self.images.add_tool_images(value)  # and the value's repr, with its text
                    head, cut, tail = head_and_tail(safe_repr(value), self.max_output_chars)
                    result["value"] = head
                    if cut or tail:  # the bridge fits head and tail into the result's budget
                        result["cut"] = {"value": {"count": cut, "tail": tail}}
                    else:
                        data = plain_json(value, self.max_output_chars)
                        if data is not None:
                            result["json"] = data
            self.images.capture_figures()  # figures still open at the end of the cell
            self.running_id = None
        except BaseException as exc:
            self.running_id = None
            result["status"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
            self.reap_children = result["status"] == "interrupted"
            explain_missing_server(exc, self.servers, self.config_problems)
            result["error"] = describe_user_exception(exc, self.max_output_chars)
        finally:
            self.running_id = None
        self._attach_images(result)
        for stream in (sys.stdout, sys.stderr):  # buffered text reaches the pipes before the result
            try:
                stream.flush()
            except Exception:  # user code may have closed or replaced it (even with None)
                pass
        return result

    def _attach_images(self, result: Frame) -> None:
        try:
            if result["status"] == "error":
                self.images.capture_figures()  # what was drawn before the error, as Jupyter shows it
        except BaseException as exc:
            self.images.notes.append("Open figures could not be drawn: %s" % type(exc).__name__)
        images, attachments, notes = self.images.take()
        if images:
            result["images"] = images
        if attachments:
            result["attachments"] = attachments
        if notes:
            result["notices"] = list(result.get("notices") or []) + notes


def reap_killed_children(patience: float = 1.0) -> None:
    """After an interrupted execute the supervisor SIGKILLs every process the code started;
    collect those that were the executor's own children, or they linger as zombies (and
    count against the pids limit) for as long as the session lives."""
    give_up = time.monotonic() + patience
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no children left
        if pid == 0:  # one still alive: dying from the kill, or a left-over thread's
            if time.monotonic() > give_up:
                return
            time.sleep(0.01)


def _python_version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]


# =============================================================================
# supervisor: PID 1, owns the bridge's channel
# =============================================================================

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_INTERRUPT_GRACE = 3.0
EXECUTOR_START_TIMEOUT = 30.0
MAX_QUEUED_EXECUTES = 16
# A saved tool runs in every fresh executor before the code: one that ends the process or
# will not finish must not take the session (and the delete_tool that would remove it) with
# it. Each gets this long; the one that fails is blamed, and the execute starts again in a
# fresh executor without it, at most MAX_FAILED_TOOLS times, then without any saved tool.
SAVED_TOOL_SECONDS = 5.0
MAX_FAILED_TOOLS = 5
BACKGROUND_REFUSED = (
    "refused: the run_python call that started this thread or task has ended, so it can no longer "
    "call tools or the host. Do the work inside a call (await it, or join the thread before the "
    "cell ends)."
)


def _prctl(option: int, value: int) -> bool:
    """prctl(2) through ctypes; False where it is unavailable (not Linux)."""
    try:
        import ctypes  # noqa: PLC0415 - best effort: minimal images may lack ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except Exception:
        return False


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process this one can see."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as handle:
                stat = handle.read()
        except OSError:
            continue  # gone meanwhile
        # The command name may hold spaces and parentheses: fields follow the LAST ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2:
            table[int(entry)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
    return table


def live_descendants(root: int) -> list[int]:
    """Every live (not zombie) process below ``root``. As PID 1 (or a child subreaper),
    ``root`` inherits every orphan, so this is everything the code started."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: list[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return [pid for pid in found if table[pid][1] != "Z"]


def kill_descendants(keep: frozenset[int] = frozenset(), settle: bool = False) -> int:
    """SIGKILL every process below this one except ``keep``. Returns how many were killed.

    As PID 1 of the container (the supervisor), every other process of its pid namespace
    is one it started or inherited: one kill(-1, SIGSTOP) freezes them all at once (the
    kernel signals each process of the namespace but init and the caller, and a fork that
    races with it fails), so a fork bomb cannot outrun the kill and the supervisor gets the
    CPU back; then each is killed by pid and ``keep`` is continued. Anywhere else (the
    kernel run on the host, in tests) kill(-1) would reach every process of the machine's
    user, so there the tree below this process is walked, again and again until none is
    left (a fork bomb keeps making more). ``settle``: also wait (up to 2 s) until the dead
    are reaped, for a fresh executor about to start."""
    if os.getpid() == 1:
        return _kill_namespace(keep, settle)
    killed = 0
    for _ in range(200):
        victims = [pid for pid in live_descendants(os.getpid()) if pid not in keep]
        if not victims:
            break
        killed += _signal_each(victims, signal.SIGKILL)
    return killed


def _signal_each(pids: Iterable[int], number: int) -> int:
    """Send signal ``number`` to each of ``pids``; how many got it (the rest are gone)."""
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, number)
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def _kill_namespace(keep: frozenset[int], settle: bool) -> int:
    """kill_descendants as PID 1: stop all, kill all but ``keep``, continue all; again until
    none is left (under gVisor a stop takes effect late, and a process may fork meanwhile)."""
    killed = 0
    give_up = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, signal.SIGSTOP)
        except OSError:  # ESRCH: no other process at all
            break
        table = _process_table()
        alive = [pid for pid, (_, state) in table.items() if state not in "ZX" and pid not in keep | {1}]
        if not alive or time.monotonic() > give_up:
            break
        killed += _signal_each(alive, signal.SIGKILL)
        _signal_each(
            table, signal.SIGCONT
        )  # the killed too: gVisor ends a stopped process only once continued
    _signal_each(keep, signal.SIGCONT)
    # Until the reaper thread has collected them, the dead still count against the pids and
    # process limits; a fresh executor (and its threads) must not fail for want of a slot.
    while settle and time.monotonic() < give_up:
        if not any(entry.isdigit() and entry != "1" for entry in os.listdir("/proc")):
            break
        time.sleep(0.005)
    return killed


def describe_exit(status: int, memory: str) -> str:
    """Why the executor ended, for the model: 'exited with code 3', 'was killed ...'."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number == signal.SIGKILL:
            return (
                "was killed (SIGKILL), almost certainly by the out-of-memory killer: the code exceeded the "
                "sandbox's %s memory limit" % memory
            )
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "signal %d" % number
        return "was killed by %s" % name
    return "exited with code %d" % (os.WEXITSTATUS(status) if os.WIFEXITED(status) else status)


class ExecutorHandle:
    """The supervisor's view of one executor process: its pid, its frame pipes, the two
    pumps reading its output, and whether the supervisor is replacing it."""

    def __init__(
        self, process: subprocess.Popen[bytes], to_executor: Channel, pumps: list[OutputPump]
    ) -> None:
        self.process = process
        self.pid = process.pid
        self.channel = to_executor
        self.pumps = pumps
        self.hello = threading.Event()
        self.python = ""
        self.retired = False  # set once the supervisor kills or has lost it
        self.last_words = ""  # the last error frame it sent, for the report if it dies
        self.loading: tuple[str, str] | None = None  # (name, digest) of the saved tool it defines now
        self.tools_done = False  # it said the code starts: no "loading" frame is heeded after that
        self.reader: threading.Thread | None = None  # reads its frame pipe until end of file

    def sync_output(self) -> None:
        """Deliver the output written before now, before the result that follows it."""
        for pump in self.pumps:
            try:
                pump.drain()
            except Exception as exc:  # the result must still go out; this output then comes late
                message = "supervisor: draining the executor's %s failed: %r" % (pump.stream_name, exc)
                print(message, file=sys.stderr)

    def retire(self, join_pumps: float) -> None:
        """After the process is dead: close the supervisor's pipe ends and let the
        pumps deliver what is left."""
        self.retired = True
        for pump in self.pumps:
            pump.close_write_end()
        for pump in self.pumps:
            pump.join(join_pumps)
        # The reading end is closed by the reader thread itself, after end of file: closing
        # it here could let that thread read a reused descriptor.
        self.channel.close_output()


class Supervisor:
    """PID 1 of the container. Owns the frame channel to the bridge (its own stdin and
    stdout), runs no user code, and cannot be read by it: it is non-dumpable, so
    ``/proc/1/fd`` is closed to the sandbox user. It starts the executor, validates every
    frame the executor sends (the executor is as hostile as the code in it), forwards
    output and host requests only while an execute runs, reaps every zombie, and on a
    timeout interrupts the executor, then kills what the code started, or everything,
    and starts a fresh executor."""

    def __init__(
        self, channel: Channel, config: dict[str, Any], config_path: str, boot: bytes | None = None
    ) -> None:
        self.channel = channel
        self.config = config
        self.config_path = config_path
        self.boot = boot  # the boot payload when booted from stdin (executors boot from it too)
        self.max_output_chars = int(config.get("max_output_chars", DEFAULT_MAX_OUTPUT))
        self.memory = str(config.get("memory", "the"))
        self.output = OutputKeeper(self.max_output_chars, str(config.get("output_dir", OUTPUT_DIR)))
        self.lock = threading.RLock()
        self.child: ExecutorHandle | None = None
        self.ready = threading.Event()  # an executor is up and has said hello
        self.running: Any = None  # the id of the execute in flight
        self.interrupted = False
        # (when, execute id): the moment an interrupted execute is killed if still running.
        self.escalation: tuple[float, Any] | None = None
        # Work for the control thread. Nothing the supervisor must do may need a NEW thread:
        # a fork bomb can use up every pid, and "can't start new thread" would end PID 1.
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.forwarded: set[Any] = set()  # executor request ids the bridge still owes an answer
        self.background = {"stdout": 0, "stderr": 0}  # output while no execute ran
        self.pending_notices: list[str] = []  # for the next result
        self.ignored_frames = 0
        self.queued: collections.deque[Frame] = collections.deque()  # executes waiting their turn
        self.running_frame: Frame | None = None  # the execute in flight, to start again if a tool fails
        self.failed_tools: list[Frame] = []  # {name, digest, reason} of the saved tools it blamed
        self.load_deadline: float | None = None  # when the saved tool being defined is killed

    # --- executor lifecycle ------------------------------------------------------------
    def start_executor(self) -> ExecutorHandle:
        to_read, to_write = os.pipe()
        from_read, from_write = os.pipe()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        if self.boot is None:  # the kernel is a file in the IPC mount
            argv = [sys.executable, "-I", os.path.abspath(__file__), "--executor", self.config_path]
        else:  # booted from stdin: the executor boots the same way, from its own stdin
            argv = [sys.executable, "-I", "-c", BOOTSTRAP, "--executor", ""]
        process = subprocess.Popen(
            [*argv, str(to_read), str(from_write)],
            stdin=subprocess.DEVNULL if self.boot is None else subprocess.PIPE,
            stdout=out_write,
            stderr=err_write,
            pass_fds=(to_read, from_write),
            cwd=str(self.config.get("workdir") or os.getcwd()),
        )
        os.close(to_read)
        os.close(from_write)
        if process.stdin is not None:
            # An executor that dies before reading it all is noticed by the hello timeout below.
            with contextlib.suppress(OSError):
                process.stdin.write(self.boot or b"")
            with contextlib.suppress(OSError):
                process.stdin.close()
        pumps = [
            OutputPump("stdout", out_read, out_write, self.on_output),
            OutputPump("stderr", err_read, err_write, self.on_output),
        ]
        # Tolerant: whatever the code writes to its pipe, the supervisor skips and counts it.
        channel = Channel(from_read, to_write, self.channel.max_frame_bytes, tolerant=True)
        handle = ExecutorHandle(process, channel, pumps)
        for pump in pumps:
            pump.start()
        handle.reader = threading.Thread(
            target=self.read_executor, args=(handle,), name="executor-reader", daemon=True
        )
        handle.reader.start()
        if not handle.hello.wait(EXECUTOR_START_TIMEOUT):
            raise RuntimeError("the executor did not start within %gs" % EXECUTOR_START_TIMEOUT)
        return handle

    def replace_executor(self, old: ExecutorHandle, why: str) -> None:
        """Kill the executor and everything the code started, then start a fresh one."""
        self.ready.clear()
        old.retired = True
        kill_descendants(settle=True)
        old.retire(join_pumps=1.0)
        try:
            fresh = self.start_executor()
        except Exception as exc:  # nothing left to run code in: tell the bridge and stop
            self.channel.send({"type": "error", "message": "supervisor stopped: %s (%s)" % (exc, why)})
            os._exit(1)
        with self.lock:
            self.child = fresh
        self.ready.set()

    def reap(self) -> None:
        """Reaper thread: as PID 1 every orphan becomes our child; collect them all, and
        notice when the executor itself has gone."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.05)  # no children for a moment (an executor is being started)
                continue
            except InterruptedError:
                continue
            child = self.child
            if child is not None and pid == child.pid and not child.retired:
                child.process.returncode = status
                self.tasks.put(functools.partial(self.on_executor_died, child, status))

    def on_executor_died(self, handle: ExecutorHandle, status: int) -> None:
        if handle.reader is not None:
            # What it wrote before it died (its last words) may still be in the pipe: the
            # reaper can be faster than the reader. Bounded: a child it left may hold the pipe.
            handle.reader.join(timeout=1.0)
        reason = describe_exit(status, self.memory)
        if handle.last_words:
            reason += " (it reported: %s)" % handle.last_words
        with self.lock:
            if handle.retired:
                return
            execute_id = self.running
            blamed = execute_id is not None and self.blame_tool(
                handle, "ended the Python process (%s)" % reason
            )
        self.replace_executor(handle, reason)
        if blamed:
            self.restart_execute()
        elif execute_id is not None:
            detail = "the Python process running the code %s" % reason
            self.finish(
                execute_id, "crashed", error={"type": "ExecutorDied", "message": detail, "traceback": ""}
            )
        else:
            with self.lock:
                self.pending_notices.append(
                    "The sandbox's Python process %s between calls; this call runs in a fresh namespace "
                    "(variables, imports and functions are gone; files in /tmp and /workspace are kept)."
                    % reason
                )

    # --- from the executor -------------------------------------------------------------------
    def read_executor(self, handle: ExecutorHandle) -> None:
        try:
            self._read_executor(handle)
        finally:
            os.close(handle.channel.in_fd)

    def _read_executor(self, handle: ExecutorHandle) -> None:
        decoder = handle.channel.decoder
        while True:
            frame = handle.channel.receive()
            if decoder.rejected:  # lines that were not frames at all
                with self.lock:
                    self.ignored_frames += decoder.rejected
                decoder.rejected = 0
            if frame is None:
                break
            try:
                validate_frame(frame, EXECUTOR_FRAME_TYPES)
            except ProtocolError as exc:
                self.ignore_frame()
                if frame.get("type") == "request" and is_frame_id(frame.get("id")):
                    # A caller waits for this answer: refused at once, not at its timeout.
                    self.answer_executor(handle, frame["id"], "refused: %s" % exc)
                continue
            self.on_executor_frame(handle, frame)

    def ignore_frame(self) -> None:
        with self.lock:
            self.ignored_frames += 1

    def on_executor_frame(self, handle: ExecutorHandle, frame: Frame) -> None:
        kind = frame["type"]
        if kind == "hello":
            if not handle.hello.is_set():
                handle.python = str(frame["python"])
                handle.hello.set()
            return
        with self.lock:
            current = handle is self.child and not handle.retired
            running = self.running if current else None
        if kind == "result":
            if running is None or frame["id"] != running:
                self.ignore_frame()  # forged, late or duplicate: exactly one result per execute
                return
            handle.tools_done, handle.loading = True, None
            if self.interrupted:  # every timeout: whatever else the code started dies now
                kill_descendants(keep=frozenset({handle.pid}))
            handle.sync_output()
            with self.lock:
                self.pending_notices.extend(frame.get("notices") or [])
            self.finish(
                running,
                str(frame["status"]),
                value=frame.get("value"),
                error=frame.get("error"),
                extra={key: frame[key] for key in RESULT_EXTRAS if key in frame},
                value_cut=(frame.get("cut") or {}).get("value"),
            )
        elif kind == "request":
            self.forward_request(handle, frame, running)
        elif kind == "cancel":
            with self.lock:
                known = frame["id"] in self.forwarded
            if known:
                self.channel.send({"type": "cancel", "id": frame["id"]})
        elif kind == "error" and current:
            # Kept, not forwarded: the code can send these at will. They explain a crash.
            handle.last_words = str(frame["message"])[:500]
        elif kind == "loading":
            self.on_loading(handle, frame, running)

    # --- saved tools that fail in a fresh executor -----------------------------------------
    def on_loading(self, handle: ExecutorHandle, frame: Frame, running: Any) -> None:
        """The executor defines a saved tool now (or, tool null, is done and the code starts)."""
        with self.lock:
            if running is None or handle.tools_done:
                self.ignored_frames += 1  # only a fresh executor, before the code, loads tools
                return
            tool = frame["tool"]
            handle.tools_done = tool is None
            handle.loading = None if tool is None else (str(tool), str(frame.get("digest") or ""))
            self.load_deadline = None if tool is None else time.monotonic() + SAVED_TOOL_SECONDS
        self.tasks.put(None)  # wakes the control thread to watch the deadline

    def blame_tool(self, handle: ExecutorHandle, reason: str) -> bool:
        """Under the lock: record the saved tool ``handle`` was defining as failed; False if
        it was defining none."""
        if handle.loading is None:
            return False
        name, digest = handle.loading
        handle.loading, self.load_deadline = None, None
        self.failed_tools.append({"name": name, "digest": digest, "reason": reason})
        return True

    def kill_slow_tool(self) -> None:
        """The saved tool being defined is past SAVED_TOOL_SECONDS: kill its executor and
        start the execute again in a fresh one, without that tool."""
        with self.lock:
            old = self.child
            due = self.load_deadline is not None and self.load_deadline <= time.monotonic()
            if not due or self.running is None or old is None:
                return
            if not self.blame_tool(old, "took over %gs" % SAVED_TOOL_SECONDS):
                return
            old.retired = True
        self.replace_executor(old, "a saved tool took too long to define")
        self.restart_execute()

    def restart_execute(self) -> None:
        """Send the execute in flight again, to the fresh executor, skipping the saved tools
        that failed (all of them once MAX_FAILED_TOOLS have): the code has not started."""
        with self.lock:
            frame, handle = dict(self.running_frame or {}), self.child
            skip = [tool["name"] for tool in self.failed_tools]
            if len(skip) >= MAX_FAILED_TOOLS:
                frame["saved_tools"] = False
                self.pending_notices.append(
                    "%d saved tools failed to define, so this session starts without saved tools." % len(skip)
                )
            else:
                frame["skip"] = skip
        assert handle is not None
        try:
            handle.channel.send(frame)
        except (ProtocolError, OSError) as exc:
            self.finish(
                frame["id"], "error", error={"type": "SandboxError", "message": str(exc), "traceback": ""}
            )

    def forward_request(self, handle: ExecutorHandle, frame: Frame, running: Any) -> None:
        request_id = frame["id"]
        with self.lock:
            refuse = None
            if running is None or frame.get("call") != running:  # a thread of an earlier call
                refuse = BACKGROUND_REFUSED
            elif request_id in self.forwarded:
                refuse = "refused: request id %r is already in flight" % (request_id,)
            elif len(self.forwarded) >= MAX_REQUESTS_IN_FLIGHT:
                refuse = TOO_MANY_REQUESTS
            else:
                self.forwarded.add(request_id)
        if refuse is not None:
            self.answer_executor(handle, request_id, refuse)
            return
        try:
            self.channel.send(
                {"type": "request", "id": request_id, "method": frame["method"], "params": frame["params"]}
            )
        except ProtocolError as exc:  # cannot happen with equal caps; answered all the same
            with self.lock:
                self.forwarded.discard(request_id)
            self.answer_executor(handle, request_id, "refused: %s" % exc)

    def answer_executor(self, handle: ExecutorHandle, request_id: Any, message: str) -> None:
        try:
            handle.channel.send(
                {"type": "response", "id": request_id, "error": {"type": "MCPError", "message": message}}
            )
        except OSError:
            pass  # it is gone

    def on_output(self, name: str, text: str) -> None:
        with self.lock:
            running = self.running
            if running is None:
                self.background[name] += len(text)
                return
            kept = self.output.admit(name, text)
        if kept:
            try:
                self.channel.send({"type": "stream", "id": running, "name": name, "text": kept})
            except ProtocolError:  # only with a frame cap below the chunk size: count it as cut
                self.output.unsend(name, len(kept))

    # --- from the bridge -----------------------------------------------------------------------
    def serve(self) -> None:
        threading.Thread(target=self.reap, name="reaper", daemon=True).start()
        threading.Thread(target=self.control, name="control", daemon=True).start()
        self.child = self.start_executor()
        self.ready.set()
        self.channel.send(
            {"type": "hello", "protocol": PROTOCOL_VERSION, "python": self.child.python, "pid": os.getpid()}
        )
        while True:
            try:
                frame = self.channel.receive()
            except ProtocolError as exc:  # the byte stream itself is broken: nothing later can be trusted
                self.channel.send({"type": "error", "message": "kernel stopped: %s" % exc})
                break
            if frame is None:
                break  # the bridge has gone
            try:
                validate_frame(frame, BRIDGE_FRAME_TYPES)
            except ProtocolError as exc:
                if frame["type"] == "execute" and is_frame_id(frame.get("id")):
                    error = {"type": "ProtocolError", "message": str(exc), "traceback": ""}
                    self.channel.send(
                        {"type": "result", "id": frame["id"], "status": "error", "error": error}
                    )
                else:
                    self.channel.send({"type": "error", "message": "kernel ignored a frame: %s" % exc})
                continue
            getattr(self, "on_" + frame["type"])(frame)
        kill_descendants()
        os._exit(0)

    def on_execute(self, frame: Frame) -> None:
        with self.lock:
            if self.running is not None or self.queued:
                if len(self.queued) < MAX_QUEUED_EXECUTES:
                    self.queued.append(frame)  # run in order, one at a time
                    return
                refused = True
            else:
                refused = False
        if refused:
            self.refuse_execute(frame["id"], "more than %d executes are waiting" % MAX_QUEUED_EXECUTES)
        else:
            self.start_execute(frame)

    def refuse_execute(self, execute_id: Any, message: str) -> None:
        error = {"type": "SandboxError", "message": message, "traceback": ""}
        self.channel.send({"type": "result", "id": execute_id, "status": "error", "error": error})

    def start_execute(self, frame: Frame, queued: bool = False) -> None:
        """Run ``frame``; ``queued``: it is the head of self.queued, which it leaves only as
        it becomes the running one (under the lock), so an execute arriving meanwhile always
        finds the supervisor busy and queues behind it (never runs alongside)."""
        execute_id = frame["id"]
        if not self.ready.wait(EXECUTOR_START_TIMEOUT):
            if queued:
                with self.lock:
                    self.queued.popleft()
            self.refuse_execute(execute_id, "no Python process is ready to run code")
            if queued:
                self.start_queued()
            return
        with self.lock:
            if queued:
                self.queued.popleft()
            self.pending_notices.extend(self.take_background_notices())
            self.running, self.interrupted = execute_id, False
            self.output.reset()
            handle = self.child
            self.running_frame = {"type": "execute", "id": execute_id, "code": frame["code"]}
            if "saved_tools" in frame:
                self.running_frame["saved_tools"] = frame["saved_tools"]
            self.failed_tools, self.load_deadline = [], None
        assert handle is not None
        try:
            handle.channel.send(self.running_frame)
        except (ProtocolError, OSError) as exc:
            self.finish(
                execute_id, "error", error={"type": "SandboxError", "message": str(exc), "traceback": ""}
            )

    def take_background_notices(self) -> list[str]:
        notices = []
        written = {name: count for name, count in self.background.items() if count}
        if written:
            notices.append(
                "Dropped %s written while no call was running (by a background thread or process of an "
                "earlier call)."
                % " and ".join("%d characters of %s" % (count, name) for name, count in written.items())
            )
            self.background = {"stdout": 0, "stderr": 0}
        if self.ignored_frames:
            notices.append(
                "The code's process sent %d frame(s) that the supervisor rejected (forged, malformed, or "
                "for a call that had ended)." % self.ignored_frames
            )
            self.ignored_frames = 0
        return notices

    def on_interrupt(self, frame: Frame) -> None:
        with self.lock:
            if frame["id"] != self.running or self.child is None:
                return  # late: that execute has ended
            self.interrupted = True
            pid = self.child.pid
            grace = float(frame.get("grace") or DEFAULT_INTERRUPT_GRACE)
            if self.escalation is None:
                self.escalation = (time.monotonic() + grace, frame["id"])
                self.tasks.put(None)  # wakes the control thread to watch the new deadline
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass  # it died; the reaper reports it

    def control(self) -> None:
        """Control thread, started once: runs queued tasks (replacing a dead executor) and
        the escalation of an interrupt whose grace period is over."""
        while True:
            with self.lock:
                deadlines = [
                    when for when in (self.escalation and self.escalation[0], self.load_deadline) if when
                ]
                wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            try:
                task = self.tasks.get(timeout=wait)
            except queue.Empty:
                task = None
            if task is not None:
                task()
                continue
            with self.lock:
                due = self.escalation if self.escalation and self.escalation[0] <= time.monotonic() else None
            if due is not None:
                self.escalate(due[1])
            self.kill_slow_tool()

    def escalate(self, execute_id: Any) -> None:
        """The grace period is over and the code has not stopped: kill it all, start fresh."""
        with self.lock:
            if self.running != execute_id or self.child is None:
                return
            old = self.child
            old.retired = True
            self.blame_tool(old, "did not stop when the call's timeout interrupted it")
        started = time.monotonic()
        self.replace_executor(old, "timeout")
        message = (
            "the code did not stop when interrupted, so its processes were killed; a fresh Python "
            "process was ready %d ms later" % round((time.monotonic() - started) * 1000)
        )
        self.finish(execute_id, "killed", error={"type": "Killed", "message": message, "traceback": ""})

    def on_response(self, frame: Frame) -> None:
        with self.lock:
            if frame["id"] not in self.forwarded:
                return  # not one the executor asked for (or already answered)
            self.forwarded.discard(frame["id"])
            handle = self.child
        if handle is not None and not handle.retired:
            response = {"type": "response", "id": frame["id"]}
            for key in ("result", "error"):
                if key in frame:
                    response[key] = frame[key]
            try:
                handle.channel.send(response)
            except OSError:
                pass

    def finish(
        self,
        execute_id: Any,
        status: str,
        value: Any = None,
        error: Any = None,
        extra: Frame | None = None,
        value_cut: Frame | None = None,
    ) -> None:
        """Send the one result of ``execute_id`` (later attempts are ignored)."""
        with self.lock:
            if self.running != execute_id:
                return
            self.running = None
            self.escalation = None
            result: Frame = {
                "type": "result",
                "id": execute_id,
                "status": status,
                "value": value,
                "error": error,
            }
            # The value and the traceback share the output budget with the streams.
            others = len(value or "") + len((error or {}).get("traceback") or "")
            if value_cut:
                others += value_cut["count"] + len(value_cut["tail"])
            cuts = self.output.finish(others)
            if value_cut:
                cuts["value"] = value_cut
            if cuts:
                result["cut"] = cuts
            notices = self.pending_notices + self.take_background_notices()
            self.pending_notices = []
            if notices:
                result["notices"] = notices
            if self.failed_tools:  # for the bridge, which keeps them out of new sessions until changed
                result["failed_tools"], self.failed_tools = self.failed_tools[:100], []
            self.running_frame, self.load_deadline = None, None
            result.update(extra or {})
        try:
            self.channel.send(result)
        except ProtocolError as exc:  # only with a tiny frame cap; exactly one result still goes out
            result.update(status="error", value=None, error={"type": "ProtocolError", "message": str(exc)})
            result.pop("notices", None)
            result.pop("cut", None)
            for key in RESULT_EXTRAS:
                result.pop(key, None)
            self.channel.send(result)
        self.start_queued()

    def start_queued(self) -> None:
        """Start the execute waiting longest, if any."""
        with self.lock:
            following = self.queued[0] if self.queued else None
        if following is not None:
            self.start_execute(following, queued=True)


# =============================================================================
# entry point
# =============================================================================


# --- the stdin bootstrap ----------------------------------------------------------------
# When the engine cannot see the host's files (a remote engine, a Kubernetes Pod) there is
# no IPC mount: the container runs ``python3 -I -c BOOTSTRAP``, which reads one payload
# from stdin, ``<length>\n<JSON {"name", "kernel", "config"}>``, and runs the kernel source
# in ``__main__`` with the payload as ``BOOTED``. It reads exactly that many bytes (os.read,
# no buffering): the frame channel on the same stdin starts right after. Kept tiny and
# fixed; it is the only code that is not this file, and it has to fit on a command line.
BOOT_NAME = "/kernel/mcp_sandbox_kernel.py"  # the kernel's file name in tracebacks when booted
BOOT_HEADER_MAX = 12  # digits and newline of the length line
BOOTSTRAP = (
    "import os,sys,json\n"
    "def _boot_read(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:raise SystemExit('kernel bootstrap: stdin ended before the kernel arrived')\n"
    "  b+=c\n"
    " return b\n"
    "_boot_head=b''\n"
    "while _boot_head[-1:]!=b'\\n' and len(_boot_head)<%d:_boot_head+=_boot_read(1)\n"
    "BOOTED=json.loads(_boot_read(int(_boot_head)))\n"
    "__file__=BOOTED['name']\n"
    "exec(compile(BOOTED['kernel'],__file__,'exec'),globals())\n"
) % BOOT_HEADER_MAX


def boot_payload(kernel_source: str, config: dict[str, Any]) -> bytes:
    """What BOOTSTRAP reads from stdin before the frame channel starts."""
    body = json.dumps({"name": BOOT_NAME, "kernel": kernel_source, "config": config}).encode()
    return b"%d\n" % len(body) + body


# --- the socket channel ---------------------------------------------------------------
# Every byte on stdin and stdout passes through the engine's relay (conmon and the podman
# CLI, or dockerd and containerd's shim): most of a warm call's time. Where the bridge
# shares the IPC mount, it listens on a Unix socket there (session.json's "socket"); the
# supervisor connects once, before the executor (and any code) exists, and the bridge
# accepts that one connection and removes the socket file. The frames go over the socket,
# signed as on stdio. Where the socket cannot be reached (Docker Desktop's VM, gVisor,
# SELinux labels) the channel stays on stdio, and the reason goes to stderr.
SOCKET_CONNECT_TIMEOUT = 5.0


def connect_to_bridge(path: str) -> socket.socket | str:
    """A connected socket to the bridge at ``path``, or why there is none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(SOCKET_CONNECT_TIMEOUT)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        return "%s: %s" % (path, exc.strerror or exc)
    sock.settimeout(None)
    return sock


def stop_at_end_of_stdin() -> None:
    """Thread: with the frames on the socket, the bridge closing the container's stdin
    (or going away) still stops the sandbox, as it does on stdio."""
    with contextlib.suppress(OSError):
        while os.read(0, 1 << 16):
            pass
    kill_descendants()
    os._exit(0)


def _read_config(path: str) -> dict[str, Any]:
    if not path:
        return {}
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    return config if isinstance(config, dict) else {}


def main(argv: list[str], booted: dict[str, Any] | None = None) -> int:
    """``mcp_sandbox_kernel.py [SESSION_JSON]``: the supervisor (PID 1).
    ``mcp_sandbox_kernel.py --executor SESSION_JSON IN_FD OUT_FD``: the executor it starts.
    ``booted``: the payload BOOTSTRAP read from stdin (its config replaces SESSION_JSON)."""
    if len(argv) > 1 and argv[1] == "--executor":
        global asyncio
        import asyncio  # noqa: PLC0415 - the executor's alone (see the imports)

        if booted is not None:  # stdin held the payload; the code reads an empty stdin
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
        config = booted["config"] if booted is not None else _read_config(argv[2])
        channel = Channel(
            int(argv[3]), int(argv[4]), int(config.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES))
        )
        process = ExecutorProcess(channel, config)
        process.prepare()
        process.serve()
        return 0
    config_path = argv[1] if len(argv) > 1 and booted is None else ""
    config = booted["config"] if booted is not None else _read_config(config_path)
    boot = boot_payload(booted["kernel"], config) if booted is not None else None
    # Nothing in the sandbox may read this process's memory or descriptors (/proc/1/fd:
    # the bridge's channel), and orphans of the code must come here to be reaped.
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code may signal PID 1; only the bridge may stop it
    os.chdir(str(config.get("workdir") or os.getcwd()))
    channel = Channel(0, 1, int(config.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES)))
    first = channel.receive()  # the key, before the executor (and any code) exists
    if first is None:
        return 0
    try:
        validate_frame(first, frozenset({"key"}))
    except ProtocolError as exc:
        channel.send(
            {"type": "error", "message": "kernel stopped: the first frame must be the key (%s)" % exc}
        )
        return 2
    channel.key = bytes.fromhex(first["key"])
    socket_path = config.get("socket")
    if isinstance(socket_path, str) and socket_path:
        connected = connect_to_bridge(socket_path)
        if isinstance(connected, str):
            sys.stderr.write("kernel: the frames stay on stdio (no socket channel: %s)\n" % connected)
            sys.stderr.flush()
        else:
            channel.move_to(connected.detach())  # non-inheritable: no executor holds it
            threading.Thread(target=stop_at_end_of_stdin, name="stdin-watch", daemon=True).start()
    Supervisor(channel, config, config_path, boot).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv, globals().get("BOOTED")))
