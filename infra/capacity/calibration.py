"""What vLLM sees of each GPU and spends before its KV cache: sourced figures, and a band instead of a point.

vLLM sizes its KV cache per GPU as `ceil(CUDA total x gpu_memory_utilization)`
less the weights and what its start-up profiling measures (vLLM 0.29,
`Worker.determine_available_memory` and `utils/mem_utils.memory_profiling`):

- the total is what CUDA reports (`cudaMemGetInfo`), not the datasheet's GB:
  CUDA_MEMORY holds it per GPU model, each figure with where it was read;
- the transient activation peak of the profile run: one forward pass of
  `max_num_batched_tokens` tokens, then the sampler warmed up on
  `min(max_num_seqs, tokens)` rows of float32 logits (the last stage only);
- memory outside PyTorch that grew after vLLM's start-up snapshot. Since 0.11
  (vllm-project/vllm#25359) that snapshot is taken after the distributed
  environment is up, so NCCL's communicators are neither measured nor
  subtracted: they come out of the `1 - gpu_memory_utilization` slack. With
  TP or PP only what grows later (lazily connected channels, all-reduce
  workspaces) is counted, which the calibration bounds;
- the CUDA graphs vLLM will capture, estimated by capturing the first two of
  each mode (`profile_cudagraph_memory`), subtracted since 0.21 (before, the
  graphs were captured outside the budget).

Each term has a low and a high end fitted to CALIBRATION_POINTS, published
start-up logs; the KV band's low end takes every term's high end (and the
smaller CUDA total), its high end the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.capacity.geometry import PINNED, Geometry
from infra.instance_types import GB, GpuInstanceType
from infra.versions import VLLM_VERSION

# Nothing here imports the plan (infra/capacity/kv_band.py joins the two), so the plan can import this.
GIB = 2**30
MIB = 2**20


def _gib(value: float) -> int:
    return round(value * GIB)


def version(text: str) -> tuple[int, int]:
    """A vLLM version's (major, minor): '0.29.0' -> (0, 29)."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


PINNED_VLLM = version(VLLM_VERSION)
# From this version the CUDA graph estimate is subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default).
GRAPHS_COUNTED_SINCE = (0, 21)
# From this version the start-up snapshot follows NCCL's set-up (vllm-project/vllm#25359): the rules modelled here.
MODELLED_SINCE = (0, 11)


@dataclass(frozen=True)
class Source:
    """Where a figure was read: an address and the words that state it."""

    url: str
    quote: str


@dataclass(frozen=True)
class CudaMemory:
    """The total memory CUDA reports for one GPU model: what `gpu_memory_utilization` is a share of.

    Drivers and ECC move it by a few hundred MiB, hence a low and a high end.
    `assumption` says what stands in when no source names this GPU.
    """

    low_bytes: int
    high_bytes: int
    sources: tuple[Source, ...]
    assumption: str = ""


# Keyed by the instance type's Ray accelerator type (A100-40G and A100-80G share a gpu_model).
CUDA_MEMORY: dict[str, CudaMemory] = {
    "L4": CudaMemory(
        23_612_293_120,
        23_612_293_120,
        (
            Source(
                "https://github.com/Alawaji214/GPU-Median-Blurring/blob/main/README.md",
                'deviceQuery, driver 525.105.17, ECC enabled: Device 0: "NVIDIA L4" ... '
                "Total amount of global memory: 22518 MBytes (23612293120 bytes)",
            ),
        ),
    ),
    "A10G": CudaMemory(
        _gib(22.07),
        _gib(22.18),
        (
            Source(
                "https://github.com/oracle-samples/oci-data-science-ai-samples/blob/main/ai-quick-actions/troubleshooting-tips.md",
                "the guide's vLLM log, for its shapes with A10 cards: the current vLLM instance can use "
                "total_gpu_memory (22.07GiB) x gpu_memory_utilization (0.90) = 19.86GiB",
            ),
            Source(
                "https://github.com/OpenBMB/MiniCPM-V/issues/640",
                "one A10 (24G): GPU 0 has a total capacity of 22.18 GiB",
            ),
        ),
        "no source names the A10G; it is AWS's A10 (the same 24 GB GDDR6 board), so the A10's figures stand in",
    ),
    "L40S": CudaMemory(
        47_576_711_168,
        _gib(44.53),
        (
            Source(
                "https://github.com/alvarobartt/cuda-device-query/blob/main/README.md",
                'Device 0: "NVIDIA L40S" ... Total amount of global memory: 45373 MBytes (47576711168 bytes)',
            ),
            Source(
                "https://github.com/Wan-Video/Wan2.1/issues/205",
                "GPU:L40S 48GB ... GPU 0 has a total capacity of 44.53 GiB",
            ),
        ),
    ),
    "A100-40G": CudaMemory(
        _gib(39.56),
        _gib(39.56),
        (
            Source(
                "https://github.com/threestudio-project/threestudio/issues/402",
                "NVIDIA A100-SXM4-40GB, driver 535.104.05: GPU 0 has a total capacty of 39.56 GiB",
            ),
        ),
    ),
    "A100-80G": CudaMemory(
        _gib(79.25),
        _gib(79.25),
        (
            Source(
                "https://github.com/HiDream-ai/VAREdit/issues/6",
                "I use an A100 ... GPU 0 has a total capacity of 79.25 GiB",
            ),
        ),
    ),
    "H100": CudaMemory(
        _gib(79.11),
        85_520_809_984,
        (
            Source(
                "https://github.com/vllm-project/vllm/issues/27508",
                "openai/gpt-oss-120b can't run on H100: GPU 0 has a total capacity of 79.11 GiB",
            ),
            Source(
                "https://github.com/modal-labs/modal-client/pull/2797",
                "the reported total memory (85520809984 bytes or 85.5 GB on H100)",
            ),
            Source(
                "https://github.com/llm-d/llm-d-benchmark/blob/main/config_explorer/empirical-vllm-memory-results.md",
                "Free memory on device: 78.57/79.18 GiB on startup",
            ),
        ),
    ),
    "H200": CudaMemory(
        141 * GB,
        141 * GB,
        (),
        "no citable source found: the datasheet's 141 GB (131.3 GiB) is taken at both ends, an underestimate",
    ),
}


def cuda_memory(gpu: GpuInstanceType) -> CudaMemory:
    """The CUDA total of an instance type's GPU (every GPU of infra/instance_types.py has an entry)."""
    return CUDA_MEMORY[gpu.ray_accelerator_type]


@dataclass(frozen=True)
class Range:
    """A quantity between a low and a high end, in bytes."""

    low: int
    high: int

    def __add__(self, other: Range) -> Range:
        return Range(self.low + other.low, self.high + other.high)

    def end(self, name: str) -> int:
        """The "low" or the "high" end."""
        return self.low if name == "low" else self.high

    def holds(self, value: float, slack: float = 0) -> bool:
        """The value lies between the ends, widened by `slack` either side."""
        return self.low - slack <= value <= self.high + slack


# The sampler's warm-up peak in float32 copies of a [rows, vocabulary] logits tensor: 9.6-9.9 in the
# four vLLM 0.11 logs that give it (1024 rows on an H100), widened to the nearest half copy.
SAMPLER_COPIES = (9.0, 10.5)
# Outside PyTorch after the snapshot: 0.13-0.14 GiB at TP=1 in vLLM 0.11 and 0.05 GiB in older logs; rotary
# caches and buffers the plan's weight count leaves out go here too. With TP or PP, up to PARALLEL_NON_TORCH
# more (0.42 GiB at TP=2 on H100s); nothing at the low end, which is the same as TP=1's.
NON_TORCH = Range(_gib(0.05), _gib(0.25))
PARALLEL_NON_TORCH = _gib(0.7)
# CUDA graph estimate: the first capture of each mode plus a per-graph cost times the others. Logged
# estimates for dense models (0.62 GiB for 51 + 35 graphs, 0.67 GiB for 35 + 19 at TP=4) sit inside.
FIRST_CAPTURE = Range(16 * MIB, 128 * MIB)
PER_GRAPH = Range(4 * MIB, 10 * MIB)
DEFAULT_MAX_CAPTURE = 512


@dataclass(frozen=True)
class Run:
    """The engine settings the non-KV memory depends on, resolved (no defaults left to fill in)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    dtype_bytes: int = 2
    vllm: tuple[int, int] = PINNED_VLLM


def capture_sizes(max_size: int) -> list[int]:
    """vLLM's default CUDA graph batch sizes up to `max_size` (VllmConfig: 1, 2, 4, then by 8, then by 16 from 256)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, DEFAULT_MAX_CAPTURE + 1, 16)]
    return [s for s in sizes if s <= max_size]


def cuda_graph_count(run: Run) -> int:
    """Graphs vLLM captures by default: PIECEWISE up to 2 x max_num_seqs (at most 512), FULL decode to max_num_seqs."""
    largest = min(2 * run.max_num_seqs, DEFAULT_MAX_CAPTURE, run.max_num_batched_tokens)
    return len(capture_sizes(largest)) + len(capture_sizes(min(run.max_num_seqs, largest)))


@dataclass(frozen=True)
class OverheadBand:
    """Non-KV memory of one GPU besides the weights, as vLLM's profiling would count it, low and high."""

    activation: Range
    non_torch: Range
    cuda_graphs: Range

    @property
    def total(self) -> Range:
        """All of it."""
        return self.activation + self.non_torch + self.cuda_graphs

    def describe(self, end: str) -> str:
        """The assumption behind one end ("low" or "high" overhead) in words."""
        copies = SAMPLER_COPIES[0] if end == "low" else SAMPLER_COPIES[1]
        act, other, graphs = (r.end(end) / GIB for r in (self.activation, self.non_torch, self.cuda_graphs))
        return (
            f"{act:.2f} GiB of activations (sampler at {copies} float32 logits copies), "
            f"{other:.2f} GiB outside PyTorch, {graphs:.2f} GiB of CUDA graphs"
        )


def overhead_band(geometry: Geometry, run: Run, last_stage: bool = True) -> OverheadBand:
    """What vLLM's start-up profiling subtracts besides the weights on one GPU of a stage."""
    tp = run.tensor_parallel_size
    # The largest live activations of the forward pass: the hidden states and the MLP's gate, up and output.
    forward = run.max_num_batched_tokens * (2 * geometry.hidden_size + 3 * geometry.intermediate_size // tp)
    forward *= run.dtype_bytes
    rows = min(run.max_num_seqs, run.max_num_batched_tokens) if last_stage else 0
    logits = rows * geometry.vocab_size * 4
    # The forward pass and the sampler run one after the other: the peak is the larger of the two.
    activation = Range(max(forward, int(logits * SAMPLER_COPIES[0])), max(forward, int(logits * SAMPLER_COPIES[1])))
    parallel = run.tensor_parallel_size * run.pipeline_parallel_size > 1
    non_torch = NON_TORCH + Range(0, PARALLEL_NON_TORCH if parallel else 0)
    graphs = Range(0, 0)
    if not run.enforce_eager and run.vllm >= GRAPHS_COUNTED_SINCE:
        others = max(0, cuda_graph_count(run) - 2)
        graphs = Range(2 * FIRST_CAPTURE.low + others * PER_GRAPH.low, 2 * FIRST_CAPTURE.high + others * PER_GRAPH.high)
    return OverheadBand(activation, non_torch, graphs)


def kv_memory_band(total: CudaMemory, utilization: float, weight_bytes: int, overhead: OverheadBand) -> Range:
    """KV cache bytes of one GPU: the requested share of the CUDA total, less weights and overheads."""
    low = math.ceil(total.low_bytes * utilization) - weight_bytes - overhead.total.high
    high = math.ceil(total.high_bytes * utilization) - weight_bytes - overhead.total.low
    return Range(low, high)


# Qwen3's config.json on the Hugging Face hub (the calibration logs' other models; Llama's are pinned).
QWEN3_0_6B = Geometry(
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=1024,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)  # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
QWEN3_32B = Geometry(
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=5120,
    intermediate_size=25600,
    vocab_size=151936,
    max_position_embeddings=40960,
)  # https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json


@dataclass(frozen=True)
class CalibrationPoint:
    """One published vLLM start-up: the settings it ran with and the memory it logged, per GPU, in GiB."""

    vllm: str
    gpu: str  # a CUDA_MEMORY key
    model: str
    geometry: Geometry
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enforce_eager: bool
    weights_gib: float
    kv_cache_gib: float
    source: Source
    settings: str  # the command, and where the batch limits come from when it leaves them out
    kv_tokens: int | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    # "Free memory on device (free/total GiB) on startup": the snapshot vLLM's budget starts from.
    startup_free_gib: float | None = None
    startup_total_gib: float | None = None

    @property
    def run(self) -> Run:
        """The point's settings as the overhead model takes them."""
        return Run(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager,
            vllm=version(self.vllm),
        )

    def band(self) -> Range:
        """The KV memory band the model gives this point's GPU, settings and logged weights."""
        overhead = overhead_band(self.geometry, self.run)
        return kv_memory_band(CUDA_MEMORY[self.gpu], self.gpu_memory_utilization, _gib(self.weights_gib), overhead)


_LLM_D = "https://github.com/llm-d/llm-d-benchmark/blob/main/config_explorer/empirical-vllm-memory-results.md"


def _llm_d(model: str, geometry: Geometry, tp: int, logged: tuple[float, ...], quote: str) -> CalibrationPoint:
    """One of llm-d's vLLM 0.11 runs on H100s: logged weights, KV, activation, non-torch (and startup free) GiB."""
    weights, kv, activation, non_torch, *free = logged
    return CalibrationPoint(
        "0.11.0", "H100", model, geometry, tp, 0.9, 16000, 8192, 1024, False, weights, kv, Source(_LLM_D, quote),
        "vllm serve --gpu-memory-utilization=0.90 --max-model-len=16000 --block-size=128 --enable-prefix-caching; "
        "batch limits left to vLLM's defaults for an H100 (8192 tokens, 1024 sequences)",
        activation_gib=activation, non_torch_gib=non_torch,
        startup_free_gib=free[0] if free else None, startup_total_gib=79.18 if free else None,
    )  # fmt: skip


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    _llm_d("meta-llama/Llama-3.1-8B-Instruct", PINNED[0].geometry, 1, (14.99, 51.38, 4.76, 0.13, 78.57),
           "Model loading took: 14.99 GiB memory; Available KV cache memory: 51.38 GiB; Free memory on device: "
           "78.57/79.18 GiB on startup; Peak activation memory: 4.76 GiB; Non-torch memory: 0.13 GiB"),
    _llm_d("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", PINNED[1].geometry, 2, (33.88, 32.0, 4.84, 0.55, 77.64),
           "(TP=2) Model loading took: 33.88 GiB memory; Available KV cache memory: 32.0 GiB; Free memory on "
           "device: 77.64/79.18 GiB on startup; Peak activation memory: 4.84 GiB; Non-torch memory: 0.55 GiB"),
    _llm_d("Qwen/Qwen3-0.6B", QWEN3_0_6B, 1, (1.12, 64.45, 5.56, 0.13, 78.57),
           "Model loading took: 1.12 GiB memory; Available KV cache memory: 64.45 GiB; Free memory on device: "
           "78.57/79.18 GiB on startup; Peak activation memory: 5.56 GiB; Non-torch memory: 0.13 GiB"),
    _llm_d("Qwen/Qwen3-32B", QWEN3_32B, 1, (61.03, 4.45, 5.64, 0.14),
           "| Qwen3-32B | SUCCESS | 61.03 | 5.64 | 0.14 | -0.88 | 4.45 | 1 | 16000 | (weights, peak activation, "
           "non-torch, CUDA graph, KV cache GiB, TP, max model len)"),
    CalibrationPoint(
        "0.15.1", "A100-40G", "meta-llama/Llama-3.1-8B-Instruct", PINNED[0].geometry, 1, 0.9, 131072, 8192, 256,
        True, 14.99, 19.28,
        Source("https://github.com/ilseokoh/vllm-gce/blob/main/README.md",
               "Initializing a V1 LLM engine (v0.15.1) ... enforce_eager=True ... Model loading took 14.99 GiB "
               "memory ... Available KV cache memory: 19.28 GiB ... GPU KV cache size: 157,936 tokens"),
        "LLM(enforce_eager=True) on a2-highgpu-1g (one A100 40GB): utilization and max_num_seqs are the LLM "
        "class's defaults (0.9, 256); the log states max_num_batched_tokens=8192",
        kv_tokens=157_936,
    ),
)  # fmt: skip
