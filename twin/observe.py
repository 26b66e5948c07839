"""Observability of one RayService's twin: a real Prometheus scrapes its live processes and runs the rendered rules.

The scrape jobs are the ones the Prometheus Operator generates from the
rendered PodMonitors (twin.prometheus_operator). Each live process of the
local cluster becomes the file-SD target its pod's port would be in the
cluster: the pod is built by the KubeRay mirror (twin.kuberay), so the
labels Prometheus selects and relabels on are the ones KubeRay would set.

Then, one PASS/FAIL line each:

* series: every metric a rule, an alert or a dashboard panel reads that this
  layout's exporters emit has a live series (metrics of exporters that can
  not run here are listed with the reason);
* steady state: under normal load no alert fires;
* faults: each serving alert that can fire here fires on its own fault
  (an overload that fills the queue and the KV cache, a replica's server
  killed, an engine that dies under load);
* panels: every dashboard query whose exporters run here returns data.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.serving import alerts, dashboards
from localserve.traffic import StreamLoad, abandon_all
from twin import kuberay as mirror
from twin import live, metrics_endpoint, prometheus_operator
from twin.cluster import FAKE_HEAD_NODE_ID, LOOPBACK, LocalCluster
from twin.prometheus import (
    SCRAPE_INTERVAL,
    TwinPrometheus,
    as_duration,
    duration_s,
    longest_window_s,
    rule_groups,
)
from twin.render import RayServiceSpec
from twin.report import Report

TARGETS_EVERY_S = 2.0
# A gauge every serving vLLM replica exports (after the vllm-servers rename), and how long a model
# at zero may take to wake under normal load before the series and panels are read.
SERVING_GAUGE = "ray_vllm_num_requests_running"
WAKE_TIMEOUT_S = 180.0
RECONCILE_EVERY_S = 2.0
SERIES_RETRY_S = 15.0
SERIES_LOOKBACK = "30s"
STEADY_STREAMS = 2
# Steady state lasts past the longest scaled `for` of the serving alerts, so
# an alert whose condition held from the start would have fired.
STEADY_MARGIN_S = 10.0
# A fault's alert may take its scaled `for`, plus this, to fire: the
# condition needs a few scrapes, and the rule a few evaluations, to hold.
FIRE_SLACK_S = 60.0
# The overload's alerts wait for its streams to fill the KV cache first. When
# each stream's client built its own TLS context, dev's last stream started
# 84-105 s in and KvCacheNearlyFull fired 120-180 s into the fault; with one
# shared context (localserve.traffic) the streams start in seconds and all four
# alerts fired within 36 s on an idle machine. In CI-style runs dev's
# LlmRequestsWaiting was slower: pending from 101 s (fired at 115 s of a 135 s
# limit) in one, not firing within 135 s in another, where the KV cache was full
# from 16 s; vLLM's queue stays near the threshold when the ingress, on the same
# two cores, forwards fewer than the replica's cap (longer answers through the
# ingress, OVERLOAD_MAX_TOKENS_INGRESS, now keep it above). Prod's overload
# alerts fired 17-23 s in on the CI runs on record, but 99 and 177 s in on two
# runs of one afternoon with the same code and the same engine throughput
# (17 requests a second), and in later runs KvCacheNearlyFull did not fire
# within 255 s or 435 s: the replica's KV cache usage swung between 0 and 1.0
# under the overload while it held 40-55 requests waiting, and the alert then
# needed 15 s of scrapes above 0.9. Neither whole answers nor the clients in
# processes of their own held it there. The alert now reads each minute's
# peak (alerts.KV_CACHE_PEAK; the twin's window is 30 s) and fired 28 s in.
# The margin covers the slowest overload alert on record (115 s), and costs
# nothing when the alerts are quick.
OVERLOAD_FILL_S = 180.0
# How long the overload's clients may take to drop their streams once its alerts fired.
ABANDON_TIMEOUT_S = 10.0
SETTLE_S = 8.0
# A serving replica's gauges are in Prometheus by its first scrapes (check_scrape waited for the targets
# to be up); a model at zero takes a cold start, tens of seconds, to export them.
WARM_WITHIN_S = 2 * duration_s(SCRAPE_INTERVAL)
# Each fault starts from quiet: its alerts (and those that must stay quiet
# through it) neither pending nor firing, else a "fired" could be the
# previous fault's. The windows are scaled to 30 s (twin.prometheus), so a
# previous fault's series leave them within this.
QUIET_TIMEOUT_S = 120.0
# An alert's activeAt is an evaluation's time: it may lead the fault's start
# (taken just before the fault) by up to one evaluation interval.
PENDING_SLACK_S = 1.5

# Exporters that do not run in the twin, by metric prefix, and why.
ABSENT_HERE: dict[str, str] = {
    "DCGM_FI_": "no GPU here for NVIDIA's DCGM exporter to read",
    "kube_": "no Kubernetes API server here for kube-state-metrics to read",
    "cluster_autoscaler_": "no node groups here for cluster-autoscaler to report",
    "keda_": "the KEDA operator does not run here (the batch queue runs in its own e2e test)",
    "llm_gateway_": (
        "the monitoring run sends no request through a model gateway (tests/test_gateway.py reads the gateway's "
        "own exposition for the names and labels its alerts read)"
    ),
    "vllm_router_": (
        "the monitoring run's Prometheus scrapes the Ray pods' monitors, and the routers run here as processes, "
        "not pods a PodMonitor selects (tests/test_serving_router.py reads the pinned router's own exposition)"
    ),
}


def absent_reason(metric: str) -> str | None:
    """Why ``metric``'s exporter does not run in the twin; None when it does."""
    return next((why for prefix, why in ABSENT_HERE.items() if metric.startswith(prefix)), None)


def _family(metric: str) -> alerts.MetricFamily:
    return next(f for f in alerts.METRIC_INVENTORY if metric in f.names)


# The capacity plan's recorded figures read no exporter metric.
_RECORDED = (
    {r.record: r.metrics for r in alerts.RECORDING_RULES}
    | {name: () for name in alerts.PLAN_RECORDS}
    | dict(alerts.PER_MODEL_RECORDS)
)


def inventory_metrics(names: Iterable[str]) -> set[str]:
    """Exporter metrics behind ``names`` (recording rules expanded, through each other, to what they read)."""
    out: set[str] = set()
    for name in names:
        behind = _RECORDED.get(name)
        out |= {name} if behind is None else inventory_metrics(behind)
    return out


def metrics_read() -> set[str]:
    """Every exporter metric a recording rule, an alert or a dashboard panel reads."""
    names: set[str] = set(dashboards.DASHBOARD_METRICS)
    for rule in alerts.RECORDING_RULES:
        names |= inventory_metrics(rule.metrics)
    for alert in alerts.ALERTS:
        names |= inventory_metrics(alert.metrics)
    return names


def expected_here(layouts: set[str]) -> tuple[set[str], dict[str, str]]:
    """(metrics a twin of these layouts must show, metric -> why it can not show the others)."""
    want: set[str] = set()
    absent: dict[str, str] = {}
    for metric in sorted(metrics_read()):
        why = absent_reason(metric)
        family = _family(metric)
        if why is not None:
            absent[metric] = why
        elif layouts & set(family.layouts):
            want.add(metric)
        else:
            absent[metric] = f"only the {'/'.join(family.layouts)} layout emits it"
    return want, absent


# The fault each serving alert fires on; every alert is here or can not fire in the twin.
OVERLOAD = "overload"
KILL_SERVER = "kill-server"
ENGINE_DEATH = "engine-death"
UPGRADE_STUCK = "upgrade-stuck"
NOT_READY = "not-ready"
FAULT_OF: dict[str, str] = {
    "LlmTimeToFirstTokenHigh": OVERLOAD,
    "LlmRequestsWaiting": OVERLOAD,
    "LlmKvCacheNearlyFull": OVERLOAD,
    "LlmRequestsPreempted": OVERLOAD,
    "RayServeReplicaUnhealthy": KILL_SERVER,
    "LlmHttp5xxRatioHigh": ENGINE_DEATH,
    "RayServiceUpgradeStuck": UPGRADE_STUCK,
    "RayServiceNotReady": NOT_READY,
}
# Not-ready last: it freezes every server the serve Service selects.
FAULTS = (OVERLOAD, KILL_SERVER, ENGINE_DEATH, UPGRADE_STUCK, NOT_READY)
# Alerts that must stay quiet through a fault (the old cluster keeps serving while an upgrade is stuck).
QUIET_DURING: dict[str, tuple[str, ...]] = {UPGRADE_STUCK: ("RayServiceNotReady",)}
# Faults a layout can not show, and why (one line in the report).
FAULT_NOT_IN_LAYOUT: dict[tuple[str, str], str] = {
    (ENGINE_DEATH, "vllm-server"): (
        "vLLM's own server answers its in-flight requests 500 and exits when its engine dies "
        "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH unset), so its new 5xx counter is gone before a second scrape and "
        "rate() never sees it; the death pages as RayServeReplicaUnhealthy (fault kill-server)"
    ),
}


# Alerts that compare the live replicas with the capacity plan's figures for the stack's GPUs, and why
# the twin's replicas can not be held to them.
PLANNED_FOR_GPUS: dict[str, str] = {
    "LlmRunningAbovePreemptionFree": (
        "its threshold is the capacity plan's preemption-free load of a GPU replica's KV cache, recorded only for "
        "a model whose workload allows preemption; the twin's stacks keep every model within its plan, and the "
        "tiny model's few-MiB KV cache is not the cache that load was planned for"
    ),
}


def alert_absent_reason(alert: alerts.AlertSpec) -> str | None:
    """Why ``alert`` can not fire in the twin (an exporter it reads is absent, or it holds the replicas to
    figures planned for the stack's GPUs); None when it can."""
    if alert.name in PLANNED_FOR_GPUS:
        return PLANNED_FOR_GPUS[alert.name]
    for metric in sorted(inventory_metrics(alert.metrics)):
        why = absent_reason(metric)
        if why is not None:
            return f"reads {metric}: {why}"
    return None


# --- targets ---------------------------------------------------------------


@dataclass
class LiveTargets:
    """Writes the file-SD targets of a RayService's live twin processes, as their pods' ports, every few seconds."""

    service: RayServiceSpec
    cluster: LocalCluster
    sd_dir: Path
    address_dirs: list[Path]
    # Head-only metrics endpoints: port name -> the live port (the autoscaler's, the dashboard's).
    head_ports: dict[str, int] = field(default_factory=dict)
    # The KubeRay operator's Service, its pod, and the live port of the exporter that stands in for it.
    operator: tuple[dict[str, Any], dict[str, Any], int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _index: dict[str, int] = field(default_factory=dict)
    written: int = 0

    @property
    def ray_service(self) -> dict[str, Any]:
        """The RayService object as rendered."""
        return {
            "apiVersion": "ray.io/v1",
            "kind": "RayService",
            "metadata": self.service.metadata,
            "spec": self.service.spec,
        }

    @property
    def active(self) -> mirror.RayClusterRef:
        """The RayService's active RayCluster, as the mirror names it."""
        return mirror.RayClusterRef(mirror.ray_cluster_name(self.ray_service, "twin0"), self.ray_service)

    def probes(self) -> list[tuple[str, int]]:
        """The readiness probes of the pods the serve Service selects: (port name, live port).

        The probe is the rendered one: a vllm-server pod's server answers
        ``/health`` on ``openai``; otherwise its Serve proxy ``/-/healthz`` on ``serve``.
        """
        selector = mirror.first_serve_service(self.active)["spec"].get("selector") or {}
        found = []
        for pod, ports in self.pods():
            if mirror.selects(selector, pod["metadata"]["labels"]):
                name = "openai" if "openai" in ports else "serve"
                if name in ports:
                    found.append((name, ports[name]))
        return found

    def serve_endpoints(self) -> int:
        """``NumServeEndpoints``: pods the serve Service selects whose readiness probe passes now."""
        return sum(
            live.server_health(f"http://{LOOPBACK}:{port}") if name == "openai" else live.healthz(port)
            for name, port in self.probes()
        )

    def probe_ports(self) -> list[int]:
        """The live ports the serve Service's readiness probes ask."""
        return [port for _, port in self.probes()]

    def pods(self) -> list[tuple[dict[str, Any], dict[str, int]]]:
        """(pod as KubeRay builds it, port name -> live port) for every live node."""
        import ray

        cluster = self.active
        groups = {str(g["groupName"]): g for g in self.service.worker_groups()}
        by_node: dict[str, list[dict[str, Any]]] = {}
        for replica in live.replica_addresses(self.address_dirs):
            by_node.setdefault(str(replica.get("node_id")), []).append(replica)
        proxies = self.cluster.proxy_ports()
        out = []
        # Typed here: Ray's own function is not annotated.
        gcs_nodes: Callable[[], list[dict[str, Any]]] = ray.nodes
        for info in gcs_nodes():
            if not info.get("Alive"):
                continue
            node_id = str(info["NodeID"])
            ports: dict[str, int] = {"metrics": int(info.get("MetricsExportPort") or 0)}
            if node_id == FAKE_HEAD_NODE_ID:
                pod = mirror.build_pod(cluster, self.service.cluster["headGroupSpec"], mirror.HEAD)
                ports.update(self.head_ports)
                ports["serve"] = self.cluster.head_proxy_port
            else:
                group = str(proxies.get(node_id, {}).get("node_type", ""))
                if group not in groups:
                    continue  # still starting: the provider has not named it yet
                index = self._index.setdefault(node_id, sum(1 for k in self._index if k != node_id))
                pod = mirror.build_pod(cluster, groups[group], mirror.WORKER, index)
                ports["serve"] = int(proxies.get(node_id, {}).get("proxy_port") or 0)
            for replica in by_node.get(node_id, []):
                ports["openai"] = _port_of(str(replica.get("url", "")))
                ports["vllm-metrics"] = _port_of(str(replica.get("metrics_url", "")))
            out.append((pod, {k: v for k, v in ports.items() if v}))
        return out

    def write(self) -> int:
        """Writes the current targets; returns how many."""
        groups: list[dict[str, Any]] = []
        for pod, ports in self.pods():

            def address_of(_container: str, port: Mapping[str, Any], ports: dict[str, int] = ports) -> str | None:
                live_port = ports.get(str(port.get("name", "")))
                return f"127.0.0.1:{live_port}" if live_port else None

            groups += prometheus_operator.pod_targets(pod, address_of)
        endpoints: list[dict[str, Any]] = []
        if self.operator is not None:
            service, pod, port = self.operator

            def operator_address(_container: str, spec: Mapping[str, Any]) -> str | None:
                return f"{LOOPBACK}:{port}" if spec.get("name") == "http" else None

            endpoints = prometheus_operator.endpoint_targets(service, [pod], operator_address)
        prometheus_operator.write_sd_files(self.sd_dir, groups, endpoints)
        self.written = len(groups)
        return self.written

    def _run(self) -> None:
        while not self._stop.wait(TARGETS_EVERY_S):
            with contextlib.suppress(Exception):  # a node going away mid-read; the next round sees it
                self.write()

    def start(self) -> None:
        """Writes once, then keeps the targets current in a thread."""
        self.write()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


class OperatorExporter:
    """Stands in for the KubeRay operator's ``/metrics``: what it would export for the twin's RayService.

    The RayService's status is the mirror's (twin.kuberay): Ready from the
    live readiness of the pods the serve Service selects, UpgradeInProgress
    from a NewCluster upgrade the mirror plays. The metric lines are
    ``RayServiceMetricsManager``'s, from that status.

    As the operator does, the status is reconciled in a loop and ``/metrics``
    serves the last one, so a scrape never waits on a probe of a frozen pod.
    The endpoint runs in a process of its own (twin.metrics_endpoint), as the
    operator runs in a pod of its own: served from this process, which also
    runs the load's clients, scrapes timed out under the overload.
    """

    def __init__(self, targets: LiveTargets) -> None:
        self.targets = targets
        self.pending = ""
        self.upgrade: mirror.NewClusterUpgrade | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="twin-operator-"))
        self._file = self._dir / "metrics"
        self._endpoint = subprocess.Popen(
            [sys.executable, str(Path(metrics_endpoint.__file__)), str(self._file), LOOPBACK],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._endpoint.stdout is not None
        first = self._endpoint.stdout.readline().strip()
        if not first.isdigit():
            self._endpoint.kill()
            raise RuntimeError(f"the operator's /metrics endpoint did not start (it printed {first!r})")
        self.port = int(first)
        self._endpoints = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reconciler = threading.Thread(target=self._reconcile, daemon=True)

    def _reconcile(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a node going away mid-read; the next round sees it
                self._endpoints = self.targets.serve_endpoints()
                self._publish()
            if self._stop.wait(RECONCILE_EVERY_S):
                return

    def _publish(self) -> None:
        """Writes the exposition of the current status where the endpoint reads it, whole or not at all."""
        with self._lock:
            written = self._file.with_suffix(".new")
            written.write_text(self.metrics())
            os.replace(written, self._file)

    def conditions(self) -> dict[str, bool]:
        """The RayService's conditions as last reconciled."""
        return mirror.ray_service_conditions(
            active=self.targets.active.name, pending=self.pending, serve_endpoints=self._endpoints
        )

    def metrics(self) -> str:
        """The exposition the operator's ``/metrics`` would serve for this RayService."""
        metadata = {**self.targets.service.metadata, "uid": "twin"}
        return "\n".join(mirror.ray_service_metrics(metadata, self.conditions())) + "\n"

    def start_stuck_upgrade(self) -> str:
        """A NewCluster upgrade to an image whose Serve apps never become RUNNING; returns what happened."""
        from twin.day2 import with_image

        rs = self.targets.ray_service
        upgrade = mirror.NewClusterUpgrade(
            rs, with_image(rs), self.targets.active, mirror.first_serve_service(self.targets.active)
        )
        if not upgrade.needed:
            return "an image change started no new cluster"
        self.pending = upgrade.start("stuck").name
        # The new image's apps fail to deploy: KubeRay keeps the pending cluster and never switches.
        upgrade.switch({"app": "DEPLOY_FAILED"})
        self.upgrade = upgrade
        self._publish()
        return f"pending RayCluster {self.pending}: {upgrade.events[-1].phase} ({upgrade.events[-1].detail})"

    def end_upgrade(self) -> None:
        """The user rolls the spec back: KubeRay deletes the pending cluster."""
        self.pending = ""
        self.upgrade = None
        self._publish()

    def start(self) -> None:
        """Reconciles once, then keeps reconciling in a thread; the endpoint serves each result."""
        with contextlib.suppress(Exception):
            self._endpoints = self.targets.serve_endpoints()
        self._publish()
        self._reconciler.start()

    def stop(self) -> None:
        """Stops reconciling and serving."""
        self._stop.set()
        if self._reconciler.is_alive():
            self._reconciler.join(timeout=30)
        self._endpoint.terminate()
        try:
            self._endpoint.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._endpoint.kill()
            self._endpoint.wait()
        if self._endpoint.stdout is not None:
            self._endpoint.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def listening_pids(port: int) -> set[int]:
    """The processes with a socket listening on TCP ``port`` (from /proc, as ``ss -ltnp`` reads it)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{inode}]")
    pids: set[int] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                pids.add(int(fd_dir.parent.name))
    return pids


def _port_of(url: str) -> int:
    match = re.match(r"https?://[^/:]+:(\d+)", url)
    return int(match.group(1)) if match else 0


# --- the checks -------------------------------------------------------------


@dataclass
class Traffic:
    """Where and how the twin sends requests to one model of the RayService."""

    model_id: str
    api_key: str
    # OpenAI base URLs: the serve Service's endpoint (serve-ingress), or each replica's server (vllm-server).
    base_urls: Callable[[], list[str]]
    # The processes a fault kills: the replica's server (pid) per base URL (vllm-server) or the replica actors.
    server_pids: Callable[[], list[int]]
    # The twin's other clients' keys, and the guard's in-flight caps (inference_server.fairness): per key,
    # and per replica. The overload sends from as many keys as its streams need, up to the replica's cap.
    client_keys: list[str] = field(default_factory=list)
    per_key_cap: int = 1
    replica_cap: int = 1


def series_query(metric: str) -> str:
    """The query that finds ``metric`` live: a sample within SERIES_LOOKBACK, in any series."""
    return f"count(last_over_time({metric}[{SERIES_LOOKBACK}]))"


def check_series(name: str, prom: TwinPrometheus, report: Report, layouts: set[str]) -> None:
    """Every metric read by a rule, alert or panel that this layout's exporters emit has a live series."""
    want, absent = expected_here(layouts)
    # One scrape that failed (a target starved by the overload this runs under) marks its series stale
    # until the next one, so a metric counts as live if it had a sample in the last SERIES_LOOKBACK; one
    # that has none is read again for a few scrapes before it counts as missing. A dev run's overload
    # left the KubeRay operator stand-in unscraped for 6-12 s at a time, and the check, reading the
    # instant's series for 15 s, found none of its series.
    missing = sorted(want)
    deadline = time.monotonic() + SERIES_RETRY_S
    while True:
        missing = [m for m in missing if not prom.query(series_query(m))]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(duration_s(SCRAPE_INTERVAL))
    report.check(
        name,
        not missing,
        f"series: all {len(want)} metrics the rules, alerts and panels read from exporters running here have "
        "live series"
        if not missing
        else f"series: no live series for {', '.join(missing)}",
    )
    by_reason: dict[str, list[str]] = {}
    for metric, why in absent.items():
        by_reason.setdefault(why, []).append(metric)
    for why, metrics in sorted(by_reason.items()):
        report.note(name, f"series not expected here ({why}): {', '.join(sorted(metrics))}")


def check_per_model_records(name: str, prom: TwinPrometheus, report: Report, objects: list[dict[str, Any]]) -> None:
    """Each per-model series the render records (alerts.PER_MODEL_RECORDS) has a series for its model.

    Their selectors name things the render can only spell out, not read back
    (Serve's deployment of a serve-ingress model); a selector that matched no
    series would leave LlmRequestsWaiting blind to Serve's queue.
    """
    wanted = sorted(
        {
            (str(rule["record"]), str(rule["labels"]["model_name"]))
            for group in rule_groups(objects)
            for rule in group["rules"]
            if rule.get("record") in alerts.PER_MODEL_RECORDS
        }
    )
    if not wanted:
        return
    missing = [
        f"{record} of {model}" for record, model in wanted if not prom.query(f'{record}{{model_name="{model}"}}')
    ]
    report.check(
        name,
        not missing,
        f"per-model series: {', '.join(sorted({r for r, _ in wanted}))} recorded for "
        f"{', '.join(sorted({m for _, m in wanted}))} from Serve's handles"
        if not missing
        else f"per-model series: nothing recorded for {', '.join(missing)} (the rule's selector matches no series)",
    )


def check_steady(name: str, prom: TwinPrometheus, report: Report, load: StreamLoad, hold_s: float) -> None:
    """Under normal load for ``hold_s``, no alert fires."""
    seen: dict[str, str] = {}
    started = time.monotonic()
    deadline = started + hold_s
    while time.monotonic() < deadline:
        for alert in prom.alerts():
            if alert.state == "firing":
                seen.setdefault(
                    alert.name, f"{alert.name} {alert.labels} at {alert.value} {time.monotonic() - started:.0f}s in"
                )
        time.sleep(1.0)
    served = sum(o.ok for o in load.done())
    failed = sum(not o.ok for o in load.done())
    report.check(
        name,
        not seen and failed == 0,
        f"steady state: no alert fired in {hold_s:.0f}s of normal load ({served} requests served, {failed} failed)"
        if not seen and failed == 0
        else f"steady state: firing {'; '.join(seen[a] for a in sorted(seen))} ({served} requests served, "
        f"{failed} failed{load.last_error()})",
    )


@dataclass(frozen=True)
class Fired:
    """When an alert fired, and when it began pending, in seconds from the fault's start."""

    after_s: float
    pending_from_s: float


def _epoch(rfc3339: str) -> float:
    """Prometheus' ``activeAt`` (nanoseconds, ``Z``) as a Unix time."""
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339.replace("Z", "+00:00"))
    return datetime.datetime.fromisoformat(stamp).timestamp()


def wait_firing(
    prom: TwinPrometheus, wanted: Iterable[str], timeout_s: float, began: tuple[float, float] | None = None
) -> dict[str, Fired]:
    """Alert name -> when it fired and began pending, for each of ``wanted`` that fired within ``timeout_s``.

    Times count from ``began`` (``time.monotonic()``, ``time.time()``) when the
    fault began before the call: the overload's many client threads take the
    GIL from the thread that starts them, so its last stream may start many
    seconds after its first.
    """
    started, wall = began if began is not None else (time.monotonic(), time.time())
    # The wait itself is ``timeout_s`` from now: a slow start must not eat the alert's time.
    deadline = time.monotonic() + timeout_s
    fired: dict[str, Fired] = {}
    pending = set(wanted)
    while pending and time.monotonic() < deadline:
        for name, instances in prom.firing().items():
            if name in pending:
                active = min((_epoch(a.active_at) for a in instances if a.active_at), default=wall)
                fired[name] = Fired(time.monotonic() - started, active - wall)
                pending.discard(name)
        time.sleep(0.5)
    return fired


def wait_quiet(prom: TwinPrometheus, names: Iterable[str], timeout_s: float) -> tuple[list[str], float]:
    """Waits until none of ``names`` is pending or firing: those still active after ``timeout_s``, and the wait."""
    started = time.monotonic()
    wanted = set(names)
    while True:
        active = sorted({a.name for a in prom.alerts()} & wanted)
        waited = time.monotonic() - started
        if not active or waited >= timeout_s:
            return active, waited
        time.sleep(1.0)


def fire_timeout(fault: str, fors: Mapping[str, float]) -> float:
    """How long ``fault``'s alerts may take to fire: the longest scaled `for`, the slack, and the overload's fill."""
    return max(fors.values()) + FIRE_SLACK_S + (OVERLOAD_FILL_S if fault == OVERLOAD else 0.0)


def report_fault(
    name: str,
    report: Report,
    fault: str,
    what: str,
    fired: Mapping[str, Fired],
    fors: Mapping[str, float],
    extra: str = "",
) -> None:
    """One line per alert the fault must fire, and only from pending it began during the fault."""
    for alert, scaled in sorted(fors.items()):
        took = fired.get(alert)
        if took is None:
            report.fail(
                name,
                f"alert {alert}: did not fire within {fire_timeout(fault, fors):.0f}s of fault {fault} ({what}){extra}",
            )
            continue
        during = took.pending_from_s >= -PENDING_SLACK_S
        report.check(
            name,
            during,
            f"alert {alert}: fired {took.after_s:.0f}s into fault {fault}, pending from {took.pending_from_s:.0f}s "
            f"({what}; `for` scaled to {as_duration(scaled)}){extra}"
            if during
            else f"alert {alert}: was already pending {-took.pending_from_s:.0f}s before fault {fault} began, so its "
            f"firing is not this fault's ({what}){extra}",
        )


def check_panels(name: str, prom: TwinPrometheus, report: Report, layouts: set[str]) -> None:
    """Every dashboard query whose exporters run here returns data."""
    empty: list[str] = []
    checked = 0
    skipped: list[str] = []
    for board in (dashboards.serving_dashboard(), dashboards.gpu_dashboard()):
        built = board.build()
        for panel in built.panels or []:
            for target in getattr(panel, "targets", None) or []:
                expr = str(getattr(target, "expr", ""))
                reads = {m for m in alerts.KNOWN_METRICS | set(_RECORDED) if re.search(rf"\b{re.escape(m)}\b", expr)}
                absent = sorted(m for m in inventory_metrics(reads) if absent_reason(m))
                title = str(getattr(panel, "title", "?"))
                if absent:
                    skipped.append(title)
                    continue
                checked += 1
                if not prom.query(expr):
                    empty.append(f"{title}: {expr}")
    report.check(
        name,
        not empty and checked > 0,
        f"panels: all {checked} queries of the dashboards' panels whose exporters run here return data"
        if not empty
        else f"panels: no data for {'; '.join(empty)}",
    )
    if skipped:
        report.note(name, f"panels without an exporter here (no GPU): {', '.join(sorted(set(skipped)))}")


# What runs the model under a replica: vLLM's engine-core process (its own server, vllm-server), or
# under Serve LLM, which forces vLLM's Ray executor, the engine's worker actor (not the replica's child).
ENGINE_PROCESSES = (b"VLLM::EngineCore", b"ray::RayWorkerWrapper")
ENGINE_WAIT_S = 90.0


def kill_engine_core(server_pid: int) -> int | None:
    """Kills the vLLM engine process that serves the replica ``server_pid``; returns its pid.

    First the engine core among its descendants; else (Serve LLM) a live Ray worker actor of vLLM's
    executor: the twin runs one model, so any such actor is this replica's.
    """
    from localserve.processes import with_descendants

    candidates = sorted(with_descendants({server_pid}) - {server_pid})
    candidates += sorted(int(p.name) for p in Path("/proc").glob("[0-9]*") if int(p.name) not in candidates)
    for prefix in ENGINE_PROCESSES:
        for pid in candidates:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prefix):
                    if prefix == ENGINE_PROCESSES[0] and pid not in with_descendants({server_pid}):
                        continue
                    os.kill(pid, signal.SIGKILL)
                    return pid
    return None


def kill_engine_when_quiet(
    obs: Observed, prom: TwinPrometheus, report: Report, wanted: list[str]
) -> tuple[int | None, list[str]]:
    """Under the engine-death fault's load: once a replica serves and ``wanted`` are quiet, kills its engine.

    In dev the previous fault's replicas may be going away as this load begins: Serve scales a model
    with no load for its downscale delay to zero. In a CI run this load met a replica Serve was
    stopping, and the 5xx alert was pending 20 s before the engine died, so its firing was not the
    engine's. Returns the engine's pid (None when none ran) and the alerts still pending or firing
    after QUIET_TIMEOUT_S, in which case the engine is left alone.
    """
    wait_serving(obs, prom, report)
    active, _ = wait_quiet(prom, wanted, QUIET_TIMEOUT_S)
    if active:
        return None, active
    return engine_death(obs.traffic), []


def engine_death(traffic: Traffic) -> int | None:
    """Kills a serving replica's engine once one runs (a model at zero wakes under the load first)."""
    deadline = time.monotonic() + ENGINE_WAIT_S
    while time.monotonic() < deadline:
        for pid in reversed(traffic.server_pids()):
            engine = kill_engine_core(pid)
            if engine is not None:
                return engine
        time.sleep(2.0)
    return None


# --- the run ----------------------------------------------------------------

# An overload: many streams of long prompts, to one replica. The twin's KV
# cache (twin.deploy.TWIN_KV_CACHE_BYTES) holds about 10 such sequences, far
# fewer than this sends, so requests queue and running ones are preempted.
# About 300 prompt tokens of the tiny model plus the answer fit its 512-token
# context. Sent straight to a replica's own server (vllm-server), every
# stream reaches vLLM: the guard lets the replica hold them all. Through
# serve-ingress's ingress, which shares the two cores with the engine and the
# clients and forwards requests no faster than it can, each request must stay
# at the engine longer: with 96-token answers a dev run's
# queue hovered between 20 and 36 (the alert's threshold is 20) and
# LlmRequestsWaiting pended 129 s into a CI run's overload; with 176 it
# fired 43 s and 53 s in. Straight to a replica the answers stay at 96, the
# length prod's overload alerts fired on 17-23 s in on the CI runs on record
# (one prod run with 176 was no quicker: KvCacheNearlyFull pended 146 s in).
OVERLOAD_STREAMS = 160
OVERLOAD_MAX_TOKENS = 96
OVERLOAD_MAX_TOKENS_INGRESS = 176
OVERLOAD_PROMPT = " ".join(["Ray Serve scales replicas up and down with the number of ongoing requests."] * 10)
# Long enough that the steady load's two streams keep a request at the
# model replica most of the time. Serve's autoscaler counts the requests a
# handle has at its replicas from samples a few seconds apart
# (ray/serve/_private/router.py, `_add_autoscaling_metrics_point`). With
# 16-token answers each took the tiny model about 33 ms, so two streams 0.2 s
# apart had one in flight about a quarter of the time; in a CI run's steady
# state Serve decided on "Current ongoing requests: 0.00" while the replica
# answered 7 requests a second, scaled dev's one replica to zero after the
# twin's 15 s downscale delay, and the stopping replica (health 0) and its
# draining proxy failed the steady state.
STEADY_MAX_TOKENS = 64


@dataclass
class Observed:
    """What one RayService's observability run needs from its live session."""

    name: str
    service: RayServiceSpec
    cluster: LocalCluster
    layouts: set[str]
    traffic: Traffic
    address_dirs: list[Path]
    head_ports: dict[str, int]
    workdir: Path
    objects: list[dict[str, Any]]


def _fors(prom: TwinPrometheus, names: Iterable[str]) -> dict[str, float]:
    """Alert name -> its `for` in seconds, as the twin's Prometheus runs it (scaled by rule_groups)."""
    scaled = {
        rule["alert"]: duration_s(rule["for"])
        for group in rule_groups(prom.objects, prom.factor)
        for rule in group["rules"]
        if "alert" in rule
    }
    return {n: scaled[n] for n in names}


def check_scrape(obs: Observed, prom: TwinPrometheus, report: Report, timeout_s: float = 20.0) -> None:
    """Each generated job keeps targets, and they are up: the monitors select the pods KubeRay builds."""
    jobs = [j["job_name"] for j in prom.jobs()]
    up: dict[str, list[str]] = {}

    def scraped() -> bool:
        up.clear()
        for target in prom.targets().get("activeTargets") or []:
            labels = target.get("labels") or {}
            if target.get("health") == "up":
                up.setdefault(str(target.get("scrapePool")), []).append(
                    f"{labels.get('container')}/{labels.get('endpoint')}"
                )
        return all(job in up for job in jobs if _job_applies(job, obs))

    live.wait_for(scraped, timeout_s)
    for job in jobs:
        if not _job_applies(job, obs):
            continue
        found = up.get(job, [])
        report.check(
            obs.name,
            bool(found),
            f"scrape: {job} keeps {len(found)} live targets, all up ({', '.join(sorted(set(found)))})"
            if found
            else f"scrape: {job} keeps no live target: its selector or port matches no pod KubeRay builds here",
        )


def _job_applies(job: str, obs: Observed) -> bool:
    """The vllm-servers monitor selects only RayServices in the vllm-server layout."""
    return alerts.VLLM_SERVER_MONITOR not in job or "vllm-server" in obs.layouts


def _steady_load(obs: Observed, base_url: str) -> StreamLoad:
    return StreamLoad(
        base_url=base_url,
        api_key=obs.traffic.api_key,
        streams=STEADY_STREAMS,
        think_s=0.2,
        max_tokens=STEADY_MAX_TOKENS,
        model=obs.traffic.model_id,
        timeout_s=60,
    )


def _quiet(prom: TwinPrometheus, alerts_: Iterable[str]) -> list[str]:
    firing = set(prom.firing())
    return sorted(a for a in alerts_ if a in firing)


def run_operator_fault(
    obs: Observed, prom: TwinPrometheus, report: Report, fault: str, operator: OperatorExporter | None
) -> None:
    """The RayService faults: an upgrade that can not finish, and a serve Service with no ready endpoint."""
    wanted = [a for a, f in FAULT_OF.items() if f == fault]
    if operator is None:
        report.fail(obs.name, f"fault {fault}: the render has no KubeRay operator ServiceMonitor to scrape")
        return
    fors = _fors(prom, wanted)
    timeout = fire_timeout(fault, fors)
    quiet = QUIET_DURING.get(fault, ())
    if fault == UPGRADE_STUCK:
        what = operator.start_stuck_upgrade()
        fired = wait_firing(prom, wanted, timeout)
        loud = _quiet(prom, quiet)
        operator.end_upgrade()
        report_fault(obs.name, report, fault, what, fired, fors)
        report.check(
            obs.name,
            not loud,
            f"alert {', '.join(quiet)}: quiet while the upgrade is stuck (the active cluster keeps serving)"
            if not loud
            else f"alert {', '.join(loud)}: fired while the active cluster still served",
        )
        return
    ports = operator.targets.probe_ports()
    frozen = sorted(set().union(*(listening_pids(p) for p in ports))) if ports else []
    if not frozen:
        report.fail(obs.name, f"fault {fault}: no process answers the serve Service's readiness probes")
        return
    for pid in frozen:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    try:
        fired = wait_firing(prom, wanted, timeout)
    finally:
        for pid in frozen:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
    what = f"SIGSTOP of the {len(frozen)} processes answering the serve Service's readiness probes"
    report_fault(obs.name, report, fault, what, fired, fors)


def overload(traffic: Traffic, base_url: str, *, through_ingress: bool) -> list[StreamLoad]:
    """The overload fault's clients: as many streams as the replica may hold, each key within its own cap.

    More would only be refused with 429 by the guard (inference_server.fairness) and spin on two cores.
    Through serve-ingress's ingress the answers are longer (OVERLOAD_MAX_TOKENS_INGRESS).
    """
    streams = min(OVERLOAD_STREAMS, traffic.replica_cap)
    keys = traffic.client_keys[: -(-streams // max(traffic.per_key_cap, 1))]
    loads = []
    for index, key in enumerate(keys):
        share = streams // len(keys) + (index < streams % len(keys))
        loads.append(
            StreamLoad(
                base_url=base_url,
                api_key=key,
                streams=min(share, traffic.per_key_cap),
                max_tokens=OVERLOAD_MAX_TOKENS_INGRESS if through_ingress else OVERLOAD_MAX_TOKENS,
                prompt=OVERLOAD_PROMPT,
                distinct=True,
                model=traffic.model_id,
                timeout_s=300,
            )
        )
    return loads


def run_faults(
    obs: Observed,
    prom: TwinPrometheus,
    report: Report,
    operator: OperatorExporter | None = None,
    during_overload: Callable[[], None] | None = None,
) -> None:
    """Each fault, and the alerts it must fire; alerts that can not fire here say why.

    ``during_overload`` runs once the overload's alerts fired, before its load stops.
    """
    for spec in alerts.ALERTS:
        why = alert_absent_reason(spec)
        if why is not None:
            report.note(obs.name, f"alert {spec.name}: can not fire here, {why}; its promtool cases fire it")
    for fault in FAULTS:
        wanted = [a for a, f in FAULT_OF.items() if f == fault]
        skipped = [
            FAULT_NOT_IN_LAYOUT[(fault, layout)] for layout in obs.layouts if (fault, layout) in FAULT_NOT_IN_LAYOUT
        ]
        if skipped:
            for alert in wanted:
                report.note(obs.name, f"alert {alert}: fault {fault} not run in this layout: {skipped[0]}")
            continue
        active, waited = wait_quiet(prom, [*wanted, *QUIET_DURING.get(fault, ())], QUIET_TIMEOUT_S)
        if active:
            report.fail(
                obs.name,
                f"fault {fault}: not run, {', '.join(active)} still pending or firing {waited:.0f}s after the "
                "previous fault, so a firing could not be told from the previous fault's",
            )
            continue
        if waited >= SETTLE_S:
            report.note(obs.name, f"fault {fault}: began once its alerts were quiet, {waited:.0f}s after the previous")
        if fault in (UPGRADE_STUCK, NOT_READY):
            run_operator_fault(obs, prom, report, fault, operator)
            if fault != FAULTS[-1]:  # the next fault's start from quiet; after the last, nothing follows
                time.sleep(SETTLE_S)
            continue
        fors = _fors(prom, wanted)
        timeout = fire_timeout(fault, fors)
        urls = obs.traffic.base_urls()
        if fault == OVERLOAD:
            began = (time.monotonic(), time.time())
            # observed() sends to a vllm-server model's replicas when the service has one.
            loads = overload(obs.traffic, urls[0], through_ingress="vllm-server" not in obs.layouts)
            for load in loads:
                load.start()
            fired = wait_firing(prom, wanted, timeout, began)
            if during_overload is not None:
                during_overload()
            abandon_all(loads, timeout_s=ABANDON_TIMEOUT_S)
            streams = sum(load.streams for load in loads)
            what = (
                f"{streams} streams of long prompts to one replica from {len(loads)} keys (the guard lets one "
                f"replica hold {obs.traffic.replica_cap}, one key {obs.traffic.per_key_cap})"
            )
            done = [o for load in loads for o in load.done()]
            errors = next((e for load in loads if (e := load.last_error())), "")
            extra = f"; {sum(o.ok for o in done)} served, {sum(not o.ok for o in done)} failed{errors}"
            report_fault(obs.name, report, fault, what, fired, fors, extra=extra)
        elif fault == KILL_SERVER:
            pids = obs.traffic.server_pids()
            if not pids:
                report.fail(obs.name, f"fault {fault}: no replica server to kill")
                continue
            with contextlib.suppress(OSError):
                os.kill(pids[0], signal.SIGKILL)
            fired = wait_firing(prom, wanted, timeout)
            report_fault(obs.name, report, fault, f"SIGKILL of replica server pid {pids[0]}", fired, fors)
        else:
            load = _steady_load(obs, urls[-1])
            load.start()
            engine, active = kill_engine_when_quiet(obs, prom, report, wanted)
            if active:
                load.stop(timeout_s=1)
                report.fail(
                    obs.name,
                    f"fault {fault}: not run, {', '.join(active)} still pending or firing {QUIET_TIMEOUT_S:.0f}s "
                    "into its load, so a firing could not be told from the engine's death",
                )
                continue
            fired = wait_firing(prom, wanted, timeout) if engine else {}
            load.stop(timeout_s=1)
            failed = sum(not o.ok for o in load.done())
            report_fault(
                obs.name,
                report,
                fault,
                f"SIGKILL of the vLLM engine core pid {engine} under load",
                fired,
                fors,
                extra=f"; {failed} requests failed",
            )
        time.sleep(SETTLE_S)


def run(obs: Observed, report: Report, *, faults: bool) -> None:
    """Prometheus on the live session: scrape, series, steady state, faults (when asked), panels."""
    prom = TwinPrometheus(obs.workdir, obs.objects)
    for line in prom.substitutions():
        report.sub(obs.name, line)
    prom.start()
    targets = LiveTargets(obs.service, obs.cluster, prom.sd_dir, obs.address_dirs, obs.head_ports)
    operator = _operator(obs.objects, targets)
    load = _steady_load(obs, obs.traffic.base_urls()[0])
    try:
        if operator is not None:
            operator.start()
        targets.start()
        load.start()
        check_scrape(obs, prom, report)
        # Steady state begins once a replica serves: a model at zero (dev) first wakes under the load,
        # and its first requests wait for the cold start, which is not the steady state. They carry it
        # into a rule's rate window for a whole window (a dev CI run's p95 time to first token passed the
        # SLO for the scaled `for` right after a wake), so then it begins once every window has passed.
        # A replica that already served when the load began (prod's; a model the live checks woke) has
        # no cold start in any window: Prometheus started after those requests, and a rate sees only
        # what a counter gained between its own scrapes.
        windows = max(SETTLE_S, longest_window_s(rule_groups(obs.objects)))
        wait_serving(obs, prom, report, after_wake_s=windows)
        serving = [a.name for a in alerts.ALERTS if alert_absent_reason(a) is None]
        hold = max(_fors(prom, serving).values()) + STEADY_MARGIN_S
        check_steady(obs.name, prom, report, load, hold)
        load.stop(timeout_s=30)

        # Series and panels are read under the overload, once its alerts fired:
        # a counter exported through Ray's metrics agent (vLLM's preemptions
        # under serve-ingress) has no series until its first increment, which
        # only the overload brings, and a later fault's restart (kill-server,
        # engine-death) starts a replica without it; a replica serves then, so
        # every gauge is exported too. Without faults, under normal load once
        # a replica serves (a model at zero exports no gauge).
        read: list[bool] = []

        def read_series_and_panels() -> None:
            check_series(obs.name, prom, report, obs.layouts)
            check_per_model_records(obs.name, prom, report, obs.objects)
            check_panels(obs.name, prom, report, obs.layouts)
            read.append(True)

        if faults:
            run_faults(obs, prom, report, operator, during_overload=read_series_and_panels)
        if not read:  # no faults, or the overload did not run
            load = _steady_load(obs, obs.traffic.base_urls()[0])
            load.start()
            wait_serving(obs, prom, report)
            read_series_and_panels()
            load.stop(timeout_s=30)
        bad = prom.rule_health()
        report.check(
            obs.name,
            not bad,
            "rules: Prometheus evaluated every rendered rule without an error"
            if not bad
            else f"rules: evaluation errors: {'; '.join(bad)}",
        )
    finally:
        load.stop(timeout_s=5)
        targets.stop()
        if operator is not None:
            operator.stop()
        prom.stop()


def wait_serving(
    obs: Observed,
    prom: TwinPrometheus,
    report: Report,
    settle_s: float = SETTLE_S,
    *,
    after_wake_s: float | None = None,
) -> None:
    """Waits (under the caller's load) until a replica exports its gauges, then ``settle_s`` more.

    ``after_wake_s``: the settle instead when a replica had to wake for the load (its gauges were not
    there within WARM_WITHIN_S), so that the cold start's requests have left every rate window.
    """
    started = time.monotonic()
    woke = live.wait_for(lambda: bool(prom.query(f"count({SERVING_GAUGE}) > 0")), WAKE_TIMEOUT_S)
    if not woke:
        report.note(obs.name, f"no replica exported {SERVING_GAUGE} within {WAKE_TIMEOUT_S:.0f}s of normal load")
        return
    warm = time.monotonic() - started <= WARM_WITHIN_S
    time.sleep(settle_s if after_wake_s is None or warm else after_wake_s)


def _operator(objects: list[dict[str, Any]], targets: LiveTargets) -> OperatorExporter | None:
    """The exporter for the KubeRay operator's pod (the chart's, twin.prometheus.load_objects) and its Service."""
    pods = [o for o in objects if o.get("kind") == "Pod"]
    for service in (o for o in objects if o.get("kind") == "Service"):
        selector = (service.get("spec") or {}).get("selector") or {}
        pod = next((p for p in pods if selector and mirror.selects(selector, p["metadata"].get("labels") or {})), None)
        if pod is not None:
            exporter = OperatorExporter(targets)
            targets.operator = (service, pod, exporter.port)
            return exporter
    return None
