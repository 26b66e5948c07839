"""serveConfigV2 from the typed catalogue: the one schema the server parses too.

The Pulumi program never imports Ray: it fills the server's own pydantic
`Catalog` and writes it as the application's `args`, so a field the server
does not know fails here, at preview, not in a crash-looping replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from infra.capacity import cold_start
from infra.config import Model, StackConfig, key_fairness
from infra.instance_types import host_io
from infra.scheduling import GpuPlacement
from infra.serving.drain import WAIT_LOOP_SECONDS, drain
from infra.serving.ports import RAY_PORTS
from workloads.inference_server.catalog import (
    Catalog,
    GracefulShutdown,
    Layout,
    ModelEntry,
    S3Streamer,
    Tracing,
    VllmServerSettings,
)
from workloads.inference_server.engine import serve_tracing_config

# The builder in workloads/ that turns the catalogue into Ray Serve LLM's app.
IMPORT_PATH = "inference_server.app:build_app"


@dataclass(frozen=True)
class Mounts:
    """Where the pods see the API keys and the model cache."""

    api_keys_dir: str = "/etc/inference/api-keys"
    api_keys_key: str = "keys"  # the Secret's data key, one API key per line
    # The batch worker's own key (its Secret has the same data key).
    batch_api_key_dir: str = "/etc/inference/batch-api-key"
    model_cache_dir: str = "/models"
    # vLLM's, Inductor's and Triton's caches (ray_service.engine_cache_env).
    cache_dir: str = "/var/cache/llm"

    @property
    def api_keys_file(self) -> str:
        """The file the server reads the keys from."""
        return str(PurePosixPath(self.api_keys_dir) / self.api_keys_key)

    @property
    def batch_api_key_file(self) -> str:
        """The file the batch worker reads its key from."""
        return str(PurePosixPath(self.batch_api_key_dir) / self.api_keys_key)


MOUNTS = Mounts()

# The Ray custom resource only the ingress group's nodes advertise (KubeRay
# group `resources`); the OpenAI ingress replicas ask for one each. Without it
# Serve may place a second ingress replica on a GPU worker (it has the CPUs),
# leaving an ingress pod with no replica, no proxy and so never Ready.
INGRESS_RESOURCE = "llm_platform_ingress"


def catalog_entry(model: Model, placement: GpuPlacement) -> ModelEntry:
    """The server's view of a configured model (placement fields dropped).

    The accelerator type always comes from the model's GPU group: the
    replica's bundle then asks for the `accelerator_type:<GPU>` resource
    that exactly that group's nodes advertise, and the engine never falls
    back to the CPU accelerator on a GPU node.
    """
    fields = model.model_dump(include=set(ModelEntry.model_fields))
    fields["accelerator_type"] = placement.instance.ray_accelerator_type
    if model.weights_kind == "s3" and model.streamer is None:
        fields["streamer"] = streamer_settings(model, placement)
    return ModelEntry(**fields)


def streamer_settings(model: Model, placement: GpuPlacement) -> S3Streamer:
    """runai_streamer sized from the node's network (infra/capacity/cold_start.py), unless the stack sets it.

    A replica with more than one rank on a node streams distributed, so each
    node reads the checkpoint once; the ranks on a node share its NIC, so each
    opens its share of the node's S3 reads. The memory limit is the pod's:
    its GPUs' share of the node, as ray_service sizes it, which the streamer
    divides over the ranks when distributed.
    """
    instance = placement.instance
    io = host_io(instance.name)
    pod_memory_gib = int(instance.memory_gib * min(1.0, model.num_devices / instance.gpus))
    ranks = cold_start.ranks_per_node(model.num_devices, instance.gpus)
    return S3Streamer(
        concurrency=cold_start.streamer_concurrency(io, ranks),
        memory_limit=cold_start.streamer_memory_limit(io, pod_memory_gib),
        distributed=cold_start.streams_distributed(ranks),
    )


@dataclass(frozen=True)
class Readiness:
    """The readiness probe of a vllm-server pod, and how long a stopping replica must keep serving after it fails."""

    period_s: int = 5
    # Two misses: one slow /health under load does not take a serving pod out.
    failure_threshold: int = 2
    timeout_s: int = 5
    # From a target's deregistration until an NLB sends it no new connection:
    # AWS documents no bound; tens of seconds are commonly observed.
    load_balancer_deregistration_s: int = 30

    @property
    def drain_notice_s(self) -> int:
        """A draining replica's /health answers 503 this long before its server may stop."""
        return self.period_s * self.failure_threshold + self.load_balancer_deregistration_s


READINESS = Readiness()


def vllm_server_settings() -> VllmServerSettings:
    """Where a vllm-server replica listens in a pod: every interface, on the ports the pod declares."""
    return VllmServerSettings(
        host="0.0.0.0",
        port=RAY_PORTS.openai.number,
        metrics_port=RAY_PORTS.vllm_metrics.number,
        drain_notice_s=READINESS.drain_notice_s,
    )


def catalog(
    cfg: StackConfig, models: list[Model], gpu: Mapping[str, GpuPlacement], layout: Layout = "serve-ingress"
) -> Catalog:
    """The catalogue one RayService's application serves."""
    fields: dict[str, Any] = {}
    if layout == "serve-ingress":
        fields.update(ingress=cfg.serving.ingress, ingress_resource=INGRESS_RESOURCE)
    else:
        # No OpenAI ingress runs, so no ingress nodes and no resource to steer it there.
        fields.update(layout=layout, vllm_server=vllm_server_settings())
    return Catalog(
        models=[catalog_entry(m, gpu[m.gpu_group]) for m in models],
        limits=cfg.serving.limits,
        # Every replica finishes the longest generation the limits allow before it stops.
        shutdown=GracefulShutdown(timeout_s=drain(cfg).serve_timeout_seconds, wait_loop_s=WAIT_LOOP_SECONDS),
        api_keys_file=MOUNTS.api_keys_file,
        allow_hub_download=cfg.serving.allow_hub_download,
        model_cache_dir=MOUNTS.model_cache_dir,
        tracing=Tracing.model_validate(cfg.observability.tracing.model_dump()),
        fairness=key_fairness(cfg),
        **fields,
    )


# What each layout leaves at the server's defaults and so out of its args:
# a serve-ingress catalogue is written as it was before layouts existed (a
# changed serveConfigV2 is applied to the running cluster), and a vllm-server
# one names no ingress that would not run.
_UNUSED_FIELDS: dict[Layout, frozenset[str]] = {
    "serve-ingress": frozenset({"layout", "vllm_server"}),
    "vllm-server": frozenset({"ingress", "ingress_resource"}),
}


def catalog_args(catalog_: Catalog) -> dict[str, Any]:
    """The application's `args`: the catalogue as JSON, as the server parses it.

    `tracing` only when it is on: a stack without a collector renders the
    same serveConfigV2 as before tracing existed (a change is applied live).
    Likewise a streamer's `distributed` only when it is on: a model that
    streams as before keeps the args it had before the field existed.
    """
    unused = set(_UNUSED_FIELDS[catalog_.layout])
    if not catalog_.tracing.enabled:
        unused.add("tracing")
    exclude: dict[Any, Any] = dict.fromkeys(unused, True)
    plain = {
        i: {"streamer": {"distributed"}}
        for i, m in enumerate(catalog_.models)
        if m.streamer is not None and not m.streamer.distributed
    }
    if plain:
        exclude["models"] = plain
    return catalog_.model_dump(mode="json", exclude=exclude)


def serve_config(
    cfg: StackConfig, service: str, models: list[Model], gpu: Mapping[str, GpuPlacement]
) -> dict[str, Any]:
    """The serveConfigV2 document of one RayService."""
    layout = cfg.layout_for(models)
    # serve-ingress: a proxy on every node; the GPU workers' proxies answer
    # the readiness probe KubeRay adds, and the Service spreads over them.
    # vllm-server: requests go straight to each replica's vLLM server, so a
    # proxy only on the head (which the serve Service leaves out) keeps
    # Serve's HTTP side as small as it goes, and none takes a GPU worker's CPU.
    catalog_ = catalog(cfg, models, gpu, layout)
    config: dict[str, Any] = {
        "proxy_location": "EveryNode" if layout == "serve-ingress" else "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": RAY_PORTS.serve.number},
    }
    # Serve's own request tracing where requests pass through Serve; under
    # vllm-server no request does, and vLLM's spans are the request's.
    tracing = serve_tracing_config(catalog_.tracing) if layout == "serve-ingress" else None
    if tracing is not None:
        config["tracing_config"] = tracing
    config["applications"] = [
        {"name": service, "route_prefix": "/", "import_path": IMPORT_PATH, "args": catalog_args(catalog_)}
    ]
    return config


def serve_config_yaml(cfg: StackConfig, service: str, models: list[Model], gpu: Mapping[str, GpuPlacement]) -> str:
    """serveConfigV2 as the YAML string the CRD field takes."""
    return yaml.safe_dump(serve_config(cfg, service, models, gpu), sort_keys=False)
