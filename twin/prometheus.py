"""A real ``prometheus`` for the twin: the operator's scrape jobs, the rendered rules, file-based discovery.

What changes from the cluster, each printed as a substitution line:

* discovery: ``file_sd_configs`` instead of Kubernetes SD (twin.prometheus_operator);
  the twin writes each live process as the target its pod's port would be;
* time: every ``for`` is multiplied by one factor, and the scrape and rule
  evaluation intervals are shortened, so minutes of a cluster are seconds
  here. Rate windows (``[5m]``) stay as rendered: with a short scrape
  interval they hold enough samples from the first seconds.

Everything else (selection, relabelling, metric renames, the rules' PromQL)
is what Prometheus itself does with the rendered objects.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from localserve.processes import Child, child_env, free_port
from twin import kuberay as mirror
from twin import prometheus_operator

# 10m -> 10 s: a fault is seen within seconds of its alert's own wait, scaled.
FOR_FACTOR = 1 / 60
# And never longer than this: a scaled 60m (RayServiceUpgradeStuck) held the
# twin a minute for nothing once the upgrade was stuck, and the steady state
# holds for the longest `for`. 30 s is still twice the next longest (15m ->
# 15 s), so the alerts that must stay quiet through it are still seen quiet
# for longer than their own wait.
FOR_CEILING_S = 30.0
# Not 1s: on a loaded two-core machine Ray's metrics agents and an
# overloaded vLLM server take about a second to answer, and a timed-out
# scrape drops the series, which resets every alert's `for` (seen with 1s:
# the KV-cache alert never held, and the head's target fell out after a kill).
SCRAPE_INTERVAL = "3s"
EVALUATION_INTERVAL = "1s"
# Range selectors ([5m]) are scaled like `for`, so a fault's series leave the
# window as quickly as its alert's wait passes and the next fault starts from
# quiet rules; never below ten scrapes, as a rate() over a few samples flaps.
WINDOW_FLOOR_S = 30.0
_RANGE = re.compile(r"\[(\d+(?:ms|[smhdwy]))+\]")
READY_TIMEOUT_S = 30.0
MONITOR_KINDS = ("PodMonitor", "ServiceMonitor")

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


class PrometheusMissingError(RuntimeError):
    """No ``prometheus`` binary on PATH."""


def duration_s(text: str) -> float:
    """A Prometheus duration (``1h30m``, ``10m``, ``0m``) in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


def as_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration, to the millisecond."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def load_objects(render_dir: Path) -> list[dict[str, Any]]:
    """Every object of the render's ``manifests.yaml``, and those a mirrored chart makes of its release.

    The KubeRay operator's chart makes the operator's pod, Service and
    ServiceMonitor from the release's values (twin.kuberay.OperatorRelease):
    its RayService metrics are what the RayService alerts read.
    """
    docs = yaml.safe_load_all((render_dir / "manifests.yaml").read_text())
    objects = [doc for doc in docs if isinstance(doc, dict)]
    helm = render_dir / "helm.yaml"
    releases = [d for d in yaml.safe_load_all(helm.read_text()) if isinstance(d, dict)] if helm.is_file() else []
    for release in releases:
        if release.get("chart") == mirror.CHART_NAME:
            operator = mirror.OperatorRelease.from_release(release)
            made = [operator.pod(), operator.service(), operator.service_monitor()]
            objects += [obj for obj in made if obj is not None]
    return objects


def monitors(objects: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The PodMonitors and ServiceMonitors of a render."""
    return [dict(o) for o in objects if o.get("kind") in MONITOR_KINDS]


def scaled_for_s(for_s: float, factor: float = FOR_FACTOR) -> float:
    """A rule's `for`, scaled, but not above the ceiling."""
    return min(for_s * factor, FOR_CEILING_S)


def scaled_window_s(window_s: float, factor: float = FOR_FACTOR) -> float:
    """A range selector's window, scaled, but not below the floor (nor above the window itself)."""
    return max(window_s * factor, min(window_s, WINDOW_FLOOR_S))


def scaled_ranges(expr: str, factor: float = FOR_FACTOR) -> str:
    """``expr`` with every range selector's window scaled (``rate(x[5m])`` -> ``rate(x[30s])``)."""
    return _RANGE.sub(lambda m: f"[{as_duration(scaled_window_s(duration_s(m.group(0)[1:-1]), factor))}]", expr)


def longest_window_s(groups: Iterable[Mapping[str, Any]]) -> float:
    """The longest range selector's window in these (already scaled) rule groups, in seconds."""
    return max(
        (
            duration_s(m.group(0)[1:-1])
            for g in groups
            for r in g.get("rules") or []
            for m in _RANGE.finditer(str(r.get("expr", "")))
        ),
        default=0.0,
    )


def rule_groups(objects: Iterable[Mapping[str, Any]], factor: float = FOR_FACTOR) -> list[dict[str, Any]]:
    """Every PrometheusRule group, each `for` and range window scaled, evaluated at the twin's interval."""
    groups = []
    for obj in objects:
        if obj.get("kind") != "PrometheusRule":
            continue
        for group in obj["spec"]["groups"]:
            scaled = copy.deepcopy(group)
            scaled["interval"] = EVALUATION_INTERVAL
            for rule in scaled["rules"]:
                rule["expr"] = scaled_ranges(str(rule["expr"]), factor)
                if "for" in rule:
                    rule["for"] = as_duration(scaled_for_s(duration_s(rule["for"]), factor))
            groups.append(scaled)
    return groups


def scaled_jobs(jobs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The operator's jobs with the twin's scrape interval (timeouts may not exceed it)."""
    out = []
    for job in jobs:
        copied = dict(job)
        copied["scrape_interval"] = SCRAPE_INTERVAL
        copied["scrape_timeout"] = SCRAPE_INTERVAL
        out.append(copied)
    return out


@dataclass(frozen=True)
class Alert:
    """One alert as Prometheus' API reports it."""

    name: str
    state: str
    labels: dict[str, str]
    active_at: str
    # The expression's value when the rule last ran, as the API writes it.
    value: str = ""


@dataclass
class TwinPrometheus:
    """``prometheus`` on 127.0.0.1 with the render's monitors and rules, until :meth:`stop`."""

    workdir: Path
    objects: list[dict[str, Any]]
    factor: float = FOR_FACTOR
    port: int = field(default_factory=free_port)
    child: Child | None = None

    @property
    def sd_dir(self) -> Path:
        """Where the twin writes the file-SD targets."""
        return self.workdir / "sd"

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def substitutions(self) -> list[str]:
        """What differs from the cluster's Prometheus, one line each."""
        jobs = self.jobs()
        return [
            f"prometheus: {len(jobs)} scrape jobs generated from {len(monitors(self.objects))} monitors as the "
            "Prometheus Operator generates them; kubernetes_sd_configs -> file_sd_configs of the live twin processes",
            f"prometheus: every rule's `for` x {self.factor:.4g} (10m -> {as_duration(600 * self.factor)}) "
            f"but not above {as_duration(FOR_CEILING_S)} (60m -> {as_duration(scaled_for_s(3600, self.factor))}), "
            f"every range selector's window too, but not below {as_duration(WINDOW_FLOOR_S)} "
            f"([5m] -> [{as_duration(scaled_window_s(300, self.factor))}]); "
            f"scrape interval -> {SCRAPE_INTERVAL}, rule evaluation interval -> {EVALUATION_INTERVAL}",
        ]

    def jobs(self) -> list[dict[str, Any]]:
        """The scrape jobs Prometheus runs here."""
        return scaled_jobs(prometheus_operator.scrape_jobs(monitors(self.objects), self.sd_dir))

    def config(self) -> dict[str, Any]:
        """prometheus.yml."""
        return {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": EVALUATION_INTERVAL},
            "rule_files": [str(self.workdir / "rules.yaml")],
            "scrape_configs": self.jobs(),
        }

    def start(self) -> None:
        """Writes the config, rules and empty target files, then starts the server and waits until it is ready."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusMissingError("prometheus is not installed (Debian: apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sd_dir.mkdir(exist_ok=True)
        prometheus_operator.write_sd_files(self.sd_dir, [], [])
        (self.workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(self.objects, self.factor)}))
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.child = Child.start("prometheus", argv, child_env({}), self.workdir / "prometheus.log")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready():
            if self.child.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{self.child.log_tail()}")
            time.sleep(0.3)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stops the server."""
        if self.child is not None:
            self.child.stop(grace_s=5)

    def _api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (an empty list when it has no data)."""
        data = self._api("query", {"query": expr})
        result = data.get("result") or []
        return list(result) if isinstance(result, list) else [result]

    def alerts(self) -> list[Alert]:
        """Every pending or firing alert."""
        return [
            Alert(
                name=str(a["labels"].get("alertname")),
                state=str(a["state"]),
                labels=dict(a["labels"]),
                active_at=str(a.get("activeAt", "")),
                value=str(a.get("value", "")),
            )
            for a in self._api("alerts").get("alerts") or []
        ]

    def firing(self) -> dict[str, list[Alert]]:
        """Alert name -> its firing instances."""
        out: dict[str, list[Alert]] = {}
        for alert in self.alerts():
            if alert.state == "firing":
                out.setdefault(alert.name, []).append(alert)
        return out

    def targets(self) -> dict[str, Any]:
        """Active and dropped targets."""
        data: dict[str, Any] = self._api("targets", {"state": "any"})
        return data

    def rule_health(self) -> list[str]:
        """One line for each rule Prometheus failed to evaluate."""
        bad = []
        for group in self._api("rules").get("groups") or []:
            for rule in group.get("rules") or []:
                if rule.get("health") not in ("ok", "unknown"):
                    bad.append(f"{rule.get('name')}: {rule.get('lastError')}")
        return bad
