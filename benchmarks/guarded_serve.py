"""The default layout's guarded vLLM server started alone: no Ray, no Serve replica beside it.

    python benchmarks/guarded_serve.py --catalog catalog.json

Runs the very class a "vllm-server" replica runs
(:class:`inference_server.vllm_server.VllmServer`), outside Ray: it starts
``inference_server.vllm_main`` (vLLM's OpenAI server with the API-key guard
as middleware) with the catalogue's engine arguments and waits for its
``/health``. Nothing calls its health check or its autoscaling metrics, and
no Ray process runs beside it. Beside the project's layout and bare vLLM it
splits the overhead into what the guard costs (guarded - bare) and what the
Serve replica and the cluster around it cost (project - guarded). Prints
``SERVER READY <url>`` and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "workloads"), str(REPO)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--catalog", required=True, help="catalogue JSON file (layout vllm-server)")
    args = parser.parse_args()
    catalog = json.loads(Path(args.catalog).read_text())
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    from inference_server.vllm_server import VllmServer

    # Blocks until the server answers /health. Started from this main thread:
    # the child's parent-death signal follows the thread that started it.
    server = VllmServer(catalog)
    print(f"SERVER READY {server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        # What Serve does when it stops a replica: drain, then end the process group.
        server.__del__()
    return 0


if __name__ == "__main__":
    sys.exit(main())
