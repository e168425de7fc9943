"""GUIDE.md's examples, run as a reader would: every ```python block, read from the file
at test time and sent verbatim, in document order, to one real bridge behind a real MCP
client, with real servers under the aliases the guide uses. Each block's outcome is checked
against what the guide says follows it ("Result: ...", "prints lines such as ..."), and a
block the guide shows without an outcome must run without error. The few blocks that
cannot run here by design are listed in ILLUSTRATIONS, each with the one way it must fail.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from tests.conftest import REPO, Engine, bridge_client, claude_desktop_home, proxy_env, real_server, run_cell
from tests.test_build_image import BATTERIES_EXAMPLE
from tests.test_images import PLOT_EXAMPLE

pytestmark = pytest.mark.anyio

GUIDE = REPO / "GUIDE.md"

# A python block; the text right after it says what the block gives, if anything.
BLOCK = re.compile(r"^```python\n(?P<code>.*?)^```\n", re.M | re.S)
# "Result: `X`" on the line after a block; `rest` is whatever follows the backquotes.
INLINE_RESULT = re.compile(r"\AResult: `(?P<value>[^`]*)`(?P<rest>[^\n]*)")
# "Result:" alone on its line: the value is the fenced block that follows it.
BLOCK_RESULT = re.compile(r"\AResult:\n```\n(?P<value>.*?)^```\n", re.M | re.S)
PRINTS = re.compile(r"\Aprints lines such as\n`(?P<line>[^`]*)`")


@dataclass(frozen=True)
class Example:
    line: int  # where the block starts in GUIDE.md, for messages
    code: str
    result: str | None  # the text between the backquotes of "Result: `...`"
    result_rest: str  # what the guide writes after it on the same line
    shown_block: str | None  # a "Result:" given as a fenced block
    printed_line: str | None  # "prints lines such as `...`"


def guide_examples() -> list[Example]:
    text = GUIDE.read_text(encoding="utf-8")
    examples = []
    for match in BLOCK.finditer(text):
        after = text[match.end() :]
        inline, shown, prints = INLINE_RESULT.match(after), BLOCK_RESULT.match(after), PRINTS.match(after)
        # A claim in a form not read here would go unchecked.
        assert inline or shown or not after.startswith("Result"), after[:80]
        assert prints or not after.startswith("prints"), after[:80]
        examples.append(
            Example(
                line=text.count("\n", 0, match.start()) + 1,
                code=match["code"],
                result=inline["value"] if inline else None,
                result_rest=inline["rest"] if inline else "",
                shown_block=shown["value"] if shown else None,
                printed_line=prints["line"] if prints else None,
            )
        )
    return examples


def the_block(examples: list[Example], marker: str) -> Example:
    """The one example whose code contains `marker` (so a table entry cannot go stale)."""
    found = [example for example in examples if marker in example.code]
    assert len(found) == 1, "%r should mark exactly one GUIDE.md block, marks %d" % (marker, len(found))
    return found[0]


# Blocks that cannot run here by design, and the one way each must fail; a block that fails
# differently (or runs) is a finding. Marked by a line of their code.
ILLUSTRATIONS = {
    # The guide's example of a server the user might have: no GitHub server here (it needs
    # a token and the network), so the name is not defined in the sandbox, and the error
    # says which servers there are.
    'mcp_github.create_issue(owner="me", repo="nope", title="x")': (
        "NameError: name 'mcp_github' is not defined. There is no MCP server 'github' in this sandbox. "
        "Its servers: mcp_everything, mcp_filesystem, mcp_time. runtime.discovered_servers(detailed=True) "
        "shows where each server came from."
    ),
}
# BATTERIES_EXAMPLE (section "Data work") and PLOT_EXAMPLE (section "Images") need the
# batteries image: not run here; tests/test_build_image.py and tests/test_images.py run
# them verbatim in that image (and this file checks GUIDE.md still shows them).

# Results the guide writes loosely, each read in one explicit way.
# "Result: `1` the first time, then `2`, ...": run the block twice, expect 1 then 2.
COUNTS_UP = 'update_memory("runs", lambda n: (n or 0) + 1)'
THEN = re.compile(r"\A the first time, then `(?P<value>[^`]*)`, \.\.\.\Z")
# The saved tool's path is shown for a user "you" with the default state directory
# (~/MCPs): here the state directory is the test's.
SHOWN_STATE_DIR = "/home/you/MCPs"
# `runtime.list_servers()` lists the guide's example configuration, which includes the
# illustrative GitHub server (see ILLUSTRATIONS): every other alias must be listed, and no more.
LIST_SERVERS = "runtime.list_servers()"
NOT_CONFIGURED_HERE = ["github"]


def servers(tmp_path: Path) -> dict[str, Any]:
    """The servers GUIDE.md's examples call, under its aliases."""
    files = tmp_path / "files"
    files.mkdir()
    return {
        "everything": {"command": real_server("everything")},
        "filesystem": {"command": real_server("filesystem"), "args": [str(files)]},
        "time": {"command": real_server("time")},
    }


def test_guide_marks_every_special_case() -> None:
    examples = guide_examples()
    for marker in [*ILLUSTRATIONS, BATTERIES_EXAMPLE, PLOT_EXAMPLE, COUNTS_UP, LIST_SERVERS]:
        the_block(examples, marker)
    assert [e.line for e in examples if SHOWN_STATE_DIR in (e.result or "")] == [
        the_block(examples, "save_tool(slugify)").line
    ]
    # Every result with words after it is one of the special cases above.
    loose = [e.line for e in examples if e.result_rest not in ("", ".")]
    assert loose == [the_block(examples, COUNTS_UP).line]


async def test_every_guide_example_does_what_the_guide_says(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    examples = guide_examples()
    assert len(examples) == GUIDE.read_text(encoding="utf-8").count("```python\n") > 10
    skipped = {the_block(examples, BATTERIES_EXAMPLE).line, the_block(examples, PLOT_EXAMPLE).line}
    illustrations = {the_block(examples, marker).line: error for marker, error in ILLUSTRATIONS.items()}
    home = claude_desktop_home(tmp_path, servers(tmp_path))
    checked = []
    asked: list[str] = []

    async def the_user(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        """The guide's reader as the user: asked to approve a call, they deny it."""
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"decision": "deny"})

    async with bridge_client(proxy_env(proxy_engine, state_dir, home), elicitation=the_user) as client:
        for example in examples:
            if example.line in skipped:
                continue
            where = "GUIDE.md line %d" % example.line
            answer = await run_cell(client, example.code)
            if example.line in illustrations:
                assert answer["is_error"], (where, answer)
                assert (
                    answer["error"]["type"] + ": " + answer["error"]["message"] == illustrations[example.line]
                ), (where, answer)
                checked.append(example.line)
                continue
            assert not answer["is_error"], (where, answer)
            assert answer["status"] == "ok", (where, answer)
            if example.result is not None:
                expected = example.result
                if COUNTS_UP in example.code:
                    assert answer["value"] == expected, (where, answer)
                    then = THEN.match(example.result_rest)
                    assert then, (where, example.result_rest)
                    answer = await run_cell(client, example.code)
                    expected = then["value"]
                elif LIST_SERVERS in example.code:
                    shown = ast.literal_eval(expected)
                    expected = repr([alias for alias in shown if alias not in NOT_CONFIGURED_HERE])
                expected = expected.replace(SHOWN_STATE_DIR, str(state_dir))
                # A result with files or images has no structuredContent: its text is the value.
                shown = answer["text"] if answer["files"] or answer["images"] else answer["value"]
                assert shown == expected, (where, answer)
            if example.shown_block is not None:
                # The shown value is the value's text, wrapped over lines for the reader.
                assert " ".join(answer["value"].split()) == " ".join(example.shown_block.split()), (
                    where,
                    answer,
                )
            if example.printed_line is not None:
                assert example.printed_line in answer["stdout"].splitlines(), (where, answer)
            checked.append(example.line)
    assert len(checked) == len(examples) - len(skipped)
    # Only the approvals example's call asked (every other call the guide makes is read-only).
    assert len(asked) == 1 and "mcp_filesystem.create_directory" in asked[0], asked
