"""The cluster's default StorageClass: encrypted gp3 on the EBS CSI driver.

Written by hand because it is one object: no chart ships a StorageClass
whose encryption, IOPS and throughput come from this stack's config.
"""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra.cluster_services.parts import PartContext
from infra.config import StorageClass

EBS_CSI_PROVISIONER = "ebs.csi.aws.com"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"


def storage_class_parameters(cfg: StorageClass) -> dict[str, str]:
    """The EBS CSI driver's parameters (all strings, as the API requires)."""
    params = {
        "type": "gp3",
        "encrypted": "true",
        "iops": str(cfg.iops),
        "throughput": str(cfg.throughput_mibps),
    }
    if cfg.kms_key_arn:
        params["kmsKeyId"] = cfg.kms_key_arn
    return params


class DefaultStorageClass(pulumi.ComponentResource):
    """The default StorageClass every PersistentVolumeClaim without one gets."""

    name: str

    def __init__(self, resource_name: str, cfg: StorageClass, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llm-platform:platform:StorageClass", resource_name, None, opts)
        self.name = cfg.name
        self.storage_class = k8s.storage.v1.StorageClass(
            f"{resource_name}-class",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=cfg.name,
                annotations={DEFAULT_CLASS_ANNOTATION: "true"},
            ),
            provisioner=EBS_CSI_PROVISIONER,
            parameters=storage_class_parameters(cfg),
            # Bind in the zone the pod is scheduled to: an EBS volume can
            # only attach in its own zone.
            volume_binding_mode="WaitForFirstConsumer",
            allow_volume_expansion=True,
            reclaim_policy="Delete",
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"name": self.name})


def build(name: str, ctx: PartContext, opts: pulumi.ResourceOptions) -> DefaultStorageClass:
    """The encrypted gp3 default StorageClass."""
    return DefaultStorageClass(name, ctx.cfg.storage.storage_class, opts)
