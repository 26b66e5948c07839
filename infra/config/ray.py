"""The `ray` section: what every RayService shares (GCS fault tolerance, cold-start timeouts, upgrades)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from infra.capacity.upgrade import UpgradeHeadroom
from infra.config.fields import CpuQuantity, MemoryQuantity, Section

# ElastiCache node families that run the Ray GCS Redis as infra/aws/redis.py
# creates it (Redis 7.1, Multi-AZ automatic failover, TLS in transit,
# encryption at rest): the current generation, without the data-tiering
# family (r6gd), which the replication group does not enable.
ELASTICACHE_FAMILIES = ("t3", "t4g", "m5", "m6g", "m7g", "r5", "r6g", "r7g", "c7gn")
_CACHE_NODE_TYPE = re.compile(r"^cache\.(?P<family>[a-z0-9]+)\.(?P<size>[a-z0-9]+)$")
_BURSTABLE_SIZES = ("micro", "small", "medium")
_CACHE_SIZE = re.compile(r"^(large|\d*xlarge)$")


def _cache_node_type(value: str) -> str:
    match = _CACHE_NODE_TYPE.match(value)
    family, size = (match["family"], match["size"]) if match else ("", "")
    burstable = family.startswith("t")
    if family in ELASTICACHE_FAMILIES and (size in _BURSTABLE_SIZES if burstable else _CACHE_SIZE.match(size)):
        return value
    raise ValueError(
        f"'{value}' is not an ElastiCache node type this Redis runs on: cache.<family>.<size> with a family of "
        f"{', '.join(ELASTICACHE_FAMILIES)} (micro, small or medium for t*, large or <n>xlarge otherwise)"
    )


class GcsFaultTolerance(Section):
    """External Redis for the Ray GCS, so a head restart keeps serving."""

    enabled: bool = False
    node_type: Annotated[str, AfterValidator(_cache_node_type)] = "cache.t4g.small"


class ColdStartTimeouts(Section):
    """The timeouts a cold start runs under; a rule holds each above the model's budget (infra/capacity/cold_start.py).

    Defaults are the upstream ones (Ray 2.60's autoscaler v2 reconciler and
    Serve LLM), written out so the rule can see them; `pulumi_wait_seconds`
    unset keeps the RayService's own wait (1800 s, 3600 s from 40 GiB of weights).
    """

    autoscaler_allocate_seconds: int = Field(default=3600, ge=60)
    autoscaler_ray_install_seconds: int = Field(default=1800, ge=60)
    engine_start_seconds: int = Field(default=3600, ge=60)
    pulumi_wait_seconds: int | None = Field(default=None, ge=60)


class Ray(Section):
    """RayService settings shared by every model."""

    gcs_fault_tolerance: GcsFaultTolerance = GcsFaultTolerance()
    cold_start: ColdStartTimeouts = ColdStartTimeouts()
    idle_timeout_seconds: int = Field(default=300, ge=30)
    # NewCluster: a full second cluster, traffic switched when it is ready
    # (zero downtime; the new cluster's GPUs beside the old cluster's while
    # upgrading, see upgrade_headroom). None: cluster changes
    # are not rolled out (serveConfigV2 still updates in place). KubeRay's
    # incremental upgrade needs a Gateway API implementation the platform
    # does not install, so it is not offered.
    upgrade_strategy: Literal["NewCluster", "None"] = "NewCluster"
    # The old cluster a NewCluster upgrade must find room beside, in every GPU
    # group's max_size: `peak`, the old cluster at max_replicas (an upgrade
    # places its new cluster at any hour), or `min`, at min_replicas (smaller
    # groups; an upgrade started at peak waits for traffic to fall). `peak` is
    # the default because nobody times `pulumi up` to traffic: under `min` the
    # upgrade that ships a fix at peak is the one that stalls. See
    # infra/capacity/upgrade.py and docs/upgrade-headroom.md.
    upgrade_headroom: UpgradeHeadroom = "peak"
    head_cpu: CpuQuantity = "2"
    head_memory: MemoryQuantity = "8Gi"
