"""Where a RayService's upgrade stands, read from what KubeRay v1.7.0 writes: one line per RayService.

`pulumi up` waits for each RayService's `Ready` and `UpgradeInProgress=False`
(ray_service.WAIT_FOR_CONDITIONS) up to `pulumi.com/timeoutSeconds`; when it
times out, Pulumi's message names the resource and nothing else. These pure
functions take the RayService as KubeRay wrote it (and, optionally, the
namespace's pods and events, as `kubectl get -o json` gives them) and say
which phase it is in and the likely cause:

    llm/llama-33-70b: pending-cluster-starting: no GPU capacity: ...

`python -m infra.upgrade_status` (and `make upgrade-status STACK=...`) runs
`kubectl` and prints these lines; the phases and causes are documented in
docs/changing-a-running-stack.md.

Every rule is KubeRay's, read in `reference/kuberay/src-v1.7.0/`: each
``_k(file, line, quote)`` mark names the line it relies on, and
tests/test_upgrade_status.py checks that the line still says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from infra.citations import Cite, marks
from infra.serving import kuberay

Phase = Literal[
    "steady",
    "not-observed",
    "pending-cluster-starting",
    "pending-apps-not-running",
    "switch-refused",
    "old-cluster-draining",
    "apps-not-running",
    "not-ready",
]
# What each phase means, in the order a NewCluster upgrade goes through them.
PHASES: dict[Phase, str] = {
    "not-observed": "KubeRay has not reconciled the applied spec (operator down, or the spec refused)",
    "pending-cluster-starting": "the new cluster's pods are not up, or its head has no Serve applications yet",
    "pending-apps-not-running": "the new cluster's Serve applications are deployed but not all RUNNING",
    "switch-refused": "the new cluster is ready but KubeRay could not move its Services to it",
    "old-cluster-draining": "KubeRay switched; the old cluster waits out its deletion delay, then drains",
    "apps-not-running": "one cluster serves, but a Serve application is not RUNNING (an in-place update)",
    "not-ready": "no serve endpoint is Ready",
    "steady": "one cluster, every application RUNNING, nothing in progress",
}

KUBERAY_REFERENCE = "kuberay/src-v1.7.0/ray-operator/controllers/ray/"
# A message quoted into a line is cut here: a Serve traceback is pages long.
MAX_MESSAGE = 240
GPU_RESOURCE = "nvidia.com/gpu"
RUNNING = "RUNNING"


def _k(path: str, line: int, quote: str) -> None:
    """Marks the KubeRay line (under KUBERAY_REFERENCE) the code beside it relies on; see citations()."""


# --- the rules, as KubeRay's code states them -------------------------------------

# calculateStatus stamps the generation it worked from; a spec KubeRay has not
# reconciled (operator down) or refused (validation returns before it) keeps an older one.
_k(
    "rayservice_controller.go",
    653,
    "rayServiceInstance.Status.ObservedGeneration = rayServiceInstance.ObjectMeta.Generation",
)
_k("rayservice_controller.go", 157, "errType, err := validateRayService(ctx, rayServiceInstance)")
_k(
    "rayservice_controller.go",
    163,
    "setCondition(rayServiceInstance, rayv1.RayServiceReady, metav1.ConditionFalse, rayv1.RayServiceValidationFailed",
)
_k("utils/constant.go", 479, 'InvalidRayServiceSpec           K8sEventType = "InvalidRayServiceSpec"')
_k("utils/constant.go", 480, 'InvalidRayServiceMetadata       K8sEventType = "InvalidRayServiceMetadata"')
REFUSED_SPEC_EVENTS = frozenset({"InvalidRayServiceSpec", "InvalidRayServiceMetadata"})

# UpgradeInProgress is True exactly while both cluster names are set.
_k("rayservice_controller.go", 807, 'if activeClusterName != "" && pendingClusterName != "" {')
_k(
    "rayservice_controller.go",
    808,
    "rayv1.UpgradeInProgress, metav1.ConditionTrue, rayv1.BothActivePendingClustersExist",
)
_k("rayservice_controller.go", 810, "rayv1.UpgradeInProgress, metav1.ConditionFalse, rayv1.NoPendingCluster")
# Ready is the serve Service's Ready endpoints, nothing else: an in-place
# serveConfigV2 update that fails leaves it True.
_k("rayservice_controller.go", 795, "if rayServiceInstance.Status.NumServeEndpoints > 0 {")

# A cluster is ready for traffic when it has applications and all are RUNNING;
# its head must be Ready before KubeRay asks for them at all.
_k("rayservice_controller.go", 1874, "if app.Status != rayv1.ApplicationStatusEnum.RUNNING {")
_k("rayservice_controller.go", 1889, "if len(newApplications) == 0 {")
_k(
    "rayservice_controller.go",
    2003,
    "if isRunningAndReady, err := r.isHeadPodRunningAndReady(ctx, rayClusterInstance); err != nil",
)
_k("rayservice_controller.go", 2053, "string(utils.FailedToUpdateServeApplications), string(utils.UpdateAction)")
_k("utils/constant.go", 489, 'FailedToUpdateServeApplications K8sEventType = "FailedToUpdateServeApplications"')
SERVE_SUBMIT_EVENT = "FailedToUpdateServeApplications"

# The reconcile that sees the pending cluster ready points the Services at it
# and, in the same calculateStatus, promotes it: a written status never shows a
# pending cluster whose applications are all RUNNING unless the switch failed.
# A failed switch returns before calculateStatus, so the status stays as the
# last good reconcile left it (applications possibly still DEPLOYING): the
# event, newer than the status, is the evidence.
_k("rayservice_controller.go", 289, "if isPendingClusterReady && !isIncrementalUpgradeInProgress {")
_k(
    "rayservice_controller.go",
    297,
    "headSvc, serveSvc, err = r.reconcileServicesToReadyCluster(ctx, rayServiceInstance, targetCluster)",
)
_k("rayservice_controller.go", 299, "return ctrl.Result{RequeueAfter: ServiceDefaultRequeueDuration}, err")
_k(
    "rayservice_controller.go",
    636,
    "rayServiceInstance.Status.ActiveServiceStatus = rayServiceInstance.Status.PendingServiceStatus",
)
_k("rayservice_controller.go", 1964, "string(utils.FailedToUpdateService), string(utils.UpdateAction)")
_k("rayservice_controller.go", 1976, "string(utils.FailedToCreateService), string(utils.CreateAction)")
_k("utils/constant.go", 520, 'FailedToCreateService K8sEventType = "FailedToCreateService"')
_k("utils/constant.go", 521, 'FailedToUpdateService K8sEventType = "FailedToUpdateService"')
SWITCH_EVENTS = frozenset({"FailedToUpdateService", "FailedToCreateService"})

# During an upgrade only the pending cluster's applications are reported.
_k("rayservice_controller.go", 243, "if activeRayClusterInstance != nil && pendingRayClusterInstance == nil &&")
_k(
    "rayservice_controller.go",
    664,
    "rayServiceInstance.Status.PendingServiceStatus.RayClusterStatus = pendingClusterStatus",
)

# A cluster named by neither status field is deleted once the deletion delay
# (default 60 s) has passed; with GCS fault tolerance its head goes first,
# then the Redis cleanup Job runs.
_k(
    "rayservice_controller.go",
    1278,
    "(rayClusterInstance.Name != rayServiceInstance.Status.ActiveServiceStatus.RayClusterName",
)
_k("rayservice_controller.go", 1299, "deletionTimestamp := metav1.Now().Add(deletionDelay)")
_k("rayservice_controller.go", 48, "RayClusterDeletionDelayDuration = 60 * time.Second")
_k("raycluster_controller.go", 1812, "pod.Labels[utils.RayNodeTypeLabelKey] = string(rayv1.RedisCleanupNode)")
DEFAULT_DELETION_DELAY_SECONDS = 60

# A RayCluster of a RayService is named `<rayservice>-<5 random characters>`.
_k("utils/util.go", 370, 'return fmt.Sprintf("%s-%s", serviceName, rand.String(5))')

# Ready False with this reason is terminal: KubeRay clears both cluster names.
_k(
    "rayservice_controller.go",
    2269,
    "setCondition(rs, rayv1.RayServiceReady, metav1.ConditionFalse, rayv1.RayServiceInitializingTimeout, message)",
)
INITIALIZING_TIMEOUT = "InitializingTimeout"
# Ready's reasons calculateConditions itself writes (apis/ray/v1/rayservice_types.go).
ROUTINE_READY_REASONS = frozenset({"Initializing", "NonZeroServeEndpoints", "ZeroServeEndpoints"})

# Waiting reasons of a container that will not get better on its own.
BROKEN_CONTAINER = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
# Pod events that explain why no node is coming: cluster-autoscaler's, and Karpenter's.
AUTOSCALER_EVENTS = frozenset({"NotTriggerScaleUp"})
KARPENTER = "karpenter"


@dataclass(frozen=True)
class Diagnosis:
    """One RayService's phase and its likely cause."""

    namespace: str
    name: str
    phase: Phase
    cause: str

    @property
    def steady(self) -> bool:
        """Nothing left in progress."""
        return self.phase == "steady"

    def line(self) -> str:
        """`<namespace>/<name>: <phase>: <cause>`, always one line."""
        return one_line(f"{self.namespace}/{self.name}: {self.phase}: {self.cause}")


def one_line(text: str, limit: int | None = None) -> str:
    """`text` with its whitespace collapsed, cut to `limit` characters."""
    flat = " ".join(str(text).split())
    if limit is not None and len(flat) > limit:
        return flat[: limit - 1].rstrip() + "…"
    return flat


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _be(n: int) -> str:
    return "is" if n == 1 else "are"


def _quote(text: Any) -> str:
    return one_line(str(text or ""), MAX_MESSAGE)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return _meta(obj).get("labels") or {}


def _time(value: Any) -> datetime | None:
    """An RFC 3339 time as Kubernetes writes it (seconds or microseconds, `Z`)."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def condition(conditions: Iterable[Mapping[str, Any]] | None, kind: str) -> Mapping[str, Any] | None:
    """The condition of one type, if present."""
    return next((c for c in conditions or () if c.get("type") == kind), None)


# --- events --------------------------------------------------------------------------


def event_time(event: Mapping[str, Any]) -> datetime | None:
    """An event's latest occurrence, in the core/v1 or the events.k8s.io/v1 shape."""
    series = event.get("series") or {}
    stamps = (
        series.get("lastObservedTime"),
        event.get("lastTimestamp"),
        event.get("deprecatedLastTimestamp"),
        event.get("eventTime"),
        event.get("firstTimestamp"),
        _meta(event).get("creationTimestamp"),
    )
    times = [t for t in (_time(s) for s in stamps) if t is not None]
    return max(times) if times else None


def _regarding(event: Mapping[str, Any]) -> Mapping[str, Any]:
    return event.get("involvedObject") or event.get("regarding") or {}


def _message(event: Mapping[str, Any]) -> str:
    return str(event.get("message") or event.get("note") or "")


def _source(event: Mapping[str, Any]) -> str:
    source = event.get("source") or {}
    return str(event.get("reportingComponent") or event.get("reportingController") or source.get("component") or "")


def events_about(
    events: Iterable[Mapping[str, Any]], kind: str, name: str, reasons: Iterable[str] | None = None
) -> list[Mapping[str, Any]]:
    """Events regarding one object (optionally of some reasons), newest first."""
    wanted = None if reasons is None else set(reasons)
    found = [
        e
        for e in events
        if _regarding(e).get("kind") == kind
        and _regarding(e).get("name") == name
        and (wanted is None or e.get("reason") in wanted)
    ]
    return sorted(found, key=lambda e: event_time(e) or datetime.min.replace(tzinfo=UTC), reverse=True)


def _fresh(
    events: Iterable[Mapping[str, Any]], name: str, reasons: Iterable[str], status: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """The newest event of `reasons` on the RayService that is not older than its status.

    A reconcile that fails after recording the event returns before it writes
    the status, so a live failure's event is the newer of the two; an event
    left from a failure that later cleared is older than the status written
    since.
    """
    since = _time(status.get("lastUpdateTime"))
    for event in events_about(events, "RayService", name, reasons):
        when = event_time(event)
        if since is None or when is None or when >= since:
            return event
    return None


# --- pods ----------------------------------------------------------------------------


def cluster_name_pattern(ray_service: str) -> re.Pattern[str]:
    """The names KubeRay gives the RayClusters of one RayService."""
    return re.compile(rf"^{re.escape(ray_service)}-[a-z0-9]{{5}}$")


def pods_of(pods: Iterable[Mapping[str, Any]], ray_service: str) -> list[Mapping[str, Any]]:
    """The pods of every cluster of one RayService: our template label, else KubeRay's cluster name."""
    pattern = cluster_name_pattern(ray_service)
    return [
        p
        for p in pods
        if _labels(p).get(kuberay.SERVICE_LABEL) == ray_service or pattern.match(_labels(p).get(kuberay.CLUSTER, ""))
    ]


def in_cluster(pods: Iterable[Mapping[str, Any]], cluster: str) -> list[Mapping[str, Any]]:
    """The pods one RayCluster made (the Redis cleanup Job's pod included)."""
    return [p for p in pods if _labels(p).get(kuberay.CLUSTER) == cluster]


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool(_meta(pod).get("deletionTimestamp"))


def _redis_cleanup(pod: Mapping[str, Any]) -> bool:
    return _labels(pod).get(kuberay.NODE_TYPE) == kuberay.REDIS_CLEANUP


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    ready = condition((pod.get("status") or {}).get("conditions"), "Ready")
    return ready is not None and ready.get("status") == "True"


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message for a Pending pod it could not place, else None."""
    status = pod.get("status") or {}
    scheduled = condition(status.get("conditions"), "PodScheduled")
    if status.get("phase") != "Pending" or scheduled is None or scheduled.get("status") != "False":
        return None
    return str(scheduled.get("message") or scheduled.get("reason") or "Unschedulable")


def scheduler_summary(messages: Iterable[str]) -> str:
    """`Insufficient <resource>` from the scheduler's messages, else the first message's first clause."""
    messages = list(messages)
    short = sorted({m.group(0) for text in messages for m in re.finditer(r"Insufficient [\w./-]*\w", text)})
    if short:
        return ", ".join(short)
    first = messages[0] if messages else "Unschedulable"
    # "0/7 nodes are available: 7 node(s) had untolerated taint ... preemption: ..."
    return _quote(first.split(" preemption:")[0].split(": ", 1)[-1].rstrip("."))


def broken_container(pod: Mapping[str, Any]) -> str | None:
    """`<container> <reason>: <message>` for the first container stuck in a failing state."""
    status = pod.get("status") or {}
    for state in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (state.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in BROKEN_CONTAINER:
            last = ((state.get("lastState") or {}).get("terminated")) or {}
            exited = f" (last exit {last.get('reason')}, code {last.get('exitCode')})" if last else ""
            detail = f": {_quote(waiting.get('message'))}" if waiting.get("message") else ""
            return f"{state.get('name')} {waiting['reason']}{exited}{detail}"
    return None


def _autoscaler_note(pods: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]) -> str:
    """What cluster-autoscaler or Karpenter last said about these pods, if anything."""
    said = [
        e
        for p in pods
        for e in events_about(events, "Pod", str(_meta(p).get("name")))
        if e.get("reason") in AUTOSCALER_EVENTS or (e.get("reason") == "FailedScheduling" and _source(e) == KARPENTER)
    ]
    if not said:
        return ""
    newest = max(said, key=lambda e: event_time(e) or datetime.min.replace(tzinfo=UTC))
    return f"; {_source(newest) or 'autoscaler'}: {_quote(_message(newest))}"


def pods_cause(
    pods: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]], whose: str
) -> tuple[bool, str] | None:
    """Why a cluster's pods are not serving: (capacity?, cause), or None when they all are Ready.

    `whose` names the pods in the sentence ("the new cluster's").
    """
    live = [p for p in pods if not _terminating(p) and not _redis_cleanup(p)]
    if not live:
        return False, f"{whose} pods are not created yet"
    stuck = [(p, m) for p in live if (m := unschedulable(p)) is not None]
    if stuck:
        summary = scheduler_summary(m for _, m in stuck)
        note = _autoscaler_note([p for p, _ in stuck], events)
        counted = f"{len(stuck)} of {whose} {_count(len(live), 'pod')} {_be(len(stuck))} Pending ({summary}{note})"
        if GPU_RESOURCE in summary:
            return True, f"no GPU capacity: {counted}; see ray.upgrade_headroom and the GPU group's max_size"
        return True, f"no room: {counted}"
    broken = [(p, b) for p in live if (b := broken_container(p)) is not None]
    if broken:
        pod, why = broken[0]
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        return False, f"{whose} pod {_meta(pod).get('name')}: {why}{more}"
    waiting = [p for p in live if not pod_ready(p)]
    if waiting:
        return False, (
            f"{len(waiting)} of {whose} {_count(len(live), 'pod')} {_be(len(waiting))} not Ready yet "
            "(image pull, model load, engine start: the capacity plan's cold start budget says how long)"
        )
    return None


# --- the phases ----------------------------------------------------------------------


def apps_cause(apps: Mapping[str, Mapping[str, Any]]) -> str:
    """The applications that are not RUNNING, each with its status and message (or its deployments')."""
    parts = []
    for name, app in sorted(apps.items()):
        status = app.get("status") or "UNKNOWN"
        if status == RUNNING:
            continue
        message = app.get("message")
        if not message:
            deployments = app.get("serveDeploymentStatuses") or {}
            message = "; ".join(
                f"{d} {s.get('status')}" + (f": {s.get('message')}" if s.get("message") else "")
                for d, s in sorted(deployments.items())
                if s.get("status") != "HEALTHY"
            )
        parts.append(f"{name} {status}" + (f": {_quote(message)}" if message else ""))
    return "; ".join(parts)


def _all_running(apps: Mapping[str, Mapping[str, Any]]) -> bool:
    return bool(apps) and all((a.get("status") or "") == RUNNING for a in apps.values())


def _minutes_since(value: Any, now: datetime | None) -> str:
    start = _time(value)
    if now is None or start is None:
        return ""
    return f" (for {max(0, int((now - start).total_seconds() // 60))} min)"


def _not_observed(rs: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str | None:
    """Why KubeRay has not reconciled the applied generation, or None when it has."""
    status = rs.get("status") or {}
    generation = int(_meta(rs).get("generation") or 0)
    observed = int(status.get("observedGeneration") or 0)
    if generation <= observed:
        return None
    name = str(_meta(rs).get("name"))
    refused = events_about(events, "RayService", name, REFUSED_SPEC_EVENTS)
    ready = condition(status.get("conditions"), "Ready") or {}
    if refused:
        return f"KubeRay refused generation {generation}: {_quote(_message(refused[0]))}"
    if ready.get("reason") and ready.get("reason") not in ROUTINE_READY_REASONS | {INITIALIZING_TIMEOUT}:
        return f"KubeRay refused generation {generation}: {ready.get('reason')}: {_quote(ready.get('message'))}"
    return (
        f"KubeRay has not reconciled generation {generation} (last observed {observed}): "
        "is the KubeRay operator running? (its log says why)"
    )


def _pending(
    rs: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]] | None,
    events: Sequence[Mapping[str, Any]],
    now: datetime | None,
) -> tuple[Phase, str]:
    """The phase of an upgrade (or a first deploy) while KubeRay has a pending cluster."""
    status = rs.get("status") or {}
    name = str(_meta(rs).get("name"))
    pending = status.get("pendingServiceStatus") or {}
    cluster = str(pending.get("rayClusterName"))
    first = "" if (status.get("activeServiceStatus") or {}).get("rayClusterName") else "first deploy: "
    upgrading = condition(status.get("conditions"), "UpgradeInProgress") or {}
    since = _minutes_since(upgrading.get("lastTransitionTime") if not first else None, now)
    refused = _fresh(events, name, SWITCH_EVENTS, status)
    if refused is not None:
        return "switch-refused", (
            f"{first}KubeRay could not point its Services at the new cluster {cluster}: "
            f"{refused.get('reason')}: {_quote(_message(refused))}{since}"
        )
    apps: Mapping[str, Mapping[str, Any]] = pending.get("applicationStatuses") or {}
    if _all_running(apps):
        return "switch-refused", (
            f"{first}the new cluster {cluster}'s applications are all RUNNING but KubeRay has not moved its "
            f"Services to it (no FailedToUpdateService event found: read the KubeRay operator's log){since}"
        )
    why = None if pods is None else pods_cause(in_cluster(pods_of(pods, name), cluster), events, "the new cluster's")
    if why is not None and (why[0] or not apps):
        return "pending-cluster-starting", f"{first}{why[1]}{since}"
    if not apps:
        pods_up = pods is not None and why is None
        return "pending-cluster-starting", f"{first}{_no_apps(cluster, pending, events, name, status, pods_up)}{since}"
    submit = _fresh(events, name, [SERVE_SUBMIT_EVENT], status)
    tail = f"; {SERVE_SUBMIT_EVENT}: {_quote(_message(submit))}" if submit is not None else ""
    pods_note = f"; {why[1]}" if why is not None else ""
    return "pending-apps-not-running", f"{first}the new cluster {cluster}: {apps_cause(apps)}{pods_note}{tail}{since}"


def _no_apps(
    cluster: str,
    pending: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    name: str,
    status: Mapping[str, Any],
    pods_up: bool,
) -> str:
    """Why a pending cluster whose pods are all Ready (`pods_up`), or not known, reports no Serve application."""
    submit = _fresh(events, name, [SERVE_SUBMIT_EVENT], status)
    if submit is not None:
        return f"KubeRay could not submit the Serve config to {cluster}: {_quote(_message(submit))}"
    cluster_status = pending.get("rayClusterStatus") or {}
    failure = condition(cluster_status.get("conditions"), "ReplicaFailure")
    if failure is not None and failure.get("status") == "True":
        return f"the new cluster {cluster} can not create its pods: {_quote(failure.get('message'))}"
    if pods_up:
        return (
            f"the new cluster {cluster}'s pods are Ready but it reports no Serve application yet (KubeRay "
            "submits the Serve config once the head is Ready; the operator's log says why if this lasts)"
        )
    ready, desired = cluster_status.get("readyWorkerReplicas"), cluster_status.get("desiredWorkerReplicas")
    workers = f"; {ready or 0}/{desired} workers ready" if desired is not None else ""
    return f"the new cluster {cluster} has no Serve applications yet (its head is not Ready{workers})"


def _serving(
    rs: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | None, events: Sequence[Mapping[str, Any]]
) -> tuple[Phase, str]:
    """The phase when no pending cluster exists: one cluster serves (or none does)."""
    status = rs.get("status") or {}
    name = str(_meta(rs).get("name"))
    active = str((status.get("activeServiceStatus") or {}).get("rayClusterName") or "")
    ready = condition(status.get("conditions"), "Ready") or {}
    if not active:
        if ready.get("reason") == INITIALIZING_TIMEOUT:
            return "not-ready", f"KubeRay gave up: {_quote(ready.get('message'))} (delete and re-create the RayService)"
        upgrade = condition(status.get("conditions"), "UpgradeInProgress") or {}
        return "not-ready", f"no active or pending cluster ({upgrade.get('reason')}: {_quote(upgrade.get('message'))})"
    apps: Mapping[str, Mapping[str, Any]] = (status.get("activeServiceStatus") or {}).get("applicationStatuses") or {}
    endpoints = int(status.get("numServeEndpoints") or 0)
    mine = None if pods is None else pods_of(pods, name)
    if endpoints == 0 or ready.get("status") != "True":
        why = None if mine is None else pods_cause(in_cluster(mine, active), events, "the cluster's")
        parts = [f"0 serve endpoints on cluster {active}", apps_cause(apps), why[1] if why else ""]
        return "not-ready", "; ".join(p for p in parts if p)
    if not _all_running(apps):
        detail = apps_cause(apps) or "no Serve application status (its head is not Ready, so KubeRay can not ask)"
        return "apps-not-running", (
            f"{endpoints} serve endpoints on cluster {active}, but {detail} (a serveConfigV2 change is applied in "
            "place, and Pulumi's wait does not cover it)"
        )
    old = sorted({_labels(p).get(kuberay.CLUSTER, "") for p in mine or ()} - {active})
    if old:
        return "old-cluster-draining", _draining(rs, active, old, mine or [])
    return "steady", f"cluster {active}, {endpoints} serve endpoints, {', '.join(sorted(apps))} RUNNING"


def _draining(rs: Mapping[str, Any], active: str, old: list[str], pods: Sequence[Mapping[str, Any]]) -> str:
    """Where the old cluster of a finished switch is: waiting out the delay, draining, or cleaning Redis."""
    delay = (rs.get("spec") or {}).get("rayClusterDeletionDelaySeconds", DEFAULT_DELETION_DELAY_SECONDS)
    left = [p for p in pods if _labels(p).get(kuberay.CLUSTER) in old]
    cleanup = [p for p in left if _redis_cleanup(p)]
    stopping = [p for p in left if _terminating(p) and not _redis_cleanup(p)]
    if cleanup:
        pod = cleanup[0]
        broken = broken_container(pod)
        failed = (pod.get("status") or {}).get("phase") == "Failed" or broken is not None
        where = f"the Redis cleanup Job is {'failing' if failed else 'deleting its GCS data'}"
        where += f" ({broken})" if broken else ""
    elif stopping:
        where = f"{len(stopping)} of its pods are draining (preStop, up to terminationGracePeriodSeconds)"
    else:
        where = f"kept for rayClusterDeletionDelaySeconds ({delay} s) after the switch, then deleted"
    return f"KubeRay switched to {active}; old cluster {', '.join(old)} ({_count(len(left), 'pod')}): {where}"


def diagnose(
    ray_service: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]] | None = None,
    events: Sequence[Mapping[str, Any]] = (),
    now: datetime | None = None,
) -> Diagnosis:
    """One RayService's phase and likely cause; `pods` and `events` are the namespace's, if known."""
    meta = _meta(ray_service)
    namespace, name = str(meta.get("namespace") or ""), str(meta.get("name"))
    unobserved = _not_observed(ray_service, events)
    if unobserved is not None:
        return Diagnosis(namespace, name, "not-observed", unobserved)
    status = ray_service.get("status") or {}
    if (status.get("pendingServiceStatus") or {}).get("rayClusterName"):
        phase, cause = _pending(ray_service, pods, events, now)
    else:
        phase, cause = _serving(ray_service, pods, events)
    return Diagnosis(namespace, name, phase, cause)


def diagnose_list(listing: Mapping[str, Any], now: datetime | None = None) -> list[Diagnosis]:
    """Every RayService of a `kubectl get rayservices,pods,events -o json` List, by name."""
    items = listing.get("items") or []
    services = [i for i in items if i.get("kind") == "RayService"]
    pods = [i for i in items if i.get("kind") == "Pod"]
    events = [i for i in items if i.get("kind") == "Event"]
    found = [diagnose(rs, pods, events, now) for rs in services]
    return sorted(found, key=lambda d: (d.namespace, d.name))


def exit_code(diagnoses: Iterable[Diagnosis]) -> int:
    """0 when every RayService is steady, else 1."""
    return 0 if all(d.steady for d in diagnoses) else 1


def citations() -> list[Cite]:
    """Every ``_k`` mark of this module (paths under the reference folder)."""
    return marks(Path(__file__), {"_k": KUBERAY_REFERENCE})
