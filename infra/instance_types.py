"""GPU instance types the platform knows how to place models on.

Only what the config rules and the node templates need: the GPU model, how
many GPUs one node has, each GPU's memory, and the host's size. The Ray
accelerator type is the name Ray Serve LLM uses to place a replica
(`accelerator_type` in LLMConfig) and the custom resource a Ray worker
advertises so the autoscaler can scale a group up from zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInstanceType:
    """One EC2 GPU instance type."""

    name: str
    gpu_model: str
    gpus: int
    gpu_memory_gib: int
    vcpus: int
    memory_gib: int
    ray_accelerator_type: str


def _family(
    gpu_model: str, gpu_memory_gib: int, accel: str, sizes: dict[str, tuple[int, int, int]]
) -> dict[str, GpuInstanceType]:
    return {
        name: GpuInstanceType(name, gpu_model, gpus, gpu_memory_gib, vcpus, mem, accel)
        for name, (gpus, vcpus, mem) in sizes.items()
    }


# (GPUs, vCPUs, memory GiB) per size, from the EC2 instance type pages.
GPU_INSTANCE_TYPES: dict[str, GpuInstanceType] = {
    **_family(
        "A10G",
        24,
        "A10G",
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
        "L4",
        24,
        "L4",
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
        "L40S",
        48,
        "L40S",
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
    **_family("A100", 40, "A100-40G", {"p4d.24xlarge": (8, 96, 1152)}),
    **_family("A100", 80, "A100-80G", {"p4de.24xlarge": (8, 96, 1152)}),
    **_family("H100", 80, "H100", {"p5.48xlarge": (8, 192, 2048)}),
    **_family("H200", 141, "H200", {"p5e.48xlarge": (8, 192, 2048), "p5en.48xlarge": (8, 192, 2048)}),
}
