"""The EKS control plane: pulumi-eks Cluster with API access entries and KMS secrets encryption."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks

from infra.aws import policies
from infra.aws.addons import AddonsArgs, EksAddons
from infra.config import Cluster

# Add-ons a node needs before it can join and run pods; the rest are
# installed after the node groups (see EksAddons).
NODE_ADDONS = ("vpc-cni", "kube-proxy", "eks-pod-identity-agent")
WORKLOAD_ADDONS = ("coredns", "aws-ebs-csi-driver")

CLUSTER_ADMIN_POLICY = "AmazonEKSClusterAdminPolicy"
NODE_MANAGED_POLICIES = (
    "AmazonEKSWorkerNodePolicy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonEKS_CNI_Policy",
)


@dataclass(frozen=True)
class ClusterArgs:
    """The cluster's config and the VPC it runs in."""

    cluster: Cluster
    vpc_id: pulumi.Input[str]
    private_subnet_ids: pulumi.Input[Sequence[str]]
    public_subnet_ids: pulumi.Input[Sequence[str]]
    tags: dict[str, str] = field(default_factory=dict)


def _aws_managed_policy(partition: str, name: str) -> str:
    return f"arn:{partition}:iam::aws:policy/{name}"


class EksCluster(pulumi.ComponentResource):
    """An EKS cluster with no default node group.

    Authentication mode API: who may administer the cluster is a list of
    access entries in config, not an aws-auth ConfigMap. Kubernetes Secrets
    are envelope-encrypted with a KMS key of the cluster's own (rotated
    yearly). Nodes come from the NodeGroup components, which share the node
    role made here.
    """

    name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    node_security_group_id: pulumi.Output[str]
    node_role: aws.iam.Role

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:Cluster", name, None, opts)
        cfg = args.cluster
        child = pulumi.ResourceOptions(parent=self)

        self.secrets_key = aws.kms.Key(
            f"{name}-secrets",
            description=f"Envelope encryption of Kubernetes Secrets in EKS cluster {cfg.name}",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=args.tags,
            opts=child,
        )
        aws.kms.Alias(
            f"{name}-secrets",
            name=f"alias/eks/{cfg.name}-secrets",
            target_key_id=self.secrets_key.key_id,
            opts=child,
        )

        # One role for every managed node group; EKS creates the nodes' access
        # entries for it when a managed node group uses it.
        self.node_role = aws.iam.Role(
            f"{name}-node",
            description=f"EC2 instance role of the nodes of EKS cluster {cfg.name}",
            assume_role_policy=pulumi.Output.json_dumps(policies.service_trust("ec2.amazonaws.com")),
            tags=args.tags,
            opts=child,
        )
        partition = aws.get_partition_output().partition
        self.node_role_policies = [
            aws.iam.RolePolicyAttachment(
                f"{name}-node-{policy}",
                role=self.node_role.name,
                policy_arn=partition.apply(functools.partial(_aws_managed_policy, name=policy)),
                opts=child,
            )
            for policy in NODE_MANAGED_POLICIES
        ]

        access_entries = {
            f"admin-{i}": eks.AccessEntryArgs(
                principal_arn=arn,
                type=eks.AccessEntryType.STANDARD,
                access_policies={
                    "cluster-admin": eks.AccessPolicyAssociationArgs(
                        policy_arn=partition.apply(
                            lambda p: f"arn:{p}:eks::aws:cluster-access-policy/{CLUSTER_ADMIN_POLICY}"
                        ),
                        access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="cluster"),
                    )
                },
            )
            for i, arn in enumerate(cfg.admin_principal_arns)
        }

        self.cluster = eks.Cluster(
            name,
            name=cfg.name,
            version=cfg.kubernetes_version,
            vpc_id=args.vpc_id,
            private_subnet_ids=args.private_subnet_ids,
            public_subnet_ids=args.public_subnet_ids,
            node_associate_public_ip_address=False,
            skip_default_node_group=True,
            # Managed node groups get the security group EKS creates for the
            # cluster; pulumi-eks' extra groups would only apply to
            # self-managed nodes.
            skip_default_security_groups=True,
            authentication_mode=eks.AuthenticationMode.API,
            access_entries=access_entries,
            enabled_cluster_log_types=list(cfg.log_types),
            endpoint_private_access=cfg.endpoint_private_access,
            endpoint_public_access=cfg.endpoint_public_access,
            public_access_cidrs=[str(c) for c in cfg.public_access_cidrs] if cfg.endpoint_public_access else None,
            encryption_config_key_arn=self.secrets_key.arn,
            # Pods get AWS credentials from EKS Pod Identity, not IRSA.
            create_oidc_provider=False,
            # Every core add-on is an EKS managed add-on at a pinned version
            # (EksAddons), so neither EKS nor pulumi-eks installs its own copy.
            bootstrap_self_managed_addons=False,
            use_default_vpc_cni=True,
            coredns_addon_options=eks.CoreDnsAddonOptionsArgs(enabled=False),
            kube_proxy_addon_options=eks.KubeProxyAddonOptionsArgs(enabled=False),
            tags=args.tags,
            opts=child,
        )
        # The configured name, carrying the dependency on the cluster so
        # everything keyed by it waits for the control plane.
        self.name = self.cluster.urn.apply(lambda _: cfg.name)
        self.kubeconfig = pulumi.Output.secret(self.cluster.kubeconfig_json)
        self.node_security_group_id = self.cluster.node_security_group_id

        self.node_addons = EksAddons(
            f"{name}-node-addons",
            AddonsArgs(cluster_name=self.name, names=NODE_ADDONS, after=[self.cluster]),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs(
            {
                "name": self.name,
                "kubeconfig": self.kubeconfig,
                "node_security_group_id": self.node_security_group_id,
                "node_role_arn": self.node_role.arn,
            }
        )
