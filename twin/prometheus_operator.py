"""The scrape jobs the Prometheus Operator v0.93 generates from PodMonitors and ServiceMonitors, for a real Prometheus.

In a cluster the operator (pkg/prometheus/promcfg.go, pinned in the
reference folder) turns every endpoint of every PodMonitor and ServiceMonitor
into one ``scrape_configs`` entry: a ``kubernetes_sd_configs`` block, and
``relabel_configs`` that keep the targets the monitor's selector and port
select and name them (namespace, pod, container, endpoint, job, the
podTargetLabels), then the monitor's own ``relabelings``, then the sharding
rules. This module ports that generation rule by rule, each rule beside a
citation of the line it ports (``_po``; infra/citations.py,
tests/twin/test_prometheus_operator_citations.py), so the twin can run the
real ``prometheus`` binary against local processes with the scrape config
the operator would write.

It is hand-written because the operator is Go, and no Python library
generates its configuration; the output is plain dicts, the YAML Prometheus
reads.

What differs from the operator's output, on purpose:

* Discovery is file-based: ``kubernetes_sd_configs`` becomes
  ``file_sd_configs`` on :data:`SD_POD_FILE` (PodMonitors, role pod) or
  :data:`SD_ENDPOINTS_FILE` (ServiceMonitors, role endpoints). The
  Kubernetes SD's namespace scoping (``namespaces.names``) cannot be said in
  file SD, so when the monitor's namespaceSelector names namespaces a keep
  rule on ``__meta_kubernetes_namespace`` comes first in ``relabel_configs``
  (:func:`namespace_scope`); everything after it is the operator's.
* ``$(SHARD)`` in the sharding rules is written as ``0``: in a cluster the
  config reloader substitutes the shard's environment variable, and there is
  one shard here.
* The targets (:func:`pod_targets`, :func:`endpoint_targets`) are what
  Prometheus' own Kubernetes SD would produce for the pod or Service, with
  the address of the live local process instead of the pod IP.

Assumed, as kube-prometheus-stack 88.5.3 configures its Prometheus by
default (its values are cited with ``_kps``): one shard, a global scrape
interval of 30s, no scrape classes, no Prometheus-wide podTargetLabels, no
enforcedNamespaceLabel, no enforced limits, no overrideHonorLabels or
overrideHonorTimestamps, namespace selectors honoured, the ``endpoints``
discovery role for ServiceMonitors, no DaemonSet mode, no retention policy
for stale shards, no topology sharding. Fields of a monitor that need
Secrets (TLS, basic auth, OAuth2, authorization, bearer tokens, proxies),
``selectorMechanism: RoleSelector`` and the native-histogram settings are
not ported: :func:`scrape_jobs` raises :class:`UnsupportedMonitorError`
naming the field rather than dropping it silently.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from infra.citations import Cite, marks

_PROMCFG = "prometheus-operator/src-v0.93.0/pkg/prometheus/"
_KPS = "kube-prometheus-stack/"
# Marker -> the folder (under the reference) its paths are in.
MARKERS = {"_po": _PROMCFG, "_kps": _KPS}


def _po(path: str, line: int, quote: str) -> None:
    """Marks the line of the Prometheus Operator's pkg/prometheus/ the code beside it ports (infra/citations.py)."""


def _kps(path: str, line: int, quote: str) -> None:
    """Marks the line of kube-prometheus-stack's pinned values a default here comes from (infra/citations.py)."""


def citations() -> list[Cite]:
    """Every mark in this module, read from its source."""
    return marks(Path(__file__), MARKERS)


class UnsupportedMonitorError(ValueError):
    """A monitor sets a field this port does not generate (it would be dropped silently otherwise)."""


# File-SD files, one per discovery role, in the folder given to scrape_jobs.
SD_POD_FILE = "pods.json"
SD_ENDPOINTS_FILE = "endpoints.json"

# --- the chart's Prometheus (kube-prometheus-stack values) ---------------------------

_kps("chart-values.yaml", 4269, "## Defaults to 30s.")
_kps("chart-values.yaml", 4272, 'scrapeInterval: ""')
GLOBAL_SCRAPE_INTERVAL = "30s"
_kps("chart-values.yaml", 4601, "shards: 1")
SHARDS = 1
# The shard index the config reloader substitutes for $(SHARD) on the one shard.
SHARD_INDEX = "0"
_kps("chart-values.yaml", 4281, "scrapeClasses: []")
_kps("chart-values.yaml", 4290, "podTargetLabels: []")
_kps("chart-values.yaml", 4914, 'enforcedNamespaceLabel: ""')
_kps("chart-values.yaml", 4909, "ignoreNamespaceSelectors: false")
_kps("chart-values.yaml", 4900, "overrideHonorLabels: false")
_kps("chart-values.yaml", 4903, "overrideHonorTimestamps: false")
_kps("chart-values.yaml", 5031, 'serviceDiscoveryRole: ""')

# --- names (promcfg.go) -----------------------------------------------------------

_po("promcfg.go", 52, 'kubernetesSDRoleEndpoint      = "endpoints"')
ROLE_ENDPOINTS = "endpoints"
_po("promcfg.go", 54, 'kubernetesSDRolePod           = "pod"')
ROLE_POD = "pod"
_po("promcfg.go", 61, 'hashLabelNameForSharding          = "__tmp_hash"')
_HASH_LABEL = "__tmp_hash"
_po("promcfg.go", 62, 'hashLabelNameForDisablingSharding = "__tmp_disable_sharding"')
_DISABLE_SHARDING_LABEL = "__tmp_disable_sharding"

_po("promcfg.go", 74, "invalidLabelCharRE = regexp.MustCompile(`[^a-zA-Z0-9_]`)")
_INVALID_LABEL_CHAR = re.compile(r"[^a-zA-Z0-9_]")


def sanitize_label_name(name: str) -> str:
    """A Kubernetes label or annotation name as a Prometheus label name: every other character becomes `_`.

    The operator's sanitizeLabelName, and the same rule Prometheus' Kubernetes
    SD applies to the label names it exposes (strutil.SanitizeLabelName).
    """
    _po("promcfg.go", 77, 'return invalidLabelCharRE.ReplaceAllString(name, "_")')
    return _INVALID_LABEL_CHAR.sub("_", name)


# --- the generation ---------------------------------------------------------------

# The endpoint and monitor fields ported below; any other one raises.
_POD_ENDPOINT_FIELDS = {
    "port",
    "portNumber",
    "targetPort",
    "path",
    "scheme",
    "params",
    "interval",
    "scrapeTimeout",
    "honorLabels",
    "honorTimestamps",
    "trackTimestampsStaleness",
    "filterRunning",
    "relabelings",
    "metricRelabelings",
    "followRedirects",
    "enableHttp2",
}
_SERVICE_ENDPOINT_FIELDS = _POD_ENDPOINT_FIELDS - {"portNumber"}
_MONITOR_FIELDS = {
    "selector",
    "namespaceSelector",
    "jobLabel",
    "podTargetLabels",
    "targetLabels",
    "podMetricsEndpoints",
    "endpoints",
    "sampleLimit",
    "targetLimit",
    "labelLimit",
    "labelNameLengthLimit",
    "labelValueLengthLimit",
    "keepDroppedTargets",
    "scrapeProtocols",
    "fallbackScrapeProtocol",
    "bodySizeLimit",
    "selectorMechanism",
}


def _check_fields(where: str, given: Mapping[str, Any], ported: set[str]) -> None:
    unknown = sorted(set(given) - ported)
    if unknown:
        raise UnsupportedMonitorError(f"{where}: not ported to the twin: {', '.join(unknown)}")


def _init_relabelings() -> list[dict[str, Any]]:
    """The job name kept as a meta label, first of every job's relabelings (initRelabelings)."""
    _po("promcfg.go", 1226, '{Key: "source_labels", Value: []string{"job"}},')
    _po("promcfg.go", 1227, '{Key: "target_label", Value: "__tmp_prometheus_job_name"},')
    return [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]


def _running_filter() -> dict[str, Any]:
    """Drop pods that have finished (generateRunningFilter)."""
    _po("promcfg.go", 2245, '{Key: "source_labels", Value: []string{"__meta_kubernetes_pod_phase"}},')
    _po("promcfg.go", 2246, '{Key: "regex", Value: "(Failed|Succeeded)"},')
    return {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}


def _selector_relabelings(selector: Mapping[str, Any], role_object: str) -> list[dict[str, Any]]:
    """Keep/drop rules for a LabelSelector on the pod's (`pod`) or the Service's (`service`) labels.

    The values are put into the regex as they are, not escaped (the operator
    does the same), and Prometheus anchors the regex.
    """
    label = f"__meta_kubernetes_{role_object}_label_"
    present = f"__meta_kubernetes_{role_object}_labelpresent_"
    out: list[dict[str, Any]] = []
    match_labels: Mapping[str, str] = selector.get("matchLabels") or {}
    _po("promcfg.go", 1530, "for _, k := range sortutil.SortedKeys(m.Spec.Selector.MatchLabels) {")
    for key in sorted(match_labels):
        _po("promcfg.go", 1534, '{Key: "regex", Value: fmt.Sprintf("(%s);true", m.Spec.Selector.MatchLabels[k])},')
        name = sanitize_label_name(key)
        out.append(
            {"action": "keep", "source_labels": [label + name, present + name], "regex": f"({match_labels[key]});true"}
        )
    for exp in selector.get("matchExpressions") or []:
        name = sanitize_label_name(exp["key"])
        values = "|".join(exp.get("values") or [])
        operator = exp["operator"]
        if operator == "In":
            _po("promcfg.go", 1541, "case metav1.LabelSelectorOpIn:")
            _po("promcfg.go", 1545, '{Key: "regex", Value: fmt.Sprintf("(%s);true", strings.Join(exp.Values, "|"))},')
            out.append({"action": "keep", "source_labels": [label + name, present + name], "regex": f"({values});true"})
        elif operator == "NotIn":
            _po("promcfg.go", 1547, "case metav1.LabelSelectorOpNotIn:")
            _po("promcfg.go", 1549, '{Key: "action", Value: "drop"},')
            out.append({"action": "drop", "source_labels": [label + name, present + name], "regex": f"({values});true"})
        elif operator == "Exists":
            _po("promcfg.go", 1553, "case metav1.LabelSelectorOpExists:")
            _po("promcfg.go", 1556, '"__meta_kubernetes_pod_labelpresent_" + sanitizeLabelName(exp.Key)}},')
            out.append({"action": "keep", "source_labels": [present + name], "regex": "true"})
        elif operator == "DoesNotExist":
            _po("promcfg.go", 1559, "case metav1.LabelSelectorOpDoesNotExist:")
            out.append({"action": "drop", "source_labels": [present + name], "regex": "true"})
        # Any other operator: the operator's switch has no case, so no rule
        # (the API server's validation refuses such a selector anyway).
    return out


def _target_label_relabelings(labels: Iterable[str], role_object: str) -> list[dict[str, Any]]:
    """A pod's (or Service's) label copied onto the target under its sanitised name, when it has a value."""
    _po("promcfg.go", 1620, '"__meta_kubernetes_pod_label_" + sanitizeLabelName(l)}},')
    _po("promcfg.go", 1621, '{Key: "target_label", Value: sanitizeLabelName(l)},')
    _po("promcfg.go", 1622, '{Key: "regex", Value: "(.+)"},')
    return [
        {
            "source_labels": [f"__meta_kubernetes_{role_object}_label_{sanitize_label_name(label)}"],
            "target_label": sanitize_label_name(label),
            "regex": "(.+)",
            "replacement": "${1}",
        }
        for label in labels
    ]


def _relabel_configs(configs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A monitor's RelabelConfigs as Prometheus spells them (generateRelabelConfig): the fields set, in order."""
    out = []
    for c in configs:
        rule: dict[str, Any] = {}
        if c.get("sourceLabels"):
            _po("promcfg.go", 2403, 'relabeling = append(relabeling, yaml.MapItem{Key: "source_labels"')
            rule["source_labels"] = list(c["sourceLabels"])
        if c.get("separator") is not None:
            rule["separator"] = c["separator"]
        if c.get("targetLabel"):
            rule["target_label"] = c["targetLabel"]
        if c.get("regex"):
            rule["regex"] = c["regex"]
        if c.get("modulus"):
            rule["modulus"] = c["modulus"]
        if c.get("replacement") is not None:
            rule["replacement"] = c["replacement"]
        if c.get("action"):
            # The CRD accepts `Replace` as well as `replace`; Prometheus only the latter.
            _po("promcfg.go", 2427, "Value: strings.ToLower(c.Action)})")
            rule["action"] = c["action"].lower()
        out.append(rule)
    return out


def _sharding_relabelings() -> list[dict[str, Any]]:
    """Hash the address into the shard's bucket and keep the shard's own (appendShardingRelabelingWithLabel).

    With one shard every target hashes to 0 and is kept; the rules are kept
    all the same, as the operator writes them.
    """
    _po("promcfg.go", 2379, '{Key: "source_labels", Value: []string{shardLabel, hashLabelNameForSharding}},')
    _po("promcfg.go", 2387, '{Key: "modulus", Value: modulus},')
    _po("promcfg.go", 2388, '{Key: "action", Value: "hashmod"},')
    _po("promcfg.go", 2391, '{Key: "regex", Value: fmt.Sprintf("$(%s);|.+;.+", shardEnvVar)},')
    return [
        {
            "source_labels": ["__address__", _HASH_LABEL],
            "target_label": _HASH_LABEL,
            "regex": "(.+);",
            "replacement": "$1",
            "action": "replace",
        },
        {"source_labels": [_HASH_LABEL], "target_label": _HASH_LABEL, "modulus": SHARDS, "action": "hashmod"},
        {
            "source_labels": [_HASH_LABEL, _DISABLE_SHARDING_LABEL],
            "regex": f"{SHARD_INDEX};|.+;.+",
            "action": "keep",
        },
    ]


def _namespaces(monitor: Mapping[str, Any]) -> list[str]:
    """The namespaces discovery watches for the monitor (getNamespacesFromNamespaceSelector); empty: all."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    _po("promcfg.go", 2440, "} else if nsel.Any {")
    if selector.get("any"):
        return []
    _po("promcfg.go", 2442, "} else if len(nsel.MatchNames) == 0 {")
    _po("promcfg.go", 2443, "return []string{namespace}")
    return list(selector.get("matchNames") or [monitor["metadata"]["namespace"]])


def namespace_scope(monitor: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Ours, not the operator's: Kubernetes SD only discovers in these namespaces; file SD sees every pod."""
    names = _namespaces(monitor)
    if not names:
        return []
    return [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_namespace"],
            # Namespace names are DNS labels: nothing in them needs escaping.
            "regex": "(" + "|".join(names) + ")",
        }
    ]


def _common_head(job_name: str, ep: Mapping[str, Any], sd_file: Path) -> dict[str, Any]:
    """job_name, honor_labels, honor_timestamps, discovery, interval, timeout, path, params, scheme."""
    cfg: dict[str, Any] = {"job_name": job_name}
    # AddHonorLabels: always written (overrideHonorLabels is off).
    _po("promcfg.go", 506, 'return cg.AppendMapItem(cfg, "honor_labels", honorLabels)')
    cfg["honor_labels"] = bool(ep.get("honorLabels", False))
    # AddHonorTimestamps: only when the endpoint sets it.
    _po("promcfg.go", 446, "if userHonorTimestamps == nil && !cpf.OverrideHonorTimestamps {")
    if ep.get("honorTimestamps") is not None:
        cfg["honor_timestamps"] = bool(ep["honorTimestamps"])
    _po("promcfg.go", 467, 'AppendMapItem(cfg, "track_timestamps_staleness", *trackTimestampsStaleness)')
    if ep.get("trackTimestampsStaleness") is not None:
        cfg["track_timestamps_staleness"] = bool(ep["trackTimestampsStaleness"])
    # kubernetes_sd_configs, here as file SD (module docstring).
    cfg["file_sd_configs"] = [{"files": [str(sd_file)]}]
    _po("promcfg.go", 1483, 'cfg = append(cfg, yaml.MapItem{Key: "scrape_interval", Value: ep.Interval})')
    if ep.get("interval"):
        cfg["scrape_interval"] = ep["interval"]
    _po("promcfg.go", 1486, 'cfg = append(cfg, yaml.MapItem{Key: "scrape_timeout", Value: ep.ScrapeTimeout})')
    if ep.get("scrapeTimeout"):
        cfg["scrape_timeout"] = ep["scrapeTimeout"]
    _po("promcfg.go", 1489, 'cfg = append(cfg, yaml.MapItem{Key: "metrics_path", Value: ep.Path})')
    if ep.get("path"):
        cfg["metrics_path"] = ep["path"]
    _po("promcfg.go", 1492, 'cfg = append(cfg, yaml.MapItem{Key: "params", Value: ep.Params})')
    if ep.get("params") is not None:
        cfg["params"] = {k: list(v) for k, v in ep["params"].items()}
    _po("promcfg.go", 1495, 'cfg = append(cfg, yaml.MapItem{Key: "scheme", Value: ep.Scheme.String()})')
    if ep.get("scheme"):
        # Scheme.String() (pkg/apis/monitoring/v1) lowercases: the CRD allows HTTPS too.
        cfg["scheme"] = str(ep["scheme"]).lower()
    _po("promcfg.go", 2008, 'AppendMapItem(cfg, "follow_redirects", *ep.FollowRedirects)')
    if ep.get("followRedirects") is not None:
        cfg["follow_redirects"] = bool(ep["followRedirects"])
    _po("promcfg.go", 2011, 'AppendMapItem(cfg, "enable_http2", *ep.EnableHTTP2)')
    if ep.get("enableHttp2") is not None:
        cfg["enable_http2"] = bool(ep["enableHttp2"])
    return cfg


def _common_tail(cfg: dict[str, Any], spec: Mapping[str, Any], ep: Mapping[str, Any]) -> dict[str, Any]:
    """Limits, protocols, body size and metric_relabel_configs, after relabel_configs."""
    # AddLimitsToYAML: no enforced limits (chart default), so the monitor's own, when set.
    _po(
        "promcfg.go", 1670, "cfg = cg.AddLimitsToYAML(cfg, sampleLimitKey, m.Spec.SampleLimit, cpf.EnforcedSampleLimit)"
    )
    for field, key in (
        ("sampleLimit", "sample_limit"),
        ("targetLimit", "target_limit"),
        ("labelLimit", "label_limit"),
        ("labelNameLengthLimit", "label_name_length_limit"),
        ("labelValueLengthLimit", "label_value_length_limit"),
        ("keepDroppedTargets", "keep_dropped_targets"),
    ):
        if spec.get(field) is not None:
            cfg[key] = spec[field]
    _po("promcfg.go", 487, 'return cg.WithMinimumVersion("2.49.0").AppendMapItem(cfg, "scrape_protocols", sps)')
    if spec.get("scrapeProtocols"):
        cfg["scrape_protocols"] = list(spec["scrapeProtocols"])
    if spec.get("fallbackScrapeProtocol"):
        cfg["fallback_scrape_protocol"] = spec["fallbackScrapeProtocol"]
    _po("promcfg.go", 1681, 'AppendMapItem(cfg, "body_size_limit", bodySizeLimit)')
    if spec.get("bodySizeLimit"):
        cfg["body_size_limit"] = spec["bodySizeLimit"]
    # No scrape class metric relabelings (no scrape classes): the endpoint's own only.
    _po("promcfg.go", 1686, "labeler.GetRelabelingConfigs(m.TypeMeta, m.ObjectMeta, ep.MetricRelabelConfigs)...)")
    _po("promcfg.go", 1688, "if len(metricRelabelings) > 0 {")
    metric = _relabel_configs(ep.get("metricRelabelings") or [])
    if metric:
        cfg["metric_relabel_configs"] = metric
    return cfg


def _check_selector_mechanism(where: str, spec: Mapping[str, Any]) -> None:
    # RoleSelector moves the selector into kubernetes_sd_configs.selectors,
    # which file SD has no equivalent for.
    _po("promcfg.go", 1528, "monitoringv1.SelectorMechanismRelabel) == monitoringv1.SelectorMechanismRelabel {")
    if spec.get("selectorMechanism", "RelabelConfig") != "RelabelConfig":
        raise UnsupportedMonitorError(f"{where}: selectorMechanism {spec['selectorMechanism']} is not ported")


def pod_monitor_job(monitor: Mapping[str, Any], ep: Mapping[str, Any], i: int, sd_dir: Path) -> dict[str, Any]:
    """The scrape job of endpoint `i` (`ep`) of a PodMonitor (generatePodMonitorConfig)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespace, name = meta["namespace"], meta["name"]
    where = f"PodMonitor {namespace}/{name} podMetricsEndpoints[{i}]"
    _check_fields(where, ep, _POD_ENDPOINT_FIELDS)
    _check_selector_mechanism(where, spec)
    _po("promcfg.go", 1459, 'Value: fmt.Sprintf("podMonitor/%s/%s/%d", m.Namespace, m.Name, i),')
    cfg = _common_head(f"podMonitor/{namespace}/{name}/{i}", ep, sd_dir / SD_POD_FILE)

    relabelings = namespace_scope(monitor) + _init_relabelings()
    _po("promcfg.go", 1521, "if ep.FilterRunning == nil || *ep.FilterRunning {")
    if ep.get("filterRunning", True):
        relabelings.append(_running_filter())
    relabelings += _selector_relabelings(spec.get("selector") or {}, "pod")

    # The port: by name, else by number, else the deprecated targetPort.
    port, port_number, target_port = ep.get("port") or "", ep.get("portNumber") or 0, ep.get("targetPort")
    if port:
        _po("promcfg.go", 1570, 'if ptr.Deref(ep.Port, "") != "" {')
        _po("promcfg.go", 1573, '{Key: "source_labels", Value: []string{"__meta_kubernetes_pod_container_port_name"}},')
        relabelings.append(
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port}
        )
    elif port_number:
        _po("promcfg.go", 1576, "} else if ptr.Deref(ep.PortNumber, 0) != 0 {")
        _po(
            "promcfg.go",
            1579,
            '{Key: "source_labels", Value: []string{"__meta_kubernetes_pod_container_port_number"}},',
        )
        relabelings.append(
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": port_number}
        )
    elif target_port is not None:
        relabelings += _target_port_keep(target_port)

    _po("promcfg.go", 1603, '{Key: "source_labels", Value: []string{"__meta_kubernetes_namespace"}},')
    _po("promcfg.go", 1607, '{Key: "source_labels", Value: []string{"__meta_kubernetes_pod_container_name"}},')
    _po("promcfg.go", 1611, '{Key: "source_labels", Value: []string{"__meta_kubernetes_pod_name"}},')
    relabelings += [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    # The monitor's podTargetLabels, then the Prometheus-wide ones (none, chart default).
    _po("promcfg.go", 1618, "for _, l := range append(m.Spec.PodTargetLabels, cpf.PodTargetLabels...) {")
    relabelings += _target_label_relabelings(spec.get("podTargetLabels") or [], "pod")

    _po("promcfg.go", 1634, '{Key: "replacement", Value: fmt.Sprintf("%s/%s", m.GetNamespace(), m.GetName())},')
    relabelings.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
    if spec.get("jobLabel"):
        _po("promcfg.go", 1638, '"__meta_kubernetes_pod_label_" + sanitizeLabelName(m.Spec.JobLabel)}},')
        relabelings.append(
            {
                "source_labels": [f"__meta_kubernetes_pod_label_{sanitize_label_name(spec['jobLabel'])}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    if port:
        _po("promcfg.go", 1647, '{Key: "target_label", Value: "endpoint"},')
        _po("promcfg.go", 1648, '{Key: "replacement", Value: *ep.Port},')
        relabelings.append({"target_label": "endpoint", "replacement": port})
    elif target_port is not None and str(target_port) != "":
        # portNumber alone sets no endpoint label.
        _po("promcfg.go", 1650, '} else if ep.TargetPort != nil && ep.TargetPort.String() != "" {')
        relabelings.append({"target_label": "endpoint", "replacement": str(target_port)})

    # The endpoint's own relabelings come after all of the operator's naming
    # (and after the scrape class's, of which there are none), before sharding.
    _po("promcfg.go", 1661, "labeler.GetRelabelingConfigs(m.TypeMeta, m.ObjectMeta, ep.RelabelConfigs))...)")
    relabelings += _relabel_configs(ep.get("relabelings") or [])
    _po("promcfg.go", 1665, "relabelings = cg.appendShardingRelabelingWithAddress(relabelings, shards)")
    relabelings += _sharding_relabelings()
    cfg["relabel_configs"] = relabelings
    return _common_tail(cfg, spec, ep)


def _target_port_keep(target_port: str | int) -> list[dict[str, Any]]:
    """The deprecated targetPort: a name keeps by container port name, a number by container port number."""
    if isinstance(target_port, str) and target_port != "":
        _po("promcfg.go", 1585, 'if ep.TargetPort.StrVal != "" {')
        return [
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": target_port}
        ]
    if isinstance(target_port, int) and target_port != 0:
        _po("promcfg.go", 1591, "} else if ep.TargetPort.IntVal != 0 {")
        return [
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"], "regex": target_port}
        ]
    return []


def service_monitor_job(monitor: Mapping[str, Any], ep: Mapping[str, Any], i: int, sd_dir: Path) -> dict[str, Any]:
    """The scrape job of endpoint `i` (`ep`) of a ServiceMonitor (generateServiceMonitorConfig), role endpoints."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespace, name = meta["namespace"], meta["name"]
    where = f"ServiceMonitor {namespace}/{name} endpoints[{i}]"
    _check_fields(where, ep, _SERVICE_ENDPOINT_FIELDS)
    _check_selector_mechanism(where, spec)
    if spec.get("serviceDiscoveryRole", "Endpoints") != "Endpoints":
        raise UnsupportedMonitorError(f"{where}: serviceDiscoveryRole {spec['serviceDiscoveryRole']} is not ported")
    _po("promcfg.go", 1962, 'Value: fmt.Sprintf("serviceMonitor/%s/%s/%d", m.Namespace, m.Name, i),')
    cfg = _common_head(f"serviceMonitor/{namespace}/{name}/{i}", ep, sd_dir / SD_ENDPOINTS_FILE)

    relabelings = namespace_scope(monitor) + _init_relabelings()
    # The selector is on the Service's labels.
    _po(
        "promcfg.go",
        2050,
        '"__meta_kubernetes_service_label_" + sanitizeLabelName(k), "__meta_kubernetes_service_labelpresent_"',
    )
    relabelings += _selector_relabelings(spec.get("selector") or {}, "service")

    port, target_port = ep.get("port") or "", ep.get("targetPort")
    if port:
        # The Service port's name, as the Endpoints object carries it.
        _po("promcfg.go", 2088, 'sourceLabels := []string{"__meta_kubernetes_endpoint_port_name"}')
        relabelings.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": port})
    elif target_port is not None:
        relabelings += _target_port_keep(target_port)

    kind_and_name = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
    _po("promcfg.go", 2113, 'sourceLabels := []string{"__meta_kubernetes_endpoint_address_target_kind"')
    _po("promcfg.go", 2123, '{Key: "regex", Value: "Node;(.*)"},')
    _po("promcfg.go", 2130, '{Key: "regex", Value: "Pod;(.*)"},')
    _po("promcfg.go", 2139, '{Key: "source_labels", Value: []string{"__meta_kubernetes_service_name"}},')
    relabelings += [
        {
            "source_labels": kind_and_name,
            "separator": ";",
            "regex": "Node;(.*)",
            "replacement": "${1}",
            "target_label": "node",
        },
        {
            "source_labels": kind_and_name,
            "separator": ";",
            "regex": "Pod;(.*)",
            "replacement": "${1}",
            "target_label": "pod",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    ]
    # Unlike a PodMonitor's, the running filter comes after the naming rules.
    _po("promcfg.go", 2152, "if ptr.Deref(ep.FilterRunning, true) {")
    if ep.get("filterRunning", True):
        relabelings.append(_running_filter())
    _po("promcfg.go", 2159, '"__meta_kubernetes_service_label_" + sanitizeLabelName(l)}},')
    relabelings += _target_label_relabelings(spec.get("targetLabels") or [], "service")
    _po("promcfg.go", 2167, "for _, l := range append(m.Spec.PodTargetLabels, cpf.PodTargetLabels...) {")
    relabelings += _target_label_relabelings(spec.get("podTargetLabels") or [], "pod")

    # The job is the Service's name (not the monitor's, as for a PodMonitor).
    _po("promcfg.go", 2180, '{Key: "source_labels", Value: []string{"__meta_kubernetes_service_name"}},')
    _po("promcfg.go", 2182, '{Key: "replacement", Value: "${1}"},')
    relabelings.append(
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"}
    )
    if spec.get("jobLabel"):
        _po("promcfg.go", 2186, '"__meta_kubernetes_service_label_" + sanitizeLabelName(m.Spec.JobLabel)}},')
        relabelings.append(
            {
                "source_labels": [f"__meta_kubernetes_service_label_{sanitize_label_name(spec['jobLabel'])}"],
                "target_label": "job",
                "regex": "(.+)",
                "replacement": "${1}",
            }
        )
    if port:
        _po("promcfg.go", 2199, '{Key: "replacement", Value: ep.Port},')
        relabelings.append({"target_label": "endpoint", "replacement": port})
    elif target_port is not None and str(target_port) != "":
        relabelings.append({"target_label": "endpoint", "replacement": str(target_port)})

    _po("promcfg.go", 2212, "labeler.GetRelabelingConfigs(m.TypeMeta, m.ObjectMeta, ep.RelabelConfigs))...)")
    relabelings += _relabel_configs(ep.get("relabelings") or [])
    _po("promcfg.go", 2214, "relabelings = cg.appendShardingRelabelingWithAddress(relabelings, shards)")
    relabelings += _sharding_relabelings()
    cfg["relabel_configs"] = relabelings
    return _common_tail(cfg, spec, ep)


def _sorted_by_key(monitors: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    # The operator keeps monitors in a map keyed by namespace/name and walks it sorted.
    chosen = [m for m in monitors if m.get("kind") == kind]
    return sorted(chosen, key=lambda m: f"{m['metadata']['namespace']}/{m['metadata']['name']}")


def scrape_jobs(monitors: Iterable[Mapping[str, Any]], sd_dir: Path) -> list[dict[str, Any]]:
    """Every PodMonitor and ServiceMonitor (dicts as rendered: apiVersion/kind/metadata/spec) -> the scrape jobs.

    One job per endpoint, in the operator's order: ServiceMonitors, then
    PodMonitors, each sorted by namespace/name, endpoints in their order.
    Discovery is file SD on ``sd_dir / SD_POD_FILE`` (PodMonitors) or
    ``sd_dir / SD_ENDPOINTS_FILE`` (ServiceMonitors). Other kinds are
    ignored; a field this port does not generate raises
    :class:`UnsupportedMonitorError`.
    """
    monitors = list(monitors)
    jobs: list[dict[str, Any]] = []
    _po(
        "promcfg.go",
        1040,
        "scrapeConfigs = cg.appendServiceMonitorConfigs(scrapeConfigs, sMons, apiserverConfig, store, shards)",
    )
    _po("promcfg.go", 3234, "for _, identifier := range sortutil.SortedKeys(serviceMonitors) {")
    for monitor in _sorted_by_key(monitors, "ServiceMonitor"):
        _check_fields(
            f"ServiceMonitor {monitor['metadata']['name']}", monitor["spec"], _MONITOR_FIELDS | {"serviceDiscoveryRole"}
        )
        for i, ep in enumerate(monitor["spec"].get("endpoints") or []):
            jobs.append(service_monitor_job(monitor, ep, i, sd_dir))
    _po(
        "promcfg.go",
        1041,
        "scrapeConfigs = cg.appendPodMonitorConfigs(scrapeConfigs, pMons, apiserverConfig, store, shards)",
    )
    _po("promcfg.go", 3258, "for i, ep := range podMonitors[identifier].Spec.PodMetricsEndpoints {")
    for monitor in _sorted_by_key(monitors, "PodMonitor"):
        _check_fields(f"PodMonitor {monitor['metadata']['name']}", monitor["spec"], _MONITOR_FIELDS)
        for i, ep in enumerate(monitor["spec"].get("podMetricsEndpoints") or []):
            jobs.append(pod_monitor_job(monitor, ep, i, sd_dir))
    return jobs


def prometheus_config(monitors: Iterable[Mapping[str, Any]], sd_dir: Path) -> dict[str, Any]:
    """A whole prometheus.yml: the chart's global scrape interval and :func:`scrape_jobs`."""
    _po("promcfg.go", 3112, 'slice = append(slice, yaml.MapItem{Key: "scrape_interval", Value: cpf.ScrapeInterval})')
    return {"global": {"scrape_interval": GLOBAL_SCRAPE_INTERVAL}, "scrape_configs": scrape_jobs(monitors, sd_dir)}


# =====================================================================================
# The targets: what Prometheus' Kubernetes SD would discover, as file-SD groups.
#
# Prometheus' discovery code (discovery/kubernetes/pod.go, endpoints.go) is not
# in the reference folder; the label names and values below follow
# Prometheus' documented `kubernetes_sd_config` labels for the pod and
# endpoints roles. Names of Kubernetes labels and annotations are sanitised
# as the operator's sanitizeLabelName does (the same rule). An empty value
# is left out: Prometheus treats an empty label as an absent one.
# =====================================================================================

_META = "__meta_kubernetes_"


def _object_meta_labels(role: str, meta: Mapping[str, Any]) -> dict[str, str]:
    """<role>_name, <role>_label_*, <role>_labelpresent_*, <role>_annotation_*, <role>_annotationpresent_*."""
    out = {f"{_META}{role}_name": str(meta.get("name", ""))}
    for kind, values in (("label", meta.get("labels") or {}), ("annotation", meta.get("annotations") or {})):
        for key, value in values.items():
            name = sanitize_label_name(key)
            out[f"{_META}{role}_{kind}_{name}"] = str(value)
            out[f"{_META}{role}_{kind}present_{name}"] = "true"
    return out


def _pod_labels(pod: Mapping[str, Any], phase: str, ready: bool, node_name: str) -> dict[str, str]:
    """The pod-level labels of the pod role (and of a pod behind an endpoint)."""
    meta = pod["metadata"]
    status = pod.get("status") or {}
    labels = {
        f"{_META}namespace": str(meta.get("namespace", "")),
        **_object_meta_labels("pod", meta),
        # The twin's processes all listen on loopback.
        f"{_META}pod_ip": str(status.get("podIP") or "127.0.0.1"),
        f"{_META}pod_ready": "true" if ready else "false",
        f"{_META}pod_phase": phase,
        f"{_META}pod_node_name": node_name,
        f"{_META}pod_host_ip": str(status.get("hostIP") or "127.0.0.1"),
        f"{_META}pod_uid": str(meta.get("uid") or ""),
    }
    # The owner reference marked controller, as metav1.GetControllerOf picks it.
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            labels[f"{_META}pod_controller_kind"] = str(owner.get("kind", ""))
            labels[f"{_META}pod_controller_name"] = str(owner.get("name", ""))
            break
    return labels


def _container_id(pod: Mapping[str, Any], container: str, init: bool) -> str:
    status = pod.get("status") or {}
    for cs in status.get("initContainerStatuses" if init else "containerStatuses") or []:
        if cs.get("name") == container:
            return str(cs.get("containerID") or "")
    return ""


def _container_port_labels(container: Mapping[str, Any], port: Mapping[str, Any]) -> dict[str, str]:
    return {
        f"{_META}pod_container_name": str(container["name"]),
        f"{_META}pod_container_image": str(container.get("image", "")),
        f"{_META}pod_container_port_name": str(port.get("name", "")),
        f"{_META}pod_container_port_number": str(port["containerPort"]),
        # The API server defaults an unset protocol to TCP.
        f"{_META}pod_container_port_protocol": str(port.get("protocol") or "TCP"),
    }


def _group(address: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"targets": [address], "labels": {k: v for k, v in labels.items() if v != ""}}


def pod_targets(
    pod: Mapping[str, Any],
    address_of: Callable[[str, Mapping[str, Any]], str | None],
    phase: str = "Running",
    ready: bool = True,
    node_name: str = "twin",
) -> list[dict[str, Any]]:
    """The file-SD groups Prometheus' Kubernetes SD (role pod) would produce for one pod object.

    One group per declared container port, and one per container without
    ports (whose address in Kubernetes is the pod IP alone); containers first,
    then init containers (``__meta_kubernetes_pod_container_init``). Each
    carries the pod's labels (``pod_name``, ``pod_ip``, ``pod_label_*``,
    ``pod_labelpresent_*``, ``pod_annotation_*``, ``pod_annotationpresent_*``,
    ``pod_ready``, ``pod_phase``, ``pod_node_name``, ``pod_host_ip``,
    ``pod_uid``, ``pod_controller_kind``/``_name`` when an owner is the
    controller, ``namespace``) and the container's (``pod_container_name``,
    ``_id`` when the pod has a status for it, ``_image``, ``_port_name``,
    ``_port_number``, ``_port_protocol``, ``_init``).

    The address is ``address_of(container_name, port_entry)`` (an empty
    ``port_entry`` for a container without ports): the live local process
    behind that port. When it returns None nothing of the twin listens
    there, and the target is left out: a target Prometheus could never reach
    locally would only add a down target where the cluster has an up one.
    """
    spec = pod.get("spec") or {}
    base = _pod_labels(pod, phase, ready, node_name)
    containers = [(c, False) for c in spec.get("containers") or []]
    containers += [(c, True) for c in spec.get("initContainers") or []]
    out = []
    for container, init in containers:
        labels = {
            **base,
            f"{_META}pod_container_init": "true" if init else "false",
            f"{_META}pod_container_id": _container_id(pod, container["name"], init),
        }
        ports = container.get("ports") or []
        if not ports:
            address = address_of(container["name"], {})
            if address is not None:
                labels[f"{_META}pod_container_name"] = str(container["name"])
                labels[f"{_META}pod_container_image"] = str(container.get("image", ""))
                out.append(_group(address, labels))
            continue
        for port in ports:
            address = address_of(container["name"], port)
            if address is not None:
                out.append(_group(address, {**labels, **_container_port_labels(container, port)}))
    return out


def _find_container_port(
    pod: Mapping[str, Any], target: str | int
) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """The (container, port) a Service's targetPort names, by port name or number, among the pod's containers."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if (isinstance(target, str) and port.get("name") == target) or port.get("containerPort") == target:
                return container, port
    return None


def endpoint_targets(
    service: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    address_of: Callable[[str, Mapping[str, Any]], str | None],
    phase: str = "Running",
    ready: bool = True,
    node_name: str = "twin",
) -> list[dict[str, Any]]:
    """The file-SD groups Prometheus' Kubernetes SD (role endpoints) would produce for one Service.

    The Endpoints object is the one the endpoints controller keeps: the pods
    of the Service's namespace its (plain) selector matches, not finished,
    one address per Service port whose targetPort (name or number, default
    the port) the pod declares; a pod that is not Ready is a not-ready
    address (``endpoint_ready`` false). Each target carries the Service's
    labels (``service_name``, ``service_label_*`` ...), the endpoint's
    (``endpoints_name``, ``endpoints_label_*`` as the controller copies the
    Service's labels, ``endpoint_port_name``, ``endpoint_port_protocol``,
    ``endpoint_ready``, ``endpoint_address_target_kind``/``_name``,
    ``endpoint_node_name``), the pod's, and the matching container port's.
    Then, as Prometheus does, every other declared container port of those
    pods becomes a target with the Service's and the pod's labels but no
    endpoint labels. Targets whose ``address_of`` is None are left out, as in
    :func:`pod_targets`.
    """
    meta, spec = service["metadata"], service.get("spec") or {}
    selector: Mapping[str, str] = spec.get("selector") or {}
    if not selector or phase in ("Failed", "Succeeded"):
        return []  # no selector: Endpoints are managed by hand; finished pods are no endpoints
    service_labels = {f"{_META}namespace": str(meta["namespace"]), **_object_meta_labels("service", meta)}
    endpoints_labels = {f"{_META}endpoints_name": str(meta["name"])}
    for key, value in (meta.get("labels") or {}).items():
        endpoints_labels[f"{_META}endpoints_label_{sanitize_label_name(key)}"] = str(value)
        endpoints_labels[f"{_META}endpoints_labelpresent_{sanitize_label_name(key)}"] = "true"
    selected = [
        p
        for p in pods
        if p["metadata"].get("namespace") == meta["namespace"]
        and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
    ]
    out = []
    for pod in selected:
        pod_labels = _pod_labels(pod, phase, ready, node_name)
        covered: set[tuple[str, int]] = set()
        for sport in spec.get("ports") or []:
            found = _find_container_port(pod, sport.get("targetPort", sport["port"]))
            if found is None:
                continue  # the controller leaves the pod out of this port's subset
            container, cport = found
            covered.add((str(container["name"]), int(cport["containerPort"])))
            labels = {
                **service_labels,
                **endpoints_labels,
                **pod_labels,
                **_container_port_labels(container, cport),
                f"{_META}pod_container_init": "false",
                f"{_META}endpoint_port_name": str(sport.get("name", "")),
                f"{_META}endpoint_port_protocol": str(sport.get("protocol") or "TCP"),
                f"{_META}endpoint_ready": "true" if ready else "false",
                f"{_META}endpoint_address_target_kind": "Pod",
                f"{_META}endpoint_address_target_name": str(pod["metadata"]["name"]),
                f"{_META}endpoint_node_name": node_name,
            }
            address = address_of(str(container["name"]), cport)
            if address is not None:
                out.append(_group(address, labels))
        for container in (pod.get("spec") or {}).get("containers") or []:
            for cport in container.get("ports") or []:
                if (str(container["name"]), int(cport["containerPort"])) in covered:
                    continue
                address = address_of(str(container["name"]), cport)
                if address is not None:
                    labels = {
                        **service_labels,
                        **pod_labels,
                        **_container_port_labels(container, cport),
                        f"{_META}pod_container_init": "false",
                    }
                    out.append(_group(address, labels))
    return out


def write_sd_files(
    sd_dir: Path, pod_groups: Sequence[Mapping[str, Any]], endpoint_groups: Sequence[Mapping[str, Any]] = ()
) -> None:
    """Write both file-SD files, each atomically (a temporary file renamed over it).

    Prometheus watches the files and re-reads one when it changes: a rename
    means it never reads a half-written file.
    """
    sd_dir.mkdir(parents=True, exist_ok=True)
    for name, groups in ((SD_POD_FILE, pod_groups), (SD_ENDPOINTS_FILE, endpoint_groups)):
        fd, tmp = tempfile.mkstemp(dir=sd_dir, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump([dict(g) for g in groups], f, indent=1, sort_keys=True)
            os.replace(tmp, sd_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
