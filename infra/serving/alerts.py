"""`ServingAlerts`: the serving PrometheusRule and the PodMonitors that feed it.

Three tables, and everything else derives from them:
- `METRIC_INVENTORY`: every exporter metric this platform may read, grouped by
  the exporter that emits it;
- `RECORDING_RULES`: the series the dashboards plot and the alerts compare;
- `ALERTS`: the alerts, one `AlertSpec` each.
One set of rules reads both serving layouts: under vllm-server each
replica's vLLM registry is scraped directly (`vllm_server_pod_monitor`), and
that PodMonitor renames vLLM's `vllm:` series to the `ray_vllm_` names Ray's
metrics agent gives them under serve-ingress.
The PrometheusRule is rendered from the last two; the tests hold every
expression to the inventory, every alert to a `promtool test rules` case that
fires it, and the alert table in docs/operations.md to `ALERTS`. Adding an alert is one
`AlertSpec` here, its case in `tests/rules/serving-alerts.yaml` and its
runbook, `docs/runbooks/<AlertName>.md`, which the alert's `runbook_url`
annotation names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pulumi
import pulumi_kubernetes as k8s

from infra.aws.queue import queue_names
from infra.config import PULUMI_WAIT_BIG_SECONDS, Slo
from infra.serving import kuberay
from infra.serving.batch import WORKER_NAME as BATCH_SCALED_OBJECT
from infra.serving.namespace import PART_OF
from infra.serving.ports import RAY_PORTS
from infra.serving.ray_service import SERVICE_LABEL
from infra.serving.router import ROUTER_OF
from workloads.inference_server.catalog import Layout

PROMETHEUS_RULE_TYPE = "kubernetes:monitoring.coreos.com/v1:PrometheusRule"
POD_MONITOR_TYPE = "kubernetes:monitoring.coreos.com/v1:PodMonitor"
RULE_NAME = "llm-serving"
RECORDING_GROUP = "llm-serving.recording"
RECORDING_INTERVAL = "30s"
ALERT_GROUP = "llm-serving.alerts"
HEADROOM_POD_PATTERN = "gpu-headroom-.*"

# Below this utilisation (percent) a GPU counts as idle.
GPU_IDLE_UTIL_PERCENT = 5
# Container restarts within CRASH_LOOP_WINDOW that make a crash loop.
CRASH_LOOP_RESTARTS = 3
CRASH_LOOP_WINDOW = "15m"
# An upgrade still in progress after the longest wait a deploy allows
# (a big model's RayService timeout) is stuck.
UPGRADE_STUCK_MINUTES = PULUMI_WAIT_BIG_SECONDS // 60
# KEDA names an aws-sqs-queue trigger's metric `s<index>-aws-sqs-<queue name>`;
# the dead-letter queue's name ends the same way in every cluster.
DEAD_LETTER_QUEUE_SUFFIX = queue_names("")[1]
DEAD_LETTER_METRIC = f"s[0-9]+-aws-sqs-.+{DEAD_LETTER_QUEUE_SUFFIX}"


def target_label_name(label: str) -> str:
    """The label a monitor's `podTargetLabels` entry gives its series: every character but `[a-zA-Z0-9_]`
    becomes `_` (the Prometheus Operator's sanitizeLabelName; twin/prometheus_operator.py mirrors it)."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in label)


# The RayService a router routes for, on each of its series (the router's PodMonitor copies its pod label).
ROUTER_OF_LABEL = target_label_name(ROUTER_OF)
# vllm-router's `error_type` for an attempt no replica could take: every circuit open, or none known.
ROUTER_NO_WORKER_ERROR = "no_available_workers"
# vllm-router's `outcome` for an attempt a replica failed (5xx, or no answer) on vllm_router_cb_outcomes_total.
ROUTER_FAILED_ATTEMPT = "failure"
# The replicas a model's routers may send to (the most any of its router pods knows): what
# LlmRouterHasNoReplica and LlmRouterCircuitsOpen compare and the serving dashboard draws.
ROUTER_REPLICAS = f"max by (namespace, {ROUTER_OF_LABEL}) (vllm_router_active_workers)"
# A model's routers' attempts to its replicas a second, and the share of them that failed: what
# LlmRouterAttemptsFailing judges and the serving dashboard draws.
ROUTER_ATTEMPTS_RATE = f"sum by (namespace, {ROUTER_OF_LABEL}) (rate(vllm_router_cb_outcomes_total[5m]))"
ROUTER_FAILED_ATTEMPTS_RATIO = (
    f"sum by (namespace, {ROUTER_OF_LABEL}) (\n"
    f'  rate(vllm_router_cb_outcomes_total{{outcome="{ROUTER_FAILED_ATTEMPT}"}}[5m])\n'
    f") / {ROUTER_ATTEMPTS_RATE}"
)

# Every alert's runbook, in this repository: <RUNBOOK_DIR>/<AlertName>.md.
RUNBOOK_DIR = "docs/runbooks"


def runbook_url(alert: str, base_url: str | None = None) -> str:
    """Where an alert's runbook opens: under `observability.runbook_base_url` (where the team serves
    docs/runbooks/), else the page's path in the repository, which an operator can still find."""
    return f"{(base_url or RUNBOOK_DIR).rstrip('/')}/{alert}.md"


@dataclass(frozen=True)
class MetricFamily:
    """The metric names one exporter emits that this platform reads."""

    exporter: str
    prefix: str
    names: tuple[str, ...]
    # The serving layouts whose pods emit these (a Serve proxy counts HTTP
    # requests only where requests pass through it).
    layouts: tuple[Layout, ...] = ("serve-ingress", "vllm-server")


# Versions are the ones pinned in infra/versions.py. Counters carry
# Prometheus' `_total`, histograms are read through `_bucket`.
METRIC_INVENTORY: tuple[MetricFamily, ...] = (
    # vLLM's engine metrics under Ray Serve LLM: Ray's metrics agent (port
    # `metrics` on every Ray pod) exports vLLM's `vllm:` series as `ray_vllm_`.
    # Labels: model_name, ReplicaId, engine. Under vllm-server the same
    # series come from vLLM's own registry (port `vllm-metrics`), renamed to
    # these names at scrape (VLLM_RENAME); labels model_name, engine, and
    # `application` (the RayService) from the PodMonitor.
    MetricFamily(
        exporter="vLLM through Ray's metrics agent",
        prefix="ray_vllm_",
        names=(
            "ray_vllm_time_to_first_token_seconds_bucket",
            "ray_vllm_inter_token_latency_seconds_bucket",
            "ray_vllm_e2e_request_latency_seconds_bucket",
            "ray_vllm_generation_tokens_total",
            "ray_vllm_prompt_tokens_total",
            "ray_vllm_request_success_total",
            "ray_vllm_num_requests_waiting",
            "ray_vllm_num_requests_running",
            "ray_vllm_kv_cache_usage_perc",
            "ray_vllm_num_preemptions_total",
        ),
    ),
    # Ray Serve's own metrics, from the same metrics agent. Labels:
    # application, deployment (HTTP: route, method, status_code). The
    # controller reports every replica's health in both layouts; only the
    # proxies of the serve-ingress layout see HTTP requests.
    MetricFamily(
        exporter="Ray Serve through Ray's metrics agent",
        prefix="ray_serve_",
        names=("ray_serve_deployment_replica_healthy",),
    ),
    # Under serve-ingress a model's requests wait for a replica slot (its
    # max_ongoing_requests) in the ingress' handle, where vLLM does not see
    # them: Serve's router counts them per handle. Labels: application,
    # deployment, handle. Under vllm-server the guard refuses past the cap
    # (429) and nothing waits in Serve.
    MetricFamily(
        exporter="Ray Serve's deployment handles through Ray's metrics agent",
        prefix="ray_serve_",
        names=("ray_serve_deployment_queued_queries",),
        layouts=("serve-ingress",),
    ),
    MetricFamily(
        exporter="Ray Serve's HTTP proxies through Ray's metrics agent",
        prefix="ray_serve_",
        names=("ray_serve_num_http_requests_total", "ray_serve_num_http_error_requests_total"),
        layouts=("serve-ingress",),
    ),
    # vLLM's OpenAI server's HTTP metrics (prometheus-fastapi-instrumentator,
    # on the `vllm-metrics` port under vllm-server, where no Serve proxy
    # counts requests). Labels: handler, method, status ("2xx", "4xx",
    # "5xx"); the PodMonitor adds namespace and application. /health and
    # /metrics are not counted.
    MetricFamily(
        exporter="vLLM's OpenAI server (vllm-server layout)",
        prefix="http_",
        names=("http_requests_total",),
        layouts=("vllm-server",),
    ),
    # The model gateway (serving.gateway; workloads/inference_server/gateway.py), on its
    # `gateway-metrics` port through its PodMonitor. Labels: model (the request's, "" before one
    # is known: 401, 404), code (the HTTP status answered); the PodMonitor adds namespace and pod.
    # Only stacks with the gateway on have these series.
    MetricFamily(
        exporter="the model gateway",
        prefix="llm_gateway_",
        names=("llm_gateway_requests_total", "llm_gateway_upstream_failures_total", "llm_gateway_held_requests"),
        layouts=("vllm-server",),
    ),
    # vllm-router (serving.routing), on its `router-metrics` port through its PodMonitor: its own
    # registry. `vllm_router_active_workers` is the replicas it may send to (its discovery's Ready pods);
    # `vllm_router_request_errors_total{route, error_type}` counts failed attempts, `error_type`
    # "no_available_workers" when no replica could be tried (every one's circuit open, or none known).
    # `vllm_router_cb_outcomes_total{worker, outcome}` counts every attempt sent to a replica, `outcome`
    # "failure" for a 5xx answer or none (refused, reset, timed out), "success" for any other, 4xx and
    # 429 included; the pinned release counts it with the circuit breaker off too.
    # The PodMonitor adds namespace, pod and the RayService it routes for (ROUTER_OF_LABEL).
    MetricFamily(
        exporter="vllm-router",
        prefix="vllm_router_",
        names=("vllm_router_active_workers", "vllm_router_request_errors_total", "vllm_router_cb_outcomes_total"),
        layouts=("vllm-server",),
    ),
    # The KubeRay operator's metrics endpoint (chart `metrics.enabled`, its
    # ServiceMonitor with honorLabels): RayService conditions. Labels: name,
    # namespace (the RayService's), condition ("true"/"false"), value 1.
    MetricFamily(
        exporter="KubeRay operator",
        prefix="kuberay_",
        names=("kuberay_service_condition_ready", "kuberay_service_condition_upgrade_in_progress"),
    ),
    # NVIDIA's DCGM exporter (deployed by the GPU Operator). Labels: Hostname,
    # gpu, UUID, modelName, and the pod holding the GPU (`pod` or `exported_pod`).
    MetricFamily(
        exporter="DCGM exporter",
        prefix="DCGM_FI_",
        names=(
            "DCGM_FI_DEV_GPU_UTIL",
            "DCGM_FI_DEV_FB_USED",
            "DCGM_FI_DEV_FB_FREE",
            "DCGM_FI_DEV_XID_ERRORS",
            "DCGM_FI_DEV_POWER_USAGE",
        ),
    ),
    # kube-state-metrics (kube-prometheus-stack); extended resources appear
    # with `.` and `/` turned into `_`, e.g. `nvidia_com_gpu`. Container
    # series carry namespace, pod, container; the last termination's reason
    # is a `reason` label (value 1).
    MetricFamily(
        exporter="kube-state-metrics",
        prefix="kube_",
        names=(
            "kube_pod_status_phase",
            "kube_pod_container_resource_requests",
            "kube_pod_container_status_restarts_total",
            "kube_pod_container_status_last_terminated_reason",
        ),
    ),
    # cluster-autoscaler's per-node-group gauges (`--emit-per-nodegroup-metrics`).
    MetricFamily(
        exporter="cluster-autoscaler",
        prefix="cluster_autoscaler_",
        names=("cluster_autoscaler_node_group_target_count", "cluster_autoscaler_node_group_max_count"),
    ),
    # The KEDA operator (chart `prometheus.operator`, its ServiceMonitor):
    # the last reading of every trigger of every ScaledObject. Labels:
    # scaledObject, scaler, triggerIndex, metric (the trigger's metric name);
    # the ScaledObject's namespace arrives as `exported_namespace`. The batch
    # ScaledObject's dead-letter trigger reports that queue's depth.
    MetricFamily(
        exporter="KEDA operator",
        prefix="keda_",
        names=("keda_scaler_metrics_value",),
    ),
)
KNOWN_METRICS: frozenset[str] = frozenset(name for family in METRIC_INVENTORY for name in family.names)


@dataclass(frozen=True, kw_only=True)
class RecordingRule:
    """A recorded series; `metrics` are the inventory names its expression reads."""

    record: str
    expr: str
    metrics: tuple[str, ...]

    def rule(self) -> dict[str, Any]:
        return {"record": self.record, "expr": self.expr}


# Recording rules: what the dashboards plot and the alerts compare.
TTFT_P95 = "llm:time_to_first_token_seconds:p95"
ITL_P95 = "llm:inter_token_latency_seconds:p95"
GENERATION_TOKENS_RATE = "llm:generation_tokens:rate5m"
PROMPT_TOKENS_RATE = "llm:prompt_tokens:rate5m"
# Requests waiting for a slot: in vLLM's queue and, under serve-ingress, in Serve's handles before it.
REQUESTS_WAITING = "llm:requests_waiting:sum"
# The queue over the last minute, every scrape of it, summed over the replicas (LlmRequestsWaiting).
REQUESTS_WAITING_AVG = "llm:requests_waiting:avg_over_time1m"
# A serve-ingress model's requests queued in Serve's handles (`serve_queue_rules`, one per model: the
# handles' series name the deployment, not the model).
SERVE_QUEUED = "llm:serve_queued_requests:sum"
SERVE_QUEUED_AVG = "llm:serve_queued_requests:avg_over_time1m"
SERVE_QUEUE_METRIC = "ray_serve_deployment_queued_queries"
REQUESTS_RUNNING = "llm:requests_running:sum"
REQUESTS_RUNNING_MAX = "llm:requests_running:max"
KV_CACHE_USAGE = "llm:kv_cache_usage:max"
# The fullest replica's highest reading in the last minute, every scrape of it (LlmKvCacheNearlyFull).
KV_CACHE_PEAK = "llm:kv_cache_usage:max_over_time1m"
PREEMPTIONS_RATE = "llm:preemptions:rate5m"
HTTP_REQUESTS_RATE = "llm:http_requests:rate5m"
HTTP_5XX_RATIO = "llm:http_5xx_ratio:rate5m"
GPU_UTIL_ALLOCATED = "llm:gpu_util_allocated:percent"
# The capacity plan's preemption-free load of a model (infra/capacity/workload.py): the sequences its
# replica runs at once with every one at the workload's p95. A constant per model, recorded only for a
# model whose workload allows preemption (`plan_rules`): any other keeps max_num_seqs at or below it, so
# its replicas never run more.
PREEMPTION_FREE = "llm:preemption_free_sequences:plan"
# Recorded series the capacity plan writes, with no exporter metric behind them.
PLAN_RECORDS = frozenset({PREEMPTION_FREE})
# Recorded series written per model by the render, each from the one exporter metric named.
PER_MODEL_RECORDS: Mapping[str, tuple[str, ...]] = {
    SERVE_QUEUED: (SERVE_QUEUE_METRIC,),
    SERVE_QUEUED_AVG: (SERVE_QUEUE_METRIC,),
}


def _with_serve_queue(vllm: str, serve: str) -> str:
    """vLLM's queue plus Serve's, per model; either alone where the other has no series (vllm-server
    models have no Serve queue; a serve-ingress model at zero has no engine while its first requests wait)."""
    return f"{vllm} + on (model_name) {serve}\nor {vllm}\nor {serve}"


# The share of a model's gateway requests that failed between the gateway and the model's router.
GATEWAY_FAILURE_RATIO = (
    "sum by (namespace, model) (rate(llm_gateway_upstream_failures_total[5m]))\n"
    "/ sum by (namespace, model) (rate(llm_gateway_requests_total[5m]))"
)


def _ratio(part: str, whole: str) -> str:
    """`part / whole` per application, 0 (not absent) while `part` has no series: an application
    that never failed has no 5xx counter yet, and its panel should read 0, not "No data"."""
    by = "sum by (namespace, application)"
    return f"(({by} ({part}) or 0 * {by} ({whole})) / {by} ({whole}))"


RECORDING_RULES: tuple[RecordingRule, ...] = (
    RecordingRule(
        record=TTFT_P95,
        expr="histogram_quantile(0.95, sum by (model_name, le) "
        "(rate(ray_vllm_time_to_first_token_seconds_bucket[5m])))",
        metrics=("ray_vllm_time_to_first_token_seconds_bucket",),
    ),
    RecordingRule(
        record=ITL_P95,
        expr="histogram_quantile(0.95, sum by (model_name, le) "
        "(rate(ray_vllm_inter_token_latency_seconds_bucket[5m])))",
        metrics=("ray_vllm_inter_token_latency_seconds_bucket",),
    ),
    RecordingRule(
        record=GENERATION_TOKENS_RATE,
        expr="sum by (model_name) (rate(ray_vllm_generation_tokens_total[5m]))",
        metrics=("ray_vllm_generation_tokens_total",),
    ),
    RecordingRule(
        record=PROMPT_TOKENS_RATE,
        expr="sum by (model_name) (rate(ray_vllm_prompt_tokens_total[5m]))",
        metrics=("ray_vllm_prompt_tokens_total",),
    ),
    RecordingRule(
        record=REQUESTS_WAITING,
        expr=_with_serve_queue("sum by (model_name) (ray_vllm_num_requests_waiting)", SERVE_QUEUED),
        metrics=("ray_vllm_num_requests_waiting", SERVE_QUEUED),
    ),
    RecordingRule(
        record=REQUESTS_WAITING_AVG,
        expr=_with_serve_queue(
            "sum by (model_name) (avg_over_time(ray_vllm_num_requests_waiting[1m]))", SERVE_QUEUED_AVG
        ),
        metrics=("ray_vllm_num_requests_waiting", SERVE_QUEUED_AVG),
    ),
    RecordingRule(
        record=REQUESTS_RUNNING,
        expr="sum by (model_name) (ray_vllm_num_requests_running)",
        metrics=("ray_vllm_num_requests_running",),
    ),
    # The busiest replica (engine) of each model, against the plan's per-replica figures.
    RecordingRule(
        record=REQUESTS_RUNNING_MAX,
        expr="max by (model_name) (ray_vllm_num_requests_running)",
        metrics=("ray_vllm_num_requests_running",),
    ),
    RecordingRule(
        record=KV_CACHE_USAGE,
        expr="max by (model_name) (ray_vllm_kv_cache_usage_perc)",
        metrics=("ray_vllm_kv_cache_usage_perc",),
    ),
    RecordingRule(
        record=KV_CACHE_PEAK,
        expr="max by (model_name) (max_over_time(ray_vllm_kv_cache_usage_perc[1m]))",
        metrics=("ray_vllm_kv_cache_usage_perc",),
    ),
    RecordingRule(
        record=PREEMPTIONS_RATE,
        expr="sum by (model_name) (rate(ray_vllm_num_preemptions_total[5m]))",
        metrics=("ray_vllm_num_preemptions_total",),
    ),
    # Per application: Serve's proxies count a serve-ingress RayService's
    # requests, vLLM's own server a vllm-server one's (no proxy is in its
    # path); the two never name the same application at once, so `or` joins
    # them. `application!=""` keeps to the series the vllm-server PodMonitor
    # labelled: `http_requests_total` is a common name. On Serve's series it
    # leaves out the proxies' own health and route probes (`/-/healthz`,
    # `/-/routes`): the proxy counts them under no application, and answers
    # them 503 while it starts or drains (ray/serve/_private/proxy.py,
    # `_get_health_or_routes_reponse`), which is the load balancer taking a
    # node out, not a request failing. Counted, they made an alert with no
    # application each time a worker node joined or left.
    RecordingRule(
        record=HTTP_REQUESTS_RATE,
        expr='sum by (namespace, application) (rate(ray_serve_num_http_requests_total{application!=""}[5m]))'
        ' or sum by (namespace, application) (rate(http_requests_total{application!=""}[5m]))',
        metrics=("ray_serve_num_http_requests_total", "http_requests_total"),
    ),
    RecordingRule(
        record=HTTP_5XX_RATIO,
        expr=_ratio(
            'rate(ray_serve_num_http_requests_total{application!="", status_code=~"5.."}[5m])',
            'rate(ray_serve_num_http_requests_total{application!=""}[5m])',
        )
        + " or "
        + _ratio(
            'rate(http_requests_total{application!="", status="5xx"}[5m])',
            'rate(http_requests_total{application!=""}[5m])',
        ),
        metrics=("ray_serve_num_http_requests_total", "http_requests_total"),
    ),
    # The DCGM exporter labels a GPU held by a pod with that pod. Whether the
    # label arrives as `pod` or, under a ServiceMonitor without honorLabels,
    # as `exported_pod`, depends on the scrape; accept both.
    RecordingRule(
        record=GPU_UTIL_ALLOCATED,
        expr="max by (pod, Hostname, gpu) ("
        'label_replace(DCGM_FI_DEV_GPU_UTIL{exported_pod!=""}, "pod", "$1", "exported_pod", "(.+)")'
        ' or DCGM_FI_DEV_GPU_UTIL{pod!="", exported_pod="", container!="nvidia-dcgm-exporter"})',
        metrics=("DCGM_FI_DEV_GPU_UTIL",),
    ),
)


# How long a woken model may leave its requests held with none answered when the stack wakes no model
# (the rule is rendered in every stack; it then reads no series).
DEFAULT_WAKE_FOR_MINUTES = 15


def wake_for_minutes(cold_starts_s: Iterable[float]) -> int:
    """The `for` of LlmModelWakeStalled: the longest cold-start budget of the stack's woken models, in whole
    minutes (the figure `pulumi preview` prints for each), or DEFAULT_WAKE_FOR_MINUTES without one."""
    budgets = list(cold_starts_s)
    return max(1, math.ceil(max(budgets) / 60)) if budgets else DEFAULT_WAKE_FOR_MINUTES


@dataclass(frozen=True)
class RuleContext:
    """What an alert's thresholds, selectors and runbook link are filled from."""

    slo: Slo
    namespace: str
    runbook_base_url: str | None = None
    wake_for_minutes: int = DEFAULT_WAKE_FOR_MINUTES


# A rule field: fixed text, or text made from the stack's SLOs and namespace.
Text = str | Callable[[RuleContext], str]
Severity = Literal["critical", "warning", "info"]


def _text(value: Text, ctx: RuleContext) -> str:
    return value if isinstance(value, str) else value(ctx)


@dataclass(frozen=True, kw_only=True)
class AlertSpec:
    """One alert. `metrics` are the names its expression reads (inventory
    metrics or recording rules); `summary` and `description` are Prometheus
    templates; its runbook is `docs/runbooks/<name>.md`."""

    name: str
    expr: Text
    for_: Text
    severity: Severity
    summary: str
    description: Text
    metrics: tuple[str, ...]

    def rule(self, ctx: RuleContext) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": _text(self.expr, ctx),
            "for": _text(self.for_, ctx),
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": _text(self.description, ctx),
                # The annotation kube-prometheus' alerts use; Alertmanager
                # templates and Grafana link it.
                "runbook_url": runbook_url(self.name, ctx.runbook_base_url),
            },
        }


def _gpu_pods_pending_at_max(ctx: RuleContext) -> str:
    ns = ctx.namespace
    return (
        f'sum(\n  (kube_pod_status_phase{{namespace="{ns}", phase="Pending"}} == 1)\n'
        "  * on (namespace, pod) group_left ()\n"
        f'  (max by (namespace, pod) (kube_pod_container_resource_requests{{namespace="{ns}", '
        f'resource="nvidia_com_gpu", pod!~"{HEADROOM_POD_PATTERN}"}}) > 0)\n'
        ") > 0\n"
        "and on ()\n"
        "count(cluster_autoscaler_node_group_target_count >= cluster_autoscaler_node_group_max_count) > 0"
    )


def _upgrade_stuck(ctx: RuleContext) -> str:
    return f'kuberay_service_condition_upgrade_in_progress{{namespace="{ctx.namespace}", condition="true"}} == 1'


def _restarts(ctx: RuleContext) -> str:
    """Container restarts in the serving namespace over the crash-loop window, per container."""
    return (
        "max by (namespace, pod, container) (increase(kube_pod_container_status_restarts_total"
        f'{{namespace="{ctx.namespace}"}}[{CRASH_LOOP_WINDOW}]))'
    )


def _oom_killed(ctx: RuleContext) -> str:
    return (
        "max by (namespace, pod, container) (kube_pod_container_status_last_terminated_reason"
        f'{{namespace="{ctx.namespace}", reason="OOMKilled"}}) == 1\n'
        f"and on (namespace, pod, container)\n{_restarts(ctx)} > 0"
    )


# The serving alerts; thresholds from the config's SLOs. Each one needs a
# `promtool test rules` case in tests/rules/ that fires it and one that does not.
ALERTS: tuple[AlertSpec, ...] = (
    AlertSpec(
        name="LlmTimeToFirstTokenHigh",
        expr=lambda c: f"{TTFT_P95} > {c.slo.ttft_p95_seconds}",
        for_="10m",
        severity="warning",
        summary="Time to first token p95 of {{ $labels.model_name }} is over the SLO",
        description=lambda c: (
            f"p95 TTFT is {{{{ $value | humanizeDuration }}}} (SLO {c.slo.ttft_p95_seconds}s) for 10 minutes."
        ),
        metrics=(TTFT_P95,),
    ),
    # Each minute's mean queue. On the gauge itself, one evaluation without a reading above the
    # threshold restarted the 10 minutes: a trough (a saturated engine admits its queue in waves,
    # as sequences of like length finish together), or a scrape the overloaded server answered too
    # late, which leaves the series stale. In a prod twin run 64 streams held the replica for 255 s
    # (5,469 answers) and this alert never fired, while the alerts on windows fired within 30 s.
    # The mean rides over both, and unlike the peak does not fire on a queue that forms for a
    # moment once a minute. Under serve-ingress it counts Serve's queue too: the model's
    # max_ongoing_requests holds the rest back in the ingress' handle, and vLLM's own queue
    # never grew past that cap less what it runs (in a dev twin run it rose above 20 in 5 of 25
    # scrapes of a 255 s overload while Serve held 30-90 more, and the alert did not fire).
    AlertSpec(
        name="LlmRequestsWaiting",
        expr=lambda c: f"{REQUESTS_WAITING_AVG} > {c.slo.requests_waiting}",
        for_="10m",
        severity="warning",
        summary="Requests are queueing for {{ $labels.model_name }}",
        description=lambda c: (
            f"{{{{ $value }}}} requests waited for a slot on average (threshold {c.slo.requests_waiting}) in "
            "every minute for 10 minutes, in vLLM's queue or in Serve's before it: replicas are at their "
            "maximum or GPU nodes are not coming up."
        ),
        metrics=(REQUESTS_WAITING_AVG,),
    ),
    # Each minute's peak: a saturated engine's usage does not sit above the threshold, it swings as
    # sequences finish together and preempted ones free their blocks (the twin's replica, kept busy
    # by a queue of 40-55 requests, read above 0.9 in 24-30 of 41-53 one-second samples and never
    # 15 in a row), so on the gauge itself one low scrape restarted the 15 minutes and the alert
    # did not fire on a replica that filled its cache every few seconds.
    AlertSpec(
        name="LlmKvCacheNearlyFull",
        expr=lambda c: f"{KV_CACHE_PEAK} > {c.slo.kv_cache_usage}",
        for_="15m",
        severity="warning",
        summary="KV cache of {{ $labels.model_name }} is nearly full",
        description=lambda c: (
            f"KV cache usage reached {{{{ $value | humanizePercentage }}}} (threshold {c.slo.kv_cache_usage}) "
            "in every minute for 15 minutes: requests get preempted and latency climbs."
        ),
        metrics=(KV_CACHE_PEAK,),
    ),
    # The plan keeps a model's max_num_seqs within what its KV cache holds at the workload's p95, so a
    # preemption means requests run longer than the profile. A model that accepts preemption
    # (workload.allow_preemption) preempts by design above the plan's load: there only a preemption at
    # or below it counts, and LlmRunningAbovePreemptionFree reports the load itself.
    AlertSpec(
        name="LlmRequestsPreempted",
        expr=f"{PREEMPTIONS_RATE} > 0\nunless on (model_name)\n"
        f"(max_over_time({REQUESTS_RUNNING_MAX}[5m]) > on (model_name) {PREEMPTION_FREE})",
        for_="10m",
        severity="warning",
        summary="vLLM is preempting requests of {{ $labels.model_name }}",
        description="vLLM evicts running sequences from the KV cache ({{ $value | humanize }}/s) and recomputes "
        "them from the start when blocks free up: every preempted request pays its prefill again and latency "
        "climbs. The capacity plan holds the model's running sequences to what its KV cache keeps at the "
        "workload's p95, so requests are longer than the workload profile, or the cache smaller than planned. "
        "Measure the workload again, lower max_num_seqs, add replicas, or give the KV cache more memory.",
        metrics=(PREEMPTIONS_RATE, REQUESTS_RUNNING_MAX, PREEMPTION_FREE),
    ),
    AlertSpec(
        name="LlmRunningAbovePreemptionFree",
        expr=f"{REQUESTS_RUNNING_MAX} > on (model_name) {PREEMPTION_FREE}",
        for_="10m",
        severity="warning",
        summary="{{ $labels.model_name }} runs more sequences than its KV cache holds at the workload's p95",
        description="A replica runs {{ $value }} sequences at once, above the load the capacity plan found "
        "preemption-free at the model's workload profile (its workload allows preemption): long requests are "
        "preempted and recomputed. Add replicas, or lower max_num_seqs to the plan's figure.",
        metrics=(REQUESTS_RUNNING_MAX, PREEMPTION_FREE),
    ),
    AlertSpec(
        name="LlmHttp5xxRatioHigh",
        expr=lambda c: f"{HTTP_5XX_RATIO} > {c.slo.error_ratio} and {HTTP_REQUESTS_RATE} > 0.05",
        for_="5m",
        severity="critical",
        summary="Serve application {{ $labels.application }} answers with 5xx",
        description=lambda c: (
            f"{{{{ $value | humanizePercentage }}}} of requests fail with 5xx (SLO {c.slo.error_ratio})."
        ),
        metrics=(HTTP_5XX_RATIO, HTTP_REQUESTS_RATE),
    ),
    AlertSpec(
        name="RayServeReplicaUnhealthy",
        expr="count by (namespace, application, deployment) (ray_serve_deployment_replica_healthy == 0) > 0",
        for_="5m",
        severity="warning",
        summary="Serve deployment {{ $labels.application }}/{{ $labels.deployment }} has unhealthy replicas",
        description="{{ $value }} replicas fail their health checks for 5 minutes.",
        metrics=("ray_serve_deployment_replica_healthy",),
    ),
    AlertSpec(
        name="RayServiceNotReady",
        expr=lambda c: f'kuberay_service_condition_ready{{namespace="{c.namespace}", condition="false"}} == 1',
        for_="15m",
        severity="critical",
        summary="RayService {{ $labels.name }} is not ready",
        description="KubeRay reports the RayService not Ready for 15 minutes: its Serve applications are not serving.",
        metrics=("kuberay_service_condition_ready",),
    ),
    AlertSpec(
        name="GpuXidError",
        expr="max by (Hostname, gpu, modelName) (DCGM_FI_DEV_XID_ERRORS) > 0",
        for_="0m",
        severity="critical",
        summary="GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported XID {{ $value }}",
        description="The driver reported an XID error; check `nvidia-smi -q` and drain the node if it repeats.",
        metrics=("DCGM_FI_DEV_XID_ERRORS",),
    ),
    AlertSpec(
        name="GpuAllocatedButIdle",
        expr=f'{GPU_UTIL_ALLOCATED}{{pod!~"{HEADROOM_POD_PATTERN}"}} < {GPU_IDLE_UTIL_PERCENT}',
        for_=lambda c: f"{c.slo.gpu_idle_minutes}m",
        severity="info",
        summary="GPU held by {{ $labels.pod }} is idle",
        description=lambda c: (
            f"A GPU allocated to a pod stayed under {GPU_IDLE_UTIL_PERCENT}% utilisation for "
            f"{c.slo.gpu_idle_minutes} minutes: lower the model's min_replicas or check its traffic."
        ),
        metrics=(GPU_UTIL_ALLOCATED,),
    ),
    AlertSpec(
        name="GpuPodsPendingNodeGroupAtMax",
        expr=_gpu_pods_pending_at_max,
        for_="10m",
        severity="warning",
        summary="GPU pods are pending and a node group is at its maximum",
        description="Pods requesting GPUs have been Pending for 10 minutes while cluster-autoscaler has a node group "
        "at max_size: raise the group's max_size or lower the models' max_replicas.",
        metrics=(
            "kube_pod_status_phase",
            "kube_pod_container_resource_requests",
            "cluster_autoscaler_node_group_target_count",
            "cluster_autoscaler_node_group_max_count",
        ),
    ),
    AlertSpec(
        name="RayServiceUpgradeStuck",
        expr=_upgrade_stuck,
        for_=f"{UPGRADE_STUCK_MINUTES}m",
        severity="warning",
        summary=f"RayService {{{{ $labels.name }}}} has been upgrading for over {UPGRADE_STUCK_MINUTES} minutes",
        description="KubeRay's new cluster has not taken over: it holds a second fleet of GPUs beside the old one "
        "and the change is not serving. `make upgrade-status` names the phase and the likely cause "
        "(pending pods without GPUs, apps not RUNNING, a refused Service switch).",
        metrics=("kuberay_service_condition_upgrade_in_progress",),
    ),
    AlertSpec(
        name="LlmContainerCrashLooping",
        expr=lambda c: f"{_restarts(c)} >= {CRASH_LOOP_RESTARTS}",
        for_="5m",
        severity="warning",
        summary="Container {{ $labels.container }} of {{ $labels.pod }} keeps restarting",
        description=f"{{{{ $value }}}} restarts in {CRASH_LOOP_WINDOW}: the container crash-loops; "
        "check its previous logs (`kubectl logs --previous`).",
        metrics=("kube_pod_container_status_restarts_total",),
    ),
    AlertSpec(
        name="LlmContainerOomKilled",
        expr=_oom_killed,
        for_="0m",
        severity="warning",
        summary="Container {{ $labels.container }} of {{ $labels.pod }} was OOM-killed",
        description=f"The container restarted in the last {CRASH_LOOP_WINDOW} after running out of memory: "
        "raise its memory or lower what it holds (batch size, KV cache, max_model_len).",
        metrics=("kube_pod_container_status_last_terminated_reason", "kube_pod_container_status_restarts_total"),
    ),
    # The gateway could not get an answer from a model's router: no router pod reachable (its pods, the
    # policies between them), a connection cut mid-answer, or no first byte within its timeout. The
    # routers' and replicas' own 5xx are passed on and counted by LlmHttp5xxRatioHigh where they arise.
    AlertSpec(
        name="LlmGatewayUpstreamFailing",
        expr=lambda c: (
            f"{GATEWAY_FAILURE_RATIO} > {c.slo.error_ratio}\n"
            f"and on (namespace, model) sum by (namespace, model) (rate(llm_gateway_requests_total[5m])) > 0.05"
        ),
        for_="5m",
        severity="critical",
        summary="The model gateway can not reach the router of {{ $labels.model }}",
        description=lambda c: (
            "{{ $value | humanizePercentage }} of the gateway's requests for the model failed between it and the "
            f"model's router (SLO {c.slo.error_ratio}): clients of the gateway's address get 502/503/504."
        ),
        metrics=("llm_gateway_upstream_failures_total", "llm_gateway_requests_total"),
    ),
    # A woken model that does not come up: requests for it were held in the last 5 minutes and none was
    # answered, for longer than its cold start should take. Its clients meanwhile get 503 model_starting
    # each time their hold ends (serving.gateway.wake_hold_seconds).
    AlertSpec(
        name="LlmModelWakeStalled",
        expr=(
            "max by (namespace, model) (max_over_time(llm_gateway_held_requests[5m])) > 0\n"
            "unless on (namespace, model) "
            '(sum by (namespace, model) (increase(llm_gateway_requests_total{code="200"}[5m])) > 0)'
        ),
        for_=lambda c: f"{c.wake_for_minutes}m",
        severity="warning",
        summary="{{ $labels.model }} is not waking: its requests wait at the gateway and none is answered",
        description=lambda c: (
            "Requests for the model have waited at the gateway for a wake and none was answered for "
            f"{c.wake_for_minutes} minutes, longer than the model's cold-start budget: its replica or its GPU "
            "node is not coming up."
        ),
        metrics=("llm_gateway_held_requests", "llm_gateway_requests_total"),
    ),
    # A model's router has no replica to send to while Serve reports a healthy one: its discovery (the
    # pod selector, its RBAC) or the replicas' readiness is broken, and every request through the
    # model's address is answered 503. A model at zero replicas has no healthy one and does not alert.
    AlertSpec(
        name="LlmRouterHasNoReplica",
        expr=(
            f"{ROUTER_REPLICAS} == 0\n"
            f"and on (namespace, {ROUTER_OF_LABEL}) label_replace(\n"
            "  max by (namespace, application) (ray_serve_deployment_replica_healthy) == 1,\n"
            f'  "{ROUTER_OF_LABEL}", "$1", "application", "(.+)"\n'
            ")"
        ),
        for_="5m",
        severity="critical",
        summary=f"The router of {{{{ $labels.{ROUTER_OF_LABEL} }}}} sees none of its healthy replicas",
        description="Serve reports a healthy replica of the model, and its router has had none to send to for "
        "5 minutes: every request through the model's address is answered 503.",
        metrics=("vllm_router_active_workers", "ray_serve_deployment_replica_healthy"),
    ),
    # A model's router refuses requests although it knows replicas: none of them passes the router's own
    # health checks, or (with `serving.routing.circuit_breaker` on) every replica's circuit is open. Each
    # request is then answered 503 "No available workers" and counted here, once an attempt; the replicas
    # see none of them, so LlmHttp5xxRatioHigh (the replicas' own answers) goes quiet exactly then. A short
    # trip (one break) clears from the 2-minute rate before the alert's 5 minutes; replicas that keep
    # failing trip it again and keep it firing. A router with no replica at all is LlmRouterHasNoReplica's.
    AlertSpec(
        name="LlmRouterCircuitsOpen",
        expr=(
            f"sum by (namespace, {ROUTER_OF_LABEL}) (\n"
            f'  rate(vllm_router_request_errors_total{{error_type="{ROUTER_NO_WORKER_ERROR}"}}[2m])\n'
            ") > 0\n"
            f"and on (namespace, {ROUTER_OF_LABEL}) {ROUTER_REPLICAS} > 0"
        ),
        for_="5m",
        severity="critical",
        summary=f"The router of {{{{ $labels.{ROUTER_OF_LABEL} }}}} refuses requests: no replica it knows may take one",
        description=(
            "For 5 minutes the model's router has known replicas and found none it may send to: they fail its "
            "health checks, or (with serving.routing.circuit_breaker on) every replica failed enough attempts "
            'to open its circuit. Clients get 503 "No available workers", which the replicas never see '
            "({{ $value | humanize }} attempts a second found no replica)."
        ),
        metrics=("vllm_router_request_errors_total", "vllm_router_active_workers"),
    ),
    # A model's router sees its attempts fail: replicas answering 5xx, or not answering at all (a
    # connection refused, reset or timed out: a pod that died mid-answer, a policy that drops the
    # router's packets). The replicas' own LlmHttp5xxRatioHigh counts only the answers they sent; the
    # failures of the connection show nowhere else. Retries hide most of them from clients (a request is
    # tried serving.routing.attempts times), so this warns before clients see errors. 429 and other 4xx
    # answers are not failures: a key over its cap does not fire it.
    AlertSpec(
        name="LlmRouterAttemptsFailing",
        expr=lambda c: (
            f"{ROUTER_FAILED_ATTEMPTS_RATIO}\n> {c.slo.error_ratio}\n"
            f"and on (namespace, {ROUTER_OF_LABEL}) {ROUTER_ATTEMPTS_RATE} > 0.05"
        ),
        for_="10m",
        severity="warning",
        summary=f"Attempts of the router of {{{{ $labels.{ROUTER_OF_LABEL} }}}} to its replicas fail",
        description=lambda c: (
            "{{ $value | humanizePercentage }} of the router's attempts got a 5xx answer or none at all "
            f"(SLO {c.slo.error_ratio}) for 10 minutes. Retries on other replicas hide most from clients; "
            "answers that never came are counted only here, not in the replicas' own 5xx ratio."
        ),
        metrics=("vllm_router_cb_outcomes_total",),
    ),
    AlertSpec(
        name="BatchDeadLetterQueueNotEmpty",
        expr=f'max by (scaledObject, metric) (keda_scaler_metrics_value{{scaledObject="{BATCH_SCALED_OBJECT}", '
        f'metric=~"{DEAD_LETTER_METRIC}"}}) > 0',
        for_="5m",
        severity="warning",
        summary="Batch requests are in the dead-letter queue",
        description="{{ $value }} messages failed every receive and moved to the dead-letter queue: "
        "read one, fix the cause, then redrive them to the request queue.",
        metrics=("keda_scaler_metrics_value",),
    ),
)


def plan_rules(preemption_free: Mapping[str, int]) -> list[dict[str, Any]]:
    """The capacity plan's preemption-free load as a series per model (model id -> sequences)."""
    return [
        {"record": PREEMPTION_FREE, "expr": f"vector({sequences})", "labels": {"model_name": model}}
        for model, sequences in sorted(preemption_free.items())
    ]


@dataclass(frozen=True)
class ServeQueue:
    """Where a serve-ingress model's requests wait in Serve: its application and deployment."""

    namespace: str
    application: str
    deployment: str


def serve_queue_rules(queues: Mapping[str, ServeQueue]) -> list[dict[str, Any]]:
    """Serve's queue of each serve-ingress model (model id -> where it waits), labelled with the model.

    First in the group: Prometheus evaluates a group's rules in order, so the
    waiting rules after them read this evaluation's values, not the last one's.
    """
    rules = []
    for model, queue in sorted(queues.items()):
        selector = (
            f'{SERVE_QUEUE_METRIC}{{namespace="{queue.namespace}", application="{queue.application}", '
            f'deployment="{queue.deployment}"}}'
        )
        labels = {"model_name": model}
        rules.append({"record": SERVE_QUEUED, "expr": f"sum({selector})", "labels": labels})
        rules.append({"record": SERVE_QUEUED_AVG, "expr": f"sum(avg_over_time({selector}[1m]))", "labels": labels})
    return rules


def recording_rules(
    preemption_free: Mapping[str, int] | None = None, serve_queues: Mapping[str, ServeQueue] | None = None
) -> list[dict[str, Any]]:
    """Serve's per-model queues, the per-model and per-application series for the dashboards and alerts,
    then the plan's figures."""
    return (
        serve_queue_rules(serve_queues or {}) + [r.rule() for r in RECORDING_RULES] + plan_rules(preemption_free or {})
    )


def alert_rules(
    slo: Slo, namespace: str, runbook_base_url: str | None = None, wake_minutes: int = DEFAULT_WAKE_FOR_MINUTES
) -> list[dict[str, Any]]:
    """The serving alerts; thresholds from the config's SLOs, runbooks under `runbook_base_url`."""
    ctx = RuleContext(slo=slo, namespace=namespace, runbook_base_url=runbook_base_url, wake_for_minutes=wake_minutes)
    return [a.rule(ctx) for a in ALERTS]


def prometheus_rule(
    slo: Slo,
    namespace: str,
    labels: dict[str, str],
    runbook_base_url: str | None = None,
    preemption_free: Mapping[str, int] | None = None,
    serve_queues: Mapping[str, ServeQueue] | None = None,
    wake_minutes: int = DEFAULT_WAKE_FOR_MINUTES,
) -> dict[str, Any]:
    """The PrometheusRule object; `preemption_free`: the plan's figure of each model that allows preemption;
    `serve_queues`: where each serve-ingress model's requests wait in Serve."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": RULE_NAME, "namespace": namespace, "labels": {**PART_OF, **labels}},
        "spec": {
            "groups": [
                {
                    "name": RECORDING_GROUP,
                    "interval": RECORDING_INTERVAL,
                    "rules": recording_rules(preemption_free, serve_queues),
                },
                {"name": ALERT_GROUP, "rules": alert_rules(slo, namespace, runbook_base_url, wake_minutes)},
            ]
        },
    }


# The pod labels every Ray PodMonitor copies onto its series.
RAY_TARGET_LABELS = [kuberay.CLUSTER, kuberay.SERVICE_LABEL, kuberay.GROUP]
VLLM_SERVER_MONITOR = "vllm-servers"
# One set of rules reads both layouts: vLLM's own `vllm:<name>` series get
# the `ray_vllm_<name>` names Ray's metrics agent gives them under
# serve-ingress (Prometheus anchors the regex; `${1}` is the rest). The
# separator is `:` or `_` because vLLM's registry (prometheus_client) writes
# `vllm_<name>` in OpenMetrics to a scraper that does not offer UTF-8 names
# (Prometheus 2), and `vllm:<name>` to one that does (Prometheus 3); a real
# Prometheus 2 in the twin showed the first, which `vllm:(.*)` never matched.
VLLM_RENAME = {
    "sourceLabels": ["__name__"],
    "regex": "vllm[:_](.*)",
    "targetLabel": "__name__",
    "replacement": "ray_vllm_${1}",
    "action": "replace",
}


def _pod_label_meta(label: str) -> str:
    """Prometheus' Kubernetes discovery label for a pod label (`.`, `/`, `-` become `_`)."""
    return "__meta_kubernetes_pod_label_" + target_label_name(label)


def vllm_server_pod_monitor(namespace: str, labels: dict[str, str], services: list[str]) -> dict[str, Any]:
    """vLLM's own registry on the GPU workers of the vllm-server RayServices.

    The RayService's name becomes `application`, as Serve labels its own
    series, so the per-application HTTP rules read both layouts alike. Only
    pods that declare the `vllm-metrics` port are scraped.
    """
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": VLLM_SERVER_MONITOR, "namespace": namespace, "labels": {**PART_OF, **labels}},
        "spec": {
            "namespaceSelector": {"matchNames": [namespace]},
            "selector": {
                "matchLabels": {kuberay.NODE_TYPE: "worker"},
                "matchExpressions": [{"key": SERVICE_LABEL, "operator": "In", "values": sorted(services)}],
            },
            "podTargetLabels": RAY_TARGET_LABELS,
            "podMetricsEndpoints": [
                {
                    "port": RAY_PORTS.vllm_metrics.name,
                    "interval": "15s",
                    "relabelings": [
                        {
                            "sourceLabels": [_pod_label_meta(SERVICE_LABEL)],
                            "targetLabel": "application",
                            "action": "replace",
                        }
                    ],
                    "metricRelabelings": [VLLM_RENAME],
                }
            ],
        },
    }


def pod_monitors(namespace: str, labels: dict[str, str], vllm_servers: list[str] | None = None) -> list[dict[str, Any]]:
    """Ray heads (metrics agent, autoscaler, dashboard) and workers (metrics agent); vLLM's own registry
    on the GPU workers of `vllm_servers` (the RayServices in the vllm-server layout)."""
    target_labels = RAY_TARGET_LABELS
    out = []
    for node_type, ports in (("head", RAY_PORTS.scraped_on_head()), ("worker", [RAY_PORTS.metrics])):
        out.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "PodMonitor",
                "metadata": {"name": f"ray-{node_type}s", "namespace": namespace, "labels": {**PART_OF, **labels}},
                "spec": {
                    "namespaceSelector": {"matchNames": [namespace]},
                    # Our label, which KubeRay copies from the template onto
                    # every pod of every cluster; its own pods carry no
                    # `ray.io/originated-from-*` (twin/kuberay.py label_pod).
                    "selector": {
                        "matchLabels": {kuberay.NODE_TYPE: node_type},
                        "matchExpressions": [{"key": kuberay.SERVICE_LABEL, "operator": "Exists"}],
                    },
                    "podTargetLabels": target_labels,
                    "podMetricsEndpoints": [{"port": p.name, "interval": "15s"} for p in ports],
                },
            }
        )
    if vllm_servers:
        out.append(vllm_server_pod_monitor(namespace, labels, vllm_servers))
    return out


@dataclass(frozen=True)
class ServingAlertsArgs:
    """Where the rules go and what they hold the platform to."""

    namespace: str
    slo: Slo
    prometheus_selector_labels: dict[str, str]
    # The RayServices in the vllm-server layout (their vLLM registries are scraped directly).
    vllm_servers: list[str] = field(default_factory=list)
    # `observability.runbook_base_url`: where the alerts' runbook links point.
    runbook_base_url: str | None = None
    # Model id -> the capacity plan's preemption-free sequences, for each model whose workload allows preemption.
    preemption_free: dict[str, int] = field(default_factory=dict)
    # Model id -> where its requests wait in Serve, for each serve-ingress model.
    serve_queues: dict[str, ServeQueue] = field(default_factory=dict)
    # LlmModelWakeStalled's `for`: wake_for_minutes of the woken models' cold-start budgets.
    wake_minutes: int = DEFAULT_WAKE_FOR_MINUTES


class ServingAlerts(pulumi.ComponentResource):
    """The serving PrometheusRule and the Ray PodMonitors."""

    def __init__(self, name: str, args: ServingAlertsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Alerts", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self)
        objects = [
            prometheus_rule(
                args.slo,
                args.namespace,
                args.prometheus_selector_labels,
                args.runbook_base_url,
                args.preemption_free,
                args.serve_queues,
                args.wake_minutes,
            )
        ]
        objects += pod_monitors(args.namespace, args.prometheus_selector_labels, args.vllm_servers)
        for obj in objects:
            k8s.apiextensions.CustomResource(
                f"{name}-{obj['metadata']['name']}",
                api_version=obj["apiVersion"],
                kind=obj["kind"],
                metadata=obj["metadata"],
                spec=obj["spec"],
                opts=k8s_opts,
            )
        self.register_outputs({"rule": RULE_NAME})
