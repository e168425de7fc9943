"""Issue 19's parts, one function or class at a time, without a container: which calls
ask (the policy), what an answer decides, the time that stands still while the user is
asked, the cap on proxied calls, and the call log with its reader and the calls command.
The whole flow, through a real client and real containers, is tests/test_approvals.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import anyio
import mcp_types as types
import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import console_script

pytestmark = pytest.mark.anyio


def config(**settings: object) -> bridge.BridgeConfig:
    return bridge.BridgeConfig(**settings)  # type: ignore[arg-type]


def a_call(tool: str = "write_note", **arguments: object) -> bridge.ProxiedCall:
    spec = bridge.ServerSpec("notes", "notes", "stdio", command="x")
    return bridge.proxied_call("local", "default", spec, tool, arguments or {"key": "a"})


# --- the policy ---------------------------------------------------------------------------


def test_writes_ask_unless_read_only_and_patterns_refine_it() -> None:
    writes = config()
    assert bridge.approval_reason("notes", "lookup", True, writes) is None
    assert "may change things" in (bridge.approval_reason("notes", "write", False, writes) or "")
    assert bridge.approval_reason("notes", "write", False, config(approve="none")) is None
    assert "every tool call" in (bridge.approval_reason("notes", "lookup", True, config(approve="all")) or "")
    refined = config(approve_tools=("notes.lookup",), allow_tools_without_asking=("notes.write_*",))
    assert "MCP_BRIDGE_APPROVE_TOOLS" in (bridge.approval_reason("notes", "lookup", True, refined) or "")
    assert bridge.approval_reason("notes", "write_note", False, refined) is None
    # Where both match, asking wins: the safe side.
    both = config(approve_tools=("notes.*",), allow_tools_without_asking=("notes.write_note",))
    assert "MCP_BRIDGE_APPROVE_TOOLS" in (bridge.approval_reason("notes", "write_note", False, both) or "")


def test_the_policy_settings_are_validated_and_typos_are_reported() -> None:
    with pytest.raises(bridge.ConfigError, match="MCP_BRIDGE_APPROVE="):
        bridge.load_config([], {"MCP_BRIDGE_APPROVE": "sometimes"})
    with pytest.raises(bridge.ConfigError, match="has no dot"):
        bridge.load_config([], {"MCP_BRIDGE_APPROVE_TOOLS": "write_*"})
    with pytest.raises(bridge.ConfigError, match="MCP_BRIDGE_MAX_TOOL_CALLS="):
        bridge.load_config([], {"MCP_BRIDGE_MAX_TOOL_CALLS": "0"})
    loaded = bridge.load_config([], {"MCP_BRIDGE_APPROVE_TOOLS": "notse.*"})
    spec = bridge.ServerSpec("notes", "notes", "stdio", command="x")
    assert bridge.policy_problems(loaded, [spec]) == [
        "MCP_BRIDGE_APPROVE_TOOLS: 'notse.*' matches no configured server"
    ]


def test_the_manual_says_what_this_bridge_asks() -> None:
    assert "does not mark read-only waits" in bridge.capabilities_manual(config())
    assert "Every tool call waits" in bridge.capabilities_manual(config(approve="all"))
    assert "No call asks the user first" in bridge.capabilities_manual(config(approve="none"))
    assert "A call of github.merge_* waits" in bridge.capabilities_manual(
        config(approve="none", approve_tools=("github.merge_*",))
    )
    assert bridge.APPROVALS_LINE not in bridge.capabilities_manual(config())


# --- the question and its answer ----------------------------------------------------------


def test_the_question_shows_the_call_cut_to_size_and_binds_its_digest() -> None:
    call = a_call(text="x" * 5000)
    message, schema = bridge.approval_request(call, "it may change things")
    assert "mcp_notes.write_note(" in message and "characters in all)" in message
    assert "(5011 bytes of arguments.)" in message
    assert len(message) < 2000 and call.digest[:12] in message
    assert schema["required"] == ["decision"]
    # Same call, same digest; any other argument, another digest.
    assert a_call(text="x" * 5000).digest == call.digest != a_call(text="y").digest
    assert a_call(key="a", text="b").digest == a_call(text="b", key="a").digest  # key order does not matter


@pytest.mark.parametrize(
    ("result", "choice", "how"),
    [
        (
            types.ElicitResult(action="accept", content={"decision": "allow_once"}),
            "allow_once",
            "Allow this call",
        ),
        (types.ElicitResult(action="accept", content={"decision": "deny"}), "deny", "Deny"),
        (
            types.ElicitResult(action="accept", content={"decision": "yes please"}),
            None,
            "none of the offered",
        ),
        (types.ElicitResult(action="accept"), None, "none of the offered"),
        (types.ElicitResult(action="decline"), None, "the user declined"),
        (types.ElicitResult(action="cancel"), None, "Claude Code in print mode"),
    ],
)
def test_an_answer_decides_only_what_it_says(
    result: types.ElicitResult, choice: str | None, how: str
) -> None:
    answer = bridge.approval_answer(result, "d")
    assert (answer.digest, answer.choice) == ("d", choice) and how in answer.how


class User:
    """UserQuestions that answers with ``choice`` (for the digest ``digest`` if given)."""

    def __init__(self, choice: str | None, digest: str | None = None, delay: float = 0, fail: bool = False):
        self.choice, self.digest, self.delay, self.fail = choice, digest, delay, fail
        self.asked: list[bridge.ProxiedCall] = []

    async def approve(self, call: bridge.ProxiedCall, reason: str) -> bridge.ApprovalAnswer:
        self.asked.append(call)
        await anyio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("client went away")
        return bridge.ApprovalAnswer(self.digest or call.digest, self.choice, "the user chose")

    async def relay(self, server: str, params: types.ElicitRequestParams) -> types.ElicitResult:
        raise AssertionError("not used here")


async def test_each_decision_and_each_way_of_not_deciding() -> None:
    approvals = bridge.SessionApprovals(config(approval_timeout=0.2))
    notices: list[str] = []
    assert await approvals.decide(a_call(), "r", User("allow_once"), notices) == "allowed once by the user"
    assert await approvals.decide(a_call(), "r", User("allow_session"), notices) == (
        "allowed by the user for this session"
    )
    nobody = User("deny")
    assert await approvals.decide(a_call(key="z"), "r", nobody, notices) == "allowed for this session"
    assert nobody.asked == [] and notices == []  # the tool, not the call, is allowed for the session
    for user, how in (
        (User("deny"), "the user chose"),
        (User("allow_once", digest="another call"), "the answer was for another call"),
        (User("allow_once", delay=5), "no answer within 0.2s (MCP_BRIDGE_APPROVAL_TIMEOUT)"),
        (User("allow_once", fail=True), "could not reach the user (ConnectionError: client went away)"),
    ):
        with pytest.raises(bridge.ApprovalDeniedError) as denied:
            await bridge.SessionApprovals(config(approval_timeout=0.2)).decide(a_call(), "r", user, notices)
        assert how in str(denied.value) and "was not called" in str(denied.value)
        assert denied.value.for_sandbox() == {
            "type": "ApprovalDenied",
            "message": str(denied.value),
            "server": "notes",
            "tool": "write_note",
        }


async def test_a_client_that_cannot_ask_gets_the_fallback_and_one_notice_per_session() -> None:
    notices: list[str] = []
    allowing = bridge.SessionApprovals(config())
    for _ in range(2):
        assert (
            await allowing.decide(a_call(), "r", None, notices)
            == "allowed without asking (this client cannot ask)"
        )
    (notice,) = notices
    assert "Approvals are not available in this client" in notice and "MCP_BRIDGE_DENY_TOOLS" in notice
    with pytest.raises(bridge.ApprovalDeniedError, match="MCP_BRIDGE_APPROVE_FALLBACK=deny"):
        await bridge.SessionApprovals(config(approve_fallback="deny")).decide(a_call(), "r", None, [])


# --- the timeout stands still; the cap ------------------------------------------------------


async def test_the_timeout_stands_still_while_the_user_is_asked() -> None:
    pending = bridge.PendingExecute("e1", 1000)
    with anyio.move_on_after(10) as scope:
        pending.timeout_scope = scope
        deadline = scope.deadline
        with pending.paused("first"):
            assert scope.deadline == math.inf and pending.awaiting == ["first"]
            with pending.paused("second"):  # overlapping questions: one pause
                await anyio.sleep(0.05)
            assert scope.deadline == math.inf and pending.awaiting == ["first"]
            await anyio.sleep(0.05)
        assert pending.awaiting == []
        assert deadline + 0.1 <= scope.deadline < deadline + 1  # moved on by the time asked


def test_the_cap_counts_every_proxied_call_of_one_run() -> None:
    run = bridge.RunContext("default", bridge.SessionApprovals(config()), bridge.PendingExecute("e", 10), 3)
    for _ in range(3):
        run.count_call("mcp_notes.lookup(...)")
    with pytest.raises(
        bridge.ToolCallCapError, match=r"mcp_notes.lookup\(\.\.\.\) was not made: .* 3 proxied"
    ):
        run.count_call("mcp_notes.lookup(...)")


# --- the call log, its reader and the calls command ------------------------------------------


def test_the_log_keeps_meta_by_default_everything_when_full_and_nothing_when_off(tmp_path: Path) -> None:
    call = a_call(key="secret-key", text="a secret")
    started = time.monotonic()
    bridge.CallLog(config(state_dir=tmp_path)).record(call, "not asked", started, 12, None, {"content": []})
    (meta,) = bridge.read_call_log(tmp_path)
    assert "secret" not in json.dumps(meta) and meta["arguments_digest"] == call.digest
    assert meta["result_bytes"] == 12 and meta["decision"] == "not asked" and meta["error"] is None
    assert (tmp_path / "calls.jsonl").stat().st_mode & 0o777 == 0o600

    bridge.CallLog(config(state_dir=tmp_path, call_log="full")).record(call, "denied", started, error="no")
    full = list(bridge.read_call_log(tmp_path))[1]
    assert (
        json.loads(full["arguments"]) == {"key": "secret-key", "text": "a secret"} and full["result"] is None
    )
    bridge.CallLog(config(state_dir=tmp_path, call_log="off")).record(call, "denied", started)
    assert len(list(bridge.read_call_log(tmp_path))) == 2


def test_the_log_rotates_skips_torn_lines_and_survives_an_unwritable_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(bridge, "CALL_LOG_MAX_BYTES", 2000)
    log = bridge.CallLog(config(state_dir=tmp_path))
    for number in range(20):
        log.record(a_call(key=str(number)), "not asked", time.monotonic())
    assert (tmp_path / "calls.jsonl.1").exists() and (tmp_path / "calls.jsonl").stat().st_size <= 2000
    with (tmp_path / "calls.jsonl").open("a") as torn:
        torn.write('{"time": "2026-')  # a write cut short
    entries = list(bridge.read_call_log(tmp_path))
    assert 5 < len(entries) < 20 and entries == sorted(entries, key=lambda entry: entry["time"])

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    stuck = bridge.CallLog(config(state_dir=blocked))
    stuck.record(a_call(), "not asked", time.monotonic())  # no exception: the call goes on
    stuck.record(a_call(), "not asked", time.monotonic())
    assert sum("cannot be written" in record.message for record in caplog.records) == 1


def test_the_calls_command_filters_by_server_and_time(tmp_path: Path) -> None:
    entry = {
        "principal": "local",
        "session": "default",
        "duration_ms": 3.0,
        "result_bytes": None,
        "error": None,
    }
    lines = [
        {**entry, "time": "2026-01-01T10:00:00.000+00:00", "server": "notes", "tool": "write_note"},
        {**entry, "time": "2099-01-01T10:00:00.000+00:00", "server": "time", "tool": "now"},
    ]
    lines[0].update(decision="denied", error="no")
    lines[1].update(decision="not asked", result_bytes=40)
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {**os.environ, "MCP_BRIDGE_STATE_DIR": str(tmp_path)}

    def calls(*args: str) -> str:
        command = [console_script(), "calls", *args]
        done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert [json.loads(line)["tool"] for line in calls("--json").splitlines()] == ["write_note", "now"]
    assert [json.loads(line)["tool"] for line in calls("--json", "--server", "time").splitlines()] == ["now"]
    assert [json.loads(line)["tool"] for line in calls("--json", "--since", "2h").splitlines()] == ["now"]
    shown = calls("--since", "2025-12-31")
    assert "notes.write_note  denied  3.0ms  -  error: no" in shown and "time.now  not asked" in shown
    assert "no proxied calls" in calls("--server", "github") and calls("--json", "--server", "github") == ""
    command = [console_script(), "calls", "--since", "yesterday"]
    bad = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "neither an ISO time nor an age" in bad.stderr


# --- a proxied server's own questions -------------------------------------------------------


async def test_a_servers_question_goes_to_the_one_call_in_flight_or_is_declined_with_the_reason() -> None:
    spec = bridge.ServerSpec("notes", "notes", "stdio", command="x")
    async with anyio.create_task_group() as group:
        client = bridge.PooledClient(spec, config(), group)
        params = types.ElicitRequestFormParams(message="Go on?", requested_schema={"type": "object"})
        heard: list[str] = []

        class Listener:
            async def relay(
                self, server: str, asked: types.ElicitRequestParams
            ) -> types.ElicitResult | types.ErrorData:
                heard.append(server + ": " + asked.message)
                return types.ElicitResult(action="accept", content={})

            async def progress(
                self, server: str, done: float, total: float | None, message: str | None
            ) -> None:
                heard.append("%s: %g" % (server, done))

            async def log(self, server: str, params: types.LoggingMessageNotificationParams) -> None:
                heard.append("%s: %s" % (server, params.data))

            def paused(self, waiting_for: str) -> AbstractContextManager[None]:
                return nullcontext()

        relay = Listener()
        none = await client._on_question(None, params)
        assert isinstance(none, types.ErrorData) and "no call of its is running" in none.message
        client.calls_in_flight.append((relay, anyio.CancelScope()))
        assert isinstance(await client._on_question(None, params), types.ElicitResult)
        assert heard == ["notes: Go on?"]
        await client._on_log(types.LoggingMessageNotificationParams(level="info", data="hello"))
        assert heard == ["notes: Go on?", "notes: hello"]
        client.calls_in_flight.append((relay, anyio.CancelScope()))
        two = await client._on_question(None, params)
        assert isinstance(two, types.ErrorData) and "cannot tell whose user to ask" in two.message
        group.cancel_scope.cancel()


async def test_a_run_whose_client_cannot_ask_declines_a_servers_question() -> None:
    pending = bridge.PendingExecute("e", 10)
    run = bridge.RunContext("default", bridge.SessionApprovals(config()), pending, 10)
    params = types.ElicitRequestFormParams(message="Go on?", requested_schema={"type": "object"})
    declined = await run.relay("notes", params)
    assert isinstance(declined, types.ErrorData) and "cannot show the user a question" in declined.message
    pending.asker = User("allow_once", fail=True)  # relay raises: the user could not be reached
    failed = await run.relay("notes", params)
    assert isinstance(failed, types.ErrorData) and "could not reach the user" in failed.message


@pytest.mark.parametrize(
    ("elicitation", "asks", "url"),
    [
        (None, False, False),
        (types.ElicitationCapability(), True, False),  # empty: form mode, the spec's rule
        (types.ElicitationCapability(form=types.FormElicitationCapability()), True, False),
        (types.ElicitationCapability(url=types.UrlElicitationCapability()), False, True),
        (
            types.ElicitationCapability(
                form=types.FormElicitationCapability(), url=types.UrlElicitationCapability()
            ),
            True,
            True,
        ),
    ],
)
def test_only_a_client_that_declared_form_elicitation_is_asked(
    elicitation: types.ElicitationCapability | None, asks: bool, url: bool
) -> None:
    from types import SimpleNamespace

    capabilities = types.ClientCapabilities(elicitation=elicitation)
    ctx = SimpleNamespace(session=SimpleNamespace(client_capabilities=capabilities), request_id=7)
    questions = bridge.client_questions(ctx)  # type: ignore[arg-type]
    assert (questions is not None) == asks
    if questions is not None:
        assert questions.url_mode == url and questions.related == 7


def test_a_log_another_bridge_rotated_meanwhile_is_opened_again_not_rotated_twice(tmp_path: Path) -> None:
    log = bridge.CallLog(config(state_dir=tmp_path))
    log.record(a_call(), "not asked", time.monotonic())
    held = os.open(tmp_path / "calls.jsonl", os.O_WRONLY | os.O_APPEND)  # as a bridge that waits for the lock
    os.replace(tmp_path / "calls.jsonl", tmp_path / "calls.jsonl.1")  # another bridge rotates
    fd = log._open_locked()
    try:
        assert os.fstat(fd).st_ino == os.stat(tmp_path / "calls.jsonl").st_ino != os.fstat(held).st_ino
    finally:
        os.close(fd)
        os.close(held)
    log.record(a_call(key="b"), "not asked", time.monotonic())
    assert len(list(bridge.read_call_log(tmp_path))) == 2  # one in each file, none lost


async def test_a_server_with_resources_but_no_templates_still_lists_its_resources() -> None:
    from mcp.shared.exceptions import MCPError as McpProtocolError

    class Session:
        async def list_resources(self, params: object = None) -> types.ListResourcesResult:
            return types.ListResourcesResult(resources=[types.Resource(uri="x://a", name="a")])

        async def list_resource_templates(self, params: object = None) -> types.ListResourceTemplatesResult:
            raise McpProtocolError(code=types.METHOD_NOT_FOUND, message="Method not found")

    listed = await bridge.list_all_resources(Session())  # type: ignore[arg-type]
    assert listed == {"resources": [{"uri": "x://a", "name": "a"}], "resourceTemplates": []}


def test_a_call_with_a_wrong_or_missing_argument_gets_the_exact_signature() -> None:
    tool = {
        "name": "get_issue",
        "description": "Get an issue.",
        "inputSchema": {
            "type": "object",
            "properties": {
                "owner": {"type": "string"},
                "repo": {"type": "string"},
                "issue-number": {"type": "integer"},
            },
            "required": ["owner", "repo", "issue-number"],
        },
    }
    said = bridge.argument_problems("github", tool, {"owner": "a", "repo": "b", "issue_numbr": 3})
    assert said == (
        "mcp_github.get_issue was not called: no parameter issue_numbr (did you mean issue_number?); "
        "missing the required issue_number. Its signature: "
        "mcp_github.get_issue(owner: str, repo: str, issue_number: int) -> Any  # Get an issue"
    )
    for right in (
        {"owner": "a", "repo": "b", "issue_number": 3},
        {"owner": "a", "repo": "b", "issue-number": 3},
    ):
        assert bridge.argument_problems("github", tool, right) is None  # Python or schema names
    open_ended = {
        "name": "t",
        "inputSchema": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    }
    assert bridge.argument_problems("x", open_ended, {"b": 1}) is None  # takes other names
    assert bridge.argument_problems("x", {"name": "t", "inputSchema": {"type": "object"}}, {"any": 1}) is None


def test_two_bridges_share_the_log_and_follow_each_others_rotation_and_a_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each log keeps its file open between lines: a rotation by the other bridge, or a user
    # who deletes the file, must send the next line to the file at the path (what goes is
    # only what rotation drops by design: the file before calls.jsonl.1), never twice.
    monkeypatch.setattr(bridge, "CALL_LOG_MAX_BYTES", 2000)
    first, second = bridge.CallLog(config(state_dir=tmp_path)), bridge.CallLog(config(state_dir=tmp_path))
    keys = [str(number) for number in range(12)]
    for number, key in enumerate(keys):
        (first if number % 2 else second).record(a_call(key=key), "not asked", time.monotonic())
    assert (tmp_path / "calls.jsonl.1").exists() and (tmp_path / "calls.jsonl").stat().st_size <= 2000
    logged = [entry["arguments_digest"] for entry in bridge.read_call_log(tmp_path)]
    assert logged[-1] == a_call(key=keys[-1]).digest and len(logged) == len(set(logged))
    (tmp_path / "calls.jsonl").unlink()
    (tmp_path / "calls.jsonl.1").unlink()
    first.record(a_call(key="after"), "not asked", time.monotonic())
    second.record(a_call(key="later"), "not asked", time.monotonic())
    entries = list(bridge.read_call_log(tmp_path))
    assert [entry["arguments_digest"] for entry in entries] == [
        a_call(key="after").digest,
        a_call(key="later").digest,
    ]
    first.close()
    second.close()


def test_a_calls_line_is_written_at_the_loops_next_pass_after_its_answer(tmp_path: Path) -> None:
    log = bridge.CallLog(config(state_dir=tmp_path))

    async def main() -> tuple[int, int]:
        bridge.at_next_pass(log.record, a_call(), "not asked", time.monotonic(), 12)
        before = len(list(bridge.read_call_log(tmp_path)))  # the answer goes out now
        await anyio.sleep(0)
        return before, len(list(bridge.read_call_log(tmp_path)))

    assert anyio.run(main) == (0, 1)
    log.close()


def test_a_rotation_whose_new_file_cannot_be_opened_closes_nothing_of_anyone_elses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rotated file's descriptor is closed once: its number may be another thread's
    # next open file by the time opening the new log fails (a full disk, no descriptors).
    monkeypatch.setattr(bridge, "CALL_LOG_MAX_BYTES", 600)
    log = bridge.CallLog(config(state_dir=tmp_path))
    log.record(a_call(key="x" * 300), "not asked", time.monotonic())
    log.close()
    real_open_locked = bridge.CallLog._open_locked
    others: list[int] = []

    def open_locked(self: bridge.CallLog) -> int:
        if not others:
            others.append(-1)
            return real_open_locked(self)
        others.append(os.open(os.devnull, os.O_RDONLY))  # another thread takes the freed number
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bridge.CallLog, "_open_locked", open_locked)
    log.record(a_call(key="y" * 300), "not asked", time.monotonic())  # rotates, then cannot open
    os.fstat(others[-1])  # still open
    os.close(others[-1])
    assert log.failed
