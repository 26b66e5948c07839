"""`make test`'s runner (tests/run.py): its suites split the tests without gap or overlap; a port range holds.

The split is checked on tests/e2e, whose collection takes seconds where the
whole suite's takes most of a minute; outside it, every test is in `rest`
or, if marked `timing`, in `timing`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from localserve import processes
from localserve.processes import PORT_RANGE_ENV, PortRangeError, free_port, port_range
from tests import run

ROOT = Path(__file__).resolve().parents[1]
# Ray's default worker ports (`ray start --min-worker-port/--max-worker-port`).
RAY_WORKER_PORTS = range(10002, 20000)
E2E_DIR = run.E2E_DIR


def _collected(*args: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**os.environ, "E2E": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line for line in done.stdout.splitlines() if "::" in line}


def _suites() -> dict[str, run.Suite]:
    return {suite.name: suite for phase in run.phases() for suite in phase}


def _e2e_of(suite: run.Suite) -> set[str]:
    """The end-to-end tests ``suite`` runs: its own arguments, kept to tests/e2e when they name no path."""
    args = suite.argv[4:]
    return _collected(*args) if any(a.startswith("tests/") for a in args) else _collected(*args, E2E_DIR)


def test_the_suites_run_every_end_to_end_test_once() -> None:
    everything = _collected(E2E_DIR)
    assert len(everything) > 100
    picked = [_e2e_of(suite) for suite in _suites().values() if suite.argv[2] == "pytest"]
    assert sum(len(p) for p in picked) == len(everything)
    assert set().union(*picked) == everything


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
    assert all(len(phase) == 1 for phase in run.phases())


def test_free_port_takes_distinct_free_ports_from_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "27000-27009")
    monkeypatch.setattr(processes, "_HANDED_OUT", set())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 27004))
        ports = [free_port() for _ in range(9)]
        assert sorted(ports) == [p for p in range(27000, 27010) if p != 27004]
        with pytest.raises(PortRangeError, match=f"{PORT_RANGE_ENV}: no free port left in 27000-27009"):
            free_port()


@pytest.mark.parametrize("text", ["27000", "27000-", "a-b", "900-2000", "3000-2000", "27000-70000"])
def test_a_bad_port_range_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, text)
    with pytest.raises(PortRangeError, match=f"^{PORT_RANGE_ENV}: '{text}' is not low-high"):
        port_range()


def test_without_a_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    low, high = (int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert port_range() is None and low <= free_port() <= high


def test_ctrl_c_waits_for_the_running_suites_and_returns_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import twin.model

    monkeypatch.setattr(twin.model, "tiny_model_dir", lambda: tmp_path)
    monkeypatch.setattr(run, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(sys, "argv", ["run"])
    suite = run.Suite("short", [sys.executable, "-c", "import time; time.sleep(1)"])
    monkeypatch.setattr(run, "phases", lambda extra=None: [[suite]])

    def interrupted(suites: list[run.Suite]) -> None:
        for s in suites:
            s.start()
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_together", interrupted)
    assert run.main() == 130
    assert suite.proc is not None and suite.proc.returncode == 0
    assert "[run] interrupted" in capsys.readouterr().out
