"""The HTTP bridge as an OAuth resource server (issue 23, part 2), all on loopback: the
bridge with MCP_BRIDGE_OAUTH_ISSUER set to tests/servers/oauth_server.py (its own
authorization server, which also mints JWTs for the bridge's audience) takes the SDK's
streamable HTTP client with OAuth; a request without a token, with a token for another
audience, expired, or signed by another key gets 401 with the metadata pointer; two
subjects are two principals; an unreachable issuer stops the start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jwt
import pytest
from mcp.client.auth import AuthorizationCodeResult, OAuthClientProvider
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.auth import OAuthClientMetadata

import mcp_server_code_execution_mode as bridge
from tests.conftest import REPO, Engine, console_script
from tests.harness import bridge_env, free_port, wait_for_port
from tests.servers.oauth_server import KID, load_key

OAUTH_SERVER = Path(__file__).parent / "servers" / "oauth_server.py"
OIDC_PROVIDER = Path(__file__).parent / "servers" / "oidc_provider.mjs"
OIDC_PROVIDER_MODULE = REPO / ".cache" / "mcp-servers" / "node_modules" / "oidc-provider"

pytestmark = pytest.mark.anyio


class Setup:
    """The authorization server and the bridge it issues tokens for."""

    def __init__(self, issuer: str, bridge_url: str, key: Any, log: Path) -> None:
        self.issuer, self.bridge_url, self.key, self.log = issuer, bridge_url, key, log

    def token(self, **claims: Any) -> str:
        """A JWT signed by the issuer's key: by default one the bridge takes."""
        now = int(time.time())
        base = {
            "iss": self.issuer,
            "sub": "carol",
            "aud": self.bridge_url,
            "exp": now + 300,
            "scope": "tools",
        }
        return jwt.encode({**base, **claims}, self.key, algorithm="RS256", headers={"kid": KID})


@contextmanager
def oauth_bridge(
    engine: Engine | None,
    state_dir: Path,
    tmp_path: Path,
    provider: str = "stub",
    token_format: str = "jwt",
    **env: str,
) -> Iterator[Setup]:
    """The bridge over HTTP behind an authorization server: the test stub (which can also
    mint tokens by hand: Setup.token), or ``provider="oidc-provider"``, a self-hosted
    OpenID provider (issuing ``token_format`` tokens)."""
    issuer_port, bridge_port = free_port(), free_port()
    issuer = "http://127.0.0.1:%d" % issuer_port
    bridge_url = "http://127.0.0.1:%d/mcp" % bridge_port
    key_file = tmp_path / "issuer-key.pem"
    if provider == "oidc-provider":
        authority = oidc_provider(issuer_port, bridge_url, token_format=token_format)
    else:
        argv = [sys.executable, str(OAUTH_SERVER), str(issuer_port), "--jwt-audience", bridge_url]
        argv += ["--key-file", str(key_file)]
        authority = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers = tmp_path / "servers.json"
    servers.write_text('{"mcpServers": {}}')
    log = tmp_path / "bridge.log"
    bridge = None
    try:
        wait_for_port(issuer_port, authority, "the authorization server")
        settings = {"MCP_BRIDGE_OAUTH_ISSUER": issuer, "MCP_SERVERS_CONFIG": str(servers), **env}
        with log.open("w") as errors:
            bridge = subprocess.Popen(
                [console_script(), "--transport", "http", "--port", str(bridge_port)],
                env=bridge_env(
                    engine, state_dir, HOME=str(tmp_path), MCP_BRIDGE_LOG_LEVEL="INFO", **settings
                ),
                stdin=subprocess.DEVNULL,
                stderr=errors,
            )
        wait_for_port(bridge_port, bridge, "the bridge (log: %s)" % log)
        yield Setup(issuer, bridge_url, load_key(str(key_file)) if provider == "stub" else None, log)
    finally:
        if bridge is not None:
            bridge.terminate()
            bridge.wait(30)
        authority.kill()
        authority.wait(10)


class MemoryStorage:
    def __init__(self) -> None:
        self.tokens: Any = None
        self.client: Any = None

    async def get_tokens(self) -> Any:
        return self.tokens

    async def set_tokens(self, tokens: Any) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> Any:
        return self.client

    async def set_client_info(self, client_info: Any) -> None:
        self.client = client_info


async def sign_in_at_oidc_provider(link: str, person: str) -> str:
    """What a person does in a browser at oidc-provider: its sign-in page (any name and
    password), then its consent page; where it then sends the browser back to the client
    (a URL ending in /callback?code=...)."""
    async with httpx2.AsyncClient(follow_redirects=False, timeout=30) as browser:
        answer = await browser.get(link)
        for _ in range(10):
            location = answer.headers.get("location")
            if location is not None and urllib.parse.urlsplit(location).path == "/callback":
                return str(location)
            if location is not None:
                answer = await browser.get(urllib.parse.urljoin(str(answer.url), location))
                continue
            assert answer.status_code == 200, answer.text
            form = re.search(r'action="([^"]+)"', answer.text)
            prompt = re.search(r'name="prompt" value="(\w+)"', answer.text)
            assert form is not None and prompt is not None, answer.text
            fields = {"prompt": prompt.group(1), "login": person, "password": "any"}
            answer = await browser.post(urllib.parse.urljoin(str(answer.url), form.group(1)), data=fields)
    raise AssertionError("oidc-provider did not redirect back: %s" % answer.text[:500])


def oidc_provider(
    port: int, *audiences: str, token_format: str = "jwt", token_seconds: int = 300
) -> subprocess.Popen[bytes]:
    """tests/servers/oidc_provider.mjs on ``port``, issuing tokens for ``audiences`` (JWTs,
    or opaque ones its introspection endpoint explains to the client "mcp-bridge") that
    last ``token_seconds``."""
    if not (OIDC_PROVIDER_MODULE / "package.json").exists():
        pytest.fail("oidc-provider is not installed at %s; run scripts/setup.sh" % OIDC_PROVIDER_MODULE)
    argv = [
        "node",
        str(OIDC_PROVIDER),
        str(OIDC_PROVIDER_MODULE),
        str(port),
        ",".join(audiences),
        token_format,
        str(token_seconds),
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@asynccontextmanager
async def logged_in(
    url: str, person: str, provider: str = "stub", storage: MemoryStorage | None = None
) -> AsyncIterator[ClientSession]:
    """The SDK's streamable HTTP client with its OAuth client, logged in as ``person``: the
    "browser" follows the authorization server's approval to the redirect by hand."""
    query: dict[str, str] = {}

    async def open_link(link: str) -> None:
        if provider == "oidc-provider":
            location = await sign_in_at_oidc_provider(link, person)
        else:
            async with httpx2.AsyncClient() as browser:
                location = (await browser.get(link)).headers["location"]
        back = urllib.parse.urlsplit(location).query
        query.update({key: values[0] for key, values in urllib.parse.parse_qs(back).items()})

    async def redirected() -> AuthorizationCodeResult:
        return AuthorizationCodeResult(code=query["code"], state=query.get("state"), iss=query.get("iss"))

    metadata = OAuthClientMetadata(
        redirect_uris=["http://127.0.0.1:%d/callback" % free_port()],  # type: ignore[list-item]
        client_name="user:" + person,
    )
    auth = OAuthClientProvider(url, metadata, storage or MemoryStorage(), open_link, redirected)
    async with (
        create_mcp_http_client(auth=auth) as http,
        streamable_http_client(url, http_client=http) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        yield session


async def run(session: ClientSession, code: str) -> Any:
    result = await session.call_tool("run_python", {"code": code})
    assert not result.is_error, result.content
    return (result.structured_content or {}).get("value")


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}


async def post_initialize(url: str, token: str | None) -> httpx2.Response:
    headers = {"Accept": "application/json, text/event-stream"}
    if token is not None:
        headers["Authorization"] = "Bearer " + token
    async with httpx2.AsyncClient(timeout=30) as client:
        return await client.post(url, json=INITIALIZE, headers=headers)


async def test_a_client_logs_in_with_oauth_and_two_subjects_are_two_principals(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    with oauth_bridge(proxy_engine, state_dir, tmp_path) as setup:
        async with logged_in(setup.bridge_url, "alice") as alice:
            assert await run(alice, "x = 'alice'; runtime.save_memory('who', 'alice')['key']") == "who"
            assert await run(alice, "x") == "alice"
        async with logged_in(setup.bridge_url, "bob") as bob:
            assert await run(bob, "'x' in globals()") is False  # bob's own sandbox
            assert await run(bob, "runtime.load_memory('who')") is None  # and his own memory
        async with logged_in(setup.bridge_url, "alice") as alice:
            assert await run(alice, "runtime.load_memory('who')") == "alice"
    assert sorted(path.name for path in (state_dir / "principals").iterdir()) == ["alice", "bob"]


async def test_tokens_the_bridge_must_refuse_get_401_with_the_metadata_pointer(
    state_dir: Path, tmp_path: Path
) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    with oauth_bridge(None, state_dir, tmp_path, MCP_BRIDGE_PREWARM="0") as setup:
        metadata_url = setup.bridge_url.replace("/mcp", "/.well-known/oauth-protected-resource/mcp")
        async with httpx2.AsyncClient() as client:
            metadata = (await client.get(metadata_url)).json()
        assert metadata["resource"] == setup.bridge_url
        assert metadata["authorization_servers"] == [setup.issuer]

        now = int(time.time())
        other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        refused = {
            "no token": None,
            "not a JWT": "just-some-opaque-token-of-someone",
            "another audience": setup.token(aud=setup.issuer + "/mcp"),
            "another issuer": setup.token(iss="http://127.0.0.1:9"),
            "expired beyond the clock skew": setup.token(exp=now - 120),
            "signed by another key": jwt.encode(
                {"iss": setup.issuer, "sub": "mallory", "aud": setup.bridge_url, "exp": now + 300},
                other_key,
                algorithm="RS256",
                headers={"kid": KID},
            ),
            "no expiry": jwt.encode(
                {"iss": setup.issuer, "sub": "mallory", "aud": setup.bridge_url},
                setup.key,
                algorithm="RS256",
                headers={"kid": KID},
            ),
        }
        for why, token in refused.items():
            answer = await post_initialize(setup.bridge_url, token)
            assert answer.status_code == 401, why
            assert 'resource_metadata="%s"' % metadata_url in answer.headers["www-authenticate"], why

        # A clock 30 s behind the issuer's: within the leeway, taken.
        late = await post_initialize(setup.bridge_url, setup.token(exp=now - 30))
        assert late.status_code == 200, late.text
        assert (await post_initialize(setup.bridge_url, setup.token())).status_code == 200
    log = setup.log.read_text()
    assert "refused an access token" in log
    for token in refused.values():
        if token is not None:
            assert token not in log  # tokens are never logged


async def test_a_self_hosted_openid_provider_logs_people_in_as_their_own_principals(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    # panva's oidc-provider, set up as README's "self-hosted provider" says: the SDK's client
    # registers itself, signs in (PKCE, the resource indicator, the "tools" scope), and the
    # bridge takes the provider's own JWTs, checked against its JWKS.
    with oauth_bridge(
        proxy_engine, state_dir, tmp_path, provider="oidc-provider", MCP_BRIDGE_OAUTH_SCOPES="tools"
    ) as setup:
        async with logged_in(setup.bridge_url, "dana", "oidc-provider") as dana:
            assert await run(dana, "runtime.save_memory('who', 'dana')['key']") == "who"
        async with logged_in(setup.bridge_url, "erin", "oidc-provider") as erin:
            assert await run(erin, "runtime.load_memory('who')") is None  # her own memory
    assert sorted(path.name for path in (state_dir / "principals").iterdir()) == ["dana", "erin"]


BRIDGE_SECRET = "bridge-secret-for-tests-only"  # the bridge's client at oidc_provider.mjs


async def test_opaque_tokens_are_checked_at_the_issuers_introspection_endpoint(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "client-secret"
    secret.write_text(BRIDGE_SECRET + "\n")
    secret.chmod(0o600)
    client = {"MCP_BRIDGE_OAUTH_CLIENT_ID": "mcp-bridge", "MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE": str(secret)}
    storage = MemoryStorage()
    with oauth_bridge(
        proxy_engine,
        state_dir,
        tmp_path,
        provider="oidc-provider",
        token_format="opaque",
        MCP_BRIDGE_OAUTH_SCOPES="tools",
        **client,
    ) as setup:
        async with logged_in(setup.bridge_url, "dana", "oidc-provider", storage) as dana:
            assert await run(dana, "runtime.save_memory('who', 'dana')['key']") == "who"
        token = storage.tokens.access_token
        assert token.count(".") != 2  # opaque: only the issuer can say what it is
        assert (await post_initialize(setup.bridge_url, token)).status_code == 200
        forged = await post_initialize(setup.bridge_url, "made-up-opaque-token-of-mallory")
        assert forged.status_code == 401 and "resource_metadata=" in forged.headers["www-authenticate"]
        async with httpx2.AsyncClient() as http:  # only /mcp looks at tokens: no issuer asked
            health = await http.get(
                setup.bridge_url.replace("/mcp", "/health"), headers={"Authorization": "Bearer elsewhere"}
            )
        assert health.status_code == 200
    log = setup.log.read_text()
    assert log.count("refused an access token: the issuer says it is not active") == 1
    assert token not in log
    assert [path.name for path in (state_dir / "principals").iterdir()] == ["dana"]

    secret.write_text("not-the-secret\n")  # the bridge's client is misconfigured: refused, said
    secret.chmod(0o644)
    with oauth_bridge(
        None, state_dir, tmp_path, provider="oidc-provider", token_format="opaque",
        MCP_BRIDGE_PREWARM="0", **client,
    ) as setup:  # fmt: skip
        assert (await post_initialize(setup.bridge_url, "any-opaque-token")).status_code == 401
    said = setup.log.read_text()
    assert "check MCP_BRIDGE_OAUTH_CLIENT_ID and its secret" in said
    assert "the client secret file %s can be read by other users" % secret in said
    assert "not-the-secret" not in said


def test_the_issuers_introspection_answer_must_be_active_for_this_bridge_and_unexpired() -> None:
    issuer, mine, now = "https://login.example", "https://code.example/mcp", 1_000_000.0
    good = {"active": True, "iss": issuer + "/", "aud": [mine, "other"], "exp": now + 10, "sub": "dana"}
    assert bridge.introspected_claims(good, issuer, mine, now) == good
    for answer, said in (
        ({"active": False}, "not active"),
        ({**good, "active": "true"}, "not active"),
        ("garbage", "not active"),
        ({**good, "iss": "https://evil.example"}, "another issuer"),
        ({**good, "aud": "https://other.example/mcp"}, "not for this bridge"),
        ({key: value for key, value in good.items() if key != "aud"}, "not for this bridge"),
        ({**good, "exp": now - 61}, "expired"),
        ({**good, "token_type": "refresh_token"}, "not an access token"),
    ):
        with pytest.raises(bridge.TokenRefusedError, match=said):
            bridge.introspected_claims(answer, issuer, mine, now)
    assert bridge.introspected_claims({**good, "exp": now - 30}, issuer, mine, now)  # clock skew
    assert bridge.introspected_claims({**good, "token_type": "Bearer"}, issuer, mine, now)


def test_a_client_secret_file_that_holds_none_stops_the_start(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(bridge.CommandError, match="is empty"):
        bridge.read_client_secret(empty)
    with pytest.raises(bridge.CommandError, match="cannot be read"):
        bridge.read_client_secret(tmp_path)  # a folder
    (tmp_path / "secret").write_text("s3cret\n")
    assert bridge.read_client_secret(tmp_path / "secret") == "s3cret"


def test_a_shared_bridge_says_when_logins_could_not_come_back(tmp_path: Path) -> None:
    notes = bridge.ServerSpec(name="notes", alias="notes", transport="http", url="https://n/mcp", source="t")
    found = bridge.DiscoveryResult((notes,), (), ())
    tokens = bridge.AuthTokens(tmp_path / "tokens", ())

    def warning(**settings: Any) -> str | None:
        config = bridge.BridgeConfig(state_dir=tmp_path, transport="http", auth_tokens=tokens, **settings)
        return bridge.public_url_warning(config, found)

    assert "MCP_BRIDGE_PUBLIC_URL is not set" in (warning(host="0.0.0.0") or "")
    assert "in the clear" in (warning(host="0.0.0.0", public_url="http://10.1.2.3:8000") or "")
    assert warning(host="0.0.0.0", public_url="https://code.example") is None
    assert warning() is None  # loopback: the browser is on this machine
    config = bridge.BridgeConfig(state_dir=tmp_path, transport="http", auth_tokens=tokens, host="0.0.0.0")
    assert bridge.public_url_warning(config, bridge.DiscoveryResult((), (), ())) is None  # no such server


async def test_the_issuers_answers_are_cached_refusals_too(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s\n")
    config = bridge.BridgeConfig(
        transport="http",
        oauth_issuer="https://login.example",
        oauth_resource="https://code.example/mcp",
        oauth_client_id="mcp-bridge",
        oauth_client_secret_file=secret,
    )
    verifier = bridge.OAuthTokenVerifier(
        config, bridge.IssuerEndpoints(None, "https://login.example/introspect")
    )
    asked: list[str] = []
    good = {"active": True, "aud": "https://code.example/mcp", "sub": "dana", "exp": time.time() + 300}

    def ask_issuer(token: str) -> object:
        asked.append(token)
        return good if token == "good" else {"active": False}

    verifier._ask_issuer = ask_issuer  # type: ignore[method-assign]
    async with anyio.create_task_group() as group:  # at once, as a client's POST and GET bring it
        for _ in range(3):
            group.start_soon(verifier.verify_token, "good")
    for _ in range(3):
        assert await verifier.verify_token("bad") is None
        taken = await verifier.verify_token("good")
        assert taken is not None and taken.client_id == "dana" and taken.token == ""
    assert asked == ["good", "bad"]  # once each: the rest waited for that answer, or the cache


def test_the_bridges_client_needs_an_issuer_and_both_its_id_and_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s")
    http = ["--transport", "http"]
    issuer = {"MCP_BRIDGE_OAUTH_ISSUER": "https://login.example.com"}
    with pytest.raises(bridge.ConfigError, match="go together"):
        bridge.load_config(http, {**issuer, "MCP_BRIDGE_OAUTH_CLIENT_ID": "mcp-bridge"})
    with pytest.raises(bridge.ConfigError, match="need MCP_BRIDGE_OAUTH_ISSUER"):
        bridge.load_config(http, {"MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE": str(secret)})
    both = {**issuer, "MCP_BRIDGE_OAUTH_CLIENT_ID": "mcp-bridge"}
    both["MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE"] = str(secret)
    assert bridge.load_config(http, both).oauth_client_id == "mcp-bridge"


def test_an_unreachable_issuer_stops_the_start_and_settings_without_one_are_refused(
    state_dir: Path, tmp_path: Path
) -> None:
    dead = "http://127.0.0.1:%d" % free_port()
    env = bridge_env(None, state_dir, HOME=str(tmp_path), MCP_BRIDGE_OAUTH_ISSUER=dead)
    start = subprocess.run(
        [console_script(), "--transport", "http", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert start.returncode == 1
    assert "MCP_BRIDGE_OAUTH_ISSUER=%s" % dead in start.stderr and "no token could be checked" in start.stderr

    for settings, said in (
        ({"MCP_BRIDGE_OAUTH_SCOPES": "tools"}, "need MCP_BRIDGE_OAUTH_ISSUER"),
        ({"MCP_BRIDGE_OAUTH_ISSUER": "http://login.example.com"}, "must be https"),
        ({"MCP_BRIDGE_OAUTH_ISSUER": "https://login.example.com"}, "is for the HTTP transport"),
    ):
        stdio = "MCP_BRIDGE_OAUTH_SCOPES" not in settings
        argv = [console_script(), *([] if stdio else ["--transport", "http"])]
        refused = subprocess.run(
            argv,
            env=bridge_env(None, state_dir, HOME=str(tmp_path), **settings),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        assert refused.returncode == 2 and said in refused.stderr, (settings, refused.stderr)
    assert not os.path.exists(state_dir / "principals")
