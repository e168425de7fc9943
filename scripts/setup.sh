#!/usr/bin/env bash
# Idempotent set-up for contributors and CI on Debian/Ubuntu: installs what is missing
# (Podman with runc, Docker, debootstrap, Node for the npm MCP servers), starts dockerd,
# builds the local sandbox images once (the plain one and, with build-image, a "batteries"
# one), and creates .venv with the project installed.
# Safe to run again: every step first checks whether its work is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${MCP_BRIDGE_IMAGE:-localhost/mcp-sandbox-python:bookworm}"
# The oldest Python the kernel supports (3.9, Debian bullseye), for the first runtime only.
OLDEST_IMAGE="${MCP_TEST_OLDEST_IMAGE:-localhost/mcp-sandbox-python:bullseye}"
ROOTFS_CACHE_DIR="${MCP_SANDBOX_ROOTFS_CACHE:-/var/cache/mcp-sandbox}"
RUNTIMES="${MCP_TEST_RUNTIMES:-podman,docker}"
log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# --- packages --------------------------------------------------------------
need=()
command -v podman >/dev/null || need+=(podman uidmap)
command -v runc >/dev/null || need+=(runc)
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v npx >/dev/null || need+=(nodejs npm)
command -v runsc >/dev/null || need+=(runsc)  # gVisor, for the MCP_BRIDGE_OCI_RUNTIME=runsc tests
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# --- docker engine -----------------------------------------------------------
# gVisor must be registered with dockerd (daemon.json) before dockerd starts; a dockerd
# already running without it is restarted.
if [[ "$RUNTIMES" == *docker* ]] && command -v runsc >/dev/null; then
  if ! grep -qs '"runsc"' /etc/docker/daemon.json; then
    log "registering runsc (gVisor) in /etc/docker/daemon.json"
    as_root mkdir -p /etc/docker
    as_root python3 - "$(command -v runsc)" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
config = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
config.setdefault("runtimes", {})["runsc"] = {"path": sys.argv[1], "runtimeArgs": ["--network=none"]}
json.dump(config, open(path, "w"), indent=2)
PY
    if docker info >/dev/null 2>&1; then
      log "restarting dockerd so it knows runsc"
      as_root pkill -x dockerd || true
      for _ in $(seq 60); do pgrep -x dockerd >/dev/null || break; sleep 1; done
    fi
  fi
fi
# dockerd also listens on a loopback TCP port: the remote-engine tests reach it through
# DOCKER_HOST=tcp://127.0.0.1:PORT as a bridge on another machine would (loopback only,
# so nothing off this machine can reach it). A dockerd running without it is restarted.
DOCKER_TCP="tcp://127.0.0.1:${MCP_TEST_DOCKER_TCP_PORT:-23750}"
if [[ "$RUNTIMES" == *docker* ]] && docker info >/dev/null 2>&1 \
    && ! docker -H "$DOCKER_TCP" info >/dev/null 2>&1; then
  log "restarting dockerd so it also listens on $DOCKER_TCP"
  as_root pkill -x dockerd || true
  for _ in $(seq 60); do pgrep -x dockerd >/dev/null || break; sleep 1; done
fi
if [[ "$RUNTIMES" == *docker* ]] && ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  as_root sh -c "setsid nohup dockerd -H unix:///var/run/docker.sock -H $DOCKER_TCP >/tmp/dockerd.log 2>&1 </dev/null &"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { log "dockerd did not start; see /tmp/dockerd.log"; exit 1; }
fi

# --- python environment and real MCP servers (in the background) -----------------
# Independent of the images, so they install while the rootfs is debootstrapped.
prepare_tools() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    python3 -m venv .venv
  fi
  if ! .venv/bin/python -c 'import mcp_server_code_execution_mode' >/dev/null 2>&1 \
     || [ pyproject.toml -nt .venv/.installed ] || [ uv.lock -nt .venv/.installed ]; then
    # The dependencies at the versions uv.lock pins (`uv lock` after editing pyproject.toml),
    # the project editable; --inexact keeps the venv's own pip. uv itself is locked too.
    log "installing the project and its locked dependencies (uv.lock) into .venv"
    uv_version=$(sed -n '/^name = "uv"$/{n;s/^version = "\(.*\)"$/\1/p;}' uv.lock)
    [ -x .venv/bin/uv ] || .venv/bin/pip install -q "uv==$uv_version"
    UV_PROJECT_ENVIRONMENT=.venv .venv/bin/uv sync --frozen --inexact --extra dev --quiet
    touch .venv/.installed
  fi
  # --- real third-party MCP servers for the proxy tests ---------------------------
  # ... and the official TypeScript client (the inspector's CLI mode) for client-side tests,
  # and a self-hosted OpenID provider (oidc-provider) for the HTTP bridge's OAuth tests.
  NPM_SERVERS=(@modelcontextprotocol/server-everything @modelcontextprotocol/server-filesystem
               @modelcontextprotocol/server-memory @modelcontextprotocol/inspector oidc-provider@9.13.3)
  if [ ! -x .cache/mcp-servers/node_modules/.bin/mcp-server-everything ] \
     || [ ! -x .cache/mcp-servers/node_modules/.bin/mcp-server-filesystem ] \
     || [ ! -x .cache/mcp-servers/node_modules/.bin/mcp-server-memory ] \
     || [ ! -x .cache/mcp-servers/node_modules/.bin/mcp-inspector ] \
     || ! grep -qs '"version": "9.13.3"' .cache/mcp-servers/node_modules/oidc-provider/package.json; then
    log "installing ${NPM_SERVERS[*]} into .cache/mcp-servers"
    mkdir -p .cache/mcp-servers
    npm install --prefix .cache/mcp-servers --no-audit --no-fund --silent "${NPM_SERVERS[@]}" >/dev/null
  fi
  # --- real MCP clients at pinned versions, for tests/test_real_clients.py ---------------
  # (the test reads the versions from here). Claude Code's postinstall copies the platform's
  # native binary over bin/claude.exe; where install scripts do not run, copy it here.
  NPM_CLIENTS=(@anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0)
  clients_pinned=1
  for spec in "${NPM_CLIENTS[@]}"; do  # the version each package.json says, against the pin
    grep -qs "\"version\": \"${spec##*@}\"" ".cache/clients/node_modules/${spec%@*}/package.json" || clients_pinned=0
  done
  if [ "$clients_pinned" = 0 ] || [ ! -x .cache/clients/node_modules/.bin/claude ] \
     || [ ! -x .cache/clients/node_modules/.bin/codex ]; then
    log "installing ${NPM_CLIENTS[*]} into .cache/clients"
    mkdir -p .cache/clients
    npm install --prefix .cache/clients --no-audit --no-fund --silent "${NPM_CLIENTS[@]}" >/dev/null
    claude_exe=.cache/clients/node_modules/@anthropic-ai/claude-code/bin/claude.exe
    for native in .cache/clients/node_modules/@anthropic-ai/claude-code-linux-*/claude; do
      if [ -f "$native" ] && ! "$claude_exe" --version >/dev/null 2>&1; then
        cp -f "$native" "$claude_exe" && chmod +x "$claude_exe"
      fi
    done
  fi
}
prepare_tools &
tools_pid=$!

# --- sandbox image -----------------------------------------------------------
# No registry on the dev/CI machines: debootstrap a minimal Debian with python3
# once, cache the tarball, and import it into each runtime that lacks the image.
build_rootfs() {  # $1 = Debian suite; prints the cached tarball's path
  local cache="$ROOTFS_CACHE_DIR/rootfs-$1.tar" mirror dir
  if [ ! -s "$cache" ]; then
    mirror=$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)
    [ -n "$mirror" ] || mirror=$(grep -hoE '^deb +\S+' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -n1 || true)
    [ -n "$mirror" ] || { log "cannot find an apt mirror in /etc/apt"; exit 1; }
    dir=$(mktemp -d)
    log "debootstrapping a python3 rootfs ($1) from the machine's own mirror (about a minute)"
    as_root debootstrap --variant=minbase --include=python3 "$1" "$dir" "$mirror" >"/tmp/debootstrap-$1.log" 2>&1 \
      || { log "debootstrap failed; see /tmp/debootstrap-$1.log"; exit 1; }
    as_root mkdir -p "$ROOTFS_CACHE_DIR"
    as_root tar -C "$dir" -cf "$cache.tmp" . && as_root mv "$cache.tmp" "$cache"
    as_root rm -rf "$dir"
  fi
  printf '%s\n' "$cache"
}
ensure_image() {  # $1 = podman|docker, $2 = image, $3 = Debian suite to build it from
  "$1" image inspect "$2" >/dev/null 2>&1 && return 0
  # A registry image (machines with a registry, e.g. GitHub Actions) is pulled; a
  # localhost/ name is built here from Debian packages.
  if [[ "$2" != localhost/* ]]; then "$1" pull -q "$2" >/dev/null && return 0; fi
  local tarball
  tarball=$(build_rootfs "$3")
  log "importing $2 into $1"
  "$1" import "$tarball" "$2" >/dev/null
}
IFS=, read -ra wanted <<<"$RUNTIMES"
# Both root filesystems are debootstrapped at once (network- and disk-bound) when needed.
suite_pids=()
[[ "$IMAGE" == localhost/* ]] && { build_rootfs bookworm >/dev/null & suite_pids+=($!); }
[[ "$OLDEST_IMAGE" == localhost/* ]] && { build_rootfs bullseye >/dev/null & suite_pids+=($!); }
for pid in "${suite_pids[@]}"; do wait "$pid"; done
for rt in "${wanted[@]}"; do ensure_image "$rt" "$IMAGE" bookworm; done
ensure_image "${wanted[0]}" "$OLDEST_IMAGE" bullseye

# --- podman OCI runtime --------------------------------------------------------
# crun refuses cgroups in hybrid mode on some hosts; runc works there. Only touch
# the host's containers.conf when a trivial container really fails.
if [[ "$RUNTIMES" == *podman* ]]; then
  probe=(podman run --rm --ulimit nofile=1024:1024 --ulimit nproc=512:512 "$IMAGE" true)
  if ! "${probe[@]}" >/dev/null 2>&1; then
    log "podman's default OCI runtime fails here; configuring runc in /etc/containers/containers.conf"
    as_root mkdir -p /etc/containers
    printf '[engine]\nruntime = "runc"\n' | as_root tee -a /etc/containers/containers.conf >/dev/null
    "${probe[@]}" >/dev/null || { log "podman still cannot start a container"; exit 1; }
  fi
fi

wait "$tools_pid" || { log "setting up .venv or the npm MCP servers failed (output above)"; exit 1; }

# --- the "batteries" image (numpy, pandas, matplotlib), built by the product itself ------
# tests/test_build_image.py uses it; only the first runtime needs it.
BATTERIES_IMAGE="${MCP_TEST_BATTERIES_IMAGE:-localhost/mcp-sandbox-python:batteries}"
if ! "${wanted[0]}" image inspect "$BATTERIES_IMAGE" >/dev/null 2>&1; then
  log "building $BATTERIES_IMAGE with build-image (a few minutes)"
  .venv/bin/mcp-server-code-execution-mode build-image --runtime "${wanted[0]}" --tag "$BATTERIES_IMAGE" \
    >/tmp/build-image.log 2>&1 || { log "build-image failed; see /tmp/build-image.log"; exit 1; }
fi
log "ready: image $IMAGE on ${RUNTIMES}"
