"""The `endpoint` section: how clients reach the OpenAI-compatible API, and the DNS records that name it."""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Network
from typing import Literal

from pydantic import Field

from infra.config.fields import Section
from infra.config.problems import Problem

# NLB security policies that negotiate TLS 1.2 or 1.3 only (AWS's
# "describe-ssl-policies" for network load balancers).
TlsPolicy = Literal[
    "ELBSecurityPolicy-TLS13-1-2-Res-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-2021-06",
    "ELBSecurityPolicy-TLS13-1-3-2021-06",
]


class Endpoint(Section):
    """How clients reach the OpenAI-compatible API."""

    scheme: Literal["internal", "internet-facing"] = "internal"
    allowed_cidrs: list[IPv4Network] = Field(default_factory=list)
    certificate_arn: str | None = None
    # Each RayService answers at <service>.<domain> (a network load balancer
    # can not route on the request's model); the certificate covers
    # *.<domain>, and external-dns, where it runs, creates the records.
    domain: str | None = Field(default=None, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z]{2,}$")
    # The Route 53 hosted zone of `domain`: external-dns writes the records
    # there, and its role may change that zone only.
    hosted_zone_id: str | None = Field(default=None, pattern=r"^Z[0-9A-Z]{4,31}$")
    # The NLB's TLS security policy (protocols and ciphers clients may
    # negotiate) when it holds a certificate. Without one the controller
    # falls back to ELBSecurityPolicy-2016-08, which still accepts TLS 1.0.
    # These accept TLS 1.3 and 1.2 only; the `Res` (restricted) one only
    # forward-secret AEAD ciphers on 1.2.
    tls_policy: TlsPolicy = "ELBSecurityPolicy-TLS13-1-2-Res-2021-06"

    def service_host(self, service: str) -> str | None:
        """The DNS name of one RayService's endpoint, when a domain is set."""
        return f"{service}.{self.domain}" if self.domain else None


def check_dns(endpoint: Endpoint, *, external_dns: bool) -> Iterable[Problem]:
    """A domain comes with its hosted zone where external-dns runs, and a zone only with its domain."""
    ep = endpoint
    if ep.domain and ep.hosted_zone_id is None and external_dns:
        yield Problem(
            "endpoint.hosted_zone_id",
            f"required with endpoint.domain: external-dns writes <service>.{ep.domain} into that Route 53 zone "
            "(an existing cluster whose records are made elsewhere may switch platform.external_dns off)",
        )
    if ep.hosted_zone_id is not None and not ep.domain:
        yield Problem("endpoint.hosted_zone_id", "set endpoint.domain too: the zone holds that domain's records")
