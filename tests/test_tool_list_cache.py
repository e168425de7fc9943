"""Issue 21, item 5: no server is started just to be searched. Each server's tool list is
cached on the host (ToolListCache, STATE_DIR/cache/tool-lists.json) when it lists it
live; a later bridge's search uses the cached list instead of starting the server. The
cache survives a restart, is ignored when damaged or stale, is bounded, written
atomically and private, and never holds env values or headers. Real MCP servers over
stdio; no container."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import STUB_SERVER

pytestmark = pytest.mark.anyio

SECRET = "s3cret-token-value"  # in a server's env, a header and a URL: never in the file

# A real MCP server that notes each start of its process in $STARTS_FILE; its version is
# what $VERSION_FILE holds (an upgrade changes the program, not its entry), and from
# version 2 on it has one more tool.
ALMANAC = '''\
import os

from mcp.server.mcpserver import MCPServer

with open(os.environ["STARTS_FILE"], "a", encoding="utf-8") as starts:
    starts.write("started\\n")
with open(os.environ["VERSION_FILE"], encoding="utf-8") as installed:
    version = installed.read().strip()
server = MCPServer("almanac", version=version, instructions="Tides and moons of the coast.")


@server.tool()
def tide_times(harbour: str) -> str:
    """High and low tide times for a harbour."""
    return "high 06:10, low 12:25 at " + harbour


if version != "1.0":

    @server.tool()
    def moon_phase(date: str) -> str:
        """The phase of the moon on a date."""
        return "full"


server.run()
'''


class Almanac:
    """The almanac server's entry (``spec``) and how often its process was started."""

    def __init__(self, tmp_path: Path) -> None:
        self.script = tmp_path / "almanac_server.py"
        self.script.write_text(ALMANAC, encoding="utf-8")
        self.starts_file = tmp_path / "almanac-starts.txt"
        self.version_file = tmp_path / "almanac-version.txt"
        self.version_file.write_text("1.0", encoding="utf-8")

    def spec(self, version: str | None = None) -> bridge.ServerSpec:
        """Its entry; ``version``: install that version first (where the server reads it)."""
        if version is not None:
            self.version_file.write_text(version, encoding="utf-8")
        env = {
            "STARTS_FILE": str(self.starts_file),
            "VERSION_FILE": str(self.version_file),
            "ALMANAC_TOKEN": SECRET,
        }
        return bridge.ServerSpec("almanac", "almanac", "stdio", sys.executable, (str(self.script),), env=env)

    @property
    def starts(self) -> int:
        return len(self.starts_file.read_text().splitlines()) if self.starts_file.exists() else 0


@pytest.fixture
def almanac(tmp_path: Path) -> Almanac:
    return Almanac(tmp_path)


@asynccontextmanager
async def bridge_of(
    state_dir: Path, *specs: bridge.ServerSpec, **settings: Any
) -> AsyncIterator[bridge.SandboxAPI]:
    """One bridge's pool and sandbox API over ``specs``, as the server composes them; its
    servers are stopped at the end."""
    config = bridge.BridgeConfig(state_dir=state_dir, **settings)
    async with anyio.create_task_group() as group:
        pool = bridge.ClientPool(bridge.DiscoveryResult(tuple(specs), (), ()), config, group)
        try:
            yield bridge.SandboxAPI(pool, config)
        finally:
            await pool.aclose()


def cache_file(state_dir: Path) -> Path:
    return state_dir / bridge.TOOL_LISTS_PATH


def key_of(state_dir: Path, spec: bridge.ServerSpec) -> str:
    """``spec``'s key in the cache of ``state_dir`` (whose HMAC key is made if new)."""
    secret = bridge.tool_lists_secret(cache_file(state_dir).with_suffix(".key"))
    return bridge.server_program_key(spec, secret)


def cached_entry(state_dir: Path, spec: bridge.ServerSpec) -> dict[str, Any]:
    document = json.loads(cache_file(state_dir).read_bytes())
    assert document["format"] == bridge.TOOL_LISTS_FORMAT
    entry: dict[str, Any] = document["servers"][key_of(state_dir, spec)]
    bridge.CachedToolList.read_back(entry)  # what the bridge reads back: valid
    return entry


def tool_names(entry: dict[str, Any]) -> list[str]:
    return sorted(tool["name"] for tool in entry["tools"])


async def hits(api: bridge.SandboxAPI, query: str) -> list[str]:
    found: Any = await api.search_tool_docs(query, 5, "summary")
    return ["%s.%s" % (hit["server"], hit["tool"]) for hit in found["hits"]]


# --- the cache survives a restart ---------------------------------------------------------


async def test_a_new_bridge_searches_a_server_by_its_cached_tool_list_without_starting_it(
    almanac: Almanac, state_dir: Path
) -> None:
    spec = almanac.spec()
    async with bridge_of(state_dir, spec) as api:
        assert (await hits(api, "tide times for a harbour"))[0] == "almanac.tide_times"
        assert almanac.starts == 1  # the first bridge had to start it to list its tools
    entry = cached_entry(state_dir, spec)
    assert tool_names(entry) == ["tide_times"] and entry["name"] == "almanac"
    assert entry["serverInfo"] == {"name": "almanac", "version": "1.0"}
    assert entry["instructions"] == "Tides and moons of the coast."

    async with bridge_of(state_dir, spec) as api:  # a restart: a new bridge, the same state dir
        client = api.pool.client("almanac")
        assert (await hits(api, "tide times for a harbour"))[0] == "almanac.tide_times"
        # Its instructions were indexed from the cache too: "coast" is only there.
        assert (await hits(api, "coast"))[0] == "almanac.tide_times"
        assert almanac.starts == 1 and client.starts == 0 and not client.running
        # One tool list object while the entry stands: the search index is built once.
        listed = await client.cached_tools()
        assert listed is not None and await client.cached_tools() is listed
        indexed = await api._indexed_tools(client)
        assert await api._indexed_tools(client) is indexed

        # A call starts the server as ever; from then on its live list counts.
        result = await client.call_tool("tide_times", {"harbour": "Brest"})
        assert "Brest" in str(result.content) and almanac.starts == 2 and client.running
        assert await client.cached_tools() is None
        assert (await hits(api, "tide times for a harbour"))[0] == "almanac.tide_times"
        assert almanac.starts == 2


async def test_the_tool_policy_applies_to_cached_tool_lists(almanac: Almanac, state_dir: Path) -> None:
    spec = almanac.spec("2.0")
    async with bridge_of(state_dir, spec) as api:
        assert "almanac.moon_phase" in await hits(api, "phase of the moon")
    async with bridge_of(state_dir, spec, deny_tools=("almanac.moon_phase",)) as api:
        found = await hits(api, "phase of the moon")
        assert found == ["almanac.tide_times"] and almanac.starts == 1


async def test_a_tool_list_refreshed_after_list_changed_is_cached(state_dir: Path) -> None:
    spec = bridge.ServerSpec("stub", "stub", "stdio", sys.executable, (str(STUB_SERVER),))
    async with bridge_of(state_dir, spec) as api:
        client = api.pool.client("stub")
        await client.list_tools()
        assert "sprout" not in tool_names(cached_entry(state_dir, spec))
        await client.call_tool("grow", {"name": "sprout"})
        with anyio.fail_after(10):  # the server announced it with tools/list_changed
            while not client.tools_stale:
                await anyio.sleep(0.01)
        assert "sprout" in [tool.name for tool in await client.list_tools()]
        assert "sprout" in tool_names(cached_entry(state_dir, spec))
    async with bridge_of(state_dir, spec) as api:
        assert "stub.sprout" in await hits(api, "sprout")
        assert api.pool.client("stub").starts == 0


async def test_a_changed_server_version_replaces_its_cached_entry(almanac: Almanac, state_dir: Path) -> None:
    async with bridge_of(state_dir, almanac.spec("1.0")) as api:
        await hits(api, "tides")
    assert cached_entry(state_dir, almanac.spec())["serverInfo"]["version"] == "1.0"
    # The same program (its command and arguments), upgraded: the cached list stands
    # until the server runs; its live list, of its new version, then replaces it.
    async with bridge_of(state_dir, almanac.spec("2.0")) as api:
        assert "almanac.moon_phase" not in await hits(api, "phase of the moon")
        assert almanac.starts == 1
        await api.pool.client("almanac").call_tool("tide_times", {"harbour": "Cork"})
    entry = cached_entry(state_dir, almanac.spec())
    assert entry["serverInfo"]["version"] == "2.0" and tool_names(entry) == ["moon_phase", "tide_times"]
    async with bridge_of(state_dir, almanac.spec("2.0")) as api:
        assert (await hits(api, "phase of the moon"))[0] == "almanac.moon_phase"
        assert almanac.starts == 2


# --- a damaged or stale cache is ignored, then rewritten ------------------------------------


def a_bad_tool(almanac: Almanac, state_dir: Path) -> bytes:
    """A well-formed file whose entry for the almanac has a tool the SDK refuses (no
    inputSchema), beside another server's good entry."""
    tools = [types.Tool(name="ping", input_schema={"type": "object"})]
    good = bridge.CachedToolList.listed(good_spec(), initialized("other"), tools, time.time())
    bad = {
        "name": "almanac",
        "saved": time.time(),
        "serverInfo": {"name": "almanac", "version": "1.0"},
        "instructions": None,
        "tools": [{"name": "poisoned", "description": "no inputSchema"}],
    }
    servers = {
        key_of(state_dir, almanac.spec()): bad,
        key_of(state_dir, good_spec()): good.entry,
    }
    return json.dumps({"format": bridge.TOOL_LISTS_FORMAT, "servers": servers}).encode()


def good_spec() -> bridge.ServerSpec:
    return bridge.ServerSpec("other", "other", "stdio", "other-server")


DAMAGE = {
    "garbage bytes": lambda almanac, state_dir: b'\x00\xff\xfe{"format": 2, "serv',
    "JSON of the wrong shape": lambda almanac, state_dir: b'{"format": 2, "servers": [["almanac", {}]]}',
    "another format": lambda almanac, state_dir: b'{"format": 99, "servers": {}}',
    "a tool that fails validation": a_bad_tool,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_damaged_cache_is_ignored_the_server_started_and_the_file_rewritten(
    almanac: Almanac, state_dir: Path, damage: str
) -> None:
    path = cache_file(state_dir)
    path.parent.mkdir(parents=True)
    path.write_bytes(DAMAGE[damage](almanac, state_dir))
    spec = almanac.spec()
    async with bridge_of(state_dir, spec) as api:
        assert (await hits(api, "tide times for a harbour"))[0] == "almanac.tide_times"
        assert "almanac.poisoned" not in await hits(api, "poisoned")
        assert almanac.starts == 1 and api.pool.client("almanac").starts == 1
    assert tool_names(cached_entry(state_dir, spec)) == ["tide_times"]  # rewritten, valid
    if damage == "a tool that fails validation":  # only that entry was ignored
        assert tool_names(cached_entry(state_dir, good_spec())) == ["ping"]


@pytest.mark.parametrize(
    "age", [bridge.TOOL_LIST_MAX_AGE + 3600, -86400.0], ids=["8 days old", "from the future"]
)
async def test_a_stale_cache_entry_is_ignored(almanac: Almanac, state_dir: Path, age: float) -> None:
    spec = almanac.spec()
    async with bridge_of(state_dir, spec) as api:
        await hits(api, "tides")
    path = cache_file(state_dir)
    document = json.loads(path.read_bytes())
    document["servers"][key_of(state_dir, spec)]["saved"] = time.time() - age
    path.write_text(json.dumps(document))
    async with bridge_of(state_dir, spec) as api:
        assert (await hits(api, "tide times for a harbour"))[0] == "almanac.tide_times"
        assert almanac.starts == 2  # started again to list its tools
    assert abs(cached_entry(state_dir, spec)["saved"] - time.time()) < 600  # saved afresh


# --- the bounds, the file's mode, no secrets -----------------------------------------------


def initialized(name: str, version: str = "1") -> types.InitializeResult:
    return types.InitializeResult(
        protocol_version=types.LATEST_PROTOCOL_VERSION,
        capabilities=types.ServerCapabilities(),
        server_info=types.Implementation(name=name, version=version),
    )


def some_tools(description: str = "Does a thing.") -> list[types.Tool]:
    return [types.Tool(name="do_thing", description=description, input_schema={"type": "object"})]


def numbered_spec(number: int) -> bridge.ServerSpec:
    if number % 2:  # an HTTP server: its headers and the token in its URL stay out of the file
        url, headers = "https://mcp.example.com/%d?key=%s" % (number, SECRET), {"Authorization": SECRET}
        return bridge.ServerSpec("web%d" % number, "web%d" % number, "http", url=url, headers=headers)
    name = "local%d" % number
    return bridge.ServerSpec(name, name, "stdio", "server-%d" % number, ("--fast",), env={"TOKEN": SECRET})


async def test_the_cache_is_bounded_private_atomic_and_holds_no_secrets(state_dir: Path) -> None:
    path = cache_file(state_dir)
    cache = bridge.ToolListCache(path)
    specs = [numbered_spec(number) for number in range(bridge.MAX_CACHED_SERVERS + 6)]
    for spec in specs:  # one after the other: the first six are the least recently saved
        await cache.save(spec, initialized(spec.name), some_tools())
    data = path.read_bytes()
    servers = json.loads(data)["servers"]
    assert len(servers) == bridge.MAX_CACHED_SERVERS
    assert set(servers) == {key_of(state_dir, spec) for spec in specs[6:]}
    assert SECRET.encode() not in data and b"example.com" not in data
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.with_suffix(".key")).st_mode) == 0o600
    files = sorted([path.name, path.with_suffix(".key").name])
    assert sorted(os.listdir(path.parent)) == files  # no temporary file left behind

    # Saves made at the same time in one bridge are all kept (written together).
    again = bridge.ToolListCache(path)
    async with anyio.create_task_group() as group:
        for spec in specs[:10]:
            group.start_soon(again.save, spec, initialized(spec.name, "2"), some_tools())
    servers = json.loads(path.read_bytes())["servers"]
    assert all(servers[key_of(state_dir, spec)]["serverInfo"]["version"] == "2" for spec in specs[:10])
    assert len(servers) == bridge.MAX_CACHED_SERVERS and sorted(os.listdir(path.parent)) == files
    assert (await bridge.ToolListCache(path).get(specs[0])) is not None  # a new bridge reads them

    # One program set up two ways (another token, another toolset) is two servers.
    other = numbered_spec(0)
    other = bridge.ServerSpec(
        other.name, other.alias, "stdio", other.command, other.args, env={"TOKEN": "other"}
    )
    assert key_of(state_dir, other) != key_of(state_dir, numbered_spec(0))
    await again.save(other, initialized("other", "9"), some_tools())
    assert (await bridge.ToolListCache(path).get(numbered_spec(0))).server_info.version == "2"  # type: ignore[union-attr]


async def test_a_principals_own_login_caches_its_tool_list_for_that_principal_alone(state_dir: Path) -> None:
    """On a shared bridge, what a server lists to alice's own login (account-specific tools)
    is never what a search of bob's, or of the shared connection, reads from the cache."""
    path = cache_file(state_dir)
    spec = numbered_spec(1)  # an HTTP server
    config = bridge.BridgeConfig(state_dir=state_dir)
    alices = ["alice_private_board"]
    async with anyio.create_task_group() as group:
        alice = bridge.PooledClient(spec, config, group, bridge.ToolListCache(path), principal="alice")
        alice.initialized = initialized(spec.name)
        alice.tools = [types.Tool(name=name, input_schema={"type": "object"}) for name in alices]
        await alice._cache_tools()  # as after alice's own tools/list

        later = bridge.ToolListCache(path)  # a new bridge on the same state dir
        bob = bridge.PooledClient(spec, config, group, later, principal="bob")
        shared = bridge.PooledClient(spec, config, group, later)
        again = bridge.PooledClient(spec, config, group, later, principal="alice")
        assert await bob.cached_tools() is None
        assert await shared.cached_tools() is None
        found = await again.cached_tools()
        assert found is not None and [tool.name for tool in found.tools] == alices

        # A file of format 1 (before this) kept such a list under the shared key: ignored.
        before = bridge.PooledClient(spec, config, group, bridge.ToolListCache(path))
        before.initialized, before.tools = alice.initialized, alice.tools
        await before._cache_tools()
        assert await bridge.PooledClient(spec, config, group, bridge.ToolListCache(path)).cached_tools()
        document = json.loads(path.read_bytes())
        path.write_text(json.dumps({**document, "format": 1}), encoding="utf-8")
        upgraded = bridge.PooledClient(spec, config, group, bridge.ToolListCache(path))
        assert await upgraded.cached_tools() is None
        group.cancel_scope.cancel()


async def test_the_cache_keeps_no_list_over_its_byte_caps(state_dir: Path) -> None:
    path = cache_file(state_dir)
    cache = bridge.ToolListCache(path)
    specs = [numbered_spec(number * 2) for number in range(6)]
    big = "x" * (bridge.MAX_CACHED_LIST_BYTES * 9 // 10)  # four such lists fit in the file, not five
    for spec in specs[:5]:
        await cache.save(spec, initialized(spec.name), some_tools(big))
    assert path.stat().st_size <= bridge.MAX_TOOL_LISTS_BYTES
    kept = set(json.loads(path.read_bytes())["servers"])
    assert kept == {key_of(state_dir, spec) for spec in specs[1:5]}
    # A list over MAX_CACHED_LIST_BYTES is not cached, and the server's older entry goes.
    await cache.save(specs[4], initialized(specs[4].name), some_tools(big + "x" * (len(big) // 5)))
    kept = set(json.loads(path.read_bytes())["servers"])
    assert kept == {key_of(state_dir, spec) for spec in specs[1:4]}
    assert await bridge.ToolListCache(path).get(specs[4]) is None


async def test_bridges_sharing_a_state_dir_never_see_a_torn_file(state_dir: Path) -> None:
    """Two bridges (two caches on one file) writing at once may lose each other's update,
    but every read finds a whole file."""
    path = cache_file(state_dir)
    first, second = bridge.ToolListCache(path), bridge.ToolListCache(path)
    torn: list[str] = []

    async def write(cache: bridge.ToolListCache, numbers: range) -> None:
        for number in numbers:
            spec = numbered_spec(number)
            await cache.save(spec, initialized(spec.name), some_tools("y" * 50_000))

    async def read() -> None:
        for _ in range(200):
            if path.exists():
                try:
                    json.loads(path.read_bytes())
                except ValueError as exc:
                    torn.append(str(exc))
            await anyio.sleep(0)

    async with anyio.create_task_group() as group:
        group.start_soon(write, first, range(0, 20))
        group.start_soon(write, second, range(20, 40))
        group.start_soon(read)
    assert not torn
    assert json.loads(path.read_bytes())["servers"]  # whichever wrote last: its entries
    assert sorted(os.listdir(path.parent)) == sorted([path.name, path.with_suffix(".key").name])
