"""The batch queue: SQS requests in, a dead-letter queue beside it, results out to S3.

Results go to a bucket of their own rather than to the model bucket: the
model pods may only read the model bucket, and a bucket holding answers
(user data, short-lived) wants a different lifecycle and different readers
than one holding weights (large, kept for good).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.aws import policies
from infra.aws.layer import BatchQueue
from infra.aws.private_bucket import Expiry, PrivateBucket, PrivateBucketArgs
from infra.config import Batch

RESULTS_PREFIX = "results/"
# Answers are fetched by the client that asked; after this they are gone.
RESULTS_RETENTION_DAYS = 30
# Requests older than this were never going to be wanted (SQS allows up to 14 days).
REQUEST_RETENTION_SECONDS = 4 * 24 * 3600
# The dead-letter queue keeps failed requests as long as SQS allows, for a
# person to look at and redrive.
DEAD_LETTER_RETENTION_SECONDS = 14 * 24 * 3600
# Long polling by default: a receive waits up to this for a message instead
# of returning empty at once (fewer empty, billed receives).
RECEIVE_WAIT_SECONDS = 20


def queue_names(cluster_name: str) -> tuple[str, str]:
    """The request queue's and the dead-letter queue's names (at most 80 characters each)."""
    return f"{cluster_name}-batch", f"{cluster_name}-batch-dlq"


def redrive_policy(dead_letter_arn: str, max_receive_count: int) -> str:
    """The request queue's redrive policy: after `max_receive_count` receives, to the dead-letter queue."""
    return json.dumps({"deadLetterTargetArn": dead_letter_arn, "maxReceiveCount": max_receive_count})


def redrive_allow_policy(source_arn: str) -> str:
    """Only the request queue may use the dead-letter queue."""
    return json.dumps({"redrivePermission": "byQueue", "sourceQueueArns": [source_arn]})


@dataclass(frozen=True)
class BatchQueueArgs:
    """The batch settings, the cluster the queues are named after, the region and tags."""

    settings: Batch
    cluster_name: str
    region: str
    tags: dict[str, str] = field(default_factory=dict)


class BatchQueues(pulumi.ComponentResource):
    """The request queue and its dead-letter queue (SSE, TLS only), and the results bucket.

    The results bucket is a PrivateBucket (private, TLS-only, protected like
    the model bucket: it holds answers a redeploy can not recreate) with
    SSE-S3, so that readers of results need no grants on a key, and it
    expires results after RESULTS_RETENTION_DAYS.
    """

    queue: BatchQueue

    def __init__(self, name: str, args: BatchQueueArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:BatchQueue", name, None, opts)
        settings = args.settings
        queue, dlq = self._queues(name, args)
        results = PrivateBucket(
            f"{name}-results",
            PrivateBucketArgs(
                encryption="s3",
                expiry=Expiry(rule_id="expire-results", prefix=RESULTS_PREFIX, days=RESULTS_RETENTION_DAYS),
                tags=args.tags,
            ),
            owner=self,
        )
        self.queue = BatchQueue(
            url=queue.id,
            arn=queue.arn,
            dead_letter_url=dlq.id,
            dead_letter_arn=dlq.arn,
            results_bucket=results.bucket_name,
            results_bucket_arn=results.arn,
            results_prefix=RESULTS_PREFIX,
            region=args.region,
            visibility_timeout_seconds=settings.visibility_timeout_seconds,
        )
        self.register_outputs(
            {
                "queue_url": self.queue.url,
                "dead_letter_queue_url": self.queue.dead_letter_url,
                "results_bucket": self.queue.results_bucket,
            }
        )

    def _queues(self, name: str, args: BatchQueueArgs) -> tuple[aws.sqs.Queue, aws.sqs.Queue]:
        """The request queue and its dead-letter queue, each with a TLS-only policy."""
        child = pulumi.ResourceOptions(parent=self)
        settings = args.settings
        queue_name, dlq_name = queue_names(args.cluster_name)
        dlq = aws.sqs.Queue(
            f"{name}-dlq",
            name=dlq_name,
            message_retention_seconds=DEAD_LETTER_RETENTION_SECONDS,
            sqs_managed_sse_enabled=True,
            tags=args.tags,
            opts=child,
        )
        queue = aws.sqs.Queue(
            name,
            name=queue_name,
            visibility_timeout_seconds=settings.visibility_timeout_seconds,
            message_retention_seconds=REQUEST_RETENTION_SECONDS,
            receive_wait_time_seconds=RECEIVE_WAIT_SECONDS,
            sqs_managed_sse_enabled=True,
            redrive_policy=dlq.arn.apply(lambda arn: redrive_policy(arn, settings.max_receive_count)),
            tags=args.tags,
            opts=child,
        )
        # A queue's id is its URL (the provider's `url` attribute repeats it).
        aws.sqs.RedriveAllowPolicy(
            f"{name}-dlq",
            queue_url=dlq.id,
            redrive_allow_policy=queue.arn.apply(redrive_allow_policy),
            opts=child,
        )
        for logical, q in ((name, queue), (f"{name}-dlq", dlq)):
            aws.sqs.QueuePolicy(
                logical,
                queue_url=q.id,
                policy=pulumi.Output.json_dumps(q.arn.apply(policies.queue_tls_only)),
                opts=child,
            )
        return queue, dlq
