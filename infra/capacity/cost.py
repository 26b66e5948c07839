"""What a replica costs: $/hour from the pinned prices, a decode roofline, and $ per 1M output tokens.

Every number here is an estimate, and says so where it is shown:

- Decode is memory-bound at these batch sizes: each step reads every weight
  of a GPU once and the KV cache of every running sequence. Step time =
  (weights per GPU + batch x context x KV bytes per token per GPU) /
  (peak memory bandwidth x BANDWIDTH_EFFICIENCY); the GPUs of a replica work
  in parallel (TP shards, pipeline stages kept busy), so the slowest GPU sets
  the pace. Output tokens per second = batch / step time.
- The batch is the configured max_num_seqs (else the recommended one,
  workload.py), capped by the mean sequences the KV cache holds at once at
  the model's workload profile; the context is what a mean sequence holds
  on average while it decodes (its prompt and half its answer). So every
  figure is an estimate at that profile, and the plan says which.
- Prefill, scheduling gaps and network time are left out: the figure is a
  ceiling for a saturated replica, not a latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.capacity.plan import ReplicaPlan
from infra.capacity.prices import CapacityType, Price, price
from infra.capacity.workload import Concurrency
from infra.instance_types import GpuInstanceType

# The share of peak memory bandwidth decode kernels reach.
BANDWIDTH_EFFICIENCY = 0.7
ROOFLINE = (
    "decode estimate, at each model's workload profile: memory-bound roofline, step = (weights per GPU + batch x "
    f"context x KV bytes per token) / ({BANDWIDTH_EFFICIENCY:.0%} of peak memory bandwidth); batch = max_num_seqs "
    "(set, else recommended) capped by the mean sequences the KV cache holds at once, context = the mean prompt and "
    "half the mean output; prefill and scheduling gaps left out"
)


@dataclass(frozen=True)
class Decode:
    """The roofline decode estimate of one saturated replica."""

    batch: int
    context_tokens: int
    bytes_per_step: int
    step_seconds: float
    tokens_per_second: float


def decode_estimate(plan: ReplicaPlan, at: Concurrency) -> Decode | None:
    """Output tokens per second of one replica at the roofline, at the workload of `at`; None when the cache
    holds no sequence at that profile."""
    batch = min(plan.engine.max_num_seqs or at.recommended, at.at_mean)
    if batch < 1:
        return None
    context = round(at.workload.mean_context)
    bytes_per_step = max(s.weight_bytes + batch * context * s.kv_bytes_per_token for s in plan.stages)
    step = bytes_per_step / (plan.device.bandwidth_bytes_s * BANDWIDTH_EFFICIENCY)
    return Decode(batch, context, bytes_per_step, step, batch / step)


def nodes_share(gpus: int, instance: GpuInstanceType) -> float:
    """The instances one replica of `gpus` GPUs takes: a share of a node, or whole nodes."""
    if gpus < instance.gpus:
        return gpus / instance.gpus
    return float(-(-gpus // instance.gpus))


@dataclass(frozen=True)
class Cost:
    """One replica's $/hour and, at the decode estimate, $ per 1M output tokens."""

    instance_type: str
    capacity_type: CapacityType
    region: str
    price: Price | None
    usd_per_hour: float | None
    usd_per_million_tokens: float | None


def replica_cost(
    plan: ReplicaPlan, instance: GpuInstanceType, capacity_type: CapacityType, region: str, decode: Decode | None
) -> Cost:
    """The cost of one replica on `instance` nodes at `capacity_type` in `region` (None where no price is pinned)."""
    pinned = price(region, instance.name, capacity_type)
    if pinned is None:
        return Cost(instance.name, capacity_type, region, None, None, None)
    hourly = pinned.usd_per_hour * nodes_share(plan.engine.world_size, instance)
    per_million = hourly / (decode.tokens_per_second * 3600) * 1e6 if decode else None
    return Cost(instance.name, capacity_type, region, pinned, hourly, per_million)
