"""What structuredContent carries, through a real MCP client and real containers: the
final value as JSON data when it is plain JSON, its repr otherwise, no empty fields, and
TOON mode's tables for lists of uniform dicts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import toon_format

from tests.conftest import REPO, Engine, bridge_client, bridge_env, text_of

pytestmark = pytest.mark.anyio
# results are rendered on the host: the first requested runtime is enough.
ONE_RUNTIME = True

ROWS = "[{'id': i, 'name': 'user%02d' % i, 'active': i % 2 == 0} for i in range(20)]"


async def test_a_plain_json_value_is_json_data_and_anything_else_its_repr(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        cases = {
            "1 + 1": {"value": 2},
            "{'a': [1, 2.5, None, True], 'b': 'é'}": {"value": {"a": [1, 2.5, None, True], "b": "é"}},
            "(1, 'two')": {"value": [1, "two"]},  # JSON has no tuple; the text keeps the repr
            "{1, 2}": {"value_repr": "{1, 2}"},
            "{1: 'int keys'}": {"value_repr": "{1: 'int keys'}"},
            "float('nan')": {"value_repr": "nan"},
            "class D(dict):\n    pass\nD(a=1)": {"value_repr": "{'a': 1}"},  # a subclass may mean more
        }
        for code, expected in cases.items():
            result = await client.call_tool("run_python", {"code": code})
            raw = result.structured_content
            assert raw is not None and not result.is_error, (code, result)
            assert {key: raw[key] for key in ("value", "value_repr") if key in raw} == expected, (code, raw)
        text = await client.call_tool("run_python", {"code": "(1, 'two')"})
        assert text_of(text) == "(1, 'two')"  # the model reads the repr, as in a REPL


async def test_a_trivial_call_has_no_empty_fields(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool("run_python", {"code": "1 + 1"})
        raw = result.structured_content
        assert raw is not None
        assert set(raw) == {"status", "value", "duration_seconds"}, raw
        printed = await client.call_tool("run_python", {"code": "print('hi')"})
        assert set(printed.structured_content or {}) == {"status", "stdout", "duration_seconds"}


async def test_toon_mode_renders_a_list_of_uniform_dicts_as_a_table(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_OUTPUT_MODE="toon")
    async with bridge_client(env) as client:
        result = await client.call_tool("run_python", {"code": ROWS})
        text = text_of(result)
        assert "value[20]{id,name,active}:" in text, text
        assert toon_format.decode(text)["value"][3] == {"id": 3, "name": "user03", "active": False}
        assert result.structured_content is not None and result.structured_content["value"][19]["id"] == 19


async def test_guides_toon_example_reads_as_the_guide_shows(engine: Engine, state_dir: Path) -> None:
    guide = (REPO / "GUIDE.md").read_text(encoding="utf-8")
    code, shown = GUIDE_TOON.search(guide).group("code", "shown")  # type: ignore[union-attr]
    env = bridge_env(engine, state_dir, MCP_BRIDGE_OUTPUT_MODE="toon")
    async with bridge_client(env) as client:
        result = await client.call_tool("run_python", {"code": code})
    # Everything but the duration, which varies.
    assert without_duration(text_of(result)) == without_duration(shown), text_of(result)


GUIDE_TOON = re.compile(
    r"```python\n(?P<code>[^`]*)```\nResult: `[^`]*`\n\nreads in TOON mode as\n\n```\n(?P<shown>[^`]*)```",
    re.S,
)


def without_duration(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if not line.startswith("duration_seconds:")]
