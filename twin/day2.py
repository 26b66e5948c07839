"""Day 2 of a stack, judged the way KubeRay and the load balancer controller would carry it out.

Three checks, each one PASS/FAIL line (the live upgrade under load is in
:mod:`twin.upgrade`):

* **A load-balancer change.** The stack file's source ranges and certificate
  change; the next render must change the object the AWS load balancer
  controller reads (our load-balancer Service) and nothing else: not the
  RayService (that would start a new cluster), not any other resource.
* **Upgrade at peak.** With every model at max_replicas, an image change
  starts the new cluster beside the old one. Under
  ``ray.upgrade_headroom: peak`` the GPU groups hold both and the config is
  accepted; under ``min`` the config rule says so in its plan, and a stack
  whose groups can not hold it under ``peak`` is refused before deploy.
* **The switch on the mirror.** KubeRay's NewCluster sequence played on the
  render's RayServices (twin/kuberay.py): the Services KubeRay updates are
  accepted by the API server, and the new cluster's pods get the load
  balancer's readiness gate when they are created.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from infra.render import Rendered
from twin import kuberay as mirror

PUBLIC_SERVICE_TYPE = "kubernetes:core/v1:Service"
RAY_SERVICE_TYPE = "kubernetes:ray.io/v1:RayService"
# What a new image digest changes in a RayService: every Ray container's image.
NEW_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-inference@sha256:" + "b" * 64


@dataclass(frozen=True)
class Change:
    """One field that differs between two renders of a resource, by URN."""

    urn: str
    path: str
    before: Any
    after: Any


def _walk(path: str, a: Any, b: Any) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b)):
            yield from _walk(f"{path}.{key}" if path else str(key), a.get(key), b.get(key))
    elif a != b:
        yield path, a, b


def render_diff(before: Rendered, after: Rendered) -> list[Change]:
    """Every input field that differs, resource by resource (a resource only in one render is a change of '')."""
    old = {r["urn"]: r for r in before.resources}
    new = {r["urn"]: r for r in after.resources}
    changes = []
    for urn in sorted(set(old) | set(new)):
        if urn not in old or urn not in new:
            changes.append(Change(urn, "", urn in old, urn in new))
            continue
        for path, a, b in _walk("", old[urn]["inputs"], new[urn]["inputs"]):
            changes.append(Change(urn, path, a, b))
    return changes


# Fields of a Service that the API server and the load balancer controller
# change in place: the NLB is updated, never replaced.
IN_PLACE_SERVICE_FIELDS = ("metadata.annotations.", "spec.loadBalancerSourceRanges")


def lb_change_problems(changes: list[Change]) -> list[str]:
    """Why a render diff is not "the load balancer's Service, in place, and nothing else" (empty when it is)."""
    problems = []
    if not changes:
        problems.append("the change reached no resource")
    for c in changes:
        if f"::{PUBLIC_SERVICE_TYPE}::" not in c.urn.replace("$", "::"):
            problems.append(f"{c.urn} {c.path or 'created or deleted'} changed too")
        elif not c.path.startswith(IN_PLACE_SERVICE_FIELDS):
            problems.append(f"{c.urn} {c.path} would not change in place")
    return problems


def with_image(ray_service: Mapping[str, Any], image: str = NEW_IMAGE) -> dict[str, Any]:
    """The RayService after a new image digest: every Ray container of every group (what `pulumi up` applies)."""
    rs = copy.deepcopy(dict(ray_service))
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *(cluster.get("workerGroupSpecs") or [])]:
        for container in group["template"]["spec"]["containers"]:
            container["image"] = image
    return rs


@dataclass(frozen=True)
class SwitchResult:
    """What KubeRay's NewCluster switch did to one RayService, on the mirror."""

    ray_service: str
    ok: bool
    detail: str


def play_switch(ray_service: Mapping[str, Any], load_balanced: list[Mapping[str, Any]]) -> SwitchResult:
    """The NewCluster sequence for a new image: the switch is accepted and the new pods are gated by the NLB.

    ``load_balanced``: the render's Services that an NLB with IP targets
    serves (their selectors decide the readiness gates).
    """
    name = ray_service["metadata"]["name"]
    active = mirror.RayClusterRef(mirror.ray_cluster_name(ray_service, "aaaaa"), ray_service)
    served = [*load_balanced]
    first = mirror.first_serve_service(active)
    if first["spec"].get("type") == "LoadBalancer":
        served.append(first)
    upgrade = mirror.NewClusterUpgrade(ray_service, with_image(ray_service), active, first)
    if not upgrade.needed:
        return SwitchResult(name, False, "an image change did not start a new cluster")
    pending = upgrade.start("bbbbb")
    pods = [p for p in mirror.build_cluster_pods(pending, {g: 1 for g in _groups(ray_service)}) if _serving(p)]
    ungated = [p["metadata"]["name"] for p in pods if not mirror.lbc_readiness_gates(p, served)]
    try:
        upgrade.switch({"app": "RUNNING"})
    except mirror.ApiError as err:
        return SwitchResult(name, False, f"the switch is refused, the upgrade never finishes: {err}")
    if ungated:
        return SwitchResult(name, False, f"new pods created without the load balancer's readiness gate: {ungated}")
    old, cleanup = upgrade.finish()
    detail = f"{old.name} -> {upgrade.active.name}; {len(pods)} new serving pods gated"
    if cleanup is not None:
        detail += f"; Redis cleanup pod {cleanup['metadata']['name']}"
    return SwitchResult(name, True, detail)


def _groups(ray_service: Mapping[str, Any]) -> list[str]:
    return [str(g["groupName"]) for g in ray_service["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []]


def _serving(pod: Mapping[str, Any]) -> bool:
    labels = pod["metadata"]["labels"]
    return bool(labels.get(mirror.NODE_TYPE_LABEL) == mirror.WORKER and labels.get(mirror.SERVE_LABEL) == "true")
