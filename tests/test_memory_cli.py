"""`mcp-server-code-execution-mode memory list|get|delete|export`: the installed console
script, run as the user would, on a state directory filled by a real bridge's sandbox (or,
for the error cases, by the store itself)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, console_script, run_cell

# the memory command reads the host's store: the first requested runtime is enough.
ONE_RUNTIME = True

SAVED_PROJECT = {"name": "x", "tags": ["a", "ü"], "n": 1}
ODD_KEY = "notes/2024 ü?#"


def memory_cli(state_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The console script's memory subcommand, with MCP_BRIDGE_STATE_DIR=`state_dir`."""
    return store_command("memory", state_dir, *args, **env)


def store_command(command: str, state_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), command, *args],
        env=bridge_env(None, state_dir, **env),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
        check=False,
    )


def store_for(state_dir: Path) -> bridge.MemoryStore:
    return bridge.MemoryStore(state_dir / bridge.MEMORY_DIRNAME, 1024 * 1024, 100 * 1024 * 1024)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (no traceback, nothing on stdout)."""
    assert result.stdout == "", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("mcp-server-code-execution-mode memory: "), lines
    return lines[0]


@pytest.mark.anyio
async def test_the_cli_shows_exports_and_deletes_what_the_sandbox_saved(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        saved = await run_cell(
            client,
            f"""
            save_memory("project", {SAVED_PROJECT!r}, metadata={{"about": "demo"}})
            save_memory({ODD_KEY!r}, [1, 2.5, None])
            def double(x):
                \"\"\"Twice x.\"\"\"
                return 2 * x
            save_tool(double)
            sorted(entry["key"] for entry in list_memories())
            """,
        )
        assert not saved["is_error"] and saved["value"] == repr(sorted(["project", ODD_KEY])), saved

    listing = memory_cli(state_dir, "list", "--json")
    assert listing.returncode == 0, listing.stderr
    lines = [json.loads(line) for line in listing.stdout.splitlines()]
    memories = [line for line in lines if "key" in line]
    assert [(m["key"], m["metadata"], m["size"]) for m in memories] == [
        (ODD_KEY, {}, len("[1,2.5,null]")),
        (
            "project",
            {"about": "demo"},
            # size: the value's and the metadata's JSON, as the caps count them
            len(json.dumps(SAVED_PROJECT, ensure_ascii=False, separators=(",", ":")).encode())
            + len('{"about":"demo"}'),
        ),
    ]
    assert all(m["updated"] and m["version"] == 1 for m in memories)
    assert [line["tool"] for line in lines if "tool" in line] == ["double"]

    table = memory_cli(state_dir, "list")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split() == ["KEY", "SIZE", "UPDATED", "METADATA"]
    assert rows[1].startswith(ODD_KEY + "  ") and rows[2].startswith("project ")
    assert '{"about": "demo"}' in rows[2]
    assert any(row.startswith("double ") and "Twice x." in row for row in rows[3:]), rows

    got = memory_cli(state_dir, "get", "project")
    assert got.returncode == 0 and json.loads(got.stdout) == SAVED_PROJECT, got
    assert json.loads(memory_cli(state_dir, "get", ODD_KEY).stdout) == [1, 2.5, None]

    exported = memory_cli(state_dir, "export")
    assert exported.returncode == 0, exported.stderr
    everything: dict[str, Any] = json.loads(exported.stdout)
    assert sorted(everything) == sorted(["project", ODD_KEY])
    assert everything["project"]["value"] == SAVED_PROJECT
    assert everything["project"]["metadata"] == {"about": "demo"}
    assert everything[ODD_KEY]["value"] == [1, 2.5, None]
    assert set(everything["project"]) >= {"value", "metadata", "size", "version", "created", "updated"}

    deleted = memory_cli(state_dir, "delete", "project")
    assert deleted.returncode == 0 and deleted.stdout == "", deleted
    gone = memory_cli(state_dir, "get", "project")
    assert gone.returncode == 1 and "no memory named 'project'" in one_line_error(gone)

    # and the sandbox sees the user's deletion
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        after = await run_cell(client, 'memory_exists("project"), load_memory(' + repr(ODD_KEY) + ")")
        assert after["value"] == "(False, [1, 2.5, None])", after


def test_get_of_a_missing_key_is_one_line_on_stderr_and_exit_1(state_dir: Path) -> None:
    store_for(state_dir).save("present", 1)
    result = memory_cli(state_dir, "get", "absent")
    assert result.returncode == 1
    assert "no memory named 'absent'" in one_line_error(result)
    assert memory_cli(state_dir, "delete", "absent").returncode == 1


@pytest.mark.parametrize("key", ["", "a\nb", "x" * (bridge.MAX_MEMORY_KEY_CHARS + 1)])
def test_a_bad_key_is_a_usage_error_without_a_traceback(state_dir: Path, key: str) -> None:
    for command in ("get", "delete"):
        result = memory_cli(state_dir, command, key)
        assert result.returncode == 2
        assert "Memory keys are 1-200 printable characters" in one_line_error(result)


def test_a_corrupt_store_is_reported_in_one_line_and_left_untouched(state_dir: Path) -> None:
    path = state_dir / bridge.MEMORY_DIRNAME / bridge.MEMORY_FILENAME
    path.parent.mkdir()
    junk = b"this is not a database" * 200
    path.write_bytes(junk)
    for args in (["list"], ["list", "--json"], ["get", "k"], ["delete", "k"], ["export"]):
        result = memory_cli(state_dir, *args)
        assert result.returncode == 1, (args, result)
        assert "cannot be used" in one_line_error(result) and str(path) in result.stderr
    assert path.read_bytes() == junk


def test_reading_an_empty_state_dir_creates_no_store(state_dir: Path) -> None:
    listing = memory_cli(state_dir, "list")
    assert listing.returncode == 0 and listing.stdout == "" and "No memories" in listing.stderr
    exported = memory_cli(state_dir, "export")
    assert exported.returncode == 0 and json.loads(exported.stdout) == {}
    assert memory_cli(state_dir, "get", "k").returncode == 1
    assert not (state_dir / bridge.MEMORY_DIRNAME).exists()


def test_the_state_dir_flag_wins_over_the_environment_before_or_after_the_command(
    state_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    store_for(other).save("only-in-other", "yes")
    store_for(state_dir).save("only-in-env", "no")
    assert json.loads(memory_cli(state_dir, "get", "only-in-env").stdout) == "no"
    for args in (
        ["--state-dir", str(other), "get", "only-in-other"],
        ["get", "only-in-other", "--state-dir", str(other)],
    ):
        result = memory_cli(state_dir, *args)
        assert result.returncode == 0 and json.loads(result.stdout) == "yes", (args, result)


def test_a_bad_setting_is_the_same_config_error_as_the_servers(state_dir: Path) -> None:
    result = memory_cli(state_dir, "list", MCP_BRIDGE_TIMEOUT="soon")
    assert result.returncode == 2
    assert "MCP_BRIDGE_TIMEOUT='soon' is invalid" in one_line_error(result)


def test_output_is_utf8_json_even_when_the_locale_is_ascii(state_dir: Path) -> None:
    store_for(state_dir).save("café ☕", {"naïve": "✓"})
    result = memory_cli(state_dir, "export", PYTHONIOENCODING="ascii", LC_ALL="C")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["café ☕"]["value"] == {"naïve": "✓"}


def test_a_reader_that_stops_early_gets_no_traceback(state_dir: Path) -> None:
    store = store_for(state_dir)
    for index in range(8):
        store.save("big-%d" % index, "x" * 200_000)
    environ = bridge_env(None, state_dir)
    with subprocess.Popen(
        [console_script(), "memory", "export"], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.read(10)
        process.stdout.close()  # like `| head -c 10`: the rest of the 1.6 MB meets a closed pipe
        stderr = process.stderr.read().decode()
        status = process.wait(timeout=60)
    assert status == 1 and stderr == "", stderr


# --- issue 16: saved tools on the command line, bad entries, escape sequences ---------------

HOSTILE_DOC = "Looks fine.\x1b]0;owned\x07\x1b[2J\x9b31m"
CHAIN = "def chain():\n    return " + "+".join(["1"] * 2990) + "\n"  # compiles; ast.parse recurses too deep


def tools_cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return store_command("tools", state_dir, *args)


def saved_tools(state_dir: Path) -> bridge.SavedTools:
    return bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME)


def test_the_tools_command_lists_shows_and_deletes_saved_tools_with_their_quarantine(state_dir: Path) -> None:
    tools = saved_tools(state_dir)
    tools.save("good", 'def good():\n    """Works."""\n    return 1\n')
    tools.save("exits", 'def exits(code=__import__("os")._exit(3)):\n    return code\n')
    digest = tools.sources()["tools"][0]["digest"]  # name order: exits first
    assert tools.quarantine("exits", digest, "ended the Python process (exited with code 3)") is not None
    listing = tools_cli(state_dir, "list")
    assert listing.returncode == 0, listing
    rows = listing.stdout.splitlines()
    assert rows[0].split() == ["SAVED", "TOOL", "FILE", "DOC"], rows
    assert "[quarantined: defining it ended the Python process (exited with code 3)]" in rows[1], rows
    assert rows[2].startswith("good ") and rows[2].endswith("Works."), rows
    as_json = [json.loads(line) for line in tools_cli(state_dir, "list", "--json").stdout.splitlines()]
    assert [(line["tool"], "quarantined" in line) for line in as_json] == [("exits", True), ("good", False)]
    shown = tools_cli(state_dir, "show", "good")
    assert shown.returncode == 0 and shown.stdout == 'def good():\n    """Works."""\n    return 1\n', shown
    deleted = tools_cli(state_dir, "delete", "exits")
    assert deleted.returncode == 0 and "Deleted saved tool exits" in deleted.stderr, deleted
    assert [entry["name"] for entry in tools.entries()] == ["good"]
    missing = tools_cli(state_dir, "delete", "exits")
    assert missing.returncode == 1 and "There is no saved tool named exits" in missing.stderr, missing
    assert "Traceback" not in missing.stderr
    assert tools_cli(state_dir, "show", "../memory").returncode == 2
    # `memory delete` of a saved tool's name says which command handles saved tools.
    wrong_command = memory_cli(state_dir, "delete", "good")
    assert wrong_command.returncode == 1 and "There is no memory named 'good'" in wrong_command.stderr
    assert "A saved tool has that name" in wrong_command.stderr, wrong_command.stderr
    assert "`mcp-server-code-execution-mode tools delete good`" in wrong_command.stderr
    assert [entry["name"] for entry in tools.entries()] == ["good"]  # nothing deleted


def test_a_saved_tool_that_cannot_be_parsed_back_is_refused_and_one_on_disk_is_listed_as_such(
    state_dir: Path,
) -> None:
    tools = saved_tools(state_dir)
    with pytest.raises(bridge.MemoryStoreError, match="cannot be parsed back \\(RecursionError"):
        tools.save("chain", CHAIN)
    tools.save("good", 'def good():\n    """Works."""\n    return 1\n')
    (state_dir / bridge.MEMORY_DIRNAME / "chain.py").write_text(CHAIN)  # by hand, beside the store
    (state_dir / bridge.MEMORY_DIRNAME / "latin.py").write_bytes(b"def latin():\n    return '\xe9'\n")
    for command in (memory_cli, tools_cli):
        listing = command(state_dir, "list")
        assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing
        lines = {line.split()[0]: line for line in listing.stdout.splitlines() if line.strip()}
        assert "(cannot be parsed: RecursionError" in lines["chain"], lines
        assert "(cannot be read: UnicodeDecodeError" in lines["latin"], lines
        assert lines["good"].endswith("Works."), lines


def test_escape_sequences_the_sandbox_saved_never_reach_the_terminal(state_dir: Path) -> None:
    tools = saved_tools(state_dir)
    tools.save("sneaky", 'def sneaky():\n    """%s"""\n    return "\x1b[2J"\n' % HOSTILE_DOC)
    store_for(state_dir).save("k", "value \x9b31m \x7f \x1b[2J", metadata={"about": "\x1b]0;owned\x07\x9b"})
    outputs = {
        "memory list": memory_cli(state_dir, "list").stdout,
        "memory list --json": memory_cli(state_dir, "list", "--json").stdout,
        "memory get": memory_cli(state_dir, "get", "k").stdout,
        "memory export": memory_cli(state_dir, "export").stdout,
        "tools list": tools_cli(state_dir, "list").stdout,
        "tools list --json": tools_cli(state_dir, "list", "--json").stdout,
        "tools show": tools_cli(state_dir, "show", "sneaky").stdout,
    }
    for surface, text in outputs.items():
        assert "Looks fine." in text or "value" in text or "sneaky" in text, (surface, text)
        controls = [
            char for char in text if (ord(char) < 32 and char not in "\n\t") or 0x7F <= ord(char) <= 0x9F
        ]
        assert controls == [], (surface, text)
    # JSON keeps the value: escaped, not dropped.
    assert json.loads(outputs["memory get"]) == "value \x9b31m \x7f \x1b[2J"
    assert "\\x1b[2J" in outputs["tools show"]
