"""Progress notifications: a client that sends a progress token hears, while code runs,
the seconds elapsed with the latest line of output, or what the code reports with
runtime.progress(done, total, message); values always increase. Through the SDK's client."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp.shared.dispatcher import ProgressFnT

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, text_of

pytestmark = pytest.mark.anyio
# progress is relayed by the bridge: the first requested runtime is enough.
ONE_RUNTIME = True

Heard = list[tuple[float, float | None, str | None]]


def listener() -> tuple[Heard, ProgressFnT]:
    """A progress callback for the SDK's client, and the list of what it heard."""
    heard: Heard = []

    async def listen(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, total, message))

    return heard, listen


async def test_long_running_code_reports_its_latest_output_line(engine: Engine, state_dir: Path) -> None:
    heard, listen = listener()
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool(
            "run_python",
            {"code": "import time\nfor n in range(7):\n    print('step', n, flush=True)\n    time.sleep(1)"},
            progress_callback=listen,
        )
        assert not result.is_error, text_of(result)
    # A 7-second run with one notification every 2 seconds: at least 2 (a loaded machine may be late).
    assert len(heard) >= 2, heard
    values = [value for value, _, _ in heard]
    assert values == sorted(set(values)), heard
    assert all(total is None and message and message.startswith("step ") for _, total, message in heard)


async def test_code_reports_its_own_progress(engine: Engine, state_dir: Path) -> None:
    heard, listen = listener()
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool(
            "run_python",
            {
                "code": "import time\nfrom mcp import runtime\n"
                "for n in range(1, 4):\n    runtime.progress(n, 3, 'file %d of 3' % n)\n    time.sleep(0.4)\n"
                "runtime.progress(2, 3, 'going back is ignored')\n"
                "time.sleep(2.5)  # and the ticker stays quiet: the code reports its own"
            },
            progress_callback=listen,
        )
        assert not result.is_error, text_of(result)
        refused = await client.call_tool("run_python", {"code": "runtime.progress(-1)"})
    assert heard == [(1, 3, "file 1 of 3"), (2, 3, "file 2 of 3"), (3, 3, "file 3 of 3")]
    assert refused.is_error and "Bad arguments for runtime.progress: done" in text_of(refused)


async def test_progress_is_thinned_and_cleaned() -> None:
    sent: Heard = []

    async def report(value: float, total: float | None, message: str | None) -> None:
        sent.append((value, total, message))

    progress = bridge.CallProgress(report)
    progress.saw_output("first\n\x1b[31mred\x1b[0m\n\n")
    await progress.tick(2.0)
    await progress.from_code(5, None, "x" * 500)  # too soon after the tick: dropped
    assert sent == [(0.001, None, "red")]
    await anyio.sleep(bridge.MIN_PROGRESS_GAP)
    await progress.from_code(1, 10, "x" * 500)  # the ticker's values stay below the code's own
    assert sent[1] == (1, 10, "x" * 200)
