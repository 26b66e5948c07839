"""What a broken rule reports: one line naming the key path, and the error that carries them all."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One broken rule at one key path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"config error: {self.path}: {self.message}"


class ConfigError(Exception):
    """The config breaks one or more rules; `problems` has one line each."""

    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems
