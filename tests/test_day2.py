"""Day 2 on the KubeRay mirror: upgrades that finish, settings that apply, cleanup that reaches Redis.

Each test plays what KubeRay v1.7.0 and the AWS load balancer controller
v3.5.0 would do with the render (twin/kuberay.py, twin/day2.py), and each
has a control showing the mirror catches the fault the old render had.
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

import pytest
import yaml

from infra.capacity.report import plan_stack
from infra.config import capacity_input, load_stack_file
from infra.render import stack_file
from infra.serving import kuberay
from infra.serving.endpoint import NLB_CLASS, public_service_name
from infra.serving.network import REDIS_PORT
from tests.harness import manifests_of, ray_cluster, ray_services, render_config, render_stack, stack_doc
from twin import day2
from twin import kuberay as mirror

STACKS = ["dev", "prod"]


def _public_services(stack: str) -> list[dict[str, Any]]:
    return [s for s in manifests_of(render_stack(stack), "Service") if s["spec"].get("type") == "LoadBalancer"]


# --- finding 2: a NewCluster upgrade finishes -------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_a_new_image_upgrade_switches_and_finishes_on_every_ray_service(stack: str) -> None:
    routers = day2.router_discovery(render_stack(stack).manifests)
    for rs in ray_services(stack):
        result = day2.play_switch(rs, _public_services(stack), routers.get(rs["metadata"]["name"]))
        assert result.ok, result.detail


def test_the_mirror_refuses_the_switch_the_old_render_made() -> None:
    """The serve Service as a LoadBalancer without a class (what every stack had): the API server refuses the switch."""
    rs = copy.deepcopy(ray_services("prod")[0])
    rs["spec"]["serveService"]["spec"]["type"] = "LoadBalancer"
    result = day2.play_switch(rs, [])
    assert not result.ok
    assert "spec.loadBalancerClass" in result.detail and "may not change once set" in result.detail


def test_the_webhook_sets_the_class_only_where_none_is_given() -> None:
    ours = {"spec": {"type": "LoadBalancer", "loadBalancerClass": NLB_CLASS}}
    assert mirror.lbc_mutate_service_create(ours) == ours
    bare = mirror.lbc_mutate_service_create({"spec": {"type": "LoadBalancer"}})
    assert bare["spec"]["loadBalancerClass"] == NLB_CLASS
    assert "loadBalancerClass" not in mirror.lbc_mutate_service_create({"spec": {"type": "ClusterIP"}})["spec"]


@pytest.mark.parametrize("stack", STACKS)
def test_our_load_balancer_service_names_its_class(stack: str) -> None:
    for svc in _public_services(stack):
        assert svc["spec"]["loadBalancerClass"] == NLB_CLASS
        # So the webhook leaves it alone, and no later update can differ from it.
        assert mirror.lbc_mutate_service_create(svc) == svc


# --- finding 3: load-balancer settings apply on the next `pulumi up` --------------------


def _changed_endpoint() -> dict[str, Any]:
    doc = copy.deepcopy(stack_doc("prod"))
    endpoint = doc["config"]["llm-platform:endpoint"]
    endpoint["allowed_cidrs"] = ["203.0.113.0/24"]
    endpoint["certificate_arn"] = endpoint["certificate_arn"].replace("3f1c2a8e", "0a0b0c0d")
    return doc


def test_a_source_range_and_certificate_change_updates_the_load_balancer_service_and_nothing_else() -> None:
    before, after = render_stack("prod"), render_config(_changed_endpoint(), "prod")
    changes = day2.render_diff(before, after)
    assert day2.lb_change_problems(changes) == []
    paths = {c.path for c in changes}
    assert "spec.loadBalancerSourceRanges" in paths
    assert "metadata.annotations.service.beta.kubernetes.io/aws-load-balancer-ssl-cert" in paths
    # One change per RayService's load balancer, and the RayServices themselves untouched.
    assert {c.urn.rsplit("::", 1)[1] for c in changes} == {
        f"serving-endpoint-{public_service_name(rs['metadata']['name'])}" for rs in ray_services("prod")
    }


def test_the_old_render_put_those_settings_where_kuberay_never_applies_them() -> None:
    """Control: a change that lands in the RayService's serveService is reported, not passed."""
    before = render_stack("prod")
    after = copy.deepcopy(before)
    rs = next(r for r in after.resources if r["type"] == day2.RAY_SERVICE_TYPE)
    rs["inputs"]["spec"]["serveService"]["metadata"]["annotations"] = {"changed": "yes"}
    problems = day2.lb_change_problems(day2.render_diff(before, after))
    assert problems and "RayService" in problems[0]


# --- finding 4: the Redis cleanup Job reaches Redis --------------------------------------


def _egress_allows(policies: list[dict[str, Any]], pod: dict[str, Any], address: str, port: int) -> bool:
    """NetworkPolicy semantics: a pod selected by any Egress policy may send where one of their rules allows."""
    labels = pod["metadata"]["labels"]
    selecting = [
        p for p in policies if "Egress" in p["spec"]["policyTypes"] and mirror.selects(p["spec"]["podSelector"], labels)
    ]
    assert selecting, "no egress policy selects the pod: the namespace's default-deny must"
    for policy in selecting:
        for rule in policy["spec"].get("egress") or []:
            ports = {p["port"] for p in rule.get("ports") or []}
            if ports and port not in ports:
                continue
            for peer in rule.get("to") or []:
                block = peer.get("ipBlock")
                if block and ipaddress.ip_address(address) in ipaddress.ip_network(block["cidr"]):
                    return True
    return False


def test_the_redis_cleanup_job_of_every_prod_cluster_may_reach_redis_and_nothing_else_new() -> None:
    render = render_stack("prod")
    policies = manifests_of(render, "NetworkPolicy")
    redis = "10.50.7.12"  # an ElastiCache address inside prod's VPC
    assert ipaddress.ip_address(redis) in ipaddress.ip_network(
        stack_doc("prod")["config"]["llm-platform:network"]["vpc_cidr"]
    )
    for rs in ray_services("prod"):
        cluster = ray_cluster(rs)
        cleanup = mirror.build_redis_cleanup_pod(cluster)
        assert cleanup["metadata"]["labels"][kuberay.NODE_TYPE] == kuberay.REDIS_CLEANUP
        assert _egress_allows(policies, cleanup, redis, REDIS_PORT)
        # A worker of the same RayService still may not.
        worker = next(
            p for p in mirror.build_cluster_pods(cluster) if p["metadata"]["labels"][kuberay.NODE_TYPE] == "worker"
        )
        assert not _egress_allows(policies, worker, redis, REDIS_PORT)


def test_without_the_cleanup_policy_the_job_could_not_reach_redis() -> None:
    """Control: the policies the render had before."""
    render = render_stack("prod")
    policies = [p for p in manifests_of(render, "NetworkPolicy") if not p["metadata"]["name"].endswith("redis-cleanup")]
    cleanup = mirror.build_redis_cleanup_pod(ray_cluster(ray_services("prod")[0]))
    assert not _egress_allows(policies, cleanup, "10.50.7.12", REDIS_PORT)


def test_the_cleanup_pod_is_the_head_pod_with_the_redis_address_and_password() -> None:
    rs = ray_services("prod")[0]
    pod = mirror.build_redis_cleanup_pod(ray_cluster(rs))
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert "RAY_REDIS_ADDRESS" in env and "valueFrom" in env["REDIS_PASSWORD"]
    assert "cleanup_redis_storage" in container["args"][0]
    assert "readinessProbe" not in container and pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"][kuberay.SERVICE_LABEL] == rs["metadata"]["name"]


# --- finding 6: the switch is a hand-over, not a flip ------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_every_pod_the_load_balancer_serves_gets_its_readiness_gate_in_either_cluster(stack: str) -> None:
    """Without a router the load balancer targets the serving workers, which get its gate in either cluster;
    behind a router it targets the router's pods, and the workers (found by the router's discovery) get none."""
    lbs = _public_services(stack)
    routers = day2.router_discovery(render_stack(stack).manifests)
    for rs in ray_services(stack):
        discovery = routers.get(rs["metadata"]["name"])
        groups = {str(g["groupName"]): 1 for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
        for suffix in ("aaaaa", "bbbbb"):
            pods = mirror.build_cluster_pods(ray_cluster(rs, suffix), groups)
            assert any(pod["metadata"]["labels"][kuberay.NODE_TYPE] == "worker" for pod in pods)
            for pod in pods:
                serving = pod["metadata"]["labels"][kuberay.NODE_TYPE] == "worker"
                gated = bool(mirror.lbc_readiness_gates(pod, lbs))
                if discovery is None:
                    assert gated == serving, pod["metadata"]["name"]
                else:
                    assert not gated and mirror.selects(discovery, pod["metadata"]["labels"]) == serving


@pytest.mark.parametrize("stack", STACKS)
def test_during_an_upgrade_the_load_balancer_keeps_the_old_pods_until_the_new_are_ready(stack: str) -> None:
    """Targets are the Ready pods of both clusters: at no step of the hand-over is the set empty.

    Behind a request router the load balancer targets the router's pods, and the router sends to the
    Ready pods its discovery selects: those are the targets that must never run out.
    """
    routers = day2.router_discovery(render_stack(stack).manifests)
    for rs in ray_services(stack):
        (lb,) = [
            s for s in _public_services(stack) if s["metadata"]["name"] == public_service_name(rs["metadata"]["name"])
        ]
        service = rs["metadata"]["name"]
        selector = routers[service] if service in routers else lb["spec"]["selector"]
        groups = {str(g["groupName"]): 1 for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
        old = mirror.build_cluster_pods(ray_cluster(rs, "aaaaa"), groups)
        new = mirror.build_cluster_pods(ray_cluster(rs, "bbbbb"), groups)
        names = lambda pods: {p["metadata"]["name"] for p in pods}  # noqa: E731
        steps = [
            (old + new, names(old)),  # new pods starting, not Ready
            (old + new, names(old) | names(new)),  # new pods Ready: both serve
            (old + new, names(new)),  # old pods draining: unready
            (new, names(new)),  # old cluster deleted
        ]
        for pods, ready in steps:
            targets = {
                p["metadata"]["name"]
                for p in pods
                if p["metadata"]["name"] in ready and mirror.selects(selector, p["metadata"]["labels"])
            }
            assert targets, f"{rs['metadata']['name']}: no target at some step"


def test_a_pod_created_while_kuberay_selects_the_old_cluster_gets_no_gate() -> None:
    """Control: the old design's load balancer was KubeRay's serve Service, selecting the active cluster only."""
    rs = ray_services("prod")[0]
    old_lb = mirror.lbc_mutate_service_create(
        {
            **mirror.build_serve_service(ray_cluster(rs, "aaaaa")),
            "spec": {**mirror.build_serve_service(ray_cluster(rs, "aaaaa"))["spec"], "type": "LoadBalancer"},
        }
    )
    pending = [
        p
        for p in mirror.build_cluster_pods(ray_cluster(rs, "bbbbb"))
        if p["metadata"]["labels"][kuberay.NODE_TYPE] == "worker"
    ]
    assert pending and not any(mirror.lbc_readiness_gates(p, [old_lb]) for p in pending)


# --- the mirror's Ready and upgrade sequence --------------------------------------------


def test_ready_needs_a_ready_endpoint_of_kuberays_serve_service() -> None:
    rs = ray_services("prod")[0]
    cluster = ray_cluster(rs)
    pods = mirror.build_cluster_pods(cluster)
    serve = mirror.first_serve_service(cluster)
    workers = {p["metadata"]["name"] for p in pods if p["metadata"]["labels"][kuberay.NODE_TYPE] == "worker"}
    head = {p["metadata"]["name"] for p in pods} - workers
    assert mirror.ray_service_ready(serve, pods, workers)
    # The head is excluded (`ray.io/serve: "false"`): a Ready head alone is not Ready.
    assert not mirror.ray_service_ready(serve, pods, head)


def test_apps_must_all_be_running_before_the_switch() -> None:
    rs = ray_services("prod")[0]
    upgrade = mirror.NewClusterUpgrade(
        rs, day2.with_image(rs), ray_cluster(rs, "aaaaa"), mirror.first_serve_service(ray_cluster(rs, "aaaaa"))
    )
    upgrade.start("bbbbb")
    assert not upgrade.switch({})
    assert not upgrade.switch({"a": "RUNNING", "b": "DEPLOYING"})
    assert upgrade.switch({"a": "RUNNING", "b": "RUNNING"})
    assert upgrade.serve_service["spec"]["selector"][kuberay.CLUSTER] == upgrade.pending.name  # type: ignore[union-attr]
    assert [e.phase for e in upgrade.events] == ["pending-cluster", "waiting-for-apps", "waiting-for-apps", "switched"]


def test_a_serve_config_change_alone_starts_no_new_cluster() -> None:
    rs = ray_services("prod")[0]
    changed = copy.deepcopy(rs)
    changed["spec"]["serveConfigV2"] += "\n# changed\n"
    upgrade = mirror.NewClusterUpgrade(rs, changed, ray_cluster(rs), mirror.first_serve_service(ray_cluster(rs)))
    assert not upgrade.needed
    assert mirror.NewClusterUpgrade(rs, day2.with_image(rs), ray_cluster(rs), {}).needed


def test_what_kuberays_spec_hash_leaves_out_starts_no_new_cluster() -> None:
    """Replica bounds and tolerations (util.go GenerateHashWithoutReplicasAndWorkersToDelete); a group appended
    at the end is added in place (rayservice_controller.go shouldPrepareNewCluster)."""
    rs = ray_services("prod")[0]
    active = ray_cluster(rs)

    def needed(change: Any) -> bool:
        new = copy.deepcopy(rs)
        change(new["spec"]["rayClusterConfig"])
        return mirror.NewClusterUpgrade(rs, new, active, {}).needed

    def bounds(c: dict[str, Any]) -> None:
        c["workerGroupSpecs"][0]["maxReplicas"] += 4
        c["workerGroupSpecs"][0]["minReplicas"] += 1

    def tolerations(c: dict[str, Any]) -> None:
        c["workerGroupSpecs"][0]["template"]["spec"]["tolerations"] = [{"key": "x", "operator": "Exists"}]

    def appended(c: dict[str, Any]) -> None:
        c["workerGroupSpecs"].append({**copy.deepcopy(c["workerGroupSpecs"][0]), "groupName": "extra"})

    def resources(c: dict[str, Any]) -> None:
        c["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "1Gi"

    assert not needed(bounds) and not needed(tolerations) and not needed(appended)
    assert needed(resources)


# --- render B's engine change stays within the capacity plan ---------------------------


def test_render_b_changes_max_num_seqs_to_a_value_the_capacity_rule_accepts() -> None:
    """The changed engine argument is the plan's recommendation: a value above the model's preemption-free
    load would be refused before render B exists. (prod: day 2 plays a vllm-server RayService, dev has none.)"""
    stack = "prod"
    inputs = day2.upgrade_inputs(stack, render_stack(stack))
    plans = {p.model.entry.model_id: p for p in plan_stack(capacity_input(load_stack_file(stack_file(stack))))}
    catalog = yaml.safe_load(inputs.before["spec"]["serveConfigV2"])["applications"][0]["args"]
    plan = plans[catalog["models"][0]["model_id"]]
    assert inputs.engine_key == "max_num_seqs"
    assert inputs.engine_value != plan.replica.engine.max_num_seqs
    assert 1 <= inputs.engine_value <= plan.concurrency.preemption_free
    assert inputs.engine_value == day2.engine_value(stack, plan.name)


def test_behind_a_router_the_switch_fails_when_its_discovery_misses_the_new_pods() -> None:
    """Control: a router whose selector names the old cluster alone would lose every replica at the switch."""
    (rs,) = ray_services("dev")
    discovery = day2.router_discovery(render_stack("dev").manifests)[rs["metadata"]["name"]]
    assert day2.play_switch(rs, _public_services("dev"), discovery).ok
    old_cluster = mirror.ray_cluster_name(rs, "aaaaa")
    narrowed = {**discovery, mirror.CLUSTER_LABEL: old_cluster}
    result = day2.play_switch(rs, _public_services("dev"), narrowed)
    assert not result.ok and "router's discovery does not find" in result.detail, result.detail
