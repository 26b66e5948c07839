"""The capacity plan of a whole stack: a table, Markdown, one preview line per model, and the stack output.

Shown by `python -m infra.plan`, printed by the program during `pulumi
preview`, exported as the `capacity` stack output, and added to the pull
request's preview comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.capacity import cold_start
from infra.capacity.cost import ROOFLINE, Cost, Decode, decode_estimate, replica_cost
from infra.capacity.geometry import resolve_geometry
from infra.capacity.plan import (
    GIB,
    OVERHEADS,
    Device,
    EngineSettings,
    ReplicaPlan,
    plan_replica,
)
from infra.capacity.prices import ON_DEMAND_AS_OF, ON_DEMAND_SOURCE, SPOT_AS_OF, SPOT_SOURCE
from infra.config import Model, StackConfig, model_cold_start
from infra.instance_types import GpuInstanceType

MEMORY = "GPU memory is the datasheet's GB (10^9 bytes); GiB = 2^30 bytes"
PRICES = (
    f"prices pinned in infra/capacity/prices.py: on-demand {ON_DEMAND_SOURCE}, {ON_DEMAND_AS_OF}; "
    f"spot {SPOT_SOURCE}, {SPOT_AS_OF}"
)
ASSUMPTIONS = (OVERHEADS, ROOFLINE, PRICES, MEMORY)
COLUMNS = (
    "model",
    "replica",
    "weights / GPU",
    "KV cache / GPU",
    "KV / token / GPU",
    "KV tokens",
    "max_model_len seqs",
    "max_num_seqs",
    "decode (est.)",
    "$/h (replica)",
    "$/1M out (est.)",
    "$/h (min-max replicas)",
)


@dataclass(frozen=True)
class ModelPlan:
    """One model's plan: its replica, decode estimate and cost, and the replicas it scales between."""

    model: Model
    instance: GpuInstanceType
    replica: ReplicaPlan
    decode: Decode | None
    cost: Cost

    @property
    def name(self) -> str:
        """The model's name in the stack."""
        return self.model.name


def plan_model(cfg: StackConfig, model: Model) -> ModelPlan:
    """The plan of one model of a validated stack (its rules ensure a geometry and a usable group)."""
    geometry = resolve_geometry(model.geometry, model.source, model.model_id)
    if geometry is None:
        raise ValueError(f"model '{model.name}' has no geometry (the config rules refuse it)")
    group = cfg.node_groups.gpu_group(model.gpu_group)
    instance = group.instance()
    replica = plan_replica(geometry, model.parameters_billion, EngineSettings.of(model), Device.of(instance))
    decode = decode_estimate(replica)
    cost = replica_cost(replica, instance, group.capacity_type, cfg.region, decode)
    return ModelPlan(model, instance, replica, decode, cost)


def cold_start_budget(cfg: StackConfig, model: Model) -> cold_start.ColdStart:
    """A model's cold-start budget on its group's instance type (infra/capacity/cold_start.py)."""
    return model_cold_start(cfg, model, cfg.node_groups.gpu_group(model.gpu_group))


def cold_start_line(budget: cold_start.ColdStart) -> str:
    """One line for the preview's log: the budget and its phases."""
    return (
        f"cold start {budget.model}: {budget.total:.0f} s budget on a new {budget.instance} node "
        f"({cold_start.describe(budget)})"
    )


def cold_start_output(cfg: StackConfig) -> dict[str, Any]:
    """The `cold_start` stack output: each model's budget and the pinned figures behind it."""
    return {
        "models": {m.name: cold_start.output(cold_start_budget(cfg, m)) for m in cfg.models},
        "figures": cold_start.sources(),
    }


def plan_stack(cfg: StackConfig) -> list[ModelPlan]:
    """Every model's plan, in config order."""
    return [plan_model(cfg, m) for m in cfg.models]


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def _usd(value: float | None) -> str:
    return "no pinned price" if value is None else f"${value:,.2f}"


def _replica(p: ModelPlan) -> str:
    kind = p.cost.capacity_type.replace("_", "-")
    return f"{p.replica.engine.world_size} x {p.instance.gpu_model} ({p.instance.name}, {kind})"


def _max_num_seqs(r: ReplicaPlan) -> str:
    now = f"set {r.engine.max_num_seqs}" if r.engine.max_num_seqs else f"vLLM default {r.default_max_num_seqs}"
    return f"{r.recommended_max_num_seqs} recommended ({now})"


def _replicas_cost(p: ModelPlan) -> str:
    hourly = p.cost.usd_per_hour
    if hourly is None:
        return "no pinned price"
    low, high = p.model.autoscaling.min_replicas, p.model.autoscaling.max_replicas
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
        f"{r.kv_tokens:,}",
        f"{r.max_model_len_sequences} x {r.engine.max_model_len:,}",
        _max_num_seqs(r),
        decode,
        _usd(p.cost.usd_per_hour),
        _usd(p.cost.usd_per_million_tokens),
        _replicas_cost(p),
    ]


def markdown(stack: str, cfg: StackConfig, plans: list[ModelPlan]) -> str:
    """The plan as Markdown: a heading, one row per model, and the assumptions behind the estimates."""
    lines = [
        f"#### Capacity plan: `{stack}` ({cfg.region})",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row(p)) + " |" for p in plans),
        "",
        "Estimates, and what they assume:",
        "",
        *(f"- {a}" for a in ASSUMPTIONS),
    ]
    return "\n".join(lines) + "\n"


def text(stack: str, cfg: StackConfig, plans: list[ModelPlan]) -> str:
    """The plan as an aligned text table, then the assumptions."""
    rows = [list(COLUMNS), *(row(p) for p in plans)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    notes = [f"* {a}" for a in ASSUMPTIONS]
    return "\n".join([f"capacity plan: {stack} ({cfg.region})", "", *table, "", *notes]) + "\n"


def preview_line(p: ModelPlan) -> str:
    """One line for the preview's log."""
    r = p.replica
    decode = f"~{p.decode.tokens_per_second:,.0f} output tokens/s" if p.decode else "no decode estimate"
    return (
        f"capacity {p.name}: {_replica(p)} in {p.cost.region}: weights {_gib(r.weight_bytes_per_gpu)}/GPU, "
        f"KV cache {_gib(r.binding.kv_memory_bytes)}/GPU = {r.kv_tokens:,} tokens = "
        f"{r.max_model_len_sequences} sequences of {r.engine.max_model_len:,}; max_num_seqs {_max_num_seqs(r)}; "
        f"estimates: {decode}, {_usd(p.cost.usd_per_hour)}/h, {_usd(p.cost.usd_per_million_tokens)}/1M output tokens"
    )


def _model_output(p: ModelPlan) -> dict[str, Any]:
    r, cost = p.replica, p.cost
    return {
        "model_id": p.model.model_id,
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
        "max_model_len": r.engine.max_model_len,
        "max_model_len_sequences": r.max_model_len_sequences,
        "recommended_max_num_seqs": r.recommended_max_num_seqs,
        "max_num_seqs": r.max_num_seqs,
        "estimated_decode_tokens_per_second": round(p.decode.tokens_per_second) if p.decode else None,
        "usd_per_hour": None if cost.usd_per_hour is None else round(cost.usd_per_hour, 4),
        "estimated_usd_per_million_output_tokens": (
            None if cost.usd_per_million_tokens is None else round(cost.usd_per_million_tokens, 4)
        ),
        "price_as_of": cost.price.as_of if cost.price else None,
    }


def stack_output(cfg: StackConfig, plans: list[ModelPlan]) -> dict[str, Any]:
    """The `capacity` stack output: the numbers per model, and the assumptions behind the estimates."""
    return {
        "region": cfg.region,
        "models": {p.name: _model_output(p) for p in plans},
        "assumptions": list(ASSUMPTIONS),
    }
