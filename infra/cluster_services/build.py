"""Builds the platform layer: the in-cluster services models rely on.

The layer is the table `PARTS`, installed in order; each part waits for the
parts it names in `after`, and all of them for the AWS layer's
`cluster_ready`. The order, and why:
1. the default StorageClass (Prometheus and Alertmanager claim volumes of it);
2. kube-prometheus-stack (installs the monitoring.coreos.com CRDs that the
   other charts' ServiceMonitors need);
3. the AWS load balancer controller (its webhook intercepts every Service
   created afterwards, so it must be serving before the other charts' Services);
4. GPU Operator, KubeRay, KEDA, cluster-autoscaler (managed node groups) or
   Karpenter (its NodePools) and, where the endpoint has a domain, external-dns.
"""

from __future__ import annotations

import pulumi

from infra.aws.layer import MANAGED_NODE_GROUPS, AwsLayer
from infra.cluster_services import (
    autoscaler,
    external_dns,
    gpu_operator,
    karpenter,
    keda,
    kuberay,
    load_balancer,
    storage,
)
from infra.cluster_services import monitoring as mon
from infra.cluster_services.chart_release import ChartRelease
from infra.cluster_services.layer import PlatformLayer
from infra.cluster_services.parts import Part, PartContext
from infra.config import StackConfig

# With `platform.monitoring.enabled: false` (an existing cluster) the program
# assumes the cluster runs kube-prometheus-stack under its usual names, whose
# default selectors match the `release` label: monitors and rules this
# program creates carry it so that Prometheus picks them up.
EXISTING_MONITORING_SELECTOR = {"release": mon.RELEASE_NAME}

# Parts whose charts bring webhooks or CRDs that the parts after them use.
_FOUNDATION = ("storage-class", "monitoring", "load-balancer-controller")

PARTS: tuple[Part, ...] = (
    Part("storage-class", lambda ctx: True, storage.build),
    Part("monitoring", lambda ctx: ctx.cfg.platform.monitoring.enabled, mon.build, after=("storage-class",)),
    Part(
        "load-balancer-controller",
        lambda ctx: ctx.cfg.platform.load_balancer_controller.enabled,
        load_balancer.build,
        after=("monitoring",),
    ),
    Part("gpu-operator", lambda ctx: ctx.cfg.platform.gpu_operator.enabled, gpu_operator.build, after=_FOUNDATION),
    Part("kuberay-operator", lambda ctx: ctx.cfg.platform.kuberay.enabled, kuberay.build, after=_FOUNDATION),
    Part("keda", lambda ctx: ctx.cfg.platform.keda.enabled, keda.build, after=_FOUNDATION),
    Part(
        "cluster-autoscaler",
        # Scales managed node groups; other node provisioners scale themselves.
        lambda ctx: ctx.cfg.platform.cluster_autoscaler.enabled and ctx.aws.node_provisioner == MANAGED_NODE_GROUPS,
        autoscaler.build,
        after=_FOUNDATION,
    ),
    # The endpoints' DNS records, where the endpoint has a domain.
    Part("external-dns", external_dns.enabled, external_dns.build, after=_FOUNDATION),
    # GPU nodes, where the node provisioner is Karpenter (its ServiceMonitor
    # needs the monitoring CRDs, its Service the load balancer webhook).
    Part("karpenter", karpenter.enabled, karpenter.build, after=_FOUNDATION),
)


def install_parts(
    cfg: StackConfig, aws: AwsLayer, parts: tuple[Part, ...] = PARTS
) -> dict[str, pulumi.ComponentResource]:
    """Declare every enabled part, in order, each after the parts it names."""
    installed: dict[str, pulumi.ComponentResource] = {}
    for part in parts:
        ctx = PartContext(cfg=cfg, aws=aws, installed=dict(installed))
        if not part.enabled(ctx):
            continue
        waits_for = [installed[name] for name in part.after if name in installed]
        opts = pulumi.ResourceOptions(provider=aws.provider, depends_on=[*aws.cluster_ready, *waits_for])
        installed[part.name] = part.build(part.name, ctx, opts)
    return installed


def _release(installed: dict[str, pulumi.ComponentResource], name: str) -> pulumi.Resource | None:
    part = installed.get(name)
    return part.release if isinstance(part, ChartRelease) else None


def build_platform(cfg: StackConfig, aws: AwsLayer) -> PlatformLayer:
    """Install the platform services on the cluster the AWS layer made or found."""
    installed = install_parts(cfg, aws)
    monitoring = installed.get("monitoring")
    ours = isinstance(monitoring, mon.Monitoring)
    return PlatformLayer(
        ray_crds=_release(installed, "kuberay-operator"),
        monitoring_crds=_release(installed, "monitoring"),
        keda_crds=_release(installed, "keda"),
        monitoring_namespace=mon.NAMESPACE,
        dashboard_label=mon.DASHBOARD_LABEL,
        prometheus_selector_labels={} if ours else dict(EXISTING_MONITORING_SELECTOR),
        prometheus_url=mon.prometheus_url(),
        grafana_url=mon.grafana_url(),
        storage_class=cfg.storage.storage_class.name,
        kuberay_operator=kuberay.operator_pods(),
        prometheus=mon.prometheus_pods(),
        grafana=mon.grafana_pods(),
        load_balancer_controller=_release(installed, "load-balancer-controller"),
    )
