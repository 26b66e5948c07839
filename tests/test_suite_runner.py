"""`make test`'s runner (tests/run.py): its suites split the tests without gap or overlap, and Ctrl-C ends it cleanly.

The split is checked on the end-to-end tests' paths (run.E2E_PATHS), whose
collection takes seconds where the whole suite's takes most of a minute;
outside them no test is marked ``e2e`` or ``timing``, so every test there is
in ``unit``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import run

ROOT = Path(__file__).resolve().parents[1]
E2E_DIR = run.E2E_DIR
E2E_PATHS = run.E2E_PATHS


def _collected(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**os.environ, "E2E": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    # 5: pytest collected nothing (the unit suite has no test on the end-to-end paths).
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def _suites() -> dict[str, run.Suite]:
    return {suite.name: suite for suite in run.suites()}


def _e2e_of(suite: run.Suite) -> set[str]:
    """The tests under run.E2E_PATHS that ``suite`` runs: its own selection (and paths, when it names
    some), collected on the end-to-end paths alone."""
    args = [a for a in suite.argv[4:] if not a.startswith(("tests/", "--numprocesses"))]
    paths = [a for a in suite.argv[4:] if a.startswith("tests/")]
    return _collected(*args, *(paths or E2E_PATHS))


def test_the_suites_run_every_end_to_end_test_once() -> None:
    everything = _collected(*E2E_PATHS)
    assert len(everything) > 100
    assert any(line.startswith(E2E_PATHS[1]) for line in everything)
    picked = [_e2e_of(suite) for suite in _suites().values() if suite.argv[2] == "pytest"]
    assert sum(len(p) for p in picked) == len(everything)
    assert set().union(*picked) == everything


def test_the_end_to_end_suite_collects_every_path_with_an_end_to_end_test() -> None:
    """The e2e suite collects only run.E2E_PATHS; a test marked e2e elsewhere would run in no suite."""
    marked = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("*.py")
        if path != Path(__file__)
        and "mark.e2e" in path.read_text()
        and not any(path.is_relative_to(ROOT / e2e) for e2e in E2E_PATHS)
    ]
    assert marked == []
    named = [a for suite in _suites().values() for a in suite.argv]
    assert all(path in named for path in E2E_PATHS)


def test_only_end_to_end_tests_are_marked_timing() -> None:
    """The timing suite collects only tests/e2e; a timing test elsewhere would run in no suite."""
    marked = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("*.py")
        if path != Path(__file__) and "mark.timing" in path.read_text() and not path.is_relative_to(ROOT / E2E_DIR)
    ]
    assert marked == []


def test_the_timing_tests_run_alone() -> None:
    suites = _suites()
    timing = {line.split("::")[0] for line in _e2e_of(suites["timing"])}
    assert timing == {
        "tests/e2e/test_attacks_e2e.py",
        "tests/e2e/test_fairness_e2e.py",
        "tests/e2e/test_serving_overhead.py",
    }
    assert [[s.name for s in phase] for phase in run.phases(run.suites())] == [
        ["timing"],
        ["unit", "lint", "e2e-apart"],
        ["e2e"],
        ["bench-quick"],
    ]


def test_the_end_to_end_tests_beside_the_unit_suite_share_no_server_and_measure_nothing() -> None:
    """Beside the unit suite run only modules that start what they test themselves: no shared server
    fixture (its queue readings did not hold under the other suites' load), no twin, no timing."""
    apart = _e2e_of(_suites()["e2e-apart"])
    assert {line.split("::")[0] for line in apart} == set(run.APART_PATHS)
    for path in run.APART_PATHS:
        text = (ROOT / path).read_text()
        assert "server: ServerInfo" not in text and "mark.timing" not in text and "twin" not in path, path
    assert not apart & _e2e_of(_suites()["e2e"])


def test_lint_is_the_makefiles_and_make_test_reaches_it_only_through_the_suite() -> None:
    # One list of linters (the Makefile's `lint`), run once: beside the unit suite, not before it too.
    assert _suites()["lint"].argv[0] == "make" and _suites()["lint"].argv[-1] == "lint"
    test_rule = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("test:"))
    assert "lint" not in test_rule.split(":", 1)[1].split()


def test_the_suites_of_a_phase_run_at_once_and_each_prints_its_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run, "LOGS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["run"])
    sleep = "import sys, time; time.sleep(2); print(sys.argv[1]); sys.exit(int(sys.argv[2]))"
    first = run.Suite("first", [sys.executable, "-c", sleep, "one", "0"])
    second = run.Suite("second", [sys.executable, "-c", sleep, "two", "4"], beside_previous=True)
    monkeypatch.setattr(run, "suites", lambda extra=None: [first, second])
    started = time.monotonic()
    assert run.main() == 1
    assert time.monotonic() - started < 3.5, "the two suites ran one after the other"
    out = capsys.readouterr().out
    assert "one" in out and "two" in out and "[run] FAILED: second" in out
    assert (first.code, second.code) == (0, 4)


def test_the_unit_suite_runs_two_at_a_time_and_nothing_that_starts_a_server() -> None:
    unit = _suites()["unit"].argv
    assert run.UNIT_WORKERS in unit and "not e2e and not timing" in unit
    assert all(run.UNIT_WORKERS not in suite.argv for name, suite in _suites().items() if name != "unit")


def test_ctrl_c_waits_for_the_running_suite_and_returns_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Interrupted(run.Suite):
        def start(self) -> None:
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
            raise KeyboardInterrupt

    suite = Interrupted("short", [])
    monkeypatch.setattr(run, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(sys, "argv", ["run"])
    monkeypatch.setattr(run, "suites", lambda extra=None: [suite])
    assert run.main() == 130
    assert suite.proc is not None and suite.proc.returncode == 0
    assert "[run] interrupted" in capsys.readouterr().out


def test_a_suite_runs_to_its_end_and_prints_its_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run, "LOGS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["run"])
    ok = run.Suite("ok", [sys.executable, "-c", "print('hello from ok')"])
    bad = run.Suite("bad", [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"])
    monkeypatch.setattr(run, "suites", lambda extra=None: [bad, ok])
    assert run.main() == 1
    out = capsys.readouterr().out
    assert "hello from ok" in out and "broken" in out and (tmp_path / "bad.log").read_text() == "broken\n"
    assert "[run] FAILED: bad" in out and (bad.code, ok.code) == (3, 0)
