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

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

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
