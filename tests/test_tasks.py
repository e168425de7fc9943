"""MCP tasks (the Tasks extension, SEP-2663, issue 20 item 3): a 2026-07-28 client that
declares the extension gets code still running when the call must answer as a task, not
"still running": it polls tasks/get for the call's whole result, answers the code's
approvals with tasks/update, and may stop it with tasks/cancel. The client here is the
MCP SDK's own, with the extension written on its public ClientExtension interface (a
ResultClaim on tools/call that polls until the task ends), against a real bridge, a real
container and a real proxied server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from mcp import types
from mcp.client import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.stdio import StdioServerParameters
from pydantic import ConfigDict

from tests.conftest import Engine
from tests.harness import console_script, text_of
from tests.test_approvals import setup

pytestmark = pytest.mark.anyio
ONE_RUNTIME = True  # tasks are the host's: the first requested runtime is enough

TASKS = "io.modelcontextprotocol/tasks"


class Answer(types.Result):
    """Any result, every field kept as sent (model_dump gives the wire's keys back)."""

    model_config = ConfigDict(extra="allow")


async def ask(session: Any, request: types.Request[Any, Any]) -> dict[str, Any]:
    """Send a tasks/* request; its result as a dict of the wire's keys."""
    answer: Answer = await session.send_request(request, Answer)
    return answer.model_dump(by_alias=True, exclude_none=True)


def get_task(task_id: str) -> GetTask:
    return GetTask(params=TaskIdParams(task_id=task_id))


class TaskHandle(types.Result):
    """CreateTaskResult: the task a tools/call answered with instead of its result."""

    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None


class TaskIdParams(types.RequestParams):
    task_id: str


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any]


class GetTask(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class CancelTask(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


class UpdateTask(types.Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param = "taskId"


class TasksExtension(ClientExtension):
    """A requester of the Tasks extension: each task-answered tools/call is polled until it
    ends (answering input_required with ``decision``), and everything seen is kept."""

    identifier = TASKS

    def __init__(self, decision: str = "allow_once") -> None:
        self.decision = decision
        self.created: list[TaskHandle] = []
        self.seen: list[dict[str, Any]] = []  # every tasks/get answer, in order

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=self.resolve)]

    async def resolve(self, handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
        self.created.append(handle)
        while True:
            state = await ask(ctx.session, get_task(handle.task_id))
            self.seen.append(state)
            if state["status"] == "completed":
                return types.CallToolResult.model_validate(state["result"])
            if state["status"] in ("failed", "cancelled"):
                raise AssertionError("the task ended %s: %s" % (state["status"], state))
            if state["status"] == "input_required":
                answers = {
                    key: {"action": "accept", "content": {"decision": self.decision}}
                    for key in state["inputRequests"]
                }
                params = UpdateParams(task_id=handle.task_id, input_responses=answers)
                await ask(ctx.session, UpdateTask(params=params))
            await anyio.sleep(min(state.get("pollIntervalMs", 1000), 1000) / 1000)


@asynccontextmanager
async def tasks_client(env: dict[str, str], extension: ClientExtension | None) -> AsyncIterator[Client]:
    """The SDK's high-level client speaking 2026-07-28, with the Tasks extension or not, once
    its sandbox has started (with MCP_BRIDGE_RESPOND_AFTER=1 a call made while the pre-warm
    start holds the session answers that it is busy)."""
    params = StdioServerParameters(command=console_script(), env=env)
    extensions = [extension] if extension is not None else None

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        # Declares form elicitation (the user can be asked); a task's questions come
        # through tasks/get and are answered with tasks/update, never through here.
        raise AssertionError("asked outside the task: %s" % params)

    # Discovers the server: 2026-07-28.
    async with Client(params, extensions=extensions, elicitation_callback=elicitation) as client:
        assert client.protocol_version == "2026-07-28"
        for _ in range(60):
            warm = await client.call_tool("run_python", {"code": "'warm'"})
            if "'warm'" in text_of(warm):
                break
        yield client


async def test_a_long_call_becomes_a_task_whose_result_is_the_whole_call(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    tasks = TasksExtension()
    async with tasks_client(env, tasks) as client:
        capabilities = client.session.server_capabilities
        assert capabilities is not None and TASKS in (capabilities.extensions or {}), capabilities
        code = "import time\nprint('start')\ntime.sleep(4)\nprint('end')\nkept = 41\nkept + 1"
        done = await client.call_tool("run_python", {"code": code})
        # The whole call's result, once: no "still running", no output split over answers.
        assert not done.is_error and done.structured_content is not None, done
        assert done.structured_content["stdout"] == "start\nend\n", done.structured_content
        assert done.structured_content["status"] == "ok", done.structured_content
        text = text_of(done)
        assert "start\nend\n" in text and "42" in text and "still running" not in text.lower(), text
        assert len(tasks.created) == 1 and tasks.created[0].status == "working", tasks.created
        assert tasks.created[0].ttl_ms and tasks.created[0].poll_interval_ms == 1000
        working = [state for state in tasks.seen if state["status"] == "working"]
        assert working and "Running for" in working[0]["statusMessage"], tasks.seen
        assert tasks.seen[-1]["status"] == "completed" and tasks.seen[-1]["resultType"] == "complete"

        # The session kept the task's state, and the next call shows nothing of it again.
        after = await client.call_tool("run_python", {"code": "kept"})
        assert "41" in text_of(after) and "start" not in text_of(after) and len(tasks.created) == 1, after

        # A quick call is answered at once, without a task.
        quick = await client.call_tool("run_python", {"code": "6 * 7"})
        assert "42" in text_of(quick) and len(tasks.created) == 1


async def test_an_approval_asked_during_a_task_is_answered_by_tasks_update(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    tasks = TasksExtension(decision="allow_once")
    async with tasks_client(env, tasks) as client:
        code = "import time\ntime.sleep(2)\nmcp_notes.write_note(key='t', text='from a task')"
        done = await client.call_tool("run_python", {"code": code})
        assert "wrote t" in text_of(done), done
        asking = [state for state in tasks.seen if state["status"] == "input_required"]
        assert asking, tasks.seen
        (request,) = asking[0]["inputRequests"].values()
        assert request["method"] == "elicitation/create", request
        assert 'mcp_notes.write_note({"key":"t","text":"from a task"})' in request["params"]["message"]
        assert "Waiting for the user to approve mcp_notes.write_note(" in asking[0]["statusMessage"]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [call["arguments"]["key"] for call in calls] == ["t"], calls

    # Denied through the task: the tool is not called, the code sees ApprovalDenied.
    (tmp_path / "deny").mkdir()
    env, record = setup(tmp_path / "deny", state_dir, engine, bridge_respond_after="1")
    tasks = TasksExtension(decision="deny")
    async with tasks_client(env, tasks) as client:
        code = (
            "import time\ntime.sleep(2)\ntry:\n    mcp_notes.delete_note(key='z')\n"
            "except runtime.ApprovalDenied as e:\n    said = str(e)\nsaid"
        )
        denied = await client.call_tool("run_python", {"code": code})
        assert "the user chose 'Deny'" in text_of(denied), denied
    assert record.read_text() == ""


async def test_a_task_can_be_cancelled_and_an_unknown_task_is_refused(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    async with tasks_client(env, TasksExtension()) as client:
        handle = await client.session.call_tool(
            "run_python", {"code": "import time\ntime.sleep(120)"}, allow_claimed=True
        )
        assert isinstance(handle, TaskHandle) and handle.status == "working", handle
        cancel = CancelTask(params=TaskIdParams(task_id=handle.task_id))
        assert (await ask(client.session, cancel))["resultType"] == "complete"
        state = await ask(client.session, get_task(handle.task_id))
        assert state["status"] == "cancelled" and "tasks/cancel" in state["statusMessage"], state
        again = await client.call_tool("run_python", {"code": "'usable'"})
        assert "usable" in text_of(again), again  # the session goes on

        with pytest.raises(Exception, match="No task"):
            await ask(client.session, get_task("nope"))


async def test_a_client_without_the_extension_still_gets_still_running(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    async with tasks_client(env, None) as client:
        first = await client.call_tool("run_python", {"code": "import time\ntime.sleep(3)\n'late'"})
        assert "Still running" in text_of(first), first
        for _ in range(10):
            rest = await client.call_tool("run_python", {"code": "None"})
            if "late" in text_of(rest):
                break
        assert "late" in text_of(rest), rest


async def test_another_call_during_a_task_takes_nothing_of_it_and_a_reset_cancels_it(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    async with tasks_client(env, TasksExtension()) as client:
        code = "import time\nprint('one')\ntime.sleep(3)\nprint('two')\n'task done'"
        handle = await client.session.call_tool("run_python", {"code": code}, allow_claimed=True)
        assert isinstance(handle, TaskHandle), handle
        # Another call to the session waits for the task's code and shows none of its output;
        # its own code runs once the task's has ended.
        other = await client.call_tool("run_python", {"code": "'mine'"})
        while "MCP task" in text_of(other):  # "still running as MCP task ..." (respond_after 1 s)
            assert "one" not in text_of(other), other
            other = await client.call_tool("run_python", {"code": "'mine'"})
        assert "'mine'" in text_of(other) and "one" not in text_of(other), other
        state = await ask(client.session, get_task(handle.task_id))
        assert state["status"] == "completed", state
        assert state["result"]["structuredContent"]["stdout"] == "one\ntwo\n", state
        assert state["result"]["structuredContent"]["value"] == "task done", state

        # A reset while a task's code runs cancels the task, and says so to the resetting call.
        long = await client.session.call_tool(
            "run_python", {"code": "import time\ntime.sleep(60)"}, allow_claimed=True
        )
        assert isinstance(long, TaskHandle), long
        reset = await client.call_tool("run_python", {"code": "'fresh'", "reset": True})
        assert "'fresh'" in text_of(reset) and "Reset stopped the code" in text_of(reset), reset
        state = await ask(client.session, get_task(long.task_id))
        assert state["status"] == "cancelled" and "reset" in state["statusMessage"], state
