// A self-hosted OpenID provider for the HTTP bridge's OAuth tests: panva's oidc-provider
// (a certified OpenID Connect implementation; npm), set up the way an operator sets up
// a provider for the bridge -- dynamic client registration, PKCE, and JWT access tokens
// for the bridge's resource (RFC 8707) with the "tools" scope. Its login and consent pages
// are the library's own development ones (any login name, any password).
//
//   node tests/servers/oidc_provider.mjs MODULE_DIR PORT AUDIENCE[,AUDIENCE...] [jwt|opaque] [TTL]
//
// MODULE_DIR: the installed oidc-provider package; each AUDIENCE: a resource it issues
// tokens for (the HTTP bridge's MCP URL, a proxied MCP server's), as JWTs or as opaque
// tokens that its introspection endpoint explains to the client "mcp-bridge" (secret
// BRIDGE_SECRET below), the bridge's own; access tokens last TTL seconds (default 300), and
// every client that may refresh gets a refresh token.
import { pathToFileURL } from "node:url";
import { join } from "node:path";
import { readFileSync } from "node:fs";

const [moduleDir, port, audienceList, format = "jwt", ttl = "300"] = process.argv.slice(2);
const BRIDGE_SECRET = "bridge-secret-for-tests-only";
const audiences = audienceList.split(",");
const main = JSON.parse(readFileSync(join(moduleDir, "package.json"), "utf8")).main;
const { default: Provider, errors } = await import(pathToFileURL(join(moduleDir, main)).href);

const issuer = `http://127.0.0.1:${port}`;
const provider = new Provider(issuer, {
  clients: [{
    client_id: "mcp-bridge",
    client_secret: BRIDGE_SECRET,
    grant_types: [],
    response_types: [],
    redirect_uris: [],
  }],
  features: {
    introspection: { enabled: true },
    devInteractions: { enabled: true },
    registration: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => audiences[0],
      useGrantedResource: () => true,
      getResourceServerInfo(ctx, resource) {
        if (!audiences.includes(resource)) {
          throw new errors.InvalidTarget();
        }
        return {
          scope: "tools",
          audience: resource,
          accessTokenTTL: Number(ttl),
          accessTokenFormat: format,
          ...(format === "jwt" ? { jwt: { sign: { alg: "RS256" } } } : {}),
        };
      },
    },
  },
  scopes: ["openid", "offline_access", "tools"],
  pkce: { required: () => true },
  issueRefreshToken: async (ctx, client) => client.grantTypeAllowed("refresh_token"),
  async findAccount(ctx, id) {
    return { accountId: id, async claims() { return { sub: id }; } };
  },
});
provider.proxy = false;
provider.listen(Number(port), "127.0.0.1");
