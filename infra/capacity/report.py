"""The capacity plan of a whole stack: a table, Markdown, one preview line per model, and the stack output.

Shown by `python -m infra.plan`, printed by the program during `pulumi
preview`, exported as the `capacity` stack output, and added to the pull
request's preview comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.capacity import cold_start
from infra.capacity.calibration import CUDA_MEMORY
from infra.capacity.cost import ROOFLINE, Cost, Decode, decode_estimate, replica_cost
from infra.capacity.geometry import resolve_geometry
from infra.capacity.inputs import GroupInput, ModelInput, StackInput
from infra.capacity.kv_band import KvBand, replica_kv_band
from infra.capacity.plan import (
    GIB,
    OVERHEADS,
    Device,
    EngineSettings,
    ReplicaPlan,
    plan_replica,
)
from infra.capacity.prices import ON_DEMAND_AS_OF, ON_DEMAND_SOURCE, SPOT_AS_OF, SPOT_SOURCE
from infra.capacity.rules import MAX_INFLIGHT_KV_ROUNDS, inflight_tokens
from infra.capacity.upgrade import UpgradeCost, UpgradeNeed, upgrade_cost
from infra.capacity.workload import RECOMMENDED_SHARE, Concurrency, concurrency
from infra.instance_types import GpuInstanceType

MEMORY = (
    "GPU memory is the total CUDA reports for the GPU (cudaMemGetInfo, what gpu_memory_utilization is a share of; "
    "each figure sourced in infra/capacity/calibration.py, the lower where sources differ), below the datasheet's "
    f"GB on the GDDR6 cards (an L4 reports {CUDA_MEMORY['L4'].low_bytes / GIB:.2f} GiB of its 24 GB); GiB = 2^30 bytes"
)
KV_BAND = (
    "KV tokens (band): the plan's figure (the lower CUDA total, each non-KV term's midpoint), then the band's ends: "
    "the low end takes the lower CUDA total and each term's high end, the high end the higher total and each term's "
    "low end (each model's two are listed with the table); every published start-up in infra/capacity/calibration.py "
    "logged a KV memory inside its band"
)
PRICES = (
    f"prices pinned in infra/capacity/prices.py: on-demand {ON_DEMAND_SOURCE}, {ON_DEMAND_AS_OF}; "
    f"spot {SPOT_SOURCE}, {SPOT_AS_OF}"
)
CONCURRENCY = (
    "concurrency at each model's workload profile (its workload block, else every request at the longest "
    "serving.limits admits): the blocks at the KV band's low end, less vLLM's null block, over the blocks of one "
    "sequence at p95 (p95 prompt + p95 output tokens) is the load up to which vLLM never preempts; the recommended "
    f"max_num_seqs is {RECOMMENDED_SHARE:.0%} of it, and a max_num_seqs set above it is refused unless "
    "workload.allow_preemption (infra/capacity/workload.py)"
)
ASSUMPTIONS = (OVERHEADS, KV_BAND, CONCURRENCY, ROOFLINE, PRICES, MEMORY)
COLUMNS = (
    "model",
    "replica",
    "weights / GPU",
    "KV cache / GPU",
    "KV / token / GPU",
    "KV tokens (band)",
    "max_model_len seqs",
    "max_num_seqs",
    "decode (est. at workload)",
    "$/h (replica)",
    "$/1M out (est. at workload)",
    "$/h (min-max replicas)",
)


@dataclass(frozen=True)
class ModelPlan:
    """One model's plan: its replica, decode estimate and cost, and the replicas it scales between."""

    model: ModelInput
    instance: GpuInstanceType
    replica: ReplicaPlan
    # The KV tokens between the calibrated overheads' ends; the replica's own figure lies inside.
    kv_band: KvBand
    # The sequences one replica runs at once at the model's workload profile, from the band's low end.
    concurrency: Concurrency
    decode: Decode | None
    cost: Cost

    @property
    def name(self) -> str:
        """The model's name in the stack."""
        return self.model.name


def plan_model(model: ModelInput, region: str) -> ModelPlan:
    """The plan of one model of a validated stack (its rules ensure a geometry and a usable group)."""
    entry = model.entry
    geometry = resolve_geometry(model.geometry, entry.source, entry.model_id)
    if geometry is None:
        raise ValueError(f"model '{model.name}' has no geometry (the config rules refuse it)")
    group = model.group
    instance = group.instance
    engine = EngineSettings.of(entry)
    replica = plan_replica(geometry, model.parameters_billion, engine, Device.of(instance))
    band = replica_kv_band(geometry, model.parameters_billion, engine, instance)
    at = concurrency(replica, band, model.workload)
    decode = decode_estimate(replica, at)
    cost = replica_cost(replica, instance, group.capacity_type, region, decode)
    return ModelPlan(model, instance, replica, band, at, decode, cost)


def cold_start_line(budget: cold_start.ColdStart) -> str:
    """One line for the preview's log: the budget and its phases."""
    return (
        f"cold start {budget.model}: {budget.total:.0f} s budget on a new {budget.instance} node "
        f"({cold_start.describe(budget)})"
    )


def cold_start_output(inputs: StackInput) -> dict[str, Any]:
    """The `cold_start` stack output: each model's budget and the pinned figures behind it."""
    return {
        "models": {m.name: cold_start.output(m.cold_start) for m in inputs.models},
        "figures": cold_start.sources(),
    }


def plan_stack(inputs: StackInput) -> list[ModelPlan]:
    """Every model's plan, in config order."""
    return [plan_model(m, inputs.region) for m in inputs.models]


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def _usd(value: float | None) -> str:
    return "no pinned price" if value is None else f"${value:,.2f}"


def _kv_tokens(p: ModelPlan) -> str:
    band = p.kv_band.tokens
    return f"{p.replica.kv_tokens:,} ({band.low:,}-{band.high:,})"


def band_line(p: ModelPlan) -> str:
    """One line: a model's KV token band and the assumption behind each end."""
    return f"KV band {p.name}: {p.kv_band.describe()}"


def _estimates(p: ModelPlan) -> str:
    decode = (
        f"~{p.decode.tokens_per_second:,.0f} output tokens/s at batch {p.decode.batch}"
        if p.decode
        else "no decode estimate"
    )
    return f"{decode}, {_usd(p.cost.usd_per_million_tokens)} per 1M output tokens"


def workload_line(p: ModelPlan) -> str:
    """One line: the model's workload profile, the load at which preemption starts, and the estimates at it."""
    at, r = p.concurrency, p.replica
    now = f"set {r.engine.max_num_seqs}" if r.engine.max_num_seqs else f"unset, vLLM's default {r.default_max_num_seqs}"
    return (
        f"workload {p.name}: {at.workload.describe()}: no preemption up to {at.preemption_free} sequences at once at "
        f"p95 ({at.arithmetic()}), typically from about {at.at_mean} at the mean ({at.mean_blocks:,} blocks a "
        f"sequence); max_num_seqs {at.recommended} recommended ({RECOMMENDED_SHARE:.0%} of {at.preemption_free}), "
        f"{now}; estimates at this profile: {_estimates(p)}"
    )


def preemption_warning(p: ModelPlan) -> str | None:
    """The warning a max_num_seqs above the preemption-free load gets when the stack accepts preemption, else None.

    Without workload.allow_preemption the config refuses it (rules.preemption_problems).
    """
    at, configured = p.concurrency, p.replica.engine.max_num_seqs
    if configured is None or not at.preempts(configured):
        return None
    return (
        f"preemption {p.name}: max_num_seqs {configured} is above the {at.preemption_free} sequences the KV cache "
        f"holds at once at the workload's p95 (workload.allow_preemption: true): above {at.preemption_free} running "
        "sequences of long requests vLLM preempts and recomputes them, and the preemption alerts take "
        f"{at.preemption_free} as the load where it starts"
    )


def _replica(p: ModelPlan) -> str:
    kind = p.cost.capacity_type.replace("_", "-")
    return f"{p.replica.engine.world_size} x {p.instance.gpu_model} ({p.instance.name}, {kind})"


def _max_num_seqs(p: ModelPlan) -> str:
    r, at = p.replica, p.concurrency
    now = f"set {r.engine.max_num_seqs}" if r.engine.max_num_seqs else f"vLLM default {r.default_max_num_seqs}"
    return f"{at.recommended} recommended, {at.preemption_free} preemption-free at p95 ({now})"


def _replicas_cost(p: ModelPlan) -> str:
    hourly = p.cost.usd_per_hour
    if hourly is None:
        return "no pinned price"
    low, high = p.model.entry.autoscaling.min_replicas, p.model.entry.autoscaling.max_replicas
    return f"{_usd(hourly * low)}-{_usd(hourly * high)} ({low}-{high})"


def row(p: ModelPlan) -> list[str]:
    """One model's cells, in COLUMNS order."""
    r, stage = p.replica, p.replica.binding
    decode = f"~{p.decode.tokens_per_second:,.0f} tok/s at batch {p.decode.batch}" if p.decode else "none"
    return [
        p.name,
        _replica(p),
        _gib(r.weight_bytes_per_gpu),
        f"{_gib(stage.kv_memory_bytes)} ({r.num_blocks:,} blocks of {r.block_size})",
        _kib(r.kv_bytes_per_token),
        _kv_tokens(p),
        f"{r.max_model_len_sequences} x {r.engine.max_model_len:,}",
        _max_num_seqs(p),
        decode,
        _usd(p.cost.usd_per_hour),
        _usd(p.cost.usd_per_million_tokens),
        _replicas_cost(p),
    ]


# --- Capacity during a NewCluster upgrade (infra/capacity/upgrade.py). ---


@dataclass(frozen=True)
class GroupUpgrade:
    """One GPU group during an upgrade of every model on it, under the stack's ray.upgrade_headroom."""

    group: GroupInput
    need: UpgradeNeed
    cost: UpgradeCost | None


def upgrade_plan(inputs: StackInput) -> list[GroupUpgrade]:
    """Each GPU group that serves a model, during a NewCluster upgrade; none under upgrade_strategy None."""
    if inputs.upgrade_strategy != "NewCluster":
        return []
    out = []
    for group in inputs.groups:
        need = group.upgrade_need(inputs.upgrade_headroom)
        if need.fleets:
            out.append(GroupUpgrade(group, need, upgrade_cost(need, group.capacity_type, inputs.region)))
    return out


def upgrade_line(u: GroupUpgrade) -> str:
    """One line: the GPUs a group holds while an upgrade runs, and what they cost per hour."""
    need = u.need
    cost = (
        "no pinned price"
        if u.cost is None
        else f"{_usd(u.cost.usd_per_hour)}/h while it runs, {_usd(u.cost.extra_usd_per_hour)}/h above the old "
        "cluster alone"
    )
    return (
        f"upgrade headroom {u.group.name} (ray.upgrade_headroom: {need.headroom}): {need.sides()}: "
        f"{need.arithmetic()} of max_size {u.group.max_size}; {cost}"
    )


def _upgrade_output(u: GroupUpgrade) -> dict[str, Any]:
    return {
        "headroom": u.need.headroom,
        "old_gpus": u.need.old_gpus,
        "new_gpus": u.need.new_gpus,
        "gpus": u.need.gpus,
        "nodes": u.need.nodes,
        "max_size": u.group.max_size,
        "usd_per_hour": None if u.cost is None else round(u.cost.usd_per_hour, 4),
        "extra_usd_per_hour": None if u.cost is None else round(u.cost.extra_usd_per_hour, 4),
    }


@dataclass(frozen=True)
class PeakUpgrade:
    """Whether one GPU group places a new cluster for every model while the old ones are at max_replicas."""

    group: str
    fits: bool
    gpus_needed: int
    gpus_available: int
    reason: str


def upgrade_at_peak(inputs: StackInput) -> list[PeakUpgrade]:
    """Per GPU group that serves a model: can an upgrade started with every model at max_replicas place the new fleet?

    Asked under `peak` whatever ray.upgrade_headroom says: under `min` a
    False is the trade-off the stack chose (its new pods wait for the old
    cluster to scale down). Under upgrade_strategy None nothing is replaced,
    so every group fits.
    """
    out = []
    for group in inputs.groups:
        need = group.upgrade_need("peak")
        if not need.fleets:
            continue
        available = group.max_size * need.instance.gpus
        if inputs.upgrade_strategy != "NewCluster":
            reason = "ray.upgrade_strategy None: an upgrade never starts a second cluster"
            out.append(PeakUpgrade(group.name, True, need.old_gpus, available, reason))
            continue
        fits = need.fits(group.max_size)
        verdict = "fits" if fits else "does not fit, the new cluster's pods wait for the old one to scale down"
        reason = (
            f"group '{group.name}' at peak: {need.arithmetic()}, max_size {group.max_size} = {available} GPUs: "
            f"{verdict} (ray.upgrade_headroom: {inputs.upgrade_headroom})"
        )
        out.append(PeakUpgrade(group.name, fits, need.gpus, available, reason))
    return out


def _upgrade_notes(inputs: StackInput) -> list[str]:
    return [upgrade_line(u) for u in upgrade_plan(inputs)]


def _warnings(plans: list[ModelPlan]) -> list[str]:
    return [w for p in plans if (w := preemption_warning(p)) is not None]


def markdown(stack: str, inputs: StackInput, plans: list[ModelPlan]) -> str:
    """The plan as Markdown: a heading, one row per model, the upgrade headroom, and the assumptions."""
    upgrades = _upgrade_notes(inputs)
    lines = [
        f"#### Capacity plan: `{stack}` ({inputs.region})",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row(p)) + " |" for p in plans),
        "",
        "KV tokens (band), what each end assumes:",
        "",
        *(f"- {band_line(p)}" for p in plans),
        "",
        "Workload profile, concurrency and estimates at it:",
        "",
        *(f"- {workload_line(p)}" for p in plans),
        *(f"- {w}" for w in _warnings(plans)),
        "",
        *(["During a NewCluster upgrade of every model:", "", *(f"- {u}" for u in upgrades), ""] if upgrades else []),
        "Estimates, and what they assume:",
        "",
        *(f"- {a}" for a in ASSUMPTIONS),
    ]
    return "\n".join(lines) + "\n"


def text(stack: str, inputs: StackInput, plans: list[ModelPlan]) -> str:
    """The plan as an aligned text table, then the assumptions."""
    rows = [list(COLUMNS), *(row(p) for p in plans)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    upgrades = _upgrade_notes(inputs)
    notes = [f"* {a}" for a in ASSUMPTIONS]
    lines = [
        f"capacity plan: {stack} ({inputs.region})",
        "",
        *table,
        "",
        *(band_line(p) for p in plans),
        "",
        *(workload_line(p) for p in plans),
        *_warnings(plans),
        "",
        *([*upgrades, ""] if upgrades else []),
        *notes,
    ]
    return "\n".join(lines) + "\n"


def preview_line(p: ModelPlan) -> str:
    """One line for the preview's log."""
    r = p.replica
    decode = f"~{p.decode.tokens_per_second:,.0f} output tokens/s" if p.decode else "no decode estimate"
    return (
        f"capacity {p.name}: {_replica(p)} in {p.cost.region}: weights {_gib(r.weight_bytes_per_gpu)}/GPU, "
        f"KV cache {_gib(r.binding.kv_memory_bytes)}/GPU = {r.kv_tokens:,} tokens "
        f"(band {p.kv_band.tokens.low:,}-{p.kv_band.tokens.high:,}) = "
        f"{r.max_model_len_sequences} sequences of {r.engine.max_model_len:,}; max_num_seqs {_max_num_seqs(p)}; "
        f"estimates at the workload profile: {decode}, {_usd(p.cost.usd_per_hour)}/h, "
        f"{_usd(p.cost.usd_per_million_tokens)}/1M output tokens"
    )


def inflight_ratio(p: ModelPlan) -> float:
    """The replica's in-flight cap at the typical sequence, in KV caches (infra/capacity/rules.py bounds it)."""
    return inflight_tokens(p.model.entry, p.replica) / max(1, p.replica.kv_tokens)


def inflight_line(p: ModelPlan) -> str:
    """One line for the preview's log: what the replica's in-flight cap asks of its KV cache."""
    r = p.replica
    cap = p.model.entry.autoscaling.max_ongoing_requests
    running = min(r.planning_sequences, r.max_num_seqs)
    return (
        f"in flight {p.name}: at most {cap} requests per replica (autoscaling.max_ongoing_requests) x "
        f"{r.planning_context_tokens:,} typical tokens = {inflight_tokens(p.model.entry, r):,} tokens, "
        f"{inflight_ratio(p):.1f} x the KV cache's {r.kv_tokens:,} (at most {MAX_INFLIGHT_KV_ROUNDS}): about "
        f"{running} run at once at that length, the rest wait in vLLM's queue"
    )


def _workload_output(at: Concurrency) -> dict[str, Any]:
    w = at.workload
    return {
        "prompt_tokens": {"mean": round(w.prompt.mean, 1), "p95": w.prompt.p95},
        "output_tokens": {"mean": round(w.output.mean, 1), "p95": w.output.p95},
        "source": w.source,
        "allow_preemption": w.allow_preemption,
    }


def _model_output(p: ModelPlan) -> dict[str, Any]:
    r, cost = p.replica, p.cost
    return {
        "model_id": p.model.entry.model_id,
        "gpus": r.engine.world_size,
        "gpu": p.instance.gpu_model,
        "instance_type": p.instance.name,
        "capacity_type": cost.capacity_type,
        "weights_gib_per_gpu": round(r.weight_bytes_per_gpu / GIB, 2),
        "kv_cache_gib_per_gpu": round(r.binding.kv_memory_bytes / GIB, 2),
        "kv_bytes_per_token_per_gpu": r.kv_bytes_per_token,
        "block_size": r.block_size,
        "kv_blocks": r.num_blocks,
        "kv_tokens": r.kv_tokens,
        "kv_tokens_band": {
            "low": p.kv_band.tokens.low,
            "high": p.kv_band.tokens.high,
            "low_assumption": p.kv_band.low_assumption,
            "high_assumption": p.kv_band.high_assumption,
        },
        "gpu_memory_gib": round(r.device.memory_bytes / GIB, 2),
        "max_model_len": r.engine.max_model_len,
        "max_model_len_sequences": r.max_model_len_sequences,
        "workload": _workload_output(p.concurrency),
        "preemption_free_sequences": p.concurrency.preemption_free,
        "sequences_at_mean": p.concurrency.at_mean,
        "recommended_max_num_seqs": p.concurrency.recommended,
        "max_num_seqs": r.max_num_seqs,
        "max_ongoing_requests": p.model.entry.autoscaling.max_ongoing_requests,
        "inflight_kv_ratio": round(inflight_ratio(p), 2),
        "estimated_decode_tokens_per_second": round(p.decode.tokens_per_second) if p.decode else None,
        "usd_per_hour": None if cost.usd_per_hour is None else round(cost.usd_per_hour, 4),
        "estimated_usd_per_million_output_tokens": (
            None if cost.usd_per_million_tokens is None else round(cost.usd_per_million_tokens, 4)
        ),
        "price_as_of": cost.price.as_of if cost.price else None,
    }


def stack_output(inputs: StackInput, plans: list[ModelPlan]) -> dict[str, Any]:
    """The `capacity` stack output: the numbers per model, and the assumptions behind the estimates."""
    return {
        "region": inputs.region,
        "models": {p.name: _model_output(p) for p in plans},
        # Per GPU group, what a NewCluster upgrade of every model holds (none under upgrade_strategy None).
        "upgrade": {u.group.name: _upgrade_output(u) for u in upgrade_plan(inputs)},
        "assumptions": list(ASSUMPTIONS),
    }
