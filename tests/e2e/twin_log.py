"""Reading a twin run's log: its verdict lines, and what a failed test shows of it."""

from __future__ import annotations

TAIL_LINES = 60


def verdicts(output: str) -> list[str]:
    """The PASS and FAIL lines, in order."""
    return [line for line in output.splitlines() if line.startswith(("PASS", "FAIL"))]


def failures(output: str) -> list[str]:
    """The FAIL lines."""
    return [line for line in verdicts(output) if line.startswith("FAIL")]


def failure_message(output: str) -> str:
    """The failed checks, then the log's last lines: a failure's tail alone is whatever ran last."""
    return "\n".join([*failures(output), "--- the log's last lines:", *output.splitlines()[-TAIL_LINES:]])
