"""`ServingDashboards`: Grafana dashboards as ConfigMaps for Grafana's sidecar.

Built with Grafana's typed SDK (grafana-foundation-sdk) so a panel field
that Grafana does not have is a Python error, not a blank panel. The
queries read the recording rules of alerts.py where one exists, so the
dashboards and the alerts show the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s
from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from infra.serving import alerts
from infra.serving.namespace import PART_OF

# kube-prometheus-stack's provisioned Prometheus datasource.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
PANEL_HEIGHT = 8
HALF_WIDTH = 12


@dataclass(frozen=True)
class Query:
    """One PromQL target and its legend."""

    expr: str
    legend: str


def _panel(title: str, unit: str, *queries: Query) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(PANEL_HEIGHT).span(HALF_WIDTH)
    for query in queries:
        panel = panel.with_target(prometheus.Dataquery().expr(query.expr).legend_format(query.legend))
    return panel


def serving_dashboard() -> dashboard.Dashboard:
    """Tokens/s, TTFT, inter-token latency, queue, KV cache and errors per model; the routers' attempts."""
    by_model = "{{model_name}}"
    board = (
        dashboard.Dashboard("LLM serving")
        .uid("llm-serving")
        .tags(["llm-platform", "serving"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_row(dashboard.Row("Throughput and latency"))
        .with_panel(
            _panel(
                "Tokens per second",
                "short",
                Query(alerts.GENERATION_TOKENS_RATE, f"{by_model} generated"),
                Query(alerts.PROMPT_TOKENS_RATE, f"{by_model} prompt"),
            )
        )
        .with_panel(_panel("Time to first token (p95)", "s", Query(alerts.TTFT_P95, by_model)))
        .with_panel(_panel("Inter-token latency (p95)", "s", Query(alerts.ITL_P95, by_model)))
        .with_panel(
            _panel(
                "Requests running and waiting",
                "short",
                Query(alerts.REQUESTS_RUNNING, f"{by_model} running"),
                Query(alerts.REQUESTS_WAITING, f"{by_model} waiting"),
            )
        )
        .with_row(dashboard.Row("Capacity and errors"))
        .with_panel(_panel("KV cache usage", "percentunit", Query(alerts.KV_CACHE_USAGE, by_model)))
        .with_panel(_panel("Preemptions per second", "short", Query(alerts.PREEMPTIONS_RATE, by_model)))
        .with_panel(
            _panel(
                "HTTP 5xx ratio",
                "percentunit",
                Query(alerts.HTTP_5XX_RATIO, "{{application}}"),
            )
        )
        .with_panel(_panel("HTTP requests per second", "reqps", Query(alerts.HTTP_REQUESTS_RATE, "{{application}}")))
        .with_panel(
            _panel(
                "Healthy Serve replicas",
                "short",
                Query(
                    "sum by (application, deployment) (ray_serve_deployment_replica_healthy)",
                    "{{application}}/{{deployment}}",
                ),
            )
        )
    )
    return _with_routing(board)


def _with_routing(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The routers' row; empty for a stack without `serving.routing`, where nothing exports these series."""
    by_router = f"{{{{{alerts.ROUTER_OF_LABEL}}}}}"
    return (
        board.with_row(dashboard.Row("Request routing"))
        .with_panel(
            _panel(
                "Router attempts to replicas that failed (5xx or no answer)",
                "percentunit",
                Query(alerts.ROUTER_FAILED_ATTEMPTS_RATIO, by_router),
            )
        )
        .with_panel(
            _panel(
                "Replicas each router may send to",
                "short",
                Query(alerts.ROUTER_REPLICAS, by_router),
            )
        )
    )


def gpu_dashboard() -> dashboard.Dashboard:
    """DCGM: utilisation, framebuffer memory, XID errors and power per GPU."""
    per_gpu = "{{Hostname}} GPU {{gpu}}"
    return (
        dashboard.Dashboard("LLM GPUs")
        .uid("llm-gpus")
        .tags(["llm-platform", "gpu"])
        .refresh("30s")
        .time("now-6h", "now")
        .with_panel(_panel("GPU utilisation", "percent", Query("DCGM_FI_DEV_GPU_UTIL", per_gpu)))
        .with_panel(
            _panel(
                "GPU memory used",
                "percentunit",
                Query("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)", per_gpu),
            )
        )
        .with_panel(_panel("XID errors (last code)", "none", Query("DCGM_FI_DEV_XID_ERRORS", per_gpu)))
        .with_panel(_panel("Power", "watt", Query("DCGM_FI_DEV_POWER_USAGE", per_gpu)))
        .with_panel(
            _panel("Utilisation of allocated GPUs", "percent", Query(alerts.GPU_UTIL_ALLOCATED, "{{pod}} GPU {{gpu}}"))
        )
    )


# Exporter metrics the dashboards read directly (the rest via recording rules).
DASHBOARD_METRICS = [
    "ray_serve_deployment_replica_healthy",
    "vllm_router_cb_outcomes_total",
    "vllm_router_active_workers",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_POWER_USAGE",
]


def dashboard_json(board: dashboard.Dashboard) -> str:
    """The dashboard model as Grafana's JSON."""
    return JSONEncoder(sort_keys=True, indent=2).encode(board.build())


def dashboards() -> dict[str, str]:
    """ConfigMap name -> dashboard JSON."""
    return {
        "llm-serving-dashboard": dashboard_json(serving_dashboard()),
        "llm-gpus-dashboard": dashboard_json(gpu_dashboard()),
    }


@dataclass(frozen=True)
class ServingDashboardsArgs:
    """Where Grafana's sidecar looks for dashboards."""

    monitoring_namespace: str
    dashboard_label: tuple[str, str]


class ServingDashboards(pulumi.ComponentResource):
    """The serving and GPU dashboards as labelled ConfigMaps."""

    def __init__(self, name: str, args: ServingDashboardsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:serving:Dashboards", name, None, opts)
        key, value = args.dashboard_label
        for cm_name, body in dashboards().items():
            k8s.core.v1.ConfigMap(
                f"{name}-{cm_name}",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=cm_name, namespace=args.monitoring_namespace, labels={**PART_OF, key: value}
                ),
                data={f"{cm_name}.json": body},
                opts=pulumi.ResourceOptions(parent=self),
            )
        self.register_outputs({"dashboards": list(dashboards())})
