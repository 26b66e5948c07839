"""EKS managed add-ons, each pinned to the version in infra/versions.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra import versions

# The serving layer's NetworkPolicies are enforced only when the VPC CNI's
# network policy agent is on.
ADDON_CONFIGURATION: dict[str, dict[str, str]] = {"vpc-cni": {"enableNetworkPolicy": "true"}}


@dataclass(frozen=True)
class AddonsArgs:
    """Which add-ons to install on which cluster."""

    cluster_name: pulumi.Input[str]
    names: Sequence[str]


class EksAddons(pulumi.ComponentResource):
    """A set of EKS managed add-ons at pinned versions.

    Installed in two steps by the layer: the ones a node needs to join and
    run pods (vpc-cni, kube-proxy, eks-pod-identity-agent) with the cluster,
    and the ones that run as Deployments (coredns, aws-ebs-csi-driver) after
    the node groups: EKS reports those DEGRADED until a node can run them,
    and the create would wait on that until it times out.

    What the add-ons wait for is the component's `depends_on`: the
    component registers only once its dependencies exist, and each add-on
    (a child) only once the component has registered.
    """

    addons: dict[str, aws.eks.Addon]

    def __init__(self, name: str, args: AddonsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:EksAddons", name, None, opts)
        unknown = [n for n in args.names if n not in versions.EKS_ADDONS]
        if unknown:
            raise ValueError(f"add-ons {unknown} have no pinned version in infra/versions.py EKS_ADDONS")
        self.addons = {
            addon: aws.eks.Addon(
                addon,
                cluster_name=args.cluster_name,
                addon_name=addon,
                addon_version=versions.EKS_ADDONS[addon],
                configuration_values=json.dumps(ADDON_CONFIGURATION[addon]) if addon in ADDON_CONFIGURATION else None,
                # The program owns these add-ons' settings: a manual edit in
                # the cluster is put back on the next update.
                resolve_conflicts_on_create="OVERWRITE",
                resolve_conflicts_on_update="OVERWRITE",
                opts=pulumi.ResourceOptions(parent=self),
            )
            for addon in args.names
        }
        self.register_outputs({"versions": {n: a.addon_version for n, a in self.addons.items()}})
