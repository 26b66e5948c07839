"""The reference data: every file the tests read has a source in the fetch script.

scripts/fetch-reference.sh fetches the pinned charts' values and CRDs into
the folder `tests.harness.REFERENCE` names. Its `--list` mode prints each
file it writes with the URL it comes from, offline; these tests hold that
list against infra/versions.py, against the files the tests read, and against
the reference folder itself.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra import versions
from tests import harness
from tests.values_keys import REFERENCE_VALUES

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fetch-reference.sh"
TESTS = ROOT / "tests"

# The reference folder of each pinned chart, as the values checks lay it out.
FOLDER_OF = {chart: path.split("/")[0] for chart, path in REFERENCE_VALUES.items()}


def listed(root: Path = ROOT) -> dict[str, str]:
    """`<relative path>: <url>` as the fetch script under `root` lists them."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(root / "scripts" / SCRIPT.name), "--list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pairs = [line.split() for line in result.stdout.splitlines()]
    assert all(len(p) == 2 for p in pairs), result.stdout
    paths = [p for p, _ in pairs]
    assert len(paths) == len(set(paths)), f"a file is listed twice: {paths}"
    return dict(pairs)


def release_tag(url: str) -> str:
    """The git ref in a raw.githubusercontent.com or github.com/tree URL."""
    match = re.fullmatch(
        r"https://(?:raw\.githubusercontent\.com/[\w.-]+/[\w.-]+|github\.com/[\w.-]+/[\w.-]+/tree)/([^/]+)/.+", url
    )
    assert match, f"not an upstream file at a tag: {url}"
    return match.group(1)


def names_version(tag: str, version: str) -> bool:
    """Whether a release tag is the one of `version` (v1.2.3, chart-1.2.3, 1.2.3)."""
    return re.fullmatch(rf"(?:.*-|v)?{re.escape(version.removeprefix('v'))}", tag) is not None


# --- the list itself -------------------------------------------------------------------------


def test_every_pinned_chart_has_its_folder_and_every_folder_a_pinned_chart() -> None:
    assert {c.chart for c in versions.HELM_CHARTS} == set(FOLDER_OF)
    assert {path.split("/")[0] for path in listed()} == set(FOLDER_OF.values()) | set(versions.UPSTREAM_SOURCES)


def test_every_url_is_at_the_release_tag_of_the_pinned_version() -> None:
    chart_of = {folder: chart for chart, folder in FOLDER_OF.items()}
    pinned = {c.chart: c.version for c in versions.HELM_CHARTS}
    for path, url in listed().items():
        folder = path.split("/")[0]
        version = versions.UPSTREAM_SOURCES[folder] if folder in versions.UPSTREAM_SOURCES else pinned[chart_of[folder]]
        assert names_version(release_tag(url), version), f"{path}: {url} is not at {version}"


def test_versions_come_from_infra_versions_only(tmp_path: Path) -> None:
    text = SCRIPT.read_text()
    for chart in versions.HELM_CHARTS:
        assert chart.version.removeprefix("v") not in text, f"{chart.chart}'s version is typed in {SCRIPT.name}"
    for folder, tag in versions.UPSTREAM_SOURCES.items():
        assert tag.removeprefix("v") not in text, f"{folder}'s version is typed in {SCRIPT.name}"
    # The same script beside other pins lists the other versions.
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / SCRIPT.name)
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "__init__.py").write_text("")
    fake = {
        c.chart: ("v" if c.version.startswith("v") else "") + f"77.{i}.99" for i, c in enumerate(versions.HELM_CHARTS)
    }
    fake_sources = {folder: f"v66.{i}.99" for i, folder in enumerate(versions.UPSTREAM_SOURCES)}
    charts = ",\n    ".join(
        f"HelmChart({c.chart!r}, {fake[c.chart]!r}, {c.repository!r})" for c in versions.HELM_CHARTS
    )
    (tmp_path / "infra" / "versions.py").write_text(
        "from dataclasses import dataclass\n\n\n"
        "@dataclass(frozen=True)\n"
        "class HelmChart:\n    chart: str\n    version: str\n    repository: str\n\n\n"
        f"HELM_CHARTS = (\n    {charts},\n)\n"
        f"UPSTREAM_SOURCES = {fake_sources!r}\n"
    )
    chart_of = {folder: chart for chart, folder in FOLDER_OF.items()}
    for path, url in listed(tmp_path).items():
        folder = path.split("/")[0]
        version = fake_sources[folder] if folder in fake_sources else fake[chart_of[folder]]
        assert names_version(release_tag(url), version), f"{path}: {url}"


# --- against the tests and the folder ---------------------------------------------------------


def _reference_reads(source: str) -> list[str]:
    """Path patterns of `REFERENCE / ...` and `reference_dir() / ...` chains.

    A literal part stays as it is, an f-string becomes a glob, any other
    expression `*`.
    """

    def parts(node: ast.expr) -> list[str] | None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left = parts(node.left)
            return None if left is None else [*left, part(node.right)]
        is_reference = isinstance(node, ast.Name) and node.id in ("REFERENCE", "reference")
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reference_dir"
        return [] if is_reference or is_call else None

    def part(node: ast.expr) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
        return "*"

    tree = ast.parse(source)
    # Only whole chains: `REFERENCE / "a"` inside `REFERENCE / "a" / "b"` is not a read.
    inner = {id(n.left) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and id(node) not in inner:
            chain = parts(node)
            if chain:
                found.append("/".join(chain))
    return found


def test_every_file_the_tests_read_has_a_source() -> None:
    sources = listed()
    folders = {path.split("/")[0] for path in sources}
    reads = [*REFERENCE_VALUES.values()]
    for module in sorted(TESTS.rglob("*.py")):
        text = module.read_text()
        reads += _reference_reads(text)
        # Paths written out whole, e.g. a chart's "kuberay/operator-chart.yaml".
        tree = ast.parse(text)
        reads += [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and re.fullmatch(r"[\w-]+/[\w.-]+\.(?:ya?ml|json|txt)", n.value)
            and n.value.split("/")[0] in folders
        ]
    assert any("*" not in r for r in reads), "the scan found no file the tests read"
    missing = sorted({r for r in reads if not fnmatch.filter(sources, r)})
    assert not missing, f"the tests read files that {SCRIPT.name} does not fetch: {missing}"


def test_the_reference_folder_holds_exactly_the_listed_files_of_each_pinned_chart() -> None:
    reference = harness.reference_dir()
    sources = listed()
    for folder in sorted({path.split("/")[0] for path in sources}):
        # Notes (*.md) are prose kept beside the data, not fetched.
        present = {
            p.relative_to(reference).as_posix()
            for p in (reference / folder).rglob("*")
            if p.is_file() and p.suffix != ".md"
        }
        wanted = {path for path in sources if path.split("/")[0] == folder}
        assert present == wanted, f"{folder}: only in the folder {present - wanted}, only listed {wanted - present}"


# --- the helper the tests read the folder through ---------------------------------------------


def test_a_missing_folder_skips_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(harness, "REFERENCE", tmp_path / "absent")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="LLM_PLATFORM_REFERENCE") as skipped:
        harness.reference_dir()
    assert "scripts/fetch-reference.sh" in str(skipped.value)


def test_a_missing_folder_fails_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(harness, "REFERENCE", tmp_path / "absent")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="LLM_PLATFORM_REFERENCE") as failed:
        harness.reference_dir()
    assert "scripts/fetch-reference.sh" in str(failed.value)


def test_the_variable_names_the_folder(tmp_path: Path) -> None:
    env = {**os.environ, "LLM_PLATFORM_REFERENCE": str(tmp_path)}
    code = "from tests.harness import REFERENCE; print(REFERENCE)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path)
    env.pop("LLM_PLATFORM_REFERENCE")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == ROOT.parent / "shared" / "reference"


# --- the script and the workflow --------------------------------------------------------------


def test_the_fetch_script_passes_shellcheck() -> None:
    binary = shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run([binary, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_test_workflow_fetches_the_reference_data_before_the_tests() -> None:
    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    runs = [str(step.get("run", "")) for step in doc["jobs"]["test"]["steps"]]
    fetch = [i for i, run in enumerate(runs) if "scripts/fetch-reference.sh" in run]
    tests = [i for i, run in enumerate(runs) if "bash .ci/run" in run]
    assert fetch and tests and max(fetch) < min(tests), runs
