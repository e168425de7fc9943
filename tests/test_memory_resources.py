"""Memories and saved tools as MCP resources: what the sandbox saved is listed and read
through a real MCP client (the installed console script on a real container), and the
edge cases (a corrupt store, odd keys, paging, names that would leave the folder) through
the SDK's in-memory client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, run_cell

pytestmark = pytest.mark.anyio
# resources are served from the host's store: the first requested runtime is enough.
ONE_RUNTIME = True

ODD_KEY = "notes/2024 ü?#%"


def store_for(state_dir: Path) -> bridge.MemoryStore:
    return bridge.MemoryStore(state_dir / bridge.MEMORY_DIRNAME, 1024 * 1024, 100 * 1024 * 1024)


@asynccontextmanager
async def in_memory_client(state_dir: Path) -> AsyncIterator[Client]:
    """A client of a bridge opened in this process, without a container runtime."""

    async def no_runtime(preferred: Any) -> bridge.ContainerEngine:
        raise bridge.EngineUnavailableError("no runtime in this test")

    config = bridge.BridgeConfig(state_dir=state_dir, prewarm=False)
    discovery = bridge.DiscoveryResult(servers=(), problems=(), sources=())
    async with (
        bridge.open_bridge(config, discovery, no_runtime) as world,
        Client(bridge.build_server(world)) as client,
    ):
        yield client


def text_of(result: types.ReadResourceResult) -> tuple[str | None, str]:
    (content,) = result.contents
    assert isinstance(content, types.TextResourceContents), content
    return content.mime_type, content.text


async def read_error(client: Client, uri: str) -> MCPError:
    with pytest.raises(MCPError) as caught:
        await client.read_resource(uri)
    return caught.value


async def test_what_the_sandbox_saves_is_listed_and_read_as_resources(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        before = await client.list_resources()
        assert [str(r.uri) for r in before.resources] == [bridge.CAPABILITIES_URI]
        saved = await run_cell(
            client,
            f"""
            save_memory("project", {{"name": "x", "n": 1}}, metadata={{"about": "demo"}})
            save_memory({ODD_KEY!r}, ["ü", 2])
            def double(x):
                \"\"\"Twice x.\"\"\"
                return 2 * x
            save_tool(double)
            """,
        )
        assert not saved["is_error"], saved

        listed = {str(r.uri): r for r in (await client.list_resources()).resources}
        odd_uri = "memory://notes%2F2024%20%C3%BC%3F%23%25"
        assert sorted(listed) == sorted(
            [bridge.CAPABILITIES_URI, "memory://project", odd_uri, "tool://double"]
        )
        project = listed["memory://project"]
        assert project.mime_type == "application/json" and project.name == "project"
        assert project.size == len('{"name":"x","n":1}')
        assert "18 bytes" in (project.description or "") and '"about":"demo"' in (project.description or "")
        assert listed[odd_uri].name == ODD_KEY
        assert listed["tool://double"].mime_type == "text/x-python"
        assert "Twice x." in (listed["tool://double"].description or "")

        mime, text = text_of(await client.read_resource("memory://project"))
        assert mime == "application/json" and json.loads(text) == {"name": "x", "n": 1}
        assert len(text.encode()) == project.size
        assert json.loads(text_of(await client.read_resource(odd_uri))[1]) == ["ü", 2]
        mime, source = text_of(await client.read_resource("tool://double"))
        assert mime == "text/x-python" and source.startswith("def double(x):") and '"""Twice x."""' in source

        # The list follows the store: a deletion in the sandbox is gone from it at once.
        await run_cell(client, 'delete_memory("project"); delete_tool("double")')
        uris = [str(r.uri) for r in (await client.list_resources()).resources]
        assert uris == [bridge.CAPABILITIES_URI, odd_uri]
        with pytest.raises(MCPError, match="No memory named 'project'"):
            await client.read_resource("memory://project")


async def test_an_unreadable_store_leaves_the_manual_and_the_saved_tools_listed(state_dir: Path) -> None:
    folder = state_dir / bridge.MEMORY_DIRNAME
    bridge.SavedTools(folder).save("triple", "def triple(x):\n    return 3 * x\n")
    junk = b"not a database" * 100
    (folder / bridge.MEMORY_FILENAME).write_bytes(junk)
    async with in_memory_client(state_dir) as client:
        uris = [str(r.uri) for r in (await client.list_resources()).resources]
        assert uris == [bridge.CAPABILITIES_URI, "tool://triple"]
        assert "return 3 * x" in text_of(await client.read_resource("tool://triple"))[1]
        error = await read_error(client, "memory://anything")
        assert error.code == types.INTERNAL_ERROR and "cannot be used" in error.message
    assert (folder / bridge.MEMORY_FILENAME).read_bytes() == junk


async def test_keys_that_differ_in_case_or_encoding_get_distinct_uris(state_dir: Path) -> None:
    keys = ["A", "a", "a b", "a%20b", "a/b", "a+b", "ü", "%", ".."]
    store = store_for(state_dir)
    for index, key in enumerate(keys):
        store.save(key, index)
    async with in_memory_client(state_dir) as client:
        listed = [r for r in (await client.list_resources()).resources if str(r.uri).startswith("memory://")]
        assert len({str(r.uri) for r in listed}) == len(keys)
        for resource in listed:
            value = json.loads(text_of(await client.read_resource(str(resource.uri)))[1])
            assert keys[value] == resource.name


async def test_resources_are_paged_with_a_cursor(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bridge, "RESOURCES_PAGE_SIZE", 2)
    store = store_for(state_dir)
    for index in range(5):
        store.save("k%d" % index, index)
    async with in_memory_client(state_dir) as client:
        uris: list[str] = []
        cursor: str | None = None
        for _ in range(10):
            page = await client.list_resources(cursor=cursor)
            assert len(page.resources) <= 2
            uris += [str(r.uri) for r in page.resources]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert uris == [bridge.CAPABILITIES_URI] + ["memory://k%d" % index for index in range(5)]
        with pytest.raises(MCPError, match="Invalid cursor"):
            await client.list_resources(cursor="not-a-cursor")


async def test_tool_resources_cannot_name_a_file_outside_the_folder(state_dir: Path) -> None:
    folder = state_dir / bridge.MEMORY_DIRNAME
    bridge.SavedTools(folder).save("ok", "def ok():\n    return 1\n")
    (state_dir / "secret.py").write_text("SECRET = 1\n")
    (folder / "not a tool.py").write_text("x = 1\n")
    async with in_memory_client(state_dir) as client:
        for uri in (
            "tool://../secret",
            "tool://..%2Fsecret",
            "tool:///etc/passwd",
            "tool://not a tool",
            "tool://",
        ):
            error = await read_error(client, uri)
            assert error.code == types.INVALID_PARAMS and "No saved tool named" in error.message, uri
        assert [str(r.uri) for r in (await client.list_resources()).resources] == [
            bridge.CAPABILITIES_URI,
            "tool://ok",
        ]


async def test_unknown_and_invalid_uris_are_invalid_params_with_a_hint(state_dir: Path) -> None:
    async with in_memory_client(state_dir) as client:
        unknown = await read_error(client, "file:///etc/passwd")
        assert unknown.code == types.INVALID_PARAMS and "resources/list shows" in unknown.message
        for uri in ("memory://", "memory://a%0Ab", "memory://%ff"):
            error = await read_error(client, uri)
            assert error.code == types.INVALID_PARAMS, (uri, error)
        missing = await read_error(client, "memory://absent")
        assert missing.code == types.INVALID_PARAMS and "No memory named 'absent'" in missing.message
    assert not (state_dir / bridge.MEMORY_DIRNAME).exists(), "reading must not create the store"


# --- issue 16: heavy listings, bad entries, escape sequences -----------------------------------


def big_tool(n: int) -> str:
    """A saved tool of about 240 KB (a long literal): slow to parse, within the caps."""
    return 'def big_%d():\n    """Big tool %d."""\n    return [%s]\n' % (
        n,
        n,
        ", ".join(["1234567"] * 26_000),
    )


async def test_many_large_saved_tools_list_right_repeatedly_and_in_parallel_without_parsing(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = bridge.SavedTools(state_dir / bridge.MEMORY_DIRNAME)
    for n in range(24):
        tools.save("big_%d" % n, big_tool(n))

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a listing parsed a saved tool that had not changed")

    monkeypatch.setattr("ast.parse", no_parse)  # what listing must not do on its hot path
    expected = [bridge.CAPABILITIES_URI, *sorted(bridge.tool_uri("big_%d" % n) for n in range(24))]
    answers: list[list[types.Resource]] = []
    async with in_memory_client(state_dir) as client:

        async def listing() -> None:
            for _ in range(3):
                answers.append((await client.list_resources()).resources)

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(listing)
    assert len(answers) == 24
    for resources in answers:
        assert [str(resource.uri) for resource in resources] == expected
        assert resources[1].description is not None and ": Big tool 0. File " in resources[1].description


async def test_one_saved_tool_that_cannot_be_parsed_leaves_the_rest_listed(state_dir: Path) -> None:
    folder = state_dir / bridge.MEMORY_DIRNAME
    bridge.SavedTools(folder).save("good", 'def good():\n    """Works."""\n    return 1\n')
    (folder / "chain.py").write_text("def chain():\n    return " + "+".join(["1"] * 2990) + "\n")
    async with in_memory_client(state_dir) as client:
        resources = {resource.name: resource for resource in (await client.list_resources()).resources}
    assert set(resources) == {"capabilities", "chain", "good"}
    assert "(cannot be parsed: RecursionError" in str(resources["chain"].description)
    assert "Works" in str(resources["good"].description)


async def test_resource_names_and_descriptions_carry_no_control_characters(state_dir: Path) -> None:
    folder = state_dir / bridge.MEMORY_DIRNAME
    bridge.SavedTools(folder).save(
        "sneaky", 'def sneaky():\n    """Fine.\x1b]0;owned\x07\x1b[2J\x9b31m"""\n    return 1\n'
    )
    store_for(state_dir).save("k", 1, metadata={"about": "\x1b]0;owned\x07\x9b\x7f"})
    async with in_memory_client(state_dir) as client:
        resources = (await client.list_resources()).resources
    shown = json.dumps([resource.model_dump(mode="json") for resource in resources], ensure_ascii=False)
    assert "Fine." in shown and "owned" in shown
    assert [char for char in shown if 0x7F <= ord(char) <= 0x9F or ord(char) < 32] == []
