"""Pod Security `restricted` for every pod the serving layer declares, in one place.

The serving namespace enforces the `restricted` Pod Security Standard, so a
pod that is not written this way is refused at admission. The Ray pods, the
batch workers and the GPU headroom placeholders all take their security
contexts from here.

Service-account tokens: no serving pod mounts one except the KubeRay
autoscaler sidecar of each Ray head, which patches its RayCluster through the
Kubernetes API. EKS Pod Identity does not need the Kubernetes token either:
its webhook adds its own projected token (audience `pods.eks.amazonaws.com`)
to pods whose account has an association, whatever
`automountServiceAccountToken` says. So the GPU workers and the batch
workers keep their AWS roles without a Kubernetes credential, and code run
inside a Ray container (the dashboard's job API runs arbitrary code) finds no
token to use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The serving image's user: the Ray base image's `ray` user and `users`
# group, which workloads/Dockerfile names in its USER line.
RAY_UID = 1000
RAY_GID = 100
# Why a pod running the serving image skips checkov's "high UID" check (checkov.io/skip annotations).
SERVING_IMAGE_UID_SKIP = {
    "CKV_K8S_40": f"the serving image's own user is uid {RAY_UID} (workloads/Dockerfile), owner of its Python "
    "environment",
}
# The pause image's `nobody` user (65535:65535).
PAUSE_UID = 65535

RESTRICTED = "restricted"
PSA_PREFIX = "pod-security.kubernetes.io"

# Where a pod with a mounted token would find it; the Ray autoscaler reads
# its token and CA from there (ray/autoscaler/_private/kuberay/node_provider.py).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
AUTOSCALER_TOKEN_VOLUME = "autoscaler-api-token"
# What kubelet gives an automounted token: an hour, refreshed before expiry.
TOKEN_EXPIRATION_SECONDS = 3607

CHECKOV_SKIP = "checkov.io/skip"


def restricted_namespace_labels() -> dict[str, str]:
    """Enforce, audit and warn at `restricted` (the latest version of the standard)."""
    labels: dict[str, str] = {}
    for mode in ("enforce", "audit", "warn"):
        labels[f"{PSA_PREFIX}/{mode}"] = RESTRICTED
        labels[f"{PSA_PREFIX}/{mode}-version"] = "latest"
    return labels


def pod_security_context(uid: int, gid: int, *, fs_group: bool = False) -> dict[str, Any]:
    """The pod-level context: a numeric non-root user, the runtime's seccomp profile.

    `fs_group` gives the image's group ownership of the pod's volumes (an
    EBS volume is root-owned when it is formatted).
    """
    context: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if fs_group:
        context["fsGroup"] = gid
        # Only when the volume's root is not already the group's: a model
        # cache of many files is not walked on every start.
        context["fsGroupChangePolicy"] = "OnRootMismatch"
    return context


def container_security_context(*, read_only_root: bool) -> dict[str, Any]:
    """The container-level context: no privilege escalation, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def autoscaler_token_volume() -> dict[str, Any]:
    """The head's Kubernetes token as a volume of its own, mounted only into the autoscaler.

    The same three parts kubelet would automount (token, cluster CA,
    namespace), so the autoscaler's in-cluster client works unchanged.
    """
    return {
        "name": AUTOSCALER_TOKEN_VOLUME,
        "projected": {
            "defaultMode": 0o444,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_SECONDS}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ],
        },
    }


def autoscaler_token_mount() -> dict[str, Any]:
    """Where the autoscaler sidecar reads its token."""
    return {"name": AUTOSCALER_TOKEN_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}


def checkov_skips(reasons: Mapping[str, str]) -> dict[str, str]:
    """`checkov.io/skip<N>: <CHECK_ID>=<reason>` annotations, one per check that can not apply."""
    return {f"{CHECKOV_SKIP}{i}": f"{check}={reason}" for i, (check, reason) in enumerate(sorted(reasons.items()), 1)}
