"""`VllmRayService`: one KubeRay RayService serving one or more catalogue models.

The manifest is built by plain functions from typed inputs (config models,
placement objects, the ports object), so tests can check every value without
running Pulumi; the component only declares it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra import versions
from infra.aws.layer import RedisEndpoint
from infra.config import (
    RAY_SERVICE_NAME_MAX,
    ColdStartTimeouts,
    Model,
    StackConfig,
    pulumi_wait_seconds,
)
from infra.scheduling import GpuPlacement, Placement
from infra.serving import kuberay
from infra.serving.drain import drain, prestop_hook
from infra.serving.namespace import PART_OF, REDIS_PASSWORD_KEY
from infra.serving.pod_security import (
    RAY_GID,
    RAY_UID,
    autoscaler_token_mount,
    autoscaler_token_volume,
    checkov_skips,
    container_security_context,
    pod_security_context,
)
from infra.serving.ports import RAY_PORTS, Port
from infra.serving.serve_config import INGRESS_RESOURCE, MOUNTS, READINESS, serve_config_yaml
from workloads.inference_server.catalog import NODE_DRAIN_FILE, NODE_DRAIN_FILE_ENV, WORKER_NICENESS_ENV, Layout

RAY_SERVICE_TYPE = "kubernetes:ray.io/v1:RayService"
RAY_CONTAINER = "ray"
INGRESS_GROUP = "ingress"

# Pulumi waits until every condition of the list holds: KubeRay's Ready,
# and UpgradeInProgress back to False (during a NewCluster upgrade the old
# cluster keeps Ready true until the new one has taken over, or forever if it
# never does). The `condition=` form also waits until KubeRay has observed the
# applied generation, so a status left from before the change never counts.
# Model download and engine start dominate the wait: big models stream tens
# of GiB from S3 and compile CUDA graphs.
WAIT_FOR_CONDITIONS = ("condition=Ready", "condition=UpgradeInProgress=False")
WAIT_FOR = json.dumps(list(WAIT_FOR_CONDITIONS))
# Pulumi's timeout message names the resource and nothing else. This
# annotation (shown by `kubectl describe rayservice` and in the diff of the
# first `pulumi up` that adds it) says what to run then: one line per
# RayService with its upgrade phase and the likely cause
# (infra/serving/upgrade_status.py). Metadata only: KubeRay hashes
# rayClusterConfig alone, so it starts no cluster.
ON_TIMEOUT_ANNOTATION = "llm-platform/on-timeout"


def on_timeout_hint(namespace: str) -> str:
    """The command a timed-out wait points to."""
    return f"make upgrade-status STACK=<stack>, or: python -m infra.upgrade_status --namespace {namespace}"


# What a node keeps for itself: kubelet/system reserve and the daemonsets
# (CNI, kube-proxy, EBS CSI, DCGM exporter, device plugin, node exporter).
NODE_RESERVED_CPU = 1.0
NODE_RESERVED_MEMORY_GIB = 4.0
NODE_ALLOCATABLE_SHARE = 0.9
# Ray puts its object store in /dev/shm; vLLM's tensor-parallel workers use
# it for NCCL. Memory-backed, so it counts against the pod's memory.
SHM_SHARE = 0.3

INGRESS_CPU = 2
INGRESS_MEMORY_GIB = 4
# The RayService a pod belongs to; KubeRay's own `ray.io/cluster` label
# changes with every NewCluster upgrade.
SERVICE_LABEL = kuberay.SERVICE_LABEL
# KubeRay's label for a pod's worker group.
RAY_GROUP_LABEL = "ray.io/group"
RAY_CLUSTER_LABEL = "ray.io/cluster"
ZONE_LABEL = "topology.kubernetes.io/zone"
# The system CA bundle of the serving image (Debian/Ubuntu's ca-certificates;
# the rayproject/ray-llm base is Ubuntu and its own build fetches over HTTPS
# with it). ElastiCache's server certificates chain to Amazon's public roots,
# which it holds, so the GCS verifies its `rediss://` Redis against it.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
REDIS_CA_CERT_ENV = "RAY_REDIS_CA_CERT"
# Serve LLM's engine start timeout (ray/llm/_internal/serve/constants.py).
ENGINE_START_TIMEOUT_ENV = "RAYLLM_ENGINE_START_TIMEOUT_S"
# A vllm-server replica's wait for its vLLM server's first /health
# (workloads/inference_server/vllm_server.py): the same engine start, so
# the same timeout.
VLLM_SERVER_START_TIMEOUT_ENV = "INFERENCE_VLLM_START_TIMEOUT_S"
# The Ray autoscaler v2's reconciler gives up on an instance stuck in
# ALLOCATED (pod created, Ray not yet up: node, image pull) or RAY_INSTALLING
# after these (ray/autoscaler/v2/instance_manager/config.py; 3600 s and
# 1800 s by default). Set on the autoscaler sidecar so the cold-start rule
# can hold them above the budget.
AUTOSCALER_ALLOCATE_TIMEOUT_ENV = "RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S"
AUTOSCALER_RAY_INSTALL_TIMEOUT_ENV = "RAY_AUTOSCALER_RECONCILE_RAY_INSTALL_STATUS_TIMEOUT_S"
ENGINE_CACHE_VOLUME = "engine-cache"
# vLLM's OpenAI server answers its health route without an API key
# (workloads' guard); a stopping replica answers 503 there before it drains.
VLLM_HEALTH_PATH = "/health"
# torch.compile, CUDA graph and Triton artefacts of one engine: a few GiB.
ENGINE_CACHE_GIB = 20


def pod_labels(service: str) -> dict[str, str]:
    """Labels on every pod of one RayService."""
    return {**PART_OF, SERVICE_LABEL: service}


# Checks that can not apply to a Ray pod, with the reason (checkov.io/skip annotations).
RAY_CHECKOV_SKIPS = {
    "CKV_K8S_22": "Ray and vLLM write session state, logs and compile caches under /tmp and the home directory",
    "CKV_K8S_40": "the image's own user is uid 1000 (workloads/Dockerfile), owner of its Python environment",
    "CKV_K8S_8": "KubeRay adds the liveness probe (dashboard agent /api/healthz) when it builds the pod",
    "CKV_K8S_9": "KubeRay adds the readiness probe (raylet health, Serve's /-/healthz on workers) to the pod",
}


def ray_pod_security() -> dict[str, Any]:
    """Pod-level security of every Ray pod: the image's non-root user, RuntimeDefault seccomp, no token.

    fsGroup makes the cache volumes (emptyDirs) writable by the image's group.
    """
    return {
        "securityContext": pod_security_context(RAY_UID, RAY_GID, fs_group=True),
        "automountServiceAccountToken": False,
    }


def ray_container_security() -> dict[str, Any]:
    """The Ray container's context; KubeRay copies it to the init container it adds to workers."""
    return container_security_context(read_only_root=False)


# With GCS fault tolerance KubeRay hands the head the Redis password as the
# environment variable REDIS_PASSWORD (from gcsFaultToleranceOptions'
# secretKeyRef; common/pod.go configureRedisFT), which Ray and the Redis
# cleanup Job read: it can not be a file.
HEAD_REDIS_CHECKOV_SKIPS = {
    **RAY_CHECKOV_SKIPS,
    "CKV_K8S_35": "KubeRay passes the GCS Redis password to Ray as REDIS_PASSWORD, from the Secret (configureRedisFT)",
}
# A vllm-server GPU worker declares its own readiness probe (vllm_readiness_probe).
VLLM_SERVER_CHECKOV_SKIPS = {k: v for k, v in RAY_CHECKOV_SKIPS.items() if k != "CKV_K8S_9"}


def ray_pod_metadata(service: str, skips: dict[str, str] = RAY_CHECKOV_SKIPS) -> dict[str, Any]:
    """A Ray pod template's labels and its checkov skips."""
    return {"labels": pod_labels(service), "annotations": checkov_skips(skips)}


def autoscaler_security() -> dict[str, Any]:
    """`autoscalerOptions` fields for the sidecar KubeRay adds to the head: restricted, with its own token.

    The only container of a Ray pod that calls the Kubernetes API; the head
    pod mounts no token, so the Ray container (and any job it runs) has none.
    """
    return {
        # The autoscaler runs Ray's own CLI, which keeps its logs and
        # temporary files under /tmp like the Ray container.
        "securityContext": container_security_context(read_only_root=False),
        "volumeMounts": [autoscaler_token_mount()],
    }


def aws_region_env(region: str) -> list[dict[str, str]]:
    """The region for the AWS SDKs: pods can not look it up in the instance metadata (hop limit 1)."""
    return [{"name": "AWS_REGION", "value": region}, {"name": "AWS_DEFAULT_REGION", "value": region}]


def spread_over_nodes(service: str, group: str) -> dict[str, Any]:
    """At most one more pod of a group on any node than on another.

    Scoped to one RayCluster with `matchLabelKeys`, so during a NewCluster
    upgrade the new cluster's pods are not held back by the old ones'.
    """
    return {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {SERVICE_LABEL: service, RAY_GROUP_LABEL: group}},
        "matchLabelKeys": [RAY_CLUSTER_LABEL],
    }


def spread_over_zones(service: str, group: str) -> dict[str, Any]:
    """A group's pods spread over the zones as evenly as capacity allows, per RayCluster.

    A preference (`ScheduleAnyway`), not a rule: a node group spans every
    zone and cluster-autoscaler can not choose the zone of the node it adds,
    so a hard rule could leave a replica pending beside a free node in
    another zone.
    """
    return {**spread_over_nodes(service, group), "topologyKey": ZONE_LABEL, "whenUnsatisfiable": "ScheduleAnyway"}


@dataclass(frozen=True)
class GpuShape:
    """How one Serve replica of a model lands on a GPU group's nodes."""

    gpus_per_host: int
    hosts: int
    cpu: int
    memory_gib: int
    shm_gib: int


def gpu_shape(model: Model, placement: GpuPlacement) -> GpuShape:
    """GPUs per pod (TP x PP when one node holds it, else TP with PP hosts) and the pod's share of the node."""
    per_node = placement.gpus_per_node
    total = model.tensor_parallel_size * model.pipeline_parallel_size
    if total <= per_node:
        gpus, hosts = total, 1
    else:
        # The config rules make each pipeline stage fill a whole node.
        gpus, hosts = model.tensor_parallel_size, model.pipeline_parallel_size
    share = gpus / per_node
    inst = placement.instance
    cpu = max(1, math.floor((inst.vcpus * NODE_ALLOCATABLE_SHARE - NODE_RESERVED_CPU) * share))
    memory = max(4, math.floor((inst.memory_gib * NODE_ALLOCATABLE_SHARE - NODE_RESERVED_MEMORY_GIB) * share))
    return GpuShape(gpus, hosts, cpu, memory, max(1, math.floor(memory * SHM_SHARE)))


def accelerator_resources(placement: GpuPlacement) -> dict[str, str]:
    """The Ray custom resource a GPU group's nodes advertise, as KubeRay group `resources`."""
    return {f"accelerator_type:{placement.instance.ray_accelerator_type}": "1"}


def worker_group_name(model: Model) -> str:
    """The GPU worker group of a model (also its pods' `ray.io/group` label)."""
    return f"gpu-{model.name}"


@dataclass(frozen=True)
class VllmRayServiceArgs:
    """Everything one RayService is made from."""

    cfg: StackConfig
    name: str
    models: list[Model]
    namespace: str
    image: pulumi.Input[str]
    system: Placement
    gpu: dict[str, GpuPlacement]
    model_reader_service_account: str
    api_keys_secret: str
    storage_class: str
    prometheus_url: str
    grafana_url: str
    serving_priority_class: str
    serve_service: dict[str, Any]
    redis: RedisEndpoint | None = None
    redis_secret: str | None = None

    @property
    def layout(self) -> Layout:
        """How requests reach this RayService's engines (from its models, as the config resolves it)."""
        return self.cfg.layout_for(self.models)

    @property
    def woken(self) -> bool:
        """Whether the model gateway wakes this RayService's model from zero (through its head)."""
        return self.name in self.cfg.woken_services()


def _ports(ports: list[Port]) -> list[dict[str, object]]:
    return [p.container_port() for p in ports]


def _api_keys_volume(args: VllmRayServiceArgs) -> tuple[dict[str, Any], dict[str, Any]]:
    """The API keys, for the pods a guard runs in (guard_runs_on): never the head, which answers no request."""
    volume = {"name": "api-keys", "secret": {"secretName": args.api_keys_secret, "defaultMode": 0o444}}
    mount = {"name": "api-keys", "mountPath": MOUNTS.api_keys_dir, "readOnly": True}
    return volume, mount


def head_env(args: VllmRayServiceArgs) -> list[dict[str, Any]]:
    """The head container's environment: where Prometheus and Grafana are, and the Redis CA for the GCS."""
    env: list[dict[str, Any]] = [
        {"name": "RAY_PROMETHEUS_HOST", "value": args.prometheus_url},
        {"name": "RAY_GRAFANA_HOST", "value": args.grafana_url},
    ]
    if args.redis is not None and args.redis.tls:
        # Without a CA the GCS can not verify the Redis' certificate
        # (CERTIFICATE_VERIFY_FAILED) and the head crash-loops.
        env.append({"name": REDIS_CA_CERT_ENV, "value": SYSTEM_CA_BUNDLE})
    return env


def drain_and_spread(args: VllmRayServiceArgs, group: dict[str, Any]) -> dict[str, Any]:
    """A worker group with its drain (infra/serving/drain.py) and, in prod, its zone spread.

    Every worker pod gets the preStop hook on its Ray container and a grace
    period that covers it. Prod spreads single-host groups over the zones; a
    multi-host replica's pipeline stages stay wherever the scheduler puts
    them together.
    """
    timings = drain(args.cfg)
    spec = group["template"]["spec"]
    spec["terminationGracePeriodSeconds"] = timings.grace_seconds
    for container in spec["containers"]:
        if container["name"] == RAY_CONTAINER:
            servers = any(e["name"] == NODE_DRAIN_FILE_ENV for e in container.get("env") or [])
            container["lifecycle"] = prestop_hook(timings.prestop_seconds, NODE_DRAIN_FILE if servers else None)
    if args.cfg.is_prod and group.get("numOfHosts", 1) == 1:
        spread = spread_over_zones(args.name, group["groupName"])
        spec["topologySpreadConstraints"] = [*spec.get("topologySpreadConstraints", []), spread]
    return group


def guard_runs_on(layout: Layout) -> frozenset[str]:
    """The groups whose pods run the API-key guard, and so mount the keys: "ingress" and/or "gpu".

    serve-ingress: the OpenAI ingress replicas, on the ingress group (the
    models' replicas answer only the ingress). vllm-server: each model
    replica's own vLLM server, on the GPU groups. Never the head: it holds
    the GCS, the Serve controller and a proxy that routes to the replicas,
    and its job API runs arbitrary code, so a key there serves nobody and
    is one more place to read it from.
    """
    return frozenset({"gpu"}) if layout == "vllm-server" else frozenset({"ingress"})


def _head(args: VllmRayServiceArgs) -> dict[str, Any]:
    cfg = args.cfg
    resources = {"cpu": cfg.ray.head_cpu, "memory": cfg.ray.head_memory}
    return {
        "rayStartParams": {
            # No Ray tasks or replicas on the head: it holds the GCS and the
            # Serve controller, and losing it to an OOM loses the cluster.
            "num-cpus": "0",
            "dashboard-host": "0.0.0.0",
            "metrics-export-port": str(RAY_PORTS.metrics.number),
        },
        "template": {
            "metadata": ray_pod_metadata(
                args.name, RAY_CHECKOV_SKIPS if args.redis is None else HEAD_REDIS_CHECKOV_SKIPS
            ),
            "spec": {
                **args.system.pod_scheduling(),
                **ray_pod_security(),
                "containers": [
                    {
                        "name": RAY_CONTAINER,
                        "image": args.image,
                        "securityContext": ray_container_security(),
                        "ports": _ports(RAY_PORTS.head(args.layout, woken=args.woken)),
                        "env": head_env(args),
                        "resources": {"requests": resources, "limits": resources},
                    }
                ],
                "volumes": [autoscaler_token_volume()],
            },
        },
    }


def _ingress_group(args: VllmRayServiceArgs) -> dict[str, Any]:
    keys_volume, keys_mount = _api_keys_volume(args)
    resources = {"cpu": str(INGRESS_CPU), "memory": f"{INGRESS_MEMORY_GIB}Gi"}
    ingress = args.cfg.serving.ingress
    # Sized from the ingress deployment's own bounds, so every pod of this
    # group holds a replica and so a proxy, which its readiness probe needs.
    minimum = ingress.nodes(ingress.min_replicas)
    return {
        "groupName": INGRESS_GROUP,
        # Serve's OpenAI ingress replicas (CPU only) and a proxy that takes traffic.
        "minReplicas": minimum,
        "maxReplicas": ingress.nodes(ingress.max_replicas),
        "replicas": minimum,
        # As many as the replicas a node may hold: Ray then places them here
        # only, never on a GPU worker or the head (serve_config.INGRESS_RESOURCE).
        "resources": {INGRESS_RESOURCE: str(ingress.max_replicas_per_node)},
        "rayStartParams": {"metrics-export-port": str(RAY_PORTS.metrics.number)},
        "template": {
            "metadata": ray_pod_metadata(args.name),
            "spec": {
                **args.system.pod_scheduling(),
                **ray_pod_security(),
                "topologySpreadConstraints": [spread_over_nodes(args.name, INGRESS_GROUP)],
                "containers": [
                    {
                        "name": RAY_CONTAINER,
                        "image": args.image,
                        "securityContext": ray_container_security(),
                        "ports": _ports(RAY_PORTS.worker()),
                        "resources": {"requests": resources, "limits": resources},
                        "volumeMounts": [keys_mount],
                    }
                ],
                "volumes": [keys_volume],
            },
        },
    }


def engine_cache_env(cache_root: str = MOUNTS.cache_dir) -> list[dict[str, str]]:
    """Where vLLM, torch.compile and Triton keep what they build at start-up: the pod's local emptyDir.

    vLLM 0.29 reads VLLM_CACHE_ROOT (its torch.compile artefacts and CUDA
    graph metadata go under it, else `$XDG_CACHE_HOME/vllm`); Inductor reads
    TORCHINDUCTOR_CACHE_DIR (else /tmp/torchinductor_<user>) and Triton
    TRITON_CACHE_DIR (else ~/.triton). One root on one emptyDir: it lives in
    kubelet's ephemeral storage, which the node's bootstrap puts on the
    instance-store RAID0 (infra/aws/node_bootstrap.py), so the compile writes
    go to local NVMe instead of the EBS root volume or the container layer.
    """
    root = PurePosixPath(cache_root)
    return [
        {"name": "XDG_CACHE_HOME", "value": str(root / "xdg")},
        {"name": "VLLM_CACHE_ROOT", "value": str(root / "vllm")},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": str(root / "torchinductor")},
        {"name": "TRITON_CACHE_DIR", "value": str(root / "triton")},
    ]


def gpu_worker_env(
    region: str, timeouts: ColdStartTimeouts, cache_root: str = MOUNTS.cache_dir, layout: Layout = "serve-ingress"
) -> list[dict[str, str]]:
    """The GPU worker container's environment: region, engine caches, the engine start timeout.

    EKS Pod Identity adds the credential variables itself
    (infra/aws/identities.POD_IDENTITY_ENV); the S3 endpoint is the SDK's
    default regional one, reached through the VPC's S3 gateway endpoint.
    """
    env = [
        *aws_region_env(region),
        *engine_cache_env(cache_root),
        # Serve LLM cancels an engine that has not started by then (ray.llm's
        # ENGINE_START_TIMEOUT_S, 3600 s by default); the cold-start rule holds it
        # above the budget (infra/capacity/cold_start.py).
        {"name": ENGINE_START_TIMEOUT_ENV, "value": str(timeouts.engine_start_seconds)},
        *({"name": name, "value": value} for name, value in WORKER_NICENESS_ENV.items()),
    ]
    if layout == "vllm-server":
        env.append({"name": VLLM_SERVER_START_TIMEOUT_ENV, "value": str(timeouts.engine_start_seconds)})
        # The preStop hook's file: every vLLM server of the pod drains when it appears.
        env.append({"name": NODE_DRAIN_FILE_ENV, "value": NODE_DRAIN_FILE})
    return env


def uses_hub(models: list[Model]) -> bool:
    """Whether any model of the service downloads from a model hub (S3 weights stream, nothing is stored)."""
    return any(m.weights_kind == "hub" for m in models)


def _gpu_volumes(args: VllmRayServiceArgs, shape: GpuShape, models: list[Model]) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shape.shm_gib}Gi"}},
        # Compile and kernel caches (engine_cache_env), on the node's local disk.
        {"name": ENGINE_CACHE_VOLUME, "emptyDir": {"sizeLimit": f"{ENGINE_CACHE_GIB}Gi"}},
    ]
    if uses_hub(models):
        # Only a hub download is written to disk. The gp3 volume per pod this
        # replaced cost an EBS create and attach on every cold start and was
        # never read by S3 sources (runai_streamer streams into memory); an
        # emptyDir sits on the instance-store RAID0 the node already has.
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": f"{args.cfg.storage.model_cache_gib}Gi"}})
    return volumes


def _gpu_mounts(models: list[Model], keys_mount: dict[str, Any] | None) -> list[dict[str, Any]]:
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": ENGINE_CACHE_VOLUME, "mountPath": MOUNTS.cache_dir},
    ]
    if uses_hub(models):
        mounts.append({"name": "model-cache", "mountPath": MOUNTS.model_cache_dir})
    return [*mounts, keys_mount] if keys_mount is not None else mounts


def vllm_readiness_probe() -> dict[str, Any]:
    """A vllm-server replica's pod takes traffic while its vLLM server says it is healthy.

    Given here, KubeRay 1.7 adds no readiness probe of its own
    (pod.go initLivenessAndReadinessProbe only fills a missing one): its
    RayService worker probe asks Serve's proxy on the `serve` port, which
    this layout does not run on workers. A draining replica answers 503 and
    keeps serving for READINESS.drain_notice_s (the probe's misses plus the
    load balancer's deregistration) before its server stops.
    """
    return {
        "httpGet": {"path": VLLM_HEALTH_PATH, "port": RAY_PORTS.openai.name, "scheme": "HTTP"},
        "initialDelaySeconds": 10,
        "periodSeconds": READINESS.period_s,
        "timeoutSeconds": READINESS.timeout_s,
        "successThreshold": 1,
        "failureThreshold": READINESS.failure_threshold,
    }


def _gpu_container(args: VllmRayServiceArgs, limits: dict[str, str], mounts: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": RAY_CONTAINER,
        "image": args.image,
        "securityContext": ray_container_security(),
        "env": gpu_worker_env(args.cfg.region, args.cfg.ray.cold_start, layout=args.layout),
        "ports": _ports(RAY_PORTS.gpu_worker(args.layout)),
        # Equal requests and limits: GPUs can not be overcommitted and
        # Ray sizes its CPU and memory resources from the limits.
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "volumeMounts": mounts,
    }
    if args.layout == "vllm-server":
        container["readinessProbe"] = vllm_readiness_probe()
    return container


def _gpu_group(args: VllmRayServiceArgs, model: Model) -> dict[str, Any]:
    placement = args.gpu[model.gpu_group]
    shape = gpu_shape(model, placement)
    keys_volume, keys_mount = _api_keys_volume(args)
    keys = "gpu" in guard_runs_on(args.layout)
    scaling = model.autoscaling
    limits = {
        "cpu": str(shape.cpu),
        "memory": f"{shape.memory_gib}Gi",
        "nvidia.com/gpu": str(shape.gpus_per_host),
    }
    group: dict[str, Any] = {
        "groupName": worker_group_name(model),
        # KubeRay counts a multi-host replica once (numOfHosts pods), so the
        # group's bounds are Serve's replica bounds.
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "replicas": scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas,
        # Advertised before the node exists, so the autoscaler knows this group
        # can place an `accelerator_type:<GPU>` bundle when it is at zero. The
        # group-level field, not rayStartParams.resources: KubeRay writes
        # rayStartParams into `bash -c` unquoted, so a JSON value with a space
        # is split by the shell, while it quotes what it builds from this field
        # (and Ray's autoscaler reads this field as plain quantities).
        "resources": accelerator_resources(placement),
        "rayStartParams": {"metrics-export-port": str(RAY_PORTS.metrics.number)},
        "template": {
            "metadata": ray_pod_metadata(
                args.name, VLLM_SERVER_CHECKOV_SKIPS if args.layout == "vllm-server" else RAY_CHECKOV_SKIPS
            ),
            "spec": {
                **placement.pod_scheduling(),
                **ray_pod_security(),
                # EKS Pod Identity binds the model bucket role to this account.
                "serviceAccountName": args.model_reader_service_account,
                "priorityClassName": args.serving_priority_class,
                "containers": [_gpu_container(args, limits, _gpu_mounts([model], keys_mount if keys else None))],
                "volumes": [*_gpu_volumes(args, shape, [model]), *([keys_volume] if keys else [])],
            },
        },
    }
    if shape.hosts > 1:
        group["numOfHosts"] = shape.hosts
    return group


def worker_groups(args: VllmRayServiceArgs) -> list[dict[str, Any]]:
    """The ingress group (serve-ingress only: vllm-server runs no OpenAI ingress) and one GPU group per model."""
    gpu = [_gpu_group(args, m) for m in args.models]
    return [_ingress_group(args), *gpu] if args.layout == "serve-ingress" else gpu


def upgrade_strategy(cfg: StackConfig) -> dict[str, Any]:
    """The RayService's upgrade strategy, always explicit.

    `NewCluster` starts a complete second cluster at its starting replicas
    beside the old one, as scaled, on every `rayClusterConfig` change that
    KubeRay hashes (not the worker groups' replica bounds or tolerations, and
    worker groups appended at the end update the cluster in place:
    docs/changing-a-running-stack.md); its
    replicas join the load balancer as they turn Ready and the old cluster
    drains away (endpoint.py). The GPU groups are sized for both
    (`ray.upgrade_headroom`, infra/capacity/upgrade.py). `None` never
    replaces the cluster. Changes to `serveConfigV2` alone are applied in
    place either way.
    """
    return {"type": cfg.ray.upgrade_strategy}


def redis_address(redis: RedisEndpoint) -> pulumi.Output[str]:
    """The GCS's Redis URL; `rediss://` makes Ray speak TLS to ElastiCache."""
    scheme = "rediss" if redis.tls else "redis"
    return redis.address.apply(lambda a: f"{scheme}://{a}")


def autoscaler_env(timeouts: ColdStartTimeouts) -> list[dict[str, str]]:
    """The Ray autoscaler's reconcile timeouts, explicit so the cold-start rule can check them."""
    return [
        {"name": AUTOSCALER_ALLOCATE_TIMEOUT_ENV, "value": str(timeouts.autoscaler_allocate_seconds)},
        {"name": AUTOSCALER_RAY_INSTALL_TIMEOUT_ENV, "value": str(timeouts.autoscaler_ray_install_seconds)},
    ]


# Ray's token authentication (Ray 2.52 and later): with RAY_AUTH_MODE=token the
# GCS, raylets and workers refuse gRPC without the token, and the dashboard
# (8265: the job API, which runs arbitrary code) and the dashboard agent
# (52365) answer 401 without `Authorization: Bearer <token>` and 403 with a
# wrong one (ray/_private/authentication/http_token_authentication.py). The
# probes' routes stay open: /api/healthz, /api/gcs_healthz,
# /api/local_raylet_healthz, /-/healthz. KubeRay 1.7 turns it on from
# `authOptions` (common/pod.go configureTokenAuth, SetContainerTokenAuthEnvVars):
# RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the Secret's `auth_token` key
# (utils.RAY_AUTH_TOKEN_SECRET_KEY) on the Ray container of the head and of
# every worker, on the autoscaler sidecar and on the wait-gcs-ready init
# container; its operator reads the same Secret for its own dashboard calls
# (utils.GetRayDashboardClientFunc). With `secretName` KubeRay makes no Secret
# of its own: the program makes one per RayService (VllmRayService), so
# the token is in Pulumi's state as a secret and nowhere else, and only that
# RayService's pods get it.
RAY_AUTH_MODE = "token"
RAY_AUTH_TOKEN_KEY = "auth_token"
RAY_AUTH_TOKEN_LENGTH = 48


def ray_auth_secret_name(service: str) -> str:
    """The Secret holding one RayService's Ray auth token."""
    return f"{service}-ray-auth"


def auth_options(service: str) -> dict[str, str]:
    """`rayClusterConfig.authOptions`: token authentication, with the token from the program's Secret."""
    return {"mode": RAY_AUTH_MODE, "secretName": ray_auth_secret_name(service)}


def ray_service_manifest(args: VllmRayServiceArgs) -> dict[str, Any]:
    """The RayService object."""
    if len(args.name) > RAY_SERVICE_NAME_MAX:
        raise ValueError(f"RayService name '{args.name}' is longer than {RAY_SERVICE_NAME_MAX} characters")
    cfg = args.cfg
    cluster: dict[str, Any] = {
        "rayVersion": versions.RAY_VERSION,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": "v2",
            "idleTimeoutSeconds": cfg.ray.idle_timeout_seconds,
            # Add all pods a pending demand needs at once: a model replica is
            # useless until every one of its GPU pods is up.
            "upscalingMode": "Default",
            "env": autoscaler_env(cfg.ray.cold_start),
            **autoscaler_security(),
        },
        "headGroupSpec": _head(args),
        "workerGroupSpecs": [drain_and_spread(args, g) for g in worker_groups(args)],
        "authOptions": auth_options(args.name),
    }
    if args.redis is not None:
        if args.redis_secret is None:
            raise ValueError("GCS fault tolerance needs the Redis password Secret")
        cluster["gcsFaultToleranceOptions"] = {
            "redisAddress": redis_address(args.redis),
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": args.redis_secret, "key": REDIS_PASSWORD_KEY}}},
        }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {
            "name": args.name,
            "namespace": args.namespace,
            "labels": {**PART_OF, "app.kubernetes.io/name": args.name},
            "annotations": {
                "pulumi.com/waitFor": WAIT_FOR,
                "pulumi.com/timeoutSeconds": str(pulumi_wait_seconds(cfg, args.models)),
                ON_TIMEOUT_ANNOTATION: on_timeout_hint(args.namespace),
            },
        },
        "spec": {
            # The workers take traffic (Serve's proxies, or under vllm-server
            # the replicas' own vLLM servers); the head (no CPUs for
            # replicas) stays out of the serve Service.
            "excludeHeadPodFromServeSvc": True,
            "upgradeStrategy": upgrade_strategy(cfg),
            # After a NewCluster upgrade moves traffic, the old cluster
            # finishes the streams it holds before KubeRay deletes it.
            "rayClusterDeletionDelaySeconds": drain(cfg).cluster_deletion_delay_seconds,
            "serveService": args.serve_service,
            "serveConfigV2": serve_config_yaml(cfg, args.name, args.models, args.gpu),
            "rayClusterConfig": cluster,
        },
    }


class VllmRayService(pulumi.ComponentResource):
    """A RayService running Ray Serve LLM (vLLM) for the models of one `service`."""

    name: str
    ray_service: k8s.apiextensions.CustomResource

    def __init__(
        self,
        name: str,
        args: VllmRayServiceArgs,
        opts: pulumi.ResourceOptions | None = None,
    ) -> None:
        super().__init__("llm-platform:serving:VllmRayService", name, None, opts)
        self.name = args.name
        manifest = ray_service_manifest(args)
        auth = self._auth_secret(name, args)
        self.ray_service = k8s.apiextensions.CustomResource(
            name,
            api_version=manifest["apiVersion"],
            kind=manifest["kind"],
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            # KubeRay reads the token when it builds the first pod.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[auth]),
        )
        self.register_outputs({"name": self.name, "ray_service": self.ray_service.id})

    def _auth_secret(self, name: str, args: VllmRayServiceArgs) -> k8s.core.v1.Secret:
        """The Ray auth token (authOptions.secretName): generated here, kept in Pulumi's state as a secret."""
        token = random.RandomPassword(
            f"{name}-ray-auth-token",
            length=RAY_AUTH_TOKEN_LENGTH,
            # Sent in an HTTP header and an environment variable: letters and digits only.
            special=False,
            opts=pulumi.ResourceOptions(parent=self),
        )
        generated: pulumi.Output[str] = token.result
        # Marked secret here too, not only by the provider: never in a plain output or the render.
        value: pulumi.Output[str] = pulumi.Output.secret(generated)
        return k8s.core.v1.Secret(
            f"{name}-ray-auth",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=ray_auth_secret_name(args.name),
                namespace=args.namespace,
                labels={**PART_OF, "app.kubernetes.io/name": args.name},
            ),
            type="Opaque",
            string_data={RAY_AUTH_TOKEN_KEY: value},
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["stringData", "data"]),
        )
