"""The twin's router (twin/routing.py): the rendered command, with discovery swapped for the live replicas."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import yaml

from infra.serving.router import ROUTER_CONTAINER, router_name
from tests.harness import ROUTING, manifests_of, render_routed, stack_doc
from twin.routing import imbalance, router_specs, static_command


def _rendered_command(service: str) -> list[str]:
    (dep,) = [
        d for d in manifests_of(render_routed("prod"), "Deployment") if d["metadata"]["name"] == router_name(service)
    ]
    (router,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == ROUTER_CONTAINER]
    command: list[str] = router["command"]
    return command


def test_the_twin_builds_the_command_the_render_gives_the_deployment(tmp_path: Path) -> None:
    doc = copy.deepcopy(stack_doc("prod"))
    doc["config"]["llm-platform:serving"] = {**doc["config"].get("llm-platform:serving", {}), "routing": ROUTING}
    path = tmp_path / "Pulumi.prod.yaml"
    path.write_text(yaml.safe_dump(doc))
    specs = router_specs(path)
    assert sorted(specs) == sorted(rs["metadata"]["name"] for rs in manifests_of(render_routed("prod"), "RayService"))
    for service, spec in specs.items():
        assert spec.enabled
        assert list(spec.command) == _rendered_command(service)


def test_the_committed_prod_stack_runs_no_router_but_the_twin_still_knows_it() -> None:
    specs = router_specs(Path(__file__).resolve().parents[2] / "Pulumi.prod.yaml")
    assert specs and not any(s.enabled for s in specs.values())


def test_discovery_becomes_the_replicas_and_the_rest_is_kept() -> None:
    router_args = pytest.importorskip("vllm_router.router_args", reason="pip install -r requirements-dev.txt")
    rendered = _rendered_command("llama-31-8b")
    workers = ["http://127.0.0.1:41001", "http://127.0.0.1:41002"]
    argv = static_command(rendered, workers, 40000, 40001)
    assert not {"--service-discovery", "--selector", "--service-discovery-port"} & set(argv)
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_args.RouterArgs.add_cli_args(parser)
    assert argv[:3] == [sys.executable, "-m", "vllm_router.launch_router"]
    args = router_args.RouterArgs.from_cli_args(parser.parse_args(argv[3:]))
    assert not args.service_discovery and args.selector == {}
    assert args.worker_urls == workers
    assert (args.host, args.port, args.prometheus_host, args.prometheus_port) == (
        "127.0.0.1",
        40000,
        "127.0.0.1",
        40001,
    )
    # Everything else as rendered: the policy and its settings, the queue, the timeouts, the health checks.
    assert (args.policy, args.cache_threshold) == ("cache_aware", ROUTING["cache_threshold"])
    kept = [
        w
        for w in rendered
        if w.startswith("--")
        and w
        not in (
            "--service-discovery",
            "--service-discovery-namespace",
            "--service-discovery-port",
            "--selector",
            "--host",
            "--port",
            "--prometheus-host",
            "--prometheus-port",
        )
    ]
    assert [w for w in argv if w in kept] == kept


def test_imbalance_is_busiest_over_idlest() -> None:
    assert imbalance([60, 50]) == 1.2
    assert imbalance([10, 0]) == float("inf")


def test_the_twin_runs_the_rendered_gateway_and_router_readiness_for_a_model_at_zero(tmp_path: Path) -> None:
    """Dev with routing and the gateway: its one model at zero is woken, so the twin gets the gateway's settings
    (wake URL included) and the router's readiness on /liveness, exactly as rendered."""
    from infra.serving.gateway import GATEWAY_LABEL
    from tests.harness import GATEWAY
    from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

    doc = copy.deepcopy(stack_doc("dev"))
    serving = doc["config"].get("llm-platform:serving", {})
    doc["config"]["llm-platform:serving"] = {**serving, "routing": ROUTING, "gateway": GATEWAY}
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump(doc))
    (spec,) = router_specs(path).values()
    deployments = manifests_of(render_routed("dev"), "Deployment")
    (gateway,) = [d for d in deployments if d["spec"]["selector"]["matchLabels"] == GATEWAY_LABEL]
    (env,) = [e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == SETTINGS_ENV]
    assert spec.gateway == GatewaySettings.model_validate_json(env["value"])
    assert spec.gateway is not None and list(spec.gateway.wake) == list(spec.gateway.routes)
    (router,) = [d for d in deployments if d["metadata"]["name"] == router_name(spec.service)]
    containers = router["spec"]["template"]["spec"]["containers"]
    probes = [c["readinessProbe"]["httpGet"]["path"] for c in containers if "readinessProbe" in c]
    assert probes == [spec.readiness_path] == ["/liveness"]
