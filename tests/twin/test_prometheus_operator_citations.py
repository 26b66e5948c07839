"""Every upstream line the Prometheus Operator port (twin/prometheus_operator.py) relies on still says what it quotes.

The port's rules cite `file:line` in the pinned operator v0.93.0 source
(pkg/prometheus/promcfg.go) and the chart defaults in the pinned
kube-prometheus-stack values (../shared/reference). A bump of either moves or
changes those lines: this test then fails and names each one, so the port is
read again before the twin relies on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from infra.citations import Cite, misquoted
from tests.harness import reference_dir
from twin import prometheus_operator

PORT = Path(prometheus_operator.__file__)


def test_the_port_cites_many_lines() -> None:
    cites = prometheus_operator.citations()
    assert len(cites) >= 25
    # Every mark was filled in with a real line number.
    assert all(c.line > 0 for c in cites), [c for c in cites if c.line <= 0]
    promcfg = [c for c in cites if c.path.endswith("pkg/prometheus/promcfg.go")]
    assert len(promcfg) >= 25
    assert {c.path.split("/", 1)[0] for c in cites} == {"prometheus-operator", "kube-prometheus-stack"}


def test_every_cited_line_says_what_is_quoted() -> None:
    wrong = misquoted(prometheus_operator.citations(), reference_dir())
    assert not wrong, "\n".join(wrong)


def test_a_wrong_citation_is_caught() -> None:
    """The check itself can fail: a mark moved one line down no longer matches."""
    root = reference_dir()
    cite = next(c for c in prometheus_operator.citations() if c.path.endswith("promcfg.go"))
    moved = Cite(cite.path, cite.line + 1, cite.quote)
    assert misquoted([moved], root), cite
    assert misquoted([Cite(cite.path, cite.line, cite.quote + " (not in the line)")], root)


def test_marks_are_literal_calls() -> None:
    """citations() reads marks from source: a mark built at run time would be missed, so none is."""
    tree = ast.parse(PORT.read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in prometheus_operator.MARKERS
    ]
    assert len(calls) == len(prometheus_operator.citations())
    for call in calls:
        assert all(isinstance(arg, ast.Constant) for arg in call.args), ast.unparse(call)
