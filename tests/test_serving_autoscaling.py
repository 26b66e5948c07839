"""Scheduled GPU headroom, priorities, disruption budgets, and nothing scaling Ray objects."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from infra import versions
from infra.scheduling import gpu_placements
from infra.serving import kuberay
from infra.serving.autoscaling import HEADROOM_CLASS, SERVING_CLASS, budget, headroom_name
from infra.serving.ray_service import INGRESS_GROUP, worker_group_name
from tests.harness import manifests_of, ray_services, reference_dir, render_stack
from tests.harness import stack_config as config

STACKS = ["dev", "prod"]
RAY_KINDS = {"RayService", "RayCluster", "RayJob"}


@pytest.mark.parametrize("stack", STACKS)
def test_nothing_points_an_hpa_or_scaled_object_at_ray(stack: str) -> None:
    rendered = render_stack(stack)
    targets = [m["spec"]["scaleTargetRef"] for m in manifests_of(rendered, "ScaledObject")]
    targets += [m["spec"]["scaleTargetRef"] for m in manifests_of(rendered, "HorizontalPodAutoscaler")]
    for target in targets:
        assert target["kind"] not in RAY_KINDS
        assert not target.get("apiVersion", "").startswith("ray.io/")
    names = {rs["metadata"]["name"] for rs in ray_services(stack)}
    assert not {t["name"] for t in targets} & names


def test_prescale_windows_hold_whole_gpu_nodes_of_their_group() -> None:
    cfg = config("prod")
    rendered = render_stack("prod")
    deployments = {d["metadata"]["name"]: d for d in manifests_of(rendered, "Deployment")}
    scaled = {s["metadata"]["name"]: s for s in manifests_of(rendered, "ScaledObject")}
    assert cfg.autoscaling.prescale
    for window in cfg.autoscaling.prescale:
        placement = gpu_placements(cfg)[window.gpu_group]
        dep = deployments[headroom_name(window)]
        assert dep["spec"]["replicas"] == 0
        pod = dep["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == HEADROOM_CLASS
        assert pod["tolerations"] == placement.tolerations()
        assert pod["nodeSelector"] == placement.node_selector()
        (container,) = pod["containers"]
        assert container["image"] == versions.PAUSE_IMAGE
        assert container["resources"]["requests"]["nvidia.com/gpu"] == str(placement.gpus_per_node)
        so = scaled[headroom_name(window)]["spec"]
        assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": headroom_name(window)}
        assert so["minReplicaCount"] == 0
        assert so["maxReplicaCount"] == window.nodes
        (trigger,) = so["triggers"]
        assert trigger["type"] == "cron"
        assert trigger["metadata"] == {
            "timezone": window.timezone,
            "start": window.start,
            "end": window.end,
            "desiredReplicas": str(window.nodes),
        }


def test_no_prescale_in_dev_means_no_headroom() -> None:
    rendered = render_stack("dev")
    assert manifests_of(rendered, "ScaledObject") == []
    assert not [d for d in manifests_of(rendered, "Deployment") if d["metadata"]["name"].startswith("gpu-headroom")]


@pytest.mark.parametrize("stack", STACKS)
def test_serving_preempts_headroom_and_headroom_still_scales_nodes(stack: str) -> None:
    classes = {p["metadata"]["name"]: p for p in manifests_of(render_stack(stack), "PriorityClass")}
    headroom, serving = classes[HEADROOM_CLASS], classes[SERVING_CLASS]
    assert headroom["value"] < 0
    # cluster-autoscaler ignores pods below its expendable cutoff (-10).
    assert headroom["value"] >= -10
    assert headroom["preemptionPolicy"] == "Never"
    assert serving["value"] > 0 > headroom["value"]
    assert not headroom.get("globalDefault") and not serving.get("globalDefault")
    for rs in ray_services(stack):
        for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
            if g["groupName"].startswith("gpu-"):
                assert g["template"]["spec"]["priorityClassName"] == SERVING_CLASS


@pytest.mark.parametrize("stack", STACKS)
def test_disruption_budgets_cover_head_and_every_worker_group(stack: str) -> None:
    cfg = config(stack)
    pdbs = {p["metadata"]["name"]: p["spec"] for p in manifests_of(render_stack(stack), "PodDisruptionBudget")}
    for name, models in cfg.services().items():
        head = pdbs[f"{name}-head"]
        # The head may restart only where the GCS keeps its state in Redis.
        expected = {"maxUnavailable": 1} if cfg.ray.gcs_fault_tolerance.enabled else {"minAvailable": 1}
        assert {k: v for k, v in head.items() if k != "selector"} == expected
        assert head["selector"]["matchLabels"] == {**kuberay.pods_of(name), kuberay.NODE_TYPE: "head"}
        if cfg.layout_of(name) == "serve-ingress":
            ingress = pdbs[f"{name}-{INGRESS_GROUP}"]
            assert ingress == {
                **budget(cfg.serving.ingress.min_replicas),
                "selector": {"matchLabels": {**kuberay.pods_of(name), kuberay.GROUP: INGRESS_GROUP}},
            }
        else:
            # No ingress group runs, so no budget for it.
            assert f"{name}-{INGRESS_GROUP}" not in pdbs
        for model in models:
            spec = pdbs[f"{name}-{worker_group_name(model)}"]
            assert {k: v for k, v in spec.items() if k != "selector"} == budget(model.autoscaling.min_replicas)
            assert spec["selector"]["matchLabels"][kuberay.GROUP] == worker_group_name(model)
            assert spec["selector"]["matchLabels"][kuberay.SERVICE_LABEL] == name


def test_scaled_objects_match_the_pinned_keda_crd() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    path = reference_dir() / "keda" / "crd-scaledobjects.yaml"
    crd: dict[str, Any] = yaml.safe_load(path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    objects = manifests_of(render_stack("prod"), "ScaledObject")
    assert objects
    for obj in objects:
        jsonschema.Draft7Validator(v1["schema"]["openAPIV3Schema"]).validate(obj)


def test_one_replica_that_must_stay_is_held_by_min_available() -> None:
    assert budget(1) == {"minAvailable": 1}
    assert budget(2) == budget(0) == {"maxUnavailable": 1}
