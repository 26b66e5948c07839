"""How the cluster gets nodes: the seam between the AWS layer and whatever provisions nodes.

A node provisioner does two things:

- it says where pods may run: the system placement and one GPU placement
  per GPU group (infra/scheduling.py), the objects every layer below takes
  its node selectors, tolerations and GPU shapes from;
- it makes the capacity that carries those placements, once there is a
  cluster to join.

The AWS layer (infra/aws/build.py) only asks the provisioner selected by
`cluster.node_provisioner`; it knows nothing about node groups. Today there
is one provisioner, ManagedNodeGroups. Another one (Karpenter NodePools)
is another class with the same three members and an entry in PROVISIONERS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

import pulumi

from infra.aws.karpenter import KarpenterController, KarpenterControllerArgs
from infra.aws.layer import KARPENTER, MANAGED_NODE_GROUPS, KarpenterAccess
from infra.aws.node_groups import NodeGroup, NodeGroupArgs
from infra.config import NodeGroups, NodeGroupSettings, StackConfig
from infra.scheduling import GpuPlacement, Placement, gpu_placements, system_placement


@dataclass(frozen=True)
class NodeTarget:
    """The cluster the nodes join, and what every node carries."""

    cluster_name: pulumi.Output[str]
    kubernetes_version: str
    node_role_arn: pulumi.Input[str]
    subnet_ids: pulumi.Input[Sequence[str]]
    tags: dict[str, str] = field(default_factory=dict)
    # What a provisioner that launches nodes itself (Karpenter) also needs:
    # the region, and the security group every node's interfaces carry.
    region: str = ""
    security_group_id: pulumi.Input[str] | None = None


@dataclass(frozen=True)
class ProvisionedNodes:
    """What a provisioner made."""

    # The AWS name of each placement's capacity (a node group's name), by
    # placement group; exported as the stack output `node_groups`.
    names: dict[str, pulumi.Output[str]]
    # What in-cluster resources wait for: the capacity that runs their pods.
    ready: list[pulumi.Resource]
    # Karpenter's AWS side, when the provisioner is Karpenter.
    karpenter: KarpenterAccess | None = None


class NodeProvisioner(Protocol):
    """Where pods may run, and the nodes that make it true."""

    @property
    def name(self) -> str:
        """The `cluster.node_provisioner` value; the platform layer reads it (AwsLayer.node_provisioner)."""
        ...

    @property
    def system(self) -> Placement:
        """The system nodes' placement: operators, monitoring, Ray heads."""
        ...

    @property
    def gpu(self) -> Mapping[str, GpuPlacement]:
        """Each GPU group's placement, by group name."""
        ...

    def provision(self, target: NodeTarget, opts: pulumi.ResourceOptions | None = None) -> ProvisionedNodes:
        """Declare the capacity that carries the placements.

        `opts` go to every component made here: its `depends_on` is what
        the nodes wait for before they can join (add-ons, node role
        policies), reaching each component's children through the parent.
        """
        ...


@dataclass(frozen=True)
class _Placements:
    """What every provisioner starts from: the node group settings and the placements made from them."""

    settings: NodeGroups
    system: Placement
    gpu: dict[str, GpuPlacement]

    @classmethod
    def from_config(cls, cfg: StackConfig) -> Self:
        """The node groups and placements of `cfg.node_groups`."""
        return cls(settings=cfg.node_groups, system=system_placement(cfg), gpu=gpu_placements(cfg))


@dataclass(frozen=True)
class ManagedNodeGroups(_Placements):
    """One EKS managed node group per placement, scaled by cluster-autoscaler.

    The system group and every GPU group of `node_groups` becomes a
    NodeGroup component named `nodes-<group>`, whose nodes carry exactly
    the labels and taints of the placement handed to the layers below.
    """

    name: str = field(default=MANAGED_NODE_GROUPS, init=False)

    def provision(self, target: NodeTarget, opts: pulumi.ResourceOptions | None = None) -> ProvisionedNodes:
        """The system group first, then the GPU groups in config order."""
        groups = {self.system.group: self._node_group(self.system, self.settings.system, target, opts)}
        for settings in self.settings.gpu:
            groups[settings.name] = self._node_group(self.gpu[settings.name], settings, target, opts)
        return ProvisionedNodes(
            names={group: node_group.name for group, node_group in groups.items()},
            ready=list(groups.values()),
        )

    @staticmethod
    def _node_group(
        placement: Placement,
        settings: NodeGroupSettings,
        target: NodeTarget,
        opts: pulumi.ResourceOptions | None,
    ) -> NodeGroup:
        return NodeGroup(
            f"nodes-{placement.group}",
            NodeGroupArgs(
                cluster_name=target.cluster_name,
                kubernetes_version=target.kubernetes_version,
                config=settings,
                placement=placement,
                node_role_arn=target.node_role_arn,
                subnet_ids=target.subnet_ids,
                tags=target.tags,
            ),
            opts=opts,
        )


@dataclass(frozen=True)
class KarpenterNodePools(_Placements):
    """The system nodes as a managed node group; GPU nodes launched by Karpenter.

    The AWS side is a KarpenterController component (its role, the nodes'
    role, the interruption queue); the NodePools and EC2NodeClasses that
    carry each GPU placement are in-cluster objects the platform layer
    makes from the same placements (infra/cluster_services/karpenter.py).
    Nothing here makes GPU capacity ahead of pods asking for it.
    """

    name: str = field(default=KARPENTER, init=False)

    def provision(self, target: NodeTarget, opts: pulumi.ResourceOptions | None = None) -> ProvisionedNodes:
        """The system group, then Karpenter's controller identity and interruption queue."""
        system = ManagedNodeGroups._node_group(self.system, self.settings.system, target, opts)
        if target.security_group_id is None:
            raise ValueError("Karpenter needs the nodes' security group id (NodeTarget.security_group_id)")
        controller = KarpenterController(
            "karpenter",
            KarpenterControllerArgs(
                cluster_name=target.cluster_name,
                region=target.region,
                subnet_ids=target.subnet_ids,
                security_group_id=target.security_group_id,
                tags=target.tags,
            ),
            opts=opts,
        )
        return ProvisionedNodes(
            names={self.system.group: system.name}, ready=[system, controller], karpenter=controller.access
        )


# `cluster.node_provisioner` -> the provisioner it selects.
PROVISIONERS: dict[str, Callable[[StackConfig], NodeProvisioner]] = {
    MANAGED_NODE_GROUPS: ManagedNodeGroups.from_config,
    KARPENTER: KarpenterNodePools.from_config,
}


def node_provisioner(cfg: StackConfig) -> NodeProvisioner:
    """The provisioner `cluster.node_provisioner` selects (Karpenter when the setting is absent)."""
    selected: str = cfg.cluster.node_provisioner
    if selected not in PROVISIONERS:
        raise ValueError(f"cluster.node_provisioner: '{selected}' is not one of {sorted(PROVISIONERS)}")
    return PROVISIONERS[selected](cfg)
