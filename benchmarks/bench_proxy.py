"""Proxy benchmark: the user's MCP servers called from the sandbox versus called directly.

Starts the installed console script through the MCP SDK's stdio client with exactly one
configured MCP server, @modelcontextprotocol/server-everything (MCP_SERVERS_CONFIG points
at a temporary JSON file; HOME is an empty temporary directory so no client config of
this machine is picked up), and compares it with a direct stdio ClientSession from this
process to the same server executable:

* round trip: N sequential ``mcp_everything.echo(message="x")`` calls in plain (sync)
  code inside ONE run_python call, each timed with time.perf_counter() in the sandbox,
  against N sequential ``call_tool("echo", ...)`` on the direct session; p50/p95 of both
  and the proxy overhead (proxied minus direct);
* throughput with 32 calls in flight: R batches of
  ``await asyncio.gather(*[mcp_everything.echo(message=str(i)) for i in range(32)])`` in
  one run_python call, against R batches of 32 concurrent call_tool on the direct
  session (an anyio task group); calls per second and the p50 batch time;
* doc size: the tools as Python signatures (``runtime.query_tool_docs("everything")``)
  versus the tools as tools/list gives them (name, description, inputSchema,
  outputSchema as JSON), counted with anthropic_tokenizer's local (offline) tokenizer.

It is a measurement, not a test: it always exits 0 (problems are listed under the table).
Usage:

    .venv/bin/python benchmarks/bench_proxy.py [--runtime podman] [--calls 200] [--batches 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from anthropic_tokenizer import count_tokens  # Rust-native local tokenizer: no network.
from bench_core import (  # the sibling benchmark: same conventions, same helpers
    TOOL_NAME,
    add_runtime_and_image,
    captured_stderr,
    compact_json,
    isolated_bridge_env,
    ms_since,
    percentile,
    server_command,
    tail_of,
)
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from mcp_server_code_execution_mode import list_all_tools
from tests.harness import text_of  # on the path once bench_core is imported

REPO = Path(__file__).resolve().parent.parent
EVERYTHING = REPO / ".cache" / "mcp-servers" / "node_modules" / ".bin" / "mcp-server-everything"
ALIAS = "everything"  # the server's name in the config: mcp_everything in the sandbox
ECHO = "echo"
MIN_CALLS = 50
DEFAULT_CALLS = 200
DEFAULT_BATCHES = 20
IN_FLIGHT = 32
WARMUP_CALLS = 20  # per path, before anything is timed (server start, caches, JIT of node)
SECTION_DEADLINE_S = 600.0  # per measured path: bridge start + sandbox start + all cells
DEFAULT_CELL_TIMEOUT_S = 120.0  # run_python's default MCP_BRIDGE_MAX_TIMEOUT
SCHEMA_KEYS = ("name", "description", "inputSchema", "outputSchema")

# Code run in the sandbox. Each cell's final expression is json.dumps(...) of its
# measurements: run_python returns that string as structuredContent["value"] (JSON data).
WARMUP_CELL = """
import json
_bench_first = mcp_{alias}.{tool}(message="warm")
for _ in range({warmup}):
    mcp_{alias}.{tool}(message="warm")
json.dumps(repr(_bench_first))
"""

DOCS_CELL = """
import json
from mcp import runtime
json.dumps({{
    "summary": runtime.query_tool_docs("{alias}"),
    "full": runtime.query_tool_docs("{alias}", detail="full"),
}})
"""

# Plain code (no await anywhere in the cell), so every call is a blocking sync call.
# Then the same number of runtime.discovered_servers() requests: answered by the bridge
# itself, so they time the sandbox <-> bridge channel without any MCP server.
SEQUENTIAL_CELL = """
import json, time
from mcp import runtime
_bench_ms = []
for _ in range({calls}):
    _bench_t = time.perf_counter()
    _bench_last = mcp_{alias}.{tool}(message="x")
    _bench_ms.append((time.perf_counter() - _bench_t) * 1000.0)
_bench_host_ms = []
for _ in range({calls}):
    _bench_t = time.perf_counter()
    runtime.discovered_servers()
    _bench_host_ms.append((time.perf_counter() - _bench_t) * 1000.0)
json.dumps({{"ms": _bench_ms, "host_ms": _bench_host_ms, "last": repr(_bench_last)}})
"""

# Code that uses await: tool calls are awaitables, gathered IN_FLIGHT at a time.
BATCH_CELL = """
import asyncio, json, time
async def _bench_batch():
    return await asyncio.gather(*[mcp_{alias}.{tool}(message=str(i)) for i in range({in_flight})])
await _bench_batch()  # warm-up batch, not timed
_bench_ms, _bench_wrong = [], 0
for _ in range({batches}):
    _bench_t = time.perf_counter()
    _bench_results = await _bench_batch()
    _bench_ms.append((time.perf_counter() - _bench_t) * 1000.0)
    _bench_wrong += sum(str(i) not in str(r) for i, r in enumerate(_bench_results))
json.dumps({{"ms": _bench_ms, "wrong": _bench_wrong, "last": repr(_bench_results[-1])}})
"""


@dataclass
class Row:
    metric: str
    value: str
    unit: str
    note: str = ""


@dataclass
class Samples:
    """What one path (proxied or direct) measured; None where that step failed."""

    sequential_ms: list[float] | None = None
    batch_ms: list[float] | None = None
    bridge_only_ms: list[float] | None = None  # proxied only: requests the bridge answers itself


@dataclass
class Measurements:
    proxied: Samples = field(default_factory=Samples)
    direct: Samples = field(default_factory=Samples)
    summary_docs: list[dict[str, Any]] | None = None
    full_docs: list[dict[str, Any]] | None = None
    tools: list[types.Tool] | None = None
    problems: list[str] = field(default_factory=list)


class CellError(Exception):
    """run_python answered, but the cell did not produce the expected value."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if isinstance(exc, TimeoutError):
        return "no answer within %g s (TimeoutError)" % SECTION_DEADLINE_S
    return "%s: %s" % (type(exc).__name__, exc)


# --- the proxied path: run_python cells ---------------------------------------------


def bridge_env(runtime: str, image: str, root: Path, cell_timeout: float) -> dict[str, str]:
    """An isolated bridge with server-everything as its one server."""
    servers = {ALIAS: {"command": str(EVERYTHING)}}
    max_timeout = "%g" % max(cell_timeout, DEFAULT_CELL_TIMEOUT_S)
    return isolated_bridge_env(runtime, image, root, servers, {"MCP_BRIDGE_MAX_TIMEOUT": max_timeout})


async def run_cell(session: ClientSession, template: str, cell_timeout: float, **fields: Any) -> Any:
    """Run one cell whose final expression is json.dumps(...); return the decoded JSON."""
    code = textwrap.dedent(template).format(alias=ALIAS, tool=ECHO, **fields)
    result = await session.call_tool(TOOL_NAME, {"code": code, "timeout": cell_timeout})
    if not isinstance(result, types.CallToolResult):
        raise CellError("run_python returned %s, not a CallToolResult" % type(result).__name__)
    if result.is_error:
        raise CellError("run_python reported an error: %s" % text_of(result)[:1500])
    structured = result.structured_content
    value = structured.get("value") if isinstance(structured, dict) else None
    if not isinstance(value, str):
        raise CellError("no structuredContent value in the result: %s" % text_of(result)[:500])
    try:
        return json.loads(value)  # the json.dumps string, as JSON data in structuredContent
    except (ValueError, SyntaxError, TypeError) as exc:
        raise CellError(
            "the cell's value is not a JSON string (%s; truncated: %s): %s..."
            % (exc, structured.get("truncated") if isinstance(structured, dict) else None, value[:300])
        ) from None


def float_list(value: Any, what: str) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(item, int | float) for item in value):
        raise CellError(("%s: expected a list of numbers, got %r" % (what, value))[:500])
    return [float(item) for item in value]


def doc_list(value: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise CellError(("%s: expected a list of doc dicts, got %r" % (what, value))[:500])
    return value


async def measure_proxied(
    out: Measurements, runtime: str, image: str, calls: int, batches: int, cell_timeout: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp, captured_stderr() as errlog:
        params = StdioServerParameters(
            command=server_command(), env=bridge_env(runtime, image, Path(tmp), cell_timeout)
        )
        try:
            with anyio.fail_after(SECTION_DEADLINE_S):
                async with (
                    stdio_client(params, errlog=errlog) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    await _proxied_cells(out, session, calls, batches, cell_timeout)
        except Exception as exc:  # report and go on: this is a measurement, not a test
            out.problems.append("proxied (run_python): %s%s" % (describe(exc), tail_of(errlog)))


async def _proxied_cells(
    out: Measurements, session: ClientSession, calls: int, batches: int, cell_timeout: float
) -> None:
    # Starts the sandbox and server-everything, and warms the call path up.
    first = await run_cell(session, WARMUP_CELL, cell_timeout, warmup=WARMUP_CALLS)
    print("  proxied warm-up ok (echo gave %s)" % first, file=sys.stderr, flush=True)
    try:
        docs = await run_cell(session, DOCS_CELL, cell_timeout)
        out.summary_docs = doc_list(docs.get("summary"), "query_tool_docs summary")
        out.full_docs = doc_list(docs.get("full"), "query_tool_docs full")
    except (CellError, AttributeError) as exc:
        out.problems.append("proxied query_tool_docs: %s" % exc)
    try:
        sequential = await run_cell(session, SEQUENTIAL_CELL, cell_timeout, calls=calls)
        out.proxied.sequential_ms = float_list(sequential.get("ms"), "sequential")
        out.proxied.bridge_only_ms = float_list(sequential.get("host_ms"), "discovered_servers")
        if "'Echo: x'" not in str(sequential.get("last")):
            out.problems.append("proxied echo returned %s, expected 'Echo: x'" % sequential.get("last"))
    except (CellError, AttributeError) as exc:
        out.problems.append("proxied sequential calls: %s" % exc)
    try:
        batch = await run_cell(session, BATCH_CELL, cell_timeout, batches=batches, in_flight=IN_FLIGHT)
        out.proxied.batch_ms = float_list(batch.get("ms"), "batches")
        if batch.get("wrong"):
            out.problems.append("proxied batches: %s results did not echo their message" % batch["wrong"])
    except (CellError, AttributeError) as exc:
        out.problems.append("proxied batches: %s" % exc)


# --- the direct path: this process's own ClientSession -------------------------------


def check_echo(result: types.CallToolResult, message: str) -> None:
    if not isinstance(result, types.CallToolResult) or result.is_error:
        raise CellError("direct echo failed: %r" % (result,))
    if message not in text_of(result):
        raise CellError("direct echo(%r) returned %r" % (message, text_of(result)))


async def echo(session: ClientSession, message: str) -> None:
    check_echo(await session.call_tool(ECHO, {"message": message}), message)


async def direct_batch(session: ClientSession) -> float:
    """IN_FLIGHT concurrent echo calls; returns the time until the last one answered, ms."""
    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for i in range(IN_FLIGHT):
            group.start_soon(echo, session, str(i))
    return ms_since(start)


async def measure_direct(out: Measurements, calls: int, batches: int) -> None:
    params = StdioServerParameters(command=str(EVERYTHING))
    with captured_stderr() as errlog:
        try:
            with anyio.fail_after(SECTION_DEADLINE_S):
                async with (
                    stdio_client(params, errlog=errlog) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    out.tools = await list_all_tools(session)  # as the bridge does on start
                    for _ in range(WARMUP_CALLS + 1):
                        await echo(session, "warm")
                    sequential: list[float] = []
                    for _ in range(calls):
                        start = time.perf_counter()
                        result = await session.call_tool(ECHO, {"message": "x"})
                        sequential.append(ms_since(start))
                        check_echo(result, "x")
                    out.direct.sequential_ms = sequential
                    await direct_batch(session)  # warm-up batch, not timed
                    out.direct.batch_ms = [await direct_batch(session) for _ in range(batches)]
        except Exception as exc:  # report and go on: this is a measurement, not a test
            out.problems.append("direct client: %s%s" % (describe(exc), tail_of(errlog)))


# --- the table ------------------------------------------------------------------------


def ms_row(metric: str, value: float | None, note: str = "") -> Row:
    return Row(metric, "ERROR" if value is None else "%.3f" % value, "ms", note)


def pct(samples: Sequence[float] | None, fraction: float) -> float | None:
    return None if not samples else percentile(samples, fraction)


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def throughput(batch_ms: Sequence[float] | None) -> float | None:
    if not batch_ms or sum(batch_ms) <= 0:
        return None
    return len(batch_ms) * IN_FLIGHT / (sum(batch_ms) / 1000.0)


def latency_rows(m: Measurements, calls: int) -> list[Row]:
    proxied, direct = m.proxied.sequential_ms, m.direct.sequential_ms
    p50, p95 = pct(proxied, 0.50), pct(proxied, 0.95)
    d50, d95 = pct(direct, 0.50), pct(direct, 0.95)
    where = "%d sequential echo calls" % calls
    return [
        ms_row("proxied round trip p50", p50, "sandbox mcp_everything.echo(), sync; %s" % where),
        ms_row("proxied round trip p95", p95, "timed with perf_counter inside the container"),
        ms_row("direct round trip p50", d50, "ClientSession.call_tool('echo') from this process"),
        ms_row("direct round trip p95", d95, "same server executable, own stdio session"),
        ms_row("proxy overhead p50", difference(p50, d50), "proxied p50 - direct p50"),
        ms_row("proxy overhead p95", difference(p95, d95), "proxied p95 - direct p95"),
        ms_row(
            "sandbox -> bridge only p50",
            pct(m.proxied.bridge_only_ms, 0.50),
            "runtime.discovered_servers(): no MCP server involved",
        ),
        ms_row("sandbox -> bridge only p95", pct(m.proxied.bridge_only_ms, 0.95)),
    ]


def throughput_rows(m: Measurements, batches: int) -> list[Row]:
    rows: list[Row] = []
    for label, samples, how in (
        ("proxied", m.proxied.batch_ms, "await asyncio.gather(...) in the sandbox"),
        ("direct", m.direct.batch_ms, "anyio task group on the direct session"),
    ):
        rate = throughput(samples)
        shown = "ERROR" if rate is None else "%.0f" % rate
        note = "%d batches x %d calls in flight; %s" % (batches, IN_FLIGHT, how)
        rows.append(Row("%s throughput (%d in flight)" % (label, IN_FLIGHT), shown, "calls/s", note))
        rows.append(ms_row("%s batch p50 (%d calls)" % (label, IN_FLIGHT), pct(samples, 0.50)))
    return rows


def schema_view(tool: types.Tool) -> dict[str, Any]:
    """The tool as tools/list gives it, limited to what a signature stands for."""
    dumped: dict[str, Any] = tool.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {key: dumped[key] for key in SCHEMA_KEYS if key in dumped}


def count_or_none(value: Any) -> int | None:
    """Tokens of a text, or of a value as compact JSON; None if it was not measured."""
    if value is None:
        return None
    tokens: int = count_tokens(value if isinstance(value, str) else compact_json(value))
    return tokens


def int_row(metric: str, value: int | None, unit: str, note: str = "") -> Row:
    return Row(metric, "ERROR" if value is None else "%d" % value, unit, note)


def token_rows(m: Measurements) -> list[Row]:
    tools = m.tools
    summary = m.summary_docs
    signatures_text = None if summary is None else "\n".join(str(d.get("signature", "")) for d in summary)
    if tools is not None and summary is not None and len(summary) != len(tools):
        m.problems.append("query_tool_docs lists %d tools, tools/list %d" % (len(summary), len(tools)))
    signatures = count_or_none(signatures_text)
    schemas = count_or_none(None if tools is None else [schema_view(tool) for tool in tools])
    all_fields = count_or_none(
        None
        if tools is None
        else [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]
    )
    ratio = "ERROR" if not signatures or schemas is None else "%.2f" % (schemas / signatures)
    return [
        int_row("server-everything tools", None if tools is None else len(tools), "tools", "tools/list"),
        int_row(
            "tools in query_tool_docs", None if summary is None else len(summary), "tools", "from the sandbox"
        ),
        int_row(
            "docs as Python signatures", signatures, "tokens", '"\\n".join(query_tool_docs() signatures)'
        ),
        int_row(
            "docs as JSON schema",
            schemas,
            "tokens",
            "tools/list tools: %s, compact JSON" % ", ".join(SCHEMA_KEYS),
        ),
        Row("JSON schema / signatures", ratio, "x", "how many times larger the JSON is"),
        int_row("tools/list tools, all fields", all_fields, "tokens", "adds title, annotations, execution"),
        int_row(
            "query_tool_docs(detail='full')", count_or_none(m.full_docs), "tokens", "compact JSON of the list"
        ),
    ]


def show_docs(m: Measurements) -> None:
    """--verbose: the two texts whose tokens are counted, on stderr."""
    if m.summary_docs is not None:
        signatures = "\n".join(str(doc.get("signature", "")) for doc in m.summary_docs)
        print("signatures:\n%s\n" % signatures, file=sys.stderr)
    if m.tools is not None:
        print("schema JSON:\n%s\n" % compact_json([schema_view(t) for t in m.tools]), file=sys.stderr)
    sys.stderr.flush()


def render_table(rows: Sequence[Row]) -> str:
    cells = [["metric", "value", "unit", "note"], *([r.metric, r.value, r.unit, r.note] for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(4)]

    def fmt(line: list[str]) -> str:
        parts = [
            cell.rjust(w) if i == 1 else cell.ljust(w)  # the value column is right-aligned
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), rule, *(fmt(line) for line in cells[1:])])


# --- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_runtime_and_image(parser)
    parser.add_argument(
        "--calls",
        type=int,
        default=DEFAULT_CALLS,
        help="sequential calls per path (default %d, minimum %d)" % (DEFAULT_CALLS, MIN_CALLS),
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=DEFAULT_BATCHES,
        help="batches of %d concurrent calls per path (default %d)" % (IN_FLIGHT, DEFAULT_BATCHES),
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also print the signatures and the schema JSON to stderr"
    )
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=DEFAULT_CELL_TIMEOUT_S,
        help="run_python timeout of each measuring cell, seconds (default %g)" % DEFAULT_CELL_TIMEOUT_S,
    )
    return parser


async def bench(
    runtime: str, image: str, calls: int, batches: int, cell_timeout: float, verbose: bool
) -> None:
    out = Measurements()
    print("measuring run_python -> server-everything (%s) ..." % runtime, file=sys.stderr, flush=True)
    await measure_proxied(out, runtime, image, calls, batches, cell_timeout)
    print("measuring direct client -> server-everything ...", file=sys.stderr, flush=True)
    await measure_direct(out, calls, batches)

    rows = [*latency_rows(out, calls), *throughput_rows(out, batches), *token_rows(out)]
    if verbose:
        show_docs(out)
    print(
        "runtime: %s   image: %s   sequential calls: %d   batches: %d x %d in flight"
        % (runtime, image, calls, batches, IN_FLIGHT)
    )
    print(render_table(rows), flush=True)
    if out.problems:
        print("\nproblems:")
        for problem in out.problems:
            print("- %s" % problem)


def missing_programs() -> list[str]:
    missing: list[str] = []
    if not EVERYTHING.exists():
        missing.append("server-everything is not installed at %s; run scripts/setup.sh" % EVERYTHING)
    try:
        server_command()
    except SystemExit as exc:
        missing.append(str(exc.code))
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    calls: int = args.calls
    if calls < MIN_CALLS:
        print("--calls %d raised to the minimum of %d" % (calls, MIN_CALLS), file=sys.stderr)
        calls = MIN_CALLS
    batches: int = max(1, args.batches)
    cell_timeout: float = args.cell_timeout
    missing = missing_programs()
    if missing:
        print("nothing measured:\n" + "\n".join("- " + line for line in missing))
        return 0
    anyio.run(bench, args.runtime, args.image, calls, batches, cell_timeout, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
