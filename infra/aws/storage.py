"""The model bucket: private, KMS-encrypted, versioned, TLS-only and kept when the stack goes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi

from infra.aws.private_bucket import PrivateBucket, PrivateBucketArgs


@dataclass(frozen=True)
class ModelBucketArgs:
    """The bucket's name (storage.model_bucket) and tags."""

    bucket_name: str
    tags: dict[str, str] = field(default_factory=dict)


class ModelBucket(pulumi.ComponentResource):
    """The S3 bucket that holds model weights.

    A PrivateBucket with a KMS key of its own and versioning. The weights
    outlive any one deployment (they take hours to copy in), which is why
    the bucket and its key are kept (see PrivateBucket).
    """

    bucket_name: pulumi.Output[str]
    arn: pulumi.Output[str]
    key_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelBucketArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:ModelBucket", name, None, opts)
        storage = PrivateBucket(
            name,
            PrivateBucketArgs(bucket_name=args.bucket_name, encryption="kms", versioning=True, tags=args.tags),
            owner=self,
        )
        assert storage.key is not None  # encryption="kms"
        self.bucket = storage.bucket
        self.key = storage.key
        self.bucket_name = storage.bucket_name
        self.arn = storage.arn
        self.key_arn = storage.key.arn
        self.register_outputs({"bucket": self.bucket_name, "arn": self.arn, "key_arn": self.key_arn})
