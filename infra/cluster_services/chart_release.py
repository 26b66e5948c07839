"""The generic platform part: a pinned Helm chart in a namespace this program owns.

Every chart of the platform layer is declared the same way (exact version,
fixed Helm release name, explicit namespace, the provider inherited from
the part) through `ChartRelease`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
# For a chart whose pods all pass `restricted` as the pinned chart renders them
# (non-root, every capability dropped, no privilege escalation, RuntimeDefault
# seccomp, no host namespaces or paths): nobody can start a pod there that
# does not, hostNetwork included.
PSA_RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/audit": "restricted",
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
    labels: Mapping[str, str] | None = None,
) -> k8s.core.v1.Namespace | None:
    """A Namespace this program owns, or None for one every cluster has.

    The provider and the dependencies come from `parent`.
    """
    if name in SYSTEM_NAMESPACES:
        return None
    return k8s.core.v1.Namespace(
        f"{name}-namespace",
        metadata=k8s.meta.v1.ObjectMetaArgs(
            name=name,
            labels={"app.kubernetes.io/managed-by": "pulumi", **(labels or {})},
        ),
        opts=pulumi.ResourceOptions(parent=parent),
    )


@dataclass(frozen=True)
class ChartReleaseArgs:
    """One pinned chart installed in a namespace.

    `component_type` is the Pulumi type the part shows under in a preview
    (and that its URNs carry), e.g. `llm-platform:platform:KubeRayOperator`.
    """

    component_type: str
    chart: HelmChart
    version: str
    release_name: str
    namespace: str
    values: Mapping[str, Any]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    # False when another part already declares the namespace.
    own_namespace: bool = True
    timeout_seconds: int = 600


class ChartRelease(pulumi.ComponentResource):
    """A Helm release pinned to an exact version, in a namespace this program owns.

    The provider and the parts it waits for arrive through `opts` and reach
    the namespace and the release as children. The Helm release name is
    fixed (no Pulumi suffix) because the charts derive their object names
    from it, and the platform layer derives service addresses from those.
    Subclasses add children the release needs first in `_before_release`.
    """

    release: k8s.helm.v3.Release
    namespace: str

    def __init__(self, name: str, args: ChartReleaseArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__(args.component_type, name, None, opts)
        self.namespace = args.namespace
        ns = namespace(args.namespace, parent=self, labels=args.namespace_labels) if args.own_namespace else None
        first = [*([ns] if ns else []), *self._before_release(name, args, ns)]
        # A chart in an OCI registry is named by its full reference; Helm's
        # repository option only takes index-based (https) repositories.
        oci = args.chart.repository.startswith("oci://")
        self.release = k8s.helm.v3.Release(
            f"{name}-release",
            name=args.release_name,
            chart=f"{args.chart.repository}/{args.chart.chart}" if oci else args.chart.chart,
            version=args.version,
            repository_opts=None if oci else k8s.helm.v3.RepositoryOptsArgs(repo=args.chart.repository),
            namespace=args.namespace,
            create_namespace=False,
            values=dict(args.values),
            # A failed install or upgrade rolls back instead of leaving a
            # half-applied release that the next `pulumi up` has to untangle.
            atomic=True,
            cleanup_on_fail=True,
            timeout=args.timeout_seconds,
            opts=pulumi.ResourceOptions(parent=self, depends_on=first),
        )
        self.register_outputs({"namespace": args.namespace, "release": self.release.name})

    def _before_release(
        self, name: str, args: ChartReleaseArgs, ns: k8s.core.v1.Namespace | None
    ) -> list[pulumi.Resource]:
        """Children the release must wait for (none by default)."""
        return []
