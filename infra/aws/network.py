"""The VPC: private subnets for nodes, public subnets for internet-facing load balancers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_awsx as awsx

from infra.config import Network

# Tags the AWS load balancer controller reads to pick subnets: `elb` for
# internet-facing load balancers, `internal-elb` for internal ones; the
# cluster tag (value `shared`) tells it the subnet may serve this cluster.
ROLE_ELB = "kubernetes.io/role/elb"
ROLE_INTERNAL_ELB = "kubernetes.io/role/internal-elb"

# Node subnets get most of the space: the VPC CNI gives every pod a VPC
# address, so a zone of GPU nodes with warm IP pools uses thousands.
PRIVATE_CIDR_MASK = 19
PUBLIC_CIDR_MASK = 24


def cluster_tag(cluster_name: str) -> str:
    """The subnet tag that marks a subnet as usable by this cluster."""
    return f"kubernetes.io/cluster/{cluster_name}"


@dataclass(frozen=True)
class NetworkArgs:
    """Zones, addressing and the cluster the subnets are tagged for."""

    network: Network
    cluster_name: str
    region: str


class ClusterNetwork(pulumi.ComponentResource):
    """An awsx VPC with one private and one public subnet per configured zone.

    NAT: `single` (dev: one gateway, cheap, one zone's outage cuts egress) or
    `one_per_zone` (prod: each zone keeps its own egress).
    """

    vpc_id: pulumi.Output[str]
    private_subnet_ids: pulumi.Output[Sequence[str]]
    public_subnet_ids: pulumi.Output[Sequence[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:Network", name, None, opts)
        cluster = cluster_tag(args.cluster_name)
        strategy = (
            awsx.ec2.NatGatewayStrategy.ONE_PER_AZ
            if args.network.nat_gateways == "one_per_zone"
            else awsx.ec2.NatGatewayStrategy.SINGLE
        )
        self.vpc = awsx.ec2.Vpc(
            name,
            cidr_block=str(args.network.vpc_cidr),
            availability_zone_names=list(args.network.zones),
            enable_dns_hostnames=True,
            enable_dns_support=True,
            nat_gateways=awsx.ec2.NatGatewayConfigurationArgs(strategy=strategy),
            subnet_strategy=awsx.ec2.SubnetAllocationStrategy.AUTO,
            subnet_specs=[
                awsx.ec2.SubnetSpecArgs(
                    type=awsx.ec2.SubnetType.PRIVATE,
                    cidr_mask=PRIVATE_CIDR_MASK,
                    tags={ROLE_INTERNAL_ELB: "1", cluster: "shared"},
                ),
                awsx.ec2.SubnetSpecArgs(
                    type=awsx.ec2.SubnetType.PUBLIC,
                    cidr_mask=PUBLIC_CIDR_MASK,
                    tags={ROLE_ELB: "1", cluster: "shared"},
                ),
            ],
            tags={"Name": args.cluster_name},
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.vpc_id = self.vpc.vpc_id
        self.private_subnet_ids = self.vpc.private_subnet_ids
        self.public_subnet_ids = self.vpc.public_subnet_ids
        self.s3_endpoint = self._s3_gateway(name, args)
        self.register_outputs(
            {
                "vpc_id": self.vpc_id,
                "private_subnet_ids": self.private_subnet_ids,
                "public_subnet_ids": self.public_subnet_ids,
                "s3_endpoint_id": self.s3_endpoint.id,
            }
        )

    def _s3_gateway(self, name: str, args: NetworkArgs) -> aws.ec2.VpcEndpoint:
        """An S3 gateway endpoint on every private route table.

        Weights stream from S3 at the NIC's rate (tens of GiB per cold
        start): through the NAT gateways that is NAT data processing per GB
        and a NAT's bandwidth shared by the zone; a gateway endpoint is free
        and routes S3's prefix list past the NAT. ECR's image layers are
        served from S3 too, so image pulls take it as well. awsx exposes
        route tables only as resources, so each private subnet's table is
        looked up by its association.
        """
        zones = list(args.network.zones)
        route_tables = [
            aws.ec2.get_route_table_output(
                subnet_id=self.vpc.private_subnet_ids[i], opts=pulumi.InvokeOutputOptions(parent=self)
            ).id
            for i in range(len(zones))
        ]
        return aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=self.vpc.vpc_id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=route_tables,
            tags={"Name": f"{args.cluster_name}-s3"},
            opts=pulumi.ResourceOptions(parent=self),
        )
