"""Small statistics helpers shared by the benchmarks (standard library only)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def median_interval(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The median's percentile-bootstrap interval: the middle ``confidence`` of the medians of resamples.

    Each resample draws ``len(values)`` values with replacement; the seed is
    fixed, so a report rebuilt from the same rounds prints the same interval.
    A round's ratio on a shared machine swings far more than the median
    does, so the interval, not the rounds' min and max, says whether a
    median at a target's edge is over it or not yet known.
    """
    if not values:
        return math.nan, math.nan
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)]
    tail = (1.0 - confidence) / 2.0 * 100.0
    return percentile(medians, tail), percentile(medians, 100.0 - tail)


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """``median [min, max]`` as text: the form every table in the report uses."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Slope, intercept and R² of the ordinary least-squares line through (xs, ys)."""
    n = len(xs)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    ss_tot = sum((y - mean_y) ** 2 for y in ys)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot else 1.0
    return slope, intercept, r2
