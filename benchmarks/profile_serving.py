"""Where a server's time goes under load: per-process CPU, where its threads ran, and py-spy stacks.

    python -m benchmarks.profile_serving [--variants project,bare] [--layout shared] [--rounds 4] [--concurrency 32]

Starts the variants as ``serving_overhead`` does and runs alternated cells of
vLLM's client against each. During every cell it samples, every 100 ms, the
CPU each thread of the variant's processes last ran on
(``/proc/<pid>/task/<tid>/stat``, field 39) and their CPU time, and records
the measured server's API server (and, for the project, its Serve replica
actor) with ``py-spy record --nonblocking``. Per cell it prints the
requests/s, each role's share of a core, how often the API server ran on the
same CPU as the forward pass, and, for the API server, where its samples fall
by package. Cells of the same variant that differ in speed can then be told
apart by what ran where. The raw stacks go to
benchmarks/results/profile-<variant>-r<round>-<role>.txt.

``--layout shared`` leaves the threads where the servers and the kernel put
them (what ``make local`` does); ``isolated`` is the benchmark's layout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import vllm_client
from benchmarks.pinning import Pinner, busy_shares, cpu_times
from benchmarks.server_tree import API_SERVER, ENGINE_CORE, FORWARD_PASS, process_role
from benchmarks.serving_overhead import (
    RESULTS,
    SETTLE_S,
    Server,
    apply_layout,
    build_model,
    client_target,
    cpu_by_role,
    start_all,
    stop_all,
)

PROFILED_ROLES = (API_SERVER, "Serve VllmServer replica", "Serve proxy", "Serve ingress replica")
SAMPLE_S = 0.1

# First match wins: a frame's file path decides its bucket.
BUCKETS = (
    ("inference_server/", "project (guard, replica)"),
    ("prometheus_client", "Prometheus client (metrics)"),
    ("ray/serve/", "Ray Serve"),
    ("ray/_raylet", "Ray core (raylet bindings)"),
    ("ray/_private/", "Ray core"),
    ("ray/", "Ray (other)"),
    ("vllm/entrypoints", "vLLM API server"),
    ("vllm/v1/engine", "vLLM engine client"),
    ("vllm/", "vLLM (other)"),
    ("starlette/", "Starlette/FastAPI"),
    ("fastapi/", "Starlette/FastAPI"),
    ("uvicorn/", "uvicorn"),
    ("uvloop", "uvloop"),
    ("pydantic", "pydantic"),
    ("zmq", "ZeroMQ"),
    ("json/", "json"),
    ("asyncio/", "asyncio"),
    ("threading.py", "threads (idle wait)"),
)


def bucket_of(frame: str) -> str:
    for needle, name in BUCKETS:
        if needle in frame:
            return name
    return "other"


def summarize(raw: Path, top: int = 8) -> str:
    """Samples by package (innermost frame that is not asyncio) and the top functions, from py-spy's raw output."""
    by_bucket: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        by_function[frames[-1]] += count
        owner = next((f for f in reversed(frames) if bucket_of(f) not in ("asyncio", "other")), frames[-1])
        by_bucket[bucket_of(owner)] += count
    if not total:
        return "    (no samples)"
    lines = [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_bucket.most_common(top)]
    lines.append("    top functions:")
    lines += [f"    {100 * n / total:5.1f}%  {name[:110]}" for name, n in by_function.most_common(top)]
    return "\n".join(lines)


def _thread_cpus(pid: int) -> dict[int, int]:
    """The CPU each thread of ``pid`` last ran on."""
    out = {}
    with contextlib.suppress(OSError):
        for tid in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (tid / "stat").read_text().rsplit(")", 1)[-1].split()
                # After the command name: state is field 3, processor is field 39.
                out[int(tid.name)] = int(fields[36])
    return out


def _busy_thread_cpu(pid: int, last: dict[int, int]) -> int | None:
    """The CPU of the thread of ``pid`` that used the most CPU since the last call (its main worker)."""
    best, best_ticks = None, -1
    with contextlib.suppress(OSError):
        for tid in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (tid / "stat").read_text().rsplit(")", 1)[-1].split()
                ticks = int(fields[11]) + int(fields[12])
                used = ticks - last.get(int(tid.name), ticks)
                last[int(tid.name)] = ticks
                if used > best_ticks:
                    best, best_ticks = int(fields[36]), used
    return best


class Sampler(threading.Thread):
    """Samples where the API server's, the engine core's and the forward pass's busiest threads run."""

    def __init__(self, tree: set[int]) -> None:
        super().__init__(daemon=True)
        self.pids = {
            role: pid for pid in tree if (role := process_role(pid)) in (API_SERVER, ENGINE_CORE, FORWARD_PASS)
        }
        self.stop = threading.Event()
        self.samples: list[dict[str, int | None]] = []
        self._last: dict[str, dict[int, int]] = {role: {} for role in self.pids}

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.samples.append({role: _busy_thread_cpu(pid, self._last[role]) for role, pid in self.pids.items()})

    def same_cpu(self, a: str, b: str) -> float:
        both = [s for s in self.samples if s.get(a) is not None and s.get(b) is not None]
        return sum(s[a] == s[b] for s in both) / len(both) if both else float("nan")

    def on_cpu(self, role: str) -> str:
        seen = Counter(s.get(role) for s in self.samples if s.get(role) is not None)
        total = sum(seen.values())
        return ", ".join(f"cpu{cpu} {n / total:.0%}" for cpu, n in sorted(seen.items())) if total else "n/a"


def profile_cell(
    server: Server,
    servers: dict[str, Server],
    model_dir: Path,
    pinner: Pinner,
    layout: str,
    concurrency: int,
    prompts: int,
    rnd: int,
    seconds: int,
) -> dict[str, Any]:
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    tree = server.server_tree()
    apply_layout(layout, tree, servers, pinner)
    time.sleep(SETTLE_S)
    pids = server.pids() | tree
    # The measured replica's API server, not the other replica's; every Serve process of the variant.
    targets = {
        pid: role
        for pid in pids
        if (role := process_role(pid)) in PROFILED_ROLES and (role != API_SERVER or pid in tree)
    }
    sampler = Sampler(tree)
    before, busy_before = cpu_by_role(pids), cpu_times()
    spies = {}
    for pid, role in targets.items():
        out = RESULTS / f"profile-{server.variant}-r{rnd + 1}-{role.split()[-1].lower()}-{pid}.txt"
        spies[pid] = (
            out,
            subprocess.Popen(
                [
                    *(pyspy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50"),
                    *("--nonblocking", "--format", "raw", "--output", str(out)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        )
    sampler.start()
    started = time.monotonic()
    result = vllm_client.run(client_target(server, model_dir), concurrency, prompts, RESULTS / "profile-client.log")
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join()
    busy = busy_shares(busy_before, cpu_times())
    after = cpu_by_role(pids)
    for _, spy in spies.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(timeout=seconds + 30)
    return {
        "variant": server.variant,
        "round": rnd + 1,
        "rps": float(result.get("request_throughput", 0.0)),
        "failed": int(result.get("failed", 0)),
        "cpu_share": {r: (after[r] - before.get(r, 0.0)) / wall for r in after if r != "gone"},
        "cpu_busy": busy,
        "api_with_forward": sampler.same_cpu(API_SERVER, FORWARD_PASS),
        "engine_with_forward": sampler.same_cpu(ENGINE_CORE, FORWARD_PASS),
        "where": {role: sampler.on_cpu(role) for role in sampler.pids},
        "stacks": {targets[pid]: str(out) for pid, (out, _) in spies.items()},
    }


def print_cell(cell: dict[str, Any]) -> None:
    shares = ", ".join(f"{r} {s:.0%}" for r, s in sorted(cell["cpu_share"].items(), key=lambda x: -x[1]) if s >= 0.01)
    print(
        f"\n{cell['variant']} round {cell['round']}: {cell['rps']:.1f} req/s (failed {cell['failed']}); "
        f"CPU busy {'/'.join(f'{b:.0%}' for b in cell['cpu_busy'])}",
        flush=True,
    )
    print(f"  share of a core: {shares}")
    print(
        f"  API server on the forward pass's CPU {cell['api_with_forward']:.0%} of samples, engine core "
        f"{cell['engine_with_forward']:.0%}; busiest thread's CPU: "
        + "; ".join(f"{r}: {w}" for r, w in cell["where"].items())
    )
    for role, path in cell["stacks"].items():
        print(f"  {role} ({path}):")
        print(summarize(Path(path)) if Path(path).is_file() else "    (py-spy wrote nothing)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_serving", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="project,bare")
    parser.add_argument("--layout", choices=("shared", "isolated"), default="shared")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=480)
    parser.add_argument("--seconds", type=int, default=6, help="py-spy's recording, from the cell's start")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench_profile_", dir="/tmp"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(work)
    vllm_client.warm_up()
    servers = start_all(variants, work, model_dir, args.replicas)
    pinner = Pinner()
    cells = []
    try:
        pinner.remember(set().union(*(s.pids() for s in servers.values())))
        for server in servers.values():
            vllm_client.run(client_target(server, model_dir), 8, 32, RESULTS / "profile-client.log")
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
            for variant in order:
                cell = profile_cell(
                    servers[variant],
                    servers,
                    model_dir,
                    pinner,
                    args.layout,
                    args.concurrency,
                    args.prompts,
                    rnd,
                    args.seconds,
                )
                cells.append(cell)
                print_cell(cell)
    finally:
        pinner.restore(set().union(*(s.pids() for s in servers.values())))
        stop_all(servers)
    (RESULTS / f"profile-{args.layout}.json").write_text(json.dumps(cells, indent=2) + "\n")
    print("\nrequests/s by round:")
    for variant in variants:
        print(f"  {variant}: " + ", ".join(f"{c['rps']:.1f}" for c in cells if c["variant"] == variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
