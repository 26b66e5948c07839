"""Alerts: only real exporter metrics, thresholds from the SLOs, promtool-checked and unit-tested."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import Slo
from infra.serving import alerts, dashboards
from infra.serving.ports import RAY_PORTS
from tests.harness import REFERENCE, manifests_of, render_stack
from tests.test_serving_support import config

RULES_DIR = Path(__file__).parent / "rules"
# The rules the promtool cases in tests/rules/ are written against.
CASE_SLO = Slo()
CASE_NAMESPACE = "llm"

# Metrics the exporters of this platform emit (Ray 2.60 with vLLM 0.29 under
# Serve LLM, KubeRay 1.7 operator, dcgm-exporter 4.x, kube-state-metrics,
# cluster-autoscaler 1.35). Counters carry Prometheus' `_total`, histograms
# `_bucket`.
KNOWN_METRICS = {
    "ray_vllm_time_to_first_token_seconds_bucket",
    "ray_vllm_inter_token_latency_seconds_bucket",
    "ray_vllm_e2e_request_latency_seconds_bucket",
    "ray_vllm_generation_tokens_total",
    "ray_vllm_prompt_tokens_total",
    "ray_vllm_num_requests_waiting",
    "ray_vllm_num_requests_running",
    "ray_vllm_kv_cache_usage_perc",
    "ray_serve_num_http_requests_total",
    "ray_serve_num_http_error_requests_total",
    "ray_serve_deployment_replica_healthy",
    "kuberay_service_condition_ready",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_POWER_USAGE",
    "kube_pod_status_phase",
    "kube_pod_container_resource_requests",
    "cluster_autoscaler_node_group_target_count",
    "cluster_autoscaler_node_group_max_count",
}
REMOVED_BY_VLLM = ("gpu_cache_usage_perc", "time_per_output_token_seconds")
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "rate", "irate", "increase", "histogram_quantile", "label_replace",
    "max_over_time", "changes", "le", "offset",
}  # fmt: skip


def _metrics_in(expr: str) -> set[str]:
    """The metric names an expression selects (labels, strings, functions and durations removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", n)}


def _rule(stack: str) -> dict[str, Any]:
    (rule,) = [r for r in manifests_of(render_stack(stack), "PrometheusRule") if r["metadata"]["name"] == "llm-serving"]
    return rule


def _rules(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_expression_reads_only_known_metrics(stack: str) -> None:
    rules = _rules(_rule(stack))
    recorded = {r["record"] for r in rules if "record" in r}
    for rule in rules:
        name = rule.get("alert") or rule["record"]
        used = _metrics_in(rule["expr"])
        assert used <= KNOWN_METRICS | recorded, f"{name}: {used - KNOWN_METRICS - recorded}"
        # The declared list and the expression agree.
        assert used == set(alerts.ALERT_METRICS[name]), name
    for metrics in alerts.ALERT_METRICS.values():
        assert set(metrics) <= KNOWN_METRICS | recorded
    assert set(dashboards.DASHBOARD_METRICS) <= KNOWN_METRICS
    text = json.dumps(_rule(stack)) + json.dumps(dashboards.dashboards())
    for removed in REMOVED_BY_VLLM:
        assert removed not in text


def test_the_metric_parser_finds_what_it_should() -> None:
    assert _metrics_in('sum by (a) (rate(foo_total{x="bar_total"}[5m])) / on () bar') == {"foo_total", "bar"}


def test_thresholds_come_from_the_slos() -> None:
    cfg = config("prod")
    slo = cfg.observability.slo
    by_alert = {r["alert"]: r for r in _rules(_rule("prod")) if "alert" in r}
    assert by_alert["LlmTimeToFirstTokenHigh"]["expr"].endswith(f"> {slo.ttft_p95_seconds}")
    assert f"> {slo.error_ratio}" in by_alert["LlmHttp5xxRatioHigh"]["expr"]
    assert by_alert["LlmRequestsWaiting"]["expr"].endswith(f"> {slo.requests_waiting}")
    assert by_alert["LlmKvCacheNearlyFull"]["expr"].endswith(f"> {slo.kv_cache_usage}")
    assert by_alert["GpuAllocatedButIdle"]["for"] == f"{slo.gpu_idle_minutes}m"
    assert f'namespace="{cfg.serving.namespace}"' in by_alert["RayServiceNotReady"]["expr"]
    assert set(by_alert) >= {
        "RayServeReplicaUnhealthy",
        "GpuXidError",
        "GpuPodsPendingNodeGroupAtMax",
    }


def test_rule_and_monitors_carry_the_prometheus_selector_labels() -> None:
    rendered = render_stack("prod")
    rule = _rule("prod")
    monitors = {m["metadata"]["name"]: m for m in manifests_of(rendered, "PodMonitor")}
    selector_labels = alerts.prometheus_rule(CASE_SLO, "x", {"release": "y"})["metadata"]["labels"]
    assert selector_labels["release"] == "y"
    for obj in [rule, *monitors.values()]:
        assert obj["metadata"]["namespace"] == config("prod").serving.namespace
    heads = monitors["ray-heads"]["spec"]
    assert {e["port"] for e in heads["podMetricsEndpoints"]} == {
        RAY_PORTS.metrics.name,
        RAY_PORTS.autoscaler_metrics.name,
        RAY_PORTS.dashboard_metrics.name,
    }
    assert heads["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    workers = monitors["ray-workers"]["spec"]
    assert [e["port"] for e in workers["podMetricsEndpoints"]] == [RAY_PORTS.metrics.name]
    assert workers["selector"]["matchLabels"]["ray.io/node-type"] == "worker"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def _write_rules(directory: Path, rule: dict[str, Any]) -> Path:
    path = directory / "serving-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_promtool_accepts_the_rendered_rules(stack: str, tmp_path: Path) -> None:
    promtool = _promtool()
    path = _write_rules(tmp_path, _rule(stack))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", sorted(p.name for p in RULES_DIR.glob("*.yaml")))
def test_promtool_rule_cases(case: str, tmp_path: Path) -> None:
    promtool = _promtool()
    rule = alerts.prometheus_rule(CASE_SLO, CASE_NAMESPACE, {})
    # promtool compares annotations exactly; their templates are checked by
    # `promtool check rules` above, the cases here test when alerts fire.
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            r.pop("annotations", None)
    _write_rules(tmp_path, rule)
    shutil.copy(RULES_DIR / case, tmp_path / case)
    result = subprocess.run(
        [promtool, "test", "rules", case], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_cases_cover_the_main_alerts_firing_and_not() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in RULES_DIR.glob("*.yaml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    main = {
        "LlmTimeToFirstTokenHigh",
        "LlmRequestsWaiting",
        "LlmKvCacheNearlyFull",
        "LlmHttp5xxRatioHigh",
        "RayServeReplicaUnhealthy",
        "RayServiceNotReady",
        "GpuXidError",
        "GpuAllocatedButIdle",
        "GpuPodsPendingNodeGroupAtMax",
    }
    assert main <= fired
    assert main <= silent


def test_prometheus_rule_matches_the_pinned_crd() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path = REFERENCE / "kube-prometheus-stack" / "crd-prometheusrules.yaml"
    if not path.exists():
        pytest.skip(f"{path} is absent (the pinned CRDs live outside the project)")
    crd = yaml.safe_load(path.read_text())
    jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(_rule("prod"))
    path = REFERENCE / "kube-prometheus-stack" / "crd-podmonitors.yaml"
    crd = yaml.safe_load(path.read_text())
    for monitor in manifests_of(render_stack("prod"), "PodMonitor"):
        jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(monitor)
