"""Wires the layers: config -> aws -> platform -> serving -> outputs."""

from __future__ import annotations

import pulumi

from infra.aws.build import build_aws
from infra.capacity.inputs import StackInput
from infra.capacity.report import (
    ModelPlan,
    cold_start_line,
    cold_start_output,
    inflight_line,
    plan_stack,
    preemption_warning,
    preview_line,
    stack_output,
    upgrade_line,
    upgrade_plan,
    workload_line,
)
from infra.cluster_services.build import build_platform
from infra.config import LoadedConfig, StackConfig, capacity_input
from infra.config.routing import recorded_whatif
from infra.serving.build import build_serving


def _log_plans(cfg: StackConfig, inputs: StackInput, capacity: list[ModelPlan]) -> None:
    """The preview's lines, before anything is declared: the capacity plan (one line per model; python -m
    infra.plan shows the same plan), each GPU group's upgrade headroom, the recorded routing what-if."""
    for plan in capacity:
        pulumi.log.info(preview_line(plan))
        pulumi.log.info(workload_line(plan))
        # A max_num_seqs the stack lets preempt (workload.allow_preemption); the config refuses it otherwise.
        warning = preemption_warning(plan)
        if warning is not None:
            pulumi.log.warn(warning)
        pulumi.log.info(inflight_line(plan))
        pulumi.log.info(cold_start_line(plan.model.cold_start))
    # Each GPU group's headroom for a NewCluster upgrade, and its cost while it runs.
    for upgrade in upgrade_plan(inputs):
        pulumi.log.info(upgrade_line(upgrade))
    # The routing what-if recorded for this stack's traffic (checked readable when the config loaded).
    report = cfg.serving.routing.whatif_report
    if report is not None:
        pulumi.log.info(f"routing {recorded_whatif(report)} [{report}]")


def build_stack(loaded: LoadedConfig) -> None:
    """Declare the whole stack and export its outputs."""
    cfg = loaded.stack
    inputs = capacity_input(cfg)
    capacity = plan_stack(inputs)
    _log_plans(cfg, inputs, capacity)
    aws = build_aws(cfg)
    platform = build_platform(cfg, aws)
    serving = build_serving(cfg, loaded.api_keys, aws, platform)

    pulumi.export("endpoint", serving.endpoint)
    pulumi.export("models", serving.models)
    # Each model's own base URL: models in different RayServices sit behind
    # different load balancers.
    pulumi.export(
        "endpoints",
        {model: serving.endpoints[name] for name, models in serving.service_models.items() for model in models},
    )
    # Each model's network load balancer: the name `<service>.<domain>` points
    # at (external-dns writes that record), for checking DNS and the LB apart.
    pulumi.export(
        "load_balancers",
        {model: serving.load_balancers[name] for name, models in serving.service_models.items() for model in models},
    )
    if serving.gateway is not None:
        # Every model at one base URL (serving.gateway); `endpoints` keeps each model's own.
        pulumi.export("gateway_endpoint", serving.gateway)
    pulumi.export("grafana_url", platform.grafana_url)
    pulumi.export("ray_dashboard", serving.ray_dashboards)
    pulumi.export("image", aws.image)
    pulumi.export("cluster_name", aws.cluster_name)
    if aws.kubeconfig is not None:
        pulumi.export("kubeconfig", pulumi.Output.secret(aws.kubeconfig))
    pulumi.export("model_bucket", aws.model_bucket)
    pulumi.export("node_groups", aws.node_group_names)
    # What each model's replica holds and costs, with the assumptions behind the estimates.
    pulumi.export("capacity", stack_output(inputs, capacity))
    # Each model's cold-start budget on a new node, phase by phase, and the figures behind it.
    pulumi.export("cold_start", cold_start_output(inputs))
    if aws.batch_queue is not None:
        pulumi.export("batch_queue_url", aws.batch_queue.url)
        pulumi.export("batch_dead_letter_queue_url", aws.batch_queue.dead_letter_url)
        pulumi.export(
            "batch_results",
            pulumi.Output.concat("s3://", aws.batch_queue.results_bucket, "/", aws.batch_queue.results_prefix),
        )
