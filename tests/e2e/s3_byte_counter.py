"""A loopback pass-through in front of moto that counts the bytes each object's GETs returned.

moto logs requests, not how many bytes a ranged GET carried; the distributed
streaming tests need exactly that: what each reader took from S3. Point a
reader's AWS_ENDPOINT_URL here instead of at moto (moto checks no signatures
in that mode, so the changed Host does not matter).
"""

from __future__ import annotations

import http.client
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from tests.e2e.loopback_http import LoopbackHttp

# Per hop, never forwarded: the proxy frames each response itself.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class ByteCounter(LoopbackHttp):
    """An HTTP pass-through to `upstream` on 127.0.0.1; `got[path]` is the body bytes GETs of that path returned."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.got: Counter[str] = Counter()
        counter = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as S3 clients expect; every response carries its length.
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                if body is not None:
                    headers["Content-Length"] = str(length)
                upstream_conn = http.client.HTTPConnection(target.hostname or "", target.port, timeout=60)
                try:
                    upstream_conn.request(self.command, self.path, body=body, headers=headers)
                    response = upstream_conn.getresponse()
                    data = response.read()
                    sent_length = response.getheader("Content-Length", "0")
                finally:
                    upstream_conn.close()
                if self.command == "GET":
                    counter.got[urlsplit(self.path).path] += len(data)
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_HEADERS:
                        self.send_header(key, value)
                # A HEAD's length is the object's, with no body to measure.
                self.send_header("Content-Length", sent_length if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            # A weight load only reads: listings and objects (GET), sizes (HEAD).
            def do_GET(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(Handler)

    @property
    def endpoint(self) -> str:
        """The URL a reader uses as its S3 endpoint."""
        return self.base_url

    def read_of(self, suffix: str) -> int:
        """Body bytes GETs returned for the paths ending in `suffix` (path-style: /bucket/key)."""
        return sum(n for path, n in self.got.items() if path.endswith(suffix))
