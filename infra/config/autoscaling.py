"""The `autoscaling` section: cluster-autoscaler's behaviour, and the pre-scale windows with their cron rules."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from pydantic import Field

from infra.config.fields import Duration, K8sName, Section
from infra.config.node_groups import GpuNodeGroupSettings
from infra.config.problems import Problem


class PreScale(Section):
    """A window of warm GPU capacity held ahead of a known peak."""

    name: K8sName
    gpu_group: str
    nodes: int = Field(ge=1)
    timezone: str = "UTC"
    start: str = Field(description="cron expression when the window opens")
    # How long before the peak `start` fires: the warm nodes must be up, and a
    # replica started on them, by the peak (the cold-start rule's lead time).
    lead_seconds: int = Field(default=1800, ge=0)
    end: str = Field(description="cron expression when the window closes")


class ClusterAutoscaling(Section):
    """cluster-autoscaler behaviour."""

    expander: Literal["least-waste", "priority", "most-pods", "random", "price"] = "least-waste"
    scale_down_unneeded_time: Duration = "10m"
    scale_down_delay_after_add: Duration = "10m"
    max_node_provision_time: Duration = "15m"


class Autoscaling(Section):
    """The node and schedule layers of autoscaling (Serve's is per model)."""

    cluster: ClusterAutoscaling = ClusterAutoscaling()
    prescale: list[PreScale] = Field(default_factory=list)


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# KEDA's cron scaler: minute hour day-of-month month day-of-week, the ranges
# its parser accepts (Sunday is 0 only), names for months and weekdays.
_CRON_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {name: i + 1 for i, name in enumerate(_MONTHS)}),
    ("day of week", 0, 6, {name: i for i, name in enumerate(_WEEKDAYS)}),
)


def _cron_value(token: str, low: int, high: int, names: dict[str, int]) -> str | int:
    """The number a cron token stands for, or why it is not one."""
    value = names.get(token.lower()) if names and token.isalpha() else (int(token) if token.isdigit() else None)
    if value is None:
        return f"'{token}' is not a number{' or a name' if names else ''}"
    if not low <= value <= high:
        return f"{value} is outside {low}-{high}"
    return value


def _cron_part_problem(part: str, low: int, high: int, names: dict[str, int]) -> str | None:
    """Why one comma-separated part of a cron field is wrong (`*`, `a`, `a-b`, each with an optional `/step`)."""
    body, slash, step = part.partition("/")
    if slash and not (step.isdigit() and int(step) > 0):
        return f"step '{step}' is not a positive number"
    if body in ("*", "?"):
        return None
    ends = [_cron_value(token, low, high, names) for token in body.split("-", 1)]
    for end in ends:
        if isinstance(end, str):
            return end
    if len(ends) == 2 and int(ends[0]) > int(ends[1]):
        return f"range {body} runs backwards"
    return None


def cron_problem(expression: str) -> str | None:
    """Why a 5-field cron expression is wrong, or None."""
    fields = expression.split()
    if len(fields) != len(_CRON_FIELDS):
        return f"'{expression}' is not a 5-field cron expression (minute hour day-of-month month day-of-week)"
    for text, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        for part in text.split(","):
            problem = _cron_part_problem(part, low, high, names)
            if problem:
                return f"'{expression}': {name} {problem}"
    return None


def timezone_problem(name: str) -> str | None:
    """Why a time zone name is not an IANA zone, or None (zoneinfo, with the tzdata package as fallback)."""
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        close = difflib.get_close_matches(name, available_timezones(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"'{name}' is not an IANA time zone{hint}"
    return None


def check_prescale(prescale: list[PreScale], groups: dict[str, GpuNodeGroupSettings]) -> Iterable[Problem]:
    """Each window names a GPU group it fits, cron expressions KEDA parses, and an IANA time zone."""
    for i, window in enumerate(prescale):
        path = f"autoscaling.prescale[{i}]"
        group = groups.get(window.gpu_group)
        if group is None:
            yield Problem(f"{path}.gpu_group", f"'{window.gpu_group}' is not a GPU node group")
        elif window.nodes > group.max_size:
            yield Problem(
                f"{path}.nodes",
                f"{window.nodes} nodes exceed node group '{group.name}' max_size {group.max_size}",
            )
        for key, expression in (("start", window.start), ("end", window.end)):
            problem = cron_problem(expression)
            if problem:
                yield Problem(f"{path}.{key}", problem)
        zone_problem = timezone_problem(window.timezone)
        if zone_problem:
            yield Problem(f"{path}.timezone", zone_problem)
