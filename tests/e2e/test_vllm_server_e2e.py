"""What only the vllm-server layout does, against the real server: vLLM's own OpenAI server placed by Serve.

The shared server and guard tests run on this layout too (the `server`
fixture is parametrized); these cover its own parts: the routes it does not
serve, the metrics port outside the guard, and the queue its replicas report
to Serve's autoscaler.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from localserve.processes import STAT_NICE, STAT_PPID, stat_fields
from localserve.server import LIMIT_MAX_TOKENS

from .conftest import ServerInfo
from .openai_errors import assert_openai_error, headers

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0


@pytest.fixture
def vllm_server(server: ServerInfo) -> ServerInfo:
    if server.layout != "vllm-server":
        pytest.skip("vllm-server layout only")
    return server


# Routes vLLM's server has that the platform does not offer: their token
# counts the limits do not read (Responses, Anthropic Messages, token-level
# generate) or no client should reach (elastic scaling, profiling, tokenizer).
UNSERVED = (
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/tokenize"),
    ("GET", "/metrics"),
)


@pytest.mark.parametrize(("method", "path"), UNSERVED)
def test_routes_the_platform_does_not_offer_are_404_even_with_a_key(
    vllm_server: ServerInfo, method: str, path: str
) -> None:
    root = vllm_server.base_url.removesuffix("/v1")
    body = {
        "model": vllm_server.model_id,
        "input": "hi",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    response = httpx.request(method, root + path, json=body, headers=headers(vllm_server), timeout=TIMEOUT_S)
    assert_openai_error(response, 404)


def _stat(pid: int) -> list[str]:
    fields = stat_fields(pid)
    assert fields is not None, f"process {pid} is gone"
    return fields


def _tree(pid: int) -> list[int]:
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += _tree(int(child))
    return found


def test_the_replicas_server_and_the_replica_run_at_normal_priority(vllm_server: ServerInfo) -> None:
    """Not Ray's nice 15 for workers (WORKER_NICENESS_ENV): vLLM's host side sets the GPU's pace."""
    from localserve.server import replica_addresses

    assert vllm_server.address_dir is not None
    (published,) = replica_addresses(vllm_server.address_dir)[:1]
    server = int(str(published["pid"]))
    replica = int(_stat(server)[STAT_PPID])  # the Serve replica (a Ray worker) started the server
    nice = {pid: int(_stat(pid)[STAT_NICE]) for pid in [replica, *_tree(server)]}
    assert len(nice) >= 3, nice  # the replica, vLLM's API server and its engine core at least
    assert set(nice.values()) == {0}, nice


def test_metrics_are_on_their_own_port_without_a_key(vllm_server: ServerInfo) -> None:
    assert not vllm_server.metrics_url.startswith(vllm_server.base_url.removesuffix("/v1"))
    with urllib.request.urlopen(vllm_server.metrics_url, timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    assert "vllm:num_requests_running{" in text


def test_the_queue_a_replica_reports_follows_the_requests_in_flight(vllm_server: ServerInfo) -> None:
    from workloads.inference_server.vllm_server import queue_length, queue_url

    def scrape() -> float:
        # What the replica asks for: only the two gauges, from vLLM's own registry.
        with urllib.request.urlopen(queue_url(vllm_server.metrics_url), timeout=TIMEOUT_S) as response:
            return queue_length(response.read().decode())

    async def load_and_sample(requests: int) -> list[float]:
        body = {
            "model": vllm_server.model_id,
            "prompt": "count",
            "max_tokens": LIMIT_MAX_TOKENS,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            sent = [
                asyncio.create_task(
                    client.post(vllm_server.base_url + "/completions", json=body, headers=headers(vllm_server))
                )
                for _ in range(requests)
            ]
            samples = []
            while not all(r.done() for r in sent):
                samples.append(await asyncio.to_thread(scrape))
                await asyncio.sleep(0.05)
            assert all(r.result().status_code == 200 for r in sent)
        return samples

    # On a busy machine one scrape can outlast a small load: more requests
    # (the whole batch generating at once) until a sample lands inside it.
    tried = []
    for requests in (8, 24, 64):
        samples = asyncio.run(load_and_sample(requests))
        tried.append((requests, samples))
        if max(samples) >= 2:
            break
    assert max(samples) >= 2, tried
    # vLLM updates its gauges once an engine step is logged: give the last one a moment.
    deadline = time.monotonic() + 15
    while (after := scrape()) != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert after == 0, f"{after} requests still reported after the load ended"
