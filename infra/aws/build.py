"""The AWS layer: builds what the platform and serving layers run on, and hands it down."""

from __future__ import annotations

import pulumi

from infra.aws.addons import AddonsArgs, EksAddons
from infra.aws.cluster import WORKLOAD_ADDONS, ClusterArgs, EksCluster
from infra.aws.identities import (
    IdentitiesArgs,
    PodIdentities,
    batch_worker_identity,
    cluster_autoscaler_identity,
    keda_operator_identity,
    load_balancer_controller_identity,
    model_reader_identity,
)
from infra.aws.kubernetes import KubernetesAccess, KubernetesAccessArgs
from infra.aws.layer import AwsLayer
from infra.aws.network import ClusterNetwork, NetworkArgs
from infra.aws.node_groups import NodeGroup, NodeGroupArgs
from infra.aws.queue import BatchQueueArgs, BatchQueues
from infra.aws.redis import GcsRedis, RedisArgs
from infra.aws.registry import RegistryArgs, ServingImage
from infra.aws.storage import ModelBucket, ModelBucketArgs
from infra.config import NodeGroupSettings
from infra.config import StackConfig
from infra.scheduling import Placement, gpu_placements, system_placement


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


def build_aws(cfg: StackConfig) -> AwsLayer:
    """Declare the AWS layer for `cfg` and return what the layers below need.

    With `cluster.mode: existing` only the model bucket and the image are
    made; the kubernetes provider comes from the configured kubeconfig
    context and no pod identity roles are created (role_arn None).
    """
    tags = stack_tags(cfg)
    system = system_placement(cfg)
    gpu = gpu_placements(cfg)
    bucket = ModelBucket("model-bucket", ModelBucketArgs(bucket_name=cfg.storage.model_bucket, tags=tags))
    image = ServingImage(
        "serving-image",
        RegistryArgs(repository_name=cfg.image.repository_name, reference=cfg.image.reference, tags=tags),
    )
    batch = (
        BatchQueues(
            "batch-queue",
            BatchQueueArgs(settings=cfg.batch, cluster_name=cfg.cluster.name, region=cfg.region, tags=tags),
        ).queue
        if cfg.batch.enabled
        else None
    )

    if cfg.cluster.mode == "existing":
        provider = KubernetesAccess("k8s", KubernetesAccessArgs(context=cfg.cluster.kubeconfig_context)).provider
        return AwsLayer(
            provider=provider,
            cluster_name=pulumi.Output.from_input(cfg.cluster.name),
            kubeconfig=None,
            system=system,
            gpu=gpu,
            node_group_names={},
            model_bucket=bucket.bucket_name,
            image=image.reference,
            model_reader=model_reader_identity(cfg.serving.namespace),
            cluster_autoscaler=cluster_autoscaler_identity(),
            load_balancer_controller=load_balancer_controller_identity(),
            redis=None,
            vpc_id=None,
            keda_operator=keda_operator_identity(),
            batch_queue=batch,
            batch_worker=batch_worker_identity(cfg.serving.namespace) if batch else None,
        )

    network = ClusterNetwork("network", NetworkArgs(network=cfg.network, cluster_name=cfg.cluster.name))
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

    def node_group(placement: Placement, config: NodeGroupSettings) -> NodeGroup:
        return NodeGroup(
            f"nodes-{placement.group}",
            NodeGroupArgs(
                cluster_name=cluster.name,
                kubernetes_version=cfg.cluster.kubernetes_version,
                config=config,
                placement=placement,
                node_role_arn=cluster.node_role.arn,
                subnet_ids=network.private_subnet_ids,
                tags=tags,
                # Nodes only turn Ready once the VPC CNI runs on them.
                # (and the node role needs its policies before a node can join).
                after=[*cluster.node_addons.addons.values(), *cluster.node_role_policies],
            ),
        )

    groups = {system.group: node_group(system, cfg.node_groups.system)}
    for group in cfg.node_groups.gpu:
        groups[group.name] = node_group(gpu[group.name], group)

    identities = PodIdentities(
        "pod-identities",
        IdentitiesArgs(
            cluster_name=cluster.name,
            region=cfg.region,
            serving_namespace=cfg.serving.namespace,
            bucket_arn=bucket.arn,
            bucket_key_arn=bucket.key_arn,
            model_prefixes=model_prefixes(cfg),
            node_security_group_id=cluster.node_security_group_id,
            ebs_kms_key_arn=cfg.storage.storage_class.kms_key_arn,
            batch=batch,
        ),
    )
    workload_addons = EksAddons(
        "workload-addons",
        AddonsArgs(
            cluster_name=cluster.name,
            names=WORKLOAD_ADDONS,
            # coredns needs nodes to run on; the EBS CSI controller needs its role bound.
            after=[*(g.node_group for g in groups.values()), *identities.associations],
        ),
    )

    redis = None
    if cfg.ray.gcs_fault_tolerance.enabled:
        redis = GcsRedis(
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

    # The one provider every in-cluster resource uses.
    provider = KubernetesAccess("k8s", KubernetesAccessArgs(kubeconfig=cluster.kubeconfig)).provider
    return AwsLayer(
        provider=provider,
        cluster_name=cluster.name,
        kubeconfig=cluster.kubeconfig,
        system=system,
        gpu=gpu,
        node_group_names={name: g.name for name, g in groups.items()},
        model_bucket=bucket.bucket_name,
        image=image.reference,
        model_reader=identities.model_reader,
        cluster_autoscaler=identities.cluster_autoscaler,
        load_balancer_controller=identities.load_balancer_controller,
        redis=redis,
        vpc_id=network.vpc_id,
        keda_operator=identities.keda_operator,
        batch_queue=batch,
        batch_worker=identities.batch_worker,
        cluster_ready=[*groups.values(), workload_addons],
    )
