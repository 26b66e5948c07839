"""The endpoint, NetworkPolicies, dashboards, stack outputs, and every serving manifest against real schemas."""

from __future__ import annotations

import json
from ipaddress import IPv4Network
from typing import Any

import pytest

from infra import versions
from infra.config import Endpoint
from infra.serving import kuberay
from infra.serving.dashboards import dashboards
from infra.serving.endpoint import (
    EXTERNAL_DNS_ANNOTATION,
    LB_ANNOTATION,
    NLB_CLASS,
    base_url,
    load_balancer_service,
    public_service_name,
    serve_service_spec,
    source_ranges,
)
from infra.serving.ports import HTTPS_PORT, RAY_PORTS
from infra.serving.ray_service import SERVICE_LABEL
from infra.serving.router import router_pods
from tests.harness import SERVE_INGRESS, manifests_of, ray_services, render_stack
from tests.harness import stack_config as config

STACKS = ["dev", "prod"]
SERVING_KINDS = {
    "Namespace",
    "ServiceAccount",
    "Secret",
    "PriorityClass",
    "Deployment",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ConfigMap",
}


def _serve_service(rs: dict[str, Any]) -> dict[str, Any]:
    svc: dict[str, Any] = rs["spec"]["serveService"]
    return svc


def _public(stack: str, name: str) -> dict[str, Any]:
    (svc,) = [
        s for s in manifests_of(render_stack(stack), "Service") if s["metadata"]["name"] == public_service_name(name)
    ]
    return svc


def test_prod_endpoint_is_an_internet_facing_tls_nlb_limited_to_the_allowed_cidrs() -> None:
    cfg = config("prod")
    for rs in ray_services("prod"):
        name = rs["metadata"]["name"]
        svc = _public("prod", name)
        annotations = svc["metadata"]["annotations"]
        assert annotations[f"{LB_ANNOTATION}-nlb-target-type"] == "ip"
        assert annotations[f"{LB_ANNOTATION}-scheme"] == "internet-facing"
        assert annotations[f"{LB_ANNOTATION}-ssl-cert"] == cfg.endpoint.certificate_arn
        assert svc["spec"]["type"] == "LoadBalancer"
        # Ours, so the controller's webhook never sets it and nothing ever changes it.
        assert svc["spec"]["loadBalancerClass"] == NLB_CLASS
        assert svc["spec"]["loadBalancerSourceRanges"] == [str(c) for c in cfg.endpoint.allowed_cidrs]
        (port,) = svc["spec"]["ports"]
        # Prod serves in the vllm-server layout: straight to each replica's vLLM server.
        assert (port["port"], port["targetPort"]) == (HTTPS_PORT, RAY_PORTS.openai.name)
        assert annotations[f"{LB_ANNOTATION}-ssl-ports"] == port["name"]
        # TLS 1.2 and 1.3 only: the controller's default policy (2016-08) still takes TLS 1.0.
        assert annotations[f"{LB_ANNOTATION}-ssl-negotiation-policy"] == cfg.endpoint.tls_policy
        assert cfg.endpoint.tls_policy == "ELBSecurityPolicy-TLS13-1-2-Res-2021-06"


def test_the_tls_policy_is_one_of_tls_12_and_13_and_only_with_a_certificate() -> None:
    prod = config("prod").endpoint
    chosen = prod.model_copy(update={"tls_policy": "ELBSecurityPolicy-TLS13-1-3-2021-06"})
    annotations = load_balancer_service("a", "llm", chosen)["metadata"]["annotations"]
    assert annotations[f"{LB_ANNOTATION}-ssl-negotiation-policy"] == "ELBSecurityPolicy-TLS13-1-3-2021-06"
    # Plain HTTP has no listener to negotiate on.
    annotations = load_balancer_service("a", "llm", config("dev").endpoint)["metadata"]["annotations"]
    assert f"{LB_ANNOTATION}-ssl-negotiation-policy" not in annotations
    with pytest.raises(ValueError, match="tls_policy"):
        Endpoint.model_validate({**prod.model_dump(mode="json"), "tls_policy": "ELBSecurityPolicy-2016-08"})


@pytest.mark.parametrize("stack", STACKS)
def test_kuberay_serve_service_is_in_cluster_only_and_has_nothing_kuberay_would_not_apply(stack: str) -> None:
    """KubeRay never updates an existing Service's annotations: none are given to it."""
    for rs in ray_services(stack):
        svc = _serve_service(rs)
        assert svc["spec"]["type"] == "ClusterIP"
        assert "annotations" not in svc["metadata"]
        assert "loadBalancerSourceRanges" not in svc["spec"]


def test_a_tls_listener_keeps_its_port_under_either_layout() -> None:
    endpoint = config("prod").endpoint
    ingress = load_balancer_service("a", "llm", endpoint, "serve-ingress")["spec"]["ports"]
    assert ingress == [{"name": "https", "port": HTTPS_PORT, "targetPort": "serve", "protocol": "TCP"}]
    direct = load_balancer_service("a", "llm", endpoint, "vllm-server")["spec"]["ports"]
    assert direct == [{"name": "https", "port": HTTPS_PORT, "targetPort": "openai", "protocol": "TCP"}]


@pytest.mark.parametrize("stack", ["dev", SERVE_INGRESS])
def test_dev_endpoint_is_internal_plain_http_on_the_port_its_layout_serves(stack: str) -> None:
    """Dev's router front (the vllm-server servers' port), or Serve's proxy on its variant."""
    cfg = config(stack)
    for rs in ray_services(stack):
        svc = _public(stack, rs["metadata"]["name"])
        annotations = svc["metadata"]["annotations"]
        assert annotations[f"{LB_ANNOTATION}-scheme"] == "internal"
        assert f"{LB_ANNOTATION}-ssl-cert" not in annotations
        # No allow-list of its own: the VPC alone, not the controller's default of 0.0.0.0/0
        # (which an internal NLB would apply to everything routed into the VPC).
        assert not cfg.endpoint.allowed_cidrs
        assert svc["spec"]["loadBalancerSourceRanges"] == [str(cfg.network.vpc_cidr)]
        (port,) = svc["spec"]["ports"]
        public = RAY_PORTS.public(cfg.layout_of(rs["metadata"]["name"]))
        assert public == (RAY_PORTS.openai if stack == "dev" else RAY_PORTS.serve)
        assert (port["port"], port["targetPort"]) == (public.number, public.name)


def test_source_ranges_are_the_allow_list_else_the_vpc() -> None:
    dev = config("dev").endpoint
    assert source_ranges(dev, "10.0.0.0/16") == ["10.0.0.0/16"]
    listed = dev.model_copy(update={"allowed_cidrs": [IPv4Network("10.20.0.0/16")]})
    assert source_ranges(listed, "10.0.0.0/16") == ["10.20.0.0/16"]
    # Called without a VPC (a hand-made manifest), nothing is added.
    assert "loadBalancerSourceRanges" not in load_balancer_service("a", "llm", dev)["spec"]


def test_each_service_gets_its_own_name_under_the_domain() -> None:
    cfg = config("prod")
    for rs in ray_services("prod"):
        name = rs["metadata"]["name"]
        annotations = _public("prod", name)["metadata"]["annotations"]
        assert annotations[EXTERNAL_DNS_ANNOTATION] == f"{name}.{cfg.endpoint.domain}"
    for rs in ray_services("dev"):
        assert EXTERNAL_DNS_ANNOTATION not in _public("dev", rs["metadata"]["name"])["metadata"]["annotations"]


def test_base_url_scheme_follows_the_certificate() -> None:
    assert base_url("lb.example", config("prod").endpoint) == "https://lb.example/v1"
    assert base_url("lb.example", config("prod").endpoint, "vllm-server") == "https://lb.example/v1"
    assert base_url("lb.example", config("dev").endpoint) == "http://lb.example:8000/v1"
    # Without a certificate the load balancer listens on the port it targets.
    assert base_url("lb.example", config("dev").endpoint, "vllm-server") == "http://lb.example:8100/v1"
    (port,) = load_balancer_service("a", "llm", config("dev").endpoint, "vllm-server")["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("openai", 8100, "openai")
    assert serve_service_spec("a", "llm")["metadata"]["namespace"] == "llm"


def _policies(stack: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p["spec"] for p in manifests_of(render_stack(stack), "NetworkPolicy")}


def _peers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        e for key in ("ingress", "egress") for rule in spec.get(key, []) for e in rule.get("from", rule.get("to", []))
    ]


@pytest.mark.parametrize("stack", STACKS)
def test_the_namespace_denies_everything_but_dns_by_default(stack: str) -> None:
    ns = config(stack).serving.namespace
    policies = _policies(stack)
    assert policies["default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    dns = policies["allow-dns"]
    assert dns["podSelector"] == {} and dns["policyTypes"] == ["Egress"]
    (rule,) = dns["egress"]
    assert rule["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ]
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == {("UDP", 53), ("TCP", 53)}
    namespaces = {p["metadata"]["namespace"] for p in manifests_of(render_stack(stack), "NetworkPolicy")}
    assert namespaces == {ns}


@pytest.mark.parametrize("stack", STACKS)
def test_ray_policies_select_by_ray_service_and_name_peers_by_namespace_and_labels(stack: str) -> None:
    cfg = config(stack)
    policies = _policies(stack)
    for name in cfg.services():
        pods, head, serve = policies[f"{name}-ray"], policies[f"{name}-ray-head"], policies[f"{name}-ray-serve"]
        assert pods["podSelector"]["matchLabels"] == {SERVICE_LABEL: name}
        assert head["podSelector"]["matchLabels"] == {SERVICE_LABEL: name, kuberay.NODE_TYPE: "head"}
        assert serve["podSelector"]["matchLabels"] == {SERVICE_LABEL: name, kuberay.NODE_TYPE: "worker"}
        # Every peer in another namespace names that namespace AND its pods:
        # a label alone can be copied by any pod anywhere.
        for spec in (pods, head, serve):
            for peer in _peers(spec):
                if "namespaceSelector" in peer:
                    assert peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    assert peer["podSelector"]["matchLabels"]
            for rule in spec.get("ingress", []):
                assert rule.get("from"), "a rule without peers would admit everyone"
        # The operator; and for a model the gateway wakes, the gateway on Serve's port (test_serving_wake.py).
        operator, *wake = head["ingress"]
        assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kuberay"}
        assert {p["port"] for p in operator["ports"]} == {RAY_PORTS.dashboard.number, RAY_PORTS.serve.number}
        assert len(wake) == (1 if name in cfg.woken_services() and cfg.serving.gateway.enabled else 0)
        # The port the serve Service targets, and only it: for the load balancer's addresses in the VPC,
        # or behind a router for its pods alone.
        public = RAY_PORTS.public(cfg.layout_of(name))
        (lb,) = serve["ingress"]
        if cfg.serving.routing.enabled:
            assert lb["from"] == [{"podSelector": {"matchLabels": router_pods(name)}}]
        else:
            assert {"ipBlock": {"cidr": str(cfg.network.vpc_cidr)}} in lb["from"]
        assert lb["ports"] == [{"protocol": "TCP", "port": public.number}]
        (svc_port,) = _serve_service(next(rs for rs in ray_services(stack) if rs["metadata"]["name"] == name))["spec"][
            "ports"
        ]
        assert svc_port["targetPort"] == public.name
        redis = [r for r in head["egress"] if r["ports"] == [{"protocol": "TCP", "port": 6379}]]
        assert len(redis) == (1 if cfg.ray.gcs_fault_tolerance.enabled else 0)


@pytest.mark.parametrize("stack", STACKS)
def test_the_load_balancer_gates_the_serving_pods_readiness(stack: str) -> None:
    """The controller injects a readiness gate into the namespace's pods behind an IP-target NLB."""
    cfg = config(stack)
    namespaces = manifests_of(render_stack(stack), "Namespace")
    (ns,) = [n for n in namespaces if n["metadata"]["name"] == cfg.serving.namespace]
    assert ns["metadata"]["labels"]["elbv2.k8s.aws/pod-readiness-gate-inject"] == "enabled"
    for rs in ray_services(stack):
        svc = _public(stack, rs["metadata"]["name"])
        assert svc["metadata"]["annotations"][f"{LB_ANNOTATION}-nlb-target-type"] == "ip"


@pytest.mark.parametrize("stack", STACKS)
def test_outputs_name_the_endpoint_models_and_dashboards(stack: str) -> None:
    cfg = config(stack)
    outputs = render_stack(stack).outputs
    assert outputs["models"] == [m.model_id for m in cfg.models]
    assert outputs["endpoint"].endswith("/v1")
    first = next(iter(cfg.services()))
    if cfg.endpoint.domain:
        assert outputs["endpoint"] == f"https://{first}.{cfg.endpoint.domain}/v1"
        for name, models in cfg.services().items():
            for model in models:
                assert outputs["endpoints"][model.model_id] == f"https://{name}.{cfg.endpoint.domain}/v1"
    assert set(outputs["endpoints"]) == {m.model_id for m in cfg.models}
    assert outputs["endpoint"] == outputs["endpoints"][cfg.models[0].model_id]
    for name in cfg.services():
        assert outputs["ray_dashboard"][name] == (
            f"kubectl -n {cfg.serving.namespace} port-forward svc/{name}-head-svc {RAY_PORTS.dashboard.number}"
        )


@pytest.mark.parametrize("stack", STACKS)
def test_dashboards_are_configmaps_grafana_picks_up(stack: str) -> None:
    rendered = render_stack(stack)
    maps = {m["metadata"]["name"]: m for m in manifests_of(rendered, "ConfigMap")}
    for name, body in dashboards().items():
        cm = maps[name]
        assert cm["metadata"]["namespace"] == "monitoring"
        labels = cm["metadata"]["labels"]
        assert any(k.startswith("grafana") or "dashboard" in k for k in labels)
        model = json.loads(cm["data"][f"{name}.json"])
        assert model == json.loads(body)
        exprs = [t["expr"] for p in model["panels"] if p.get("type") != "row" for t in p["targets"]]
        assert exprs and all(exprs)
    serving = json.loads(dashboards()["llm-serving-dashboard"])
    titles = {p["title"] for p in serving["panels"]}
    assert {"Tokens per second", "Time to first token (p95)", "Inter-token latency (p95)", "KV cache usage"} <= titles
    gpus = json.loads(dashboards()["llm-gpus-dashboard"])
    assert any("DCGM_FI_DEV_XID_ERRORS" in t["expr"] for p in gpus["panels"] for t in p["targets"])


@pytest.mark.parametrize("stack", STACKS)
def test_serving_manifests_validate_against_the_kubernetes_schema(stack: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    rendered = render_stack(stack)
    checked = 0
    for manifest in rendered.manifests:
        if manifest.get("kind") not in SERVING_KINDS:
            continue
        obj = json.loads(json.dumps(manifest).replace('"[secret]"', '{"keys": "x"}'))
        if obj["kind"] == "Secret":
            obj.pop("stringData", None)
        kubernetes_validate.validate(obj, f"{versions.KUBERNETES_VERSION}.0", strict=True)
        checked += 1
    assert checked >= 8
