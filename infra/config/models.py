"""The `models` section: each served model, and the rules that hold it to its GPU group, its weights and vLLM."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from pydantic import Field

from infra.capacity.geometry import Geometry, resolve_geometry, unknown_model_message
from infra.capacity.plan import GIB, Device, weight_bytes_per_parameter
from infra.capacity.rules import capacity_problems
from infra.config.fields import K8sName
from infra.config.node_groups import GpuNodeGroupSettings, usable_group
from infra.config.problems import Problem
from infra.config.workload import Workload, check_workload, workload_profile
from infra.instance_types import GpuInstanceType
from workloads.inference_server.catalog import ModelEntry, RequestLimits

# KubeRay appends suffixes to a RayService's name for its clusters and
# Services; longer names are rejected by its webhook.
RAY_SERVICE_NAME_MAX = 47
# Below this share of the usable GPU memory left for the KV cache a model
# loads but serves only a handful of short sequences at once.
KV_CACHE_MIN_SHARE = 0.1
# Prod keeps every model serving through a node drain (an upgrade, a
# consolidation, a spot reclaim): two replicas, never on one node.
PROD_MIN_MODEL_REPLICAS = 2
_ENGINE_ARGS_FILE = Path(__file__).parent.parent / "vllm_engine_args.json"


class Model(ModelEntry):
    """One served model: the catalogue entry the server reads, plus placement.

    Inherits the server's own catalogue schema so the program and the server
    can not disagree on a field.
    """

    name: K8sName
    gpu_group: str
    parameters_billion: float = Field(gt=0)
    # Models with the same `service` share one RayService; by default each
    # model is its own upgrade and failure domain.
    service: str | None = None
    # The model's shape for the capacity plan (infra/capacity/); the pinned
    # families of infra/capacity/geometry.py need none.
    geometry: Geometry | None = None
    # The traffic its capacity is planned for (infra/config/workload.py);
    # without it the plan takes the longest requests serving.limits admits.
    workload: Workload | None = None

    @property
    def service_name(self) -> str:
        """The RayService this model is served by."""
        return self.service or self.name

    def weights_gib(self) -> float:
        """Weights size in GiB for the dtype or quantization it loads in."""
        per_param = weight_bytes_per_parameter(self.dtype, self.quantization)
        return self.parameters_billion * 1e9 * per_param / GIB


def nodes_per_replica(model: Model, gpu: GpuInstanceType) -> int:
    """The nodes one replica of `model` spans on `gpu` nodes."""
    return max(1, math.ceil(model.tensor_parallel_size * model.pipeline_parallel_size / gpu.gpus))


def check_parallelism(path: str, model: Model, gpu: GpuInstanceType) -> Iterable[Problem]:
    """TP within a node and dividing it; pipeline stages that fill whole nodes.

    A TP group that does not divide a node would strand its other GPUs.
    That TP also divides the model's attention and KV heads, which vLLM
    shards over the TP ranks, is checked against the model's geometry by
    the capacity rules (infra/capacity/rules.py), once this rule holds.
    """
    tp, pp = model.tensor_parallel_size, model.pipeline_parallel_size
    if tp > gpu.gpus:
        yield Problem(
            f"{path}.tensor_parallel_size",
            f"{tp} GPUs do not fit {gpu.name} ({gpu.gpus} GPU{'s' if gpu.gpus > 1 else ''})",
        )
    elif gpu.gpus % tp:
        divisors = [str(d) for d in range(1, gpu.gpus + 1) if gpu.gpus % d == 0]
        yield Problem(
            f"{path}.tensor_parallel_size",
            f"{tp} does not divide the {gpu.gpus} GPUs of {gpu.name}: use {', '.join(divisors[:-1])} or "
            f"{divisors[-1]} (vLLM splits the attention heads over the TP ranks, and the models' head counts "
            "are powers of two; a TP group that does not divide a node also strands its other GPUs)",
        )
    elif tp * pp > gpu.gpus and tp != gpu.gpus:
        yield Problem(
            f"{path}.pipeline_parallel_size",
            f"{pp} stages of {tp} GPUs span nodes of {gpu.name} ({gpu.gpus} GPUs) but do not fill them: "
            f"each pipeline stage must use a whole node (tensor_parallel_size {gpu.gpus})",
        )


def _check_model_capacity(path: str, model: Model, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """The weights fit the replica's GPUs with room for a KV cache; the minimum replicas fit the group."""
    gpu = group.instance()
    gpus = model.num_devices
    # The memory the capacity plan takes for the GPU (what CUDA reports, not the datasheet's GB):
    # vLLM's gpu_memory_utilization is a share of it.
    memory = Device.of(gpu).memory_bytes
    budget = gpus * memory / GIB * model.gpu_memory_utilization
    weights = model.weights_gib()
    if weights > budget * (1 - KV_CACHE_MIN_SHARE):
        yield Problem(
            path,
            f"weights of {weights:.1f} GiB do not fit {gpus} x {gpu.gpu_model} "
            f"{memory / GIB:.1f} GiB (what CUDA reports of its {gpu.gpu_memory_gb} GB) x gpu_memory_utilization "
            f"{model.gpu_memory_utilization} "
            f"= {budget:.1f} GiB with {KV_CACHE_MIN_SHARE:.0%} left for the KV cache",
        )
    need = model.autoscaling.min_replicas * nodes_per_replica(model, gpu)
    if need > group.max_size:
        yield Problem(
            f"{path}.autoscaling.min_replicas",
            f"{model.autoscaling.min_replicas} replicas need {need} {gpu.name} nodes "
            f"but node group '{group.name}' has max_size {group.max_size}",
        )


def _check_model_fits_group(path: str, model: Model, group: GpuNodeGroupSettings) -> Iterable[Problem]:
    """The model's accelerator, parallelism, weights and minimum replicas fit its GPU group."""
    gpu = group.instance()
    if model.accelerator_type is not None and model.accelerator_type != gpu.ray_accelerator_type:
        yield Problem(
            f"{path}.accelerator_type",
            f"'{model.accelerator_type}' disagrees with GPU group '{group.name}' ({gpu.ray_accelerator_type}): "
            "leave it out, it is derived from the group",
        )
    parallelism = list(check_parallelism(path, model, gpu))
    yield from parallelism
    if not parallelism:
        yield from _check_model_capacity(path, model, group)


def check_model(
    i: int,
    model: Model,
    groups: dict[str, GpuNodeGroupSettings],
    *,
    model_bucket: str,
    is_prod: bool,
    allow_hub_download: bool,
    limits: RequestLimits,
) -> Iterable[Problem]:
    """One model: its group fits it, its weights come from where the stack allows, vLLM takes its settings."""
    path = f"models[{i}]"
    group = groups.get(model.gpu_group)
    if group is None:
        yield Problem(
            f"{path}.gpu_group",
            f"'{model.gpu_group}' is not a GPU node group (have: {', '.join(groups) or 'none'})",
        )
    elif usable_group(group):
        yield from _check_model_fits_group(path, model, group)
    if model.weights_kind == "s3" and not model.source.startswith(f"s3://{model_bucket}/"):
        yield Problem(
            f"{path}.source",
            f"S3 weights must live in the model bucket s3://{model_bucket}/ (the pods may read only that bucket)",
        )
    if model.weights_kind == "hub" and (is_prod or not allow_hub_download):
        yield Problem(
            f"{path}.source",
            "a hub download at start is not allowed "
            + ("in prod" if is_prod else "(set serving.allow_hub_download, or copy the weights to S3)"),
        )
    if is_prod and model.autoscaling.min_replicas < PROD_MIN_MODEL_REPLICAS:
        yield Problem(
            f"{path}.autoscaling.min_replicas",
            f"prod models keep at least {PROD_MIN_MODEL_REPLICAS} replicas, so one serves while a node drains "
            f"('{model.name}' has {model.autoscaling.min_replicas})",
        )
    yield from _check_engine_overrides(path, model)
    yield from check_workload(path, model.workload, model.max_model_len)
    yield from _check_capacity(path, model, group if usable_group(group) else None, limits)


def _check_capacity(
    path: str, model: Model, group: GpuNodeGroupSettings | None, limits: RequestLimits
) -> Iterable[Problem]:
    """The model's geometry is known, and its context, TP and KV cache fit it (infra/capacity/rules.py)."""
    geometry = resolve_geometry(model.geometry, model.source, model.model_id)
    if geometry is None:
        yield Problem(f"{path}.geometry", unknown_model_message(model.name, model.source, model.model_id))
        return
    gpu = group.instance() if group is not None else None
    if gpu is not None and list(check_parallelism(path, model, gpu)):
        gpu = None
    workload = workload_profile(model.workload, model.max_model_len, limits)
    for key, message in capacity_problems(model.name, model, geometry, model.parameters_billion, gpu, workload):
        yield Problem(f"{path}.{key}", message)


@cache
def vllm_engine_args() -> tuple[str, frozenset[str]]:
    """The pinned vLLM's version and the engine argument names Ray Serve LLM passes it (infra/vllm_engine_args.json)."""
    data = json.loads(_ENGINE_ARGS_FILE.read_text())
    return str(data["vllm_version"]), frozenset(data["engine_args"]) | frozenset(data["frontend_args"])


def _check_engine_overrides(path: str, model: Model) -> Iterable[Problem]:
    version, known = vllm_engine_args()
    for key in model.engine_overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            yield Problem(
                f"{path}.engine_overrides.{key}",
                f"not an engine argument of vLLM {version}{hint}: Ray Serve LLM would refuse it "
                "when the replica starts",
            )
