"""What the serving layer hands to the stack outputs."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi


@dataclass(frozen=True)
class ServingLayer:
    """Endpoints and identifiers users read from the stack outputs."""

    endpoint: pulumi.Output[str]  # the OpenAI base URL, ending in /v1
    models: list[str]  # served model ids
    ray_dashboards: dict[str, str]  # RayService name -> how to reach its dashboard
