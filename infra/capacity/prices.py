"""Pinned EC2 prices per instance type and region: on-demand and spot $/hour, each with its date and source.

Prices change; the plan reads only this table, so a preview costs nothing
and gives the same answer twice. To refresh a line:

    on-demand  https://aws.amazon.com/ec2/pricing/on-demand/ (Linux, shared tenancy), or
               aws pricing get-products --service-code AmazonEC2 --region us-east-1 --filters
                 Type=TERM_MATCH,Field=instanceType,Value=<type> Type=TERM_MATCH,Field=regionCode,Value=<region>
                 Type=TERM_MATCH,Field=operatingSystem,Value=Linux Type=TERM_MATCH,Field=tenancy,Value=Shared
                 Type=TERM_MATCH,Field=preInstalledSw,Value=NA Type=TERM_MATCH,Field=capacitystatus,Value=Used
    spot       aws ec2 describe-spot-price-history --region <region> --instance-types <type>
                 --product-descriptions Linux/UNIX --start-time <now>   (the lowest zone's price)

Spot prices move with supply and demand, zone by zone: the pinned value is
a typical recent price, rounded to the cent, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CapacityType = Literal["on_demand", "spot"]

ON_DEMAND_SOURCE = "AWS EC2 On-Demand pricing (Linux, shared tenancy), aws.amazon.com/ec2/pricing/on-demand/"
SPOT_SOURCE = "AWS EC2 Spot price history (Linux/UNIX, lowest zone, typical, rounded), describe-spot-price-history"
ON_DEMAND_AS_OF = "2026-06"
SPOT_AS_OF = "2026-06"


@dataclass(frozen=True)
class Price:
    """One instance type's hourly price in one region, at one capacity type."""

    usd_per_hour: float
    as_of: str
    source: str


# On-demand $/hour; the same in us-east-1 and us-west-2 for these families.
_ON_DEMAND: dict[str, float] = {
    "g5.xlarge": 1.006,
    "g5.2xlarge": 1.212,
    "g5.4xlarge": 1.624,
    "g5.8xlarge": 2.448,
    "g5.12xlarge": 5.672,
    "g5.24xlarge": 8.144,
    "g5.48xlarge": 16.288,
    "g6.xlarge": 0.8048,
    "g6.2xlarge": 0.9776,
    "g6.4xlarge": 1.3232,
    "g6.8xlarge": 2.0144,
    "g6.12xlarge": 4.6016,
    "g6.24xlarge": 6.6752,
    "g6.48xlarge": 13.3504,
    "g6e.xlarge": 1.861,
    "g6e.2xlarge": 2.24208,
    "g6e.4xlarge": 3.00424,
    "g6e.8xlarge": 4.52856,
    "g6e.12xlarge": 10.49264,
    "g6e.24xlarge": 15.06559,
    "g6e.48xlarge": 30.13118,
}
_ON_DEMAND_REGIONS = ("us-east-1", "us-west-2")

# Spot $/hour of the instance types the example stacks use, in their regions.
_SPOT: dict[tuple[str, str], float] = {
    ("us-west-2", "g6.2xlarge"): 0.43,
    ("us-west-2", "g6.4xlarge"): 0.57,
    ("us-east-1", "g6e.2xlarge"): 1.05,
    ("us-east-1", "g6e.4xlarge"): 1.40,
    ("us-east-1", "g6e.12xlarge"): 4.72,
}

PRICES: dict[tuple[str, str, CapacityType], Price] = {
    **{
        (region, name, "on_demand"): Price(usd, ON_DEMAND_AS_OF, ON_DEMAND_SOURCE)
        for region in _ON_DEMAND_REGIONS
        for name, usd in _ON_DEMAND.items()
    },
    **{(region, name, "spot"): Price(usd, SPOT_AS_OF, SPOT_SOURCE) for (region, name), usd in _SPOT.items()},
}


def price(region: str, instance_type: str, capacity_type: CapacityType) -> Price | None:
    """The pinned price, or None when the table has no line for it."""
    return PRICES.get((region, instance_type, capacity_type))
