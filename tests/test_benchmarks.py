"""The serving benchmark's own parts, without a server: finding a server's processes, the CPU layout, the verdict.

The whole benchmark (servers, vLLM's client) runs in ``make bench-quick``;
these check in seconds what made it fail before: a one-shot process lookup
that raced the server's start, a layout that did not hold, a wrong verdict.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import guard_overhead
from benchmarks.pinning import REST_CPUS, SERVER_CPUS, Pinner
from benchmarks.report import gateway_table, headline_table, judged, main, pooled, router_table, verdict
from benchmarks.server_tree import (
    API_SERVER,
    ENGINE_CORE,
    FORWARD_PASS,
    ROUTER,
    ROUTER_FRONT,
    ServerTreeError,
    process_role,
    wait_for_tree,
)
from benchmarks.serving_overhead import Cell, ServingResults
from benchmarks.stats import median, median_interval
from localserve.processes import allowed_cpus, threads
from workloads.inference_server.vllm_main import API_SERVER_TITLE

# A root titled as vLLM's API server that starts its "engine core" late, which
# starts its "forward pass" later, as vLLM's API server does. Each child's title
# is in its own command line only (built from halves here, so the root's
# command line does not match).
STAGED = f"# {API_SERVER_TITLE}\n" + textwrap.dedent(
    """
    import subprocess, sys, time
    time.sleep(0.6)
    worker = "import time; time.sleep(0.6); time.sleep(60)  # VLLM" + "::Worker"
    core = (
        "import subprocess, sys, time; time.sleep(0.6); "
        f"subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(60)  # VLLM::Engine" + "Core"
    )
    subprocess.Popen([sys.executable, "-c", core])
    time.sleep(60)
    """
)


@pytest.fixture
def staged_server() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", STAGED], start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_the_tree_is_waited_for_until_engine_core_and_forward_pass_show(
    staged_server: subprocess.Popen[bytes],
) -> None:
    tree = wait_for_tree(lambda: {staged_server.pid}, timeout_s=30, poll_s=0.1)
    roles = sorted(process_role(pid) for pid in tree)
    assert roles == sorted([API_SERVER, ENGINE_CORE, FORWARD_PASS])
    assert staged_server.pid in tree


def test_a_tree_that_never_completes_fails_naming_what_it_found(staged_server: subprocess.Popen[bytes]) -> None:
    with pytest.raises(ServerTreeError) as err:
        wait_for_tree(lambda: {staged_server.pid}, roles=("router",), timeout_s=0.5, poll_s=0.1)
    assert "no router" in str(err.value)
    assert str(staged_server.pid) in str(err.value)


def test_roots_known_only_later_are_picked_up() -> None:
    # A replica publishes its server's process id once it is healthy: the roots start empty.
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", STAGED], start_new_session=True)
    try:
        tree = wait_for_tree(lambda: {proc.pid} if time.monotonic() - started > 0.5 else set(), timeout_s=30)
        assert {process_role(pid) for pid in tree} >= {ENGINE_CORE, FORWARD_PASS}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_isolate_puts_every_thread_of_the_server_on_its_core_and_the_rest_on_the_other() -> None:
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,)).start()\n"
    server = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pinner = Pinner()
    try:
        deadline = time.monotonic() + 20
        while len(threads(server.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        pinner.remember({server.pid, other.pid})
        check = pinner.isolate({server.pid}, {server.pid, other.pid})
        assert check.mismatched == 0
        assert check.server_threads == 4
        assert {allowed_cpus(server.pid, t) for t in threads(server.pid)} == {SERVER_CPUS}
        assert {allowed_cpus(other.pid, t) for t in threads(other.pid)} == {REST_CPUS}
        shared = pinner.share({server.pid}, {server.pid, other.pid})
        assert shared.mismatched == 0
        assert {allowed_cpus(server.pid, t) for t in threads(server.pid)} == {pinner.original[server.pid]}
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait()


def _cell(
    variant: str, rnd: int, concurrency: int, rps: float, ttft_ms: float = 10.0, server_cpu_ms: float = 0.0
) -> Cell:
    return Cell(
        variant=variant,
        concurrency=concurrency,
        round=rnd,
        prompts=10,
        completed=10,
        failed=0,
        duration_s=10 / rps,
        rps=rps,
        output_tok_s=rps * 32,
        ttft_p50_ms=ttft_ms,
        ttft_p99_ms=20.0,
        tpot_p50_ms=1.0,
        itl_p50_ms=1.0,
        e2el_p50_ms=40.0,
        e2el_p99_ms=60.0,
        output_tokens=320,
        cpu_ms={FORWARD_PASS: 100.0, ENGINE_CORE: 50.0},
        server_cpu_ms=server_cpu_ms,
    )


def _three_rounds(variants: list[str], concurrency: list[int], cells: list[Cell]) -> ServingResults:
    """Three rounds of `cells` at `concurrency`, 10 prompts a cell, as the run records them."""
    return ServingResults(
        variants=variants,
        rounds=3,
        concurrency=concurrency,
        prompts=dict.fromkeys(concurrency, 10),
        max_tokens=32,
        input_tokens=64,
        layout="isolated",
        replicas=1,
        start_seconds={},
        idle_cpu_share={},
        cells=cells,
        seconds=1.0,
    )


def test_the_headline_pairs_each_round_with_bare_and_judges_the_median() -> None:
    # Project at 0.96x, 0.90x, 1.00x of bare in three rounds at c=8: median 0.96x passes;
    # at c=32 it is 0.90x in every round and misses.
    cells = []
    for rnd, (ratio8, bare8) in enumerate([(0.96, 50.0), (0.90, 80.0), (1.00, 60.0)]):
        cells += [_cell("bare", rnd, 8, bare8), _cell("project", rnd, 8, bare8 * ratio8)]
        cells += [_cell("bare", rnd, 32, 100.0), _cell("project", rnd, 32, 90.0)]
    results = _three_rounds(["project", "bare"], [8, 32], cells)
    table = headline_table(results)
    # Three rounds: the median's interval is the rounds' own range, so 0.96x is not told from 0.90x.
    assert (
        "| req/s ratio | 8 | 0.96x [0.90x, 1.00x] | [0.90x, 1.00x] | >= 0.95x | **PASS** (interval spans the target) |"
        in table
    )
    assert "| req/s ratio | 32 | 0.90x [0.90x, 0.90x] | [0.90x, 0.90x] | >= 0.95x | **MISS** |" in table
    assert verdict([], 0.95, True) == "n/a"


def test_the_routing_tier_is_judged_on_its_hop_against_the_direct_layout_and_its_rate_against_bare() -> None:
    # c=1: the routed TTFT is 3, 4 and 9 ms over the direct layout's in the same round
    # (median 4 ms: PASS), whatever bare does; c=8: 0.97x bare's req/s in every round
    # (PASS); c=32: 0.90x (MISS).
    cells = []
    for rnd, (added, bare_ttft) in enumerate([(3.0, 5.0), (4.0, 50.0), (9.0, 5.0)]):
        cells += [_cell("bare", rnd, 1, 10.0, bare_ttft), _cell("project", rnd, 1, 10.0, 20.0)]
        cells += [_cell("routed", rnd, 1, 10.0, 20.0 + added)]
        cells += [_cell("bare", rnd, 8, 50.0), _cell("project", rnd, 8, 49.0), _cell("routed", rnd, 8, 48.5)]
        cells += [_cell("bare", rnd, 32, 100.0), _cell("project", rnd, 32, 95.0), _cell("routed", rnd, 32, 90.0)]
    results = _three_rounds(["project", "routed", "bare"], [1, 8, 32], cells)
    table = router_table(results)
    assert (
        "| TTFT p50 the router adds, ms | 1 | +4.0 [+3.0, +9.0] | [+3.0, +9.0] | <= 5 ms "
        "| **PASS** (interval spans the target) |" in table
    )
    assert "| req/s ratio to bare vLLM | 8 | 0.97x [0.97x, 0.97x] | [0.97x, 0.97x] | >= 0.95x | **PASS** |" in table
    assert "| req/s ratio to bare vLLM | 32 | 0.90x [0.90x, 0.90x] | [0.90x, 0.90x] | >= 0.95x | **MISS** |" in table
    assert router_table(ServingResults(**{**results.__dict__, "variants": ["project", "bare"]})) == ""


def test_the_routing_tiers_table_says_where_the_hops_cost_went_under_load() -> None:
    # c=32, three rounds: routed serves 0.96x, 0.94x and 0.95x of the project's req/s in its round,
    # its measured server spends 1.05x the project's CPU a request, and the router and its front
    # 6 and 4 ms over the cell's 10 requests (1.00 ms a request); the direct layout has no hop.
    cells = []
    for rnd, ratio in enumerate([0.96, 0.94, 0.95]):
        cells += [_cell("bare", rnd, 32, 100.0), _cell("project", rnd, 32, 98.0, server_cpu_ms=80.0)]
        routed = _cell("routed", rnd, 32, 98.0 * ratio, server_cpu_ms=84.0)
        routed.cpu_ms = {**routed.cpu_ms, ROUTER: 6.0, ROUTER_FRONT: 4.0}
        cells.append(routed)
        # The server's own steps: 40 for the project's 10 requests, 42 behind the router (1.05x);
        # so a step took 10/98/40 s directly and 10/(98 x ratio)/42 s routed.
        cells[-2].engine_steps, routed.engine_steps = 40.0, 42.0
    results = _three_rounds(["project", "routed", "bare"], [32], cells)
    table = router_table(results)
    assert "| req/s, routed / project (the hop alone) | 32 | 0.95x [0.94x, 0.96x] | [0.94x, 0.96x] | - | - |" in table
    assert "| the measured server's CPU a request, routed / project | 32 | 1.05x [1.05x, 1.05x] |" in table
    assert "| CPU ms a request of the router and its front | 32 | 1.00 [1.00, 1.00] |" in table
    assert "| the server's engine steps a request, routed / project | 32 | 1.05x [1.05x, 1.05x] |" in table
    # Steps x time a step is the rate: 1 / (1.05 x 1/0.95) = 0.95x, the hop alone's median.
    assert "| the server's time an engine step, routed / project | 32 | 1.00x [0.99x, 1.01x] |" in table
    # An old run's cells, or a server whose metrics were not read, have no steps: left out, not 0x or inf.
    unread = _cell("routed", 0, 32, 90.0)
    assert math.isnan(unread.engine_steps_per_request()) and math.isnan(unread.ms_per_engine_step())
    cells[1].engine_steps = 0.0  # round 0's project cell
    fewer = router_table(_three_rounds(["project", "routed", "bare"], [32], cells))
    assert (
        "| the server's engine steps a request, routed / project | 32 | 1.05x [1.05x, 1.05x] | [1.05x, 1.05x] |"
        in fewer
    )
    # Without the direct layout in the run, none of the three (bare alone judges the rate).
    alone = ServingResults(**{**results.__dict__, "variants": ["routed", "bare"]})
    assert "the hop alone" not in router_table(alone) and "req/s ratio to bare vLLM | 32" in router_table(alone)


def test_the_medians_interval_narrows_with_rounds_and_is_the_same_each_time() -> None:
    rounds = [0.82, 1.01, 0.95, 0.71, 1.12, 0.93, 0.97, 0.88, 1.05, 0.90, 0.99, 0.94, 1.20, 0.86, 0.96]
    low, high = median_interval(rounds)
    assert low < median(rounds) < high
    assert median_interval(rounds) == (low, high)  # a fixed seed: a rebuilt report prints the same
    # Four times the rounds from the same spread: a narrower interval around the same median.
    low4, high4 = median_interval(rounds * 4)
    assert low <= low4 < median(rounds) < high4 <= high
    assert high4 - low4 < high - low
    assert median_interval([0.97] * 5) == (0.97, 0.97)
    assert all(math.isnan(v) for v in median_interval([]))


def test_a_verdict_says_when_its_median_is_not_told_apart_from_the_target() -> None:
    edge = [0.95 + d for d in (-0.10, -0.05, -0.02, 0.0, 0.01, 0.03, 0.06, 0.12, -0.04, 0.02, 0.08)]
    assert verdict(edge, 0.95, True) == "PASS"
    assert judged(edge, 0.95, True) == "**PASS** (interval spans the target)"
    assert judged([0.97, 0.98, 0.99, 1.01, 0.96], 0.95, True) == "**PASS**"
    assert judged([0.90, 0.91, 0.89, 0.92, 0.93], 0.95, True) == "**MISS**"
    # At most: milliseconds added.
    assert judged([1.0, 1.5, 0.8, 1.2, 0.9], 5.0, False) == "**PASS**"
    assert judged([4.0, 6.0, 5.5, 3.0, 5.2], 5.0, False) == "**MISS** (interval spans the target)"
    assert judged([], 0.95, True) == "n/a"


def _run(rounds_ratio: list[float], layout: str = "isolated", bare: float = 100.0) -> ServingResults:
    cells = []
    for rnd, ratio in enumerate(rounds_ratio):
        cells += [_cell("bare", rnd, 32, bare + rnd), _cell("routed", rnd, 32, (bare + rnd) * ratio)]
    run = _three_rounds(["routed", "bare"], [32], cells)
    return ServingResults(**{**run.__dict__, "rounds": len(rounds_ratio), "layout": layout})


def test_pooled_runs_pair_each_round_within_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = _run([0.90, 0.92, 0.94]), _run([1.00, 0.98, 0.96], bare=150.0)
    both = pooled([first, second])
    assert both.rounds == 6
    assert sorted({c.round for c in both.cells}) == list(range(6))
    # Each ratio is a round's own: paired with the first run's bare cells, the second run's would be 1.44x-1.50x.
    assert "| req/s ratio to bare vLLM | 32 | 0.95x [0.90x, 1.00x] |" in router_table(both)
    with pytest.raises(ValueError, match="layout"):
        pooled([first, _run([0.9], layout="shared")])
    # From the command line: each directory one run's serving.json; the tables go to --out.
    dirs = []
    for name, run in (("a", first), ("b", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serving.json").write_text(json.dumps(run.to_json()))
        dirs.append(str(tmp_path / name))
    assert main(["--pool", *dirs, "--out", str(tmp_path / "pooled")]) == 0
    report = (tmp_path / "pooled" / "report.md").read_text()
    assert "| req/s ratio to bare vLLM | 32 | 0.95x [0.90x, 1.00x] |" in report
    assert "from 2 runs, 6 rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        main(["--pool", dirs[0], str(tmp_path / "none"), "--out", str(tmp_path / "x")])
    assert stopped.value.code == 2
    assert "--pool: no serving.json in" in capsys.readouterr().err


def test_the_gateways_hop_is_paired_with_the_routed_layout_in_each_round() -> None:
    # c=1: the gateway's TTFT is 1, 2 and 6 ms over the routed layout's in the same round (median 2);
    # c=32: 0.95x, 0.90x and 1.00x its req/s. Without the routed variant there is nothing to pair with.
    cells = []
    for rnd, (added, ratio) in enumerate([(1.0, 0.95), (2.0, 0.90), (6.0, 1.00)]):
        cells += [_cell("routed", rnd, 1, 10.0, 20.0 + rnd), _cell("gateway", rnd, 1, 10.0, 20.0 + rnd + added)]
        cells += [_cell("routed", rnd, 32, 100.0 + rnd), _cell("gateway", rnd, 32, (100.0 + rnd) * ratio)]
    results = _three_rounds(["routed", "gateway"], [1, 32], cells)
    table = gateway_table(results)
    assert "| TTFT p50 the gateway adds, ms | 1 | +2.0 [+1.0, +6.0] |" in table
    assert "| req/s, gateway / routed | 32 | 0.95x [0.90x, 1.00x] |" in table
    assert gateway_table(ServingResults(**{**results.__dict__, "variants": ["gateway"]})) == ""


def test_the_routers_process_is_counted_as_the_router(tmp_path: Path) -> None:
    # vllm-router retitles its process ("vllm::router"); its CPU must not land in "other".
    from benchmarks.serving_overhead import REPO
    from tests.e2e.loopback_http import LoopbackHttp, SlowReplica
    from twin.routing import router_specs, start_router

    replica = LoopbackHttp(SlowReplica)
    spec = next(iter(router_specs(REPO / "Pulumi.prod.yaml").values()))
    router, _ = start_router(spec.command, [replica.base_url], tmp_path / "router.log", spec.front, env=spec.env)
    try:
        assert process_role(router.child.proc.pid) == "router"
    finally:
        router.stop()
        replica.stop()


def test_the_gateways_process_is_counted_as_the_gateway(tmp_path: Path) -> None:
    # Its CPU must not land in "other" in the gateway variant's per-role table.
    from localserve.processes import free_port
    from twin.gateway import start_gateway
    from workloads.inference_server.gateway_settings import GatewaySettings

    keys = tmp_path / "keys"
    keys.write_text("sk-bench-0123456789abcdef0123\n")
    settings = GatewaySettings(
        host="127.0.0.1",
        port=free_port(),
        routes={"m": f"http://127.0.0.1:{free_port()}"},
        api_keys_file=str(keys),
        api_keys_env="UNUSED_KEYS",
        max_body_bytes=1024,
        request_timeout_s=5,
    )
    gateway = start_gateway(settings, tmp_path / "gateway.log")
    try:
        assert process_role(gateway.proc.pid) == "gateway"
    finally:
        gateway.stop(grace_s=5)


def test_the_server_stack_is_timed_serving_vllms_events_through_all_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the per-request figure of the vllm-server process times: every request served and accounted."""
    pytest.importorskip("vllm")
    case = guard_overhead.measure(8, 5, requests=20, batches=2, stack="server", workdir=tmp_path)
    # Both sides were timed. Not their difference: ten requests a batch on a machine running
    # other tests beside this one can time the stack under the app alone (a CI run saw -109 us).
    assert case.stack == "server" and case.bare_us > 0 and case.guarded_us > 0
    lines = [json.loads(line) for line in (tmp_path / "access.log").read_text().splitlines()]
    # Warm-up and two batches, each request through the accounting: the key named, its tokens
    # the ones the stand-in left in the request state as vLLM's serving code does.
    assert len(lines) == 10 // 4 + 1 + 2 * 10
    assert {(x["status"], x["key_id"] is not None, x["model"], x["output_tokens"], x["tokens"]) for x in lines} == {
        (200, True, guard_overhead.MODEL, 5, "exact")
    }
    # The access file the stack wrote to is closed once it is timed.
    assert _open_files_under(tmp_path) == []
    # A stack that refuses answers without the app: that is not what is timed.
    monkeypatch.setattr(guard_overhead, "KEY", "not-a-key-" + "z" * 40)
    with pytest.raises(RuntimeError, match=r"answered \[401\]"):
        guard_overhead.measure(8, 5, requests=20, batches=2, stack="server", workdir=tmp_path)
    assert _open_files_under(tmp_path) == []


def _open_files_under(folder: Path) -> list[str]:
    """This process's descriptors open on a file under ``folder``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)):
                found.append(target)
    return found


def test_the_servers_engine_steps_are_read_from_vllms_own_histogram() -> None:
    from prometheus_client import CollectorRegistry, Histogram, start_http_server

    from benchmarks.report import unread_steps
    from benchmarks.serving_overhead import ENGINE_STEPS, engine_steps

    # The histogram as vLLM exports it (one series per engine), in the exposition format prometheus_client writes.
    registry = CollectorRegistry()
    steps = Histogram(ENGINE_STEPS, "tokens a step", ["model_name", "engine"], buckets=(1, 8, 32), registry=registry)
    for tokens in (64, 8, 8, 8):
        steps.labels("tiny", "0").observe(tokens)
    steps.labels("tiny", "1").observe(5)
    # Served by prometheus_client's exporter: vLLM exports its metrics with the same library.
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        # Both engines' steps and tokens, not the buckets' counts.
        assert engine_steps(url) == (5.0, 93.0)
    finally:
        server.shutdown()
        server.server_close()
    # A server that does not answer, or none to ask: unread, not zero steps.
    assert engine_steps(url) is None
    assert engine_steps(None) is None
    # A run whose servers' steps went unread says which cells (the quick check fails on it).
    cells = [_cell("project", 0, 8, 40.0), _cell("guarded", 0, 8, 40.0), _cell("bare", 0, 8, 40.0)]
    cells[2].engine_steps = 30.0
    assert unread_steps(_three_rounds(["project", "guarded", "bare"], [8], cells)) == ["project c=8 round 1"]
