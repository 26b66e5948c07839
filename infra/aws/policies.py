"""IAM policy documents, as plain functions of the ARNs they name.

Kept free of Pulumi so each document can be read and tested as data. Every
statement names the resources it needs; `*` appears only for actions that
have no resource-level permissions (Describe*/List* calls), and then only
with a condition where IAM offers one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

Policy = dict[str, Any]
VERSION = "2012-10-17"

# The tag EKS puts on a managed node group's Auto Scaling group, and that
# the cluster-autoscaler's auto-discovery looks for.
AUTOSCALER_ENABLED_TAG = "k8s.io/cluster-autoscaler/enabled"
EBS_CSI_MANAGED_POLICY = "arn:{partition}:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"

# The AWS load balancer controller's policy, kept as data beside this module
# (it is long, and a reviewer compares it with upstream's statement by
# statement). Its action set follows upstream's published policy for the
# pinned controller version: docs/install/iam_policy.json of
# kubernetes-sigs/aws-load-balancer-controller at
# LOAD_BALANCER_CONTROLLER_POLICY_VERSION, the chart version pinned in
# infra/versions.py (a test holds the two together). It is narrowed, not
# copied:
# - every ARN names this partition, region and account (`${partition}`,
#   `${region}`, `${account}` are filled in by load_balancer_controller);
# - every create, change and delete requires the tag the controller puts
#   on what it creates, `elbv2.k8s.aws/cluster`, to equal this cluster's
#   name (`${cluster}`): upstream only requires the tag to exist, which lets
#   one cluster's controller change another's load balancers;
# - the one untagged security group the controller may open to its load
#   balancers (NodeSecurityGroupRules) is the nodes' group
#   (`${node_security_group}`) when it is known;
# - listeners and rules carry no controller tag of their own; they are
#   reached through the load balancers they belong to (ListenersAndRules);
# - no WAF, WAF Regional or Shield calls: those act on any web ACL and
#   protection of the account (`*`), only ALBs use them, and the platform
#   serves through NLBs; the chart switches the three add-ons off
#   (infra/cluster_services/load_balancer.py ADDONS_OFF) so the controller
#   never makes those calls.
LOAD_BALANCER_CONTROLLER_POLICY_VERSION = "3.5.0"
LOAD_BALANCER_CONTROLLER_POLICY_FILE = Path(__file__).with_name("load_balancer_controller_policy.json")
LOAD_BALANCER_CONTROLLER_POLICY: Policy = json.loads(LOAD_BALANCER_CONTROLLER_POLICY_FILE.read_text())


def autoscaler_cluster_tag(cluster: str) -> str:
    """The ASG tag that says a group belongs to `cluster` (value `owned`)."""
    return f"k8s.io/cluster-autoscaler/{cluster}"


def _doc(*statements: Policy) -> Policy:
    return {"Version": VERSION, "Statement": list(statements)}


def _fill(template: Any, values: Mapping[str, str]) -> Any:
    """A copy of a policy template with every `${name}` replaced; an unknown name raises KeyError."""
    if isinstance(template, dict):
        return {_fill(k, values): _fill(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, values) for v in template]
    if isinstance(template, str):
        return Template(template).substitute(values)
    return template


def aws_managed_policy_arn(partition: str, name: str) -> str:
    """The ARN of an AWS managed policy (`AmazonEKSWorkerNodePolicy`, `service-role/...`)."""
    return f"arn:{partition}:iam::aws:policy/{name}"


def pod_identity_trust(account: str, cluster: str, namespace: str, service_account: str) -> Policy:
    """Lets EKS Pod Identity assume the role for one service account of one cluster.

    Pod Identity passes the cluster, namespace and service account as session
    tags; matching them here means no other association in the account (another
    cluster, another namespace) can borrow the role.
    """
    return _doc(
        {
            "Sid": "EksPodIdentity",
            "Effect": "Allow",
            "Principal": {"Service": "pods.eks.amazonaws.com"},
            "Action": ["sts:AssumeRole", "sts:TagSession"],
            "Condition": {
                "StringEquals": {
                    "aws:SourceAccount": account,
                    "aws:RequestTag/eks-cluster-name": cluster,
                    "aws:RequestTag/kubernetes-namespace": namespace,
                    "aws:RequestTag/kubernetes-service-account": service_account,
                }
            },
        }
    )


def service_trust(service: str) -> Policy:
    """Lets an AWS service (EC2 for nodes) assume the role."""
    return _doc(
        {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"},
    )


def model_reader(bucket_arn: str, prefixes: Iterable[str], kms_key_arn: str, region: str) -> Policy:
    """Read-only access to the models' prefixes of the model bucket.

    GetObject on `<bucket>/<prefix>/*` for each served model, ListBucket on
    the bucket limited to those prefixes, and Decrypt on the bucket's key
    only when S3 asks for it on the reader's behalf.
    """
    prefixes = sorted(set(prefixes))
    statements: list[Policy] = []
    if prefixes:
        statements.append(
            {
                "Sid": "ReadModelObjects",
                "Effect": "Allow",
                "Action": ["s3:GetObject"],
                "Resource": [f"{bucket_arn}/{p}/*" for p in prefixes],
            }
        )
        statements.append(
            {
                "Sid": "ListModelPrefixes",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [bucket_arn],
                "Condition": {"StringLike": {"s3:prefix": [x for p in prefixes for x in (p, f"{p}/*")]}},
            }
        )
    statements.append(
        {
            "Sid": "DecryptModelObjects",
            "Effect": "Allow",
            "Action": ["kms:Decrypt"],
            "Resource": [kms_key_arn],
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
        }
    )
    return _doc(*statements)


def cluster_autoscaler(partition: str, region: str, account: str, cluster: str) -> Policy:
    """Scale only this cluster's Auto Scaling groups.

    The Describe calls have no resource-level permissions (IAM requires `*`);
    the two calls that change capacity are limited to groups tagged as this
    cluster's, and DescribeNodegroup (labels and taints for scale from zero)
    to this cluster's node groups.
    """
    return _doc(
        {
            "Sid": "Discover",
            "Effect": "Allow",
            "Action": [
                "autoscaling:DescribeAutoScalingGroups",
                "autoscaling:DescribeAutoScalingInstances",
                "autoscaling:DescribeLaunchConfigurations",
                "autoscaling:DescribeScalingActivities",
                "autoscaling:DescribeTags",
                "ec2:DescribeImages",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplateVersions",
                "ec2:GetInstanceTypesFromInstanceRequirements",
            ],
            "Resource": "*",
        },
        {
            "Sid": "DescribeOwnNodeGroups",
            "Effect": "Allow",
            "Action": ["eks:DescribeNodegroup"],
            "Resource": f"arn:{partition}:eks:{region}:{account}:nodegroup/{cluster}/*/*",
        },
        {
            "Sid": "ScaleOwnGroups",
            "Effect": "Allow",
            "Action": ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
            "Resource": f"arn:{partition}:autoscaling:{region}:{account}:autoScalingGroup:*:autoScalingGroupName/*",
            "Condition": {
                "StringEquals": {f"aws:ResourceTag/{autoscaler_cluster_tag(cluster)}": "owned"},
            },
        },
    )


def load_balancer_controller(
    partition: str, region: str, account: str, cluster: str, node_security_group_id: str | None = None
) -> Policy:
    """What the AWS load balancer controller (v3.5) calls, scoped to this cluster.

    The document is LOAD_BALANCER_CONTROLLER_POLICY (see there for where it
    comes from and how it is narrowed) with this cluster's partition,
    region, account and name filled in. The nodes' security group, when
    known, is the only untagged group the controller may open to its load
    balancers (the controller does not tag that group); otherwise any group
    of the account and region.
    """
    filled: Policy = _fill(
        LOAD_BALANCER_CONTROLLER_POLICY,
        {
            "partition": partition,
            "region": region,
            "account": account,
            "cluster": cluster,
            "node_security_group": node_security_group_id or "*",
        },
    )
    return filled


def kms_grants_for_ebs(key_arn: str, region: str) -> Policy:
    """Lets the EBS CSI driver encrypt volumes with a customer key (storage class key)."""
    return _doc(
        {
            "Sid": "EbsVolumeKey",
            "Effect": "Allow",
            "Action": [
                "kms:Encrypt",
                "kms:Decrypt",
                "kms:ReEncrypt*",
                "kms:GenerateDataKey*",
                "kms:DescribeKey",
                "kms:CreateGrant",
            ],
            "Resource": [key_arn],
            "Condition": {"StringEquals": {"kms:ViaService": f"ec2.{region}.amazonaws.com"}},
        }
    )


def bucket_tls_only(bucket_arn: str) -> Policy:
    """Denies every request to the bucket that does not come over TLS."""
    return _doc(
        {
            "Sid": "DenyInsecureTransport",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:*",
            "Resource": [bucket_arn, f"{bucket_arn}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }
    )


# What replaces or removes an object's content: a write (every part of a
# multipart upload is authorized as PutObject), a delete, a delete of one
# version (in a versioned bucket that brings an older object back), and the
# writes S3 replication makes on a replication role's behalf.
OBJECT_WRITES = (
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:DeleteObjectVersion",
    "s3:ReplicateObject",
    "s3:ReplicateDelete",
)


def private_bucket(bucket_arn: str, writers: Sequence[str] = ()) -> Policy:
    """The policy of a private bucket: TLS only and, when `writers` are named, writes by them alone.

    With writers, every principal whose `aws:PrincipalArn` (a role session's
    role, a user, the account root) is not one of them is denied
    OBJECT_WRITES, whatever its own IAM policies grant: `s3:PutObject` on
    `*` in some role of the account no longer replaces the weights. Reads
    are untouched (the model reader's role grants them), and so is the
    bucket's configuration, policy included: an administrator who may
    change the policy can always change who writes.
    """
    document = bucket_tls_only(bucket_arn)
    if writers:
        document["Statement"].append(
            {
                "Sid": "DenyObjectWritesByOthers",
                "Effect": "Deny",
                "Principal": "*",
                "Action": list(OBJECT_WRITES),
                "Resource": f"{bucket_arn}/*",
                "Condition": {"ArnNotEquals": {"aws:PrincipalArn": sorted(set(writers))}},
            }
        )
    return document


def batch_worker(queue_arn: str, results_bucket_arn: str, results_prefix: str) -> Policy:
    """What a batch worker does: take requests from its queue and write answers under the results prefix.

    No SendMessage (workers never enqueue) and no read of results (clients
    read them with their own credentials). The queues use SQS-managed
    encryption, so no KMS permission is needed.
    """
    return _doc(
        {
            "Sid": "ConsumeBatchRequests",
            "Effect": "Allow",
            "Action": [
                "sqs:ReceiveMessage",
                "sqs:DeleteMessage",
                "sqs:ChangeMessageVisibility",
                "sqs:GetQueueAttributes",
            ],
            "Resource": [queue_arn],
        },
        {
            "Sid": "WriteBatchResults",
            "Effect": "Allow",
            "Action": ["s3:PutObject"],
            "Resource": [f"{results_bucket_arn}/{results_prefix}*"],
        },
    )


def external_dns(partition: str, hosted_zone_id: str) -> Policy:
    """external-dns: change records in the one hosted zone only.

    The calls it makes to find zones and read their records and tags
    (ListHostedZones, ListResourceRecordSets, ListTagsForResources) are
    granted on `*` as upstream's AWS tutorial grants them; only
    ChangeResourceRecordSets writes, and it names this zone.
    """
    return _doc(
        {
            "Sid": "ChangeRecordsInTheZone",
            "Effect": "Allow",
            "Action": ["route53:ChangeResourceRecordSets"],
            "Resource": [f"arn:{partition}:route53:::hostedzone/{hosted_zone_id}"],
        },
        {
            "Sid": "ListZonesAndRecords",
            "Effect": "Allow",
            "Action": ["route53:ListHostedZones", "route53:ListResourceRecordSets", "route53:ListTagsForResources"],
            "Resource": ["*"],
        },
    )


def queue_length_reader(*queue_arns: str) -> Policy:
    """KEDA's operator: read the queues' message counts (the request and dead-letter queues), nothing else."""
    return _doc(
        {
            "Sid": "ReadBatchQueueLength",
            "Effect": "Allow",
            "Action": ["sqs:GetQueueAttributes"],
            "Resource": list(queue_arns),
        }
    )


def queue_tls_only(queue_arn: str) -> Policy:
    """Denies every request to the queue that does not come over TLS."""
    return _doc(
        {
            "Sid": "DenyInsecureTransport",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "sqs:*",
            "Resource": queue_arn,
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }
    )


# The tags Karpenter puts on what it launches (instances, volumes, network
# interfaces, launch templates, fleets) and on the instance profiles it
# makes, and that its controller's permissions are conditioned on.
KARPENTER_NODEPOOL_TAG = "karpenter.sh/nodepool"
KARPENTER_NODECLASS_TAG = "karpenter.k8s.aws/ec2nodeclass"
# Who may own the images Karpenter launches from. The EC2NodeClasses take
# their AMIs by alias only (infra/versions.py KARPENTER_AMI_ALIASES: the
# EKS-optimized AL2023 and Bottlerocket releases), and Amazon owns those.
KARPENTER_IMAGE_OWNERS: tuple[str, ...] = ("amazon",)
# The statement that carries upstream's image grant of
# AllowScopedEC2InstanceAccessActions, split off to hold its owner condition.
KARPENTER_IMAGE_SID = "AllowAmazonImagesForInstanceAccessActions"
KARPENTER_SPLIT_FROM: dict[str, str] = {KARPENTER_IMAGE_SID: "AllowScopedEC2InstanceAccessActions"}


@dataclass(frozen=True)
class KarpenterLaunchTargets:
    """Where Karpenter's EC2NodeClasses put nodes: the subnets and security groups they select by id."""

    subnet_ids: Sequence[str]
    security_group_ids: Sequence[str]

    def __post_init__(self) -> None:
        # An empty list would leave RunInstances without a subnet or group it may use.
        if not self.subnet_ids or not self.security_group_ids:
            raise ValueError("Karpenter's launch targets need at least one subnet and one security group")


def _karpenter_owned(cluster: str) -> tuple[dict[str, str], dict[str, str], dict[str, str], dict[str, str]]:
    """The tag conditions: on an existing resource (owned, nodepool) and on a request (requested, nodepool)."""
    return (
        {f"aws:ResourceTag/kubernetes.io/cluster/{cluster}": "owned"},
        {f"aws:ResourceTag/{KARPENTER_NODEPOOL_TAG}": "*"},
        {f"aws:RequestTag/kubernetes.io/cluster/{cluster}": "owned", "aws:RequestTag/eks:eks-cluster-name": cluster},
        {f"aws:RequestTag/{KARPENTER_NODEPOOL_TAG}": "*"},
    )


def _karpenter_created(ec2: str) -> list[str]:
    """What Karpenter's launches create, in this account and region."""
    kinds = ("fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request")
    return [f"{ec2}:{kind}/*" for kind in kinds]


def _arns(ec2: str, kind: str, ids: Sequence[str]) -> list[str]:
    return [f"{ec2}:{kind}/{i}" for i in ids]


def _karpenter_node_lifecycle(ec2: str, cluster: str, launch: KarpenterLaunchTargets) -> list[Policy]:
    """Launch, tag and terminate only what carries this cluster's ownership tags.

    Upstream lets a launch use any image, subnet and security group of the
    region. Ours names the subnets and the security group the EC2NodeClasses
    select by id, and takes images from Amazon only (a separate statement:
    the condition key `ec2:Owner` is on images, and the images' snapshots
    stay as upstream has them, since a snapshot alone launches nothing).
    """
    owned, nodepool, requested, requested_nodepool = _karpenter_owned(cluster)
    created = _karpenter_created(ec2)
    region_wide = ec2.rsplit(":", 1)[0] + ":"  # arn:<partition>:ec2:<region>: (images and snapshots have no account)
    return [
        {
            "Sid": "AllowScopedEC2InstanceAccessActions",
            "Effect": "Allow",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
            "Resource": [
                f"{region_wide}:snapshot/*",
                *_arns(ec2, "security-group", launch.security_group_ids),
                *_arns(ec2, "subnet", launch.subnet_ids),
                *(f"{ec2}:{kind}/*" for kind in ("capacity-reservation", "placement-group")),
            ],
        },
        {
            "Sid": KARPENTER_IMAGE_SID,
            "Effect": "Allow",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
            "Resource": f"{region_wide}:image/*",
            "Condition": {"StringEquals": {"ec2:Owner": list(KARPENTER_IMAGE_OWNERS)}},
        },
        {
            "Sid": "AllowScopedEC2LaunchTemplateAccessActions",
            "Effect": "Allow",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
            "Resource": f"{ec2}:launch-template/*",
            "Condition": {"StringEquals": owned, "StringLike": nodepool},
        },
        {
            "Sid": "AllowScopedEC2InstanceActionsWithTags",
            "Effect": "Allow",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"],
            "Resource": created,
            "Condition": {"StringEquals": requested, "StringLike": requested_nodepool},
        },
        *_karpenter_tagging_and_deletion(ec2, cluster),
    ]


def _karpenter_tagging_and_deletion(ec2: str, cluster: str) -> list[Policy]:
    """Tag what a launch creates and name its instances; delete only this cluster's instances and templates."""
    owned, nodepool, requested, requested_nodepool = _karpenter_owned(cluster)
    return [
        {
            "Sid": "AllowScopedResourceCreationTagging",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": _karpenter_created(ec2),
            "Condition": {
                "StringEquals": {
                    **requested,
                    "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"],
                },
                "StringLike": requested_nodepool,
            },
        },
        {
            "Sid": "AllowScopedResourceTagging",
            "Effect": "Allow",
            "Action": "ec2:CreateTags",
            "Resource": f"{ec2}:instance/*",
            "Condition": {
                "StringEquals": owned,
                "StringLike": nodepool,
                "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster},
                "ForAllValues:StringEquals": {
                    "aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
                },
            },
        },
        {
            "Sid": "AllowScopedDeletion",
            "Effect": "Allow",
            "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
            "Resource": [f"{ec2}:instance/*", f"{ec2}:launch-template/*"],
            "Condition": {"StringEquals": owned, "StringLike": nodepool},
        },
    ]


def _karpenter_iam_integration(profiles: str, region: str, cluster: str, node_role_arn: str) -> list[Policy]:
    """Pass the nodes' role to EC2, and manage only instance profiles tagged for this cluster and region."""
    owned = {
        f"aws:ResourceTag/kubernetes.io/cluster/{cluster}": "owned",
        "aws:ResourceTag/topology.kubernetes.io/region": region,
    }
    requested = {
        f"aws:RequestTag/kubernetes.io/cluster/{cluster}": "owned",
        "aws:RequestTag/eks:eks-cluster-name": cluster,
        "aws:RequestTag/topology.kubernetes.io/region": region,
    }
    return [
        {
            "Sid": "AllowPassingInstanceRole",
            "Effect": "Allow",
            "Action": "iam:PassRole",
            "Resource": node_role_arn,
            "Condition": {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com", "ec2.amazonaws.com.cn"]}},
        },
        {
            "Sid": "AllowScopedInstanceProfileCreationActions",
            "Effect": "Allow",
            "Action": ["iam:CreateInstanceProfile"],
            "Resource": profiles,
            "Condition": {"StringEquals": requested, "StringLike": {f"aws:RequestTag/{KARPENTER_NODECLASS_TAG}": "*"}},
        },
        {
            "Sid": "AllowScopedInstanceProfileTagActions",
            "Effect": "Allow",
            "Action": ["iam:TagInstanceProfile"],
            "Resource": profiles,
            "Condition": {
                "StringEquals": {**owned, **requested},
                "StringLike": {
                    f"aws:ResourceTag/{KARPENTER_NODECLASS_TAG}": "*",
                    f"aws:RequestTag/{KARPENTER_NODECLASS_TAG}": "*",
                },
            },
        },
        {
            "Sid": "AllowScopedInstanceProfileActions",
            "Effect": "Allow",
            "Action": [
                "iam:AddRoleToInstanceProfile",
                "iam:RemoveRoleFromInstanceProfile",
                "iam:DeleteInstanceProfile",
            ],
            "Resource": profiles,
            "Condition": {"StringEquals": owned, "StringLike": {f"aws:ResourceTag/{KARPENTER_NODECLASS_TAG}": "*"}},
        },
    ]


def _karpenter_resource_discovery(partition: str, region: str, account: str) -> list[Policy]:
    """The read calls Karpenter makes to pick instance types, images, subnets and prices."""
    return [
        {
            "Sid": "AllowRegionalReadActions",
            "Effect": "Allow",
            "Action": [
                "ec2:DescribeCapacityReservations",
                "ec2:DescribeImages",
                "ec2:DescribeInstances",
                "ec2:DescribeInstanceStatus",
                "ec2:DescribeInstanceTypeOfferings",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplates",
                "ec2:DescribePlacementGroups",
                "ec2:DescribeSecurityGroups",
                "ec2:DescribeSpotPriceHistory",
                "ec2:DescribeSubnets",
            ],
            "Resource": "*",
            "Condition": {"StringEquals": {"aws:RequestedRegion": region}},
        },
        {
            "Sid": "AllowSSMReadActions",
            "Effect": "Allow",
            "Action": "ssm:GetParameter",
            "Resource": f"arn:{partition}:ssm:{region}::parameter/aws/service/*",
        },
        {"Sid": "AllowPricingReadActions", "Effect": "Allow", "Action": "pricing:GetProducts", "Resource": "*"},
        {
            "Sid": "AllowUnscopedInstanceProfileListAction",
            "Effect": "Allow",
            "Action": "iam:ListInstanceProfiles",
            "Resource": "*",
        },
        {
            "Sid": "AllowInstanceProfileReadActions",
            "Effect": "Allow",
            "Action": "iam:GetInstanceProfile",
            "Resource": f"arn:{partition}:iam::{account}:instance-profile/*",
        },
    ]


def karpenter_controller(
    partition: str,
    region: str,
    account: str,
    cluster: str,
    queue_arn: str,
    node_role_arn: str,
    launch: KarpenterLaunchTargets,
) -> dict[str, Policy]:
    """The Karpenter controller's permissions, one document per upstream managed policy.

    The statements follow the six `KarpenterController<X>Policy` documents of
    Karpenter's getting-started CloudFormation at the pinned version
    (infra/versions.py KARPENTER; a test compares them statement by
    statement), narrowed: every EC2 ARN names this account instead of `*`,
    PassRole names the one role Karpenter's nodes run with, the queue
    actions name the one interruption queue, and a launch may use only the
    subnets and security groups of `launch` and Amazon's images (one
    upstream statement split in two: KARPENTER_SPLIT_FROM). Kept as separate documents
    because, like upstream, they are managed policies: a role's inline
    policies share one 10,240-character limit that these would exceed.
    """
    ec2 = f"arn:{partition}:ec2:{region}:{account}"
    cluster_arn = f"arn:{partition}:eks:{region}:{account}:cluster/{cluster}"
    profiles = f"arn:{partition}:iam::{account}:instance-profile/*"
    return {
        "NodeLifecycle": _doc(*_karpenter_node_lifecycle(ec2, cluster, launch)),
        "IAMIntegration": _doc(*_karpenter_iam_integration(profiles, region, cluster, node_role_arn)),
        "EKSIntegration": _doc(
            {
                "Sid": "AllowAPIServerEndpointDiscovery",
                "Effect": "Allow",
                "Action": "eks:DescribeCluster",
                "Resource": cluster_arn,
            }
        ),
        "Interruption": _doc(
            {
                "Sid": "AllowInterruptionQueueActions",
                "Effect": "Allow",
                "Action": ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
                "Resource": queue_arn,
            }
        ),
        "ZonalShift": _doc(
            {
                "Sid": "AllowZonalShiftStatusReadOnly",
                "Effect": "Allow",
                "Action": ["arc-zonal-shift:GetManagedResource"],
                "Resource": "*",
                "Condition": {"StringEquals": {"arc-zonal-shift:ResourceIdentifier": cluster_arn}},
            }
        ),
        "ResourceDiscovery": _doc(*_karpenter_resource_discovery(partition, region, account)),
    }


def karpenter_interruption_queue(queue_arn: str, account: str, rule_arns: Sequence[str]) -> Policy:
    """Only this stack's EventBridge rules may send to the interruption queue; nothing may use it without TLS.

    Upstream lets the EventBridge and SQS services send without a condition,
    so a rule in any account could feed Karpenter forged interruption
    warnings (and have it drain nodes). Here the sender must be EventBridge
    acting for one of the rules that feed the queue, in this account
    (`aws:SourceArn`, `aws:SourceAccount`: the confused-deputy conditions
    AWS documents for service principals).
    """
    tls_only: Policy = queue_tls_only(queue_arn)["Statement"][0]
    return {
        "Version": VERSION,
        "Id": "EC2InterruptionPolicy",
        "Statement": [
            {
                "Sid": "InterruptionEvents",
                "Effect": "Allow",
                "Principal": {"Service": "events.amazonaws.com"},
                "Action": "sqs:SendMessage",
                "Resource": queue_arn,
                "Condition": {
                    "StringEquals": {"aws:SourceAccount": account},
                    "ArnEquals": {"aws:SourceArn": sorted(rule_arns)},
                },
            },
            tls_only,
        ],
    }
