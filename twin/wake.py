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

from localserve.processes import Child, free_port
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


class WokenFront:
    """What the render runs in front of a woken model, on loopback, until stopped: the model's router (the
    rendered command with no worker, as discovery finds no pod at zero) behind its front, the twin's stand-in
    for its discovery, and the gateway with the rendered settings, its wake URL ``serve_proxy``.

    The gateway routes every other model the render names to a closed port: one front per model.
    """

    def __init__(
        self,
        spec: RouterSpec,
        keys_file: str,
        address_dir: Path,
        serve_proxy: str,
        model_id: str,
        log_dir: Path,
        report_sub: Callable[[str], None],
    ) -> None:
        if spec.gateway is None or model_id not in spec.gateway.wake:
            raise ValueError(f"the render runs no gateway that wakes {model_id}")
        self.model_id = model_id
        router, _ = start_router(
            spec.command, [], log_dir / "wake-router.log", spec.front, spec.readiness_path, env=spec.env
        )
        self.router = router
        self.discovery = Discovery(router, address_dir).start()
        self.gateway: Child | None = None
        try:
            self.router_root = router.base_url.removesuffix("/v1")
            dead = f"http://{HOST}:{free_port()}"
            routes = {m: (self.router_root if m == model_id else dead) for m in spec.gateway.routes}
            wakes = {m: (serve_proxy if m == model_id else dead + "/") for m in spec.gateway.wake}
            self.settings = local_settings(spec.gateway, routes, keys_file, wakes)
            for line in substitutions(spec.gateway, self.settings):
                report_sub(line)
            self.gateway = start_gateway(self.settings, log_dir / "wake-gateway.log")
        except BaseException:
            self.stop()
            raise
        self.base = f"http://{self.settings.host}:{self.settings.port}"
        self.metrics_url = f"http://{self.settings.host}:{self.settings.metrics_port}/metrics"

    @property
    def hold_s(self) -> float:
        """How long the gateway holds a request for the model at zero."""
        return float(self.settings.wake[self.model_id].hold_s)

    def stop(self) -> None:
        """The gateway, discovery and router, in that order."""
        if self.gateway is not None:
            self.gateway.stop(grace_s=10)
        self.discovery.stop()
        self.router.stop()


def wake_through_gateway(front: WokenFront, api_key: str, then: Callable[[WakeRun, str], None]) -> WakeRun:
    """One request at zero through ``front``'s gateway and router, then the next; ``then`` gets the run and the
    router's root while both still run (the twin checks the way back to zero there)."""
    model_id, root = front.model_id, front.router_root
    if not router_has_no_worker(root, model_id, api_key):
        raise RuntimeError("the router has a worker before the first request: the model is not at zero")
    timeout = front.hold_s + 30
    started = time.monotonic()
    first = ask(front.base, CHAT_PATH, api_key, chat_body(model_id, stream=False), timeout_s=timeout)
    seconds = time.monotonic() - started
    content = None
    if first.status == 200:
        content = json.loads(first.body)["choices"][0]["message"]["content"]
    started = time.monotonic()
    following = ask(front.base, CHAT_PATH, api_key, chat_body(model_id, stream=False), timeout_s=timeout)
    next_seconds = time.monotonic() - started
    woken = gateway_wakes(front.metrics_url)
    events = list(front.discovery.events)
    run = WakeRun(first.status, seconds, content, events, following.status, next_seconds, woken)
    then(run, root)
    return run
