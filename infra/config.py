"""The stack configuration: one typed model, read from Pulumi config once.

Everything below this module takes a `StackConfig` (or a piece of it) as a
typed argument; nothing else calls `pulumi.Config`. A bad config stops the
program before any resource is declared, with one line per problem naming
the key path and the rule it breaks.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import cache
from ipaddress import IPv4Network, collapse_addresses
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import pulumi
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from infra import versions
from infra.capacity.cold_start import ColdStart, Timeout, cold_start, timeout_problems
from infra.capacity.geometry import Geometry, resolve_geometry, unknown_model_message
from infra.capacity.plan import GIB, weight_bytes_per_parameter
from infra.capacity.rules import capacity_problems
from infra.capacity.upgrade import Fleet, UpgradeHeadroom, UpgradeNeed, headroom_problem
from infra.instance_types import GPU_INSTANCE_TYPES, GpuInstanceType
from workloads.inference_server.api_keys import BATCH_WORKER_KEY_ID, FINGERPRINT_PREFIX, KeyFormatError, parse_entry
from workloads.inference_server.catalog import IngressScaling, KeyFairness, Layout, ModelEntry, RequestLimits
from workloads.inference_server.catalog import Tracing as CatalogTracing

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

# A Kubernetes resource quantity: a signed decimal number and a suffix,
# binary (Ki..Ei), decimal (n, u, m, "", k..E) or an exponent (e3, E-2).
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$"
)
_BINARY_SUFFIX = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_MEBIBYTE = 2**20


def quantity_value(text: str) -> Decimal | None:
    """A Kubernetes quantity's value (cores, bytes), or None when it is not one."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    number, suffix = Decimal(match["number"]), match["suffix"] or ""
    if suffix in _BINARY_SUFFIX:
        return number * Decimal(1024) ** _BINARY_SUFFIX[suffix]
    exponent = _DECIMAL_SUFFIX[suffix] if suffix in _DECIMAL_SUFFIX else int(suffix[1:])
    try:
        return number.scaleb(exponent)
    except InvalidOperation:
        return None


def _quantity_text(value: Any) -> Any:
    # YAML reads `head_cpu: 2` as a number; Kubernetes takes both.
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _positive_quantity(value: str) -> Decimal:
    amount = quantity_value(value)
    if amount is None or amount <= 0:
        raise ValueError(f"'{value}' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)")
    return amount


def _cpu_quantity(value: str) -> str:
    _positive_quantity(value)
    return value


def _memory_quantity(value: str) -> str:
    if _positive_quantity(value) < _MEBIBYTE:
        raise ValueError(f"'{value}' is less than 1Mi of memory: 'm' is milli (a thousandth of a byte), 'Mi' is mebi")
    return value


CpuQuantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_cpu_quantity)]
MemoryQuantity = Annotated[str, BeforeValidator(_quantity_text), AfterValidator(_memory_quantity)]

# ElastiCache node families that run the Ray GCS Redis as infra/aws/redis.py
# creates it (Redis 7.1, Multi-AZ automatic failover, TLS in transit,
# encryption at rest): the current generation, without the data-tiering
# family (r6gd), which the replication group does not enable.
ELASTICACHE_FAMILIES = ("t3", "t4g", "m5", "m6g", "m7g", "r5", "r6g", "r7g", "c7gn")
_CACHE_NODE_TYPE = re.compile(r"^cache\.(?P<family>[a-z0-9]+)\.(?P<size>[a-z0-9]+)$")
_BURSTABLE_SIZES = ("micro", "small", "medium")
_CACHE_SIZE = re.compile(r"^(large|\d*xlarge)$")


def _cache_node_type(value: str) -> str:
    match = _CACHE_NODE_TYPE.match(value)
    family, size = (match["family"], match["size"]) if match else ("", "")
    burstable = family.startswith("t")
    if family in ELASTICACHE_FAMILIES and (size in _BURSTABLE_SIZES if burstable else _CACHE_SIZE.match(size)):
        return value
    raise ValueError(
        f"'{value}' is not an ElastiCache node type this Redis runs on: cache.<family>.<size> with a family of "
        f"{', '.join(ELASTICACHE_FAMILIES)} (micro, small or medium for t*, large or <n>xlarge otherwise)"
    )


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


def _reservation_id(value: str) -> str:
    if not _RESERVATION_ID.match(value):
        raise ValueError(f"'{value}' is not an EC2 capacity reservation id (cr- and 8 to 17 hex digits)")
    return value


_RESERVATION_ID = re.compile(r"^cr-[0-9a-f]{8,17}$")
ReservationId = Annotated[str, AfterValidator(_reservation_id)]


class GpuNodeGroupSettings(NodeGroupSettings):
    """A GPU group of one shape: a managed node group, or a Karpenter NodePool."""

    name: K8sName
    ami: Literal["al2023_nvidia", "bottlerocket_nvidia"] = "al2023_nvidia"
    # On-demand capacity reservations or Capacity Blocks this group launches
    # into first (Karpenter's `reserved` capacity type), before falling back
    # to `capacity_type`. Karpenter only.
    capacity_reservation_ids: list[ReservationId] = Field(default_factory=list)

    def capacity_types(self) -> tuple[str, ...]:
        """The capacity a Karpenter pool may launch: reserved first when it has reservations, then capacity_type."""
        return (*(("reserved",) if self.capacity_reservation_ids else ()), self.capacity_type)

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


# How the network layer (infra/aws/network.py) cuts the VPC: one private
# subnet for nodes and one public subnet for internet-facing load balancers
# in each zone. Node subnets get most of the space: the VPC CNI gives every
# pod a VPC address, so a zone of GPU nodes with warm IP pools uses thousands.
PRIVATE_CIDR_MASK = 19
PUBLIC_CIDR_MASK = 24
# The VPC sizes AWS allows.
VPC_PREFIX_RANGE = (16, 28)


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
    # How the cluster gets GPU nodes (infra/aws/provisioning.py): Karpenter
    # NodePools, or EKS managed node groups scaled by cluster-autoscaler. The
    # system nodes are a managed node group under both.
    node_provisioner: Literal["karpenter", "managed_node_groups"] = "karpenter"

    @model_validator(mode="before")
    @classmethod
    def _existing_keeps_its_nodes(cls, data: Any) -> Any:
        # An existing cluster's nodes are not this program's: unless told
        # otherwise it keeps today's behaviour (cluster-autoscaler installed).
        if isinstance(data, dict) and data.get("mode") == "existing" and "node_provisioner" not in data:
            return {**data, "node_provisioner": "managed_node_groups"}
        return data


class Versions(_Section):
    """Pinned platform versions; defaults come from infra/versions.py."""

    gpu_operator: str = versions.GPU_OPERATOR.version
    kuberay_operator: str = versions.KUBERAY_OPERATOR.version
    kube_prometheus_stack: str = versions.KUBE_PROMETHEUS_STACK.version
    keda: str = versions.KEDA.version
    cluster_autoscaler: str = versions.CLUSTER_AUTOSCALER.version
    aws_load_balancer_controller: str = versions.AWS_LOAD_BALANCER_CONTROLLER.version
    external_dns: str = versions.EXTERNAL_DNS.version

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
    # Runs only where endpoint.domain and endpoint.hosted_zone_id are set.
    external_dns: Toggle = Toggle()


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
    # IAM users or roles that may write and delete weights in the model
    # bucket, besides the principal that deploys the stack; the bucket
    # policy denies every other principal of the account (infra/aws/policies.py
    # model_bucket_writers_only).
    weights_writer_arns: list[str] = Field(default_factory=list)


class GcsFaultTolerance(_Section):
    """External Redis for the Ray GCS, so a head restart keeps serving."""

    enabled: bool = False
    node_type: Annotated[str, AfterValidator(_cache_node_type)] = "cache.t4g.small"


class ColdStartTimeouts(_Section):
    """The timeouts a cold start runs under; a rule holds each above the model's budget (infra/capacity/cold_start.py).

    Defaults are the upstream ones (Ray 2.60's autoscaler v2 reconciler and
    Serve LLM), written out so the rule can see them; `pulumi_wait_seconds`
    unset keeps the RayService's own wait (1800 s, 3600 s from 40 GiB of weights).
    """

    autoscaler_allocate_seconds: int = Field(default=3600, ge=60)
    autoscaler_ray_install_seconds: int = Field(default=1800, ge=60)
    engine_start_seconds: int = Field(default=3600, ge=60)
    pulumi_wait_seconds: int | None = Field(default=None, ge=60)


class Ray(_Section):
    """RayService settings shared by every model."""

    gcs_fault_tolerance: GcsFaultTolerance = GcsFaultTolerance()
    cold_start: ColdStartTimeouts = ColdStartTimeouts()
    idle_timeout_seconds: int = Field(default=300, ge=30)
    # NewCluster: a full second cluster, traffic switched when it is ready
    # (zero downtime; the new cluster's GPUs beside the old cluster's while
    # upgrading, see upgrade_headroom). None: cluster changes
    # are not rolled out (serveConfigV2 still updates in place). KubeRay's
    # incremental upgrade needs a Gateway API implementation the platform
    # does not install, so it is not offered.
    upgrade_strategy: Literal["NewCluster", "None"] = "NewCluster"
    # The old cluster a NewCluster upgrade must find room beside, in every GPU
    # group's max_size: `peak`, the old cluster at max_replicas (an upgrade
    # places its new cluster at any hour), or `min`, at min_replicas (smaller
    # groups; an upgrade started at peak waits for traffic to fall). `peak` is
    # the default because nobody times `pulumi up` to traffic: under `min` the
    # upgrade that ships a fix at peak is the one that stalls. See
    # infra/capacity/upgrade.py and docs/upgrade-headroom.md.
    upgrade_headroom: UpgradeHeadroom = "peak"
    head_cpu: CpuQuantity = "2"
    head_memory: MemoryQuantity = "8Gi"


class Serving(_Section):
    """The namespace the models run in and the limits every request obeys."""

    namespace: K8sName = "llm"
    limits: RequestLimits = RequestLimits()
    # How requests reach the engines of each RayService (catalog.Layout).
    # `auto` picks vllm-server wherever a service can use it (see
    # `vllm_server_problem`): it skips Serve's per-chunk hops, so it is the
    # faster path; the rest stay on serve-ingress.
    layout: Literal["auto", "vllm-server", "serve-ingress"] = "auto"
    # Serve LLM's OpenAI ingress; only serve-ingress services have one, so a
    # vllm-server service ignores this section.
    ingress: IngressScaling = IngressScaling()
    allow_hub_download: bool = False
    # What one API key may hold of a replica (inference_server.fairness);
    # the batch worker's own key is held to batch.messages_per_worker unless
    # `per_key` names it.
    fairness: KeyFairness = KeyFairness()


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
    # The model's shape for the capacity plan (infra/capacity/); the pinned
    # families of infra/capacity/geometry.py need none.
    geometry: Geometry | None = None

    @property
    def service_name(self) -> str:
        """The RayService this model is served by."""
        return self.service or self.name

    def weights_gib(self) -> float:
        """Weights size in GiB for the dtype or quantization it loads in."""
        per_param = weight_bytes_per_parameter(self.dtype, self.quantization)
        return self.parameters_billion * 1e9 * per_param / GIB


class PreScale(_Section):
    """A window of warm GPU capacity held ahead of a known peak."""

    name: K8sName
    gpu_group: str
    nodes: int = Field(ge=1)
    timezone: str = "UTC"
    start: str = Field(description="cron expression when the window opens")
    # How long before the peak `start` fires: the warm nodes must be up, and a
    # replica started on them, by the peak (the cold-start rule's lead time).
    lead_seconds: int = Field(default=1800, ge=0)
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


class Tracing(CatalogTracing):
    """OpenTelemetry traces to the team's own collector; off unless `otlp_endpoint` is set.

    The server's own catalogue schema (catalog.Tracing), so the program and
    the server read the same rules: `otlp_endpoint` is scheme://host:port of
    an OTLP/gRPC collector (http:// or grpc:// plaintext, https:// TLS), e.g.
    `http://otel-collector.monitoring:4317`. vLLM (both layouts) gets it as
    its `otlp_traces_endpoint`; serve-ingress services also trace Serve's
    replicas (`sample_ratio` of the requests); the Ray pods may then reach
    that port. No stack sets it: each team names its collector.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


def _runbook_base_url(value: str) -> str:
    # Each alert's link is <base>/<AlertName>.md: a query or fragment would
    # end up before the page's name, and a link without a host does not open
    # from a page in Slack or PagerDuty.
    parts = urlsplit(value)
    opens = parts.scheme in ("http", "https") and parts.netloc and not (parts.query or parts.fragment)
    if not opens or any(c.isspace() for c in value):
        raise ValueError(
            f"'{value}' is not a base URL for the runbooks: http(s)://host/path with no query or fragment, "
            "where docs/runbooks/ is served (each alert links <base>/<AlertName>.md)"
        )
    return value


class Observability(_Section):
    """Prometheus, Grafana, the SLOs and (optionally) traces."""

    prometheus_retention: Duration = "15d"
    prometheus_storage_gib: int = Field(default=100, ge=10)
    slo: Slo = Slo()
    # A Secret in the monitoring namespace holding `alertmanager.yaml` (the
    # routes and receivers that page: PagerDuty, Opsgenie, Slack keys), kept
    # by the team's secret tooling; without it alerts only show in Alertmanager.
    alertmanager_config_secret: K8sName | None = None
    # Where this repository's docs/runbooks/ is served, e.g.
    # https://github.com/<org>/<repo>/blob/main/docs/runbooks: every alert's
    # `runbook_url` is <base>/<AlertName>.md. Unset, it is the page's path in
    # the repository, docs/runbooks/<AlertName>.md.
    runbook_base_url: Annotated[str, AfterValidator(_runbook_base_url)] | None = None
    tracing: Tracing = Tracing()


# NLB security policies that negotiate TLS 1.2 or 1.3 only (AWS's
# "describe-ssl-policies" for network load balancers).
TlsPolicy = Literal[
    "ELBSecurityPolicy-TLS13-1-2-Res-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-2021-06",
    "ELBSecurityPolicy-TLS13-1-3-2021-06",
]


class Endpoint(_Section):
    """How clients reach the OpenAI-compatible API."""

    scheme: Literal["internal", "internet-facing"] = "internal"
    allowed_cidrs: list[IPv4Network] = Field(default_factory=list)
    certificate_arn: str | None = None
    # Each RayService answers at <service>.<domain> (a network load balancer
    # can not route on the request's model); the certificate covers
    # *.<domain>, and external-dns, where it runs, creates the records.
    domain: str | None = Field(default=None, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z]{2,}$")
    # The Route 53 hosted zone of `domain`: external-dns writes the records
    # there, and its role may change that zone only.
    hosted_zone_id: str | None = Field(default=None, pattern=r"^Z[0-9A-Z]{4,31}$")
    # The NLB's TLS security policy (protocols and ciphers clients may
    # negotiate) when it holds a certificate. Without one the controller
    # falls back to ELBSecurityPolicy-2016-08, which still accepts TLS 1.0.
    # These accept TLS 1.3 and 1.2 only; the `Res` (restricted) one only
    # forward-secret AEAD ciphers on 1.2.
    tls_policy: TlsPolicy = "ELBSecurityPolicy-TLS13-1-2-Res-2021-06"

    def service_host(self, service: str) -> str | None:
        """The DNS name of one RayService's endpoint, when a domain is set."""
        return f"{service}.{self.domain}" if self.domain else None


# A batch request must end this long before its message's visibility
# timeout, so the answer is stored and the message deleted while the worker
# still holds it.
BATCH_VISIBILITY_MARGIN_SECONDS = 30


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

    def request_timeout_seconds(self) -> int:
        """One request's budget in a worker: inside the visibility timeout, leaving time to store the answer."""
        return self.visibility_timeout_seconds - BATCH_VISIBILITY_MARGIN_SECONDS


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

    def layouts(self) -> dict[str, Layout]:
        """RayService name -> the layout it is served in (`serving.layout`, `auto` resolved)."""
        return {name: self.layout_of(name) for name in self.services()}

    def layout_of(self, service: str) -> Layout:
        """The layout of one RayService (by name)."""
        return self.layout_for(self.services()[service])

    def layout_for(self, models: list[Model]) -> Layout:
        """The layout of a RayService serving `models`: the configured one, or under `auto` the best it can use."""
        layout = self.serving.layout
        if layout == "serve-ingress" or (layout == "auto" and vllm_server_problem(models)):
            return "serve-ingress"
        return "vllm-server"

    def uses_serve_ingress(self) -> bool:
        """Whether any RayService runs Serve LLM's OpenAI ingress (and so reads `serving.ingress`)."""
        return "serve-ingress" in self.layouts().values()


def vllm_server_problem(models: list[Model]) -> str | None:
    """Why a RayService serving `models` can not use the vllm-server layout, or None.

    The same rules the server's catalogue enforces (catalog.Catalog), stated
    here so a config fails at preview with its key instead: the load balancer
    can not route on a request's `model` field (one model per service),
    nothing in the path wakes a replica at zero, and a replica is one pod.
    """
    if len(models) != 1:
        return f"it serves exactly one model per service (service '{models[0].service_name}' has {len(models)})"
    (model,) = models
    if model.autoscaling.min_replicas < 1:
        return f"model '{model.name}' needs autoscaling.min_replicas >= 1 (nothing in its path wakes it from zero)"
    if model.pipeline_parallel_size != 1:
        return f"model '{model.name}' needs pipeline_parallel_size 1 (a replica must fit in one pod)"
    return None


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
        return
    yield from _check_instance_order(f"{path}.instance_types", group)


def _size(gpu: GpuInstanceType) -> str:
    return f"{gpu.name} ({gpu.vcpus} vCPUs, {gpu.memory_gib} GiB)"


def _check_instance_order(path: str, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """Smallest first: the first type is the node template, and the pods are sized from it."""
    types = [GPU_INSTANCE_TYPES[t] for t in group.instance_types]
    ordered = sorted(types, key=lambda t: (t.vcpus, t.memory_gib))
    if types == ordered:
        return
    listing = f"list the instance types of group '{group.name}' smallest first ({', '.join(t.name for t in ordered)})"
    if types[0] != ordered[0]:
        yield Problem(
            path,
            f"{listing}: cluster-autoscaler and EKS take the first, {_size(types[0])}, as the node template "
            f"and the pods are sized from it, so they would never fit a {_size(ordered[0])}",
        )
    else:
        yield Problem(path, f"{listing}: the order is read as the sizes a group grows through")


def _check_parallelism(path: str, model: Model, gpu: GpuInstanceType) -> Iterable[Problem]:
    """TP within a node and dividing it; pipeline stages that fill whole nodes.

    A TP group that does not divide a node would strand its other GPUs.
    That TP also divides the model's attention and KV heads, which vLLM
    shards over the TP ranks, is checked against the model's geometry by
    the capacity rules (infra/capacity/rules.py), once this rule holds.
    """
    tp, pp = model.tensor_parallel_size, model.pipeline_parallel_size
    if tp > gpu.gpus:
        yield Problem(
            f"{path}.tensor_parallel_size",
            f"{tp} GPUs do not fit {gpu.name} ({gpu.gpus} GPU{'s' if gpu.gpus > 1 else ''})",
        )
    elif gpu.gpus % tp:
        divisors = [str(d) for d in range(1, gpu.gpus + 1) if gpu.gpus % d == 0]
        yield Problem(
            f"{path}.tensor_parallel_size",
            f"{tp} does not divide the {gpu.gpus} GPUs of {gpu.name}: use {', '.join(divisors[:-1])} or "
            f"{divisors[-1]} (vLLM splits the attention heads over the TP ranks, and the models' head counts "
            "are powers of two; a TP group that does not divide a node also strands its other GPUs)",
        )
    elif tp * pp > gpu.gpus and tp != gpu.gpus:
        yield Problem(
            f"{path}.pipeline_parallel_size",
            f"{pp} stages of {tp} GPUs span nodes of {gpu.name} ({gpu.gpus} GPUs) but do not fill them: "
            f"each pipeline stage must use a whole node (tensor_parallel_size {gpu.gpus})",
        )


def _check_model_capacity(path: str, model: Model, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """The weights fit the replica's GPUs with room for a KV cache; the minimum replicas fit the group."""
    gpu = group.instance()
    gpus = model.num_devices
    budget = gpus * gpu.gpu_memory_bytes / GIB * model.gpu_memory_utilization
    weights = model.weights_gib()
    if weights > budget * (1 - KV_CACHE_MIN_SHARE):
        yield Problem(
            path,
            f"weights of {weights:.1f} GiB do not fit {gpus} x {gpu.gpu_model} "
            f"{gpu.gpu_memory_bytes / GIB:.1f} GiB ({gpu.gpu_memory_gb} GB) x gpu_memory_utilization "
            f"{model.gpu_memory_utilization} "
            f"= {budget:.1f} GiB with {KV_CACHE_MIN_SHARE:.0%} left for the KV cache",
        )
    need = model.autoscaling.min_replicas * _nodes_per_replica(model, gpu)
    if need > group.max_size:
        yield Problem(
            f"{path}.autoscaling.min_replicas",
            f"{model.autoscaling.min_replicas} replicas need {need} {gpu.name} nodes "
            f"but node group '{group.name}' has max_size {group.max_size}",
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
    parallelism = list(_check_parallelism(path, model, gpu))
    yield from parallelism
    if not parallelism:
        yield from _check_model_capacity(path, model, group)


def _usable_group(group: GpuNodeGroupSettings | None) -> bool:
    """The group exists and every instance type is in the catalogue (else another rule reports it)."""
    return group is not None and all(t in GPU_INSTANCE_TYPES for t in group.instance_types)


def _check_model(i: int, model: Model, cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    path = f"models[{i}]"
    group = groups.get(model.gpu_group)
    if group is None:
        yield Problem(
            f"{path}.gpu_group",
            f"'{model.gpu_group}' is not a GPU node group (have: {', '.join(groups) or 'none'})",
        )
    elif _usable_group(group):
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
    if cfg.is_prod and model.autoscaling.min_replicas < PROD_MIN_MODEL_REPLICAS:
        yield Problem(
            f"{path}.autoscaling.min_replicas",
            f"prod models keep at least {PROD_MIN_MODEL_REPLICAS} replicas, so one serves while a node drains "
            f"('{model.name}' has {model.autoscaling.min_replicas})",
        )
    yield from _check_engine_overrides(path, model)
    yield from _check_capacity(path, model, group if _usable_group(group) else None)


def _check_capacity(path: str, model: Model, group: GpuNodeGroupSettings | None) -> Iterable[Problem]:
    """The model's geometry is known, and its context, TP and KV cache fit it (infra/capacity/rules.py)."""
    geometry = resolve_geometry(model.geometry, model.source, model.model_id)
    if geometry is None:
        yield Problem(f"{path}.geometry", unknown_model_message(model.name, model.source, model.model_id))
        return
    gpu = group.instance() if group is not None else None
    if gpu is not None and list(_check_parallelism(path, model, gpu)):
        gpu = None
    for key, message in capacity_problems(model.name, model, geometry, model.parameters_billion, gpu):
        yield Problem(f"{path}.{key}", message)


# Prod keeps every model serving through a node drain (an upgrade, a
# consolidation, a spot reclaim): two replicas, never on one node.
PROD_MIN_MODEL_REPLICAS = 2
_ENGINE_ARGS_FILE = Path(__file__).with_name("vllm_engine_args.json")


@cache
def vllm_engine_args() -> tuple[str, frozenset[str]]:
    """The pinned vLLM's version and the engine argument names Ray Serve LLM passes it (infra/vllm_engine_args.json)."""
    data = json.loads(_ENGINE_ARGS_FILE.read_text())
    return str(data["vllm_version"]), frozenset(data["engine_args"]) | frozenset(data["frontend_args"])


def _check_engine_overrides(path: str, model: Model) -> Iterable[Problem]:
    version, known = vllm_engine_args()
    for key in model.engine_overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            yield Problem(
                f"{path}.engine_overrides.{key}",
                f"not an engine argument of vLLM {version}{hint}: Ray Serve LLM would refuse it "
                "when the replica starts",
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


# The widest single range an allow-list may name (a /8 is already 16.7
# million addresses), and the most public addresses a whole list may admit:
# an allow-list names clients, and one made of halves or quarters of the
# internet (0.0.0.0/1 and 128.0.0.0/1) is the internet.
MIN_ALLOWED_PREFIX = 8
MAX_ALLOWED_PUBLIC_ADDRESSES = 2 ** (32 - MIN_ALLOWED_PREFIX)


def cidr_list_problem(cidrs: Iterable[IPv4Network]) -> str | None:
    """Why an allow-list is too wide to be one, or None.

    Each range must be /MIN_ALLOWED_PREFIX or narrower, and the ranges
    together may admit at most MAX_ALLOWED_PUBLIC_ADDRESSES public addresses
    (private ranges, RFC 1918 and the like, do not count: they reach the
    load balancer only through networks the account routes).
    """
    cidrs = list(cidrs)
    wide = [str(c) for c in cidrs if c.prefixlen < MIN_ALLOWED_PREFIX]
    if wide:
        return f"{', '.join(wide)} is wider than /{MIN_ALLOWED_PREFIX} (name the clients' own ranges)"
    # Private ranges left out before collapsing: 10.0.0.0/8 and 11.0.0.0/8 would merge into a public /7.
    public = sum(c.num_addresses for c in collapse_addresses(c for c in cidrs if not c.is_private))
    if public > MAX_ALLOWED_PUBLIC_ADDRESSES:
        return (
            f"the ranges together admit {public} public addresses, more than one /{MIN_ALLOWED_PREFIX} "
            f"({MAX_ALLOWED_PUBLIC_ADDRESSES}): name the clients' own ranges"
        )
    return None


def _check_access(cfg: StackConfig) -> Iterable[Problem]:
    ep = cfg.endpoint
    for key, cidrs in (
        ("endpoint.allowed_cidrs", ep.allowed_cidrs),
        ("cluster.public_access_cidrs", cfg.cluster.public_access_cidrs),
    ):
        problem = cidr_list_problem(cidrs)
        if problem:
            yield Problem(key, problem)
    if not ep.certificate_arn and ep.scheme == "internal":
        # No TLS: requests and their API keys cross the network in clear, so
        # only private networks may reach the endpoint (an internet-facing one
        # needs a certificate, below). With no list the load balancer admits
        # the VPC alone (infra/serving/endpoint.py source_ranges).
        public = [str(c) for c in ep.allowed_cidrs if not c.is_private]
        if public:
            yield Problem(
                "endpoint.allowed_cidrs",
                f"{', '.join(public)} is not a private range: without endpoint.certificate_arn the endpoint "
                "serves plain HTTP, and API keys must not cross public networks in clear",
            )
    if ep.scheme == "internet-facing":
        if cfg.is_prod and not ep.allowed_cidrs:
            yield Problem(
                "endpoint.allowed_cidrs", "prod may not use an internet-facing endpoint without an allow-list"
            )
        if not ep.certificate_arn:
            yield Problem(
                "endpoint.certificate_arn",
                "an internet-facing endpoint needs a TLS certificate (API keys must not cross the internet in clear)",
            )
    cl = cfg.cluster
    if cl.mode == "eks":
        if not (cl.endpoint_public_access or cl.endpoint_private_access):
            yield Problem("cluster.endpoint_private_access", "the API server needs public or private access")
        # 0.0.0.0/0 (or any list as wide) is refused above, for every stack.
        if cl.endpoint_public_access and not cl.public_access_cidrs:
            yield Problem(
                "cluster.public_access_cidrs",
                "a public API server endpoint needs a CIDR allow-list without 0.0.0.0/0",
            )
        if cfg.is_prod and cl.endpoint_public_access:
            yield Problem("cluster.endpoint_public_access", "prod keeps the API server endpoint private")


def _check_dns(cfg: StackConfig) -> Iterable[Problem]:
    ep = cfg.endpoint
    if ep.domain and ep.hosted_zone_id is None and cfg.platform.external_dns.enabled:
        yield Problem(
            "endpoint.hosted_zone_id",
            f"required with endpoint.domain: external-dns writes <service>.{ep.domain} into that Route 53 zone "
            "(an existing cluster whose records are made elsewhere may switch platform.external_dns off)",
        )
    if ep.hosted_zone_id is not None and not ep.domain:
        yield Problem("endpoint.hosted_zone_id", "set endpoint.domain too: the zone holds that domain's records")


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
    if cfg.cluster.mode == "eks":
        yield from _check_vpc_size(cfg.network)
    if cfg.cluster.kubernetes_version != versions.KUBERNETES_VERSION and not re.match(
        r"^1\.\d+$", cfg.cluster.kubernetes_version
    ):
        yield Problem("cluster.kubernetes_version", "must be a Kubernetes minor such as 1.35")


def _check_vpc_size(network: Network) -> Iterable[Problem]:
    """The VPC holds every zone's subnets as the network layer lays them out.

    awsx gives each zone an equal, aligned block (the VPC split into the next
    power of two of zones) and packs the zone's subnets into it.
    """
    cidr, zones = network.vpc_cidr, len(network.zones)
    low, high = VPC_PREFIX_RANGE
    if not low <= cidr.prefixlen <= high:
        yield Problem("network.vpc_cidr", f"AWS allows a VPC from /{low} to /{high} (got {cidr})")
        return
    zone_bits = (zones - 1).bit_length()
    zone_prefix = cidr.prefixlen + zone_bits
    need = 2 ** (32 - PRIVATE_CIDR_MASK) + 2 ** (32 - PUBLIC_CIDR_MASK)
    if 2 ** (32 - zone_prefix) < need:
        largest = 32 - (need - 1).bit_length() - zone_bits
        yield Problem(
            "network.vpc_cidr",
            f"{cidr} is too small for {zones} zones: each zone gets a /{zone_prefix} ({2 ** (32 - zone_prefix)} "
            f"addresses) but needs a /{PRIVATE_CIDR_MASK} private and a /{PUBLIC_CIDR_MASK} public subnet "
            f"({need} addresses); use a /{largest} or larger",
        )


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# KEDA's cron scaler: minute hour day-of-month month day-of-week, the ranges
# its parser accepts (Sunday is 0 only), names for months and weekdays.
_CRON_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {name: i + 1 for i, name in enumerate(_MONTHS)}),
    ("day of week", 0, 6, {name: i for i, name in enumerate(_WEEKDAYS)}),
)


def _cron_value(token: str, low: int, high: int, names: dict[str, int]) -> str | int:
    """The number a cron token stands for, or why it is not one."""
    value = names.get(token.lower()) if names and token.isalpha() else (int(token) if token.isdigit() else None)
    if value is None:
        return f"'{token}' is not a number{' or a name' if names else ''}"
    if not low <= value <= high:
        return f"{value} is outside {low}-{high}"
    return value


def _cron_part_problem(part: str, low: int, high: int, names: dict[str, int]) -> str | None:
    """Why one comma-separated part of a cron field is wrong (`*`, `a`, `a-b`, each with an optional `/step`)."""
    body, slash, step = part.partition("/")
    if slash and not (step.isdigit() and int(step) > 0):
        return f"step '{step}' is not a positive number"
    if body in ("*", "?"):
        return None
    ends = [_cron_value(token, low, high, names) for token in body.split("-", 1)]
    for end in ends:
        if isinstance(end, str):
            return end
    if len(ends) == 2 and int(ends[0]) > int(ends[1]):
        return f"range {body} runs backwards"
    return None


def cron_problem(expression: str) -> str | None:
    """Why a 5-field cron expression is wrong, or None."""
    fields = expression.split()
    if len(fields) != len(_CRON_FIELDS):
        return f"'{expression}' is not a 5-field cron expression (minute hour day-of-month month day-of-week)"
    for text, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        for part in text.split(","):
            problem = _cron_part_problem(part, low, high, names)
            if problem:
                return f"'{expression}': {name} {problem}"
    return None


def timezone_problem(name: str) -> str | None:
    """Why a time zone name is not an IANA zone, or None (zoneinfo, with the tzdata package as fallback)."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        close = difflib.get_close_matches(name, available_timezones(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"'{name}' is not an IANA time zone{hint}"
    return None


def _check_prescale(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    for i, window in enumerate(cfg.autoscaling.prescale):
        path = f"autoscaling.prescale[{i}]"
        group = groups.get(window.gpu_group)
        if group is None:
            yield Problem(f"{path}.gpu_group", f"'{window.gpu_group}' is not a GPU node group")
        elif window.nodes > group.max_size:
            yield Problem(
                f"{path}.nodes",
                f"{window.nodes} nodes exceed node group '{group.name}' max_size {group.max_size}",
            )
        for key, expression in (("start", window.start), ("end", window.end)):
            problem = cron_problem(expression)
            if problem:
                yield Problem(f"{path}.{key}", problem)
        zone_problem = timezone_problem(window.timezone)
        if zone_problem:
            yield Problem(f"{path}.timezone", zone_problem)


_DURATION_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
# Pulumi's default wait for a RayService's Ready (infra/serving/ray_service.py):
# big models stream tens of GiB and compile longer.
PULUMI_WAIT_BIG_MODEL_GIB = 40.0
PULUMI_WAIT_SMALL_SECONDS = 1800
PULUMI_WAIT_BIG_SECONDS = 3600


def duration_seconds(value: str) -> int:
    """A `Duration` ("15m") in seconds."""
    return int(value[:-1]) * _DURATION_SECONDS[value[-1]]


def pulumi_wait_seconds(cfg: StackConfig, models: list[Model]) -> int:
    """Pulumi's wait for a RayService of `models`: `ray.cold_start.pulumi_wait_seconds`, else by the biggest model."""
    configured = cfg.ray.cold_start.pulumi_wait_seconds
    if configured is not None:
        return configured
    biggest = max(m.weights_gib() for m in models)
    return PULUMI_WAIT_BIG_SECONDS if biggest >= PULUMI_WAIT_BIG_MODEL_GIB else PULUMI_WAIT_SMALL_SECONDS


def _cold_start_timeouts(cfg: StackConfig, model: Model) -> list[Timeout]:
    """The timeouts a cold start of `model` runs under, each with the part of the budget it covers."""
    t, key = cfg.ray.cold_start, "ray.cold_start"
    service = [m for m in cfg.models if m.service_name == model.service_name]
    return [
        Timeout(
            f"{key}.autoscaler_allocate_seconds",
            t.autoscaler_allocate_seconds,
            "to_ray_up",
            "the Ray autoscaler's allocate timeout",
        ),
        Timeout(
            f"{key}.autoscaler_ray_install_seconds",
            t.autoscaler_ray_install_seconds,
            "to_ray_up",
            "the Ray autoscaler's ray-install timeout",
        ),
        Timeout(
            f"{key}.engine_start_seconds", t.engine_start_seconds, "in_container", "Serve LLM's engine start timeout"
        ),
        Timeout(f"{key}.pulumi_wait_seconds", pulumi_wait_seconds(cfg, service), "total", "Pulumi's wait for Ready"),
        Timeout(
            "autoscaling.cluster.max_node_provision_time",
            duration_seconds(cfg.autoscaling.cluster.max_node_provision_time),
            "node_ready",
            "cluster-autoscaler's node provision time",
        ),
        # KubeRay's probes are not here: the liveness probe it injects checks
        # the raylet (up within Ray start, inside its 630 s window) and the
        # readiness probe only holds the pod out of the Service, so neither
        # ends a slow engine start (tests/test_cold_start.py checks the window).
    ]


def model_cold_start(cfg: StackConfig, model: Model, group: GpuNodeGroupSettings) -> ColdStart:
    """A model's cold-start budget on its group (infra/capacity/cold_start.py)."""
    instance = group.instance()
    hosts = 1 if model.num_devices <= instance.gpus else model.pipeline_parallel_size
    eager = str(model.engine_overrides.get("enforce_eager", False)).lower() == "true"
    weight_bytes = model.weights_gib() * GIB
    return cold_start(model.name, instance, weight_bytes, hosts, model.tensor_parallel_size, eager)


def _check_cold_start(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    """No timeout on a cold start's path is shorter than the part of the model's budget it covers."""
    budgets: dict[str, ColdStart] = {}
    for model in cfg.models:
        group = groups.get(model.gpu_group)
        if group is None or not _usable_group(group):
            continue
        budget = budgets[model.name] = model_cold_start(cfg, model, group)
        for key, message in timeout_problems(budget, _cold_start_timeouts(cfg, model)):
            yield Problem(key, message)
    for i, window in enumerate(cfg.autoscaling.prescale):
        on_group = [budgets[m.name] for m in cfg.models if m.gpu_group == window.gpu_group and m.name in budgets]
        if not on_group:
            continue
        longest = max(on_group, key=lambda b: b.total)
        lead = Timeout(
            f"autoscaling.prescale[{i}].lead_seconds", window.lead_seconds, "total", "the pre-scale lead time"
        )
        for key, message in timeout_problems(longest, [lead]):
            yield Problem(key, message)


def longest_generation_seconds(cfg: StackConfig) -> float:
    """The longest request the limits allow, at the SLO: first token, then max_tokens tokens at the p95 pace."""
    slo = cfg.observability.slo
    return slo.ttft_p95_seconds + cfg.serving.limits.max_tokens * slo.inter_token_p95_seconds


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
    longest = math.ceil(longest_generation_seconds(cfg))
    if batch.request_timeout_seconds() < longest:
        slo = cfg.observability.slo
        yield Problem(
            "batch.visibility_timeout_seconds",
            f"{batch.visibility_timeout_seconds} s leaves a worker a request timeout of "
            f"{batch.request_timeout_seconds()} s ({BATCH_VISIBILITY_MARGIN_SECONDS} s go to storing the answer), "
            f"below the longest generation the limits allow: {slo.ttft_p95_seconds} s to the first token + "
            f"{cfg.serving.limits.max_tokens} tokens x {slo.inter_token_p95_seconds} s (the SLO p95s) = {longest} s; "
            "such requests would time out on every receive and end in the dead-letter queue: "
            f"set at least {longest + BATCH_VISIBILITY_MARGIN_SECONDS}",
        )


def key_fairness(cfg: StackConfig) -> KeyFairness:
    """The catalogue's per-key caps: serving.fairness, with the batch worker's key held to its own concurrency.

    A worker keeps batch.messages_per_worker requests in flight, on one
    connection pool to the serve Service: a smaller cap would refuse part of
    every worker's own concurrency at the replica it talks to.
    """
    fairness = cfg.serving.fairness
    if not cfg.batch.enabled or BATCH_WORKER_KEY_ID in fairness.per_key:
        return fairness
    per_key = {**fairness.per_key, BATCH_WORKER_KEY_ID: cfg.batch.messages_per_worker}
    return fairness.model_copy(update={"per_key": per_key})


def replica_inflight_caps(cfg: StackConfig) -> dict[str, tuple[str, int]]:
    """RayService -> (config key, value) of the in-flight cap of the replica its guard runs in.

    vllm-server: the model's max_ongoing_requests (the guard holds it, Serve
    never sees the requests); serve-ingress: the OpenAI ingress replica's.
    """
    caps: dict[str, tuple[str, int]] = {}
    for name, models in cfg.services().items():
        if cfg.layout_for(models) == "vllm-server":
            i = cfg.models.index(models[0])
            caps[name] = (f"models[{i}].autoscaling.max_ongoing_requests", models[0].autoscaling.max_ongoing_requests)
        else:
            caps[name] = ("serving.ingress.max_ongoing_requests", cfg.serving.ingress.max_ongoing_requests)
    return caps


def _check_fairness(cfg: StackConfig) -> Iterable[Problem]:
    """Every key cap stays below every replica cap, and the batch worker's covers its own concurrency."""
    fairness = key_fairness(cfg)
    derived = fairness is not cfg.serving.fairness
    for key_id, cap in fairness.caps().items():
        if key_id == "*":
            path = "serving.fairness.max_inflight_per_key"
        elif derived and key_id == BATCH_WORKER_KEY_ID:
            path = "batch.messages_per_worker"
        else:
            path = f"serving.fairness.per_key.{key_id}"
        for service, (replica_path, replica_cap) in replica_inflight_caps(cfg).items():
            if cap >= replica_cap:
                yield Problem(
                    path,
                    f"{cap} is not below {replica_path} ({replica_cap}) of service '{service}': one key at its cap "
                    "would hold the whole replica and every other key would get 429",
                )
                break
    batch_cap = cfg.serving.fairness.per_key.get(BATCH_WORKER_KEY_ID)
    if cfg.batch.enabled and batch_cap is not None and batch_cap < cfg.batch.messages_per_worker:
        yield Problem(
            f"serving.fairness.per_key.{BATCH_WORKER_KEY_ID}",
            f"{batch_cap} is below batch.messages_per_worker ({cfg.batch.messages_per_worker}): each batch worker "
            "would be refused part of its own concurrency at the replica it talks to",
        )


def _check_limits(cfg: StackConfig) -> Iterable[Problem]:
    limit = cfg.serving.limits.max_prompt_tokens
    short = [f"'{m.name}' ({m.max_model_len})" for m in cfg.models if limit >= m.max_model_len]
    if short:
        yield Problem(
            "serving.limits.max_prompt_tokens",
            f"{limit} is not below the max_model_len of {', '.join(short)}: a prompt the server accepts "
            "would leave the model no room to answer",
        )
    # The prompts of one request together (a /v1/completions batch) never
    # cost more prefill than one prompt at the model's full context.
    total = cfg.serving.limits.max_request_prompt_tokens
    if total is not None:
        over = [f"'{m.name}' ({m.max_model_len})" for m in cfg.models if total > m.max_model_len]
        if over:
            yield Problem(
                "serving.limits.max_request_prompt_tokens",
                f"{total} exceeds the max_model_len of {', '.join(over)}: one request's prompts together would "
                "cost more prefill than a single prompt at the model's full context",
            )


# The partition of a region (the `aws` partition for every other region).
_PARTITIONS = (
    ("cn-", "aws-cn"),
    ("us-gov-", "aws-us-gov"),
    ("us-isob-", "aws-iso-b"),
    ("us-isof-", "aws-iso-f"),
    ("us-iso-", "aws-iso"),
    ("eu-isoe-", "aws-iso-e"),
    ("eusc-", "aws-eusc"),
)
_ARN = re.compile(
    r"^arn:(?P<partition>aws(-[a-z]+)*):(?P<service>[a-z0-9-]+):(?P<region>[a-z0-9-]*):(?P<account>\d{12})?:"
    r"(?P<resource>.+)$"
)
# A resource id as AWS writes them (a UUID, `mrk-...` for multi-Region keys).
_RESOURCE_ID = r"[A-Za-z0-9][A-Za-z0-9-]*"


@dataclass(frozen=True)
class ArnRule:
    """What an ARN field must name: the service, the resource form, and whether it lives in the stack's region."""

    service: str
    resource: str
    example: str
    regional: bool


# Every `*_arn` / `*_arns` field of the config and what it must name.
ARN_RULES: dict[str, ArnRule] = {
    # An IAM user or role: what an EKS access entry takes (not an STS assumed-role session).
    "cluster.admin_principal_arns": ArnRule("iam", r"(user|role)/[\w+=,.@/-]+", "role/<name>", regional=False),
    # The model bucket's policy names them as `aws:PrincipalArn`: a user or a role, never a session.
    "storage.weights_writer_arns": ArnRule("iam", r"(user|role)/[\w+=,.@/-]+", "role/<name>", regional=False),
    # A key, not an alias: the EBS CSI driver's IAM grants name it as a policy resource.
    "storage.storage_class.kms_key_arn": ArnRule("kms", rf"key/{_RESOURCE_ID}", "key/<id>", regional=True),
    # The NLB's TLS listener takes an ACM certificate of its own region.
    "endpoint.certificate_arn": ArnRule("acm", rf"certificate/{_RESOURCE_ID}", "certificate/<id>", regional=True),
}


def region_partition(region: str) -> str:
    """The AWS partition a region belongs to."""
    return next((partition for prefix, partition in _PARTITIONS if region.startswith(prefix)), "aws")


def _arn_problem(arn: str, rule: ArnRule, region: str) -> str | None:
    match = _ARN.match(arn)
    form = f"arn:{region_partition(region)}:{rule.service}:{region if rule.regional else ''}:<account>:{rule.example}"
    if match is None:
        return f"'{arn}' is not an ARN ({form})"
    if match["partition"] != region_partition(region):
        return f"'{arn}' is in partition {match['partition']}, region {region} in {region_partition(region)}"
    if match["service"] != rule.service or not re.fullmatch(rule.resource, match["resource"]):
        return f"'{arn}' is not {form}"
    if not match["account"]:
        return f"'{arn}' names no account ({form})"
    if (match["region"] or None) != (region if rule.regional else None):
        where = f"the stack's region {region}" if rule.regional else "no region (the service is global)"
        return f"'{arn}' must name {where}"
    return None


def _values_at(cfg: StackConfig, path: str) -> list[tuple[str, str]]:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    if isinstance(node, list):
        return [(f"{path}[{i}]", str(v)) for i, v in enumerate(node)]
    return [] if node is None else [(path, str(node))]


def _check_arns(cfg: StackConfig) -> Iterable[Problem]:
    for field, rule in ARN_RULES.items():
        for path, arn in _values_at(cfg, field):
            problem = _arn_problem(arn, rule, cfg.region)
            if problem:
                yield Problem(path, problem)


def _fits_once(model: Model, gpu: GpuInstanceType, group: GpuNodeGroupSettings) -> bool:
    """The model's parallelism is valid for the group and its minimum replicas fit the group once."""
    if list(_check_parallelism("", model, gpu)):
        return False
    return model.autoscaling.min_replicas * _nodes_per_replica(model, gpu) <= group.max_size


def upgrade_need(cfg: StackConfig, group: GpuNodeGroupSettings, headroom: UpgradeHeadroom | None = None) -> UpgradeNeed:
    """What `group` holds while every model on it upgrades at once, under `headroom` (else ray.upgrade_headroom)."""
    return UpgradeNeed(
        group=group.name,
        headroom=cfg.ray.upgrade_headroom if headroom is None else headroom,
        instance=group.instance(),
        fleets=tuple(Fleet(m.name, m.num_devices, m.autoscaling) for m in cfg.models if m.gpu_group == group.name),
    )


def _check_upgrade_headroom(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    """A NewCluster upgrade runs the old and the new cluster side by side: each group's max_size holds both.

    The old cluster counts at max_replicas or min_replicas as
    ray.upgrade_headroom says, the new one at its starting replicas
    (infra/capacity/upgrade.py). A change that reaches every RayService (a new
    image) upgrades them all at once, so every model of a group counts. A group
    whose models do not fit even once is reported by the model rules instead.
    """
    if cfg.ray.upgrade_strategy != "NewCluster":
        return
    for i, group in enumerate(cfg.node_groups.gpu):
        models = [m for m in cfg.models if m.gpu_group == group.name]
        if groups.get(group.name) is not group or not _usable_group(group) or not models:
            continue
        if not all(_fits_once(m, group.instance(), group) for m in models):
            continue
        problem = headroom_problem(upgrade_need(cfg, group), group.max_size)
        if problem:
            yield Problem(f"node_groups.gpu[{i}].max_size", problem)


def _check_provisioner(cfg: StackConfig) -> Iterable[Problem]:
    """Karpenter launches nodes for a cluster made here; only Karpenter launches into capacity reservations."""
    if cfg.cluster.node_provisioner == "karpenter":
        if cfg.cluster.mode == "existing":
            yield Problem(
                "cluster.node_provisioner",
                "karpenter needs cluster.mode: eks (an existing cluster's nodes are not made by this program)",
            )
        return
    for i, group in enumerate(cfg.node_groups.gpu):
        if group.capacity_reservation_ids:
            yield Problem(
                f"node_groups.gpu[{i}].capacity_reservation_ids",
                "needs cluster.node_provisioner: karpenter (managed node groups here do not target reservations)",
            )


def check_rules(cfg: StackConfig) -> list[Problem]:
    """Every cross-field rule; an empty list means the config is usable."""
    problems: list[Problem] = []
    problems += _check_provisioner(cfg)
    problems += _check_node_group("node_groups.system", cfg.node_groups.system)
    gpu_groups: dict[str, GpuNodeGroupSettings] = {}
    for i, group in enumerate(cfg.node_groups.gpu):
        problems += _check_gpu_group(i, group)
        gpu_groups.setdefault(group.name, group)
    for i, model in enumerate(cfg.models):
        problems += _check_model(i, model, cfg, gpu_groups)
    problems += _check_upgrade_headroom(cfg, gpu_groups)
    problems += _check_names(cfg)
    problems += _check_access(cfg)
    problems += _check_dns(cfg)
    problems += _check_arns(cfg)
    problems += _check_cluster_mode(cfg)
    problems += _check_network(cfg)
    problems += _check_prescale(cfg, gpu_groups)
    problems += _check_cold_start(cfg, gpu_groups)
    problems += _check_limits(cfg)
    problems += _check_fairness(cfg)
    problems += _check_batch(cfg)
    problems += _check_layout(cfg)
    problems += _check_ingress(cfg)
    return problems


def _check_layout(cfg: StackConfig) -> Iterable[Problem]:
    if cfg.serving.layout != "vllm-server":
        return
    problems = [p for p in map(vllm_server_problem, cfg.services().values()) if p]
    if problems:
        yield Problem("serving.layout", f"vllm-server: {'; '.join(problems)}; use auto or serve-ingress")


# Prod's OpenAI ingress survives the loss of a node: two replicas on two nodes.
PROD_MIN_INGRESS_REPLICAS = 2


def _check_ingress(cfg: StackConfig) -> Iterable[Problem]:
    # Without a serve-ingress service there is no OpenAI ingress to protect:
    # `serving.ingress` is then read by nothing.
    if not cfg.uses_serve_ingress():
        return
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
    """Each entry is `<id>:<secret>` (or a bare secret, whose id is its fingerprint), ids and secrets unique.

    Never echo a key: a message names the position, and the id where one is written.
    """
    out: list[Problem] = []
    ids: set[str] = set()
    secrets: set[str] = set()
    entries = split_api_keys(value)
    if not entries:
        return [Problem(SECRET_API_KEYS, "needs at least one key (<id>:<key>)")]
    for i, text in enumerate(entries, start=1):
        try:
            key = parse_entry(text, f"key {i}")
        except KeyFormatError as err:
            out.append(Problem(SECRET_API_KEYS, str(err)))
            continue
        named = f"key {i} ('{key.id}')" if key.explicit else f"key {i}"
        rules = [
            (len(key.secret) < API_KEY_MIN_LENGTH, f"is shorter than {API_KEY_MIN_LENGTH} characters"),
            (
                key.explicit and key.id == BATCH_WORKER_KEY_ID,
                f"uses the id '{BATCH_WORKER_KEY_ID}', the batch worker's own",
            ),
            (
                key.explicit and key.id.startswith(FINGERPRINT_PREFIX),
                f"uses an id starting '{FINGERPRINT_PREFIX}', kept for keys written without an id",
            ),
            (key.id in ids, "uses the id of another key"),
            (key.secret in secrets, "repeats another key"),
        ]
        out += [Problem(SECRET_API_KEYS, f"{named} {message}") for broken, message in rules if broken]
        ids.add(key.id)
        secrets.add(key.secret)
    return out


# A stand-in for the API keys secret when a stack file does not carry it
# (each user sets it with `pulumi config set --secret`); never a real key.
PLACEHOLDER_API_KEYS = "render-placeholder-key-0000000000000000"


def _duplicate_keys(node: yaml.Node | None, path: str) -> Iterable[Problem]:
    """Every key a YAML mapping repeats: a YAML loader keeps only the last, silently."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            # The stack file's keys are named as Pulumi names them: without `config.`.
            inner = key if path in ("", "config") else f"{path}.{key}"
            if key in seen:
                yield Problem(
                    inner,
                    f"duplicate key (lines {seen[key]} and {line}): YAML would keep only the last, silently",
                )
            seen.setdefault(key, line)
            yield from _duplicate_keys(value_node, inner)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, f"{path}[{i}]")


def read_stack_file(path: Path) -> tuple[dict[str, str], list[str]]:
    """Pulumi config (key -> value as the CLI passes it) and its secret keys.

    Structured values reach a program as JSON strings, scalars as strings;
    `secure:` values can not be decrypted offline and become placeholders.
    """
    text = path.read_text()
    try:
        duplicates = list(_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), ""))
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([Problem(str(path), f"not valid YAML{where}")]) from None
    if duplicates:
        raise ConfigError(duplicates)
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


# The config namespaces a stack may use, and what reads each. A key in any
# other namespace is read by nothing: a misspelt `llm-platfrom:endpoint`
# would quietly leave the endpoint at its defaults.
CONFIG_NAMESPACES = {
    NAMESPACE: "this program",
    "aws": "the AWS provider and the program (aws:region)",
    "docker-build": "the provider that builds the serving image",
    "pulumi": "the Pulumi engine (pulumi:tags, pulumi:disable-default-providers)",
}


def check_namespaces(keys: Iterable[str]) -> list[Problem]:
    """One problem per config key outside the namespaces something reads."""
    problems: list[Problem] = []
    for key in sorted(keys):
        namespace, colon, name = key.partition(":")
        if not (colon and namespace and name):
            problems.append(Problem(key, "not a config key: Pulumi config keys are <namespace>:<name>"))
        elif namespace not in CONFIG_NAMESPACES:
            close = difflib.get_close_matches(namespace, CONFIG_NAMESPACES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                Problem(
                    key,
                    f"unknown config namespace '{namespace}'{hint}: nothing reads it "
                    f"(the namespaces read are {', '.join(CONFIG_NAMESPACES)})",
                )
            )
    return problems


def load_stack_file(path: Path) -> StackConfig:
    """A stack file (`Pulumi.<stack>.yaml`) as the validated config; raise ConfigError."""
    values, _ = read_stack_file(path)
    problems = check_namespaces(values)
    if problems:
        raise ConfigError(problems)
    return parse(sections(values))


def load() -> LoadedConfig:
    """Read, validate and return the stack's config; raise ConfigError."""
    values = _all_config()
    # A misspelt namespace leaves whole sections at their defaults: report
    # it alone, not the knock-on problems of the sections it hides.
    misplaced = check_namespaces(values)
    if misplaced:
        raise ConfigError(misplaced)
    raw = sections(values)
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
