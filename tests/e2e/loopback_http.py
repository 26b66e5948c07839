"""A threaded HTTP server on 127.0.0.1 for the e2e tests' stand-ins (the credential agent, the S3 pass-through)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# SlowReplica's stream: this many chunks, this far apart.
CHUNKS = 30
CHUNK_S = 0.1


def answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str = "application/json") -> None:
    """Sends ``body`` whole, with its length: what every stand-in's plain answer is."""
    handler.send_response(status)
    handler.send_header("content-type", content_type)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class LoopbackHttp:
    """Serves `handler` on a free loopback port from a daemon thread until :meth:`stop`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SlowReplica(BaseHTTPRequestHandler):
    """A replica's server as the router sees it: healthy, and streaming each completion over three seconds."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        return None

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self) -> None:
        answer(self, 200, b'{"status": "ok"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.stream()

    def stream(self) -> None:
        """The streamed answer: CHUNKS chunks CHUNK_S apart, then [DONE]."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(CHUNKS):
            self._chunk(f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode())
            time.sleep(CHUNK_S)
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
