"""One recipe, two buckets: the model bucket and the batch results bucket are both PrivateBuckets."""

from __future__ import annotations

import json
from typing import Any

import pulumi
import pytest

from infra.aws import policies
from infra.aws.private_bucket import Expiry, PrivateBucket, PrivateBucketArgs
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
    assert json.loads(parts[POLICY]["inputs"]["policy"]) == policies.bucket_tls_only(arn)


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
