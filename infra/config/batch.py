"""The `batch` section: queue-fed batch inference, and the rule that its requests end inside their visibility."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import Field

from infra.config.fields import Section
from infra.config.observability import Slo
from infra.config.problems import Problem
from infra.config.serving import longest_generation
from workloads.inference_server.catalog import RequestLimits

# A batch request must end this long before its message's visibility
# timeout, so the answer is stored and the message deleted while the worker
# still holds it.
BATCH_VISIBILITY_MARGIN_SECONDS = 30


class Batch(Section):
    """Queue-fed batch inference: SQS requests, KEDA-scaled workers, results in S3."""

    enabled: bool = False
    # The served model's model_id the workers send every request to.
    model: str | None = None
    min_workers: int = Field(default=0, ge=0)
    max_workers: int = Field(default=4, ge=1)
    # KEDA's target backlog (visible plus in-flight messages) per worker; each
    # worker also keeps this many requests in flight at once.
    messages_per_worker: int = Field(default=8, ge=1)
    # A received message stays hidden this long; a worker's request must end
    # well inside it (SQS allows at most 12 hours).
    visibility_timeout_seconds: int = Field(default=900, ge=60, le=43200)
    # Receives before a message moves to the dead-letter queue.
    max_receive_count: int = Field(default=5, ge=1, le=1000)

    def request_timeout_seconds(self) -> int:
        """One request's budget in a worker: inside the visibility timeout, leaving time to store the answer."""
        return self.visibility_timeout_seconds - BATCH_VISIBILITY_MARGIN_SECONDS


def check_batch(batch: Batch, model_ids: list[str], limits: RequestLimits, slo: Slo) -> Iterable[Problem]:
    """An enabled batch names a served model, and a worker's request timeout outlasts the longest generation."""
    if not batch.enabled:
        return
    if batch.model is None:
        yield Problem("batch.model", "required when batch.enabled is true")
    elif batch.model not in model_ids:
        yield Problem("batch.model", f"'{batch.model}' is not a configured model_id (have: {', '.join(model_ids)})")
    if batch.min_workers > batch.max_workers:
        yield Problem("batch.min_workers", f"{batch.min_workers} exceeds max_workers {batch.max_workers}")
    longest = math.ceil(longest_generation(limits, slo))
    if batch.request_timeout_seconds() < longest:
        yield Problem(
            "batch.visibility_timeout_seconds",
            f"{batch.visibility_timeout_seconds} s leaves a worker a request timeout of "
            f"{batch.request_timeout_seconds()} s ({BATCH_VISIBILITY_MARGIN_SECONDS} s go to storing the answer), "
            f"below the longest generation the limits allow: {slo.ttft_p95_seconds} s to the first token + "
            f"{limits.max_tokens} tokens x {slo.inter_token_p95_seconds} s (the SLO p95s) = {longest} s; "
            "such requests would time out on every receive and end in the dead-letter queue: "
            f"set at least {longest + BATCH_VISIBILITY_MARGIN_SECONDS}",
        )
