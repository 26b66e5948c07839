"""The `node_groups` section: the system group and the GPU groups, and the rules on their sizes and shapes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from infra.config.fields import K8sName, Section
from infra.config.problems import Problem
from infra.instance_types import GPU_INSTANCE_TYPES, GpuInstanceType

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class Taint(Section):
    """A Kubernetes node taint."""

    key: str
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class NodeGroupSettings(Section):
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


class NodeGroups(Section):
    """The system group and any number of GPU groups."""

    system: SystemNodeGroupSettings
    gpu: list[GpuNodeGroupSettings] = Field(min_length=1)

    def gpu_group(self, name: str) -> GpuNodeGroupSettings:
        """The GPU group called `name` (the rules ensure it exists)."""
        return next(g for g in self.gpu if g.name == name)


def check_node_group(path: str, group: NodeGroupSettings) -> Iterable[Problem]:
    """min_size <= desired_size <= max_size."""
    if not group.min_size <= group.desired_size <= group.max_size:
        yield Problem(
            path,
            f"min_size <= desired_size <= max_size does not hold "
            f"({group.min_size}, {group.desired_size}, {group.max_size})",
        )


def check_gpu_group(i: int, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """The group's sizes hold, and its instance types are catalogued GPU types of one shape, smallest first."""
    path = f"node_groups.gpu[{i}]"
    yield from check_node_group(path, group)
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


def usable_group(group: GpuNodeGroupSettings | None) -> bool:
    """The group exists and every instance type is in the catalogue (else another rule reports it)."""
    return group is not None and all(t in GPU_INSTANCE_TYPES for t in group.instance_types)
