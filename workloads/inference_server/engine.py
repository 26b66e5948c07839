"""Turns a catalogue entry into the keyword arguments of a Ray Serve LLM ``LLMConfig``.

Plain dictionaries only (no Ray import), so the mapping is tested in
milliseconds and the builder in ``app.py`` stays a thin layer.
"""

from __future__ import annotations

from typing import Any

from .catalog import Catalog, GracefulShutdown, ModelEntry, S3Streamer, ServeAutoscaling, Tracing

# vLLM streams safetensors straight from S3 with this loader; nothing is
# written to local disk and no model hub is asked.
S3_LOAD_FORMAT = "runai_streamer"

# Stops any library from reaching a model hub when the catalogue forbids it.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# Ray Serve's request tracing (serve-ingress). Ray 2.60 offers two switches:
# the RAY_SERVE_TRACING_* environment variables of the Serve processes, and
# the declarative `tracing_config` of serveConfigV2 (ray.serve.schema
# TracingConfig: enabled, exporter_import_path, sampling_ratio), which the
# controller hands to every replica it starts. The platform uses the latter:
# it is part of the Serve config, so turning tracing on or off is an in-place
# Serve update, while an environment variable in the pods would change the
# RayCluster and so roll a new cluster (a NewCluster upgrade of GPU nodes).
# Serve's exporter hook takes no arguments, so the replicas find the collector
# in this variable, set in their runtime_env from the same catalogue.
SERVE_TRACING_EXPORTER = "inference_server.tracing:serve_span_processors"
SERVE_OTLP_ENDPOINT_ENV = "INFERENCE_SERVE_OTLP_ENDPOINT"


def autoscaling_config(scaling: ServeAutoscaling) -> dict[str, Any]:
    """Ray Serve ``autoscaling_config``, every knob written out explicitly."""
    config: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
    }
    if scaling.initial_replicas is not None:
        config["initial_replicas"] = scaling.initial_replicas
    return config


def shutdown_options(shutdown: GracefulShutdown) -> dict[str, Any]:
    """Serve's graceful shutdown options of a deployment."""
    return {
        "graceful_shutdown_timeout_s": shutdown.timeout_s,
        "graceful_shutdown_wait_loop_s": shutdown.wait_loop_s,
    }


def ingress_deployment_config(catalog: Catalog) -> dict[str, Any]:
    """Serve LLM's ``ingress_deployment_config``: replaces its defaults (to zero with the models, else 1..1)."""
    ingress = catalog.ingress
    config: dict[str, Any] = {
        **shutdown_options(catalog.shutdown),
        "autoscaling_config": {
            "min_replicas": ingress.min_replicas,
            "max_replicas": ingress.max_replicas,
            "target_ongoing_requests": ingress.target_ongoing_requests,
            "upscale_delay_s": ingress.upscale_delay_s,
            "downscale_delay_s": ingress.downscale_delay_s,
        },
        "max_ongoing_requests": ingress.max_ongoing_requests,
        "max_replicas_per_node": ingress.max_replicas_per_node,
    }
    actor_options: dict[str, Any] = {}
    if catalog.ingress_resource is not None:
        # Only the ingress group's nodes advertise it: a replica never takes
        # a GPU worker's CPUs, and each ingress pod's replica (and so its
        # proxy, which its readiness probe needs) stays on that pod.
        actor_options["resources"] = {catalog.ingress_resource: 1}
    env = serve_tracing_env(catalog.tracing)
    if env:
        actor_options["runtime_env"] = {"env_vars": env}
    if actor_options:
        config["ray_actor_options"] = actor_options
    return config


def serve_tracing_env(tracing: Tracing) -> dict[str, str]:
    """What a Serve replica's exporter reads (``inference_server.tracing``): the collector, when tracing is on."""
    return {SERVE_OTLP_ENDPOINT_ENV: tracing.otlp_endpoint} if tracing.otlp_endpoint else {}


def serve_tracing_config(tracing: Tracing) -> dict[str, Any] | None:
    """serveConfigV2's top-level ``tracing_config`` (Ray Serve's TracingConfig), or None when tracing is off.

    Serve's proxies are started before any config arrives and read only the
    RAY_SERVE_TRACING_* environment variables, so they are not traced; the
    ingress and model replicas are, which covers the request's hops in Serve.
    """
    if not tracing.enabled:
        return None
    return {
        "enabled": True,
        "exporter_import_path": SERVE_TRACING_EXPORTER,
        "sampling_ratio": tracing.sample_ratio,
    }


def streamer_config(streamer: S3Streamer) -> dict[str, int | bool]:
    """vLLM's ``model_loader_extra_config`` for runai_streamer.

    vLLM 0.29 accepts exactly these three keys (runai_streamer_loader.py:
    ``allowed_keys = {"distributed", "concurrency", "memory_limit"}``) and
    refuses a ``distributed`` that is not a bool. Off is vLLM's default, so a
    one-rank replica's arguments carry no ``distributed`` at all.
    """
    config: dict[str, int | bool] = {"concurrency": streamer.concurrency, "memory_limit": streamer.memory_limit}
    if streamer.distributed:
        config["distributed"] = True
    return config


def engine_kwargs(entry: ModelEntry, catalog: Catalog) -> dict[str, Any]:
    """vLLM engine arguments for one model."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": entry.tensor_parallel_size,
        "pipeline_parallel_size": entry.pipeline_parallel_size,
        "max_model_len": entry.max_model_len,
        "dtype": entry.dtype,
        "gpu_memory_utilization": entry.gpu_memory_utilization,
        # A request that omits max_tokens gets at most the server limit,
        # not "the rest of the context window".
        "override_generation_config": {"max_new_tokens": catalog.limits.max_tokens},
        # The engine refuses what the guard refuses: one value for both
        # (vLLM's own default, 20, would let the other layout's path ask more).
        "max_logprobs": catalog.limits.max_logprobs,
    }
    if entry.quantization is not None:
        kwargs["quantization"] = entry.quantization
    if entry.weights_kind == "s3":
        kwargs["load_format"] = S3_LOAD_FORMAT
        if entry.streamer is not None:
            kwargs["model_loader_extra_config"] = streamer_config(entry.streamer)
    elif entry.weights_kind == "hub":
        kwargs["download_dir"] = catalog.model_cache_dir
    if catalog.tracing.otlp_endpoint is not None:
        # vLLM's own option (ObservabilityConfig.otlp_traces_endpoint): one
        # `llm_request` span per request, in both layouts. Not
        # collect_detailed_traces: its per-step timings cost engine time.
        kwargs["otlp_traces_endpoint"] = catalog.tracing.otlp_endpoint
    kwargs.update(entry.engine_overrides)
    return kwargs


def replica_env(entry: ModelEntry, catalog: Catalog) -> dict[str, str]:
    """The environment a model's replica adds: offline unless a hub download is allowed, the hub cache."""
    env: dict[str, str] = {}
    if entry.weights_kind != "hub" or not catalog.allow_hub_download:
        env.update(OFFLINE_ENV)
    if entry.weights_kind == "hub":
        env["HF_HOME"] = catalog.model_cache_dir
    return env


def llm_config_kwargs(entry: ModelEntry, catalog: Catalog) -> dict[str, Any]:
    """Keyword arguments for ``ray.serve.llm.LLMConfig`` for one catalogue entry."""
    scaling = entry.autoscaling
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": entry.model_id, "model_source": entry.source},
        "engine_kwargs": engine_kwargs(entry, catalog),
        "deployment_config": {
            "autoscaling_config": autoscaling_config(scaling),
            "max_ongoing_requests": scaling.max_ongoing_requests,
            **shutdown_options(catalog.shutdown),
        },
        # vLLM's own metrics, exported by Ray's metrics agent as ray_vllm_*.
        "log_engine_metrics": True,
    }
    if entry.accelerator_type is not None:
        config["accelerator_type"] = entry.accelerator_type
    else:
        # Serve LLM assumes a GPU when no accelerator is named; the catalogue's
        # "no accelerator" means the CPU build of vLLM.
        config["accelerator_config"] = {"kind": "cpu"}
    # Serve's own spans of the model replica (serve-ingress only: this is Serve LLM's config).
    env = {**replica_env(entry, catalog), **serve_tracing_env(catalog.tracing)}
    if env:
        config["runtime_env"] = {"env_vars": env}
    return config
