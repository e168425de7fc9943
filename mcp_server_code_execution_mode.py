"""mcp-server-code-execution-mode: one MCP tool, ``run_python``, backed by a persistent,
hardened, network-less Podman or Docker container.

The model's code runs in ONE container per session (``run_python``'s ``session``),
started (pre-warmed) once and kept, so variables, imports and functions survive between
calls. Over stdio the bridge serves one client; over streamable HTTP (``--transport
http``) many, each bearer token's principal with its own sessions, memory and saved
tools. The container's main process is the kernel in ``mcp_sandbox_kernel.py``; bridge
and kernel talk in newline-delimited JSON frames over the container's stdin/stdout (see
ARCHITECTURE.md).

Sections, in dependency order (``grep -n '^# ====' mcp_server_code_execution_mode.py``):
    text                 -> clean_text: what any section shows a person or a model, made safe
    errors               -> every exception class: BridgeError (for the model), CommandError (a terminal)
    configuration        -> BridgeConfig, built once in main() from flags and MCP_BRIDGE_*; tool policy
    wire protocol        -> shared with the kernel: encode_frame / FrameDecoder
    container engine     -> Podman / Docker strategies, detection, hardened argv, sweeping;
                            SharedEngine (found once for all sandboxes); the workspace mount
    server discovery     -> the user's MCP servers, read from every client's config files
    MCP client pool      -> one long-lived client per server, each owned by one task
    tool docs            -> Python-style signatures of the tools' schemas
    search               -> a fuzzy search over all tools (search_tool_docs)
    memory store         -> memories (SQLite) and saved tools, written by the host only
    approvals and the call log -> a proxied call waits for the user where the policy says;
                            SessionApprovals, CallLog (calls.jsonl)
    sandbox API (host)   -> serves the sandbox's requests: discovery, docs, tool calls
    sandbox session      -> Sandbox (one container + kernel), SandboxKeeper (serializes its calls,
                            keeps it warm), Sandboxes (every sandbox, by principal and name)
    rendering            -> ExecutionOutcome -> text / TOON + structuredContent
    MCP server & tool    -> run_python; resources: the manual, memories, saved tools;
                            principals (who calls, and what each caller owns);
                            the stdio transport (a reply to every message, 4 MiB cap);
                            the misconfigured server (a bad setting, answered over stdio)
    HTTP transport       -> /mcp behind bearer tokens, /health, uvicorn, signals
    command line         -> main(); the memory, tools and calls subcommands; adopt; doctor
"""

from __future__ import annotations

import argparse
import ast
import base64
import bisect
import copy
import difflib
import errno
import fcntl
import fnmatch
import gc
import hashlib
import hmac
import html
import importlib.metadata
import importlib.util
import io
import ipaddress
import json
import keyword
import logging
import math
import os
import random
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.parse
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from difflib import SequenceMatcher
from functools import lru_cache, partial
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Literal,
    NamedTuple,
    NoReturn,
    NotRequired,
    Protocol,
    TypeAlias,
    TypedDict,
    TypeVar,
    TypeVarTuple,
    cast,
)

import anyio
import anyio.abc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic.json_schema import SkipJsonSchema

# The MCP SDK (mcp.*), uvicorn and starlette are imported where they are used, not here:
# importing any mcp.* module loads the SDK's HTTP server as well (uvicorn, starlette,
# sse_starlette, httpx: about half a second), which the terminal commands (memory, adopt,
# build-image, --help) never need. tests/test_imports.py checks that importing this module
# loads none of them. Here, the names that annotations use:
if TYPE_CHECKING:
    import asyncio

    import mcp_types as types
    import uvicorn
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters
    from mcp.server.auth.middleware.bearer_auth import AuthorizationContext
    from mcp.server.auth.provider import AccessToken
    from mcp.server.context import ServerRequestContext
    from mcp.server.lowlevel import Server
    from mcp.server.streamable_http import StreamableHTTPServerTransport
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from mcp.shared.dispatcher import ProgressFnT
    from mcp.shared.exceptions import MCPError as McpProtocolError
    from mcp.shared.message import SessionMessage
    from starlette.applications import Starlette
    from starlette.authentication import AuthenticationBackend
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send
    from uvicorn.protocols.http.h11_impl import H11Protocol

import mcp_sandbox_kernel
from mcp_sandbox_kernel import (
    BOOTSTRAP,
    IMAGE_TYPES,
    KERNEL_FRAME_TYPES,
    MAX_ATTACHMENTS,
    MAX_REQUESTS_IN_FLIGHT,
    PROTOCOL_VERSION,
    TOO_MANY_REQUESTS,
    Attachment,
    CancelFrame,
    ErrorFrame,
    ErrorInfo,
    ExecuteFrame,
    Frame,
    FrameDecoder,
    FrameId,
    HelloFrame,
    Image,
    InterruptFrame,
    ProtocolError,
    RequestFrame,
    ResponseFrame,
    ResultFrame,
    StreamFrame,
    boot_payload,
    encode_frame,
    is_frame_id,
    validate_frame,
)

__version__ = "0.1.0"
SERVER_NAME = "mcp-server-code-execution-mode"
logger = logging.getLogger("mcp_server_code_execution_mode")


def lazy_module(name: str) -> ModuleType:
    """``name``'s module, loaded on its first attribute access (the stdlib's LazyLoader
    recipe): what importing it costs is paid only by the paths that use it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None, name
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The MCP protocol's types: a third of a second to import (pydantic models of two protocol
# versions), which the terminal commands never need. (Python 3.11's LazyLoader is not
# thread-safe on the first access: the servers make theirs as the bridge opens (Bridge's
# run_python tool) or in build_misconfigured_server, before any worker thread runs.)
if not TYPE_CHECKING:
    types = lazy_module("mcp_types")

# What the bridge takes from the MCP SDK beyond its public API, each "module:name" (a
# dotted name reaches into a class; an attribute the SDK sets in __init__ is checked on an
# instance). An SDK upgrade may move or change them without notice: tests/test_imports.py
# imports each and names the one that moved. Where one is used, its import says "one of
# SDK_INTERNALS", and the test checks that every such import is listed here.
SDK_INTERNALS = (
    "mcp.shared._httpx_utils:create_mcp_http_client",  # an HTTP server's client, the SDK's timeouts
    "mcp.os.posix.utilities:terminate_posix_process_tree",  # stops a stdio server's process group
    "mcp.client.auth.oauth2:OAuthContext.token_expiry_time",  # a stored token's expiry, after a restart
    "mcp.client.auth.oauth2:OAuthContext.update_token_expiry",  # refreshed before it expires
    "mcp.client.auth.oauth2:OAuthContext.oauth_metadata",  # where to refresh, after a restart
    "mcp.server.streamable_http_manager:StreamableHTTPSessionManager._admit_session",  # per-principal cap
    "mcp.server.streamable_http_manager:StreamableHTTPSessionManager._session_owners",  # who holds each
    "mcp.server.streamable_http_manager:StreamableHTTPSessionManager._server_instances",  # how many open
)

# =============================================================================
# text
# =============================================================================
# What every section shows a person or a model passes through clean_text.


# What a terminal would act on rather than show: escape sequences (colours, cursor moves,
# window titles, hyperlinks, DCS/APC strings) and other control characters (NUL, BEL,
# backspace). A client may show results in a terminal, and the code must not be able to
# repaint or hide what the user reads there.
_CONTROL_CHARS = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"  # C0 and C1 controls but tab, newline, CR
_TERMINAL_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC, ended by BEL or ST
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC
    r"|\x1b[@-_]?"  # any other escape, or a lone ESC
    r"|" + _CONTROL_CHARS
)
_CONTROL_CHAR = re.compile(_CONTROL_CHARS)


def clean_text(text: str) -> str:
    """``text`` as the model and the client should see it: valid Unicode (lone
    surrogates, from a ``repr`` or a non-UTF-8 file name, become ``\\udcff``; JSON cannot
    carry them and the SDK's writer would fail on them and end the server), line
    breaks as ``\\n`` (a lone ``\\r`` could overwrite a line on a terminal), and no
    terminal control sequences."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _TERMINAL_CONTROL.sub("", text)


def escape_controls(text: str, escape: Callable[[str], str]) -> str:
    """``text`` with each control character clean_text would drop replaced by
    ``escape(char)``, where dropping would change what the text means (a URI, JSON)."""
    return _CONTROL_CHAR.sub(lambda match: escape(match.group()), text)


def terminal_json(text: str) -> str:
    """JSON text (json.dumps escapes C0 itself) with DEL and C1 escaped too: the same
    value, nothing a terminal acts on."""
    return escape_controls(text, lambda char: "\\u%04x" % ord(char))


# =============================================================================
# errors
# =============================================================================


# Every exception class of the bridge, by the audience that reads its message:
#
#   Exception
#    +-- BridgeError                      the model reads it: what happened and what to do in the
#    |    |                               next run_python call (render_error, at the tool boundary)
#    |    +-- EngineUnavailableError     the container engine does not answer
#    |    |    +-- NoEngineError          none of the engines tried answers (.problems: why each)
#    |    +-- SandboxStartError           the container or its kernel did not start
#    |    |    +-- SandboxImageMissingError   ... and its image is not here (not retried at once)
#    |    +-- InvalidRequestError         run_python's arguments are unusable
#    |    +-- ConfigurationUnusableError  a bad setting: run_python cannot run anything
#    |    +-- ShuttingDownError           a stop signal arrived during the call
#    |    +-- ServerUnavailableError      a configured MCP server did not start, or died
#    |    |    +-- LoginRequiredError     it wants an OAuth login: the link to open
#    |    |    +-- PersonalLoginError     it wants a login on a bridge of several principals: served
#    |    |                               again by the principal's own connection (never shown)
#    |    |    +-- OversizedMessageError  it sent a message over the cap (handed to its client
#    |    |                               session as a stream item, never raised)
#    |    +-- ProxyError                  a request from the sandbox the bridge refuses or cannot serve
#    |    |    +-- ApprovalDeniedError    the user denied a call, or was not asked (runtime.ApprovalDenied)
#    |    |    +-- ToolCallCapError       a run_python call made MCP_BRIDGE_MAX_TOOL_CALLS proxied calls
#    |    +-- MemoryStoreError            the memory store refuses or cannot serve a request
#    |    +-- TooManySessionsError        a new session while MCP_BRIDGE_MAX_SESSIONS hold sandboxes
#    |    +-- TooManyCallsError           a principal's run_python calls in flight are at their cap
#    |    +-- UnauthenticatedError        an HTTP request without the principal auth sets
#    |    |    +-- TokenRefusedError      an access token not taken: why, for the log (never raised
#    |    |                               past the token check, which answers 401)
#    |    +-- TooManyMcpSessionsError     a principal's MCP sessions are at their cap
#    +-- CommandError (.status)           a person at a terminal reads it: what to run or set there;
#         |                               main() prints it once and exits with its status
#         +-- ConfigError (status 2)      a bad setting: the flag or variable and what it accepts
#         +-- AdoptError                  adopt refuses, having changed nothing
#              +-- ConfigChangedError     a file changed between adopt's read and its write
#
# A failure both audiences meet keeps one fact and each layer phrases it: NoEngineError
# carries .problems, which the model reads with "call run_python again" and the command
# line with "run this command again" (engine_problem); a ConfigError reaches the model
# through misconfigured_message; a MemoryStoreError's facts suit both as they are.


class BridgeError(Exception):
    """Root of the errors the model reads. The message is written for the model: what
    happened and what to do next. Rendered once, at the tool boundary, or raised in the
    sandbox's code as the kernel's ``sandbox_error`` class (one of its ERROR_TYPES)."""

    sandbox_error: ClassVar[str] = "MCPError"

    def for_sandbox(self) -> ErrorInfo:
        """The error of a response frame that raises it in the sandbox's code."""
        return {"type": self.sandbox_error, "message": str(self)}


class EngineUnavailableError(BridgeError):
    """No container runtime answers."""


class NoEngineError(EngineUnavailableError):
    """None of the engines tried answers. The message is the model's; ``problems`` (why
    each engine failed) lets the command line say the same in its own words."""

    def __init__(self, message: str, problems: Sequence[str]) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class SandboxStartError(BridgeError):
    """The container did not start or the kernel did not say hello in time."""


class SandboxImageMissingError(SandboxStartError):
    """The container did not start, and its image is not on this machine (not found, or
    the pull failed): the one start failure that is not retried at once."""


class InvalidRequestError(BridgeError):
    """The model's arguments to run_python are unusable."""


class ConfigurationUnusableError(BridgeError):
    """The bridge's own settings are invalid: run_python cannot run anything (see main())."""


class ShuttingDownError(BridgeError):
    """The bridge received SIGTERM/SIGINT while the call was in flight."""


class ServerUnavailableError(BridgeError):
    """A configured MCP server could not be started, or died."""


class LoginRequiredError(ServerUnavailableError):
    """A proxied HTTP server wants an OAuth login that has not happened yet: the message
    carries the link the user opens; ``login`` is its ServerLogin."""

    def __init__(self, message: str, login: object = None) -> None:
        super().__init__(message)
        self.login = login


class PersonalLoginError(ServerUnavailableError):
    """A shared connection's server wants a login: each principal logs in on its own."""


class OversizedMessageError(ServerUnavailableError):
    """A server sent a message over the size cap; it was discarded unread. Handed to the
    server's ClientSession as a stream item (the connection then restarts), never raised."""


class ProxyError(BridgeError):
    """A request from the sandbox that the bridge refuses or cannot serve."""


class ApprovalDeniedError(ProxyError):
    """A proxied call that needed the user's approval did not get it (denied, declined,
    unanswered, or no one could be asked): the tool was not called. The code can catch it
    as runtime.ApprovalDenied, which names the server (its alias) and the tool."""

    sandbox_error = mcp_sandbox_kernel.APPROVAL_DENIED

    def __init__(self, message: str, server: str, tool: str) -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool

    def for_sandbox(self) -> ErrorInfo:
        return {**super().for_sandbox(), "server": self.server, "tool": self.tool}


class ToolCallCapError(ProxyError):
    """A run_python call made MCP_BRIDGE_MAX_TOOL_CALLS proxied calls already."""


class MemoryStoreError(BridgeError):
    """A memory request the store refuses (bad key, value too large) or cannot serve. The
    memory and tools commands show the same message (its facts suit a terminal too)."""


class TooManySessionsError(BridgeError):
    """A call named a new session while MCP_BRIDGE_MAX_SESSIONS sessions hold sandboxes."""


class TooManyCallsError(BridgeError):
    """An HTTP principal has MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL run_python calls in flight."""


class UnauthenticatedError(BridgeError):
    """An HTTP request reached a handler without the principal the auth middleware sets."""


class TokenRefusedError(UnauthenticatedError):
    """Why an access token is not taken (logged, never with the token)."""


class TooManyMcpSessionsError(BridgeError):
    """An HTTP principal holds MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL MCP sessions and sent
    another initialize."""


class CommandError(Exception):
    """Root of the errors a person at a terminal reads (the subcommands, the server's own
    start): what to run or set there. main() prints it once, as one line on stderr after
    the command's name, and exits with ``status`` (1: refused or failed, 2: a bad command
    line or setting)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class ConfigError(CommandError):
    """A bad setting; the message names the variable and the accepted values. Exit status 2;
    over stdio, the model hears of it through misconfigured_message."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message, status)


class AdoptError(CommandError):
    """adopt refuses, having changed nothing (or says what it could not finish)."""


class ConfigChangedError(AdoptError):
    """A file changed between adopt's read and its write: its client may be running."""


SHUTTING_DOWN = (
    "The MCP server is shutting down (it received a stop signal), so this call was not completed. "
    "If the client restarts the server, call run_python again; earlier state is gone."
)


# =============================================================================
# configuration
# =============================================================================

EngineName = Literal["podman", "docker", "kubernetes"]
KernelDelivery = Literal["auto", "mount", "stdin"]
FrameChannel = Literal["auto", "stdio"]
OutputMode = Literal["compact", "toon"]
ServeTransport = Literal["stdio", "http"]
ProjectServers = Literal["trusted", "all", "none"]
ApprovalMode = Literal["writes", "all", "none"]  # which proxied tool calls ask the user first
ApprovalFallback = Literal["allow", "deny"]  # what a call that would ask does where no one can be asked
CallLogMode = Literal["meta", "full", "off"]  # what the call log keeps of each proxied call

# JSON data as json.loads returns it: what config files, engines, MCP servers and the
# sandbox send until a check or a model narrows it, and what json.dumps sends back out.
JSON: TypeAlias = "dict[str, JSON] | list[JSON] | str | int | float | bool | None"


def json_field(value: object, *path: str) -> object:
    """``value[path[0]][path[1]]...`` while each step is a JSON object holding the key; else None."""
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class Workspace:
    """MCP_BRIDGE_WORKSPACE: a host folder mounted at /workspace instead of the in-memory
    one (``PATH``, or ``PATH:ro`` read-only). The only writable host mount, and only when
    the user chooses it. ``path`` is absolute and resolved (no symbolic links)."""

    path: Path
    read_only: bool = False


# HTTP principals: who a bearer token says the caller is. A name becomes a directory
# (STATE_DIR/principals/<name>/), so it never starts with a dot ("..", ".hidden").
PRINCIPAL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
PRINCIPAL_NAME_RULE = "1-64 characters of A-Z, a-z, 0-9, _, - and . (not first)"
MIN_TOKEN_CHARS = 16


def token_digest(token: str) -> bytes:
    """SHA-256 of a bearer token: what is kept and compared instead of the token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class AuthTokens:
    """MCP_BRIDGE_AUTH_TOKENS: the bearer tokens of the HTTP transport, read once at
    start-up. Only each token's SHA-256 is kept, beside the principal it names."""

    path: Path
    digests: tuple[tuple[bytes, str], ...]  # (sha256 of the token, principal)

    @property
    def principals(self) -> frozenset[str]:
        return frozenset(principal for _, principal in self.digests)

    def principal_of(self, token: str) -> str | None:
        """The principal whose token this is, or None. Compares digests in constant time
        and always against every entry, so the time taken says nothing about which token
        (or how much of one) matched."""
        digest = token_digest(token)
        found = None
        for known, principal in self.digests:
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def parse_auth_tokens(text: str) -> tuple[tuple[bytes, str], ...]:
    """A token file's lines, ``TOKEN PRINCIPAL`` each (``#`` comments and blank lines
    allowed), as (sha256 of the token, principal). ValueError naming the first bad line."""
    digests: dict[bytes, tuple[str, int]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) != 2:
            raise ValueError(
                "line %d: expected `TOKEN PRINCIPAL` (two words separated by spaces), got %d word%s"
                % (number, len(fields), "" if len(fields) == 1 else "s")
            )
        token, principal = fields
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                "line %d: the token is %d characters; use at least %d random ones "
                "(e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
                % (number, len(token), MIN_TOKEN_CHARS)
            )
        if not PRINCIPAL_NAME_PATTERN.fullmatch(principal):
            raise ValueError(
                "line %d: the principal %s is not %s" % (number, ascii(principal[:70]), PRINCIPAL_NAME_RULE)
            )
        digest = token_digest(token)
        if digest in digests:
            raise ValueError("line %d: the same token as line %d" % (number, digests[digest][1]))
        digests[digest] = (principal, number)
    if not digests:
        raise ValueError("the file has no `TOKEN PRINCIPAL` line")
    return tuple((digest, principal) for digest, (principal, _) in digests.items())


def _auth_tokens(text: str) -> AuthTokens:
    path = Path(text).expanduser()
    try:
        data = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError("cannot read it: %s" % exc) from None
    return AuthTokens(path, parse_auth_tokens(data))


def is_loopback_host(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only: "localhost", 127.0.0.0/8
    or ::1. Any other name or address (0.0.0.0, "", a LAN address) reaches further."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class BridgeConfig:
    """Every setting, read once in main() and passed down; nothing reads the
    environment after start-up."""

    runtime: EngineName | None = None
    image: str = "python:3.14-slim"
    timeout: float = 30.0
    max_timeout: float = 3600.0
    state_dir: Path = field(default_factory=lambda: Path("~/MCPs").expanduser())
    output_mode: OutputMode = "compact"
    memory: str = "512m"
    pids: int = 128
    cpus: float = 1.0
    container_user: str = "65534:65534"
    idle_timeout: float = 3600.0
    prewarm: bool = True
    max_sessions: int = 8
    max_output_chars: int = mcp_sandbox_kernel.DEFAULT_MAX_OUTPUT
    max_frame_bytes: int = 32 * 1024 * 1024
    start_timeout: float = 120.0
    interrupt_grace: float = 3.0
    log_level: str = "INFO"
    servers_config: Path | None = None
    allow_servers: tuple[str, ...] = ()
    deny_servers: tuple[str, ...] = ()
    allow_tools: tuple[str, ...] = ()
    deny_tools: tuple[str, ...] = ()
    approve: ApprovalMode = "writes"
    approve_tools: tuple[str, ...] = ()
    allow_tools_without_asking: tuple[str, ...] = ()
    approval_timeout: float = 300.0
    approve_fallback: ApprovalFallback = "allow"
    max_tool_calls: int = 1000
    call_log: CallLogMode = "meta"
    server_start_timeout: float = 30.0
    tool_timeout: float = 120.0
    pass_env: tuple[str, ...] = ()
    max_tool_result_bytes: int = 16 * 1024 * 1024
    oci_runtime: str | None = None
    kernel_delivery: KernelDelivery = "auto"
    frame_channel: FrameChannel = "auto"
    kube_namespace: str | None = None  # None: kubectl's current namespace
    kube_context: str | None = None  # None: kubectl's current context
    kube_runtime_class: str | None = None  # e.g. gvisor
    allow_root: bool = False
    discover: bool = True
    project_servers: ProjectServers = "trusted"
    max_memory_bytes: int = 1024 * 1024
    max_memory_total_bytes: int = 100 * 1024 * 1024
    max_memories: int = 10_000
    max_images: int = 10
    max_image_bytes: int = 2 * 1024 * 1024
    max_attachment_bytes: int = 5_000_000
    respond_after: float | None = None  # None: what the calling client can wait (respond_after_for)
    workspace: Workspace | None = None
    transport: ServeTransport = "stdio"
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None  # None: http://HOST:PORT
    auth_tokens: AuthTokens | None = None
    oauth_issuer: str | None = None  # the HTTP transport takes this issuer's access tokens
    oauth_resource: str | None = None  # None: PUBLIC_URL/mcp
    oauth_principal_claim: str = "sub"
    oauth_scopes: tuple[str, ...] = ()
    oauth_client_id: str | None = None  # the bridge's own client at the issuer: token introspection
    oauth_client_secret_file: Path | None = None
    max_calls_per_principal: int = 8
    max_total_sessions: int = 32
    max_mcp_sessions_per_principal: int = 16
    mcp_session_idle_timeout: float = 300.0
    http_request_timeout: float = 10.0
    http_max_connections: int = 256

    @property
    def names_principals(self) -> bool:
        """Whether callers over HTTP are told apart (a token file, an OAuth issuer): then each
        principal has its own store and sandboxes; else every caller is this machine's user."""
        return self.transport == "http" and (self.auth_tokens is not None or self.oauth_issuer is not None)

    @property
    def base_url(self) -> str:
        """The HTTP bridge's address as browsers and clients reach it (MCP_BRIDGE_PUBLIC_URL)."""
        if self.public_url is not None:
            return self.public_url
        host = self.host if ":" not in self.host or self.host.startswith("[") else "[%s]" % self.host
        return "http://%s:%d" % (host, self.port)


Number = TypeVar("Number", int, float)
_Result = TypeVar("_Result")
_Args = TypeVarTuple("_Args")


def _number(
    text: str, kind: Callable[[str], Number], expected: str, valid: Callable[[Number], bool]
) -> Number:
    """``text`` as ``kind`` when ``valid``; else a ValueError saying what is expected
    (float()'s own "could not convert string to float" says only what is wrong)."""
    try:
        value = kind(text.replace("_", "") if kind is int else text)
    except ValueError:
        raise ValueError("must be " + expected) from None
    if (isinstance(value, float) and not math.isfinite(value)) or not valid(value):
        raise ValueError("must be " + expected)
    return value


def _positive_float(text: str) -> float:
    return float(_number(text, float, "a positive number such as 30 or 0.5", lambda value: value > 0))


def _non_negative_float(text: str) -> float:
    return float(_number(text, float, "zero or a positive number such as 30", lambda value: value >= 0))


def _positive_int(text: str) -> int:
    return int(_number(text, int, "a positive whole number such as 128", lambda value: value > 0))


def _port(text: str) -> int:
    return int(_number(text, int, "a port number, 1-65535", lambda value: 1 <= value <= 65535))


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


def _existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError("no such file")
    return path


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _web_url(text: str) -> str:
    """An https URL, or http to a loopback host (a local authorization server, tests)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("must be an https URL without a query (e.g. https://login.example.com/)")
    if parts.scheme == "http" and not is_loopback_host(parts.hostname):
        raise ValueError("must be https (http only to a loopback address)")
    return text


def _public_url(text: str) -> str:
    """An http(s) URL without a query, kept without a trailing "/" (paths are added to it)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("must be an http(s) URL without a query (e.g. https://bridge.example.com)")
    return text.rstrip("/")


def _env_names(text: str) -> tuple[str, ...]:
    names = _patterns(text)
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\*?", name):
            raise ValueError(
                "each entry is a variable name (e.g. GITHUB_TOKEN) or a prefix ending in * (e.g. AWS_*); "
                "%s is neither" % ascii(name[:60])
            )
    return names


def _tool_patterns(text: str) -> tuple[str, ...]:
    patterns = _patterns(text)
    for pattern in patterns:
        if "." not in pattern:
            # A bare "write_*" would match no "server.tool" name: the rule would do nothing.
            raise ValueError("each entry is server.tool (e.g. filesystem.write_*); %r has no dot" % pattern)
    return patterns


# Folders of the system itself: an engine's socket lives under /run, devices under /dev.
REFUSED_WORKSPACE_ROOTS = tuple(Path(root) for root in ("/proc", "/sys", "/dev", "/run", "/var/run"))


def _workspace(text: str) -> Workspace:
    raw, read_only = (text[: -len(":ro")], True) if text.endswith(":ro") else (text, False)
    path = Path(os.path.expandvars(raw)).expanduser()
    if not path.is_absolute():
        raise ValueError("must be an absolute path to a folder, optionally ending in :ro")
    if not path.is_dir():
        raise ValueError("%s is not a folder" % path if path.exists() else "no such folder: %s" % path)
    resolved = path.resolve()
    # Defense in depth: the sandbox may write and delete anything in the folder.
    choose = "; choose (or create) a folder just for the sandbox, e.g. ~/mcp-workspace"
    home = Path.home().resolve()
    if resolved == Path(resolved.anchor):
        raise ValueError("%s is the whole file system%s" % (resolved, choose))
    if resolved == home or resolved in home.parents:
        relation = "is" if resolved == home else "contains"
        raise ValueError("%s %s your home folder%s" % (resolved, relation, choose))
    if any(resolved == root or root in resolved.parents for root in REFUSED_WORKSPACE_ROOTS):
        raise ValueError("%s is a system folder (/proc, /sys, /dev, /run)%s" % (resolved, choose))
    if "," in str(resolved):
        raise ValueError("%s has a comma, which the engines' --mount option cannot carry" % resolved)
    return Workspace(resolved, read_only)


@dataclass(frozen=True)
class Option:
    """One setting: its config field, environment variable, flag and parser. The single
    table below drives parsing, --help and the docs' option list."""

    field: str
    env: str
    parse: Callable[[str], object]  # the field's value (BridgeConfig's type for it)
    help: str
    default_text: str = ""  # how --help and README show the default, where its value says too little

    @property
    def flag(self) -> str:
        """The variable's name without its prefix: MCP_BRIDGE_MAX_OUTPUT <-> --max-output."""
        name = self.env.removeprefix("MCP_BRIDGE_").removeprefix("MCP_")
        return "--" + name.lower().replace("_", "-")

    def shown_default(self, defaults: BridgeConfig) -> str:
        if self.default_text:
            return self.default_text
        value = getattr(defaults, self.field)
        if isinstance(value, bool):
            return str(value).lower()
        return "%g" % value if isinstance(value, float) else str(value)


OPTIONS: tuple[Option, ...] = (
    Option(
        "runtime",
        "MCP_BRIDGE_RUNTIME",
        _choice("podman", "docker", "kubernetes"),
        "container runtime; auto: Podman if it answers, else Docker; kubernetes: a Pod per session, "
        "through kubectl",
        "auto",
    ),
    Option(
        "image",
        "MCP_BRIDGE_IMAGE",
        _pattern(r"[\w./:@-]+", "an image reference"),
        "sandbox image; needs python3 >= 3.9",
    ),
    Option("timeout", "MCP_BRIDGE_TIMEOUT", _positive_float, "default per-call timeout, seconds"),
    Option("max_timeout", "MCP_BRIDGE_MAX_TIMEOUT", _positive_float, "largest timeout a call may ask for"),
    Option("state_dir", "MCP_BRIDGE_STATE_DIR", _directory, "bridge state directory", "~/MCPs"),
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
        "max_sessions",
        "MCP_BRIDGE_MAX_SESSIONS",
        _positive_int,
        "sandboxes (run_python session names) alive at once per client: over stdio the one client, "
        "over HTTP each principal",
    ),
    Option(
        "max_output_chars",
        "MCP_BRIDGE_MAX_OUTPUT",
        _positive_int,
        "characters of a result's text, shared by stdout, stderr and the value; a longer part keeps its "
        "head and tail around a marker, and a call's whole output is saved in /tmp/outputs",
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
    Option(
        "servers_config",
        "MCP_SERVERS_CONFIG",
        _existing_file,
        "MCP servers config file (mcpServers JSON); when set, the only source of servers",
        "none",
    ),
    Option(
        "allow_servers",
        "MCP_BRIDGE_ALLOW_SERVERS",
        _patterns,
        "comma-separated name patterns of servers the sandbox may use",
        "all",
    ),
    Option(
        "deny_servers",
        "MCP_BRIDGE_DENY_SERVERS",
        _patterns,
        "server name patterns to hide from the sandbox",
        "none",
    ),
    Option(
        "allow_tools",
        "MCP_BRIDGE_ALLOW_TOOLS",
        _tool_patterns,
        "comma-separated server.tool patterns the sandbox may call",
        "all",
    ),
    Option(
        "deny_tools",
        "MCP_BRIDGE_DENY_TOOLS",
        _tool_patterns,
        "server.tool patterns to hide and refuse, e.g. filesystem.write_*",
        "none",
    ),
    Option(
        "approve",
        "MCP_BRIDGE_APPROVE",
        _choice("writes", "all", "none"),
        "which proxied tool calls wait for the user's approval (asked through the MCP client): writes: "
        "every tool its server does not mark read-only (readOnlyHint); all: every call; none: no call",
    ),
    Option(
        "approve_tools",
        "MCP_BRIDGE_APPROVE_TOOLS",
        _tool_patterns,
        "server.tool patterns that always ask first, whatever MCP_BRIDGE_APPROVE says",
        "none",
    ),
    Option(
        "allow_tools_without_asking",
        "MCP_BRIDGE_ALLOW_TOOLS_WITHOUT_ASKING",
        _tool_patterns,
        "server.tool patterns that never ask (MCP_BRIDGE_APPROVE_TOOLS and MCP_BRIDGE_DENY_TOOLS still win)",
        "none",
    ),
    Option(
        "approval_timeout",
        "MCP_BRIDGE_APPROVAL_TIMEOUT",
        _positive_float,
        "seconds to wait for the user's answer to an approval; then the call is denied",
    ),
    Option(
        "approve_fallback",
        "MCP_BRIDGE_APPROVE_FALLBACK",
        _choice("allow", "deny"),
        "a call that would ask, from a client that cannot ask (no elicitation): allow it (the "
        "result says so) or deny it",
    ),
    Option(
        "max_tool_calls",
        "MCP_BRIDGE_MAX_TOOL_CALLS",
        _positive_int,
        "proxied calls (tools, resources, prompts) one run_python call may make; more raise an error",
    ),
    Option(
        "call_log",
        "MCP_BRIDGE_CALL_LOG",
        _choice("meta", "full", "off"),
        "the log of proxied calls (STATE_DIR/calls.jsonl; read it with the calls command): meta: "
        "who, what, when, sizes, digests and decisions; full: the arguments and results too; off",
    ),
    Option(
        "server_start_timeout",
        "MCP_BRIDGE_SERVER_START_TIMEOUT",
        _positive_float,
        "seconds an MCP server may take to start and initialize",
    ),
    Option(
        "tool_timeout", "MCP_BRIDGE_TOOL_TIMEOUT", _positive_float, "seconds one proxied tool call may take"
    ),
    Option(
        "pass_env",
        "MCP_BRIDGE_PASS_ENV",
        _env_names,
        "comma-separated variables (or PREFIX_* patterns) of the bridge's environment that stdio MCP "
        "servers get, besides the CA, proxy and locale ones they always get",
        "none",
    ),
    Option(
        "discover",
        "MCP_BRIDGE_DISCOVER",
        _boolean,
        "read MCP clients' config files for servers (0: only MCP_SERVERS_CONFIG or the state dir's *.json)",
    ),
    Option(
        "project_servers",
        "MCP_BRIDGE_PROJECT_SERVERS",
        _choice("trusted", "all", "none"),
        "servers of the project's own files (.mcp.json, .cursor/mcp.json, .vscode/mcp.json in the working "
        "directory); trusted: only those its client records as trusted (Claude Code), the rest are listed, "
        "not started; all: every one; none: those files are not read",
    ),
    Option(
        "allow_root",
        "MCP_BRIDGE_ALLOW_ROOT",
        _boolean,
        "allow MCP_BRIDGE_CONTAINER_USER to be root (refused otherwise)",
    ),
    Option(
        "oci_runtime",
        "MCP_BRIDGE_OCI_RUNTIME",
        _pattern(r"[\w./-]+", "an OCI runtime name such as runsc, or its path"),
        "OCI runtime for the sandbox, e.g. runsc (gVisor)",
        "the engine's",
    ),
    Option(
        "kernel_delivery",
        "MCP_BRIDGE_KERNEL_DELIVERY",
        _choice("auto", "mount", "stdin"),
        "how the kernel reaches the sandbox: a read-only mount, or its stdin (engines that cannot see "
        "this machine's files); auto: stdin for a remote engine (DOCKER_HOST, CONTAINER_HOST, ...)",
    ),
    Option(
        "frame_channel",
        "MCP_BRIDGE_FRAME_CHANNEL",
        _choice("auto", "stdio"),
        "where frames between the bridge and the sandbox go: auto: a Unix socket in the IPC mount "
        "(Linux, a local engine), else the container's stdin/stdout; stdio: always stdin/stdout",
    ),
    Option(
        "kube_namespace",
        "MCP_BRIDGE_KUBE_NAMESPACE",
        _pattern(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", "a Kubernetes namespace name"),
        "Kubernetes: the namespace of the sandbox Pods",
        "kubectl's",
    ),
    Option(
        "kube_context",
        "MCP_BRIDGE_KUBE_CONTEXT",
        _pattern(r"[\w.@:/-]+", "a kubeconfig context name"),
        "Kubernetes: the kubeconfig context (cluster and user)",
        "kubectl's",
    ),
    Option(
        "kube_runtime_class",
        "MCP_BRIDGE_KUBE_RUNTIME_CLASS",
        _pattern(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", "a RuntimeClass name"),
        "Kubernetes: the Pods' runtimeClassName, e.g. gvisor",
        "the cluster's",
    ),
    Option(
        "max_memory_bytes",
        "MCP_BRIDGE_MAX_MEMORY_BYTES",
        _positive_int,
        "largest memory (save_memory): bytes of its value's and metadata's JSON together",
    ),
    Option(
        "max_memory_total_bytes",
        "MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES",
        _positive_int,
        "largest total of all memories (keys, values, metadata and 256 bytes each), bytes of JSON",
    ),
    Option(
        "max_memories",
        "MCP_BRIDGE_MAX_MEMORIES",
        _positive_int,
        "most memories the store holds (save_memory of a new key beyond it is refused)",
    ),
    Option(
        "max_tool_result_bytes",
        "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES",
        _positive_int,
        "largest tool result passed into the sandbox, bytes",
    ),
    Option(
        "max_images", "MCP_BRIDGE_MAX_IMAGES", _positive_int, "images one call may return (plots, display())"
    ),
    Option(
        "max_image_bytes",
        "MCP_BRIDGE_MAX_IMAGE_BYTES",
        _positive_int,
        "largest image a call may return, bytes",
    ),
    Option(
        "respond_after",
        "MCP_BRIDGE_RESPOND_AFTER",
        _non_negative_float,
        "answer with 'still running' after this many seconds (Claude Desktop gives up at about 60); "
        "the code goes on; 0 = wait for the end; unset: by the client (Claude Code 0, Codex 240, else 45)",
        default_text="45 (Claude Code: 0, Codex: 240)",
    ),
    Option(
        "max_attachment_bytes",
        "MCP_BRIDGE_MAX_ATTACHMENT_BYTES",
        _positive_int,
        "largest file runtime.attach() may return, bytes",
    ),
    Option(
        "workspace",
        "MCP_BRIDGE_WORKSPACE",
        _workspace,
        "host folder mounted at /workspace (PATH, or PATH:ro for read-only), kept across resets; "
        "the sandbox runs as its owner",
        "none (in memory)",
    ),
    Option(
        "transport",
        "MCP_BRIDGE_TRANSPORT",
        _choice("stdio", "http"),
        "how clients connect: stdio (one client) or http (streamable HTTP at /mcp, many clients)",
    ),
    Option(
        "host",
        "MCP_BRIDGE_HOST",
        _pattern(r"[A-Za-z0-9._:-]+|\[[0-9A-Fa-f:.]+\]", "a host name or an IP address"),
        "address the HTTP transport listens on; any but loopback needs MCP_BRIDGE_AUTH_TOKENS",
    ),
    Option("port", "MCP_BRIDGE_PORT", _port, "port the HTTP transport listens on"),
    Option(
        "public_url",
        "MCP_BRIDGE_PUBLIC_URL",
        _public_url,
        "the HTTP bridge's address as people's browsers and clients reach it (behind a proxy: the "
        "public one): where their logins to proxied OAuth servers come back (PUBLIC_URL/oauth/callback)",
        "http://HOST:PORT",
    ),
    Option(
        "auth_tokens",
        "MCP_BRIDGE_AUTH_TOKENS",
        _auth_tokens,
        "file of `TOKEN PRINCIPAL` lines: the HTTP transport's bearer tokens; each principal has "
        "its own sessions, memory and saved tools",
        "none",
    ),
    Option(
        "oauth_issuer",
        "MCP_BRIDGE_OAUTH_ISSUER",
        _web_url,
        "the HTTP transport also takes OAuth access tokens (JWTs) of this authorization server, "
        "checked against its JWKS; their principal is a claim (MCP_BRIDGE_OAUTH_PRINCIPAL_CLAIM)",
        "none",
    ),
    Option(
        "oauth_resource",
        "MCP_BRIDGE_OAUTH_RESOURCE",
        _web_url,
        "this bridge's MCP URL as its clients reach it (behind a proxy: the public one): the "
        "audience its access tokens must name",
        "PUBLIC_URL/mcp",
    ),
    Option(
        "oauth_principal_claim",
        "MCP_BRIDGE_OAUTH_PRINCIPAL_CLAIM",
        _pattern(r"[A-Za-z0-9_.:/-]{1,100}", "a claim name such as sub, email or preferred_username"),
        "the access token's claim that names its principal",
    ),
    Option(
        "oauth_scopes",
        "MCP_BRIDGE_OAUTH_SCOPES",
        _patterns,
        "scopes an access token must carry (comma-separated)",
        "none",
    ),
    Option(
        "oauth_client_id",
        "MCP_BRIDGE_OAUTH_CLIENT_ID",
        _pattern(r"[\x21-\x7e]{1,200}", "a client id (printable, no spaces)"),
        "the bridge's own client at the issuer, with MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE: access "
        "tokens that are not JWTs are checked at the issuer's introspection endpoint (RFC 7662)",
        "none",
    ),
    Option(
        "oauth_client_secret_file",
        "MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE",
        _existing_file,
        "file holding that client's secret",
        "none",
    ),
    Option(
        "max_calls_per_principal",
        "MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL",
        _positive_int,
        "run_python calls one HTTP principal may have in flight at once",
    ),
    Option(
        "max_total_sessions",
        "MCP_BRIDGE_MAX_TOTAL_SESSIONS",
        _positive_int,
        "sandboxes alive at once over HTTP, all principals together",
    ),
    Option(
        "max_mcp_sessions_per_principal",
        "MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL",
        _positive_int,
        "MCP sessions (initialize handshakes) one HTTP principal may hold open at once",
    ),
    Option(
        "mcp_session_idle_timeout",
        "MCP_BRIDGE_MCP_SESSION_IDLE_TIMEOUT",
        _positive_float,
        "close an HTTP MCP session after this many seconds without a request (its client "
        "initializes again); its sandboxes keep their own MCP_BRIDGE_IDLE_TIMEOUT",
    ),
    Option(
        "http_request_timeout",
        "MCP_BRIDGE_HTTP_REQUEST_TIMEOUT",
        _positive_float,
        "seconds an HTTP client has to send a whole request (headers and body); slower ones are cut off",
    ),
    Option(
        "http_max_connections",
        "MCP_BRIDGE_HTTP_MAX_CONNECTIONS",
        _positive_int,
        "HTTP connections open at once; one more closes the slowest unfinished request, or is "
        "answered 503 at once when all are serving requests",
    ),
)


class _LineHelpFormatter(argparse.HelpFormatter):
    """Fills each line of a description or epilog on its own, at its own indent: a list
    stays a list."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines = []
        for line in text.split("\n"):
            margin = indent + " " * (len(line) - len(line.lstrip(" ")))
            lines.append(super()._fill_text(line, width, margin))
        return "\n".join(lines)


class _ConfigArgumentParser(argparse.ArgumentParser):
    """A command line argparse cannot read (an unknown flag, a flag without its value) is
    a ConfigError like a bad value, not argparse's usage-and-exit: started by an MCP client,
    the bridge answers with it (see main()). --help and --version still exit 0."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            "the command line is invalid: %s; `%s --help` lists the flags" % (message, self.prog)
        )


def build_arg_parser() -> argparse.ArgumentParser:
    defaults = BridgeConfig()
    parser = _ConfigArgumentParser(
        prog=SERVER_NAME,
        description="MCP server (stdio, or streamable HTTP with --transport http) with one tool, "
        "run_python, that runs code in a persistent, hardened Podman/Docker sandbox. Each option can "
        "also be set by the environment variable shown; the flag wins.",
        epilog="Other commands (%(prog)s COMMAND ...; each has --help):\n"
        "  memory list|get KEY|delete KEY|export: what the agent saved, without the agent\n"
        "  adopt --client CLIENT [--dry-run] [--undo] [--env K=V]: hand a client's servers to the bridge\n"
        "  doctor [--json]: check engine, limits, image, sandbox, configs and servers by starting each once\n"
        "  build-image [--packages A,B] [--tag TAG]: a sandbox image with more Python packages",
        formatter_class=_LineHelpFormatter,
    )
    parser.add_argument("--version", action="version", version="%(prog)s " + __version__)
    for option in OPTIONS:
        parser.add_argument(
            option.flag,
            dest=option.field,
            metavar=option.field.upper(),
            default=None,
            help="%s [env %s; default: %s]" % (option.help, option.env, option.shown_default(defaults)),
        )
    return parser


def _is_root(part: str) -> bool:
    """Whether a user or group of MCP_BRIDGE_CONTAINER_USER is root: "root", or 0 as a number."""
    try:
        return part == "root" or int(part) == 0
    except ValueError:
        return False


def _check_kubernetes(config: BridgeConfig) -> None:
    """Settings the Kubernetes backend cannot honour are an error, not silently dropped."""
    if config.workspace is not None:
        raise ConfigError(
            "MCP_BRIDGE_WORKSPACE cannot be used with MCP_BRIDGE_RUNTIME=kubernetes: a Pod cannot mount a "
            "folder of this machine; unset it (the Pod's /workspace is in memory)"
        )
    if config.kernel_delivery == "mount":
        raise ConfigError(
            "MCP_BRIDGE_KERNEL_DELIVERY=mount cannot be used with MCP_BRIDGE_RUNTIME=kubernetes: a Pod "
            "cannot see this machine's files, so the kernel always arrives on its stdin; unset it"
        )
    if config.oci_runtime is not None:
        raise ConfigError(
            "MCP_BRIDGE_OCI_RUNTIME is for Podman and Docker; with MCP_BRIDGE_RUNTIME=kubernetes use "
            "MCP_BRIDGE_KUBE_RUNTIME_CLASS (e.g. gvisor) instead"
        )
    ids = config.container_user.split(":")
    if len(ids) != 2 or not all(part.isdigit() and int(part) > 0 for part in ids):
        raise ConfigError(
            "MCP_BRIDGE_CONTAINER_USER=%s: with MCP_BRIDGE_RUNTIME=kubernetes it must be a non-root UID:GID "
            "in numbers (e.g. 65534:65534): Pods run with runAsNonRoot" % config.container_user
        )


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
    if config.max_tool_result_bytes > config.max_frame_bytes // 2:
        raise ConfigError(
            "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES (%d) must be at most half of MCP_BRIDGE_MAX_FRAME_BYTES (%d): "
            "a result must fit in one frame" % (config.max_tool_result_bytes, config.max_frame_bytes)
        )
    user, _, group = config.container_user.partition(":")
    # Defense in depth: root is uid or gid 0 however it is written ("00", "000:0").
    rooted = ["%s %r" % (what, part) for what, part in (("user", user), ("group", group)) if _is_root(part)]
    if rooted and not config.allow_root:
        raise ConfigError(
            "MCP_BRIDGE_CONTAINER_USER=%s would run the sandbox with root's privileges (%s is root); use "
            "an unprivileged user and group (the default is 65534:65534), or set MCP_BRIDGE_ALLOW_ROOT=1 "
            "if you really mean it" % (config.container_user, " and ".join(rooted))
        )
    if config.timeout > config.max_timeout:
        raise ConfigError(
            "MCP_BRIDGE_TIMEOUT (%g) must not exceed MCP_BRIDGE_MAX_TIMEOUT (%g)"
            % (config.timeout, config.max_timeout)
        )
    if config.runtime == "kubernetes":
        _check_kubernetes(config)
    if config.oauth_issuer is None and (
        config.oauth_resource is not None
        or config.oauth_scopes
        or config.oauth_principal_claim != "sub"
        or config.oauth_client_id is not None
        or config.oauth_client_secret_file is not None
    ):
        raise ConfigError(
            "MCP_BRIDGE_OAUTH_RESOURCE, _SCOPES, _PRINCIPAL_CLAIM, _CLIENT_ID and _CLIENT_SECRET_FILE need "
            "MCP_BRIDGE_OAUTH_ISSUER (the authorization server whose tokens the bridge takes)"
        )
    if (config.oauth_client_id is None) != (config.oauth_client_secret_file is None):
        raise ConfigError(
            "MCP_BRIDGE_OAUTH_CLIENT_ID and MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE go together: the bridge's "
            "client at the issuer, which introspects tokens that are not JWTs"
        )
    if config.public_url is not None and config.transport != "http":
        raise ConfigError("MCP_BRIDGE_PUBLIC_URL is for the HTTP transport (--transport http)")
    if config.oauth_issuer is not None and config.transport != "http":
        raise ConfigError(
            "MCP_BRIDGE_OAUTH_ISSUER is for the HTTP transport (--transport http); over stdio the client "
            "that starts the bridge is its only user"
        )
    if (
        config.transport == "http"
        and config.auth_tokens is None
        and config.oauth_issuer is None
        and not is_loopback_host(config.host)
    ):
        # Defense in depth: whoever reaches the port runs code and calls the user's MCP servers.
        raise ConfigError(
            "MCP_BRIDGE_HOST=%s is not a loopback address, so anyone who can reach it could run code and "
            "use your MCP servers; refusing to start without bearer tokens. Set MCP_BRIDGE_AUTH_TOKENS to "
            'a file of `TOKEN PRINCIPAL` lines (README: "A shared bridge over HTTP"), or listen on '
            "127.0.0.1 (behind a reverse proxy for TLS)." % config.host
        )
    if config.workspace is not None:
        # Defense in depth: the state directory holds the launch files (kernel, seccomp profile).
        state_dir = config.state_dir.resolve()
        if config.workspace.path in (state_dir, *state_dir.parents):
            raise ConfigError(
                "MCP_BRIDGE_WORKSPACE=%s contains the bridge's state directory %s (MCP_BRIDGE_STATE_DIR): "
                "the sandbox could rewrite its own launch files, memories and saved tools; choose a folder "
                "outside it" % (config.workspace.path, state_dir)
            )
    return config


@dataclass(frozen=True)
class ClientProfile:
    """How one MCP client hands a run_python result to its model, and so what the bridge
    sends it: by clientInfo.name (CLIENT_PROFILES). Measured through the real CLIs, driven
    by a scripted model API that records what the model received (../shared/clients).

    ``respond_after``: seconds before a "still running" answer (0: the end), unless
    MCP_BRIDGE_RESPOND_AFTER says otherwise. ``structured``: send structuredContent beside
    the text; a client that then shows the model only that JSON (escaped, the text
    dropped) gets the text alone. ``error_images``: whether an isError result keeps its
    images; where not, a failed run with images is sent without the flag (its text says
    it failed). ``max_output_chars``: where the client cuts a result's text itself (in the
    middle, marker and all): the bridge's own budget stays under it. ``attached_images``:
    an image file from runtime.attach goes as an image block, not as an embedded resource
    the client would hand the model as base64 text."""

    respond_after: float = 45.0
    structured: bool = True
    error_images: bool = True
    max_output_chars: int | None = None
    attached_images: bool = False


# Claude Code (2.1.197, 2.1.332): waits about 27.8 h for a tool over stdio (MCP_TOOL_TIMEOUT
# lowers it), so it gets the end; shows the model JSON.stringify(structuredContent) instead
# of the text when both are there; drops the images of an isError result; shows an embedded
# image as an image after an empty "[Resource from ...]" text. Codex (0.171.0):
# waits 300 s (tool_timeout_sec); shows structuredContent as JSON, errors included; cuts a
# text over about 12,000 characters in the middle; shows an embedded PNG as base64 text.
# Everyone else: what the spec's reading gives (both forms), and 45 s: Claude Desktop gives
# up at about 60. A user who lowered a client's timeout sets MCP_BRIDGE_RESPOND_AFTER below it.
CLIENT_PROFILES: Mapping[str, ClientProfile] = MappingProxyType(
    {
        "claude-code": ClientProfile(
            respond_after=0.0, structured=False, error_images=False, attached_images=True
        ),
        "codex-mcp-client": ClientProfile(
            respond_after=240.0, structured=False, max_output_chars=10_000, attached_images=True
        ),
    }
)
DEFAULT_CLIENT = ClientProfile()


def client_profile(client: str | None) -> ClientProfile:
    """The profile of the client named ``client`` (clientInfo.name), or the default."""
    return CLIENT_PROFILES.get(client or "", DEFAULT_CLIENT)


def respond_after_for(config: BridgeConfig, client: str | None) -> float:
    """Seconds after which a call of ``client`` answers "still running" (0: at the end)."""
    if config.respond_after is not None:
        return config.respond_after
    return client_profile(client).respond_after


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def server_allowed(name: str, config: BridgeConfig) -> bool:
    if config.allow_servers and not _matches(name, config.allow_servers):
        return False
    return not _matches(name, config.deny_servers)


def tool_allowed(server: str, tool: str, config: BridgeConfig) -> bool:
    """Tool patterns match "server.tool" (e.g. "filesystem.write_*", "*.delete_*")."""
    qualified = "%s.%s" % (server, tool)
    if config.allow_tools and not _matches(qualified, config.allow_tools):
        return False
    return not _matches(qualified, config.deny_tools)


def _read_only(tool: types.Tool) -> bool:
    """Whether a tool's annotations say it changes nothing (readOnlyHint: true)."""
    return tool.annotations is not None and tool.annotations.read_only_hint is True


def approval_reason(server: str, tool: str, read_only: bool, config: BridgeConfig) -> str | None:
    """Why a call of an allowed tool asks the user first (shown to the user), or None: it
    does not. ``read_only``: the tool's annotations say readOnlyHint true (MCP's default
    for a tool without annotations is that it may change things)."""
    qualified = "%s.%s" % (server, tool)
    if _matches(qualified, config.approve_tools):  # the safe side wins where both match
        return "it matches MCP_BRIDGE_APPROVE_TOOLS"
    if _matches(qualified, config.allow_tools_without_asking):
        return None
    if config.approve == "all":
        return "MCP_BRIDGE_APPROVE=all asks before every tool call"
    if config.approve == "writes" and not read_only:
        return "its server does not mark it read-only, so it may change things (MCP_BRIDGE_APPROVE=writes)"
    return None


# =============================================================================
# wire protocol
# =============================================================================
# Frames are built and parsed by mcp_sandbox_kernel (imported above) on both sides.

KERNEL_SOURCE = Path(mcp_sandbox_kernel.__file__)
KERNEL_FILENAME = "mcp_sandbox_kernel.py"
SESSION_CONFIG_FILENAME = "session.json"
DEFAULT_SESSION = mcp_sandbox_kernel.DEFAULT_SESSION  # the session of a call that names none
SECCOMP_FILENAME = "seccomp.json"
IPC_MOUNT = "/ipc"
# The frames' Unix socket in the IPC directory (see the kernel's "socket channel"): the
# bridge listens, the supervisor connects once, the bridge removes the file at once.
CHANNEL_SOCKET_FILENAME = "channel.sock"
WORKDIR = "/workspace"
# Frames from the sandbox (or lines from a proxied server) that complete more than this
# many bytes in one read are decoded in a worker thread: decoding megabytes takes long
# (0.6 s for 11 MB of nested lists), and the event loop must keep answering the client.
DECODE_IN_THREAD_BYTES = 256 * 1024

# A frame from the kernel as its type says (the kernel's TypedDicts, beside FRAME_SCHEMAS).
KernelFrame: TypeAlias = HelloFrame | StreamFrame | ResultFrame | ErrorFrame | RequestFrame | CancelFrame


def kernel_frame(frame: Frame) -> KernelFrame:
    """``frame`` when it is a valid frame from the kernel: a type in KERNEL_FRAME_TYPES and
    every field as FRAME_SCHEMAS says; else ProtocolError saying which field is wrong."""
    validate_frame(frame, KERNEL_FRAME_TYPES)
    return cast("KernelFrame", frame)  # validate_frame checked each field its TypedDict types


def json_depth(value: object, limit: int) -> int:
    """How deeply JSON data nests (a scalar 0, ``{}`` 1), walked with a stack of its own so
    no depth makes the count itself fail; counting stops past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


# =============================================================================
# container engine
# =============================================================================

CONTAINER_LABEL = "io.github.mcp-server-code-execution-mode"
OWNER_PID_LABEL = CONTAINER_LABEL + ".owner-pid"
OWNER_START_LABEL = CONTAINER_LABEL + ".owner-start"
OWNER_HOST_LABEL = CONTAINER_LABEL + ".owner-host"
SESSION_LABEL = CONTAINER_LABEL + ".session"  # run_python's session name, for people and tools
UNKNOWN = "unknown"  # label value / directory name where a part of the identity cannot be read
CONTAINER_PREFIX = "mcp-code-exec"
# Modest explicit ulimits: good hardening, and rootful Podman's defaults exceed the
# hard limits of some hosts ("setrlimit ... operation not permitted").
ULIMIT_NOFILE = 1024
ULIMIT_NPROC = 512
# The writable in-memory filesystems take from the container's memory limit, so together
# they get less than it (5/8): a full disk is ENOSPC for the code, never an OOM kill.
WRITABLE_SHARES = (("/tmp", 4), (WORKDIR, 4), ("/dev/shm", 8))  # (path, 1/N of the memory)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``512m`` -> bytes (the engines' units: b, k, m, g; powers of 1024)."""
    match = re.fullmatch(r"([0-9]+)([bkmg]?)", text.strip().lower())
    if match is None:
        raise ValueError("not a size: %r" % text)
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def writable_sizes(memory: str) -> dict[str, int]:
    """Bytes for each writable filesystem of a sandbox with ``memory``, in KiB steps."""
    total = parse_size(memory)
    return {path: max(1 << 20, total // share) // 1024 * 1024 for path, share in WRITABLE_SHARES}


# Under gVisor (runsc) the host's pids limit counts the Sentry's own threads and ptrace
# stubs, which a fork bomb multiplies (about 70 per sandbox process): reaching it aborts
# the Sentry ("failed to create new OS thread", exit code 2) and the whole sandbox with it.
# There the code's processes and threads are capped by RLIMIT_NPROC, which gVisor enforces
# per sandbox; each also costs the Sentry memory, so the cap follows the memory limit (32
# with 512m), and the host limit only bounds the Sentry.
GVISOR_BYTES_PER_PROCESS = 16 << 20
GVISOR_HOST_PIDS_PER_PROCESS = 128


def process_limits(spec: LaunchSpec, gvisor: bool) -> tuple[int, int]:
    """(--pids-limit, RLIMIT_NPROC) of one sandbox."""
    if not gvisor:
        return spec.pids, ULIMIT_NPROC
    nproc = max(16, min(spec.pids, parse_size(spec.memory) // GVISOR_BYTES_PER_PROCESS))
    return nproc * GVISOR_HOST_PIDS_PER_PROCESS, nproc


COMMAND_TIMEOUT = 20.0

# Where to get an engine: one fact, which each audience reads in its own words (the
# model's here, a terminal's in engine_problem).
INSTALL_ENGINE = (
    "Install Podman (https://podman.io/docs/installation; on Debian/Ubuntu: "
    "`sudo apt-get install podman`) or Docker (https://docs.docker.com/get-docker/)"
)
INSTALL_HINT = (
    INSTALL_ENGINE + ", make sure `podman info` or `docker info` works for the user running this MCP "
    "server, then call run_python again. To choose one explicitly set MCP_BRIDGE_RUNTIME=podman|docker."
)


async def run_command(
    argv: Sequence[str], timeout: float = COMMAND_TIMEOUT
) -> subprocess.CompletedProcess[bytes]:
    """Run a short runtime CLI command; raises TimeoutError if it hangs."""
    with anyio.fail_after(timeout):
        return await anyio.run_process(list(argv), check=False, stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class OwnerIdentity:
    """Which bridge process owns a sandbox, told apart from every other machine, pid
    namespace and later process that shares the container engine or the state directory.

    `host_key`: 16 hex digits naming the space in which `pid` means something. Linux: a
    hash of the boot id and the pid namespace (a dev container, a remote engine's host
    or the next boot each get another key; a toolbox or snap sharing the host's pids gets
    the same one). macOS: a hash of the host name and the boot time. None where neither
    can be read (Windows, ...): such a bridge labels its containers but never sweeps.
    `start_time`: the process's start time in clock ticks since boot (Linux, field 22 of
    /proc/<pid>/stat), None elsewhere; it tells a reused pid from the original owner."""

    host_key: str | None
    pid: int
    start_time: int | None

    @property
    def host(self) -> str:
        return self.host_key or UNKNOWN

    def labels(self) -> list[str]:
        start = UNKNOWN if self.start_time is None else str(self.start_time)
        return [
            "%s=1" % CONTAINER_LABEL,
            "%s=%d" % (OWNER_PID_LABEL, self.pid),
            "%s=%s" % (OWNER_START_LABEL, start),
            "%s=%s" % (OWNER_HOST_LABEL, self.host),
        ]


def _host_digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def linux_host_key(boot_id: str, pid_namespace: str) -> str | None:
    """From /proc/sys/kernel/random/boot_id and readlink(/proc/self/ns/pid)."""
    boot_id = boot_id.strip()
    if not re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", boot_id):
        return None
    if not re.fullmatch(r"pid:\[\d+\]", pid_namespace):
        return None
    return _host_digest("linux", boot_id, pid_namespace)


def darwin_host_key(hostname: str, boottime: str) -> str | None:
    """From the host name and `sysctl -n kern.boottime` ("{ sec = 1700000000, usec = ...")."""
    match = re.match(r"\{ sec = (\d+), usec = \d+ \}", boottime.strip())
    if not hostname or match is None:
        return None
    return _host_digest("darwin", hostname, match.group(1))


def parse_start_time(stat: str) -> int | None:
    """Field 22 (starttime) of a /proc/<pid>/stat line. Field 2, the command name in
    parentheses, may itself contain spaces and parentheses, so count from the last ')'."""
    head, paren, tail = stat.rpartition(")")
    fields = tail.split()
    if not paren or " (" not in head or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def process_start_time(pid: int) -> int | None:
    try:
        return parse_start_time(Path("/proc/%d/stat" % pid).read_text(errors="replace"))
    except OSError:
        return None


def _read_host_key() -> str | None:
    if sys.platform.startswith("linux"):
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text()
            return linux_host_key(boot_id, os.readlink("/proc/self/ns/pid"))
        except OSError:
            return None
    if sys.platform == "darwin":
        try:
            result = subprocess.run(
                ["sysctl", "-n", "kern.boottime"], capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return darwin_host_key(os.uname().nodename, result.stdout)
    # Elsewhere (Windows) no sweep: there os.kill(pid, 0) would even terminate the process.
    return None


@lru_cache(maxsize=1)
def bridge_owner() -> OwnerIdentity:
    """This bridge process's identity, read once on first use (never at import)."""
    pid = os.getpid()
    start = process_start_time(pid) if sys.platform.startswith("linux") else None
    return OwnerIdentity(_read_host_key(), pid, start)


@dataclass(frozen=True)
class LaunchSpec:
    """What one sandbox container needs; the argv is derived from it by a pure function."""

    name: str
    image: str
    ipc_dir: Path | None  # None: no mount; the kernel arrives on stdin (BOOTSTRAP)
    owner: OwnerIdentity
    memory: str
    pids: int
    cpus: float
    user: str
    seccomp_profile: Path | None = None  # written by the session; None: the engine's default
    workspace: Workspace | None = None  # None: /workspace is an in-memory tmpfs
    session: str = DEFAULT_SESSION

    def labels(self) -> list[str]:
        return [*self.owner.labels(), "%s=%s" % (SESSION_LABEL, self.session)]


def sandbox_user(config: BridgeConfig) -> str:
    """The sandbox's --user: MCP_BRIDGE_CONTAINER_USER, or with a workspace folder its
    owner's uid:gid, so that files written there are the user's. Never root: a folder
    whose owner or group is root keeps the configured user (main() warns)."""
    if config.workspace is None:
        return config.container_user
    try:
        info = config.workspace.path.stat()
    except OSError as exc:
        raise SandboxStartError(
            "The workspace folder MCP_BRIDGE_WORKSPACE=%s cannot be read (%s); restore it, or restart the "
            "server without it." % (config.workspace.path, exc.strerror or exc)
        ) from None
    if info.st_uid == 0 or info.st_gid == 0:
        return config.container_user
    return "%d:%d" % (info.st_uid, info.st_gid)


SANDBOX_LIMITS = ("memory", "pids", "cpus")  # the run flags that need the engine's cgroups
_LIMIT_CONTROLLERS = {"memory": "memory", "pids": "pids", "cpus": "cpu"}


def unenforced_limits(rootless: bool, cgroups: str, controllers: Sequence[str] | None) -> tuple[str, ...]:
    """Which of SANDBOX_LIMITS an engine accepts but does not enforce: all of them when
    rootless on cgroups v1 (no cgroups at all); otherwise those whose cgroup controller
    is missing from `controllers` (None: not known, none assumed missing)."""
    if rootless and cgroups == "v1":
        return SANDBOX_LIMITS
    if controllers is None:
        return ()
    return tuple(limit for limit in SANDBOX_LIMITS if _LIMIT_CONTROLLERS[limit] not in controllers)


def host_cgroups_version(root: Path = Path("/sys/fs/cgroup")) -> str:
    """This Linux host's cgroups: "v2" where the unified hierarchy is mounted at the root
    (it lists its controllers there), else "v1" (hybrid mounts count as v1, as Podman
    counts them); "" without cgroups."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    return "v1" if root.is_dir() else ""


@dataclass(frozen=True)
class EngineFacts:
    """What `doctor` reports of an engine, from its `info`: its version, whether it runs
    rootless, the cgroups version ("v1", "v2"; "" unknown), the limits it cannot enforce
    here (unenforced_limits) and where gVisor's runsc is available to it (None: nowhere)."""

    version: str
    rootless: bool = False
    cgroups: str = ""
    unenforced: tuple[str, ...] = ()
    gvisor: str | None = None


def podman_facts(info: Mapping[str, object], runsc: str | None) -> EngineFacts:
    """From `podman info --format json`; `runsc`: its path on PATH (Podman runs any OCI
    runtime it is given)."""
    rootless = bool(json_field(info, "host", "security", "rootless"))
    cgroups = str(json_field(info, "host", "cgroupVersion") or "")
    controllers = json_field(info, "host", "cgroupControllers")
    listed = [str(name) for name in controllers] if isinstance(controllers, list) else None
    version = str(json_field(info, "version", "Version") or "unknown")
    return EngineFacts(version, rootless, cgroups, unenforced_limits(rootless, cgroups, listed), runsc)


def docker_facts(info: Mapping[str, object]) -> EngineFacts:
    """From `docker info --format '{{json .}}'`: gVisor only where the daemon knows runsc."""
    options = info.get("SecurityOptions")
    rootless = isinstance(options, list) and "name=rootless" in options
    cgroups = "v%s" % info["CgroupVersion"] if info.get("CgroupVersion") else ""
    flags = {"memory": "MemoryLimit", "pids": "PidsLimit", "cpu": "CpuCfsQuota"}
    controllers = [controller for controller, flag in flags.items() if info.get(flag, True)]
    runtimes = info.get("Runtimes")
    gvisor = next(
        (
            str(name)
            for name, runtime in (runtimes.items() if isinstance(runtimes, dict) else ())
            if name == "runsc" or Path(str(json_field(runtime, "path") or "")).name == "runsc"
        ),
        None,
    )
    version = str(info.get("ServerVersion") or "unknown")
    return EngineFacts(version, rootless, cgroups, unenforced_limits(rootless, cgroups, controllers), gvisor)


class ContainerEngine:
    """Strategy for one container engine. The run flags are identical on both engines
    (one pure function builds them); what differs is how readiness is checked and what
    the engine needs before it can run anything."""

    name: ClassVar[EngineName]

    def __init__(self, executable: str) -> None:
        self.executable = executable
        self.warnings: list[str] = []
        self.oci_runtime: str | None = None  # e.g. runsc (gVisor); set by use_oci_runtime()
        # The engine runs on another machine (or VM) than this process, or at least may:
        # it is reached through DOCKER_HOST, CONTAINER_HOST, a context or a connection.
        # It cannot be assumed to see the host's files, so no IPC mount (set by check_ready).
        self.remote = False

    # Flags only this engine takes, added to the shared run argv.
    engine_flags: ClassVar[tuple[str, ...]] = ()
    # Mount options this engine takes on a bind mount (the workspace folder).
    bind_options: ClassVar[tuple[str, ...]] = ()

    def run_argv(self, spec: LaunchSpec) -> list[str]:
        global_flags, run_flags = self.oci_runtime_flags()
        flags = (*self.engine_flags, *self.workspace_flags(spec), *run_flags)
        argv = build_run_argv(self.executable, spec, flags, self.bind_options, gvisor=self.gvisor)
        return [argv[0], *global_flags, *argv[1:]]

    @property
    def gvisor(self) -> bool:
        """Whether the sandbox runs under gVisor (MCP_BRIDGE_OCI_RUNTIME=runsc or its path)."""
        return self.oci_runtime is not None and Path(self.oci_runtime).name == "runsc"

    def workspace_flags(self, spec: LaunchSpec) -> list[str]:
        """Run flags a workspace folder needs on this engine, beside its mount."""
        return []

    def oci_runtime_flags(self) -> tuple[list[str], list[str]]:
        """(flags before `run`, flags of `run`) that select the OCI runtime."""
        return [], []

    async def use_oci_runtime(self, name: str | None) -> None:
        """Check that the OCI runtime ``name`` (MCP_BRIDGE_OCI_RUNTIME) can be used with this
        engine and remember it; EngineUnavailableError explains what is missing."""
        self.oci_runtime = name

    def kill_argv(self, container: str) -> list[str]:
        return [self.executable, "rm", "--force", container]

    def leftover_argv(self, container: str) -> list[str] | None:
        """What removes a sandbox whose process has ended by itself; None: nothing is left
        (Docker and Podman remove it themselves: --rm)."""
        return None

    @property
    def reads_profile_here(self) -> bool:
        """Whether `--security-opt seccomp=FILE` may name a file on this machine. Docker's
        CLI reads it and sends its content; Podman passes the path, which a remote
        service opens on its own machine."""
        return True

    async def has_image(self, image: str) -> bool:
        """Whether the engine has ``image`` locally (no pull)."""
        try:
            result = await run_command([self.executable, "image", "inspect", image])
        except (TimeoutError, OSError):
            return False
        return result.returncode == 0

    def list_argv(self, host_key: str) -> list[str]:
        """Names of the sandbox containers of one host key (one machine + pid namespace)."""
        return [
            self.executable,
            "ps",
            "--all",
            "--filter",
            "label=%s=%s" % (OWNER_HOST_LABEL, host_key),
            "--format",
            "{{.Names}}",
        ]

    async def check_ready(self) -> None:
        """Raise EngineUnavailableError unless the engine answers."""
        raise NotImplementedError

    async def describe(self) -> EngineFacts | None:
        """The engine's version and what it enforces (for `doctor`); None: not known here."""
        return None

    async def _info(self, template: str) -> dict[str, object]:
        """The engine's `info` as JSON; EngineUnavailableError when it does not answer."""
        result = await _answer(self, [self.executable, "info", "--format", template])
        try:
            info = json.loads(result.stdout)
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise EngineUnavailableError("`%s info` did not answer JSON." % self.name)
        return info

    async def release(self) -> None:
        """Undo what check_ready() started (only ever what the bridge itself started)."""


class DockerEngine(ContainerEngine):
    name = "docker"

    async def check_ready(self) -> None:
        result = await _answer(self, [self.executable, "info", "--format", "{{.ServerVersion}}"])
        # The endpoint the CLI talks to (DOCKER_HOST or the current context's); a local
        # socket or pipe shares this machine's files, tcp:// or ssh:// may not.
        # A CLI without contexts (before 19.03, podman-docker) answers nothing: local.
        try:
            endpoint = await run_command(
                [self.executable, "context", "inspect", "--format", "{{.Endpoints.docker.Host}}"]
            )
        except (TimeoutError, OSError):
            endpoint = None
        ok = endpoint is not None and endpoint.returncode == 0
        where = endpoint.stdout.decode(errors="replace").strip() if ok and endpoint is not None else ""
        self.remote = bool(where) and not where.startswith(("unix://", "npipe://"))
        logger.info("docker engine %s answers at %s", result.stdout.decode().strip(), where)

    def oci_runtime_flags(self) -> tuple[list[str], list[str]]:
        return [], (["--runtime", self.oci_runtime] if self.oci_runtime else [])

    async def describe(self) -> EngineFacts | None:
        return docker_facts(await self._info("{{json .}}"))

    async def use_oci_runtime(self, name: str | None) -> None:
        if name is not None:
            result = await _answer(self, [self.executable, "info", "--format", "{{json .Runtimes}}"])
            try:
                known = sorted(json.loads(result.stdout or b"{}"))
            except ValueError:
                known = []
            if name not in known:
                raise EngineUnavailableError(
                    "MCP_BRIDGE_OCI_RUNTIME=%s, but the Docker daemon does not know that runtime "
                    "(it has: %s). "
                    'For gVisor: install runsc, add {"runtimes": {"runsc": {"path": "/usr/bin/runsc", '
                    '"runtimeArgs": ["--network=none"]}}} to /etc/docker/daemon.json and restart dockerd; '
                    "or unset MCP_BRIDGE_OCI_RUNTIME." % (name, ", ".join(known) or "none")
                )
        self.oci_runtime = name


class PodmanEngine(ContainerEngine):
    name = "podman"
    # With --read-only, Podman also mounts writable, exec-allowed tmpfs on /run, /tmp and
    # /var/tmp; only the filesystems we document (and size) may be writable.
    engine_flags = ("--read-only-tmpfs=false",)
    # As on the tmpfs mounts (Docker's bind mounts take none of these).
    bind_options = ("noexec", "nosuid", "nodev")

    def __init__(self, executable: str) -> None:
        super().__init__(executable)
        self.started_machine: str | None = None
        self.rootless = False  # read by check_ready()

    @property
    def reads_profile_here(self) -> bool:
        return not self.remote

    def workspace_flags(self, spec: LaunchSpec) -> list[str]:
        # Rootless, container uids map to the user's subordinate ids; keep-id maps the
        # user's own uid to itself, so the sandbox (run as the folder's owner) can write.
        return ["--userns=keep-id"] if spec.workspace is not None and self.rootless else []

    def oci_runtime_flags(self) -> tuple[list[str], list[str]]:
        if not self.oci_runtime:
            return [], []
        flags = ["--runtime", self.oci_runtime]
        if self.gvisor:
            # gVisor refuses to start in the host's network namespace without this, even
            # with --network none (which gives the container no network anyway).
            flags += ["--runtime-flag", "network=none"]
        return flags, []

    async def use_oci_runtime(self, name: str | None) -> None:
        path = None
        if name is not None:
            path = name if "/" in name else shutil.which(name)
            if path is None or not os.access(path, os.X_OK):
                raise EngineUnavailableError(
                    "MCP_BRIDGE_OCI_RUNTIME=%s, but no such executable was found%s. For gVisor install "
                    "runsc (https://gvisor.dev/docs/user_guide/install/; Debian/Ubuntu: `sudo apt-get "
                    "install runsc`), or unset MCP_BRIDGE_OCI_RUNTIME."
                    % (name, "" if "/" in name else " on PATH")
                )
        self.oci_runtime = path

    def kill_argv(self, container: str) -> list[str]:
        # --time 0: kill at once. Podman otherwise sends SIGTERM and waits 10 s, which code
        # stuck in a C call (signal handlers wait for it) turns into a 10 s stall.
        return [self.executable, "rm", "--force", "--time", "0", container]

    async def check_ready(self) -> None:
        if sys.platform == "darwin":
            await self._start_machine_if_stopped()
        if sys.platform == "linux":
            # `podman version` names a server only where Podman is a client of a service
            # (CONTAINER_HOST, --remote, a connection): 20 ms, where `podman info` takes 0.2 s
            # (it gathers the host's packages) on the way to the first result. A local
            # Podman's facts are this host's: rootless is a user other than root.
            answer = await _answer(
                self, [self.executable, "version", "--format", "{{if .Server}}remote{{else}}local{{end}}"]
            )
            if answer.stdout.strip() == b"local":
                self._heed_limits(os.geteuid() != 0, host_cgroups_version())
                return
        result = await _answer(
            self,
            [
                self.executable,
                "info",
                "--format",
                "{{.Host.Security.Rootless}} {{.Host.CgroupsVersion}} {{.Host.ServiceIsRemote}}",
            ],
        )
        rootless, cgroups, remote = [*result.stdout.decode().split(), "", "", ""][:3]
        # CONTAINER_HOST, --remote or a connection: a Podman service that may be elsewhere.
        # (On macOS and Windows Podman is always a client of its machine VM, which shares
        # the user's files, so the mount still works there.)
        self.remote = remote == "true" and sys.platform == "linux"
        if self.remote:
            self.warnings.append(
                "remote Podman: the sandbox runs under the engine's default seccomp profile, not the "
                "bridge's stricter one (Podman's service would look for the profile file on its own machine)"
            )
            logger.warning(self.warnings[-1])
        self._heed_limits(rootless == "true", cgroups)

    def _heed_limits(self, rootless: bool, cgroups: str) -> None:
        self.rootless = rootless
        if unenforced_limits(rootless, cgroups, None):
            self.warnings.append(
                "rootless Podman on cgroups v1 ignores resource limits: the sandbox's memory, "
                "pids and CPU caps are NOT enforced on this host"
            )
            logger.warning(self.warnings[-1])

    async def describe(self) -> EngineFacts | None:
        return podman_facts(await self._info("json"), shutil.which("runsc"))

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


@dataclass(frozen=True)
class KubeTarget:
    """Where the Kubernetes backend puts its Pods; None: kubectl's current one."""

    namespace: str | None = None
    context: str | None = None
    runtime_class: str | None = None


class KubernetesEngine(ContainerEngine):
    """MCP_BRIDGE_RUNTIME=kubernetes: each session is a Pod that `kubectl run --stdin
    --attach` creates and attaches to, so kubectl's stdin and stdout are the frame channel
    and the kernel arrives on stdin (the cluster never sees this machine's files). The Pod
    is deleted on a timeout kill, a reset and exit; leftovers are swept by label."""

    name = "kubernetes"

    def __init__(self, executable: str, target: KubeTarget) -> None:
        super().__init__(executable)
        self.target = target
        self.remote = True

    def kubectl(self, *args: str) -> list[str]:
        return kubectl_argv(self.executable, self.target, *args)

    def run_argv(self, spec: LaunchSpec) -> list[str]:
        return kubectl_run_argv(self.executable, self.target, spec)

    def kill_argv(self, container: str) -> list[str]:
        # --wait=false: the API server finishes it; the bridge does not wait for the kubelet.
        return self.kubectl(
            "delete", "pod", container, "--ignore-not-found", "--grace-period=0", "--force", "--wait=false"
        )

    def leftover_argv(self, container: str) -> list[str] | None:
        return self.kill_argv(container)  # a Pod that has ended stays until it is deleted

    def list_argv(self, host_key: str) -> list[str]:
        return self.kubectl(
            "get",
            "pods",
            "--selector",
            "%s=%s" % (OWNER_HOST_LABEL, host_key),
            "--output",
            "jsonpath={range .items[*]}{.metadata.name}{'\\n'}{end}",
        )

    async def has_image(self, image: str) -> bool:
        return True  # the nodes pull it; kubectl cannot tell from here

    async def check_ready(self) -> None:
        # Exit 1 with "no" when the user may not: _answer reports it as not usable.
        result = await _answer(self, self.kubectl("auth", "can-i", "create", "pods", "--subresource=attach"))
        logger.info("kubernetes answers: create pods/attach: %s", result.stdout.decode().strip())


async def locate_kubernetes(
    config: BridgeConfig, which: Callable[[str], str | None] = shutil.which
) -> KubernetesEngine:
    """The Kubernetes backend, once kubectl answers for the configured context and namespace."""
    executable = which("kubectl")
    if executable is None:
        raise EngineUnavailableError(
            "MCP_BRIDGE_RUNTIME=kubernetes, but kubectl is not installed (not on PATH): install it "
            "(https://kubernetes.io/docs/tasks/tools/) and make sure `kubectl auth can-i create pods "
            "--subresource=attach` answers yes for the user running this MCP server."
        )
    target = KubeTarget(config.kube_namespace, config.kube_context, config.kube_runtime_class)
    engine = KubernetesEngine(executable, target)
    await engine.check_ready()
    return engine


ENGINE_CLASSES: dict[EngineName, type[ContainerEngine]] = {
    "podman": PodmanEngine,
    "docker": DockerEngine,
}


async def _answer(engine: ContainerEngine, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    try:
        result = await run_command(argv)
    except TimeoutError:
        raise EngineUnavailableError(
            "%s did not answer within %gs (`%s`)." % (engine.name, COMMAND_TIMEOUT, " ".join(argv[:2]))
        ) from None
    if result.returncode != 0:
        detail = result.stderr.decode(errors="replace").strip().splitlines()
        raise EngineUnavailableError(
            "%s is installed but not usable: %s"
            % (engine.name, detail[-1] if detail else "exit %d" % result.returncode)
        )
    return result


# How the bridge finds its container engine (detect_engine; a test passes its own).
EngineLocator: TypeAlias = Callable[[EngineName | None], Awaitable[ContainerEngine]]


async def configured_engine(config: BridgeConfig, locate: EngineLocator) -> ContainerEngine:
    """The engine the settings name: Kubernetes (it needs its target, not just a name), else
    what ``locate`` finds for MCP_BRIDGE_RUNTIME (detect_engine: the first that answers)."""
    if config.runtime == "kubernetes":
        return await locate_kubernetes(config)
    return await locate(config.runtime)


async def detect_engine(
    preferred: EngineName | None, which: Callable[[str], str | None] = shutil.which
) -> ContainerEngine:
    """MCP_BRIDGE_RUNTIME if set, else Podman, else Docker: the first that answers.
    (Kubernetes is located by locate_kubernetes: it needs its namespace and context.)"""
    if preferred == "kubernetes":
        raise EngineUnavailableError(
            "This needs a local container engine, and MCP_BRIDGE_RUNTIME=kubernetes names none: "
            "use --runtime podman or --runtime docker."
        )
    candidates: list[EngineName] = [preferred] if preferred else ["podman", "docker"]
    problems: list[str] = []
    for name in candidates:
        executable = which(name)
        if executable is None:
            problems.append("%s is not installed (not on PATH)" % name)
            continue
        engine = ENGINE_CLASSES[name](executable)
        try:
            await engine.check_ready()
        except EngineUnavailableError as exc:
            problems.append(str(exc))
            continue
        return engine
    raise NoEngineError(
        "No container runtime is available, so Python cannot run yet: %s. %s"
        % ("; ".join(problems), INSTALL_HINT),
        problems,
    )


def build_run_argv(
    executable: str,
    spec: LaunchSpec,
    engine_flags: Sequence[str] = (),
    bind_options: Sequence[str] = (),
    gvisor: bool = False,
) -> list[str]:
    """The hardened `run` command for one sandbox. Pure, so tests assert on it exactly.
    ``engine_flags`` are the runtime's own additions (placed after --read-only);
    ``bind_options`` its options for the workspace folder's bind mount; ``gvisor``: the
    OCI runtime is runsc (see process_limits)."""
    sizes = writable_sizes(spec.memory)
    pids, nproc = process_limits(spec, gvisor)
    tmpfs = "rw,nosuid,nodev,noexec,size=%dk,mode=1777"
    workdir = ["--tmpfs", WORKDIR + ":" + tmpfs % (sizes[WORKDIR] // 1024)]
    if spec.workspace is not None:  # the user's folder: the only writable host mount
        mount = ["type=bind", "source=%s" % spec.workspace.path, "target=" + WORKDIR]
        mount += ["readonly"] if spec.workspace.read_only else []
        workdir = ["--mount", ",".join([*mount, *bind_options])]
    ipc_mount = [] if spec.ipc_dir is None else ["--volume", "%s:%s:ro" % (spec.ipc_dir, IPC_MOUNT)]
    return [
        executable, "run",
        "--interactive",  # the kernel's stdin is the frame channel; EOF ends the container
        "--rm",
        "--name", spec.name,
        *(item for label in spec.labels() for item in ("--label", label)),
        "--network", "none",
        "--read-only",
        *engine_flags,
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        *(("--security-opt", "seccomp=%s" % spec.seccomp_profile) if spec.seccomp_profile else ()),
        "--user", spec.user,
        "--memory", spec.memory,
        "--memory-swap", spec.memory,  # equal to memory: no swap on top of the limit
        "--pids-limit", str(pids),
        "--cpus", "%g" % spec.cpus,
        "--ulimit", "nofile=%d:%d" % (ULIMIT_NOFILE, ULIMIT_NOFILE),
        "--ulimit", "nproc=%d:%d" % (nproc, nproc),
        "--tmpfs", "/tmp:" + tmpfs % (sizes["/tmp"] // 1024),
        *workdir,
        "--shm-size", "%dk" % (sizes["/dev/shm"] // 1024),  # noexec, nosuid, nodev on both engines
        # The engines mount a writable mqueue filesystem here; a read-only tmpfs hides it
        # (mq_open still works: its queues live in the container's own IPC namespace).
        "--tmpfs", "/dev/mqueue:ro,nosuid,nodev,noexec,size=4k",
        *ipc_mount,
        # No --workdir: Docker re-creates a workdir that is a tmpfs mount point as 0755
        # root, making it unwritable for the sandbox user. The kernel chdirs instead.
        "--env", "HOME=" + WORKDIR,
        "--env", "PYTHONDONTWRITEBYTECODE=1",
        "--env", "PYTHONIOENCODING=utf-8",
        "--entrypoint", "python3",
        spec.image,
        "-I",  # isolated: the image's PYTHON* variables and user site cannot hijack the kernel
        *kernel_argv(spec.ipc_dir),
    ]  # fmt: skip


def kernel_argv(ipc_dir: Path | None) -> list[str]:
    """What follows ``python3 -I``: the kernel file in the IPC mount, or the bootstrap
    that reads it from stdin (the Kubernetes backend starts it the same way)."""
    if ipc_dir is None:
        return ["-c", BOOTSTRAP]
    return ["%s/%s" % (IPC_MOUNT, KERNEL_FILENAME), "%s/%s" % (IPC_MOUNT, SESSION_CONFIG_FILENAME)]


# --- Kubernetes: the Pod and the kubectl commands -------------------------------------
# The hardening of build_run_argv, in a Pod's terms, where a Pod can say it: no network
# is NOT in the Pod (a NetworkPolicy denying all egress is; see ARCHITECTURE), nor are the
# pids limit and ulimits (the kubelet's podPidsLimit is), our seccomp profile
# (RuntimeDefault instead), noexec/nosuid/nodev on the in-memory volumes, or the
# read-only /dev/mqueue.
KUBE_CONTAINER = "sandbox"
KUBE_OWNER_ANNOTATION = CONTAINER_LABEL + "/owner"
KUBE_SESSION_ANNOTATION = CONTAINER_LABEL + "/session"


def kubectl_argv(executable: str, target: KubeTarget, *args: str) -> list[str]:
    context = ["--context", target.context] if target.context else []
    namespace = ["--namespace", target.namespace] if target.namespace else []
    return [executable, *context, *namespace, *args]


def pod_manifest(spec: LaunchSpec, runtime_class: str | None = None) -> dict[str, Any]:
    """The sandbox Pod. Pure, so a test compares it with a checked-in manifest."""
    uid, gid = (int(part) for part in spec.user.split(":"))
    sizes = writable_sizes(spec.memory)
    limits = {"cpu": "%g" % spec.cpus, "memory": str(parse_size(spec.memory))}
    volumes = [("tmp", "/tmp"), ("workspace", WORKDIR), ("shm", "/dev/shm")]
    # The owner's labels (the sweep selects by them); the session as an annotation: a label
    # value must start and end with a letter or digit, and "_x" is a valid session name.
    labels = dict(label.split("=", 1) for label in spec.owner.labels())
    pod_spec: dict[str, object] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # no API credentials inside
        "enableServiceLinks": False,  # no environment variables naming the cluster's services
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "terminationGracePeriodSeconds": 0,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": KUBE_CONTAINER,
                "image": spec.image,
                "command": ["python3", "-I", *kernel_argv(None)],
                "stdin": True,  # the frame channel; attached by kubectl run --attach
                "stdinOnce": True,  # the bridge closing it ends the kernel, and the Pod with it
                "tty": False,
                "env": [
                    {"name": "HOME", "value": WORKDIR},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                    {"name": "PYTHONIOENCODING", "value": "utf-8"},
                ],
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": uid,
                    "runAsGroup": gid,
                    "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False,
                    "privileged": False,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "resources": {"limits": limits, "requests": limits},
                "volumeMounts": [{"name": name, "mountPath": path} for name, path in volumes],
            }
        ],
        # In memory, sized like the engines' tmpfs mounts; they count against the memory limit.
        "volumes": [
            {"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": str(sizes[path])}}
            for name, path in volumes
        ],
    }
    if runtime_class:
        pod_spec["runtimeClassName"] = runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.name,
            "labels": labels,
            "annotations": {
                KUBE_OWNER_ANNOTATION: "bridge pid %d on host %s" % (spec.owner.pid, spec.owner.host),
                KUBE_SESSION_ANNOTATION: spec.session,
                "kubectl.kubernetes.io/default-container": KUBE_CONTAINER,
            },
        },
        "spec": pod_spec,
    }


def kubectl_run_argv(executable: str, target: KubeTarget, spec: LaunchSpec) -> list[str]:
    """`kubectl run` creating the Pod and attaching to its stdin and stdout. The override
    is a merge patch that replaces what kubectl would generate with pod_manifest()."""
    return kubectl_argv(
        executable,
        target,
        "run",
        spec.name,
        "--image",
        spec.image,
        "--restart=Never",
        "--stdin",
        "--attach",
        "--quiet",
        "--pod-running-timeout=10m",  # an image pull may be slow; the bridge's start timeout decides
        "--override-type=merge",
        "--overrides",
        json.dumps(pod_manifest(spec, target.runtime_class), separators=(",", ":"), sort_keys=True),
    )


# --- seccomp --------------------------------------------------------------------------
# The profile every sandbox runs under: the engines' default profile (containers-common's
# seccomp.json, itself derived from Docker's), reduced to what a container without
# capabilities may use, minus what this sandbox never needs: namespaces and mounts
# (unshare, setns, clone with CLONE_NEW* flags, the mount family), the kernel keyring
# (keyctl, add_key, request_key), userfaultfd, perf_event_open, bpf, and sockets other
# than AF_UNIX, AF_INET, AF_INET6 and NETLINK_ROUTE (no AF_VSOCK: a VM host's vsock is
# reachable despite --network none; no AF_PACKET). Those fail with EPERM; any syscall the
# profile does not know fails with ENOSYS, so libc falls back (clone3 -> clone).
# A table of names, one per word, as the engines' profiles list them.
_SECCOMP_ALLOWED_NAMES = """
    _llseek _newselect accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown
    chown32 clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64
    clock_nanosleep clock_nanosleep_time64 close close_range connect copy_file_range creat dup dup2 dup3
    epoll_create epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait
    epoll_wait_old eventfd eventfd2 execve execveat exit exit_group faccessat faccessat2 fadvise64
    fadvise64_64 fallocate fanotify_mark fchdir fchmod fchmodat fchown fchown32 fchownat fcntl fcntl64
    fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs
    fstatfs64 fsync ftruncate ftruncate64 futex futex_time64 futimesat get_mempolicy get_robust_list
    get_thread_area getcpu getcwd getdents getdents64 getegid getegid32 geteuid geteuid32 getgid
    getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp getpid getppid getpriority
    getrandom getresgid getresgid32 getresuid getresuid32 getrlimit getrusage getsid getsockname
    getsockopt gettid gettimeofday getuid getuid32 getxattr inotify_add_watch inotify_init inotify_init1
    inotify_rm_watch io_cancel io_destroy io_getevents io_setup io_submit ioctl ioprio_get ioprio_set
    ipc kill landlock_add_rule landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr
    link linkat listen listxattr llistxattr lremovexattr lseek lsetxattr lstat lstat64 madvise mbind
    membarrier memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap
    mmap2 mprotect mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend
    mq_timedsend_time64 mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock munlockall munmap
    name_to_handle_at nanosleep newfstatat open openat openat2 pause pidfd_getfd pidfd_open
    pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl
    pread64 preadv preadv2 prlimit64 process_mrelease process_vm_readv process_vm_writev pselect6
    pselect6_time64 ptrace pwrite64 pwritev pwritev2 read readahead readdir readlink readlinkat readv
    reboot recv recvfrom recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr rename renameat
    renameat2 restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo
    rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo
    sched_get_priority_max sched_get_priority_min sched_getaffinity sched_getattr sched_getparam
    sched_getscheduler sched_rr_get_interval sched_rr_get_interval_time64 sched_setaffinity
    sched_setattr sched_setparam sched_setscheduler sched_yield seccomp select semctl semget semop
    semtimedop semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto set_mempolicy
    set_robust_list set_thread_area set_tid_address setfsgid setfsgid32 setfsuid setfsuid32 setgid
    setgid32 setgroups setgroups32 setitimer setpgid setpriority setregid setregid32 setresgid
    setresgid32 setresuid setresuid32 setreuid setreuid32 setrlimit setsid setsockopt setuid setuid32
    setxattr shmat shmctl shmdt shmget shutdown sigaction sigaltstack signal signalfd signalfd4
    sigpending sigprocmask sigreturn sigsuspend socketcall socketpair splice stat stat64 statfs statfs64
    statx symlink symlinkat sync sync_file_range syncfs syscall sysinfo syslog tee tgkill time
    timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
    timer_settime64 timerfd timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
    timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat utime
    utimensat utimensat_time64 utimes vfork wait4 waitid waitpid write writev
"""
SECCOMP_ALLOWED = tuple(_SECCOMP_ALLOWED_NAMES.split())
SECCOMP_DENIED = (
    "add_key", "bpf", "fsconfig", "fsmount", "fsopen", "fspick", "keyctl", "mount", "mount_setattr",
    "move_mount", "open_tree", "perf_event_open", "pivot_root", "request_key", "setns", "umount",
    "umount2", "unshare", "userfaultfd",
    # the engines' own denials
    "bdflush", "io_pgetevents", "kexec_file_load", "kexec_load", "migrate_pages", "move_pages",
    "nfsservctl", "nice", "oldfstat", "oldlstat", "oldolduname", "oldstat", "olduname",
    "pciconfig_iobase", "pciconfig_read", "pciconfig_write", "sgetmask", "ssetmask", "swapcontext",
    "swapoff", "swapon", "sysfs", "uselib", "ustat", "vm86", "vm86old", "vmsplice",
)  # fmt: skip
SOCKET_FAMILIES_ALLOWED = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6"}
AF_NETLINK, NETLINK_ROUTE = 16, 0
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
EPERM, ENOSYS = 1, 38


def seccomp_profile() -> dict[str, Any]:
    """The profile as the engines read it (`--security-opt seccomp=FILE`). Pure."""

    def arg(index: int, value: int, op: str = "SCMP_CMP_EQ", mask: int = 0) -> dict[str, int | str]:
        if op == "SCMP_CMP_MASKED_EQ":
            return {"index": index, "value": mask, "valueTwo": value, "op": op}
        return {"index": index, "value": value, "valueTwo": 0, "op": op}

    allow, deny = "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"
    rules: list[dict[str, object]] = [
        {"names": list(SECCOMP_ALLOWED), "action": allow},
        {"names": list(SECCOMP_DENIED), "action": deny, "errnoRet": EPERM},
        {"names": ["clone3"], "action": deny, "errnoRet": ENOSYS},  # glibc then uses clone
        # clone without any namespace flag (the flags are argument 0, 1 on s390)
        {"names": ["clone"], "action": allow, "args": [arg(0, 0, "SCMP_CMP_MASKED_EQ", CLONE_NEW_FLAGS)],
         "excludes": {"arches": ["s390", "s390x"]}},
        {"names": ["clone"], "action": allow, "args": [arg(1, 0, "SCMP_CMP_MASKED_EQ", CLONE_NEW_FLAGS)],
         "includes": {"arches": ["s390", "s390x"]}},
        {"names": ["socket"], "action": allow, "args": [arg(0, AF_NETLINK), arg(2, NETLINK_ROUTE)]},
    ]  # fmt: skip
    rules += [
        {"names": ["socket"], "action": allow, "args": [arg(0, family)]} for family in SOCKET_FAMILIES_ALLOWED
    ]
    rules += [
        {"names": ["socket"], "action": deny, "errnoRet": EPERM, "args": [arg(0, family)]}
        for family in range(46)
        if family not in SOCKET_FAMILIES_ALLOWED and family != AF_NETLINK
    ]
    rules += [
        {"names": ["personality"], "action": allow, "args": [arg(0, persona)]}
        for persona in (0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # the default's: linux, 32-bit, query
    ]
    for names, arches in (
        (["arch_prctl"], ["amd64", "x32"]),
        (["modify_ldt"], ["amd64", "x32", "x86"]),
        (["arm_fadvise64_64", "arm_sync_file_range", "breakpoint", "cacheflush"], ["arm", "arm64"]),
        (["set_tls"], ["arm", "arm64"]),
        (["sync_file_range2"], ["arm", "arm64"]),
        (["sync_file_range2"], ["ppc64le"]),
        (["s390_pci_mmio_read", "s390_pci_mmio_write", "s390_runtime_instr"], ["s390", "s390x"]),
    ):  # fmt: skip
        rules.append({"names": names, "action": allow, "includes": {"arches": arches}})
    return {
        "defaultAction": deny,
        "defaultErrnoRet": ENOSYS,
        "archMap": [
            {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
            {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
            {"architecture": "SCMP_ARCH_S390X", "subArchitectures": ["SCMP_ARCH_S390"]},
            {"architecture": "SCMP_ARCH_PPC64LE", "subArchitectures": []},
        ],
        "syscalls": rules,
    }


def container_name(owner: OwnerIdentity) -> str:
    """`mcp-code-exec-<pid>.<start time>-<random>` (`mcp-code-exec-<pid>-<random>` when the
    start time is unknown); the session's IPC directory is named after it."""
    token = "%d" % owner.pid if owner.start_time is None else "%d.%d" % (owner.pid, owner.start_time)
    return "%s-%s-%s" % (CONTAINER_PREFIX, token, secrets.token_hex(4))


def session_dir_name(owner: OwnerIdentity, name: str) -> str:
    """`<host key>.<container name>`: the session's private directory under STATE_DIR/ipc,
    named so that a sweep can tell this host's directories from other hosts'."""
    return "%s.%s" % (owner.host, name)


def owner_of(name: str) -> tuple[int, int | None] | None:
    """(pid, start time or None) of the bridge named in a container or IPC directory name."""
    match = re.fullmatch(re.escape(CONTAINER_PREFIX) + r"-(\d+)(?:\.(\d+))?-[0-9a-f]+", name)
    if match is None:
        return None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_gone(
    pid: int,
    start_time: int | None,
    alive: Callable[[int], bool] = process_alive,
    start_time_of: Callable[[int], int | None] = process_start_time,
) -> bool:
    """True only when provably gone: no such process, or one with another start time (the
    pid was reused). A live pid whose start time cannot be compared counts as the owner."""
    if not alive(pid):
        return True
    if start_time is None:
        return False
    current = start_time_of(pid)
    return current is not None and current != start_time


async def sweep_orphans(
    engine: ContainerEngine,
    ipc_root: Path,
    owner: OwnerIdentity,
    alive: Callable[[int], bool] = process_alive,
    start_time_of: Callable[[int], int | None] = process_start_time,
) -> list[str]:
    """Remove the sandbox containers and IPC directories of THIS host key whose bridge is
    provably gone. Other machines', other pid namespaces' and unparseable ones stay: their
    pids mean nothing here."""
    if owner.host_key is None:
        logger.info("this host cannot be identified, so leftover sandboxes are not swept")
        return []

    def orphaned(name: str) -> bool:
        parsed = owner_of(name)
        return parsed is not None and owner_gone(*parsed, alive=alive, start_time_of=start_time_of)

    result = await run_command(engine.list_argv(owner.host_key))
    names = result.stdout.decode(errors="replace").split() if result.returncode == 0 else []
    orphans = [name for name in names if orphaned(name)]
    for name in orphans:
        logger.info("removing orphaned sandbox container %s", name)
        await run_command(engine.kill_argv(name))
    if ipc_root.is_dir():
        for entry in ipc_root.iterdir():
            host, _, name = entry.name.partition(".")
            if host == owner.host_key and entry.is_dir() and not entry.is_symlink() and orphaned(name):
                shutil.rmtree(entry, ignore_errors=True)
    return orphans


class SharedEngine:
    """The container engine every sandbox uses: found (and this host's leftover
    sandboxes swept) once, on first use, and released once at the end."""

    def __init__(self, config: BridgeConfig, locate_engine: EngineLocator = detect_engine) -> None:
        self.config = config
        self.locate_engine = locate_engine
        self.engine: ContainerEngine | None = None
        self._lock = anyio.Lock()  # two sessions starting at once find it once

    async def get(self) -> ContainerEngine:
        async with self._lock:
            if self.engine is None:
                engine = await configured_engine(self.config, self.locate_engine)
                if self.config.runtime != "kubernetes":  # a Pod's runtime is its RuntimeClass
                    await engine.use_oci_runtime(self.config.oci_runtime)
                ipc_root = self.config.state_dir / "ipc"
                try:
                    await sweep_orphans(engine, ipc_root, await anyio.to_thread.run_sync(bridge_owner))
                except (TimeoutError, OSError) as exc:  # leftovers stay for the next start to sweep
                    logger.warning("could not sweep leftover sandboxes: %s", exc)
                self.engine = engine
            return self.engine

    async def release(self) -> None:
        if self.engine is not None:
            await self.engine.release()


# The image for data work that `build-image` builds (see the command line), named here:
# a sandbox's missing-package hint tells the model of it.
BUILD_IMAGE_COMMAND = "build-image"
BATTERIES = ("numpy", "pandas", "matplotlib")
BATTERIES_TAG = "localhost/mcp-sandbox-python:batteries"


def workspace_warning(config: BridgeConfig) -> str | None:
    """What the user (log) and the model (the first result of each session) should know
    about a workspace folder of root's: the sandbox, never root, may not be able to use it."""
    if config.workspace is None:
        return None
    try:
        info = config.workspace.path.stat()
    except OSError:
        return None  # the sandbox's start says so
    if info.st_uid != 0 and info.st_gid != 0:
        return None
    return (
        "The workspace folder MCP_BRIDGE_WORKSPACE=%s belongs to root (user or group), so the sandbox "
        "runs as %s, never as root: that user must be able to %s it, or the user should give the folder "
        "to their own account (chown)."
        % (
            config.workspace.path,
            config.container_user,
            "read" if config.workspace.read_only else "read and write",
        )
    )


# =============================================================================
# server discovery
# =============================================================================
# Where MCP servers are found, LOWEST precedence first. A later file's entry with the
# same name replaces an earlier one, even when the later entry is disabled, malformed or
# skipped (so a name is turned off by the file that mentions it last).
#
#   1. <state dir>/*.json (MCP_BRIDGE_STATE_DIR, default ~/MCPs), in name order   mcpServers
#   2. Claude Desktop   macOS   ~/Library/Application Support/Claude/claude_desktop_config.json
#                       Linux   $XDG_CONFIG_HOME (~/.config)/Claude/claude_desktop_config.json
#                       Windows %APPDATA%\Claude\claude_desktop_config.json      mcpServers
#   3. Windsurf         ~/.codeium/windsurf/mcp_config.json                       mcpServers
#   4. Gemini CLI       ~/.gemini/settings.json                                   mcpServers
#   5. Codex            $CODEX_HOME (~/.codex)/config.toml                        [mcp_servers.NAME]
#   6. VS Code (user)   <Code user dir>/mcp.json                                  servers
#                       <Code user dir>/settings.json                             mcp.servers
#                       (macOS ~/Library/Application Support/Code/User, Linux
#                       $XDG_CONFIG_HOME (~/.config)/Code/User, Windows %APPDATA%\Code\User)
#   7. Cursor (user)    ~/.cursor/mcp.json                                        mcpServers
#   8. Claude Code      ~/.claude.json                                            mcpServers
#   9. the project (the bridge's working directory), in this order:
#                       .vscode/mcp.json                                          servers
#                       .cursor/mcp.json                                          mcpServers
#                       ~/.claude.json, this project's entry                      projects[<cwd>].mcpServers
#                       .mcp.json                                                 mcpServers
#  10. MCP_SERVERS_CONFIG: when set, the ONLY source                              mcpServers or servers
#  MCP_BRIDGE_DISCOVER=0 leaves out 2-9 (every client's config).
#
# The project's own files (.vscode/mcp.json, .cursor/mcp.json, .mcp.json) come with a
# repository, not from the user: MCP_BRIDGE_PROJECT_SERVERS=trusted (the default) starts
# their servers only where the client records that the user trusted them, as the client
# itself would. Claude Code records it in ~/.claude.json projects[<folder>]
# (hasTrustDialogAccepted, for the folder or a parent) and in its settings files
# (enabledMcpjsonServers, enableAllProjectMcpServers, disabledMcpjsonServers); Cursor and
# VS Code keep workspace trust in their own databases, so their project servers are not
# started. Each server not started is a "found but not trusted" problem saying how to
# allow it, and takes no part in the merge (a repository cannot hide the user's server of
# the same name). `all` starts every project server; `none` does not read those files.
# ~/.claude.json projects[<cwd>].mcpServers is the user's own (`claude mcp add --scope local`).
#
# JSON files may hold // and /* */ comments and trailing commas (VS Code writes them).
# In command, args, env values, cwd, url and header values, ${VAR}, ${VAR:-default} (used
# when VAR is unset or empty) and ${env:VAR} are replaced from the bridge's environment,
# ${workspaceFolder}/${userHome} as VS Code would; an entry with a reference nothing here
# can resolve (${input:...}) is skipped with a problem, never started with the literal.

Transport = Literal["stdio", "http", "sse"]
SELF_MARKERS = ("mcp-server-code-execution-mode", "mcp_server_code_execution_mode")
SELF_ENTRY_SKIPPED = "it launches this bridge itself"  # the problem line of an entry that does


@dataclass(frozen=True)
class ServerSpec:
    """One configured MCP server. `env` and `headers` are stored as read-only
    MappingProxyType copies; they take part in == but not in hash() (a mappingproxy is not
    hashable), so a spec is immutable, hashable, and equal specs hash equal."""

    name: str
    alias: str
    transport: Transport
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)
    source: str = ""

    def __post_init__(self) -> None:
        # Callers may pass a list or a dict: keep private read-only copies.
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))


@dataclass(frozen=True)
class DiscoveryResult:
    servers: tuple[ServerSpec, ...]  # sorted by alias
    problems: tuple[str, ...]  # "<file>: <what is wrong>", one per line
    sources: tuple[str, ...]  # labels of the files that exist and were read, lowest precedence first
    untrusted: tuple[str, ...] = ()  # names of project servers found but not trusted (not started)
    # The problems (each also in `problems`) of config files that could not be used at all:
    # every server they configure is missing, so the sandbox and the model are told.
    unusable: tuple[str, ...] = ()


@dataclass(frozen=True)
class ConfigSource:
    """One file that may configure MCP servers, and where its server table sits in it."""

    client: str  # who writes the file, for docs and logs
    path: Path
    keys: tuple[tuple[str, ...], ...] = (("mcpServers",),)  # key paths; the first present is used
    format: Literal["json", "toml"] = "json"
    scope: str = ""  # names the table when one file holds several: "projects[/work/x]"
    url_transport: Transport = "http"  # an entry with a url and no type (Gemini CLI: sse)
    required: bool = False  # a missing file is a problem (only the explicit MCP_SERVERS_CONFIG)
    project: str = ""  # a file that comes with the repository: the client whose trust it needs

    @property
    def label(self) -> str:
        return "%s %s" % (self.path, self.scope) if self.scope else str(self.path)


def config_sources(
    home: Path,
    cwd: Path,
    platform: str,
    environ: Mapping[str, str],
    state_dir: Path,
    explicit: Path | None,
    clients: bool = True,
) -> list[ConfigSource]:
    """The table above, for this host: every file discovery looks at, lowest precedence first.
    MCP_SERVERS_CONFIG, when given, is the only source ("this file", as users expect);
    ``clients=False`` (MCP_BRIDGE_DISCOVER=0) leaves out every client's config."""
    servers = (("servers",),)
    if explicit is not None:
        return [ConfigSource("MCP_SERVERS_CONFIG", explicit, keys=(("mcpServers",), *servers), required=True)]
    own = [ConfigSource("bridge state dir", path) for path in sorted(state_dir.glob("*.json"))]
    if not clients:
        return own
    if platform == "darwin":
        app_config = home / "Library" / "Application Support"
    elif platform == "win32":
        app_config = Path(environ.get("APPDATA") or home / "AppData" / "Roaming")
    else:
        xdg = Path(environ.get("XDG_CONFIG_HOME", ""))
        app_config = xdg if xdg.is_absolute() else home / ".config"  # the XDG spec ignores relative paths
    vscode = app_config / "Code" / "User"
    claude_json = home / ".claude.json"
    return [
        *own,
        ConfigSource("Claude Desktop", app_config / "Claude" / "claude_desktop_config.json"),
        ConfigSource("Windsurf", home / ".codeium" / "windsurf" / "mcp_config.json"),
        ConfigSource("Gemini CLI", home / ".gemini" / "settings.json", url_transport="sse"),
        ConfigSource(
            "Codex",
            Path(environ.get("CODEX_HOME") or home / ".codex") / "config.toml",
            keys=(("mcp_servers",),),
            format="toml",
        ),
        ConfigSource("VS Code", vscode / "mcp.json", keys=servers),
        ConfigSource("VS Code", vscode / "settings.json", keys=(("mcp", "servers"),)),
        ConfigSource("Cursor", home / ".cursor" / "mcp.json"),
        ConfigSource("Claude Code", claude_json),
        ConfigSource("VS Code (project)", cwd / ".vscode" / "mcp.json", keys=servers, project="VS Code"),
        ConfigSource("Cursor (project)", cwd / ".cursor" / "mcp.json", project="Cursor"),
        ConfigSource(
            "Claude Code (project)",
            claude_json,
            keys=(("projects", str(cwd), "mcpServers"),),
            scope="projects[%s]" % cwd,
        ),
        ConfigSource("Claude Code (project)", cwd / ".mcp.json", project="Claude Code"),
    ]


# --- reading one file ---------------------------------------------------------------

# Client configs are kilobytes, but Claude Code keeps its history in ~/.claude.json, which
# users report at 65 to 101 MB: the cap must read those and still stop a /dev/zero.
MAX_CONFIG_FILE_BYTES = 128 * 1024 * 1024
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(path: Path, mode: int) -> OSError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
    return OSError(errno.EINVAL, "it is %s, not a regular file" % kind, str(path))


def read_config_bytes(path: Path, limit: int = MAX_CONFIG_FILE_BYTES) -> tuple[bytes, os.stat_result]:
    """A config file's bytes and its status, read only from a regular file (symlinks
    followed) of at most `limit` bytes: a link to /dev/zero or a FIFO must not hang or
    bloat whoever reads it. FileNotFoundError or NotADirectoryError when it is absent;
    another OSError, whose strerror says what is wrong, when it cannot be used."""
    refused = _not_regular(path, os.stat(path).st_mode)  # before opening: opening a device may act
    if refused is not None:
        raise refused
    # O_NONBLOCK: if a FIFO replaced the file since the stat, opening it cannot wait for a writer.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        refused = _not_regular(path, status.st_mode)
        if refused is not None:
            raise refused
        too_large = OSError(errno.EFBIG, "it is larger than %d MiB" % (limit // (1024 * 1024)), str(path))
        if status.st_size > limit:
            raise too_large
        data = file.read(limit + 1)  # bounded too: a file may grow while it is read
    if len(data) > limit:
        raise too_large
    return data, status


def write_atomically(path: Path, data: bytes, check: Callable[[], None] | None = None) -> None:
    """Replace ``path`` by ``data`` in one step: a temporary file beside it, flushed to disk,
    then os.replace, so a reader finds the old file or the new one, never a torn one. An
    existing file keeps its mode; a new one is private (0600): config entries and caches
    may hold tokens. ``check`` runs right before the replace and may raise to keep the
    file as it is."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    temporary = path.with_name(".%s.%s.tmp" % (path.name, secrets.token_hex(4)))
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, mode)
        if check is not None:
            check()
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# A JSON string (kept as is), or what JSONC adds to JSON (blanked out).
_JSON_STRING = r'("(?:\\.|[^"\\])*")'
_JSONC_COMMENT = re.compile(_JSON_STRING + r"|//[^\n]*|/\*.*?\*/", re.DOTALL)
_JSONC_TRAILING_COMMA = re.compile(_JSON_STRING + r"|,(?=\s*[\]}])")


def _keep_strings(match: re.Match[str]) -> str:
    # Blank out with spaces, keeping newlines, so error positions still match the file.
    return match.group(1) or re.sub(r"[^\n]", " ", match.group())


def strip_jsonc(text: str) -> str:
    """JSON with comments and trailing commas -> JSON. Strings are matched first and kept,
    so "https://..." or "/* */" inside a string survive."""
    return _JSONC_TRAILING_COMMA.sub(_keep_strings, _JSONC_COMMENT.sub(_keep_strings, text))


def _read_document(path: Path, format: Literal["json", "toml"]) -> JSON:
    """The parsed file. Raises FileNotFoundError when it is absent, OSError or ValueError
    (which covers JSON, TOML and UTF-8 decoding errors) when it cannot be used."""
    # -sig: editors on Windows may add a BOM
    document: JSON = parse_document(read_config_bytes(path)[0].decode("utf-8-sig"), format)
    return document


def parse_document(text: str, format: Literal["json", "toml"]) -> Any:
    """A config file's text, parsed as discovery reads it (JSON with comments, or TOML);
    ValueError when it cannot be."""
    if format == "toml":
        return tomllib.loads(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(strip_jsonc(text))


def _server_table(document: JSON, source: ConfigSource) -> dict[str, JSON] | None:
    """The servers table of a parsed file, None when it has none; ValueError when the
    document or a table on the way has the wrong type."""
    if not isinstance(document, dict):
        raise ValueError("the top level is not an object")
    for keys in source.keys:
        node: JSON = document
        for depth, key in enumerate(keys):
            if not isinstance(node, dict):
                raise ValueError("%s is not an object" % ".".join(keys[:depth]))
            node = node.get(key)
            if node is None:
                break
        else:
            if not isinstance(node, dict):
                raise ValueError("%s is not an object" % ".".join(keys))
            return node
    return None


# --- one server entry ---------------------------------------------------------------

_REMOTE_TYPES: dict[str, Transport] = {
    "http": "http",
    "streamable-http": "http",
    "streamableHttp": "http",
    "sse": "sse",
}
_URL_KEYS = ("url", "serverUrl", "httpUrl")  # serverUrl: Windsurf; httpUrl: Gemini CLI's streamable HTTP
_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_ENV_REFERENCE = re.compile(r"(?:env:)?([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def editor_variables(home: Path, cwd: Path) -> dict[str, str]:
    """VS Code's predefined variables that have a meaning here: the workspace is the
    directory the bridge was started in (where clients start it)."""
    return {"workspaceFolder": str(cwd), "workspaceFolderBasename": cwd.name, "userHome": str(home)}


def expand_variables(
    value: str, environ: Mapping[str, str], editor: Mapping[str, str] | None = None
) -> tuple[str, list[str], list[str]]:
    """Replace ${VAR}, ${VAR:-default}, ${env:VAR} and the ``editor`` variables
    (${workspaceFolder}). Returns the expanded text, the unset variables that had no
    default (they expand to ""), and the references nothing here can resolve
    (${input:key}: VS Code asks the user; they expand to "", never to their own text)."""
    unset: list[str] = []
    unresolved: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        inner = match.group(1)
        if editor is not None and inner in editor:
            return editor[inner]
        variable = _ENV_REFERENCE.fullmatch(inner)
        if variable is None:
            unresolved.append(match.group(0))
            return ""
        name, default = variable.group(1), variable.group(2)
        found = environ.get(name)
        if found or default is None:
            if found is None:
                unset.append(name)
            return found or ""
        return default

    return _REFERENCE.sub(substitute, value), list(dict.fromkeys(unset)), list(dict.fromkeys(unresolved))


def _entry_text(entry: Mapping[str, object], key: str) -> str | None:
    value = entry.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError("%s must be a string" % key)
    return value


def _text_list(entry: Mapping[str, object], key: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError("%s must be a list of strings" % key)
    return value


def _text_map(entry: Mapping[str, object], key: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise ValueError("%s must be an object whose values are strings" % key)
    return value


def _transport(entry: Mapping[str, object], source: ConfigSource) -> Transport:
    kind = _entry_text(entry, "type")
    if kind == "stdio" or (kind is None and entry.get("command") is not None):
        return "stdio"
    if kind is None and entry.get("httpUrl") is not None:
        return "http"
    if kind is None and any(entry.get(key) is not None for key in _URL_KEYS):
        return source.url_transport
    if kind is None:
        raise ValueError("it has neither a command nor a url")
    if kind not in _REMOTE_TYPES:
        raise ValueError("type %r is not one of stdio, http, streamable-http, sse" % kind)
    return _REMOTE_TYPES[kind]


def _parse_entry(
    name: str,
    entry: JSON,
    source: ConfigSource,
    environ: Mapping[str, str],
    self_markers: tuple[str, ...],
    editor: Mapping[str, str] | None = None,
) -> tuple[ServerSpec | None, list[str]]:
    """One entry of a servers table -> (its spec, or None when it is skipped; problem lines).
    The alias is assigned later, once every name is known."""
    try:
        if not isinstance(entry, dict):
            raise ValueError("the entry is not an object")
        if entry.get("disabled") is True or entry.get("enabled") is False:  # enabled: Codex
            return None, []
        transport = _transport(entry, source)
        if transport == "stdio":
            command = _entry_text(entry, "command")
            if not command:
                raise ValueError("a stdio server needs a command")
            raw = ServerSpec(
                name,
                "",
                transport,
                command=command,
                args=tuple(_text_list(entry, "args")),
                env=_text_map(entry, "env"),
                cwd=_entry_text(entry, "cwd"),
            )
        else:
            url = next(filter(None, (_entry_text(entry, key) for key in _URL_KEYS)), None)
            if url is None:
                raise ValueError("a %s server needs a url" % transport)
            headers = {**_text_map(entry, "headers"), **_text_map(entry, "http_headers")}  # http_: Codex
            raw = ServerSpec(name, "", transport, url=url, headers=headers)
    except ValueError as exc:
        return None, ["%s: skipped %s: %s" % (source.label, name, exc)]

    unset: list[str] = []
    unresolved: list[str] = []

    def expand(value: str) -> str:
        expanded, missing, unknown = expand_variables(value, environ, editor)
        unset.extend(missing)
        unresolved.extend(unknown)
        return expanded

    spec = replace(
        raw,
        command=raw.command and expand(raw.command),
        args=tuple(expand(arg) for arg in raw.args),
        env={key: expand(value) for key, value in raw.env.items()},
        cwd=raw.cwd and expand(raw.cwd),
        url=raw.url and expand(raw.url),
        headers={key: expand(value) for key, value in raw.headers.items()},
        source=source.label,
    )
    if spec.command and launches_self((spec.command, *spec.args), self_markers):
        return None, ["%s: skipped %s: %s" % (source.label, name, SELF_ENTRY_SKIPPED)]
    if unresolved:  # a prompt for a secret (${input:...}): starting without it would mislead
        return None, [
            "%s: skipped %s: %s cannot be resolved here (VS Code asks for ${input:...} values "
            "itself); write ${env:NAME} and set NAME in the bridge's environment instead"
            % (source.label, name, ", ".join(dict.fromkeys(unresolved)))
        ]
    return spec, [
        "%s: server %s: ${%s} is not set, so it expanded to an empty string" % (source.label, name, variable)
        for variable in dict.fromkeys(unset)
    ]


# --- project servers: whose trust they need -------------------------------------------

ALL_PROJECT_SERVERS = "MCP_BRIDGE_PROJECT_SERVERS=all in the bridge's environment starts every project server"
MAX_SHOWN_NAME_CHARS = 100


def printable(text: str) -> str:
    """`text` with escapes instead of control characters: it may come from a file the user
    did not write (a repository's .mcp.json) and reach a terminal."""
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def shown_name(name: str) -> str:
    """A server name from such a file, as a person or the model sees it: printable, bounded."""
    return printable(name[:MAX_SHOWN_NAME_CHARS]) + ("..." if len(name) > MAX_SHOWN_NAME_CHARS else "")


@dataclass(frozen=True)
class ClaudeCodeApprovals:
    """What Claude Code records about this folder's .mcp.json servers. Its settings files
    (~/.claude/settings.json, the project's .claude/settings.json and settings.local.json)
    count only in a folder whose trust dialog was accepted, as in Claude Code: a cloned
    repository cannot approve its own servers."""

    trusted: bool  # hasTrustDialogAccepted for this folder or a parent
    enable_all: bool  # enableAllProjectMcpServers
    enabled: frozenset[str]  # enabledMcpjsonServers
    disabled: frozenset[str]  # disabledMcpjsonServers: rejected, whatever else says


def claude_code_settings_files(home: Path, cwd: Path) -> list[Path]:
    return [
        home / ".claude" / "settings.json",
        cwd / ".claude" / "settings.json",
        cwd / ".claude" / "settings.local.json",
    ]


def claude_code_approvals(claude_json: JSON, settings: Sequence[JSON], cwd: Path) -> ClaudeCodeApprovals:
    """From the parsed ~/.claude.json and settings files (None or anything malformed: no
    approval there)."""
    projects = claude_json.get("projects") if isinstance(claude_json, dict) else None
    projects = projects if isinstance(projects, dict) else {}
    trusted = any(
        json_field(projects, str(folder), "hasTrustDialogAccepted") is True for folder in (cwd, *cwd.parents)
    )
    layers = [layer for layer in (projects.get(str(cwd)), *settings) if isinstance(layer, dict)]

    def names(key: str) -> frozenset[str]:
        found = [layer.get(key) for layer in layers]
        return frozenset(
            name for value in found if isinstance(value, list) for name in value if isinstance(name, str)
        )

    return ClaudeCodeApprovals(
        trusted=trusted,
        enable_all=any(layer.get("enableAllProjectMcpServers") is True for layer in layers),
        enabled=names("enabledMcpjsonServers"),
        disabled=names("disabledMcpjsonServers"),
    )


def untrusted_reason(
    source: ConfigSource, name: str, approvals: ClaudeCodeApprovals, cwd: Path, state_dir: Path
) -> str | None:
    """Why a project file's server is not started under MCP_BRIDGE_PROJECT_SERVERS=trusted,
    with how to allow it (a problem line); None when its client records it as trusted."""
    if source.project == "Claude Code":
        if name in approvals.disabled:
            why = (
                "Claude Code rejected it (disabledMcpjsonServers). To allow it, enable it in Claude Code "
                "(/mcp in %s) or take it out of disabledMcpjsonServers" % cwd
            )
        elif not approvals.trusted:
            why = (
                "this folder's trust dialog has not been accepted in Claude Code. To allow it, run "
                "`claude` in %s, trust the folder and approve the server" % cwd
            )
        elif not (approvals.enable_all or name in approvals.enabled):
            why = (
                "it has not been approved in Claude Code (enabledMcpjsonServers). To allow it, run "
                "`claude` in %s and approve it" % cwd
            )
        else:
            return None
    else:
        why = (
            "%s keeps workspace trust where the bridge cannot read it, so its project servers are not "
            "started. To allow it, copy the entry to %s" % (source.project, state_dir / "servers.json")
        )
    return "%s: not started: %s is found but not trusted: %s; or %s." % (
        source.label,
        shown_name(name),
        why,
        ALL_PROJECT_SERVERS,
    )


# --- aliases and the whole discovery ------------------------------------------------


def sanitize_alias(name: str) -> str:
    """A Python identifier for `mcp_<alias>`: lower case, runs of anything but [a-z0-9] -> "_"."""
    alias = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if alias[:1].isdigit():
        return "s_" + alias
    return alias or "server"


def assign_aliases(names: Iterable[str]) -> dict[str, str]:
    """name -> alias, unique. Names that sanitize alike are sorted: the first keeps the
    alias, the next get _2, _3, ... (skipping any alias another name already has)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        groups.setdefault(sanitize_alias(name), []).append(name)
    taken = set(groups)
    aliases: dict[str, str] = {}
    for alias, members in sorted(groups.items()):
        aliases[members[0]] = alias
        suffix = 2
        for name in members[1:]:
            while "%s_%d" % (alias, suffix) in taken:
                suffix += 1
            aliases[name] = "%s_%d" % (alias, suffix)
            taken.add(aliases[name])
    return aliases


def launches_self(argv: Sequence[str], self_markers: tuple[str, ...]) -> bool:
    """True when a command line runs this bridge: some word of it, taken as a program name
    (base name, without .py/.exe or a version pin such as @latest or ==1.0), IS one of the
    markers. A path that merely contains the project's name (a checkout directory) is not."""
    for part in argv:
        name = re.split(r"[@=<>~!\[]", part.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1], maxsplit=1)[0]
        name = name.removesuffix(".exe").removesuffix(".py")
        if name in self_markers:
            return True
    return False


def _names_this_bridge(entry: JSON, self_markers: tuple[str, ...]) -> bool:
    """An entry that launches this bridge (a project's .mcp.json often lists it): never
    started, whoever trusts it, so _parse_entry says that instead of "not trusted"."""
    command, args = json_field(entry, "command"), json_field(entry, "args")
    if not isinstance(command, str):
        return False
    words = [arg for arg in args if isinstance(arg, str)] if isinstance(args, list) else []
    return launches_self([command, *words], self_markers)


class _ConfigDocuments:
    """The config files read so far, each read once (~/.claude.json serves three purposes),
    or the error reading it raised."""

    def __init__(self) -> None:
        self.by_path: dict[Path, JSON | OSError | ValueError] = {}

    def read(self, path: Path, format: Literal["json", "toml"]) -> JSON:
        if path not in self.by_path:
            try:
                self.by_path[path] = _read_document(path, format)
            except (OSError, ValueError) as exc:
                self.by_path[path] = exc
        document = self.by_path[path]
        if isinstance(document, Exception):
            raise document
        return document

    def optional(self, path: Path) -> JSON:
        """The JSON document at ``path``, or None: an approval that cannot be read approves nothing."""
        with suppress(OSError, ValueError):
            return self.read(path, "json")
        return None


@dataclass
class _Discovered:
    """What discover_servers has found so far, in the order it found it."""

    chosen: dict[str, tuple[ServerSpec | None, list[str]]] = field(default_factory=dict)  # by name
    problems: list[str] = field(default_factory=list)
    unusable: list[str] = field(default_factory=list)  # also in problems
    read: list[str] = field(default_factory=list)
    untrusted: list[str] = field(default_factory=list)

    def cannot_use(self, problem: str) -> None:
        self.problems.append(problem)
        self.unusable.append(problem)

    def result(self) -> DiscoveryResult:
        """The servers chosen, aliased and sorted; the problem lines of the entries chosen
        come last (those of entries a later file replaced are gone with them)."""
        specs = [spec for spec, _ in self.chosen.values() if spec is not None]
        problems = self.problems + [line for _, lines in self.chosen.values() for line in lines]
        aliases = assign_aliases(spec.name for spec in specs)
        servers = sorted((replace(spec, alias=aliases[spec.name]) for spec in specs), key=lambda s: s.alias)
        # dict.fromkeys: ~/.claude.json is read for two sources; report it once.
        return DiscoveryResult(
            tuple(servers),
            tuple(dict.fromkeys(problems)),
            tuple(dict.fromkeys(self.read)),
            tuple(dict.fromkeys(self.untrusted)),
            tuple(dict.fromkeys(self.unusable)),
        )


def _source_table(source: ConfigSource, documents: _ConfigDocuments, found: _Discovered) -> dict[str, JSON]:
    """The server table of one config file (empty if it has none); why it cannot be used,
    if so, goes to ``found``."""
    try:
        document = documents.read(source.path, source.format)
    except (FileNotFoundError, NotADirectoryError):
        if source.required:
            found.cannot_use("%s: the file does not exist" % source.path)
        return {}
    except (OSError, ValueError) as exc:
        found.read.append(source.label)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        found.cannot_use("%s: cannot be used: %s" % (source.path, reason))
        return {}
    found.read.append(source.label)
    try:
        table = _server_table(document, source)
    except ValueError as exc:
        found.cannot_use("%s: cannot be used: %s" % (source.label, exc))
        return {}
    if table is None and source.required:
        found.cannot_use("%s: has no mcpServers or servers table" % source.label)
    return table or {}


def discover_servers(
    home: Path,
    cwd: Path,
    platform: str,
    environ: Mapping[str, str],
    state_dir: Path,
    explicit: Path | None,
    self_markers: tuple[str, ...] = SELF_MARKERS,
    clients: bool = True,
    project_servers: ProjectServers = "trusted",
) -> DiscoveryResult:
    """Every configured MCP server, merged by name across config_sources(). Never raises
    for bad input: what cannot be used is skipped and described in `problems`; problem
    lines of entries that a later file replaced are dropped with them. The project's own
    files are read as `project_servers` says (see the table above)."""
    found = _Discovered()
    editor = editor_variables(home, cwd)
    documents = _ConfigDocuments()
    approvals: ClaudeCodeApprovals | None = None
    for source in config_sources(home, cwd, platform, environ, state_dir, explicit, clients):
        if source.project and project_servers == "none":
            continue
        for name, entry in _source_table(source, documents, found).items():
            if (
                source.project
                and project_servers == "trusted"
                and not _names_this_bridge(entry, self_markers)
            ):
                if approvals is None:
                    approvals = claude_code_approvals(
                        documents.optional(home / ".claude.json"),
                        [documents.optional(path) for path in claude_code_settings_files(home, cwd)],
                        cwd,
                    )
                refusal = untrusted_reason(source, name, approvals, cwd, state_dir)
                if refusal is not None:
                    found.untrusted.append(shown_name(name))
                    found.problems.append(refusal)
                    continue
            found.chosen[name] = _parse_entry(name, entry, source, environ, self_markers, editor)
    return found.result()


def unusable_config_notices(discovery: DiscoveryResult) -> list[str]:
    """What the first result of each sandbox says of each config file that could not be
    used: its servers are missing, and only the user can fix the file."""
    return [
        "An MCP server configuration file could not be used, so the servers it configures are missing: "
        "%s. Tell the user: once the file is fixed, restart this MCP server (or the client) to read it."
        % problem
        for problem in discovery.unusable
    ]


# =============================================================================
# MCP client pool
# =============================================================================


async def _first_of(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as group:

        async def wait_for(event: anyio.Event) -> None:
            await event.wait()
            group.cancel_scope.cancel()

        for event in events:
            group.start_soon(wait_for, event)


def _innermost(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (task groups wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _describe_exception(exc: BaseException) -> str:
    """One line for the model: the innermost cause of a (possibly grouped) failure."""
    from mcp.shared.exceptions import MCPError as McpProtocolError

    exc = _innermost(exc)
    if isinstance(exc, McpProtocolError):
        return exc.message
    text = str(exc).strip().splitlines()
    described = "%s: %s" % (type(exc).__name__, text[0]) if text else type(exc).__name__
    request = failed_request(exc)
    return "%s (%s)" % (described, shown_request(request)) if request is not None else described


def failed_request(exc: BaseException) -> Any | None:
    """The HTTP request an exception of httpx's failed (its RequestError's), or None. A
    connection error alone does not say whether the server, or an authorization server it
    sent the client to, was out of reach."""
    try:
        request = exc.request  # type: ignore[attr-defined]  # httpx raises RuntimeError when it has none
    except (AttributeError, RuntimeError):
        return None
    return request if hasattr(request, "method") and hasattr(request, "url") else None


def shown_request(request: Any) -> str:
    """An httpx request's method and URL: scheme, host, port and path (a query or a user
    part may hold secrets)."""
    url = request.url
    port = ":%d" % url.port if url.port else ""
    return "%s %s://%s%s%s" % (request.method, url.scheme, url.host, port, url.path)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_origin(url: str) -> tuple[str, str | None, int | None]:
    """A URL's scheme, host and port (the scheme's default where none is written)."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port or _DEFAULT_PORTS.get(parts.scheme)


def _leaves(exc: BaseException) -> Iterable[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


# What a dropped connection raises, bare or grouped by a task group. (TimeoutError is an
# OSError too: callers test for it first, a timeout is not a dropped connection.)
_TRANSPORT_FAILURES = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)


def _is_transport_failure(exc: BaseException) -> bool:
    return all(isinstance(leaf, _TRANSPORT_FAILURES) for leaf in _leaves(exc))


MAX_LIST_PAGES = 100  # pages of a */list followed (a server could page forever)


class _Page(Protocol):
    @property
    def next_cursor(self) -> str | None: ...


_PageT = TypeVar("_PageT", bound=_Page)
_Item = TypeVar("_Item")


async def all_pages(
    list_page: Callable[..., Awaitable[_PageT]], items_of: Callable[[_PageT], Sequence[_Item]]
) -> list[_Item]:
    """Every item of a paginated */list (``list_page(params=...)``), up to MAX_LIST_PAGES."""
    items: list[_Item] = []
    cursor: str | None = None
    for _ in range(MAX_LIST_PAGES):
        page = await list_page(params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
        items.extend(items_of(page))
        cursor = page.next_cursor
        if not cursor:
            break
    return items


async def list_all_tools(session: ClientSession) -> list[types.Tool]:
    """Every tool of a server, following tools/list pagination."""
    return await all_pages(session.list_tools, lambda page: page.tools)


async def list_all_resources(session: ClientSession) -> dict[str, Any]:
    """A server's resources and templates (runtime.list_resources), following pagination."""
    from mcp.shared.exceptions import MCPError as McpProtocolError

    resources = await all_pages(session.list_resources, lambda page: page.resources)
    try:
        templates = await all_pages(session.list_resource_templates, lambda page: page.resource_templates)
    except McpProtocolError as exc:
        if exc.code != types.METHOD_NOT_FOUND:
            raise
        templates = []  # a server may offer resources without templates
    dump = partial(BaseModel.model_dump, by_alias=True, exclude_none=True, mode="json")
    return {
        "resources": [dump(item) for item in resources],
        "resourceTemplates": [dump(item) for item in templates],
    }


async def list_all_prompts(session: ClientSession) -> types.ListPromptsResult:
    """A server's prompts, following pagination."""
    return types.ListPromptsResult(prompts=await all_pages(session.list_prompts, lambda page: page.prompts))


# --- tool lists, tool by tool -----------------------------------------------------------
# The SDK validates a tools/list result as a whole: one tool whose inputSchema is {} (real
# servers ship such tools) makes the whole list fail, and every tool of that server
# vanishes. The read stream between transport and session (CheckedReadStream) checks each
# listing on its way to the session: a tool that fails alone is repaired when that is
# safe (an inputSchema or outputSchema without "type" gets "type": "object", which tool
# arguments and structured results always are) or else left out and named; the session
# sees a valid list of the rest, and its output-schema checks of call results use the
# repaired schemas.
MAX_NAMED_BAD_TOOLS = 10  # tools a notice names; more are counted


def _listing_problem(result: Mapping[str, Any], version: str) -> str | None:
    """Why the SDK's session would refuse ``result`` as a tools/list answer (its checks:
    the negotiated version's wire schema, then the SDK's model), or None."""
    try:
        with suppress(KeyError):  # a method or version the SDK has no wire schema for
            import mcp_types.methods

            mcp_types.methods.validate_server_result("tools/list", version, result)
        types.ListToolsResult.model_validate(result, by_name=False)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        if not errors:
            return type(exc).__name__
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"] if not isinstance(part, int))
        return clean_text("%s: %s" % (where, first["msg"]) if where else first["msg"])[:200]
    return None


@dataclass(frozen=True)
class CheckedListing:
    """A tools/list result as the session gets it: ``result``, with ``repaired`` (tool
    names) mended and ``dropped`` ((tool name, why)) left out."""

    result: dict[str, Any]
    repaired: tuple[str, ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()


def _mended_tool(tool: object) -> dict[str, Any] | None:
    """``tool`` with "type": "object" added to an inputSchema or outputSchema that has no
    "type" (tool arguments and structured results are objects in every MCP version, so
    it says what the schema left implicit), or None when neither lacks it."""
    if not isinstance(tool, dict):
        return None
    mended = dict(tool)
    for key in ("inputSchema", "outputSchema"):
        schema = tool.get(key)
        if isinstance(schema, dict) and "type" not in schema:
            mended[key] = {"type": "object", **schema}
    return mended if mended != tool else None


def check_tool_listing(result: dict[str, Any], version: str) -> CheckedListing:
    """``result`` of tools/list, checked tool by tool when the SDK would refuse it whole.
    Unchanged when it is valid, or when what is wrong is not in its tools (the session
    then reports that as before)."""
    tools = result.get("tools")
    if not isinstance(tools, list) or _listing_problem(result, version) is None:
        return CheckedListing(result)
    page = {key: value for key, value in result.items() if key != "tools"}
    if _listing_problem(page | {"tools": []}, version) is not None:
        return CheckedListing(result)
    kept: list[Any] = []
    repaired: list[str] = []
    dropped: list[tuple[str, str]] = []
    for number, tool in enumerate(tools, start=1):
        name = tool.get("name") if isinstance(tool, dict) else None
        shown = "'%s'" % shown_name(name) if isinstance(name, str) else "#%d (no name)" % number
        problem = _listing_problem(page | {"tools": [tool]}, version)
        if problem is None:
            kept.append(tool)
            continue
        mended = _mended_tool(tool)
        if mended is not None:
            problem = _listing_problem(page | {"tools": [mended]}, version)
            if problem is None:
                kept.append(mended)
                repaired.append(shown)
                continue
        dropped.append((shown, str(problem).removeprefix("tools.")))
    return CheckedListing(page | {"tools": kept}, tuple(repaired), tuple(dropped))


def _plural(count: int) -> str:
    return "" if count == 1 else "s"


def dropped_tools_notice(server: str, dropped: Sequence[tuple[str, str]], kept: int) -> str:
    named = "; ".join("%s (%s)" % pair for pair in dropped[:MAX_NAMED_BAD_TOOLS])
    more = " and %d more" % (len(dropped) - MAX_NAMED_BAD_TOOLS) if len(dropped) > MAX_NAMED_BAD_TOOLS else ""
    return (
        "MCP server %r lists %d tool%s that MCP clients cannot use, left out: %s%s. Its other %d tool%s "
        "work; the server's authors can fix the listing."
        % (server, len(dropped), _plural(len(dropped)), named, more, kept, _plural(kept))
    )


# --- stdio transport with a size cap ---------------------------------------------------
# The SDK's stdio_client re-joins its whole line buffer on every 64 KiB read, so a line
# costs quadratic time: measured through the bridge, a 20 MB result line took 2 s, 50 MB
# 11 s, 100 MB 66 s (41 s of CPU, 650 MB peak memory) before the cap in SandboxAPI.call_tool
# refused it. This transport splits lines in linear time and drops a line over the cap
# as it arrives (a 200 MB line: 0.1 s of CPU), answering the request it belonged to.

RESULT_ENVELOPE_SLACK = 64 * 1024  # JSON-RPC envelope around a capped tool result
_READ_CHUNK = 1 << 20
_READ_CHUNK_ON_LOOP = 1 << 16  # a pipe's default size; a 1 MiB buffer costs 15x as much to make
_LINE_EDGE = 1024  # bytes kept of each end of a discarded line: enough to find its id
_SERVER_EXIT_GRACE = 2.0  # seconds per shutdown step: stdin closed, SIGTERM, SIGKILL
OVERSIZED = "mcp-bridge:oversized"  # marks the error the bridge answers in place of a discarded line
INVALID = "mcp-bridge:invalid"  # marks the error the bridge answers in place of an invalid response


@dataclass(frozen=True)
class OversizedLine:
    """A line over the cap, discarded as it arrived: its size and its two ends."""

    size: int
    head: bytes
    tail: bytes


class LineSplitter:
    """Splits a byte stream into lines in linear time, holding at most `max_line` bytes
    of one line; a longer line is dropped as it arrives and comes out as an
    OversizedLine."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._parts: list[bytes] = []
        self._size = 0
        self._head: bytes | None = None  # set while a line is being discarded
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes | OversizedLine]:
        lines: list[bytes | OversizedLine] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:end])
            lines.append(self._finish())
            start = end + 1
        self._add(chunk[start:])
        return lines

    def rest(self) -> bytes | OversizedLine | None:
        """The last line, when the stream ended without a newline after it."""
        return self._finish() if self._size or self._head is not None else None

    def _add(self, piece: bytes) -> None:
        self._size += len(piece)
        if self._head is None and self._size <= self.max_line:
            self._parts.append(piece)
            return
        pieces = [piece]
        if self._head is None:  # over the cap: from now on only the two ends are kept
            pieces, self._parts, self._head = [*self._parts, piece], [], b""
        for part in pieces:
            self._head += part[: _LINE_EDGE - len(self._head)]
            self._tail = (self._tail + part[-_LINE_EDGE:])[-_LINE_EDGE:]

    def _finish(self) -> bytes | OversizedLine:
        line: bytes | OversizedLine
        if self._head is None:
            line = b"".join(self._parts)
        else:
            line = OversizedLine(self._size, self._head, self._tail)
        self._parts, self._size, self._head, self._tail = [], 0, None, b""
        return line


# The top level of a JSON-RPC message whose large member was discarded: the simple
# members before it (head) and after it (tail). Sound for valid JSON: an unescaped quote
# right after "{" or "," cannot be inside a string.
_JSON_SCALAR = rb'-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|"[^"\\]*"|true|false|null'
_JSON_MEMBER = rb'\s*"[^"\\]*"\s*:\s*(?:' + _JSON_SCALAR + rb")\s*"
_JSON_MEMBER_PARTS = re.compile(rb'"([^"\\]*)"\s*:\s*(' + _JSON_SCALAR + rb")")
_JSON_HEAD = re.compile(rb"\s*\{((?:" + _JSON_MEMBER + rb',)*)\s*"([^"\\]*)"\s*:')
_JSON_TAIL = re.compile(rb"((?:," + _JSON_MEMBER + rb")*)\}\s*$")


def id_at_ends(head: bytes, tail: bytes) -> tuple[bytes | None, int | str | None]:
    """For a JSON-RPC message read only at its two ends: the key of the first top-level
    member that is not a simple value (None when `head` does not start a JSON object that
    way), and the message's id when it was among the simple members kept at either end."""
    opening = _JSON_HEAD.match(head)
    if opening is None:
        return None, None
    closing = _JSON_TAIL.search(tail)
    members = _JSON_MEMBER_PARTS.findall(opening.group(1) + (closing.group(1) if closing else b""))
    for key, value in members:
        if key == b"id":
            found = json.loads(value)
            if isinstance(found, int | str) and not isinstance(found, bool):
                return opening.group(2), found
    return opening.group(2), None


def oversized_response_id(line: OversizedLine) -> int | str | None:
    """The id of the JSON-RPC response a discarded line carried (its "result" or
    "error" was the large member), or None when it is not a response or its id was not
    in the kept ends."""
    large, found = id_at_ends(line.head, line.tail)
    return found if large in (b"result", b"error") else None


def _server_item(line: bytes | OversizedLine, cap: int) -> SessionMessage | Exception | None:
    """What the ClientSession receives for one line from a stdio server."""
    from mcp.shared.message import SessionMessage

    if isinstance(line, OversizedLine):
        request_id = oversized_response_id(line)
        text = (
            "sent a %d-byte message, over the %d-byte cap (MCP_BRIDGE_MAX_TOOL_RESULT_BYTES), which the "
            "bridge discarded unread" % (line.size, cap)
        )
        if request_id is None:
            return OversizedMessageError(text)
        error = types.ErrorData(code=types.INTERNAL_ERROR, message=text, data={OVERSIZED: line.size})
        return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))
    if not line.strip():
        return None
    text = line.decode("utf-8", "replace")
    try:
        message = types.jsonrpc_message_adapter.validate_json(text, by_name=False)
    except ValueError as exc:
        return _repaired_item(text, exc)
    return SessionMessage(message)


def _repaired_item(text: str, exc: ValueError) -> SessionMessage | Exception:
    """A line the SDK's validator refused. Lone surrogates (``\\udcff`` escapes: valid JSON
    from a careless server, refused by the validator) are replaced and the message is
    validated again. A response that is still invalid answers its request with an error
    now (else the call would wait out MCP_BRIDGE_TOOL_TIMEOUT); anything else is junk on
    stdout, which the session reports while the connection stays."""
    from mcp.shared.message import SessionMessage

    try:
        cleaned = _without_lone_surrogates(json.loads(text))
    except (ValueError, RecursionError):  # not JSON at all (or absurdly deep)
        return exc
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_python(cleaned, by_name=False))
    except ValueError as invalid:
        request_id = cleaned.get("id") if isinstance(cleaned, dict) else None
        if not isinstance(request_id, int | str) or isinstance(request_id, bool):
            return exc
        if "method" in cleaned:  # a request or a notification: it answers nothing
            return exc
        problem = type(invalid).__name__
        if isinstance(invalid, ValidationError) and invalid.errors():
            errors = invalid.errors(include_url=False, include_input=False)
            as_response = [error for error in errors if error["loc"][:1] == ("JSONRPCResponse",)]
            first = (as_response or errors)[0]
            problem = "%s: %s" % (".".join(str(part) for part in first["loc"]), first["msg"])
        problem = clean_text(problem)[:300]
        error = types.ErrorData(code=types.INTERNAL_ERROR, message=problem, data={INVALID: problem})
        return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


def _without_lone_surrogates(value: Any) -> Any:
    """JSON data with each lone surrogate in its strings written as ``\\udcff`` text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, list):
        return [_without_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(key): _without_lone_surrogates(item) for key, item in value.items()}
    return value


# --- a stdio server's environment -------------------------------------------------------
# What a stdio server inherits from the bridge's environment, on top of the SDK's default
# (HOME, LOGNAME, PATH, SHELL, TERM, USER) and below its entry's own "env" (which wins):
# where the CA certificates and proxies are (without them `uvx mcp-server-time` behind a
# corporate proxy fails with "invalid peer certificate: UnknownIssuer"), the package
# indexes uvx/npx/pip install from, locale, time zone and the usual folders. No secrets
# by default: more names (or NAME_* prefixes) come from MCP_BRIDGE_PASS_ENV.
SERVER_ENV_PASSTHROUGH = (
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "PIP_CERT", "UV_NATIVE_TLS", "NPM_CONFIG_CAFILE", "npm_config_cafile",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_CACHE_DIR", "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL", "NPM_CONFIG_REGISTRY", "npm_config_registry",
    "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ",
    "TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR",
)  # fmt: skip


def server_environment(
    pass_env: Iterable[str], environ: Mapping[str, str], entry_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables a stdio server gets besides the SDK's default environment: those of
    SERVER_ENV_PASSTHROUGH and ``pass_env`` (names, or ``PREFIX_*``) that ``environ`` has,
    then its entry's own ``entry_env`` over them. Shell functions (values starting with
    "()") are left out, as the SDK does."""
    names = [*SERVER_ENV_PASSTHROUGH, *pass_env]
    exact = {name for name in names if not name.endswith("*")}
    prefixes = tuple(name[:-1] for name in names if name.endswith("*"))
    env = {
        key: value
        for key, value in environ.items()
        if (key in exact or (prefixes and key.startswith(prefixes))) and not value.startswith("()")
    }
    return env | dict(entry_env)


# --- how large a stdio server's messages are -------------------------------------------
# Data this small is walked on the event loop: a hop to a worker thread costs about 0.1 ms,
# more than walking it (see SandboxAPI._maybe_off_loop).
ON_LOOP_BYTES = 64 * 1024


class WireWatch:
    """Counts the messages over ON_LOOP_BYTES that a server's transport read (a stdio
    transport measures each line): a result that arrived while the count stayed the same
    was small. Where the transport measures nothing (HTTP, Windows) no result is small."""

    def __init__(self) -> None:
        self.measured = False
        self.large = 0

    def saw(self, size: int) -> None:
        if size > ON_LOOP_BYTES:
            self.large += 1

    def mark(self) -> int | None:
        """Before a request: what small_since needs."""
        return self.large if self.measured else None

    def small_since(self, mark: int | None) -> bool:
        """After its answer: whether every message read since ``mark`` was small."""
        return mark is not None and self.large == mark


# --- what a stdio server's process says, and how it ends --------------------------------
STDERR_TAIL_LINES = 10  # last lines of a server's stderr kept for the error when it fails to start
MAX_STDERR_LINE_CHARS = 300  # of one stderr line, in the log and in that error
_STDERR_LINE_BYTES = 8 * 1024  # a longer line is read as its first _LINE_EDGE bytes (LineSplitter)
MAX_SHOWN_COMMAND_CHARS = 300


class ServerProcessLog:
    """One run of a stdio server's process: each line of its stderr goes to the bridge's
    log with the server's name (cleaned, bounded); the last STDERR_TAIL_LINES are kept
    for the error when it cannot be started; and how the process ended, once it has."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.returncode: int | None = None

    def add(self, line: bytes | OversizedLine) -> None:
        data = line.head if isinstance(line, OversizedLine) else line
        text = printable(data.decode("utf-8", "replace").rstrip("\r"))
        if len(text) > MAX_STDERR_LINE_CHARS or isinstance(line, OversizedLine):
            text = text[:MAX_STDERR_LINE_CHARS] + "..."
        if text.strip():
            logger.info("MCP server %s: %s", shown_name(self.name), text)
            self.tail.append(text)

    @property
    def ending(self) -> str | None:
        """How the process ended ("exited with status 1", "was killed by signal 9
        (SIGKILL)"), or None while it runs or when it is not known."""
        code = self.returncode
        if code is None:
            return None
        if code < 0:
            try:
                signame = " (%s)" % signal.Signals(-code).name
            except ValueError:
                signame = ""
            return "was killed by signal %d%s" % (-code, signame)
        return "exited with status %d" % code

    def stderr_tail(self) -> str:
        """The kept stderr lines as the end of an error message ("" when there are none)."""
        if not self.tail:
            return ""
        return " Its last stderr lines:\n%s\n" % "\n".join("  " + line for line in self.tail)


def shown_command(command: str, args: Sequence[str]) -> str:
    """A server's command line as the model and the log see it: shell-quoted, printable, bounded."""
    text = printable(shlex.join([command, *args]))
    return text[:MAX_SHOWN_COMMAND_CHARS] + ("..." if len(text) > MAX_SHOWN_COMMAND_CHARS else "")


async def _open_server_process(params: StdioServerParameters) -> anyio.abc.Process:
    """A stdio server's process, started as the SDK's stdio_client starts it (the entry's
    environment over the SDK's default one)."""
    from mcp.client.stdio import get_default_environment

    return await anyio.open_process(
        [params.command, *params.args],
        env=get_default_environment() | (params.env or {}),
        stderr=subprocess.PIPE,  # read into process_log (the bridge's log); never its stdout
        cwd=params.cwd,
        start_new_session=True,  # its own process group, killed as a whole at the end
    )


class PulledStream(anyio.abc.ObjectReceiveStream["SessionMessage | Exception"]):
    """A transport's read stream whose items are read in the task that receives them (the
    session's own), ``fill`` at a time: a reader task behind a memory stream, as the SDK's
    transports have, costs a pass of the event loop per message. ``fill(stream)`` reads
    once and appends to ``stream.items``, or calls ``stream.end``; ``on_end(drained)``: what
    to do at the end (``drained`` False: the session is done before the pipe). Iteration
    and ``async with`` are anyio's stream protocol's."""

    def __init__(
        self, fill: Callable[[PulledStream], Awaitable[None]], on_end: Callable[[bool], None] | None = None
    ) -> None:
        self.items: deque[SessionMessage | Exception] = deque()
        self.ended = False
        self._fill = fill
        self._on_end = on_end

    async def receive(self) -> SessionMessage | Exception:
        while not self.items:
            if self.ended:
                raise anyio.EndOfStream
            await self._fill(self)
        return self.items.popleft()

    def end(self, drained: bool = False) -> None:
        """Nothing more for the session after the items it holds (``drained``: the pipe has
        ended too)."""
        if not self.ended:
            self.ended = True
            if self._on_end is not None:
                self._on_end(drained)

    def close(self) -> None:
        self.end()

    async def aclose(self) -> None:
        self.end()


class MessageWriter(anyio.abc.ObjectSendStream["SessionMessage"]):
    """A session's write stream that writes each message, as one line of JSON, in the task
    that sends it (``write_line``: the line without its newline). A task of its own behind
    a memory stream, as the SDK's transports have, costs a hop of the event loop per
    message; concurrent senders are ordered by ``write_line``, which writes whole lines.
    Closing it fails the sends still waiting to write (BrokenResourceError, as a memory
    stream whose reader is gone): a peer that no longer reads must not hold them until its
    pipe breaks."""

    def __init__(
        self,
        write_line: Callable[[bytes], Awaitable[None]],
        write_now: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.write_line = write_line
        # Hands a line over whole without a wait, where it can (else False): most lines, with
        # no cancel scope and no pass of the loop (a tenth of the bridge's work on a call).
        self.write_now = write_now
        self.closed = False
        self._waiting: set[anyio.CancelScope] = set()  # the sends in write_line now

    async def send(self, message: SessionMessage) -> None:
        if self.closed:
            raise anyio.ClosedResourceError
        line = message.message.model_dump_json(by_alias=True, exclude_unset=True).encode()
        if self.write_now is not None and self.write_now(line):
            return
        scope = anyio.CancelScope()
        self._waiting.add(scope)
        try:
            with scope:
                await self.write_line(line)
        finally:
            self._waiting.discard(scope)
        if scope.cancelled_caught:
            raise anyio.BrokenResourceError

    def close(self) -> None:
        self.closed = True
        for scope in self._waiting:
            scope.cancel()

    async def aclose(self) -> None:
        self.close()


@asynccontextmanager
async def capped_stdio_transport(
    params: StdioServerParameters, cap: int, process_log: ServerProcessLog, wire: WireWatch | None = None
) -> AsyncIterator[Any]:
    """What the SDK's stdio_client does (on POSIX), with a linear, capped reader: a line
    over `cap` + RESULT_ENVELOPE_SLACK bytes is never held. If it answered one of our
    requests, that request gets an error naming the cap and the connection stays;
    otherwise (no id found) the connection is ended so the server is restarted. The
    server's stderr goes to `process_log`, which also learns how the process ended;
    `wire` hears the size of each line."""
    process = await _open_server_process(params)
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    assert stdin is not None and stdout is not None and stderr is not None
    # As narrowed, for the methods below.
    server_stdin: anyio.abc.ByteSendStream = stdin
    server_stdout: anyio.abc.ByteReceiveStream = stdout
    if wire is not None:
        wire.measured = True
    stderr_read = anyio.Event()
    splitter = LineSplitter(cap + RESULT_ENVELOPE_SLACK)
    stdout_lock = anyio.Lock(fast_acquire=True)  # one reader of the pipe at a time: the session, or drop
    reading: list[anyio.CancelScope] = []  # the session's read in progress, which end() cancels

    async def read_stdout(stream: PulledStream) -> None:
        async with stdout_lock:
            scope = anyio.CancelScope()
            reading.append(scope)
            try:
                with scope:
                    chunk = await server_stdout.receive(_READ_CHUNK)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                stream.end(drained=True)
                return
            finally:
                reading.remove(scope)
        if stream.ended:  # ended while it waited: that chunk is dropped like the rest
            return
        for line in splitter.feed(chunk):
            if wire is not None:
                wire.saw(line.size if isinstance(line, OversizedLine) else len(line))
            if isinstance(line, bytes) and len(line) > DECODE_IN_THREAD_BYTES:
                # Validating megabytes takes long: off the event loop.
                item = await anyio.to_thread.run_sync(_server_item, line, cap)
            else:
                item = _server_item(line, cap)
            if item is not None:
                stream.items.append(item)
            if isinstance(item, OversizedMessageError):
                stream.end()  # the session sees the end after it; its requests fail now
                return

    def stdout_ended(drained: bool) -> None:
        """No more for the session: a send waiting to write would get no answer, so it fails
        now; if the pipe has not ended, the rest of the server's output is read and dropped
        in a task of its own, so the server never blocks writing."""
        write_send.close()
        if not drained:
            for scope in reading:
                scope.cancel()
            pipes.start_soon(drop_stdout)

    async def drop_stdout() -> None:
        with suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            async with stdout_lock:
                while True:
                    await server_stdout.receive(_READ_CHUNK)

    read_receive = PulledStream(read_stdout, stdout_ended)

    async def write_stdin(line: bytes) -> None:
        try:
            await server_stdin.send(line + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            read_receive.end()  # the server stopped reading: end the session, do not hang it
            raise anyio.BrokenResourceError from None

    # asyncio's own writer under anyio's: its transport takes a line at once (it writes what
    # the pipe has room for and keeps the rest), which anyio's send follows with a pass of
    # the loop. Only where anyio's send would not wait either: nothing in the buffer (lines
    # keep their order) and the line within its high-water mark, so a server that reads
    # nothing still holds a large send back. A closing pipe goes the long way, which raises.
    stdin_transport = getattr(getattr(server_stdin, "_stream", None), "transport", None)
    stdin_high = stdin_transport.get_write_buffer_limits()[1] if stdin_transport is not None else 0

    def stdin_now(line: bytes) -> bool:
        if (
            stdin_transport is None
            or stdin_transport.is_closing()
            or stdin_transport.get_write_buffer_size()
            or len(line) + 1 > stdin_high
        ):
            return False
        stdin_transport.write(line + b"\n")
        return True

    write_send = MessageWriter(write_stdin, stdin_now)

    async def read_stderr() -> None:
        splitter = LineSplitter(_STDERR_LINE_BYTES)
        try:
            with suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                while True:
                    for line in splitter.feed(await stderr.receive(_READ_CHUNK)):
                        process_log.add(line)
            for line in splitter.feed(b"\n"):  # a last line without its newline
                process_log.add(line)
        finally:
            stderr_read.set()

    async with anyio.create_task_group() as pipes:
        pipes.start_soon(read_stderr)
        try:
            yield read_receive, write_send
        finally:
            with anyio.CancelScope(shield=True):
                write_send.close()
                read_receive.close()
                await _stop_server_process(process, stderr_read)
                process_log.returncode = process.returncode
            pipes.cancel_scope.cancel()


async def _stop_server_process(process: anyio.abc.Process, stderr_read: anyio.Event | None = None) -> None:
    """The MCP shutdown sequence, every step bounded: close stdin, wait, SIGTERM then
    SIGKILL the server's whole process group, let its last stderr lines be read
    (`stderr_read`), release the pipes."""
    from mcp.os.posix.utilities import terminate_posix_process_tree  # one of SDK_INTERNALS

    assert process.stdin is not None
    with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.aclose()
    with anyio.move_on_after(_SERVER_EXIT_GRACE):
        await process.wait()
    if process.returncode is None:
        await terminate_posix_process_tree(process, _SERVER_EXIT_GRACE)
    if stderr_read is not None:
        with anyio.move_on_after(_SERVER_EXIT_GRACE):  # a leftover child may hold the pipe open
            await stderr_read.wait()
    with anyio.move_on_after(_SERVER_EXIT_GRACE):
        await process.aclose()
    if process.returncode is None:
        logger.warning("MCP server process %d survived SIGKILL; abandoning it", process.pid)


# --- tool lists, cached between runs ---------------------------------------------------
# A search covers every configured server; without a cache it would start each one just
# to read its tool list. Each server's list as it last gave it live (at start, and again
# after tools/list_changed) is kept in STATE_DIR/cache/tool-lists.json (a folder of its
# own: discovery reads every STATE_DIR/*.json as a server config), keyed by a digest of
# what names the server's program and how it is set up (server_program_key: its env and
# headers too, which may hold tokens, so an HMAC with a key of this state dir that never
# leaves it). A search uses the cached list of a server this bridge has not started; a
# call starts it as ever, and its live list replaces the cached one (a new version's too).
# Bounded (the MAX_CACHED_SERVERS most recently saved, MAX_TOOL_LISTS_BYTES in all, no
# list over MAX_CACHED_LIST_BYTES) and written atomically (write_atomically): bridges
# sharing the state dir may lose an update, never tear the file. An entry older than
# TOOL_LIST_MAX_AGE is stale; a file or an entry that does not read back as what
# ToolListCache writes is ignored (logged) and replaced by the next write.
TOOL_LISTS_PATH = Path("cache") / "tool-lists.json"  # under the state dir
# The file's "format"; a file of another format is ignored. 2: a list a principal's own
# login listed is keyed by the principal; a file of format 1 may hold one under the key
# every principal's shared connection reads.
TOOL_LISTS_FORMAT = 2
MAX_CACHED_SERVERS = 64
MAX_TOOL_LISTS_BYTES = 4 * 1024 * 1024
MAX_CACHED_LIST_BYTES = 1024 * 1024
TOOL_LIST_MAX_AGE = 7 * 24 * 3600.0  # seconds since an entry was saved
_CLOCK_SLACK = 60.0  # seconds an entry may seem to have been saved in the future
_PROGRAM_KEY = re.compile(r"[0-9a-f]{64}")


def server_program_key(spec: ServerSpec, secret: bytes, principal: str | None = None) -> str:
    """The tool-list cache's key for ``spec``: an HMAC (with ``secret``, tool_lists_secret)
    of its transport and its command, arguments, folder and env (stdio) or its URL and
    headers: two entries that run one program set up differently (another token, another
    toolset) are two servers. ``principal``: a shared bridge's principal whose own login
    listed the tools (what an account sees is its own, not its co-tenants'). Nothing of
    them can be read back from the key."""
    if spec.transport == "stdio":
        named: list[object] = [
            spec.transport,
            spec.command,
            list(spec.args),
            spec.cwd,
            sorted(spec.env.items()),
        ]
    else:
        named = [spec.transport, spec.url, sorted(spec.headers.items())]
    if principal is not None:
        named.append(["principal", principal])
    return hmac.new(secret, json.dumps(named).encode(), hashlib.sha256).hexdigest()


def tool_lists_secret(path: Path) -> bytes:
    """The key of the tool-list cache's entries, made once (32 random bytes, 0600) in
    ``path`` and kept; one of this process only where it cannot be kept (logged: the
    cache then serves this bridge alone). Blocking."""
    for _ in range(2):
        try:
            with open(path, "rb") as file:
                secret = file.read(64)
            if len(secret) == 32:
                return secret
            raise OSError("it holds %d bytes, not 32" % len(secret))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.info(
                "The tool-list cache's key %s is unusable (%s): the cache serves this bridge alone", path, exc
            )
            return secrets.token_bytes(32)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # another bridge made it first: read theirs
        except OSError as exc:
            logger.info(
                "The tool-list cache's key %s cannot be made (%s): the cache serves this bridge alone",
                path,
                exc,
            )
            return secrets.token_bytes(32)
        with os.fdopen(descriptor, "wb") as file:
            secret = secrets.token_bytes(32)
            file.write(secret)
            file.flush()
            os.fsync(file.fileno())
        return secret
    return secrets.token_bytes(32)


def _compact_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()  # ASCII: as many bytes as characters


@dataclass(frozen=True)
class CachedToolList:
    """A server's tool list as it last gave it live, what it said about itself then
    (serverInfo, instructions), and ``entry``: all of it as the cache file holds it."""

    tools: list[types.Tool]
    server_info: types.Implementation
    instructions: str | None
    saved: float  # time.time() when the list was saved
    entry: dict[str, Any]

    def fresh(self, now: float) -> bool:
        return now - TOOL_LIST_MAX_AGE <= self.saved <= now + _CLOCK_SLACK

    @classmethod
    def listed(
        cls, spec: ServerSpec, initialized: types.InitializeResult, tools: list[types.Tool], now: float
    ) -> CachedToolList:
        """What a server just listed live, as its cache entry."""
        dump = partial(BaseModel.model_dump, mode="json", by_alias=True, exclude_none=True)
        info = initialized.server_info
        entry = {
            "name": spec.name,  # for a person reading the file
            "saved": now,
            "serverInfo": dump(info, include={"name", "version", "title", "description"}),
            "instructions": initialized.instructions,
            "tools": [dump(tool) for tool in tools],
        }
        server_info = types.Implementation.model_validate(entry["serverInfo"], by_name=False)
        return cls(list(tools), server_info, initialized.instructions, now, entry)

    @classmethod
    def read_back(cls, entry: object) -> CachedToolList:
        """An entry of the file, validated as the SDK validates a live answer; ValueError
        (a pydantic ValidationError among them) when it is not what ``listed`` writes."""
        if not isinstance(entry, dict):
            raise ValueError("not a JSON object")
        saved, instructions, tools = entry.get("saved"), entry.get("instructions"), entry.get("tools")
        if isinstance(saved, bool) or not isinstance(saved, int | float) or not math.isfinite(saved):
            raise ValueError("'saved' is not a time")
        if not (instructions is None or isinstance(instructions, str)) or not isinstance(tools, list):
            raise ValueError("'instructions' or 'tools' is of the wrong type")
        server_info = types.Implementation.model_validate(entry.get("serverInfo"), by_name=False)
        validated = [types.Tool.model_validate(tool, by_name=False) for tool in tools]
        return cls(validated, server_info, instructions, float(saved), entry)


class ToolListCache:
    """The cached tool lists in ``path`` (STATE_DIR/TOOL_LISTS_PATH): read once, then held
    in memory. Each save merges its entry into the file as it is then (another bridge may
    have written it) and rewrites it; saves that arrive while one is written go out
    together in the next write, so starting many servers at once writes it twice, not
    once per server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._secret = b""  # the entries' keys' HMAC key (tool_lists_secret), read with the file
        self._entries: dict[str, CachedToolList] | None = None  # None: not read yet
        self._pending: dict[str, CachedToolList | None] = {}  # key -> entry (None: drop it)
        self._lock = anyio.Lock()

    async def get(self, spec: ServerSpec, principal: str | None = None) -> CachedToolList | None:
        """The fresh entry for ``spec``'s program (as ``principal`` logged in, if one did), or None."""
        async with self._lock:
            entries = await self._loaded()
            found = entries.get(server_program_key(spec, self._secret, principal))
        return found if found is not None and found.fresh(time.time()) else None

    async def save(
        self,
        spec: ServerSpec,
        initialized: types.InitializeResult,
        tools: list[types.Tool],
        principal: str | None = None,
    ) -> None:
        """Caches what ``spec``'s server just listed live (to ``principal``'s own login). A
        file that cannot be written is logged, not raised: the server works all the same."""
        listed = CachedToolList.listed(spec, initialized, tools, time.time())
        size = len(_compact_json(listed.entry))
        kept: CachedToolList | None = listed
        if size > MAX_CACHED_LIST_BYTES:
            logger.info(
                "MCP server %s: its tool list (%d bytes) is over the %d bytes the tool-list cache keeps of "
                "one server, so it is not cached",
                shown_name(spec.name),
                size,
                MAX_CACHED_LIST_BYTES,
            )
            kept = None  # and an older entry is dropped: it no longer says what the server has
        async with self._lock:
            await self._loaded()
        self._pending[server_program_key(spec, self._secret, principal)] = kept
        async with self._lock:
            if not self._pending:
                return  # the write this save waited for took its entry too
            pending, self._pending = self._pending, {}
            try:
                self._entries = await anyio.to_thread.run_sync(self._write, pending)
            except OSError as exc:
                logger.warning(
                    "The tool-list cache %s could not be written (%s); searches start servers to list "
                    "their tools",
                    self.path,
                    exc,
                )

    async def _loaded(self) -> dict[str, CachedToolList]:
        """The entries, and the key of their keys, read on first use (hold self._lock)."""
        if self._entries is None:
            self._secret = await anyio.to_thread.run_sync(tool_lists_secret, self.path.with_suffix(".key"))
            self._entries = await anyio.to_thread.run_sync(self._read)
        return self._entries

    def _ignored(self, why: object) -> dict[str, CachedToolList]:
        logger.info(
            "The tool-list cache %s is ignored (%s); the next server started rewrites it", self.path, why
        )
        return {}

    def _read(self) -> dict[str, CachedToolList]:
        """Every entry of the file that reads back (stale ones too), by key; none when the
        file is missing or damaged. Blocking."""
        try:
            with open(self.path, "rb") as file:
                data = file.read(MAX_TOOL_LISTS_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            return self._ignored(exc)
        if len(data) > MAX_TOOL_LISTS_BYTES:
            return self._ignored("over %d bytes" % MAX_TOOL_LISTS_BYTES)
        try:
            document = json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return self._ignored("not JSON: %s" % _describe_exception(exc))
        servers = document.get("servers") if isinstance(document, dict) else None
        if not isinstance(servers, dict) or document.get("format") != TOOL_LISTS_FORMAT:
            return self._ignored('not {"format": %d, "servers": {...}}' % TOOL_LISTS_FORMAT)
        entries: dict[str, CachedToolList] = {}
        for key, entry in servers.items():
            try:
                if not _PROGRAM_KEY.fullmatch(key):
                    raise ValueError("its key is not a digest")
                entries[key] = CachedToolList.read_back(entry)
            except ValueError as exc:
                name = entry.get("name") if isinstance(entry, dict) else None
                logger.info(
                    "The tool-list cache %s: the entry of %s is ignored (%s)",
                    self.path,
                    shown_name(name) if isinstance(name, str) else "a server",
                    _describe_exception(exc),
                )
        return entries

    def _write(self, pending: Mapping[str, CachedToolList | None]) -> dict[str, CachedToolList]:
        """The file rewritten with ``pending`` merged in: fresh entries only, the most
        recently saved first, within the bounds. Blocking; OSError when it cannot be written."""
        entries = self._read()
        for key, listed in pending.items():
            old = entries.pop(key, None)
            if listed is None:
                continue
            if old is not None and old.server_info.version != listed.server_info.version:
                logger.info(
                    "MCP server %s is at version %s now (cached: %s); its cached tool list is replaced",
                    shown_name(listed.entry["name"]),
                    listed.server_info.version,
                    old.server_info.version,
                )
            entries[key] = listed
        now = time.time()
        kept: dict[str, CachedToolList] = {}
        size = len(_compact_json({"format": TOOL_LISTS_FORMAT, "servers": {}}))
        for key, listed in sorted(entries.items(), key=lambda item: item[1].saved, reverse=True):
            if not listed.fresh(now):
                continue
            share = len(_compact_json({key: listed.entry})) - 1  # in the file: with its key and a comma
            if len(kept) == MAX_CACHED_SERVERS or size + share > MAX_TOOL_LISTS_BYTES:
                break  # the rest were saved earlier: dropped
            kept[key], size = listed, size + share
        document = {
            "format": TOOL_LISTS_FORMAT,
            "servers": {key: listed.entry for key, listed in kept.items()},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.path, _compact_json(document))
        return kept


_CONNECTION_ENDED = "exited or closed its connection"


# --- OAuth: logging in to a proxied HTTP server ----------------------------------------
# A streamable-HTTP server entry without an Authorization header of its own gets the SDK's
# OAuth client (OAuthClientProvider): on a 401 with OAuth metadata it discovers the
# authorization server, registers the bridge, and sends the user a link (PKCE, the
# resource indicator); the browser comes back to a loopback port of the bridge's. The
# tokens stay on the host (OAuthTokenFile), are refreshed by the SDK, and never reach the
# sandbox or the log. On an HTTP bridge of several principals each logs in with their own
# account: a connection and a token file per principal, and the browser comes back to the
# bridge's own address (LoginRedirects), wherever the person is.
OAUTH_DIR = "oauth"  # under STATE_DIR (or a principal's folder): one 0600 file per server URL
PRINCIPALS_DIRNAME = "principals"  # under STATE_DIR: each HTTP principal's own folder
LOGIN_WAIT = 600.0  # seconds a login waits for the browser's redirect
REFRESH_EARLY = 60.0  # at most this many seconds before it expires, a token is refreshed
SERVER_LOGIN_FINISH = 30.0  # seconds for the rest of a server's start once its login is done
REDIRECT_PATH = "/callback"  # on the loopback port of a login of the bridge's own
LOGIN_CALLBACK_PATH = "/oauth/callback"  # on the HTTP bridge: its principals' logins
ABANDONED = " abandoned"  # in place of a redirect's query: the bridge closed (no query has it)
MAX_REDIRECT_REQUEST_BYTES = 16 * 1024


def refresh_lead(lifetime: float) -> float:
    """How long before its expiry a token of ``lifetime`` seconds is refreshed: a server
    whose clock runs ahead, or a request in flight at the expiry, would answer 401, and on a
    401 the SDK asks the user to log in again even though it could refresh."""
    return min(REFRESH_EARLY, lifetime / 10)


def wants_oauth(spec: ServerSpec) -> bool:
    """Whether ``spec`` gets the OAuth client: a streamable-HTTP server whose entry sets no
    Authorization header (a static token of the user's own stays as it is)."""
    return spec.transport == "http" and not any(name.lower() == "authorization" for name in spec.headers)


def oauth_token_path(state_dir: Path, url: str, principal: str | None = None) -> Path:
    """The token file of the login to ``url``: the bridge's own, or an HTTP principal's."""
    folder = state_dir if principal is None else state_dir / PRINCIPALS_DIRNAME / principal
    return folder / OAUTH_DIR / ("%s.json" % hashlib.sha256(url.encode()).hexdigest()[:32])


class OAuthTokenFile:
    """The SDK's TokenStorage over one server's file: its tokens (with when the access token
    expires, so a restarted bridge refreshes instead of logging in again), the bridge's
    registration with its authorization server, and the loopback port it registered. A
    file that cannot be read counts as no login, never as a failure."""

    def __init__(self, path: Path, redirect_uri: str | None = None) -> None:
        """``redirect_uri``: the one address logins come back to (the HTTP bridge's), where
        not a loopback port of its own; a registration made for another counts as none."""
        self.path = path
        self.redirect_uri = redirect_uri
        self._port: int | None = None  # chosen for a registration not made yet

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _update(self, **fields: object) -> None:
        data = {**self.read(), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.path, json.dumps(data).encode())

    async def get_tokens(self) -> Any:
        from mcp.shared.auth import OAuthToken

        tokens = (await anyio.to_thread.run_sync(self.read)).get("tokens")
        try:
            return None if tokens is None else OAuthToken.model_validate(tokens)
        except ValidationError:
            return None

    async def set_tokens(self, tokens: Any) -> None:
        expires = None if tokens.expires_in is None else time.time() + tokens.expires_in
        dumped = tokens.model_dump(mode="json", exclude_none=True)
        await anyio.to_thread.run_sync(partial(self._update, tokens=dumped, expires_at=expires))

    async def get_client_info(self) -> Any:
        from mcp.shared.auth import OAuthClientInformationFull

        client = (await anyio.to_thread.run_sync(self.read)).get("client")
        try:
            found = None if client is None else OAuthClientInformationFull.model_validate(client)
        except ValidationError:
            return None
        registered = [] if found is None else [str(uri) for uri in found.redirect_uris or []]
        if self.redirect_uri is not None and self.redirect_uri not in registered:
            return None  # for another address (MCP_BRIDGE_PUBLIC_URL changed): register again
        return found

    async def set_client_info(self, client_info: Any) -> None:
        dumped = client_info.model_dump(mode="json", exclude_none=True)
        # The loopback port it registered, where it has one (not the HTTP bridge's address).
        port = {} if self.redirect_uri is not None else {"redirect_port": self.redirect_port()}
        update = partial(self._update, client=dumped, **port)
        await anyio.to_thread.run_sync(update)

    def keep_authorization_server(self, metadata: dict[str, Any]) -> None:
        """The authorization server's metadata (RFC 8414), where its tokens are refreshed. A
        file that cannot be written costs only that (the SDK finds it again after a 401)."""
        if self.read().get("authorization_server") == metadata:
            return
        try:
            self._update(authorization_server=metadata)
        except OSError as exc:
            logger.warning("the OAuth token file %s cannot be written: %s", self.path, exc)

    def authorization_server(self, stored: Mapping[str, Any] | None = None) -> Any:
        """The stored authorization server's metadata (an OAuthMetadata), or None;
        ``stored``: the file's contents, where already read."""
        from mcp.shared.auth import OAuthMetadata

        metadata = (self.read() if stored is None else stored).get("authorization_server")
        try:
            return None if metadata is None else OAuthMetadata.model_validate(metadata)
        except ValidationError:
            return None

    def redirect_port(self) -> int:
        """The loopback port of the bridge's registration (an authorization server may hold
        it to its registration exactly): a free one until then, kept with the registration
        (a server that never asks for a login leaves no file)."""
        port = self.read().get("redirect_port")
        if isinstance(port, int) and 0 < port < 65536:
            return port
        if self._port is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self._port = int(probe.getsockname()[1])
        return self._port

    def forget(self) -> bool:
        """Remove the login (logout): whether there was one."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        return True


def query_value(url: str, name: str) -> str | None:
    """The value of the query parameter ``name`` in ``url``, if it has one."""
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query)).get(name)


def redirect_page(server: str, query: Mapping[str, str]) -> str:
    """What the browser shows when a login comes back (HTML)."""
    said = "The login to %s %s. You can close this tab." % (
        server,
        "failed: " + query["error"] if "error" in query else "is done",
    )
    return html.escape(said)


class PendingRedirect:
    """One login waiting for its browser to come back to the HTTP bridge."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.query: dict[str, str] = {}
        self.back = anyio.Event()

    def arrive(self, query: dict[str, str]) -> None:
        self.query = query
        self.back.set()


class LoginRedirects:
    """Where the browsers of an HTTP bridge's principals come back from their logins to
    proxied servers: one address of the bridge's (``url``), served by its HTTP app
    (``endpoint``), each login told apart by its OAuth state (the SDK's random one, which
    the SDK checks again). A redirect no login waits for changes nothing."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pending: dict[str, PendingRedirect] = {}

    def expect(self, link: str, server: str) -> tuple[str, PendingRedirect]:
        """The state of the login ``link`` starts, and its arrival."""
        state = query_value(link, "state")
        if not state:
            raise ServerUnavailableError("its login link carries no state, so the login could not come back")
        pending = self.pending[state] = PendingRedirect(server)
        return state, pending

    async def endpoint(self, request: Request) -> Response:
        from starlette.responses import HTMLResponse

        query = dict(request.query_params)
        pending = self.pending.pop(query.get("state", ""), None)
        if pending is None:
            return HTMLResponse(
                "No login waits for this link: it was used already, or it expired. Run the code that "
                "needs the server again for a new one.",
                status_code=400,
            )
        pending.arrive(query)
        return HTMLResponse(redirect_page(pending.server, query))


async def receive_redirect(listener: anyio.abc.SocketListener, server: str) -> dict[str, str]:
    """The query of the browser's redirect to REDIRECT_PATH on ``listener`` (code, state,
    iss; or error); other requests (a favicon) get a 404 and are ignored."""
    while True:
        stream = await listener.accept()
        async with stream:
            request = b""
            with anyio.move_on_after(10):
                while b"\r\n\r\n" not in request and len(request) < MAX_REDIRECT_REQUEST_BYTES:
                    request += await stream.receive(4096)
            parts = request.split(b"\r\n", 1)[0].decode("latin-1").split()
            target = urllib.parse.urlsplit(parts[1]) if len(parts) == 3 and parts[0] == "GET" else None
            if target is None or target.path != REDIRECT_PATH:
                with suppress(OSError, anyio.BrokenResourceError):
                    await stream.send(
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                continue
            query = {key: values[0] for key, values in urllib.parse.parse_qs(target.query).items()}
            page = redirect_page(server, query).encode()
            with suppress(OSError, anyio.BrokenResourceError):
                await stream.send(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s" % (len(page), page)
                )
            return query


class ServerLogin:
    """One proxied HTTP server's OAuth login: the SDK's provider over its token file, whose
    handlers show the link (``link``; ``asked`` is set when the user must open it) and wait
    up to LOGIN_WAIT for the browser's redirect, while the server's start deadline
    (``starting``) stands still. The redirect comes to a loopback port of the login's own
    (the browser is on this machine), or through ``redirects`` (an HTTP bridge's principal,
    whose browser is wherever that person is)."""

    def __init__(
        self,
        spec: ServerSpec,
        state_dir: Path,
        on_link: Callable[[str], None] | None = None,
        principal: str | None = None,
        redirects: LoginRedirects | None = None,
    ) -> None:
        """``on_link``: who else shows the link (the login command: the terminal, a browser);
        ``principal``: whose login it is, over HTTP (its token file is that principal's)."""
        assert spec.url is not None
        self.spec = spec
        self.principal = principal
        self.redirects = redirects
        self.tokens = OAuthTokenFile(
            oauth_token_path(state_dir, spec.url, principal), None if redirects is None else redirects.url
        )
        self.on_link = on_link
        self.link: str | None = None
        self.asked = anyio.Event()
        self.done = anyio.Event()  # the login asked for last has ended (done or not)
        self.waiting = False  # for the browser's redirect
        self.starting: anyio.CancelScope | None = None
        self._listener: anyio.abc.SocketListener | None = None  # the loopback port's
        self._pending: tuple[str, PendingRedirect] | None = None  # through ``redirects``

    def provider(self) -> Any:
        """A fresh OAuthClientProvider (one per connection), with the stored token's expiry."""
        from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider
        from mcp.shared.auth import OAuthClientMetadata

        redirects = self.redirects
        if redirects is None:
            port = self.tokens.redirect_port()
            redirect_uri = "http://127.0.0.1:%d%s" % (port, REDIRECT_PATH)
        else:
            port, redirect_uri = 0, redirects.url
        # What the consent page shows: on a shared bridge, whose login it is.
        name = SERVER_NAME if self.principal is None else "%s (for %s)" % (SERVER_NAME, self.principal)
        metadata = OAuthClientMetadata(
            redirect_uris=[redirect_uri],  # type: ignore[list-item]
            client_name=name,
            grant_types=["authorization_code", "refresh_token"],
            token_endpoint_auth_method="none",
        )

        async def show_link(url: str) -> None:
            if redirects is not None:
                self._pending = redirects.expect(url, self.spec.name)
            else:
                self._listener = await self._listen(port)
            self.link, self.waiting, self.done = url, True, anyio.Event()
            if self.starting is not None:  # the user's time is not the server's start
                self.starting.deadline = math.inf
            if self.principal is None:  # the user's own bridge: its log may be where they look
                logger.warning("MCP server %s wants a login: open %s", shown_name(self.spec.name), url)
            else:  # the link is the principal's: whoever opens it logs in for that principal
                logger.info(
                    "MCP server %s wants principal %s to log in", shown_name(self.spec.name), self.principal
                )
            if self.on_link is not None:
                self.on_link(url)
            self.asked.set()

        async def wait_for_redirect() -> AuthorizationCodeResult:
            try:
                with anyio.fail_after(LOGIN_WAIT):
                    query = await self._redirect()
            except TimeoutError:
                raise ServerUnavailableError(
                    "the login was not completed within %d minutes" % (LOGIN_WAIT // 60)
                ) from None
            finally:
                if self._listener is not None:
                    await self._listener.aclose()
                if self._pending is not None and redirects is not None:
                    redirects.pending.pop(self._pending[0], None)
                self._listener = self._pending = None
                self.waiting, self.asked = False, anyio.Event()
                self.done.set()
                if self.starting is not None:
                    self.starting.deadline = anyio.current_time() + SERVER_LOGIN_FINISH
            if ABANDONED in query:
                raise ServerUnavailableError("the bridge closed before the login was completed")
            if "error" in query:
                raise ServerUnavailableError(
                    "its authorization server refused the login: %s%s"
                    % (
                        query["error"],
                        (" (%s)" % query["error_description"]) if "error_description" in query else "",
                    )
                )
            return AuthorizationCodeResult(
                code=query.get("code", ""), state=query.get("state"), iss=query.get("iss")
            )

        provider = OAuthClientProvider(
            self.spec.url or "", metadata, self.tokens, show_link, wait_for_redirect
        )
        context = provider.context

        def refresh_early(token: Any) -> None:  # one of SDK_INTERNALS: in place of the SDK's own
            lifetime = token.expires_in
            if lifetime is None:
                context.token_expiry_time = None
            else:
                context.token_expiry_time = time.time() + lifetime - refresh_lead(lifetime)
            # Tokens came from the authorization server the SDK found: kept with them, since a
            # new connection's SDK knows none until a 401 and would send its refresh token to
            # the MCP server's own origin.
            if context.oauth_metadata is not None:  # one of SDK_INTERNALS
                self.tokens.keep_authorization_server(context.oauth_metadata.model_dump(mode="json"))

        context.update_token_expiry = refresh_early  # type: ignore[method-assign]
        stored = self.tokens.read()
        context.oauth_metadata = self.tokens.authorization_server(stored)  # one of SDK_INTERNALS
        expires, tokens = stored.get("expires_at"), stored.get("tokens")
        lifetime = tokens.get("expires_in") if isinstance(tokens, dict) else None
        if isinstance(expires, int | float):  # one of SDK_INTERNALS
            lead = refresh_lead(lifetime) if isinstance(lifetime, int | float) else 0.0
            context.token_expiry_time = float(expires) - lead
        return provider

    async def _redirect(self) -> dict[str, str]:
        """The query the browser comes back with."""
        if self._pending is not None:
            pending = self._pending[1]
            await pending.back.wait()
            return pending.query
        assert self._listener is not None
        return await receive_redirect(self._listener, self.spec.name)

    @staticmethod
    async def _listen(port: int) -> anyio.abc.SocketListener:
        """The loopback port the browser comes back to."""
        listening = socket.socket()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last login's TIME_WAIT
        try:
            listening.bind(("127.0.0.1", port))
            listening.listen(4)
        except OSError as exc:
            listening.close()
            raise ServerUnavailableError(
                "its login needs the loopback port %d, which is in use (%s); free it and call again"
                % (port, exc.strerror or exc)
            ) from None
        return await anyio.abc.SocketListener.from_socket(listening)

    async def abandon(self) -> None:
        """Stop waiting for the browser (the bridge closes): the login fails at once."""
        if self.waiting and self._listener is not None:
            await self._listener.aclose()
        if self.waiting and self._pending is not None:
            self._pending[1].arrive({ABANDONED: "1"})

    def forgotten(self) -> bool:
        """Whether the login was removed (`logout`) while a connection still holds its token."""
        return not self.tokens.path.exists()

    def required(self) -> LoginRequiredError:
        """What a call that needs the server is told while the login waits for the user."""
        how = (
            "(In a terminal, `%s login %s` does the same.)" % (SERVER_NAME, self.spec.name)
            if self.principal is None
            else "(The login is this principal's own: the server acts with that account for it alone.)"
        )
        return LoginRequiredError(
            "MCP server %r wants you to log in (OAuth) before code can use it. Ask the user to open this "
            "link in a browser and approve: %s -- then run the code again; the bridge waits %d minutes "
            "for the login. %s" % (self.spec.name, self.link, LOGIN_WAIT // 60, how),
            self,
        )

    async def through(self, run: CallListener) -> bool:
        """Ask the user of ``run``'s call to open the link (URL-mode elicitation, where its
        client takes it), then wait for the login, the call's timeout paused; whether the
        login is done (False: the client cannot show a link, or the user declined)."""
        if self.link is None:
            return False
        params = types.ElicitRequestURLParams(
            message="MCP server %r wants you to log in (OAuth) so that code can use it: open the "
            "link, approve, and the code goes on." % self.spec.name,
            url=self.link,
            elicitation_id=secrets.token_hex(8),
        )
        answer = await run.relay(self.spec.name, params)
        if not isinstance(answer, types.ElicitResult) or answer.action != "accept":
            return False
        with (
            run.paused("the login to MCP server %r" % self.spec.name),
            anyio.move_on_after(LOGIN_WAIT),
        ):
            await self.done.wait()
        return self.done.is_set()


class CallListener(Protocol):
    """Who hears what a proxied server says to its client during one call of code's (the
    run_python call it is part of: RunContext), each with the server's name."""

    async def relay(
        self, server: str, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        """A question (elicitation): the user's answer, or an error saying why not asked."""
        ...

    async def progress(self, server: str, done: float, total: float | None, message: str | None) -> None: ...

    async def log(self, server: str, params: types.LoggingMessageNotificationParams) -> None: ...

    def paused(self, waiting_for: str) -> AbstractContextManager[None]:
        """The call's timeout stands still in the block (the user is busy with ``waiting_for``)."""
        ...


class CheckedReadStream(anyio.abc.ObjectReceiveStream[Any]):
    """A transport's read stream as the session reads it: each item passed through ``check``
    (PooledClient._checked) in the session's own reading task (a relay task of its own cost
    a hop per message); ``ended`` is set once the transport has no more to give."""

    def __init__(
        self,
        source: anyio.abc.ObjectReceiveStream[Any],  # the transport's read stream
        check: Callable[[Any], Any],
        ended: anyio.Event,
    ) -> None:
        self.source = source
        self.check = check
        self.ended = ended

    async def receive(self) -> Any:
        try:
            item = await self.source.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.ended.set()
            raise anyio.EndOfStream from None
        return self.check(item)

    async def aclose(self) -> None:
        self.ended.set()
        await self.source.aclose()


class PooledClient:
    """One configured MCP server behind a long-lived client session.

    A single owner task opens the transport and the ClientSession and later closes
    them: the SDK's cancel scopes break when a session is entered in one task and
    exited in another. Callers in any task use the session while it is up. The
    session's read stream (CheckedReadStream) notices when the server goes away, so the
    next use restarts it instead of failing. A server that misses a deadline or whose
    connection fails is stopped the same way (a wedged server would make every later
    call wait out the timeout); the model is told when it is restarted."""

    def __init__(
        self,
        spec: ServerSpec,
        config: BridgeConfig,
        task_group: anyio.abc.TaskGroup,
        tool_list_cache: ToolListCache | None = None,
        principal: str | None = None,
        redirects: LoginRedirects | None = None,
    ) -> None:
        """``tool_list_cache``: where its live tool lists are cached (its pool's), if anywhere;
        ``principal``: the HTTP principal whose own connection this is (a server with a login);
        ``redirects``: where that principal's login comes back."""
        self.spec = spec
        self.config = config
        self.task_group = task_group
        self.tool_list_cache = tool_list_cache
        self.principal = principal
        self._cached: CachedToolList | None = None  # what cached_tools() found, kept as the same object
        self.session: ClientSession | None = None
        self.tools: list[types.Tool] = []
        self.initialized: types.InitializeResult | None = None  # serverInfo, instructions
        self.tools_stale = False
        self.failure: str | None = None
        self.starts = 0
        self.ran = False  # whether the last start got the server running (else it could not be started)
        self.notices: list[str] = []
        # The calls in flight, each with where a question of the server's goes (its run's
        # RunContext.relay): a stdio server's question names no call, so it is passed on
        # only while exactly one call runs.
        self.calls_in_flight: list[tuple[CallListener, anyio.CancelScope]] = []  # with each deadline
        self.last_used = 0.0  # time.monotonic() of the last ensure_running
        self.parked = False  # closed for being idle: the next use reconnects without a notice
        self.wire = WireWatch()  # how large its messages are, where its transport measures them
        self.login = None  # a streamable-HTTP server's OAuth login, where it may want one
        # A shared connection of a bridge of several principals never logs in (whose account
        # would it be?): a 401 says the server wants each principal's own (ClientPool).
        self.personal_login = False
        self._watches_logins = wants_oauth(spec) and config.names_principals and principal is None
        if wants_oauth(spec) and not self._watches_logins:
            self.login = ServerLogin(spec, config.state_dir, principal=principal, redirects=redirects)
        self._start_lock = anyio.Lock()
        self._starting: anyio.Event | None = None  # the last start's ready event
        self._closed = anyio.Event()
        self._stop = anyio.Event()

    @property
    def running(self) -> bool:
        return self.session is not None and not self._closed.is_set() and not self._stop.is_set()

    async def ensure_running(self) -> ClientSession:
        self.last_used = time.monotonic()
        if self.running and self.session is not None:  # each proxied call: no lock, no checkpoint
            if self.login is None or not self.login.forgotten():
                return self.session
            self._fail(self.session, "its login was removed (logout)")  # log in again
            with anyio.move_on_after(10):
                await self._closed.wait()
        if self.login is not None and self.login.waiting:  # its start waits for the user's login
            raise self.login.required()
        async with self._start_lock:
            if self.running and self.session is not None:
                return self.session
            if self._starting is not None and not self._starting.is_set():
                await self._starting.wait()  # the last start goes on after its login: not a second one
                if self.running and self.session is not None:
                    return self.session
            # What the notice says once it runs again: a restart only of a server that ran.
            before, ran, parked = self.failure or "had stopped", self.ran, self.parked
            self.parked = False
            await self._start()
            if self.starts > 1 and not parked:
                self.notices.append(
                    "MCP server %r %s; it was restarted." % (self.spec.name, before)
                    if ran
                    else "MCP server %r could not be started before (%s); it has started now."
                    % (self.spec.name, before)
                )
            assert self.session is not None
            return self.session

    async def _start(self) -> None:
        self.failure, self.ran = None, False
        self.starts += 1
        ready, self._closed, self._stop = anyio.Event(), anyio.Event(), anyio.Event()
        process_log = ServerProcessLog(self.spec.name)
        self._starting = ready
        login = self.login
        if login is not None:
            login.asked = anyio.Event()
        self.task_group.start_soon(self._own, ready, self._closed, self._stop, process_log)
        if login is None:
            await ready.wait()
        else:  # the call that needs it hears of a login at once; the start goes on meanwhile
            await _first_of(ready, login.asked)
            if not ready.is_set():
                raise login.required()
        if self.session is None:
            spec = self.spec
            if self.personal_login:  # served again by the calling principal's own connection
                raise PersonalLoginError("MCP server %r wants each principal's own login" % spec.name)
            command = " (command: %s)" % shown_command(spec.command, spec.args) if spec.command else ""
            reason, stderr_tail = self.failure or "unknown error", process_log.stderr_tail()
            raise ServerUnavailableError(
                "MCP server %r%s could not be started: %s.%s Check its entry in %s."
                % (spec.name, command, reason, stderr_tail, spec.source)
            )
        self.ran = True

    async def _own(
        self, ready: anyio.Event, closed: anyio.Event, stop: anyio.Event, process_log: ServerProcessLog
    ) -> None:
        from mcp.client.session import ClientSession

        owned: ClientSession | None = None
        try:
            async with (
                self._transport(process_log) as (read, write),
                ClientSession(
                    CheckedReadStream(read, self._checked, closed),
                    write,
                    message_handler=self._on_message,
                    elicitation_callback=self._on_question,
                    logging_callback=self._on_log,
                ) as session,
            ):
                with anyio.fail_after(self.config.server_start_timeout) as starting:
                    if self.login is not None:  # a login stops this clock while the user is asked
                        self.login.starting = starting
                    self.initialized = await session.initialize()
                    self.tools = await list_all_tools(session)
                await self._cache_tools()
                self.session = owned = session
                ready.set()
                await _first_of(stop, closed)
                if closed.is_set() and not stop.is_set() and stop is self._stop:
                    self.failure = self.failure or _CONNECTION_ENDED
            if process_log.ending is not None and self.failure == _CONNECTION_ENDED and stop is self._stop:
                self.failure = "%s: its process %s" % (_CONNECTION_ENDED, process_log.ending)
        except Exception as exc:  # any failure of a user-configured server is reported, never fatal
            reason = _describe_exception(exc)
            if isinstance(_innermost(exc), TimeoutError) and not ready.is_set():
                reason = "it did not finish initializing within %gs (MCP_BRIDGE_SERVER_START_TIMEOUT)" % (
                    self.config.server_start_timeout
                )
            elif process_log.ending is not None and not ready.is_set():
                reason = "its process %s before it finished initializing (%s)" % (process_log.ending, reason)
            elif (
                self.login is not None
                and (request := failed_request(_innermost(exc))) is not None
                and url_origin(str(request.url)) != url_origin(self.spec.url or "")
            ):
                reason = "its OAuth login failed at its authorization server: %s" % reason
            if stop is self._stop:  # else a restart already owns `failure`
                self.failure = self.failure or reason
            logger.info("MCP server %s stopped: %s", self.spec.name, reason)
        finally:
            # Only this owner's session: a restart may already have put a new one here.
            if self.session is owned:
                self.session = None
            closed.set()
            ready.set()

    @asynccontextmanager
    async def _transport(self, process_log: ServerProcessLog) -> AsyncIterator[Any]:
        """The (read, write) streams of this server's transport, closed on exit
        (including the HTTP client, which the SDK does not close when handed one); a stdio
        server's stderr and exit go to `process_log`."""
        spec = self.spec
        if spec.transport == "stdio":
            from mcp.client.stdio import StdioServerParameters, stdio_client

            assert spec.command is not None
            params = StdioServerParameters(
                command=spec.command,
                args=list(spec.args),
                env=server_environment(self.config.pass_env, os.environ, spec.env),
                cwd=spec.cwd,
                encoding_error_handler="replace",  # a server's binary junk must not end the session
            )
            if sys.platform == "win32":  # the SDK's: results capped after arrival, stderr passed as is
                async with stdio_client(params) as streams:
                    yield streams
            else:
                cap = self.config.max_tool_result_bytes
                async with capped_stdio_transport(params, cap, process_log, self.wire) as streams:
                    yield streams
            return
        assert spec.url is not None
        headers = dict(spec.headers) or None
        if spec.transport == "sse":
            from mcp.client.sse import sse_client

            async with sse_client(spec.url, headers=headers) as streams:
                yield streams
            return
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client  # one of SDK_INTERNALS

        auth = None if self.login is None else self.login.provider()
        async with create_mcp_http_client(headers=headers, auth=auth) as http:
            if self._watches_logins:
                http.event_hooks["response"].append(self._saw_response)
            async with streamable_http_client(
                spec.url, http_client=http, max_sse_event_size=self.config.max_frame_bytes
            ) as streams:
                yield streams

    async def _saw_response(self, response: Any) -> None:
        """A shared connection's HTTP answer: a 401 means the server wants a login, each
        principal its own (see ClientPool)."""
        if response.status_code == 401 and not self.personal_login:
            self.personal_login = True
            logger.info("MCP server %s wants a login: each principal logs in with its own", self.spec.name)

    def _checked(self, item: SessionMessage | Exception) -> SessionMessage | Exception:
        """``item``, or, when it answers tools/list (the one result with a "tools" list)
        with tools the session would refuse, the same answer without them (check_tool_listing),
        with a notice naming those left out."""
        from mcp.shared.message import SessionMessage

        message = item.message if isinstance(item, SessionMessage) else None
        if not (isinstance(message, types.JSONRPCResponse) and isinstance(message.result.get("tools"), list)):
            return item
        version = self.initialized.protocol_version if self.initialized else types.LATEST_PROTOCOL_VERSION
        checked = check_tool_listing(message.result, str(version))
        if checked.result is message.result:
            return item
        name = self.spec.name
        if checked.repaired:
            logger.info(
                'MCP server %s: tools whose inputSchema lacks "type": "object" were mended: %s',
                shown_name(name),
                ", ".join(checked.repaired),
            )
        if checked.dropped:
            notice = dropped_tools_notice(name, checked.dropped, len(checked.result["tools"]))
            logger.warning("%s", notice)
            self.notices.append(notice)
        response = types.JSONRPCResponse(jsonrpc="2.0", id=message.id, result=checked.result)
        return SessionMessage(response, metadata=item.metadata) if isinstance(item, SessionMessage) else item

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.tools_stale = True
        elif isinstance(message, OversizedMessageError):
            logger.warning("MCP server %s %s; the connection is restarted", self.spec.name, message)
            self.failure = self.failure or str(message)
        elif isinstance(message, Exception):
            logger.info("MCP server %s sent something unreadable: %s", self.spec.name, message)

    async def list_tools(self) -> list[types.Tool]:
        session = await self.ensure_running()
        if self.tools_stale:
            self.tools_stale = False  # a tools/list_changed arriving during the refresh sets it again
            try:
                with anyio.fail_after(self.config.tool_timeout):
                    self.tools = await list_all_tools(session)
            except Exception as exc:
                self.tools_stale = True  # not refreshed: the next use asks again
                error = self._request_error(session, exc, "tools/list")
                if error is None:
                    raise
                raise error from None
            except BaseException:  # cancelled: not refreshed either
                self.tools_stale = True
                raise
            await self._cache_tools()
        return self.tools

    async def cached_tools(self) -> CachedToolList | None:
        """What a search may use instead of starting this server: its tool list as it last
        gave it live, to this bridge or an earlier one (ToolListCache), while this bridge
        has not started it (once it has, its live list counts: list_tools()). None when
        there is no fresh entry: the server must be started to list its tools. The same
        object while the entry stays the same."""
        if self.starts or self.tool_list_cache is None:
            return None
        if self._cached is None:
            self._cached = await self.tool_list_cache.get(self.spec, self.principal)
        if self.starts or self._cached is None or not self._cached.fresh(time.time()):
            return None
        return self._cached

    async def _cache_tools(self) -> None:
        """The tool list just listed live, into the cache for later bridges' searches."""
        if self.tool_list_cache is not None and self.initialized is not None:
            await self.tool_list_cache.save(self.spec, self.initialized, self.tools, self.principal)

    async def _on_question(
        self, context: object, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        """The server asks its client for input (elicitation/create) during a call: passed
        on to the user of the run_python call that made it, when there is exactly one."""
        if len(self.calls_in_flight) == 1:
            # The call's own deadline (MCP_BRIDGE_TOOL_TIMEOUT) stands still while its user answers.
            listener, limit = self.calls_in_flight[0]
            saved, started, limit.deadline = limit.deadline, time.monotonic(), math.inf
            try:
                return await listener.relay(self.spec.name, params)
            finally:
                limit.deadline = saved + (time.monotonic() - started)
        why = "several of its calls are running, so the bridge cannot tell whose user to ask"
        if not self.calls_in_flight:
            why = "no call of its is running"
        logger.info("MCP server %s asked a question; declined: %s", self.spec.name, why)
        return types.ErrorData(code=types.INVALID_REQUEST, message="the bridge declined: " + why)

    async def _on_log(self, params: types.LoggingMessageNotificationParams) -> None:
        """A log message of the server's: to the user of the one call in flight, if one."""
        if len(self.calls_in_flight) == 1:
            await self.calls_in_flight[0][0].log(self.spec.name, params)
        else:
            logger.info("MCP server %s says (%s): %s", self.spec.name, params.level, str(params.data)[:500])

    async def call_tool(
        self, tool: str, arguments: dict[str, Any], listener: CallListener | None = None
    ) -> types.CallToolResult:
        """``listener``: who hears the server's questions, progress and log messages
        during this call (the run_python call it is part of)."""
        progress: ProgressFnT | None = None
        if listener is not None:
            heard = listener

            async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                await heard.progress(self.spec.name, progress, total, message)

            progress = on_progress

        async def send(session: ClientSession) -> types.CallToolResult:
            return await session.call_tool(tool, arguments, progress_callback=progress)

        hint = " Ask the tool for less (a filter, a page, a limit)."
        return await self.request("the call to %s" % tool, send, listener, hint)

    async def request(
        self,
        what: str,
        send: Callable[[ClientSession], Awaitable[_Result]],
        listener: CallListener | None,
        hint: str = " Ask for less.",
    ) -> _Result:
        """The request ``send`` makes of the server (``what``: "the call to X",
        "resources/read"), within MCP_BRIDGE_TOOL_TIMEOUT, its failures told for the code
        (_request_error); ``listener`` hears what the server says meanwhile."""
        session = await self.ensure_running()
        try:
            # A deadline scope of its own, not fail_after: its two generator context
            # managers were a twentieth of the bridge's work on a proxied call.
            with anyio.CancelScope(deadline=anyio.current_time() + self.config.tool_timeout) as limit:
                entry = None if listener is None else (listener, limit)
                if entry is not None:
                    self.calls_in_flight.append(entry)
                try:
                    if self.login is None:
                        return await send(session)
                    return await self._sent_unless_asked(send, session)
                finally:
                    if entry is not None:
                        self.calls_in_flight.remove(entry)
            raise TimeoutError  # only the deadline cancels this scope
        except LoginRequiredError:
            raise
        except Exception as exc:
            error = self._request_error(session, exc, what, hint)
            if error is None:
                raise
            raise error from None

    async def _sent_unless_asked(
        self, send: Callable[[ClientSession], Awaitable[_Result]], session: ClientSession
    ) -> _Result:
        """``send(session)``, unless the server's login asks the user meanwhile (its token
        could not be refreshed): then at once LoginRequiredError, with the link; the login
        goes on in the connection's own task."""
        login = self.login
        assert login is not None
        outcome: list[tuple[bool, Any]] = []  # (sent, its result or its exception)
        async with anyio.create_task_group() as race:

            async def sending() -> None:
                try:
                    outcome.append((True, await send(session)))
                except Exception as exc:  # raised below, in the caller's task, as it was
                    outcome.append((False, exc))
                race.cancel_scope.cancel()

            async def asked() -> None:
                await login.asked.wait()
                race.cancel_scope.cancel()

            race.start_soon(sending)
            race.start_soon(asked)
        if not outcome:
            raise login.required()
        sent, value = outcome[0]
        if not sent:
            raise value
        return cast("_Result", value)

    def _request_error(
        self, session: ClientSession, exc: Exception, request: str, hint: str = ""
    ) -> ProxyError | None:
        """What the sandbox is told when `request` ("tools/list", "the call to X") failed.
        A server that missed the deadline (it may be wedged) or whose connection failed
        is stopped, so the next use restarts it. None: not the server's failure."""
        from mcp.shared.exceptions import MCPError as McpProtocolError

        name, leaf = self.spec.name, _innermost(exc)
        code = leaf.code if isinstance(leaf, McpProtocolError) else None
        if isinstance(leaf, McpProtocolError) and isinstance(leaf.data, dict) and OVERSIZED in leaf.data:
            return ProxyError(
                "MCP server %r answered %s with %s bytes, over the %d-byte cap "
                "(MCP_BRIDGE_MAX_TOOL_RESULT_BYTES); the bridge discarded the answer unread.%s"
                % (name, request, leaf.data[OVERSIZED], self.config.max_tool_result_bytes, hint)
            )
        if isinstance(leaf, McpProtocolError) and isinstance(leaf.data, dict) and INVALID in leaf.data:
            return ProxyError(
                "MCP server %r answered %s with a message that is not valid MCP (%s); the bridge "
                "discarded it." % (name, request, leaf.data[INVALID])
            )
        if code == types.REQUEST_TIMEOUT or isinstance(leaf, TimeoutError):
            limit = "within %gs (MCP_BRIDGE_TOOL_TIMEOUT)" % self.config.tool_timeout
            self._fail(session, "did not answer %s %s" % (request, limit))
            return ProxyError(
                "MCP server %r did not answer %s %s; it was stopped and will be restarted on the next call."
                % (name, request, limit)
            )
        if code == types.CONNECTION_CLOSED or (code is None and _is_transport_failure(exc)):
            if code == types.CONNECTION_CLOSED:  # the reason may be known: a crash, a stop, a discard
                cause = self.failure or _CONNECTION_ENDED
            else:
                cause = "lost its connection: %s" % _describe_exception(exc)
            self._fail(session, cause)
            return ProxyError(
                "MCP server %r went away during %s (it %s); it will be restarted on the next call."
                % (name, request, cause)
            )
        if code is not None:
            return ProxyError("MCP server %r rejected %s: %s" % (name, request, _describe_exception(leaf)))
        return None

    def _fail(self, session: ClientSession, reason: str) -> None:
        """Stop the client serving `session`, unless a restart has already replaced it:
        its owner closes it, and the next use restarts the server and reports `reason`."""
        if self.session is session and not self._stop.is_set():
            self.failure = reason
            self._stop.set()

    def park_if_idle(self, now: float, idle: float) -> bool:
        """Close the connection when no call has used it for ``idle`` seconds and none is in
        flight or waiting for a login; the next use reconnects with the tokens it has."""
        if (
            self.session is None
            or self._stop.is_set()
            or self.calls_in_flight
            or now - self.last_used < idle
            or (self.login is not None and self.login.waiting)
        ):
            return False
        self.parked = True
        self._stop.set()
        return True

    async def aclose(self) -> None:
        self._stop.set()
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            if self.login is not None:
                await self.login.abandon()
            await self._closed.wait()


IDLE_CHECK_SECONDS = 60.0  # how often the principals' own connections are checked for idleness


class ClientPool:
    """All configured servers, each started lazily on first use and then kept. On an HTTP
    bridge of several principals (``redirects``) every principal uses the shared
    connections, but a server that answers one with 401 wants a login: from then on each
    principal has its own connection to it (of_principal), whose account, tokens and login
    are that principal's alone."""

    def __init__(
        self, discovery: DiscoveryResult, config: BridgeConfig, task_group: anyio.abc.TaskGroup
    ) -> None:
        self.discovery = discovery
        self.config = config
        self.task_group = task_group
        self.tool_list_cache = ToolListCache(config.state_dir / TOOL_LISTS_PATH)
        self.shared = {
            spec.alias: PooledClient(spec, config, task_group, self.tool_list_cache)
            for spec in discovery.servers
            if server_allowed(spec.name, config)
        }
        self.redirects = (
            LoginRedirects(config.base_url + LOGIN_CALLBACK_PATH) if config.names_principals else None
        )
        self.principal: str | None = None  # whose view of the pool this is (of_principal)
        self._own: dict[str, PooledClient] = {}  # that principal's own connections, by alias
        self._views: dict[str, ClientPool] = {}  # every principal's view, by principal
        # Principals may be many (an issuer's users): their own connections close when idle.
        self._idle_closer = anyio.CancelScope()
        if self.redirects is not None and config.idle_timeout > 0:
            task_group.start_soon(self._close_idle_connections)

    @property
    def clients(self) -> dict[str, PooledClient]:
        """The connections this pool's user calls, by alias: the shared ones, but the
        principal's own to a server that wants a login."""
        if self.principal is None:
            return self.shared
        return {alias: self._used(client) for alias, client in self.shared.items()}

    def _used(self, shared: PooledClient) -> PooledClient:
        """The connection this pool's user calls in place of ``shared``."""
        if self.principal is None or not shared.personal_login:
            return shared
        own = self._own.get(shared.spec.alias)
        if own is None:
            cache, redirects = self.tool_list_cache, self.redirects
            own = PooledClient(shared.spec, self.config, self.task_group, cache, self.principal, redirects)
            self._own[shared.spec.alias] = own
        return own

    def close_idle(self, now: float) -> int:
        """Close the principals' own connections idle for MCP_BRIDGE_IDLE_TIMEOUT: how many."""
        own = (client for view in self._views.values() for client in view._own.values())
        return sum(client.park_if_idle(now, self.config.idle_timeout) for client in own)

    async def _close_idle_connections(self) -> None:
        with self._idle_closer:  # until aclose
            while True:
                await anyio.sleep(min(IDLE_CHECK_SECONDS, self.config.idle_timeout))
                self.close_idle(time.monotonic())

    def of_principal(self, principal: str) -> ClientPool:
        """The pool as ``principal`` uses it (on a bridge that tells principals apart; else
        this pool)."""
        if self.redirects is None:
            return self
        view = self._views.get(principal)
        if view is None:
            view = self._views[principal] = copy.copy(self)
            view.principal, view._own, view._views = principal, {}, {}
        return view

    def client(self, alias: str) -> PooledClient:
        client = self.shared.get(alias)
        if client is None:
            known = ", ".join(sorted(self.shared)) or "(none configured)"
            unusable = "".join(
                " A configuration file could not be used, so its servers are missing: %s." % problem
                for problem in self.discovery.unusable
            )
            raise ProxyError("Unknown MCP server %r. Available servers: %s.%s" % (alias, known, unusable))
        return self._used(client)

    def drain_notices(self) -> list[str]:
        """Every client's notices since the last drain, each once (a loop of searches over
        a broken server says so once per call)."""
        notices: list[str] = []
        for client in self.clients.values():
            notices.extend(client.notices)
            client.notices.clear()
        return list(dict.fromkeys(notices))

    async def aclose(self) -> None:
        """Close every connection this pool started, and every principal's own."""
        self._idle_closer.cancel()
        clients = [*self.shared.values(), *self._own.values()]
        clients.extend(own for view in self._views.values() for own in view._own.values())
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for client in clients:
                    if client.starts:  # a client never started has no owner task to wait for
                        group.start_soon(client.aclose)


def policy_problems(config: BridgeConfig, servers: Iterable[ServerSpec]) -> list[str]:
    """Patterns that match no configured server: a policy that silently does nothing (a
    typo in a deny list) is reported, in the log and in discovered_servers(detailed=True)."""
    names = [spec.name for spec in servers]
    problems = []
    for variable, patterns, server_part in (
        ("MCP_BRIDGE_ALLOW_SERVERS", config.allow_servers, False),
        ("MCP_BRIDGE_DENY_SERVERS", config.deny_servers, False),
        ("MCP_BRIDGE_ALLOW_TOOLS", config.allow_tools, True),
        ("MCP_BRIDGE_DENY_TOOLS", config.deny_tools, True),
        ("MCP_BRIDGE_APPROVE_TOOLS", config.approve_tools, True),
        ("MCP_BRIDGE_ALLOW_TOOLS_WITHOUT_ASKING", config.allow_tools_without_asking, True),
    ):
        for pattern in patterns:
            server_pattern = pattern.split(".", 1)[0] if server_part else pattern
            if not any(fnmatch.fnmatchcase(name, server_pattern) for name in names):
                problems.append("%s: %r matches no configured server" % (variable, pattern))
    return problems


def tool_pattern_problems(
    config: BridgeConfig, tools_by_server: Mapping[str, Sequence[str]], servers: Sequence[str]
) -> list[str]:
    """Tool patterns that match none of the tools of the servers they name, once every one
    of those servers has listed its tools (``tools_by_server``, by server name)."""
    problems = []
    for variable, patterns in (
        ("MCP_BRIDGE_ALLOW_TOOLS", config.allow_tools),
        ("MCP_BRIDGE_DENY_TOOLS", config.deny_tools),
        ("MCP_BRIDGE_APPROVE_TOOLS", config.approve_tools),
        ("MCP_BRIDGE_ALLOW_TOOLS_WITHOUT_ASKING", config.allow_tools_without_asking),
    ):
        for pattern in patterns:
            covered = [name for name in servers if fnmatch.fnmatchcase(name, pattern.split(".", 1)[0])]
            if not covered or any(name not in tools_by_server for name in covered):
                continue  # no such server (policy_problems says so), or not all listed yet
            qualified = ("%s.%s" % (name, tool) for name in covered for tool in tools_by_server[name])
            if not any(fnmatch.fnmatchcase(name, pattern) for name in qualified):
                problems.append("%s: %r matches no tool of %s" % (variable, pattern, ", ".join(covered)))
    return problems


# =============================================================================
# tool docs
# =============================================================================

_PRIMITIVES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}
_MAX_SCHEMA_DEPTH = 8
_MAX_SUMMARY_CHARS = 100
_UNKNOWN_TYPE = "Any"  # what a signature shows where the schema does not pin the type down


def python_identifier(tool_name: str) -> str:
    """The attribute (or parameter) name a tool name is exposed under: ``get-sum`` ->
    ``get_sum``, ``2fa`` -> ``t_2fa``, ``class`` -> ``class_``."""
    name = re.sub(r"\W", "_", tool_name, flags=re.ASCII) or "_"
    if name[0].isdigit():
        name = "t_" + name
    return name + "_" if keyword.iskeyword(name) else name


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _union(alternatives: Sequence[Sequence[str]]) -> list[str]:
    """Flatten and dedupe union members; any unknown member makes the whole union Any."""
    members = list(dict.fromkeys(member for group in alternatives for member in group))
    return [_UNKNOWN_TYPE] if not members or _UNKNOWN_TYPE in members else members


def _resolve_ref(ref: str, root: Mapping[str, object]) -> str:
    parts = ref.removeprefix("#/").split("/")
    if not ref.startswith("#/") or len(parts) != 2 or parts[0] not in ("$defs", "definitions"):
        return _UNKNOWN_TYPE
    defs = root.get(parts[0])
    return parts[1] if isinstance(defs, Mapping) and parts[1] in defs else _UNKNOWN_TYPE


def _python_types(schema: object, root: Mapping[str, object], depth: int = 0) -> list[str]:
    """The Python types a JSON schema admits, as union members (``["Any"]`` when unknown)."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return [_UNKNOWN_TYPE]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return ["Literal[%s]" % ", ".join(repr(value) for value in enum)]
    if "const" in schema:
        return ["Literal[%r]" % (schema["const"],)]
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return [_resolve_ref(ref, root)]
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            return _union([_python_types(member, root, depth + 1) for member in members])
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return [_UNKNOWN_TYPE]
    return _union([[_one_type(kind, schema, root, depth)] for kind in kinds])


def _one_type(kind: object, schema: Mapping[str, object], root: Mapping[str, object], depth: int) -> str:
    if kind == "array":
        items = _python_types(schema.get("items"), root, depth + 1)
        return "list" if items == [_UNKNOWN_TYPE] else "list[%s]" % " | ".join(items)
    if kind == "object":
        extra = schema.get("additionalProperties")
        values = _python_types(extra, root, depth + 1) if not schema.get("properties") else [_UNKNOWN_TYPE]
        return "dict" if values == [_UNKNOWN_TYPE] else "dict[str, %s]" % " | ".join(values)
    return _PRIMITIVES.get(kind, _UNKNOWN_TYPE) if isinstance(kind, str) else _UNKNOWN_TYPE


def parameter_names(schema: Mapping[str, object]) -> dict[str, str]:
    """Each parameter's schema name -> the Python name it is shown and called under, in
    signature order (required ones first, in schema order). A name that is already a
    Python name keeps it; the others become python_identifier(name), plus "_" until no
    other parameter has it ("a-b" beside "a_b" is a_b_), so every Python name maps back
    to exactly one schema name (schema_arguments)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    names = [name for name in properties if isinstance(name, str)]
    ordered = [n for n in names if n in required] + [n for n in required if n not in properties]
    ordered = list(dict.fromkeys(ordered + [n for n in names if n not in required]))
    taken = {name for name in ordered if python_identifier(name) == name}
    python_names: dict[str, str] = {}
    for name in ordered:
        ident = python_identifier(name)
        if ident != name:
            while ident in taken:
                ident += "_"
            taken.add(ident)
        python_names[name] = ident
    return python_names


def schema_arguments(
    schema: Mapping[str, object], arguments: Mapping[str, object], names: Mapping[str, str] | None = None
) -> dict[str, object]:
    """``arguments`` with each Python name of parameter_names() (``names``, if known already)
    renamed back to its schema name (``user_id`` -> ``user-id``). A schema name, or a key the
    schema does not know, is sent as it is. ProxyError when two keys name the same parameter."""
    names = parameter_names(schema) if names is None else names
    schema_names = {ident: name for name, ident in names.items()}
    renamed: dict[str, object] = {}
    given_as: dict[str, str] = {}
    for key, value in arguments.items():
        name = schema_names.get(key, key)
        if name in given_as:
            raise ProxyError(
                "The parameter %r is given twice, as %r and as %r: pass it once."
                % (name, given_as[name], key)
            )
        renamed[name], given_as[name] = value, key
    return renamed


def _parameters(schema: Mapping[str, object]) -> list[str]:
    """``name: type [= default]`` for each parameter (parameter_names() gives the order and
    the names)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    rendered: list[str] = []
    for name, ident in parameter_names(schema).items():
        prop = properties.get(name)
        types = _python_types(prop, schema)
        if name in required:
            rendered.append("%s: %s" % (ident, " | ".join(types)))
            continue
        default = prop.get("default") if isinstance(prop, Mapping) else None  # absent: None
        if default is None and "None" not in types and types != [_UNKNOWN_TYPE]:
            types = [*types, "None"]
        rendered.append("%s: %s = %r" % (ident, " | ".join(types), default))
    # A schema naming no parameters at all accepts anything; `"properties": {}` means none,
    # unless additionalProperties says otherwise.
    extra = schema.get("additionalProperties", "properties" not in schema)
    if not properties and (extra is True or isinstance(extra, Mapping)):
        rendered.append("**kwargs: %s" % " | ".join(_python_types(extra, schema)))
    return rendered


def _summary_line(description: object) -> str:
    """The first sentence of the first non-blank line, without its full stop, cut to ~100 chars."""
    lines = [line.strip() for line in _text(description).splitlines() if line.strip()]
    if not lines:
        return ""
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z])", lines[0], maxsplit=1)[0]
    sentence = sentence[:-1] if sentence.endswith(".") and not sentence.endswith("..") else sentence
    if len(sentence) > _MAX_SUMMARY_CHARS:
        sentence = sentence[: _MAX_SUMMARY_CHARS - 3].rstrip() + "..."
    return sentence


def _is_object_schema(schema: object) -> bool:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def render_signature(tool: Mapping[str, object]) -> str:
    """``name(params) -> dict|Any  # summary``: how the model calls the tool from Python."""
    schema = tool.get("inputSchema")
    params = _parameters(schema if isinstance(schema, Mapping) else {})
    returns = "dict" if _is_object_schema(tool.get("outputSchema")) else _UNKNOWN_TYPE
    signature = "%s(%s) -> %s" % (python_identifier(_text(tool.get("name"))), ", ".join(params), returns)
    summary = _summary_line(tool.get("description"))
    return "%s  # %s" % (signature, summary) if summary else signature


# What str.splitlines splits on: a "line" must stay one line whatever a schema holds.
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]+")


def render_tool_line(server_alias: str, tool: Mapping[str, object]) -> str:
    """``mcp_<alias>.name(params) -> T  # summary``: one line, the call as the model writes it."""
    return _LINE_BREAKS.sub(" ", "mcp_%s.%s" % (server_alias, render_signature(tool)))


def argument_problems(
    server_alias: str,
    tool: Mapping[str, object],
    arguments: Mapping[str, object],
    names: Mapping[str, str] | None = None,
) -> str | None:
    """Why a call with ``arguments`` (Python or schema names) cannot be what the model
    meant, with the tool's exact signature so it fixes the call in the same run; None when
    nothing is wrong. An unknown name counts only where the schema lists its parameters and
    does not take others (additionalProperties): a server would ignore it silently.
    ``names``: the tool's parameter_names(), if known already."""
    schema = tool.get("inputSchema")
    schema = schema if isinstance(schema, Mapping) else {}
    names = parameter_names(schema) if names is None else names  # schema name -> Python name
    given = {name for name, ident in names.items() if name in arguments or ident in arguments}
    required = schema.get("required")
    missing = [
        names.get(name, name)
        for name in (required if isinstance(required, list) else [])
        if isinstance(name, str) and name not in given
    ]
    additional = schema.get("additionalProperties")
    takes_others = not names or additional is True or isinstance(additional, Mapping)
    known = set(names) | set(names.values())
    unknown = [] if takes_others else [key for key in arguments if key not in known]
    if not missing and not unknown:
        return None
    said = []
    if unknown:
        close = {
            key: difflib.get_close_matches(key, list(names.values()), n=1, cutoff=0.6) for key in unknown
        }
        said.append(
            "no parameter %s"
            % ", ".join(
                "%s (did you mean %s?)" % (key, close[key][0]) if close[key] else key for key in unknown
            )
        )
    if missing:
        said.append("missing the required %s" % ", ".join(missing))
    return "mcp_%s.%s was not called: %s. Its signature: %s" % (
        server_alias,
        python_identifier(_text(tool.get("name"))),
        "; ".join(said),
        render_tool_line(server_alias, tool),
    )


class ToolDoc(TypedDict):
    """One tool's doc, as query_tool_docs and search_tool_docs answer."""

    server: str  # the server's alias
    tool: str  # the tool's name on its server
    name: str  # the Python name it is called under
    signature: str
    description: NotRequired[str]  # "full" only, with the schemas as the server sent them
    input_schema: NotRequired[object]
    output_schema: NotRequired[object]


def render_tool_doc(
    server_alias: str, tool: Mapping[str, object], detail: Literal["summary", "full"]
) -> ToolDoc:
    """One tool's doc: the signature alone ("summary"), or with description and schemas ("full")."""
    if detail not in ("summary", "full"):
        raise ValueError("detail must be 'summary' or 'full', not %r" % (detail,))
    name = _text(tool.get("name"))
    doc: ToolDoc = {
        "server": server_alias,
        "tool": name,
        "name": python_identifier(name),
        "signature": render_signature(tool),
    }
    if detail == "full":
        doc["description"] = _text(tool.get("description"))
        doc["input_schema"] = tool.get("inputSchema", {})
        if tool.get("outputSchema") is not None:
            doc["output_schema"] = tool["outputSchema"]
    return doc


# =============================================================================
# search
# =============================================================================

_RAW_WORD = re.compile(r"[A-Za-z]+|[0-9]+|[^\W\d_A-Za-z]+")  # a word as written: GitHub, getFileInfo
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+|[^\W\d_A-Za-z]+")  # its parts: Git, Hub
_STOP_WORDS = frozenset({
    "a", "an", "and", "any", "are", "as", "at", "be", "by", "can", "could", "do", "does", "for", "from",
    "how", "i", "if", "in", "into", "is", "it", "its", "me", "my", "not", "of", "on", "or", "please", "some",
    "that", "the", "their", "them", "then", "there", "these", "this", "those", "to", "use", "used",
    "using", "via", "want", "was", "what", "when", "where", "which", "while", "who", "will", "with",
    "would", "you", "your", "tool", "tools",
})  # fmt: skip
# (suffix, replacement, shortest stem left): one rule applies, first match wins.
_SUFFIXES = (
    ("ies", "y", 3), ("sses", "ss", 3), ("xes", "x", 2), ("ches", "ch", 2), ("shes", "sh", 2),
    ("ions", "", 3), ("ion", "", 3), ("ings", "", 3), ("ing", "", 3), ("edly", "", 3),
    ("ed", "", 3), ("ly", "", 4), ("s", "", 3),
)  # fmt: skip
_KEEP_ENDINGS = ("eed", "ss", "us", "is")  # speed, process, status, analysis
# BM25F (Robertson and Zaragoza) over a tool's fields. Each field has a weight, and a share
# of its length that dampens a word's count (BM25's b: 0 not at all, 1 in full). The name
# and titles say what the tool is; its server's names say which service; the description
# and the parameters (names, descriptions, choices) say what it does; what the server says
# about itself (description, instructions) is the same for all its tools, so it counts
# little. Measured on benchmarks/search_eval's dev queries (bench_search.py --eval).
_FIELDS = ("name", "server", "description", "parameters", "about")
_FIELD_WEIGHT = (3.0, 2.0, 1.0, 0.6, 0.3)
_FIELD_LENGTH_NORM = (0.3, 0.0, 0.75, 0.75, 0.5)
_SATURATION = 1.2  # BM25's k1: how soon more of one word stops adding
_RELATED_WEIGHT = 0.6  # a word of the same concept (_CONCEPTS), or a part of a camel-case word
_SPELLING_WEIGHT = 0.7  # times _similarity: a word that starts like the query's (repo, repository)
_NAME_COVERAGE_WEIGHT = 0.5  # times the share of the tool's name the query covers, times its mean idf
_UNASKED_DESTRUCTIVE = 0.85  # a destructive tool, when the query asks for no change
_OTHER_INTENT = 0.85  # a tool that does something else than the query asks (_INTENT_WORDS)
_GENERIC_NAME_WORDS = frozenset({"get"})  # left out of a name's coverage: get_sum is "sum"

# Bounds on what the sandbox may ask of a search (defense in depth: the ranking runs on
# the host, outside the container's CPU limit).
MAX_SEARCH_QUERY_CHARS = 500
MAX_SEARCH_TERMS = 16
MAX_SEARCH_LIMIT = 50
# Bounds on what a server's own text adds to its index (it is tokenized once per tool list).
MAX_ABOUT_CHARS = 4000
_MAX_INDEXED_PROPERTIES = 200
_MAX_PROPERTY_DEPTH = 3
_MAX_INDEXED_CHOICES = 20  # of one property's enum

# Search by meaning with a small thesaurus: words that mean the same thing to someone
# looking for a tool. A query word also finds the other words of each group it is in, at
# _RELATED_WEIGHT; so do two query words in a row that make a two-word item ("pull+request":
# as a word found, each of its two). Plain English, about what tools do (common verbs,
# the nouns of common domains); no server's tool names.
_CONCEPTS = (
    "remember memory memorize recall",
    "remember store save keep note record",
    "fact observation note knowledge information info",
    "person people someone somebody user contact human individual friend colleague coworker teammate "
    "member employee entity",
    "entity node",
    "folder directory dir",
    "file document",
    "save write store persist record",
    "read open load view",
    "show display print view list",
    "delete remove erase forget drop unlink destroy discard",
    "create make new add open build generate propose",
    "add sum plus total addition",
    "number integer numeric",
    "now current today present",
    "clock time",
    "timezone zone tz",
    "move rename",
    "find search lookup locate query grep seek",
    "list enumerate",
    "size big large bytes",
    "info information metadata detail stat",
    "edit modify change update patch replace alter revise",
    "compress gzip zip archive",
    "echo repeat",
    "environment env",
    "variable var setting",
    "image picture photo screenshot png",
    "relation relationship link connect",
    "url link web page website site webpage internet online browser",
    "get fetch retrieve obtain download",
    "run execute invoke launch evaluate eval",
    "message chat post send publish share dm submit",
    "channel room conversation chat",
    "reply respond answer",
    "email mail",
    "issue bug ticket bug+report problem defect",
    "pr pull+request merge+request propose",
    "repository repo project codebase",
    "navigate go visit browse open",
    "screenshot capture snapshot screen",
    "text content body",
    "calendar event meeting schedule appointment",
    "database db sql table row",
    "log logging",
    "error failure exception",
    "copy duplicate",
    "tree hierarchy recursive",
    "history log timeline",
    "latest newest recent last",
    "version release",
    "balance money funds",
    "stop cancel abort halt terminate kill",
    "pause suspend",
    "resume restore unpause wake",
    "append add attach",
    "monitor watch track observe",
    "schema structure columns fields properties",
)
# Two words that ask for a concept neither says: a term of its own.
_PHRASES = {
    ("what", "time"): "now", ("what", "date"): "now", ("what", "day"): "now",
    ("how", "many"): "count", ("look", "up"): "search", ("code", "change"): "pr",
}  # fmt: skip
# A place with a time zone of its own ("Tokyo", "New York": the tz database's cities) also
# finds these.
_PLACE_RELATED = ("timezone", "time")
_TIME_ZONE_REGIONS = frozenset({
    "Africa", "America", "Antarctica", "Arctic", "Asia", "Atlantic", "Australia", "Europe", "Indian",
    "Pacific",
})  # fmt: skip
# Destructive tools rank lower unless a query word asks for a change.
_DESTRUCTIVE_VERBS = frozenset(
    {"delete", "remove", "erase", "drop", "destroy", "purge", "clear", "wipe", "unlink"}
)
_CHANGE_WORDS = _DESTRUCTIVE_VERBS | {
    "forget", "overwrite", "replace", "edit", "modify", "change", "update", "patch", "move", "rename",
    "write", "save", "store", "reset",
}  # fmt: skip
# What a query asks for, told by its first word of these (verbs, and question words that
# read): to read, or to act: create, update, delete, or any of them ("act": save, write).
# What a tool does, told by its readOnlyHint and the first of these words in its name. A
# tool that reads when the query acts (or the other way round), or that does another of
# create, update and delete, ranks lower (_OTHER_INTENT).
_INTENT_WORDS = {
    "read": "get show list read view display see find search look fetch retrieve check describe "
    "print query what which who where when",
    "create": "create make add new post send publish share reply comment propose upload append remember",
    "update": "edit modify change update patch replace alter revise rename move set overwrite reset",
    "delete": "delete remove erase drop destroy purge clear wipe unlink forget discard",
    "act": "write save store record put push merge",
}


def _stem(word: str) -> str:
    """Light stemming so word forms meet: timezones/timezone, reading/read, created/create."""
    if word.endswith(_KEEP_ENDINGS):
        return word
    for suffix, replacement, shortest in _SUFFIXES:
        stem = word[: len(word) - len(suffix)]
        if word.endswith(suffix) and len(stem) >= shortest and re.search("[aeiouy]", stem):
            word = stem + replacement
            break
    return word[:-1] if len(word) >= 5 and word.endswith("e") else word  # write/writ(ing)


def _words(text: str) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each word of a text in lower case, with its parts where it is written in camel case:
    "GitHub" -> ("github", ("git", "hub")); "getFileInfo" -> its three words; else no parts.
    A brand is one word to whoever types it, an identifier several."""
    for match in _RAW_WORD.finditer(text):
        parts = _WORD.findall(match.group())
        yield match.group().lower(), tuple(part.lower() for part in parts) if len(parts) > 1 else ()


def _tokens(text: str, whole: bool = True) -> tuple[str, ...]:
    """The stems of a text's words (stop words and single letters left out), a camel-case
    word both whole and in its parts ("GitHub": github, git, hub); ``whole`` False: its
    parts only.
    No cache keyed by text: queries come from the sandbox. Tool texts are tokenized once
    per tool list instead (index_tools, kept by the caller)."""
    stems: list[str] = []
    for word, parts in _words(text):
        for item in (word, *parts) if whole or not parts else parts:
            if len(item) > 1 and item not in _STOP_WORDS:
                stems.append(_stem(item))
    return tuple(stems)


def _related_stems() -> dict[tuple[str, ...], frozenset[str]]:
    """The stems of an item of _CONCEPTS (one word, or two: "pull+request") -> the stems of
    the other items of every group it is in."""
    related: dict[tuple[str, ...], set[str]] = {}
    for group in _CONCEPTS:
        items = {tuple(_stem(word) for word in item.split("+")) for item in group.split()}
        for item in items:
            related.setdefault(item, set()).update(stem for other in items - {item} for stem in other)
    return {item: frozenset(others) for item, others in related.items()}


_RELATED = _related_stems()
_PLACE_STEMS = tuple(_stem(word) for word in _PLACE_RELATED)
_DESTRUCTIVE_STEMS = frozenset(_stem(word) for word in _DESTRUCTIVE_VERBS)
_CHANGE_STEMS = frozenset(_stem(word) for word in _CHANGE_WORDS)
_INTENTS = {_stem(word): intent for intent, words in _INTENT_WORDS.items() for word in words.split()}


@lru_cache(maxsize=1)
def _places() -> frozenset[str]:
    """The cities of the tz database, lower case, letters only ("newyork"); empty where the
    system has no time zone data."""
    import zoneinfo  # for search only, once

    return frozenset(
        re.sub(r"[^a-z]", "", name.rsplit("/", 1)[-1].lower())
        for name in zoneinfo.available_timezones()
        if name.split("/", 1)[0] in _TIME_ZONE_REGIONS
    )


@dataclass(frozen=True)
class QueryTerm:
    """One term of a query: a stem, and the other stems that count for it, with their
    weight (related words: _RELATED_WEIGHT; the compound with the word before it: 1)."""

    stem: str
    related: Mapping[str, float]


def query_terms(query: str) -> list[QueryTerm]:
    """The terms of a query, at most MAX_SEARCH_TERMS (the first ones): the distinct stems
    of its words, each with the related stems of _CONCEPTS (those of the two-word item it
    ends too: "pull request" -> "pr"), its parts where it is written in camel case ("GitHub"
    -> "git", "hub"), the compound it makes with the previous word ("time zones" ->
    "timezone") and, for a city ("Tokyo", "New York"), "timezone" and "time"; plus a term
    for each phrase of _PHRASES ("what time" -> "now")."""
    terms: dict[str, dict[str, float]] = {}

    def add(stem: str) -> dict[str, float]:
        related = terms.setdefault(stem, {})
        for other in sorted(_RELATED.get((stem,), ())):
            related.setdefault(other, _RELATED_WEIGHT)
        return related

    recent: list[str] = []  # the last three words, stop words included
    for word, parts in _words(_text(query)):
        if len(terms) >= MAX_SEARCH_TERMS:
            break
        previous = recent[-1] if recent else ""
        recent = [*recent[-2:], word]
        if len(word) > 1 and word not in _STOP_WORDS:
            related = add(_stem(word))
            for part in parts:
                if len(part) > 1 and part not in _STOP_WORDS:
                    related.setdefault(_stem(part), _RELATED_WEIGHT)
            if len(previous) > 1 and previous not in _STOP_WORDS:
                related[_stem(previous + word)] = 1.0
                for other in sorted(_RELATED.get((_stem(previous), _stem(word)), ())):
                    related.setdefault(other, _RELATED_WEIGHT)
            if any("".join(recent[-n:]) in _places() for n in range(1, len(recent) + 1)):
                for stem in _PLACE_STEMS:
                    related.setdefault(stem, _RELATED_WEIGHT)
        phrase = _PHRASES.get((previous, word))
        if phrase and len(terms) < MAX_SEARCH_TERMS:
            add(_stem(phrase))
    return [QueryTerm(stem, related) for stem, related in terms.items()]


def query_intent(query: str) -> str:
    """What the query asks for, by its first word in _INTENT_WORDS: "read", "create",
    "update", "delete", "act" or "" (not told). "show the issues": read; "comment on an
    issue": create."""
    for word in _WORD.findall(_text(query)[:MAX_SEARCH_QUERY_CHARS]):
        intent = _INTENTS.get(_stem(word.lower()))
        if intent:
            return intent
    return ""


def search_terms(query: str) -> list[str]:
    """The stems of a query's terms (query_terms), at most MAX_SEARCH_TERMS."""
    return [term.stem for term in query_terms(query)]


def _transposed(a: str, b: str) -> bool:
    """Whether swapping two neighbouring letters of ``a`` gives ``b``."""
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y] if len(a) == len(b) else []
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def _similarity(term: str, token: str) -> float:
    """1.0 same stem; 0.7 one a prefix of the other (a token shorter than the term: of 4
    letters at least, so "per" of perPage is not "person"); less for a shared start,
    swapped letters or a near spelling (difflib ratio >= 0.8)."""
    if term == token:
        return 1.0
    shorter, longer = sorted((len(term), len(token)))
    prefix = next((i for i, (x, y) in enumerate(zip(term, token, strict=False)) if x != y), shorter)
    whole = prefix == shorter >= (3 if len(term) <= len(token) else 4)
    score = 0.7 if whole else 0.6 * prefix / shorter if prefix >= 4 else 0.0
    if shorter < 3:  # two letters ("pr", "db") are a word, not a spelling of one ("per")
        return score
    if score < 0.5 and _transposed(term, token):  # fiel/file
        score = 0.5
    if score < 0.6 and 3 * shorter >= 2 * longer:  # a ratio >= 0.8 needs lengths within 2:3
        matcher = SequenceMatcher(None, term, token)
        if matcher.quick_ratio() >= 0.8 and (ratio := matcher.ratio()) >= 0.8:
            score = max(score, 0.6 * ratio)
    return score


def _property_fields(schema: object, fields: list[object], depth: int = 0) -> None:
    """The names, descriptions and string choices (enum: state "open"/"closed") of a
    schema's properties, nested ones (objects, arrays of objects) included, up to
    _MAX_PROPERTY_DEPTH levels and _MAX_INDEXED_PROPERTIES fields."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping) or depth > _MAX_PROPERTY_DEPTH:
        return
    for name, prop in properties.items():
        if len(fields) >= _MAX_INDEXED_PROPERTIES:
            return
        fields.append(name)
        if isinstance(prop, Mapping):
            fields.append(prop.get("description"))
            choices = prop.get("enum")
            if isinstance(choices, list):
                fields.append(" ".join(c for c in choices[:_MAX_INDEXED_CHOICES] if isinstance(c, str)))
            items = prop.get("items")
            _property_fields(items if isinstance(items, Mapping) else prop, fields, depth + 1)


@dataclass(frozen=True)
class ServerTokens:
    """What a server says about itself, as stems for each of its tools: its names (alias,
    configured name, serverInfo name and title: the "server" field) and what it says it is
    for (serverInfo description and instructions, the first MAX_ABOUT_CHARS: "about")."""

    names: tuple[str, ...] = ()
    about: tuple[str, ...] = ()


def server_tokens(names: Iterable[object], about: object = "") -> ServerTokens:
    return ServerTokens(
        tuple(stem for name in names for stem in _tokens(_text(name))),
        _tokens(_text(about)[:MAX_ABOUT_CHARS]),
    )


def _tool_fields(
    alias: str, tool: Mapping[str, object], server: ServerTokens | None
) -> tuple[Counter[str], ...]:
    """Each of _FIELDS of a tool, as its stems with their counts (the server's: ``server``,
    or the alias alone)."""
    annotations = tool.get("annotations")
    names = [tool.get("name"), tool.get("title")]
    if isinstance(annotations, Mapping):
        names.append(annotations.get("title"))
    parameters: list[object] = []
    _property_fields(tool.get("inputSchema"), parameters)

    def stems(texts: Iterable[object]) -> Counter[str]:
        return Counter(stem for text in texts for stem in _tokens(_text(text)))

    server = server or ServerTokens(_tokens(alias))
    return (
        stems(names), Counter(server.names), stems([tool.get("description")]), stems(parameters),
        Counter(server.about),
    )  # fmt: skip


@dataclass(frozen=True)
class IndexedTool:
    """A tool as the ranking reads it: each of its _FIELDS as stems with their counts, the
    stems of its name (for the name's coverage), what it does (its intent) and whether it
    destroys."""

    alias: str
    tool: Mapping[str, object]
    fields: tuple[Mapping[str, int], ...]
    name: tuple[str, ...]
    intent: str = ""  # what the tool does (_tool_intent)
    destructive: bool = False  # its destructiveHint, or a name that starts with delete, remove...


def _tool_intent(tool: Mapping[str, object]) -> str:
    """What the tool does: read, when its readOnlyHint says so; else the intent of the first
    word of its name in _INTENT_WORDS (``list_issues``: read; ``slack_post_message``:
    create); else "act" when its readOnlyHint is false; else "" (not told)."""
    annotations = tool.get("annotations")
    read_only = annotations.get("readOnlyHint") if isinstance(annotations, Mapping) else None
    if read_only is True:
        return "read"
    named = next(filter(None, map(_INTENTS.get, _tokens(_text(tool.get("name"))))), "")
    return "act" if read_only is False and named in ("", "read") else named


def _other_intent(asked: str, done: str) -> bool:
    """Whether a tool that does ``done`` does something else than a query asks (``asked``):
    reads when asked to act or the other way round, or does another of create, update and
    delete. Intents not told, and "act", agree with every action."""
    if not asked or not done or asked == done:
        return False
    return "read" in (asked, done) or "act" not in (asked, done)


def index_tools(
    tools: Iterable[tuple[str, Mapping[str, object]]],
    servers: Mapping[str, ServerTokens] | None = None,
) -> list[IndexedTool]:
    """The search entries of (server alias, tool) pairs; ``servers``: alias -> server_tokens.
    A name's words for its coverage leave out _GENERIC_NAME_WORDS and the words every tool
    of its server has in its name, when it has three or more: a prefix ("slack" of
    slack_post_message) says which server, not what the tool does."""
    servers = servers or {}
    pairs = list(tools)
    names = [_tokens(_text(tool.get("name")), whole=False) for _, tool in pairs]
    shared: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for (alias, _), name in zip(pairs, names, strict=True):
        shared[alias] = shared[alias] & set(name) if alias in shared else set(name)
        count[alias] = count.get(alias, 0) + 1
    entries = []
    for (alias, tool), name in zip(pairs, names, strict=True):
        annotations = tool.get("annotations")
        destructive = isinstance(annotations, Mapping) and annotations.get("destructiveHint") is True
        entries.append(
            IndexedTool(
                alias,
                tool,
                _tool_fields(alias, tool, servers.get(alias)),
                tuple(
                    dict.fromkeys(
                        word
                        for word in name
                        if word not in _GENERIC_NAME_WORDS and (count[alias] < 3 or word not in shared[alias])
                    )
                ),
                _tool_intent(tool),
                destructive or (bool(name) and name[0] in _DESTRUCTIVE_STEMS),
            )
        )
    return entries


class ToolIndex:
    """The tools searched at once, as BM25F reads them: each stem -> each tool that has it
    (its position) -> the stem's count in each field, weighted and dampened by the field's
    length against its average. Built once per catalogue (the caller keeps it while the
    tool lists stay the same) and read, never changed, by every search."""

    def __init__(self, tools: Iterable[IndexedTool]) -> None:
        self.tools = tuple(tools)
        lengths = [[sum(entry.fields[i].values()) for i in range(len(_FIELDS))] for entry in self.tools]
        averages = [sum(column) / len(column) or 1.0 for column in zip(*lengths, strict=True)]
        postings: dict[str, dict[int, float]] = {}
        for position, (entry, sizes) in enumerate(zip(self.tools, lengths, strict=True)):
            weighted: dict[str, float] = {}
            for counts, size, average, weight, norm in zip(
                entry.fields, sizes, averages, _FIELD_WEIGHT, _FIELD_LENGTH_NORM, strict=True
            ):
                damping = 1 - norm + norm * size / average
                for stem, n in counts.items():
                    weighted[stem] = weighted.get(stem, 0.0) + weight * n / damping
            for stem, value in weighted.items():
                postings.setdefault(stem, {})[position] = value
        self.postings = postings
        self.vocabulary = sorted(postings)  # for the words that start like a query's

    def idf(self, stem: str) -> float:
        """BM25's rarity of a stem among the tools: a word every tool has counts little."""
        found = len(self.postings.get(stem, ()))
        return math.log(1 + (len(self.tools) - found + 0.5) / (found + 0.5))

    def matches(self, term: QueryTerm) -> dict[str, float]:
        """The stems a term finds, with how well: its own 1; a compound 1 and a related word
        _RELATED_WEIGHT (QueryTerm.related); a word that starts like it or is spelt nearly
        like it (_similarity: among the words that share its first three letters, or its
        first letter for a word the tools do not have, a typo maybe) times _SPELLING_WEIGHT."""
        found = {term.stem: 1.0} if term.stem in self.postings else {}
        start = term.stem[: 3 if found else 1]
        for token in self.vocabulary[bisect.bisect_left(self.vocabulary, start) :]:
            if not token.startswith(start):
                break
            if token != term.stem and (score := _similarity(term.stem, token)) > 0:
                found[token] = _SPELLING_WEIGHT * score
        for stem, weight in term.related.items():
            if stem in self.postings and weight > found.get(stem, 0.0):
                found[stem] = weight
        return found


@dataclass(frozen=True)
class QueryMatches:
    """A query, its terms (query_terms) and, for each, the stems of an index it finds and
    how well (ToolIndex.matches): found once per search, read by the ranking
    (rank_matches) and by query_coverage."""

    query: str
    terms: list[QueryTerm]
    found: list[dict[str, float]]


def match_query(query: str, index: ToolIndex) -> QueryMatches:
    terms = query_terms(query)
    return QueryMatches(query, terms, [index.matches(term) for term in terms])


def rank_tools(query: str, index: ToolIndex, limit: int = 5) -> list[tuple[float, str, Mapping[str, Any]]]:
    """rank_matches of ``query`` over ``index``."""
    return rank_matches(match_query(query, index), index, limit)


def rank_matches(
    matches: QueryMatches, index: ToolIndex, limit: int = 5
) -> list[tuple[float, str, Mapping[str, Any]]]:
    """The ``limit`` best (score, server alias, tool) matches for the query, best first.

    BM25F: each query term (query_terms) adds, for each tool, its best match among the
    stems it finds (ToolIndex.matches: how well, times the stem's rarity, times its
    weighted count in the tool's fields, saturated). To that is added the share of the
    tool's name the query covers (its server's prefix left out), times the query's mean
    rarity. A destructive tool scores x0.85 unless the query asks for a change; so does a
    tool that does something else than the query asks (query_intent: reads when asked to
    create, creates when asked to delete...). Ties go to the shorter tool name, then
    alphabetical order, so results are deterministic.
    """
    terms = matches.terms
    if not terms or limit <= 0 or not index.tools:
        return []
    scores: dict[int, float] = {}
    found: dict[str, float] = {}  # every stem the query finds, and how well: for the names' coverage
    for term_found in matches.found:
        best: dict[int, float] = {}
        for stem, match in term_found.items():
            found[stem] = max(found.get(stem, 0.0), match)
            rarity = match * index.idf(stem)
            for position, weighted in index.postings[stem].items():
                value = rarity * weighted * (_SATURATION + 1) / (_SATURATION + weighted)
                if value > best.get(position, 0.0):
                    best[position] = value
        for position, value in best.items():
            scores[position] = scores.get(position, 0.0) + value
    mean_idf = sum(index.idf(term.stem) for term in terms) / len(terms)
    asks_change = any(term.stem in _CHANGE_STEMS for term in terms)
    intent = query_intent(matches.query)
    ranked: list[tuple[float, str, Mapping[str, Any]]] = []
    for position, matched in scores.items():
        entry = index.tools[position]
        covered = sum(found.get(word, 0.0) for word in entry.name) / max(len(entry.name), 1)
        score = matched + _NAME_COVERAGE_WEIGHT * mean_idf * covered
        if not asks_change and entry.destructive:
            score *= _UNASKED_DESTRUCTIVE
        elif _other_intent(intent, entry.intent):
            score *= _OTHER_INTENT
        ranked.append((round(score, 4), entry.alias, entry.tool))
    ranked.sort(key=lambda hit: (-hit[0], len(_text(hit[2].get("name"))), _text(hit[2].get("name")), hit[1]))
    return ranked[:limit]


GOOD_MATCH = 1 / 3  # query_coverage of a best hit that is worth trusting
WEAK_SEARCH_SERVERS_FROM = 20  # hits whose servers a weak search names as the likeliest


def query_coverage(matches: QueryMatches, index: ToolIndex, tool: Mapping[str, object]) -> float:
    """How much of the query ``tool`` (one of the index's) matches, 0 to 1: each term's
    rarity (idf) times how well the tool's stems match it (1: the word itself), over the
    rarity of all the terms. A best hit under GOOD_MATCH matches no more than scattered
    words."""
    entry = next((entry for entry in index.tools if entry.tool is tool), None)
    if entry is None or not matches.terms:
        return 0.0
    stems = set().union(*entry.fields)
    rarity = [index.idf(term.stem) for term in matches.terms]
    matched = [
        max((how for stem, how in found.items() if stem in stems), default=0.0) for found in matches.found
    ]
    return sum(r * m for r, m in zip(rarity, matched, strict=True)) / (sum(rarity) or 1.0)


def search_tools(
    query: str,
    tools: Sequence[tuple[str, Mapping[str, object]]],
    limit: int = 5,
    servers: Mapping[str, ServerTokens] | None = None,
) -> list[tuple[float, str, Mapping[str, Any]]]:  # the tools as given (JSON objects)
    """rank_tools over tools not indexed yet."""
    return rank_entries(query, index_tools(tools, servers), limit)


def rank_entries(
    query: str, entries: Iterable[IndexedTool], limit: int = 5
) -> list[tuple[float, str, Mapping[str, Any]]]:
    """rank_tools over entries not yet in an index of their own."""
    return rank_tools(query, ToolIndex(entries), limit)


# =============================================================================
# memory store
# =============================================================================
# What the agent remembers across sessions, on the host, written only by the bridge: one
# SQLite file (WAL, one transaction per write) under STATE_DIR/user_tools/. SQLite gives
# atomic writes that two bridges (Claude Desktop and Claude Code at once) can share on
# every platform, without locking code of ours. Values are JSON text.

MEMORY_DIRNAME = "user_tools"
MEMORY_FILENAME = "memory.sqlite3"
MAX_MEMORY_KEY_CHARS = 200
# What one memory costs on disk beyond its key, value and metadata (its row, its key again
# in the primary-key index, page slack): measured at about 270 bytes with 200-byte keys.
# The total cap counts it, so many small memories cannot fill the disk past the cap.
MEMORY_ENTRY_OVERHEAD = 256
# Values and metadata nested deeper than this are refused at save: every answer that
# carries them (load_memory, list_memories) is JSON-encoded again, and Python's encoder
# gives up (RecursionError) near 1000 levels.
MAX_MEMORY_DEPTH = 100
# list_memories() is answered a page at a time: at most MEMORY_PAGE_ENTRIES entries, and
# entries of at most this many bytes (keys and metadata; a larger single entry is a page of
# its own), so no answer nears the frame cap however many memories there are.
MEMORY_PAGE_ENTRIES = mcp_sandbox_kernel.MEMORY_PAGE_ENTRIES
MEMORY_PAGE_BYTES = 4 * 1024 * 1024
# Schema versions (PRAGMA user_version): 1 added "generation", a number drawn from one
# store-wide counter on every write, so it never repeats for a key, even one deleted and
# saved again (whose version starts from 1 again). update_memory commits only if the
# generation it read is still the key's: its condition cannot be met by an ABA.
MEMORY_SCHEMA_VERSION = 1
_MEMORY_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS memories (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    metadata TEXT,
    version INTEGER NOT NULL,
    size INTEGER NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0
)""",
    "CREATE TABLE IF NOT EXISTS memory_generation "
    "(id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO memory_generation (id, last) VALUES (1, 0)",
)


def validate_memory_key(key: str) -> str:
    if not key or len(key) > MAX_MEMORY_KEY_CHARS or not key.isprintable():
        raise MemoryStoreError(
            "Memory keys are 1-%d printable characters (no newlines or other control characters); "
            "got %s." % (MAX_MEMORY_KEY_CHARS, ascii(key[:60]) + ("..." if len(key) > 60 else ""))
        )
    return key


def check_memory_depth(value: object, what: str) -> None:
    """MemoryStoreError if ``value`` nests lists and objects deeper than MAX_MEMORY_DEPTH."""
    if json_depth(value, MAX_MEMORY_DEPTH) > MAX_MEMORY_DEPTH:
        raise MemoryStoreError(
            "The %s nests lists and objects deeper than %d levels, the most a memory may hold; "
            "flatten it (e.g. store the deep part as a JSON string)." % (what, MAX_MEMORY_DEPTH)
        )


def memory_json(value: object, what: str) -> str:
    """``value`` as the JSON text the store keeps; MemoryStoreError if it cannot be."""
    check_memory_depth(value, what)
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise MemoryStoreError("The %s cannot be stored as JSON: %s." % (what, exc)) from None
    except UnicodeEncodeError:
        raise MemoryStoreError(
            "The %s holds text that is not valid Unicode (a lone surrogate)." % what
        ) from None
    return text


MEMORY_BUSY_SECONDS = 30.0  # how long a store operation waits for other bridges' writes


class MemoryInfo(TypedDict):
    """A memory as listed: its key, metadata and bookkeeping (and its value, in a snapshot)."""

    key: str
    value: NotRequired[JSON]  # snapshot() only
    metadata: JSON  # as saved ({} for none; {"unreadable": why} when it cannot be read back)
    size: int  # bytes of its value's and metadata's JSON: what counts against the caps
    version: int
    created: str  # ISO 8601, UTC
    updated: str
    value_size: NotRequired[int]  # entries(value_sizes=True) only: its value's JSON alone


class MemoryLoaded(TypedDict):
    found: bool
    value: JSON  # None when not found
    version: int  # 0 when not found
    generation: int  # what put_if compares; 0 when not found


class MemoryPutIf(TypedDict):
    ok: bool
    version: NotRequired[int]  # when written
    generation: NotRequired[int]  # when not: the key's generation now


class MemoryPage(TypedDict):
    memories: list[MemoryInfo]
    more: bool  # whether keys follow


class MemoryStore:
    """The memory table. Every method is blocking (call it in a worker thread) and opens
    its own connection, so it is safe from any thread and any process."""

    def __init__(
        self,
        directory: Path,
        max_value_bytes: int,
        max_total_bytes: int,
        max_entries: int = BridgeConfig.max_memories,
    ) -> None:
        self.path = directory / MEMORY_FILENAME
        self.max_value_bytes = max_value_bytes
        self.max_total_bytes = max_total_bytes
        self.max_entries = max_entries

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection]:
        connection = self._begin(write)
        try:
            yield connection
            connection.execute("COMMIT")
        except sqlite3.Error as exc:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise self._unusable(exc) from None
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        finally:
            connection.close()

    def _begin(self, write: bool) -> sqlite3.Connection:
        """A connection inside a transaction (BEGIN IMMEDIATE to write). Another bridge's
        write is waited for (the busy timeout); the few moments where SQLite answers
        "locked" at once instead (a WAL file being checkpointed away by the last connection
        to close, or made anew) are retried until the same 30 s have passed."""
        deadline = time.monotonic() + MEMORY_BUSY_SECONDS
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                connection = sqlite3.connect(self.path, timeout=MEMORY_BUSY_SECONDS, isolation_level=None)
            except (OSError, sqlite3.Error) as exc:
                raise self._unusable(exc) from None
            try:
                if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    connection.execute("PRAGMA journal_mode=WAL")  # once per file: it is persistent
                if connection.execute("PRAGMA user_version").fetchone()[0] < MEMORY_SCHEMA_VERSION:
                    self._migrate(connection)
                connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                return connection
            except sqlite3.OperationalError as exc:
                connection.close()
                if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() > deadline:
                    raise self._unusable(exc) from None
                time.sleep(random.uniform(0.005, 0.05))
            except sqlite3.Error as exc:
                connection.close()
                raise self._unusable(exc) from None

    @staticmethod
    def _migrate(connection: sqlite3.Connection) -> None:
        """Create the tables, or bring a file of an earlier schema up to date in place, in
        one transaction (another bridge may be doing the same: the second finds it done).
        Rows from before generations each get their own (their rowid), and the counter
        starts above them all."""
        connection.execute("BEGIN IMMEDIATE")
        try:
            if connection.execute("PRAGMA user_version").fetchone()[0] < MEMORY_SCHEMA_VERSION:
                connection.execute(_MEMORY_SCHEMA[0])
                columns = {row[1] for row in connection.execute("PRAGMA table_info(memories)")}
                if "generation" not in columns:
                    connection.execute(
                        "ALTER TABLE memories ADD COLUMN generation INTEGER NOT NULL DEFAULT 0"
                    )
                for statement in _MEMORY_SCHEMA[1:]:
                    connection.execute(statement)
                connection.execute("UPDATE memories SET generation = rowid WHERE generation = 0")
                connection.execute(
                    "UPDATE memory_generation SET last = MAX(last, (SELECT COALESCE(MAX(generation), 0) "
                    "FROM memories))"
                )
                connection.execute("PRAGMA user_version = %d" % MEMORY_SCHEMA_VERSION)
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise

    def _unusable(self, exc: BaseException) -> MemoryStoreError:
        # Reported, never replaced: the file may hold the user's only copy.
        return MemoryStoreError(
            "The memory store %s cannot be used (%s: %s). It was left untouched; move it aside to start "
            "a new one." % (self.path, type(exc).__name__, exc)
        )

    def _encode(self, value: object, metadata: Mapping[str, object] | None) -> tuple[str, str | None]:
        text = memory_json(value, "value")
        meta = None if metadata is None else memory_json(metadata, "metadata")
        self._entry_size(text, meta)  # refused before the store is opened, when it can be
        return text, meta

    def _entry_size(self, text: str, meta: str | None) -> int:
        """Bytes an entry counts against both caps: its value's and its metadata's JSON."""
        value_bytes = len(text.encode("utf-8"))
        meta_bytes = 0 if meta is None else len(meta.encode("utf-8"))
        size = value_bytes + meta_bytes
        if size > self.max_value_bytes:
            parts = (
                "The value is %d bytes" % value_bytes
                if not meta_bytes
                else "The value (%d bytes) and its metadata (%d bytes) are %d bytes together"
                % (value_bytes, meta_bytes, size)
            )
            raise MemoryStoreError(
                "%s, over the %d-byte cap per memory (MCP_BRIDGE_MAX_MEMORY_BYTES; value and metadata "
                "count together)." % (parts, self.max_value_bytes)
            )
        return size

    def _write(self, db: sqlite3.Connection, key: str, text: str, meta: str | None) -> int:
        row = db.execute("SELECT version, metadata FROM memories WHERE key = ?", (key,)).fetchone()
        # metadata=None keeps the entry's metadata (the upsert below), so it counts too.
        size = self._entry_size(text, meta if meta is not None or row is None else row[1])
        count, others = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size + length(CAST(key AS BLOB))), 0) FROM memories "
            "WHERE key != ?",
            (key,),
        ).fetchone()
        if row is None and count >= self.max_entries:
            raise MemoryStoreError(
                "There are already %d memories, the most the store holds (MCP_BRIDGE_MAX_MEMORIES); "
                "delete_memory() the ones you no longer need (list_memories() names them), or keep "
                "related values together under one key." % count
            )
        # A memory takes its key, value, metadata and bookkeeping on disk: all count.
        others += count * MEMORY_ENTRY_OVERHEAD
        needed = size + len(key.encode("utf-8")) + MEMORY_ENTRY_OVERHEAD
        if others + needed > self.max_total_bytes:
            raise MemoryStoreError(
                "Storing %d bytes (value and metadata; %d with its key and %d bytes of bookkeeping) would "
                "take the memory store over its %d-byte total (MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES; the other "
                "%d memories hold %d bytes, keys and bookkeeping included); delete memories you no longer "
                "need." % (size, needed, MEMORY_ENTRY_OVERHEAD, self.max_total_bytes, count, others)
            )
        now = time.time()
        version = (row[0] if row else 0) + 1
        db.execute("UPDATE memory_generation SET last = last + 1")
        generation = db.execute("SELECT last FROM memory_generation").fetchone()[0]
        db.execute(
            "INSERT INTO memories (key, value, metadata, version, size, created, updated, generation) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
            "metadata = COALESCE(excluded.metadata, memories.metadata), version = excluded.version, "
            "size = excluded.size, updated = excluded.updated, generation = excluded.generation",
            (key, text, meta, version, size, now, now, generation),
        )
        return int(version)

    def save(self, key: str, value: object, metadata: Mapping[str, object] | None = None) -> MemoryInfo:
        text, meta = self._encode(value, metadata)
        with self._transaction(write=True) as db:
            self._write(db, validate_memory_key(key), text, meta)
        info = self.info(key)
        assert info is not None
        return info

    def load(self, key: str) -> MemoryLoaded:
        """{"found": bool, "value": ..., "version": int, "generation": int} (0 and 0 when not
        found); "generation" is what put_if compares."""
        with self._transaction(write=False) as db:
            row = db.execute(
                "SELECT value, version, generation FROM memories WHERE key = ?", (validate_memory_key(key),)
            ).fetchone()
        if row is None:
            return {"found": False, "value": None, "version": 0, "generation": 0}
        value = _stored_json(row[0], key, "value")
        return {"found": True, "value": value, "version": row[1], "generation": row[2]}

    def put_if(self, key: str, value: object, generation: int) -> MemoryPutIf:
        """Write ``value`` only if the key is still at ``generation`` (0: still absent), as
        load read it: the commit half of update_memory, whose function runs in the sandbox
        in between. Generations never repeat, so a delete and a new save in between (whose
        version may be the same again) still makes the write fail."""
        text, meta = self._encode(value, None)
        with self._transaction(write=True) as db:
            row = db.execute(
                "SELECT generation FROM memories WHERE key = ?", (validate_memory_key(key),)
            ).fetchone()
            current = row[0] if row else 0
            if current != generation:
                return {"ok": False, "generation": current}
            return {"ok": True, "version": self._write(db, key, text, meta)}

    def delete(self, key: str) -> bool:
        with self._transaction(write=True) as db:
            return db.execute("DELETE FROM memories WHERE key = ?", (validate_memory_key(key),)).rowcount > 0

    def info(self, key: str) -> MemoryInfo | None:
        rows = self._infos("WHERE key = ?", (validate_memory_key(key),))
        return rows[0] if rows else None

    def entries(self, value_sizes: bool = False) -> list[MemoryInfo]:
        """Every memory's info; ``value_sizes``: with "value_size", the bytes of its value's
        JSON alone ("size" counts the metadata too, as the caps do)."""
        return self._infos("ORDER BY key", (), value_sizes=value_sizes)

    def page(self, after: str | None = None, limit: int = MEMORY_PAGE_ENTRIES) -> MemoryPage:
        """{"memories": the infos of the keys after ``after`` in key order, at most ``limit``
        of them and about MEMORY_PAGE_BYTES of keys and metadata (at least one), "more":
        whether keys follow}: what list_memories() asks for, one bounded answer at a time."""
        after = after or ""
        infos = self._infos(
            "WHERE key IN (SELECT key FROM (SELECT key, ROW_NUMBER() OVER w AS n, "
            "SUM(length(CAST(key AS BLOB)) + COALESCE(length(CAST(metadata AS BLOB)), 0)) OVER w AS running "
            "FROM memories WHERE key > ? "
            "WINDOW w AS (ORDER BY key)) WHERE n <= ? AND (n = 1 OR running <= ?)) ORDER BY key",
            (after, min(limit, MEMORY_PAGE_ENTRIES), MEMORY_PAGE_BYTES),
        )
        last = infos[-1]["key"] if infos else after
        with self._transaction(write=False) as db:
            more = db.execute("SELECT 1 FROM memories WHERE key > ? LIMIT 1", (last,)).fetchone() is not None
        return {"memories": infos, "more": more}

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Every memory, its value first, then its info, read in one transaction: a
        consistent copy even while another bridge writes."""
        memories: dict[str, dict[str, object]] = {}
        for entry in self._infos("ORDER BY key", (), with_values=True):
            info = {name: field for name, field in entry.items() if name not in ("key", "value")}
            memories[entry["key"]] = {"value": entry.get("value"), **info}
        return memories

    def _infos(
        self, where: str, args: tuple[str | int, ...], with_values: bool = False, value_sizes: bool = False
    ) -> list[MemoryInfo]:
        columns = "key, metadata, size, version, created, updated" + (", value" if with_values else "")
        with self._transaction(write=False) as db:
            rows = db.execute("SELECT %s FROM memories %s" % (columns, where), args).fetchall()
        infos = []
        for key, metadata, size, version, created, updated, *value in rows:
            shown: JSON
            try:
                shown = _stored_json(metadata, key, "metadata") if metadata else {}
            except MemoryStoreError as exc:  # one bad entry must not hide the others
                shown = {"unreadable": str(exc)}
            info: MemoryInfo = {
                "key": key,
                "metadata": shown,
                "size": size,
                "version": version,
                "created": _iso_time(created),
                "updated": _iso_time(updated),
            }
            if with_values:
                info["value"] = _stored_json(value[0], key, "value")
            if value_sizes:
                info["value_size"] = size - (len(metadata.encode("utf-8")) if metadata else 0)
            infos.append(info)
        return infos


def _stored_json(text: str, key: str, what: str) -> JSON:
    """A stored value or metadata decoded, or MemoryStoreError saying which memory cannot be
    read back and what to do: a store written by hand, or before depth was checked at
    save, may hold JSON nested deeper than Python's decoder goes (RecursionError)."""
    try:
        value: JSON = json.loads(text)
        return value
    except (RecursionError, ValueError) as exc:
        raise MemoryStoreError(
            "The %s of the memory %r cannot be read back (%s: it nests deeper than %d levels or "
            "is not JSON); delete it with delete_memory(%r) or, on the host, `%s memory delete %s`."
            % (what, key, type(exc).__name__, MAX_MEMORY_DEPTH, key, SERVER_NAME, key)
        ) from None


# CPython's parser keeps recursion bookkeeping that two threads parsing at once can upset
# ("SystemError: AST constructor recursion depth mismatch"): saved tools are parsed one at
# a time in the whole process, whichever principal's worker thread asks.
_PARSE_LOCK = threading.Lock()


def saved_tool_doc(source: str, filename: str = "<saved tool>") -> str:
    """The first line of the docstring of the function ``source`` defines ("" if none),
    with the parse that checks it: SyntaxError, ValueError, RecursionError or MemoryError
    for source that compile() may accept but the parser cannot take back."""
    with _PARSE_LOCK:
        compile(source, filename, "exec", dont_inherit=True)
        tree = ast.parse(source, filename)
    definition = tree.body[0] if tree.body else None
    doc = (
        ast.get_docstring(definition)
        if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef)
        else None
    )
    return (doc or "").strip().split("\n")[0]


_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


class SavedTool(TypedDict):
    """What save_tool answers: the tool's file, and every saved tool's name (so the kernel
    does not warn about calls to them)."""

    name: str
    path: str
    tools: list[str]


class SavedSource(TypedDict):
    """A saved tool as a fresh session defines it."""

    name: str
    path: str
    source: str
    digest: str  # sha256 of the file: what a quarantine names


class SavedSources(TypedDict):
    tools: list[SavedSource]  # in name order
    skipped: list[str]  # a notice for each tool left out


class SavedTools:
    """Saved tools: one readable Python file per tool, ``STATE_DIR/user_tools/<name>.py``,
    that the user may open and edit; written atomically (a temporary file, then
    os.replace), so a reader never sees half a file. Blocking, like MemoryStore.

    Bounded, because every new session loads them all: at most MAX_TOOLS tools and
    MAX_TOTAL_BYTES of source together (a save that would pass either is refused).

    Parsed once, at save: what listing needs (the docstring's first line) goes to
    ``.index/<name>.json`` with the file's size, mtime and digest, so a listing only
    stats the files. A file changed by hand is parsed once more, then indexed again.
    The index also holds a quarantine: the digest of a source whose definition killed
    or hung a sandbox's Python process; that source is not sent to new sessions until
    the file changes."""

    MAX_SOURCE_BYTES = 256 * 1024
    MAX_TOOLS = 1000
    MAX_TOTAL_BYTES = 10 * 1024 * 1024
    INDEX_DIRNAME = ".index"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.index_dir = directory / self.INDEX_DIRNAME

    def path(self, name: str) -> Path:
        if not (name.isidentifier() and not keyword.iskeyword(name) and len(name) <= 100):
            raise MemoryStoreError(
                "A saved tool's name must be a Python identifier of at most 100 characters."
            )
        return self.directory / (name + ".py")

    def save(self, name: str, source: str) -> SavedTool:
        path = self.path(name)
        data = source.encode("utf-8", "surrogatepass")
        if len(data) > self.MAX_SOURCE_BYTES:
            raise MemoryStoreError("The source of %s is over %d bytes." % (name, self.MAX_SOURCE_BYTES))
        try:  # the parse every listing relies on: what it cannot read back is refused here
            doc = saved_tool_doc(source, str(path))
        except _UNPARSABLE as exc:
            raise MemoryStoreError(
                "The source of %s does not compile or cannot be parsed back (%s: %s); simplify it (a "
                "very long or deeply nested expression) and save it again." % (name, type(exc).__name__, exc)
            ) from None
        self._check_room(path, len(data))
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = data if data.endswith(b"\n") else data + b"\n"
        try:
            write_atomically(path, data)
        except OSError as exc:
            raise MemoryStoreError("Could not write %s: %s" % (path, exc)) from None
        self._index(path, doc, hashlib.sha256(data).hexdigest())
        # "tools": every saved tool's name, so the kernel does not warn about calls to them.
        return {"name": name, "path": str(path), "tools": [other.stem for other in self._files()]}

    def _files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return [path for path in sorted(self.directory.glob("*.py")) if path.stem.isidentifier()]

    def _check_room(self, path: Path, size: int) -> None:
        """MemoryStoreError if one more tool, or ``size`` more bytes, would pass the bounds.
        Two bridges saving at the same moment may each pass it once: a soft bound."""
        others = [other for other in self._files() if other != path]
        if len(others) >= self.MAX_TOOLS:
            raise MemoryStoreError(
                "There are already %d saved tools, the most there may be; delete_tool() the ones you no "
                "longer need (list_saved_tools() names them)." % len(others)
            )
        used = 0
        for other in others:
            with suppress(OSError):  # deleted meanwhile: takes no room
                used += other.stat().st_size
        if used + size > self.MAX_TOTAL_BYTES:
            raise MemoryStoreError(
                "Saving %d bytes of source would take the saved tools over %d bytes together (the others "
                "hold %d); delete_tool() the ones you no longer need." % (size, self.MAX_TOTAL_BYTES, used)
            )

    def delete(self, name: str) -> bool:
        path = self.path(name)
        with suppress(OSError):
            (self.index_dir / (name + ".json")).unlink()
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    # --- the index: what listing needs, and the quarantine ------------------------------
    def _read_index(self, name: str) -> dict[str, JSON]:
        try:
            with (self.index_dir / (name + ".json")).open("rb") as file:
                record = json.loads(file.read(64 * 1024))
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _write_index(self, name: str, record: dict[str, JSON]) -> None:
        """Best effort: an index that cannot be written costs a parse at the next listing."""
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomically(self.index_dir / (name + ".json"), json.dumps(record).encode("utf-8"))
        except OSError as exc:
            logger.warning("saved tool index %s cannot be written: %s", self.index_dir, exc)

    def _index(self, path: Path, doc: str, digest: str | None = None) -> None:
        try:
            status = path.stat()
        except OSError:
            return
        record: dict[str, JSON] = {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "doc": doc}
        if digest is not None:
            record["digest"] = digest
        self._write_index(path.stem, record)

    def _listed(self, path: Path) -> tuple[str, dict[str, JSON]]:
        """The docstring's first line and the index record: from the index while the file
        is as indexed (same size and mtime), else parsed once (a hand-edited file) and
        indexed again. The record's "quarantined" holds only while the file is unchanged."""
        status = path.stat()
        record = self._read_index(path.stem)
        if record.get("size") == status.st_size and record.get("mtime_ns") == status.st_mtime_ns:
            return str(record.get("doc") or ""), record
        source = path.read_text(encoding="utf-8")
        try:
            doc = saved_tool_doc(source, str(path))
        except _UNPARSABLE as exc:
            doc = "(cannot be parsed: %s: %s)" % (type(exc).__name__, exc)
        self._index(path, doc)
        return doc, {}

    def quarantine(self, name: str, digest: str, reason: str) -> Path | None:
        """Keep the source whose sha256 is ``digest`` out of new sessions until the file
        changes; the tool's path, or None if its file no longer holds that source (deleted
        or changed since: it is tried again anyway)."""
        path = self.path(name)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            return None
        record = self._read_index(name)
        if record.get("digest") != digest:  # changed by hand since it was indexed
            with suppress(OSError, ValueError):
                record = {"doc": self._listed(path)[0]}
        with suppress(OSError):
            status = path.stat()
            record.update(size=status.st_size, mtime_ns=status.st_mtime_ns, digest=digest)
        record["quarantined"] = {"digest": digest, "reason": reason[:500], "since": _iso_time(time.time())}
        self._write_index(name, record)
        return path

    def _quarantine_of(self, name: str, digest: str) -> dict[str, JSON] | None:
        held = self._read_index(name).get("quarantined")
        return held if isinstance(held, dict) and held.get("digest") == digest else None

    # --- reading ------------------------------------------------------------------------
    def sources(self) -> SavedSources:
        """What a fresh session defines: {"tools": [{name, path, source, digest}] in name
        order, "skipped": [a notice for each tool left out]}. A quarantined source and a
        file that cannot be read are left out, each with its notice."""
        tools: list[SavedSource] = []
        skipped: list[str] = []
        for path in self._files():
            name = path.stem
            try:
                data = path.read_bytes()
                source = data.decode("utf-8")
            except (OSError, ValueError) as exc:
                logger.warning("saved tool %s cannot be read: %s", path, exc)
                skipped.append(
                    "Saved tool %s was not defined: its file %s cannot be read (%s)." % (name, path, exc)
                )
                continue
            digest = hashlib.sha256(data).hexdigest()
            held = self._quarantine_of(name, digest)
            if held is not None:
                skipped.append(quarantine_notice(name, path, str(held.get("reason")), str(held.get("since"))))
                continue
            tools.append({"name": name, "path": str(path), "source": source, "digest": digest})
        return {"tools": tools, "skipped": skipped}

    def entries(self) -> list[dict[str, str]]:
        """[{name, doc, path, quarantined?}] in name order, without parsing what is indexed.
        Any one file that cannot be read says so in its doc; the rest still list."""
        entries = []
        for path in self._files():
            entry = {"name": path.stem, "doc": "", "path": str(path)}
            try:
                entry["doc"], record = self._listed(path)
            except (OSError, ValueError) as exc:
                entry["doc"], record = "(cannot be read: %s: %s)" % (type(exc).__name__, exc), {}
            held = record.get("quarantined")
            if isinstance(held, dict):
                entry["quarantined"] = str(held.get("reason"))
            entries.append(entry)
        return entries


def quarantine_notice(name: str, path: Path, reason: str, since: str = "") -> str:
    return (
        "Saved tool %s was not defined: defining it %s%s, so it is kept out of new sessions until its "
        "file %s changes. Fix it with save_tool, or delete_tool(%r)."
        % (name, reason, " (%s)" % since if since else "", path, name)
    )


def _iso_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds")


# =============================================================================
# approvals and the call log
# =============================================================================
# A proxied call that the policy (approval_reason) says needs the user's approval waits
# where it is, in the live sandbox, while the bridge asks the user of the run_python call
# that made it (an elicitation through that call's client); the time it waits does not
# count toward the call's timeout. Every proxied call is then written to the call log.

APPROVAL_CHOICES: dict[str, str] = {
    "allow_once": "Allow this call",
    "allow_session": "Allow this tool for the rest of this session",
    "deny": "Deny",
}
MAX_SHOWN_ARGUMENTS = 1500  # characters of a call's arguments an approval request shows
CALL_LOG_FILENAME = "calls.jsonl"
CALL_LOG_MAX_BYTES = 10 * 1024 * 1024  # then it moves to calls.jsonl.1 (one older file is kept)
MAX_LOGGED_JSON = 64 * 1024  # characters of arguments and of a result a full log keeps per call


def at_next_pass(function: Callable[[*_Args], object], *args: *_Args) -> None:
    """``function(*args)`` at the event loop's next pass, after what the running task does
    until it waits (anyio's asyncio backend runs the bridge: asyncio is loaded already)."""
    import asyncio

    asyncio.get_running_loop().call_soon(function, *args)


def canonical_json(value: object) -> str:
    """One text for one value: the same arguments always give the same digest."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ProxiedCall:
    """One call of a proxied tool (or read of a resource or prompt) that sandbox code made,
    as the user is asked about it and the call log keeps it."""

    principal: str
    session_name: str
    server: str  # the server's configured name
    alias: str  # its mcp_<alias> in the sandbox
    tool: str  # the server's own name for the tool (or "resources/read", ...)
    arguments: Mapping[str, object]
    arguments_json: str  # canonical_json(arguments)

    @property
    def digest(self) -> str:
        """What an approval is bound to: this server, this tool, exactly these arguments."""
        text = canonical_json([self.server, self.tool]) + self.arguments_json
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    @property
    def shown(self) -> str:
        """The call as the model wrote it, its arguments cut to MAX_SHOWN_ARGUMENTS."""
        arguments = self.arguments_json
        if len(arguments) > MAX_SHOWN_ARGUMENTS:
            arguments = "%s ... (%d characters in all)" % (arguments[:MAX_SHOWN_ARGUMENTS], len(arguments))
        return "mcp_%s.%s(%s)" % (self.alias, python_identifier(self.tool), arguments)


def proxied_call(
    principal: str, session_name: str, spec: ServerSpec, tool: str, arguments: Mapping[str, object]
) -> ProxiedCall:
    return ProxiedCall(
        principal, session_name, spec.name, spec.alias, tool, arguments, canonical_json(arguments)
    )


@dataclass(frozen=True)
class ApprovalAnswer:
    """The user's answer to the request about the call with ``digest``; ``choice`` None:
    no choice (declined, dismissed, no answer, could not be asked), ``how`` says which."""

    digest: str
    choice: str | None
    how: str = ""


class UserQuestions(Protocol):
    """How the bridge reaches the user of a run_python call while its code runs: through
    that call's client (ClientQuestions, for a client that declared elicitation)."""

    async def approve(self, call: ProxiedCall, reason: str) -> ApprovalAnswer:
        """Ask whether ``call`` may go ahead (``reason``: why it asks)."""
        ...

    async def relay(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        """Pass on a question the proxied MCP server ``server`` asked its client."""
        ...


def approval_request(call: ProxiedCall, reason: str) -> tuple[str, dict[str, Any]]:
    """The message and the form (a requested schema) of an approval request."""
    size = len(call.arguments_json.encode("utf-8", "surrogatepass"))
    message = (
        "Code in run_python (session %r) wants to call a tool of the MCP server %r:\n\n%s\n\n"
        "(%d bytes of arguments.) Asked because %s. The call waits for your answer; denying it "
        "raises runtime.ApprovalDenied in the code. (Call %s)"
        % (call.session_name, call.server, call.shown, size, reason, call.digest[:12])
    )
    choices = [{"const": value, "title": title} for value, title in APPROVAL_CHOICES.items()]
    schema = {
        "type": "object",
        "properties": {"decision": {"type": "string", "title": "Your decision", "oneOf": choices}},
        "required": ["decision"],
    }
    return message, schema


def approval_answer(result: types.ElicitResult, digest: str) -> ApprovalAnswer:
    """What the client's answer to the request about the call ``digest`` decides."""
    if result.action != "accept":
        return ApprovalAnswer(
            digest,
            None,
            "the user declined"
            if result.action == "decline"
            # Claude Code in print mode (-p) cancels every elicitation at once, unseen.
            else "the request was dismissed (by the user, or by a client that cannot show it, such as "
            "Claude Code in print mode)",
        )
    decision = (result.content or {}).get("decision")
    if decision not in APPROVAL_CHOICES:
        return ApprovalAnswer(digest, None, "the answer chose none of the offered decisions")
    return ApprovalAnswer(digest, str(decision), "the user chose %r" % APPROVAL_CHOICES[str(decision)])


class SessionApprovals:
    """What the user of one sandbox session decided: the tools allowed for the rest of it
    (a reset or another session asks again); and whether its results have said that
    its client cannot be asked."""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        self.allowed: set[tuple[str, str]] = set()  # (server, tool)
        self.told_no_asking = False

    async def decide(
        self, call: ProxiedCall, reason: str, asker: UserQuestions | None, notices: list[str]
    ) -> str:
        """The call's decision for the log, once it may go ahead; ApprovalDeniedError if
        not. ``notices``: where a result's notice goes (the call ran without asking)."""
        if (call.server, call.tool) in self.allowed:
            return "allowed for this session"
        if asker is None:
            return self._without_asking(call, reason, notices)
        with anyio.move_on_after(self.config.approval_timeout):
            try:
                answer = await asker.approve(call, reason)
            except Exception as exc:  # the client is gone or refused the request
                answer = ApprovalAnswer(
                    call.digest, None, "the request could not reach the user (%s)" % _describe_exception(exc)
                )
            if answer.digest != call.digest:  # an answer is never taken for another call
                answer = ApprovalAnswer(call.digest, None, "the answer was for another call")
            if answer.choice == "allow_session":
                self.allowed.add((call.server, call.tool))
                return "allowed by the user for this session"
            if answer.choice == "allow_once":
                return "allowed once by the user"
            raise ApprovalDeniedError(denied_message(call, reason, answer.how), call.alias, call.tool)
        how = "no answer within %gs (MCP_BRIDGE_APPROVAL_TIMEOUT)" % self.config.approval_timeout
        raise ApprovalDeniedError(denied_message(call, reason, how), call.alias, call.tool)

    def _without_asking(self, call: ProxiedCall, reason: str, notices: list[str]) -> str:
        """A client that cannot be asked (it declared no elicitation): MCP_BRIDGE_APPROVE_FALLBACK."""
        if self.config.approve_fallback == "deny":
            how = (
                "this client cannot ask the user (it does not support elicitation) and "
                "MCP_BRIDGE_APPROVE_FALLBACK=deny"
            )
            raise ApprovalDeniedError(denied_message(call, reason, how), call.alias, call.tool)
        if not self.told_no_asking:
            self.told_no_asking = True
            notices.append(
                "Approvals are not available in this client (it cannot show the user a question: no MCP "
                "elicitation), so mcp_%s.%s ran without asking, as MCP_BRIDGE_APPROVE_FALLBACK=allow says "
                "(asked because %s). To restrict what code may call here, set MCP_BRIDGE_DENY_TOOLS "
                "(e.g. github.delete_*) or MCP_BRIDGE_ALLOW_TOOLS, or MCP_BRIDGE_APPROVE_FALLBACK=deny."
                % (call.alias, python_identifier(call.tool), reason)
            )
        return "allowed without asking (this client cannot ask)"


# --- asking over 2026-07-28: questions parked until the client's retry answers them --------
# That protocol has no server-to-client requests: the run_python call ends with an
# input_required result carrying the questions, and the client calls again with the same
# arguments and the answers (the SDK's RequestStateBoundary seals the state and binds it to
# the call and the principal). Meanwhile the code waits in the sandbox, as it does for an
# elicitation.


@dataclass(eq=False)
class ParkedQuestion:
    """One question waiting for the client's retry: its key in input_requests, what it
    asks, and (an approval's) the digest of the call it is about."""

    key: str
    params: types.ElicitRequestParams
    digest: str | None
    answered: anyio.Event = field(default_factory=anyio.Event)
    answer: types.ElicitResult | None = None
    bound_to: str | None = None  # the digest the answer is for (a retry's state names it)
    failure: str | None = None  # why it could not reach the user, when it could not
    sent: bool = False


class Elicitor(Protocol):
    """A client that can show its user a question (ClientQuestions)."""

    async def ask(self, params: types.ElicitRequestParams) -> types.ElicitResult: ...


class QuestionDesk:
    """The questions of one execute's code, parked until a run_python call that waits for
    it can carry them to its user: as elicitations (pump) or, over 2026-07-28, in an
    input_required result (take_unsent). A question asked while no call waits (after a
    "still running" answer) waits for the next call."""

    def __init__(self) -> None:
        self.waiting: dict[str, ParkedQuestion] = {}
        self.arrived = anyio.Event()  # set when a question parks; replaced once it is sent
        self._count = 0

    async def ask(self, params: types.ElicitRequestParams, digest: str | None) -> ParkedQuestion:
        """Park a question until a retry answers it; the answered question."""
        self._count += 1
        question = ParkedQuestion("q%d" % self._count, params, digest)
        self.waiting[question.key] = question
        self.arrived.set()
        try:
            await question.answered.wait()
        finally:
            self.waiting.pop(question.key, None)
        return question

    def has_unsent(self) -> bool:
        """Whether a question waits that no call or task has carried to the user yet."""
        return any(not question.sent for question in self.waiting.values())

    def take_unsent(self) -> list[ParkedQuestion]:
        """The questions no input_required result has carried yet (now they are sent)."""
        unsent = [question for question in self.waiting.values() if not question.sent]
        for question in unsent:
            question.sent = True
        self.arrived = anyio.Event()  # the next question to park wakes the next wait
        return unsent

    async def pump(self, client: Elicitor, start: Callable[..., object]) -> None:
        """While the call of ``client`` waits: send every question through it as it parks,
        each in a task that ``start`` starts (it outlives the call: an answer may come
        after the call answered "still running")."""
        while True:
            for question in self.take_unsent():
                start(self._ask, client, question)
            await self.arrived.wait()

    async def _ask(self, client: Elicitor, question: ParkedQuestion) -> None:
        try:
            answer = await client.ask(question.params)
        except Exception as exc:  # the client refused or went away: a denial, with the reason
            question.failure = _describe_exception(exc)
        else:
            question.answer, question.bound_to = answer, question.digest
        question.answered.set()

    def deliver(self, answers: Mapping[str, types.ElicitResult], digests: Mapping[str, str | None]) -> int:
        """A retry's answers, each to the question of its key (``digests``: what the
        retry's sealed state says each key is about); how many found their question."""
        found = 0
        for key, result in answers.items():
            question = self.waiting.get(key)
            if question is None or question.answered.is_set():
                continue  # already answered, or given up (MCP_BRIDGE_APPROVAL_TIMEOUT)
            question.answer, question.bound_to = result, digests.get(key)
            question.answered.set()
            found += 1
        return found


class ParkedQuestions:
    """UserQuestions through the execute's QuestionDesk: each question waits there for the
    run_python call that carries it to the user (see QuestionDesk)."""

    def __init__(self, desk: QuestionDesk) -> None:
        self.desk = desk

    async def approve(self, call: ProxiedCall, reason: str) -> ApprovalAnswer:
        message, schema = approval_request(call, reason)
        question = await self.desk.ask(
            types.ElicitRequestFormParams(message=message, requested_schema=schema), call.digest
        )
        if question.failure is not None or question.answer is None:
            return ApprovalAnswer(
                call.digest, None, "the request could not reach the user (%s)" % question.failure
            )
        # A retry's state names the call each key was asked about: never another's answer.
        digest = call.digest if question.bound_to == call.digest else "another call"
        return approval_answer(question.answer, digest)

    async def relay(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        said = "MCP server %r (called by code in run_python) asks: %s" % (server, params.message)
        question = await self.desk.ask(params.model_copy(update={"message": said}), None)
        if question.failure is not None or question.answer is None:
            raise ProxyError(str(question.failure))
        return question.answer


def denied_message(call: ProxiedCall, reason: str, how: str) -> str:
    """runtime.ApprovalDenied's message, for the model."""
    return (
        "mcp_%s.%s was not called: it needs the user's approval (%s), and %s. Do not retry it in this "
        "run; tell the user what the call was for, or go on without it."
        % (call.alias, python_identifier(call.tool), reason, how)
    )


class CallLog:
    """Every proxied call, one JSON line each, appended to STATE_DIR/calls.jsonl by the host
    (the sandbox cannot write it); over CALL_LOG_MAX_BYTES it moves to calls.jsonl.1.
    ``meta`` keeps no arguments or results (they may hold secrets), ``full`` keeps them
    (each cut to MAX_LOGGED_JSON characters), ``off`` keeps nothing. Bridges that share
    the state dir append to one file: each line is one O_APPEND write (whole, never
    interleaved with another's), and a rotation is done under an flock. The file stays
    open between calls (opening and locking it per call cost a tenth of a proxied call);
    one stat per line tells whether the file at the path is still this one, with room."""

    def __init__(self, config: BridgeConfig) -> None:
        self.mode = config.call_log
        self.path = config.state_dir / CALL_LOG_FILENAME
        self.failed = False  # a log that cannot be written is said once in the server log
        self._fd: int | None = None  # the file at the path when it was last looked at
        self._file: tuple[int, int] = (0, 0)  # its (st_dev, st_ino)

    def record(
        self,
        call: ProxiedCall,
        decision: str,
        started: float,
        result_bytes: int | None = None,
        error: str | None = None,
        result: object = None,
    ) -> None:
        if self.mode == "off":
            return
        full: dict[str, object] = {}
        if self.mode == "full":
            full["arguments"] = call.arguments_json[:MAX_LOGGED_JSON]
            full["result"] = None if result is None else canonical_json(result)[:MAX_LOGGED_JSON]
        self._write(
            call.principal,
            call.session_name,
            call.server,
            call.tool,
            call.digest,
            len(call.arguments_json.encode("utf-8", "surrogatepass")),
            decision,
            round((time.monotonic() - started) * 1000, 1),
            result_bytes,
            error,
            full,
        )

    def refused(self, principal: str, session: str, server: str, tool: str, size: int, error: str) -> None:
        """A call refused before it could be made (``server`` and ``tool`` as the code named
        them; ``size``: its request's bytes): the policy, an unknown tool, wrong arguments,
        the cap on calls."""
        if self.mode != "off":
            self._write(principal, session, server[:200], tool[:200], None, size, "refused", 0.0, None, error)

    def _write(
        self,
        principal: str,
        session: str,
        server: str,
        tool: str,
        digest: str | None,
        size: int,
        decision: str,
        duration_ms: float,
        result_bytes: int | None,
        error: str | None,
        full: Mapping[str, object] | None = None,
    ) -> None:
        """One line of the log: its fields in one order, whatever wrote them."""
        entry: dict[str, object] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "principal": principal,
            "session": session,
            "server": server,
            "tool": tool,
            "arguments_digest": digest,
            "arguments_bytes": size,
            "decision": decision,
            "duration_ms": duration_ms,
            "result_bytes": result_bytes,
            "error": error[:500] if error else None,
            **(full or {}),
        }
        self._append((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass"))

    def _append(self, line: bytes) -> None:
        try:
            os.write(self._room_for(len(line)), line)
        except OSError as exc:
            self.close()
            if not self.failed:
                self.failed = True
                logger.warning("the call log %s cannot be written: %s", self.path, exc)

    def _room_for(self, size: int) -> int:
        """The open log file, once it is the file at the path and ``size`` more bytes keep
        it within CALL_LOG_MAX_BYTES; else the file is opened again (another bridge moved
        it away, or it was deleted), or rotated first, under the lock."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if (
            self._fd is not None
            and now is not None
            and (now.st_dev, now.st_ino) == self._file
            and now.st_size + size <= CALL_LOG_MAX_BYTES
        ):
            return self._fd
        self.close()
        fd = self._open_locked()
        try:
            if os.fstat(fd).st_size + size > CALL_LOG_MAX_BYTES:
                os.replace(self.path, self.path.with_name(CALL_LOG_FILENAME + ".1"))
                rotated, fd = fd, -1  # closed once: its number may be another file's next
                os.close(rotated)
                fd = self._open_locked()
            fcntl.flock(fd, fcntl.LOCK_UN)
            opened = os.fstat(fd)
        except OSError:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd, self._file = fd, (opened.st_dev, opened.st_ino)
        return fd

    def _open_locked(self) -> int:
        """The log file, open for appending under an exclusive flock. Another bridge may
        have moved it to calls.jsonl.1 while this one waited for the lock: then the file
        at the path is opened again, so nothing rotates twice."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            try:
                fd = os.open(self.path, flags, 0o600)
            except FileNotFoundError:  # the state dir is made when it is missing, not per call
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            except OSError:
                os.close(fd)
                raise
            if same:
                return fd
            os.close(fd)

    def close(self) -> None:
        fd, self._fd, self._file = self._fd, None, (0, 0)
        if fd is not None:
            with suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()


def read_call_log(state_dir: Path) -> Iterator[dict[str, Any]]:
    """The call log's entries, oldest first (the rotated file's first); lines that are not
    a JSON object (a torn write) are skipped."""
    for path in (state_dir / (CALL_LOG_FILENAME + ".1"), state_dir / CALL_LOG_FILENAME):
        try:
            with path.open("rb") as lines:
                for line in lines:
                    with suppress(ValueError):
                        entry = json.loads(line)
                        if isinstance(entry, dict):
                            yield entry
        except FileNotFoundError:
            continue


# =============================================================================
# sandbox API (host)
# =============================================================================


# One input model per sandbox request method of the kernel's REQUEST_METHODS (the protocol
# is declared there; a test checks these models have its methods and parameters): the
# validation and the error text the sandbox code sees come from it. Strict: the sandbox
# must send the right JSON types.
class _SandboxParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_ServerName = Field(min_length=1, max_length=200)


class DiscoveredServersParams(_SandboxParams):
    detailed: bool = False


class ListToolsParams(_SandboxParams):
    server: str = _ServerName


class QueryToolDocsParams(_SandboxParams):
    server: str = _ServerName
    tool: str | None = Field(default=None, min_length=1, max_length=1000)
    detail: Literal["summary", "full"] = "summary"


class SearchToolDocsParams(_SandboxParams):
    query: str = Field(max_length=MAX_SEARCH_QUERY_CHARS)
    limit: int = Field(default=5, ge=1, le=MAX_SEARCH_LIMIT)
    detail: Literal["line", "summary", "full"] = "line"


class CallToolParams(_SandboxParams):
    server: str = _ServerName
    tool: str = Field(min_length=1, max_length=1000)
    arguments: dict[str, Any] | None = None


class ServerParams(_SandboxParams):
    server: str = _ServerName


class ReadResourceParams(_SandboxParams):
    server: str = _ServerName
    uri: str = Field(min_length=1, max_length=8192)


class GetPromptParams(_SandboxParams):
    server: str = _ServerName
    name: str = Field(min_length=1, max_length=1000)
    arguments: dict[str, str] | None = None


class CapabilitySummaryParams(_SandboxParams):
    pass


_MemoryKey = Field(min_length=1, max_length=MAX_MEMORY_KEY_CHARS)


class MemoryKeyParams(_SandboxParams):
    key: str = _MemoryKey


class MemorySaveParams(_SandboxParams):
    key: str = _MemoryKey
    value: Any = None
    metadata: dict[str, Any] | None = None


class MemoryPutIfParams(_SandboxParams):
    key: str = _MemoryKey
    value: Any = None
    generation: int = Field(ge=0)  # as memory_load answered it (MemoryStore.put_if)


class MemoryListParams(_SandboxParams):
    pass


class MemoryPageParams(_SandboxParams):
    after: str | None = Field(default=None, max_length=MAX_MEMORY_KEY_CHARS)
    limit: int = Field(default=MEMORY_PAGE_ENTRIES, ge=1, le=MEMORY_PAGE_ENTRIES)


class ProgressParams(_SandboxParams):
    done: float = Field(ge=0, allow_inf_nan=False)
    total: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    message: str | None = Field(default=None, max_length=1000)


class ToolSaveParams(_SandboxParams):
    name: str = Field(min_length=1, max_length=100)
    source: str = Field(max_length=SavedTools.MAX_SOURCE_BYTES)


class ToolNameParams(_SandboxParams):
    name: str = Field(min_length=1, max_length=100)


MAX_ARGUMENT_DEPTH = 100
# The MCP SDK serializes a call's arguments on the event loop, at up to a microsecond per
# value (lists and objects cost most): this many values hold it for a tenth of a second at
# worst. Bulk data of one string (file contents) counts as one value.
MAX_ARGUMENT_VALUES = 250_000


def check_tool_arguments(arguments: Mapping[str, object]) -> None:
    """ProxyError for arguments a server connection would choke on: strings with lone
    surrogates (e.g. a file name that is not UTF-8; the transport's encoder would fail
    and drop the connection), nesting deeper than MAX_ARGUMENT_DEPTH and more than
    MAX_ARGUMENT_VALUES values. CPU-bound on large arguments: call it in a worker thread."""
    stack: list[tuple[object, int]] = [(arguments, 0)]
    count = 1
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            count += len(value) * (2 if isinstance(value, dict) else 1)  # before the walk grows
            if count > MAX_ARGUMENT_VALUES:
                raise ProxyError(
                    "Tool arguments hold more than %d values (numbers, strings, keys, lists and objects each "
                    "count once). Split the data over several calls, or pass it as one string where the "
                    "tool accepts text." % MAX_ARGUMENT_VALUES
                )
        if depth > MAX_ARGUMENT_DEPTH:
            raise ProxyError("Tool arguments are nested deeper than %d levels." % MAX_ARGUMENT_DEPTH)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ProxyError(
                    "A tool argument holds text that is not valid Unicode (a lone surrogate, typically "
                    "from a file name that is not UTF-8): %s. Clean it first, e.g. "
                    "text.encode('utf-8', 'replace').decode()." % ascii(value[:40])
                ) from None
        elif isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def describe_params_error(method: str, exc: ValidationError) -> str:
    problems = "; ".join(
        "%s: %s" % (".".join(str(part) for part in error["loc"]) or "arguments", error["msg"])
        for error in exc.errors(include_url=False, include_input=False)[:5]
    )
    return "Bad arguments for runtime.%s: %s." % (method, problems)


_Params = TypeVar("_Params", bound=_SandboxParams)


def parse_params(method: str, model: type[_Params], params: Mapping[str, object]) -> _Params:
    """``params`` of a ``method`` request as its ``model``; ProxyError says what is wrong."""
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        raise ProxyError(describe_params_error(method, exc)) from None


MAX_CONFIG_PROBLEMS = 20  # unusable config files named to the kernel (a line each)


class SandboxAPI:
    """Serves the sandbox's ``request`` frames: discovery, docs, search and tool calls.
    Every request is validated here, on the host: only configured, allowed servers and
    tools are reachable, and results are size-capped before they cross the channel."""

    def __init__(
        self,
        pool: ClientPool,
        config: BridgeConfig,
        store_dir: Path | None = None,
        principal: str = "local",
        call_log: CallLog | None = None,
    ) -> None:
        """``store_dir``: where memory and saved tools live (STATE_DIR/user_tools unless an
        HTTP principal has its own); ``principal``: whose sandboxes it serves, as the call
        log names it; ``call_log``: the bridge's one (all principals write to it)."""
        self.pool = pool
        self.config = config
        self.principal = principal
        self.call_log = call_log or CallLog(config)
        self.tool_pattern_problems: list[str] = []  # found as servers list their tools
        self.announced_tools: tuple[str, ...] | None = None  # see defined_tools_notice()
        store_dir = store_dir or config.state_dir / MEMORY_DIRNAME
        self.saved_tools = SavedTools(store_dir)
        self.memory = MemoryStore(
            store_dir, config.max_memory_bytes, config.max_memory_total_bytes, config.max_memories
        )
        # SQLite is blocking: one worker thread at a time per bridge (other bridges share
        # the file through SQLite's own locking).
        self._memory_limiter = anyio.CapacityLimiter(1)
        # One search ranks at a time, in a worker thread: it is CPU-bound and must not
        # stall the event loop (which also answers the MCP client's pings).
        self._search_limiter = anyio.CapacityLimiter(1)
        # Other CPU-bound work on what the sandbox or a server sent (walking a call's
        # arguments, measuring its result: megabytes each) also runs in worker threads.
        self._cpu_limiter = anyio.CapacityLimiter(2)
        # alias -> the permitted tools as calls look them up (ToolTable); one per server.
        self._tool_tables: dict[str, ToolTable] = {}
        # alias -> (the tool list it was built from, its search index); one per server.
        self._search_index: dict[str, tuple[list[types.Tool], list[IndexedTool]]] = {}
        # The catalogue last searched: each server's entries (in alias order), and their index.
        self._search_catalogue: tuple[tuple[list[IndexedTool], ...], ToolIndex] | None = None

    def server_list(self) -> list[dict[str, str]]:
        """What the kernel needs at start-up to create the ``mcp_<alias>`` objects."""
        return [
            {"alias": alias, "name": client.spec.name} for alias, client in sorted(self.pool.clients.items())
        ]

    def config_problems(self) -> list[str]:
        """The config files that could not be used, for the kernel to name where servers go
        missing (runtime.discovered_servers(), the error for an unknown mcp_<alias>)."""
        return list(self.pool.discovery.unusable[:MAX_CONFIG_PROBLEMS])

    async def handle(self, method: str, params: Mapping[str, object], run: RunContext | None) -> object:
        """Serve one request of any of the sandboxes this SandboxAPI serves (see HOST_METHODS);
        ``run``: the run_python call the asking sandbox runs, which a proxied call is part of."""
        entry = HOST_METHODS.get(method)
        if entry is None:
            raise ProxyError(
                "Unknown sandbox request %r; the host serves %s."
                % (method[:100], ", ".join(mcp_sandbox_kernel.REQUEST_METHODS))
            )
        arguments = dict(parse_params(method, entry.params, params))
        if entry.proxied and run is None:  # the supervisor refuses requests between calls: defense in depth
            raise ProxyError("refused: no run_python call is running")
        serve = (
            partial(entry.handler, self, run, **arguments)
            if entry.proxied
            else partial(entry.handler, self, **arguments)
        )
        try:
            try:
                return await serve()
            except PersonalLoginError:  # now the principal's own connection's (ClientPool)
                return await serve()
        except LoginRequiredError as exc:
            # A client that can show a link gets it now, and the request goes on after the
            # login; others (and a user who declines) get the link in the error.
            if run is None or not isinstance(exc.login, ServerLogin) or not await exc.login.through(run):
                raise
            return await serve()

    async def discovered_servers(self, detailed: bool = False) -> object:
        if not detailed:
            return sorted(self.pool.clients)
        servers = [
            {
                "alias": alias,
                "name": client.spec.name,
                "transport": client.spec.transport,
                "source": client.spec.source,
                "running": client.running,
                "tools": len(client.tools) if client.ran else None,
                # Why it is not running: it could not be started, crashed or was stopped.
                "failure": None if client.running else client.failure,
            }
            for alias, client in sorted(self.pool.clients.items())
        ]
        return {"servers": servers, "problems": [*self.pool.discovery.problems, *self.tool_pattern_problems]}

    async def _allowed_tools(self, client: PooledClient) -> list[types.Tool]:
        return (await self._tool_table(client)).tools

    async def _tool_table(self, client: PooledClient) -> ToolTable:
        tools = await client.list_tools()
        table = self._tool_tables.get(client.spec.alias)
        if table is None or table.listed is not tools:
            self._check_tool_patterns()
            table = ToolTable.of(tools, self._permitted(client, tools))
            self._tool_tables[client.spec.alias] = table
        return table

    def _check_tool_patterns(self) -> None:
        """A tool pattern that matches nothing is reported once its servers have listed tools."""
        config = self.config
        if not (
            config.allow_tools
            or config.deny_tools
            or config.approve_tools
            or config.allow_tools_without_asking
        ):
            return
        listed = {
            client.spec.name: [tool.name for tool in client.tools]
            for client in self.pool.clients.values()
            if client.starts
        }
        names = [client.spec.name for client in self.pool.clients.values()]
        for problem in tool_pattern_problems(self.config, listed, names):
            if problem not in self.tool_pattern_problems:
                logger.warning("MCP server configuration: %s", problem)
                self.tool_pattern_problems.append(problem)

    def _permitted(self, client: PooledClient, tools: list[types.Tool]) -> list[types.Tool]:
        return [tool for tool in tools if tool_allowed(client.spec.name, tool.name, self.config)]

    async def _find_tool(self, client: PooledClient, name: str) -> TableTool:
        """The tool the code calls ``name``; ProxyError naming the nearest."""
        table = await self._tool_table(client)
        found = table.by_name.get(name)
        if found is not None:
            return found
        tools = table.tools
        # A denied tool gets the same answer as a missing one: the sandbox does not learn
        # what the policy hides.
        # The nearest three by meaning (create_pr: create_pull_request) and by name (a typo),
        # each with its signature, so the model fixes the call in the same run; ranked in
        # the search's worker thread over the server's index (a miss costs the loop nothing).
        alias = client.spec.alias
        docs = {python_identifier(tool.name): _tool_dict(tool) for tool in tools}
        close = difflib.get_close_matches(name, list(docs), n=3, cutoff=0.5)
        entries = await self._indexed_tools(client)
        hits = await anyio.to_thread.run_sync(
            rank_entries, name, entries, 3, limiter=self._search_limiter, abandon_on_cancel=True
        )
        meant = [python_identifier(_text(doc.get("name"))) for _, _, doc in hits]
        nearest = [near for near in dict.fromkeys([*meant[:2], *close, *meant]) if near in docs][:3]
        hint = " The nearest: %s." % "; ".join(render_tool_line(alias, docs[near]) for near in nearest)
        raise ProxyError(
            "MCP server %r has no tool %r.%s Its tools: %s."
            % (alias, name, hint if nearest else "", ", ".join(docs))
        )

    async def list_tools(self, server: str) -> list[dict[str, str]]:
        client = self.pool.client(server)
        return [
            {
                "name": python_identifier(tool.name),
                "tool": tool.name,
                "description": _summary_line(tool.description),
            }
            for tool in await self._allowed_tools(client)
        ]

    async def query_tool_docs(
        self, server: str, tool: str | None = None, detail: Literal["summary", "full"] = "summary"
    ) -> object:
        client = self.pool.client(server)  # detail was checked by QueryToolDocsParams
        if tool:
            return render_tool_doc(client.spec.alias, (await self._find_tool(client, tool)).doc, detail)
        table = await self._tool_table(client)
        return [render_tool_doc(client.spec.alias, doc, detail) for doc in table.docs]

    async def search_tool_docs(
        self, query: str, limit: int = 5, detail: Literal["line", "summary", "full"] = "line"
    ) -> dict[str, object]:
        """{"hits": one line per hit (render_tool_line), or docs with their score and line
        ("summary", "full"), best first; "notice": where no tool matches the query well,
        what to do instead (the kernel prints it to the code's stderr, where it asked), else
        None}. Every configured server is searched: one this bridge has not started is
        searched by its cached tool list (ToolListCache) or else started here (concurrently);
        a server that fails is left out of the ranking, and the call's notices say which and
        why."""
        catalogue: dict[str, list[IndexedTool]] = {}
        skipped: list[tuple[str, str]] = []

        async def collect(client: PooledClient) -> None:
            try:
                catalogue[client.spec.alias] = await self._indexed_tools(client)
            except BridgeError as exc:
                logger.info("search skipped %s: %s", client.spec.alias, exc)
                skipped.append((client.spec.alias, str(exc)))

        async with anyio.create_task_group() as group:
            for client in self.pool.clients.values():
                group.start_soon(collect, client)
        for alias, reason in sorted(skipped):
            self.pool.client(alias).notices.append(
                "runtime.search_tool_docs(...) left out the tools of MCP server %r: %s" % (alias, reason)
            )
        servers = tuple(catalogue[alias] for alias in sorted(catalogue))
        ranked, weak = await anyio.to_thread.run_sync(
            self._ranked, query, servers, limit, limiter=self._search_limiter, abandon_on_cancel=True
        )
        if detail == "line":
            return {"hits": [render_tool_line(alias, tool) for _, alias, tool in ranked], "notice": weak}
        # "line" too: the kernel shows each hit dict as that one line (SearchHit).
        hits = [
            dict(
                render_tool_doc(alias, tool, detail),
                score=round(score, 3),
                line=render_tool_line(alias, tool),
            )
            for score, alias, tool in ranked
        ]
        return {"hits": hits, "notice": weak}

    def _ranked(
        self, query: str, servers: tuple[list[IndexedTool], ...], limit: int
    ) -> tuple[list[tuple[float, str, Mapping[str, Any]]], str | None]:
        """rank_tools over the servers' entries (_indexed_tools), indexed together once for
        as long as each server's entries stay the same objects; and, where no tool matches
        the query well (query_coverage), a notice that says so and where to look instead."""
        kept = self._search_catalogue
        same = kept is not None and len(kept[0]) == len(servers)
        if kept is None or not same or any(a is not b for a, b in zip(kept[0], servers, strict=True)):
            kept = (servers, ToolIndex(entry for entries in servers for entry in entries))
            self._search_catalogue = kept
        index = kept[1]
        matches = match_query(query, index)  # once: the ranking and the coverage read it
        ranked = rank_matches(matches, index, max(limit, WEAK_SEARCH_SERVERS_FROM))
        if ranked and query_coverage(matches, index, ranked[0][2]) >= GOOD_MATCH:
            return ranked[:limit], None
        likeliest = list(dict.fromkeys(alias for _, alias, _ in ranked))[:3]
        known = likeliest or sorted({entry.alias for entry in index.tools})[:3]
        where = (
            " The likeliest servers: %s; see all of one's tools with runtime.query_tool_docs(%r)."
            % (", ".join(likeliest), likeliest[0])
            if likeliest
            else " See a server's tools with runtime.query_tool_docs(name)%s."
            % (": %s" % ", ".join(known) if known else "")
        )
        what = "matches these words well" if ranked else "matches any of these words"
        return ranked[:limit], "runtime.search_tool_docs(%r): no tool %s.%s" % (query, what, where)

    async def _indexed_tools(self, client: PooledClient) -> list[IndexedTool]:
        """The server's allowed tools, tokenized once per tool list (not per search), with
        what the server said about itself at initialize (a restart brings a new tool list).
        A server this bridge has not started is searched by its cached list when there is
        one (PooledClient.cached_tools): a search starts only the servers without one."""
        listed = await client.cached_tools()
        info: types.Implementation | None = None
        instructions: str | None = None
        if listed is not None:
            tools, info, instructions = listed.tools, listed.server_info, listed.instructions
        else:
            tools, init = await client.list_tools(), client.initialized
            if init is not None:
                info, instructions = init.server_info, init.instructions
        cached = self._search_index.get(client.spec.alias)
        if cached is None or cached[0] is not tools:
            allowed = self._permitted(client, tools)
            alias = client.spec.alias
            names: list[str | None] = [alias, client.spec.name]
            about: list[str | None] = []
            if info is not None:
                names += [info.name, info.title]
                about += [info.description, instructions]
            server = server_tokens(names, "\n".join(text for text in about if text))
            cached = (tools, index_tools(((alias, _tool_dict(tool)) for tool in allowed), {alias: server}))
            self._search_index[client.spec.alias] = cached
        return cached[1]

    async def call_tool(
        self, run: RunContext, server: str, tool: str, arguments: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A proxied tool call: counted, asked about where the policy says so (the call waits
        for the user), made, and logged, whatever became of it (a call refused before it
        could be made too: the policy, an unknown tool, wrong arguments, the cap)."""
        try:
            run.count_call("mcp_%s.%s(...)" % (server, tool))
            small = run.request_bytes <= ON_LOOP_BYTES
            await self._maybe_off_loop(small, check_tool_arguments, arguments or {})
            client = self.pool.client(server)
            entry = await self._find_tool(client, tool)
            found, spec = entry.tool, client.spec
            call = await self._maybe_off_loop(
                small, self._call_of, run.session_name, spec, entry, arguments or {}
            )
        except BridgeError as exc:
            self.call_log.refused(self.principal, run.session_name, server, tool, run.request_bytes, str(exc))
            raise
        renamed = dict(call.arguments)
        reason = approval_reason(spec.name, found.name, _read_only(found), self.config)
        return await self._logged(
            call, run, reason, client, lambda: client.call_tool(found.name, renamed, run)
        )

    # --- what else a server offers: resources and prompts, proxied like tool calls -------
    # Their policy names are the MCP methods (server.resources/read, ...): tool patterns
    # match them (a deny list "github.*" hides these too); being reads, they ask the user
    # only under MCP_BRIDGE_APPROVE=all or MCP_BRIDGE_APPROVE_TOOLS.
    async def list_resources(self, run: RunContext, server: str) -> dict[str, Any]:
        return await self._proxied(run, server, "resources/list", {}, list_all_resources, "resources")

    async def read_resource(self, run: RunContext, server: str, uri: str) -> dict[str, Any]:
        async def send(session: ClientSession) -> BaseModel:
            return await session.read_resource(uri)

        return await self._proxied(run, server, "resources/read", {"uri": uri}, send, "resources")

    async def list_prompts(self, run: RunContext, server: str) -> dict[str, Any]:
        return await self._proxied(run, server, "prompts/list", {}, list_all_prompts, "prompts")

    async def get_prompt(
        self, run: RunContext, server: str, name: str, arguments: dict[str, str] | None = None
    ) -> dict[str, Any]:
        async def send(session: ClientSession) -> BaseModel:
            return await session.get_prompt(name, arguments)

        call_arguments = {"name": name, "arguments": arguments}
        return await self._proxied(run, server, "prompts/get", call_arguments, send, "prompts")

    async def _proxied(
        self,
        run: RunContext,
        server: str,
        method: str,
        arguments: dict[str, Any],
        send: Callable[[ClientSession], Awaitable[BaseModel | dict[str, Any]]],
        capability: Literal["resources", "prompts"],
    ) -> dict[str, Any]:
        run.count_call("runtime.%s(%r)" % (method.replace("/", "_").replace("s_", "_"), server))
        client = self.pool.client(server)
        spec = client.spec
        if not tool_allowed(spec.name, method, self.config):
            raise ProxyError(
                "MCP server %r: %s is not allowed here (MCP_BRIDGE_ALLOW_TOOLS / MCP_BRIDGE_DENY_TOOLS)."
                % (spec.alias, method)
            )
        await client.ensure_running()
        if client.initialized is not None and getattr(client.initialized.capabilities, capability) is None:
            raise ProxyError(
                "MCP server %r offers no %s (its initialize declared none)." % (spec.alias, capability)
            )
        call = proxied_call(self.principal, run.session_name, spec, method, arguments)
        reason = approval_reason(spec.name, method, True, self.config)
        return await self._logged(call, run, reason, client, lambda: client.request(method, send, run))

    def _call_of(
        self, session_name: str, spec: ServerSpec, entry: TableTool, arguments: Mapping[str, object]
    ) -> ProxiedCall:
        """The call as the server will receive it: the signature shows Python names
        (user_id), the server knows its own (user-id). ProxyError for a call that names
        a parameter the tool does not have, or lacks a required one."""
        problem = argument_problems(spec.alias, entry.doc, arguments, entry.names)
        if problem is not None:
            raise ProxyError(problem)
        renamed = schema_arguments(entry.tool.input_schema, arguments, entry.names)
        return proxied_call(self.principal, session_name, spec, entry.tool.name, renamed)

    async def _logged(
        self,
        call: ProxiedCall,
        run: RunContext,
        reason: str | None,
        client: PooledClient,
        send: Callable[[], Awaitable[BaseModel | dict[str, Any]]],
    ) -> dict[str, Any]:
        """``send()`` to ``client`` once the user approved ``call`` (where ``reason`` says to
        ask), its result as JSON data within the result cap; the call log hears how it went."""
        started, decision, size, payload = time.monotonic(), "not asked", None, None
        error: str | None = "cancelled: the run_python call ended"
        try:
            if reason is not None:
                decision = "cancelled while asking the user"
                decision = await run.approve(call, reason)  # ApprovalDeniedError: not sent
            mark = client.wire.mark()
            result = await send()
            payload, size = await self._maybe_off_loop(client.wire.small_since(mark), result_payload, result)
            if size > self.config.max_tool_result_bytes:
                raise ProxyError(
                    "The result of mcp_%s.%s is %d bytes, over the %d-byte cap "
                    "(MCP_BRIDGE_MAX_TOOL_RESULT_BYTES). Ask for less (a filter, a page, a limit)."
                    % (call.alias, call.tool, size, self.config.max_tool_result_bytes)
                )
            error = "the tool reported an error" if payload.get("isError") else None
            return payload
        except ApprovalDeniedError as exc:
            decision, error = "denied", str(exc)
            raise
        except BridgeError as exc:
            error = str(exc)
            raise
        except Exception as exc:  # a bug of ours: the call still has its line
            error = "internal error: %s" % _describe_exception(exc)
            raise
        finally:
            # Written once the answer is on its way into the sandbox: the line costs a tenth
            # of a proxied call, which need not wait for it.
            at_next_pass(self.call_log.record, call, decision, started, size, error, payload)

    async def _off_loop(self, function: Callable[[*_Args], _Result], *args: *_Args) -> _Result:
        """``function(*args)`` in a worker thread: it walks data of up to the request or
        result cap, which would hold the event loop for a second or more."""
        return await anyio.to_thread.run_sync(function, *args, limiter=self._cpu_limiter)

    async def _maybe_off_loop(
        self, small: bool, function: Callable[[*_Args], _Result], *args: *_Args
    ) -> _Result:
        """``function(*args)`` here when its data is ``small`` (a hop to a worker thread
        costs about 0.1 ms, more than walking ON_LOOP_BYTES), else in a worker thread."""
        return function(*args) if small else await self._off_loop(function, *args)

    # --- memory: the store's methods, off the event loop ---------------------------------
    async def _in_store(self, method: Callable[[*_Args], _Result], *args: *_Args) -> _Result:
        return await anyio.to_thread.run_sync(method, *args, limiter=self._memory_limiter)

    async def memory_save(
        self, key: str, value: object = None, metadata: Mapping[str, object] | None = None
    ) -> object:
        return await self._in_store(self.memory.save, key, value, metadata)

    async def memory_load(self, key: str) -> object:
        return await self._in_store(self.memory.load, key)

    async def memory_put_if(self, key: str, value: object, generation: int) -> object:
        return await self._in_store(self.memory.put_if, key, value, generation)

    async def memory_delete(self, key: str) -> object:
        return await self._in_store(self.memory.delete, key)

    async def memory_info(self, key: str) -> object:
        return await self._in_store(self.memory.info, key)

    async def memory_list(self, after: str | None = None, limit: int = MEMORY_PAGE_ENTRIES) -> object:
        return await self._in_store(self.memory.page, after, limit)

    async def tool_save(self, name: str, source: str) -> object:
        return await self._in_store(self.saved_tools.save, name, source)

    async def tool_list(self) -> object:
        return await self._in_store(self.saved_tools.entries)

    async def tool_delete(self, name: str) -> object:
        return await self._in_store(self.saved_tools.delete, name)

    async def tool_sources(self) -> object:
        return await self._in_store(self.saved_tools.sources)

    def defined_tools_notice(self, names: Sequence[str]) -> str | None:
        """The notice naming the saved tools a fresh session defined: once per change of
        their names (this caller's sessions share them; the manual says that every fresh
        session defines them), not in every fresh session."""
        defined = tuple(sorted(names))
        if defined == self.announced_tools:
            return None
        self.announced_tools = defined
        return "Saved tools defined in this fresh session: %s." % ", ".join(names) if names else None

    async def quarantine_tools(self, failed: Sequence[mcp_sandbox_kernel.FailedTool]) -> list[str]:
        """Keep the saved tools whose definition killed or hung a sandbox's Python process
        (as its supervisor reports: names and digests the sandbox sent, so only checked
        against the files) out of new sessions until they change; a notice for each."""
        notices = []
        for tool in failed:
            name, reason = tool["name"], tool["reason"]
            try:
                path = await self._in_store(self.saved_tools.quarantine, name, tool["digest"], reason)
            except MemoryStoreError:
                path = None  # not a tool name at all
            if path is not None:
                logger.warning("saved tool %s is quarantined: defining it %s", path, reason)
                notices.append(quarantine_notice(name, path, reason))
            else:
                notices.append("Saved tool %s was skipped: defining it %s." % (name, reason))
        return notices

    async def capability_summary(self) -> str:
        lines = ["MCP servers available in this sandbox (none is started until used):"]
        for alias, client in sorted(self.pool.clients.items()):
            lines.append("- mcp_%s  (%s, %s)" % (alias, client.spec.name, client.spec.transport))
        if not self.pool.clients:
            lines.append("- (none configured)")
        lines += [
            "Find tools: runtime.search_tool_docs('what you need in plain words') gives the best "
            "tools, each shown as one line, mcp_<alias>.<tool>(signature)  # summary; "
            "runtime.query_tool_docs('<alias>') lists a server's signatures.",
            "Call: mcp_<alias>.<tool>(name=value) returns the value; calls inside await or "
            "asyncio.gather(...) run at the same time; failures raise runtime.MCPToolError.",
        ]
        if self.pool.discovery.untrusted:
            lines.append(
                "Found in the project's config but not trusted, so not started: %s."
                % ", ".join(self.pool.discovery.untrusted)
            )
        if self.pool.discovery.problems:
            lines.append(
                "%d configuration problem(s): see runtime.discovered_servers(detailed=True)."
                % len(self.pool.discovery.problems)
            )
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class HostMethod:
    """A request method the host API serves: its name (one of the kernel's REQUEST_METHODS),
    the model of its params, and the SandboxAPI method that answers, called with them by name
    (``proxied``: a request to a proxied server, also given the RunContext it is part of)."""

    name: str
    params: type[_SandboxParams]
    handler: Callable[..., Awaitable[object]]
    proxied: bool = False


# What SandboxAPI.handle serves: every request method but PROGRESS (see report_progress).
HOST_METHODS: dict[str, HostMethod] = {
    method.name: method
    for method in (
        HostMethod(
            mcp_sandbox_kernel.DISCOVERED_SERVERS, DiscoveredServersParams, SandboxAPI.discovered_servers
        ),
        HostMethod(mcp_sandbox_kernel.LIST_TOOLS, ListToolsParams, SandboxAPI.list_tools),
        HostMethod(mcp_sandbox_kernel.QUERY_TOOL_DOCS, QueryToolDocsParams, SandboxAPI.query_tool_docs),
        HostMethod(mcp_sandbox_kernel.SEARCH_TOOL_DOCS, SearchToolDocsParams, SandboxAPI.search_tool_docs),
        HostMethod(mcp_sandbox_kernel.CALL_TOOL, CallToolParams, SandboxAPI.call_tool, proxied=True),
        HostMethod(mcp_sandbox_kernel.LIST_RESOURCES, ServerParams, SandboxAPI.list_resources, proxied=True),
        HostMethod(
            mcp_sandbox_kernel.READ_RESOURCE, ReadResourceParams, SandboxAPI.read_resource, proxied=True
        ),
        HostMethod(mcp_sandbox_kernel.LIST_PROMPTS, ServerParams, SandboxAPI.list_prompts, proxied=True),
        HostMethod(mcp_sandbox_kernel.GET_PROMPT, GetPromptParams, SandboxAPI.get_prompt, proxied=True),
        HostMethod(
            mcp_sandbox_kernel.CAPABILITY_SUMMARY, CapabilitySummaryParams, SandboxAPI.capability_summary
        ),
        HostMethod(mcp_sandbox_kernel.MEMORY_SAVE, MemorySaveParams, SandboxAPI.memory_save),
        HostMethod(mcp_sandbox_kernel.MEMORY_LOAD, MemoryKeyParams, SandboxAPI.memory_load),
        HostMethod(mcp_sandbox_kernel.MEMORY_PUT_IF, MemoryPutIfParams, SandboxAPI.memory_put_if),
        HostMethod(mcp_sandbox_kernel.MEMORY_DELETE, MemoryKeyParams, SandboxAPI.memory_delete),
        HostMethod(mcp_sandbox_kernel.MEMORY_INFO, MemoryKeyParams, SandboxAPI.memory_info),
        HostMethod(mcp_sandbox_kernel.MEMORY_LIST, MemoryPageParams, SandboxAPI.memory_list),
        HostMethod(mcp_sandbox_kernel.TOOL_SAVE, ToolSaveParams, SandboxAPI.tool_save),
        HostMethod(mcp_sandbox_kernel.TOOL_LIST, MemoryListParams, SandboxAPI.tool_list),
        HostMethod(mcp_sandbox_kernel.TOOL_DELETE, ToolNameParams, SandboxAPI.tool_delete),
        HostMethod(mcp_sandbox_kernel.TOOL_SOURCES, MemoryListParams, SandboxAPI.tool_sources),
    )
}


def result_payload(result: BaseModel | dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A proxied server's answer (a tool's result, a resource...) as JSON data, and its size in bytes."""
    payload = (
        result
        if isinstance(result, dict)
        else result.model_dump(by_alias=True, exclude_none=True, mode="json")
    )
    # surrogatepass: a server may send lone surrogates; they are measured, not fatal.
    return payload, len(json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _tool_dict(tool: types.Tool) -> dict[str, Any]:
    return tool.model_dump(by_alias=True, exclude_none=True, mode="json")


class TableTool(NamedTuple):
    tool: types.Tool
    doc: dict[str, Any]  # its dict, which the signature checks read
    names: dict[str, str]  # parameter_names() of its input schema


@dataclass(frozen=True)
class ToolTable:
    """A server's permitted tools as calls look them up, built once per tool list (the
    ``listed`` object, identical while the list stays): in order with their dicts, and
    each by its name and by its Python name, with its parameters' Python names."""

    listed: list[types.Tool]
    tools: list[types.Tool]
    docs: list[dict[str, Any]]
    by_name: dict[str, TableTool]

    @classmethod
    def of(cls, listed: list[types.Tool], permitted: list[types.Tool]) -> ToolTable:
        docs = [_tool_dict(tool) for tool in permitted]
        entries = [
            TableTool(tool, doc, parameter_names(tool.input_schema))
            for tool, doc in zip(permitted, docs, strict=True)
        ]
        by_name: dict[str, TableTool] = {}
        for entry in entries:  # a name first, then the Python names; the first tool wins
            by_name.setdefault(entry.tool.name, entry)
        for entry in entries:
            by_name.setdefault(python_identifier(entry.tool.name), entry)
        return cls(listed, permitted, docs, by_name)


# =============================================================================
# sandbox session
# =============================================================================

SIGKILL_EXIT = 128 + signal.SIGKILL
# How long after its socket closed the kernel's container has to end before it is removed.
SOCKET_CLOSED_GRACE = 5.0
# How long after the grace period the supervisor has to kill the code and start a fresh
# executor before the bridge gives up on it and removes the container.
SUPERVISOR_MARGIN = 5.0


@dataclass
class OutputCut:
    """Characters cut from the middle of a part of a result, the text after them, and the
    file in the sandbox that holds the whole part (streams only)."""

    count: int = 0
    tail: str = ""
    file: str | None = None


@dataclass
class ExecutionOutcome:
    """What one run_python call produced; rendered once at the tool boundary."""

    status: Literal["ok", "error", "timeout", "crashed", "running"]
    stdout: str = ""
    stderr: str = ""
    value: str | None = None  # the repr of the final value
    value_json: object = None  # the final value as JSON data, when it is plain JSON
    error: ErrorInfo | None = None
    # What was cut from the middle of stdout, stderr or the value (rendering fits the rest
    # into the output budget): the count, the text after the cut, the file holding it all.
    cuts: dict[str, OutputCut] = field(default_factory=dict)
    state_kept: bool = True
    detail: str | None = None  # the status line: what happened to the run and the session
    notices: list[str] = field(default_factory=list)
    duration: float = 0.0
    images: list[tuple[str, str]] = field(default_factory=list)  # (mime type, base64 data)
    attachments: list[types.EmbeddedResource] = field(default_factory=list)  # runtime.attach()
    # The end of the code an earlier call left running, when this call waited for it.
    earlier: ExecutionOutcome | None = None
    session: str = DEFAULT_SESSION  # run_python's session that ran it
    # Of code still running: its execute and the questions for a 2026-07-28 client, which
    # the call then carries as input_required instead of this outcome (see on_call_tool).
    questions: tuple[str, tuple[ParkedQuestion, ...]] | None = None
    # Of code that went on as an MCP task: the task, which the call returns instead.
    task: McpTask | None = None


# How a call reports progress to its client (MCP notifications/progress): value, total, message.
ProgressReport = Callable[[float, float | None, str | None], Awaitable[None]]
# How a call passes a proxied server's log message (server name, the message) to its client.
ServerLog = Callable[[str, "types.LoggingMessageNotificationParams"], Awaitable[None]]
PROGRESS_INTERVAL = 2.0  # seconds between notifications while code runs
MIN_PROGRESS_GAP = 0.25  # code that reports faster is thinned out
TICK_STEP = 0.001  # the ticker's progress value per notification (see CallProgress.tick)
MAX_PROGRESS_MESSAGE_CHARS = 200


class CallProgress:
    """Progress notifications for one run_python call whose client sent a progress token:
    every PROGRESS_INTERVAL seconds the latest line of output (or the seconds so far), until
    the code reports its own with runtime.progress(done, total, message). Values always
    increase (the protocol requires it); at most one notification per MIN_PROGRESS_GAP."""

    def __init__(self, report: ProgressReport) -> None:
        self.report = report
        self.latest_line = ""
        self.code_reports = False
        self._value = 0.0
        self._sent_at = 0.0

    def saw_output(self, text: str) -> None:
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            self.latest_line = lines[-1]

    async def tick(self, elapsed: float) -> None:
        # The ticker's values only creep up (TICK_STEP each), so the code's own numbers,
        # whenever it starts to report, are still above them: the protocol wants growth.
        if not self.code_reports:
            message = self.latest_line or "running for %ds" % elapsed
            await self._send(round(self._value + TICK_STEP, 6), None, message)

    async def from_code(self, done: float, total: float | None, message: str | None) -> None:
        self.code_reports = True
        await self._send(done, total, message)

    async def relay(self, server: str, done: float, total: float | None, message: str | None) -> None:
        """A proxied server's progress on a call the code made: its words (or its numbers)
        with the server's name, at the next value of this call's own scale."""
        said = message or ("%g of %g" % (done, total) if total else "%g" % done)
        await self._send(round(self._value + TICK_STEP, 6), None, "%s: %s" % (server, said))

    async def _send(self, value: float, total: float | None, message: str | None) -> None:
        now = time.monotonic()
        if value <= self._value or now - self._sent_at < MIN_PROGRESS_GAP:
            return
        self._value, self._sent_at = value, now
        if message is not None:
            message = clean_text(message)[:MAX_PROGRESS_MESSAGE_CHARS]
        with suppress(Exception):  # a client that went away must not fail the call
            await self.report(value, total, message)


def checked_images(images: Sequence[Image], config: BridgeConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """The kernel caps images already; the host checks again (the frame came from the
    sandbox): a known image type, valid base64, within both caps. (mime type, base64)
    each, and a notice for each one dropped."""
    kept: list[tuple[str, str]] = []
    notices: list[str] = []
    for number, image in enumerate(images, 1):
        data = image["data"]
        try:
            size = len(base64.b64decode(data, validate=True))
        except ValueError:
            size = -1
        if image["mime_type"] not in IMAGE_TYPES or not 0 <= size <= config.max_image_bytes:
            notices.append("Image %d was dropped: not a valid image within the caps." % number)
        elif len(kept) >= config.max_images:
            notices.append("Image %d was dropped: at most %d images per call." % (number, config.max_images))
        else:
            kept.append((image["mime_type"], data))
    return kept, notices


def _strict_utf8(*texts: str) -> bool:
    """Whether every text is valid Unicode (no lone surrogates: JSON cannot carry them)."""
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def checked_attachments(
    files: Sequence[Attachment], config: BridgeConfig
) -> tuple[list[types.EmbeddedResource], list[str]]:
    """Files from runtime.attach() as embedded resources, checked again on the host: a
    file:// URI, valid base64, within the size cap, at most MAX_ATTACHMENTS; and a notice
    for each one dropped."""
    kept: list[types.EmbeddedResource] = []
    notices: list[str] = []
    for number, entry in enumerate(files, 1):
        uri, kind = entry["uri"], entry["mime_type"]
        contents: types.TextResourceContents | types.BlobResourceContents
        try:
            if "text" in entry:
                size = len(entry["text"].encode("utf-8", "surrogatepass"))
                contents = types.TextResourceContents(uri=uri, mime_type=kind, text=entry["text"])
            else:
                size = len(base64.b64decode(entry["blob"], validate=True))
                contents = types.BlobResourceContents(uri=uri, mime_type=kind, blob=entry["blob"])
        except ValueError:
            size = -1
        if not (uri.startswith("file:///") and _strict_utf8(uri, entry.get("text", ""))) or not (
            0 <= size <= config.max_attachment_bytes
        ):
            notices.append("File %d was dropped: not a valid attachment within the cap." % number)
        elif len(kept) >= MAX_ATTACHMENTS:
            notices.append("File %d was dropped: at most %d files per call." % (number, MAX_ATTACHMENTS))
        else:
            kept.append(types.EmbeddedResource(resource=contents))
    return kept, notices


def sandbox_error_result(execute_id: FrameId, kind: str, message: str) -> ResultFrame:
    """A result frame for an execute the kernel could not run to its own result."""
    error: ErrorInfo = {"type": kind, "message": message, "traceback": ""}
    return {"type": "result", "id": execute_id, "status": "error", "error": error}


class PendingExecute:
    """Collects the frames of one execute until its result (or the session's death)."""

    def __init__(self, execute_id: str, max_chars: int) -> None:
        self.id = execute_id
        self.max_chars = max_chars
        self.streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.kept = {"stdout": 0, "stderr": 0}
        self.cut = {"stdout": 0, "stderr": 0}
        self.result: ResultFrame | None = None
        self.done = anyio.Event()
        self.progress: CallProgress | None = None
        self.server_log: ServerLog | None = None  # where proxied servers' log messages go
        # How to reach the user: through the client of the latest call that waited for
        # this execute (it stays after a "still running" answer). None: it cannot be asked.
        self.asker: UserQuestions | None = None
        self.parked = QuestionDesk()  # questions waiting for a 2026-07-28 client's retry
        self.proxied_calls = 0  # tool calls, resource and prompt reads so far (MCP_BRIDGE_MAX_TOOL_CALLS)
        self.notices: list[str] = []  # what the proxied calls have to tell the result
        self.awaiting: list[str] = []  # the calls waiting for the user's approval now
        self.timeout_scope: anyio.CancelScope | None = None  # its deadline is the call's timeout
        self._paused_at: float | None = None  # since when the timeout stands still
        self._deadline = math.inf  # the timeout's deadline when it began to stand still

    @contextmanager
    def paused(self, call: str) -> Iterator[None]:
        """The timeout stands still while ``call`` waits for the user (approvals overlap:
        it starts again when the last one is answered, moved on by the time they took)."""
        scope, self.awaiting = self.timeout_scope, [*self.awaiting, call]
        if len(self.awaiting) == 1:
            self._paused_at = time.monotonic()
        if scope is not None and len(self.awaiting) == 1:
            self._deadline, scope.deadline = scope.deadline, math.inf
        try:
            yield
        finally:
            self.awaiting.remove(call)
            if not self.awaiting and self._paused_at is not None:
                waited, self._paused_at = time.monotonic() - self._paused_at, None
                if scope is not None:
                    scope.deadline = self._deadline + waited

    def add_stream(self, name: str, text: str) -> None:
        if self.progress is not None:
            self.progress.saw_output(text)
        # The supervisor streams at most half the budget per stream (the head); this is the
        # host's own cap, in case anything else ever writes stream frames.
        room = max(0, self.max_chars // 2 - self.kept[name])
        if room:
            self.streams[name].append(text[:room])
        self.kept[name] += min(room, len(text))
        self.cut[name] += max(0, len(text) - room)

    def complete(self, result: ResultFrame) -> None:
        """The first result ends the execute; anything later is ignored."""
        if self.result is None:
            self.result = result
            self.done.set()

    def receive(self, frame: StreamFrame | ResultFrame | ErrorFrame) -> None:
        """A valid stream, result or error frame of this execute's."""
        if frame["type"] == "stream":
            self.add_stream(frame["name"], frame["text"])
        elif frame["type"] == "result":
            self.complete(frame)
        else:
            self.complete(sandbox_error_result(self.id, "SandboxError", frame["message"]))

    async def wait_ticking(self, started: float) -> None:
        """Until the execute is done, progress every PROGRESS_INTERVAL seconds for whichever
        call waits for it now (it may change). Most code ends before the first tick is due:
        it costs no ticker task."""
        with anyio.move_on_after(PROGRESS_INTERVAL):
            await self.done.wait()
        if self.done.is_set():
            return
        async with anyio.create_task_group() as ticking:

            async def tick() -> None:
                while True:
                    if self.progress is not None:
                        await self.progress.tick(time.monotonic() - started)
                    await anyio.sleep(PROGRESS_INTERVAL)

            ticking.start_soon(tick)
            await self.done.wait()
            ticking.cancel_scope.cancel()


@dataclass(frozen=True)
class RunContext:
    """What a proxied call from sandbox code knows of the run_python call it is part of:
    its session's name and approvals, and its execute (whom to ask, its cap on proxied
    calls, its timeout, which stands still while the user is asked)."""

    session_name: str
    approvals: SessionApprovals
    pending: PendingExecute
    max_calls: int
    request_bytes: int = 0  # the size of the request frame: small ones are checked on the event loop

    def count_call(self, what: str) -> None:
        """One more proxied call (``what``: the code's words for it); ToolCallCapError past the cap."""
        self.pending.proxied_calls += 1
        if self.pending.proxied_calls > self.max_calls:
            raise ToolCallCapError(
                "%s was not made: this run_python call has made %d proxied calls (tools, resources, "
                "prompts), the cap (MCP_BRIDGE_MAX_TOOL_CALLS). A loop may be calling by mistake; if not, "
                "split the work over several run_python calls (variables are kept)." % (what, self.max_calls)
            )

    async def approve(self, call: ProxiedCall, reason: str) -> str:
        """The user's decision on ``call`` (see SessionApprovals.decide), the timeout paused."""
        with self.pending.paused(call.shown):
            return await self.approvals.decide(call, reason, self.pending.asker, self.pending.notices)

    async def relay(
        self, server: str, params: types.ElicitRequestParams
    ) -> types.ElicitResult | types.ErrorData:
        """A proxied server's question to its client, passed on to this call's user (the
        timeout paused meanwhile); refused with the reason where the user cannot be asked."""
        asker = self.pending.asker
        if asker is None:
            return types.ErrorData(
                code=types.INVALID_REQUEST,
                message="the bridge declined: the client of the run_python call that made this call "
                "cannot show the user a question (no elicitation support)",
            )
        with self.pending.paused("a question from MCP server %r" % server):
            try:
                return await asker.relay(server, params)
            except Exception as exc:
                return types.ErrorData(
                    code=types.INTERNAL_ERROR,
                    message="the question could not reach the user: %s" % _describe_exception(exc),
                )

    def paused(self, waiting_for: str) -> AbstractContextManager[None]:
        return self.pending.paused(waiting_for)

    async def progress(self, server: str, done: float, total: float | None, message: str | None) -> None:
        """A proxied call's progress, heard as this run_python call's progress."""
        if self.pending.progress is not None:
            await self.pending.progress.relay(server, done, total, message)

    async def log(self, server: str, params: types.LoggingMessageNotificationParams) -> None:
        """A proxied server's log message during a call, passed on to this call's client."""
        if self.pending.server_log is not None:
            with suppress(Exception):  # a client that went away must not fail the call
                await self.pending.server_log(server, params)


class ProblemLog:
    """Logs the first problem of each kind and counts the rest: the sandbox can cause
    these at will and must not be able to flood the bridge's log. Kinds are fixed
    strings of ours (or exception class names), so the table stays small."""

    MAX_KINDS = 64

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def report(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        seen = self.counts.get(kind, 0)
        if seen or len(self.counts) < self.MAX_KINDS:
            self.counts[kind] = seen + 1
        if not seen:
            logger.warning(
                message + " (further problems of this kind are not logged)", *args, exc_info=exc_info
            )


class ServerDirectory(Protocol):
    """What a sandbox's settings tell its kernel about the MCP servers (SandboxAPI)."""

    def server_list(self) -> list[dict[str, str]]: ...

    def config_problems(self) -> list[str]: ...


class SandboxServices(ServerDirectory, Protocol):
    """What a sandbox session asks of the host while it runs code: SandboxAPI, a principal's
    one for all its sandboxes (tests pass a fake)."""

    async def handle(self, method: str, params: Mapping[str, object], run: RunContext | None) -> object: ...

    def defined_tools_notice(self, names: Sequence[str]) -> str | None: ...

    async def quarantine_tools(self, failed: Sequence[mcp_sandbox_kernel.FailedTool]) -> list[str]: ...


# --- a sandbox's parts: its container, its request desk, its exit, its outcome ----------


def listen_in(directory: Path, name: str) -> socket.socket:
    """A Unix socket listening at ``directory/name`` that anyone who can reach the
    directory may connect to (the sandbox's user is not the bridge's). Bound through the
    directory's descriptor: a socket's path is limited to 107 bytes, a state directory's
    is not."""
    with suppress(FileNotFoundError):  # a stale file would make bind fail
        (directory / name).unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    try:
        listener.bind("/proc/self/fd/%d/%s" % (directory_fd, name))
        (directory / name).chmod(0o666)
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    finally:
        os.close(directory_fd)
    return listener


class FrameSocket(anyio.abc.ByteStream):
    """The kernel's connection to the frames' socket, read and written on the event loop
    as asyncio's own transports are: the loop's readable callback reads what has arrived
    for the task that waits for it, and a write goes out at once. anyio's socket stream
    costs more at each message: a pass of the loop before each read and each write, the
    socket registered anew at each read (two epoll_ctl calls, and a KeyError that asyncio
    formats with the socket's repr: two more system calls), and a read that finds nothing
    before each wait. The socket stays registered while its reader keeps coming back; a
    callback while nobody waits unregisters it (data left unread must not wake the loop
    again and again), and the next receive registers it again. The bridge runs on anyio's
    asyncio backend."""

    def __init__(self, connection: socket.socket) -> None:
        connection.setblocking(False)
        self.connection = connection
        self.closed = False
        self._chunks: deque[bytes] = deque()  # read by the callback, not yet received
        self._end: BaseException | None = None  # EndOfStream, or BrokenResourceError, once read
        self._loop: Any = None  # the running asyncio loop, while the socket is registered with it
        self._waiter: Any = None  # the future of the receive waiting now

    async def receive(self, max_bytes: int = 65536) -> bytes:
        import asyncio  # anyio's asyncio backend runs the bridge: asyncio is loaded already

        while not self._chunks:
            if self.closed:
                raise anyio.ClosedResourceError
            if self._end is not None:
                raise self._end
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(self.connection.fileno(), self._readable)
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        return chunk

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is None:  # nobody waits: the next receive registers the socket again
            self._unregister()
            return
        try:
            data = self.connection.recv(65536)
        except BlockingIOError:  # a stale wake: what the loop saw was read already
            return
        except OSError as exc:  # the kernel's end went away with frames unread
            self._end = anyio.BrokenResourceError(str(exc))
            data = b""
        if data:
            self._chunks.append(data)
        else:
            self._end = self._end or anyio.EndOfStream()
            self._unregister()
        if not waiter.done():
            waiter.set_result(None)

    def _unregister(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.connection.fileno())
            self._loop = None

    async def send(self, item: bytes) -> None:
        """All of ``item`` (the caller holds the write lock: frames are never interleaved)."""
        view = memoryview(item)
        while view:
            if self.closed:
                raise anyio.ClosedResourceError
            try:
                view = view[self.connection.send(view) :]
            except BlockingIOError:  # a frame larger than the socket's buffer, or a slow reader
                await anyio.wait_writable(self.connection)
            except OSError as exc:
                raise anyio.BrokenResourceError from exc

    async def send_eof(self) -> None:
        with suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Closed: a receive waiting now raises ClosedResourceError, and so does a send
        waiting for room (anyio.notify_closing), as anyio's own streams do."""
        if not self.closed:
            self.closed = True
            self._unregister()  # before the descriptor goes
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            anyio.notify_closing(self.connection)
            self.connection.close()

    async def aclose(self) -> None:
        self.close()


async def accepted(listener: socket.socket) -> socket.socket:
    """The next connection to ``listener`` (non-blocking by then)."""
    listener.setblocking(False)
    while True:
        try:
            return listener.accept()[0]
        except BlockingIOError:
            await anyio.wait_readable(listener)


class SandboxContainer:
    """One sandbox's container on the engine's side: its name, its private IPC directory
    (the kernel, its settings, the seccomp profile), the launch spec, the process that
    starts it and the first bytes the kernel reads, why it did not start, and its removal."""

    def __init__(
        self,
        engine: ContainerEngine,
        config: BridgeConfig,
        ipc_root: Path,
        api: ServerDirectory,
        owner: OwnerIdentity | None,
        session_name: str,
    ) -> None:
        self.engine = engine
        self.config = config
        self.api = api
        self.owner = owner = owner or bridge_owner()
        self.session_name = session_name
        self.name = container_name(owner)
        self.ipc_dir = ipc_root / session_dir_name(owner, self.name) / "ipc"
        self.listener: socket.socket | None = None  # the frames' socket, until the kernel connects

    @property
    def kernel_via_stdin(self) -> bool:
        """Whether the kernel reaches the container on its stdin (BOOTSTRAP) rather than
        through the IPC mount: asked for, or a remote engine that may not see this
        machine's files (MCP_BRIDGE_KERNEL_DELIVERY)."""
        delivery = self.config.kernel_delivery
        return delivery == "stdin" or (delivery == "auto" and self.engine.remote)

    @property
    def frames_via_socket(self) -> bool:
        """Whether the bridge offers the kernel a Unix socket in the IPC mount for its frames
        (MCP_BRIDGE_FRAME_CHANNEL): only where the engine runs the container on this Linux
        machine. Where the socket is still out of reach (Docker Desktop's VM, gVisor) the
        kernel keeps its frames on stdio."""
        return (
            self.config.frame_channel == "auto"
            and sys.platform == "linux"
            and not self.kernel_via_stdin
            and not self.engine.remote
        )

    def session_config(self) -> dict[str, Any]:
        """The kernel's settings: session.json in the mount, or part of the boot payload."""
        return {
            "protocol": PROTOCOL_VERSION,
            "session": self.session_name,
            "max_frame_bytes": self.config.max_frame_bytes,
            "max_output_chars": self.config.max_output_chars,
            "max_images": self.config.max_images,
            "max_image_bytes": self.config.max_image_bytes,
            "max_attachment_bytes": self.config.max_attachment_bytes,
            "memory": self.config.memory,  # named when the out-of-memory killer strikes
            "workdir": WORKDIR,
            "servers": self.api.server_list(),
            # Named by runtime.discovered_servers() and by the error for an unknown mcp_<alias>.
            "config_problems": self.api.config_problems(),
            "saved_tools": True,  # the executor asks for them before its first call
            **({"socket": "%s/%s" % (IPC_MOUNT, CHANNEL_SOCKET_FILENAME)} if self.frames_via_socket else {}),
        }

    def prepare_ipc_dir(self) -> None:
        """A private (0700) per-session directory holding a world-readable (0755) `ipc/`
        that is mounted read-only: the sandbox user can read the kernel, other host
        users cannot reach it, and nothing in it is writable from inside. With the kernel
        on stdin only the directory (the seccomp profile, the engine's working directory)."""
        self.ipc_dir.parent.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.ipc_dir.parent.mkdir(mode=0o700)
        # Beside ipc/, not in it: the engine's CLI reads it on the host; the sandbox never sees it.
        self.seccomp_path.write_text(json.dumps(seccomp_profile()))
        if self.kernel_via_stdin:
            return
        self.ipc_dir.mkdir(mode=0o755)
        self.ipc_dir.chmod(0o755)  # undo the umask
        shutil.copyfile(KERNEL_SOURCE, self.ipc_dir / KERNEL_FILENAME)
        (self.ipc_dir / SESSION_CONFIG_FILENAME).write_text(json.dumps(self.session_config()))
        for path in self.ipc_dir.iterdir():
            path.chmod(0o644)
        if self.frames_via_socket:
            try:
                self.listener = listen_in(self.ipc_dir, CHANNEL_SOCKET_FILENAME)
            except OSError as exc:  # the kernel finds no socket and stays on stdio
                logger.warning("sandbox %s: no socket for its frames (%s): stdio instead", self.name, exc)

    def take_listener(self) -> socket.socket | None:
        """The frames' listening socket, handed over once; its file is gone from then on
        (no one else in the sandbox can connect: the kernel's connection is the only one)."""
        listener, self.listener = self.listener, None
        return listener

    def remove_socket_file(self) -> None:
        with suppress(OSError):
            (self.ipc_dir / CHANNEL_SOCKET_FILENAME).unlink()

    def launch_spec(self) -> LaunchSpec:
        return LaunchSpec(
            name=self.name,
            image=self.config.image,
            ipc_dir=None if self.kernel_via_stdin else self.ipc_dir,
            owner=self.owner,
            memory=self.config.memory,
            pids=self.config.pids,
            cpus=self.config.cpus,
            user=sandbox_user(self.config),
            seccomp_profile=self.seccomp_path if self.engine.reads_profile_here else None,
            workspace=self.config.workspace,
            session=self.session_name,
        )

    @property
    def seccomp_path(self) -> Path:
        return self.ipc_dir.parent / SECCOMP_FILENAME

    def opening(self, frame_key: bytes) -> bytes:
        """What the kernel reads first: with the kernel on stdin, BOOTSTRAP's payload (the
        kernel and its settings); then the key the supervisor signs its frames with."""
        key = encode_frame({"type": "key", "key": frame_key.hex()}, self.config.max_frame_bytes)
        if not self.kernel_via_stdin:
            return key
        return boot_payload(KERNEL_SOURCE.read_text(encoding="utf-8"), self.session_config()) + key

    async def open_process(self) -> anyio.abc.Process:
        """Prepare the IPC directory and run the engine's CLI, which starts the container."""
        argv = self.engine.run_argv(self.launch_spec())
        try:
            self.prepare_ipc_dir()
            # cwd: Podman's conmon drops an "oom" marker file into the working directory
            # when the container is OOM-killed; keep it in the session's private directory.
            process = await anyio.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.ipc_dir.parent,
            )
        except OSError as exc:
            raise SandboxStartError(
                "The sandbox could not be launched: %s (state directory %s). Check that "
                "MCP_BRIDGE_STATE_DIR is a writable directory." % (exc, self.config.state_dir)
            ) from None
        logger.debug("starting sandbox: %s", " ".join(argv))
        return process

    async def failure(self, reason: str) -> SandboxStartError:
        """Why the sandbox did not start (``reason``), and what the user can do about it."""
        tried = "`%s run ... %s`" % (Path(self.engine.executable).name, self.config.image)
        if not await self.engine.has_image(self.config.image):
            return SandboxImageMissingError(
                "The sandbox image %s could not be found or pulled: %s. Tried: %s. Set MCP_BRIDGE_IMAGE "
                "to an image with python3 >= 3.9 that this machine has or can pull (`%s build-image` "
                "builds one), then restart the MCP server; the server log has the runtime's output."
                % (self.config.image, reason, tried, SERVER_NAME)
            )
        # A cluster's nodes pull the image: whether they can is not known here.
        where = "" if isinstance(self.engine, KubernetesEngine) else " (the image is on this machine)"
        return SandboxStartError(
            "The sandbox container did not start: %s. Tried: %s%s. Check the sandbox settings "
            "(MCP_BRIDGE_OCI_RUNTIME, MCP_BRIDGE_MEMORY, MCP_BRIDGE_CONTAINER_USER, ...) and the "
            "runtime's output in the server log, then restart the MCP server." % (reason, tried, where)
        )

    async def remove(self) -> None:
        """Remove the container, running or not."""
        try:
            await run_command(self.engine.kill_argv(self.name))
        except TimeoutError:
            logger.warning("%s rm --force %s timed out", self.engine.name, self.name)

    async def clean_up(self, launched: bool) -> None:
        """Remove what is left once the process has ended: what the engine keeps of a
        container that was ``launched`` (e.g. a Pod that has ended is kept until it is
        deleted), and the IPC directory."""
        leftover = self.engine.leftover_argv(self.name) if launched else None
        if leftover is not None:
            try:
                await run_command(leftover)
            except (TimeoutError, OSError) as exc:  # swept by label at the next start
                logger.warning("could not remove sandbox %s: %s", self.name, exc)
        listener = self.take_listener()
        if listener is not None:
            listener.close()
        shutil.rmtree(self.ipc_dir.parent, ignore_errors=True)


def execute_frame(execute_id: str, code: str, saved_tools: bool, max_frame_bytes: int) -> bytes:
    """The execute frame for ``code``; InvalidRequestError when it is too large to send."""
    frame: ExecuteFrame = {"type": "execute", "id": execute_id, "code": code}
    if not saved_tools:
        frame["saved_tools"] = False
    try:
        return encode_frame(frame, max_frame_bytes)
    except ProtocolError as exc:
        raise InvalidRequestError(
            "The code is too large to send to the sandbox (%s). Split it into smaller calls, "
            "or raise MCP_BRIDGE_MAX_FRAME_BYTES." % exc
        ) from None


class RequestDesk:
    """The sandbox's requests to the host while a call runs. Each is served in a task of
    its own (many may be in flight), within caps on how many and on their bytes together;
    each gets exactly one answer, also when it is refused, fails, is cancelled (the call
    that made it ended) or its answer cannot be sent. Nothing here raises to the reader."""

    def __init__(
        self,
        name: str,
        serve: Callable[[RequestFrame, int], Awaitable[object]],  # (frame, its bytes) -> JSON data
        send: Callable[[ResponseFrame], Awaitable[None]],
        max_bytes: int,
        problems: ProblemLog,
    ) -> None:
        self.name = name  # the sandbox's, for the log
        self.serve = serve  # a request frame and its size -> its result; BridgeError: an answer for the code
        self.send = send  # one frame into the sandbox
        self.max_bytes = max_bytes  # per request, and of all requests in flight together
        self.problems = problems
        self.task_group: anyio.abc.TaskGroup | None = None  # none yet: every request is refused
        self.requests: dict[FrameId, anyio.CancelScope] = {}  # in flight, by id
        self.request_bytes = 0  # frame bytes of the requests in flight
        self.refusing = 0  # refusal answers being sent

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def accept(self, frame: RequestFrame, size: int) -> None:
        """Serve a valid request frame of ``size`` bytes, or refuse it (a duplicate id is dropped)."""
        request_id, cap = frame["id"], self.max_bytes
        if request_id in self.requests:
            self.problems.report("duplicate id", "sandbox %s reused request id %r", self.name, request_id)
        elif self.in_flight >= MAX_REQUESTS_IN_FLIGHT or self.task_group is None:
            # Defense in depth (the supervisor caps requests in flight too): code that fires
            # requests without bound must not make the bridge hold unbounded server calls.
            self.refuse(request_id, TOO_MANY_REQUESTS)
        elif size > cap:
            # Defense in depth: a request's arguments are held (and checked, and sent on)
            # by the bridge, so they are capped like a tool's result.
            self.refuse(
                request_id,
                "runtime.%s: the request is %d bytes, over the %d-byte cap for a request to the host "
                "(MCP_BRIDGE_MAX_TOOL_RESULT_BYTES). Pass less data per call (split it over several calls)."
                % (frame["method"], size, cap),
            )
        elif self.request_bytes + size > cap:
            # All requests in flight together hold at most the cap too (up to 256 of them
            # could otherwise hold 256 times the cap).
            self.refuse(
                request_id,
                "runtime.%s: the request is %d bytes, and requests still in flight hold %d bytes; together "
                "they may hold at most %d bytes (MCP_BRIDGE_MAX_TOOL_RESULT_BYTES). Wait for those calls to "
                "finish, or pass less data per call." % (frame["method"], size, self.request_bytes, cap),
            )
        else:
            self.request_bytes += size
            scope = self.requests[request_id] = anyio.CancelScope()
            self.task_group.start_soon(self._serve, frame, scope, size)

    def refuse(self, request_id: FrameId, message: str) -> None:
        """Answer a request with an error from a task of its own: the reader must never
        wait on a write to the sandbox (the sandbox may be waiting for the reader), and a
        flood of refusals beyond MAX_REQUESTS_IN_FLIGHT is dropped, not queued."""
        if self.refusing >= MAX_REQUESTS_IN_FLIGHT or self.task_group is None:
            self.problems.report("refusal flood", "sandbox %s: request refusals dropped", self.name)
            return
        self.refusing += 1

        async def answer() -> None:
            try:
                await self.respond(request_id, error=message)
            finally:
                self.refusing -= 1

        self.task_group.start_soon(answer)

    def cancel(self, request_id: FrameId | None = None) -> None:
        """Cancel one request in flight, or all of them (the call that made them ended)."""
        for key, scope in list(self.requests.items()):
            if request_id is None or key == request_id:
                scope.cancel()

    async def _serve(self, frame: RequestFrame, scope: anyio.CancelScope, size: int) -> None:
        """Serve one request and answer it exactly once; nothing raises out of here."""
        request_id = frame["id"]
        result: object = None
        error: str | ErrorInfo | None = None
        try:
            with scope:
                try:
                    result = await self.serve(frame, size)
                except BridgeError as exc:
                    error = exc.for_sandbox()
                except Exception as exc:  # a bug here must fail one request, not the bridge
                    self.problems.report(
                        "internal " + type(exc).__name__,
                        "sandbox request %s failed",
                        frame["method"],
                        exc_info=True,
                    )
                    error = "internal bridge error (%s); the server log has details" % type(exc).__name__
            if scope.cancelled_caught:
                # Answered anyway: a background thread or task in the sandbox may still wait.
                error = "cancelled: the run_python call that made this request has ended"
        finally:
            self.requests.pop(request_id, None)
            self.request_bytes -= size
        await self.respond(request_id, result=result, error=error)

    async def respond(
        self, request_id: FrameId, result: object = None, error: str | ErrorInfo | None = None
    ) -> None:
        """Send the one response to ``request_id`` (``error``: a message, raised as
        runtime.MCPError, or a BridgeError's for_sandbox()); a response too large for a
        frame becomes an error response. Never raises: the sandbox may be gone already."""
        response: ResponseFrame = {"type": "response", "id": request_id}
        if error is None:
            response["result"] = result
        else:
            response["error"] = {"type": "MCPError", "message": error} if isinstance(error, str) else error
        try:
            try:
                await self.send(response)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise
            except Exception as exc:  # too large, or not encodable (RecursionError): still one answer
                message = "the answer could not be sent into the sandbox: %s: %s" % (type(exc).__name__, exc)
                await self.send(
                    {
                        "type": "response",
                        "id": request_id,
                        "error": {"type": "MCPError", "message": message[:2000]},
                    }
                )
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the sandbox is gone; its reader reports that
        except Exception:
            self.problems.report(
                "respond", "sandbox %s: could not answer request %r", self.name, request_id, exc_info=True
            )


class SandboxExit:
    """How a sandbox ended, told to the model as "The sandbox <reason>": the bridge's own
    reason when it stopped or removed it, else a reason read from the exit code and from
    what the sandbox said last (the kernel's id-less errors, its stderr's last lines)."""

    def __init__(self, memory: str) -> None:
        self.memory = memory  # the memory limit, named when the out-of-memory killer struck
        self.reason: str | None = None
        self.by_bridge = False
        self.stderr_tail: list[str] = []
        self.kernel_errors: list[str] = []  # the last few

    def stopped_by_bridge(self, reason: str) -> None:
        self.by_bridge = True
        self.reason = self.reason or reason

    def saw_stderr(self, text: str) -> None:
        self.stderr_tail = (self.stderr_tail + [line[:500] for line in text.splitlines()])[-20:]

    def saw_kernel_error(self, message: str) -> None:
        self.kernel_errors = [*self.kernel_errors[-4:], message[:500]]

    def ended(self, code: int | None) -> None:
        """The process ended with ``code``: the reason, unless one is known already."""
        self.reason = self.reason or self.explain(code)

    def explain(self, code: int | None) -> str:
        if self.by_bridge:
            return "was stopped by the bridge"
        if code in (SIGKILL_EXIT, -signal.SIGKILL):
            return (
                "was killed (SIGKILL), almost certainly by the out-of-memory killer: the code "
                "exceeded the sandbox's %s memory limit" % self.memory
            )
        if self.kernel_errors:
            return "stopped (exit code %s); the kernel reported: %s" % (code, self.kernel_errors[-1])
        tail = " Last kernel output: %s" % " | ".join(self.stderr_tail[-3:]) if self.stderr_tail else ""
        return "exited unexpectedly with code %s.%s" % (code, tail)


# Import names of common data packages, and the PyPI name build-image installs each by.
# The sandbox has no network, so `pip install` cannot add one: the image must have it.
DATA_PACKAGES = {
    "numpy": "numpy", "pandas": "pandas", "matplotlib": "matplotlib", "scipy": "scipy",
    "sklearn": "scikit-learn", "PIL": "pillow", "seaborn": "seaborn", "statsmodels": "statsmodels",
    "sympy": "sympy", "polars": "polars", "pyarrow": "pyarrow", "openpyxl": "openpyxl",
    "networkx": "networkx", "plotly": "plotly", "yaml": "pyyaml", "bs4": "beautifulsoup4",
    "lxml": "lxml", "cv2": "opencv-python", "dateutil": "python-dateutil", "tabulate": "tabulate",
}  # fmt: skip


def missing_package_hint(error: Mapping[str, Any] | None, image: str) -> str | None:
    """For code that failed to import a common data package (the kernel's ``module`` of a
    ModuleNotFoundError): the image lacks it, and how the user gets one that has it."""
    module = str((error or {}).get("module") or "")  # "a.b": a is there, a.b is not
    if module not in DATA_PACKAGES:
        return None
    packages = list(BATTERIES) + [DATA_PACKAGES[module]] * (DATA_PACKAGES[module] not in BATTERIES)
    return (
        "%s is not installed in the sandbox image %s, and the sandbox has no network to pip install "
        "it. Tell the user: `%s %s --packages %s` builds an image with it; then set MCP_BRIDGE_IMAGE=%s "
        "in this MCP server's environment and restart it. Meanwhile, use the standard library."
        % (module, image, SERVER_NAME, BUILD_IMAGE_COMMAND, ",".join(packages), BATTERIES_TAG)
    )


MAX_CRASH_REASON_CHARS = 1000
# What outcome_of_execute reads when the kernel sent no result: none of the optional fields.
NO_RESULT: ResultFrame = {"type": "result", "id": "", "status": "crashed"}


def outcome_of_execute(
    pending: PendingExecute,
    *,
    timeout: float,
    timed_out: bool,
    death_reason: str | None,
    config: BridgeConfig,
) -> ExecutionOutcome:
    """What the kernel said about one execute (``pending``'s output and result, none when
    the sandbox died), as the call's outcome: whether the code timed out (``timed_out``:
    it had no result within ``timeout`` seconds), ended, crashed or failed, and what of
    the session's state is left. ``death_reason`` completes "The sandbox ..."."""
    status = pending.result["status"] if pending.result is not None else None
    result = pending.result or NO_RESULT
    cuts = {name: OutputCut(**cut) for name, cut in (result.get("cut") or {}).items()}
    for name, count in pending.cut.items():  # the host's own cap cut the head
        if count:
            cuts.setdefault(name, OutputCut()).count += count
    images, dropped_images = checked_images(result.get("images") or [], config)
    attachments, dropped_files = checked_attachments(result.get("attachments") or [], config)
    outcome = ExecutionOutcome(
        status="ok",
        stdout="".join(pending.streams["stdout"]),
        stderr="".join(pending.streams["stderr"]),
        value=result.get("value"),
        value_json=result.get("json"),
        error=result.get("error"),
        cuts=cuts,
        notices=[*(result.get("notices") or []), *dropped_images, *dropped_files],
        images=images,
        attachments=attachments,
    )
    if timed_out and status == "ok":
        timed_out = False  # it finished during the grace period: an ordinary success
    if timed_out and status == "killed":
        # error (kept) says what the supervisor did and how fast a fresh process was up.
        outcome.status, outcome.state_kept = "timeout", False
        outcome.detail = (
            "Timed out after %gs and did not stop when interrupted. Variables, imports and functions "
            "are gone; files in /tmp and /workspace were kept." % timeout
        )
    elif timed_out and pending.result is not None:
        outcome.status = "timeout"
        outcome.detail = (
            "Timed out after %gs: the code was interrupted (KeyboardInterrupt) and any processes it "
            "started were stopped. The session and its variables were kept." % timeout
        )
    elif timed_out:
        outcome.status, outcome.state_kept, outcome.error = "timeout", False, None
        outcome.detail = (
            "Timed out after %gs and did not stop when interrupted, so the sandbox was killed. "
            "All state was lost; the next call starts a fresh session." % timeout
        )
    elif pending.result is None:
        outcome.status, outcome.state_kept = "crashed", False
        outcome.detail = "The sandbox %s. All state was lost; the next call starts a fresh session." % (
            death_reason or "stopped"
        )
    elif status in ("crashed", "killed"):
        said = outcome.error.get("message") if outcome.error is not None else None
        reason = str(said or "the Python process running the code ended")
        reason = reason[:MAX_CRASH_REASON_CHARS]  # the supervisor's word, from the sandbox
        outcome.status, outcome.state_kept, outcome.error = "crashed", False, None
        outcome.detail = (
            "%s%s. Variables, imports and functions are gone; files in /tmp and /workspace were kept, "
            "and the next call runs in a fresh Python process." % (reason[:1].upper(), reason[1:])
        )
    elif status != "ok":
        outcome.status = "error"
        outcome.detail = missing_package_hint(outcome.error, config.image)
    return outcome


class Sandbox:
    """One container running the kernel: its process, the tasks that read its frames, and
    the calls it runs. Its container on the engine's side (SandboxContainer), its requests
    to the host (RequestDesk), the story of its exit (SandboxExit) and what an execute's
    result means (outcome_of_execute) are parts of their own."""

    def __init__(
        self,
        engine: ContainerEngine,
        config: BridgeConfig,
        ipc_root: Path,
        api: SandboxServices,
        owner: OwnerIdentity | None = None,
        problems: ProblemLog | None = None,
        session_name: str = DEFAULT_SESSION,
    ) -> None:
        self.config = config
        self.api = api
        # The engine, the owner and run_python's name for it (runtime.session inside) are its container's.
        self.container = SandboxContainer(engine, config, ipc_root, api, owner, session_name)
        self.name = self.container.name
        self.process: anyio.abc.Process | None = None
        self.hello: HelloFrame | None = None
        self.hello_received = anyio.Event()
        self.exited = anyio.Event()
        self.exit = SandboxExit(config.memory)
        self.pending: PendingExecute | None = None
        self.malformed_frames = 0
        self.first_malformed: str | None = None
        # Shared by a principal's sandboxes: one restarted again and again logs once.
        self.problems = problems = problems or ProblemLog()
        self.desk = RequestDesk(self.name, self._serve, self.send, config.max_tool_result_bytes, problems)
        self.approvals = SessionApprovals(config)  # what the user allowed for this session
        self.frame_key = secrets.token_bytes(32)  # signs what the supervisor sends (see the kernel)
        # The kernel's socket connection once its first frame arrived there; until then (and
        # where it has none) frames to the kernel go to the container's stdin.
        self._socket: anyio.abc.ByteSendStream | None = None
        self._write_lock = anyio.Lock(fast_acquire=True)  # no pass of the loop when free: one less per call
        self._reader_scopes: list[anyio.CancelScope] = []

    @property
    def alive(self) -> bool:
        return self.process is not None and not self.exited.is_set()

    @property
    def death_reason(self) -> str | None:
        """Why the sandbox ended (completes "The sandbox ..."); None while it runs."""
        return self.exit.reason

    # --- start ------------------------------------------------------------------
    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        try:
            await self._start(task_group)
        except BaseException:
            await self.stop()  # cancelled or failed half-way: the container must not outlive it
            raise

    async def _start(self, task_group: anyio.abc.TaskGroup) -> None:
        self.process = process = await self.container.open_process()
        assert process.stdout is not None
        self.desk.task_group = task_group
        task_group.start_soon(self._read_frames, process.stdout)
        listener = self.container.take_listener()
        if listener is not None:
            task_group.start_soon(self._frames_from_socket, listener)
        task_group.start_soon(self._read_stderr)
        with anyio.move_on_after(self.config.start_timeout):
            # Within the start timeout: an engine still pulling the image reads nothing yet.
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.send_bytes(self.container.opening(self.frame_key))
            await _first_of(self.hello_received, self.exited)
        if self.hello is None:
            raise await self.container.failure(
                self.death_reason or "no hello from the kernel within %gs" % self.config.start_timeout
            )
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            raise SandboxStartError(
                "The sandbox kernel speaks protocol %r, the bridge %d: reinstall the package."
                % (self.hello.get("protocol"), PROTOCOL_VERSION)
            )
        logger.info("sandbox %s ready (python %s)", self.name, self.hello.get("python"))

    # --- frame I/O ------------------------------------------------------------------
    async def send(self, frame: InterruptFrame | ResponseFrame) -> None:
        await self.send_bytes(encode_frame(frame, self.config.max_frame_bytes))

    @property
    def channel(self) -> Literal["stdio", "socket"]:
        """Where the frames go: the container's stdin and stdout, or the kernel's socket."""
        return "stdio" if self._socket is None else "socket"

    async def send_bytes(self, data: bytes) -> None:
        out = self._socket or (None if self.process is None else self.process.stdin)
        assert out is not None
        async with self._write_lock:
            await out.send(data)

    async def _frames_from_socket(self, listener: socket.socket) -> None:
        """Take the kernel's connection to the frames' socket, if it makes one before its
        hello, and read its frames; only one connection is taken, and the socket's file is
        removed then (or once the hello came over stdio: the kernel could not connect)."""
        connection: FrameSocket | None = None
        with self._reader_scope():
            with listener:
                async with anyio.create_task_group() as waiting:

                    async def accept() -> None:
                        nonlocal connection
                        try:
                            connection = FrameSocket(await accepted(listener))
                        except OSError as exc:
                            logger.warning("sandbox %s: its frames' socket is unusable (%s)", self.name, exc)
                        waiting.cancel_scope.cancel()

                    async def hello_over_stdio() -> None:
                        await _first_of(self.hello_received, self.exited)
                        waiting.cancel_scope.cancel()

                    waiting.start_soon(accept)
                    waiting.start_soon(hello_over_stdio)
            self.container.remove_socket_file()
        if connection is not None:
            async with connection:
                await self._read_frames(connection, answers=connection)

    async def _read_frames(
        self, frames_in: anyio.abc.ByteReceiveStream, answers: anyio.abc.ByteSendStream | None = None
    ) -> None:
        """Read and dispatch the frames arriving on ``frames_in``: the container's stdout, or
        the kernel's socket connection (``answers``, where the bridge's frames go from the
        first authentic frame on it: only the kernel holds the key)."""
        via_socket = answers is not None
        decoder = FrameDecoder(self.config.max_frame_bytes, key=self.frame_key)
        unauthentic = 0
        with self._reader_scope():
            try:
                async for chunk in frames_in:
                    if decoder.buffered + len(chunk) > DECODE_IN_THREAD_BYTES and b"\n" in chunk:
                        # One reader per session: frames are still decoded in order.
                        frames = await anyio.to_thread.run_sync(decoder.feed_sized, chunk)
                    else:
                        frames = decoder.feed_sized(chunk)
                    if decoder.unauthentic > unauthentic:  # the code wrote to the channel itself
                        unauthentic = decoder.unauthentic
                        self.problems.report(
                            "unauthentic frames",
                            "sandbox %s: dropped lines on its channel that its supervisor did not sign",
                            self.name,
                        )
                    for frame, size in frames:
                        if answers is not None:
                            self._socket, answers = answers, None
                        await self._dispatch(frame, size)
            except ProtocolError as exc:
                logger.error("sandbox %s broke the frame protocol: %s", self.name, exc)
                await self._kill("broke the frame protocol (%s)" % exc)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            await (self._on_socket_closed() if via_socket else self._on_exit())

    async def _read_stderr(self) -> None:
        # The kernel's own diagnostics (not user output, which arrives as frames).
        assert self.process is not None and self.process.stderr is not None
        with self._reader_scope():
            try:
                async for chunk in self.process.stderr:
                    text = chunk.decode(errors="replace")
                    logger.info("sandbox %s stderr: %s", self.name, text.rstrip())
                    self.exit.saw_stderr(text)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def _reader_scope(self) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        self._reader_scopes.append(scope)
        return scope

    async def _dispatch(self, unchecked: Frame, size: int = 0) -> None:
        """One frame from the sandbox (``size`` bytes on the wire), validated before any
        field is used. Runs in the reader task: what it awaits slows the sandbox's sender,
        never the bridge."""
        try:
            frame = kernel_frame(unchecked)
        except ProtocolError as exc:
            self._on_malformed(unchecked, exc)
            return
        pending = self.pending
        if frame["type"] == "hello":
            if self.hello is None:
                self.hello = frame
                self.hello_received.set()
        elif frame["type"] == "request" and pending is None:
            # The supervisor already refuses requests between calls; defense in depth.
            self.desk.refuse(frame["id"], "refused: no run_python call is running")
        elif frame["type"] == "request":
            self.desk.accept(frame, size)
        elif frame["type"] == "cancel":
            self.cancel_requests(frame["id"])
        elif pending is not None and frame.get("id") == pending.id:  # stream, result or error
            pending.receive(frame)
        elif frame["type"] == "error":  # with no execute to end (e.g. why the kernel is stopping)
            self.exit.saw_kernel_error(frame["message"])
            self.problems.report("kernel error", "sandbox %s kernel: %s", self.name, frame["message"][:500])

    async def _serve(self, frame: RequestFrame, size: int) -> object:
        """One request of the sandbox's (``size`` bytes on the wire), served by the host (see RequestDesk)."""
        pending = self.pending
        if frame["method"] == mcp_sandbox_kernel.PROGRESS:  # about this session's own call
            await report_progress(pending, frame["params"])  # answered with null
            return None
        run = None
        if pending is not None:
            run = RunContext(
                self.container.session_name, self.approvals, pending, self.config.max_tool_calls, size
            )
        return await self.api.handle(frame["method"], frame["params"], run)

    def _on_malformed(self, frame: Frame, exc: ProtocolError) -> None:
        self.malformed_frames += 1
        self.first_malformed = self.first_malformed or str(exc)
        self.problems.report("malformed frame", "sandbox %s sent a malformed frame: %s", self.name, exc)
        kind, frame_id, pending = frame.get("type"), frame.get("id"), self.pending
        if kind == "result" and pending is not None and frame_id == pending.id:
            # Fail the call now rather than let it wait for a result that may never come.
            pending.complete(
                sandbox_error_result(
                    pending.id, "ProtocolError", "the sandbox sent a malformed result: %s" % exc
                )
            )
        elif kind == "request" and is_frame_id(frame_id):
            self.desk.refuse(frame_id, "the request was malformed: %s" % exc)

    def cancel_requests(self, request_id: FrameId | None = None) -> None:
        """Cancel one outstanding sandbox request, or all of them (end of an execute)."""
        self.desk.cancel(request_id)

    async def _on_socket_closed(self) -> None:
        """The kernel's socket ended: the kernel has exited and its container is ending,
        which the stdout reader reports. A container still there after a few seconds (a
        kernel that closed its socket and lives on) is removed."""
        with anyio.move_on_after(SOCKET_CLOSED_GRACE):
            await self.exited.wait()
        if not self.exited.is_set():
            await self._kill("closed its frame channel")

    async def _on_exit(self) -> None:
        assert self.process is not None
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            self.exit.ended(await self.process.wait())
        self.exited.set()
        if self.pending is not None:
            self.pending.done.set()

    # --- execute ---------------------------------------------------------------------
    async def execute(
        self,
        code: str,
        timeout: float,
        progress: CallProgress | None = None,
        pending: PendingExecute | None = None,
        saved_tools: bool = True,
    ) -> ExecutionOutcome:
        """Run ``code``; ``saved_tools`` false: a fresh namespace starts without them."""
        started = time.monotonic()
        malformed_before, self.first_malformed = self.malformed_frames, None
        pending = pending or PendingExecute(secrets.token_hex(8), self.config.max_output_chars)
        pending.progress = progress or pending.progress  # a waiting call may have set its own
        data = execute_frame(pending.id, code, saved_tools, self.config.max_frame_bytes)
        self.pending = pending
        if self.exited.is_set():  # ended before this execute: no reader is left to end it
            pending.done.set()
        timed_out = False
        try:
            with anyio.move_on_after(timeout) as pending.timeout_scope:
                # Inside the timeout: a sandbox that stopped reading cannot hold the call.
                with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self.send_bytes(data)  # if gone, the reader completes `pending`
                await pending.wait_ticking(started)
            if not pending.done.is_set():
                timed_out = True
                await self._stop_running(pending, "after a timeout")
        except anyio.get_cancelled_exc_class():
            # The client cancelled the call: stop the code too, or it would keep the
            # kernel busy and delay every later call.
            with anyio.CancelScope(shield=True):
                await self._stop_running(pending, "after the call was cancelled")
            raise
        finally:
            self.pending = None
            self.cancel_requests()
        outcome = outcome_of_execute(
            pending, timeout=timeout, timed_out=timed_out, death_reason=self.death_reason, config=self.config
        )
        result = pending.result or NO_RESULT
        defined = result.get("defined_tools")
        defined_notice = self.api.defined_tools_notice(defined) if defined is not None else None
        failed = result.get("failed_tools")
        quarantined = await self.api.quarantine_tools(failed) if failed else []
        malformed = self.malformed_frames - malformed_before
        notices = [
            *([defined_notice] if defined_notice is not None else []),
            *outcome.notices,
            *pending.notices,
            *quarantined,
            *(
                [
                    "The sandbox sent %d malformed frame(s) to the bridge, which ignored them (first: %s)."
                    % (malformed, self.first_malformed)
                ]
                if malformed
                else []
            ),
        ]
        return replace(outcome, notices=notices, duration=time.monotonic() - started)

    def abandon(self, reason: str) -> None:
        """End the running execute now, without its result (the bridge is shutting down);
        ``reason`` completes "The sandbox ..." for the model."""
        if self.pending is not None:
            self.exit.reason = self.exit.reason or reason
            self.pending.done.set()

    async def _stop_running(self, pending: PendingExecute, when: str) -> None:
        """Interrupt the running code. The supervisor escalates by itself: when the code
        has not stopped within the grace period it kills the code's processes, starts a
        fresh executor and answers "killed". Only a supervisor that does not answer at all
        (wedged, or the container is gone) makes the bridge remove the container."""
        # Bounded: a sandbox that stopped reading must not hold the timeout hostage.
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError), anyio.move_on_after(1):
            await self.send({"type": "interrupt", "id": pending.id, "grace": self.config.interrupt_grace})
        with anyio.move_on_after(self.config.interrupt_grace + SUPERVISOR_MARGIN):
            await pending.done.wait()
        if not pending.done.is_set():
            await self._kill("was removed %s: its supervisor did not answer the interrupt" % when)
            with anyio.move_on_after(10):
                await self.exited.wait()

    # --- stop --------------------------------------------------------------------------
    async def _kill(self, reason: str) -> None:
        """Remove the container; `reason` completes "The sandbox ..." for the model."""
        self.exit.stopped_by_bridge(reason)
        await self.container.remove()
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        """Close the channel (the kernel exits on EOF), make sure the container is gone,
        and remove the IPC directory. Safe to call more than once, from any task, and
        while the reader tasks are being cancelled (it waits on the process itself)."""
        with anyio.CancelScope(shield=True):
            process = self.process
            if process is not None and process.returncode is None:
                self.exit.stopped_by_bridge("was stopped by the bridge")
                if process.stdin is not None:
                    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await process.stdin.aclose()
                with anyio.move_on_after(2):
                    await process.wait()
                if process.returncode is None:
                    await self._kill("was stopped by the bridge")
                    with anyio.move_on_after(10):
                        await process.wait()
            await self.container.clean_up(launched=process is not None)
            for scope in self._reader_scopes:
                scope.cancel()
            self.exited.set()


START_RETRY_SECONDS = 300


@dataclass(frozen=True)
class Principal:
    """Who calls: stdio's one client, or an HTTP bearer token's principal. Its memory store
    and saved tools are its own (``api``); its sandboxes are Sandboxes', keyed by its name."""

    name: str
    api: SandboxAPI  # its memory store and saved tools


@dataclass(frozen=True)
class RunRequest:
    """One run_python call, built once at the tool boundary and passed whole down to the
    sandbox: what the caller asked, who asked (the principal, and the client it calls
    through), when the call arrived and how to report its progress."""

    code: str
    timeout: float
    reset: bool
    session_name: str  # run_python's session name
    principal: Principal
    saved_tools: bool = True
    client_name: str | None = None  # clientInfo.name from the client's initialize, if it said one
    progress: CallProgress | None = None  # None: the client asked for no progress
    server_log: ServerLog | None = None  # where proxied servers' log messages go
    asker: Elicitor | None = None  # None: no elicitation (round_trip, or it cannot ask its user)
    # The client speaks 2026-07-28: questions end the call with input_required (its retry answers).
    round_trip: bool = False
    resume: Resume | None = None  # a retry that answers them: go on with that code
    # The client takes MCP tasks (the Tasks extension, 2026-07-28): code still running when
    # the call must answer goes on as a task (McpTask) instead of answering "still running".
    as_task: bool = False
    arrived: float = field(default_factory=time.monotonic)  # the client's clock runs from here


@dataclass(frozen=True)
class Resume:
    """A 2026-07-28 retry of a run_python call that ended with input_required: the code it
    goes on with (its execute) and the client's answers, by key, with the digest of the
    call each key was asked about (from the sealed state)."""

    execute: str
    answers: Mapping[str, types.ElicitResult]
    digests: Mapping[str, str | None]


@dataclass(frozen=True)
class Reply:
    """What one call's turn at a sandbox produced, composed into the call's outcome once
    (SandboxKeeper.answer): its outcome, what is said before the outcome's own notices,
    and the end of code an earlier call left running."""

    outcome: ExecutionOutcome
    notices: list[str] = field(default_factory=list)
    earlier: ExecutionOutcome | None = None


def composed(reply: Reply, session: str) -> ExecutionOutcome:
    """A call's outcome from its turn's Reply, once: what is said before the outcome's own
    notices, and the end of earlier code, in the session that ran it."""
    earlier = None if reply.earlier is None else replace(reply.earlier, session=session)
    notices = [*reply.notices, *reply.outcome.notices]
    return replace(reply.outcome, notices=notices, earlier=earlier, session=session)


class RunningCode:
    """One execute running in the keeper's task group, so a call can answer "still running"
    after respond_after seconds and a later call can wait for the rest. Its own timeout
    still ends it; cancelling its scope stops the code (the client gave up)."""

    def __init__(self, sandbox: Sandbox, request: RunRequest, task_group: anyio.abc.TaskGroup) -> None:
        self.sandbox = sandbox
        self.request = request  # "still running after" counts from its arrival
        self.task_group = task_group  # the keeper's: the code and its questions run there
        self.pending = PendingExecute(secrets.token_hex(8), sandbox.config.max_output_chars)
        self.pending.server_log = request.server_log
        self.pending.asker = self._questions(request)
        self.scope = anyio.CancelScope()
        self.finished = anyio.Event()
        self.outcome: ExecutionOutcome | None = None
        self.failure: Exception | None = None
        self.shown = {"stdout": 0, "stderr": 0}  # characters already returned by "still running"
        self.asking: set[anyio.CancelScope] = set()  # the questions being sent (see ask_soon)
        self.task: McpTask | None = None  # when it went on as an MCP task: its end is the task's

    async def run(self) -> None:
        """Run the code (started with start_soon: a task group's start() costs a pass of the
        loop, and the waiting call needs nothing from the task first)."""
        request = self.request
        try:
            with self.scope:
                # Stopped before it began (the call cancelled in the same pass of the loop):
                # the code is never sent. Sending it takes no checkpoint of its own.
                await anyio.lowlevel.checkpoint_if_cancelled()
                try:
                    self.outcome = await self.sandbox.execute(
                        request.code,
                        request.timeout,
                        pending=self.pending,
                        saved_tools=request.saved_tools,
                    )
                except Exception as exc:  # re-raised to the call that waits for it
                    self.failure = exc
        finally:  # also when the whole task group is cancelled (shutdown): nobody waits forever
            self._end_questions()  # the code has ended: its questions are moot
            self.finished.set()

    def stop(self) -> None:
        """Stop the code (a reset, a cancelled call or task), and its questions at once: the
        user must not be asked about code that is being stopped."""
        self.scope.cancel()
        self._end_questions()

    def _end_questions(self) -> None:
        for scope in list(self.asking):  # each task removes its own scope as it ends
            scope.cancel()

    @property
    def _asks_no_more(self) -> bool:
        """The code has ended or is being stopped: no question of its is sent from now on."""
        return self.finished.is_set() or self.scope.cancel_called

    def ask_soon(self, ask: Callable[..., Awaitable[None]], *args: object) -> None:
        """Send a question of the code's (``ask(*args)``) in a task of the keeper's, which
        lasts as long as the code: one sent by a call that then answered "still running"
        can still be answered."""
        if not self._asks_no_more:
            self.task_group.start_soon(self._asked, ask, args)

    async def _asked(self, ask: Callable[..., Awaitable[None]], args: tuple[object, ...]) -> None:
        if self._asks_no_more:  # ended or stopped since it was started
            return
        with anyio.CancelScope() as scope:
            self.asking.add(scope)
            try:
                await ask(*args)
            finally:
                self.asking.discard(scope)

    async def wait(self, seconds: float, request: RunRequest) -> bool:
        """Whether the code ended within ``seconds`` (0: however long it takes); the
        waiting call's progress listener hears it meanwhile, and its client is the one
        asked for approvals from then on. A cancelled wait stops it."""
        self.pending.progress, self.pending.server_log = request.progress, request.server_log
        parked = self.pending.parked
        # An MCP task's questions go through the task (tasks/get), whoever else waits.
        asks = self.task is None
        if asks:
            self.pending.asker = self._questions(request)
        # The code's questions go to this call's user, each sent for as long as the code
        # runs; those it asks after this call ends wait for the next one.
        pump_questions = (
            partial(parked.pump, request.asker, self.ask_soon) if asks and request.asker is not None else None
        )
        try:
            # A task group only where questions are pumped: its end costs a pass of the loop.
            async with anyio.create_task_group() if pump_questions else nullcontext() as pump:
                if pump is not None and pump_questions is not None:
                    pump.start_soon(pump_questions)
                with anyio.move_on_after(seconds or math.inf):
                    if asks and request.round_trip:  # a question ends the wait: the call carries it
                        await _first_of(self.finished, parked.arrived)
                    else:
                        await self.finished.wait()
                if pump is not None:
                    pump.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            if self.task is None:  # the waiting call owns the code: it stops with it
                self.stop()
                with anyio.CancelScope(shield=True):
                    await self.finished.wait()
            raise
        finally:
            if not self.finished.is_set():
                self.pending.progress = None
        return self.finished.is_set()

    def _questions(self, request: RunRequest) -> UserQuestions | None:
        """How the code's questions reach the user from now on: parked for the calls that
        wait (this one first), or None when this call's client cannot ask its user."""
        can_ask = request.round_trip or request.asker is not None
        return ParkedQuestions(self.pending.parked) if can_ask else None

    def new_output(self) -> dict[str, str]:
        """What the code printed since the last "still running" answer."""
        text = {}
        for name in ("stdout", "stderr"):
            whole = "".join(self.pending.streams[name])
            text[name], self.shown[name] = whole[self.shown[name] :], len(whole)
        return text

    def rest(self, notices: list[str]) -> ExecutionOutcome:
        """The ended code's outcome less what "still running" answers showed, ``notices`` last."""
        assert self.outcome is not None
        outcome = self.outcome
        return replace(
            outcome,
            stdout=outcome.stdout[self.shown["stdout"] :],
            stderr=outcome.stderr[self.shown["stderr"] :],
            notices=[*outcome.notices, *notices],
        )

    def still_running(self, waited_for_earlier: bool, round_trip: bool = False) -> ExecutionOutcome:
        """The answer of a call that stops waiting before the code ends; ``round_trip``:
        its client speaks 2026-07-28, and the code's questions (if any) go in it instead,
        the output so far kept for a later answer."""
        elapsed = time.monotonic() - self.request.arrived
        # An MCP task's output and questions are the task's (tasks/get), not this call's.
        unsent = self.pending.parked.take_unsent() if round_trip and self.task is None else []
        quiet = unsent or self.task is not None
        output = self.new_output() if not quiet else {"stdout": "", "stderr": ""}
        detail = (
            "Still running after %.0fs (its timeout of %gs still applies). Call run_python again to wait "
            "for the rest of its output and its result (any code; it runs once this code has ended), "
            "or with reset: true to stop it." % (elapsed, self.request.timeout)
            if self.task is None
            else "Still running after %.0fs as MCP task %s, whose result comes with the task (its timeout "
            "of %gs still applies). Call run_python again to wait for its end, or with reset: true to stop "
            "it." % (elapsed, self.task.id, self.request.timeout)
        )
        if self.pending.awaiting:
            detail += " It is waiting for the user to approve %s." % ", ".join(self.pending.awaiting)
        if waited_for_earlier:
            detail = "Your code was not run: the code of an earlier call is still running. " + detail
        return ExecutionOutcome(
            status="running",
            stdout=output["stdout"],
            stderr=output["stderr"],
            detail=detail,
            duration=elapsed,
            questions=(self.pending.id, tuple(unsent)) if unsent else None,
        )

    def stopped_by_reset(self) -> str:
        """The notice for a reset that stops this code, which has not ended."""
        elapsed = time.monotonic() - self.request.arrived
        unseen = sum(len("".join(self.pending.streams[name])) - self.shown[name] for name in self.shown)
        lost = " Its output since the last answer (%d characters) was not shown." % unseen if unseen else ""
        return (
            "Reset stopped the code of an earlier call, still running after %.0fs; its result is gone.%s"
            % (elapsed, lost)
        )


TASK_POLL_MS = 1000  # how often a client polls a task (pollIntervalMs: a hint)
TASK_KEPT_AFTER_TIMEOUT = 3600.0  # a task is kept its code's timeout plus this long (ttlMs)
MAX_ENDED_TASKS_PER_PRINCIPAL = 16  # ended tasks kept per principal (the oldest ended go first)


class McpTask:
    """Code a run_python call left running as an MCP task (the Tasks extension, 2026-07-28):
    its client polls tasks/get for the call's result, answers the code's questions with
    tasks/update and may stop it with tasks/cancel. The code's end is the task's, never
    another call's "earlier" output, and it is set once: the first end (completed with the
    outcome, failed, or cancelled) stands. Kept by a TaskBoard until its ttl."""

    def __init__(
        self,
        keeper: SandboxKeeper,
        running: RunningCode,
        notices: list[str],
        earlier: ExecutionOutcome | None,
    ) -> None:
        self.id = secrets.token_urlsafe(18)  # unguessable, and asked for with its principal's too
        self.keeper = keeper
        self.running = running
        self.principal = running.request.principal.name
        self.client_name = running.request.client_name
        self.created = self.updated = datetime.now(UTC)
        self.ttl = running.request.timeout + TASK_KEPT_AFTER_TIMEOUT
        self.notices = notices  # what the call would have said before the code's outcome
        self.earlier = earlier  # the end of code an earlier call left running, if it collected one
        self.state: Literal["working", "completed", "failed", "cancelled"] = "working"
        self.outcome: ExecutionOutcome | None = None  # completed: the call's outcome, until rendered
        self.failure: Exception | None = None  # failed: what stopped it, when not the code itself
        self.reason = ""  # cancelled: why
        self.shown: dict[str, Any] | None = None  # the ended task as tasks/get shows it (task_detail)

    @property
    def ended(self) -> bool:
        return self.state != "working"

    def expired(self, now: datetime) -> bool:
        return now - self.created > timedelta(seconds=self.ttl)

    def end(
        self, outcome: ExecutionOutcome | None, failure: Exception | None = None, cancelled: str = ""
    ) -> None:
        """The task's end, unless it has one: ``cancelled`` (why), else the code's outcome
        (composed as the call's would be), else ``failure``, else stopped."""
        if self.ended:
            return
        if cancelled:
            self.state, self.reason = "cancelled", cancelled
        elif outcome is not None:
            self.state = "completed"
            self.outcome = composed(Reply(outcome, self.notices, self.earlier), self.keeper.name)
        elif failure is not None:
            self.state, self.failure = "failed", failure
        else:
            self.state, self.reason = "cancelled", "The code was stopped before it ended."
        self.updated = datetime.now(UTC)

    def status_message(self) -> str:
        """What a working task is doing, for tasks/get."""
        running = self.running
        elapsed = time.monotonic() - running.request.arrived
        lines = sum(
            chunk.count("\n") for name in ("stdout", "stderr") for chunk in running.pending.streams[name]
        )
        message = "Running for %.0fs (timeout %gs); %d line(s) of output so far." % (
            elapsed,
            running.request.timeout,
            lines,
        )
        if running.pending.awaiting:
            message += " Waiting for the user to approve %s." % ", ".join(running.pending.awaiting)
        return message


class TaskBoard:
    """The bridge's MCP tasks by id, for tasks/get, tasks/update and tasks/cancel: a task
    whose code runs is kept (its code is a call in flight, under that cap); an ended one
    until its ttl (its code's timeout plus an hour), and at most
    MAX_ENDED_TASKS_PER_PRINCIPAL ended ones per principal."""

    def __init__(self) -> None:
        self.tasks: dict[str, McpTask] = {}

    def add(self, task: McpTask) -> None:
        self._prune()
        self.tasks[task.id] = task

    def get(self, principal: str, task_id: str) -> McpTask:
        """``principal``'s task ``task_id``; InvalidRequestError when there is none (another
        principal's task is none of theirs)."""
        self._prune()
        task = self.tasks.get(task_id)
        if task is None or task.principal != principal:
            raise InvalidRequestError(
                "No task %s here: it ended more than its ttl ago, newer ended tasks took its place "
                "(%d are kept), the bridge restarted, or it was never this bridge's."
                % (ascii(task_id[:64]), MAX_ENDED_TASKS_PER_PRINCIPAL)
            )
        return task

    def _prune(self) -> None:
        now = datetime.now(UTC)
        ended: dict[str, list[McpTask]] = {}
        for task in list(self.tasks.values()):
            if not task.ended:
                continue  # its code runs (an approval may have paused its timeout past the ttl)
            if task.expired(now):
                del self.tasks[task.id]
            else:
                ended.setdefault(task.principal, []).append(task)
        for tasks in ended.values():
            tasks.sort(key=lambda task: task.updated)
            for task in tasks[: max(0, len(tasks) - MAX_ENDED_TASKS_PER_PRINCIPAL)]:
                del self.tasks[task.id]


NOT_RUN_WHILE_ASKING = (
    "Your code was not run: the code of an earlier call was still running, and what the user was "
    "asked came from it. Call run_python again to run yours."
)
BUSY = (
    "Your code was not run: other run_python calls are still using the sandbox (calls run one at a "
    "time). Call run_python again to wait for your turn."
)


class Closing:
    """Sandboxes' word that the bridge begins to stop, set once. A call waits for its turn's
    end or this, whichever comes first: this sets the event it waits on too (one event to
    wait on, where waiting for the first of two takes a task each)."""

    def __init__(self) -> None:
        self._set = False
        self._waiting: set[anyio.Event] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for event in self._waiting:
            event.set()

    @contextmanager
    def ends(self, event: anyio.Event) -> Iterator[None]:
        """While in the block, ``set()`` sets ``event`` too."""
        self._waiting.add(event)
        try:
            yield
        finally:
            self._waiting.discard(event)


class SandboxKeeper:
    """One sandbox of one principal (``Sandboxes`` holds them by principal and session name):
    serializes the calls to it, pre-warms it, replaces it after a crash, a kill, a reset or
    an idle stop, and tells the model whenever earlier state is gone. Its lifetime, caps and
    shutdown are Sandboxes'; ``closing`` is Sandboxes' event, set when the bridge stops."""

    def __init__(
        self,
        config: BridgeConfig,
        task_group: anyio.abc.TaskGroup,
        api: SandboxAPI,
        engine: SharedEngine,
        name: str,
        problems: ProblemLog,
        closing: Closing,
        board: TaskBoard,
    ) -> None:
        self.config = config
        self.task_group = task_group
        self.board = board  # where the MCP tasks of its calls are kept (Sandboxes')
        self.api = api
        self.name = name
        self.shared_engine = engine
        self.ipc_root = config.state_dir / "ipc"
        self.sandbox: Sandbox | None = None
        self.lost_reason: str | None = None
        self.last_used = time.monotonic()
        self._lock = anyio.Lock(fast_acquire=True)  # no pass of the loop when free: one less per call
        # Shared by the principal's sessions: a sandbox restarted again and again logs once.
        self.problems = problems
        self.closing = closing  # Sandboxes' event, set when the bridge begins to stop
        self.active_calls = 0
        # The last start failure for want of the image, and when it happened: explained in
        # full once, then answered at once, not retried (a pull that cannot work takes long
        # every time) until the image appears locally or START_RETRY_SECONDS pass.
        self.start_failure: tuple[str, float] | None = None
        self.running: RunningCode | None = None  # code an earlier call left running
        self.unreported: ExecutionOutcome | None = None  # its end, until a call returns it
        self.held_notices: list[str] = []  # what the pre-warm start has to say to the first call

    async def _ensure_sandbox(self) -> tuple[Sandbox, list[str]]:
        """The live sandbox, started when there is none, and what a start has to tell."""
        if self.sandbox is not None and not self.sandbox.alive:
            self.lost_reason = self.lost_reason or "the previous sandbox %s." % self.sandbox.death_reason
            await self.sandbox.stop()
            self.sandbox = None
        if self.sandbox is not None:
            return self.sandbox, []
        engine = await self.shared_engine.get()
        await self._check_earlier_start_failure(engine)
        sandbox = Sandbox(
            engine, self.config, self.ipc_root, self.api, problems=self.problems, session_name=self.name
        )
        try:
            await sandbox.start(self.task_group)
        except SandboxStartError as exc:
            missing = isinstance(exc, SandboxImageMissingError)  # other failures: retried at once
            self.start_failure = (str(exc), time.monotonic()) if missing else None
            raise
        self.start_failure = None
        if self.closing.is_set():  # the bridge began to close while it started: no one else removes it
            await sandbox.stop()
            raise ShuttingDownError(SHUTTING_DOWN)
        self.sandbox = sandbox
        notices = []
        if self.lost_reason:
            notices.append(
                "Started a fresh sandbox session: %s Variables, imports and functions from "
                "earlier calls are gone." % self.lost_reason
            )
            self.lost_reason = None
        notices.extend(engine.warnings)
        notices.extend(unusable_config_notices(self.api.pool.discovery))
        warning = workspace_warning(self.config)
        if warning:
            notices.append(warning)
        return sandbox, notices

    async def _check_earlier_start_failure(self, engine: ContainerEngine) -> None:
        if self.start_failure is None:
            return
        message, when = self.start_failure
        waited = time.monotonic() - when
        if waited >= START_RETRY_SECONDS or await engine.has_image(self.config.image):
            return  # worth another try
        raise SandboxImageMissingError(
            "The sandbox still cannot start (not retried: the image %s is not on this machine, and the "
            "last try failed %ds ago; the next try is at most %ds away). The first failure said: %s"
            % (self.config.image, waited, START_RETRY_SECONDS, message)
        )

    async def prewarm(self) -> None:
        async with self._lock:
            try:
                _, notices = await self._ensure_sandbox()
                self.held_notices.extend(notices)  # for the first call's result
            except ShuttingDownError:
                pass
            except BridgeError as exc:
                logger.warning("pre-warm failed (run_python will retry): %s", exc)
            except Exception:  # a background start-up step must never end the server
                logger.exception("pre-warm failed (run_python will retry)")

    async def answer(self, request: RunRequest) -> ExecutionOutcome:
        """run() for one tool call, answered with ShuttingDownError as soon as the bridge
        begins to shut down, so no call is left without a response. The work runs in
        the keeper's task group; cancelling the call (the client gave up) cancels it.
        The call's outcome is composed here, once, from what run() returned."""
        if self.closing.is_set():
            raise ShuttingDownError(SHUTTING_DOWN)
        self.active_calls += 1
        finished = anyio.Event()
        holder: list[Reply | Exception] = []
        work_scope = anyio.CancelScope()

        async def work() -> None:
            with work_scope:
                try:
                    holder.append(await self.take_turn(request))
                except Exception as exc:  # re-raised in the caller's task below
                    holder.append(exc)
            finished.set()

        try:
            with self.closing.ends(finished):
                self.task_group.start_soon(work)
                await finished.wait()
        except BaseException:
            work_scope.cancel()
            raise
        finally:
            self.active_calls -= 1
        if not holder:
            raise ShuttingDownError(SHUTTING_DOWN)
        if isinstance(holder[0], Exception):
            raise holder[0]
        return composed(holder[0], self.name)

    async def take_turn(self, request: RunRequest) -> Reply:
        # The client's clock runs from the call's arrival, also while it waits its turn.
        acquired = False
        with anyio.move_on_after(self._left(request) or math.inf):
            await self._lock.acquire()
            acquired = True
        if not acquired:
            busy = ExecutionOutcome(
                status="running", detail=BUSY, duration=time.monotonic() - request.arrived
            )
            return Reply(busy)
        try:
            return await self._take_turn_locked(request)
        finally:
            self._lock.release()

    def _left(self, request: RunRequest) -> float:
        """Seconds until ``request`` must answer (0: no limit)."""
        respond_after = respond_after_for(self.config, request.client_name)
        if not respond_after:
            return 0
        return max(0.01, request.arrived + respond_after - time.monotonic())

    async def _take_turn_locked(self, request: RunRequest) -> Reply:
        if self.closing.is_set():
            raise ShuttingDownError(SHUTTING_DOWN)
        if request.resume is not None:
            return await self._resume(request, request.resume)
        notices, self.held_notices = self.held_notices, []
        if self.running is not None and request.reset:  # a reset stops the earlier code too
            notices += await self._stop_for_reset(self.running)
        elif self.running is not None:
            if not await self.running.wait(self._left(request), request):
                waiting = self.running.still_running(waited_for_earlier=True, round_trip=request.round_trip)
                if waiting.questions is not None:  # said when the questions' retry ends
                    self.held_notices = [*notices, NOT_RUN_WHILE_ASKING]
                return Reply(waiting)
            earlier = self.running
            ended = await self._finish(earlier)
            if earlier.task is None:
                # Kept on the keeper until a call returns it: a failure of this call's own
                # code (a sandbox that cannot start) must not lose it.
                self.unreported = ended
                if ended is None:
                    notices.append(
                        "The code of an earlier call was stopped: the call waiting for it was cancelled."
                    )
        if request.reset and self.sandbox is not None:
            await self.sandbox.stop()
            self.sandbox = None
            notices.append("Reset: started a fresh session with an empty namespace.")
        elif request.reset:
            self.lost_reason = None
        sandbox, started = await self._ensure_sandbox()
        notices += started
        running = RunningCode(sandbox, request, self.task_group)
        self.running = running
        self.task_group.start_soon(running.run)
        if await running.wait(self._left(request), request):
            outcome = await self._finish(running)
            assert outcome is not None  # only a cancelled wait stops it, and that raised
        else:
            return self._went_on(running, request, notices)
        self.last_used = time.monotonic()
        return self._reply(outcome, notices)

    def _went_on(self, running: RunningCode, request: RunRequest, notices: list[str]) -> Reply:
        """The reply of a call whose code goes on after it answers: an MCP task, for a
        client of the Tasks extension (the output so far, the notices and the end of earlier
        code wait for the task's result), unless the code has questions to carry in an
        input_required result first; else "still running"."""
        self.last_used = time.monotonic()
        if request.as_task and not running.pending.parked.has_unsent():
            earlier, self.unreported = self.unreported, None
            running.task = task = McpTask(self, running, notices, earlier)
            self.board.add(task)  # now: a call cancelled before it answers leaves no orphan
            self.task_group.start_soon(self._end_task_when_done, task)
            return Reply(ExecutionOutcome(status="running", task=task))
        outcome = running.still_running(waited_for_earlier=False, round_trip=request.round_trip)
        return self._reply(outcome, notices)

    def _reply(self, outcome: ExecutionOutcome, notices: list[str]) -> Reply:
        """The call's reply; one that ends to ask (input_required) carries nothing else, so
        its notices and the end of earlier code wait for the call that goes on."""
        if outcome.questions is not None:
            self.held_notices = [*notices, *self.held_notices]
            return Reply(outcome)
        earlier, self.unreported = self.unreported, None
        return Reply(outcome, notices, earlier)

    async def _resume(self, request: RunRequest, resume: Resume) -> Reply:
        """A 2026-07-28 retry: its answers go to the questions of the code it was asked
        for, and the call goes on waiting for that code, as the call that started it."""
        running = self.running
        if running is None or running.pending.id != resume.execute:
            raise InvalidRequestError(
                "These answers came too late: the code they were asked for has ended (its questions "
                "were given up after MCP_BRIDGE_APPROVAL_TIMEOUT, or the session was reset). Call "
                "run_python again without them."
            )
        if running.task is not None:
            raise InvalidRequestError(
                "These answers are for code that goes on as MCP task %s: the client answers its questions "
                "through the task. Call run_python again without them." % running.task.id
            )
        running.pending.parked.deliver(resume.answers, resume.digests)
        notices, self.held_notices = self.held_notices, []
        if not await running.wait(self._left(request), request):
            return self._went_on(running, request, notices)
        outcome = await self._finish(running)
        assert outcome is not None  # only a cancelled wait stops it, and that raised
        self.last_used = time.monotonic()
        return self._reply(outcome, notices)

    async def _stop_for_reset(self, running: RunningCode) -> list[str]:
        """Stop the code an earlier call left running (its end kept when it had ended)."""
        self.running = None
        task = running.task
        if running.finished.is_set() and running.failure is None:
            ended = await self._finish(running)  # it ended before the reset
            if task is None:
                self.unreported = ended
            return []
        if running.finished.is_set():
            if task is not None:
                await self._finish(running)  # its failure is the task's (_finish never raises it)
            return ["The code of an earlier call could not finish: %s" % running.failure]
        if task is not None:
            task.end(None, cancelled="A reset of the session stopped the code before it ended.")
        notice = running.stopped_by_reset()
        running.stop()
        await running.finished.wait()
        if task is not None:
            await self._finish(running)
        return [notice]

    async def _finish(self, running: RunningCode) -> ExecutionOutcome | None:
        """The outcome of code that has ended (what a "still running" answer already
        showed left out), and the session replaced if it died; None when it was stopped
        (the call waiting for it was cancelled). Code that went on as an MCP task ends
        its task instead, whatever became of it (its outcome, its failure, or stopped), and
        None is returned: a task never stays "working" once its code is done."""
        if self.running is running:
            self.running = None
        task = running.task
        try:
            outcome = await self._ended_outcome(running)
        except Exception as exc:
            if task is None:
                raise
            task.end(None, exc)
            return None
        if task is None:
            return outcome
        task.end(outcome)
        return None

    async def _ended_outcome(self, running: RunningCode) -> ExecutionOutcome | None:
        """_finish's outcome: the code's failure raised, None when it was stopped."""
        if running.failure is not None:
            raise running.failure
        if running.outcome is None:
            return None
        outcome = running.rest(self.api.pool.drain_notices())
        sandbox = running.sandbox
        if not sandbox.alive:
            await sandbox.stop()
            if self.sandbox is sandbox:
                self.sandbox = None
            self.lost_reason = "the previous sandbox %s." % sandbox.death_reason
        self.last_used = time.monotonic()
        return outcome

    async def _end_task_when_done(self, task: McpTask) -> None:
        """Finish ``task``'s code as soon as it ends, so the task ends even if nobody polls
        it and the session is free again: here, at its turn at the session, unless a call
        that held the session first finished it (every call waits for this code first)."""
        running = task.running
        await running.finished.wait()
        async with self._lock:
            if self.running is running:
                await self._finish(running)

    def cancel_task(self, task: McpTask) -> None:
        """tasks/cancel: the task ends cancelled (unless it has ended) and its code is
        stopped; _end_task_when_done finishes it once stopped."""
        task.end(None, cancelled="tasks/cancel stopped the code before it ended.")
        task.running.stop()

    async def watch_idle(self) -> None:
        """Stop the sandbox after idle_timeout seconds without a call."""
        if self.config.idle_timeout <= 0:
            return
        while True:
            await anyio.sleep(min(self.config.idle_timeout, 30.0) / 2)
            busy = self.running is not None and not self.running.finished.is_set()
            if self.sandbox is None or self._lock.locked() or busy:
                continue  # in use: a call, or code an earlier call left running
            if time.monotonic() - self.last_used >= self.config.idle_timeout:
                async with self._lock:
                    idle = time.monotonic() - self.last_used >= self.config.idle_timeout
                    if self.sandbox is not None and idle:  # a call may have slipped in meanwhile
                        logger.info("stopping idle sandbox %s (session %s)", self.sandbox.name, self.name)
                        await self.sandbox.stop()
                        self.sandbox = None
                        self.lost_reason = "the previous sandbox was shut down after %gs without a call." % (
                            self.config.idle_timeout
                        )

    @property
    def running_unattended(self) -> bool:
        """Code an earlier call left running ("still running") that no call waits for now."""
        return self.running is not None and not self.running.finished.is_set() and not self.active_calls

    @property
    def dormant(self) -> bool:
        """No sandbox, no call, no code left running and nothing unreported: forgetting
        this keeper loses nothing but its name (and why its last sandbox ended)."""
        return (
            self.sandbox is None
            and self.running is None
            and self.unreported is None
            and not self.active_calls
            and not self._lock.locked()
        )

    async def aclose(self) -> None:
        """Remove this session's sandbox (the shared engine is Sandboxes' to release)."""
        with anyio.CancelScope(shield=True):
            if self.sandbox is not None:
                await self.sandbox.stop()
                self.sandbox = None


# run_python's session names: short, and safe in logs, labels and file names as they are.
# Lower case only, so one sandbox has one spelling ("A" is refused, not taken for "a").
SESSION_NAME_PATTERN = re.compile(r"[a-z0-9_-]{1,32}")
SESSION_NAME_RULE = "1-32 characters of a-z, 0-9, _ and -"


def valid_session_name(name: str) -> str:
    """``name`` if it is a valid session name; else ValueError saying the rule."""
    if not SESSION_NAME_PATTERN.fullmatch(name):
        raise ValueError("a session name is %s, not %s" % (SESSION_NAME_RULE, ascii(name[:40])))
    return name


MAX_REMEMBERED_ENDS = 64  # per principal: forgotten sessions whose "why your state is gone" is kept


class Sandboxes:
    """Every sandbox of the bridge, by principal and run_python's ``session`` ("default"
    when a call names none): one SandboxKeeper each, created on first use. The one owner
    of their lifetimes: the caps (MCP_BRIDGE_MAX_SESSIONS per principal; with ``shared``,
    i.e. over HTTP, MCP_BRIDGE_MAX_TOTAL_SESSIONS in all and MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL
    calls in flight), idle forgetting, the shutdown fan-out and the shared engine's release.
    Each session has its own sandbox, state, limits (the configured ones) and idle timer;
    calls to different sessions run side by side, calls to one session one at a time (its
    keeper's lock). A session stopped for idleness keeps its name (its next call starts
    fresh and says why) until room is needed for a new name: then it is forgotten, and only
    why its last sandbox ended is remembered (for a bounded number of names)."""

    def __init__(
        self,
        config: BridgeConfig,
        task_group: anyio.abc.TaskGroup,
        engine: SharedEngine,
        shared: bool = False,
    ) -> None:
        self.config = config
        self.task_group = task_group
        self.engine = engine
        self.shared = shared
        self.keepers: dict[tuple[str, str], SandboxKeeper] = {}  # (principal, session name)
        self.watchers: dict[tuple[str, str], anyio.CancelScope] = {}
        self.ended: dict[str, dict[str, str]] = {}  # principal -> forgotten name -> why its sandbox ended
        self.problems: dict[str, ProblemLog] = {}  # per principal
        self.calls: dict[str, int] = {}  # principal -> run_python calls in flight
        self.tasks = TaskBoard()  # the MCP tasks of every session's calls
        self.closing = Closing()  # set when the bridge begins to shut down
        self._no_calls = anyio.Event()  # set while no call is in flight
        self._no_calls.set()

    def of(self, principal: str) -> dict[str, SandboxKeeper]:
        """The sessions of ``principal`` by name."""
        return {name: keeper for (owner, name), keeper in self.keepers.items() if owner == principal}

    def keeper(self, principal: Principal, name: str) -> SandboxKeeper:
        """The keeper of ``principal``'s session ``name``, created when new and there is room."""
        # Defense in depth: the input model checks names too; they reach logs and the kernel.
        try:
            valid_session_name(name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if self.closing.is_set():
            raise ShuttingDownError(SHUTTING_DOWN)
        key = (principal.name, name)
        found = self.keepers.get(key)
        if found is not None:
            return found
        self._make_room(principal.name, name)
        problems = self.problems.setdefault(principal.name, ProblemLog())
        keeper = SandboxKeeper(
            self.config, self.task_group, principal.api, self.engine, name, problems, self.closing, self.tasks
        )
        keeper.lost_reason = self.ended.get(principal.name, {}).pop(name, None)
        self.keepers[key] = keeper
        self.watchers[key] = scope = anyio.CancelScope()
        self.task_group.start_soon(self._watch, keeper, scope)
        return keeper

    def _make_room(self, principal: str, name: str) -> None:
        """Refuse a new session while the caps are reached (sessions stopped for idleness
        are forgotten first): all principals' together (shared), then the principal's own."""
        if self.shared and len(self.keepers) >= self.config.max_total_sessions:
            self.forget_dormant()
        if self.shared and len(self.keepers) >= self.config.max_total_sessions:
            # Says nothing of other principals' sessions: their names are theirs.
            raise TooManySessionsError(
                "Session %r was not started: the bridge already holds %d sessions for all its clients "
                "together, the most it allows (MCP_BRIDGE_MAX_TOTAL_SESSIONS). Use a session you have; "
                "room frees up as sessions stay idle for MCP_BRIDGE_IDLE_TIMEOUT seconds."
                % (name, len(self.keepers))
            )
        if len(self.of(principal)) >= self.config.max_sessions:
            self.forget_dormant(principal)
        mine = self.of(principal)
        if len(mine) >= self.config.max_sessions:
            raise TooManySessionsError(
                "Session %r was not started: %d sessions (%s) already hold sandboxes, the most this "
                "bridge allows (MCP_BRIDGE_MAX_SESSIONS). Use one of them, or free one: a session is "
                "released when it has been idle for MCP_BRIDGE_IDLE_TIMEOUT seconds."
                % (name, len(mine), ", ".join(sorted(mine)))
            )

    def forget_dormant(self, principal: str | None = None) -> None:
        """Forget the dormant sessions (of ``principal``; None: of everyone)."""
        for (owner, name), keeper in list(self.keepers.items()):
            if keeper.dormant and principal in (None, owner):
                del self.keepers[owner, name]
                self.watchers.pop((owner, name)).cancel()
                if keeper.lost_reason:
                    ended = self.ended.setdefault(owner, {})
                    ended[name] = keeper.lost_reason
                    while len(ended) > MAX_REMEMBERED_ENDS:
                        del ended[next(iter(ended))]  # the oldest

    @staticmethod
    async def _watch(keeper: SandboxKeeper, scope: anyio.CancelScope) -> None:
        with scope:
            await keeper.watch_idle()

    async def run(self, request: RunRequest) -> ExecutionOutcome:
        """One tool call, run by the session it names (see SandboxKeeper.answer)."""
        principal = request.principal.name
        if self.shared:
            self._check_calls(request)
        keeper = self.keeper(request.principal, request.session_name)
        if not self.calls:
            self._no_calls = anyio.Event()
        self.calls[principal] = self.calls.get(principal, 0) + 1
        try:
            return await keeper.answer(request)
        finally:
            self.calls[principal] -= 1
            if not self.calls[principal]:
                del self.calls[principal]
            if not self.calls:
                self._no_calls.set()

    def _check_calls(self, request: RunRequest) -> None:
        """Refuse a call of a principal with MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL in flight.
        Code left running after a "still running" answer counts as a call in flight:
        otherwise one principal could keep every session busy with no call open. A call
        to such a session takes its place (it waits for that code first)."""
        mine = self.of(request.principal.name)
        running = [name for name, keeper in mine.items() if keeper.running_unattended]
        in_flight = self.calls.get(request.principal.name, 0) + len(running)
        if request.session_name in running or in_flight < self.config.max_calls_per_principal:
            return
        raise TooManyCallsError(
            "Your code was not run: %d run_python calls of yours are already in flight%s, the most "
            "this bridge allows at once (MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL). Wait for one to "
            "finish, then call again%s."
            % (
                in_flight,
                " or still running code (sessions %s)" % ", ".join(sorted(running)) if running else "",
                "; call one of those sessions to wait for its result, or with reset: true to stop it"
                if running
                else "",
            )
        )

    def health(self) -> dict[str, Any]:
        """What /health tells anyone who asks: counts only, never a principal's name."""
        holding = [owner for (owner, _), keeper in self.keepers.items() if keeper.sandbox is not None]
        return {"status": "ok", "principals": len(set(holding)), "sessions": len(holding)}

    async def prewarm(self, principal: Principal) -> None:
        """Start ``principal``'s default sandbox; named ones start on first use."""
        await self.keeper(principal, DEFAULT_SESSION).prewarm()

    async def begin_shutdown(self, grace: float) -> None:
        """Answer every call in flight (the running code is abandoned, the containers
        removed afterwards by aclose()); waits at most ``grace`` seconds for that."""
        self.closing.set()
        for keeper in list(self.keepers.values()):
            if keeper.sandbox is not None:
                keeper.sandbox.abandon("was stopped because the MCP server is shutting down")
        with anyio.move_on_after(grace):
            await self._no_calls.wait()

    async def aclose(self) -> None:
        """Remove every session's sandbox, side by side, then release the engine."""
        self.closing.set()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for keeper in list(self.keepers.values()):
                    group.start_soon(keeper.aclose)
            await self.engine.release()


async def report_progress(execute: PendingExecute | None, params: Mapping[str, object]) -> None:
    """runtime.progress() (a PROGRESS request): heard by the progress listener of the call
    waiting for ``execute``, if that call's client asked. The request is about the asking
    sandbox's own call, so its sandbox session answers it, not the SandboxAPI that all the
    sandboxes of a principal share."""
    arguments = parse_params(mcp_sandbox_kernel.PROGRESS, ProgressParams, params)
    if execute is not None and execute.progress is not None:
        await execute.progress.from_code(arguments.done, arguments.total, arguments.message)


# =============================================================================
# rendering
# =============================================================================


# --- the output budget -------------------------------------------------------------
# One budget (MCP_BRIDGE_MAX_OUTPUT characters) for the text of a result, shared by
# stdout, stderr, the traceback and the value: each gets a fair share, a part that needs
# less leaves the rest to the others, and a part longer than its share keeps its head and
# its tail around one cut marker (the kernel's, so every cut reads the same). Streams cut
# this way were saved whole in the sandbox; the marker names the file.

PART_LABELS = {"stdout": "stdout", "stderr": "stderr", "traceback": "the traceback", "value": "the value"}


# Whatever the kernel says (its result frame is the sandbox's word, and code may patch the
# kernel), the notices and the error message take at most these shares of the budget, and
# what they take is left out of the budget of the rest: the whole result stays within it.
NOTICES_SHARE = 4  # notices: at most a quarter of the budget
ERROR_MESSAGE_SHARE = 10  # the error's message (its traceback says it too): a tenth
MAX_VALUE_JSON_DEPTH = 64  # as the kernel's plain_json: deeper data is shown as its repr


@dataclass
class FittedOutput:
    text: dict[str, str]  # part -> what the result shows of it
    cut: dict[str, dict[str, Any]]  # part -> {"characters": cut, "file": the whole, if saved}
    notices: list[str] = field(default_factory=list)  # the notices as the result shows them
    error: dict[str, str] | None = None  # type, message (fitted) and traceback (fitted)
    value_json: bool = False  # whether the value is shown as JSON data (it fits what is left)


def shown_error(outcome: ExecutionOutcome) -> str:
    """The error text a result shows: the traceback of code that failed or timed out."""
    if not outcome.error or outcome.status not in ("error", "timeout"):
        return ""
    return outcome.error.get("traceback") or "%s: %s" % (outcome.error["type"], outcome.error["message"])


def shares(sizes: dict[str, int], budget: int) -> dict[str, int]:
    """How many characters each part keeps: the budget split evenly, smallest first, so
    what a small part does not use goes to the bigger ones."""
    keep: dict[str, int] = {}
    left = budget
    for done, name in enumerate(sorted(sizes, key=sizes.__getitem__)):
        keep[name] = min(sizes[name], left // (len(sizes) - done))
        left -= keep[name]
    return keep


def fit_notices(notices: Sequence[str], room: int) -> list[str]:
    """The notices in order while they fit ``room`` characters; the one that crosses it
    keeps its head and a marker, and a last line counts those left out."""
    kept: list[str] = []
    for number, notice in enumerate(notices):
        if len(notice) <= room:
            kept.append(notice)
            room -= len(notice) + 1
            continue
        marker = mcp_sandbox_kernel.cut_marker(len(notice) - max(room, 0), "a notice", room)
        partly = room > len(marker) + 10
        if partly:
            kept.append(notice[: room - len(marker) - 1] + " " + marker)
        left = len(notices) - number - partly
        if left:
            kept.append("(%d more notice(s) left out: over the output budget)" % left)
        break
    return kept


def json_fits(value: object, room: int) -> bool:
    """Whether ``value`` (decoded JSON) is at most MAX_VALUE_JSON_DEPTH deep and its JSON
    text at most ``room`` characters; walked without recursion, stopping once it is over."""
    size, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_VALUE_JSON_DEPTH or size > room:
            return False
        if isinstance(item, dict):
            size += 2 + 2 * len(item)
            for key, child in item.items():
                size += len(key) + 2
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            size += 2 + len(item)
            stack.extend((child, depth + 1) for child in item)
        else:
            size += len(item) + 2 if isinstance(item, str) else 8
    return size <= room and len(json.dumps(value, ensure_ascii=False)) <= room


def fit_error(error: Mapping[str, Any] | None, budget: int) -> dict[str, str] | None:
    """The error's type and message, the message cut to its share (the traceback is fitted
    with the other parts); fields the kernel should not send are left out."""
    if error is None:
        return None
    message, room = str(error.get("message", "")), budget // ERROR_MESSAGE_SHARE
    if len(message) > room:
        marker = mcp_sandbox_kernel.cut_marker(len(message) - room, "the message", budget)
        message = message[: max(room - len(marker) - 1, 0)] + " " + marker
    fitted = {"type": str(error.get("type", ""))[: mcp_sandbox_kernel.MAX_NAME_CHARS], "message": message}
    traceback = error.get("traceback")
    if isinstance(traceback, str):  # shown when the status shows no traceback (fit_output)
        if len(traceback) > room:
            marker = mcp_sandbox_kernel.cut_marker(len(traceback) - room, "the traceback", budget)
            traceback = marker + "\n" + traceback[len(traceback) - room :]
        fitted["traceback"] = traceback
    return fitted


def _fit_parts(
    fitted: FittedOutput,
    parts: dict[str, str],
    cuts: Mapping[str, OutputCut],
    budget: int,
    whole: int,
    why: str,
) -> None:
    """Each part's share of ``budget`` in ``fitted``: its head and tail around one marker
    where it is over its share or was cut already (``whole``: the budget the markers name)."""
    known = {name: cuts.get(name) or OutputCut() for name in parts}
    keep = shares({name: len(parts[name]) + len(known[name].tail) for name in parts}, budget)
    for name, head in parts.items():
        cut = known[name]
        shown_head, count, shown_tail = keep_ends(head, cut.count, cut.tail, keep[name])
        if not count:
            fitted.text[name] = shown_head
            continue
        marker = mcp_sandbox_kernel.cut_marker(count, PART_LABELS[name], whole, cut.file, why)
        newline = "\n" if shown_head and not shown_head.endswith("\n") else ""
        fitted.text[name] = shown_head + newline + marker + "\n" + shown_tail
        fitted.cut[name] = {"characters": count, **({"file": cut.file} if cut.file else {})}


def fit_output(outcome: ExecutionOutcome, budget: int, why: str = "MCP_BRIDGE_MAX_OUTPUT") -> FittedOutput:
    """``outcome``'s text within ``budget`` characters (``why``: what sets it, for the marker)."""
    notices = fit_notices(outcome.notices, budget // NOTICES_SHARE)
    error = fit_error(outcome.error, budget)
    whole = budget  # what the markers name
    budget -= sum(len(notice) + 1 for notice in notices) + len(error["message"] if error else "")
    budget = max(budget, 0)
    parts = {
        "stdout": outcome.stdout,
        "stderr": outcome.stderr,
        "traceback": shown_error(outcome),
        "value": outcome.value or "",
    }
    fitted = FittedOutput(text={}, cut={}, notices=notices, error=error)
    if not outcome.cuts and sum(len(text) for text in parts.values()) <= budget:
        fitted.text = parts  # it all fits: shares() and keep_ends() would keep each part whole
    else:
        _fit_parts(fitted, parts, outcome.cuts, budget, whole, why)
    if outcome.value_json is not None and "value" not in fitted.cut:
        # The JSON stands in for the value's repr: it gets what the other parts left.
        room = budget - sum(len(text) for name, text in fitted.text.items() if name != "value")
        fitted.value_json = json_fits(outcome.value_json, room)
    if error is not None and fitted.error is not None:
        fitted.error["traceback"] = fitted.text["traceback"] or error.get("traceback", "")
    return fitted


def keep_ends(head: str, missing: int, tail: str, keep: int) -> tuple[str, int, str]:
    """(head shown, characters cut, tail shown) of a text known as its head, ``missing``
    characters, and its tail, showing at most ``keep`` characters: half each end."""
    if not missing:  # nothing lies between head and tail: one text, cut anywhere
        whole = head + tail
        if len(whole) <= keep:
            return whole, 0, ""
        return whole[: keep - keep // 2], len(whole) - keep, whole[len(whole) - keep // 2 :]
    tail_keep = min(len(tail), keep // 2)
    head_keep = min(len(head), keep - tail_keep)
    tail_keep = min(len(tail), keep - head_keep)  # a short head leaves more to the tail
    cut = missing + len(head) - head_keep + len(tail) - tail_keep
    return head[:head_keep], cut, tail[len(tail) - tail_keep :]


def structured_result(outcome: ExecutionOutcome, fitted: FittedOutput) -> dict[str, Any]:
    """The result as data (structuredContent, and TOON mode's text): only what this call
    has (no empty fields), and the final value as JSON data when it is plain JSON within
    the budget (else its repr, as ``value_repr``)."""
    data: dict[str, Any] = {"status": outcome.status}
    for name in ("stdout", "stderr"):
        if fitted.text[name]:
            data[name] = fitted.text[name]
    if fitted.value_json:
        data["value"] = outcome.value_json
    elif outcome.value is not None:
        data["value_repr"] = fitted.text["value"]
    if fitted.error is not None:
        data["error"] = fitted.error
    if fitted.cut:
        data["truncated"] = fitted.cut
    if not outcome.state_kept:
        data["state_kept"] = False
    if outcome.detail:
        data["detail"] = outcome.detail
    if fitted.notices:
        data["notices"] = fitted.notices
    if outcome.session != DEFAULT_SESSION:  # a trivial result stays small
        data["session"] = outcome.session
    data["duration_seconds"] = round(outcome.duration, 3)
    return data


# The tags the bridge's own lines start with. A line of the code's output that starts the
# same way is shown with a backslash in front ("\[session] ..."), so nothing the code
# prints reads as the bridge's word; structuredContent keeps the output as it was.
BRIDGE_TAGS = "session|stderr|earlier call, now finished|ok|error|timeout|crashed|running"  # and the statuses
_BRIDGE_TAG_LINE = re.compile(r"^(?=\[(?:%s)\])" % BRIDGE_TAGS, re.MULTILINE)


def escape_bridge_tags(text: str) -> str:
    """``text`` (the code's output) cleaned first, so that no control character it drops
    can join or start a line after the escape was decided."""
    text = clean_text(text)
    # A replacement given as a template string ("\\") is parsed in Python at every call.
    return _BRIDGE_TAG_LINE.sub(_backslash, text) if "[" in text else text


def _backslash(_: re.Match[str]) -> str:
    return "\\"


def render_blocks(outcome: ExecutionOutcome, fitted: FittedOutput) -> list[str]:
    """The result text as content blocks: the bridge's notices, the code's own output
    (stdout, stderr, traceback, value), and the bridge's status line. Kept apart so
    nothing the code prints can pass for a message from the bridge."""
    shown = {name: escape_bridge_tags(text) for name, text in fitted.text.items()}
    output = [
        {"stdout": text.rstrip("\n"), "stderr": "[stderr]\n" + text.rstrip("\n")}.get(name, text)
        for name, text in shown.items()
        if text and name != "value"
    ]
    if outcome.value is not None:
        output.append(shown["value"])
    blocks = [
        "\n".join("[session] " + notice for notice in fitted.notices),
        "\n".join(output),
        "[%s] %s" % (outcome.status, outcome.detail) if outcome.detail else "",
    ]
    return [block for block in blocks if block] or (
        [] if outcome.images or outcome.attachments else ["(no output)"]
    )


def render_compact(outcome: ExecutionOutcome, config: BridgeConfig) -> str:
    return "\n".join(render_blocks(outcome, fit_output(outcome, config.max_output_chars)))


def render_toon(outcome: ExecutionOutcome, fitted: FittedOutput) -> str:
    import toon_format  # the TOON response format only

    return str(toon_format.encode(structured_result(outcome, fitted)))


def clean_attachment(attachment: types.EmbeddedResource) -> types.EmbeddedResource:
    """An attached file as a client may show it: control characters in its URI
    percent-encoded, its mime type cleaned; text holding control characters goes as
    base64 instead, so the file stays byte for byte and no terminal acts on it."""
    contents = attachment.resource
    uri = escape_controls(str(contents.uri), urllib.parse.quote)
    kind = clean_text(contents.mime_type) if contents.mime_type is not None else None
    if isinstance(contents, types.TextResourceContents) and _CONTROL_CHAR.search(contents.text):
        blob = base64.b64encode(contents.text.encode("utf-8")).decode("ascii")
        return types.EmbeddedResource(resource=types.BlobResourceContents(uri=uri, mime_type=kind, blob=blob))
    return types.EmbeddedResource(resource=contents.model_copy(update={"uri": uri, "mime_type": kind}))


def clean_strings(value: Any) -> Any:
    """``value`` (JSON-like data) with clean_text applied to every string in it."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [clean_strings(item) for item in value]
    if isinstance(value, dict):
        return {clean_strings(key): clean_strings(item) for key, item in value.items()}
    return value


def tool_result(
    blocks: list[str],
    structured: dict[str, Any] | None,
    is_error: bool,
    images: Sequence[tuple[str, str]] = (),
    attachments: Sequence[types.EmbeddedResource] = (),
) -> types.CallToolResult:
    """The one place a run_python result is built: every string in it goes through
    clean_text; images (mime type, base64), then attached files, follow the text."""
    content: list[types.ContentBlock] = [types.TextContent(text=clean_text(block)) for block in blocks]
    content += [types.ImageContent(data=data, mime_type=mime_type) for mime_type, data in images]
    content += [clean_attachment(attachment) for attachment in attachments]  # kept byte for byte
    structured = clean_strings(structured)
    return types.CallToolResult(content=content, structured_content=structured, is_error=is_error)


# --- results over HTTP ----------------------------------------------------------------
# The SDK's own streamable HTTP client reads a result as one server-sent event and gives
# up on an event over 1 MiB ("Server-sent event exceeded the 1048576 byte limit"), after
# the code has run; other clients built on such readers do the same. Over HTTP a result's
# JSON is kept under this (the margin holds the JSON-RPC envelope and the notes): images
# and files that would pass it are left out, each with a note naming where it stays.
HTTP_MAX_RESULT_BYTES = 1024 * 1024 - 64 * 1024


def _json_size(item: BaseModel) -> int:
    return len(item.model_dump_json(by_alias=True, exclude_none=True))


def keep_within(parts: Sequence[ExecutionOutcome], config: BridgeConfig, limit: int) -> None:
    """Leave out of ``parts`` the images and files (in order, the later ones first to go)
    that would take the rendered result over ``limit`` bytes of JSON, each with a notice."""
    bare = [replace(part, images=[], attachments=[], earlier=None) for part in parts]
    if len(bare) == 2:
        bare[1].earlier = bare[0]
    used = _json_size(_render(bare, config)) + 2048  # the notes this may add
    for part in parts:
        kept_images: list[tuple[str, str]] = []
        for number, (mime_type, data) in enumerate(part.images, 1):
            size = len(data) + len(mime_type) + 64
            if used + size <= limit:
                kept_images.append((mime_type, data))
                used += size
            else:
                part.notices.append(
                    "Image %d (%d bytes of base64) was left out: over HTTP a result is kept under %d bytes, "
                    "what common clients accept. Show a smaller image (fewer pixels, a lower dpi), or fewer "
                    "per call." % (number, len(data), limit)
                )
        kept_files: list[types.EmbeddedResource] = []
        for number, attachment in enumerate(part.attachments, 1):
            size = _json_size(attachment)
            if used + size <= limit:
                kept_files.append(attachment)
                used += size
                continue
            uri = str(attachment.resource.uri)
            where = urllib.parse.unquote(uri[len("file://") :]) if uri.startswith("file://") else uri
            part.notices.append(
                "File %d (%s, %d bytes as sent) was left out: too large for this transport (over HTTP a "
                "result is kept under %d bytes, what common clients accept). It stays in the sandbox at %s: "
                "read or send a part of it, or compress it." % (number, where, size, limit, where)
            )
        part.images, part.attachments = kept_images, kept_files


def render_outcome(
    outcome: ExecutionOutcome,
    config: BridgeConfig,
    max_result_bytes: int | None = None,
    client: ClientProfile = DEFAULT_CLIENT,
) -> types.CallToolResult:
    """The result for ``client`` (see ClientProfile); ``max_result_bytes``: the most the
    result's JSON may take (over HTTP, see keep_within)."""
    parts = [outcome] if outcome.earlier is None else [outcome.earlier, outcome]
    why = "MCP_BRIDGE_MAX_OUTPUT"
    if client.max_output_chars is not None and client.max_output_chars < config.max_output_chars:
        config = replace(config, max_output_chars=client.max_output_chars)
        why = "the most this client shows whole"
    if max_result_bytes is None:
        return _render(parts, config, client, why)
    if any(part.images or part.attachments for part in parts):
        keep_within(parts, config, max_result_bytes)
    result = _render(parts, config, client, why)
    for _ in range(3):  # the text alone is over only with a large MCP_BRIDGE_MAX_OUTPUT
        size = _json_size(result)
        if size <= max_result_bytes:
            break
        smaller = max(1000, config.max_output_chars * max_result_bytes // size // 2)
        config = replace(config, max_output_chars=smaller)
        result = _render(parts, config, client, why)
    return result


def _render(
    parts: Sequence[ExecutionOutcome],
    config: BridgeConfig,
    client: ClientProfile = DEFAULT_CLIENT,
    why: str = "MCP_BRIDGE_MAX_OUTPUT",
) -> types.CallToolResult:
    outcome = parts[-1]
    fitted = [fit_output(part, config.max_output_chars // len(parts), why) for part in parts]  # one budget
    blocks = []
    for part, fit in zip(parts, fitted, strict=True):
        text = [render_toon(part, fit)] if config.output_mode == "toon" else render_blocks(part, fit)
        if part is outcome.earlier:  # the end of the code an earlier call left running
            text = ["[earlier call, now finished]", *text]
        blocks += text
    images = [image for part in parts for image in part.images]
    attachments = [attachment for part in parts for attachment in part.attachments]
    # A client that reads structuredContent instead of content when both are there would
    # drop images and files: a result with either has none (nor has one for a client
    # that shows the model only that JSON: see ClientProfile).
    structured = None
    if client.structured and not images and not attachments:
        structured = structured_result(outcome, fitted[-1])
        if outcome.earlier is not None:
            structured["earlier"] = structured_result(outcome.earlier, fitted[0])
    if client.attached_images:
        images += [image for attachment in attachments if (image := attached_image(attachment))]
        attachments = [attachment for attachment in attachments if not attached_image(attachment)]
    # "running" is no error: the model calls again to wait for the rest.
    failed = outcome.status not in ("ok", "running")
    if failed and images and not client.error_images:
        failed = False  # its text says it failed; the flag would cost the model the images
    return tool_result(blocks, structured, failed, images, attachments)


def attached_image(attachment: types.EmbeddedResource) -> tuple[str, str] | None:
    """An attached file that is an image a model can see, as (mime type, base64 data)."""
    resource = attachment.resource
    mime_type = resource.mime_type or ""
    if isinstance(resource, types.BlobResourceContents) and mime_type in IMAGE_TYPES:
        return mime_type, resource.blob
    return None


def render_error(exc: BridgeError) -> types.CallToolResult:
    return tool_result([str(exc)], None, is_error=True)


# =============================================================================
# MCP server & tool
# =============================================================================

TOOL_NAME = "run_python"
CAPABILITIES_URI = "resource://code-execution/capabilities"
# Found by a deferred-tool search (Claude Code 2.1.3xx shows the model only the name until
# it searches) for "run Python", "compute", "analyse data", "call my MCP tools from code".
TOOL_DESCRIPTION = (
    "Run Python code to compute, analyse data or call your MCP tools as functions (persistent, "
    "network-less sandbox; last expression shown): runtime.search_tool_docs('task'), then "
    "mcp_<server>.<tool>(arg=...). Manual: " + CAPABILITIES_URI
)
TOOL_TITLE = "Run Python"
TOOL_LIST_TTL_MS = 24 * 3600 * 1000  # the tool never changes while the bridge runs

CAPABILITIES_MANUAL = """\
# run_python sandbox manual

run_python(code, timeout=None, reset=False, session="default") runs `code` in ONE long-lived Python process
inside a container. State (variables, imports, functions) persists between calls until
`reset: true`, an idle shutdown, a timeout that had to kill the sandbox, or a crash; the
result says so whenever earlier state is gone.

- Like a REPL: the value of a final expression is shown; `_` holds the last value.
- Top-level `await` works (one event loop persists across calls).
- stdout/stderr are captured (subprocesses too) and capped per call with a marker.
- A timeout raises KeyboardInterrupt in the code and keeps the session; code that
  ignores it is killed and the session restarts empty.
- Writable: /workspace (working directory) and /tmp, in memory; reset empties them. No network.
- `session`: each name (1-32 of a-z 0-9 _ -) is a separate sandbox with its own state;
  calls to different sessions run at the same time. `runtime.session` is its name.

## Your MCP servers, as Python
Each configured server is an object `mcp_<alias>` (also `from mcp.servers import <alias>`);
its tools are methods taking keyword arguments. Nothing is loaded until you ask:

    from mcp import runtime
    runtime.list_servers()                      # aliases
    runtime.search_tool_docs("read a file")     # best matches across ALL servers, one line each
    runtime.query_tool_docs("github")           # signatures; detail="full" adds schemas
    help(mcp_github.create_issue)               # one tool's signature and description
    mcp_github.create_issue(owner="o", repo="r", title="t")   # returns the value, in any code
    await asyncio.gather(mcp_a.x(), mcp_b.y())  # calls inside await/gather run at the same time

Results are plain Python: structured content, else parsed JSON text, else text; images
are runtime.ToolImage(data, mime_type); raw=True returns the whole MCP result. A failing
tool raises runtime.MCPToolError (a runtime.MCPError); wrap calls in try/except.
APPROVALS_LINE
runtime.list_resources(alias), read_resource(alias, uri), list_prompts(alias) and
get_prompt(alias, name, {"arg": "value"}) read the rest of what a server offers.
runtime.discovered_servers(detailed=True) shows where each server came from and any
configuration problems; runtime.capability_summary() is a short overview.

## Memory and saved tools (kept on the host, across sessions and bridges)

    save_memory("project", {"name": "x"}, metadata={"about": "..."})   # JSON values
    load_memory("project", default=None); list_memories(); delete_memory("project")
    update_memory("counter", lambda v: (v or 0) + 1)   # atomic, even with other bridges
    save_tool(my_function)   # a top-level def; defined in every future session
    list_saved_tools(); delete_tool("my_function")

A saved tool that ends or hangs the Python process while being defined is skipped, and kept
out of new sessions until its file changes. run_python(..., reset=true, saved_tools=false)
starts a fresh namespace without any saved tool.

## Images, files, progress

    plt.show()  /  display(obj)  /  runtime.show_image(bytes_or_path)   # images after the text
    runtime.attach("/workspace/out.csv")        # the file itself, to the client
    runtime.progress(3, 10, "step 3")           # a progress notification, if the client asked

Saved tools are already defined when a session starts; list_saved_tools() names them.
Like tool calls, these return their value, and can be awaited or gathered.
"""


APPROVALS_LINE = "APPROVALS_LINE"  # where approvals_manual_line goes
# The manual's line on files, as it reads with MCP_BRIDGE_WORKSPACE set (":ro" or not).
MANUAL_WRITABLE_LINE = "- Writable: /workspace (working directory) and /tmp, in memory; reset empties them."
MANUAL_WORKSPACE_LINES = {
    False: "- Writable: /tmp (in memory; reset empties it) and /workspace (working directory): the\n"
    "  user's own folder on their disk, kept across resets and sessions; you can delete there too.",
    True: "- Writable: /tmp (in memory; reset empties it). /workspace (working directory) is the\n"
    "  user's own folder, read-only: read their files there, write to /tmp.",
}


def approvals_manual_line(config: BridgeConfig) -> str:
    """The manual's words on approvals, true to this bridge's policy."""
    asks = {
        "writes": "A call of a tool its server does not mark read-only",
        "all": "Every tool call",
        "none": "No call asks the user first" if not config.approve_tools else "A call of",
    }[config.approve]
    if config.approve == "none" and not config.approve_tools:
        return asks + " (MCP_BRIDGE_APPROVE=none)."
    if config.approve == "none":
        asks += " " + ", ".join(config.approve_tools)
    return (
        asks + " waits while the user approves it; a denied call raises runtime.ApprovalDenied\n"
        "(an MCPToolError; the tool was not called): catch it, and tell the user what it was for."
    )


def capabilities_manual(config: BridgeConfig) -> str:
    """The manual, true to this bridge's /workspace (in memory, or the user's folder) and
    its approvals policy."""
    manual = CAPABILITIES_MANUAL.replace(APPROVALS_LINE, approvals_manual_line(config))
    if config.workspace is None:
        return manual
    line = MANUAL_WORKSPACE_LINES[config.workspace.read_only]
    return manual.replace(MANUAL_WRITABLE_LINE, line)


TIMEOUT_DESCRIPTION = "Seconds before interrupting."


class RunPythonInput(BaseModel):
    """run_python's arguments. The timeout's default and maximum are the config's: the
    tool's model is this one's subclass for the config (run_python_input_model), whose
    JSON schema is the tool's inputSchema."""

    model_config = ConfigDict(extra="forbid")
    code: str  # Python source (no description: the name says it, and tools/list stays small)
    timeout: float = Field(default=BridgeConfig.timeout, gt=0, description=TIMEOUT_DESCRIPTION)
    reset: bool = Field(default=False, description="Start from an empty namespace first.")
    # false: a fresh namespace (reset, a new session) starts without the saved tools. Taken
    # but left out of the schema (SkipJsonSchema): every tools/list answer would pay ~30
    # tokens for a way out that the manual and the quarantine notices tell of when needed.
    saved_tools: SkipJsonSchema[bool] = True
    # The name's rule is checked here, not stated in the schema: a pattern there costs
    # every tools/list answer a dozen tokens; the error names the rule instead.
    session: str = Field(default=DEFAULT_SESSION, description="Sandbox name; each has its own state")

    @field_validator("session")
    @classmethod
    def _session_name(cls, name: str) -> str:
        return valid_session_name(name)


def run_python_input_model(config: BridgeConfig) -> type[RunPythonInput]:
    """RunPythonInput with the config's default and maximum timeout, which its schema
    states (the field keeps its place, so the schema reads as RunPythonInput's)."""
    timeout = Field(default=config.timeout, gt=0, le=config.max_timeout, description=TIMEOUT_DESCRIPTION)
    return create_model("RunPythonInput", __base__=RunPythonInput, timeout=(float, timeout))


def run_python_tool(config: BridgeConfig) -> types.Tool:
    return types.Tool(
        name=TOOL_NAME,
        title=TOOL_TITLE,
        description=TOOL_DESCRIPTION,
        input_schema=_compact_schema(run_python_input_model(config).model_json_schema()),
        # No annotations: code may call proxied tools that write, delete or reach the
        # network, which is what the protocol's defaults say (not read-only, destructive,
        # not idempotent, open world); spelled out they would only cost every listing tokens.
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
        '"timeout" (seconds), "reset" (true/false), "saved_tools" (true/false) and "session" (a name of %s).'
        % (problems, SESSION_NAME_RULE)
    )


# --- resources: the manual, each memory, each saved tool --------------------------------
# What the agent saved is the user's to see: a client lists it under resources, beside the
# manual. The store and the files are read in a worker thread (blocking I/O).

MEMORY_URI_PREFIX = "memory://"
TOOL_URI_PREFIX = "tool://"
RESOURCES_PAGE_SIZE = 500
MAX_RESOURCE_FILE_BYTES = 1024 * 1024
MAX_DESCRIBED_METADATA_CHARS = 200


@lru_cache(maxsize=1)
def capabilities_resource() -> types.Resource:
    return types.Resource(
        uri=CAPABILITIES_URI,
        name="capabilities",
        description="Manual of the run_python sandbox",
        mime_type="text/markdown",
    )


def memory_uri(key: str) -> str:
    return MEMORY_URI_PREFIX + urllib.parse.quote(key, safe="")


def tool_uri(name: str) -> str:
    return TOOL_URI_PREFIX + name


def memory_key_of(uri: str) -> str | None:
    """The memory key a ``memory://`` URI names (percent-decoded), or None."""
    if not uri.startswith(MEMORY_URI_PREFIX):
        return None
    try:
        return urllib.parse.unquote(uri[len(MEMORY_URI_PREFIX) :], errors="strict")
    except UnicodeDecodeError:
        return None


def memory_resource(entry: Mapping[str, Any]) -> types.Resource:
    metadata = json.dumps(entry["metadata"], ensure_ascii=False, separators=(",", ":"))
    if len(metadata) > MAX_DESCRIBED_METADATA_CHARS:
        metadata = metadata[:MAX_DESCRIBED_METADATA_CHARS] + "..."
    return types.Resource(  # what the sandbox wrote is shown clean (clean_text), as run_python's output is
        uri=memory_uri(entry["key"]),
        name=clean_text(entry["key"]),
        title=clean_text("memory " + entry["key"]),
        description=clean_text(
            "Memory saved by run_python code (save_memory): %d bytes of JSON, updated %s%s"
            % (entry["value_size"], entry["updated"], "; metadata " + metadata if entry["metadata"] else "")
        ),
        mime_type="application/json",
        size=entry["value_size"],
    )


def tool_resource(entry: Mapping[str, str]) -> types.Resource:
    status = Path(entry["path"]).stat()
    doc = ": " + entry["doc"].rstrip(".") if entry["doc"] else ""
    held = entry.get("quarantined")
    where = "kept out of new sessions (defining it %s) until its file changes" % held if held else ""
    return types.Resource(
        uri=tool_uri(entry["name"]),
        name=entry["name"],
        title="saved tool " + entry["name"],
        description=clean_text(
            "Saved tool (save_tool), %s%s. File %s, %d bytes, updated %s"
            % (
                where or "defined in every new session",
                doc,
                entry["path"],
                status.st_size,
                _iso_time(status.st_mtime),
            )
        ),
        mime_type="text/x-python",
        size=status.st_size,
    )


def user_resources(store: MemoryStore, tools: SavedTools) -> list[types.Resource]:
    """One resource per memory and per saved tool. Blocking: call it in a worker thread.
    A store or file that cannot be read is logged and left out; the rest still lists."""
    resources = []
    if store.path.exists():  # listing must not create the store
        try:
            resources += [memory_resource(entry) for entry in store.entries(value_sizes=True)]
        except (MemoryStoreError, ValueError) as exc:
            logger.warning("resources/list leaves out the memories: %s", exc)
    try:
        saved = tools.entries()  # each unreadable file says so in its entry
    except OSError as exc:  # the folder itself
        logger.warning("resources/list leaves out the saved tools: %s", exc)
        saved = []
    for entry in saved:
        try:
            resources.append(tool_resource(entry))
        except OSError as exc:  # deleted or replaced since it was read
            logger.warning("resources/list leaves out saved tool %s: %s", entry["name"], exc)
    return resources


def read_memory_text(store: MemoryStore, key: str) -> str | None:
    """The memory's value as the JSON text the store keeps, or None if there is no such
    memory. Blocking. MemoryStoreError if the key is invalid or the store unusable."""
    validate_memory_key(key)
    if not store.path.exists():
        return None
    loaded = store.load(key)
    return memory_json(loaded["value"], "value") if loaded["found"] else None


def read_saved_tool(tools: SavedTools, name: str) -> str | None:
    """A saved tool's source, or None if there is no such tool. Blocking; OSError or
    ValueError (not UTF-8, too large) if the file cannot be served."""
    try:
        path = tools.path(name)  # defense in depth: only an identifier, so never outside the folder
    except MemoryStoreError:
        return None
    if not path.is_file():
        return None
    with path.open("rb") as file:
        data = file.read(MAX_RESOURCE_FILE_BYTES + 1)
    if len(data) > MAX_RESOURCE_FILE_BYTES:
        raise ValueError("the file is over %d bytes" % MAX_RESOURCE_FILE_BYTES)
    return data.decode("utf-8")


def resource_error(code: int, uri: str, message: str) -> McpProtocolError:
    from mcp.shared.exceptions import MCPError as McpProtocolError

    return McpProtocolError(code=code, message=message, data={"uri": uri})


def page_start(cursor: str | None) -> int:
    from mcp.shared.exceptions import MCPError as McpProtocolError

    if cursor is None:
        return 0
    if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 12):
        raise McpProtocolError(
            code=types.INVALID_PARAMS, message="Invalid cursor %r; list again without one." % cursor[:40]
        )
    return int(cursor)


# --- principals: who calls, and the world each caller owns ------------------------------
# Over stdio the bridge has one client. Over HTTP each bearer token names a principal, and
# each principal gets its own sessions (its own containers, in Sandboxes under its name),
# its own memory store and saved tools (STATE_DIR/principals/<name>/user_tools) and its own
# limits. A call reaches only its principal's sessions and store, so a session name, a
# memory key or a resource URI of another principal names nothing. The pool of proxied MCP
# servers and the container engine are shared: they hold no caller's state.

LOCAL_PRINCIPAL = "local"  # stdio's one client; over HTTP without tokens, every caller


class Principals:
    """The bridge's principals by name, each created on its first request: who calls, and
    its memory store and saved tools. ``http`` turns on per-principal stores (when tokens
    name principals) and refuses a request the auth middleware left without one."""

    def __init__(self, config: BridgeConfig, pool: ClientPool, http: bool, closing: Closing) -> None:
        self.config = config
        self.pool = pool
        self.http = http
        self.closing = closing  # Sandboxes' event: no new principal once it is set
        self.by_name: dict[str, Principal] = {}
        self.call_log = CallLog(config)  # every principal's proxied calls, in one file

    def store_dir(self, name: str) -> Path:
        """Where a principal's memory and saved tools live. Without tokens every caller is
        this machine's user, whose store is the stdio bridge's own."""
        if self.http and self.config.names_principals:
            return self.config.state_dir / PRINCIPALS_DIRNAME / name / MEMORY_DIRNAME
        return self.config.state_dir / MEMORY_DIRNAME

    def get(self, name: str) -> Principal:
        found = self.by_name.get(name)
        if found is not None:
            return found
        if self.closing.is_set():  # no store is created for a principal first seen while stopping
            raise ShuttingDownError(SHUTTING_DOWN)
        # Defense in depth: the token file's parser checks names too; one becomes a directory.
        if not PRINCIPAL_NAME_PATTERN.fullmatch(name):
            raise UnauthenticatedError("Refused: %s is not a valid principal name." % ascii(name[:70]))
        pool = self.pool.of_principal(name) if self.http else self.pool
        api = SandboxAPI(pool, self.config, self.store_dir(name), name, self.call_log)
        principal = Principal(name, api)
        self.by_name[name] = principal
        return principal

    def of_request(self, request: Any) -> Principal:
        """The principal a tool call or resource request comes from. Over HTTP, the one
        the auth middleware put on the request; a request without one is refused (fail
        closed), never served as somebody's."""
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser

        if not self.http:
            return self.get(LOCAL_PRINCIPAL)
        user = getattr(request, "scope", {}).get("user") if request is not None else None
        if not isinstance(user, AuthenticatedUser):
            raise UnauthenticatedError("Refused: this request carries no authenticated principal.")
        return self.get(user.access_token.client_id)


def client_name(ctx: ServerRequestContext[Bridge]) -> str | None:
    """The calling client's name as its initialize said it (clientInfo.name), if it did."""
    params = ctx.session.client_params
    return None if params is None else params.client_info.name


class ClientQuestions:
    """An Elicitor: the client of one run_python call, whose elicitations are sent as part
    of that call (so over HTTP they reach only this principal's client, on a stream that
    is open while the call waits)."""

    def __init__(self, ctx: ServerRequestContext[Bridge], url_mode: bool) -> None:
        self.session = ctx.session
        self.related = ctx.request_id
        self.url_mode = url_mode  # the client declared URL-mode elicitation too

    async def ask(self, params: types.ElicitRequestParams) -> types.ElicitResult:
        if isinstance(params, types.ElicitRequestURLParams):
            if not self.url_mode:
                raise ProxyError("this client cannot open a link (it declared no URL-mode elicitation)")
            elicitation_id = params.elicitation_id or secrets.token_hex(8)
            return await self.session.elicit_url(params.message, params.url, elicitation_id, self.related)
        return await self.session.elicit_form(params.message, params.requested_schema, self.related)


def client_questions(ctx: ServerRequestContext[Bridge]) -> ClientQuestions | None:
    """How to reach the user of this run_python call, or None: its client declared no
    form elicitation, so it cannot be asked."""
    capabilities = ctx.session.client_capabilities
    elicitation = None if capabilities is None else capabilities.elicitation
    # An empty elicitation capability means form mode (the spec's rule for older clients).
    if elicitation is None or (elicitation.form is None and elicitation.url is not None):
        return None
    return ClientQuestions(ctx, elicitation.url is not None)


# --- the bridge: its world opened once, and the handlers that serve it ------------------


class Bridge:
    """The bridge's world, opened by serve() and serve_http() (open_bridge) and handed to
    the handlers by the SDK's lifespan: the config and its run_python tool, the pool of
    proxied MCP servers, who calls (principals) and every sandbox (sandboxes)."""

    def __init__(
        self,
        config: BridgeConfig,
        pool: ClientPool,
        sandboxes: Sandboxes,
        principals: Principals | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.sandboxes = sandboxes
        self.principals = principals or Principals(
            config, pool, config.transport == "http", sandboxes.closing
        )
        self.input_model = run_python_input_model(config)
        self.tool = run_python_tool(config)


def load_server_side() -> None:
    """Import what serving MCP needs (the protocol's types, the SDK's server): about 0.35 s,
    which open_bridge spends in a worker thread while the event loop starts the sandbox.
    The first access to ``types`` happens here, while the loop touches none of the SDK
    (LazyLoader is not thread-safe on the first access before Python 3.12)."""
    import mcp.server.lowlevel
    import mcp.shared.message  # noqa: F401

    types.Tool  # noqa: B018 - loads the lazy module


@asynccontextmanager
async def open_bridge(
    config: BridgeConfig,
    discovery: DiscoveryResult,
    locate_engine: EngineLocator = detect_engine,
) -> AsyncIterator[Bridge]:
    """The bridge, open until the block ends; then every sandbox is removed and every
    proxied server stopped. The local principal's default sandbox starts meanwhile
    (config.prewarm; a principal of a token is known only when it calls)."""
    async with anyio.create_task_group() as group:
        http = config.transport == "http"
        sandboxes = Sandboxes(config, group, SharedEngine(config, locate_engine), shared=http)
        pool = ClientPool(discovery, config, group)
        principals = Principals(config, pool, http, sandboxes.closing)
        if config.prewarm and not config.names_principals:
            group.start_soon(sandboxes.prewarm, principals.get(LOCAL_PRINCIPAL))
        try:
            # The engine's commands and the container's start run on the loop meanwhile;
            # a short switch interval lets the loop take the GIL from the importing thread
            # as soon as a command answers, rather than 5 ms later at each step.
            switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(0.0005)
            try:
                await anyio.to_thread.run_sync(load_server_side)
            finally:
                sys.setswitchinterval(switch_interval)
            yield Bridge(config, pool, sandboxes, principals)
        finally:
            # Side by side (each shields itself): the sandboxes and the proxied servers
            # take up to 2 s each to stop, and the bridge exits within 2 s in all.
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closing:
                    closing.start_soon(sandboxes.aclose)
                    closing.start_soon(pool.aclose)
            group.cancel_scope.cancel()


def build_server(bridge: Bridge) -> Server[Bridge]:
    """The MCP server over an open ``bridge``, for either transport (config.transport):
    its lifespan only hands the bridge to the module-level handlers."""
    from mcp.server.lowlevel import Server

    @asynccontextmanager
    async def lifespan(_: Server[Bridge]) -> AsyncIterator[Bridge]:
        yield bridge

    server = Server(
        SERVER_NAME,
        version=__version__,
        lifespan=lifespan,
        on_list_tools=on_list_tools,
        on_list_resources=on_list_resources,
        on_list_resource_templates=on_list_resource_templates,
        on_read_resource=on_read_resource,
    )
    server.middleware.append(request_state_boundary(bridge))
    # tools/call the way the constructor registers it, typed for its task result too (a dict).
    server.add_request_handler("tools/call", types.CallToolRequestParams, on_call_tool)
    task, update = task_params()
    server.add_request_handler("tasks/get", task, on_get_task)
    server.add_request_handler("tasks/update", update, on_update_task)
    server.add_request_handler("tasks/cancel", task, on_cancel_task)
    server.extensions[TASKS_EXTENSION] = {}
    return server


def request_state_boundary(bridge: Bridge) -> Any:
    """The SDK's seal on the state of input_required results (2026-07-28): a key of this
    process, bound to the call's arguments and to the principal; it expires with the
    approval timeout (a retry after that finds its questions given up anyway)."""
    from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity

    def principal(ctx: ServerRequestContext[Any, Any]) -> str | None:
        return bridge.principals.of_request(ctx.request).name

    security = RequestStateSecurity(
        keys=[secrets.token_bytes(32)], ttl=bridge.config.approval_timeout + 60, bind_principal=principal
    )
    return RequestStateBoundary(security, default_audience=SERVER_NAME)


async def on_list_tools(
    ctx: ServerRequestContext[Bridge], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    page_start(params.cursor if params is not None else None)  # one page: a valid cursor lists it again
    # The same for every caller, and fixed while the bridge runs: cacheable (2026-07-28).
    return types.ListToolsResult(
        tools=[ctx.lifespan_context.tool], ttl_ms=TOOL_LIST_TTL_MS, cache_scope="public"
    )


def call_progress(ctx: ServerRequestContext[Bridge]) -> CallProgress | None:
    """Progress notifications for a call whose client sent a progress token, else None."""
    meta: Mapping[str, Any] = ctx.meta or {}
    token = meta.get("progress_token", meta.get("progressToken"))
    if not isinstance(token, (str, int)) or isinstance(token, bool):  # the client asked for none
        return None

    async def report(value: float, total: float | None, message: str | None) -> None:
        related = None if ctx.request_id is None else str(ctx.request_id)
        await ctx.session.send_progress_notification(token, value, total, message, related)

    return CallProgress(report)


def server_log_of(ctx: ServerRequestContext[Bridge]) -> ServerLog:
    """Proxied servers' log messages during this call, passed on as this call's own
    notifications/message, the logger named after the server."""
    session, related = ctx.session, ctx.request_id

    async def forward(server: str, params: types.LoggingMessageNotificationParams) -> None:
        logger_name = "mcp_%s%s" % (server, "." + params.logger if params.logger else "")
        message = params.model_copy(update={"logger": logger_name})
        await session.send_notification(types.LoggingMessageNotification(params=message), related)

    return forward


def round_trip_client(ctx: ServerRequestContext[Bridge]) -> bool:
    """Whether the client speaks 2026-07-28, where the bridge asks by input_required."""
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    return ctx.session.protocol_version in MODERN_PROTOCOL_VERSIONS


def input_required(execute: str, questions: Sequence[ParkedQuestion]) -> types.InputRequiredResult:
    """A run_python call that ends to ask the user (2026-07-28): the questions, and the state
    its retry brings back (sealed by the SDK's RequestStateBoundary, see build_server)."""
    state = {"execute": execute, "digests": {question.key: question.digest for question in questions}}
    return types.InputRequiredResult(
        input_requests=elicit_requests(questions), request_state=json.dumps(state)
    )


def elicit_requests(questions: Sequence[ParkedQuestion]) -> dict[str, types.InputRequest]:
    """The questions as the client's input requests, by key (input_required, tasks/get)."""
    return {question.key: types.ElicitRequest(params=question.params) for question in questions}


def elicit_answers(responses: Mapping[str, object] | None) -> dict[str, types.ElicitResult]:
    """The client's answers to elicitations among its input responses, by key (the others
    answer nothing the bridge asks)."""
    return {
        key: answer for key, answer in (responses or {}).items() if isinstance(answer, types.ElicitResult)
    }


def resume_of(params: types.CallToolRequestParams) -> Resume | None:
    """The retry of a call that ended with input_required, or None: a call of its own."""
    if params.request_state is None:
        return None
    try:  # verified and unsealed by the boundary: this is the plaintext input_required minted
        state = json.loads(params.request_state)
        execute, digests = str(state["execute"]), dict(state["digests"])
    except (ValueError, KeyError, TypeError):
        raise InvalidRequestError("The requestState of this retry is not one the bridge made.") from None
    return Resume(execute, elicit_answers(params.input_responses), digests)


async def on_call_tool(
    ctx: ServerRequestContext[Bridge], params: types.CallToolRequestParams
) -> types.CallToolResult | types.InputRequiredResult | dict[str, Any]:
    """run_python: its arguments checked, one RunRequest built and run, the outcome rendered."""
    from mcp.shared.exceptions import MCPError as McpProtocolError

    if params.name != TOOL_NAME:  # a protocol error, as the MCP spec has it, not a tool result
        raise McpProtocolError(
            code=types.INVALID_PARAMS,
            message="Unknown tool %s; the only tool is run_python." % ascii(params.name)[:80],
        )
    bridge = ctx.lifespan_context
    try:
        arguments = bridge.input_model.model_validate(params.arguments or {})
    except ValidationError as exc:
        return render_error(InvalidRequestError(describe_validation_error(exc)))
    progress = call_progress(ctx)
    round_trip = round_trip_client(ctx)
    try:
        request = RunRequest(
            code=arguments.code,
            timeout=arguments.timeout,
            reset=arguments.reset,
            session_name=arguments.session,
            principal=bridge.principals.of_request(ctx.request),
            saved_tools=arguments.saved_tools,
            client_name=client_name(ctx),
            progress=progress,
            server_log=server_log_of(ctx),
            asker=None if round_trip else client_questions(ctx),
            round_trip=round_trip and client_questions(ctx) is not None,
            resume=resume_of(params),
            as_task=takes_tasks(ctx),
        )
        outcome = await bridge.sandboxes.run(request)
        if outcome.questions is not None:
            return input_required(*outcome.questions)
        if outcome.task is not None:
            return {"resultType": "task", **task_fields(outcome.task, "working")}
        return render_for(bridge, outcome, request.client_name)
    except BridgeError as exc:
        return render_error(exc)
    except Exception as exc:  # a bug of ours: one failed call, rendered for the model, never a dead server
        logger.exception("run_python failed unexpectedly")
        return render_error(
            BridgeError(
                "The bridge hit an internal error (%s: %s); details are in the server log. Try the "
                "call again, or with reset: true." % (type(exc).__name__, exc)
            )
        )


def render_for(bridge: Bridge, outcome: ExecutionOutcome, client: str | None) -> types.CallToolResult:
    """render_outcome for ``client`` (its ClientProfile), within the HTTP transport's cap."""
    limit = HTTP_MAX_RESULT_BYTES if bridge.config.transport == "http" else None
    return render_outcome(outcome, bridge.config, limit, client_profile(client))


# --- MCP tasks (the Tasks extension, SEP-2663) -----------------------------------------
# A client that declares the extension (2026-07-28) gets, for code still running when the
# call must answer, a task instead of "still running": it polls tasks/get for the call's
# result, answers the code's questions (approvals) with tasks/update, stops it with
# tasks/cancel (McpTask; Sandboxes' TaskBoard keeps the tasks).

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"


@lru_cache(maxsize=1)
def task_params() -> tuple[type[BaseModel], type[BaseModel]]:
    """The params of tasks/get and tasks/cancel, and of tasks/update: built on first use,
    so that importing the bridge loads no protocol types (tests/test_imports.py)."""

    class TaskParams(types.RequestParams):
        task_id: str = Field(max_length=64)

    class UpdateTaskParams(TaskParams):
        input_responses: types.InputResponses = Field(default_factory=dict)

    return TaskParams, UpdateTaskParams


def takes_tasks(ctx: ServerRequestContext[Bridge]) -> bool:
    """Whether this call's client declared the Tasks extension (2026-07-28 only: the SDK
    cannot deliver a task on an older wire)."""
    capabilities = ctx.session.client_capabilities
    extensions = None if capabilities is None else capabilities.extensions
    return round_trip_client(ctx) and TASKS_EXTENSION in (extensions or {})


def task_fields(task: McpTask, status: str) -> dict[str, Any]:
    """The Task shape the extension defines, with ``status``."""
    return {
        "taskId": task.id,
        "status": status,
        "createdAt": task.created.isoformat(),
        "lastUpdatedAt": task.updated.isoformat(),
        "ttlMs": int(task.ttl * 1000),
        "pollIntervalMs": TASK_POLL_MS,
    }


def task_detail(bridge: Bridge, task: McpTask) -> dict[str, Any]:
    """tasks/get's DetailedTask: working with what the code is doing, input_required with
    the code's open questions, or the end, shown the same on every poll (task_end)."""
    if task.ended:
        if task.shown is None:
            task.shown = task_end(bridge, task)
            task.outcome = task.failure = None  # rendered once: the images are not kept twice
        return {**task_fields(task, task.shown["status"]), **task.shown}
    desk = task.running.pending.parked
    questions = [question for question in desk.waiting.values() if not question.answered.is_set()]
    for question in questions:
        question.sent = True  # carried by the task: no call carries them too
    if not questions:
        return {**task_fields(task, "working"), "statusMessage": task.status_message()}
    requests = {
        key: request.model_dump(by_alias=True, mode="json", exclude_none=True)
        for key, request in elicit_requests(questions).items()
    }
    return {
        **task_fields(task, "input_required"),
        "inputRequests": requests,
        "statusMessage": task.status_message(),
    }


def task_end(bridge: Bridge, task: McpTask) -> dict[str, Any]:
    """An ended task's status and its fields, rendered once: completed with the call's
    result (for the task's client, as a call's would be; a failure the bridge explains
    is a result too, as it is for a call), failed (an internal error, logged once) or
    cancelled (why)."""
    if task.state == "cancelled":
        return {"status": "cancelled", "statusMessage": task.reason}
    if task.outcome is not None:
        result = render_for(bridge, task.outcome, task.client_name)
    elif isinstance(task.failure, BridgeError):
        result = render_error(task.failure)
    else:
        logger.error("MCP task %s failed", task.id, exc_info=task.failure)
        message = (
            "The bridge hit an internal error (%s: %s); details are in the server log. Run the code "
            "again, or with reset: true." % (type(task.failure).__name__, task.failure)
        )
        return {"status": "failed", "error": {"code": types.INTERNAL_ERROR, "message": message}}
    dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {"status": "completed", "result": {"resultType": "complete", **dumped}}


def _own_task(ctx: ServerRequestContext[Bridge], task_id: str) -> McpTask:
    """The caller's task ``task_id``, or the protocol's invalid-params error."""
    from mcp.shared.exceptions import MCPError as McpProtocolError

    bridge = ctx.lifespan_context
    try:
        return bridge.sandboxes.tasks.get(bridge.principals.of_request(ctx.request).name, task_id)
    except BridgeError as exc:
        raise McpProtocolError(code=types.INVALID_PARAMS, message=str(exc)) from None


async def on_get_task(ctx: ServerRequestContext[Bridge], params: Any) -> dict[str, Any]:
    """tasks/get (TaskParams, see task_params)."""
    return {"resultType": "complete", **task_detail(ctx.lifespan_context, _own_task(ctx, params.task_id))}


async def on_update_task(ctx: ServerRequestContext[Bridge], params: Any) -> dict[str, Any]:
    """tasks/update (UpdateTaskParams): the user's answers to the task's questions, each
    bound to the question's own call (the task id is the principal's capability; a key no
    question has is ignored)."""
    task = _own_task(ctx, params.task_id)
    desk = task.running.pending.parked
    desk.deliver(elicit_answers(params.input_responses), {key: q.digest for key, q in desk.waiting.items()})
    return {"resultType": "complete"}


async def on_cancel_task(ctx: ServerRequestContext[Bridge], params: Any) -> dict[str, Any]:
    """tasks/cancel (TaskParams): answered at once; the code stops in the background."""
    task = _own_task(ctx, params.task_id)
    task.keeper.cancel_task(task)
    return {"resultType": "complete"}


async def on_list_resources(
    ctx: ServerRequestContext[Bridge], params: types.PaginatedRequestParams | None
) -> types.ListResourcesResult:
    start = page_start(params.cursor if params is not None else None)
    api = _resource_owner(ctx).api
    # In the principal's store thread (one at a time): listing stats the files and reads
    # their index, and one principal's listings must not crowd out the others.
    saved = await api._in_store(user_resources, api.memory, api.saved_tools)
    resources = [capabilities_resource(), *saved]
    end = start + RESOURCES_PAGE_SIZE
    return types.ListResourcesResult(
        resources=resources[start:end], next_cursor=str(end) if end < len(resources) else None
    )


async def on_list_resource_templates(
    ctx: ServerRequestContext[Bridge], params: types.PaginatedRequestParams | None
) -> types.ListResourceTemplatesResult:
    page_start(params.cursor if params is not None else None)
    return types.ListResourceTemplatesResult(resource_templates=[])  # every resource is listed


async def on_read_resource(
    ctx: ServerRequestContext[Bridge], params: types.ReadResourceRequestParams
) -> types.ReadResourceResult:
    uri = str(params.uri)
    if uri == CAPABILITIES_URI:
        mime_type, text = "text/markdown", capabilities_manual(ctx.lifespan_context.config)
    elif (key := memory_key_of(uri)) is not None:
        store = _resource_owner(ctx).api.memory
        mime_type, text = "application/json", await _read_memory_resource(store, uri, key)
    elif uri.startswith(TOOL_URI_PREFIX):
        tools = _resource_owner(ctx).api.saved_tools
        mime_type, text = (
            "text/x-python",
            await _read_tool_resource(tools, uri, uri[len(TOOL_URI_PREFIX) :]),
        )
    else:
        raise resource_error(
            types.INVALID_PARAMS,
            uri,
            "Unknown resource %s; resources/list shows the manual (%s), memories (%s<key>) and saved "
            "tools (%s<name>)." % (uri, CAPABILITIES_URI, MEMORY_URI_PREFIX, TOOL_URI_PREFIX),
        )
    return types.ReadResourceResult(
        contents=[types.TextResourceContents(uri=uri, mime_type=mime_type, text=text)]
    )


def _resource_owner(ctx: ServerRequestContext[Bridge]) -> Principal:
    """The caller's principal: memories and saved tools are listed and read from its store only."""
    from mcp.shared.exceptions import MCPError as McpProtocolError

    try:
        return ctx.lifespan_context.principals.of_request(ctx.request)
    except BridgeError as exc:
        raise McpProtocolError(code=types.INVALID_REQUEST, message=str(exc)) from None


async def _read_memory_resource(store: MemoryStore, uri: str, key: str) -> str:
    try:
        validate_memory_key(key)
    except MemoryStoreError as exc:
        raise resource_error(types.INVALID_PARAMS, uri, str(exc)) from None
    try:
        text = await anyio.to_thread.run_sync(read_memory_text, store, key)
    except MemoryStoreError as exc:
        raise resource_error(types.INTERNAL_ERROR, uri, str(exc)) from None
    except ValueError as exc:  # a row that is not JSON: written by something other than a bridge
        raise resource_error(
            types.INTERNAL_ERROR, uri, "The memory store %s holds a damaged value: %s" % (store.path, exc)
        ) from None
    if text is None:
        raise resource_error(
            types.INVALID_PARAMS, uri, "No memory named %s; resources/list shows them." % ascii(key)
        )
    return text


async def _read_tool_resource(saved_tools: SavedTools, uri: str, name: str) -> str:
    try:
        source = await anyio.to_thread.run_sync(read_saved_tool, saved_tools, name)
    except (OSError, ValueError) as exc:
        raise resource_error(
            types.INTERNAL_ERROR, uri, "The saved tool %s cannot be read: %s" % (name, exc)
        ) from None
    if source is None:
        raise resource_error(
            types.INVALID_PARAMS, uri, "No saved tool named %s; resources/list shows them." % ascii(name)
        )
    return source


# --- stdio transport: a reply to every message ------------------------------------------
# The SDK's stdio_server drops, without a word, every line its validator refuses (not
# JSON, a batch, "jsonrpc": "1.0", an id or params of the wrong type, nesting past its
# parser's 200 levels), so the client waits out its own timeout; and it holds a line of any
# size whole (a 200 MB line took the bridge to 759 MB, and it stayed at 611 MB). This
# transport answers such a line with the error JSON-RPC 2.0 prescribes and caps a line at
# what HTTP accepts, discarding a longer one as it arrives (LineSplitter, above).

STDIO_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the SDK's cap on an HTTP request body (a test checks)
MAX_MESSAGE_DEPTH = 200  # the nesting the SDK's JSON parser accepts, over HTTP as over stdio


def client_line_item(
    line: bytes | OversizedLine, cap: int = STDIO_MAX_MESSAGE_BYTES
) -> SessionMessage | bytes | None:
    """What one line from the stdio client becomes: a message for the server; the error
    reply (JSON text) that JSON-RPC 2.0 requires for a line the server cannot take; or
    nothing: a blank line, or an invalid notification or response (JSON-RPC answers
    neither; they are logged)."""
    from mcp.shared.message import SessionMessage

    if isinstance(line, OversizedLine):
        large, request_id = id_at_ends(line.head, line.tail)
        if large in (b"result", b"error"):
            logger.warning(
                "discarded a %d-byte response from the client, over the %d-byte cap", line.size, cap
            )
            return None
        return jsonrpc_error_reply(
            request_id,
            types.INVALID_REQUEST,
            "The message is %d bytes, over the bridge's cap of %d bytes on one message (the same as over "
            "HTTP); it was discarded unread. Send less in one message: split the code over several "
            "run_python calls, or have the code read large data from a file." % (line.size, cap),
        )
    if not line.strip():
        return None
    text = line.decode("utf-8", "replace")  # as the SDK reads it
    refused: ValueError | None = None
    try:
        message = types.jsonrpc_message_adapter.validate_json(text, by_name=False)
    except ValueError as exc:
        refused = exc
    else:
        if not isinstance(message, types.JSONRPCNotification):
            return SessionMessage(message)
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than Python's own parser goes: the id is read from the head
        return _too_deep_reply(id_at_ends(line[:_LINE_EDGE], line[-_LINE_EDGE:])[1])
    except ValueError as exc:
        return jsonrpc_error_reply(
            None, types.PARSE_ERROR, "The line is not JSON (%s); send one JSON-RPC 2.0 object per line." % exc
        )
    if refused is None and not (isinstance(value, dict) and "id" in value):
        return SessionMessage(message)
    # Refused, or a request whose id is of no type an id takes (null, a float, an object),
    # which passes the SDK's validator as a notification, never answered.
    return _invalid_message_reply(value, refused)


def jsonrpc_error_reply(request_id: int | str | None, code: int, message: str) -> bytes:
    error = types.JSONRPCError(
        jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message)
    )
    return error.model_dump_json(by_alias=True, exclude_unset=True).encode()


def _too_deep_reply(request_id: int | str | None) -> bytes:
    return jsonrpc_error_reply(
        request_id,
        types.INVALID_PARAMS,
        "The message nests more than %d levels deep, which the server does not accept. Send flatter "
        "arguments (deeply nested data can travel as a JSON string that the code decodes)."
        % MAX_MESSAGE_DEPTH,
    )


def _readable_id(value: object) -> int | str | None:
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


def _shown(value: object) -> str:
    return clean_text(json.dumps(value))[:40]


def _invalid_message_reply(value: object, refused: ValueError | None) -> bytes | None:
    """The error reply for JSON that is not a JSON-RPC message the SDK accepts (`refused`:
    why its validator refused it, or None when it took a request for a notification)."""
    if isinstance(value, list):
        return _batch_reply(value)
    if not isinstance(value, dict):
        return jsonrpc_error_reply(
            None, types.INVALID_REQUEST, "A JSON-RPC 2.0 message is a JSON object, not %s." % _shown(value)
        )
    problem = (
        "%s: %s" % (type(refused).__name__, refused) if refused is not None else "an id of the wrong type"
    )
    if isinstance(refused, ValidationError) and refused.errors():
        first = refused.errors(include_url=False, include_input=False)[0]
        problem = "%s: %s" % (".".join(str(part) for part in first["loc"]) or "message", first["msg"])
    problem = clean_text(problem)[:300]
    if _is_notification(value) or _is_response(value):  # JSON-RPC never answers these
        logger.warning("ignored an invalid message from the client (%s)", problem)
        return None
    request_id = _readable_id(value.get("id"))
    version, method, params = value.get("jsonrpc"), value.get("method"), value.get("params")
    code = types.INVALID_REQUEST
    if json_depth(value, MAX_MESSAGE_DEPTH) > MAX_MESSAGE_DEPTH:
        return _too_deep_reply(request_id)
    if version != "2.0":
        message = 'The "jsonrpc" member must be "2.0"' + (
            ", not %s." % _shown(version) if "jsonrpc" in value else "."
        )
    elif "id" in value and request_id is None:
        message = 'A request\'s "id" must be a string or an integer, not %s.' % _shown(value["id"])
    elif not isinstance(method, str):
        message = 'A request needs a "method" string.'
    elif "params" in value and not isinstance(params, dict):
        # MCP's methods take named parameters; a list is valid JSON-RPC but wrong for them.
        code = types.INVALID_PARAMS if isinstance(params, list) else types.INVALID_REQUEST
        message = 'The "params" of %s must be an object, not %s.' % (_shown(method), _shown(params))
    elif isinstance(refused, ValidationError) and any(e["type"] == "json_invalid" for e in refused.errors()):
        return jsonrpc_error_reply(
            None, types.PARSE_ERROR, "The server's JSON parser refused the line (%s)." % problem
        )
    else:
        message = "The message is not a valid JSON-RPC 2.0 request (%s)." % problem
    return jsonrpc_error_reply(request_id, code, message)


def _is_notification(value: dict[str, Any]) -> bool:
    return "id" not in value and value.get("jsonrpc") == "2.0" and isinstance(value.get("method"), str)


def _is_response(value: dict[str, Any]) -> bool:
    return "method" not in value and ("result" in value or "error" in value)


def _batch_reply(items: list[Any]) -> bytes | None:
    """A batch gets a batch of errors, one per request in it: MCP sends one message per
    line (the 2025-06-18 protocol removed batching, and the SDK never read them)."""
    message = (
        "JSON-RPC batches are not supported: MCP sends each message on its own line. Send the %d messages "
        "of this batch one per line." % len(items)
    )
    if not items:
        return jsonrpc_error_reply(None, types.INVALID_REQUEST, "An empty batch is not a JSON-RPC request.")
    replies = [
        jsonrpc_error_reply(
            _readable_id(item.get("id")) if isinstance(item, dict) else None, types.INVALID_REQUEST, message
        )
        for item in items
        if not (isinstance(item, dict) and (_is_notification(item) or _is_response(item)))
    ]
    if not replies:  # only notifications and responses: JSON-RPC returns nothing at all
        logger.warning("ignored a batch of %d notifications or responses from the client", len(items))
        return None
    return b"[" + b",".join(replies) + b"]"


@contextmanager
def claimed_stdio() -> Iterator[tuple[int, int]]:
    """The client's pipes as private descriptors, while fd 0 reads /dev/null and fd 1
    writes to stderr, as the SDK's stdio_server does: a child that inherits them, or a stray
    print, never touches the wire. Restored on exit; the private descriptors stay open (a
    reader thread may still be blocked on one)."""
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
    finally:
        os.close(null)
    try:
        yield wire_in, wire_out
    finally:
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)


def stdio_kind(fd: int) -> Literal["pipe", "socket"] | None:
    """What a client's stdio ``fd`` is, where the event loop can wait on it: a pipe (a
    Python client's), a socket (Node's libuv gives its children socketpairs); None for a
    terminal or a file, which a worker thread reads and writes instead."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    return "pipe" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else None


class LineWriter:
    """Whole lines to the client, one at a time: the server's messages and the transport's
    own error replies share the pipe. Once the client has closed it, lines are dropped
    (stdin's end then stops the server). What goes without waiting is written on the loop
    (most answers: a worker thread's two hand-offs cost more than the write): on a pipe, a
    line of at most PIPE_BUF bytes while poll says there is room; on a socket, what a send
    that may not wait takes. The rest, or all of it for a terminal or a file, goes through
    a worker thread. The descriptor's own flags are never changed: the client shares them."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = anyio.Lock(fast_acquire=True)  # no pass of the loop when free: one less per call
        self.closed = False
        kind = stdio_kind(fd)
        self._room: select.poll | None = None  # POLLOUT on a pipe: PIPE_BUF bytes take no wait
        if kind == "pipe" and hasattr(select, "poll"):
            self._room = select.poll()
            self._room.register(fd, select.POLLOUT)
        # A second descriptor of the socket, for send(MSG_DONTWAIT): that flag is per call.
        self._socket = socket.socket(fileno=os.dup(fd)) if kind == "socket" else None

    def write_now(self, data: bytes) -> bool:
        """The line written (or dropped, once closed) here and now when that takes no wait:
        on a pipe with room, no other line being written; else False (write_line)."""
        if self.closed:
            return True
        if self.lock.locked() or not self._pipe_takes(len(data) + 1):
            return False
        try:
            os.write(self.fd, data + b"\n")  # atomic, and there is room: all of it
        except OSError as exc:
            self._client_gone(exc)
        return True

    def _pipe_takes(self, size: int) -> bool:
        return self._room is not None and size <= select.PIPE_BUF and bool(self._room.poll(0))

    def _client_gone(self, exc: OSError) -> None:
        logger.warning("the client's stdout pipe is closed (%s); no more replies can be sent", exc)
        self.closed = True

    async def write_line(self, data: bytes) -> None:
        async with self.lock:
            if self.closed:
                return
            line = memoryview(data + b"\n")
            try:
                if self._pipe_takes(len(line)):
                    line = line[os.write(self.fd, line) :]  # atomic, and there is room: all of it
                elif self._socket is not None:
                    with suppress(BlockingIOError):
                        line = line[self._socket.send(line, socket.MSG_DONTWAIT) :]
                if line:
                    await anyio.to_thread.run_sync(self._write_all, line)
            except OSError as exc:
                self._client_gone(exc)

    def close(self) -> None:
        """Let go of the socket's second descriptor (the client's own stays as it is)."""
        if self._socket is not None:
            self._socket.close()

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:  # the client made its end non-blocking: wait for room
                select.select([], [self.fd], [])


@asynccontextmanager
async def stdio_transport(
    wire: tuple[int, int], cap: int = STDIO_MAX_MESSAGE_BYTES
) -> AsyncIterator[tuple[PulledStream, MessageWriter]]:
    """The SDK's stdio_server with a reply to every message and a size cap: a line over
    `cap` bytes is discarded as it arrives and answered with an error, so it is never held
    whole; a line the SDK would drop gets its JSON-RPC error (client_line_item). ``wire``:
    the client's pipes (claimed_stdio)."""
    from mcp.shared.message import SessionMessage

    wire_in, wire_out = wire
    out = LineWriter(wire_out)
    splitter = LineSplitter(cap)
    on_loop = stdio_kind(wire_in) is not None  # read once readable: no worker thread per message

    async def read_stdin(stream: PulledStream) -> None:
        try:
            if on_loop:
                await anyio.wait_readable(wire_in)
                chunk = os.read(wire_in, _READ_CHUNK_ON_LOOP)  # readable: returns at once
            else:
                chunk = await anyio.to_thread.run_sync(os.read, wire_in, _READ_CHUNK, abandon_on_cancel=True)
        except OSError as exc:
            logger.warning("reading the client's stdin failed (%s); stopping", exc)
            stream.end(drained=True)
            return
        if chunk:
            lines = splitter.feed(chunk)
        else:  # the client closed stdin: a last line without its newline, then the end
            lines = [] if (last := splitter.rest()) is None else [last]
            stream.end(drained=True)
        for line in lines:
            if isinstance(line, bytes) and len(line) > DECODE_IN_THREAD_BYTES:
                item = await anyio.to_thread.run_sync(client_line_item, line, cap)  # megabytes: off the loop
            else:
                item = client_line_item(line, cap)
            if isinstance(item, SessionMessage):
                stream.items.append(item)
            elif item is not None:
                await out.write_line(item)

    try:
        yield PulledStream(read_stdin), MessageWriter(out.write_line, out.write_now)
    finally:
        out.close()


# The bridge process's garbage collector. What start-up built (the modules, the SDK's and
# pydantic's types: 90,000 objects) lives as long as the process, yet each full collection
# walked all of it: 80 ms, once in a thousand proxied calls under load. It is frozen once
# the server is built. A call's objects are freed by their reference counts as it ends,
# so the young generation fills only while many calls are in flight (32 calls: 3,000
# objects); at Python's 700 it was collected every few calls, a twentieth of the bridge's
# work. Cycles still go, 10,000 objects later. No collection before the freeze: it would
# cost the first result 25-80 ms; what start-up left as cyclic garbage stays, once.
YOUNG_COLLECTION_THRESHOLD = 10_000


def collect_less_after_start_up() -> None:
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


async def serve(config: BridgeConfig, discovery: DiscoveryResult) -> None:
    """Serve MCP on stdio until stdin closes or SIGTERM/SIGINT arrives; leaving the
    bridge removes the sandbox either way."""
    opened: Bridge | None = None

    async def stop_on_signal(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        # The receiver stays open until the bridge is gone: Claude Code sends SIGINT, then
        # SIGTERM 100 ms later, and the second must not kill the bridge half-way through
        # removing the sandbox.
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                if run_scope.cancel_called:
                    logger.info("received signal %d; already shutting down", signum)
                    continue
                logger.info("received signal %d; shutting down", signum)
                if opened is not None:
                    await opened.sandboxes.begin_shutdown(grace=1.0)
                    await anyio.sleep(0.05)  # lets the tasks sending those answers write them
                run_scope.cancel()

    # The client's pipes are claimed first (no process the bridge starts may inherit them),
    # then the signals (the sandbox may start at once); the bridge opens before the
    # transport: it starts the sandbox while it imports the SDK's server side.
    with claimed_stdio() as wire:
        async with anyio.create_task_group() as group:
            with anyio.CancelScope() as run_scope:
                await group.start(stop_on_signal)
                async with open_bridge(config, discovery) as bridge, stdio_transport(wire) as streams:
                    opened = bridge
                    server = build_server(bridge)
                    collect_less_after_start_up()
                    await server.run(*streams, server.create_initialization_options())
            if run_scope.cancelled_caught:
                # Leaving the bridge has removed the sandbox, but where stdin is a terminal or a
                # file its reader is a worker thread blocked in read(), which the interpreter's
                # exit would wait for until the client writes or closes stdin.
                logging.shutdown()
                os._exit(0)
            group.cancel_scope.cancel()


# --- misconfigured: a bad setting, told to the model -------------------------------------
# An MCP client shows the user neither the server's stderr nor its exit status ("Connection
# closed"), so over stdio a bad setting does not end the bridge: it serves run_python (same
# name, same schema) whose every call answers with the setting's error, for the model to
# tell the user. It starts no container and no MCP server.


def misconfigured_message(problem: str) -> str:
    """What every run_python call answers when the bridge could not read its settings."""
    return (
        "run_python is unavailable: %s could not start its sandbox because of its settings, so no code "
        "was run. The problem: %s. The user must fix it where the MCP client starts this server (the "
        '"env" or "args" of its entry in the client\'s MCP configuration: change the value, or remove '
        "it to use the default), then restart the server or the client. Tell the user this message."
        % (SERVER_NAME, problem.rstrip("."))
    )


def build_misconfigured_server(problem: str) -> Server[Any]:
    """The MCP server a bad setting leaves: run_python and the manual, each saying what is wrong."""
    from mcp.server.lowlevel import Server

    message = misconfigured_message(problem)
    tool = run_python_tool(BridgeConfig())  # the default schema: the client lists the tool as usual

    async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        return render_error(ConfigurationUnusableError(message))

    async def list_resources(ctx: ServerRequestContext[Any], params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[capabilities_resource()])

    async def read_resource(
        ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        uri = str(params.uri)
        if uri != CAPABILITIES_URI:
            raise resource_error(types.INVALID_PARAMS, uri, message)
        text = "**%s**\n\n%s" % (message, capabilities_manual(BridgeConfig()))
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="text/markdown", text=text)]
        )

    return Server(
        SERVER_NAME,
        version=__version__,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
    )


async def serve_misconfigured(problem: str) -> None:
    """Serve the misconfigured server on stdio until stdin closes (a stop signal ends the
    process: there is nothing to clean up)."""
    server = build_misconfigured_server(problem)
    with claimed_stdio() as wire:
        async with stdio_transport(wire) as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())


# =============================================================================
# HTTP transport
# =============================================================================
# `--transport http`: the same server over the SDK's streamable HTTP transport at /mcp,
# for many clients. Every request to /mcp must carry a bearer token of the token file
# (MCP_BRIDGE_AUTH_TOKENS), which names its principal; the SDK's session manager then
# binds each MCP session to that principal, and the handlers serve it only its own world
# (Principals). Without a token file (allowed on loopback only) every caller is the local
# principal. /health answers anyone, with counts only. TLS belongs to a reverse proxy in
# front (GUIDE.md): the bridge speaks plain HTTP.

MCP_PATH = "/mcp"
HEALTH_PATH = "/health"
HTTP_GRACEFUL_SECONDS = 1  # after a stop signal, for responses still being written
LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
LOOPBACK_ORIGINS = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]
# A connection over MCP_BRIDGE_HTTP_MAX_CONNECTIONS gets this long to send the request
# its 503 answers; it must not hold a file descriptor for a whole request timeout.
REFUSED_CONNECTION_SECONDS = 1.0


# The SDK's session manager and uvicorn's h11 protocol are extended below, but imported only
# when the HTTP transport starts (they load starlette and uvicorn): each class here is a mixin
# whose base is joined on at that time (create(), configured()). mypy sees the real base.
if TYPE_CHECKING:
    _SessionManagerBase = StreamableHTTPSessionManager
    _H11ProtocolBase = H11Protocol
else:
    _SessionManagerBase = _H11ProtocolBase = object


class PrincipalSessionManager(_SessionManagerBase):
    """The SDK's session manager with a cap on each principal's MCP sessions. The SDK's
    own cap is global: one token could fill it with initialize requests and lock every
    other principal out. Admission is decided here, under the SDK's creation lock, so
    parallel initializes of one principal cannot overshoot; the SDK's global limit is set
    to the per-principal cap times the number of principals, so it is never reached first.
    Made with ``create()``, which joins it to the SDK's class."""

    @classmethod
    def create(cls, app: Server[Bridge], config: BridgeConfig, **settings: Any) -> PrincipalSessionManager:
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        joined: type[PrincipalSessionManager] = type(cls.__name__, (cls, StreamableHTTPSessionManager), {})
        return joined(app, config, **settings)

    def __init__(self, app: Server[Bridge], config: BridgeConfig, **settings: Any) -> None:
        # With an OAuth issuer anyone it knows may come: its sessions count as many as the
        # sandboxes the bridge lets live at once.
        tokens = len(config.auth_tokens.principals) if config.auth_tokens is not None else 1
        principals = max(tokens, config.max_total_sessions) if config.oauth_issuer is not None else tokens
        super().__init__(
            app,
            session_idle_timeout=config.mcp_session_idle_timeout,
            max_sessions=config.max_mcp_sessions_per_principal * principals,
            **settings,
        )
        self.config = config

    def _admit_session(self, requestor: AuthorizationContext | None) -> StreamableHTTPServerTransport | None:
        if requestor is not None:
            held = self.sessions_of(requestor["client_id"])
            if held >= self.config.max_mcp_sessions_per_principal:
                raise TooManyMcpSessionsError(
                    "No new MCP session: this token's principal already holds %d open MCP sessions, the "
                    "most this bridge allows (MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL). Reuse an open "
                    "session (send its Mcp-Session-Id), end the ones you no longer use (HTTP DELETE with "
                    "their Mcp-Session-Id), or wait: a session without a request for %g seconds is closed "
                    "(MCP_BRIDGE_MCP_SESSION_IDLE_TIMEOUT)." % (held, self.config.mcp_session_idle_timeout)
                )
        return super()._admit_session(requestor)

    def sessions_of(self, principal: str) -> int:
        return sum(1 for owner in self._session_owners.values() if owner["client_id"] == principal)

    @property
    def open_sessions(self) -> int:
        return len(self._server_instances)


class SessionCapApp:
    """The session manager's ASGI app, answering an initialize over the principal's cap
    with 429 and a JSON-RPC error that says which cap and what to do."""

    def __init__(self, manager: PrincipalSessionManager) -> None:
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.manager.asgi_app(scope, receive, send)
        except TooManyMcpSessionsError as exc:  # raised before any response was started
            from starlette.responses import Response

            body = types.JSONRPCError(
                jsonrpc="2.0", id=None, error=types.ErrorData(code=types.INVALID_REQUEST, message=str(exc))
            )
            response = Response(
                body.model_dump_json(by_alias=True, exclude_unset=True),
                status_code=429,
                media_type="application/json",
                headers={"Retry-After": "%d" % math.ceil(self.manager.config.mcp_session_idle_timeout)},
            )
            await response(scope, receive, send)


def bound_host_names(config: BridgeConfig) -> tuple[list[str], list[str]]:
    """The Host and Origin headers of requests to the address the bridge listens on, beside
    the usual loopback names: a client of --host 127.0.0.2 sends Host: 127.0.0.2:PORT."""
    host = config.host.lower()
    if ":" in host and not host.startswith("["):
        host = "[%s]" % host
    hosts = ["%s:%d" % (host, config.port)] + ([host] if config.port == 80 else [])
    return LOOPBACK_HOSTS + hosts, LOOPBACK_ORIGINS + ["http://" + name for name in hosts]


class GuardedH11Protocol(_H11ProtocolBase):
    """uvicorn's h11 protocol with the two guards uvicorn lacks (slowloris): a request
    (headers and body) must arrive within ``request_timeout`` seconds of its first byte (or
    of the connection), and at most ``max_connections`` connections are open. A connection
    over that makes room by closing the one whose unfinished request began longest ago (a
    real client sends its request within milliseconds, a slowloris never finishes one), so
    slow connections cannot lock real clients out; when every connection is serving a
    request, the new one is answered 503 at once and closed. uvicorn's own timeout only
    covers the wait between requests. ``configured()`` makes the class uvicorn is given (this
    one joined to uvicorn's H11Protocol); uvicorn makes one instance per connection."""

    request_timeout: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 256

    @classmethod
    def configured(cls, config: BridgeConfig) -> type[GuardedH11Protocol]:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        settings = {
            "request_timeout": config.http_request_timeout,
            "max_connections": config.http_max_connections,
        }
        return type(cls.__name__, (cls, H11Protocol), settings)

    # Any: uvicorn narrows asyncio's BaseTransport to Transport here (it ignores the override)
    def connection_made(self, transport: Any) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._request_began = 0.0
        super().connection_made(transport)
        seconds = self.request_timeout
        if len(self.connections) > self.max_connections and not self._close_slowest():
            self.app = refuse_busy_connection  # answers its request, whatever it is
            seconds = min(seconds, REFUSED_CONNECTION_SECONDS)
        self._arm(seconds)

    def _close_slowest(self) -> bool:
        """Close the open connection whose unfinished request began first; False if every
        other connection has sent its whole request (or is closing already)."""
        waiting = [
            other
            for other in self.connections
            if isinstance(other, GuardedH11Protocol)
            and other is not self
            and other._deadline is not None
            and not other.transport.is_closing()
        ]
        if not waiting:
            return False
        slowest = min(waiting, key=lambda other: other._request_began)
        logger.info("closing the slowest of %d HTTP connections to make room", len(self.connections))
        slowest._close_unfinished()
        return True

    def data_received(self, data: bytes) -> None:
        import h11  # loaded by uvicorn's protocol already

        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(self.request_timeout)  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY) and self._deadline is not None:
            self._deadline.cancel()  # the whole request has arrived: the app's time is not ours
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, self._too_slow)
        self._request_began = self.loop.time()

    def _too_slow(self) -> None:
        import h11

        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        logger.info("closing an HTTP connection that sent no whole request in %gs", self.request_timeout)
        self._close_unfinished()

    def _close_unfinished(self) -> None:
        import h11

        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            # No request yet, so h11 has nothing to answer; the status line tells a real client why.
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            )
        self.transport.close()


async def refuse_busy_connection(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI answer on a connection over MCP_BRIDGE_HTTP_MAX_CONNECTIONS."""
    from starlette.responses import Response

    response = Response(
        "The bridge has MCP_BRIDGE_HTTP_MAX_CONNECTIONS connections open, the most it allows; try "
        "again in a moment, or reuse an open connection.\n",
        status_code=503,
        headers={"Connection": "close", "Retry-After": "1"},
    )
    await response(scope, receive, send)


class TokenFileVerifier:
    """The SDK's TokenVerifier (a Protocol) over the token file: a token's principal is the
    client."""

    def __init__(self, tokens: AuthTokens) -> None:
        self.tokens = tokens

    async def verify_token(self, token: str) -> AccessToken | None:
        from mcp.server.auth.provider import AccessToken

        principal = self.tokens.principal_of(token)
        if principal is None:
            return None
        # Not the token itself: nothing downstream needs it, so nothing downstream keeps it.
        return AccessToken(token="", client_id=principal, scopes=[])


# --- the HTTP bridge as an OAuth resource server ----------------------------------------
# With MCP_BRIDGE_OAUTH_ISSUER the bridge serves its protected-resource metadata (RFC 9728),
# answers a request without a valid token with 401 and a WWW-Authenticate pointer to it,
# and takes the issuer's JWT access tokens: signed by a key of its JWKS, for this bridge
# (aud: its resource URL), not expired, with the required scopes. A claim of the token
# (sub by default) is the principal: each keeps its own sandboxes, memory and saved tools.
OAUTH_CLOCK_SKEW = 60  # seconds of leeway for the issuer's clock against this one
OAUTH_DISCOVERY_TIMEOUT = 10.0
SIGNING_ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]  # fmt: skip  # noqa: E501


def oauth_resource(config: BridgeConfig) -> str:
    """This bridge's MCP URL, the audience its access tokens must name."""
    if config.oauth_resource is not None:
        return config.oauth_resource
    return config.base_url + MCP_PATH


def issuer_metadata_urls(issuer: str) -> list[str]:
    """Where an issuer's metadata may be (RFC 8414 with its path inserted, then OpenID
    Connect's appended and inserted forms)."""
    parts = urllib.parse.urlsplit(issuer.rstrip("/"))
    origin, path = "%s://%s" % (parts.scheme, parts.netloc), parts.path
    return [
        origin + "/.well-known/oauth-authorization-server" + path,
        issuer.rstrip("/") + "/.well-known/openid-configuration",
        origin + "/.well-known/openid-configuration" + path,
    ]


@dataclass(frozen=True)
class IssuerEndpoints:
    """Where the bridge checks an issuer's tokens: the keys that sign its JWTs, and its
    introspection endpoint (RFC 7662; only for a bridge with a client of its own there)."""

    jwks_uri: str | None
    introspection_endpoint: str | None = None


def discover_issuer(issuer: str, introspects: bool = False) -> IssuerEndpoints:
    """The issuer's endpoints from its metadata: its jwks_uri, and with ``introspects`` its
    introspection endpoint, which must be there; CommandError saying what failed (checked at
    start-up: a bridge that cannot check tokens must not start as if it could)."""
    import urllib.request

    tried = []
    for url in issuer_metadata_urls(issuer):
        try:
            with urllib.request.urlopen(
                url, timeout=OAUTH_DISCOVERY_TIMEOUT
            ) as response:  # https, or loopback
                metadata = json.loads(response.read(1 << 20))
        except (OSError, ValueError) as exc:
            tried.append("%s: %s" % (url, getattr(exc, "reason", None) or exc))
            continue
        named = str(metadata.get("issuer", "")) if isinstance(metadata, dict) else ""
        if named.rstrip("/") != issuer.rstrip("/"):
            tried.append("%s: not this issuer's metadata" % url)
            continue
        found: dict[str, str | None] = {}
        for name, wanted in (("jwks_uri", True), ("introspection_endpoint", introspects)):
            value = metadata.get(name)
            try:
                found[name] = _web_url(value) if wanted and isinstance(value, str) and value else None
            except ValueError as exc:
                tried.append("%s: its %s %s" % (url, name, exc))
                found[name] = None
        if introspects and found["introspection_endpoint"] is None:
            tried.append("%s: no introspection_endpoint (MCP_BRIDGE_OAUTH_CLIENT_ID is set)" % url)
            continue
        if found["jwks_uri"] is None and found["introspection_endpoint"] is None:
            tried.append("%s: no jwks_uri" % url)
            continue
        return IssuerEndpoints(found["jwks_uri"], found["introspection_endpoint"])
    raise CommandError(
        "MCP_BRIDGE_OAUTH_ISSUER=%s: no metadata with the keys that sign its tokens (jwks_uri)%s was "
        "found, so no token could be checked: %s"
        % (issuer, " or its introspection endpoint" if introspects else "", "; ".join(tried))
    )


JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
INTROSPECTION_CACHE_SECONDS = 60.0  # a revoked token is still taken for at most this long
REFUSAL_CACHE_SECONDS = 30.0  # a token the issuer called inactive is not asked about again meanwhile
INTROSPECTION_CACHE_ENTRIES = 4096


@lru_cache(maxsize=1)
def opener_without_redirects() -> Any:
    """urllib's opener, but a redirect is an error: urllib would send the credentials along."""
    import urllib.request

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    return urllib.request.build_opener(NoRedirects)


def introspected_claims(answer: object, issuer: str, resource: str, now: float) -> dict[str, Any]:
    """The claims of an issuer's introspection answer (RFC 7662) for a token it says is
    active, for this bridge (``aud`` must name ``resource``) and not expired; else
    TokenRefusedError saying why."""
    if not isinstance(answer, dict) or answer.get("active") is not True:
        raise TokenRefusedError("the issuer says it is not active")
    kind = answer.get("token_type")
    if kind is not None and str(kind).lower() not in ("bearer", "access_token", "dpop"):
        raise TokenRefusedError("it is not an access token (%s)" % str(kind)[:40])
    named = answer.get("iss")
    if named is not None and str(named).rstrip("/") != issuer.rstrip("/"):
        raise TokenRefusedError("the issuer's answer names another issuer")
    audience = answer.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience if isinstance(audience, list) else []
    if resource not in audiences:
        raise TokenRefusedError("it is not for this bridge (its audience is %r)" % (audience,))
    expires = answer.get("exp")
    if isinstance(expires, int | float) and expires + OAUTH_CLOCK_SKEW < now:
        raise TokenRefusedError("it has expired")
    return answer


def read_client_secret(path: Path) -> str:
    """The secret in ``path``; CommandError when there is none to read."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(
            "MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE=%s cannot be read: %s" % (path, exc)
        ) from None
    if not secret:
        raise CommandError("MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE=%s is empty" % path)
    return secret


class OAuthTokenVerifier:
    """The SDK's TokenVerifier with MCP_BRIDGE_OAUTH_ISSUER: a token of the token file (if
    any) names its principal as before; any other must be a JWT of the issuer for this
    bridge, or, with a client of the bridge's at the issuer, a token the issuer's
    introspection endpoint says is active for this bridge (its answer cached for a minute
    at most). Whatever is wrong with a token, it is refused (401), never let through."""

    def __init__(self, config: BridgeConfig, endpoints: IssuerEndpoints) -> None:
        import jwt

        assert config.oauth_issuer is not None
        self.config = config
        self.issuer = config.oauth_issuer
        self.resource = oauth_resource(config)
        self.keys = None
        if endpoints.jwks_uri is not None:
            timeout = int(OAUTH_DISCOVERY_TIMEOUT)
            self.keys = jwt.PyJWKClient(endpoints.jwks_uri, cache_keys=True, timeout=timeout)
        self.introspection_endpoint = endpoints.introspection_endpoint
        self._client_secret = ""
        if config.oauth_client_secret_file is not None:
            self._client_secret = read_client_secret(config.oauth_client_secret_file)
        # The issuer's answers, by the token's digest, each until when it holds.
        self._introspected: dict[str, tuple[float, dict[str, Any] | str]] = {}  # str: why refused
        self._asking: dict[str, anyio.Event] = {}  # digests the issuer is being asked about
        self._limiter = anyio.CapacityLimiter(4)  # the JWKS fetch, the signature check, introspection

    async def verify_token(self, token: str) -> AccessToken | None:
        import jwt
        from mcp.server.auth.provider import AccessToken

        tokens = self.config.auth_tokens
        principal = None if tokens is None else tokens.principal_of(token)
        if principal is not None:
            return AccessToken(token="", client_id=principal, scopes=[])
        try:
            if self.keys is not None and (self.introspection_endpoint is None or JWT_SHAPE.fullmatch(token)):
                claims = await anyio.to_thread.run_sync(self._claims, token, limiter=self._limiter)
            else:
                claims = await self._introspect(token)
        except TokenRefusedError as exc:
            logger.info("refused an access token: %s", exc)
            return None
        except jwt.PyJWKClientConnectionError as exc:
            logger.warning("the issuer's keys could not be fetched, so a token was refused: %s", exc)
            return None
        except jwt.PyJWTError as exc:
            logger.info("refused an access token: %s", exc)
            return None
        scopes = self._scopes(claims)
        missing = [scope for scope in self.config.oauth_scopes if scope not in scopes]
        subject = claims.get(self.config.oauth_principal_claim)
        if missing or not isinstance(subject, str) or not subject:
            logger.info(
                "refused an access token: %s",
                "it lacks the scopes %s" % ", ".join(missing)
                if missing
                else "it has no %s claim" % self.config.oauth_principal_claim,
            )
            return None
        expires = claims.get("exp")
        return AccessToken(
            token="",  # not the token: nothing downstream needs it, so nothing downstream keeps it
            client_id=self._principal(subject),
            scopes=scopes,
            # The SDK's bearer check compares expiry with this clock: the issuer's leeway too.
            expires_at=int(expires) + OAUTH_CLOCK_SKEW if isinstance(expires, int | float) else None,
            resource=self.resource,
            subject=subject,
        )

    async def _introspect(self, token: str) -> dict[str, Any]:
        """The issuer's word on ``token``, from the cache while it holds; requests that bring
        the same new token together wait for one answer."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        while (asking := self._asking.get(digest)) is not None:
            await asking.wait()
        now = time.time()
        cached = self._introspected.get(digest)
        if cached is not None and cached[0] > now:
            if isinstance(cached[1], str):  # why the issuer refused it
                raise TokenRefusedError(cached[1])
            return cached[1]
        self._asking[digest] = asked = anyio.Event()
        try:
            answer = await anyio.to_thread.run_sync(self._ask_issuer, token, limiter=self._limiter)
        finally:
            del self._asking[digest]
            asked.set()
        try:
            claims = introspected_claims(answer, self.issuer, self.resource, now)
        except TokenRefusedError as refused:  # the issuer's word: kept a while, so a stream of
            self._remember(digest, now + REFUSAL_CACHE_SECONDS, str(refused))  # the same token asks once
            raise
        expires = claims.get("exp")
        until = now + INTROSPECTION_CACHE_SECONDS
        if isinstance(expires, int | float):
            until = min(until, float(expires))
        self._remember(digest, until, claims)
        return claims

    def _remember(self, digest: str, until: float, answer: dict[str, Any] | str) -> None:
        if len(self._introspected) >= INTROSPECTION_CACHE_ENTRIES:  # the lapsed first, else all
            now = time.time()
            kept = {key: entry for key, entry in self._introspected.items() if entry[0] > now}
            self._introspected = kept if len(kept) < INTROSPECTION_CACHE_ENTRIES else {}
        self._introspected[digest] = (until, answer)

    def _ask_issuer(self, token: str) -> object:
        """The introspection endpoint's JSON answer about ``token``, asked as the bridge's
        client (HTTP Basic, RFC 6749's form-encoded id and secret)."""
        import urllib.error
        import urllib.request

        assert self.introspection_endpoint is not None and self.config.oauth_client_id is not None
        quote = partial(urllib.parse.quote, safe="")
        credentials = "%s:%s" % (quote(self.config.oauth_client_id), quote(self._client_secret))
        request = urllib.request.Request(
            self.introspection_endpoint,
            data=urllib.parse.urlencode({"token": token, "token_type_hint": "access_token"}).encode(),
            headers={
                "Authorization": "Basic " + base64.b64encode(credentials.encode()).decode(),
                "Accept": "application/json",
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        try:
            with opener_without_redirects().open(request, timeout=OAUTH_DISCOVERY_TIMEOUT) as response:
                return json.loads(response.read(1 << 20))
        except urllib.error.HTTPError as exc:
            exc.close()
            logger.warning(
                "the issuer's introspection endpoint answered HTTP %d%s, so a token was refused",
                exc.code,
                " (check MCP_BRIDGE_OAUTH_CLIENT_ID and its secret)" if exc.code in (400, 401, 403) else "",
            )
        except (OSError, ValueError) as exc:
            logger.warning("the issuer's introspection endpoint failed, so a token was refused: %s", exc)
        raise TokenRefusedError("the issuer could not be asked about it")

    def _claims(self, token: str) -> dict[str, Any]:
        import jwt

        assert self.keys is not None
        key = self.keys.get_signing_key_from_jwt(token)  # fetched once, then cached
        claims = jwt.decode(
            token,
            key.key,
            algorithms=SIGNING_ALGORITHMS,
            audience=self.resource,
            issuer=self.issuer,
            leeway=OAUTH_CLOCK_SKEW,
            options={"require": ["exp", "iss", "aud"]},
        )
        return dict(claims)

    @staticmethod
    def _scopes(claims: Mapping[str, Any]) -> list[str]:
        scope = claims.get("scope", claims.get("scp"))
        if isinstance(scope, str):
            return scope.split()
        return [item for item in scope if isinstance(item, str)] if isinstance(scope, list) else []

    def _principal(self, subject: str) -> str:
        """The claim itself where it is a principal name and no token-file principal's (a
        user must not become someone the token file names); else a digest of issuer and
        claim, stable per person."""
        tokens = self.config.auth_tokens
        if PRINCIPAL_NAME_PATTERN.fullmatch(subject) and (tokens is None or subject not in tokens.principals):
            return subject
        return "oauth-" + hashlib.sha256(("%s\n%s" % (self.issuer, subject)).encode()).hexdigest()[:24]


def local_principal_backend() -> AuthenticationBackend:
    """No token file (loopback only): every request is the local principal."""
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken
    from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
    from starlette.requests import HTTPConnection

    class LocalPrincipalBackend(AuthenticationBackend):
        async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
            return AuthCredentials([]), AuthenticatedUser(
                AccessToken(token="", client_id=LOCAL_PRINCIPAL, scopes=[])
            )

    return LocalPrincipalBackend()


def http_app(
    server: Server[Bridge], bridge: Bridge, verifier: OAuthTokenVerifier | None = None
) -> tuple[Starlette, PrincipalSessionManager]:
    """The ASGI app (/mcp behind bearer auth; /health and the logins' /oauth/callback open)
    and the SDK's session manager,
    whose run() serves the MCP sessions inside the open bridge."""
    from mcp.server.auth.middleware.bearer_auth import BearerAuthBackend, RequireAuthMiddleware
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.middleware.authentication import AuthenticationMiddleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    config = bridge.config
    security = None
    if not config.names_principals:
        # Without tokens, a web page could reach the loopback port through DNS rebinding:
        # only local Host and Origin headers are let in (the SDK's own default for loopback).
        hosts, origins = bound_host_names(config)
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
        )
    manager = PrincipalSessionManager.create(server, config, security_settings=security)
    backend: AuthenticationBackend
    if verifier is not None:
        backend = BearerAuthBackend(verifier)
    elif config.auth_tokens is not None:
        backend = BearerAuthBackend(TokenFileVerifier(config.auth_tokens))
    else:
        backend = local_principal_backend()
    resource_metadata = None
    oauth_routes: list[Any] = []
    if verifier is not None:
        from mcp.server.auth.routes import build_resource_metadata_url, create_protected_resource_routes
        from pydantic import AnyHttpUrl

        resource_metadata = build_resource_metadata_url(AnyHttpUrl(verifier.resource))
        scopes = list(config.oauth_scopes) or None
        # As strings: the metadata model keeps them as they are, where AnyHttpUrl would add a
        # "/" to a bare origin, and clients compare the issuer exactly (RFC 8414).
        resource: Any = verifier.resource
        issuers: Any = [verifier.issuer]
        oauth_routes = create_protected_resource_routes(resource, issuers, scopes)

    async def health(request: Request) -> Response:
        return JSONResponse({**bridge.sandboxes.health(), "mcp_sessions": manager.open_sessions})

    routes = [
        # 401 with `WWW-Authenticate: Bearer` for a request without a valid token (with
        # OAuth, pointing to the protected-resource metadata).
        # Tokens are checked here alone: a token sent to another path (/health, a login's
        # callback) is never looked at, so it cannot make the bridge ask the issuer.
        Route(
            MCP_PATH,
            endpoint=AuthenticationMiddleware(
                RequireAuthMiddleware(
                    SessionCapApp(manager),
                    required_scopes=list(config.oauth_scopes),
                    resource_metadata_url=resource_metadata,
                ),
                backend=backend,
            ),
        ),
        Route(HEALTH_PATH, endpoint=health, methods=["GET"]),
        *oauth_routes,
    ]
    if bridge.pool.redirects is not None:  # a browser back from a principal's login: no token
        routes.append(Route(LOGIN_CALLBACK_PATH, endpoint=bridge.pool.redirects.endpoint, methods=["GET"]))
    app = Starlette(routes=routes)
    return app, manager


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket, opened before anything starts: a taken port or an unknown
    address is a clear error at once. OSError if it cannot be opened."""
    address = host.strip("[]")
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address, port), family=family)


def uvicorn_server_class() -> type[uvicorn.Server]:
    """uvicorn's Server without its own signal handlers: serve_http's answer the calls in
    flight first, and uvicorn's would raise the signal again once it has stopped."""
    import uvicorn

    class _UvicornServer(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _UvicornServer


def secret_file_warning(path: Path, what: str) -> str | None:
    """What to say of a file of secrets (``what``) that other users can read, if it is one."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if mode & 0o077:
        return "%s %s can be read by other users; `chmod 600 %s`" % (what, path, path)
    return None


async def serve_http(
    config: BridgeConfig,
    discovery: DiscoveryResult,
    listener: socket.socket,
    verifier: OAuthTokenVerifier | None = None,
) -> None:
    """Serve MCP over streamable HTTP on ``listener`` until SIGTERM/SIGINT: calls in
    flight are answered, then every principal's sandboxes are removed (leaving the bridge)."""
    if verifier is None:
        warn_about_tokens(config)
    if (warning := public_url_warning(config, discovery)) is not None:
        logger.warning(warning)
    async with anyio.create_task_group() as group:
        async with open_bridge(config, discovery) as bridge:
            app, manager = http_app(build_server(bridge), bridge, verifier)
            http_server = http_server_for(app, config)
            collect_less_after_start_up()
            # Open until the end: a second signal must not cut the sandboxes' removal short.
            group.start_soon(stop_http_on_signal, http_server, bridge)
            async with manager.run():  # the SDK's sessions; the bridge outlives them
                logger.info("serving MCP on http://%s:%d%s", config.host, config.port, MCP_PATH)
                await http_server.serve(sockets=[listener])
        group.cancel_scope.cancel()


def http_server_for(app: Starlette, config: BridgeConfig) -> uvicorn.Server:
    """uvicorn serving ``app``, with the bridge's own signal handling and connection guard."""
    import uvicorn

    _UvicornServer = uvicorn_server_class()
    uvicorn_config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=HTTP_GRACEFUL_SECONDS,
        http=GuardedH11Protocol.configured(config),
    )
    return _UvicornServer(uvicorn_config)


def warn_about_tokens(config: BridgeConfig) -> None:
    """Said before anything starts: no token file, or one that others can read."""
    if config.auth_tokens is None:
        logger.warning(
            "HTTP without MCP_BRIDGE_AUTH_TOKENS: every process that can reach %s:%d is the one principal "
            "%r (it can run code and use your MCP servers); set a token file to tell clients apart",
            config.host,
            config.port,
            LOCAL_PRINCIPAL,
        )
    elif (warning := secret_file_warning(config.auth_tokens.path, "the token file")) is not None:
        logger.warning(warning)


def public_url_warning(config: BridgeConfig, discovery: DiscoveryResult) -> str | None:
    """Said before anything starts, on a bridge whose principals may log in to proxied HTTP
    servers: an address their browsers may not reach, or one that carries the login's code
    in the clear."""
    if not config.names_principals or not any(wants_oauth(spec) for spec in discovery.servers):
        return None
    callback = config.base_url + LOGIN_CALLBACK_PATH
    host = urllib.parse.urlsplit(callback).hostname or ""
    if config.public_url is None and not is_loopback_host(config.host):
        return (
            "MCP_BRIDGE_PUBLIC_URL is not set: a principal's login to a proxied HTTP server comes "
            "back to %s, which browsers elsewhere may not reach; set it to the address they use" % callback
        )
    if callback.startswith("http:") and not is_loopback_host(host):
        return "logins to proxied HTTP servers come back to %s in the clear; use https (a proxy)" % callback
    return None


async def stop_http_on_signal(http_server: uvicorn.Server, bridge: Bridge) -> None:
    """On SIGTERM/SIGINT: answer the calls in flight, then let uvicorn stop."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if http_server.should_exit:
                logger.info("received signal %d; already shutting down", signum)
                continue
            logger.info("received signal %d; shutting down", signum)
            await bridge.sandboxes.begin_shutdown(grace=1.0)
            http_server.should_exit = True


# =============================================================================
# command line
# =============================================================================
# What a person at a terminal reads: each subcommand raises CommandError, which main()
# prints once, as one line after the command's name, and turns into the exit status.


def engine_problem(exc: EngineUnavailableError) -> str:
    """A missing engine in a terminal's words: the model's message says to call run_python
    again; a person runs the command again, and can choose the engine with --runtime."""
    if not isinstance(exc, NoEngineError):
        return str(exc)
    return (
        "No container engine is available: %s. %s, make sure `podman info` or `docker info` works for "
        "you, then run this command again; --runtime podman|docker chooses one (MCP_BRIDGE_RUNTIME in "
        "the MCP server's environment)." % ("; ".join(exc.problems), INSTALL_ENGINE)
    )


# --- the memory and tools subcommands ---------------------------------------------------
# `mcp-server-code-execution-mode memory list|get KEY|delete KEY|export` and `... tools
# list|show NAME|delete NAME`: the user sees and manages what the agent saved, without the
# agent (a saved tool that breaks every session is deleted here). This is not the MCP
# server: stdout is the output; messages go to stderr, one line each, never a traceback.
# What the sandbox wrote reaches a terminal here: text goes through clean_text, JSON
# through terminal_json, source through escape_controls.

MEMORY_COMMAND = "memory"
TOOLS_COMMAND = "tools"
MAX_LISTED_METADATA_CHARS = 60


def _state_dir_parser() -> argparse.ArgumentParser:
    """The server's --state-dir, as a parent parser for a subcommand (memory, adopt)."""
    state_dir = next(option for option in OPTIONS if option.field == "state_dir")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        state_dir.flag,
        dest=state_dir.field,
        metavar=state_dir.field.upper(),
        default=argparse.SUPPRESS,  # given before or after the command, never reset by it
        help="%s [env %s; default: %s]"
        % (state_dir.help, state_dir.env, state_dir.shown_default(BridgeConfig())),
    )
    return common


def build_memory_parser() -> argparse.ArgumentParser:
    common = _state_dir_parser()
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, MEMORY_COMMAND),
        parents=[common],
        description="See and manage what run_python code saved (save_memory, save_tool) without the "
        "agent. Output goes to stdout, messages to stderr.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = commands.add_parser(
        "list", parents=[common], help="the memories (key, size, updated, metadata), then the saved tools"
    )
    listing.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line: each memory (key, metadata, size, version, created, "
        "updated), then each saved tool (tool, doc, path)",
    )
    get = commands.add_parser("get", parents=[common], help="print a memory's value as JSON")
    get.add_argument("key")
    delete = commands.add_parser("delete", parents=[common], help="delete a memory")
    delete.add_argument("key")
    commands.add_parser(
        "export",
        parents=[common],
        help='print every memory as one JSON object: {key: {"value": ..., "metadata": ..., "size": ..., '
        '"version": ..., "created": ..., "updated": ...}}',
    )
    return parser


def build_tools_parser() -> argparse.ArgumentParser:
    common = _state_dir_parser()
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, TOOLS_COMMAND),
        parents=[common],
        description="See and delete the saved tools (save_tool) without the agent, e.g. one that breaks "
        "every session. Output goes to stdout, messages to stderr.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = commands.add_parser(
        "list", parents=[common], help="each saved tool: name, file, first line of its docstring, quarantine"
    )
    listing.add_argument(
        "--json", action="store_true", help="one JSON object per line: tool, doc, path (and quarantined)"
    )
    show = commands.add_parser("show", parents=[common], help="print a saved tool's source")
    show.add_argument("name")
    delete = commands.add_parser("delete", parents=[common], help="delete a saved tool")
    delete.add_argument("name")
    return parser


def _command_key(key: str) -> str:
    try:
        return validate_memory_key(key)
    except MemoryStoreError as exc:
        raise CommandError(str(exc), status=2) from None


def _no_memory(store: MemoryStore, key: str) -> CommandError:
    message = "There is no memory named %s in %s; `%s %s list` shows the keys." % (
        ascii(key),
        store.path,
        SERVER_NAME,
        MEMORY_COMMAND,
    )
    # Saved tools live beside the memories and `memory list` shows both: point at the
    # command that handles them rather than leave the user guessing.
    if key.isidentifier() and (store.path.parent / (key + ".py")).is_file():
        message += " A saved tool has that name: `%s %s show %s` or `%s %s delete %s`." % (
            SERVER_NAME,
            TOOLS_COMMAND,
            key,
            SERVER_NAME,
            TOOLS_COMMAND,
            key,
        )
    return CommandError(message)


def _stored_entries(store: MemoryStore) -> list[MemoryInfo]:
    return store.entries() if store.path.exists() else []  # reading must not create the store


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]).rstrip()
        for row in rows
    )


def _tool_line(tool: Mapping[str, str]) -> str:
    line = {"tool": tool["name"], "doc": tool["doc"], "path": tool["path"]}
    if "quarantined" in tool:
        line["quarantined"] = tool["quarantined"]
    return terminal_json(json.dumps(line, ensure_ascii=False))


def _tool_rows(saved: Sequence[Mapping[str, str]]) -> list[tuple[str, str, str]]:
    rows = [("SAVED TOOL", "FILE", "DOC")]
    for tool in saved:
        doc = tool["doc"]
        if "quarantined" in tool:
            doc = "[quarantined: defining it %s] %s" % (tool["quarantined"], doc)
        rows.append((tool["name"], clean_text(tool["path"]), clean_text(doc)))
    return rows


def _list_memories(store: MemoryStore, tools: SavedTools, as_json: bool) -> None:
    entries, saved = _stored_entries(store), tools.entries()
    if as_json:
        for entry in entries:
            print(terminal_json(json.dumps(entry, ensure_ascii=False)))
        for tool in saved:
            print(_tool_line(tool))
        return
    if not entries:
        print("No memories in %s." % store.path, file=sys.stderr)
    else:
        rows = [("KEY", "SIZE", "UPDATED", "METADATA")]
        for entry in entries:
            metadata = json.dumps(entry["metadata"], ensure_ascii=False) if entry["metadata"] else ""
            if len(metadata) > MAX_LISTED_METADATA_CHARS:
                metadata = metadata[: MAX_LISTED_METADATA_CHARS - 3] + "..."
            rows.append(
                (clean_text(entry["key"]), str(entry["size"]), entry["updated"], clean_text(metadata))
            )
        print(_table(rows))
    if saved:
        print("\n" + _table(_tool_rows(saved)))


def _get_memory(store: MemoryStore, key: str) -> None:
    loaded = store.load(key) if store.path.exists() else None
    if loaded is None or not loaded["found"]:
        raise _no_memory(store, key)
    print(terminal_json(json.dumps(loaded["value"], ensure_ascii=False, indent=2)))


def _delete_memory(store: MemoryStore, key: str) -> None:
    if not (store.path.exists() and store.delete(key)):
        raise _no_memory(store, key)
    print("Deleted memory %s." % ascii(key), file=sys.stderr)


def _export_memories(store: MemoryStore) -> None:
    memories = store.snapshot() if store.path.exists() else {}  # reading must not create the store
    print(terminal_json(json.dumps(memories, ensure_ascii=False, indent=2)))


def _tool_name(tools: SavedTools, name: str) -> Path:
    try:
        return tools.path(name)
    except MemoryStoreError as exc:
        raise CommandError(str(exc), status=2) from None


def _no_tool(tools: SavedTools, name: str) -> CommandError:
    return CommandError(
        "There is no saved tool named %s in %s; `%s %s list` shows them."
        % (name, tools.directory, SERVER_NAME, TOOLS_COMMAND)
    )


def _list_tools(tools: SavedTools, as_json: bool) -> None:
    saved = tools.entries()
    if as_json:
        for tool in saved:
            print(_tool_line(tool))
    elif not saved:
        print("No saved tools in %s." % tools.directory, file=sys.stderr)
    else:
        print(_table(_tool_rows(saved)))


def _show_tool(tools: SavedTools, name: str) -> None:
    path = _tool_name(tools, name)
    try:
        source = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _no_tool(tools, name) from None
    print(escape_controls(source, lambda char: "\\x%02x" % ord(char)), end="")


def _delete_tool(tools: SavedTools, name: str) -> None:
    _tool_name(tools, name)
    if not tools.delete(name):
        raise _no_tool(tools, name)
    print("Deleted saved tool %s; new sessions no longer define it." % name, file=sys.stderr)


def memory_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``memory`` subcommand; its settings come from the same load_config as the server's."""
    args = build_memory_parser().parse_args(list(argv))  # a bad command line: usage, status 2

    def run(store: MemoryStore, tools: SavedTools) -> None:
        if args.command == "list":
            _list_memories(store, tools, args.json)
        elif args.command == "get":
            _get_memory(store, _command_key(args.key))
        elif args.command == "delete":
            _delete_memory(store, _command_key(args.key))
        else:
            _export_memories(store)

    return _store_command(args, environ, run)


def tools_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``tools`` subcommand: list, show and delete saved tools."""
    args = build_tools_parser().parse_args(list(argv))  # a bad command line: usage, status 2

    def run(store: MemoryStore, tools: SavedTools) -> None:
        if args.command == "list":
            _list_tools(tools, args.json)
        elif args.command == "show":
            _show_tool(tools, args.name)
        else:
            _delete_tool(tools, args.name)

    return _store_command(args, environ, run)


# --- the calls subcommand: the call log -------------------------------------------------

CALLS_COMMAND = "calls"
SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def build_calls_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, CALLS_COMMAND),
        parents=[_state_dir_parser()],
        description="The proxied calls that run_python code made (STATE_DIR/calls.jsonl, kept by "
        "MCP_BRIDGE_CALL_LOG): when, who, which server and tool, the approval decision, how long, "
        "how large, and any error. Oldest first.",
    )
    parser.add_argument("--json", action="store_true", help="each call as the JSON line the log keeps")
    parser.add_argument(
        "--server", metavar="NAME", help="only the calls to this server (its configured name)"
    )
    parser.add_argument(
        "--since",
        metavar="WHEN",
        type=since_time,
        help="only the calls since WHEN: an ISO time (2026-12-02T10:00, UTC unless it says) or an age "
        "(30m, 2h, 1d)",
    )
    return parser


def since_time(text: str) -> datetime:
    """--since: an ISO 8601 time (UTC unless it names its zone), or an age such as 2h."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if match:
        return datetime.now(UTC) - timedelta(seconds=float(match.group(1)) * SINCE_UNITS[match.group(2)])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            "%r is neither an ISO time nor an age such as 30m, 2h, 1d" % text
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _call_time(entry: Mapping[str, object]) -> datetime | None:
    try:
        return datetime.fromisoformat(str(entry.get("time")))
    except ValueError:
        return None


def calls_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``calls`` subcommand: the call log, filtered, as a table or JSON lines."""
    args = build_calls_parser().parse_args(list(argv))  # a bad command line: usage, status 2
    config = load_config(["--state-dir=%s" % args.state_dir] if "state_dir" in args else [], environ)
    return 0 if printed(lambda: _print_calls(config, args)) else 1


def printed(show: Callable[[], None]) -> bool:
    """Run ``show``, which prints to stdout (UTF-8, JSON's encoding, whatever the locale's);
    False when the reader went away (`... | head`): then it stops quietly."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(encoding="utf-8")
    try:
        show()
        sys.stdout.flush()
    except BrokenPipeError:
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


def _print_calls(config: BridgeConfig, args: argparse.Namespace) -> None:
    shown = 0
    for entry in read_call_log(config.state_dir):
        when = _call_time(entry)
        if args.server is not None and entry.get("server") != args.server:
            continue
        if args.since is not None and (when is None or when < args.since):
            continue
        shown += 1
        if args.json:
            print(terminal_json(json.dumps(entry, ensure_ascii=False)))
            continue
        error = entry.get("error")
        print(
            clean_text(
                "%s  %s/%s  %s.%s  %s  %sms  %s%s"
                % (
                    entry.get("time"),
                    entry.get("principal"),
                    entry.get("session"),
                    entry.get("server"),
                    entry.get("tool"),
                    entry.get("decision"),
                    entry.get("duration_ms"),
                    "%s bytes" % entry.get("result_bytes") if entry.get("result_bytes") is not None else "-",
                    "  error: %s" % error if error else "",
                )
            )
        )
    if not shown and not args.json:
        where = config.state_dir / CALL_LOG_FILENAME
        print("no proxied calls in %s%s" % (where, " that match" if args.server or args.since else ""))


def _store_command(
    args: argparse.Namespace, environ: Mapping[str, str], run: Callable[[MemoryStore, SavedTools], None]
) -> int:
    """What the memory and tools subcommands share: the settings (from the same load_config
    as the server's), the store, and a CommandError for each failure."""
    config = load_config(["--state-dir=%s" % args.state_dir] if "state_dir" in args else [], environ)
    logging.basicConfig(level=config.log_level, stream=sys.stderr, format="%(levelname)s: %(message)s")
    store = MemoryStore(
        config.state_dir / MEMORY_DIRNAME,
        config.max_memory_bytes,
        config.max_memory_total_bytes,
        config.max_memories,
    )
    tools = SavedTools(config.state_dir / MEMORY_DIRNAME)
    try:
        if not printed(lambda: run(store, tools)):
            return 1
    except MemoryStoreError as exc:
        raise CommandError(str(exc)) from None
    except (OSError, ValueError) as exc:  # an unreadable folder, a damaged row
        raise CommandError("cannot read %s (%s: %s)" % (store.path.parent, type(exc).__name__, exc)) from None
    return 0


# --- the adopt subcommand -------------------------------------------------------------
# `mcp-server-code-execution-mode adopt --client NAME [--dry-run] [--undo]` moves the
# servers of an MCP client's config into the bridge's own servers file and leaves that
# client with only this bridge. Without it, the client starts every server itself AND the
# bridge starts them again: the user pays twice, in context and in processes.
# Where each client keeps its config, and in which format, is config_sources(): adopt
# takes a client's user-level files (a project's files are shared with others: left as
# they are). Before writing, a copy of each file it changes goes to
# <state dir>/backups/adopt-<UTC time>/ with manifest.json; every write is atomic (a
# temporary file, then os.replace). --undo restores the newest backup and renames its
# folder *.undone. Diffs and lists go to stdout, messages to stderr, one line each.

ADOPT_COMMAND = "adopt"
ADOPT_CLIENTS = {  # --client NAME -> the ConfigSource.client of the files it adopts
    "claude-desktop": "Claude Desktop",
    "claude-code": "Claude Code",
    "cursor": "Cursor",
    "vscode": "VS Code",
    "windsurf": "Windsurf",
    "gemini": "Gemini CLI",
    "codex": "Codex",
}
SERVERS_FILE = "servers.json"  # in the state dir, read like every <state dir>/*.json
BRIDGE_ENTRY_NAME = "code-execution"
BACKUPS_DIRNAME = "backups"
ADOPT_MANIFEST = "manifest.json"
_UNDONE = ".undone"
_BOM = b"\xef\xbb\xbf"
_TOML_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


Stamp = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns of a file as read


@dataclass(frozen=True)
class FileChange:
    """One file that adopt (or its undo) writes: its bytes before and after; None: absent.
    `stamp`: the file's status when `before` was read, so that a write in between, even of
    the same length, is seen; None: compare the bytes only."""

    path: Path
    before: bytes | None
    after: bytes | None
    stamp: Stamp | None = None


@dataclass
class _ClientFile:
    """One config file, read, and its entries sorted into those that move and those that stay."""

    source: ConfigSource
    data: bytes
    document: Any
    keys: tuple[str, ...]  # where its servers table is (or would be)
    table: dict[str, Any]
    stamp: Stamp
    moved: dict[str, Any] = field(default_factory=dict)  # name -> the entry for servers.json
    bridges: list[str] = field(default_factory=list)  # entries that start this bridge: they stay
    kept: dict[str, str] = field(default_factory=dict)  # name -> why only the client can use it


class _BackedUpFile(BaseModel):
    path: str
    backup: str | None = Field(pattern=r"^[^/\\]+$")  # a name in the backup folder; None: was absent
    written_sha256: str | None  # of what adopt wrote; None: adopt removed it


class _AdoptManifest(BaseModel):
    clients: list[str]
    created: str
    files: list[_BackedUpFile]


def _sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _stamp(status: os.stat_result) -> Stamp:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _read_file(path: Path) -> tuple[bytes, Stamp] | None:
    """A config file's bytes and stamp, as discovery reads it (a regular file, bounded);
    None when it does not exist."""
    try:
        data, status = read_config_bytes(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise AdoptError("cannot read %s: %s. Nothing was changed." % (path, exc.strerror or exc)) from None
    return data, _stamp(status)


def _read_bytes(path: Path) -> bytes | None:
    found = _read_file(path)
    return None if found is None else found[0]


def unchanged_since_read(change: FileChange) -> bool:
    """Whether change.path still holds change.before (same bytes and, when known, the same
    stamp): nobody wrote it since adopt read it."""
    found = _read_file(change.path)
    if found is None:
        return change.before is None
    return found[0] == change.before and change.stamp in (None, found[1])


def _write_atomically(path: Path, data: bytes | None, expect: FileChange | None = None) -> None:
    """write_atomically, or remove `path` when `data` is None. With `expect`, the file is
    compared with what was read right before the replace, and ConfigChangedError leaves it
    as it is if another writer (the client itself) changed it in between: replacing it
    would lose that write."""

    def check() -> None:
        if expect is not None and not unchanged_since_read(expect):
            raise ConfigChangedError(
                "%s changed while adopt was writing it (quit its client first, then run adopt again), "
                "so it was not overwritten" % expect.path
            )

    if data is None:
        check()
        path.unlink(missing_ok=True)
        return
    write_atomically(path, data, check)


# --- reading a client's files and sorting their entries ------------------------------


def _table_keys(document: Any, source: ConfigSource) -> tuple[str, ...]:
    """The key path of the servers table _server_table() reads: the first present one."""
    for keys in source.keys:
        if json_field(document, *keys) is not None:
            return keys
    return source.keys[0]


def _read_config_file(source: ConfigSource) -> _ClientFile | None:
    """The file, parsed as discovery parses it; None when it does not exist."""
    found = _read_file(source.path)
    if found is None:
        return None
    data, stamp = found
    try:
        document = parse_document(data.removeprefix(_BOM).decode("utf-8"), source.format)
        table = _server_table(document, source) or {}
    except ValueError as exc:  # JSON, TOML and UTF-8 errors, a table of the wrong type
        raise AdoptError(
            "%s cannot be read as %s (%s): fix it, or move its servers by hand. Nothing was changed."
            % (source.path, source.format.upper(), exc)
        ) from None
    return _ClientFile(source, data, document, _table_keys(document, source), table, stamp)


def _starts_this_bridge(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("command"), str):
        return False
    args = entry.get("args")
    words = [arg for arg in args if isinstance(arg, str)] if isinstance(args, list) else []
    return launches_self([entry["command"], *words], SELF_MARKERS)


def _portable_entry(entry: dict[str, Any], source: ConfigSource, own: ConfigSource) -> dict[str, Any]:
    """The entry as the bridge's servers file must write it to mean the same: a url without
    a type is SSE to Gemini CLI but streamable HTTP there."""
    try:
        transport = _transport(entry, source)
    except ValueError:  # a disabled entry the bridge could not run anyway: it moves as it is
        return entry
    return entry if _transport(entry, own) == transport else {**entry, "type": transport}


def _client_only_references(entry: Any) -> list[str]:
    """The ${...} references in the entry's text that discovery cannot resolve
    (expand_variables): only the client can fill them in (${input:...})."""
    references: list[str] = []
    stack = [entry]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            references += expand_variables(value, {})[2]
        elif isinstance(value, dict):
            stack.extend(reversed(value.values()))
        elif isinstance(value, list):
            stack.extend(reversed(value))
    return list(dict.fromkeys(references))


def _sort_entries(found: _ClientFile, own: ConfigSource) -> None:
    """Entries that start this bridge stay; so do those the bridge cannot run as the client
    does (malformed, client-only ${input:...} values, TOML dates). The rest move, disabled
    ones included (they stay disabled)."""
    for name, entry in found.table.items():
        if _starts_this_bridge(entry):
            found.bridges.append(name)
            continue
        spec, problems = _parse_entry(name, entry, found.source, {}, ())
        if spec is None and problems:
            found.kept[name] = problems[0].removeprefix("%s: " % found.source.label)
            continue
        try:
            json.dumps(entry)
        except TypeError:
            found.kept[name] = "it holds a TOML date or time, which JSON cannot"
            continue
        client_only = _client_only_references(entry)  # disabled entries too
        if client_only:
            found.kept[name] = "it uses %s, which only the client fills in" % ", ".join(client_only)
            continue
        moved = _portable_entry(entry, found.source, own)
        if spec is not None:
            again = _parse_entry(name, moved, own, {}, ())[0]
            if again is None or replace(again, source="") != replace(spec, source=""):
                found.kept[name] = "the bridge's servers file cannot say the same"
                continue
        found.moved[name] = moved


def _client_sources(
    client: str, home: Path, platform: str, environ: Mapping[str, str], state_dir: Path
) -> list[ConfigSource]:
    """The client's user-level config files, from config_sources()."""
    return [
        source
        for source in config_sources(home, home, platform, environ, state_dir, None)
        if source.client == ADOPT_CLIENTS[client]
    ]


def _sorted_file(source: ConfigSource, state_dir: Path) -> _ClientFile | None:
    found = _read_config_file(source)
    if found is not None:
        _sort_entries(found, ConfigSource("bridge state dir", state_dir / SERVERS_FILE))
    return found


def _client_names(values: Sequence[str]) -> list[str]:
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    for name in names:
        if name not in ADOPT_CLIENTS:
            raise AdoptError(
                "unknown client %r; use one of: %s." % (name, ", ".join(ADOPT_CLIENTS)), status=2
            )
    return list(dict.fromkeys(names))


# --- rewriting a file: only its servers table changes ---------------------------------


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _json_value_span(text: str, keys: Sequence[str]) -> tuple[int, int] | None:
    """Where the value at `keys` is in JSON `text` (comments already blanked out by
    strip_jsonc, so positions are the file's); None when a key is missing. Of repeated keys
    the last counts, as for json.loads."""
    decoder = json.JSONDecoder()
    start = _skip_space(text, 0)
    span = None
    for key in keys:
        if text[start : start + 1] != "{":
            return None
        found = None
        position = _skip_space(text, start + 1)
        while text[position] != "}":
            name, position = decoder.raw_decode(text, position)
            value_start = _skip_space(text, _skip_space(text, position) + 1)  # past the ":"
            _, value_end = decoder.raw_decode(text, value_start)
            if name == key:
                found = (value_start, value_end)
            position = _skip_space(text, value_end)
            if text[position] == ",":
                position = _skip_space(text, position + 1)
        if found is None:
            return None
        span = found
        start = found[0]
    return span


def _json_with_table(text: str, keys: Sequence[str], document: Any, table: dict[str, Any]) -> str:
    """`text` with the value at `keys` replaced by `table`, written in the file's own style
    (one line, or indented like the file); every other byte stays as it is, comments too."""
    span = _json_value_span(strip_jsonc(text), keys)
    if span is None:  # no table yet (an old servers.json): the whole file is written anew
        return json.dumps(_with_table(document, keys, table), indent=2, ensure_ascii=False) + "\n"
    start, end = span
    if "\n" not in text.strip():
        return text[:start] + json.dumps(table, ensure_ascii=False) + text[end:]
    unit = re.search(r"\n([ \t]+)\S", text)
    line = text[text.rfind("\n", 0, start) + 1 : start]
    indent = line[: len(line) - len(line.lstrip(" \t"))]
    newline = "\r\n" if "\r\n" in text else "\n"
    value = json.dumps(table, indent=unit.group(1) if unit else "  ", ensure_ascii=False)
    return text[:start] + value.replace("\n", newline + indent) + text[end:]


def _toml_header(line: str) -> tuple[str, ...] | None:
    """The key path of a `[table]` or `[[array]]` header line; None for any other line.
    tomllib itself reads the header, quoted and dotted keys included."""
    stripped = line.strip()
    if not stripped.startswith("["):
        return None
    try:
        node: Any = tomllib.loads(stripped)
    except tomllib.TOMLDecodeError:
        return None
    keys = []
    while isinstance(node, dict) and len(node) == 1:
        key, node = next(iter(node.items()))
        keys.append(key)
    return tuple(keys) if keys and (node == {} or isinstance(node, list)) else None


def _toml_key(key: str) -> str:
    return key if _TOML_BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    """A JSON string is a TOML basic string; lists and tables of them are all adopt writes."""
    if isinstance(value, list):
        return "[%s]" % ", ".join(_toml_value(item) for item in value)
    if isinstance(value, dict):
        return "{ %s }" % ", ".join("%s = %s" % (_toml_key(k), _toml_value(v)) for k, v in value.items())
    return json.dumps(value, ensure_ascii=False)


def _toml_with_table(text: str, keys: Sequence[str], old: dict[str, Any], table: dict[str, Any]) -> str:
    """`text` without the `[<keys>.NAME]` tables (and their sub-tables) of the names that
    left `table`, and with a table appended for each name new to it. Servers written in
    another TOML form stay: the caller's check of the result then refuses the rewrite."""
    prefix, gone = tuple(keys), set(old) - set(table)
    lines, dropping = [], False
    for line in text.splitlines(keepends=True):
        header = _toml_header(line)
        if header is not None:
            dropping = (
                len(header) > len(prefix) and header[: len(prefix)] == prefix and header[len(prefix)] in gone
            )
        if not dropping:
            lines.append(line)
    newline = "\r\n" if "\r\n" in text else "\n"
    result = "".join(lines)
    for name, entry in table.items():
        if name in old:
            continue
        if result:  # a blank line before the new table
            result += newline if result.endswith("\n") else newline * 2
        result += "[%s]%s" % (".".join(_toml_key(key) for key in (*prefix, name)), newline)
        result += "".join("%s = %s%s" % (_toml_key(k), _toml_value(v), newline) for k, v in entry.items())
    return result


def _with_table(document: Any, keys: Sequence[str], table: dict[str, Any]) -> Any:
    if not keys:
        return table
    node = document if isinstance(document, dict) else {}
    return {**node, keys[0]: _with_table(node.get(keys[0]), keys[1:], table)}


def _rewritten(found: _ClientFile, table: dict[str, Any]) -> bytes:
    """The file's bytes with `table` as its servers table. Checked by parsing the result:
    it must read as the old document with only that table changed, or adopt refuses."""
    bom = _BOM if found.data.startswith(_BOM) else b""
    text = found.data.removeprefix(_BOM).decode("utf-8")
    try:
        if found.source.format == "toml":
            result = _toml_with_table(text, found.keys, found.table, table)
        else:
            result = _json_with_table(text, found.keys, found.document, table)
        same = parse_document(result, found.source.format) == _with_table(found.document, found.keys, table)
    except (ValueError, IndexError):  # the check below refuses; the file is not touched
        same = False
    if not same:
        raise AdoptError(
            "cannot rewrite %s safely (its servers are not written as %s): move them by hand. "
            "Nothing was changed."
            % (
                found.source.path,
                "[%s.NAME] tables" % ".".join(found.keys) if found.source.format == "toml" else "plain JSON",
            )
        )
    return bom + result.encode("utf-8")


# --- adopting and undoing -------------------------------------------------------------


def install_source(direct_url: str | None) -> str | None:
    """What `uvx --from` takes to install this package again, from its PEP 610
    direct_url.json (which pip and uv write for a path, URL or VCS install): a folder or
    file path, a URL, or `git+URL@COMMIT` (that exact commit). None: installed from an
    index (or unreadable), where the package name alone finds it."""
    try:
        record = json.loads(direct_url or "null")
    except ValueError:
        return None
    url = record.get("url") if isinstance(record, dict) else None
    if not isinstance(url, str) or not url:
        return None
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("vcs"), str):
        commit = vcs.get("commit_id") or vcs.get("requested_revision")
        source = "%s+%s%s" % (vcs["vcs"], url, "@%s" % commit if isinstance(commit, str) else "")
    elif url.startswith("file://"):
        source = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
        if re.match(r"/[A-Za-z]:", source):  # file:///C:/... on Windows
            source = source[1:]
    else:
        source = url
    subdirectory = record.get("subdirectory")
    if isinstance(subdirectory, str) and subdirectory and not url.startswith("file://"):
        source += "#subdirectory=" + subdirectory
    return source


def running_install_source() -> str | None:
    """install_source() of the installed package this process runs from."""
    try:
        return install_source(importlib.metadata.distribution(SERVER_NAME).read_text("direct_url.json"))
    except importlib.metadata.PackageNotFoundError:
        return None


def bridge_command(environ: Mapping[str, str], script: str, source: str | None = None) -> list[str]:
    """The command a client runs to start this same program, with absolute paths: apps
    started from a desktop do not inherit the shell's PATH. Run by uvx, the bridge lives in
    a throw-away environment in uv's cache (uv sets UV to its own path): `uv tool run`,
    with `--from SOURCE` when it was installed from a folder, a URL or a repository
    (`source`, see install_source). Otherwise the console script it runs as (pipx, a venv,
    `uv tool install`), or this interpreter with this module's file."""
    uv = environ.get("UV")
    if uv and Path(uv).is_absolute():
        try:
            cache = subprocess.run(
                [uv, "cache", "dir"], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            cache = ""
        if cache and Path(sys.prefix).resolve().is_relative_to(Path(cache).resolve()):
            return [uv, "tool", "run", *(("--from", source) if source else ()), SERVER_NAME]
    path = Path(script)
    if path.stem == SERVER_NAME and path.is_file():
        return [str(path.absolute())]
    return [sys.executable, str(Path(__file__).resolve())]  # `python -m ...` or the file itself


# The settings an adopted entry carries (adopt_main): every MCP_BRIDGE_* variable adopt
# ran with whose value differs from the default, plus each --env KEY=VALUE. Not those
# that would make the entry useless to its client: it speaks stdio, and it must read the
# servers file that adopt writes.
_NOT_CARRIED = {
    "transport": "the client talks to the entry over stdio",
    "servers_config": "the bridge would read only that file, not %s where adopt moves the servers"
    % SERVERS_FILE,
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_pairs(values: Sequence[str]) -> dict[str, str]:
    """adopt's --env KEY=VALUE arguments; AdoptError (status 2) for a malformed one."""
    pairs: dict[str, str] = {}
    for value in values:
        key, equals, text = value.partition("=")
        if not equals or not _ENV_NAME.fullmatch(key):
            raise AdoptError("--env %s: write KEY=VALUE (KEY: letters, digits, _)." % ascii(value), status=2)
        option = next((option for option in OPTIONS if option.env == key), None)
        if option is not None and option.field in _NOT_CARRIED:
            raise AdoptError("--env %s: %s." % (key, _NOT_CARRIED[option.field]), status=2)
        pairs[key] = text
    return pairs


def carried_settings(
    environ: Mapping[str, str], config: BridgeConfig, added: Mapping[str, str]
) -> dict[str, str]:
    """The env of the entry adopt adds: the settings (read into `config` from `environ`)
    that differ from the defaults, then `added` (--env). (The state dir is plan_adoption's:
    it may come from --state-dir.)"""
    defaults = BridgeConfig()
    carried: dict[str, str] = {}
    for option in OPTIONS:
        if option.field in _NOT_CARRIED or option.field == "state_dir" or not environ.get(option.env):
            continue
        if getattr(config, option.field) != getattr(defaults, option.field):
            carried[option.env] = environ[option.env]
    return {**carried, **added}


def _bridge_entry_problem(entry: dict[str, Any], state_dir: Path, default_state_dir: Path) -> str | None:
    """Why the bridge this entry starts would not read <state_dir>/servers.json; None if it would."""

    def setting(name: str) -> str | None:
        option = next(option for option in OPTIONS if option.field == name)
        args = entry.get("args")
        words = [arg for arg in args if isinstance(arg, str)] if isinstance(args, list) else []
        for index, word in enumerate(words):
            if word == option.flag and index + 1 < len(words):
                return words[index + 1]
            if word.startswith(option.flag + "="):
                return word.split("=", 1)[1]
        env = entry.get("env")
        value = env.get(option.env) if isinstance(env, dict) else None
        return value if isinstance(value, str) and value else None

    servers_config = setting("servers_config")
    if servers_config:
        return "it sets MCP_SERVERS_CONFIG=%s, the only file that bridge reads" % servers_config
    chosen = setting("state_dir")
    reads = _directory(chosen) if chosen else default_state_dir
    if reads != state_dir:
        return "it reads %s, not %s (run adopt with --state-dir %s)" % (
            reads / SERVERS_FILE,
            state_dir / SERVERS_FILE,
            reads,
        )
    return None


def _nothing_to_move(client: str, sources: Sequence[ConfigSource], files: Sequence[_ClientFile]) -> str:
    label = ADOPT_CLIENTS[client]
    if not files:
        where = " or ".join(str(source.path) for source in sources)
        return "nothing to move: %s has no config file (looked for %s). Nothing was changed." % (label, where)
    said = []
    for found in files:
        if found.bridges or found.kept:
            stays = ["%s (this bridge)" % name for name in found.bridges]
            stays += ["%s (%s)" % (name, why) for name, why in found.kept.items()]
            said.append("%s lists only %s" % (found.source.path, ", ".join(stays)))
        else:
            said.append("%s lists no MCP servers" % found.source.path)
    return "nothing to move from %s: %s. Nothing was changed." % (label, "; ".join(said))


def _state_dir_files(
    home: Path, platform: str, environ: Mapping[str, str], state_dir: Path
) -> tuple[dict[Path, _ClientFile], dict[str, tuple[Path, Any]]]:
    """The config files of the state dir, by path, and what they already define: each
    server's name -> (its file, its entry)."""
    files: dict[Path, _ClientFile] = {}
    defined: dict[str, tuple[Path, Any]] = {}
    for source in config_sources(home, home, platform, environ, state_dir, None, clients=False):
        found = _read_config_file(source)
        if found is not None:
            files[source.path] = found
            defined.update((name, (source.path, entry)) for name, entry in found.table.items())
    return files, defined


def _refuse_lost_bridges(
    label: str, files: Sequence[_ClientFile], state_dir: Path, default_state_dir: Path
) -> None:
    """AdoptError if an entry of the client's files starts this bridge so that it would not
    read the servers moved to ``state_dir``."""
    for found in files:
        for name in found.bridges:
            problem = _bridge_entry_problem(found.table[name], state_dir, default_state_dir)
            if problem:
                raise AdoptError(
                    "%s: the entry %s of %s starts this bridge, but %s; the servers would be lost to "
                    "it. Nothing was changed." % (label, name, found.source.path, problem)
                )


def _bridge_entry(
    found: _ClientFile, table: Mapping[str, Any], command: Sequence[str], env: Mapping[str, str]
) -> tuple[str, dict[str, Any]]:
    """The name and entry that start this bridge in ``found``'s (new) ``table``."""
    name, number = BRIDGE_ENTRY_NAME, 1
    while name in table:  # a server the client cannot lend keeps its name
        number += 1
        name = "%s-%d" % (BRIDGE_ENTRY_NAME, number)
    entry: dict[str, Any] = {"command": command[0], "args": list(command[1:])}
    if found.keys[-1] == "servers":  # VS Code's tables: its docs always give the type
        entry = {"type": "stdio", **entry}
    if env:
        entry["env"] = dict(env)
    return name, entry


def _servers_file_change(
    own_path: Path, existing: _ClientFile | None, adding: Mapping[str, tuple[Path, Any]]
) -> FileChange:
    """The bridge's servers file with the ``adding`` entries (new, or added to ``existing``)."""
    table = {**(existing.table if existing else {}), **{name: entry for name, (_, entry) in adding.items()}}
    if existing is None:
        after = (json.dumps({"mcpServers": table}, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        return FileChange(own_path, None, after)
    return FileChange(own_path, existing.data, _rewritten(existing, table), existing.stamp)


def plan_adoption(
    clients: Sequence[str],
    home: Path,
    platform: str,
    environ: Mapping[str, str],
    state_dir: Path,
    default_state_dir: Path,
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
) -> tuple[list[FileChange], list[str]]:
    """What `adopt --client ...` would write, and the lines that say so; the bridge entry it
    adds runs `command` with `env` (and the state dir, unless the default). Raises
    AdoptError, having written nothing, when it must refuse."""
    env = dict(env or {})
    if state_dir != default_state_dir:  # a client starts the entry in a directory of its own
        env["MCP_BRIDGE_STATE_DIR"] = str(state_dir.absolute())
    own_path = state_dir / SERVERS_FILE
    own_files, defined = _state_dir_files(home, platform, environ, state_dir)
    adding: dict[str, tuple[Path, Any]] = {}
    conflicts: list[str] = []
    changes: list[FileChange] = []
    lines: list[str] = []
    for client in clients:
        label = ADOPT_CLIENTS[client]
        sources = _client_sources(client, home, platform, environ, state_dir)
        files = [found for source in sources if (found := _sorted_file(source, state_dir)) is not None]
        movable = [found for found in files if found.moved]
        if not movable:
            raise AdoptError(_nothing_to_move(client, sources, files))
        _refuse_lost_bridges(label, files, state_dir, default_state_dir)
        add_bridge = not any(found.bridges for found in files)
        for found in movable:
            for name, entry in found.moved.items():
                earlier = defined.get(name) or adding.get(name)
                if earlier is None:
                    adding[name] = (found.source.path, entry)
                elif earlier[1] != entry:
                    conflicts.append(
                        "%s of %s is also in %s, defined differently" % (name, found.source.path, earlier[0])
                    )
            table = {name: entry for name, entry in found.table.items() if name not in found.moved}
            lines.append(
                "%s: moves %s from %s to %s" % (label, ", ".join(found.moved), found.source.path, own_path)
            )
            lines += ["%s: keeps %s (%s)" % (label, name, why) for name, why in found.kept.items()]
            kept_as_is = "; its settings stay as they are" if env else ""
            lines += ["%s: keeps %s (this bridge%s)" % (label, name, kept_as_is) for name in found.bridges]
            if add_bridge:
                add_bridge = False
                name, entry = _bridge_entry(found, table, command, env)
                table[name] = entry
                settings = "".join(" %s=%s" % pair for pair in env.items())
                lines.append("%s: adds %s (this bridge:%s %s)" % (label, name, settings, " ".join(command)))
            changes.append(FileChange(found.source.path, found.data, _rewritten(found, table), found.stamp))
    if conflicts:
        raise AdoptError(
            "%s. Rename or remove one of each, then run adopt again. Nothing was changed."
            % "; ".join(conflicts)
        )
    if adding:
        changes.append(_servers_file_change(own_path, own_files.get(own_path), adding))
    return changes, lines


def apply_adoption(changes: Sequence[FileChange], state_dir: Path, clients: Sequence[str]) -> Path:
    """Back up, then write, every change; returns the backup folder. Refuses, writing
    nothing, when a file changed since it was read (its client may be running). The
    bridge's servers file is written first: if a client's file then cannot be written, or
    changed meanwhile, what was written is put back, so no server is ever in neither."""
    for change in changes:
        if not unchanged_since_read(change):
            raise AdoptError(
                "%s changed while adopt was reading it (quit its client first); run adopt again. "
                "Nothing was changed." % change.path
            )
    root = state_dir / BACKUPS_DIRNAME
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = root / ("adopt-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ"))
    folder.mkdir(mode=0o700)
    files = []
    for number, change in enumerate(changes, 1):
        backup = None if change.before is None else "%d-%s" % (number, change.path.name)
        if backup is not None:
            _write_atomically(folder / backup, change.before)
        files.append(
            _BackedUpFile(path=str(change.path), backup=backup, written_sha256=_sha256(change.after))
        )
    manifest = _AdoptManifest(clients=list(clients), created=datetime.now(UTC).isoformat(), files=files)
    _write_atomically(folder / ADOPT_MANIFEST, manifest.model_dump_json(indent=2).encode("utf-8"))
    own = state_dir / SERVERS_FILE
    written: list[FileChange] = []
    for change in sorted(changes, key=lambda change: change.path != own):  # stable: own first
        try:  # symlinked configs (dotfiles) are written through the link
            _write_atomically(change.path.resolve(), change.after, expect=change)
        except (OSError, ConfigChangedError) as exc:
            if isinstance(exc, ConfigChangedError):
                what = str(exc)
            else:
                what = "could not write %s (%s)" % (change.path, exc.strerror or exc)
            not_restored = _put_back(written)
            if not_restored:
                raise AdoptError(
                    "%s, and could not put back %s; `%s %s --undo` restores them from %s."
                    % (what, ", ".join(not_restored), SERVER_NAME, ADOPT_COMMAND, folder)
                ) from None
            shutil.rmtree(folder, ignore_errors=True)  # no adopt happened: nothing for --undo
            raise AdoptError("%s. Nothing was changed." % what) from None
        written.append(change)
    return folder


def _put_back(written: Sequence[FileChange]) -> list[str]:
    """Restore files adopt wrote (newest first), each only while it still holds what adopt
    wrote; returns those that could not be."""
    failed = []
    for change in reversed(written):
        target = change.path.resolve() if change.before is not None else change.path
        try:
            _write_atomically(target, change.before, expect=FileChange(change.path, change.after, None))
        except (OSError, AdoptError):
            failed.append(str(change.path))
    return failed


def plan_undo(state_dir: Path, clients: Sequence[str], force: bool) -> tuple[Path, list[FileChange]]:
    """The newest adopt's backup folder, and the writes that restore its files. Refuses
    when a file changed since that adopt, unless `force`."""
    root = state_dir / BACKUPS_DIRNAME
    folders = sorted(
        folder
        for folder in (root.glob("adopt-*") if root.is_dir() else ())
        if not folder.name.endswith(_UNDONE) and (folder / ADOPT_MANIFEST).is_file()
    )
    if not folders:
        raise AdoptError("there is no adopt to undo: no backup in %s." % root)
    folder = folders[-1]
    try:
        manifest = _AdoptManifest.model_validate_json((folder / ADOPT_MANIFEST).read_bytes())
        backups = [
            None if item.backup is None else (folder / item.backup).read_bytes() for item in manifest.files
        ]
    except (OSError, ValidationError) as exc:
        raise AdoptError("the backup in %s is damaged (%s). Nothing was changed." % (folder, exc)) from None
    if clients and set(clients) != set(manifest.clients):
        raise AdoptError(
            "the latest adopt (%s) was for %s; undo it first (`%s %s --undo`). Nothing was changed."
            % (folder.name, ", ".join(manifest.clients), SERVER_NAME, ADOPT_COMMAND)
        )
    changes, changed_since = [], []
    for item, backup in zip(manifest.files, backups, strict=True):
        path = Path(item.path)
        current = _read_bytes(path)
        if current == backup:
            continue  # already as it was
        if _sha256(current) != item.written_sha256 and not force:
            changed_since.append(str(path))
            continue
        changes.append(FileChange(path, current, backup))
    if changed_since:
        raise AdoptError(
            "%s changed since that adopt; restoring would lose those changes. --force restores anyway "
            "(the backup is in %s). Nothing was changed." % (", ".join(changed_since), folder)
        )
    return folder, changes


def apply_undo(folder: Path, changes: Sequence[FileChange]) -> None:
    for change in changes:
        target = change.path.resolve() if change.after is not None else change.path
        _write_atomically(target, change.after, expect=change)
    folder.rename(folder.with_name(folder.name + _UNDONE))


def _diff_lines(data: bytes | None) -> list[str]:
    text = "" if data is None else data.decode("utf-8", "replace")
    if not text:
        return []
    lines = [line + "\n" for line in text.split("\n")]
    if text.endswith("\n"):
        lines.pop()
    else:
        lines[-1] += "\\ No newline at end of file\n"
    return lines


def unified_diff(changes: Sequence[FileChange]) -> str:
    return "".join(
        line
        for change in changes
        for line in difflib.unified_diff(
            _diff_lines(change.before),
            _diff_lines(change.after),
            "/dev/null" if change.before is None else str(change.path),
            "/dev/null" if change.after is None else str(change.path),
        )
    )


def _list_adoptable(home: Path, platform: str, environ: Mapping[str, str], state_dir: Path) -> None:
    rows = [("CLIENT", "TO MOVE", "FILE")]
    for client in ADOPT_CLIENTS:
        for source in _client_sources(client, home, platform, environ, state_dir):
            try:
                found = _sorted_file(source, state_dir)
            except AdoptError:
                rows.append((client, "(cannot be read)", str(source.path)))
                continue
            if found is not None and found.table:
                rows.append((client, ", ".join(found.moved) or "-", str(found.source.path)))
    if len(rows) == 1:
        print(
            "%s %s: no MCP client config lists servers; nothing to adopt." % (SERVER_NAME, ADOPT_COMMAND),
            file=sys.stderr,
        )
        return
    print(_table(rows))
    print(
        "%s %s: nothing was changed. `%s %s --client CLIENT --dry-run` shows what adopting one "
        "would change." % (SERVER_NAME, ADOPT_COMMAND, SERVER_NAME, ADOPT_COMMAND),
        file=sys.stderr,
    )


def build_adopt_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, ADOPT_COMMAND),
        parents=[_state_dir_parser()],
        description="Move the MCP servers of a client's config into the bridge's own servers file "
        "(<state dir>/%s) and leave the client with only this bridge, so each server is started "
        "once, by the bridge, and costs no context until code asks for it. Without --client: list "
        "the clients found, changing nothing." % SERVERS_FILE,
    )
    parser.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="CLIENT",
        help="the client to adopt: %s (repeat, or separate with commas, for several)"
        % ", ".join(ADOPT_CLIENTS),
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print a unified diff of every file it would change; change nothing",
    )
    parser.add_argument(
        "--undo",
        action="store_true",
        help="restore the files of the latest adopt, byte for byte, from its backup in <state dir>/%s"
        % BACKUPS_DIRNAME,
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --undo: restore even files changed since (losing the changes)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variable for the bridge entry adopt adds (repeat for several); the entry already "
        "carries every MCP_BRIDGE_* setting adopt runs with that differs from the default",
    )
    return parser


def adopt_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``adopt`` subcommand: 0 when done (or listed); AdoptError (1 when it refuses, 2 for
    a bad --env) or ConfigError (2) when it does nothing."""
    args = build_adopt_parser().parse_args(list(argv))  # a bad command line: usage, status 2
    prefix = "%s %s: " % (SERVER_NAME, ADOPT_COMMAND)
    added = env_pairs(args.env)
    settings = {**environ, **added}  # --env MCP_BRIDGE_STATE_DIR=... moves the state dir too
    config = load_config(["--state-dir=%s" % args.state_dir] if "state_dir" in args else [], settings)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(encoding="utf-8")
    home, platform = Path.home(), sys.platform
    try:
        clients = _client_names(args.client)
        if args.force and not args.undo:
            raise AdoptError("--force only goes with --undo.", status=2)
        if args.undo:
            folder, changes = plan_undo(config.state_dir, clients, args.force)
            lines = ["restores %s from %s" % (change.path, folder) for change in changes]
        elif not clients:
            _list_adoptable(home, platform, environ, config.state_dir)
            return 0
        else:
            command = bridge_command(environ, sys.argv[0], running_install_source())
            default_state_dir = BridgeConfig().state_dir
            env = carried_settings(settings, config, added)
            changes, lines = plan_adoption(
                clients, home, platform, environ, config.state_dir, default_state_dir, command, env
            )
        if args.dry_run:
            sys.stdout.write(unified_diff(changes))
            sys.stdout.flush()
            for line in [*lines, "dry run: nothing was changed."]:
                print(prefix + line, file=sys.stderr)
            return 0
        if args.undo:
            apply_undo(folder, changes)
            lines.append("undone; restart the clients concerned.")
        else:
            folder = apply_adoption(changes, config.state_dir, clients)
            lines.append(
                "done; backup in %s. Restart %s; `%s %s --undo` puts everything back."
                % (
                    folder,
                    " and ".join(ADOPT_CLIENTS[client] for client in clients),
                    SERVER_NAME,
                    ADOPT_COMMAND,
                )
            )
        for line in lines:
            print(prefix + line, file=sys.stderr)
    except OSError as exc:  # a folder that cannot be created, a disk that is full
        raise CommandError("%s: %s" % (exc.filename or type(exc).__name__, exc.strerror or exc)) from None
    return 0


# --- the doctor subcommand ------------------------------------------------------------
# `mcp-server-code-execution-mode doctor [--json] [server flags]`: what the bridge would
# meet if it started here (this working directory, these settings), found by doing it
# once: the engine and its version, whether it enforces the sandbox's limits, the image
# (pulled if missing, as the bridge would), a real sandbox started and stopped (its
# Python version), gVisor, every config file read and its problems, every configured
# server started once through the client pool (time, tool count, tools code cannot use
# well, the error when it fails), and the client configs that still start the same
# servers themselves, with the `adopt` line that fixes it. Each probe is bounded by the
# setting that bounds it in the bridge. Exit status: 0 healthy (warnings allowed), 1
# when something would fail, 2 for a bad setting. The report goes to stdout.

DOCTOR_COMMAND = "doctor"
DOCTOR_PARALLEL_SERVERS = 4  # servers started at once
DOCTOR_SERVER_SLACK = 15.0  # seconds beyond MCP_BRIDGE_SERVER_START_TIMEOUT before a probe gives up
DoctorStatus = Literal["ok", "warn", "fail"]
DOCTOR_SECTIONS = {
    "sandbox": "Sandbox",
    "approvals": "What code may do with your tools",
    "config": "Config files read",
    "servers": "MCP servers, each started once",
    "clients": "Clients that still start the bridge's servers themselves",
}
# MCP's rule for tool names (1-128 of these); others may be refused by clients or mangled.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class DoctorCheck:
    """One finding: its section (DOCTOR_SECTIONS), what it is about, ok/warn/fail, one
    line for a person, and the facts behind it for --json."""

    section: str
    subject: str
    status: DoctorStatus
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)


def tool_problems(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """What makes a server's tools (as tools/list sent them) hard or impossible to use
    from code: a name outside MCP's rule, an input schema that is not an object (no
    arguments by name), two names that become the same Python name."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    for tool in tools:
        name = _text(tool.get("name"))
        if not _TOOL_NAME.fullmatch(name):
            problems.append("tool %s: the name is not 1-128 of A-Z a-z 0-9 _ . -" % ascii(name[:130]))
        if not _is_object_schema(tool.get("inputSchema")):
            problems.append("tool %s: its inputSchema is not an object schema" % ascii(name[:130]))
        identifier = python_identifier(name)
        if identifier in seen:
            problems.append(
                "tools %s and %s are both .%s in code: one hides the other"
                % (ascii(seen[identifier]), ascii(name), identifier)
            )
        seen.setdefault(identifier, name)
    return problems


async def _doctor_image(engine: ContainerEngine, config: BridgeConfig) -> DoctorCheck:
    """The image on this machine, or pulled now (as the bridge's first start would)."""
    image = config.image
    if isinstance(engine, KubernetesEngine):  # the nodes pull it: the start below tells
        return DoctorCheck(
            "sandbox", "image", "ok", "image %s: the cluster's nodes pull it" % image, {"image": image}
        )
    if await engine.has_image(image):
        return DoctorCheck("sandbox", "image", "ok", "image %s is on this machine" % image, {"image": image})
    argv = [engine.executable, "pull", image]
    try:
        pulled = await run_command(argv, timeout=config.start_timeout)
    except TimeoutError:
        reason = "pulling it took longer than %gs (MCP_BRIDGE_START_TIMEOUT)" % config.start_timeout
    else:
        lines = pulled.stderr.decode(errors="replace").strip().splitlines()
        reason = "`%s pull %s` failed: %s" % (
            engine.name,
            image,
            lines[-1] if lines else "exit %d" % pulled.returncode,
        )
        if pulled.returncode == 0:
            return DoctorCheck("sandbox", "image", "ok", "image %s was pulled" % image, {"image": image})
    return DoctorCheck(
        "sandbox",
        "image",
        "fail",
        "image %s is not on this machine and cannot be pulled: %s. Set MCP_BRIDGE_IMAGE to an image with "
        "python3 >= 3.9 that this machine has or can pull (`%s build-image` builds one)."
        % (image, printable(reason), SERVER_NAME),
        {"image": image, "reason": reason},
    )


async def _check_sandbox_start(engine: ContainerEngine, config: BridgeConfig) -> DoctorCheck:
    """A real sandbox, started as the bridge starts it (hardening, seccomp, kernel), then stopped."""
    async with anyio.create_task_group() as group:
        api = SandboxAPI(ClientPool(DiscoveryResult((), (), ()), config, group), config)
        sandbox = Sandbox(engine, config, config.state_dir / "ipc", api)
        started = time.monotonic()
        try:
            await sandbox.start(group)
        except SandboxStartError as exc:
            return DoctorCheck("sandbox", "start", "fail", str(exc), {"image": config.image})
        finally:
            await sandbox.stop()
            group.cancel_scope.cancel()
        seconds = time.monotonic() - started
        python = sandbox.hello["python"] if sandbox.hello is not None else "unknown"
    return DoctorCheck(
        "sandbox",
        "start",
        "ok",
        "a sandbox started in %.1fs (Python %s in %s) and was removed" % (seconds, python, config.image),
        {"seconds": round(seconds, 2), "python": python, "image": config.image},
    )


def _limits_check(engine: ContainerEngine, facts: EngineFacts | None, config: BridgeConfig) -> DoctorCheck:
    limits = {"memory": config.memory, "pids": config.pids, "cpus": config.cpus}
    shown = ", ".join(
        "%s %s" % (name, "%g" % value if isinstance(value, float) else value)
        for name, value in limits.items()
    )
    if facts is None:
        return DoctorCheck(
            "sandbox",
            "limits",
            "ok",
            "%s set on each Pod; the cluster enforces them (not checked here)" % shown,
            limits,
        )
    if not facts.unenforced:
        return DoctorCheck(
            "sandbox", "limits", "ok", "%s enforced (cgroups %s)" % (shown, facts.cgroups or "?"), limits
        )
    how = (
        "rootless on cgroups v1 has no cgroups"
        if facts.rootless and facts.cgroups == "v1"
        else ("its cgroups lack the controllers for them")
    )
    return DoctorCheck(
        "sandbox",
        "limits",
        "warn",
        "%s: %s NOT enforced: %s %s. Code can use all the memory, processes and CPU it likes; run the engine "
        "rootful, or on cgroups v2 with the controllers delegated to this user."
        % (shown, ", ".join(facts.unenforced), engine.name, how),
        {**limits, "unenforced": list(facts.unenforced)},
    )


def _gvisor_check(engine: ContainerEngine, facts: EngineFacts | None, config: BridgeConfig) -> DoctorCheck:
    if engine.gvisor:
        return DoctorCheck(
            "sandbox", "gvisor", "ok", "gVisor in use (%s)" % engine.oci_runtime, {"in_use": True}
        )
    details = {"in_use": False, "available": None if facts is None else facts.gvisor}
    if facts is None:
        message = "gVisor: for Pods, MCP_BRIDGE_KUBE_RUNTIME_CLASS (e.g. gvisor) selects it"
    elif facts.gvisor:
        message = (
            "gVisor available (%s), not in use: MCP_BRIDGE_OCI_RUNTIME=runsc isolates the sandbox further"
            % (facts.gvisor)
        )
    else:
        message = "gVisor not installed (optional: runsc isolates the sandbox further; see the README)"
    return DoctorCheck("sandbox", "gvisor", "ok", message, details)


async def check_sandbox(config: BridgeConfig) -> list[DoctorCheck]:
    """The engine, its limits, gVisor, the image and a real sandbox start."""
    try:
        engine = await configured_engine(config, detect_engine)
    except EngineUnavailableError as exc:
        return [DoctorCheck("sandbox", "engine", "fail", engine_problem(exc))]
    checks: list[DoctorCheck] = []
    try:
        try:
            facts = await engine.describe()
        except (EngineUnavailableError, TimeoutError, OSError) as exc:
            return [DoctorCheck("sandbox", "engine", "fail", "%s stopped answering: %s" % (engine.name, exc))]
        version = "" if facts is None else " " + facts.version
        how = (
            ""
            if facts is None
            else " (%s, cgroups %s)" % ("rootless" if facts.rootless else "rootful", facts.cgroups or "?")
        )
        checks.append(
            DoctorCheck(
                "sandbox",
                "engine",
                "ok",
                "engine %s%s at %s%s%s"
                % (engine.name, version, engine.executable, how, ", remote" if engine.remote else ""),
                {
                    "engine": engine.name,
                    "executable": engine.executable,
                    "version": None if facts is None else facts.version,
                },
            )
        )
        checks += [DoctorCheck("sandbox", "engine", "warn", warning) for warning in engine.warnings]
        checks.append(_limits_check(engine, facts, config))
        if not isinstance(engine, KubernetesEngine):
            try:
                await engine.use_oci_runtime(config.oci_runtime)
            except EngineUnavailableError as exc:
                checks.append(DoctorCheck("sandbox", "gvisor", "fail", str(exc)))
                return checks
        checks.append(_gvisor_check(engine, facts, config))
        image = await _doctor_image(engine, config)
        checks.append(image)
        if image.status != "fail":
            checks.append(await _check_sandbox_start(engine, config))
    finally:
        await engine.release()
    return checks


async def _probe_server(client: PooledClient, limiter: anyio.CapacityLimiter) -> DoctorCheck:
    spec = client.spec
    where = {"server": spec.name, "alias": spec.alias, "transport": spec.transport, "source": spec.source}
    async with limiter:
        started = time.monotonic()
        try:
            with anyio.fail_after(client.config.server_start_timeout + DOCTOR_SERVER_SLACK):
                await client.ensure_running()
        except PersonalLoginError:  # a shared bridge's: each principal logs in through its calls
            said = (
                "MCP server %r wants an OAuth login: each principal logs in with its own account, "
                "through the link its first call returns" % spec.name
            )
            return DoctorCheck("servers", spec.name, "ok", said, where)
        except ServerUnavailableError as exc:
            return DoctorCheck("servers", spec.name, "fail", str(exc), where)
        except TimeoutError:
            message = "MCP server %r did not start within %gs; check its entry in %s." % (
                spec.name,
                client.config.server_start_timeout + DOCTOR_SERVER_SLACK,
                spec.source,
            )
            return DoctorCheck("servers", spec.name, "fail", message, where)
        seconds = time.monotonic() - started
    tools = [_tool_dict(tool) for tool in client.tools]
    problems = tool_problems(tools)
    asking = [
        tool.name
        for tool in client.tools
        if tool_allowed(spec.name, tool.name, client.config)
        and approval_reason(spec.name, tool.name, _read_only(tool), client.config) is not None
    ]
    details = {
        **where,
        "seconds": round(seconds, 2),
        "tools": len(tools),
        "tool_problems": problems,
        "tools_asking_first": asking,
    }
    message = "%s (mcp_%s): started in %.1fs, %d tool%s, %d of them ask the user first" % (
        shown_name(spec.name),
        spec.alias,
        seconds,
        len(tools),
        _plural(len(tools)),
        len(asking),
    )
    if problems:
        return DoctorCheck("servers", spec.name, "warn", "%s; %s" % (message, "; ".join(problems)), details)
    return DoctorCheck("servers", spec.name, "ok", message, details)


async def check_servers(config: BridgeConfig, discovery: DiscoveryResult) -> list[DoctorCheck]:
    """Every configured server the policy allows, started once through the client pool."""
    checks = [
        DoctorCheck(
            "servers",
            spec.name,
            "ok",
            "%s: not started (MCP_BRIDGE_ALLOW_SERVERS / MCP_BRIDGE_DENY_SERVERS leave it out)"
            % shown_name(spec.name),
        )
        for spec in discovery.servers
        if not server_allowed(spec.name, config)
    ]
    limiter = anyio.CapacityLimiter(DOCTOR_PARALLEL_SERVERS)
    found: dict[str, DoctorCheck] = {}
    async with anyio.create_task_group() as group:
        pool = ClientPool(discovery, config, group)

        async def probe(alias: str, client: PooledClient) -> None:
            found[alias] = await _probe_server(client, limiter)

        try:
            async with anyio.create_task_group() as probes:
                for alias, client in pool.clients.items():
                    probes.start_soon(probe, alias, client)
        finally:
            await pool.aclose()
    return [*(found[alias] for alias in sorted(found)), *checks]


def check_config_files(discovery: DiscoveryResult) -> list[DoctorCheck]:
    """Each file read, then its problems; problems of no one file (policy) last."""
    checks: list[DoctorCheck] = []
    problems = list(discovery.problems)
    for label in discovery.sources:
        checks.append(DoctorCheck("config", label, "ok", label))
        path = label.split(" projects[")[0]
        mine = [line for line in problems if line.startswith((label + ":", path + ":"))]
        problems = [line for line in problems if line not in mine]
        checks += [  # the client's own entry for this bridge is as it should be
            DoctorCheck(
                "config", label, "ok" if line.endswith(SELF_ENTRY_SKIPPED) else "warn", printable(line)
            )
            for line in mine
        ]
    checks += [DoctorCheck("config", "", "warn", printable(line)) for line in problems]
    if not discovery.sources:
        checks.insert(0, DoctorCheck("config", "", "ok", "(no config file lists MCP servers here)"))
    return checks


def check_direct_clients(
    config: BridgeConfig, discovery: DiscoveryResult, environ: Mapping[str, str]
) -> list[DoctorCheck]:
    """Client configs that start this bridge AND, directly, servers the bridge offers too:
    each such server runs twice and its schemas fill the model's context anyway."""
    offered = {spec.name for spec in discovery.servers}
    checks = []
    for client, label in ADOPT_CLIENTS.items():
        for source in _client_sources(client, Path.home(), sys.platform, environ, config.state_dir):
            try:
                found = _sorted_file(source, config.state_dir)
            except AdoptError:
                continue  # discovery's own problem line says why it cannot be read
            twice = (
                [name for name in found.moved if name in offered]
                if found is not None and found.bridges
                else []
            )
            if twice:
                fix = "%s %s --client %s" % (SERVER_NAME, ADOPT_COMMAND, client)
                checks.append(
                    DoctorCheck(
                        "clients",
                        client,
                        "warn",
                        "%s (%s) starts %s itself and again through this bridge: `%s` moves them"
                        % (
                            label,
                            source.path,
                            ", ".join(shown_name(name) for name in twice),
                            fix,
                        ),
                        {"client": client, "path": str(source.path), "servers": twice, "fix": fix},
                    )
                )
    return checks


def check_approvals(config: BridgeConfig) -> DoctorCheck:
    """The approvals policy and the call log, as the bridge will apply them."""
    asks = {
        "writes": "calls of tools their servers do not mark read-only wait for the user's approval",
        "all": "every proxied call waits for the user's approval",
        "none": "no call asks the user first",
    }[config.approve]
    parts = ["MCP_BRIDGE_APPROVE=%s: %s" % (config.approve, asks)]
    if config.approve_tools:
        parts.append("always asking: %s" % ", ".join(config.approve_tools))
    if config.allow_tools_without_asking:
        parts.append("never asking: %s" % ", ".join(config.allow_tools_without_asking))
    parts.append(
        "clients without elicitation: %s (MCP_BRIDGE_APPROVE_FALLBACK)"
        % ("allowed, the result says so" if config.approve_fallback == "allow" else "denied")
    )
    parts.append("at most %d proxied calls per run_python call" % config.max_tool_calls)
    log = config.state_dir / CALL_LOG_FILENAME
    parts.append("call log: %s" % ("off" if config.call_log == "off" else "%s (%s)" % (log, config.call_log)))
    details = {
        "approve": config.approve,
        "approve_tools": list(config.approve_tools),
        "allow_tools_without_asking": list(config.allow_tools_without_asking),
        "approval_timeout": config.approval_timeout,
        "approve_fallback": config.approve_fallback,
        "max_tool_calls": config.max_tool_calls,
        "call_log": config.call_log,
        "call_log_path": str(log),
    }
    return DoctorCheck("approvals", "policy", "ok", "; ".join(parts), details)


async def doctor_checks(
    config: BridgeConfig, discovery: DiscoveryResult, environ: Mapping[str, str]
) -> list[DoctorCheck]:
    return [
        *await check_sandbox(config),
        check_approvals(config),
        *check_config_files(discovery),
        *await check_servers(config, discovery),
        *check_direct_clients(config, discovery, environ),
    ]


def doctor_status(checks: Sequence[DoctorCheck]) -> int:
    return 1 if any(check.status == "fail" for check in checks) else 0


def doctor_report(config: BridgeConfig, checks: Sequence[DoctorCheck]) -> str:
    lines = [
        "%s %s %s (working directory %s, state dir %s, MCP_BRIDGE_PROJECT_SERVERS=%s)"
        % (SERVER_NAME, __version__, DOCTOR_COMMAND, Path.cwd(), config.state_dir, config.project_servers)
    ]
    for section, title in DOCTOR_SECTIONS.items():
        mine = [check for check in checks if check.section == section]
        if mine or section == "servers":
            lines += ["", title]
            for check in mine:
                # Servers' errors and files' names may hold anything: escape what a terminal
                # would run. A message of several lines (a server's stderr) stays indented.
                first, *rest = check.message.splitlines() or [""]
                lines.append("  %-4s  %s" % (check.status, printable(first)))
                lines += ["        %s" % printable(line) for line in rest]
            lines += [] if mine else ["  (none configured)"]
    failures = sum(check.status == "fail" for check in checks)
    warnings = sum(check.status == "warn" for check in checks)
    lines += [
        "",
        "%d failure%s, %d warning%s: %s"
        % (
            failures,
            _plural(failures),
            warnings,
            _plural(warnings),
            "something would fail (exit 1)." if failures else "the bridge can start here.",
        ),
    ]
    return "\n".join(lines) + "\n"


def doctor_json(checks: Sequence[DoctorCheck]) -> str:
    return json.dumps(
        {
            "version": __version__,
            "status": doctor_status(checks),
            "checks": [
                {
                    "section": c.section,
                    "subject": c.subject,
                    "status": c.status,
                    "message": c.message,
                    **c.details,
                }
                for c in checks
            ],
        },
        indent=2,
        ensure_ascii=False,
    )


def doctor_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """The ``doctor`` subcommand: 0 healthy, 1 when something would fail; ConfigError (status 2)
    for a bad setting."""
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, DOCTOR_COMMAND),
        description="Check, by doing each once, what the bridge would meet if it started here: "
        "the engine, its limits, gVisor, the image and a real sandbox, every config file, every "
        "configured MCP server (started once), and clients that still start those servers "
        "themselves. Takes the server's own flags too (`%s --help`). Exit status: 0 healthy, 1 "
        "when something would fail, 2 for a bad setting." % SERVER_NAME,
    )
    parser.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    args, settings = parser.parse_known_args(list(argv))
    config = load_config(settings, environ)  # the server's own flags and variables
    # The servers' own logs reach stderr anyway; the bridge's INFO lines would only repeat the report.
    level = config.log_level if config.log_level == "DEBUG" else "WARNING"
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s: %(message)s")
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(encoding="utf-8")
    checks = anyio.run(doctor_checks, config, configured_servers(config, environ), environ)
    sys.stdout.write(doctor_json(checks) + "\n" if args.json else doctor_report(config, checks))
    sys.stdout.flush()
    return doctor_status(checks)


# --- the build-image subcommand --------------------------------------------------------
# `mcp-server-code-execution-mode build-image [--packages numpy,pandas,matplotlib]`: a
# "batteries" sandbox image for data work, built the way this machine allows: FROM the
# default image with pip where a registry exists; from Debian packages with debootstrap
# where none does (as root; scripts/setup.sh builds the test image the same way). The
# result is checked by importing every package in it, with the sandbox's network off.

DEBIAN_SUITE = "bookworm"
# matplotlib writes its cache and config under $HOME, which the read-only sandbox lacks.
IMAGE_ENVIRONMENT = ("MPLCONFIGDIR=/tmp/matplotlib",)
BUILD_IMAGE_LABEL = "io.github.mcp-server-code-execution-mode.build-image"
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:(?:==|>=|<=|~=)[A-Za-z0-9.*+!-]+)?")
# PyPI names whose Debian package or import name is not python3-<name> / <name>.
_DEBIAN_NAMES = {
    "pillow": "python3-pil", "scikit-learn": "python3-sklearn", "beautifulsoup4": "python3-bs4",
    "pyyaml": "python3-yaml", "opencv-python": "python3-opencv",
}  # fmt: skip
_IMPORT_NAMES = {
    "pillow": "PIL", "scikit-learn": "sklearn", "beautifulsoup4": "bs4", "pyyaml": "yaml",
    "opencv-python": "cv2", "python-dateutil": "dateutil",
}  # fmt: skip


def _project_name(package: str) -> str:
    return re.split(r"[<>=~]", package, maxsplit=1)[0].lower().replace("_", "-")


def debian_package(package: str) -> str:
    name = _project_name(package)
    return _DEBIAN_NAMES.get(name, "python3-" + name)


def import_name(package: str) -> str:
    name = _project_name(package)
    return _IMPORT_NAMES.get(name, name.replace("-", "_"))


def image_settings(packages: Sequence[str], method: str) -> list[str]:
    """Containerfile instructions both methods add: the environment, and a label that
    says how the image was made."""
    label = "LABEL %s=%s" % (BUILD_IMAGE_LABEL, json.dumps("%s:%s" % (method, ",".join(packages))))
    return ["ENV %s" % setting for setting in IMAGE_ENVIRONMENT] + [label]


def containerfile(base: str, packages: Sequence[str]) -> str:
    """The pip recipe: the base image plus the packages, nothing else changed."""
    lines = ["FROM %s" % base, "RUN python3 -m pip install --no-cache-dir %s" % " ".join(packages)]
    return "\n".join(lines + image_settings(packages, "pip")) + "\n"


def apt_mirror(etc_apt: Path = Path("/etc/apt")) -> str | None:
    """The machine's own Debian mirror (deb822 .sources first, then sources.list)."""
    for path in sorted((etc_apt / "sources.list.d").glob("*.sources")):
        for match in re.finditer(r"^URIs:\s*(\S+)", path.read_text(errors="replace"), re.MULTILINE):
            if "security" not in match.group(1):
                return match.group(1)
    listing = etc_apt / "sources.list"
    if listing.exists():
        for match in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", listing.read_text(errors="replace"), re.M):
            if "security" not in match.group(1):
                return match.group(1)
    return None


def build_image_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, BUILD_IMAGE_COMMAND),
        description="Build a sandbox image with extra Python packages (default: numpy, pandas, "
        "matplotlib), then use it with MCP_BRIDGE_IMAGE=TAG. With a registry it is the default image "
        "plus pip; without one, a Debian %s with the packages' Debian builds (needs root and "
        "debootstrap)." % DEBIAN_SUITE,
    )
    parser.add_argument(
        "--packages",
        default=",".join(BATTERIES),
        help="comma-separated PyPI names, optionally pinned (name==1.2) [default: %(default)s]",
    )
    parser.add_argument("--tag", default=BATTERIES_TAG, help="the image to create [default: %(default)s]")
    parser.add_argument(
        "--from",
        dest="base",
        default=None,
        help="base image for the pip method [default: MCP_BRIDGE_IMAGE, else %s]" % BridgeConfig().image,
    )
    parser.add_argument(
        "--method",
        choices=("auto", "pip", "debian"),
        default="auto",
        help="auto: pip if the base image is here or can be pulled, else debian [default: auto]",
    )
    parser.add_argument("--runtime", choices=("podman", "docker"), default=None, help="default: detected")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would run on this machine (auto asks the base image's registry instead of "
        "pulling), build nothing",
    )
    return parser


def _stream(argv: Sequence[str], **kwargs: Any) -> None:
    """Run a build step with its output on our stderr (builds are long: the user sees them)."""
    logger.info("running: %s", " ".join(argv))
    result = subprocess.run(list(argv), stdout=sys.stderr, check=False, **kwargs)
    if result.returncode != 0:
        raise CommandError(
            "`%s` failed with exit status %d (output above)" % (" ".join(argv[:3]), result.returncode)
        )


def _build_with_pip(executable: str, base: str, packages: Sequence[str], tag: str, dry_run: bool) -> None:
    recipe = containerfile(base, packages)
    print("Containerfile:\n%s" % recipe, file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="mcp-build-image-"))
    try:
        (workdir / "Containerfile").write_text(recipe)
        argv = [executable, "build", "--tag", tag, "--file", str(workdir / "Containerfile"), str(workdir)]
        if dry_run:
            print(" ".join(argv))
            return
        _stream(argv)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def mounts_under(root: Path, mounts: Path = Path("/proc/self/mounts")) -> list[str]:
    """The mount points at or under ``root`` listed in ``mounts`` (the /proc/self/mounts
    format: fields split by spaces, a space in a path written as \\040). OSError when the
    table cannot be read."""
    found = []
    prefix = str(root).rstrip("/") + "/"
    for line in mounts.read_text(encoding="utf-8", errors="surrogateescape").splitlines():
        fields = line.split(" ")
        if len(fields) < 2:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[1])
        if point == str(root) or point.startswith(prefix):
            found.append(point)
    return found


def remove_build_root(root: Path, mounts: Path = Path("/proc/self/mounts")) -> str | None:
    """Remove the debootstrap target, unless something is still mounted in it (/proc, /sys
    or /dev of a debootstrap that was killed): removing it as root would then delete through
    the mount, into the host's own /dev or /sys. Returns what was left and why, or None."""
    # Defense in depth: never rmtree across a mount point.
    try:
        mounted = mounts_under(root.resolve(), mounts)
    except OSError as exc:
        return "left %s in place: the mount table %s cannot be read (%s); remove it by hand" % (
            root,
            mounts,
            exc,
        )
    if mounted:
        last_first = " ".join("'%s'" % point for point in reversed(mounted))  # inner ones first
        return (
            "left %s in place, because something is still mounted inside it (%s): unmount with "
            "`umount %s`, check that `grep '%s' /proc/self/mounts` finds nothing, then `rm -rf '%s'`"
            % (root, ", ".join(mounted), last_first, root, root)
        )
    shutil.rmtree(root, ignore_errors=True)
    return None


def _build_with_debian(executable: str, packages: Sequence[str], tag: str, dry_run: bool) -> None:
    if any(re.search("[<>=~]", package) for package in packages):
        raise CommandError("the debian method installs Debian's builds: versions cannot be pinned", 2)
    mirror = apt_mirror()
    if mirror is None:
        raise CommandError("no Debian mirror found in /etc/apt; use --method pip with a registry")
    include = ",".join(["python3", *(debian_package(package) for package in packages)])
    root = Path(tempfile.mkdtemp(prefix="mcp-build-image-"))
    debootstrap = ["debootstrap", "--variant=minbase", "--include=" + include, DEBIAN_SUITE, str(root)]
    debootstrap.append(mirror)
    changes = [part for setting in image_settings(packages, "debian") for part in ("--change", setting)]
    load = [executable, "import", *changes, "-", tag]
    try:
        if dry_run:
            print(" ".join(debootstrap))
            print("tar -C %s -c . | %s" % (root, " ".join(load)))
            return
        if shutil.which("debootstrap") is None or os.geteuid() != 0:
            raise CommandError(
                "the debian method needs root and debootstrap (apt-get install debootstrap); "
                "where a registry is reachable use --method pip instead"
            )
        _stream(debootstrap)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # downloaded .debs: 200+ MB
            shutil.rmtree(root / cache, ignore_errors=True)
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as archive:
            _stream(load, stdin=archive.stdout)
            if archive.wait() != 0:
                raise CommandError("archiving the root filesystem failed")
    finally:
        left = remove_build_root(root)
        if left is not None:
            print("%s %s: %s" % (SERVER_NAME, BUILD_IMAGE_COMMAND, left), file=sys.stderr)


REGISTRY_SECONDS = 120  # a dry run's question to the registry (a real pull has no bound)


def _can_use_base(engine: ContainerEngine, base: str, dry_run: bool) -> bool:
    """Whether the pip method has its base image: here, or pulled now. A dry run pulls
    nothing: it asks the image's registry for its manifest, which answers where a pull
    would work (the same registry, name resolution and credentials)."""
    if anyio.run(engine.has_image, base):
        return True
    if dry_run:
        print("%s is not here; asking its registry (a real run would pull it) ..." % base, file=sys.stderr)
        argv = [engine.executable, "manifest", "inspect", base]
        try:
            found = subprocess.run(
                argv, stdout=subprocess.DEVNULL, stderr=sys.stderr, timeout=REGISTRY_SECONDS, check=False
            )
        except subprocess.TimeoutExpired:
            print("%s did not answer within %ds." % (" ".join(argv), REGISTRY_SECONDS), file=sys.stderr)
            return False
        return found.returncode == 0
    print("Pulling %s ..." % base, file=sys.stderr)
    pulled = subprocess.run([engine.executable, "pull", base], stdout=sys.stderr, check=False)
    return pulled.returncode == 0


def _check_image(executable: str, tag: str, packages: Sequence[str]) -> None:
    modules = ", ".join(import_name(package) for package in packages) or "sys"
    argv = [executable, "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024"]
    argv += ["--ulimit", "nproc=512:512", "--user", "65534:65534", tag, "python3", "-c", "import " + modules]
    _stream(argv)
    print("Checked: `import %s` works in %s." % (modules, tag), file=sys.stderr)


def build_image_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    args = build_image_parser().parse_args(list(argv))  # a bad command line: usage, status 2
    config = load_config([], environ)
    packages = [part.strip() for part in args.packages.split(",") if part.strip()]
    bad = [package for package in packages if not _PACKAGE.fullmatch(package)]
    if bad:
        raise CommandError("not a package name: %s (write name or name==version)" % ", ".join(bad), 2)
    logging.basicConfig(level=config.log_level, stream=sys.stderr, format="%(levelname)s: %(message)s")
    try:
        engine = anyio.run(detect_engine, args.runtime or config.runtime)
    except EngineUnavailableError as exc:
        raise CommandError(engine_problem(exc)) from None
    base = args.base or config.image
    method = args.method
    if method == "auto":
        method = "pip" if _can_use_base(engine, base, args.dry_run) else "debian"
        if method == "debian" and args.base is not None:  # asked for: no silent substitute
            raise CommandError(
                "--from %s: %s neither has that image nor can pull it; pull or build it first, "
                "give another --from, or drop --from to let auto fall back to a Debian image "
                "(--method debian)" % (args.base, engine.name)
            )
        print("Method: %s." % method, file=sys.stderr)
    if method == "pip":
        _build_with_pip(engine.executable, base, packages, args.tag, args.dry_run)
    else:
        _build_with_debian(engine.executable, packages, args.tag, args.dry_run)
    if args.dry_run:
        return 0
    _check_image(engine.executable, args.tag, packages)
    print("Built %s. Use it: set MCP_BRIDGE_IMAGE=%s in the MCP server's environment." % (args.tag, args.tag))
    return 0


def log_workspace(config: BridgeConfig) -> None:
    """Says once, at start-up, which host folder the sandbox writes in, and as whom."""
    assert config.workspace is not None
    try:
        user = sandbox_user(config)
    except SandboxStartError:
        return  # gone since it was checked: the sandbox's start says so
    access = "read-only" if config.workspace.read_only else "read-write"
    logger.info("workspace: %s at %s (%s), sandbox user %s", config.workspace.path, WORKDIR, access, user)
    warning = workspace_warning(config)
    if warning:
        logger.warning(warning)


def configured_servers(config: BridgeConfig, environ: Mapping[str, str]) -> DiscoveryResult:
    """The servers the bridge offers, found here, with every problem (policy ones too)."""
    discovery = discover_servers(
        home=Path.home(),
        cwd=Path.cwd(),
        platform=sys.platform,
        environ=environ,
        state_dir=config.state_dir,
        explicit=config.servers_config,
        clients=config.discover,
        project_servers=config.project_servers,
    )
    return replace(discovery, problems=(*discovery.problems, *policy_problems(config, discovery.servers)))


def requested_transport(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The transport the command line or MCP_BRIDGE_TRANSPORT asks for, as written, when
    the other settings cannot be read: unknown flags are passed over, and a command line
    argparse cannot read at all is searched for the flag itself."""
    flag = next(option for option in OPTIONS if option.field == "transport")
    try:
        written = build_arg_parser().parse_known_args(list(argv))[0].transport
    except ConfigError:  # e.g. a flag without its value
        written = None
        for index, arg in enumerate(argv):
            if arg == flag.flag and index + 1 < len(argv):
                written = argv[index + 1]
            elif arg.startswith(flag.flag + "="):
                written = arg[len(flag.flag) + 1 :]
    return written or environ.get(flag.env) or BridgeConfig().transport


def started_by_stdio_client(argv: Sequence[str], environ: Mapping[str, str], stdin: Any) -> bool:
    """Whether a bad setting is answered over stdio (the misconfigured server) rather than
    by exit status 2 alone: the stdio transport, and a stdin that is no terminal (a person
    at a terminal reads the error line). HTTP exits: a network service fails loudly, and a
    bad transport value names no transport to serve."""
    try:
        terminal = stdin is None or stdin.isatty()
    except (AttributeError, OSError, ValueError):  # closed, or replaced by something odd
        terminal = True
    return not terminal and requested_transport(argv, environ) == "stdio"


# --- the login and logout subcommands --------------------------------------------------
# `login SERVER` runs a proxied HTTP server's OAuth login at a terminal (the link printed
# and opened in a browser, the redirect awaited on the loopback port), so that no call of
# code's has to ask for it; `logout SERVER` removes the tokens, and the next use logs in again.
LOGIN_COMMAND = "login"
LOGOUT_COMMAND = "logout"


def oauth_server(name: str, config: BridgeConfig, environ: Mapping[str, str]) -> ServerSpec:
    """The configured server ``name`` (its name or alias), which must be one with a login."""
    servers = configured_servers(config, environ).servers
    spec = next((spec for spec in servers if name in (spec.name, spec.alias)), None)
    if spec is None:
        raise CommandError(
            "no MCP server %r is configured (configured: %s)"
            % (name, ", ".join(sorted(spec.name for spec in servers)) or "none")
        )
    if not wants_oauth(spec):
        raise CommandError(
            "MCP server %r has no OAuth login: %s"
            % (
                spec.name,
                "its entry sets its own Authorization header"
                if spec.transport == "http"
                else "it is not a streamable HTTP server",
            )
        )
    return spec


def terminal_lines(fd: int) -> Iterator[str]:
    """The lines read from ``fd`` until its end, unbuffered: a daemon thread blocked in
    sys.stdin would hold its lock when the interpreter exits, which is a fatal error."""
    pending = b""
    while chunk := os.read(fd, 4096):
        pending += chunk
        *whole, pending = pending.split(b"\n")
        yield from (line.decode("utf-8", "replace") for line in whole)
    if pending:
        yield pending.decode("utf-8", "replace")


def forward_pasted_redirect(port: int, lines: Iterable[str]) -> None:
    """The address a browser on another machine ended on (its redirect to this machine's
    loopback port, which it cannot reach), pasted at the terminal: handed to that port, so
    the login finishes all the same."""
    import urllib.request

    for line in lines:
        pasted = urllib.parse.urlsplit(line.strip())
        if pasted.path == REDIRECT_PATH and pasted.query:
            try:
                back = "http://127.0.0.1:%d%s?%s" % (port, REDIRECT_PATH, pasted.query)
                urllib.request.urlopen(back, timeout=10).close()
                return
            except OSError as exc:  # the login stopped waiting, or the port is not its
                print("That address could not be handed to the login (%s)." % exc, file=sys.stderr)
                continue
        if line.strip():
            print(
                "That is not where the login ended (an address with %s?code=...)." % REDIRECT_PATH,
                file=sys.stderr,
            )


async def log_in(spec: ServerSpec, config: BridgeConfig, on_link: Callable[[str], None]) -> bool:
    """Connect to ``spec`` once with its login; whether the user had to log in (False: the
    stored tokens still work)."""
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client  # one of SDK_INTERNALS

    assert spec.url is not None
    login = ServerLogin(spec, config.state_dir, on_link)
    async with (
        create_mcp_http_client(headers=dict(spec.headers) or None, auth=login.provider()) as http,
        streamable_http_client(spec.url, http_client=http) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
    return login.link is not None


def login_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, LOGIN_COMMAND),
        description="Log in to a configured MCP server over HTTP that wants OAuth: print its "
        "login link (and open it in a browser), wait for the browser to come back, and keep the "
        "tokens in the state directory for the bridge. Takes the server's own flags too.",
    )
    parser.add_argument("server", help="the server's name in your MCP configuration")
    parser.add_argument("--no-browser", action="store_true", help="only print the link")
    args, settings = parser.parse_known_args(list(argv))
    config = load_config(settings, environ)
    spec = oauth_server(args.server, config, environ)

    def show(url: str) -> None:
        print("Open this link to log in to %s:\n\n  %s\n" % (spec.name, url), file=sys.stderr, flush=True)
        if not args.no_browser:
            import webbrowser

            with suppress(Exception):
                webbrowser.open(url)
        print(
            "Waiting up to %d minutes for the login... (A browser on another machine ends on a page "
            "that does not load: paste that page's address here.)" % (LOGIN_WAIT // 60),
            file=sys.stderr,
            flush=True,
        )
        port = urllib.parse.urlsplit(query_value(url, "redirect_uri") or "").port
        with suppress(AttributeError, OSError, ValueError):  # no stdin at all: nothing to paste
            if port is not None:
                lines = terminal_lines(sys.stdin.fileno())
                threading.Thread(target=forward_pasted_redirect, args=(port, lines), daemon=True).start()

    try:
        asked = anyio.run(log_in, spec, config, show)
    except Exception as exc:
        raise CommandError("the login to %s failed: %s" % (spec.name, _describe_exception(exc))) from None
    path = oauth_token_path(config.state_dir, spec.url or "")
    print(
        "%s %s; the tokens are in %s."
        % ("Logged in to" if asked else "Already logged in to", spec.name, path)
    )
    return 0


def logout_main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    parser = argparse.ArgumentParser(
        prog="%s %s" % (SERVER_NAME, LOGOUT_COMMAND),
        description="Remove the OAuth tokens of a configured MCP server: its next use logs in again.",
    )
    parser.add_argument("server", help="the server's name in your MCP configuration")
    parser.add_argument(
        "--principal", help="the HTTP bridge's principal whose own login to remove (else the bridge's)"
    )
    args, settings = parser.parse_known_args(list(argv))
    config = load_config(settings, environ)
    spec = oauth_server(args.server, config, environ)
    if args.principal is not None and not PRINCIPAL_NAME_PATTERN.fullmatch(args.principal):
        raise CommandError("%s is not a principal name" % ascii(args.principal[:70]))
    forgot = OAuthTokenFile(oauth_token_path(config.state_dir, spec.url or "", args.principal)).forget()
    whose = "" if args.principal is None else " for principal %s" % args.principal
    print(("Logged out of %s%s." if forgot else "%s had no login here%s.") % (spec.name, whose))
    return 0


SUBCOMMANDS: dict[str, Callable[[Sequence[str], Mapping[str, str]], int]] = {
    MEMORY_COMMAND: memory_main,
    TOOLS_COMMAND: tools_main,
    CALLS_COMMAND: calls_main,
    ADOPT_COMMAND: adopt_main,
    BUILD_IMAGE_COMMAND: build_image_main,
    DOCTOR_COMMAND: doctor_main,
    LOGIN_COMMAND: login_main,
    LOGOUT_COMMAND: logout_main,
}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The console script: a subcommand, else the MCP server. The one place a CommandError
    is shown: one line on stderr, after the command's name, and its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    command = args[0] if args[:1] and args[0] in SUBCOMMANDS else None
    try:
        if command is not None:
            return SUBCOMMANDS[command](args[1:], environ)
        return serve_main(args, environ)
    except CommandError as exc:
        print("%s: %s" % (" ".join([SERVER_NAME, *([command] if command else [])]), exc), file=sys.stderr)
        serving = command is None  # the MCP server itself, not a subcommand
        if serving and isinstance(exc, ConfigError) and started_by_stdio_client(args, environ, sys.stdin):
            # A client shows neither stderr nor the exit status: the model hears of it instead.
            with suppress(KeyboardInterrupt):
                anyio.run(serve_misconfigured, str(exc))
        return exc.status


def serve_main(args: Sequence[str], environ: Mapping[str, str]) -> int:
    """The MCP server, on the transport its settings name; ConfigError for a bad setting."""
    config = load_config(args, environ)
    logging.basicConfig(
        level=config.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    discovery = configured_servers(config, environ)
    for problem in discovery.problems:
        logger.warning("MCP server configuration: %s", problem)
    if config.workspace is not None:
        log_workspace(config)
    logger.info("MCP servers configured: %s", ", ".join(spec.alias for spec in discovery.servers) or "none")
    if config.transport == "http":
        verifier = None
        if config.oauth_issuer is not None:
            endpoints = discover_issuer(config.oauth_issuer, config.oauth_client_id is not None)
            verifier = OAuthTokenVerifier(config, endpoints)
            secret = config.oauth_client_secret_file
            if secret is not None and (warning := secret_file_warning(secret, "the client secret file")):
                logger.warning(warning)
            logger.info("taking OAuth access tokens of %s for %s", config.oauth_issuer, verifier.resource)
        try:
            listener = listen_socket(config.host, config.port)
        except OSError as exc:
            raise CommandError("cannot listen on %s port %d: %s" % (config.host, config.port, exc)) from None
        with listener:
            anyio.run(serve_http, config, discovery, listener, verifier)
        return 0
    try:
        anyio.run(serve, config, discovery)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
