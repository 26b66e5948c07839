"""A validated stack as the capacity plan reads it (infra/capacity/inputs.py): plain values, no config model."""

from __future__ import annotations

from infra.capacity.inputs import GroupInput, ModelInput, StackInput
from infra.config.cold_start import cold_start_budget
from infra.config.rules import upgrade_need
from infra.config.stack import StackConfig


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
