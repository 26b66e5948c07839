"""Runs every benchmark and writes benchmarks/results/report.md, report.png and the raw JSON.

    python -m benchmarks [--rounds 5] [--layout isolated] [--repeats 3] [--skip-serving] [--skip-render]
    python -m benchmarks --quick              # every stage once, small (make bench-quick)
    python -m benchmarks --from-json          # re-render the report from the last raw results
    python -m benchmarks --pool A B --out P   # the serving tables over several runs' rounds (each DIR one run)

Prints the same tables it writes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

from benchmarks import guard_overhead, render_scale, serving_overhead
from benchmarks.render_scale import ScaleResults
from benchmarks.serving_overhead import VARIANT_LABELS, Cell, ServingResults
from benchmarks.stats import least_squares, median, median_interval, spread

RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- serving


def _cells(results: ServingResults, variant: str, concurrency: int) -> list[Cell]:
    return [c for c in results.cells if c.variant == variant and c.concurrency == concurrency]


def _value(cell: Cell, attr: str) -> float:
    got = getattr(cell, attr)
    return float(got() if callable(got) else got)


def _paired(
    results: ServingResults, variant: str, concurrency: int, attr: str, how: str, against: str = "bare"
) -> list[float]:
    """Per-round comparison with ``against`` (bare vLLM) measured in the same round: a ratio or a difference."""
    bare = {c.round: _value(c, attr) for c in _cells(results, against, concurrency)}
    out = []
    for cell in _cells(results, variant, concurrency):
        theirs = bare.get(cell.round)
        if theirs is not None:
            mine = _value(cell, attr)
            out.append((mine / theirs if theirs else math.nan) if how == "ratio" else mine - theirs)
    return [v for v in out if not math.isnan(v)]


def _label(variant: str) -> str:
    return VARIANT_LABELS.get(variant, variant)


OUTSIDE = "outside_forward_ms_per_token"

# Targets for the default layout against bare vLLM.
RPS_RATIO_TARGET = 0.95
ADDED_TTFT_TARGET_MS = 15.0
CPU_RATIO_TARGET = 1.5
# Targets for the routing tier: the router's hop over the direct layout at c=1,
# and the routed layout's requests/s against bare vLLM under load.
ROUTER_ADDED_TTFT_TARGET_MS = 5.0
ROUTER_RPS_CONCURRENCY = (8, 32)


def headline_variant(results: ServingResults) -> str | None:
    if "project" in results.variants:
        return "project"
    return next((v for v in results.variants if v != "bare"), None)


def headline_rows(results: ServingResults) -> list[tuple[str, str, int, str, float | None, bool]]:
    """(figure, attribute, c, ratio|diff, target or None, at least?) of the headline table."""
    rows: list[tuple[str, str, int, str, float | None, bool]] = [
        ("req/s ratio", "rps", c, "ratio", RPS_RATIO_TARGET, True) for c in results.concurrency
    ]
    # No target: the same ratio with each cell's req/s divided by the share of its core the
    # server got, which takes out what other users' processes took from that core.
    per_core = "req/s per core the server got, ratio"
    rows += [(per_core, "rps_per_core", c, "ratio", None, True) for c in results.concurrency]
    if 1 in results.concurrency:
        rows.append(("added TTFT p50 ms", "ttft_p50_ms", 1, "diff", ADDED_TTFT_TARGET_MS, False))
    rows += [
        ("CPU/output token outside forward pass, ratio", OUTSIDE, c, "ratio", CPU_RATIO_TARGET, False)
        for c in results.concurrency
    ]
    return rows


def verdict(values: list[float], target: float, at_least: bool) -> str:
    """PASS or MISS on the median over rounds; n/a without a pair."""
    med = median(values)
    if math.isnan(med):
        return "n/a"
    return "PASS" if (med >= target if at_least else med <= target) else "MISS"


def judged(values: list[float], target: float, at_least: bool) -> str:
    """The verdict in bold, and whether the median's 95% interval is on the verdict's side of the target.

    A median at a target's edge passes in one run and misses in the next; the
    interval says which of the two a run can tell apart.
    """
    said = verdict(values, target, at_least)
    if said == "n/a":
        return said
    low, high = median_interval(values)
    settled = (low >= target or high < target) if at_least else (high <= target or low > target)
    return f"**{said}**" + ("" if settled else " (interval spans the target)")


def interval(values: list[float], fmt: str) -> str:
    """The median's 95% bootstrap interval as ``[low, high]``."""
    if not values:
        return "n/a"
    low, high = median_interval(values)
    return f"[{fmt.format(low)}, {fmt.format(high)}]"


def headline_table(results: ServingResults) -> str:
    variant = headline_variant(results)
    if variant is None or "bare" not in results.variants:
        return "No headline: the run needs bare vLLM and a project variant."
    others = [v for v in results.variants if v not in (variant, "bare")]
    lines = [
        f"{_label(variant)} against bare vLLM, {results.layout} layout, paired within each round: "
        "median [min, max] over rounds, the median's 95% bootstrap interval; the verdict is on the median.",
        "",
        "| figure | c | measured | median's 95% interval | target | verdict |"
        + "".join(f" {_label(o)} |" for o in others),
        "|---|---|---|---|---|---|" + "---|" * len(others),
    ]
    for name, attr, concurrency, how, target, at_least in headline_rows(results):
        values = _paired(results, variant, concurrency, attr, how)
        fmt = "{:.2f}x" if how == "ratio" else "{:+.1f}"
        if target is None:
            bound, said = "-", "-"
        else:
            bound = (">= " if at_least else "<= ") + (f"{target:.2f}x" if how == "ratio" else f"{target:.0f} ms")
            said = judged(values, target, at_least)
        line = f"| {name} | {concurrency} | {spread(values, fmt)} | {interval(values, fmt)} | {bound} | {said} |"
        line += "".join(f" {spread(_paired(results, o, concurrency, attr, how), fmt)} |" for o in others)
        lines.append(line)
    return "\n".join(lines)


class RouterRow(NamedTuple):
    """One figure of the routing tier's table: the routed variant paired with ``against`` in each round."""

    name: str
    attr: str
    concurrency: int
    how: str  # "ratio" or "diff"
    against: str
    target: float | None  # None: shown, not judged
    at_least: bool = False
    fmt: str = "{:+.1f}"

    @property
    def shown(self) -> str:
        return "{:.2f}x" if self.how == "ratio" else self.fmt


def router_rows(results: ServingResults) -> list[RouterRow]:
    """The routing tier's table: the criterion's figures, then where the hop's cost goes under load.

    The criterion's: the TTFT the router adds at c=1 and its requests/s
    against bare vLLM under load. Then, against the direct layout it fronts:
    its requests/s (the hop alone), the measured server's own CPU a request
    (isolated, that server fills its one core under load, so its rate is
    that core over this CPU: a hop that makes the server spend more a
    request, for example by reaching the engine's batch later, costs rate
    there), and the CPU the router and its front spend a request (on the
    other core here, in the router's own pods on a cluster). Last, that
    rate split in two from the server's own metrics: the engine steps it
    took a request (how full the hop left its batches) and the time a step
    took (the core's speed in that cell, which drifts from cell to cell on a
    shared machine, the work each step carried, and any wait between steps).
    """
    rows: list[RouterRow] = []
    direct = "project" in results.variants
    if 1 in results.concurrency and direct:
        rows.append(
            RouterRow("TTFT p50 the router adds, ms", "ttft_p50_ms", 1, "diff", "project", ROUTER_ADDED_TTFT_TARGET_MS)
        )
    loads = [c for c in ROUTER_RPS_CONCURRENCY if c in results.concurrency]
    if "bare" in results.variants:
        rows += [
            RouterRow("req/s ratio to bare vLLM", "rps", c, "ratio", "bare", RPS_RATIO_TARGET, at_least=True)
            for c in loads
        ]
    if direct:
        for c in loads:
            rows += [
                RouterRow("req/s, routed / project (the hop alone)", "rps", c, "ratio", "project", None),
                RouterRow(
                    "the measured server's CPU a request, routed / project",
                    "server_cpu_ms_per_request",
                    c,
                    "ratio",
                    "project",
                    None,
                ),
                RouterRow(
                    "CPU ms a request of the router and its front",
                    "hop_cpu_ms_per_request",
                    c,
                    "diff",
                    "project",
                    None,
                    fmt="{:.2f}",
                ),
                RouterRow(
                    "the server's engine steps a request, routed / project",
                    "engine_steps_per_request",
                    c,
                    "ratio",
                    "project",
                    None,
                ),
                RouterRow(
                    "the server's time an engine step, routed / project",
                    "ms_per_engine_step",
                    c,
                    "ratio",
                    "project",
                    None,
                ),
            ]
    return rows


def router_table(results: ServingResults) -> str:
    """The routed variant against the direct layout (its hop) and bare vLLM (its throughput)."""
    if "routed" not in results.variants:
        return ""
    rows = router_rows(results)
    if not rows:
        return "No routing-tier figures: the run needs the project variant or bare vLLM beside the routed one."
    lines = [
        f"{_label('routed')}, paired within each round: median [min, max] over rounds, the median's 95% "
        "bootstrap interval; the verdict is on the median. The rows without a target say where the hop's "
        "cost goes, against the project's layout the router fronts.",
        "",
        "| figure | c | measured | median's 95% interval | target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        values = _paired(results, "routed", row.concurrency, row.attr, row.how, row.against)
        if row.target is None:
            bound, said = "-", "-"
        else:
            bound = (">= " if row.at_least else "<= ") + (
                f"{row.target:.2f}x" if row.how == "ratio" else f"{row.target:.0f} ms"
            )
            said = judged(values, row.target, row.at_least)
        lines.append(
            f"| {row.name} | {row.concurrency} | {spread(values, row.shown)} | {interval(values, row.shown)} "
            f"| {bound} | {said} |"
        )
    return "\n".join(lines)


def gateway_table(results: ServingResults) -> str:
    """The model gateway's hop: the gateway variant against the routed one (the same router behind it)."""
    if "gateway" not in results.variants or "routed" not in results.variants:
        return ""
    lines = [
        f"{_label('gateway')} against {_label('routed')}, paired within each round: median [min, max] over rounds.",
        "",
        "| figure | c | measured |",
        "|---|---|---|",
    ]
    for concurrency in results.concurrency:
        added = _paired(results, "gateway", concurrency, "ttft_p50_ms", "diff", "routed")
        ratio = _paired(results, "gateway", concurrency, "rps", "ratio", "routed")
        lines.append(f"| TTFT p50 the gateway adds, ms | {concurrency} | {spread(added, '{:+.1f}')} |")
        lines.append(f"| req/s, gateway / routed | {concurrency} | {spread(ratio, '{:.2f}x')} |")
    return "\n".join(lines)


def _variant_tables(results: ServingResults) -> list[str]:
    lines = [
        "| c | server | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | e2e p50 ms "
        "| CPU ms/token outside fwd | fwd-pass CPU ms/token | server's core used | req/s per core "
        "| CPU busy core0/core1 | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for concurrency in results.concurrency:
        for variant in results.variants:
            cells = _cells(results, variant, concurrency)
            if not cells:
                continue

            def col(attr: str, fmt: str, cells: list[Cell] = cells) -> str:
                return spread([_value(c, attr) for c in cells], fmt)

            busy = "/".join(
                f"{median([c.cpu_busy[i] for c in cells if len(c.cpu_busy) > i]):.0%}"
                for i in range(min((len(c.cpu_busy) for c in cells), default=0))
            )
            lines.append(
                f"| {concurrency} | {_label(variant)} | {col('rps', '{:.2f}')} "
                f"| {col('ttft_p50_ms', '{:.1f}')} | {col('ttft_p99_ms', '{:.1f}')} | {col('tpot_p50_ms', '{:.2f}')} "
                f"| {col('itl_p50_ms', '{:.2f}')} | {col('e2el_p50_ms', '{:.0f}')} "
                f"| {col(OUTSIDE, '{:.2f}')} | {col('forward_ms_per_token', '{:.2f}')} "
                f"| {col('server_core_share', '{:.0%}')} | {col('rps_per_core', '{:.2f}')} "
                f"| {busy or 'n/a'} | {sum(c.failed for c in cells)} |"
            )
    lines += [
        "",
        "Against bare vLLM measured in the same round (ratio: variant / bare; added: variant - bare):",
        "",
        "| c | server | req/s ratio | added TTFT p50 ms | added TPOT p50 ms | CPU/token outside fwd ratio |",
        "|---|---|---|---|---|---|",
    ]
    for concurrency in results.concurrency:
        for variant in results.variants:
            if variant == "bare" or not _cells(results, variant, concurrency):
                continue
            lines.append(
                f"| {concurrency} | {_label(variant)} "
                f"| {spread(_paired(results, variant, concurrency, 'rps', 'ratio'), '{:.2f}x')} "
                f"| {spread(_paired(results, variant, concurrency, 'ttft_p50_ms', 'diff'), '{:+.1f}')} "
                f"| {spread(_paired(results, variant, concurrency, 'tpot_p50_ms', 'diff'), '{:+.2f}')} "
                f"| {spread(_paired(results, variant, concurrency, OUTSIDE, 'ratio'), '{:.2f}x')} |"
            )
    lines += ["", "Requests/s of every round, in the order measured (the spread behind the medians):", ""]
    lines += ["| c | server | " + " | ".join(f"round {r + 1}" for r in range(results.rounds)) + " |"]
    lines += ["|---|---|" + "---|" * results.rounds]
    for concurrency in results.concurrency:
        for variant in results.variants:
            by_round = {c.round: c.rps for c in _cells(results, variant, concurrency)}
            cols = " | ".join(f"{by_round[r]:.1f}" if r in by_round else "-" for r in range(results.rounds))
            lines.append(f"| {concurrency} | {_label(variant)} | {cols} |")
    roles = sorted({r for c in results.cells for r in c.cpu_ms if r != "gone"})
    if roles:
        lines += [
            "",
            "CPU ms per output token, by process role, summed over the variant's processes (median over rounds). "
            "*outside fwd* is every role but the forward-pass worker:",
            "",
            "| c | server | " + " | ".join(roles) + " | outside fwd | load generator |",
            "|---|---|" + "---|" * (len(roles) + 2),
        ]
        for concurrency in results.concurrency:
            for variant in results.variants:
                cells = _cells(results, variant, concurrency)
                if not cells:
                    continue
                per_role = [median([c.cpu_ms_per_token(r) for c in cells]) for r in roles]
                total = median([c.outside_forward_ms_per_token() for c in cells])
                loadgen = median([c.loadgen_cpu_ms / max(1, c.tokens()) for c in cells])
                lines.append(
                    f"| {concurrency} | {_label(variant)} | "
                    + " | ".join(f"{v:.2f}" if v else "-" for v in per_role)
                    + f" | {total:.2f} | {loadgen:.2f} |"
                )
    pinned = [c for c in results.cells if c.pin]
    if pinned:
        mine = [int(c.pin.get("server_threads", 0)) for c in pinned]
        other = [int(c.pin.get("other_threads", 0)) for c in pinned]
        bad = sum(int(c.pin.get("mismatched", 0)) + int(c.pin.get("mismatched_after", 0)) for c in pinned)
        where = (
            f"the measured server's tree on CPU {pinned[0].pin.get('server_cpus')}, everything else of the run "
            f"on CPU {pinned[0].pin.get('rest_cpus')}"
            if results.layout == "isolated"
            else "every thread on the mask it started with"
        )
        lines += [
            "",
            f"CPU layout ({where}): set before each of {len(pinned)} cells on {min(mine)}-{max(mine)} "
            f"threads of the measured server and {min(other)}-{max(other)} other threads, read back from "
            f"/proc/<pid>/task/<tid>/status before and after each cell: {bad} threads off their mask.",
        ]
    return lines


def serving_tables(results: ServingResults) -> str:
    lines = [
        f"Tiny random-weight Llama on the CPU; load from {results.client}; {results.rounds} rounds, every "
        f"variant measured in every round, alternated; the project's layout with {results.replicas} replica(s), "
        "the first measured. Each figure: **median over rounds [min, max]**.",
        "",
        "### Headline",
        "",
        headline_table(results),
        "",
        *(["### The routing tier", "", router_table(results), ""] if "routed" in results.variants else []),
        *(["### The model gateway", "", gateway_table(results), ""] if gateway_table(results) else []),
        f"### Every variant ({results.layout} layout)",
        "",
        *_variant_tables(results),
    ]
    idle = ", ".join(f"{_label(v)} {s:.0%}" for v, s in results.idle_cpu_share.items())
    starts = ", ".join(f"{_label(v)} {s:.0f} s" for v, s in results.start_seconds.items())
    waited = sum(c.waited_for_other_server_s for c in results.cells)
    lines += [
        "",
        f"Start to ready (all started at once): {starts}. Idle CPU of each server, all its processes (share of "
        f"one core): {idle}; idle servers kept running while another was measured. Prompts per cell: "
        + ", ".join(f"c={c}: {n}" for c, n in results.prompts.items())
        + f". Serving run: {results.seconds / 60:.1f} min"
        + (f"; waited {waited:.0f} s for another server or Ray cluster to finish." if waited > 1 else "."),
    ]
    return "\n".join(lines)


def failed_requests(results: ServingResults) -> int:
    return sum(c.failed for c in results.cells)


def unread_steps(results: ServingResults) -> list[str]:
    """The cells of a variant whose server's metrics are read (serving_overhead.STEPS_READ) that got no steps."""
    return [
        f"{c.variant} c={c.concurrency} round {c.round + 1}"
        for c in results.cells
        if c.variant in serving_overhead.STEPS_READ and c.completed and c.engine_steps <= 0
    ]


# --------------------------------------------------------------------------- render


def render_tables(results: ScaleResults) -> str:
    labels: list[str] = []
    for sample in results.samples:
        if sample.label not in labels:
            labels.append(sample.label)
    labels.sort(key=lambda lb: (results.samples[[s.label for s in results.samples].index(lb)].models, lb != "prod"))
    lines = [
        f"Each stack rendered {results.repeats} times under mocks, each time in a fresh process, sizes "
        "alternated. *render* is the `infra.render.render()` call; *process* adds the interpreter and imports "
        "(what `python -m infra.render` costs). Median [min, max].",
        "",
        "| stack | models | resources | k8s objects | helm releases | render s | process s | render ms / resource |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_label = {lb: [s for s in results.samples if s.label == lb] for lb in labels}
    for label in labels:
        samples = by_label[label]
        first = samples[0]
        lines.append(
            f"| {label} | {first.models} | {first.resources} | {first.manifests} | {first.helm_releases} "
            f"| {spread([s.render_s for s in samples])} | {spread([s.process_s for s in samples])} "
            f"| {spread([s.render_s / s.resources * 1e3 for s in samples], '{:.1f}')} |"
        )
    fleet = [s for s in results.samples if s.label != "prod"]
    if len(fleet) >= 2 and len({s.models for s in fleet}) >= 2:
        # Fit the per-size medians: one slow outlier render (another job on the
        # machine) must not bend the line.
        sizes_fit = sorted({s.models for s in fleet})
        models = [float(n) for n in sizes_fit]
        times = [median([s.render_s for s in fleet if s.models == n]) for n in sizes_fit]
        resources = [float(next(s.resources for s in fleet if s.models == n)) for n in sizes_fit]
        slope_m, icpt_m, r2_m = least_squares(models, times)
        slope_r, icpt_r, r2_r = least_squares(resources, times)
        per_model_resources, base_resources, _ = least_squares(models, resources)
        lines += [
            "",
            f"Least squares over the per-size medians: render s = {icpt_m:.2f} + "
            f"{slope_m * 1e3:.0f} ms x models (R² {r2_m:.3f}); = {icpt_r:.2f} + {slope_r * 1e3:.1f} ms x resources "
            f"(R² {r2_r:.3f}). Each model adds {per_model_resources:.1f} resources to a base of "
            f"{base_resources:.0f}.",
        ]
        sizes = sorted({s.models for s in fleet})
        med = {n: median([s.render_s for s in fleet if s.models == n]) for n in sizes}
        res = {n: next(s.resources for s in fleet if s.models == n) for n in sizes}
        if len(sizes) >= 3:
            a, b, c = sizes[-3:]
            lines.append(
                f"Linearity: time({c})/time({b}) = {med[c] / med[b]:.2f} against resources({c})/resources({b}) = "
                f"{res[c] / res[b]:.2f}; the increments (time({c})-time({b}))/(time({b})-time({a})) = "
                f"{(med[c] - med[b]) / (med[b] - med[a]):.2f} against "
                f"({res[c]}-{res[b]})/({res[b]}-{res[a]}) resources = {(res[c] - res[b]) / (res[b] - res[a]):.2f} "
                "(equal for a linear cost, larger for a super-linear one)."
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- guard


def guard_table(cases: list[guard_overhead.GuardCase]) -> str:
    lines = [
        "The project's per-request code in front of a dummy streaming ASGI app, called directly (no server); "
        "ten keys configured, the request's key last. *guard*: ApiGuard alone; *server*: all the vllm-server "
        "process runs in front of vLLM's app (drain check, per-key cap, answer reading, access log, counters, "
        "guard), streaming vLLM's own completion events. Median of 7 batches (min, max of the added time).",
        "",
        "| stack | prompt bytes | response chunks | app alone µs | with the stack µs | added µs |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c.stack} | {c.prompt_bytes} | {c.chunks} | {c.bare_us:.1f} | {c.guarded_us:.1f} "
            f"| {c.added_us:.1f} [{c.added_us_min:.1f}, {c.added_us_max:.1f}] |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- chart


def chart(serving: ServingResults | None, scale: ScaleResults | None, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        # The tables are the report; the chart is only a picture of them.
        print("matplotlib is not installed (pip install -r benchmarks/requirements.txt): no report.png")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if serving else 0) + (1 if scale else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    axes = list(axes) if panels > 1 else [axes]
    i = 0
    if serving:
        layout = serving.layout
        width = 0.8 / max(1, len(serving.variants))
        for attr, title, ax in (
            ("rps", f"requests/s, {layout} (median, min, max)", axes[0]),
            ("ttft_p50_ms", f"TTFT p50 ms, {layout}", axes[1]),
        ):
            for j, variant in enumerate(serving.variants):
                meds, lows, highs = [], [], []
                for concurrency in serving.concurrency:
                    values = [getattr(c, attr) for c in _cells(serving, variant, concurrency)]
                    m = median(values)
                    meds.append(m)
                    lows.append(m - min(values) if values else 0)
                    highs.append(max(values) - m if values else 0)
                xs = [k + (j - (len(serving.variants) - 1) / 2) * width for k in range(len(serving.concurrency))]
                ax.bar(xs, meds, width, yerr=[lows, highs], capsize=3, label=_label(variant))
            ax.set_xticks(range(len(serving.concurrency)), [f"c={c}" for c in serving.concurrency])
            ax.set_title(title)
        axes[0].legend(fontsize=8)
        i = 2
    if scale:
        ax = axes[i]
        fleet = [s for s in scale.samples if s.label != "prod"]
        prod = [s for s in scale.samples if s.label == "prod"]
        ax.scatter([s.resources for s in fleet], [s.render_s for s in fleet], label="N-model fleet renders")
        if prod:
            ax.scatter([s.resources for s in prod], [s.render_s for s in prod], marker="x", label="Pulumi.prod.yaml")
        if len({s.models for s in fleet}) >= 2:
            sizes = sorted({s.models for s in fleet})
            slope, icpt, r2 = least_squares(
                [float(next(s.resources for s in fleet if s.models == n)) for n in sizes],
                [median([s.render_s for s in fleet if s.models == n]) for n in sizes],
            )
            xs = [0, max(s.resources for s in fleet)]
            ax.plot(xs, [icpt + slope * x for x in xs], linestyle="--", label=f"least squares on medians (R² {r2:.3f})")
        for n in sorted({s.models for s in fleet}):
            first = next(s for s in fleet if s.models == n)
            ax.annotate(f"{n} models", (first.resources, median([s.render_s for s in fleet if s.models == n])))
        ax.set_xlabel("resources declared")
        ax.set_ylabel("render s (under mocks)")
        ax.set_title("program render time vs fleet size")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- pooling


def pooled(runs: list[ServingResults]) -> ServingResults:
    """Several runs' cells as one run's, each run's rounds numbered after the previous run's.

    Pairs are still made within a round only, so a pooled median is the
    median of every round's own ratio. Runs that measured different things
    (layout, prompt or output length) do not pool.
    """
    if not runs:
        raise ValueError("nothing to pool")
    first = runs[0]
    for run in runs[1:]:
        for field in ("layout", "max_tokens", "input_tokens"):
            if getattr(run, field) != getattr(first, field):
                raise ValueError(f"runs differ in {field} ({getattr(first, field)} and {getattr(run, field)})")
    cells: list[Cell] = []
    offset = 0
    for run in runs:
        cells += [replace(cell, round=cell.round + offset) for cell in run.cells]
        offset += run.rounds
    variants = list(dict.fromkeys(v for run in runs for v in run.variants))
    return replace(
        first,
        variants=variants,
        rounds=offset,
        concurrency=sorted({c for run in runs for c in run.concurrency}),
        prompts={k: v for run in runs for k, v in run.prompts.items()},
        cells=cells,
        seconds=sum(run.seconds for run in runs),
    )


# --------------------------------------------------------------------------- main


def write_report(
    serving: ServingResults | None,
    scale: ScaleResults | None,
    guard: list[guard_overhead.GuardCase] | None,
    out: Path,
    seconds: float,
) -> str:
    parts = [
        "# Benchmark report",
        "",
        f"Python {platform.python_version()} on {platform.machine()}, "
        f"{__import__('os').cpu_count()} CPUs; generated {time.strftime('%Y-%m-%d %H:%M')}; "
        f"whole run {seconds / 60:.1f} min.",
        "",
    ]
    if serving:
        parts += ["## Serving overhead", "", serving_tables(serving), ""]
    if guard:
        parts += ["## The per-request code alone", "", guard_table(guard), ""]
    if scale:
        parts += ["## Program render scale", "", render_tables(scale), ""]
    parts += ["![chart](report.png)", ""]
    text = "\n".join(parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    chart(serving, scale, out / "report.png")
    return text


# What `make bench-quick` runs: every stage once, small, in under three minutes.
QUICK = {"variants": "project,routed,bare", "rounds": 1, "scale": 0.2, "replicas": 1, "sizes": "1,4", "repeats": 1}
QUICK_GUARD_REQUESTS = 2000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Run the benchmarks, write the report.")
    parser.add_argument("--rounds", type=int, default=5, help="serving rounds (every variant each round)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the prompts per serving cell")
    parser.add_argument("--variants", default=",".join(serving_overhead.DEFAULT_VARIANTS))
    parser.add_argument("--layout", choices=serving_overhead.LAYOUTS, default="isolated")
    parser.add_argument("--replicas", type=int, default=serving_overhead.DEFAULT_REPLICAS)
    parser.add_argument("--repeats", type=int, default=3, help="renders of each stack size")
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every stage once and small (project, routed and bare, 1 round, 1 replica, 2 render sizes): a check that "
        "the benchmark runs, not a measurement; fails on any failed request, layout that did not hold or "
        "server whose engine steps went unread",
    )
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-render", action="store_true")
    parser.add_argument("--from-json", action="store_true", help="rebuild the report from results/*.json")
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="rebuild the serving tables from several runs (each DIR holds one run's serving.json), "
        "every round paired within itself; writes to --out",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    began = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    serving: ServingResults | None = None
    scale: ScaleResults | None = None
    guard: list[guard_overhead.GuardCase] | None = None
    if args.pool:
        missing = [str(d) for d in args.pool if not (d / "serving.json").is_file()]
        if missing:
            parser.error(f"--pool: no serving.json in {', '.join(missing)}")
        runs = [ServingResults.from_json(json.loads((d / "serving.json").read_text())) for d in args.pool]
        try:
            serving = pooled(runs)
        except ValueError as exc:
            parser.error(f"--pool: {exc}")
        text = write_report(serving, None, None, out, serving.seconds)
        print(text)
        print(f"\nwrote {out / 'report.md'} and {out / 'report.png'} from {len(runs)} runs, {serving.rounds} rounds")
        return 0
    if args.from_json:
        if (out / "serving.json").is_file():
            serving = ServingResults.from_json(json.loads((out / "serving.json").read_text()))
        if (out / "render.json").is_file():
            scale = ScaleResults.from_json(json.loads((out / "render.json").read_text()))
        if (out / "guard.json").is_file():
            # A run from before the server stack was measured names no stack: it measured the guard.
            raw = json.loads((out / "guard.json").read_text())
            guard = [guard_overhead.GuardCase(**{"stack": "guard", **g}) for g in raw]
    else:
        # Cheapest first: a broken setup shows in seconds, not after the servers' minutes.
        guard = guard_overhead.run(QUICK_GUARD_REQUESTS) if args.quick else guard_overhead.run()
        (out / "guard.json").write_text(json.dumps([asdict(g) for g in guard], indent=2) + "\n")
        if not args.skip_render:
            scale = render_scale.run([int(s) for s in args.sizes.split(",")], args.repeats)
            (out / "render.json").write_text(json.dumps(scale.to_json(), indent=2) + "\n")
        if not args.skip_serving:
            variants = [v.strip() for v in args.variants.split(",") if v.strip()]
            serving = serving_overhead.run(
                variants, args.rounds, args.scale, layout=args.layout, replicas=args.replicas, out=out
            )
            (out / "serving.json").write_text(json.dumps(serving.to_json(), indent=2) + "\n")
    seconds = time.monotonic() - began
    if args.from_json:
        seconds = (serving.seconds if serving else 0.0) + (scale.seconds if scale else 0.0)
    text = write_report(serving, scale, guard, out, seconds)
    print(text)
    print(f"\nwrote {out / 'report.md'} and {out / 'report.png'}")
    if serving is not None and failed_requests(serving):
        print(f"{failed_requests(serving)} requests failed: see the tables and {out / 'client.log'}")
        return 1
    if serving is not None and not args.from_json and unread_steps(serving):
        print("no engine steps read from the server's metrics for: " + ", ".join(unread_steps(serving)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
