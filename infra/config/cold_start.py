"""The cold-start rule: every timeout on a cold start's path outlasts the part of the model's budget it covers.

Across sections: the timeouts are `ray.cold_start`'s and cluster-autoscaler's
(`autoscaling.cluster`), the budget is the model's on its GPU group
(infra/capacity/cold_start.py), and a pre-scale window's lead time covers
the slowest model of its group.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.capacity.cold_start import (
    ColdStart,
    Timeout,
    checkpoint_copies_per_node,
    cold_start,
    ranks_per_node,
    streams_distributed,
    timeout_problems,
)
from infra.capacity.plan import GIB
from infra.config.fields import duration_seconds
from infra.config.models import Model
from infra.config.node_groups import GpuNodeGroupSettings, usable_group
from infra.config.problems import Problem
from infra.config.stack import StackConfig
from infra.instance_types import GpuInstanceType

# Pulumi's default wait for a RayService's Ready (infra/serving/ray_service.py):
# big models stream tens of GiB and compile longer.
PULUMI_WAIT_BIG_MODEL_GIB = 40.0
PULUMI_WAIT_SMALL_SECONDS = 1800
PULUMI_WAIT_BIG_SECONDS = 3600


def pulumi_wait_seconds(cfg: StackConfig, models: list[Model]) -> int:
    """Pulumi's wait for a RayService of `models`: `ray.cold_start.pulumi_wait_seconds`, else by the biggest model."""
    configured = cfg.ray.cold_start.pulumi_wait_seconds
    if configured is not None:
        return configured
    biggest = max(m.weights_gib() for m in models)
    return PULUMI_WAIT_BIG_SECONDS if biggest >= PULUMI_WAIT_BIG_MODEL_GIB else PULUMI_WAIT_SMALL_SECONDS


def _cold_start_timeouts(cfg: StackConfig, model: Model) -> list[Timeout]:
    """The timeouts a cold start of `model` runs under, each with the part of the budget it covers."""
    t, key = cfg.ray.cold_start, "ray.cold_start"
    service = [m for m in cfg.models if m.service_name == model.service_name]
    return [
        Timeout(
            f"{key}.autoscaler_allocate_seconds",
            t.autoscaler_allocate_seconds,
            "to_ray_up",
            "the Ray autoscaler's allocate timeout",
        ),
        Timeout(
            f"{key}.autoscaler_ray_install_seconds",
            t.autoscaler_ray_install_seconds,
            "to_ray_up",
            "the Ray autoscaler's ray-install timeout",
        ),
        Timeout(
            f"{key}.engine_start_seconds", t.engine_start_seconds, "in_container", "Serve LLM's engine start timeout"
        ),
        Timeout(f"{key}.pulumi_wait_seconds", pulumi_wait_seconds(cfg, service), "total", "Pulumi's wait for Ready"),
        Timeout(
            "autoscaling.cluster.max_node_provision_time",
            duration_seconds(cfg.autoscaling.cluster.max_node_provision_time),
            "node_ready",
            "cluster-autoscaler's node provision time",
        ),
        # KubeRay's probes are not here: the liveness probe it injects checks
        # the raylet (up within Ray start, inside its 630 s window) and the
        # readiness probe only holds the pod out of the Service, so neither
        # ends a slow engine start (tests/test_cold_start.py checks the window).
    ]


def checkpoint_copies(model: Model, instance: GpuInstanceType) -> int:
    """How many times each node of a replica reads the checkpoint: once, unless its S3 ranks stream undistributed.

    The streamer settings are the stack's own when it sets them, else the
    platform's (infra/serving/serve_config.py), which stream distributed
    whenever a node holds more than one of the replica's ranks.
    """
    if model.weights_kind != "s3":
        return 1
    ranks = ranks_per_node(model.num_devices, instance.gpus)
    streamer = model.streamer
    distributed = streamer.distributed if streamer is not None else streams_distributed(ranks)
    return checkpoint_copies_per_node(ranks, distributed)


def model_cold_start(cfg: StackConfig, model: Model, group: GpuNodeGroupSettings) -> ColdStart:
    """A model's cold-start budget on its group (infra/capacity/cold_start.py)."""
    instance = group.instance()
    eager = str(model.engine_overrides.get("enforce_eager", False)).lower() == "true"
    weight_bytes = model.weights_gib() * GIB
    copies = checkpoint_copies(model, instance)
    return cold_start(model.name, instance, weight_bytes, copies, model.tensor_parallel_size, eager)


def cold_start_budget(cfg: StackConfig, model: Model) -> ColdStart:
    """A model's cold-start budget on its group's instance type (infra/capacity/cold_start.py)."""
    return model_cold_start(cfg, model, cfg.node_groups.gpu_group(model.gpu_group))


def check_cold_start(cfg: StackConfig, groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    """No timeout on a cold start's path is shorter than the part of the model's budget it covers."""
    budgets: dict[str, ColdStart] = {}
    for model in cfg.models:
        group = groups.get(model.gpu_group)
        if group is None or not usable_group(group):
            continue
        budget = budgets[model.name] = model_cold_start(cfg, model, group)
        for key, message in timeout_problems(budget, _cold_start_timeouts(cfg, model)):
            yield Problem(key, message)
    for i, window in enumerate(cfg.autoscaling.prescale):
        on_group = [budgets[m.name] for m in cfg.models if m.gpu_group == window.gpu_group and m.name in budgets]
        if not on_group:
            continue
        longest = max(on_group, key=lambda b: b.total)
        lead = Timeout(
            f"autoscaling.prescale[{i}].lead_seconds", window.lead_seconds, "total", "the pre-scale lead time"
        )
        for key, message in timeout_problems(longest, [lead]):
            yield Problem(key, message)
