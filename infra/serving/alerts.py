"""`ServingAlerts`: the serving PrometheusRule and the PodMonitors that feed it.

Every metric named here is one an exporter of this platform emits:
- Ray's metrics agent (port `metrics` on every Ray pod): vLLM's engine
  metrics with `vllm:` turned into `ray_vllm_` (label `model_name`), Ray
  Serve's `ray_serve_*` (labels `application`, `deployment`); counters get
  Prometheus' `_total`;
- the KubeRay operator: `kuberay_service_condition_ready{condition, name, namespace}`;
- the DCGM exporter: `DCGM_FI_DEV_*`;
- kube-state-metrics: `kube_pod_*` (extended resources as `nvidia_com_gpu`);
- cluster-autoscaler: per-node-group gauges (`--emit-per-nodegroup-metrics`).
`ALERT_METRICS` lists them per rule so a test can hold them to an allow-list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import Slo
from infra.serving import kuberay
from infra.serving.namespace import PART_OF
from infra.serving.ports import RAY_PORTS

PROMETHEUS_RULE_TYPE = "kubernetes:monitoring.coreos.com/v1:PrometheusRule"
POD_MONITOR_TYPE = "kubernetes:monitoring.coreos.com/v1:PodMonitor"
RULE_NAME = "llm-serving"
HEADROOM_POD_PATTERN = "gpu-headroom-.*"

# Below this utilisation (percent) a GPU counts as idle.
GPU_IDLE_UTIL_PERCENT = 5

# Recording rules: what the dashboards plot and the alerts compare.
TTFT_P95 = "llm:time_to_first_token_seconds:p95"
ITL_P95 = "llm:inter_token_latency_seconds:p95"
GENERATION_TOKENS_RATE = "llm:generation_tokens:rate5m"
PROMPT_TOKENS_RATE = "llm:prompt_tokens:rate5m"
REQUESTS_WAITING = "llm:requests_waiting:sum"
REQUESTS_RUNNING = "llm:requests_running:sum"
KV_CACHE_USAGE = "llm:kv_cache_usage:max"
HTTP_REQUESTS_RATE = "llm:http_requests:rate5m"
HTTP_5XX_RATIO = "llm:http_5xx_ratio:rate5m"
GPU_UTIL_ALLOCATED = "llm:gpu_util_allocated:percent"

# The exporter metrics each rule reads (recording rules by their record name).
ALERT_METRICS: dict[str, list[str]] = {
    TTFT_P95: ["ray_vllm_time_to_first_token_seconds_bucket"],
    ITL_P95: ["ray_vllm_inter_token_latency_seconds_bucket"],
    GENERATION_TOKENS_RATE: ["ray_vllm_generation_tokens_total"],
    PROMPT_TOKENS_RATE: ["ray_vllm_prompt_tokens_total"],
    REQUESTS_WAITING: ["ray_vllm_num_requests_waiting"],
    REQUESTS_RUNNING: ["ray_vllm_num_requests_running"],
    KV_CACHE_USAGE: ["ray_vllm_kv_cache_usage_perc"],
    HTTP_REQUESTS_RATE: ["ray_serve_num_http_requests_total"],
    HTTP_5XX_RATIO: ["ray_serve_num_http_requests_total"],
    GPU_UTIL_ALLOCATED: ["DCGM_FI_DEV_GPU_UTIL"],
    "LlmTimeToFirstTokenHigh": [TTFT_P95],
    "LlmRequestsWaiting": [REQUESTS_WAITING],
    "LlmKvCacheNearlyFull": [KV_CACHE_USAGE],
    "LlmHttp5xxRatioHigh": [HTTP_5XX_RATIO, HTTP_REQUESTS_RATE],
    "RayServeReplicaUnhealthy": ["ray_serve_deployment_replica_healthy"],
    "RayServiceNotReady": ["kuberay_service_condition_ready"],
    "GpuXidError": ["DCGM_FI_DEV_XID_ERRORS"],
    "GpuAllocatedButIdle": [GPU_UTIL_ALLOCATED],
    "GpuPodsPendingNodeGroupAtMax": [
        "kube_pod_status_phase",
        "kube_pod_container_resource_requests",
        "cluster_autoscaler_node_group_target_count",
        "cluster_autoscaler_node_group_max_count",
    ],
}


def _record(name: str, expr: str) -> dict[str, Any]:
    return {"record": name, "expr": expr}


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def recording_rules() -> list[dict[str, Any]]:
    """Per-model and per-application series for the dashboards and alerts."""
    ratio = (
        'sum by (namespace, application) (rate(ray_serve_num_http_requests_total{status_code=~"5.."}[5m]))'
        " / sum by (namespace, application) (rate(ray_serve_num_http_requests_total[5m]))"
    )
    # The DCGM exporter labels a GPU held by a pod with that pod. Whether the
    # label arrives as `pod` or, under a ServiceMonitor without honorLabels,
    # as `exported_pod`, depends on the scrape; accept both.
    gpu_util = (
        'label_replace(DCGM_FI_DEV_GPU_UTIL{exported_pod!=""}, "pod", "$1", "exported_pod", "(.+)")'
        ' or DCGM_FI_DEV_GPU_UTIL{pod!="", exported_pod="", container!="nvidia-dcgm-exporter"}'
    )
    return [
        _record(
            TTFT_P95,
            "histogram_quantile(0.95, sum by (model_name, le) (rate(ray_vllm_time_to_first_token_seconds_bucket[5m])))",
        ),
        _record(
            ITL_P95,
            "histogram_quantile(0.95, sum by (model_name, le) (rate(ray_vllm_inter_token_latency_seconds_bucket[5m])))",
        ),
        _record(GENERATION_TOKENS_RATE, "sum by (model_name) (rate(ray_vllm_generation_tokens_total[5m]))"),
        _record(PROMPT_TOKENS_RATE, "sum by (model_name) (rate(ray_vllm_prompt_tokens_total[5m]))"),
        _record(REQUESTS_WAITING, "sum by (model_name) (ray_vllm_num_requests_waiting)"),
        _record(REQUESTS_RUNNING, "sum by (model_name) (ray_vllm_num_requests_running)"),
        _record(KV_CACHE_USAGE, "max by (model_name) (ray_vllm_kv_cache_usage_perc)"),
        _record(HTTP_REQUESTS_RATE, "sum by (namespace, application) (rate(ray_serve_num_http_requests_total[5m]))"),
        _record(HTTP_5XX_RATIO, ratio),
        _record(GPU_UTIL_ALLOCATED, f"max by (pod, Hostname, gpu) ({gpu_util})"),
    ]


def alert_rules(slo: Slo, namespace: str) -> list[dict[str, Any]]:
    """The serving alerts; thresholds from the config's SLOs."""
    gpu_pending = (
        f'sum(\n  (kube_pod_status_phase{{namespace="{namespace}", phase="Pending"}} == 1)\n'
        "  * on (namespace, pod) group_left ()\n"
        f'  (max by (namespace, pod) (kube_pod_container_resource_requests{{namespace="{namespace}", '
        f'resource="nvidia_com_gpu", pod!~"{HEADROOM_POD_PATTERN}"}}) > 0)\n'
        ") > 0\n"
        "and on ()\n"
        "count(cluster_autoscaler_node_group_target_count >= cluster_autoscaler_node_group_max_count) > 0"
    )
    return [
        _alert(
            "LlmTimeToFirstTokenHigh",
            f"{TTFT_P95} > {slo.ttft_p95_seconds}",
            "10m",
            "warning",
            "Time to first token p95 of {{ $labels.model_name }} is over the SLO",
            f"p95 TTFT is {{{{ $value | humanizeDuration }}}} (SLO {slo.ttft_p95_seconds}s) for 10 minutes.",
        ),
        _alert(
            "LlmRequestsWaiting",
            f"{REQUESTS_WAITING} > {slo.requests_waiting}",
            "10m",
            "warning",
            "Requests are queueing for {{ $labels.model_name }}",
            f"{{{{ $value }}}} requests wait for a slot (threshold {slo.requests_waiting}) for 10 minutes: "
            "replicas are at their maximum or GPU nodes are not coming up.",
        ),
        _alert(
            "LlmKvCacheNearlyFull",
            f"{KV_CACHE_USAGE} > {slo.kv_cache_usage}",
            "15m",
            "warning",
            "KV cache of {{ $labels.model_name }} is nearly full",
            f"KV cache usage is {{{{ $value | humanizePercentage }}}} (threshold {slo.kv_cache_usage}): "
            "requests get preempted and latency climbs.",
        ),
        _alert(
            "LlmHttp5xxRatioHigh",
            f"{HTTP_5XX_RATIO} > {slo.error_ratio} and {HTTP_REQUESTS_RATE} > 0.05",
            "5m",
            "critical",
            "Serve application {{ $labels.application }} answers with 5xx",
            f"{{{{ $value | humanizePercentage }}}} of requests fail with 5xx (SLO {slo.error_ratio}).",
        ),
        _alert(
            "RayServeReplicaUnhealthy",
            "count by (namespace, application, deployment) (ray_serve_deployment_replica_healthy == 0) > 0",
            "5m",
            "warning",
            "Serve deployment {{ $labels.application }}/{{ $labels.deployment }} has unhealthy replicas",
            "{{ $value }} replicas fail their health checks for 5 minutes.",
        ),
        _alert(
            "RayServiceNotReady",
            f'kuberay_service_condition_ready{{namespace="{namespace}", condition="false"}} == 1',
            "15m",
            "critical",
            "RayService {{ $labels.name }} is not ready",
            "KubeRay reports the RayService not Ready for 15 minutes: its Serve applications are not serving.",
        ),
        _alert(
            "GpuXidError",
            "max by (Hostname, gpu, modelName) (DCGM_FI_DEV_XID_ERRORS) > 0",
            "0m",
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported XID {{ $value }}",
            "The driver reported an XID error; check `nvidia-smi -q` and drain the node if it repeats.",
        ),
        _alert(
            "GpuAllocatedButIdle",
            f'{GPU_UTIL_ALLOCATED}{{pod!~"{HEADROOM_POD_PATTERN}"}} < {GPU_IDLE_UTIL_PERCENT}',
            f"{slo.gpu_idle_minutes}m",
            "info",
            "GPU held by {{ $labels.pod }} is idle",
            f"A GPU allocated to a pod stayed under {GPU_IDLE_UTIL_PERCENT}% utilisation for "
            f"{slo.gpu_idle_minutes} minutes: lower the model's min_replicas or check its traffic.",
        ),
        _alert(
            "GpuPodsPendingNodeGroupAtMax",
            gpu_pending,
            "10m",
            "warning",
            "GPU pods are pending and a node group is at its maximum",
            "Pods requesting GPUs have been Pending for 10 minutes while cluster-autoscaler has a node group "
            "at max_size: raise the group's max_size or lower the models' max_replicas.",
        ),
    ]


def prometheus_rule(slo: Slo, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """The PrometheusRule object."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": RULE_NAME, "namespace": namespace, "labels": {**PART_OF, **labels}},
        "spec": {
            "groups": [
                {"name": "llm-serving.recording", "interval": "30s", "rules": recording_rules()},
                {"name": "llm-serving.alerts", "rules": alert_rules(slo, namespace)},
            ]
        },
    }


def pod_monitors(namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """Ray heads (metrics agent, autoscaler, dashboard) and workers (metrics agent)."""
    target_labels = [kuberay.CLUSTER, kuberay.ORIGINATED_FROM_NAME, kuberay.GROUP]
    out = []
    for node_type, ports in (("head", RAY_PORTS.scraped_on_head()), ("worker", [RAY_PORTS.metrics])):
        out.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "PodMonitor",
                "metadata": {"name": f"ray-{node_type}s", "namespace": namespace, "labels": {**PART_OF, **labels}},
                "spec": {
                    "namespaceSelector": {"matchNames": [namespace]},
                    "selector": {
                        "matchLabels": {
                            kuberay.ORIGINATED_FROM_CRD: kuberay.RAY_SERVICE_CRD,
                            kuberay.NODE_TYPE: node_type,
                        }
                    },
                    "podTargetLabels": target_labels,
                    "podMetricsEndpoints": [{"port": p.name, "interval": "15s"} for p in ports],
                },
            }
        )
    return out


@dataclass(frozen=True)
class ServingAlertsArgs:
    """Where the rules go and what they hold the platform to."""

    namespace: str
    slo: Slo
    prometheus_selector_labels: dict[str, str]
    provider: k8s.Provider
    depends_on: list[pulumi.Resource]
    monitoring_crds: pulumi.Resource | None


class ServingAlerts(pulumi.ComponentResource):
    """The serving PrometheusRule and the Ray PodMonitors."""

    def __init__(self, name: str, args: ServingAlertsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Alerts", name, None, opts)
        crds = [args.monitoring_crds] if args.monitoring_crds is not None else []
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[*crds, *args.depends_on])
        objects = [prometheus_rule(args.slo, args.namespace, args.prometheus_selector_labels)]
        objects += pod_monitors(args.namespace, args.prometheus_selector_labels)
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
