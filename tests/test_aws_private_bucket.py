"""One recipe, two buckets: the model bucket and the batch results bucket are both PrivateBuckets."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import pulumi
import pytest

from infra.aws import policies
from infra.aws.private_bucket import Expiry, PrivateBucket, PrivateBucketArgs
from infra.mocks import ACCOUNT_ID
from infra.render import run_under_mocks
from tests.harness import render_stack

BUCKET = "aws:s3/bucket:Bucket"
KEY = "aws:kms/key:Key"
PUBLIC_ACCESS = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
OWNERSHIP = "aws:s3/bucketOwnershipControls:BucketOwnershipControls"
ENCRYPTION = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
VERSIONING = "aws:s3/bucketVersioning:BucketVersioning"
LIFECYCLE = "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration"
POLICY = "aws:s3/bucketPolicy:BucketPolicy"
OWNER = "test:index:Owner"

# (bucket's logical name, the component that owns it): prod has batch on.
STACK_BUCKETS = [("model-bucket", "model-bucket"), ("batch-queue-results", "batch-queue")]


def _declare(args: PrivateBucketArgs) -> list[dict[str, Any]]:
    """A PrivateBucket named `data` under a component of a test type, under the mocks."""

    class Owner(pulumi.ComponentResource):
        def __init__(self) -> None:
            super().__init__(OWNER, "owner")
            PrivateBucket("data", args, owner=self)
            self.register_outputs({})

    async def program() -> None:
        Owner()

    return run_under_mocks("test", {"aws:region": "us-east-1"}, [], program)


def _by_type(resources: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    parts = {r["type"]: r for r in resources if r["type"] != OWNER}
    assert len(parts) == len([r for r in resources if r["type"] != OWNER]), "one resource of each type"
    return parts


def _sse(part: dict[str, Any]) -> dict[str, Any]:
    (rule,) = part["inputs"]["rules"]
    return dict(rule)


def _check_private_tls_only_and_kept(parts: dict[str, dict[str, Any]], arn: str) -> None:
    bucket = parts[BUCKET]
    assert bucket["protect"] and bucket["retain_on_delete"]
    assert not bucket["inputs"].get("forceDestroy")
    block = parts[PUBLIC_ACCESS]["inputs"]
    assert all(
        block[f] is True for f in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    )
    assert parts[OWNERSHIP]["inputs"]["rule"] == {"objectOwnership": "BucketOwnerEnforced"}
    # TLS only first; a bucket with writers adds their statement after it.
    statements = json.loads(parts[POLICY]["inputs"]["policy"])["Statement"]
    assert statements[0] == policies.bucket_tls_only(arn)["Statement"][0]


@pytest.mark.parametrize(("name", "owner"), STACK_BUCKETS)
def test_both_buckets_of_the_stack_are_private_tls_only_and_kept(name: str, owner: str) -> None:
    resources = render_stack("prod").resources
    parts = _by_type([r for r in resources if r["name"] in (name, f"{name}-key") and r["parent"] == owner])
    assert {BUCKET, PUBLIC_ACCESS, OWNERSHIP, ENCRYPTION, POLICY} <= set(parts)
    _check_private_tls_only_and_kept(parts, f"arn:aws:s3:::{parts[BUCKET]['inputs'].get('bucket', name)}")


def test_the_model_bucket_has_a_kept_key_of_its_own_and_versions() -> None:
    resources = render_stack("prod").resources
    parts = _by_type([r for r in resources if r["parent"] == "model-bucket"])
    assert set(parts) == {KEY, BUCKET, PUBLIC_ACCESS, OWNERSHIP, ENCRYPTION, VERSIONING, POLICY}
    assert parts[KEY]["protect"] and parts[KEY]["retain_on_delete"]
    rule = _sse(parts[ENCRYPTION])
    assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
    assert rule["bucketKeyEnabled"] is True


def test_only_the_deployer_and_the_listed_writers_may_replace_the_weights() -> None:
    resources = render_stack("prod").resources
    parts = _by_type([r for r in resources if r["parent"] == "model-bucket"])
    arn = f"arn:aws:s3:::{parts[BUCKET]['inputs']['bucket']}"
    policy = json.loads(parts[POLICY]["inputs"]["policy"])
    # The mocks deploy as the account root, whose session issuer is itself.
    assert policy == policies.private_bucket(arn, [f"arn:aws:iam::{ACCOUNT_ID}:root"])
    (deny,) = [s for s in policy["Statement"] if s["Sid"] == "DenyObjectWritesByOthers"]
    assert deny["Effect"] == "Deny" and deny["Principal"] == "*" and deny["Resource"] == f"{arn}/*"
    # Every way to change what a key holds: a write (multipart uploads included), a delete, a
    # delete of one version (which would bring an older object back), and replication's writes.
    assert set(deny["Action"]) == {
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:DeleteObjectVersion",
        "s3:ReplicateObject",
        "s3:ReplicateDelete",
    }
    # The results bucket names no writers: the batch workers' role writes there.
    results = _by_type([r for r in resources if r["name"] == "batch-queue-results"])
    assert len(json.loads(results[POLICY]["inputs"]["policy"])["Statement"]) == 1


def _denied(policy: dict[str, Any], principal_arn: str, action: str, resource: str) -> bool:
    """Whether one of the policy's Deny statements matches (the conditions this module writes)."""
    for stmt in policy["Statement"]:
        actions = stmt["Action"] if isinstance(stmt["Action"], list) else [stmt["Action"]]
        resources = stmt["Resource"] if isinstance(stmt["Resource"], list) else [stmt["Resource"]]
        if stmt["Effect"] != "Deny" or not any(fnmatch.fnmatchcase(action, a) for a in actions):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in resources):
            continue
        condition = stmt.get("Condition", {})
        if "ArnNotEquals" in condition and principal_arn in condition["ArnNotEquals"]["aws:PrincipalArn"]:
            continue
        if "Bool" in condition:  # aws:SecureTransport false: every request here is over TLS
            continue
        return True
    return False


def test_a_write_by_any_other_principal_is_denied_and_reads_are_not() -> None:
    bucket = "arn:aws:s3:::weights"
    uploader = "arn:aws:iam::123456789012:role/ci/weights-upload"
    policy = policies.private_bucket(bucket, [uploader, uploader])
    (deny,) = policy["Statement"][1:]
    assert deny["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": [uploader]}}
    other = "arn:aws:iam::123456789012:role/some-app"
    key = f"{bucket}/meta-llama/Llama-3.1-8B-Instruct/model.safetensors"
    for action in policies.OBJECT_WRITES:
        assert _denied(policy, other, action, key)
        assert not _denied(policy, uploader, action, key)
    assert not _denied(policy, other, "s3:GetObject", key)
    # Without writers nothing but plain HTTP is denied (the results bucket).
    assert policies.private_bucket(bucket) == policies.bucket_tls_only(bucket)


def test_the_results_bucket_uses_sse_s3_and_expires_results() -> None:
    resources = render_stack("prod").resources
    parts = _by_type([r for r in resources if r["name"] == "batch-queue-results"])
    assert set(parts) == {BUCKET, PUBLIC_ACCESS, OWNERSHIP, ENCRYPTION, LIFECYCLE, POLICY}
    assert _sse(parts[ENCRYPTION]) == {"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}
    (rule,) = parts[LIFECYCLE]["inputs"]["rules"]
    assert rule["filter"] == {"prefix": "results/"} and rule["expiration"] == {"days": 30}


def test_every_part_is_a_child_of_the_owner_so_its_urn_names_the_owner() -> None:
    resources = _declare(PrivateBucketArgs(bucket_name="weights-test", encryption="kms", versioning=True))
    parts = [r for r in resources if r["type"] != OWNER]
    assert {r["parent"] for r in parts} == {"owner"}
    assert {r["urn"] for r in parts} == {
        f"urn:pulumi:test::llm-platform::{OWNER}${r['type']}::{'data-key' if r['type'] == KEY else 'data'}"
        for r in parts
    }


def test_kms_encryption_makes_a_kept_key_and_uses_it() -> None:
    parts = _by_type(_declare(PrivateBucketArgs(bucket_name="weights-test", encryption="kms")))
    assert set(parts) == {KEY, BUCKET, PUBLIC_ACCESS, OWNERSHIP, ENCRYPTION, POLICY}
    key = parts[KEY]
    assert key["protect"] and key["retain_on_delete"]
    assert key["inputs"]["enableKeyRotation"] is True
    assert key["inputs"]["description"] == "Default encryption of s3://weights-test"
    default = _sse(parts[ENCRYPTION])["applyServerSideEncryptionByDefault"]
    assert default["sseAlgorithm"] == "aws:kms" and default["kmsMasterKeyId"].startswith("arn:aws:kms:")
    assert parts[BUCKET]["inputs"]["bucket"] == "weights-test"
    _check_private_tls_only_and_kept(parts, "arn:aws:s3:::weights-test")


def test_sse_s3_makes_no_key_and_an_unnamed_bucket_is_named_by_pulumi() -> None:
    expiry = Expiry(rule_id="expire-scratch", prefix="scratch/", days=3)
    parts = _by_type(_declare(PrivateBucketArgs(encryption="s3", expiry=expiry)))
    assert set(parts) == {BUCKET, PUBLIC_ACCESS, OWNERSHIP, ENCRYPTION, LIFECYCLE, POLICY}
    assert "bucket" not in parts[BUCKET]["inputs"]
    assert _sse(parts[ENCRYPTION]) == {"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}
    (rule,) = parts[LIFECYCLE]["inputs"]["rules"]
    assert rule == {
        "id": "expire-scratch",
        "status": "Enabled",
        "filter": {"prefix": "scratch/"},
        "expiration": {"days": 3},
        "abortIncompleteMultipartUpload": {"daysAfterInitiation": 1},
    }
    _check_private_tls_only_and_kept(parts, "arn:aws:s3:::data")


def test_the_configured_writers_join_the_deployer() -> None:
    from infra.aws.build import build_aws
    from tests.harness import stack_config

    uploader = "arn:aws:iam::123456789012:role/ci/weights-upload"

    def writers(config: dict[str, Any]) -> None:
        config["llm-platform:storage"]["weights_writer_arns"] = [uploader]

    cfg = stack_config("dev", writers)

    async def program() -> None:
        build_aws(cfg)

    resources = run_under_mocks("dev", {"aws:region": cfg.region}, [], program)
    (policy,) = [r for r in resources if r["type"] == POLICY and r["parent"] == "model-bucket"]
    (deny,) = json.loads(policy["inputs"]["policy"])["Statement"][1:]
    assert deny["Condition"]["ArnNotEquals"]["aws:PrincipalArn"] == sorted(
        [uploader, f"arn:aws:iam::{ACCOUNT_ID}:root"]
    )
