"""AWS Load Balancer Controller: ALBs for Ingresses, NLBs for Services."""

from __future__ import annotations

from typing import Any

import pulumi

from infra import versions
from infra.aws.layer import PodIdentity
from infra.cluster_services.chart_release import ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.scheduling import Placement

RELEASE_NAME = "aws-load-balancer-controller"
# The IngressClass the chart creates; the serving layer's Ingress names it.
INGRESS_CLASS = "alb"
# The controller's ALB add-ons, all on by default. The platform serves
# through NLBs, which have none of them, and the controller's IAM policy
# grants no WAF or Shield call (infra/aws/load_balancer_controller_policy.json):
# switched off, the controller never tries one.
ADDONS_OFF = {"enableWaf": False, "enableWafv2": False, "enableShield": False}


def load_balancer_values(
    *,
    cluster_name: pulumi.Input[str],
    region: str,
    vpc_id: pulumi.Input[str] | None,
    identity: PodIdentity,
    system: Placement,
    watch_namespace: str,
) -> dict[str, Any]:
    """The chart values: cluster, region, VPC, the pod identity's account and the one namespace it serves.

    `watch_namespace`: the serving namespace, the only one whose Services
    (and Ingresses) get load balancers. The controller may create and delete
    this cluster's load balancers and open the nodes' security group; left
    watching every namespace, anyone who may create a LoadBalancer Service
    anywhere in the cluster could use those rights.
    """
    values: dict[str, Any] = {
        "fullnameOverride": RELEASE_NAME,
        "clusterName": cluster_name,
        "region": region,
        "serviceAccount": {"create": True, "name": identity.service_account},
        "ingressClass": INGRESS_CLASS,
        "createIngressClassResource": True,
        "watchNamespace": watch_namespace,
        **ADDONS_OFF,
        **system.pod_scheduling(),
        "serviceMonitor": {"enabled": True},
    }
    # Given explicitly the controller needs no instance metadata (IMDS) to
    # find its VPC; on an existing cluster without a known VPC it falls back.
    if vpc_id is not None:
        values["vpcId"] = vpc_id
    return values


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The AWS Load Balancer Controller release, in its pod identity's namespace."""
    identity = ctx.aws.load_balancer_controller
    values = load_balancer_values(
        cluster_name=ctx.aws.cluster_name,
        region=ctx.cfg.region,
        vpc_id=ctx.aws.vpc_id,
        identity=identity,
        system=ctx.aws.system,
        watch_namespace=ctx.cfg.serving.namespace,
    )
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:LoadBalancerController",
        chart=versions.AWS_LOAD_BALANCER_CONTROLLER,
        version=ctx.cfg.versions.aws_load_balancer_controller,
        release_name=RELEASE_NAME,
        namespace=identity.namespace,
        values=values,
    )
    return ChartRelease(name, args, opts)
