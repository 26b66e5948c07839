"""The local run's front door (twin/front_door.py) against fake guarded servers: routing by model, streams, errors.

Also which replicas the local run gives it (twin/local_run.py).

Each fake server plays one replica's vLLM server behind its guard: it wants
the key, serves one model, and answers 404 for any other, so a request the
door sends to the wrong replica fails.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from tests.e2e.loopback_http import answer
from twin.deploy import ModelInfo
from twin.front_door import FrontDoor, Target
from twin.local_run import ready_servers

KEY = "twin-test-key"
STREAM_CHUNKS = 3


def fake_replica(name: str, model: str) -> tuple[ThreadingHTTPServer, Target]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _json(self, status: int, body: dict[str, object]) -> None:
            answer(self, status, json.dumps(body).encode())

        def _keyed(self) -> bool:
            if self.headers.get("authorization") == f"Bearer {KEY}":
                return True
            self._json(401, {"error": {"message": "no valid API key", "code": "invalid_api_key"}})
            return False

        def do_GET(self) -> None:
            if self._keyed():
                self._json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if not self._keyed():
                return
            if body.get("model") != model:
                self._json(404, {"error": {"message": f"The model {body.get('model')} does not exist"}})
                return
            if not body.get("stream"):
                self._json(200, {"served_by": name, "model": model})
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(STREAM_CHUNKS):
                chunk = f"data: {i} from {name}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, (name, "127.0.0.1", int(server.server_address[1]))


@pytest.fixture
def replicas() -> Iterator[dict[str, Target]]:
    servers = {name: fake_replica(name, model) for name, model in (("a1", "A"), ("a2", "A"), ("b1", "B"))}
    yield {name: target for name, (_, target) in servers.items()}
    for server, _ in servers.values():
        server.shutdown()
        server.server_close()


@pytest.fixture
def door(replicas: dict[str, Target]) -> Iterator[FrontDoor]:
    front = FrontDoor(port=0)
    front.start()
    front.follow(lambda: {"A": [replicas["a1"], replicas["a2"]], "B": [replicas["b1"]]})
    yield front
    front.stop()


def client(door: FrontDoor, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=f"http://127.0.0.1:{door.port}/v1", headers=headers, timeout=10)


def test_each_request_reaches_a_replica_of_its_model_over_one_kept_alive_client(door: FrontDoor) -> None:
    with client(door) as http:
        answers = [http.post("/chat/completions", json={"model": m}) for m in ("A", "B", "A", "B", "A", "A")]
    assert [a.status_code for a in answers] == [200] * 6
    served = [(a.json()["model"], a.json()["served_by"]) for a in answers]
    assert {by for model, by in served if model == "B"} == {"b1"}
    # Round robin among the model's own replicas, whatever other models ask in between.
    assert [by for model, by in served if model == "A"] == ["a1", "a2", "a1", "a2"]
    assert all(a.headers["connection"] == "close" for a in answers)


def test_models_lists_every_model_of_the_stack_with_the_key_and_refuses_without(door: FrontDoor) -> None:
    with client(door) as http:
        listed = http.get("/models")
    assert listed.status_code == 200
    assert sorted(m["id"] for m in listed.json()["data"]) == ["A", "B"]
    with client(door, key=None) as http:
        refused = http.get("/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_the_guards_answer_what_the_door_can_not_route(door: FrontDoor) -> None:
    with client(door) as http:
        unknown = http.post("/chat/completions", json={"model": "C"})
    with client(door, key=None) as http:
        keyless = http.post("/chat/completions", json={"model": "A"})
    assert unknown.status_code == 404 and "C does not exist" in unknown.json()["error"]["message"]
    assert keyless.status_code == 401


def test_a_stream_passes_through_in_order(door: FrontDoor) -> None:
    with client(door) as http, http.stream("POST", "/chat/completions", json={"model": "B", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines == [f"data: {i} from b1" for i in range(STREAM_CHUNKS)]


def test_a_chunked_request_body_is_routed_by_its_model(door: FrontDoor) -> None:
    body = (part for part in (b'{"model":', b' "B"}'))
    with client(door) as http:
        answer = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 200 and answer.json()["served_by"] == "b1"


def answer_with_routes(routes: dict[str, list[Target]], model: str) -> httpx.Response:
    front = FrontDoor(port=0)
    front.start()
    front.set_routes(routes)
    try:
        with client(front) as http:
            return http.post("/chat/completions", json={"model": model})
    finally:
        front.stop()


def test_a_model_without_a_ready_replica_gets_503_in_the_openai_shape(replicas: dict[str, Target]) -> None:
    answer = answer_with_routes({"A": [], "B": [replicas["b1"]]}, "A")
    assert answer.status_code == 503
    assert answer.json()["error"] == {
        "message": "no replica of A is Ready",
        "type": "server_error",
        "param": None,
        "code": "unavailable",
    }


def test_a_replica_that_went_away_gets_502() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = ("gone", "127.0.0.1", int(sock.getsockname()[1]))
    answer = answer_with_routes({"A": [gone]}, "A")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "bad_gateway"


def test_routes_follow_the_source(replicas: dict[str, Target]) -> None:
    """As the NLB's health checks: a replica that stops answering /health leaves the targets, and comes back."""
    ready = [replicas["a1"], replicas["a2"]]
    front = FrontDoor(port=0)
    front.start()
    front.follow(lambda: {"A": list(ready)}, every_s=0.05)
    try:
        ready.remove(replicas["a1"])
        time.sleep(0.3)
        with client(front) as http:
            served = {http.post("/chat/completions", json={"model": "A"}).json()["served_by"] for _ in range(4)}
        assert served == {"a2"}
    finally:
        front.stop()


def test_the_door_refuses_a_taken_port_and_reads_back_the_port_it_got() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with pytest.raises(OSError):
            FrontDoor(port=port).start()
    front = FrontDoor(port=0)
    front.start()
    try:
        assert front.port > 0
        with client(front) as http:
            answer = http.get("/models")
    finally:
        front.stop()
    # Listening before any cluster runs: nothing to route to yet, said in the OpenAI shape.
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "no replica of the stack is Ready"


def test_the_local_run_routes_only_replicas_whose_server_answers_health(tmp_path: Path) -> None:
    """What the rendered readiness probe lets into the load balancer: a server that answers GET /health."""

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = int(sock.getsockname()[1])
    up = int(server.server_address[1])
    for name, model_id, port in (("up", "A", up), ("dead", "A", dead), ("other", "B", up)):
        record = {"model_id": model_id, "url": f"http://127.0.0.1:{port}/v1", "metrics_url": "", "node_id": "n"}
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    model = ModelInfo(app="a", model_id="A", min_replicas=2, accelerator_type=None, layout="vllm-server")
    try:
        assert ready_servers(replace(model, address_dir=tmp_path)) == [(f"A replica {up}", "127.0.0.1", up)]
        assert ready_servers(model) == []
    finally:
        server.shutdown()
        server.server_close()


def test_the_local_run_sends_a_woken_model_to_its_gateway_and_the_rest_to_replicas_or_the_proxy(
    tmp_path: Path,
) -> None:
    """A vllm-server model at zero has no replica to route to: the local run's front door sends it to the
    rendered gateway it runs (which holds the request while the model wakes), as the deployed stack does."""
    from types import SimpleNamespace

    from twin.local_run import LocalRun

    woken = ModelInfo(app="w", model_id="W", min_replicas=0, accelerator_type=None, layout="vllm-server")
    served = ModelInfo(app="s", model_id="S", min_replicas=1, accelerator_type=None, layout="vllm-server")
    ingress = ModelInfo(app="i", model_id="I", min_replicas=0, accelerator_type=None, layout="serve-ingress")
    run = LocalRun.__new__(LocalRun)
    run.sessions = [
        cast(
            Any,
            SimpleNamespace(
                name=m.app, serve=SimpleNamespace(models=[m]), cluster=SimpleNamespace(head_proxy_port=7001)
            ),
        )
        for m in (woken, replace(served, address_dir=tmp_path), ingress)
    ]
    run.woken = {"W": cast(Any, SimpleNamespace(settings=SimpleNamespace(host="127.0.0.1", port=4242)))}
    assert run._routes() == {
        "W": [("W gateway", "127.0.0.1", 4242)],
        "S": [],  # no replica wrote its address yet
        "I": [("i serve proxy", "127.0.0.1", 7001)],
    }


def test_the_local_runs_first_request_asks_again_while_the_gateway_says_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A woken model whose start outlasts the gateway's hold answers 503 `model_starting` with Retry-After:
    the first request is asked again after it, as a client would; any other error ends the load at once."""
    import openai

    from twin import live
    from twin.local_run import LocalRun
    from twin.report import Report
    from workloads.inference_server.guard import error_body

    def refusal(status: int, code: str) -> openai.APIStatusError:
        body = error_body("not yet", type_="unavailable", param=None, code=code)
        request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
        response = httpx.Response(status, content=body, headers={"retry-after": "0"}, request=request)
        client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="k")
        return client._make_status_error_from_response(cast(Any, response))

    answers: list[Any] = [refusal(503, "model_starting"), refusal(503, "model_starting"), "hello"]

    def chat_at(*_: Any, **__: Any) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    monkeypatch.setattr(live, "chat_at", chat_at)
    run = LocalRun.__new__(LocalRun)
    run.front_door, run.port, run.api_key, run.report = None, 1, "k", Report(out=io.StringIO())
    run._ask_until_awake("W", time.monotonic() + 60)
    assert answers == []
    answers[:] = [refusal(503, "model_unavailable")]
    with pytest.raises(openai.APIStatusError):
        run._ask_until_awake("W", time.monotonic() + 60)


def test_the_door_stops_once_its_loop_has_closed_and_not_after_the_timeout(door: FrontDoor) -> None:
    with client(door) as http:
        assert http.get("/models").status_code == 200
    started = time.monotonic()
    door.stop(timeout_s=5.0)
    assert door.stopped.is_set() and time.monotonic() - started < 2.0
