#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it: set up whatever is missing (runtimes,
# sandbox image, venv), then lint, type-check, and run every test on real containers.
# MCP_TEST_RUNTIMES=podman (or docker) limits the integration tests to one runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MCP_BRIDGE_IMAGE="${MCP_BRIDGE_IMAGE:-localhost/mcp-sandbox-python:bookworm}"
export MCP_TEST_RUNTIMES="${MCP_TEST_RUNTIMES:-podman,docker}"
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/pytest "$@"
