"""OAuth to proxied HTTP servers (issue 23, part 1): a streamable-HTTP server that wants a
login (tests/servers/oauth_server.py: its own authorization server, on loopback) is used
from sandbox code after the user opens the link the call returns; the token is refreshed
when it expires, never reaches the sandbox, and `logout` forces a new login. The browser
is an HTTP client that follows the authorization server's redirect to the bridge's
loopback port (the test server approves at once: a consent page is the one step a test
cannot click)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import httpx2
import mcp_types as types
import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, claude_desktop_home, console_script, run_cell
from tests.harness import free_port, isolated_env, local_server, wait_for_port

OAUTH_SERVER = Path(__file__).parent / "servers" / "oauth_server.py"
LINK = re.compile(r"http://127\.0\.0\.1:\d+/authorize\?[^\s'\"]+")

pytestmark = pytest.mark.anyio


@contextmanager
def oauth_server(token_seconds: int = 3600, issuer: str | None = None) -> Iterator[str]:
    """The OAuth stub serving on a free loopback port: its MCP endpoint's URL. ``issuer``:
    the authorization server its metadata names instead of itself."""

    def argv(port: int) -> list[str]:
        extra = ["--issuer", issuer] if issuer else []
        return [sys.executable, str(OAUTH_SERVER), str(port), "--token-seconds", str(token_seconds), *extra]

    with local_server(argv, "the OAuth test server") as port:
        yield "http://127.0.0.1:%d/mcp" % port


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The console script's subcommand ``args`` (login, logout) with ``env``."""
    return subprocess.run(
        [console_script(), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def the_link(text: str) -> str:
    found = LINK.search(text)
    assert found is not None, "no login link in: %s" % text[:2000]
    return found.group()


async def open_in_browser(link: str) -> str:
    """What a browser does with the link: the authorization server approves and redirects
    to the bridge's loopback port, whose page ends the login."""
    async with httpx2.AsyncClient(follow_redirects=True, timeout=30) as browser:
        page = await browser.get(link)
    assert page.status_code == 200, page.text
    return page.text


def token_file(state_dir: Path) -> Path:
    files = list((state_dir / bridge.OAUTH_DIR).glob("*.json"))
    assert len(files) == 1, files
    return files[0]


# --- the token file and the redirect, without a server ---------------------------------


async def test_the_token_file_is_private_atomic_and_a_damaged_one_counts_as_no_login(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

    tokens = bridge.OAuthTokenFile(tmp_path / "oauth" / "server.json")
    assert await tokens.get_tokens() is None and await tokens.get_client_info() is None
    port = tokens.redirect_port()
    assert tokens.redirect_port() == port and not tokens.path.exists()  # chosen, kept with a registration
    await tokens.set_tokens(OAuthToken(access_token="a", expires_in=60, refresh_token="r"))
    await tokens.set_client_info(OAuthClientInformationFull(client_id="c", redirect_uris=None))
    assert stat.S_IMODE(tokens.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(tokens.path.parent.stat().st_mode) == 0o700
    stored = await tokens.get_tokens()
    assert stored is not None and stored.access_token == "a" and stored.refresh_token == "r"
    assert 50 < tokens.read()["expires_at"] - time.time() <= 60  # a restarted bridge knows the expiry
    assert (await tokens.get_client_info()).client_id == "c"
    assert bridge.OAuthTokenFile(tokens.path).redirect_port() == port  # the registration's, after a restart
    assert [path.name for path in tokens.path.parent.iterdir()] == ["server.json"]  # no temporary left

    assert tokens.authorization_server() is None
    tokens.keep_authorization_server(
        {"issuer": "https://as.example", "authorization_endpoint": "https://as.example/a",
         "token_endpoint": "https://as.example/t"}
    )  # fmt: skip
    assert str(tokens.authorization_server().token_endpoint) == "https://as.example/t"
    assert (await tokens.get_tokens()).access_token == "a"  # kept beside the tokens

    tokens.path.write_text('{"authorization_server": {"token_endpoint": 5}}')
    assert tokens.authorization_server() is None  # damaged: the SDK finds it again

    def full_disk(**fields: object) -> None:
        raise OSError(28, "No space left on device")

    tokens._update = full_disk  # type: ignore[method-assign]
    tokens.keep_authorization_server({"issuer": "https://other.example"})  # said; the login goes on
    assert "cannot be written: [Errno 28] No space left on device" in caplog.text
    tokens.path.write_text('{"tokens": {"access_token": ')  # torn by something else
    assert await tokens.get_tokens() is None
    tokens.path.write_text('{"tokens": {"token_type": 7}}')
    assert await tokens.get_tokens() is None
    assert tokens.forget() and not tokens.forget()


async def test_the_redirect_page_ends_the_login_and_other_requests_are_ignored() -> None:
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(4)
    port = listening.getsockname()[1]
    listener = await anyio.abc.SocketListener.from_socket(listening)
    async with listener, anyio.create_task_group() as group:
        got: list[dict[str, str]] = []

        async def receive() -> None:
            got.append(await bridge.receive_redirect(listener, "notes"))

        group.start_soon(receive)
        async with httpx2.AsyncClient() as browser:
            favicon = await browser.get("http://127.0.0.1:%d/favicon.ico" % port)
            page = await browser.get(
                "http://127.0.0.1:%d/callback?code=abc&state=xyz&iss=http%%3A%%2F%%2Fas" % port
            )
    assert favicon.status_code == 404
    assert page.status_code == 200 and "login to notes is done" in page.text
    assert got == [{"code": "abc", "state": "xyz", "iss": "http://as"}]


def test_a_failed_request_is_named_without_its_secrets() -> None:
    failed = httpx2.ConnectError(
        "All connection attempts failed",
        request=httpx2.Request("GET", "https://user:secret@auth.example:8443/token?code=abc"),
    )
    assert bridge._describe_exception(ExceptionGroup("start", [failed])) == (
        "ConnectError: All connection attempts failed (GET https://auth.example:8443/token)"
    )
    assert bridge._describe_exception(httpx2.ConnectError("refused")) == "ConnectError: refused"
    assert bridge.url_origin("https://Auth.example:443/token") == bridge.url_origin(
        "https://auth.example/mcp"
    )
    assert bridge.url_origin("http://127.0.0.1:8/x") != bridge.url_origin("http://127.0.0.1:9/mcp")


def test_only_a_streamable_http_entry_without_its_own_authorization_gets_a_login() -> None:
    http = bridge.ServerSpec(name="a", alias="a", transport="http", url="http://x/mcp", source="t")
    assert bridge.wants_oauth(http)
    with_token = bridge.ServerSpec(
        name="b",
        alias="b",
        transport="http",
        url="http://x/mcp",
        source="t",
        headers={"authorization": "Bearer k"},
    )
    assert not bridge.wants_oauth(with_token)
    assert not bridge.wants_oauth(
        bridge.ServerSpec(name="c", alias="c", transport="sse", url="http://x", source="t")
    )


# --- through the bridge ------------------------------------------------------------------


def oauth_env(engine: Engine, state_dir: Path, tmp_path: Path, url: str) -> dict[str, str]:
    home = claude_desktop_home(tmp_path, {"notes": {"type": "http", "url": url}})
    return isolated_env(engine, state_dir, home, MCP_BRIDGE_APPROVE="none")


async def test_code_uses_a_server_after_the_login_the_token_is_refreshed_and_the_sandbox_never_sees_it(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    with oauth_server(token_seconds=3) as url:
        async with bridge_client(oauth_env(proxy_engine, state_dir, tmp_path, url)) as client:
            first = await run_cell(client, "mcp_notes.whoami()")
            assert first["status"] == "error" and "wants you to log in" in first["text"], first["text"]
            again = await run_cell(client, "mcp_notes.whoami()")  # the same login, still waiting
            assert the_link(again["text"]) == the_link(first["text"])
            page = await open_in_browser(the_link(first["text"]))
            assert "login to notes is done" in page

            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "ok", who["text"]
            assert json.loads(who["value"].replace("'", '"'))["subject"] == "alice"
            assert url in who["value"]  # the token is bound to this server (the resource indicator)

            await anyio.sleep(4)  # the access token expires: the next call refreshes it
            stats = await run_cell(client, "mcp_notes.stats()")
            assert stats["status"] == "ok", stats["text"]
            counts = json.loads(stats["value"].replace("'", '"'))
            assert counts["logins"] == 1 and counts["refreshes"] >= 1 and counts["wrong_resource"] == 0

            stored = json.loads(token_file(state_dir).read_text())
            secrets_ = [stored["tokens"]["access_token"], stored["tokens"]["refresh_token"]]
            search = await run_cell(
                client,
                """
                import os, subprocess
                secrets_ = %r
                found = subprocess.run(
                    ["grep", "-rlsF", "-e", secrets_[0], "-e", secrets_[1], "/",
                     "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=dev"],
                    capture_output=True, text=True).stdout
                (found, [k for k, v in os.environ.items() if any(s in v for s in secrets_)])
                """
                % secrets_,
                timeout=120,
            )
            assert search["status"] == "ok", search["text"]
            assert search["value"] == "('', [])"


async def test_a_client_that_opens_links_logs_in_within_the_call(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    asked: list[Any] = []

    async def open_link(context: Any, params: Any) -> Any:
        asked.append(params)
        assert params.mode == "url" and "wants you to log in" in params.message
        await open_in_browser(params.url)  # the user opens it and approves
        return types.ElicitResult(action="accept")

    with oauth_server() as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        async with bridge_client(env, elicitation=open_link) as client:
            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "ok" and "alice" in who["value"], who["text"]
            assert len(asked) == 1
            assert (await run_cell(client, "mcp_notes.whoami()"))["status"] == "ok"  # asked once
            assert len(asked) == 1


async def test_a_user_who_declines_to_open_the_link_gets_it_in_the_error(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    async def decline(context: Any, params: Any) -> Any:
        return types.ElicitResult(action="decline")

    with oauth_server() as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        async with bridge_client(env, elicitation=decline) as client:
            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "error" and "wants you to log in" in who["text"], who["text"]
            assert LINK.search(who["text"])


async def test_an_unreachable_authorization_server_is_named_in_the_error(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    nowhere = "http://127.0.0.1:%d" % free_port()  # nothing listens there
    with oauth_server(issuer=nowhere) as url:
        async with bridge_client(oauth_env(proxy_engine, state_dir, tmp_path, url)) as client:
            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "error", who["text"]
            assert (
                "'notes' could not be started: its OAuth login failed at its authorization server"
                in (who["text"])
            )
            assert nowhere in who["text"], who["text"]  # where it tried: not the server itself
            assert not LINK.search(who["text"])
            again = await run_cell(client, "1 + 1")  # the bridge goes on
            assert again["status"] == "ok" and again["value"] == "2"
    assert not list((state_dir / bridge.OAUTH_DIR).glob("*.json"))


async def test_logout_forces_a_new_login_and_a_revoked_refresh_token_asks_again(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    with oauth_server(token_seconds=2) as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        async with bridge_client(env) as client:
            first = await run_cell(client, "mcp_notes.whoami()")
            await open_in_browser(the_link(first["text"]))
            assert (await run_cell(client, "mcp_notes.whoami()"))["status"] == "ok"

            logout = cli(env, "logout", "notes")
            assert logout.returncode == 0 and "Logged out of notes" in logout.stdout, logout.stderr
            asked = await run_cell(client, "mcp_notes.whoami()")
            assert "wants you to log in" in asked["text"], asked["text"]
            await open_in_browser(the_link(asked["text"]))
            assert (await run_cell(client, "mcp_notes.whoami()"))["status"] == "ok"

            # An administrator revokes the refresh tokens: once the access token expires, the
            # refresh fails and the call asks for a login again, saying so.
            assert (await run_cell(client, "mcp_notes.revoke_refresh_tokens()"))["status"] == "ok"
            await anyio.sleep(3)
            revoked = await run_cell(client, "mcp_notes.whoami()")
            assert "wants you to log in" in revoked["text"], revoked["text"]


def login_command(env: dict[str, str]) -> subprocess.Popen[str]:
    """`login notes --no-browser` at a terminal: its stdin, stdout and stderr are pipes."""
    return subprocess.Popen(
        [console_script(), "login", "notes", "--no-browser"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def said_until(login: subprocess.Popen[str], words: str) -> str:
    """What ``login`` printed on stderr up to the line with ``words``."""
    assert login.stderr is not None
    said = ""
    while words not in said:
        line = login.stderr.readline()
        assert line, "the login command ended before saying %r: %s" % (words, said)
        said += line
    return said


async def test_the_login_command_logs_in_at_a_terminal_for_the_bridge(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    with oauth_server() as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        login = login_command(env)
        try:
            said = said_until(login, "paste that page's address here")
            await open_in_browser(the_link(said))
            out, _ = login.communicate(timeout=60)
        finally:
            login.kill()
        assert login.returncode == 0 and "Logged in to notes" in out
        again = cli(env, "login", "notes")
        assert again.returncode == 0 and "Already logged in to notes" in again.stdout, again.stderr

        async with bridge_client(env) as client:  # no link: the bridge uses the stored tokens
            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "ok" and "alice" in who["value"], who["text"]


async def test_a_browser_on_another_machine_finishes_the_login_by_its_pasted_address(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # Over SSH: the browser is elsewhere, so its redirect to this machine's loopback port
    # does not load; the person pastes the address it ended on into the login command.
    with oauth_server() as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        login = login_command(env)
        try:
            assert login.stdin is not None
            said = said_until(login, "paste that page's address here")
            async with httpx2.AsyncClient() as browser:  # approves, but never reaches the redirect
                ended_on = (await browser.get(the_link(said))).headers["location"]
            assert "/callback?code=" in ended_on
            login.stdin.write("not the address\n" + ended_on + "\n")
            login.stdin.flush()
            out, errors = login.communicate(timeout=60)
        finally:
            login.kill()
        assert login.returncode == 0 and "Logged in to notes" in out, errors
        assert "That is not where the login ended" in errors
        async with bridge_client(env) as client:
            who = await run_cell(client, "mcp_notes.whoami()")
            assert who["status"] == "ok" and "alice" in who["value"], who["text"]


def test_login_names_what_it_cannot_log_in_to(tmp_path: Path, state_dir: Path) -> None:
    home = claude_desktop_home(
        tmp_path,
        {
            "local": {"command": "true"},
            "keyed": {
                "type": "http",
                "url": "http://127.0.0.1:9/mcp",
                "headers": {"Authorization": "Bearer k"},
            },
        },
    )
    env = isolated_env(None, state_dir, home)
    for name, said in (
        ("nothing", "no MCP server 'nothing' is configured"),
        ("local", "it is not a streamable HTTP server"),
        ("keyed", "sets its own Authorization header"),
    ):
        run = cli(env, "login", name)
        assert run.returncode == 1 and said in run.stderr, run.stderr
    assert not os.path.exists(state_dir / bridge.OAUTH_DIR)


def test_doctor_names_the_login_link(proxy_engine: Engine, state_dir: Path, tmp_path: Path) -> None:
    with oauth_server() as url:
        env = oauth_env(proxy_engine, state_dir, tmp_path, url)
        doctor = subprocess.run(
            [console_script(), "doctor"], env=env, capture_output=True, text=True, timeout=120, check=False
        )
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "wants you to log in" in doctor.stdout and LINK.search(doctor.stdout), doctor.stdout

    # A shared bridge's settings: no login of the doctor's own; each principal logs in itself.
    tokens = tmp_path / "tokens"
    tokens.write_text("%s alice\n" % ("t" * 32))
    tokens.chmod(0o600)
    shared = {**env, "MCP_BRIDGE_TRANSPORT": "http", "MCP_BRIDGE_AUTH_TOKENS": str(tokens)}
    with oauth_server() as url:
        notes = {"notes": {"type": "http", "url": url}}
        shared["HOME"] = str(claude_desktop_home(tmp_path / "shared", notes))
        doctor = subprocess.run(
            [console_script(), "doctor"], env=shared, capture_output=True, text=True, timeout=120, check=False
        )
    assert "each principal logs in with its own account" in doctor.stdout, doctor.stdout
    assert not LINK.search(doctor.stdout) and doctor.returncode == 0, doctor.stdout + doctor.stderr


async def test_a_server_behind_a_self_hosted_openid_provider_is_used_after_a_login_there(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # The server is only a resource server; its login is at oidc-provider (a real OpenID
    # provider): the bridge discovers it, registers there, and the person signs in and
    # consents on its pages; the browser then comes back to the bridge's loopback port.
    from tests.test_oauth_bridge import oidc_provider, sign_in_at_oidc_provider

    issuer_port = free_port()
    issuer = "http://127.0.0.1:%d" % issuer_port

    def argv(port: int) -> list[str]:
        return [sys.executable, str(OAUTH_SERVER), str(port), "--external-issuer", issuer]

    with local_server(argv, "the resource server") as port:
        url = "http://127.0.0.1:%d/mcp" % port
        provider = oidc_provider(issuer_port, url, token_seconds=4)
        try:
            wait_for_port(issuer_port, provider, "oidc-provider")
            env = oauth_env(proxy_engine, state_dir, tmp_path, url)
            async with bridge_client(env) as client:
                asked = await run_cell(client, "mcp_notes.whoami()")
                assert "wants you to log in" in asked["text"], asked["text"]
                link = re.search(r"%s/auth\?[^\s'\"]+" % re.escape(issuer), asked["text"])
                assert link is not None, asked["text"]
                back = await sign_in_at_oidc_provider(link.group(), "dana")
                async with httpx2.AsyncClient() as browser:
                    page = await browser.get(back)  # the bridge's loopback port
                assert "login to notes is done" in page.text

                who = await run_cell(client, "mcp_notes.whoami()")
                assert who["status"] == "ok", who["text"]
                assert "'subject': 'dana'" in who["value"] and url in who["value"]

            # The access token expires while no bridge runs: the next bridge refreshes it at the
            # provider's token endpoint (not at the server's origin, which has none), no login.
            await anyio.sleep(5)
            async with bridge_client(env) as client:
                again = await run_cell(client, "mcp_notes.whoami()")
                assert again["status"] == "ok" and "'subject': 'dana'" in again["value"], again["text"]
        finally:
            provider.kill()
            provider.wait(10)


# --- an HTTP bridge of several principals: each logs in with its own account ------------


def test_a_principals_login_is_its_own_file_and_says_so(tmp_path: Path) -> None:
    spec = bridge.ServerSpec(name="notes", alias="notes", transport="http", url="http://x/mcp", source="t")
    redirects = bridge.LoginRedirects("https://bridge.example/oauth/callback")
    own = bridge.ServerLogin(spec, tmp_path, principal="bob", redirects=redirects)
    assert own.tokens.path.parent == tmp_path / "principals" / "bob" / "oauth"
    assert own.tokens.path.name == bridge.ServerLogin(spec, tmp_path).tokens.path.name
    own.link = "https://as.example/authorize?state=s"
    said = str(own.required())
    assert own.link in said and "this principal's own" in said and "login notes" not in said
    operators = bridge.ServerLogin(spec, tmp_path)
    operators.link = own.link
    assert "`mcp-server-code-execution-mode login notes`" in str(operators.required())


async def test_a_shared_connection_becomes_each_principals_own_once_its_server_wants_a_login(
    tmp_path: Path,
) -> None:
    specs = tuple(
        bridge.ServerSpec(name=name, alias=name, transport="http", url="http://x/%s" % name, source="t")
        for name in ("notes", "public")
    )
    tokens = bridge.AuthTokens(tmp_path / "tokens", ())
    config = bridge.BridgeConfig(state_dir=tmp_path, transport="http", auth_tokens=tokens)
    async with anyio.create_task_group() as group:
        pool = bridge.ClientPool(bridge.DiscoveryResult(specs, (), ()), config, group)
        alice, bob = pool.of_principal("alice"), pool.of_principal("bob")
        assert pool.of_principal("alice") is alice
        assert alice.clients["notes"] is pool.shared["notes"] is bob.clients["notes"]  # shared at first
        assert pool.shared["notes"].login is None  # a shared connection never logs in

        pool.shared["notes"].personal_login = True  # it answered 401
        own = alice.clients["notes"]
        assert own is alice.client("notes") is not pool.shared["notes"]
        assert own.login is not None and own.login.principal == "alice"
        assert own.login.tokens.path.parent == tmp_path / "principals" / "alice" / "oauth"
        bobs = bob.clients["notes"].login
        assert bob.clients["notes"] is not own and bobs is not None and bobs.principal == "bob"
        assert alice.clients["public"] is pool.shared["public"]  # the rest stay shared
        await pool.aclose()

        stdio = bridge.ClientPool(
            bridge.DiscoveryResult(specs, (), ()), bridge.BridgeConfig(state_dir=tmp_path), group
        )
        assert stdio.of_principal("local") is stdio and stdio.shared["notes"].login is not None


async def test_a_principals_idle_connection_closes_and_comes_back_without_a_word(tmp_path: Path) -> None:
    from tests.test_proxy import _http_stub

    with _http_stub() as url:
        spec = bridge.ServerSpec(name="remote", alias="remote", transport="http", url=url, source="t")
        tokens = bridge.AuthTokens(tmp_path / "tokens", ())
        config = bridge.BridgeConfig(
            state_dir=tmp_path, transport="http", auth_tokens=tokens, idle_timeout=30
        )
        async with anyio.create_task_group() as group:  # its idle closer ends with aclose
            pool = bridge.ClientPool(bridge.DiscoveryResult((spec,), (), ()), config, group)
            pool.shared["remote"].personal_login = True  # as after a 401
            own = pool.of_principal("alice").client("remote")
            await own.ensure_running()
            assert pool.close_idle(time.monotonic()) == 0  # just used
            own.calls_in_flight.append(cast(Any, (None, None)))
            assert pool.close_idle(time.monotonic() + 31) == 0  # a call is using it
            own.calls_in_flight.clear()
            assert pool.close_idle(time.monotonic() + 31) == 1
            with anyio.fail_after(10):
                while own.starts == 1 and own.session is not None:
                    await anyio.sleep(0.01)
            assert not own.running
            await own.ensure_running()  # the next call reconnects, and the model hears nothing of it
            assert own.running and own.starts == 2 and own.notices == []
            await pool.aclose()


async def test_a_token_is_refreshed_before_it_expires_also_after_a_restart(tmp_path: Path) -> None:
    # On a 401 the SDK would ask the user to log in again, though it could refresh: a server
    # whose clock runs ahead must never see a token at its very end.
    from mcp.shared.auth import OAuthToken

    spec = bridge.ServerSpec(name="notes", alias="notes", transport="http", url="http://x/mcp", source="t")
    login = bridge.ServerLogin(spec, tmp_path)
    context = login.provider().context
    context.update_token_expiry(OAuthToken(access_token="a", expires_in=3600))
    assert context.token_expiry_time is not None
    assert 3535 < context.token_expiry_time - time.time() <= 3540  # a minute early
    context.update_token_expiry(OAuthToken(access_token="a", expires_in=30))
    assert 25 < context.token_expiry_time - time.time() <= 27  # a tenth of a short life
    context.update_token_expiry(OAuthToken(access_token="a"))
    assert context.token_expiry_time is None  # no expiry said: none assumed

    await login.tokens.set_tokens(OAuthToken(access_token="a", expires_in=3600, refresh_token="r"))
    restarted = bridge.ServerLogin(spec, tmp_path).provider().context
    assert restarted.token_expiry_time is not None
    assert 3535 < restarted.token_expiry_time - time.time() <= 3540
    login.tokens.path.write_text('{"expires_at": 5, "tokens": "torn"}')
    assert bridge.ServerLogin(spec, tmp_path).provider().context.token_expiry_time == 5


async def test_a_registration_for_another_redirect_address_counts_as_none(tmp_path: Path) -> None:
    from mcp.shared.auth import OAuthClientInformationFull

    here = "https://bridge.example/oauth/callback"
    tokens = bridge.OAuthTokenFile(tmp_path / "t.json", redirect_uri=here)
    await tokens.set_client_info(OAuthClientInformationFull(client_id="c", redirect_uris=[here]))  # type: ignore[list-item]
    assert (await tokens.get_client_info()).client_id == "c"
    moved = bridge.OAuthTokenFile(tmp_path / "t.json", redirect_uri="https://new.example/oauth/callback")
    assert await moved.get_client_info() is None  # MCP_BRIDGE_PUBLIC_URL changed: register again


async def test_a_browser_comes_back_to_the_login_its_state_names_and_only_once() -> None:
    from starlette.requests import Request

    def back(query: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/oauth/callback", "headers": [],
                        "query_string": query.encode()})  # fmt: skip

    redirects = bridge.LoginRedirects("https://bridge.example/oauth/callback")
    state, pending = redirects.expect("https://as.example/authorize?client_id=c&state=s1&x=y", "notes")
    assert state == "s1"
    stranger = await redirects.endpoint(back("state=s2&code=c"))
    assert stranger.status_code == 400 and not pending.back.is_set()
    page = await redirects.endpoint(back("state=s1&code=abc&iss=https%3A%2F%2Fas.example"))
    assert page.status_code == 200 and b"login to notes is done" in page.body
    assert pending.back.is_set() and pending.query == {
        "state": "s1",
        "code": "abc",
        "iss": "https://as.example",
    }
    assert (await redirects.endpoint(back("state=s1&code=abc"))).status_code == 400  # used
    with pytest.raises(bridge.ServerUnavailableError, match="no state"):
        redirects.expect("https://as.example/authorize?client_id=c", "notes")


def test_the_public_url_is_where_logins_come_back_and_the_default_audience() -> None:
    config = bridge.load_config(["--transport", "http", "--port", "8123"], {})
    assert config.base_url == "http://127.0.0.1:8123"
    public = bridge.load_config(
        ["--transport", "http", "--host", "::1"], {"MCP_BRIDGE_PUBLIC_URL": "https://bridge.example/team/"}
    )
    assert public.base_url == "https://bridge.example/team"
    assert bridge.load_config(["--transport", "http", "--host", "::1"], {}).base_url == "http://[::1]:8000"
    with pytest.raises(bridge.ConfigError, match="PUBLIC_URL is for the HTTP transport"):
        bridge.load_config([], {"MCP_BRIDGE_PUBLIC_URL": "https://bridge.example"})
    with pytest.raises(bridge.ConfigError, match="without a query"):
        bridge.load_config(["--transport", "http"], {"MCP_BRIDGE_PUBLIC_URL": "https://b.example/?x=1"})


async def test_on_an_http_bridge_each_principal_logs_in_with_its_own_account(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    from tests.test_http import ALICE, BOB, call, http_bridge, http_client
    from tests.test_proxy import _http_stub

    with oauth_server() as url, _http_stub() as public:
        servers = {"notes": {"type": "http", "url": url}, "remote": {"type": "http", "url": public}}
        home = claude_desktop_home(state_dir.parent, servers)
        env = isolated_env(proxy_engine, state_dir, home)
        async with (
            http_bridge(proxy_engine, state_dir, approve="none") as running,
            http_client(running.url, ALICE) as alice,
            http_client(running.url, BOB) as bob,
        ):
            asked = await call(alice, "mcp_notes.whoami()")
            assert "wants you to log in" in asked["text"] and "this principal's own" in asked["text"], asked
            alices_link = the_link(asked["text"])
            redirect = urllib.parse.parse_qs(urllib.parse.urlsplit(alices_link).query)["redirect_uri"]
            assert redirect == [running.base + "/oauth/callback"]  # the bridge's, not a loopback port
            bobs_link = the_link((await call(bob, "mcp_notes.whoami()"))["text"])
            assert bobs_link != alices_link  # his own login, not a share of hers

            assert "login to notes is done" in await open_in_browser(alices_link)
            mine = await call(alice, "mcp_notes.whoami()")
            assert mine["view"]["status"] == "ok", mine["text"]
            still = await call(bob, "mcp_notes.whoami()")  # alice's login is not bob's
            assert the_link(still["text"]) == bobs_link
            assert "login to notes is done" in await open_in_browser(bobs_link)
            his = await call(bob, "mcp_notes.whoami()")
            assert his["view"]["status"] == "ok", his["text"]
            assert "'client': " in mine["text"] and mine["text"] != his["text"]  # two registrations

            async with httpx2.AsyncClient() as browser:  # a used link changes nothing
                again = await browser.get(running.base + "/oauth/callback?" + alices_link.split("?")[1])
            assert again.status_code == 400

            principals = state_dir / "principals"
            assert [p.parent.parent.name for p in sorted(principals.glob("*/oauth/*.json"))] == [
                "alice",
                "bob",
            ]
            assert not (state_dir / bridge.OAUTH_DIR).exists()  # no login of the bridge's own

            for session in (alice, bob):  # a server without a login stays one shared connection
                assert "'sum': 6" in (await call(session, "mcp_remote.pair(a=4)"))["text"]
            said = running.log.read_text()
            assert said.count("wants a login: each principal logs in with its own") == 1
            assert "remote wants a login" not in said

            logout = cli(env, "logout", "notes", "--principal", "bob")
            assert logout.returncode == 0 and "Logged out of notes for principal bob" in logout.stdout
            assert "wants you to log in" in (await call(bob, "mcp_notes.whoami()"))["text"]
            assert (await call(alice, "mcp_notes.whoami()"))["view"]["status"] == "ok"

        # A client of bob's that opens links: the link reaches it within the call, and the
        # code goes on once he has logged in.
        opened: list[str] = []

        async def open_link(context: Any, params: Any) -> Any:
            opened.append(params.url)
            await open_in_browser(params.url)
            return types.ElicitResult(action="accept")

        async with (
            http_bridge(proxy_engine, state_dir, approve="none") as running,
            http_client(running.url, BOB, elicitation=open_link) as bob,
        ):
            who = await call(bob, "mcp_notes.whoami()")
            assert who["view"]["status"] == "ok", who["text"]
            assert len(opened) == 1 and "/oauth/callback" in urllib.parse.unquote(opened[0])
