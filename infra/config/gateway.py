"""The `serving.gateway` section: one address for the models of several vllm-server services."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from pydantic import Field, model_validator

from infra.config.fields import CpuQuantity, MemoryQuantity, Section, dns_label
from infra.config.problems import Problem
from infra.config.routing import Routing
from workloads.inference_server.catalog import Layout

# Prod's gateway survives the loss of a node and a zone, as its routers do.
PROD_MIN_GATEWAY_REPLICAS = 2
# AWS's Network Load Balancer closes a TCP connection idle this long (its
# default tcp.idle_timeout.seconds); a held request sends nothing, so it must
# be answered before then, with room to spare.
NLB_IDLE_TIMEOUT_S = 350
WAKE_HOLD_MARGIN_S = 10


class Gateway(Section):
    """One load balancer for every model: the gateway reads each request's `model` and sends it to that model's router.

    Off until `enabled`. Each vllm-server service keeps its own load balancer
    and base URL (the shorter path); the gateway adds one more, named
    `<name>` (and `<name>.<domain>` with `endpoint.domain`), whose
    `/v1/models` lists every model. vllm-router's own multi-model mode can
    not take this place (docs/routing.md says why), so the gateway is ours
    (`workloads/inference_server/gateway.py`).

    It is also what wakes a vllm-server model at `min_replicas: 0`: its
    first request is held while a replica starts (`wake_hold_seconds`, at
    most `wake_max_held` at once), then answered, or refused with a 503
    whose Retry-After is what is left of the model's cold-start budget.
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
    # The longest a request for a model at zero replicas is held while it wakes.
    wake_hold_seconds: int = Field(default=300, ge=1)
    # Requests held at once per model and gateway replica; more get the 503 at once.
    wake_max_held: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _check(self) -> Gateway:
        dns_label(self.name)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self


def check_gateway(
    gateway: Gateway,
    routing: Routing,
    layouts: Mapping[str, Layout],
    *,
    is_prod: bool,
    scales_to_zero: Collection[str] = (),
) -> Iterable[Problem]:
    """The gateway sends to the models' routers: routing on, every service vllm-server, several of them
    (or one that scales to zero, which only the gateway wakes)."""
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
    elif len(layouts) < 2 and not scales_to_zero:
        yield Problem(
            "serving.gateway.enabled",
            "one service has one model that never scales to zero: its own address already serves it",
        )
    longest = NLB_IDLE_TIMEOUT_S - WAKE_HOLD_MARGIN_S
    if gateway.wake_hold_seconds > longest:
        yield Problem(
            "serving.gateway.wake_hold_seconds",
            f"{gateway.wake_hold_seconds}s is longer than {longest}s: the load balancer closes a connection idle "
            f"for {NLB_IDLE_TIMEOUT_S}s, and a held request sends nothing",
        )
    if gateway.name in layouts:
        yield Problem("serving.gateway.name", f"'{gateway.name}' is a service's name too; pick another")
    if is_prod and gateway.min_replicas < PROD_MIN_GATEWAY_REPLICAS:
        yield Problem(
            "serving.gateway.min_replicas",
            f"prod keeps at least {PROD_MIN_GATEWAY_REPLICAS} gateway replicas "
            "(one would be a single point of failure)",
        )
