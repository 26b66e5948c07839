"""The AWS layer: builds what the platform and serving layers run on, and hands it down."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.aws.addons import AddonsArgs, EksAddons
from infra.aws.cluster import WORKLOAD_ADDONS, ClusterArgs, EksCluster
from infra.aws.front_image import RouterFrontImage, RouterFrontImageArgs
from infra.aws.identities import (
    IdentitiesArgs,
    PodIdentities,
    batch_worker_identity,
    cluster_autoscaler_identity,
    external_dns_identity,
    external_dns_zone,
    keda_operator_identity,
    load_balancer_controller_identity,
    model_reader_identity,
    uses_cluster_autoscaler,
)
from infra.aws.kubernetes import KubernetesAccess, KubernetesAccessArgs
from infra.aws.layer import AwsLayer, BatchQueue, ExternalDnsAccess, RedisEndpoint
from infra.aws.network import ClusterNetwork, NetworkArgs
from infra.aws.provisioning import NodeProvisioner, NodeTarget, ProvisionedNodes, node_provisioner
from infra.aws.queue import BatchQueueArgs, BatchQueues
from infra.aws.redis import GcsRedis, RedisArgs
from infra.aws.registry import RegistryArgs, ServingImage
from infra.aws.storage import ModelBucket, ModelBucketArgs
from infra.config import StackConfig


def stack_tags(cfg: StackConfig) -> dict[str, str]:
    """Tags on every AWS resource the layer makes, for cost reports and ownership."""
    return {"llm-platform/cluster": cfg.cluster.name, "llm-platform/environment": cfg.environment}


def model_prefixes(cfg: StackConfig) -> list[str]:
    """The key prefixes of the models served from the model bucket (what the readers may read)."""
    root = f"s3://{cfg.storage.model_bucket}/"
    return sorted(
        {
            m.source.removeprefix(root).strip("/")
            for m in cfg.models
            if m.weights_kind == "s3" and m.source.startswith(root)
        }
    )


@dataclass(frozen=True)
class _Shared:
    """What every cluster mode makes: the model bucket, the serving image and the batch queue (when on)."""

    bucket: ModelBucket
    image: ServingImage
    batch: BatchQueue | None
    # The routers' front image, when `serving.routing` renders routers.
    router_front: RouterFrontImage | None


def build_aws(cfg: StackConfig) -> AwsLayer:
    """Declare the AWS layer for `cfg` and return what the layers below need.

    Where pods may run comes from the node provisioner `cluster.node_provisioner`
    selects (infra/aws/provisioning.py), in both modes. With `cluster.mode:
    existing` only the model bucket, the image and the batch queue are made;
    the kubernetes provider comes from the configured kubeconfig context and
    no pod identity roles are created (role_arn None).
    """
    tags = stack_tags(cfg)
    nodes = node_provisioner(cfg)
    shared = _shared(cfg, tags)
    if cfg.cluster.mode == "existing":
        return _existing_cluster(cfg, nodes, shared)
    return _new_cluster(cfg, nodes, shared, tags)


def _shared(cfg: StackConfig, tags: dict[str, str]) -> _Shared:
    bucket = ModelBucket(
        "model-bucket",
        ModelBucketArgs(
            bucket_name=cfg.storage.model_bucket, tags=tags, writer_arns=tuple(cfg.storage.weights_writer_arns)
        ),
    )
    image = ServingImage(
        "serving-image",
        RegistryArgs(repository_name=cfg.image.repository_name, reference=cfg.image.reference, tags=tags),
    )
    router_front = None
    if cfg.serving.routing.enabled:
        router_front = RouterFrontImage(
            "router-front-image",
            RouterFrontImageArgs(
                repository_name=f"{cfg.image.repository_name}-router-front",
                reference=cfg.image.router_front_reference,
                tags=tags,
            ),
        )
    batch = None
    if cfg.batch.enabled:
        batch = BatchQueues(
            "batch-queue",
            BatchQueueArgs(settings=cfg.batch, cluster_name=cfg.cluster.name, region=cfg.region, tags=tags),
        ).queue
    return _Shared(bucket=bucket, image=image, batch=batch, router_front=router_front)


def _existing_cluster(cfg: StackConfig, nodes: NodeProvisioner, shared: _Shared) -> AwsLayer:
    """An existing cluster: reached through a kubeconfig context; its nodes and roles are not made here."""
    provider = KubernetesAccess("k8s", KubernetesAccessArgs(context=cfg.cluster.kubeconfig_context)).provider
    zone = external_dns_zone(cfg)
    return AwsLayer(
        provider=provider,
        cluster_name=pulumi.Output.from_input(cfg.cluster.name),
        kubeconfig=None,
        system=nodes.system,
        gpu=dict(nodes.gpu),
        node_group_names={},
        node_provisioner=nodes.name,
        model_bucket=shared.bucket.bucket_name,
        image=shared.image.reference,
        router_front_image=shared.router_front.reference if shared.router_front else None,
        model_reader=model_reader_identity(cfg.serving.namespace),
        cluster_autoscaler=cluster_autoscaler_identity(),
        load_balancer_controller=load_balancer_controller_identity(),
        redis=None,
        vpc_id=None,
        keda_operator=keda_operator_identity(),
        batch_queue=shared.batch,
        batch_worker=batch_worker_identity(cfg.serving.namespace) if shared.batch else None,
        external_dns=ExternalDnsAccess(external_dns_identity(), zone) if zone else None,
    )


def _new_cluster(cfg: StackConfig, nodes: NodeProvisioner, shared: _Shared, tags: dict[str, str]) -> AwsLayer:
    """A new EKS cluster in a new VPC, its nodes, pod identities and core add-ons."""
    network = ClusterNetwork(
        "network", NetworkArgs(network=cfg.network, cluster_name=cfg.cluster.name, region=cfg.region)
    )
    cluster = EksCluster(
        "cluster",
        ClusterArgs(
            cluster=cfg.cluster,
            vpc_id=network.vpc_id,
            private_subnet_ids=network.private_subnet_ids,
            public_subnet_ids=network.public_subnet_ids,
            tags=tags,
        ),
    )
    provisioned = _provision(cfg, nodes, network, cluster, tags)
    identities = _pod_identities(cfg, cluster, shared, nodes)
    workload_addons = EksAddons(
        "workload-addons",
        AddonsArgs(cluster_name=cluster.name, names=WORKLOAD_ADDONS),
        # coredns needs nodes to run on; the EBS CSI controller needs its role bound.
        opts=pulumi.ResourceOptions(depends_on=[*provisioned.ready, *identities.associations]),
    )
    redis = _gcs_redis(cfg, network, cluster, tags)
    # The one provider every in-cluster resource uses.
    provider = KubernetesAccess("k8s", KubernetesAccessArgs(kubeconfig=cluster.kubeconfig)).provider
    return AwsLayer(
        provider=provider,
        cluster_name=cluster.name,
        kubeconfig=cluster.kubeconfig,
        system=nodes.system,
        gpu=dict(nodes.gpu),
        node_group_names=provisioned.names,
        node_provisioner=nodes.name,
        model_bucket=shared.bucket.bucket_name,
        image=shared.image.reference,
        router_front_image=shared.router_front.reference if shared.router_front else None,
        model_reader=identities.model_reader,
        cluster_autoscaler=identities.cluster_autoscaler,
        load_balancer_controller=identities.load_balancer_controller,
        redis=redis,
        vpc_id=network.vpc_id,
        keda_operator=identities.keda_operator,
        batch_queue=shared.batch,
        batch_worker=identities.batch_worker,
        external_dns=identities.external_dns,
        karpenter=provisioned.karpenter,
        cluster_ready=[*provisioned.ready, workload_addons],
    )


def _provision(
    cfg: StackConfig, nodes: NodeProvisioner, network: ClusterNetwork, cluster: EksCluster, tags: dict[str, str]
) -> ProvisionedNodes:
    """The nodes, in the private subnets, with the cluster's node role."""
    return nodes.provision(
        NodeTarget(
            cluster_name=cluster.name,
            kubernetes_version=cfg.cluster.kubernetes_version,
            node_role_arn=cluster.node_role.arn,
            subnet_ids=network.private_subnet_ids,
            tags=tags,
            region=cfg.region,
            security_group_id=cluster.node_security_group_id,
        ),
        # Nodes only turn Ready once the VPC CNI runs on them, and the node
        # role needs its policies before a node can join.
        opts=pulumi.ResourceOptions(depends_on=[cluster.node_addons, *cluster.node_role_policies]),
    )


def _pod_identities(cfg: StackConfig, cluster: EksCluster, shared: _Shared, nodes: NodeProvisioner) -> PodIdentities:
    return PodIdentities(
        "pod-identities",
        IdentitiesArgs(
            cluster_name=cluster.name,
            region=cfg.region,
            serving_namespace=cfg.serving.namespace,
            bucket_arn=shared.bucket.arn,
            bucket_key_arn=shared.bucket.key_arn,
            model_prefixes=model_prefixes(cfg),
            node_security_group_id=cluster.node_security_group_id,
            ebs_kms_key_arn=cfg.storage.storage_class.kms_key_arn,
            batch=shared.batch,
            hosted_zone_id=external_dns_zone(cfg),
            cluster_autoscaler=uses_cluster_autoscaler(cfg, nodes.name),
        ),
    )


def _gcs_redis(
    cfg: StackConfig, network: ClusterNetwork, cluster: EksCluster, tags: dict[str, str]
) -> RedisEndpoint | None:
    """The Ray GCS Redis, when GCS fault tolerance is on."""
    if not cfg.ray.gcs_fault_tolerance.enabled:
        return None
    return GcsRedis(
        "ray-gcs-redis",
        RedisArgs(
            settings=cfg.ray.gcs_fault_tolerance,
            cluster_name=cfg.cluster.name,
            vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids,
            zones=cfg.network.zones,
            client_security_group_id=cluster.node_security_group_id,
            tags=tags,
        ),
    ).endpoint
