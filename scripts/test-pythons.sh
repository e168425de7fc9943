#!/usr/bin/env bash
# The container-free tests (pytest -m "not container") on each CPython from 3.11 to 3.14
# that this machine has, each in its own venv under .cache/pythons/ installed from uv.lock.
# A version with no interpreter here is reported and skipped (uv cannot download one
# where only PyPI is reachable). Arguments go to pytest. Exit status: 1 if any run failed.
# PYTHONS="3.12 3.13" picks versions; MCP_TEST_WORKERS=N as in scripts/test.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/uv ] || { echo "no .venv/bin/uv: run scripts/setup.sh first" >&2; exit 1; }

find_python() {  # an interpreter of version $1 that starts, on PATH or in pyenv's versions
  local candidate
  for candidate in "$(command -v "python$1")" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
       && "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$1'.split('.'))))" \
          >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

failed=() missing=() passed=()
for version in ${PYTHONS:-3.11 3.12 3.13 3.14}; do
  if ! python=$(find_python "$version"); then
    echo "== python $version: no interpreter on this machine, skipped"
    missing+=("$version")
    continue
  fi
  venv=.cache/pythons/$version
  echo "== python $version: $python"
  if ! UV_PROJECT_ENVIRONMENT=$venv .venv/bin/uv sync --frozen --extra dev --quiet --python "$python"; then
    failed+=("$version (install)")
    continue
  fi
  if "$venv/bin/pytest" -q -n "${MCP_TEST_WORKERS:-2}" -m "not container" -p no:cacheprovider "$@"; then
    passed+=("$version")
  else
    failed+=("$version")
  fi
done
echo "== passed: ${passed[*]:-none}; failed: ${failed[*]:-none}; not on this machine: ${missing[*]:-none}"
[ ${#failed[@]} -eq 0 ]
