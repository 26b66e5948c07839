"""KEDA: event-driven scaling (cron pre-scaling, queue-fed workers).

The release installs the keda.sh CRDs, so every ScaledObject waits for it.
Its namespace and the operator's service account come from the AWS layer's
pod identity, whose role lets the operator read the batch queue's length
(the `aws` pod identity provider of a TriggerAuthentication uses the
operator's own credentials).
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra import versions
from infra.aws.layer import PodIdentity
from infra.cluster_services.chart_release import PSA_RESTRICTED, ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.scheduling import Placement

RELEASE_NAME = "keda"


def keda_values(*, system: Placement, operator: PodIdentity) -> dict[str, Any]:
    """The chart values: on system nodes, each component's metrics scraped, the operator's account named."""
    values: dict[str, Any] = {
        "crds": {"install": True},
        # The account the operator's pod identity association names; the chart creates it.
        "serviceAccount": {"operator": {"create": True, "name": operator.service_account}},
        # The chart-wide selector applies to the operator, the metrics API
        # server and the admission webhooks alike.
        **system.pod_scheduling(),
        "prometheus": {
            "operator": {"enabled": True, "serviceMonitor": {"enabled": True}},
            "metricServer": {"enabled": True, "serviceMonitor": {"enabled": True}},
            "webhooks": {"enabled": True, "serviceMonitor": {"enabled": True}},
        },
    }
    return values


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> ChartRelease:
    """The KEDA release, in its operator's pod identity namespace; it owns the keda.sh CRDs."""
    operator = ctx.aws.keda_operator
    args = ChartReleaseArgs(
        component_type="llm-platform:platform:Keda",
        chart=versions.KEDA,
        version=ctx.cfg.versions.keda,
        release_name=RELEASE_NAME,
        namespace=operator.namespace,
        values=keda_values(system=ctx.aws.system, operator=operator),
        # KEDA's chart pods pass `restricted` (chart values securityContext and
        # podSecurityContext: non-root, no capabilities, RuntimeDefault seccomp).
        namespace_labels=PSA_RESTRICTED,
    )
    return ChartRelease(name, args, opts)
