"""A model's `workload`: the traffic its capacity is planned for, as figures or as a trace of past requests.

The capacity plan turns it into the sequences one replica runs at once
without preemption, the recommended `max_num_seqs` and the estimates at that
profile (infra/capacity/workload.py); the preemption rule
(infra/capacity/rules.py) refuses a `max_num_seqs` above what the KV cache
holds at the profile's p95. A model without one is planned for the longest
requests `serving.limits` admit (`workload_profile`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from infra.capacity.workload import Tokens, full_length, profile_of
from infra.capacity.workload import Workload as Profile
from infra.config.fields import Section
from infra.config.problems import Problem
from workloads.inference_server.catalog import RequestLimits

# A relative trace path is read from the project's folder (where Pulumi.yaml is), as `pulumi` runs the program.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class TokenStats(Section):
    """Tokens per request on one side of it: the mean and the 95th percentile."""

    mean: float = Field(gt=0, description="Mean tokens per request.")
    p95: int = Field(gt=0, description="95th percentile of tokens per request.")

    @model_validator(mode="after")
    def _check_order(self) -> TokenStats:
        if self.p95 < self.mean:
            raise ValueError(f"p95 ({self.p95}) must be at least the mean ({self.mean:g})")
        return self


class TraceError(ValueError):
    """A trace file that can not be read as requests' usage."""


@cache
def _read_trace(path: Path, mtime_ns: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each request's (prompt tokens, output tokens) of a JSON Lines trace; cached per file version."""
    prompts: list[int] = []
    outputs: list[int] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"line {number} is not JSON") from None
        usage = record.get("usage", record) if isinstance(record, dict) else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        output = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not (type(prompt) is int and prompt > 0 and type(output) is int and output >= 0):
            raise TraceError(
                f"line {number} has no usage with prompt_tokens (> 0) and completion_tokens (>= 0) as integers"
            )
        prompts.append(prompt)
        outputs.append(output)
    if not prompts:
        raise TraceError("holds no request")
    return tuple(prompts), tuple(outputs)


def trace_path(value: str) -> Path:
    """Where a `trace` value points: absolute, or under the project's folder."""
    path = Path(value)
    return path if path.is_absolute() else PROJECT_ROOT / path


def read_trace(value: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (prompt tokens, output tokens) of every request of the trace `value`; raise TraceError saying why not."""
    path = trace_path(value)
    if not path.is_file():
        raise TraceError(f"no such file {path}")
    return _read_trace(path, path.stat().st_mtime_ns)


class Workload(Section):
    """The traffic a model's capacity is planned for: prompt and output tokens per request.

    Either both figures (`prompt_tokens`, `output_tokens`) or a `trace`. The
    plan sizes `max_num_seqs` so that a replica's KV cache holds every running
    sequence at once even when each is a p95 request (prompt p95 + output
    p95 tokens), and gives its estimates at the mean.
    """

    prompt_tokens: TokenStats | None = Field(
        default=None, description="Prompt tokens per request, as the engine counts them (after the chat template)."
    )
    output_tokens: TokenStats | None = Field(default=None, description="Generated tokens per request.")
    trace: str | None = Field(
        default=None,
        description=(
            "Past requests instead of the figures: a JSON Lines file (absolute, or relative to the project's "
            "folder), one request a line, each an OpenAI `usage` object or an object holding one under `usage` "
            "(prompt_tokens, completion_tokens). The plan takes each side's mean and p95 over its requests."
        ),
    )
    allow_preemption: bool = Field(
        default=False,
        description=(
            "Accept a max_num_seqs above what the KV cache holds at the profile's p95: the plan prints a warning "
            "instead of refusing it, and the preemption alerts follow the plan's figure."
        ),
    )

    @field_validator("trace")
    @classmethod
    def _check_trace(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                read_trace(value)
            except TraceError as err:
                raise ValueError(f"{value}: {err}") from None
        return value

    @model_validator(mode="after")
    def _check_source(self) -> Workload:
        figures = (self.prompt_tokens is not None, self.output_tokens is not None)
        if self.trace is not None:
            if any(figures):
                raise ValueError("give prompt_tokens and output_tokens, or a trace, not both")
        elif not all(figures):
            raise ValueError("give both prompt_tokens and output_tokens (the mean and p95 of each), or a trace")
        return self

    def profile(self) -> Profile:
        """The profile the capacity plan reads."""
        if self.trace is not None:
            prompts, outputs = read_trace(self.trace)
            source = f"trace {self.trace}, {len(prompts):,} requests"
            return profile_of(list(prompts), list(outputs), source, allow_preemption=self.allow_preemption)
        assert self.prompt_tokens is not None and self.output_tokens is not None
        return Profile(
            prompt=_tokens(self.prompt_tokens),
            output=_tokens(self.output_tokens),
            source="its workload block",
            allow_preemption=self.allow_preemption,
        )


def _tokens(stats: TokenStats) -> Tokens:
    return Tokens(stats.mean, stats.p95)


NO_WORKLOAD = "no workload given: every request at the longest serving.limits admits"


def workload_profile(workload: Workload | None, max_model_len: int, limits: RequestLimits) -> Profile:
    """A model's profile: its `workload`, else every request at the longest the limits admit."""
    if workload is not None:
        return workload.profile()
    return full_length(max_model_len, limits.max_prompt_tokens, limits.max_tokens, NO_WORKLOAD)


def check_workload(path: str, workload: Workload | None, max_model_len: int) -> Iterable[Problem]:
    """A p95 request fits the model's context: the plan sizes the KV cache for it."""
    if workload is None:
        return
    profile = workload.profile()
    if profile.p95_tokens > max_model_len:
        key = f"{path}.workload" + (".trace" if workload.trace is not None else "")
        yield Problem(
            key,
            f"a p95 request of {profile.prompt.p95:,} prompt + {profile.output.p95:,} output = "
            f"{profile.p95_tokens:,} tokens exceeds max_model_len {max_model_len:,}: the engine would refuse it "
            "(lower the figures to the traffic this model serves, or raise max_model_len)",
        )
