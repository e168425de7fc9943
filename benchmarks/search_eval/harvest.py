"""Spawn a stdio MCP server, run initialize + tools/list (paged), print JSON."""

import argparse
import json
import os
import select
import subprocess
import sys
import time
from typing import Any


def run(
    cmd: list[str], env_extra: dict[str, str], timeout: int = 60, cwd: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    env = dict(os.environ)
    env.update(env_extra)
    p = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd
    )
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    stdin, stdout, stderr = p.stdin, p.stdout, p.stderr
    buf = b""

    def send(o: dict[str, Any]) -> None:
        stdin.write((json.dumps(o) + "\n").encode())
        stdin.flush()

    def recv(want_id: int) -> Any:
        nonlocal buf
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line:
                    continue
                try:
                    m = json.loads(line)
                except Exception:
                    sys.stderr.write("nonjson: %r\n" % line[:200])
                    continue
                if m.get("id") == want_id and ("result" in m or "error" in m):
                    return m
                if "method" in m and "id" in m:  # server request (e.g. roots/list)
                    if m["method"] == "roots/list":
                        send({"jsonrpc": "2.0", "id": m["id"], "result": {"roots": []}})
                    else:
                        send({"jsonrpc": "2.0", "id": m["id"], "result": {}})
            r, _, _ = select.select([stdout], [], [], 0.5)
            if r:
                chunk = os.read(stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError("server exited: " + stderr.read().decode(errors="replace")[-3000:])
                buf += chunk
        raise TimeoutError("timeout")

    try:
        send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "harvest", "version": "0"},
                },
            }
        )
        init = recv(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        tools: list[dict[str, Any]] = []
        cursor = None
        i = 2
        while True:
            params: dict[str, Any] = {"cursor": cursor} if cursor else {}
            send({"jsonrpc": "2.0", "id": i, "method": "tools/list", "params": params})
            r = recv(i)
            i += 1
            if "error" in r:
                raise RuntimeError(str(r["error"]))
            tools += r["result"].get("tools", [])
            cursor = r["result"].get("nextCursor")
            if not cursor:
                break
        return init.get("result", {}), tools
    finally:
        try:
            p.kill()
        except Exception:
            pass


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    env = dict(e.split("=", 1) for e in a.env)
    init, tools = run(a.cmd, env, a.timeout)
    with open(a.out, "w") as f:
        json.dump({"cmd": a.cmd, "serverInfo": init.get("serverInfo"), "tools": tools}, f, indent=1)
    print(a.out, init.get("serverInfo"), len(tools), [t["name"] for t in tools])
