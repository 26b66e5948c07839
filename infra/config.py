"""The stack configuration: one typed model, read from Pulumi config once.

Everything below this module takes a `StackConfig` (or a piece of it) as a
typed argument; nothing else calls `pulumi.Config`. A bad config stops the
program before any resource is declared, with one line per problem naming
the key path and the rule it breaks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network
from pathlib import Path
from typing import Annotated, Any, Literal

import pulumi
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from infra import versions
from infra.instance_types import GPU_INSTANCE_TYPES, GpuInstanceType
from workloads.inference_server.catalog import IngressScaling, ModelEntry, RequestLimits

NAMESPACE = "llm-platform"
SECRET_API_KEYS = "api_keys"
API_KEY_MIN_LENGTH = 24

# KubeRay appends suffixes to a RayService's name for its clusters and
# Services; longer names are rejected by its webhook.
RAY_SERVICE_NAME_MAX = 47
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_EXACT_VERSION = re.compile(r"^v?\d+\.\d+(\.\d+)?([-+][0-9A-Za-z.-]+)?$")
_DURATION = re.compile(r"^\d+[smhdwy]$")

# Weights bytes per parameter for the dtype the engine loads them in.
_DTYPE_BYTES = {"auto": 2.0, "bfloat16": 2.0, "float16": 2.0, "float32": 4.0}
_QUANT_BYTES = {"fp8": 1.0, "awq": 0.5, "gptq": 0.5, "bitsandbytes": 0.5}
# Below this share of the usable GPU memory left for the KV cache a model
# loads but serves only a handful of short sequences at once.
KV_CACHE_MIN_SHARE = 0.1


def _dns_label(value: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(
            f"'{value}' is not a valid Kubernetes name (lowercase letters, digits and '-', "
            "starting and ending alphanumeric, at most 63 characters)"
        )
    return value


K8sName = Annotated[str, Field(min_length=1)]
Duration = Annotated[str, Field(pattern=_DURATION.pattern)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Taint(_Section):
    """A Kubernetes node taint."""

    key: str
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class NodeGroupSettings(_Section):
    """Size and shape shared by the system group and every GPU group."""

    instance_types: list[str] = Field(min_length=1)
    capacity_type: Literal["on_demand", "spot"] = "on_demand"
    min_size: int = Field(ge=0)
    desired_size: int = Field(ge=0)
    max_size: int = Field(ge=1)
    disk_size_gib: int = Field(default=100, ge=20, le=16384)
    labels: dict[str, str] = Field(default_factory=dict)
    taints: list[Taint] = Field(default_factory=list)

    @field_validator("labels")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        for key in labels:
            if not _LABEL_KEY.match(key):
                raise ValueError(f"'{key}' is not a valid label key")
        return labels


class SystemNodeGroupSettings(NodeGroupSettings):
    """CPU nodes for operators, Prometheus and the Ray heads."""

    name: K8sName = "system"


class GpuNodeGroupSettings(NodeGroupSettings):
    """A managed node group of one GPU shape."""

    name: K8sName
    ami: Literal["al2023_nvidia", "bottlerocket_nvidia"] = "al2023_nvidia"

    def instance(self) -> GpuInstanceType:
        """The shape every node of this group has (the rules make them agree)."""
        return GPU_INSTANCE_TYPES[self.instance_types[0]]


class NodeGroups(_Section):
    """The system group and any number of GPU groups."""

    system: SystemNodeGroupSettings
    gpu: list[GpuNodeGroupSettings] = Field(min_length=1)

    def gpu_group(self, name: str) -> GpuNodeGroupSettings:
        """The GPU group called `name` (the rules ensure it exists)."""
        return next(g for g in self.gpu if g.name == name)


class Network(_Section):
    """Zones and addressing of the VPC."""

    zones: list[str] = Field(min_length=1)
    vpc_cidr: IPv4Network = IPv4Network("10.0.0.0/16")
    nat_gateways: Literal["single", "one_per_zone"] = "single"


LogType = Literal["api", "audit", "authenticator", "controllerManager", "scheduler"]
_DEFAULT_LOG_TYPES: tuple[LogType, ...] = ("api", "audit", "authenticator")


class Cluster(_Section):
    """The Kubernetes cluster: created here (`eks`) or an existing one."""

    mode: Literal["eks", "existing"] = "eks"
    name: K8sName
    kubernetes_version: str = versions.KUBERNETES_VERSION
    endpoint_public_access: bool = False
    endpoint_private_access: bool = True
    public_access_cidrs: list[IPv4Network] = Field(default_factory=list)
    admin_principal_arns: list[str] = Field(default_factory=list)
    log_types: list[LogType] = Field(default_factory=lambda: list(_DEFAULT_LOG_TYPES))
    kubeconfig_context: str | None = None
    # How the cluster gets nodes (infra/aws/provisioning.py): EKS managed node
    # groups scaled by cluster-autoscaler, the one provisioner so far.
    node_provisioner: Literal["managed_node_groups"] = "managed_node_groups"


class Versions(_Section):
    """Pinned platform versions; defaults come from infra/versions.py."""

    gpu_operator: str = versions.GPU_OPERATOR.version
    kuberay_operator: str = versions.KUBERAY_OPERATOR.version
    kube_prometheus_stack: str = versions.KUBE_PROMETHEUS_STACK.version
    keda: str = versions.KEDA.version
    cluster_autoscaler: str = versions.CLUSTER_AUTOSCALER.version
    aws_load_balancer_controller: str = versions.AWS_LOAD_BALANCER_CONTROLLER.version

    @field_validator("*")
    @classmethod
    def _exact(cls, value: str) -> str:
        if not _EXACT_VERSION.match(value):
            raise ValueError(f"'{value}' is not an exact version (no ranges or wildcards)")
        return value


class Toggle(_Section):
    """A platform part that an existing cluster may already run."""

    enabled: bool = True


class GpuOperatorSettings(Toggle):
    """NVIDIA GPU Operator settings."""

    mig_strategy: Literal["none", "single", "mixed"] = "none"


class Platform(_Section):
    """In-cluster services; each may be switched off on an existing cluster."""

    gpu_operator: GpuOperatorSettings = GpuOperatorSettings()
    kuberay: Toggle = Toggle()
    monitoring: Toggle = Toggle()
    keda: Toggle = Toggle()
    cluster_autoscaler: Toggle = Toggle()
    load_balancer_controller: Toggle = Toggle()


class StorageClass(_Section):
    """The default gp3 StorageClass."""

    name: K8sName = "gp3-encrypted"
    iops: int = Field(default=3000, ge=3000, le=16000)
    throughput_mibps: int = Field(default=125, ge=125, le=1000)
    kms_key_arn: str | None = None


class Storage(_Section):
    """Where model weights live and how nodes cache them."""

    model_bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
    model_cache_gib: int = Field(default=200, ge=10)
    storage_class: StorageClass = StorageClass()


class GcsFaultTolerance(_Section):
    """External Redis for the Ray GCS, so a head restart keeps serving."""

    enabled: bool = False
    node_type: str = "cache.t4g.small"


class Ray(_Section):
    """RayService settings shared by every model."""

    gcs_fault_tolerance: GcsFaultTolerance = GcsFaultTolerance()
    idle_timeout_seconds: int = Field(default=300, ge=30)
    # NewCluster: a full second cluster, traffic switched when it is ready
    # (zero downtime, twice the GPUs while upgrading). None: cluster changes
    # are not rolled out (serveConfigV2 still updates in place). KubeRay's
    # incremental upgrade needs a Gateway API implementation the platform
    # does not install, so it is not offered.
    upgrade_strategy: Literal["NewCluster", "None"] = "NewCluster"
    head_cpu: str = "2"
    head_memory: str = "8Gi"


class Serving(_Section):
    """The namespace the models run in and the limits every request obeys."""

    namespace: K8sName = "llm"
    limits: RequestLimits = RequestLimits()
    ingress: IngressScaling = IngressScaling()
    allow_hub_download: bool = False


class Model(ModelEntry):
    """One served model: the catalogue entry the server reads, plus placement.

    Inherits the server's own catalogue schema so the program and the server
    can not disagree on a field.
    """

    name: K8sName
    gpu_group: str
    parameters_billion: float = Field(gt=0)
    # Models with the same `service` share one RayService; by default each
    # model is its own upgrade and failure domain.
    service: str | None = None

    @property
    def service_name(self) -> str:
        """The RayService this model is served by."""
        return self.service or self.name

    def weights_gib(self) -> float:
        """Weights size in GiB for the dtype or quantization it loads in."""
        per_param = _QUANT_BYTES.get(self.quantization or "", _DTYPE_BYTES[self.dtype])
        return self.parameters_billion * 1e9 * per_param / 2**30


class PreScale(_Section):
    """A window of warm GPU capacity held ahead of a known peak."""

    name: K8sName
    gpu_group: str
    nodes: int = Field(ge=1)
    timezone: str = "UTC"
    start: str = Field(description="cron expression when the window opens")
    end: str = Field(description="cron expression when the window closes")


class ClusterAutoscaling(_Section):
    """cluster-autoscaler behaviour."""

    expander: Literal["least-waste", "priority", "most-pods", "random", "price"] = "least-waste"
    scale_down_unneeded_time: Duration = "10m"
    scale_down_delay_after_add: Duration = "10m"
    max_node_provision_time: Duration = "15m"


class Autoscaling(_Section):
    """The node and schedule layers of autoscaling (Serve's is per model)."""

    cluster: ClusterAutoscaling = ClusterAutoscaling()
    prescale: list[PreScale] = Field(default_factory=list)


class Slo(_Section):
    """Service levels the alerts hold the platform to."""

    ttft_p95_seconds: float = Field(default=2.0, gt=0)
    inter_token_p95_seconds: float = Field(default=0.15, gt=0)
    error_ratio: float = Field(default=0.01, gt=0, lt=1)
    requests_waiting: int = Field(default=20, ge=1)
    kv_cache_usage: float = Field(default=0.9, gt=0, le=1)
    gpu_idle_minutes: int = Field(default=30, ge=5)


class Observability(_Section):
    """Prometheus, Grafana and the SLOs."""

    prometheus_retention: Duration = "15d"
    prometheus_storage_gib: int = Field(default=100, ge=10)
    slo: Slo = Slo()
    # A Secret in the monitoring namespace holding `alertmanager.yaml` (the
    # routes and receivers that page: PagerDuty, Opsgenie, Slack keys), kept
    # by the team's secret tooling; without it alerts only show in Alertmanager.
    alertmanager_config_secret: K8sName | None = None


class Endpoint(_Section):
    """How clients reach the OpenAI-compatible API."""

    scheme: Literal["internal", "internet-facing"] = "internal"
    allowed_cidrs: list[IPv4Network] = Field(default_factory=list)
    certificate_arn: str | None = None
    # Each RayService answers at <service>.<domain> (a network load balancer
    # can not route on the request's model); the certificate covers
    # *.<domain>, and external-dns, where it runs, creates the records.
    domain: str | None = Field(default=None, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z]{2,}$")

    def service_host(self, service: str) -> str | None:
        """The DNS name of one RayService's endpoint, when a domain is set."""
        return f"{service}.{self.domain}" if self.domain else None


class Batch(_Section):
    """Queue-fed batch inference: SQS requests, KEDA-scaled workers, results in S3."""

    enabled: bool = False
    # The served model's model_id the workers send every request to.
    model: str | None = None
    min_workers: int = Field(default=0, ge=0)
    max_workers: int = Field(default=4, ge=1)
    # KEDA's target backlog (visible plus in-flight messages) per worker; each
    # worker also keeps this many requests in flight at once.
    messages_per_worker: int = Field(default=8, ge=1)
    # A received message stays hidden this long; a worker's request must end
    # well inside it (SQS allows at most 12 hours).
    visibility_timeout_seconds: int = Field(default=900, ge=60, le=43200)
    # Receives before a message moves to the dead-letter queue.
    max_receive_count: int = Field(default=5, ge=1, le=1000)


class Image(_Section):
    """The serving image: built from workloads/ or given by digest."""

    reference: str | None = Field(default=None, pattern=r"^[^@\s]+@sha256:[0-9a-f]{64}$")
    repository_name: K8sName = "llm-serving"


class StackConfig(_Section):
    """The whole stack, as `Pulumi.<stack>.yaml` describes it."""

    environment: Literal["dev", "staging", "prod"]
    region: str
    network: Network
    cluster: Cluster
    node_groups: NodeGroups
    versions: Versions = Versions()
    platform: Platform = Platform()
    storage: Storage
    ray: Ray = Ray()
    serving: Serving = Serving()
    models: list[Model] = Field(min_length=1)
    autoscaling: Autoscaling = Autoscaling()
    observability: Observability = Observability()
    endpoint: Endpoint = Endpoint()
    image: Image = Image()
    batch: Batch = Batch()

    @property
    def is_prod(self) -> bool:
        """Production rules apply."""
        return self.environment == "prod"

    def services(self) -> dict[str, list[Model]]:
        """RayService name -> the models it serves, in config order."""
        out: dict[str, list[Model]] = {}
        for model in self.models:
            out.setdefault(model.service_name, []).append(model)
        return out


@dataclass(frozen=True)
class Problem:
    """One broken rule at one key path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"config error: {self.path}: {self.message}"


class ConfigError(Exception):
    """The config breaks one or more rules; `problems` has one line each."""

    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class LoadedConfig:
    """The validated config and the secrets read beside it."""

    stack: StackConfig
    api_keys: pulumi.Output[str]


def _path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _nodes_per_replica(model: Model, gpu: GpuInstanceType) -> int:
    return max(1, math.ceil(model.tensor_parallel_size * model.pipeline_parallel_size / gpu.gpus))


def _check_node_group(path: str, group: NodeGroupSettings) -> Iterable[Problem]:
    if not group.min_size <= group.desired_size <= group.max_size:
        yield Problem(
            path,
            f"min_size <= desired_size <= max_size does not hold "
            f"({group.min_size}, {group.desired_size}, {group.max_size})",
        )


def _check_gpu_group(i: int, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    path = f"node_groups.gpu[{i}]"
    yield from _check_node_group(path, group)
    unknown = [t for t in group.instance_types if t not in GPU_INSTANCE_TYPES]
    if unknown:
        yield Problem(
            f"{path}.instance_types",
            f"{', '.join(unknown)} not in the GPU catalogue (infra/instance_types.py: "
            f"{', '.join(sorted(GPU_INSTANCE_TYPES))})",
        )
        return
    shapes = {(GPU_INSTANCE_TYPES[t].gpu_model, GPU_INSTANCE_TYPES[t].gpus) for t in group.instance_types}
    if len(shapes) > 1:
        yield Problem(
            f"{path}.instance_types",
            "all instance types of a group must have the same GPU model and GPU count "
            "(the autoscaler's node template and the pods' GPU limits assume one shape)",
        )


def _check_model_fits_group(path: str, model: Model, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """The model's accelerator, parallelism, weights and minimum replicas fit its GPU group."""
    gpu = group.instance()
    if model.accelerator_type is not None and model.accelerator_type != gpu.ray_accelerator_type:
        yield Problem(
            f"{path}.accelerator_type",
            f"'{model.accelerator_type}' disagrees with GPU group '{group.name}' ({gpu.ray_accelerator_type}): "
            "leave it out, it is derived from the group",
        )
    tp, pp = model.tensor_parallel_size, model.pipeline_parallel_size
    if tp > gpu.gpus:
        yield Problem(
            f"{path}.tensor_parallel_size",
            f"{tp} GPUs do not fit {gpu.name} ({gpu.gpus} GPU{'s' if gpu.gpus > 1 else ''})",
        )
    elif tp * pp > gpu.gpus and tp != gpu.gpus:
        yield Problem(
            f"{path}.pipeline_parallel_size",
            f"{pp} stages of {tp} GPUs span nodes of {gpu.name} ({gpu.gpus} GPUs) but do not fill them: "
            f"each pipeline stage must use a whole node (tensor_parallel_size {gpu.gpus})",
        )
    else:
        gpus = tp * pp
        budget = gpus * gpu.gpu_memory_gib * model.gpu_memory_utilization
        weights = model.weights_gib()
        if weights > budget * (1 - KV_CACHE_MIN_SHARE):
            yield Problem(
                path,
                f"weights of {weights:.1f} GiB do not fit {gpus} x {gpu.gpu_model} "
                f"{gpu.gpu_memory_gib} GiB x gpu_memory_utilization {model.gpu_memory_utilization} "
                f"= {budget:.1f} GiB with {KV_CACHE_MIN_SHARE:.0%} left for the KV cache",
            )
        need = model.autoscaling.min_replicas * _nodes_per_replica(model, gpu)
        if need > group.max_size:
            yield Problem(
                f"{path}.autoscaling.min_replicas",
                f"{model.autoscaling.min_replicas} replicas need {need} {gpu.name} nodes "
                f"but node group '{group.name}' has max_size {group.max_size}",
            )


def _check_model(i: int, model: Model, cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    path = f"models[{i}]"
    group = groups.get(model.gpu_group)
    if group is None:
        yield Problem(
            f"{path}.gpu_group",
            f"'{model.gpu_group}' is not a GPU node group (have: {', '.join(groups) or 'none'})",
        )
    elif all(t in GPU_INSTANCE_TYPES for t in group.instance_types):
        yield from _check_model_fits_group(path, model, group)
    if model.weights_kind == "s3" and not model.source.startswith(f"s3://{cfg.storage.model_bucket}/"):
        yield Problem(
            f"{path}.source",
            f"S3 weights must live in the model bucket s3://{cfg.storage.model_bucket}/ "
            "(the pods may read only that bucket)",
        )
    if model.weights_kind == "hub" and (cfg.is_prod or not cfg.serving.allow_hub_download):
        yield Problem(
            f"{path}.source",
            "a hub download at start is not allowed "
            + ("in prod" if cfg.is_prod else "(set serving.allow_hub_download, or copy the weights to S3)"),
        )
    if cfg.is_prod and model.autoscaling.min_replicas < 1:
        yield Problem(
            f"{path}.autoscaling.min_replicas",
            "prod models keep at least one replica (scale to zero means minutes-long cold starts)",
        )


def _check_names(cfg: StackConfig) -> Iterable[Problem]:
    named: list[tuple[str, str]] = [
        ("cluster.name", cfg.cluster.name),
        ("node_groups.system.name", cfg.node_groups.system.name),
        ("serving.namespace", cfg.serving.namespace),
        ("storage.storage_class.name", cfg.storage.storage_class.name),
        ("image.repository_name", cfg.image.repository_name),
    ]
    if cfg.observability.alertmanager_config_secret:
        named.append(("observability.alertmanager_config_secret", cfg.observability.alertmanager_config_secret))
    named += [(f"node_groups.gpu[{i}].name", g.name) for i, g in enumerate(cfg.node_groups.gpu)]
    named += [(f"autoscaling.prescale[{i}].name", p.name) for i, p in enumerate(cfg.autoscaling.prescale)]
    for i, model in enumerate(cfg.models):
        named.append((f"models[{i}].name", model.name))
        if model.service is not None:
            named.append((f"models[{i}].service", model.service))
    for path, value in named:
        try:
            _dns_label(value)
        except ValueError as err:
            yield Problem(path, str(err))
    for i, model in enumerate(cfg.models):
        if len(model.service_name) > RAY_SERVICE_NAME_MAX:
            key = "service" if model.service else "name"
            yield Problem(
                f"models[{i}].{key}",
                f"RayService name '{model.service_name}' has {len(model.service_name)} characters "
                f"(at most {RAY_SERVICE_NAME_MAX})",
            )
    for label, items in (
        ("name", [m.name for m in cfg.models]),
        ("model_id", [m.model_id for m in cfg.models]),
    ):
        seen: set[str] = set()
        for i, value in enumerate(items):
            if value in seen:
                yield Problem(f"models[{i}].{label}", f"'{value}' is used by another model")
            seen.add(value)
    seen = set()
    for i, group in enumerate(cfg.node_groups.gpu):
        if group.name in seen or group.name == cfg.node_groups.system.name:
            yield Problem(f"node_groups.gpu[{i}].name", f"'{group.name}' is used by another node group")
        seen.add(group.name)


def _check_access(cfg: StackConfig) -> Iterable[Problem]:
    everywhere = IPv4Network("0.0.0.0/0")
    ep = cfg.endpoint
    if ep.scheme == "internet-facing":
        if cfg.is_prod and not ep.allowed_cidrs:
            yield Problem(
                "endpoint.allowed_cidrs", "prod may not use an internet-facing endpoint without an allow-list"
            )
        if cfg.is_prod and everywhere in ep.allowed_cidrs:
            yield Problem("endpoint.allowed_cidrs", "prod may not allow 0.0.0.0/0 on an internet-facing endpoint")
        if not ep.certificate_arn:
            yield Problem(
                "endpoint.certificate_arn",
                "an internet-facing endpoint needs a TLS certificate (API keys must not cross the internet in clear)",
            )
    cl = cfg.cluster
    if cl.mode == "eks":
        if not (cl.endpoint_public_access or cl.endpoint_private_access):
            yield Problem("cluster.endpoint_private_access", "the API server needs public or private access")
        if cl.endpoint_public_access and (not cl.public_access_cidrs or everywhere in cl.public_access_cidrs):
            yield Problem(
                "cluster.public_access_cidrs",
                "a public API server endpoint needs a CIDR allow-list without 0.0.0.0/0",
            )
        if cfg.is_prod and cl.endpoint_public_access:
            yield Problem("cluster.endpoint_public_access", "prod keeps the API server endpoint private")


def _check_cluster_mode(cfg: StackConfig) -> Iterable[Problem]:
    if cfg.cluster.mode == "existing":
        if not cfg.cluster.kubeconfig_context:
            yield Problem("cluster.kubeconfig_context", "required when cluster.mode is existing")
        if cfg.ray.gcs_fault_tolerance.enabled:
            yield Problem(
                "ray.gcs_fault_tolerance.enabled",
                "the Redis for GCS fault tolerance is created in the program's VPC, so only with cluster.mode eks",
            )
        return
    for part, toggle in cfg.platform:
        if not toggle.enabled:
            yield Problem(f"platform.{part}.enabled", "may be off only with cluster.mode existing")
    if cfg.cluster.kubeconfig_context:
        yield Problem("cluster.kubeconfig_context", "only used with cluster.mode existing")
    if cfg.is_prod and cfg.platform.monitoring.enabled and not cfg.observability.alertmanager_config_secret:
        yield Problem(
            "observability.alertmanager_config_secret",
            "prod alerts must page: name the Secret that holds alertmanager.yaml",
        )
    if cfg.is_prod and not cfg.ray.gcs_fault_tolerance.enabled:
        yield Problem(
            "ray.gcs_fault_tolerance.enabled",
            "prod needs GCS fault tolerance so a Ray head restart does not drop serving",
        )


def _check_network(cfg: StackConfig) -> Iterable[Problem]:
    for i, zone in enumerate(cfg.network.zones):
        if not (zone.startswith(cfg.region) and len(zone) > len(cfg.region)):
            yield Problem(f"network.zones[{i}]", f"'{zone}' is not a zone of region {cfg.region}")
    if len(set(cfg.network.zones)) != len(cfg.network.zones):
        yield Problem("network.zones", "zones must be distinct")
    if cfg.cluster.mode == "eks" and len(cfg.network.zones) < 2:
        yield Problem("network.zones", "EKS needs subnets in at least two zones")
    if cfg.cluster.kubernetes_version != versions.KUBERNETES_VERSION and not re.match(
        r"^1\.\d+$", cfg.cluster.kubernetes_version
    ):
        yield Problem("cluster.kubernetes_version", "must be a Kubernetes minor such as 1.35")


def _check_prescale(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    for i, window in enumerate(cfg.autoscaling.prescale):
        group = groups.get(window.gpu_group)
        if group is None:
            yield Problem(f"autoscaling.prescale[{i}].gpu_group", f"'{window.gpu_group}' is not a GPU node group")
        elif window.nodes > group.max_size:
            yield Problem(
                f"autoscaling.prescale[{i}].nodes",
                f"{window.nodes} nodes exceed node group '{group.name}' max_size {group.max_size}",
            )
        for key in ("start", "end"):
            if len(getattr(window, key).split()) != 5:
                yield Problem(f"autoscaling.prescale[{i}].{key}", "must be a 5-field cron expression")


def _check_batch(cfg: StackConfig) -> Iterable[Problem]:
    batch = cfg.batch
    if not batch.enabled:
        return
    model_ids = [m.model_id for m in cfg.models]
    if batch.model is None:
        yield Problem("batch.model", "required when batch.enabled is true")
    elif batch.model not in model_ids:
        yield Problem("batch.model", f"'{batch.model}' is not a configured model_id (have: {', '.join(model_ids)})")
    if batch.min_workers > batch.max_workers:
        yield Problem("batch.min_workers", f"{batch.min_workers} exceeds max_workers {batch.max_workers}")


def check_rules(cfg: StackConfig) -> list[Problem]:
    """Every cross-field rule; an empty list means the config is usable."""
    problems: list[Problem] = []
    problems += _check_node_group("node_groups.system", cfg.node_groups.system)
    gpu_groups: dict[str, GpuNodeGroupSettings] = {}
    for i, group in enumerate(cfg.node_groups.gpu):
        problems += _check_gpu_group(i, group)
        gpu_groups.setdefault(group.name, group)
    for i, model in enumerate(cfg.models):
        problems += _check_model(i, model, cfg, gpu_groups)
    problems += _check_names(cfg)
    problems += _check_access(cfg)
    problems += _check_cluster_mode(cfg)
    problems += _check_network(cfg)
    problems += _check_prescale(cfg, gpu_groups)
    problems += _check_batch(cfg)
    problems += _check_ingress(cfg)
    return problems


# Prod's OpenAI ingress survives the loss of a node: two replicas on two nodes.
PROD_MIN_INGRESS_REPLICAS = 2


def _check_ingress(cfg: StackConfig) -> Iterable[Problem]:
    ingress = cfg.serving.ingress
    if cfg.is_prod and ingress.min_replicas < PROD_MIN_INGRESS_REPLICAS:
        yield Problem(
            "serving.ingress.min_replicas",
            f"prod keeps at least {PROD_MIN_INGRESS_REPLICAS} ingress replicas "
            "(one would be a single point of failure)",
        )
    if cfg.is_prod and ingress.max_replicas_per_node > 1:
        yield Problem(
            "serving.ingress.max_replicas_per_node",
            "prod spreads ingress replicas one per node (more would share a node's fate)",
        )


def _describe(err: Mapping[str, Any]) -> str:
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "missing":
        return "required"
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) and err["type"] not in ("value_error",):
        return f"{msg} (got {json.dumps(value)})"
    return msg.removeprefix("Value error, ")


def parse(raw: Mapping[str, Any]) -> StackConfig:
    """Validate the raw config (section name -> value); raise ConfigError."""
    try:
        cfg = StackConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError([Problem(_path(e["loc"]) or "config", _describe(e)) for e in err.errors()]) from None
    problems = check_rules(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _all_config() -> dict[str, Any]:
    # pulumi.Config can only look keys up; listing them is how unknown
    # top-level keys are caught instead of silently ignored.
    from pulumi.runtime import config as runtime_config

    merged = dict(runtime_config.get_config_env())
    merged.update(runtime_config.CONFIG.get())
    return merged


def _secret_keys() -> set[str]:
    from pulumi.runtime import config as runtime_config

    return set(runtime_config.get_config_secret_keys_env()) | set(runtime_config._SECRET_KEYS.get())


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def split_api_keys(value: str) -> list[str]:
    """The keys in the secret: comma- or newline-separated."""
    return [k.strip() for k in re.split(r"[,\n]", value) if k.strip()]


def _check_api_keys(value: str) -> list[Problem]:
    # Never echo a key: the message names only the position and the rule.
    keys = split_api_keys(value)
    if not keys:
        return [Problem(SECRET_API_KEYS, "needs at least one key")]
    return [
        Problem(SECRET_API_KEYS, f"key {i + 1} is shorter than {API_KEY_MIN_LENGTH} characters")
        for i, key in enumerate(keys)
        if len(key) < API_KEY_MIN_LENGTH
    ]


# A stand-in for the API keys secret when a stack file does not carry it
# (each user sets it with `pulumi config set --secret`); never a real key.
PLACEHOLDER_API_KEYS = "render-placeholder-key-0000000000000000"


def read_stack_file(path: Path) -> tuple[dict[str, str], list[str]]:
    """Pulumi config (key -> value as the CLI passes it) and its secret keys.

    Structured values reach a program as JSON strings, scalars as strings;
    `secure:` values can not be decrypted offline and become placeholders.
    """
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([Problem(str(path), f"not valid YAML{where}")]) from None
    raw = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(str(path), "needs a `config:` mapping")])
    config: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in raw.items():
        if isinstance(value, dict) and set(value) == {"secure"}:
            config[key] = PLACEHOLDER_API_KEYS
            secrets.append(key)
        elif isinstance(value, (dict, list)):
            config[key] = json.dumps(value)
        elif isinstance(value, bool):
            config[key] = "true" if value else "false"
        else:
            config[key] = "" if value is None else str(value)
    return config, secrets


def sections(values: Mapping[str, str]) -> dict[str, Any]:
    """Pulumi's flat config (`namespace:key` -> string) as the sections `parse` takes.

    The one translation from what the CLI hands a program to the config
    model: the program (`load`), the render and the tests all go through it.
    """
    raw: dict[str, Any] = {}
    for key, value in sorted(values.items()):
        ns, _, name = key.partition(":")
        if ns == NAMESPACE and name != SECRET_API_KEYS:
            raw[name] = _decode(value)
    if "aws:region" in values:
        raw["region"] = values["aws:region"]
    return raw


def load_stack_file(path: Path) -> StackConfig:
    """A stack file (`Pulumi.<stack>.yaml`) as the validated config; raise ConfigError."""
    values, _ = read_stack_file(path)
    return parse(sections(values))


def load() -> LoadedConfig:
    """Read, validate and return the stack's config; raise ConfigError."""
    raw = sections(_all_config())
    region = pulumi.Config("aws").get("region")
    problems: list[Problem] = []
    if region is None:
        problems.append(Problem("aws:region", "required: pulumi config set aws:region <region>"))
    raw["region"] = region or "unset"
    try:
        cfg = parse(raw)
    except ConfigError as err:
        problems += err.problems
    keys = pulumi.Config(NAMESPACE).get_secret(SECRET_API_KEYS)
    full_key = f"{NAMESPACE}:{SECRET_API_KEYS}"
    if keys is None:
        problems.append(
            Problem(
                SECRET_API_KEYS,
                f"required: pulumi config set --secret {full_key} <key>[,<key>...]",
            )
        )
    elif full_key not in _secret_keys():
        problems.append(Problem(SECRET_API_KEYS, f"must be a secret: pulumi config set --secret {full_key} ..."))
    else:
        problems += _check_api_keys(str(_all_config().get(full_key, "")))
    if problems:
        raise ConfigError(problems)
    assert keys is not None
    return LoadedConfig(stack=cfg, api_keys=keys)
