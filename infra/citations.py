"""Code that ports an upstream controller's behaviour names the line it relies on, and a test re-reads it.

A module marks each rule with a call to a no-op marker, ``_k(path, line,
quote)``, beside the code that ports it. :func:`marks` reads every such call
from the module's source (so marks inside functions count as well as those
at module level), and :func:`misquoted` checks each against the pinned
upstream files in the reference folder: a bump that moves or changes a line
fails the test and names it, so the port is read again.

Used by the KubeRay mirror (twin/kuberay.py) and the upgrade diagnosis
(infra/serving/upgrade_status.py). Imports nothing of the program.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cite:
    """One upstream line a rule relies on: a path under the reference folder, its 1-based line, a quote of it."""

    path: str
    line: int
    quote: str


def marks(source: Path, folders: Mapping[str, str]) -> list[Cite]:
    """Every call in `source` to a marker named in `folders` (marker -> its folder under the reference).

    The arguments must be literals: a mark built at run time could not be read here.
    """
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in folders:
            path, line, quote = (ast.literal_eval(arg) for arg in node.args)
            found.append(Cite(folders[node.func.id] + path, line, quote))
    return found


def misquoted(cites: Iterable[Cite], reference: Path) -> list[str]:
    """One line for each citation whose line (under `reference`) does not say what it quotes."""
    wrong = []
    for cite in cites:
        path = reference / cite.path
        lines = path.read_text().splitlines() if path.is_file() else []
        said = lines[cite.line - 1] if 0 < cite.line <= len(lines) else "<no such line>"
        if cite.quote not in said:
            wrong.append(f"{cite.path}:{cite.line}: expected {cite.quote!r}, found {said.strip()!r}")
    return wrong
