"""What the AWS layer hands to the layers below it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.scheduling import GpuPlacement, Placement

# `cluster.node_provisioner` of EKS managed node groups scaled by cluster-autoscaler
# (infra/aws/provisioning.py).
MANAGED_NODE_GROUPS = "managed_node_groups"
# `cluster.node_provisioner` of Karpenter NodePools (infra/aws/karpenter.py).
KARPENTER = "karpenter"


@dataclass(frozen=True)
class PodIdentity:
    """A Kubernetes service account and the IAM role its pods assume.

    The AWS layer names the service account (the pod identity association
    binds exactly that name); the layer that creates the account reads the
    name from here. `role_arn` is None where no role is made here (an
    existing cluster).
    """

    namespace: str
    service_account: str
    role_arn: pulumi.Output[str] | None


@dataclass(frozen=True)
class ExternalDnsAccess:
    """external-dns' pod identity and the one Route 53 hosted zone its role may change."""

    identity: PodIdentity
    hosted_zone_id: str


@dataclass(frozen=True)
class KarpenterAccess:
    """What the Karpenter chart and its EC2NodeClasses need from AWS.

    The controller runs as `identity`; the EC2NodeClasses launch nodes with
    `node_role_name` into `subnet_ids` with `security_group_ids` (selected
    by id, so nothing else must carry discovery tags).
    """

    identity: PodIdentity
    interruption_queue: pulumi.Input[str]
    node_role_name: pulumi.Input[str]
    subnet_ids: pulumi.Input[list[str]]
    security_group_ids: pulumi.Input[list[str]]
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RedisEndpoint:
    """The external Redis that keeps the Ray GCS state across head restarts."""

    address: pulumi.Output[str]  # host:port
    password: pulumi.Output[str]  # secret
    tls: bool = True


@dataclass(frozen=True)
class BatchQueue:
    """The batch request queue, its dead-letter queue and where results go.

    Clients send OpenAI chat requests to `url`; the workers write each answer
    to `s3://<results_bucket>/<results_prefix><id>.json`. Messages received
    `max_receive_count` times without success move to the dead-letter queue.
    """

    url: pulumi.Output[str]
    arn: pulumi.Output[str]
    dead_letter_url: pulumi.Output[str]
    dead_letter_arn: pulumi.Output[str]
    results_bucket: pulumi.Output[str]
    results_bucket_arn: pulumi.Output[str]
    results_prefix: str
    region: str
    visibility_timeout_seconds: int


@dataclass(frozen=True)
class AwsLayer:
    """Everything the platform and serving layers need from AWS."""

    provider: k8s.Provider
    cluster_name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str] | None
    system: Placement
    gpu: dict[str, GpuPlacement]
    # The AWS name of each placement's node group (or pool), by placement group.
    node_group_names: dict[str, pulumi.Output[str]]
    model_bucket: pulumi.Output[str]
    image: pulumi.Output[str]
    model_reader: PodIdentity
    cluster_autoscaler: PodIdentity
    load_balancer_controller: PodIdentity
    redis: RedisEndpoint | None
    vpc_id: pulumi.Output[str] | None
    # KEDA's operator: the platform's release runs under this account; it
    # reads the batch queue's length with this identity's role.
    keda_operator: PodIdentity
    # The routers' front image (`repository@sha256:...`); None when no router is rendered.
    router_front_image: pulumi.Output[str] | None = None
    # The batch queue and the workers' identity; None when batch is off.
    batch_queue: BatchQueue | None = None
    batch_worker: PodIdentity | None = None
    # What in-cluster resources wait for: node groups and core add-ons.
    cluster_ready: list[pulumi.Resource] = field(default_factory=list)
    # Which node provisioner made the nodes (infra/aws/provisioning.py): the
    # platform installs cluster-autoscaler only for managed node groups.
    node_provisioner: str = MANAGED_NODE_GROUPS
    # external-dns' identity and hosted zone, when the endpoint has a domain
    # and its zone is known: the platform installs external-dns only then.
    external_dns: ExternalDnsAccess | None = None
    # Karpenter's controller identity, queue and node launch settings, when
    # the node provisioner is Karpenter on a cluster made here: the platform
    # installs Karpenter and its NodePools only then.
    karpenter: KarpenterAccess | None = None
