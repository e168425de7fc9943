"""The sandbox session's parts that need no process: the request desk (caps, requests in
flight, exactly one answer each, cancellation), the exit's story, and the table from what
the kernel said about an execute to the call's outcome."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any, cast

import anyio
import pytest

import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import MAX_REQUESTS_IN_FLIGHT, TOO_MANY_REQUESTS, ProtocolError, RequestFrame

CAP = 1000


class FakeSandbox:
    """The desk's two ends: the host that serves a request, and the writer into the
    sandbox (records every frame sent; can be broken, or refuse a frame as too large)."""

    def __init__(self) -> None:
        self.sent: list[Mapping[str, Any]] = []
        self.release = anyio.Event()  # "hold" requests wait for it
        self.served: list[str] = []
        self.broken = False
        self.refuse_results = False  # a result frame cannot be sent (too large); an error can

    async def serve(self, frame: RequestFrame, size: int) -> object:
        method = frame["method"]
        self.served.append(method)
        if method == "hold":
            await self.release.wait()
        if method == "denied":
            raise bridge.InvalidRequestError("not allowed: %s" % frame["params"])
        if method == "bug":
            raise RuntimeError("a bug in the bridge")
        return {"served": method}

    async def send(self, frame: Mapping[str, Any]) -> None:
        if self.broken:
            raise anyio.BrokenResourceError
        if self.refuse_results and "result" in frame:
            raise ProtocolError("frame too large")
        self.sent.append(frame)

    def answers(self) -> dict[Any, Mapping[str, Any]]:
        by_id: dict[Any, Mapping[str, Any]] = {}
        for frame in self.sent:
            assert frame["id"] not in by_id, "answered twice: %r" % frame
            by_id[frame["id"]] = frame
        return by_id

    async def wait_answers(self, count: int) -> dict[Any, Mapping[str, Any]]:
        with anyio.fail_after(10):
            while len(self.sent) < count:
                await anyio.sleep(0.005)
        return self.answers()


def request(
    request_id: str | int, method: str = "echo", params: dict[str, object] | None = None
) -> RequestFrame:
    return {"type": "request", "id": request_id, "method": method, "params": params or {}}


def make_desk(sandbox: FakeSandbox) -> bridge.RequestDesk:
    return bridge.RequestDesk("sbx", sandbox.serve, sandbox.send, CAP, bridge.ProblemLog())


pytestmark = pytest.mark.anyio


# --- the request desk ------------------------------------------------------------------


async def test_each_request_gets_exactly_one_answer_result_error_or_internal_error() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    async with anyio.create_task_group() as group:
        desk.task_group = group
        desk.accept(request("a"), 10)
        desk.accept(request(2, "denied", {"x": 1}), 10)
        desk.accept(request("c", "bug"), 10)
        sent = await sandbox.wait_answers(3)
    assert sent["a"] == {"type": "response", "id": "a", "result": {"served": "echo"}}
    assert sent[2]["error"] == {"type": "MCPError", "message": "not allowed: {'x': 1}"}
    assert sent["c"]["error"]["message"].startswith("internal bridge error (RuntimeError)")
    assert desk.in_flight == 0 and desk.request_bytes == 0 and desk.requests == {}
    assert desk.problems.counts == {"internal RuntimeError": 1}


async def test_requests_beyond_the_cap_in_flight_are_refused_at_once_not_queued() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    async with anyio.create_task_group() as group:
        desk.task_group = group
        for number in range(MAX_REQUESTS_IN_FLIGHT):
            desk.accept(request(number, "hold"), 1)
        desk.accept(request("one too many", "hold"), 1)
        sent = await sandbox.wait_answers(1)
        assert sent == {
            "one too many": {
                "type": "response",
                "id": "one too many",
                "error": {"type": "MCPError", "message": TOO_MANY_REQUESTS},
            }
        }
        assert desk.in_flight == MAX_REQUESTS_IN_FLIGHT
        sandbox.release.set()
        sent = await sandbox.wait_answers(MAX_REQUESTS_IN_FLIGHT + 1)
    assert all(sent[number]["result"] == {"served": "hold"} for number in range(MAX_REQUESTS_IN_FLIGHT))
    assert sandbox.served.count("hold") == MAX_REQUESTS_IN_FLIGHT  # the refused one never reached the host
    assert desk.in_flight == 0


async def test_request_bytes_are_capped_alone_and_together() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    async with anyio.create_task_group() as group:
        desk.task_group = group
        desk.accept(request("over", "call_tool"), CAP + 1)
        desk.accept(request("held", "hold"), CAP // 2)
        desk.accept(request("more", "call_tool"), CAP // 2 + 1)
        desk.accept(request("fits", "hold"), CAP // 2)  # exactly the cap together
        sent = await sandbox.wait_answers(2)
        assert desk.request_bytes == CAP and desk.in_flight == 2
        sandbox.release.set()
        sent = await sandbox.wait_answers(4)
    assert (
        "runtime.call_tool: the request is %d bytes, over the %d-byte cap" % (CAP + 1, CAP)
        in (sent["over"]["error"]["message"])
    )
    assert "requests still in flight hold %d bytes" % (CAP // 2) in sent["more"]["error"]["message"]
    assert sent["held"]["result"] == sent["fits"]["result"] == {"served": "hold"}
    assert desk.request_bytes == 0


async def test_a_cancelled_request_is_still_answered_once_and_only_it_is_cancelled() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    async with anyio.create_task_group() as group:
        desk.task_group = group
        desk.accept(request("first", "hold"), 10)
        desk.accept(request("second", "hold"), 10)
        desk.accept(request("third", "hold"), 10)
        await anyio.sleep(0)
        desk.cancel("second")
        sent = await sandbox.wait_answers(1)
        assert list(sent) == ["second"]
        assert sent["second"]["error"]["message"] == (
            "cancelled: the run_python call that made this request has ended"
        )
        desk.cancel()  # the call ended: all of them
        sent = await sandbox.wait_answers(3)
    assert sent["first"]["error"] == sent["third"]["error"] == sent["second"]["error"]
    assert desk.in_flight == 0 and desk.request_bytes == 0


async def test_a_duplicate_id_in_flight_is_dropped_not_answered_twice() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    async with anyio.create_task_group() as group:
        desk.task_group = group
        desk.accept(request("same", "hold"), 10)
        desk.accept(request("same", "echo"), 10)
        await anyio.sleep(0.05)
        assert sandbox.sent == [] and desk.in_flight == 1
        sandbox.release.set()
        sent = await sandbox.wait_answers(1)
        await anyio.sleep(0.05)
    assert sent == {"same": {"type": "response", "id": "same", "result": {"served": "hold"}}}
    assert len(sandbox.sent) == 1 and sandbox.served == ["hold"]
    assert desk.problems.counts == {"duplicate id": 1}


async def test_without_a_task_group_requests_are_refused_by_dropping_and_counted() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)  # a sandbox that has not started: nothing can be served
    desk.accept(request("early"), 10)
    desk.refuse("early too", "no")
    assert sandbox.sent == [] and sandbox.served == [] and desk.in_flight == 0
    assert desk.problems.counts == {"refusal flood": 2}


async def test_refusals_beyond_the_cap_are_dropped_while_the_writer_is_stuck() -> None:
    sandbox = FakeSandbox()
    desk = make_desk(sandbox)
    stuck = anyio.Event()

    async def send(frame: Mapping[str, Any]) -> None:
        await stuck.wait()
        sandbox.sent.append(frame)

    desk.send = send
    async with anyio.create_task_group() as group:
        desk.task_group = group
        for number in range(MAX_REQUESTS_IN_FLIGHT + 5):
            desk.refuse(number, "refused")
        assert desk.refusing == MAX_REQUESTS_IN_FLIGHT
        stuck.set()
        sent = await sandbox.wait_answers(MAX_REQUESTS_IN_FLIGHT)
    assert set(sent) == set(range(MAX_REQUESTS_IN_FLIGHT)) and desk.refusing == 0
    assert desk.problems.counts == {"refusal flood": 5}


async def test_an_answer_that_cannot_be_sent_becomes_one_error_answer() -> None:
    sandbox = FakeSandbox()
    sandbox.refuse_results = True
    desk = make_desk(sandbox)
    await desk.respond("r1", result={"big": True})
    assert sandbox.sent == [
        {
            "type": "response",
            "id": "r1",
            "error": {
                "type": "MCPError",
                "message": "the answer could not be sent into the sandbox: ProtocolError: frame too large",
            },
        }
    ]


async def test_an_answer_to_a_sandbox_that_is_gone_never_raises() -> None:
    sandbox = FakeSandbox()
    sandbox.broken = True
    desk = make_desk(sandbox)
    await desk.respond("r1", result={"ok": True})
    await desk.respond("r2", error="an error")
    assert sandbox.sent == [] and desk.problems.counts == {}


# --- how the sandbox ended -------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kernel_errors", "stderr", "says"),
    [
        (137, [], [], "was killed (SIGKILL), almost certainly by the out-of-memory killer: "),
        (-signal.SIGKILL, ["ignored"], [], "exceeded the sandbox's 512m memory limit"),
        (0, ["first", "kernel stopped: the channel broke"], ["noise"], "stopped (exit code 0); the kernel "),
        (3, [], ["a", "b", "c", "d"], "exited unexpectedly with code 3. Last kernel output: b | c | d"),
        (None, [], [], "exited unexpectedly with code None."),
    ],
)
def test_the_exit_is_explained_from_the_code_then_the_kernel_then_its_stderr(
    code: int | None, kernel_errors: list[str], stderr: list[str], says: str
) -> None:
    story = bridge.SandboxExit("512m")
    for message in kernel_errors:
        story.saw_kernel_error(message)
    story.saw_stderr("\n".join(stderr))
    story.ended(code)
    assert story.reason is not None and says in story.reason, story.reason
    if kernel_errors and code == 0:
        assert story.reason.endswith("the kernel reported: kernel stopped: the channel broke")


def test_the_first_reason_stays_and_the_bridges_own_stop_wins_over_the_exit_code() -> None:
    story = bridge.SandboxExit("512m")
    story.stopped_by_bridge("was removed after a timeout: its supervisor did not answer the interrupt")
    story.stopped_by_bridge("was stopped by the bridge")
    story.ended(137)
    assert story.reason == "was removed after a timeout: its supervisor did not answer the interrupt"
    assert story.explain(137) == "was stopped by the bridge"  # not taken for the OOM killer


def test_what_the_sandbox_said_last_is_bounded() -> None:
    story = bridge.SandboxExit("512m")
    for number in range(50):
        story.saw_kernel_error("error %d " % number + "x" * 1000)
        story.saw_stderr("line %d " % number + "y" * 1000)
    assert len(story.kernel_errors) == 5 and story.kernel_errors[-1].startswith("error 49")
    assert len(story.stderr_tail) == 20 and all(len(line) == 500 for line in story.stderr_tail)


# --- what the kernel said, as the call's outcome -----------------------------------------

CONFIG = bridge.BridgeConfig(image="python:3.14-slim")
ERROR = {"type": "ValueError", "message": "bad", "traceback": "..."}


def pending_with(result: dict[str, Any] | None, stdout: str = "") -> bridge.PendingExecute:
    pending = bridge.PendingExecute("e1", 1000)
    if stdout:
        pending.add_stream("stdout", stdout)
    if result is not None:
        frame: Any = {"type": "result", **result}  # as the table's rows say, partial ones too
        pending.complete(frame)
    return pending


@pytest.mark.parametrize(
    ("result", "timed_out", "status", "state_kept", "error_kept", "detail"),
    [
        ({"status": "ok", "value": "2"}, False, "ok", True, True, None),
        ({"status": "ok", "value": "2"}, True, "ok", True, True, None),  # ended during the grace
        ({"status": "error", "error": ERROR}, False, "error", True, True, None),
        (
            {"status": "error", "error": ERROR},
            True,
            "timeout",
            True,
            True,
            "Timed out after 5s: the code was ",
        ),
        (
            {"status": "killed", "error": ERROR},
            True,
            "timeout",
            False,
            True,
            "Timed out after 5s and did not stop when interrupted. Variables",
        ),
        (
            None,
            True,
            "timeout",
            False,
            False,
            "Timed out after 5s and did not stop when interrupted, so the sandbox",
        ),
        (None, False, "crashed", False, False, "The sandbox was killed (SIGKILL). All state was lost"),
        (
            {"status": "crashed", "error": {"message": "the process died"}},
            False,
            "crashed",
            False,
            False,
            "The ",
        ),
        (
            {"status": "killed", "error": {"message": ""}},
            False,
            "crashed",
            False,
            False,
            "The Python process",
        ),
    ],
)
def test_the_outcome_table(
    result: dict[str, Any] | None,
    timed_out: bool,
    status: str,
    state_kept: bool,
    error_kept: bool,
    detail: str | None,
) -> None:
    pending = pending_with(result, stdout="printed\n")
    outcome = bridge.outcome_of_execute(
        pending, timeout=5, timed_out=timed_out, death_reason="was killed (SIGKILL)", config=CONFIG
    )
    assert (outcome.status, outcome.state_kept) == (status, state_kept)
    assert (outcome.error is not None) is (error_kept and result is not None and "error" in result)
    assert outcome.stdout == "printed\n"
    if detail is None:
        assert outcome.detail is None
    else:
        assert outcome.detail is not None and outcome.detail.startswith(detail), outcome.detail


def test_a_crash_reason_from_the_sandbox_is_capitalized_and_capped() -> None:
    pending = pending_with({"status": "crashed", "error": {"message": "segfault " + "z" * 5000}})
    outcome = bridge.outcome_of_execute(pending, timeout=5, timed_out=False, death_reason=None, config=CONFIG)
    assert outcome.detail is not None and outcome.detail.startswith("Segfault zzz")
    assert len(outcome.detail) < bridge.MAX_CRASH_REASON_CHARS + 200


def test_a_sandbox_that_ended_without_a_reason_is_said_to_have_stopped() -> None:
    outcome = bridge.outcome_of_execute(
        pending_with(None), timeout=5, timed_out=False, death_reason=None, config=CONFIG
    )
    assert outcome.detail == "The sandbox stopped. All state was lost; the next call starts a fresh session."


def test_a_missing_data_package_names_the_image_and_build_image() -> None:
    error = {"type": "ModuleNotFoundError", "message": "No module named 'pandas'", "module": "pandas"}
    outcome = bridge.outcome_of_execute(
        pending_with({"status": "error", "error": error}),
        timeout=5,
        timed_out=False,
        death_reason=None,
        config=CONFIG,
    )
    assert outcome.status == "error" and outcome.detail is not None
    assert outcome.detail.startswith("pandas is not installed in the sandbox image python:3.14-slim")
    assert "build-image --packages" in outcome.detail


def test_cuts_by_the_kernel_and_by_the_hosts_own_cap_add_up() -> None:
    pending = bridge.PendingExecute("e1", 20)  # the host keeps 10 characters per stream
    pending.add_stream("stdout", "0123456789abcdef")
    pending.complete(
        {"type": "result", "id": "e1", "status": "ok", "cut": {"stdout": {"count": 100, "tail": "end"}}}
    )
    outcome = bridge.outcome_of_execute(pending, timeout=5, timed_out=False, death_reason=None, config=CONFIG)
    assert outcome.stdout == "0123456789"
    assert outcome.cuts["stdout"] == bridge.OutputCut(count=106, tail="end")


def test_images_and_files_are_checked_again_and_their_drops_noticed() -> None:
    result = {
        "status": "ok",
        "notices": ["from the kernel"],
        "images": [{"mime_type": "image/png", "data": "not base64!"}],
        "attachments": [{"uri": "http://x", "mime_type": "text/plain", "text": "hi"}],
    }
    outcome = bridge.outcome_of_execute(
        pending_with(result), timeout=5, timed_out=False, death_reason=None, config=CONFIG
    )
    assert outcome.images == [] and outcome.attachments == []
    assert outcome.notices == [
        "from the kernel",
        "Image 1 was dropped: not a valid image within the caps.",
        "File 1 was dropped: not a valid attachment within the cap.",
    ]


async def test_an_execute_collects_its_own_frames_and_the_first_result_ends_it() -> None:
    pending = bridge.PendingExecute("e1", 1000)
    pending.receive({"type": "stream", "id": "e1", "name": "stderr", "text": "warn"})
    pending.receive({"type": "error", "id": "e1", "message": "the executor died"})
    pending.receive({"type": "result", "id": "e1", "status": "ok"})  # later: ignored
    assert pending.done.is_set() and pending.streams["stderr"] == ["warn"]
    assert pending.result == bridge.sandbox_error_result("e1", "SandboxError", "the executor died")


# --- the code a call runs: its questions live as long as it does -------------------------


class ScriptedSandbox:
    """Sandbox.execute's stand-in: the code "runs" until ``end`` is set."""

    def __init__(self) -> None:
        self.config = CONFIG
        self.end = anyio.Event()
        self.sent: list[str] = []  # the code that reached the "kernel"

    async def execute(self, code: str, timeout: float, **_: Any) -> bridge.ExecutionOutcome:
        self.sent.append(code)  # as Sandbox.execute, the code goes out before any checkpoint
        try:
            await self.end.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):  # as Sandbox.execute: it waits until the code stops
                await self.end.wait()
            raise
        return bridge.ExecutionOutcome(status="ok", value=code)


def a_run_request(code: str = "1") -> bridge.RunRequest:
    principal = cast(Any, None)  # RunningCode never reads it
    return bridge.RunRequest(code=code, timeout=5, reset=False, session_name="default", principal=principal)


async def test_the_codes_questions_are_sent_while_it_runs_and_cancelled_when_it_ends() -> None:
    sandbox = ScriptedSandbox()
    request = a_run_request()
    asked: list[str] = []
    ended: list[str] = []

    async def ask(name: str) -> None:
        asked.append(name)
        try:
            await anyio.sleep_forever()
        finally:
            ended.append(name)

    async with anyio.create_task_group() as keeper:
        running = bridge.RunningCode(cast(Any, sandbox), request, keeper)
        keeper.start_soon(running.run)
        running.ask_soon(ask, "first")
        with anyio.fail_after(5):
            while not asked:
                await anyio.sleep(0)
        assert running.asking  # in flight while the code runs
        sandbox.end.set()  # the code's task ends first ...
        running.ask_soon(ask, "late")  # ... so this one, started while it still ran, asks nothing
        with anyio.fail_after(5):
            await running.finished.wait()
            while not ended:
                await anyio.sleep(0)
        running.ask_soon(ask, "after")  # the code has ended: not started
        await anyio.sleep(0.05)
        keeper.cancel_scope.cancel()  # whatever is left (nothing, where questions end with the code)
    assert running.outcome is not None and running.outcome.value == "1"
    assert asked == ["first"] and ended == ["first"] and not running.asking


async def test_code_stopped_before_its_task_began_is_never_sent() -> None:
    sandbox = ScriptedSandbox()
    async with anyio.create_task_group() as keeper:
        running = bridge.RunningCode(cast(Any, sandbox), a_run_request("rm -rf /workspace/*"), keeper)
        keeper.start_soon(running.run)
        running.stop()  # the call was cancelled in the same pass of the loop
        with anyio.fail_after(5):
            await running.finished.wait()
    assert sandbox.sent == [] and running.outcome is None and running.failure is None


async def test_stopping_the_code_stops_its_questions_at_once() -> None:
    """A reset or a cancelled call stops the code (which may take seconds to end: an
    interrupt, then a kill); the user is not asked about it meanwhile."""
    sandbox = ScriptedSandbox()
    ended: list[str] = []

    async def ask(name: str) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            ended.append(name)

    async with anyio.create_task_group() as keeper:
        running = bridge.RunningCode(cast(Any, sandbox), a_run_request(), keeper)
        keeper.start_soon(running.run)
        try:
            running.ask_soon(ask, "approve?")
            with anyio.fail_after(5):
                while not running.asking:
                    await anyio.sleep(0)
            running.stop()  # the code itself has not ended yet (sandbox.end is not set)
            with anyio.fail_after(5):
                while not ended:
                    await anyio.sleep(0)
            assert not running.finished.is_set()  # the code is still stopping
            running.ask_soon(ask, "later")  # stopped: not sent
            await anyio.sleep(0.05)
        finally:
            sandbox.end.set()  # the code has stopped
    assert ended == ["approve?"]
