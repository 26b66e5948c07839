"""NVIDIA GPU Operator: device plugin, DCGM exporter, GPU feature discovery.

Both AMIs this program runs GPU nodes on (EKS AL2023 NVIDIA and Bottlerocket
NVIDIA) ship the driver and the container toolkit, so the operator installs
neither; it adds what the AMIs lack: the device plugin (except on
Bottlerocket, which has its own), DCGM metrics and node labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import pulumi

from infra import versions
from infra.cluster_services.chart_release import PSA_PRIVILEGED, ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.scheduling import GpuPlacement, Placement

NAMESPACE = "gpu-operator"
RELEASE_NAME = "gpu-operator"
BOTTLEROCKET_AMI = "bottlerocket_nvidia"
DCGM_SCRAPE_INTERVAL = "15s"

MigStrategy = Literal["none", "single", "mixed"]


def gpu_tolerations(placements: Iterable[Placement]) -> list[dict[str, str]]:
    """Tolerations for every GPU group's taints, each once, in group order."""
    out: list[dict[str, str]] = []
    for placement in placements:
        for toleration in placement.tolerations():
            if toleration not in out:
                out.append(toleration)
    return out


def _device_plugin_enabled(gpu: Mapping[str, GpuPlacement]) -> bool:
    # Bottlerocket ships its own device plugin. With only Bottlerocket groups
    # the operator's is off; beside AL2023 groups it stays on and the
    # Bottlerocket nodes opt out through the label their placement carries
    # (infra/scheduling.py), since the chart has no per-operand node selector.
    return any(p.ami != BOTTLEROCKET_AMI for p in gpu.values())


def gpu_operator_values(
    *, mig_strategy: MigStrategy, gpu: Mapping[str, GpuPlacement], system: Placement
) -> dict[str, Any]:
    """The chart values for these GPU groups and this MIG strategy."""
    tolerations = gpu_tolerations(gpu.values())
    operator = system.pod_scheduling()
    return {
        "nfd": {"enabled": True},
        "operator": operator,
        "driver": {"enabled": False},
        "toolkit": {"enabled": False},
        "devicePlugin": {"enabled": _device_plugin_enabled(gpu)},
        "dcgmExporter": {
            "enabled": True,
            "serviceMonitor": {
                "enabled": True,
                "interval": DCGM_SCRAPE_INTERVAL,
                # Keep the exporter's own pod/namespace/container labels (the
                # GPU's user) instead of renaming them exported_*.
                "honorLabels": True,
            },
        },
        "mig": {"strategy": mig_strategy},
        # Without MIG there is nothing for the MIG manager to partition.
        "migManager": {"enabled": mig_strategy != "none"},
        # Operand daemonsets (device plugin, DCGM exporter, GFD, validator)
        # run only on GPU nodes and must tolerate exactly their taints.
        "daemonsets": {"tolerations": tolerations},
        "node-feature-discovery": {"worker": {"tolerations": tolerations}},
    }


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The NVIDIA GPU Operator release in its own namespace."""
    settings = ctx.cfg.platform.gpu_operator
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:GpuOperator",
        chart=versions.GPU_OPERATOR,
        version=ctx.cfg.versions.gpu_operator,
        release_name=RELEASE_NAME,
        namespace=NAMESPACE,
        values=gpu_operator_values(mig_strategy=settings.mig_strategy, gpu=ctx.aws.gpu, system=ctx.aws.system),
        namespace_labels=PSA_PRIVILEGED,
        timeout_seconds=900,
    )
    return ChartRelease(name, args, opts)
