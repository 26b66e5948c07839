"""What the capacity plan reads of a stack: its models, the GPU groups they run on, and the upgrade settings.

The config builds these from a validated stack (infra/config/capacity_plan.py),
so the plan takes plain values and does not import the config model.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.capacity.cold_start import ColdStart
from infra.capacity.geometry import Geometry
from infra.capacity.prices import CapacityType
from infra.capacity.upgrade import Fleet, UpgradeHeadroom, UpgradeNeed
from infra.capacity.workload import Workload
from infra.instance_types import GpuInstanceType
from workloads.inference_server.catalog import ModelEntry


@dataclass(frozen=True)
class GroupInput:
    """A GPU node group: the shape and capacity type of its nodes, its max_size, and each model on it as a fleet."""

    name: str
    instance: GpuInstanceType
    capacity_type: CapacityType
    max_size: int
    fleets: tuple[Fleet, ...]

    def upgrade_need(self, headroom: UpgradeHeadroom) -> UpgradeNeed:
        """What the group holds while every model on it upgrades at once, under `headroom`."""
        return UpgradeNeed(group=self.name, headroom=headroom, instance=self.instance, fleets=self.fleets)


@dataclass(frozen=True)
class ModelInput:
    """One model: the catalogue entry its engine starts from, its size and shape, its group, its cold start,
    and the traffic it is planned for."""

    name: str
    entry: ModelEntry
    parameters_billion: float
    # The model's `geometry` block; the pinned families of geometry.py need none.
    geometry: Geometry | None
    group: GroupInput
    cold_start: ColdStart
    # The model's `workload` block, or the full-length profile when it gives none (workload.full_length).
    workload: Workload


@dataclass(frozen=True)
class StackInput:
    """A validated stack as the plan reads it: the region, every model in config order, every GPU group."""

    region: str
    models: tuple[ModelInput, ...]
    groups: tuple[GroupInput, ...]
    # ray.upgrade_strategy (NewCluster or None) and ray.upgrade_headroom.
    upgrade_strategy: str
    upgrade_headroom: UpgradeHeadroom
