"""`make test`: the whole suite, in phases that keep measurements apart from load.

1. the tests that measure latency against an idle baseline (marker
   ``timing``), alone, so nothing else on the machine moves their figures;
2. everything else, the twins of both stacks included;
3. the benchmark's quick run (`python -m benchmarks --quick`), alone, as it
   pins the server it measures to a core.

One phase may run several suites at once (each with a port range of its own,
``LLM_PLATFORM_PORT_RANGE``). None does today: run beside the rest of the
suite on two cores, the monitored twins failed (a steady-state TTFT alert
fired, a Ray node timed out starting, `make local` did not come up), so
they run in sequence, and the monitoring twins only with TWIN_MONITORING=1.

Every phase runs even when an earlier one failed, so one run shows every
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
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "build" / "test-logs"
E2E_DIR = "tests/e2e"
HEARTBEAT_S = 120.0
# How long an interrupted suite gets to end its servers before the run returns.
INTERRUPT_GRACE_S = 60.0


@dataclass
class Suite:
    """One pytest (or other) command run to completion, its output kept in a log."""

    name: str
    argv: list[str]
    ports: str | None = None
    started: float = 0.0
    took: float = 0.0
    code: int | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    out: IO[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name}.log"

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "E2E": "1", "E2E_REQUIRED": "1"}
        if self.ports:
            env["LLM_PLATFORM_PORT_RANGE"] = self.ports
        self.out = self.log.open("wb")
        self.started = time.monotonic()
        print(f"[run] {self.name}: {' '.join(self.argv)}", flush=True)
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def poll(self) -> bool:
        """Whether it has ended; prints its whole output the moment it does."""
        assert self.proc is not None and self.out is not None
        if self.code is None and (code := self.proc.poll()) is not None:
            self.code, self.took = code, time.monotonic() - self.started
            self.out.close()
            print(f"\n========== {self.name} (exit {code}, {self.took / 60:.1f} min) ==========", flush=True)
            sys.stdout.write(self.log.read_text(errors="replace"))
            sys.stdout.flush()
        return self.code is not None


def pytest(name: str, *args: str, ports: str | None = None, extra: list[str] | None = None) -> Suite:
    return Suite(name, [sys.executable, "-m", "pytest", "-q", *args, *(extra or [])], ports=ports)


def phases(extra: list[str] | None = None) -> list[list[Suite]]:
    """The run's phases, in order; the suites of one phase run at once. ``extra`` goes to every pytest."""
    return [
        # Timing tests live in tests/e2e: collecting only it saves the whole suite's collection (most of a minute).
        [pytest("timing", "-m", "timing", E2E_DIR, extra=extra)],
        [pytest("rest", "-m", "not timing", extra=extra)],
        [Suite("bench-quick", [sys.executable, "-m", "benchmarks", "--quick", "--out", "build/bench-quick"])],
    ]


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def run_together(suites: list[Suite]) -> None:
    for suite in suites:
        suite.start()
    last = time.monotonic()
    while not all(suite.poll() for suite in suites):
        time.sleep(1.0)
        if time.monotonic() - last >= HEARTBEAT_S:
            last = time.monotonic()
            running = [f"{s.name} {(last - s.started) / 60:.0f} min" for s in suites if s.code is None]
            print(f"[run] still running: {', '.join(running)}", flush=True)


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    # The tiny model every e2e test and twin serves, built once before two suites could both build it.
    from twin.model import tiny_model_dir

    tiny_model_dir()
    ordered = phases(sys.argv[1:])
    try:
        for phase in ordered:
            run_together(phase)
    except KeyboardInterrupt:
        # Ctrl-C reached the suites too (one process group): each pytest ends its tests' servers itself.
        for suite in (s for phase in ordered for s in phase if s.proc is not None and s.code is None):
            assert suite.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                suite.proc.wait(timeout=INTERRUPT_GRACE_S)
        print(f"\n[run] interrupted; each suite's output so far is in {_shown(LOGS)}/", flush=True)
        return 130
    suites = [suite for phase in ordered for suite in phase]
    print("\n[run] " + "; ".join(f"{s.name}: exit {s.code} in {s.took / 60:.1f} min" for s in suites), flush=True)
    failed = [s.name for s in suites if s.code != 0]
    if failed:
        print(f"[run] FAILED: {', '.join(failed)} (logs in {_shown(LOGS)}/)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
