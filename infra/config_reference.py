"""The configuration reference (docs/configuration.md), generated from the stack's config model.

    python -m infra.config_reference > docs/configuration.md     # or: make config-docs

Walks `StackConfig` field by field and writes every key a `Pulumi.<stack>.yaml`
may set: its dotted path, type, default, the constraints pydantic holds it to
and its description (the field's `description`, which pydantic also fills from
an attribute docstring where a model sets `use_attribute_docstrings`). The
notes below add what the models do not say; each names a key, and a note whose
key the models no longer have stops the generator, so a rename can not leave
a stale note behind. tests/test_config_reference.py fails when the committed
page is not what this module prints.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from infra.config import API_KEY_MIN_LENGTH, CONFIG_NAMESPACES, NAMESPACE, SECRET_API_KEYS, StackConfig
from infra.config.routing import ROUTING_KEY_HEADER

# The one field of StackConfig that lives in another namespace (the AWS
# provider's), and how the stack file names it.
OTHER_NAMESPACE_KEYS = {"region": "aws:region"}

# What the models do not say, by key: the user's side of a setting (what it is
# for, what it interacts with, which rule holds it). Defaults and bounds come
# from the models and are not repeated here.
NOTES: Mapping[str, str] = {
    "environment": "prod turns on the production rules (see [the rules across fields](#rules-across-fields)).",
    "aws:region": "The stack's AWS region: every zone, ARN and price is checked against it.",
    "network.zones": "Availability zones of `aws:region`; EKS needs two, prod spreads over them.",
    "network.vpc_cidr": (
        "/16 to /28, and large enough that each zone's share (the VPC split into the next power of two of "
        "zones) holds its /19 private and /24 public subnet: a /17 for two zones, a /16 for three or four."
    ),
    "cluster.mode": "`eks`: create the cluster; `existing`: use `cluster.kubeconfig_context`.",
    "cluster.node_provisioner": (
        "How the cluster gets GPU nodes (`infra/aws/provisioning.py`): `karpenter` (the default for `mode: eks`): "
        "a NodePool and EC2NodeClass per GPU group; `managed_node_groups` (the default for `mode: existing`): "
        "EKS managed node groups scaled by cluster-autoscaler. The system nodes are a managed node group under "
        "both (see [Capacity: Karpenter or managed node groups]"
        "(architecture.md#capacity-karpenter-or-managed-node-groups))."
    ),
    "cluster.endpoint_public_access": (
        "API server access, with `endpoint_private_access` and `public_access_cidrs`; a public endpoint needs "
        "CIDRs, prod keeps it private."
    ),
    "cluster.public_access_cidrs": (
        "Each /8 or narrower, at most one /8 of public addresses in all (see [TLS and allow-lists]"
        "(security.md#tls-and-allow-lists))."
    ),
    "cluster.admin_principal_arns": (
        "IAM users or roles (`arn:<partition>:iam::<account>:role/<name>`, no STS sessions) given cluster-admin "
        "through access entries."
    ),
    "cluster.log_types": "Control-plane logs.",
    "cluster.kubeconfig_context": "The kubeconfig context of an existing cluster (`mode: existing`).",
    "node_groups.gpu[]": (
        "One managed node group (or Karpenter NodePool) per GPU shape. Every GPU group is tainted "
        "`nvidia.com/gpu=true:NoSchedule` and labelled with its name and GPU model."
    ),
    "node_groups.gpu[].instance_types": (
        "Share one GPU shape and are listed smallest first (the first is the autoscaler's node template and "
        "sizes the pods)."
    ),
    "node_groups.gpu[].capacity_reservation_ids": (
        "`cr-` + 8 to 17 hex digits; Karpenter only: on-demand capacity reservations or Capacity Blocks the pool "
        "launches into first, before `capacity_type`."
    ),
    "versions": "Chart versions; exact versions only.",
    "platform": "Each part may be off only on an existing cluster that already runs it.",
    "storage.model_bucket": "The S3 bucket for weights (created, private, encrypted, versioned, protected).",
    "storage.weights_writer_arns": (
        "IAM users or roles that may write weights to the bucket besides the deploying principal (the bucket "
        "policy denies everyone else)."
    ),
    "storage.model_cache_gib": (
        "Size limit of the per-pod emptyDir a hub download goes to (S3 sources stream and get none)."
    ),
    "storage.storage_class.kms_key_arn": "A KMS key ARN (`key/<id>`, not an alias) in the stack's region.",
    "ray.gcs_fault_tolerance": "ElastiCache Redis (TLS, an auth token); required in prod.",
    "ray.gcs_fault_tolerance.node_type": (
        "`cache.<family>.<size>` of a family that runs it (t3, t4g, m5, m6g, m7g, r5, r6g, r7g, c7gn)."
    ),
    "ray.cold_start": (
        "Each is refused below the model's cold-start budget (see [the cold-start budget]"
        "(capacity.md#the-cold-start-budget))."
    ),
    "ray.cold_start.autoscaler_allocate_seconds": "The Ray autoscaler's.",
    "ray.cold_start.autoscaler_ray_install_seconds": "The Ray autoscaler's.",
    "ray.cold_start.engine_start_seconds": "Serve LLM's.",
    "ray.cold_start.pulumi_wait_seconds": "Unset: 1800, 3600 from 40 GiB of weights.",
    "ray.idle_timeout_seconds": "The in-tree autoscaler's idle timeout.",
    "ray.upgrade_strategy": (
        "`NewCluster`: a second cluster beside the old one during an upgrade (see [Changing a running stack]"
        "(changing-a-running-stack.md)); `None`: cluster changes are not rolled out."
    ),
    "ray.upgrade_headroom": (
        "`peak`: each GPU group's `max_size` holds the old cluster at `max_replicas` plus the new one at its "
        "starting replicas, so an upgrade started at peak can place its new fleet; `min`: old at `min_replicas` "
        "plus new at start (cheaper, and an upgrade at peak waits for the old cluster to scale down). The plan "
        "prints the GPUs and $/h an upgrade holds ([upgrade headroom](upgrade-headroom.md))."
    ),
    "ray.head_cpu": "The Ray head's CPU: a positive Kubernetes quantity.",
    "ray.head_memory": "The Ray head's memory: a positive Kubernetes quantity, at least 1Mi.",
    "serving.limits": (
        "Larger requests get 400 (see [Request fields we accept](security.md#request-fields-we-accept))."
    ),
    "serving.limits.max_prompt_tokens": "Below every model's `max_model_len`.",
    "serving.limits.max_request_prompt_tokens": "At most every model's `max_model_len`.",
    "serving.fairness": (
        "Over a cap, 429 with `Retry-After` (see [Per-key limits and attribution]"
        "(security.md#per-key-limits-and-attribution))."
    ),
    "serving.fairness.max_inflight_per_key": "Below every replica's `max_ongoing_requests`.",
    "serving.layout": (
        "How requests reach the engines (see [Routing](routing.md)); `auto` runs `vllm-server` for every service "
        "it can serve (one model, `min_replicas` >= 1, `pipeline_parallel_size` 1) and `serve-ingress` "
        "elsewhere; an explicit `vllm-server` a service can not use is refused."
    ),
    "serving.ingress": (
        "The OpenAI ingress deployment of `serve-ingress` services (auth, tokenisation, routing); a "
        "`vllm-server` service ignores it."
    ),
    "serving.ingress.min_replicas": (
        "Never 0: the serve Service needs a proxy to stay Ready and to wake models from zero; prod at least 2."
    ),
    "serving.ingress.max_replicas_per_node": "Replicas spread over pods, pods over nodes.",
    "serving.allow_hub_download": "Allow hub ids as sources outside prod.",
    "serving.routing": (
        "vllm-router in front of each `vllm-server` service's replicas (see [Request-level routing]"
        "(routing.md#request-level-routing)); the load balancer then sends to the router."
    ),
    "serving.routing.enabled": "Needs at least one `vllm-server` service.",
    "serving.routing.policy": (
        "`cache_aware`: prefix-cache affinity, balanced by load when out of balance; `consistent_hash`: the "
        f"replica the request's `{ROUTING_KEY_HEADER}` hashes to; `power_of_two`: the shorter of two queues; "
        "`round_robin`: in turn."
    ),
    "serving.routing.cache_threshold": "`cache_aware`: the share of a prompt a replica's cache must match.",
    "serving.routing.balance_abs_threshold": "`cache_aware`: balance by load past this many requests' difference.",
    "serving.routing.balance_rel_threshold": "`cache_aware`: ... and past this ratio of busiest to idlest.",
    "serving.routing.min_replicas": "Prod at least 2 (spread over zones).",
    "serving.routing.queue_size": "Requests held while every replica is at its cap, then 429.",
    "serving.routing.attempts": (
        "Attempts a request gets, the first included: a 5xx, a 429 or a failed connection is tried again on "
        "another replica; a 4xx never. Each is a prefill."
    ),
    "serving.routing.circuit_breaker": (
        "Off by default: a request that fails on every replica would open every replica's circuit "
        "(see [Request-level routing](routing.md#request-level-routing))."
    ),
    "serving.routing.circuit_breaker.failures": "Failed attempts (5xx, failed connections) in `window_s` that open it.",
    "serving.routing.circuit_breaker.open_s": "How long an open circuit sends the replica nothing.",
    "serving.routing.circuit_breaker.close_after": "Good attempts after `open_s` that close it.",
    "models[].name": "The RayService name, at most 47 characters.",
    "models[].source": "`s3://<model bucket>/<prefix>` in a deployed stack.",
    "models[].accelerator_type": "Optional: derived from the group's GPU; a value that disagrees is refused.",
    "models[].engine_overrides": (
        "Names of the pinned vLLM's `AsyncEngineArgs` or `FrontendArgs`, listed in `infra/vllm_engine_args.json`."
    ),
    "models[].service": "Models with the same value share a RayService.",
    "models[].geometry": (
        "The model's shape from its `config.json`, for the capacity plan; not needed for the pinned families "
        "(see [the capacity plan's rules](capacity.md#the-rules-it-enforces))."
    ),
    "autoscaling.prescale[]": (
        "A KEDA cron ScaledObject over placeholder pods that each hold a whole GPU node at negative priority; "
        "Ray GPU workers preempt them."
    ),
    "autoscaling.prescale[].timezone": "An IANA zone.",
    "autoscaling.prescale[].start": (
        "5-field cron as KEDA reads it: minute 0-59, hour 0-23, day 1-31, month 1-12 or jan-dec, "
        "weekday 0-6 or sun-sat."
    ),
    "autoscaling.prescale[].end": "5-field cron, as `start`.",
    "autoscaling.prescale[].lead_seconds": (
        "How far `start` is ahead of the peak; at least the cold-start budget of the group's models."
    ),
    "observability.alertmanager_config_secret": (
        "A Secret in `monitoring` with `alertmanager.yaml`, the paging routes; required in prod."
    ),
    "observability.runbook_base_url": (
        "Where `docs/runbooks` is served: each alert's `runbook_url` is `<base>/<AlertName>.md`; unset, the "
        "page's path in the repository ([runbooks](runbooks/README.md))."
    ),
    "endpoint.allowed_cidrs": "Each /8 or narrower, at most one /8 of public addresses in all.",
    "endpoint.certificate_arn": "An ACM certificate in the stack's region.",
    "endpoint.domain": "Each RayService answers at `<name>.<domain>`; the certificate covers `*.<domain>`.",
    "endpoint.hosted_zone_id": "external-dns writes the records there (its `--zone-id-filter`).",
    "batch": "See [Batch inference](architecture.md#batch-inference-queue-fed-workers).",
    "batch.model": "A served `model_id`.",
    "batch.visibility_timeout_seconds": (
        "A worker's request timeout is 30 s less, and must cover the longest generation the limits allow at the "
        "SLO: `ttft_p95_seconds + max_tokens x inter_token_p95_seconds`."
    ),
    "image.reference": (
        "A prebuilt image pinned by digest; unset, the image is built from `workloads/` and pushed to ECR."
    ),
    "image.router_front_reference": (
        "The routers' front (nginx) pinned by digest, with `serving.routing` on; unset, the stack copies "
        "`ROUTER_FRONT_TAG` into `<repository_name>-router-front` in ECR and runs that digest "
        "(see [Supply chain](security.md#supply-chain)). A stack that builds no images (`image.reference`) "
        "gives this too."
    ),
}

# Checked across fields when the config is read, each failing with the key path and the rule.
CROSS_FIELD_RULES = """\
Checked once every key is read, each failing with the key path and the rule:
a model's `gpu_group` exists; tensor parallelism divides the GPUs of one node
of the group's instance type and pipeline stages fill whole nodes; the
weights (parameters x dtype bytes) fit `GPUs x GPU memory x gpu_memory_utilization`
with 10% left for the KV cache (GPU memory as CUDA reports it); the capacity
rules (see [the capacity plan](capacity.md#the-rules-it-enforces)); a group's
instance types share one GPU shape; `min <= desired <= max` for node groups and
replicas; a model's minimum replicas fit its group's maximum; names are valid
Kubernetes names and RayService names at most 47 characters; S3 sources live
in the model bucket; an internet-facing endpoint has TLS; zones belong to the
region; versions are exact. In prod: the endpoint, when internet-facing, has an
allow-list without 0.0.0.0/0; the API server is private; GCS fault tolerance is
on; alerts page through an Alertmanager config Secret; models keep two
replicas (one serves while a node drains); no hub downloads."""


@dataclass(frozen=True)
class Key:
    """One row of the reference: a key a stack file may set."""

    path: str
    type: str
    default: str
    constraints: str
    description: str


@dataclass(frozen=True)
class Section:
    """One table of the reference: the keys of one model, under the path it is written at."""

    path: str
    doc: str
    keys: tuple[Key, ...]


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds, and the path suffix it is written with (`[]` for a list of them)."""
    inner = _strip(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner, ""
    if get_origin(inner) is list:
        (item,) = get_args(inner)
        item = _strip(item)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, "[]"
    return None, ""


def _strip(annotation: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` as X."""
    if get_origin(annotation) is Annotated:
        return _strip(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


_SCALARS: Mapping[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    IPv4Network: "IPv4 CIDR",
    type(None): "null",
}


def type_text(annotation: Any) -> str:
    """A field's type in the stack file's terms: `integer`, `list of string`, `` `a` or `b` ``."""
    annotation = _strip(annotation)
    origin = get_origin(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if origin is Literal:
        values = [f"`{v}`" for v in get_args(annotation)]
        return values[0] if len(values) == 1 else ", ".join(values[:-1]) + f" or {values[-1]}"
    if origin is list:
        return f"list of {type_text(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {type_text(key)} to {type_text(value)}"
    if origin in (Union, types.UnionType):
        parts = [type_text(a) for a in get_args(annotation) if a is not type(None)]
        return ", ".join(parts[:-1]) + f" or {parts[-1]}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _yaml_text(value: Any) -> str:
    """A default as it would be written in the stack file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    if isinstance(value, (int, float)):
        return f"`{value}`"
    if isinstance(value, IPv4Network):
        return f"`{value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    flow = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return f"`{flow}`"


def default_text(field: FieldInfo) -> str:
    """The default of a field, or `required`."""
    if field.is_required():
        return "required"
    return _yaml_text(field.get_default(call_default_factory=True, validated_data={}))


def constraints_text(field: FieldInfo) -> str:
    """The bounds pydantic checks on a field (numbers, lengths, patterns), in words."""
    container = get_origin(_strip(field.annotation)) in (list, dict)
    out: list[str] = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Gt):
            out.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Ge):
            out.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Lt):
            out.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.Le):
            out.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.MultipleOf):
            out.append(f"a multiple of {item.multiple_of}")
        elif isinstance(item, annotated_types.MinLen):
            out.append(_length("at least", item.min_length, container))
        elif isinstance(item, annotated_types.MaxLen):
            out.append(_length("at most", item.max_length, container))
        elif getattr(item, "pattern", None):
            out.append(f"matches `{item.pattern}`")
    return ", ".join(out)


def _length(bound: str, n: int, container: bool) -> str:
    if n == 1 and bound == "at least":
        return "not empty"
    unit = "item" if container else "character"
    return f"{bound} {n} {unit}{'' if n == 1 else 's'}"


def _doc(model: type[BaseModel]) -> str:
    """A model's own docstring (never pydantic's BaseModel's), as Markdown."""
    for cls in model.__mro__:
        if cls is BaseModel:
            return ""
        doc = cls.__dict__.get("__doc__")
        if doc:
            return _markdown(inspect.cleandoc(doc))
    return ""


def _markdown(text: str) -> str:
    # The catalogue's docstrings are reStructuredText: ``x`` is `x` here.
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _join(*parts: str) -> str:
    """Sentences from several sources as one text, each ending in a full stop."""
    kept = [p.strip() for p in parts if p and p.strip()]
    if len(kept) < 2:
        return "".join(kept)
    return " ".join(p if p.endswith((".", "!", "?")) else f"{p}." for p in kept)


def _path(prefix: str, name: str) -> str:
    if not prefix and name in OTHER_NAMESPACE_KEYS:
        return OTHER_NAMESPACE_KEYS[name]
    return f"{prefix}.{name}" if prefix else name


def sections(model: type[BaseModel] = StackConfig, prefix: str = "", doc: str = "") -> Iterator[Section]:
    """Every table of the reference, depth first in declaration order: the model's own keys, then its sections."""
    keys: list[Key] = []
    nested: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        path = _path(prefix, name)
        inner, suffix = _model_of(field.annotation)
        if inner is not None:
            nested.append((path + suffix, inner, _section_status(field)))
            continue
        keys.append(
            Key(
                path=path,
                type=type_text(field.annotation),
                default=default_text(field),
                constraints=constraints_text(field),
                description=_join(_markdown(field.description or ""), NOTES.get(path, "")),
            )
        )
    yield Section(path=prefix, doc=doc, keys=tuple(keys))
    for path, inner, status in nested:
        # The model's docstring, then what the notes and the field add, as a paragraph of its own.
        extra = _join(NOTES.get(path, ""), status)
        yield from sections(inner, path, "\n\n".join(p for p in (_doc(inner), extra) if p))


def _section_status(field: FieldInfo) -> str:
    if field.is_required():
        return "Required."
    if field.get_default(call_default_factory=True, validated_data={}) is None:
        return "Optional: unset by default."
    return ""


def _table(keys: tuple[Key, ...]) -> list[str]:
    rows = ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    rows += [
        f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.constraints)} | {_cell(k.description)} |"
        for k in keys
    ]
    return rows


def _check_notes(all_sections: list[Section]) -> None:
    known = {s.path for s in all_sections} | {k.path for s in all_sections for k in s.keys}
    stale = sorted(set(NOTES) - known)
    if stale:
        raise ValueError(f"notes for keys the config model does not have: {', '.join(stale)}")


def render() -> str:
    """The whole page, as docs/configuration.md holds it."""
    all_sections = list(sections())
    _check_notes(all_sections)
    namespaces = ", ".join(f"`{ns}`" for ns in CONFIG_NAMESPACES)
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config model by `make config-docs` (python -m infra.config_reference);",
        "     tests/test_config_reference.py fails when this page is stale. Edit the models in infra/config/",
        "     or the notes in infra/config_reference.py, not this page. -->",
        "",
        f"All keys live under the `{NAMESPACE}:` namespace in `Pulumi.<stack>.yaml`",
        f"(plus `{OTHER_NAMESPACE_KEYS['region']}`). A dotted key is one YAML mapping per part:",
        f"`serving.limits.max_tokens` is `max_tokens` under `limits:` under `{NAMESPACE}:serving:`,",
        "and `[]` marks a list of entries:",
        "",
        "```yaml",
        "config:",
        f"  {OTHER_NAMESPACE_KEYS['region']}: us-west-2",
        f"  {NAMESPACE}:serving:",
        "    limits:",
        "      max_tokens: 2048",
        f"  {NAMESPACE}:models:",
        "    - name: llama-31-8b",
        "      autoscaling:",
        "        min_replicas: 0",
        "```",
        "",
        "Unknown keys are errors, and so are a key repeated in the file (YAML would",
        f"keep only the last) and a namespace nothing reads (only {namespaces} are).",
        "A bad value stops the preview with one `config error:` line per problem,",
        "naming the key path (`models[0].tensor_parallel_size`) and the rule.",
        "",
    ]
    for section in all_sections:
        title = f"`{section.path}`" if section.path else "Top-level keys"
        lines += [f"## {title}", ""]
        if section.doc:
            lines += [section.doc, ""]
        if section.keys:
            lines += [*_table(section.keys), ""]
    lines += [
        "## Secrets",
        "",
        f"`{SECRET_API_KEYS}` is not part of the model above: it is a Pulumi secret, read on its own. Comma-separated",
        f"API keys, each `<id>:<key>` (a key of at least {API_KEY_MIN_LENGTH} characters; without `<id>:` its id is",
        "`key-` and 12 hex digits of its SHA-256), set with",
        f"`pulumi config set --secret {NAMESPACE}:{SECRET_API_KEYS} ...` (`make up` sets one for a new stack; see",
        "[Per-key limits and attribution](security.md#per-key-limits-and-attribution)).",
        "",
        "## Rules across fields",
        "",
        CROSS_FIELD_RULES,
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """Print the page (`make config-docs` writes it to docs/configuration.md)."""
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
