"""A streamable-HTTP MCP server that wants OAuth 2.1, and its own authorization server, on
127.0.0.1 (the SDK's auth routes over an in-memory provider): protected-resource and
authorization-server metadata, dynamic client registration, an authorize endpoint that
approves at once (a person's consent page is the one part a test cannot click), the code
exchange with PKCE (checked by the SDK's token handler), refresh tokens that rotate, and
tokens bound to the resource indicator the client sent (RFC 8707), checked on every call.

    python tests/servers/oauth_server.py PORT [--token-seconds N] [--jwt-audience URL --key-file PEM]
    python tests/servers/oauth_server.py PORT --external-issuer URL

With --external-issuer it is only a resource server: its metadata names that authorization
server (a real one, such as tests/servers/oidc_provider.mjs), and it takes that server's
JWT access tokens for its own URL (checked against the issuer's JWKS).

With --jwt-audience it is also the authorization server of another resource (the HTTP
bridge): a token asked for that resource is a JWT (RS256, the key in --key-file, its JWKS
at /jwks, named by /.well-known/openid-configuration) whose subject is the registered
client's name after "user:" (else alice), so a test can log in as two people.

Tools: ``whoami`` (the token's subject, client, resource and scopes), ``stats`` (logins,
refreshes, calls refused), ``revoke_refresh_tokens`` (what an administrator does: the
next refresh fails). Access tokens last --token-seconds (default 3600)."""

from __future__ import annotations

import argparse
import secrets
import time
from typing import Any

from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    AuthorizeError,
    RefreshToken,
    TokenError,
    construct_redirect_uri,
)
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions
from mcp.server.mcpserver import MCPServer
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

SUBJECT = "alice"
SCOPE = "tools"


class InMemoryAuthority:
    """The authorization server's state: clients, codes, tokens, and what the tests read."""

    def __init__(
        self,
        resource: str,
        token_seconds: int,
        issuer: str = "",
        jwt_audience: str | None = None,
        key: Any = None,
    ) -> None:
        self.resource = resource
        self.token_seconds = token_seconds
        self.issuer = issuer
        self.jwt_audience = jwt_audience
        self.key = key
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}
        self.stats = {"registrations": 0, "logins": 0, "refreshes": 0, "wrong_resource": 0}

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        assert client_info.client_id is not None
        self.clients[client_info.client_id] = client_info
        self.stats["registrations"] += 1

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        if params.resource not in (self.resource, self.jwt_audience):  # RFC 8707: for these only
            self.stats["wrong_resource"] += 1
            said = "resource must be %s, not %s" % (self.resource, params.resource)
            raise AuthorizeError("invalid_request", said)
        code = secrets.token_urlsafe(24)
        assert client.client_id is not None
        self.codes[code] = AuthorizationCode(
            code=code,
            scopes=params.scopes or [SCOPE],
            expires_at=time.time() + 300,
            client_id=client.client_id,
            code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
            subject=subject_of(client),
        )
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        code = self.codes.get(authorization_code)
        return code if code is not None and code.client_id == client.client_id else None

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        del self.codes[authorization_code.code]  # once
        self.stats["logins"] += 1
        code = authorization_code
        return self._issue(code.client_id, code.scopes, code.resource, code.subject or SUBJECT)

    async def load_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: str
    ) -> RefreshToken | None:
        token = self.refresh.get(refresh_token)
        return token if token is not None and token.client_id == client.client_id else None

    async def exchange_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: RefreshToken, scopes: list[str]
    ) -> OAuthToken:
        if self.refresh.pop(refresh_token.token, None) is None:  # rotated: each refresh token once
            raise TokenError("invalid_grant", "refresh token already used")
        self.stats["refreshes"] += 1
        return self._issue(
            refresh_token.client_id,
            scopes or refresh_token.scopes,
            refresh_token.resource,
            refresh_token.subject or SUBJECT,
        )

    async def load_access_token(self, token: str) -> AccessToken | None:
        access = self.access.get(token)
        if access is None or (access.expires_at is not None and access.expires_at < time.time()):
            return None
        return access

    async def exchange_identity_assertion(
        self, client: OAuthClientInformationFull, params: Any
    ) -> OAuthToken:
        raise TokenError("unsupported_grant_type", "identity assertions are not accepted here")

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)

    def _issue(self, client_id: str, scopes: list[str], resource: str | None, subject: str) -> OAuthToken:
        access, refresh = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        expires_at = int(time.time()) + self.token_seconds
        if resource is not None and resource == self.jwt_audience:
            access = self.jwt(subject, resource, scopes, expires_at)
        self.access[access] = AccessToken(
            token=access,
            client_id=client_id,
            scopes=scopes,
            expires_at=expires_at,
            resource=resource,
            subject=subject,
        )
        self.refresh[refresh] = RefreshToken(
            token=refresh, client_id=client_id, scopes=scopes, resource=resource, subject=subject
        )
        return OAuthToken(
            access_token=access,
            token_type="Bearer",
            expires_in=self.token_seconds,
            refresh_token=refresh,
            scope=" ".join(scopes),
        )

    def jwt(self, subject: str, audience: str, scopes: list[str], expires_at: int) -> str:
        import jwt

        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": audience,
            "exp": expires_at,
            "iat": int(time.time()),
        }
        return jwt.encode(
            {**claims, "scope": " ".join(scopes)}, self.key, algorithm="RS256", headers={"kid": KID}
        )


KID = "test-key"


def subject_of(client: OAuthClientInformationFull) -> str:
    """Who logs in: the registered client's name after "user:" (a test's way of being
    somebody), else alice."""
    name = client.client_name or ""
    return name.removeprefix("user:") if name.startswith("user:") else SUBJECT


def load_key(path: str) -> Any:
    """The RSA key in ``path`` (PEM), made there first when the file is missing."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    try:
        with open(path, "rb") as pem:
            return serialization.load_pem_private_key(pem.read(), password=None)
    except FileNotFoundError:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        with open(path, "wb") as pem:
            pem.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        return key


class ExternalTokens:
    """A TokenVerifier for JWTs of another authorization server: signed by a key of its
    JWKS (found through its OpenID metadata), for ``resource``, with the "tools" scope."""

    def __init__(self, issuer: str, resource: str) -> None:
        self.issuer, self.resource = issuer, resource
        self._keys: Any = None

    async def verify_token(self, token: str) -> AccessToken | None:
        import anyio
        import httpx2
        import jwt

        if self._keys is None:
            async with httpx2.AsyncClient() as http:
                metadata = (await http.get(self.issuer + "/.well-known/openid-configuration")).json()
            self._keys = jwt.PyJWKClient(metadata["jwks_uri"])
        try:
            key = await anyio.to_thread.run_sync(self._keys.get_signing_key_from_jwt, token)
            claims = jwt.decode(
                token, key.key, algorithms=["RS256"], audience=self.resource, issuer=self.issuer
            )
        except jwt.PyJWTError:
            return None
        scopes = str(claims.get("scope", "")).split()
        if SCOPE not in scopes:
            return None
        return AccessToken(
            token=token,
            client_id=str(claims.get("client_id", "")),
            scopes=scopes,
            expires_at=int(claims["exp"]),
            resource=self.resource,
            subject=str(claims.get("sub")),
        )


def build(
    port: int,
    token_seconds: int,
    jwt_audience: str | None = None,
    key_file: str | None = None,
    issuer: str | None = None,
    external_issuer: str | None = None,
) -> tuple[MCPServer, InMemoryAuthority]:
    """``issuer``: the authorization server its metadata names (default: itself; another
    URL, where nothing answers, makes a server whose login cannot be reached);
    ``external_issuer``: a real authorization server whose tokens it takes instead."""
    base = "http://127.0.0.1:%d" % port
    resource = base + "/mcp"
    key = load_key(key_file) if key_file else None
    authority = InMemoryAuthority(resource, token_seconds, base, jwt_audience, key)
    if external_issuer is not None:
        server = MCPServer(
            "oauth-stub",
            token_verifier=ExternalTokens(external_issuer, resource),
            auth=AuthSettings(
                issuer_url=external_issuer,  # type: ignore[arg-type]
                resource_server_url=resource,  # type: ignore[arg-type]
                required_scopes=[SCOPE],
                validate_token_resource=True,
            ),
        )
        add_tools(server, authority)
        return server, authority
    server = MCPServer(
        "oauth-stub",
        auth_server_provider=authority,
        auth=AuthSettings(
            issuer_url=issuer or base,  # type: ignore[arg-type]
            resource_server_url=resource,  # type: ignore[arg-type]
            client_registration_options=ClientRegistrationOptions(
                enabled=True, valid_scopes=[SCOPE], default_scopes=[SCOPE]
            ),
            required_scopes=[SCOPE],
            validate_token_resource=True,
        ),
    )

    if key is not None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response

        @server.custom_route("/.well-known/openid-configuration", methods=["GET"])  # type: ignore[untyped-decorator]
        async def openid_configuration(request: Request) -> Response:
            return JSONResponse({"issuer": base, "jwks_uri": base + "/jwks"})

        @server.custom_route("/jwks", methods=["GET"])  # type: ignore[untyped-decorator]
        async def jwks(request: Request) -> Response:
            import json

            from jwt.algorithms import RSAAlgorithm

            public = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
            return JSONResponse({"keys": [{**public, "kid": KID, "use": "sig", "alg": "RS256"}]})

    add_tools(server, authority)
    return server, authority


def add_tools(server: MCPServer, authority: InMemoryAuthority) -> None:
    @server.tool()
    async def whoami() -> dict[str, Any]:
        """Who the access token says the caller is."""
        from mcp.server.auth.middleware.auth_context import get_access_token

        token = get_access_token()
        if token is None:
            return {"subject": None}
        return {"subject": token.subject, "client": token.client_id, "resource": token.resource}

    @server.tool()
    async def stats() -> dict[str, int]:
        """Registrations, logins and refreshes so far."""
        return dict(authority.stats)

    @server.tool()
    async def revoke_refresh_tokens() -> int:
        """Revoke every refresh token (the next refresh fails: a new login is needed)."""
        count = len(authority.refresh)
        authority.refresh.clear()
        return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--token-seconds", type=int, default=3600)
    parser.add_argument("--jwt-audience")
    parser.add_argument("--key-file")
    parser.add_argument("--issuer")
    parser.add_argument("--external-issuer")
    args = parser.parse_args()
    server, _ = build(
        args.port, args.token_seconds, args.jwt_audience, args.key_file, args.issuer, args.external_issuer
    )
    server.run("streamable-http", host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
