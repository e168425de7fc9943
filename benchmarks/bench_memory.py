"""Memory benchmark: the sandbox's memory helpers, served by the bridge from SQLite on the host.

Starts TWO bridges (the installed console script, each behind the MCP SDK's stdio client)
that share one temporary MCP_BRIDGE_STATE_DIR, so one memory store
(STATE_DIR/user_tools/memory.sqlite3); HOME is an empty temporary directory and
MCP_SERVERS_CONFIG an empty servers table, so no config of this machine is picked up.
Then, with every time taken inside the sandbox with time.perf_counter():

* round trip: in ONE run_python call on bridge A, N x (``save_memory(key, value)`` then
  ``load_memory(key)``) with a ~100-byte value, then the same with a 100 KiB value; each
  call timed on its own; p50/p95 per helper and size (each load must return what the save
  before it wrote);
* contended update_memory, two bridges: both bridges run the same cell at once (started
  together by wall clock): K threads, each calling
  ``update_memory(key, lambda v: v + 1, 0)`` M times on ONE counter; updates/s over both,
  per-update latency, retries (fn invocations minus successful updates: every invocation
  after the first of an update is a retry after a conflicting write); the final count must
  be 2 x K x M, and the values update_memory returned must be exactly 1..2 x K x M (each
  increment landed once);
* the same cell on bridge A alone (K threads x M updates, another counter), for comparison.

It is a measurement, not a test: it always exits 0 (problems are listed under the table).
Usage:

    .venv/bin/python benchmarks/bench_memory.py [--runtime podman] [--calls 200] [--threads 4] [--updates 100]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sqlite3
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
import mcp_types as types
from bench_core import (  # the sibling benchmark: same conventions, same helpers
    TOOL_NAME,
    add_runtime_and_image,
    captured_stderr,
    isolated_bridge_env,
    percentile,
    server_command,
    tail_of,
)
from bench_proxy import Row, render_table  # the same table as the proxy benchmark
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from mcp_server_code_execution_mode import MEMORY_DIRNAME, MEMORY_FILENAME
from tests.harness import text_of  # on the path once bench_core is imported

MIN_CALLS = 50
DEFAULT_CALLS = 200
DEFAULT_THREADS = 4
DEFAULT_UPDATES = 100
WARMUP_CALLS = 10  # save + load pairs before anything is timed
SMALL_VALUE_BYTES = 100  # bytes of the value's JSON text, as the store counts them
BIG_VALUE_BYTES = 100 * 1024
START_DELAY_S = 2.0  # both contended cells start at now + this (wall clock, shared with containers)
START_DEADLINE_S = 300.0  # bridge start + initialize + the first call (sandbox start)
CELL_MARGIN_S = 60.0  # on top of a cell's run_python timeout before the client gives up
DEFAULT_CELL_TIMEOUT_S = 300.0
MAX_OUTPUT_CHARS = 8_000_000  # the cells return every sample; the default cap is 50,000
TWO_KEY = "bench/counter/two-bridges"
ONE_KEY = "bench/counter/one-bridge"

# Code run in the sandbox. Each cell's final expression is json.dumps(...) of its
# measurements: run_python returns repr() of that string in structuredContent["value"].
# Plain code (no await anywhere in a cell), so every helper is a blocking call.
WARMUP_CELL = """
import json
for _ in range({warmup}):
    save_memory("bench/warm-up", "x")
    load_memory("bench/warm-up")
json.dumps({{"loaded": load_memory("bench/warm-up"), "deleted": delete_memory("bench/warm-up")}})
"""

LATENCY_CELL = """
import json, time
def _bench_round_trips(key, size):
    saves, loads, wrong = [], [], 0
    for i in range({calls}):
        value = ("%06d" % i).ljust(size - 2, "x")  # a JSON string: size bytes with its quotes
        t = time.perf_counter()
        save_memory(key, value)
        saves.append(round((time.perf_counter() - t) * 1000.0, 4))
        t = time.perf_counter()
        loaded = load_memory(key)
        loads.append(round((time.perf_counter() - t) * 1000.0, 4))
        wrong += loaded != value
    delete_memory(key)
    return {{"save": saves, "load": loads, "wrong": wrong}}
json.dumps({{
    "small": _bench_round_trips("bench/latency/small", {small}),
    "big": _bench_round_trips("bench/latency/big", {big}),
}})
"""

# K threads wait on an event that is set at start_at (time.time(): the host's clock, which
# containers share), then each makes M update_memory calls on one key. fn counts its own
# invocations: one per attempt, so invocations - successful updates = retries.
UPDATE_CELL = """
import json, threading, time
_bench_lock = threading.Lock()
_bench_go = threading.Event()
_bench_fn_calls = [0]
_bench_values, _bench_ms, _bench_errors = [], [], []

def _bench_increment(value):
    with _bench_lock:
        _bench_fn_calls[0] += 1
    return value + 1

def _bench_worker():
    _bench_go.wait()
    for _ in range({updates}):
        t = time.perf_counter()
        try:
            value = update_memory({key!r}, _bench_increment, 0)
        except Exception as exc:
            with _bench_lock:
                _bench_errors.append("%s: %s" % (type(exc).__name__, exc))
            continue
        ms = (time.perf_counter() - t) * 1000.0
        with _bench_lock:
            _bench_values.append(value)
            _bench_ms.append(round(ms, 3))

_bench_threads = [threading.Thread(target=_bench_worker) for _ in range({threads})]
for _bench_thread in _bench_threads:
    _bench_thread.start()
_bench_wait = {start_at!r} - time.time()
if _bench_wait > 0:
    time.sleep(_bench_wait)
_bench_start_wall, _bench_t0 = time.time(), time.perf_counter()
_bench_go.set()
for _bench_thread in _bench_threads:
    _bench_thread.join()
_bench_elapsed = time.perf_counter() - _bench_t0
json.dumps({{
    "values": _bench_values, "ms": _bench_ms, "fn_calls": _bench_fn_calls[0],
    "errors": len(_bench_errors), "first_errors": _bench_errors[:3],
    "elapsed_s": _bench_elapsed, "start_wall": _bench_start_wall, "end_wall": time.time(),
    "late_s": max(0.0, -_bench_wait),
}})
"""

VERIFY_CELL = """
import json
json.dumps({{key: load_memory(key) for key in {keys!r}}})
"""


@dataclass
class UpdateRun:
    """What one UPDATE_CELL measured on one bridge."""

    values: list[int]
    ms: list[float]
    fn_calls: int
    errors: int
    first_errors: list[str]
    elapsed_s: float
    start_wall: float
    end_wall: float
    late_s: float


@dataclass
class Measurements:
    latency: dict[str, list[float]] = field(default_factory=dict)  # "save small", "load big", ...
    two_bridges: list[UpdateRun] | None = None
    one_bridge: UpdateRun | None = None
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)  # bridge -> {key: loaded value}
    stored: dict[str, tuple[Any, int]] = field(default_factory=dict)  # key -> (value, version) on disk
    problems: list[str] = field(default_factory=list)


class CellError(Exception):
    """run_python answered, but the cell did not produce the expected value."""


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if isinstance(exc, TimeoutError):
        return "no answer in time (TimeoutError)"
    return "%s: %s" % (type(exc).__name__, exc)


# --- the bridges --------------------------------------------------------------------------


def bridge_env(runtime: str, image: str, root: Path, cell_timeout: float) -> dict[str, str]:
    """An isolated bridge with no MCP server; both bridges of a run share ``root`` (one store)."""
    settings = {
        "MCP_BRIDGE_MAX_TIMEOUT": "%g" % max(cell_timeout, DEFAULT_CELL_TIMEOUT_S),
        "MCP_BRIDGE_MAX_OUTPUT": str(MAX_OUTPUT_CHARS),
    }
    return isolated_bridge_env(runtime, image, root, {}, settings)


@dataclass
class Bridge:
    name: str
    session: ClientSession
    errlog: TextIO


@asynccontextmanager
async def open_bridge(name: str, params: StdioServerParameters, errlog: TextIO) -> AsyncIterator[Bridge]:
    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        with anyio.fail_after(START_DEADLINE_S):
            await session.initialize()
        yield Bridge(name, session, errlog)


async def run_cell(bridge: Bridge, template: str, cell_timeout: float, **fields: Any) -> Any:
    """Run one cell whose final expression is json.dumps(...); return the decoded JSON."""
    code = textwrap.dedent(template).format(**fields)
    with anyio.fail_after(cell_timeout + CELL_MARGIN_S):
        result = await bridge.session.call_tool(TOOL_NAME, {"code": code, "timeout": cell_timeout})
    if not isinstance(result, types.CallToolResult):
        raise CellError("run_python returned %s, not a CallToolResult" % type(result).__name__)
    if result.is_error:
        raise CellError("run_python reported an error: %s" % text_of(result)[:1500])
    structured = result.structured_content
    value = structured.get("value") if isinstance(structured, dict) else None
    if not isinstance(value, str):
        raise CellError("no structuredContent value in the result: %s" % text_of(result)[:500])
    try:
        if value.startswith(("'", '"')):  # repr() of the json.dumps string (bridges before JSON values)
            value = ast.literal_eval(value)
        return json.loads(value)  # the json.dumps string itself, as JSON data
    except (ValueError, SyntaxError, TypeError) as exc:
        raise CellError(
            "the cell's value is not repr() of a JSON string (%s): %s..." % (exc, value[:300])
        ) from None


def numbers(value: Any, what: str) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(item, int | float) for item in value):
        raise CellError(("%s: expected a list of numbers, got %r" % (what, value))[:500])
    return [float(item) for item in value]


def update_run(data: Any) -> UpdateRun:
    try:
        values = data["values"]
        if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
            raise CellError("values: expected a list of ints, got %r" % (values,))
        return UpdateRun(
            values=values,
            ms=numbers(data["ms"], "ms"),
            fn_calls=int(data["fn_calls"]),
            errors=int(data["errors"]),
            first_errors=[str(e) for e in data["first_errors"]],
            elapsed_s=float(data["elapsed_s"]),
            start_wall=float(data["start_wall"]),
            end_wall=float(data["end_wall"]),
            late_s=float(data["late_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CellError(("unexpected update cell result (%s): %r" % (describe(exc), data))[:800]) from None


async def contended(
    bridges: Sequence[Bridge], key: str, threads: int, updates: int, cell_timeout: float
) -> list[UpdateRun]:
    """The update cell on every bridge at once; one result per bridge, in order."""
    start_at = time.time() + START_DELAY_S
    results: list[Any] = [None] * len(bridges)

    async def one(index: int) -> None:
        results[index] = await run_cell(
            bridges[index],
            UPDATE_CELL,
            cell_timeout,
            key=key,
            threads=threads,
            updates=updates,
            start_at=start_at,
        )

    async with anyio.create_task_group() as group:
        for index in range(len(bridges)):
            group.start_soon(one, index)
    return [update_run(data) for data in results]


async def measure(
    out: Measurements,
    runtime: str,
    image: str,
    calls: int,
    threads: int,
    updates: int,
    cell_timeout: float,
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        params = StdioServerParameters(
            command=server_command(), env=bridge_env(runtime, image, root, cell_timeout), cwd=str(root)
        )
        with captured_stderr() as log_a, captured_stderr() as log_b:  # outlive the bridges
            try:
                async with AsyncExitStack() as stack:
                    bridges = [
                        await stack.enter_async_context(open_bridge(name, params, errlog))
                        for name, errlog in (("A", log_a), ("B", log_b))
                    ]
                    await _cells(out, bridges, calls, threads, updates, cell_timeout)
                    read_store(out, root / "state" / MEMORY_DIRNAME / MEMORY_FILENAME)
            except Exception as exc:  # report and go on: this is a measurement, not a test
                logs = "".join(
                    "\n  bridge %s:%s" % (name, tail_of(errlog))
                    for name, errlog in (("A", log_a), ("B", log_b))
                )
                out.problems.append("bridges: %s%s" % (describe(exc), logs))


async def _cells(
    out: Measurements, bridges: list[Bridge], calls: int, threads: int, updates: int, cell_timeout: float
) -> None:
    a = bridges[0]
    # Starts both sandboxes (pre-warm is on) and opens the store from both bridges.
    async with anyio.create_task_group() as group:
        for bridge in bridges:
            group.start_soon(warm_up, out, bridge, cell_timeout)
    print("  both bridges warm", file=sys.stderr, flush=True)

    try:
        latency = await run_cell(
            a, LATENCY_CELL, cell_timeout, calls=calls, small=SMALL_VALUE_BYTES, big=BIG_VALUE_BYTES
        )
        for size in ("small", "big"):
            for helper in ("save", "load"):
                out.latency["%s %s" % (helper, size)] = numbers(
                    latency[size][helper], "%s %s" % (helper, size)
                )
            if latency[size]["wrong"]:
                out.problems.append(
                    "load_memory after save_memory (%s value): %d of %d loads returned another value"
                    % (size, latency[size]["wrong"], calls)
                )
    except Exception as exc:  # a failed cell, a malformed result or a timeout
        out.problems.append("save/load round trips: %s" % describe(exc))
    print("  save/load round trips done", file=sys.stderr, flush=True)

    try:
        out.two_bridges = await contended(bridges, TWO_KEY, threads, updates, cell_timeout)
    except Exception as exc:  # includes an exception group from the task group
        out.problems.append("update_memory, two bridges: %s" % describe(exc))
    print("  update_memory with two bridges done", file=sys.stderr, flush=True)

    try:
        out.one_bridge = (await contended([a], ONE_KEY, threads, updates, cell_timeout))[0]
    except Exception as exc:
        out.problems.append("update_memory, one bridge: %s" % describe(exc))
    print("  update_memory with one bridge done", file=sys.stderr, flush=True)

    for bridge in bridges:
        try:
            seen = await run_cell(bridge, VERIFY_CELL, cell_timeout, keys=[TWO_KEY, ONE_KEY])
            if not isinstance(seen, dict):
                raise CellError("expected a dict, got %r" % (seen,))
            out.seen[bridge.name] = seen
        except Exception as exc:
            out.problems.append("load_memory of the counters on bridge %s: %s" % (bridge.name, describe(exc)))


async def warm_up(out: Measurements, bridge: Bridge, cell_timeout: float) -> None:
    warm = await run_cell(bridge, WARMUP_CELL, cell_timeout, warmup=WARMUP_CALLS)
    if warm != {"loaded": "x", "deleted": True}:
        out.problems.append(
            "warm-up on bridge %s: expected loaded 'x', deleted True; got %r" % (bridge.name, warm)
        )


def read_store(out: Measurements, path: Path) -> None:
    """The counters' value and version as the store file holds them (read-only)."""
    try:
        database = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
        try:
            for key in (TWO_KEY, ONE_KEY):
                row = database.execute("SELECT value, version FROM memories WHERE key = ?", (key,)).fetchone()
                if row is not None:
                    out.stored[key] = (json.loads(row[0]), int(row[1]))
        finally:
            database.close()
    except (sqlite3.Error, ValueError) as exc:
        out.problems.append("reading the store %s: %s" % (path, describe(exc)))


# --- the table ------------------------------------------------------------------------


def ms_row(metric: str, samples: Sequence[float] | None, fraction: float, note: str = "") -> Row:
    value = "ERROR" if not samples else "%.3f" % percentile(samples, fraction)
    return Row(metric, value, "ms", note)


def latency_rows(m: Measurements, calls: int) -> list[Row]:
    rows: list[Row] = []
    for size, label in (("small", "%d B" % SMALL_VALUE_BYTES), ("big", "%d KiB" % (BIG_VALUE_BYTES // 1024))):
        for helper in ("save", "load"):
            samples = m.latency.get("%s %s" % (helper, size))
            note = ""
            if helper == "save" and size == "small":
                note = "%d calls each, save then load, in one run_python call" % calls
            elif helper == "load" and size == "small":
                note = "perf_counter around each call, inside the container"
            rows.append(ms_row("%s_memory p50 (%s)" % (helper, label), samples, 0.50, note))
            rows.append(ms_row("%s_memory p95 (%s)" % (helper, label), samples, 0.95))
    return rows


def update_rows(
    m: Measurements,
    label: str,
    runs: list[UpdateRun] | None,
    key: str,
    bridges: int,
    threads: int,
    updates: int,
) -> list[Row]:
    expected = bridges * threads * updates
    if runs is None:
        return [Row("%s: updates/s" % label, "ERROR", "updates/s", "")]
    done = sum(len(run.values) for run in runs)
    fn_calls = sum(run.fn_calls for run in runs)
    errors = sum(run.errors for run in runs)
    retries = fn_calls - done
    span = max(run.end_wall for run in runs) - min(run.start_wall for run in runs)
    seconds = runs[0].elapsed_s if len(runs) == 1 else span
    rate = "ERROR" if seconds <= 0 else "%.0f" % (done / seconds)
    samples = [ms for run in runs for ms in run.ms]
    stored = m.stored.get(key)
    final = "ERROR" if stored is None else str(stored[0])
    rows = [
        Row(
            "%s: updates/s" % label,
            rate,
            "updates/s",
            "%d x %d threads x %d update_memory(+1) on one counter" % (bridges, threads, updates),
        ),
        Row("%s: wall time" % label, "%.3f" % seconds, "s", "first thread start to last thread end"),
        ms_row("%s: update_memory p50" % label, samples, 0.50, "one call, retries included"),
        ms_row("%s: update_memory p95" % label, samples, 0.95),
        Row(
            "%s: retries" % label,
            str(retries),
            "retries",
            "fn invocations (%d) - successful updates" % fn_calls,
        ),
        Row(
            "%s: retries per update" % label,
            "ERROR" if not done else "%.2f" % (retries / done),
            "",
            "",
        ),
        Row(
            "%s: final count" % label,
            final,
            "",
            "expected %d; store version %s" % (expected, stored[1] if stored else "?"),
        ),
    ]
    if len(runs) > 1:
        skew = abs(runs[0].start_wall - runs[1].start_wall) * 1000.0
        rows.append(Row("%s: start skew" % label, "%.1f" % skew, "ms", "between the bridges' first updates"))
    check_updates(m, label, runs, key, expected, done, errors)
    return rows


def check_updates(
    m: Measurements, label: str, runs: list[UpdateRun], key: str, expected: int, done: int, errors: int
) -> None:
    if errors:
        firsts = "; ".join(e for run in runs for e in run.first_errors)[:600]
        m.problems.append("%s: %d update_memory calls failed (first: %s)" % (label, errors, firsts))
    stored = m.stored.get(key)
    if stored is None:
        m.problems.append("%s: the counter %r is not in the store" % (label, key))
    else:
        value, version = stored
        if value != expected:
            m.problems.append("%s: final count %r, expected %d" % (label, value, expected))
        if value != done:
            m.problems.append(
                "%s: final count %r, but %d updates succeeded (lost or extra writes)" % (label, value, done)
            )
        if version != done:
            m.problems.append("%s: store version %d, but %d updates succeeded" % (label, version, done))
    for bridge, seen in m.seen.items():
        if stored is not None and seen.get(key) != stored[0]:
            m.problems.append(
                "%s: bridge %s loads %r, the store holds %r" % (label, bridge, seen.get(key), stored[0])
            )
    returned = sorted(value for run in runs for value in run.values)
    if returned != list(range(1, done + 1)):
        twice = sum(1 for count in Counter(returned).values() if count > 1)
        m.problems.append(
            "%s: update_memory returned values other than 1..%d (%d returned more than once): lost updates"
            % (label, done, twice)
        )
    late = max(run.late_s for run in runs)
    if len(runs) > 1 and late > 0:
        m.problems.append(
            "%s: a cell began %.3f s after the common start time, so the bridges did not start "
            "together (see start skew)" % (label, late)
        )


# --- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_runtime_and_image(parser)
    parser.add_argument(
        "--calls",
        type=int,
        default=DEFAULT_CALLS,
        help="save_memory + load_memory pairs per value size (default %d, minimum %d)"
        % (DEFAULT_CALLS, MIN_CALLS),
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="threads per bridge calling update_memory (default %d)" % DEFAULT_THREADS,
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=DEFAULT_UPDATES,
        help="update_memory calls per thread (default %d)" % DEFAULT_UPDATES,
    )
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=DEFAULT_CELL_TIMEOUT_S,
        help="run_python timeout of each measuring cell, seconds (default %g)" % DEFAULT_CELL_TIMEOUT_S,
    )
    return parser


async def bench(
    runtime: str, image: str, calls: int, threads: int, updates: int, cell_timeout: float
) -> None:
    out = Measurements()
    print("measuring memory helpers on two bridges (%s) ..." % runtime, file=sys.stderr, flush=True)
    await measure(out, runtime, image, calls, threads, updates, cell_timeout)
    rows = [
        *latency_rows(out, calls),
        *update_rows(out, "2 bridges", out.two_bridges, TWO_KEY, 2, threads, updates),
        *update_rows(
            out, "1 bridge", [out.one_bridge] if out.one_bridge else None, ONE_KEY, 1, threads, updates
        ),
    ]
    print(
        "runtime: %s   image: %s   round trips: %d per size   "
        "update_memory: %d threads x %d updates per bridge   host CPUs: %s"
        % (runtime, image, calls, threads, updates, os.cpu_count())
    )
    print(render_table(rows), flush=True)
    if out.problems:
        print("\nproblems:")
        for problem in out.problems:
            print("- %s" % problem)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    calls: int = args.calls
    if calls < MIN_CALLS:
        print("--calls %d raised to the minimum of %d" % (calls, MIN_CALLS), file=sys.stderr)
        calls = MIN_CALLS
    threads: int = max(1, args.threads)
    updates: int = max(1, args.updates)
    try:
        server_command()
    except SystemExit as exc:
        print("nothing measured:\n- %s" % exc.code)
        return 0
    anyio.run(bench, args.runtime, args.image, calls, threads, updates, args.cell_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
