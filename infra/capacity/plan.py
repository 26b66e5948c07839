"""One model replica under vLLM's memory rules: weights, KV cache, blocks, tokens and sequences per GPU.

The rules are those of the pinned vLLM (0.29), read in its code:

- Layers are split over the pipeline stages as `vllm.distributed.utils.get_pp_indices`
  does; attention and MLP weights are sharded over the TP ranks, the
  vocabulary (padded to 64) too, the embedding on the first stage and the LM
  head on the last.
- A KV page per layer is `block_size x 2 (K and V) x KV heads per GPU x head_dim
  x KV dtype bytes` (`AttentionSpec.page_size_bytes`); KV heads per GPU are
  `max(1, KV heads // TP)` (`ModelConfig.get_num_kv_heads`); `kv_cache_dtype`
  fp8 stores one byte per value.
- The memory left for the KV cache is `ceil(GPU memory x gpu_memory_utilization)`
  less the weights and the non-KV overheads that vLLM profiles at start-up
  (`Worker.determine_available_memory`): the activation peak of a
  `max_num_batched_tokens` forward pass or of the sampler, memory outside
  PyTorch that grew after its start-up snapshot (NCCL's communicators are set
  up before it, so they are not counted) and the CUDA graphs it will capture.
  GPU memory is the total CUDA reports, not the datasheet's GB. With
  `kv_cache_memory_bytes` set vLLM skips all of that and takes the number as
  given, per GPU.
- Blocks are that memory // (page x layers of the stage), the smallest stage
  binding (`get_kv_cache_configs`); one block is held back (the null block)
  when vLLM checks that one `max_model_len` sequence fits, and the KV token
  capacity it logs at start-up ("GPU KV cache size: N tokens") is
  `int(blocks / ceil(max_model_len / block_size) x max_model_len)`.

The overheads are estimates (vLLM measures them on the GPU): the plan takes
the midpoint of each term of calibration.py's band and the low end of the
CUDA total, so its figure lies inside the band kv_band.py prints (see
OVERHEADS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from infra.capacity.calibration import (
    FIRST_CAPTURE,
    NON_TORCH,
    PARALLEL_NON_TORCH,
    PER_GRAPH,
    PINNED_VLLM,
    SAMPLER_COPIES,
    Range,
    Run,
    cuda_memory,
    overhead_band,
)
from infra.capacity.geometry import Geometry
from infra.instance_types import GpuInstanceType
from workloads.inference_server.catalog import ModelEntry

GIB = 2**30
MIB = 2**20

# Weights bytes per parameter for the dtype the engine loads them in ("auto":
# the checkpoints served here are bfloat16), and per quantized parameter.
DTYPE_BYTES: dict[str, int] = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
QUANT_BYTES: dict[str, float] = {"fp8": 1.0, "awq": 0.5, "gptq": 0.5, "bitsandbytes": 0.5}
# KV cache bytes per value for the `kv_cache_dtype` engine argument ("auto": the model's dtype).
KV_CACHE_DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)

Platform = Literal["cuda", "cpu"]
# vLLM's block size when the engine arguments leave it out: 16 on CUDA
# (CacheConfig.DEFAULT_BLOCK_SIZE, FlashAttention's preference), 128 on the CPU backend.
DEFAULT_BLOCK_SIZE: dict[Platform, int] = {"cuda": 16, "cpu": 128}
# vLLM pads the vocabulary of its embedding and LM head to a multiple of this.
VOCAB_PADDING = 64


def _gib_range(r: Range) -> str:
    return f"{r.low / GIB:.2f}-{r.high / GIB:.2f} GiB"


# The non-KV memory model in words, from calibration.py's own constants (the plan's notes print it).
OVERHEADS = (
    "non-KV memory per GPU, estimated as vLLM 0.29 profiles it at start-up, each term the midpoint of a band fitted "
    "to published vLLM start-up logs (infra/capacity/calibration.py): the larger of one max_num_batched_tokens "
    "forward pass (tokens x (2 x hidden + 3 x intermediate / TP) x dtype bytes) and the sampler's warm-up "
    f"(min(max_num_seqs, tokens) x vocabulary x 4 B x {SAMPLER_COPIES[0]}-{SAMPLER_COPIES[1]} copies, last pipeline "
    f"stage only); {_gib_range(NON_TORCH)} outside PyTorch (+0-{PARALLEL_NON_TORCH / GIB:.2f} GiB with TP or PP: "
    "NCCL's communicators are set up before vLLM's start-up snapshot and come out of the 1 - "
    "gpu_memory_utilization slack, so no separate allowance); CUDA graphs as vLLM estimates them, its first capture "
    f"of each mode {FIRST_CAPTURE.low // MIB}-{FIRST_CAPTURE.high // MIB} MiB and {PER_GRAPH.low // MIB}-"
    f"{PER_GRAPH.high // MIB} MiB per further graph (none with enforce_eager). With kv_cache_memory_bytes vLLM "
    "skips profiling and takes it as given."
)
# A running sequence holds, on average, this share of max_model_len in the
# KV cache (its prompt and half its answer, typically): what the in-flight
# rule (rules.py) assumes of the requests a replica queues. The recommended
# max_num_seqs and the estimates read the model's workload profile instead
# (workload.py).
PLANNING_CONTEXT_SHARE = 0.5


def weight_bytes_per_parameter(dtype: str, quantization: str | None) -> float:
    """Bytes per parameter of the transformer layers (embeddings stay in `dtype`)."""
    return QUANT_BYTES.get(quantization or "", DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class Device:
    """One accelerator of a replica: its memory, its bandwidth and the platform vLLM runs on."""

    name: str
    memory_bytes: int
    bandwidth_bytes_s: int
    platform: Platform = "cuda"

    @classmethod
    def of(cls, gpu: GpuInstanceType) -> Device:
        """The GPU of an instance type, with the total CUDA reports for it (the low end where sources differ)."""
        return cls(gpu.gpu_model, cuda_memory(gpu).low_bytes, gpu.memory_bandwidth_bytes_s)

    def batch_defaults(self, world_size: int) -> tuple[int, int]:
        """vLLM's max_num_batched_tokens and max_num_seqs when left out, for the OpenAI server (Ray Serve LLM)."""
        if self.platform == "cpu":
            return 2048 * world_size, 128 * world_size
        if self.memory_bytes >= 160 * GIB:
            return 16384, 1024
        if self.memory_bytes >= 70 * GIB and "a100" not in self.name.lower():
            return 8192, 1024
        return 2048, 256


# The integer engine arguments the plan reads from engine_overrides.
INT_OVERRIDES = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes")


def positive_int(value: str | int | float | bool | None) -> int | None:
    """An engine argument's value as a positive integer (5, 5.0 or "5"), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        number = int(value) if value.is_integer() else None
    elif isinstance(value, str):
        number = int(value) if value.strip().isdigit() else None
    else:
        number = value
    return number if number is not None and number > 0 else None


def _int_override(overrides: dict[str, str | int | float | bool], key: str) -> int | None:
    return positive_int(overrides.get(key))


@dataclass(frozen=True)
class EngineSettings:
    """The engine arguments the plan depends on, from a catalogue entry and its engine_overrides."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int
    dtype: str
    quantization: str | None
    gpu_memory_utilization: float
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False

    @classmethod
    def of(cls, entry: ModelEntry) -> EngineSettings:
        """The settings a replica of `entry` starts with."""
        over = entry.engine_overrides
        return cls(
            tensor_parallel_size=entry.tensor_parallel_size,
            pipeline_parallel_size=entry.pipeline_parallel_size,
            max_model_len=entry.max_model_len,
            dtype=entry.dtype,
            quantization=entry.quantization,
            gpu_memory_utilization=entry.gpu_memory_utilization,
            kv_cache_dtype=str(over.get("kv_cache_dtype", "auto")),
            block_size=_int_override(over, "block_size"),
            max_num_seqs=_int_override(over, "max_num_seqs"),
            max_num_batched_tokens=_int_override(over, "max_num_batched_tokens"),
            kv_cache_memory_bytes=_int_override(over, "kv_cache_memory_bytes"),
            enforce_eager=over.get("enforce_eager") is True,
        )

    @property
    def world_size(self) -> int:
        """GPUs of one replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def kv_value_bytes(self) -> int:
        """Bytes of one cached K or V value."""
        if self.kv_cache_dtype == "auto":
            return DTYPE_BYTES[self.dtype]
        return KV_CACHE_DTYPE_BYTES[self.kv_cache_dtype]


def pp_layers(layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage, as vLLM's get_pp_indices splits them (the remainder skips the last stage)."""
    parts = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        parts[-i] += 1
    return parts


def kv_heads_per_gpu(geometry: Geometry, tp: int) -> int:
    """KV heads one TP rank holds: sharded, or replicated when TP exceeds them."""
    return max(1, geometry.num_key_value_heads // tp)


@dataclass(frozen=True)
class Overheads:
    """Non-KV memory of one GPU besides the weights."""

    activation_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int

    @property
    def total(self) -> int:
        """All of it."""
        return self.activation_bytes + self.non_torch_bytes + self.cuda_graph_bytes


def run_of(engine: EngineSettings, device: Device, vllm: tuple[int, int] = PINNED_VLLM) -> Run:
    """The settings vLLM's profiling depends on, its defaults filled in for the device."""
    default_tokens, default_seqs = device.batch_defaults(engine.world_size)
    return Run(
        max_num_batched_tokens=engine.max_num_batched_tokens or default_tokens,
        max_num_seqs=engine.max_num_seqs or default_seqs,
        tensor_parallel_size=engine.tensor_parallel_size,
        pipeline_parallel_size=engine.pipeline_parallel_size,
        enforce_eager=engine.enforce_eager,
        dtype_bytes=DTYPE_BYTES[engine.dtype],
        vllm=vllm,
    )


def _midpoint(r: Range) -> int:
    return (r.low + r.high) // 2


def overheads(geometry: Geometry, engine: EngineSettings, device: Device, last_stage: bool = True) -> Overheads:
    """What vLLM's start-up profiling subtracts besides the weights, estimated (none with kv_cache_memory_bytes).

    Each term is the midpoint of calibration.py's band, so the plan's KV
    memory lies inside the band kv_band.py gives for the same settings.
    """
    if engine.kv_cache_memory_bytes is not None:
        return Overheads(0, 0, 0)
    band = overhead_band(geometry, run_of(engine, device), last_stage=last_stage)
    return Overheads(_midpoint(band.activation), _midpoint(band.non_torch), _midpoint(band.cuda_graphs))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: what each of its GPUs holds."""

    rank: int
    layers: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_memory_bytes: int
    num_blocks: int


def _stage_weights(geometry: Geometry, parameters: float, engine: EngineSettings, rank: int, layers: int) -> int:
    """Weight bytes on one GPU of pipeline stage `rank`."""
    tp, stages = engine.tensor_parallel_size, engine.pipeline_parallel_size
    dtype_bytes = DTYPE_BYTES[engine.dtype]
    h = geometry.hidden_size
    per_layer = (parameters - geometry.vocab_parameters - h) / geometry.num_hidden_layers
    layer_bytes = per_layer * layers / tp * weight_bytes_per_parameter(engine.dtype, engine.quantization)
    vocab_shard = math.ceil(geometry.vocab_size / VOCAB_PADDING) * VOCAB_PADDING * h // tp
    vocab_matrices = (rank == 0) + (rank == stages - 1 and not (geometry.tie_word_embeddings and stages == 1))
    final_norm = h if rank == stages - 1 else 0
    return math.ceil(layer_bytes + (vocab_matrices * vocab_shard + final_norm) * dtype_bytes)


def stages(geometry: Geometry, parameters: float, engine: EngineSettings, device: Device) -> list[Stage]:
    """Each pipeline stage's weights, KV bytes per token, KV memory and blocks, per GPU."""
    block_size = engine.block_size or DEFAULT_BLOCK_SIZE[device.platform]
    per_layer_token = 2 * kv_heads_per_gpu(geometry, engine.tensor_parallel_size) * geometry.head_dim
    per_layer_token *= engine.kv_value_bytes()
    requested = math.ceil(device.memory_bytes * engine.gpu_memory_utilization)
    out = []
    last = engine.pipeline_parallel_size - 1
    for rank, layers in enumerate(pp_layers(geometry.num_hidden_layers, engine.pipeline_parallel_size)):
        weights = _stage_weights(geometry, parameters, engine, rank, layers)
        memory = engine.kv_cache_memory_bytes
        if memory is None:
            # Only the last stage warms the sampler up.
            memory = requested - weights - overheads(geometry, engine, device, last_stage=rank == last).total
        block_bytes = block_size * per_layer_token * layers
        blocks = memory // block_bytes if memory > 0 else 0
        out.append(Stage(rank, layers, weights, per_layer_token * layers, memory, blocks))
    return out


@dataclass(frozen=True)
class ReplicaPlan:
    """What one replica holds: the binding stage's GPU, and the KV capacity of the whole replica."""

    engine: EngineSettings
    device: Device
    stages: tuple[Stage, ...]
    # The binding stage's (only the last stage's include the sampler).
    overheads: Overheads
    block_size: int
    num_blocks: int
    kv_tokens: int
    blocks_per_sequence: int
    max_model_len_sequences: int
    planning_context_tokens: int
    planning_sequences: int
    default_max_num_seqs: int

    @property
    def binding(self) -> Stage:
        """The stage with the fewest blocks (vLLM sizes every stage to it)."""
        return min(self.stages, key=lambda s: s.num_blocks)

    @property
    def weight_bytes_per_gpu(self) -> int:
        """The largest weights one GPU holds."""
        return max(s.weight_bytes for s in self.stages)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes on the binding stage's GPU."""
        return self.binding.kv_bytes_per_token

    @property
    def fits_one_sequence(self) -> bool:
        """The cache holds one max_model_len sequence besides vLLM's null block (the engine refuses to start else)."""
        return self.max_model_len_sequences >= 1

    @property
    def max_num_seqs(self) -> int:
        """The max_num_seqs the engine runs with: the configured one, or vLLM's default."""
        return self.engine.max_num_seqs or self.default_max_num_seqs


def plan_replica(geometry: Geometry, parameters_billion: float, engine: EngineSettings, device: Device) -> ReplicaPlan:
    """The plan of one replica of a model of `geometry` with `engine` settings on `device` GPUs."""
    staged = tuple(stages(geometry, parameters_billion * 1e9, engine, device))
    block_size = engine.block_size or DEFAULT_BLOCK_SIZE[device.platform]
    num_blocks = min(s.num_blocks for s in staged)
    per_sequence = -(-engine.max_model_len // block_size)
    usable = max(0, num_blocks - 1)
    planning = max(1, math.ceil(engine.max_model_len * PLANNING_CONTEXT_SHARE))
    planning_sequences = usable // -(-planning // block_size)
    default_seqs = device.batch_defaults(engine.world_size)[1]
    binding = min(staged, key=lambda s: s.num_blocks)
    return ReplicaPlan(
        engine=engine,
        device=device,
        stages=staged,
        overheads=overheads(geometry, engine, device, last_stage=binding.rank == len(staged) - 1),
        block_size=block_size,
        num_blocks=num_blocks,
        kv_tokens=int(num_blocks / per_sequence * engine.max_model_len),
        blocks_per_sequence=per_sequence,
        max_model_len_sequences=usable // per_sequence,
        planning_context_tokens=planning,
        planning_sequences=planning_sequences,
        default_max_num_seqs=default_seqs,
    )
