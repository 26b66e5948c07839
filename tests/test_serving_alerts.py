"""Alerts as data: every rule comes from `alerts.ALERTS` / `alerts.RECORDING_RULES`,
reads only metrics of `alerts.METRIC_INVENTORY`, is promtool-checked, and every
alert has `promtool test rules` cases and a row in the alert table of docs/operations.md."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import Slo
from infra.render import ROOT
from infra.serving import alerts, dashboards
from infra.serving.ports import RAY_PORTS
from tests.harness import REFERENCE, SERVE_INGRESS, manifests_of, reference_dir, render_config, render_stack, stack_doc
from tests.harness import stack_config as config
from tests.promql import metrics_in
from workloads.inference_server.catalog import serve_llm_deployment_name

RULES_DIR = Path(__file__).parent / "rules"
# The rules the promtool cases in tests/rules/ are written against.
CASE_SLO = Slo()
CASE_NAMESPACE = "llm"
ALERT_NAMES = [a.name for a in alerts.ALERTS]
# The static recording rules, and the series the capacity plan records per model.
RECORDED = {r.record for r in alerts.RECORDING_RULES} | alerts.PLAN_RECORDS | set(alerts.PER_MODEL_RECORDS)
# The plan's preemption-free load of the models the cases let preempt (tests/rules/serving-alerts.yaml).
CASE_PREEMPTION_FREE = {"crowded": 12, "tolerant": 12}
# Where the cases' serve-ingress models wait in Serve (tests/rules/serving-alerts.yaml).
CASE_SERVE_QUEUES = {
    name: alerts.ServeQueue(CASE_NAMESPACE, f"app-{name}", serve_llm_deployment_name(name))
    for name in ("held", "cold", "ingress-calm")
}
# Names vLLM removed; they must not come back anywhere.
REMOVED_BY_VLLM = ("gpu_cache_usage_perc", "time_per_output_token_seconds")


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (a) (rate(foo_total{x="bar_total"}[5m])) / on () bar', {"foo_total", "bar"}),
        ('label_replace(up{job="a}b"}, "pod", "$1", "exported_pod", "(.+)") or llm:rule:sum', {"up", "llm:rule:sum"}),
        ("x * on (pod) group_left (node, by) kube_pod_info", {"x", "kube_pod_info"}),
        ("a * ignoring (le) group_right b", {"a", "b"}),
        ("sum without (le) (rate(h_bucket[5m:30s] offset -1h)) > bool 2.5e3", {"h_bucket"}),
        ('{__name__="by_name", job="x"} unless absent(y @ 1609746000) and z @ start()', {"by_name", "y", "z"}),
        ("max_over_time(m[1h]) > Inf and on () count(n) > 0x10 or -NaN < p", {"m", "n", "p"}),
        (r'a{l="x\"}y", k=~`z}`} + b', {"a", "b"}),
        ("SUM(a) BY (le) + AVG BY (x) (d) # a comment naming c\n", {"a", "d"}),
        ('topk(3, q) / count_values("v", r) and s offset 5m', {"q", "r", "s"}),
    ],
)
def test_the_metric_parser_finds_what_it_should(expr: str, names: set[str]) -> None:
    assert metrics_in(expr) == names


@pytest.mark.parametrize("expr", ['{__name__=~"ray_.*"}', "sum(rate(x[5m])", "a ? b"])
def test_the_metric_parser_refuses_what_it_cannot_read(expr: str) -> None:
    with pytest.raises(ValueError):
        metrics_in(expr)


# --- The inventory and the rules. ---


def test_metric_inventory_is_one_name_per_exporter_under_its_prefix() -> None:
    seen: list[str] = []
    for family in alerts.METRIC_INVENTORY:
        assert family.names, family.exporter
        for name in family.names:
            assert name.startswith(family.prefix), f"{name} is not a {family.exporter} metric ({family.prefix}*)"
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name), name
        seen += family.names
    assert len(seen) == len(set(seen)), "a metric is listed twice"
    assert set(seen) == alerts.KNOWN_METRICS
    assert not RECORDED & alerts.KNOWN_METRICS
    for name in seen:
        assert not any(removed in name for removed in REMOVED_BY_VLLM), name


def test_rule_names_are_unique() -> None:
    names = [*ALERT_NAMES, *(r.record for r in alerts.RECORDING_RULES)]
    assert len(names) == len(set(names))
    for name in ALERT_NAMES:
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", name), name
    for record in RECORDED:
        assert re.fullmatch(r"llm:[a-z0-9_]+:[a-z0-9_]+", record), record


def _rule_of(rendered: Any) -> dict[str, Any]:
    (rule,) = [r for r in manifests_of(rendered, "PrometheusRule") if r["metadata"]["name"] == "llm-serving"]
    return rule


def _rule(stack: str) -> dict[str, Any]:
    return _rule_of(render_stack(stack))


def _rules(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_rule_is_rendered_from_the_lists(stack: str) -> None:
    groups = _rule(stack)["spec"]["groups"]
    assert [g["name"] for g in groups] == [alerts.RECORDING_GROUP, alerts.ALERT_GROUP]
    # Serve's queues of a serve-ingress stack's models first, read by the waiting rules after them.
    models = config(stack).models
    queued = [alerts.SERVE_QUEUED, alerts.SERVE_QUEUED_AVG] * sum(
        config(stack).layout_of(m.service_name) == "serve-ingress" for m in models
    )
    assert [r["record"] for r in groups[0]["rules"]] == queued + [r.record for r in alerts.RECORDING_RULES]
    assert [r["alert"] for r in groups[1]["rules"]] == ALERT_NAMES
    severities = {a.name: a.severity for a in alerts.ALERTS}
    assert {r["alert"]: r["labels"]["severity"] for r in groups[1]["rules"]} == severities


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_every_expression_reads_only_its_declared_known_metrics(stack: str) -> None:
    declared = (
        {a.name: a.metrics for a in alerts.ALERTS}
        | {r.record: r.metrics for r in alerts.RECORDING_RULES}
        | dict(alerts.PER_MODEL_RECORDS)
    )
    for rule in _rules(_rule(stack)):
        name = rule.get("alert") or rule["record"]
        used = metrics_in(rule["expr"])
        assert used == set(declared[name]), f"{name}: reads {sorted(used)}, declares {sorted(declared[name])}"
        # A recording rule reads exporter metrics, or a per-model series recorded before it.
        allowed = (
            alerts.KNOWN_METRICS | set(alerts.PER_MODEL_RECORDS)
            if "record" in rule
            else alerts.KNOWN_METRICS | RECORDED
        )
        assert used <= allowed, f"{name}: not in the metric inventory: {sorted(used - allowed)}"


def _dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from _dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _dashboard_exprs(item)


def test_dashboards_read_recorded_series_or_known_metrics() -> None:
    exprs = [e for body in dashboards.dashboards().values() for e in _dashboard_exprs(json.loads(body))]
    assert exprs
    used = set().union(*(metrics_in(e) for e in exprs))
    assert used <= RECORDED | set(dashboards.DASHBOARD_METRICS), sorted(used - RECORDED)
    assert set(dashboards.DASHBOARD_METRICS) <= alerts.KNOWN_METRICS


def _project_texts() -> Iterator[tuple[Path, str]]:
    for folder in ("infra", "workloads", "policy", "tests/rules"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".yaml", ".yml", ".json", ".md", ".txt"} and "venv" not in path.parts:
                yield path, path.read_text(errors="replace")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        yield path, path.read_text()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_names_vllm_removed_appear_nowhere(stack: str) -> None:
    rendered = render_stack(stack)
    text = json.dumps(rendered.manifests) + json.dumps(rendered.helm) + json.dumps(dashboards.dashboards())
    for removed in REMOVED_BY_VLLM:
        assert removed not in text
    for path, content in _project_texts():
        for removed in REMOVED_BY_VLLM:
            assert removed not in content, f"{path.relative_to(ROOT)} names {removed}"


def test_the_preemption_threshold_is_the_plans_figure_for_a_model_that_allows_preemption() -> None:
    """Rendered as the plan prints it; a model kept within its plan (every committed one) records none."""
    doc = copy.deepcopy(stack_doc("prod"))
    seventy = doc["config"]["llm-platform:models"][1]
    seventy["engine_overrides"]["max_num_seqs"] = 128
    seventy["workload"]["allow_preemption"] = True
    rendered = render_config(doc)
    planned = rendered.outputs["capacity"]["models"][seventy["name"]]["preemption_free_sequences"]
    assert planned < 128
    # The program accepts it, with the plan's warning in the preview's log.
    assert [line for line in rendered.log if line.startswith("preemption ")] == [
        f"preemption {seventy['name']}: max_num_seqs 128 is above the {planned} sequences the KV cache holds at "
        f"once at the workload's p95 (workload.allow_preemption: true): above {planned} running sequences of long "
        f"requests vLLM preempts and recomputes them, and the preemption alerts take {planned} as the load where "
        "it starts"
    ]
    (recording, alerting) = _rule_of(rendered)["spec"]["groups"]
    plan = [r for r in recording["rules"] if r["record"] == alerts.PREEMPTION_FREE]
    labels = {"model_name": seventy["model_id"]}
    assert plan == [{"record": alerts.PREEMPTION_FREE, "expr": f"vector({planned})", "labels": labels}]
    assert [r["record"] for r in recording["rules"]] == [r.record for r in alerts.RECORDING_RULES] + [
        alerts.PREEMPTION_FREE
    ]
    by_alert = {r["alert"]: r for r in alerting["rules"]}
    assert by_alert["LlmRunningAbovePreemptionFree"]["expr"].endswith(f"> on (model_name) {alerts.PREEMPTION_FREE}")
    for stack in ("dev", "prod"):
        recorded = [r.get("record") for g in _rule(stack)["spec"]["groups"] for r in g["rules"]]
        assert not alerts.PLAN_RECORDS & set(recorded)


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
    other = alerts.alert_rules(Slo(ttft_p95_seconds=7.5, gpu_idle_minutes=55), "elsewhere")
    by_other = {r["alert"]: r for r in other}
    assert by_other["LlmTimeToFirstTokenHigh"]["expr"].endswith("> 7.5")
    assert "SLO 7.5s" in by_other["LlmTimeToFirstTokenHigh"]["annotations"]["description"]
    assert by_other["GpuAllocatedButIdle"]["for"] == "55m"
    assert 'namespace="elsewhere"' in by_other["GpuPodsPendingNodeGroupAtMax"]["expr"]


def test_the_new_alerts_watch_the_stacks_namespace() -> None:
    by_other = {r["alert"]: r for r in alerts.alert_rules(Slo(), "elsewhere")}
    for name in ("RayServiceUpgradeStuck", "LlmContainerCrashLooping", "LlmContainerOomKilled"):
        assert 'namespace="elsewhere"' in by_other[name]["expr"], name
        assert 'namespace="llm"' not in by_other[name]["expr"], name


def test_a_stuck_upgrade_outlasts_the_longest_deploy_wait() -> None:
    """The alert fires only after `pulumi up` would have given up waiting for the upgrade."""
    from infra.config import pulumi_wait_seconds

    longest = max(pulumi_wait_seconds(config(stack), config(stack).models) for stack in ("dev", "prod"))
    assert longest <= alerts.UPGRADE_STUCK_MINUTES * 60
    by_alert = {a.name: a for a in alerts.ALERTS}
    assert by_alert["RayServiceUpgradeStuck"].for_ == f"{alerts.UPGRADE_STUCK_MINUTES}m"


def test_the_exporters_the_new_alerts_read_are_installed_and_scraped() -> None:
    """KubeRay's operator metrics, KEDA's operator metrics and kube-state-metrics, each with a monitor."""
    values = {h["chart"]: h["values"] for h in render_stack("prod").helm}
    kuberay_metrics = values["kuberay-operator"]["metrics"]
    assert kuberay_metrics["enabled"] is True and kuberay_metrics["serviceMonitor"]["enabled"] is True
    keda_operator = values["keda"]["prometheus"]["operator"]
    assert keda_operator["enabled"] is True and keda_operator["serviceMonitor"]["enabled"] is True
    # kube-prometheus-stack runs kube-state-metrics unless told not to.
    assert values["kube-prometheus-stack"].get("kubeStateMetrics", {}).get("enabled", True) is True
    families = {f.prefix: f for f in alerts.METRIC_INVENTORY}
    assert "kuberay_service_condition_upgrade_in_progress" in families["kuberay_"].names
    assert {
        "kube_pod_container_status_restarts_total",
        "kube_pod_container_status_last_terminated_reason",
    } <= set(families["kube_"].names)
    assert families["keda_"].names == ("keda_scaler_metrics_value",)


def _sqs_trigger_metrics(scaled_object: dict[str, Any]) -> list[str]:
    """The metric names KEDA gives a ScaledObject's SQS triggers: s<index>-aws-sqs-<queue name>."""
    return [
        f"s{i}-aws-sqs-{t['metadata']['queueURL'].rstrip('/').rsplit('/', 1)[-1]}"
        for i, t in enumerate(scaled_object["spec"]["triggers"])
        if t["type"] == "aws-sqs-queue"
    ]


def test_the_dead_letter_alert_reads_a_trigger_the_batch_scaled_object_has() -> None:
    """Never an alert on a metric nobody emits: KEDA reports the dead-letter queue's depth only for a
    trigger that watches it."""
    rendered = render_stack("prod")
    (scaled,) = [
        s for s in manifests_of(rendered, "ScaledObject") if s["metadata"]["name"] == alerts.BATCH_SCALED_OBJECT
    ]
    dead_letter_url = rendered.outputs["batch_dead_letter_queue_url"]
    by_alert = {r["alert"]: r for r in _rules(_rule("prod")) if "alert" in r}
    assert f'scaledObject="{alerts.BATCH_SCALED_OBJECT}"' in by_alert["BatchDeadLetterQueueNotEmpty"]["expr"]
    pattern = re.compile(alerts.DEAD_LETTER_METRIC)
    metrics = _sqs_trigger_metrics(scaled)
    # The request queue's own trigger never matches.
    request = [
        m
        for m, t in zip(metrics, scaled["spec"]["triggers"], strict=True)
        if t["metadata"]["queueURL"] != dead_letter_url
    ]
    assert request and not any(pattern.fullmatch(m) for m in request)
    watched = [t for t in scaled["spec"]["triggers"] if t["metadata"].get("queueURL") == dead_letter_url]
    assert any(pattern.fullmatch(m) for m in metrics)
    (trigger,) = watched
    # It reports, never scales: never active, and never the HPA's largest demand.
    assert int(trigger["metadata"]["activationQueueLength"]) >= 10**6
    assert int(trigger["metadata"]["queueLength"]) >= 10**6


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


# --- the vllm-server layout: vLLM's own registry, read by the same rules. ---


def _relabel(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """One Prometheus `replace` relabeling (anchored regex, `${n}` groups, `;`-joined sources)."""
    assert rule["action"] == "replace"
    value = ";".join(labels.get(name, "") for name in rule["sourceLabels"])
    match = re.fullmatch(rule.get("regex", "(.*)"), value)
    if match is None:
        return labels
    replacement = re.sub(r"\$\{(\d+)\}", r"\\\1", rule.get("replacement", "$1").replace("$1", "${1}"))
    return {**labels, rule["targetLabel"]: match.expand(replacement)}


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_vllm_server_pods_are_scraped_on_their_vllm_registry(stack: str) -> None:
    cfg = config(stack)
    direct = sorted(name for name, layout in cfg.layouts().items() if layout == "vllm-server")
    monitors = {m["metadata"]["name"]: m for m in manifests_of(render_stack(stack), "PodMonitor")}
    if not direct:
        assert alerts.VLLM_SERVER_MONITOR not in monitors
        return
    spec = monitors[alerts.VLLM_SERVER_MONITOR]["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [cfg.serving.namespace]}
    assert spec["selector"]["matchLabels"]["ray.io/node-type"] == "worker"
    assert spec["selector"]["matchExpressions"] == [
        {"key": "llm-platform/ray-service", "operator": "In", "values": direct}
    ]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == RAY_PORTS.vllm_metrics.name
    # The RayService's name is the application, as Serve names its own (serve_config: one app per RayService).
    (relabel,) = endpoint["relabelings"]
    pod = {"__meta_kubernetes_pod_label_llm_platform_ray_service": direct[0]}
    assert _relabel(relabel, pod)["application"] == direct[0]
    for rs in manifests_of(render_stack(stack), "RayService"):
        app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["name"]
        assert app == rs["metadata"]["name"]


def test_vllms_own_names_become_the_names_the_rules_read() -> None:
    """Every `ray_vllm_` series the rules read is a `vllm:` series vLLM's own registry exports."""
    (rename,) = alerts.vllm_server_pod_monitor("llm", {}, ["m"])["spec"]["podMetricsEndpoints"][0]["metricRelabelings"]
    assert rename == alerts.VLLM_RENAME
    (family,) = [f for f in alerts.METRIC_INVENTORY if f.prefix == "ray_vllm_"]
    for name in family.names:
        own = "vllm:" + name.removeprefix("ray_vllm_")
        assert _relabel(rename, {"__name__": own})["__name__"] == name
    # Other series keep their names (vLLM's HTTP counter among them).
    assert _relabel(rename, {"__name__": "http_requests_total"})["__name__"] == "http_requests_total"
    assert _relabel(rename, {"__name__": "xvllm:a"})["__name__"] == "xvllm:a"
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed: its metric names were not read")
    loggers = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    for name in family.names:
        base = re.sub(r"_(bucket|total)$", "", name.removeprefix("ray_vllm_"))
        assert f'"vllm:{base}"' in loggers, f"vLLM {spec.origin} has no vllm:{base}"
    # The label the rules group by is vLLM's own.
    assert 'labelnames = ["model_name", "engine"]' in loggers


def test_vllms_http_counter_has_the_labels_the_rules_read() -> None:
    """prometheus-fastapi-instrumentator, as vLLM attaches it: handler, method, status grouped as "5xx"."""
    instrumentator = pytest.importorskip("prometheus_fastapi_instrumentator")
    import inspect

    params = inspect.signature(instrumentator.Instrumentator.__init__).parameters
    assert params["should_group_status_codes"].default is True
    source = inspect.getsource(importlib.import_module("prometheus_fastapi_instrumentator.metrics"))
    # The counter `.add()` registers (the instrumentator's `default` metrics).
    assert 'name="http_requests_total"' in source
    for label in ("handler", "method", "status"):
        assert f'label_names.append("{label}")' in source
    (rule,) = [r for r in alerts.RECORDING_RULES if r.record == alerts.HTTP_5XX_RATIO]
    assert 'status="5xx"' in rule.expr


# --- promtool: every rule checked, every alert fired and kept quiet by a case. ---


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


CASE_FILES = sorted(RULES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("case", [p.name for p in CASE_FILES])
def test_promtool_rule_cases(case: str, tmp_path: Path) -> None:
    promtool = _promtool()
    rule = alerts.prometheus_rule(
        CASE_SLO, CASE_NAMESPACE, {}, preemption_free=CASE_PREEMPTION_FREE, serve_queues=CASE_SERVE_QUEUES
    )
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


def _case_tests() -> list[dict[str, Any]]:
    return [test for path in CASE_FILES for test in yaml.safe_load(path.read_text())["tests"]]


def _alert_cases() -> list[dict[str, Any]]:
    return [case for test in _case_tests() for case in test.get("alert_rule_test", [])]


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_every_alert_has_a_promtool_case_that_fires_it_and_one_that_does_not(alert: str) -> None:
    cases = [c for c in _alert_cases() if c["alertname"] == alert]
    assert any(c.get("exp_alerts") for c in cases), f"no case in {RULES_DIR.name}/ fires {alert}"
    assert any(not c.get("exp_alerts") for c in cases), f"no case in {RULES_DIR.name}/ keeps {alert} quiet"


def test_promtool_cases_name_only_alerts_and_metrics_that_exist() -> None:
    # A case for a renamed alert would pass forever: it expects no alert and gets none.
    assert {c["alertname"] for c in _alert_cases()} <= set(ALERT_NAMES)
    for test in _case_tests():
        for series in test["input_series"]:
            name = metrics_in(series["series"])
            assert name <= alerts.KNOWN_METRICS | RECORDED, series["series"]


# --- The alert table of docs/operations.md, generated from the list. ---

ALERTS_PAGE = ROOT / "docs" / "operations.md"
TABLE_BEGIN = "<!-- alert table: generated from infra/serving/alerts.py by tests/test_serving_alerts.py -->"
TABLE_END = "<!-- end of alert table -->"
# With this set (outside CI), the page test writes the table instead of comparing it.
UPDATE_ENV = "UPDATE_DOCS_ALERTS"


def _page_text(template: str) -> str:
    """A Prometheus template as Markdown text: `{{ $labels.pod }}` -> *pod*."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", r"*\1*", template)
    text = re.sub(r"\{\{\s*\$value[^}]*\}\}", "*value*", text)
    assert "{{" not in text, template
    return text.replace("|", "\\|")


def alert_table() -> str:
    """The alert table (`for` with the default SLOs), each alert linked to its runbook."""
    ctx = alerts.RuleContext(slo=Slo(), namespace=CASE_NAMESPACE)
    # The runbook link relative to the file holding the table, as the page's own link would be.
    runbooks = Path(os.path.relpath(ROOT / alerts.RUNBOOK_DIR, ALERTS_PAGE.parent)).as_posix()
    rows = [
        f"| `{a.name}` | {a.severity} | {a.rule(ctx)['for']} | {_page_text(a.summary)} "
        f"| [runbook]({runbooks}/{a.name}.md) |"
        for a in alerts.ALERTS
    ]
    return "\n".join(["| alert | severity | for | summary | runbook |", "|---|---|---|---|---|", *rows])


def test_operations_alert_table_is_generated_from_the_list() -> None:
    text = ALERTS_PAGE.read_text()
    assert text.count(TABLE_BEGIN) == 1 and text.count(TABLE_END) == 1, (
        "docs/operations.md lost the alert table markers"
    )
    head, rest = text.split(TABLE_BEGIN)
    current, tail = rest.split(TABLE_END)
    wanted = f"\n{alert_table()}\n"
    if os.environ.get(UPDATE_ENV) and not os.environ.get("CI"):
        ALERTS_PAGE.write_text(f"{head}{TABLE_BEGIN}{wanted}{TABLE_END}{tail}")
        return
    assert current == wanted, (
        f"docs/operations.md's alert table is not alerts.ALERTS; rewrite it with "
        f"{UPDATE_ENV}=1 venv/bin/python -m pytest -q tests/test_serving_alerts.py -k operations_alert_table"
    )


def test_the_alert_table_names_every_alert_once() -> None:
    names = re.findall(r"^\| `(\w+)` \|", alert_table(), flags=re.MULTILINE)
    assert names == ALERT_NAMES


def test_prometheus_rule_matches_the_pinned_crd() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path = reference_dir() / "kube-prometheus-stack" / "crd-prometheusrules.yaml"
    crd = yaml.safe_load(path.read_text())
    jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(_rule("prod"))
    path = REFERENCE / "kube-prometheus-stack" / "crd-podmonitors.yaml"
    crd = yaml.safe_load(path.read_text())
    for monitor in manifests_of(render_stack("prod"), "PodMonitor"):
        jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(monitor)


@pytest.mark.parametrize("model_id", ["llama-3.1-8b-instruct", "meta-llama/Llama-3.3-70B-Instruct", "a.b/c.d:e"])
def test_the_serve_queue_rule_names_the_deployment_ray_serve_llm_builds(model_id: str) -> None:
    """The per-model rule selects the handles' series by the deployment name Ray Serve LLM gives the model."""
    from types import SimpleNamespace

    from ray.llm._internal.serve.core.server.builder import _get_deployment_name

    from workloads.inference_server.app import LLMServer

    ray_name = f"{LLMServer.__name__}:" + _get_deployment_name(SimpleNamespace(model_id=model_id))
    assert serve_llm_deployment_name(model_id) == ray_name
    (total, mean) = alerts.serve_queue_rules({model_id: alerts.ServeQueue("llm", "app", ray_name)})
    assert f'deployment="{ray_name}"' in total["expr"] and total["labels"] == {"model_name": model_id}
    assert (total["record"], mean["record"]) == (alerts.SERVE_QUEUED, alerts.SERVE_QUEUED_AVG)


def test_a_serve_ingress_model_waits_in_serve_and_a_vllm_server_one_does_not() -> None:
    """Dev's one model on Serve's ingress (SERVE_INGRESS) gets Serve's queue rules for its own app and
    deployment; the committed stacks' models (vllm-server: the guard refuses past the cap, nothing waits
    in Serve) get none."""
    variant = config(SERVE_INGRESS)
    model = variant.models[0]
    records = [r for r in _rules(_rule(SERVE_INGRESS)) if r.get("record") == alerts.SERVE_QUEUED]
    assert [r["labels"]["model_name"] for r in records] == [model.model_id]
    assert f'application="{model.service_name}"' in records[0]["expr"]
    assert f'namespace="{variant.serving.namespace}"' in records[0]["expr"]
    assert not [r for r in _rules(_rule("dev")) if r.get("record") == alerts.SERVE_QUEUED]
    assert not [r for r in _rules(_rule("prod")) if r.get("record") == alerts.SERVE_QUEUED]
