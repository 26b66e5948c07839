"""Every selector in the render selects exactly the pods it is meant for, among the pods KubeRay really builds.

The Ray pods come from the KubeRay mirror (twin/kuberay.py: labelPod,
BuildPod, the Redis cleanup Job), the other pods from their Deployments'
templates; KubeRay's own serve and head Services are built by the mirror
too. Each selector in the serving namespace (Services, PodDisruptionBudgets,
PodMonitors, NetworkPolicy pod selectors and in-namespace peers, topology
spread constraints, Deployments, KEDA targets) is evaluated against them,
for both stacks and both layouts. Each must select at least one pod, and
exactly the ones its intent names: an intent is declared below for every
selector, and one without an intent fails the test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from infra.render import Rendered
from infra.serving import kuberay
from infra.serving.endpoint import public_service_name
from infra.serving.gateway import GATEWAY_LABEL, upstream_name
from infra.serving.network import head_service_pods
from infra.serving.ports import RAY_PORTS
from infra.serving.router import router_name, router_pods
from tests.harness import (
    SERVE_INGRESS,
    manifests_of,
    ray_cluster,
    render_config,
    render_routed,
    render_stack,
    stack_doc,
)
from twin import day2
from twin import kuberay as mirror

Pod = dict[str, Any]
Intent = Callable[[Pod], bool]


def _layout_variant(stack: str, layout: str) -> Rendered:
    doc = copy.deepcopy(stack_doc(stack))
    config = doc["config"]
    config["llm-platform:serving"] = {**config.get("llm-platform:serving", {}), "layout": layout}
    return render_config(doc, f"{stack}-{layout}")


# The committed stacks in their own layouts (dev: vllm-server at min_replicas 0 behind its router and
# the gateway, prod: vllm-server), dev's file on Serve's ingress (SERVE_INGRESS) and prod's, and each
# with the tests' router and gateway settings (harness.ROUTING, GATEWAY).
VARIANTS = ["dev", "prod", SERVE_INGRESS, "prod-serve-ingress", "prod-routed", "dev-routed"]


@cache
def rendered(variant: str) -> Rendered:
    if variant in ("dev", "prod", SERVE_INGRESS):
        return render_stack(variant)
    stack, rest = variant.split("-", 1)
    if rest == "routed":
        return render_routed(stack)
    return _layout_variant(stack, rest)


def _labels(pod: Pod) -> dict[str, str]:
    labels: dict[str, str] = pod["metadata"]["labels"]
    return labels


@dataclass(frozen=True)
class World:
    """The serving namespace as the cluster would hold it: pods and Services, by who made them."""

    namespace: str
    pods: list[Pod]
    services: list[dict[str, Any]]
    ray_services: dict[str, dict[str, Any]]
    # The RayServices with a router in front (serving.routing).
    routed: frozenset[str] = frozenset()
    # The model gateway's Deployment, when serving.gateway is on.
    gateway: str | None = None

    def name(self, pod: Pod) -> str:
        name: str = pod["metadata"]["name"]
        return name


@cache
def world(variant: str) -> World:
    render = rendered(variant)
    ray_services = {rs["metadata"]["name"]: rs for rs in manifests_of(render, "RayService")}
    namespace = next(iter(ray_services.values()))["metadata"]["namespace"]
    pods: list[Pod] = []
    services: list[dict[str, Any]] = []
    for rs in ray_services.values():
        cluster = ray_cluster(rs)
        groups = rs["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
        # Two pods of each group, so a budget or a spread has something to count.
        pods += mirror.build_cluster_pods(cluster, {str(g["groupName"]): 2 for g in groups})
        if rs["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions"):
            pods.append(mirror.build_redis_cleanup_pod(cluster))
        services += [mirror.first_serve_service(cluster), mirror.build_head_service(cluster)]
    for dep in manifests_of(render, "Deployment"):
        template = dep["spec"]["template"]
        pods.append(
            {
                "metadata": {
                    "name": f"{dep['metadata']['name']}-7d9f8b6c4-x2x2x",
                    "namespace": dep["metadata"]["namespace"],
                    # The ReplicaSet controller adds the template hash.
                    "labels": {**template["metadata"]["labels"], "pod-template-hash": "7d9f8b6c4"},
                },
                "spec": template["spec"],
                "owner": dep["metadata"]["name"],
            }
        )
    services += manifests_of(render, "Service")
    deployments = {d["metadata"]["name"] for d in manifests_of(render, "Deployment")}
    routed = frozenset(s for s in ray_services if router_name(s) in deployments)
    gateways = [
        d["metadata"]["name"]
        for d in manifests_of(render, "Deployment")
        if d["spec"]["selector"]["matchLabels"] == GATEWAY_LABEL
    ]
    return World(namespace, pods, services, ray_services, routed, gateways[0] if gateways else None)


# --- what each pod is --------------------------------------------------------------


def of_service(service: str) -> Intent:
    return lambda p: _labels(p).get(kuberay.SERVICE_LABEL) == service


def node_type(kind: str) -> Intent:
    return lambda p: _labels(p).get(kuberay.NODE_TYPE) == kind


def in_group(group: str) -> Intent:
    return lambda p: _labels(p).get(kuberay.GROUP) == group and _labels(p).get(kuberay.NODE_TYPE) == "worker"


def deployment(name: str) -> Intent:
    return lambda p: p.get("owner") == name


def both(*intents: Intent) -> Intent:
    return lambda p: all(i(p) for i in intents)


def declares_port(name: str) -> Intent:
    return lambda p: mirror.container_port(p["spec"]["containers"][0], name) is not None


def any_pod(_: Pod) -> bool:
    return True


def serving_worker(p: Pod) -> bool:
    return _labels(p).get(kuberay.NODE_TYPE) == "worker" and _labels(p).get(kuberay.SERVE) == "true"


# --- every selector, with its intent ------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """One selector of the render (or of an object KubeRay makes from it) and the pods it should select."""

    where: str
    selector: dict[str, Any]
    intent: Intent
    # A Service's selector (plain map) rather than a LabelSelector.
    plain: bool = False


def _policy_intent(w: World, name: str) -> Intent:
    for service in w.ray_services:
        if name == f"{service}-ray":
            return of_service(service)
        if name == f"{service}-ray-head":
            return both(of_service(service), node_type("head"))
        if name == f"{service}-ray-serve":
            return both(of_service(service), node_type("worker"))
        if name == f"{service}-ray-redis-cleanup":
            return both(of_service(service), node_type(kuberay.REDIS_CLEANUP))
    if name in ("default-deny", "allow-dns"):
        return any_pod
    if name == "batch-worker":
        return deployment("batch-worker")
    for service in w.routed:
        if name == router_name(service):
            return deployment(router_name(service))
    if name == w.gateway:
        return deployment(w.gateway)
    raise AssertionError(f"no intent declared for NetworkPolicy {name}")


def _pdb_intent(w: World, name: str) -> Intent:
    for service, rs in w.ray_services.items():
        if name == f"{service}-head":
            return both(of_service(service), node_type("head"))
        for g in rs["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []:
            if name == f"{service}-{g['groupName']}":
                return both(of_service(service), in_group(g["groupName"]))
        if service in w.routed and name == router_name(service):
            return deployment(router_name(service))
    if name == w.gateway:
        return deployment(w.gateway)
    raise AssertionError(f"no intent declared for PodDisruptionBudget {name}")


def _monitor_intent(w: World, name: str) -> Intent:
    vllm_servers = {s for s, rs in w.ray_services.items() if not _has_ingress_group(rs)}
    intents: dict[str, Intent] = {
        "ray-heads": both(lambda p: _labels(p).get(kuberay.SERVICE_LABEL) in w.ray_services, node_type("head")),
        "ray-workers": both(lambda p: _labels(p).get(kuberay.SERVICE_LABEL) in w.ray_services, node_type("worker")),
        "vllm-servers": both(
            lambda p: _labels(p).get(kuberay.SERVICE_LABEL) in vllm_servers,
            node_type("worker"),
            declares_port(RAY_PORTS.vllm_metrics.name),
        ),
    }
    intents.update({router_name(s): deployment(router_name(s)) for s in w.routed})
    if w.gateway is not None:
        intents[w.gateway] = deployment(w.gateway)
    if name not in intents:
        raise AssertionError(f"no intent declared for PodMonitor {name}")
    return intents[name]


def _has_ingress_group(rs: dict[str, Any]) -> bool:
    return any(g["groupName"] == "ingress" for g in rs["spec"]["rayClusterConfig"].get("workerGroupSpecs") or [])


def _service_intent(w: World, svc: dict[str, Any]) -> Intent:
    name = svc["metadata"]["name"]
    for service in w.ray_services:
        cluster = ray_cluster(w.ray_services[service]).name
        if name == public_service_name(service):
            if service in w.routed:
                return deployment(router_name(service))  # the router takes the connections
            # Both clusters of an upgrade; each pod while it is Ready.
            return both(of_service(service), serving_worker)
        if name == kuberay.serve_service_name(service):
            return both(lambda p, c=cluster: _labels(p).get(kuberay.CLUSTER) == c, serving_worker)
        if name == kuberay.head_service(service):
            return both(lambda p, c=cluster: _labels(p).get(kuberay.CLUSTER) == c, node_type("head"))
        if w.gateway is not None and name == upstream_name(service):
            return deployment(router_name(service))  # one route of the gateway
    if w.gateway is not None and name == public_service_name(w.gateway):
        return deployment(w.gateway)  # the gateway takes the connections
    raise AssertionError(f"no intent declared for Service {name}")


def _spreads(template_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from template_spec.get("topologySpreadConstraints") or []


def selections(w: World, render: Rendered) -> list[Selection]:
    """Every pod selector of the serving namespace, each with its intent."""
    out: list[Selection] = []
    for svc in w.services:
        out.append(
            Selection(f"Service {svc['metadata']['name']}", svc["spec"]["selector"], _service_intent(w, svc), True)
        )
    for pdb in manifests_of(render, "PodDisruptionBudget"):
        name = pdb["metadata"]["name"]
        out.append(Selection(f"PodDisruptionBudget {name}", pdb["spec"]["selector"], _pdb_intent(w, name)))
    for monitor in manifests_of(render, "PodMonitor"):
        name = monitor["metadata"]["name"]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": [w.namespace]}
        out.append(Selection(f"PodMonitor {name}", monitor["spec"]["selector"], _monitor_intent(w, name)))
    for policy in manifests_of(render, "NetworkPolicy"):
        name = policy["metadata"]["name"]
        intent = _policy_intent(w, name)
        out.append(Selection(f"NetworkPolicy {name} podSelector", policy["spec"]["podSelector"], intent))
        for direction in ("ingress", "egress"):
            for i, rule in enumerate(policy["spec"].get(direction) or []):
                for peer in rule.get("from", rule.get("to", [])):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        where = f"NetworkPolicy {name} {direction}[{i}] peer"
                        out.append(Selection(where, peer["podSelector"], _peer_intent(w, name, peer)))
    for service, rs in w.ray_services.items():
        cluster = rs["spec"]["rayClusterConfig"]
        for g in cluster.get("workerGroupSpecs") or []:
            for spread in _spreads(g["template"]["spec"]):
                # matchLabelKeys narrows each to the pod's own cluster.
                intent = both(of_service(service), in_group(g["groupName"]))
                out.append(
                    Selection(f"RayService {service} group {g['groupName']} spread", spread["labelSelector"], intent)
                )
    # The pods each router discovers by its `--selector`, read from its rendered command line.
    discovery = day2.router_discovery(render.manifests)
    for service in w.routed:
        selector = {"matchLabels": discovery[service]}
        intent = both(of_service(service), in_group(_model_group(w, service)), serving_worker)
        out.append(Selection(f"router {service} --selector", selector, intent))
    for dep in manifests_of(render, "Deployment"):
        name = dep["metadata"]["name"]
        out.append(Selection(f"Deployment {name}", dep["spec"]["selector"], deployment(name)))
        for spread in _spreads(dep["spec"]["template"]["spec"]):
            out.append(Selection(f"Deployment {name} spread", spread["labelSelector"], deployment(name)))
    return out


def _model_group(w: World, service: str) -> str:
    """The GPU worker group of a vllm-server RayService's one model."""
    groups = w.ray_services[service]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (group,) = [g["groupName"] for g in groups if g["groupName"].startswith("gpu-")]
    return str(group)


def _peer_intent(w: World, policy: str, peer: dict[str, Any]) -> Intent:
    for service in w.ray_services:
        if policy == f"{service}-ray":
            return of_service(service)  # a RayService's pods talk among themselves
        if policy == f"{service}-ray-head" and w.gateway is not None:
            return deployment(w.gateway)  # the gateway wakes the model through its head's Serve proxy
        if policy == f"{service}-ray-serve":
            if service in w.routed and peer["podSelector"]["matchLabels"] == router_pods(service):
                return deployment(router_name(service))  # the router sends to the replicas
            return deployment("batch-worker")  # the batch workers call the model
        if service in w.routed and policy == router_name(service):
            if w.gateway is not None and peer["podSelector"]["matchLabels"] == GATEWAY_LABEL:
                return deployment(w.gateway)  # the gateway sends to the router
            return both(of_service(service), in_group(_model_group(w, service)), serving_worker)
        if policy == w.gateway and peer["podSelector"]["matchLabels"] == router_pods(service):
            return deployment(router_name(service))  # the gateway sends to each model's router
    if policy == w.gateway and peer["podSelector"]["matchLabels"] == head_service_pods():
        # Its wakes, by head Service (network.head_service_pods); each head's own policy admits it or not.
        return node_type("head")
    if policy == "batch-worker":
        # The batch workers' egress: the serving port of any RayService's workers (network.serving_pods).
        return serving_worker
    raise AssertionError(f"no intent declared for a peer of NetworkPolicy {policy}: {peer}")


def _selected(w: World, s: Selection) -> set[str]:
    if s.plain and not s.selector:
        return set()
    return {w.name(p) for p in w.pods if mirror.selects(s.selector, _labels(p))}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_selector_selects_exactly_the_pods_it_is_meant_for(variant: str) -> None:
    w, render = world(variant), rendered(variant)
    wrong = []
    checked = selections(w, render)
    for s in checked:
        got = _selected(w, s)
        want = {w.name(p) for p in w.pods if s.intent(p)}
        if not got:
            wrong.append(f"{s.where}: selects no pod ({s.selector})")
        elif got != want:
            wrong.append(f"{s.where}: selects {sorted(got - want)} it should not, misses {sorted(want - got)}")
    assert not wrong, "\n".join(wrong)
    kinds = {s.where.split()[0] for s in checked}
    assert {"Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize("variant", VARIANTS)
def test_keda_targets_name_a_deployment_of_the_render(variant: str) -> None:
    render = rendered(variant)
    deployments = {d["metadata"]["name"] for d in manifests_of(render, "Deployment")}
    for so in manifests_of(render, "ScaledObject"):
        target = so["spec"]["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment"
        assert target["name"] in deployments, so["metadata"]["name"]


def test_a_selector_on_kuberays_originated_from_labels_selects_no_pod() -> None:
    """What every PodMonitor and budget did before: KubeRay puts those labels on no pod."""
    w = world("prod")
    old = {"matchLabels": {mirror.ORIGINATED_FROM_CRD: "RayService", kuberay.NODE_TYPE: "head"}}
    assert not _selected(w, Selection("old ray-heads", old, any_pod))
