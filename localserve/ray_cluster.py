"""A Ray cluster on 127.0.0.1 whose nodes are started the way KubeRay starts a RayService's pods.

KubeRay 1.7 turns a group's `rayStartParams` into `ray start` flags (sorted,
"true" as a bare switch, `--key=value` verbatim), forces `block`, adds the
dashboard agent and metrics ports when absent, and runs the result under
`/bin/bash -c "ulimit -n ...; ray start ..."`. With `gcsFaultToleranceOptions`
it gives the head `RAY_REDIS_ADDRESS`, `REDIS_PASSWORD` (referenced as
`--redis-password=$REDIS_PASSWORD`, which that shell expands) and
`RAY_external_storage_namespace` (the RayCluster's uid), and it gives workers
`RAY_gcs_rpc_server_reconnect_timeout_s=600`. The functions below take all of
that from the KubeRay mirror (twin/kuberay.py, cited line by line) for the
rendered RayService; the caller then moves every address
and port onto 127.0.0.1 and free ports (each pod has its own network
namespace, these nodes share one). What KubeRay derives from container
limits (`num-cpus` when absent, `memory`) is left to the caller: prod's head
sets `num-cpus: 0` itself, and local nodes size memory from the machine.

Each node is one `Child` (its own session) led by that `ray start --block`,
like a pod's container: when one of the node's Ray processes dies, `ray start
--block` ends the others and exits, and `RayNode.start()` runs the same
command again, as the kubelet restarts the container. Never `ray stop`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localserve.processes import (
    REPO,
    Child,
    child_env,
    free_port,
    marked_processes,
    process_name,
    session_members,
    with_descendants,
)
from twin import kuberay as mirror

HOST = "127.0.0.1"
LOOPBACK_CLI = Path(__file__).resolve().with_name("ray_loopback.py")

STARTED = "Ray runtime started."
HEAD_NICE = -5

# Every node: a pod has no ~/.ray/auth_token, so Ray's token auth stays off
# there; this machine's home may have one (ray.init writes it), and
# `ray start --head` turns token auth on when it finds one.
NODE_ENV = {"RAY_AUTH_MODE": "disabled"}
# The head (and drivers): Ray otherwise swaps 127.0.0.1 for the machine's
# interface address. Workers take their address from the head's instead
# (see ray_loopback.py), because this switch makes a worker's `ray start` refuse.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class ClusterError(RuntimeError):
    """A node exited or did not come up in time; the message carries its log's tail."""


# What KubeRay derives from a container's limits when the group does not set it;
# local nodes size these from the machine instead.
FROM_LIMITS = ("num-cpus", "memory", "num-gpus")


def _cluster(cluster: dict[str, Any], uid: str | None = None) -> mirror.RayClusterRef:
    """A rayClusterConfig as one RayCluster of a RayService, for the KubeRay mirror."""
    rs = {"metadata": {"name": "local", "namespace": "default"}, "spec": {"rayClusterConfig": cluster}}
    return mirror.RayClusterRef("local-00000", rs, uid)


def _own_sizing(params: dict[str, str], group: dict[str, Any]) -> dict[str, str]:
    given = group.get("rayStartParams") or {}
    return {k: v for k, v in params.items() if k not in FROM_LIMITS or k in given}


def kuberay_head_params(cluster: dict[str, Any]) -> dict[str, str]:
    """The head group's rayStartParams with what KubeRay adds to them (twin/kuberay.py)."""
    head = cluster["headGroupSpec"]
    return _own_sizing(dict(mirror.start_command(_cluster(cluster), head, mirror.HEAD).params), head)


def kuberay_worker_params(group: dict[str, Any], head_address: str) -> dict[str, str]:
    """A worker group's rayStartParams with what KubeRay adds to them (twin/kuberay.py)."""
    spec = mirror.GroupSpec.from_spec(group, is_head=False)
    command = mirror.build_start_command(spec, head_address=head_address, in_tree_autoscaling=False)
    return _own_sizing(dict(command.params), group)


def kuberay_head_env(cluster: dict[str, Any], *, cluster_uid: str, redis_password: str) -> dict[str, str]:
    """What KubeRay adds to the head container's environment for Redis-backed GCS fault tolerance."""
    env = mirror.gcs_fault_tolerance_env(_cluster(cluster, cluster_uid), mirror.HEAD)
    # The password reaches the pod from its Secret (a secretKeyRef); here, the local Redis's.
    return {e["name"]: str(e["value"]) if "value" in e else redis_password for e in env}


def kuberay_worker_env(cluster: dict[str, Any]) -> dict[str, str]:
    """What KubeRay adds to a worker container's environment when GCS fault tolerance is on."""
    return {e["name"]: str(e["value"]) for e in mirror.gcs_fault_tolerance_env(_cluster(cluster), mirror.WORKER)}


def container_command(params: dict[str, str], *, head: bool, ray: str = "ray") -> str:
    """The container's `bash -c` string as KubeRay writes it (nothing quoted; twin/kuberay.py)."""
    start = f"{ray} start --head" if head else f"{ray} start"
    return f"{mirror.ULIMIT_PREFIX}{start} {mirror.convert_param_map(params)}".rstrip()


def loopback_params(*, head: bool) -> dict[str, str]:
    """Every port a node binds, free, and the head's addresses on 127.0.0.1."""
    names = [
        "metrics-export-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "node-manager-port",
        "object-manager-port",
    ]
    if head:
        names += ["port", "dashboard-port", "ray-client-server-port"]
    params = {name: str(free_port()) for name in names}
    if head:
        params.update({"node-ip-address": HOST, "dashboard-host": HOST})
    return params


def _open_files_limit() -> str:
    """KubeRay's `ulimit -n` value, capped at this machine's hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return str(65536 if hard == resource.RLIM_INFINITY else min(65536, hard))


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else shutil.which("ray") or "ray"


@dataclass
class RayNode:
    """One "pod": a `ray start --block` command, its environment, and each process that ran it."""

    name: str
    command: str
    env: dict[str, str]
    temp_dir: Path
    log_dir: Path
    # CPU priority of the node's processes (set on the leader before it forks the rest).
    nice: int = 0
    runs: list[Child] = field(default_factory=list)

    @property
    def child(self) -> Child:
        if not self.runs:
            raise ClusterError(f"{self.name} was never started")
        return self.runs[-1]

    def start(self) -> None:
        """Run the container command (again): a fresh log per run."""
        log = self.log_dir / f"{self.name}-{len(self.runs) + 1}.log"
        argv = ["/bin/bash", "-c", "--", self.command]
        child = Child.start(self.name, argv, self.env, log, marker=str(self.temp_dir))
        self.runs.append(child)
        if self.nice:
            # The session is its own scheduling autogroup on Linux, and a nice value counts
            # only inside its autogroup: set both.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, child.proc.pid, self.nice)
                Path(f"/proc/{child.proc.pid}/autogroup").write_text(str(self.nice))

    def wait_started(self, timeout_s: float) -> float:
        """Until `ray start` says the node is up; returns the seconds waited."""
        child = self.child
        started = time.monotonic()
        while STARTED not in child.log_path.read_text(errors="replace"):
            if child.proc.poll() is not None:
                raise ClusterError(f"{self.name} exited with {child.proc.returncode}:\n{child.log_tail()}")
            if time.monotonic() > started + timeout_s:
                raise ClusterError(f"{self.name} not started after {timeout_s:.0f}s:\n{child.log_tail()}")
            time.sleep(0.2)
        return time.monotonic() - started

    def start_until_up(self, timeout_s: float, attempts: int = 3) -> int:
        """Start, and start again while `ray start` fails before the node is up.

        What the kubelet does for a crashing container (without its back-off);
        on a busy machine Ray's agents can start too slowly for the raylet,
        which then gives up. Returns the number of starts it took.
        """
        for attempt in range(1, attempts + 1):
            self.start()
            try:
                self.wait_started(timeout_s)
                return attempt
            except ClusterError:
                if attempt == attempts:
                    raise
                self.child.stop(grace_s=0)
                self.fresh_filesystem()
        raise AssertionError("unreachable")

    def fresh_filesystem(self) -> None:
        """Forget the last run's address record, as a restarted container's fresh filesystem does.

        The head mounts nothing on its temp dir. With the record left, `ray start
        --head` takes a raylet that points at that address (the worker's, in the
        process list this machine shares and a pod does not) for a head still running.
        """
        (self.temp_dir / "ray_current_cluster").unlink(missing_ok=True)

    def wait_exit(self, timeout_s: float) -> int | None:
        """The current run's exit code, or None if it is still running after `timeout_s`."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.child.proc.wait(timeout=timeout_s)
        return None

    def pids(self) -> set[int]:
        """The current run's processes: its session, anything naming this node's temp dir, and their children.

        Children too: a vllm-server replica starts vLLM's server in a session
        of its own, which neither of the first two finds.
        """
        found = with_descendants(set(session_members(self.child.proc.pid)) | set(marked_processes(str(self.temp_dir))))
        found.discard(os.getpid())
        return found

    def process_named(self, comm: str) -> int | None:
        """The pid of this node's process whose executable name is `comm` (e.g. gcs_server)."""
        return next((pid for pid in sorted(self.pids()) if process_name(pid) == comm), None)

    def stop(self, grace_s: float = 5.0) -> None:
        """End every run's processes by pid."""
        for child in self.runs:
            child.stop(grace_s=grace_s)


def ray_node(
    name: str,
    params: dict[str, str],
    env: dict[str, str],
    *,
    head: bool,
    temp_dir: Path,
    log_dir: Path,
) -> RayNode:
    """A node whose `ray start` runs under bash exactly as KubeRay writes it, in its own temp dir."""
    params = {**params, "temp-dir": str(temp_dir)}
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    node_env = {**NODE_ENV, **(LOOPBACK_ENV if head else {})}
    full_env = child_env({"RAY_START_ULIMIT_OPEN_FILES": _open_files_limit(), **node_env, **env})
    ray = _ray_cli() if head else f"{sys.executable} {LOOPBACK_CLI}"
    # A pod has CPUs of its own; here the head shares two with the worker's engine (and whatever
    # else runs on the machine), so it gets a higher priority to start its agents in time.
    nice = HEAD_NICE if head else 0
    return RayNode(name, container_command(params, head=head, ray=ray), full_env, temp_dir, log_dir, nice)


# -- the Serve REST API, as KubeRay drives it ---------------------------------


def _request(method: str, url: str, body: object | None = None, timeout_s: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def deploy_serve_config(dashboard_url: str, config: dict[str, Any], timeout_s: float = 60.0) -> None:
    """PUT serveConfigV2 (as JSON) to the dashboard's Serve REST API, as KubeRay does."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status, text = _request("PUT", f"{dashboard_url}/api/serve/applications/", config, timeout_s=30)
            if status == 200:
                return
            last = f"HTTP {status}: {text[:500]}"
        except OSError as err:
            last = repr(err)
        time.sleep(1)
    raise ClusterError(f"serve config not accepted in {timeout_s:.0f}s: {last}")


def application_status(dashboard_url: str, app: str) -> str | None:
    """An application's status from the Serve REST API (what KubeRay reads), None when unknown."""
    try:
        status, text = _request("GET", f"{dashboard_url}/api/serve/applications/", timeout_s=10)
    except OSError:
        return None
    if status != 200:
        return None
    details = json.loads(text)
    found = details.get("applications", {}).get(app, {}).get("status")
    return str(found) if found is not None else None


def wait_application_running(dashboard_url: str, app: str, timeout_s: float) -> float:
    """Until the application is RUNNING; returns the seconds waited."""
    started = time.monotonic()
    status = None
    while time.monotonic() < started + timeout_s:
        status = application_status(dashboard_url, app)
        if status == "RUNNING":
            return time.monotonic() - started
        if status == "DEPLOY_FAILED":
            raise ClusterError(f"{app} failed to deploy")
        time.sleep(1)
    raise ClusterError(f"{app} not RUNNING after {timeout_s:.0f}s (last status: {status})")


# -- what the cluster holds, read by a short-lived driver ---------------------

SERVE_ACTOR_PREFIXES = ("ServeReplica:", "ProxyActor", "ServeController")


def cluster_state(gcs_address: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Cluster id, nodes and Serve's actors, from a driver in its own process.

    A separate process, so a GCS kill never reaches the test's own process.
    """
    argv = [sys.executable, "-m", "localserve.ray_cluster", gcs_address]
    env = child_env({**NODE_ENV, **LOOPBACK_ENV})
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise ClusterError(f"cluster probe failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    state: dict[str, Any] = json.loads(lines[-1])
    return state


def _probe(gcs_address: str) -> dict[str, Any]:
    import ray
    from ray._private import state as ray_state
    from ray._private import worker

    ray.init(address=gcs_address, log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
    try:
        nodes = [
            {"id": n["NodeID"], "alive": n["Alive"], "head": "node:__internal_head__" in n["Resources"]}
            for n in ray.nodes()  # type: ignore[no-untyped-call]
        ]
        actors = [
            {
                "id": a["ActorID"],
                "class": a["ActorClassName"],
                "state": a["State"],
                "pid": a["Pid"],
                "restarts": a["NumRestarts"],
                "node": a["Address"]["NodeID"],
            }
            for a in ray_state.actors().values()
            if a["ActorClassName"].startswith(SERVE_ACTOR_PREFIXES)
        ]
        node = worker.global_worker.node
        if node is None:
            raise ClusterError(f"no node after connecting to {gcs_address}")
        return {"cluster_id": node.cluster_id.hex(), "nodes": nodes, "actors": actors}
    finally:
        ray.shutdown()


def listening_sockets(pids: set[int]) -> list[tuple[int, str, str]]:
    """(pid, command name, local address) of every TCP socket these processes listen on."""
    listening: dict[str, str] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening[fields[9]] = _address(fields[1], v6)
    found = []
    for pid in sorted(pids):
        if (comm := process_name(pid)) is None:
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    inode = target[len("socket:[") : -1] if target.startswith("socket:[") else ""
                    if inode in listening:
                        found.append((pid, comm, listening[inode]))
    return found


def _address(hex_address: str, v6: bool) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp* prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = (
        ipaddress.IPv6Address(words) if v6 else ipaddress.IPv4Address(words)
    )
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0]).is_loopback


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1])), flush=True)
