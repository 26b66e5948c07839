"""Labels and names KubeRay puts on what it creates (KubeRay 1.7), and the one label of ours its pods carry.

The PodDisruptionBudgets, NetworkPolicies, PodMonitors and the endpoint
select Ray pods by these; they are KubeRay's, so they are written down once
here rather than guessed at each use. What KubeRay really puts on a pod is
ported, with citations, in twin/kuberay.py; tests check these names against it.

A pod gets its template's labels, its group's `labels` and what `labelPod`
adds (`ray.io/cluster`, `ray.io/node-type`, `ray.io/group`, ...), plus
`ray.io/serve` on RayService pods. `ray.io/originated-from-*` is on the
RayCluster and the Services only, never on a pod: a selector on it selects
nothing, so none here uses it.
"""

from __future__ import annotations

# Ours, on every Ray pod template a RayService declares (ray_service.pod_labels):
# KubeRay copies template labels onto the pods of every cluster it makes, so
# it names the RayService's pods across a NewCluster upgrade, where
# `ray.io/cluster` changes.
SERVICE_LABEL = "llm-platform/ray-service"
CLUSTER = "ray.io/cluster"
NODE_TYPE = "ray.io/node-type"  # "head" or "worker"; "redis-cleanup" on the GCS cleanup Job's pod
# The pod of the Job KubeRay runs to delete a GCS-fault-tolerant cluster's
# data in Redis: the head pod with this node type (common/job.go, raycluster_controller.go).
REDIS_CLEANUP = "redis-cleanup"
GROUP = "ray.io/group"  # the worker group's name; "headgroup" on the head
IS_RAY_NODE = "ray.io/is-ray-node"
# "true" on pods whose Serve proxy takes traffic (KubeRay keeps it false on
# the head when `excludeHeadPodFromServeSvc` is set).
SERVE = "ray.io/serve"
# The KubeRay operator's pods (chart 1.7.0, `nameOverride: kuberay-operator`):
# the operator polls each head's dashboard for the Serve status.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}


def head_service(ray_service: str) -> str:
    """The Service KubeRay points at the active cluster's head."""
    return f"{ray_service}-head-svc"


def serve_service_name(ray_service: str) -> str:
    """The Service KubeRay points at the active cluster's Serve proxies."""
    return f"{ray_service}-serve-svc"


def pods_of(ray_service: str) -> dict[str, str]:
    """Selects every pod of every RayCluster a RayService owns (active and pending), by our template label."""
    return {SERVICE_LABEL: ray_service}
