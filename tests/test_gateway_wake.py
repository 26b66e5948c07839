"""The model gateway waking a model at zero replicas, in front of the real vllm-router.

The router is the pinned release, run with no worker: what a woken model's
router is at zero (Kubernetes discovery finds no Ready pod). The gateway
process is the image's. Two stand-ins play the cluster's parts, on loopback:
the model's Serve proxy, which gets the wake and, after a set delay (the
cold start), answers it and hands the new replica to the router, as
discovery would; and the replica, which answers chats.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from localserve.processes import Child, child_env, free_port
from tests.gateway_process import AUTH, GatewayProcess, Loop, error_of, gateway_settings, metric, post
from twin.routing import HOST, ROUTER_MODULE
from workloads.inference_server.gateway import MIN_RETRY_AFTER_S, NO_WORKERS

MODEL = "sleepy"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ROUTER_READY_S = 30.0
# The stand-in cold start: how long the Serve proxy holds the wake before the replica is up.
COLD_START_S = 2.0


class Replica:
    """A model replica's server: healthy, and answers every chat with its name."""

    def __init__(self, loop: Loop) -> None:
        self.chats = 0
        self.runner, self.port = loop.run(loop.serve(self._handle))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return web.json_response({})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        self.chats += 1
        message = {"role": "assistant", "content": "awake"}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})


class ServeProxy:
    """The model's Serve proxy at zero: holds each wake for the cold start, then adds the replica to the router."""

    def __init__(self, loop: Loop, router_url: str, replica: Replica, delay_s: float = COLD_START_S) -> None:
        self.wakes: list[float] = []
        self.delay_s = delay_s
        # Set when the test is over: a wake still sleeping then adds no replica to the next test's router.
        self.closed = False
        self.router_url = router_url
        self.replica = replica
        self.runner, self.port = loop.run(loop.serve(self._handle))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.wakes.append(time.monotonic())
        await asyncio.sleep(self.delay_s)
        if self.closed:
            return web.json_response({}, status=503)
        # What Kubernetes discovery does once the new replica's pod is Ready.
        await asyncio.to_thread(add_worker, self.router_url, self.replica.url)
        return web.json_response({"model": MODEL, "status": "ready"})


def add_worker(router_url: str, worker: str) -> None:
    request = urllib.request.Request(f"{router_url}/add_worker?url={worker}", method="POST")
    with urllib.request.urlopen(request, timeout=20) as answer:
        answer.read()


def remove_worker(router_url: str, worker: str) -> None:
    request = urllib.request.Request(f"{router_url}/remove_worker?url={worker}", method="POST")
    with urllib.request.urlopen(request, timeout=20) as answer:
        answer.read()


def workers(router_url: str) -> list[str]:
    with urllib.request.urlopen(f"{router_url}/list_workers", timeout=5) as answer:
        return list(json.loads(answer.read())["urls"])


@dataclass
class Zero:
    """A router with no worker, the stand-ins, and a gateway that wakes the model."""

    router_url: str
    proxy: ServeProxy
    replica: Replica
    url: str
    metrics_url: str

    tmp: Path
    loop: Loop

    def back_to_zero(self) -> None:
        for worker in workers(self.router_url):
            remove_worker(self.router_url, worker)
        self.proxy.wakes.clear()
        self.replica.chats = 0


def start_router(log: Path) -> tuple[Child, str]:
    """The pinned vllm-router with no worker, as a woken model's router is at zero."""
    port = free_port()
    argv = [sys.executable, "-m", ROUTER_MODULE, "--host", HOST, "--port", str(port), "--policy", "round_robin"]
    child = Child.start("vllm-router", argv, child_env(), log)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + ROUTER_READY_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/liveness", timeout=2):
                return child, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    child.stop(grace_s=5)
    raise RuntimeError(f"vllm-router did not start: {child.log_tail(5)}")


@contextlib.contextmanager
def gateway_at(tmp: Path, router_url: str, proxy: ServeProxy) -> Iterator[tuple[str, str]]:
    """A gateway that wakes MODEL through ``proxy``: its URL and metrics URL."""
    wake = {"url": proxy.url, "hold_s": 6, "max_held": 3, "cold_start_s": 30}
    settings = gateway_settings(tmp, {MODEL: router_url}, metrics_port=free_port(), wake={MODEL: wake}, wake_poll_s=0.2)
    gateway = GatewayProcess(settings)
    try:
        gateway.wait_listening()
        yield f"http://{HOST}:{settings['port']}", f"http://{HOST}:{settings['metrics_port']}/metrics"
    finally:
        gateway.stop()
        proxy.closed = True


@pytest.fixture(scope="module")
def zero(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zero]:
    tmp = tmp_path_factory.mktemp("wake")
    router, router_url = start_router(tmp / "router.log")
    loop = Loop()
    replica = Replica(loop)
    proxy = ServeProxy(loop, router_url, replica)
    try:
        with gateway_at(tmp, router_url, proxy) as (url, metrics_url):
            yield Zero(router_url, proxy, replica, url, metrics_url, tmp, loop)
    finally:
        router.stop(grace_s=5)


@pytest.fixture
def at_zero(zero: Zero) -> Zero:
    zero.back_to_zero()
    return zero


def test_the_pinned_router_at_zero_answers_what_the_gateway_reads_as_no_worker(at_zero: Zero) -> None:
    """The text the gateway holds on is the pinned router's own: a release that words it differently fails here."""
    answer = httpx.post(at_zero.router_url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=10)
    assert answer.status_code == 503
    assert answer.content.startswith(NO_WORKERS), answer.content
    # And it runs (its liveness, the woken router's readiness) with no worker.
    assert httpx.get(at_zero.router_url + "/liveness", timeout=5).status_code == 200


def test_a_request_at_zero_is_held_until_the_woken_replica_answers_it(at_zero: Zero) -> None:
    started = time.monotonic()
    answer = post(at_zero.url + "/v1/chat/completions", CHAT)
    took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "awake"
    assert took >= COLD_START_S, took
    assert len(at_zero.proxy.wakes) == 1
    assert at_zero.replica.chats == 1
    assert metric(at_zero.metrics_url, "llm_gateway_wakes_total", model=MODEL) >= 1
    assert metric(at_zero.metrics_url, "llm_gateway_held_requests", model=MODEL) == 0
    # Awake: the next request goes straight through, with no wake.
    started = time.monotonic()
    assert post(at_zero.url + "/v1/chat/completions", CHAT).status_code == 200
    assert time.monotonic() - started < COLD_START_S
    assert len(at_zero.proxy.wakes) == 1


def test_requests_at_zero_share_one_wake_and_past_the_bound_get_503_at_once(at_zero: Zero) -> None:
    """max_held 3: three are held and answered after the one wake; the rest are refused without waiting."""
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        timed = list(pool.map(lambda _: _timed_post(at_zero.url + "/v1/chat/completions"), range(5)))
    held = [(a, t) for a, t in timed if a.status_code == 200]
    refused = [(a, t) for a, t in timed if a.status_code == 503]
    assert (len(held), len(refused)) == (3, 2), [a.status_code for a, _ in timed]
    assert len(at_zero.proxy.wakes) == 1
    for answer, took in refused:
        assert took < COLD_START_S, took
        assert error_of(answer)["code"] == "model_starting"
        assert "too many requests are waiting" in error_of(answer)["message"]
        assert MIN_RETRY_AFTER_S <= int(answer.headers["Retry-After"]) <= 30


def test_a_model_that_does_not_wake_in_time_is_503_with_retry_after_the_rest_of_its_cold_start(
    at_zero: Zero,
) -> None:
    # Its own gateway and proxy: the wake it starts outlives the test, as a real one outlives the request.
    slow = ServeProxy(at_zero.loop, at_zero.router_url, at_zero.replica, delay_s=20.0)  # past hold_s (6)
    with gateway_at(at_zero.tmp, at_zero.router_url, slow) as (url, _):
        started = time.monotonic()
        answer = post(url + "/v1/chat/completions", CHAT)
        took = time.monotonic() - started
    assert len(slow.wakes) == 1
    assert answer.status_code == 503
    assert 6 <= took < 10, took
    error = error_of(answer)
    assert error["code"] == "model_starting"
    assert f"`{MODEL}`" in error["message"] and "within 6s" in error["message"]
    # cold_start_s 30, held 6: come back in about 24 s.
    assert 22 <= int(answer.headers["Retry-After"]) <= 24, answer.headers["Retry-After"]
    assert at_zero.replica.chats == 0


def test_without_a_key_nothing_is_held_and_nothing_woken(at_zero: Zero) -> None:
    answer = post(at_zero.url + "/v1/chat/completions", CHAT, headers={})
    assert answer.status_code == 401
    assert at_zero.proxy.wakes == []


def _timed_post(url: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = httpx.post(url, json=CHAT, headers=AUTH, timeout=30)
    return answer, time.monotonic() - started


def test_a_replicas_own_503_is_passed_on_as_it_is_and_wakes_nothing(at_zero: Zero) -> None:
    """Only the router's "no worker" means zero replicas; a replica's 503 (draining, full) is its answer."""
    body = b'{"error": {"message": "draining", "type": "unavailable", "param": null, "code": "draining"}}'

    async def busy(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=503, body=body, content_type="application/json", headers={"Retry-After": "3"})

    runner, port = at_zero.loop.run(at_zero.loop.serve(busy))
    proxy = ServeProxy(at_zero.loop, at_zero.router_url, at_zero.replica)
    try:
        with gateway_at(at_zero.tmp, f"http://{HOST}:{port}", proxy) as (url, _):
            answer = post(url + "/v1/chat/completions", CHAT)
    finally:
        at_zero.loop.run(runner.cleanup())
    assert answer.status_code == 503
    assert answer.content == body
    assert answer.headers["Retry-After"] == "3"
    assert proxy.wakes == []
