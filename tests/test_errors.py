"""The errors section: every exception class of the bridge is declared there, under one of
the two roots (BridgeError for the model, CommandError for a terminal), and drawn in the
section's tree."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import mcp_server_code_execution_mode as bridge

SOURCE = Path(bridge.__file__).read_text(encoding="utf-8")


def errors_section() -> str:
    start = SOURCE.index("# errors\n# ====")
    return SOURCE[start : SOURCE.index("\n# ====", SOURCE.index("\n", start + len("# errors\n# ====")))]


def exception_classes() -> dict[str, type[BaseException]]:
    return {
        name: value
        for name, value in vars(bridge).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == bridge.__name__
    }


def test_every_exception_class_is_declared_in_the_errors_section() -> None:
    section = errors_section()
    declared = set(re.findall(r"^class (\w+)\(", section, re.MULTILINE))
    assert set(exception_classes()) == declared
    elsewhere = re.findall(r"^class (\w+)\(", SOURCE.replace(section, ""), re.MULTILINE)
    assert not declared & set(elsewhere)


def drawn_parents() -> dict[str, str]:
    """Each class drawn in the section's tree -> the class drawn as its parent (the nearest
    entry above it that starts further left)."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = [(-1, "Exception")]
    for match in re.finditer(r"^(#[ |]*)\+-- (\w+)", errors_section(), re.MULTILINE):
        column, name = len(match.group(1)), match.group(2)
        while stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1]
        stack.append((column, name))
    return parents


def test_every_exception_class_has_one_of_the_two_roots_and_is_drawn_under_its_base() -> None:
    parents = drawn_parents()
    assert set(parents) == set(exception_classes())
    for name, cls in exception_classes().items():
        assert issubclass(cls, bridge.BridgeError) != issubclass(cls, bridge.CommandError), name
        assert cls.__bases__[0].__name__ == parents[name], (name, parents[name])
