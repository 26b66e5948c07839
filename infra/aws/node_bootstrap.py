"""GPU node bootstrap: instance-store RAID0 and SOCI parallel image pull, as user data per OS.

Shared by the managed node groups' launch templates (node_groups.py) and any
other provisioner that launches the same AMIs (`gpu_user_data`).

Image pull: SOCI parallel pull mode, not a pre-pulled data volume.
- Both EKS-optimised GPU OS families ship the SOCI snapshotter with its
  parallel pull/unpack mode since 2025-08 (AL2023: nodeadm's `FastImagePull`
  feature gate; Bottlerocket: `settings.container-runtime.snapshotter =
  "soci"` and `settings.container-runtime-plugins.soci-snapshotter.*`).
- It needs nothing from the image pipeline: it fetches an unmodified image's
  layers in ranged chunks over many connections and unpacks layers in
  parallel, which is what a 10+ GB image of a few huge CUDA layers lacks
  (containerd's default pulls 3 layers over one connection each, unpacks
  one at a time). Lazy loading (a SOCI index) would help little: vLLM reads
  most of the CUDA libraries before it can serve.
- A pre-pulled Bottlerocket data volume (an EBS snapshot with the image) is
  tied to one image digest: every image build would need a new snapshot and
  launch template version, and a volume restored from a snapshot reads
  lazily from S3 unless Fast Snapshot Restore is paid for per zone; it also
  exists on Bottlerocket only.
Parallel pull spends CPU and memory while pulling; a GPU node has nothing
else to do then. Unpacked layers land on the instance-store RAID0 below.

Instance store: the NVMe disks of g5/g6/g6e/p4/p5 are striped as one RAID0
and hold containerd's and kubelet's directories, so image layers, emptyDirs
(vLLM's compile caches, ray_service.engine_cache_env) and logs are on local
NVMe, not on the gp3 root volume (125 MiB/s baseline). Instance store is
wiped with the instance: only caches live there.
"""

from __future__ import annotations

import json
from typing import Any

AL2023 = "AL2023"
BOTTLEROCKET = "BOTTLEROCKET"
NODEADM_CONTENT_TYPE = "application/node.eks.aws"
MIME_BOUNDARY = "//llm-platform-node-bootstrap//"
# nodeadm's gate for the SOCI snapshotter in parallel pull mode (amazon-eks-ami
# nodeadm, "Enabling fast image pull"); its instance-store strategy for RAID0.
FAST_IMAGE_PULL_GATE = "FastImagePull"
LOCAL_STORAGE_STRATEGY = "RAID0"
# Bottlerocket: what the ephemeral-storage RAID0 is bound over (its
# `apiclient ephemeral-storage` commands): the runtimes' and kubelet's state.
BOTTLEROCKET_BIND_DIRS = (
    "/var/lib/containerd",
    "/var/lib/soci-snapshotter",
    "/var/lib/kubelet",
    "/var/log/pods",
)
# Parallel pull tuning on Bottlerocket, for a node that pulls one big image:
# more concurrent downloads per image than containerd's 3, chunks big enough
# that S3-backed ECR serves each at full speed, unpacks in parallel, and
# compressed layers dropped once unpacked (they would only fill the disk).
SOCI_DOWNLOADS_PER_IMAGE = 20
SOCI_CHUNK_SIZE = "16mb"
SOCI_UNPACKS_PER_IMAGE = 8


def os_family(ami_type: str) -> str:
    """AL2023 or BOTTLEROCKET, from an EKS AMI type ("AL2023_x86_64_NVIDIA", "BOTTLEROCKET_x86_64_NVIDIA")."""
    for family in (AL2023, BOTTLEROCKET):
        if ami_type.startswith(family):
            return family
    raise ValueError(f"no node bootstrap for AMI type '{ami_type}'")


def nodeadm_config(instance_store: bool) -> dict[str, Any]:
    """The partial NodeConfig nodeadm merges with the one EKS writes for a managed node group."""
    spec: dict[str, Any] = {"featureGates": {FAST_IMAGE_PULL_GATE: True}}
    if instance_store:
        spec["instance"] = {"localStorage": {"strategy": LOCAL_STORAGE_STRATEGY}}
    return {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig", "spec": spec}


def bottlerocket_settings(instance_store: bool) -> dict[str, Any]:
    """Bottlerocket settings (TOML in user data) EKS merges with the cluster settings it writes."""
    settings: dict[str, Any] = {
        "container-runtime": {"snapshotter": "soci"},
        "container-runtime-plugins": {
            "soci-snapshotter": {
                "pull-mode": "parallel-pull-unpack",
                "parallel-pull-unpack": {
                    "max-concurrent-downloads-per-image": SOCI_DOWNLOADS_PER_IMAGE,
                    "concurrent-download-chunk-size": SOCI_CHUNK_SIZE,
                    "max-concurrent-unpacks-per-image": SOCI_UNPACKS_PER_IMAGE,
                    "discard-unpacked-layers": True,
                },
            }
        },
    }
    if instance_store:
        # Before kubelet and containerd start: stripe the NVMe disks, then
        # bind their directories onto the array.
        settings["bootstrap-commands"] = {
            "k8s-ephemeral-storage": {
                "commands": [
                    ["apiclient", "ephemeral-storage", "init"],
                    ["apiclient", "ephemeral-storage", "bind", "--dirs", *BOTTLEROCKET_BIND_DIRS],
                ],
                "essential": True,
                "mode": "always",
            }
        }
    return {"settings": settings}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """Nested tables as TOML `[a.b]` sections; enough for Bottlerocket settings (no arrays of tables)."""
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    out = "\n".join(lines)
    for key, table in tables.items():
        name = f"{prefix}.{_key(key)}" if prefix else _key(key)
        section = to_toml(table, name)
        out = f"{out}\n\n{section}" if out else section
    return out


def _key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else json.dumps(key)


def mime_multipart(part: str, content_type: str) -> str:
    """User data as the MIME multipart document EKS merges its own nodeadm part into."""
    return (
        "MIME-Version: 1.0\n"
        f'Content-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"\n\n'
        f"--{MIME_BOUNDARY}\n"
        f"Content-Type: {content_type}\n\n"
        f"{part}\n"
        f"--{MIME_BOUNDARY}--\n"
    )


def gpu_user_data(ami_type: str, instance_store: bool) -> str:
    """A GPU node's user data (plain text; base64 it for a launch template): RAID0 when it has NVMe, SOCI pull.

    AL2023: a MIME part of content type application/node.eks.aws with a
    NodeConfig. Bottlerocket: TOML settings.
    """
    if os_family(ami_type) == AL2023:
        return mime_multipart(json.dumps(nodeadm_config(instance_store), indent=2), NODEADM_CONTENT_TYPE)
    return to_toml(bottlerocket_settings(instance_store)) + "\n"
