"""Who can reach which port of which pod, computed from the rendered NetworkPolicies.

The evaluator below implements the NetworkPolicy semantics
(kubernetes.io/docs/concepts/services-networking/network-policies):

- a pod is isolated for ingress (egress) when any policy in its namespace
  selects it and lists Ingress (Egress) in its policyTypes; an isolated pod
  admits a connection only if some rule of such a policy allows it;
- a rule allows a peer when one of its `from`/`to` elements matches (an
  absent or empty list matches everything), and a port when one of its
  `ports` matches (absent or empty: every port);
- in one element, `namespaceSelector` and `podSelector` must both match;
  a `podSelector` alone means the policy's own namespace; `ipBlock` matches
  addresses in its CIDR and outside its `except`s;
- a connection needs the source's egress and the target's ingress.

The VPC CNI gives pods VPC addresses and its policy agent matches them
against ipBlocks, so pods here have VPC addresses and ipBlocks match them.
Kubelet's probes come from the pod's own node, which is always allowed, so
they are not part of the matrix.

Every source pod below is tried against every target and port, and the
whole matrix must equal `expected`, the matrix in words of docs/security.md
("Who can reach what").
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import pytest

from infra.cluster_services import kuberay as kuberay_part
from infra.cluster_services import monitoring
from infra.config import StackConfig
from infra.render import Rendered
from infra.serving.batch import WORKER_NAME, worker_labels
from infra.serving.build import batch_service
from infra.serving.gateway import GATEWAY_LABEL, GATEWAY_METRICS, GATEWAY_PORT
from infra.serving.network import POD_IDENTITY_AGENT, ClusterPeers, ray_service_policies
from infra.serving.ports import RAY_PORTS
from infra.serving.ray_service import SERVICE_LABEL, pod_labels
from infra.serving.router import ROUTER_METRICS, ROUTER_OF, ROUTER_PORT
from tests.harness import (
    SERVE_INGRESS,
    manifests_of,
    ray_cluster,
    ray_service_pods,
    render_stack,
    stack_config,
    workload_pods,
)
from twin import kuberay as mirror

# The committed stacks (dev's model behind its router and the gateway) and dev on Serve's ingress.
STACKS = ["dev", "prod", SERVE_INGRESS]
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
# Ports Ray listens on that no container port names: the dashboard agent
# (its job agent runs code too) and a worker process's port; on a head, Serve's
# proxy, which a vllm-server head runs without declaring it.
DASHBOARD_AGENT = 52365
RAY_WORKER_PORT = 10002
HEAD_PROXY = RAY_PORTS.serve.number
PROBE_PORT = 8080  # for pods that listen on nothing: any connection must fail
OTHER_SERVICE = "other-model"


@dataclass(frozen=True)
class Endpoint:
    """A source or target: a pod (namespace and labels) or an address outside the cluster."""

    name: str
    role: str
    ip: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: tuple[int, ...] = ()
    service: str | None = None  # the RayService of a Ray pod

    @property
    def is_pod(self) -> bool:
        return self.namespace is not None


# --- the NetworkPolicy semantics ---------------------------------------------------------------


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector against labels, as the API server evaluates it (twin/kuberay.py selects)."""
    return mirror.selects(selector, labels)


def _in_block(ip: str, block: Mapping[str, Any]) -> bool:
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(address in ipaddress.ip_network(e) for e in block.get("except", []))


def _peer_matches(element: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in element:
        return _in_block(other.ip, element["ipBlock"])
    if not other.is_pod:
        return False
    if "namespaceSelector" in element:
        ns_labels = {NAMESPACE_LABEL: other.namespace or ""}
        if not _selects(element["namespaceSelector"], ns_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return _selects(element.get("podSelector", {}), other.labels)


def _port_matches(rule_ports: Iterable[Mapping[str, Any]] | None, port: int) -> bool:
    entries = list(rule_ports or [])
    if not entries:
        return True
    for entry in entries:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in entry:
            return True
        low = int(entry["port"])
        if low <= port <= int(entry.get("endPort", low)):
            return True
    return False


def _types(spec: Mapping[str, Any]) -> list[str]:
    return list(spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else [])))


def _allowed(policies: list[dict[str, Any]], pod: Endpoint, other: Endpoint, port: int, direction: str) -> bool:
    """Whether `pod`'s policies let it talk to `other` on `port` (direction Ingress or Egress)."""
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and _selects(p["spec"]["podSelector"], pod.labels)
        and direction in _types(p["spec"])
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(rules_key, []):
            peers = rule.get(peers_key) or []
            peer_ok = not peers or any(_peer_matches(e, policy["metadata"]["namespace"], other) for e in peers)
            if peer_ok and _port_matches(rule.get("ports"), port):
                return True
    return False


def reachable(policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int) -> bool:
    """Egress at the source (if a pod) and ingress at the target (if a pod)."""
    if src.is_pod and not _allowed(policies, src, dst, port, "Egress"):
        return False
    return not dst.is_pod or _allowed(policies, dst, src, port, "Ingress")


# --- the evaluator on its own ------------------------------------------------------------------

ATTACKER = Endpoint("attacker", "attacker", "10.0.9.9", "attacker", {"app.kubernetes.io/name": "kuberay-operator"})
HEAD = Endpoint("head", "head", "10.0.1.1", "llm", {"app": "ray"}, (8265,))


def _policy(ingress: list[dict[str, Any]]) -> dict[str, Any]:
    spec = {"podSelector": {"matchLabels": {"app": "ray"}}, "policyTypes": ["Ingress"], "ingress": ingress}
    return {"metadata": {"name": "p", "namespace": "llm"}, "spec": spec}


def test_an_empty_namespace_selector_with_a_label_lets_any_namespace_in() -> None:
    """The hole the old policy had: `namespaceSelector: {}` plus a label anyone can set."""
    hole = _policy(
        [
            {
                "from": [
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
                    }
                ],
                "ports": [{"port": 8265}],
            }
        ]
    )
    assert reachable([hole], ATTACKER, HEAD, 8265)
    fixed = _policy(
        [
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "kuberay"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
                    }
                ],
                "ports": [{"port": 8265}],
            }
        ]
    )
    assert not reachable([fixed], ATTACKER, HEAD, 8265)
    assert reachable([fixed], replace(ATTACKER, namespace="kuberay"), HEAD, 8265)


def test_two_elements_are_an_or_and_one_element_is_an_and() -> None:
    either = _policy(
        [{"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "kuberay"}}}, {"podSelector": {}}]}]
    )
    assert not reachable([either], ATTACKER, HEAD, 1)
    assert reachable([either], replace(ATTACKER, namespace="kuberay"), HEAD, 1)
    assert reachable([either], replace(ATTACKER, namespace="llm"), HEAD, 1)


def test_ip_blocks_ports_and_isolation() -> None:
    lb = Endpoint("lb", "lb", "10.0.0.5")
    policy = _policy(
        [{"from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.9.0/24"]}}], "ports": [{"port": 8000}]}]
    )
    assert reachable([policy], lb, HEAD, 8000) and not reachable([policy], lb, HEAD, 8001)
    assert not reachable([policy], ATTACKER, HEAD, 8000)  # in the except
    assert reachable([], ATTACKER, HEAD, 1)  # nothing selects the head: not isolated
    deny = _policy([])
    assert not reachable([deny], lb, HEAD, 8000)
    ranged = _policy([{"ports": [{"port": 8000, "endPort": 8010}]}])
    assert reachable([ranged], lb, HEAD, 8005) and not reachable([ranged], lb, HEAD, 8011)


# --- the endpoints of a stack ------------------------------------------------------------------


class Addresses:
    """Addresses handed out inside the stack's VPC, and one outside it."""

    def __init__(self, cidr: str) -> None:
        self._hosts = ipaddress.ip_network(cidr).hosts()

    def next(self) -> str:
        return str(next(self._hosts))


def _ray_ports(pod: dict[str, Any]) -> tuple[int, ...]:
    declared = {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    if pod["metadata"]["labels"].get("ray.io/node-type") == "head":
        declared.add(HEAD_PROXY)
    return tuple(sorted(declared | {DASHBOARD_AGENT, RAY_WORKER_PORT}))


def _pod_endpoint(pod: dict[str, Any], ip: str) -> Endpoint:
    labels = pod["metadata"]["labels"]
    node_type = labels.get("ray.io/node-type")
    name = pod["metadata"]["name"]
    if node_type is not None:
        group = labels["ray.io/group"]
        role = "head" if node_type == "head" else ("ingress" if group == "ingress" else "gpu")
        return Endpoint(name, role, ip, pod["metadata"]["namespace"], labels, _ray_ports(pod), labels[SERVICE_LABEL])
    declared = tuple(sorted({p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}))
    if ROUTER_OF in labels:
        return Endpoint(name, "router", ip, pod["metadata"]["namespace"], labels, declared, labels[ROUTER_OF])
    if GATEWAY_LABEL.items() <= labels.items():
        return Endpoint(name, "gateway", ip, pod["metadata"]["namespace"], labels, declared)
    role = "batch" if name == WORKER_NAME else "headroom"
    return Endpoint(name, role, ip, pod["metadata"]["namespace"], labels, (PROBE_PORT,))


def _other_service_pods(cfg: StackConfig, rendered: Rendered) -> list[dict[str, Any]]:
    """A RayService the stack does not have, built like its first one (dev has only one).

    Its ingress pods, or under vllm-server (no ingress) its GPU workers: the pods another
    RayService's traffic lands on.
    """
    rs = copy.deepcopy(manifests_of(rendered, "RayService")[0])
    # Declared as the program declares each RayService; KubeRay (the mirror) builds its pods.
    rs["metadata"]["name"] = OTHER_SERVICE
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        group["template"]["metadata"]["labels"] = pod_labels(OTHER_SERVICE)
    pods = ray_service_pods(rs)
    ingress = [p for p in pods if p["metadata"]["labels"]["ray.io/group"] == "ingress"]
    return ingress or [p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]


def _layout(cfg: StackConfig, service: str | None) -> str:
    """A RayService's layout; the made-up other one is built like the stack's first."""
    services = cfg.services()
    return cfg.layout_of(service if service in services else next(iter(services)))


def _public_port(cfg: StackConfig, service: str | None) -> int:
    """The port a RayService's serve Service targets: Serve's proxy, or the replicas' vLLM servers."""
    return RAY_PORTS.openai.number if _layout(cfg, service) == "vllm-server" else RAY_PORTS.serve.number


def _sources_only(cfg: StackConfig, ips: Addresses) -> list[Endpoint]:
    """Representative callers that are not pods the stack declares."""
    ns = cfg.serving.namespace
    operator = kuberay_part.operator_pods()
    prometheus = monitoring.prometheus_pods()
    grafana = monitoring.grafana_pods()
    synthetic = [
        Endpoint("kuberay-operator", "operator", ips.next(), operator.namespace, operator.labels),
        Endpoint("attacker-with-operator-labels", "attacker", ips.next(), "attacker", operator.labels),
        Endpoint("llm-pod-with-operator-labels", "llm-impostor", ips.next(), ns, operator.labels),
        Endpoint("prometheus", "prometheus", ips.next(), prometheus.namespace, prometheus.labels, prometheus.ports),
        Endpoint("grafana", "grafana", ips.next(), grafana.namespace, grafana.labels, grafana.ports),
        Endpoint("load-balancer", "lb", ips.next()),
        Endpoint("internet-client", "internet", "203.0.113.7"),
    ]
    if not cfg.batch.enabled:
        synthetic.append(Endpoint(WORKER_NAME, "batch", ips.next(), ns, worker_labels(), (PROBE_PORT,)))
    if not cfg.autoscaling.prescale:
        labels = {**pod_labels("x"), "app.kubernetes.io/name": "gpu-headroom-x"}
        del labels[SERVICE_LABEL]
        synthetic.append(Endpoint("gpu-headroom-x", "headroom", ips.next(), ns, labels, (PROBE_PORT,)))
    return synthetic


def _outside(cfg: StackConfig, ips: Addresses) -> list[Endpoint]:
    """What the pods call outside the namespace: targets for their egress."""
    prometheus = monitoring.prometheus_pods()
    grafana = monitoring.grafana_pods()
    return [
        Endpoint("prometheus", "prometheus", ips.next(), prometheus.namespace, prometheus.labels, prometheus.ports),
        Endpoint("grafana", "grafana", ips.next(), grafana.namespace, grafana.labels, grafana.ports),
        Endpoint("kube-dns", "dns", ips.next(), "kube-system", {"k8s-app": "kube-dns"}, (53,)),
        Endpoint("gcs-redis", "redis", ips.next(), ports=(6379,)),
        Endpoint("kube-api-private", "kube-api", ips.next(), ports=(443,)),
        Endpoint("s3-and-sqs", "aws-api", "52.216.1.1", ports=(443,)),
        Endpoint("pod-identity-agent", "pod-identity", POD_IDENTITY_AGENT.split("/")[0], ports=(80,)),
    ]


@dataclass
class Matrix:
    """Every (source, target) pair's reachable ports, and the endpoints."""

    cfg: StackConfig
    sources: list[Endpoint]
    targets: list[Endpoint]
    ports: dict[tuple[str, str], frozenset[int]]


@cache
def matrix(stack: str) -> Matrix:
    cfg = stack_config(stack)
    rendered = render_stack(stack)
    ips = Addresses(str(cfg.network.vpc_cidr))
    ns = cfg.serving.namespace
    declared = [_pod_endpoint(p, ips.next()) for p in workload_pods(rendered) if p["metadata"]["namespace"] == ns]
    others = [_pod_endpoint(p, ips.next()) for p in _other_service_pods(cfg, rendered)]
    sources = declared + others + _sources_only(cfg, ips)
    targets = declared + others + [e for e in sources if e.role == "batch" and e not in declared]
    targets += [e for e in sources if e.role == "headroom" and e not in declared] + _outside(cfg, ips)
    policies = manifests_of(rendered, "NetworkPolicy")
    # The other RayService gets the policies the program gives any RayService.
    policies += _policies_for(cfg, OTHER_SERVICE)
    ports = {
        (s.name, t.name): frozenset(p for p in t.ports if reachable(policies, s, t, p))
        for s in sources
        for t in targets
        if s.name != t.name
    }
    return Matrix(cfg, sources, targets, ports)


def _policies_for(cfg: StackConfig, service: str) -> list[dict[str, Any]]:
    peers = ClusterPeers(
        operator=kuberay_part.operator_pods(),
        prometheus=monitoring.prometheus_pods(),
        grafana=monitoring.grafana_pods(),
        vpc_cidr=str(cfg.network.vpc_cidr),
    )
    return ray_service_policies(
        cfg.serving.namespace,
        service,
        peers,
        gcs_redis=cfg.ray.gcs_fault_tolerance.enabled,
        layout=_layout(cfg, service),
    )


# --- what the matrix must be ---------------------------------------------------------------------

RAY_ROLES = {"head", "ingress", "gpu"}
IN_VPC_WITHOUT_EGRESS_POLICY = {"operator", "attacker", "prometheus", "grafana", "lb"}
HEAD_METRICS = {p.number for p in RAY_PORTS.scraped_on_head()}
OPERATOR_ON_HEAD = {RAY_PORTS.dashboard.number, RAY_PORTS.serve.number}


def _to_ray_pod(cfg: StackConfig, src: Endpoint, dst: Endpoint) -> set[int]:
    """Ray pods: their own RayService on every port; the rest only as docs/security.md says."""
    if src.role in RAY_ROLES:
        # Its own RayService: everything. Another one: nothing (its egress
        # reaches only its own pods, HTTPS and the credentials agent).
        return set(dst.ports) if src.service == dst.service else set()
    if dst.role == "head":
        # The operator (its namespace AND labels) on the dashboard and the
        # Serve health; Prometheus on the metrics ports; for a model the
        # gateway wakes, the gateway on Serve's proxy; nobody else.
        if src.role == "gateway" and cfg.serving.gateway.enabled and dst.service in cfg.woken_services():
            return {RAY_PORTS.wake.number}
        return {"operator": OPERATOR_ON_HEAD, "prometheus": HEAD_METRICS}.get(src.role, set())
    # Workers: the public port (Serve's proxy; under vllm-server the
    # replica's own vLLM server) for the load balancer, i.e. any VPC address
    # whose own egress allows it, and the batch workers of this RayService;
    # Prometheus scrapes the metrics port, and under vllm-server the GPU
    # workers' vLLM registry (no API key guards it: nobody else).
    allowed: set[int] = set()
    public = _public_port(cfg, dst.service)
    if cfg.serving.routing.enabled and _layout(cfg, dst.service) == "vllm-server" and dst.service != OTHER_SERVICE:
        # Behind its router: the replicas' port for that router's pods alone.
        if src.role == "router" and src.service == dst.service:
            allowed.add(public)
    elif src.role in IN_VPC_WITHOUT_EGRESS_POLICY:
        allowed.add(public)
    # Batch workers: their model's public port, on any RayService's workers
    # that use the same one (see test_egress_rules_to_services_match_the_services_selectors).
    if src.role == "batch" and cfg.batch.enabled and public == _public_port(cfg, batch_service(cfg)):
        allowed.add(public)
    if src.role == "prometheus":
        allowed.add(RAY_PORTS.metrics.number)
        if _layout(cfg, dst.service) == "vllm-server" and dst.role == "gpu":
            allowed.add(RAY_PORTS.vllm_metrics.number)
    return allowed


def _from_serving_pod(cfg: StackConfig, src: Endpoint, dst: Endpoint) -> set[int]:
    """Egress of the serving namespace's pods to what is outside it."""
    if dst.role == "dns":
        return {53}
    if src.role in RAY_ROLES:
        allowed = {"aws-api": {443}, "kube-api": {443}, "pod-identity": {80}}.get(dst.role, set())
        if src.role == "head":
            allowed |= {"prometheus": {9090}, "grafana": {3000}}.get(dst.role, set())
            if dst.role == "redis" and cfg.ray.gcs_fault_tolerance.enabled:
                allowed = {6379}
        return allowed
    if src.role == "batch" and cfg.batch.enabled:
        # AWS APIs outside the VPC only: not the private API endpoint.
        return {"aws-api": {443}, "pod-identity": {80}}.get(dst.role, set())
    if src.role == "router":
        # Its discovery lists and watches pods: HTTPS to the API server, wherever it is.
        return {"aws-api": {443}, "kube-api": {443}}.get(dst.role, set())
    return set()


def _to_front(cfg: StackConfig, src: Endpoint, dst: Endpoint) -> set[int]:
    """A router's or the gateway's pods: the load balancer's sources (the VPC) on the API port, Prometheus on
    the metrics port, and a router's also for the gateway."""
    api, metrics = (ROUTER_PORT, ROUTER_METRICS) if dst.role == "router" else (GATEWAY_PORT, GATEWAY_METRICS)
    if src.role in IN_VPC_WITHOUT_EGRESS_POLICY:
        return {api.number} | ({metrics.number} if src.role == "prometheus" else set())
    if src.role == "gateway" and dst.role == "router":
        return {api.number}
    return set()


def expected(cfg: StackConfig, src: Endpoint, dst: Endpoint) -> set[int]:
    """The matrix in words (docs/security.md, "Who can reach what")."""
    if dst.role in RAY_ROLES:
        return _to_ray_pod(cfg, src, dst)
    if dst.role in {"batch", "headroom"}:
        return set()  # nothing reaches them
    if dst.role in {"router", "gateway"}:
        return _to_front(cfg, src, dst)
    if src.namespace == cfg.serving.namespace:
        return _from_serving_pod(cfg, src, dst)
    # Outside the serving namespace no policy applies: not this program's to decide.
    return set(dst.ports)


@pytest.mark.parametrize("stack", STACKS)
def test_the_whole_matrix(stack: str) -> None:
    m = matrix(stack)
    by_name = {e.name: e for e in m.sources + m.targets}
    wrong = []
    for (src, dst), ports in sorted(m.ports.items()):
        want = frozenset(expected(m.cfg, by_name[src], by_name[dst]))
        if ports != want:
            wrong.append(f"{src} -> {dst}: reachable {sorted(ports)}, expected {sorted(want)}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("stack", STACKS)
def test_the_matrix_covers_every_role(stack: str) -> None:
    m = matrix(stack)
    roles = {e.role for e in m.sources}
    cfg = stack_config(stack)
    assert {"head", "gpu", "batch", "headroom", "operator", "attacker", "prometheus", "lb"} <= roles
    # And the routers and the gateway where the stack runs them.
    assert ("router" in roles) is cfg.serving.routing.enabled
    assert ("gateway" in roles) is cfg.serving.gateway.enabled
    # Every RayService's traffic-taking pods: its ingress pods, or under vllm-server its GPU workers.
    serving = {"vllm-server": "gpu", "serve-ingress": "ingress"}
    for service in [*cfg.services(), OTHER_SERVICE]:
        role = serving[_layout(cfg, service)]
        assert any(e.role == role and e.service == service for e in m.sources), (service, role)
    assert len(m.ports) > 100


@pytest.mark.parametrize("stack", STACKS)
def test_vllms_own_registry_answers_prometheus_and_its_own_ray_service_only(stack: str) -> None:
    """vLLM's metrics port has no API key in front of it; the OpenAI port takes the load balancer's traffic."""
    m = matrix(stack)
    by_name = {e.name: e for e in m.sources + m.targets}
    vllm_metrics, openai = RAY_PORTS.vllm_metrics.number, RAY_PORTS.openai.number
    seen = 0
    for (src, dst), ports in m.ports.items():
        s, t = by_name[src], by_name[dst]
        if vllm_metrics in ports and s.service != t.service:
            assert s.role == "prometheus", (src, dst)
            seen += 1
        if openai in t.ports and t.role == "gpu" and s.service != t.service and s.role == "lb":
            # The load balancer reaches the replicas' servers, unless a router stands in front of them.
            routed = m.cfg.serving.routing.enabled and t.service in m.cfg.services()
            assert (openai in ports) is not routed, (src, dst)
        if s.role == "router" and t.role == "gpu":
            assert (openai in ports) is (s.service == t.service), (src, dst)
    # Prod serves in the vllm-server layout, so its GPU workers were tried.
    assert (seen > 0) is ("vllm-server" in stack_config(stack).layouts().values())


@pytest.mark.parametrize("stack", STACKS)
def test_the_job_api_is_for_the_operator_and_the_own_cluster_only(stack: str) -> None:
    """Ray's job API (dashboard 8265, and the dashboard agent's 52365) runs arbitrary code."""
    m = matrix(stack)
    by_name = {e.name: e for e in m.sources + m.targets}
    for (src, dst), ports in m.ports.items():
        s, t = by_name[src], by_name[dst]
        if t.role not in RAY_ROLES or s.service == t.service:
            continue
        assert DASHBOARD_AGENT not in ports, (src, dst)
        if RAY_PORTS.dashboard.number in ports:
            assert s.role == "operator" and s.namespace == kuberay_part.NAMESPACE, (src, dst)


@pytest.mark.parametrize("stack", STACKS)
def test_the_endpoint_component_declares_each_ray_services_policies(stack: str) -> None:
    rendered = render_stack(stack)
    policies = {
        r["name"]: r for r in rendered.resources if r["type"] == "kubernetes:networking.k8s.io/v1:NetworkPolicy"
    }
    for service in stack_config(stack).services():
        for name in (f"{service}-ray", f"{service}-ray-head", f"{service}-ray-serve"):
            assert policies[name]["parent"] == "serving-endpoint", name
    for name in ("serving-default-deny", "serving-allow-dns"):
        assert policies[name]["parent"] == "serving", name


# --- what the VPC CNI's policy agent sees ------------------------------------------------------

# A pod that calls a Service's cluster IP is filtered before the Service's DNAT,
# so the VPC CNI's policy controller adds a Service's cluster IP to an egress
# rule only when the rule's pod selector matches the Service's own selector
# (amazon-network-policy-controller-k8s, `getMatchingServiceClusterIPs`).
# The Services the serving pods call, by their selectors:
SERVICE_SELECTORS = {
    # KubeRay's serve Service, as the mirror builds it (the cluster name changes on upgrades).
    "serve": (
        "llm",
        mirror.build_serve_service(ray_cluster(manifests_of(render_stack("prod"), "RayService")[0]))["spec"][
            "selector"
        ],
    ),
    "prometheus": ("monitoring", dict(monitoring.prometheus_pods().labels)),
    "grafana": ("monitoring", dict(monitoring.grafana_pods().labels)),
    "kube-dns": ("kube-system", {"k8s-app": "kube-dns"}),
}


def _egress_peers(policy: dict[str, Any]) -> list[tuple[dict[str, Any], list[int]]]:
    return [
        (peer, [p["port"] for p in rule.get("ports", [])])
        for rule in policy["spec"].get("egress", [])
        for peer in rule.get("to", [])
        if "podSelector" in peer
    ]


@pytest.mark.parametrize("stack", STACKS)
def test_egress_rules_to_services_match_the_services_selectors(stack: str) -> None:
    """Batch workers reach their serve Service, heads Prometheus and Grafana, everyone kube-dns, by cluster IP."""
    cfg = stack_config(stack)
    policies = {p["metadata"]["name"]: p for p in manifests_of(render_stack(stack), "NetworkPolicy")}

    def reaches(policy: str, service: str) -> bool:
        namespace, selector = SERVICE_SELECTORS[service]
        for peer, _ in _egress_peers(policies[policy]):
            ns_ok = _selects(peer.get("namespaceSelector"), {NAMESPACE_LABEL: namespace}) or (
                "namespaceSelector" not in peer and namespace == cfg.serving.namespace
            )
            if ns_ok and _selects(peer["podSelector"], selector):
                return True
        return False

    assert reaches("allow-dns", "kube-dns")
    for service in cfg.services():
        assert reaches(f"{service}-ray-head", "prometheus") and reaches(f"{service}-ray-head", "grafana")
    if cfg.batch.enabled:
        assert reaches(WORKER_NAME, "serve")
