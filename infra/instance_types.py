"""GPU instance types the platform knows how to place models on.

Only what the config rules, the node templates and the capacity plan need:
the GPU model, how many GPUs one node has, each GPU's memory and memory
bandwidth, and the host's size. The Ray accelerator type is the name Ray
Serve LLM uses to place a replica (`accelerator_type` in LLMConfig) and the
custom resource a Ray worker advertises so the autoscaler can scale a group
up from zero.

GPU memory is held in GB (10^9 bytes), as NVIDIA's datasheets state it: 24 GB
for the A10G and L4, 48 GB for the L40S, 40 or 80 GB for the A100, 80 GB for
the H100, 141 GB for the H200. AWS's instance-type pages head the same
figures "GPU memory (GiB)", and its API is not consistent either
(describe-instance-types gives a g5's A10G 24,576 MiB, i.e. 24 GiB, but a
p4de's eight A100s 610,352 MiB, i.e. 8 x 80 GB). Reading the nominal 24 as
GiB overstates the memory by 7.4% (2^30 / 10^9). Neither is what CUDA
reports, which is what vLLM's `gpu_memory_utilization` is a share of: the
GDDR6 cards report less than their datasheet's GB (an L4 23,612,293,120
bytes, so 24 x 10^9 is 1.6% too much; the A10G 0.8-1.3% and the L40S
0.4-0.9%), the HBM cards more (an A100 40GB 39.56 GiB, 6% above 40 x 10^9).
The capacity plan and the weights rule (infra/config/models.py) therefore
take each GPU's CUDA total from infra/capacity/calibration.py (`CUDA_MEMORY`,
every figure with its source); the datasheet figure here names the card.

Memory bandwidth is the datasheet's peak in GB/s; the capacity plan's decode
estimate (infra/capacity/) is bound by it.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class GpuInstanceType:
    """One EC2 GPU instance type."""

    name: str
    gpu_model: str
    gpus: int
    gpu_memory_gb: int
    memory_bandwidth_gb_s: int
    vcpus: int
    memory_gib: int
    ray_accelerator_type: str

    @property
    def gpu_memory_bytes(self) -> int:
        """One GPU's memory in bytes (the datasheet's GB, 10^9 bytes each)."""
        return self.gpu_memory_gb * GB

    @property
    def memory_bandwidth_bytes_s(self) -> int:
        """One GPU's peak memory bandwidth in bytes per second."""
        return self.memory_bandwidth_gb_s * GB


@dataclass(frozen=True)
class _Gpu:
    """A GPU model from its datasheet: memory in GB, peak memory bandwidth in GB/s."""

    model: str
    memory_gb: int
    bandwidth_gb_s: int
    ray_accelerator_type: str


# NVIDIA datasheets: A10G (AWS's A10 variant) 24 GB GDDR6 at 600 GB/s; L4
# 24 GB GDDR6 at 300 GB/s; L40S 48 GB GDDR6 at 864 GB/s; A100 SXM 40 GB HBM2
# at 1,555 GB/s and 80 GB HBM2e at 2,039 GB/s; H100 SXM 80 GB HBM3 at
# 3,350 GB/s; H200 141 GB HBM3e at 4,800 GB/s.
A10G = _Gpu("A10G", 24, 600, "A10G")
L4 = _Gpu("L4", 24, 300, "L4")
L40S = _Gpu("L40S", 48, 864, "L40S")
A100_40G = _Gpu("A100", 40, 1555, "A100-40G")
A100_80G = _Gpu("A100", 80, 2039, "A100-80G")
H100 = _Gpu("H100", 80, 3350, "H100")
H200 = _Gpu("H200", 141, 4800, "H200")


def _family(gpu: _Gpu, sizes: dict[str, tuple[int, int, int]]) -> dict[str, GpuInstanceType]:
    return {
        name: GpuInstanceType(
            name, gpu.model, gpus, gpu.memory_gb, gpu.bandwidth_gb_s, vcpus, mem, gpu.ray_accelerator_type
        )
        for name, (gpus, vcpus, mem) in sizes.items()
    }


# (GPUs, vCPUs, memory GiB) per size, from the EC2 instance type pages.
GPU_INSTANCE_TYPES: dict[str, GpuInstanceType] = {
    **_family(
        A10G,
        {
            "g5.xlarge": (1, 4, 16),
            "g5.2xlarge": (1, 8, 32),
            "g5.4xlarge": (1, 16, 64),
            "g5.8xlarge": (1, 32, 128),
            "g5.12xlarge": (4, 48, 192),
            "g5.24xlarge": (4, 96, 384),
            "g5.48xlarge": (8, 192, 768),
        },
    ),
    **_family(
        L4,
        {
            "g6.xlarge": (1, 4, 16),
            "g6.2xlarge": (1, 8, 32),
            "g6.4xlarge": (1, 16, 64),
            "g6.8xlarge": (1, 32, 128),
            "g6.12xlarge": (4, 48, 192),
            "g6.24xlarge": (4, 96, 384),
            "g6.48xlarge": (8, 192, 768),
        },
    ),
    **_family(
        L40S,
        {
            "g6e.xlarge": (1, 4, 32),
            "g6e.2xlarge": (1, 8, 64),
            "g6e.4xlarge": (1, 16, 128),
            "g6e.8xlarge": (1, 32, 256),
            "g6e.12xlarge": (4, 48, 384),
            "g6e.24xlarge": (4, 96, 768),
            "g6e.48xlarge": (8, 192, 1536),
        },
    ),
    **_family(A100_40G, {"p4d.24xlarge": (8, 96, 1152)}),
    **_family(A100_80G, {"p4de.24xlarge": (8, 96, 1152)}),
    **_family(H100, {"p5.48xlarge": (8, 192, 2048)}),
    **_family(H200, {"p5e.48xlarge": (8, 192, 2048), "p5en.48xlarge": (8, 192, 2048)}),
}


@dataclass(frozen=True)
class HostIo:
    """A GPU instance type's network and local disk, as the cold-start budget and the S3 loader size them.

    `network_gbps` is the EC2 page's figure; for "up to" sizes it is the
    burst, which a single cold start (tens of GiB) stays within, and
    `network_burst` says so. `instance_store_gb` is the total NVMe instance
    store (0: none), which the node bootstrap stripes as RAID0.
    """

    network_gbps: float
    network_burst: bool
    instance_store_gb: int

    @property
    def network_bytes_s(self) -> float:
        """The network's line rate in bytes per second."""
        return self.network_gbps * 1e9 / 8


# Network bandwidth (Gbps) and instance store (GB, NVMe SSD) from the EC2
# accelerated-computing instance type pages (aws.amazon.com/ec2/instance-types/
# g5, g6, g6e, p4, p5, "Network bandwidth" and "Instance storage" columns), 2026-06.
_UP_TO = True
HOST_IO: dict[str, HostIo] = {
    "g5.xlarge": HostIo(10, _UP_TO, 250),
    "g5.2xlarge": HostIo(10, _UP_TO, 450),
    "g5.4xlarge": HostIo(25, _UP_TO, 600),
    "g5.8xlarge": HostIo(25, False, 900),
    "g5.12xlarge": HostIo(40, False, 3800),
    "g5.24xlarge": HostIo(50, False, 3800),
    "g5.48xlarge": HostIo(100, False, 7600),
    "g6.xlarge": HostIo(10, _UP_TO, 250),
    "g6.2xlarge": HostIo(10, _UP_TO, 450),
    "g6.4xlarge": HostIo(25, _UP_TO, 600),
    "g6.8xlarge": HostIo(25, False, 900),
    "g6.12xlarge": HostIo(40, False, 3760),
    "g6.24xlarge": HostIo(50, False, 3760),
    "g6.48xlarge": HostIo(100, False, 7520),
    "g6e.xlarge": HostIo(20, _UP_TO, 250),
    "g6e.2xlarge": HostIo(20, _UP_TO, 450),
    "g6e.4xlarge": HostIo(20, False, 600),
    "g6e.8xlarge": HostIo(25, False, 900),
    "g6e.12xlarge": HostIo(100, False, 3800),
    "g6e.24xlarge": HostIo(200, False, 3800),
    "g6e.48xlarge": HostIo(400, False, 7600),
    "p4d.24xlarge": HostIo(400, False, 8000),
    "p4de.24xlarge": HostIo(400, False, 8000),
    "p5.48xlarge": HostIo(3200, False, 30720),
    "p5e.48xlarge": HostIo(3200, False, 30720),
    "p5en.48xlarge": HostIo(3200, False, 30720),
}


def host_io(instance_type: str) -> HostIo:
    """The network and instance store of a GPU instance type (every type of GPU_INSTANCE_TYPES has a row)."""
    return HOST_IO[instance_type]
