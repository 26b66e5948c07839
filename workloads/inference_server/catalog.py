"""The model catalogue: one typed schema shared by the Pulumi program and the server.

The infrastructure code imports this module to write the RayService
``serveConfigV2`` and the server parses the very same model at start-up, so the
two can never drift apart. It must stay importable with pydantic alone: no Ray,
no vLLM, no relative imports of modules that pull them in.
"""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .api_keys import KEY_ID_RULE, valid_key_id

WeightsKind = Literal["s3", "local", "hub"]

# How requests reach the engines (see VllmServerSettings and app.py):
# * "vllm-server": Ray Serve places, health-checks and autoscales vLLM's own
#   OpenAI server; clients (the load balancer) talk to it directly, so no
#   streamed token crosses a Ray process. One model, never at zero.
# * "serve-ingress": Ray Serve LLM's OpenAI ingress routes every request by its
#   `model` field through Serve; several models share one address and a model
#   can scale to zero, at the cost of Serve's hops on every streamed chunk.
Layout = Literal["vllm-server", "serve-ingress"]

# "org/name" as the model hubs spell repository ids (no scheme, exactly one slash).
# The file a vllm-server pod's preStop hook creates when the pod is deleted;
# every vLLM server of the pod then drains (vllm_guard), whether or not Ray
# can still reach its GCS. The pod's environment names it.
NODE_DRAIN_FILE_ENV = "INFERENCE_NODE_DRAIN_FILE"
NODE_DRAIN_FILE = "/tmp/inference-node-draining"
# Ray starts every worker process at nice 15 (its `worker_niceness` setting,
# read from RAY_worker_niceness; Ray's own job manager sets it to 0 for job
# drivers, ray/dashboard/modules/job/job_manager.py). A Serve replica is a
# worker, and the vLLM server it starts inherits the value: vLLM's host side
# (API server, engine core), which sets the GPU's pace, would yield the CPU to
# every daemon on the node. A container can not lower its own niceness
# without CAP_SYS_NICE, which Pod Security `restricted` drops, so the raylet
# of a node that serves models starts its workers at the normal priority.
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
# What the OpenAI API accepts as a model name and what is safe in a Serve deployment name.
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def serve_llm_deployment_name(model_id: str) -> str:
    """Serve's name of a model's deployment in the serve-ingress layout, as Ray Serve LLM builds it.

    ray/llm/_internal/serve/core/server/builder.py (Ray 2.60): the prefix is
    the server class' name (``f"{deployment_cls.__name__}:"``, our
    ``app.LLMServer`` keeps Ray's name), the rest ``_get_deployment_name``:
    ``llm_config.model_id.replace("/", "--").replace(".", "_")``. Written out
    here because the render runs without Ray; a test holds it to Ray's code.
    """
    return "LLMServer:" + model_id.replace("/", "--").replace(".", "_")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# How an OTLP endpoint may be written. vLLM 0.29 exports over OTLP/gRPC unless
# OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says otherwise (vllm/tracing/otel.py), and
# its gRPC exporter reads the scheme only for TLS: https:// is TLS, http:// and
# grpc:// are plaintext. The port is required: the gRPC channel has no
# well-known default, and the NetworkPolicy opens exactly that port.
OTLP_SCHEMES = ("http", "https", "grpc")


def otlp_endpoint_problem(value: str) -> str | None:
    """Why ``value`` is not an OTLP/gRPC collector address (scheme://host:port), or None."""
    rule = "must be http://host:port, https://host:port or grpc://host:port (the collector's OTLP/gRPC port, e.g. 4317)"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return f"'{value}' {rule}"
    if parts.scheme not in OTLP_SCHEMES or not parts.hostname or port is None or port == 0:
        return f"'{value}' {rule}"
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        # A path (such as OTLP/HTTP's /v1/traces) would be dropped by the gRPC exporter without a word.
        return f"'{value}' {rule}, with no path, query or credentials"
    return None


class Tracing(_Strict):
    """OpenTelemetry traces: where vLLM (both layouts) and Ray Serve (serve-ingress) send their spans.

    Off unless ``otlp_endpoint`` names a collector. vLLM exports one
    ``llm_request`` span per finished request (attribute ``gen_ai.request.id``
    is vLLM's request id, ``chatcmpl-<X-Request-Id>`` for a chat completion);
    under serve-ingress Serve's replicas add theirs (``route_to_replica``,
    ``replica_handle_request``, attribute ``request_id``). Serve's proxies are
    not traced: Ray 2.60 gives them only its environment variables.
    """

    otlp_endpoint: str | None = Field(
        default=None, description="The OTLP/gRPC collector, scheme://host:port (http and grpc plaintext, https TLS)."
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description=(
            "Share of requests Ray Serve traces (its TracingConfig.sampling_ratio, parent-based). vLLM has no "
            "sampler option: under vllm-server it exports a span for every request; under serve-ingress its spans "
            "go through the tracer provider Serve installs in the model replica, so this ratio applies to them too."
        ),
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            problem = otlp_endpoint_problem(value)
            if problem:
                raise ValueError(problem)
        return value

    @property
    def enabled(self) -> bool:
        """Whether spans are sent anywhere."""
        return self.otlp_endpoint is not None

    @property
    def port(self) -> int | None:
        """The collector's port (what the serving pods' egress must allow), when tracing is on."""
        return urlsplit(self.otlp_endpoint).port if self.otlp_endpoint else None


class RequestLimits(_Strict):
    """Limits applied to every request before it reaches an engine."""

    max_tokens: int = Field(default=4096, gt=0, description="Largest max_tokens / max_completion_tokens accepted.")
    max_prompt_tokens: int = Field(default=32768, gt=0, description="Largest prompt accepted, in tokens.")
    max_n: int = Field(
        default=4,
        ge=1,
        le=128,
        description="Largest n (choices) and best_of accepted: each choice is a sequence the engine generates.",
    )
    max_request_output_tokens: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Most tokens one request may ask for over all its sequences: prompts x max(n, best_of) x max_tokens "
            "(the server's max_tokens when the request leaves it out). None: max_tokens x max_n."
        ),
    )
    prompt_bytes_per_token: int = Field(
        default=16,
        ge=1,
        le=256,
        description=(
            "Cheap pre-check before tokenizing: a prompt with more than max_prompt_tokens x this many UTF-8 "
            "bytes is refused unread by the tokenizer. Text averages 3-5 bytes a token; it also sizes the body cap."
        ),
    )
    # vLLM takes up to 1,024 prompts in one /v1/completions request
    # (VLLM_MAX_COMPLETION_PROMPTS) and prefills each; these two keep one
    # request's prefill to what a single prompt at the limit costs.
    max_prompts: int = Field(
        default=16, ge=1, le=1024, description="Most prompts one /v1/completions request may carry."
    )
    max_request_prompt_tokens: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Most prompt tokens one request may carry over all its prompts, counted after the chat template. "
            "None: max_prompt_tokens, so a batch of prompts costs no more prefill than one prompt at the limit."
        ),
    )
    max_logprobs: int = Field(
        default=5,
        ge=0,
        le=20,
        description=(
            "Largest logprobs, top_logprobs and prompt_logprobs accepted; also the engine's max_logprobs, so the "
            "guard and the engine hold one value (20 is the OpenAI API's own ceiling)."
        ),
    )
    max_prompt_logprob_tokens: int = Field(
        default=2048,
        gt=0,
        description=(
            "Most prompt tokens one request may ask logprobs for (prompt_logprobs, or echo with logprobs). The API "
            "server builds max_logprobs + 1 entries for each on its one event loop, stalling every other stream; "
            "a value above the request's prompt tokens changes nothing."
        ),
    )

    @model_validator(mode="after")
    def _check_output_budget(self) -> RequestLimits:
        if self.max_request_output_tokens is not None and self.max_request_output_tokens < self.max_tokens:
            raise ValueError(
                f"max_request_output_tokens ({self.max_request_output_tokens}) must be at least max_tokens "
                f"({self.max_tokens}): a single choice at the default length would be refused"
            )
        if self.max_request_prompt_tokens is not None and self.max_request_prompt_tokens < self.max_prompt_tokens:
            raise ValueError(
                f"max_request_prompt_tokens ({self.max_request_prompt_tokens}) must be at least max_prompt_tokens "
                f"({self.max_prompt_tokens}): a single prompt at the limit would be refused"
            )
        return self

    @property
    def request_prompt_token_budget(self) -> int:
        """The most prompt tokens one request may carry over all its prompts."""
        if self.max_request_prompt_tokens is not None:
            return self.max_request_prompt_tokens
        return self.max_prompt_tokens

    @property
    def output_token_budget(self) -> int:
        """The most tokens one request may ask for over all its sequences."""
        if self.max_request_output_tokens is not None:
            return self.max_request_output_tokens
        return self.max_tokens * self.max_n


class ServeAutoscaling(_Strict):
    """Ray Serve replica autoscaling for one model.

    Both ``target_ongoing_requests`` and ``max_ongoing_requests`` are always
    written out: Serve LLM's defaults (1e9) mean a deployment never scales.
    """

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    target_ongoing_requests: float = Field(default=16, gt=0)
    max_ongoing_requests: int = Field(default=64, gt=0)
    upscale_delay_s: float = Field(default=30, ge=0)
    downscale_delay_s: float = Field(default=600, ge=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> ServeAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not (self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must lie between "
                f"min_replicas ({self.min_replicas}) and max_replicas ({self.max_replicas})"
            )
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests ({self.target_ongoing_requests}) must not exceed "
                f"max_ongoing_requests ({self.max_ongoing_requests})"
            )
        return self


class IngressScaling(_Strict):
    """Ray Serve autoscaling of the OpenAI ingress (auth, tokenisation, routing for every model).

    Never below one replica: Serve runs HTTP proxies only on nodes that hold
    replicas (and on the head, which the serve Service leaves out), so an
    ingress at zero leaves the Kubernetes Service without a Ready endpoint.
    The RayService then never turns Ready and no request can arrive to wake a
    model that scaled to zero. One ingress replica costs a few CPUs; it keeps
    the path open at every scale. Serve LLM's own default follows the models
    to zero, or pins one replica (min 1, max 1) otherwise.
    """

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=2, ge=1)
    target_ongoing_requests: float = Field(default=64, gt=0)
    max_ongoing_requests: int = Field(default=256, gt=0)
    # One per Ray node: the replicas land on different pods, which the
    # RayService spreads over Kubernetes nodes, so no node is a single point
    # of failure and each pod that exists holds a replica (and so a proxy).
    max_replicas_per_node: int = Field(default=1, ge=1)
    upscale_delay_s: float = Field(default=10, ge=0)
    downscale_delay_s: float = Field(default=300, ge=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> IngressScaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests ({self.target_ongoing_requests}) must not exceed "
                f"max_ongoing_requests ({self.max_ongoing_requests})"
            )
        return self

    def nodes(self, replicas: int) -> int:
        """Ray nodes (ingress pods) that hold `replicas` replicas."""
        return -(-replicas // self.max_replicas_per_node)


class GracefulShutdown(_Strict):
    """How a Serve replica stops: it takes no new requests and finishes the ones it holds.

    Set on every deployment (each model and the OpenAI ingress, which holds a
    stream for as long as the model does). The platform sets ``timeout_s`` to
    the longest generation the request limits allow (infra/serving/drain.py);
    the defaults are Serve's own.
    """

    timeout_s: float = Field(default=20, ge=0, description="Serve's graceful_shutdown_timeout_s.")
    wait_loop_s: float = Field(default=2, ge=0, description="Serve's graceful_shutdown_wait_loop_s.")


class KeyFairness(_Strict):
    """What one API key may hold of a replica: requests in flight at once, and how long a refused client waits.

    The guard counts a generation request from the moment it is let in until
    its answer ends (a stream: its last chunk, or the client going away).
    Over its key's cap, or over the replica's own cap (the serving replica's
    ``max_ongoing_requests``), a request gets 429 with ``Retry-After``
    (``inference_server.fairness``). The caps hold per guard: a vllm-server
    replica, or a serve-ingress OpenAI ingress replica.
    """

    max_inflight_per_key: int = Field(
        default=8, ge=1, le=4096, description="Requests one key may have in flight at one replica."
    )
    per_key: dict[str, int] = Field(
        default_factory=dict,
        description="Key id -> its own in-flight cap, in place of max_inflight_per_key (e.g. the batch worker's).",
    )
    retry_after_s: int = Field(
        default=1, ge=1, le=600, description="The Retry-After a refused request gets, in seconds."
    )

    @field_validator("per_key")
    @classmethod
    def _check_per_key(cls, value: dict[str, int]) -> dict[str, int]:
        for key_id, cap in value.items():
            if not valid_key_id(key_id):
                raise ValueError(f"per_key: '{key_id}' is not a key id ({KEY_ID_RULE})")
            if cap < 1:
                raise ValueError(f"per_key.{key_id}: {cap} must be at least 1")
        return value

    def cap_for(self, key_id: str) -> int:
        """The in-flight cap of the key ``key_id``."""
        return self.per_key.get(key_id, self.max_inflight_per_key)

    def caps(self) -> dict[str, int]:
        """Every cap the config names: the default under "*", then each key's own."""
        return {"*": self.max_inflight_per_key, **self.per_key}


class S3Streamer(_Strict):
    """How vLLM's runai_streamer reads S3 weights (its `model_loader_extra_config`).

    The platform sizes them from the node's network (infra/serving/serve_config.py):
    enough parallel S3 reads, over the ranks on a node, to fill the line rate,
    and a CPU staging buffer that holds a couple of seconds of it; and it
    streams distributed whenever a node holds more than one of a replica's ranks.
    """

    concurrency: int = Field(
        ge=1, le=256, description="Parallel S3 reads of each rank (RUNAI_STREAMER_CONCURRENCY, read per process)."
    )
    memory_limit: int = Field(
        ge=-1,
        description="CPU buffer in bytes (RUNAI_STREAMER_MEMORY_LIMIT; -1 unlimited); "
        "with distributed streaming a total for the ranks on a node, which the streamer divides between them.",
    )
    distributed: bool = Field(
        default=False,
        description="Distributed streaming: the ranks on a node each read a share of the checkpoint from S3 and "
        "broadcast it to the others, so the node reads it once, not once per rank.",
    )


class ModelEntry(_Strict):
    """One served model."""

    model_id: str = Field(description="The model name clients send in the OpenAI `model` field.")
    source: str = Field(
        description='Where the weights are: "s3://bucket/prefix", an absolute local path, or a hub id "org/name".'
    )
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    max_model_len: int = Field(gt=0)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: str | None = None
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    accelerator_type: str | None = Field(
        default=None, description='Ray accelerator type, e.g. "L4", "A10G", "L40S", "H100"; None on CPU.'
    )
    engine_overrides: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Extra vLLM engine keyword arguments."
    )
    autoscaling: ServeAutoscaling = Field(default_factory=ServeAutoscaling)
    streamer: S3Streamer | None = Field(
        default=None, description="runai_streamer settings for s3:// sources; None keeps the streamer's defaults."
    )

    @field_validator("model_id")
    @classmethod
    def _check_model_id(cls, value: str) -> str:
        if not _MODEL_ID.match(value):
            raise ValueError(
                "model_id must be 1-128 characters of letters, digits and . _ : / -, "
                f"starting with a letter or digit (got {value!r})"
            )
        return value

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        if value.startswith("s3://"):
            if not _S3_URI.match(value):
                raise ValueError(f"source {value!r} is not a valid s3://bucket/prefix URI")
            return value
        if "://" in value:
            raise ValueError(f"source {value!r}: only s3:// URIs are supported")
        if os.path.isabs(value) or _HUB_ID.match(value):
            return value
        raise ValueError(
            f'source {value!r} must be "s3://bucket/prefix", an absolute local path, or a hub id "org/name"'
        )

    @field_validator("engine_overrides")
    @classmethod
    def _check_overrides(cls, value: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        # These have typed fields of their own; a second spelling would be ambiguous.
        owned = {
            "model",
            "served_model_name",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "max_model_len",
            "dtype",
            "quantization",
            "gpu_memory_utilization",
            # The catalogue's `tracing` section sets it for every model.
            "otlp_traces_endpoint",
            # limits.max_logprobs sets it: the guard and the engine hold one value.
            "max_logprobs",
        }
        clash = sorted(owned & set(value))
        if clash:
            raise ValueError(f"engine_overrides must not set {clash}: use the catalogue fields instead")
        return value

    # A plain property, not a computed field: it stays out of model_dump(), so a
    # dumped catalogue parses again under extra="forbid".
    @property
    def weights_kind(self) -> WeightsKind:
        """Where the weights come from: "s3", "local" or "hub"."""
        if self.source.startswith("s3://"):
            return "s3"
        if os.path.isabs(self.source):
            return "local"
        return "hub"

    @property
    def num_devices(self) -> int:
        """Accelerators one replica of this model needs."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class VllmServerSettings(_Strict):
    """Where a replica's vLLM OpenAI server listens in the "vllm-server" layout.

    The public port answers the OpenAI API behind the API keys (only
    ``/health`` is open, for the readiness probe). vLLM's Prometheus registry
    is served on its own port, outside the guard, which only the monitoring
    stack may reach (a NetworkPolicy matter, not a key).
    """

    host: str = Field(default="0.0.0.0", min_length=1)
    port: int = Field(default=8100, ge=0, le=65535, description="0: any free port (local runs).")
    metrics_port: int = Field(default=8101, ge=0, le=65535, description="0: any free port (local runs).")
    address_dir: str | None = Field(
        default=None,
        description="Local runs: each replica writes <replica>.json with its URLs here, as ports are not fixed.",
    )
    drain_notice_s: float = Field(
        default=40,
        ge=0,
        description=(
            "How long a stopping replica keeps serving after its readiness turns 503, at the least: the time the "
            "readiness probe and the load balancer take to stop sending it new requests."
        ),
    )

    @model_validator(mode="after")
    def _check_ports(self) -> VllmServerSettings:
        if self.port and self.port == self.metrics_port:
            raise ValueError(f"vllm_server.port and metrics_port must differ (both {self.port})")
        return self


class Catalog(_Strict):
    """Everything the server needs to know to build its application."""

    models: list[ModelEntry] = Field(min_length=1)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    ingress: IngressScaling = Field(default_factory=IngressScaling)
    shutdown: GracefulShutdown = Field(default_factory=GracefulShutdown)
    ingress_resource: str | None = Field(
        default=None,
        description="A Ray custom resource that only the ingress nodes advertise; each ingress replica asks for 1.",
    )
    api_keys_file: str | None = Field(
        default="/etc/inference/api-keys/keys", description="File with one API key per line."
    )
    api_keys_env: str = Field(
        default="INFERENCE_API_KEYS",
        description="Environment variable with comma-separated API keys, used when the file is absent.",
    )
    allow_hub_download: bool = Field(
        default=False, description="Production configs leave this False: a hub source is then rejected."
    )
    model_cache_dir: str = "/models"
    layout: Layout = "serve-ingress"
    vllm_server: VllmServerSettings = Field(default_factory=VllmServerSettings)
    tracing: Tracing = Field(default_factory=Tracing)
    fairness: KeyFairness = Field(default_factory=KeyFairness)

    @model_validator(mode="after")
    def _check_layout(self) -> Catalog:
        if self.layout != "vllm-server":
            return self
        if len(self.models) != 1:
            raise ValueError(
                f"layout vllm-server serves exactly one model (the load balancer can not route by the request's "
                f"`model` field); the catalogue has {len(self.models)}: use serve-ingress"
            )
        # min_replicas 0 is allowed: a request to the head's Serve proxy wakes
        # the model (vllm_server.VllmServer.__call__), and the model gateway
        # sends it (the stack's rules require one for such a model).
        entry = self.models[0]
        if entry.pipeline_parallel_size != 1:
            raise ValueError(
                f"layout vllm-server runs a replica in one pod: {entry.model_id}'s pipeline_parallel_size must be 1"
            )
        return self

    @model_validator(mode="after")
    def _check_models(self) -> Catalog:
        seen: set[str] = set()
        duplicates: list[str] = []
        for entry in self.models:
            if entry.model_id in seen:
                duplicates.append(entry.model_id)
            seen.add(entry.model_id)
        if duplicates:
            raise ValueError(f"model_id must be unique; duplicated: {sorted(set(duplicates))}")
        if not self.allow_hub_download:
            hub = [m.model_id for m in self.models if m.weights_kind == "hub"]
            if hub:
                raise ValueError(
                    f"models {hub} load from a model hub but allow_hub_download is false: use an s3:// or local source"
                )
        return self

    def model(self, model_id: str) -> ModelEntry:
        for entry in self.models:
            if entry.model_id == model_id:
                return entry
        raise KeyError(model_id)

    def replica_inflight_cap(self) -> int:
        """Requests the guard lets its replica hold at once: that replica's ``max_ongoing_requests``.

        Under vllm-server the guard runs in the model's replica and Serve
        never sees its requests, so the guard is what holds the model's
        ``max_ongoing_requests``. Under serve-ingress it runs in the OpenAI
        ingress replica (``ingress.max_ongoing_requests``), while Serve holds
        each model replica to its own.
        """
        if self.layout == "vllm-server":
            return self.models[0].autoscaling.max_ongoing_requests
        return self.ingress.max_ongoing_requests
