"""Labels and names KubeRay puts on what it creates (KubeRay 1.7).

The PodDisruptionBudgets, NetworkPolicies, PodMonitors and the endpoint
select Ray pods by these; they are KubeRay's, so they are written down once
here rather than guessed at each use.
"""

from __future__ import annotations

# On every pod of a RayCluster that a RayService made.
ORIGINATED_FROM_NAME = "ray.io/originated-from-cr-name"
ORIGINATED_FROM_CRD = "ray.io/originated-from-crd"
RAY_SERVICE_CRD = "RayService"
CLUSTER = "ray.io/cluster"
NODE_TYPE = "ray.io/node-type"  # "head" or "worker"
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
    """Selects every pod of every RayCluster a RayService owns (active and pending)."""
    return {ORIGINATED_FROM_NAME: ray_service, ORIGINATED_FROM_CRD: RAY_SERVICE_CRD}
