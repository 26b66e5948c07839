"""The request router in front of one vllm-server service's replicas: vllm-router, discovered by label.

Why vllm-router (vllm-project/router, the release workloads/requirements.txt
pins into the serving image), over what else routes vLLM requests:

- The Gateway API Inference Extension (an InferencePool and its endpoint
  picker) needs a Gateway implementation and the picker's Go images: two more
  controllers to run and upgrade, and nothing of it runs outside a cluster,
  so no replay here could show what it does with our traffic.
- Ray Serve's PrefixCacheAffinityRouter routes between Serve replicas: it
  works only where Serve's proxy carries every request, the serve-ingress
  path the vllm-server layout exists to avoid.
- vllm-router is one binary (Rust, in a Python wheel) with prefix-cache
  (`cache_aware`), keyed affinity (`consistent_hash`), least-loaded
  (`power_of_two`) and `round_robin` policies,
  Kubernetes discovery by label selector that follows pod readiness, health
  checks, retries, a bounded queue and Prometheus metrics. It runs here, so
  the same release is what the tests and the replays run.

The load balancer's Service selects the router's pods instead of the
replicas' (endpoint.load_balancer_service), on the port name clients already
reach (`openai`), so the base URL does not change when routing is switched
on; the replicas' `openai` port then admits the router and no longer the
VPC (network.ray_service_policies). The router finds the replicas through
the Kubernetes API (list and watch pods in this namespace, nothing else),
selecting the model's GPU workers by the labels KubeRay puts on them
(kuberay.py, checked against twin/kuberay.py), and sends only to Ready pods:
a replica is Ready while its vLLM server answers `/health`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import Routing, StackConfig, longest_generation_seconds
from infra.config.fields import whole_cores
from infra.scheduling import Placement
from infra.serving import kuberay
from infra.serving.drain import PROXY_DRAIN_SECONDS
from infra.serving.endpoint import serving_workers
from infra.serving.namespace import PART_OF, peer, policy_metadata
from infra.serving.network import ANYWHERE, HTTPS, ClusterPeers, tcp
from infra.serving.pod_security import (
    RAY_GID,
    RAY_UID,
    SERVING_IMAGE_UID_SKIP,
    checkov_skips,
    container_security_context,
    pod_security_context,
)
from infra.serving.ports import RAY_PORTS, Port
from infra.serving.ray_service import worker_group_name
from infra.serving.replicated import (
    DeploymentSite,
    cpu_autoscaler,
    cpu_limit,
    declare_scaling_and_monitoring,
    disruption_budget,
    pod_monitor,
    spread,
)
from infra.serving.router_front import (
    CONFIG_DIR,
    CONFIG_FILE,
    FRONT_CPU,
    FRONT_CPU_LIMIT,
    FRONT_MEMORY,
    FRONT_PORT,
    LIVENESS_PATH,
    POD_SCRATCH,
    READINESS_PATH,
    ROUTER_BACKEND,
    FrontPlan,
    config_digest,
)

ROUTER_NAME_LABEL = {"app.kubernetes.io/name": "llm-router"}
# Which RayService's replicas a router pod sends to.
ROUTER_OF = "llm-platform/router-of"
# The pod answers on the port name and number the replicas' servers use, so
# the load balancer's target port and the clients' URL are the same with or
# without it; its front (router_front.py) listens there, the router behind it.
ROUTER_PORT = FRONT_PORT
ROUTER_METRICS = Port("router-metrics", 29000)
# The pod's two containers.
ROUTER_CONTAINER = "router"
FRONT_CONTAINER = "front"
# The pod's annotation carrying its front's config digest.
FRONT_CONFIG_DIGEST = "llm-platform/router-front-config"
# vllm-router's async runtime (tokio) starts a worker thread for every core
# it sees, and in a pod that is the node's cores (8 on prod's m7i.2xlarge
# system nodes), not its CPU. Eight threads spend a 2-CPU quota in a
# quarter of each CFS period, and the container is then throttled for the
# rest of it: a pause that every request in flight waits out. tokio takes
# the count from this variable instead (the pinned release honours it:
# tests/test_serving_router.py counts the threads). The count is the cores
# the router's request holds (runtime_threads), not its limit: every
# streamed chunk wakes the runtime, and a second worker turns a wake into a
# hand-off between threads. Measured with `python -m benchmarks.router_hop`
# (prod's router and front, 32 streams of 33 chunks, free to use both of
# the machine's cores), one worker spent 1020 us of CPU a request against
# 1470 with two, at the same rate. The autoscaler holds the router at 70%
# of its request, below what one worker per requested core can do, so a
# second worker would make every request dearer, and add router pods.
RUNTIME_THREADS_ENV = "TOKIO_WORKER_THREADS"
# The router's CPU limit when twice its request is less (replicated.cpu_limit).
ROUTER_CPU_LIMIT = "2"
# How often the router checks each replica's /health itself (its own default
# is 60 s); Kubernetes readiness removes a failing replica sooner still.
HEALTH_CHECK_INTERVAL_S = 10
# Failed checks in a row after which it sends the replica nothing (the
# release's default, set so the runbook states it): measured, a replica
# whose /health fails gets requests for about 30 s, then the router answers
# 503 itself (tests/test_router_failures.py), which LlmRouterCircuitsOpen reads.
HEALTH_FAILURES = 3


# The wait before a request's second attempt (the release's default, doubling after).
RETRY_FIRST_BACKOFF_MS = 50


def failure_args(routing: Routing) -> list[str]:
    """What the router does with an attempt a replica fails (`serving.routing.attempts`, `.circuit_breaker`).

    Measured against the pinned release (tests/test_router_failures.py): a
    5xx, a 429, and a cut or refused connection are tried again, on another
    replica where there is one; only a 5xx or a connection error counts
    towards a circuit, never a 4xx (429 included), so a client with a bad key
    can not open one. Every value is set here rather than left to the
    release, so LlmRouterCircuitsOpen's runbook and docs/routing.md state
    what the pods run, whichever release the image pins.
    """
    # --retry-max-retries counts every attempt, the first included.
    args = ["--retry-max-retries", str(routing.attempts), "--retry-initial-backoff-ms", str(RETRY_FIRST_BACKOFF_MS)]
    breaker = routing.circuit_breaker
    if not breaker.enabled:
        return [*args, "--disable-circuit-breaker"]
    return [
        *args,
        "--cb-failure-threshold",
        str(breaker.failures),
        "--cb-window-duration-secs",
        str(breaker.window_s),
        "--cb-timeout-duration-secs",
        str(breaker.open_s),
        "--cb-success-threshold",
        str(breaker.close_after),
    ]


# A router pod being deleted (a rollout of a changed router, a scale-down, a
# node drain) leaves the load balancer's targets while Kubernetes sends it
# SIGTERM, and the NLB keeps sending new connections for a while after. So
# its preStop hook waits as long as the load balancer is given to stop
# sending to a draining Serve proxy; then SIGTERM, on which vllm-router stops
# accepting and finishes the requests it holds before it exits (measured in
# tests/test_router_drain.py), each within its request timeout.
DEREGISTER_SECONDS = PROXY_DRAIN_SECONDS
# After its last request, the process's own exit.
EXIT_SECONDS = 5


def router_name(service: str) -> str:
    """The router's Deployment, Service account and policies of one RayService."""
    return f"{service}-router"


def router_pods(service: str) -> dict[str, str]:
    """The router pods of one RayService (the load balancer's endpoints when routing is on)."""
    return {**ROUTER_NAME_LABEL, ROUTER_OF: service}


def replica_selector(service: str, worker_group: str) -> dict[str, str]:
    """The pods the router sends to: the load balancer's serving workers, of the model's GPU group.

    `llm-platform/ray-service` is on the pods of both clusters of a
    NewCluster upgrade, so the new cluster's replicas join as they turn
    Ready and the old ones leave as their drain makes them unready.
    """
    return {**serving_workers(service), kuberay.GROUP: worker_group}


@dataclass(frozen=True)
class RouterPlan:
    """One vllm-server service's router: the replicas it selects, its command line, its request timeout."""

    selector: dict[str, str]
    command: list[str]
    # The longest generation the limits allow at the SLO's pace: what a stopping router lets finish.
    request_timeout_s: int
    # The nginx in front of it, which alone the load balancer reaches.
    front: FrontPlan
    # The router container's environment (runtime_env).
    env: dict[str, str]
    # The model scales to zero and the gateway wakes it (StackConfig.woken_services).
    woken: bool = False

    @property
    def readiness_path(self) -> str:
        """What the pod's readiness asks the router: a replica to send to, or for a woken model only that it runs.

        At zero a woken model has no replica, and the gateway must still reach
        its router to hear "no worker" (and so hold the request while it wakes
        the model): a router Ready only with a replica would leave the
        gateway's Service with no endpoint.
        """
        return LIVENESS_PATH if self.woken else READINESS_PATH

    @property
    def grace_seconds(self) -> int:
        """The pod's terminationGracePeriodSeconds: the preStop wait, every request it holds, its exit."""
        return DEREGISTER_SECONDS + self.request_timeout_s + EXIT_SECONDS


def router_plans(cfg: StackConfig) -> dict[str, RouterPlan]:
    """Each vllm-server service's router, as the render declares it (the twin runs the same command)."""
    timeout = math.ceil(longest_generation_seconds(cfg))
    woken = set(cfg.woken_services())
    plans = {}
    for service, models in cfg.services().items():
        if cfg.layout_of(service) != "vllm-server":
            continue
        (model,) = models  # vllm-server serves one model per service (serving.vllm_server_problem)
        selector = replica_selector(service, worker_group_name(model))
        plans[service] = RouterPlan(
            selector,
            router_args(cfg.serving.routing, cfg.serving.namespace, selector, timeout),
            timeout,
            FrontPlan.of(cfg.serving.limits, timeout),
            runtime_env(cfg.serving.routing),
            woken=service in woken,
        )
    return plans


def runtime_threads(cpu_request: str) -> int:
    """The router's runtime threads for a CPU request: one per core it holds, a part counted whole."""
    return whole_cores(cpu_request)


def runtime_env(routing: Routing) -> dict[str, str]:
    """The router container's environment: as many runtime threads as its CPU request has cores."""
    return {RUNTIME_THREADS_ENV: str(runtime_threads(routing.cpu))}


def router_cpu_limit(routing: Routing) -> str:
    """The router container's CPU limit (replicated.cpu_limit)."""
    return cpu_limit(routing.cpu, ROUTER_CPU_LIMIT)


def router_args(routing: Routing, namespace: str, selector: Mapping[str, str], request_timeout_s: int) -> list[str]:
    """vllm-router's command line (its flags in vllm_router/router_args.py of the pinned release)."""
    args = [
        "vllm-router",
        "--host",
        "127.0.0.1",  # its control routes need no key: only the pod's front reaches it
        "--port",
        str(ROUTER_BACKEND.number),
        "--service-discovery",
        "--service-discovery-namespace",
        namespace,
        "--service-discovery-port",
        str(RAY_PORTS.openai.number),
        "--selector",
        *(f"{k}={v}" for k, v in selector.items()),
        "--policy",
        routing.policy,
        "--health-check-endpoint",
        "/health",
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--request-timeout-secs",
        str(request_timeout_s),
        "--queue-size",
        str(routing.queue_size),
        "--queue-timeout-secs",
        str(routing.queue_timeout_s),
        *failure_args(routing),
        "--prometheus-host",
        "0.0.0.0",  # scraped by Prometheus alone (NetworkPolicy)
        "--prometheus-port",
        str(ROUTER_METRICS.number),
        "--log-level",
        "info",
    ]
    if routing.policy == "cache_aware":
        args += [
            "--cache-threshold",
            str(routing.cache_threshold),
            "--balance-abs-threshold",
            str(routing.balance_abs_threshold),
            "--balance-rel-threshold",
            str(routing.balance_rel_threshold),
        ]
    return args


def role(service: str, namespace: str) -> dict[str, Any]:
    """What the router may read: pods in its own namespace, to follow the replicas and their readiness."""
    return {
        "metadata": {"name": router_name(service), "namespace": namespace, "labels": dict(PART_OF)},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def _router_container(routing: Routing, image: pulumi.Input[str], plan: RouterPlan) -> dict[str, Any]:
    return {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": plan.command,
        "env": [{"name": name, "value": value} for name, value in plan.env.items()],
        # Its API port is on loopback (router_front.py); only the metrics are on the pod's address.
        "ports": [ROUTER_METRICS.container_port()],
        # Through the front, the only way in from the kubelet: a router that
        # stops answering is restarted.
        "livenessProbe": {
            "httpGet": {"path": LIVENESS_PATH, "port": ROUTER_PORT.name},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": routing.cpu, "memory": routing.memory},
            "limits": {"cpu": router_cpu_limit(routing), "memory": routing.memory},
        },
        "securityContext": container_security_context(read_only_root=True),
        # Kubernetes' own sleep (no binary in the image needed): the load balancer stops sending first.
        "lifecycle": {"preStop": {"sleep": {"seconds": DEREGISTER_SECONDS}}},
    }


# Room for the request bodies it holds while they arrive (each under the guard's cap).
FRONT_SCRATCH = "1Gi"


def _front_container(image: pulumi.Input[str], readiness_path: str) -> dict[str, Any]:
    return {
        "name": FRONT_CONTAINER,
        # The stack's own copy of the front, by digest (infra/aws/front_image.py).
        "image": image,
        "command": ["nginx", "-c", f"{CONFIG_DIR}/{CONFIG_FILE}", "-e", "stderr", "-g", "daemon off;"],
        "ports": [ROUTER_PORT.container_port()],
        # The router's readiness, through the front: Ready once the router has
        # a healthy replica to send to and the front passes to it, so a pod
        # that has found none takes no connection from the load balancer
        # (for a model the gateway wakes, once it runs: RouterPlan.readiness_path).
        "readinessProbe": {
            "httpGet": {"path": readiness_path, "port": ROUTER_PORT.name},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {"tcpSocket": {"port": ROUTER_PORT.name}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": FRONT_CPU, "memory": FRONT_MEMORY},
            "limits": {"cpu": FRONT_CPU_LIMIT, "memory": FRONT_MEMORY},
        },
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [
            {"name": "front-config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "front-scratch", "mountPath": POD_SCRATCH},
        ],
        # As the router's: the load balancer stops sending first. Then the
        # image's stop signal, SIGQUIT, on which nginx finishes the requests
        # it holds before it exits.
        "lifecycle": {"preStop": {"sleep": {"seconds": DEREGISTER_SECONDS}}},
    }


# checkov's checks the router pod can not meet, and why.
ROUTER_CHECKOV_SKIPS = {
    **SERVING_IMAGE_UID_SKIP,
    "CKV_K8S_9": "the router listens on the pod's loopback only; the front container's readiness probe asks the "
    "router's own readiness through it, so the pod is Ready only when the router is",
    "CKV_K8S_38": "the router discovers its replicas by listing and watching pods in its namespace (its Role), "
    "which needs the service account's token",
}


def front_config_map(service: str, namespace: str, plan: RouterPlan) -> dict[str, Any]:
    """The front's nginx.conf, mounted read-only."""
    return {
        "metadata": {"name": f"{router_name(service)}-front", "namespace": namespace, "labels": dict(PART_OF)},
        "data": {CONFIG_FILE: plan.front.config()},
    }


def deployment(
    service: str,
    namespace: str,
    routing: Routing,
    image: pulumi.Input[str],
    front_image: pulumi.Input[str],
    system: Placement,
    plan: RouterPlan,
) -> dict[str, Any]:
    """The router Deployment: non-root, read-only root, spread over zones and nodes.

    `image` is the serving image the router runs from; `front_image` the
    front's, both by digest.
    """
    labels = {**PART_OF, **router_pods(service)}
    return {
        "metadata": {
            "name": router_name(service),
            "namespace": namespace,
            "labels": labels,
            "annotations": checkov_skips(ROUTER_CHECKOV_SKIPS),
        },
        "spec": {
            # The HorizontalPodAutoscaler owns the count once it exists; this is the start.
            "replicas": routing.min_replicas,
            "selector": {"matchLabels": router_pods(service)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels,
                    # A changed front config rolls the pods (nginx reads it once, at start).
                    "annotations": {FRONT_CONFIG_DIGEST: config_digest(plan.front.config())},
                },
                "spec": {
                    **system.pod_scheduling(),
                    "serviceAccountName": router_name(service),
                    # The token is how it lists and watches the replicas.
                    "automountServiceAccountToken": True,
                    "securityContext": pod_security_context(RAY_UID, RAY_GID),
                    "topologySpreadConstraints": spread(router_pods(service)),
                    "terminationGracePeriodSeconds": plan.grace_seconds,
                    "containers": [
                        _front_container(front_image, plan.readiness_path),
                        _router_container(routing, image, plan),
                    ],
                    "volumes": [
                        {"name": "front-config", "configMap": {"name": f"{router_name(service)}-front"}},
                        # On the node's disk, not memory: large request bodies wait here.
                        {"name": "front-scratch", "emptyDir": {"sizeLimit": FRONT_SCRATCH}},
                    ],
                },
            },
        },
    }


def network_policy(
    service: str,
    namespace: str,
    peers: ClusterPeers,
    selector: Mapping[str, str],
    gateway_pods: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The router: the load balancer in, Prometheus to its metrics; out to its replicas and the Kubernetes API.

    A network load balancer with IP targets connects from its own addresses
    in the VPC, so the VPC is the source here, as it was on the replicas'
    port before; `loadBalancerSourceRanges` limits the clients at the load
    balancer. The API server's addresses are not known to a NetworkPolicy,
    so HTTPS goes out to any address, as it does for the Ray heads.
    `gateway_pods`: the model gateway's (gateway.py), named as well, since
    their addresses need not be in the VPC's range (custom networking).
    """
    sources: list[dict[str, Any]] = [{"ipBlock": {"cidr": peers.vpc_cidr}}]
    if gateway_pods:
        sources.append({"podSelector": {"matchLabels": dict(gateway_pods)}})
    return {
        "metadata": policy_metadata(router_name(service), namespace),
        "spec": {
            "podSelector": {"matchLabels": router_pods(service)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": sources, "ports": tcp(ROUTER_PORT.number)},
                {"from": [peer(peers.prometheus)], "ports": tcp(ROUTER_METRICS.number)},
            ],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": dict(selector)}}], "ports": tcp(RAY_PORTS.openai.number)},
                {"to": [{"ipBlock": {"cidr": ANYWHERE}}], "ports": tcp(HTTPS)},
            ],
        },
    }


def _scaling_and_monitoring(
    service: str, routing: Routing, site: DeploymentSite
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The router's budget, autoscaler and PodMonitor."""
    name, pods = router_name(service), router_pods(service)
    return (
        disruption_budget(name, site.namespace, pods),
        # Its count follows its CPU: it parses every request and matches every prompt.
        cpu_autoscaler(
            name, site.namespace, routing.min_replicas, routing.max_replicas, routing.target_cpu_utilization
        ),
        # Its own registry (vllm_router_* series), with the RayService it routes for on every series.
        pod_monitor(
            name, site.namespace, pods, ROUTER_METRICS, site.prometheus_selector_labels, target_labels=[ROUTER_OF]
        ),
    )


@dataclass(frozen=True)
class RequestRouterArgs:
    """One vllm-server RayService's router: its settings, where it runs, what it sends to."""

    service: str
    routing: Routing
    # Its replicas and command line (router_plans).
    plan: RouterPlan
    site: DeploymentSite
    # The front's image by digest (the AWS layer's copy, infra/aws/front_image.py).
    front_image: pulumi.Input[str]
    # The model gateway's pods, when `serving.gateway` puts one in front of the routers.
    gateway_pods: Mapping[str, str] | None = None


class RequestRouter(pulumi.ComponentResource):
    """vllm-router for one RayService: account, role, Deployment, budget, autoscaler, policy, monitor."""

    def __init__(self, name: str, args: RequestRouterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:RequestRouter", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        service, site = args.service, args.site
        namespace = site.namespace
        selector = args.plan.selector
        meta = k8s.meta.v1.ObjectMetaArgs(name=router_name(service), namespace=namespace, labels=dict(PART_OF))
        account = k8s.core.v1.ServiceAccount(f"{name}-account", metadata=meta, opts=k8s_opts)
        rules = role(service, namespace)
        reader = k8s.rbac.v1.Role(f"{name}-role", metadata=rules["metadata"], rules=rules["rules"], opts=k8s_opts)
        binding = k8s.rbac.v1.RoleBinding(
            f"{name}-binding",
            metadata=meta,
            role_ref=k8s.rbac.v1.RoleRefArgs(
                api_group="rbac.authorization.k8s.io", kind="Role", name=router_name(service)
            ),
            subjects=[k8s.rbac.v1.SubjectArgs(kind="ServiceAccount", name=router_name(service), namespace=namespace)],
            opts=k8s_opts,
        )
        policy = network_policy(service, namespace, site.peers, selector, args.gateway_pods)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-policy", metadata=policy["metadata"], spec=policy["spec"], opts=k8s_opts
        )
        front = front_config_map(service, namespace, args.plan)
        front_config = k8s.core.v1.ConfigMap(
            f"{name}-front", metadata=front["metadata"], data=front["data"], opts=k8s_opts
        )
        manifest = deployment(service, namespace, args.routing, site.image, args.front_image, site.system, args.plan)
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[account, reader, binding, front_config],
                # The autoscaler owns the count after the first apply.
                ignore_changes=["spec.replicas"],
            ),
        )
        declare_scaling_and_monitoring(name, self, *_scaling_and_monitoring(service, args.routing, site))
        self.pod_labels = router_pods(service)
        self.register_outputs({"deployment": self.deployment.metadata.name})
