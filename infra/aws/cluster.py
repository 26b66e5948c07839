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


def admin_access_entries(
    principal_arns: Sequence[str], partition: pulumi.Output[str]
) -> dict[str, eks.AccessEntryArgs]:
    """Cluster-admin access entries, one per configured principal (`admin-<i>`)."""
    admin_policy = partition.apply(lambda p: f"arn:{p}:eks::aws:cluster-access-policy/{CLUSTER_ADMIN_POLICY}")
    return {
        f"admin-{i}": eks.AccessEntryArgs(
            principal_arn=arn,
            type=eks.AccessEntryType.STANDARD,
            access_policies={
                "cluster-admin": eks.AccessPolicyAssociationArgs(
                    policy_arn=admin_policy,
                    access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="cluster"),
                )
            },
        )
        for i, arn in enumerate(principal_arns)
    }


class EksCluster(pulumi.ComponentResource):
    """An EKS cluster with no default node group.

    Authentication mode API: who may administer the cluster is a list of
    access entries in config, not an aws-auth ConfigMap. Kubernetes Secrets
    are envelope-encrypted with a KMS key of the cluster's own (rotated
    yearly). Nodes come from the node provisioner (infra/aws/provisioning.py),
    which uses the node role made here.
    """

    name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    node_security_group_id: pulumi.Output[str]
    node_role: aws.iam.Role
    node_role_policies: list[aws.iam.RolePolicyAttachment]
    node_addons: EksAddons

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:Cluster", name, None, opts)
        cfg = args.cluster
        partition = aws.get_partition_output().partition
        self.secrets_key = self._secrets_key(name, cfg.name, args.tags)
        self.node_role = self._node_role(name, cfg.name, args.tags)
        self.node_role_policies = self._node_role_policies(name, partition)
        self.cluster = self._control_plane(name, args, admin_access_entries(cfg.admin_principal_arns, partition))
        # The configured name, carrying the dependency on the cluster so
        # everything keyed by it waits for the control plane.
        self.name = self.cluster.urn.apply(lambda _: cfg.name)
        self.kubeconfig = pulumi.Output.secret(self.cluster.kubeconfig_json)
        self.node_security_group_id = self.cluster.node_security_group_id
        self.node_addons = EksAddons(
            f"{name}-node-addons",
            AddonsArgs(cluster_name=self.name, names=NODE_ADDONS),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster]),
        )
        self.register_outputs(
            {
                "name": self.name,
                "kubeconfig": self.kubeconfig,
                "node_security_group_id": self.node_security_group_id,
                "node_role_arn": self.node_role.arn,
            }
        )

    def _secrets_key(self, name: str, cluster: str, tags: dict[str, str]) -> aws.kms.Key:
        """The KMS key (and its alias) that envelope-encrypts the cluster's Secrets."""
        child = pulumi.ResourceOptions(parent=self)
        key = aws.kms.Key(
            f"{name}-secrets",
            description=f"Envelope encryption of Kubernetes Secrets in EKS cluster {cluster}",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=tags,
            opts=child,
        )
        aws.kms.Alias(f"{name}-secrets", name=f"alias/eks/{cluster}-secrets", target_key_id=key.key_id, opts=child)
        return key

    def _node_role(self, name: str, cluster: str, tags: dict[str, str]) -> aws.iam.Role:
        """The EC2 instance role every node of the cluster runs with.

        EKS creates the nodes' access entries for it when a managed node
        group uses it.
        """
        return aws.iam.Role(
            f"{name}-node",
            description=f"EC2 instance role of the nodes of EKS cluster {cluster}",
            assume_role_policy=pulumi.Output.json_dumps(policies.service_trust("ec2.amazonaws.com")),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _node_role_policies(self, name: str, partition: pulumi.Output[str]) -> list[aws.iam.RolePolicyAttachment]:
        """The AWS managed policies a node needs to join, pull images and run the VPC CNI."""
        return [
            aws.iam.RolePolicyAttachment(
                f"{name}-node-{policy}",
                role=self.node_role.name,
                policy_arn=partition.apply(functools.partial(policies.aws_managed_policy_arn, name=policy)),
                opts=pulumi.ResourceOptions(parent=self),
            )
            for policy in NODE_MANAGED_POLICIES
        ]

    def _control_plane(
        self, name: str, args: ClusterArgs, access_entries: dict[str, eks.AccessEntryArgs]
    ) -> eks.Cluster:
        """The pulumi-eks cluster: API authentication, encrypted Secrets, no node group or add-on of its own."""
        cfg = args.cluster
        return eks.Cluster(
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
            opts=pulumi.ResourceOptions(parent=self),
        )
