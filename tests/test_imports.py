"""What the bridge imports, and from where. Importing the module (and running a terminal
command such as `memory list`) loads neither the MCP SDK nor the HTTP stack it drags in
(uvicorn, starlette): they are imported by the paths that use them. And what the bridge
takes from the SDK's internals (SDK_INTERNALS) still exists, each named if it moved."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mcp_server_code_execution_mode as bridge

REPO = Path(__file__).resolve().parent.parent

# Modules only the server paths need: the SDK (whose package imports its HTTP server),
# uvicorn, starlette, and the protocol types' models (loaded on first use).
SERVER_ONLY = [
    "mcp",
    "uvicorn",
    "starlette",
    "sse_starlette",
    "h11",
    "httpx2",
    "toon_format",
    "mcp_types._types",
]


def loaded_after(code: str, tmp_path: Path) -> list[str]:
    """Which of SERVER_ONLY a fresh interpreter has loaded after running ``code``."""
    probe = "%s\nimport json, sys\nprint(json.dumps([m for m in %r if m in sys.modules]))" % (
        code,
        SERVER_ONLY,
    )
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "MCP_BRIDGE_STATE_DIR": str(tmp_path / "state")}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout.splitlines()[-1])
    return loaded


def test_importing_the_bridge_loads_no_http_stack(tmp_path: Path) -> None:
    assert loaded_after("import mcp_server_code_execution_mode", tmp_path) == []


def test_memory_list_loads_no_http_stack(tmp_path: Path) -> None:
    code = "import mcp_server_code_execution_mode as m\nassert m.main(['memory', 'list']) == 0"
    assert loaded_after(code, tmp_path) == []


def test_the_probe_sees_what_a_server_path_loads(tmp_path: Path) -> None:
    """The two tests above could pass by looking in the wrong place: one that loads the SDK
    must see it."""
    code = "import mcp_server_code_execution_mode as m\nm.build_misconfigured_server('probe')"
    assert {"mcp", "uvicorn", "starlette", "mcp_types._types"} <= set(loaded_after(code, tmp_path))


def resolve(entry: str) -> object:
    """The object an SDK_INTERNALS entry names ("module:Class.attribute"); an attribute the
    class sets in __init__ is looked up on an instance."""
    module_name, _, dotted = entry.partition(":")
    found: object = importlib.import_module(module_name)
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        if not hasattr(found, part) and index == len(parts) - 1 and isinstance(found, type):
            found = instance_of(found)
        found = getattr(found, part)
    return found


def instance_of(cls: type) -> object:
    from mcp.server.lowlevel import Server
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    makers = {StreamableHTTPSessionManager: lambda: StreamableHTTPSessionManager(Server("probe"))}
    assert cls in makers, "no way to make a %s to look for its attributes: add one here" % cls.__name__
    return makers[cls]()


@pytest.mark.parametrize("entry", bridge.SDK_INTERNALS)
def test_each_sdk_internal_still_exists(entry: str) -> None:
    try:
        resolve(entry)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            "The MCP SDK no longer has %s (%s: %s): the bridge uses it (see SDK_INTERNALS); "
            "find where this SDK version moved it" % (entry, type(exc).__name__, exc)
        )


def sdk_imports() -> list[tuple[int, str, str]]:
    """(line, module, name) of every import of an mcp.* module in the bridge."""
    tree = ast.parse(Path(bridge.__file__).read_text(encoding="utf-8"))
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mcp"
        for alias in node.names
    ]


def split_entry(entry: str) -> tuple[str, str, str]:
    return entry.partition(":")


def is_internal(module: str, name: str) -> bool:
    """Private by the leading underscore, or the SDK's os helpers (not its public API)."""
    return any(part.startswith("_") for part in [*module.split("."), name]) or module.startswith("mcp.os.")


def test_every_import_of_an_sdk_internal_is_listed() -> None:
    imports = sdk_imports()
    assert any(module == "mcp.client.session" for _, module, _ in imports)  # the scan finds imports
    listed = {
        module + ":" + dotted.split(".")[0] for module, _, dotted in map(split_entry, bridge.SDK_INTERNALS)
    }
    unlisted = [
        "line %d: from %s import %s" % (line, module, name)
        for line, module, name in imports
        if is_internal(module, name) and "%s:%s" % (module, name) not in listed
    ]
    assert unlisted == [], "add these to SDK_INTERNALS: %s" % unlisted


def test_the_stdio_cap_is_the_sdks_http_body_cap() -> None:
    from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE

    assert bridge.STDIO_MAX_MESSAGE_BYTES == DEFAULT_MAX_REQUEST_BODY_SIZE


def test_the_http_classes_are_joined_to_their_bases() -> None:
    from mcp.server.lowlevel import Server
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from uvicorn.protocols.http.h11_impl import H11Protocol

    config = bridge.BridgeConfig()
    protocol = bridge.GuardedH11Protocol.configured(config)
    assert issubclass(protocol, H11Protocol) and issubclass(protocol, bridge.GuardedH11Protocol)
    assert (protocol.request_timeout, protocol.max_connections) == (
        config.http_request_timeout,
        config.http_max_connections,
    )
    manager = bridge.PrincipalSessionManager.create(Server("probe"), config)
    assert isinstance(manager, StreamableHTTPSessionManager) and isinstance(
        manager, bridge.PrincipalSessionManager
    )
    assert manager.open_sessions == 0 and manager.sessions_of("local") == 0
