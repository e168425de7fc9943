"""Floors benchmark: the bridge's figures against what the same work costs at the least,
all measured in ONE run, alternately, over several rounds (medians), so a ratio compares
two figures taken on the same machine under the same load.

* spawn -> first result (pre-warm on): a fresh bridge process (the installed console
  script, through the MCP SDK's stdio client), initialize, run_python("1") at once; floors:
  benchmarks/noop_server.py (the SDK's low-level Server, one tool answering "1") spawned,
  initialized and called the same way, and one bare hardened container start
  (`<runtime> run --rm ... IMAGE python3 -I -c pass`, the argv the bridge builds itself:
  build_run_argv with the bridge's default limits and its seccomp profile);
* warm calls: --calls run_python("1") on that bridge after its first call, p50 / p95,
  against the same number of tools/call on the no-op server;
* proxied echo: server-everything configured as `everything`; one run_python cell makes
  --echo-calls `mcp_everything.echo(message="x")` calls in a loop, its time divided by
  the count, against the same loop on a direct SDK client of the same executable;
* proxied throughput: --batches of `asyncio.gather` of 32 echo calls in one cell, against
  32 concurrent call_tool on the direct client (an anyio task group);
* where the time goes: the CPU time each process spends per warm call and per proxied echo
  (Linux: the sum of /proc/PID/task/*/schedstat over the timed loop, divided by the calls):
  the bridge, its sandbox's supervisor and executor, the proxied server and the client,
  beside the no-op server, the direct client and its server. On this 2-core machine their
  sum is about the wall time of a call: the processes take turns, few run at once;
* a process hop: the round trip of a 64-byte message between two fresh Python processes
  over a Unix socketpair, as the scheduler places them and with both held on one CPU. A
  warm call makes two round trips more than the no-op (bridge -> supervisor -> executor
  and back), a proxied call two more than a direct client: the part of the gap no Python
  work removes.

It is a measurement, not a test: it always exits 0 (problems are listed under the table).

    .venv/bin/python benchmarks/bench_floors.py [--rounds 5] [--runtime podman|docker] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import anyio
import mcp_types as types
from bench_core import (  # the sibling benchmarks: same conventions, same helpers
    ToolCallError,
    captured_stderr,
    isolated_bridge_env,
    ms_since,
    percentile,
    server_command,
    tail_of,
    timed_call,
)
from bench_proxy import ALIAS, BATCH_CELL, EVERYTHING, IN_FLIGHT, direct_batch, echo, run_cell
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import mcp_server_code_execution_mode as bridge
from tests.harness import (
    DEFAULT_IMAGE,
    Engine,
    bridge_pids,
    text_of,
)  # on the path once bench_core is imported

NOOP_SERVER = Path(__file__).resolve().parent / "noop_server.py"
NOOP_TOOL = "noop"
RUNTIMES = ("podman", "docker")
DEFAULTS = {"rounds": 5, "calls": 200, "echo_calls": 200, "batches": 10}
QUICK = {"rounds": 2, "calls": 50, "echo_calls": 50, "batches": 3}
WARMUP_CALLS = 5  # untimed calls after the first one, before the warm calls are timed
CELL_TIMEOUT_S = 120.0
ROUND_DEADLINE_S = 300.0  # one spawn round or one proxy round, start and shutdown included
CONTAINERS_GONE_S = 20.0  # how long to wait for a closed bridge's sandbox to be removed

# The proxied loop: N calls, timed as a whole inside the container, divided by N.
ECHO_LOOP_CELL = """
import json, time
_bench_t = time.perf_counter()
for _ in range({calls}):
    _bench_last = mcp_{alias}.{tool}(message="x")
_bench_total = (time.perf_counter() - _bench_t) * 1000.0
json.dumps({{"ms": _bench_total / {calls}, "last": repr(_bench_last)}})
"""
WARMUP_CELL = """
import json
for _ in range(20):
    _bench_last = mcp_{alias}.{tool}(message="warm")
json.dumps(repr(_bench_last))
"""

# Per-round series (the keys of Samples.rounds).
B_FIRST, N_FIRST, BARE = "bridge first", "noop first", "bare container"
B_P50, B_P95, N_P50, N_P95 = "bridge warm p50", "bridge warm p95", "noop warm p50", "noop warm p95"
P_ECHO, D_ECHO, P_RATE, D_RATE = "proxied echo", "direct echo", "proxied rate", "direct rate"
# CPU per call by process: "cpu <case> <process>" (see CpuMeter).
WARM_BRIDGE, WARM_NOOP, ECHO_BRIDGE, ECHO_DIRECT = "warm bridge", "warm noop", "echo bridge", "echo direct"
SUPERVISOR, EXECUTOR, SERVER, CLIENT = "supervisor", "executor", "server", "client"


@dataclass
class Samples:
    rounds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    problems: list[str] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        values = self.rounds.get(key)
        return statistics.median(values) if values else None


@dataclass(frozen=True)
class Settings:
    runtime: str
    image: str
    rounds: int
    calls: int
    echo_calls: int
    batches: int


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if isinstance(exc, TimeoutError):
        return "no answer within %g s (TimeoutError)" % ROUND_DEADLINE_S
    return "%s: %s" % (type(exc).__name__, exc)


@asynccontextmanager
async def client(params: StdioServerParameters, errlog: TextIO) -> AsyncIterator[ClientSession]:
    """The MCP SDK's stdio client, initialized: the same for the bridge and the floors."""
    async with (
        stdio_client(params, errlog=errlog) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


# --- CPU time per call, by process ------------------------------------------------------


def cpu_ns(pid: int) -> int | None:
    """The CPU time of ``pid``'s threads alive now (ns, from schedstat: exact, where
    /proc/PID/stat counts clock ticks), or None once it is gone or where Linux has none."""
    total, read = 0, False
    try:
        for task in Path("/proc/%d/task" % pid).iterdir():
            with suppress(OSError, ValueError, IndexError):  # a thread that just ended
                total += int((task / "schedstat").read_text().split()[0])
                read = True
    except OSError:
        return None
    return total if read else None


def processes(fragment: str, parent: int | None = None, program: str = "") -> list[int]:
    """Pids whose command line holds ``fragment``, whose parent is ``parent`` (if given)
    and whose program's name starts with ``program``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if (
            fragment in " ".join(argv)
            and (parent is None or ppid == parent)
            and Path(argv[0]).name.startswith(program)
        ):
            found.append(int(proc.name))
    return found


def sandbox_pids() -> dict[str, int]:
    """The one sandbox's kernel processes on this machine: its supervisor and executor
    (none when there are several sandboxes: whose would be a guess). The engine's own
    processes name the kernel too, but are not Python."""
    kernels = processes("mcp_sandbox_kernel.py", program="python")
    executors = processes("mcp_sandbox_kernel.py --executor", program="python")
    supervisors = [pid for pid in kernels if pid not in executors]
    if len(supervisors) != 1 or len(executors) != 1:
        return {}
    return {SUPERVISOR: supervisors[0], EXECUTOR: executors[0]}


class CpuMeter:
    """CPU time per call of named processes over one timed loop (see cpu_ns)."""

    def __init__(self, case: str, pids: dict[str, int | None]) -> None:
        self.case = case
        self.pids = {name: pid for name, pid in pids.items() if pid is not None}
        self.start = {name: cpu_ns(pid) for name, pid in self.pids.items()}

    def stop(self, out: Samples, calls: int) -> None:
        for name, pid in self.pids.items():
            before, after = self.start[name], cpu_ns(pid)
            if before is not None and after is not None:
                out.rounds["cpu %s %s" % (self.case, name)].append((after - before) / calls / 1e6)


# --- spawn -> first result, and warm calls ----------------------------------------------


async def noop_call(session: ClientSession) -> float:
    start = time.perf_counter()
    result = await session.call_tool(NOOP_TOOL, {})
    elapsed = ms_since(start)
    if not isinstance(result, types.CallToolResult) or result.is_error or text_of(result) != "1":
        raise ToolCallError("the no-op server answered %r" % (result,))
    return elapsed


async def spawn_round(
    out: Samples,
    params: StdioServerParameters,
    call: Callable[[ClientSession], Awaitable[float]],
    keys: tuple[str, str, str],
    calls: int,
    server_pids: Callable[[], dict[str, int | None]],
    after: Callable[[int | None], Awaitable[None]] | None = None,
) -> None:
    """Spawn, initialize, one call (timed from the spawn), then warm calls (p50, p95) and
    the CPU time they took by process (``server_pids``: the server's, once it is up)."""
    first_key, p50_key, p95_key = keys
    with captured_stderr() as errlog:
        try:
            with anyio.fail_after(ROUND_DEADLINE_S):
                start = time.perf_counter()
                async with client(params, errlog) as session:
                    await call(session)
                    first = ms_since(start)
                    for _ in range(WARMUP_CALLS):
                        await call(session)
                    owner = find_bridge_pid(params)
                    case = {B_FIRST: WARM_BRIDGE, N_FIRST: WARM_NOOP}[first_key]
                    meter = CpuMeter(case, {**server_pids(), CLIENT: os.getpid()})
                    warm: list[float] = [await call(session) for _ in range(calls)]
                    meter.stop(out, calls)
            out.rounds[first_key].append(first)
            out.rounds[p50_key].append(percentile(warm, 0.50))
            out.rounds[p95_key].append(percentile(warm, 0.95))
            if after is not None:
                await after(owner)
        except Exception as exc:  # report and go on: this is a measurement, not a test
            out.problems.append("%s: %s%s" % (first_key, describe(exc), tail_of(errlog)))


def find_bridge_pid(params: StdioServerParameters) -> int | None:
    """The bridge process started with this state dir (tests.harness.bridge_pids)."""
    state = (params.env or {}).get("MCP_BRIDGE_STATE_DIR")
    pids = bridge_pids(Path(state)) if state is not None else []
    return pids[0] if pids else None


def bare_argv(runtime: str, image: str, profile: Path) -> list[str]:
    """The bridge's own hardened run argv (build_run_argv via the engine, default limits,
    its seccomp profile, the kernel on stdin), with `python3 -I -c pass` as the program."""
    config = bridge.BridgeConfig()
    owner = bridge.bridge_owner()
    spec = bridge.LaunchSpec(
        name=bridge.container_name(owner),
        image=image,
        ipc_dir=None,
        owner=owner,
        memory=config.memory,
        pids=config.pids,
        cpus=config.cpus,
        user=config.container_user,
        seccomp_profile=profile,
    )
    executable = shutil.which(runtime) or runtime
    engine = bridge.ENGINE_CLASSES[runtime](executable)  # type: ignore[index]
    argv = engine.run_argv(spec)
    return [*argv[: argv.index(image) + 1], "-I", "-c", "pass"]


async def bare_round(out: Samples, runtime: str, image: str, profile: Path) -> None:
    argv = bare_argv(runtime, image, profile)  # a fresh container name each time
    try:
        with anyio.fail_after(ROUND_DEADLINE_S):
            start = time.perf_counter()
            result = await anyio.run_process(argv, stdin=subprocess.DEVNULL, check=False)
            elapsed = ms_since(start)
        if result.returncode != 0:
            out.problems.append(
                "bare container: exit %d: %s"
                % (result.returncode, result.stderr.decode(errors="replace")[:500])
            )
            return
        out.rounds[BARE].append(elapsed)
    except Exception as exc:
        out.problems.append("bare container: %s" % describe(exc))


async def measure_spawn(out: Samples, s: Settings) -> None:
    engine = Engine(s.runtime, s.image)

    async def containers_gone(pid: int | None) -> None:
        """Wait until the closed bridge's sandbox is removed: its teardown is not measured,
        and must not load the next round."""
        if pid is None:
            return
        deadline = time.monotonic() + CONTAINERS_GONE_S
        while await anyio.to_thread.run_sync(lambda: engine.containers(running_only=False, owner_pid=pid)):
            if time.monotonic() > deadline:
                out.problems.append(
                    "bridge %d: its sandbox was still there %g s after it closed" % (pid, CONTAINERS_GONE_S)
                )
                return
            await anyio.sleep(0.1)

    with tempfile.TemporaryDirectory(prefix="bench-floors-") as tmp:
        root = Path(tmp)
        settings = {"MCP_BRIDGE_APPROVE": "none", "MCP_BRIDGE_PREWARM": "1"}
        env = isolated_bridge_env(s.runtime, s.image, root, {}, settings)
        bridge_params = StdioServerParameters(command=server_command(), env=env, cwd=root)
        noop_params = StdioServerParameters(command=sys.executable, args=[str(NOOP_SERVER)], cwd=root)
        profile = root / "seccomp.json"
        profile.write_text(json.dumps(bridge.seccomp_profile()), encoding="utf-8")

        def bridge_pids_now() -> dict[str, int | None]:
            return {"bridge": find_bridge_pid(bridge_params), **sandbox_pids()}

        def noop_pid_now() -> dict[str, int | None]:
            return {SERVER: next(iter(processes(str(NOOP_SERVER), parent=os.getpid())), None)}

        async def run_bridge() -> None:
            keys = (B_FIRST, B_P50, B_P95)
            await spawn_round(out, bridge_params, timed_call, keys, s.calls, bridge_pids_now, containers_gone)

        async def run_noop() -> None:
            await spawn_round(out, noop_params, noop_call, (N_FIRST, N_P50, N_P95), s.calls, noop_pid_now)

        async def run_bare() -> None:
            await bare_round(out, s.runtime, s.image, profile)

        for index in range(s.rounds):
            print("  spawn round %d/%d" % (index + 1, s.rounds), file=sys.stderr, flush=True)
            order = [run_bridge, run_noop, run_bare]
            for step in order if index % 2 == 0 else order[::-1]:
                await step()
            await anyio.to_thread.run_sync(measure_hop, out)


# --- the proxied server: sandbox code against a direct client -------------------------


async def direct_loop(session: ClientSession, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await echo(session, "x")
    return ms_since(start) / calls


async def measure_proxy(out: Samples, s: Settings) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-floors-proxy-") as tmp, captured_stderr() as errlog:
        root = Path(tmp)
        settings = {
            "MCP_BRIDGE_APPROVE": "none",
            "MCP_BRIDGE_PREWARM": "1",
            "MCP_BRIDGE_MAX_TIMEOUT": "%g" % CELL_TIMEOUT_S,
        }
        env = isolated_bridge_env(s.runtime, s.image, root, {ALIAS: {"command": str(EVERYTHING)}}, settings)
        bridge_params = StdioServerParameters(command=server_command(), env=env, cwd=root)
        direct_params = StdioServerParameters(command=str(EVERYTHING), cwd=root)
        try:
            # One deadline over both sessions: a cancel scope must not end inside them.
            with anyio.fail_after(ROUND_DEADLINE_S * (s.rounds + 1)):
                async with client(bridge_params, errlog) as proxied, client(direct_params, errlog) as direct:
                    await run_cell(proxied, WARMUP_CELL, CELL_TIMEOUT_S)
                    for _ in range(20):
                        await echo(direct, "warm")
                    await direct_batch(direct)
                    owner = find_bridge_pid(bridge_params)
                    pids = {
                        ECHO_BRIDGE: {
                            "bridge": owner,
                            **sandbox_pids(),
                            SERVER: next(iter(processes(str(EVERYTHING), parent=owner or -1)), None),
                        },
                        ECHO_DIRECT: {
                            CLIENT: os.getpid(),
                            SERVER: next(iter(processes(str(EVERYTHING), parent=os.getpid())), None),
                        },
                    }
                    for index in range(s.rounds):
                        print("  proxy round %d/%d" % (index + 1, s.rounds), file=sys.stderr, flush=True)
                        await proxy_round(out, proxied, direct, s, pids, bridge_first=index % 2 == 0)
        except Exception as exc:  # report and go on: this is a measurement, not a test
            out.problems.append("proxy rows: %s%s" % (describe(exc), tail_of(errlog)))


async def proxy_round(
    out: Samples,
    proxied: ClientSession,
    direct: ClientSession,
    s: Settings,
    pids: dict[str, dict[str, int | None]],
    bridge_first: bool,
) -> None:
    async def proxied_echo() -> None:
        meter = CpuMeter(ECHO_BRIDGE, pids[ECHO_BRIDGE])
        value = await run_cell(proxied, ECHO_LOOP_CELL, CELL_TIMEOUT_S, calls=s.echo_calls)
        meter.stop(out, s.echo_calls)
        if "Echo: x" not in str(value.get("last")):
            out.problems.append("proxied echo returned %s" % value.get("last"))
        out.rounds[P_ECHO].append(float(value["ms"]))

    async def direct_echo() -> None:
        meter = CpuMeter(ECHO_DIRECT, pids[ECHO_DIRECT])
        out.rounds[D_ECHO].append(await direct_loop(direct, s.echo_calls))
        meter.stop(out, s.echo_calls)

    async def proxied_batches() -> None:
        value = await run_cell(proxied, BATCH_CELL, CELL_TIMEOUT_S, batches=s.batches, in_flight=IN_FLIGHT)
        if value.get("wrong"):
            out.problems.append("proxied batches: %s results did not echo their message" % value["wrong"])
        out.rounds[P_RATE].append(rate([float(ms) for ms in value["ms"]]))

    async def direct_batches() -> None:
        await direct_batch(direct)  # untimed, as the cell's first batch
        out.rounds[D_RATE].append(rate([await direct_batch(direct) for _ in range(s.batches)]))

    pairs = [(proxied_echo, direct_echo), (proxied_batches, direct_batches)]
    for first, second in pairs if bridge_first else [(b, a) for a, b in pairs]:
        await first()
        await second()


def rate(batch_ms: Sequence[float]) -> float:
    return len(batch_ms) * IN_FLIGHT / (sum(batch_ms) / 1000.0)


# --- a process hop: what one more process on a call's path costs at the least -------------

HOP_TRIPS = 3000
# Both ends in one fresh process and its fork (single-threaded): the round trip's median, us.
HOP_SCRIPT = (
    """
import os, socket, statistics, sys, time
if sys.argv[1] == "pinned":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
ours, theirs = socket.socketpair()
if os.fork() == 0:
    ours.close()
    while message := theirs.recv(64):
        theirs.send(message)
    os._exit(0)
theirs.close()
trips = []
for _ in range(%d):
    start = time.perf_counter_ns()
    ours.send(b"x" * 64)
    ours.recv(64)
    trips.append(time.perf_counter_ns() - start)
ours.close()
os.wait()
print(statistics.median(trips) / 1000)
"""
    % HOP_TRIPS
)
HOP, HOP_PINNED = "hop trip us", "hop pinned us"


def measure_hop(out: Samples) -> None:
    for key, placement in ((HOP, "free"), (HOP_PINNED, "pinned")):
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", HOP_SCRIPT, placement],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            out.rounds[key].append(float(done.stdout))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            out.problems.append("process hop (%s): %s" % (placement, describe(exc)))


def hop_line(out: Samples) -> str:
    free, pinned = out.median(HOP), out.median(HOP_PINNED)
    if free is None or pinned is None:
        return "process hop: ERROR (see problems)"
    return (
        "process hop, round trip between two Python processes over a Unix socket: %.0f us as placed"
        " by the scheduler, %.0f us on one CPU\n(a warm call and a proxied call each make 2 round"
        " trips more than their floors)" % (free, pinned)
    )


# --- the table ------------------------------------------------------------------------


@dataclass
class Line:
    figure: str
    bridge: str
    floor: str
    ratio: str
    target: str
    met: str
    floor_is: str


def ms(value: float | None) -> str:
    return "ERROR" if value is None else "%.2f ms" % value


def per_s(value: float | None) -> str:
    return "ERROR" if value is None else "%.0f calls/s" % value


def ratio_line(
    figure: str,
    b: float | None,
    f: float | None,
    floor_is: str,
    target: str = "(info)",
    limit: float | None = None,
    shown: Callable[[float | None], str] = ms,
    at_least: bool = False,
) -> Line:
    if b is None or f is None or f <= 0:
        return Line(figure, shown(b), shown(f), "ERROR", target, "", floor_is)
    ratio = b / f
    met = "" if limit is None else ("yes" if (ratio >= limit if at_least else ratio <= limit) else "no")
    return Line(figure, shown(b), shown(f), "%.2fx" % ratio, target, met, floor_is)


def table_lines(out: Samples, s: Settings) -> list[Line]:
    m = out.median
    bare = "bare hardened `%s run --rm IMAGE python3 -I -c pass` (the bridge's run argv)" % s.runtime
    noop_first, bare_first = m(N_FIRST), m(BARE)
    both = None if noop_first is None or bare_first is None else noop_first + bare_first
    p_echo, d_echo = m(P_ECHO), m(D_ECHO)
    overhead = None if p_echo is None or d_echo is None else p_echo - d_echo
    echo_line = Line(
        "proxied echo, per call (%d in a loop)" % s.echo_calls,
        ms(p_echo),
        ms(d_echo),
        "ERROR" if overhead is None else "%+.3f ms" % overhead,
        "overhead <= 0.3 ms",
        "" if overhead is None else ("yes" if overhead <= 0.3 else "no"),
        "the same loop on a direct SDK client of server-everything",
    )
    return [
        ratio_line(
            "spawn -> first run_python (pre-warm on)",
            m(B_FIRST),
            m(N_FIRST),
            "no-op SDK server: spawn -> first tools/call result",
            "<= 1.25x",
            1.25,
        ),
        ratio_line("  (second floor, same row)", m(B_FIRST), m(BARE), bare),
        ratio_line("  (both floors, one after the other)", m(B_FIRST), both, "no-op server + bare container"),
        ratio_line('warm run_python("1") p50', m(B_P50), m(N_P50), "no-op server, warm tools/call p50"),
        ratio_line(
            'warm run_python("1") p95',
            m(B_P95),
            m(N_P95),
            "no-op server, warm tools/call p95",
            "<= 1.3x",
            1.3,
        ),
        echo_line,
        ratio_line(
            "proxied throughput, %d in flight" % IN_FLIGHT,
            m(P_RATE),
            m(D_RATE),
            "direct SDK client, %d concurrent call_tool" % IN_FLIGHT,
            ">= 0.7x",
            0.7,
            per_s,
            at_least=True,
        ),
    ]


def render(lines: Sequence[Line]) -> str:
    header = Line("figure", "bridge", "floor", "ratio", "target", "met", "floor measured as")
    cells = [list(vars(line).values()) for line in [header, *lines]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    right = {1, 2, 3}

    def fmt(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths), *(fmt(row) for row in cells[1:])])


CPU_ROWS = (
    ('warm run_python("1")', WARM_BRIDGE, ("bridge", SUPERVISOR, EXECUTOR), WARM_NOOP, (SERVER,)),
    ("proxied echo", ECHO_BRIDGE, ("bridge", SUPERVISOR, EXECUTOR, SERVER), ECHO_DIRECT, (CLIENT, SERVER)),
)


def cpu_table(out: Samples) -> str:
    """Where a call's time goes: each process's CPU time per call (medians), the bridge's
    side beside its floor's; the client of the warm calls is shown on both sides."""
    lines = ["CPU time per call, by process (ms; medians over the rounds):"]
    for figure, case, names, floor_case, floor_names in CPU_ROWS:
        for label, key, shown in (("ours:", case, names), ("floor:", floor_case, floor_names)):
            parts = [(name, out.median("cpu %s %s" % (key, name))) for name in shown]
            known = [value for _, value in parts if value is not None]
            total = " = %.2f" % sum(known) if len(known) == len(parts) and len(parts) > 1 else ""
            client = out.median("cpu %s %s" % (key, CLIENT)) if CLIENT not in shown else None
            text = " + ".join("%s %s" % (name, "?" if v is None else "%.2f" % v) for name, v in parts)
            extra = "   (client %.2f)" % client if client is not None else ""
            shown_figure = figure if label == "ours:" else ""
            lines.append("  %-22s %-6s %s%s%s" % (shown_figure, label, text, total, extra))
    return "\n".join(lines)


def spreads(out: Samples) -> str:
    order = [B_FIRST, N_FIRST, BARE, B_P50, N_P50, B_P95, N_P95, P_ECHO, D_ECHO, P_RATE, D_RATE]
    order += [HOP, HOP_PINNED]
    shown = []
    for key in order:
        values = out.rounds.get(key)
        if values:
            digits = "%.0f" if key.endswith("rate") else "%.2f"
            shown.append("  %-16s %s" % (key, " ".join(digits % v for v in values)))
    return "per round:\n" + "\n".join(shown)


def machine(runtime: str) -> str:
    try:
        version = subprocess.run(
            [runtime, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = "%s: %s" % (runtime, exc)
    return "machine: nproc %s, kernel %s, %s, Python %s" % (
        os.cpu_count(),
        platform.release(),
        version or runtime,
        platform.python_version(),
    )


# --- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--runtime", choices=RUNTIMES, default="podman", help="container runtime (default podman)"
    )
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="sandbox image (default %s)" % DEFAULT_IMAGE)
    parser.add_argument(
        "--rounds", type=int, help="rounds of each measurement (default %d)" % DEFAULTS["rounds"]
    )
    parser.add_argument("--calls", type=int, help="warm calls per round (default %d)" % DEFAULTS["calls"])
    parser.add_argument(
        "--echo-calls",
        type=int,
        help="proxied / direct echo calls per round (default %d)" % DEFAULTS["echo_calls"],
    )
    parser.add_argument(
        "--batches", type=int, help="batches of %d per round (default %d)" % (IN_FLIGHT, DEFAULTS["batches"])
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: defaults of %s" % ", ".join("%s %d" % item for item in QUICK.items()),
    )
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else DEFAULTS
    chosen = {
        key: max(1, getattr(args, key) if getattr(args, key) is not None else value)
        for key, value in base.items()
    }
    return Settings(runtime=args.runtime, image=args.image, **chosen)


async def bench(s: Settings) -> None:
    out = Samples()
    print("measuring spawn and warm calls (%s) ..." % s.runtime, file=sys.stderr, flush=True)
    await measure_spawn(out, s)
    if EVERYTHING.exists():
        print("measuring the proxied server ...", file=sys.stderr, flush=True)
        await measure_proxy(out, s)
    else:
        out.problems.append("server-everything is not installed at %s; run scripts/setup.sh" % EVERYTHING)

    print(machine(s.runtime))
    print(
        "runtime: %s   image: %s   rounds: %d   warm calls: %d   echo calls: %d   batches: %d x %d"
        % (s.runtime, s.image, s.rounds, s.calls, s.echo_calls, s.batches, IN_FLIGHT)
    )
    print("medians over the rounds; ratio = bridge / floor, both measured in this run, alternately\n")
    print(render(table_lines(out, s)))
    print("\n" + cpu_table(out))
    print("\n" + hop_line(out))
    print("\n" + spreads(out), flush=True)
    if out.problems:
        print("\nproblems:")
        for problem in out.problems:
            print("- %s" % problem)


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(build_parser().parse_args(argv))
    server_command()  # exits with a message when the console script is not installed
    anyio.run(bench, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
