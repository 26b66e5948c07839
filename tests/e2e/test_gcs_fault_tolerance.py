"""End-to-end: Ray's GCS fault tolerance against a real TLS Redis, with the real application.

Prod keeps the GCS's state in ElastiCache over TLS with an auth token
(`ray.gcs_fault_tolerance` in Pulumi.prod.yaml, `gcsFaultToleranceOptions`
in the rendered RayService). Here Debian's `redis-server` plays ElastiCache:
TLS only, a password, a CA made for the test. The head and a worker are
started from prod's rendered RayService the way KubeRay starts the pods
(localserve/ray_cluster.py), on 127.0.0.1; the application is prod's
serveConfigV2 with the tiny model's catalogue, applied through the Serve
REST API as KubeRay applies it.

While streamed chat completions run against the worker's proxy, the head's
`gcs_server` is killed with SIGKILL; the head's `ray start --block` then ends
the rest of the head, as the head container dies, and the same command is
run again, as the kubelet restarts it. The test prints one line per check
and the measured gap in serving.

Run with ``E2E=1 pytest -s tests/e2e/test_gcs_fault_tolerance.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from localserve.processes import STAT_PPID, every_process, free_port, process_name, stat_fields
from localserve.ray_cluster import (
    STARTED,
    RayNode,
    application_status,
    cluster_state,
    deploy_serve_config,
    is_loopback,
    kuberay_head_env,
    kuberay_head_params,
    kuberay_worker_env,
    kuberay_worker_params,
    listening_sockets,
    loopback_params,
    ray_node,
    wait_application_running,
)
from localserve.redis_tls import TlsRedis, make_ca, redis_server_path, start_tls_redis
from localserve.server import catalog_for, replica_addresses, write_keys
from localserve.traffic import Outcome, StreamLoad
from tests.harness import manifests_of, render_stack

pytestmark = pytest.mark.e2e

STACK = "prod"
INGRESS_GROUP = "ingress"
REDIS_CA_ENV = "RAY_REDIS_CA_CERT"
HOST = "127.0.0.1"
# The RayCluster's uid in a cluster; KubeRay makes it the Redis key namespace.
CLUSTER_UID = str(uuid.uuid4())
# Logical CPUs of the worker (a pod's CPU limit): the model's bundle and the ingress.
WORKER_CPUS = "6"
STREAMS = 4
REQUEST_TIMEOUT_S = 60.0
NODE_START_TIMEOUT_S = 90.0
APP_TIMEOUT_S = float(os.environ.get("E2E_SERVER_START_TIMEOUT_S", "300"))
RECOVERY_TIMEOUT_S = 120.0
# Traffic kept up after the head is back, so new requests are seen served.
AFTER_RECOVERY_S = 6.0
# The application is RUNNING once the replica's server answers; its engine
# process is looked for a little longer on a busy machine.
ENGINE_LOOKUP_S = 20.0


def say(line: str) -> None:
    print(f"[gcs-ft] {line}", flush=True)


@pytest.fixture(scope="module")
def gcs_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """The module's work dir (nodes' temp dirs, logs, Redis, certificates), kept only when a test failed.

    Skips without redis-server, openssl or Ray, unless the run says they must be there (CI).
    """
    missing = [
        name
        for name, found in (
            ("redis-server", redis_server_path()),
            ("openssl", shutil.which("openssl")),
            ("ray", importlib.util.find_spec("ray")),
        )
        if found is None
    ]
    if missing:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail(f"E2E_REQUIRED=1 but {missing} are not installed (apt-get install redis-server openssl)")
        pytest.skip(f"not installed: {missing}")
    # Short: Ray's unix sockets live under the nodes' temp dirs.
    path = Path(tempfile.mkdtemp(prefix="gcs_", dir="/tmp"))
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)
    else:
        say(f"logs kept in {path}")


@pytest.fixture(scope="module")
def tls_redis(gcs_dir: Path) -> Iterator[TlsRedis]:
    redis = start_tls_redis(gcs_dir / "redis")
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def prod_service() -> dict[str, Any]:
    """Prod's rendered RayService: the head, its worker groups, GCS FT options and serveConfigV2."""
    services = manifests_of(render_stack(STACK), "RayService")
    assert services, f"{STACK} renders no RayService"
    service: dict[str, Any] = services[0]
    cluster = service["spec"]["rayClusterConfig"]
    assert "gcsFaultToleranceOptions" in cluster, f"{STACK} has no GCS fault tolerance"
    assert REDIS_CA_ENV in container_env(cluster["headGroupSpec"]), (
        f"{STACK}'s head does not set {REDIS_CA_ENV}: its GCS can not verify the Redis certificate"
    )
    return service


def local_cluster(service: dict[str, Any], redis: TlsRedis) -> dict[str, Any]:
    """Prod's rayClusterConfig with the Redis address moved to the local server (same scheme)."""
    cluster: dict[str, Any] = copy.deepcopy(service["spec"]["rayClusterConfig"])
    ft = cluster["gcsFaultToleranceOptions"]
    scheme = urlsplit(ft["redisAddress"]).scheme
    ft["redisAddress"] = f"{scheme}://{HOST}:{redis.port}"
    return cluster


def container_env(group: dict[str, Any]) -> dict[str, str]:
    """A group's Ray container environment: the plain values (Secret references are KubeRay's)."""
    env = group["template"]["spec"]["containers"][0].get("env", [])
    return {e["name"]: str(e["value"]) for e in env if "value" in e}


def head_node(
    cluster: dict[str, Any], redis: TlsRedis, directory: Path, name: str, ca_cert: Path | None
) -> tuple[RayNode, dict[str, str]]:
    """Prod's head: its rayStartParams and environment with KubeRay's additions, on loopback.

    `RAY_REDIS_CA_CERT` names the test's CA instead of the image's system bundle
    (which holds the public roots ElastiCache chains to); None leaves it out.
    """
    params = {**kuberay_head_params(cluster), **loopback_params(head=True)}
    env = {
        **container_env(cluster["headGroupSpec"]),
        **kuberay_head_env(cluster, cluster_uid=CLUSTER_UID, redis_password=redis.password),
    }
    env.pop(REDIS_CA_ENV, None)
    if ca_cert is not None:
        env[REDIS_CA_ENV] = str(ca_cert)
    node = ray_node(name, params, env, head=True, temp_dir=directory / name, log_dir=directory / "logs")
    if ca_cert is None:
        node.env.pop(REDIS_CA_ENV, None)
    return node, params


# -- the negative: the CA is what makes the head reach the TLS Redis --------


@pytest.mark.parametrize("ca", ["missing", "wrong"])
def test_head_without_the_redis_ca_fails_certificate_verification(
    ca: str, prod_service: dict[str, Any], tls_redis: TlsRedis, gcs_dir: Path
) -> None:
    cluster = local_cluster(prod_service, tls_redis)
    wrong_ca = make_ca(gcs_dir / "other-ca", "some other CA")[0] if ca == "wrong" else None
    node, _ = head_node(cluster, tls_redis, gcs_dir, f"no-ca-{ca}", wrong_ca)
    started = time.monotonic()
    node.start()
    try:
        code = node.wait_exit(timeout_s=60)
        log = node.child.log_path.read_text(errors="replace")
        assert code is not None, f"head still running 60s without a usable CA:\n{node.child.log_tail()}"
        assert code != 0
        assert "CERTIFICATE_VERIFY_FAILED" in log, node.child.log_tail()
        assert STARTED not in log
        say(f"CA {ca}: head exited {code} after {time.monotonic() - started:.1f}s: CERTIFICATE_VERIFY_FAILED")
    finally:
        node.stop()


# -- the kill: serving goes on while the head and its GCS come back ---------


@dataclass
class Cluster:
    head: RayNode
    worker: RayNode
    gcs_address: str
    dashboard_url: str
    app: str
    base_url: str
    api_key: str
    # What the pod's readiness probe asks: Serve's proxy, or the replica's vLLM server.
    health_path: str = "/-/healthz"


def _layout(service: dict[str, Any]) -> str:
    """The serving layout prod renders (the catalogue's `layout`)."""
    config: dict[str, Any] = yaml.safe_load(service["spec"]["serveConfigV2"])
    return str(config["applications"][0]["args"].get("layout", "serve-ingress"))


def _serve_config(service: dict[str, Any], model_dir: Path, keys: Path) -> dict[str, Any]:
    """Prod's serveConfigV2 with the local catalogue (in prod's layout) and the head's proxy on a free loopback port."""
    config: dict[str, Any] = yaml.safe_load(service["spec"]["serveConfigV2"])
    app = config["applications"][0]
    app["args"] = catalog_for(model_dir, keys, layout=_layout(service))
    config["applications"] = [app]
    config["http_options"] = {**config["http_options"], "host": HOST, "port": free_port()}
    return config


@pytest.fixture(scope="module")
def cluster(prod_service: dict[str, Any], tls_redis: TlsRedis, tiny_model: Path, gcs_dir: Path) -> Iterator[Cluster]:
    """Prod's head (0 CPUs) and one worker, the application deployed and RUNNING."""
    local = local_cluster(prod_service, tls_redis)
    head, head_params = head_node(local, tls_redis, gcs_dir, "head", tls_redis.tls.ca_cert)
    gcs_address = f"{HOST}:{head_params['port']}"
    groups = local["workerGroupSpecs"]
    worker_group = next((g for g in groups if g["groupName"] == INGRESS_GROUP), groups[0])
    worker_params = {
        **kuberay_worker_params(worker_group, gcs_address),
        **loopback_params(head=False),
        "num-cpus": WORKER_CPUS,
    }
    proxy_port = free_port()
    # Each pod's proxy binds the same port on its own IP; here the worker's gets its own port.
    worker_env = {
        **container_env(worker_group),
        **kuberay_worker_env(local),
        "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy_port),
    }
    worker = ray_node(
        "worker", worker_params, worker_env, head=False, temp_dir=gcs_dir / "worker", log_dir=gcs_dir / "logs"
    )
    try:
        started = time.monotonic()
        head.start_until_up(NODE_START_TIMEOUT_S)
        worker.start_until_up(NODE_START_TIMEOUT_S)
        say(f"head and worker up in {time.monotonic() - started:.1f}s; head: {head.command.split('; ', 1)[1]}")
        api_key = write_keys(gcs_dir / "keys")
        config = _serve_config(prod_service, tiny_model, gcs_dir / "keys")
        dashboard_url = f"http://{HOST}:{head_params['dashboard-port']}"
        app = config["applications"][0]["name"]
        deploy_serve_config(dashboard_url, config)
        say(f"{app} RUNNING {wait_application_running(dashboard_url, app, APP_TIMEOUT_S):.1f}s after the PUT")
        base_url, health_path = f"http://{HOST}:{proxy_port}/v1", "/-/healthz"
        if _layout(prod_service) == "vllm-server":
            # Requests go to the replica's own vLLM server, as the serve Service sends them in prod.
            servers = replica_addresses(Path(config["applications"][0]["args"]["vllm_server"]["address_dir"]))
            assert servers, "the vllm-server replica wrote no address"
            base_url, health_path = str(servers[0]["url"]), "/health"
        yield Cluster(head, worker, gcs_address, dashboard_url, app, base_url, api_key, health_path)
    finally:
        worker.stop()
        head.stop()


def _serve_actors(state: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {a["id"]: a for a in state["actors"] if a["class"].startswith(prefix) and a["state"] == "ALIVE"}


def _kill_gcs_and_restart_head(cluster: Cluster) -> tuple[float, float]:
    """SIGKILL the head's gcs_server; the head "container" dies and is started again. Returns (kill, up) times."""
    gcs_pid = cluster.head.process_named("gcs_server")
    assert gcs_pid is not None, "no gcs_server among the head's processes"
    killed = time.monotonic()
    os.kill(gcs_pid, signal.SIGKILL)
    code = cluster.head.wait_exit(timeout_s=30)
    assert code is not None and code != 0, f"ray start --block did not end after its GCS died (exit {code})"
    say(
        f"gcs_server {gcs_pid} killed; the head's `ray start --block` exited {code} "
        f"{time.monotonic() - killed:.1f}s later"
    )
    # Whatever the dying head left behind goes too, as with a container; then the kubelet's restart.
    cluster.head.child.stop(grace_s=0)
    cluster.head.fresh_filesystem()
    starts = cluster.head.start_until_up(NODE_START_TIMEOUT_S)
    say(f"head restarted with the same command and Redis ({starts} start{'s' if starts > 1 else ''})")
    return killed, time.monotonic()


def test_serving_survives_a_gcs_kill(cluster: Cluster, tls_redis: TlsRedis) -> None:
    before = cluster_state(cluster.gcs_address)
    worker_node = next(n["id"] for n in before["nodes"] if not n["head"])
    replicas = _serve_actors(before, "ServeReplica:")
    assert replicas and all(r["node"] == worker_node for r in replicas.values()), "replicas must be on the worker"
    strays = [s for s in listening_sockets(cluster.head.pids() | cluster.worker.pids()) if not is_loopback(s[2])]
    # Ray Serve's replicas open their inter-deployment gRPC server on [::]:0 (replica.py); nothing else may.
    assert all(comm.startswith("ray::ServeRepli") for _, comm, _ in strays), strays
    engines = _wait_engine_pids(cluster.worker, ENGINE_LOOKUP_S)
    assert engines, f"no vLLM engine on the worker after {ENGINE_LOOKUP_S:.0f}s; {_process_table(cluster.worker)}"
    say(f"{len(replicas)} replicas on worker node {worker_node[:8]}; non-loopback listeners: {strays or 'none'}")

    load = StreamLoad(
        cluster.base_url, cluster.api_key, STREAMS, timeout_s=REQUEST_TIMEOUT_S, health_path=cluster.health_path
    )
    load.start()
    try:
        deadline = time.monotonic() + 60
        while sum(o.ok for o in load.done()) < STREAMS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sum(o.ok for o in load.done()) >= STREAMS, f"no steady traffic before the kill: {load.done()[-3:]}"
        killed, head_up = _kill_gcs_and_restart_head(cluster)
        wait_application_running(cluster.dashboard_url, cluster.app, RECOVERY_TIMEOUT_S)
        recovered = time.monotonic()
        say(
            f"head up again {head_up - killed:.1f}s after the kill, "
            f"{cluster.app} RUNNING on the Serve REST API after {recovered - killed:.1f}s"
        )
        time.sleep(AFTER_RECOVERY_S)
    finally:
        hung = load.stop(timeout_s=REQUEST_TIMEOUT_S + 10)
    assert not hung, f"{len(hung)} request threads still running {REQUEST_TIMEOUT_S + 10:.0f}s after stop"
    outcomes = load.done()
    after = cluster_state(cluster.gcs_address)
    _check_in_flight(outcomes, killed)
    _check_head_back(cluster, tls_redis, before, after, worker_node)
    _check_new_requests(outcomes, recovered)
    _check_replicas_kept(cluster, after, replicas, engines)
    _report_gap(outcomes, load.health, killed, recovered)


def _wait_engine_pids(node: RayNode, timeout_s: float) -> set[int]:
    """The node's engine processes, looked for until one shows or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not (found := _engine_pids(node)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def _process_table(node: RayNode) -> str:
    """The node's processes as pid/ppid/comm, and every vLLM-titled process on the machine, for a failure's message."""
    rows = []
    for pid in sorted(node.pids()):
        fields, name = stat_fields(pid), process_name(pid)
        if fields is not None and name is not None:
            rows.append(f"{pid}<-{fields[STAT_PPID]} {name}")
    vllm = [f"{pid} {name}" for pid, _ in every_process() if (name := process_name(pid) or "").startswith("VLLM::")]
    return f"node processes: {', '.join(rows)}; VLLM-titled processes anywhere: {', '.join(vllm) or 'none'}"


def _engine_pids(node: RayNode) -> set[int]:
    """The node's vLLM engine processes (EngineCore, started by the model replica)."""
    return {pid for pid in node.pids() if (process_name(pid) or "").startswith("VLLM::EngineCor")}


def _check_in_flight(outcomes: list[Outcome], killed: float) -> None:
    in_flight = [o for o in outcomes if o.started < killed < o.ended]
    assert in_flight, "no request was in flight at the kill"
    slow = [o for o in in_flight if o.ended - o.started > REQUEST_TIMEOUT_S + 5]
    assert not slow, f"{len(slow)} in-flight requests took longer than the {REQUEST_TIMEOUT_S:.0f}s bound"
    failed = [o for o in in_flight if not o.ok]
    longest = max(o.ended - o.started for o in in_flight)
    say(
        f"in flight at the kill: {len(in_flight)}, finished {len(in_flight) - len(failed)}, "
        f"failed cleanly {len(failed)} (longest {longest:.1f}s){': ' + failed[0].error if failed else ''}"
    )


def _check_head_back(
    cluster: Cluster, redis: TlsRedis, before: dict[str, Any], after: dict[str, Any], worker_node: str
) -> None:
    nodes = {n["id"]: n for n in after["nodes"]}
    assert after["cluster_id"] == before["cluster_id"], "the head came back as a new cluster"
    assert nodes.get(worker_node, {}).get("alive"), f"worker node {worker_node} is not ALIVE: {after['nodes']}"
    old_head = next(n["id"] for n in before["nodes"] if n["head"])
    new_heads = [n["id"] for n in after["nodes"] if n["head"] and n["alive"]]
    assert len(new_heads) == 1 and new_heads[0] != old_head, after["nodes"]
    keys = redis.command("KEYS", f"RAY{CLUSTER_UID}@*")
    assert isinstance(keys, list) and keys, "no GCS tables under the cluster's namespace in Redis"
    gcs_pid = cluster.head.process_named("gcs_server")
    cmdline = Path(f"/proc/{gcs_pid}/cmdline").read_bytes().decode().split("\0") if gcs_pid else []
    assert f"--redis_port={redis.port}" in cmdline and "--redis_enable_ssl=true" in cmdline, cmdline
    say(
        f"head back on the same Redis: cluster id {after['cluster_id'][:8]} kept, worker node {worker_node[:8]} "
        f"ALIVE, new head {new_heads[0][:8]}, {len(keys)} GCS tables in Redis"
    )


def _check_new_requests(outcomes: list[Outcome], recovered: float) -> None:
    after = [o for o in outcomes if o.started >= recovered]
    failed = [o for o in after if not o.ok]
    assert after and not failed, f"after recovery: {len(after)} requests, failed: {[o.error for o in failed[:3]]}"
    say(f"new requests served after recovery: {len(after)}/{len(after)}")


def _check_replicas_kept(
    cluster: Cluster, state: dict[str, Any], replicas: dict[str, dict[str, Any]], engines: set[int]
) -> None:
    now = _serve_actors(state, "ServeReplica:")
    assert set(now) == set(replicas), f"replica actors changed: {sorted(replicas)} -> {sorted(now)}"
    changed = [
        r
        for r in now.values()
        if (r["pid"], r["restarts"]) != (replicas[r["id"]]["pid"], replicas[r["id"]]["restarts"])
    ]
    assert not changed, f"replicas restarted: {changed}"
    assert _engine_pids(cluster.worker) == engines, f"vLLM engines changed: {engines} -> {_engine_pids(cluster.worker)}"
    controllers = [a for a in state["actors"] if a["class"].startswith("ServeController") and a["state"] == "ALIVE"]
    restarts = controllers[0]["restarts"] if controllers else "?"
    assert application_status(cluster.dashboard_url, cluster.app) == "RUNNING"
    say(
        f"no replica restarted: {len(now)} replica actors, same ids and pids "
        f"({', '.join(str(r['pid']) for r in now.values())}), same vLLM engine pid {sorted(engines)}; "
        f"Serve controller (on the head) restarts: {restarts}"
    )


def _report_gap(outcomes: list[Outcome], health: list[tuple[float, bool]], killed: float, recovered: float) -> None:
    """The serving gap: from the kill to the first request started after it that was served,
    and the longest time without any completed request while the head was away."""
    new_ok = sorted(o.ended for o in outcomes if o.ok and o.started > killed)
    assert new_ok, "no request started after the kill succeeded"
    gap = new_ok[0] - killed
    completions = [killed, *sorted(o.ended for o in outcomes if o.ok and killed < o.ended <= recovered), recovered]
    pause = max(b - a for a, b in itertools.pairwise(completions))
    failed_new = [o for o in outcomes if o.started > killed and not o.ok]
    probes = [ok for t, ok in health if killed <= t <= recovered]
    say(
        f"serving gap: first new request served {gap:.1f}s after the kill; longest pause between "
        f"completions while the head was away {pause:.1f}s; requests failed {len(failed_new)}; "
        f"worker readiness failures {probes.count(False)} of {len(probes)}"
    )
