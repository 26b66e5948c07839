"""cluster-autoscaler: adds and removes nodes of the managed node groups.

Finds the groups by their Auto Scaling group tags (auto-discovery) and acts
through the IAM role the AWS layer binds to its service account with EKS
Pod Identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.aws.layer import PodIdentity
from infra.config import ClusterAutoscaling
from infra.cluster_services.helm import namespace, release
from infra.scheduling import Placement

RELEASE_NAME = "cluster-autoscaler"


def autoscaler_values(
    *,
    settings: ClusterAutoscaling,
    cluster_name: pulumi.Input[str],
    region: str,
    identity: PodIdentity,
    system: Placement,
    service_monitor: bool,
) -> dict[str, Any]:
    """The chart values: discovery, identity, expander and scale-down timing."""
    values: dict[str, Any] = {
        "fullnameOverride": RELEASE_NAME,
        "cloudProvider": "aws",
        "awsRegion": region,
        "autoDiscovery": {"clusterName": cluster_name},
        "image": {"tag": versions.CLUSTER_AUTOSCALER_IMAGE_TAG},
        # The account the pod identity association names; the chart creates it.
        "rbac": {"serviceAccount": {"create": True, "name": identity.service_account}},
        "extraArgs": {
            "expander": settings.expander,
            "balance-similar-node-groups": True,
            "scale-down-unneeded-time": settings.scale_down_unneeded_time,
            "scale-down-delay-after-add": settings.scale_down_delay_after_add,
            "max-node-provision-time": settings.max_node_provision_time,
            # Ray pods keep logs and spill in emptyDir: without this the
            # autoscaler would never remove an idle GPU node.
            "skip-nodes-with-local-storage": False,
            # cluster_autoscaler_node_group_{target,max}_count exist only with
            # this flag; the "GPU pods pending, group at max" alert reads them.
            "emit-per-nodegroup-metrics": True,
        },
        "nodeSelector": system.node_selector(),
        "serviceMonitor": {"enabled": service_monitor, "namespace": identity.namespace},
    }
    if system.taints:
        values["tolerations"] = system.tolerations()
    return values


@dataclass(frozen=True)
class ClusterAutoscalerArgs:
    """What the cluster-autoscaler release is built from."""

    version: str
    settings: ClusterAutoscaling
    cluster_name: pulumi.Input[str]
    region: str
    identity: PodIdentity
    system: Placement
    service_monitor: bool
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]
    # False when another component already declares this namespace (both
    # pod identities in one namespace).
    own_namespace: bool = True


class ClusterAutoscaler(pulumi.ComponentResource):
    """The cluster-autoscaler release, in its pod identity's namespace."""

    release: k8s.helm.v3.Release
    namespace_resource: k8s.core.v1.Namespace | None

    def __init__(self, name: str, args: ClusterAutoscalerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:ClusterAutoscaler", name, None, opts)
        ns_name = args.identity.namespace
        ns = (
            namespace(ns_name, parent=self, provider=args.provider, depends_on=args.depends_on)
            if args.own_namespace
            else None
        )
        self.namespace_resource = ns
        values = autoscaler_values(
            settings=args.settings,
            cluster_name=args.cluster_name,
            region=args.region,
            identity=args.identity,
            system=args.system,
            service_monitor=args.service_monitor,
        )
        self.release = release(
            f"{name}-release",
            chart=versions.CLUSTER_AUTOSCALER,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=ns_name,
            values=values,
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
        )
        self.register_outputs({"namespace": ns_name})
