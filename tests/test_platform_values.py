"""Every Helm value the program sets is a key of the pinned chart's values.yaml.

Helm silently ignores a key a chart does not read, so a typo ships as a
working install that does the wrong thing. The pinned charts' values files
live outside the project, in the folder `tests.harness.REFERENCE` names
($LLM_PLATFORM_REFERENCE, default ../shared/reference/, filled by
scripts/fetch-reference.sh): without it these tests skip, saying so, or fail
under CI=true.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra import versions
from infra.aws.identities import external_dns_zone
from infra.aws.layer import ExternalDnsAccess, PodIdentity
from tests.harness import (
    KARPENTER_ACCESS,
    PlatformRender,
    reference_dir,
    render_platform,
    stack_config,
    stack_render,
)
from tests.values_keys import REFERENCE_VALUES, documented_keys, key_paths, load_chart_values, unknown_keys


def _variants() -> dict[str, PlatformRender]:
    def mig_mixed_tainted(c: dict[str, Any]) -> None:
        c["llm-platform:platform"] = {"gpu_operator": {"mig_strategy": "mixed"}}
        c["llm-platform:node_groups"]["system"]["taints"] = [{"key": "dedicated", "value": "system"}]

    return {
        "dev": stack_render("dev"),
        "prod": stack_render("prod"),
        "dev+mig+tainted-system": render_platform(stack_config("dev", mig_mixed_tainted)),
        "dev+no-vpc": render_platform(stack_config("dev"), vpc_id=None),
        # Karpenter as the node provisioner: its chart and NodePools are installed.
        "dev+karpenter": render_platform(stack_config("dev"), node_provisioner="karpenter", karpenter=KARPENTER_ACCESS),
        # A domain with its hosted zone: external-dns is installed.
        "prod+hosted-zone": render_platform(
            stack_config("prod"),
            external_dns=ExternalDnsAccess(PodIdentity("external-dns", "external-dns", None), "Z0123456789ABCDEFGHIJ"),
        ),
    }


# --- the checker itself (no reference needed) ---------------------------------


DEFAULTS: dict[str, Any] = {
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "extraArgs": {"v": 4},
    "storageSpec": {},
    "clusterName": None,
    "serviceMonitor": {"enabled": False, "interval": "30s"},
    "tolerations": [],
    "env": [],
}


def test_checker_names_a_misspelled_nested_key() -> None:
    assert unknown_keys({"serviceMonitor": {"enabeld": True}}, DEFAULTS) == [
        "serviceMonitor.enabeld: not a key of the chart's values.yaml"
    ]


def test_checker_names_an_unknown_top_level_key() -> None:
    assert unknown_keys({"nodeSelectors": {"a": "b"}}, DEFAULTS) == [
        "nodeSelectors: not a key of the chart's values.yaml"
    ]


def test_checker_allows_free_form_maps_and_empty_defaults() -> None:
    values = {
        "nodeSelector": {"llm-platform/node-group": "system"},
        "extraArgs": {"expander": "least-waste"},
        "storageSpec": {"volumeClaimTemplate": {"spec": {"storageClassName": "gp3"}}},
        "clusterName": "c",
        "tolerations": [{"key": "k"}],
        "serviceMonitor": {"enabled": True},
    }
    assert unknown_keys(values, DEFAULTS) == []


def test_checker_rejects_a_map_where_the_chart_has_a_list() -> None:
    assert unknown_keys({"env": {"A": "1"}}, DEFAULTS) == ["env: a map is set where the chart's default is a list"]


def test_every_chart_has_a_reference_values_file_mapped() -> None:
    assert {c.chart for c in versions.HELM_CHARTS} == set(REFERENCE_VALUES)


# --- the program's values against the pinned charts ---------------------------


@pytest.mark.parametrize("chart", sorted(REFERENCE_VALUES))
def test_every_value_set_is_a_key_of_the_pinned_chart(chart: str) -> None:
    defaults = load_chart_values(reference_dir(), chart)
    problems: list[str] = []
    checked = 0
    for variant, render in _variants().items():
        if chart not in render.releases():
            continue
        values = render.values(chart)
        checked += len(key_paths(values))
        problems += [f"{variant}: {chart}: {p}" for p in unknown_keys(values, defaults)]
    assert checked > 0, f"no values of {chart} were checked"
    assert not problems, "\n".join(problems)


def test_reference_is_the_pinned_chart_version() -> None:
    import yaml

    reference = reference_dir()
    charts = {
        "kuberay-operator": "kuberay/operator-chart.yaml",
        "kube-prometheus-stack": "kube-prometheus-stack/chart-chart.yaml",
        "keda": "keda/chart-chart.yaml",
        "cluster-autoscaler": "cluster-autoscaler/chart-chart.yaml",
        "aws-load-balancer-controller": "aws-load-balancer-controller/chart-chart.yaml",
        "external-dns": "external-dns/Chart.yaml",
    }
    pinned = {c.chart: c.version for c in versions.HELM_CHARTS}
    for chart, path in charts.items():
        meta = yaml.safe_load((reference / path).read_text())
        assert meta["version"] == pinned[chart], f"{chart}: reference is {meta['version']}, pinned {pinned[chart]}"
    # The GPU Operator's Chart.yaml at a git tag carries a development
    # version; its source note names the tag instead.
    source = (reference / "gpu-operator" / "SOURCE.txt").read_text()
    assert pinned["gpu-operator"] in source


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_whole_program_render_sets_only_chart_keys(stack: str) -> None:
    from tests.harness import render_stack

    reference = reference_dir()
    rendered = render_stack(stack)
    # external-dns runs only where the endpoint has a domain and its hosted zone.
    cfg = stack_config(stack)
    optional = set() if external_dns_zone(cfg) else {"external-dns"}
    # One node provisioner per stack: cluster-autoscaler scales managed node groups only.
    optional |= {"cluster-autoscaler"} if cfg.cluster.node_provisioner == "karpenter" else {"karpenter"}
    assert {h["chart"] for h in rendered.helm} == set(REFERENCE_VALUES) - optional
    problems: list[str] = []
    for release in rendered.helm:
        assert release["version"] == {c.chart: c.version for c in versions.HELM_CHARTS}[release["chart"]]
        defaults = load_chart_values(reference, release["chart"])
        problems += [f"{release['chart']}: {p}" for p in unknown_keys(release["values"], defaults)]
    assert not problems, "\n".join(problems)


def test_commented_out_settings_count_as_documented_keys() -> None:
    text = """
alertmanager:
  ## ConfigSecret is the name of a Secret with the configuration.
  ##
  alertmanagerSpec:
    replicas: 1
    # configSecret:
    ## Prose: a sentence with a colon: not a key.
    # web:
    #   tls: {}
  enabled: true
# topLevel: x
"""
    assert documented_keys(text) == [
        ("alertmanager", "alertmanagerSpec", "configSecret"),
        ("alertmanager", "alertmanagerSpec", "web"),
        ("topLevel",),
    ]
