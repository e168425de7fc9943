"""Server discovery section: config_sources(), discover_servers(), variable expansion and
aliases, on real files in a fake home and project directory."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import Any

import pytest

from mcp_server_code_execution_mode import (
    MAX_CONFIG_FILE_BYTES,
    DiscoveryResult,
    ProjectServers,
    ServerSpec,
    config_sources,
    discover_servers,
    expand_variables,
    sanitize_alias,
    strip_jsonc,
)
from tests.conftest import Engine, bridge_client, console_script, proxy_env, run_cell, stub_entry


@dataclass(frozen=True)
class Host:
    """A fake home, project directory and bridge state directory under tmp_path."""

    home: Path
    cwd: Path
    state_dir: Path

    def discover(
        self,
        platform: str = "linux",
        environ: Mapping[str, str] | None = None,
        explicit: Path | None = None,
        project_servers: ProjectServers = "all",  # these tests are about reading the files
    ) -> DiscoveryResult:
        return discover_servers(
            self.home,
            self.cwd,
            platform,
            environ or {},
            self.state_dir,
            explicit,
            project_servers=project_servers,
        )


@pytest.fixture
def host(tmp_path: Path) -> Host:
    host = Host(tmp_path / "home", tmp_path / "work" / "project", tmp_path / "home" / "MCPs")
    for path in (host.home, host.cwd, host.state_dir):
        path.mkdir(parents=True)
    return host


def write(path: Path, content: Any) -> Path:
    """Write `content` (a str as is, anything else as JSON), creating parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def stdio(command: str, *args: str) -> dict[str, Any]:
    return {"command": command, "args": list(args)}


def servers(result: DiscoveryResult) -> dict[str, ServerSpec]:
    return {spec.name: spec for spec in result.servers}


def only(result: DiscoveryResult) -> ServerSpec:
    assert result.problems == (), result.problems
    assert len(result.servers) == 1, result.servers
    return result.servers[0]


# --- each source format -----------------------------------------------------------


def test_claude_desktop_is_read_from_the_linux_config_dir(host: Host) -> None:
    path = write(
        host.home / ".config/Claude/claude_desktop_config.json",
        {"mcpServers": {"time": stdio("uvx", "mcp-server-time")}},
    )
    spec = only(host.discover("linux"))
    assert (spec.name, spec.transport, spec.command, spec.args) == (
        "time",
        "stdio",
        "uvx",
        ("mcp-server-time",),
    )
    assert spec.source == str(path)
    assert host.discover("darwin").servers == ()


def test_claude_desktop_on_linux_respects_xdg_config_home(host: Host, tmp_path: Path) -> None:
    write(tmp_path / "xdg/Claude/claude_desktop_config.json", {"mcpServers": {"xdg": stdio("a")}})
    write(host.home / ".config/Claude/claude_desktop_config.json", {"mcpServers": {"default": stdio("b")}})
    assert only(host.discover(environ={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})).name == "xdg"
    # The XDG spec says a relative XDG_CONFIG_HOME is ignored.
    assert only(host.discover(environ={"XDG_CONFIG_HOME": "xdg"})).name == "default"


def test_claude_desktop_is_read_from_application_support_on_macos(host: Host) -> None:
    write(
        host.home / "Library/Application Support/Claude/claude_desktop_config.json",
        {"mcpServers": {"mac": stdio("a")}},
    )
    assert only(host.discover("darwin")).name == "mac"
    assert host.discover("linux").servers == ()


def test_claude_desktop_and_vscode_on_windows_live_under_appdata(host: Host, tmp_path: Path) -> None:
    appdata = tmp_path / "Roaming"
    write(appdata / "Claude/claude_desktop_config.json", {"mcpServers": {"desktop": stdio("a")}})
    write(appdata / "Code/User/mcp.json", {"servers": {"vscode": stdio("b")}})
    result = host.discover("win32", environ={"APPDATA": str(appdata)})
    assert sorted(servers(result)) == ["desktop", "vscode"]


def test_claude_code_reads_user_entries_and_only_this_projects_entries(host: Host) -> None:
    write(
        host.home / ".claude.json",
        {
            "mcpServers": {"user": stdio("u")},
            "projects": {
                str(host.cwd): {"mcpServers": {"here": stdio("h")}},
                "/somewhere/else": {"mcpServers": {"elsewhere": stdio("e")}},
            },
        },
    )
    result = host.discover()
    found = servers(result)
    assert sorted(found) == ["here", "user"]
    assert found["here"].source == "%s projects[%s]" % (host.home / ".claude.json", host.cwd)
    assert found["user"].source == str(host.home / ".claude.json")
    assert result.problems == ()


def test_project_mcp_json_is_read(host: Host) -> None:
    write(host.cwd / ".mcp.json", {"mcpServers": {"project": stdio("p")}})
    assert only(host.discover()).source == str(host.cwd / ".mcp.json")


def test_cursor_user_and_project_files_are_read(host: Host) -> None:
    write(host.home / ".cursor/mcp.json", {"mcpServers": {"cursor-user": stdio("u")}})
    write(host.cwd / ".cursor/mcp.json", {"mcpServers": {"cursor-project": stdio("p")}})
    assert sorted(servers(host.discover())) == ["cursor-project", "cursor-user"]


def test_windsurf_config_is_read_including_its_server_url_key(host: Host) -> None:
    write(
        host.home / ".codeium/windsurf/mcp_config.json",
        {"mcpServers": {"local": stdio("w"), "remote": {"serverUrl": "https://example.com/mcp"}}},
    )
    found = servers(host.discover())
    assert found["local"].command == "w"
    assert (found["remote"].transport, found["remote"].url) == ("http", "https://example.com/mcp")


def test_vscode_reads_mcp_json_servers_and_settings_json_with_comments_and_trailing_commas(
    host: Host,
) -> None:
    user = host.home / ".config/Code/User"
    write(user / "mcp.json", {"servers": {"from-mcp-json": {"type": "stdio", "command": "a"}}})
    write(
        user / "settings.json",
        """{
            // the editor's own settings
            "editor.fontSize": 14, /* a block
            comment */
            "mcp": {
                "servers": {
                    "from-settings": {
                        "type": "stdio",
                        "command": "b",
                        "args": ["--url", "https://example.com/a//b", "/* not a comment */",],
                    },
                },
            },
        }""",
    )
    write(host.cwd / ".vscode/mcp.json", {"servers": {"from-workspace": {"type": "stdio", "command": "c"}}})
    result = host.discover()
    assert result.problems == ()
    found = servers(result)
    assert sorted(found) == ["from-mcp-json", "from-settings", "from-workspace"]
    assert found["from-settings"].args == ("--url", "https://example.com/a//b", "/* not a comment */")


def test_jsonc_stripping_keeps_strings_and_line_numbers() -> None:
    text = '{"a": "// x", // gone\n "b": [1, 2,], /* gone */ "c": "\\" /* */",}'
    assert json.loads(strip_jsonc(text)) == {"a": "// x", "b": [1, 2], "c": '" /* */'}
    assert strip_jsonc(text).count("\n") == text.count("\n")


def test_gemini_settings_are_read_where_url_means_sse_and_http_url_means_http(host: Host) -> None:
    write(
        host.home / ".gemini/settings.json",
        {
            "theme": "dark",
            "mcpServers": {
                "local": stdio("g"),
                "legacy-sse": {"url": "https://example.com/sse"},
                "streamable": {"httpUrl": "https://example.com/mcp", "headers": {"X-Key": "k"}},
            },
        },
    )
    found = servers(host.discover())
    assert found["local"].command == "g"
    assert (found["legacy-sse"].transport, found["legacy-sse"].url) == ("sse", "https://example.com/sse")
    assert (found["streamable"].transport, found["streamable"].url) == ("http", "https://example.com/mcp")
    assert dict(found["streamable"].headers) == {"X-Key": "k"}


def test_codex_toml_mcp_servers_tables_are_read(host: Host) -> None:
    write(
        host.home / ".codex/config.toml",
        """model = "o3"

[mcp_servers.docs]
command = "npx"
args = ["-y", "docs-server"]
env = { API_KEY = "secret" }
cwd = "/srv/docs"

[mcp_servers.remote]
url = "https://example.com/mcp"
http_headers = { Authorization = "Bearer t" }

[mcp_servers.off]
command = "never"
enabled = false
""",
    )
    result = host.discover()
    assert result.problems == ()
    found = servers(result)
    assert sorted(found) == ["docs", "remote"]
    docs = found["docs"]
    assert (docs.command, docs.args, dict(docs.env), docs.cwd) == (
        "npx",
        ("-y", "docs-server"),
        {"API_KEY": "secret"},
        "/srv/docs",
    )
    assert (found["remote"].transport, dict(found["remote"].headers)) == (
        "http",
        {"Authorization": "Bearer t"},
    )


def test_codex_home_moves_the_codex_config(host: Host, tmp_path: Path) -> None:
    write(tmp_path / "codex/config.toml", '[mcp_servers.moved]\ncommand = "m"\n')
    assert only(host.discover(environ={"CODEX_HOME": str(tmp_path / "codex")})).name == "moved"


def test_state_dir_json_files_are_read_in_name_order(host: Host) -> None:
    write(host.state_dir / "b.json", {"mcpServers": {"shared": stdio("from-b"), "b-only": stdio("b")}})
    write(host.state_dir / "a.json", {"mcpServers": {"shared": stdio("from-a"), "a-only": stdio("a")}})
    result = host.discover()
    assert servers(result)["shared"].command == "from-b"
    assert sorted(servers(result)) == ["a-only", "b-only", "shared"]
    assert result.sources == (str(host.state_dir / "a.json"), str(host.state_dir / "b.json"))


def test_explicit_file_wins_on_a_name_clash_and_may_use_servers(host: Host, tmp_path: Path) -> None:
    write(host.cwd / ".mcp.json", {"mcpServers": {"github": stdio("project")}})
    explicit = write(tmp_path / "explicit.json", {"mcpServers": {"github": stdio("explicit")}})
    assert only(host.discover(explicit=explicit)).command == "explicit"
    write(explicit, {"servers": {"github": stdio("vscode-style")}})
    assert only(host.discover(explicit=explicit)).command == "vscode-style"


def test_a_missing_explicit_file_is_a_problem_but_missing_discovered_files_are_not(
    host: Host, tmp_path: Path
) -> None:
    assert host.discover() == DiscoveryResult((), (), ())
    result = host.discover(explicit=tmp_path / "nope.json")
    assert result.problems == ("%s: the file does not exist" % (tmp_path / "nope.json"),)
    no_table = write(tmp_path / "empty.json", {"other": {}})
    assert host.discover(explicit=no_table).problems == ("%s: has no mcpServers or servers table" % no_table,)


# --- precedence -------------------------------------------------------------------


def precedence_layers(host: Host, tmp_path: Path) -> list[tuple[Path, tuple[str, ...]]]:
    """Every source as (file, key path of its servers table), lowest precedence first."""
    vscode, claude = host.home / ".config/Code/User", host.home / ".claude.json"
    return [
        (host.state_dir / "state.json", ("mcpServers",)),
        (host.home / ".config/Claude/claude_desktop_config.json", ("mcpServers",)),
        (host.home / ".codeium/windsurf/mcp_config.json", ("mcpServers",)),
        (host.home / ".gemini/settings.json", ("mcpServers",)),
        (host.home / ".codex/config.toml", ("mcp_servers",)),
        (vscode / "mcp.json", ("servers",)),
        (vscode / "settings.json", ("mcp", "servers")),
        (host.home / ".cursor/mcp.json", ("mcpServers",)),
        (claude, ("mcpServers",)),
        (host.cwd / ".vscode/mcp.json", ("servers",)),
        (host.cwd / ".cursor/mcp.json", ("mcpServers",)),
        (claude, ("projects", str(host.cwd), "mcpServers")),
        (host.cwd / ".mcp.json", ("mcpServers",)),
        (tmp_path / "explicit.json", ("mcpServers",)),
    ]


def write_layers(layers: list[tuple[Path, tuple[str, ...]]]) -> None:
    """Each layer defines the server "dup" whose command is the layer's index."""
    documents: dict[Path, dict[str, Any]] = {}
    for index, (path, keys) in enumerate(layers):
        node = documents.setdefault(path, {})
        for key in keys:
            node = node.setdefault(key, {})
        node["dup"] = stdio(str(index))
    for path, document in documents.items():
        if path.suffix == ".toml":
            write(path, '[mcp_servers.dup]\ncommand = "%s"\n' % document["mcp_servers"]["dup"]["command"])
        else:
            write(path, document)


def test_precedence_follows_the_documented_order(host: Host, tmp_path: Path) -> None:
    layers = precedence_layers(host, tmp_path)
    for count in reversed(range(1, len(layers) + 1)):
        for path, _ in layers:
            path.unlink(missing_ok=True)
        write_layers(layers[:count])
        explicit = layers[-1][0] if count == len(layers) else None
        assert only(host.discover(explicit=explicit)).command == str(count - 1)


def test_config_sources_lists_linux_files_lowest_precedence_first(host: Host, tmp_path: Path) -> None:
    write(host.state_dir / "z.json", {})
    write(host.state_dir / "a.json", {})
    labels = [
        source.label for source in config_sources(host.home, host.cwd, "linux", {}, host.state_dir, None)
    ]
    home, cwd = host.home, host.cwd
    assert labels == [
        str(host.state_dir / "a.json"),
        str(host.state_dir / "z.json"),
        str(home / ".config/Claude/claude_desktop_config.json"),
        str(home / ".codeium/windsurf/mcp_config.json"),
        str(home / ".gemini/settings.json"),
        str(home / ".codex/config.toml"),
        str(home / ".config/Code/User/mcp.json"),
        str(home / ".config/Code/User/settings.json"),
        str(home / ".cursor/mcp.json"),
        str(home / ".claude.json"),
        str(cwd / ".vscode/mcp.json"),
        str(cwd / ".cursor/mcp.json"),
        "%s projects[%s]" % (home / ".claude.json", cwd),
        str(cwd / ".mcp.json"),
    ]


def test_mcp_servers_config_is_the_only_source_when_set(host: Host, tmp_path: Path) -> None:
    write(host.state_dir / "own.json", {"mcpServers": {"own": stdio("own")}})
    write(host.home / ".config/Claude/claude_desktop_config.json", {"mcpServers": {"claude": stdio("c")}})
    explicit = write(tmp_path / "explicit.json", {"mcpServers": {"mine": stdio("mine")}})

    result = host.discover(explicit=explicit)

    assert sorted(servers(result)) == ["mine"]
    assert result.sources == (str(explicit),)


def test_client_discovery_can_be_turned_off_leaving_the_bridges_own_files(host: Host) -> None:
    write(host.state_dir / "own.json", {"mcpServers": {"own": stdio("own")}})
    write(host.home / ".config/Claude/claude_desktop_config.json", {"mcpServers": {"claude": stdio("c")}})
    write(host.cwd / ".mcp.json", {"mcpServers": {"project": stdio("p")}})

    off = discover_servers(host.home, host.cwd, "linux", {}, host.state_dir, None, clients=False)

    assert sorted(servers(off)) == ["own"]
    assert sorted(servers(host.discover())) == ["claude", "own", "project"]


# --- variables --------------------------------------------------------------------


def test_expand_variables_uses_the_environment_defaults_and_the_vscode_env_prefix() -> None:
    environ = {"TOKEN": "t0k", "EMPTY": ""}
    assert expand_variables("Bearer ${TOKEN}", environ) == ("Bearer t0k", [], [])
    assert expand_variables("${env:TOKEN}/${MISSING:-fallback}", environ) == ("t0k/fallback", [], [])
    assert expand_variables("${EMPTY:-used when empty}", environ) == ("used when empty", [], [])
    assert expand_variables("[${EMPTY}]", environ) == ("[]", [], [])
    assert expand_variables("$TOKEN ${TOKEN", environ) == ("$TOKEN ${TOKEN", [], [])


def test_vscode_variables_resolve_and_prompts_are_never_passed_on_literally() -> None:
    editor = {"workspaceFolder": "/work/app", "userHome": "/home/me"}
    assert expand_variables("${workspaceFolder}/data:${userHome}", {}, editor) == (
        "/work/app/data:/home/me",
        [],
        [],
    )
    assert expand_variables("Bearer ${input:api-key}", {"input": "x"}, editor) == (
        "Bearer ",
        [],
        ["${input:api-key}"],
    )
    assert expand_variables("${command:pick} ${config:x.y}", {}, editor)[2] == [
        "${command:pick}",
        "${config:x.y}",
    ]


def test_an_entry_that_needs_a_prompted_secret_is_skipped_and_reported(host: Host) -> None:
    entry = {
        "type": "stdio",
        "command": "gh-mcp",
        "args": ["${workspaceFolder}"],
        "env": {"T": "${input:token}"},
    }
    path = write(host.cwd / ".vscode" / "mcp.json", {"servers": {"gh": entry, "ok": {"command": "ok"}}})
    result = host.discover()
    assert [spec.name for spec in result.servers] == ["ok"]
    assert result.problems == (
        "%s: skipped gh: ${input:token} cannot be resolved here (VS Code asks for ${input:...} values "
        "itself); write ${env:NAME} and set NAME in the bridge's environment instead" % path,
    )
    entry["env"] = {}
    write(path, {"servers": {"gh": entry}})
    assert host.discover().servers[0].args == (str(host.cwd),)


def test_unset_variable_expands_to_empty_and_is_reported_once_by_name(host: Host) -> None:
    assert expand_variables("${NOPE}-${NOPE}-${ALSO}", {}) == ("--", ["NOPE", "ALSO"], [])
    path = write(
        host.cwd / ".mcp.json", {"mcpServers": {"gh": {"command": "gh", "env": {"T": "${GH_TOKEN}"}}}}
    )
    result = host.discover()
    assert dict(result.servers[0].env) == {"T": ""}
    assert result.problems == (
        "%s: server gh: ${GH_TOKEN} is not set, so it expanded to an empty string" % path,
    )


def test_variables_are_expanded_in_every_launch_field(host: Host) -> None:
    write(
        host.cwd / ".mcp.json",
        {
            "mcpServers": {
                "local": {
                    "command": "${BIN}/server",
                    "args": ["--root", "${env:ROOT}"],
                    "env": {"KEY": "${KEY:-none}"},
                    "cwd": "${ROOT}/run",
                },
                "remote": {"type": "http", "url": "https://${HOST}/mcp", "headers": {"A": "Bearer ${KEY}"}},
            }
        },
    )
    environ = {"BIN": "/opt/bin", "ROOT": "/data", "HOST": "example.com", "KEY": "k"}
    found = servers(host.discover(environ=environ))
    local, remote = found["local"], found["remote"]
    assert (local.command, local.args, dict(local.env), local.cwd) == (
        "/opt/bin/server",
        ("--root", "/data"),
        {"KEY": "k"},
        "/data/run",
    )
    assert (remote.url, dict(remote.headers)) == ("https://example.com/mcp", {"A": "Bearer k"})


# --- entries that are skipped -----------------------------------------------------


def test_entries_that_launch_this_bridge_are_skipped_with_a_problem(host: Host) -> None:
    path = write(
        host.home / ".claude.json",
        {
            "mcpServers": {
                "code-exec": stdio("uvx", "mcp-server-code-execution-mode"),
                "as-module": stdio("python", "-m", "mcp_server_code_execution_mode"),
                "by-variable": stdio("${BRIDGE}"),
                "other": stdio("uvx", "mcp-server-time"),
            }
        },
    )
    result = host.discover(environ={"BRIDGE": "/usr/local/bin/mcp-server-code-execution-mode"})
    assert [spec.name for spec in result.servers] == ["other"]
    assert sorted(result.problems) == [
        "%s: skipped %s: it launches this bridge itself" % (path, name)
        for name in ("as-module", "by-variable", "code-exec")
    ]


def test_disabled_entries_are_skipped_without_a_problem(host: Host) -> None:
    write(host.cwd / ".mcp.json", {"mcpServers": {"off": {**stdio("x"), "disabled": True}, "on": stdio("y")}})
    assert only(host.discover()).name == "on"


def test_a_disabled_entry_hides_a_lower_precedence_entry_of_the_same_name(host: Host) -> None:
    write(host.home / ".cursor/mcp.json", {"mcpServers": {"github": stdio("gh")}})
    write(host.cwd / ".mcp.json", {"mcpServers": {"github": {**stdio("gh"), "disabled": True}}})
    assert host.discover() == DiscoveryResult(
        (), (), (str(host.home / ".cursor/mcp.json"), str(host.cwd / ".mcp.json"))
    )


def test_malformed_files_are_reported_and_other_files_still_load(host: Host) -> None:
    bad_json = write(host.home / ".cursor/mcp.json", '{"mcpServers": {"x": ')
    bad_toml = write(host.home / ".codex/config.toml", "[mcp_servers.x\n")
    not_an_object = write(host.home / ".gemini/settings.json", ["a", "list"])
    bad_table = write(host.home / ".codeium/windsurf/mcp_config.json", {"mcpServers": ["a"]})
    (host.cwd / ".vscode/mcp.json").mkdir(parents=True)  # a directory where a file should be
    write(host.cwd / ".mcp.json", {"mcpServers": {"good": stdio("g")}})
    result = host.discover()
    assert [spec.name for spec in result.servers] == ["good"]
    problems = "\n".join(result.problems)
    assert len(result.problems) == 5, problems
    for path in (bad_json, bad_toml, not_an_object, bad_table, host.cwd / ".vscode/mcp.json"):
        assert "%s: cannot be used: " % path in problems
    assert "the top level is not an object" in problems
    assert "mcpServers is not an object" in problems
    assert "it is a directory, not a regular file" in problems
    assert result.unusable == result.problems  # whole files: the sandbox names them (notices, errors)


def test_a_malformed_claude_json_is_reported_once_though_two_sources_read_it(host: Host) -> None:
    path = write(host.home / ".claude.json", "{not json")
    result = host.discover()
    assert len(result.problems) == 1 and result.problems[0].startswith("%s: cannot be used: " % path)
    assert result.sources == (str(path), "%s projects[%s]" % (path, host.cwd))


def test_malformed_entries_are_reported_and_their_siblings_still_load(host: Host) -> None:
    path = write(
        host.cwd / ".mcp.json",
        {
            "mcpServers": {
                "nothing": {"env": {}},
                "bad-args": {"command": "x", "args": "--flag"},
                "bad-arg-item": {"command": "x", "args": ["--n", 3]},
                "bad-env": {"command": "x", "env": ["A=1"]},
                "bad-env-value": {"command": "x", "env": {"PORT": 8080}},
                "bad-type": {"type": "websocket", "url": "ws://x"},
                "remote-without-url": {"type": "sse"},
                "not-an-object": "uvx thing",
                "good": stdio("g"),
            }
        },
    )
    result = host.discover()
    assert [spec.name for spec in result.servers] == ["good"]
    assert result.problems == (
        "%s: skipped nothing: it has neither a command nor a url" % path,
        "%s: skipped bad-args: args must be a list of strings" % path,
        "%s: skipped bad-arg-item: args must be a list of strings" % path,
        "%s: skipped bad-env: env must be an object whose values are strings" % path,
        "%s: skipped bad-env-value: env must be an object whose values are strings" % path,
        "%s: skipped bad-type: type 'websocket' is not one of stdio, http, streamable-http, sse" % path,
        "%s: skipped remote-without-url: a sse server needs a url" % path,
        "%s: skipped not-an-object: the entry is not an object" % path,
    )
    assert result.unusable == ()  # the file itself was read


def test_problems_of_an_entry_replaced_by_a_later_file_are_dropped(host: Host) -> None:
    write(host.home / ".cursor/mcp.json", {"mcpServers": {"gh": {"command": "gh", "args": 1}}})
    write(host.cwd / ".mcp.json", {"mcpServers": {"gh": stdio("gh")}})
    assert only(host.discover()).source == str(host.cwd / ".mcp.json")


# --- transports -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry_type", "transport"),
    [
        ("http", "http"),
        ("streamable-http", "http"),
        ("streamableHttp", "http"),
        ("sse", "sse"),
        (None, "http"),
    ],
)
def test_remote_entry_type_selects_the_transport(host: Host, entry_type: str | None, transport: str) -> None:
    entry: dict[str, Any] = {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}}
    if entry_type is not None:
        entry["type"] = entry_type
    write(host.cwd / ".mcp.json", {"mcpServers": {"remote": entry}})
    spec = only(host.discover())
    assert (spec.transport, spec.url, dict(spec.headers)) == (
        transport,
        "https://example.com/mcp",
        {"Authorization": "Bearer x"},
    )
    assert (spec.command, spec.args) == (None, ())


# --- aliases ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "alias"),
    [
        ("github", "github"),
        ("GitHub Enterprise", "github_enterprise"),
        ("@scope/server-name", "scope_server_name"),
        ("--a..b--", "a_b"),
        ("2fa", "s_2fa"),
        ("Ünïcode", "n_code"),
        ("!!!", "server"),
        ("", "server"),
    ],
)
def test_sanitize_alias_gives_a_lower_case_identifier(name: str, alias: str) -> None:
    assert sanitize_alias(name) == alias
    assert alias.isidentifier()


def test_alias_collisions_are_resolved_by_sorted_name_whatever_the_file_order(host: Host) -> None:
    names = ["My Server", "my-server", "my_server", "my_server_2", "other"]
    write(host.home / ".cursor/mcp.json", {"mcpServers": {name: stdio("x") for name in names}})
    write(host.cwd / ".mcp.json", {"mcpServers": {name: stdio("x") for name in reversed(names)}})
    result = host.discover()
    assert [(spec.alias, spec.name) for spec in result.servers] == [
        ("my_server", "My Server"),  # "M" sorts before "m"
        ("my_server_2", "my_server_2"),  # keeps its own alias; the colliders skip it
        ("my_server_3", "my-server"),
        ("my_server_4", "my_server"),
        ("other", "other"),
    ]


def test_server_spec_is_immutable_and_hashable() -> None:
    env = {"A": "1"}
    spec = ServerSpec("s", "s", "stdio", command="c", args=["x"], env=env)  # type: ignore[arg-type]
    env["A"] = "changed"
    assert (spec.args, dict(spec.env)) == (("x",), {"A": "1"})
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        spec.command = "other"  # type: ignore[misc]
    twin = ServerSpec("s", "s", "stdio", command="c", args=("x",), env={"A": "1"})
    assert spec == twin and hash(spec) == hash(twin)
    assert spec != ServerSpec("s", "s", "stdio", command="c", args=("x",), env={"A": "2"})


@pytest.mark.parametrize(
    "argv",
    [
        ["uvx", "mcp-server-code-execution-mode"],
        ["uvx", "mcp-server-code-execution-mode@latest"],
        ["pipx", "run", "mcp-server-code-execution-mode==0.1.0"],
        ["/home/me/.local/bin/mcp-server-code-execution-mode"],
        ["python", "-m", "mcp_server_code_execution_mode"],
        ["python3", "/opt/bridge/mcp_server_code_execution_mode.py"],
        ["C:\\Tools\\mcp-server-code-execution-mode.exe"],
    ],
)
def test_launches_self_recognises_the_bridge_however_it_is_started(argv: list[str]) -> None:
    from mcp_server_code_execution_mode import SELF_MARKERS, launches_self

    assert launches_self(argv, SELF_MARKERS)


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "/src/mcp-server-code-execution-mode/tests/servers/stub_server.py"],
        ["node", "/home/runner/work/mcp-server-code-execution-mode/server.js"],
        ["uvx", "mcp-server-code-execution-mode-helper"],
        ["mcp-server-time"],
    ],
)
def test_launches_self_ignores_paths_that_merely_contain_the_name(argv: list[str]) -> None:
    from mcp_server_code_execution_mode import SELF_MARKERS, launches_self

    assert not launches_self(argv, SELF_MARKERS)


# --- project servers: started only where their client records the user's trust -------


def claude_project(host: Host, folder: Path | None = None, **settings: Any) -> Path:
    """~/.claude.json as Claude Code writes it, with `settings` for the folder (default: cwd)."""
    return write(host.home / ".claude.json", {"projects": {str(folder or host.cwd): settings}})


def not_trusted(result: DiscoveryResult) -> dict[str, str]:
    """name -> its "found but not trusted" problem line."""
    lines = [line for line in result.problems if " is found but not trusted: " in line]
    assert len(lines) == len(result.untrusted), result
    return dict(zip(result.untrusted, lines, strict=True))


def test_a_project_mcp_json_is_not_started_until_claude_code_records_trust(host: Host) -> None:
    path = write(host.cwd / ".mcp.json", {"mcpServers": {"evil": stdio("sh", "-c", "id > marker")}})
    result = host.discover(project_servers="trusted")
    assert result.servers == ()
    line = not_trusted(result)["evil"]
    assert line.startswith("%s: not started: evil is found but not trusted: " % path)
    assert "trust dialog has not been accepted" in line and "run `claude` in %s" % host.cwd in line
    assert "MCP_BRIDGE_PROJECT_SERVERS=all" in line

    claude_project(host, hasTrustDialogAccepted=False, disabledMcpjsonServers=["evil"])
    assert (
        "rejected it (disabledMcpjsonServers)"
        in not_trusted(host.discover(project_servers="trusted"))["evil"]
    )

    claude_project(host, hasTrustDialogAccepted=True)  # trusted, but this server never approved
    assert "has not been approved" in not_trusted(host.discover(project_servers="trusted"))["evil"]

    claude_project(
        host, hasTrustDialogAccepted=True, enabledMcpjsonServers=["evil"], disabledMcpjsonServers=[]
    )
    assert only(host.discover(project_servers="trusted")).name == "evil"

    claude_project(host, hasTrustDialogAccepted=True, enableAllProjectMcpServers=True)
    assert only(host.discover(project_servers="trusted")).name == "evil"

    # Rejected wins over approved, wherever each is written.
    claude_project(host, hasTrustDialogAccepted=True, enableAllProjectMcpServers=True)
    write(host.home / ".claude/settings.json", {"disabledMcpjsonServers": ["evil"]})
    assert "evil" in not_trusted(host.discover(project_servers="trusted"))


def test_claude_code_trust_of_a_parent_folder_and_approvals_in_settings_files_count(host: Host) -> None:
    write(host.cwd / ".mcp.json", {"mcpServers": {"a": stdio("a"), "b": stdio("b"), "c": stdio("c")}})
    claude_project(host, host.cwd.parent, hasTrustDialogAccepted=True)
    write(host.home / ".claude/settings.json", {"enabledMcpjsonServers": ["a"]})
    write(host.cwd / ".claude/settings.local.json", {"enabledMcpjsonServers": ["b"]})
    result = host.discover(project_servers="trusted")
    assert [spec.name for spec in result.servers] == ["a", "b"]
    assert list(not_trusted(result)) == ["c"]


def test_a_repository_cannot_approve_its_own_servers_in_an_untrusted_folder(host: Host) -> None:
    write(host.cwd / ".mcp.json", {"mcpServers": {"evil": stdio("evil")}})
    write(host.cwd / ".claude/settings.json", {"enableAllProjectMcpServers": True})
    write(host.cwd / ".claude/settings.local.json", {"enabledMcpjsonServers": ["evil"]})
    assert "trust dialog" in not_trusted(host.discover(project_servers="trusted"))["evil"]


def test_cursor_and_vscode_project_servers_are_not_started_under_trusted(host: Host) -> None:
    cursor = write(host.cwd / ".cursor/mcp.json", {"mcpServers": {"c": stdio("c")}})
    vscode = write(host.cwd / ".vscode/mcp.json", {"servers": {"v": stdio("v")}})
    claude_project(host, hasTrustDialogAccepted=True, enableAllProjectMcpServers=True)  # Claude Code's only
    result = host.discover(project_servers="trusted")
    assert result.servers == ()
    lines = not_trusted(result)
    assert lines["c"].startswith("%s: not started: c is found but not trusted: Cursor keeps" % cursor)
    assert lines["v"].startswith("%s: not started: v is found but not trusted: VS Code keeps" % vscode)
    assert str(host.state_dir / "servers.json") in lines["c"]
    assert {spec.name for spec in host.discover(project_servers="all").servers} == {"c", "v"}


def test_claude_code_local_scope_servers_are_the_users_own_and_start(host: Host) -> None:
    claude_project(host, hasTrustDialogAccepted=False, mcpServers={"mine": stdio("m")})
    assert only(host.discover(project_servers="trusted")).name == "mine"
    assert only(host.discover(project_servers="none")).name == "mine"


def test_an_untrusted_project_server_does_not_hide_the_users_server_of_that_name(host: Host) -> None:
    write(host.home / ".cursor/mcp.json", {"mcpServers": {"github": stdio("users-own")}})
    write(host.cwd / ".mcp.json", {"mcpServers": {"github": stdio("the-repositorys")}})
    result = host.discover(project_servers="trusted")
    assert [spec.command for spec in result.servers] == ["users-own"]
    assert list(not_trusted(result)) == ["github"]
    assert [spec.command for spec in host.discover(project_servers="all").servers] == ["the-repositorys"]


def test_a_project_entry_that_launches_this_bridge_is_skipped_as_such_not_as_untrusted(host: Host) -> None:
    path = write(
        host.cwd / ".mcp.json",
        {"mcpServers": {"code-execution": stdio("uvx", "mcp-server-code-execution-mode")}},
    )
    result = host.discover(project_servers="trusted")
    assert (result.servers, result.untrusted) == ((), ())
    assert result.problems == ("%s: skipped code-execution: it launches this bridge itself" % path,)


def test_none_leaves_the_project_files_unread(host: Host) -> None:
    for path in (host.cwd / ".mcp.json", host.cwd / ".cursor/mcp.json"):
        write(path, {"mcpServers": {path.parent.name: stdio("x")}})
    assert host.discover(project_servers="none") == DiscoveryResult((), (), ())


def test_a_hostile_server_name_is_shown_escaped_and_bounded(host: Host) -> None:
    name = "\x1b]0;owned\x07\x1b[2J" + "x" * 500
    write(host.cwd / ".mcp.json", {"mcpServers": {name: stdio("x")}})
    result = host.discover(project_servers="trusted")
    (shown,) = result.untrusted
    assert "\x1b" not in shown and "\x07" not in shown and shown.startswith("\\x1b]0;owned\\x07")
    assert len(shown) < 150 and not any("\x1b" in line for line in result.problems)


# --- reading config files: only regular files, bounded --------------------------------


def test_a_config_that_is_a_link_to_dev_zero_or_a_fifo_is_a_problem_and_others_still_load(
    host: Host,
) -> None:
    import os

    zero = host.home / ".cursor/mcp.json"
    zero.parent.mkdir(parents=True)
    zero.symlink_to("/dev/zero")
    fifo = host.home / ".gemini/settings.json"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    huge = write(host.home / ".codeium/windsurf/mcp_config.json", "")
    os.truncate(huge, MAX_CONFIG_FILE_BYTES + 1)  # sparse: no real disk use
    write(host.home / ".claude.json", {"mcpServers": {"good": stdio("g")}})
    # In a process of its own, bounded: a FIFO read without O_NONBLOCK hangs, /dev/zero grows forever.
    script = (
        "import json, sys; from pathlib import Path; import mcp_server_code_execution_mode as m; "
        "r = m.discover_servers(Path(sys.argv[1]), Path(sys.argv[2]), 'linux', {}, Path(sys.argv[3]), None); "
        "print(json.dumps([[s.name for s in r.servers], r.problems]))"
    )
    argv = [sys.executable, "-c", script, str(host.home), str(host.cwd), str(host.state_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    names, lines = json.loads(done.stdout)
    assert names == ["good"]
    problems = "\n".join(lines)
    assert "%s: cannot be used: it is a character device, not a regular file" % zero in problems
    assert "%s: cannot be used: it is a named pipe (FIFO), not a regular file" % fifo in problems
    assert "%s: cannot be used: it is larger than 128 MiB" % huge in problems


# --- the acceptance test: a hostile repository's .mcp.json and a real bridge ----------


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["untrusted", "approved", "all"])
async def test_a_repositorys_mcp_json_runs_on_the_host_only_once_trusted(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path, case: str
) -> None:
    project, marker, home = tmp_path / "repo", tmp_path / "MARKER", tmp_path / "home"
    write(project / ".mcp.json", {"mcpServers": {"evil": stdio("sh", "-c", "id > %s" % marker)}})
    approved = case == "approved"
    approval = {"enabledMcpjsonServers" if approved else "disabledMcpjsonServers": ["evil"]}
    write(
        home / ".claude.json", {"projects": {str(project): {"hasTrustDialogAccepted": approved, **approval}}}
    )
    settings = {"MCP_BRIDGE_PROJECT_SERVERS": "all"} if case == "all" else {}
    env = proxy_env(proxy_engine, state_dir, home, MCP_BRIDGE_SERVER_START_TIMEOUT="10", **settings)
    async with bridge_client(env, cwd=project) as client:
        seen = await run_cell(
            client,
            """
            from mcp import runtime
            runtime.search_tool_docs("anything")
            {
                "servers": runtime.list_servers(),
                "problems": runtime.discovered_servers(detailed=True)["problems"],
                "summary": runtime.capability_summary(),
            }
            """,
        )
    assert seen["status"] == "ok", seen
    value = ast.literal_eval(seen["value"])
    if case == "untrusted":
        assert not marker.exists()  # before the fix: `id` had run, as the user
        assert value["servers"] == []
        (line,) = [line for line in value["problems"] if "evil is found but not trusted" in line]
        assert "rejected it (disabledMcpjsonServers)" in line and "MCP_BRIDGE_PROJECT_SERVERS=all" in line
        assert "not trusted, so not started: evil" in value["summary"]
    else:
        assert marker.read_text().startswith("uid="), seen  # it ran, as the user
        assert value["servers"] == ["evil"]
    doctor = subprocess.run(
        [console_script(), "doctor"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    config, servers = doctor.stdout.split("\nMCP servers, each started once\n")
    if case == "untrusted":  # doctor starts what the bridge would start: not this one
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "  warn  " + line in config
        assert "evil" not in servers and not marker.exists()
    else:  # trusted, so started once, and named: it is no MCP server
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "  fail  MCP server 'evil' (command: sh -c 'id > " in servers, servers
        assert "could not be started: its process exited with status 0" in servers, servers
        assert "not trusted" not in doctor.stdout


# --- a config file that cannot be used: its servers are missing, and the model is told ---

# A comma left out between two entries, as a hand edit does.
BROKEN_SERVERS_JSON = '{"mcpServers": {"time": {"command": "mcp-server-time"} "fetch": {"command": "f"}}}'


def broken_servers_json(tmp_path: Path, state_dir: Path) -> tuple[Path, Path, str]:
    """A Claude Desktop config with the stub server, and a servers.json in the state
    directory that is not JSON: (the fake home, the broken file, its problem line)."""
    home = tmp_path / "home"
    write(home / ".config/Claude/claude_desktop_config.json", {"mcpServers": {"stub": stub_entry()}})
    broken = write(state_dir / "servers.json", BROKEN_SERVERS_JSON)
    (problem,) = discover_servers(home, tmp_path, "linux", {}, state_dir, None).problems
    assert problem.startswith("%s: cannot be used: " % broken) and "line 1 column" in problem, problem
    return home, broken, problem


# Each way code names a server, for a server that is not there: Python's own error, then
# what the bridge adds.
MISSING_SERVER_FORMS = [
    ("mcp_time.get_current_time(timezone='UTC')", "NameError: name 'mcp_time' is not defined. "),
    (
        "from mcp.servers import time",
        "ImportError: cannot import name 'time' from 'mcp.servers' (unknown location). ",
    ),
    (
        "from mcp import mcp_time",
        "ImportError: cannot import name 'mcp_time' from 'mcp' (unknown location). ",
    ),
    (
        "import mcp.servers.time",
        "ModuleNotFoundError: No module named 'mcp.servers.time'; 'mcp.servers' is not a package. ",
    ),
    (
        "import mcp.servers\nmcp.servers.time",
        "AttributeError: module 'mcp.servers' has no attribute 'time'. ",
    ),
]


async def check_a_broken_config_file_is_named(client: Any, problem: str) -> None:
    """What the model sees of it: the first result's notices, runtime.discovered_servers(),
    and every way code names a server that is missing."""
    first = await run_cell(client, "from mcp import runtime\nruntime.discovered_servers()")
    assert first["status"] == "ok", first
    assert first["notices"] == [
        "An MCP server configuration file could not be used, so the servers it configures are missing: "
        "%s. Tell the user: once the file is fixed, restart this MCP server (or the client) to read it."
        % problem
    ]
    assert first["value"] == (
        "['stub']\n# Servers are missing: a configuration file could not be used:\n#   %s" % problem
    )
    assert first["json"] is None  # not plain JSON: the problems show with it
    listed = await run_cell(
        client, "servers = runtime.discovered_servers()\n(servers == ['stub'], runtime.list_servers())"
    )
    assert listed["notices"] == [] and listed["value"].startswith("(True, ['stub']\n# Servers are missing"), (
        listed
    )
    explained = (
        "There is no MCP server 'time' in this sandbox. Its servers: mcp_stub. A configuration file "
        "could not be used, so the servers it configures are missing: %s. Tell the user: once it is "
        "fixed, restart the MCP server (or the client) to read it. "
        "runtime.discovered_servers(detailed=True) shows where each server came from." % problem
    )
    for code, error in MISSING_SERVER_FORMS:
        failed = await run_cell(client, code)
        assert failed["is_error"], failed
        assert failed["text"].rstrip().endswith(error + explained), (code, failed["text"])
    called = await run_cell(client, "runtime.call_tool('time', 'get_current_time', {'timezone': 'UTC'})")
    assert called["is_error"]
    assert (
        "Unknown MCP server 'time'. Available servers: stub. A configuration file could not be used, so its "
        "servers are missing: %s." % problem
    ) in called["text"], called["text"]


@pytest.mark.anyio
async def test_a_broken_config_file_is_named_to_the_model(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home, _, problem = broken_servers_json(tmp_path, state_dir)
    async with bridge_client(proxy_env(engine, state_dir, home)) as client:
        await check_a_broken_config_file_is_named(client, problem)
        detailed = await run_cell(client, "runtime.discovered_servers(detailed=True)['problems']")
        assert problem in ast.literal_eval(detailed["value"])
        # A name close to a server's: the error names it; any other name: Python's error alone.
        other = await run_cell(client, "mcp_stub_typo")
        assert (
            "NameError: name 'mcp_stub_typo' is not defined. There is no MCP server 'stub_typo' in this "
            "sandbox (did you mean mcp_stub?). Its servers: mcp_stub." in other["text"]
        ), other["text"]
        plain = await run_cell(client, "undefined_name")
        assert plain["text"].rstrip().endswith("NameError: name 'undefined_name' is not defined")
