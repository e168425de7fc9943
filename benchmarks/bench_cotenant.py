"""Co-tenants of one HTTP bridge: what principal A's attacks cost principal B.

Starts the installed console script once with `--transport http` and a token file of two
principals, alice (the attacker) and bob (the victim), on a free loopback port, with no
MCP server configured. Bob is the MCP SDK's own streamable HTTP client; during every
case a task makes `ping` and `run_python("1")` calls as bob, one after the other, every
--interval seconds, and records their latency. The cases, each --seconds long:

- no attack: bob's floor, measured in this same run;
- MCP session flood: alice sends `initialize` requests from --flood-workers tasks at once
  (raw HTTP POSTs, never closing a session), as fast as the bridge answers;
- slowloris: --slow-connections raw sockets send a request line and then one header line
  per second, never finishing their request (no token needed); a fresh bob client also
  tries to connect in the middle of the case;
- heavy listings: alice has --tools saved tools of --tool-kb KB each (saved with
  save_tool before the case) and --listers tasks call resources/list in a loop.

The table gives, per case, bob's ping and run_python latency (p50, p99, max; nearest
rank), their p50 as a ratio to the no-attack floor, bob's failed calls, and what the
attacker got (answers by HTTP status, connections closed by the bridge, listing time).
The bridge runs with its default limits. It is a measurement, not a test: it always exits
0 (problems are listed under the table). Usage:

    .venv/bin/python benchmarks/bench_cotenant.py [--runtime podman] [--image IMG] [--seconds 8]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
from bench_core import (
    TOOL_NAME,
    add_runtime_and_image,
    isolated_bridge_env,
    percentile,
    server_command,
)
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from mcp_server_code_execution_mode import BridgeConfig
from tests.harness import text_of  # on the path once bench_core is imported

ALICE = "alice-bench-token-" + "a" * 24
BOB = "bob-bench-token-" + "b" * 24
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "flood", "version": "1"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
CELL_TIMEOUT_S = 60.0
UNANSWERED_MS = 1000.0  # a call the end of a case cut short counts as failed after this long
REQUEST_TIMEOUT_S = BridgeConfig().http_request_timeout  # the bridge runs with its defaults


@dataclass
class Latencies:
    pings: list[float] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Case:
    name: str
    bob: Latencies
    attacker: str


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@asynccontextmanager
async def client(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": "Bearer " + token}, timeout=httpx2.Timeout(30, read=300)
        ) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def run_python(session: ClientSession, code: str) -> str:
    result = await session.call_tool(TOOL_NAME, {"code": code, "timeout": CELL_TIMEOUT_S})
    if result.is_error:
        raise RuntimeError(text_of(result)[:300])
    return text_of(result)


async def sample_bob(bob: ClientSession, interval: float, out: Latencies) -> None:
    """Bob's ping and run_python("1"), one after the other, until cancelled."""
    while True:
        for kind, call in (("ping", bob.send_ping), ("run_python", lambda: run_python(bob, "1"))):
            start = time.perf_counter()
            try:
                with anyio.fail_after(CELL_TIMEOUT_S):
                    await call()
            except anyio.get_cancelled_exc_class():  # the case ended with this call unanswered
                if ms(start) >= UNANSWERED_MS:  # not one the end merely cut short
                    out.errors.append("%s: no answer by the end of the case (%.0f ms)" % (kind, ms(start)))
                raise
            except Exception as exc:  # a failed call of bob's is what this measures
                out.errors.append("%s: %s" % (kind, str(exc)[:120] or type(exc).__name__))
            else:
                (out.pings if kind == "ping" else out.runs).append(ms(start))
        await anyio.sleep(interval)


async def during(
    bob: ClientSession,
    seconds: float,
    interval: float,
    attack: Callable[[], Coroutine[Any, Any, None]] | None,
) -> Latencies:
    out = Latencies()
    async with anyio.create_task_group() as group:
        group.start_soon(sample_bob, bob, interval, out)
        if attack is not None:
            group.start_soon(attack)
        await anyio.sleep(seconds)
        group.cancel_scope.cancel()
    return out


async def session_flood(url: str, workers: int, statuses: Counter[str]) -> None:
    async def worker(http: httpx2.AsyncClient) -> None:
        while True:
            try:
                answer = await http.post(
                    url, json=INITIALIZE, headers={**ACCEPT, "Authorization": "Bearer " + ALICE}
                )
                statuses[str(answer.status_code)] += 1
            except httpx2.HTTPError as exc:
                statuses[type(exc).__name__] += 1

    async with httpx2.AsyncClient(timeout=10) as http, anyio.create_task_group() as group:
        for _ in range(workers):
            group.start_soon(worker, http)


async def slowloris(port: int, count: int, closed: list[int], opened: list[int]) -> None:
    streams: list[anyio.abc.SocketStream] = []
    try:
        for _ in range(count):
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
                await stream.send(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                streams.append(stream)
                opened[0] += 1
            except OSError:
                break
        while True:
            await anyio.sleep(1)
            for stream in list(streams):
                try:
                    await stream.send(b"X-Slow: 1\r\n")
                    with anyio.move_on_after(0.001):
                        await stream.receive()  # an answer (408, 503) or the end: closed
                        raise anyio.EndOfStream
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    streams.remove(stream)
                    closed[0] += 1
                    await stream.aclose()
    finally:
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()


async def fresh_client_result(url: str, delay: float, out: list[str]) -> None:
    await anyio.sleep(delay)
    start = time.perf_counter()
    try:
        with anyio.fail_after(20):
            async with client(url, BOB) as fresh:
                await fresh.send_ping()
        out.append("connected in %.0f ms" % ms(start))
    except BaseException as exc:  # an ExceptionGroup of the SDK's client, or the timeout
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            raise
        out.append("refused after %.0f ms (%s)" % (ms(start), type(exc).__name__))


BIG_TOOL = '''
def {name}():
    """Saved by bench_cotenant: a large tool, {size} bytes."""
{body}    return v0
'''


def big_tool_source(name: str, kilobytes: int) -> str:
    lines, size, index = [], 0, 0
    while size < kilobytes * 1024:
        line = "    v%d = %d + 1\n" % (index, index)
        lines.append(line)
        size += len(line)
        index += 1
    return BIG_TOOL.format(name=name, size=size, body="".join(lines))


async def save_big_tools(alice: ClientSession, tools: int, kilobytes: int) -> None:
    for number in range(tools):
        name = "big_%d" % number
        await run_python(alice, big_tool_source(name, kilobytes) + "\nsave_tool(%s)\nNone" % name)


async def heavy_listings(alice: ClientSession, listers: int, times: list[float], errors: list[str]) -> None:
    async def lister() -> None:
        while True:
            start = time.perf_counter()
            try:
                await alice.list_resources()
                times.append(ms(start))
            except Exception as exc:
                errors.append(str(exc)[:120])

    async with anyio.create_task_group() as group:
        for _ in range(listers):
            group.start_soon(lister)


@asynccontextmanager
async def bridge(
    runtime: str, image: str, root: Path
) -> AsyncIterator[tuple[str, int, subprocess.Popen[bytes]]]:
    tokens = root / "tokens"
    tokens.write_text("%s alice\n%s bob\n" % (ALICE, BOB))
    tokens.chmod(0o600)
    env = isolated_bridge_env(
        runtime, image, root, {}, {"MCP_BRIDGE_AUTH_TOKENS": str(tokens), "MCP_BRIDGE_PREWARM": "0"}
    )
    port = free_port()
    log = (root / "bridge.log").open("wb")
    process = subprocess.Popen(  # noqa: ASYNC220 (started once, returns at once)
        [server_command(), "--transport", "http", "--port", str(port)],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=log,
    )
    base = "http://127.0.0.1:%d" % port
    try:
        with anyio.fail_after(30):
            async with httpx2.AsyncClient() as http:
                while True:
                    if process.poll() is not None:
                        raise SystemExit("the bridge exited: " + (root / "bridge.log").read_text())
                    try:
                        if (await http.get(base + "/health", timeout=2)).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await anyio.sleep(0.1)
        yield base, port, process
    finally:
        process.terminate()
        try:
            await anyio.to_thread.run_sync(lambda: process.wait(30))
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


async def health(base: str) -> dict[str, Any]:
    async with httpx2.AsyncClient(timeout=5) as http:
        data: dict[str, Any] = (await http.get(base + "/health")).json()
        return data


async def bench(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="bench-cotenant-") as tmp:
        async with bridge(args.runtime, args.image, Path(tmp)) as (base, port, _):
            url = base + "/mcp"
            async with client(url, BOB) as bob, client(url, ALICE) as alice:
                await run_python(bob, "1")  # both sandboxes up before anything is timed
                await run_python(alice, "1")
                print("measuring: no attack ...", file=sys.stderr, flush=True)
                cases.append(
                    Case("no attack (floor)", await during(bob, args.seconds, args.interval, None), "")
                )

                print("measuring: MCP session flood ...", file=sys.stderr, flush=True)
                statuses: Counter[str] = Counter()
                flood = await during(
                    bob, args.seconds, args.interval, lambda: session_flood(url, args.flood_workers, statuses)
                )
                after = await health(base)
                cases.append(
                    Case(
                        "MCP session flood",
                        flood,
                        "initialize answers %s; /health mcp_sessions %s"
                        % (
                            ", ".join("%s x%d" % item for item in sorted(statuses.items())),
                            after.get("mcp_sessions"),
                        ),
                    )
                )

                print("measuring: slowloris ...", file=sys.stderr, flush=True)
                closed, opened, fresh = [0], [0], list[str]()

                async def slow_attack() -> None:
                    async with anyio.create_task_group() as group:
                        group.start_soon(slowloris, port, args.slow_connections, closed, opened)
                        group.start_soon(fresh_client_result, url, args.seconds / 2, fresh)

                # Long enough for the bridge's request timeout to close every slow connection.
                slow_seconds = max(args.seconds, REQUEST_TIMEOUT_S + 3)
                slow = await during(bob, slow_seconds, args.interval, slow_attack)
                cases.append(
                    Case(
                        "slowloris",
                        slow,
                        "%d slow connections opened, %d closed by the bridge within %gs; a fresh client: %s"
                        % (opened[0], closed[0], slow_seconds, fresh[0] if fresh else "no answer"),
                    )
                )

                print(
                    "measuring: heavy listings (saving %d tools) ..." % args.tools,
                    file=sys.stderr,
                    flush=True,
                )
                await save_big_tools(alice, args.tools, args.tool_kb)
                times: list[float] = []
                errors: list[str] = []
                listed = await during(
                    bob,
                    args.seconds,
                    args.interval,
                    lambda: heavy_listings(alice, args.listers, times, errors),
                )
                cases.append(
                    Case(
                        "heavy listings",
                        listed,
                        "%d resources/list of %d tools x %d KB by %d tasks: p50 %s ms, max %s ms, %d failed"
                        % (
                            len(times),
                            args.tools,
                            args.tool_kb,
                            args.listers,
                            "%.0f" % percentile(times, 0.5) if times else "-",
                            "%.0f" % max(times) if times else "-",
                            len(errors),
                        ),
                    )
                )
    return cases


def render(cases: list[Case]) -> str:
    floor = cases[0].bob
    header = [
        "case",
        "ping p50",
        "p99",
        "max",
        "x floor",
        "run_python p50",
        "p99",
        "max",
        "x floor",
        "bob failed",
    ]
    rows = [header]
    for case in cases:
        line = [case.name]
        for samples, base in ((case.bob.pings, floor.pings), (case.bob.runs, floor.runs)):
            if samples:
                p50 = percentile(samples, 0.5)
                line += ["%.1f" % p50, "%.1f" % percentile(samples, 0.99), "%.1f" % max(samples)]
                line.append("%.2f" % (p50 / percentile(base, 0.5)) if base else "-")
            else:
                line += ["-", "-", "-", "-"]
        line.append(
            "%d of %d"
            % (len(case.bob.errors), len(case.bob.errors) + len(case.bob.pings) + len(case.bob.runs))
        )
        rows.append(line)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    table = [fmt(rows[0]), "  ".join("-" * w for w in widths), *(fmt(row) for row in rows[1:])]
    notes = ["", "latencies in ms, bob's calls from his one SDK client session; attacker:"]
    notes += ["- %s: %s" % (case.name, case.attacker) for case in cases if case.attacker]
    return "\n".join(table + notes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_runtime_and_image(parser)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each case (default 8)")
    parser.add_argument(
        "--interval", type=float, default=0.1, help="bob's pause between samples (default 0.1 s)"
    )
    parser.add_argument("--flood-workers", type=int, default=16, help="alice's concurrent initialize senders")
    parser.add_argument("--slow-connections", type=int, default=300, help="slowloris sockets (default 300)")
    parser.add_argument(
        "--tools", type=int, default=40, help="alice's saved tools for the listings (default 40)"
    )
    parser.add_argument("--tool-kb", type=int, default=200, help="size of each saved tool, KB (default 200)")
    parser.add_argument("--listers", type=int, default=4, help="alice's concurrent resources/list tasks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems: list[str] = []
    try:
        cases = anyio.run(bench, args)
    except Exception as exc:  # a measurement: say what broke, exit 0
        problems.append("%s: %s" % (type(exc).__name__, exc))
        cases = []
    if cases:
        print("runtime: %s   image: %s   %g s per case" % (args.runtime, args.image, args.seconds))
        print(render(cases))
        problems += ["%s: bob's %s" % (case.name, error) for case in cases for error in case.bob.errors[:3]]
    if problems:
        print("\nproblems:")
        for problem in problems:
            print("- " + textwrap.shorten(problem, 300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
