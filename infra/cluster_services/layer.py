"""What the platform layer hands to the serving layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi


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
    grafana_service: str  # "namespace/name:port"
    prometheus_url: str  # in-cluster URL, for Ray's dashboard
    grafana_url: str  # in-cluster URL, for Ray's dashboard
    storage_class: str
    # Added by the platform layer (defaults keep older callers working):
    # the IngressClass of the AWS load balancer controller, and its release,
    # which an Ingress or LoadBalancer Service must wait for (its webhook
    # mutates Services); the release is None when not installed here.
    ingress_class: str | None = None
    load_balancer_controller: pulumi.Resource | None = None
    # Grafana's generated admin password (a secret output); None when
    # Grafana is not installed here.
    grafana_admin_password: pulumi.Output[str] | None = None
    # Every release this layer installed, for anything that must come after
    # the whole platform.
    releases: dict[str, pulumi.Resource] = field(default_factory=dict)
