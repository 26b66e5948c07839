"""The node-provisioning seam: the AWS layer asks it where pods may run and for the nodes that make it so."""

from __future__ import annotations

import ast
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from infra.aws import provisioning
from infra.aws.addons import EksAddons
from infra.aws.build import build_aws
from infra.aws.identities import uses_cluster_autoscaler
from infra.aws.layer import KARPENTER, MANAGED_NODE_GROUPS, AwsLayer
from infra.aws.node_groups import TAINT_EFFECTS, NodeGroup
from infra.aws.provisioning import KarpenterNodePools, ManagedNodeGroups, node_provisioner
from infra.config import StackConfig, Taint
from infra.render import ROOT, Rendered, run_under_mocks
from infra.scheduling import NODE_GROUP_LABEL, GpuPlacement, gpu_placement, gpu_placements, system_placement
from tests.harness import STACKS, by_type, render_config, stack_config, stack_doc

NS = "llm-platform:"
MARK = Taint(key="example.com/seam", value="marked", effect="NoSchedule")


def _build(cfg: StackConfig) -> tuple[AwsLayer, list[dict[str, Any]]]:
    """build_aws alone, under the mocks: the layer it hands down and what it declared."""
    made: dict[str, AwsLayer] = {}

    async def program() -> None:
        made["layer"] = build_aws(cfg)

    resources = run_under_mocks("dev", {"aws:region": cfg.region}, [], program)
    return made["layer"], resources


def _pod_specs(value: Any) -> list[dict[str, Any]]:
    """Every pod spec (a mapping with `containers`) anywhere in `value`."""
    if isinstance(value, dict):
        own = [value] if "containers" in value else []
        return own + [spec for v in value.values() for spec in _pod_specs(v)]
    if isinstance(value, list):
        return [spec for v in value for spec in _pod_specs(v)]
    return []


def _marked(placement: GpuPlacement) -> GpuPlacement:
    """The placement with a node-group label of another value, one more label and one more taint."""
    labels = {**placement.labels, NODE_GROUP_LABEL: f"{placement.group}-marked", MARK.key: MARK.value}
    return replace(placement, labels=labels, taints=(*placement.taints, MARK))


def test_the_configured_provisioner_is_managed_node_groups_with_the_configs_placements() -> None:
    cfg = stack_config("prod")
    nodes = node_provisioner(cfg)
    assert isinstance(nodes, ManagedNodeGroups)
    assert nodes.name == MANAGED_NODE_GROUPS == "managed_node_groups"
    assert nodes.system == system_placement(cfg)
    assert nodes.gpu == gpu_placements(cfg)


def _managed(config: dict[str, Any]) -> None:
    config[f"{NS}cluster"]["node_provisioner"] = MANAGED_NODE_GROUPS


def test_an_unknown_provisioner_is_refused_by_name() -> None:
    cfg = cast(StackConfig, SimpleNamespace(cluster=SimpleNamespace(node_provisioner="fargate")))
    with pytest.raises(ValueError, match="'fargate' is not one of \\['karpenter', 'managed_node_groups'\\]"):
        node_provisioner(cfg)


@pytest.mark.parametrize("stack", STACKS)
def test_the_layer_hands_down_what_the_provisioner_made(stack: str) -> None:
    cfg = stack_config(stack, _managed)
    layer, resources = _build(cfg)
    groups = [cfg.node_groups.system.name, *(g.name for g in cfg.node_groups.gpu)]
    assert layer.node_provisioner == MANAGED_NODE_GROUPS
    assert layer.system == system_placement(cfg)
    assert layer.gpu == gpu_placements(cfg)
    assert list(layer.node_group_names) == groups
    # In-cluster resources wait for every node group and the add-ons that need nodes.
    assert [type(r) for r in layer.cluster_ready] == [NodeGroup] * len(groups) + [EksAddons]
    made = [r["name"] for r in resources if r["type"] == "llm-platform:aws:NodeGroup"]
    assert made == [f"nodes-{g}" for g in groups]


def test_an_existing_cluster_gets_the_placements_but_no_nodes() -> None:
    existing = {
        f"{NS}cluster": {"mode": "existing", "name": "shared-gpu", "kubeconfig_context": "shared-gpu-admin"},
        f"{NS}image": {"reference": "registry.example.com/llm-serving@sha256:" + "ab" * 32},
    }
    cfg = stack_config("dev", edit=lambda config: config.update(existing))
    layer, resources = _build(cfg)
    assert layer.node_provisioner == MANAGED_NODE_GROUPS
    assert layer.system == system_placement(cfg) and layer.gpu == gpu_placements(cfg)
    assert layer.node_group_names == {} and layer.cluster_ready == []
    assert not [r for r in resources if r["type"] == "llm-platform:aws:NodeGroup"]


def _node_labels_and_taints(r: Rendered, provisioner: str, group: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A GPU group's node labels and taints (Kubernetes spelling) as its provisioner declared them."""
    if provisioner == KARPENTER:
        (pool,) = [m for m in r.manifests if m.get("kind") == "NodePool" and m["metadata"]["name"] == group]
        template = pool["spec"]["template"]
        return template["metadata"]["labels"], template["spec"]["taints"]
    (node_group,) = [x for x in by_type(r, "aws:eks/nodeGroup:NodeGroup") if x["name"] == f"nodes-{group}"]
    effects = {v: k for k, v in TAINT_EFFECTS.items()}
    return node_group["inputs"]["labels"], [
        {**t, "effect": effects[t["effect"]]} for t in node_group["inputs"]["taints"]
    ]


@pytest.mark.parametrize("provisioner", [MANAGED_NODE_GROUPS, KARPENTER])
def test_gpu_pods_and_gpu_nodes_take_their_scheduling_from_the_same_placement(
    monkeypatch: pytest.MonkeyPatch, provisioner: str
) -> None:
    """Change the provisioner's GPU placements: the nodes (node groups or NodePools) and the GPU pods follow."""
    make = {MANAGED_NODE_GROUPS: ManagedNodeGroups.from_config, KARPENTER: KarpenterNodePools.from_config}[provisioner]

    def marked(cfg: StackConfig) -> provisioning.NodeProvisioner:
        nodes = make(cfg)
        return replace(nodes, gpu={name: _marked(p) for name, p in nodes.gpu.items()})

    monkeypatch.setitem(provisioning.PROVISIONERS, provisioner, marked)
    doc = stack_doc("dev")
    doc = {
        **doc,
        "config": {**doc["config"], f"{NS}cluster": {**doc["config"][f"{NS}cluster"], "node_provisioner": provisioner}},
    }
    cfg = stack_config("dev")
    r: Rendered = render_config(doc, "dev")
    pods = _pod_specs(r.manifests)
    for group in cfg.node_groups.gpu:
        placement = _marked(gpu_placement(group))
        labels, taints = _node_labels_and_taints(r, provisioner, group.name)
        assert labels == placement.labels
        assert [(t["key"], t.get("value", ""), t["effect"]) for t in taints] == [
            (t.key, t.value, t.effect) for t in placement.taints
        ]
        selecting = [p for p in pods if p.get("nodeSelector") == placement.node_selector()]
        assert selecting, f"no pod selects the nodes of {group.name}"
        for pod in selecting:
            assert all(t in pod["tolerations"] for t in placement.tolerations())
    unmarked = {gpu_placement(g).labels[NODE_GROUP_LABEL] for g in cfg.node_groups.gpu}
    assert not [p for p in pods if p.get("nodeSelector", {}).get(NODE_GROUP_LABEL) in unmarked]


def test_build_aws_knows_nothing_about_node_groups() -> None:
    """The layer asks the seam; node groups are the managed-node-groups provisioner's business."""
    tree = ast.parse((ROOT / "infra" / "aws" / "build.py").read_text())
    imported = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not [name for name in imported if "node_group" in name.lower() or name.endswith(".NodeGroup")]
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "node_groups" not in attributes


@pytest.mark.parametrize(
    ("stack", "edit", "runs"),
    # On a cluster this program makes the platform part is always on (config: it may be off only
    # on an existing cluster, where no role is made at all): the provisioner decides.
    [("dev", None, False), ("prod", _managed, True)],
)
def test_cluster_autoscaler_gets_a_role_only_where_it_runs(stack: str, edit: Any, runs: bool) -> None:
    cfg = stack_config(stack, edit)
    layer, resources = _build(cfg)
    # The platform installs the chart under the same condition (infra/cluster_services/build.py).
    installed = cfg.platform.cluster_autoscaler.enabled and layer.node_provisioner == MANAGED_NODE_GROUPS
    assert uses_cluster_autoscaler(cfg, layer.node_provisioner) == installed == runs
    made = {r["name"] for r in resources if r["type"].startswith(("aws:iam/", "aws:eks/podIdentityAssociation"))}
    assert ("pod-identities-cluster-autoscaler" in made) == runs
    # The identity is still handed down (its service account's name), with a role only where it runs.
    assert layer.cluster_autoscaler.service_account == "cluster-autoscaler"
    assert (layer.cluster_autoscaler.role_arn is not None) == runs
