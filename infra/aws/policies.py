"""IAM policy documents, as plain functions of the ARNs they name.

Kept free of Pulumi so each document can be read and tested as data. Every
statement names the resources it needs; `*` appears only for actions that
have no resource-level permissions (Describe*/List* calls), and then only
with a condition where IAM offers one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Policy = dict[str, Any]
VERSION = "2012-10-17"

# The tag EKS puts on a managed node group's Auto Scaling group, and that
# the cluster-autoscaler's auto-discovery looks for.
AUTOSCALER_ENABLED_TAG = "k8s.io/cluster-autoscaler/enabled"
# The tag the load balancer controller puts on every resource it creates.
LBC_CLUSTER_TAG = "elbv2.k8s.aws/cluster"

EBS_CSI_MANAGED_POLICY = "arn:{partition}:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"


def autoscaler_cluster_tag(cluster: str) -> str:
    """The ASG tag that says a group belongs to `cluster` (value `owned`)."""
    return f"k8s.io/cluster-autoscaler/{cluster}"


def _doc(*statements: Policy) -> Policy:
    return {"Version": VERSION, "Statement": list(statements)}


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

    The action set follows the controller's documented IAM requirements for
    its v3.5.0 release (docs/install/iam_policy.json in
    kubernetes-sigs/aws-load-balancer-controller). Written out here rather
    than vendored so it is narrowed further: ARNs are limited to this
    account and region, and every create, change and delete requires the
    controller's `elbv2.k8s.aws/cluster` tag to equal this cluster's name
    (upstream only requires the tag to exist, which lets one cluster's
    controller change another's load balancers), and the untagged group it
    opens to its load balancers is the nodes' group only, when known.
    """
    arn = f"arn:{partition}"
    elb = f"{arn}:elasticloadbalancing:{region}:{account}"
    sg = f"{arn}:ec2:{region}:{account}:security-group/*"
    lb_and_tg = [f"{elb}:targetgroup/*/*", f"{elb}:loadbalancer/net/*/*", f"{elb}:loadbalancer/app/*/*"]
    listeners = [
        f"{elb}:listener/net/*/*/*",
        f"{elb}:listener/app/*/*/*",
        f"{elb}:listener-rule/net/*/*/*",
        f"{elb}:listener-rule/app/*/*/*",
    ]
    owned = {f"aws:ResourceTag/{LBC_CLUSTER_TAG}": cluster}
    requested = {f"aws:RequestTag/{LBC_CLUSTER_TAG}": cluster}
    return _doc(
        {
            "Sid": "ServiceLinkedRole",
            "Effect": "Allow",
            "Action": ["iam:CreateServiceLinkedRole"],
            "Resource": f"{arn}:iam::{account}:role/aws-service-role/elasticloadbalancing.amazonaws.com/*",
            "Condition": {"StringEquals": {"iam:AWSServiceName": "elasticloadbalancing.amazonaws.com"}},
        },
        {
            "Sid": "Discover",
            "Effect": "Allow",
            "Action": [
                "ec2:DescribeAccountAttributes",
                "ec2:DescribeAddresses",
                "ec2:DescribeAvailabilityZones",
                "ec2:DescribeInternetGateways",
                "ec2:DescribeVpcs",
                "ec2:DescribeVpcPeeringConnections",
                "ec2:DescribeSubnets",
                "ec2:DescribeSecurityGroups",
                "ec2:DescribeInstances",
                "ec2:DescribeNetworkInterfaces",
                "ec2:DescribeTags",
                "ec2:DescribeRouteTables",
                "ec2:DescribeIpamPools",
                "ec2:DescribeCoipPools",
                "ec2:GetCoipPoolUsage",
                "ec2:GetSecurityGroupsForVpc",
                "elasticloadbalancing:DescribeLoadBalancers",
                "elasticloadbalancing:DescribeLoadBalancerAttributes",
                "elasticloadbalancing:DescribeListeners",
                "elasticloadbalancing:DescribeListenerAttributes",
                "elasticloadbalancing:DescribeListenerCertificates",
                "elasticloadbalancing:DescribeSSLPolicies",
                "elasticloadbalancing:DescribeRules",
                "elasticloadbalancing:DescribeTargetGroups",
                "elasticloadbalancing:DescribeTargetGroupAttributes",
                "elasticloadbalancing:DescribeTargetHealth",
                "elasticloadbalancing:DescribeTags",
                "elasticloadbalancing:DescribeTrustStores",
                "elasticloadbalancing:DescribeCapacityReservation",
                "acm:ListCertificates",
                "acm:DescribeCertificate",
                "iam:ListServerCertificates",
                "iam:GetServerCertificate",
                "cognito-idp:DescribeUserPoolClient",
                "wafv2:GetWebACL",
                "wafv2:GetWebACLForResource",
                "waf-regional:GetWebACL",
                "waf-regional:GetWebACLForResource",
                "shield:GetSubscriptionState",
                "shield:DescribeProtection",
            ],
            "Resource": "*",
        },
        {
            "Sid": "AttachWebAclAndShield",
            "Effect": "Allow",
            "Action": [
                "wafv2:AssociateWebACL",
                "wafv2:DisassociateWebACL",
                "waf-regional:AssociateWebACL",
                "waf-regional:DisassociateWebACL",
                "shield:CreateProtection",
                "shield:DeleteProtection",
            ],
            "Resource": "*",
        },
        {
            # The controller opens the nodes' security group to its load
            # balancers; that group is not tagged by the controller.
            "Sid": "NodeSecurityGroupRules",
            "Effect": "Allow",
            "Action": ["ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress"],
            "Resource": f"{arn}:ec2:{region}:{account}:security-group/{node_security_group_id}"
            if node_security_group_id
            else sg,
        },
        {
            "Sid": "CreateSecurityGroup",
            "Effect": "Allow",
            "Action": ["ec2:CreateSecurityGroup"],
            "Resource": [sg, f"{arn}:ec2:{region}:{account}:vpc/*"],
        },
        {
            "Sid": "TagNewSecurityGroup",
            "Effect": "Allow",
            "Action": ["ec2:CreateTags"],
            "Resource": sg,
            "Condition": {"StringEquals": {"ec2:CreateAction": "CreateSecurityGroup", **requested}},
        },
        {
            "Sid": "RetagOwnSecurityGroups",
            "Effect": "Allow",
            "Action": ["ec2:CreateTags", "ec2:DeleteTags"],
            "Resource": sg,
            "Condition": {
                "StringEquals": owned,
                "Null": {f"aws:RequestTag/{LBC_CLUSTER_TAG}": "true"},
            },
        },
        {
            "Sid": "ChangeOwnSecurityGroups",
            "Effect": "Allow",
            "Action": [
                "ec2:AuthorizeSecurityGroupIngress",
                "ec2:RevokeSecurityGroupIngress",
                "ec2:DeleteSecurityGroup",
            ],
            "Resource": sg,
            "Condition": {"StringEquals": owned},
        },
        {
            "Sid": "CreateOwnedLoadBalancers",
            "Effect": "Allow",
            "Action": ["elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"],
            "Resource": lb_and_tg,
            "Condition": {"StringEquals": requested},
        },
        {
            "Sid": "TagOnCreate",
            "Effect": "Allow",
            "Action": ["elasticloadbalancing:AddTags"],
            "Resource": lb_and_tg,
            "Condition": {
                "StringEquals": {
                    "elasticloadbalancing:CreateAction": ["CreateTargetGroup", "CreateLoadBalancer"],
                    **requested,
                }
            },
        },
        {
            "Sid": "RetagOwnLoadBalancers",
            "Effect": "Allow",
            "Action": ["elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"],
            "Resource": lb_and_tg,
            "Condition": {
                "StringEquals": owned,
                "Null": {f"aws:RequestTag/{LBC_CLUSTER_TAG}": "true"},
            },
        },
        {
            "Sid": "ChangeOwnLoadBalancers",
            "Effect": "Allow",
            "Action": [
                "elasticloadbalancing:ModifyLoadBalancerAttributes",
                "elasticloadbalancing:SetIpAddressType",
                "elasticloadbalancing:SetSecurityGroups",
                "elasticloadbalancing:SetSubnets",
                "elasticloadbalancing:DeleteLoadBalancer",
                "elasticloadbalancing:ModifyTargetGroup",
                "elasticloadbalancing:ModifyTargetGroupAttributes",
                "elasticloadbalancing:DeleteTargetGroup",
                "elasticloadbalancing:ModifyCapacityReservation",
                "elasticloadbalancing:ModifyIpPools",
                "elasticloadbalancing:SetWebAcl",
            ],
            "Resource": lb_and_tg,
            "Condition": {"StringEquals": owned},
        },
        {
            "Sid": "Targets",
            "Effect": "Allow",
            "Action": ["elasticloadbalancing:RegisterTargets", "elasticloadbalancing:DeregisterTargets"],
            "Resource": f"{elb}:targetgroup/*/*",
        },
        {
            # Listeners and rules carry no controller tag of their own; they
            # live under the load balancers above.
            "Sid": "ListenersAndRules",
            "Effect": "Allow",
            "Action": [
                "elasticloadbalancing:CreateListener",
                "elasticloadbalancing:DeleteListener",
                "elasticloadbalancing:ModifyListener",
                "elasticloadbalancing:ModifyListenerAttributes",
                "elasticloadbalancing:AddListenerCertificates",
                "elasticloadbalancing:RemoveListenerCertificates",
                "elasticloadbalancing:CreateRule",
                "elasticloadbalancing:DeleteRule",
                "elasticloadbalancing:ModifyRule",
                "elasticloadbalancing:SetRulePriorities",
            ],
            "Resource": [f"{elb}:loadbalancer/net/*/*", f"{elb}:loadbalancer/app/*/*", *listeners],
        },
        {
            "Sid": "TagListenersAndRules",
            "Effect": "Allow",
            "Action": ["elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"],
            "Resource": listeners,
        },
    )


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


def queue_length_reader(queue_arn: str) -> Policy:
    """KEDA's operator: read the queue's message counts, nothing else."""
    return _doc(
        {
            "Sid": "ReadBatchQueueLength",
            "Effect": "Allow",
            "Action": ["sqs:GetQueueAttributes"],
            "Resource": [queue_arn],
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
