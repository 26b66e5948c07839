"""Builds the platform layer: the in-cluster services models rely on.

Order, and why:
1. the default StorageClass (Prometheus and Alertmanager claim volumes of it);
2. kube-prometheus-stack (installs the monitoring.coreos.com CRDs that the
   other charts' ServiceMonitors need);
3. the AWS load balancer controller (its webhook intercepts every Service
   created afterwards, so it must be serving before the other charts' Services);
4. GPU Operator, KubeRay, KEDA and cluster-autoscaler.
Every release waits for the AWS layer's `cluster_ready`.
"""

from __future__ import annotations

import pulumi

from infra.aws.layer import AwsLayer
from infra.config import StackConfig
from infra.cluster_services import monitoring as mon
from infra.cluster_services.autoscaler import ClusterAutoscaler, ClusterAutoscalerArgs
from infra.cluster_services.gpu_operator import GpuOperator, GpuOperatorArgs
from infra.cluster_services.keda import Keda, KedaArgs
from infra.cluster_services.kuberay import KubeRayArgs, KubeRayOperator
from infra.cluster_services.layer import PlatformLayer
from infra.cluster_services.load_balancer import INGRESS_CLASS, LoadBalancerController, LoadBalancerControllerArgs
from infra.cluster_services.storage import DefaultStorageClass

# With `platform.monitoring.enabled: false` (an existing cluster) the program
# assumes the cluster runs kube-prometheus-stack under its usual names, whose
# default selectors match the `release` label: monitors and rules this
# program creates carry it so that Prometheus picks them up.
EXISTING_MONITORING_SELECTOR = {"release": mon.RELEASE_NAME}


def build_platform(cfg: StackConfig, aws: AwsLayer) -> PlatformLayer:
    """Install the platform services on the cluster the AWS layer made or found."""
    parts = cfg.platform
    provider = aws.provider
    ready: list[pulumi.Resource] = list(aws.cluster_ready)
    releases: dict[str, pulumi.Resource] = {}

    storage = DefaultStorageClass("storage-class", cfg.storage.storage_class, provider=provider, depends_on=ready)

    monitoring: mon.Monitoring | None = None
    if parts.monitoring.enabled:
        monitoring = mon.Monitoring(
            "monitoring",
            mon.MonitoringArgs(
                observability=cfg.observability,
                version=cfg.versions.kube_prometheus_stack,
                storage_class=storage.name,
                system=aws.system,
                highly_available=cfg.is_prod,
                provider=provider,
                depends_on=[*ready, storage],
            ),
        )
        releases["kube-prometheus-stack"] = monitoring.release
    # Charts' own ServiceMonitors need the CRDs: from this release, or (when
    # switched off on an existing cluster) from the cluster's own stack.
    monitors = True
    after_monitoring = [*ready, *([monitoring.release] if monitoring else [])]

    lbc: LoadBalancerController | None = None
    if parts.load_balancer_controller.enabled:
        lbc = LoadBalancerController(
            "load-balancer-controller",
            LoadBalancerControllerArgs(
                version=cfg.versions.aws_load_balancer_controller,
                cluster_name=aws.cluster_name,
                region=cfg.region,
                vpc_id=aws.vpc_id,
                identity=aws.load_balancer_controller,
                system=aws.system,
                service_monitor=monitors,
                provider=provider,
                depends_on=after_monitoring,
            ),
        )
        releases["aws-load-balancer-controller"] = lbc.release
    after_webhooks = [*after_monitoring, *([lbc.release] if lbc else [])]

    gpu_operator: GpuOperator | None = None
    if parts.gpu_operator.enabled:
        gpu_operator = GpuOperator(
            "gpu-operator",
            GpuOperatorArgs(
                version=cfg.versions.gpu_operator,
                mig_strategy=parts.gpu_operator.mig_strategy,
                gpu=aws.gpu,
                system=aws.system,
                provider=provider,
                depends_on=after_webhooks,
            ),
        )
        releases["gpu-operator"] = gpu_operator.release

    kuberay: KubeRayOperator | None = None
    if parts.kuberay.enabled:
        kuberay = KubeRayOperator(
            "kuberay-operator",
            KubeRayArgs(
                version=cfg.versions.kuberay_operator,
                system=aws.system,
                service_monitor=monitors,
                provider=provider,
                depends_on=after_webhooks,
            ),
        )
        releases["kuberay-operator"] = kuberay.release

    keda: Keda | None = None
    if parts.keda.enabled:
        keda = Keda(
            "keda",
            KedaArgs(
                version=cfg.versions.keda,
                system=aws.system,
                service_monitor=monitors,
                operator=aws.keda_operator,
                provider=provider,
                depends_on=after_webhooks,
            ),
        )
        releases["keda"] = keda.release

    if parts.cluster_autoscaler.enabled:
        identity = aws.cluster_autoscaler
        # Both pod identities may share one namespace: declare it once.
        shared = lbc is not None and aws.load_balancer_controller.namespace == identity.namespace
        autoscaler = ClusterAutoscaler(
            "cluster-autoscaler",
            ClusterAutoscalerArgs(
                version=cfg.versions.cluster_autoscaler,
                settings=cfg.autoscaling.cluster,
                cluster_name=aws.cluster_name,
                region=cfg.region,
                identity=identity,
                system=aws.system,
                service_monitor=monitors,
                provider=provider,
                depends_on=after_webhooks,
                own_namespace=not shared,
            ),
        )
        releases["cluster-autoscaler"] = autoscaler.release

    return PlatformLayer(
        ray_crds=kuberay.release if kuberay else None,
        monitoring_crds=monitoring.release if monitoring else None,
        keda_crds=keda.release if keda else None,
        monitoring_namespace=monitoring.namespace if monitoring else mon.NAMESPACE,
        dashboard_label=mon.DASHBOARD_LABEL,
        prometheus_selector_labels={} if monitoring else dict(EXISTING_MONITORING_SELECTOR),
        grafana_service=monitoring.grafana_service if monitoring else mon.grafana_service(),
        prometheus_url=monitoring.prometheus_url if monitoring else mon.prometheus_url(),
        grafana_url=monitoring.grafana_url if monitoring else mon.grafana_url(),
        storage_class=storage.name,
        ingress_class=INGRESS_CLASS,
        load_balancer_controller=lbc.release if lbc else None,
        grafana_admin_password=monitoring.admin_password if monitoring else None,
        releases=releases,
    )
