"""The upgrade twin's load balancer and its target registration (twin/upgrade.py), without Ray.

A stand-in replica answers vLLM's ``/health``; the pods are the mirror's,
built from the prod render, so the Service's selector is judged on the
labels KubeRay would give them.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from localserve.ray_cluster import RayNode
from tests.harness import render_stack
from twin import day2, upgrade
from twin import kuberay as mirror


class _Health(http.server.BaseHTTPRequestHandler):
    # Keep-alive, as vLLM's server: a connection stays open between requests.
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((upgrade.HOST, 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{upgrade.HOST}:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def _cluster(tmp_path: Path, url: str) -> tuple[upgrade.LocalCluster, dict[str, Any]]:
    inputs = day2.upgrade_inputs("prod", render_stack("prod"))
    ref = mirror.RayClusterRef(mirror.ray_cluster_name(inputs.before, "aaaaa"), inputs.before)
    group = upgrade._serving_group(ref)
    pods = [mirror.build_pod(ref, ref.spec["headGroupSpec"], mirror.HEAD), mirror.build_pod(ref, group, mirror.WORKER)]
    address_dir = tmp_path / "replicas"
    address_dir.mkdir()
    (address_dir / "r.json").write_text(json.dumps({"url": url, "pid": 1}))
    # Registration reads the pods, the replica record and `terminating`; the nodes are not started here.
    node = cast(RayNode, None)
    cluster = upgrade.LocalCluster(ref, pods, node, node, "", "", address_dir, tmp_path / "drain", "app")
    return cluster, dict(inputs.load_balancer)


def test_the_targets_are_set_when_registration_starts_not_a_probe_period_later(tmp_path: Path, replica: str) -> None:
    cluster, service = _cluster(tmp_path, replica)
    lb = upgrade.LoadBalancer()
    registration = upgrade.Registration(lb, service)
    registration.add(cluster)
    try:
        registration.run()
        # No wait: a client that connects as soon as run() returns must find a target.
        head, worker = (p["metadata"]["name"] for p in cluster.pods)
        assert [t[0] for t in lb.targets] == [worker], f"the Service selects the serving pod, not {head}"
        assert registration.wait_targeted(cluster, 1.0)
    finally:
        registration.stop()


def test_a_connection_made_as_registration_starts_reaches_the_replica(tmp_path: Path, replica: str) -> None:
    cluster, service = _cluster(tmp_path, replica)
    lb = upgrade.LoadBalancer()
    lb.start()
    registration = upgrade.Registration(lb, service)
    registration.add(cluster)
    try:
        registration.run()
        with socket.create_connection((upgrade.HOST, lb.port), timeout=5) as conn:
            conn.sendall(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")
            answer = conn.recv(64)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert lb.refused == 0
        assert sum(lb.connections.values()) == 1
    finally:
        registration.stop()
        lb.stop()
    # Stopped cleanly with no connection left open too.
    assert lb.stopped.is_set()


def test_a_terminating_cluster_leaves_the_targets_and_waiting_for_it_times_out(tmp_path: Path, replica: str) -> None:
    cluster, service = _cluster(tmp_path, replica)
    lb = upgrade.LoadBalancer()
    registration = upgrade.Registration(lb, service)
    registration.add(cluster)
    cluster.terminating = True
    started = time.monotonic()
    assert not registration.wait_targeted(cluster, 1.0)
    assert 1.0 <= time.monotonic() - started < 3.0
    assert lb.targets == []
    # A client now is refused, and counted.
    assert lb._pick() is None and lb.refused == 1


def test_stopping_the_load_balancer_closes_the_connections_it_still_pipes(tmp_path: Path, replica: str) -> None:
    cluster, service = _cluster(tmp_path, replica)
    lb = upgrade.LoadBalancer()
    lb.start()
    registration = upgrade.Registration(lb, service)
    registration.add(cluster)
    registration.run()
    registration.stop()
    # A keep-alive connection, open and idle when the load balancer stops.
    with socket.create_connection((upgrade.HOST, lb.port), timeout=5) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(64).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        lb.stop()
        assert lb.stopped.is_set() and time.monotonic() - started < 5
        conn.settimeout(5)
        while conn.recv(4096):  # the rest of the answer, then the close
            pass
