"""Every relative link in README.md and docs/ points at a file that exists, and at a heading of it when it names one.

Links are read as GitHub renders them: not inside code (fenced, indented or
inline), external URLs left alone, and a `#fragment` matched against the
target page's headings turned into GitHub's anchors (lower case, punctuation
dropped, spaces to hyphens, `-1`, `-2` for repeats).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
# ](target) or ](target "title"); the link text before it may span lines.
_INLINE_LINK = re.compile(r"\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced and indented code blocks; code lines come back empty, so line numbers hold."""
    fence: str | None = None
    previous_blank_or_code = True
    for line in text.split("\n"):
        opener = _FENCE.match(line)
        if fence is not None:
            if opener and opener.group(1)[0] == fence[0] and len(opener.group(1)) >= len(fence):
                fence = None
            yield ""
            continue
        if opener:
            fence = opener.group(1)
            yield ""
            continue
        indented_code = line.startswith("    ") and previous_blank_or_code and line.strip()
        if indented_code:
            yield ""
            continue
        previous_blank_or_code = not line.strip()
        yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' (GitHub numbers repeats) and explicit HTML anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
        out.update(_HTML_ANCHOR.findall(line))
    return out


def links(text: str) -> list[str]:
    """The targets of every inline link and reference definition outside code."""
    prose = _CODE_SPAN.sub("", "\n".join(_prose_lines(text)))
    found = [m.group(1) for m in _INLINE_LINK.finditer(prose)] + _REFERENCE_DEF.findall(prose)
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in found]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link of `page` that points at no file, or at no heading of its target."""
    problems: list[str] = []
    where = page.relative_to(root).as_posix()
    for target in links(page.read_text()):
        if not target or _EXTERNAL.match(target) or target.startswith("//"):
            continue
        path_part, _, fragment = target.partition("#")
        path_part = unquote(path_part)
        if path_part.startswith("/"):
            resolved = root / path_part.lstrip("/")
        else:
            resolved = (page.parent / path_part) if path_part else page
        if not resolved.exists():
            problems.append(f"{where}: {target}: no such file")
            continue
        is_page = resolved.is_file() and resolved.suffix == ".md"
        if fragment and is_page and unquote(fragment).lower() not in anchors(resolved.read_text()):
            problems.append(f"{where}: {target}: no heading #{fragment} in {resolved.name}")
    return problems


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = doc_files()
    assert ROOT / "docs" / "README.md" in pages and len(pages) > 10
    problems = [p for page in pages for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_docs_index_links_every_page_of_docs() -> None:
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p != index}
    assert not pages - linked, f"docs/README.md does not link {sorted(p.name for p in pages - linked)}"


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Adding a stack (e.g. `staging`)\n\n## Notes\n\n## Notes\n"
    )
    (tmp_path / "README.md").write_text(
        "# Project\n\n"
        "[ok](docs/guide.md) [ok](docs/guide.md#adding-a-stack-eg-staging) [ok](docs/guide.md#notes-1)\n"
        "[self](#project) [web](https://example.com/missing.md) [dir](docs/)\n"
        "[gone](docs/missing.md) and [a wrapped\nlink text](docs/guide.md#no-such-heading)\n"
        "[repeat too far](docs/guide.md#notes-2)\n\n"
        "`[code](docs/in-code.md)`\n\n"
        "```\n[fenced](docs/in-fence.md)\n```\n\n"
        "    [indented](docs/in-indented-code.md)\n"
    )
    problems = broken_links(tmp_path / "README.md", tmp_path)
    assert problems == [
        "README.md: docs/missing.md: no such file",
        "README.md: docs/guide.md#no-such-heading: no heading #no-such-heading in guide.md",
        "README.md: docs/guide.md#notes-2: no heading #notes-2 in guide.md",
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Adding a stack (e.g. `staging`)", "adding-a-stack-eg-staging"),
        ("Serving (`infra/serving/`)", "serving-infraserving"),
        ("A stuck upgrade: `make upgrade-status`", "a-stuck-upgrade-make-upgrade-status"),
        ("Cold start, end to end", "cold-start-end-to-end"),
        ("`node_groups.gpu[]`", "node_groupsgpu"),
        ("See [the plan](capacity.md)", "see-the-plan"),
    ],
)
def test_anchors_are_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
