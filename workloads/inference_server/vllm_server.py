"""The "vllm-server" layout: Ray Serve places, health-checks and autoscales vLLM's own OpenAI server.

Why not Ray Serve LLM's request path: there, every streamed chunk crosses the
Serve proxy, the OpenAI ingress replica and the LLMServer replica (two actor
hops and three processes) before the client sees it. Measured on the same
engine, that costs several times bare vLLM's front-end CPU per token and caps
requests/s well below it (benchmarks/README.md); no Serve setting removes the
hops. Here Serve keeps what it is good at (placing a replica on a GPU node
through the Ray autoscaler, restarting it when unhealthy, scaling the count)
and the request path is exactly vLLM's: the load balancer sends traffic to
the replica's pod, where vLLM's server answers behind the API-key guard
(``vllm_guard``). Serve LLM has no switch for this; the deployment below is
the little glue it takes.

One replica is one child process (``vllm_main``) holding the replica's GPUs;
vLLM's own multiprocessing runs tensor parallelism inside the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.deployment import Application

from .autoscale import ONGOING_METRIC, POLICY_PATH
from .catalog import Catalog, ModelEntry
from .engine import autoscaling_config, engine_kwargs, replica_env
from .vllm_guard import DRAIN_FILE_ENV, SETTINGS_ENV, ServerGuardSettings
from .vllm_main import PARENT_ENV, SPEC_ENV

logger = logging.getLogger(__name__)

# vLLM's gauges whose sum is a replica's queue (running plus waiting requests).
QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# Longest a replica waits for its server's first /health; the start of a
# large model from S3 takes minutes, a hang must still surface.
START_TIMEOUT_S = float(os.environ.get("INFERENCE_VLLM_START_TIMEOUT_S", "3600"))
# The rest of Serve's graceful-shutdown budget left for stopping the process.
STOP_MARGIN_S = 5.0
# Local runs pick free ports that another process may take before the server
# binds them: start again on new ones this many times.
PORT_RETRIES = 3


def deployment_name(entry: ModelEntry) -> str:
    """Serve's name of the model's deployment, as Serve LLM spells its own ("LLMServer:<model>")."""
    return f"VllmServer:{entry.model_id}"


def replica_actor_options(entry: ModelEntry) -> dict[str, Any]:
    """The resources one replica holds: its GPUs, on a node of the model's accelerator type.

    ``accelerator_type`` becomes the Ray resource ``accelerator_type:<type>``
    that only the model's GPU group advertises, so the Ray autoscaler starts
    exactly that group's pod for a new replica.
    """
    options: dict[str, Any] = {"num_cpus": 1}
    if entry.accelerator_type is not None:
        options["num_gpus"] = entry.num_devices
        options["accelerator_type"] = entry.accelerator_type
    else:
        options["num_gpus"] = 0
    return options


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _public_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        import ray

        return str(ray.util.get_node_ip_address())
    return host


def queue_length(metrics_text: str) -> float:
    """Running plus waiting requests from vLLM's Prometheus text (every label set summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in QUEUE_GAUGES:
                total += sample.value
    return total


def queue_url(metrics_url: str) -> str:
    """The server's metrics address asking for the two gauges :func:`queue_length` reads, and no others.

    prometheus_client's exposition server collects only the named metrics
    (its ``name[]`` parameter): the whole of vLLM's registry is about 46 KB
    and 6 ms of the API server's CPU to write, where these two are 0.4 KB
    and 1.3 ms, on the core the engine shares, every few seconds for the
    autoscaler.
    """
    return f"{metrics_url}?{urllib.parse.urlencode([('name[]', gauge) for gauge in QUEUE_GAUGES])}"


def _get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""


class VllmServer:
    """One Serve replica: a guarded vLLM OpenAI server process on this node, ports from the catalogue."""

    def __init__(self, catalog: dict[str, Any]) -> None:
        self._catalog = Catalog.model_validate(catalog)
        self._entry = self._catalog.models[0]
        settings = self._catalog.vllm_server
        self._host = settings.host
        self._port = settings.port or _free_port(self._host)
        self._metrics_port = settings.metrics_port or _free_port(self._host)
        self._set_urls()
        self._stopped = False
        self._address_file: Path | None = None
        self._drain_file = Path(tempfile.mkdtemp(prefix="vllm-server-")) / "draining"
        self._process = self._start()
        for _ in range(PORT_RETRIES if not (settings.port and settings.metrics_port) else 0):
            if self._wait_healthy(retry_on_exit=True):
                break
            # A free port picked here was taken before the server bound it (local runs only).
            self._port, self._metrics_port = _free_port(self._host), _free_port(self._host)
            self._set_urls()
            self._process = self._start()
        else:
            self._wait_healthy(retry_on_exit=False)
        self._address_file = self._publish_address(settings.address_dir)

    # ------------------------------------------------------------------ process

    def _set_urls(self) -> None:
        public = _public_host(self._host)
        self.url = f"http://{public}:{self._port}/v1"
        self.metrics_url = f"http://{public}:{self._metrics_port}/metrics"
        # What this replica itself calls: loopback when the server listens there too.
        near = "127.0.0.1" if self._host in ("0.0.0.0", "127.0.0.1") else public
        self._health_url = f"http://{near}:{self._port}/health"
        self._local_metrics = queue_url(f"http://{near}:{self._metrics_port}/metrics")

    def _spec(self) -> dict[str, Any]:
        return {
            "model": self._entry.source,
            "served_model_name": self._entry.model_id,
            "host": self._host,
            "port": self._port,
            "metrics_host": self._host,
            "metrics_port": self._metrics_port,
            "engine_kwargs": engine_kwargs(self._entry, self._catalog),
        }

    def _env(self) -> dict[str, str]:
        guard = ServerGuardSettings(
            api_keys_file=self._catalog.api_keys_file,
            api_keys_env=self._catalog.api_keys_env,
            limits=self._catalog.limits,
            model_ids=[self._entry.model_id],
            fairness=self._catalog.fairness,
            replica_inflight_cap=self._catalog.replica_inflight_cap(),
        )
        env = dict(os.environ)
        env.update(replica_env(self._entry, self._catalog))
        env[SPEC_ENV] = json.dumps(self._spec())
        env[SETTINGS_ENV] = guard.model_dump_json()
        env[DRAIN_FILE_ENV] = str(self._drain_file)
        env[PARENT_ENV] = str(os.getpid())
        return env

    def _start(self) -> subprocess.Popen[bytes]:
        logger.info("Starting vLLM's OpenAI server for %s on %s", self._entry.model_id, self.url)
        return subprocess.Popen(
            [sys.executable, "-m", "inference_server.vllm_main"],
            env=self._env(),
            # Its own process group: the engine core and workers it starts go with it.
            start_new_session=True,
        )

    def _wait_healthy(self, *, retry_on_exit: bool) -> bool:
        """True once /health answers; False if the process exited and the caller may retry."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = self._process.poll()
            if code is not None:
                if retry_on_exit:
                    logger.warning("vLLM's server for %s exited with %s while starting", self._entry.model_id, code)
                    return False
                raise RuntimeError(f"vLLM's server for {self._entry.model_id} exited with {code} while starting")
            with contextlib.suppress(OSError):
                if _get(self._health_url, 5)[0] == 200:
                    logger.info("vLLM's server for %s is healthy", self._entry.model_id)
                    return True
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"vLLM's server for {self._entry.model_id} not healthy after {START_TIMEOUT_S:.0f}s")
            time.sleep(1)

    def _publish_address(self, address_dir: str | None) -> Path | None:
        if address_dir is None:
            return None
        import ray

        replica = serve.get_replica_context().replica_id.unique_id
        Path(address_dir).mkdir(parents=True, exist_ok=True)
        path = Path(address_dir) / f"{replica}.json"
        record = {
            "model_id": self._entry.model_id,
            "url": self.url,
            "metrics_url": self.metrics_url,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": self._process.pid,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
        return path

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10)

    # ------------------------------------------------------------------ Serve hooks

    async def check_health(self) -> None:
        """Serve's health check: the process lives and answers /health (a draining replica still counts)."""
        code = self._process.poll()
        if code is not None:
            raise RuntimeError(f"vLLM's server for {self._entry.model_id} exited with {code}")
        status, _ = await asyncio.to_thread(_get, self._health_url, 10)
        if status not in (200, 503):
            raise RuntimeError(f"vLLM's server for {self._entry.model_id} answered /health with {status}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """vLLM's running plus waiting requests: the queue Serve's autoscaler sizes the replicas by."""
        _, text = await asyncio.to_thread(_get, self._local_metrics, 5)
        return {ONGOING_METRIC: queue_length(text)}

    async def __call__(self, request: Any) -> dict[str, str]:
        """What a request through Serve's proxy gets: that this replica is up (the wake's answer).

        No request is served here: requests go to vLLM's server on the pod.
        A model at zero replicas is woken by sending one request to the head's
        Serve proxy (``inference_server.gateway``): Serve queues it, its
        autoscaler starts a replica for a queued request, and once the
        replica is constructed (its server healthy) this answers. The body is
        never read.
        """
        del request
        return {"model": self._entry.model_id, "status": "ready"}

    async def address(self) -> dict[str, str]:
        """Where this replica's server answers (for operators and the local twin)."""
        return {"url": self.url, "metrics_url": self.metrics_url}

    def __del__(self) -> None:
        # Serve calls this when it stops the replica (on the replica's own
        # thread, after its requests are done): drain, then stop the process.
        if self._stopped or not hasattr(self, "_process"):
            return
        self._stopped = True
        self._drain_file.touch()
        started = time.monotonic()
        budget = max(0.0, self._catalog.shutdown.timeout_s - STOP_MARGIN_S)
        # Requests keep arriving until the probe and the load balancer have
        # seen the 503: serve them for the notice, then until none is left.
        notice = min(self._catalog.vllm_server.drain_notice_s, budget)
        while time.monotonic() - started < budget and self._process.poll() is None:
            waited = time.monotonic() - started
            try:
                if waited >= notice and queue_length(_get(self._local_metrics, 5)[1]) == 0:
                    break
            except OSError:
                break
            time.sleep(self._catalog.shutdown.wait_loop_s or 1.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            self._kill()
        if self._address_file is not None:
            self._address_file.unlink(missing_ok=True)


def build_vllm_server_app(catalog: Catalog) -> Application:
    """The Serve application of the "vllm-server" layout: one deployment for the catalogue's one model."""
    entry = catalog.models[0]
    scaling = autoscaling_config(entry.autoscaling)
    scaling["policy"] = {"policy_function": POLICY_PATH}
    deployment = serve.deployment(VllmServer).options(
        name=deployment_name(entry),
        ray_actor_options=replica_actor_options(entry),
        autoscaling_config=scaling,
        graceful_shutdown_timeout_s=catalog.shutdown.timeout_s,
        graceful_shutdown_wait_loop_s=catalog.shutdown.wait_loop_s,
        # Serve routes only wakes here (__call__) and the twin's address(): a few at once is plenty.
        max_ongoing_requests=4,
    )
    return deployment.bind(catalog.model_dump(mode="json"))
