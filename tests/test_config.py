"""Config model: every cross-field rule fails with its message, and the CLI exits 2."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import ConfigError, StackConfig, parse
from tests.harness import render_cli, stack_sections

NS = "llm-platform:"


def raw_config(stack: str) -> dict[str, Any]:
    """The sections of a committed stack, as `load()` hands them to `parse()`."""
    return stack_sections(stack)


def problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return [str(p) for p in info.value.problems]


def broken(stack: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    raw = copy.deepcopy(raw_config(stack))
    change(raw)
    return raw


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_committed_stacks_are_valid(stack: str) -> None:
    cfg = parse(raw_config(stack))
    assert isinstance(cfg, StackConfig)
    assert cfg.environment == stack


def test_dev_is_small_and_scales_to_zero() -> None:
    cfg = parse(raw_config("dev"))
    assert [g.capacity_type for g in cfg.node_groups.gpu] == ["spot"]
    assert cfg.node_groups.gpu[0].min_size == 0
    assert len(cfg.models) == 1 and cfg.models[0].autoscaling.min_replicas == 0
    assert 7 <= cfg.models[0].parameters_billion <= 9


def test_prod_is_multi_zone_on_demand_with_a_multi_gpu_model() -> None:
    cfg = parse(raw_config("prod"))
    assert len(cfg.network.zones) == 3
    assert {g.capacity_type for g in cfg.node_groups.gpu} == {"on_demand"}
    sizes = sorted(m.parameters_billion for m in cfg.models)
    assert len(sizes) == 2 and sizes[1] > 5 * sizes[0]
    assert max(m.tensor_parallel_size * m.pipeline_parallel_size for m in cfg.models) > 1
    assert cfg.ray.gcs_fault_tolerance.enabled


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change that sets one key path like `models.0.tensor_parallel_size`."""

    def change(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def _both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """Several changes, in order."""

    def change(raw: dict[str, Any]) -> None:
        for one in changes:
            one(raw)

    return change


CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    (
        "unknown GPU group",
        "dev",
        _set("models.0.gpu_group", "a100"),
        "config error: models[0].gpu_group: 'a100' is not a GPU node group (have: l4-spot)",
    ),
    (
        "tensor parallel larger than a node",
        "dev",
        _set("models.0.tensor_parallel_size", 3),
        "config error: models[0].tensor_parallel_size: 3 GPUs do not fit g6.2xlarge (1 GPU)",
    ),
    (
        "pipeline stages that do not fill nodes",
        "prod",
        lambda raw: raw["models"][1].update(tensor_parallel_size=2, pipeline_parallel_size=3),
        "config error: models[1].pipeline_parallel_size: 3 stages of 2 GPUs span nodes of g6e.12xlarge (4 GPUs) "
        "but do not fill them: each pipeline stage must use a whole node (tensor_parallel_size 4)",
    ),
    (
        "weights larger than the GPUs",
        "dev",
        _set("models.0.parameters_billion", 13),
        "config error: models[0]: weights of 24.2 GiB do not fit 1 x L4 22.0 GiB (what CUDA reports of its 24 GB) "
        "x gpu_memory_utilization 0.9 = 19.8 GiB with 10% left for the KV cache",
    ),
    (
        "node group min above desired",
        "dev",
        lambda raw: raw["node_groups"]["gpu"][0].update(min_size=2, desired_size=1),
        "config error: node_groups.gpu[0]: min_size <= desired_size <= max_size does not hold (2, 1, 2)",
    ),
    (
        "replicas min above max",
        "dev",
        lambda raw: raw["models"][0]["autoscaling"].update(min_replicas=3, max_replicas=2),
        "config error: models[0].autoscaling: min_replicas (3) must not exceed max_replicas (2)",
    ),
    (
        "invalid Kubernetes name",
        "dev",
        _set("models.0.name", "Llama_8B"),
        "config error: models[0].name: 'Llama_8B' is not a valid Kubernetes name (lowercase letters, digits "
        "and '-', starting and ending alphanumeric, at most 63 characters)",
    ),
    (
        "RayService name too long",
        "dev",
        _set("models.0.name", "a" * 48),
        "config error: models[0].name: RayService name '" + "a" * 48 + "' has 48 characters (at most 47)",
    ),
    (
        "prod public endpoint without allow-list",
        "prod",
        _set("endpoint.allowed_cidrs", []),
        "config error: endpoint.allowed_cidrs: prod may not use an internet-facing endpoint without an allow-list",
    ),
    (
        "public endpoint without TLS",
        "prod",
        _set("endpoint.certificate_arn", None),
        "config error: endpoint.certificate_arn: an internet-facing endpoint needs a TLS certificate "
        "(API keys must not cross the internet in clear)",
    ),
    (
        "unknown key",
        "dev",
        lambda raw: raw["models"][0].update(tensor_paralel_size=2),
        "config error: models[0].tensor_paralel_size: unknown key",
    ),
    (
        "unknown section",
        "dev",
        _set("nodegroups", {}),
        "config error: nodegroups: unknown key",
    ),
    (
        "weights outside the model bucket",
        "dev",
        _set("models.0.source", "s3://someone-elses-bucket/llama"),
        "config error: models[0].source: S3 weights must live in the model bucket s3://acme-llm-weights-dev/ "
        "(the pods may read only that bucket)",
    ),
    (
        "hub download in prod",
        "prod",
        _set("models.0.source", "meta-llama/Llama-3.1-8B-Instruct"),
        "config error: models[0].source: a hub download at start is not allowed in prod",
    ),
    (
        "zone outside the region",
        "dev",
        _set("network.zones.1", "eu-west-1a"),
        "config error: network.zones[1]: 'eu-west-1a' is not a zone of region us-west-2",
    ),
    (
        "version range",
        "dev",
        _set("versions", {"keda": "^2.20"}),
        "config error: versions.keda: '^2.20' is not an exact version (no ranges or wildcards)",
    ),
    (
        "existing cluster without a context",
        "dev",
        _set("cluster.mode", "existing"),
        "config error: cluster.kubeconfig_context: required when cluster.mode is existing",
    ),
    (
        "platform part off on a cluster this program makes",
        "dev",
        _set("platform", {"keda": {"enabled": False}}),
        "config error: platform.keda.enabled: may be off only with cluster.mode existing",
    ),
    (
        "prod model below two replicas",
        "prod",
        lambda raw: raw["models"][0]["autoscaling"].update(min_replicas=0),
        "config error: models[0].autoscaling.min_replicas: prod models keep at least 2 replicas, so one serves "
        "while a node drains ('llama-31-8b' has 0)",
    ),
    (
        "min replicas beyond the node group",
        "prod",
        lambda raw: raw["models"][1]["autoscaling"].update(min_replicas=7, max_replicas=7),
        "config error: models[1].autoscaling.min_replicas: 7 replicas need 7 g6e.12xlarge nodes "
        "but node group 'l40s-4x' has max_size 6",
    ),
    (
        "mixed GPU shapes in one group",
        "dev",
        _set("node_groups.gpu.0.instance_types", ["g6.2xlarge", "g6.12xlarge"]),
        "config error: node_groups.gpu[0].instance_types: all instance types of a group must have the same GPU "
        "model and GPU count (the autoscaler's node template and the pods' GPU limits assume one shape)",
    ),
    (
        "public API server in prod",
        "prod",
        lambda raw: raw["cluster"].update(endpoint_public_access=True, public_access_cidrs=["198.51.100.0/24"]),
        "config error: cluster.endpoint_public_access: prod keeps the API server endpoint private",
    ),
    (
        "prod alerts that page nobody",
        "prod",
        lambda raw: raw["observability"].pop("alertmanager_config_secret"),
        "config error: observability.alertmanager_config_secret: prod alerts must page: name the Secret that "
        "holds alertmanager.yaml",
    ),
    (
        "prod without GCS fault tolerance",
        "prod",
        _set("ray", {}),
        "config error: ray.gcs_fault_tolerance.enabled: prod needs GCS fault tolerance so a Ray head restart "
        "does not drop serving",
    ),
    (
        "pre-scale window on an unknown group",
        "prod",
        _set("autoscaling.prescale.0.gpu_group", "h100"),
        "config error: autoscaling.prescale[0].gpu_group: 'h100' is not a GPU node group",
    ),
    (
        "batch without a model",
        "dev",
        _set("batch", {"enabled": True}),
        "config error: batch.model: required when batch.enabled is true",
    ),
    (
        "batch model not served",
        "prod",
        _set("batch.model", "llama-3.1-70b-instruct"),
        "config error: batch.model: 'llama-3.1-70b-instruct' is not a configured model_id "
        "(have: llama-3.1-8b-instruct, llama-3.3-70b-instruct)",
    ),
    (
        "batch min workers above max",
        "prod",
        lambda raw: raw["batch"].update(min_workers=9, max_workers=8),
        "config error: batch.min_workers: 9 exceeds max_workers 8",
    ),
    (
        "batch without workers",
        "prod",
        _set("batch.max_workers", 0),
        "config error: batch.max_workers: Input should be greater than or equal to 1 (got 0)",
    ),
    (
        "batch visibility timeout beyond the SQS limit",
        "prod",
        _set("batch.visibility_timeout_seconds", 50000),
        "config error: batch.visibility_timeout_seconds: Input should be less than or equal to 43200 (got 50000)",
    ),
    (
        "accelerator type that disagrees with the group's GPU",
        "dev",
        _set("models.0.accelerator_type", "H100"),
        "config error: models[0].accelerator_type: 'H100' disagrees with GPU group 'l4-spot' (L4): "
        "leave it out, it is derived from the group",
    ),
    (
        "prod with one ingress replica",
        "prod",
        _both(_set("serving.layout", "serve-ingress"), _set("serving.ingress.min_replicas", 1)),
        "config error: serving.ingress.min_replicas: prod keeps at least 2 ingress replicas "
        "(one would be a single point of failure)",
    ),
    (
        "prod ingress replicas sharing a node",
        "prod",
        _both(_set("serving.layout", "serve-ingress"), _set("serving.ingress.max_replicas_per_node", 2)),
        "config error: serving.ingress.max_replicas_per_node: prod spreads ingress replicas one per node "
        "(more would share a node's fate)",
    ),
    (
        "vllm-server for a model that scales to zero, without the gateway",
        "dev",
        _both(_set("serving.layout", "vllm-server"), _set("serving.gateway.enabled", False)),
        "config error: serving.layout: vllm-server: model 'llama-31-8b' needs autoscaling.min_replicas >= 1, "
        "or serving.gateway and serving.routing enabled (only the gateway wakes a vllm-server model from zero); "
        "use auto or serve-ingress",
    ),
    (
        "vllm-server for a service of two models",
        "prod",
        _both(
            _set("serving.layout", "vllm-server"),
            _set("models.0.service", "shared"),
            _set("models.1.service", "shared"),
        ),
        "config error: serving.layout: vllm-server: it serves exactly one model per service "
        "(service 'shared' has 2); use auto or serve-ingress",
    ),
    (
        "a layout that does not exist",
        "dev",
        _set("serving.layout", "direct"),
        "config error: serving.layout: Input should be 'auto', 'vllm-server' or 'serve-ingress' (got \"direct\")",
    ),
    (
        "an ingress that scales to zero",
        "dev",
        lambda raw: raw.setdefault("serving", {}).update(ingress={"min_replicas": 0}),
        "config error: serving.ingress.min_replicas: Input should be greater than or equal to 1 (got 0)",
    ),
    (
        "batch target backlog of zero",
        "prod",
        _set("batch.messages_per_worker", 0),
        "config error: batch.messages_per_worker: Input should be greater than or equal to 1 (got 0)",
    ),
]


@pytest.mark.parametrize(("stack", "change", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_fails_with_its_message(stack: str, change: Callable[[dict[str, Any]], None], expected: str) -> None:
    assert problems(broken(stack, change)) == [expected]


def test_several_problems_give_one_line_each() -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["models"][0]["gpu_group"] = "nope"
        raw["node_groups"]["system"]["min_size"] = 9

    assert problems(broken("dev", change)) == [
        "config error: node_groups.system: min_size <= desired_size <= max_size does not hold (9, 2, 4)",
        "config error: models[0].gpu_group: 'nope' is not a GPU node group (have: l4-spot)",
    ]


def test_type_errors_name_the_value() -> None:
    assert problems(broken("dev", _set("models.0.max_model_len", "lots"))) == [
        "config error: models[0].max_model_len: Input should be a valid integer, unable to parse string as an "
        'integer (got "lots")'
    ]


# The command line: ten broken stack files, each one line per problem and exit 2.
CLI_CASES = [c for c in CASES if c[0] != "version range"][:10]


def _stack_file(tmp_path: Path, stack: str, raw: dict[str, Any]) -> Path:
    config: dict[str, Any] = {"aws:region": raw.pop("region")}
    config.update({NS + k: v for k, v in raw.items()})
    path = tmp_path / f"Pulumi.{stack}.yaml"
    path.write_text(yaml.safe_dump({"config": config}))
    return path


@pytest.mark.parametrize(("stack", "change", "expected"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_render_cli_exits_2_with_one_line(
    tmp_path: Path, stack: str, change: Callable[[dict[str, Any]], None], expected: str
) -> None:
    path = _stack_file(tmp_path, stack, broken(stack, change))
    result = render_cli("--stack", stack, "--config", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [expected]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


def test_api_keys_must_be_a_secret(tmp_path: Path) -> None:
    raw = raw_config("dev")
    path = _stack_file(tmp_path, "dev", raw)
    doc = yaml.safe_load(path.read_text())
    doc["config"][NS + "api_keys"] = "plain-text-key-that-is-long-enough-000"
    path.write_text(yaml.safe_dump(doc))
    result = render_cli("--stack", "dev", "--config", str(path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: api_keys: must be a secret: pulumi config set --secret llm-platform:api_keys ..."
    ]
    assert "plain-text-key" not in result.stdout + result.stderr


def test_missing_stack_file_is_a_config_error(tmp_path: Path) -> None:
    result = render_cli("--stack", "nope", "--config", str(tmp_path / "Pulumi.nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("no such stack config file")


def test_eks_needs_two_zones() -> None:
    assert problems(broken("dev", _set("network.zones", ["us-west-2a"]))) == [
        "config error: network.zones: EKS needs subnets in at least two zones"
    ]


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "Pulumi.bad.yaml"
    path.write_text("config:\n  llm-platform:models: [\n")
    result = render_cli("--stack", "bad", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"config error: {path}: not valid YAML line 3"]


def test_missing_region_names_the_key(tmp_path: Path) -> None:
    raw = raw_config("dev")
    path = _stack_file(tmp_path, "dev", raw)
    doc = yaml.safe_load(path.read_text())
    del doc["config"]["aws:region"]
    path.write_text(yaml.safe_dump(doc))
    result = render_cli("--stack", "dev", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "config error: aws:region: required: pulumi config set aws:region <region>"
