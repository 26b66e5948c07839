"""NVIDIA GPU Operator: device plugin, DCGM exporter, GPU feature discovery.

Both AMIs this program runs GPU nodes on (EKS AL2023 NVIDIA and Bottlerocket
NVIDIA) ship the driver and the container toolkit, so the operator installs
neither; it adds what the AMIs lack: the device plugin (except on
Bottlerocket, which has its own), DCGM metrics and node labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.cluster_services.helm import PSA_PRIVILEGED, namespace, release
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
    operator: dict[str, Any] = {"nodeSelector": system.node_selector()}
    if system.taints:
        operator["tolerations"] = system.tolerations()
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


@dataclass(frozen=True)
class GpuOperatorArgs:
    """What the GPU Operator release is built from."""

    version: str
    mig_strategy: MigStrategy
    gpu: Mapping[str, GpuPlacement]
    system: Placement
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]


class GpuOperator(pulumi.ComponentResource):
    """The NVIDIA GPU Operator release in its own namespace."""

    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: GpuOperatorArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:GpuOperator", name, None, opts)
        values = gpu_operator_values(mig_strategy=args.mig_strategy, gpu=args.gpu, system=args.system)
        ns = namespace(
            NAMESPACE, parent=self, provider=args.provider, labels=PSA_PRIVILEGED, depends_on=args.depends_on
        )
        self.release = release(
            f"{name}-release",
            chart=versions.GPU_OPERATOR,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=NAMESPACE,
            values=values,
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
            timeout_seconds=900,
        )
        self.register_outputs({"namespace": NAMESPACE})
