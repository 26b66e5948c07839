"""A local multi-node Ray cluster on 127.0.0.1 whose worker nodes the real Ray autoscaler (v2) adds and removes.

The head is one ``ray start --head --block`` child process in a session of
its own, with the autoscaler's monitor running in it (KubeRay runs the same
monitor in a sidecar container). The worker groups are node types of Ray's
fake multi-node provider (:mod:`twin.provider`), which starts each node as a
raylet on this machine. Everything listens on 127.0.0.1 only; the GCS and
every head port is a free port, so several twins (and other Ray users) can
share the machine. Stopping the cluster ends the head's session and every
process that names the cluster's own temp dir, by pid.

Ray is imported only inside functions: :func:`prepare_driver_env` must run
before the first import of Ray in the process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from localserve.processes import Child, free_port

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
# The node provider class (loaded by Ray's monitor) and its extra config key; see twin.provider.
PROVIDER_CLASS = "twin.provider.TwinNodeProvider"
NODES_FILE_KEY = "twin_nodes_file"
# The fake provider's fixed identity of the head (ray/autoscaler/_private/fake_multi_node/node_provider.py).
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
FAKE_HEAD_NODE_TYPE = "ray.head.default"
HEAD_START_TIMEOUT_S = 120.0
HEAD_STOP_GRACE_S = 3.0
# Ray's smallest object store is 75 MiB; the twin moves no large objects.
OBJECT_STORE_BYTES = 128 * 2**20


@dataclass(frozen=True)
class NodeType:
    """One worker node type of the local cluster (a KubeRay worker group)."""

    name: str
    resources: dict[str, float]
    min_workers: int
    max_workers: int
    idle_timeout_s: float | None = None


@dataclass(frozen=True)
class Shape:
    """Everything the local cluster is started from."""

    cluster_name: str
    # `ray start` arguments of the head (after "ray"), already fitted to this machine.
    head_args: list[str]
    head_resources: dict[str, float]
    worker_types: list[NodeType]
    idle_timeout_minutes: float
    upscaling_speed: float
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    """One live Ray node of the local cluster."""

    node_id: str
    node_type: str
    ip: str
    is_head: bool
    resources: dict[str, float]
    # The HTTP port of this node's Serve proxy (see twin.provider).
    proxy_port: int


def prepare_driver_env() -> None:
    """Sets what this process needs to drive a local cluster; call it before Ray is imported.

    Ray reads these once, when it is imported:
    * ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray's own idea of this
      machine's address 127.0.0.1, so it never turns ``127.0.0.1:<port>``
      into the machine's interface address;
    * token authentication with a token of this process, passed by
      environment: Ray's default token file in ``~/.ray`` is shared by every
      cluster of the user on this machine.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def driver_env() -> dict[str, str]:
    """What :func:`prepare_driver_env` set, for the cluster's processes."""
    return {
        name: os.environ[name]
        for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
        if name in os.environ
    }


def autoscaling_config(shape: Shape, gcs_address: str, nodes_file: Path) -> dict[str, Any]:
    """The autoscaler's cluster config: Ray's fake multi-node provider and the stack's node types."""
    node_types: dict[str, Any] = {
        FAKE_HEAD_NODE_TYPE: {"resources": dict(shape.head_resources), "node_config": {}, "max_workers": 0},
    }
    for node_type in shape.worker_types:
        entry: dict[str, Any] = {
            "resources": dict(node_type.resources),
            "node_config": {},
            "min_workers": node_type.min_workers,
            "max_workers": node_type.max_workers,
        }
        if node_type.idle_timeout_s is not None:
            entry["idle_timeout_s"] = node_type.idle_timeout_s
        node_types[node_type.name] = entry
    return {
        "cluster_name": shape.cluster_name,
        "max_workers": sum(t.max_workers for t in shape.worker_types),
        "upscaling_speed": shape.upscaling_speed,
        "idle_timeout_minutes": shape.idle_timeout_minutes,
        "provider": {
            "type": "external",
            "module": PROVIDER_CLASS,
            "gcs_address": gcs_address,
            "head_node_id": FAKE_HEAD_NODE_ID,
            # One node per create call: autoscaler v2 asks for several at once.
            "launch_multiple": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            NODES_FILE_KEY: str(nodes_file),
        },
        "head_node_type": FAKE_HEAD_NODE_TYPE,
        "available_node_types": node_types,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _ray_executable() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


class LocalCluster:
    """The running cluster: start, connect, look at its nodes, stop."""

    def __init__(
        self, shape: Shape, workdir: Path, base_env: Mapping[str, str], head_proxy_port: int | None = None
    ) -> None:
        self.shape = shape
        self.workdir = workdir
        # Short: Ray's unix sockets live under it and must stay below 108 bytes.
        self.temp_dir = workdir / "r"
        self.gcs_port = free_port()
        self.head_proxy_port = head_proxy_port or free_port()
        self.nodes_file = workdir / "nodes.json"
        self.config_file = workdir / "autoscaling.yaml"
        self.env = {**base_env, **shape.env, **driver_env()}
        self.head: Child | None = None

    @property
    def gcs_address(self) -> str:
        """The head's GCS address."""
        return f"{LOOPBACK}:{self.gcs_port}"

    def head_argv(self) -> list[str]:
        """The head's full command line: the fitted KubeRay arguments plus this cluster's own paths and ports."""
        return [
            _ray_executable(),
            *self.shape.head_args,
            f"--port={self.gcs_port}",
            f"--node-ip-address={LOOPBACK}",
            f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={self.config_file}",
        ]

    def start(self, timeout_s: float = HEAD_START_TIMEOUT_S) -> None:
        """Write the autoscaling config, start the head, and wait until its GCS answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nodes_file.write_text("{}")
        config = autoscaling_config(self.shape, self.gcs_address, self.nodes_file)
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.head = Child.start(
            "ray-head", self.head_argv(), self.env, self.workdir / "head.log", marker=str(self.temp_dir)
        )
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.head.log_path.read_text(errors="replace"):
            if self.head.proc.poll() is not None:
                raise RuntimeError(f"the head exited with {self.head.proc.returncode}:\n{self.head.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head did not start in {timeout_s:.0f}s:\n{self.head.log_tail()}")
            time.sleep(0.5)

    def connect(self) -> None:
        """Connect this process to the cluster as a driver (on the head's raylet)."""
        import ray

        missing = {k: v for k, v in driver_env().items() if os.environ.get(k) != v}
        if missing:
            raise RuntimeError(f"prepare_driver_env() must run before Ray is imported (missing {sorted(missing)})")
        ray.init(
            address=self.gcs_address,
            _node_ip_address=LOOPBACK,
            log_to_driver=False,
            logging_level=logging.WARNING,
            namespace="twin",
        )

    def proxy_ports(self) -> dict[str, dict[str, Any]]:
        """What the provider wrote: node id -> node type and Serve proxy port."""
        try:
            data = json.loads(self.nodes_file.read_text())
        except (OSError, ValueError):
            return {}
        return dict(data)

    def nodes(self) -> list[Node]:
        """The live nodes, as Ray's GCS reports them."""
        import ray

        ports = self.proxy_ports()
        # Typed here: Ray's own function is not annotated.
        gcs_nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
        result = []
        for info in gcs_nodes():
            if not info.get("Alive"):
                continue
            node_id = str(info["NodeID"])
            is_head = node_id == FAKE_HEAD_NODE_ID
            known = ports.get(node_id, {})
            result.append(
                Node(
                    node_id=node_id,
                    node_type=FAKE_HEAD_NODE_TYPE if is_head else str(known.get("node_type", "(starting)")),
                    ip=str(info.get("NodeManagerAddress", "")),
                    is_head=is_head,
                    resources={str(k): float(v) for k, v in (info.get("Resources") or {}).items()},
                    proxy_port=self.head_proxy_port if is_head else int(known.get("proxy_port", 0)),
                )
            )
        return result

    def log_tail(self, lines: int = 40) -> str:
        """The head's own output (where `ray start` and the monitor report)."""
        return self.head.log_tail(lines) if self.head else ""

    def monitor_log_tail(self, lines: int = 40) -> str:
        """The autoscaler's log, for a failure report."""
        logs = sorted(self.temp_dir.glob("session_*/logs/monitor.log"))
        if not logs:
            return ""
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Disconnect, then end the head's session and every process naming this cluster's temp dir."""
        import ray

        if ray.is_initialized():
            # The processes are killed next either way.
            with contextlib.suppress(Exception):
                ray.shutdown()
        if self.head is not None:
            # The checks are done. On SIGTERM `ray start --block` stops every process it started,
            # gracefully and one after another, which took the whole of a 15 s grace at the end of
            # every twin; what is left after HEAD_STOP_GRACE_S gets SIGKILL, as a deleted pod's does.
            self.head.stop(grace_s=HEAD_STOP_GRACE_S)
