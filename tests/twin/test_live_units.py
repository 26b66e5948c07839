"""The serve-endpoint sampler (twin/live.py) against small local HTTP servers: it must see a missing endpoint."""

from __future__ import annotations

import http.server
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
