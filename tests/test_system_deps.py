"""`make test` and `make twin` set up their system packages: installed as root, else one line naming them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from infra.render import ROOT

SCRIPT = ROOT / "scripts" / "system-deps.sh"


def _bin(tmp_path: Path, *, uid: int, present: tuple[str, ...] = (), apt: bool = True) -> Path:
    """A PATH with fake `id`, the ``present`` commands, and an `apt-get` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def tool(name: str, body: str) -> None:
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    tool("id", f"echo {uid}")
    for name in present:
        tool(name, "exit 0")
    if apt:
        tool("apt-get", f'echo "$@" >> {tmp_path / "apt.log"}')
    return bin_dir


def _run(bin_dir: Path, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), target],
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )


def test_nothing_happens_when_every_package_is_there(tmp_path: Path) -> None:
    present = ("prometheus", "promtool", "shellcheck", "redis-server", "openssl")
    done = _run(_bin(tmp_path, uid=0, present=present), "test")
    assert done.returncode == 0 and not (tmp_path / "apt.log").exists()


def test_root_installs_exactly_the_missing_packages(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=0, present=("shellcheck", "openssl", "prometheus")), "test")
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    # promtool missing while prometheus is present still names the package once.
    assert calls[-1].split()[-2:] == ["prometheus", "redis-server"]
    assert calls[0].startswith("update")


def test_without_root_one_line_names_the_packages_and_the_command(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=1000, present=("shellcheck",)), "test")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "missing system packages: prometheus redis-server openssl; "
        "install them with: sudo apt-get install -y prometheus redis-server openssl"
    ]
    assert not (tmp_path / "apt.log").exists()


def test_the_twin_needs_only_prometheus(tmp_path: Path) -> None:
    done = _run(_bin(tmp_path, uid=1000, present=("prometheus",)), "twin")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("target", ["test", "twin"])
def test_the_make_targets_run_it_first(target: str) -> None:
    # Under `make test` this runs inside make: without the parent's MAKE*
    # variables and with --no-print-directory, the dry run prints only recipes.
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}}
    made = subprocess.run(
        ["make", "--no-print-directory", "-n", target], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert made.splitlines()[0] == f"bash scripts/system-deps.sh {target}"
