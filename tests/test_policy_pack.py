"""The policy pack as the engine runs it: the wrappers in policy/rules.py and the pack in policy/__main__.py.

`PolicyPack(...)` serves the engine's analyzer protocol and blocks, so the
pack is started here the way the Pulumi CLI starts it (`python -m
pulumi.policy <engine> policy/`, in a child process) and asked over gRPC.
Needs pulumi-policy in the test environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pulumi_policy = pytest.importorskip("pulumi_policy", reason="pulumi-policy is not installed (policy/requirements.txt)")

import grpc  # noqa: E402
from google.protobuf import empty_pb2, json_format, struct_pb2  # noqa: E402
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc, plugin_pb2  # noqa: E402
from pulumi_policy import (  # noqa: E402
    EnforcementLevel,
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError, unknown_checking_proxy  # noqa: E402

from policy import rules  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "cd" * 32
URN = "urn:pulumi:dev::llm-platform::kubernetes:ray.io/v1:RayService::llama"


def ray_service(tolerate: bool = True, image: str = f"repo/serving@{DIGEST}") -> dict[str, Any]:
    """A RayService whose one worker group asks for a GPU."""
    worker: dict[str, Any] = {
        "containers": [{"name": "ray-worker", "image": image, "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    }
    if tolerate:
        worker["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        ]
    head = {"containers": [{"name": "ray-head", "image": f"repo/serving@{DIGEST}"}]}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "llama", "namespace": "llm"},
        "spec": {
            "rayClusterConfig": {
                "headGroupSpec": {"template": {"spec": head}},
                "workerGroupSpecs": [{"groupName": "gpu", "template": {"spec": worker}}],
            }
        },
    }


def options(protect: bool = False) -> PolicyResourceOptions:
    return PolicyResourceOptions(protect, [], None, [], PolicyCustomTimeouts(0, 0, 0), [])


def by_name() -> dict[str, Any]:
    return {p.name: p for p in rules.policies()}


def validate(name: str, type_token: str, props: dict[str, Any], config: dict[str, Any] | None = None) -> list[str]:
    """Run one resource policy the way the analyzer does: props behind the unknown-checking proxy."""
    policy = by_name()[name]
    assert isinstance(policy, ResourceValidationPolicy)
    args = ResourceValidationArgs(
        type_token, unknown_checking_proxy(props), URN, "llama", options(), None, config or {}, {}
    )
    return collect(policy, args)


def collect(policy: Any, args: Any) -> list[str]:
    """The messages a policy reports for `args`."""
    reported: list[str] = []
    policy.validate(args, lambda message, urn=None: reported.append(message))
    return reported


# --- the wrappers ----------------------------------------------------------------------------


def test_every_rule_is_a_mandatory_policy() -> None:
    policies = rules.policies()
    assert [p.name for p in policies] == [r.name for r in rules.RULES]
    assert {p.enforcement_level for p in policies} == {EnforcementLevel.MANDATORY}
    kinds = {p.name: type(p) for p in policies}
    assert kinds[rules.BUCKET_STACK_RULE.name] is StackValidationPolicy
    assert kinds[rules.GPU_RULE.name] is ResourceValidationPolicy
    lb = by_name()[rules.LB_RULE.name]
    assert lb.config_schema.properties["allowInternetFacing"] == {"type": "boolean", "default": False}


def test_resource_policy_reports_the_rules_message() -> None:
    reported = validate(rules.GPU_RULE.name, "kubernetes:ray.io/v1:RayService", ray_service(tolerate=False))
    assert len(reported) == 1
    assert reported[0].startswith("RayService 'llm/llama': spec.rayClusterConfig.workerGroupSpecs[0].template.spec")
    assert "does not tolerate the GPU taint nvidia.com/gpu=true:NoSchedule" in reported[0]
    assert validate(rules.GPU_RULE.name, "kubernetes:ray.io/v1:RayService", ray_service()) == []


def test_policy_config_reaches_the_check() -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "api",
            "namespace": "llm",
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing"},
        },
        "spec": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["198.51.100.0/24"]},
    }
    refused = validate(rules.LB_RULE.name, "kubernetes:core/v1:Service", service)
    assert refused and "(allowInternetFacing is false)" in refused[0]
    allowed = validate(rules.LB_RULE.name, "kubernetes:core/v1:Service", service, {"allowInternetFacing": True})
    assert allowed == []


def test_a_value_unknown_during_preview_is_not_a_violation() -> None:
    # The image digest is unknown until the push; the engine reports the
    # policy as not run for the preview instead of a false violation.
    props = ray_service(image=UNKNOWN_STRING_VALUE)
    with pytest.raises(UnknownValueError):
        validate(rules.IMAGE_RULE.name, "kubernetes:ray.io/v1:RayService", props)


def test_protect_comes_from_the_resource_options() -> None:
    policy = by_name()[rules.STATEFUL_RULE.name]
    for protect, expected in ((False, 1), (True, 0)):
        args = ResourceValidationArgs(
            rules.ECR_REPOSITORY,
            unknown_checking_proxy({"name": "llm-serving"}),
            URN,
            "serving-image",
            options(protect),
            None,
            {},
            {},
        )
        assert len(collect(policy, args)) == expected


def test_stack_policy_reports_the_unguarded_bucket() -> None:
    def resource(type_token: str, name: str, deps: list[PolicyResource]) -> PolicyResource:
        urn = f"urn:pulumi:dev::llm-platform::{type_token}::{name}"
        return PolicyResource(type_token, {}, urn, name, options(True), None, None, deps, {})

    guarded = resource(rules.BUCKET_TYPES[0], "weights", [])
    bare = resource(rules.BUCKET_TYPES[0], "logs", [])
    resources = [
        guarded,
        bare,
        resource(rules.PUBLIC_ACCESS_BLOCK, "weights", [guarded]),
        resource(rules.ENCRYPTION_TYPES[0], "weights", [guarded]),
    ]
    policy = by_name()[rules.BUCKET_STACK_RULE.name]
    reported: list[tuple[str, str | None]] = []
    policy.validate(StackValidationArgs(resources, {}, {}), lambda m, urn=None: reported.append((m, urn)))
    assert [urn for _, urn in reported] == [bare.urn]
    assert reported[0][0].startswith("Bucket 'logs' lacks an aws.s3.BucketPublicAccessBlock")


# --- the pack, served as the CLI serves it ---------------------------------------------------


def pack_python() -> str:
    """The pack's own environment when it exists (as the CLI uses it), else this one."""
    own = ROOT / "policy" / "venv" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


@pytest.fixture(scope="module")
def analyzer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[analyzer_pb2_grpc.AnalyzerStub]:
    log = tmp_path_factory.mktemp("pack") / "stderr.log"
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [pack_python(), "-u", "-m", "pulumi.policy", "127.0.0.1:0", str(ROOT / "policy")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port.isdigit():
            server.kill()
            server.wait(timeout=30)
            pytest.fail(f"the policy pack did not start: {port}\n{log.read_text()[-4000:]}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            yield analyzer_pb2_grpc.AnalyzerStub(channel)
    finally:
        server.terminate()
        server.wait(timeout=30)


def struct(value: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    json_format.ParseDict(value, out)
    return out


def test_the_pack_serves_every_rule_as_mandatory(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty())
    assert info.name == "llm-platform-guardrails"
    assert [p.name for p in info.policies] == [r.name for r in rules.RULES]
    assert {p.enforcementLevel for p in info.policies} == {analyzer_pb2.MANDATORY}
    assert isinstance(analyzer.GetPluginInfo(empty_pb2.Empty()), plugin_pb2.PluginInfo)


def test_the_pack_refuses_a_gpu_pod_without_toleration(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    request = analyzer_pb2.AnalyzeRequest(
        type="kubernetes:ray.io/v1:RayService",
        properties=struct(ray_service(tolerate=False, image="rayproject/ray-llm:2.60.0")),
        urn=URN,
        name="llama",
        options=analyzer_pb2.AnalyzerResourceOptions(protect=False),
    )
    diagnostics = analyzer.Analyze(request).diagnostics
    found = {(d.policyName, d.enforcementLevel) for d in diagnostics}
    assert found == {
        (rules.GPU_RULE.name, analyzer_pb2.MANDATORY),
        (rules.IMAGE_RULE.name, analyzer_pb2.MANDATORY),
    }
    messages = " ".join(d.message for d in diagnostics)
    assert "does not tolerate the GPU taint" in messages
    assert "image 'rayproject/ray-llm:2.60.0' is not pinned by digest" in messages


def test_the_pack_reads_the_stacks_policy_config(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "api",
            "namespace": "llm",
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing"},
        },
        "spec": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["198.51.100.0/24"]},
    }
    request = analyzer_pb2.AnalyzeRequest(
        type="kubernetes:core/v1:Service",
        properties=struct(service),
        urn="urn:pulumi:prod::llm-platform::kubernetes:core/v1:Service::api",
        name="api",
        options=analyzer_pb2.AnalyzerResourceOptions(protect=False),
    )
    refused = analyzer.Analyze(request).diagnostics
    assert [d.policyName for d in refused] == [rules.LB_RULE.name]
    assert "(allowInternetFacing is false)" in refused[0].message

    # What `--policy-pack-config policy/config/prod.json` sends the pack.
    prod = json.loads((ROOT / "policy" / "config" / "prod.json").read_text())
    analyzer.Configure(
        analyzer_pb2.ConfigureAnalyzerRequest(
            policyConfig={
                name: analyzer_pb2.PolicyConfig(enforcementLevel=analyzer_pb2.MANDATORY, properties=struct(props))
                for name, props in prod.items()
            }
        )
    )
    assert list(analyzer.Analyze(request).diagnostics) == []
