"""The model gateway: one load balancer for the models of several vllm-server services (`serving.gateway`).

Each vllm-server service serves one model behind its own load balancer and
router (router.py). The gateway is the one address in front of all of them:
it reads each request's `model` and sends the request to that model's
router, whose replicas then answer it. Why not vllm-router's own
multi-model mode (`--enable-igw`), read in the pinned release's source:
its discovery asks each replica's `/v1/models` without a key, which the
replicas' guard refuses; its own `/v1/models` is not OpenAI's list; and a
request for a model with no Ready replica falls back to every replica, so it
reaches another model's server. The gateway (workloads/inference_server/
gateway.py) checks the API key first, answers an unknown model with
OpenAI's 404 and a model whose router can not be reached with a 503 and
`Retry-After`, lists every model on `/v1/models`, and streams each token as
the router sends it.

What it renders: a Deployment from the serving image (two replicas or more
in prod, spread over zones, a PodDisruptionBudget, a HorizontalPodAutoscaler
on CPU), a ClusterIP Service per model's router (what the gateway's routes
name), a network load balancer Service like each service's own, a
NetworkPolicy (the VPC in, its routers out) and a PodMonitor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import Endpoint, Gateway, StackConfig
from infra.config.cold_start import cold_start_budget
from infra.scheduling import Placement
from infra.serving import kuberay
from infra.serving.endpoint import load_balancer_service, public_address
from infra.serving.namespace import PART_OF, peer, policy_metadata
from infra.serving.network import ClusterPeers, head_service_pods, tcp
from infra.serving.pod_security import (
    RAY_GID,
    RAY_UID,
    SERVING_IMAGE_UID_SKIP,
    checkov_skips,
    container_security_context,
    pod_security_context,
)
from infra.serving.ports import RAY_PORTS, Port
from infra.serving.replicated import (
    DeploymentSite,
    cpu_autoscaler,
    cpu_limit,
    declare_scaling_and_monitoring,
    disruption_budget,
    pod_monitor,
    spread,
)
from infra.serving.router import DEREGISTER_SECONDS, EXIT_SECONDS, ROUTER_PORT, router_plans, router_pods
from infra.serving.serve_config import MOUNTS
from workloads.inference_server.catalog import Catalog
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings, Wake

GATEWAY_LABEL = {"app.kubernetes.io/name": "llm-gateway"}
# Clients reach it on the port name and number the routers and replicas use,
# so a model's base URL and the gateway's differ only in their host.
GATEWAY_PORT = ROUTER_PORT
GATEWAY_METRICS = Port("gateway-metrics", 29001)
CONTAINER = "gateway"
# The gateway's CPU limit when twice its request is less (replicated.cpu_limit).
GATEWAY_CPU_LIMIT = "2"


def upstream_name(service: str) -> str:
    """The ClusterIP Service in front of one model's router pods (a route of the gateway)."""
    return f"{service}-router"


@dataclass(frozen=True)
class GatewayPlan:
    """What the gateway sends where: model id -> the RayService whose router serves it, and its limits."""

    # Model id -> the RayService (one model each under vllm-server).
    models: Mapping[str, str]
    namespace: str
    # The body cap every replica's guard holds (router_front.body_cap).
    max_body_bytes: int
    # The longest generation the limits allow at the SLO's pace (the routers' request timeout).
    request_timeout_s: int
    # Model id -> its cold-start budget in seconds, for the models at min_replicas 0 (the gateway wakes them).
    cold_starts: Mapping[str, float] = field(default_factory=dict)
    wake_hold_s: int = Gateway.model_fields["wake_hold_seconds"].default
    wake_max_held: int = Gateway.model_fields["wake_max_held"].default

    def wake(self, model: str) -> Wake:
        """How the gateway wakes `model`: one request to the Serve proxy on its RayService's head."""
        head = kuberay.head_service(self.models[model])
        return Wake(
            url=f"http://{head}.{self.namespace}.svc:{RAY_PORTS.wake.number}/",
            hold_s=float(self.wake_hold_s),
            max_held=self.wake_max_held,
            cold_start_s=round(self.cold_starts[model]),
        )

    @property
    def woken(self) -> list[str]:
        """The RayServices whose model the gateway wakes."""
        return sorted({self.models[m] for m in self.cold_starts})

    def settings(self) -> GatewaySettings:
        """The gateway process's settings: its routes, where the keys are mounted, its limits (never keys)."""
        port = GATEWAY_PORT.number
        return GatewaySettings(
            host="0.0.0.0",
            port=port,
            metrics_port=GATEWAY_METRICS.number,
            routes={
                model: f"http://{upstream_name(service)}.{self.namespace}.svc:{port}"
                for model, service in self.models.items()
            },
            api_keys_file=MOUNTS.api_keys_file,
            # The same fallback variable every server's guard reads (catalog.Catalog).
            api_keys_env=Catalog.model_fields["api_keys_env"].default,
            max_body_bytes=self.max_body_bytes,
            request_timeout_s=float(self.request_timeout_s),
            # The pod's preStop sleep already waits for the load balancer (below).
            drain_s=0.0,
            wake={model: self.wake(model) for model in self.cold_starts},
        )

    @property
    def grace_seconds(self) -> int:
        """terminationGracePeriodSeconds: the preStop wait, the longest request it holds, its exit."""
        return DEREGISTER_SECONDS + self.request_timeout_s + EXIT_SECONDS


def woken_cold_starts(cfg: StackConfig) -> dict[str, float]:
    """Model id -> its cold-start budget in seconds, for each model the gateway wakes (vllm-server at zero)."""
    woken = set(cfg.woken_services())
    return {m.model_id: cold_start_budget(cfg, m).total for m in cfg.models if m.service_name in woken}


def gateway_plan(cfg: StackConfig) -> GatewayPlan:
    """The gateway in front of the stack's routers, as the render declares it (the twin runs the same)."""
    plans = router_plans(cfg)
    # Under vllm-server each service serves one model (serving.vllm_server_problem).
    models = {models[0].model_id: service for service, models in cfg.services().items() if service in plans}
    if not models:
        raise ValueError("no service runs the vllm-server layout: the gateway has no router to send to")
    # Every router holds the same limits (the stack's): the first one's are the gateway's.
    first = next(iter(plans.values()))
    gw = cfg.serving.gateway
    return GatewayPlan(
        models,
        cfg.serving.namespace,
        first.front.max_body_bytes,
        first.request_timeout_s,
        cold_starts=woken_cold_starts(cfg),
        wake_hold_s=gw.wake_hold_seconds,
        wake_max_held=gw.wake_max_held,
    )


def _container(gateway: Gateway, image: pulumi.Input[str], plan: GatewayPlan) -> dict[str, Any]:
    """The gateway process: the rendered settings in its environment, the keys from the mounted Secret."""
    return {
        "name": CONTAINER,
        "image": image,
        "command": ["python", "-m", "inference_server.gateway"],
        # Locations and limits only: the keys come from the mounted Secret.
        "env": [{"name": SETTINGS_ENV, "value": plan.settings().model_dump_json()}],
        "ports": [GATEWAY_PORT.container_port(), GATEWAY_METRICS.container_port()],
        # /health answers 503 from SIGTERM on, so a stopping gateway leaves the targets.
        "readinessProbe": {"httpGet": {"path": "/health", "port": GATEWAY_PORT.name}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": GATEWAY_PORT.name}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": gateway.cpu, "memory": gateway.memory},
            # A ceiling for a runaway, well above what the autoscaler holds it to
            # (a quota it reached would hold back every token it streams).
            "limits": {"cpu": cpu_limit(gateway.cpu, GATEWAY_CPU_LIMIT), "memory": gateway.memory},
        },
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [{"name": "api-keys", "mountPath": MOUNTS.api_keys_dir, "readOnly": True}],
        # As the routers': the load balancer stops sending first, then SIGTERM,
        # on which the gateway takes no new connection and finishes what it holds.
        "lifecycle": {"preStop": {"sleep": {"seconds": DEREGISTER_SECONDS}}},
    }


def deployment(
    gateway: Gateway,
    namespace: str,
    image: pulumi.Input[str],
    system: Placement,
    plan: GatewayPlan,
    api_keys_secret: str,
) -> dict[str, Any]:
    """The gateway Deployment: non-root, read-only root, no API token, the API keys' Secret read-only."""
    labels = {**PART_OF, **GATEWAY_LABEL}
    return {
        "metadata": {
            "name": gateway.name,
            "namespace": namespace,
            "labels": labels,
            "annotations": checkov_skips(SERVING_IMAGE_UID_SKIP),
        },
        "spec": {
            # The HorizontalPodAutoscaler owns the count once it exists; this is the start.
            "replicas": gateway.min_replicas,
            "selector": {"matchLabels": dict(GATEWAY_LABEL)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    **system.pod_scheduling(),
                    "serviceAccountName": gateway.name,
                    # It calls no Kubernetes API.
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security_context(RAY_UID, RAY_GID),
                    "topologySpreadConstraints": spread(GATEWAY_LABEL),
                    "terminationGracePeriodSeconds": plan.grace_seconds,
                    "containers": [_container(gateway, image, plan)],
                    "volumes": [{"name": "api-keys", "secret": {"secretName": api_keys_secret, "defaultMode": 0o444}}],
                },
            },
        },
    }


def upstream_service(service: str, namespace: str) -> dict[str, Any]:
    """A ClusterIP Service selecting one model's router pods, on their API port."""
    return {
        "metadata": {"name": upstream_name(service), "namespace": namespace, "labels": dict(PART_OF)},
        "spec": {
            "type": "ClusterIP",
            "selector": router_pods(service),
            "ports": [
                {
                    "name": ROUTER_PORT.name,
                    "port": ROUTER_PORT.number,
                    "targetPort": ROUTER_PORT.name,
                    "protocol": "TCP",
                }
            ],
        },
    }


def public_service(gateway: Gateway, namespace: str, endpoint: Endpoint, vpc_cidr: str) -> dict[str, Any]:
    """The gateway's network load balancer: the same settings as each service's own (endpoint.py)."""
    manifest = load_balancer_service(
        gateway.name, namespace, endpoint, "vllm-server", vpc_cidr=vpc_cidr, router_labels=GATEWAY_LABEL
    )
    # Not a RayService's Service: labelled as the gateway's.
    manifest["metadata"]["labels"] = {**PART_OF, **GATEWAY_LABEL}
    return manifest


def network_policy(
    gateway: Gateway, namespace: str, peers: ClusterPeers, services: list[str], woken: list[str]
) -> dict[str, Any]:
    """The load balancer in, Prometheus to the metrics; out only to the models' routers (and, for the models
    it wakes, to Serve's proxy on the heads, whose own policy admits the gateway only on a woken model's head)."""
    egress: list[dict[str, Any]] = [
        {
            "to": [{"podSelector": {"matchLabels": router_pods(s)}} for s in services],
            "ports": tcp(ROUTER_PORT.number),
        }
    ]
    if woken:
        egress.append(
            {"to": [{"podSelector": {"matchLabels": head_service_pods()}}], "ports": tcp(RAY_PORTS.wake.number)}
        )
    return {
        "metadata": policy_metadata(gateway.name, namespace),
        "spec": {
            "podSelector": {"matchLabels": dict(GATEWAY_LABEL)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"ipBlock": {"cidr": peers.vpc_cidr}}], "ports": tcp(GATEWAY_PORT.number)},
                {"from": [peer(peers.prometheus)], "ports": tcp(GATEWAY_METRICS.number)},
            ],
            "egress": egress,
        },
    }


@dataclass(frozen=True)
class ModelGatewayArgs:
    """The gateway's settings, where it runs, and the routers it sends to."""

    gateway: Gateway
    endpoint: Endpoint
    plan: GatewayPlan
    site: DeploymentSite
    # The Secret holding the API keys file every server's guard reads (ServingNamespace).
    api_keys_secret: str


class ModelGateway(pulumi.ComponentResource):
    """One address for several models: account, Deployment, router Services, load balancer, budget, policy."""

    url: pulumi.Output[str]
    hostname: pulumi.Output[str]

    def __init__(self, name: str, args: ModelGatewayArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:ModelGateway", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        gw, site = args.gateway, args.site
        namespace = site.namespace
        services = sorted(set(args.plan.models.values()))
        account = k8s.core.v1.ServiceAccount(
            f"{name}-account",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=gw.name, namespace=namespace, labels=dict(PART_OF)),
            automount_service_account_token=False,
            opts=k8s_opts,
        )
        for service in services:
            upstream = upstream_service(service, namespace)
            k8s.core.v1.Service(
                f"{name}-{service}-upstream", metadata=upstream["metadata"], spec=upstream["spec"], opts=k8s_opts
            )
        policy = network_policy(gw, namespace, site.peers, services, args.plan.woken)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-policy", metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
        )
        manifest = deployment(gw, namespace, site.image, site.system, args.plan, args.api_keys_secret)
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[account], ignore_changes=["spec.replicas"]),
        )
        declare_scaling_and_monitoring(
            name,
            self,
            disruption_budget(gw.name, namespace, GATEWAY_LABEL),
            # Its count follows its CPU: it reads every request's body and copies every chunk.
            cpu_autoscaler(gw.name, namespace, gw.min_replicas, gw.max_replicas, gw.target_cpu_utilization),
            # Its llm_gateway_* series.
            pod_monitor(gw.name, namespace, GATEWAY_LABEL, GATEWAY_METRICS, site.prometheus_selector_labels),
        )
        public = public_service(gw, namespace, args.endpoint, site.peers.vpc_cidr)
        self.service = k8s.core.v1.Service(
            f"{name}-public",
            metadata=public["metadata"],
            spec=public["spec"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.deployment]),
        )
        self.hostname, self.url = public_address(self.service, gw.name, args.endpoint, "vllm-server")
        self.pod_labels = dict(GATEWAY_LABEL)
        self.register_outputs({"url": self.url, "hostname": self.hostname})
