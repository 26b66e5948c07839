"""The batch worker's settings and message schema (pydantic only).

The Pulumi program imports this module to write the worker Deployment's
environment, and the worker parses the very same model at start: a setting
renamed on one side fails the tests, not a pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# What a client may use as a request id: it becomes the result's object key,
# so no slashes, no dot-segments, nothing that needs escaping.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# SQS hands out at most ten messages per receive.
MAX_RECEIVE_BATCH = 10
# The longest long-poll SQS allows.
MAX_WAIT_SECONDS = 20


class BatchRequest(BaseModel):
    """One queued request: a client-chosen id and an OpenAI chat/completions request body.

    Example message body:
    ``{"id": "invoice-42", "body": {"messages": [{"role": "user", "content": "..."}], "max_tokens": 256}}``.
    `body.model` may be left out (the worker fills in its model); streaming is not offered.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=REQUEST_ID_PATTERN)
    body: dict[str, Any]


class WorkerSettings(BaseModel):
    """Everything the worker reads from its environment (field alias = variable name)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    queue_url: str = Field(alias="BATCH_QUEUE_URL", min_length=1)
    region: str = Field(alias="AWS_REGION", min_length=1)
    results_bucket: str = Field(alias="BATCH_RESULTS_BUCKET", min_length=3)
    results_prefix: str = Field(default="results/", alias="BATCH_RESULTS_PREFIX")
    # The model every request goes to (the OpenAI `model` field).
    model: str = Field(alias="BATCH_MODEL", min_length=1)
    # The serve Service's OpenAI base URL, ending in /v1.
    base_url: str = Field(alias="INFERENCE_BASE_URL", pattern=r"^https?://.+/v1$")
    api_keys_file: str = Field(alias="INFERENCE_API_KEYS_FILE", min_length=1)
    # Requests one worker keeps in flight.
    concurrency: int = Field(default=8, alias="BATCH_CONCURRENCY", ge=1)
    # One request's whole budget; kept inside the queue's visibility timeout
    # so a message is never handed to a second worker while the first still works on it.
    request_timeout_seconds: float = Field(alias="BATCH_REQUEST_TIMEOUT_SECONDS", gt=0)
    # First retry delay after a 5xx, a 401 (key rotation) or a timeout; doubles with
    # each receive. A message without a readable id comes back after this delay
    # every time, so SQS's redrive moves it to the dead-letter queue promptly.
    retry_delay_seconds: int = Field(default=30, alias="BATCH_RETRY_DELAY_SECONDS", ge=0, le=43200)
    wait_seconds: int = Field(default=MAX_WAIT_SECONDS, alias="BATCH_WAIT_SECONDS", ge=0, le=MAX_WAIT_SECONDS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerSettings:
        """The settings from environment variables (unrelated variables are ignored)."""
        names = set(env_names().values())
        return cls.model_validate({k: v for k, v in environ.items() if k in names})

    def result_key(self, request_id: str) -> str:
        """The S3 key of one request's result."""
        return f"{self.results_prefix}{request_id}.json"


def env_names() -> dict[str, str]:
    """Setting name -> environment variable name."""
    return {name: str(f.alias) for name, f in WorkerSettings.model_fields.items()}
