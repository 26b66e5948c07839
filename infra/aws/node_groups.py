"""A managed node group with its launch template and cluster-autoscaler node-template tags."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.aws import node_bootstrap, policies
from infra.config import NodeGroupSettings
from infra.instance_types import HOST_IO
from infra.scheduling import GpuPlacement, Placement

AMI_TYPES = {
    "al2023_nvidia": "AL2023_x86_64_NVIDIA",
    "bottlerocket_nvidia": "BOTTLEROCKET_x86_64_NVIDIA",
}
SYSTEM_AMI_TYPE = "AL2023_x86_64_STANDARD"
CAPACITY_TYPES = {"on_demand": "ON_DEMAND", "spot": "SPOT"}
TAINT_EFFECTS = {"NoSchedule": "NO_SCHEDULE", "NoExecute": "NO_EXECUTE", "PreferNoSchedule": "PREFER_NO_SCHEDULE"}

NODE_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"
GPU_RESOURCE = "nvidia.com/gpu"
# A limit of 1 keeps IMDSv2's token from crossing into a pod's network
# namespace: only host-network pods (the VPC CNI, kube-proxy, the EKS Pod
# Identity agent) reach the instance metadata service, so no other pod can
# take the node's role (ECR read on every repository, the CNI's ENI rights).
# Pods get AWS credentials from their own pod identity; the load balancer
# controller and cluster-autoscaler are given their region and VPC instead
# of looking them up.
IMDS_HOP_LIMIT = 1


def node_template_tags(placement: Placement, disk_size_gib: int) -> dict[str, str]:
    """The tags cluster-autoscaler builds a group's node template from.

    With them a group at zero nodes can still be scaled up: the autoscaler
    knows, without a node to look at, that a new node would carry these
    labels and taints and offer these GPUs, so it can tell whether a pending
    pod would fit.
    """
    tags = {f"{NODE_TEMPLATE}/resources/ephemeral-storage": f"{disk_size_gib}Gi"}
    for key, value in sorted(placement.labels.items()):
        tags[f"{NODE_TEMPLATE}/label/{key}"] = value
    for taint in placement.taints:
        tags[f"{NODE_TEMPLATE}/taint/{taint.key}"] = f"{taint.value}:{taint.effect}"
    if isinstance(placement, GpuPlacement):
        tags[f"{NODE_TEMPLATE}/resources/{GPU_RESOURCE}"] = str(placement.gpus_per_node)
    return tags


def autoscaler_tags(cluster: str, placement: Placement, disk_size_gib: int) -> dict[str, str]:
    """Auto-discovery tags (this cluster's group, autoscaling on) plus the node template."""
    return {
        policies.AUTOSCALER_ENABLED_TAG: "true",
        policies.autoscaler_cluster_tag(cluster): "owned",
        **node_template_tags(placement, disk_size_gib),
    }


def has_instance_store(instance_types: Sequence[str]) -> bool:
    """Every type of the group has NVMe instance store (a RAID0 of none fails the bootstrap)."""
    return all(t in HOST_IO and HOST_IO[t].instance_store_gb > 0 for t in instance_types)


def user_data(placement: Placement, instance_types: Sequence[str]) -> str | None:
    """A GPU group's launch template user data (base64): RAID0 on the instance store, SOCI parallel pull."""
    if not isinstance(placement, GpuPlacement):
        return None
    text = node_bootstrap.gpu_user_data(ami_type(placement), has_instance_store(instance_types))
    return base64.b64encode(text.encode()).decode()


def ami_type(placement: Placement) -> str:
    """The EKS AMI type: NVIDIA drivers baked in for GPU groups."""
    if isinstance(placement, GpuPlacement):
        return AMI_TYPES[placement.ami]
    return SYSTEM_AMI_TYPE


@dataclass(frozen=True)
class NodeGroupArgs:
    """One node group: its size and shape from config, its placement from infra/scheduling.py."""

    cluster_name: pulumi.Input[str]
    kubernetes_version: str
    config: NodeGroupSettings
    placement: Placement
    node_role_arn: pulumi.Input[str]
    subnet_ids: pulumi.Input[Sequence[str]]
    tags: dict[str, str] = field(default_factory=dict)


class NodeGroup(pulumi.ComponentResource):
    """An EKS managed node group whose nodes carry exactly the placement's labels and taints.

    Built from aws.eks.NodeGroup and a launch template rather than
    pulumi-eks' ManagedNodeGroup: the launch template is needed anyway
    (IMDSv2 with a hop limit of 1, an encrypted gp3 root volume), access
    entries replace the aws-auth mapping that ManagedNodeGroup adds, and the
    autoscaler's node-template tags must also go on the Auto Scaling group
    that EKS creates, whose name only the node group resource exposes.
    What the group waits for (the add-ons a node needs to turn Ready) is the
    component's `depends_on`.
    """

    name: pulumi.Output[str]
    autoscaling_group: pulumi.Output[str]

    def __init__(self, name: str, args: NodeGroupArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:NodeGroup", name, None, opts)
        self.launch_template = self._launch_template(name, args)
        self.node_group = self._node_group(name, args)
        self.name = self.node_group.node_group_name
        self.autoscaling_group = self.node_group.resources.apply(
            lambda rs: (rs[0].autoscaling_groups[0].name or "") if rs and rs[0].autoscaling_groups else ""
        )
        self._tag_autoscaling_group(name, args)
        self.register_outputs({"name": self.name, "autoscaling_group": self.autoscaling_group})

    def _launch_template(self, name: str, args: NodeGroupArgs) -> aws.ec2.LaunchTemplate:
        """IMDSv2 for the node alone (hop limit 1), encrypted gp3 volumes, the group's name on instances and volumes."""
        group = args.placement.group
        return aws.ec2.LaunchTemplate(
            name,
            description=f"Nodes of node group {group}",
            update_default_version=True,
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled",
                http_tokens="required",
                http_put_response_hop_limit=IMDS_HOP_LIMIT,
                instance_metadata_tags="disabled",
            ),
            block_device_mappings=_volumes(ami_type(args.placement), args.config.disk_size_gib),
            user_data=user_data(args.placement, args.config.instance_types),
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(
                    resource_type=kind, tags={**args.tags, "llm-platform/node-group": group}
                )
                for kind in ("instance", "volume")
            ],
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _node_group(self, name: str, args: NodeGroupArgs) -> aws.eks.NodeGroup:
        """The managed node group: size and instance types from config, labels and taints from the placement."""
        group, placement = args.config, args.placement
        ca_tags = pulumi.Output.from_input(args.cluster_name).apply(
            lambda c: autoscaler_tags(c, placement, group.disk_size_gib)
        )
        return aws.eks.NodeGroup(
            name,
            cluster_name=args.cluster_name,
            # A prefix, not a fixed name: changing instance types or capacity
            # type replaces the group, and the new one must be created while
            # the old one still serves.
            node_group_name_prefix=f"{placement.group}-",
            version=args.kubernetes_version,
            node_role_arn=args.node_role_arn,
            subnet_ids=args.subnet_ids,
            ami_type=ami_type(placement),
            capacity_type=CAPACITY_TYPES[group.capacity_type],
            instance_types=list(group.instance_types),
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=group.min_size, desired_size=group.desired_size, max_size=group.max_size
            ),
            update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
                id=self.launch_template.id, version=self.launch_template.latest_version.apply(str)
            ),
            labels=dict(placement.labels),
            taints=[
                aws.eks.NodeGroupTaintArgs(key=t.key, value=t.value, effect=TAINT_EFFECTS[t.effect])
                for t in placement.taints
            ],
            tags=ca_tags.apply(lambda t: {**args.tags, **t}),
            opts=pulumi.ResourceOptions(
                parent=self,
                # cluster-autoscaler owns the desired size once the group exists.
                ignore_changes=["scalingConfig.desiredSize"],
            ),
        )

    def _tag_autoscaling_group(self, name: str, args: NodeGroupArgs) -> None:
        """Copies the node template onto the Auto Scaling group EKS made for the node group.

        EKS does not copy node group tags to the Auto Scaling group, where
        cluster-autoscaler reads the node template from. (The two discovery
        tags EKS puts on the group itself.)
        """
        for key, value in node_template_tags(args.placement, args.config.disk_size_gib).items():
            aws.autoscaling.Tag(
                f"{name}-{key.removeprefix(NODE_TEMPLATE + '/').replace('/', '-')}",
                autoscaling_group_name=self.autoscaling_group,
                tag=aws.autoscaling.TagTagArgs(key=key, value=value, propagate_at_launch=False),
                opts=pulumi.ResourceOptions(parent=self),
            )


def _volumes(ami: str, disk_size_gib: int) -> list[aws.ec2.LaunchTemplateBlockDeviceMappingArgs]:
    def ebs(size: int | None) -> aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs:
        return aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_size=size, volume_type="gp3", encrypted="true", delete_on_termination="true"
        )

    if ami.startswith("BOTTLEROCKET"):
        # Bottlerocket keeps the OS on xvda and images and pod storage on
        # xvdb: size the data volume, keep the OS volume at the AMI's size.
        return [
            aws.ec2.LaunchTemplateBlockDeviceMappingArgs(device_name="/dev/xvda", ebs=ebs(None)),
            aws.ec2.LaunchTemplateBlockDeviceMappingArgs(device_name="/dev/xvdb", ebs=ebs(disk_size_gib)),
        ]
    return [aws.ec2.LaunchTemplateBlockDeviceMappingArgs(device_name="/dev/xvda", ebs=ebs(disk_size_gib))]
