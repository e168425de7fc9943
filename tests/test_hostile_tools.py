"""A hostile saved tool cannot take the sessions with it (issue 16, item 4): a tool whose
definition ends the sandbox's Python process (os._exit in a default argument) or ignores
SIGINT and sleeps is skipped, named in a notice and kept out of new sessions until its
file changes, through a real bridge on a real container of each runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, run_cell, text_of
from tests.test_memory import tool_files

pytestmark = pytest.mark.anyio

EXITS = (
    'def exits(code=__import__("os")._exit(3)):\n    """Ends the process when defined."""\n    return code\n'
)
HANGS = (
    "def hangs(wait=(__import__('signal').signal(2, __import__('signal').SIG_IGN), "
    "__import__('time').sleep(600))):\n    return wait\n"
)
GOOD = 'def good():\n    """A tool that works."""\n    return "good"\n'


def quarantined(state_dir: Path) -> dict[str, str]:
    """Saved tool -> why it is kept out of new sessions, as listings show it."""
    entries = bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME).entries()
    return {entry["name"]: entry["quarantined"] for entry in entries if "quarantined" in entry}


async def call(client: Any, code: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool("run_python", {"code": code, "timeout": 60, **arguments})
    structured = result.structured_content or {}
    return {"text": text_of(result), "is_error": result.is_error, "notices": structured.get("notices", [])}


async def test_a_saved_tool_that_exits_or_hangs_is_skipped_and_kept_out_until_it_changes(
    engine: Engine, state_dir: Path
) -> None:
    tools = bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME)
    for name, source in (("exits", EXITS), ("good", GOOD), ("hangs", HANGS)):
        tools.save(name, source)  # as save_tool would: the host accepts what compiles
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        first = await call(client, "good()")
        assert not first["is_error"] and "'good'" in first["text"], first
        notices = "\n".join(first["notices"])
        assert (
            "Saved tool exits was not defined: defining it ended the Python process (exited with code 3)"
            in (notices)
        ), notices
        assert "Saved tool hangs was not defined: defining it took over 5s" in notices, notices
        assert (
            "delete_tool('hangs')" in notices
            and "Saved tools defined in this fresh session: good." in notices
        )
        assert set(quarantined(state_dir)) == {"exits", "hangs"}

        # Quarantined: a reset and a new session start at once, and say why each is left out.
        reset = await call(client, "good()", reset=True)
        assert not reset["is_error"] and "'good'" in reset["text"], reset
        assert sum("kept out of new sessions until its file" in notice for notice in reset["notices"]) == 2, (
            reset
        )
        other = await call(client, "[good(), 'exits' in globals(), 'hangs' in globals()]", session="other")
        assert "['good', False, False]" in other["text"], other

        # The way out works from the sandbox; a changed file is tried again.
        deleted = await call(client, "delete_tool('exits')")
        assert "True" in deleted["text"], deleted
        (state_dir / bridge.MEMORY_DIRNAME / "hangs.py").write_text("def hangs():\n    return 'fixed'\n")
        fixed = await call(client, "[hangs(), good()]", reset=True)
        assert "['fixed', 'good']" in fixed["text"], fixed
        assert not any("hangs" in notice and "not defined" in notice for notice in fixed["notices"]), fixed
        assert quarantined(state_dir) == {}

        # And a fresh namespace can start without any saved tool.
        bare = await call(client, "'good' in globals()", reset=True, saved_tools=False)
        assert "False" in bare["text"] and "started without the saved tools" in "\n".join(bare["notices"]), (
            bare
        )
        assert "good" in (await run_cell(client, "[t['name'] for t in list_saved_tools()]"))["value"]


async def test_a_changed_but_still_hostile_tool_is_tried_again_and_quarantined_again(
    engine: Engine, state_dir: Path
) -> None:
    tools = bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME)
    tools.save("exits", EXITS)
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        first = await call(client, "1 + 1")
        assert "2" in first["text"] and "exits" in quarantined(state_dir), first
        tools.save("exits", EXITS.replace("_exit(3)", "_exit(4)"))  # saved again: a new source
        assert quarantined(state_dir) == {}
        again = await call(client, "2 + 2", reset=True)
        assert "4" in again["text"], again
        assert "(exited with code 4)" in "\n".join(again["notices"]), again
        assert "exits" in quarantined(state_dir)


# Issue 16 item 10, on each runtime like the other saved-tool items.
async def test_a_tool_that_compiles_but_cannot_be_parsed_back_is_refused_and_listed_as_such(
    engine: Engine, state_dir: Path
) -> None:
    chain = "def chain():\n    return " + "+".join(["1"] * 2990) + "\n"  # compile() takes it, ast.parse not
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run_cell(client, 'def good():\n    """Works."""\n    return 1\nsave_tool(good)')
        refused = await run_cell(
            client,
            f"""
            requests = runtime.call_tool.__self__._requests  # the raw channel, as hostile code may use it
            try:
                requests.call("tool_save", {{"name": "chain", "source": {chain!r}}})
            except Exception as exc:
                print(exc)
            """,
        )
        assert (
            "The source of chain does not compile or cannot be parsed back (RecursionError"
            in (refused["stdout"])
        ), refused
        assert sorted(tool_files(state_dir)) == ["good.py"]
        (state_dir / bridge.MEMORY_DIRNAME / "chain.py").write_text(chain)  # by hand, on the host
        listed = await run_cell(client, "[(t['name'], t['doc']) for t in list_saved_tools()]")
        assert listed["status"] == "ok", listed
        chain_doc, good_doc = eval(listed["value"])
        assert chain_doc[0] == "chain" and chain_doc[1].startswith("(cannot be parsed: RecursionError"), (
            chain_doc
        )
        assert tuple(good_doc) == ("good", "Works.")
