"""The ``ray start`` command line of a RayCluster group, built the way the KubeRay 1.7 operator builds it.

The operator turns a group's ``rayStartParams``, its group-level
``resources`` and ``labels`` and its Ray container's resource limits into
one ``bash -c`` command (ray-operator/controllers/ray/common/pod.go):

1. ``updateRayStartParamsResources``: the group ``resources`` map, each value
   a Kubernetes quantity; ``cpu`` -> ``num-cpus``, ``memory`` -> ``memory``,
   a name ending in ``gpu`` (or a MIG slice) -> ``num-gpus``, all as integers
   rounded up; every other key goes into ``resources='{...}'``, JSON in single
   quotes that the operator writes itself.
2. ``updateRayStartParamsLabels``: the group ``labels``, ``k=v`` joined by commas.
3. the head gets ``no-monitor`` when in-tree autoscaling runs the autoscaler
   in its own container.
4. ``setMissingRayStartParams``: ``address`` for workers, ``dashboard-host`` for
   the head, ``metrics-export-port``, ``block`` (always), ``dashboard-agent-listen-port``.
5. ``generateRayStartCommand``: ``num-cpus`` and ``memory`` from the container's
   limits when absent, ``num-gpus`` from the first GPU limit, then
   ``convertParamMap``: keys sorted, ``--key=value`` with the value verbatim,
   nothing quoted or escaped.

The validation the operator applies first (utils/validation.go) is here too:
a group may not set ``resources`` together with ``rayStartParams``
``num-cpus``/``num-gpus``/``memory``/``resources``, nor ``rayStartParams.labels``.

This module imports no Ray: it produces the exact string; :mod:`twin.checks`
runs it through bash and Ray's own parser.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from infra.citations import Cite, marks

HEAD_GROUP = "headgroup"  # what Ray's KubeRay autoscaler calls the head's node type
DEFAULT_HEAD_PORT = "6379"
DEFAULT_METRICS_PORT = "8080"
DEFAULT_DASHBOARD_AGENT_LISTEN_PORT = "52365"
# Values that are not switches even when they read "true"/"false" (convertParamMap).
SPECIAL_PARAMETER_OPTIONS = ("log-color", "include-dashboard", "include-log-monitor")
# Container limits that KubeRay turns into Ray custom resources.
CUSTOM_ACCELERATORS = {"aws.amazon.com/neuroncore": "neuron_cores", "google.com/tpu": "TPU"}
# What the container runs: KubeRay wraps the command in `bash -c` after raising the file limit.
ULIMIT_PREFIX = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; "

_MIG = re.compile(r"nvidia\.com/mig-\d+g\.\d+gb$")
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$")
_SUFFIX = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


class KubeRayValidationError(ValueError):
    """The operator would reject the group (utils/validation.go) before it builds a pod."""


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "4Gi", "1e3", "2") as an exact decimal."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, exponent, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if exponent:
        return value * Decimal(10) ** int(exponent[1:])
    return value * _SUFFIX[suffix or ""]


def quantity_value(text: str) -> int:
    """``Quantity.Value()``: the quantity as an integer, rounded up."""
    return math.ceil(parse_quantity(text))


def go_float(value: float) -> str:
    """A float64 as Go's encoding/json writes it: integers without a fraction."""
    if value == int(value) and abs(value) < 1e21:
        return str(int(value))
    return repr(value)


def go_json_object(values: Mapping[str, float]) -> str:
    """``json.Marshal`` of a map[string]float64: keys sorted, no spaces."""
    return "{" + ",".join(f"{json.dumps(k)}:{go_float(v)}" for k, v in sorted(values.items())) + "}"


def is_gpu_resource(name: str) -> bool:
    """A resource name KubeRay counts as GPUs (``nvidia.com/gpu``, MIG slices)."""
    return name.endswith("gpu") or bool(_MIG.search(name))


@dataclass(frozen=True)
class GroupSpec:
    """One head or worker group of a RayCluster spec, as rendered."""

    name: str
    is_head: bool
    ray_start_params: dict[str, str]
    resources: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    requests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], *, is_head: bool) -> GroupSpec:
        """Reads a ``headGroupSpec`` or one ``workerGroupSpecs`` entry."""
        container = (spec.get("template", {}).get("spec", {}).get("containers") or [{}])[0]
        container_resources = container.get("resources") or {}
        return cls(
            name=HEAD_GROUP if is_head else str(spec["groupName"]),
            is_head=is_head,
            ray_start_params={str(k): _as_param(v) for k, v in (spec.get("rayStartParams") or {}).items()},
            resources={str(k): str(v) for k, v in (spec.get("resources") or {}).items()},
            labels={str(k): str(v) for k, v in (spec.get("labels") or {}).items()},
            limits={str(k): str(v) for k, v in (container_resources.get("limits") or {}).items()},
            requests={str(k): str(v) for k, v in (container_resources.get("requests") or {}).items()},
        )


def _as_param(value: Any) -> str:
    # rayStartParams is map[string]string in the CRD; YAML booleans reach the operator as strings.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def groups(ray_cluster_spec: Mapping[str, Any]) -> list[GroupSpec]:
    """The head group and every worker group of a ``rayClusterConfig``."""
    result = [GroupSpec.from_spec(ray_cluster_spec["headGroupSpec"], is_head=True)]
    result += [GroupSpec.from_spec(spec, is_head=False) for spec in ray_cluster_spec.get("workerGroupSpecs") or []]
    return result


def validate(group: GroupSpec) -> None:
    """The operator's own checks of a group (utils/validation.go); raises :class:`KubeRayValidationError`."""
    if group.resources:
        clash = sorted({"num-cpus", "num-gpus", "memory", "resources"} & set(group.ray_start_params))
        if clash:
            raise KubeRayValidationError(
                f"sets the group field `resources` together with rayStartParams {clash}; KubeRay accepts only one"
            )
    if "labels" in group.ray_start_params:
        raise KubeRayValidationError(
            "sets rayStartParams.labels; KubeRay takes node labels only from the group field `labels`"
        )


def update_ray_start_params_resources(params: dict[str, str], resources: Mapping[str, str]) -> None:
    """``updateRayStartParamsResources``: the group ``resources`` field into rayStartParams."""
    custom: dict[str, float] = {}
    for name, text in resources.items():
        try:
            quantity = parse_quantity(text)
        except ValueError:
            continue  # the operator skips a value it can not parse
        lowered = name.lower()
        if lowered == "cpu":
            params["num-cpus"] = str(math.ceil(quantity))
        elif lowered == "memory":
            params["memory"] = str(math.ceil(quantity))
        elif is_gpu_resource(lowered):
            params["num-gpus"] = str(math.ceil(quantity))
        else:
            custom[name] = float(quantity)
    if custom:
        # The operator quotes what it writes itself.
        params["resources"] = f"'{go_json_object(custom)}'"


def update_ray_start_params_labels(params: dict[str, str], labels: Mapping[str, str]) -> None:
    """``updateRayStartParamsLabels``: the group ``labels`` as ``k=v,...``, sorted."""
    if labels:
        params["labels"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def set_missing_ray_start_params(params: dict[str, str], *, is_head: bool, head_address: str) -> None:
    """``setMissingRayStartParams``."""
    if not is_head:
        params.setdefault("address", head_address)
    else:
        params.setdefault("dashboard-host", "0.0.0.0")
    params.setdefault("metrics-export-port", DEFAULT_METRICS_PORT)
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT)


def _resources_map(params: Mapping[str, str]) -> dict[str, float] | None:
    """``getResourcesMap``: rayStartParams.resources with quotes and spaces trimmed, or None if unparseable."""
    if "resources" not in params:
        return {}
    try:
        parsed = json.loads(params["resources"].strip("'\"` "))
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, float)) for v in parsed.values()):
        return None
    return {str(k): float(v) for k, v in parsed.items()}


def add_well_known_accelerator_resources(params: dict[str, str], limits: Mapping[str, str]) -> None:
    """``addWellKnownAcceleratorResources``: ``num-gpus`` and Neuron/TPU resources from the limits.

    When rayStartParams.resources does not parse, the operator logs an error
    and returns before it sets ``num-gpus``: so does this.
    """
    if not limits:
        return
    resources = _resources_map(params)
    if resources is None:
        return
    custom_present = any(name in resources for name in CUSTOM_ACCELERATORS.values())
    for name in sorted(limits):
        try:
            quantity = parse_quantity(limits[name])
        except ValueError:
            continue
        if "num-gpus" not in params and is_gpu_resource(name) and quantity != 0:
            params["num-gpus"] = str(math.ceil(quantity))
        if not custom_present and name in CUSTOM_ACCELERATORS and quantity != 0:
            ray_name = CUSTOM_ACCELERATORS[name]
            if ray_name not in resources:
                resources[ray_name] = float(quantity)
                params["resources"] = f"'{go_json_object(resources)}'"
            custom_present = True


def convert_param_map(params: Mapping[str, str]) -> str:
    """``convertParamMap``: `` --key=value `` per key, sorted; "true" is a bare switch, "false" is dropped."""
    flags = []
    for option in sorted(params):
        argument = params[option]
        if argument.lower() in ("true", "false") and option not in SPECIAL_PARAMETER_OPTIONS:
            if argument.lower() == "true":
                flags.append(f" --{option} ")
        else:
            flags.append(f" --{option}={argument} ")
    return "".join(flags)


def generate_ray_start_command(
    params: dict[str, str], *, is_head: bool, limits: Mapping[str, str], requests: Mapping[str, str]
) -> str:
    """``generateRayStartCommand``: CPUs, memory and GPUs from the container, then the flags."""
    if "num-cpus" not in params:
        for source in (limits, requests):
            cpu = source.get("cpu")
            if cpu is not None and parse_quantity(cpu) != 0:
                params["num-cpus"] = str(quantity_value(cpu))
                break
    if "memory" not in params:
        memory = limits.get("memory")
        if memory is not None and parse_quantity(memory) != 0:
            params["memory"] = str(quantity_value(memory))
    add_well_known_accelerator_resources(params, limits)
    prefix = "ray start --head" if is_head else "ray start"
    return f"{prefix} {convert_param_map(params)}"


@dataclass(frozen=True)
class StartCommand:
    """What KubeRay would run in one group's Ray container."""

    group: str
    params: dict[str, str]
    ray_start: str

    @property
    def container_command(self) -> str:
        """The ``bash -c`` argument of the container."""
        return ULIMIT_PREFIX + self.ray_start


def build_start_command(group: GroupSpec, *, head_address: str, in_tree_autoscaling: bool) -> StartCommand:
    """The ``ray start`` line of ``group``; raises :class:`KubeRayValidationError` for a group the operator refuses."""
    validate(group)
    params = dict(group.ray_start_params)
    update_ray_start_params_resources(params, group.resources)
    update_ray_start_params_labels(params, group.labels)
    if group.is_head and in_tree_autoscaling:
        params["no-monitor"] = "true"
    set_missing_ray_start_params(params, is_head=group.is_head, head_address=head_address)
    command = generate_ray_start_command(params, is_head=group.is_head, limits=group.limits, requests=group.requests)
    return StartCommand(group=group.name, params=params, ray_start=command)


def head_service_address(cluster_name: str, namespace: str, port: str = DEFAULT_HEAD_PORT) -> str:
    """The head Service's FQDN and GCS port, as workers are given it."""
    return f"{cluster_name}-head-svc.{namespace}.svc.cluster.local:{port}"


# =====================================================================================
# The rest of the operator the platform relies on, ported from KubeRay v1.7.0.
#
# Every rule below cites the line of KubeRay (or of the AWS load balancer
# controller, v3.5.0, which acts on the same Service and pods) it ports, and
# quotes it: tests/twin/test_kuberay_citations.py reads each cited line in the
# pinned sources and fails when it no longer says what is quoted, so a bump of
# either forces a re-read. Tests and the twin build Ray pods and Services only
# through these functions.
# =====================================================================================


_KUBERAY = "kuberay/src-v1.7.0/ray-operator/controllers/ray/"
_LBC = "aws-load-balancer-controller/src-v3.5.0/"
_CHART = "kuberay/src-v1.7.0/helm-chart/kuberay-operator/"
# Marker -> the folder (under the reference) its paths are in.
MARKERS = {"_k": _KUBERAY, "_lbc": _LBC, "_chart": _CHART, "_values": "kuberay/"}


def _k(path: str, line: int, quote: str) -> None:
    """Marks the line of KubeRay's ray-operator/controllers/ray/ the code beside it ports (infra/citations.py)."""


def _lbc(path: str, line: int, quote: str) -> None:
    """Marks the line of the AWS load balancer controller the code beside it ports (infra/citations.py)."""


def _chart(path: str, line: int, quote: str) -> None:
    """Marks the line of KubeRay's operator chart (helm-chart/kuberay-operator/) the code beside it ports."""


def _values(path: str, line: int, quote: str) -> None:
    """Marks the line of the operator chart's values (kuberay/operator-chart-values.yaml in the reference)."""


def citations() -> list[Cite]:
    """Every mark in this module, read from its source."""
    return marks(Path(__file__), MARKERS)


# --- constants (utils/constant.go) -------------------------------------------------

_k("utils/constant.go", 17, 'RayOriginatedFromCRNameLabelKey          = "ray.io/originated-from-cr-name"')
ORIGINATED_FROM_NAME = "ray.io/originated-from-cr-name"
_k("utils/constant.go", 18, 'RayOriginatedFromCRDLabelKey             = "ray.io/originated-from-crd"')
ORIGINATED_FROM_CRD = "ray.io/originated-from-crd"
_k("utils/constant.go", 19, 'RayClusterLabelKey                       = "ray.io/cluster"')
CLUSTER_LABEL = "ray.io/cluster"
_k("utils/constant.go", 20, 'RayNodeTypeLabelKey                      = "ray.io/node-type"')
NODE_TYPE_LABEL = "ray.io/node-type"
_k("utils/constant.go", 21, 'RayNodeGroupLabelKey                     = "ray.io/group"')
GROUP_LABEL = "ray.io/group"
_k("utils/constant.go", 22, 'RayNodeLabelKey                          = "ray.io/is-ray-node"')
IS_RAY_NODE_LABEL = "ray.io/is-ray-node"
_k("utils/constant.go", 23, 'RayIDLabelKey                            = "ray.io/identifier"')
IDENTIFIER_LABEL = "ray.io/identifier"
_k("utils/constant.go", 24, 'RayClusterServingServiceLabelKey         = "ray.io/serve"')
SERVE_LABEL = "ray.io/serve"
_k("utils/constant.go", 98, 'KubernetesApplicationNameLabelKey = "app.kubernetes.io/name"')
APP_NAME_LABEL = "app.kubernetes.io/name"
_k("utils/constant.go", 99, 'KubernetesCreatedByLabelKey       = "app.kubernetes.io/created-by"')
CREATED_BY_LABEL = "app.kubernetes.io/created-by"
_k("utils/constant.go", 126, 'ApplicationName = "kuberay"')
APPLICATION_NAME = "kuberay"
_k("utils/constant.go", 129, 'ComponentName = "kuberay-operator"')
COMPONENT_NAME = "kuberay-operator"
_k("utils/constant.go", 352, 'RayNodeHeadGroupLabelValue      = "headgroup"')
_k("utils/constant.go", 116, 'ServingPortName   = "serve"')
SERVING_PORT_NAME = "serve"
_k("utils/constant.go", 110, "DefaultServingPort              = 8000")
DEFAULT_SERVING_PORT = 8000
_k("utils/constant.go", 337, 'RayServeProxyHealthPath                  = "-/healthz"')
_k(
    "utils/constant.go",
    340,
    'BaseWgetHealthCommand = "wget --tries 1 -T %d -q -O- http://localhost:%d/%s | grep success"',
)
WGET_HEALTH = "wget --tries 1 -T {timeout} -q -O- http://localhost:{port}/{path} | grep success"
HEAD, WORKER, REDIS_CLEANUP = "head", "worker", "redis-cleanup"
RAY_CONTAINER_INDEX = 0


# --- pods (common/pod.go) ----------------------------------------------------------


def _meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj.get("metadata") or {})


def label_pod(node_type: str, cluster_name: str, group: str, override: Mapping[str, str]) -> dict[str, str]:
    """``labelPod``: KubeRay's own labels, then the template's and group's, except three it keeps."""
    _k("common/pod.go", 1167, "func labelPod(rayNodeType rayv1.RayNodeType, rayClusterName string, groupName string")
    _k("common/pod.go", 1169, 'utils.RayNodeLabelKey:                   "yes",')
    _k(
        "common/pod.go",
        1173,
        "utils.RayIDLabelKey:                     utils.CheckLabel(utils.GenerateIdentifier(rayClusterName",
    )
    _k("common/pod.go", 1174, "utils.KubernetesApplicationNameLabelKey: utils.ApplicationName,")
    _k("common/pod.go", 1175, "utils.KubernetesCreatedByLabelKey:       utils.ComponentName,")
    _k(
        "common/pod.go",
        1183,
        "if k == utils.RayNodeTypeLabelKey || k == utils.RayNodeGroupLabelKey || k == utils.RayClusterLabelKey {",
    )
    labels = {
        IS_RAY_NODE_LABEL: "yes",
        CLUSTER_LABEL: cluster_name,
        NODE_TYPE_LABEL: node_type,
        GROUP_LABEL: group,
        IDENTIFIER_LABEL: check_label(f"{cluster_name}-{node_type}"),
        APP_NAME_LABEL: APPLICATION_NAME,
        CREATED_BY_LABEL: COMPONENT_NAME,
    }
    for key, value in override.items():
        if key in (NODE_TYPE_LABEL, GROUP_LABEL, CLUSTER_LABEL):
            continue
        labels[key] = value
    return labels


def check_label(value: str) -> str:
    """``utils.CheckLabel``: at most 63 characters, cut from the front; no leading punctuation."""
    _k("utils/util.go", 251, "func CheckLabel(s string) string {")
    if len(value) > 63:
        value = value[len(value) - 63 :]
    if value and not value[0].isalnum():
        value = "r" + value[1:]
    return value


def merge_labels(template: Mapping[str, str], group: Mapping[str, str]) -> dict[str, str]:
    """``mergeLabels``: the template's labels, then the group's ``labels`` field over them."""
    _k("common/pod.go", 1691, "maps.Copy(merged, templateLabels)")
    _k("common/pod.go", 1692, "maps.Copy(merged, groupLabels)")
    return {**template, **group}


def readiness_probe(container: Mapping[str, Any], node_type: str, ray_service: bool) -> dict[str, Any]:
    """``initLivenessAndReadinessProbe``: the template's own probe, or the one KubeRay injects.

    A RayService worker without a probe gets the raylet check plus the Serve
    proxy's ``/-/healthz`` on its ``serve`` port (8000 when it declares none).
    """
    _k("common/pod.go", 795, "if rayContainer.ReadinessProbe == nil {")
    _k("common/pod.go", 816, "if creatorCRDType == utils.RayServiceCRD && rayNodeType == rayv1.WorkerNode {")
    _k("common/pod.go", 821, "utils.FindContainerPort(rayContainer, utils.ServingPortName, utils.DefaultServingPort),")
    if container.get("readinessProbe"):
        return copy.deepcopy(dict(container["readinessProbe"]))
    commands = [
        WGET_HEALTH.format(timeout=1, port=DEFAULT_DASHBOARD_AGENT_LISTEN_PORT, path="api/local_raylet_healthz")
    ]
    if node_type == HEAD:
        commands.append(WGET_HEALTH.format(timeout=5, port=8265, path="api/gcs_healthz"))
    probe: dict[str, Any] = {"initialDelaySeconds": 10, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 10}
    if ray_service and node_type == WORKER:
        serve_port = container_port(container, SERVING_PORT_NAME) or DEFAULT_SERVING_PORT
        commands.append(WGET_HEALTH.format(timeout=10, port=serve_port, path="-/healthz"))
        probe["failureThreshold"] = 1
    probe["exec"] = {"command": ["bash", "-c", " && ".join(commands)]}
    return probe


def container_port(container: Mapping[str, Any], name: str) -> int | None:
    """``utils.FindContainerPort``: the number of the container's port called ``name``."""
    for port in container.get("ports") or []:
        if port.get("name") == name:
            return int(port["containerPort"])
    return None


def kuberay_env(
    node_type: str, cluster_name: str, head_address: str, start: str, ray_service: bool
) -> list[dict[str, Any]]:
    """``setContainerEnvVars``: the variables KubeRay adds to the Ray container."""
    _k(
        "common/pod.go",
        1207,
        "func setContainerEnvVars(pod *corev1.Pod, rayNodeType rayv1.RayNodeType, fqdnRayIP string",
    )
    _k(
        "common/pod.go",
        1279,
        "generatedRayStartCmdEnv := corev1.EnvVar{Name: utils.KUBERAY_GEN_RAY_START_CMD, Value: rayStartCmd}",
    )
    _k(
        "common/pod.go",
        1290,
        'deathEnv := corev1.EnvVar{Name: utils.RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO, Value: "0"}',
    )
    env: list[dict[str, Any]] = []
    if node_type == WORKER:
        env += [{"name": "FQ_RAY_IP", "value": head_address.rsplit(":", 1)[0]}]
        env += [{"name": "RAY_IP", "value": head_address.split(".", 1)[0]}]
    env += [
        {"name": "RAY_CLUSTER_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{CLUSTER_LABEL}']"}}},
        {"name": "RAY_CLUSTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "RAY_CLOUD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "RAY_NODE_TYPE_NAME", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{GROUP_LABEL}']"}}},
        {"name": "KUBERAY_GEN_RAY_START_CMD", "value": start},
        {"name": "RAY_PORT", "value": DEFAULT_HEAD_PORT},
    ]
    if ray_service:
        env += [
            {"name": "RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO", "value": "0"},
            {"name": "RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS", "value": "5"},
            {"name": "RAY_SERVE_KV_TIMEOUT_S", "value": "5"},
        ]
    return env


def gcs_fault_tolerance_env(cluster: RayClusterRef, node_type: str) -> list[dict[str, Any]]:
    """``configureRedisFT``: the head (and so its cleanup Job) learn the Redis, its password and their namespace.

    The storage namespace is the RayCluster's UID unless the options name
    one; the password reaches Ray as ``REDIS_PASSWORD`` and rayStartParams
    ``redis-password=$REDIS_PASSWORD`` (:func:`gcs_start_params`).
    """
    options = cluster.spec.get("gcsFaultToleranceOptions")
    if not options:
        return []
    if node_type == WORKER:
        # Workers wait for a restarted GCS up to 600 s instead of Ray's 60.
        _k(
            "common/pod.go",
            100,
            "gcsTimeout := corev1.EnvVar{Name: utils.RAY_GCS_RPC_SERVER_RECONNECT_TIMEOUT_S,",
        )
        _k(
            "utils/constant.go",
            149,
            'RAY_GCS_RPC_SERVER_RECONNECT_TIMEOUT_S  = "RAY_gcs_rpc_server_reconnect_timeout_s"',
        )
        _k("utils/constant.go", 302, 'DefaultWorkerRayGcsReconnectTimeoutS = "600"')
        return [{"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": "600"}]
    _k("common/pod.go", 117, "func configureRedisFT(podTemplate *corev1.PodTemplateSpec, instance *rayv1.RayCluster")
    _k("common/pod.go", 119, "storageNS := string(instance.UID)")
    _k("common/pod.go", 128, "storageNSEnv := corev1.EnvVar{Name: utils.RAY_EXTERNAL_STORAGE_NS, Value: storageNS}")
    _k("common/pod.go", 134, "Name:  utils.RAY_REDIS_ADDRESS,")
    _k("common/pod.go", 155, "Name:      utils.REDIS_PASSWORD,")
    env: list[dict[str, Any]] = [
        {"name": "RAY_external_storage_namespace", "value": options.get("externalStorageNamespace") or cluster.uid},
        {"name": "RAY_REDIS_ADDRESS", "value": options["redisAddress"]},
    ]
    password = options.get("redisPassword")
    if password is not None:
        source = (
            {"valueFrom": password["valueFrom"]} if "valueFrom" in password else {"value": password.get("value", "")}
        )
        env.append({"name": "REDIS_PASSWORD", **source})
    return env


def gcs_start_params(cluster: RayClusterRef, node_type: str) -> dict[str, str]:
    """What ``configureRedisFT`` adds to the head's rayStartParams: the password, by reference to the env."""
    options = cluster.spec.get("gcsFaultToleranceOptions")
    if not options or node_type == WORKER or options.get("redisPassword") is None:
        return {}
    _k("common/pod.go", 153, 'instance.Spec.HeadGroupSpec.RayStartParams["redis-password"] = "$REDIS_PASSWORD"')
    return {"redis-password": "$REDIS_PASSWORD"}


@dataclass(frozen=True)
class RayClusterRef:
    """A RayCluster made from a RayService: its generated name and the RayService it came from."""

    name: str
    ray_service: Mapping[str, Any]
    # The UID the API server gave the RayCluster; when not given, a stable one from the name.
    given_uid: str | None = None

    @property
    def uid(self) -> str:
        """The RayCluster's UID (KubeRay's Redis storage namespace for its GCS)."""
        import uuid

        return self.given_uid or str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.namespace}.{self.name}.raycluster"))

    @property
    def namespace(self) -> str:
        return str(_meta(self.ray_service).get("namespace", "default"))

    @property
    def head_address(self) -> str:
        """What workers are given: the RayCluster's own head Service and GCS port (``fqdnRayIP``)."""
        return head_service_address(f"{self.name}-head-svc", self.namespace)

    @property
    def spec(self) -> Mapping[str, Any]:
        spec: Mapping[str, Any] = self.ray_service["spec"]["rayClusterConfig"]
        return spec


def ray_cluster_name(ray_service: Mapping[str, Any], suffix: str) -> str:
    """``GenerateRayClusterName``: the RayService's name and five random characters (given, for a test)."""
    _k("utils/util.go", 370, 'return fmt.Sprintf("%s-%s", serviceName, rand.String(5))')
    return f"{_meta(ray_service)['name']}-{suffix}"


def start_command(cluster: RayClusterRef, group_spec: Mapping[str, Any], node_type: str) -> StartCommand:
    """The ``ray start`` of one group's pods in this cluster, GCS fault tolerance's parameters included."""
    group = GroupSpec.from_spec(group_spec, is_head=node_type == HEAD)
    params = {**group.ray_start_params, **gcs_start_params(cluster, node_type)}
    group = GroupSpec(group.name, group.is_head, params, group.resources, group.labels, group.limits, group.requests)
    autoscaling = bool(cluster.spec.get("enableInTreeAutoscaling"))
    return build_start_command(group, head_address=cluster.head_address, in_tree_autoscaling=autoscaling)


def build_pod(cluster: RayClusterRef, group_spec: Mapping[str, Any], node_type: str, index: int = 0) -> dict[str, Any]:
    """One pod of a group as KubeRay creates it (``DefaultHead/WorkerPodTemplate`` then ``BuildPod``)."""
    is_head = node_type == HEAD
    group_name = HEAD_GROUP if is_head else str(group_spec["groupName"])
    template = copy.deepcopy(dict(group_spec["template"]))
    meta = _meta(template)
    _k("common/pod.go", 235, "mergedLabels := mergeLabels(headSpec.Template.ObjectMeta.Labels, headSpec.Labels)")
    _k("common/pod.go", 670, "mergedLabels := mergeLabels(workerSpec.Template.ObjectMeta.Labels, workerSpec.Labels)")
    labels = label_pod(
        node_type, cluster.name, group_name, merge_labels(meta.get("labels") or {}, group_spec.get("labels") or {})
    )
    # BuildPod: every RayService pod carries ray.io/serve; the head starts at
    # "false" and only the RayService controller's proxy check moves it.
    _k(
        "common/pod.go",
        840,
        "podTemplateSpec.Labels[utils.RayClusterServingServiceLabelKey] = utils.EnableRayClusterServingServiceTrue",
    )
    _k(
        "common/pod.go",
        842,
        "podTemplateSpec.Labels[utils.RayClusterServingServiceLabelKey] = utils.EnableRayClusterServingServiceFalse",
    )
    labels[SERVE_LABEL] = "false" if is_head else "true"
    spec = copy.deepcopy(dict(template.get("spec") or {}))
    containers = [dict(c) for c in spec.get("containers") or []]
    head_address = cluster.head_address
    start = start_command(cluster, group_spec, node_type)
    ray = containers[RAY_CONTAINER_INDEX]
    ray["command"] = ["/bin/bash", "-lc", "--"]
    ray["args"] = [start.container_command]
    ray["env"] = [*(ray.get("env") or []), *gcs_fault_tolerance_env(cluster, node_type)]
    ray["env"] += kuberay_env(node_type, cluster.name, head_address, start.ray_start, ray_service=True)
    ray["readinessProbe"] = readiness_probe(ray, node_type, ray_service=True)
    if is_head and cluster.spec.get("enableInTreeAutoscaling"):
        _k(
            "common/pod.go",
            249,
            "podTemplate.Spec.ServiceAccountName = utils.CheckName(utils.GetHeadGroupServiceAccountName(&instance))",
        )
        spec["serviceAccountName"] = spec.get("serviceAccountName") or cluster.name
        containers.append(autoscaler_container(ray["image"], cluster.spec.get("autoscalerOptions") or {}))
    if not is_head:
        spec["initContainers"] = [
            *(spec.get("initContainers") or []),
            wait_gcs_container(template["spec"]["containers"][0]),
        ]
    spec["containers"] = containers
    suffix = "head" if is_head else f"{group_name}-worker"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{cluster.name}-{suffix}-{index:05d}"[:63],
            "namespace": cluster.namespace,
            "labels": labels,
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": spec,
    }


AUTOSCALER_CONTAINER = "autoscaler"
WAIT_GCS_CONTAINER = "wait-gcs-ready"


def autoscaler_container(image: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``BuildAutoscalerContainer`` then ``mergeAutoscalerOverrides``: the head's autoscaler sidecar."""
    _k("common/pod.go", 253, "autoscalerContainer := BuildAutoscalerContainer(autoscalerImage)")
    _k("common/pod.go", 275, "mergeAutoscalerOverrides(&autoscalerContainer, instance.Spec.AutoscalerOptions)")
    _k("common/pod.go", 1016, "autoscalerContainer.Env = append(autoscalerContainer.Env, autoscalerOptions.Env...)")
    command = "ray kuberay-autoscaler --cluster-name $(RAY_CLUSTER_NAME) --cluster-namespace $(RAY_CLUSTER_NAMESPACE)"
    fixed = {"cpu": "500m", "memory": "512Mi"}
    container: dict[str, Any] = {
        "name": AUTOSCALER_CONTAINER,
        "image": options.get("image", image),
        "imagePullPolicy": options.get("imagePullPolicy", "IfNotPresent"),
        "env": [
            {
                "name": "RAY_CLUSTER_NAME",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{CLUSTER_LABEL}']"}},
            },
            {"name": "RAY_CLUSTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "RAY_HEAD_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "KUBERAY_CRD_VER", "value": "v1"},
            {"name": "KUBERAY_GEN_AUTOSCALER_START_CMD", "value": command},
            *copy.deepcopy(list(options.get("env") or [])),
        ],
        "command": ["/bin/bash", "-lc", "--"],
        "args": [command],
        "resources": copy.deepcopy(options.get("resources") or {"limits": dict(fixed), "requests": dict(fixed)}),
    }
    for key in ("envFrom", "volumeMounts"):
        if options.get(key):
            container[key] = copy.deepcopy(list(options[key]))
    if options.get("securityContext"):
        container["securityContext"] = copy.deepcopy(dict(options["securityContext"]))
    return container


def wait_gcs_container(template_ray: Mapping[str, Any]) -> dict[str, Any]:
    """The ``wait-gcs-ready`` init container of a worker: the template's Ray container's image, context, env, mounts."""
    _k("common/pod.go", 610, 'Name:            "wait-gcs-ready",')
    _k(
        "common/pod.go",
        635,
        "SecurityContext: podTemplate.Spec.Containers[utils.RayContainerIndex].SecurityContext.DeepCopy(),",
    )
    fixed = {"cpu": "200m", "memory": "256Mi"}
    init: dict[str, Any] = {
        "name": WAIT_GCS_CONTAINER,
        "image": template_ray["image"],
        "resources": {"limits": dict(fixed), "requests": dict(fixed)},
    }
    for key in ("imagePullPolicy", "securityContext", "env", "volumeMounts"):
        if template_ray.get(key) is not None:
            init[key] = copy.deepcopy(template_ray[key])
    return init


def build_cluster_pods(cluster: RayClusterRef, replicas: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """The head and each worker group's pods; ``replicas`` (group -> count) overrides the spec's ``replicas``.

    A multi-host group makes ``numOfHosts`` pods per replica.
    """
    spec = cluster.spec
    pods = [build_pod(cluster, spec["headGroupSpec"], HEAD)]
    for group_spec in spec.get("workerGroupSpecs") or []:
        name = str(group_spec["groupName"])
        count = (replicas or {}).get(name, int(group_spec.get("replicas") or 0))
        hosts = int(group_spec.get("numOfHosts") or 1)
        pods += [build_pod(cluster, group_spec, WORKER, i) for i in range(count * hosts)]
    return pods


def build_redis_cleanup_pod(cluster: RayClusterRef) -> dict[str, Any]:
    """The pod of the Redis cleanup Job KubeRay runs when a GCS-fault-tolerant RayCluster is deleted.

    It is the head pod with ``ray.io/node-type: redis-cleanup``, only the Ray
    container, no probes, and a ``python -c`` that deletes the cluster's
    storage namespace in Redis (``buildRedisCleanupJob``).
    """
    _k("raycluster_controller.go", 1811, "pod := r.buildHeadPod(ctx, instance)")
    _k("raycluster_controller.go", 1812, "pod.Labels[utils.RayNodeTypeLabelKey] = string(rayv1.RedisCleanupNode)")
    _k(
        "raycluster_controller.go",
        1815,
        "pod.Spec.Containers = []corev1.Container{pod.Spec.Containers[utils.RayContainerIndex]}",
    )
    _k("raycluster_controller.go", 1829, '"from ray._private.gcs_utils import cleanup_redis_storage; " +')
    pod = build_pod(cluster, cluster.spec["headGroupSpec"], HEAD)
    pod["metadata"]["labels"][NODE_TYPE_LABEL] = REDIS_CLEANUP
    pod["metadata"]["name"] = check_label(f"{cluster.name}-redis-cleanup")
    ray = pod["spec"]["containers"][RAY_CONTAINER_INDEX]
    pod["spec"]["containers"] = [ray]
    ray["command"] = ["/bin/bash", "-lc", "--"]
    ray["args"] = [REDIS_CLEANUP_SCRIPT]
    ray.pop("readinessProbe", None)
    ray.pop("livenessProbe", None)
    ray["env"] = [
        *ray["env"],
        {"name": "RAY_redis_db_connect_retries", "value": "120"},
        {"name": "RAY_redis_db_connect_wait_milliseconds", "value": "500"},
    ]
    ray["resources"] = {"limits": {"cpu": "200m", "memory": "256Mi"}, "requests": {"cpu": "200m", "memory": "256Mi"}}
    pod["spec"]["restartPolicy"] = "Never"
    return pod


# The Job's Python, as buildRedisCleanupJob writes it (no REDIS_USERNAME in our env).
REDIS_CLEANUP_PYTHON = (
    "from ray._private.gcs_utils import cleanup_redis_storage; "
    "from urllib.parse import urlparse; "
    "import os; "
    "import sys; "
    "redis_address = os.getenv('RAY_REDIS_ADDRESS', '').split(',')[0]; "
    "redis_address = redis_address if '://' in redis_address else 'redis://' + redis_address; "
    "parsed = urlparse(redis_address); "
    "sys.exit(1) if not cleanup_redis_storage(host=parsed.hostname, port=parsed.port, "
    "password=os.getenv('REDIS_PASSWORD', parsed.password or ''), use_ssl=parsed.scheme=='rediss', "
    "storage_namespace=os.getenv('RAY_external_storage_namespace')) else None"
)
REDIS_CLEANUP_SCRIPT = f'python -c "{REDIS_CLEANUP_PYTHON}"'
_k(
    "raycluster_controller.go",
    1840,
    "password=os.getenv('REDIS_PASSWORD', parsed.password or ''), use_ssl=parsed.scheme=='rediss', storage_namespace=",
)


# --- Services (common/service.go) --------------------------------------------------


def head_ports(cluster_spec: Mapping[str, Any]) -> dict[str, int]:
    """``getServicePorts``: the head container's named ports (defaults when none), plus ``metrics``."""
    _k(
        "common/service.go",
        425,
        "cPorts := cluster.Spec.HeadGroupSpec.Template.Spec.Containers[utils.RayContainerIndex].Ports",
    )
    _k("common/service.go", 412, "if _, metricsDefined := ports[utils.MetricsPortName]; !metricsDefined {")
    container = cluster_spec["headGroupSpec"]["template"]["spec"]["containers"][RAY_CONTAINER_INDEX]
    ports = {
        str(p.get("name") or f"{p['containerPort']}-port"): int(p["containerPort"])
        for p in container.get("ports") or []
    }
    if not ports:
        ports = {"client": 10001, "gcs-server": 6379, "dashboard": 8265, "metrics": 8080, "serve": 8000}
    ports.setdefault("metrics", 8080)
    return ports


def is_serving_port(name: str) -> bool:
    """``isServingPort``: ``serve`` or ``serve-*``."""
    _k(
        "common/service.go",
        449,
        'return name == utils.ServingPortName || strings.HasPrefix(name, utils.ServingPortName+"-")',
    )
    return name == SERVING_PORT_NAME or name.startswith(SERVING_PORT_NAME + "-")


def build_serve_service(cluster: RayClusterRef) -> dict[str, Any]:
    """``BuildServeService`` for a RayService: the user's ``serveService`` with KubeRay's selector, labels and ports.

    The selector is always KubeRay's (``ray.io/cluster`` of the cluster
    served, ``ray.io/serve: "true"``). When the head declares ports named
    ``serve``/``serve-*`` they replace the user's ports, a user port kept
    only under the same name.
    """
    rs = cluster.ray_service
    name = str(_meta(rs)["name"])
    _k("common/service.go", 201, "utils.RayClusterLabelKey: rayCluster.Name,")
    _k(
        "common/service.go",
        204,
        "selectorLabels[utils.RayClusterServingServiceLabelKey] = utils.EnableRayClusterServingServiceTrue",
    )
    _k("common/service.go", 239, "serveService.Spec.Selector = selectorLabels")
    _k("common/service.go", 259, "mergedPorts = append(mergedPorts, userPort)")
    selector = {CLUSTER_LABEL: cluster.name, SERVE_LABEL: "true"}
    labels = {ORIGINATED_FROM_NAME: name, ORIGINATED_FROM_CRD: "RayService", SERVE_LABEL: f"{name}-serve"}
    auto = [{"name": n, "port": p} for n, p in sorted(head_ports(cluster.spec).items()) if is_serving_port(n)]
    user = rs["spec"].get("serveService")
    head_type = cluster.spec["headGroupSpec"].get("serviceType") or "ClusterIP"
    if user is None:
        if not auto:
            raise KubeRayValidationError(
                "no port named 'serve' on the head and no serveService: KubeRay makes no serve Service"
            )
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{name}-serve-svc", "namespace": cluster.namespace, "labels": labels},
            "spec": {"selector": selector, "ports": auto, "type": head_type},
        }
    service = copy.deepcopy(dict(user))
    spec = dict(service.get("spec") or {})
    spec["selector"] = selector
    if auto:
        by_name = {p.get("name"): p for p in spec.get("ports") or []}
        spec["ports"] = [copy.deepcopy(by_name.get(p["name"], p)) for p in auto]
    meta = dict(service.get("metadata") or {})
    _k("common/service.go", 267, "setLabelsforUserProvidedService(serveService, labels)")
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta.setdefault("name", f"{name}-serve-svc")
    meta.setdefault("namespace", cluster.namespace)
    meta.setdefault("annotations", {})
    spec.setdefault("type", head_type)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def build_head_service(cluster: RayClusterRef) -> dict[str, Any]:
    """``BuildHeadServiceForRayService``: ``<rayservice>-head-svc`` on the active cluster's head."""
    rs_name = str(_meta(cluster.ray_service)["name"])
    _k("common/service.go", 27, "utils.RayClusterLabelKey:                cluster.Name,")
    _k("common/service.go", 28, "utils.RayNodeTypeLabelKey:               string(rayv1.HeadNode),")
    selector = {
        CLUSTER_LABEL: cluster.name,
        NODE_TYPE_LABEL: HEAD,
        IDENTIFIER_LABEL: check_label(f"{cluster.name}-head"),
        APP_NAME_LABEL: APPLICATION_NAME,
        CREATED_BY_LABEL: COMPONENT_NAME,
    }
    labels = {ORIGINATED_FROM_NAME: rs_name, ORIGINATED_FROM_CRD: "RayService", NODE_TYPE_LABEL: HEAD}
    ports = [{"name": n, "port": p} for n, p in sorted(head_ports(cluster.spec).items())]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{rs_name}-head-svc", "namespace": cluster.namespace, "labels": labels},
        "spec": {"selector": selector, "ports": ports, "type": "ClusterIP"},
    }


# --- label selectors, as the API server and controllers evaluate them --------------


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A ``LabelSelector`` (matchLabels, matchExpressions) or a Service's plain selector map against labels.

    An empty LabelSelector selects everything; a Service without a selector
    selects nothing (that case is the caller's).
    """
    if selector is None:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return all(labels.get(k) == v for k, v in selector.items())
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# --- the AWS load balancer controller's webhooks (v3.5.0) ---------------------------

NLB_CLASS = "service.k8s.aws/nlb"


def lbc_mutate_service_create(service: Mapping[str, Any], lb_class: str = NLB_CLASS) -> dict[str, Any]:
    """The service mutator: a LoadBalancer Service created without a class gets the controller's.

    It is registered for CREATE only, so an update never gets it back.
    """
    _lbc(
        "webhooks/core/service_mutator.go",
        40,
        "func (m *serviceMutator) MutateCreate(ctx context.Context, obj runtime.Object) (runtime.Object, error) {",
    )
    _lbc("webhooks/core/service_mutator.go", 51, "svc.Spec.LoadBalancerClass = &m.loadBalancerClass")
    _lbc(
        "webhooks/core/service_mutator.go",
        95,
        "resources=services,verbs=create,versions=v1,name=mservice.elbv2.k8s.aws",
    )
    out = copy.deepcopy(dict(service))
    spec = out.setdefault("spec", {})
    if spec.get("type") == "LoadBalancer" and not spec.get("loadBalancerClass"):
        spec["loadBalancerClass"] = lb_class
    return out


def lbc_readiness_gates(pod: Mapping[str, Any], load_balanced: list[Mapping[str, Any]]) -> list[str]:
    """The pod readiness gates the controller's pod webhook adds at a pod's CREATE.

    One per IP target group whose Service selects the pod *then*; a pod
    created while no such Service selects it never gets one.
    """
    _lbc("pkg/inject/pod_readiness/pod_readiness_gate.go", 93, "if svcSelector.Matches(labels.Set(pod.Labels)) {")
    _lbc(
        "webhooks/core/pod_readiness_gate_mutator.go",
        51,
        "resources=pods,verbs=create,versions=v1,name=mpod.elbv2.k8s.aws",
    )
    labels = _meta(pod).get("labels") or {}
    gates = []
    for svc in load_balanced:
        selector = svc["spec"].get("selector") or {}
        if selector and selects(selector, labels):
            gates.append(f"target-health.elbv2.k8s.aws/{_meta(svc)['name']}")
    return gates


class ApiError(RuntimeError):
    """What the API server answers to a write it refuses."""


def api_update_service(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A Service update as the API server validates it (Kubernetes' ValidateServiceUpdate).

    ``spec.loadBalancerClass`` may not change while the Service stays a
    LoadBalancer; a missing cluster IP is taken from the old object.
    """
    old_spec, new_spec = old["spec"], dict(new["spec"])
    both_lb = old_spec.get("type") == "LoadBalancer" and new_spec.get("type") == "LoadBalancer"
    if both_lb and old_spec.get("loadBalancerClass") != new_spec.get("loadBalancerClass"):
        raise ApiError(
            f'Service "{_meta(old)["name"]}" is invalid: spec.loadBalancerClass: Invalid value: '
            f"{new_spec.get('loadBalancerClass')!r}: may not change once set"
        )
    if new_spec.get("type") != "LoadBalancer":
        new_spec.pop("loadBalancerClass", None)
    return {**dict(new), "spec": new_spec}


def kuberay_update_service(old: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """``reconcileServices``: nothing while the selector's cluster is the same; else the whole spec replaced.

    Annotations and labels of the existing Service are never touched. Returns
    the object KubeRay sends to the API server, or None when it sends nothing.
    """
    _k(
        "rayservice_controller.go",
        1952,
        "if newSvc.Spec.Selector[utils.RayClusterLabelKey] == oldSvc.Spec.Selector[utils.RayClusterLabelKey] {",
    )
    _k("rayservice_controller.go", 1961, "oldSvc.Spec = *newSvc.Spec.DeepCopy()")
    if desired["spec"]["selector"].get(CLUSTER_LABEL) == old["spec"].get("selector", {}).get(CLUSTER_LABEL):
        return None
    spec = copy.deepcopy(dict(desired["spec"]))
    if old["spec"].get("clusterIP"):
        spec["clusterIP"] = old["spec"]["clusterIP"]
    return {**copy.deepcopy(dict(old)), "spec": spec}


# --- readiness and the NewCluster upgrade (rayservice_controller.go) ---------------


def apps_ready(statuses: Mapping[str, str]) -> bool:
    """``getAndCheckServeStatus``: a cluster may take traffic when it has apps and every one is RUNNING."""
    _k("rayservice_controller.go", 1874, "if app.Status != rayv1.ApplicationStatusEnum.RUNNING {")
    _k("rayservice_controller.go", 1889, "if len(newApplications) == 0 {")
    return bool(statuses) and all(s == "RUNNING" for s in statuses.values())


def ray_service_ready(serve_service: Mapping[str, Any] | None, pods: list[Mapping[str, Any]], ready: set[str]) -> bool:
    """``calculateConditions``: Ready while KubeRay's serve Service has at least one ready endpoint.

    ``ready``: names of pods whose readiness (probe and gates) holds.
    """
    _k("rayservice_controller.go", 795, "if rayServiceInstance.Status.NumServeEndpoints > 0 {")
    _k("rayservice_controller.go", 2152, "if ptr.Deref(endpoint.Conditions.Ready, false) {")
    if serve_service is None:
        return False
    selector = serve_service["spec"].get("selector") or {}
    return any(_meta(p)["name"] in ready and selector and selects(selector, _meta(p)["labels"]) for p in pods)


@dataclass
class UpgradeEvent:
    """One step of an upgrade, as KubeRay's events and status would show it."""

    phase: str
    detail: str


@dataclass
class NewClusterUpgrade:
    """KubeRay's NewCluster upgrade of one RayService, step by step.

    1. the spec hash changed: a pending cluster (``<name>-<5 chars>``) is
       created beside the active one (``shouldPrepareNewCluster``);
    2. its Serve apps are deployed; when all are RUNNING it is ready
       (``getAndCheckServeStatus``);
    3. the head and serve Services are switched to it: the whole spec is
       replaced (``reconcileServices``), which the API server may refuse;
    4. the pending cluster is promoted; the old one is deleted after
       ``rayClusterDeletionDelaySeconds`` (``cleanUpRayClusterInstance``);
    5. with GCS fault tolerance, its deletion runs the Redis cleanup Job.

    ``serve_service`` is the live Service as the API server holds it.
    """

    old: Mapping[str, Any]
    new: Mapping[str, Any]
    active: RayClusterRef
    serve_service: dict[str, Any]
    pending: RayClusterRef | None = None
    events: list[UpgradeEvent] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _k(
            "rayservice_controller.go",
            1436,
            "return isZeroDowntimeUpgradeEnabled(ctx, rayServiceInstance.Spec.UpgradeStrategy)",
        )
        _k("rayservice_controller.go", 292, "targetCluster = pendingRayClusterInstance")
        _k(
            "rayservice_controller.go",
            1278,
            "(rayClusterInstance.Name != rayServiceInstance.Status.ActiveServiceStatus.RayClusterName &&",
        )

    @property
    def needed(self) -> bool:
        """Whether the change starts a new cluster: the strategy is NewCluster and the spec hash changed.

        The hash leaves out what autoscaling and external controllers move
        (every group's replicas, min/max replicas, workers to delete, and each
        template's tolerations and scheduling gates): a change to only those
        starts nothing and never reaches the running cluster. Worker groups
        appended at the end are added to it in place.
        """
        strategy = (self.new["spec"].get("upgradeStrategy") or {}).get("type", "NewCluster")
        _k("rayservice_controller.go", 1432, "if isClusterSpecHashEqual(rayServiceInstance, cluster, true) {")
        old, new = self.old["spec"]["rayClusterConfig"], self.new["spec"]["rayClusterConfig"]
        if spec_hash_view(old) == spec_hash_view(new):
            return False
        groups = len(old.get("workerGroupSpecs") or [])
        appended = {**new, "workerGroupSpecs": (new.get("workerGroupSpecs") or [])[:groups]}
        return strategy == "NewCluster" and spec_hash_view(old) != spec_hash_view(appended)

    def start(self, suffix: str) -> RayClusterRef:
        """Step 1: the pending cluster."""
        self.pending = RayClusterRef(ray_cluster_name(self.new, suffix), self.new)
        self.events.append(UpgradeEvent("pending-cluster", f"created RayCluster {self.pending.name}"))
        return self.pending

    def switch(self, statuses: Mapping[str, str]) -> bool:
        """Steps 2-3: when the pending cluster's apps are all RUNNING, move the Services to it.

        Raises :class:`ApiError` when the API server refuses the Service
        update: KubeRay then retries forever and the upgrade never finishes.
        """
        if self.pending is None:
            raise RuntimeError("no pending cluster: call start() first")
        if not apps_ready(statuses):
            self.events.append(
                UpgradeEvent(
                    "waiting-for-apps", ", ".join(f"{a}={s}" for a, s in sorted(statuses.items())) or "no apps"
                )
            )
            return False
        desired = build_serve_service(self.pending)
        update = kuberay_update_service(self.serve_service, desired)
        if update is not None:
            try:
                self.serve_service = api_update_service(self.serve_service, update)
            except ApiError as err:
                self.events.append(UpgradeEvent("switch-refused", str(err)))
                raise
        self.events.append(UpgradeEvent("switched", f"serve Service now selects {self.pending.name}"))
        return True

    def finish(self) -> tuple[RayClusterRef, dict[str, Any] | None]:
        """Steps 4-5: promotion, the old cluster deleted, its Redis cleanup pod when the GCS keeps state in Redis."""
        if self.pending is None:
            raise RuntimeError("no pending cluster")
        old, self.active, self.pending = self.active, self.pending, None
        self.deleted.append(old.name)
        self.events.append(
            UpgradeEvent("old-cluster-deleted", f"deleted RayCluster {old.name} after rayClusterDeletionDelaySeconds")
        )
        cleanup = None
        if old.spec.get("gcsFaultToleranceOptions"):
            _k("raycluster_controller.go", 337, "redisCleanupJob := r.buildRedisCleanupJob(ctx, *instance)")
            cleanup = build_redis_cleanup_pod(old)
            self.events.append(UpgradeEvent("redis-cleanup", f"Job {cleanup['metadata']['name']}"))
        return old, cleanup


def spec_hash_view(cluster_spec: Mapping[str, Any]) -> dict[str, Any]:
    """``GenerateHashWithoutReplicasAndWorkersToDelete``: the part of a RayCluster spec KubeRay compares."""
    _k(
        "utils/util.go",
        645,
        "func GenerateHashWithoutReplicasAndWorkersToDelete(rayClusterSpec rayv1.RayClusterSpec) (string, error) {",
    )
    _k("utils/util.go", 658, "updatedRayClusterSpec.WorkerGroupSpecs[i].MaxReplicas = nil")
    _k("utils/util.go", 661, "updatedRayClusterSpec.WorkerGroupSpecs[i].Template.Spec.Tolerations = nil")
    view = copy.deepcopy(dict(cluster_spec))
    templates = [view["headGroupSpec"]["template"]]
    for group in view.get("workerGroupSpecs") or []:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
        templates.append(group["template"])
    for template in templates:
        template.get("spec", {}).pop("tolerations", None)
        template.get("spec", {}).pop("schedulingGates", None)
    view.pop("upgradeStrategy", None)
    return view


def first_serve_service(cluster: RayClusterRef) -> dict[str, Any]:
    """The serve Service as the API server stores it after KubeRay's first CREATE (the LB webhook applied)."""
    _k("rayservice_controller.go", 1975, "if err := r.Create(ctx, newSvc); err != nil {")
    return lbc_mutate_service_create(build_serve_service(cluster))


# --- the operator's own metrics (metrics/ray_service_metrics.go) -------------------


def ray_service_conditions(*, active: str, pending: str, serve_endpoints: int) -> dict[str, bool]:
    """``calculateConditions``: the RayService's Ready and UpgradeInProgress conditions.

    ``active``/``pending``: the names of the active and pending RayClusters
    ("" for none); ``serve_endpoints``: the ready endpoints of the serve
    Service (``NumServeEndpoints``). Ready before the first endpoint is
    "initializing", which is False too.
    """
    _k("rayservice_controller.go", 795, "if rayServiceInstance.Status.NumServeEndpoints > 0 {")
    _k(
        "rayservice_controller.go",
        798,
        'rayv1.ZeroServeEndpoints, "Number of serve endpoints dropped to 0")',
    )
    _k("rayservice_controller.go", 807, 'if activeClusterName != "" && pendingClusterName != "" {')
    _k(
        "rayservice_controller.go",
        810,
        "setCondition(rayServiceInstance, rayv1.UpgradeInProgress, metav1.ConditionFalse, rayv1.NoPendingCluster,",
    )
    return {"Ready": serve_endpoints > 0, "UpgradeInProgress": bool(active and pending)}


def ray_service_metrics(metadata: Mapping[str, Any], conditions: Mapping[str, bool]) -> list[str]:
    """``RayServiceMetricsManager.Collect`` for one RayService: its exposition lines (no HELP/TYPE).

    Every series has the value 1; the condition's state is the ``condition``
    label, "true" or "false" (``strconv.FormatBool``).
    """
    _k("metrics/ray_service_metrics.go", 29, '"kuberay_service_info",')
    _k("metrics/ray_service_metrics.go", 35, '"kuberay_service_condition_ready",')
    _k("metrics/ray_service_metrics.go", 37, '[]string{"name", "namespace", "uid", "condition"},')
    _k("metrics/ray_service_metrics.go", 41, '"kuberay_service_condition_upgrade_in_progress",')
    _k(
        "metrics/ray_service_metrics.go",
        84,
        "ready := meta.IsStatusConditionTrue(service.Status.Conditions, string(rayv1.RayServiceReady))",
    )
    _k(
        "metrics/ray_service_metrics.go",
        94,
        "upgradeInProgress := meta.IsStatusConditionTrue(service.Status.Conditions, string(rayv1.UpgradeInProgress))",
    )
    _k("metrics/ray_service_metrics.go", 102, "strconv.FormatBool(upgradeInProgress),")
    base = f'name="{metadata["name"]}",namespace="{metadata["namespace"]}",uid="{metadata.get("uid", "")}"'
    lines = [f"kuberay_service_info{{{base}}} 1"]
    for metric, condition in (
        ("kuberay_service_condition_ready", "Ready"),
        ("kuberay_service_condition_upgrade_in_progress", "UpgradeInProgress"),
    ):
        state = "true" if conditions.get(condition) else "false"
        lines.append(f'{metric}{{{base},condition="{state}"}} 1')
    return lines


# --- the operator's chart: its pod, Service and ServiceMonitor (helm-chart/kuberay-operator) ----------

CHART_NAME = "kuberay-operator"


def chart_defaults() -> dict[str, Any]:
    """The chart's own values.yaml, as far as the objects below read it."""
    _values("operator-chart-values.yaml", 6, "nameOverride: kuberay-operator")
    _values("operator-chart-values.yaml", 9, "fullnameOverride: kuberay-operator")
    _values("operator-chart-values.yaml", 12, "componentOverride: kuberay-operator")
    _values("operator-chart-values.yaml", 175, "interval: 30s")
    _values("operator-chart-values.yaml", 335, "type: ClusterIP")
    _values("operator-chart-values.yaml", 337, "port: 8080")
    return {
        "nameOverride": CHART_NAME,
        "fullnameOverride": CHART_NAME,
        "componentOverride": CHART_NAME,
        "labels": {},
        "metrics": {"serviceMonitor": {"enabled": False, "interval": "30s", "honorLabels": True}},
        "service": {"type": "ClusterIP", "port": 8080},
    }


def helm_name(value: str) -> str:
    """Helm's ``trunc 63 | trimSuffix "-"``, which every name helper of the chart ends with."""
    return value[:63].removesuffix("-")


@dataclass(frozen=True)
class OperatorRelease:
    """The operator's Helm release: its name, namespace and merged values (the chart's defaults under the render's)."""

    name: str
    namespace: str
    values: Mapping[str, Any]

    @classmethod
    def from_release(cls, release: Mapping[str, Any]) -> OperatorRelease:
        """From a rendered release (name, namespace, values): its values coalesced over the chart's."""
        values = merged_values(chart_defaults(), release.get("values") or {})
        return cls(str(release["name"]), str(release["namespace"]), values)

    def chart_name(self) -> str:
        """``kuberay-operator.name``: nameOverride, else the chart's name."""
        _chart(
            "templates/_helpers.tpl", 6, '{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}'
        )
        return helm_name(str(self.values.get("nameOverride") or CHART_NAME))

    def fullname(self) -> str:
        """``kuberay-operator.fullname``."""
        _chart("templates/_helpers.tpl", 23, '{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}')
        _chart("templates/_helpers.tpl", 26, "{{- if contains $name .Release.Name -}}")
        _chart("templates/_helpers.tpl", 29, '{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}')
        override = self.values.get("fullnameOverride")
        if override:
            return helm_name(str(override))
        name = self.chart_name()
        return helm_name(self.name if name in self.name else f"{self.name}-{name}")

    def pod(self) -> dict[str, Any]:
        """The operator's pod as far as Prometheus sees it: its labels and its one container's ``http`` port."""
        _chart("templates/deployment.yaml", 22, 'app.kubernetes.io/name: {{ include "kuberay-operator.name" . }}')
        _chart("templates/deployment.yaml", 23, "app.kubernetes.io/instance: {{ .Release.Name }}")
        _chart(
            "templates/deployment.yaml", 24, 'app.kubernetes.io/component: {{ include "kuberay-operator.component" . }}'
        )
        _chart("templates/deployment.yaml", 148, "- name: http")
        _chart("templates/deployment.yaml", 149, "containerPort: 8080")
        labels = {
            APP_NAME_LABEL: self.chart_name(),
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": helm_name(str(self.values.get("componentOverride") or CHART_NAME)),
            **dict(self.values.get("labels") or {}),
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{self.fullname()}-0", "namespace": self.namespace, "labels": labels},
            "spec": {
                "containers": [
                    {"name": CHART_NAME, "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]}
                ]
            },
        }

    def service(self) -> dict[str, Any]:
        """``templates/service.yaml``."""
        _chart("templates/service.yaml", 4, 'name: {{ include "kuberay-operator.service.name" . }}')
        _chart("templates/_helpers.tpl", 86, '{{- include "kuberay-operator.fullname" . }}')
        _chart("templates/service.yaml", 11, "- port: {{ .Values.service.port }}")
        _chart("templates/service.yaml", 12, "targetPort: http")
        _chart("templates/service.yaml", 16, 'app.kubernetes.io/name: {{ include "kuberay-operator.name" . }}')
        _chart("templates/service.yaml", 17, "app.kubernetes.io/instance: {{ .Release.Name }}")
        _chart("templates/_helpers.tpl", 45, 'app.kubernetes.io/name: {{ include "kuberay-operator.name" . }}')
        _chart("templates/_helpers.tpl", 47, "app.kubernetes.io/instance: {{ .Release.Name }}")
        service = self.values.get("service") or {}
        selector = {APP_NAME_LABEL: self.chart_name(), "app.kubernetes.io/instance": self.name}
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.fullname(), "namespace": self.namespace, "labels": dict(selector)},
            "spec": {
                "type": service.get("type", "ClusterIP"),
                "ports": [
                    {"port": int(service.get("port", 8080)), "targetPort": "http", "protocol": "TCP", "name": "http"}
                ],
                "selector": selector,
            },
        }

    def service_monitor(self) -> dict[str, Any] | None:
        """``templates/servicemonitor.yaml``: None unless ``metrics.serviceMonitor.enabled``."""
        _chart("templates/servicemonitor.yaml", 1, "{{- if .Values.metrics.serviceMonitor.enabled }}")
        _chart("templates/servicemonitor.yaml", 13, "- path: /metrics")
        _chart("templates/servicemonitor.yaml", 14, "targetPort: http")
        _chart("templates/servicemonitor.yaml", 16, "honorLabels: {{ .Values.metrics.serviceMonitor.honorLabels }}")
        _chart("templates/servicemonitor.yaml", 19, "- {{ .Release.Namespace }}")
        _chart("templates/servicemonitor.yaml", 22, 'app.kubernetes.io/name: {{ include "kuberay-operator.name" . }}')
        monitor = (self.values.get("metrics") or {}).get("serviceMonitor") or {}
        if not monitor.get("enabled"):
            return None
        metadata: dict[str, Any] = {"name": self.fullname(), "namespace": monitor.get("namespace") or self.namespace}
        if monitor.get("additionalLabels"):
            metadata["labels"] = dict(monitor["additionalLabels"])
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": metadata,
            "spec": {
                "endpoints": [
                    {
                        "path": "/metrics",
                        "targetPort": "http",
                        "interval": monitor.get("interval", "30s"),
                        "honorLabels": bool(monitor.get("honorLabels")),
                    }
                ],
                "namespaceSelector": {"matchNames": [self.namespace]},
                "selector": {"matchLabels": {APP_NAME_LABEL: self.chart_name()}},
            },
        }


def merged_values(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a release's values over the chart's: maps merge key by key, the release wins."""
    out = dict(defaults)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged_values(out[key], value)
        else:
            out[key] = value
    return out
