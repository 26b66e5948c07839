"""Upgrade safety at deploy: one line per RayService saying which phase it is in and the likely cause.

Every status here is built the way KubeRay v1.7.0's calculateStatus and
calculateConditions fill it (rayservice_controller.go 643-818), checked
against the RayService CRD's `status` schema with unknown fields refused,
on the prod render's RayServices and the pods the KubeRay mirror builds for
them. The rules the diagnosis relies on cite KubeRay's lines; a test checks
each still says what is quoted.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from infra import upgrade_status as cli
from infra.citations import misquoted
from infra.render import ROOT
from infra.serving import kuberay
from infra.serving.drain import drain
from infra.serving.endpoint import load_balancer_service, serve_service_spec
from infra.serving.ray_service import ON_TIMEOUT_ANNOTATION
from infra.serving.upgrade_status import (
    PHASES,
    Diagnosis,
    citations,
    diagnose,
    diagnose_list,
    exit_code,
)
from tests.harness import (
    ray_cluster,
    ray_service_pods,
    ray_services,
    reference_dir,
    stack_config,
)
from twin import kuberay as mirror

NAMESPACE = "llm"
SMALL = "llama-31-8b"  # prod: one L40S per replica
BIG = "llama-33-70b"  # prod: four L40S per replica
OLD, NEW = "ol5dx", "nw7kq"  # the five characters KubeRay appends to each cluster's name
GENERATION = 7
# Times, in the order an upgrade goes: the status KubeRay last wrote, then events after it.
STARTED = "2026-08-20T10:00:00Z"
STATUS_WRITTEN = "2026-08-20T10:05:00Z"
LATER = "2026-08-20T10:06:30.123456Z"
EARLIER = "2026-08-20T09:00:00Z"


# --- KubeRay's status, as calculateStatus writes it -----------------------------------


def _condition(kind: str, status: str, reason: str, message: str, at: str = STARTED) -> dict[str, Any]:
    """setCondition (rayservice_controller.go 820-829): the condition carries the observed generation."""
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": GENERATION,
        "lastTransitionTime": at,
    }


def app(status: str, message: str = "", **deployments: tuple[str, str]) -> dict[str, Any]:
    """One AppStatus as getAndCheckServeStatus copies it from Serve (rayservice_controller.go 1866-1885)."""
    found: dict[str, Any] = {"status": status}
    if message:
        found["message"] = message
    if deployments:
        found["serveDeploymentStatuses"] = {
            name: {"status": s, **({"message": m} if m else {})} for name, (s, m) in deployments.items()
        }
    return found


def cluster(name: str, apps: dict[str, Any] | None = None, ready: int = 0, desired: int = 0) -> dict[str, Any]:
    """A RayServiceStatus: the cluster's name, its apps, and the RayCluster's own status (line 663-668)."""
    found: dict[str, Any] = {"rayClusterName": name}
    if apps:
        found["applicationStatuses"] = apps
    if desired:
        found["rayClusterStatus"] = {"readyWorkerReplicas": ready, "desiredWorkerReplicas": desired}
    return found


def kuberay_status(
    active: dict[str, Any] | None = None,
    pending: dict[str, Any] | None = None,
    endpoints: int = 0,
    was_ready: bool = True,
    observed: int = GENERATION,
) -> dict[str, Any]:
    """The status after a reconcile: calculateStatus (653-781) with calculateConditions (785-818)."""
    status: dict[str, Any] = {"observedGeneration": observed, "lastUpdateTime": STATUS_WRITTEN}
    if active:
        status["activeServiceStatus"] = active
    if pending:
        status["pendingServiceStatus"] = pending
    if endpoints:  # `numServeEndpoints,omitempty`
        status["numServeEndpoints"] = endpoints
    if endpoints > 0:
        ready = _condition("Ready", "True", "NonZeroServeEndpoints", "Number of serve endpoints is greater than 0")
    elif was_ready:
        ready = _condition("Ready", "False", "ZeroServeEndpoints", "Number of serve endpoints dropped to 0")
    else:
        ready = _condition("Ready", "False", "Initializing", "RayService is initializing")
    if active and pending:
        upgrade = _condition(
            "UpgradeInProgress", "True", "BothActivePendingClustersExist", "Both active and pending Ray clusters exist"
        )
    elif active:
        upgrade = _condition(
            "UpgradeInProgress", "False", "NoPendingCluster", "Active Ray cluster exists and no pending Ray cluster"
        )
    else:
        upgrade = _condition("UpgradeInProgress", "False", "Initializing", "RayService is initializing")
    status["conditions"] = [ready, upgrade]
    if endpoints > 0:
        status["serviceStatus"] = "Running"
    return status


def ray_service(name: str, status: dict[str, Any]) -> dict[str, Any]:
    """Prod's rendered RayService as the API server holds it: a generation, and KubeRay's status."""
    rs = copy.deepcopy(next(r for r in ray_services("prod") if r["metadata"]["name"] == name))
    rs["metadata"]["generation"] = GENERATION
    rs["status"] = status
    return rs


def cluster_name(name: str, suffix: str) -> str:
    return f"{name}-{suffix}"


# --- pods, as KubeRay builds them (the mirror), with a kubelet's status -----------------


def pods(rs: dict[str, Any], suffix: str, state: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> list[Any]:
    """The head and one pod per worker group of one cluster, each given a status (Running and Ready by default)."""
    built = ray_service_pods(rs, suffix)
    for pod in built:
        pod["status"] = (state or running)(pod)
    return built


def running(pod: dict[str, Any], ready: bool = True) -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }


def gpu_unschedulable(pod: dict[str, Any]) -> dict[str, Any]:
    """GPU workers Pending (the scheduler's message), every other pod Running."""
    if pod["metadata"]["labels"][kuberay.GROUP].startswith("gpu-"):
        message = (
            "0/9 nodes are available: 3 node(s) didn't match Pod's node affinity/selector, "
            "6 Insufficient nvidia.com/gpu. preemption: 0/9 nodes are available: 9 No preemption victims found."
        )
        return {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        }
    return running(pod)


def image_pull_failing(pod: dict[str, Any]) -> dict[str, Any]:
    waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "example.com/llm-serving@sha256:1"'}
    return {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
        "containerStatuses": [{"name": "ray", "ready": False, "restartCount": 0, "state": {"waiting": waiting}}],
    }


def crash_looping(pod: dict[str, Any]) -> dict[str, Any]:
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container=ray"}
    last = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    status = running(pod, ready=False)
    status["containerStatuses"] = [
        {"name": "ray", "ready": False, "restartCount": 6, "state": {"waiting": waiting}, "lastState": last}
    ]
    return status


def terminating(built: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for pod in built:
        pod["metadata"]["deletionTimestamp"] = LATER
    return built


# --- events, as `kubectl get events -o json` shows what KubeRay's recorder wrote ------


def event(regarding: dict[str, Any], reason: str, message: str, at: str = LATER, component: str = "") -> dict:
    """A core/v1 Event; KubeRay records through events.k8s.io (eventTime, reportingComponent)."""
    meta = regarding["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{reason.lower()}", "namespace": meta.get("namespace", NAMESPACE)},
        "involvedObject": {"kind": regarding["kind"], "name": meta["name"], "namespace": NAMESPACE},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "eventTime": at,
        "reportingComponent": component or "kuberay-operator",
    }


def refused_switch_message(rs: dict[str, Any]) -> str:
    """What KubeRay records when the API server refuses its serve Service update (line 1964), via the mirror.

    The serve Service a previous release left as a LoadBalancer (its class set
    by the load balancer controller's webhook) gets KubeRay's new spec, as a
    LoadBalancer without the class: refused.
    """
    old_rs = copy.deepcopy(rs)
    lb = load_balancer_service(SMALL, NAMESPACE, stack_config("prod").endpoint, "vllm-server")
    old_rs["spec"]["serveService"] = {
        "metadata": serve_service_spec(SMALL, NAMESPACE, "vllm-server")["metadata"],
        "spec": {k: v for k, v in lb["spec"].items() if k != "loadBalancerClass"},
    }
    live = mirror.lbc_mutate_service_create(mirror.first_serve_service(ray_cluster(old_rs, OLD)))
    desired = mirror.build_serve_service(ray_cluster(old_rs, NEW))
    update = mirror.kuberay_update_service(live, desired)
    assert update is not None
    with pytest.raises(mirror.ApiError) as refused:
        mirror.api_update_service(live, update)
    return f"Failed to update the service {NAMESPACE}/{kuberay.serve_service_name(SMALL)}, {refused.value}"


# --- the CRD's status schema ------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server prunes them (a field it drops is not KubeRay's)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def status_schema() -> dict[str, Any]:
    crd = yaml.safe_load((reference_dir() / "kuberay" / "crd-rayservices.yaml").read_text())
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(v1["schema"]["openAPIV3Schema"]["properties"]["status"])  # type: ignore[no-any-return]


def check(status_schema: dict[str, Any], rs: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(rs["status"], status_schema)
    return rs


def line_of(rs: dict[str, Any], built: list[dict[str, Any]] | None = None, events: list[Any] | None = None) -> str:
    found = diagnose(rs, built, events or [])
    text = found.line()
    assert "\n" not in text
    assert text.startswith(f"{NAMESPACE}/{rs['metadata']['name']}: {found.phase}: ")
    return text


# --- the phases ---------------------------------------------------------------------------


def test_a_steady_rayservice_names_its_cluster_and_exits_0(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(cluster_name(SMALL, NEW), {SMALL: app("RUNNING")}), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    found = diagnose(rs, pods(rs, NEW), [])
    assert found.phase == "steady"
    assert found.line() == f"llm/{SMALL}: steady: cluster {SMALL}-{NEW}, 2 serve endpoints, {SMALL} RUNNING"
    assert exit_code([found]) == 0


def test_a_generation_kuberay_has_not_seen_counts_as_stuck(status_schema: dict[str, Any]) -> None:
    """calculateStatus stamps the generation; a spec the operator never reconciled keeps the older one."""
    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}", {SMALL: app("RUNNING")}), endpoints=2, observed=6)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, OLD))
    assert ": not-observed: " in text
    assert "generation 7 (last observed 6)" in text and "operator" in text
    assert exit_code([diagnose(rs)]) == 1


def test_a_spec_kuberay_refused_quotes_its_validation_event(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}", {SMALL: app("RUNNING")}), endpoints=2, observed=6)
    rs = check(status_schema, ray_service(SMALL, status))
    why = f"{NAMESPACE}/{SMALL}: The RayService spec is invalid: spec.rayClusterConfig.headGroupSpec is required"
    text = line_of(rs, [], [event(rs, "InvalidRayServiceSpec", why)])
    assert ": not-observed: KubeRay refused generation 7: " in text and "headGroupSpec is required" in text


def test_no_gpu_capacity_for_the_new_cluster_says_so_and_points_at_the_headroom(status_schema: dict[str, Any]) -> None:
    """The new cluster's head is up and its app DEPLOYING, but its GPU workers can not be placed: capacity, not apps."""
    old, new = f"{BIG}-{OLD}", f"{BIG}-{NEW}"
    status = kuberay_status(
        active=cluster(old),
        pending=cluster(new, {BIG: app("DEPLOYING", **{"LLMServer:llama-33-70b": ("UPDATING", "")})}, 0, 2),
        endpoints=2,
    )
    rs = check(status_schema, ray_service(BIG, status))
    new_pods = pods(rs, NEW, gpu_unschedulable)
    gpu_pod = next(p for p in new_pods if p["metadata"]["labels"][kuberay.GROUP].startswith("gpu-"))
    scale = event(gpu_pod, "NotTriggerScaleUp", "pod didn't trigger scale-up: 1 max node group size reached")
    scale["reportingComponent"], scale["source"] = "", {"component": "cluster-autoscaler"}
    text = line_of(rs, pods(rs, OLD) + new_pods, [scale])
    assert f"llm/{BIG}: pending-cluster-starting: no GPU capacity: " in text
    assert "1 of the new cluster's 2 pods is Pending (Insufficient nvidia.com/gpu" in text
    assert "cluster-autoscaler: pod didn't trigger scale-up: 1 max node group size reached" in text
    assert "see ray.upgrade_headroom" in text
    assert "DEPLOYING" not in text


def test_a_new_cluster_that_can_not_pull_its_image(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}"), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW, image_pull_failing))
    assert ": pending-cluster-starting: the new cluster's pod " in text
    assert "ray ImagePullBackOff: Back-off pulling image" in text


def test_a_new_cluster_still_loading_is_starting_not_broken(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}"), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW, lambda p: running(p, ready=False)))
    assert ": pending-cluster-starting: 2 of the new cluster's 2 pods are not Ready yet" in text


def test_without_pods_the_pending_clusters_own_status_explains(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}", None, 0, 1))
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs)
    assert f": pending-cluster-starting: the new cluster {SMALL}-{NEW} has no Serve applications yet" in text
    assert "0/1 workers ready" in text


def test_apps_that_failed_on_the_new_cluster_are_listed_with_serves_message(status_schema: dict[str, Any]) -> None:
    failed = "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor"
    deployments = {"LLMServer:llama-3.1-8b-instruct": ("UNHEALTHY", "Replica failed the health check")}
    status = kuberay_status(
        active=cluster(f"{SMALL}-{OLD}"),
        pending=cluster(f"{SMALL}-{NEW}", {SMALL: app("DEPLOY_FAILED", failed, **deployments)}),
        endpoints=2,
    )
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW))
    assert f": pending-apps-not-running: the new cluster {SMALL}-{NEW}: {SMALL} DEPLOY_FAILED: {failed}" in text


def test_a_deployment_message_stands_in_for_an_empty_app_message(status_schema: dict[str, Any]) -> None:
    deployments = {"LLMServer:llama-3.1-8b-instruct": ("UNHEALTHY", "Replica failed the health check")}
    status = kuberay_status(
        active=cluster(f"{SMALL}-{OLD}"),
        pending=cluster(f"{SMALL}-{NEW}", {SMALL: app("UNHEALTHY", **deployments)}),
        endpoints=2,
    )
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs)
    assert "UNHEALTHY: LLMServer:llama-3.1-8b-instruct UNHEALTHY: Replica failed the health check" in text


def test_running_apps_without_a_switch_read_as_a_refused_switch_not_as_apps(status_schema: dict[str, Any]) -> None:
    """KubeRay switches and promotes in the reconcile that sees every app RUNNING (lines 289-298, 636): a
    written status with a RUNNING pending cluster means the switch failed, never that apps are not running."""
    status = kuberay_status(
        active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=2
    )
    rs = check(status_schema, ray_service(SMALL, status))
    found = diagnose(rs, pods(rs, OLD) + pods(rs, NEW), [])
    assert found.phase == "switch-refused"
    assert "applications are all RUNNING but KubeRay has not moved its Services" in found.cause
    assert "not RUNNING" not in found.line() and "apps-not-running" not in found.line()


def test_a_refused_switch_quotes_kuberays_event_over_the_stale_app_status(status_schema: dict[str, Any]) -> None:
    """A failed Service update returns before calculateStatus: the status still shows the apps as they were
    (DEPLOYING) and only the FailedToUpdateService event, newer than the status, tells what happened."""
    status = kuberay_status(
        active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}", {SMALL: app("DEPLOYING")}), endpoints=2
    )
    rs = check(status_schema, ray_service(SMALL, status))
    message = refused_switch_message(rs)
    assert "spec.loadBalancerClass" in message and "may not change once set" in message
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW), [event(rs, "FailedToUpdateService", message)])
    assert f"llm/{SMALL}: switch-refused: KubeRay could not point its Services at the new cluster {SMALL}-{NEW}" in text
    assert f"FailedToUpdateService: {message}" in text


def test_an_event_older_than_the_status_is_a_past_failure(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(
        active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}", {SMALL: app("DEPLOYING")}), endpoints=2
    )
    rs = check(status_schema, ray_service(SMALL, status))
    old_event = event(rs, "FailedToUpdateService", refused_switch_message(rs), at=EARLIER)
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW), [old_event])
    assert f": pending-apps-not-running: the new cluster {SMALL}-{NEW}: {SMALL} DEPLOYING" in text


def test_the_switch_is_done_while_the_old_cluster_waits_out_its_deletion_delay(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, OLD) + pods(rs, NEW))
    delay = drain(stack_config("prod")).cluster_deletion_delay_seconds
    assert f": old-cluster-draining: KubeRay switched to {SMALL}-{NEW}; old cluster {SMALL}-{OLD} (2 pods): " in text
    assert f"kept for rayClusterDeletionDelaySeconds ({delay} s) after the switch" in text
    assert exit_code([diagnose(rs, pods(rs, OLD))]) == 1


def test_old_pods_draining_then_the_redis_cleanup_job(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    workers = [p for p in terminating(pods(rs, OLD)) if p["metadata"]["labels"][kuberay.NODE_TYPE] == "worker"]
    assert "1 of its pods are draining (preStop" in line_of(rs, workers + pods(rs, NEW))
    cleanup = mirror.build_redis_cleanup_pod(ray_cluster(rs, OLD))
    cleanup["status"] = crash_looping(cleanup)
    text = line_of(rs, [cleanup, *pods(rs, NEW)])
    assert "the Redis cleanup Job is failing (ray CrashLoopBackOff (last exit OOMKilled, code 137)" in text


def test_an_in_place_serve_update_that_fails_is_not_steady_although_ready(status_schema: dict[str, Any]) -> None:
    """Ready counts serve endpoints only (line 795): a failed serveConfigV2 update leaves it True."""
    failed = "ValueError: max_num_seqs must be positive"
    status = kuberay_status(active=cluster(f"{BIG}-{NEW}", {BIG: app("DEPLOY_FAILED", failed)}), endpoints=2)
    rs = check(status_schema, ray_service(BIG, status))
    text = line_of(rs, pods(rs, NEW))
    assert f": apps-not-running: 2 serve endpoints on cluster {BIG}-{NEW}, but {BIG} DEPLOY_FAILED: {failed}" in text


def test_no_endpoints_with_crash_looping_workers(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(active=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=0)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, NEW, crash_looping))
    assert f": not-ready: 0 serve endpoints on cluster {SMALL}-{NEW}; the cluster's pod " in text
    assert "CrashLoopBackOff (last exit OOMKilled, code 137)" in text


def test_a_first_deploy_says_so(status_schema: dict[str, Any]) -> None:
    status = kuberay_status(pending=cluster(f"{SMALL}-{NEW}"), was_ready=False)
    rs = check(status_schema, ray_service(SMALL, status))
    text = line_of(rs, pods(rs, NEW, gpu_unschedulable))
    assert ": pending-cluster-starting: first deploy: no GPU capacity: " in text


def test_the_upgrades_age_is_shown_when_the_time_is_known(status_schema: dict[str, Any]) -> None:
    from datetime import UTC, datetime

    status = kuberay_status(active=cluster(f"{SMALL}-{OLD}"), pending=cluster(f"{SMALL}-{NEW}"), endpoints=2)
    rs = check(status_schema, ray_service(SMALL, status))
    found = diagnose(rs, None, [], now=datetime(2026, 8, 20, 10, 42, tzinfo=UTC))
    assert found.cause.endswith("(for 42 min)")


def test_the_status_builders_are_checked_strictly(status_schema: dict[str, Any]) -> None:
    """The schema check can fail: a field the CRD does not have (the apps under `applications`) is refused."""
    status = kuberay_status(active=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=2)
    status["activeServiceStatus"]["applications"] = status["activeServiceStatus"].pop("applicationStatuses")
    with pytest.raises(jsonschema.ValidationError, match="applications"):
        jsonschema.validate(status, status_schema)


def test_every_phase_is_documented() -> None:
    doc = (ROOT / "docs" / "changing-a-running-stack.md").read_text()
    assert [p for p in PHASES if f"`{p}`" not in doc] == []


def test_every_cited_kuberay_line_says_what_is_quoted() -> None:
    wrong = misquoted(citations(), reference_dir())
    assert len(citations()) >= 20
    assert not wrong, "\n".join(wrong)


# --- the command ------------------------------------------------------------------------


def listing(*objects: dict[str, Any]) -> dict[str, Any]:
    """What `kubectl get rayservices,pods,events -o json` prints: one List of every kind."""
    return {"apiVersion": "v1", "kind": "List", "items": list(objects), "metadata": {"resourceVersion": ""}}


def steady_and_stuck() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    small = ray_service(SMALL, kuberay_status(active=cluster(f"{SMALL}-{NEW}", {SMALL: app("RUNNING")}), endpoints=2))
    big = ray_service(
        BIG,
        kuberay_status(active=cluster(f"{BIG}-{OLD}"), pending=cluster(f"{BIG}-{NEW}"), endpoints=2),
    )
    return small, [small, *pods(small, NEW), big, *pods(big, OLD), *pods(big, NEW, gpu_unschedulable)]


def test_the_list_is_split_by_kind_and_sorted_by_name() -> None:
    _, objects = steady_and_stuck()
    found = diagnose_list(listing(*reversed(objects)))
    assert [(d.name, d.phase) for d in found] == [(SMALL, "steady"), (BIG, "pending-cluster-starting")]


def fake_kubectl(tmp_path: Path, printed: dict[str, Any] | None, fail: str | None = None) -> dict[str, str]:
    """A `kubectl` on PATH that records its arguments and prints `printed` (or fails saying `fail`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "out.json").write_text(json.dumps(printed))
    script = bin_dir / "kubectl"
    body = f'echo "$@" > {tmp_path / "args"}\n'
    if fail:
        body += f"echo 'E1203 01:46:01.091247 22130 memcache.go:265] noise' >&2\necho '{fail}' >&2\nexit 1\n"
    else:
        body += f"cat {tmp_path / 'out.json'}\n"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infra.upgrade_status", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_steady_exits_0_and_a_stuck_rayservice_exits_1(tmp_path: Path) -> None:
    small, objects = steady_and_stuck()
    steady = run_cli(fake_kubectl(tmp_path / "steady", listing(*objects[:3])), "--namespace", NAMESPACE)
    assert steady.returncode == 0, steady.stderr
    assert steady.stdout.splitlines() == [diagnose(small, objects[1:3]).line()]
    stuck = run_cli(fake_kubectl(tmp_path / "stuck", listing(*objects)), "--namespace", NAMESPACE, "--context", "prod")
    assert stuck.returncode == 1, stuck.stderr
    lines = stuck.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"llm/{SMALL}: steady: ")
    assert lines[1].startswith(f"llm/{BIG}: pending-cluster-starting: no GPU capacity: ")
    args = (tmp_path / "stuck" / "args").read_text().split()
    assert args == ["--context", "prod", "get", "rayservices,pods,events", "-n", NAMESPACE, "-o", "json"]


def test_the_stack_names_the_namespace(tmp_path: Path) -> None:
    _, objects = steady_and_stuck()
    done = run_cli(fake_kubectl(tmp_path, listing(*objects)), "--stack", "prod")
    assert done.returncode == 1, done.stderr
    assert (tmp_path / "args").read_text().split()[-4:] == ["-n", stack_config("prod").serving.namespace, "-o", "json"]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    no_kubectl = {**os.environ, "PATH": str(tmp_path / "empty")}
    cases = {
        "missing": run_cli(no_kubectl, "--namespace", NAMESPACE),
        "refused": run_cli(
            fake_kubectl(tmp_path / "a", None, fail='error: context "nope" does not exist'), "-n", NAMESPACE
        ),
        "empty": run_cli(fake_kubectl(tmp_path / "b", listing()), "-n", NAMESPACE),
        "stack": run_cli(no_kubectl, "--stack", "no-such-stack"),
    }
    said = {name: done.stderr.strip() for name, done in cases.items()}
    assert all(done.returncode == 2 and done.stdout == "" for done in cases.values()), said
    assert all(len(text.splitlines()) == 1 and text.startswith("upgrade-status: ") for text in said.values()), said
    assert "kubectl is not installed or not on PATH" in said["missing"]
    assert said["refused"].endswith('failed: error: context "nope" does not exist')
    assert "no RayService in namespace llm" in said["empty"]
    assert "Pulumi.no-such-stack.yaml: no such stack config file" in said["stack"]


def test_make_upgrade_status_runs_the_command_for_the_stack() -> None:
    # Run as a user runs it, not as a sub-make of `make test` (which prints its directory changes).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(
        ["make", "-n", "upgrade-status", "STACK=prod", "CONTEXT=ctx"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if "infra.upgrade_status" in line]
    assert commands and commands[-1].endswith("/python -m infra.upgrade_status --stack prod --context ctx"), done.stdout


# --- the hint on the RayService -----------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_rayservice_says_what_to_run_when_its_wait_times_out(stack: str) -> None:
    namespace = stack_config(stack).serving.namespace
    for rs in ray_services(stack):
        hint = rs["metadata"]["annotations"][ON_TIMEOUT_ANNOTATION]
        assert "make upgrade-status STACK=" in hint
        assert f"python -m infra.upgrade_status --namespace {namespace}" in hint
        # Metadata only: KubeRay hashes rayClusterConfig, which carries no such text.
        assert ON_TIMEOUT_ANNOTATION not in json.dumps(rs["spec"])
    makefile = (ROOT / "Makefile").read_text()
    assert "\nupgrade-status:" in makefile and "-m infra.upgrade_status --stack $(STACK)" in makefile


def test_the_cli_module_is_the_one_the_hint_names() -> None:
    assert cli.PROG == "python -m infra.upgrade_status"
    assert isinstance(diagnose({"metadata": {"name": "x"}, "status": {}}), Diagnosis)
