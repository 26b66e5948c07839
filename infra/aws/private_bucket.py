"""A private S3 bucket: the one recipe behind the model bucket and the batch results bucket.

Private (every public access blocked, ACLs off), encrypted at rest, TLS
only, written only by the principals named when it names any, and kept:
the bucket is protected (a `pulumi destroy` stops on it) and retained on
delete (leaving the stack does not delete it), and so is its
key when it has one. What differs between buckets is an argument:
the name, the encryption, versioning and an expiry rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import pulumi
import pulumi_aws as aws

from infra.aws import policies

Encryption = Literal["kms", "s3"]
# Parts an upload left behind are deleted after this many days.
ABORT_INCOMPLETE_UPLOADS_DAYS = 1


@dataclass(frozen=True)
class Expiry:
    """A lifecycle rule: objects under `prefix` are deleted `days` days after they were written."""

    rule_id: str
    prefix: str
    days: int


@dataclass(frozen=True)
class PrivateBucketArgs:
    """How one private bucket differs from another."""

    # None: Pulumi names the bucket (a random suffix keeps it globally unique).
    bucket_name: str | None = None
    # `kms`: a customer key of the bucket's own (rotated yearly, kept with the
    # bucket: objects encrypted with a deleted key are lost). `s3`: SSE-S3,
    # encrypted at rest without a key policy every reader would need grants on.
    encryption: Encryption = "kms"
    versioning: bool = False
    expiry: Expiry | None = None
    tags: dict[str, str] = field(default_factory=dict)
    # IAM principals (users, roles) that alone may write and delete objects
    # (policies.private_bucket); None: whoever the account's IAM lets.
    writers: pulumi.Input[Sequence[str]] | None = None


class PrivateBucket:
    """Declares a private bucket and its settings as children of `owner`.

    Deliberately not a ComponentResource of its own. The two buckets it
    serves were deployed before it existed, and a resource's URN names its
    parents: the model bucket's resources are children of the ModelBucket
    component, the results bucket's are children of the BatchQueue
    component directly. A generic component would put a new level into the
    results bucket's URNs; Pulumi would then replace a protected bucket
    unless every one of its resources carried an alias, on every stack,
    for good. Declaring the same resources under whichever component owns
    the bucket keeps every URN as it was, with no alias: ModelBucket and
    BatchQueues stay the components, and this class is the one place the
    bucket's resources are written down.
    """

    key: aws.kms.Key | None
    bucket: aws.s3.Bucket

    def __init__(self, name: str, args: PrivateBucketArgs, owner: pulumi.Resource) -> None:
        self._name = name
        self._args = args
        self._child = pulumi.ResourceOptions(parent=owner)
        self._keep = pulumi.ResourceOptions(parent=owner, protect=True, retain_on_delete=True)
        self.key = self._key() if args.encryption == "kms" else None
        self.bucket = aws.s3.Bucket(name, bucket=args.bucket_name, force_destroy=False, tags=args.tags, opts=self._keep)
        public_access = self._block_public_access()
        self._encrypt()
        if args.versioning:
            self._enable_versioning()
        if args.expiry is not None:
            self._expire(args.expiry)
        writers = pulumi.Output.from_input(args.writers if args.writers is not None else [])
        aws.s3.BucketPolicy(
            name,
            bucket=self.bucket.id,
            policy=pulumi.Output.json_dumps(
                pulumi.Output.all(self.bucket.arn, writers).apply(lambda a: policies.private_bucket(a[0], a[1]))
            ),
            # S3 rejects a policy while the public access block is being set.
            opts=pulumi.ResourceOptions(parent=owner, depends_on=[public_access]),
        )

    @property
    def bucket_name(self) -> pulumi.Output[str]:
        """The bucket's name."""
        return self.bucket.bucket

    @property
    def arn(self) -> pulumi.Output[str]:
        """The bucket's ARN."""
        return self.bucket.arn

    @property
    def key_arn(self) -> pulumi.Output[str] | None:
        """The bucket key's ARN; None with SSE-S3."""
        return self.key.arn if self.key is not None else None

    def _key(self) -> aws.kms.Key:
        where = f"s3://{self._args.bucket_name}" if self._args.bucket_name else f"bucket {self._name}"
        return aws.kms.Key(
            f"{self._name}-key",
            description=f"Default encryption of {where}",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=self._args.tags,
            opts=self._keep,
        )

    def _block_public_access(self) -> aws.s3.BucketPublicAccessBlock:
        """No public ACL or policy, and bucket-owner-enforced ownership (ACLs off)."""
        public_access = aws.s3.BucketPublicAccessBlock(
            self._name,
            bucket=self.bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=self._child,
        )
        aws.s3.BucketOwnershipControls(
            self._name,
            bucket=self.bucket.id,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=self._child,
        )
        return public_access

    def _encrypt(self) -> None:
        by_default = aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs
        if self.key is not None:
            rule = aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                apply_server_side_encryption_by_default=by_default(
                    sse_algorithm="aws:kms", kms_master_key_id=self.key.arn
                ),
                # One data key per bucket instead of one KMS call per object
                # read: multi-GB safetensors are read in many parts.
                bucket_key_enabled=True,
            )
        else:
            rule = aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                apply_server_side_encryption_by_default=by_default(sse_algorithm="AES256"),
            )
        aws.s3.BucketServerSideEncryptionConfiguration(
            self._name, bucket=self.bucket.id, rules=[rule], opts=self._child
        )

    def _enable_versioning(self) -> None:
        aws.s3.BucketVersioning(
            self._name,
            bucket=self.bucket.id,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
            opts=self._child,
        )

    def _expire(self, expiry: Expiry) -> None:
        aws.s3.BucketLifecycleConfiguration(
            self._name,
            bucket=self.bucket.id,
            rules=[
                aws.s3.BucketLifecycleConfigurationRuleArgs(
                    id=expiry.rule_id,
                    status="Enabled",
                    filter=aws.s3.BucketLifecycleConfigurationRuleFilterArgs(prefix=expiry.prefix),
                    expiration=aws.s3.BucketLifecycleConfigurationRuleExpirationArgs(days=expiry.days),
                    abort_incomplete_multipart_upload=aws.s3.BucketLifecycleConfigurationRuleAbortIncompleteMultipartUploadArgs(
                        days_after_initiation=ABORT_INCOMPLETE_UPLOADS_DAYS
                    ),
                )
            ],
            opts=self._child,
        )
