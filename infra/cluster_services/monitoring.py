"""kube-prometheus-stack: Prometheus, Alertmanager, Grafana and the operator.

The release installs the monitoring.coreos.com CRDs, so every ServiceMonitor,
PodMonitor and PrometheusRule (the charts' and the serving layer's) waits
for it.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra import versions
from infra.cluster_services.chart_release import PSA_PRIVILEGED, ChartRelease, ChartReleaseArgs, helm_fullname
from infra.cluster_services.layer import PlatformPods
from infra.cluster_services.parts import PartContext
from infra.config import Observability
from infra.scheduling import Placement

NAMESPACE = "monitoring"
RELEASE_NAME = "kube-prometheus-stack"
# kube-prometheus-stack truncates its fullname to 26 characters.
_FULLNAME_LIMIT = 26
PROMETHEUS_PORT = 9090
# The grafana subchart's `service.port` default; the parent chart's
# values.yaml does not expose it, so it is not set here, only read.
GRAFANA_PORT = 80
# The Grafana container's own port (the Service's target).
GRAFANA_CONTAINER_PORT = 3000
GRAFANA_ADMIN_USER = "admin"
GRAFANA_SECRET_USER_KEY = "admin-user"
GRAFANA_SECRET_PASSWORD_KEY = "admin-password"
DASHBOARD_LABEL = ("grafana_dashboard", "1")
# Prometheus trims the oldest blocks beyond this share of the volume, so a
# burst of series fills the retention window instead of the disk.
_RETENTION_SIZE_SHARE = 0.85
ALERTMANAGER_STORAGE_GIB = 10


def prometheus_fullname(release_name: str = RELEASE_NAME) -> str:
    """The chart's fullname, the prefix of every object it renders."""
    return helm_fullname(release_name, "kube-prometheus-stack", limit=_FULLNAME_LIMIT)


def grafana_service_name(release_name: str = RELEASE_NAME) -> str:
    """The Grafana Service the subchart renders."""
    return helm_fullname(release_name, "grafana")


def prometheus_url(ns: str = NAMESPACE, release_name: str = RELEASE_NAME) -> str:
    """In-cluster URL of the Prometheus Service."""
    return f"http://{prometheus_fullname(release_name)}-prometheus.{ns}.svc:{PROMETHEUS_PORT}"


def grafana_url(ns: str = NAMESPACE, release_name: str = RELEASE_NAME) -> str:
    """In-cluster URL of the Grafana Service."""
    return f"http://{grafana_service_name(release_name)}.{ns}.svc:{GRAFANA_PORT}"


def prometheus_pods(ns: str = NAMESPACE, release_name: str = RELEASE_NAME) -> PlatformPods:
    """The Prometheus pods as the operator labels them (`<fullname>-prometheus` is the Prometheus object)."""
    labels = {
        "app.kubernetes.io/name": "prometheus",
        "operator.prometheus.io/name": f"{prometheus_fullname(release_name)}-prometheus",
    }
    return PlatformPods(ns, labels, (PROMETHEUS_PORT,))


def grafana_pods(ns: str = NAMESPACE, release_name: str = RELEASE_NAME) -> PlatformPods:
    """The Grafana pods as the grafana subchart labels them."""
    labels = {"app.kubernetes.io/name": "grafana", "app.kubernetes.io/instance": release_name}
    return PlatformPods(ns, labels, (GRAFANA_CONTAINER_PORT,))


def _volume_claim(storage_class: str, gib: int) -> dict[str, Any]:
    return {
        "volumeClaimTemplate": {
            "spec": {
                "storageClassName": storage_class,
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": f"{gib}Gi"}},
            }
        }
    }


def _alertmanager(obs: Observability, storage_class: str, scheduling: dict[str, Any], ha: bool) -> dict[str, Any]:
    return {
        "enabled": True,
        "alertmanagerSpec": {
            **scheduling,
            # Alertmanager replicas gossip silences and dedupe
            # notifications, so three survive a node loss.
            "replicas": 3 if ha else 1,
            "storage": _volume_claim(storage_class, ALERTMANAGER_STORAGE_GIB),
            # The operator reads alertmanager.yaml from this Secret
            # instead of the chart's default (which routes nowhere).
            **({"configSecret": obs.alertmanager_config_secret} if obs.alertmanager_config_secret else {}),
        },
    }


def _prometheus(obs: Observability, storage_class: str, scheduling: dict[str, Any]) -> dict[str, Any]:
    retention_size = int(obs.prometheus_storage_gib * _RETENTION_SIZE_SHARE)
    return {
        "enabled": True,
        "service": {"port": PROMETHEUS_PORT},
        "prometheusSpec": {
            **scheduling,
            "retention": obs.prometheus_retention,
            "retentionSize": f"{retention_size}GB",
            "storageSpec": _volume_claim(storage_class, obs.prometheus_storage_gib),
            # Open selectors: monitors and rules from every namespace
            # are picked up without carrying this release's label.
            "ruleSelectorNilUsesHelmValues": False,
            "serviceMonitorSelectorNilUsesHelmValues": False,
            "podMonitorSelectorNilUsesHelmValues": False,
            "probeSelectorNilUsesHelmValues": False,
            "scrapeConfigSelectorNilUsesHelmValues": False,
        },
    }


def grafana_sidecar_role_name(release_name: str = RELEASE_NAME) -> str:
    """The Role Grafana's account gets in this namespace instead of the chart's."""
    return f"{grafana_service_name(release_name)}-configmaps"


def grafana_sidecar_rules() -> list[dict[str, list[str]]]:
    """What the dashboard and datasource sidecars need: read ConfigMaps, nothing else."""
    return [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]


def _grafana_sidecar() -> dict[str, Any]:
    """Dashboards and datasources from ConfigMaps in this namespace only, with RBAC to match.

    The grafana subchart's default RBAC is a ClusterRole that reads every
    ConfigMap and Secret in the cluster (its sidecars may watch any
    namespace); `rbac.namespaced` alone still makes a Role that reads every
    Secret of this namespace (grafana 12.11.1 templates/role.yaml grants
    configmaps and secrets whenever a sidecar is on), the admin password and
    Alertmanager's routes among them. So the sidecars watch ConfigMaps only
    (`resource: configmap`; the serving dashboards and the chart's
    Prometheus datasource are ConfigMaps), search only here, and the
    RoleBinding the chart makes points at `grafana_sidecar_role_name`, a Role
    this program makes with `grafana_sidecar_rules` (`rbac.useExistingRole`:
    the chart then renders no Role of its own). Grafana reads its own admin
    Secret through the pod's environment, not the API.
    """
    return {
        "rbac": {"namespaced": True, "useExistingRole": grafana_sidecar_role_name()},
        "sidecar": {
            "dashboards": {
                "enabled": True,
                "label": DASHBOARD_LABEL[0],
                "labelValue": DASHBOARD_LABEL[1],
                "searchNamespace": NAMESPACE,
                "resource": "configmap",
            },
            "datasources": {"resource": "configmap"},
        },
    }


def monitoring_values(
    obs: Observability,
    *,
    storage_class: str,
    system: Placement,
    admin_secret: str,
    highly_available: bool,
) -> dict[str, Any]:
    """The chart values: retention and storage from config, selectors open."""
    scheduling = system.pod_scheduling()
    return {
        "crds": {"enabled": True},
        "alertmanager": _alertmanager(obs, storage_class, scheduling, highly_available),
        "grafana": {
            "enabled": True,
            "admin": {
                "existingSecret": admin_secret,
                "userKey": GRAFANA_SECRET_USER_KEY,
                "passwordKey": GRAFANA_SECRET_PASSWORD_KEY,
            },
            **_grafana_sidecar(),
        },
        "prometheusOperator": {"enabled": True, **scheduling},
        "prometheus": _prometheus(obs, storage_class, scheduling),
    }


ADMIN_SECRET_NAME = f"{grafana_service_name()}-admin"


class Monitoring(ChartRelease):
    """kube-prometheus-stack, with Grafana's admin password generated here and kept in a Secret."""

    admin_password: pulumi.Output[str]
    prometheus_url: str
    grafana_url: str

    def __init__(self, name: str, args: ChartReleaseArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        self.prometheus_url = prometheus_url(args.namespace, args.release_name)
        self.grafana_url = grafana_url(args.namespace, args.release_name)
        super().__init__(name, args, opts)

    def _before_release(
        self, name: str, args: ChartReleaseArgs, ns: k8s.core.v1.Namespace | None
    ) -> list[pulumi.Resource]:
        password = random.RandomPassword(
            f"{name}-grafana-admin-password",
            length=32,
            special=False,
            opts=pulumi.ResourceOptions(parent=self),
        )
        # Marked secret here too, not only by the provider: it must never
        # reach a plain output or the render.
        generated: pulumi.Output[str] = password.result
        self.admin_password = pulumi.Output.secret(generated)
        secret = k8s.core.v1.Secret(
            f"{name}-grafana-admin",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=ADMIN_SECRET_NAME, namespace=args.namespace),
            type="Opaque",
            string_data={
                GRAFANA_SECRET_USER_KEY: GRAFANA_ADMIN_USER,
                GRAFANA_SECRET_PASSWORD_KEY: self.admin_password,
            },
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[ns] if ns else [],
                additional_secret_outputs=["stringData", "data"],
            ),
        )
        # Before the release: the chart's RoleBinding names this Role.
        role = k8s.rbac.v1.Role(
            f"{name}-grafana-sidecar",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=grafana_sidecar_role_name(args.release_name), namespace=args.namespace
            ),
            rules=[
                k8s.rbac.v1.PolicyRuleArgs(api_groups=r["apiGroups"], resources=r["resources"], verbs=r["verbs"])
                for r in grafana_sidecar_rules()
            ],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[ns] if ns else []),
        )
        return [secret, role]


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> Monitoring:
    """kube-prometheus-stack; it owns the monitoring.coreos.com CRDs."""
    values = monitoring_values(
        ctx.cfg.observability,
        storage_class=ctx.cfg.storage.storage_class.name,
        system=ctx.aws.system,
        admin_secret=ADMIN_SECRET_NAME,
        highly_available=ctx.cfg.is_prod,
    )
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:Monitoring",
        chart=versions.KUBE_PROMETHEUS_STACK,
        version=ctx.cfg.versions.kube_prometheus_stack,
        release_name=RELEASE_NAME,
        namespace=NAMESPACE,
        values=values,
        # node-exporter needs the host's network and PID namespaces.
        namespace_labels=PSA_PRIVILEGED,
        timeout_seconds=900,
    )
    return Monitoring(name, args, opts)
