"""The bridge module's map stays true: its docstring's table of contents names the banner
sections (``# ====`` lines) the code really has, in the same order."""

from __future__ import annotations

import re
from pathlib import Path

import mcp_server_code_execution_mode as bridge

BANNER = re.compile(r"^# =+\n# (?P<title>.+)\n# =+$", re.MULTILINE)
CONTENTS_ENTRY = re.compile(r"^    (?P<title>\S.*?)\s+-> ", re.MULTILINE)


def test_the_docstrings_table_of_contents_equals_the_banners() -> None:
    source = Path(bridge.__file__).read_text(encoding="utf-8")
    banners = [match["title"] for match in BANNER.finditer(source)]
    assert bridge.__doc__ is not None
    contents = [match["title"] for match in CONTENTS_ENTRY.finditer(bridge.__doc__)]
    assert len(banners) >= 10, banners  # the pattern still finds the banners
    assert contents == banners
