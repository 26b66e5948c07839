"""KubeRay operator: reconciles RayService and RayCluster objects.

The release installs the ray.io CRDs, so every RayService waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.cluster_services.helm import PSA_RESTRICTED_WARN, namespace, release
from infra.scheduling import Placement

NAMESPACE = "kuberay"
RELEASE_NAME = "kuberay-operator"


def kuberay_values(*, system: Placement, service_monitor: bool) -> dict[str, Any]:
    """The chart values: on system nodes, control-plane metrics scraped."""
    values: dict[str, Any] = {
        "nodeSelector": system.node_selector(),
        "metrics": {
            "enabled": True,
            "serviceMonitor": {"enabled": service_monitor, "honorLabels": True},
        },
    }
    if system.taints:
        values["tolerations"] = system.tolerations()
    return values


@dataclass(frozen=True)
class KubeRayArgs:
    """What the KubeRay operator release is built from."""

    version: str
    system: Placement
    service_monitor: bool
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]


class KubeRayOperator(pulumi.ComponentResource):
    """The KubeRay operator release; it owns the ray.io CRDs."""

    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: KubeRayArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:KubeRayOperator", name, None, opts)
        ns = namespace(
            NAMESPACE, parent=self, provider=args.provider, labels=PSA_RESTRICTED_WARN, depends_on=args.depends_on
        )
        self.release = release(
            f"{name}-release",
            chart=versions.KUBERAY_OPERATOR,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=NAMESPACE,
            values=kuberay_values(system=args.system, service_monitor=args.service_monitor),
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
        )
        self.register_outputs({"namespace": NAMESPACE})
