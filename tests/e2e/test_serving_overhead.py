"""End-to-end: the default layout (vllm-server) adds little time to first token over bare vLLM.

Starts the project's default layout and bare vLLM once each, then runs a few
short cells at one client, alternating which server goes first in each pair.
The figure is the median over pairs of (project - bare) TTFT p50, each pair
measured back to back: a loaded or slow machine shifts both sides of a pair
alike, where an absolute latency bar would flake. The full comparison is
``python -m benchmarks.serving_overhead``; this reuses its servers and load.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.serving_overhead import Server, deprioritize, measure, restore_priority, run_load, start
from benchmarks.stats import median

pytestmark = pytest.mark.e2e

PAIRS = int(os.environ.get("E2E_OVERHEAD_PAIRS", "5"))
REQUESTS_PER_CELL = 8
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
    differences = []
    rows = []
    try:
        for pair in range(PAIRS):
            order = ["project", "bare"] if pair % 2 == 0 else ["bare", "project"]
            ttft = {}
            for variant in order:
                # The idle server's background loops (Ray's) must not tax the measured one.
                for other, server in servers.items():
                    if other != variant:
                        deprioritize(server, saved)
                restore_priority(servers[variant], saved)
                cell = measure(servers[variant], 1, pair, REQUESTS_PER_CELL)
                assert cell.errors == 0, cell.first_error
                ttft[variant] = cell.ttft_p50_ms
            differences.append(ttft["project"] - ttft["bare"])
            rows.append(f"{order[0]} first: project {ttft['project']:.1f} ms, bare {ttft['bare']:.1f} ms")
    finally:
        for server in servers.values():
            restore_priority(server, saved)
    added = median(differences)
    print("\n[overhead] TTFT p50 at c=1, " + "; ".join(rows), flush=True)
    print(
        f"[overhead] added TTFT p50 (project - bare), median over {PAIRS} pairs: {added:+.1f} ms "
        f"[{min(differences):+.1f}, {max(differences):+.1f}], bar {MAX_ADDED_TTFT_MS:.0f} ms",
        flush=True,
    )
    assert added <= MAX_ADDED_TTFT_MS, f"the default layout adds {added:.1f} ms TTFT p50 over bare vLLM"
