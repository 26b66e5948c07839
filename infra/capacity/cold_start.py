"""A model's cold-start budget: how long from "a replica is needed" to "Serve routes to it" on a new node.

    node ready   provisioner reaction + EC2 launch + boot + kubelet Ready with the GPU advertised
    image pull   the serving image over the node's network (SOCI parallel pull) and unpacked on NVMe
    ray start    the container's Ray worker registered with the head
    weights      what each node reads from S3 (runai_streamer) at the network's usable rate: the checkpoint
                 once with distributed streaming (more than one rank a node), once per rank without
    engine init  vLLM after the weights: KV profiling, torch.compile (cold cache on a new node), CUDA graphs
    serve ready  Serve marks the replica healthy and the proxies route to it

Computed from the pinned figures below (each says where it comes from) and
the model's size. The config rules (`timeout_problems`) refuse a timeout on
the path that is shorter than the budget it has to cover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infra.instance_types import GpuInstanceType, HostIo, host_io

GB = 10**9
MIB = 2**20


@dataclass(frozen=True)
class Figure:
    """One pinned figure and where it comes from."""

    value: float
    unit: str
    source: str


# --- Pinned figures ----------------------------------------------------------

FIGURES: dict[str, Figure] = {
    "node_ready_g": Figure(
        300,
        "s",
        "scale-up of a g6/g6e node on this platform, pending pod to node Ready with nvidia.com/gpu: 4-5 min "
        "reported in KubeRay's issue tracker for GPU scale-ups; the upper end",
    ),
    "node_ready_p": Figure(
        420,
        "s",
        "estimate: the g figure plus 2 min for p4d/p5 firmware, NVSwitch fabric manager and EFA devices "
        "(no measurement on this platform yet)",
    ),
    "image_compressed_gb": Figure(
        10.5,
        "GB",
        "the serving image (rayproject/ray-llm base + workloads/), compressed in ECR; "
        "10+ GB as reported for Ray LLM images on KubeRay",
    ),
    "image_unpacked_ratio": Figure(
        2.0, "x", "estimate: unpacked / compressed size of CUDA and Python layers (gzip of binaries and wheels)"
    ),
    "pull_network_share": Figure(
        0.5,
        "of line rate",
        "estimate: SOCI parallel pull fetches layers in ranged chunks over many connections; half the line "
        "rate from ECR is the planning figure (its tuning guide reports pulls near network speed)",
    ),
    "unpack_bytes_s": Figure(
        400e6,
        "B/s",
        "estimate: parallel unpack (SOCI, 4 layers at a time) of gzip at ~100 MB/s a core, written to the "
        "instance-store RAID0",
    ),
    "ray_start": Figure(20, "s", "Ray worker start to raylet registered, seen on the local twin (make twin/local)"),
    "s3_network_share": Figure(
        0.6,
        "of line rate",
        "estimate: runai_streamer with enough parallel ranged GETs (S3 performance guidelines: ~85-90 MB/s "
        "a connection, scale with connections up to the NIC) through the VPC's S3 gateway endpoint",
    ),
    "s3_per_connection_bytes_s": Figure(
        85e6, "B/s", "S3 performance design guidelines: about 85-90 MB/s for one request stream"
    ),
    "engine_init": Figure(
        90,
        "s",
        "estimate from vLLM 0.29 start-up logs on L4/L40S: KV profiling ~10 s, torch.compile with an empty "
        "cache 40-60 s, CUDA graph capture ~20 s",
    ),
    "engine_init_eager": Figure(15, "s", "vLLM with enforce_eager: no compile, no CUDA graphs; KV profiling only"),
    "engine_init_tp": Figure(20, "s", "estimate: NCCL init and per-rank compile skew with tensor parallelism"),
    "serve_ready": Figure(
        20,
        "s",
        "Serve's replica health check (period 10 s) and the proxies' route table update; KubeRay's "
        "readiness probe period (10 s)",
    ),
    # KubeRay 1.7's injected liveness probe on Ray containers
    # (ray-operator/controllers/ray/utils/constant.go): initial delay 30 s,
    # period 5 s, failure threshold 120: 630 s from container start.
    "kuberay_liveness_window": Figure(630, "s", "KubeRay 1.7 default liveness probe: 30 s + 120 x 5 s"),
}


def figure(key: str) -> float:
    """A pinned figure's value."""
    return FIGURES[key].value


# --- The S3 streamer, sized from the network --------------------------------
#
# How vLLM 0.29 and runai-model-streamer 0.17.1 read a checkpoint, which the
# sizing and the budget follow:
# - Every rank reads every tensor of the checkpoint, whatever its TP shard or
#   PP stage: vLLM's loader lists all the files and streams them all
#   (model_loader/runai_streamer_loader.py: `hf_weights_files =
#   list_safetensors(path=hf_folder)`, then
#   `runai_safetensors_weights_iterator(hf_weights_files, ..., self._is_distributed)`).
#   Without distributed streaming a node of R ranks reads it R times.
# - `model_loader_extra_config={"distributed": true}` makes the ranks sharing a
#   host split the tensors and broadcast their shares to each other
#   (runai_model_streamer/distributed_streamer/distributed_streamer.py:
#   `group = self.create_local_distribution_group()`, "all ranks on the current
#   node", then `partition_for_rank(...)`): each node reads the checkpoint once.
#   On GPUs vLLM hands it a CUDA device (model_loader/weight_utils.py:
#   `f"cuda:{current_platform.current_device()}" if is_distributed and is_cuda_alike`)
#   and the broadcast runs over NCCL, which the streamer's "auto" mode takes
#   (`elif enable_dist == "auto" and backend_name != "nccl":` falls back).
# - A world of one rank falls back to plain streaming anyway
#   (`self.is_distributed = self.is_distributed and self.get_group_size() > 1`),
#   but vLLM would still pick the CUDA device: replicas with one rank a node
#   are left as they were.
# - RUNAI_STREAMER_CONCURRENCY is read by each rank's own reader (the S3
#   reader is not divided by RUNAI_STREAMER_PROCESS_GROUP_SIZE, which only the
#   file-system queue depth is), so the node's NIC is shared by ranks x concurrency.
# - RUNAI_STREAMER_MEMORY_LIMIT is a node total in distributed mode, divided
#   over the host's ranks (`per_rank = max(limit // ranks, self.max_chunk)`).
# - Each rank also holds two staging buffers of max(1 GiB, the largest tensor)
#   on its GPU while loading; with less free it falls back to plain streaming
#   (`if free_memory < 2 * self.params.max_chunk:`).

STREAMER_MIN_CONCURRENCY = 16  # runai_streamer's own default
STREAMER_MAX_CONCURRENCY = 128
# The CPU staging buffer: two seconds of line rate keeps the NIC busy while
# tensors are copied to the GPU, capped at a quarter of the pod's memory so it
# never crowds the Ray object store and the shm.
STREAMER_BUFFER_SECONDS = 2.0
STREAMER_MEMORY_SHARE = 0.25


def ranks_per_node(num_devices: int, gpus_per_node: int) -> int:
    """One replica's ranks on each of its nodes: all of them, or a whole node per pipeline stage beyond one node."""
    return min(num_devices, gpus_per_node)


def streams_distributed(ranks: int) -> bool:
    """Whether a replica with `ranks` on each node streams distributed: whenever a node has more than one.

    The ranks sharing a host split the reads; a rank alone on its node (a
    pipeline stage per one-GPU node) would only add the broadcast's GPU buffers.
    """
    return ranks > 1


def checkpoint_copies_per_node(ranks: int, distributed: bool) -> int:
    """How many times one node reads the whole checkpoint from S3: once distributed, else once per rank."""
    return 1 if distributed else ranks


def streamer_concurrency(io: HostIo, ranks: int = 1) -> int:
    """Each rank's parallel S3 reads: the node's `ranks` together fill its usable line rate, at S3's rate a stream."""
    target = io.network_bytes_s * figure("s3_network_share")
    wanted = math.ceil(target / figure("s3_per_connection_bytes_s") / ranks)
    return max(STREAMER_MIN_CONCURRENCY, min(STREAMER_MAX_CONCURRENCY, wanted))


def streamer_memory_limit(io: HostIo, pod_memory_gib: int) -> int:
    """runai_streamer's CPU buffer in bytes: a couple of seconds of line rate, within a share of the pod's memory.

    The pod's total: a one-rank replica uses it all, and distributed streaming divides it over the ranks.
    """
    buffer = io.network_bytes_s * STREAMER_BUFFER_SECONDS
    cap = pod_memory_gib * 2**30 * STREAMER_MEMORY_SHARE
    return int(min(buffer, cap)) // MIB * MIB


# --- The budget --------------------------------------------------------------


@dataclass(frozen=True)
class ColdStart:
    """One model's cold-start budget, phase by phase, in seconds."""

    model: str
    instance: str
    node_ready: float
    image_pull: float
    ray_start: float
    weights: float
    engine_init: float
    serve_ready: float
    # What each node reads from S3 (the `weights` phase's bytes), and how many checkpoints that is.
    node_read_bytes: float
    checkpoint_copies: int

    @property
    def total(self) -> float:
        """The whole budget."""
        return self.node_ready + self.image_pull + self.ray_start + self.weights + self.engine_init + self.serve_ready

    @property
    def to_ray_up(self) -> float:
        """From the pod's creation until Ray runs in it: what the autoscaler's allocate window covers."""
        return self.node_ready + self.image_pull + self.ray_start

    @property
    def in_container(self) -> float:
        """From the container's start until the replica serves: what the probes and the engine timeout cover."""
        return self.ray_start + self.weights + self.engine_init + self.serve_ready

    def phases(self) -> dict[str, int]:
        """The phases rounded to whole seconds, in order."""
        return {
            "node_ready": round(self.node_ready),
            "image_pull": round(self.image_pull),
            "ray_start": round(self.ray_start),
            "weights": round(self.weights),
            "engine_init": round(self.engine_init),
            "serve_ready": round(self.serve_ready),
        }


def node_ready_seconds(instance: GpuInstanceType) -> float:
    """The node figure of the instance's family (p: bigger boards, fabric manager, EFA)."""
    return figure("node_ready_p" if instance.name.startswith("p") else "node_ready_g")


def image_pull_seconds(io: HostIo) -> float:
    """Download at the pull's share of the line rate, then the unpack of what was not unpacked alongside."""
    compressed = figure("image_compressed_gb") * GB
    download = compressed / (io.network_bytes_s * figure("pull_network_share"))
    unpack = compressed * figure("image_unpacked_ratio") / figure("unpack_bytes_s")
    # Parallel pull unpacks layers while later ones download: the slower of the two bounds it.
    return max(download, unpack)


def weights_seconds(node_read_bytes: float, io: HostIo) -> float:
    """What one node reads from S3 at the usable rate of its NIC (its ranks share it)."""
    return node_read_bytes / (io.network_bytes_s * figure("s3_network_share"))


def engine_init_seconds(tensor_parallel_size: int, enforce_eager: bool) -> float:
    """vLLM's start after the weights are in."""
    base = figure("engine_init_eager" if enforce_eager else "engine_init")
    return base + (figure("engine_init_tp") if tensor_parallel_size > 1 else 0.0)


def cold_start(
    model: str,
    instance: GpuInstanceType,
    weight_bytes: float,
    checkpoint_copies: int,
    tensor_parallel_size: int,
    enforce_eager: bool,
) -> ColdStart:
    """The budget of one replica of `weight_bytes` on new `instance` nodes.

    Each node reads the checkpoint `checkpoint_copies` times. A replica over
    several nodes loads no faster than one: each node reads the whole
    checkpoint (see the streamer's notes above), all of them at once.
    """
    io = host_io(instance.name)
    node_read_bytes = weight_bytes * checkpoint_copies
    return ColdStart(
        model=model,
        instance=instance.name,
        node_ready=node_ready_seconds(instance),
        image_pull=image_pull_seconds(io),
        ray_start=figure("ray_start"),
        weights=weights_seconds(node_read_bytes, io),
        engine_init=engine_init_seconds(tensor_parallel_size, enforce_eager),
        serve_ready=figure("serve_ready"),
        node_read_bytes=node_read_bytes,
        checkpoint_copies=checkpoint_copies,
    )


# --- Timeouts against the budget ---------------------------------------------


@dataclass(frozen=True)
class Timeout:
    """One timeout on the cold-start path: its config key, its value, and the part of the budget it must cover."""

    key: str
    seconds: float
    covers: str  # "total", "to_ray_up", "in_container" or "node_ready"
    what: str


def required(budget: ColdStart, covers: str) -> float:
    """The part of the budget a timeout covers."""
    if covers == "node_ready":
        return budget.node_ready
    value = getattr(budget, covers)
    return float(value)


def timeout_problems(budget: ColdStart, timeouts: list[Timeout]) -> list[tuple[str, str]]:
    """(key, message) for every timeout shorter than the part of the budget it covers."""
    problems = []
    for t in timeouts:
        need = required(budget, t.covers)
        if t.seconds < need:
            problems.append(
                (
                    t.key,
                    f"{t.seconds:.0f} s is shorter than the cold-start budget of '{budget.model}' on "
                    f"{budget.instance} that {t.what} must cover: {need:.0f} s ({describe(budget)}); "
                    "raise it, or shorten the start (see README, Capacity)",
                )
            )
    return problems


def describe(budget: ColdStart) -> str:
    """The phases as one short string; the weights with what each node reads."""
    parts = []
    for key, seconds in budget.phases().items():
        part = f"{key.replace('_', ' ')} {seconds} s"
        if key == "weights":
            part += f" for {weights_read(budget)}"
        parts.append(part)
    return ", ".join(parts)


def weights_read(budget: ColdStart) -> str:
    """What each node reads from S3, e.g. "141 GB a node" or "564 GB a node: 4 ranks each read all 141 GB"."""
    read = f"{budget.node_read_bytes / GB:.0f} GB a node"
    if budget.checkpoint_copies > 1:
        checkpoint = budget.node_read_bytes / budget.checkpoint_copies
        read += f": {budget.checkpoint_copies} ranks each read all {checkpoint / GB:.0f} GB"
    return read


def output(budget: ColdStart) -> dict[str, Any]:
    """The budget as the stack output shows it."""
    return {
        "instance_type": budget.instance,
        "total_seconds": round(budget.total),
        "phases_seconds": budget.phases(),
        "weights_read_per_node_gb": round(budget.node_read_bytes / GB, 1),
    }


def sources() -> dict[str, str]:
    """Every pinned figure with its value and source, for the stack output and the README."""
    return {k: f"{f.value:g} {f.unit}: {f.source}" for k, f in FIGURES.items()}
