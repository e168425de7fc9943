"""The HTTP transport (``--transport http``): the token file and the loopback rule without
containers; then the real bridge, started as a process, driven through the SDK's own
streamable HTTP client on real containers: state per principal, nothing of one
principal reachable by another, 401 without a valid token, caps, idle reaping, many
clients at once and a clean stop."""

from __future__ import annotations

import hashlib
import hmac
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx2
import pytest
from mcp import types
from mcp.client.session import ClientSession, ElicitationFnT
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.shared.exceptions import MCPError

import mcp_server_code_execution_mode as bridge
from tests.conftest import REPO, Engine, bridge_env, structured, text_of
from tests.harness import free_port

pytestmark = pytest.mark.anyio

ALICE = "alice-token-" + "a" * 32
BOB = "bob-token-" + "b" * 32
TOKENS = {"alice": ALICE, "bob": BOB}


# --- the token file and the loopback rule, without containers ---------------------------


def test_a_token_file_gives_each_token_its_principal_and_keeps_only_digests() -> None:
    text = "# team tokens\n\n%s alice\n  %s   bob  \n%s alice\n" % (ALICE, BOB, "alice-second-" + "c" * 20)
    digests = bridge.parse_auth_tokens(text)
    tokens = bridge.AuthTokens(Path("tokens"), digests)
    assert tokens.principal_of(ALICE) == "alice" and tokens.principal_of(BOB) == "bob"
    assert tokens.principal_of("alice-second-" + "c" * 20) == "alice"  # two tokens: rotation
    assert tokens.principals == {"alice", "bob"}
    for wrong in ("", ALICE[:-1], ALICE + "x", ALICE.upper(), "\udcff" * 20, "\ud800" * 20):
        assert tokens.principal_of(wrong) is None
    assert (hashlib.sha256(ALICE.encode()).digest(), "alice") in digests
    assert ALICE not in repr(tokens)  # defense in depth: no token kept, so none logged


def test_a_token_is_compared_with_every_digest_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defense in depth: stopping at the first match would tell by its timing where a token is.
    tokens = bridge.AuthTokens(Path("t"), bridge.parse_auth_tokens("%s alice\n%s bob\n" % (ALICE, BOB)))
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(known: bytes, given: bytes) -> bool:
        compared.append((known, given))
        return real(known, given)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for token, principal in ((ALICE, "alice"), (BOB, "bob"), ("x" * 40, None)):
        compared.clear()
        assert tokens.principal_of(token) == principal
        assert [known for known, _ in compared] == [digest for digest, _ in tokens.digests]
        assert {given for _, given in compared} == {hashlib.sha256(token.encode()).digest()}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("%s alice\nlonely-token-0123456789\n" % ALICE, "line 2: expected `TOKEN PRINCIPAL`"),
        (
            "%s alice extra\n" % ALICE,
            "line 1: expected `TOKEN PRINCIPAL` (two words separated by spaces), got 3",
        ),
        ("# c\nshort alice\n", "line 2: the token is 5 characters; use at least 16"),
        ("%s alice\n\n%s bob\n" % (ALICE, ALICE), "line 3: the same token as line 1"),
        ("%s ..\n" % ALICE, "line 1: the principal '..' is not 1-64 characters"),
        ("%s .hidden\n" % ALICE, "line 1: the principal '.hidden'"),
        ("%s a/b\n" % ALICE, "line 1: the principal 'a/b'"),
        ("%s %s\n" % (ALICE, "p" * 65), "line 1: the principal"),
        ("# only comments\n\n", "the file has no `TOKEN PRINCIPAL` line"),
    ],
)
def test_a_bad_token_file_is_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        bridge.parse_auth_tokens(text)
    assert message in str(caught.value)


def test_principal_names_reject_path_traversal() -> None:
    # A principal name becomes STATE_DIR/principals/<name>: never "..", never a separator.
    for name in ("..", ".", ".x", "a/b", "a\\b", "", "x" * 65, "a b", "ü"):
        assert not bridge.PRINCIPAL_NAME_PATTERN.fullmatch(name), name
    for name in ("alice", "team-1", "ci_bot", "a.b", "x" * 64):
        assert bridge.PRINCIPAL_NAME_PATTERN.fullmatch(name), name


def test_a_bad_token_file_stops_start_up_with_the_variable_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("%s alice\nnot-a-good-line\n" % ALICE)
    with pytest.raises(bridge.ConfigError, match=r"MCP_BRIDGE_AUTH_TOKENS=.* is invalid: line 2: expected"):
        bridge.load_config([], {"MCP_BRIDGE_AUTH_TOKENS": str(path)})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    assert bridge.is_loopback_host(host) is loopback


def test_a_non_loopback_host_needs_a_token_file(tmp_path: Path) -> None:
    with pytest.raises(bridge.ConfigError) as caught:
        bridge.load_config(["--transport", "http", "--host", "0.0.0.0"], {})
    assert "MCP_BRIDGE_HOST=0.0.0.0 is not a loopback address" in str(caught.value)
    assert "MCP_BRIDGE_AUTH_TOKENS" in str(caught.value)
    path = tmp_path / "tokens"
    path.write_text("%s alice\n" % ALICE)
    config = bridge.load_config(["--transport", "http", "--host", "0.0.0.0", "--auth-tokens", str(path)], {})
    assert config.auth_tokens is not None and config.auth_tokens.principals == {"alice"}
    assert bridge.load_config(["--transport", "http", "--host", "127.0.0.2"], {}).auth_tokens is None
    assert bridge.load_config(["--host", "0.0.0.0"], {}).transport == "stdio"  # stdio listens nowhere


# --- principals, without containers -------------------------------------------------------


def principals_for(group: anyio.abc.TaskGroup, state_dir: Path, **settings: Any) -> bridge.Principals:
    return bridge_for(group, state_dir, **settings).principals


def bridge_for(group: anyio.abc.TaskGroup, state_dir: Path, **settings: Any) -> bridge.Bridge:
    """An HTTP bridge of principals alice and bob, its sandboxes never started."""
    tokens = bridge.AuthTokens(
        state_dir / "tokens", bridge.parse_auth_tokens("%s alice\n%s bob\n" % (ALICE, BOB))
    )
    config = bridge.BridgeConfig(state_dir=state_dir, transport="http", auth_tokens=tokens, **settings)
    pool: Any = SimpleNamespace(drain_notices=list)
    pool.of_principal = lambda name: pool  # no server with a login
    sessions = bridge.Sandboxes(config, group, bridge.SharedEngine(config), shared=True)
    return bridge.Bridge(config, pool, sessions)


def run_request(principal: bridge.Principal, session: str) -> bridge.RunRequest:
    return bridge.RunRequest(code="1", timeout=5, reset=False, session_name=session, principal=principal)


def request_of(principal: str) -> Any:
    user = AuthenticatedUser(AccessToken(token="", client_id=principal, scopes=[]))
    return SimpleNamespace(scope={"user": user})


async def test_each_principal_has_its_own_sessions_and_store(tmp_path: Path) -> None:
    async with anyio.create_task_group() as group:
        world = bridge_for(group, tmp_path)
        principals, sessions = world.principals, world.sandboxes
        alice, bob = principals.of_request(request_of("alice")), principals.of_request(request_of("bob"))
        assert principals.of_request(request_of("alice")) is alice and alice is not bob
        assert sessions.keeper(alice, "s1") is not sessions.keeper(bob, "s1")
        assert sessions.keeper(alice, "s1").api is alice.api  # its store, not bob's
        assert sessions.keeper(bob, "s1").api is bob.api
        assert alice.api.memory.path == tmp_path / "principals" / "alice" / "user_tools" / "memory.sqlite3"
        assert bob.api.saved_tools.directory == tmp_path / "principals" / "bob" / "user_tools"
        assert sessions.keeper(alice, "s1").shared_engine is sessions.keeper(bob, "s1").shared_engine
        group.cancel_scope.cancel()


async def test_a_request_without_an_authenticated_principal_is_refused(tmp_path: Path) -> None:
    async with anyio.create_task_group() as group:
        principals = principals_for(group, tmp_path)
        for request in (None, SimpleNamespace(scope={}), SimpleNamespace(scope={"user": "alice"})):
            with pytest.raises(bridge.UnauthenticatedError, match="no authenticated principal"):
                principals.of_request(request)
        with pytest.raises(bridge.UnauthenticatedError, match="not a valid principal name"):
            principals.of_request(request_of("../alice"))
        assert principals.by_name == {}
        group.cancel_scope.cancel()


async def test_a_principal_first_seen_while_the_bridge_stops_is_refused_and_gets_no_store(
    tmp_path: Path,
) -> None:
    async with anyio.create_task_group() as group:
        opened = bridge_for(group, tmp_path)
        principals = opened.principals
        alice = principals.of_request(request_of("alice"))
        opened.sandboxes.closing.set()  # as begin_shutdown sets it
        assert principals.of_request(request_of("alice")) is alice  # a known one keeps its store
        with pytest.raises(bridge.ShuttingDownError):
            principals.of_request(request_of("bob"))
        assert list(principals.by_name) == ["alice"]
        assert not (tmp_path / "principals" / "bob").exists()
        group.cancel_scope.cancel()


async def test_stdio_keeps_one_principal_and_todays_store(tmp_path: Path) -> None:
    async with anyio.create_task_group() as group:
        pool: Any = SimpleNamespace(drain_notices=list)
        principals = bridge.Principals(bridge.BridgeConfig(state_dir=tmp_path), pool, False, bridge.Closing())
        local = principals.of_request(None)
        assert local.name == bridge.LOCAL_PRINCIPAL and principals.of_request(request_of("bob")) is local
        assert local.api.memory.path == tmp_path / "user_tools" / "memory.sqlite3"
        group.cancel_scope.cancel()


async def test_the_caps_on_calls_and_on_all_sessions_refuse_at_once_naming_no_one_else(
    tmp_path: Path,
) -> None:
    async with anyio.create_task_group() as group:
        world = bridge_for(group, tmp_path, max_total_sessions=2, max_calls_per_principal=1)
        sessions = world.sandboxes
        alice, bob = world.principals.get("alice"), world.principals.get("bob")
        sessions.keeper(alice, "secret-name").sandbox = object()  # type: ignore[assignment]  # as if it ran
        sessions.keeper(bob, "b1").sandbox = object()  # type: ignore[assignment]
        with pytest.raises(bridge.TooManySessionsError) as caught:
            await sessions.run(run_request(bob, "b2"))
        message = str(caught.value)
        assert "MCP_BRIDGE_MAX_TOTAL_SESSIONS" in message and "2 sessions" in message
        assert "secret-name" not in message and "alice" not in message
        assert sessions.health() == {"status": "ok", "principals": 2, "sessions": 2}
        sessions.calls["alice"] = 1
        with pytest.raises(bridge.TooManyCallsError, match="MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL"):
            await sessions.run(run_request(alice, "secret-name"))
        group.cancel_scope.cancel()


# --- the real bridge over HTTP --------------------------------------------------------------


def bridge_argv(*args: str) -> list[str]:
    # `python -m` from the repository: the module under test, whichever checkout runs it.
    return [sys.executable, "-m", "mcp_server_code_execution_mode", "--transport", "http", *args]


@dataclass
class HttpBridge:
    process: subprocess.Popen[bytes]
    base: str
    log: Path

    @property
    def url(self) -> str:
        return self.base + "/mcp"

    async def health(self) -> dict[str, Any]:
        async with httpx2.AsyncClient() as http:
            answer = await http.get(self.base + "/health", timeout=5)
        assert answer.status_code == 200, answer.text
        data: dict[str, Any] = answer.json()
        return data


@asynccontextmanager
async def http_bridge(
    engine: Engine,
    state_dir: Path,
    *args: str,
    tokens: dict[str, str] | None = TOKENS,
    listen: str = "127.0.0.1",
    **env: str,
) -> AsyncIterator[HttpBridge]:
    """The bridge as a process on a free loopback port (of ``listen``), ready once /health
    answers. On leaving: SIGTERM, a clean exit within seconds, and not one container of it left."""
    port = free_port()
    if listen != "127.0.0.1":
        args = ("--host", listen, *args)
    overrides = {"MCP_BRIDGE_" + name.upper(): setting for name, setting in env.items()}
    if tokens is not None:
        path = state_dir.parent / "tokens"
        path.write_text("".join("%s %s\n" % (token, name) for name, token in tokens.items()))
        path.chmod(0o600)
        overrides["MCP_BRIDGE_AUTH_TOKENS"] = str(path)
    home = state_dir.parent / "home"  # no MCP client config of the developer's is read
    home.mkdir(exist_ok=True)
    environ = bridge_env(engine, state_dir, MCP_BRIDGE_LOG_LEVEL="INFO", HOME=str(home), **overrides)
    environ.pop("XDG_CONFIG_HOME", None)
    log = state_dir.parent / "bridge.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            bridge_argv("--port", str(port), *args),
            env=environ,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stderr=stderr,
        )
    running = HttpBridge(process, "http://%s:%d" % (listen, port), log)
    try:
        with anyio.fail_after(30):
            while True:
                assert process.poll() is None, "the bridge exited: " + log.read_text()
                try:
                    await running.health()
                    break
                except httpx2.TransportError:
                    await anyio.sleep(0.1)
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            status = await anyio.to_thread.run_sync(lambda: process.wait(20))
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        stopped = time.monotonic() - started
    assert status == 0, log.read_text()
    assert stopped < 10, "stopping took %.1fs" % stopped
    assert engine.containers(running_only=False, owner_pid=process.pid) == [], log.read_text()


@asynccontextmanager
async def http_client(
    url: str, token: str | None, elicitation: ElicitationFnT | None = None
) -> AsyncIterator[ClientSession]:
    """The SDK's own streamable HTTP client, with ``token`` as its bearer token;
    ``elicitation``: its answer to elicitation requests (given, it declares the capability)."""
    headers = {"Authorization": "Bearer " + token} if token is not None else {}
    timeout = httpx2.Timeout(30, read=300)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write, elicitation_callback=elicitation) as session,
    ):
        await session.initialize()
        yield session


async def call(client: ClientSession, code: str, session: str | None = None) -> dict[str, Any]:
    arguments: dict[str, Any] = {"code": textwrap.dedent(code)}
    if session is not None:
        arguments["session"] = session
    result = await client.call_tool("run_python", arguments)
    raw = result.structured_content
    view = structured(result) if isinstance(raw, dict) else None
    return {"view": view, "text": text_of(result), "is_error": result.is_error}


# A raw initialize request: what a client (or a flood of them) sends to open an MCP session.
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def value(result: dict[str, Any]) -> Any:
    assert result["view"] is not None and result["view"]["status"] == "ok", result
    return result["view"]["json"]


async def test_principals_keep_their_state_and_see_nothing_of_each_other(
    engine: Engine, state_dir: Path
) -> None:
    async with (
        http_bridge(engine, state_dir) as running,
        http_client(running.url, ALICE) as alice,
        http_client(running.url, BOB) as bob,
    ):
        assert value(await call(alice, "x = 41")) is None
        assert value(await call(alice, "x + 1")) == 42
        assert value(await call(alice, "y = 'alice s1'; y", session="s1")) == "alice s1"
        saved = await call(
            alice,
            """
            save_memory("k", 1)
            def secret():
                return "alice's"
            save_tool(secret)
            """,
        )
        assert not saved["is_error"], saved

        for code, session in (("x", None), ("y", "s1"), ("secret()", None)):
            seen = await call(bob, code, session)
            assert seen["view"]["status"] == "error" and "NameError" in seen["text"], seen
        assert value(await call(bob, "load_memory('k', 'nothing')")) == "nothing"
        assert value(await call(bob, "[list_memories(), list_saved_tools(), memory_exists('k')]")) == [
            [],
            [],
            False,
        ]
        # Alice's sessions share her store, not their namespaces.
        assert value(await call(alice, "[load_memory('k'), y, 'x' in globals()]", session="s1")) == [
            1,
            "alice s1",
            False,
        ]

        # Each principal's own resources: the manual, and only its own memories and tools.
        alice_uris = {str(r.uri) for r in (await alice.list_resources()).resources}
        bob_uris = {str(r.uri) for r in (await bob.list_resources()).resources}
        assert alice_uris == {bridge.CAPABILITIES_URI, "memory://k", "tool://secret"}
        assert bob_uris == {bridge.CAPABILITIES_URI}
        for uri in ("memory://k", "tool://secret"):
            with pytest.raises(MCPError, match=r"No (memory|saved tool) named"):
                await bob.read_resource(uri)
        assert (state_dir / "principals" / "alice" / "user_tools" / "memory.sqlite3").is_file()
        assert not (state_dir / "user_tools").exists()  # the stdio store stays untouched

        assert await running.health() == {"status": "ok", "principals": 2, "sessions": 4, "mcp_sessions": 2}


async def test_no_token_or_a_wrong_token_gets_401_and_no_session_crosses_principals(
    engine: Engine, state_dir: Path
) -> None:
    initialize, accept = INITIALIZE, ACCEPT
    async with http_bridge(engine, state_dir) as running, httpx2.AsyncClient(timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer " + ALICE + "x"}, {"Authorization": "Basic " + ALICE}):
            refused = await http.post(running.url, json=initialize, headers={**accept, **headers})
            assert refused.status_code == 401, refused.text
            assert refused.headers["www-authenticate"].startswith("Bearer ")
            assert refused.json()["error"] == "invalid_token"
        with pytest.raises(ExceptionGroup) as caught:  # the SDK's client too: it cannot even initialize
            async with http_client(running.url, "not-a-token-of-this-bridge"):
                pass
        assert caught.group_contains(MCPError, depth=None) or caught.group_contains(httpx2.HTTPStatusError)

        opened = await http.post(
            running.url, json=initialize, headers={**accept, "Authorization": "Bearer " + ALICE}
        )
        assert opened.status_code == 200, opened.text
        session_id = opened.headers["mcp-session-id"]
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        as_bob = {**accept, "Authorization": "Bearer " + BOB, "Mcp-Session-Id": session_id}
        stolen = await http.post(running.url, json=listing, headers=as_bob)
        assert stolen.status_code == 404  # alice's MCP session is not bob's, even with its id
        assert await running.health() == {"status": "ok", "principals": 0, "sessions": 0, "mcp_sessions": 1}


def test_a_non_loopback_address_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    env = bridge_env(None, tmp_path, HOME=str(tmp_path))
    started = time.monotonic()
    result = subprocess.run(
        bridge_argv("--host", "0.0.0.0", "--port", str(free_port())),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result
    # A hang guard, not a speed figure: it refuses before looking for an engine (which may
    # wait 20 s for one to answer); a loaded machine takes a few seconds to import the bridge.
    assert time.monotonic() - started < 15
    assert "MCP_BRIDGE_HOST=0.0.0.0 is not a loopback address" in result.stderr
    assert "refusing to start without bearer tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            bridge_argv("--port", str(port)),
            env=bridge_env(None, tmp_path, HOME=str(tmp_path)),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert result.returncode == 1 and "cannot listen on 127.0.0.1 port %d" % port in result.stderr, result
    assert "Traceback" not in result.stderr


@pytest.fixture
def first_engine(proxy_engine: Engine) -> Engine:
    """Runtime-independent HTTP behaviour runs on the first requested runtime only."""
    return proxy_engine


async def test_twenty_clients_of_twenty_calls_each_get_their_own_results(
    first_engine: Engine, state_dir: Path
) -> None:
    principals = {"p%d" % n: "token-of-principal-%d-%s" % (n, "z" * 20) for n in range(4)}
    names = sorted(principals)

    async def client(number: int, results: dict[int, list[Any]]) -> None:
        principal = names[number % len(names)]
        async with http_client(running.url, principals[principal]) as session:
            got = [value(await call(session, "mine = [%d]; mine" % number, session="c%d" % number))]
            for index in range(1, 20):
                code = "mine.append(%d * 1000 + %d); (len(mine), mine[-1], mine[0])" % (number, index)
                got.append(value(await call(session, code, session="c%d" % number)))
            results[number] = got

    started = time.monotonic()
    async with http_bridge(first_engine, state_dir, tokens=principals) as running:
        results: dict[int, list[Any]] = {}
        async with anyio.create_task_group() as group:
            for number in range(20):
                group.start_soon(client, number, results)
        for number in range(20):
            expected = [[number]] + [[index + 1, number * 1000 + index, number] for index in range(1, 20)]
            assert results[number] == expected, number
        health = await running.health()
        assert (health["principals"], health["sessions"]) == (4, 20), health
    assert time.monotonic() - started < 90


async def test_caps_are_clear_errors_and_idle_sessions_are_reaped(
    first_engine: Engine, state_dir: Path
) -> None:
    caps = http_bridge(
        first_engine,
        state_dir,
        max_sessions="2",
        max_total_sessions="3",
        max_calls_per_principal="2",
        idle_timeout="3",
    )
    async with (
        caps as running,
        http_client(running.url, ALICE) as alice,
        http_client(running.url, BOB) as bob,
    ):
        assert value(await call(alice, "1", session="a1")) == 1
        assert value(await call(alice, "2", session="a2")) == 2
        over = await call(alice, "3", session="a3")
        assert over["is_error"] and "MCP_BRIDGE_MAX_SESSIONS" in over["text"], over
        assert value(await call(bob, "1", session="b1")) == 1
        total = await call(bob, "2", session="b2")
        assert total["is_error"] and "MCP_BRIDGE_MAX_TOTAL_SESSIONS" in total["text"], total
        assert "a1" not in total["text"] and "alice" not in total["text"]
        assert await running.health() == {"status": "ok", "principals": 2, "sessions": 3, "mcp_sessions": 2}

        async with anyio.create_task_group() as group:
            for session in ("a1", "a2"):
                group.start_soon(call, alice, "import time; time.sleep(4)", session)
            await anyio.sleep(1.5)  # both calls are in their sandboxes by now (warm: milliseconds)
            asked = time.monotonic()
            busy = await call(alice, "1", session="a1")
            assert time.monotonic() - asked < 2, "the cap must answer at once, not wait"
            assert busy["is_error"] and "MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL" in busy["text"], busy
            assert value(await call(bob, "'bob is not capped by alice'", session="b1"))

        with anyio.fail_after(30):  # idle for 3 s: every sandbox stopped, no container left
            while (await running.health())["sessions"]:
                await anyio.sleep(0.5)
        assert await running.health() == {"status": "ok", "principals": 0, "sessions": 0, "mcp_sessions": 2}
        assert first_engine.containers(running_only=False, owner_pid=running.process.pid) == []
        again = await call(alice, "'back'", session="a1")
        assert value(again) == "back" and "without a call" in " ".join(again["view"]["notices"])
        assert value(await call(bob, "'room again'", session="b2")) == "room again"


async def test_without_tokens_loopback_callers_are_the_local_user(
    first_engine: Engine, state_dir: Path
) -> None:
    async with (
        http_bridge(first_engine, state_dir, tokens=None, prewarm="0") as running,
        http_client(running.url, None) as local,
    ):
        assert value(await call(local, "save_memory('k', 'local'); load_memory('k')")) == "local"
        assert (state_dir / "user_tools" / "memory.sqlite3").is_file()  # the stdio bridge's own store
        assert not (state_dir / "principals").exists()
        async with httpx2.AsyncClient(timeout=10) as http:  # a page reached through DNS rebinding
            rebound = await http.post(running.url, json={}, headers={"Host": "attacker.example:80"})
        assert rebound.status_code in (400, 421), rebound.text
    assert "HTTP without MCP_BRIDGE_AUTH_TOKENS" in running.log.read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_stop_signal_answers_calls_in_flight_and_removes_every_principals_sandbox(
    first_engine: Engine, state_dir: Path, signum: signal.Signals
) -> None:
    async with (
        http_bridge(first_engine, state_dir) as running,
        http_client(running.url, ALICE) as alice,
        http_client(running.url, BOB) as bob,
    ):
        assert value(await call(alice, "1")) == 1 and value(await call(bob, "2", session="b")) == 2
        assert len(first_engine.containers(owner_pid=running.process.pid)) == 2
        results: list[dict[str, Any]] = []

        async def long_call() -> None:
            results.append(await call(alice, "import time; time.sleep(30)"))

        async with anyio.create_task_group() as group:
            group.start_soon(long_call)
            await anyio.sleep(1)
            running.process.send_signal(signum)
        assert results and results[0]["is_error"] and "shutting down" in results[0]["text"], results
    # http_bridge's exit checked the exit status, the time and that no container is left.
    assert "Traceback" not in running.log.read_text()


# --- co-tenants: what one caller must not take from the others (issue 16) -----------------


async def test_one_principal_cannot_use_up_the_mcp_sessions_of_all(
    first_engine: Engine, state_dir: Path
) -> None:
    capped = http_bridge(
        first_engine, state_dir, prewarm="0", max_mcp_sessions_per_principal="3", mcp_session_idle_timeout="5"
    )
    async with capped as running, httpx2.AsyncClient(timeout=10) as http:
        as_alice = {**ACCEPT, "Authorization": "Bearer " + ALICE}
        answers = [await http.post(running.url, json=INITIALIZE, headers=as_alice) for _ in range(8)]
        assert [answer.status_code for answer in answers] == [200] * 3 + [429] * 5, answers
        refused = answers[-1].json()["error"]["message"]
        assert "already holds 3 open MCP sessions" in refused, refused
        assert "MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL" in refused and "DELETE" in refused, refused
        assert (await running.health())["mcp_sessions"] == 3

        async with http_client(running.url, BOB) as bob:  # bob is not locked out by alice's flood
            assert (await running.health())["mcp_sessions"] == 4  # (within alice's 5 s of idleness)
            assert value(await call(bob, "'bob runs'")) == "bob runs"
            with anyio.fail_after(30):  # alice's sessions, idle for 5 s, are closed; bob's is in use
                while (await running.health())["mcp_sessions"] > 1:
                    await anyio.sleep(0.2)
            assert value(await call(bob, "'still here'")) == "still here"
        again = await http.post(running.url, json=INITIALIZE, headers=as_alice)
        assert again.status_code == 200, again.text


async def test_one_principals_heavy_listings_leave_another_principal_served(
    first_engine: Engine, state_dir: Path
) -> None:
    # Issue 16 item 5: 40 saved tools of 240 KB each, listed by alice in parallel. Listing
    # used to parse every tool in anyio's shared thread pool: parallel listings failed
    # ("AST constructor recursion depth mismatch") and bob's pings waited up to 13.8 s.
    from tests.test_memory_resources import big_tool

    tools = bridge.SavedTools(state_dir / bridge.PRINCIPALS_DIRNAME / "alice" / bridge.MEMORY_DIRNAME)
    for n in range(40):
        tools.save("big_%d" % n, big_tool(n))
    expected = sorted(bridge.tool_uri("big_%d" % n) for n in range(40))
    listed: list[list[str]] = []
    pings: list[float] = []
    bridge_process = http_bridge(first_engine, state_dir, prewarm="0")
    async with bridge_process as running, http_client(running.url, BOB) as bob:
        await bob.send_ping()

        async def alice_lists() -> None:
            async with http_client(running.url, ALICE) as alice:
                for _ in range(3):
                    resources = (await alice.list_resources()).resources
                    listed.append(
                        sorted(str(r.uri) for r in resources if str(r.uri) != bridge.CAPABILITIES_URI)
                    )

        async def bob_pings(done: anyio.Event) -> None:
            while not done.is_set():
                started = time.monotonic()
                await bob.send_ping()
                pings.append(time.monotonic() - started)
                await anyio.sleep(0.05)

        done = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(bob_pings, done)
            async with anyio.create_task_group() as listings:
                for _ in range(4):
                    listings.start_soon(alice_lists)
            done.set()
    assert listed == [expected] * 12  # every parallel listing whole and right
    assert pings, "bob was never answered while alice listed"
    # A hang guard, not a speed target (bench_cotenant measures that): before, 13.8 s.
    assert max(pings) < 5, pings


def slow_connections(port: int, count: int) -> list[socket.socket]:
    """Slowloris: connections that send a request line and one header, and no more yet."""
    opened = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        connection.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        opened.append(connection)
    return opened


def trickle_until_closed(connections: list[socket.socket], within: float) -> float:
    """Send each connection one more header line every 0.2 s until the bridge closes it;
    how long that took. AssertionError if some are still open after ``within`` seconds."""
    started, open_ = time.monotonic(), list(connections)
    while open_ and time.monotonic() - started < within:
        for connection in list(open_):
            try:
                connection.sendall(b"X-Slow: 1\r\n")
                connection.settimeout(0.01)
                connection.recv(4096)  # an answer (408) or the end of the stream: the bridge closed it
            except TimeoutError:
                continue  # still open
            except OSError:  # reset: closed too
                pass
            open_.remove(connection)
            connection.close()
        time.sleep(0.2)
    assert not open_, "%d slow connections still open after %gs" % (len(open_), within)
    return time.monotonic() - started


def raw_get(port: int, path: str) -> bytes:
    """A whole GET request on a new connection; the bridge's answer, up to its close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(
            b"GET %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % (path.encode(), port)
        )
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
        return answer


def event_stream(port: int, session_id: str) -> socket.socket:
    """A whole request that stays in flight: an MCP session's GET event stream, open."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=5)
    connection.sendall(
        (
            "GET /mcp HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
            "Accept: text/event-stream\r\nMcp-Session-Id: %s\r\nMcp-Protocol-Version: 2025-06-18\r\n\r\n"
            % (port, ALICE, session_id)
        ).encode()
    )
    assert connection.recv(4096).startswith(b"HTTP/1.1 200 ")
    return connection


async def test_slow_connections_make_room_for_real_clients_and_are_cut_off(
    first_engine: Engine, state_dir: Path
) -> None:
    guarded = http_bridge(
        first_engine, state_dir, prewarm="0", http_request_timeout="3", http_max_connections="4"
    )
    async with guarded as running:
        port = int(running.base.rsplit(":", 1)[1])
        slow = await anyio.to_thread.run_sync(slow_connections, port, 4)
        try:
            asked = time.monotonic()  # one more: the slowest makes room, the real client is served
            served = await anyio.to_thread.run_sync(raw_get, port, "/health")
            assert time.monotonic() - asked < 5, "a real client must not wait for the slow ones"
            assert served.startswith(b"HTTP/1.1 200 "), served
            slow[0].settimeout(5)
            assert slow[0].recv(4096).startswith(b"HTTP/1.1 408 ")  # the oldest unfinished request
            took = await anyio.to_thread.run_sync(trickle_until_closed, slow[1:], 10.0)
            assert took < 10  # hang detector; they are closed about 3 s after they opened
        finally:
            for connection in slow:
                connection.close()

        # Every connection serving a whole request: one more is refused at once, and clearly.
        async with httpx2.AsyncClient(timeout=10, headers={"Connection": "close"}) as http:
            as_alice = {**ACCEPT, "Authorization": "Bearer " + ALICE, "Connection": "close"}
            opened = [await http.post(running.url, json=INITIALIZE, headers=as_alice) for _ in range(4)]
        streams = [
            await anyio.to_thread.run_sync(event_stream, port, answer.headers["mcp-session-id"])
            for answer in opened
        ]
        try:
            asked = time.monotonic()
            refused = await anyio.to_thread.run_sync(raw_get, port, "/health")
            assert time.monotonic() - asked < 5, "one connection too many must be refused at once"
            assert refused.startswith(b"HTTP/1.1 503 "), refused
            assert b"MCP_BRIDGE_HTTP_MAX_CONNECTIONS" in refused, refused
        finally:
            for stream in streams:
                stream.close()
        with anyio.fail_after(10):  # the streams' ends reach the bridge: a normal client is served again
            while True:
                try:
                    async with http_client(running.url, ALICE) as alice:
                        assert (await alice.list_tools()).tools[0].name == "run_python"
                    break
                except* (httpx2.HTTPStatusError, MCPError):
                    await anyio.sleep(0.2)


async def test_running_code_counts_toward_the_calls_a_principal_may_have(
    first_engine: Engine, state_dir: Path
) -> None:
    capped = http_bridge(
        first_engine,
        state_dir,
        prewarm="0",
        respond_after="1",
        max_calls_per_principal="2",
        max_total_sessions="3",
    )
    async with (
        capped as running,
        http_client(running.url, ALICE) as alice,
        http_client(running.url, BOB) as bob,
    ):
        for session in ("a1", "a2"):  # answered "still running"; no call of alice's is in flight
            started = await call(alice, "import time; time.sleep(120)", session=session)
            assert started["view"]["status"] == "running", started
        over = await call(alice, "1", session="a3")
        assert over["is_error"] and "MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL" in over["text"], over
        assert "still running code (sessions a1, a2)" in over["text"], over
        assert "reset: true" in over["text"], over
        waited = await call(alice, "1", session="a1")  # her own running code: she may wait for it
        assert waited["view"]["status"] == "running" and not waited["is_error"], waited
        bobs = await call(bob, "'bob still runs'", session="b1")
        if bobs["view"] is not None and bobs["view"]["status"] == "running":
            # His sandbox took longer than respond_after (1 s) to start on a loaded machine:
            # still served, not refused; the next call brings the value.
            bobs = {**bobs, "view": (await call(bob, "None", session="b1"))["view"]["earlier"]}
        assert value(bobs) == "bob still runs"
        assert (await running.health())["sessions"] == 3


async def test_a_loopback_address_other_than_127_0_0_1_serves_requests(
    first_engine: Engine, state_dir: Path
) -> None:
    async with (
        http_bridge(first_engine, state_dir, tokens=None, listen="127.0.0.2", prewarm="0") as running,
        http_client(running.url, None) as local,
    ):
        assert (await local.list_tools()).tools[0].name == "run_python"
        manual = await local.read_resource(bridge.CAPABILITIES_URI)
        assert "run_python sandbox manual" in manual.contents[0].text  # type: ignore[union-attr]
        async with httpx2.AsyncClient(timeout=10) as http:  # other Host names are still refused
            rebound = await http.post(running.url, json={}, headers={"Host": "attacker.example:80"})
        assert rebound.status_code in (400, 421), rebound.text


async def test_large_attachments_and_notices_still_arrive_through_the_sdk_client(
    engine: Engine, state_dir: Path
) -> None:
    # The SDK's client drops a server-sent event over 1 MiB: an 800 KB file (within the
    # 5 MB attachment cap) is left out with a note, the small one still comes.
    async with http_bridge(engine, state_dir) as running, http_client(running.url, ALICE) as alice:
        result = await alice.call_tool(
            "run_python",
            {
                "code": textwrap.dedent(
                    """
                    import os
                    open("/tmp/big.bin", "wb").write(os.urandom(800_000))
                    open("/tmp/small.txt", "w").write("hello")
                    runtime.attach("/tmp/big.bin")
                    runtime.attach("/tmp/small.txt")
                    """
                )
            },
        )
        files = [block for block in result.content if isinstance(block, types.EmbeddedResource)]
        assert [str(block.resource.uri) for block in files] == ["file:///tmp/small.txt"], result.content
        text = text_of(result)
        assert "File 1 (/tmp/big.bin" in text and "too large for this transport" in text, text
        assert "stays in the sandbox at /tmp/big.bin" in text and str(bridge.HTTP_MAX_RESULT_BYTES) in text
        # 1.6 MB of notices from a kernel patched from inside: cut to the budget, and delivered.
        noisy = await call(
            alice,
            """
            channel = runtime.call_tool.__self__._requests.channel
            send = channel.send
            def inflate(frame):
                if frame.get("type") == "result":
                    channel.send = send
                    frame["notices"] = ["n" * 200_000] * 8
                send(frame)
            channel.send = inflate
            """,
        )
        assert "more notice(s) left out" in noisy["text"] and len(noisy["text"]) < 30_000, noisy["text"][:200]
        assert value(await call(alice, "1 + 1")) == 2
