"""The live checks' load (localserve.traffic.StreamLoad) against a loopback server that streams answers."""

from __future__ import annotations

import http.server
import json
import logging
import ssl
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from localserve.traffic import HTTP_CLIENT_LOGGERS, StreamLoad
from tests.e2e.loopback_http import LoopbackHttp

STREAMS = 12


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The client port of each whole answer; the _Replica that serves it sets its own list.
    peers: ClassVar[list[int]]

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        if not request.get("stream"):
            self.peers.append(self.client_address[1])
            self._send(
                "application/json",
                json.dumps(
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"}
                        ],
                    }
                ).encode(),
            )
            return
        chunk = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}],
        }
        self._send("text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    def _send(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Replica(LoopbackHttp):
    """Answers chat completions as vLLM's server does, streamed or whole, and keeps each whole answer's client port."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        super().__init__(type("Handler", (_Handler,), {"peers": self.peers}))
        # The whole-answer clients' keep-alive connections stay open after the test: daemon
        # handler threads, so that stop() does not wait for them (read per request, so set in time).
        self.server.daemon_threads = True


@pytest.fixture
def server() -> Iterator[_Replica]:
    replica = _Replica()
    yield replica
    replica.stop()


def _load(server: _Replica, mixed: bool = False) -> StreamLoad:
    return StreamLoad(base_url=f"{server.base_url}/v1", api_key="k", streams=STREAMS, think_s=0.05, mixed=mixed)


def test_the_streams_load_the_ca_bundle_once(server: _Replica, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each client building its own TLS context loads the CA bundle again (45 ms of CPU):
    # 160 overload streams then began 84 s after their fault's clock started.
    loads: list[object] = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: Any, **kwargs: Any) -> None:
        loads.append(args or kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    load = _load(server)
    load.start()
    assert load.wait_served(STREAMS * 2, 0.0, timeout_s=20)
    load.stop(timeout_s=5)
    assert len(loads) <= 1, f"{len(loads)} CA bundle loads for {STREAMS} streams"


def test_each_whole_answer_client_keeps_its_own_connection(server: _Replica) -> None:
    # The mixed load's non-streamed clients read their whole answer, so each one's
    # keep-alive connection carries its next request (a load balancer then sees
    # long-lived connections). openai's sync stream stops reading at [DONE] and
    # drops its connection, so only these clients can show connection affinity.
    load = _load(server, mixed=True)
    load.start()
    assert load.wait_served(STREAMS * 3, 0.0, timeout_s=20)
    load.stop(timeout_s=5)
    done = load.done()
    assert all(o.ok for o in done), [o.error for o in done if not o.ok][:3]
    assert len(server.peers) >= STREAMS
    assert len(set(server.peers)) == STREAMS // 2


def test_the_load_logs_no_line_per_request(server: _Replica, caplog: pytest.LogCaptureFixture) -> None:
    # openai sends through httpx2, whose logger is not httpx's: quieting httpx alone left a JSON
    # line per request in the twin's log (1269 in one dev run), the check lines lost among them.
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    caplog.set_level(logging.INFO)
    load = _load(server)
    load.start()
    assert load.wait_served(STREAMS, 0.0, timeout_s=20)
    load.stop(timeout_s=5)
    assert not [r.getMessage() for r in caplog.records if "HTTP Request" in r.getMessage()][:3]
