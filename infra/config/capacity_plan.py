"""A validated stack as the capacity plan reads it (infra/capacity/inputs.py): plain values, no config model."""

from __future__ import annotations

from infra.capacity.inputs import GroupInput, ModelInput, StackInput
from infra.capacity.report import plan_stack
from infra.config.cold_start import cold_start_budget
from infra.config.rules import upgrade_need
from infra.config.stack import StackConfig
from infra.config.workload import workload_profile


def capacity_input(cfg: StackConfig) -> StackInput:
    """The models, GPU groups and upgrade settings of a validated stack, for infra/capacity/report.py."""
    groups = tuple(
        GroupInput(
            name=g.name,
            instance=g.instance(),
            capacity_type=g.capacity_type,
            max_size=g.max_size,
            fleets=upgrade_need(cfg, g).fleets,
        )
        for g in cfg.node_groups.gpu
    )
    # A model runs on the first group of its name, as NodeGroups.gpu_group finds it.
    by_name = {g.name: g for g in reversed(groups)}
    models = tuple(
        ModelInput(
            name=m.name,
            entry=m,
            parameters_billion=m.parameters_billion,
            geometry=m.geometry,
            group=by_name[m.gpu_group],
            cold_start=cold_start_budget(cfg, m),
            workload=workload_profile(m.workload, m.max_model_len, cfg.serving.limits),
        )
        for m in cfg.models
    )
    return StackInput(
        region=cfg.region,
        models=models,
        groups=groups,
        upgrade_strategy=cfg.ray.upgrade_strategy,
        upgrade_headroom=cfg.ray.upgrade_headroom,
    )


def preemption_free_sequences(cfg: StackConfig) -> dict[str, int]:
    """Model id -> the plan's preemption-free load, for each model whose workload allows preemption.

    What the serving alerts compare running sequences with: any other model
    keeps max_num_seqs within that load (the preemption rule), so its
    replicas never run more.
    """
    return {
        p.model.entry.model_id: p.concurrency.preemption_free
        for p in plan_stack(capacity_input(cfg))
        if p.model.workload.allow_preemption
    }
