"""The stack configuration: one typed model, read from Pulumi config once.

Everything below this package takes a `StackConfig` (or a piece of it) as a
typed argument; nothing else calls `pulumi.Config`. A bad config stops the
program before any resource is declared, with one line per problem naming
the key path and the rule it breaks.

One module per section, each with the rules that judge its own fields, and
a few for the rules and the reading that span them:

fields.py          the shared field types (names, durations, quantities) and the section base
problems.py        `Problem` (one line per broken rule) and `ConfigError`
network.py         `network`: zones, the VPC, and the allow-lists' width
cluster.py         `cluster`: EKS or an existing cluster, and its node provisioner
platform.py        `versions` and `platform`: the in-cluster services
node_groups.py     `node_groups`: the system group and the GPU groups
storage.py         `storage`: the model bucket and the StorageClass
ray.py             `ray`: GCS fault tolerance, cold-start timeouts, the upgrade strategy
serving.py         `serving`: limits, layout, ingress
routing.py         `serving.routing`: the request router in front of each vllm-server service
gateway.py         `serving.gateway`: one address for the models of several vllm-server services
models.py          `models`: each model on its GPU group, its weights, vLLM's engine arguments
workload.py        a model's `workload`: the traffic its capacity is planned for, figures or a trace
autoscaling.py     `autoscaling`: cluster-autoscaler and the pre-scale windows
observability.py   `observability`: Prometheus, the SLOs, alerting, tracing
endpoint.py        `endpoint`: how clients reach the API, and its DNS
image.py           `image`: the serving image
batch.py           `batch`: queue-fed batch inference
stack.py           `StackConfig`, every section together
rules.py           `check_rules`, and the rules across sections
cold_start.py      the cold-start rule: each timeout on the path outlasts the model's budget
fairness.py        the per-key fairness rule and the caps the server gets
arns.py            the ARN rule, for every `*_arn` key
loader.py          Pulumi config or a stack file in; validation errors out as one line each
capacity_plan.py   the stack as the capacity plan (infra/capacity/) reads it

Import from the package (`from infra.config import StackConfig`), not from
its modules: the split is this package's own business.
"""

from infra.config.arns import ARN_RULES, ArnRule, region_partition
from infra.config.autoscaling import Autoscaling, ClusterAutoscaling, PreScale, cron_problem, timezone_problem
from infra.config.batch import BATCH_VISIBILITY_MARGIN_SECONDS, Batch
from infra.config.capacity_plan import capacity_input, preemption_free_sequences
from infra.config.cluster import Cluster, LogType
from infra.config.cold_start import (
    PULUMI_WAIT_BIG_MODEL_GIB,
    PULUMI_WAIT_BIG_SECONDS,
    PULUMI_WAIT_SMALL_SECONDS,
    cold_start_budget,
    model_cold_start,
    pulumi_wait_seconds,
)
from infra.config.endpoint import Endpoint, TlsPolicy
from infra.config.fairness import key_fairness, replica_inflight_caps
from infra.config.fields import CpuQuantity, Duration, K8sName, MemoryQuantity, duration_seconds, quantity_value
from infra.config.gateway import PROD_MIN_GATEWAY_REPLICAS, Gateway
from infra.config.image import Image
from infra.config.loader import (
    API_KEY_MIN_LENGTH,
    CONFIG_NAMESPACES,
    NAMESPACE,
    PLACEHOLDER_API_KEYS,
    SECRET_API_KEYS,
    LoadedConfig,
    _check_api_keys,
    check_namespaces,
    load,
    load_stack_file,
    parse,
    read_stack_file,
    sections,
    split_api_keys,
)
from infra.config.models import (
    KV_CACHE_MIN_SHARE,
    PROD_MIN_MODEL_REPLICAS,
    RAY_SERVICE_NAME_MAX,
    Model,
    vllm_engine_args,
)
from infra.config.network import (
    MAX_ALLOWED_PUBLIC_ADDRESSES,
    MIN_ALLOWED_PREFIX,
    PRIVATE_CIDR_MASK,
    PUBLIC_CIDR_MASK,
    VPC_PREFIX_RANGE,
    Network,
    cidr_list_problem,
)
from infra.config.node_groups import (
    GpuNodeGroupSettings,
    NodeGroups,
    NodeGroupSettings,
    ReservationId,
    SystemNodeGroupSettings,
    Taint,
)
from infra.config.observability import Observability, Slo, Tracing
from infra.config.platform import GpuOperatorSettings, Platform, Toggle, Versions
from infra.config.problems import ConfigError, Problem
from infra.config.ray import ELASTICACHE_FAMILIES, ColdStartTimeouts, GcsFaultTolerance, Ray
from infra.config.routing import PROD_MIN_ROUTER_REPLICAS, Routing, RoutingPolicy
from infra.config.rules import check_rules, upgrade_need
from infra.config.serving import PROD_MIN_INGRESS_REPLICAS, Serving, vllm_server_problem
from infra.config.stack import StackConfig, longest_generation_seconds
from infra.config.storage import Storage, StorageClass

__all__ = [
    "API_KEY_MIN_LENGTH",
    "ARN_RULES",
    "BATCH_VISIBILITY_MARGIN_SECONDS",
    "CONFIG_NAMESPACES",
    "ELASTICACHE_FAMILIES",
    "KV_CACHE_MIN_SHARE",
    "MAX_ALLOWED_PUBLIC_ADDRESSES",
    "MIN_ALLOWED_PREFIX",
    "NAMESPACE",
    "PLACEHOLDER_API_KEYS",
    "PRIVATE_CIDR_MASK",
    "PROD_MIN_GATEWAY_REPLICAS",
    "PROD_MIN_INGRESS_REPLICAS",
    "PROD_MIN_MODEL_REPLICAS",
    "PROD_MIN_ROUTER_REPLICAS",
    "PUBLIC_CIDR_MASK",
    "PULUMI_WAIT_BIG_MODEL_GIB",
    "PULUMI_WAIT_BIG_SECONDS",
    "PULUMI_WAIT_SMALL_SECONDS",
    "RAY_SERVICE_NAME_MAX",
    "SECRET_API_KEYS",
    "VPC_PREFIX_RANGE",
    "ArnRule",
    "Autoscaling",
    "Batch",
    "Cluster",
    "ClusterAutoscaling",
    "ColdStartTimeouts",
    "ConfigError",
    "CpuQuantity",
    "Duration",
    "Endpoint",
    "Gateway",
    "GcsFaultTolerance",
    "GpuNodeGroupSettings",
    "GpuOperatorSettings",
    "Image",
    "K8sName",
    "LoadedConfig",
    "LogType",
    "MemoryQuantity",
    "Model",
    "Network",
    "NodeGroupSettings",
    "NodeGroups",
    "Observability",
    "Platform",
    "PreScale",
    "Problem",
    "Ray",
    "ReservationId",
    "Routing",
    "RoutingPolicy",
    "Serving",
    "Slo",
    "StackConfig",
    "Storage",
    "StorageClass",
    "SystemNodeGroupSettings",
    "Taint",
    "TlsPolicy",
    "Toggle",
    "Tracing",
    "Versions",
    "_check_api_keys",
    "capacity_input",
    "check_namespaces",
    "check_rules",
    "cidr_list_problem",
    "cold_start_budget",
    "cron_problem",
    "duration_seconds",
    "key_fairness",
    "load",
    "load_stack_file",
    "longest_generation_seconds",
    "model_cold_start",
    "parse",
    "preemption_free_sequences",
    "pulumi_wait_seconds",
    "quantity_value",
    "read_stack_file",
    "region_partition",
    "replica_inflight_caps",
    "sections",
    "split_api_keys",
    "timezone_problem",
    "upgrade_need",
    "vllm_engine_args",
    "vllm_server_problem",
]
