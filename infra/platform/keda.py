"""KEDA: event-driven scaling (cron pre-scaling, queue-fed workers).

The release installs the keda.sh CRDs, so every ScaledObject waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.platform.helm import PSA_RESTRICTED_WARN, namespace, release
from infra.scheduling import Placement

NAMESPACE = "keda"
RELEASE_NAME = "keda"


def keda_values(*, system: Placement, service_monitor: bool) -> dict[str, Any]:
    """The chart values: on system nodes, each component's metrics scraped."""
    values: dict[str, Any] = {
        "crds": {"install": True},
        # The chart-wide selector applies to the operator, the metrics API
        # server and the admission webhooks alike.
        "nodeSelector": system.node_selector(),
        "prometheus": {
            "operator": {"enabled": True, "serviceMonitor": {"enabled": service_monitor}},
            "metricServer": {"enabled": True, "serviceMonitor": {"enabled": service_monitor}},
            "webhooks": {"enabled": True, "serviceMonitor": {"enabled": service_monitor}},
        },
    }
    if system.taints:
        values["tolerations"] = system.tolerations()
    return values


@dataclass(frozen=True)
class KedaArgs:
    """What the KEDA release is built from."""

    version: str
    system: Placement
    service_monitor: bool
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]


class Keda(pulumi.ComponentResource):
    """The KEDA release; it owns the keda.sh CRDs."""

    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: KedaArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:Keda", name, None, opts)
        ns = namespace(
            NAMESPACE, parent=self, provider=args.provider, labels=PSA_RESTRICTED_WARN, depends_on=args.depends_on
        )
        self.release = release(
            f"{name}-release",
            chart=versions.KEDA,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=NAMESPACE,
            values=keda_values(system=args.system, service_monitor=args.service_monitor),
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
        )
        self.register_outputs({"namespace": NAMESPACE})
