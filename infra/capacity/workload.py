"""A model's workload profile, and the sequences its replica runs at once without preemption at that profile.

vLLM holds each running sequence's prompt and generated tokens in whole KV
blocks, and when a running sequence needs a block and none is free it
preempts one (frees its blocks and recomputes it later from the start). So
the load at which preemption starts is the KV cache's blocks over the
blocks one sequence takes:

- preemption-free concurrency: the usable blocks at the KV band's low end
  (kv_band.py; the conservative end, less vLLM's null block) over the blocks
  of one sequence at the profile's p95 (p95 prompt + p95 output tokens,
  rounded up to whole blocks). Up to that many sequences run at once without
  preemption even if every one of them is a p95 request;
- the recommended max_num_seqs: RECOMMENDED_SHARE of that figure, so that
  traffic a little longer than the profile still runs without preemption
  (and never above vLLM's own default);
- at the mean: the same blocks over a mean sequence, where preemption
  typically begins when requests are ordinary rather than long.

Prefix caching (requests sharing a prompt's blocks) only lowers what a
sequence holds, so the figures stay on the safe side with it on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.capacity.kv_band import KvBand
from infra.capacity.plan import ReplicaPlan

# The recommended max_num_seqs keeps this share of the preemption-free
# concurrency: a tenth of the cache stays free for traffic that runs a tenth
# longer than its profile before the stack is replanned.
RECOMMENDED_SHARE = 0.9
# The percentile the profile and a trace give besides the mean.
PERCENTILE = 0.95


@dataclass(frozen=True)
class Tokens:
    """One side of a request (prompt or output) in tokens: the mean and the 95th percentile."""

    mean: float
    p95: int

    def describe(self) -> str:
        """'1,500 mean / 4,096 p95'."""
        return f"{self.mean:,.0f} mean / {self.p95:,} p95"


@dataclass(frozen=True)
class Workload:
    """The traffic a model is planned for: prompt and output tokens per request, and where the figures come from."""

    prompt: Tokens
    output: Tokens
    # Where the figures come from, as the plan prints it ("models[1].workload", a trace file, the default).
    source: str
    # The stack accepts preemption at p95 (workload.allow_preemption): a max_num_seqs above the
    # preemption-free concurrency is printed as a warning instead of refused.
    allow_preemption: bool = False
    # The stack gave these figures (a workload block or a trace); False for the
    # full-length profile the plan assumes when it gives none (full_length).
    given: bool = True

    @property
    def p95_tokens(self) -> int:
        """The tokens of one sequence at its end when both its prompt and its answer are at p95."""
        return self.prompt.p95 + self.output.p95

    @property
    def mean_tokens(self) -> float:
        """The tokens of a mean sequence at its end."""
        return self.prompt.mean + self.output.mean

    @property
    def mean_context(self) -> float:
        """The KV tokens a mean sequence holds on average while it decodes: its prompt and half its answer."""
        return self.prompt.mean + self.output.mean / 2

    def describe(self) -> str:
        """The profile in one phrase, with its source."""
        return f"prompt {self.prompt.describe()}, output {self.output.describe()} tokens ({self.source})"


def percentile(values: list[int], share: float = PERCENTILE) -> int:
    """The nearest-rank percentile: the smallest value at least `share` of `values` do not exceed."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def profile_of(prompts: list[int], outputs: list[int], source: str, *, allow_preemption: bool = False) -> Workload:
    """The profile of a trace: the mean and p95 of each side over its requests (each side on its own, so the
    p95 sequence, the two p95s together, is at least as long as the trace's 95th-percentile request)."""
    return Workload(
        prompt=Tokens(sum(prompts) / len(prompts), percentile(prompts)),
        output=Tokens(sum(outputs) / len(outputs), percentile(outputs)),
        source=source,
        allow_preemption=allow_preemption,
    )


def full_length(max_model_len: int, max_prompt_tokens: int, max_tokens: int, source: str) -> Workload:
    """Every request at the longest the limits admit: the profile a model that gives none is planned for.

    Nothing is known of its traffic, so the plan takes the worst the server
    lets in (the prompt limit, then the longest answer that still fits the
    context), which never preempts whatever the traffic is; the estimates at
    it are the lowest. A `workload` block gives the plan the real traffic.
    """
    prompt = min(max_prompt_tokens, max_model_len - 1)
    output = max(1, min(max_tokens, max_model_len - prompt))
    return Workload(Tokens(prompt, prompt), Tokens(output, output), source, given=False)


def blocks_for(tokens: float, block_size: int) -> int:
    """Whole KV blocks `tokens` tokens take (at least one)."""
    return max(1, math.ceil(tokens / block_size))


@dataclass(frozen=True)
class Concurrency:
    """How many sequences one replica runs at once at a workload profile, from its KV band's low end."""

    workload: Workload
    block_size: int
    # Blocks at the band's low end, less vLLM's null block.
    usable_blocks: int
    p95_blocks: int
    mean_blocks: int
    # Sequences at p95 that fit at once: above this many running, vLLM may preempt.
    preemption_free: int
    # Mean sequences that fit at once: where preemption typically begins.
    at_mean: int
    recommended: int

    @property
    def usable_tokens(self) -> int:
        """The usable blocks in tokens."""
        return self.usable_blocks * self.block_size

    def preempts(self, max_num_seqs: int) -> bool:
        """Whether `max_num_seqs` sequences at p95 would not fit at once."""
        return max_num_seqs > self.preemption_free

    def arithmetic(self) -> str:
        """How the preemption-free figure is reached, in words and numbers."""
        w = self.workload
        return (
            f"{self.usable_blocks:,} blocks of {self.block_size} at the KV band's low end, null block aside, / "
            f"{self.p95_blocks:,} per p95 sequence of {w.prompt.p95:,} + {w.output.p95:,} tokens = "
            f"{self.preemption_free}"
        )


def concurrency(replica: ReplicaPlan, band: KvBand, workload: Workload) -> Concurrency:
    """The sequences `replica` runs at once at `workload`, its KV at the low end of `band`."""
    block_size = replica.block_size
    usable = max(0, band.blocks.low - 1)
    p95_blocks = blocks_for(workload.p95_tokens, block_size)
    mean_blocks = blocks_for(workload.mean_tokens, block_size)
    free = usable // p95_blocks
    # At least one sequence when one fits: a cache this tight is the KV rule's to judge, not a zero here.
    recommended = min(max(1, math.floor(free * RECOMMENDED_SHARE)), replica.default_max_num_seqs) if free else 0
    return Concurrency(
        workload=workload,
        block_size=block_size,
        usable_blocks=usable,
        p95_blocks=p95_blocks,
        mean_blocks=mean_blocks,
        preemption_free=free,
        at_mean=usable // mean_blocks,
        recommended=recommended,
    )
