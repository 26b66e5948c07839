"""The `cluster` section: the Kubernetes cluster made here (EKS) or an existing one, and how it gets GPU nodes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from ipaddress import IPv4Network
from typing import Any, Literal

from pydantic import Field, model_validator

from infra import versions
from infra.config.fields import K8sName, Section
from infra.config.problems import Problem

LogType = Literal["api", "audit", "authenticator", "controllerManager", "scheduler"]
_DEFAULT_LOG_TYPES: tuple[LogType, ...] = ("api", "audit", "authenticator")


class Cluster(Section):
    """The Kubernetes cluster: created here (`eks`) or an existing one."""

    mode: Literal["eks", "existing"] = "eks"
    name: K8sName
    kubernetes_version: str = versions.KUBERNETES_VERSION
    endpoint_public_access: bool = False
    endpoint_private_access: bool = True
    public_access_cidrs: list[IPv4Network] = Field(default_factory=list)
    admin_principal_arns: list[str] = Field(default_factory=list)
    log_types: list[LogType] = Field(default_factory=lambda: list(_DEFAULT_LOG_TYPES))
    kubeconfig_context: str | None = None
    # How the cluster gets GPU nodes (infra/aws/provisioning.py): Karpenter
    # NodePools, or EKS managed node groups scaled by cluster-autoscaler. The
    # system nodes are a managed node group under both.
    node_provisioner: Literal["karpenter", "managed_node_groups"] = "karpenter"

    @model_validator(mode="before")
    @classmethod
    def _existing_keeps_its_nodes(cls, data: Any) -> Any:
        # An existing cluster's nodes are not this program's: unless told
        # otherwise it keeps today's behaviour (cluster-autoscaler installed).
        if isinstance(data, dict) and data.get("mode") == "existing" and "node_provisioner" not in data:
            return {**data, "node_provisioner": "managed_node_groups"}
        return data


def check_kubernetes_version(cluster: Cluster) -> Iterable[Problem]:
    """A version other than the pinned one is a Kubernetes minor."""
    if cluster.kubernetes_version != versions.KUBERNETES_VERSION and not re.match(
        r"^1\.\d+$", cluster.kubernetes_version
    ):
        yield Problem("cluster.kubernetes_version", "must be a Kubernetes minor such as 1.35")
