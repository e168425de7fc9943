"""The stdio transport as a client's bytes meet it: raw lines into a real bridge
process's stdin, raw lines read from its stdout. Every request gets a reply, malformed
or not (JSON-RPC 2.0), a line over the cap is discarded as it arrives, and the bridge
goes on serving."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.stdio import StdioServerParameters

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_env, console_script

ONE_RUNTIME = True  # the transport is the host's; the container only proves the bridge goes on

REPLY_DEADLINE = 10.0  # seconds: only to tell "no reply" from a reply, never a speed check


class RawBridge:
    """The installed console script on pipes, spoken to in raw JSON-RPC lines."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.pending = b""

    def send(self, line: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + b"\n")
        self.process.stdin.flush()

    def send_message(self, message: dict[str, Any]) -> None:
        self.send(json.dumps(message).encode())

    def read_line(self, deadline: float = REPLY_DEADLINE) -> bytes | None:
        """The next line the bridge writes, or None if none comes within `deadline`."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        end = time.monotonic() + deadline
        while b"\n" not in self.pending:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def reply(self, deadline: float = REPLY_DEADLINE) -> Any:
        line = self.read_line(deadline)
        assert line is not None, "no reply within %g s" % deadline
        return json.loads(line)

    def reply_to(self, request_id: int | str, deadline: float) -> dict[str, Any]:
        """The response to `request_id`, past any notification the bridge sends first."""
        end = time.monotonic() + deadline
        while True:
            message = self.reply(max(0.1, end - time.monotonic()))
            if isinstance(message, dict) and message.get("id") == request_id:
                return message

    def peak_memory_kib(self) -> int:
        for line in Path("/proc/%d/status" % self.process.pid).read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/%d/status" % self.process.pid)


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"},
    },
}


@contextmanager
def raw_bridge(env: dict[str, str], cwd: Path) -> Iterator[RawBridge]:
    process = subprocess.Popen(
        [console_script()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd
    )
    raw = RawBridge(process)
    try:
        raw.send_message(INITIALIZE)
        assert "result" in raw.reply_to(0, 60)
        raw.send_message({"jsonrpc": "2.0", "method": "notifications/initialized"})
        yield raw
    finally:
        assert process.stdin is not None
        process.stdin.close()  # EOF: the bridge removes its sandbox and exits
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"code": "1"}
    for _ in range(levels):
        value = {"a": value}
    return value


def tool_call(request_id: int | str, arguments: Any) -> bytes:
    params = {"name": "run_python", "arguments": arguments}
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}).encode()


BIG_CODE = "x = 1\n" * (5 * 1024 * 1024 // 6 + 1)  # over the 4 MiB cap
# (what the line is, its bytes, the error code and the id its reply must carry)
MALFORMED: list[tuple[str, bytes, int, int | str | None]] = [
    ("not JSON", b'{"jsonrpc": "2.0", "id": 1, "method": ', -32700, None),
    ("not an object", b"42", -32600, None),
    ("a string", b'"ping"', -32600, None),
    ("an empty batch", b"[]", -32600, None),
    ("JSON-RPC 1.0", b'{"jsonrpc": "1.0", "id": 2, "method": "ping"}', -32600, 2),
    ("no jsonrpc member", b'{"id": 3, "method": "ping"}', -32600, 3),
    ("a float id", b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', -32600, None),
    ("an object id", b'{"jsonrpc": "2.0", "id": {"n": 1}, "method": "ping"}', -32600, None),
    ("a null id", b'{"jsonrpc": "2.0", "id": null, "method": "ping"}', -32600, None),
    ("a boolean id", b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', -32600, None),
    ("a method that is no string", b'{"jsonrpc": "2.0", "id": 4, "method": 7}', -32600, 4),
    ("params as a list", b'{"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": [1]}', -32602, 5),
    (
        "params as a string",
        b'{"jsonrpc": "2.0", "id": "s", "method": "tools/call", "params": 1}',
        -32600,
        "s",
    ),
    ("arguments 250 levels deep", tool_call(6, nested(250)), -32602, 6),
    (
        "arguments 10**5 levels deep",
        tool_call(7, {"a": "D"}).replace(b'"D"', b"[" * 10**5 + b"]" * 10**5),
        -32602,
        7,
    ),
    ("a line over the cap", tool_call("big", {"code": BIG_CODE}), -32600, "big"),
    ("an unknown tool", b'{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"no"}}', -32602, 8),
    (
        "a cursor never given",
        b'{"jsonrpc":"2.0","id":9,"method":"tools/list","params":{"cursor":"z"}}',
        -32602,
        9,
    ),
]


def test_every_malformed_message_gets_its_error_and_the_bridge_goes_on(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env = bridge_env(engine, state_dir, HOME=str(tmp_path))
    with raw_bridge(env, tmp_path) as raw:
        for name, line, code, request_id in MALFORMED:
            raw.send(line)
            reply = raw.reply()
            assert isinstance(reply, dict), "%s: %r" % (name, reply)
            assert reply["jsonrpc"] == "2.0" and "result" not in reply, "%s: %r" % (name, reply)
            assert (reply["error"]["code"], reply["id"]) == (code, request_id), "%s: %r" % (name, reply)
            assert reply["error"]["message"], name

        raw.send(b'[{"jsonrpc": "2.0", "id": 10, "method": "ping"}, 5, {"jsonrpc": "2.0", "method": "x"}]')
        batch = raw.reply()  # a batch of errors: one per request (a notification gets none)
        assert [(item["id"], item["error"]["code"]) for item in batch] == [(10, -32600), (None, -32600)]
        assert "one per line" in batch[0]["error"]["message"]

        raw.send(b'{"jsonrpc": "2.0", "id": 11, "method": "resources/templates/list"}')
        assert raw.reply() == {"jsonrpc": "2.0", "id": 11, "result": {"resourceTemplates": []}}

        raw.send(b"")  # a blank line, an invalid notification and a stray response answer nothing
        raw.send(b'{"jsonrpc": "2.0", "method": "notifications/x", "params": [1]}')
        raw.send(b'{"jsonrpc": "2.0", "id": 999, "result": {}}')
        raw.send(tool_call(12, {"code": "6 * 7"}))
        result = raw.reply_to(12, 180)["result"]
        assert not result.get("isError") and "42" in json.dumps(result)


def test_a_line_over_the_cap_is_never_held_whole(state_dir: Path, tmp_path: Path) -> None:
    """64 MB on one line: discarded as it streams in (the bridge's peak memory grows by
    far less than the line), its request answered with the cap, and the bridge goes on."""
    env = bridge_env(None, state_dir, HOME=str(tmp_path), MCP_BRIDGE_PREWARM="0")
    with raw_bridge(env, tmp_path) as raw:
        before = raw.peak_memory_kib()
        raw.send(tool_call(1, {"code": "#" + "x" * (64 * 1024 * 1024)}))
        reply = raw.reply(60)
        assert (reply["id"], reply["error"]["code"]) == (1, -32600)
        assert (
            "over the bridge's cap of %d bytes" % bridge.STDIO_MAX_MESSAGE_BYTES in reply["error"]["message"]
        )
        assert raw.peak_memory_kib() - before < 32 * 1024
        raw.send(b'{"jsonrpc": "2.0", "id": 2, "method": "ping"}')
        assert raw.reply() == {"jsonrpc": "2.0", "id": 2, "result": {}}


@pytest.mark.parametrize(
    "line",
    [
        b"   ",
        b'{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": "x"}',
        b'{"jsonrpc": "2.0", "id": 3, "result": 5, "error": 5}',
        b'[{"jsonrpc": "2.0", "method": "notifications/initialized"}]',
    ],
)
def test_what_json_rpc_never_answers_gets_no_reply(line: bytes) -> None:
    assert bridge.client_line_item(line) is None


def test_a_discarded_line_is_answered_with_the_id_at_its_head() -> None:
    request = bridge.OversizedLine(
        10**9, b'{"jsonrpc":"2.0","id":"a1","method":"tools/call","params":{"x', b'"}}'
    )
    reply = json.loads(bridge.client_line_item(request, 4096) or b"")  # type: ignore[arg-type]
    assert (reply["id"], reply["error"]["code"]) == ("a1", -32600)
    assert "1000000000 bytes, over the bridge's cap of 4096 bytes" in reply["error"]["message"]
    response = bridge.OversizedLine(10**9, b'{"jsonrpc":"2.0","id":4,"result":{"x', b'"}}')
    assert bridge.client_line_item(response, 4096) is None  # a response is never answered


def test_the_last_line_counts_without_a_newline_after_it() -> None:
    splitter = bridge.LineSplitter(8)
    assert splitter.feed(b'1\n{"a"') == [b"1"]
    assert splitter.rest() == b'{"a"'
    assert splitter.rest() is None
    splitter.feed(b"x" * 20)
    assert splitter.rest() == bridge.OversizedLine(20, b"x" * 20, b"x" * 20)


# --- the pipes themselves: on the loop where they are pipes, in a thread otherwise -------


def client_stdio(kind: str) -> tuple[int, int]:
    """A client's end and the bridge's end of its stdout: a pipe (Python's clients) or a
    socketpair (Node's libuv), both blocking."""
    if kind == "pipe":
        return os.pipe()
    ours, theirs = socket.socketpair()
    return ours.detach(), theirs.detach()


@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_a_line_longer_than_the_pipe_takes_at_once_arrives_whole_in_order(kind: str) -> None:
    async def main() -> bytes:
        read_end, write_end = client_stdio(kind)
        assert bridge.stdio_kind(write_end) == kind
        writer = bridge.LineWriter(write_end)
        got = bytearray()

        def drain() -> None:
            while chunk := os.read(read_end, 1 << 16):
                got.extend(chunk)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, drain)
                await writer.write_line(b"small")
                await writer.write_line(b"x" * 300_000)  # past the pipe's 64 KiB: the thread's
                await writer.write_line(b"after")
                writer.close()
                os.close(write_end)
        finally:
            os.close(read_end)
        return bytes(got)

    assert anyio.run(main) == b"small\n" + b"x" * 300_000 + b"\nafter\n"


@pytest.mark.parametrize("kind", ["pipe", "socket"])
def test_a_client_that_stops_reading_never_stops_the_loop(kind: str) -> None:
    async def main() -> tuple[int, bytes]:
        read_end, write_end = client_stdio(kind)
        os.set_blocking(write_end, False)
        with suppress(BlockingIOError):
            while True:
                os.write(write_end, b"." * 4096)  # the client's pipe is full: it reads nothing
        os.set_blocking(write_end, True)
        writer = bridge.LineWriter(write_end)
        ticks = 0
        async with anyio.create_task_group() as group:
            group.start_soon(writer.write_line, b"reply")
            for _ in range(20):  # the loop goes on while the reply waits for room
                await anyio.sleep(0.01)
                ticks += 1
            tail = b""
            while not tail.endswith(b"reply\n"):  # the client reads again: the reply arrives
                tail = (tail + os.read(read_end, 1 << 16))[-64:]
        writer.close()
        os.close(read_end)
        os.close(write_end)
        return ticks, tail

    ticks, tail = anyio.run(main)
    assert ticks == 20 and tail.endswith(b"reply\n")


def test_a_reply_the_pipe_has_room_for_is_written_at_once_and_the_rest_waits_its_turn() -> None:
    # MessageWriter's short way: no cancel scope, no pass of the loop. It must never put a
    # line ahead of one still being written, nor write to a client that has gone.
    async def main() -> None:
        read_end, write_end = os.pipe()
        writer = bridge.LineWriter(write_end)
        assert writer.write_now(b"first") and os.read(read_end, 100) == b"first\n"
        assert not writer.write_now(b"x" * (select.PIPE_BUF + 1))  # could be split: the long way
        async with writer.lock:  # a line is being written (in a thread): wait behind it
            assert not writer.write_now(b"second")
        os.close(read_end)
        assert writer.write_now(b"to nobody")  # the client has gone: dropped, said once
        assert writer.closed and writer.write_now(b"dropped too")
        os.close(write_end)

    anyio.run(main)


def test_a_request_goes_to_the_servers_stdin_at_once_and_a_large_one_the_long_way() -> None:
    # capped_stdio_transport hands a line to asyncio's pipe transport under anyio's process
    # stream (a private attribute: an anyio that moves it must fail here, not slow down).
    echo = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()\n"
    params = StdioServerParameters(command=sys.executable, args=["-c", echo])

    def ping(number: int, pad: str = "") -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": number, "method": "ping", "params": {"p": pad}}).encode()

    async def main() -> list[object]:
        log = bridge.ServerProcessLog("echo")
        with anyio.fail_after(20):
            async with bridge.capped_stdio_transport(params, 1_000_000, log) as (read, write):
                assert write.write_now is not None
                assert write.write_now(ping(1))
                assert not write.write_now(ping(2, "x" * 70_000))  # over the high-water mark
                first = await read.receive()
        return [first.message.id]

    assert anyio.run(main) == [1]


def test_a_bridge_whose_stdin_is_a_file_reads_it_in_a_thread(state_dir: Path, tmp_path: Path) -> None:
    # Not a pipe (the loop cannot wait on a file): read by a worker thread, to its end.
    requests = tmp_path / "requests.jsonl"
    lines = [INITIALIZE, {"jsonrpc": "2.0", "method": "notifications/initialized"}]
    lines.append({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with requests.open("rb") as file:
        assert bridge.stdio_kind(file.fileno()) is None
    env = bridge_env(None, state_dir, MCP_BRIDGE_PREWARM="0", HOME=str(tmp_path))
    with requests.open("rb") as stdin:
        done = subprocess.run(
            [console_script()],
            stdin=stdin,
            capture_output=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
            check=False,
        )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [reply.get("id") for reply in replies] == [0, 1], done.stderr[-2000:]
    assert replies[1]["result"]["tools"][0]["name"] == "run_python"
