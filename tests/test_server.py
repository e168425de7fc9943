"""The MCP layer in-process (the SDK's in-memory Client): errors of any kind become one
result written for the model, and the server keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp import Client

import mcp_server_code_execution_mode as bridge

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def no_servers() -> bridge.DiscoveryResult:
    return bridge.DiscoveryResult(servers=(), problems=(), sources=())


async def test_an_unexpected_bug_is_one_failed_call_not_a_dead_server(tmp_path: Path) -> None:
    async def broken_runtime_lookup(preferred: Any) -> bridge.ContainerRuntime:
        raise RuntimeError("simulated bug")

    config = bridge.BridgeConfig(state_dir=tmp_path, prewarm=True)
    server = bridge.build_server(config, no_servers(), locate_runtime=broken_runtime_lookup)
    async with Client(server) as client:
        result = await client.call_tool("run_python", {"code": "1"})
        assert result.is_error
        text = "".join(block.text for block in result.content if isinstance(block, types.TextContent))
        assert "internal error (RuntimeError: simulated bug)" in text and "server log" in text
        assert [tool.name for tool in (await client.list_tools()).tools] == ["run_python"]


async def test_unknown_tool_and_bad_arguments_are_explained(tmp_path: Path) -> None:
    async def no_runtime(preferred: Any) -> bridge.ContainerRuntime:
        raise bridge.RuntimeUnavailableError("no runtime here")

    server = bridge.build_server(
        bridge.BridgeConfig(state_dir=tmp_path, prewarm=False), no_servers(), no_runtime
    )
    async with Client(server) as client:
        unknown = await client.call_tool("run_java", {"code": "1"})
        assert unknown.is_error and "the only tool is run_python" in str(unknown.content)
        extra = await client.call_tool("run_python", {"code": "1", "shell": True})
        assert extra.is_error and "shell" in str(extra.content)
