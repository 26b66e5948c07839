"""KubeRay operator: reconciles RayService and RayCluster objects.

The release installs the ray.io CRDs, so every RayService waits for it.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import versions
from infra.cluster_services.chart_release import PSA_RESTRICTED, ChartRelease, ChartReleaseArgs
from infra.cluster_services.layer import PlatformPods
from infra.cluster_services.parts import PartContext
from infra.scheduling import Placement

NAMESPACE = "kuberay"
RELEASE_NAME = "kuberay-operator"
# The operator pod's labels in chart 1.7.0 (its values set nameOverride
# `kuberay-operator`; the instance is the release).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": RELEASE_NAME}


def operator_pods() -> PlatformPods:
    """The operator's pods, for the NetworkPolicies that let it reach the Ray heads."""
    return PlatformPods(NAMESPACE, OPERATOR_POD_LABELS)


def kuberay_values(*, system: Placement) -> dict[str, Any]:
    """The chart values: on system nodes, control-plane metrics scraped."""
    values: dict[str, Any] = {
        **system.pod_scheduling(),
        "metrics": {
            "enabled": True,
            "serviceMonitor": {"enabled": True, "honorLabels": True},
        },
    }
    return values


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The KubeRay operator release; it owns the ray.io CRDs."""
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:KubeRayOperator",
        chart=versions.KUBERAY_OPERATOR,
        version=ctx.cfg.versions.kuberay_operator,
        release_name=RELEASE_NAME,
        namespace=NAMESPACE,
        values=kuberay_values(system=ctx.aws.system),
        # The operator's chart 1.7.0 pod passes `restricted` (its container securityContext
        # drops every capability, runs non-root with RuntimeDefault seccomp).
        namespace_labels=PSA_RESTRICTED,
    )
    return ChartRelease(name, args, opts)
