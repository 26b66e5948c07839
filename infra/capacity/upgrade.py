"""The GPUs a NewCluster upgrade holds: the old cluster and the new one side by side on a group.

What KubeRay does (v1.7.0, ray-operator/controllers/ray/rayservice_controller.go):
`constructRayClusterForRayService` builds the pending cluster from the
RayService's `rayClusterConfig` as written, so each worker group starts at
its `replicas` (the model's initial_replicas, else min_replicas; see
infra/serving/ray_service.py). The active cluster keeps serving meanwhile,
at whatever scale traffic holds it: at a peak, max_replicas. Traffic moves
once the new cluster's Serve apps are RUNNING, that is once its starting
replicas are placed, and the old cluster is deleted
`rayClusterDeletionDelaySeconds` later. A change that reaches every
RayService (a new image) upgrades them all at once, so every model of a
group counts.

`ray.upgrade_headroom` says which old fleet a group's max_size must leave
room beside:

- `peak` (the default): the old cluster at max_replicas. An upgrade started
  at any time of day places its new cluster at once. The default because
  `pulumi up` is not timed to traffic (an image fix ships when it is ready),
  and under `min` an upgrade started at peak stalls at the worst moment,
  holding GPUs for a new cluster that can not start, until traffic falls.
- `min`: the old cluster at min_replicas. Smaller groups, a lower cost
  ceiling; an upgrade started at peak waits, its new pods Pending, for the
  old cluster to scale down (and `pulumi up` may time out waiting for it).

This module does not import the config model: infra/config/rules.py builds
the `UpgradeNeed` of each group (`upgrade_need`) for its rule, and the capacity
plan (infra/capacity/report.py) builds it from the group's plain values
(infra/capacity/inputs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from infra.capacity.prices import CapacityType, price
from infra.instance_types import GpuInstanceType
from workloads.inference_server.catalog import ServeAutoscaling

UpgradeHeadroom = Literal["peak", "min"]
# What each setting assumes the old cluster holds while the new one starts.
OLD_FLEET: dict[UpgradeHeadroom, str] = {"peak": "max_replicas", "min": "min_replicas"}


@dataclass(frozen=True)
class Fleet:
    """One model on a group: the GPUs of a replica and the replica bounds an upgrade meets."""

    model: str
    gpus_per_replica: int
    scaling: ServeAutoscaling

    @property
    def start_replicas(self) -> int:
        """The replicas the new cluster starts with: the worker group's `replicas`."""
        initial = self.scaling.initial_replicas
        return self.scaling.min_replicas if initial is None else initial

    def old_replicas(self, headroom: UpgradeHeadroom) -> int:
        """The replicas the old cluster holds while the new one starts, under `headroom`."""
        return self.scaling.max_replicas if headroom == "peak" else self.scaling.min_replicas


@dataclass(frozen=True)
class UpgradeNeed:
    """What one GPU group holds while every model on it upgrades at once."""

    group: str
    headroom: UpgradeHeadroom
    instance: GpuInstanceType
    fleets: tuple[Fleet, ...]

    @property
    def old_gpus(self) -> int:
        """GPUs of the old clusters."""
        return sum(f.old_replicas(self.headroom) * f.gpus_per_replica for f in self.fleets)

    @property
    def new_gpus(self) -> int:
        """GPUs of the new clusters at their starting replicas."""
        return sum(f.start_replicas * f.gpus_per_replica for f in self.fleets)

    @property
    def gpus(self) -> int:
        """GPUs of both, side by side."""
        return self.old_gpus + self.new_gpus

    @property
    def nodes(self) -> int:
        """Nodes of the group's shape that hold both (a replica's GPUs divide a node or fill whole nodes)."""
        return math.ceil(self.gpus / self.instance.gpus)

    @property
    def old_nodes(self) -> int:
        """Nodes the old clusters alone take."""
        return math.ceil(self.old_gpus / self.instance.gpus)

    def fits(self, max_size: int) -> bool:
        """Whether `max_size` nodes hold both clusters."""
        return self.nodes <= max_size

    def arithmetic(self) -> str:
        """'name' (old + new) x GPUs per replica, summed: the sum the rule and the plan show."""
        terms = " + ".join(
            f"'{f.model}' ({f.old_replicas(self.headroom)} + {f.start_replicas}) x {f.gpus_per_replica}"
            for f in self.fleets
        )
        return f"{terms} = {self.gpus} GPUs = {self.nodes} {self.instance.name} nodes"

    def sides(self) -> str:
        """Which replicas each cluster is counted at."""
        return (
            f"the old cluster at {OLD_FLEET[self.headroom]} and the new one at its starting replicas "
            "(initial_replicas, else min_replicas)"
        )


def headroom_problem(need: UpgradeNeed, max_size: int) -> str | None:
    """The rule's message for a group whose max_size can not hold `need`, or None when it can."""
    if need.fits(max_size):
        return None
    when = " at peak" if need.headroom == "peak" else ""
    message = (
        f"{max_size} leaves group '{need.group}' no room for a NewCluster upgrade{when} "
        f"(ray.upgrade_headroom: {need.headroom}): {need.sides()} need {need.arithmetic()}; "
        f"raise max_size to {need.nodes}"
    )
    if need.headroom == "peak":
        message += (
            ", or set ray.upgrade_headroom: min and accept that an upgrade started at peak waits for the old "
            "cluster to scale down"
        )
    return message


@dataclass(frozen=True)
class UpgradeCost:
    """What a group's nodes cost per hour while an upgrade runs, at the group's pinned price."""

    usd_per_hour: float
    # Above what the old clusters' nodes alone cost.
    extra_usd_per_hour: float


def upgrade_cost(need: UpgradeNeed, capacity_type: CapacityType, region: str) -> UpgradeCost | None:
    """The $/h of the nodes `need` holds, or None when no price is pinned for the group's instance type."""
    pinned = price(region, need.instance.name, capacity_type)
    if pinned is None:
        return None
    hourly = pinned.usd_per_hour
    return UpgradeCost(hourly * need.nodes, hourly * (need.nodes - need.old_nodes))
