"""Shared pieces of the platform components: namespaces and pinned releases.

Not a component: the helpers every platform component uses so that each
release is declared the same way (exact version, fixed Helm release name,
explicit namespace, the one provider) and each namespace is a resource this
program owns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.versions import HelmChart

# Namespaces a cluster always has: a release may go there, but this program
# must not claim (and on delete remove) them.
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})

# Pod Security Admission level for namespaces whose pods need host access
# (node exporter, DCGM exporter, device plugin): say so explicitly instead of
# relying on the cluster's default level.
PSA_PRIVILEGED = {
    "pod-security.kubernetes.io/enforce": "privileged",
    "pod-security.kubernetes.io/audit": "privileged",
    "pod-security.kubernetes.io/warn": "privileged",
}
PSA_RESTRICTED_WARN = {
    "pod-security.kubernetes.io/enforce": "baseline",
    "pod-security.kubernetes.io/warn": "restricted",
}


def helm_fullname(release: str, chart_name: str, override: str = "", limit: int = 63) -> str:
    """The `<chart>.fullname` most charts derive (Helm's starter template).

    Used to build in-cluster service addresses from the release name instead of
    typing the rendered object names a second time.
    """
    if override:
        name = override
    elif chart_name in release:
        name = release
    else:
        name = f"{release}-{chart_name}"
    return name[:limit].rstrip("-")


def namespace(
    name: str,
    *,
    parent: pulumi.Resource,
    provider: k8s.Provider,
    labels: Mapping[str, str] | None = None,
    depends_on: Sequence[pulumi.Resource] = (),
) -> k8s.core.v1.Namespace | None:
    """A Namespace this program owns, or None for one every cluster has."""
    if name in SYSTEM_NAMESPACES:
        return None
    return k8s.core.v1.Namespace(
        f"{name}-namespace",
        metadata=k8s.meta.v1.ObjectMetaArgs(
            name=name,
            labels={"app.kubernetes.io/managed-by": "pulumi", **(labels or {})},
        ),
        opts=pulumi.ResourceOptions(parent=parent, provider=provider, depends_on=list(depends_on)),
    )


def release(
    resource_name: str,
    *,
    chart: HelmChart,
    version: str,
    release_name: str,
    namespace: str,
    values: Mapping[str, Any],
    parent: pulumi.Resource,
    provider: k8s.Provider,
    depends_on: Sequence[pulumi.Resource],
    timeout_seconds: int = 600,
) -> k8s.helm.v3.Release:
    """A Helm release of `chart` pinned to `version`, in `namespace`.

    The Helm release name is fixed (no Pulumi suffix) because the charts derive
    their object names from it, and the platform layer derives service
    addresses from those.
    """
    return k8s.helm.v3.Release(
        resource_name,
        name=release_name,
        chart=chart.chart,
        version=version,
        repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=chart.repository),
        namespace=namespace,
        create_namespace=False,
        values=dict(values),
        # A failed install or upgrade rolls back instead of leaving a
        # half-applied release that the next `pulumi up` has to untangle.
        atomic=True,
        cleanup_on_fail=True,
        timeout=timeout_seconds,
        opts=pulumi.ResourceOptions(parent=parent, provider=provider, depends_on=list(depends_on)),
    )
