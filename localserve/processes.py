"""Child processes for the local server: each in its own session, ended by process id.

Used by the end-to-end tests, the benchmarks and the local run. Never
`ray stop`: it ends every Ray process on the machine, other runs' included.
Teardown ends a child's whole session (Ray's raylet, workers and agents,
vLLM's engine processes) and any process that names its own Ray temp dir.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workloads.inference_server.catalog import WORKER_NICENESS_ENV

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "workloads"


# Ports this process has handed out: the kernel may give a just-released
# port again, and two components told the same port refuse to start.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


# /proc/<pid>/stat after the parenthesised command name (which may hold spaces
# and parentheses, hence the last ")"), 0-based: state, ppid, pgrp, session, ...
STAT_STATE = 0
STAT_PPID = 1
STAT_SESSION = 3
STAT_UTIME = 11
STAT_STIME = 12
STAT_NICE = 16
STAT_START_TIME = 19


def stat_fields(pid: int, tid: int | None = None) -> list[str] | None:
    """``pid``'s /proc/<pid>/stat fields after its command name (see STAT_*), or one thread's
    (/proc/<pid>/task/<tid>/stat); None once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (none once it is gone): a process may import torch, or be niced
    and pinned, from any of its threads."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()]
    except OSError:
        return []


def allowed_cpus(pid: int, tid: int) -> frozenset[int] | None:
    """The thread's ``Cpus_allowed_list`` as the kernel reports it; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return frozenset(parse_cpu_list(line.split(":", 1)[1].strip()))
    return None


def parse_cpu_list(text: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5] (the kernel's list format)."""
    cpus: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2} -> ``0,1,2``: a CPU set in the kernel's list format (without ranges)."""
    return ",".join(str(c) for c in sorted(cpus))


def process_name(pid: int) -> str | None:
    """``pid``'s executable name or the title it set (/proc/<pid>/comm, at most 15 characters), or None once gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return None


def every_process() -> Iterator[tuple[int, list[str]]]:
    """Every process on the machine with its stat fields (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            yield int(entry), fields


def with_descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for pid, fields in every_process():
        children.setdefault(int(fields[STAT_PPID]), []).append(pid)
    found = set(roots)
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def session_members(sid: int) -> list[int]:
    """Process ids whose session id is ``sid`` (Linux /proc), zombies left out.

    A zombie has exited and holds nothing but its pid until its parent reaps
    it. Once a session's leader is gone its children's parent is this
    machine's init, which reaps them only every so often: counted, each stop
    sent them SIGKILL until its deadline (10 s after every Ray cluster).
    """
    return [
        pid
        for pid, fields in every_process()
        if len(fields) > STAT_SESSION and int(fields[STAT_SESSION]) == sid and fields[STAT_STATE] != "Z"
    ]


def marked_processes(marker: str) -> list[int]:
    """Process ids whose command line names ``marker`` (our unique Ray temp dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


@dataclass
class Child:
    """A subprocess in its own session, with its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    marker: str | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log_path: Path, marker: str | None = None) -> Child:
        log = open(log_path, "wb")  # noqa: SIM115 - closed when the child is stopped
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        return cls(name, proc, log_path, marker)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0, stop_signal: signal.Signals = signal.SIGTERM) -> None:
        """Signal the leader (SIGTERM unless told), wait ``grace_s``, then SIGKILL what is left of its session."""
        sid = self.proc.pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        deadline = time.monotonic() + 10
        while True:
            left = set(session_members(sid))
            if self.marker:
                left |= set(marked_processes(self.marker))
            left.discard(os.getpid())
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKLOADS), env.get("PYTHONPATH", "")) if p)
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            # vLLM's engine processes talk over this address: keep it on loopback.
            "VLLM_HOST_IP": "127.0.0.1",
            # What the GPU nodes' containers set: the replicas' vLLM servers at
            # the normal priority, not Ray's nice 15 for workers.
            **WORKER_NICENESS_ENV,
        }
    )
    env.update(extra or {})
    return env
