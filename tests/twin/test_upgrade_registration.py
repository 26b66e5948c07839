"""The upgrade twin's load balancer and its target registration (twin/upgrade.py), without Ray.

A stand-in replica answers vLLM's ``/health``; the pods are the mirror's,
built from the prod render, so the Service's selector is judged on the
labels KubeRay would give them.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from localserve.ray_cluster import RayNode
from tests.harness import render_stack, start_importing_server
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


@pytest.fixture(scope="module")
def prod_upgrade() -> Any:
    """What day 2 upgrades in prod: its RayService and load-balancer Service, rendered once for the module."""
    return day2.upgrade_inputs("prod", render_stack("prod"))


def _registered(
    prod_upgrade: Any, tmp_path: Path, url: str, *, listening: bool
) -> tuple[upgrade.LocalCluster, upgrade.LoadBalancer, upgrade.Registration]:
    """Render A's cluster (the mirror's pods, a replica record for `url`) added to a registration of its own.

    ``listening`` starts the load balancer's listener.
    """
    ref = mirror.RayClusterRef(mirror.ray_cluster_name(prod_upgrade.before, "aaaaa"), prod_upgrade.before)
    group = upgrade._serving_group(ref)
    pods = [mirror.build_pod(ref, ref.spec["headGroupSpec"], mirror.HEAD), mirror.build_pod(ref, group, mirror.WORKER)]
    address_dir = tmp_path / "replicas"
    address_dir.mkdir()
    (address_dir / "r.json").write_text(json.dumps({"url": url, "pid": 1}))
    # Registration reads the pods, the replica record and `terminating`; the nodes are not started here.
    node = cast(RayNode, None)
    cluster = upgrade.LocalCluster(ref, pods, node, node, "", "", address_dir, tmp_path / "drain", "app")
    lb = upgrade.LoadBalancer()
    if listening:
        lb.start()
    registration = upgrade.Registration(lb, dict(prod_upgrade.load_balancer))
    registration.add(cluster)
    return cluster, lb, registration


@contextlib.contextmanager
def _running(
    prod_upgrade: Any, tmp_path: Path, url: str, *, listening: bool
) -> Iterator[tuple[upgrade.LocalCluster, upgrade.LoadBalancer]]:
    """:func:`_registered` with its registration running; stopped (and the load balancer too) on the way out."""
    cluster, lb, registration = _registered(prod_upgrade, tmp_path, url, listening=listening)
    try:
        registration.run()
        yield cluster, lb
    finally:
        registration.stop()
        if listening:
            lb.stop()


def test_the_targets_are_set_when_registration_starts_not_a_probe_period_later(
    prod_upgrade: Any, tmp_path: Path, replica: str
) -> None:
    cluster, lb, registration = _registered(prod_upgrade, tmp_path, replica, listening=False)
    registration.run()
    registration.stop()
    # No wait: a client that connects as soon as run() returns must find a target.
    head, worker = (p["metadata"]["name"] for p in cluster.pods)
    assert [t[0] for t in lb.targets] == [worker], f"the Service selects the serving pod, not {head}"
    assert registration.wait_targeted(cluster, 1.0)


def _healthy_connection(lb: upgrade.LoadBalancer) -> socket.socket:
    """A keep-alive connection through the load balancer that has had one answer: vLLM's /health, 200."""
    conn = socket.create_connection((upgrade.HOST, lb.port), timeout=5)
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = conn.recv(64)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return conn


def test_a_connection_made_as_registration_starts_reaches_the_replica(
    prod_upgrade: Any, tmp_path: Path, replica: str
) -> None:
    with _running(prod_upgrade, tmp_path, replica, listening=True) as (_, lb), _healthy_connection(lb):
        assert lb.refused == 0
        assert sum(lb.connections.values()) == 1
    # Stopped cleanly with no connection left open too.
    assert lb.stopped.is_set()


def test_a_terminating_cluster_leaves_the_targets_and_waiting_for_it_times_out(
    prod_upgrade: Any, tmp_path: Path, replica: str
) -> None:
    cluster, lb, registration = _registered(prod_upgrade, tmp_path, replica, listening=False)
    cluster.terminating = True
    registration.run()
    try:
        started = time.monotonic()
        assert not registration.wait_targeted(cluster, 1.0)
        assert 1.0 <= time.monotonic() - started < 3.0
        assert lb.targets == []
        # A client now is refused, and counted.
        assert lb._pick() is None and lb.refused == 1
    finally:
        registration.stop()


def test_stopping_the_load_balancer_closes_the_connections_it_still_pipes(
    prod_upgrade: Any, tmp_path: Path, replica: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    # The connection is open and idle when the load balancer stops.
    with _running(prod_upgrade, tmp_path, replica, listening=True) as (_, lb), _healthy_connection(lb) as conn:
        started = time.monotonic()
        lb.stop()
        assert lb.stopped.is_set() and time.monotonic() - started < 5
        conn.settimeout(5)
        while conn.recv(4096):  # the rest of the answer, then the close
            pass
    # Ended quietly: asyncio's server logs a traceback for a connection task that ends cancelled.
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_a_start_that_never_finishes_reports_its_busy_threads_and_the_servers_python_stacks(tmp_path: Path) -> None:
    """What day 2 prints when the pending cluster's app is not RUNNING in time (why_not_running)."""
    pytest.importorskip("vllm")
    import os
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    logs = tmp_path / "session_latest" / "logs"
    logs.mkdir(parents=True)
    with (logs / "worker-1.err").open("w") as err:
        # A server importing vLLM (as the stuck one was), and a thread spinning in a process beside it.
        server = start_importing_server(tmp_path, err)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)  # the spinner shows some CPU time
        worker = SimpleNamespace(pids=lambda: {server.pid, spinner.pid}, temp_dir=tmp_path)
        lines = upgrade.why_not_running(cast(upgrade.LocalCluster, SimpleNamespace(name="c-bbbbb", worker=worker)))
    finally:
        for proc in (server, spinner):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "\n".join(lines)
    assert f"c-bbbbb-worker: pid {spinner.pid} (python) thread {spinner.pid}: state R" in text, text
    assert f"c-bbbbb-worker: Python stacks of pids [{server.pid}]:" in text, text
    # The stack names the server's own module, where it was when asked, without the import system's frames;
    # unless the import was deeper than faulthandler's 100 frames when the signal came, which it then says.
    assert "most recent call first" in text and ("vllm_main.py" in text or upgrade.CUT_NOTE in text), text
    assert "<frozen importlib." not in text, text


def test_a_deep_stack_keeps_its_first_and_last_frames_and_drops_the_import_systems() -> None:
    """A server stuck deep in `import vllm` prints hundreds of frames, most of them importlib's; the report
    keeps where the thread is (the first lines) and where it started (the last: the server's module)."""
    frames = ["Current thread 0x1 (most recent call first):", '  File "/x/numpy/_shape.py", line 2 in <module>']
    for depth in range(60):
        frames += [
            '  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed',
            f'  File "/x/pkg/mod{depth}.py", line 1 in <module>',
        ]
    frames += ['  File "/w/inference_server/vllm_main.py", line 40 in <module>', ""]
    shown = upgrade.shown_stacks("\n".join(frames), limit=20)
    assert len(shown) == 21
    assert shown[:2] == frames[:2]
    assert shown[-1].endswith('vllm_main.py", line 40 in <module>')
    assert shown[10] == "  ... 43 lines left out"  # 63 kept: 2 + 60 modules + the server's
    assert not any("importlib" in line for line in shown)
    # Short enough: every frame but the import system's, in order.
    assert upgrade.shown_stacks("\n".join(frames[:6])) == [frames[0], frames[1], frames[3], frames[5]]
    # A dump faulthandler cut at its 100 frames ends in its "  ..." line: the report says what is missing.
    cut = upgrade.shown_stacks("\n".join([*frames[:6], "  ...", ""]))
    assert cut == [frames[0], frames[1], frames[3], frames[5], upgrade.CUT_NOTE]
