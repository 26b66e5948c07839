"""A vllm-server model at min_replicas 0, woken by the model gateway, as rendered.

Dev's model scales to zero. With `serving.routing` and `serving.gateway` on
(tests/harness.render_routed("dev")) it runs the vllm-server layout, and the
gateway wakes it through its head's Serve proxy. What the cluster would make
of the render (KubeRay's head and serve Services) is built by the KubeRay
mirror, not written here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from infra.config import Gateway
from infra.config.cold_start import cold_start_budget
from infra.render import Rendered
from infra.serving.gateway import GATEWAY_LABEL
from infra.serving.network import head_service_pods
from infra.serving.ports import RAY_PORTS
from infra.serving.router import router_name
from infra.serving.router_front import LIVENESS_PATH, READINESS_PATH
from tests.harness import (
    GATEWAY,
    ROUTING,
    config_problems,
    manifests_of,
    ray_cluster,
    render_config,
    render_routed,
    render_stack,
    stack_config,
    stack_doc,
)
from twin import kuberay as mirror
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

NAME = Gateway().name
SERVICE = "llama-31-8b"


def woken() -> Rendered:
    return render_routed("dev")


def _named(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests_of(rendered, kind) if m["metadata"]["name"] == name]
    return found


def _settings(rendered: Rendered) -> GatewaySettings:
    (container,) = _named(rendered, "Deployment", NAME)["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == SETTINGS_ENV]
    return GatewaySettings.model_validate_json(env["value"])


def _ray_service(rendered: Rendered) -> dict[str, Any]:
    return _named(rendered, "RayService", SERVICE)


def test_dev_at_zero_runs_vllm_server_only_with_the_gateway() -> None:
    for rendered in (render_stack("dev"), woken()):
        rs = _ray_service(rendered)
        assert yaml.safe_load(rs["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"
    (model,) = stack_config("dev").models
    assert model.autoscaling.min_replicas == 0
    assert stack_config("dev").layout_of(SERVICE) == "vllm-server"

    # Without the gateway nothing in the vllm-server path would wake it: serve-ingress.
    def no_gateway(raw: dict[str, Any]) -> None:
        for section in ("routing", "gateway"):
            raw["llm-platform:serving"].pop(section)

    assert stack_config("dev", no_gateway).layout_of(SERVICE) == "serve-ingress"


def test_a_woken_models_endpoint_is_the_gateways() -> None:
    """Its own load balancer leads to a router with no replica while it sleeps: the outputs give the
    address that wakes it, the gateway's."""
    doc = stack_doc("dev")
    endpoint = {"domain": "llm.example.com", "hosted_zone_id": "Z0123456789EXAMPLEZONE"}
    doc["config"]["llm-platform:endpoint"] = {**doc["config"]["llm-platform:endpoint"], **endpoint}
    outputs = render_config(doc, "dev").outputs
    gateway = f"http://{NAME}.llm.example.com:{RAY_PORTS.openai.number}/v1"
    assert outputs["gateway_endpoint"] == gateway
    assert outputs["endpoints"] == {"llama-3.1-8b-instruct": gateway}
    assert outputs["endpoint"] == gateway
    # Prod's models keep a replica: each keeps its own address beside the gateway's.
    routed = render_routed("prod").outputs
    assert routed["gateway_endpoint"] not in routed["endpoints"].values()


def test_the_wake_reaches_serves_proxy_through_the_head_service_kuberay_builds() -> None:
    rendered = woken()
    rs = _ray_service(rendered)
    cluster = ray_cluster(rs)
    head_svc = mirror.build_head_service(cluster)
    wake = _settings(rendered).wake
    (model_id,) = wake
    url = urlsplit(wake[model_id].url)
    assert url.hostname == f"{head_svc['metadata']['name']}.{head_svc['metadata']['namespace']}.svc"
    ports = {p["name"]: p["port"] for p in head_svc["spec"]["ports"]}
    assert ports[RAY_PORTS.wake.name] == url.port
    # Serve's proxy listens there: the serve config's own HTTP port, on the head (HeadOnly).
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["http_options"]["port"] == url.port
    # And KubeRay keeps it out of the serve Service, which still sends to the replicas' servers.
    serve_svc = mirror.first_serve_service(cluster)
    assert url.port not in {p["port"] for p in serve_svc["spec"]["ports"]}
    assert RAY_PORTS.wake.name not in {p["name"] for p in serve_svc["spec"]["ports"]}


def test_the_gateway_may_reach_the_head_service_and_the_head_admits_only_it_there() -> None:
    rendered = woken()
    port = RAY_PORTS.wake.number
    gateway = _named(rendered, "NetworkPolicy", NAME)["spec"]
    (rule,) = [r for r in gateway["egress"] if r["ports"] == [{"protocol": "TCP", "port": port}]]
    (peer,) = rule["to"]
    # The VPC CNI adds a Service's cluster IP to an egress rule only when the rule's pod
    # selector matches the Service's own selector (network.head_service_pods).
    head_svc = mirror.build_head_service(ray_cluster(_ray_service(rendered)))
    assert mirror.selects(peer["podSelector"], head_svc["spec"]["selector"])
    assert peer == {"podSelector": {"matchLabels": head_service_pods()}}
    head = _named(rendered, "NetworkPolicy", f"{SERVICE}-ray-head")["spec"]
    on_port = [r for r in head["ingress"] if {"protocol": "TCP", "port": port} in r["ports"]]
    gateway_rules = [r for r in on_port if r["from"] == [{"podSelector": {"matchLabels": GATEWAY_LABEL}}]]
    assert [r["ports"] for r in gateway_rules] == [[{"protocol": "TCP", "port": port}]]


def test_heads_declare_the_wake_port_only_for_a_woken_model() -> None:
    def head_ports(rendered: Rendered) -> dict[str, set[str]]:
        return {
            rs["metadata"]["name"]: {
                p["name"]
                for c in rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            for rs in manifests_of(rendered, "RayService")
        }

    assert RAY_PORTS.wake.name in head_ports(woken())[SERVICE]
    # Prod's models never scale to zero: its routed render (gateway on) declares none, and wakes nothing.
    assert not any(RAY_PORTS.wake.name in names for names in head_ports(render_routed("prod")).values())
    assert _settings(render_routed("prod")).wake == {}


def test_the_hold_is_the_gateways_and_the_retry_after_the_models_cold_start() -> None:
    cfg = stack_config("dev")
    (model,) = cfg.models
    (wake,) = _settings(woken()).wake.values()
    assert wake.hold_s == Gateway().wake_hold_seconds
    assert wake.max_held == Gateway().wake_max_held
    assert wake.cold_start_s == round(cold_start_budget(cfg, model).total)


def test_a_woken_models_router_is_ready_at_zero_and_prods_only_with_a_replica() -> None:
    def readiness(rendered: Rendered, service: str) -> str:
        pod = _named(rendered, "Deployment", router_name(service))["spec"]["template"]["spec"]
        paths = [c["readinessProbe"]["httpGet"]["path"] for c in pod["containers"] if "readinessProbe" in c]
        (path,) = set(paths)
        return str(path)

    assert readiness(woken(), SERVICE) == LIVENESS_PATH
    for rs in manifests_of(render_routed("prod"), "RayService"):
        assert readiness(render_routed("prod"), rs["metadata"]["name"]) == READINESS_PATH


@pytest.mark.parametrize(
    ("serving", "expect"),
    [
        (
            {"routing": ROUTING, "gateway": {**GATEWAY, "wake_hold_seconds": 341}},
            "serving.gateway.wake_hold_seconds: 341s is longer than 340s: the load balancer closes a connection idle",
        ),
        (
            {"routing": ROUTING, "gateway": {**GATEWAY, "wake_max_held": 0}},
            "serving.gateway.wake_max_held",
        ),
        (
            {"layout": "vllm-server", "routing": {"enabled": False}},
            "serving.layout: vllm-server: model 'llama-31-8b' needs autoscaling.min_replicas >= 1, or "
            "serving.gateway and serving.routing enabled",
        ),
    ],
)
def test_bad_wake_settings_are_one_line_naming_the_key(serving: dict[str, Any], expect: str) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["serving"] = {**raw.get("serving", {}), **serving}

    problems = config_problems("dev", change)
    assert any(p.startswith(f"config error: {expect}") for p in problems), problems


def test_a_gateway_for_one_model_that_never_sleeps_is_still_refused() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["serving"] = {**raw.get("serving", {}), "routing": ROUTING, "gateway": GATEWAY}
        raw["models"][0]["autoscaling"]["min_replicas"] = 1

    problems = config_problems("dev", change)
    assert any("serving.gateway.enabled: one service has one model that never scales to zero" in p for p in problems)


def test_a_stalled_wake_pages_after_the_models_cold_start_budget() -> None:
    """LlmModelWakeStalled waits the woken model's cold-start budget (the figure preview prints), in minutes;
    a stack that wakes no model keeps the default."""
    import math

    from infra.serving import alerts

    def stalled(rendered: Rendered) -> dict[str, Any]:
        (rule,) = manifests_of(rendered, "PrometheusRule")
        return next(r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "LlmModelWakeStalled")

    cfg = stack_config("dev").model_copy(deep=True)
    budget = cold_start_budget(cfg, cfg.models[0]).total
    assert stalled(woken())["for"] == f"{math.ceil(budget / 60)}m" != f"{alerts.DEFAULT_WAKE_FOR_MINUTES}m"
    assert stalled(render_stack("prod"))["for"] == f"{alerts.DEFAULT_WAKE_FOR_MINUTES}m"
    assert alerts.wake_for_minutes([30.0, 601.0]) == 11 and alerts.wake_for_minutes([]) == 15
