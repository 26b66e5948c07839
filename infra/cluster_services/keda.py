"""KEDA: event-driven scaling (cron pre-scaling, queue-fed workers).

The release installs the keda.sh CRDs, so every ScaledObject waits for it.
Its namespace and the operator's service account come from the AWS layer's
pod identity, whose role lets the operator read the batch queue's length
(the `aws` pod identity provider of a TriggerAuthentication uses the
operator's own credentials).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.aws.layer import PodIdentity
from infra.cluster_services.helm import PSA_RESTRICTED_WARN, namespace, release
from infra.scheduling import Placement

RELEASE_NAME = "keda"


def keda_values(*, system: Placement, service_monitor: bool, operator: PodIdentity) -> dict[str, Any]:
    """The chart values: on system nodes, each component's metrics scraped, the operator's account named."""
    values: dict[str, Any] = {
        "crds": {"install": True},
        # The account the operator's pod identity association names; the chart creates it.
        "serviceAccount": {"operator": {"create": True, "name": operator.service_account}},
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
    operator: PodIdentity
    provider: k8s.Provider
    depends_on: Sequence[pulumi.Resource]


class Keda(pulumi.ComponentResource):
    """The KEDA release; it owns the keda.sh CRDs."""

    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: KedaArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:Keda", name, None, opts)
        ns_name = args.operator.namespace
        ns = namespace(
            ns_name, parent=self, provider=args.provider, labels=PSA_RESTRICTED_WARN, depends_on=args.depends_on
        )
        self.release = release(
            f"{name}-release",
            chart=versions.KEDA,
            version=args.version,
            release_name=RELEASE_NAME,
            namespace=ns_name,
            values=keda_values(system=args.system, service_monitor=args.service_monitor, operator=args.operator),
            parent=self,
            provider=args.provider,
            depends_on=[*args.depends_on, *([ns] if ns else [])],
        )
        self.register_outputs({"namespace": ns_name})
