"""The `network` section: the VPC's zones and addressing, and the allow-lists' width rule."""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Network, collapse_addresses
from typing import Literal

from pydantic import Field

from infra.config.fields import Section
from infra.config.problems import Problem

# How the network layer (infra/aws/network.py) cuts the VPC: one private
# subnet for nodes and one public subnet for internet-facing load balancers
# in each zone. Node subnets get most of the space: the VPC CNI gives every
# pod a VPC address, so a zone of GPU nodes with warm IP pools uses thousands.
PRIVATE_CIDR_MASK = 19
PUBLIC_CIDR_MASK = 24
# The VPC sizes AWS allows.
VPC_PREFIX_RANGE = (16, 28)


class Network(Section):
    """Zones and addressing of the VPC."""

    zones: list[str] = Field(min_length=1)
    vpc_cidr: IPv4Network = IPv4Network("10.0.0.0/16")
    nat_gateways: Literal["single", "one_per_zone"] = "single"


def check_network(network: Network, region: str, *, eks: bool) -> Iterable[Problem]:
    """The zones are distinct zones of the region; a cluster made here has two or more, in a VPC that holds them."""
    for i, zone in enumerate(network.zones):
        if not (zone.startswith(region) and len(zone) > len(region)):
            yield Problem(f"network.zones[{i}]", f"'{zone}' is not a zone of region {region}")
    if len(set(network.zones)) != len(network.zones):
        yield Problem("network.zones", "zones must be distinct")
    if eks and len(network.zones) < 2:
        yield Problem("network.zones", "EKS needs subnets in at least two zones")
    if eks:
        yield from _check_vpc_size(network)


def _check_vpc_size(network: Network) -> Iterable[Problem]:
    """The VPC holds every zone's subnets as the network layer lays them out.

    awsx gives each zone an equal, aligned block (the VPC split into the next
    power of two of zones) and packs the zone's subnets into it.
    """
    cidr, zones = network.vpc_cidr, len(network.zones)
    low, high = VPC_PREFIX_RANGE
    if not low <= cidr.prefixlen <= high:
        yield Problem("network.vpc_cidr", f"AWS allows a VPC from /{low} to /{high} (got {cidr})")
        return
    zone_bits = (zones - 1).bit_length()
    zone_prefix = cidr.prefixlen + zone_bits
    need = 2 ** (32 - PRIVATE_CIDR_MASK) + 2 ** (32 - PUBLIC_CIDR_MASK)
    if 2 ** (32 - zone_prefix) < need:
        largest = 32 - (need - 1).bit_length() - zone_bits
        yield Problem(
            "network.vpc_cidr",
            f"{cidr} is too small for {zones} zones: each zone gets a /{zone_prefix} ({2 ** (32 - zone_prefix)} "
            f"addresses) but needs a /{PRIVATE_CIDR_MASK} private and a /{PUBLIC_CIDR_MASK} public subnet "
            f"({need} addresses); use a /{largest} or larger",
        )


# The widest single range an allow-list may name (a /8 is already 16.7
# million addresses), and the most public addresses a whole list may admit:
# an allow-list names clients, and one made of halves or quarters of the
# internet (0.0.0.0/1 and 128.0.0.0/1) is the internet.
MIN_ALLOWED_PREFIX = 8
MAX_ALLOWED_PUBLIC_ADDRESSES = 2 ** (32 - MIN_ALLOWED_PREFIX)


def cidr_list_problem(cidrs: Iterable[IPv4Network]) -> str | None:
    """Why an allow-list is too wide to be one, or None.

    Each range must be /MIN_ALLOWED_PREFIX or narrower, and the ranges
    together may admit at most MAX_ALLOWED_PUBLIC_ADDRESSES public addresses
    (private ranges, RFC 1918 and the like, do not count: they reach the
    load balancer only through networks the account routes).
    """
    cidrs = list(cidrs)
    wide = [str(c) for c in cidrs if c.prefixlen < MIN_ALLOWED_PREFIX]
    if wide:
        return f"{', '.join(wide)} is wider than /{MIN_ALLOWED_PREFIX} (name the clients' own ranges)"
    # Private ranges left out before collapsing: 10.0.0.0/8 and 11.0.0.0/8 would merge into a public /7.
    public = sum(c.num_addresses for c in collapse_addresses(c for c in cidrs if not c.is_private))
    if public > MAX_ALLOWED_PUBLIC_ADDRESSES:
        return (
            f"the ranges together admit {public} public addresses, more than one /{MIN_ALLOWED_PREFIX} "
            f"({MAX_ALLOWED_PUBLIC_ADDRESSES}): name the clients' own ranges"
        )
    return None
