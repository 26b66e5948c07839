"""The serve-endpoint sampler (twin/live.py) against small local HTTP servers: it must see a missing endpoint."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from twin import live


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"success" if self.path == "/-/healthz" else b"no"
        self.send_response(200 if body == b"success" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@dataclass
class FakeCluster:
    """What the sampler reads of a LocalCluster: the provider's port file and the head's port."""

    ports: dict[str, dict[str, Any]] = field(default_factory=dict)
    head_proxy_port: int = 0
    nodes_file: Path = Path("/nonexistent")

    def proxy_ports(self) -> dict[str, dict[str, Any]]:
        return self.ports


def port_of(server: http.server.ThreadingHTTPServer) -> int:
    return int(server.server_address[1])


def test_healthz_wants_success_from_that_port(proxy: http.server.ThreadingHTTPServer) -> None:
    assert live.healthz(port_of(proxy))
    assert not live.healthz(0)


def test_a_ready_worker_proxy_passes(proxy: http.server.ThreadingHTTPServer) -> None:
    cluster = FakeCluster(ports={"f" * 56: {"node_type": "ingress", "proxy_port": port_of(proxy)}})
    sampler = live.EndpointSampler(cluster, excludes_head=True)  # type: ignore[arg-type]
    assert sampler.sample().ready == ["ingress#ff"]
    assert sampler.ready_port() == port_of(proxy)
    assert sampler.summary()[0]


def test_the_head_does_not_count_when_the_service_excludes_it(proxy: http.server.ThreadingHTTPServer) -> None:
    cluster = FakeCluster(head_proxy_port=port_of(proxy))
    excluded = live.EndpointSampler(cluster, excludes_head=True)  # type: ignore[arg-type]
    excluded.sample()
    ok, line = excluded.summary()
    assert not ok and "no node the serve Service selects answered /-/healthz in 1 of 1 samples" in line
    included = live.EndpointSampler(cluster, excludes_head=False)  # type: ignore[arg-type]
    assert included.sample().ready == ["head#00"]


def test_one_empty_moment_fails_the_whole_run(proxy: http.server.ThreadingHTTPServer) -> None:
    cluster = FakeCluster(ports={"a" * 56: {"node_type": "ingress", "proxy_port": port_of(proxy)}})
    sampler = live.EndpointSampler(cluster, excludes_head=True)  # type: ignore[arg-type]
    sampler.sample()
    cluster.ports["a" * 56]["proxy_port"] = 1  # the proxy went away
    sampler.sample()
    cluster.ports["a" * 56]["proxy_port"] = port_of(proxy)
    sampler.sample()
    ok, line = sampler.summary()
    assert not ok and "in 1 of 3 samples" in line


def test_replica_states_are_read_from_serves_enums() -> None:
    class State:
        value = "RUNNING"

    deployment = {"replicas": [{"state": State()}, {"state": "STOPPING"}, {"state": "STARTING"}], "status": State()}
    assert len(live.running_replicas(deployment)) == 1
    assert len(live.live_replicas(deployment)) == 2


def test_the_wait_for_ready_does_not_count_but_every_moment_after_does(proxy: http.server.ThreadingHTTPServer) -> None:
    """Before the RayService is Ready the Service may be empty; from the start of sampling it may never be."""
    cluster = FakeCluster(ports={"b" * 56: {"node_type": "ingress", "proxy_port": 1}})
    sampler = live.EndpointSampler(cluster, excludes_head=True)  # type: ignore[arg-type]
    assert not sampler.sample().ready  # still starting: not Ready yet
    cluster.ports["b" * 56]["proxy_port"] = port_of(proxy)
    sampler.start()
    sampler.stop(min_samples=2)
    assert sampler.summary()[0]
    cluster.ports["b" * 56]["proxy_port"] = 1
    sampler.sample()
    ok, line = sampler.summary()
    assert not ok and "1 of" in line


class _Server(http.server.BaseHTTPRequestHandler):
    """A replica's vLLM server as the probe sees it: /health open."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 401)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def publish(folder: Path, name: str, node_id: str, port: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    url = f"http://127.0.0.1:{port}/v1"
    path.write_text(json.dumps({"model_id": "m", "url": url, "metrics_url": "", "node_id": node_id, "pid": 1}))
    return path


GPU_A, GPU_B = "f" * 54 + "01", "f" * 54 + "02"


def test_server_root_drops_the_openai_suffix() -> None:
    assert live.server_root("http://127.0.0.1:9/v1") == "http://127.0.0.1:9"


def test_a_node_is_ready_when_its_replicas_server_answers_health(
    server: http.server.ThreadingHTTPServer, tmp_path: Path
) -> None:
    cluster = FakeCluster(ports={GPU_A: {"node_type": "gpu", "proxy_port": 0}, GPU_B: {"node_type": "gpu"}})
    publish(tmp_path, "r1", GPU_A, port_of(server))
    sampler = live.ServerSampler(cluster, excludes_head=True, address_dirs=[tmp_path])  # type: ignore[arg-type]
    sample = sampler.sample()
    assert sample.candidates == ["gpu#01", "gpu#02"] and sample.ready == ["gpu#01"]
    assert sampler.ready_root() == f"http://127.0.0.1:{port_of(server)}"
    assert sampler.summary()[0]


def test_no_answering_server_is_an_empty_service(server: http.server.ThreadingHTTPServer, tmp_path: Path) -> None:
    """A replica on a node the Service does not select, or a server that went away, leaves no endpoint."""
    cluster = FakeCluster(ports={GPU_A: {"node_type": "gpu"}})
    publish(tmp_path, "elsewhere", GPU_B, port_of(server))
    stale = publish(tmp_path, "gone", GPU_A, 1)
    sampler = live.ServerSampler(cluster, excludes_head=True, address_dirs=[tmp_path])  # type: ignore[arg-type]
    assert not sampler.sample().ready
    stale.unlink()
    publish(tmp_path, "back", GPU_A, port_of(server))
    assert sampler.sample().ready == ["gpu#01"]
    ok, line = sampler.summary()
    assert not ok and "answered /health in 1 of 2 samples" in line


@pytest.mark.usefixtures("needs_ray")
def test_replicas_must_be_on_distinct_nodes_when_a_node_holds_one() -> None:
    from twin.run import holds_one

    node = {"CPU": 4.0, "GPU": 4.0, "accelerator_type:L40S": 1.0}
    assert holds_one({"num_cpus": 1, "num_gpus": 4, "accelerator_type": "L40S"}, node)
    assert not holds_one({"num_cpus": 1, "num_gpus": 1, "accelerator_type": "L40S"}, node)
    assert not holds_one({"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100"}, node)


@pytest.mark.usefixtures("needs_ray")
def test_worker_proxy_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """Picked long before the proxy binds: a port bind(0) could hand to any other process meanwhile is avoided."""
    from twin import provider

    low = provider._ephemeral_low()
    ports = {provider._free_port() for _ in range(5)}
    if low > provider.PORT_FLOOR:
        assert all(provider.PORT_FLOOR <= p < low for p in ports)
    assert all(provider._bindable(p) for p in ports)
