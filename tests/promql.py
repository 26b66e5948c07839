"""A PromQL reader for the tests: the metric names (or recorded series) an expression selects.

Shared by the alert tests (every rule reads only inventory metrics) and the
runbook tests (every query a runbook gives does too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_TOKEN = re.compile(
    r"""
      (?P<space>\s+|\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|(?i:inf|nan)(?![\w:]))
    | (?P<name>[A-Za-z_:][\w:]*)
    | (?P<punct>=~|!~|==|!=|>=|<=|[-+*/%^=<>(){}\[\],:@])
    """,
    re.VERBOSE,
)
# Keywords that take a parenthesised list of label names.
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LIST_KEYWORDS | {"and", "or", "unless", "bool", "offset", "atan2"}
_CLOSING = {"(": ")", "{": "}", "[": "]"}


def _tokens(expr: str) -> Iterator[tuple[str, str]]:
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[pos:]!r}")
        assert match.lastgroup is not None
        if match.lastgroup != "space":
            yield match.lastgroup, match.group()
        pos = match.end()


def _skip(tokens: list[tuple[str, str]], start: int) -> int:
    """The index after the bracket that closes the one at `start`."""
    opening = tokens[start][1]
    depth = 0
    for i in range(start, len(tokens)):
        text = tokens[i][1] if tokens[i][0] == "punct" else ""
        depth += (text == opening) - (text == _CLOSING[opening])
        if depth == 0:
            return i + 1
    raise ValueError(f"unclosed {opening!r}")


def _selector_name(tokens: list[tuple[str, str]]) -> str | None:
    """A `__name__="..."` matcher inside a `{...}` selector."""
    for i, (kind, text) in enumerate(tokens):
        if kind == "name" and text == "__name__":
            if tokens[i + 1][1] != "=" or tokens[i + 2][0] != "string":
                raise ValueError("a __name__ matcher must be an exact string; name the metric")
            return str(tokens[i + 2][1][1:-1])
    return None


def metrics_in(expr: str) -> set[str]:
    """Metric names (or recorded series) an expression selects; label matchers,
    strings, ranges, function names, keywords and grouping labels are skipped."""
    tokens = list(_tokens(expr))
    parens = [text for kind, text in tokens if kind == "punct" and text in "()"]
    if parens.count("(") != parens.count(")"):
        raise ValueError("unbalanced parentheses")
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1].lower() if i + 1 < len(tokens) else ""
        if kind == "punct" and text in ("{", "["):
            end = _skip(tokens, i)
            if text == "{" and (name := _selector_name(tokens[i + 1 : end - 1])) is not None:
                names.add(name)
            i = end
        elif kind == "name" and text.lower() in _LABEL_LIST_KEYWORDS and following == "(":
            i = _skip(tokens, i + 1)
        elif kind == "name" and (following in ("(", "by", "without") or text.lower() in _KEYWORDS):
            i += 1  # a function, an aggregation (`sum by (a) (...)` too) or a keyword
        else:
            if kind == "name":
                names.add(text)
            i += 1
    return names
