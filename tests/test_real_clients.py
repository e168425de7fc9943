"""Real clients (issue 20, item 6): the Claude Code and Codex CLIs, at the versions
scripts/setup.sh pins into .cache/clients, drive the bridge's console script while their
model is a fake, scripted API on loopback (tests/clients); what the client handed back to
that model (its turns.jsonl) is what a real model would have read, and is asserted here.

One script per client: plain text, plain lines, a failure with a plot, a long output cut,
a reset, an attached PNG, and (Claude Code only) a 50 s job that must reach the model whole
in one result. Codex would get "still running" only after 240 s: not tested.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Engine, console_script
from tests.harness import isolated_env  # bridge_env with a HOME of its own

REPO = Path(__file__).resolve().parent.parent
CLIENTS_BIN = REPO / ".cache" / "clients" / "node_modules" / ".bin"
FAKES = Path(__file__).resolve().parent / "clients"
SETUP = REPO / "scripts" / "setup.sh"
BATTERIES_IMAGE = os.environ.get("MCP_TEST_BATTERIES_IMAGE", "localhost/mcp-sandbox-python:batteries")
SERVER = "code-execution"  # the name the clients know the bridge by
PNG = b"\x89PNG\r\n\x1a\n"
BASE64_RUN = re.compile(r"[A-Za-z0-9+/=]{1001,}")

Json = dict[str, Any]

# --- the script ------------------------------------------------------------------------

ATTACH_PNG = (
    "from mcp import runtime\n"
    "import matplotlib\n"
    'matplotlib.use("Agg")\n'
    "import matplotlib.pyplot as plt\n"
    "fig = plt.figure(figsize=(2, 2)); plt.plot([3, 1, 2]); fig.savefig('/workspace/p.png'); plt.close(fig)\n"
    "runtime.attach('/workspace/p.png')"
)
STEPS: list[tuple[str, Json]] = [
    ("print", {"code": 'x = 41; print("hi")'}),
    ("lines", {"code": "for i in range(3):\n    print('line', i)\n'done'"}),
    (
        "plot_then_fail",
        {
            "code": "import matplotlib.pyplot as plt; plt.plot([1,2,3]); plt.show(); "
            "print('about to fail'); 1/0"
        },
    ),
    ("long_output", {"code": 'print("y" * 100000)'}),
    ("reset", {"code": "x", "reset": True}),
    ("attach_png", {"code": ATTACH_PNG}),
]
LONG_JOB: tuple[str, Json] = (
    "long_job",
    {"code": "import time\nfor i in range(10):\n    print(i, flush=True); time.sleep(5)", "timeout": 120},
)
LINES = "line 0\nline 1\nline 2\n'done'"
TRACEBACK_END = "ZeroDivisionError: division by zero"
CUT = "characters of stdout cut"
RESET = "[session] Reset: started a fresh session"
NAME_ERROR = "NameError: name 'x' is not defined"


def script(steps: list[tuple[str, Json]]) -> Json:
    return {
        "tool": "mcp__%s__run_python" % SERVER,
        "steps": [{"label": label, "input": arguments} for label, arguments in steps]
        + [{"label": "end", "final": "Done."}],
    }


# --- running a client against a fake model API -----------------------------------------


def pinned(package: str) -> str:
    """The version of the npm ``package`` scripts/setup.sh installs (its NPM_CLIENTS)."""
    found = re.search(r"^\s*NPM_CLIENTS=\((.*)\)$", SETUP.read_text(), re.MULTILINE)
    assert found, "scripts/setup.sh has no NPM_CLIENTS=(...) line"
    versions = {name: version for name, _, version in (spec.rpartition("@") for spec in found[1].split())}
    return versions[package]


def client_cli(name: str, package: str) -> Path:
    """The CLI scripts/setup.sh installed at its pinned version; missing or another version
    fails the test."""
    version = pinned(package)
    path = CLIENTS_BIN / name
    if not path.exists():
        pytest.fail("%s is not installed at %s; run scripts/setup.sh" % (name, path))
    shown = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if version not in shown.stdout.split():
        pytest.fail(
            "%s at %s is %r, not the pinned %s; run scripts/setup.sh"
            % (name, path, shown.stdout.strip() or shown.stderr.strip(), version)
        )
    return path


def batteries(engine: Engine) -> Engine:
    """The engine with the image that has matplotlib (scripts/setup.sh builds it)."""
    found = subprocess.run(
        [engine.name, "image", "inspect", BATTERIES_IMAGE], capture_output=True, timeout=60, check=False
    )
    if found.returncode != 0:
        pytest.fail("%s has no image %s; run scripts/setup.sh" % (engine.name, BATTERIES_IMAGE))
    return Engine(engine.name, BATTERIES_IMAGE)


def server_env(engine: Engine, state_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The bridge's environment: the batteries image, and a HOME of its own, so that it
    finds no MCP servers in this machine's client configurations."""
    return isolated_env(batteries(engine), state_dir, tmp_path / "bridge-home")


def client_env(home: Path, **settings: str) -> dict[str, str]:
    """This environment without what would steer a client elsewhere (its own keys, endpoints
    and config homes), with a private HOME and ``settings``."""
    steering = ("ANTHROPIC_", "CLAUDE", "OPENAI_", "CODEX_", "MCP_", "XDG_CONFIG_HOME")
    env = {key: value for key, value in os.environ.items() if not key.startswith(steering)}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    env.update(settings)
    return env


def run_against_fake(
    fake: str, scripted: Json, run: Path, argv: Callable[[int], list[str]], env: dict[str, str]
) -> list[Json]:
    """Starts ``fake`` (a script in tests/clients) with ``scripted`` (script()), runs the
    client ``argv(port)`` to its end and gives back the fake's turns.jsonl."""
    (run / "work").mkdir(parents=True)  # the client's folder: empty, no git repository
    (run / "script.json").write_text(json.dumps(scripted, indent=1))
    command = [sys.executable, str(FAKES / fake), "--port", "0", "--script", str(run / "script.json")]
    with (run / "fake.log").open("wb") as log:
        api = subprocess.Popen([*command, "--out", str(run)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (run / "port").exists():
            if api.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the fake model API did not start: %s" % (run / "fake.log").read_text())
            time.sleep(0.05)
        port = int((run / "port").read_text())
        with (run / "client_stdout.jsonl").open("wb") as out, (run / "client_stderr.log").open("wb") as err:
            try:
                ended = subprocess.run(
                    argv(port),
                    cwd=run / "work",
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    timeout=180,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                pytest.fail("the client did not finish within 180 s; see %s" % run)
    finally:
        api.send_signal(signal.SIGINT)
        try:
            api.wait(10)
        except subprocess.TimeoutExpired:
            api.kill()
            api.wait()
    stderr = (run / "client_stderr.log").read_text(errors="replace")
    assert ended.returncode == 0, "the client exited %d (%s):\n%s" % (ended.returncode, run, stderr[-3000:])
    turns = [json.loads(line) for line in (run / "turns.jsonl").read_text().splitlines()]
    last = len(scripted["steps"]) - 1  # the final answer's step
    assert turns and turns[-1]["step"] == last, "the script did not reach its end (%s)" % run
    return turns


def plain(texts: list[str]) -> None:
    """Neither structuredContent's JSON nor an image or file as base64 text."""
    for text in texts:
        assert not text.startswith('{"'), "JSON reached the model: %s..." % text[:200]
        assert not BASE64_RUN.search(text), "base64 text reached the model: %s..." % text[:200]


def no_sandbox_left(engine: Engine, state_dir: Path, ipc_too: bool = False) -> None:
    """The client has ended the bridge: its sandbox container is gone too (soon). The bridge
    names its IPC folder after the container; a clean exit removes both (``ipc_too``: the
    client ends the bridge by signals it can handle; one that kills it leaves the folder,
    for the next bridge's sweep)."""
    ipc = state_dir / "ipc"
    names = {entry.name.partition(".")[2] for entry in ipc.iterdir()} if ipc.is_dir() else set()
    deadline = time.monotonic() + 20
    while left := names.intersection(engine.containers(running_only=False)):
        assert time.monotonic() < deadline, "sandbox containers left behind: %s" % sorted(left)
        time.sleep(0.5)
    # Its IPC folder too: the client's SIGINT and then SIGTERM let the bridge finish removing it.
    while ipc_too and (folders := sorted(entry.name for entry in ipc.iterdir()) if ipc.is_dir() else []):
        assert time.monotonic() < deadline, "IPC folders left behind: %s" % folders
        time.sleep(0.5)


def png(data: str) -> bytes:
    decoded = base64.b64decode(data)
    assert decoded.startswith(PNG) and len(decoded) > 1000, decoded[:40]
    return decoded


# --- Claude Code -------------------------------------------------------------------------


def claude_results(turns: list[Json], steps: list[tuple[str, Json]]) -> dict[str, Json]:
    """label -> the tool_result block Claude Code sent the model for that step (exactly one)."""
    results: dict[str, Json] = {}
    for number, (label, _) in enumerate(steps):
        tool_use_id = "toolu_%02d_%s" % (number, label[:20])
        found = {
            json.dumps(block, sort_keys=True): block
            for turn in turns
            for message in turn.get("tail_messages") or []
            if isinstance(message.get("content"), list)
            for block in message["content"]
            if block.get("type") == "tool_result" and block.get("tool_use_id") == tool_use_id
        }
        assert len(found) == 1, "step %s: %d tool_results: %s" % (label, len(found), list(found))
        results[label] = next(iter(found.values()))
    return results


def claude_blocks(result: Json) -> list[Json]:
    """A tool_result's content as blocks (an is_error one carries a plain string)."""
    content = result["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def claude_texts(result: Json) -> list[str]:
    return [block["text"] for block in claude_blocks(result) if block["type"] == "text"]


def claude_images(result: Json) -> list[bytes]:
    images = [block for block in claude_blocks(result) if block["type"] == "image"]
    assert all(image["source"]["media_type"] == "image/png" for image in images), images
    return [png(image["source"]["data"]) for image in images]


def test_claude_code_shows_its_model_what_the_bridge_meant(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    claude = client_cli("claude", "@anthropic-ai/claude-code")
    steps = [*STEPS, LONG_JOB]
    run = tmp_path / "claude-code"
    config = {
        "mcpServers": {
            SERVER: {
                "type": "stdio",
                "command": console_script(),
                "args": [],
                "env": server_env(proxy_engine, state_dir, tmp_path),
            }
        }
    }
    (tmp_path / "mcp.json").write_text(json.dumps(config))
    argv = [
        str(claude),
        *("-p", "go", "--mcp-config", str(tmp_path / "mcp.json"), "--strict-mcp-config"),
        *("--allowedTools", "mcp__%s__run_python" % SERVER),
        *("--output-format", "stream-json", "--verbose", "--no-session-persistence"),
    ]
    env = client_env(
        tmp_path / "claude-home",
        ANTHROPIC_API_KEY="sk-ant-fake",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        # Wait for the bridge to connect before the first model request: by default -p mode
        # goes on with the server "pending", and on a loaded machine the model then sees no
        # run_python (seen once in CI).
        MCP_CONNECTION_NONBLOCKING="false",
    )

    def with_port(port: int) -> list[str]:
        env["ANTHROPIC_BASE_URL"] = "http://127.0.0.1:%d" % port
        return argv

    turns = run_against_fake("fake_anthropic.py", script(steps), run, with_port, env)
    got = claude_results(turns, steps)
    why = json.dumps(got, indent=1)[:6000]

    # Text, not structuredContent's JSON: Claude Code would show the model only that JSON.
    assert got["print"]["content"] == [{"type": "text", "text": "hi"}], why
    assert got["lines"]["content"] == [{"type": "text", "text": LINES}], why
    for label in ("print", "lines", "plot_then_fail", "long_output", "attach_png", "long_job"):
        assert not got[label].get("is_error"), (label, why)

    # A failure with a plot: sent without isError, which would cost the model the image.
    failed = "\n".join(claude_texts(got["plot_then_fail"]))
    assert failed.startswith("about to fail\nTraceback (most recent call last):"), why
    assert TRACEBACK_END in failed, why
    assert len(claude_images(got["plot_then_fail"])) == 1, why

    cut = "\n".join(claude_texts(got["long_output"]))
    assert CUT in cut and "/tmp/outputs/" in cut and not cut.startswith("{"), cut[:300]
    assert 19_000 < len(cut) < 22_000, len(cut)

    assert got["reset"].get("is_error") is True, why
    reset = "\n".join(claude_texts(got["reset"]))
    assert reset.startswith(RESET) and reset.rstrip().endswith(NAME_ERROR), why

    attached = got["attach_png"]
    assert len(claude_images(attached)) == 1, why
    assert claude_texts(attached) == ["'file:///workspace/p.png'"], why  # no empty resource text
    for label in got:
        if label != "long_output":  # "yyy...": base64's alphabet
            plain(claude_texts(got[label]))

    # 50 s of work: Claude Code waits (about 27.8 h over stdio), so the bridge does too.
    long_job = "\n".join(claude_texts(got["long_job"]))
    assert long_job == "\n".join(str(i) for i in range(10)), long_job
    assert "still running" not in long_job.lower()
    waited = next(turn for turn in turns if turn["step"] == len(steps))["seconds_since_tool_use_sent"]
    assert waited is not None and waited > 45, waited
    no_sandbox_left(proxy_engine, state_dir, ipc_too=True)  # Claude Code: SIGINT, then SIGTERM


# --- Codex -------------------------------------------------------------------------------


def codex_outputs(turns: list[Json], steps: list[tuple[str, Json]]) -> dict[str, list[Json]]:
    """label -> the items of the function_call_output Codex sent the model for that step,
    without its own first "Wall time: ... Output:" item."""
    results: dict[str, list[Json]] = {}
    for number, (label, _) in enumerate(steps):
        call_id = "call_%02d_%s" % (number, label[:20])
        found = {
            json.dumps(item, sort_keys=True): item
            for turn in turns
            for item in turn.get("tail_items") or []
            if isinstance(item, dict)
            and item.get("type") == "function_call_output"
            and item.get("call_id") == call_id
        }
        assert len(found) == 1, "step %s: %d outputs: %s" % (label, len(found), list(found))
        output = next(iter(found.values()))["output"]
        assert isinstance(output, list), output
        assert output[0]["type"] == "input_text", output
        assert re.fullmatch(r"Wall time: [0-9.]+ seconds\nOutput:", output[0]["text"]), output
        results[label] = output[1:]
    return results


def codex_texts(items: list[Json]) -> list[str]:
    return [item["text"] for item in items if item["type"] == "input_text"]


def codex_images(items: list[Json]) -> list[bytes]:
    prefix = "data:image/png;base64,"
    images = [item["image_url"] for item in items if item["type"] == "input_image"]
    assert all(url.startswith(prefix) for url in images), [url[:60] for url in images]
    return [png(url[len(prefix) :]) for url in images]


def toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def test_codex_shows_its_model_what_the_bridge_meant(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    codex = client_cli("codex", "@openai/codex")
    steps = STEPS
    run = tmp_path / "codex"
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    bridge = server_env(proxy_engine, state_dir, tmp_path)

    def with_port(port: int) -> list[str]:
        config = [
            'model = "gpt-5-codex"',
            'model_provider = "fake"',
            'approval_policy = "never"',
            'sandbox_mode = "read-only"',
            "check_for_update_on_startup = false",
            # Codex may send the first turn before the bridge listed its tools: wait for it.
            "mcp_optional_startup_grace_ms = 60000",
            "[analytics]",
            "enabled = false",
            "[model_providers.fake]",
            'name = "fake"',
            "base_url = %s" % toml_string("http://127.0.0.1:%d/v1" % port),
            'env_key = "FAKE_OPENAI_KEY"',
            'wire_api = "responses"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "[mcp_servers.%s]" % SERVER,
            "command = %s" % toml_string(console_script()),
            "startup_timeout_sec = 120",
            # A tool without annotations counts as destructive: approve this server's tools.
            'default_tools_approval_mode = "approve"',
            "required = true",
            "[mcp_servers.%s.env]" % SERVER,
            *("%s = %s" % (toml_string(key), toml_string(value)) for key, value in bridge.items()),
        ]
        (codex_home / "config.toml").write_text("\n".join(config) + "\n")
        return [
            str(codex),
            *("exec", "--json", "--strict-config", "--skip-git-repo-check", "--ephemeral"),
            *("-C", str(run / "work"), "go"),
        ]

    env = client_env(tmp_path / "codex-user-home", CODEX_HOME=str(codex_home), FAKE_OPENAI_KEY="sk-fake")
    turns = run_against_fake("fake_openai.py", script(steps), run, with_port, env)
    got = codex_outputs(turns, steps)
    why = json.dumps(got, indent=1)[:6000]

    # Text, not structuredContent's JSON: Codex would show the model only that JSON.
    assert got["print"] == [{"type": "input_text", "text": "hi"}], why
    assert got["lines"] == [{"type": "input_text", "text": LINES}], why

    failed = "\n".join(codex_texts(got["plot_then_fail"]))
    assert failed.startswith("about to fail\nTraceback (most recent call last):"), why
    assert TRACEBACK_END in failed, why
    assert len(codex_images(got["plot_then_fail"])) == 1, why

    # Under Codex's own cut (about 12,000 characters, in the middle), so the marker survives.
    cut = "\n".join(codex_texts(got["long_output"]))
    assert CUT in cut and "/tmp/outputs/" in cut and not cut.startswith("{"), cut[:300]
    assert "tokens truncated" not in cut and len(cut) < 12_000, len(cut)

    reset = "\n".join(codex_texts(got["reset"]))
    assert reset.startswith(RESET) and reset.rstrip().endswith(NAME_ERROR), why

    # An attached PNG is an image to Codex, not an embedded resource it would show as base64.
    attached = got["attach_png"]
    assert len(codex_images(attached)) == 1, why
    assert codex_texts(attached) == ["'file:///workspace/p.png'"], why
    for label in got:
        if label != "long_output":  # "yyy...": base64's alphabet
            plain(codex_texts(got[label]))
    no_sandbox_left(proxy_engine, state_dir)
