"""The `versions` and `platform` sections: the pinned versions of the in-cluster services, and which ones run."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from infra import versions
from infra.config.fields import Section

_EXACT_VERSION = re.compile(r"^v?\d+\.\d+(\.\d+)?([-+][0-9A-Za-z.-]+)?$")


class Versions(Section):
    """Pinned platform versions; defaults come from infra/versions.py."""

    gpu_operator: str = versions.GPU_OPERATOR.version
    kuberay_operator: str = versions.KUBERAY_OPERATOR.version
    kube_prometheus_stack: str = versions.KUBE_PROMETHEUS_STACK.version
    keda: str = versions.KEDA.version
    cluster_autoscaler: str = versions.CLUSTER_AUTOSCALER.version
    aws_load_balancer_controller: str = versions.AWS_LOAD_BALANCER_CONTROLLER.version
    external_dns: str = versions.EXTERNAL_DNS.version

    @field_validator("*")
    @classmethod
    def _exact(cls, value: str) -> str:
        if not _EXACT_VERSION.match(value):
            raise ValueError(f"'{value}' is not an exact version (no ranges or wildcards)")
        return value


class Toggle(Section):
    """A platform part that an existing cluster may already run."""

    enabled: bool = True


class GpuOperatorSettings(Toggle):
    """NVIDIA GPU Operator settings."""

    mig_strategy: Literal["none", "single", "mixed"] = "none"


class Platform(Section):
    """In-cluster services; each may be switched off on an existing cluster."""

    gpu_operator: GpuOperatorSettings = GpuOperatorSettings()
    kuberay: Toggle = Toggle()
    monitoring: Toggle = Toggle()
    keda: Toggle = Toggle()
    cluster_autoscaler: Toggle = Toggle()
    load_balancer_controller: Toggle = Toggle()
    # Runs only where endpoint.domain and endpoint.hosted_zone_id are set.
    external_dns: Toggle = Toggle()
