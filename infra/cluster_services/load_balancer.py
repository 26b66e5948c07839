"""AWS Load Balancer Controller: ALBs for Ingresses, NLBs for Services."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.aws.layer import PodIdentity
from infra.cluster_services.helm import namespace, release
from infra.scheduling import Placement

RELEASE_NAME = "aws-load-balancer-controller"
# The IngressClass the chart creates; the serving layer's Ingress names it.
INGRESS_CLASS = "alb"


def load_balancer_values(
    *,
    cluster_name: pulumi.Input[str],
    region: str,
    vpc_id: pulumi.Input[str] | None,
    identity: PodIdentity,
    system: Placement,
    service_monitor: bool,
) -> dict[str, Any]:
    """The chart values: cluster, region, VPC and the pod identity's account."""
    values: dict[str, Any] = {
        "fullnameOverride": RELEASE_NAME,
        "clusterName": cluster_name,
        "region": region,
        "serviceAccount": {"create": True, "name": identity.service_account},
        "ingressClass": INGRESS_CLASS,
        "createIngressClassResource": True,
        "nodeSelector": system.node_selector(),
        "serviceMonitor": {"enabled": service_monitor},
    }
    # Given explicitly the controller needs no instance metadata (IMDS) to
    # find its VPC; on an existing cluster without a known VPC it falls back.
    if vpc_id is not None:
        values["vpcId"] = vpc_id
    if system.taints:
        values["tolerations"] = system.tolerations()
    return values


@dataclass(frozen=True)
class LoadBalancerControllerArgs:
    """What the load balancer controller release is built from."""

    version: str
    cluster_name: pulumi.Input[str]
    region: str
    vpc_id: pulumi.Input[str] | None
    identity: PodIdentity
    system: Placement
    service_monitor: bool
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]
    # False when another component already declares this namespace (both
    # pod identities in one namespace).
    own_namespace: bool = True


class LoadBalancerController(pulumi.ComponentResource):
    """The AWS Load Balancer Controller release, in its pod identity's namespace."""

    release: k8s.helm.v3.Release
    namespace_resource: k8s.core.v1.Namespace | None
    ingress_class: str

    def __init__(self, name: str, args: LoadBalancerControllerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:LoadBalancerController", name, None, opts)
        ns_name = args.identity.namespace
        ns = (
            namespace(ns_name, parent=self, provider=args.provider, depends_on=args.depends_on)
            if args.own_namespace
            else None
        )
        self.namespace_resource = ns
        values = load_balancer_values(
            cluster_name=args.cluster_name,
            region=args.region,
            vpc_id=args.vpc_id,
            identity=args.identity,
            system=args.system,
            service_monitor=args.service_monitor,
        )
        self.release = release(
            f"{name}-release",
            chart=versions.AWS_LOAD_BALANCER_CONTROLLER,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=ns_name,
            values=values,
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
        )
        self.ingress_class = INGRESS_CLASS
        self.register_outputs({"namespace": ns_name, "ingress_class": INGRESS_CLASS})
