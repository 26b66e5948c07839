"""Where pods may run: the labels and taints of each node group.

Made once from the config by the node provisioner (infra/aws/provisioning.py)
and handed to both the nodes it makes (which carry them) and the workloads
(which select and tolerate them), so a toleration can never drift from the
taint it is meant to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.config import GpuNodeGroupSettings, StackConfig, Taint
from infra.instance_types import GpuInstanceType

LABEL_PREFIX = "llm-platform"
NODE_GROUP_LABEL = f"{LABEL_PREFIX}/node-group"
GPU_MODEL_LABEL = f"{LABEL_PREFIX}/gpu-model"
# cluster-autoscaler's AWS provider reads this label to know a new node
# will have GPUs, so it waits for the device plugin instead of scaling up a
# second time while the first node's GPUs are not yet allocatable.
AUTOSCALER_GPU_LABEL = "k8s.amazonaws.com/accelerator"
# Bottlerocket's NVIDIA variants ship their own device plugin; the GPU
# Operator skips nodes that carry this label set to "false".
GPU_OPERATOR_DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
# The taint the NVIDIA device plugin's users conventionally tolerate: only
# pods that ask for GPUs land on GPU nodes.
GPU_TAINT = Taint(key="nvidia.com/gpu", value="true", effect="NoSchedule")


@dataclass(frozen=True)
class Placement:
    """The labels and taints of one node group."""

    group: str
    labels: dict[str, str]
    taints: tuple[Taint, ...] = ()

    def node_selector(self) -> dict[str, str]:
        """Selects this group's nodes and no others."""
        return {NODE_GROUP_LABEL: self.labels[NODE_GROUP_LABEL]}

    def tolerations(self) -> list[dict[str, str]]:
        """Tolerates exactly this group's taints."""
        return [{"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect} for t in self.taints]

    def pod_scheduling(self) -> dict[str, Any]:
        """`nodeSelector` and `tolerations` for a pod spec."""
        out: dict[str, Any] = {"nodeSelector": self.node_selector()}
        if self.taints:
            out["tolerations"] = self.tolerations()
        return out


@dataclass(frozen=True, kw_only=True)
class GpuPlacement(Placement):
    """A GPU group's placement plus the shape of its nodes."""

    instance: GpuInstanceType
    ami: str

    @property
    def gpus_per_node(self) -> int:
        """GPUs one node of the group offers."""
        return self.instance.gpus


def system_placement(cfg: StackConfig) -> Placement:
    """The system node group's placement."""
    group = cfg.node_groups.system
    labels = {**group.labels, NODE_GROUP_LABEL: group.name}
    return Placement(group=group.name, labels=labels, taints=tuple(group.taints))


def gpu_placement(group: GpuNodeGroupSettings) -> GpuPlacement:
    """One GPU group's placement: its labels, the GPU taint and its own taints."""
    instance = group.instance()
    labels = {
        **group.labels,
        NODE_GROUP_LABEL: group.name,
        GPU_MODEL_LABEL: instance.gpu_model,
        AUTOSCALER_GPU_LABEL: f"nvidia-{instance.gpu_model.lower()}",
    }
    if group.ami == "bottlerocket_nvidia":
        labels[GPU_OPERATOR_DEVICE_PLUGIN_LABEL] = "false"
    taints = (GPU_TAINT, *(t for t in group.taints if t != GPU_TAINT))
    return GpuPlacement(group=group.name, labels=labels, taints=taints, instance=instance, ami=group.ami)


def gpu_placements(cfg: StackConfig) -> dict[str, GpuPlacement]:
    """Every GPU group's placement, by group name."""
    return {g.name: gpu_placement(g) for g in cfg.node_groups.gpu}
