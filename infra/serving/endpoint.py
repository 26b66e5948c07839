"""The OpenAI endpoint: a load-balancer Service of ours per RayService, and the Ray pods' NetworkPolicies.

Why not KubeRay's serve Service as the load balancer (what this did
before), read in KubeRay v1.7.0 and the AWS load balancer controller v3.5.0
(ported in twin/kuberay.py):

- KubeRay never updates an existing Service's annotations, and changes its
  spec only at a NewCluster switch: a certificate, scheme, hostname or
  source-range change in the stack file would never reach the NLB.
- At that switch it replaces the whole spec without `loadBalancerClass`,
  which the controller's webhook set at CREATE; the API server refuses the
  change (immutable once set), so no NewCluster upgrade could finish.
- The switch flips the selector from the old cluster's pods to the new
  one's in one update. The new pods were created while no load-balanced
  Service selected them, so they have no target-health readiness gate; the
  old targets are deregistered at once while the new ones still await
  their first health checks.

So Pulumi owns the load balancer's Service: every setting applies on the
next `pulumi up` as an in-place update of this one object (the NLB is
never replaced), it sets `loadBalancerClass` itself, and it selects the
serving workers of the RayService by our template label, which the pods of
both clusters carry. A pod is an endpoint while it is Ready: under
vllm-server that is its own vLLM server's `/health`, and under
serve-ingress KubeRay's proxy probe. During an upgrade the new cluster's
replicas join the target group as they become healthy (each created with
its readiness gate, since this Service selects it from the start) and the
old ones leave as their drain makes them unready: a rolling hand-over
instead of a flip. KubeRay's own serve Service stays, as a ClusterIP, for
what KubeRay reads from it (the RayService's Ready condition counts its
endpoints) and for the batch workers in the cluster.

One load balancer per RayService: each RayService routes its own models by
the request's `model` field, and a network load balancer can not read a
request body, so models in different RayServices get different addresses.
Models that must share an address share a `service` in the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import Endpoint
from infra.serving import kuberay
from infra.serving.batch import worker_labels as batch_worker_labels
from infra.serving.namespace import PART_OF
from infra.serving.network import ClusterPeers, ray_service_policies
from infra.serving.ports import HTTPS_PORT, RAY_PORTS
from workloads.inference_server.catalog import Layout

LB_ANNOTATION = "service.beta.kubernetes.io/aws-load-balancer"
EXTERNAL_DNS_ANNOTATION = "external-dns.alpha.kubernetes.io/hostname"
# The load balancer controller's class for network load balancers. Set here,
# not left to its webhook, so it is ours and never changes.
NLB_CLASS = "service.k8s.aws/nlb"
# Shown until the load balancer controller has written the Service's status.
PENDING_HOSTNAME = "pending-load-balancer"


def public_service_name(ray_service: str) -> str:
    """The load-balancer Service of one RayService."""
    return f"{ray_service}-public"


def serving_workers(ray_service: str) -> dict[str, str]:
    """The pods the load balancer sends to: the RayService's workers that KubeRay marks as serving.

    `llm-platform/ray-service` is on the pods of every cluster of the
    RayService, `ray.io/serve: "true"` on every RayService worker KubeRay
    builds (the head's stays "false" under `excludeHeadPodFromServeSvc`).
    """
    return {kuberay.SERVICE_LABEL: ray_service, kuberay.NODE_TYPE: "worker", kuberay.SERVE: "true"}


def _public_port(endpoint: Endpoint, layout: Layout) -> dict[str, Any]:
    target = RAY_PORTS.public(layout)
    if endpoint.certificate_arn:
        return {"name": "https", "port": HTTPS_PORT, "targetPort": target.name, "protocol": "TCP"}
    return {"name": target.name, "port": target.number, "targetPort": target.name, "protocol": "TCP"}


def serve_service_spec(name: str, namespace: str, layout: Layout = "serve-ingress") -> dict[str, Any]:
    """`spec.serveService`: KubeRay's serve Service, a ClusterIP inside the cluster.

    It targets the pods' port by name (Serve's proxy, or under vllm-server
    each replica's own vLLM server). KubeRay 1.7 swaps the ports of a given
    serveService for the head's ports named `serve`/`serve-*` whenever the
    head declares any (common/service.go BuildServeService): a serve-ingress
    head declares `serve`, a vllm-server head none (ports.RayPorts.head), so
    there the port here is kept as written. Nothing on it needs to change
    after creation: KubeRay would not apply it.
    """
    target = RAY_PORTS.public(layout)
    return {
        "metadata": {
            "name": kuberay.serve_service_name(name),
            "namespace": namespace,
            "labels": dict(PART_OF),
        },
        "spec": {
            "type": "ClusterIP",
            "ports": [{"name": target.name, "port": target.number, "targetPort": target.name, "protocol": "TCP"}],
        },
    }


def source_ranges(endpoint: Endpoint, vpc_cidr: str | None) -> list[str]:
    """The client ranges the load balancer admits: `endpoint.allowed_cidrs`, else the VPC alone.

    With no source ranges the load balancer controller opens the NLB's
    security group to 0.0.0.0/0, internal scheme or not (v3.5.0
    pkg/service/model_build_managed_sg.go buildCIDRsFromSourceRanges): an
    internal NLB then answers anything routed into the VPC (peerings,
    transit gateways, VPNs). Without a list of its own an endpoint admits
    the VPC it lives in and nothing else.
    """
    if endpoint.allowed_cidrs:
        return [str(c) for c in endpoint.allowed_cidrs]
    return [vpc_cidr] if vpc_cidr else []


def load_balancer_service(
    name: str,
    namespace: str,
    endpoint: Endpoint,
    layout: Layout = "serve-ingress",
    *,
    vpc_cidr: str | None = None,
    router_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The RayService's network load balancer (IP targets): metadata and spec of our Service.

    `vpc_cidr`: the cluster's VPC, the clients admitted when the endpoint
    names none (source_ranges). `router_labels`: the pods of its router
    (router.py), which then take the connections instead of the replicas;
    the router listens on the replicas' port name, so nothing else changes.
    """
    annotations = {
        f"{LB_ANNOTATION}-nlb-target-type": "ip",
        f"{LB_ANNOTATION}-scheme": endpoint.scheme,
        # Spread over every zone's targets: a model replica lives in one zone.
        f"{LB_ANNOTATION}-attributes": "load_balancing.cross_zone.enabled=true",
    }
    port = _public_port(endpoint, layout)
    if endpoint.certificate_arn:
        annotations[f"{LB_ANNOTATION}-ssl-cert"] = endpoint.certificate_arn
        annotations[f"{LB_ANNOTATION}-ssl-ports"] = port["name"]
        # Pinned: without it the controller uses its default,
        # ELBSecurityPolicy-2016-08, which still negotiates TLS 1.0 and 1.1.
        annotations[f"{LB_ANNOTATION}-ssl-negotiation-policy"] = endpoint.tls_policy
    host = endpoint.service_host(name)
    if host:
        annotations[EXTERNAL_DNS_ANNOTATION] = host
    spec: dict[str, Any] = {
        "type": "LoadBalancer",
        "loadBalancerClass": NLB_CLASS,
        "selector": dict(router_labels) if router_labels else serving_workers(name),
        "ports": [port],
    }
    ranges = source_ranges(endpoint, vpc_cidr)
    if ranges:
        spec["loadBalancerSourceRanges"] = ranges
    return {
        "metadata": {
            "name": public_service_name(name),
            "namespace": namespace,
            "labels": {**PART_OF, kuberay.SERVICE_LABEL: name},
            "annotations": annotations,
        },
        "spec": spec,
    }


def base_url(hostname: str, endpoint: Endpoint, layout: Layout = "serve-ingress") -> str:
    """The OpenAI base URL clients use (`https` on 443 when the LB holds a certificate)."""
    if endpoint.certificate_arn:
        return f"https://{hostname}/v1"
    return f"http://{hostname}:{RAY_PORTS.public(layout).number}/v1"


@dataclass(frozen=True)
class ServingEndpointArgs:
    """The endpoint of the RayServices already declared."""

    namespace: str
    endpoint: Endpoint
    ray_services: Mapping[str, k8s.apiextensions.CustomResource]  # RayService name -> its CustomResource
    peers: ClusterPeers
    # The heads reach the GCS Redis (GCS fault tolerance is on).
    gcs_redis: bool = False
    # The RayService the batch workers send their requests to, if any.
    batch_service: str | None = None
    # RayService name -> its layout (serve-ingress where missing).
    layouts: Mapping[str, Layout] = field(default_factory=dict)
    # The OTLP trace collector's port the Ray pods may reach (observability.tracing), if any.
    otlp_port: int | None = None
    # RayService name -> its router's pod labels, for those with a router (serving.routing).
    routers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # RayService name -> the model gateway's pod labels, for those it wakes from zero.
    woken_by: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def layout(self, service: str) -> Layout:
        """The layout of one of the RayServices."""
        return self.layouts.get(service, "serve-ingress")


class ServingEndpoint(pulumi.ComponentResource):
    """NetworkPolicies for the Ray pods (infra/serving/network.py), each RayService's load balancer and base URL."""

    urls: dict[str, pulumi.Output[str]]
    # RayService name -> its network load balancer's DNS name (what the
    # domain's record points at), PENDING_HOSTNAME until the controller wrote it.
    hostnames: dict[str, pulumi.Output[str]]
    # RayService name -> its load-balancer Service.
    services: dict[str, k8s.core.v1.Service]

    def __init__(self, name: str, args: ServingEndpointArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Endpoint", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        for service in args.ray_services:
            batch = batch_worker_labels() if service == args.batch_service else None
            for policy in ray_service_policies(
                args.namespace,
                service,
                args.peers,
                gcs_redis=args.gcs_redis,
                batch_labels=batch,
                layout=args.layout(service),
                otlp_port=args.otlp_port,
                router_labels=args.routers.get(service),
                gateway_labels=args.woken_by.get(service),
            ):
                k8s.networking.v1.NetworkPolicy(
                    policy["metadata"]["name"], metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
                )
        self.urls = {}
        self.hostnames = {}
        self.services = {}
        for service, resource in args.ray_services.items():
            layout = args.layout(service)
            manifest = load_balancer_service(
                service,
                args.namespace,
                args.endpoint,
                layout,
                vpc_cidr=args.peers.vpc_cidr,
                router_labels=args.routers.get(service),
            )
            # After the RayService is Ready, so its serving pods exist when
            # Pulumi waits for this Service's endpoints and address.
            svc = k8s.core.v1.Service(
                f"{name}-{service}-public",
                metadata=manifest["metadata"],
                spec=manifest["spec"],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[resource]),
            )
            self.services[service] = svc
            self.hostnames[service], self.urls[service] = public_address(svc, service, args.endpoint, layout)
        self.register_outputs({"urls": self.urls, "hostnames": self.hostnames})


def public_address(
    svc: k8s.core.v1.Service, name: str, endpoint: Endpoint, layout: Layout
) -> tuple[pulumi.Output[str], pulumi.Output[str]]:
    """A load-balancer Service's DNS name (PENDING_HOSTNAME until the controller wrote it) and its base URL."""
    hostname = svc.status.apply(lambda s: _ingress_hostname(s) or PENDING_HOSTNAME)
    host = endpoint.service_host(name)
    # Clients use the name the certificate covers, not the LB's.
    url = (
        pulumi.Output.from_input(base_url(host, endpoint, layout))
        if host
        else hostname.apply(_base_url_of(endpoint, layout))
    )
    return hostname, url


def _base_url_of(endpoint: Endpoint, layout: Layout) -> Callable[[str], str]:
    def make(hostname: str) -> str:
        return base_url(hostname, endpoint, layout)

    return make


def _ingress_hostname(status: Any) -> str | None:
    if status is None:
        return None
    lb = getattr(status, "load_balancer", None)
    ingress = getattr(lb, "ingress", None) if lb is not None else None
    if not ingress:
        return None
    first = ingress[0]
    host = getattr(first, "hostname", None) or getattr(first, "ip", None)
    return str(host) if host else None
