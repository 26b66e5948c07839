"""A replica's KV cache as a band: the calibrated non-KV memory (calibration.py) applied to the plan's stages.

The plan (plan.py) gives each pipeline stage's weights and KV bytes per token;
calibration.py gives the CUDA total and the non-KV overheads, each with a low
and a high end. The band's ends are turned into blocks and tokens by the
plan's own rules (the null block aside, as vLLM logs "GPU KV cache size").
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.capacity.calibration import Range, cuda_memory, kv_memory_band, overhead_band
from infra.capacity.geometry import Geometry
from infra.capacity.plan import DEFAULT_BLOCK_SIZE, GIB, Device, EngineSettings, run_of, stages
from infra.instance_types import GpuInstanceType


@dataclass(frozen=True)
class KvBand:
    """A replica's KV cache between two assumptions: per GPU of the binding stage, and in tokens."""

    memory: Range
    tokens: Range
    # vLLM's blocks at each end (the null block included), which tokens are counted from.
    blocks: Range
    low_assumption: str
    high_assumption: str

    def describe(self) -> str:
        """One line: the token band and what each end assumes."""
        return (
            f"{self.tokens.low:,}-{self.tokens.high:,} KV tokens (low: {self.low_assumption}; "
            f"high: {self.high_assumption})"
        )


def replica_kv_band(
    geometry: Geometry, parameters_billion: float, engine: EngineSettings, gpu: GpuInstanceType
) -> KvBand:
    """The KV band of one replica under the pinned vLLM: each stage's band, the fewest blocks, in tokens."""
    device, total = Device.of(gpu), cuda_memory(gpu)
    run = run_of(engine, device)
    # The plan gives each stage's weights and KV bytes per token; its single memory figure is not used.
    staged = stages(geometry, parameters_billion * 1e9, engine, device)
    overs = [overhead_band(geometry, run, last_stage=s.rank == len(staged) - 1) for s in staged]
    if engine.kv_cache_memory_bytes is not None:
        memory = [Range(engine.kv_cache_memory_bytes, engine.kv_cache_memory_bytes)] * len(staged)
    else:
        memory = [
            kv_memory_band(total, engine.gpu_memory_utilization, s.weight_bytes, o)
            for s, o in zip(staged, overs, strict=True)
        ]
    block_size = engine.block_size or DEFAULT_BLOCK_SIZE[device.platform]
    blocks = [
        Range(*(max(0, m // (block_size * s.kv_bytes_per_token)) for m in (r.low, r.high)))
        for s, r in zip(staged, memory, strict=True)
    ]
    binding = min(range(len(staged)), key=lambda i: blocks[i].low)
    per_sequence = -(-engine.max_model_len // block_size)

    def tokens(num_blocks: int) -> int:
        # As the plan (and vLLM's start-up log) turns blocks into tokens.
        return int(num_blocks / per_sequence * engine.max_model_len)

    name, over = gpu.ray_accelerator_type, overs[binding]
    fewest = Range(min(b.low for b in blocks), min(b.high for b in blocks))
    return KvBand(
        memory=memory[binding],
        tokens=Range(tokens(fewest.low), tokens(fewest.high)),
        blocks=fewest,
        low_assumption=f"{name} reports {total.low_bytes / GIB:.2f} GiB to CUDA; {over.describe('high')}",
        high_assumption=f"{name} reports {total.high_bytes / GIB:.2f} GiB to CUDA; {over.describe('low')}",
    )
