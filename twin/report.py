"""What the twin prints: one line per check (PASS/FAIL), per substitution (SUB) and per step.

Every line names the RayService it is about. A run fails when any check failed.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Report:
    """Collects and prints the twin's lines; thread-safe (the health sampler reports from a thread)."""

    out: TextIO = field(default_factory=lambda: sys.stdout)
    started: float = field(default_factory=time.monotonic)
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _print(self, tag: str, service: str, text: str) -> None:
        where = f"[{service}] " if service else ""
        with self._lock:
            print(f"{tag:<4} {where}{text}", file=self.out, flush=True)

    def ok(self, service: str, text: str) -> None:
        """A check that passed."""
        self.passed += 1
        self._print("PASS", service, text)

    def fail(self, service: str, text: str) -> None:
        """A check that failed: the run will exit non-zero."""
        self.failed.append(f"[{service}] {text}")
        self._print("FAIL", service, text)

    def check(self, service: str, ok: bool, text: str) -> bool:
        """PASS or FAIL ``text``; returns ``ok``."""
        (self.ok if ok else self.fail)(service, text)
        return ok

    def sub(self, service: str, text: str) -> None:
        """A substitution the local run makes to the rendered declaration."""
        self._print("SUB", service, text)

    def step(self, service: str, text: str) -> None:
        """Progress, with the time since the run started."""
        self._print("..", service, f"{text} ({self.elapsed():.0f}s)")

    def note(self, service: str, text: str) -> None:
        """Anything else worth a line."""
        self._print("--", service, text)

    def elapsed(self) -> float:
        """Seconds since the report was made."""
        return time.monotonic() - self.started

    @property
    def ok_overall(self) -> bool:
        """No check failed."""
        return not self.failed
