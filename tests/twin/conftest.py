"""Fixtures of the twin's tests: Ray present (or the run says it must be), and the committed stacks' renders."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from infra.render import write
from tests.harness import render_stack


@pytest.fixture(scope="session")
def needs_ray() -> None:
    """Skip when Ray is not installed, unless E2E_REQUIRED=1 (CI), where that is a failure."""
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail("E2E_REQUIRED=1 but ray is not installed")
        pytest.skip("ray is not installed")


@pytest.fixture(scope="session")
def render_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The committed dev and prod stacks rendered to folders, as ``python -m infra.render`` writes them."""
    dirs = {}
    for stack in ("dev", "prod"):
        out = tmp_path_factory.mktemp(f"render-{stack}")
        write(render_stack(stack), out)
        dirs[stack] = out
    return dirs
