"""external-dns: the DNS records of the endpoints, in the one hosted zone the stack names.

Each RayService answers at `<service>.<domain>`: its serve Service carries the
`external-dns.alpha.kubernetes.io/hostname` annotation (infra/serving/endpoint.py)
and external-dns points that name at the Service's network load balancer
(an alias record). It reads the serving namespace's LoadBalancer Services
only, writes into the configured zone
only (the zone filter here, the role's policy in the AWS layer), and owns
what it writes through TXT records named for this cluster: `sync` removes a
record whose Service is gone, never one another owner made.

Installed where the AWS layer handed down its identity: the endpoint has a
domain and the hosted zone is known (infra/aws/identities.py `external_dns_zone`).
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import versions
from infra.aws.layer import ExternalDnsAccess
from infra.cluster_services.chart_release import PSA_RESTRICTED, ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.scheduling import Placement

RELEASE_NAME = "external-dns"
# The chart's pods already run as a non-root user with no capabilities and
# RuntimeDefault seccomp: the namespace enforces Pod Security `restricted`
# (chart_release.PSA_RESTRICTED).


def external_dns_values(
    *, domain: str, access: ExternalDnsAccess, owner: str, region: str, system: Placement, source_namespace: str
) -> dict[str, Any]:
    """The chart values: Route 53 through the pod identity, one namespace's load balancers, one domain, one zone.

    `source_namespace`: the serving namespace. external-dns writes whatever
    hostname a Service's annotation asks for (inside the domain filter), so
    reading every namespace would let anyone who may create a Service
    anywhere point a name of the zone at an address of their choosing; it
    reads LoadBalancer Services of the serving namespace only (`--namespace`,
    `--service-type-filter`). The namespace is passed as an argument rather
    than with the chart's `namespaced`: that would put the chart's Role into
    the serving namespace, which the serving layer creates after the platform
    is installed. The chart's ClusterRole stays, read-only (Services, Pods,
    EndpointSlices, Nodes); with the type filter external-dns watches
    Services alone (source/service.go: the Pod, EndpointSlice and Node
    informers are made only for NodePort and ClusterIP).
    """
    values: dict[str, Any] = {
        "fullnameOverride": RELEASE_NAME,
        "serviceAccount": {"create": True, "name": access.identity.service_account},
        "provider": {"name": "aws"},
        # The AWS SDK needs a region even for Route 53; Pod Identity gives none.
        "env": [{"name": "AWS_DEFAULT_REGION", "value": region}],
        "sources": ["service"],
        "domainFilters": [domain],
        "extraArgs": {
            "zone-id-filter": access.hosted_zone_id,
            "namespace": source_namespace,
            "service-type-filter": "LoadBalancer",
        },
        "policy": "sync",
        "registry": "txt",
        "txtOwnerId": owner,
        **system.pod_scheduling(),
        "serviceMonitor": {"enabled": True},
    }
    return values


def enabled(ctx: PartContext) -> bool:
    """Installed when the endpoint has a domain and the AWS layer made external-dns' identity."""
    return ctx.cfg.endpoint.domain is not None and ctx.aws.external_dns is not None


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The external-dns release, in its pod identity's namespace."""
    access = ctx.aws.external_dns
    domain = ctx.cfg.endpoint.domain
    if access is None or domain is None:
        raise ValueError("external-dns needs the endpoint's domain and its identity from the AWS layer")
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:ExternalDns",
        chart=versions.EXTERNAL_DNS,
        # getattr: a config without `versions.external_dns` takes the pinned default.
        version=getattr(ctx.cfg.versions, "external_dns", versions.EXTERNAL_DNS.version),
        release_name=RELEASE_NAME,
        namespace=access.identity.namespace,
        values=external_dns_values(
            domain=domain,
            access=access,
            owner=ctx.cfg.cluster.name,
            region=ctx.cfg.region,
            system=ctx.aws.system,
            source_namespace=ctx.cfg.serving.namespace,
        ),
        namespace_labels=PSA_RESTRICTED,
    )
    return ChartRelease(name, args, opts)
