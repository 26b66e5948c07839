"""The router's front (infra/serving/router_front.py): the load balancer reaches the API's routes and nothing else.

The pinned vllm-router serves keyless control routes on its API port. These
tests run that release, with the command the render gives prod, behind
Debian's nginx with the config the render mounts (loopback addresses and a
scratch directory swapped in), in front of loopback stand-in replicas that
record what reaches them.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from typing_extensions import override

from infra.config import load_stack_file
from infra.config.routing import ROUTING_KEY_HEADER
from infra.mocks import fake_digest
from infra.serving import router_front
from infra.serving.router import FRONT_CONFIG_DIGEST, router_name
from infra.serving.router_front import (
    LIVENESS_PATH,
    READINESS_PATH,
    ROUTER_BODY_GROWTH,
    ROUTES,
    FrontPlan,
    config_digest,
)
from localserve.processes import free_port, with_descendants
from tests.e2e.loopback_http import CHUNK_S, CHUNKS, LoopbackHttp, SlowReplica, answer
from tests.harness import manifests_of, render_routed, stack_config
from twin.routing import (
    RouterSpec,
    TwinRouter,
    nginx_binary,
    remove_worker_status,
    router_specs,
    start_front,
    start_router,
)
from workloads.inference_server.guard import LIMITED_PATHS, SERVER_ERROR, body_cap, server_message, too_large
from workloads.inference_server.vllm_guard import SERVED_PATHS

ROOT = Path(__file__).resolve().parents[1]
KEY = "Bearer sk-test-caller"
# vllm-router's routes that are not the API's (server.rs of the pinned
# release: admin_routes, worker_routes, and the protected and public routes
# the replicas' guard does not serve), with the method each takes.
CONTROL_ROUTES = [
    ("POST", "/add_worker?url=http://127.0.0.1:9"),
    ("POST", "/remove_worker?url=http://127.0.0.1:9"),
    ("GET", "/list_workers"),
    ("POST", "/flush_cache"),
    ("GET", "/get_loads"),
    ("GET", "/scheduling/diagnostics"),
    ("POST", "/finish_session"),
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("GET", "/workers/http%3A%2F%2F127.0.0.1%3A9"),
    ("DELETE", "/workers/http%3A%2F%2F127.0.0.1%3A9"),
    ("POST", "/generate"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/rerank"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
]


@dataclass
class Seen:
    """What reached one stand-in replica."""

    requests: list[dict[str, Any]] = field(default_factory=list)

    def api(self) -> list[dict[str, Any]]:
        """The requests other than the router's health checks."""
        return [r for r in self.requests if r["path"] != "/health"]


def recording_replica(seen: Seen) -> type[BaseHTTPRequestHandler]:
    """A replica's server as the router sees it: healthy, listing a model, streaming, noting each request."""

    class Replica(SlowReplica):
        def _note(self, body: bytes = b"") -> None:
            seen.requests.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "authorization": self.headers.get("authorization"),
                    "key": self.headers.get(ROUTING_KEY_HEADER),
                    "bytes": len(body),
                }
            )

        def _json(self, obj: Any) -> None:
            answer(self, 200, json.dumps(obj).encode())

        @override
        def do_GET(self) -> None:
            self._note()
            if self.path.startswith("/v1/models"):
                self._json({"object": "list", "data": [{"id": "m", "object": "model"}]})
            else:
                super().do_GET()

        @override
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            self._note(body)
            if json.loads(body or b"{}").get("stream"):
                self.stream()
            else:
                self._json({"choices": [{"index": 0, "text": "ok"}]})

    return Replica


def prod_router() -> RouterSpec:
    return next(iter(router_specs(ROOT / "Pulumi.prod.yaml").values()))


@contextmanager
def prod_router_before(
    handler: type[BaseHTTPRequestHandler], tmp_path: Path
) -> Iterator[tuple[TwinRouter, LoopbackHttp]]:
    """Prod's rendered router and its front, in front of one loopback replica served by ``handler``."""
    replica = LoopbackHttp(handler)
    spec = prod_router()
    try:
        router, _ = start_router(spec.command, [replica.base_url], tmp_path / "router.log", spec.front, env=spec.env)
        try:
            yield router, replica
        finally:
            router.stop()
    finally:
        replica.stop()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[TwinRouter, Seen, LoopbackHttp]]:
    seen = Seen()
    with prod_router_before(recording_replica(seen), tmp_path) as (router, replica):
        yield router, seen, replica


def test_without_its_front_the_pinned_routers_control_routes_hand_the_traffic_to_anyone(
    routed: tuple[TwinRouter, Seen, LoopbackHttp],
) -> None:
    # Why the front exists: a keyless POST on the router's own port adds a
    # server of the caller's, takes the real replica out, and from then on
    # every prompt reaches that server, with its caller's API key.
    router, seen, replica = routed
    stolen = Seen()
    thief = LoopbackHttp(recording_replica(stolen))
    direct = f"http://127.0.0.1:{router.router_port}"
    try:
        added = httpx.post(f"{direct}/add_worker", params={"url": thief.base_url}, timeout=60)
        assert added.status_code == 200, added.text
        assert remove_worker_status(router.router_port, replica.base_url) == 200
        answer = httpx.post(
            f"{direct}/v1/completions", json={"model": "m", "prompt": "secret"}, headers={"authorization": KEY}
        )
        assert answer.status_code == 200
    finally:
        thief.stop()
    assert [r["authorization"] for r in stolen.api()] == [KEY]
    assert seen.api() == []


@pytest.mark.parametrize(("method", "path"), CONTROL_ROUTES)
def test_through_its_front_every_other_route_of_the_router_is_not_found(
    routed: tuple[TwinRouter, Seen, LoopbackHttp], method: str, path: str
) -> None:
    router, seen, _ = routed
    front = f"http://127.0.0.1:{router.port}"
    answer = httpx.request(method, front + path, json={"model": "m", "prompt": "x"}, timeout=30)
    assert answer.status_code == 404, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["type"] == "not_found_error"
    # The replica is still in rotation and was not reached.
    assert seen.api() == []
    done = httpx.post(front + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
    assert done.status_code == 200
    assert [r["path"] for r in seen.api()] == ["/v1/completions"]


def test_the_api_streams_through_the_front_with_the_callers_headers(
    routed: tuple[TwinRouter, Seen, LoopbackHttp],
) -> None:
    router, seen, _ = routed
    started = time.monotonic()
    arrivals: list[float] = []
    body = {"model": "m", "prompt": "hello", "stream": True}
    headers = {"authorization": KEY, ROUTING_KEY_HEADER: "template-7"}
    with httpx.stream("POST", router.base_url + "/completions", json=body, headers=headers, timeout=30) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - started)
    assert len(arrivals) == CHUNKS + 1
    # Each token as it comes: the first long before the last (nginx buffers by default).
    assert arrivals[0] < arrivals[-1] - (CHUNKS - 5) * CHUNK_S
    chat = httpx.post(
        router.base_url + "/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
        timeout=30,
    )
    assert chat.status_code == 200
    models = httpx.get(router.base_url + "/models", headers=headers, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
    reached = seen.api()
    assert [r["path"] for r in reached] == ["/v1/completions", "/v1/chat/completions", "/v1/models"]
    assert {r["authorization"] for r in reached} == {KEY}
    assert [r["key"] for r in reached[:2]] == ["template-7", "template-7"]


def test_a_route_with_the_wrong_method_gets_405_in_the_openai_shape(
    routed: tuple[TwinRouter, Seen, LoopbackHttp],
) -> None:
    router, seen, _ = routed
    answer = httpx.get(router.base_url + "/completions", timeout=30)
    assert answer.status_code == 405
    assert answer.json()["error"]["code"] == "method_not_allowed"
    assert httpx.post(router.base_url + "/models", timeout=30).status_code == 405
    assert seen.api() == []


def test_a_body_the_replicas_guard_would_refuse_is_refused_at_the_front(
    routed: tuple[TwinRouter, Seen, LoopbackHttp],
) -> None:
    router, seen, _ = routed
    guards = body_cap(load_stack_file(ROOT / "Pulumi.prod.yaml").serving.limits)
    cap = prod_router().front.max_body_bytes
    assert cap == guards - ROUTER_BODY_GROWTH

    def sized(n: int) -> bytes:
        head = b'{"model": "m", "prompt": "'
        tail = b'"}'
        return head + b"a" * (n - len(head) - len(tail)) + tail

    url = router.base_url + "/completions"
    over = httpx.post(url, content=sized(cap + 1), headers={"content-type": "application/json"}, timeout=30)
    assert over.status_code == 413
    # The guard's own answer, word for word, with the front's cap in it.
    assert over.json()["error"] == json.loads(too_large(cap).body())["error"]
    assert seen.api() == []
    at = httpx.post(url, content=sized(cap), headers={"content-type": "application/json"}, timeout=30)
    assert at.status_code == 200
    # The router writes the body out again with its own defaults added: larger, and still
    # within what the replicas' guard accepts.
    (passed,) = seen.api()
    assert cap < passed["bytes"] <= guards


# Bodies as callers send them, compact (the router's own writing is): the router's
# defaults are added once a body, whatever it holds.
GROWN_BODIES = {
    "a completion": ("/completions", {"model": "m", "prompt": "hi"}),
    "a completion of token ids": ("/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}),
    "a chat": ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "a long chat": ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 200}),
    "a chat of parts": (
        "/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 200}]},
    ),
    "a chat with tools and their calls": (
        "/chat/completions",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {
                    "role": "assistant",
                    "content": "b",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 50,
                },
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(50)],
            "stop": ["x"] * 50,
            "temperature": 0.5,
        },
    ),
}


def test_the_router_grows_a_body_by_its_defaults_alone_within_the_fronts_allowance(
    routed: tuple[TwinRouter, Seen, LoopbackHttp],
) -> None:
    router, seen, _ = routed
    grown = {}
    for name, (path, body) in GROWN_BODIES.items():
        sent = json.dumps(body, separators=(",", ":")).encode()
        answer = httpx.post(router.base_url + path, content=sent, headers={"content-type": "application/json"})
        assert answer.status_code == 200, (name, answer.text)
        grown[name] = seen.api()[-1]["bytes"] - len(sent)
    print(f"\n[router-front] bytes the router added: {grown}")
    # The same defaults on every body of a route, however many messages, parts, tools or stops it holds.
    assert len({grown[name] for name, (path, _) in GROWN_BODIES.items() if path == "/completions"}) == 1
    assert len({grown[name] for name, (path, _) in GROWN_BODIES.items() if path == "/chat/completions"}) == 1
    assert 0 < max(grown.values()) <= ROUTER_BODY_GROWTH / 2


def test_the_front_passes_only_what_the_replicas_serve_and_the_routers_probes() -> None:
    generation = {path for path, method in ROUTES.items() if method == "POST"}
    assert generation == LIMITED_PATHS
    assert set(ROUTES) <= SERVED_PATHS | {LIVENESS_PATH, READINESS_PATH}


def test_the_pod_mounts_the_config_the_tests_run_and_rolls_when_it_changes(tmp_path: Path) -> None:
    cfg = stack_config("prod")
    rendered = render_routed("prod")
    maps = {m["metadata"]["name"]: m for m in manifests_of(rendered, "ConfigMap")}
    deployments = {d["metadata"]["name"]: d for d in manifests_of(rendered, "Deployment")}
    services = [rs["metadata"]["name"] for rs in manifests_of(rendered, "RayService")]
    assert services
    for service in services:
        dep = deployments[router_name(service)]
        template = dep["spec"]["template"]
        front = next(c for c in template["spec"]["containers"] if c["name"] == "front")
        # The stack's own copy, by digest (tests/test_supply_chain.py holds where it comes from).
        assert front["image"].endswith(f"/llm-serving-router-front@{fake_digest('router-front-image')}")
        mounts = {m["name"]: m for m in front["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        config_map = volumes[mounts["front-config"]["name"]]["configMap"]["name"]
        text = maps[config_map]["data"][router_front.CONFIG_FILE]
        assert text == FrontPlan.of(cfg.serving.limits, _timeout(dep)).config()
        assert template["metadata"]["annotations"][FRONT_CONFIG_DIGEST] == config_digest(text)
        assert f"{mounts['front-config']['mountPath']}/{router_front.CONFIG_FILE}" in front["command"]
        # nginx reads it as written (the pod's ports and paths), scratch aside.
        conf = tmp_path / f"{service}.conf"
        conf.write_text(text)
        check = subprocess.run(
            [nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert check.returncode == 0, check.stderr


def _timeout(deployment: dict[str, Any]) -> int:
    router = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "router")
    command = router["command"]
    return int(command[command.index("--request-timeout-secs") + 1])


def _worker_processes(master_pid: int) -> set[int]:
    """The processes below the nginx master (its workers)."""
    return with_descendants({master_pid}) - {master_pid}


def test_the_front_runs_one_worker_per_core_of_its_limit_as_the_pod_renders_it(tmp_path: Path) -> None:
    rendered = render_routed("prod")
    for dep in manifests_of(rendered, "Deployment"):
        if not dep["metadata"]["name"].endswith("-router"):
            continue
        front = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "front")
        limit = front["resources"]["limits"]["cpu"]
        assert router_front.worker_processes(limit) == router_front.WORKERS == 1, limit
    assert [router_front.worker_processes(q) for q in ("100m", "500m", "1", "1500m", "2")] == [1, 1, 1, 2, 2]
    # nginx started from the rendered config runs exactly that many workers, and as many as it is told.
    spec = prod_router()
    assert spec.front.workers == router_front.WORKERS
    for workers in (spec.front.workers, 3):
        child, _, scratch = start_front(replace(spec.front, workers=workers), free_port(), tmp_path / f"{workers}.log")
        try:
            deadline = time.monotonic() + 10
            while len(_worker_processes(child.proc.pid)) != workers and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(_worker_processes(child.proc.pid)) == workers, child.log_tail()
        finally:
            child.stop()
            scratch.cleanup()


def _server_error(answer: httpx.Response, status: int) -> None:
    """``answer`` is ``status`` in the OpenAI shape, with the guard's fixed message for it."""
    assert answer.status_code == status, answer.text[:300]
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json() == {
        "error": {"message": server_message(status), "type": SERVER_ERROR, "param": None, "code": None}
    }


def test_when_no_replica_answers_the_routers_own_500_leaves_without_the_replicas_address(tmp_path: Path) -> None:
    import socket

    class Dropping(SlowReplica):
        """Reads the request, then is gone without a word: a pod killed mid-request."""

        @override
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    body = {"model": "m", "prompt": "x", "max_tokens": 4}
    with prod_router_before(Dropping, tmp_path) as (router, replica):
        address = replica.base_url.removeprefix("http://")
        # The router's own answer, asked behind the front: it names the replica it could not reach.
        direct = httpx.post(f"http://127.0.0.1:{router.router_port}/v1/completions", json=body, timeout=60)
        assert direct.status_code == 500 and address in direct.text
        through = httpx.post(router.base_url + "/completions", json=body, timeout=60)
    _server_error(through, 500)
    assert address not in through.text


def test_what_the_replicas_answer_passes_the_front_as_it_is(tmp_path: Path) -> None:
    # The replicas' guard answers in the OpenAI shape already: a key over its cap (429), a model
    # waking (503 with Retry-After) and a bad request (400) reach the caller unchanged.
    answers = {
        429: (b'{"error": {"message": "key over its cap", "type": "rate_limit_exceeded"}}', {}),
        503: (b'{"error": {"message": "waking", "type": "server_error"}}', {"retry-after": "7"}),
        400: (b'{"error": {"message": "bad temperature", "type": "invalid_request_error"}}', {}),
        # The guard's own body cap, which the front holds too: answered with the front's 413.
        413: (b'{"error": {"message": "too large", "type": "invalid_request_error"}}', {}),
    }

    class Answering(SlowReplica):
        @override
        def do_POST(self) -> None:
            asked = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            body, headers = answers[int(asked["prompt"])]
            self.send_response(int(asked["prompt"]))
            for name, value in {**headers, "content-type": "application/json"}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with prod_router_before(Answering, tmp_path) as (router, _):
        got = {
            status: httpx.post(router.base_url + "/completions", json={"model": "m", "prompt": str(status)}, timeout=60)
            for status in answers
        }
    for status, (body, headers) in answers.items():
        if status == 413:
            assert got[status].status_code == 413 and got[status].json()["error"]["code"] == "request_too_large"
            continue
        assert got[status].status_code == status and got[status].content == body
        assert all(got[status].headers.get(name) == value for name, value in headers.items())


def _asked_through_front(plan: FrontPlan, router_port: int, log: Path) -> httpx.Response:
    """One completion request through a front started for it in front of ``router_port``."""
    front, port, scratch = start_front(plan, router_port, log)
    try:
        _wait_listening(port)
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
    finally:
        front.stop(grace_s=5)
        scratch.cleanup()


def test_nginxs_own_502_and_504_leave_in_the_openai_shape(tmp_path: Path) -> None:
    import socket
    import threading

    # 502: no router behind the front (its port closed).
    _server_error(_asked_through_front(prod_router().front, free_port(), tmp_path / "front.log"), 502)

    # 504: a router that takes the request and never answers, past the front's timeout (1 s here).
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    quick = replace(prod_router().front, request_timeout_s=1)
    try:
        late = _asked_through_front(quick, silent.getsockname()[1], tmp_path / "front-timeout.log")
    finally:
        silent.close()
        for conn in held:
            conn.close()
    _server_error(late, 504)


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")
