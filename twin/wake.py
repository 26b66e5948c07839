"""A vllm-server model at zero replicas in the twin: woken through the gateway and its router, then back to zero.

Such a model (`min_replicas: 0`, with `serving.routing` and `serving.gateway`
on) has no replica until a request comes. The twin runs what the render runs
in front of it: the model's router (the rendered command, with no worker, as
Kubernetes discovery finds no pod at zero) behind its front, the twin's
stand-in for that discovery (twin.routing.Discovery), and the gateway with
its rendered settings, whose wake URL becomes the local head's Serve proxy.
The request at zero must be held while Serve's autoscaler starts a replica
for the gateway's wake and the Ray autoscaler a node for it, then answered by
that replica; once idle, the replica and its node go away again and the
router is back to no worker.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localserve.processes import free_port
from twin.gateway import ask, chat_body, local_settings, start_gateway, substitutions
from twin.routing import HOST, Discovery, RouterSpec, start_router
from workloads.inference_server.gateway import NO_WORKERS
from workloads.inference_server.guard import CHAT_PATH


@dataclass(frozen=True)
class WakeRun:
    """What one wake showed: the held request's answer and how long it took, and what discovery saw."""

    status: int
    seconds: float
    content: str | None
    events: list[tuple[float, str, str]]
    # The next request, once awake: its status and seconds, and the wakes the gateway had started by then.
    next_status: int
    next_seconds: float
    wakes: float


def gateway_wakes(metrics_url: str) -> float:
    """The gateway's `llm_gateway_wakes_total`, every model summed."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "llm_gateway_wakes_total"
    )


def router_has_no_worker(router_root: str, model_id: str, key: str) -> bool:
    """Whether the router answers a chat with its own "no worker" 503 (what it does at zero)."""
    answer = ask(router_root, CHAT_PATH, key, chat_body(model_id, stream=False), timeout_s=30)
    return answer.status == 503 and answer.body.startswith(NO_WORKERS)


def wake_through_gateway(
    spec: RouterSpec,
    keys_file: str,
    address_dir: Path,
    serve_proxy: str,
    api_key: str,
    model_id: str,
    log_dir: Path,
    report_sub: Callable[[str], None],
    then: Callable[[WakeRun, str], None],
) -> WakeRun:
    """One request at zero through the gateway and the model's router; ``then`` gets the run and the router's
    root while both still run (the twin checks the way back to zero there)."""
    assert spec.gateway is not None
    router, _ = start_router(spec.command, [], log_dir / "wake-router.log", spec.front, spec.readiness_path)
    discovery = Discovery(router, address_dir).start()
    try:
        root = router.base_url.removesuffix("/v1")
        if not router_has_no_worker(root, model_id, api_key):
            raise RuntimeError("the router has a worker before the first request: the model is not at zero")
        dead = f"http://{HOST}:{free_port()}"
        routes = {m: (root if m == model_id else dead) for m in spec.gateway.routes}
        wakes = {m: (serve_proxy if m == model_id else dead + "/") for m in spec.gateway.wake}
        local = local_settings(spec.gateway, routes, keys_file, wakes)
        for line in substitutions(spec.gateway, local):
            report_sub(line)
        gateway = start_gateway(local, log_dir / "wake-gateway.log")
        try:
            timeout = local.wake[model_id].hold_s + 30
            base = f"http://{local.host}:{local.port}"
            started = time.monotonic()
            first = ask(base, CHAT_PATH, api_key, chat_body(model_id, stream=False), timeout_s=timeout)
            seconds = time.monotonic() - started
            content = None
            if first.status == 200:
                content = json.loads(first.body)["choices"][0]["message"]["content"]
            started = time.monotonic()
            following = ask(base, CHAT_PATH, api_key, chat_body(model_id, stream=False), timeout_s=timeout)
            next_seconds = time.monotonic() - started
            woken = gateway_wakes(f"http://{local.host}:{local.metrics_port}/metrics")
            run = WakeRun(first.status, seconds, content, list(discovery.events), following.status, next_seconds, woken)
            then(run, root)
            return run
        finally:
            gateway.stop(grace_s=10)
    finally:
        discovery.stop()
        router.stop()
