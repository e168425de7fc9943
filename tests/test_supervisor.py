"""The supervisor's pure parts, on the host: the frame schemas it enforces on the
executor, the tolerant decoder it reads the executor with, the process-tree walk it
kills with, and the exit reasons it reports. (The whole supervisor runs for real in
tests/test_kernel.py on the host and tests/test_containment.py in containers.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from mcp_sandbox_kernel import (
    BRIDGE_FRAME_TYPES,
    EXECUTOR_FRAME_TYPES,
    KERNEL_FRAME_TYPES,
    FrameDecoder,
    ProtocolError,
    describe_exit,
    encode_frame,
    live_descendants,
    validate_frame,
)

CAP = 1024


# --- frame schemas ------------------------------------------------------------------


def test_a_result_may_carry_the_supervisors_notices_and_new_statuses() -> None:
    frame = {
        "type": "result",
        "id": "e1",
        "status": "killed",
        "value": None,
        "error": {"type": "Killed", "message": "stopped", "traceback": ""},
        "cut": {
            "stdout": {"count": 3, "tail": "end", "file": "/tmp/outputs/1.stdout"},
            "value": {"count": 0, "tail": ""},
        },
        "notices": ["a notice"],
    }

    assert validate_frame(frame, KERNEL_FRAME_TYPES) is frame
    assert validate_frame(dict(frame, status="crashed"), KERNEL_FRAME_TYPES)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("status", "bogus"),
        ("value", 12345),
        ("error", "str"),
        ("cut", {"stdout": "lots"}),
        ("cut", {"elsewhere": {"count": 1, "tail": ""}}),
        ("cut", {"stdout": {"count": -1, "tail": ""}}),
        ("cut", {"stdout": {"count": 1, "tail": 5}}),
        ("cut", {"stdout": {"count": 1, "tail": "", "file": "x" * 5000}}),
        ("cut", {"value": {"count": 1}}),
        ("notices", "not a list"),
        ("notices", [1, 2]),
        ("notices", ["x"] * 101),
        ("id", [0] * 10),
        ("id", "x" * 65),
    ],
)
def test_a_result_with_a_field_of_the_wrong_type_or_size_is_refused(field: str, value: object) -> None:
    frame = {"type": "result", "id": "e1", "status": "ok", field: value}

    with pytest.raises(ProtocolError, match=field):
        validate_frame(frame, KERNEL_FRAME_TYPES)


def test_the_executor_may_not_send_what_only_the_supervisor_sends() -> None:
    for kind in ("stream", "execute", "interrupt", "response"):
        with pytest.raises(ProtocolError, match="frame type"):
            validate_frame({"type": kind, "id": "x"}, EXECUTOR_FRAME_TYPES)


def test_an_interrupt_may_name_its_grace_period() -> None:
    assert validate_frame({"type": "interrupt", "id": "e1", "grace": 2.5}, BRIDGE_FRAME_TYPES)
    for grace in (0, -1, "3", 1e9, True):
        with pytest.raises(ProtocolError, match="grace"):
            validate_frame({"type": "interrupt", "id": "e1", "grace": grace}, BRIDGE_FRAME_TYPES)


# --- the tolerant decoder -------------------------------------------------------------


def test_a_tolerant_decoder_skips_and_counts_what_is_not_a_frame() -> None:
    decoder = FrameDecoder(CAP, tolerant=True)
    good = encode_frame({"type": "hello", "protocol": 2, "python": "3.11.0"}, CAP)

    frames = decoder.feed(b"not json\n[1, 2]\n" + b"[" * 5000 + b"]" * 5000 + b"\n" + good)

    assert frames == [{"type": "hello", "protocol": 2, "python": "3.11.0"}]
    assert decoder.rejected == 3


def test_a_tolerant_decoder_discards_an_oversized_line_as_it_arrives() -> None:
    decoder = FrameDecoder(CAP, tolerant=True)
    good = encode_frame({"type": "cancel", "id": "r1"}, CAP)

    assert decoder.feed(b"x" * (CAP * 3)) == []
    assert decoder.feed(b"y" * (CAP * 3)) == []  # still inside the oversized line: dropped
    assert decoder.feed(b"tail\n" + good) == [{"type": "cancel", "id": "r1"}]
    assert decoder.rejected == 1


def test_a_strict_decoder_refuses_deep_nesting_with_a_protocol_error() -> None:
    decoder = FrameDecoder(1 << 22)

    with pytest.raises(ProtocolError, match="RecursionError"):
        decoder.feed(b"[" * 200_000 + b"]" * 200_000 + b"\n")


def test_a_long_frame_fed_in_small_chunks_is_decoded_whole() -> None:
    decoder = FrameDecoder(1 << 22)
    data = encode_frame({"type": "stream", "id": "e", "name": "stdout", "text": "z" * 1_000_000}, 1 << 22)

    frames = []
    for start in range(0, len(data), 4096):
        frames += decoder.feed(data[start : start + 4096])

    assert len(frames) == 1 and len(frames[0]["text"]) == 1_000_000


# --- the process tree ------------------------------------------------------------------------


def test_live_descendants_finds_the_whole_tree_below_a_process() -> None:
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        found: list[int] = []
        while len(found) < 2 and time.monotonic() < deadline:
            found = live_descendants(tree.pid)
            time.sleep(0.02)
        assert len(found) == 2, found
        assert tree.pid not in found
        assert os.getpid() not in live_descendants(tree.pid)
    finally:
        for pid in live_descendants(tree.pid):
            os.kill(pid, signal.SIGKILL)
        tree.kill()
        tree.wait()


def test_exit_reasons_are_written_for_the_model() -> None:
    killed = describe_exit(signal.SIGKILL, "512m")  # a raw wait status: killed by signal 9
    assert "out-of-memory killer" in killed and "512m" in killed
    assert describe_exit(3 << 8, "512m") == "exited with code 3"
    assert describe_exit(signal.SIGSEGV, "512m") == "was killed by SIGSEGV"
