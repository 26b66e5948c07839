"""Karpenter's AWS side: the controller's identity, the nodes' role and the interruption queue.

Karpenter launches GPU nodes itself (EC2 Fleet), so the AWS layer gives it
what upstream's getting-started CloudFormation creates at the pinned
version (infra/versions.py KARPENTER), scoped to this cluster:

- the controller's role, bound by EKS Pod Identity to one service account,
  with upstream's six controller policies narrowed to this account, the
  nodes' role and the interruption queue (infra/aws/policies.py);
- a role for the nodes it launches, with an EKS access entry of type
  EC2_LINUX so those nodes may join;
- the interruption queue (SSE, TLS only, written to only by the
  EventBridge rules of this stack in this account) and the rules that
  feed it: spot interruption warnings, rebalance recommendations, instance
  state changes, AWS Health scheduled changes and capacity reservation
  interruptions. Karpenter cordons and drains a node it is warned about
  before EC2 takes it (see infra/cluster_services/karpenter.py for how the
  Ray workers drain gracefully).

Why the nodes get a role of their own rather than the cluster's node role
(infra/aws/cluster.py): the system managed node group uses that role, and
EKS creates and owns its EC2_LINUX access entry for it. A second entry for
the same principal fails to create (the entry exists), and deleting it
later (switching back to managed node groups) would lock the system nodes
out. A separate role keeps Karpenter's access entry, PassRole grant and
lifecycle its own; it carries the same managed policies as the node role.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.aws import policies
from infra.aws.cluster import NODE_MANAGED_POLICIES
from infra.aws.identities import pod_identity_role
from infra.aws.layer import KarpenterAccess, PodIdentity

# The controller's service account; the chart creates it under this name
# (infra/cluster_services/karpenter.py reads it from the PodIdentity).
KARPENTER_NAMESPACE = "kube-system"
KARPENTER_SA = "karpenter"
# How long an interruption message is worth acting on: a spot warning gives
# two minutes, so an older message describes a node that is gone (upstream's value).
INTERRUPTION_RETENTION_SECONDS = 300
# The EventBridge rules upstream defines at the pinned version: (rule, source, detail-type).
INTERRUPTION_RULES: tuple[tuple[str, str, str], ...] = (
    ("scheduled-change", "aws.health", "AWS Health Event"),
    ("spot-interruption", "aws.ec2", "EC2 Spot Instance Interruption Warning"),
    ("rebalance", "aws.ec2", "EC2 Instance Rebalance Recommendation"),
    ("instance-state-change", "aws.ec2", "EC2 Instance State-change Notification"),
    ("capacity-reservation-interruption", "aws.ec2", "EC2 Capacity Reservation Instance Interruption Warning"),
)


def karpenter_identity(role_arn: pulumi.Output[str] | None = None) -> PodIdentity:
    """The Karpenter controller's identity."""
    return PodIdentity(namespace=KARPENTER_NAMESPACE, service_account=KARPENTER_SA, role_arn=role_arn)


def interruption_queue_name(cluster: str) -> str:
    """The interruption queue's name (SQS allows 80 characters; cluster names are DNS labels)."""
    return f"{cluster}-karpenter"


def event_pattern(source: str, detail_type: str) -> str:
    """An EventBridge pattern matching one source and detail type."""
    return json.dumps({"source": [source], "detail-type": [detail_type]})


@dataclass(frozen=True)
class KarpenterControllerArgs:
    """The cluster Karpenter serves, where its nodes go, and the tags on what is made."""

    cluster_name: pulumi.Output[str]
    region: str
    subnet_ids: pulumi.Input[Sequence[str]]
    security_group_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


class KarpenterController(pulumi.ComponentResource):
    """The controller's Pod Identity role, the nodes' role and access entry, the interruption queue and its rules."""

    access: KarpenterAccess

    def __init__(self, name: str, args: KarpenterControllerArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:KarpenterController", name, None, opts)
        self._args = args
        self._partition = aws.get_partition_output().partition
        self._account = aws.get_caller_identity_output().account_id
        node_role = self._node_role(name)
        queue = self._interruption_queue(name)
        role_arn = self._controller_role(name, queue.arn, node_role.arn)
        self.access = KarpenterAccess(
            identity=karpenter_identity(role_arn),
            interruption_queue=queue.name,
            node_role_name=node_role.name,
            subnet_ids=pulumi.Output.from_input(args.subnet_ids).apply(list),
            security_group_ids=pulumi.Output.from_input(args.security_group_id).apply(lambda sg: [sg]),
            tags=dict(args.tags),
        )
        self.register_outputs(
            {
                "controller_role_arn": role_arn,
                "node_role_arn": node_role.arn,
                "interruption_queue": queue.name,
            }
        )

    def _node_role(self, name: str) -> aws.iam.Role:
        """The EC2 role of the nodes Karpenter launches, its managed policies and its access entry."""
        args = self._args
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(
            f"{name}-node",
            description="EC2 instance role of the nodes Karpenter launches",
            assume_role_policy=pulumi.Output.json_dumps(policies.service_trust("ec2.amazonaws.com")),
            tags=args.tags,
            opts=child,
        )
        attachments = [
            aws.iam.RolePolicyAttachment(
                f"{name}-node-{policy}",
                role=role.name,
                policy_arn=self._partition.apply(functools.partial(policies.aws_managed_policy_arn, name=policy)),
                opts=child,
            )
            for policy in NODE_MANAGED_POLICIES
        ]
        aws.eks.AccessEntry(
            f"{name}-node",
            cluster_name=args.cluster_name,
            principal_arn=role.arn,
            type="EC2_LINUX",
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=attachments),
        )
        return role

    def _interruption_queue(self, name: str) -> aws.sqs.Queue:
        """The queue EventBridge writes interruption events to, and the rules that do."""
        args = self._args
        child = pulumi.ResourceOptions(parent=self)
        queue = aws.sqs.Queue(
            f"{name}-interruption",
            name=args.cluster_name.apply(interruption_queue_name),
            message_retention_seconds=INTERRUPTION_RETENTION_SECONDS,
            sqs_managed_sse_enabled=True,
            tags=args.tags,
            opts=child,
        )
        rule_arns = []
        for rule_name, source, detail_type in INTERRUPTION_RULES:
            rule = aws.cloudwatch.EventRule(
                f"{name}-{rule_name}",
                description=f"{detail_type} events for Karpenter's interruption queue",
                event_pattern=event_pattern(source, detail_type),
                tags=args.tags,
                opts=child,
            )
            aws.cloudwatch.EventTarget(
                f"{name}-{rule_name}",
                rule=rule.name,
                arn=queue.arn,
                target_id="KarpenterInterruptionQueueTarget",
                opts=child,
            )
            rule_arns.append(rule.arn)
        # Only these rules, in this account, may send (policies.karpenter_interruption_queue).
        aws.sqs.QueuePolicy(
            f"{name}-interruption",
            queue_url=queue.id,
            policy=pulumi.Output.json_dumps(
                pulumi.Output.all(queue.arn, self._account, *rule_arns).apply(
                    lambda a: policies.karpenter_interruption_queue(a[0], a[1], a[2:])
                )
            ),
            opts=child,
        )
        return queue

    def _controller_role(
        self, name: str, queue_arn: pulumi.Output[str], node_role_arn: pulumi.Output[str]
    ) -> pulumi.Output[str]:
        """The controller's role: upstream's six policies (narrowed), bound to its one service account."""
        args = self._args
        child = pulumi.ResourceOptions(parent=self)
        identity = karpenter_identity()
        region = args.region
        role, _ = pod_identity_role(
            f"{name}-controller",
            identity,
            account=self._account,
            cluster_name=args.cluster_name,
            description=f"Launches and ends this cluster's Karpenter nodes ({KARPENTER_NAMESPACE}/{KARPENTER_SA})",
            opts=child,
            tags=args.tags,
        )
        # RunInstances may use only what the EC2NodeClasses select (infra/cluster_services/karpenter.py).
        launch = pulumi.Output.all(
            pulumi.Output.from_input(args.subnet_ids), pulumi.Output.from_input(args.security_group_id)
        ).apply(lambda a: policies.KarpenterLaunchTargets(subnet_ids=list(a[0]), security_group_ids=[a[1]]))
        documents = pulumi.Output.all(
            self._partition, self._account, args.cluster_name, queue_arn, node_role_arn, launch
        ).apply(lambda a: policies.karpenter_controller(a[0], region, a[1], a[2], a[3], a[4], a[5]))
        for part in (
            "NodeLifecycle",
            "IAMIntegration",
            "EKSIntegration",
            "Interruption",
            "ZonalShift",
            "ResourceDiscovery",
        ):
            policy = aws.iam.Policy(
                f"{name}-controller-{part}",
                description=f"Karpenter controller: {part}",
                policy=pulumi.Output.json_dumps(documents.apply(functools.partial(_pick, part=part))),
                tags=args.tags,
                opts=child,
            )
            aws.iam.RolePolicyAttachment(f"{name}-controller-{part}", role=role.name, policy_arn=policy.arn, opts=child)
        return role.arn


def _pick(documents: dict[str, policies.Policy], part: str) -> policies.Policy:
    return documents[part]
