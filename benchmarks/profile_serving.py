"""Where the project's server spends its CPU: py-spy on the Serve processes under load.

    python -m benchmarks.profile_serving [--variant project] [--concurrency 32] [--seconds 20]

Starts one server (as ``serving_overhead`` does), drives a closed loop of
streamed chat completions at it, and samples the Serve proxy, the ingress
replica and the LLMServer replica with ``py-spy record`` (non-blocking) at the
same time. Prints, per process, its CPU share and where its samples fall by
package (Ray Serve, Ray core, vLLM, Starlette/FastAPI, the project's guard,
asyncio, JSON ...) plus the top functions by own time. Writes the raw
collapsed stacks to benchmarks/results/profile-<variant>-<process>.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.serving_overhead import (
    RESULTS,
    build_model,
    cpu_by_role,
    process_role,
    run_load,
    start,
)

PROFILED_ROLES = ("Serve proxy", "Serve ingress replica", "Serve LLMServer replica", "vLLM API server")

# First match wins: a frame's file path decides its bucket.
BUCKETS = (
    ("inference_server/", "project (guard, app)"),
    ("ray/serve/_private/proxy", "Ray Serve proxy"),
    ("ray/serve/_private/replica", "Ray Serve replica"),
    ("ray/serve/_private/router", "Ray Serve router/handle"),
    ("ray/serve/_private/request_router", "Ray Serve router/handle"),
    ("ray/serve/handle", "Ray Serve router/handle"),
    ("ray/serve/", "Ray Serve (other)"),
    ("ray/llm/", "Ray Serve LLM"),
    ("ray/_raylet", "Ray core (raylet bindings)"),
    ("ray/_private/", "Ray core"),
    ("ray/", "Ray (other)"),
    ("vllm/", "vLLM"),
    ("starlette/", "Starlette/FastAPI"),
    ("fastapi/", "Starlette/FastAPI"),
    ("uvicorn/", "uvicorn"),
    ("pydantic", "pydantic"),
    ("json/", "json"),
    ("asyncio/", "asyncio"),
    ("grpc", "gRPC"),
)


def bucket_of(frame: str) -> str:
    for needle, name in BUCKETS:
        if needle in frame:
            return name
    return "other"


def summarize(raw: Path, top: int = 12) -> str:
    """Self-time by bucket and by function from py-spy's collapsed ("raw") output."""
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
        # Own time goes to the innermost Python frame that is not the event loop's idle wait.
        leaf = frames[-1]
        by_function[leaf] += count
        # Bucket: the innermost frame that is not plain asyncio, so callbacks count where they belong.
        owner = next((f for f in reversed(frames) if bucket_of(f) not in ("asyncio", "other")), leaf)
        by_bucket[bucket_of(owner)] += count
    if not total:
        return "  (no samples)"
    lines = ["  by package (innermost non-asyncio frame):"]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_bucket.most_common(top)]
    lines.append("  top functions by own samples:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in by_function.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_serving", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="project")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=20)
    args = parser.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    work = Path(tempfile.mkdtemp(prefix="bench_profile_", dir="/tmp"))
    model_dir = build_model(work)
    server = start(args.variant, work, model_dir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(run_load(server, 8, 16))
        targets = {pid: process_role(pid) for pid in server.pids()}
        targets = {pid: role for pid, role in targets.items() if role in PROFILED_ROLES}
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                asyncio.run(run_load(server, args.concurrency, args.concurrency * 4))

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(2)
        cpu_before = cpu_by_role(server.pids())
        outputs: dict[int, Path] = {}
        spies = []
        for pid, role in targets.items():
            out = RESULTS / f"profile-{args.variant}-{role.split()[1].lower()}-{pid}.txt"
            outputs[pid] = out
            spies.append(
                subprocess.Popen(
                    [
                        pyspy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(args.seconds),
                        "--rate",
                        "50",
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for spy in spies:
            spy.wait(timeout=args.seconds + 60)
        cpu_after = cpu_by_role(server.pids())
        stop.set()
        loader.join(timeout=120)
        seconds = float(args.seconds)
        print(f"{args.variant} at c={args.concurrency}: CPU share of one core by process over {seconds:.0f}s")
        for role in sorted(cpu_after, key=lambda r: -(cpu_after[r] - cpu_before.get(r, 0.0))):
            print(f"  {role:<32} {(cpu_after[role] - cpu_before.get(role, 0.0)) / seconds:6.1%}")
        for pid, role in targets.items():
            print(f"\n{role} (pid {pid}): {outputs[pid]}")
            print(summarize(outputs[pid]) if outputs[pid].is_file() else "  (py-spy wrote nothing)")
    finally:
        server.child.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
