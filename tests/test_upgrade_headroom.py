"""Capacity during a NewCluster upgrade: the old cluster as traffic holds it beside the new one at its start.

KubeRay (v1.7.0, rayservice_controller.go constructRayClusterForRayService)
starts the pending cluster's worker groups at their `replicas` while the
active cluster keeps its scale. `ray.upgrade_headroom: peak` sizes each GPU
group for the old cluster at max_replicas, `min` for it at min_replicas.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from infra.capacity.prices import price
from infra.capacity.report import markdown, plan_stack, stack_output, text, upgrade_at_peak, upgrade_line, upgrade_plan
from infra.capacity.upgrade import Fleet, UpgradeNeed, headroom_problem
from infra.config import ConfigError, StackConfig, capacity_input, upgrade_need
from infra.instance_types import GPU_INSTANCE_TYPES
from tests.harness import by_type, doc_config, manifests_of, render_config, render_stack, stack_config, stack_doc
from workloads.inference_server.catalog import ServeAutoscaling

NS = "llm-platform:"
Edit = Callable[[dict[str, Any]], None]
# Prod's 70B model: min 2, max 4 replicas of 4 GPUs on l40s-4x (node_groups.gpu[1]) of g6e.12xlarge.
BIG_GROUP = 1
BIG_MODEL = 1


def _doc(stack: str, *edits: Edit) -> dict[str, Any]:
    doc = copy.deepcopy(stack_doc(stack))
    for edit in edits:
        edit(doc["config"])
    return doc


def _max_size(group: int, size: int) -> Edit:
    return lambda config: config[NS + "node_groups"]["gpu"][group].update(max_size=size)


def _headroom(value: str) -> Edit:
    return lambda config: config.setdefault(NS + "ray", {}).update(upgrade_headroom=value)


def _scaling(model: int, **values: int) -> Edit:
    return lambda config: config[NS + "models"][model]["autoscaling"].update(values)


def _refused(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        doc_config(doc)
    return [str(p) for p in info.value.problems]


def _big_group_problem(size: int, arithmetic: str, nodes: int) -> str:
    return (
        f"config error: node_groups.gpu[1].max_size: {size} leaves group 'l40s-4x' no room for a NewCluster upgrade "
        "at peak (ray.upgrade_headroom: peak): the old cluster at max_replicas and the new one at its starting "
        f"replicas (initial_replicas, else min_replicas) need {arithmetic}; raise max_size to {nodes}, or set "
        "ray.upgrade_headroom: min and accept that an upgrade started at peak waits for the old cluster to scale down"
    )


# --- the rule ---------------------------------------------------------------------------------------------------


def test_peak_is_the_default() -> None:
    assert stack_config("prod").ray.upgrade_headroom == "peak"
    assert stack_config("dev").ray.upgrade_headroom == "peak"


def test_a_group_without_room_beside_the_old_cluster_at_max_is_refused_under_peak() -> None:
    """The old cluster at 4 replicas and the new one at 2: 6 nodes; 5 is one short."""
    assert _refused(_doc("prod", _max_size(BIG_GROUP, 5))) == [
        _big_group_problem(5, "'llama-33-70b' (4 + 2) x 4 = 24 GPUs = 6 g6e.12xlarge nodes", 6)
    ]


def test_the_same_group_is_accepted_under_min() -> None:
    cfg = doc_config(_doc("prod", _max_size(BIG_GROUP, 5), _headroom("min")))
    assert cfg.ray.upgrade_headroom == "min"
    assert cfg.node_groups.gpu[BIG_GROUP].max_size == 5


def test_the_old_two_times_min_rule_is_not_enough() -> None:
    """Four nodes held 2 x min_replicas (the rule before `peak`); at peak the new cluster finds none free."""
    old_rule_nodes = 2 * 2 * 4 // GPU_INSTANCE_TYPES["g6e.12xlarge"].gpus
    assert old_rule_nodes == 4
    assert _refused(_doc("prod", _max_size(BIG_GROUP, old_rule_nodes))) == [
        _big_group_problem(4, "'llama-33-70b' (4 + 2) x 4 = 24 GPUs = 6 g6e.12xlarge nodes", 6)
    ]
    # And `min` is that old rule, chosen on purpose.
    doc_config(_doc("prod", _max_size(BIG_GROUP, old_rule_nodes), _headroom("min")))


def test_exactly_fitting_passes_under_either_setting() -> None:
    cfg = doc_config(_doc("prod", _max_size(BIG_GROUP, 6)))
    assert upgrade_need(cfg, cfg.node_groups.gpu[BIG_GROUP]).nodes == 6
    cfg = doc_config(_doc("prod", _max_size(BIG_GROUP, 4), _headroom("min")))
    assert upgrade_need(cfg, cfg.node_groups.gpu[BIG_GROUP]).nodes == 4


def test_under_min_one_node_short_is_refused_with_no_other_way_out() -> None:
    assert _refused(_doc("prod", _max_size(BIG_GROUP, 3), _headroom("min"))) == [
        "config error: node_groups.gpu[1].max_size: 3 leaves group 'l40s-4x' no room for a NewCluster upgrade "
        "(ray.upgrade_headroom: min): the old cluster at min_replicas and the new one at its starting replicas "
        "(initial_replicas, else min_replicas) need 'llama-33-70b' (2 + 2) x 4 = 16 GPUs = 4 g6e.12xlarge nodes; "
        "raise max_size to 4"
    ]


def test_the_new_cluster_starts_at_initial_replicas() -> None:
    """The worker group's `replicas` is initial_replicas when set: the new cluster starts there."""
    found = _refused(_doc("prod", _scaling(BIG_MODEL, initial_replicas=3)))
    assert found == [_big_group_problem(6, "'llama-33-70b' (4 + 3) x 4 = 28 GPUs = 7 g6e.12xlarge nodes", 7)]
    # Under min the old cluster is at min_replicas, the new one still at its start: 2 + 3.
    cfg = doc_config(_doc("prod", _scaling(BIG_MODEL, initial_replicas=3), _headroom("min")))
    assert upgrade_need(cfg, cfg.node_groups.gpu[BIG_GROUP]).gpus == (2 + 3) * 4


def test_every_model_of_a_group_upgrades_at_once() -> None:
    """A new image reaches every RayService: each model's old and new clusters share the group."""

    def second_small_model(config: dict[str, Any]) -> None:
        small = copy.deepcopy(config[NS + "models"][0])
        small.update(name="llama-31-8b-b", model_id="llama-3.1-8b-b")
        small["autoscaling"].update(min_replicas=2, max_replicas=3)
        config[NS + "models"].append(small)

    found = _refused(_doc("prod", second_small_model))
    assert len(found) == 1 and found[0].startswith("config error: node_groups.gpu[0].max_size: 10 leaves group")
    assert "'llama-31-8b' (8 + 2) x 1 + 'llama-31-8b-b' (3 + 2) x 1 = 15 GPUs = 15 g6e.2xlarge nodes" in found[0]
    doc_config(_doc("prod", second_small_model, _max_size(0, 15)))


def test_no_headroom_without_new_cluster_upgrades() -> None:
    def no_upgrades(config: dict[str, Any]) -> None:
        config[NS + "ray"]["upgrade_strategy"] = "None"

    inputs = capacity_input(doc_config(_doc("prod", _max_size(BIG_GROUP, 4), no_upgrades)))
    assert upgrade_plan(inputs) == []
    assert all(u.fits for u in upgrade_at_peak(inputs))


def test_the_setting_is_one_of_two() -> None:
    assert _refused(_doc("prod", _headroom("half"))) == [
        "config error: ray.upgrade_headroom: Input should be 'peak' or 'min' (got \"half\")"
    ]


def test_the_arithmetic_packs_small_replicas_into_whole_nodes() -> None:
    """Two-GPU replicas on four-GPU nodes: (3 + 1) x 2 = 8 GPUs = 2 nodes, 1 node is short."""
    scaling = ServeAutoscaling(min_replicas=1, max_replicas=3)
    need = UpgradeNeed("g", "peak", GPU_INSTANCE_TYPES["g6e.12xlarge"], (Fleet("m", 2, scaling),))
    assert (need.old_gpus, need.new_gpus, need.nodes, need.old_nodes) == (6, 2, 2, 2)
    assert headroom_problem(need, 2) is None
    assert headroom_problem(need, 1) is not None


# --- what the program builds from it ----------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_managed_node_groups_hold_a_peak_upgrade(stack: str) -> None:
    cfg = stack_config(stack)
    groups = {r["name"]: r["inputs"] for r in by_type(render_stack(stack), "aws:eks/nodeGroup:NodeGroup")}
    for u in upgrade_plan(capacity_input(cfg)):
        if cfg.cluster.node_provisioner == "managed_node_groups":
            assert groups[f"nodes-{u.group.name}"]["scalingConfig"]["maxSize"] >= u.need.nodes


def test_the_karpenter_pools_limit_gpus_no_lower_than_a_peak_upgrade() -> None:
    def karpenter(config: dict[str, Any]) -> None:
        config[NS + "cluster"]["node_provisioner"] = "karpenter"

    doc = _doc("prod", karpenter)
    cfg = doc_config(doc)
    pools = {p["metadata"]["name"]: p["spec"] for p in manifests_of(render_config(doc, "prod"), "NodePool")}
    for u in upgrade_plan(capacity_input(cfg)):
        assert int(pools[u.group.name]["limits"]["nvidia.com/gpu"]) >= u.need.gpus


# --- the capacity plan and the twin's question ------------------------------------------------------------------


def _prod(*edits: Edit) -> StackConfig:
    return doc_config(_doc("prod", *edits))


def test_the_plan_shows_each_groups_upgrade_gpus_and_their_cost() -> None:
    cfg = _prod()
    inputs = capacity_input(cfg)
    plan = {u.group.name: u for u in upgrade_plan(inputs)}
    big = plan["l40s-4x"]
    hourly = price(cfg.region, "g6e.12xlarge", "on_demand")
    assert hourly is not None and big.cost is not None
    assert (big.need.gpus, big.need.nodes) == (24, 6)
    assert big.cost.usd_per_hour == pytest.approx(6 * hourly.usd_per_hour)
    assert big.cost.extra_usd_per_hour == pytest.approx(2 * hourly.usd_per_hour)
    line = upgrade_line(big)
    assert line.startswith("upgrade headroom l40s-4x (ray.upgrade_headroom: peak): ")
    assert "'llama-33-70b' (4 + 2) x 4 = 24 GPUs = 6 g6e.12xlarge nodes of max_size 6" in line
    assert f"${6 * hourly.usd_per_hour:,.2f}/h while it runs" in line
    plans = plan_stack(inputs)
    for shown in (markdown("prod", inputs, plans), text("prod", inputs, plans)):
        assert all(upgrade_line(u) in shown for u in plan.values())
    output = stack_output(inputs, plans)["upgrade"]["l40s-4x"]
    assert (output["headroom"], output["gpus"], output["nodes"], output["max_size"]) == ("peak", 24, 6, 6)


def test_the_plan_follows_the_setting() -> None:
    big = next(u for u in upgrade_plan(capacity_input(_prod(_headroom("min")))) if u.group.name == "l40s-4x")
    assert (big.need.headroom, big.need.gpus, big.need.nodes) == ("min", 16, 4)
    assert "(ray.upgrade_headroom: min): the old cluster at min_replicas" in upgrade_line(big)


def test_the_capacity_output_carries_the_upgrade_headroom() -> None:
    inputs = capacity_input(stack_config("prod"))
    got = render_stack("prod").outputs["capacity"]["upgrade"]
    assert got == {
        name: {k: v for k, v in value.items() if v is not None}
        for name, value in stack_output(inputs, plan_stack(inputs))["upgrade"].items()
    }


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_committed_stacks_place_an_upgrade_at_peak(stack: str) -> None:
    checks = upgrade_at_peak(capacity_input(stack_config(stack)))
    assert checks and all(c.fits for c in checks), [c.reason for c in checks]


def test_under_min_the_twin_sees_the_trade_off() -> None:
    checks = {c.group: c for c in upgrade_at_peak(capacity_input(_prod(_max_size(BIG_GROUP, 4), _headroom("min"))))}
    big = checks["l40s-4x"]
    assert not big.fits and (big.gpus_needed, big.gpus_available) == (24, 16)
    assert big.reason == (
        "group 'l40s-4x' at peak: 'llama-33-70b' (4 + 2) x 4 = 24 GPUs = 6 g6e.12xlarge nodes, max_size 4 = 16 GPUs: "
        "does not fit, the new cluster's pods wait for the old one to scale down (ray.upgrade_headroom: min)"
    )
    assert checks["l40s-1x"].fits
