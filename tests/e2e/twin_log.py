"""Running a twin command and reading its log: its verdict lines, and what a failed test shows of it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infra.render import ROOT

TAIL_LINES = 60


@dataclass(frozen=True)
class TwinRun:
    """One twin command's exit code, log and time."""

    returncode: int
    output: str
    seconds: float

    @property
    def verdicts(self) -> list[str]:
        return verdicts(self.output)

    def assert_passed(self, label: str) -> None:
        """Prints the verdicts under ``label``; fails with the failed checks and the log's tail."""
        print(f"\n[{label}] {self.seconds:.0f}s\n" + "\n".join(self.verdicts), flush=True)
        assert self.returncode == 0, failure_message(self.output)
        assert not failures(self.output)


def run(module_args: list[str], log: Path, timeout_s: float) -> TwinRun:
    """``python -m <module_args>`` from the repository, unbuffered, its output in ``log``."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", *module_args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    return TwinRun(done.returncode, log.read_text(errors="replace"), time.monotonic() - started)


def verdicts(output: str) -> list[str]:
    """The PASS and FAIL lines, in order."""
    return [line for line in output.splitlines() if line.startswith(("PASS", "FAIL"))]


def failures(output: str) -> list[str]:
    """The FAIL lines."""
    return [line for line in verdicts(output) if line.startswith("FAIL")]


def failure_message(output: str) -> str:
    """The failed checks, then the log's last lines: a failure's tail alone is whatever ran last."""
    return "\n".join([*failures(output), "--- the log's last lines:", *output.splitlines()[-TAIL_LINES:]])
