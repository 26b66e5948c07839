"""The twin's gateway (twin/gateway.py): the rendered settings, with only addresses, routes and keys swapped."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from infra.config import Gateway
from infra.render import Rendered
from tests.harness import GATEWAY, ROUTING, manifests_of, render_routed, render_stack, stack_doc
from twin.gateway import local_settings, substitutions
from twin.routing import router_specs
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

ROOT = Path(__file__).resolve().parents[2]


def _rendered_settings(rendered: Rendered | None = None) -> GatewaySettings:
    """The settings the render gives the gateway's Deployment (by default, prod's with routing and the gateway on)."""
    deployments = manifests_of(rendered or render_routed("prod"), "Deployment")
    (dep,) = [d for d in deployments if d["metadata"]["name"] == Gateway().name]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == SETTINGS_ENV]
    return GatewaySettings.model_validate_json(env["value"])


def test_the_twin_runs_the_settings_the_render_gives_the_deployment(tmp_path: Path) -> None:
    doc = copy.deepcopy(stack_doc("prod"))
    serving = doc["config"].get("llm-platform:serving", {})
    doc["config"]["llm-platform:serving"] = {**serving, "routing": ROUTING, "gateway": GATEWAY}
    path = tmp_path / "Pulumi.prod.yaml"
    path.write_text(yaml.safe_dump(doc))
    gateways = [spec.gateway for spec in router_specs(path).values()]
    assert len(gateways) == 2 and all(g == _rendered_settings() for g in gateways)


def test_the_committed_stacks_the_twin_gateway_is_prods_two_models_and_devs_one_woken_model() -> None:
    for spec in router_specs(ROOT / "Pulumi.prod.yaml").values():
        assert spec.gateway is not None and spec.gateway.routes == _rendered_settings().routes
    # Dev routes its one model, at min_replicas 0: the gateway runs in front of its router to wake it,
    # with the very settings dev's render gives the gateway's Deployment.
    dev = router_specs(ROOT / "Pulumi.dev.yaml")
    assert set(dev) == {"llama-31-8b"}
    spec = dev["llama-31-8b"]
    assert spec.enabled and spec.gateway is not None
    assert spec.gateway == _rendered_settings(render_stack("dev"))
    assert set(spec.gateway.routes) == set(spec.gateway.wake) == {"llama-3.1-8b-instruct"}


def test_only_addresses_routes_and_keys_change_and_each_change_is_printed() -> None:
    rendered = _rendered_settings()
    routes = {model: f"http://127.0.0.1:{40000 + i}" for i, model in enumerate(sorted(rendered.routes))}
    local = local_settings(rendered, routes, "/tmp/twin-keys")
    changed = {k for k, v in local.model_dump().items() if v != rendered.model_dump()[k]}
    assert changed == {"host", "port", "metrics_port", "routes", "api_keys_file"}
    assert local.max_body_bytes == rendered.max_body_bytes and local.request_timeout_s == rendered.request_timeout_s
    lines = substitutions(rendered, local)
    for model in rendered.routes:
        assert any(rendered.routes[model] in line and routes[model] in line for line in lines), model
    with pytest.raises(ValueError, match="routes for"):
        local_settings(rendered, {next(iter(routes)): "http://127.0.0.1:1"}, "/tmp/twin-keys")
