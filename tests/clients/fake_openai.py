#!/usr/bin/env python3
"""A fake, scripted OpenAI Responses API on loopback, for watching what the Codex CLI
sends to the model when it calls an MCP tool.

    python3 fake_openai.py --port 0 --script script.json --out RUN_DIR

Same script format as fake_anthropic.py ({"steps": [{"label", "input"} ... {"final"}]});
the tool name is taken from the request's `tools` (the first whose name ends with
"run_python", or the script's "tool_suffix"). The step answered is the number of
function_call items already in the request's `input`. Writes requests.jsonl, turns.jsonl
(the input items after the last function_call: the function_call_output Codex sent) and
first_request.json into RUN_DIR.
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
        self.script, self.out = script, out
        self.steps: list[Json] = script["steps"]
        self.suffix: str = script.get("tool_suffix", "run_python")
        self.started = time.time()
        self.sent_at: dict[int, float] = {}  # step -> time its answer was fully sent
        self.first_saved = False

    def log(self, name: str, record: Json) -> None:
        with LOCK, open(os.path.join(self.out, name), "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


STATE: State


def tool_names(body: Json) -> list[str]:
    names = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if t.get("name"):
            names.append(str(t["name"]))
        for sub in t.get("tools") or []:  # namespaced tool groups, if any
            if isinstance(sub, dict) and sub.get("name"):
                names.append(str(sub["name"]))
    return names


def our_tool(body: Json) -> tuple[str | None, str] | None:
    """(namespace or None, name) of the scripted tool in the request's tools. Codex >= 0.1xx
    puts an MCP server's tools in a {"type": "namespace", "name": "mcp__<server>"} group."""
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if str(t.get("name", "")).endswith(STATE.suffix) and t.get("type") != "namespace":
            return None, str(t["name"])
        for sub in t.get("tools") or []:
            if isinstance(sub, dict) and str(sub.get("name", "")).endswith(STATE.suffix):
                return t.get("name"), str(sub["name"])
    return None


def items_of(body: Json) -> list[Any]:
    inp = body.get("input")
    return inp if isinstance(inp, list) else []


def step_of(body: Json) -> int:
    return sum(1 for it in items_of(body) if isinstance(it, dict) and it.get("type") == "function_call")


def tail_after_call(items: list[Any]) -> list[Any]:
    last = max(
        [i for i, it in enumerate(items) if isinstance(it, dict) and it.get("type") == "function_call"],
        default=-1,
    )
    return items[last + 1 :]


def text_message(text: str) -> Json:
    return {
        "type": "message",
        "id": "msg_%s" % uuid.uuid4().hex[:12],
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def build_output(body: Json) -> tuple[list[Json], int | None]:
    """The output items to answer with, and the script step they are (None: a side request)."""
    found = our_tool(body)
    if found is None:
        return [text_message("OK")], None
    n = step_of(body)
    step = STATE.steps[n] if n < len(STATE.steps) else {"label": "past-end", "final": "Script finished."}
    if "final" in step:
        return [text_message(step["final"])], n
    namespace, name = found
    item = {
        "type": "function_call",
        "id": "fc_%02d" % n,
        "call_id": "call_%02d_%s" % (n, step["label"][:20]),
        "name": name,
        "arguments": json.dumps(step["input"]),
        "status": "completed",
    }
    if namespace:
        item["namespace"] = namespace
    return [item], n


def sse(output: list[Json], body: Json) -> Iterator[tuple[str, Json]]:
    rid = "resp_%s" % uuid.uuid4().hex[:16]
    base = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model", "fake"),
        "status": "in_progress",
        "output": [],
    }
    yield "response.created", {"type": "response.created", "response": base}
    yield "response.in_progress", {"type": "response.in_progress", "response": base}
    for i, item in enumerate(output):
        if item["type"] == "message":
            added = dict(item, status="in_progress", content=[])
            yield (
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": i, "item": added},
            )
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield (
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    **where,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                },
            )
            text = item["content"][0]["text"]
            yield "response.output_text.delta", {"type": "response.output_text.delta", **where, "delta": text}
            yield "response.output_text.done", {"type": "response.output_text.done", **where, "text": text}
            yield (
                "response.content_part.done",
                {"type": "response.content_part.done", **where, "part": item["content"][0]},
            )
        else:
            added = dict(item, arguments="", status="in_progress")
            yield (
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": i, "item": added},
            )
            yield (
                "response.function_call_arguments.delta",
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": i,
                    "delta": item["arguments"],
                },
            )
            yield (
                "response.function_call_arguments.done",
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "arguments": item["arguments"],
                },
            )
        yield (
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": i, "item": item},
        )
    tokens = max(1, len(json.dumps(body)) // 4)
    done = dict(
        base,
        status="completed",
        output=output,
        usage={
            "input_tokens": tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens + 5,
        },
    )
    yield "response.completed", {"type": "response.completed", "response": done}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet; everything goes to requests.jsonl
        pass

    def _record(self, body: Any, raw: bytes) -> None:
        headers = {
            k: ("<masked>" if k.lower() in ("authorization", "x-api-key") else v)
            for k, v in self.headers.items()
        }
        STATE.log(
            "requests.jsonl",
            {
                "t": round(time.time() - STATE.started, 3),
                "method": self.command,
                "path": self.path,
                "headers": headers,
                "body": body if body is not None else raw.decode("utf-8", "replace")[:2000],
            },
        )

    def _json(self, code: int, obj: Json) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._record(None, b"")
        path = urlsplit(self.path).path
        if path.endswith("/models"):
            model = {"id": "gpt-fake", "object": "model", "created": 0, "owned_by": "fake"}
            self._json(200, {"object": "list", "data": [model], "models": []})
        else:
            self._json(404, {"error": {"message": "fake: no " + path, "type": "not_found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        encoding = self.headers.get("content-encoding", "")
        if encoding:  # Codex compresses only for OpenAI's own endpoints: say so loudly
            self._record(None, raw)
            self._json(
                415, {"error": {"message": "fake: no content-encoding " + encoding, "type": "invalid"}}
            )
            return
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self._record(body, raw)
        path = urlsplit(self.path).path
        if not path.endswith("/responses") or not isinstance(body, dict):
            self._json(404, {"error": {"message": "fake: no " + path, "type": "not_found"}})
            return
        output, n = build_output(body)
        now = time.time()
        if n is not None:
            if not STATE.first_saved:
                STATE.first_saved = True
                with open(os.path.join(STATE.out, "first_request.json"), "w", encoding="utf-8") as f:
                    json.dump(body, f, indent=1, ensure_ascii=False)
            prev = n - 1
            STATE.log(
                "turns.jsonl",
                {
                    "t": round(now - STATE.started, 3),
                    "step": n,
                    "answers_step": prev if prev >= 0 else None,
                    "seconds_since_tool_use_sent": (
                        round(now - STATE.sent_at[prev], 3) if prev in STATE.sent_at else None
                    ),
                    "tail_items": tail_after_call(items_of(body)),
                    "answer": output,
                },
            )
        if body.get("stream", True):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for event, data in sse(output, body):
                chunk = ("event: %s\ndata: %s\n\n" % (event, json.dumps(data))).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        else:
            self._json(200, {"id": "resp_x", "object": "response", "status": "completed", "output": output})
        if n is not None:
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
    print("fake Responses API on http://127.0.0.1:%d" % port, file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
