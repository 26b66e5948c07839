"""benchmarks/router_hop.py: the hop's CPU is read from the processes prod's rendered router and front run as."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import router_hop
from infra.serving.router import RUNTIME_THREADS_ENV
from twin.routing import router_specs


def test_the_hop_is_measured_through_the_rendered_router_and_front(tmp_path: Path) -> None:
    out = tmp_path / "hop.json"
    argv = ["--threads", "1", "--front-workers", "2", "--requests", "600", "--rounds", "2", "--concurrency", "8"]
    assert router_hop.main([*argv, "--events", "6", "--gap-ms", "0", "--out", str(out)]) == 0
    rounds = json.loads(out.read_text())
    assert [(r["threads"], r["front_workers"]) for r in rounds] == [(1, 2), (1, 2)]
    for r in rounds:
        # Every answer came through whole: its events and [DONE], through the front and the router.
        assert r["chunks"] == 600 * (6 + 1)
        # Both processes of the hop were found and worked (/proc counts 10 ms ticks: 600 answers cost more).
        assert r["router_us_per_request"] > 0
        assert r["front_us_per_request"] > 0
        # The same requests went to the stand-in without the hop, in the same round.
        assert r["direct_seconds"] > 0 and r["concurrency"] == 8


def test_the_hops_latency_is_the_rate_without_it_over_the_rate_through_it() -> None:
    # 1000 requests at c=8: 25 s through the hop, 20 s without it. With 8 in flight each
    # request took 200 ms against 160 ms: 40 ms more, and the rate is 0.8x.
    hop = router_hop.HopRound(1, "pinned", 1, 1000, 33000, 25.0, 900.0, 600.0, direct_seconds=20.0, concurrency=8)
    assert hop.rate_vs_direct == pytest.approx(0.8)
    assert hop.added_ms_per_request == pytest.approx(40.0)


def test_rendered_names_the_count_prods_stack_renders_and_counts_are_kept_once() -> None:
    (spec,) = list(router_specs(router_hop.REPO / "Pulumi.prod.yaml").values())[:1]
    rendered = int(spec.env[RUNTIME_THREADS_ENV])
    assert router_hop.thread_counts("rendered") == [rendered]
    assert router_hop.thread_counts(f"rendered,{rendered},3") == list(dict.fromkeys([rendered, 3]))
    assert router_hop.worker_counts("rendered,2") == list(dict.fromkeys([spec.front.workers, 2]))


@pytest.mark.parametrize("word", ["0", "two", "-1"])
def test_a_count_that_is_not_positive_is_refused_in_one_line(word: str) -> None:
    with pytest.raises(SystemExit, match=f"--threads: '{word}'"):
        router_hop.thread_counts(word)
    with pytest.raises(SystemExit, match=f"--front-workers: '{word}'"):
        router_hop.worker_counts(f"1,{word}")


def test_the_summary_gives_each_settings_median_and_spread() -> None:
    # 10 requests a round at c=8, 1 s through the hop; `d` seconds without it.
    rounds = [
        router_hop.HopRound(t, "shared", w, 10, 330, 1.0, r, f, direct_seconds=d, concurrency=8)
        for t, w, r, f, d in [
            (1, 1, 900, 800, 0.9),
            (1, 1, 1000, 700, 0.95),
            (1, 1, 950, 900, 0.8),
            (2, 1, 1400, 1000, 1.0),
            (1, 2, 900, 900, 0.5),
        ]
    ]
    assert router_hop.summary(rounds) == [
        "threads=1 front workers=1: router 950 us/request [900, 1000], front 800 [700, 900], hop 51.5 us/chunk, "
        "rate 0.900x direct [0.800, 0.950], +80.0 ms a request (3 rounds)",
        "threads=2 front workers=1: router 1400 us/request [1400, 1400], front 1000 [1000, 1000], hop 72.7 us/chunk, "
        "rate 1.000x direct [1.000, 1.000], +0.0 ms a request (1 rounds)",
        "threads=1 front workers=2: router 900 us/request [900, 900], front 900 [900, 900], hop 54.5 us/chunk, "
        "rate 0.500x direct [0.500, 0.500], +400.0 ms a request (1 rounds)",
    ]
