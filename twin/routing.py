"""The request router in the twin: vllm-router in front of a model's live replicas, and its balance check.

The router's command line is the one the render gives its Deployment
(infra/serving/router.router_args, from the stack's `serving.routing`),
with one substitution, printed: Kubernetes discovery (`--service-discovery`,
`--selector`, ...) becomes `--worker-urls` with the replicas' own server
addresses, because the twin has no API server to list pods from. Which pods
that selector picks among the pods KubeRay builds is checked in
tests/test_selectors.py; here the router itself runs, on loopback ports.

The router runs behind its front, nginx with the config the render mounts
in the router pod (infra/serving/router_front.py), on Debian's nginx, with
loopback addresses and a scratch directory: what a client reaches is what
the load balancer reaches in the cluster.

The check is the one an NLB fails: one client with a keep-alive pool at
steady load. An NLB balances connections, so that client's requests stay on
the replicas its few connections landed on; the router balances requests.
The client sends whole-answer (non-streamed) requests: openai's sync stream
drops its connection at `[DONE]` (localserve/traffic.py), which would hide
the keep-alive it is meant to show.

The twin's replicas share two cores, so one is often several times faster
than the other, and a least-loaded policy rightly sends it more: the split
under the stack's policy is printed, not held to a ratio. The ratio (busiest
over idlest at most 1.2) is held on the same router with `round_robin`,
which spreads by request whatever the replicas' speed; what the router
adds over a network load balancer is that spreading, which does not depend
on the client's connections.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from infra.serving.router_front import READINESS_PATH, FrontAddresses, FrontPlan
from localserve.processes import Child, child_env, free_port
from twin.live import status_of
from workloads.inference_server.gateway_settings import GatewaySettings

HOST = "127.0.0.1"
# The console script the image runs, and the module behind it (the wheel's entry_points.txt).
ROUTER_SCRIPT = "vllm-router"
ROUTER_MODULE = "vllm_router.launch_router"
# The discovery flags and how many values each takes (None: every word up to the next flag).
DISCOVERY_FLAGS: dict[str, int | None] = {
    "--service-discovery": 0,
    "--service-discovery-namespace": 1,
    "--service-discovery-port": 1,
    "--selector": None,
}
# Replaced with loopback ones: the pod's own address and ports.
ADDRESS_FLAGS = ("--host", "--port", "--prometheus-host", "--prometheus-port")
READY_TIMEOUT_S = 60.0
# Debian's nginx (scripts/system-deps.sh), where root's PATH may not reach it.
NGINX_FALLBACK = "/usr/sbin/nginx"
# How long a stopping front may take to finish the requests it holds.
FRONT_STOP_S = 10.0
# Steady load from one client: its pool's connections, and the requests it sends.
BALANCE_CONCURRENCY = 8
BALANCE_REQUESTS = 120
# The busiest replica's requests over the idlest's, with two replicas, under round_robin.
MAX_IMBALANCE = 1.2
SUCCESS_SERIES = re.compile(r"^vllm[:_]request_success_total\{[^}]*\} (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class RouterSpec:
    """The router the render runs (or, with routing off, would run) in front of one vllm-server service."""

    service: str
    command: tuple[str, ...]
    # Whether the stack turns it on (`serving.routing.enabled`).
    enabled: bool
    # Its front, the nginx the load balancer reaches.
    front: FrontPlan
    # The router container's environment as rendered (RouterPlan.env).
    env: Mapping[str, str]
    # The model gateway's settings as the render writes them (or, with `serving.gateway` off, would),
    # when the stack has several vllm-server services for it to route between or a model it wakes;
    # None otherwise.
    gateway: GatewaySettings | None = None
    # What its pod's readiness asks the router (RouterPlan.readiness_path).
    readiness_path: str = READINESS_PATH


def router_specs(stack_config: Path) -> dict[str, RouterSpec]:
    """Each vllm-server service's router command, from the stack file, as the render builds it."""
    from infra.config import load_stack_file
    from infra.serving.gateway import gateway_plan
    from infra.serving.router import router_plans

    cfg = load_stack_file(stack_config)
    plans = router_plans(cfg)
    gateway = gateway_plan(cfg).settings() if len(plans) > 1 or cfg.woken_services() else None
    return {
        service: RouterSpec(
            service,
            tuple(plan.command),
            cfg.serving.routing.enabled,
            plan.front,
            dict(plan.env),
            gateway,
            plan.readiness_path,
        )
        for service, plan in plans.items()
    }


def static_command(command: Sequence[str], worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """The rendered command with discovery swapped for ``worker_urls`` and the addresses for loopback ports.

    The image's `vllm-router` script is the package's `launch_router` module,
    run here with this interpreter, which has the release the image pins.
    """
    if command[0] != ROUTER_SCRIPT:
        raise ValueError(f"not a vllm-router command: {command[0]!r}")
    out: list[str] = [sys.executable, "-m", ROUTER_MODULE]
    words = list(command[1:])
    i = 0
    while i < len(words):
        word = words[i]
        if word in DISCOVERY_FLAGS:
            count = DISCOVERY_FLAGS[word]
            i += 1
            if count is None:
                while i < len(words) and not words[i].startswith("--"):
                    i += 1
            else:
                i += count
            continue
        if word in ADDRESS_FLAGS:
            i += 2
            continue
        out.append(word)
        i += 1
    return [
        *out,
        "--host",
        HOST,
        "--port",
        str(port),
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *worker_urls,
    ]


def nginx_binary() -> str:
    """Debian's nginx, on PATH or where the package puts it; one clear line when it is missing."""
    found = shutil.which("nginx") or (NGINX_FALLBACK if Path(NGINX_FALLBACK).exists() else None)
    if found is None:
        raise RuntimeError("nginx is not installed: scripts/system-deps.sh test installs it (Debian's nginx-light)")
    return found


@dataclass
class TwinRouter:
    """A running vllm-router on a loopback port, behind its front on another."""

    child: Child
    front: Child
    # The front's port: what clients reach.
    port: int
    # The router's own port, which in the pod only the front reaches.
    router_port: int
    scratch: tempfile.TemporaryDirectory[str]

    @property
    def base_url(self) -> str:
        """Its OpenAI base URL, through the front."""
        return f"http://{HOST}:{self.port}/v1"

    def stop(self) -> None:
        """Stops the front (gracefully, as the pod's stop signal does), then the router."""
        self.front.stop(grace_s=FRONT_STOP_S, stop_signal=signal.SIGQUIT)
        self.child.stop(grace_s=10)
        self.scratch.cleanup()


def start_front(
    front: FrontPlan, router_port: int, log_path: Path
) -> tuple[Child, int, tempfile.TemporaryDirectory[str]]:
    """Starts nginx with the front's config, listening on a free loopback port, in front of ``router_port``."""
    scratch = tempfile.TemporaryDirectory(prefix="router-front-")
    # Run as root (as CI runs), nginx's workers drop to `nobody`, which must
    # reach the temp directories the master makes (and hands them) in here.
    os.chmod(scratch.name, 0o755)
    port = free_port()
    conf = Path(scratch.name) / "nginx.conf"
    conf.write_text(front.config(FrontAddresses(f"{HOST}:{port}", f"{HOST}:{router_port}", scratch.name)))
    argv = [nginx_binary(), "-p", scratch.name, "-c", str(conf), "-e", "stderr", "-g", "daemon off;"]
    return Child.start("router-front", argv, child_env(), log_path), port, scratch


def start_router(
    command: Sequence[str],
    worker_urls: Sequence[str],
    log_path: Path,
    front: FrontPlan,
    readiness_path: str = READINESS_PATH,
    *,
    env: Mapping[str, str],
) -> tuple[TwinRouter, list[str]]:
    """Starts the router before ``worker_urls``, and its front; returns them and the router's command once
    its pod's readiness (``readiness_path``, RouterPlan.readiness_path) answers through the front.

    ``env`` is the router container's rendered environment (RouterSpec.env).
    """
    router_port = free_port()
    argv = static_command(command, worker_urls, router_port, free_port())
    child = Child.start("vllm-router", argv, child_env(dict(env)), log_path)
    front_child, port, scratch = start_front(front, router_port, log_path.with_name(log_path.stem + "-front.log"))
    router = TwinRouter(child, front_child, port, router_port, scratch)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for part in (router.child, router.front):
            if part.proc.poll() is not None:
                router.stop()
                raise RuntimeError(f"{part.name} exited with {part.proc.returncode}: {part.log_tail(5)}")
        with contextlib.suppress(OSError):
            # /readiness: 503 until it has a healthy replica to send to; through the front, as the kubelet asks.
            if status_of(f"http://{HOST}:{port}{readiness_path}") == 200:
                return router, argv
        time.sleep(0.5)
    router.stop()
    raise RuntimeError(f"vllm-router not ready after {READY_TIMEOUT_S:.0f}s: {router.child.log_tail(5)}")


class Discovery:
    """The router's Kubernetes discovery, as the twin stands in for it: replicas added and removed as they come and go.

    In the cluster the router watches the pods its selector names and adds a
    pod once it is Ready (its vLLM server answers /health). Here a replica
    writes its address once its server is healthy and deletes it when it
    stops (vllm_server.VllmServer), and this thread hands each change to the
    router's own worker routes (`/add_worker`, `/remove_worker`), on the
    router's port, which in the pod only the front reaches.
    """

    def __init__(self, router: TwinRouter, address_dir: Path, interval_s: float = 0.5) -> None:
        self.router_url = f"http://{HOST}:{router.router_port}"
        self.address_dir = address_dir
        self.interval_s = interval_s
        # (seconds since start, "add" or "remove", worker URL), in order.
        self.events: list[tuple[float, str, str]] = []
        self._known: set[str] = set()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="twin-discovery", daemon=True)

    def start(self) -> Discovery:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _replicas(self) -> set[str]:
        from localserve.server import replica_addresses

        return {str(r["url"]).removesuffix("/v1") for r in replica_addresses(self.address_dir)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = self._replicas()
            for verb, urls in (("add", now - self._known), ("remove", self._known - now)):
                for url in sorted(urls):
                    query = urllib.parse.urlencode({"url": url})
                    request = urllib.request.Request(f"{self.router_url}/{verb}_worker?{query}", method="POST")
                    with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=30) as answer:
                        answer.read()
                        self.events.append((time.monotonic() - self._started, verb, url))
                        self._known = self._known | {url} if verb == "add" else self._known - {url}


def served(metrics_url: str) -> float:
    """The requests a replica's vLLM server has answered (vLLM's own counter, every finish reason)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(v) for v in SUCCESS_SERIES.findall(text))


def one_client_at_steady_load(base_url: str, api_key: str, model_id: str) -> None:
    """One OpenAI client (one connection pool) sending whole answers, BALANCE_CONCURRENCY at a time."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)

    def ask(i: int) -> None:
        # Distinct prompts: no shared prefix for a cache-aware policy to follow.
        prompt = f"Request {i}: say something about the number {i * 7919 % 1000}."
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0
        )

    with ThreadPoolExecutor(BALANCE_CONCURRENCY) as pool:
        list(pool.map(ask, range(BALANCE_REQUESTS)))
    client.close()


@dataclass(frozen=True)
class Split:
    """How one router run spread the client's requests over the replicas."""

    policy: str
    counts: list[int]
    seconds: float


def with_policy(command: Sequence[str], policy: str) -> list[str]:
    """The command with its `--policy` replaced."""
    words = list(command)
    words[words.index("--policy") + 1] = policy
    return words


def remove_worker_status(port: int, worker_url: str) -> int:
    """The status of vllm-router's keyless control route that takes a replica out of rotation, at ``port``."""
    query = urllib.parse.urlencode({"url": worker_url})
    return status_of(f"http://{HOST}:{port}/remove_worker?{query}", method="POST")


@dataclass(frozen=True)
class RouterRun:
    """What one run of the router in front of the replicas showed."""

    split: Split
    # The status a request without an API key got (the replica's guard answers it).
    refused: int
    # The status vllm-router's control route got through the front.
    control: int


def measure_split(
    command: Sequence[str],
    env: Mapping[str, str],
    front: FrontPlan,
    roots: Sequence[str],
    metrics_urls: Sequence[str],
    api_key: str,
    model_id: str,
    log: Path,
) -> RouterRun:
    """Runs the router in front of ``roots`` and one client at steady load through it, then its control route."""
    router, argv = start_router(command, roots, log, front, env=env)
    try:
        before = [served(url) for url in metrics_urls]
        started = time.monotonic()
        one_client_at_steady_load(router.base_url, api_key, model_id)
        after = [served(url) for url in metrics_urls]
        seconds = time.monotonic() - started
        refused = status_of(f"http://{HOST}:{router.port}/v1/models")
        control = remove_worker_status(router.port, roots[0])
    finally:
        router.stop()
    counts = [int(a - b) for a, b in zip(after, before, strict=True)]
    return RouterRun(Split(argv[argv.index("--policy") + 1], counts, seconds), refused, control)


def imbalance(counts: Sequence[float]) -> float:
    """The busiest replica's count over the idlest's (inf when one got none)."""
    low, high = min(counts), max(counts)
    return high / low if low > 0 else float("inf")
