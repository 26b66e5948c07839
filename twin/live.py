"""Checks against the running local cluster: what a RayService would do on Kubernetes, one line each.

The serve Service's endpoints are what the :class:`EndpointSampler` watches.
KubeRay's readiness probe of a RayService worker pod is
``wget localhost:8000/-/healthz``; the serve Service sends traffic only to
Ready pods (the head only when ``excludeHeadPodFromServeSvc`` is false).
Every local worker node's Serve proxy has a port of its own
(:mod:`twin.provider`), so probing ``127.0.0.1:<that port>/-/healthz``
probes that node and nothing else; the head's proxy keeps the configured
port. The sampler probes every node the Service could select, every second,
for the whole run, including while models are at zero.

In the "vllm-server" layout the serve Service targets the replicas' own vLLM
servers, and a GPU pod is Ready when its server answers ``GET /health``
(the rendered readiness probe). Each local replica writes where its server
listens to a file (ports are free ones, as all nodes share 127.0.0.1), with
its Ray node: the :class:`ServerSampler` probes, for each node the Service
could select, the servers of the replicas on it.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localserve.traffic import quiet_http_client_logs
from twin.cluster import FAKE_HEAD_NODE_ID, LOOPBACK, LocalCluster

PROBE_TIMEOUT_S = 2.0
SAMPLE_INTERVAL_S = 1.0
# The fewest samples a run concludes from (a short run waits for them).
MIN_SAMPLES = 15
REQUEST_TIMEOUT_S = 420.0


def healthz(port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """KubeRay's worker readiness: Serve's proxy at ``port`` answers ``/-/healthz`` with "success"."""
    if port <= 0:
        return False
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/-/healthz", timeout=timeout_s) as response:
            return response.status == 200 and b"success" in response.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass
class Sample:
    """One look at the serve Service's would-be endpoints."""

    at: float
    candidates: list[str]
    ready: list[str]


@dataclass
class EndpointSampler:
    """Probes, every second in a thread, each node the serve Service could select."""

    cluster: LocalCluster
    excludes_head: bool
    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    empty: list[Sample] = field(default_factory=list)
    latest: Sample | None = None
    _ready_ports: list[Any] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def candidates(self) -> dict[str, int]:
        """Node label -> proxy port, for every node the Service could select."""
        found = {
            f"{info.get('node_type', '?')}#{node_id[-2:]}": int(info.get("proxy_port", 0))
            for node_id, info in self.cluster.proxy_ports().items()
        }
        if not self.excludes_head:
            found[f"head#{FAKE_HEAD_NODE_ID[-2:]}"] = self.cluster.head_proxy_port
        return found

    # What a Ready pod answers, for the report's lines.
    probe_name = "/-/healthz"

    def probe(self) -> tuple[list[str], dict[str, Any]]:
        """Every candidate's name, and the Ready ones with where a request to them goes."""
        candidates = self.candidates()
        return sorted(candidates), {name: port for name, port in candidates.items() if healthz(port)}

    def sample(self) -> Sample:
        """Probes once; remembers the Ready ones."""
        candidates, ready = self.probe()
        result = Sample(at=time.monotonic() - self.started, candidates=candidates, ready=sorted(ready))
        self.samples += 1
        self.latest = result
        self._ready_ports = list(ready.values())
        if not ready:
            self.empty.append(result)
        return result

    def ready_port(self) -> int | None:
        """A port the serve Service could send a request to now."""
        ports = self._ready_ports
        return ports[0] if ports else None

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def start(self) -> None:
        """Start sampling in a thread; what was probed before (waiting for Ready) does not count."""
        self.started = time.monotonic()
        self.samples = 0
        self.empty.clear()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="endpoint-sampler", daemon=True)
        self._thread.start()

    def stop(self, min_samples: int = MIN_SAMPLES) -> None:
        """Stop sampling, once at least ``min_samples`` were taken."""
        deadline = time.monotonic() + min_samples * (SAMPLE_INTERVAL_S + 2 * PROBE_TIMEOUT_S)
        while self.samples < min_samples and self._thread is not None and time.monotonic() < deadline:
            time.sleep(SAMPLE_INTERVAL_S)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> tuple[bool, str]:
        """Whether every sample had a Ready endpoint, and the line that says so."""
        span = time.monotonic() - self.started
        if not self.empty:
            return (
                True,
                f"a node the serve Service selects answered {self.probe_name} in all {self.samples} samples "
                f"over {span:.0f}s",
            )
        first = self.empty[0]
        return (
            False,
            f"no node the serve Service selects answered {self.probe_name} in {len(self.empty)} of {self.samples} "
            "samples "
            f"(first at {first.at:.0f}s; candidates then: {', '.join(first.candidates) or 'none'}): "
            "the Service has no endpoint, the RayService is not Ready and no request can reach Serve",
        )


def server_health(base_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """The rendered readiness probe of a vllm-server pod: its server answers ``GET /health`` with 200, no key."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


# A gauge every vLLM server exports on its metrics port (the replicas' autoscaling reads it).
QUEUE_GAUGE = "vllm:num_requests_running"


def metrics_answer(url: str, timeout_s: float = 10.0) -> str:
    """What a replica's metrics port says without an API key: "ok" when it serves vLLM's gauges."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as err:
        return type(err).__name__
    return "ok" if QUEUE_GAUGE in body else f"no {QUEUE_GAUGE}"


def server_root(url: str) -> str:
    """A replica's server root from the OpenAI base URL it published (``http://host:port/v1``)."""
    return url[: -len("/v1")] if url.endswith("/v1") else url.rstrip("/")


def replica_addresses(address_dirs: list[Path]) -> list[dict[str, Any]]:
    """What every running vllm-server replica wrote about itself, with the workload's own reader."""
    from localserve.server import replica_addresses as read

    found: list[dict[str, Any]] = []
    for folder in address_dirs:
        for _ in range(3):
            try:
                found += [dict(r) for r in read(folder)]
                break
            except (OSError, ValueError):
                continue  # a stopping replica removed its file between the listing and the read
    return found


@dataclass
class ServerSampler(EndpointSampler):
    """The serve Service's endpoints in the vllm-server layout: nodes whose replicas' servers answer /health."""

    address_dirs: list[Path] = field(default_factory=list)
    probe_name = "/health"

    def servers(self) -> dict[str, list[str]]:
        """Node label -> the server roots of the replicas on it, for every node the Service could select."""
        labels = {
            node_id: f"{info.get('node_type', '?')}#{node_id[-2:]}"
            for node_id, info in self.cluster.proxy_ports().items()
        }
        if not self.excludes_head:
            labels[FAKE_HEAD_NODE_ID] = f"head#{FAKE_HEAD_NODE_ID[-2:]}"
        found: dict[str, list[str]] = {label: [] for label in labels.values()}
        for replica in replica_addresses(self.address_dirs):
            label = labels.get(str(replica.get("node_id")))
            if label is not None:
                found[label].append(server_root(str(replica.get("url", ""))))
        return found

    def probe(self) -> tuple[list[str], dict[str, Any]]:
        ready: dict[str, Any] = {}
        servers = self.servers()
        for name, roots in servers.items():
            answering = [root for root in roots if server_health(root)]
            if answering:
                ready[name] = answering[0]
        return sorted(servers), ready

    def ready_root(self) -> str | None:
        """A server the serve Service could send a request to now."""
        roots = [str(r) for r in self._ready_ports]
        return roots[0] if roots else None


def serve_details() -> dict[str, Any]:
    """Serve's own view of its applications, deployments, replicas and proxies (as ``serve status`` shows)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return dict(ray.get(controller.get_serve_instance_details.remote(), timeout=30))


def _plain(value: Any) -> str:
    """An enum's value (Serve's details hold ``ApplicationStatus.RUNNING``), or the string."""
    return str(getattr(value, "value", value))


def model_deployment_name(model_id: str) -> str:
    """The part of a Serve LLM deployment's name that names the model (Serve LLM's own rule)."""
    from types import SimpleNamespace

    from ray.llm._internal.serve.core.server.builder import _get_deployment_name

    llm_config: Any = SimpleNamespace(model_id=model_id)  # the function reads only model_id
    return str(_get_deployment_name(llm_config))


def is_model_deployment(name: str, model_id: str) -> bool:
    """Whether the deployment ``name`` serves ``model_id`` (``LLMServer:<model>``)."""
    suffix = model_deployment_name(model_id)
    return name == suffix or name.endswith(":" + suffix)


def deployments(details: dict[str, Any], app: str) -> dict[str, dict[str, Any]]:
    """The deployments of ``app`` in Serve's details."""
    return dict(((details.get("applications") or {}).get(app) or {}).get("deployments") or {})


def running_replicas(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The replicas of a deployment that are RUNNING."""
    return [r for r in deployment.get("replicas") or [] if _plain(r.get("state")) == "RUNNING"]


def live_replicas(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The replicas of a deployment that exist in any state but stopped."""
    return [r for r in deployment.get("replicas") or [] if _plain(r.get("state")) not in ("STOPPING", "STOPPED")]


def describe(details: dict[str, Any], app: str) -> str:
    """One line: each deployment's RUNNING/total replicas and status."""
    parts = []
    for name, deployment in sorted(deployments(details, app).items()):
        parts.append(
            f"{name} {len(running_replicas(deployment))}/{len(live_replicas(deployment))} "
            f"{_plain(deployment.get('status'))}"
        )
    return ", ".join(parts) or "no deployments yet"


def app_status(details: dict[str, Any], app: str) -> tuple[str, str]:
    """The application's status and message."""
    info = (details.get("applications") or {}).get(app) or {}
    return _plain(info.get("status", "NOT_STARTED")), str(info.get("message", ""))


def wait_for(
    condition: Callable[[], bool], timeout_s: float, interval_s: float = 2.0, on_wait: Callable[[], None] | None = None
) -> bool:
    """Polls ``condition`` until it holds or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        if on_wait is not None:
            on_wait()
        time.sleep(interval_s)


def chat(port: int, api_key: str, model_id: str, timeout_s: float = REQUEST_TIMEOUT_S) -> str:
    """One chat completion through the official OpenAI client; returns the answer's text."""
    return chat_at(f"http://{LOOPBACK}:{port}/v1", api_key, model_id, timeout_s)


def chat_at(base_url: str, api_key: str, model_id: str, timeout_s: float = REQUEST_TIMEOUT_S) -> str:
    """:func:`chat` against an OpenAI base URL."""
    import openai

    quiet_http_client_logs()
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
    result = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = result.choices[0].message.content or ""
    if not text:
        raise RuntimeError("the answer is empty")
    return text


def status_without_key(port: int) -> int:
    """The HTTP status of ``/v1/models`` asked without an API key."""
    return status_of(f"http://{LOOPBACK}:{port}/v1/models")


def status_of(url: str, method: str = "GET") -> int:
    """The HTTP status of ``method url`` (no body) without an API key."""
    request = urllib.request.Request(url, data=b"" if method != "GET" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
