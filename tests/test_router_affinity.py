"""Keyed affinity on the pinned router: a routing key keeps its replica, and the keys spread over the replicas.

`serving.routing.policy: consistent_hash` promises that every request a
client sends with the same `X-Session-ID` (naming its shared prefix or its
conversation) reaches the same replica, whose prefix cache then holds it,
and that different keys spread over the replicas. That promise is vllm-router's,
so it is checked here on the release the image pins: the router runs the
command the render gives a prod stack with that policy (discovery swapped
for two stand-in replicas that record the key of each request they answer).
"""

from __future__ import annotations

import collections
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from typing_extensions import override

from infra.config.routing import ROUTING_KEY_HEADER, RoutingPolicy
from tests.e2e.loopback_http import LoopbackHttp, SlowReplica, answer
from tests.harness import prod_router_spec
from twin.routing import RouterSpec, start_router

# An odd count, so that a policy that takes the replicas in turn moves every key between rounds.
KEYS = [f"template-{i}" for i in range(13)]
ROUNDS = 4


def recording_replica(log: list[str | None]) -> type[BaseHTTPRequestHandler]:
    """A replica's server as the router sees it: healthy, answering each completion at once, noting its key."""

    class Replica(SlowReplica):
        @override
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            log.append(self.headers.get(ROUTING_KEY_HEADER))
            answer(self, 200, json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode())

    return Replica


def spec_for(tmp_path: Path, policy: str) -> RouterSpec:
    """The router the render gives prod with `serving.routing.policy: <policy>`."""
    return prod_router_spec(tmp_path / policy, {"enabled": True, "min_replicas": 2, "policy": policy})


def command_for(tmp_path: Path, policy: str) -> tuple[str, ...]:
    """The router command the render gives prod with `serving.routing.policy: <policy>`."""
    return spec_for(tmp_path, policy).command


@pytest.mark.parametrize("policy", get_args(RoutingPolicy))
def test_every_policy_the_config_offers_is_one_the_pinned_router_parses(tmp_path: Path, policy: str) -> None:
    import argparse

    from vllm_router.router_args import RouterArgs

    command = command_for(tmp_path, policy)
    parser = argparse.ArgumentParser(exit_on_error=False)
    RouterArgs.add_cli_args(parser)
    assert RouterArgs.from_cli_args(parser.parse_args(list(command[1:]))).policy == policy


@pytest.fixture
def replicas() -> Any:
    logs: list[list[str | None]] = [[], []]
    servers = [LoopbackHttp(recording_replica(log)) for log in logs]
    yield servers, logs
    for server in servers:
        server.stop()


def send_keys(base_url: str, rounds: int) -> None:
    """Every key ``rounds`` times, on one keep-alive connection (as an SDK's pool keeps one)."""
    with httpx.Client(timeout=10) as client:
        for n in range(rounds):
            for key in KEYS:
                body = {"model": "m", "prompt": f"{key}: question {n}", "max_tokens": 4}
                answer = client.post(base_url + "/completions", json=body, headers={ROUTING_KEY_HEADER: key})
                assert answer.status_code == 200, answer.text


def placement(logs: list[list[str | None]]) -> dict[str, set[int]]:
    """Each key and the replicas that answered it."""
    where: dict[str, set[int]] = collections.defaultdict(set)
    for index, log in enumerate(logs):
        for key in log:
            if key is not None:
                where[key].add(index)
    return dict(where)


def test_a_routing_key_keeps_its_replica_and_the_keys_spread_over_both(tmp_path: Path, replicas: Any) -> None:
    servers, logs = replicas
    spec = spec_for(tmp_path, "consistent_hash")
    command = spec.command
    assert command[command.index("--policy") + 1] == "consistent_hash"
    router, _ = start_router(command, [s.base_url for s in servers], tmp_path / "router.log", spec.front, env=spec.env)
    try:
        send_keys(router.base_url, ROUNDS)
        # Without a key the router still answers (it hashes the request).
        answer = httpx.post(router.base_url + "/completions", json={"model": "m", "prompt": "x"}, timeout=10)
        assert answer.status_code == 200
    finally:
        router.stop()
    where = placement(logs)
    assert sorted(where) == sorted(KEYS)
    assert all(len(places) == 1 for places in where.values()), where
    per_replica = collections.Counter(next(iter(places)) for places in where.values())
    # Thirteen keys on two replicas: both hold some (a hash ring, so not an exact half).
    assert set(per_replica) == {0, 1}, per_replica
    assert sum(len(log) for log in logs) == ROUNDS * len(KEYS) + 1


def test_two_routers_that_found_the_replicas_in_either_order_place_every_key_alike(
    tmp_path: Path, replicas: Any
) -> None:
    # Prod runs two routers or more behind the load balancer, each discovering
    # the replicas on its own: a key must land on the same replica whichever
    # router the connection reached, or each replica would cache it.
    servers, logs = replicas
    spec = spec_for(tmp_path, "consistent_hash")
    urls = [s.base_url for s in servers]
    placements = []
    for n, order in enumerate((urls, urls[::-1])):
        router, _ = start_router(spec.command, order, tmp_path / f"router-{n}.log", spec.front, env=spec.env)
        try:
            send_keys(router.base_url, 1)
        finally:
            router.stop()
        placements.append(placement(logs))
        for log in logs:
            log.clear()
    assert placements[0] == placements[1]
