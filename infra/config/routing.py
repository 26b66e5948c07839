"""The `serving.routing` section: a request-level router in front of each vllm-server service's replicas."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from infra.config.fields import CpuQuantity, MemoryQuantity, Section
from infra.config.problems import Problem
from workloads.inference_server.catalog import Layout

# The policies of vllm-router (the release workloads/requirements.txt pins)
# offered here. `consistent_hash` keeps every request that carries the same
# routing key (`X-Session-ID`: the client names its shared prefix or its
# conversation) on one replica, by a hash ring over the replicas' addresses,
# so every router replica sends a key to the same place. Not offered:
# `kv_aware` needs vLLM's KV events over ZMQ; `sticky_least_loaded` keeps
# its key-to-replica table in each router process, so prod's two routers
# would place a key twice (it measured the same hit rate as consistent_hash
# on one router); `random` is round_robin without the even split.
RoutingPolicy = Literal["cache_aware", "consistent_hash", "power_of_two", "round_robin"]
# The header consistent_hash takes its key from. On the pinned release it is
# read on every route (tests/test_router_affinity.py); a `user` field in a
# /v1/completions body was not (the router hashed the whole body, so each
# prompt went its own way).
ROUTING_KEY_HEADER = "X-Session-ID"

# Prod's router survives the loss of a node and a zone: two replicas, spread.
PROD_MIN_ROUTER_REPLICAS = 2
# A recorded what-if report (benchmarks/whatif.py writes it) holds its one-line result under this key.
WHATIF_SUMMARY = "summary"
# A relative `whatif_report` is read from the project's root, wherever the program runs from.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class CircuitBreaker(Section):
    """vllm-router's circuit breaker per replica (off unless `enabled`): a replica that fails this many
    attempts within the window gets nothing for `open_s`, then is tried again.

    Off by default: measured on the pinned release (tests/test_router_failures.py),
    a request that makes the replicas answer 500 (a "query of death") opens
    the circuit of every replica it is tried on, so a client repeating it
    takes the whole model out for `open_s`: with the release's own settings
    (5 attempts, 10 failures), a model with one replica answers 503 to
    everyone after two such requests. The router's own health
    checks and the pods' readiness already take a replica whose server fails
    `/health` out of rotation; the breaker adds only the replica that passes
    `/health` and fails requests, which the replicas' 5xx alert reports.
    """

    enabled: bool = False
    # The values default to the pinned release's own.
    failures: int = Field(default=10, ge=1)
    window_s: int = Field(default=120, ge=1)
    open_s: int = Field(default=60, ge=1)
    # Good attempts, after `open_s`, that close it again.
    close_after: int = Field(default=3, ge=1)


# Most attempts a request may be given: every one of them is a prefill on a replica.
MAX_ATTEMPTS = 5


class Routing(Section):
    """vllm-router in front of the replicas of every vllm-server service (off until `enabled`).

    With it the load balancer sends each connection to a router, and the
    router sends each request to a replica: by prefix-cache affinity
    (`cache_aware`: the replica whose cache holds the longest match of the
    prompt, unless the load is out of balance; `consistent_hash`: the
    replica the request's routing key hashes to), by the shorter of two
    queues (`power_of_two`), or in turn (`round_robin`). Without it the load
    balancer sends connections straight to the replicas.
    """

    enabled: bool = False
    # round_robin by default, for ordinary chat traffic: measured on
    # vllm-router 0.1.17 (docs/routing.md), the policies that weigh cache or
    # load send a request to the first replica on a tie, and ties are common
    # below saturation. cache_aware (which matches prompts by the token ids
    # the replicas' render routes give it) then piles new prefixes on one
    # replica: on vLLM's prefix_repetition trace its fleet hit rate was 1.58x
    # round robin's, with a 54/234 split; on prompts that share nothing it
    # only concentrates load. power_of_two sent 105/15 and 116/4 of one
    # keep-alive client's 120 whole answers to two replicas; on streamed
    # requests it follows the load. round_robin split every run 60/60.
    # consistent_hash pays only for clients that send a routing key (a
    # request without one is hashed whole, so it goes anywhere): with vLLM's
    # prefix_repetition trace keyed by prefix, 2.04x round robin's hit rate.
    # `make whatif` shows each on your traffic.
    policy: RoutingPolicy = "round_robin"
    # The cache_aware settings default to vllm-router's own (router_args.py).
    # cache_aware: the share of a prompt a replica's cache must match for the
    # prompt to go there; below it, the replica with the smallest cache takes it.
    cache_threshold: float = Field(default=0.3, ge=0, le=1)
    # cache_aware: balance by load instead of cache when the busiest replica
    # has more than `balance_abs_threshold` requests over the idlest AND more
    # than `balance_rel_threshold` times its count.
    balance_abs_threshold: int = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    # The router's CPU use the HorizontalPodAutoscaler holds it at.
    target_cpu_utilization: int = Field(default=70, ge=10, le=100)
    # The router's CPU request: also its runtime's worker threads, one per
    # core (infra/serving/router.py, RUNTIME_THREADS_ENV).
    cpu: CpuQuantity = "1"
    memory: MemoryQuantity = "1Gi"
    # Requests a router holds when every replica is at its concurrency cap,
    # and for how long, before answering 429.
    queue_size: int = Field(default=256, ge=0)
    queue_timeout_s: int = Field(default=30, ge=1)
    # Attempts a request gets in all, the first included: an attempt answered
    # 5xx or 429, or whose connection is cut or refused, is tried again, on
    # another replica where there is one (4xx never). 2 by default: measured
    # on the pinned release (tests/test_router_failures.py), under
    # round_robin the second attempt reaches the other replica, so a replica
    # that fails every request costs the client nothing, while a request that
    # makes replicas fail reaches two, not the release's default of five.
    # (consistent_hash and cache_aware send every attempt to the same
    # replica; power_of_two picks afresh: docs/routing.md.)
    attempts: int = Field(default=2, ge=1, le=MAX_ATTEMPTS)
    circuit_breaker: CircuitBreaker = CircuitBreaker()
    # A what-if report `make whatif` recorded for this stack's traffic
    # (build/whatif/<stack>.json, or a copy kept beside the stack file), from
    # the project's root: `pulumi preview` and `up` print its one-line result.
    whatif_report: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_bounds(self) -> Routing:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self


def recorded_whatif(report: str) -> str:
    """The one-line result of a recorded what-if report; ValueError saying what is wrong with the file."""
    path = PROJECT_ROOT / report
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{report} does not exist (make whatif STACK=<stack> writes build/whatif/<stack>.json)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{report} is not a what-if report: {type(err).__name__}") from None
    summary = body.get(WHATIF_SUMMARY) if isinstance(body, dict) else None
    if not isinstance(summary, str) or not summary.strip() or "\n" in summary:
        raise ValueError(f"{report} is not a what-if report: no one-line `{WHATIF_SUMMARY}`")
    return summary


def check_routing(routing: Routing, layouts: Mapping[str, Layout], *, is_prod: bool) -> Iterable[Problem]:
    """A router needs a vllm-server service to front; prod's survives a node; a named what-if report reads."""
    if routing.whatif_report is not None:
        try:
            recorded_whatif(routing.whatif_report)
        except ValueError as err:
            yield Problem("serving.routing.whatif_report", str(err))
    if not routing.enabled:
        return
    if "vllm-server" not in layouts.values():
        yield Problem(
            "serving.routing.enabled",
            "no service runs the vllm-server layout, the only one the router fronts (serve-ingress routes in Serve)",
        )
    if is_prod and routing.min_replicas < PROD_MIN_ROUTER_REPLICAS:
        yield Problem(
            "serving.routing.min_replicas",
            f"prod keeps at least {PROD_MIN_ROUTER_REPLICAS} router replicas (one would be a single point of failure)",
        )
