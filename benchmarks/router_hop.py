"""The router hop's own CPU: vllm-router and its front, as prod's render runs them, in front of a stand-in replica.

    python -m benchmarks.router_hop [--threads rendered,1,2] [--front-workers rendered] [--concurrency 32]
                                    [--requests 1000] [--rounds 3] [--layout shared|pinned] [--out FILE]

What the routed layout adds over the default one is a hop through two
processes (nginx, then vllm-router), each woken once for every chunk of
every streamed answer. Their CPU is what the router's HorizontalPodAutoscaler
pays for in router pods, and on the benchmark machine it is what they take
from the load generator's core. `serving_overhead` measures it among a real
server's noise; here the replica is a stand-in that streams ``--events``
chunks ``--gap-ms`` apart (vLLM's pace for a small model), so what is left
is the hop, measured precisely enough to compare its settings.

Each setting is a count of the router's runtime threads (its
``TOKIO_WORKER_THREADS``) and of its front's nginx workers; ``rendered`` is
what prod's stack renders. For each one the router and its front are started
from prod's rendered command and front config (twin/routing.py), the counts
swapped in, a keep-alive client sends ``--requests``
streamed completions at ``--concurrency``, and the report gives the router's
and the front's CPU per request and per chunk, from /proc, over rounds.

Each round also sends the same requests to the stand-in directly, before or
after the hop's (alternated), so the report gives the hop's latency too: the
rate through it over the rate without it, and the milliseconds it adds to a
request at that concurrency. With the client on the hop's core (``pinned``)
that is what the routed cell of `serving_overhead` pays for the hop at
c=8, where the rate follows each request's time, with the real server's
noise taken away.

Layouts: ``shared`` lets the router and its front run on every core (as a
pod whose limit is above its request may); ``pinned`` holds them and the
client on core 0 and the stand-in on the last core, as `serving_overhead`
lays out its routed cell.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.server_tree import ROUTER, ROUTER_FRONT  # noqa: E402
from benchmarks.serving_overhead import cpu_by_role  # noqa: E402
from localserve.processes import free_port, with_descendants  # noqa: E402
from twin.routing import RouterSpec  # noqa: E402

# One streamed event as vLLM's completions route writes it for one token.
EVENT = (
    b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m",'
    b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
# The stand-in's pace: about a small model's time per output token on a CPU.
DEFAULT_EVENTS = 32
DEFAULT_GAP_MS = 5.0
# Requests before each setting's rounds (connections opened, the router's pool warm).
WARMUP_REQUESTS = 200
STANDIN_READY_S = 30.0


def stand_in(port: int, events: int, gap_ms: float) -> None:
    """A replica that answers /health and streams ``events`` chunks and [DONE] to every completion."""
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def completion(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(events):
            await response.write(EVENT)
            await asyncio.sleep(gap_ms / 1e3)
        await response.write(DONE)
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completion)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def drive(url: str, concurrency: int, requests: int) -> tuple[float, int]:
    """``requests`` streamed completions at ``concurrency`` over keep-alive connections: seconds, chunks read."""
    import aiohttp

    left = requests
    chunks = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left, chunks
        while left > 0:
            left -= 1
            # The stand-in decides how long the answer is (--events).
            body = {"model": "m", "prompt": "hello", "stream": True}
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"the hop answered {response.status}: {(await response.text())[:200]}")
                async for line in response.content:
                    chunks += line.startswith(b"data: ")

    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return time.monotonic() - started, chunks


@dataclass
class HopRound:
    """One round of one setting: the hop's CPU per request and per chunk, and the rate the client got."""

    threads: int
    layout: str
    front_workers: int
    requests: int
    chunks: int
    seconds: float
    router_us_per_request: float
    front_us_per_request: float
    # The same requests sent to the stand-in without the hop, in the same round.
    direct_seconds: float
    concurrency: int

    @property
    def hop_us_per_chunk(self) -> float:
        return (self.router_us_per_request + self.front_us_per_request) * self.requests / max(1, self.chunks)

    @property
    def rate_vs_direct(self) -> float:
        """Requests/s through the hop over requests/s without it."""
        return self.direct_seconds / self.seconds

    @property
    def added_ms_per_request(self) -> float:
        """What the hop adds to each request's time: with ``concurrency`` in flight, the rate is c over it."""
        return (self.seconds - self.direct_seconds) * self.concurrency / self.requests * 1e3


@functools.cache
def prod_router() -> RouterSpec:
    """The router prod's stack renders (its first vllm-server service's), rendered once a process."""
    from twin.routing import router_specs

    return next(iter(router_specs(REPO / "Pulumi.prod.yaml").values()))


def measure(threads: int, workers: int, args: argparse.Namespace, replica: str, rounds: list[HopRound]) -> None:
    """Starts the rendered router with ``threads`` runtime threads, its front with ``workers``, and runs its rounds."""
    from infra.serving.router import RUNTIME_THREADS_ENV
    from twin.routing import start_router

    spec = prod_router()
    env = {**spec.env, RUNTIME_THREADS_ENV: str(threads)}
    front = replace(spec.front, workers=workers)
    with tempfile.TemporaryDirectory(prefix="router-hop-") as scratch:
        router, _ = start_router(spec.command, [replica], Path(scratch) / "router.log", front, env=env)
        try:
            pids = with_descendants({router.child.proc.pid, router.front.proc.pid})
            if args.layout == "pinned":
                for pid in pids | {os.getpid()}:
                    os.sched_setaffinity(pid, {0})
            url = f"{router.base_url}/completions"
            direct = f"{replica}/v1/completions"
            asyncio.run(drive(url, args.concurrency, WARMUP_REQUESTS))
            asyncio.run(drive(direct, args.concurrency, WARMUP_REQUESTS))
            for index in range(args.rounds):
                # Before the hop's requests or after them, alternated, so a drift of the machine falls on both alike.
                direct_first = index % 2 == 1
                direct_seconds = _direct_round(direct, args) if direct_first else 0.0
                before = cpu_by_role(pids)
                seconds, chunks = asyncio.run(drive(url, args.concurrency, args.requests))
                after = cpu_by_role(pids)
                if not direct_first:
                    direct_seconds = _direct_round(direct, args)
                used = {role: (after.get(role, 0.0) - before.get(role, 0.0)) * 1e6 / args.requests for role in after}
                hop = HopRound(
                    threads,
                    args.layout,
                    workers,
                    args.requests,
                    chunks,
                    seconds,
                    used.get(ROUTER, 0.0),
                    used.get(ROUTER_FRONT, 0.0),
                    direct_seconds,
                    args.concurrency,
                )
                rounds.append(hop)
                print(
                    f"[router-hop] threads={threads} front workers={workers} {args.layout}: "
                    f"router {hop.router_us_per_request:6.0f} us/request, "
                    f"front {hop.front_us_per_request:6.0f} us/request, "
                    f"hop {hop.hop_us_per_chunk:5.1f} us/chunk, "
                    f"{args.requests / seconds:6.1f} requests/s "
                    f"({hop.rate_vs_direct:.3f}x direct, {hop.added_ms_per_request:+.1f} ms a request)",
                    flush=True,
                )
        finally:
            router.stop()
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def _direct_round(url: str, args: argparse.Namespace) -> float:
    """Seconds the round's requests take sent to the stand-in itself, every answer read whole."""
    seconds, chunks = asyncio.run(drive(url, args.concurrency, args.requests))
    if chunks != args.requests * (args.events + 1):
        raise RuntimeError(f"the stand-in answered {chunks} chunks to {args.requests} requests")
    return seconds


def summary(rounds: list[HopRound]) -> list[str]:
    """Each setting's medians over its rounds, with their spread."""
    lines = []
    for threads, workers in dict.fromkeys((r.threads, r.front_workers) for r in rounds):
        mine = [r for r in rounds if (r.threads, r.front_workers) == (threads, workers)]
        router = [r.router_us_per_request for r in mine]
        front = [r.front_us_per_request for r in mine]
        lines.append(
            f"threads={threads} front workers={workers}: "
            f"router {statistics.median(router):.0f} us/request [{min(router):.0f}, {max(router):.0f}], "
            f"front {statistics.median(front):.0f} [{min(front):.0f}, {max(front):.0f}], "
            f"hop {statistics.median(r.hop_us_per_chunk for r in mine):.1f} us/chunk, "
            f"rate {statistics.median(r.rate_vs_direct for r in mine):.3f}x direct "
            f"[{min(r.rate_vs_direct for r in mine):.3f}, {max(r.rate_vs_direct for r in mine):.3f}], "
            f"{statistics.median(r.added_ms_per_request for r in mine):+.1f} ms a request ({len(mine)} rounds)"
        )
    return lines


def counts(option: str, text: str, rendered: int) -> list[int]:
    """``--threads`` or ``--front-workers``: counts, or ``rendered`` for the count prod's stack renders."""
    found = []
    for word in text.split(","):
        if word == "rendered":
            found.append(rendered)
        elif word.isdigit() and int(word) > 0:
            found.append(int(word))
        else:
            raise SystemExit(f"{option}: {word!r} is neither a positive count nor 'rendered'")
    return list(dict.fromkeys(found))


def thread_counts(text: str) -> list[int]:
    """``--threads``: the router's runtime threads."""
    from infra.serving.router import RUNTIME_THREADS_ENV

    return counts("--threads", text, int(prod_router().env[RUNTIME_THREADS_ENV]))


def worker_counts(text: str) -> list[int]:
    """``--front-workers``: the front's nginx workers."""
    return counts("--front-workers", text, prod_router().front.workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_hop", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="rendered,1,2", help="runtime thread counts, or 'rendered'")
    parser.add_argument("--front-workers", default="rendered", help="the front's nginx workers, or 'rendered'")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=1000, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS, help="chunks in each answer")
    parser.add_argument("--gap-ms", type=float, default=DEFAULT_GAP_MS, help="between the stand-in's chunks")
    parser.add_argument("--layout", choices=("shared", "pinned"), default="shared")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--stand-in", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stand_in is not None:
        stand_in(args.stand_in, args.events, args.gap_ms)
        return 0
    threads = thread_counts(args.threads)
    workers = worker_counts(args.front_workers)
    port = free_port()
    argv_in = [sys.executable, "-m", "benchmarks.router_hop", "--stand-in", str(port)]
    argv_in += ["--events", str(args.events), "--gap-ms", str(args.gap_ms)]
    replica = subprocess.Popen(argv_in, cwd=REPO)
    rounds: list[HopRound] = []
    try:
        if args.layout == "pinned":
            os.sched_setaffinity(replica.pid, {(os.cpu_count() or 1) - 1})
        deadline = time.monotonic() + STANDIN_READY_S
        while not _answers(f"http://127.0.0.1:{port}/health"):
            if replica.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("router_hop: the stand-in replica did not start")
            time.sleep(0.2)
        for count in threads:
            for front in workers:
                measure(count, front, args, f"http://127.0.0.1:{port}", rounds)
    finally:
        replica.terminate()
        replica.wait(timeout=10)
    for line in summary(rounds):
        print(f"[router-hop] {line}")
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rounds], indent=1))
    return 0


def _answers(url: str) -> bool:
    from twin.live import status_of

    try:
        return status_of(url) == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
