"""Configuration section: load_config(), the OPTIONS table, --help/--version and main()'s
start-up error path."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import mcp_server_code_execution_mode as bridge
from mcp_server_code_execution_mode import OPTIONS, BridgeConfig, ConfigError, build_arg_parser, load_config
from tests.conftest import bridge_env, console_script, text_of

TESTS_DIR = Path(__file__).resolve().parent
AUTH_TOKENS = TESTS_DIR / "servers" / "auth_tokens.txt"
AUTH_DIGESTS = (
    (hashlib.sha256(b"alice-token-0123456789abcdef").digest(), "alice"),
    (hashlib.sha256(b"bob-token-0123456789abcdef").digest(), "bob"),
)

# One valid, non-default raw value per environment variable, and what it parses to.
ENV_VALUES: dict[str, tuple[str, Any]] = {
    "MCP_BRIDGE_RUNTIME": ("docker", "docker"),
    "MCP_BRIDGE_IMAGE": (
        "ghcr.io/example/python:3.12-slim@sha256",
        "ghcr.io/example/python:3.12-slim@sha256",
    ),
    "MCP_BRIDGE_TIMEOUT": ("12.5", 12.5),
    "MCP_BRIDGE_MAX_TIMEOUT": ("300", 300.0),
    "MCP_BRIDGE_STATE_DIR": ("/srv/mcp-state", Path("/srv/mcp-state")),
    "MCP_BRIDGE_OUTPUT_MODE": ("toon", "toon"),
    "MCP_BRIDGE_MEMORY": ("1g", "1g"),
    "MCP_BRIDGE_PIDS": ("64", 64),
    "MCP_BRIDGE_CPUS": ("0.5", 0.5),
    "MCP_BRIDGE_CONTAINER_USER": ("1000:1000", "1000:1000"),
    "MCP_BRIDGE_IDLE_TIMEOUT": ("0", 0.0),
    "MCP_BRIDGE_PREWARM": ("no", False),
    "MCP_BRIDGE_MAX_SESSIONS": ("3", 3),
    "MCP_BRIDGE_MAX_OUTPUT": ("2_000", 2000),
    "MCP_BRIDGE_MAX_FRAME_BYTES": ("67108864", 67108864),
    "MCP_BRIDGE_START_TIMEOUT": ("45", 45.0),
    "MCP_BRIDGE_LOG_LEVEL": ("DEBUG", "DEBUG"),
    "MCP_SERVERS_CONFIG": (__file__, Path(__file__)),
    "MCP_BRIDGE_ALLOW_SERVERS": ("github, time*", ("github", "time*")),
    "MCP_BRIDGE_DENY_SERVERS": ("shell", ("shell",)),
    "MCP_BRIDGE_ALLOW_TOOLS": ("time.*", ("time.*",)),
    "MCP_BRIDGE_DENY_TOOLS": ("filesystem.write_*,*.delete_*", ("filesystem.write_*", "*.delete_*")),
    "MCP_BRIDGE_APPROVE": ("all", "all"),
    "MCP_BRIDGE_APPROVE_TOOLS": ("github.merge_*", ("github.merge_*",)),
    "MCP_BRIDGE_ALLOW_TOOLS_WITHOUT_ASKING": (
        "notes.write_*, *.create_issue",
        ("notes.write_*", "*.create_issue"),
    ),
    "MCP_BRIDGE_APPROVAL_TIMEOUT": ("60", 60.0),
    "MCP_BRIDGE_APPROVE_FALLBACK": ("deny", "deny"),
    "MCP_BRIDGE_MAX_TOOL_CALLS": ("50", 50),
    "MCP_BRIDGE_CALL_LOG": ("full", "full"),
    "MCP_BRIDGE_SERVER_START_TIMEOUT": ("5", 5.0),
    "MCP_BRIDGE_TOOL_TIMEOUT": ("7.5", 7.5),
    "MCP_BRIDGE_PASS_ENV": ("GITHUB_TOKEN, AWS_*", ("GITHUB_TOKEN", "AWS_*")),
    "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES": ("1_000_000", 1_000_000),
    "MCP_BRIDGE_MAX_IMAGES": ("3", 3),
    "MCP_BRIDGE_MAX_IMAGE_BYTES": ("500000", 500_000),
    "MCP_BRIDGE_MAX_ATTACHMENT_BYTES": ("1000", 1000),
    "MCP_BRIDGE_RESPOND_AFTER": ("5.5", 5.5),
    "MCP_BRIDGE_OCI_RUNTIME": ("/usr/bin/runsc", "/usr/bin/runsc"),
    "MCP_BRIDGE_KERNEL_DELIVERY": ("stdin", "stdin"),
    "MCP_BRIDGE_FRAME_CHANNEL": ("stdio", "stdio"),
    "MCP_BRIDGE_OAUTH_ISSUER": ("https://login.example.com/tenant", "https://login.example.com/tenant"),
    "MCP_BRIDGE_OAUTH_RESOURCE": ("https://bridge.example.com/mcp", "https://bridge.example.com/mcp"),
    "MCP_BRIDGE_OAUTH_PRINCIPAL_CLAIM": ("email", "email"),
    "MCP_BRIDGE_OAUTH_SCOPES": ("mcp, tools", ("mcp", "tools")),
    "MCP_BRIDGE_OAUTH_CLIENT_ID": ("mcp-bridge", "mcp-bridge"),
    "MCP_BRIDGE_OAUTH_CLIENT_SECRET_FILE": (__file__, Path(__file__)),
    "MCP_BRIDGE_KUBE_NAMESPACE": ("sandboxes", "sandboxes"),
    "MCP_BRIDGE_KUBE_CONTEXT": ("team@cluster-1", "team@cluster-1"),
    "MCP_BRIDGE_KUBE_RUNTIME_CLASS": ("gvisor", "gvisor"),
    "MCP_BRIDGE_MAX_MEMORY_BYTES": ("2048", 2048),
    "MCP_BRIDGE_ALLOW_ROOT": ("yes", True),
    "MCP_BRIDGE_DISCOVER": ("0", False),
    "MCP_BRIDGE_PROJECT_SERVERS": ("all", "all"),
    "MCP_BRIDGE_MAX_MEMORY_TOTAL_BYTES": ("1_000_000", 1_000_000),
    "MCP_BRIDGE_MAX_MEMORIES": ("50", 50),
    "MCP_BRIDGE_WORKSPACE": (str(TESTS_DIR) + ":ro", bridge.Workspace(TESTS_DIR, read_only=True)),
    "MCP_BRIDGE_TRANSPORT": ("http", "http"),
    "MCP_BRIDGE_HOST": ("0.0.0.0", "0.0.0.0"),  # allowed here: the token file below is set too
    "MCP_BRIDGE_PORT": ("8443", 8443),
    "MCP_BRIDGE_PUBLIC_URL": ("https://bridge.example.com/team/", "https://bridge.example.com/team"),
    "MCP_BRIDGE_AUTH_TOKENS": (str(AUTH_TOKENS), bridge.AuthTokens(AUTH_TOKENS, AUTH_DIGESTS)),
    "MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL": ("2", 2),
    "MCP_BRIDGE_MAX_TOTAL_SESSIONS": ("100", 100),
    "MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL": ("4", 4),
    "MCP_BRIDGE_MCP_SESSION_IDLE_TIMEOUT": ("60", 60.0),
    "MCP_BRIDGE_HTTP_REQUEST_TIMEOUT": ("2.5", 2.5),
    "MCP_BRIDGE_HTTP_MAX_CONNECTIONS": ("64", 64),
}


def test_no_flags_and_no_environment_gives_the_defaults() -> None:
    config = load_config([], {})

    assert config == BridgeConfig()
    assert config.runtime is None
    assert config.image == "python:3.14-slim"
    assert config.timeout == 30.0
    assert config.max_timeout == 3600.0
    assert config.respond_after is None  # by the client: respond_after_for
    assert config.output_mode == "compact"
    assert config.memory == "512m"
    assert config.container_user == "65534:65534"
    assert config.prewarm is True
    assert config.state_dir == Path("~/MCPs").expanduser()


def test_every_option_has_a_parse_case_in_this_test() -> None:
    # Guards the table below: a new Option must come with a test value.
    assert {option.env for option in OPTIONS} == set(ENV_VALUES)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: option.env)
def test_environment_variable_is_parsed_into_its_field(option: bridge.Option) -> None:
    raw, expected = ENV_VALUES[option.env]
    # MAX_TIMEOUT must stay >= the default timeout and TIMEOUT <= the default maximum. The
    # OAuth settings and the public URL belong to the HTTP transport, the rest of OAuth's to
    # an issuer.
    needs = {}
    if option.env.startswith("MCP_BRIDGE_OAUTH_"):
        needs = {"MCP_BRIDGE_TRANSPORT": "http", "MCP_BRIDGE_OAUTH_ISSUER": "https://login.example.com/"}
        if option.env.startswith("MCP_BRIDGE_OAUTH_CLIENT_"):  # the two go together
            client = [env for env in ENV_VALUES if env.startswith("MCP_BRIDGE_OAUTH_CLIENT_")]
            needs.update({env: ENV_VALUES[env][0] for env in client})
    elif option.env == "MCP_BRIDGE_PUBLIC_URL":
        needs = {"MCP_BRIDGE_TRANSPORT": "http"}
    config = load_config([], {**needs, option.env: raw})

    assert getattr(config, option.field) == expected
    assert getattr(config, option.field) != getattr(BridgeConfig(), option.field)


def test_all_environment_variables_together_are_parsed() -> None:
    environ = {env: raw for env, (raw, _) in ENV_VALUES.items()}

    config = load_config([], environ)

    for option in OPTIONS:
        assert getattr(config, option.field) == ENV_VALUES[option.env][1], option.env


def test_empty_environment_variable_means_unset() -> None:
    assert load_config([], {"MCP_BRIDGE_TIMEOUT": "", "MCP_BRIDGE_RUNTIME": ""}) == BridgeConfig()


def test_environment_variables_unrelated_to_options_are_ignored() -> None:
    assert load_config([], {"MCP_BRIDGE_UNKNOWN": "x", "TIMEOUT": "abc"}) == BridgeConfig()


OPTIONS_BY_FIELD = {option.field: option for option in OPTIONS}


@pytest.mark.parametrize(
    ("field", "flag_value", "env_value", "expected"),
    [
        ("timeout", "5", "10", 5.0),
        ("runtime", "podman", "docker", "podman"),
        ("output_mode", "compact", "toon", "compact"),
        ("max_output_chars", "77", "88", 77),
        ("prewarm", "true", "false", True),
    ],
)
def test_flag_wins_over_environment_variable(
    field: str, flag_value: str, env_value: str, expected: object
) -> None:
    option = OPTIONS_BY_FIELD[field]

    config = load_config([option.flag, flag_value], {option.env: env_value})

    assert getattr(config, field) == expected


def test_flag_is_checked_even_when_environment_variable_is_valid() -> None:
    with pytest.raises(ConfigError, match="--timeout"):
        load_config(["--timeout", "soon"], {"MCP_BRIDGE_TIMEOUT": "10"})


def test_each_flag_is_its_variable_without_the_prefix() -> None:
    flags = {option.env: option.flag for option in OPTIONS}

    assert flags["MCP_BRIDGE_MAX_OUTPUT"] == "--max-output"
    assert flags["MCP_BRIDGE_CONTAINER_USER"] == "--container-user"
    assert flags["MCP_SERVERS_CONFIG"] == "--servers-config"
    assert all(flag.startswith("--") and "_" not in flag for flag in flags.values())
    assert load_config(["--max-output", "77"], {}).max_output_chars == 77


def test_help_and_readme_show_the_same_defaults() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = {
        cells[0].strip("` "): cells[1].strip().strip("`")
        for line in readme.splitlines()
        if line.startswith("| `MCP_") and len(cells := line.strip("|").split("|")) >= 3
    }
    shown = build_arg_parser().format_help()
    for option in OPTIONS:
        default = option.shown_default(BridgeConfig())
        assert rows.get(option.env) == default, option.env
        assert "default: %s]" % default in " ".join(shown.split()), option.env


@pytest.mark.parametrize(
    ("env", "raw"),
    [
        ("MCP_BRIDGE_TIMEOUT", "abc"),
        ("MCP_BRIDGE_TIMEOUT", "-1"),
        ("MCP_BRIDGE_TIMEOUT", "0"),
        ("MCP_BRIDGE_TIMEOUT", "nan"),
        ("MCP_BRIDGE_MAX_TIMEOUT", "inf"),
        ("MCP_BRIDGE_MEMORY", "lots"),
        ("MCP_BRIDGE_MEMORY", "0m"),
        ("MCP_BRIDGE_OUTPUT_MODE", "xml"),
        ("MCP_BRIDGE_PREWARM", "maybe"),
        ("MCP_BRIDGE_MAX_SESSIONS", "0"),
        ("MCP_BRIDGE_RUNTIME", "lxc"),
        ("MCP_BRIDGE_PIDS", "1.5"),
        ("MCP_BRIDGE_PIDS", "0"),
        ("MCP_BRIDGE_CPUS", "many"),
        ("MCP_BRIDGE_IDLE_TIMEOUT", "-5"),
        ("MCP_BRIDGE_IMAGE", "python 3; rm -rf /"),
        ("MCP_BRIDGE_CONTAINER_USER", "root; id"),
        ("MCP_BRIDGE_MAX_OUTPUT", "-10"),
        ("MCP_BRIDGE_MAX_FRAME_BYTES", "big"),
        ("MCP_BRIDGE_START_TIMEOUT", "never"),
        ("MCP_BRIDGE_LOG_LEVEL", "TRACE"),
        ("MCP_SERVERS_CONFIG", "/no/such/config.json"),
        ("MCP_BRIDGE_SERVER_START_TIMEOUT", "0"),
        ("MCP_BRIDGE_MAX_TOOL_RESULT_BYTES", "lots"),
        ("MCP_BRIDGE_OCI_RUNTIME", "runsc --debug"),
        ("MCP_BRIDGE_MAX_MEMORY_BYTES", "0"),
        ("MCP_BRIDGE_ALLOW_ROOT", "maybe"),
        ("MCP_BRIDGE_DISCOVER", "sometimes"),
        ("MCP_BRIDGE_PROJECT_SERVERS", "yes"),
        ("MCP_BRIDGE_DENY_TOOLS", "write_*"),
        ("MCP_BRIDGE_ALLOW_TOOLS", "time.*, get_time"),
        ("MCP_BRIDGE_PASS_ENV", "GITHUB_TOKEN=abc"),
        ("MCP_BRIDGE_PASS_ENV", "*"),
        ("MCP_BRIDGE_WORKSPACE", "/no/such/folder"),
        ("MCP_BRIDGE_WORKSPACE", __file__),
        ("MCP_BRIDGE_WORKSPACE", "/"),
        ("MCP_BRIDGE_WORKSPACE", "relative/folder"),
        ("MCP_BRIDGE_TRANSPORT", "sse"),
        ("MCP_BRIDGE_HOST", "example.com; rm"),
        ("MCP_BRIDGE_PORT", "0"),
        ("MCP_BRIDGE_PORT", "70000"),
        ("MCP_BRIDGE_PORT", "http"),
        ("MCP_BRIDGE_AUTH_TOKENS", "/no/such/tokens"),
        ("MCP_BRIDGE_MAX_CALLS_PER_PRINCIPAL", "0"),
        ("MCP_BRIDGE_MAX_TOTAL_SESSIONS", "none"),
        ("MCP_BRIDGE_MAX_MCP_SESSIONS_PER_PRINCIPAL", "0"),
        ("MCP_BRIDGE_MCP_SESSION_IDLE_TIMEOUT", "0"),
        ("MCP_BRIDGE_HTTP_REQUEST_TIMEOUT", "inf"),
        ("MCP_BRIDGE_HTTP_MAX_CONNECTIONS", "-1"),
    ],
)
def test_invalid_environment_value_raises_config_error_naming_the_variable(env: str, raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config([], {env: raw})

    message = str(caught.value)
    assert env in message
    assert repr(raw) in message
    assert "\n" not in message


def test_invalid_choice_message_lists_the_accepted_values() -> None:
    with pytest.raises(ConfigError, match="must be one of compact, toon"):
        load_config([], {"MCP_BRIDGE_OUTPUT_MODE": "xml"})
    with pytest.raises(ConfigError, match="must be one of podman, docker"):
        load_config([], {"MCP_BRIDGE_RUNTIME": "lxc"})


def test_invalid_flag_value_raises_config_error_naming_the_flag() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(["--memory", "lots"], {})

    assert "--memory" in str(caught.value)
    assert "MCP_BRIDGE_MEMORY" not in str(caught.value)


def test_empty_flag_value_is_rejected_not_ignored() -> None:
    with pytest.raises(ConfigError, match="--timeout"):
        load_config(["--timeout", ""], {})


def test_timeout_above_max_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config([], {"MCP_BRIDGE_TIMEOUT": "200", "MCP_BRIDGE_MAX_TIMEOUT": "100"})

    assert "MCP_BRIDGE_TIMEOUT" in str(caught.value)
    assert "MCP_BRIDGE_MAX_TIMEOUT" in str(caught.value)


def test_timeout_above_default_max_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="must not exceed"):
        load_config(["--timeout", "3601"], {})


def test_timeout_equal_to_max_timeout_is_accepted() -> None:
    config = load_config(["--timeout", "60", "--max-timeout", "60"], {})

    assert config.timeout == config.max_timeout == 60.0


def test_bridge_config_is_frozen() -> None:
    config = BridgeConfig()

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0  # type: ignore[misc]


def test_help_lists_every_environment_variable_and_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal width

    with pytest.raises(SystemExit) as exited:
        bridge.main(["--help"])

    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in OPTIONS:
        assert option.env in text
        assert option.flag in text


def test_help_lists_each_other_command_on_a_line_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    lines = build_arg_parser().format_help().splitlines()
    for command in (
        bridge.MEMORY_COMMAND,
        bridge.ADOPT_COMMAND,
        bridge.DOCTOR_COMMAND,
        bridge.BUILD_IMAGE_COMMAND,
    ):
        assert [line for line in lines if line.startswith("  %s " % command)], (command, lines[-5:])
    # The line that introduces them names the program to type them after.
    assert "Other commands (%s COMMAND ...; each has --help):" % bridge.SERVER_NAME in lines


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bridge.main(["--version"])

    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == "%s %s" % (bridge.SERVER_NAME, bridge.__version__)


@pytest.fixture
def terminal_stdin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real terminal (a pseudo-terminal) on sys.stdin: a person at a shell, not an MCP client."""
    leader, follower = os.openpty()
    with os.fdopen(follower, "r") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        yield
    os.close(leader)


@pytest.mark.usefixtures("terminal_stdin")
def test_main_with_bad_environment_returns_2_and_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(os.environ, "MCP_BRIDGE_TIMEOUT", "abc")

    status = bridge.main([])

    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert "MCP_BRIDGE_TIMEOUT" in lines[0]
    assert lines[0].startswith(bridge.SERVER_NAME + ": ")
    assert "Traceback" not in captured.err


@pytest.mark.usefixtures("terminal_stdin")
def test_main_with_bad_flag_value_returns_2_and_names_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MCP_BRIDGE_OUTPUT_MODE", raising=False)

    status = bridge.main(["--output-mode", "xml"])

    assert status == 2
    err = capsys.readouterr().err
    assert "--output-mode" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        ("MCP_BRIDGE_TIMEOUT", "abc", "must be a positive number such as 30 or 0.5"),
        ("MCP_BRIDGE_IDLE_TIMEOUT", "soon", "must be zero or a positive number such as 30"),
        ("MCP_BRIDGE_PIDS", "many", "must be a positive whole number such as 128"),
        ("MCP_BRIDGE_PORT", "http", "must be a port number, 1-65535"),
        ("MCP_BRIDGE_CPUS", "inf", "must be a positive number such as 30 or 0.5"),
        ("MCP_BRIDGE_PIDS", "-" + "9" * 400, "must be a positive whole number such as 128"),  # no float
    ],
)
def test_a_number_that_does_not_parse_says_what_is_expected(variable: str, raw: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config([], {variable: raw})
    assert str(raised.value) == "%s=%r is invalid: %s" % (variable, raw, expected)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--memroy", "1g"], "unrecognized arguments: --memroy 1g"),
        (["--memory"], "argument --memory: expected one argument"),
    ],
)
def test_a_command_line_argparse_cannot_read_is_a_config_error(argv: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(argv, {})
    assert str(raised.value) == "the command line is invalid: %s; `%s --help` lists the flags" % (
        said,
        bridge.SERVER_NAME,
    )


@pytest.mark.parametrize(
    ("argv", "environ", "transport"),
    [
        ([], {}, "stdio"),
        (["--transport", "http"], {}, "http"),
        (["--memory=x", "--transport=http"], {}, "http"),
        ([], {"MCP_BRIDGE_TRANSPORT": "http"}, "http"),
        (["--transport", "stdio"], {"MCP_BRIDGE_TRANSPORT": "http"}, "stdio"),  # the flag wins
        ([], {"MCP_BRIDGE_TRANSPORT": "htp"}, "htp"),
        (["--trans", "http", "--memroy", "1g"], {}, "http"),  # argparse's abbreviation; an unknown flag
        (["--transport", "http", "--memory"], {}, "http"),  # a flag without its value
    ],
)
def test_requested_transport_is_read_without_the_other_settings(
    argv: list[str], environ: dict[str, str], transport: str
) -> None:
    assert bridge.requested_transport(argv, environ) == transport


def test_only_stdio_to_a_program_is_answered_by_the_misconfigured_server(tmp_path: Path) -> None:
    leader, follower = os.openpty()
    pipe_read, pipe_write = os.pipe()
    with os.fdopen(follower) as terminal, os.fdopen(pipe_read) as pipe:
        assert bridge.started_by_stdio_client([], {}, pipe)
        assert not bridge.started_by_stdio_client([], {}, terminal)  # a person reads the line
        assert not bridge.started_by_stdio_client(["--transport", "http"], {}, pipe)
        assert not bridge.started_by_stdio_client([], {"MCP_BRIDGE_TRANSPORT": "htp"}, pipe)
        assert not bridge.started_by_stdio_client([], {}, None)
    os.close(leader)
    os.close(pipe_write)


def test_tool_result_cap_must_fit_in_a_frame() -> None:
    with pytest.raises(ConfigError, match="MCP_BRIDGE_MAX_TOOL_RESULT_BYTES"):
        load_config(
            [], {"MCP_BRIDGE_MAX_FRAME_BYTES": "1000000", "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES": "600000"}
        )


def test_readme_documents_every_option() -> None:
    # Docs are part of the product: a new setting must reach README's table.
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [option.env for option in OPTIONS if "`%s`" % option.env not in readme]
    assert missing == []


# --- settings that would silently weaken or disable things --------------------------------


@pytest.mark.parametrize(
    ("user", "refused"),
    [
        ("0", "user '0'"),
        ("root", "user 'root'"),
        ("0:0", "user '0' and group '0'"),
        ("root:root", "user 'root' and group 'root'"),
        ("0:65534", "user '0'"),
        ("00", "user '00'"),
        ("000:0", "user '000' and group '0'"),
        ("65534:0", "group '0'"),
        ("65534:root", "group 'root'"),
        ("nobody:00", "group '00'"),
    ],
)
def test_a_root_sandbox_user_or_group_is_refused_unless_allowed(user: str, refused: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config([], {"MCP_BRIDGE_CONTAINER_USER": user})
    message = str(caught.value)
    assert "MCP_BRIDGE_CONTAINER_USER=%s " % user in message and "(%s is root)" % refused in message
    assert "MCP_BRIDGE_ALLOW_ROOT=1" in message
    assert (
        load_config([], {"MCP_BRIDGE_CONTAINER_USER": user, "MCP_BRIDGE_ALLOW_ROOT": "1"}).container_user
        == user
    )


@pytest.mark.parametrize("user", ["65534:65534", "nobody", "1000:100", "rooted", "10:01"])
def test_an_unprivileged_sandbox_user_is_accepted(user: str) -> None:
    assert load_config([], {"MCP_BRIDGE_CONTAINER_USER": user}).container_user == user


def test_a_policy_pattern_that_matches_no_configured_server_is_reported() -> None:
    config = load_config(
        [],
        {
            "MCP_BRIDGE_DENY_SERVERS": "githb,time",
            "MCP_BRIDGE_DENY_TOOLS": "filesytem.write_*,time.convert_*",
            "MCP_BRIDGE_ALLOW_SERVERS": "*",
        },
    )
    servers = [
        bridge.ServerSpec("time", "time", "stdio", command="t"),
        bridge.ServerSpec("filesystem", "filesystem", "stdio", command="f"),
    ]

    assert bridge.policy_problems(config, servers) == [
        "MCP_BRIDGE_DENY_SERVERS: 'githb' matches no configured server",
        "MCP_BRIDGE_DENY_TOOLS: 'filesytem.write_*' matches no configured server",
    ]


def test_a_tool_pattern_that_matches_no_tool_is_reported_once_its_servers_listed_tools() -> None:
    config = load_config([], {"MCP_BRIDGE_DENY_TOOLS": "time.convrt_*,time.convert_*,*.delete_*"})
    servers = ["time", "files"]

    assert bridge.tool_pattern_problems(config, {"time": ["get_current_time", "convert_time"]}, servers) == [
        "MCP_BRIDGE_DENY_TOOLS: 'time.convrt_*' matches no tool of time"  # *.delete_*: files not listed yet
    ]
    listed = {"time": ["convert_time"], "files": ["read", "delete_file"]}
    assert bridge.tool_pattern_problems(config, listed, servers) == [
        "MCP_BRIDGE_DENY_TOOLS: 'time.convrt_*' matches no tool of time"
    ]
    listed["files"] = ["read"]
    assert bridge.tool_pattern_problems(config, listed, servers)[1:] == [
        "MCP_BRIDGE_DENY_TOOLS: '*.delete_*' matches no tool of time, files"
    ]


# --- MCP_BRIDGE_WORKSPACE: the one writable host folder -------------------------------------


def test_a_workspace_folder_is_parsed_absolute_and_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    (tmp_path / "home").mkdir()
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MY_WORK", str(tmp_path))

    assert load_config([], {"MCP_BRIDGE_WORKSPACE": str(folder)}).workspace == bridge.Workspace(folder)
    assert load_config(["--workspace", str(folder) + ":ro"], {}).workspace == bridge.Workspace(folder, True)
    assert load_config([], {"MCP_BRIDGE_WORKSPACE": "$MY_WORK/link"}).workspace == bridge.Workspace(folder)
    assert load_config([], {"MCP_BRIDGE_WORKSPACE": "~/../work"}).workspace == bridge.Workspace(folder)
    assert load_config([], {}).workspace is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{tmp}/missing", "no such folder: {tmp}/missing"),
        ("{tmp}/file", "{tmp}/file is not a folder"),
        ("{tmp}/file:ro", "{tmp}/file is not a folder"),
        ("work", "must be an absolute path"),
        ("/", "/ is the whole file system; choose (or create) a folder just for the sandbox"),
        ("{tmp}/home", "{tmp}/home is your home folder"),
        ("{tmp}/home/", "{tmp}/home is your home folder"),
        ("{tmp}/link-to-home", "{tmp}/home is your home folder"),
        ("{tmp}", "{tmp} contains your home folder"),
        ("/proc/self", "is a system folder (/proc, /sys, /dev, /run)"),
        ("/sys:ro", "/sys is a system folder"),
        ("/dev", "/dev is a system folder"),
        ("/run", "/run is a system folder"),
        ("{tmp}/a,b", "has a comma"),
    ],
)
def test_a_dangerous_or_missing_workspace_folder_is_refused(
    raw: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "a,b").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link-to-home").symlink_to(tmp_path / "home")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw, says = raw.format(tmp=tmp_path), says.format(tmp=tmp_path)

    with pytest.raises(ConfigError) as caught:
        load_config([], {"MCP_BRIDGE_WORKSPACE": raw})

    message = str(caught.value)
    assert message.startswith("MCP_BRIDGE_WORKSPACE=%r is invalid: " % raw) and says in message, message
    assert "\n" not in message


def test_a_workspace_that_holds_the_state_directory_is_refused(tmp_path: Path) -> None:
    environ = {"MCP_BRIDGE_WORKSPACE": str(tmp_path), "MCP_BRIDGE_STATE_DIR": str(tmp_path / "MCPs")}
    with pytest.raises(ConfigError, match=r"contains the bridge's state directory .*MCPs"):
        load_config([], environ)
    with pytest.raises(ConfigError, match="contains the bridge's state directory"):
        load_config([], {**environ, "MCP_BRIDGE_STATE_DIR": str(tmp_path)})
    inside = {**environ, "MCP_BRIDGE_WORKSPACE": str(tmp_path / "MCPs" / "work")}
    (tmp_path / "MCPs" / "work").mkdir(parents=True)
    assert load_config([], inside).workspace == bridge.Workspace(tmp_path / "MCPs" / "work")


# --- a bad setting over stdio: the MCP client hears of it --------------------------------
# An MCP client shows the user neither the server's stderr nor its exit status, only
# "Connection closed". Started by one (stdin a pipe), the bridge answers instead.


@asynccontextmanager
async def stdio_session(env: dict[str, str], args: Sequence[str] = ()) -> AsyncIterator[ClientSession]:
    """bridge_client with command-line arguments too; the bridge introduces itself as usual."""
    params = StdioServerParameters(command=console_script(), args=list(args), env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        initialized = await session.initialize()
        assert (initialized.server_info.name, initialized.server_info.version) == (
            bridge.SERVER_NAME,
            bridge.__version__,
        )
        yield session


BAD_SETTINGS = [
    pytest.param(
        {"MCP_BRIDGE_MEMORY": "lots"},
        [],
        "MCP_BRIDGE_MEMORY='lots' is invalid: must be a size such as 512m",
        id="memory",
    ),
    pytest.param(
        {"MCP_BRIDGE_RUNTIME": "dockr"},
        [],
        "MCP_BRIDGE_RUNTIME='dockr' is invalid: must be one of podman, docker, kubernetes",
        id="runtime",
    ),
    pytest.param(
        {"MCP_BRIDGE_TIMEOUT": "ten"},
        [],
        "MCP_BRIDGE_TIMEOUT='ten' is invalid: must be a positive number such as 30 or 0.5",
        id="timeout",
    ),
    pytest.param(
        {},
        ["--memroy", "1g"],
        "the command line is invalid: unrecognized arguments: --memroy 1g; "
        "`mcp-server-code-execution-mode --help` lists the flags",
        id="unknown-flag",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("settings", "args", "problem"), BAD_SETTINGS)
async def test_a_bad_setting_is_told_by_every_run_python_call_over_stdio(
    state_dir: Path, settings: dict[str, str], args: list[str], problem: str
) -> None:
    async with stdio_session(bridge_env(None, state_dir, **settings), args) as client:
        listed = (await client.list_tools()).tools
        assert [tool.name for tool in listed] == ["run_python"]
        assert listed[0].input_schema == bridge.run_python_tool(BridgeConfig()).input_schema
        for _ in range(2):  # every call, not just the first
            result = await client.call_tool("run_python", {"code": "print('hi')"})
            assert result.is_error
            assert text_of(result) == bridge.misconfigured_message(problem)
        (manual,) = (await client.read_resource(bridge.CAPABILITIES_URI)).contents
        assert isinstance(manual, types.TextResourceContents)
        assert manual.text.startswith("**%s**" % bridge.misconfigured_message(problem))
    assert not list(state_dir.iterdir())  # nothing was started or written


def test_misconfigured_message_names_the_setting_the_value_what_is_expected_and_the_fix() -> None:
    message = bridge.misconfigured_message("MCP_BRIDGE_MEMORY='lots' is invalid: must be a size such as 512m")
    assert message == (
        "run_python is unavailable: mcp-server-code-execution-mode could not start its sandbox because of "
        "its settings, so no code was run. The problem: MCP_BRIDGE_MEMORY='lots' is invalid: must be a size "
        'such as 512m. The user must fix it where the MCP client starts this server (the "env" or "args" of '
        "its entry in the client's MCP configuration: change the value, or remove it to use the default), "
        "then restart the server or the client. Tell the user this message."
    )


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        (["--transport", "http"], {"MCP_BRIDGE_MEMORY": "lots"}),  # a network service fails loudly
        ([bridge.DOCTOR_COMMAND], {"MCP_BRIDGE_MEMORY": "lots"}),
        ([bridge.MEMORY_COMMAND, "list"], {"MCP_BRIDGE_RUNTIME": "dockr"}),
        ([bridge.TOOLS_COMMAND, "list"], {"MCP_BRIDGE_RUNTIME": "dockr"}),
    ],
)
def test_http_and_the_subcommands_still_exit_2_with_one_line(
    state_dir: Path, argv: list[str], settings: dict[str, str]
) -> None:
    # stdin is a pipe, as an MCP client's would be: only stdio serving answers over it.
    finished = subprocess.run(
        [console_script(), *argv],
        env=bridge_env(None, state_dir, **settings),
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert finished.returncode == 2, finished
    assert finished.stdout == ""
    (line,) = finished.stderr.splitlines()
    assert line.startswith(bridge.SERVER_NAME) and "is invalid" in line
