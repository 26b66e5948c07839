"""`make test`: the whole suite, in phases that keep measurements apart from load.

1. the tests that measure latency against an idle baseline (marker
   ``timing``), alone, so nothing else on the machine moves their figures;
2. the tests that start no server (neither ``e2e`` nor ``timing``), two at
   a time (pytest-xdist): each is one process's work, and one at a time they
   left a core idle for six minutes. `make lint` runs beside them: mypy is
   one process for most of two minutes, and alone it left a core idle too.
   So do the end-to-end tests that start a cluster or an engine of their own
   and share none (APART_PATHS): each checks what a system does (a token
   refused, a fault survived, bytes read once, a span sent, a capacity),
   never how fast, and one at a time they held the run for three and a half
   minutes;
3. the rest of the end-to-end tests, the twins of both stacks included, one
   at a time;
4. the benchmark's quick run (`python -m benchmarks --quick`), alone, as it
   pins the server it measures to a core.

The phases run one after another. Run beside the rest of the suite on two
cores, the monitored twins failed (a steady-state TTFT alert fired, a Ray node
timed out starting, `make local` did not come up), so they run alone, in the
end-to-end suite (TWIN_MONITORING=0 leaves their monitoring out).

Every suite runs even when an earlier one failed, so one run shows every
failure. Each suite's output is printed whole when it ends. Extra arguments
go to every pytest, e.g. ``python -m tests.run --durations=40``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"
E2E_DIR = "tests/e2e"
# Where the end-to-end tests live: collecting only these saves the whole suite's collection (most of a
# minute). A test marked e2e elsewhere would run in no suite (tests/test_suite_runner.py checks).
E2E_PATHS = (E2E_DIR, "tests/test_capacity_vllm.py")
# The end-to-end tests that run beside the unit suite (phase 2 above): modules that use no shared server
# fixture and judge no latency. Beside the unit suite, the tests of the shared servers did not hold: a
# replica's reported queue, sampled while requests were in flight, read 0 under the other suites' load.
APART_PATHS = (
    f"{E2E_DIR}/test_gcs_fault_tolerance.py",
    f"{E2E_DIR}/test_ray_auth_e2e.py",
    f"{E2E_DIR}/test_s3_weights_e2e.py",
    f"{E2E_DIR}/test_tracing_e2e.py",
    "tests/test_capacity_vllm.py",
)
# pytest-xdist's workers for the tests that start no server: one per core here.
UNIT_WORKERS = "--numprocesses=2"
HEARTBEAT_S = 120.0
# How long an interrupted suite gets to end its servers before the run returns.
INTERRUPT_GRACE_S = 60.0


@dataclass
class Suite:
    """One pytest (or other) command run to completion, its output kept in a log."""

    name: str
    argv: list[str]
    # Starts with the suite before it and runs beside it (the phase ends when both have).
    beside_previous: bool = False
    took: float = 0.0
    code: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name}.log"

    def start(self) -> None:
        """Starts it, its output going to its log."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "E2E": "1", "E2E_REQUIRED": "1"}
        print(f"[run] {self.name}: {' '.join(self.argv)}", flush=True)
        self._started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def ended(self) -> bool:
        """Whether it has ended; the first time it has, prints its whole output."""
        if self.code is not None:
            return True
        assert self.proc is not None, "not started"
        if (code := self.proc.poll()) is None:
            return False
        self.code, self.took = code, time.monotonic() - self._started
        print(f"\n========== {self.name} (exit {code}, {self.took / 60:.1f} min) ==========", flush=True)
        sys.stdout.write(self.log.read_text(errors="replace"))
        sys.stdout.flush()
        return True


def run_together(phase: list[Suite]) -> None:
    """Starts every suite of ``phase`` at once and waits for all, a line every few minutes meanwhile."""
    for suite in phase:
        suite.start()
    started = time.monotonic()
    beat = started + HEARTBEAT_S
    while not all([suite.ended() for suite in phase]):
        time.sleep(1.0)
        if time.monotonic() >= beat:
            beat += HEARTBEAT_S
            running = ", ".join(s.name for s in phase if s.code is None)
            print(f"[run] still running: {running} {(time.monotonic() - started) / 60:.0f} min", flush=True)


def phases(ordered: list[Suite]) -> list[list[Suite]]:
    """The suites grouped into phases: each with those that run beside it."""
    grouped: list[list[Suite]] = []
    for suite in ordered:
        if suite.beside_previous and grouped:
            grouped[-1].append(suite)
        else:
            grouped.append([suite])
    return grouped


def pytest(name: str, *args: str, extra: list[str] | None = None, beside_previous: bool = False) -> Suite:
    return Suite(name, [sys.executable, "-m", "pytest", "-q", *args, *(extra or [])], beside_previous=beside_previous)


# The e2e suite's arguments: the paths APART_PATHS leaves (pytest collects a path it is given even when
# told to ignore it), and the apart modules inside them ignored.
E2E_REST = (
    *(p for p in E2E_PATHS if p not in APART_PATHS),
    *(f"--ignore={p}" for p in APART_PATHS if p.startswith(f"{E2E_DIR}/")),
)


def suites(extra: list[str] | None = None) -> list[Suite]:
    """The run's suites, in the order they run. ``extra`` goes to every pytest."""
    return [
        # Timing tests live in tests/e2e: collecting only it saves the whole suite's collection (most of a minute).
        pytest("timing", "-m", "timing", E2E_DIR, extra=extra),
        pytest("unit", "-m", "not e2e and not timing", UNIT_WORKERS, extra=extra),
        Suite("lint", ["make", "--no-print-directory", "lint"], beside_previous=True),
        pytest("e2e-apart", "-m", "e2e and not timing", *APART_PATHS, extra=extra, beside_previous=True),
        pytest("e2e", "-m", "e2e and not timing", *E2E_REST, extra=extra),
        Suite("bench-quick", [sys.executable, "-m", "benchmarks", "--quick", "--out", "build/bench-quick"]),
    ]


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    ordered = suites(sys.argv[1:])
    current: list[Suite] = []
    try:
        for current in phases(ordered):
            run_together(current)
    except KeyboardInterrupt:
        # Ctrl-C reached the suites too (one process group): each pytest ends its tests' servers itself.
        for suite in current:
            if suite.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    suite.proc.wait(timeout=INTERRUPT_GRACE_S)
        print(f"\n[run] interrupted; each suite's output so far is in {_shown(LOGS)}/", flush=True)
        return 130
    print("\n[run] " + "; ".join(f"{s.name}: exit {s.code} in {s.took / 60:.1f} min" for s in ordered), flush=True)
    failed = [s.name for s in ordered if s.code != 0]
    if failed:
        print(f"[run] FAILED: {', '.join(failed)} (logs in {_shown(LOGS)}/)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
