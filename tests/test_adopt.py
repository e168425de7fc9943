"""`mcp-server-code-execution-mode adopt`: the installed console script, run as a user
would, on real client config files in a temporary HOME; a real bridge (real MCP client,
real container, real servers) proves the adopted servers are found. Also: every client
snippet in README.md, read by the discovery section's own parser."""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import mcp_server_code_execution_mode as bridge
from tests.conftest import (
    REPO,
    Engine,
    bridge_client,
    claude_desktop_home,
    console_script,
    proxy_env,
    real_server,
    run_cell,
    stub_entry,
)

PREFIX = "mcp-server-code-execution-mode adopt: "
BRIDGE_ENTRY = {"command": console_script(), "args": []}


def adopt(
    home: Path, *args: str, argv: Sequence[str] = (), **settings: str
) -> subprocess.CompletedProcess[str]:
    """The console script's adopt subcommand (or `argv`'s) with HOME=`home`, `settings`,
    and nothing else that could point it at another config (no other MCP_BRIDGE_*,
    XDG_CONFIG_HOME or CODEX_HOME)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MCP_") and key not in ("XDG_CONFIG_HOME", "CODEX_HOME", "APPDATA")
    }
    env.update(settings, HOME=str(home))
    return subprocess.run(
        [*(argv or [console_script()]), "adopt", *args],
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
        check=False,
    )


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path, with its bytes."""
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


def refused(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The one stderr line of a refusal: no traceback, nothing on stdout."""
    assert result.returncode == status, result
    assert result.stdout == "" and "Traceback" not in result.stderr, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), lines
    assert lines[0].endswith("Nothing was changed."), lines
    return lines[0].removeprefix(PREFIX)


def write_json(path: Path, document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path


def claude_desktop_config(home: Path) -> Path:
    return home / ".config" / "Claude" / "claude_desktop_config.json"


def unified(path: Path, before: bytes | None, after: bytes) -> str:
    old = before.decode().splitlines(keepends=True) if before is not None else []
    return "".join(
        difflib.unified_diff(
            old,
            after.decode().splitlines(keepends=True),
            "/dev/null" if before is None else str(path),
            str(path),
        )
    )


# --- the acceptance test: dry run, adopt, a real bridge, undo --------------------------


@pytest.mark.anyio
async def test_adopt_moves_three_servers_that_a_real_bridge_then_finds_and_undo_restores_the_bytes(
    proxy_engine: Engine, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    three = {
        "everything": {"command": real_server("everything")},
        "time": {"command": real_server("time")},
        "stub": stub_entry(),
    }
    config = write_json(claude_desktop_config(home), {"mcpServers": three, "globalShortcut": "Alt+Space"})
    servers_file = home / "MCPs" / "servers.json"
    original, before = config.read_bytes(), snapshot(tmp_path)

    dry = adopt(home, "--client", "claude-desktop", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert snapshot(tmp_path) == before  # not one byte changed, nothing created
    assert "dry run: nothing was changed" in dry.stderr

    done = adopt(home, "--client", "claude-desktop")
    assert done.returncode == 0, done.stderr
    assert json.loads(config.read_text()) == {
        "mcpServers": {"code-execution": BRIDGE_ENTRY},
        "globalShortcut": "Alt+Space",
    }
    assert json.loads(servers_file.read_text()) == {"mcpServers": three}
    # The dry run showed exactly the change adopt then made, file by file.
    assert dry.stdout == unified(config, original, config.read_bytes()) + unified(
        servers_file, None, servers_file.read_bytes()
    )
    (backup,) = (home / "MCPs" / "backups").iterdir()
    assert (backup / "1-claude_desktop_config.json").read_bytes() == original
    assert str(backup) in done.stderr

    env = proxy_env(proxy_engine, home / "MCPs", home)
    del env["MCP_BRIDGE_STATE_DIR"]  # the bridge's default, ~/MCPs, as adopt's
    async with bridge_client(env) as client:
        found = await run_cell(
            client,
            """
            from mcp import runtime
            detailed = runtime.discovered_servers(detailed=True)
            now = mcp_time.get_current_time(timezone="UTC")
            sources = sorted({s["source"] for s in detailed["servers"]})
            (runtime.discovered_servers(), sources, now["timezone"])
            """,
        )
    assert not found["is_error"], found["text"]
    assert found["value"] == repr((["everything", "stub", "time"], [str(servers_file)], "UTC"))

    undone = adopt(home, "--undo")
    assert undone.returncode == 0, undone.stderr
    assert config.read_bytes() == original
    assert not servers_file.exists()
    assert [path.name for path in (home / "MCPs" / "backups").iterdir()] == [backup.name + ".undone"]
    nothing_left = adopt(home, "--undo")
    assert "there is no adopt to undo" in nothing_left.stderr and nothing_left.returncode == 1


# --- refusals: a message, and no file changed ------------------------------------------


@pytest.mark.parametrize(
    ("client", "relative", "text", "expected"),
    [
        (
            "claude-desktop",
            ".config/Claude/claude_desktop_config.json",
            '{"mcpServers": {"a": {"command": "x"}',
            "JSON",
        ),
        ("codex", ".codex/config.toml", '[mcp_servers.a\ncommand = "x"\n', "TOML"),
    ],
)
def test_adopt_refuses_a_malformed_config(
    tmp_path: Path, client: str, relative: str, text: str, expected: str
) -> None:
    home = tmp_path / "home"
    path = home / relative
    path.parent.mkdir(parents=True)
    path.write_text(text)
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", client))
    assert message.startswith("%s cannot be read as %s (" % (path, expected)), message
    assert "fix it, or move its servers by hand" in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("servers", "said"),
    [
        (
            {"mine": {"command": "uvx", "args": ["mcp-server-code-execution-mode"]}},
            "lists only mine (this bridge)",
        ),
        ({}, "lists no MCP servers"),
        (None, "Claude Desktop has no config file (looked for"),
    ],
)
def test_adopt_refuses_when_there_is_nothing_to_move(
    tmp_path: Path, servers: dict[str, Any] | None, said: str
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    if servers is not None:
        write_json(claude_desktop_config(home), {"mcpServers": servers})
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", "claude-desktop"))
    assert message.startswith("nothing to move") and said in message, message
    assert snapshot(tmp_path) == before


def test_adopt_refuses_a_server_name_that_servers_json_defines_differently(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = write_json(
        claude_desktop_config(home),
        {"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time"]}, "other": {"command": "o"}}},
    )
    servers_file = write_json(
        home / "MCPs" / "servers.json",
        {"mcpServers": {"time": {"command": "uvx", "args": ["mcp-server-time@2"]}}},
    )
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", "claude-desktop"))
    assert message.startswith("time of %s is also in %s, defined differently." % (config, servers_file)), (
        message
    )
    assert snapshot(tmp_path) == before


def test_adopt_refuses_an_unknown_client(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_json(claude_desktop_config(home), {"mcpServers": {"a": {"command": "x"}}})
    before = snapshot(tmp_path)
    result = adopt(home, "--client", "claude")
    assert result.returncode == 2 and result.stdout == "", result
    clients = "claude-desktop, claude-code, cursor, vscode, windsurf, gemini, codex"
    assert result.stderr == PREFIX + "unknown client 'claude'; use one of: %s.\n" % clients
    assert snapshot(tmp_path) == before


# --- each client's format ---------------------------------------------------------------


def test_codex_toml_keeps_its_other_settings_and_undo_restores_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    original = (
        b'model = "o3"  # a comment\n\n'
        b'[mcp_servers.time]\ncommand = "uvx"\nargs = ["mcp-server-time"]\n\n'
        b'[mcp_servers.time.env]\nTZ = "UTC"\n\n'
        b'[mcp_servers."remote one"]\nurl = "https://example.com/mcp"\nenabled = false\n'
        b'http_headers = { "X-Key" = "k" }\n\n'
        b'[profiles.fast]\nmodel = "o4-mini"\n'
    )
    config.write_bytes(original)
    assert adopt(home, "--client", "codex").returncode == 0
    document = tomllib.loads(config.read_text())
    assert document == {
        "model": "o3",
        "profiles": {"fast": {"model": "o4-mini"}},
        "mcp_servers": {"code-execution": BRIDGE_ENTRY},
    }
    assert config.read_text().startswith('model = "o3"  # a comment\n')  # the rest of the text is kept
    moved = json.loads((home / "MCPs" / "servers.json").read_text())["mcpServers"]
    assert moved == {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
        "remote one": {"url": "https://example.com/mcp", "enabled": False, "http_headers": {"X-Key": "k"}},
    }
    assert adopt(home, "--undo").returncode == 0
    assert config.read_bytes() == original


def test_codex_servers_written_as_inline_tables_are_refused_not_mangled(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[mcp_servers]\ntime = { command = "uvx", args = ["mcp-server-time"] }\n')
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", "codex"))
    assert message.startswith(
        "cannot rewrite %s safely (its servers are not written as [mcp_servers.NAME] tables)" % config
    )
    assert snapshot(tmp_path) == before


def test_vscode_comments_survive_and_servers_only_vscode_can_fill_in_stay(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = home / ".config" / "Code" / "User" / "mcp.json"
    config.parent.mkdir(parents=True)
    config.write_text(
        '{\n\t// my servers\n\t"inputs": [{"id": "tok", "type": "promptString"}],\n\t"servers": {\n'
        '\t\t"gh": {"type": "http", "url": "https://api.example.com/mcp/", '
        '"headers": {"Authorization": "Bearer ${input:tok}"}},\n'
        '\t\t"fs": {"type": "stdio", "command": "npx", "args": ["-y", "server-filesystem", "/tmp"],},\n'
        "\t},\n}\n"
    )
    result = adopt(home, "--client", "vscode")
    assert result.returncode == 0, result.stderr
    assert "VS Code: keeps gh (" in result.stderr
    text = config.read_text()
    assert text.startswith('{\n\t// my servers\n\t"inputs": [{"id": "tok", "type": "promptString"}],\n')
    servers = bridge.parse_document(text, "json")["servers"]
    assert list(servers) == ["gh", "code-execution"]
    assert servers["code-execution"] == {"type": "stdio", **BRIDGE_ENTRY}
    assert json.loads((home / "MCPs" / "servers.json").read_text())["mcpServers"] == {
        "fs": {"type": "stdio", "command": "npx", "args": ["-y", "server-filesystem", "/tmp"]}
    }


def test_what_stays_with_the_client_is_what_discovery_cannot_resolve(tmp_path: Path) -> None:
    # ${workspaceFolder} resolves in discovery (the bridge's working directory): it moves.
    # ${input:...} and ${command:...} do not: they stay, disabled or not.
    home = tmp_path / "home"
    servers: dict[str, dict[str, Any]] = {
        "files": {"command": "npx", "args": ["server-filesystem", "${workspaceFolder}/data"]},
        "gh": {"command": "gh-mcp", "env": {"T": "${input:tok}"}, "disabled": True},
        "picked": {"command": "x", "args": ["${command:pickFile}"], "disabled": True},
    }
    write_json(home / ".config" / "Code" / "User" / "mcp.json", {"servers": servers})
    result = adopt(home, "--client", "vscode")
    assert result.returncode == 0, result.stderr
    assert "keeps gh (it uses ${input:tok}, which only the client fills in)" in result.stderr
    assert "keeps picked (it uses ${command:pickFile}, which only the client fills in)" in result.stderr
    assert json.loads((home / "MCPs" / "servers.json").read_text())["mcpServers"] == {
        "files": servers["files"]
    }
    # Enabled, discovery skips them for that same reason.
    enabled = {name: {**servers[name], "disabled": False} for name in ("gh", "picked")}
    config = write_json(tmp_path / "enabled.json", {"mcpServers": enabled})
    found = bridge.discover_servers(home, home, "linux", {}, tmp_path / "state", config)
    assert found.servers == () and len(found.problems) == 2, found
    assert all("cannot be resolved here" in problem for problem in found.problems), found.problems


def test_gemini_urls_mean_sse_there_and_stay_sse_in_servers_json(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_json(
        home / ".gemini" / "settings.json",
        {"theme": "dark", "mcpServers": {"events": {"url": "https://e.example/sse"}}},
    )
    assert adopt(home, "--client", "gemini").returncode == 0
    assert json.loads((home / "MCPs" / "servers.json").read_text())["mcpServers"] == {
        "events": {"url": "https://e.example/sse", "type": "sse"}
    }
    found = bridge.discover_servers(home, home, "linux", {}, home / "MCPs", None, clients=False)
    assert [(spec.name, spec.transport) for spec in found.servers] == [("events", "sse")]


def test_an_existing_bridge_entry_is_kept_as_it_is_and_identical_servers_are_not_repeated(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    mine = {
        "command": "/opt/bin/uvx",
        "args": ["mcp-server-code-execution-mode@latest"],
        "env": {"MCP_BRIDGE_MEMORY": "1g"},
    }
    time = {"command": "uvx", "args": ["mcp-server-time"]}
    config = write_json(
        home / ".cursor" / "mcp.json", {"mcpServers": {"time": time, "mine": mine, "b": {"command": "b"}}}
    )
    servers_file = write_json(home / "MCPs" / "servers.json", {"mcpServers": {"time": time}})
    os.chmod(config, 0o644)
    assert adopt(home, "--client", "cursor").returncode == 0
    assert json.loads(config.read_text()) == {"mcpServers": {"mine": mine}}
    assert json.loads(servers_file.read_text()) == {"mcpServers": {"time": time, "b": {"command": "b"}}}
    assert stat.S_IMODE(config.stat().st_mode) == 0o644  # the client's file keeps its mode
    assert [path.name for path in config.parent.iterdir()] == ["mcp.json"]  # no temporary file left


def test_a_bridge_entry_that_reads_another_file_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    mine = {"command": "mcp-server-code-execution-mode", "env": {"MCP_SERVERS_CONFIG": "/etc/mcp.json"}}
    write_json(home / ".cursor" / "mcp.json", {"mcpServers": {"mine": mine, "b": {"command": "b"}}})
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", "cursor"))
    assert "the entry mine of" in message and "it sets MCP_SERVERS_CONFIG=/etc/mcp.json" in message
    assert snapshot(tmp_path) == before


def test_a_symlinked_config_is_written_through_its_link(tmp_path: Path) -> None:
    home = tmp_path / "home"
    target = write_json(tmp_path / "dotfiles" / "claude.json", {"mcpServers": {"a": {"command": "a"}}})
    (home / ".claude.json").parent.mkdir(parents=True)
    (home / ".claude.json").symlink_to(target)
    assert adopt(home, "--client", "claude-code").returncode == 0
    assert (home / ".claude.json").is_symlink()
    assert json.loads(target.read_text()) == {"mcpServers": {"code-execution": BRIDGE_ENTRY}}


# --- unusable files, write errors, a client writing meanwhile ----------------------------


@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a FIFO"])
def test_adopt_refuses_a_config_that_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    home = tmp_path / "home"
    config = claude_desktop_config(home)
    config.parent.mkdir(parents=True)
    if kind == "a FIFO":
        os.mkfifo(config)
    else:
        config.symlink_to("/dev/zero")
    before = snapshot(tmp_path)
    # adopt()'s timeout is the hang detector: a plain read of either never ends.
    message = refused(adopt(home, "--client", "claude-desktop"))
    what = "a named pipe (FIFO)" if kind == "a FIFO" else "a character device"
    assert message == "cannot read %s: it is %s, not a regular file. Nothing was changed." % (config, what)
    assert snapshot(tmp_path) == before


def test_when_the_bridges_file_cannot_be_written_the_clients_file_is_left_as_it_was(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = write_json(claude_desktop_config(home), {"mcpServers": {"a": {"command": "a"}}})
    original = config.read_bytes()
    # Root may write anywhere chmod forbids; nobody can create a file under a regular file.
    (tmp_path / "a-file").write_text("")
    (home / "MCPs").mkdir()
    (home / "MCPs" / "servers.json").symlink_to(tmp_path / "a-file" / "servers.json")
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--client", "claude-desktop"))
    assert message.startswith("could not write %s (Not a directory)" % (home / "MCPs" / "servers.json"))
    assert config.read_bytes() == original  # before the fix: rewritten, its servers in neither file
    assert snapshot(tmp_path) == before  # no backup left for an adopt that did not happen
    assert not (home / "MCPs" / "backups").exists() or not any((home / "MCPs" / "backups").iterdir())


def test_a_client_writing_its_config_while_adopt_writes_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    config = write_json(claude_desktop_config(home), {"mcpServers": {"a": {"command": "a"}}})
    monkeypatch.setenv("HOME", str(home))
    real_write = bridge._write_atomically
    clients_write = b'{"mcpServers": {"a": {"command": "a"}, "added-by-the-client": {"command": "b"}}}\n'

    wrote: list[bool] = []

    def client_writes_first(path: Path, data: bytes | None, **kwargs: Any) -> None:
        if not wrote:  # once: as adopt writes its first file (a backup), after it read them all
            wrote.append(True)
            config.write_bytes(clients_write)
        real_write(path, data, **kwargs)

    monkeypatch.setattr(bridge, "_write_atomically", client_writes_first)
    status = bridge.main(["adopt", "--client", "claude-desktop"], {"HOME": str(home)})
    message = capsys.readouterr().err.strip()
    assert status == 1, message
    assert config.read_bytes() == clients_write  # before the fix: adopt's version replaced it
    assert message == (
        PREFIX + "%s changed while adopt was writing it (quit its client first, then run adopt again), so it "
        "was not overwritten. Nothing was changed." % config
    )
    assert not (home / "MCPs" / "servers.json").exists()  # written first, then put back
    assert not any((home / "MCPs" / "backups").iterdir())


def test_write_atomically_refuses_to_replace_a_file_changed_since_it_was_read(tmp_path: Path) -> None:
    path = write_json(tmp_path / "config.json", {"v": 1})
    data, status = bridge.read_config_bytes(path)
    read = bridge.FileChange(path, data, b"adopt's", bridge._stamp(status))

    path.write_bytes(data.replace(b"1", b"2"))  # same length, other bytes
    with pytest.raises(bridge.ConfigChangedError):
        bridge._write_atomically(path, read.after, expect=read)
    assert path.read_bytes() == data.replace(b"1", b"2")

    path.write_bytes(data)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))  # the same bytes, rewritten
    with pytest.raises(bridge.ConfigChangedError):
        bridge._write_atomically(path, read.after, expect=read)
    with pytest.raises(bridge.ConfigChangedError):
        bridge._write_atomically(path, None, expect=read)  # a removal is checked too
    assert path.read_bytes() == data and [p.name for p in tmp_path.iterdir()] == ["config.json"]

    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    bridge._write_atomically(path, read.after, expect=read)  # unchanged: replaced
    assert path.read_bytes() == b"adopt's"


# --- undo, listing, several clients ------------------------------------------------------


def test_undo_refuses_a_file_changed_since_unless_forced(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = write_json(home / ".claude.json", {"numStartups": 1, "mcpServers": {"a": {"command": "a"}}})
    original = config.read_bytes()
    assert adopt(home, "--client", "claude-code").returncode == 0
    write_json(config, {"numStartups": 2, "mcpServers": {"code-execution": BRIDGE_ENTRY}})  # Claude Code ran
    before = snapshot(tmp_path)
    message = refused(adopt(home, "--undo"))
    assert message.startswith(
        "%s changed since that adopt; restoring would lose those changes. --force" % config
    )
    assert snapshot(tmp_path) == before
    assert adopt(home, "--undo", "--force").returncode == 0
    assert config.read_bytes() == original


def test_without_a_client_it_lists_what_it_found_and_changes_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    write_json(claude_desktop_config(home), {"mcpServers": {"a": {"command": "a"}, "b": {"command": "b"}}})
    write_json(
        home / ".cursor" / "mcp.json", {"mcpServers": {"ce": {"command": "mcp-server-code-execution-mode"}}}
    )
    before = snapshot(tmp_path)
    result = adopt(home)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows == [
        ["CLIENT", "TO", "MOVE", "FILE"],
        ["claude-desktop", "a,", "b", str(claude_desktop_config(home))],
        ["cursor", "-", str(home / ".cursor" / "mcp.json")],
    ]
    assert "nothing was changed" in result.stderr
    assert snapshot(tmp_path) == before


def test_several_clients_are_adopted_and_undone_together(tmp_path: Path) -> None:
    home = tmp_path / "home"
    desktop = write_json(claude_desktop_config(home), {"mcpServers": {"a": {"command": "a"}}})
    cursor = write_json(home / ".cursor" / "mcp.json", {"mcpServers": {"b": {"command": "b"}}})
    before = snapshot(tmp_path)
    assert adopt(home, "--client", "claude-desktop,cursor").returncode == 0
    assert json.loads((home / "MCPs" / "servers.json").read_text())["mcpServers"] == {
        "a": {"command": "a"},
        "b": {"command": "b"},
    }
    for path in (desktop, cursor):
        assert json.loads(path.read_text()) == {"mcpServers": {"code-execution": BRIDGE_ENTRY}}
    assert "the latest adopt" in refused(adopt(home, "--undo", "--client", "cursor"))
    assert adopt(home, "--undo").returncode == 0
    after = snapshot(tmp_path)
    assert {name: data for name, data in after.items() if "MCPs" not in name} == before


# --- the command a client runs ------------------------------------------------------------


def test_bridge_command_is_the_absolute_script_or_uv_tool_run_from_uvx_cache(tmp_path: Path) -> None:
    script = console_script()
    assert bridge.bridge_command({}, script) == [script]
    # `python -m mcp_server_code_execution_mode adopt`: this interpreter and this module's file.
    assert bridge.bridge_command({}, bridge.__file__) == [
        sys.executable,
        str(Path(bridge.__file__).resolve()),
    ]
    fake_uv = tmp_path / "uv"

    def uv_cache_dir_is(directory: Path) -> None:  # a real executable that answers `uv cache dir`
        fake_uv.write_text("#!/bin/sh\necho %s\n" % shlex.quote(str(directory)))
        fake_uv.chmod(0o755)

    uv_cache_dir_is(Path(sys.prefix).parent)  # this environment lives in "uv's cache": uvx
    uv_run = [str(fake_uv), "tool", "run"]
    assert bridge.bridge_command({"UV": str(fake_uv)}, script) == [*uv_run, bridge.SERVER_NAME]
    # `uvx --from ~/src/checkout ...`: the same source again, or uv would look for it on PyPI.
    assert bridge.bridge_command({"UV": str(fake_uv)}, script, "/src/checkout") == [
        *uv_run,
        "--from",
        "/src/checkout",
        bridge.SERVER_NAME,
    ]
    uv_cache_dir_is(tmp_path / "elsewhere")  # `uv run` in a project: its own, lasting environment
    assert bridge.bridge_command({"UV": str(fake_uv)}, script, "/src/checkout") == [script]


@pytest.mark.parametrize(
    ("direct_url", "source"),
    [
        (None, None),  # installed from an index: the name finds it
        ('{"url": "file:///home/me/src/x%20y", "dir_info": {}}', "/home/me/src/x y"),
        ('{"url": "file:///home/me/src/x", "dir_info": {"editable": true}}', "/home/me/src/x"),
        ('{"url": "file:///C:/src/x", "dir_info": {}}', "C:/src/x"),
        ('{"url": "file:///tmp/x-0.1-py3-none-any.whl", "archive_info": {}}', "/tmp/x-0.1-py3-none-any.whl"),
        (
            '{"url": "https://example.org/x-0.1.tar.gz", "archive_info": {}}',
            "https://example.org/x-0.1.tar.gz",
        ),
        (
            '{"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", "commit_id": "abc123", '
            '"requested_revision": "main"}, "subdirectory": "pkg"}',
            "git+https://github.com/o/r@abc123#subdirectory=pkg",
        ),
        ("not json", None),
        ('{"dir_info": {}}', None),
    ],
)
def test_install_source_is_what_uvx_from_takes_to_install_it_again(
    direct_url: str | None, source: str | None
) -> None:
    assert bridge.install_source(direct_url) == source


# --- the entry adopt adds starts this program with this program's settings ------------------


def entry_params(entry: dict[str, Any], home: Path, **machine: str) -> StdioServerParameters:
    """How a client starts an entry: its command, args and env on top of the client's own
    environment (the SDK's default one, HOME the user's; `machine`: what the user's machine has)."""
    return StdioServerParameters(
        command=entry["command"],
        args=entry["args"],
        env={**entry.get("env", {}), "HOME": str(home), **machine},
    )


async def run_six_times_seven(params: StdioServerParameters) -> dict[str, Any]:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        return await run_cell(session, "from mcp import runtime\n(6 * 7, runtime.discovered_servers())")


@pytest.mark.anyio
async def test_the_entry_adopt_adds_carries_its_settings_and_runs_code(
    proxy_engine: Engine, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    settings = {
        "MCP_BRIDGE_IMAGE": proxy_engine.image,  # not the default image: the sandbox cannot start without it
        "MCP_BRIDGE_RUNTIME": proxy_engine.name,
        "MCP_BRIDGE_TIMEOUT": "30",  # the default: nothing to carry
    }
    done = adopt(
        home,
        "--client",
        "claude-desktop",
        "--env",
        "MCP_BRIDGE_PIDS=100",
        "--env",
        "LANG=C.UTF-8",
        **settings,
    )
    assert done.returncode == 0, done.stderr
    entry = json.loads(claude_desktop_config(home).read_text())["mcpServers"]["code-execution"]
    assert entry == {
        "command": console_script(),
        "args": [],
        "env": {
            "MCP_BRIDGE_IMAGE": proxy_engine.image,
            "MCP_BRIDGE_RUNTIME": proxy_engine.name,
            "MCP_BRIDGE_PIDS": "100",
            "LANG": "C.UTF-8",
        },
    }
    assert "MCP_BRIDGE_IMAGE=%s" % proxy_engine.image in done.stderr  # adopt says what the entry carries
    found = await run_six_times_seven(entry_params(entry, home))
    assert found["value"] == "(42, ['stub'])", found


@pytest.mark.parametrize(
    ("argument", "says"),
    [
        ("LANG", "write KEY=VALUE"),
        ("1X=y", "write KEY=VALUE"),
        ("MCP_SERVERS_CONFIG=/x.json", "would read only that file"),
        ("MCP_BRIDGE_TRANSPORT=http", "over stdio"),
    ],
)
def test_adopt_refuses_an_env_the_entry_cannot_carry(tmp_path: Path, argument: str, says: str) -> None:
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    before = snapshot(tmp_path)
    result = adopt(home, "--client", "claude-desktop", "--env", argument)
    assert result.returncode == 2 and says in result.stderr, result
    assert snapshot(tmp_path) == before


def uv_executable() -> str:
    found = shutil.which("uv", path=os.path.dirname(sys.executable))
    assert found, "uv is not installed in this environment: pip install -e .[dev]"
    return found


@pytest.mark.anyio
async def test_adopt_run_by_uvx_from_a_checkout_writes_an_entry_that_starts_the_same_checkout(
    proxy_engine: Engine, tmp_path: Path
) -> None:
    """The issue's case: `uvx --from CHECKOUT ... adopt` wrote `uv tool run NAME`, which
    looks for the package on PyPI, where it is not; and no MCP_BRIDGE_IMAGE."""
    home = claude_desktop_home(tmp_path, {"stub": stub_entry()})
    uv = uv_executable()
    # The user's machine, which the client inherits: uv's cache (the adopt run's too), no
    # Python downloads, and the certificates this machine's TLS needs to reach the index.
    machine = {"UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never"}
    machine.update({key: os.environ[key] for key in ("SSL_CERT_FILE", "SSL_CERT_DIR") if key in os.environ})
    settings = {"MCP_BRIDGE_IMAGE": proxy_engine.image, "MCP_BRIDGE_RUNTIME": proxy_engine.name}
    argv = [uv, "tool", "run", "--from", str(REPO), bridge.SERVER_NAME]
    done = adopt(home, "--client", "claude-desktop", argv=argv, **machine, **settings)
    assert done.returncode == 0, done.stderr
    entry = json.loads(claude_desktop_config(home).read_text())["mcpServers"]["code-execution"]
    assert entry == {
        "command": uv,
        "args": ["tool", "run", "--from", str(REPO), bridge.SERVER_NAME],
        "env": settings,
    }
    found = await run_six_times_seven(entry_params(entry, home, **machine))
    assert found["value"] == "(42, ['stub'])", found


# --- README: every client snippet is read by the discovery section as the bridge ----------

SNIPPET = re.compile(r"<!-- snippet: ([a-z-]+) -->\n```(\w+)\n(.*?)```", re.DOTALL)
README_CLIENTS = {  # snippet -> the config_sources() entries whose file it may be pasted into
    "claude-desktop": ("Claude Desktop",),
    "cursor": ("Cursor", "Windsurf"),
    "vscode": ("VS Code (project)",),
    "codex": ("Codex",),
    "gemini": ("Gemini CLI",),
}


def readme_snippets() -> dict[str, tuple[str, str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return {name: (language, body) for name, language, body in SNIPPET.findall(text)}


def assert_discovered_as_the_bridge(home: Path, cwd: Path) -> None:
    found = bridge.discover_servers(  # "all": a snippet pasted in a project file is read as in a user's
        home, cwd, "linux", {}, home / "MCPs", None, self_markers=(), project_servers="all"
    )
    assert found.problems == (), found.problems
    (spec,) = found.servers
    assert spec.name == "code-execution" and spec.transport == "stdio"
    assert spec.command is not None and bridge.launches_self((spec.command, *spec.args), bridge.SELF_MARKERS)


def test_readme_has_a_snippet_for_each_client() -> None:
    assert set(readme_snippets()) == {*README_CLIENTS, "claude-code"}


@pytest.mark.parametrize(
    ("snippet", "client"), [(s, c) for s, clients in README_CLIENTS.items() for c in clients]
)
def test_readme_snippet_is_read_as_the_bridge(tmp_path: Path, snippet: str, client: str) -> None:
    home, cwd = tmp_path / "home", tmp_path / "project"
    language, body = readme_snippets()[snippet]
    source = next(
        source
        for source in bridge.config_sources(home, cwd, "linux", {}, home / "MCPs", None)
        if source.client == client
    )
    assert language == source.format
    source.path.parent.mkdir(parents=True, exist_ok=True)
    source.path.write_text(body, encoding="utf-8")
    assert_discovered_as_the_bridge(home, cwd)
    if client != "Gemini CLI":  # apps started from a desktop: the command is an absolute path
        command = bridge.parse_document(body, source.format)[source.keys[0][0]]["code-execution"]["command"]
        assert Path(command).is_absolute(), command


def test_readme_claude_code_command_adds_the_bridge_for_the_user(tmp_path: Path) -> None:
    """`claude mcp add [--scope S] NAME -- COMMAND [ARGS...]`, as Claude Code documents it,
    stores {type: stdio, command, args, env} under the NAME in ~/.claude.json (scope user)."""
    language, body = readme_snippets()["claude-code"]
    assert language == "bash"
    words = shlex.split(body)
    assert words[:3] == ["claude", "mcp", "add"] and "--" in words, words
    options, command = words[3 : words.index("--")], words[words.index("--") + 1 :]
    *flags, name = options
    assert flags == ["--scope", "user"], flags
    home = tmp_path / "home"
    entry = {"type": "stdio", "command": command[0], "args": command[1:], "env": {}}
    write_json(home / ".claude.json", {"mcpServers": {name: entry}})
    assert_discovered_as_the_bridge(home, tmp_path)
