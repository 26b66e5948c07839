"""cluster-autoscaler: adds and removes nodes of the managed node groups.

Finds the groups by their Auto Scaling group tags (auto-discovery) and acts
through the IAM role the AWS layer binds to its service account with EKS
Pod Identity.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import versions
from infra.aws.layer import PodIdentity
from infra.cluster_services.chart_release import ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.config import ClusterAutoscaling
from infra.scheduling import Placement

RELEASE_NAME = "cluster-autoscaler"


def autoscaler_values(
    *,
    settings: ClusterAutoscaling,
    cluster_name: pulumi.Input[str],
    region: str,
    identity: PodIdentity,
    system: Placement,
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
        **system.pod_scheduling(),
        "serviceMonitor": {"enabled": True, "namespace": identity.namespace},
    }
    return values


LOAD_BALANCER_PART = "load-balancer-controller"


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The cluster-autoscaler release, in its pod identity's namespace."""
    identity = ctx.aws.cluster_autoscaler
    # Both pod identities may share one namespace: declare it once.
    lbc = ctx.installed.get(LOAD_BALANCER_PART)
    shared = isinstance(lbc, ChartRelease) and lbc.namespace == identity.namespace
    values = autoscaler_values(
        settings=ctx.cfg.autoscaling.cluster,
        cluster_name=ctx.aws.cluster_name,
        region=ctx.cfg.region,
        identity=identity,
        system=ctx.aws.system,
    )
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:ClusterAutoscaler",
        chart=versions.CLUSTER_AUTOSCALER,
        version=ctx.cfg.versions.cluster_autoscaler,
        release_name=RELEASE_NAME,
        namespace=identity.namespace,
        values=values,
        own_namespace=not shared,
    )
    return ChartRelease(name, args, opts)
