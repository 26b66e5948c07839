"""The live checks' load (localserve.traffic.StreamLoad) against a loopback server that streams answers."""

from __future__ import annotations

import http.server
import json
import logging
import ssl
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from localserve.traffic import HTTP_CLIENT_LOGGERS, StreamLoad, abandon_all
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


class _Endless(http.server.BaseHTTPRequestHandler):
    """Streams chat chunks 50 ms apart for a minute; counts the streams whose client went away."""

    protocol_version = "HTTP/1.1"
    dropped: ClassVar[list[int]]
    open_streams: ClassVar[list[int]]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        data = f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {'content': 'a'}}]})}\n\n".encode()
        self.open_streams.append(1)
        try:
            for _ in range(1200):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            self.dropped.append(1)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_abandoning_the_loads_drops_their_streams_at_once_and_counts_none() -> None:
    # The overload's 160 streams ran on after its alerts fired, each load stopped after the one
    # before it: the server generated on for nobody and the next fault waited for it.
    handler = type("Handler", (_Endless,), {"dropped": [], "open_streams": []})
    server = LoopbackHttp(handler)
    server.server.daemon_threads = True
    loads = [StreamLoad(base_url=f"{server.base_url}/v1", api_key="k", streams=4) for _ in range(3)]
    try:
        for load in loads:
            load.start()
        deadline = time.monotonic() + 20
        while len(handler.open_streams) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(handler.open_streams) == 12
        started = time.monotonic()
        hung = abandon_all(loads, timeout_s=10)
        took = time.monotonic() - started
        assert not hung and took < 3, f"{len(hung)} threads still running after {took:.1f}s"
        assert [o for load in loads for o in load.done()] == []
        deadline = time.monotonic() + 5
        while len(handler.dropped) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(handler.dropped) == 12, "the server went on streaming to a client that had left"
    finally:
        server.stop()


def test_a_plain_stop_lets_the_streams_in_flight_run_to_their_end() -> None:
    # Day 2 counts every request of its load, the last ones included: stop() without abandon
    # must not cut them.
    handler = type("Handler", (_Endless,), {"dropped": [], "open_streams": []})
    server = LoopbackHttp(handler)
    server.server.daemon_threads = True
    load = StreamLoad(base_url=f"{server.base_url}/v1", api_key="k", streams=2)
    try:
        load.start()
        deadline = time.monotonic() + 20
        while len(handler.open_streams) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(load.stop(timeout_s=1)) == 2
        assert handler.dropped == []
    finally:
        load.stop(timeout_s=5, abandon=True)
        server.stop()
