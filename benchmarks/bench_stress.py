"""Stress run: hostile sandbox code, proxied calls and client requests against ONE bridge.

Starts the installed console script once, through the MCP SDK's stdio client, with one or
two real MCP servers configured (server-everything; mcp-server-time when it is installed
next to this interpreter) and, for --minutes minutes, makes run_python calls that rotate
through kinds of hostile code: many threads searching the tool docs (and over-cap
queries), raw frames written straight to the sandbox's frame channel (huge ids, wrong
field types, unknown methods, bad params, floods of 10,000 frames), bytes that break the
frame protocol, lone surrogates, huge and binary output, bursts of 200-400 concurrent
proxied tool calls, oversized tool arguments, code that times out or ignores the
interrupt (the sandbox is killed and restarted), invalid or cancelled client calls and an
occasional reset. After every hostile call a normal call, run_python("6*7"), must give 42.

Meanwhile a concurrent task pings the bridge (MCP ping) every 100 ms and another samples
the bridge process (/proc/<pid>/status VmRSS and Threads, open fds, child processes).
The table gives the bridge's RSS (start, max, end), the ping round trip (event-loop lag)
p50/p99/max, run_python calls answered / unanswered (no answer within the call's timeout
+ 30 s) and, per hostile kind, how many calls and items were sent.

Everything is local: the stdio pipes to the bridge, the bridge's to its servers and its
sandbox container (which has no network). Counts per call are fixed; the run stops by
itself at the deadline (the call in progress then may take up to its timeout + 30 s),
or earlier when the bridge exits or run_python stops answering altogether.

It is a measurement, not a test: it always exits 0 (problems are listed under the table).
Usage:

    .venv/bin/python benchmarks/bench_stress.py [--minutes 10] [--runtime podman] [--image IMG]
        [--kinds KIND,...] [--skip KIND,KIND/VARIANT,...] [--no-time-server] [--verbose]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import string
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
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
from bench_proxy import EVERYTHING, missing_programs  # the same server, the same check
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from mcp_server_code_execution_mode import OWNER_PID_LABEL, BridgeConfig
from tests.harness import bridge_pids, text_of  # on the path once bench_core is imported

REPO = Path(__file__).resolve().parent.parent
TIME_SERVER = Path(sys.executable).parent / "mcp-server-time"
DEFAULT_MINUTES = 10.0

# The bridge's limits for this run, its defaults (the hostile kinds are sized against them).
MAX_FRAME_BYTES = BridgeConfig().max_frame_bytes
MAX_TOOL_RESULT_BYTES = BridgeConfig().max_tool_result_bytes
MAX_OUTPUT_CHARS = BridgeConfig().max_output_chars

HOSTILE_TIMEOUT_S = 10.0  # run_python timeout of a hostile call
LOOP_TIMEOUT_S = 5.0  # ... of code meant to time out
CHECK_TIMEOUT_S = 10.0  # ... of the normal call after each hostile one
MAX_TIMEOUT_S = 120.0  # the bridge's default MCP_BRIDGE_MAX_TIMEOUT
UNANSWERED_AFTER_S = 30.0  # a call unanswered after its timeout + this counts as unanswered
START_DEADLINE_S = 300.0  # initialize + warm-up (first sandbox start, server starts)
SHUTDOWN_DEADLINE_S = 60.0
SDK_TERMINATE_AFTER_MS = 2000.0  # the SDK's stdio client sends SIGTERM after this long
PING_INTERVAL_S = 0.1
PING_GIVE_UP_S = 60.0  # a ping unanswered this long counts as unanswered
SLOW_PING_MS = 1000.0
SAMPLE_INTERVAL_S = 0.25  # VmRSS, Threads, open fds
CHILDREN_EVERY = 8  # child processes every 8 samples (scans /proc)
CONTAINERS_INTERVAL_S = 10.0  # `<runtime> ps` for this bridge's sandbox containers
RSS_GROWTH_FLAG_MB = 50.0  # end - start above this is listed as a problem
SHOWN_PER_KIND = 3  # unexpected outcomes listed per kind
SHOWN_CHECK_FAILURES = 10  # failed 6*7 checks listed

# Sizes of the hostile load (fixed per call: the run is bounded).
SEARCH_THREADS = 48
SEARCHES_PER_THREAD = 3
OVER_CAP_EVERY = 4  # every 4th thread also sends three requests that must be refused
FLOOD_FRAMES = 10_000
BURST_CALLS = 200
WIDE_BURST_CALLS = 400  # more than the bridge's 256 requests in flight

CHANNEL = "runtime.call_tool.__self__._requests.channel"  # how hostile code reaches it today

# --- sandbox code -----------------------------------------------------------------------
# Cells whose last expression is json.dumps(...) report what they did; run_python returns
# repr() of that string as the value (shown_value). $name fields are filled in by
# string.Template; names start with _stress so they do not clash with anything.

SEARCH_CELL = """
import json, random, string, threading
from mcp import runtime
_stress_lock = threading.Lock()
_stress_counts = {"ok": 0, "refused": 0, "accepted_over_cap": 0, "other": 0}
_stress_other = []

def _stress_note(key, detail=None):
    with _stress_lock:
        _stress_counts[key] += 1
        if detail and len(_stress_other) < 3:
            _stress_other.append(detail[:200])

def _stress_search(seed):
    rnd = random.Random(seed)
    letters = string.ascii_letters + string.digits + "      _-."
    for _ in range($searches):
        query = "".join(rnd.choice(letters) for _ in range(500))
        try:
            runtime.search_tool_docs(query, limit=50)
            _stress_note("ok")
        except Exception as exc:
            _stress_note("other", "%s: %s" % (type(exc).__name__, exc))
    if seed % $over_every == 0:
        for query, limit in (("q" * 1_000_000, 50), ("q", 10_000), ("q", 0)):
            try:
                runtime.search_tool_docs(query, limit=limit)
                _stress_note("accepted_over_cap")
            except runtime.MCPError:
                _stress_note("refused")
            except Exception as exc:
                _stress_note("other", "%s: %s" % (type(exc).__name__, exc))

_stress_threads = [threading.Thread(target=_stress_search, args=(i,)) for i in range($threads)]
for _stress_t in _stress_threads:
    _stress_t.start()
for _stress_t in _stress_threads:
    _stress_t.join()
json.dumps(dict(_stress_counts, examples=_stress_other))
"""

RAW_FRAMES_CELL = """
import json
from mcp import runtime
_stress_ch = $channel
_stress_frames = [
    {"type": "request", "id": [0] * 1_000_000, "method": "capability_summary", "params": {}},
    {"type": "request", "id": "x" * 100_000, "method": "capability_summary", "params": {}},
    {"type": "request", "id": 2 ** 60, "method": "capability_summary", "params": {}},
    {"type": "request", "id": True, "method": "capability_summary", "params": {}},
    {"type": "request", "id": 1.5, "method": "capability_summary", "params": {}},
    {"type": "request", "id": "w1", "method": ["not", "a", "name"], "params": 1},
    {"type": "request", "id": "w2", "method": "m" * 10_000, "params": {}},
    {"type": "request", "id": "w3", "method": "list_tools", "params": [1, 2]},
    {"type": "request", "id": "u1", "method": "no_such_method", "params": {}},
    {"type": "request", "id": "u2", "method": "__init__", "params": {}},
    {"type": "request", "id": "u3", "method": "handle", "params": {"method": "x", "params": {}}},
    {"type": "request", "id": "x1", "method": "list_tools", "params": {"server": ["x"]}},
    {"type": "request", "id": "x2", "method": "call_tool",
     "params": {"server": "everything", "tool": {"a": 1}, "arguments": [1]}},
    {"type": "request", "id": "x3", "method": "search_tool_docs", "params": {"query": None, "limit": "all"}},
    {"type": "request", "id": "x4", "method": "call_tool", "params": {"server": "../../etc", "tool": "echo"}},
    {"type": "request", "id": "x5", "method": "query_tool_docs",
     "params": {"server": "everything", "detail": "everything", "extra": "x" * 100_000}},
    {"type": "request", "id": "x6", "method": "call_tool",
     "params": {"server": "everything", "tool": "echo", "arguments": {"message": 12345}}},
    {"type": "request", "id": "d1", "method": "discovered_servers", "params": {"detailed": "yes"}},
    {"type": "request", "id": "d1", "method": "discovered_servers", "params": {}},
    {"type": "cancel", "id": {"nested": "object"}},
    {"type": "cancel", "id": "never-sent"},
    {"type": "stream", "id": 1.5, "name": "stdout", "text": 3},
    {"type": "stream", "id": "nope", "name": "fd9", "text": "x"},
    {"type": "stream", "id": "nope", "name": "stdout", "text": "s" * 3_000_000},
    {"type": "result", "id": "nope", "status": "ok", "value": "'forged'"},
    {"type": "result", "id": "nope", "status": "weird", "value": 5, "dropped": {"stdout": -1}},
    {"type": "hello", "protocol": 99, "python": "x" * 1000},
    {"type": "error", "id": "nope", "message": "forged kernel error"},
    {"type": "error", "message": ["not", "text"]},
    {"type": "execute", "id": "e1", "code": "1"},
    {"type": "response", "id": "r1", "result": None},
    {"type": "t" * 1000},
    {"type": "request"},
]
for _stress_frame in _stress_frames:
    _stress_ch.send(_stress_frame)
json.dumps({"sent": len(_stress_frames)})
"""

FORGED_RESULT_CELL = """
import gc, time
from mcp import runtime
_stress_ch = $channel
_stress_kernel = [o for o in gc.get_objects() if type(o).__name__ == "Kernel"][0]
_stress_id = _stress_kernel.running_id
_stress_ch.send({"type": "stream", "id": _stress_id, "name": "stdout", "text": "forged " * 1000})
_stress_ch.send({"type": "result", "id": _stress_id, "status": "$status", "value": $value})
time.sleep(0.5)
"the real result, which the bridge no longer waits for"
"""

FLOOD_CELL = """
import json, time
from mcp import runtime
_stress_ch = $channel
_stress_makers = (
    lambda i: {"type": "request", "id": "f%d" % i, "method": "discovered_servers", "params": {}},
    lambda i: {"type": "request", "id": "g%d" % i, "method": "no_such_method", "params": {}},
    lambda i: {"type": "request", "id": "h%d" % i, "method": "list_tools", "params": {"server": ["x"]}},
    lambda i: {"type": "cancel", "id": "f%d" % (i - 3)},
    lambda i: {"type": "bogus%d" % (i % 7), "id": i},
)
for _stress_i in range($frames):
    _stress_ch.send(_stress_makers[_stress_i % len(_stress_makers)](_stress_i))
_stress_after = "no answer"
for _ in range(50):  # the bridge may still be busy with the flood: refusals are fine
    try:
        _stress_after = repr(runtime.discovered_servers())
        break
    except runtime.MCPError as exc:
        _stress_after = "refused: %s" % str(exc)[:200]
        time.sleep(0.1)
json.dumps({"sent": $frames, "after": _stress_after})
"""

SURROGATE_CELLS = {
    "proxied": """
        import json
        from mcp import runtime
        _stress_got = {}
        for _stress_name, _stress_call in (
            ("echo", lambda: mcp_everything.echo(message='a\\udcffb')),
            ("search", lambda: runtime.search_tool_docs('\\udcff echo', limit=5)),
            ("docs", lambda: runtime.query_tool_docs('everything', tool='\\udcff')),
            ("server", lambda: runtime.list_tools('\\udcff')),
        ):
            try:
                _stress_got[_stress_name] = repr(_stress_call())[:200]
            except Exception as exc:
                _stress_got[_stress_name] = "%s: %s" % (type(exc).__name__, str(exc)[:200])
        json.dumps(_stress_got, ensure_ascii=True)
        """,
    "exception": "raise ValueError('lone \\udcff and \\ud800 surrogates')",
    "exception type": "raise type('Bad\\udcffName', (Exception,), {})('\\udcff')",
    "value": """
        class _StressOdd:
            def __repr__(self):
                return 'v\\udcff' * 1000
        {'\\udcff key': _StressOdd(), 'list': [_StressOdd()] * 3}
        """,
    "streams": """
        import os, sys
        print('out \\udcff', '\\ud800' * 1000)
        sys.stderr.write('err \\udcff\\n' * 1000)
        os.write(1, b'\\xed\\xb3\\xbf encoded surrogate, \\xff\\xfe not UTF-8\\n')
        'streams done'
        """,
}

HUGE_OUTPUT_CELLS = {
    "text": """
        import sys
        print('x' * 10_000_000)
        for _stress_i in range(20_000):
            print('line %d ' % _stress_i + 'y' * 500)
        sys.stderr.write('e' * 10_000_000)
        'z' * 10_000_000
        """,
    "binary": """
        import os, subprocess
        os.write(1, os.urandom(10 * 2 ** 20))
        os.write(2, os.urandom(4 * 2 ** 20))
        os.write(1, b'\\x00\\x01 NULs and a cut UTF-8 sequence \\xe2\\x82')
        subprocess.run(['head', '-c', '5000000', '/dev/urandom'], check=False)
        'binary done'
        """,
    "background writer": """
        import subprocess
        # Writes to the sandbox's fd 1 for 15 s, during this call and the following ones.
        subprocess.Popen(['timeout', '15', 'yes', 'junk ' * 40])
        'started'
        """,
}

BURST_CELL = """
import asyncio, json
from mcp import runtime
async def _stress_burst():
    return await asyncio.gather(
        *[mcp_everything.echo(message=str(i)) for i in range($calls)], return_exceptions=True
    )
_stress_results = await _stress_burst()
_stress_ok = sum(1 for i, r in enumerate(_stress_results) if r == "Echo: %d" % i)
_stress_refused = sum(1 for r in _stress_results if isinstance(r, runtime.MCPError))
_stress_odd = [repr(r)[:200] for r in _stress_results if not isinstance(r, (str, runtime.MCPError))]
json.dumps({"calls": $calls, "ok": _stress_ok, "refused": _stress_refused, "odd": _stress_odd[:3]})
"""

TIME_BURST_CELL = """
import asyncio, json
from mcp import runtime
async def _stress_times():
    calls = [mcp_time.get_current_time(timezone="UTC") for _ in range($calls)]
    calls.append(mcp_time.get_current_time(timezone="Not/AZone" + "x" * 10_000))
    calls.append(mcp_time.convert_time(source_timezone=1, time=[], target_timezone=None))
    return await asyncio.gather(*calls, return_exceptions=True)
_stress_results = await _stress_times()
_stress_ok = sum(1 for r in _stress_results[:-2] if not isinstance(r, BaseException))
json.dumps({"calls": $calls, "ok": _stress_ok, "bad_ones": [type(r).__name__ for r in _stress_results[-2:]]})
"""

OVERSIZED_CELL = """
import json
from mcp import runtime
_stress_nested = "leaf"
for _ in range(500):
    _stress_nested = [_stress_nested]
_stress_out = {}
for _stress_label, _stress_call in (
    ("over_frame", lambda: mcp_everything.echo(message="x" * $over_frame)),
    ("over_result", lambda: mcp_everything.echo(message="x" * $over_result)),
    ("wrong_type", lambda: mcp_everything.echo(message={"not": "a string"})),
    ("nested", lambda: mcp_everything.echo(message=_stress_nested)),
    ("many_args", lambda: runtime.call_tool("everything", "echo", {"k%d" % i: i for i in range(100_000)})),
):
    try:
        _stress_out[_stress_label] = "accepted: %s" % repr(_stress_call())[:100]
    except runtime.MCPError as exc:
        _stress_out[_stress_label] = "refused: %s" % str(exc)[:160]
    except Exception as exc:
        _stress_out[_stress_label] = "%s: %s" % (type(exc).__name__, str(exc)[:160])
json.dumps(_stress_out)
"""

TIMEOUT_CELLS = {
    "ignores interrupt": "while True:\n    try:\n        while True:\n            pass\n"
    "    except KeyboardInterrupt:\n        pass\n",
    "busy loop": "while True:\n    pass\n",
    "SIGINT ignored": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass\n",
    "regex backtracking": "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')\n",
    "sleep": "import time\ntime.sleep(3600)\n",
}

# Bytes written straight to the channel's fd, past the frame encoder: each breaks the
# byte stream, so the bridge must kill that sandbox (and only that sandbox).
RAW_BYTES_CELL = """
import os, time
from mcp import runtime
_stress_ch = $channel
_stress_data = $payload
with _stress_ch._lock:
    _stress_view = memoryview(_stress_data)
    while _stress_view:
        _stress_view = _stress_view[os.write(_stress_ch.out_fd, _stress_view):]
time.sleep(2)
"still running after breaking the channel"
"""
RAW_PAYLOADS = {
    "not JSON": "b'\\x00\\xff not json at all\\n'",
    "deep nesting": 'b\'{"type":"request","id":"deep","method":"list_tools","params":{"server":\''
    " + b'[' * 200_000 + b']' * 200_000 + b'}}\\n'",
    "unterminated over the cap": "b'{' + b' ' * (5 * 2 ** 20)",
    "no type": "b'{\"no_type\": 1}\\n'",
    "invalid UTF-8": 'b\'{"type":"stream","id":"x","name":"stdout","text":"\\xff\\xfe"}\\n\'',
}

EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|ExceptionGroup|Interrupt|Exit)(: .*)?$")
RESET_PROBE = "sorted(name for name in globals() if name.startswith('_stress'))"


# --- what one call gave --------------------------------------------------------------


@dataclass
class CallOutcome:
    answered: bool
    elapsed_ms: float
    status: str  # run_python's structured status, "bridge error", "exception", "unanswered", ...
    value: str | None = None
    text: str = ""
    cancelled_on_purpose: bool = False
    bridge_gone: bool = False


def shown_value(structured: dict[str, Any]) -> str | None:
    """The final value as the REPL shows it: its repr (structuredContent carries plain JSON
    values as JSON data, anything else as value_repr)."""
    if "value" in structured:
        return repr(structured["value"])
    repr_text = structured.get("value_repr")
    return repr_text if isinstance(repr_text, str) else None


def json_value(outcome: CallOutcome) -> Any:
    """The decoded JSON of a cell that ends with json.dumps(...); None if there is none."""
    if outcome.value is None:
        return None
    try:
        return json.loads(ast.literal_eval(outcome.value))
    except (ValueError, SyntaxError, TypeError):
        return None


Expectation = Callable[[CallOutcome], str | None]  # a problem text, or None when as expected


@dataclass
class Variant:
    label: str
    code: str = ""
    timeout: float = HOSTILE_TIMEOUT_S
    items: int = 1  # hostile items this call sends (frames, searches, tool calls, ...)
    reset: bool = False
    arguments: dict[str, Any] | None = None  # sent as is instead of {"code", "timeout", "reset"}
    tool: str = TOOL_NAME
    cancel_after: float | None = None  # the client gives up after this many seconds (on purpose)
    special: Callable[[ClientSession], Awaitable[CallOutcome]] | None = None
    expect: Expectation | None = None

    def call_arguments(self) -> dict[str, Any]:
        if self.arguments is not None:
            return self.arguments
        arguments: dict[str, Any] = {"code": self.code, "timeout": self.timeout}
        if self.reset:
            arguments["reset"] = True
        return arguments


@dataclass
class Kind:
    name: str
    unit: str  # what the items are
    variants: list[Variant]


def cell(template: str, **fields: Any) -> str:
    return string.Template(textwrap.dedent(template).strip() + "\n").substitute(channel=CHANNEL, **fields)


# --- expectations ---------------------------------------------------------------------


def expect_search(expected_ok: int, expected_refused: int) -> Expectation:
    def check(outcome: CallOutcome) -> str | None:
        got = json_value(outcome)
        if not isinstance(got, dict):
            return "no search summary (status %s): %s" % (outcome.status, outcome.text[:300])
        if got.get("ok") != expected_ok or got.get("refused") != expected_refused or got.get("other"):
            return "searches ok %s/%d, over-cap refused %s/%d, accepted over cap %s, other %s %s" % (
                got.get("ok"),
                expected_ok,
                got.get("refused"),
                expected_refused,
                got.get("accepted_over_cap"),
                got.get("other"),
                got.get("examples"),
            )
        return None

    return check


def expect_sent(outcome: CallOutcome) -> str | None:
    got = json_value(outcome)
    if not isinstance(got, dict) or "sent" not in got:
        return "the cell did not finish (status %s): %s" % (outcome.status, outcome.text[:300])
    after = got.get("after")
    if after is not None and "everything" not in str(after):
        return "runtime.discovered_servers() after the flood: %s" % after
    return None


def expect_status(*statuses: str) -> Expectation:
    def check(outcome: CallOutcome) -> str | None:
        if outcome.status not in statuses:
            return "status %s, expected %s: %s" % (outcome.status, " or ".join(statuses), outcome.text[:300])
        return None

    return check


def expect_burst(calls: int, all_ok: bool) -> Expectation:
    def check(outcome: CallOutcome) -> str | None:
        got = json_value(outcome)
        if not isinstance(got, dict):
            return "no burst summary (status %s): %s" % (outcome.status, outcome.text[:300])
        ok, refused = int(got.get("ok") or 0), int(got.get("refused") or 0)
        if (all_ok and ok != calls) or ok + refused != calls or got.get("odd"):
            return "%d of %d echoed correctly, %d refused, odd results %s" % (
                ok,
                calls,
                refused,
                got.get("odd"),
            )
        return None

    return check


def expect_time_burst(calls: int) -> Expectation:
    def check(outcome: CallOutcome) -> str | None:
        got = json_value(outcome)
        if not isinstance(got, dict) or got.get("ok") != calls:
            return "mcp_time burst: %s (status %s)" % (got, outcome.status)
        return None

    return check


def expect_refusals(outcome: CallOutcome) -> str | None:
    got = json_value(outcome)
    if not isinstance(got, dict):
        return "no summary (status %s): %s" % (outcome.status, outcome.text[:300])
    internal = {key: value for key, value in got.items() if "internal bridge error" in str(value)}
    if internal:
        return "answered with an internal bridge error: %s" % internal
    wrong = {
        key: got.get(key)
        for key in ("over_frame", "over_result")
        if not str(got.get(key)).startswith("refused")
    }
    return "not refused: %s" % wrong if wrong else None


def expect_server_kept(outcome: CallOutcome) -> str | None:
    """Bad arguments must fail that call only, not the bridge's connection to the server."""
    got = json_value(outcome)
    if not isinstance(got, dict):
        return "no summary (status %s): %s" % (outcome.status, outcome.text[:300])
    lost = {
        key: value for key, value in got.items() if "went away" in str(value) or "closed its" in str(value)
    }
    if lost:
        return "the bridge lost its connection to the server: %s" % lost
    return None


def expect_clean_namespace(outcome: CallOutcome) -> str | None:
    if outcome.value != "[]":
        return "after reset the namespace still has %s (status %s)" % (outcome.value, outcome.status)
    return None


def expect_answer(outcome: CallOutcome) -> str | None:
    """Client mistakes must be answered with an error result, not a dropped connection."""
    if outcome.status == "exception":
        return "the call raised instead of returning an error result: %s" % outcome.text[:300]
    return None


# --- the hostile kinds ----------------------------------------------------------------


def build_kinds(with_time: bool) -> list[Kind]:
    searches = SEARCH_THREADS * SEARCHES_PER_THREAD
    over_cap_threads = len(range(0, SEARCH_THREADS, OVER_CAP_EVERY))
    search = Variant(
        "%d threads" % SEARCH_THREADS,
        cell(SEARCH_CELL, threads=SEARCH_THREADS, searches=SEARCHES_PER_THREAD, over_every=OVER_CAP_EVERY),
        items=searches + 3 * over_cap_threads,
        expect=expect_search(searches, 3 * over_cap_threads),
    )
    raw_frames = [
        Variant(
            "malformed and unknown",
            cell(RAW_FRAMES_CELL),
            items=RAW_FRAMES_CELL.count('{"type"'),
            expect=expect_sent,
        ),
        Variant(
            "forged bad result",
            cell(FORGED_RESULT_CELL, status="bogus", value="5"),
            items=2,
            expect=expect_status("error"),
        ),
        Variant("forged ok result", cell(FORGED_RESULT_CELL, status="ok", value="\"'forged'\""), items=2),
    ]
    bursts = [
        Variant(
            "%d echo" % BURST_CALLS,
            cell(BURST_CELL, calls=BURST_CALLS),
            items=BURST_CALLS,
            expect=expect_burst(BURST_CALLS, all_ok=True),
        ),
        Variant(
            "%d echo" % WIDE_BURST_CALLS,
            cell(BURST_CELL, calls=WIDE_BURST_CALLS),
            items=WIDE_BURST_CALLS,
            expect=expect_burst(WIDE_BURST_CALLS, all_ok=False),
        ),
    ]
    if with_time:
        bursts.append(
            Variant(
                "100 time calls",
                cell(TIME_BURST_CELL, calls=100),
                items=102,
                expect=expect_time_burst(100),
            )
        )
    return [
        Kind("search threads", "searches", [search]),
        Kind("raw frames", "frames", raw_frames),
        Kind(
            "timeouts",
            "calls",
            [
                Variant(label, code, timeout=LOOP_TIMEOUT_S, expect=expect_status("timeout"))
                for label, code in TIMEOUT_CELLS.items()
            ],
        ),
        Kind(
            "frame flood",
            "frames",
            [
                Variant(
                    "%d frames" % FLOOD_FRAMES,
                    cell(FLOOD_CELL, frames=FLOOD_FRAMES),
                    items=FLOOD_FRAMES,
                    expect=expect_sent,
                )
            ],
        ),
        Kind(
            "lone surrogates",
            "calls",
            [
                Variant(label, cell(code), expect=expect_server_kept if label == "proxied" else None)
                for label, code in SURROGATE_CELLS.items()
            ],
        ),
        Kind("proxied bursts", "tool calls", bursts),
        Kind(
            "protocol breakers",
            "calls",
            [
                Variant(label, cell(RAW_BYTES_CELL, payload=payload))
                for label, payload in RAW_PAYLOADS.items()
            ],
        ),
        Kind(
            "huge output", "calls", [Variant(label, cell(code)) for label, code in HUGE_OUTPUT_CELLS.items()]
        ),
        Kind(
            "oversized arguments",
            "tool calls",
            [
                Variant(
                    "5 calls",
                    # Sized against this run's caps: one over the frame cap, one over the result cap.
                    cell(
                        OVERSIZED_CELL,
                        over_frame=MAX_FRAME_BYTES + 2**20,
                        over_result=MAX_TOOL_RESULT_BYTES + 2**20,
                    ),
                    items=5,
                    expect=expect_refusals,
                )
            ],
        ),
        Kind("client mistakes", "calls", client_variants()),
        Kind(
            "reset", "calls", [Variant("reset: true", RESET_PROBE, reset=True, expect=expect_clean_namespace)]
        ),
    ]


def client_variants() -> list[Variant]:
    big_code = "_stress_big = '" + "x" * 2_000_000 + "'\nlen(_stress_big)\n"
    return [
        Variant("cancelled after 1 s", "import time\ntime.sleep(8)\n", cancel_after=1.0),
        Variant("20 concurrent calls", items=40, special=concurrent_client_calls, expect=expect_status("ok")),
        Variant("2 MB of code", big_code, expect=expect_status("ok")),
        Variant("code is not a string", arguments={"code": 5}, expect=expect_answer),
        Variant("negative timeout", arguments={"code": "1", "timeout": -1}, expect=expect_answer),
        Variant("timeout over the max", arguments={"code": "1", "timeout": 1e308}, expect=expect_answer),
        Variant("unknown argument", arguments={"code": "1", "bogus": [1] * 1000}, expect=expect_answer),
        Variant("unknown tool", arguments={"code": "1"}, tool="no_such_tool", expect=expect_answer),
    ]


async def concurrent_client_calls(session: ClientSession) -> CallOutcome:
    """20 run_python calls (they queue for the one sandbox) and 20 tools/list at once."""
    start = time.perf_counter()
    outcomes: list[str] = []
    limit = HOSTILE_TIMEOUT_S * 20 + UNANSWERED_AFTER_S

    async def one_call(i: int) -> None:
        result = await session.call_tool(TOOL_NAME, {"code": "%d * 2" % i, "timeout": HOSTILE_TIMEOUT_S})
        structured = result.structured_content if isinstance(result.structured_content, dict) else {}
        outcomes.append("ok" if structured.get("value") == i * 2 else "wrong: %s" % text_of(result)[:100])

    async def one_list() -> None:
        tools = await session.list_tools()
        outcomes.append("ok" if [tool.name for tool in tools.tools] == [TOOL_NAME] else "wrong tools/list")

    with anyio.move_on_after(limit):
        try:
            async with anyio.create_task_group() as group:
                for i in range(20):
                    group.start_soon(one_call, i)
                    group.start_soon(one_list)
        except Exception as exc:
            return CallOutcome(True, ms_since(start), "exception", text=describe(exc))
    elapsed = ms_since(start)
    if len(outcomes) < 40:
        return CallOutcome(False, elapsed, "unanswered", text="%d of 40 answered" % len(outcomes))
    wrong = [outcome for outcome in outcomes if outcome != "ok"]
    return CallOutcome(True, elapsed, "ok" if not wrong else "wrong", text="; ".join(wrong[:3]))


# --- calls ----------------------------------------------------------------------------


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    return "%s: %s" % (type(exc).__name__, exc)


async def call(session: ClientSession, variant: Variant) -> CallOutcome:
    if variant.special is not None:
        return await variant.special(session)
    arguments = variant.call_arguments()
    timeout = arguments.get("timeout")
    if not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT_S:
        timeout = HOSTILE_TIMEOUT_S  # an invalid timeout: the bridge refuses it at once
    limit = timeout + UNANSWERED_AFTER_S
    if variant.cancel_after is not None:
        limit = variant.cancel_after
    start = time.perf_counter()
    result: types.CallToolResult | None = None
    with anyio.move_on_after(limit):
        try:
            result = await session.call_tool(variant.tool, arguments)
        except Exception as exc:
            gone = isinstance(exc, anyio.ClosedResourceError | anyio.BrokenResourceError) or (
                "Connection closed" in str(exc)
            )
            return CallOutcome(True, ms_since(start), "exception", text=describe(exc), bridge_gone=gone)
    elapsed = ms_since(start)
    if result is None:
        if variant.cancel_after is not None:
            return CallOutcome(False, elapsed, "cancelled (on purpose)", cancelled_on_purpose=True)
        return CallOutcome(False, elapsed, "unanswered")
    structured = result.structured_content if isinstance(result.structured_content, dict) else None
    if structured is None:
        status = "bridge error" if result.is_error else "no structuredContent"
        return CallOutcome(True, elapsed, status, text=text_of(result))
    return CallOutcome(
        True, elapsed, str(structured.get("status")), value=shown_value(structured), text=text_of(result)
    )


CHECK = Variant("6*7", "6*7", timeout=CHECK_TIMEOUT_S)


# --- the bridge process -----------------------------------------------------------------


def bridge_pid(state_dir: Path) -> int | None:
    """The bridge started with this run's (unique) state directory (tests.harness's
    bridge_pids); our own child first."""
    found: list[tuple[bool, int]] = []
    for pid in bridge_pids(state_dir):
        try:
            found.append((proc_status(pid).get("PPid") == str(os.getpid()), pid))
        except OSError:  # it has just ended
            continue
    return max(found)[1] if found else None


def proc_status(pid: int) -> dict[str, str]:
    status: dict[str, str] = {}
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.strip()
    return status


def alive(pid: int) -> bool:
    try:
        return not proc_status(pid).get("State", "").startswith(("Z", "X"))
    except OSError:
        return False


def child_count(pid: int) -> int:
    count = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if proc_status(int(proc.name)).get("PPid") == str(pid):
                    count += 1
            except OSError:
                continue
    return count


@dataclass
class Series:
    """start / max / end of one sampled figure."""

    values: list[float] = field(default_factory=list)
    start: float | None = None

    def add(self, value: float) -> None:
        self.values.append(value)

    def mark_start(self) -> None:
        self.start = self.values[-1] if self.values else None


# --- the run ----------------------------------------------------------------------------


@dataclass
class KindStats:
    calls: int = 0
    answered: int = 0
    unanswered: int = 0
    cancelled: int = 0
    items: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    unexpected: int = 0
    call_max_ms: float = 0.0
    check_max_ms: float = 0.0
    ping_max_ms: float = 0.0


@dataclass
class Run:
    pid: int | None = None
    activity: str = "start"  # "kind/variant" of the call in progress
    started: float = field(default_factory=time.monotonic)
    rss_mb: Series = field(default_factory=Series)
    threads: Series = field(default_factory=Series)
    fds: Series = field(default_factory=Series)
    children: Series = field(default_factory=Series)
    rss_at_half: float | None = None
    half_time: float = 0.0  # time.monotonic() half way to the deadline
    containers_max: int | None = None
    containers_left: int | None = None
    ping_ms: list[float] = field(default_factory=list)
    pings_unanswered: int = 0
    ping_errors: int = 0
    slow_pings: list[str] = field(default_factory=list)
    ping_max_by_kind: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, KindStats] = field(default_factory=dict)
    iterations: int = 0
    answered: int = 0
    unanswered: int = 0
    cancelled: int = 0
    checks_ok: int = 0
    checks_failed: int = 0
    check_ms: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unexpected_shown: Counter[str] = field(default_factory=Counter)
    bridge_gone: str | None = None
    wedged: str | None = None
    shutdown_ms: float | None = None
    log_bytes: int = 0
    log_lines: int = 0
    duration_s: float = 0.0
    verbose: bool = False

    def trace(self, outcome: CallOutcome) -> None:
        """--verbose: one line per call on stderr."""
        if self.verbose:
            shown = (outcome.value or outcome.text).replace("\n", " | ")[:160]
            print(
                "%s %-45s %-22s %8.0f ms  %s"
                % (self.at(), self.activity[:45], outcome.status, outcome.elapsed_ms, shown),
                file=sys.stderr,
                flush=True,
            )

    def at(self) -> str:
        return "t=%.0fs" % (time.monotonic() - self.started)


def kind_of(activity: str) -> str:
    """The hostile kind of an activity label ("check after <kind>/<variant>" counts too)."""
    return activity.split("/", 1)[0].removeprefix("check after ")


async def pinger(session: ClientSession, run: Run, stop: anyio.Event) -> None:
    """MCP ping every 100 ms for the whole run: its round trip is the bridge's event-loop lag."""
    while not stop.is_set() and run.bridge_gone is None:
        activity, start = run.activity, time.perf_counter()
        answered = False
        with anyio.move_on_after(PING_GIVE_UP_S):
            try:
                await session.send_ping()
                answered = True
            except Exception as exc:
                run.ping_errors += 1
                if run.ping_errors <= 3:
                    run.problems.append(
                        "ping failed at %s during %s: %s" % (run.at(), activity, describe(exc))
                    )
                if isinstance(exc, anyio.ClosedResourceError | anyio.BrokenResourceError):
                    return
        elapsed = ms_since(start)
        if answered:
            run.ping_ms.append(elapsed)
            kind = kind_of(activity)
            run.ping_max_by_kind[kind] = max(run.ping_max_by_kind.get(kind, 0.0), elapsed)
            if elapsed > SLOW_PING_MS and len(run.slow_pings) < 20:
                run.slow_pings.append("%.0f ms at %s, sent during %s" % (elapsed, run.at(), activity))
        elif not stop.is_set():
            run.pings_unanswered += 1
            run.slow_pings.append(
                "no answer within %g s at %s, sent during %s" % (PING_GIVE_UP_S, run.at(), activity)
            )
        await anyio.sleep(max(0.0, PING_INTERVAL_S - elapsed / 1000.0))


async def sampler(run: Run, stop: anyio.Event) -> None:
    """The bridge's VmRSS, threads, open fds and child processes, every 250 ms."""
    assert run.pid is not None
    tick = 0
    while not stop.is_set():
        if not sample(run, run.pid, tick % CHILDREN_EVERY == 0):
            run.bridge_gone = run.bridge_gone or "the bridge process (pid %d) exited at %s during %s" % (
                run.pid,
                run.at(),
                run.activity,
            )
            return
        if run.rss_at_half is None and time.monotonic() >= run.half_time and run.rss_mb.values:
            run.rss_at_half = run.rss_mb.values[-1]
        tick += 1
        await anyio.sleep(SAMPLE_INTERVAL_S)


def sample(run: Run, pid: int, with_children: bool) -> bool:
    try:
        status = proc_status(pid)
        if status.get("State", "").startswith(("Z", "X")):
            return False
        run.rss_mb.add(int(status["VmRSS"].split()[0]) / 1024.0)
        run.threads.add(int(status["Threads"]))
        run.fds.add(len(os.listdir("/proc/%d/fd" % pid)))
        if with_children or not run.children.values:
            run.children.add(child_count(pid))
    except (OSError, KeyError, ValueError):
        return False
    return True


async def count_containers(runtime: str, pid: int) -> int | None:
    argv = [
        runtime,
        "ps",
        "--all",
        "--filter",
        "label=%s=%d" % (OWNER_PID_LABEL, pid),
        "--format",
        "{{.Names}}",
    ]
    try:
        with anyio.fail_after(30):
            done = await anyio.run_process(argv, check=False)
    except (OSError, TimeoutError):
        return None
    if done.returncode != 0:
        return None
    return len([line for line in done.stdout.decode(errors="replace").splitlines() if line.strip()])


async def container_watch(run: Run, runtime: str, stop: anyio.Event) -> None:
    assert run.pid is not None
    while not stop.is_set():
        count = await count_containers(runtime, run.pid)
        if count is not None:
            run.containers_max = max(run.containers_max or 0, count)
        with anyio.move_on_after(CONTAINERS_INTERVAL_S):
            await stop.wait()


def record(run: Run, kind: Kind, variant: Variant, outcome: CallOutcome) -> None:
    stats = run.kinds.setdefault(kind.name, KindStats())
    stats.calls += 1
    stats.items += variant.items
    stats.statuses[outcome.status] += 1
    stats.call_max_ms = max(stats.call_max_ms, outcome.elapsed_ms)
    if outcome.answered:
        stats.answered += 1
        run.answered += 1
    elif outcome.cancelled_on_purpose:
        stats.cancelled += 1
        run.cancelled += 1
    else:
        stats.unanswered += 1
        run.unanswered += 1
        run.problems.append(
            "unanswered: %s/%s at %s (no answer after %.0f s)"
            % (kind.name, variant.label, run.at(), outcome.elapsed_ms / 1000.0)
        )
    problem = variant.expect(outcome) if variant.expect is not None and outcome.answered else None
    if problem is not None:
        stats.unexpected += 1
        run.unexpected_shown[kind.name] += 1
        if run.unexpected_shown[kind.name] <= SHOWN_PER_KIND:
            run.problems.append("unexpected: %s/%s at %s: %s" % (kind.name, variant.label, run.at(), problem))


def record_check(run: Run, kind: Kind, variant: Variant, outcome: CallOutcome) -> None:
    stats = run.kinds[kind.name]
    stats.check_max_ms = max(stats.check_max_ms, outcome.elapsed_ms)
    run.check_ms.append(outcome.elapsed_ms)
    if outcome.answered:
        run.answered += 1
    else:
        run.unanswered += 1
    if outcome.answered and outcome.status == "ok" and outcome.value == "42":
        run.checks_ok += 1
        return
    run.checks_failed += 1
    if run.checks_failed > SHOWN_CHECK_FAILURES:
        return  # the count is in the table
    got = outcome.value or outcome.text or "(no answer after %.0f s)" % (outcome.elapsed_ms / 1000.0)
    run.problems.append(
        "6*7 after %s/%s at %s: %s %s" % (kind.name, variant.label, run.at(), outcome.status, got[:300])
    )


async def hammer(session: ClientSession, run: Run, kinds: Sequence[Kind], deadline: float) -> None:
    """The hostile calls, one kind after another, each followed by run_python("6*7")."""
    turn = 0
    while time.monotonic() < deadline and run.bridge_gone is None:
        kind = kinds[turn % len(kinds)]
        variant = kind.variants[(turn // len(kinds)) % len(kind.variants)]
        run.activity = "%s/%s" % (kind.name, variant.label)
        outcome = await call(session, variant)
        record(run, kind, variant, outcome)
        run.trace(outcome)
        if outcome.bridge_gone:
            run.bridge_gone = "the connection to the bridge broke during %s: %s" % (
                run.activity,
                outcome.text,
            )
            break
        run.activity = "check after %s/%s" % (kind.name, variant.label)
        check = await call(session, CHECK)
        record_check(run, kind, variant, check)
        run.trace(check)
        if check.bridge_gone:
            run.bridge_gone = "the connection to the bridge broke during %s: %s" % (run.activity, check.text)
            break
        if not outcome.answered and not outcome.cancelled_on_purpose and not check.answered:
            # Neither the hostile call nor the one after it was answered: run_python is
            # stuck, and every further call would only wait out its own limit.
            run.wedged = "run_python stopped answering after %s/%s at %s; the run was ended early" % (
                kind.name,
                variant.label,
                run.at(),
            )
            break
        turn += 1
        run.iterations = turn
    run.activity = "end"


WARM_UP = Variant(
    "warm-up",
    "from mcp import runtime\n"
    "runtime.search_tool_docs('echo', limit=3)\n"
    "mcp_everything.echo(message='warm')\n",
    timeout=120.0,
)


async def stress(
    params: StdioServerParameters,
    errlog: TextIO,
    state_dir: Path,
    runtime: str,
    kinds: Sequence[Kind],
    minutes: float,
    run: Run,
) -> None:
    shutdown_start: float | None = None
    try:
        async with stdio_client(params, errlog=errlog) as (read, write):
            try:
                async with ClientSession(read, write) as session:
                    await hammer_session(session, state_dir, runtime, kinds, minutes, run)
            finally:
                # Leaving stdio_client closes the bridge's stdin (then terminates it if it lingers).
                shutdown_start = time.perf_counter()
    finally:
        with anyio.CancelScope(shield=True):
            await after_exit(run, runtime, shutdown_start)


async def hammer_session(
    session: ClientSession, state_dir: Path, runtime: str, kinds: Sequence[Kind], minutes: float, run: Run
) -> None:
    with anyio.fail_after(START_DEADLINE_S):
        await session.initialize()
        run.pid = bridge_pid(state_dir)
        if run.pid is None:
            run.problems.append("the bridge process was not found in /proc: no RSS figures")
        warm = await call(session, WARM_UP)
        if warm.status != "ok":
            run.problems.append("warm-up call: %s %s" % (warm.status, warm.text[:500]))
    run.started = time.monotonic()
    deadline = run.started + minutes * 60.0
    run.half_time = run.started + minutes * 30.0
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        if run.pid is not None:
            sample(run, run.pid, with_children=True)
            for series in (run.rss_mb, run.threads, run.fds, run.children):
                series.mark_start()
            group.start_soon(sampler, run, stop)
            group.start_soon(container_watch, run, runtime, stop)
        group.start_soon(pinger, session, run, stop)
        try:
            await hammer(session, run, kinds, deadline)
        finally:
            run.duration_s = time.monotonic() - run.started
            if run.pid is not None and run.bridge_gone is None:
                sample(run, run.pid, with_children=True)
            stop.set()


async def after_exit(run: Run, runtime: str, shutdown_start: float | None) -> None:
    """How long the bridge took to exit, and whether its sandbox container went with it."""
    if run.pid is None:
        return
    if run.bridge_gone is not None:
        run.shutdown_ms = None  # nothing to measure: it had exited already
    start = shutdown_start if shutdown_start is not None else time.perf_counter()
    for _ in range(int(SHUTDOWN_DEADLINE_S / 0.05)):
        if not alive(run.pid):
            break
        await anyio.sleep(0.05)
    if run.bridge_gone is None:
        run.shutdown_ms = ms_since(start)
        if run.shutdown_ms > SDK_TERMINATE_AFTER_MS:
            run.problems.append(
                "shutdown took %.0f ms: the bridge did not exit by itself within %g ms of its stdin "
                "closing, so the SDK's stdio client terminated it" % (run.shutdown_ms, SDK_TERMINATE_AFTER_MS)
            )
    if alive(run.pid):
        run.problems.append(
            "the bridge (pid %d) was still running %g s after shutdown" % (run.pid, SHUTDOWN_DEADLINE_S)
        )
    for _ in range(20):  # the bridge removes its container on the way out
        run.containers_left = await count_containers(runtime, run.pid)
        if not run.containers_left:
            break
        await anyio.sleep(0.5)


# --- the table --------------------------------------------------------------------------


@dataclass
class Row:
    metric: str
    value: str
    unit: str
    note: str = ""


def render(header: Sequence[str], lines: Sequence[Sequence[str]], right: set[int]) -> str:
    cells = [list(header), *(list(line) for line in lines)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        parts = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), rule, *(fmt(line) for line in cells[1:])])


def num(value: float | None, digits: int = 1) -> str:
    return "ERROR" if value is None else "%.*f" % (digits, value)


def series_rows(label: str, series: Series, unit: str, digits: int, note: str = "") -> list[Row]:
    values = series.values
    return [
        Row("%s start" % label, num(series.start, digits), unit, note),
        Row("%s max" % label, num(max(values) if values else None, digits), unit),
        Row("%s end" % label, num(values[-1] if values else None, digits), unit),
    ]


def metric_rows(run: Run) -> list[Row]:
    pings = run.ping_ms
    rss = series_rows("bridge RSS", run.rss_mb, "MB", 1, "VmRSS of the bridge, after the warm-up")
    rows = [
        Row(
            "duration",
            num(run.duration_s / 60.0, 2),
            "min",
            "%d hostile calls, each followed by 6*7" % run.iterations,
        ),
        rss[0],
        Row("bridge RSS at half time", num(run.rss_at_half), "MB"),
        *rss[1:],
        *series_rows("bridge threads", run.threads, "threads", 0),
        *series_rows("bridge open fds", run.fds, "fds", 0),
        *series_rows("bridge child processes", run.children, "processes", 0, "MCP servers, runtime clients"),
        Row(
            "sandbox containers, max at once",
            "ERROR" if run.containers_max is None else "%d" % run.containers_max,
            "containers",
            "sampled every %g s" % CONTAINERS_INTERVAL_S,
        ),
        Row(
            "sandbox containers left after exit",
            "ERROR" if run.containers_left is None else "%d" % run.containers_left,
            "containers",
        ),
        Row(
            "ping round trip p50",
            num(percentile(pings, 0.50) if pings else None, 2),
            "ms",
            "MCP ping every 100 ms, nearest-rank",
        ),
        Row("ping round trip p99", num(percentile(pings, 0.99) if pings else None, 2), "ms"),
        Row("ping round trip max", num(max(pings) if pings else None, 2), "ms"),
        Row(
            "pings answered",
            "%d" % len(pings),
            "pings",
            "%d over %g ms" % (sum(1 for p in pings if p > SLOW_PING_MS), SLOW_PING_MS),
        ),
        Row(
            "pings unanswered / failed",
            "%d / %d" % (run.pings_unanswered, run.ping_errors),
            "pings",
            "no answer in %g s / error" % PING_GIVE_UP_S,
        ),
        Row("run_python calls answered", "%d" % run.answered, "calls", "hostile calls and checks"),
        Row(
            "run_python calls unanswered",
            "%d" % run.unanswered,
            "calls",
            "no answer within timeout + %g s" % UNANSWERED_AFTER_S,
        ),
        Row(
            "run_python calls cancelled on purpose", "%d" % run.cancelled, "calls", "by the client, after 1 s"
        ),
        Row(
            "6*7 checks ok / failed",
            "%d / %d" % (run.checks_ok, run.checks_failed),
            "calls",
            "the first %d failures are listed below" % SHOWN_CHECK_FAILURES if run.checks_failed else "",
        ),
        Row(
            "6*7 check p50 / max",
            "%s / %s"
            % (
                num(percentile(run.check_ms, 0.5) if run.check_ms else None, 0),
                num(max(run.check_ms) if run.check_ms else None, 0),
            ),
            "ms",
            "includes sandbox restarts",
        ),
        Row(
            "bridge log",
            "%d" % run.log_bytes,
            "bytes",
            "%d lines at MCP_BRIDGE_LOG_LEVEL=WARNING" % run.log_lines,
        ),
        Row(
            "shutdown",
            "n/a" if run.bridge_gone else num(run.shutdown_ms, 0),
            "ms",
            "stdin closed -> bridge process gone",
        ),
    ]
    return rows


def kind_lines(run: Run, kinds: Sequence[Kind]) -> list[list[str]]:
    lines: list[list[str]] = []
    for kind in kinds:
        stats = run.kinds.get(kind.name, KindStats())
        statuses = ", ".join("%s %d" % (status, count) for status, count in sorted(stats.statuses.items()))
        lines.append(
            [
                kind.name,
                "%d" % stats.calls,
                "%d" % stats.answered,
                "%d" % stats.unanswered,
                "%d %s" % (stats.items, kind.unit),
                "%d" % stats.unexpected,
                "%.0f" % stats.call_max_ms,
                "%.0f" % stats.check_max_ms,
                "%.0f" % run.ping_max_by_kind.get(kind.name, 0.0),
                statuses,
            ]
        )
    return lines


def flag_problems(run: Run) -> None:
    rss = run.rss_mb
    if rss.start is not None and rss.values and rss.values[-1] - rss.start > RSS_GROWTH_FLAG_MB:
        run.problems.append(
            "bridge RSS grew by %.1f MB (start %.1f, at half time %s, end %.1f, max %.1f)"
            % (rss.values[-1] - rss.start, rss.start, num(run.rss_at_half), rss.values[-1], max(rss.values))
        )
    if run.slow_pings:
        run.problems.append(
            "pings over %g ms or unanswered:\n    %s" % (SLOW_PING_MS, "\n    ".join(run.slow_pings))
        )
    if run.containers_left:
        run.problems.append(
            "%d sandbox container(s) of this bridge were left after it exited" % run.containers_left
        )
    if run.wedged:
        run.problems.insert(0, "RUN_PYTHON STUCK: %s" % run.wedged)
    if run.bridge_gone:
        run.problems.insert(0, "BRIDGE GONE: %s" % run.bridge_gone)


def read_log(run: Run, errlog: TextIO) -> None:
    errlog.flush()
    errlog.seek(0)
    text = errlog.read()
    run.log_bytes = len(text.encode("utf-8", "replace"))
    run.log_lines = len(text.splitlines())
    if run.verbose:
        print("bridge log:\n%s" % text, file=sys.stderr, flush=True)
    lines = text.splitlines()
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    # The last line of each traceback: the exception itself ("| " prefixes from exception groups).
    raised = [
        line.strip().lstrip("| ").strip()
        for line in lines
        if EXCEPTION_LINE.match(line.strip().lstrip("| ").strip())
    ]
    tracebacks = sum(1 for line in lines if "Traceback (most recent call last)" in line)
    if errors or tracebacks:
        shown = list(dict.fromkeys([*errors[:5], *raised]))[:8]
        run.problems.append(
            "bridge log: %d ERROR lines, %d tracebacks; first ERROR lines and the exceptions raised:\n    %s"
            % (len(errors), tracebacks, "\n    ".join(line[:300] for line in shown))
        )


# --- command line -----------------------------------------------------------------------


def bridge_env(runtime: str, image: str, root: Path, with_time: bool) -> dict[str, str]:
    """An isolated bridge with server-everything (and mcp-server-time) and this run's limits."""
    servers: dict[str, Any] = {"everything": {"command": str(EVERYTHING)}}
    if with_time:
        servers["time"] = {"command": str(TIME_SERVER)}
    limits = {
        "MCP_BRIDGE_MAX_FRAME_BYTES": str(MAX_FRAME_BYTES),
        "MCP_BRIDGE_MAX_TOOL_RESULT_BYTES": str(MAX_TOOL_RESULT_BYTES),
        "MCP_BRIDGE_MAX_OUTPUT": str(MAX_OUTPUT_CHARS),
    }
    return isolated_bridge_env(runtime, image, root, servers, limits)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help="how long to hammer the bridge; fractions work (default %g)" % DEFAULT_MINUTES,
    )
    add_runtime_and_image(parser)
    parser.add_argument(
        "--no-time-server", action="store_true", help="configure server-everything only, not mcp-server-time"
    )
    parser.add_argument(
        "--kinds",
        help="comma list of hostile kinds to run (default: all), named as in the table, "
        "e.g. 'raw frames,reset'",
    )
    parser.add_argument(
        "--skip",
        help="comma list of kinds or kind/variant labels to leave out, e.g. 'frame flood,protocol "
        "breakers/deep nesting'",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="one line per call and the bridge's log on stderr"
    )
    return parser


def split_names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def choose_kinds(
    all_kinds: list[Kind], wanted: str | None, skipped: str | None
) -> tuple[list[Kind], list[str]]:
    """--kinds (kind names) and --skip (kind names or kind/variant labels); unknown names."""
    known = {kind.name: kind for kind in all_kinds}
    labels = {"%s/%s" % (kind.name, variant.label) for kind in all_kinds for variant in kind.variants}
    names, skip = split_names(wanted), split_names(skipped)
    unknown = [name for name in names if name not in known]
    unknown += [name for name in skip if name not in known and name not in labels]
    chosen: list[Kind] = []
    for kind in [known[name] for name in names if name in known] if names else all_kinds:
        if kind.name in skip:
            continue
        variants = [v for v in kind.variants if "%s/%s" % (kind.name, v.label) not in skip]
        if variants:
            chosen.append(Kind(kind.name, kind.unit, variants))
    return chosen, unknown


async def bench(
    runtime: str, image: str, minutes: float, kinds: list[Kind], with_time: bool, verbose: bool
) -> None:
    run = Run(verbose=verbose)
    print("stressing the bridge on %s for %g min ..." % (runtime, minutes), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-stress-") as tmp, captured_stderr() as errlog:
        root = Path(tmp)
        params = StdioServerParameters(
            command=server_command(), env=bridge_env(runtime, image, root, with_time)
        )
        try:
            await stress(params, errlog, root / "state", runtime, kinds, minutes, run)
        except Exception as exc:  # report and go on: this is a measurement, not a test
            run.problems.append("the run ended early: %s%s" % (describe(exc), tail_of(errlog)))
        read_log(run, errlog)
    flag_problems(run)
    servers = "everything, time" if with_time else "everything"
    print(
        "runtime: %s   image: %s   servers: %s   frame cap %d B, tool result cap %d B"
        % (runtime, image, servers, MAX_FRAME_BYTES, MAX_TOOL_RESULT_BYTES)
    )
    print(
        render(
            ("metric", "value", "unit", "note"),
            [[r.metric, r.value, r.unit, r.note] for r in metric_rows(run)],
            {1},
        )
    )
    print()
    header = (
        "hostile kind",
        "calls",
        "answered",
        "unanswered",
        "sent",
        "unexpected",
        "call max ms",
        "6*7 max ms",
        "ping max ms",
        "statuses",
    )
    print(render(header, kind_lines(run, kinds), {1, 2, 3, 5, 6, 7, 8}), flush=True)
    print("\nproblems:" if run.problems else "\nproblems: none")
    for problem in run.problems:
        print("- %s" % problem)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    minutes: float = max(0.05, args.minutes)
    with_time = not args.no_time_server and TIME_SERVER.exists()
    kinds, unknown = choose_kinds(build_kinds(with_time), args.kinds, args.skip)
    if unknown or not kinds:
        names = "\n".join(
            "  %s: %s" % (kind.name, ", ".join(v.label for v in kind.variants))
            for kind in build_kinds(with_time)
        )
        print(
            "nothing measured: unknown or no kinds (%s); the kinds and their variants are:\n%s"
            % (", ".join(unknown) or "all skipped", names)
        )
        return 0
    missing = missing_programs()
    if missing:
        print("nothing measured:\n" + "\n".join("- " + line for line in missing))
        return 0
    anyio.run(bench, args.runtime, args.image, minutes, kinds, with_time, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
