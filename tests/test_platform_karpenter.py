"""Karpenter in the cluster: NodePools and EC2NodeClasses against the pinned CRDs; one placement, two provisioners.

Every stack renders under both node provisioners (the committed file and a
copy with `cluster.node_provisioner` flipped). Under each, the GPU worker
pods' nodeSelector and tolerations are checked against what the nodes
carry: the NodePool template under Karpenter, the managed node group under
managed node groups.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from infra import versions
from infra.aws.node_groups import TAINT_EFFECTS
from infra.cluster_services import karpenter
from infra.config import longest_generation_seconds
from infra.render import ROOT, Rendered
from infra.scheduling import GPU_MODEL_LABEL, NODE_GROUP_LABEL, gpu_placements
from policy import rules
from policy.rules import Resource
from tests.harness import (
    by_type,
    manifests_of,
    reference_dir,
    render_cli,
    render_config,
    render_stack,
    stack_config,
    stack_doc,
)

PROVISIONERS = ("karpenter", "managed_node_groups")
STACKS = ("dev", "prod")
CLUSTER = "llm-platform:cluster"


def _doc(stack: str, provisioner: str) -> dict[str, Any]:
    doc = copy.deepcopy(stack_doc(stack))
    doc["config"][CLUSTER]["node_provisioner"] = provisioner
    return doc


@cache
def rendered(stack: str, provisioner: str) -> Rendered:
    """A stack under one provisioner: the committed render when the file selects it, else a flipped copy."""
    if stack_config(stack).cluster.node_provisioner == provisioner:
        return render_stack(stack)
    return render_config(_doc(stack, provisioner), stack)


@cache
def crd_schema(name: str) -> dict[str, Any]:
    """The v1 openAPIV3Schema of one pinned Karpenter CRD file."""
    crd = yaml.safe_load((reference_dir() / "karpenter" / name).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


SCHEMAS = {"NodePool": "crd-nodepools.yaml", "EC2NodeClass": "crd-ec2nodeclasses.yaml"}


def _validate(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(crd_schema(SCHEMAS[obj["kind"]])).validate(obj)


def _gpu_worker_templates(r: Rendered) -> list[dict[str, Any]]:
    """The pod templates of every GPU worker group of every RayService."""
    out = []
    for rs in manifests_of(r, "RayService"):
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
            if "nvidia.com/gpu" in limits:
                out.append(g["template"])
    assert out, "no GPU worker group rendered"
    return out


def _taints_as_tolerations(taints: list[dict[str, str]]) -> list[dict[str, str]]:
    return sorted(
        ({"key": t["key"], "operator": "Equal", "value": t.get("value", ""), "effect": t["effect"]} for t in taints),
        key=lambda t: (t["key"], t["value"], t["effect"]),
    )


def _node_side(r: Rendered, provisioner: str) -> dict[str, tuple[dict[str, str], list[dict[str, str]]]]:
    """Each GPU group's node labels and taints (as tolerations), read from what the provisioner declared."""
    out = {}
    if provisioner == "karpenter":
        for pool in manifests_of(r, "NodePool"):
            template = pool["spec"]["template"]
            out[pool["metadata"]["name"]] = (template["metadata"]["labels"], template["spec"].get("taints", []))
    else:
        effects = {v: k for k, v in TAINT_EFFECTS.items()}
        for group in by_type(r, "aws:eks/nodeGroup:NodeGroup"):
            inputs = group["inputs"]
            if GPU_MODEL_LABEL not in inputs["labels"]:
                continue  # the system group
            taints = [{**t, "effect": effects[t["effect"]]} for t in inputs.get("taints", [])]
            out[inputs["labels"][NODE_GROUP_LABEL]] = (inputs["labels"], taints)
    return {name: (labels, _taints_as_tolerations(taints)) for name, (labels, taints) in out.items()}


# --- both provisioners render, and only one of them installs its pieces -----------------------------


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("provisioner", PROVISIONERS)
def test_every_stack_renders_under_both_provisioners(stack: str, provisioner: str) -> None:
    r = rendered(stack, provisioner)
    charts = {h["chart"] for h in r.helm}
    pools = manifests_of(r, "NodePool")
    gpu_groups = [g.name for g in stack_config(stack).node_groups.gpu]
    managed = {g["inputs"]["labels"][NODE_GROUP_LABEL] for g in by_type(r, "aws:eks/nodeGroup:NodeGroup")}
    if provisioner == "karpenter":
        assert "karpenter" in charts and "cluster-autoscaler" not in charts
        assert sorted(p["metadata"]["name"] for p in pools) == sorted(gpu_groups)
        assert sorted(c["metadata"]["name"] for c in manifests_of(r, "EC2NodeClass")) == sorted(gpu_groups)
        # The system nodes stay a managed node group; no GPU group is one.
        assert managed == {stack_config(stack).node_groups.system.name}
    else:
        assert "cluster-autoscaler" in charts and "karpenter" not in charts
        assert not pools and not manifests_of(r, "EC2NodeClass")
        assert managed == {stack_config(stack).node_groups.system.name, *gpu_groups}
        assert not [x for x in r.resources if x["type"] == "llm-platform:aws:KarpenterController"]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("provisioner", PROVISIONERS)
def test_gpu_pods_select_and_tolerate_exactly_what_their_nodes_carry(stack: str, provisioner: str) -> None:
    r = rendered(stack, provisioner)
    nodes = _node_side(r, provisioner)
    for template in _gpu_worker_templates(r):
        spec = template["spec"]
        group = spec["nodeSelector"][NODE_GROUP_LABEL]
        labels, tolerated = nodes[group]
        # Every label the pod selects is on the node, with the same value.
        assert spec["nodeSelector"].items() <= labels.items()
        # The pod tolerates each taint of its nodes, and nothing else.
        tolerations = sorted(spec.get("tolerations", []), key=lambda t: (t["key"], t["value"], t["effect"]))
        assert tolerations == tolerated


def test_the_node_side_is_the_same_under_both_provisioners() -> None:
    """Labels and taints of a GPU group do not depend on who makes its nodes."""
    for stack in STACKS:
        assert _node_side(rendered(stack, "karpenter"), "karpenter") == _node_side(
            rendered(stack, "managed_node_groups"), "managed_node_groups"
        )


def test_a_pool_carries_the_placements_own_objects() -> None:
    """The NodePool is built from the GpuPlacement's labels dict itself, not from a retyped copy."""
    cfg = stack_config("prod")
    placements = gpu_placements(cfg)
    for group in cfg.node_groups.gpu:
        spec = karpenter.node_pool_spec(cfg, group, placements[group.name])
        assert spec["template"]["metadata"]["labels"] is placements[group.name].labels
        assert [(t["key"], t.get("value", ""), t["effect"]) for t in spec["template"]["spec"]["taints"]] == [
            (t.key, t.value, t.effect) for t in placements[group.name].taints
        ]


# --- the pinned CRDs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_node_pools_and_node_classes_match_the_pinned_crds(stack: str) -> None:
    objects = [
        *manifests_of(rendered(stack, "karpenter"), "NodePool"),
        *manifests_of(rendered(stack, "karpenter"), "EC2NodeClass"),
    ]
    assert objects
    for obj in objects:
        assert obj["apiVersion"] in {"karpenter.sh/v1", "karpenter.k8s.aws/v1"}
        _validate(obj)
        if obj["kind"] == "EC2NodeClass":
            # CEL rules the schema check can not run: exactly one of role and
            # instanceProfile; an alias is the only AMI term.
            spec = obj["spec"]
            assert ("role" in spec) != ("instanceProfile" in spec)
            assert len(spec["amiSelectorTerms"]) == 1 and "alias" in spec["amiSelectorTerms"][0]


def test_the_crd_check_rejects_a_broken_pool() -> None:
    pool = copy.deepcopy(manifests_of(rendered("dev", "karpenter"), "NodePool")[0])
    pool["spec"]["disruption"]["consolidationPolicy"] = "Never"
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)
    node_class = copy.deepcopy(manifests_of(rendered("dev", "karpenter"), "EC2NodeClass")[0])
    node_class["spec"]["metadataOptions"]["httpTokens"] = "sometimes"
    with pytest.raises(jsonschema.ValidationError):
        _validate(node_class)


# --- what the pools hold to -----------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_pools_never_consolidate_busy_nodes_and_limit_their_gpus(stack: str) -> None:
    cfg = stack_config(stack)
    pools = {p["metadata"]["name"]: p["spec"] for p in manifests_of(rendered(stack, "karpenter"), "NodePool")}
    for group in cfg.node_groups.gpu:
        spec = pools[group.name]
        assert spec["disruption"]["consolidationPolicy"] == "WhenEmpty"
        assert spec["disruption"]["budgets"] == [{"nodes": "1"}]
        assert spec["template"]["spec"]["expireAfter"] == karpenter.EXPIRE_AFTER
        assert int(spec["limits"]["nvidia.com/gpu"]) == group.max_size * group.instance().gpus
        requirements = {req["key"]: req["values"] for req in spec["template"]["spec"]["requirements"]}
        assert requirements["node.kubernetes.io/instance-type"] == group.instance_types
        assert requirements["karpenter.sh/capacity-type"] == [group.capacity_type.replace("_", "-")]


@pytest.mark.parametrize("stack", STACKS)
def test_a_draining_node_outwaits_its_ray_workers(stack: str) -> None:
    """Karpenter's terminationGracePeriod never cuts short the pods' preStop drain."""
    r = rendered(stack, "karpenter")
    grace = {
        p["metadata"]["name"]: p["spec"]["template"]["spec"]["terminationGracePeriod"]
        for p in manifests_of(r, "NodePool")
    }
    for template in _gpu_worker_templates(r):
        node = int(grace[template["spec"]["nodeSelector"][NODE_GROUP_LABEL]].removesuffix("s"))
        assert node > template["spec"]["terminationGracePeriodSeconds"]
        assert node >= longest_generation_seconds(stack_config(stack))


@pytest.mark.parametrize("stack", STACKS)
def test_node_classes_pin_the_ami_and_lock_down_the_node(stack: str) -> None:
    cfg = stack_config(stack)
    classes = {c["metadata"]["name"]: c["spec"] for c in manifests_of(rendered(stack, "karpenter"), "EC2NodeClass")}
    for group in cfg.node_groups.gpu:
        spec = classes[group.name]
        alias = spec["amiSelectorTerms"][0]["alias"]
        family, version = alias.split("@")
        assert family == {"al2023_nvidia": "al2023", "bottlerocket_nvidia": "bottlerocket"}[group.ami]
        assert version != "latest"
        assert spec["metadataOptions"]["httpTokens"] == "required"
        assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
        assert spec["instanceStorePolicy"] == "RAID0"
        assert all(b["ebs"]["encrypted"] and b["ebs"]["volumeType"] == "gp3" for b in spec["blockDeviceMappings"])
        assert all(set(t) == {"id"} for t in spec["subnetSelectorTerms"] + spec["securityGroupSelectorTerms"])


@pytest.mark.parametrize("stack", STACKS)
def test_node_classes_turn_on_soci_parallel_pull_and_leave_the_raid_to_karpenter(stack: str) -> None:
    classes = manifests_of(rendered(stack, "karpenter"), "EC2NodeClass")
    assert classes
    for node_class in classes:
        text = node_class["spec"]["userData"]
        assert "application/node.eks.aws" in text
        (part,) = [p for p in text.split("--//") if "NodeConfig" in p]
        config = json.loads(part[part.index("{") :])
        assert config["spec"]["featureGates"] == {"FastImagePull": True}
        # instanceStorePolicy builds the RAID0; nodeadm must not build a second one.
        assert "instance" not in config["spec"]


def test_bottlerocket_node_classes_get_soci_settings_in_toml() -> None:
    doc = _doc("dev", "karpenter")
    doc["config"]["llm-platform:node_groups"]["gpu"][0]["ami"] = "bottlerocket_nvidia"
    (node_class,) = manifests_of(render_config(doc, "dev"), "EC2NodeClass")
    spec = node_class["spec"]
    _validate(node_class)
    assert "parallel-pull-unpack" in spec["userData"]
    assert "node.eks.aws" not in spec["userData"]
    assert spec["amiSelectorTerms"] == [{"alias": versions.KARPENTER_AMI_ALIASES["bottlerocket_nvidia"]}]


def test_reservations_come_first_and_are_selected_by_id() -> None:
    cfg = stack_config("prod", lambda c: c[f"{CLUSTER}"].update(node_provisioner="karpenter"))
    group = cfg.node_groups.gpu[0].model_copy(update={"capacity_reservation_ids": ["cr-0123456789abcdef0"]})
    # Pure functions only: an Output made outside a Pulumi run would hold up the next run.
    assert karpenter.reservation_terms(group) == [{"id": "cr-0123456789abcdef0"}]
    pool = karpenter.node_pool_spec(cfg, group, gpu_placements(cfg)[group.name])
    (capacity,) = [r for r in pool["template"]["spec"]["requirements"] if r["key"] == "karpenter.sh/capacity-type"]
    assert capacity["values"] == ["reserved", "on-demand"]


def test_a_stack_with_reservations_renders_them_and_passes_the_crds() -> None:
    doc = _doc("prod", "karpenter")
    doc["config"]["llm-platform:node_groups"]["gpu"][0]["capacity_reservation_ids"] = ["cr-0123456789abcdef0"]
    group = stack_config("prod").node_groups.gpu[0].name
    r = render_config(doc, "prod")
    (node_class,) = [c for c in manifests_of(r, "EC2NodeClass") if c["metadata"]["name"] == group]
    assert node_class["spec"]["capacityReservationSelectorTerms"] == [{"id": "cr-0123456789abcdef0"}]
    _validate(node_class)
    (pool,) = [p for p in manifests_of(r, "NodePool") if p["metadata"]["name"] == group]
    requirements = {x["key"]: x["values"] for x in pool["spec"]["template"]["spec"]["requirements"]}
    assert requirements["karpenter.sh/capacity-type"] == ["reserved", "on-demand"]


def test_bottlerocket_keeps_an_os_volume_and_puts_pods_on_the_data_volume() -> None:
    cfg = stack_config("dev")
    group = cfg.node_groups.gpu[0].model_copy(update={"ami": "bottlerocket_nvidia"})
    devices = karpenter.block_devices(group)
    assert [d["deviceName"] for d in devices] == ["/dev/xvda", "/dev/xvdb"]
    assert [d.get("rootVolume", False) for d in devices] == [False, True]
    assert devices[1]["ebs"]["volumeSize"] == f"{group.disk_size_gib}Gi"


# --- config errors through the render command ----------------------------------------------------------


def _render_file(tmp_path: Path, doc: dict[str, Any], stack: str) -> tuple[int, list[str]]:
    path = tmp_path / f"Pulumi.{stack}.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = render_cli("--stack", stack, "--config", str(path), "--out", str(tmp_path / "out"))
    return result.returncode, [line for line in result.stderr.splitlines() if line.startswith("config error:")]


@pytest.mark.parametrize(
    ("provisioner", "ids", "expected"),
    [
        (
            "karpenter",
            ["cr-xyz"],
            "config error: node_groups.gpu[0].capacity_reservation_ids[0]: ",
        ),
        (
            "managed_node_groups",
            ["cr-0123456789abcdef0"],
            "config error: node_groups.gpu[0].capacity_reservation_ids: needs cluster.node_provisioner: karpenter",
        ),
        ("fargate", [], "config error: cluster.node_provisioner: "),
    ],
)
def test_bad_provisioning_values_fail_with_one_line(
    tmp_path: Path, provisioner: str, ids: list[str], expected: str
) -> None:
    doc = _doc("dev", provisioner)
    if ids:
        doc["config"]["llm-platform:node_groups"]["gpu"][0]["capacity_reservation_ids"] = ids
    code, errors = _render_file(tmp_path, doc, "dev")
    assert code != 0
    assert len(errors) == 1, errors
    assert errors[0].startswith(expected), errors


# --- the policy pack over Karpenter's renders -----------------------------------------------------------


def _policy_resources(r: Rendered) -> list[Resource]:
    return [
        Resource(
            type=x["type"],
            name=x["name"],
            props=copy.deepcopy(x["inputs"]),
            protect=x["protect"],
            ref=x["name"],
            depends_on=tuple(x["depends_on"]),
        )
        for x in r.resources
    ]


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("provisioner", PROVISIONERS)
def test_the_policy_pack_passes_under_both_provisioners(stack: str, provisioner: str) -> None:
    # The stack's own policy config, as the workflows pass it (prod's endpoint is internet-facing).
    config = json.loads((ROOT / "policy" / "config" / f"{stack}.json").read_text())
    assert rules.evaluate(_policy_resources(rendered(stack, provisioner)), config) == []


def test_the_policy_pack_refuses_an_unbounded_or_consolidating_pool_and_imdsv1() -> None:
    resources = _policy_resources(rendered("dev", "karpenter"))
    (pool,) = [x for x in resources if x.type == rules.NODE_POOL]
    pool.props["spec"]["disruption"]["consolidationPolicy"] = "WhenEmptyOrUnderutilized"
    del pool.props["spec"]["limits"]
    messages = rules.check_node_pools(pool, {})
    assert len(messages) == 2 and "nvidia.com/gpu" in messages[0] and "WhenEmpty" in messages[1]
    (node_class,) = [x for x in resources if x.type == rules.EC2_NODE_CLASS]
    node_class.props["spec"]["metadataOptions"]["httpTokens"] = "optional"
    assert "IMDSv1 answers" in rules.check_imds_v2(node_class, {})[0]
