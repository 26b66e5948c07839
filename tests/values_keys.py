"""Checks that every Helm value the program sets is a key of the pinned chart.

Helm ignores a key a chart does not read: a misspelled `serviceMonitor`
switch installs fine and monitors nothing. This walks the values the
program builds against the chart's own `values.yaml` and names each path the
chart does not have.

Rules:
- a mapping the program sets is compared key by key with the chart's default;
- below a key whose default is an empty map (`{}`), an empty value (`~`), or
  whose name marks a free-form map (node selectors, labels, annotations,
  resources, extra arguments), any children are allowed;
- a list, scalar or unresolved Pulumi output is a leaf (lists replace lists);
- a mapping set where the chart's default is a list or scalar is reported;
- a key the chart documents as a commented-out setting (`# key: ...` at the
  key's indentation) counts as a key with no default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

# Keys whose children are free-form by their meaning, whatever their default
# (e.g. the GPU Operator's `operator.nodeSelector` defaults to one label, the
# cluster-autoscaler's `extraArgs` to three flags).
FREE_FORM_KEYS = frozenset(
    {
        "nodeSelector",
        "labels",
        "annotations",
        "podAnnotations",
        "podLabels",
        "additionalLabels",
        "commonLabels",
        "resources",
        "extraArgs",
    }
)

# Where each chart's pinned values.yaml lies inside the reference folder.
REFERENCE_VALUES: dict[str, str] = {
    "gpu-operator": "gpu-operator/chart-values.yaml",
    "kuberay-operator": "kuberay/operator-chart-values.yaml",
    "kube-prometheus-stack": "kube-prometheus-stack/chart-values.yaml",
    "keda": "keda/chart-values.yaml",
    "cluster-autoscaler": "cluster-autoscaler/chart-values.yaml",
    "aws-load-balancer-controller": "aws-load-balancer-controller/chart-values.yaml",
    "external-dns": "external-dns/chart-values.yaml",
    "karpenter": "karpenter/chart-values.yaml",
}


# Keys of a chart that a pinned chart packages as a dependency and whose
# values.yaml the parent's does not repeat: the parent passes them through
# under the dependency's name. Each names the dependency release that has
# the key (checked in that chart's own values.yaml).
SUBCHART_KEYS: dict[str, dict[tuple[str, ...], str]] = {
    "kube-prometheus-stack": {
        # grafana 12.11.1 (kube-prometheus-stack 88.5.3's dependency): a Role
        # in Grafana's namespace instead of a cluster-wide ClusterRole.
        ("grafana", "rbac", "namespaced"): "grafana 12.11.1",
        # The RoleBinding names the program's Role (configmaps only); no chart Role.
        ("grafana", "rbac", "useExistingRole"): "grafana 12.11.1",
        # What the sidecars watch: `both` (ConfigMaps and Secrets) by default.
        ("grafana", "sidecar", "dashboards", "resource"): "grafana 12.11.1",
        ("grafana", "sidecar", "datasources", "resource"): "grafana 12.11.1",
    },
}

_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w.-]*):(\s|$)")
_DOCUMENTED_KEY_LINE = re.compile(r"^(\s*)# ([A-Za-z_][\w.-]*):(\s|$)")


def documented_keys(text: str) -> list[tuple[str, ...]]:
    """Key paths a values.yaml documents as commented-out settings.

    Charts document optional keys without a default as `# key: example`
    at the key's own indentation (kube-prometheus-stack's
    `alertmanagerSpec.configSecret`); the template reads them all the same.
    Prose comments (`## ...`) are not keys.
    """
    stack: list[tuple[int, str]] = []
    found: list[tuple[str, ...]] = []
    for line in text.splitlines():
        real, documented = _KEY_LINE.match(line), _DOCUMENTED_KEY_LINE.match(line)
        match = real or documented
        if match is None:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(k for _, k in stack), match.group(2))
        if real:
            stack.append((indent, match.group(2)))
        else:
            found.append(path)
    return found


def load_chart_values(reference_dir: Path, chart: str) -> dict[str, Any]:
    """The pinned chart's default values, documented optional keys included (as None)."""
    text = (reference_dir / REFERENCE_VALUES[chart]).read_text()
    loaded = yaml.safe_load(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"{chart}: values file is not a mapping")
    for path in documented_keys(text):
        node: Any = loaded
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.setdefault(path[-1], None)
    for path in SUBCHART_KEYS.get(chart, {}):
        node = loaded
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node.setdefault(path[-1], None)
    return loaded


def _type_name(value: Any) -> str:
    return "list" if isinstance(value, list) else type(value).__name__


def unknown_keys(
    values: Mapping[str, Any],
    defaults: Mapping[str, Any],
    free_form: Iterable[str] = FREE_FORM_KEYS,
    _prefix: str = "",
) -> list[str]:
    """Every key path in `values` that the chart defaults do not allow."""
    free = frozenset(free_form)
    problems: list[str] = []
    for key, value in values.items():
        path = f"{_prefix}.{key}" if _prefix else str(key)
        if key not in defaults:
            problems.append(f"{path}: not a key of the chart's values.yaml")
            continue
        default = defaults[key]
        if not isinstance(value, Mapping):
            continue
        if default is None or default == {} or key in free:
            continue
        if not isinstance(default, Mapping):
            problems.append(f"{path}: a map is set where the chart's default is a {_type_name(default)}")
            continue
        problems += unknown_keys(value, default, free, path)
    return problems


def key_paths(values: Mapping[str, Any], _prefix: str = "") -> list[str]:
    """Every key path a values mapping sets (for reports and tests)."""
    out: list[str] = []
    for key, value in values.items():
        path = f"{_prefix}.{key}" if _prefix else str(key)
        out.append(path)
        if isinstance(value, Mapping):
            out += key_paths(value, path)
    return out
