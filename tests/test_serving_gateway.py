"""The model gateway (serving.gateway) as rendered: its routes, its keys, who reaches it and whom it reaches.

Which pods its selectors pick, among the pods the cluster would hold, is
checked with every other selector in tests/test_selectors.py ("prod-routed",
which turns the gateway on).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from infra import versions
from infra.config import PROD_MIN_GATEWAY_REPLICAS, Gateway
from infra.render import Rendered
from infra.serving.endpoint import public_service_name
from infra.serving.gateway import GATEWAY_LABEL, GATEWAY_METRICS, GATEWAY_PORT, upstream_name
from infra.serving.router import ROUTER_PORT, router_name, router_pods
from tests.harness import GATEWAY, ROUTING, SERVE_INGRESS, config_problems, manifests_of, render_routed, render_stack
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

# The gateway's default name (serving.gateway.name), which the routed render keeps.
NAME = Gateway().name


def routed() -> Rendered:
    return render_routed("prod")


def _named(kind: str, name: str, rendered: Rendered | None = None) -> dict[str, Any]:
    (found,) = [m for m in manifests_of(rendered or routed(), kind) if m["metadata"]["name"] == name]
    return found


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _named("Deployment", NAME)["spec"]["template"]["spec"]
    return spec


def _settings() -> GatewaySettings:
    (container,) = _pod()["containers"]
    (env,) = [e for e in container["env"] if e["name"] == SETTINGS_ENV]
    return GatewaySettings.model_validate_json(env["value"])


def _ray_services() -> dict[str, dict[str, Any]]:
    return {rs["metadata"]["name"]: rs for rs in manifests_of(routed(), "RayService")}


def test_the_gateway_is_off_unless_asked_for() -> None:
    for stack in (SERVE_INGRESS, "prod"):
        rendered = render_stack(stack)
        assert not [d for d in manifests_of(rendered, "Deployment") if d["metadata"]["name"] == NAME], stack
        assert "gateway_endpoint" not in rendered.outputs
    # Dev asks for it: its model sleeps at zero, and only the gateway wakes it.
    rendered = render_stack("dev")
    assert [d for d in manifests_of(rendered, "Deployment") if d["metadata"]["name"] == NAME]
    assert "gateway_endpoint" in rendered.outputs


def test_each_model_is_routed_to_its_own_router() -> None:
    """Model id -> the ClusterIP Service of the router in front of exactly that model's replicas."""
    routes = _settings().routes
    services = set(_ray_services())
    assert len(routes) == len(services) == 2
    for model, url in routes.items():
        (service,) = [s for s in services if url == f"http://{upstream_name(s)}.llm.svc:{ROUTER_PORT.number}"]
        upstream = _named("Service", upstream_name(service))
        assert upstream["spec"]["type"] == "ClusterIP"
        assert upstream["spec"]["selector"] == router_pods(service)
        assert [p["targetPort"] for p in upstream["spec"]["ports"]] == [ROUTER_PORT.name]
        # The model the route names is the one that service serves.
        # The model the route names is the one that service serves (its own endpoint's model).
        served = {m for m, url in routed().outputs["endpoints"].items() if url.startswith(f"https://{service}.")}
        assert served == {model}


def test_the_gateway_holds_the_replicas_limits_and_reads_the_same_keys() -> None:
    settings = _settings()
    front = json.loads(json.dumps(_named("ConfigMap", f"{router_name(next(iter(_ray_services())))}-front")))
    conf = next(iter(front["data"].values()))
    assert f"client_max_body_size {settings.max_body_bytes};" in conf
    # The keys: the Secret every server's guard reads, mounted read-only; no key in the settings.
    rs = json.dumps(next(iter(_ray_services().values())))
    (server_secret,) = {v["secret"]["secretName"] for v in _volumes(json.loads(rs)) if v["name"] == "api-keys"}
    (keys,) = [v for v in _pod()["volumes"] if v["name"] == "api-keys"]
    assert keys["secret"]["secretName"] == server_secret
    (container,) = _pod()["containers"]
    (mount,) = container["volumeMounts"]
    assert mount["readOnly"] is True and settings.api_keys_file is not None
    assert settings.api_keys_file.startswith(mount["mountPath"] + "/")
    # It calls no Kubernetes API: no token.
    assert _pod()["automountServiceAccountToken"] is False
    assert _named("ServiceAccount", NAME)["automountServiceAccountToken"] is False
    # A stopping gateway finishes the longest request the routers would.
    assert settings.request_timeout_s > 0
    assert _pod()["terminationGracePeriodSeconds"] > settings.request_timeout_s


def _volumes(value: Any) -> list[dict[str, Any]]:
    """Every pod volume anywhere in a manifest."""
    if isinstance(value, dict):
        found = list(value.get("volumes", [])) if isinstance(value.get("volumes"), list) else []
        return found + [v for child in value.values() for v in _volumes(child)]
    if isinstance(value, list):
        return [v for child in value for v in _volumes(child)]
    return []


def test_the_load_balancer_sends_to_the_gateway_like_each_models_own() -> None:
    public = _named("Service", public_service_name(NAME))
    assert public["spec"]["selector"] == GATEWAY_LABEL
    (port,) = public["spec"]["ports"]
    assert port["targetPort"] == GATEWAY_PORT.name
    own = _named("Service", public_service_name(next(iter(_ray_services()))))
    for key in ("type", "loadBalancerClass", "loadBalancerSourceRanges"):
        assert public["spec"].get(key) == own["spec"].get(key), key
    same = {k: v for k, v in own["metadata"]["annotations"].items() if "hostname" not in k}
    assert {k: v for k, v in public["metadata"]["annotations"].items() if "hostname" not in k} == same
    assert routed().outputs["gateway_endpoint"] == "https://llm-gateway.llm.example.com/v1"


def test_the_gateway_reaches_only_the_routers_and_they_admit_it() -> None:
    policy = _named("NetworkPolicy", NAME)["spec"]
    assert policy["podSelector"] == {"matchLabels": GATEWAY_LABEL}
    (egress,) = policy["egress"]
    assert egress["ports"] == [{"protocol": "TCP", "port": ROUTER_PORT.number}]
    assert sorted(json.dumps(p, sort_keys=True) for p in egress["to"]) == sorted(
        json.dumps({"podSelector": {"matchLabels": router_pods(s)}}, sort_keys=True) for s in _ray_services()
    )
    ports = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    assert ports == {GATEWAY_PORT.number, GATEWAY_METRICS.number}
    for service in _ray_services():
        router = _named("NetworkPolicy", router_name(service))["spec"]
        sources = [
            s for rule in router["ingress"] if rule["ports"][0]["port"] == ROUTER_PORT.number for s in rule["from"]
        ]
        assert {"podSelector": {"matchLabels": GATEWAY_LABEL}} in sources


def test_prod_gateways_survive_a_node_and_a_zone() -> None:
    dep = _named("Deployment", NAME)
    assert dep["spec"]["replicas"] == GATEWAY["min_replicas"] >= PROD_MIN_GATEWAY_REPLICAS
    zone = [c for c in _pod()["topologySpreadConstraints"] if c["topologyKey"] == "topology.kubernetes.io/zone"]
    assert zone and zone[0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert zone[0]["labelSelector"] == {"matchLabels": GATEWAY_LABEL}
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert _named("PodDisruptionBudget", NAME)["spec"]["maxUnavailable"] == 1
    assert _named("HorizontalPodAutoscaler", NAME)["spec"]["minReplicas"] == GATEWAY["min_replicas"]
    monitor = _named("PodMonitor", NAME)["spec"]
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == [GATEWAY_METRICS.name]


def test_gateway_manifests_validate_against_the_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    services = {public_service_name(NAME), *(upstream_name(s) for s in _ray_services())}
    checked = 0
    for manifest in routed().manifests:
        name, kind = manifest["metadata"]["name"], manifest.get("kind")
        if (name == NAME and kind != "PodMonitor") or (kind == "Service" and name in services):
            kubernetes_validate.validate(
                json.loads(json.dumps(manifest)), f"{versions.KUBERNETES_VERSION}.0", strict=True
            )
            checked += 1
    # Account, policy, Deployment, budget, autoscaler; its load balancer; one Service per router.
    assert checked == 5 + 1 + len(_ray_services())


@pytest.mark.parametrize(
    ("stack", "serving", "expect"),
    [
        ("prod", {"gateway": {"enabled": True, "min_replicas": 2}}, "serving.gateway.enabled: needs serving.routing"),
        ("prod", {"routing": ROUTING, "gateway": {"enabled": True, "min_replicas": 1}}, "serving.gateway.min_replicas"),
        (
            SERVE_INGRESS,
            {"gateway": {"enabled": True}},
            "serving.gateway.enabled: every service must run the vllm-server",
        ),
        ("prod", {"routing": ROUTING, "gateway": {**GATEWAY, "name": "llama-31-8b"}}, "serving.gateway.name"),
        ("prod", {"routing": ROUTING, "gateway": {**GATEWAY, "name": "Bad_Name"}}, "serving.gateway"),
        ("prod", {"routing": ROUTING, "gateway": {**GATEWAY, "max_replicas": 1}}, "serving.gateway"),
    ],
)
def test_bad_gateway_is_one_line_naming_the_key(stack: str, serving: dict[str, Any], expect: str) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["serving"] = {**raw.get("serving", {}), **serving}

    problems = config_problems(stack, change)
    assert any(p.startswith(f"config error: {expect}") for p in problems), problems
