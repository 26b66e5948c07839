"""The endpoint, NetworkPolicies, dashboards, stack outputs, and every serving manifest against real schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from infra import versions
from infra.serving import kuberay
from infra.serving.dashboards import dashboards
from infra.serving.endpoint import EXTERNAL_DNS_ANNOTATION, LB_ANNOTATION, base_url, serve_service_spec
from infra.serving.ports import HTTPS_PORT, RAY_PORTS
from tests.harness import manifests_of, ray_services, render_stack
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


def test_prod_endpoint_is_an_internet_facing_tls_nlb_limited_to_the_allowed_cidrs() -> None:
    cfg = config("prod")
    for rs in ray_services("prod"):
        svc = _serve_service(rs)
        name = rs["metadata"]["name"]
        assert svc["metadata"]["name"] == kuberay.serve_service_name(name)
        annotations = svc["metadata"]["annotations"]
        assert annotations[f"{LB_ANNOTATION}-type"] == "external"
        assert annotations[f"{LB_ANNOTATION}-nlb-target-type"] == "ip"
        assert annotations[f"{LB_ANNOTATION}-scheme"] == "internet-facing"
        assert annotations[f"{LB_ANNOTATION}-ssl-cert"] == cfg.endpoint.certificate_arn
        assert svc["spec"]["type"] == "LoadBalancer"
        assert svc["spec"]["loadBalancerSourceRanges"] == [str(c) for c in cfg.endpoint.allowed_cidrs]
        (port,) = svc["spec"]["ports"]
        assert (port["port"], port["targetPort"]) == (HTTPS_PORT, RAY_PORTS.serve.name)
        assert annotations[f"{LB_ANNOTATION}-ssl-ports"] == port["name"]


def test_dev_endpoint_is_internal_plain_http_on_the_serve_port() -> None:
    for rs in ray_services("dev"):
        svc = _serve_service(rs)
        annotations = svc["metadata"]["annotations"]
        assert annotations[f"{LB_ANNOTATION}-scheme"] == "internal"
        assert f"{LB_ANNOTATION}-ssl-cert" not in annotations
        assert "loadBalancerSourceRanges" not in svc["spec"]
        (port,) = svc["spec"]["ports"]
        assert (port["port"], port["targetPort"]) == (RAY_PORTS.serve.number, RAY_PORTS.serve.name)


def test_each_service_gets_its_own_name_under_the_domain() -> None:
    cfg = config("prod")
    for rs in ray_services("prod"):
        name = rs["metadata"]["name"]
        annotations = _serve_service(rs)["metadata"]["annotations"]
        assert annotations[EXTERNAL_DNS_ANNOTATION] == f"{name}.{cfg.endpoint.domain}"
    for rs in ray_services("dev"):
        assert EXTERNAL_DNS_ANNOTATION not in _serve_service(rs)["metadata"]["annotations"]


def test_base_url_scheme_follows_the_certificate() -> None:
    assert base_url("lb.example", config("prod").endpoint) == "https://lb.example/v1"
    assert base_url("lb.example", config("dev").endpoint) == "http://lb.example:8000/v1"
    assert serve_service_spec("a", "llm", config("dev").endpoint)["metadata"]["namespace"] == "llm"


@pytest.mark.parametrize("stack", STACKS)
def test_ray_ports_are_closed_to_everyone_but_namespace_monitoring_and_operator(stack: str) -> None:
    cfg = config(stack)
    rendered = render_stack(stack)
    policies = {p["metadata"]["name"]: p["spec"] for p in manifests_of(rendered, "NetworkPolicy")}
    monitoring = next(
        ns["metadata"]["name"] for ns in manifests_of(rendered, "Namespace") if "monitor" in ns["metadata"]["name"]
    )
    for name in cfg.services():
        spec = policies[f"{name}-ray"]
        assert spec["podSelector"]["matchLabels"] == kuberay.pods_of(name)
        assert spec["policyTypes"] == ["Ingress"]
        open_ports: set[int] = set()
        for rule in spec["ingress"]:
            peers = rule.get("from")
            ports = {p["port"] for p in rule.get("ports", [])}
            if peers is None:
                open_ports |= ports
                assert ports, "a rule without peers and ports would open everything"
            elif peers == [{"podSelector": {}}]:
                assert "ports" not in rule  # the namespace itself: all Ray ports
            elif "podSelector" in peers[0]:
                assert peers[0]["podSelector"]["matchLabels"] == kuberay.OPERATOR_POD_LABELS
            else:
                assert peers == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": monitoring}}}]
                assert ports == {p.number for p in RAY_PORTS.scraped_on_head()}
        # From anywhere only the serve port: the load balancer's IP targets.
        assert open_ports == {RAY_PORTS.serve.number}
        for internal in (6379, 8265, 10001, 8080):
            assert internal not in open_ports


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
