"""A vllm-server model at zero replicas, woken through the gateway and its router, on real Ray.

Dev's model scales to zero; with `serving.routing` and `serving.gateway` on it
runs the vllm-server layout (tests/harness.render_routed("dev")). This runs
what that render runs, on loopback: the real server (Serve, the replica's
vLLM server, the tiny model) at min_replicas 0; the rendered router command
and its nginx front, with no worker; the twin's stand-in for the router's
Kubernetes discovery (twin.routing.Discovery); and the rendered gateway
settings, whose wake URL becomes the local Serve proxy. A request at zero
must be held while Serve's autoscaler starts a replica for the wake, then
answered by that replica through the router; once idle, the replica goes
away again and the router is back to no worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from localserve.processes import Child
from localserve.server import catalog_for, replica_addresses, start, write_keys
from tests.harness import render_routed
from twin.gateway import local_settings, start_gateway, substitutions
from twin.routing import Discovery, TwinRouter, start_router
from workloads.inference_server.gateway import NO_WORKERS
from workloads.inference_server.gateway_settings import SETTINGS_ENV, GatewaySettings

pytestmark = pytest.mark.e2e

SERVICE = "llama-31-8b"
# Serve's autoscaling for the test's replica: back to zero soon after the last request.
DOWNSCALE_DELAY_S = 5
SERVER_READY_S = 240.0
# The wake: Serve places the replica, vLLM loads the tiny model and compiles nothing (eager).
WAKE_TIMEOUT_S = 300.0
BACK_TO_ZERO_S = 180.0


def _rendered_gateway() -> GatewaySettings:
    (dep,) = [
        d for d in render_routed("dev").manifests if d["kind"] == "Deployment" and "gateway" in d["metadata"]["name"]
    ]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == SETTINGS_ENV]
    return GatewaySettings.model_validate_json(env["value"])


@dataclass
class Woken:
    """The server at zero, its router (no worker), discovery and the gateway."""

    model_id: str
    api_key: str
    gateway_url: str
    metrics_url: str
    router: TwinRouter
    discovery: Discovery
    address_dir: Path


def _wait_for(log: Path, mark: str, child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while mark not in log.read_text(errors="replace"):
        if child.proc.poll() is not None:
            pytest.fail(f"the server exited with {child.proc.returncode}:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {mark!r} after {timeout_s:.0f}s:\n{child.log_tail()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def woken(tiny_model: Path, e2e_dir: Path) -> Iterator[Woken]:
    from infra.serving.router import router_plans
    from tests.harness import stack_config

    rendered = _rendered_gateway()
    (model_id,) = rendered.wake
    work = e2e_dir / "wake"
    work.mkdir()
    api_key = write_keys(work / "keys")
    catalog = catalog_for(tiny_model, work / "keys", layout="vllm-server")
    # The tiny model under the stack's model id, so the rendered routes hold; at zero, as dev's is.
    (model,) = catalog["models"]  # type: ignore[misc]
    model["model_id"] = model_id
    model["autoscaling"].update(min_replicas=0, max_replicas=1, downscale_delay_s=DOWNSCALE_DELAY_S)
    # A replica leaving takes its drain notice first (for the load balancer): short here, nothing else sends.
    catalog["vllm_server"]["drain_notice_s"] = 1  # type: ignore[index]
    server = start(work, catalog, api_key, layout="vllm-server", ray_dir=e2e_dir / "rayw")
    router = discovery = gateway = None
    try:
        _wait_for(server.child.log_path, "SERVER READY", server.child, SERVER_READY_S)
        assert server.address_dir is not None
        serve_proxy = server.base_url.removesuffix("/v1") + "/"
        # The router the render runs for the model (its plan under routing + gateway), with no worker.
        from tests.harness import GATEWAY, ROUTING, stack_sections

        serving = {**stack_sections("dev").get("serving", {}), "routing": ROUTING, "gateway": GATEWAY}
        plan = router_plans(stack_config("dev", serving=serving))[SERVICE]
        assert plan.woken
        router, _ = start_router(plan.command, [], work / "router.log", plan.front, plan.readiness_path)
        discovery = Discovery(router, server.address_dir).start()
        settings = local_settings(
            rendered, {model_id: router.base_url.removesuffix("/v1")}, str(work / "keys"), {model_id: serve_proxy}
        )
        for line in substitutions(rendered, settings):
            print(f"\n[e2e] {line}", flush=True)
        gateway = start_gateway(settings, work / "gateway.log")
        yield Woken(
            model_id,
            api_key,
            f"http://{settings.host}:{settings.port}",
            f"http://{settings.host}:{settings.metrics_port}/metrics",
            router,
            discovery,
            server.address_dir,
        )
    finally:
        if gateway is not None:
            gateway.stop(grace_s=5)
        if discovery is not None:
            discovery.stop()
        if router is not None:
            router.stop()
        server.child.stop()


def _chat(url: str, woken: Woken, timeout_s: float) -> httpx.Response:
    body = {"model": woken.model_id, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {woken.api_key}"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout_s)


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def test_a_request_at_zero_wakes_the_model_and_is_answered_then_the_model_sleeps_again(woken: Woken) -> None:
    assert replica_addresses(woken.address_dir) == [], "the model must start at zero"
    at_zero = _chat(woken.router.base_url.removesuffix("/v1"), woken, 30)
    assert at_zero.status_code == 503 and at_zero.content.startswith(NO_WORKERS), at_zero.text

    started = time.monotonic()
    answer = _chat(woken.gateway_url, woken, WAKE_TIMEOUT_S)
    took = time.monotonic() - started
    print(f"\n[e2e] wake: the request at zero was answered in {took:.1f}s", flush=True)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None
    assert len(replica_addresses(woken.address_dir)) == 1
    assert [verb for _, verb, _ in woken.discovery.events] == ["add"]
    assert _metric(woken.metrics_url, "llm_gateway_wakes_total") == 1

    # Awake: straight through, without another wake.
    started = time.monotonic()
    assert _chat(woken.gateway_url, woken, 60).status_code == 200
    assert time.monotonic() - started < 30
    assert _metric(woken.metrics_url, "llm_gateway_wakes_total") == 1

    # Idle: Serve's autoscaler (our policy on vLLM's queue) takes it back to zero, and the router has no worker.
    deadline = time.monotonic() + BACK_TO_ZERO_S
    while replica_addresses(woken.address_dir) or [v for _, v, _ in woken.discovery.events] != ["add", "remove"]:
        assert time.monotonic() < deadline, f"still a replica after {BACK_TO_ZERO_S:.0f}s"
        time.sleep(2)
    print(f"\n[e2e] wake: back at zero {time.monotonic() - started:.0f}s after the last request", flush=True)
    again = _chat(woken.router.base_url.removesuffix("/v1"), woken, 30)
    assert again.status_code == 503 and again.content.startswith(NO_WORKERS), again.text
