"""NetworkPolicies of the serving namespace: deny by default, then allow each flow by name.

Who may reach what (docs/security.md has the matrix in words):

- Every pod in the namespace is denied ingress and egress unless a policy
  below allows it; each may resolve names (kube-dns, port 53).
- A Ray pod accepts any port from the pods of its own RayService (its own
  label, `llm-platform/ray-service`, which both clusters of a NewCluster
  upgrade carry) and nothing from another RayService.
- The KubeRay operator, matched by its namespace AND its pod labels, reaches
  a head's dashboard (deploys and Serve status) and its Serve proxy
  (`/-/healthz`, which sets the head's `ray.io/serve` label). A pod that
  copies the operator's labels in any other namespace matches nothing.
- Prometheus, matched the same way, scrapes the metrics ports; under the
  vllm-server layout that includes vLLM's own registry (`vllm-metrics`),
  which answers without an API key and so is open to Prometheus alone.
- The public port of the worker pods (the serve Service's endpoints: Serve's
  proxy on `serve`, or under vllm-server each replica's vLLM server on
  `openai`) is open to the load balancer: a network load balancer with IP
  targets connects from its own addresses inside the VPC (it does not keep
  the client's), and `loadBalancerSourceRanges` limits the clients at the
  load balancer. The VPC CNI gives pods VPC addresses too, so this rule
  admits in-VPC sources to that one port, which the API keys guard.
  With `serving.routing` on, the load balancer sends to the router's pods
  instead (router.py: the VPC in, its replicas' `openai` port and the
  Kubernetes API out), and the replicas' public port admits the router alone.
- Batch workers reach that public port of the RayServices' workers (their
  model's serve Service), AWS APIs outside the VPC over 443 and the EKS Pod
  Identity agent, nothing else.
- Ray pods reach their own RayService, HTTPS (S3 for weights, the Kubernetes
  API for the head's autoscaler), EKS Pod Identity's node-local agent, and
  from the head: Prometheus and Grafana (the Ray dashboard's metrics views)
  and the GCS Redis when there is one; so does the Redis cleanup Job KubeRay
  runs when a cluster of theirs is deleted.
- With `observability.tracing` set, Ray pods also reach the OTLP collector's
  port (any address: it may run in the cluster or outside it), where vLLM
  and Serve's replicas send their spans.

Kubelet's probes come from the pod's own node and are always allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra.cluster_services.layer import PlatformPods
from infra.serving import kuberay
from infra.serving.namespace import peer, policy_metadata
from infra.serving.ports import RAY_PORTS, Port
from infra.serving.ray_service import SERVICE_LABEL
from workloads.inference_server.catalog import Layout

HTTPS = 443
REDIS_PORT = 6379
# The EKS Pod Identity agent: a host-network DaemonSet answering on a
# link-local address of every node (AWS_CONTAINER_CREDENTIALS_FULL_URI).
POD_IDENTITY_AGENT = "169.254.170.23/32"
POD_IDENTITY_AGENT_PORT = 80
ANYWHERE = "0.0.0.0/0"
# What the KubeRay operator calls on a head: the dashboard (Serve deploys and
# status) and the Serve proxy's /-/healthz (reference: KubeRay's RayService
# controller, `updateHeadPodServeLabel`).
OPERATOR_PORTS = (RAY_PORTS.dashboard.number, RAY_PORTS.serve.number)


@dataclass(frozen=True)
class ClusterPeers:
    """What the serving pods talk to outside their namespace."""

    operator: PlatformPods
    prometheus: PlatformPods
    grafana: PlatformPods
    # The cluster's VPC: the load balancer's sources and ElastiCache's address.
    vpc_cidr: str


def tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _ip(cidr: str, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    block: dict[str, Any] = {"cidr": cidr}
    if exclude:
        block["except"] = list(exclude)
    return {"ipBlock": block}


def service_pods(service: str) -> dict[str, str]:
    """Every pod of one RayService (both clusters during an upgrade)."""
    return {SERVICE_LABEL: service}


def head_pods(service: str) -> dict[str, str]:
    """The head pods of one RayService."""
    return {**service_pods(service), kuberay.NODE_TYPE: "head"}


def worker_pods(service: str) -> dict[str, str]:
    """The worker pods of one RayService: the serve Service's endpoints."""
    return {**service_pods(service), kuberay.NODE_TYPE: "worker"}


def redis_cleanup_pods(service: str) -> dict[str, str]:
    """The pod of a RayService's Redis cleanup Job."""
    return {**service_pods(service), kuberay.NODE_TYPE: kuberay.REDIS_CLEANUP}


def scraped_ports(layout: Layout) -> list[Port]:
    """The ports Prometheus may reach on a RayService's pods."""
    ports = RAY_PORTS.scraped_on_head()
    return [*ports, RAY_PORTS.vllm_metrics] if layout == "vllm-server" else ports


def _ray_pods_policy(
    namespace: str, service: str, peers: ClusterPeers, layout: Layout, otlp_port: int | None = None
) -> dict[str, Any]:
    """Every pod of a RayService: its own RayService in and out, metrics to Prometheus, HTTPS out."""
    own = {"podSelector": {"matchLabels": service_pods(service)}}
    egress: list[dict[str, Any]] = [
        {"to": [own]},
        # S3 (model weights), the Kubernetes API (the head's
        # autoscaler) and, outside prod, the model hub.
        {"to": [_ip(ANYWHERE)], "ports": tcp(HTTPS)},
        # AWS credentials for the model reader's pod identity.
        {"to": [_ip(POD_IDENTITY_AGENT)], "ports": tcp(POD_IDENTITY_AGENT_PORT)},
    ]
    if otlp_port is not None and otlp_port != HTTPS:
        # The trace collector (observability.tracing), by port only: the
        # stack names it by host, which a NetworkPolicy can not; vLLM runs on
        # the GPU workers, Serve's replicas on the ingress and GPU workers.
        egress.append({"to": [_ip(ANYWHERE)], "ports": tcp(otlp_port)})
    return {
        "metadata": policy_metadata(f"{service}-ray", namespace),
        "spec": {
            "podSelector": {"matchLabels": service_pods(service)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                # Ray nodes talk to each other on many ports (GCS, raylets,
                # object managers, workers, NCCL): only within the RayService.
                {"from": [own]},
                {"from": [peer(peers.prometheus)], "ports": tcp(*(p.number for p in scraped_ports(layout)))},
            ],
            "egress": egress,
        },
    }


def _head_policy(
    namespace: str,
    service: str,
    peers: ClusterPeers,
    gcs_redis: bool,
    gateway_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A RayService's heads: the operator in (and the gateway that wakes its model); Prometheus, Grafana and
    the GCS Redis out."""
    ingress: list[dict[str, Any]] = [
        # Serve deploys and status (dashboard) and the head's Serve
        # health, which sets its `ray.io/serve` label.
        {"from": [peer(peers.operator)], "ports": tcp(*OPERATOR_PORTS)},
    ]
    if gateway_labels:
        # The gateway's wake: one request to Serve's proxy for a model at zero.
        ingress.append(
            {"from": [{"podSelector": {"matchLabels": dict(gateway_labels)}}], "ports": tcp(RAY_PORTS.wake.number)}
        )
    egress: list[dict[str, Any]] = [
        {"to": [peer(peers.prometheus)], "ports": tcp(*peers.prometheus.ports)},
        {"to": [peer(peers.grafana)], "ports": tcp(*peers.grafana.ports)},
    ]
    if gcs_redis:
        egress.append({"to": [_ip(peers.vpc_cidr)], "ports": tcp(REDIS_PORT)})
    return {
        "metadata": policy_metadata(f"{service}-ray-head", namespace),
        "spec": {
            "podSelector": {"matchLabels": head_pods(service)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def _redis_cleanup_policy(namespace: str, service: str, peers: ClusterPeers) -> dict[str, Any]:
    """The Redis cleanup Job's pod: out to the GCS Redis.

    When a GCS-fault-tolerant RayCluster is deleted (after every NewCluster
    upgrade), KubeRay runs a Job that deletes its data in Redis. Its pod is
    the head pod with `ray.io/node-type: redis-cleanup` (twin/kuberay.py
    build_redis_cleanup_pod), so the heads' Redis rule does not cover it,
    and without this rule every upgrade would leave its GCS data behind.
    """
    return {
        "metadata": policy_metadata(f"{service}-ray-redis-cleanup", namespace),
        "spec": {
            "podSelector": {"matchLabels": redis_cleanup_pods(service)},
            "policyTypes": ["Egress"],
            "egress": [{"to": [_ip(peers.vpc_cidr)], "ports": tcp(REDIS_PORT)}],
        },
    }


def _serve_policy(
    namespace: str,
    service: str,
    peers: ClusterPeers,
    batch_labels: Mapping[str, str] | None,
    layout: Layout,
    router_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A RayService's workers: the public port to the load balancer, or to its router when it has one
    (and to the batch workers)."""
    sources: list[dict[str, Any]] = (
        [{"podSelector": {"matchLabels": dict(router_labels)}}] if router_labels else [_ip(peers.vpc_cidr)]
    )
    if batch_labels:
        sources.append({"podSelector": {"matchLabels": dict(batch_labels)}})
    return {
        "metadata": policy_metadata(f"{service}-ray-serve", namespace),
        "spec": {
            "podSelector": {"matchLabels": worker_pods(service)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": tcp(RAY_PORTS.public(layout).number)}],
        },
    }


def ray_service_policies(
    namespace: str,
    service: str,
    peers: ClusterPeers,
    *,
    gcs_redis: bool,
    batch_labels: Mapping[str, str] | None = None,
    layout: Layout = "serve-ingress",
    otlp_port: int | None = None,
    router_labels: Mapping[str, str] | None = None,
    gateway_labels: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The policies of one RayService (all pods, heads, workers; the Redis cleanup Job's pod with a GCS Redis).

    `batch_labels`: the batch workers' pod labels when they send their
    requests to this RayService. `otlp_port`: the trace collector's port,
    when the stack names one. `router_labels`: its router's pods, when
    `serving.routing` puts one in front of it (router.py). `gateway_labels`:
    the model gateway's pods, when it wakes this RayService's model from zero
    (gateway.py).
    """
    policies = [
        _ray_pods_policy(namespace, service, peers, layout, otlp_port),
        _head_policy(namespace, service, peers, gcs_redis, gateway_labels),
        _serve_policy(namespace, service, peers, batch_labels, layout, router_labels),
    ]
    if gcs_redis:
        policies.append(_redis_cleanup_policy(namespace, service, peers))
    return policies


def serving_pods() -> dict[str, str]:
    """Pods whose Serve proxy takes traffic: the label KubeRay's serve Services select on.

    The batch workers call their model through its serve Service's cluster
    IP. The VPC CNI's policy agent sees that address, not the pod's (it
    filters before the Service's DNAT), and its controller adds a Service's
    cluster IP to an egress rule only when the rule's pod selector matches
    the Service's own selector (`ray.io/cluster` and `ray.io/serve`). A
    cluster's name changes with every upgrade, so the rule names the serve
    label alone: the serve port of any RayService's workers, which their
    load balancer exposes anyway.
    """
    return {kuberay.SERVE: "true"}


def head_service_pods() -> dict[str, str]:
    """Every RayService's heads, as an egress rule must name them to reach a head Service's cluster IP.

    The same rule of the VPC CNI's policy controller as `serving_pods`: a
    Service's cluster IP joins an egress rule only when the rule's pod
    selector matches the Service's own selector. KubeRay's head Service
    selects on the active cluster's name (which every NewCluster upgrade
    changes) and the node type, so the rule names the node type alone. What
    a client may reach on a given head is its head's own ingress rule
    (`_head_policy`).
    """
    return {kuberay.NODE_TYPE: "head"}


def batch_worker_policy(
    name: str, namespace: str, labels: Mapping[str, str], vpc_cidr: str, serve_port: Port = RAY_PORTS.serve
) -> dict[str, Any]:
    """Batch workers: nothing in; the public port of their RayService's kind, AWS APIs and credentials out.

    `serve_port`: the port their model's serve Service targets (ports.RayPorts.public).
    """
    return {
        "metadata": policy_metadata(name, namespace),
        "spec": {
            "podSelector": {"matchLabels": dict(labels)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": serving_pods()}}], "ports": tcp(serve_port.number)},
                # SQS and S3 on their public endpoints (through the NAT), not
                # anything inside the VPC.
                {"to": [_ip(ANYWHERE, exclude=(vpc_cidr,))], "ports": tcp(HTTPS)},
                {"to": [_ip(POD_IDENTITY_AGENT)], "ports": tcp(POD_IDENTITY_AGENT_PORT)},
            ],
        },
    }
