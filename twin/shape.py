"""The local cluster a rendered RayService becomes, and every way it differs from the render.

The head starts from the very ``ray start`` line KubeRay builds for it
(:mod:`twin.kuberay`, as parsed by Ray in :mod:`twin.checks`); the worker
groups become node types of the autoscaler with the resources, bounds and
idle timeouts of Ray's own KubeRay conversion. What changes is what this
machine needs, and each change is returned as one printable line:

* CPUs and memory per node are capped (a 42-CPU node would make Ray start
  42 worker processes); GPUs and custom resources stay, as logical
  resources, so the autoscaler still has to pick the node type a bundle
  asks for;
* every port is a free port on 127.0.0.1, the dashboard is off, the
  autoscaler runs in the head (KubeRay runs it in a sidecar, hence
  ``--no-monitor`` in the render);
* idle timeouts are shortened so scale-down happens within the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localserve.processes import free_port
from twin.checks import ParsedStart
from twin.cluster import OBJECT_STORE_BYTES, NodeType, Shape
from workloads.inference_server.catalog import WORKER_NICENESS_ENV

MAX_NODE_CPUS = 4
MAX_NODE_MEMORY = 2 * 2**30
TWIN_IDLE_TIMEOUT_S = 15.0
# Head flags the twin sets itself (ports, paths) or drops; see fit_head_args.
_HEAD_PORT_FLAGS = (
    "metrics_export_port",
    "dashboard_agent_listen_port",
    "dashboard_agent_grpc_port",
    "ray_client_server_port",
    "runtime_env_agent_port",
    "dashboard_port",
)
# Logged and environment settings every local node shares.
TWIN_NODE_ENV = {
    "RAY_FAKE_CLUSTER": "1",
    "RAY_enable_autoscaler_v2": "1",
    # The fake provider knows the head by this id.
    "RAY_CLOUD_INSTANCE_ID": "fffffffffffffffffffffffffffffffffffffffffffffffffff00000",
    # Ray would start one idle worker process per logical CPU on every node.
    "RAY_prestart_worker_first_driver": "0",
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
}


@dataclass(frozen=True)
class FittedShape:
    """The cluster shape and the lines that say how it differs from the render."""

    shape: Shape
    substitutions: list[str]


def _gib(value: float) -> str:
    return f"{value / 2**30:g}Gi"


def fit_resources(name: str, resources: Mapping[str, float], subs: list[str]) -> dict[str, float]:
    """A node type's resources, capped to what this machine holds."""
    fitted = {k: float(v) for k, v in resources.items()}
    changes = []
    if fitted.get("CPU", 0) > MAX_NODE_CPUS:
        changes.append(f"CPU {fitted['CPU']:g} -> {MAX_NODE_CPUS}")
        fitted["CPU"] = float(MAX_NODE_CPUS)
    if fitted.get("memory", 0) > MAX_NODE_MEMORY:
        changes.append(f"memory {_gib(fitted['memory'])} -> {_gib(MAX_NODE_MEMORY)}")
        fitted["memory"] = float(MAX_NODE_MEMORY)
    fitted["object_store_memory"] = float(OBJECT_STORE_BYTES)
    changes.append(f"object store {_gib(OBJECT_STORE_BYTES)}")
    kept = [f"{k} {v:g}" for k, v in fitted.items() if k not in ("CPU", "memory", "object_store_memory")]
    if kept:
        changes.append("kept as logical resources: " + ", ".join(kept))
    subs.append(f"node type {name}: " + "; ".join(changes))
    return fitted


def fit_head_args(
    head: ParsedStart, head_resources: Mapping[str, float], head_http_port: int, subs: list[str]
) -> list[str]:
    """The head's ``ray start`` arguments (after ``ray``) from KubeRay's, fitted to this machine."""
    params = dict(head.params)
    args = ["start", "--head", "--block"]
    cpus = params.get("num_cpus")
    if cpus is not None:
        fitted = min(int(cpus), MAX_NODE_CPUS)
        if fitted != int(cpus):
            subs.append(f"head: --num-cpus={cpus} -> {fitted}")
        args.append(f"--num-cpus={fitted}")
    if params.get("num_gpus") is not None:
        args.append(f"--num-gpus={params['num_gpus']}")
    memory = params.get("memory")
    if memory is not None:
        fitted_memory = min(int(memory), MAX_NODE_MEMORY)
        if fitted_memory != int(memory):
            subs.append(f"head: --memory={memory} -> {fitted_memory}")
        args.append(f"--memory={fitted_memory}")
    if head.resources:
        import json

        args.append(f"--resources={json.dumps(head.resources)}")
    if params.get("labels"):
        args.append(f"--labels={params['labels']}")
    args.append(f"--object-store-memory={OBJECT_STORE_BYTES}")
    if params.get("no_monitor"):
        subs.append("head: --no-monitor dropped (KubeRay runs the autoscaler in a sidecar; here it runs in the head)")
    if params.get("include_dashboard") is not False:
        subs.append(
            f"head: dashboard off (was --dashboard-host={params.get('dashboard_host')}); "
            "serveConfigV2 goes through Serve's deploy_apps, as the dashboard's serve API does"
        )
    args.append("--include-dashboard=false")
    changed = [
        f"--{flag.replace('_', '-')}={params[flag]}" for flag in _HEAD_PORT_FLAGS if params.get(flag) is not None
    ]
    subs.append(
        "head: every port a free port on 127.0.0.1"
        + (f" (was {' '.join(changed)})" if changed else "")
        + f"; Serve's HTTP proxy on the head at 127.0.0.1:{head_http_port}"
    )
    args += [
        f"--metrics-export-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        # The dashboard process runs even with the dashboard off (its API server), on 8265 unless told.
        f"--dashboard-port={free_port()}",
        "--min-worker-port=0",
        "--max-worker-port=0",
    ]
    del head_resources  # the head's node type carries them; the command line is what starts the node
    return args


def fit_shape(
    name: str,
    autoscaling: Mapping[str, Any],
    head: ParsedStart,
    head_http_port: int,
    extra_env: Mapping[str, str],
    idle_timeout_s: float | None = TWIN_IDLE_TIMEOUT_S,
) -> FittedShape:
    """The local cluster for one RayService, from Ray's autoscaling config and the head's parsed command.

    ``idle_timeout_s`` caps the rendered idle timeouts (None keeps them).
    """
    subs: list[str] = []
    node_types = dict(autoscaling["available_node_types"])
    head_type = node_types.pop("headgroup")
    head_resources = fit_resources("headgroup", head_type["resources"], subs)
    rendered_idle_s = float(autoscaling["idle_timeout_minutes"]) * 60
    cap = rendered_idle_s if idle_timeout_s is None else idle_timeout_s
    workers = []
    for type_name, node_type in node_types.items():
        timeout = node_type.get("idle_timeout_s")
        workers.append(
            NodeType(
                name=type_name,
                resources=fit_resources(type_name, node_type["resources"], subs),
                min_workers=int(node_type["min_workers"]),
                max_workers=int(node_type["max_workers"]),
                idle_timeout_s=None if timeout is None else min(float(timeout), idle_timeout_s or float(timeout)),
            )
        )
    if rendered_idle_s > cap:
        subs.append(f"autoscaler idle timeout {rendered_idle_s:g}s -> {cap:g}s")
    subs.append(
        "autoscaler: Ray's fake multi-node provider, every worker node a raylet on 127.0.0.1, checked every "
        f"{TWIN_NODE_ENV['AUTOSCALER_UPDATE_INTERVAL_S']}s"
    )
    for key, value in extra_env.items():
        subs.append(f"environment from the pod templates: {key}={value}")
    shape = Shape(
        cluster_name=name,
        head_args=fit_head_args(head, head_resources, head_http_port, subs),
        head_resources=head_resources,
        worker_types=workers,
        idle_timeout_minutes=min(rendered_idle_s, cap) / 60,
        upscaling_speed=float(autoscaling.get("upscaling_speed", 1.0)),
        env={**TWIN_NODE_ENV, **extra_env},
    )
    return FittedShape(shape=shape, substitutions=subs)


# Container environment the Ray and Serve processes read; the twin's nodes get it too.
_FORWARDED_ENV_PREFIXES = ("RAY_SERVE_", "RAYLLM_", "RAY_SERVE_LLM_", "VLLM_", *WORKER_NICENESS_ENV)


def pod_env(cluster: Mapping[str, Any]) -> dict[str, str]:
    """Ray/Serve/vLLM settings from the Ray containers' ``env`` (same value in every group, or not forwarded)."""
    groups = [cluster.get("headGroupSpec") or {}, *(cluster.get("workerGroupSpecs") or [])]
    found: dict[str, str] = {}
    for group in groups:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or [{}]
        for item in containers[0].get("env") or []:
            name = str(item.get("name", ""))
            if name.startswith(_FORWARDED_ENV_PREFIXES) and "value" in item:
                found.setdefault(name, str(item["value"]))
    return found
