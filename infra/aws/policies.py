"""IAM policy documents, as plain functions of the ARNs they name.

Kept free of Pulumi so each document can be read and tested as data. Every
statement names the resources it needs; `*` appears only for actions that
have no resource-level permissions (Describe*/List* calls), and then only
with a condition where IAM offers one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
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
#   reached through the load balancers they belong to (ListenersAndRules).
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
