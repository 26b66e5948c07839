"""Upgrade under load: KubeRay's NewCluster sequence, played from the mirror on real Ray, with traffic flowing.

Render A is serving: its RayCluster (a head and one worker of the model's
group, each started with the ``ray start`` and environment KubeRay would
give its pod, built by :mod:`twin.kuberay`) runs the application on this
machine, with its GCS in the TLS ``redis-server`` that plays ElastiCache. A
steady stream of streamed chat completions goes through a local load
balancer that behaves as the NLB does: it is L4, a new connection goes to a
target whose pod the rendered load-balancer Service selects and whose
readiness (the pod's probe, vLLM's ``/health``) holds; an open connection
stays where it is.

Render B (a new image and a changed engine argument) is then deployed the
way KubeRay carries it out (:class:`twin.kuberay.NewClusterUpgrade`): a
second cluster comes up beside the first, on the same Redis, under its own
storage namespace; its apps become RUNNING; KubeRay switches its Services,
which the mirror's API server must accept; the new pods join the load
balancer as they turn Ready; the old cluster is deleted: its head goes at
once, its worker runs the rendered preStop hook (drain), then stops; and
KubeRay's Redis cleanup Job (the mirror's pod, its own command and
environment) deletes the old cluster's keys.

Pass when no request failed, the new cluster serves with render B's engine
argument, and only the new cluster's keys are left in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.serving.drain import DRAIN_COMMAND_SECONDS, prestop_script
from localserve.affinity_hang import thread_lines
from localserve.processes import child_env, free_port, process_name
from localserve.ray_cluster import RayNode, application_status, deploy_serve_config, loopback_params, ray_node
from localserve.redis_tls import TlsRedis
from localserve.server import LIMIT_MAX_TOKENS, catalog_for, replica_addresses, write_keys
from localserve.traffic import StreamLoad
from twin import kuberay as mirror
from twin.report import Report
from workloads.inference_server.catalog import NODE_DRAIN_FILE_ENV
from workloads.inference_server.vllm_main import API_SERVER_TITLE, SPEC_ENV, STACKS_SIGNAL

# The titles vLLM's processes carry in /proc/<pid>/comm (15 characters).
VLLM_TITLES = frozenset(title[:15] for title in (API_SERVER_TITLE, "VLLM::EngineCore"))

HOST = "127.0.0.1"
STREAMS = 3
# Each client's pause between requests.
THINK_S = 0.2
REQUEST_TIMEOUT_S = 90.0
NODE_START_TIMEOUT_S = 120.0
APP_TIMEOUT_S = float(os.environ.get("E2E_SERVER_START_TIMEOUT_S", "420"))
# The worker's logical CPUs: the replica and its engine (a pod's CPU limit is larger).
WORKER_CPUS = "6"
# Twin-scale drain: the server's notice after /health turns 503, the hook's bound.
TWIN_DRAIN_NOTICE_S = 4.0
TWIN_PRESTOP_S = 20
# Each Ray command of the hook (the node's id, its drain), bounded inside that: the render's bound for
# each is longer than the whole twin hook, and a NewCluster deletion takes the head at once, so with no
# GCS left to answer they ran to it (the hook took 43 s of its 20).
TWIN_DRAIN_COMMAND_S = 8
TWIN_SHUTDOWN_S = 30.0
# The readiness probe's period here (prod: 5 s, three misses).
PROBE_PERIOD_S = 0.5
# How long a Ready replica may take to pass the load balancer's health check.
TARGET_TIMEOUT_S = 30.0
# Engine arguments that run on the CPU, carried from the render into the local catalogue.
TWIN_ENGINE_KEYS = ("max_num_seqs",)
# Paths the pod mounts that this machine keeps under the run's folder instead.
CACHE_ENV = ("XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
SERVICE = "upgrade"


# --- one RayCluster of the RayService, on this machine ------------------------------


def _env_value(entry: Mapping[str, Any], pod: Mapping[str, Any], redis: TlsRedis) -> str | None:
    """A container env entry's value as the kubelet would resolve it (Secret refs: the Redis password)."""
    if "value" in entry:
        return str(entry["value"])
    source = entry.get("valueFrom") or {}
    if "secretKeyRef" in source:
        return redis.password
    path = (source.get("fieldRef") or {}).get("fieldPath", "")
    meta = pod["metadata"]
    if path == "metadata.name":
        return str(meta["name"])
    if path == "metadata.namespace":
        return str(meta["namespace"])
    if path.startswith("metadata.labels['"):
        return str(meta["labels"].get(path[len("metadata.labels['") : -2], ""))
    return None


def pod_env(pod: Mapping[str, Any], redis: TlsRedis) -> dict[str, str]:
    """The Ray container's environment as the kubelet resolves it, with the GCS Redis moved to the local one."""
    container = pod["spec"]["containers"][0]
    env = {e["name"]: v for e in container.get("env") or [] if (v := _env_value(e, pod, redis)) is not None}
    if "RAY_REDIS_ADDRESS" in env:
        env["RAY_REDIS_ADDRESS"] = redis.url()
    if "RAY_REDIS_CA_CERT" in env:
        env["RAY_REDIS_CA_CERT"] = str(redis.tls.ca_cert)
    return env


@dataclass
class LocalCluster:
    """One RayCluster of the RayService: its mirror-built pods and the local nodes that play them."""

    ref: mirror.RayClusterRef
    pods: list[dict[str, Any]]
    head: RayNode
    worker: RayNode
    dashboard_url: str
    gcs_address: str
    address_dir: Path
    node_drain_file: Path
    app: str
    terminating: bool = False

    @property
    def name(self) -> str:
        return self.ref.name

    def replica(self) -> dict[str, Any] | None:
        """The model replica's record (url, pid) on this cluster, once its server is healthy."""
        found = replica_addresses(self.address_dir)
        return found[0] if found else None

    def stop(self) -> None:
        self.worker.stop(grace_s=5)
        self.head.stop(grace_s=5)


def _serving_group(ref: mirror.RayClusterRef) -> Mapping[str, Any]:
    groups = ref.spec.get("workerGroupSpecs") or []
    return next((g for g in groups if g["groupName"] == "ingress"), groups[0])


def _node(
    ref: mirror.RayClusterRef,
    group: Mapping[str, Any],
    node_type: str,
    redis: TlsRedis,
    workdir: Path,
    overrides: Mapping[str, str],
    extra_env: Mapping[str, str],
    subs: list[str],
) -> tuple[RayNode, dict[str, Any]]:
    """A local node started as KubeRay starts the group's pod: the mirror's params and env, moved to loopback."""
    pod = mirror.build_pod(ref, group, node_type)
    params = dict(mirror.start_command(ref, group, node_type).params)
    # This machine sizes memory itself and has no GPUs; the worker gets a pod's worth of logical CPUs.
    for key in ("memory", "num-gpus"):
        params.pop(key, None)
    params.update(overrides)
    env = pod_env(pod, redis)
    for key in CACHE_ENV:
        if key in env:
            # Each pod has its own emptyDir for these.
            env[key] = str(workdir / ref.name[-5:] / "cache" / key.lower())
    env.update(extra_env)
    name = f"{ref.name}-{'head' if node_type == mirror.HEAD else 'worker'}"
    node = ray_node(
        name,
        params,
        env,
        head=node_type == mirror.HEAD,
        temp_dir=workdir / ref.name[-5:] / node_type[0],
        log_dir=workdir / "logs",
    )
    subs.append(f"{name}: KubeRay's ray start and env for the pod, on 127.0.0.1 and free ports")
    return node, pod


def local_serve_config(rs: Mapping[str, Any], model_dir: Path, keys: Path, address_dir: Path) -> dict[str, Any]:
    """The rendered serveConfigV2 with the tiny model's catalogue, keeping the engine arguments that run on the CPU."""
    config: dict[str, Any] = yaml.safe_load(rs["spec"]["serveConfigV2"])
    app = config["applications"][0]
    rendered = app["args"]
    args: dict[str, Any] = catalog_for(model_dir, keys, layout=str(rendered.get("layout", "serve-ingress")))
    overrides = rendered["models"][0].get("engine_overrides") or {}
    model = args["models"][0]
    model["engine_overrides"].update({k: overrides[k] for k in TWIN_ENGINE_KEYS if k in overrides})
    if "vllm_server" in args:
        args["vllm_server"] = {
            **args["vllm_server"],
            "address_dir": str(address_dir),
            "drain_notice_s": TWIN_DRAIN_NOTICE_S,
        }
    args["shutdown"] = {"timeout_s": TWIN_SHUTDOWN_S, "wait_loop_s": 0.5}
    app["args"] = args
    config["applications"] = [app]
    config["http_options"] = {**config.get("http_options", {}), "host": HOST, "port": free_port()}
    return config


def start_cluster(
    ref: mirror.RayClusterRef, redis: TlsRedis, workdir: Path, model_dir: Path, report: Report, core: int
) -> LocalCluster:
    """Head and worker up, the application deployed through the Serve REST API (as KubeRay does).

    ``core``: the CPU the worker's vLLM engine binds its threads to. Each
    cluster's GPU pods have nodes of their own; here the two clusters share
    two cores, and vLLM's CPU backend binds to core 0 by default, where one
    engine under load would starve the other's start.
    """
    subs: list[str] = []
    head_ports = loopback_params(head=True)
    head, head_pod = _node(ref, ref.spec["headGroupSpec"], mirror.HEAD, redis, workdir, head_ports, {}, subs)
    gcs = f"{HOST}:{head_ports['port']}"
    group = _serving_group(ref)
    node_drain = workdir / ref.name[-5:] / "node-draining"
    worker_env = {
        "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(free_port()),
        NODE_DRAIN_FILE_ENV: str(node_drain),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
    }
    subs.append(f"{ref.name}-worker: its vLLM engine on CPU {core} of this machine (each cluster has nodes of its own)")
    worker_params = {**loopback_params(head=False), "address": gcs, "num-cpus": WORKER_CPUS}
    worker, worker_pod = _node(ref, group, mirror.WORKER, redis, workdir, worker_params, worker_env, subs)
    for line in subs:
        report.sub(SERVICE, line)
    head.start_until_up(NODE_START_TIMEOUT_S)
    worker.start_until_up(NODE_START_TIMEOUT_S)
    keys = workdir / "keys"
    address_dir = workdir / ref.name[-5:] / "replicas"
    config = local_serve_config(ref.ray_service, model_dir, keys, address_dir)
    dashboard = f"http://{HOST}:{head_ports['dashboard-port']}"
    app = str(config["applications"][0]["name"])
    deploy_serve_config(dashboard, config)
    return LocalCluster(ref, [head_pod, worker_pod], head, worker, dashboard, gcs, address_dir, node_drain, app)


def wait_app_running(cluster: LocalCluster, timeout_s: float = APP_TIMEOUT_S) -> dict[str, str]:
    """The cluster's Serve application statuses once all are RUNNING (what KubeRay reads before a switch)."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = application_status(cluster.dashboard_url, cluster.app)
        if status == "RUNNING" and cluster.replica() is not None:
            return {cluster.app: status}
        if status == "DEPLOY_FAILED":
            break
        time.sleep(1)
    raise RuntimeError(f"{cluster.name}: {cluster.app} not RUNNING after {timeout_s:.0f}s (last: {status})")


# What a start that never finished leaves in the report: at most this many lines of stacks, the first
# and the last half (a stack is printed most recent call first, so its last lines are where the thread
# started: the server's own module).
STACK_LINES = 80
# The import system's own frames, two for each module an import goes through: a stack stuck inside
# `import vllm` is mostly these.
_IMPORT_FRAMES = '"<frozen importlib.'
# faulthandler writes at most 100 frames of a thread, most recent first, then this line alone: a
# thread deep in `import vllm` (importlib's two frames a module) can pass that, and its outer frames,
# the server's own module among them, are then not in the dump at all.
FAULTHANDLER_CUT = "  ..."
CUT_NOTE = "  ... (faulthandler writes 100 frames at most: this thread's outer frames, down to its own module, are cut)"


def shown_stacks(text: str, limit: int = STACK_LINES) -> list[str]:
    """The stack dump's lines without the import system's frames, cut in the middle beyond ``limit``."""
    kept = [
        CUT_NOTE if line.rstrip() == FAULTHANDLER_CUT else line
        for line in text.splitlines()
        if line.strip() and _IMPORT_FRAMES not in line
    ]
    if len(kept) <= limit:
        return kept
    half = limit // 2
    return [*kept[:half], f"  ... {len(kept) - 2 * half} lines left out", *kept[-half:]]


def why_not_running(cluster: LocalCluster, wait_s: float = 2.0) -> list[str]:
    """Where the worker node's processes are: each busy or blocked thread, and the vLLM processes' Python stacks.

    The stacks come from the signal the server registers first thing
    (``vllm_main.STACKS_SIGNAL``); they land on the replica's stderr, the
    Ray worker's ``.err`` log in the node's session.
    """
    pids = cluster.worker.pids()
    lines = [f"{cluster.name}-worker: {line}" for line in thread_lines(pids)]
    logs = cluster.worker.temp_dir / "session_latest" / "logs"
    sizes = {log: log.stat().st_size for log in logs.glob("worker-*.err")}
    asked = [pid for pid in pids if process_name(pid) in VLLM_TITLES]
    for pid in asked:
        with contextlib.suppress(OSError):
            os.kill(pid, STACKS_SIGNAL)
    if not asked:
        return [*lines, f"{cluster.name}-worker: no vLLM server process to ask for its stacks"]
    time.sleep(wait_s)
    stacks = ""
    for log in sorted(logs.glob("worker-*.err")):
        with log.open("rb") as handle:
            handle.seek(sizes.get(log, 0))
            stacks += handle.read().decode(errors="replace")
    return [*lines, f"{cluster.name}-worker: Python stacks of pids {sorted(asked)}:", *shown_stacks(stacks)]


# --- the load balancer ----------------------------------------------------------------


@dataclass
class LoadBalancer:
    """The NLB with IP targets, on loopback: L4, a new connection to a registered healthy target, round robin.

    An open connection stays on its target whatever happens to the target's
    registration (the NLB's flows do; the server ends them).
    """

    port: int = field(default_factory=free_port)
    targets: list[tuple[str, str, int]] = field(default_factory=list)  # (pod, host, port)
    connections: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    _cycle: itertools.count[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    stopped: threading.Event = field(default_factory=threading.Event)

    def set_targets(self, targets: list[tuple[str, str, int]]) -> None:
        with self._lock:
            self.targets = list(targets)

    def _pick(self) -> tuple[str, str, int] | None:
        with self._lock:
            if not self.targets:
                self.refused += 1
                return None
            target = self.targets[next(self._cycle) % len(self.targets)]
            self.connections[target[0]] = self.connections.get(target[0], 0) + 1
            return target

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
        finally:  # the far end closed, or the load balancer stops
            with contextlib.suppress(OSError):
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Cancelled when the load balancer stops: the connection ends with it. The task ends without
        # an error, as asyncio's server (3.11) logs a traceback for a connection task that ends cancelled.
        with contextlib.suppress(asyncio.CancelledError):
            await self._connect(reader, writer)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = self._pick()
        if target is None:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(target[1], target[2])
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def start(self) -> None:
        self._run_server(lambda: asyncio.start_server(self._handle, HOST, self.port), "twin-nlb")

    def _run_server(self, listen: Callable[[], Awaitable[asyncio.Server]], thread: str) -> None:
        """Runs the server ``listen`` makes on a loop of its own in a thread, until stop(); returns once it listens."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            server = loop.run_until_complete(listen())
            ready.set()
            with contextlib.suppress(Exception):
                loop.run_forever()
            server.close()
            # As asyncio.run ends: the connections still piped are cancelled and awaited, then the loop closes.
            loop.run_until_complete(_cancel_the_others())
            loop.close()
            self.stopped.set()

        threading.Thread(target=run, daemon=True, name=thread).start()
        ready.wait(10)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening and close the connections still open; waits up to `timeout_s` for that."""
        if self._loop is not None and not self.stopped.is_set():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.stopped.wait(timeout_s)


async def _cancel_the_others() -> None:
    """Cancels every other task of the running loop and waits until each has ended."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def healthy(url: str) -> bool:
    """The vllm-server pod's readiness probe: vLLM's /health answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Registration:
    """Keeps the load balancer's targets: pods the Service selects, not terminating, Ready (the NLB's view)."""

    lb: LoadBalancer
    service: Mapping[str, Any]  # the rendered load-balancer Service
    clusters: list[LocalCluster] = field(default_factory=list)
    timeline: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)
    gated: dict[str, bool] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def add(self, cluster: LocalCluster) -> None:
        for pod in cluster.pods:
            # The pod webhook runs at CREATE: gates for the Services that select the pod then.
            self.gated[pod["metadata"]["name"]] = bool(mirror.lbc_readiness_gates(pod, [self.service]))
        self.clusters.append(cluster)

    def _targets(self) -> list[tuple[str, str, int]]:
        found = []
        selector = self.service["spec"]["selector"]
        for cluster in list(self.clusters):
            if cluster.terminating:
                continue  # a terminating pod leaves the Service's ready endpoints at once
            replica = cluster.replica()
            for pod in cluster.pods:
                if not mirror.selects(selector, pod["metadata"]["labels"]) or replica is None:
                    continue
                url = str(replica["url"]).removesuffix("/v1")
                if healthy(url):
                    host, port = url.removeprefix("http://").rsplit(":", 1)
                    found.append((pod["metadata"]["name"], host, int(port)))
        return found

    def refresh(self) -> None:
        """Probe once and hand the load balancer its targets."""
        targets = self._targets()
        self.lb.set_targets(targets)
        names = tuple(sorted(t[0] for t in targets))
        if names != self.targeted():
            self.timeline.append((time.monotonic(), names))

    def targeted(self) -> tuple[str, ...]:
        """The target pods' names as the last probe found them."""
        return self.timeline[-1][1] if self.timeline else ()

    def run(self) -> None:
        """Probe now, then every PROBE_PERIOD_S: the targets are set when this returns, not a period later."""
        self.refresh()

        def loop() -> None:
            while not self._stop.wait(PROBE_PERIOD_S):
                self.refresh()

        threading.Thread(target=loop, daemon=True, name="twin-targets").start()

    def wait_targeted(self, cluster: LocalCluster, timeout_s: float) -> bool:
        """Until the running probe finds one of the cluster's pods a target; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(name.startswith(f"{cluster.name}-") for name in self.targeted()):
                return True
            time.sleep(PROBE_PERIOD_S)
        return False

    def stop(self) -> None:
        self._stop.set()


# --- traffic ----------------------------------------------------------------------------


# --- the old cluster goes ---------------------------------------------------------------


@dataclass
class ProcView:
    """A /proc of one node's processes only (the hook greps /proc; here the nodes share one machine)."""

    node: RayNode
    root: Path
    _stop: threading.Event = field(default_factory=threading.Event)

    def refresh(self) -> None:
        live = set()
        for pid in self.node.pids():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                (self.root / str(pid)).mkdir(parents=True, exist_ok=True)
                (self.root / str(pid) / "cmdline").write_bytes(cmdline)
                live.add(str(pid))
        for entry in self.root.iterdir() if self.root.is_dir() else []:
            if entry.name not in live:
                (entry / "cmdline").unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    entry.rmdir()

    def run(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.refresh()

        def loop() -> None:
            while not self._stop.wait(0.5):
                self.refresh()

        threading.Thread(target=loop, daemon=True, name="twin-proc").start()

    def stop(self) -> None:
        self._stop.set()


def _tool_path() -> str:
    """PATH with this interpreter's bin first: the image's `python` and `ray`."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def delete_cluster(cluster: LocalCluster, workdir: Path, report: Report) -> float:
    """KubeRay deletes the RayCluster: the head at once, the worker after its preStop hook. Returns the hook's time."""
    cluster.terminating = True
    view = ProcView(cluster.worker, workdir / cluster.name[-5:] / "proc")
    view.run()
    script = prestop_script(
        TWIN_PRESTOP_S,
        str(view.root),
        node_drain_file=str(cluster.node_drain_file),
        command_seconds=TWIN_DRAIN_COMMAND_S,
    )
    report.sub(
        SERVICE,
        f"{cluster.name}: the worker's preStop hook with a {TWIN_PRESTOP_S}s bound and {TWIN_DRAIN_COMMAND_S}s for "
        "each of its Ray commands, the pod's drain file and a /proc of the node's own processes (the render's: "
        f"the longest generation, {DRAIN_COMMAND_SECONDS}s, /tmp, /proc)",
    )
    env = {**cluster.worker.env, "RAY_ADDRESS": cluster.gcs_address, "PATH": _tool_path()}
    head_gone = threading.Thread(target=cluster.head.stop, kwargs={"grace_s": 5}, daemon=True)
    started = time.monotonic()
    head_gone.start()
    subprocess.run(["bash", "-c", script], env=env, timeout=TWIN_PRESTOP_S + 60, check=False, capture_output=True)
    took = time.monotonic() - started
    view.stop()
    cluster.worker.stop(grace_s=10)  # SIGTERM after the hook, as the kubelet sends it
    head_gone.join(30)
    return took


def redis_cleanup(pod: Mapping[str, Any], redis: TlsRedis, report: Report) -> tuple[int, str]:
    """KubeRay's Redis cleanup Job: the mirror's pod, its own command and environment, against the local Redis."""
    container = pod["spec"]["containers"][0]
    env = pod_env(pod, redis)
    report.sub(
        SERVICE, f"{pod['metadata']['name']}: `bash -c` for the Job's `bash -lc` (a login shell resets PATH here)"
    )
    done = subprocess.run(
        ["bash", "-c", container["args"][0]],
        env=child_env({**env, "PATH": _tool_path()}),
        timeout=180,
        check=False,
        capture_output=True,
        text=True,
    )
    return done.returncode, (done.stdout + done.stderr)[-600:]


# --- the run ----------------------------------------------------------------------------


def storage_keys(redis: TlsRedis, cluster: LocalCluster) -> list[Any]:
    keys = redis.command("KEYS", f"RAY{cluster.ref.uid}@*")
    return list(keys) if isinstance(keys, list) else []


def engine_kwargs_of(cluster: LocalCluster) -> dict[str, Any]:
    """The engine arguments the cluster's vLLM server runs with (its spec, from its environment)."""
    replica = cluster.replica() or {}
    with contextlib.suppress(OSError, ValueError, KeyError):
        raw = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
        for item in raw:
            name, _, value = item.partition(b"=")
            if name == SPEC_ENV.encode():
                spec: dict[str, Any] = json.loads(value)
                return dict(spec.get("engine_kwargs") or {})
    return {}


@dataclass(frozen=True)
class UpgradeInputs:
    """What the check plays: the RayService as rendered before and after, and the load balancer in front."""

    before: Mapping[str, Any]
    after: Mapping[str, Any]
    load_balancer: Mapping[str, Any]
    # The engine argument render B changed, and its value there.
    engine_key: str
    engine_value: Any


def run_upgrade_under_load(
    inputs: UpgradeInputs, redis: TlsRedis, model_dir: Path, workdir: Path, report: Report
) -> bool:
    """Render A serving, render B deployed under load by KubeRay's NewCluster sequence; see the module docstring."""
    name = str(inputs.before["metadata"]["name"])
    active = mirror.RayClusterRef(mirror.ray_cluster_name(inputs.before, "aaaaa"), inputs.before)
    upgrade = mirror.NewClusterUpgrade(inputs.before, inputs.after, active, mirror.first_serve_service(active))
    if not report.check(
        SERVICE, upgrade.needed, f"{name}: render B (new image, {inputs.engine_key}) starts a new cluster"
    ):
        return False
    started = time.monotonic()
    lb = LoadBalancer()
    lb.start()
    registration = Registration(lb, inputs.load_balancer)
    clusters: list[LocalCluster] = []
    traffic: StreamLoad | None = None
    ok = True
    # The API keys file both clusters' servers read (a Secret the RayService mounts).
    api_key = write_keys(workdir / "keys")
    try:
        report.step(SERVICE, f"{active.name}: starting render A's head and worker")
        old = start_cluster(active, redis, workdir, model_dir, report, core=0)
        clusters.append(old)
        wait_app_running(old)
        registration.add(old)
        registration.run()
        # Users reach the Service once a target is registered; traffic sent before would count as refused.
        if not report.check(
            SERVICE,
            registration.wait_targeted(old, TARGET_TIMEOUT_S),
            f"{active.name}: its serving pod is a load balancer target before traffic starts",
        ):
            return False
        # A steady stream, not a saturating one: this machine's two cores hold both clusters.
        traffic = StreamLoad(
            f"http://{HOST}:{lb.port}/v1",
            api_key,
            STREAMS,
            timeout_s=REQUEST_TIMEOUT_S,
            think_s=THINK_S,
            max_tokens=LIMIT_MAX_TOKENS // 2,
            prompt="Tell me about upgrades.",
            mixed=True,
        )
        traffic.start()
        ok &= report.check(
            SERVICE,
            traffic.wait_served(STREAMS, 0.0, 120),
            f"steady traffic through the load balancer on {active.name}{traffic.last_error()}",
        )

        pending = upgrade.start("bbbbb")
        report.step(SERVICE, f"{pending.name}: KubeRay creates the pending cluster beside {active.name}")
        new = start_cluster(pending, redis, workdir, model_dir, report, core=1)
        clusters.append(new)
        try:
            statuses = wait_app_running(new)
        except RuntimeError:
            # The start that never finishes (docs/testing.md): say where it is before the run stops it.
            for line in why_not_running(new):
                report.note(SERVICE, line)
            raise
        registration.add(new)
        try:
            upgrade.switch(statuses)
            ok &= report.check(
                SERVICE, True, f"{pending.name}: apps RUNNING; KubeRay's Service switch accepted by the API server"
            )
        except mirror.ApiError as err:
            ok &= report.check(SERVICE, False, f"switch refused: {err}")
            return False
        gates = [p for p, gated in registration.gated.items() if p.startswith(pending.name) and "worker" in p]
        ok &= report.check(
            SERVICE,
            all(registration.gated[p] for p in gates) and bool(gates),
            f"{pending.name}: its serving pods were created with the load balancer's readiness gate",
        )
        switched = time.monotonic()
        ok &= report.check(
            SERVICE,
            traffic.wait_served(STREAMS, switched, 120),
            f"traffic served after {pending.name} joined the load balancer",
        )
        engine = engine_kwargs_of(new)
        ok &= report.check(
            SERVICE,
            engine.get(inputs.engine_key) == inputs.engine_value,
            f"{pending.name} serves with render B's {inputs.engine_key}={engine.get(inputs.engine_key)!r} "
            f"(wanted {inputs.engine_value!r})",
        )

        old_ref, cleanup = upgrade.finish()
        report.step(
            SERVICE, f"{old_ref.name}: KubeRay deletes the old cluster (head at once, worker after its preStop hook)"
        )
        deleting = time.monotonic()
        hook = delete_cluster(old, workdir, report)
        report.step(SERVICE, f"{old_ref.name}: the worker's preStop hook took {hook:.1f}s; the node is stopped")
        ok &= report.check(
            SERVICE, traffic.wait_served(STREAMS, time.monotonic(), 120), f"traffic served by {pending.name} alone"
        )
        hung = traffic.stop(REQUEST_TIMEOUT_S + 10)
        outcomes = traffic.done()
        failed = [o for o in outcomes if not o.ok]
        stopped = time.monotonic()
        during = [o for o in outcomes if o.ended >= deleting and o.started <= stopped]
        ok &= report.check(
            SERVICE,
            not failed and not hung,
            f"{len(outcomes)} requests across the upgrade "
            f"({len(during)} while the old cluster was deleted), "
            f"{len(failed)} failed{': ' + failed[0].error if failed else ''}; "
            f"{lb.refused} connections found no target; "
            f"connections per pod: {', '.join(f'{p} {n}' for p, n in sorted(lb.connections.items()))}",
        )
        report.note(SERVICE, "load balancer targets: " + describe_timeline(registration.timeline, started))
        if cleanup is None:
            return report.check(SERVICE, False, "the old cluster has no Redis cleanup Job (GCS fault tolerance off?)")
        before = len(storage_keys(redis, old))
        code, output = redis_cleanup(cleanup, redis, report)
        left, kept = storage_keys(redis, old), storage_keys(redis, new)
        ok &= report.check(
            SERVICE,
            code == 0 and not left and bool(kept) and before > 0,
            f"Redis cleanup Job {cleanup['metadata']['name']}: exit {code}; "
            f"the old cluster's keys {before} -> {len(left)}, "
            f"the new cluster's kept: {len(kept)}" + (f"; {output.strip()[-300:]}" if code else ""),
        )
        return ok
    except Exception as err:  # a failure to start or deploy: one FAIL line, the run goes on to stop things
        report.fail(SERVICE, f"upgrade under load stopped: {type(err).__name__}: {str(err)[-800:]}")
        return False
    finally:
        if traffic is not None:
            traffic.stop(5)
        registration.stop()
        lb.stop()
        for cluster in clusters:
            cluster.stop()


def describe_timeline(timeline: list[tuple[float, tuple[str, ...]]], started: float) -> str:
    """The load balancer's target sets as they changed, e.g. ``+12s [a-worker] -> +230s [a-worker, b-worker]``."""
    return " -> ".join(f"+{at - started:.0f}s [{', '.join(names) or 'none'}]" for at, names in timeline)


def changed_engine(doc: dict[str, Any], model: str, key: str, value: Any) -> dict[str, Any]:
    """A stack document with one engine argument of one model changed."""
    out = copy.deepcopy(doc)
    for entry in out["config"]["llm-platform:models"]:
        if entry["name"] == model:
            entry.setdefault("engine_overrides", {})[key] = value
    return out
