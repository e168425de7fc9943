#!/usr/bin/env python3
"""A fake, scripted Anthropic Messages API on loopback, for watching what Claude Code
(or any Messages API client) sends to the model.

    python3 fake_anthropic.py --port 0 --script script.json --out RUN_DIR

Writes into RUN_DIR:
  port               the port it listens on (written once listening)
  requests.jsonl     every request: time, method, path, headers (x-api-key masked), body
  turns.jsonl        one line per main-loop /v1/messages request: the step it answered,
                     the messages after the last assistant message (the tool_result(s)
                     Claude Code sent for the previous step, in full, and any reminders
                     it added), and the time since the
                     previous step's tool_use was sent
  first_request.json the first main-loop /v1/messages body (system prompt, tools, ...)

The script (JSON): {"tool": "mcp__code-execution__run_python",
                    "steps": [{"label": "a1", "input": {"code": "..."}}, ...,
                              {"label": "end", "final": "text"}]}
A step with "input" answers with a tool_use of "tool" (or the step's own "tool");
"auto_tool_search": false leaves a deferred tool unloaded (the script's own ToolSearch
steps then show what a search by words finds);
a step with "final" answers with text and stop_reason end_turn. The step to answer is
derived from the request itself (the number of assistant messages already in it), so
retries of the same request get the same answer. Requests whose `tools` do not name the
scripted tool (Claude Code's side requests: titles, quota checks, summaries) get a short
text answer and do not move the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

Json = dict[str, Any]

LOCK = threading.Lock()


class State:
    def __init__(self, script: Json, out: str):
        self.script = script
        self.tool: str = script.get("tool", "mcp__code-execution__run_python")
        self.steps: list[Json] = script["steps"]
        self.out = out
        self.started = time.time()
        self.sent_at: dict[int, float] = {}  # step -> time its answer was fully sent
        self.first_saved = False

    def log(self, name: str, record: Json) -> None:
        with LOCK, open(os.path.join(self.out, name), "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


STATE: State


def estimate_tokens(obj: object) -> int:
    return max(1, len(json.dumps(obj, ensure_ascii=False)) // 4)


def tool_names(body: Json) -> set[str]:
    return {str(t.get("name")) for t in body.get("tools") or [] if isinstance(t, dict)}


def scripted_tools() -> set[str]:
    return {STATE.tool} | {str(s["tool"]) for s in STATE.steps if s.get("tool")}


def is_main_loop(body: Json) -> bool:
    """The agent loop's requests carry the scripted tool, or (Claude Code >= 2.1.2xx with
    tool search) the ToolSearch tool and the scripted tool's name in the deferred list."""
    names = tool_names(body)
    if names & scripted_tools():
        return True
    return "ToolSearch" in names and STATE.tool in json.dumps(body)


def tool_uses(body: Json) -> list[Json]:
    return [
        b
        for m in body.get("messages", [])
        if m.get("role") == "assistant" and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def step_for(body: Json) -> int:
    """The script step to answer: the scripted calls already made (a ToolSearch call the
    harness inserted does not count)."""
    return sum(1 for b in tool_uses(body) if b.get("name") in scripted_tools())


def needs_tool_search(body: Json) -> bool:
    """The scripted tool is deferred (not in `tools`) and not loaded yet: call ToolSearch first."""
    if STATE.tool in tool_names(body) or "ToolSearch" not in tool_names(body):
        return False
    return not any(b.get("name") == "ToolSearch" for b in tool_uses(body))


def tail_after_assistant(messages: list[Json]) -> list[Json]:
    last = max([i for i, m in enumerate(messages) if m.get("role") == "assistant"], default=-1)
    return messages[last + 1 :]


def build_message(body: Json) -> tuple[Json, int | None]:
    """The assistant message to answer with, and the script step it is (None: side request,
    -1: the ToolSearch call)."""
    model = body.get("model", "claude-fake")
    msg_id = "msg_fake_%s" % uuid.uuid4().hex[:16]
    usage = {
        "input_tokens": estimate_tokens(body.get("messages", [])),
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    message: Json = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "stop_sequence": None,
        "usage": usage,
    }
    if not is_main_loop(body):
        return {**message, "content": [{"type": "text", "text": "OK"}], "stop_reason": "end_turn"}, None
    if STATE.script.get("auto_tool_search", True) and needs_tool_search(body):
        search = {
            "type": "tool_use",
            "id": "toolu_toolsearch",
            "name": "ToolSearch",
            "input": {"query": "select:%s" % STATE.tool, "max_results": 1},
        }
        return {**message, "content": [search], "stop_reason": "tool_use"}, -1
    n = step_for(body)
    step = STATE.steps[n] if n < len(STATE.steps) else {"label": "past-end", "final": "Script finished."}
    content: list[Json] = []
    if "final" in step:
        content.append({"type": "text", "text": step["final"]})
        stop = "end_turn"
    else:
        if step.get("say"):
            content.append({"type": "text", "text": step["say"]})
        content.append(
            {
                "type": "tool_use",
                "id": "toolu_%02d_%s" % (n, str(step.get("label", "step"))[:20].replace(" ", "_")),
                "name": step.get("tool", STATE.tool),
                "input": step["input"],
            }
        )
        stop = "tool_use"
    return {**message, "content": content, "stop_reason": stop}, n


def sse_events(message: Json) -> Iterator[tuple[str, Json]]:
    start = dict(
        message,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=dict(message["usage"], output_tokens=1),
    )
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
            )
            text = block["text"]
            for j in range(0, max(len(text), 1), 40):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "text_delta", "text": text[j : j + 40]},
                    },
                )
        elif block["type"] == "tool_use":
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": i,
                    "content_block": {
                        "type": "tool_use",
                        "id": block["id"],
                        "name": block["name"],
                        "input": {},
                    },
                },
            )
            raw = json.dumps(block["input"])
            for j in range(0, len(raw), 30):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": raw[j : j + 30]},
                    },
                )
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def save_json(name: str, obj: object) -> None:
    with open(os.path.join(STATE.out, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-anthropic/1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet; everything goes to requests.jsonl
        pass

    def _read_body(self) -> tuple[bytes, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return raw, json.loads(raw) if raw else None
        except ValueError:
            return raw, None

    def _record(self, body_json: Any, raw: bytes) -> None:
        headers = {
            k: ("<masked>" if k.lower() in ("x-api-key", "authorization") else v)
            for k, v in self.headers.items()
        }
        STATE.log(
            "requests.jsonl",
            {
                "t": round(time.time() - STATE.started, 3),
                "method": self.command,
                "path": self.path,
                "headers": headers,
                "body": body_json if body_json is not None else raw.decode("utf-8", "replace")[:2000],
            },
        )

    def _json(self, code: int, obj: Json) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", "req_fake_%s" % uuid.uuid4().hex[:12])
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self, path: str) -> None:
        self._json(
            404, {"type": "error", "error": {"type": "not_found_error", "message": "fake: no " + path}}
        )

    def do_GET(self) -> None:
        self._record(None, b"")
        path = urlsplit(self.path).path
        if path.startswith("/v1/models"):
            model = {
                "type": "model",
                "id": "claude-sonnet-4-5",
                "display_name": "fake",
                "created_at": "2025-01-01T00:00:00Z",
            }
            self._json(
                200,
                {"data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]},
            )
        else:
            self._not_found(path)

    def do_HEAD(self) -> None:
        self._record(None, b"")
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        raw, body = self._read_body()
        self._record(body, raw)
        path = urlsplit(self.path).path
        if path == "/v1/messages/count_tokens":
            self._json(200, {"input_tokens": estimate_tokens(body)})
            return
        if path != "/v1/messages" or not isinstance(body, dict):
            self._not_found(path)
            return
        message, n = build_message(body)
        now = time.time()
        uses = tool_uses(body)
        last_is_toolsearch = bool(uses) and uses[-1].get("name") == "ToolSearch"
        if (
            n is not None
            and last_is_toolsearch
            and not os.path.exists(os.path.join(STATE.out, "toolsearch_result.json"))
        ):
            save_json(
                "toolsearch_result.json",
                {
                    "tail_messages": tail_after_assistant(body.get("messages", [])),
                    "tools_now": sorted(name for name in tool_names(body) if name),
                },
            )
        if n is not None and not STATE.first_saved:
            STATE.first_saved = True
            save_json("first_request.json", body)
        if n == -1:
            STATE.log(
                "turns.jsonl",
                {"t": round(now - STATE.started, 3), "step": "toolsearch", "answer": message["content"]},
            )
        elif n is not None:
            prev = n - 1
            STATE.log(
                "turns.jsonl",
                {
                    "t": round(now - STATE.started, 3),
                    "step": n,
                    "label": STATE.steps[n]["label"] if n < len(STATE.steps) else "past-end",
                    "answers_step": prev if prev >= 0 else None,
                    "answers_label": STATE.steps[prev]["label"] if 0 <= prev < len(STATE.steps) else None,
                    "seconds_since_tool_use_sent": (
                        round(now - STATE.sent_at[prev], 3) if prev in STATE.sent_at else None
                    ),
                    # the messages after the last assistant one: the tool_result(s) for the
                    # previous step, plus whatever Claude Code added (system reminders)
                    "tail_messages": tail_after_assistant(body.get("messages", [])),
                    "n_messages": len(body.get("messages", [])),
                    "answer": message["content"],
                },
            )
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("transfer-encoding", "chunked")
            self.send_header("request-id", "req_fake_%s" % uuid.uuid4().hex[:12])
            self.end_headers()
            for event, data in sse_events(message):
                chunk = ("event: %s\ndata: %s\n\n" % (event, json.dumps(data))).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        else:
            self._json(200, message)
        if n is not None and n >= 0:
            STATE.sent_at[n] = time.time()


def main() -> None:
    global STATE
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--script", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.script, encoding="utf-8") as f:
        STATE = State(json.load(f), args.out)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    httpd.daemon_threads = True
    port = httpd.server_address[1]
    with open(os.path.join(args.out, "port.tmp"), "w") as f:
        f.write(str(port))
    os.replace(os.path.join(args.out, "port.tmp"), os.path.join(args.out, "port"))  # whole when seen
    print("fake Anthropic API on http://127.0.0.1:%d" % port, file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
