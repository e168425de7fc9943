"""Wire protocol section: encode_frame / FrameDecoder, shared by the bridge and the kernel."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

import mcp_sandbox_kernel as kernel
import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, ProtocolError, encode_frame

MAX = DEFAULT_MAX_FRAME_BYTES


def round_trip(frame: dict[str, Any], max_frame_bytes: int = MAX) -> dict[str, Any]:
    data = encode_frame(frame, max_frame_bytes)
    frames = FrameDecoder(max_frame_bytes).feed(data)
    assert len(frames) == 1
    return frames[0]


def test_bridge_uses_the_kernels_frame_functions() -> None:
    # One place builds and parses frames: the bridge re-exports the kernel's.
    names = vars(bridge)
    assert names["encode_frame"] is encode_frame
    assert names["FrameDecoder"] is FrameDecoder
    assert names["ProtocolError"] is ProtocolError


def test_frame_round_trips() -> None:
    frame = {"type": "execute", "id": "abc123", "code": "print(1)", "n": 3, "ok": True, "none": None}

    assert round_trip(frame) == frame


def test_encoded_frame_is_one_line_terminated_by_newline() -> None:
    data = encode_frame({"type": "stream", "text": "a\nb\r\nc\n"}, MAX)

    assert data.endswith(b"\n")
    assert data.count(b"\n") == 1


def test_non_ascii_and_embedded_newlines_survive() -> None:
    text = "héllo wörld ✓ 日本語 🐍\nsecond line\r\nthird\x00nul\ttab\u2028sep"
    frame = {"type": "stream", "name": "stdout", "text": text}

    assert round_trip(frame)["text"] == text


def test_non_ascii_is_sent_as_utf8_not_escaped() -> None:
    data = encode_frame({"type": "stream", "text": "é🐍"}, MAX)

    assert "é🐍".encode() in data


def test_lone_surrogate_survives() -> None:
    # User output decoded with surrogateescape-style errors may carry lone surrogates.
    frame = {"type": "stream", "text": "bad \udcff byte"}

    assert round_trip(frame)["text"] == "bad \udcff byte"


def test_five_megabyte_frame_round_trips_without_a_line_limit() -> None:
    text = "0123456789abcdef" * (5 * 1024 * 1024 // 16)
    frame = {"type": "result", "id": "big", "value": text}
    data = encode_frame(frame, MAX)
    assert len(data) > 5 * 1024 * 1024

    decoder = FrameDecoder(MAX)
    frames: list[dict[str, Any]] = []
    for start in range(0, len(data), 1 << 16):  # delivered in pipe-sized chunks
        frames.extend(decoder.feed(data[start : start + (1 << 16)]))

    assert len(frames) == 1
    assert frames[0]["value"] == text


def test_frame_split_at_every_byte_boundary_reassembles() -> None:
    frame = {"type": "stream", "id": "x", "name": "stdout", "text": "héllo\n🐍 wörld"}
    data = encode_frame(frame, MAX)

    for cut in range(len(data) + 1):
        decoder = FrameDecoder(MAX)
        first = decoder.feed(data[:cut])
        second = decoder.feed(data[cut:])
        assert first + second == [frame], cut
        assert (first == []) == (cut < len(data)), cut


def test_frame_fed_one_byte_at_a_time_reassembles() -> None:
    frame = {"type": "stream", "text": "日本語\n" * 5}
    data = encode_frame(frame, MAX)
    decoder = FrameDecoder(MAX)

    frames = [parsed for index in range(len(data)) for parsed in decoder.feed(data[index : index + 1])]

    assert frames == [frame]


def test_several_frames_in_one_chunk_come_out_in_order() -> None:
    sent = [{"type": "stream", "id": "a", "text": str(n)} for n in range(5)]
    chunk = b"".join(encode_frame(frame, MAX) for frame in sent)

    assert FrameDecoder(MAX).feed(chunk) == sent


def test_chunk_ending_mid_frame_keeps_the_tail_for_the_next_feed() -> None:
    one = encode_frame({"type": "a"}, MAX)
    two = encode_frame({"type": "b", "text": "tail"}, MAX)
    decoder = FrameDecoder(MAX)

    assert decoder.feed(one + two[:5]) == [{"type": "a"}]
    assert decoder.feed(two[5:]) == [{"type": "b", "text": "tail"}]


def test_frame_of_exactly_the_maximum_size_is_accepted() -> None:
    overhead = len(encode_frame({"type": "t", "text": ""}, MAX))
    limit = 200
    frame = {"type": "t", "text": "x" * (limit - overhead)}

    data = encode_frame(frame, limit)

    assert len(data) == limit
    assert FrameDecoder(limit).feed(data) == [frame]


def test_encode_rejects_frame_over_the_maximum() -> None:
    with pytest.raises(ProtocolError, match="exceeds the maximum frame size of 100 bytes"):
        encode_frame({"type": "t", "text": "x" * 200}, 100)


def test_decode_rejects_complete_line_over_the_maximum() -> None:
    data = encode_frame({"type": "t", "text": "x" * 200}, MAX)

    with pytest.raises(ProtocolError, match="exceeds the maximum frame size of 100 bytes"):
        FrameDecoder(100).feed(data)


def test_decode_rejects_unterminated_runaway_buffer_before_it_completes() -> None:
    decoder = FrameDecoder(1000)
    decoder.feed(b'{"type":"t","text":"' + b"x" * 500)

    with pytest.raises(ProtocolError, match="maximum frame size of 1000 bytes"):
        decoder.feed(b"x" * 600)  # still no newline: the sender is running away


def test_decode_of_buffer_just_under_the_maximum_keeps_waiting() -> None:
    decoder = FrameDecoder(1000)

    assert decoder.feed(b"x" * 999) == []


@pytest.mark.parametrize(
    "line",
    [
        b"{not json",
        b"\xff\xfe garbage",
        b"",
        b"   ",
    ],
)
def test_malformed_json_raises_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed frame"):
        FrameDecoder(MAX).feed(line + b"\n")


@pytest.mark.parametrize("value", [[1, 2], "text", 42, None, True])
def test_non_object_frame_raises_protocol_error(value: object) -> None:
    with pytest.raises(ProtocolError, match="not an object with a string 'type'"):
        FrameDecoder(MAX).feed(json.dumps(value).encode() + b"\n")


@pytest.mark.parametrize("frame", [{}, {"id": "x"}, {"type": 1}, {"type": None}, {"type": ["a"]}])
def test_frame_without_string_type_raises_protocol_error(frame: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="string 'type'"):
        FrameDecoder(MAX).feed(json.dumps(frame).encode() + b"\n")


def test_protocol_error_message_shows_the_start_of_the_bad_line() -> None:
    with pytest.raises(ProtocolError) as caught:
        FrameDecoder(MAX).feed(b"{oops " + b"z" * 500 + b"\n")

    assert "{oops" in str(caught.value)
    assert len(str(caught.value)) < 300


# --- frame authentication -------------------------------------------------------------------

KEY = bytes(range(32))


def signed(frame: dict[str, Any], seq: int, key: bytes = KEY) -> bytes:
    return encode_frame({"seq": seq, **frame}, MAX, key)


def test_signed_frames_decode_without_their_mac_and_number() -> None:
    decoder = FrameDecoder(MAX, key=KEY)

    frames = decoder.feed(signed({"type": "stream", "text": "a"}, 1) + signed({"type": "result"}, 2))

    assert frames == [{"type": "stream", "text": "a"}, {"type": "result"}]
    assert decoder.unauthentic == 0


def test_lines_the_supervisor_did_not_sign_are_dropped_and_counted() -> None:
    decoder = FrameDecoder(MAX, key=KEY)
    good = signed({"type": "result", "value": "real"}, 1)
    tampered = good.replace(b"real", b"fake")
    forged = [
        encode_frame({"type": "result", "value": "unsigned"}, MAX),
        signed({"type": "result", "value": "other key"}, 1, key=bytes(32)),
        tampered,
        b'{"mac":"' + b"0" * 32 + b'","type":"result"}\n',
        b"not even json\n",
    ]

    assert decoder.feed(b"".join(forged)) == []
    assert decoder.unauthentic == len(forged)
    assert decoder.feed(good) == [{"type": "result", "value": "real"}]  # the channel goes on


def test_a_replayed_or_reordered_frame_is_dropped() -> None:
    decoder = FrameDecoder(MAX, key=KEY)
    call = signed({"type": "request", "id": 1, "method": "call_tool"}, 5)

    assert len(decoder.feed(call)) == 1
    assert decoder.feed(call) == []  # the same tool call twice: no
    assert decoder.feed(signed({"type": "stream"}, 4)) == []
    assert decoder.unauthentic == 2
    assert decoder.feed(signed({"type": "stream"}, 9)) == [{"type": "stream"}]  # gaps are fine


def test_a_signed_frame_still_respects_the_size_cap() -> None:
    frame = {"seq": 1, "type": "stream", "text": "x" * 100}
    size = len(encode_frame(frame, MAX, KEY))

    assert len(encode_frame(frame, size, KEY)) == size
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_frame(frame, size - 1, KEY)


# --- host requests: one protocol, declared in the kernel ---------------------------------


def json_kinds(schema: dict[str, Any]) -> str:
    """A parameter's JSON type(s) in a model's JSON schema, written as REQUEST_METHODS does."""
    if "anyOf" in schema:
        return " or ".join(json_kinds(option) for option in schema["anyOf"])
    return str(schema.get("type", "JSON"))


def test_the_bridge_serves_exactly_the_request_methods_the_kernel_declares() -> None:
    models = {name: method.params for name, method in bridge.HOST_METHODS.items()}
    assert all(name == method.name for name, method in bridge.HOST_METHODS.items())
    assert kernel.PROGRESS not in models  # the sandbox session running the call answers it
    models[kernel.PROGRESS] = bridge.ProgressParams
    assert list(models) == list(kernel.REQUEST_METHODS)
    for name, params in kernel.REQUEST_METHODS.items():
        properties = models[name].model_json_schema().get("properties", {})
        assert {field: json_kinds(schema) for field, schema in properties.items()} == params, name


# What the host answers the kernel's callers in the test below, where they use the answer.
ANSWERS: dict[str, Any] = {
    kernel.DISCOVERED_SERVERS: {"servers": []},
    kernel.SEARCH_TOOL_DOCS: [],
    kernel.CALL_TOOL: {"content": []},
    kernel.MEMORY_LOAD: {"value": 1, "found": True, "generation": 3},
    kernel.MEMORY_PUT_IF: {"ok": True},
    kernel.MEMORY_LIST: {"memories": [], "more": False},
    kernel.TOOL_SAVE: {"name": "saved", "tools": []},
    kernel.TOOL_SOURCES: {"tools": [], "skipped": []},
}


class RecordingRequests:
    """The kernel's HostRequests as its callers see it: records what they ask."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def call(self, method: str, params: dict[str, Any]) -> Any:
        self.sent.append((method, params))
        return ANSWERS.get(method)


def saved() -> None:
    pass


def test_the_kernel_asks_only_declared_methods_with_their_declared_parameters() -> None:
    requests = RecordingRequests()
    runtime = kernel.SandboxRuntime(requests, [], kernel.ImageCollector(1, 1))  # type: ignore[arg-type]
    runtime.discovered_servers(detailed=True)
    runtime.list_tools("a")
    runtime.query_tool_docs("a", "b")
    runtime.search_tool_docs("words")
    runtime.call_tool("a", "b", {"x": 1})
    runtime.list_resources("a")
    runtime.read_resource("a", "u://x")
    runtime.list_prompts("a")
    runtime.get_prompt("a", "p", {"x": "1"})
    runtime.capability_summary()
    runtime.progress(1, 2, "half")
    runtime.save_memory("k", 1)
    runtime.load_memory("k")
    runtime.update_memory("k", lambda value: value + 1)
    runtime.delete_memory("k")
    runtime.get_memory_info("k")
    runtime.list_memories()
    runtime.save_tool(saved)
    runtime.list_saved_tools()
    runtime.delete_tool("saved")
    kernel.ExecutorProcess.load_saved_tools(SimpleNamespace(requests=requests))  # type: ignore[arg-type]
    assert {method for method, _ in requests.sent} == set(kernel.REQUEST_METHODS)
    for method, params in requests.sent:
        assert list(params) == list(kernel.REQUEST_METHODS[method]), method


def test_each_frame_type_has_a_typed_dict_with_the_fields_of_its_schema() -> None:
    for kind, schema in kernel.FRAME_SCHEMAS.items():
        typed = getattr(kernel, kind.capitalize() + "Frame")
        # The kernel's annotations are text (never evaluated: it runs on Python 3.9).
        annotations = typed.__annotations__.items()
        fields = {name: getattr(text, "__forward_arg__", text) for name, text in annotations}
        assert fields.pop("type") == "Literal[%r]" % kind
        for name, rule in schema.items():
            assert fields[name].startswith("NotRequired[") == (not rule.required), (kind, name)
