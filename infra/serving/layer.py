"""What the serving layer hands to the stack outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi


@dataclass(frozen=True)
class ServingLayer:
    """Endpoints and identifiers users read from the stack outputs."""

    endpoint: pulumi.Output[str]  # the OpenAI base URL, ending in /v1
    models: list[str]  # served model ids
    ray_dashboards: dict[str, str]  # RayService name -> how to reach its dashboard
    # RayService name -> its own OpenAI base URL (one load balancer each).
    endpoints: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    # RayService name -> the model ids it serves.
    service_models: dict[str, list[str]] = field(default_factory=dict)
    # RayService name -> its network load balancer's DNS name.
    load_balancers: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    # The model gateway's OpenAI base URL (every model at one address), when `serving.gateway` is on.
    gateway: pulumi.Output[str] | None = None
