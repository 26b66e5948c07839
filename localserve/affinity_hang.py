"""Ends a local process this host's kernel leaves blocked in ``sched_setaffinity``, so its parent starts it again.

Every process that imports torch pins itself to each CPU in turn: MKL counts
the cores at import (``MKL_Read_ThreadENV_Count_Cores``, seen with
``strace -f -k -e trace=sched_setaffinity python -c "import torch"``; no
MKL or OpenMP variable turns the probe off). The call takes microseconds,
but on the two-vCPU hosts the twins run on (kernel 6.18) it has stayed in
the kernel for minutes (``/proc/<pid>/stack``: ``affine_move_task``): day 2's
pending cluster then never started its replica and the run failed after its
420 s wait (docs/testing.md). Beside a vLLM engine whose threads are bound
to CPU 0 and serving, the call has also stayed there *runnable* (state ``R``,
``Cpus_allowed_list: 0``, stack in ``affine_move_task``), where
``/proc/<pid>/task/<tid>/syscall`` reads "running" and names no call: two of
eight ``import torch`` beside such an engine sat there over 180 s, and one
stayed ten minutes, SIGKILL pending and never delivered (2026-12-06). It is
waiting for CPU 0, which the engine's bound threads hold: pausing the
engine's processes for 0.3 s let each of 8 such threads seen through at once.

So the local runs watch their own processes, and for a thread in that call
longer than any real call takes (with a line saying what they did):

* asleep in it (its syscall file names the call): SIGKILL. Each process it
  has hit has a parent that starts it again: vLLM's server process
  (``VllmServer`` starts again a server that exits while starting), its
  engine core (the server exits with it), a Ray worker (Serve starts the
  replica again);
* runnable in it (found by its kernel stack): the watched processes with a
  thread bound to the CPUs it waits for are stopped for a moment
  (SIGSTOP, then SIGCONT), so it gets one of them. A request those hold is
  delayed by the pause, not failed.

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

from localserve.processes import (
    STAT_START_TIME,
    STAT_STATE,
    STAT_STIME,
    STAT_UTIME,
    allowed_cpus,
    cpu_list,
    process_name,
    stat_fields,
    threads,
    with_descendants,
)

# The system call's number per architecture (Linux' unistd tables).
SCHED_SETAFFINITY = {"x86_64": 203, "aarch64": 122}.get(platform.machine(), 203)
# A real call returns in microseconds; the hangs on record lasted minutes.
BLOCKED_AFTER_S = 20.0
# A thread runnable in the call this long waits for a CPU it will not get unaided
# (module docstring); the processes holding that CPU are paused this long.
STARVED_AFTER_S = 5.0
PAUSE_S = 0.3
STOP_WAIT_S = 1.0
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


# The kernel function a thread's stack shows while it is in the call, for a thread
# that is runnable there (its syscall file then reads "running").
KERNEL_ENTRY = {SCHED_SETAFFINITY: "sched_setaffinity"}


def kernel_stack(pid: int, tid: int) -> str:
    """A thread's kernel stack (/proc/<pid>/task/<tid>/stack: readable for one's own processes as root), or ""."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stack", encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def stack_in_call(pid: int, tid: int, syscall: int) -> bool:
    """Whether a thread's kernel stack is inside ``syscall``: how a thread runnable in it is known, its
    syscall file reading "running" (``blocked_syscall`` None)."""
    entry = KERNEL_ENTRY.get(syscall)
    return entry is not None and entry in kernel_stack(pid, tid)


def wait_channel(pid: int, tid: int) -> str | None:
    """The kernel function a thread waits in ("?" when it is not waiting); None once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/wchan", encoding="ascii", errors="replace") as handle:
            return handle.read().strip() or "?"
    except OSError:
        return None


def thread_state(pid: int, tid: int) -> tuple[str, str] | None:
    """A thread's scheduler state (``D``: uninterruptible, in the kernel) and the kernel function it waits in."""
    fields = stat_fields(pid, tid)
    wchan = wait_channel(pid, tid) if fields else None
    return None if not fields or wchan is None else (fields[STAT_STATE], wchan)


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
class Unstarved:
    """A thread left runnable in the watched call, waiting for CPUs that watched processes held: they were paused."""

    pid: int
    name: str
    waited_s: float
    cpus: frozenset[int]
    paused: tuple[int, ...]
    pause_s: float

    def line(self) -> str:
        cpus = ",".join(str(c) for c in sorted(self.cpus))
        if not self.paused:
            return (
                f"host kernel: pid {self.pid} ({self.name}) has waited {self.waited_s:.0f}s runnable in "
                f"sched_setaffinity for CPU {cpus}, and no process of this run is bound there (docs/testing.md)"
            )
        return (
            f"host kernel: pid {self.pid} ({self.name}) waited {self.waited_s:.0f}s runnable in sched_setaffinity "
            f"for CPU {cpus}; paused the processes bound there (pids {', '.join(map(str, self.paused))}) for "
            f"{self.pause_s:g}s so it could run (docs/testing.md)"
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
    """A thread that acts on this process' descendants with a thread left in ``syscall`` (module docstring):
    kills one asleep in it for ``after_s``, and pauses for ``pause_s`` those bound to the CPUs one runnable in it
    has waited ``starved_s`` for. ``on_stuck`` hears once of any other thread in uninterruptible sleep for
    ``stuck_s`` (what to look at when a local run waits for something that never comes)."""

    def __init__(
        self,
        on_action: Callable[[Killed | Unstarved], None],
        *,
        on_stuck: Callable[[Stuck], None] | None = None,
        root: int | None = None,
        syscall: int = SCHED_SETAFFINITY,
        after_s: float = BLOCKED_AFTER_S,
        starved_s: float = STARVED_AFTER_S,
        pause_s: float = PAUSE_S,
        stuck_s: float = STUCK_AFTER_S,
        every_s: float = SCAN_EVERY_S,
    ) -> None:
        self._on_action = on_action
        self._on_stuck = on_stuck
        self._stuck_s = stuck_s
        # (pid, tid) -> when first seen in uninterruptible sleep; and those already reported.
        self._asleep: dict[tuple[int, int], float] = {}
        self._told: set[tuple[int, int]] = set()
        self._root = os.getpid() if root is None else root
        self._syscall = syscall
        self._after_s = after_s
        self._starved_s = starved_s
        self._pause_s = pause_s
        self._every_s = every_s
        # (pid, start time) -> when it was first seen blocked; the start time tells a reused pid apart.
        self._since: dict[tuple[int, str], float] = {}
        # (pid, start time, tid) -> when the thread was first seen runnable in the call.
        self._waiting: dict[tuple[int, str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="affinity-hang-breaker", daemon=True)
        self.killed: list[Killed] = []
        self.unstarved: list[Unstarved] = []

    def scan(self, now: float | None = None) -> list[Killed | Unstarved]:
        """One look at every descendant; acts on those left in the call long enough and returns what it did."""
        now = time.monotonic() if now is None else now
        seen: dict[tuple[int, str], float] = {}
        waiting: dict[tuple[int, str, int], float] = {}
        done: list[Killed | Unstarved] = []
        asleep: dict[tuple[int, int], float] = {}
        descendants = with_descendants({self._root}) - {self._root}
        for pid in descendants:
            tids = threads(pid)
            if self._on_stuck is not None:
                self._watch_sleep(pid, tids, now, asleep)
            calls = {tid: blocked_syscall(pid, tid) for tid in tids}
            blocked = self._syscall in calls.values()
            running = [] if blocked else [t for t, call in calls.items() if call is None]
            runnable = [t for t in running if stack_in_call(pid, t, self._syscall)]
            if not blocked and not runnable:
                continue
            fields = stat_fields(pid)
            if fields is None:
                continue
            name = process_name(pid) or "?"
            for tid in runnable:
                key3 = (pid, fields[STAT_START_TIME], tid)
                since = waiting[key3] = self._waiting.get(key3, now)
                if now - since >= self._starved_s:
                    done.append(self._unstarve(pid, tid, name, now - since, descendants))
                    del waiting[key3]  # the clock starts again: a thread still waiting is helped again
            if not blocked:
                continue
            key = (pid, fields[STAT_START_TIME])
            since = seen[key] = self._since.get(key, now)
            if now - since >= self._after_s:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    done.append(Killed(pid, name, now - since))
                del seen[key]
        self._since = seen
        self._waiting = waiting
        self._asleep = asleep
        for item in done:
            if isinstance(item, Killed):
                self.killed.append(item)
            else:
                self.unstarved.append(item)
            self._on_action(item)
        return done

    def _unstarve(self, pid: int, tid: int, name: str, waited_s: float, descendants: set[int]) -> Unstarved:
        """Pause the watched processes with a thread bound inside the CPUs ``tid`` waits for, then resume them."""
        cpus = allowed_cpus(pid, tid) or frozenset()

        def bound_inside(other: int) -> bool:
            masks = (allowed_cpus(other, t) for t in threads(other))
            return any(mask is not None and mask <= cpus for mask in masks)

        bound = sorted(other for other in descendants - {pid} if cpus and bound_inside(other))
        paused = []
        try:
            for other in bound:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGSTOP)
                    paused.append(other)
            # A process stops when it next runs in the kernel: the pause counts from then.
            deadline = time.monotonic() + STOP_WAIT_S
            while paused and time.monotonic() < deadline:
                if all((stat_fields(other) or ["T"])[STAT_STATE] in "tT" for other in paused):
                    break
                time.sleep(0.01)
            if paused:
                time.sleep(self._pause_s)
        finally:
            for other in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGCONT)
        return Unstarved(pid, name, waited_s, cpus, tuple(paused), self._pause_s)

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
            stat, wchan = stat_fields(pid, tid), wait_channel(pid, tid)
            if not stat or wchan is None or (stat[STAT_STATE] == "S" and wchan in idle_waits):
                continue
            mask = allowed_cpus(pid, tid)
            if mask is None:
                continue
            user, system = (int(stat[i]) / os.sysconf("SC_CLK_TCK") for i in (STAT_UTIME, STAT_STIME))
            lines.append(
                f"pid {pid} ({name}) thread {tid}: state {stat[STAT_STATE]}, system call {blocked_syscall(pid, tid)}, "
                f"waits in {wchan}, CPUs {cpu_list(mask)}, user {user:.1f}s system {system:.1f}s"
            )
    return lines
