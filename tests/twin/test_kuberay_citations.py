"""Every upstream line the KubeRay mirror (twin/kuberay.py) ports still says what it quotes.

The mirror's rules cite `file:line` in the pinned KubeRay v1.7.0 and AWS load
balancer controller v3.5.0 sources (../shared/reference). A bump of either
moves or changes those lines: this test then fails and names each one, so
the mirror is read again before anything relies on it.

A few cited files (the operator's metrics code and its chart's templates) are
not in the shared reference folder: those citations are checked against the
copies `scripts/fetch-reference.sh --upstream` fetches, and every such file
must be one that command fetches.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.citations import Cite, misquoted
from infra.serving import kuberay as platform_kuberay
from tests.harness import reference_dir, upstream_dir
from twin import kuberay

MIRROR = Path(kuberay.__file__)
ROOT = Path(__file__).resolve().parents[2]


def test_the_mirror_cites_many_lines_each_once_per_place() -> None:
    cites = kuberay.citations()
    assert len(cites) >= 60
    # Every mark was filled in with a real line number.
    assert all(c.line > 0 for c in cites), [c for c in cites if c.line <= 0]
    files = {c.path.split("/", 1)[0] for c in cites}
    assert files == {"kuberay", "aws-load-balancer-controller"}


def _split(reference: Path) -> tuple[list[Cite], list[Cite]]:
    """The citations of files in the reference folder, and those of files it lacks."""
    cites = kuberay.citations()
    held = [c for c in cites if (reference / c.path).is_file()]
    return held, [c for c in cites if c not in held]


def _fetched_upstream() -> set[str]:
    listing = subprocess.run(
        ["bash", str(ROOT / "scripts" / "fetch-reference.sh"), "--list-upstream"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split()[0] for line in listing.splitlines()}


def test_every_cited_line_in_the_reference_says_what_is_quoted() -> None:
    held, _ = _split(reference_dir())
    wrong = misquoted(held, reference_dir())
    assert not wrong, "\n".join(wrong)


def test_every_cited_file_the_reference_lacks_is_one_the_fetch_script_fetches() -> None:
    _, lacking = _split(reference_dir())
    fetched = _fetched_upstream()
    assert {c.path for c in lacking} <= fetched, sorted({c.path for c in lacking} - fetched)
    # Nothing is fetched that the reference already holds or no mark cites.
    assert fetched == {c.path for c in lacking}


def test_every_cited_line_in_the_fetched_upstream_files_says_what_is_quoted() -> None:
    _, lacking = _split(reference_dir())
    wrong = misquoted(lacking, upstream_dir())
    assert not wrong, "\n".join(wrong)


def test_a_wrong_citation_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a mark moved one line down no longer matches."""
    root = reference_dir()
    cite = kuberay.citations()[0]
    lines = (root / cite.path).read_text().splitlines()
    assert cite.quote not in lines[cite.line]  # the next line


def test_marks_are_literal_calls() -> None:
    """citations() reads marks from source: a mark built at run time would be missed, so none is."""
    tree = ast.parse(MIRROR.read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in kuberay.MARKERS
    ]
    assert len(calls) == len(kuberay.citations())


@pytest.mark.parametrize(
    ("platform", "mirror"),
    [
        (platform_kuberay.CLUSTER, kuberay.CLUSTER_LABEL),
        (platform_kuberay.NODE_TYPE, kuberay.NODE_TYPE_LABEL),
        (platform_kuberay.GROUP, kuberay.GROUP_LABEL),
        (platform_kuberay.IS_RAY_NODE, kuberay.IS_RAY_NODE_LABEL),
        (platform_kuberay.SERVE, kuberay.SERVE_LABEL),
        (platform_kuberay.REDIS_CLEANUP, kuberay.REDIS_CLEANUP),
    ],
)
def test_the_platform_names_kuberay_labels_as_kuberay_does(platform: str, mirror: str) -> None:
    assert platform == mirror
