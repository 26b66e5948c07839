"""Karpenter in the cluster: the pinned chart, and one EC2NodeClass and NodePool per GPU group.

Installed where the AWS layer handed down Karpenter's access (the node
provisioner is `karpenter` on a cluster made here). Each GPU group's pool
takes its labels and taints from the group's GpuPlacement, the very object
the RayService's worker groups take their nodeSelector and tolerations from
(infra/scheduling.py), so the pods always select and tolerate what the
nodes carry.

Disruption, and why it never takes a node from under a serving replica:

- consolidation is `WhenEmpty`: Karpenter removes a node only when no pod
  but DaemonSets runs on it, i.e. after the KubeRay autoscaler has already
  removed its Ray worker (Serve scaled the replica down and the worker sat
  idle for `ray.idle_timeout_seconds`). `WhenEmptyOrUnderutilized` would
  move a busy replica to pack nodes tighter: a model reload of minutes, for
  a saving the Ray autoscaler already makes by scaling down. It waits
  `autoscaling.cluster.scale_down_unneeded_time` (the managed groups'
  scale-down time) so a replica scaling back up finds its node;
- drift (a new AMI alias, a changed EC2NodeClass) and expiry
  (`expireAfter`, so no node runs an old image for long) do replace nodes
  with pods on them, one node at a time (the budget), and through a
  drain: each Ray worker pod gets its preStop hook and
  `terminationGracePeriodSeconds` (infra/serving/drain.py), which stops its
  Serve replicas gracefully after replacements start elsewhere. The pool's
  `terminationGracePeriod` is longer than the pods' own, so Karpenter never
  cuts a drain short;
- spot interruptions, rebalance recommendations and scheduled events come
  through the interruption queue (infra/aws/karpenter.py): Karpenter
  taints and drains the node at once, the same graceful path. A spot
  warning gives two minutes, less than a long generation: the model's other
  replica (prod keeps two) serves while this one goes, and requests cut by
  the reclaim are the price of spot, which is why prod buys on-demand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import versions
from infra.aws import node_bootstrap
from infra.aws.layer import KarpenterAccess
from infra.aws.node_groups import AMI_TYPES
from infra.cluster_services.chart_release import ChartRelease, ChartReleaseArgs
from infra.cluster_services.parts import PartContext
from infra.config import GpuNodeGroupSettings, StackConfig, longest_generation_seconds
from infra.scheduling import GpuPlacement, Placement

RELEASE_NAME = "karpenter"
NODE_POOL_API = "karpenter.sh/v1"
NODE_CLASS_API = "karpenter.k8s.aws/v1"
GPU_RESOURCE = "nvidia.com/gpu"
CAPACITY_TYPES = {"on_demand": "on-demand", "spot": "spot", "reserved": "reserved"}
# Nodes are replaced within a month, so none runs an image that old.
EXPIRE_AFTER = "720h"
# Beyond the longest generation, a Ray worker's drain takes Serve's proxy
# draining period (30 s) and Ray's stop after SIGTERM (30 s): the node waits
# for both, with room for the pod's own deletion.
DRAIN_OVERHEAD_SECONDS = 120
# Karpenter replaces at most this many nodes of a pool at once (drift,
# emptiness): a model's replicas never lose more than one node together.
DISRUPTION_BUDGET_NODES = "1"
# The chart's own toleration (kept: values replace the list), plus the
# system nodes' taints; its default affinity already keeps the controller
# off the nodes it launches.
CRITICAL_ADDONS_TOLERATION = {"key": "CriticalAddonsOnly", "operator": "Exists"}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> int:
    """A config duration (`10m`, `2h`) in seconds."""
    return int(duration[:-1]) * _SECONDS[duration[-1]]


def node_termination_grace_seconds(cfg: StackConfig) -> int:
    """How long a draining node waits for its pods: the longest generation plus the drain's own steps."""
    return math.ceil(longest_generation_seconds(cfg)) + DRAIN_OVERHEAD_SECONDS


def karpenter_values(
    *, cluster_name: pulumi.Input[str], access: KarpenterAccess, system: Placement, service_monitor: bool
) -> dict[str, Any]:
    """The chart values: two controllers on the system nodes, this cluster, its interruption queue."""
    return {
        "serviceAccount": {"create": True, "name": access.identity.service_account},
        "replicas": 2,
        "settings": {"clusterName": cluster_name, "interruptionQueue": access.interruption_queue},
        "nodeSelector": {"kubernetes.io/os": "linux", **system.node_selector()},
        "tolerations": [CRITICAL_ADDONS_TOLERATION, *system.tolerations()],
        "controller": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}},
        "serviceMonitor": {"enabled": service_monitor},
    }


def _taint(key: str, value: str, effect: str) -> dict[str, str]:
    # The CRD's value pattern rejects an empty string: a taint without a value omits it.
    return {"key": key, "effect": effect, **({"value": value} if value else {})}


def node_pool_spec(cfg: StackConfig, group: GpuNodeGroupSettings, placement: GpuPlacement) -> dict[str, Any]:
    """A GPU group's NodePool spec: its shape and capacity from config, its labels and taints from the placement."""
    return {
        "template": {
            "metadata": {"labels": placement.labels},
            "spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": group.name},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(group.instance_types)},
                    {
                        "key": "karpenter.sh/capacity-type",
                        "operator": "In",
                        "values": [CAPACITY_TYPES[c] for c in group.capacity_types()],
                    },
                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                    {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
                ],
                "taints": [_taint(t.key, t.value, t.effect) for t in placement.taints],
                "expireAfter": EXPIRE_AFTER,
                "terminationGracePeriod": f"{node_termination_grace_seconds(cfg)}s",
            },
        },
        # The cost guard: never more GPUs than max_size nodes of the group's shape.
        # The config rule holds max_size at or above what a NewCluster upgrade
        # needs as ray.upgrade_headroom sizes it (infra/capacity/upgrade.py):
        # with `peak`, the new cluster's pods fit beside an old one at max.
        "limits": {GPU_RESOURCE: str(group.max_size * placement.gpus_per_node)},
        "disruption": {
            "consolidationPolicy": "WhenEmpty",
            "consolidateAfter": f"{seconds(cfg.autoscaling.cluster.scale_down_unneeded_time)}s",
            "budgets": [{"nodes": DISRUPTION_BUDGET_NODES}],
        },
    }


def block_devices(group: GpuNodeGroupSettings) -> list[dict[str, Any]]:
    """Encrypted gp3 volumes: AL2023's root, or Bottlerocket's OS and data volumes."""

    def ebs(size_gib: int) -> dict[str, Any]:
        return {"volumeSize": f"{size_gib}Gi", "volumeType": "gp3", "encrypted": True, "deleteOnTermination": True}

    if group.ami == "bottlerocket_nvidia":
        # Bottlerocket boots from a small OS volume; images and pods live on the data volume.
        return [
            {"deviceName": "/dev/xvda", "ebs": ebs(4)},
            {"deviceName": "/dev/xvdb", "rootVolume": True, "ebs": ebs(group.disk_size_gib)},
        ]
    return [{"deviceName": "/dev/xvda", "rootVolume": True, "ebs": ebs(group.disk_size_gib)}]


def _id_terms(ids: list[str]) -> list[dict[str, str]]:
    return [{"id": i} for i in ids]


def node_class_spec(group: GpuNodeGroupSettings, access: KarpenterAccess) -> dict[str, Any]:
    """A GPU group's EC2NodeClass spec: pinned NVIDIA AMI, the nodes' role, subnets and group by id."""
    spec: dict[str, Any] = {
        # The family alias at a pinned release; for GPU instance types
        # Karpenter selects that release's NVIDIA variant.
        "amiSelectorTerms": [{"alias": versions.KARPENTER_AMI_ALIASES[group.ami]}],
        "role": access.node_role_name,
        "subnetSelectorTerms": pulumi.Output.from_input(access.subnet_ids).apply(_id_terms),
        "securityGroupSelectorTerms": pulumi.Output.from_input(access.security_group_ids).apply(_id_terms),
        # IMDSv2 only, hop limit 1: pods can not reach the node's role (see infra/aws/node_groups.py).
        "metadataOptions": {
            "httpEndpoint": "enabled",
            "httpProtocolIPv6": "disabled",
            "httpPutResponseHopLimit": 1,
            "httpTokens": "required",
        },
        "blockDeviceMappings": block_devices(group),
        # Local NVMe, where the instance has it, is one RAID0 array for the
        # kubelet's and containers' ephemeral storage (the model cache).
        "instanceStorePolicy": "RAID0",
        # The same SOCI parallel pull the managed node groups' launch templates
        # turn on (infra/aws/node_bootstrap.py); Karpenter merges it with the
        # bootstrap it writes. instance_store=False: instanceStorePolicy above
        # already has Karpenter build the RAID0, a second one would fail.
        "userData": node_bootstrap.gpu_user_data(AMI_TYPES[group.ami], instance_store=False),
        "tags": {**access.tags, "llm-platform/node-group": group.name},
    }
    if group.capacity_reservation_ids:
        spec["capacityReservationSelectorTerms"] = reservation_terms(group)
    return spec


def reservation_terms(group: GpuNodeGroupSettings) -> list[dict[str, str]]:
    """The group's capacity reservations (ODCRs or Capacity Blocks), selected by id."""
    return [{"id": r} for r in group.capacity_reservation_ids]


@dataclass(frozen=True)
class KarpenterArgs:
    """The stack's GPU groups, Karpenter's access from the AWS layer, their placements and the chart values."""

    cfg: StackConfig
    access: KarpenterAccess
    placements: Mapping[str, GpuPlacement]
    values: dict[str, Any]


class Karpenter(pulumi.ComponentResource):
    """The Karpenter chart, then per GPU group an EC2NodeClass and a NodePool (which need its CRDs)."""

    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: KarpenterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:Karpenter", name, None, opts)
        chart = ChartRelease(
            f"{name}-chart",
            ChartReleaseArgs(
                component_type="llm-platform:platform:KarpenterChart",
                chart=versions.KARPENTER,
                version=versions.KARPENTER.version,
                release_name=RELEASE_NAME,
                namespace=args.access.identity.namespace,
                values=args.values,
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.release = chart.release
        after = pulumi.ResourceOptions(parent=self, depends_on=[chart.release])
        groups = args.cfg.node_groups.gpu
        for group in groups:
            k8s.apiextensions.CustomResource(
                f"{name}-{group.name}-nodeclass",
                api_version=NODE_CLASS_API,
                kind="EC2NodeClass",
                metadata={"name": group.name},
                spec=node_class_spec(group, args.access),
                opts=after,
            )
            k8s.apiextensions.CustomResource(
                f"{name}-{group.name}-nodepool",
                api_version=NODE_POOL_API,
                kind="NodePool",
                metadata={"name": group.name},
                spec=node_pool_spec(args.cfg, group, args.placements[group.name]),
                opts=after,
            )
        self.register_outputs({"release": self.release.name, "node_pools": [g.name for g in groups]})


def enabled(ctx: PartContext) -> bool:
    """Installed where the AWS layer made Karpenter's identity and queue."""
    return ctx.aws.karpenter is not None


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> Karpenter:
    """The Karpenter part: the chart and the GPU groups' pools."""
    access = ctx.aws.karpenter
    if access is None:
        raise ValueError("Karpenter needs its identity and interruption queue from the AWS layer")
    values = karpenter_values(
        cluster_name=ctx.aws.cluster_name,
        access=access,
        system=ctx.aws.system,
        service_monitor=ctx.cfg.platform.monitoring.enabled,
    )
    return Karpenter(name, KarpenterArgs(cfg=ctx.cfg, access=access, placements=ctx.aws.gpu, values=values), opts)
