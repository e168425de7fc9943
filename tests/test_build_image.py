"""`mcp-server-code-execution-mode build-image`: the recipe for each method, its refusals,
and (in test_batteries_image_*) a real build's image used by a real bridge."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import mcp_server_code_execution_mode as bridge
from tests.conftest import Engine, bridge_client, bridge_env, console_script, run_cell

pytestmark = pytest.mark.anyio

# GUIDE.md's batteries example, verbatim (test_guide_shows_this_example keeps them equal).
BATTERIES_EXAMPLE = """\
import os, numpy as np, pandas as pd
import matplotlib.pyplot as plt
frame = pd.DataFrame({"x": np.arange(5), "y": np.arange(5) ** 2})
figure, axes = plt.subplots()
axes.plot(frame.x, frame.y)
figure.savefig("/tmp/squares.png")
plt.close(figure)  # saved to a file, not shown
(int(frame.y.sum()), os.path.getsize("/tmp/squares.png") > 1000)
"""


def build_image(*args: str, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), "build-image", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **environ},
    )


def test_the_pip_recipe_is_the_base_image_plus_the_packages() -> None:
    assert bridge.containerfile("python:3.14-slim", ["numpy", "pandas==2.2.3"]) == (
        "FROM python:3.14-slim\n"
        "RUN python3 -m pip install --no-cache-dir numpy pandas==2.2.3\n"
        "ENV MPLCONFIGDIR=/tmp/matplotlib\n"
        'LABEL io.github.mcp-server-code-execution-mode.build-image="pip:numpy,pandas==2.2.3"\n'
    )


@pytest.mark.parametrize(
    ("package", "debian", "module"),
    [
        ("numpy", "python3-numpy", "numpy"),
        ("Pillow", "python3-pil", "PIL"),
        ("scikit-learn", "python3-sklearn", "sklearn"),
        ("python_dateutil", "python3-python-dateutil", "dateutil"),
        ("pandas==2.2.3", "python3-pandas", "pandas"),
    ],
)
def test_package_names_map_to_debian_packages_and_modules(package: str, debian: str, module: str) -> None:
    assert (bridge.debian_package(package), bridge.import_name(package)) == (debian, module)


def test_the_mirror_comes_from_the_machines_own_apt_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://security.example/debian-security\n\nTypes: deb\nURIs: http://mirror.example/debian\n"
    )
    assert bridge.apt_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://old.example/debian bookworm main\n"
    )
    assert bridge.apt_mirror(tmp_path) == "http://old.example/debian"
    (tmp_path / "sources.list").unlink()
    assert bridge.apt_mirror(tmp_path) is None


@pytest.mark.container  # a dry run asks the engine for its facts
def test_dry_runs_print_each_methods_commands_and_build_nothing() -> None:
    pip = build_image("--dry-run", "--method", "pip", "--from", "python:3.14-slim", "--tag", "localhost/x:1")
    assert pip.returncode == 0, pip.stderr
    assert (
        "FROM python:3.14-slim\nRUN python3 -m pip install --no-cache-dir numpy pandas matplotlib"
        in pip.stderr
    )
    assert " build --tag localhost/x:1 --file " in pip.stdout
    debian = build_image(
        "--dry-run", "--method", "debian", "--packages", "numpy,Pillow", "--tag", "localhost/x:1"
    )
    assert debian.returncode == 0, debian.stderr
    assert (
        "debootstrap --variant=minbase --include=python3,python3-numpy,python3-pil bookworm " in debian.stdout
    )
    assert " import --change ENV MPLCONFIGDIR=/tmp/matplotlib --change LABEL " in debian.stdout
    assert debian.stdout.rstrip().endswith(" - localhost/x:1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--packages", "numpy;rm -rf /"], "not a package name: numpy;rm -rf /"),
        (["--packages", "numpy,--index-url=http://evil"], "not a package name: --index-url=http://evil"),
        pytest.param(
            ["--method", "debian", "--packages", "numpy==1.0"],
            "versions cannot be pinned",
            marks=pytest.mark.container,  # refused after the engine is asked for its facts
        ),
    ],
)
def test_bad_requests_are_refused_with_a_clear_message(args: list[str], message: str) -> None:
    refused = build_image("--dry-run", *args)
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_without_an_engine_the_terminal_is_told_what_to_run(tmp_path: Path) -> None:
    # Before, build-image printed the model's words ("... then call run_python again").
    refused = build_image("--dry-run", "--runtime", "docker", PATH=str(tmp_path))
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.strip() == (
        "mcp-server-code-execution-mode build-image: No container engine is available: docker is not "
        "installed (not on PATH). Install Podman (https://podman.io/docs/installation; on Debian/Ubuntu: "
        "`sudo apt-get install podman`) or Docker (https://docs.docker.com/get-docker/), make sure "
        "`podman info` or `docker info` works for you, then run this command again; --runtime "
        "podman|docker chooses one (MCP_BRIDGE_RUNTIME in the MCP server's environment)."
    )


@pytest.mark.container  # the engine is asked for the base image
def test_an_explicit_base_that_cannot_be_used_fails_instead_of_switching_method() -> None:
    # A pinned package: were auto to fall back to debian anyway, that would refuse it
    # (status 2) rather than run debootstrap here.
    base = "localhost/mcp-test-no-such-base-%d:1" % time.monotonic_ns()
    result = build_image("--from", base, "--tag", "localhost/x:1", "--packages", "numpy==1.0")
    assert result.returncode == 1, result.stderr
    assert "--from %s: " % base in result.stderr and "neither has that image nor can pull it" in result.stderr
    assert "Method:" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_dry_run_chooses_the_method_the_real_run_would_on_this_machine(engine: Engine) -> None:
    # No registry here: a base image that is not on this machine cannot be pulled, so
    # the real run builds from Debian packages, and the dry run must say so too.
    missing = "localhost/mcp-test-no-such-base-%d:1" % time.monotonic_ns()
    auto = build_image("--dry-run", "--runtime", engine.name, MCP_BRIDGE_IMAGE=missing)
    assert auto.returncode == 0, auto.stderr
    assert "Method: debian." in auto.stderr and "a real run would pull it" in auto.stderr, auto.stderr
    assert auto.stdout.startswith("debootstrap --variant=minbase "), auto.stdout
    # An explicit base it cannot use: the same refusal as the real run's, nothing pulled.
    refused = build_image("--dry-run", "--runtime", engine.name, "--from", missing)
    assert refused.returncode == 1, refused.stderr
    assert "--from %s: %s neither has that image nor can pull it" % (missing, engine.name) in refused.stderr
    assert "Method:" not in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    # A base image that is here: pip, as the real run would.
    here = build_image("--dry-run", "--runtime", engine.name, "--from", engine.image)
    assert here.returncode == 0 and "Method: pip." in here.stderr, here.stderr
    assert "FROM %s\n" % engine.image in here.stderr and " build --tag " in here.stdout, here.stdout


def test_the_mount_table_is_read_for_mounts_at_or_under_a_path(tmp_path: Path) -> None:
    root = tmp_path / "deboot strap"
    escaped = str(root).replace(" ", "\\040")
    table = tmp_path / "mounts"
    table.write_text(
        "/dev/sda1 / ext4 rw,relatime 0 0\n"
        "proc %s/proc proc rw,nosuid 0 0\n"
        "devpts %s/dev/pts devpts rw 0 0\n"
        "tmpfs %s-other tmpfs rw 0 0\n"  # a sibling that shares the prefix: not inside
        "tmpfs %s tmpfs rw 0 0\n" % (escaped, escaped, escaped, escaped)
    )
    assert bridge.mounts_under(root, table) == ["%s/proc" % root, "%s/dev/pts" % root, str(root)]
    assert bridge.mounts_under(tmp_path / "elsewhere", table) == []


def test_the_build_root_is_not_removed_while_something_is_mounted_in_it(tmp_path: Path) -> None:
    root = tmp_path / "target"
    (root / "proc" / "1").mkdir(parents=True)
    (root / "proc" / "1" / "status").write_text("the host's, through a mount")
    table = tmp_path / "mounts"
    table.write_text("/dev/sda1 / ext4 rw 0 0\nproc %s/proc proc rw 0 0\n" % root.resolve())
    left = bridge.remove_build_root(root, table)
    assert (root / "proc" / "1" / "status").exists()
    assert left is not None and left.startswith("left %s in place" % root), left
    assert "%s/proc" % root.resolve() in left and "`umount '%s/proc'`" % root.resolve() in left, left
    # Nor when the mount table cannot be read.
    assert "cannot be read" in str(bridge.remove_build_root(root, tmp_path / "no-such-table"))
    assert root.exists()
    # Nothing mounted: removed.
    table.write_text("/dev/sda1 / ext4 rw 0 0\n")
    assert bridge.remove_build_root(root, table) is None
    assert not root.exists()


async def test_the_batteries_image_from_build_image_runs_data_code_in_the_bridge(
    proxy_engine: Engine, state_dir: Path
) -> None:
    # scripts/setup.sh made this image with `build-image` (debian method: no registry here),
    # for the first runtime only.
    engine = proxy_engine
    image = os.environ.get("MCP_TEST_BATTERIES_IMAGE", "localhost/mcp-sandbox-python:batteries")
    label = "{{index .Labels %s}}" % json.dumps(bridge.BUILD_IMAGE_LABEL)
    made = subprocess.run(
        [engine.name, "image", "inspect", "--format", label, image],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.fail("%s has no image %s; run scripts/setup.sh" % (engine.name, image))
    assert made.stdout.strip() in ("debian:numpy,pandas,matplotlib", "pip:numpy,pandas,matplotlib")
    async with bridge_client(bridge_env(Engine(engine.name, image), state_dir)) as client:
        answer = await run_cell(client, BATTERIES_EXAMPLE, timeout=120)
    assert not answer["is_error"], answer["text"]
    assert answer["value"] == "(30, True)" and answer["stderr"] == "", answer


async def test_importing_a_data_package_the_image_lacks_names_build_image(
    engine: Engine, state_dir: Path
) -> None:
    probe = subprocess.run(
        [engine.name, "run", "--rm", "--network", "none", engine.image, "python3", "-c", "import matplotlib"],
        capture_output=True,
        check=False,
    )
    if probe.returncode == 0:
        pytest.fail("%s has matplotlib: this test needs an image without it" % engine.image)
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        missing = await run_cell(client, "import os\nimport matplotlib.pyplot as plt")
        other = await run_cell(client, "import no_such_module_of_ours")
    assert missing["is_error"] and missing["error"]["type"] == "ModuleNotFoundError", missing
    hint = (
        "matplotlib is not installed in the sandbox image %s, and the sandbox has no network to pip "
        "install it. Tell the user: `mcp-server-code-execution-mode build-image --packages "
        "numpy,pandas,matplotlib` builds an image with it; then set "
        "MCP_BRIDGE_IMAGE=localhost/mcp-sandbox-python:batteries in this MCP server's environment"
        % engine.image
    )
    assert missing["detail"].startswith(hint), missing["detail"]
    assert "[error] " + hint in missing["text"], missing["text"]  # what Claude Code shows the model
    assert other["is_error"] and other["detail"] is None, other  # not a package build-image knows


def test_guide_shows_this_example() -> None:
    guide = (Path(__file__).resolve().parent.parent / "GUIDE.md").read_text()
    assert "```python\n%s```" % BATTERIES_EXAMPLE in guide
