"""The local runs' guard against a process the host's kernel leaves in sched_setaffinity (localserve.affinity_hang).

The hang itself can not be made on demand, so these watch real child
processes blocked in another call (read on a pipe, nanosleep) through the
same /proc readers, with the watched call's number swapped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from localserve import affinity_hang
from localserve.affinity_hang import (
    SCHED_SETAFFINITY,
    AffinityHangBreaker,
    Killed,
    Stuck,
    Unstarved,
    blocked_syscall,
)
from localserve.processes import stat_fields, threads

READ = 0  # x86_64's read(2); the children below block in it
pytestmark = pytest.mark.skipif(SCHED_SETAFFINITY != 203, reason="the numbers below are x86_64's")


@pytest.fixture
def reader() -> Iterator[subprocess.Popen[bytes]]:
    """A child blocked in read(2) on an empty pipe."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(1)"], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while blocked_syscall(child.pid) != READ and time.monotonic() < deadline:
        time.sleep(0.05)
    yield child
    child.kill()
    child.wait()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    time.sleep(0.3)
    yield child
    child.kill()
    child.wait()


def test_blocked_syscall_reads_the_call_a_child_waits_in(reader: subprocess.Popen[bytes]) -> None:
    assert blocked_syscall(reader.pid) == READ
    assert blocked_syscall(2**22 + 12345) is None  # no such process


def test_a_child_blocked_past_the_limit_is_killed_and_reported(
    reader: subprocess.Popen[bytes], sleeper: subprocess.Popen[bytes]
) -> None:
    reports: list[Killed] = []
    breaker = AffinityHangBreaker(reports.append, syscall=READ, after_s=10)
    start = time.monotonic()
    assert breaker.scan(start) == []
    assert breaker.scan(start + 9) == []  # blocked 9 s: under the limit
    assert reader.poll() is None
    killed = breaker.scan(start + 10)
    assert [k.pid for k in killed] == [reader.pid] and killed[0].name.startswith("python")
    assert killed[0].blocked_s == pytest.approx(10)
    assert reader.wait(5) == -9
    assert sleeper.poll() is None  # blocked too, in another call
    assert reports == killed and "sched_setaffinity" in killed[0].line()


def test_the_clock_starts_again_when_the_call_returned(reader: subprocess.Popen[bytes]) -> None:
    breaker = AffinityHangBreaker(lambda _: None, syscall=READ, after_s=10)
    start = time.monotonic()
    breaker.scan(start)
    assert reader.stdin is not None
    reader.stdin.write(b"x")
    reader.stdin.close()
    reader.wait(5)
    assert breaker.scan(start + 5) == []
    assert breaker._since == {}


def test_only_descendants_are_watched(reader: subprocess.Popen[bytes]) -> None:
    breaker = AffinityHangBreaker(lambda _: None, root=reader.pid, syscall=READ, after_s=0)
    assert breaker.scan() == [] and reader.poll() is None  # the root itself is not its own descendant


def test_the_thread_kills_within_its_scan_interval(reader: subprocess.Popen[bytes]) -> None:
    reports: list[Killed] = []
    with AffinityHangBreaker(reports.append, syscall=READ, after_s=0.5, every_s=0.2):
        assert reader.wait(10) == -9
    assert [k.pid for k in reports] == [reader.pid]


def test_a_thread_other_than_the_main_one_blocked_past_the_limit_kills_its_process() -> None:
    """A Ray actor runs its constructor (and its imports) off the main thread: the call can hang there."""
    code = (
        "import sys, threading, time; threading.Thread(target=lambda: sys.stdin.buffer.read(1)).start(); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not any(blocked_syscall(child.pid, t) == READ for t in threads(child.pid)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert blocked_syscall(child.pid) != READ  # the main thread sleeps
        breaker = AffinityHangBreaker(lambda _: None, syscall=READ, after_s=5)
        start = time.monotonic()
        breaker.scan(start)
        assert [k.pid for k in breaker.scan(start + 5)] == [child.pid]
        assert child.wait(5) == -9
    finally:
        child.kill()
        child.wait()


def test_a_thread_in_uninterruptible_sleep_is_told_once_and_not_killed(
    reader: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uninterruptible sleep can not be made on demand here: the reader's threads are read as in it."""
    monkeypatch.setattr(affinity_hang, "thread_state", lambda pid, tid: ("D", "affine_move_task"))
    told: list[Stuck] = []
    breaker = AffinityHangBreaker(lambda _: None, on_stuck=told.append, stuck_s=60)
    start = time.monotonic()
    breaker.scan(start)
    breaker.scan(start + 59)
    assert told == []
    breaker.scan(start + 60)
    breaker.scan(start + 90)
    assert [(t.pid, t.wchan, t.syscall) for t in told] == [(reader.pid, "affine_move_task", READ)]
    assert "uninterruptible sleep 60s" in told[0].line() and reader.poll() is None


def test_a_thread_runnable_inside_the_call_gets_its_cpu_from_the_processes_bound_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside a vLLM engine bound to CPU 0 the call has stayed runnable for minutes, SIGKILL undelivered.

    A runnable thread stuck in the kernel can not be made on demand: a spinning
    child pinned to CPU 0 is runnable with its syscall file reading "running",
    and its stack is read as the one recorded (2026-12-06) for such a thread.
    A process bound to CPU 0 stands for the engine; one free to run anywhere
    must be left alone.
    """
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    bound = subprocess.Popen(["sleep", "60"])
    free = subprocess.Popen(["sleep", "60"])
    os.sched_setaffinity(spinner.pid, {0})
    os.sched_setaffinity(bound.pid, {0})
    os.sched_setaffinity(free.pid, {0, 1})
    recorded = (
        "[<0>] affine_move_task+0x1d2/0x5b0\n[<0>] __set_cpus_allowed_ptr+0x62/0xc0\n"
        "[<0>] __sched_setaffinity+0xb2/0x190\n[<0>] sched_setaffinity+0x16f/0x1f0\n"
    )
    monkeypatch.setattr(affinity_hang, "kernel_stack", lambda pid, tid: recorded if pid == spinner.pid else "")
    during: dict[int, str] = {}
    real_sleep = time.sleep

    def pause(seconds: float) -> None:
        # What the processes are while the starved thread gets its CPU (the pause, not the wait for the stop).
        if seconds == 0.2:
            for proc in (bound, free, spinner):
                state = affinity_hang.thread_state(proc.pid, proc.pid)
                during[proc.pid] = state[0] if state else "?"
        real_sleep(seconds)

    monkeypatch.setattr(affinity_hang.time, "sleep", pause)
    try:
        deadline = time.monotonic() + 10
        while blocked_syscall(spinner.pid) is not None or stat_fields(spinner.pid) is None:
            assert time.monotonic() < deadline, "the spinner never ran"
            real_sleep(0.05)
        actions: list[Killed | Unstarved] = []
        breaker = AffinityHangBreaker(actions.append, starved_s=5, pause_s=0.2)
        start = time.monotonic()
        assert breaker.scan(start) == [] and breaker.scan(start + 4) == []
        (done,) = breaker.scan(start + 5)
        assert isinstance(done, Unstarved) and actions == [done] == breaker.unstarved
        assert (done.pid, done.cpus, done.paused) == (spinner.pid, frozenset({0}), (bound.pid,))
        assert during == {bound.pid: "T", free.pid: "S", spinner.pid: "R"}
        # Resumed, and nothing killed: the starved thread needs its CPU, not an end.
        assert affinity_hang.thread_state(bound.pid, bound.pid)[0] != "T"  # type: ignore[index]
        assert spinner.poll() is None and bound.poll() is None and breaker.killed == []
        assert "for CPU 0; paused the processes bound there (pids " in done.line()
        # Still waiting: helped again after as long again.
        assert breaker.scan(start + 6) == [] and breaker.scan(start + 10) == [] and len(breaker.scan(start + 11)) == 1
    finally:
        for proc in (spinner, bound, free):
            proc.kill()
            proc.wait()


def test_a_runnable_thread_elsewhere_in_the_kernel_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    monkeypatch.setattr(affinity_hang, "kernel_stack", lambda pid, tid: "[<0>] ep_poll+0x1/0x2\n")
    try:
        breaker = AffinityHangBreaker(lambda _: None, after_s=0)
        start = time.monotonic()
        assert breaker.scan(start) == [] and breaker.scan(start + 60) == []
        assert spinner.poll() is None
    finally:
        spinner.kill()
        spinner.wait()
