"""Shared fixtures: real container runtimes and a real MCP stdio client driving the
installed console script.

`MCP_TEST_RUNTIMES` (default "podman,docker") names the runtimes the integration tests
run on; a named runtime that does not answer FAILS the tests rather than skipping them,
so a broken CI machine cannot pass silently.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.client.session import ClientSession

from tests.harness import (
    CONTAINER_LABEL,
    DEFAULT_IMAGE,
    Engine,
    bridge_client,
    bridge_env,
    bridge_pids,
    console_script,
    isolated_env,
    text_of,
)

# Tests import these from here, as they did before tests/harness.py held them.
__all__ = [
    "CONTAINER_LABEL",
    "DEFAULT_IMAGE",
    "Engine",
    "bridge_client",
    "bridge_env",
    "bridge_pids",
    "console_script",
    "text_of",
]


def requested_runtimes() -> list[str]:
    return [name for name in os.environ.get("MCP_TEST_RUNTIMES", "podman,docker").split(",") if name]


# --- the `container` marker -----------------------------------------------------------
# A test that starts a container engine, a container, or a bridge that starts one is marked
# `container`; `pytest -m "not container"` runs the rest in seconds. The mark comes from the
# fixtures a test uses (CONTAINER_FIXTURES), or by hand (`@pytest.mark.container`, a
# module's `pytestmark`) for a test that reaches an engine its own way. The guard below
# makes a missing mark fail the test instead of passing slowly.

CONTAINER_FIXTURES = frozenset({"engine", "proxy_engine", "first_engine"})
ENGINES = ("podman", "docker")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if CONTAINER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.container)


class EngineGuard:
    """A test not marked `container` runs, from its first fixture to its last teardown, with
    `podman` and `docker` on PATH as shims that fail loudly and log their argv; a logged
    call fails the test even when the test, or a bridge it started, swallowed the failure."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="engine-shims-"))
        self.log = self.folder / "calls.log"
        self.log.touch()
        for name in ENGINES:
            shim = self.folder / name
            shim.write_text(
                "#!/bin/sh\n"
                'echo "%s $*" >> %s\n'
                'echo "%s was run by a test not marked container (see tests/conftest.py)" >&2\n'
                "exit 97\n" % (name, shlex.quote(str(self.log)), name)
            )
            shim.chmod(0o755)
        self.path: str | None = None
        self.seen = 0

    def arm(self) -> None:
        self.path = os.environ.get("PATH", "")
        self.seen = self.log.stat().st_size
        os.environ["PATH"] = "%s%s%s" % (self.folder, os.pathsep, self.path)

    def disarm(self) -> str:
        """Restores PATH; what the shims logged since `arm`."""
        assert self.path is not None
        os.environ["PATH"], self.path = self.path, None
        with self.log.open() as calls:
            calls.seek(self.seen)
            return calls.read()


GUARD_KEY = pytest.StashKey[EngineGuard]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[GUARD_KEY] = EngineGuard()


def pytest_sessionfinish(session: pytest.Session) -> None:
    guard = session.config.stash.get(GUARD_KEY, None)
    if guard is not None:
        shutil.rmtree(guard.folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("container") is None:
        item.config.stash[GUARD_KEY].arm()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    try:
        result = yield
    finally:
        guard = item.config.stash[GUARD_KEY]
        ran = guard.disarm() if guard.path is not None else ""
    if ran:
        pytest.fail(
            "%s is not marked container but ran a container engine:\n%s"
            "mark it (@pytest.mark.container) or add its fixture to CONTAINER_FIXTURES" % (item.nodeid, ran),
            pytrace=False,
        )
    return result


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`engine` runs a test once per requested runtime, or on the first only in a module
    that sets ``ONE_RUNTIME = True``: what it tests happens on the host (the memory store,
    rendering, long-work bookkeeping), so a second engine would only repeat it."""
    if "engine" in metafunc.fixturenames:
        runtimes = requested_runtimes()
        if getattr(metafunc.module, "ONE_RUNTIME", False):
            runtimes = runtimes[:1]
        metafunc.parametrize("engine", runtimes, indirect=True, scope="session")


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> Engine:
    name = str(request.param)
    image = os.environ.get("MCP_BRIDGE_IMAGE", DEFAULT_IMAGE)
    if shutil.which(name) is None:
        pytest.fail("%s is not installed; run scripts/setup.sh or set MCP_TEST_RUNTIMES" % name)
    probe = subprocess.run([name, "image", "inspect", image], capture_output=True, timeout=60, check=False)
    if probe.returncode != 0:
        pytest.fail("%s cannot see the sandbox image %s; run scripts/setup.sh" % (name, image))
    return Engine(name, image)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    path.mkdir()
    yield path


def claude_desktop_home(tmp_path: Path, servers: dict[str, Any]) -> Path:
    """A fake HOME whose Claude Desktop (Linux) config lists `servers`."""
    home = tmp_path / "home"
    config = home / ".config" / "Claude" / "claude_desktop_config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"mcpServers": servers}))
    return home


# Code that swallows every KeyboardInterrupt: a timeout can only end it by a kill.
IGNORES_INTERRUPTS = """
import time
while True:
    try:
        time.sleep(10)
    except KeyboardInterrupt:
        pass
"""


async def run_cell(client: ClientSession, code: str, timeout: float = 60) -> dict[str, Any]:
    """One run_python call (code dedented): its structuredContent plus the text, isError and
    the number of images and files (a result with those has no structuredContent: status only)."""
    result = await client.call_tool("run_python", {"code": textwrap.dedent(code), "timeout": timeout})
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    files = [block for block in result.content if isinstance(block, types.EmbeddedResource)]
    if (images or files) and result.structured_content is None:  # a result with either has none
        fields: dict[str, Any] = {"status": "error" if result.is_error else "ok", "value": None}
    else:
        fields = structured(result)
    counts = {"images": len(images), "files": len(files)}
    return {**fields, "text": text_of(result), "is_error": result.is_error, **counts}


# What structuredContent leaves out when a call has none of it.
STRUCTURED_DEFAULTS: dict[str, Any] = {
    "stdout": "",
    "stderr": "",
    "error": None,
    "truncated": {},
    "state_kept": True,
    "detail": None,
    "notices": [],
}


def structured(result: types.CallToolResult) -> dict[str, Any]:
    """A result's structuredContent as the tests read it: absent fields at their defaults,
    ``value`` the value as the REPL shows it (its repr) and ``json`` the value as JSON data
    (None when the value is not plain JSON). The raw form is tested in test_rendering and
    test_structured_values."""
    assert isinstance(result.structured_content, dict), result
    return structured_view(result.structured_content, text_of(result))


def structured_view(raw: dict[str, Any], text: str) -> dict[str, Any]:
    view = {**STRUCTURED_DEFAULTS, **raw, "value": shown_value(raw, text), "json": raw.get("value")}
    if "earlier" in raw:
        view["earlier"] = structured_view(raw["earlier"], text)
    return view


def shown_value(raw: dict[str, Any], text: str) -> str | None:
    """The final value as the REPL (and the result's text) shows it: its repr, which JSON
    data gives back but for a tuple (JSON has none: the text says which it was)."""
    if "value_repr" in raw:
        return str(raw["value_repr"])
    if "value" not in raw:
        return None
    shown = repr(raw["value"])
    if isinstance(raw["value"], list) and shown not in text and repr(tuple(raw["value"])) in text:
        return repr(tuple(raw["value"]))
    return shown


# --- real MCP servers for the proxy tests -------------------------------------------

REPO = Path(__file__).resolve().parent.parent
NPM_BIN = REPO / ".cache" / "mcp-servers" / "node_modules" / ".bin"
STUB_SERVER = REPO / "tests" / "servers" / "stub_server.py"
JUNK_WRAPPER = REPO / "tests" / "servers" / "junk_wrapper.py"
LISTING_WRAPPER = REPO / "tests" / "servers" / "listing_wrapper.py"


proxy_env = isolated_env  # the name the proxy tests know it by


def real_server(name: str) -> str:
    """Path of an installed third-party server executable (scripts/setup.sh installs them)."""
    candidates = {
        "everything": NPM_BIN / "mcp-server-everything",
        "filesystem": NPM_BIN / "mcp-server-filesystem",
        "time": Path(sys.executable).parent / "mcp-server-time",
    }
    path = candidates[name]
    if not path.exists():
        pytest.fail("%s is not installed at %s; run scripts/setup.sh" % (name, path))
    return str(path)


def stub_entry(*extra_args: str) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(STUB_SERVER), *extra_args]}


@pytest.fixture(scope="session")
def proxy_engine() -> Engine:
    """The proxy does not depend on the container runtime: most proxy tests run on the
    first requested runtime only, to keep the suite short."""
    name = requested_runtimes()[0]
    return Engine(name, os.environ.get("MCP_BRIDGE_IMAGE", DEFAULT_IMAGE))
