"""The OpenAI endpoint: KubeRay's serve Service as an AWS load balancer, and the Ray pods' NetworkPolicies.

Why KubeRay's own serve Service (`spec.serveService`) and not a Service of
ours: a RayService's pods change cluster on every upgrade, and only KubeRay
knows which cluster is active; it moves the serve Service's selector when it
switches traffic. A Service selecting the pods itself would send requests to
a pending cluster whose applications are still starting.

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
# Shown until the load balancer controller has written the Service's status.
PENDING_HOSTNAME = "pending-load-balancer"


def serve_service_spec(
    name: str, namespace: str, endpoint: Endpoint, layout: Layout = "serve-ingress"
) -> dict[str, Any]:
    """`spec.serveService`: the serve Service as a network load balancer with IP targets.

    It targets the pods' port by name (Serve's proxy, or under vllm-server
    each replica's own vLLM server), so a pod that does not declare that
    port is never an endpoint.

    KubeRay 1.7 swaps the ports of a given serveService for the head's ports
    named `serve`/`serve-*` whenever the head declares any, keeping a user
    port only under the same name (common/service.go BuildServeService). A
    serve-ingress head declares `serve`, so its listener is named `serve`
    too, whatever port it listens on; a vllm-server head declares none
    (ports.RayPorts.head), so the ports here are kept as written.
    """
    target = RAY_PORTS.public(layout)
    annotations = {
        f"{LB_ANNOTATION}-type": "external",
        f"{LB_ANNOTATION}-nlb-target-type": "ip",
        f"{LB_ANNOTATION}-scheme": endpoint.scheme,
        # Spread over every zone's targets: a model replica lives in one zone.
        f"{LB_ANNOTATION}-attributes": "load_balancing.cross_zone.enabled=true",
    }
    if endpoint.certificate_arn:
        listener = RAY_PORTS.serve.name if layout == "serve-ingress" else "https"
        port: dict[str, Any] = {"name": listener, "port": HTTPS_PORT, "targetPort": target.name}
        annotations[f"{LB_ANNOTATION}-ssl-cert"] = endpoint.certificate_arn
        annotations[f"{LB_ANNOTATION}-ssl-ports"] = port["name"]
    else:
        port = {"name": target.name, "port": target.number, "targetPort": target.name}
    host = endpoint.service_host(name)
    if host:
        annotations[EXTERNAL_DNS_ANNOTATION] = host
    spec: dict[str, Any] = {"type": "LoadBalancer", "ports": [{**port, "protocol": "TCP"}]}
    if endpoint.allowed_cidrs:
        spec["loadBalancerSourceRanges"] = [str(c) for c in endpoint.allowed_cidrs]
    return {
        "metadata": {
            "name": kuberay.serve_service_name(name),
            "namespace": namespace,
            "labels": dict(PART_OF),
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

    def layout(self, service: str) -> Layout:
        """The layout of one of the RayServices."""
        return self.layouts.get(service, "serve-ingress")


class ServingEndpoint(pulumi.ComponentResource):
    """NetworkPolicies for the Ray pods (infra/serving/network.py) and each RayService's OpenAI base URL."""

    urls: dict[str, pulumi.Output[str]]
    # RayService name -> its network load balancer's DNS name (what the
    # domain's record points at), PENDING_HOSTNAME until the controller wrote it.
    hostnames: dict[str, pulumi.Output[str]]

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
            ):
                k8s.networking.v1.NetworkPolicy(
                    policy["metadata"]["name"], metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
                )
        self.urls = {}
        self.hostnames = {}
        for service, resource in args.ray_services.items():
            svc_name = kuberay.serve_service_name(service)
            # KubeRay creates the serve Service; read it once the RayService is
            # ready (its id is unknown at first preview, so the read waits).
            svc_id = resource.id.apply(_serve_service_id(args.namespace, svc_name))
            svc = k8s.core.v1.Service.get(
                f"{name}-{service}-serve-svc",
                svc_id,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[resource]),
            )
            hostname = svc.status.apply(lambda s: _ingress_hostname(s) or PENDING_HOSTNAME)
            self.hostnames[service] = hostname
            host = args.endpoint.service_host(service)
            layout = args.layout(service)
            # Clients use the name the certificate covers, not the LB's.
            self.urls[service] = (
                pulumi.Output.from_input(base_url(host, args.endpoint, layout))
                if host
                else hostname.apply(_base_url_of(args.endpoint, layout))
            )
        self.register_outputs({"urls": self.urls, "hostnames": self.hostnames})


def _base_url_of(endpoint: Endpoint, layout: Layout) -> Callable[[str], str]:
    def make(hostname: str) -> str:
        return base_url(hostname, endpoint, layout)

    return make


def _serve_service_id(namespace: str, svc_name: str) -> Callable[[str], str]:
    def make(_: str) -> str:
        return f"{namespace}/{svc_name}"

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
