"""Ends a local process this host's kernel leaves blocked in ``sched_setaffinity``, so its parent starts it again.

Every process that imports torch pins itself to each CPU in turn: MKL counts
the cores at import (``MKL_Read_ThreadENV_Count_Cores``, seen with
``strace -f -k -e trace=sched_setaffinity python -c "import torch"``; no
MKL or OpenMP variable turns the probe off). The call takes microseconds,
but on the two-vCPU hosts the twins run on (kernel 6.18) it has stayed in
the kernel for minutes (``/proc/<pid>/stack``: ``affine_move_task``): day 2's
pending cluster then never started its replica and the run failed after its
420 s wait (docs/testing.md). SIGKILL ends such a process, and each process
it has hit has a parent that starts it again: vLLM's server process
(``VllmServer`` starts again a server that exits while starting), its engine
core (the server exits with it), a Ray worker (Serve starts the replica
again). The local runs therefore watch their own processes and kill one that
sits in that call longer than any real call takes, with a line saying so.
A production node's kernel is not this host's, and nothing here runs there.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localserve.processes import STAT_START_TIME, process_name, stat_fields, with_descendants

# The system call's number per architecture (Linux' unistd tables).
SCHED_SETAFFINITY = {"x86_64": 203, "aarch64": 122}.get(platform.machine(), 203)
# utime and stime in /proc/<pid>/task/<tid>/stat, counted after the command name (proc(5)).
STAT_UTIME, STAT_STIME = 11, 12
# A real call returns in microseconds; the hangs on record lasted minutes.
BLOCKED_AFTER_S = 20.0
# Any thread this long in uninterruptible sleep is said once (a read of a slow disk returns well within it).
STUCK_AFTER_S = 60.0
SCAN_EVERY_S = 2.0


def blocked_syscall(pid: int, tid: int | None = None) -> int | None:
    """The system call a thread of ``pid`` (its main thread by default) is blocked in
    (/proc/<pid>/task/<tid>/syscall), or None: running, gone, or not readable."""
    try:
        with open(f"/proc/{pid}/task/{tid or pid}/syscall", encoding="ascii", errors="replace") as handle:
            first = handle.read().split(maxsplit=1)
    except OSError:
        return None
    return int(first[0]) if first and first[0].lstrip("-").isdigit() else None


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (none once it is gone): a process may import torch from any of its threads."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []


def thread_state(pid: int, tid: int) -> tuple[str, str] | None:
    """A thread's scheduler state (``D``: uninterruptible, in the kernel) and the kernel function it waits in."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8", errors="replace") as handle:
            state = handle.read().rsplit(")", 1)[-1].split()[0]
        with open(f"/proc/{pid}/task/{tid}/wchan", encoding="ascii", errors="replace") as handle:
            return state, handle.read().strip() or "?"
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Stuck:
    """A thread that stayed in uninterruptible sleep long enough to say so (it is not killed for that)."""

    pid: int
    tid: int
    name: str
    syscall: int | None
    wchan: str
    seconds: float

    def line(self) -> str:
        return (
            f"host kernel: pid {self.pid} ({self.name}) thread {self.tid} has been in uninterruptible sleep "
            f"{self.seconds:.0f}s, in system call {self.syscall} at {self.wchan}"
        )


@dataclass(frozen=True)
class Killed:
    """A process ended because it stayed blocked in the watched call."""

    pid: int
    name: str
    blocked_s: float

    def line(self) -> str:
        return (
            f"host kernel: pid {self.pid} ({self.name}) sat {self.blocked_s:.0f}s in sched_setaffinity, which "
            "returns in microseconds; killed it so its parent starts it again (docs/testing.md)"
        )


class AffinityHangBreaker:
    """A thread that kills this process' descendants with a thread blocked in ``syscall`` for ``after_s`` or
    more; ``on_stuck`` hears once of any other thread in uninterruptible sleep for ``stuck_s`` (what to look
    at when a local run waits for something that never comes)."""

    def __init__(
        self,
        on_kill: Callable[[Killed], None],
        *,
        on_stuck: Callable[[Stuck], None] | None = None,
        root: int | None = None,
        syscall: int = SCHED_SETAFFINITY,
        after_s: float = BLOCKED_AFTER_S,
        stuck_s: float = STUCK_AFTER_S,
        every_s: float = SCAN_EVERY_S,
    ) -> None:
        self._on_kill = on_kill
        self._on_stuck = on_stuck
        self._stuck_s = stuck_s
        # (pid, tid) -> when first seen in uninterruptible sleep; and those already reported.
        self._asleep: dict[tuple[int, int], float] = {}
        self._told: set[tuple[int, int]] = set()
        self._root = os.getpid() if root is None else root
        self._syscall = syscall
        self._after_s = after_s
        self._every_s = every_s
        # (pid, start time) -> when it was first seen blocked; the start time tells a reused pid apart.
        self._since: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="affinity-hang-breaker", daemon=True)
        self.killed: list[Killed] = []

    def scan(self, now: float | None = None) -> list[Killed]:
        """One look at every descendant; kills those blocked long enough and returns them."""
        now = time.monotonic() if now is None else now
        seen: dict[tuple[int, str], float] = {}
        killed = []
        asleep: dict[tuple[int, int], float] = {}
        for pid in with_descendants({self._root}) - {self._root}:
            tids = threads(pid)
            if self._on_stuck is not None:
                self._watch_sleep(pid, tids, now, asleep)
            if self._syscall not in {blocked_syscall(pid, tid) for tid in tids}:
                continue
            fields = stat_fields(pid)
            if fields is None:
                continue
            key = (pid, fields[STAT_START_TIME])
            since = seen[key] = self._since.get(key, now)
            if now - since >= self._after_s:
                name = process_name(pid) or "?"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(Killed(pid, name, now - since))
                del seen[key]
        self._since = seen
        self._asleep = asleep
        for item in killed:
            self.killed.append(item)
            self._on_kill(item)
        return killed

    def _watch_sleep(self, pid: int, tids: list[int], now: float, asleep: dict[tuple[int, int], float]) -> None:
        assert self._on_stuck is not None
        for tid in tids:
            state = thread_state(pid, tid)
            if state is None or state[0] != "D":
                continue
            key = (pid, tid)
            since = asleep[key] = self._asleep.get(key, now)
            if now - since >= self._stuck_s and key not in self._told:
                self._told.add(key)
                name = process_name(pid) or "?"
                self._on_stuck(Stuck(pid, tid, name, blocked_syscall(pid, tid), state[1], now - since))

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            with contextlib.suppress(OSError, ValueError):
                self.scan()

    def start(self) -> AffinityHangBreaker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> AffinityHangBreaker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def thread_lines(pids: set[int]) -> list[str]:
    """One line per thread of ``pids`` that is not idle: what to read when a start never finishes.

    Idle is asleep (``S``) in a wait a process makes when it has nothing to
    do (epoll, futex, a pipe); every other thread is listed with its state,
    system call, kernel wait channel, the CPUs it may run on and the CPU
    time it used, so a thread spinning, starved or blocked in the kernel
    shows which.
    """
    idle_waits = {"do_epoll_wait", "futex_wait_queue", "futex_wait_queue_me", "pipe_read", "do_select", "do_sys_poll"}
    lines = []
    for pid in sorted(pids):
        name = process_name(pid) or "?"
        for tid in sorted(threads(pid)):
            state = thread_state(pid, tid)
            if state is None or (state[0] == "S" and state[1] in idle_waits):
                continue
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text(errors="replace").rsplit(")", 1)[-1].split()
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text(errors="replace")
            except OSError:
                continue
            allowed = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list")]
            cpus = allowed[0].split(":", 1)[1].strip() if allowed else "?"
            user, system = (int(stat[i]) / os.sysconf("SC_CLK_TCK") for i in (STAT_UTIME, STAT_STIME))
            lines.append(
                f"pid {pid} ({name}) thread {tid}: state {state[0]}, system call {blocked_syscall(pid, tid)}, "
                f"waits in {state[1]}, CPUs {cpus}, user {user:.1f}s system {system:.1f}s"
            )
    return lines
