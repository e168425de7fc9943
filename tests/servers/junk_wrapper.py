"""Runs a command as an MCP server but writes junk lines to stdout around every line
the real server writes: a misbehaving server the bridge must survive."""

from __future__ import annotations

import subprocess
import sys
import threading


def main() -> int:
    child = subprocess.Popen(sys.argv[1:], stdin=sys.stdin, stdout=subprocess.PIPE)
    assert child.stdout is not None
    out = sys.stdout.buffer
    out.write(b"this is not JSON-RPC\n")
    out.flush()
    for line in child.stdout:
        out.write(b'{"junk": true}\n' + line + b"\x00\xff garbage\n")
        out.flush()
    threading.Event().wait(0.1)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
