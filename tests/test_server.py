"""The MCP layer in-process (the SDK's in-memory Client): errors of any kind become one
result written for the model, and the server keeps serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError as McpProtocolError

import mcp_server_code_execution_mode as bridge

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def no_servers() -> bridge.DiscoveryResult:
    return bridge.DiscoveryResult(servers=(), problems=(), sources=())


async def test_an_unexpected_bug_is_one_failed_call_not_a_dead_server(tmp_path: Path) -> None:
    async def broken_runtime_lookup(preferred: Any) -> bridge.ContainerEngine:
        raise RuntimeError("simulated bug")

    config = bridge.BridgeConfig(state_dir=tmp_path, prewarm=True)
    opened = bridge.open_bridge(config, no_servers(), locate_engine=broken_runtime_lookup)
    async with opened as world, Client(bridge.build_server(world)) as client:
        result = await client.call_tool("run_python", {"code": "1"})
        assert result.is_error
        text = "".join(block.text for block in result.content if isinstance(block, types.TextContent))
        assert "internal error (RuntimeError: simulated bug)" in text and "server log" in text
        assert [tool.name for tool in (await client.list_tools()).tools] == ["run_python"]


async def test_unknown_tool_and_bad_arguments_are_explained(tmp_path: Path) -> None:
    async def no_runtime(preferred: Any) -> bridge.ContainerEngine:
        raise bridge.EngineUnavailableError("no runtime here")

    config = bridge.BridgeConfig(state_dir=tmp_path, prewarm=False)
    opened = bridge.open_bridge(config, no_servers(), no_runtime)
    async with opened as world, Client(bridge.build_server(world)) as client:
        with pytest.raises(McpProtocolError) as unknown:  # a protocol error, not a tool result
            await client.call_tool("run_java", {"code": "1"})
        assert unknown.value.error.code == types.INVALID_PARAMS
        assert "the only tool is run_python" in unknown.value.error.message
        extra = await client.call_tool("run_python", {"code": "1", "shell": True})
        assert extra.is_error and "shell" in str(extra.content)


async def test_listings_answer_as_the_protocol_has_them(tmp_path: Path) -> None:
    """resources/templates/list answers (an empty list) rather than -32601, and tools/list
    refuses a cursor it never gave out as resources/list does."""
    opened = bridge.open_bridge(bridge.BridgeConfig(state_dir=tmp_path, prewarm=False), no_servers())
    async with opened as world, Client(bridge.build_server(world)) as client:
        assert (await client.list_resource_templates()).resource_templates == []
        for listing in (client.list_tools, client.list_resources):
            with pytest.raises(McpProtocolError) as refused:
                await listing(cursor="zz")
            assert refused.value.error.code == types.INVALID_PARAMS
            assert refused.value.error.message == "Invalid cursor 'zz'; list again without one."
        assert [tool.name for tool in (await client.list_tools(cursor="0")).tools] == ["run_python"]


async def test_the_calling_clients_name_decides_when_a_long_call_answers_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = bridge.BridgeConfig(state_dir=tmp_path, prewarm=False)
    seen: list[bridge.RunRequest] = []

    async def run(request: bridge.RunRequest) -> bridge.ExecutionOutcome:
        seen.append(request)
        return bridge.ExecutionOutcome(status="ok", stdout="ran\n")

    async with bridge.open_bridge(config, no_servers()) as world:
        monkeypatch.setattr(world.sandboxes, "run", run)
        for name in ("claude-code", "codex-mcp-client", "claude-ai"):
            info = types.Implementation(name=name, version="1.0")
            async with Client(bridge.build_server(world), client_info=info) as client:
                assert not (await client.call_tool("run_python", {"code": "print('ran')"})).is_error
    assert [request.client_name for request in seen] == ["claude-code", "codex-mcp-client", "claude-ai"]
    # Claude Code waits hours for a tool: it gets the end; Codex waits 300 s; Claude Desktop ~60 s.
    assert [bridge.respond_after_for(config, request.client_name) for request in seen] == [0.0, 240.0, 45.0]
    # The user's setting wins for every client, 0 included.
    for setting in (0.0, 10.0):
        chosen = bridge.BridgeConfig(respond_after=setting)
        assert {bridge.respond_after_for(chosen, name) for name in ("claude-code", "claude-ai", None)} == {
            setting
        }


def test_the_serving_process_freezes_its_start_up_and_collects_young_objects_less_often() -> None:
    # In a process of its own: a frozen test process would keep its garbage.
    probe = (
        "import gc, mcp_server_code_execution_mode as bridge\n"
        "before = gc.get_freeze_count()\n"
        "bridge.collect_less_after_start_up()\n"
        "print(before, gc.get_freeze_count() > 10_000, len(gc.get_objects()), gc.get_threshold()[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["0", "True", "0", str(bridge.YOUNG_COLLECTION_THRESHOLD)]
