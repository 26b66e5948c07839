"""ElastiCache Redis for Ray GCS fault tolerance: private, TLS, auth token, two zones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_random as random

from infra import versions
from infra.aws.layer import RedisEndpoint
from infra.config import GcsFaultTolerance

REDIS_PORT = 6379
# ElastiCache allows 16-128 printable characters; letters and digits avoid
# the ones it refuses and any quoting in Ray's redis address handling.
TOKEN_LENGTH = 64


@dataclass(frozen=True)
class RedisArgs:
    """Where the Redis runs and who may reach it."""

    settings: GcsFaultTolerance
    cluster_name: str
    vpc_id: pulumi.Input[str]
    subnet_ids: pulumi.Input[Sequence[str]]
    zones: Sequence[str]
    # Only this security group (the nodes') may connect.
    client_security_group_id: pulumi.Input[str]
    tags: dict[str, str] = field(default_factory=dict)


class GcsRedis(pulumi.ComponentResource):
    """A two-node Redis replication group the Ray heads keep their GCS state in.

    A primary and a replica in different zones with automatic failover, so
    a zone loss costs a failover, not the GCS state. Reachable on 6379 only
    from the node security group, TLS in transit, encrypted at rest, and an
    auth token that exists only as a Pulumi secret.
    """

    endpoint: RedisEndpoint

    def __init__(self, name: str, args: RedisArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:GcsRedis", name, None, opts)
        if len(args.zones) < 2:
            raise ValueError("network.zones: Redis for GCS fault tolerance needs two zones")
        self.security_group = self._security_group(name, args)
        subnets = aws.elasticache.SubnetGroup(
            name,
            name=f"{args.cluster_name}-ray-gcs",
            description=f"Private subnets of cluster {args.cluster_name}",
            subnet_ids=args.subnet_ids,
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.password = random.RandomPassword(
            f"{name}-auth-token",
            length=TOKEN_LENGTH,
            special=False,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["result"]),
        )
        token: pulumi.Output[str] = pulumi.Output.secret(self.password.result)
        self.replication_group = self._replication_group(name, args, subnets, token)
        address = self.replication_group.primary_endpoint_address.apply(lambda host: f"{host}:{REDIS_PORT}")
        self.endpoint = RedisEndpoint(address=address, password=token, tls=True)
        self.register_outputs({"address": address})

    def _security_group(self, name: str, args: RedisArgs) -> aws.ec2.SecurityGroup:
        """The Redis' security group: 6379 from the client group (the nodes') and nothing else."""
        child = pulumi.ResourceOptions(parent=self)
        group = aws.ec2.SecurityGroup(
            name,
            vpc_id=args.vpc_id,
            description=f"Ray GCS Redis of cluster {args.cluster_name}: clients are the cluster's nodes",
            tags={**args.tags, "Name": f"{args.cluster_name}-ray-gcs"},
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-from-nodes",
            security_group_id=group.id,
            referenced_security_group_id=args.client_security_group_id,
            ip_protocol="tcp",
            from_port=REDIS_PORT,
            to_port=REDIS_PORT,
            description="Redis from the cluster's nodes",
            opts=child,
        )
        return group

    def _replication_group(
        self, name: str, args: RedisArgs, subnets: aws.elasticache.SubnetGroup, token: pulumi.Output[str]
    ) -> aws.elasticache.ReplicationGroup:
        """A primary and a replica in the first two zones, failing over automatically, TLS and auth token."""
        return aws.elasticache.ReplicationGroup(
            name,
            replication_group_id=f"{args.cluster_name}-ray-gcs",
            description=f"Ray GCS fault tolerance for cluster {args.cluster_name}",
            engine="redis",
            engine_version=versions.ELASTICACHE_REDIS_VERSION,
            node_type=args.settings.node_type,
            port=REDIS_PORT,
            num_cache_clusters=2,
            preferred_cache_cluster_azs=list(args.zones[:2]),
            automatic_failover_enabled=True,
            multi_az_enabled=True,
            subnet_group_name=subnets.name,
            security_group_ids=[self.security_group.id],
            transit_encryption_enabled=True,
            at_rest_encryption_enabled=True,
            auth_token=token,
            auto_minor_version_upgrade=True,
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["authToken"]),
        )
