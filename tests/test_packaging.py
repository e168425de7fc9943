"""What users install is what we test: the sdist and wheel that `pip install` / `uvx`
get are built, checked as PyPI would (`twine check`), and the wheel is installed into
a clean venv whose console script then runs real code in a real container through the
SDK's client (scripts/demo.py, run by that venv's Python). The wheel carries both
modules: the bridge copies the kernel's source file into the sandbox at launch, so a
wheel without it would fail on the first call. server.json (the MCP Registry entry)
names the same version and only settings that exist."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_env

REPO = Path(__file__).resolve().parent.parent
ONE_RUNTIME = True  # what is tested is the package; the engines are tested everywhere else


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built from the checkout as the release workflow does."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(  # uv's build is python -m build's in half the time (its build envs are cached)
        [sys.executable, "-m", "uv", "build", "--sdist", "--wheel", "--out-dir", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


def the_wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("mcp_server_code_execution_mode-*.whl")
    return wheel


def test_wheel_ships_bridge_kernel_and_console_script(dist: Path) -> None:
    with zipfile.ZipFile(the_wheel(dist)) as archive:
        names = archive.namelist()
        entry_points = next(name for name in names if name.endswith("entry_points.txt"))
        scripts = archive.read(entry_points).decode()
        kernel = archive.read("mcp_sandbox_kernel.py")
    assert "mcp_server_code_execution_mode.py" in names
    assert kernel == (REPO / "mcp_sandbox_kernel.py").read_bytes()
    assert "mcp-server-code-execution-mode = mcp_server_code_execution_mode:main" in scripts


def test_distributions_pass_twine_check(dist: Path) -> None:
    files = sorted(str(path) for path in dist.iterdir() if path.name != ".gitignore")  # uv writes one
    assert len(files) == 2, files  # one sdist, one wheel
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_installed_wheel_runs_code_through_a_real_client(dist: Path, engine: Engine, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(the_wheel(dist))],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    home = tmp_path / "home"
    home.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    env = bridge_env(engine, state, HOME=str(home))
    env.pop("PYTHONPATH", None)
    # Run from tmp_path, not the checkout, so the venv can only import what the wheel installed.
    demo = subprocess.run(
        [str(venv / "bin" / "python"), str(REPO / "scripts" / "demo.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "42" in demo.stdout and "6.28" in demo.stdout, demo.stdout  # state kept between calls
    assert "NameError" in demo.stdout  # the reset really started afresh
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import mcp_server_code_execution_mode as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert str(venv) in shown.stdout, shown.stdout


def test_server_json_matches_the_package() -> None:
    entry = json.loads((REPO / "server.json").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (package,) = entry["packages"]
    assert entry["version"] == package["version"] == project["version"] == bridge.__version__
    assert package["identifier"] == project["name"]
    assert package["registryType"] == "pypi" and package["transport"] == {"type": "stdio"}
    assert len(entry["description"]) <= 100  # the registry's limit
    known = {option.env for option in bridge.OPTIONS}
    assert {variable["name"] for variable in package["environmentVariables"]} <= known
    # The release workflow writes the repository's owner into the name and README's marker.
    assert entry["name"] == "io.github.OWNER/mcp-server-code-execution-mode"
    assert "mcp-name: io.github.OWNER/mcp-server-code-execution-mode" in (REPO / "README.md").read_text()
    workflow = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert "io.github.OWNER/" in workflow and "github.repository_owner" in workflow
