"""The config rules the capacity plan enforces, one line each, naming the model and the numbers.

infra/config/models.py calls `capacity_problems` for every model and prefixes the
key path; this module returns (key under the model, message) pairs so that
it does not import the config model.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.capacity.geometry import Geometry
from infra.capacity.kv_band import replica_kv_band
from infra.capacity.plan import (
    GIB,
    INT_OVERRIDES,
    KV_CACHE_DTYPES,
    PLANNING_CONTEXT_SHARE,
    Device,
    EngineSettings,
    ReplicaPlan,
    plan_replica,
    positive_int,
)
from infra.capacity.workload import Concurrency, Workload, concurrency
from infra.instance_types import GpuInstanceType
from workloads.inference_server.catalog import ModelEntry


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def context_problems(name: str, entry: ModelEntry, geometry: Geometry) -> Iterable[tuple[str, str]]:
    """max_model_len within the model's context limit (vLLM refuses longer without rope scaling of its own)."""
    limit = geometry.max_position_embeddings
    if entry.max_model_len > limit:
        yield (
            "max_model_len",
            f"'{name}': {entry.max_model_len:,} exceeds the model's context limit of {limit:,} tokens "
            "(max_position_embeddings)",
        )


def head_problems(name: str, entry: ModelEntry, geometry: Geometry) -> Iterable[tuple[str, str]]:
    """TP divides the attention heads, and divides the KV heads or is a multiple of them (vLLM then replicates them)."""
    tp = entry.tensor_parallel_size
    heads, kv = geometry.num_attention_heads, geometry.num_key_value_heads
    if heads % tp:
        yield (
            "tensor_parallel_size",
            f"'{name}': {tp} does not divide the model's {heads} attention heads (vLLM shards them over the TP ranks)",
        )
    elif kv % tp and tp % kv:
        yield (
            "tensor_parallel_size",
            f"'{name}': {tp} neither divides the model's {kv} KV heads nor is a multiple of them (vLLM shards the "
            "KV heads over the TP ranks, or replicates each over TP / KV heads ranks)",
        )


def engine_value_problems(entry: ModelEntry) -> Iterable[tuple[str, str]]:
    """The integer engine arguments the plan reads are positive integers."""
    for key in INT_OVERRIDES:
        value = entry.engine_overrides.get(key)
        if value is not None and positive_int(value) is None:
            yield (f"engine_overrides.{key}", f"{value!r} is not a positive integer")


def kv_dtype_problems(entry: ModelEntry) -> Iterable[tuple[str, str]]:
    """A kv_cache_dtype the plan knows the size of."""
    value = entry.engine_overrides.get("kv_cache_dtype", "auto")
    if value not in KV_CACHE_DTYPES:
        yield (
            "engine_overrides.kv_cache_dtype",
            f"'{value}' is not a KV cache dtype the capacity plan sizes ({', '.join(KV_CACHE_DTYPES)})",
        )


def kv_message(name: str, plan: ReplicaPlan) -> str:
    """Why the KV cache does not hold one max_model_len sequence, with the memory it has."""
    engine, device, stage = plan.engine, plan.device, plan.binding
    usable = max(0, plan.num_blocks - 1)
    if engine.kv_cache_memory_bytes is not None:
        memory = f"kv_cache_memory_bytes {engine.kv_cache_memory_bytes:,}"
    else:
        memory = (
            f"{device.name} {_gib(device.memory_bytes)} (what CUDA reports) x gpu_memory_utilization "
            f"{engine.gpu_memory_utilization}, "
            f"less {_gib(stage.weight_bytes)} of weights and {_gib(plan.overheads.total)} of activations, CUDA "
            f"graphs and buffers (estimated), leaves {_gib(max(0, stage.kv_memory_bytes))}"
        )
    return (
        f"'{name}': the KV cache holds {usable * plan.block_size:,} tokens ({usable} blocks of {plan.block_size} "
        f"besides vLLM's null block; {memory} at {stage.kv_bytes_per_token:,} bytes a token per GPU), less than one "
        f"max_model_len sequence of {engine.max_model_len:,} tokens: vLLM would refuse to start; lower "
        "max_model_len, raise gpu_memory_utilization, add GPUs (tensor_parallel_size) or set kv_cache_dtype fp8"
    )


# How many KV caches' worth of typical sequences one replica may be let hold
# at once. Requests the KV cache can not hold wait in vLLM's queue, which has
# no bound of its own: past this many, the last request let in waits through
# as many rounds of generation before its first token, and the client is
# better told 429 (with Retry-After) and sent to a replica with room.
MAX_INFLIGHT_KV_ROUNDS = 8


def inflight_tokens(entry: ModelEntry, plan: ReplicaPlan) -> int:
    """The KV tokens a replica's in-flight cap asks for at the plan's typical sequence (PLANNING_CONTEXT_SHARE)."""
    return entry.autoscaling.max_ongoing_requests * plan.planning_context_tokens


def inflight_problems(name: str, entry: ModelEntry, plan: ReplicaPlan) -> Iterable[tuple[str, str]]:
    """The replica's in-flight cap (max_ongoing_requests) fits MAX_INFLIGHT_KV_ROUNDS of its KV cache.

    The cap is what a replica is let hold at once: Serve holds each
    serve-ingress replica to it, the guard each vllm-server replica
    (inference_server.fairness), where Serve never sees the requests.
    """
    cap, wanted = entry.autoscaling.max_ongoing_requests, inflight_tokens(entry, plan)
    if wanted > MAX_INFLIGHT_KV_ROUNDS * plan.kv_tokens:
        room = max(1, MAX_INFLIGHT_KV_ROUNDS * plan.kv_tokens // plan.planning_context_tokens)
        yield (
            "autoscaling.max_ongoing_requests",
            f"'{name}': {cap} requests in flight x {plan.planning_context_tokens:,} typical tokens "
            f"({PLANNING_CONTEXT_SHARE:.0%} of max_model_len) = {wanted:,} tokens, more than "
            f"{MAX_INFLIGHT_KV_ROUNDS} x the {plan.kv_tokens:,} the KV cache holds: the rest would wait in vLLM's "
            f"unbounded queue for rounds of generation before a first token; set at most {room}, or give the KV "
            "cache more memory",
        )


def preemption_message(name: str, max_num_seqs: int, at: Concurrency, *, unset: bool = False) -> str:
    """Why `max_num_seqs` would preempt at the workload's p95, with the arithmetic and the ways out."""
    what = f"unset, vLLM's default of {max_num_seqs}" if unset else f"{max_num_seqs}"
    return (
        f"'{name}': {what} sequences at once would preempt at the workload's p95 ({at.workload.source}): "
        f"{at.arithmetic()} fit at once; set at most {at.preemption_free} "
        f"(the plan recommends {at.recommended}), give workload the traffic's real figures, or accept preemption "
        "at p95 with workload.allow_preemption: true"
    )


def preemption_problems(
    name: str, entry: ModelEntry, at: Concurrency, default_max_num_seqs: int
) -> Iterable[tuple[str, str]]:
    """A max_num_seqs the stack sets keeps every sequence at the workload's p95 in the KV cache at once.

    Above that vLLM preempts under a full load of long requests: it frees a
    running sequence's blocks and recomputes it from the start, so that
    request pays its prefill again and everyone's latency climbs. With
    workload.allow_preemption the stack accepts it, and the plan prints a
    warning instead (report.preemption_warning). Where the stack gives a
    workload and sets no max_num_seqs, vLLM's own default is judged the same
    way: it is what the engine would admit. Without a workload the plan
    assumes full-length requests, and the default is shown, not judged.
    """
    configured = positive_int(entry.engine_overrides.get("max_num_seqs"))
    if at.workload.allow_preemption:
        return
    if configured is not None and at.preempts(configured):
        yield ("engine_overrides.max_num_seqs", preemption_message(name, configured, at))
    elif configured is None and at.workload.given and at.preempts(default_max_num_seqs):
        yield ("engine_overrides.max_num_seqs", preemption_message(name, default_max_num_seqs, at, unset=True))


def capacity_problems(
    name: str,
    entry: ModelEntry,
    geometry: Geometry,
    parameters_billion: float,
    gpu: GpuInstanceType | None,
    workload: Workload,
) -> list[tuple[str, str]]:
    """Every capacity rule for one model; the KV rules only on a `gpu` its parallelism fits and its weights fit.

    The preemption rule only once the profile fits max_model_len (the
    workload rule in infra/config/workload.py says so otherwise).
    """
    problems = [*context_problems(name, entry, geometry), *kv_dtype_problems(entry), *engine_value_problems(entry)]
    if gpu is None:
        return problems
    problems += head_problems(name, entry, geometry)
    if problems:
        return problems
    engine = EngineSettings.of(entry)
    plan = plan_replica(geometry, parameters_billion, engine, Device.of(gpu))
    # Weights beyond the GPU are the weights rule's to report.
    if plan.weight_bytes_per_gpu < gpu.gpu_memory_bytes * entry.gpu_memory_utilization and not plan.fits_one_sequence:
        problems.append(("max_model_len", kv_message(name, plan)))
    elif plan.fits_one_sequence:
        problems += inflight_problems(name, entry, plan)
        if workload.p95_tokens <= entry.max_model_len:
            band = replica_kv_band(geometry, parameters_billion, engine, gpu)
            problems += preemption_problems(name, entry, concurrency(plan, band, workload), plan.default_max_num_seqs)
    return problems
