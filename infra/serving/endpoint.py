"""The OpenAI endpoint: KubeRay's serve Service as an AWS load balancer, and NetworkPolicies.

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
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import Endpoint
from infra.serving import kuberay
from infra.serving.namespace import PART_OF
from infra.serving.ports import HTTPS_PORT, RAY_PORTS

LB_ANNOTATION = "service.beta.kubernetes.io/aws-load-balancer"
EXTERNAL_DNS_ANNOTATION = "external-dns.alpha.kubernetes.io/hostname"
# Shown until the load balancer controller has written the Service's status.
PENDING_HOSTNAME = "pending-load-balancer"


def serve_service_spec(name: str, namespace: str, endpoint: Endpoint) -> dict[str, Any]:
    """`spec.serveService`: the serve Service as a network load balancer with IP targets."""
    annotations = {
        f"{LB_ANNOTATION}-type": "external",
        f"{LB_ANNOTATION}-nlb-target-type": "ip",
        f"{LB_ANNOTATION}-scheme": endpoint.scheme,
        # Spread over every zone's targets: a model replica lives in one zone.
        f"{LB_ANNOTATION}-attributes": "load_balancing.cross_zone.enabled=true",
    }
    if endpoint.certificate_arn:
        port: dict[str, Any] = {"name": "https", "port": HTTPS_PORT, "targetPort": RAY_PORTS.serve.name}
        annotations[f"{LB_ANNOTATION}-ssl-cert"] = endpoint.certificate_arn
        annotations[f"{LB_ANNOTATION}-ssl-ports"] = port["name"]
    else:
        port = {"name": RAY_PORTS.serve.name, "port": RAY_PORTS.serve.number, "targetPort": RAY_PORTS.serve.name}
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


def base_url(hostname: str, endpoint: Endpoint) -> str:
    """The OpenAI base URL clients use (`https` on 443 when the LB holds a certificate)."""
    if endpoint.certificate_arn:
        return f"https://{hostname}/v1"
    return f"http://{hostname}:{RAY_PORTS.serve.number}/v1"


def _peer_port(number: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": number}


def network_policies(namespace: str, monitoring_namespace: str, ray_services: list[str]) -> list[dict[str, Any]]:
    """Ray's ports only for the namespace, the monitoring stack and the operator; Serve's for anyone."""
    policies: list[dict[str, Any]] = []
    namespace_label = "kubernetes.io/metadata.name"
    for name in ray_services:
        policies.append(
            {
                "metadata": {"name": f"{name}-ray", "namespace": namespace, "labels": dict(PART_OF)},
                "spec": {
                    "podSelector": {"matchLabels": kuberay.pods_of(name)},
                    "policyTypes": ["Ingress"],
                    "ingress": [
                        # Ray nodes talk to each other on many ports (GCS,
                        # raylet, object manager, workers): the namespace is trusted.
                        {"from": [{"podSelector": {}}]},
                        {
                            "from": [{"namespaceSelector": {"matchLabels": {namespace_label: monitoring_namespace}}}],
                            "ports": [_peer_port(p.number) for p in RAY_PORTS.scraped_on_head()],
                        },
                        {
                            # The KubeRay operator polls the dashboard for Serve's status.
                            "from": [
                                {
                                    "namespaceSelector": {},
                                    "podSelector": {"matchLabels": dict(kuberay.OPERATOR_POD_LABELS)},
                                }
                            ],
                            "ports": [_peer_port(RAY_PORTS.dashboard.number), _peer_port(RAY_PORTS.serve.number)],
                        },
                        # The load balancer's IP targets: API keys guard the
                        # routes, loadBalancerSourceRanges the addresses.
                        {"ports": [_peer_port(RAY_PORTS.serve.number)]},
                    ],
                },
            }
        )
    return policies


@dataclass(frozen=True)
class ServingEndpointArgs:
    """The endpoint of the RayServices already declared."""

    namespace: str
    monitoring_namespace: str
    endpoint: Endpoint
    ray_services: Mapping[str, k8s.apiextensions.CustomResource]  # RayService name -> its CustomResource


class ServingEndpoint(pulumi.ComponentResource):
    """NetworkPolicies for the Ray pods and each RayService's OpenAI base URL."""

    urls: dict[str, pulumi.Output[str]]

    def __init__(self, name: str, args: ServingEndpointArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Endpoint", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        for policy in network_policies(args.namespace, args.monitoring_namespace, list(args.ray_services)):
            k8s.networking.v1.NetworkPolicy(
                policy["metadata"]["name"], metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
            )
        self.urls = {}
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
            host = args.endpoint.service_host(service)
            if host:
                # Clients use the name the certificate covers, not the LB's.
                self.urls[service] = pulumi.Output.from_input(base_url(host, args.endpoint))
                continue
            hostname = svc.status.apply(lambda s: _ingress_hostname(s))
            self.urls[service] = hostname.apply(lambda h: base_url(h or PENDING_HOSTNAME, args.endpoint))
        self.register_outputs({"urls": self.urls})


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
