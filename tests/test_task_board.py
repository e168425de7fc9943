"""The TaskBoard that keeps the bridge's MCP tasks (issue 20, item 3): a principal reaches
only its own tasks; ended tasks are kept per principal up to MAX_ENDED_TASKS_PER_PRINCIPAL
(the oldest ended go first, another principal's stay); a task goes after its ttl. Unit
tests of the one class, with stand-ins for the code a task runs (tests/test_tasks.py runs
real tasks through a real client and container)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

import mcp_server_code_execution_mode as bridge


def task(principal: str, timeout: float = 30.0) -> bridge.McpTask:
    request = SimpleNamespace(principal=SimpleNamespace(name=principal), client_name=None, timeout=timeout)
    keeper: Any = SimpleNamespace(name="default")
    running: Any = SimpleNamespace(request=request)
    return bridge.McpTask(keeper, running, [], None)


def test_a_principal_reaches_only_its_own_tasks() -> None:
    board = bridge.TaskBoard()
    alice, bob = task("alice"), task("bob")
    board.add(alice)
    board.add(bob)
    assert board.get("alice", alice.id) is alice
    with pytest.raises(bridge.InvalidRequestError, match="No task"):
        board.get("alice", bob.id)  # bob's task is none of alice's
    with pytest.raises(bridge.InvalidRequestError, match="No task"):
        board.get("alice", "made-up")


def test_ended_tasks_are_kept_per_principal_oldest_ended_first() -> None:
    board = bridge.TaskBoard()
    bobs = task("bob")
    bobs.end(None, cancelled="stopped")
    board.add(bobs)
    running = task("alice")
    board.add(running)
    ended = []
    for _ in range(bridge.MAX_ENDED_TASKS_PER_PRINCIPAL + 3):
        done = task("alice")
        done.end(None, cancelled="stopped")
        board.add(done)
        ended.append(done)
    board.add(task("alice"))  # each add prunes
    kept = set(board.tasks)
    assert {t.id for t in ended[:3]}.isdisjoint(kept)  # the oldest ended went
    assert {t.id for t in ended[3:]} <= kept and running.id in kept  # a running task stays
    assert bobs.id in kept  # another principal's ended task is not pushed out


def test_a_task_goes_after_its_ttl_and_its_first_end_stands() -> None:
    board = bridge.TaskBoard()
    old = task("alice", timeout=10)
    old.created -= timedelta(seconds=10 + bridge.TASK_KEPT_AFTER_TIMEOUT + 1)
    board.add(old)
    assert board.get("alice", old.id) is old  # its code still runs (an approval paused it)
    old.end(bridge.ExecutionOutcome(status="ok"))
    with pytest.raises(bridge.InvalidRequestError):
        board.get("alice", old.id)

    cancelled = task("alice")
    cancelled.end(None, cancelled="tasks/cancel stopped it")
    cancelled.end(None, RuntimeError("late"))  # a later end changes nothing
    assert cancelled.state == "cancelled" and cancelled.reason == "tasks/cancel stopped it"
