"""runtime.attach(path): a file from the sandbox reaches the client as an embedded resource
(text as text, anything else as base64), byte for byte, within a size cap; through a
real MCP client on both runtimes."""

from __future__ import annotations

import base64
from pathlib import Path

import mcp_types as types
import pytest

import mcp_server_code_execution_mode as bridge
from mcp_sandbox_kernel import Attachment
from tests.conftest import Engine, bridge_client, bridge_env, text_of

pytestmark = pytest.mark.anyio
# attachments are checked and rendered on the host: the first requested runtime is enough.
ONE_RUNTIME = True


def resources(result: types.CallToolResult) -> list[types.TextResourceContents | types.BlobResourceContents]:
    return [block.resource for block in result.content if isinstance(block, types.EmbeddedResource)]


async def test_attached_files_arrive_byte_for_byte(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool(
            "run_python",
            {
                "code": "from mcp import runtime\n"
                "open('/workspace/out.csv', 'w').write('city,temp\\nOslo,3\\n')\n"
                "open('/tmp/data.bin', 'wb').write(bytes(range(256)))\n"
                "open('/tmp/latin.txt', 'wb').write('café'.encode('latin-1'))\n"
                "[runtime.attach(path) for path in ('/workspace/out.csv', '/tmp/data.bin', '/tmp/latin.txt')]"
            },
        )
    assert not result.is_error and result.structured_content is None, text_of(result)
    assert text_of(result) == "['file:///workspace/out.csv', 'file:///tmp/data.bin', 'file:///tmp/latin.txt']"
    csv, binary, latin = resources(result)
    assert isinstance(csv, types.TextResourceContents)
    assert (str(csv.uri), csv.mime_type, csv.text) == (
        "file:///workspace/out.csv",
        "text/csv",
        "city,temp\nOslo,3\n",
    )
    assert isinstance(binary, types.BlobResourceContents) and binary.mime_type == "application/octet-stream"
    assert base64.b64decode(binary.blob) == bytes(range(256))
    assert isinstance(latin, types.BlobResourceContents) and latin.mime_type == "text/plain"  # not UTF-8
    assert base64.b64decode(latin.blob) == "café".encode("latin-1")


async def test_a_file_over_the_cap_or_the_eleventh_is_refused_clearly(
    engine: Engine, state_dir: Path
) -> None:
    env = bridge_env(engine, state_dir, MCP_BRIDGE_MAX_ATTACHMENT_BYTES="1000")
    async with bridge_client(env) as client:
        big = await client.call_tool(
            "run_python",
            {
                "code": "from mcp import runtime\nopen('/tmp/big', 'wb').write(b'x' * 1001)\n"
                "runtime.attach('/tmp/big')"
            },
        )
        assert big.is_error and not resources(big)
        assert "attach: /tmp/big is larger than 1000 bytes (MCP_BRIDGE_MAX_ATTACHMENT_BYTES)" in text_of(big)
        many = await client.call_tool(
            "run_python",
            {
                "code": "open('/tmp/small', 'w').write('ok')\n"
                "for _ in range(11):\n    runtime.attach('/tmp/small')"
            },
        )
        assert many.is_error and "attach: at most 10 files per call" in text_of(many)
        assert len(resources(many)) == 10  # the ten attached before the error still arrive
        missing = await client.call_tool("run_python", {"code": "runtime.attach('/nope')"})
        assert missing.is_error and "FileNotFoundError" in text_of(missing)


def test_the_host_drops_attachments_that_are_not_within_the_cap() -> None:
    config = bridge.BridgeConfig(max_attachment_bytes=4)
    blob: Attachment = {"uri": "file:///tmp/d", "mime_type": "application/zip", "blob": "AA=="}
    kept, notices = bridge.checked_attachments(
        [
            {"uri": "file:///tmp/a", "mime_type": "text/plain", "text": "abcd"},
            {"uri": "http://evil/a", "mime_type": "text/plain", "text": "x"},
            {"uri": "file:///tmp/b", "mime_type": "application/zip", "blob": "not base64!"},
            {"uri": "file:///tmp/c", "mime_type": "text/plain", "text": "abcde"},
            {"uri": "file:///tmp/e", "mime_type": "text/plain", "text": "\ud800"},  # JSON cannot carry it
            *[blob] * 10,
        ],
        config,
    )
    assert len(kept) == 10 and kept[0].resource.text == "abcd"  # type: ignore[union-attr]
    assert notices == [
        "File 2 was dropped: not a valid attachment within the cap.",
        "File 3 was dropped: not a valid attachment within the cap.",
        "File 4 was dropped: not a valid attachment within the cap.",
        "File 5 was dropped: not a valid attachment within the cap.",
        "File 15 was dropped: at most 10 files per call.",
    ]


def control_characters(text: str) -> list[str]:
    return [char for char in text if (ord(char) < 32 and char not in "\n\t\r") or 0x7F <= ord(char) <= 0x9F]


async def test_escape_sequences_in_an_attachment_reach_no_client_raw(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        result = await client.call_tool(
            "run_python",
            {
                "code": "from mcp import runtime\n"
                "open('/tmp/t.txt', 'w').write('hi \\x1b]0;owned\\x07\\x1b[2J')\n"
                "runtime.attach('/tmp/t.txt', mime_type='text/\\x1b[2Jplain\\x9b')"
            },
        )
    (contents,) = resources(result)
    assert contents.mime_type == "text/plain" and control_characters(str(contents.uri)) == [], contents
    # Text holding control characters goes as base64: byte for byte, and shown by no terminal.
    assert isinstance(contents, types.BlobResourceContents), contents
    assert base64.b64decode(contents.blob) == b"hi \x1b]0;owned\x07\x1b[2J"


def test_a_forged_attachment_uri_has_its_control_characters_percent_encoded() -> None:
    kept, _ = bridge.checked_attachments(
        [{"uri": "file:///tmp/a\x1b]0;x\x07\x9b", "mime_type": "text/\x1b[31mcsv", "text": "a,b\r\n1,2\r\n"}],
        bridge.BridgeConfig(),
    )
    (block,) = bridge.tool_result(["ok"], None, False, attachments=kept).content[1:]
    assert isinstance(block, types.EmbeddedResource) and isinstance(
        block.resource, types.TextResourceContents
    )
    assert (str(block.resource.uri), block.resource.mime_type, block.resource.text) == (
        "file:///tmp/a%1B]0;x%07%C2%9B",
        "text/csv",
        "a,b\r\n1,2\r\n",  # line ends are no control sequence: text stays text
    )
