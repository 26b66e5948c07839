"""The `serving.gateway` section: one address for the models of several vllm-server services."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import Field, model_validator

from infra.config.fields import CpuQuantity, MemoryQuantity, Section, dns_label
from infra.config.problems import Problem
from infra.config.routing import Routing
from workloads.inference_server.catalog import Layout

# Prod's gateway survives the loss of a node and a zone, as its routers do.
PROD_MIN_GATEWAY_REPLICAS = 2


class Gateway(Section):
    """One load balancer for every model: the gateway reads each request's `model` and sends it to that model's router.

    Off until `enabled`. Each vllm-server service keeps its own load balancer
    and base URL (the shorter path); the gateway adds one more, named
    `<name>` (and `<name>.<domain>` with `endpoint.domain`), whose
    `/v1/models` lists every model. vllm-router's own multi-model mode can
    not take this place (docs/routing.md says why), so the gateway is ours
    (`workloads/inference_server/gateway.py`).
    """

    enabled: bool = False
    # Its Deployment, Service and host name.
    name: str = "llm-gateway"
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    # The gateway's CPU use the HorizontalPodAutoscaler holds it at.
    target_cpu_utilization: int = Field(default=70, ge=10, le=100)
    cpu: CpuQuantity = "500m"
    memory: MemoryQuantity = "512Mi"

    @model_validator(mode="after")
    def _check(self) -> Gateway:
        dns_label(self.name)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self


def check_gateway(
    gateway: Gateway, routing: Routing, layouts: Mapping[str, Layout], *, is_prod: bool
) -> Iterable[Problem]:
    """The gateway sends to the models' routers: routing on, every service vllm-server, several of them."""
    if not gateway.enabled:
        return
    if not routing.enabled:
        yield Problem(
            "serving.gateway.enabled", "needs serving.routing.enabled: the gateway sends to each model's router"
        )
    others = sorted(service for service, layout in layouts.items() if layout != "vllm-server")
    if others:
        yield Problem(
            "serving.gateway.enabled",
            f"every service must run the vllm-server layout, and {', '.join(others)} runs serve-ingress "
            "(whose own ingress already serves its models at one address)",
        )
    elif len(layouts) < 2:
        yield Problem("serving.gateway.enabled", "one service has one model: its own address already serves it")
    if gateway.name in layouts:
        yield Problem("serving.gateway.name", f"'{gateway.name}' is a service's name too; pick another")
    if is_prod and gateway.min_replicas < PROD_MIN_GATEWAY_REPLICAS:
        yield Problem(
            "serving.gateway.min_replicas",
            f"prod keeps at least {PROD_MIN_GATEWAY_REPLICAS} gateway replicas "
            "(one would be a single point of failure)",
        )
