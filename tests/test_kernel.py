"""The in-sandbox kernel, run for real as a subprocess on the host and driven through
its frame channel exactly as the bridge drives it inside the container."""

from __future__ import annotations

import collections
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mcp_sandbox_kernel
from mcp_sandbox_kernel import (
    BOOTSTRAP,
    PROTOCOL_VERSION,
    FrameDecoder,
    OutputKeeper,
    OutputPump,
    boot_payload,
    encode_frame,
)
from tests.harness import PipeCollector

KERNEL_PATH = Path(mcp_sandbox_kernel.__file__).resolve()
MAX_FRAME = 8 * 1024 * 1024
MAX_OUTPUT = 1000
WAIT = 10.0  # generous upper bound for one frame; tests normally finish in milliseconds
RECENT_FRAMES = 8  # frames shown in a failure message

Frame = dict[str, Any]


class KernelProcess:
    """The bridge's side of one kernel: sends frames on its stdin, decodes its stdout on
    a reader thread into a queue (None marks the end of the frames) and collects its
    stderr on a second thread, so every failure can show what the kernel said so far
    without waiting for it to exit."""

    def __init__(self, workdir: Path, max_output_chars: int = MAX_OUTPUT, booted: bool = False) -> None:
        """``booted``: started as the bridge starts it on a remote engine, ``python3 -I -c
        BOOTSTRAP`` with the kernel source and config as the first bytes of its stdin."""
        config_path = workdir / "session.json"
        config = {
            "protocol": PROTOCOL_VERSION,
            "max_frame_bytes": MAX_FRAME,
            "max_output_chars": max_output_chars,
            "workdir": str(workdir),
            "output_dir": str(workdir / "outputs"),
        }
        config_path.write_text(json.dumps(config))
        argv = [sys.executable, "-I", "-c", BOOTSTRAP] if booted else [sys.executable, str(KERNEL_PATH)]
        self.process = subprocess.Popen(
            [*argv, *([] if booted else [str(config_path)])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self.key = os.urandom(32)  # the supervisor signs what it sends with it
        self.frames: queue.Queue[Frame | None] = queue.Queue()
        self.recent: collections.deque[Frame] = collections.deque(maxlen=RECENT_FRAMES)
        self.reader_error: BaseException | None = None
        self._ended = False  # the test has been handed the end of the frames
        self._ids = itertools.count(1)
        self._stdout_reader = threading.Thread(target=self._read_frames, name="kernel-stdout", daemon=True)
        assert self.process.stderr is not None
        self._stderr_reader = PipeCollector(self.process.stderr.fileno(), "kernel-stderr")
        self._stdout_reader.start()
        if booted:
            assert self.process.stdin is not None
            self.process.stdin.write(boot_payload(KERNEL_PATH.read_text(), config))
        self.send({"type": "key", "key": self.key.hex()})  # as the bridge does, before anything else

    # --- reader threads: each reads its pipe until end of file, and only close() ---------
    # --- closes the pipes, after joining them (a pipe closed under a blocked os.read() ---
    # --- gets its fd number reused by the next test's kernel, whose frames it steals) ----

    def _read_frames(self) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        decoder = FrameDecoder(MAX_FRAME, key=self.key)
        try:
            while data := os.read(fd, 1 << 16):
                for frame in decoder.feed(data):
                    self.frames.put(frame)
        except Exception as exc:  # e.g. ProtocolError: shown by the next failure
            self.reader_error = exc
            self.frames.put(None)
            try:
                while os.read(fd, 1 << 16):  # drain to end of file, so close() can join us
                    pass
            except OSError:
                pass
        else:
            self.frames.put(None)

    def stderr_text(self) -> str:
        """What the kernel wrote to its stderr so far (never blocks on the kernel)."""
        return self._stderr_reader.text()

    def _end_reason(self) -> str:
        if self.reader_error is not None:
            return "the kernel's output is not a valid frame stream"
        return "the kernel closed its channel"

    def failure(self, message: str) -> str:
        """``message`` with everything that explains it: the kernel's state and stderr,
        the frame reader's state and the last frames the test received."""
        if self.process.poll() is not None:
            self._stderr_reader.join(timeout=2)  # the kernel is gone: its stderr is complete soon
        returncode = self.process.poll()
        state = "running" if returncode is None else "exited with code %d" % returncode
        reader = "reading" if self._stdout_reader.is_alive() else "at end of file"
        if self.reader_error is not None:
            reader = "failed: %r" % (self.reader_error,)
        lines = [
            message,
            "kernel pid %d: %s; frame reader: %s" % (self.process.pid, state, reader),
            "last %d frames received:" % len(self.recent),
            *("  " + _cut(repr(frame), 300) for frame in self.recent),
            "kernel stderr so far: %s" % (_cut(self.stderr_text(), 4000) or "(empty)"),
        ]
        return "\n".join(lines)

    # --- the bridge's side of the protocol -------------------------------------------------

    def send(self, frame: Frame) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(encode_frame(frame, MAX_FRAME))
            self.process.stdin.flush()
        except OSError as exc:
            raise AssertionError(self.failure("could not send %r: %r" % (frame, exc))) from exc

    def next_frame(self, timeout: float = WAIT, expecting: str = "a frame") -> Frame:
        if self._ended:
            raise AssertionError(self.failure("waiting for %s after the kernel's channel ended" % expecting))
        try:
            frame = self.frames.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                self.failure("no frame from the kernel within %.1fs (waiting for %s)" % (timeout, expecting))
            ) from None
        if frame is None:
            self._ended = True
            raise AssertionError(self.failure("%s (waiting for %s)" % (self._end_reason(), expecting)))
        self.recent.append(frame)
        return frame

    def assert_no_frame(self, within: float) -> None:
        try:
            frame = self.frames.get(timeout=within)
        except queue.Empty:
            return
        if frame is None:
            self._ended = True
            raise AssertionError(self.failure(self._end_reason()))
        self.recent.append(frame)
        raise AssertionError(self.failure("unexpected frame: %r" % (frame,)))

    def start(self, code: str, execute_id: str | None = None) -> str:
        """Send an execute frame; return its id."""
        execute_id = execute_id or "exec-%d" % next(self._ids)
        self.send({"type": "execute", "id": execute_id, "code": code})
        return execute_id

    def collect(self, execute_id: str, timeout: float = WAIT) -> tuple[list[Frame], Frame]:
        """Frames up to and including the result for execute_id, which must come within
        ``timeout`` (so a kernel that keeps talking cannot hold the test forever)."""
        deadline = time.monotonic() + timeout
        before: list[Frame] = []
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            frame = self.next_frame(remaining, expecting="the result of %s" % execute_id)
            if frame["type"] == "result" and frame.get("id") == execute_id:
                return before, frame
            before.append(frame)

    def execute(self, code: str) -> tuple[list[Frame], Frame]:
        return self.collect(self.start(code))

    def run(self, code: str) -> Frame:
        """Execute and return the result frame, which must be status ok."""
        _, result = self.execute(code)
        assert result["status"] == "ok", result
        return result

    def wait_for_text(self, execute_id: str, text: str, timeout: float = WAIT) -> None:
        """Wait until stream frames of execute_id carry `text` (the code is running)."""
        deadline = time.monotonic() + timeout
        seen = ""
        while text not in seen:
            remaining = max(0.0, deadline - time.monotonic())
            frame = self.next_frame(remaining, expecting="%r on the output of %s" % (text, execute_id))
            assert frame["type"] == "stream" and frame["id"] == execute_id, self.failure(
                "expected output of %s, got %r" % (execute_id, frame)
            )
            seen += frame["text"]

    def barrier(self, timeout: float = WAIT) -> list[Frame]:
        """Return once the kernel's frame reader has handled every frame sent before
        (it answers an unknown frame type with an error frame, in order with the
        others); returns the frames that came before that error frame."""
        self.send({"type": "barrier"})
        deadline = time.monotonic() + timeout
        before: list[Frame] = []
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            frame = self.next_frame(remaining, expecting="the error frame answering the barrier")
            if frame["type"] == "error" and "barrier" in frame.get("message", ""):
                return before
            before.append(frame)

    def close(self) -> None:
        """End the kernel (closing its stdin is how the bridge stops it), wait for both
        readers to reach end of file, and only then close the pipes they read."""
        stdin = self.process.stdin
        if stdin is not None:
            try:
                stdin.close()
            except OSError:  # BrokenPipeError: the kernel is already gone
                pass
        killed = False
        try:
            self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            killed = True
            self.process.kill()
            self.process.wait()
        for reader in (self._stdout_reader, self._stderr_reader):
            reader.join(timeout=WAIT)
        stuck = [reader.name for reader in (self._stdout_reader, self._stderr_reader) if reader.is_alive()]
        if stuck:
            # Closing now would bring the race back: leave these fds open, and say so.
            raise AssertionError(self.failure("%s saw no end of file after the kernel exited" % stuck))
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
        if killed:
            raise AssertionError(self.failure("the kernel did not exit within %gs of stdin closing" % WAIT))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "... [%d more characters]" % (len(text) - limit)


def stream_text(frames: list[Frame], name: str) -> str:
    return "".join(frame["text"] for frame in frames if frame["type"] == "stream" and frame["name"] == name)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[KernelProcess, Frame]]:
    kernel = KernelProcess(tmp_path)
    try:
        hello = kernel.next_frame()
        yield kernel, hello
    finally:
        kernel.close()


@pytest.fixture
def kernel(started: tuple[KernelProcess, Frame]) -> KernelProcess:
    return started[0]


# --- start-up -------------------------------------------------------------------------


def test_first_frame_is_hello_with_the_protocol_version(started: tuple[KernelProcess, Frame]) -> None:
    kernel, hello = started

    assert hello["type"] == "hello"
    assert hello["protocol"] == PROTOCOL_VERSION
    assert hello["pid"] == kernel.process.pid
    assert hello["python"] == "%d.%d.%d" % sys.version_info[:3]


def test_code_runs_in_the_configured_workdir(kernel: KernelProcess, tmp_path: Path) -> None:
    result = kernel.run("import os\nos.getcwd()")

    assert result["value"] == repr(str(tmp_path))


# --- namespace and values --------------------------------------------------------------


def test_namespace_persists_across_executes(kernel: KernelProcess) -> None:
    kernel.run("counter = 41")
    kernel.run("counter += 1")

    assert kernel.run("counter")["value"] == "42"


def test_final_expression_value_is_returned_as_repr(kernel: KernelProcess) -> None:
    assert kernel.run("x = 'hi'\nx + '!'")["value"] == "'hi!'"
    assert kernel.run("{'a': [1, 2]}")["value"] == "{'a': [1, 2]}"


def test_none_value_is_not_shown(kernel: KernelProcess) -> None:
    assert kernel.run("None")["value"] is None
    assert kernel.run("print('side effect')")["value"] is None


def test_statement_only_code_has_no_value(kernel: KernelProcess) -> None:
    assert kernel.run("y = 3")["value"] is None


def test_underscore_holds_the_last_value(kernel: KernelProcess) -> None:
    kernel.run("40 + 2")
    kernel.run("None")  # a None value does not replace _

    assert kernel.run("_ + 1")["value"] == "43"


def test_top_level_await_works_and_the_value_is_shown(kernel: KernelProcess) -> None:
    result = kernel.run("import asyncio\nawait asyncio.sleep(0)\nawait asyncio.sleep(0, result='slept')")

    assert result["value"] == "'slept'"


def test_async_functions_persist_and_can_be_awaited_later(kernel: KernelProcess) -> None:
    kernel.run("import asyncio\nasync def double(n):\n    await asyncio.sleep(0)\n    return 2 * n")

    assert kernel.run("total = await double(4)\ntotal")["value"] == "8"


def test_imports_and_functions_persist(kernel: KernelProcess) -> None:
    kernel.run("import math\ndef area(r):\n    return math.pi * r * r")

    assert kernel.run("round(area(2), 3)")["value"] == "12.566"


def test_a_long_value_comes_as_head_and_tail_with_the_count_between(kernel: KernelProcess) -> None:
    result = kernel.run("'a' + 'y' * 5000 + 'z'")

    assert result["value"] == "'a" + "y" * (MAX_OUTPUT // 2 - 2)
    assert result["cut"]["value"] == {"count": 5004 - MAX_OUTPUT, "tail": "y" * (MAX_OUTPUT // 2 - 2) + "z'"}


def test_broken_repr_does_not_break_the_result(kernel: KernelProcess) -> None:
    code = "class Bad:\n    def __repr__(self):\n        raise RuntimeError('no repr')\nBad()"

    value = kernel.run(code)["value"]

    assert "unrepresentable Bad" in value
    assert "no repr" in value


# --- results ----------------------------------------------------------------------------


def test_each_execute_gets_exactly_one_result_and_nothing_after_it(kernel: KernelProcess) -> None:
    first = kernel.start("print('one')\n1")
    second = kernel.start("print('two')\n2")
    third = kernel.start("raise ValueError('three')")

    frames: list[Frame] = []
    while sum(frame["type"] == "result" for frame in frames) < 3:
        frames.append(kernel.next_frame())
    kernel.assert_no_frame(within=0.3)

    results = [frame for frame in frames if frame["type"] == "result"]
    assert [frame["id"] for frame in results] == [first, second, third]
    for execute_id in (first, second, third):
        ids = [frame.get("id") for frame in frames]
        last_index = max(index for index, frame_id in enumerate(ids) if frame_id == execute_id)
        assert frames[last_index]["type"] == "result", execute_id
    assert stream_text([f for f in frames if f["id"] == first], "stdout") == "one\n"
    assert stream_text([f for f in frames if f["id"] == second], "stdout") == "two\n"


def test_an_execute_that_arrives_while_a_queued_one_starts_waits_its_turn(tmp_path: Path) -> None:
    # The supervisor alone, its channels recorded. The race once lost a result: the queued
    # execute left the queue before it became the running one, and an execute arriving in
    # between found the supervisor idle and was run alongside it.
    to_bridge: list[Frame] = []
    to_executor: list[Frame] = []

    class Recorder:
        def __init__(self, into: list[Frame]) -> None:
            self.into = into

        def send(self, frame: Frame) -> None:
            self.into.append(dict(frame))

    config = {"output_dir": str(tmp_path / "outputs")}
    supervisor = mcp_sandbox_kernel.Supervisor(Recorder(to_bridge), config, str(tmp_path / "c.json"))  # type: ignore[arg-type]
    supervisor.child = types.SimpleNamespace(channel=Recorder(to_executor))  # type: ignore[assignment]
    supervisor.ready.set()
    arrivals = [{"type": "execute", "id": "third", "code": "3"}]

    def ready_wait(timeout: float | None = None) -> bool:  # the window: an execute arrives now
        while arrivals:
            supervisor.on_execute(arrivals.pop())
        return True

    supervisor.on_execute({"type": "execute", "id": "first", "code": "1"})
    supervisor.on_execute({"type": "execute", "id": "second", "code": "2"})
    supervisor.ready.wait = ready_wait  # type: ignore[method-assign]
    supervisor.finish("first", "ok")
    assert [frame["id"] for frame in to_executor] == ["first", "second"]
    assert supervisor.running == "second"
    supervisor.finish("second", "ok")
    supervisor.finish("third", "ok")

    assert [frame["id"] for frame in to_executor] == ["first", "second", "third"]
    assert [frame["id"] for frame in to_bridge if frame["type"] == "result"] == ["first", "second", "third"]

    # No executor to run them: each queued execute is refused in turn, none is left waiting.
    supervisor.ready.wait = lambda timeout=None: True  # type: ignore[method-assign]
    for name in ("fourth", "fifth", "sixth"):
        supervisor.on_execute({"type": "execute", "id": name, "code": "4"})
    supervisor.ready.wait = lambda timeout=None: False  # type: ignore[method-assign]
    supervisor.finish("fourth", "ok")
    results = [frame for frame in to_bridge if frame["type"] == "result"][3:]
    assert [(frame["id"], frame["status"]) for frame in results] == [
        ("fourth", "ok"),
        ("fifth", "error"),
        ("sixth", "error"),
    ]
    assert not supervisor.queued and supervisor.running is None


def test_result_frame_has_the_documented_fields(kernel: KernelProcess) -> None:
    execute_id = kernel.start("7")
    _, result = kernel.collect(execute_id)

    assert result == {
        "type": "result",
        "id": execute_id,
        "status": "ok",
        "value": "7",
        "error": None,
        "json": 7,
    }


# --- booted from stdin (no IPC mount: remote engines, Kubernetes) ------------------------


@pytest.fixture
def booted(tmp_path: Path) -> Iterator[KernelProcess]:
    kernel = KernelProcess(tmp_path, booted=True)
    try:
        assert kernel.next_frame()["type"] == "hello"
        yield kernel
    finally:
        kernel.close()


def test_a_booted_kernel_keeps_state_and_hides_its_frames_from_tracebacks(booted: KernelProcess) -> None:
    booted.run("import sys\nx = 41")

    assert booted.run("x + 1")["value"] == "42"
    assert booted.run("sys.stdin.read()")["value"] == "''"  # the boot payload is not the code's stdin
    error = booted.execute("1 / 0")[1]["error"]
    assert error["type"] == "ZeroDivisionError"
    assert "/kernel/" not in error["traceback"] and "mcp_sandbox_kernel" not in error["traceback"]


def test_a_booted_kernel_boots_each_fresh_executor_from_its_payload(booted: KernelProcess) -> None:
    booted.run("x = 1")

    died = booted.execute("import os\nos._exit(3)")[1]
    after = booted.execute("x")[1]

    assert died["status"] == "crashed"
    assert after["error"]["type"] == "NameError"  # a fresh executor, booted again
    assert booted.run("2 + 2")["value"] == "4"


def test_a_bootstrap_whose_stdin_ends_early_exits_with_a_reason(tmp_path: Path) -> None:
    payload = boot_payload("print('never')", {})
    result = subprocess.run(
        [sys.executable, "-I", "-c", BOOTSTRAP],
        input=payload[:50],
        capture_output=True,
        timeout=30,
        check=False,
    )

    assert result.returncode != 0
    assert b"stdin ended before the kernel arrived" in result.stderr


# --- errors ------------------------------------------------------------------------------


def test_traceback_shows_cell_name_and_user_line_but_not_the_kernel(kernel: KernelProcess) -> None:
    kernel.run("def inner():\n    return 1 / 0")

    _, result = kernel.execute("x = 1\ninner()  # call it")

    assert result["status"] == "error"
    error = result["error"]
    assert error["type"] == "ZeroDivisionError"
    assert error["message"] == "division by zero"
    traceback_text = error["traceback"]
    assert '"<cell-1>", line 2, in inner' in traceback_text
    assert '"<cell-2>", line 2' in traceback_text
    assert "inner()  # call it" in traceback_text
    assert "return 1 / 0" in traceback_text
    assert traceback_text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "mcp_sandbox_kernel" not in traceback_text
    assert str(KERNEL_PATH.parent) not in traceback_text


def test_traceback_of_awaited_code_hides_kernel_frames(kernel: KernelProcess) -> None:
    _, result = kernel.execute("import asyncio\nawait asyncio.sleep(0)\nraise KeyError('k')")

    traceback_text = result["error"]["traceback"]
    assert result["status"] == "error"
    assert "<cell-1>" in traceback_text
    assert "raise KeyError('k')" in traceback_text
    assert "mcp_sandbox_kernel" not in traceback_text


def test_chained_exception_traceback_hides_kernel_frames(kernel: KernelProcess) -> None:
    code = "try:\n    {}['missing']\nexcept KeyError as exc:\n    raise RuntimeError('wrapped') from exc"

    _, result = kernel.execute(code)

    traceback_text = result["error"]["traceback"]
    assert "KeyError: 'missing'" in traceback_text
    assert "RuntimeError: wrapped" in traceback_text
    assert "mcp_sandbox_kernel" not in traceback_text


def test_syntax_error_is_reported_as_an_error_result(kernel: KernelProcess) -> None:
    _, result = kernel.execute("x = (1 +\n")

    assert result["status"] == "error"
    assert result["error"]["type"] == "SyntaxError"
    assert "<cell-1>" in result["error"]["traceback"]
    assert "mcp_sandbox_kernel" not in result["error"]["traceback"]
    assert kernel.run("1 + 1")["value"] == "2"


def test_system_exit_in_user_code_does_not_kill_the_kernel(kernel: KernelProcess) -> None:
    kernel.run("survivor = 'still here'")

    _, result = kernel.execute("import sys\nsys.exit(3)")

    assert result["status"] == "error"
    assert result["error"]["type"] == "SystemExit"
    assert kernel.process.poll() is None
    assert kernel.run("survivor")["value"] == "'still here'"


def test_recursion_error_is_reported_and_the_kernel_survives(kernel: KernelProcess) -> None:
    _, result = kernel.execute("def down(n):\n    return down(n + 1)\ndown(0)")

    assert result["status"] == "error"
    assert result["error"]["type"] == "RecursionError"
    assert "Previous line repeated" in result["error"]["traceback"]
    assert kernel.run("'alive'")["value"] == "'alive'"


def test_exception_with_a_broken_str_does_not_kill_the_kernel(kernel: KernelProcess) -> None:
    # Bug: Kernel.execute() builds the error message with a bare str(exc) inside its
    # `except BaseException` block; when __str__ raises, the new exception escapes
    # Kernel.serve() and the kernel dies with all state.
    kernel.run("kept = 'state'")
    code = "class Odd(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')\nraise Odd()"

    _, result = kernel.execute(code)

    assert result["status"] == "error"
    assert result["error"]["type"] == "Odd"
    assert kernel.run("kept")["value"] == "'state'"


def test_huge_exception_message_stays_within_the_output_cap(kernel: KernelProcess) -> None:
    # Bug: the value and the error message are capped, but error["traceback"] is not:
    # its last line repeats str(exc) in full, so one `raise ValueError(big)` puts the
    # whole string into the result (and render_compact shows it to the model).
    _, result = kernel.execute("raise ValueError('x' * 100_000)")

    error = result["error"]
    assert result["status"] == "error"
    assert len(error["message"]) <= 2000
    assert len(error["traceback"]) <= MAX_OUTPUT + 500


def test_execute_without_code_is_an_error_result(kernel: KernelProcess) -> None:
    kernel.send({"type": "execute", "id": "no-code"})

    _, result = kernel.collect("no-code")

    assert result["status"] == "error"
    # The supervisor checks the frame before the executor sees it.
    assert result["error"]["type"] == "ProtocolError" and "code" in result["error"]["message"]
    assert kernel.run("'ok'")["value"] == "'ok'"


def test_unknown_frame_type_gets_an_error_frame_and_kernel_keeps_working(kernel: KernelProcess) -> None:
    kernel.send({"type": "bogus", "id": "b1"})

    frame = kernel.next_frame()

    assert frame["type"] == "error"
    assert "unknown frame type 'bogus'" in frame["message"]
    assert kernel.run("6 * 7")["value"] == "42"


def test_unknown_fields_in_known_frames_are_ignored(kernel: KernelProcess) -> None:
    kernel.send({"type": "execute", "id": "extra", "code": "5", "future_field": {"x": 1}})

    _, result = kernel.collect("extra")

    assert result["value"] == "5"


# --- output capture ------------------------------------------------------------------------


def test_all_kinds_of_output_arrive_as_stream_frames_in_order_before_the_result(
    kernel: KernelProcess,
) -> None:
    code = (
        "import os, subprocess, sys\n"
        "print('from print')\n"
        "os.write(1, b'{not a frame\\n')\n"
        "subprocess.run(['echo', 'from subprocess'], check=True)\n"
        "print('to stderr', file=sys.stderr)\n"
        "subprocess.run(['sh', '-c', 'echo sub-err >&2'], check=True)\n"
        "print('last')\n"
    )
    execute_id = kernel.start(code)

    frames, result = kernel.collect(execute_id)

    assert result["status"] == "ok"
    assert all(frame["type"] == "stream" and frame["id"] == execute_id for frame in frames)
    assert stream_text(frames, "stdout") == "from print\n{not a frame\nfrom subprocess\nlast\n"
    assert stream_text(frames, "stderr") == "to stderr\nsub-err\n"


def test_output_that_looks_like_a_frame_stays_stream_text(kernel: KernelProcess) -> None:
    # A forged result frame for the very execute that prints it.
    fake = encode_frame({"type": "result", "id": "forge", "status": "ok", "value": "'forged'"}, MAX_FRAME)

    frames, result = kernel.collect(kernel.start("import os\nos.write(1, %r)\n'real'" % fake, "forge"))

    assert result["value"] == "'real'"
    assert stream_text(frames, "stdout") == fake.decode()


def test_binary_junk_on_stdout_does_not_break_the_channel(kernel: KernelProcess) -> None:
    frames, result = kernel.execute(
        "import os\nos.write(1, bytes(range(256)))\nos.write(2, b'\\xff\\xfe\\x00')"
    )

    assert result["status"] == "ok"
    text = stream_text(frames, "stdout")
    assert "\ufffd" in text
    assert "ABCDEFGHIJKLMNOPQRSTUVWXYZ" in text
    assert kernel.run("'channel intact'")["value"] == "'channel intact'"


def test_output_over_the_budget_keeps_head_and_tail_and_saves_the_whole(
    kernel: KernelProcess, tmp_path: Path
) -> None:
    frames, result = kernel.execute("print('<' + 'x' * 5000 + '>')\nimport sys\nsys.stderr.write('e' * 1500)")

    half = MAX_OUTPUT // 2
    assert stream_text(frames, "stdout") == "<" + "x" * (half - 1)  # only the head is streamed
    assert stream_text(frames, "stderr") == "e" * half
    cut = result["cut"]
    assert cut["stdout"]["tail"] == "x" * (half - 2) + ">\n"
    assert cut["stdout"]["count"] == 5003 - MAX_OUTPUT
    assert cut["stderr"]["count"] == 1500 - MAX_OUTPUT
    saved = Path(cut["stdout"]["file"])
    assert saved.parent == tmp_path / "outputs"
    assert saved.read_text() == "<" + "x" * 5000 + ">\n"
    assert Path(cut["stderr"]["file"]).read_text() == "e" * 1500


def test_output_that_fits_has_no_cut_and_no_file(kernel: KernelProcess, tmp_path: Path) -> None:
    kernel.execute("print('x' * 5000)")

    frames, result = kernel.execute("print('fresh')")

    assert stream_text(frames, "stdout") == "fresh\n"
    assert "cut" not in result
    assert [path.name for path in (tmp_path / "outputs").iterdir()] == ["1.stdout"]


def test_output_between_half_and_whole_budget_comes_whole_as_head_and_tail(kernel: KernelProcess) -> None:
    frames, result = kernel.execute("print('x' * %d, end='')" % (MAX_OUTPUT - 10))

    assert stream_text(frames, "stdout") + result["cut"]["stdout"]["tail"] == "x" * (MAX_OUTPUT - 10)
    assert result["cut"]["stdout"]["count"] == 0
    assert "file" not in result["cut"]["stdout"]


def test_a_value_sharing_an_overfull_budget_makes_the_streams_saved(kernel: KernelProcess) -> None:
    _, result = kernel.execute("print('x' * 400)\n'v' * 800")

    assert result["cut"]["stdout"]["count"] == 0  # the bridge cuts it; the whole is saved
    assert Path(result["cut"]["stdout"]["file"]).read_text() == "x" * 400 + "\n"


def test_many_small_writes_over_the_budget_are_counted_exactly(kernel: KernelProcess) -> None:
    frames, result = kernel.execute("for i in range(300):\n    print('%05d' % i)")

    cut = result["cut"]["stdout"]
    assert len(stream_text(frames, "stdout")) == len(cut["tail"]) == MAX_OUTPUT // 2
    assert cut["count"] == 300 * 6 - MAX_OUTPUT
    whole = "".join("%05d\n" % i for i in range(300))
    assert stream_text(frames, "stdout") + cut["tail"] == whole[: MAX_OUTPUT // 2] + whole[-MAX_OUTPUT // 2 :]
    assert Path(cut["file"]).read_text() == whole


def test_what_the_code_puts_where_output_is_saved_never_blocks_or_redirects_it(
    kernel: KernelProcess, tmp_path: Path
) -> None:
    # A FIFO at the next save path once hung the supervisor (opening one to write waits for
    # a reader, under its lock): no result, not even after an interrupt. A symlink there
    # would have had the output written wherever it points.
    outputs, victim = tmp_path / "outputs", tmp_path / "victim.txt"
    victim.write_text("untouched")
    kernel.run(  # call 1; call 2 saves to 2.stdout and 2.stderr
        "import os\nos.makedirs(%r, exist_ok=True)\n"
        "os.mkfifo(os.path.join(%r, '2.stdout'))\nos.symlink(%r, os.path.join(%r, '2.stderr'))"
        % (str(outputs), str(outputs), str(victim), str(outputs))
    )

    _, result = kernel.execute("import sys\nprint('x' * 5000)\nsys.stderr.write('e' * 1500)")

    assert result["status"] == "ok", result
    assert "file" not in result["cut"]["stdout"] and "file" not in result["cut"]["stderr"]
    assert (outputs / "2.stdout").is_fifo() and victim.read_text() == "untouched"
    _, later = kernel.execute("print('y' * 5000)")
    assert Path(later["cut"]["stdout"]["file"]).read_text() == "y" * 5000 + "\n"


def test_only_the_latest_calls_keep_their_saved_output(kernel: KernelProcess, tmp_path: Path) -> None:
    for _ in range(mcp_sandbox_kernel.SAVED_CALLS + 3):
        kernel.execute("print('x' * 5000)")

    saved = sorted(int(path.stem) for path in (tmp_path / "outputs").iterdir())
    assert saved == list(range(4, mcp_sandbox_kernel.SAVED_CALLS + 4))


# --- interrupts ---------------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["while True:\n    pass", "import time\ntime.sleep(100)"])
def test_interrupt_stops_running_code_and_keeps_state(kernel: KernelProcess, loop: str) -> None:
    kernel.run("kept = 'yes'")
    execute_id = kernel.start("print('started', flush=True)\n" + loop)
    kernel.wait_for_text(execute_id, "started")
    began = time.monotonic()

    kernel.send({"type": "interrupt", "id": execute_id})
    _, result = kernel.collect(execute_id)

    assert time.monotonic() - began < 5
    assert result["status"] == "interrupted"
    assert result["error"]["type"] == "KeyboardInterrupt"
    assert "mcp_sandbox_kernel" not in result["error"]["traceback"]
    assert kernel.run("kept")["value"] == "'yes'"


def test_interrupt_stops_awaited_code(kernel: KernelProcess) -> None:
    execute_id = kernel.start("import asyncio\nprint('started', flush=True)\nawait asyncio.sleep(100)")
    kernel.wait_for_text(execute_id, "started")

    kernel.send({"type": "interrupt", "id": execute_id})
    _, result = kernel.collect(execute_id)

    assert result["status"] == "interrupted"
    assert kernel.run("await asyncio.sleep(0, result='loop still usable')")["value"] == "'loop still usable'"


def test_interrupt_that_lands_in_a_coroutines_own_code_stops_it(kernel: KernelProcess) -> None:
    # The task ends with the KeyboardInterrupt itself, and asyncio never stops the loop
    # for such a task: the kernel once ran the loop again for it and hung until killed.
    code = "async def spin():\n    print('started', flush=True)\n    while True:\n        pass\nawait spin()"
    kernel.run("kept = 'yes'")
    execute_id = kernel.start(code)
    kernel.wait_for_text(execute_id, "started")

    kernel.send({"type": "interrupt", "id": execute_id})
    _, result = kernel.collect(execute_id)

    assert result["status"] == "interrupted", result
    assert "in spin" in result["error"]["traceback"]  # where it landed: the print or the loop
    assert kernel.run("kept")["value"] == "'yes'"
    awaited = kernel.run("import asyncio\nawait asyncio.sleep(0, result='loop usable')")
    assert awaited["value"] == "'loop usable'"


def test_interrupt_for_a_different_id_is_ignored(kernel: KernelProcess, tmp_path: Path) -> None:
    # The code runs until the test creates `go`, which it does only after the barrier
    # shows the kernel has handled the interrupt: so the interrupt met running code.
    code = (
        "import os, time\n"
        "print('started', flush=True)\n"
        "deadline = time.monotonic() + %r\n"
        "while not os.path.exists('go') and time.monotonic() < deadline:\n"
        "    time.sleep(0.005)\n"
        "'finished' if os.path.exists('go') else 'gave up waiting for go'"
    )
    execute_id = kernel.start(code % WAIT)
    kernel.wait_for_text(execute_id, "started")

    kernel.send({"type": "interrupt", "id": "someone-else"})
    early = kernel.barrier()
    (tmp_path / "go").touch()
    _, result = kernel.collect(execute_id)

    assert result["status"] == "ok", result
    assert result["value"] == "'finished'"
    assert all(frame["type"] == "stream" and frame["id"] == execute_id for frame in early), early


def test_late_interrupt_between_executes_does_not_hit_the_next_one(kernel: KernelProcess) -> None:
    finished = kernel.start("1")
    kernel.collect(finished)

    kernel.send({"type": "interrupt", "id": finished})
    assert kernel.barrier() == []  # the interrupt has been handled, with nothing running
    result = kernel.run("import time\ntime.sleep(0.2)\n'unharmed'")

    assert result["value"] == "'unharmed'"


# --- end of input ---------------------------------------------------------------------------


def test_closing_stdin_ends_the_kernel_even_while_code_spins(kernel: KernelProcess) -> None:
    execute_id = kernel.start("print('started', flush=True)\nwhile True:\n    pass")
    kernel.wait_for_text(execute_id, "started")

    assert kernel.process.stdin is not None
    kernel.process.stdin.close()

    assert kernel.process.wait(timeout=WAIT) == 0


def test_closing_stdin_when_idle_ends_the_kernel(kernel: KernelProcess) -> None:
    assert kernel.process.stdin is not None
    kernel.process.stdin.close()

    assert kernel.process.wait(timeout=WAIT) == 0


def test_sigterm_ends_the_kernel_and_its_executor(kernel: KernelProcess) -> None:
    executors = mcp_sandbox_kernel.live_descendants(kernel.process.pid)
    assert len(executors) == 1, executors

    kernel.process.send_signal(signal.SIGTERM)

    # The supervisor keeps SIGTERM's default action (a handler would let the code, which
    # may signal PID 1 in a container, stop it); the executor ends with its channel.
    assert kernel.process.wait(timeout=WAIT) == -signal.SIGTERM

    def alive(pid: int) -> bool:
        try:
            stat = Path("/proc/%d/stat" % pid).read_text()
        except OSError:
            return False
        return stat[stat.rfind(")") + 2] != "Z"  # a zombie has ended; its new parent reaps it

    deadline = time.monotonic() + WAIT
    while alive(executors[0]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(executors[0])


# --- robustness against user code touching the capture fds ---------------------------------


def test_user_code_closing_fd_1_does_not_kill_the_kernel(kernel: KernelProcess) -> None:
    kernel.run("kept = 1")

    kernel.execute("import os\nos.close(1)")
    frames, result = kernel.execute("print('captured again')\nkept")

    assert result["value"] == "1"
    assert stream_text(frames, "stdout") == "captured again\n"


def test_user_code_redirecting_fd_1_is_repaired_for_the_next_execute(
    kernel: KernelProcess, tmp_path: Path
) -> None:
    target = tmp_path / "redirected.txt"
    code = "import os\nfd = os.open(%r, os.O_WRONLY | os.O_CREAT)\nos.dup2(fd, 1)\nos.write(1, b'to file')"
    began = time.monotonic()

    kernel.run(code % str(target))
    frames, _ = kernel.execute("print('back on the channel')")

    assert time.monotonic() - began < 3  # the output sync does not wait on the lost pipe
    assert stream_text(frames, "stdout") == "back on the channel\n"
    assert target.read_bytes() == b"to file"  # no sync markers leaked into the user's file


def test_user_code_replacing_sys_stdout_is_repaired_for_the_next_execute(kernel: KernelProcess) -> None:
    kernel.run("import io, sys\nsys.stdout = io.StringIO()\nsys.stderr.close()")

    frames, _ = kernel.execute("print('visible')\nprint('also', file=sys.stderr)")

    assert stream_text(frames, "stdout") == "visible\n"
    assert stream_text(frames, "stderr") == "also\n"


def test_user_code_setting_sys_stdout_to_none_does_not_kill_the_kernel(kernel: KernelProcess) -> None:
    # Bug: Kernel.flush_output() catches OSError/ValueError from sys.stdout.flush() but
    # not the AttributeError of a stream replaced by None, so the exception escapes
    # Kernel.serve() and the kernel dies with all state.
    kernel.run("import sys\nkept = 'state'")

    kernel.execute("sys.stdout = None")

    assert kernel.run("kept")["value"] == "'state'"


# --- units: OutputPump and OutputKeeper ---------------------------------------------------------


def _pump(deliver: Any) -> tuple[OutputPump, int]:
    read_fd, write_fd = os.pipe()
    writer = os.dup(write_fd)  # the executor's end; the pump keeps write_fd, as the supervisor's copy
    pump = OutputPump("stdout", read_fd, write_fd, deliver)
    pump.start()
    return pump, writer


def _within(seconds: float, check: Any) -> None:
    """Run ``check()`` in a thread: its failure is the test's, and so is its hanging (a pump
    whose locking is broken can leave a read blocked)."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            check()
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "still running after %gs: a drain or a read hangs" % seconds
    if failures:
        raise failures[0]


def test_drain_delivers_everything_written_before_it_once_and_in_order() -> None:
    # The pump thread races the draining thread for every chunk: whoever reads, each chunk
    # is delivered once, in order, and before drain() returns.
    delivered: list[str] = []
    pump, writer = _pump(lambda _name, text: delivered.append(text))

    def write_and_drain() -> None:
        for number in range(2000):
            os.write(writer, b"%d;" % number)
            assert pump.drain()
            assert "".join(delivered).endswith(";%d;" % number if number else "0;")
        assert "".join(delivered) == "".join("%d;" % number for number in range(2000))

    try:
        _within(WAIT, write_and_drain)
    finally:
        os.close(writer)
        pump.close_write_end()
        pump.join(WAIT)
    assert not pump.is_alive()
    assert pump.drain()  # after the end: nothing to read, and no read of a closed descriptor


def test_drain_gives_up_while_the_pump_is_stuck_delivering() -> None:
    entered, release = threading.Event(), threading.Event()

    def deliver(_name: str, _text: str) -> None:
        entered.set()
        release.wait(WAIT)  # a bridge that does not read its channel

    pump, writer = _pump(deliver)
    try:
        os.write(writer, b"x")
        assert entered.wait(WAIT)
        assert pump.drain(timeout=0.05) is False
    finally:
        release.set()
        os.close(writer)
        pump.close_write_end()
        pump.join(WAIT)


def test_a_pump_ends_once_every_writer_is_gone_after_delivering_the_rest() -> None:
    delivered: list[str] = []
    pump, writer = _pump(lambda _name, text: delivered.append(text))
    os.write(writer, "last words \u00e9".encode())
    os.close(writer)
    pump.close_write_end()
    pump.join(WAIT)

    assert not pump.is_alive()
    assert "".join(delivered) == "last words \u00e9"


def test_output_keeper_streams_half_the_budget_keeps_half_as_tail_and_counts_between(tmp_path: Path) -> None:
    keeper = OutputKeeper(10, str(tmp_path))
    keeper.reset()

    assert keeper.admit("stdout", "abc") == "abc"
    assert keeper.admit("stdout", "defghij") == "de"
    assert keeper.admit("stdout", "klmno") == ""
    assert keeper.admit("stderr", "日本語です") == "日本語です"  # characters, not bytes
    cuts = keeper.finish(0)

    assert cuts == {
        "stdout": {"count": 5, "tail": "klmno", "file": str(tmp_path / "1.stdout")},
        "stderr": {"count": 0, "tail": "", "file": str(tmp_path / "1.stderr")},  # the whole is over budget
    }
    assert (tmp_path / "1.stdout").read_text() == "abcdefghijklmno"
    assert (tmp_path / "1.stderr").read_text() == "日本語です"


def test_output_keeper_reset_starts_a_new_budget(tmp_path: Path) -> None:
    keeper = OutputKeeper(6, str(tmp_path))
    keeper.reset()
    keeper.admit("stdout", "1234567890")

    keeper.reset()

    assert keeper.admit("stdout", "xyz") == "xyz"
    assert keeper.finish(0) == {}


def test_output_keeper_reports_a_file_it_could_not_write(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    keeper = OutputKeeper(4, str(blocked))
    keeper.reset()

    keeper.admit("stdout", "abcdefghij")

    assert keeper.finish(0) == {"stdout": {"count": 6, "tail": "ij"}}  # no file: it failed


def test_output_keeper_is_safe_under_concurrent_writers(tmp_path: Path) -> None:
    keeper = OutputKeeper(1000, str(tmp_path))
    keeper.reset()
    kept: list[str] = []

    def write() -> None:
        for _ in range(500):
            kept.append(keeper.admit("stdout", "ab"))

    threads = [threading.Thread(target=write) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    cut = keeper.finish(0)["stdout"]
    assert sum(len(text) for text in kept) == 500
    assert len(cut["tail"]) == 500 and cut["count"] == 4 * 500 * 2 - 1000
    assert len((tmp_path / "1.stdout").read_text()) == 4 * 500 * 2


# --- deferred calls: which calls a cell awaits --------------------------------------------


def deferred(source: str, functions: dict[str, Any] | None = None) -> str:
    """The rewritten cell, with the markers abbreviated: D(f, ...) defers a call, A(x)
    makes x awaitable, AS(xs) each item of xs."""
    import ast

    tree = mcp_sandbox_kernel.defer_awaited_calls(ast.parse(source), {} if functions is None else functions)
    text = ast.unparse(tree)
    for marker, short in (("__mcp_awaitables__", "AS"), ("__mcp_awaitable__", "A"), ("__mcp_defer__", "D")):
        text = text.replace(marker, short)
    return text


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x = f(1)", "x = f(1)"),
        ("x = await f(1, k=2)", "x = await A(D(f, 1, k=2))"),
        ("await g(f(1))", "await A(D(g, f(1)))"),  # only the awaited call
        ("await (r := f())", "await A((r := D(f)))"),
        ("asyncio.gather(f(), g())", "asyncio.gather(A(D(f)), A(D(g)))"),
        ("gather(*(f(i) for i in r))", "gather(*AS((D(f, i) for i in r)))"),
        ("asyncio.wait_for(f(), t())", "asyncio.wait_for(A(D(f)), t())"),
        ("asyncio.run(f())", "asyncio.run(A(D(f)))"),
        ("subprocess.run(f())", "subprocess.run(f())"),  # `run`/`wait` count only as asyncio's
        ("asyncio.wait([f(), g()])", "asyncio.wait(AS([D(f), D(g)]))"),
        ("tg.create_task(f())", "tg.create_task(A(D(f)))"),
        ("t = f()\nawait t", "t = D(f)\nawait A(t)"),
        (
            "ts = [f(i) for i in r]\nawait asyncio.gather(*ts)",
            "ts = [D(f, i) for i in r]\nawait A(D(asyncio.gather, *AS(ts)))",
        ),
        ("ts = []\nts.append(f())\nasyncio.gather(*ts)", "ts = []\nts.append(D(f))\nasyncio.gather(*AS(ts))"),
        (
            "ts = {k: f(k) for k in r}\ngather(*ts.values())",
            "ts = {k: D(f, k) for k in r}\ngather(*AS(ts.values()))",
        ),
        (
            "ts = [f(i) for i in r]\nfor t in ts:\n    await t",
            "ts = [D(f, i) for i in r]\nfor t in ts:\n    await A(t)",
        ),
        ("ys = [f(i) for i in r]\nprint(ys)", "ys = [f(i) for i in r]\nprint(ys)"),
        (
            "async def timed(c):\n    return await c\ntimed(f(), g())",
            "async def timed(c):\n    return await A(c)\ntimed(D(f), g())",
        ),
        (  # a name awaited in one function says nothing about the same name elsewhere
            "async def w(t):\n    return await t\nt = f()",
            "async def w(t):\n    return await A(t)\nt = f()",
        ),
    ],
)
def test_calls_are_deferred_exactly_where_the_code_awaits_them(source: str, expected: str) -> None:
    assert deferred(source) == expected


def test_functions_that_await_a_parameter_are_remembered_from_cell_to_cell() -> None:
    functions: dict[str, Any] = {}
    deferred("async def timed(name, coro):\n    return name, await coro", functions)
    assert deferred("timed(f(), coro=g())", functions) == "timed(f(), coro=D(g))"
    deferred("def timed(name, coro):\n    return coro", functions)  # redefined: awaits nothing
    assert deferred("timed(f(), coro=g())", functions) == "timed(f(), coro=g())"


@pytest.mark.parametrize(
    ("source", "may_defer"),
    [
        ("1", False),
        ("for _ in range(9):\n    last = mcp_x.echo(message='x')\nlast", False),
        ("x = [f(i) for i in r]", False),
        ("await f()", True),
        ("async def g():\n    return 1", True),  # a definition is recorded (or forgotten)
        ("def g():\n    return 1", True),
        ("h = lambda: f()", True),
        ("asyncio.gather(f(), g())", True),
        ("gather(f())", True),
        ("timed(f())", True),  # a function known to await its parameter
    ],
)
def test_a_cell_is_rewritten_only_where_it_could_defer_a_call(source: str, may_defer: bool) -> None:
    import ast

    functions: dict[str, Any] = {"timed": (["coro"], {"coro"})}
    assert mcp_sandbox_kernel._may_defer(ast.parse(source), functions) is may_defer


def test_only_deferrable_callees_return_awaitables() -> None:
    class Tool:
        _mcp_deferrable = True

        def __call__(self) -> bool:
            return mcp_sandbox_kernel.take_deferral()

    assert mcp_sandbox_kernel.defer_call(Tool()) is True
    assert Tool()() is False  # written without await: no deferral
    assert mcp_sandbox_kernel.defer_call(mcp_sandbox_kernel.take_deferral) is False


def test_a_signature_is_rebuilt_from_the_hosts_text() -> None:
    text = (
        "write_file(path: str, mode: Literal['a', 'w'] = 'w', tags: list[str] | None = None) -> dict  # Write"
    )
    signature = mcp_sandbox_kernel.signature_from_text(text)
    assert str(signature) == (
        "(*, path: str, mode: Literal['a', 'w'] = 'w', tags: list[str] | None = None, raw: bool = False)"
        " -> dict"
    )
    assert str(mcp_sandbox_kernel.signature_from_text("anything(**kwargs: Any) -> Any")) == (
        "(*, raw: bool = False, **kwargs: Any) -> Any"
    )
    assert mcp_sandbox_kernel.signature_from_text("broken(") is None


def test_images_and_files_of_one_call_stay_within_one_frame(tmp_path: Path) -> None:
    collector = mcp_sandbox_kernel.ImageCollector(10, 1000, 1000, max_total=2000)
    png = b"\x89PNG\r\n\x1a\n" + b"x" * 992  # 1000 bytes: 1336 in base64
    collector.add(png, "image/png")
    collector.add(png, "image/png")  # would make 2672 base64 bytes
    (tmp_path / "f").write_bytes(b"y" * 1000)
    with pytest.raises(ValueError, match="does not fit in this call's result"):
        collector.attach(tmp_path / "f")
    images, files, notes = collector.take()
    assert (
        len(images) == 1
        and files == []
        and notes
        == [
            "Image 2 was not returned: the call's images and files together would not fit in one result; "
            "show fewer or smaller images per call."
        ]
    )
    collector.attach(tmp_path / "f")  # a new call starts from nothing


# --- frame authentication --------------------------------------------------------------------


def test_a_kernel_whose_first_line_is_not_the_key_runs_nothing(tmp_path: Path) -> None:
    config = tmp_path / "session.json"
    config.write_text(json.dumps({"protocol": PROTOCOL_VERSION, "workdir": str(tmp_path)}))
    execute = encode_frame({"type": "execute", "id": "e1", "code": "open('ran', 'w')"}, MAX_FRAME)

    done = subprocess.run(
        [sys.executable, str(KERNEL_PATH), str(config)],
        input=execute,
        capture_output=True,
        timeout=WAIT,
        check=False,
    )

    assert done.returncode == 2
    (frame,) = FrameDecoder(MAX_FRAME).feed(done.stdout)
    assert frame["type"] == "error" and "the first frame must be the key" in frame["message"]
    assert not (tmp_path / "ran").exists()


def test_every_frame_of_the_kernel_is_signed_and_numbered(kernel: KernelProcess) -> None:
    # The harness decodes with the key: a frame without a valid MAC would never arrive.
    assert kernel.run("print('signed')\n1")["value"] == "1"
    assert kernel.run("2")["value"] == "2"


# --- a server that is not here: Python's error, completed ---------------------------------


def raised_by(code: str) -> BaseException:
    """The exception real code raises, run in a fresh namespace."""
    namespace: dict[str, Any] = {}
    try:
        exec(code, namespace)
    except BaseException as exc:
        return exc
    raise AssertionError("%r raised nothing" % code)


@pytest.mark.parametrize(
    ("code", "alias"),
    [
        ("mcp_time", "time"),
        ("def f():\n    return mcp_time\nf()", "time"),  # a global looked up in a function
        ("raise NameError(\"name 'mcp_time' is not defined\")", "time"),  # 3.9's NameError has no .name
        ("def f():\n    print(mcp_x)\n    mcp_x = 1\nf()", None),  # UnboundLocalError: a local, no server
        ("mcp_", None),
        ("undefined", None),
        ("raise ImportError(\"cannot import name 'x' from 'elsewhere'\")", None),
    ],
)
def test_missing_server_alias_reads_pythons_own_errors(code: str, alias: str | None) -> None:
    assert mcp_sandbox_kernel.missing_server_alias(raised_by(code)) == alias


def test_explain_missing_server_completes_the_message_and_keeps_type_and_traceback() -> None:
    exc = raised_by("mcp_tim")
    traceback_before = exc.__traceback__
    servers = [{"alias": "time", "name": "time"}]
    mcp_sandbox_kernel.explain_missing_server(exc, servers, ["/x.json: cannot be used: bad"])
    assert type(exc) is NameError and exc.__traceback__ is traceback_before
    assert str(exc) == (
        "name 'mcp_tim' is not defined. There is no MCP server 'tim' in this sandbox (did you mean "
        "mcp_time?). Its servers: mcp_time. A configuration file could not be used, so the servers it "
        "configures are missing: /x.json: cannot be used: bad. Tell the user: once it is fixed, restart the "
        "MCP server (or the client) to read it. runtime.discovered_servers(detailed=True) shows where each "
        "server came from."
    )
    explained = str(exc)
    mcp_sandbox_kernel.explain_missing_server(exc, servers, [])  # raised again by a later cell
    assert str(exc) == explained
    known = raised_by("mcp_time")  # a server that is there, but not defined in this namespace
    mcp_sandbox_kernel.explain_missing_server(known, servers, [])
    assert str(known) == "name 'mcp_time' is not defined"
