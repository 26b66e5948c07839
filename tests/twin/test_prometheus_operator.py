"""The scrape jobs twin/prometheus_operator.py generates: the operator's rules, and a real Prometheus reading them.

The pure tests pin single rules of promcfg.go (selectors, ports, the order
of relabelings). The others give the jobs generated from the committed
stacks' PodMonitors (and those of dev's file on Serve's OpenAI ingress,
SERVE_INGRESS) to the real `promtool` and `prometheus` binaries, with
file-SD targets built from the pods the KubeRay mirror builds: each Ray
PodMonitor must keep exactly the pods and ports it is meant for, with the
labels the alerting rules read, and the others (a router's, the gateway's)
no Ray pod. The targets point at a port nothing listens on, so they are
down: the test reads discovery and relabelling, not scrapes.
Without the binaries those tests skip, and fail under E2E_REQUIRED=1.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.serving import kuberay
from infra.serving.ports import RAY_PORTS
from localserve.processes import free_port
from tests.harness import SERVE_INGRESS, manifests_of, ray_cluster, ray_service_pods, render_stack
from twin import kuberay as mirror
from twin import prometheus_operator as po

STACKS = ("dev", "prod", SERVE_INGRESS)
# The PodMonitors that scrape Ray pods, and which of them each stack renders: a vllm-server model's
# replicas serve their own vLLM metrics (vllm-servers); a serve-ingress one's go through Ray's.
RAY_POD_MONITORS = ("ray-heads", "ray-workers", "vllm-servers")
STACK_RAY_POD_MONITORS = {
    "dev": set(RAY_POD_MONITORS),
    "prod": set(RAY_POD_MONITORS),
    SERVE_INGRESS: {"ray-heads", "ray-workers"},
}
# Nothing listens on port 1: targets are discovered and relabelled, then down.
UNREACHABLE = "127.0.0.1:1"
# The selector of the old render's Ray PodMonitors: KubeRay's originated-from
# labels are on its Services, never on the pods.
OLD_SELECTOR = {"matchLabels": {mirror.ORIGINATED_FROM_CRD: "RayService", kuberay.NODE_TYPE: "head"}}
OLD_MONITOR = "old-ray-heads"
HEAD_SVC_MONITOR = "ray-head-svc"
TARGET_LABELS = {"ray_io_cluster": kuberay.CLUSTER, "llm_platform_ray_service": kuberay.SERVICE_LABEL}


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("E2E_REQUIRED") == "1":
            pytest.fail(f"E2E_REQUIRED=1 but {name} is not installed")
        pytest.skip(f"{name} is not installed (Debian package prometheus)")
    return path


def _unreachable(container: str, port: Mapping[str, Any]) -> str:
    return UNREACHABLE


# --- the stacks' pods and monitors ---------------------------------------------------


def _pods(stack: str) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = []
    for rs in manifests_of(render_stack(stack), "RayService"):
        pods += ray_service_pods(rs)
    return pods


def _labels(pod: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = pod["metadata"]["labels"]
    return labels


def _namespace(stack: str) -> str:
    namespace: str = manifests_of(render_stack(stack), "RayService")[0]["metadata"]["namespace"]
    return namespace


def _extra_monitors(stack: str) -> list[dict[str, Any]]:
    """The old (broken) PodMonitor, and a ServiceMonitor on KubeRay's head Service, which does carry that label."""
    ns = _namespace(stack)
    old = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": OLD_MONITOR, "namespace": ns},
        "spec": {
            "namespaceSelector": {"matchNames": [ns]},
            "selector": OLD_SELECTOR,
            "podMetricsEndpoints": [{"port": RAY_PORTS.metrics.name, "interval": "15s"}],
        },
    }
    head_svc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": HEAD_SVC_MONITOR, "namespace": ns},
        "spec": {
            "selector": OLD_SELECTOR,
            "podTargetLabels": [kuberay.SERVICE_LABEL],
            "endpoints": [{"port": RAY_PORTS.metrics.name}],
        },
    }
    return [old, head_svc]


def _head_services(stack: str) -> list[dict[str, Any]]:
    return [mirror.build_head_service(ray_cluster(rs)) for rs in manifests_of(render_stack(stack), "RayService")]


def _ray_monitors(stack: str) -> list[dict[str, Any]]:
    return manifests_of(render_stack(stack), "PodMonitor") + manifests_of(render_stack(stack), "ServiceMonitor")


def _write_setup(stack: str, folder: Path) -> Path:
    """prometheus.yml and both file-SD files for a stack; returns the config file."""
    pods = _pods(stack)
    pod_groups = [g for p in pods for g in po.pod_targets(p, _unreachable)]
    endpoint_groups = [g for s in _head_services(stack) for g in po.endpoint_targets(s, pods, _unreachable)]
    po.write_sd_files(folder, pod_groups, endpoint_groups)
    config = po.prometheus_config(_ray_monitors(stack) + _extra_monitors(stack), folder)
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# --- promtool -------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_the_generated_config_passes_promtool(stack: str, tmp_path: Path) -> None:
    promtool = _binary("promtool")
    config = _write_setup(stack, tmp_path)
    run = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    jobs = yaml.safe_load(config.read_text())["scrape_configs"]
    assert {j["job_name"].split("/")[2] for j in jobs} >= {"ray-heads", "ray-workers"}


# --- a real Prometheus ----------------------------------------------------------------


@dataclass
class Running:
    """A Prometheus started on a stack's jobs, and what its targets API said once discovery settled."""

    stack: str
    pools: dict[str, list[dict[str, Any]]]  # job_name -> its active targets
    dropped: int  # targets relabelling dropped, over all jobs
    discovered: int  # targets over all jobs, kept or dropped


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: dict[str, Any] = json.load(response)
    return body


def _settled(targets: dict[str, Any], sizes: dict[str, int]) -> bool:
    """Every job has seen all its file-SD targets, kept or dropped.

    Counted in total: a dropped target does not reliably name its job in
    this API (Prometheus 2.42 reports the labels as relabelling left them).
    """
    return len(targets["activeTargets"]) + len(targets["droppedTargets"]) == sum(sizes.values())


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Running]]:
    """One Prometheus per stack, started together, read once every job has seen every target."""
    binary = _binary("prometheus")
    procs: dict[str, tuple[subprocess.Popen[bytes], int, Path, list[dict[str, Any]], dict[str, int]]] = {}
    try:
        for stack in STACKS:
            folder = tmp_path_factory.mktemp(f"prometheus-{stack}")
            config = _write_setup(stack, folder)
            jobs = yaml.safe_load(config.read_text())["scrape_configs"]
            sizes = {}
            for job in jobs:
                sd_file = Path(job["file_sd_configs"][0]["files"][0])
                sizes[job["job_name"]] = len(json.loads(sd_file.read_text()))
            port = free_port()
            log = (folder / "prometheus.log").open("wb")
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs[stack] = (proc, port, folder, jobs, sizes)
        out: dict[str, Running] = {}
        deadline = time.monotonic() + 30
        for stack, (proc, port, folder, jobs, sizes) in procs.items():
            targets: dict[str, Any] | None = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    targets = _get(f"http://127.0.0.1:{port}/api/v1/targets?state=any")["data"]
                except OSError:
                    targets = None
                if targets is not None and _settled(targets, sizes):
                    break
                time.sleep(0.25)
            log_text = (folder / "prometheus.log").read_text(errors="replace")[-3000:]
            assert targets is not None and _settled(targets, sizes), f"{stack}: targets never settled\n{log_text}"
            pools: dict[str, list[dict[str, Any]]] = {j["job_name"]: [] for j in jobs}
            for t in targets["activeTargets"]:
                pools[t["scrapePool"]].append(t)
            out[stack] = Running(stack, pools, len(targets["droppedTargets"]), sum(sizes.values()))
        yield out
    finally:
        for proc, *_ in procs.values():
            proc.terminate()
        for proc, *_ in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _pool(r: Running, kind: str, name: str, i: int) -> list[dict[str, Any]]:
    return r.pools[f"{kind}/{_namespace(r.stack)}/{name}/{i}"]


def _expected_ports(stack: str, monitor: str) -> set[tuple[str, str]]:
    """(pod, port) pairs a Ray PodMonitor is meant to scrape, from the pods' own labels and ports."""
    pods = [p for p in _pods(stack) if kuberay.SERVICE_LABEL in _labels(p)]
    heads = [p for p in pods if _labels(p)[kuberay.NODE_TYPE] == "head"]
    workers = [p for p in pods if _labels(p)[kuberay.NODE_TYPE] == "worker"]
    if monitor == "ray-heads":
        return {(p["metadata"]["name"], port.name) for p in heads for port in RAY_PORTS.scraped_on_head()}
    if monitor == "ray-workers":
        return {(p["metadata"]["name"], RAY_PORTS.metrics.name) for p in workers}
    vllm = RAY_PORTS.vllm_metrics.name
    return {
        (p["metadata"]["name"], vllm)
        for p in workers
        if mirror.container_port(p["spec"]["containers"][0], vllm) is not None
    }


@pytest.mark.parametrize("stack", STACKS)
def test_each_ray_pod_monitor_keeps_exactly_the_pods_and_ports_it_names(
    stack: str, running: dict[str, Running]
) -> None:
    r = running[stack]
    monitors = manifests_of(render_stack(stack), "PodMonitor")
    names = [m["metadata"]["name"] for m in monitors]
    assert {n for n in names if n in RAY_POD_MONITORS} == STACK_RAY_POD_MONITORS[stack]
    pods = {p["metadata"]["name"]: p for p in _pods(stack)}
    ns = _namespace(stack)
    # The others (dev's router and gateway) select their own Deployments' pods: they keep no Ray pod.
    for monitor in monitors:
        name = monitor["metadata"]["name"]
        if name not in RAY_POD_MONITORS:
            for i, _ in enumerate(monitor["spec"]["podMetricsEndpoints"]):
                assert _pool(r, "podMonitor", name, i) == [], name
    for monitor in monitors:
        name = monitor["metadata"]["name"]
        if name not in RAY_POD_MONITORS:
            continue
        got: set[tuple[str, str]] = set()
        for i, ep in enumerate(monitor["spec"]["podMetricsEndpoints"]):
            for target in _pool(r, "podMonitor", name, i):
                labels = target["labels"]
                got.add((labels["pod"], labels["endpoint"]))
                pod = pods[labels["pod"]]
                assert labels["endpoint"] == ep["port"]
                assert labels["namespace"] == ns
                assert labels["container"] == pod["spec"]["containers"][0]["name"]
                assert labels["job"] == f"{ns}/{name}"
                assert labels["instance"] == UNREACHABLE
                for target_label, pod_label in TARGET_LABELS.items():
                    assert labels[target_label] == _labels(pod)[pod_label], (name, target_label)
                assert labels["ray_io_group"] == _labels(pod)[kuberay.GROUP]
                # Meta labels are gone after relabelling; the operator's temporaries too.
                assert not [k for k in labels if k.startswith("__")], labels
                if name == "vllm-servers":
                    assert labels["application"] == _labels(pod)[kuberay.SERVICE_LABEL]
        want = _expected_ports(stack, name)
        assert want, name
        assert got == want, f"{name}: scrapes {sorted(got - want)} it should not, misses {sorted(want - got)}"


@pytest.mark.parametrize("stack", STACKS)
def test_the_old_selector_keeps_no_target(stack: str, running: dict[str, Running]) -> None:
    """KubeRay's originated-from labels are on no pod: the old PodMonitor's job drops every target."""
    r = running[stack]
    job = f"podMonitor/{_namespace(stack)}/{OLD_MONITOR}/0"
    # Discovery settled (every job saw every pod target), and this job kept none.
    assert r.pools[job] == []
    assert r.dropped == r.discovered - sum(len(p) for p in r.pools.values()) > 0


@pytest.mark.parametrize("stack", STACKS)
def test_a_service_monitor_on_the_head_service_keeps_the_heads(stack: str, running: dict[str, Running]) -> None:
    """The same labels on KubeRay's head Service do select: the endpoints role, job named after the Service."""
    r = running[stack]
    ns = _namespace(stack)
    targets = _pool(r, "serviceMonitor", HEAD_SVC_MONITOR, 0)
    heads = {p["metadata"]["name"]: p for p in _pods(stack) if _labels(p)[kuberay.NODE_TYPE] == "head"}
    assert {t["labels"]["pod"] for t in targets} == set(heads)
    services = {s["metadata"]["name"] for s in _head_services(stack)}
    for t in targets:
        labels = t["labels"]
        pod = heads[labels["pod"]]
        assert labels["job"] == labels["service"] and labels["service"] in services
        assert labels["endpoint"] == RAY_PORTS.metrics.name
        assert labels["namespace"] == ns
        assert labels["container"] == pod["spec"]["containers"][0]["name"]
        assert labels["llm_platform_ray_service"] == _labels(pod)[kuberay.SERVICE_LABEL]


# --- single rules, pure ---------------------------------------------------------------


def _pod_monitor(spec: dict[str, Any], name: str = "m", namespace: str = "ns") -> dict[str, Any]:
    return {"kind": "PodMonitor", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _job(monitor: dict[str, Any]) -> dict[str, Any]:
    (job,) = po.scrape_jobs([monitor], Path("/sd"))
    return job


def _rules(job: dict[str, Any]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = job["relabel_configs"]
    return rules


def test_label_names_are_sanitised_as_prometheus_does() -> None:
    assert po.sanitize_label_name("ray.io/node-type") == "ray_io_node_type"
    assert po.sanitize_label_name("llm-platform/ray-service") == "llm_platform_ray_service"
    assert po.sanitize_label_name("app.kubernetes.io/name") == "app_kubernetes_io_name"
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-1",
            "labels": {"ray.io/node-type": "head"},
            "annotations": {"example.com/a-b": "x"},
            "ownerReferences": [
                {"kind": "ReplicaSet", "name": "not-it"},
                {"kind": "RayCluster", "name": "c", "controller": True},
            ],
        },
        "spec": {
            "containers": [
                {"name": "ray", "image": "ray:1", "ports": [{"name": "metrics", "containerPort": 8080}]},
                {"name": "sidecar", "image": "s:1"},
            ],
            "initContainers": [{"name": "init", "image": "i:1"}],
        },
        "status": {"containerStatuses": [{"name": "ray", "containerID": "containerd://abc"}]},
    }
    groups = po.pod_targets(pod, lambda c, p: f"127.0.0.1:{p.get('containerPort', 9)}", phase="Pending", ready=False)
    assert [g["targets"] for g in groups] == [["127.0.0.1:8080"], ["127.0.0.1:9"], ["127.0.0.1:9"]]
    ray = groups[0]["labels"]
    assert ray == {
        "__meta_kubernetes_namespace": "ns",
        "__meta_kubernetes_pod_name": "p",
        "__meta_kubernetes_pod_label_ray_io_node_type": "head",
        "__meta_kubernetes_pod_labelpresent_ray_io_node_type": "true",
        "__meta_kubernetes_pod_annotation_example_com_a_b": "x",
        "__meta_kubernetes_pod_annotationpresent_example_com_a_b": "true",
        "__meta_kubernetes_pod_ip": "127.0.0.1",
        "__meta_kubernetes_pod_ready": "false",
        "__meta_kubernetes_pod_phase": "Pending",
        "__meta_kubernetes_pod_node_name": "twin",
        "__meta_kubernetes_pod_host_ip": "127.0.0.1",
        "__meta_kubernetes_pod_uid": "u-1",
        "__meta_kubernetes_pod_controller_kind": "RayCluster",
        "__meta_kubernetes_pod_controller_name": "c",
        "__meta_kubernetes_pod_container_init": "false",
        "__meta_kubernetes_pod_container_id": "containerd://abc",
        "__meta_kubernetes_pod_container_name": "ray",
        "__meta_kubernetes_pod_container_image": "ray:1",
        "__meta_kubernetes_pod_container_port_name": "metrics",
        "__meta_kubernetes_pod_container_port_number": "8080",
        "__meta_kubernetes_pod_container_port_protocol": "TCP",
    }
    sidecar, init = groups[1]["labels"], groups[2]["labels"]
    assert "__meta_kubernetes_pod_container_port_name" not in sidecar
    assert sidecar["__meta_kubernetes_pod_container_name"] == "sidecar"
    assert init["__meta_kubernetes_pod_container_init"] == "true"
    # A port nothing of the twin serves is left out.
    assert po.pod_targets(pod, lambda c, p: None) == []


def test_match_expressions_become_the_operators_keep_and_drop_rules() -> None:
    selector = {
        "matchLabels": {"b": "2", "a.x/y": "1"},
        "matchExpressions": [
            {"key": "in", "operator": "In", "values": ["x", "y"]},
            {"key": "not-in", "operator": "NotIn", "values": ["z"]},
            {"key": "has", "operator": "Exists"},
            {"key": "lacks", "operator": "DoesNotExist"},
        ],
    }
    rules = _rules(_job(_pod_monitor({"selector": selector, "podMetricsEndpoints": [{"port": "m"}]})))
    lbl, present = "__meta_kubernetes_pod_label_", "__meta_kubernetes_pod_labelpresent_"
    selection = rules[3:9]
    assert selection == [
        # matchLabels sorted by key, then the expressions in their order.
        {"action": "keep", "source_labels": [lbl + "a_x_y", present + "a_x_y"], "regex": "(1);true"},
        {"action": "keep", "source_labels": [lbl + "b", present + "b"], "regex": "(2);true"},
        {"action": "keep", "source_labels": [lbl + "in", present + "in"], "regex": "(x|y);true"},
        {"action": "drop", "source_labels": [lbl + "not_in", present + "not_in"], "regex": "(z);true"},
        {"action": "keep", "source_labels": [present + "has"], "regex": "true"},
        {"action": "drop", "source_labels": [present + "lacks"], "regex": "true"},
    ]


def test_the_job_starts_with_the_namespace_scope_the_job_name_and_the_phase_drop() -> None:
    rules = _rules(_job(_pod_monitor({"podMetricsEndpoints": [{"port": "m"}]})))
    # Ours: the namespace Kubernetes SD would have watched (the monitor's own).
    assert rules[0] == {"action": "keep", "source_labels": ["__meta_kubernetes_namespace"], "regex": "(ns)"}
    assert rules[1] == {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}
    assert rules[2] == {
        "action": "drop",
        "source_labels": ["__meta_kubernetes_pod_phase"],
        "regex": "(Failed|Succeeded)",
    }
    any_ns = _job(_pod_monitor({"namespaceSelector": {"any": True}, "podMetricsEndpoints": [{"port": "m"}]}))
    assert _rules(any_ns)[0]["source_labels"] == ["job"]
    no_filter = _job(_pod_monitor({"podMetricsEndpoints": [{"port": "m", "filterRunning": False}]}))
    assert "__meta_kubernetes_pod_phase" not in json.dumps(no_filter)


def test_port_then_port_number_then_target_port() -> None:
    def port_rules(ep: dict[str, Any]) -> list[dict[str, Any]]:
        rules = _rules(_job(_pod_monitor({"podMetricsEndpoints": [ep]})))
        return [r for r in rules if "__meta_kubernetes_pod_container_port" in str(r.get("source_labels"))] + [
            r for r in rules if r.get("target_label") == "endpoint"
        ]

    by_name = port_rules({"port": "metrics", "portNumber": 8080})
    assert by_name == [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics"},
        {"target_label": "endpoint", "replacement": "metrics"},
    ]
    # portNumber keeps by number and sets no endpoint label.
    assert port_rules({"portNumber": 8080}) == [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": 8080}
    ]
    assert port_rules({"targetPort": 9090}) == [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": 9090},
        {"target_label": "endpoint", "replacement": "9090"},
    ]
    assert port_rules({"targetPort": "web"})[0]["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]


def test_user_relabelings_follow_the_operators_and_precede_sharding() -> None:
    ep = {
        "port": "m",
        "interval": "15s",
        "relabelings": [{"sourceLabels": ["a"], "targetLabel": "b", "action": "Replace"}],
        "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "x_.*", "action": "drop"}],
    }
    job = _job(_pod_monitor({"podTargetLabels": ["ray.io/group"], "podMetricsEndpoints": [ep]}))
    rules = _rules(job)
    targets = [r.get("target_label") for r in rules]
    user = rules.index({"source_labels": ["a"], "target_label": "b", "action": "replace"})
    for operators in ("namespace", "container", "pod", "ray_io_group", "job", "endpoint"):
        assert targets.index(operators) < user, operators
    assert rules[targets.index("ray_io_group")] == {
        "source_labels": ["__meta_kubernetes_pod_label_ray_io_group"],
        "target_label": "ray_io_group",
        "regex": "(.+)",
        "replacement": "${1}",
    }
    assert rules[targets.index("job")] == {"target_label": "job", "replacement": "ns/m"}
    # Then the sharding rules, with the one shard's index for $(SHARD).
    assert rules[user + 1 :] == [
        {
            "source_labels": ["__address__", "__tmp_hash"],
            "target_label": "__tmp_hash",
            "regex": "(.+);",
            "replacement": "$1",
            "action": "replace",
        },
        {"source_labels": ["__tmp_hash"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
        {"source_labels": ["__tmp_hash", "__tmp_disable_sharding"], "regex": "0;|.+;.+", "action": "keep"},
    ]
    assert job["metric_relabel_configs"] == [{"source_labels": ["__name__"], "regex": "x_.*", "action": "drop"}]
    assert list(job)[:4] == ["job_name", "honor_labels", "file_sd_configs", "scrape_interval"]
    assert job["file_sd_configs"] == [{"files": [str(Path("/sd") / po.SD_POD_FILE)]}]
    assert job["honor_labels"] is False and "honor_timestamps" not in job


def test_jobs_are_ordered_as_the_operator_orders_them() -> None:
    def service_monitor(name: str) -> dict[str, Any]:
        spec = {"selector": {}, "endpoints": [{"port": "a"}]}
        return {"kind": "ServiceMonitor", "metadata": {"name": name, "namespace": "ns"}, "spec": spec}

    two = {"podMetricsEndpoints": [{"port": "a"}, {"port": "b"}]}
    monitors = [
        _pod_monitor(two, "z"),
        _pod_monitor(two, "a", "other"),
        service_monitor("s"),
        {"kind": "Probe", "metadata": {"name": "p", "namespace": "ns"}, "spec": {}},
    ]
    names = [j["job_name"] for j in po.scrape_jobs(monitors, Path("/sd"))]
    assert names == [
        "serviceMonitor/ns/s/0",
        "podMonitor/ns/z/0",
        "podMonitor/ns/z/1",
        "podMonitor/other/a/0",
        "podMonitor/other/a/1",
    ]


def test_a_service_monitor_selects_on_service_labels_and_names_the_job_after_the_service() -> None:
    monitor = {
        "kind": "ServiceMonitor",
        "metadata": {"name": "sm", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetLabels": ["team"], "endpoints": [{"port": "web"}]},
    }
    job = _job(monitor)
    rules = _rules(job)
    assert job["file_sd_configs"] == [{"files": [str(Path("/sd") / po.SD_ENDPOINTS_FILE)]}]
    assert {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_service_label_app", "__meta_kubernetes_service_labelpresent_app"],
        "regex": "(x);true",
    } in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": "web"} in rules
    assert {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"} in rules
    targets = [r.get("target_label") for r in rules]
    # The phase drop comes after the naming rules here, unlike a PodMonitor's.
    phase = next(i for i, r in enumerate(rules) if r.get("source_labels") == ["__meta_kubernetes_pod_phase"])
    assert targets.index("container") < phase < targets.index("team")


def test_a_field_the_port_does_not_generate_is_refused() -> None:
    with pytest.raises(po.UnsupportedMonitorError, match="tlsConfig"):
        po.scrape_jobs([_pod_monitor({"podMetricsEndpoints": [{"port": "m", "tlsConfig": {}}]})], Path("/sd"))
    with pytest.raises(po.UnsupportedMonitorError, match="RoleSelector"):
        spec = {"selectorMechanism": "RoleSelector", "podMetricsEndpoints": [{"port": "m"}]}
        po.scrape_jobs([_pod_monitor(spec)], Path("/sd"))


def test_the_stacks_monitors_generate_without_refusal() -> None:
    for stack in STACKS:
        monitors = copy.deepcopy(_ray_monitors(stack))
        assert po.scrape_jobs(monitors, Path("/sd"))


def test_sd_files_are_replaced_whole(tmp_path: Path) -> None:
    po.write_sd_files(tmp_path, [{"targets": ["127.0.0.1:1"], "labels": {"a": "b"}}])
    assert json.loads((tmp_path / po.SD_POD_FILE).read_text()) == [{"labels": {"a": "b"}, "targets": ["127.0.0.1:1"]}]
    assert json.loads((tmp_path / po.SD_ENDPOINTS_FILE).read_text()) == []
    po.write_sd_files(tmp_path, [])
    assert json.loads((tmp_path / po.SD_POD_FILE).read_text()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [po.SD_ENDPOINTS_FILE, po.SD_POD_FILE]
