"""The `serving` section: the namespace, the request limits, the layout and the ingress, with the rules on each."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from infra.config.fields import K8sName, Section
from infra.config.gateway import Gateway
from infra.config.models import Model
from infra.config.observability import Slo
from infra.config.problems import Problem
from infra.config.routing import Routing
from workloads.inference_server.catalog import IngressScaling, KeyFairness, RequestLimits


class Serving(Section):
    """The namespace the models run in and the limits every request obeys."""

    namespace: K8sName = "llm"
    limits: RequestLimits = RequestLimits()
    # How requests reach the engines of each RayService (catalog.Layout).
    # `auto` picks vllm-server wherever a service can use it (see
    # `vllm_server_problem`): it skips Serve's per-chunk hops, so it is the
    # faster path; the rest stay on serve-ingress.
    layout: Literal["auto", "vllm-server", "serve-ingress"] = "auto"
    # Serve LLM's OpenAI ingress; only serve-ingress services have one, so a
    # vllm-server service ignores this section.
    ingress: IngressScaling = IngressScaling()
    allow_hub_download: bool = False
    # What one API key may hold of a replica (inference_server.fairness);
    # the batch worker's own key is held to batch.messages_per_worker unless
    # `per_key` names it.
    fairness: KeyFairness = KeyFairness()
    # A request-level router in front of the vllm-server services (off by default).
    routing: Routing = Routing()
    # One address for the models of several vllm-server services (off by default).
    gateway: Gateway = Gateway()

    @property
    def wakes_from_zero(self) -> bool:
        """Whether something in the vllm-server path wakes a model at zero: the gateway, in front of the routers."""
        return self.routing.enabled and self.gateway.enabled


def vllm_server_problem(models: list[Model], *, woken: bool = False) -> str | None:
    """Why a RayService serving `models` can not use the vllm-server layout, or None.

    The rules the server's catalogue enforces (catalog.Catalog), stated here
    so a config fails at preview with its key instead: the load balancer can
    not route on a request's `model` field (one model per service), and a
    replica is one pod. And one the catalogue can not see: a model at zero
    replicas needs something in its path that wakes it, which only the model
    gateway does (`woken`: `serving.gateway` and `serving.routing` on).
    """
    if len(models) != 1:
        return f"it serves exactly one model per service (service '{models[0].service_name}' has {len(models)})"
    (model,) = models
    if model.autoscaling.min_replicas < 1 and not woken:
        return (
            f"model '{model.name}' needs autoscaling.min_replicas >= 1, or serving.gateway and serving.routing "
            "enabled (only the gateway wakes a vllm-server model from zero)"
        )
    if model.pipeline_parallel_size != 1:
        return f"model '{model.name}' needs pipeline_parallel_size 1 (a replica must fit in one pod)"
    return None


def check_layout(serving: Serving, services: Iterable[list[Model]]) -> Iterable[Problem]:
    """`vllm-server` set outright holds for every RayService (`auto` falls back per service instead)."""
    if serving.layout != "vllm-server":
        return
    problems = [p for p in (vllm_server_problem(m, woken=serving.wakes_from_zero) for m in services) if p]
    if problems:
        yield Problem("serving.layout", f"vllm-server: {'; '.join(problems)}; use auto or serve-ingress")


# Prod's OpenAI ingress survives the loss of a node: two replicas on two nodes.
PROD_MIN_INGRESS_REPLICAS = 2


def check_ingress(ingress: IngressScaling, *, is_prod: bool) -> Iterable[Problem]:
    """Prod's OpenAI ingress has replicas on more than one node."""
    if is_prod and ingress.min_replicas < PROD_MIN_INGRESS_REPLICAS:
        yield Problem(
            "serving.ingress.min_replicas",
            f"prod keeps at least {PROD_MIN_INGRESS_REPLICAS} ingress replicas "
            "(one would be a single point of failure)",
        )
    if is_prod and ingress.max_replicas_per_node > 1:
        yield Problem(
            "serving.ingress.max_replicas_per_node",
            "prod spreads ingress replicas one per node (more would share a node's fate)",
        )


def check_limits(limits: RequestLimits, models: list[Model]) -> Iterable[Problem]:
    """A prompt the server accepts leaves every model room to answer."""
    limit = limits.max_prompt_tokens
    short = [f"'{m.name}' ({m.max_model_len})" for m in models if limit >= m.max_model_len]
    if short:
        yield Problem(
            "serving.limits.max_prompt_tokens",
            f"{limit} is not below the max_model_len of {', '.join(short)}: a prompt the server accepts "
            "would leave the model no room to answer",
        )
    # The prompts of one request together (a /v1/completions batch) never
    # cost more prefill than one prompt at the model's full context.
    total = limits.max_request_prompt_tokens
    if total is not None:
        over = [f"'{m.name}' ({m.max_model_len})" for m in models if total > m.max_model_len]
        if over:
            yield Problem(
                "serving.limits.max_request_prompt_tokens",
                f"{total} exceeds the max_model_len of {', '.join(over)}: one request's prompts together would "
                "cost more prefill than a single prompt at the model's full context",
            )


def longest_generation(limits: RequestLimits, slo: Slo) -> float:
    """The longest request the limits allow, at the SLO: first token, then max_tokens tokens at the p95 pace."""
    return slo.ttft_p95_seconds + limits.max_tokens * slo.inter_token_p95_seconds
