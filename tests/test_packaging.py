"""The wheel users get from `pip install` / `uvx` carries both modules and the console
script: the bridge copies the kernel's source file into the sandbox at launch, so a
wheel without it would fail on the first call."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_ships_bridge_kernel_and_console_script(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("mcp_server_code_execution_mode-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(name for name in names if name.endswith("entry_points.txt"))
        scripts = archive.read(entry_points).decode()
        kernel = archive.read("mcp_sandbox_kernel.py")
    assert "mcp_server_code_execution_mode.py" in names
    assert kernel == (REPO / "mcp_sandbox_kernel.py").read_bytes()
    assert "mcp-server-code-execution-mode = mcp_server_code_execution_mode:main" in scripts
