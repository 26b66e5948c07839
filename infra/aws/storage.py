"""The model bucket: private, KMS-encrypted, versioned, TLS-only and kept when the stack goes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.aws import policies


@dataclass(frozen=True)
class ModelBucketArgs:
    """The bucket's name (storage.model_bucket) and tags."""

    bucket_name: str
    tags: dict[str, str] = field(default_factory=dict)


class ModelBucket(pulumi.ComponentResource):
    """The S3 bucket that holds model weights.

    The weights outlive any one deployment (they take hours to copy in), so
    the bucket and its key are protected (a `pulumi destroy` stops on them)
    and retained on delete (leaving the stack does not delete them). The key
    is kept with the bucket: objects encrypted with a deleted key are lost.
    """

    bucket_name: pulumi.Output[str]
    arn: pulumi.Output[str]
    key_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelBucketArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:ModelBucket", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        keep = pulumi.ResourceOptions(parent=self, protect=True, retain_on_delete=True)

        self.key = aws.kms.Key(
            f"{name}-key",
            description=f"Default encryption of s3://{args.bucket_name}",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=args.tags,
            opts=keep,
        )
        self.bucket = aws.s3.Bucket(
            name,
            bucket=args.bucket_name,
            force_destroy=False,
            tags=args.tags,
            opts=keep,
        )
        public_access = aws.s3.BucketPublicAccessBlock(
            name,
            bucket=self.bucket.id,
            block_public_acls=True,
            block_public_policy=True,
            ignore_public_acls=True,
            restrict_public_buckets=True,
            opts=child,
        )
        aws.s3.BucketOwnershipControls(
            name,
            bucket=self.bucket.id,
            rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
            opts=child,
        )
        aws.s3.BucketServerSideEncryptionConfiguration(
            name,
            bucket=self.bucket.id,
            rules=[
                aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                        sse_algorithm="aws:kms", kms_master_key_id=self.key.arn
                    ),
                    # One data key per bucket instead of one KMS call per
                    # object read: multi-GB safetensors are read in many parts.
                    bucket_key_enabled=True,
                )
            ],
            opts=child,
        )
        aws.s3.BucketVersioning(
            name,
            bucket=self.bucket.id,
            versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
            opts=child,
        )
        aws.s3.BucketPolicy(
            name,
            bucket=self.bucket.id,
            policy=pulumi.Output.json_dumps(self.bucket.arn.apply(policies.bucket_tls_only)),
            # S3 rejects a policy while the public access block is being set.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[public_access]),
        )
        self.bucket_name = self.bucket.bucket
        self.arn = self.bucket.arn
        self.key_arn = self.key.arn
        self.register_outputs({"bucket": self.bucket_name, "arn": self.arn, "key_arn": self.key_arn})
