"""The `container` marker's guard (tests/conftest.py): a test not marked container finds
`podman` and `docker` as shims that fail loudly and log what they were asked; a test
marked container finds the real ones."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ENGINES, GUARD_KEY


def test_an_unmarked_test_that_runs_an_engine_fails_loudly_and_is_logged(
    request: pytest.FixtureRequest,
) -> None:
    guard = request.config.stash[GUARD_KEY]
    for name in ENGINES:
        assert shutil.which(name) == str(guard.folder / name)
        ran = subprocess.run([name, "info"], capture_output=True, text=True, timeout=30, check=False)
        assert ran.returncode == 97, ran
        assert "%s was run by a test not marked container" % name in ran.stderr
    caught = guard.disarm()
    guard.arm()  # the teardown's check starts afresh: these calls were on purpose
    assert caught == "podman info\ndocker info\n"


@pytest.mark.container
def test_a_container_test_finds_the_real_engines(request: pytest.FixtureRequest) -> None:
    guard = request.config.stash[GUARD_KEY]
    for name in ENGINES:
        found = shutil.which(name)
        assert found is None or not found.startswith(str(guard.folder)), found
