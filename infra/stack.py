"""Wires the layers: config -> aws -> platform -> serving -> outputs."""

from __future__ import annotations

import pulumi

from infra.aws.build import build_aws
from infra.cluster_services.build import build_platform
from infra.config import LoadedConfig
from infra.serving.build import build_serving


def build_stack(loaded: LoadedConfig) -> None:
    """Declare the whole stack and export its outputs."""
    cfg = loaded.stack
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
    pulumi.export("grafana_url", platform.grafana_url)
    pulumi.export("ray_dashboard", serving.ray_dashboards)
    pulumi.export("image", aws.image)
    pulumi.export("cluster_name", aws.cluster_name)
    if aws.kubeconfig is not None:
        pulumi.export("kubeconfig", pulumi.Output.secret(aws.kubeconfig))
    pulumi.export("model_bucket", aws.model_bucket)
    pulumi.export("node_groups", aws.node_group_names)
    if aws.batch_queue is not None:
        pulumi.export("batch_queue_url", aws.batch_queue.url)
        pulumi.export("batch_dead_letter_queue_url", aws.batch_queue.dead_letter_url)
        pulumi.export(
            "batch_results",
            pulumi.Output.concat("s3://", aws.batch_queue.results_bucket, "/", aws.batch_queue.results_prefix),
        )
