"""What the pinned vllm-router does when replicas fail, with the failure settings the render gives it.

`serving.routing.attempts` and `serving.routing.circuit_breaker` choose
between two failures: a replica that fails every request (gray: its
`/health` still answers) and a request that fails on every replica (a
"query of death": a prompt that crashes the engine, say). Each test runs
the router with the command the render gives prod, in front of stand-in
replicas, and counts what reached each one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from typing_extensions import override

from infra.config.routing import ROUTING_KEY_HEADER, CircuitBreaker, Routing
from tests.e2e.loopback_http import LoopbackHttp, SlowReplica, answer
from tests.harness import ROUTING, prod_router_spec
from twin.routing import TwinRouter, start_router
from workloads.inference_server.guard import server_message

POISON = "poison"
# vLLM's route that turns a completion request into token ids, which cache_aware asks before it picks.
RENDER = "/completions/render"


class _Replica(SlowReplica):
    """A healthy replica's server (its /health answers) that answers POISON, or with `fail_everything` every
    generation request, with 500."""

    posts: ClassVar[list[str]]
    fail_everything: ClassVar[bool] = False

    @override
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        prompt = str(body.get("prompt", ""))
        if self.path.endswith(RENDER):
            # cache_aware has a replica tokenize the prompt first: vLLM's render answer (its shape, with
            # fewer fields), one byte a token.
            rendered = [{"request_id": "render", "token_ids": list(prompt.encode()), "model": body.get("model")}]
            answer(self, 200, json.dumps(rendered).encode())
            return
        type(self).posts.append(prompt)
        if type(self).fail_everything or prompt == POISON:
            answer(self, 500, b'{"error": {"message": "engine error"}}')
        else:
            answer(self, 200, b'{"choices": [{"index": 0, "text": "ok"}]}')


def _replica_class(*, fail_everything: bool = False) -> type[_Replica]:
    """A replica of its own: what reached it is kept apart from every other's."""

    class Replica(_Replica):
        pass

    Replica.posts = []
    Replica.fail_everything = fail_everything
    return Replica


@contextmanager
def _routed(tmp_path: Path, replicas: list[type[_Replica]], **routing: Any) -> Iterator[tuple[TwinRouter, list[str]]]:
    """Prod's rendered router (`serving.routing` = ROUTING with ``routing`` over it) in front of ``replicas``;
    yields it and its command line."""
    spec = prod_router_spec(tmp_path, {**ROUTING, **routing})
    servers = [LoopbackHttp(r) for r in replicas]
    try:
        router, argv = start_router(
            spec.command, [s.base_url for s in servers], tmp_path / "router.log", spec.front, env=spec.env
        )
        try:
            yield router, argv
        finally:
            router.stop()
    finally:
        for server in servers:
            server.stop()


def _post(router: TwinRouter, prompt: str, key: str) -> int:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4}
    headers = {ROUTING_KEY_HEADER: key}
    return httpx.post(f"{router.base_url}/completions", json=body, headers=headers, timeout=60).status_code


def test_the_defaults_retry_once_and_open_no_circuit() -> None:
    routing = Routing()
    assert routing.attempts == 2
    assert routing.circuit_breaker == CircuitBreaker(enabled=False)


def test_under_round_robin_a_replica_failing_every_request_costs_the_client_nothing(tmp_path: Path) -> None:
    """One replica answers 500 to everything while its /health answers: under the default policy the second
    attempt reaches the other replica, so every client gets 200 and each request reached it once."""
    sick, well = _replica_class(fail_everything=True), _replica_class()
    with _routed(tmp_path, [sick, well], policy="round_robin") as (router, argv):
        assert argv[argv.index("--retry-max-retries") + 1] == str(Routing().attempts)
        statuses = [_post(router, f"prompt {n}", f"key-{n}") for n in range(16)]
    assert statuses == [200] * 16
    assert len(well.posts) == 16
    # The turn moves on with every attempt, so after the first request the sick one takes every first
    # attempt, and never a second.
    assert 15 <= len(sick.posts) <= 16


@pytest.mark.parametrize(
    ("policy", "moves"), [("round_robin", True), ("consistent_hash", False), ("cache_aware", False)]
)
@pytest.mark.parametrize("attempts", [2, 5])
def test_which_policies_send_a_retry_to_another_replica(
    tmp_path: Path, policy: str, moves: bool, attempts: int
) -> None:
    """Both replicas fail everything, so every request uses all its attempts; where they went tells the
    policies apart. round_robin moves each attempt to the next replica. consistent_hash (the key's place on
    the ring) and cache_aware (the prompt's match, or on a tie as here the same pick) send every attempt
    to one replica: under them a retry does not help a request whose replica fails."""
    first, second = _replica_class(fail_everything=True), _replica_class(fail_everything=True)
    prompts = [f"prompt number {n} " * 8 for n in range(8)]
    with _routed(tmp_path, [first, second], policy=policy, attempts=attempts) as (router, _):
        statuses = [_post(router, prompt, f"key-{n}") for n, prompt in enumerate(prompts)]
    assert statuses == [500] * len(prompts)
    for prompt in prompts:
        tries = sorted((first.posts.count(prompt), second.posts.count(prompt)))
        assert sum(tries) == attempts
        if moves:
            assert tries == [attempts // 2, attempts - attempts // 2], (prompt, tries)
        else:
            assert tries == [0, attempts], (prompt, tries)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_request_that_fails_every_replica_reaches_two_and_takes_no_replica_out(tmp_path: Path, replicas: int) -> None:
    """The defaults against a query of death sent twenty times among good requests: each try of it reaches at
    most two replicas, and every good request is still answered."""
    classes = [_replica_class() for _ in range(replicas)]
    with _routed(tmp_path, list(classes), policy="round_robin") as (router, argv):
        assert "--disable-circuit-breaker" in argv
        statuses = []
        for n in range(20):
            statuses.append((POISON, _post(router, POISON, "k")))
            statuses.append(("good", _post(router, f"good {n}", "k")))
    assert [s for p, s in statuses if p == POISON] == [500] * 20
    assert [s for p, s in statuses if p == "good"] == [200] * 20
    assert sum(c.posts.count(POISON) for c in classes) == 20 * 2


def test_with_the_circuit_breaker_on_a_repeated_query_of_death_takes_the_model_out(tmp_path: Path) -> None:
    """Why it is off by default: with the release's own settings (5 attempts, a circuit after 10 failures), two
    tries of one bad request open a lone replica's circuit, and good requests get 503 for `open_s`."""
    replica = _replica_class()
    breaker = {"enabled": True}
    with _routed(tmp_path, [replica], policy="round_robin", attempts=5, circuit_breaker=breaker) as (router, argv):
        assert "--disable-circuit-breaker" not in argv
        assert argv[argv.index("--cb-failure-threshold") + 1] == str(CircuitBreaker().failures)
        poisoned = [_post(router, POISON, "k") for _ in range(2)]
        good = _post(router, "good", "k")
    assert poisoned == [500, 500]
    assert replica.posts.count(POISON) == 2 * 5 == CircuitBreaker().failures
    assert good == 503
    assert "good" not in replica.posts


def test_replicas_failing_their_health_checks_are_refused_as_the_circuit_alert_reads(tmp_path: Path) -> None:
    """With the defaults (no circuit breaker) the router still stops sending to a replica whose /health fails,
    after HEALTH_FAILURES checks, and answers 503 itself: each attempt counted as `no_available_workers`
    while it still lists the replica, the two series LlmRouterCircuitsOpen reads."""
    from infra.serving import alerts
    from infra.serving.router import HEALTH_CHECK_INTERVAL_S, HEALTH_FAILURES

    class Failing(_Replica):
        healthy = True

        @override
        def do_GET(self) -> None:
            answer(self, 200 if type(self).healthy else 503, b"{}")

    Failing.posts = []
    with _routed(tmp_path, [Failing], policy="round_robin") as (router, argv):
        metrics = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"
        assert _post(router, "before", "k") == 200
        Failing.healthy = False
        deadline = time.monotonic() + (HEALTH_FAILURES + 2) * HEALTH_CHECK_INTERVAL_S
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(1)
            status = _post(router, "after", "k")
        samples = _samples(metrics)
    assert status == 503
    assert samples[("vllm_router_request_errors_total", alerts.ROUTER_NO_WORKER_ERROR)] > 0
    assert samples[("vllm_router_active_workers", "")] == 1.0


def test_the_attempts_alert_reads_each_attempt_a_replica_failed_and_no_other(tmp_path: Path) -> None:
    """LlmRouterAttemptsFailing, against the pinned router with prod's rendered command (breaker off):
    `vllm_router_cb_outcomes_total{outcome}` counts each attempt, "failure" for a 5xx answer and for an
    answer that never came (the replica read the request and dropped the connection), which the router then
    answers 500 itself and no replica counted; "success" for 429 (a key over its cap) and other 4xx."""
    import socket

    from infra.serving import alerts

    (family,) = [f for f in alerts.METRIC_INVENTORY if f.prefix == "vllm_router_"]
    (rule,) = [a for a in alerts.ALERTS if a.name == "LlmRouterAttemptsFailing"]
    assert rule.metrics == ("vllm_router_cb_outcomes_total",) and rule.metrics[0] in family.names

    class Replica(_Replica):
        status = 200

        @override
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            type(self).posts.append(str(type(self).status))
            if type(self).status == 0:
                # Read, then gone without a word: a pod killed mid-request.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            answer(self, type(self).status, b'{"error": {"message": "x"}}')

    Replica.posts = []
    attempts = Routing().attempts
    outcomes: dict[int, dict[str, float]] = {}
    answers: dict[int, list[httpx.Response]] = {}
    with _routed(tmp_path, [Replica], policy="round_robin") as (router, argv):
        metrics = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"
        for status in (429, 400, 500, 0):
            before = _outcomes(metrics)
            Replica.status = status
            body = {"model": "m", "prompt": "x", "max_tokens": 4}
            answers[status] = [httpx.post(f"{router.base_url}/completions", json=body, timeout=60) for _ in range(3)]
            after = _outcomes(metrics)
            outcomes[status] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert [a.status_code for a in answers[429]] == [429] * 3
    assert [a.status_code for a in answers[400]] == [400] * 3
    assert outcomes[429] == {"success": 3 * attempts, "failure": 0.0}  # retried, never a failure
    assert outcomes[400] == {"success": 3, "failure": 0.0}  # not retried
    assert [a.status_code for a in answers[500]] == [500] * 3
    assert outcomes[500] == {"success": 0.0, "failure": 3 * attempts}
    # No answer: the router's own 500 (its front gives it the fixed message: tests/test_router_front.py),
    # and the replica's access log would show nothing.
    assert [a.status_code for a in answers[0]] == [500] * 3
    assert answers[0][0].json()["error"]["message"] == server_message(500)
    assert outcomes[0] == {"success": 0.0, "failure": 3 * attempts}
    assert Replica.posts.count("0") == 3 * attempts


def _outcomes(metrics_url: str) -> dict[str, float]:
    """vllm_router_cb_outcomes_total by `outcome`, summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    out = {"success": 0.0, "failure": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm_router_cb_outcomes_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def _samples(metrics_url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    return {
        (s.name, s.labels.get("error_type", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
