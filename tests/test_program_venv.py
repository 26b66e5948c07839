"""The program runs in the venv the Pulumi CLI builds: `requirements.txt` alone.

`Pulumi.yaml` says `toolchain: pip`, `virtualenv: venv`: the CLI creates
the venv and installs `requirements.txt` into it, nothing else. A module the
program imports that only a dev requirements file brings would pass every
other test and fail `pulumi up` on a user's machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.render import ROOT
from tests.harness import STACKS


def _project_files() -> list[Path]:
    """What a fresh clone holds: the tracked files, as they are in this tree."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [Path(p) for p in listed if (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def clone_with_program_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["runtime"]["options"]["toolchain"] != "pip":
        pytest.fail("Pulumi.yaml no longer builds the venv with pip: update this test to the new toolchain")
    clone = tmp_path_factory.mktemp("clone")
    for rel in _project_files():
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, clone / rel)
    subprocess.run([sys.executable, "-m", "venv", str(clone / "venv")], check=True, timeout=120)
    # --no-compile: the same packages at the same versions, without byte-compiling every module of the
    # provider SDKs up front (pip 37 s -> 21 s here; the render then compiles the modules it imports, 4 s).
    result = subprocess.run(
        [str(clone / "venv" / "bin" / "pip"), "install", "-q", "--no-compile", "-r", "requirements.txt"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return clone


@pytest.mark.parametrize("stack", STACKS)
def test_both_stacks_render_in_the_venv_built_from_requirements_txt(clone_with_program_venv: Path, stack: str) -> None:
    clone = clone_with_program_venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    result = subprocess.run(
        [str(clone / "venv" / "bin" / "python"), "-m", "infra.render", "--stack", stack, "--out", str(clone / "out")],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (clone / "out" / "manifests.yaml").stat().st_size > 0
