"""A router pod that is going away finishes what it holds: vllm-router's own SIGTERM, and the pod that gives it time.

The render gives the router's pod a preStop wait (the load balancer stops
sending new connections first) and a grace period covering every request it
holds, on the promise that vllm-router, on SIGTERM, stops accepting and lets
its requests finish before it exits. That promise is checked here on the
pinned release itself: the router runs the prod stack's command (discovery
swapped for a stand-in replica that streams slowly), one stream is in
flight when SIGTERM arrives.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from infra.serving.router import DEREGISTER_SECONDS, EXIT_SECONDS, router_plans
from tests.e2e.loopback_http import CHUNKS, LoopbackHttp, SlowReplica
from tests.harness import manifests_of, render_routed, stack_config
from twin.routing import router_specs, start_router

ROOT = Path(__file__).resolve().parents[1]


def test_on_their_stop_signals_the_front_and_router_take_no_new_connection_and_finish_the_stream_they_hold(
    tmp_path: Path,
) -> None:
    # After their preStop sleeps the kubelet signals both containers of the
    # pod at once: the router SIGTERM, the front its image's SIGQUIT.
    replica = LoopbackHttp(SlowReplica)
    spec = next(iter(router_specs(ROOT / "Pulumi.prod.yaml").values()))
    router, _ = start_router(spec.command, [replica.base_url], tmp_path / "router.log", spec.front, env=spec.env)
    seen: dict[str, Any] = {"chunks": 0, "done": False}

    def stream() -> None:
        body = {"model": "m", "prompt": "hello", "stream": True}
        with httpx.stream("POST", router.base_url + "/completions", json=body, timeout=30) as answer:
            seen["status"] = answer.status_code
            for line in answer.iter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    seen["chunks"] += 1

    try:
        client = threading.Thread(target=stream)
        client.start()
        deadline = time.monotonic() + 10
        while seen["chunks"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen["chunks"] >= 3, "the stream did not start"
        os.kill(router.front.proc.pid, signal.SIGQUIT)
        os.kill(router.child.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        refused = False
        try:
            httpx.post(router.base_url + "/completions", json={"model": "m", "prompt": "x"}, timeout=5)
        except httpx.ConnectError:
            refused = True
        client.join(timeout=30)
        codes = (router.front.proc.wait(timeout=30), router.child.proc.wait(timeout=30))
    finally:
        router.stop()
        replica.stop()
    assert refused, "a new connection was taken after the stop signals"
    assert seen == {"chunks": CHUNKS, "done": True, "status": 200}
    assert codes == (0, 0)


def test_the_router_pod_waits_for_the_load_balancer_then_gives_its_requests_their_timeout() -> None:
    plans = router_plans(stack_config("prod"))
    deployments = {d["metadata"]["name"]: d for d in manifests_of(render_routed("prod"), "Deployment")}
    assert plans
    for service, plan in plans.items():
        dep = deployments[f"{service}-router"]
        pod = dep["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in pod["containers"]}
        assert sorted(containers) == ["front", "router"]
        command = containers["router"]["command"]
        timeout = int(command[command.index("--request-timeout-secs") + 1])
        assert timeout == plan.request_timeout_s
        for container in containers.values():
            assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": DEREGISTER_SECONDS}}}
        assert pod["terminationGracePeriodSeconds"] == DEREGISTER_SECONDS + timeout + EXIT_SECONDS
        # Rollouts add a router before one goes.
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
