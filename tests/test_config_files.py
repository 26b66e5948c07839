"""Broken stack files are refused by the render command, one line each.

Each case takes a committed stack file, breaks it the way a person editing it
might, and runs `python -m infra.render --stack <s> --config <file>`: exit 2
and exactly one `config error: <key>: <rule>` line, nothing rendered.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import load_stack_file
from infra.render import ROOT
from tests.harness import render_cli

NS = "llm-platform:"
Edit = Callable[[str], str]


def _lines_of(text: str, needle: str) -> list[int]:
    return [i for i, line in enumerate(text.splitlines(), 1) if line.startswith(needle)]


def _config(change: Callable[[dict[str, Any]], None]) -> Edit:
    """An edit of the parsed `config:` mapping; the file is written back as YAML."""

    def edit(text: str) -> str:
        doc = yaml.safe_load(text)
        change(doc["config"])
        return yaml.safe_dump(doc, sort_keys=False)

    return edit


def _set(key: str, path: str, value: Any) -> Edit:
    """Sets `path` (dots, list indexes as numbers) inside config key `llm-platform:<key>`."""

    def change(config: dict[str, Any]) -> None:
        node: Any = config[NS + key]
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return _config(change)


def _append_endpoint(text: str) -> str:
    return text + f"  {NS}endpoint:\n    scheme: internal\n"


def _duplicate_line(text: str) -> str:
    first, second = _lines_of(text, f"  {NS}endpoint:")
    return (
        f"config error: {NS}endpoint: duplicate key (lines {first} and {second}): "
        "YAML would keep only the last, silently"
    )


# (id, stack, edit of the file's text, the one expected line (or how to work it out from the edited text))
CASES: list[tuple[str, str, Edit, str | Callable[[str], str]]] = [
    ("duplicate YAML key", "prod", _append_endpoint, _duplicate_line),
    (
        "misspelt config namespace",
        "prod",
        lambda text: text.replace(f"  {NS}endpoint:", "  llm-platfrom:endpoint:"),
        "config error: llm-platfrom:endpoint: unknown config namespace 'llm-platfrom' (did you mean "
        "'llm-platform'?): nothing reads it (the namespaces read are llm-platform, aws, docker-build, pulumi)",
    ),
    (
        "cron field out of range",
        "prod",
        _set("autoscaling", "prescale.0.start", "30 25 * * 1-5"),
        "config error: autoscaling.prescale[0].start: '30 25 * * 1-5': hour 25 is outside 0-23",
    ),
    (
        "misspelt timezone",
        "prod",
        _set("autoscaling", "prescale.0.timezone", "America/New_Yrok"),
        "config error: autoscaling.prescale[0].timezone: 'America/New_Yrok' is not an IANA time zone "
        "(did you mean 'America/New_York'?)",
    ),
    (
        "garbage Kubernetes quantity",
        "dev",
        _set("ray", "head_memory", "8 gigs"),
        "config error: ray.head_memory: '8 gigs' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)",
    ),
    (
        "negative CPU",
        "dev",
        _set("ray", "head_cpu", "-2"),
        "config error: ray.head_cpu: '-2' is not a positive Kubernetes quantity (such as 2, 500m, 8Gi or 512Mi)",
    ),
    (
        "garbage ARN",
        "prod",
        _set("endpoint", "certificate_arn", "arn:aws:acm:us-east-1:12345:cert"),
        "config error: endpoint.certificate_arn: 'arn:aws:acm:us-east-1:12345:cert' is not an ARN "
        "(arn:aws:acm:us-east-1:<account>:certificate/<id>)",
    ),
    (
        "nonsense ElastiCache node type",
        "prod",
        _set("ray", "gcs_fault_tolerance.node_type", "cache.r7g.huge"),
        "config error: ray.gcs_fault_tolerance.node_type: 'cache.r7g.huge' is not an ElastiCache node type this "
        "Redis runs on: cache.<family>.<size> with a family of t3, t4g, m5, m6g, m7g, r5, r6g, r7g, c7gn "
        "(micro, small or medium for t*, large or <n>xlarge otherwise)",
    ),
    (
        "VPC too small for its subnets",
        "prod",
        _set("network", "vpc_cidr", "10.50.0.0/18"),
        "config error: network.vpc_cidr: 10.50.0.0/18 is too small for 3 zones: each zone gets a /20 (4096 "
        "addresses) but needs a /19 private and a /24 public subnet (8448 addresses); use a /16 or larger",
    ),
    (
        "max_prompt_tokens above max_model_len",
        "prod",
        _set("serving", "limits.max_prompt_tokens", 20000),
        "config error: serving.limits.max_prompt_tokens: 20000 is not below the max_model_len of "
        "'llama-31-8b' (16384), 'llama-33-70b' (16384): a prompt the server accepts would leave the model "
        "no room to answer",
    ),
    (
        "a request's prompts together above max_model_len",
        "prod",
        _set("serving", "limits.max_request_prompt_tokens", 40000),
        "config error: serving.limits.max_request_prompt_tokens: 40000 exceeds the max_model_len of "
        "'llama-31-8b' (16384), 'llama-33-70b' (16384): one request's prompts together would cost more prefill "
        "than a single prompt at the model's full context",
    ),
    (
        "a request's prompts together below one prompt",
        "prod",
        _set("serving", "limits.max_request_prompt_tokens", 4096),
        "config error: serving.limits: max_request_prompt_tokens (4096) must be at least max_prompt_tokens "
        "(12288): a single prompt at the limit would be refused",
    ),
    (
        "max_logprobs above the OpenAI ceiling",
        "dev",
        _set("serving", "limits.max_logprobs", 21),
        "config error: serving.limits.max_logprobs: Input should be less than or equal to 20 (got 21)",
    ),
    (
        "no prompts per request",
        "dev",
        _set("serving", "limits.max_prompts", 0),
        "config error: serving.limits.max_prompts: Input should be greater than or equal to 1 (got 0)",
    ),
    (
        "max_logprobs set twice",
        "prod",
        lambda text: text.replace(
            "enable_prefix_caching: true", "enable_prefix_caching: true\n        max_logprobs: 20"
        ),
        "config error: models[1].engine_overrides: engine_overrides must not set ['max_logprobs']: "
        "use the catalogue fields instead",
    ),
    (
        "tensor parallel 3",
        "prod",
        _set("models", "1.tensor_parallel_size", 3),
        "config error: models[1].tensor_parallel_size: 3 does not divide the 4 GPUs of g6e.12xlarge: use 1, 2 "
        "or 4 (vLLM splits the attention heads over the TP ranks, and the models' head counts are powers of "
        "two; a TP group that does not divide a node also strands its other GPUs)",
    ),
    (
        "bigger instance type first",
        "dev",
        _set("node_groups", "gpu.0.instance_types", ["g6.4xlarge", "g6.2xlarge"]),
        "config error: node_groups.gpu[0].instance_types: list the instance types of group 'l4-spot' smallest "
        "first (g6.2xlarge, g6.4xlarge): cluster-autoscaler and EKS take the first, g6.4xlarge (16 vCPUs, "
        "64 GiB), as the node template and the pods are sized from it, so they would never fit a g6.2xlarge "
        "(8 vCPUs, 32 GiB)",
    ),
    (
        "batch visibility timeout below the request timeout",
        "prod",
        _set("batch", "visibility_timeout_seconds", 300),
        "config error: batch.visibility_timeout_seconds: 300 s leaves a worker a request timeout of 270 s "
        "(30 s go to storing the answer), below the longest generation the limits allow: 1.5 s to the first "
        "token + 4096 tokens x 0.1 s (the SLO p95s) = 412 s; such requests would time out on every receive "
        "and end in the dead-letter queue: set at least 442",
    ),
    (
        "misspelt vLLM engine argument",
        "prod",
        lambda text: text.replace("enable_prefix_caching: true", "enable_prefix_cacheing: true"),
        "config error: models[1].engine_overrides.enable_prefix_cacheing: not an engine argument of vLLM 0.29.0 "
        "(did you mean 'enable_prefix_caching'?): Ray Serve LLM would refuse it when the replica starts",
    ),
    (
        "prod model with one replica",
        "prod",
        _set("models", "1.autoscaling.min_replicas", 1),
        "config error: models[1].autoscaling.min_replicas: prod models keep at least 2 replicas, so one serves "
        "while a node drains ('llama-33-70b' has 1)",
    ),
    (
        "no GPU headroom for a NewCluster upgrade at peak",
        "prod",
        _set("node_groups", "gpu.1.max_size", 5),
        "config error: node_groups.gpu[1].max_size: 5 leaves group 'l40s-4x' no room for a NewCluster upgrade at "
        "peak (ray.upgrade_headroom: peak): the old cluster at max_replicas and the new one at its starting replicas "
        "(initial_replicas, else min_replicas) need 'llama-33-70b' (4 + 2) x 4 = 24 GPUs = 6 g6e.12xlarge nodes; "
        "raise max_size to 6, or set ray.upgrade_headroom: min and accept that an upgrade started at peak waits "
        "for the old cluster to scale down",
    ),
]


@pytest.mark.parametrize(("stack", "edit", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_stack_file_is_refused_with_one_line(
    tmp_path: Path, stack: str, edit: Edit, expected: str | Callable[[str], str]
) -> None:
    text = edit((ROOT / f"Pulumi.{stack}.yaml").read_text())
    path = tmp_path / f"Pulumi.{stack}.yaml"
    path.write_text(text)
    result = render_cli("--stack", stack, "--config", str(path), "--out", str(tmp_path / "out"))
    line = expected(text) if callable(expected) else expected
    assert (result.returncode, result.stderr.splitlines()) == (2, [line])
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stack", sorted({c[1] for c in CASES}))
def test_the_edits_are_the_only_fault(stack: str) -> None:
    """The committed files pass every rule, so each case fails for its edit alone."""
    load_stack_file(ROOT / f"Pulumi.{stack}.yaml")
