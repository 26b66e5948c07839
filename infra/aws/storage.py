"""The model bucket: private, KMS-encrypted, versioned, TLS-only and kept when the stack goes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.aws.private_bucket import PrivateBucket, PrivateBucketArgs


@dataclass(frozen=True)
class ModelBucketArgs:
    """The bucket's name (storage.model_bucket) and tags."""

    bucket_name: str
    tags: dict[str, str] = field(default_factory=dict)
    # The IAM users or roles that copy weights in (storage.weights_writer_arns).
    writer_arns: Sequence[str] = ()
    # Whether the principal running the deploy may write too: how the
    # README's upload path (`aws s3 sync` with the deploying credentials)
    # keeps working without a list.
    deployer_writes: bool = True


class ModelBucket(pulumi.ComponentResource):
    """The S3 bucket that holds model weights.

    A PrivateBucket with a KMS key of its own and versioning. The weights
    outlive any one deployment (they take hours to copy in), which is why
    the bucket and its key are kept (see PrivateBucket).

    Only its writers may put or delete objects: the principal that deploys
    the stack (the IAM role behind its session, or the user) and
    `writer_arns`. Any other principal of the account, whatever its IAM
    policies say, can not replace the weights the servers load.
    """

    bucket_name: pulumi.Output[str]
    arn: pulumi.Output[str]
    key_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelBucketArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:aws:ModelBucket", name, None, opts)
        storage = PrivateBucket(
            name,
            PrivateBucketArgs(
                bucket_name=args.bucket_name,
                encryption="kms",
                versioning=True,
                tags=args.tags,
                writers=self._writers(args),
            ),
            owner=self,
        )
        assert storage.key is not None  # encryption="kms"
        self.bucket = storage.bucket
        self.key = storage.key
        self.bucket_name = storage.bucket_name
        self.arn = storage.arn
        self.key_arn = storage.key.arn
        self.register_outputs({"bucket": self.bucket_name, "arn": self.arn, "key_arn": self.key_arn})

    def _writers(self, args: ModelBucketArgs) -> pulumi.Output[list[str]]:
        named = list(args.writer_arns)
        if not args.deployer_writes:
            return pulumi.Output.from_input(named)
        # A role session's ARN (sts ... assumed-role/<role>/<session>) is not
        # what a bucket policy matches: aws:PrincipalArn is the role's own
        # ARN, path included, which is the session context's issuer.
        caller = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self))
        issuer = aws.iam.get_session_context_output(
            arn=caller.arn, opts=pulumi.InvokeOutputOptions(parent=self)
        ).issuer_arn
        return issuer.apply(lambda deployer: [deployer, *named])
