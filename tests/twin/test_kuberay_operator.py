"""The KubeRay operator as the twin's monitoring sees it: RayService conditions, metrics, its chart's objects."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from infra.render import write
from tests.harness import render_stack
from twin import kuberay, observe, prometheus_operator
from twin.prometheus import load_objects, monitors, scaled_jobs


@pytest.mark.parametrize(
    ("active", "pending", "endpoints", "ready", "upgrading"),
    [
        ("rs-aaaaa", "", 2, True, False),
        ("rs-aaaaa", "rs-bbbbb", 2, True, True),
        ("rs-aaaaa", "rs-bbbbb", 0, False, True),
        ("rs-aaaaa", "", 0, False, False),
        ("", "rs-bbbbb", 0, False, False),
    ],
)
def test_conditions_follow_endpoints_and_the_pending_cluster(
    active: str, pending: str, endpoints: int, ready: bool, upgrading: bool
) -> None:
    got = kuberay.ray_service_conditions(active=active, pending=pending, serve_endpoints=endpoints)
    assert got == {"Ready": ready, "UpgradeInProgress": upgrading}


def test_metrics_carry_the_state_in_the_condition_label_with_value_one() -> None:
    lines = kuberay.ray_service_metrics(
        {"name": "llama", "namespace": "llm", "uid": "u1"}, {"Ready": False, "UpgradeInProgress": True}
    )
    assert lines == [
        'kuberay_service_info{name="llama",namespace="llm",uid="u1"} 1',
        'kuberay_service_condition_ready{name="llama",namespace="llm",uid="u1",condition="false"} 1',
        'kuberay_service_condition_upgrade_in_progress{name="llama",namespace="llm",uid="u1",condition="true"} 1',
    ]


def _release(values: dict[str, Any], name: str = "kuberay-operator") -> kuberay.OperatorRelease:
    return kuberay.OperatorRelease.from_release({"name": name, "namespace": "kuberay", "values": values})


def test_the_chart_makes_no_service_monitor_unless_asked() -> None:
    assert _release({}).service_monitor() is None
    monitor = _release({"metrics": {"serviceMonitor": {"enabled": True}}}).service_monitor()
    assert monitor is not None
    assert monitor["spec"]["endpoints"] == [
        {"path": "/metrics", "targetPort": "http", "interval": "30s", "honorLabels": True}
    ]


def test_names_follow_the_chart_helpers() -> None:
    # The chart's own values set both overrides; without them, the release name decides.
    assert _release({}).fullname() == "kuberay-operator"
    bare = _release({"nameOverride": "", "fullnameOverride": ""}, name="ray")
    assert bare.fullname() == "ray-kuberay-operator" and bare.chart_name() == "kuberay-operator"
    within = _release({"nameOverride": "", "fullnameOverride": ""}, name="my-kuberay-operator")
    assert within.fullname() == "my-kuberay-operator"


@pytest.fixture(scope="module")
def prod_render(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("render")
    write(render_stack("prod"), out)
    return out


def test_the_render_s_operator_monitor_scrapes_its_pod_through_its_service(prod_render: Path, tmp_path: Path) -> None:
    objects = load_objects(prod_render)
    found = [m for m in monitors(objects) if m["kind"] == "ServiceMonitor"]
    assert [m["metadata"]["name"] for m in found] == ["kuberay-operator"]
    (job,) = [j for j in scaled_jobs(prometheus_operator.scrape_jobs(found, tmp_path)) if "kuberay" in j["job_name"]]
    assert job["honor_labels"] is True
    (service,) = [o for o in objects if o.get("kind") == "Service" and o["metadata"]["namespace"] == "kuberay"]
    (pod,) = [o for o in objects if o.get("kind") == "Pod"]
    groups = prometheus_operator.endpoint_targets(
        service, [pod], lambda _c, p: "127.0.0.1:1" if p["name"] == "http" else None
    )
    assert [g["labels"]["__meta_kubernetes_endpoint_port_name"] for g in groups] == ["http"]


class _Targets:
    """What the exporter reads of the live targets: the active cluster and the ready serve endpoints."""

    def __init__(self, service: Any, endpoints: int) -> None:
        self.service = service
        self.endpoints = endpoints

    @property
    def ray_service(self) -> dict[str, Any]:
        return {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": self.service.metadata,
            "spec": self.service.spec,
        }

    @property
    def active(self) -> kuberay.RayClusterRef:
        return kuberay.RayClusterRef(kuberay.ray_cluster_name(self.ray_service, "twin0"), self.ray_service)

    def serve_endpoints(self) -> int:
        return self.endpoints


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_the_exporter_reports_a_stuck_upgrade_and_lost_endpoints(prod_render: Path) -> None:
    from twin.render import load_ray_services

    service = load_ray_services(prod_render)[0]
    targets = _Targets(service, endpoints=2)
    exporter = observe.OperatorExporter(targets)  # type: ignore[arg-type]
    exporter.start()
    # Served from a process of its own, as the operator's pod is: never from the one running the load's clients.
    serving = observe.listening_pids(exporter.port)
    assert serving and os.getpid() not in serving
    try:
        ns = service.metadata["namespace"]
        labels = f'name="{service.name}",namespace="{ns}",uid="twin"'
        assert f'kuberay_service_condition_upgrade_in_progress{{{labels},condition="false"}} 1' in _scrape(
            exporter.port
        )
        what = exporter.start_stuck_upgrade()
        assert "waiting-for-apps" in what and "DEPLOY_FAILED" in what
        text = _scrape(exporter.port)
        assert "condition_upgrade_in_progress{" in text and 'condition="true"} 1' in text
        assert (
            "kuberay_service_condition_ready{"
            + f'name="{service.name}",namespace="{ns}",uid="twin",condition="true"}} 1'
            in text
        )
        targets.endpoints = 0
        exporter.end_upgrade()
        # The exporter serves the status of its last reconcile, a round after the endpoints went.
        deadline = time.monotonic() + 3 * observe.RECONCILE_EVERY_S
        while (
            "ready{" + labels + ',condition="true"}' in (text := _scrape(exporter.port)) and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert (
            f'kuberay_service_condition_ready{{name="{service.name}",namespace="{ns}",uid="twin",condition="false"}} 1'
            in text
        )
    finally:
        exporter.stop()
    assert not observe.listening_pids(exporter.port)
