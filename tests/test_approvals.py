"""Issue 19: the user stays in control of what code does with their tools. A real bridge
(the installed console script, real containers) proxies a real MCP server whose tools are
read-only or may write by their annotations and which records every call it receives;
the SDK's own client answers the bridge's approval requests (elicitation) as a user would.
Then the call log, the cap on proxied calls, and resources and prompts read from code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError

from tests.conftest import (
    REPO,
    Engine,
    bridge_client,
    claude_desktop_home,
    console_script,
    proxy_env,
    real_server,
    run_cell,
)
from tests.harness import modern_bridge_client, text_of

pytestmark = pytest.mark.anyio
# Approvals, the log and the cap are the host's: the first requested runtime is enough.
ONE_RUNTIME = True

APPROVAL_SERVER = REPO / "tests" / "servers" / "approval_server.py"

Asked = list[types.ElicitRequestFormParams]
Answer = Callable[[types.ElicitRequestFormParams], Awaitable[types.ElicitResult]]


def user(answer: Answer) -> tuple[Asked, Any]:
    """An elicitation callback for the SDK's client that keeps what it was asked."""
    asked: Asked = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams), params
        asked.append(params)
        return await answer(params)

    return asked, elicitation


def choosing(decision: str, after: float = 0) -> Answer:
    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        await anyio.sleep(after)
        return types.ElicitResult(action="accept", content={"decision": decision})

    return answer


def in_turn(*decisions: str) -> Answer:
    """A user who answers the questions with ``decisions``, one after the other."""
    left = iter(decisions)

    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return await choosing(next(left))(params)

    return answer


def setup(tmp_path: Path, state_dir: Path, engine: Engine, **settings: str) -> tuple[dict[str, str], Path]:
    """The bridge's environment with the approval stub as its one server, and the file
    where the stub records the calls it receives."""
    record = tmp_path / "received.jsonl"
    record.touch()
    config = tmp_path / "servers.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "notes": {
                        "command": sys.executable,
                        "args": [str(APPROVAL_SERVER)],
                        "env": {"RECORD_FILE": str(record)},
                    },
                    "everything": {"command": real_server("everything")},
                }
            }
        )
    )
    overrides = {"MCP_" + key.upper(): value for key, value in settings.items()}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = proxy_env(engine, state_dir, home, MCP_SERVERS_CONFIG=str(config), **overrides)
    return env, record


def received(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


async def test_write_calls_wait_for_the_user_and_each_answer_does_what_it_says(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine)
    asked, elicitation = user(in_turn("allow_once", "deny", "allow_session", "allow_once"))
    async with bridge_client(env, elicitation=elicitation) as client:
        read = await run_cell(client, "mcp_notes.lookup(key='a')")
        assert read["json"] == "note a" and asked == [], read  # read-only: no question

        allowed = await run_cell(client, "mcp_notes.write_note(key='a', text='hello')")
        assert allowed["json"] == "wrote a", allowed
        assert len(asked) == 1
        message = asked[0].message
        assert "'notes'" in message and 'mcp_notes.write_note({"key":"a","text":"hello"})' in message, message
        assert "session 'default'" in message and "may change things" in message, message
        schema = asked[0].requested_schema["properties"]["decision"]
        assert [choice["const"] for choice in schema["oneOf"]] == ["allow_once", "allow_session", "deny"]

        denied = await run_cell(
            client,
            """
            try:
                mcp_notes.delete_note(key='a')
            except runtime.ApprovalDenied as exc:
                caught = (isinstance(exc, runtime.MCPToolError), exc.server, exc.tool, str(exc))
            caught
            """,
        )
        assert denied["json"][:3] == [True, "notes", "delete_note"], denied
        assert "the user chose 'Deny'" in denied["json"][3] and "was not called" in denied["json"][3]

        # Allowed for the session: asked once, then never again for that tool in that session.
        twice = await run_cell(client, "[mcp_notes.write_note(key=k, text='x') for k in 'bc']")
        assert twice["json"] == ["wrote b", "wrote c"] and len(asked) == 3, twice
        again = await run_cell(client, "mcp_notes.write_note(key='d', text='x')")
        assert again["json"] == "wrote d" and len(asked) == 3, again

        # Another session asks again.
        other = await client.call_tool(
            "run_python", {"code": "mcp_notes.write_note(key='e', text='x')", "session": "other"}
        )
        assert not other.is_error and len(asked) == 4 and "session 'other'" in asked[3].message

    assert [(call["tool"], call["arguments"].get("key")) for call in received(record)] == [
        ("lookup", "a"),
        ("write_note", "a"),
        ("write_note", "b"),
        ("write_note", "c"),
        ("write_note", "d"),
        ("write_note", "e"),
    ]  # the denied delete never reached the server


async def test_time_spent_asking_does_not_count_and_an_unanswered_question_denies(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine)
    slow_answers = iter([choosing("allow_once", after=8), choosing("allow_once", after=30)])

    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return await next(slow_answers)(params)

    _, elicitation = user(answer)
    env["MCP_BRIDGE_APPROVAL_TIMEOUT"] = "20"
    async with bridge_client(env, elicitation=elicitation) as client:
        # The user takes 8 s to answer; the call's own timeout is 5 s of running time.
        result = await client.call_tool(
            "run_python", {"code": "mcp_notes.write_note(key='slow', text='x')", "timeout": 5}
        )
        assert not result.is_error and result.structured_content["value"] == "wrote slow", result
    env["MCP_BRIDGE_APPROVAL_TIMEOUT"] = "3"
    async with bridge_client(env, elicitation=elicitation) as client:
        started = time.monotonic()
        unanswered = await run_cell(
            client,
            """
            try:
                mcp_notes.write_note(key='never', text='x')
            except runtime.ApprovalDenied as exc:
                said = str(exc)
            said
            """,
        )
        assert time.monotonic() - started < 20
        assert "no answer within 3s (MCP_BRIDGE_APPROVAL_TIMEOUT)" in unanswered["json"], unanswered
    assert [call["arguments"]["key"] for call in received(record)] == ["slow"]


async def test_a_client_that_cannot_be_asked_falls_back_as_configured(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine)
    async with bridge_client(env) as client:  # no elicitation callback: no capability
        first = await run_cell(client, "mcp_notes.write_note(key='a', text='x')")
        assert first["json"] == "wrote a", first
        assert any("Approvals are not available in this client" in notice for notice in first["notices"])
        assert "MCP_BRIDGE_DENY_TOOLS" in first["text"]
        second = await run_cell(client, "mcp_notes.write_note(key='b', text='x')")
        assert second["json"] == "wrote b" and not second["notices"], second  # said once per session

    env["MCP_BRIDGE_APPROVE_FALLBACK"] = "deny"
    async with bridge_client(env) as client:
        refused = await run_cell(
            client,
            """
            try:
                mcp_notes.write_note(key='c', text='x')
            except runtime.ApprovalDenied as exc:
                said = str(exc)
            said
            """,
        )
        assert "cannot ask the user" in refused["json"] and "FALLBACK=deny" in refused["json"], refused
        read = await run_cell(client, "mcp_notes.lookup(key='c')")
        assert read["json"] == "note c", read  # read-only tools never ask
    assert [call["arguments"]["key"] for call in received(record)] == ["a", "b", "c"]


async def test_patterns_refine_the_policy_and_approve_none_asks_nothing(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(
        tmp_path,
        state_dir,
        engine,
        bridge_approve_tools="notes.lookup",
        bridge_allow_tools_without_asking="notes.write_*",
    )
    asked, elicitation = user(choosing("allow_once"))
    async with bridge_client(env, elicitation=elicitation) as client:
        done = await run_cell(
            client,
            "[mcp_notes.lookup(key='a'), mcp_notes.write_note(key='a', text='x'), "
            "mcp_notes.delete_note(key='a')]",
        )
        assert done["json"] == ["note a", "wrote a", "deleted a"], done
        assert [params.message.split("\n\n")[1].split("(")[0] for params in asked] == [
            "mcp_notes.lookup",
            "mcp_notes.delete_note",
        ]
        assert "it matches MCP_BRIDGE_APPROVE_TOOLS" in asked[0].message
    env = {**env, "MCP_BRIDGE_APPROVE": "none", "MCP_BRIDGE_APPROVE_TOOLS": ""}
    asked.clear()
    async with bridge_client(env, elicitation=elicitation) as client:
        done = await run_cell(client, "mcp_notes.delete_note(key='b')")
        assert done["json"] == "deleted b" and asked == [], done


async def test_the_call_log_and_the_calls_command_and_the_cap_on_calls(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine, bridge_max_tool_calls="5")
    _, elicitation = user(choosing("deny"))
    async with bridge_client(env, elicitation=elicitation) as client:
        runaway = await run_cell(
            client,
            """
            done = 0
            try:
                while True:
                    mcp_notes.lookup(key=str(done))
                    done += 1
            except runtime.MCPError as exc:
                stopped = str(exc)
            done, stopped
            """,
        )
        assert runaway["json"][0] == 5, runaway
        assert "MCP_BRIDGE_MAX_TOOL_CALLS" in runaway["json"][1] and "cap" in runaway["json"][1]
        # The cap is per run_python call: the next one may call again.
        later = await run_cell(
            client,
            """
            try:
                mcp_notes.write_note(key='secret-key', text='a secret')
            except runtime.ApprovalDenied:
                pass
            mcp_notes.lookup(key='again')
            """,
        )
        assert later["json"] == "note again", later
    assert len(received(record)) == 6

    log = (state_dir / "calls.jsonl").read_text()
    assert "a secret" not in log and "secret-key" not in log  # meta: no arguments
    entries = [json.loads(line) for line in log.splitlines()]
    assert [(entry["tool"], entry["decision"]) for entry in entries] == [
        *[("lookup", "not asked")] * 5,
        ("lookup", "refused"),  # the sixth: the cap refused it before it became a call
        ("write_note", "denied"),
        ("lookup", "not asked"),
    ]
    for entry in entries:
        assert entry["principal"] == "local" and entry["session"] == "default" and entry["server"] == "notes"
        assert entry["arguments_bytes"] > 0
        assert entry["decision"] == "refused" or len(entry["arguments_digest"]) == 64
    assert entries[0]["result_bytes"] > 0 and entries[0]["error"] is None
    assert "MCP_BRIDGE_MAX_TOOL_CALLS" in entries[5]["error"]
    assert "was not called" in entries[6]["error"]
    assert (state_dir / "calls.jsonl").stat().st_mode & 0o777 == 0o600

    command = [console_script(), "calls", "--state-dir", str(state_dir)]
    shown = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True, timeout=60)
    assert [json.loads(line) for line in shown.stdout.splitlines()] == entries
    table = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "notes.write_note" in table and "denied" in table, table
    none = subprocess.run(
        [*command, "--server", "elsewhere"], capture_output=True, text=True, check=True, timeout=60
    )
    assert "no proxied calls" in none.stdout


async def test_resources_and_prompts_are_read_from_code(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine)
    async with bridge_client(env) as client:
        notes = await run_cell(
            client,
            """
            listed = runtime.list_resources('notes')
            [
                [r['uri'] for r in listed['resources']],
                [t['uriTemplate'] for t in listed['resourceTemplates']],
                runtime.read_resource('notes', 'notes://index'),
                runtime.read_resource('notes', 'notes://note/beta'),
                [p['name'] for p in runtime.list_prompts('notes')['prompts']],
                runtime.get_prompt('notes', 'summarize', {'topic': 'cats'})['messages'][0]['content']['text'],
            ]
            """,
        )
        assert notes["json"] == [
            ["notes://index"],
            ["notes://note/{key}"],
            "alpha\nbeta",
            "the note beta",
            ["summarize"],
            "Summarize the notes about cats.",
        ], notes
        everything = await run_cell(
            client,
            """
            import asyncio
            first = runtime.list_resources('everything')['resources'][0]
            content = runtime.read_resource('everything', first['uri'])
            prompts = [p['name'] for p in runtime.list_prompts('everything')['prompts']]
            [first['uri'], type(content).__name__, len(content) > 0, prompts[:1] != []]
            """,
        )
        assert everything["json"][1] in ("str", "bytes") and everything["json"][2:] == [True, True], (
            everything
        )
        missing = await run_cell(client, "runtime.read_resource('notes', 'notes://nowhere')")
        assert missing["status"] == "error" and "MCPError" in missing["text"], missing


async def test_a_proxied_servers_own_question_and_progress_reach_the_user(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine)

    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"confirm": True})

    asked, elicitation = user(answer)
    heard: list[str | None] = []
    logged: list[types.LoggingMessageNotificationParams] = []

    async def listen(progress: float, total: float | None, message: str | None) -> None:
        heard.append(message)

    async def log(params: types.LoggingMessageNotificationParams) -> None:
        logged.append(params)

    async with bridge_client(env, elicitation=elicitation, logging=log) as client:
        result = await client.call_tool(
            "run_python",
            {
                "code": "import time\nanswer = mcp_notes.confirm_with_user(question='Go on?')\n"
                "counted = mcp_notes.count_up(steps=3)\nmcp_notes.chatty(text='hello from notes')\n"
                "time.sleep(0.5)\n[answer, counted]"
            },
            progress_callback=listen,
        )
        assert not result.is_error and result.structured_content["value"] == ["confirmed", "counted 3"], (
            result
        )
        (question,) = asked
        assert question.message == "MCP server 'notes' (called by code in run_python) asks: Go on?"
        assert question.requested_schema["properties"]["confirm"]["type"] == "boolean"
    assert any(message and message.startswith("notes: step ") for message in heard), heard
    assert [(entry.level, entry.logger, entry.data) for entry in logged] == [
        ("info", "mcp_notes", "hello from notes")
    ], logged

    async with bridge_client(env) as client:  # a client that cannot be asked: declined, with the reason
        declined = await run_cell(
            client,
            """
            try:
                mcp_notes.confirm_with_user(question='Go on?')
            except runtime.MCPError as exc:  # the server failed the call: the bridge refused its question
                said = str(exc)
            said
            """,
        )
        assert "cannot show the user a question" in str(declined["json"]), declined


async def test_over_http_only_the_principal_whose_code_calls_is_asked(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_http import ALICE, BOB, http_bridge

    record = tmp_path / "received.jsonl"
    record.touch()
    entry = {"command": sys.executable, "args": [str(APPROVAL_SERVER)], "env": {"RECORD_FILE": str(record)}}
    claude_desktop_home(tmp_path, {"notes": entry})  # the HOME http_bridge gives the bridge
    alice_asked, alice_user = user(choosing("allow_once"))
    bob_asked, bob_user = user(choosing("allow_once"))

    async def connect(url: str, token: str, elicitation: Any, stack: AsyncExitStack) -> ClientSession:
        http = await stack.enter_async_context(
            httpx2.AsyncClient(
                headers={"Authorization": "Bearer " + token}, timeout=httpx2.Timeout(30, read=300)
            )
        )
        read, write = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        session = await stack.enter_async_context(
            ClientSession(read, write, elicitation_callback=elicitation)
        )
        await session.initialize()
        return session

    async with http_bridge(engine, state_dir) as running, AsyncExitStack() as stack:
        alice = await connect(running.url, ALICE, alice_user, stack)
        bob = await connect(running.url, BOB, bob_user, stack)
        done = await alice.call_tool("run_python", {"code": "mcp_notes.write_note(key='a', text='x')"})
        assert not done.is_error and done.structured_content["value"] == "wrote a", done
        idle = await bob.call_tool("run_python", {"code": "1 + 1"})
        assert not idle.is_error
    assert len(alice_asked) == 1 and bob_asked == []
    log = [json.loads(line) for line in (state_dir / "calls.jsonl").read_text().splitlines()]
    assert [(entry["principal"], entry["decision"]) for entry in log] == [
        ("alice", "allowed once by the user")
    ]


# --- over 2026-07-28: the question rides an input_required result, the retry answers it ----


async def test_over_2026_07_28_the_call_asks_by_input_required_and_goes_on_after_the_retry(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine)
    asked, elicitation = user(in_turn("allow_once", "deny", "allow_session"))
    async with modern_bridge_client(env, elicitation) as client:
        assert client.protocol_version == "2026-07-28"
        code = (
            "print('before')\nn = 1\nwritten = mcp_notes.write_note(key='a', text='x')\nn += 1\n[written, n]"
        )
        done = await client.call_tool("run_python", {"code": code})
        assert done.structured_content["value"] == ["wrote a", 2], done  # the code went on, state intact
        assert done.structured_content["stdout"] == "before\n", done  # printed before the question: kept
        assert len(asked) == 1 and 'mcp_notes.write_note({"key":"a","text":"x"})' in asked[0].message
        denied = await client.call_tool(
            "run_python",
            {
                "code": "try:\n    mcp_notes.delete_note(key='a')\n"
                "except runtime.ApprovalDenied as e:\n    said = str(e)\nsaid"
            },
        )
        assert "the user chose 'Deny'" in denied.structured_content["value"], denied
        twice = await client.call_tool(
            "run_python", {"code": "[mcp_notes.write_note(key=k, text='y') for k in 'bc']"}
        )
        assert twice.structured_content["value"] == ["wrote b", "wrote c"] and len(asked) == 3, twice

        # The retry by hand: a state the bridge did not seal is refused, and answers given
        # once cannot be given again (the tool is called once).
        first = await client.session.call_tool(
            "run_python", {"code": "mcp_notes.delete_note(key='z')"}, allow_input_required=True
        )
        assert isinstance(first, types.InputRequiredResult) and first.request_state, first
        ((key, request),) = (first.input_requests or {}).items()
        assert isinstance(request, types.ElicitRequest) and "mcp_notes.delete_note" in request.params.message
        allow: dict[str, types.InputResponse] = {
            key: types.ElicitResult(action="accept", content={"decision": "allow_once"})
        }
        with pytest.raises(MCPError, match="Invalid or expired requestState"):
            await client.session.call_tool(
                "run_python",
                {"code": "mcp_notes.delete_note(key='z')"},
                input_responses=allow,
                request_state=first.request_state[:-4] + "AAAA",
            )
        with pytest.raises(MCPError, match="Invalid or expired requestState"):  # bound to these arguments
            await client.session.call_tool(
                "run_python", {"code": "1"}, input_responses=allow, request_state=first.request_state
            )
        retried = await client.session.call_tool(
            "run_python",
            {"code": "mcp_notes.delete_note(key='z')"},
            input_responses=allow,
            request_state=first.request_state,
            allow_input_required=True,
        )
        assert isinstance(retried, types.CallToolResult), retried
        assert retried.structured_content and retried.structured_content["value"] == "deleted z", retried
        again = await client.session.call_tool(
            "run_python",
            {"code": "mcp_notes.delete_note(key='z')"},
            input_responses=allow,
            request_state=first.request_state,
            allow_input_required=True,
        )
        assert isinstance(again, types.CallToolResult) and again.is_error
        assert "came too late" in text_of(again), again
    assert [(call["tool"], call["arguments"]["key"]) for call in received(record)] == [
        ("write_note", "a"),
        ("write_note", "b"),
        ("write_note", "c"),
        ("delete_note", "z"),
    ]


async def test_a_call_that_answers_still_running_says_which_approval_it_waits_for(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    asked, elicitation = user(choosing("allow_once", after=4))
    async with bridge_client(env, elicitation=elicitation) as client:
        warm = await run_cell(client, "mcp_notes.lookup(key='a')")  # the server is up: asked at once below
        while warm["status"] == "running":  # a loaded machine may take a second to start it
            warm = (await run_cell(client, "None")).get("earlier", warm)
        assert warm["json"] == "note a", warm
        first = await run_cell(client, "mcp_notes.write_note(key='late', text='x')")
        assert first["status"] == "running", first
        assert "waiting for the user to approve mcp_notes.write_note(" in first["detail"], first
        for _ in range(15):  # each call waits up to 1 s for the code above, then runs its own
            rest = await run_cell(client, "1")
            if rest["status"] != "running":
                break
        assert rest["earlier"]["json"] == "wrote late" and rest["json"] == 1, rest
    assert len(asked) == 1 and [call["arguments"]["key"] for call in received(record)] == ["a", "late"]


async def test_a_question_asked_while_no_call_waits_goes_to_the_next_call(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine, bridge_respond_after="1")
    asked_at: list[float] = []

    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        asked_at.append(time.monotonic())
        return types.ElicitResult(action="accept", content={"decision": "allow_once"})

    _, elicitation = user(answer)
    async with bridge_client(env, elicitation=elicitation) as client:
        warm = await run_cell(client, "mcp_notes.lookup(key='a')")
        while warm["status"] == "running":  # a loaded machine may take a second to start it
            warm = (await run_cell(client, "None")).get("earlier", warm)
        first = await run_cell(
            client, "import time\ntime.sleep(3)\nmcp_notes.write_note(key='later', text='x')"
        )
        assert first["status"] == "running" and asked_at == [], first  # answered before the code asked
        await anyio.sleep(4)  # the code asks now, while no call waits: the question is kept
        assert asked_at == []
        second_started = time.monotonic()
        rest = await run_cell(client, "2")
        for _ in range(10):
            if rest["status"] != "running":
                break
            rest = await run_cell(client, "2")
        assert rest["earlier"]["json"] == "wrote later" and rest["json"] == 2, rest
        assert len(asked_at) == 1 and asked_at[0] >= second_started  # through the call that waited
    assert [call["arguments"]["key"] for call in received(record)] == ["a", "later"]


async def test_a_wrong_argument_name_is_refused_with_the_signature_before_any_question(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, record = setup(tmp_path, state_dir, engine)
    asked, elicitation = user(choosing("allow_once"))
    async with bridge_client(env, elicitation=elicitation) as client:
        wrong = await run_cell(
            client,
            """
            try:
                mcp_notes.write_note(key='a', txt='hello')
            except runtime.MCPError as exc:
                said = str(exc)
            said
            """,
        )
        assert wrong["json"] == (
            "mcp_notes.write_note was not called: no parameter txt (did you mean text?); missing the "
            "required text. Its signature: mcp_notes.write_note(key: str, text: str) -> dict  # Write one "
            "note (no annotations: it may change things)"
        ), wrong
    assert asked == [] and received(record) == []  # neither asked about nor sent
    (logged,) = [json.loads(line) for line in (state_dir / "calls.jsonl").read_text().splitlines()]
    assert (logged["tool"], logged["decision"]) == ("write_note", "refused") and "txt" in logged["error"]


async def test_a_servers_question_may_take_longer_than_the_tool_timeout(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    env, _ = setup(tmp_path, state_dir, engine, bridge_tool_timeout="3")

    async def slow_yes(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        await anyio.sleep(5)  # longer than MCP_BRIDGE_TOOL_TIMEOUT: that clock stands still meanwhile
        return types.ElicitResult(action="accept", content={"confirm": True})

    _, elicitation = user(slow_yes)
    async with bridge_client(env, elicitation=elicitation) as client:
        answer = await run_cell(client, "mcp_notes.confirm_with_user(question='Go on?')")
        assert answer["json"] == "confirmed", answer
