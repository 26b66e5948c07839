"""The `storage` section: the model bucket the weights live in, and the volumes nodes cache them on."""

from __future__ import annotations

from pydantic import Field

from infra.config.fields import K8sName, Section


class StorageClass(Section):
    """The default gp3 StorageClass."""

    name: K8sName = "gp3-encrypted"
    iops: int = Field(default=3000, ge=3000, le=16000)
    throughput_mibps: int = Field(default=125, ge=125, le=1000)
    kms_key_arn: str | None = None


class Storage(Section):
    """Where model weights live and how nodes cache them."""

    model_bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
    model_cache_gib: int = Field(default=200, ge=10)
    storage_class: StorageClass = StorageClass()
    # IAM users or roles that may write and delete weights in the model
    # bucket, besides the principal that deploys the stack; the bucket
    # policy denies every other principal of the account (infra/aws/policies.py
    # model_bucket_writers_only).
    weights_writer_arns: list[str] = Field(default_factory=list)
