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
  balancer's readiness gate when they are created; behind a request router
  (`serving.routing`), whose pods the load balancer targets instead, the
  router's discovery finds the new cluster's serving pods as it found the old.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infra.render import Rendered, render_document, stack_document
from twin import kuberay as mirror
from twin.report import Report

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


def router_discovery(manifests: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """Each routed RayService's router discovery selector, read from its rendered Deployment's `--selector` words."""
    from infra.serving.router import ROUTER_CONTAINER, ROUTER_OF

    out = {}
    for dep in manifests:
        service = dep["metadata"].get("labels", {}).get(ROUTER_OF) if dep.get("kind") == "Deployment" else None
        if service is None:
            continue
        (router,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == ROUTER_CONTAINER]
        args = list(router["command"])
        words = itertools.takewhile(lambda w: not w.startswith("--"), args[args.index("--selector") + 1 :])
        out[str(service)] = dict(w.split("=", 1) for w in words)
    return out


def play_switch(
    ray_service: Mapping[str, Any],
    load_balanced: list[Mapping[str, Any]],
    discovery: Mapping[str, str] | None = None,
) -> SwitchResult:
    """The NewCluster sequence for a new image: the switch is accepted and the new pods are served.

    ``load_balanced``: the render's Services that an NLB with IP targets
    serves (their selectors decide the readiness gates). ``discovery``: the
    selector of the request router in front of this RayService, if any
    (router_discovery): the NLB then targets the router's pods, and the new
    serving pods must be ones the router finds, as the old ones were.
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
    groups = {g: 1 for g in _groups(ray_service)}
    old_pods = [p for p in mirror.build_cluster_pods(active, groups) if _serving(p)]
    pending = upgrade.start("bbbbb")
    pods = [p for p in mirror.build_cluster_pods(pending, groups) if _serving(p)]
    if discovery is None:
        unserved = [p["metadata"]["name"] for p in pods if not mirror.lbc_readiness_gates(p, served)]
        problem = "new pods created without the load balancer's readiness gate"
    else:
        unserved = [p["metadata"]["name"] for p in pods if not mirror.selects(discovery, p["metadata"]["labels"])]
        problem = "new serving pods the router's discovery does not find"
        if not old_pods or any(not mirror.selects(discovery, p["metadata"]["labels"]) for p in old_pods):
            return SwitchResult(name, False, f"the router's discovery {dict(discovery)} misses the old serving pods")
    try:
        upgrade.switch({"app": "RUNNING"})
    except mirror.ApiError as err:
        return SwitchResult(name, False, f"the switch is refused, the upgrade never finishes: {err}")
    if unserved:
        return SwitchResult(name, False, f"{problem}: {unserved}")
    old, cleanup = upgrade.finish()
    served_by = "gated" if discovery is None else "found by the router's discovery, as the old were"
    detail = f"{old.name} -> {upgrade.active.name}; {len(pods)} new serving pods {served_by}"
    if cleanup is not None:
        detail += f"; Redis cleanup pod {cleanup['metadata']['name']}"
    return SwitchResult(name, True, detail)


def _groups(ray_service: Mapping[str, Any]) -> list[str]:
    return [str(g["groupName"]) for g in ray_service["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []]


def _serving(pod: Mapping[str, Any]) -> bool:
    labels = pod["metadata"]["labels"]
    return bool(labels.get(mirror.NODE_TYPE_LABEL) == mirror.WORKER and labels.get(mirror.SERVE_LABEL) == "true")


# --- the checks, as `python -m twin.day2 --stack NAME` runs them ------------------------

SERVICE = "day2"
# A certificate ARN's account and region are kept; its id changes.
NEW_CERTIFICATE_ID = "0a0b0c0d-1e2f-4a3b-8c4d-5e6f7a8b9c0d"
NEW_SOURCE_RANGE = "203.0.113.0/24"
# The engine argument render B changes (it runs on the CPU too); its value is `engine_value`'s.
ENGINE_KEY = "max_num_seqs"


def engine_value(stack: str, model: str) -> int:
    """A max_num_seqs for render B that the capacity rule accepts and the committed stack does not run with.

    The plan's recommendation for the model at its workload, else one less,
    else its preemption-free load: a value above that load would be refused
    before the render (infra/capacity/rules.py).
    """
    from infra.capacity.report import plan_stack
    from infra.config import capacity_input, load_stack_file
    from infra.render import stack_file

    plan = next(p for p in plan_stack(capacity_input(load_stack_file(stack_file(stack)))) if p.name == model)
    at = plan.concurrency
    choices = (at.recommended, at.recommended - 1, at.preemption_free)
    value = next((n for n in choices if n >= 1 and n != plan.replica.engine.max_num_seqs), None)
    if value is None:
        raise RuntimeError(f"{stack}: the plan leaves '{model}' no other max_num_seqs to change to")
    return value


def with_endpoint_change(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The stack file after a user changes the source ranges and the certificate."""
    out = copy.deepcopy(dict(doc))
    endpoint = out["config"].setdefault("llm-platform:endpoint", {})
    endpoint["allowed_cidrs"] = [NEW_SOURCE_RANGE]
    arn = endpoint.get("certificate_arn")
    if arn:
        endpoint["certificate_arn"] = arn.rsplit("/", 1)[0] + "/" + NEW_CERTIFICATE_ID
    return out


def check_load_balancer_change(stack: str, before: Rendered, report: Report) -> bool:
    """The change reaches the object the load balancer controller reads, in place, and nothing else."""
    after = render_document(stack, with_endpoint_change(stack_document(stack)))
    changes = render_diff(before, after)
    problems = lb_change_problems(changes)
    touched = sorted({c.urn.rsplit("::", 1)[1] for c in changes})
    return report.check(
        SERVICE,
        not problems,
        f"{stack}: source ranges and certificate changed: {len(changes)} fields of "
        f"{', '.join(touched) or 'nothing'}"
        + (f"; {'; '.join(problems)}" if problems else ", all in place on the load balancer's Service"),
    )


def _with_group_sizes(doc: Mapping[str, Any], size_of: Any, headroom: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    config = out["config"]
    config["llm-platform:ray"] = {**config.get("llm-platform:ray", {}), "upgrade_headroom": headroom}
    for group in config["llm-platform:node_groups"]["gpu"]:
        group["max_size"] = size_of(group)
    return out


def check_upgrade_at_peak(stack: str, report: Report) -> bool:
    """As committed, an upgrade at peak places its new fleet; sized for less, `peak` refuses before deploy
    and `min` accepts the trade-off (the new pods wait for the old cluster to scale down)."""
    from infra.capacity.report import upgrade_at_peak
    from infra.config import ConfigError, capacity_input, load_stack_file
    from infra.render import stack_file

    ok = True
    cfg = load_stack_file(stack_file(stack))
    at_peak = upgrade_at_peak(capacity_input(cfg))
    for result in at_peak:
        ok &= report.check(SERVICE, result.fits, f"{stack} as committed: {result.reason}")
    # Each group one node short of what peak needs: what the old 2 x min sizing gave prod.
    need = {r.group: r for r in at_peak}
    nodes = {g.name: g for g in cfg.node_groups.gpu}

    def short(group: Mapping[str, Any]) -> int:
        found = need.get(group["name"])
        if found is None:
            return int(group["max_size"])
        per_node = nodes[group["name"]].instance().gpus
        return max(1, found.gpus_needed // per_node - 1)

    doc = stack_document(stack)
    try:
        render_document(stack, _with_group_sizes(doc, short, "peak"))
        ok &= report.check(SERVICE, False, f"{stack} one node short under upgrade_headroom peak: accepted")
    except ConfigError as err:
        line = "; ".join(str(err).splitlines())
        ok &= report.check(SERVICE, "upgrade" in line, f"{stack} one node short, peak: refused before deploy: {line}")
    try:
        render_document(stack, _with_group_sizes(doc, short, "min"))
        ok &= report.check(
            SERVICE, True, f"{stack} one node short, min: accepted (an upgrade at peak waits for the old cluster)"
        )
    except ConfigError as err:
        ok &= report.check(SERVICE, False, f"{stack} one node short, min: refused: {err}")
    return ok


def check_switches(stack: str, before: Rendered, report: Report) -> bool:
    """KubeRay's NewCluster switch for a new image on every RayService, on the mirror."""
    from infra.render import Rendered as _Rendered

    assert isinstance(before, _Rendered)
    lbs: list[Mapping[str, Any]] = [
        m for m in before.manifests if m.get("kind") == "Service" and m["spec"].get("type") == "LoadBalancer"
    ]
    routers = router_discovery(before.manifests)
    ok = True
    for rs in (m for m in before.manifests if m.get("kind") == "RayService"):
        result = play_switch(rs, lbs, routers.get(rs["metadata"]["name"]))
        ok &= report.check(SERVICE, result.ok, f"{stack}/{result.ray_service}: NewCluster switch: {result.detail}")
    return ok


def _layout(ray_service: Mapping[str, Any]) -> str:
    import yaml

    args = yaml.safe_load(ray_service["spec"]["serveConfigV2"])["applications"][0]["args"]
    return str(args.get("layout", "serve-ingress"))


def _stays_up(ray_service: Mapping[str, Any]) -> bool:
    """Whether every model of the RayService keeps a replica (min_replicas >= 1): a woken model at zero has no
    serving pod for the load balancer to send the upgrade's traffic to."""
    import yaml

    from workloads.inference_server.catalog import Catalog

    args = yaml.safe_load(ray_service["spec"]["serveConfigV2"])["applications"][0]["args"]
    return all(m.autoscaling.min_replicas >= 1 for m in Catalog.model_validate(args).models)


def upgradeable(before: Rendered) -> list[dict[str, Any]]:
    """The RayServices the upgrade under load can run on: vllm-server ones whose models keep a replica."""
    services = [m for m in before.manifests if m.get("kind") == "RayService"]
    return [m for m in services if _layout(m) == "vllm-server" and _stays_up(m)]


def upgrade_inputs(stack: str, before: Rendered) -> Any:
    """Render A's RayService with GCS fault tolerance (else the first), and render B's.

    Render B: a new image and a changed engine argument.
    """
    from twin.upgrade import UpgradeInputs, changed_engine

    services = upgradeable(before)
    rs = next((s for s in services if s["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions")), services[0])
    name = rs["metadata"]["name"]
    import yaml

    catalog = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    model = next(
        m
        for m in stack_document(stack)["config"]["llm-platform:models"]
        if m.get("model_id") == catalog["models"][0]["model_id"]
    )
    value = engine_value(stack, model["name"])
    after_render = render_document(stack, changed_engine(stack_document(stack), model["name"], ENGINE_KEY, value))
    after = next(m for m in after_render.manifests if m.get("kind") == "RayService" and m["metadata"]["name"] == name)
    lb = next(
        m
        for m in before.manifests
        if m.get("kind") == "Service" and m["spec"]["selector"].get("llm-platform/ray-service") == name
    )
    return UpgradeInputs(rs, with_image(after), lb, ENGINE_KEY, value)


def main(argv: list[str] | None = None) -> int:
    """``python -m twin.day2 --stack NAME [--static-only]``: the day-2 checks; exit 0 when all pass, 1 otherwise."""
    import argparse
    import shutil
    import tempfile
    from pathlib import Path

    from infra.render import known_stacks, render
    from twin.report import Report

    parser = argparse.ArgumentParser(prog="python -m twin.day2", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stack", required=True, choices=known_stacks())
    parser.add_argument("--static-only", action="store_true", help="only the checks that start nothing")
    args = parser.parse_args(argv)
    report = Report()
    before = render(args.stack)
    check_load_balancer_change(args.stack, before, report)
    check_upgrade_at_peak(args.stack, report)
    check_switches(args.stack, before, report)
    live = upgradeable(before)
    if not args.static_only and not live:
        # Its load balancer targets are the replicas' own servers, which must be up when its traffic starts; a
        # serve-ingress model or one at zero (dev's) waits for a wake anyway, and its switch is checked on the
        # mirror above.
        report.note(
            SERVICE,
            f"{args.stack}: upgrade under load runs on a vllm-server RayService whose models keep a replica "
            "(min_replicas >= 1), which none is",
        )
    elif not args.static_only:
        from localserve.affinity_hang import AffinityHangBreaker
        from localserve.redis_tls import start_tls_redis
        from twin.model import tiny_model_dir
        from twin.upgrade import run_upgrade_under_load

        inputs = upgrade_inputs(args.stack, before)
        model_dir = tiny_model_dir()
        work = Path(tempfile.mkdtemp(prefix="day2-", dir="/tmp"))
        redis = start_tls_redis(work / "redis")
        try:
            with AffinityHangBreaker(
                lambda killed: report.note(SERVICE, killed.line()),
                on_stuck=lambda stuck: report.note(SERVICE, stuck.line()),
            ):
                run_upgrade_under_load(inputs, redis, model_dir, work, report)
        finally:
            redis.stop()
        if report.ok_overall:
            shutil.rmtree(work, ignore_errors=True)
        else:
            report.note(SERVICE, f"logs kept in {work}")
    verdict = "PASS" if report.ok_overall else "FAIL"
    report.note("", f"{verdict} day 2 of {args.stack}: {report.passed} checks passed, {len(report.failed)} failed")
    return 0 if report.ok_overall else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
