"""The model gateway (workloads/inference_server/gateway.py), run as the serving image runs it.

The real gateway process sits in front of two stand-in routers on loopback
(aiohttp servers in a thread of this process) that record every request they
get and stream their answers in chunks, the second held back until the test
releases it; a third route points at a port nobody listens on.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from localserve.processes import free_port
from tests.gateway_process import AUTH, KEY, MAX_BODY, GatewayProcess, Loop, error_of, gateway_settings, metric, post
from workloads.inference_server.catalog import RequestLimits
from workloads.inference_server.gateway import SETTINGS_ENV
from workloads.inference_server.guard import ApiGuard, ApiKeys

# How long a stand-in holds its second chunk at most, and how long the test waits for the first.
HOLD_S = 5.0
FIRST_CHUNK_S = 2.0


@dataclass
class Seen:
    """One request as a stand-in router got it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


class Upstream:
    """A stand-in model router: lists its models, streams SSE, notes every request."""

    def __init__(self, name: str, models: list[str]) -> None:
        self.name = name
        self.models = models
        self.seen: list[Seen] = []
        self.models_status = 200
        self.release = threading.Event()
        self.release.set()
        self.loop = Loop()
        self.runner, self.port = self.loop.run(self.loop.serve(self._handle))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path, request.query_string, dict(request.headers), body))
        if request.path == "/v1/models":
            cards = [{"id": m, "object": "model", "owned_by": self.name} for m in self.models]
            return web.json_response({"object": "list", "data": cards}, status=self.models_status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": f"req-{self.name}"})
        await response.prepare(request)
        await response.write(f'data: {{"from": "{self.name}", "n": 0}}\n\n'.encode())
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, HOLD_S)
        for n in (1, 2):
            await asyncio.sleep(0.02)
            await response.write(f'data: {{"from": "{self.name}", "n": {n}}}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def reset(self) -> None:
        self.seen.clear()
        self.models_status = 200
        self.release.set()

    def stop(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.stop()


@dataclass
class Stack:
    """The module's gateway, its stand-in routers and its addresses."""

    url: str
    metrics_url: str
    alpha: Upstream
    beta: Upstream
    settings: dict[str, Any]

    def untouched(self) -> bool:
        return not self.alpha.seen and not self.beta.seen


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    alpha = Upstream("alpha", ["alpha", "shared"])
    beta = Upstream("beta", ["beta", "shared"])
    routes = {"alpha": alpha.base_url, "beta": beta.base_url, "ghost": f"http://127.0.0.1:{free_port()}"}
    settings = gateway_settings(tmp_path_factory.mktemp("gateway"), routes, metrics_port=free_port())
    gateway = GatewayProcess(settings)
    try:
        gateway.wait_listening()
        yield Stack(
            f"http://127.0.0.1:{settings['port']}",
            f"http://127.0.0.1:{settings['metrics_port']}/metrics",
            alpha,
            beta,
            settings,
        )
    finally:
        gateway.stop()
        alpha.stop()
        beta.stop()


@pytest.fixture
def gw(stack: Stack) -> Iterator[Stack]:
    stack.alpha.reset()
    stack.beta.reset()
    yield stack
    stack.alpha.reset()
    stack.beta.reset()


def guard_401() -> tuple[bytes, str]:
    """The body and WWW-Authenticate header the guard itself answers a request without a key with."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the guard let a request without a key through")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = ApiGuard(app, keys=ApiKeys(None, "K", environ={"K": "other"}), limits=RequestLimits())
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "root_path": ""}
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == 401
    return sent[1]["body"], dict(sent[0]["headers"])[b"www-authenticate"].decode()


# ---------------------------------------------------------------- routing and streaming


def test_routes_by_model_with_the_body_and_end_to_end_headers(gw: Stack) -> None:
    bodies = {
        "alpha": b'{"model":  "alpha", "prompt": "hi",\n "stream": true}',
        "beta": b'{"messages": [{"role": "user", "content": "h\\u00e9"}], "model": "beta", "stream": true}',
    }
    paths = {"alpha": "/v1/completions", "beta": "/v1/chat/completions"}
    for model, raw in bodies.items():
        headers = {
            **AUTH,
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Session-ID": f"session-{model}",
            "X-Request-Id": f"client-{model}",
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic c2VjcmV0",
            "TE": "trailers",
        }
        response = httpx.post(f"{gw.url}{paths[model]}?trace=1", content=raw, headers=headers, timeout=10)
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["x-request-id"] == f"req-{model}"
        assert f'"from": "{model}"' in response.text and response.text.endswith("data: [DONE]\n\n")

    for model, upstream in (("alpha", gw.alpha), ("beta", gw.beta)):
        [seen] = upstream.seen
        assert (seen.method, seen.path, seen.query) == ("POST", paths[model], "trace=1")
        assert seen.body == bodies[model]
        lowered = {k.lower(): v for k, v in seen.headers.items()}
        assert lowered["authorization"] == AUTH["Authorization"]
        assert lowered["x-session-id"] == f"session-{model}"
        assert lowered["x-request-id"] == f"client-{model}"
        assert lowered["content-type"] == "application/json"
        assert lowered["accept"] == "text/event-stream"
        assert lowered["host"] == f"127.0.0.1:{upstream.port}"
        for hop in ("x-drop-me", "keep-alive", "proxy-authorization", "te", "transfer-encoding"):
            assert hop not in lowered
        assert lowered.get("connection", "keep-alive").lower() == "keep-alive"


def test_the_first_chunk_arrives_while_the_upstream_holds_the_rest(gw: Stack) -> None:
    gw.alpha.release.clear()
    timeout = httpx.Timeout(10, read=FIRST_CHUNK_S)
    body = json.dumps({"model": "alpha", "prompt": "hi", "stream": True}).encode()
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", f"{gw.url}/v1/completions", content=body, headers=AUTH) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw()
        first = next(chunks)
        assert not gw.alpha.release.is_set()
        assert b'"n": 0' in first and b'"n": 1' not in first
        gw.alpha.release.set()
        rest = b"".join(chunks)
    assert b'"n": 2' in rest and rest.endswith(b"data: [DONE]\n\n")


# ---------------------------------------------------------------- refusals


def test_a_request_without_a_valid_key_gets_the_guards_401(gw: Stack) -> None:
    body, challenge = guard_401()
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        for model in ("alpha", "no-such-model"):
            response = post(f"{gw.url}/v1/completions", {"model": model, "prompt": "x"}, headers)
            assert response.status_code == 401
            assert response.content == body
            assert response.headers["www-authenticate"] == challenge
        assert httpx.get(f"{gw.url}/v1/models", headers=headers).status_code == 401
    assert gw.untouched()


def test_an_unknown_model_is_404_model_not_found(gw: Stack) -> None:
    response = post(f"{gw.url}/v1/chat/completions", {"model": "gpt-5", "messages": []})
    assert response.status_code == 404
    error = error_of(response)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-5" in error["message"] and "does not exist" in error["message"]
    assert gw.untouched()


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "alpha",', None),
        (b"[1, 2]", None),
        (b'"alpha"', None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": 7, "prompt": "x"}', "model"),
        (b'{"model": ["alpha"], "prompt": "x"}', "model"),
    ],
)
def test_a_body_that_names_no_model_is_400(gw: Stack, raw: bytes, param: str | None) -> None:
    response = post(f"{gw.url}/v1/completions", raw)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert gw.untouched()


def test_a_body_over_the_cap_is_413(gw: Stack) -> None:
    raw = json.dumps({"model": "alpha", "prompt": "x" * MAX_BODY}).encode()
    declared = post(f"{gw.url}/v1/completions", raw)

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(raw), 1000):
            yield raw[start : start + 1000]

    chunked = httpx.post(f"{gw.url}/v1/completions", content=pieces(), headers=AUTH, timeout=10)
    for response in (declared, chunked):
        assert response.status_code == 413
        assert error_of(response)["code"] == "request_too_large"
    assert "content-length" not in chunked.request.headers
    assert gw.untouched()
    # Just under the cap still passes.
    fits = json.dumps({"model": "alpha", "prompt": "x" * (MAX_BODY - 100)}).encode()
    assert post(f"{gw.url}/v1/completions", fits).status_code == 200


def test_other_methods_are_405_and_other_paths_404_never_forwarded(gw: Stack) -> None:
    response = httpx.get(f"{gw.url}/v1/completions", headers=AUTH)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert error_of(response)["code"] == "method_not_allowed"
    for method, path in (("POST", "/add_worker"), ("GET", "/workers"), ("POST", "/flush_cache"), ("GET", "/metrics")):
        response = httpx.request(method, f"{gw.url}{path}?url=http://127.0.0.1:9", headers=AUTH, content=b"{}")
        assert response.status_code == 404
        assert error_of(response)["message"] == f"Invalid URL ({method} {path})"
    assert gw.untouched()


def test_health_needs_no_key(gw: Stack) -> None:
    response = httpx.get(f"{gw.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


# ---------------------------------------------------------------- models and failures


def test_models_merges_every_router_list(gw: Stack) -> None:
    response = httpx.get(f"{gw.url}/v1/models", headers=AUTH)
    assert response.status_code == 200
    payload = response.json()
    assert payload["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in payload["data"]] == [
        ("alpha", "alpha"),
        ("shared", "alpha"),
        ("beta", "beta"),
    ]
    for upstream in (gw.alpha, gw.beta):
        [seen] = upstream.seen
        assert (seen.method, seen.path) == ("GET", "/v1/models")
        assert seen.headers["Authorization"] == AUTH["Authorization"]


def test_models_leaves_out_a_failing_router_and_is_503_when_none_answers(gw: Stack) -> None:
    gw.alpha.models_status = 500
    response = httpx.get(f"{gw.url}/v1/models", headers=AUTH)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["beta", "shared"]
    gw.beta.models_status = 503
    response = httpx.get(f"{gw.url}/v1/models", headers=AUTH)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert error_of(response)["code"] == "model_unavailable"


def test_an_unreachable_router_is_503_model_unavailable(gw: Stack) -> None:
    response = post(f"{gw.url}/v1/completions", {"model": "ghost", "prompt": "x"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = error_of(response)
    assert error["code"] == "model_unavailable" and "ghost" in error["message"]


def test_metrics_count_requests_per_model_and_code(gw: Stack) -> None:
    requests = "llm_gateway_requests_total"
    before = {
        "alpha": metric(gw.metrics_url, requests, model="alpha", code="200"),
        "beta": metric(gw.metrics_url, requests, model="beta", code="200"),
        "unknown": metric(gw.metrics_url, requests, model="", code="404"),
        "ghost": metric(gw.metrics_url, requests, model="ghost", code="503"),
        "failures": metric(gw.metrics_url, "llm_gateway_upstream_failures_total", model="ghost"),
    }
    for _ in range(2):
        assert post(f"{gw.url}/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200
    assert post(f"{gw.url}/v1/completions", {"model": "beta", "prompt": "x"}).status_code == 200
    assert post(f"{gw.url}/v1/completions", {"model": "user-chosen-label", "prompt": "x"}).status_code == 404
    assert post(f"{gw.url}/v1/completions", {"model": "ghost", "prompt": "x"}).status_code == 503
    assert metric(gw.metrics_url, requests, model="alpha", code="200") == before["alpha"] + 2
    assert metric(gw.metrics_url, requests, model="beta", code="200") == before["beta"] + 1
    assert metric(gw.metrics_url, requests, model="", code="404") == before["unknown"] + 1
    assert metric(gw.metrics_url, requests, model="ghost", code="503") == before["ghost"] + 1
    failures = metric(gw.metrics_url, "llm_gateway_upstream_failures_total", model="ghost")
    assert failures == before["failures"] + 1
    assert "user-chosen-label" not in httpx.get(gw.metrics_url).text


def test_the_gateways_alerts_read_names_and_labels_it_exports(gw: Stack) -> None:
    """LlmGatewayUpstreamFailing and LlmModelWakeStalled group by `model` and pick `code` 200: the exposition
    has them (the held-requests gauge, which only a wake sets, is read in tests/test_gateway_wake.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    from infra.serving import alerts

    (family,) = [f for f in alerts.METRIC_INVENTORY if f.prefix == "llm_gateway_"]
    assert set(family.names) == {
        "llm_gateway_requests_total",
        "llm_gateway_upstream_failures_total",
        "llm_gateway_held_requests",
    }
    assert post(f"{gw.url}/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200
    assert post(f"{gw.url}/v1/completions", {"model": "ghost", "prompt": "x"}).status_code == 503
    text = httpx.get(gw.metrics_url).text
    labels = {s.name: set(s.labels) for f in text_string_to_metric_families(text) for s in f.samples}
    assert labels["llm_gateway_requests_total"] == {"model", "code"}
    assert labels["llm_gateway_upstream_failures_total"] == {"model"}
    assert metric(gw.metrics_url, "llm_gateway_requests_total", model="alpha", code="200") >= 1


# ---------------------------------------------------------------- stopping and settings


def test_sigterm_drains_and_finishes_the_stream_in_flight(tmp_path: Path) -> None:
    upstream = Upstream("alpha", ["alpha"])
    settings = gateway_settings(tmp_path, {"alpha": upstream.base_url}, drain_s=1.0)
    gateway = GatewayProcess(settings)
    url = f"http://127.0.0.1:{settings['port']}"
    try:
        gateway.wait_listening()
        upstream.release.clear()
        body = json.dumps({"model": "alpha", "prompt": "hi", "stream": True}).encode()
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=HOLD_S)) as client,
            client.stream("POST", f"{url}/v1/completions", content=body, headers=AUTH) as response,
        ):
            chunks = response.iter_raw()
            assert b'"n": 0' in next(chunks)
            gateway.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 0.8
            health = 200
            while health == 200 and time.monotonic() < deadline:
                health = httpx.get(f"{url}/health").status_code
            assert health == 503
            # Still served while the load balancer takes the pod out.
            assert post(f"{url}/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200
            assert gateway.proc.poll() is None
            upstream.release.set()
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert gateway.proc.wait(10) == 0
        assert not any("Traceback" in line for line in gateway.lines)
    finally:
        gateway.stop()
        upstream.stop()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (None, SETTINGS_ENV),
        ({"routes": {}}, "routes"),
        ({"routes": {"alpha": "ftp://127.0.0.1:1"}}, "routes"),
        ({"routes": {"alpha": "http://127.0.0.1:1/v1"}}, "routes"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"port": 70000}, "port"),
        ({"api_keys": ["sk-inline"]}, "api_keys"),
    ],
)
def test_bad_settings_stop_with_one_line_naming_the_setting(
    tmp_path: Path, change: dict[str, Any] | None, named: str
) -> None:
    settings = None if change is None else {**gateway_settings(tmp_path, {"a": "http://127.0.0.1:1"}), **change}
    gateway = GatewayProcess(settings)
    assert gateway.proc.wait(15) != 0
    gateway.reader.join(5)
    assert len(gateway.lines) == 1, gateway.lines
    assert named in gateway.lines[0]
    assert "Traceback" not in gateway.lines[0]


def test_a_body_sent_too_slowly_is_408_and_never_forwarded(tmp_path: Path) -> None:
    """A client that stops sending its body is let go after body_timeout_s, not held until it gives up."""
    import socket

    upstream = Upstream("alpha", ["alpha"])
    settings = gateway_settings(tmp_path, {"alpha": upstream.base_url}, body_timeout_s=1)
    gateway = GatewayProcess(settings)
    try:
        gateway.wait_listening()
        with socket.create_connection(("127.0.0.1", settings["port"]), timeout=10) as sock:
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n"
            )
            sock.sendall(head.encode() + b'{"model": "alpha", ')
            started = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            took = time.monotonic() - started
    finally:
        gateway.stop()
        upstream.stop()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer
    assert b'"code": "request_timeout"' in rest or b'"code":"request_timeout"' in rest, rest
    assert 0.9 <= took < 5, took
    assert upstream.seen == []
