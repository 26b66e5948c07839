"""A ``/metrics`` endpoint in a process of its own, serving the exposition another process last wrote to a file.

Run as ``python metrics_endpoint.py FILE HOST``: it listens on ``HOST`` at a
free port, prints the port on its first line, and answers every GET with the
file's current bytes (503 before the file exists). It exits when the process
that started it does.

Why a process: the twin's stand-in for the KubeRay operator
(twin.observe.OperatorExporter) reconciles in the twin's own process, which
also runs the load's client threads. Served from there, a scrape waited on
that process's GIL past Prometheus's timeout under the overload, and
Prometheus marks a target's series stale on a failed scrape. The operator
runs in a pod of its own, so its endpoint does here too. This file imports
nothing of the project's: it runs by path, from any working directory.
"""

from __future__ import annotations

import http.server
import os
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4"
PARENT_POLL_S = 1.0


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that gave up before the answer was written closes its end; that is its timeout to report.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        socketserver.BaseServer.handle_error(self, request, client_address)


def make_server(path: Path, host: str) -> http.server.ThreadingHTTPServer:
    """The server, bound to a free port on ``host``; it serves ``path``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                body = path.read_bytes()
            except OSError:
                self.send_error(503, "no status reconciled yet")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return _Server((host, 0), Handler)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def main(argv: list[str]) -> None:
    path, host = Path(argv[0]), argv[1]
    server = make_server(path, host)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
