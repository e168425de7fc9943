#!/usr/bin/env bash
# Set up whatever is missing (runtime, sandbox image, venv), then show the main job:
# a real MCP client calls run_python twice on the installed server, state kept between.
set -euo pipefail
cd "$(dirname "$0")/.."
MCP_TEST_RUNTIMES="${MCP_BRIDGE_RUNTIME:-podman}" bash scripts/setup.sh
export MCP_BRIDGE_IMAGE="${MCP_BRIDGE_IMAGE:-localhost/mcp-sandbox-python:bookworm}"
exec .venv/bin/python scripts/demo.py
