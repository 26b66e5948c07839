"""What the platform layer hands to the serving layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi


@dataclass(frozen=True)
class PlatformPods:
    """Pods of a platform part as the serving layer's NetworkPolicies name them.

    Matched by their namespace AND their labels (a label alone can be copied
    by anyone who may create a pod), with the ports they listen on.
    """

    namespace: str
    labels: Mapping[str, str]
    ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlatformLayer:
    """In-cluster services the serving layer builds on.

    Each `*_crds` is the resource that installs a CRD group, so custom
    resources of that group depend on it; None where the cluster already has
    the CRDs (cluster.mode existing with that part switched off).
    """

    ray_crds: pulumi.Resource | None
    monitoring_crds: pulumi.Resource | None
    keda_crds: pulumi.Resource | None
    monitoring_namespace: str
    # Label the Grafana sidecar watches ConfigMaps for (key, value).
    dashboard_label: tuple[str, str]
    # Label Prometheus' rule/monitor selectors match; empty when they are open.
    prometheus_selector_labels: dict[str, str]
    prometheus_url: str  # in-cluster URL, for Ray's dashboard
    grafana_url: str  # in-cluster URL, for Ray's dashboard
    storage_class: str
    # The KubeRay operator (it calls each Ray head), Prometheus (it scrapes
    # the Ray pods) and Grafana (the Ray dashboard checks it).
    kuberay_operator: PlatformPods
    prometheus: PlatformPods
    grafana: PlatformPods
    # The AWS load balancer controller's release, which a LoadBalancer
    # Service must wait for (its webhook mutates Services); None when not
    # installed here.
    load_balancer_controller: pulumi.Resource | None = None
