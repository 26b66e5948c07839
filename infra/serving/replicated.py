"""What the serving layer's own replicated Deployments (each model's router, the gateway) carry alike.

Zone spread, a one-at-a-time disruption budget, a CPU autoscaler and a
PodMonitor, each built from the pods' labels, so the router and the gateway
can not drift apart in how they survive a node or a zone, scale, or are
scraped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config.fields import quantity_value
from infra.scheduling import Placement
from infra.serving.namespace import PART_OF
from infra.serving.network import ClusterPeers
from infra.serving.ports import Port


@dataclass(frozen=True)
class DeploymentSite:
    """Where one of these Deployments runs and what is around it, the same for the router and the gateway."""

    namespace: str
    # The serving image (both run from it).
    image: pulumi.Input[str]
    # The system node group's scheduling.
    system: Placement
    # Who the NetworkPolicies let in or out.
    peers: ClusterPeers
    # The labels Prometheus selects its PodMonitors by.
    prometheus_selector_labels: Mapping[str, str]


def spread(pods: Mapping[str, str]) -> list[dict[str, Any]]:
    """Across zones first (a zone's loss leaves one of `pods` in another), then across nodes."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": dict(pods)},
        },
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(pods)},
        },
    ]


def disruption_budget(name: str, namespace: str, pods: Mapping[str, str]) -> dict[str, Any]:
    """A node drain takes one of `pods` at a time."""
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(pods)}},
    }


def cpu_limit(request: str, at_least: str) -> str:
    """A container's CPU limit: ``at_least``, or twice its request when that is more (room for a burst above
    the utilisation its HorizontalPodAutoscaler holds, never below the request Kubernetes requires it to meet)."""
    asked, floor = quantity_value(request), quantity_value(at_least)
    assert asked is not None and floor is not None, (request, at_least)
    return at_least if floor >= 2 * asked else f"{int(2 * asked * 1000)}m"


def cpu_autoscaler(name: str, namespace: str, min_replicas: int, max_replicas: int, target: int) -> dict[str, Any]:
    """The Deployment `name`'s count follows its CPU, held at `target` percent of its request."""
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": target}},
                }
            ],
        },
    }


def pod_monitor(
    name: str,
    namespace: str,
    pods: Mapping[str, str],
    port: Port,
    selector_labels: Mapping[str, str],
    target_labels: Sequence[str] = (),
) -> dict[str, Any]:
    """Prometheus scrapes `port` of each of `pods` (selected by the labels Prometheus picks monitors by)."""
    spec: dict[str, Any] = {
        "namespaceSelector": {"matchNames": [namespace]},
        "selector": {"matchLabels": dict(pods)},
        "podMetricsEndpoints": [{"port": port.name, "path": "/metrics", "interval": "15s"}],
    }
    if target_labels:
        spec["podTargetLabels"] = list(target_labels)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "namespace": namespace, "labels": {**PART_OF, **selector_labels}},
        "spec": spec,
    }


def declare_scaling_and_monitoring(
    name: str, parent: pulumi.Resource, budget: dict[str, Any], scaler: dict[str, Any], monitor: dict[str, Any]
) -> None:
    """The budget, the autoscaler and the PodMonitor as resources `<name>-budget`, `-autoscaler`, `-monitor`."""
    opts = pulumi.ResourceOptions(parent=parent)
    k8s.policy.v1.PodDisruptionBudget(f"{name}-budget", metadata=budget["metadata"], spec=budget["spec"], opts=opts)
    k8s.autoscaling.v2.HorizontalPodAutoscaler(
        f"{name}-autoscaler", metadata=scaler["metadata"], spec=scaler["spec"], opts=opts
    )
    k8s.apiextensions.CustomResource(
        f"{name}-monitor",
        api_version=monitor["apiVersion"],
        kind=monitor["kind"],
        metadata=monitor["metadata"],
        spec=monitor["spec"],
        opts=opts,
    )
