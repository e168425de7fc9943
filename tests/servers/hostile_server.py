"""A hand-written stdio MCP server that misbehaves in ways the SDK's servers cannot: its
JSON carries lone surrogates (\\udcff escapes) in a result and, with --bad-docs, in its
tool list, and raw bytes that are not UTF-8.

No SDK on purpose: the SDK's own serializer refuses lone surrogates, a server in another
language may well send them, and the bridge must survive it (the SDK's validator refuses
such messages as invalid JSON). Two tools answer with responses that are not valid
JSON-RPC at all: no result, or the wrong protocol version."""

from __future__ import annotations

import json
import sys

# Written as JSON text, so the escapes and bytes reach the bridge exactly as a careless
# server would send them. With --bad-docs, the tool list itself carries a lone surrogate.
DESCRIPTION = "Returns text with a lone surrogate \\udcff in it." if "--bad-docs" in sys.argv else "Bad text."
TOOLS = (
    '[{"name": "surrogate", "description": "%s", "inputSchema": {"type": "object"}},'
    ' {"name": "raw_bytes", "description": "Invalid UTF-8.", "inputSchema": {"type": "object"}},'
    ' {"name": "no_result", "description": "Answers without a result.", "inputSchema": {"type": "object"}},'
    ' {"name": "bad_version", "description": "Answers as JSON-RPC 1.0.", "inputSchema": {"type": "object"}}]'
    % DESCRIPTION
)
INVALID = {
    "no_result": '{"jsonrpc": "2.0", "id": %s}\n',
    "bad_version": '{"jsonrpc": "1.0", "id": %s, "result": {"content": []}}\n',
}
RESULTS = {
    "surrogate": '{"content": [{"type": "text", "text": "bad \\udcff text"}], "isError": false}',
    "raw_bytes": '{"content": [{"type": "text", "text": "bad \udcff\udcfe bytes"}], "isError": false}',
}


def reply(request_id: object, result_json: str) -> None:
    line = '{"jsonrpc": "2.0", "id": %s, "result": %s}\n' % (json.dumps(request_id), result_json)
    sys.stdout.buffer.write(line.encode("utf-8", "surrogateescape"))  # \xff stays a raw byte
    sys.stdout.flush()


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        method, request_id = message.get("method"), message.get("id")
        if request_id is None:
            continue  # a notification
        if method == "initialize":
            version = message["params"].get("protocolVersion", "2025-06-18")
            reply(
                request_id,
                json.dumps(
                    {
                        "protocolVersion": version,
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "hostile", "version": "1"},
                    }
                ),
            )
        elif method == "tools/list":
            reply(request_id, '{"tools": %s}' % TOOLS)
        elif method == "tools/call" and message["params"]["name"] in INVALID:
            sys.stdout.write(INVALID[message["params"]["name"]] % json.dumps(request_id))
            sys.stdout.flush()
        elif method == "tools/call":
            reply(request_id, RESULTS[message["params"]["name"]])
        else:
            reply(request_id, "{}")


if __name__ == "__main__":
    main()
