"""Core latency and size benchmark for the run_python MCP server.

Starts the installed console script through the MCP SDK's stdio client, once per
measurement and runtime, and prints a plain-text table:

* start -> initialize: process spawn until the initialize handshake has completed;
* first call (right after initialize): pre-warm enabled, the call is sent as soon as
  initialize returns, so it usually waits for the sandbox that is still starting;
* first call (pre-warmed): pre-warm enabled, a fresh server, the call is sent after
  waiting --prewarm-wait seconds (default 3) so the pre-warm has had time to finish;
* first call (cold, MCP_BRIDGE_PREWARM=0): a fresh server without pre-warm;
* warm call p50 / p95 / max: N trivial calls (code "1") on an already running sandbox;
* tools/list tokens: the ListToolsResult serialized as compact JSON
  (model_dump(by_alias=True, exclude_none=True)), counted with anthropic_tokenizer's
  local (offline) BPE tokenizer.

It is a measurement, not a test: it always exits 0. Usage:

    .venv/bin/python benchmarks/bench_core.py [--runtime podman,docker] [--calls 50] [--image IMG]
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import anyio
import mcp_types as types
from anthropic_tokenizer import count_tokens  # Rust-native local tokenizer: no network.
from mcp.client.session import ClientSession

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for tests.harness
from tests.harness import (
    DEFAULT_IMAGE,
    Engine,
    NotInstalledError,
    bridge_client,
    console_script,
    isolated_env,
    text_of,
)

CHECKOUT = Path(__file__).resolve().parent.parent
TOOL_NAME = "run_python"
RUNTIMES = ("podman", "docker")
MIN_CALLS = 50
TRIVIAL_CODE = "1"
RUN_DEADLINE_S = 300.0  # per server start; a sandbox start includes the container runtime

# Targets from the brief.
TARGET_WARM_P50_MS = 5.0
TARGET_PREWARMED_FIRST_MS = 50.0
TARGET_TOOLS_LIST_TOKENS = 200

# Metric names (also the row labels of the table).
M_INIT = "start -> initialize"
M_FIRST_IMMEDIATE = "first call (right after initialize)"
M_FIRST_PREWARMED = "first call (pre-warmed)"
M_FIRST_COLD = "first call (cold, MCP_BRIDGE_PREWARM=0)"
M_WARM_P50 = "warm call p50"
M_WARM_P95 = "warm call p95"
M_WARM_MAX = "warm call max"
M_TOOLS_TOKENS = "tools/list tokens"
M_TOOLS_BYTES = "tools/list JSON size"
M_TOOLS_ONLY_TOKENS = "tools/list tokens (tools array only)"

# What the main run measures, with the target text shown for each metric ("" = none).
MAIN_RUN_METRICS = {
    M_INIT: "",
    M_FIRST_IMMEDIATE: "",
    M_TOOLS_TOKENS: "< %d" % TARGET_TOOLS_LIST_TOKENS,
    M_TOOLS_BYTES: "",
    M_TOOLS_ONLY_TOKENS: "",
    M_WARM_P50: "<= %g" % TARGET_WARM_P50_MS,
    M_WARM_P95: "",
    M_WARM_MAX: "",
}
ROW_ORDER = [
    M_INIT,
    M_FIRST_IMMEDIATE,
    M_FIRST_PREWARMED,
    M_FIRST_COLD,
    M_WARM_P50,
    M_WARM_P95,
    M_WARM_MAX,
    M_TOOLS_TOKENS,
    M_TOOLS_BYTES,
    M_TOOLS_ONLY_TOKENS,
]


@dataclass
class Row:
    runtime: str
    metric: str
    value: str
    unit: str
    target: str = ""
    met: str = ""


@dataclass
class RuntimeReport:
    runtime: str
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, metric: str, value: float, unit: str, target: str = "", met: bool | None = None) -> None:
        shown = "%d" % value if unit in ("tokens", "bytes") else "%.2f" % value
        self.rows.append(Row(self.runtime, metric, shown, unit, target, "" if met is None else _yes_no(met)))

    def fail(self, metric: str, problem: str, target: str = "") -> None:
        self.rows.append(Row(self.runtime, metric, "ERROR", "", target, "no" if target else ""))
        self.problems.append("%s: %s" % (metric, problem))


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def percentile(samples: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (the smallest sample >= fraction of all samples)."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def server_command() -> str:
    """The console script of this checkout; exits with a message when it is not installed.
    Its two modules are compiled first, as an install leaves them (pip compiles what it
    installs): a checkout's editable install under PYTHONDONTWRITEBYTECODE (set on these
    machines) would otherwise compile 17,000 lines at every start, about 0.15 s."""
    try:
        command = console_script()
    except NotInstalledError as exc:
        raise SystemExit(str(exc)) from None
    for module in ("mcp_server_code_execution_mode.py", "mcp_sandbox_kernel.py"):
        compileall.compile_file(str(CHECKOUT / module), quiet=2)
    return command


def server_env(runtime: str, image: str, prewarm: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["MCP_BRIDGE_RUNTIME"] = runtime
    env["MCP_BRIDGE_IMAGE"] = image
    env["MCP_BRIDGE_PREWARM"] = "1" if prewarm else "0"
    return env


def add_runtime_and_image(parser: argparse.ArgumentParser) -> None:
    """--runtime (one engine) and --image, as the single-runtime benchmarks take them."""
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=os.environ.get("MCP_BRIDGE_RUNTIME") or "podman",
        help="container runtime (default: $MCP_BRIDGE_RUNTIME or podman)",
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("MCP_BRIDGE_IMAGE") or DEFAULT_IMAGE,
        help="sandbox image (default: $MCP_BRIDGE_IMAGE or %s)" % DEFAULT_IMAGE,
    )


def isolated_bridge_env(
    runtime: str, image: str, root: Path, servers: dict[str, Any], settings: dict[str, str]
) -> dict[str, str]:
    """This environment without any MCP_BRIDGE_* setting, plus an isolated bridge: an empty
    HOME (no client config files) and a state dir under ``root`` (created if missing),
    ``servers`` as the one servers config, and ``settings`` (more MCP_BRIDGE_* values)."""
    home, state, config = root / "home", root / "state", root / "servers.json"
    home.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    config.write_text(json.dumps({"mcpServers": servers}), encoding="utf-8")
    return isolated_env(Engine(runtime, image), state, home, MCP_SERVERS_CONFIG=str(config), **settings)


class ToolCallError(Exception):
    """run_python answered, but not with a successful result (the server is still up)."""


async def timed_call(session: ClientSession) -> float:
    """One trivial run_python call; returns its latency in ms, raises if it did not succeed."""
    start = time.perf_counter()
    result = await session.call_tool(TOOL_NAME, {"code": TRIVIAL_CODE})
    elapsed = ms_since(start)
    if not isinstance(result, types.CallToolResult):
        raise ToolCallError("run_python returned %s, not a CallToolResult" % type(result).__name__)
    if result.is_error:
        raise ToolCallError("run_python reported an error: %s" % text_of(result)[:500])
    return elapsed


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def tools_list_size(result: types.ListToolsResult) -> tuple[str, int, int]:
    """The whole result as compact JSON, its token count, and the token count of just
    its "tools" array (without the SDK's result envelope fields such as ttlMs)."""
    payload: dict[str, Any] = result.model_dump(by_alias=True, exclude_none=True)
    text = compact_json(payload)
    tokens: int = count_tokens(text)
    tools_only: int = count_tokens(compact_json(payload.get("tools", [])))
    return text, tokens, tools_only


@contextmanager
def captured_stderr() -> Iterator[TextIO]:
    """A temporary file for the server's stderr (its logs), shown only when a run fails."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as handle:
        yield cast(TextIO, handle)


def tail_of(errlog: TextIO, lines: int = 15) -> str:
    errlog.flush()
    errlog.seek(0)
    tail = errlog.read().strip().splitlines()[-lines:]
    return "\n  server stderr (last %d lines):\n%s" % (len(tail), "\n".join("    | " + line for line in tail))


async def measure_main_run(
    report: RuntimeReport, runtime: str, image: str, calls: int, verbose: bool
) -> None:
    """Start -> initialize, first call right after initialize, tools/list size, warm calls."""
    env = server_env(runtime, image, prewarm=True)
    with captured_stderr() as errlog:
        await _main_run(report, env, errlog, calls, verbose)


async def _main_run(
    report: RuntimeReport, env: dict[str, str], errlog: TextIO, calls: int, verbose: bool
) -> None:
    runtime = report.runtime
    try:
        with anyio.fail_after(RUN_DEADLINE_S):
            start = time.perf_counter()
            async with bridge_client(env, errlog=errlog) as session:  # spawned and initialized
                report.add(M_INIT, ms_since(start), "ms")
                try:
                    report.add(M_FIRST_IMMEDIATE, await timed_call(session), "ms")
                except ToolCallError as exc:  # still measure tools/list and try the warm calls
                    report.fail(M_FIRST_IMMEDIATE, str(exc))

                tools = await session.list_tools()
                text, tokens, tools_only = tools_list_size(tools)
                if verbose:
                    print("tools/list JSON (%s):\n%s\n" % (runtime, text), file=sys.stderr)
                report.add(
                    M_TOOLS_TOKENS,
                    tokens,
                    "tokens",
                    "< %d" % TARGET_TOOLS_LIST_TOKENS,
                    tokens < TARGET_TOOLS_LIST_TOKENS,
                )
                report.add(M_TOOLS_BYTES, len(text.encode("utf-8")), "bytes")
                report.add(M_TOOLS_ONLY_TOKENS, tools_only, "tokens")

                samples = [await timed_call(session) for _ in range(calls)]
                p50 = percentile(samples, 0.50)
                report.add(M_WARM_P50, p50, "ms", "<= %g" % TARGET_WARM_P50_MS, p50 <= TARGET_WARM_P50_MS)
                report.add(M_WARM_P95, percentile(samples, 0.95), "ms")
                report.add(M_WARM_MAX, max(samples), "ms")
    except Exception as exc:  # report and go on: this is a measurement, not a test
        report.problems.append("main run: %s%s" % (describe(exc), tail_of(errlog)))
        done = {row.metric for row in report.rows}
        for metric, target in MAIN_RUN_METRICS.items():
            if metric not in done:
                report.rows.append(Row(runtime, metric, "ERROR", "", target, "no" if target else ""))


async def measure_first_call(
    report: RuntimeReport,
    metric: str,
    *,
    runtime: str,
    image: str,
    prewarm: bool,
    wait_s: float,
    target: str = "",
    target_ms: float | None = None,
) -> None:
    """A fresh server: initialize, optionally wait, then time exactly one call."""
    env = server_env(runtime, image, prewarm)
    with captured_stderr() as errlog:
        try:
            with anyio.fail_after(RUN_DEADLINE_S):
                async with bridge_client(env, errlog=errlog) as session:
                    if wait_s > 0:
                        await anyio.sleep(wait_s)
                    elapsed = await timed_call(session)
                    met = None if target_ms is None else elapsed <= target_ms
                    report.add(metric, elapsed, "ms", target, met)
        except Exception as exc:  # report and go on: this is a measurement, not a test
            report.fail(metric, describe(exc) + tail_of(errlog), target)


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if isinstance(exc, TimeoutError):
        return "no answer within %g s (TimeoutError)" % RUN_DEADLINE_S
    return "%s: %s" % (type(exc).__name__, exc)


async def bench_runtime(runtime: str, image: str, calls: int, wait_s: float, verbose: bool) -> RuntimeReport:
    report = RuntimeReport(runtime)
    await measure_main_run(report, runtime, image, calls, verbose)
    await measure_first_call(
        report,
        M_FIRST_PREWARMED,
        runtime=runtime,
        image=image,
        prewarm=True,
        wait_s=wait_s,
        target="<= %g" % TARGET_PREWARMED_FIRST_MS,
        target_ms=TARGET_PREWARMED_FIRST_MS,
    )
    await measure_first_call(report, M_FIRST_COLD, runtime=runtime, image=image, prewarm=False, wait_s=0.0)
    report.rows.sort(key=lambda row: ROW_ORDER.index(row.metric))
    return report


def render_table(rows: Sequence[Row]) -> str:
    header = Row("runtime", "metric", "value", "unit", "target", "met")
    cells = [[r.runtime, r.metric, r.value, r.unit, r.target, r.met] for r in [header, *rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header.__dict__))]
    right_aligned = {2}  # the value column

    def fmt(line: list[str]) -> str:
        parts = [
            cell.rjust(w) if i in right_aligned else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), rule, *(fmt(line) for line in cells[1:])])


def parse_runtimes(values: Sequence[str] | None) -> list[str]:
    if not values:
        return list(RUNTIMES)
    chosen: list[str] = []
    for value in values:
        for part in value.split(","):
            name = part.strip().lower()
            if not name:
                continue
            if name not in RUNTIMES:
                raise argparse.ArgumentTypeError(
                    "unknown runtime %r (choose from %s)" % (name, ", ".join(RUNTIMES))
                )
            if name not in chosen:
                chosen.append(name)
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--runtime",
        action="append",
        metavar="podman|docker",
        help="runtime to measure; repeatable or a comma list (default: podman,docker)",
    )
    parser.add_argument(
        "--calls", type=int, default=MIN_CALLS, help="warm calls to time (default and minimum %d)" % MIN_CALLS
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("MCP_BRIDGE_IMAGE") or DEFAULT_IMAGE,
        help="sandbox image (default: $MCP_BRIDGE_IMAGE or %s)" % DEFAULT_IMAGE,
    )
    parser.add_argument(
        "--prewarm-wait",
        type=float,
        default=3.0,
        help="seconds to wait after initialize before the pre-warmed first call (default 3)",
    )
    parser.add_argument("--verbose", action="store_true", help="also print the tools/list JSON to stderr")
    return parser


async def bench(runtimes: Sequence[str], image: str, calls: int, wait_s: float, verbose: bool) -> None:
    reports: list[RuntimeReport] = []
    for runtime in runtimes:
        print("measuring %s ..." % runtime, file=sys.stderr, flush=True)
        reports.append(await bench_runtime(runtime, image, calls, wait_s, verbose))

    print("image: %s   warm calls: %d   pre-warm wait: %g s" % (image, calls, wait_s))
    print(render_table([row for report in reports for row in report.rows]), flush=True)
    problems = [(report.runtime, problem) for report in reports for problem in report.problems]
    if problems:
        print("\nproblems:")
        for runtime, problem in problems:
            print("- [%s] %s" % (runtime, problem))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        runtimes = parse_runtimes(args.runtime)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    calls: int = args.calls
    if calls < MIN_CALLS:
        print("--calls %d raised to the minimum of %d" % (calls, MIN_CALLS), file=sys.stderr)
        calls = MIN_CALLS
    anyio.run(bench, runtimes, args.image, calls, args.prewarm_wait, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
