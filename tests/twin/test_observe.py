"""The twin's monitoring run, without Ray: the rules it loads, the faults it owns, the series it expects."""

from __future__ import annotations

import datetime
import io
import time
import types
from typing import cast

import pytest

from infra.serving import alerts
from localserve.traffic import StreamLoad
from tests.harness import SERVE_INGRESS, manifests_of, render_stack
from twin import observe
from twin.prometheus import (
    FOR_CEILING_S,
    FOR_FACTOR,
    Alert,
    TwinPrometheus,
    as_duration,
    duration_s,
    longest_window_s,
    rule_groups,
    scaled_ranges,
)
from twin.report import Report


@pytest.mark.parametrize(("text", "seconds"), [("10m", 600), ("0m", 0), ("1h30m", 5400), ("250ms", 0.25)])
def test_durations_read_as_prometheus_reads_them(text: str, seconds: float) -> None:
    assert duration_s(text) == seconds


@pytest.mark.parametrize("text", ["10", "m", "5 m", "1.5m"])
def test_a_malformed_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        duration_s(text)


def test_scaled_durations_keep_milliseconds() -> None:
    assert as_duration(600 * FOR_FACTOR) == "10s"
    assert as_duration(0.25) == "250ms"


def test_every_for_is_scaled_by_the_one_factor_up_to_the_ceiling() -> None:
    objects = manifests_of(render_stack("prod"), "PrometheusRule")
    rendered = {r["alert"]: r["for"] for o in objects for g in o["spec"]["groups"] for r in g["rules"] if "alert" in r}
    scaled = {r["alert"]: r["for"] for g in rule_groups(objects) for r in g["rules"] if "alert" in r}
    assert set(scaled) == set(rendered) == {a.name for a in alerts.ALERTS}
    for name, text in rendered.items():
        want = min(duration_s(text) * FOR_FACTOR, FOR_CEILING_S)
        assert duration_s(scaled[name]) == pytest.approx(want, abs=0.001), name
    # The ceiling bites only above it: the 60m wait is cut, the 15m one is not.
    assert (
        duration_s(scaled["RayServiceUpgradeStuck"])
        == FOR_CEILING_S
        < duration_s(rendered["RayServiceUpgradeStuck"]) * FOR_FACTOR
    )
    longest_below = max(duration_s(f) for f in scaled.values() if duration_s(f) < FOR_CEILING_S)
    assert 2 * longest_below <= FOR_CEILING_S, (
        "an alert that must stay quiet through another's wait needs twice its own"
    )


def test_range_windows_are_scaled_like_for_but_not_below_the_floor() -> None:
    objects = manifests_of(render_stack("prod"), "PrometheusRule")
    rendered = [r["expr"] for o in objects for g in o["spec"]["groups"] for r in g["rules"]]
    scaled = [r["expr"] for g in rule_groups(objects) for r in g["rules"]]
    assert any("[5m]" in e for e in rendered)
    assert not any("[5m]" in e for e in scaled)
    assert sum(e.count("[30s]") for e in scaled) == sum(
        e.count("[1m]") + e.count("[2m]") + e.count("[5m]") + e.count("[15m]") for e in rendered
    )
    # A window already shorter than the floor is kept; a long one scales past it.
    assert scaled_ranges("rate(x[10s]) / rate(y[1h30m])") == "rate(x[10s]) / rate(y[90s])"


def test_every_alert_has_a_fault_here_or_a_reason_it_can_not_fire() -> None:
    for spec in alerts.ALERTS:
        reason = observe.alert_absent_reason(spec)
        assert (spec.name in observe.FAULT_OF) != (reason is not None), spec.name
    assert set(observe.FAULT_OF.values()) == set(observe.FAULTS)


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_twins_stacks_record_no_plan_threshold_so_the_overload_fires_the_preemption_alert(stack: str) -> None:
    """The overload preempts on the tiny model's cache: LlmRequestsPreempted must fire on any preemption there,
    which holds while no model of the stack records the plan's load (none allows preemption)."""
    groups = rule_groups(manifests_of(render_stack(stack), "PrometheusRule"))
    assert not [r for g in groups for r in g["rules"] if r.get("record") in alerts.PLAN_RECORDS]
    assert observe.FAULT_OF["LlmRequestsPreempted"] == observe.OVERLOAD
    assert "LlmRunningAbovePreemptionFree" not in observe.FAULT_OF
    assert observe.inventory_metrics([alerts.PREEMPTION_FREE, alerts.REQUESTS_RUNNING_MAX]) == {
        "ray_vllm_num_requests_running"
    }


def test_the_series_expected_follow_each_layout() -> None:
    ingress, _ = observe.expected_here({"serve-ingress"})
    server, absent = observe.expected_here({"vllm-server"})
    assert "ray_serve_num_http_requests_total" in ingress and "http_requests_total" not in ingress
    assert "http_requests_total" in server and "ray_serve_num_http_requests_total" not in server
    assert "ray_vllm_num_preemptions_total" in ingress & server
    assert "DCGM_FI_DEV_GPU_UTIL" in absent
    # The KubeRay operator's RayService metrics come from the mirror's exporter (observe.OperatorExporter).
    assert "kuberay_service_condition_ready" in ingress & server


def test_every_metric_read_is_in_the_inventory() -> None:
    assert observe.metrics_read() <= alerts.KNOWN_METRICS
    assert observe.inventory_metrics([alerts.HTTP_5XX_RATIO]) == {
        "ray_serve_num_http_requests_total",
        "http_requests_total",
    }


@pytest.mark.parametrize(("per_key", "replica", "keys"), [(8, 64, 8), (8, 48, 6), (3, 10, 4), (8, 500, 20)])
def test_the_overload_fills_the_replica_with_every_key_within_its_cap(per_key: int, replica: int, keys: int) -> None:
    traffic = observe.Traffic(
        model_id="m",
        api_key="main",
        base_urls=list,
        server_pids=list,
        client_keys=[f"k{i}" for i in range(32)],
        per_key_cap=per_key,
        replica_cap=replica,
    )
    loads = observe.overload(traffic, "http://127.0.0.1:1/v1", through_ingress=False)
    assert sum(load.streams for load in loads) == min(replica, observe.OVERLOAD_STREAMS)
    assert len(loads) == keys and len({load.api_key for load in loads}) == keys
    assert all(0 < load.streams <= per_key for load in loads)
    assert all(load.distinct and load.api_key != "main" for load in loads)
    assert {load.max_tokens for load in loads} == {observe.OVERLOAD_MAX_TOKENS}


def test_the_overload_through_the_ingress_sends_longer_answers() -> None:
    traffic = observe.Traffic(
        model_id="m", api_key="main", base_urls=list, server_pids=list, client_keys=["k0", "k1"], replica_cap=4
    )
    direct = observe.overload(traffic, "http://127.0.0.1:1/v1", through_ingress=False)
    ingress = observe.overload(traffic, "http://127.0.0.1:1/v1", through_ingress=True)
    assert [load.max_tokens for load in ingress] == [observe.OVERLOAD_MAX_TOKENS_INGRESS] * len(ingress)
    assert observe.OVERLOAD_MAX_TOKENS_INGRESS > observe.OVERLOAD_MAX_TOKENS
    assert [load.streams for load in ingress] == [load.streams for load in direct]


class _Alerts:
    """A Prometheus whose alerts API answers from a script, one answer per call."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)

    def alerts(self) -> list[Alert]:
        names = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [Alert(name=n, state="pending", labels={}, active_at="") for n in names]


def test_a_fault_waits_for_its_alerts_to_be_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe.time, "sleep", lambda _s: None)
    prom = _Alerts(["LlmRequestsWaiting", "GpuXidError"], ["LlmRequestsWaiting"], ["GpuXidError"])
    active, _ = observe.wait_quiet(cast(TwinPrometheus, prom), ["LlmRequestsWaiting"], timeout_s=60)
    assert active == []
    assert prom.answers == [["GpuXidError"]]  # it asked until the one it waits for was gone


def test_a_fault_whose_alerts_stay_active_names_them() -> None:
    prom = _Alerts(["LlmRequestsWaiting"])
    active, waited = observe.wait_quiet(cast(TwinPrometheus, prom), ["LlmRequestsWaiting", "Other"], timeout_s=0)
    assert active == ["LlmRequestsWaiting"]
    assert waited >= 0


def test_prometheus_active_at_reads_to_the_microsecond() -> None:
    assert observe._epoch("2026-12-03T10:30:01.123456789Z") == pytest.approx(1796293801.123457, abs=1e-6)
    assert observe._epoch("2026-12-03T10:30:01Z") == 1796293801.0


def test_an_alert_pending_before_its_fault_is_not_counted_as_the_faults() -> None:
    out = io.StringIO()
    report = Report(out=out)
    fired = {"Early": observe.Fired(after_s=0.4, pending_from_s=-12.0), "Late": observe.Fired(9.0, 0.6)}
    fors = {"Early": 10.0, "Late": 10.0, "Never": 10.0}
    observe.report_fault("svc", report, "overload", "load", fired, fors)
    lines = {line.split(":")[0].split()[-1]: line for line in out.getvalue().splitlines()}
    assert "already pending 12s before fault overload" in lines["Early"] and lines["Early"].startswith("FAIL")
    assert "fired 9s into fault overload, pending from 1s" in lines["Late"] and lines["Late"].startswith("PASS")
    assert "did not fire" in lines["Never"] and lines["Never"].startswith("FAIL")
    assert len(report.failed) == 2


class _Firing:
    """A Prometheus with one firing alert that began pending at ``active``."""

    def __init__(self, active: float) -> None:
        stamp = datetime.datetime.fromtimestamp(active, tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        self.alert = Alert(name="LlmRequestsWaiting", state="firing", labels={}, active_at=stamp)

    def firing(self) -> dict[str, list[Alert]]:
        return {self.alert.name: [self.alert]}


def test_a_fault_that_began_before_the_wait_counts_from_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe.time, "sleep", lambda _s: None)
    now_mono, now_wall = time.monotonic(), time.time()
    prom = _Firing(active=now_wall - 5)
    # The overload's streams began 10 s before the wait: pending from 5 s into it, not 5 s before it.
    fired = observe.wait_firing(cast(TwinPrometheus, prom), ["LlmRequestsWaiting"], 60, (now_mono - 10, now_wall - 10))
    assert fired["LlmRequestsWaiting"].pending_from_s == pytest.approx(5, abs=0.5)
    assert fired["LlmRequestsWaiting"].after_s >= 10
    unanchored = observe.wait_firing(cast(TwinPrometheus, prom), ["LlmRequestsWaiting"], 60)
    assert unanchored["LlmRequestsWaiting"].pending_from_s == pytest.approx(-5, abs=0.5)


def test_the_overloads_alerts_get_time_to_fill_the_kv_cache_and_other_faults_do_not() -> None:
    fors = {"LlmKvCacheNearlyFull": 15.0, "LlmRequestsWaiting": 10.0}
    base = 15.0 + observe.FIRE_SLACK_S
    assert observe.fire_timeout(observe.OVERLOAD, fors) == base + observe.OVERLOAD_FILL_S
    assert observe.fire_timeout(observe.KILL_SERVER, fors) == base


class _SeriesProm:
    """Answers the series query from a script: per metric, the reads (1-based) from which it has a series."""

    def __init__(self, present_from: dict[str, int]) -> None:
        self.present_from = present_from
        self.reads: dict[str, int] = {}

    def query(self, expr: str) -> list[object]:
        metric = expr.removeprefix("count(last_over_time(").removesuffix(f"[{observe.SERIES_LOOKBACK}]))")
        assert expr == observe.series_query(metric), expr
        self.reads[metric] = self.reads.get(metric, 0) + 1
        first = self.present_from.get(metric, 1)
        return [object()] if 0 < first <= self.reads[metric] else []


def _series_report(prom: _SeriesProm) -> tuple[bool, str]:
    out = io.StringIO()
    report = Report(out=out)
    observe.check_series("svc", cast(TwinPrometheus, prom), report, {"serve-ingress"})
    return not report.failed, out.getvalue()


def test_a_series_one_failed_scrape_left_stale_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe, "SCRAPE_INTERVAL", "10ms")
    want, _ = observe.expected_here({"serve-ingress"})
    flaky = sorted(want)[0]
    ok, text = _series_report(_SeriesProm({flaky: 3}))
    assert ok, text


def test_a_series_that_never_comes_fails_and_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe, "SCRAPE_INTERVAL", "10ms")
    monkeypatch.setattr(observe, "SERIES_RETRY_S", 0.2)
    want, _ = observe.expected_here({"serve-ingress"})
    gone = sorted(want)[0]
    prom = _SeriesProm({gone: 0})
    started = time.monotonic()
    ok, text = _series_report(prom)
    assert not ok and f"no live series for {gone}" in text
    assert prom.reads[gone] > 2 and time.monotonic() - started < 5


def test_the_steady_state_waits_out_the_rules_longest_window() -> None:
    groups = rule_groups(manifests_of(render_stack("dev"), "PrometheusRule"))
    # Every rendered window is 5m, scaled to the 30 s floor: a cold start stays that long in a rate.
    assert longest_window_s(groups) == 30.0
    longer = [{"rules": [{"expr": "rate(a[30s]) > 1"}, {"expr": "sum_over_time(b[1m30s]) + rate(c[5s])"}]}]
    assert longest_window_s(longer) == 90.0
    assert longest_window_s([{"rules": [{"expr": "up == 0"}]}]) == 0.0


class _GaugeAfter:
    """A Prometheus whose serving gauge appears ``after_s`` seconds after its first query."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.first: float | None = None

    def query(self, expr: str) -> list[dict[str, object]]:
        self.first = self.first if self.first is not None else time.monotonic()
        return [{"value": [0, "1"]}] if time.monotonic() - self.first >= self.after_s else []


@pytest.mark.parametrize(("gauge_after_s", "settled_s"), [(0.0, observe.SETTLE_S), (0.4, 30.0)])
def test_the_steady_state_waits_out_the_windows_only_after_a_wake_under_its_load(
    monkeypatch: pytest.MonkeyPatch, gauge_after_s: float, settled_s: float
) -> None:
    # A replica already serving (prod's; one the live checks woke) has no cold start in any rate window;
    # one that woke for the steady load has, until the longest window has passed.
    monkeypatch.setattr(observe, "WARM_WITHIN_S", 0.2)
    slept: list[float] = []
    # time.sleep is the one module function: wait_for's polls land here too, and the settle last.
    monkeypatch.setattr(observe.time, "sleep", slept.append)
    obs = cast(observe.Observed, types.SimpleNamespace(name="svc"))
    observe.wait_serving(
        obs, cast(TwinPrometheus, _GaugeAfter(gauge_after_s)), Report(out=io.StringIO()), after_wake_s=30.0
    )
    assert slept[-1:] == [settled_s]


class _FiringInSteadyState:
    def alerts(self) -> list[Alert]:
        labels = {"alertname": "LlmTimeToFirstTokenHigh", "model_name": "m"}
        return [Alert(name="LlmTimeToFirstTokenHigh", state="firing", labels=labels, active_at="", value="4.2e+00")]


class _Served:
    def done(self) -> list[object]:
        return [type("O", (), {"ok": True})() for _ in range(3)]

    def last_error(self) -> str:
        return ""


def test_a_steady_state_that_fires_says_what_at_which_value() -> None:
    out = io.StringIO()
    report = Report(out=out)
    observe.check_steady(
        "svc", cast(TwinPrometheus, _FiringInSteadyState()), report, cast(StreamLoad, _Served()), hold_s=0.5
    )
    assert report.failed
    line = out.getvalue()
    assert (
        "steady state: firing LlmTimeToFirstTokenHigh" in line and "at 4.2e+00" in line and "3 requests served" in line
    )


class _Serving(_Alerts):
    """A Prometheus where a replica serves, and whose alerts answer from a script."""

    def __init__(self, *answers: list[str]) -> None:
        super().__init__(*answers)
        self.asked = 0

    def query(self, expr: str) -> list[dict[str, object]]:
        return [{"value": [0, "1"]}] if expr.startswith("count(") else []

    def alerts(self) -> list[Alert]:
        self.asked += 1
        return super().alerts()


def _engine_fault(monkeypatch: pytest.MonkeyPatch, prom: _Serving) -> tuple[list[int], tuple[int | None, list[str]]]:
    """Runs kill_engine_when_quiet on ``prom``; the alerts calls made before each kill, and its result."""
    monkeypatch.setattr(observe.time, "sleep", lambda _s: None)
    kills: list[int] = []

    def kill(_traffic: observe.Traffic) -> int:
        kills.append(prom.asked)
        return 4242

    monkeypatch.setattr(observe, "engine_death", kill)
    obs = cast(observe.Observed, types.SimpleNamespace(name="svc", traffic=None))
    report = Report(out=io.StringIO())
    result = observe.kill_engine_when_quiet(obs, cast(TwinPrometheus, prom), report, ["LlmHttp5xxRatioHigh"])
    return kills, result


def test_the_engine_dies_only_once_the_5xx_alert_a_going_replica_raised_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prom = _Serving(["LlmHttp5xxRatioHigh"], ["LlmHttp5xxRatioHigh"], [])
    kills, (engine, active) = _engine_fault(monkeypatch, prom)
    assert (engine, active) == (4242, [])
    assert kills == [3]  # after the third look at the alerts, the first that found it quiet


def test_the_engine_is_left_alone_while_the_5xx_alert_stays_active(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observe, "QUIET_TIMEOUT_S", 0.0)
    kills, (engine, active) = _engine_fault(monkeypatch, _Serving(["LlmHttp5xxRatioHigh"]))
    assert (engine, active) == (None, ["LlmHttp5xxRatioHigh"])
    assert kills == []


class _Series:
    """A Prometheus stand-in that answers an instant query with a series only for the queries given."""

    def __init__(self, answered: set[str]) -> None:
        self.answered = answered
        self.asked: list[str] = []

    def query(self, expr: str) -> list[dict[str, object]]:
        self.asked.append(expr)
        return [{"metric": {}, "value": [0, "3"]}] if expr in self.answered else []


def test_a_per_model_record_whose_selector_matches_nothing_fails() -> None:
    # The serve-ingress example records Serve's queue per model; vllm-server stacks record none.
    objects = manifests_of(render_stack(SERVE_INGRESS), "PrometheusRule")
    model = "llama-3.1-8b-instruct"
    both = {f'{alerts.SERVE_QUEUED}{{model_name="{model}"}}', f'{alerts.SERVE_QUEUED_AVG}{{model_name="{model}"}}'}
    out = io.StringIO()
    observe.check_per_model_records("svc", cast(TwinPrometheus, _Series(both)), Report(out=out), objects)
    assert out.getvalue().startswith("PASS") and model in out.getvalue()
    out = io.StringIO()
    one = {f'{alerts.SERVE_QUEUED}{{model_name="{model}"}}'}
    observe.check_per_model_records("svc", cast(TwinPrometheus, _Series(one)), Report(out=out), objects)
    assert out.getvalue().startswith("FAIL") and f"{alerts.SERVE_QUEUED_AVG} of {model}" in out.getvalue()
    for stack in ("dev", "prod"):
        rules = manifests_of(render_stack(stack), "PrometheusRule")
        silent = _Series(set())
        observe.check_per_model_records("svc", cast(TwinPrometheus, silent), Report(out=io.StringIO()), rules)
        assert silent.asked == [], stack  # the committed stacks' vllm-server models record none
