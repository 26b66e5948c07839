"""The policy pack's rules: both rendered stacks pass every rule, and each broken variant fails with its message.

The rules are called directly (policy/rules.py); the pack itself serves the
engine and blocks, so it is exercised in test_policy_pack.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from infra.scheduling import GPU_TAINT
from policy import rules
from policy.rules import Resource
from tests.harness import STACKS, render_stack
from tests.harness import stack_config as load_stack_config

POLICY_CONFIG = Path(__file__).resolve().parent.parent / "policy" / "config"
DIGEST = "sha256:" + "ab" * 32


def _resource(raw: Mapping[str, Any]) -> Resource:
    return Resource(
        type=raw["type"],
        name=raw["name"],
        props=raw["inputs"],
        protect=raw["protect"],
        ref=raw["name"],
        depends_on=tuple(raw["depends_on"]),
    )


@cache
def _rendered(stack: str) -> tuple[Resource, ...]:
    return tuple(_resource(r) for r in render_stack(stack).resources)


def rendered(stack: str) -> list[Resource]:
    """A deep copy of a stack's rendered resources, free to break."""
    return copy.deepcopy(list(_rendered(stack)))


def stack_config(stack: str) -> dict[str, Any]:
    """The stack's policy config document (what the workflows pass with --policy-pack-config)."""
    doc: dict[str, Any] = json.loads((POLICY_CONFIG / f"{stack}.json").read_text())
    return doc


def settings(rule: rules.Rule, stack: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A rule's effective config: its defaults, the stack's policy config, then overrides."""
    given = stack_config(stack).get(rule.name, {}) if stack else {}
    return {**rule.defaults(), **given, **overrides}


def one(resources: list[Resource], type_token: str, name: str | None = None) -> Resource:
    found = [r for r in resources if r.type == type_token and (name is None or r.name == name)]
    assert found, f"no {type_token} {name or ''} in the render"
    return found[0]


def with_props(resource: Resource, props: Mapping[str, Any], **changes: Any) -> Resource:
    return Resource(
        type=changes.get("type", resource.type),
        name=resource.name,
        props=props,
        protect=changes.get("protect", resource.protect),
        ref=resource.ref,
        depends_on=resource.depends_on,
    )


def manifest(type_token: str, kind: str, name: str, spec: dict[str, Any], **meta: Any) -> Resource:
    """A hand-made Kubernetes resource in the render's shape."""
    metadata = {"name": name, "namespace": "llm", **meta}
    api = type_token.split(":")[1]
    return Resource(
        type=type_token,
        name=name,
        props={"apiVersion": api, "kind": kind, "metadata": metadata, "spec": spec},
    )


def gpu_worker(ray_service: Resource) -> dict[str, Any]:
    """The first worker group that asks for GPUs (a mutable part of the resource's props)."""
    for group in ray_service.props["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        if "nvidia.com/gpu" in container["resources"].get("limits", {}):
            return dict(group)
    raise AssertionError(f"{ray_service.name} has no GPU worker group")


# --- the rendered stacks pass ----------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_rendered_stack_passes_every_rule(stack: str) -> None:
    assert rules.evaluate(rendered(stack), stack_config(stack)) == []


@pytest.mark.parametrize("stack", STACKS)
def test_render_has_what_the_rules_check(stack: str) -> None:
    # Guards against a rule passing only because it never saw its resources.
    resources = rendered(stack)
    ray_services = [r for r in resources if r.type == "kubernetes:ray.io/v1:RayService"]
    assert ray_services
    specs = [path for r in ray_services for path, _ in rules.pod_specs(r)]
    assert "spec.rayClusterConfig.headGroupSpec.template.spec" in specs
    assert any(path.startswith("spec.rayClusterConfig.workerGroupSpecs[") for path in specs)
    types = {r.type for r in resources}
    assert {
        rules.PUBLIC_ACCESS_BLOCK,
        rules.ENCRYPTION_TYPES[0],
        rules.BUCKET_TYPES[0],
        rules.LAUNCH_TEMPLATE,
        rules.EKS_NODE_GROUP,
        rules.ECR_REPOSITORY,
        rules.HELM_TYPES[0],
    } <= types


def test_gpu_rule_defaults_are_the_programs_gpu_taint() -> None:
    defaults = rules.GPU_RULE.defaults()
    assert (defaults["gpuTaintKey"], defaults["gpuTaintValue"], defaults["gpuTaintEffect"]) == (
        GPU_TAINT.key,
        GPU_TAINT.value,
        GPU_TAINT.effect,
    )


def test_every_rule_is_in_the_pack_once() -> None:
    names = [r.name for r in rules.RULES]
    assert len(names) == len(set(names))
    assert all((r.check is None) != (r.stack_check is None) for r in rules.RULES)


# --- GPU pods --------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_gpu_worker_without_toleration_fails(stack: str) -> None:
    ray_service = one(rendered(stack), "kubernetes:ray.io/v1:RayService")
    worker = gpu_worker(ray_service)
    worker["template"]["spec"].pop("tolerations")
    messages = rules.check_gpu_pods(ray_service, settings(rules.GPU_RULE))
    assert len(messages) == 1
    assert "does not tolerate the GPU taint nvidia.com/gpu=true:NoSchedule" in messages[0]
    assert f"RayService 'llm/{ray_service.props['metadata']['name']}'" in messages[0]
    assert "workerGroupSpecs[" in messages[0]


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, True),
        ({"key": "nvidia.com/gpu", "operator": "Exists"}, True),
        ({"operator": "Exists"}, True),
        ({"key": "nvidia.com/gpu", "value": "true"}, True),
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "false", "effect": "NoSchedule"}, False),
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, False),
        ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}, False),
    ],
)
def test_gpu_toleration_matching_follows_kubernetes(toleration: dict[str, str], tolerated: bool) -> None:
    ray_service = one(rendered("dev"), "kubernetes:ray.io/v1:RayService")
    gpu_worker(ray_service)["template"]["spec"]["tolerations"] = [toleration]
    messages = rules.check_gpu_pods(ray_service, settings(rules.GPU_RULE))
    assert (messages == []) is tolerated, messages


def test_gpu_request_without_limit_fails() -> None:
    ray_service = one(rendered("dev"), "kubernetes:ray.io/v1:RayService")
    resources = gpu_worker(ray_service)["template"]["spec"]["containers"][0]["resources"]
    resources["limits"].pop("nvidia.com/gpu")
    messages = rules.check_gpu_pods(ray_service, settings(rules.GPU_RULE))
    assert len(messages) == 1
    assert "requests nvidia.com/gpu without a limit" in messages[0]
    assert "resources.limits['nvidia.com/gpu']" in messages[0]


def test_gpu_request_different_from_limit_fails() -> None:
    ray_service = one(rendered("dev"), "kubernetes:ray.io/v1:RayService")
    resources = gpu_worker(ray_service)["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["nvidia.com/gpu"] = "2"
    resources["limits"]["nvidia.com/gpu"] = "1"
    messages = rules.check_gpu_pods(ray_service, settings(rules.GPU_RULE))
    assert messages and "requests 2 nvidia.com/gpu but limits 1" in messages[0]


def test_gpu_deployment_without_toleration_fails_and_cpu_pods_are_left_alone() -> None:
    container = {"name": "batch", "image": f"repo@{DIGEST}", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    spec = {"template": {"spec": {"containers": [container]}}}
    gpu = manifest("kubernetes:apps/v1:Deployment", "Deployment", "batch", spec)
    messages = rules.check_gpu_pods(gpu, settings(rules.GPU_RULE))
    assert len(messages) == 1
    assert messages[0].startswith("Deployment 'llm/batch': spec.template.spec requests nvidia.com/gpu")
    cpu = copy.deepcopy(spec)
    cpu["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    assert (
        rules.check_gpu_pods(
            manifest("kubernetes:apps/v1:Deployment", "Deployment", "cpu", cpu), settings(rules.GPU_RULE)
        )
        == []
    )


def test_gpu_rule_reads_the_taint_from_its_config() -> None:
    ray_service = one(rendered("dev"), "kubernetes:ray.io/v1:RayService")
    messages = rules.check_gpu_pods(ray_service, settings(rules.GPU_RULE, gpuTaintKey="example.com/accelerator"))
    assert messages and "does not tolerate the GPU taint example.com/accelerator=true:NoSchedule" in messages[0]


# --- images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_ray_head_image_by_tag_fails(stack: str) -> None:
    ray_service = one(rendered(stack), "kubernetes:ray.io/v1:RayService")
    head = ray_service.props["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["image"] = "rayproject/ray-llm:2.60.0-py311-cu128"
    messages = rules.check_image_digests(ray_service, {})
    assert messages == [
        f"RayService 'llm/{ray_service.props['metadata']['name']}': "
        f"spec.rayClusterConfig.headGroupSpec.template.spec.containers[{head['containers'][0]['name']}] "
        "image 'rayproject/ray-llm:2.60.0-py311-cu128' is not pinned by digest; "
        "fix: use '<repository>@sha256:<digest>' (a tag can be moved to other bytes)"
    ]


def test_worker_init_container_by_tag_fails() -> None:
    ray_service = one(rendered("dev"), "kubernetes:ray.io/v1:RayService")
    worker = gpu_worker(ray_service)
    worker["template"]["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox:1.36"}]
    messages = rules.check_image_digests(ray_service, {})
    assert len(messages) == 1
    assert "initContainers[fetch] image 'busybox:1.36' is not pinned by digest" in messages[0]


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        (f"registry.k8s.io/pause@{DIGEST}", True),
        (f"registry.k8s.io/pause:3.10@{DIGEST}", True),
        ("registry.k8s.io/pause:3.10", False),
        ("registry.k8s.io/pause", False),
        ("registry.k8s.io/pause@sha256:abc", False),
        (None, False),
    ],
)
def test_cronjob_images_need_a_full_digest(image: str | None, pinned: bool) -> None:
    pod = {"containers": [{"name": "job", "image": image}]}
    spec = {"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": {"spec": pod}}}}
    messages = rules.check_image_digests(manifest("kubernetes:batch/v1:CronJob", "CronJob", "sync", spec), {})
    assert (messages == []) is pinned
    if not pinned:
        assert "spec.jobTemplate.spec.template.spec.containers[job]" in messages[0]


def test_helm_values_are_not_pod_specs() -> None:
    release = Resource(
        type="kubernetes:helm.sh/v3:Release",
        name="x",
        props={"chart": "x", "version": "1.0.0", "values": {"spec": {"containers": [{"image": "a:b"}]}}},
    )
    assert rules.check_image_digests(release, {}) == []


# --- S3 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"])
def test_public_access_flag_off_fails(flag: str) -> None:
    block = one(rendered("dev"), rules.PUBLIC_ACCESS_BLOCK)
    props = {**block.props, flag: False}
    messages = rules.check_bucket_settings(with_props(block, props), {})
    assert messages == [
        f"BucketPublicAccessBlock '{block.name}': {flag} not true, so the bucket can be made public; "
        "fix: set all of blockPublicAcls, blockPublicPolicy, ignorePublicAcls, restrictPublicBuckets to true"
    ]


@pytest.mark.parametrize("rules_value", [[], [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "none"}}]])
def test_encryption_config_without_algorithm_fails(rules_value: list[dict[str, Any]]) -> None:
    sse = one(rendered("prod"), rules.ENCRYPTION_TYPES[0])
    messages = rules.check_bucket_settings(with_props(sse, {**sse.props, "rules": rules_value}), {})
    assert len(messages) == 1
    assert messages[0].startswith(f"BucketServerSideEncryptionConfiguration '{sse.name}': default encryption")
    assert "sseAlgorithm to one of AES256, aws:kms, aws:kms:dsse" in messages[0]


def test_public_acl_fails() -> None:
    bucket = one(rendered("dev"), rules.BUCKET_TYPES[0])
    messages = rules.check_bucket_settings(with_props(bucket, {**bucket.props, "acl": "public-read"}), {})
    assert messages and "canned ACL 'public-read' makes objects public" in messages[0]


@pytest.mark.parametrize(
    ("dropped", "missing"),
    [
        (rules.PUBLIC_ACCESS_BLOCK, "lacks an aws.s3.BucketPublicAccessBlock"),
        (rules.ENCRYPTION_TYPES[0], "lacks an aws.s3.BucketServerSideEncryptionConfiguration"),
    ],
)
@pytest.mark.parametrize("stack", STACKS)
def test_bucket_without_its_guard_fails(stack: str, dropped: str, missing: str) -> None:
    resources = [r for r in rendered(stack) if r.type != dropped]
    found = rules.check_buckets_guarded(resources, {})
    # Every bucket of the stack (the model bucket; in prod also the batch results bucket).
    buckets = [r for r in resources if r.type == rules.BUCKET_TYPES[0]]
    assert buckets and [ref for ref, _ in found] == [b.ref for b in buckets]
    for bucket, (_, message) in zip(buckets, found, strict=True):
        assert message.startswith(f"Bucket '{bucket.name}' {missing}")


def test_a_guard_of_another_bucket_does_not_count() -> None:
    resources = rendered("dev")
    bucket = one(resources, rules.BUCKET_TYPES[0])
    other = Resource(type=bucket.type, name="logs", props={"bucket": "acme-logs"}, ref="logs")
    found = rules.check_buckets_guarded([*resources, other], {})
    assert [ref for ref, _ in found] == ["logs"]
    assert "lacks an aws.s3.BucketPublicAccessBlock" in found[0][1]
    assert "and an aws.s3.BucketServerSideEncryptionConfiguration" in found[0][1]


# --- load balancers --------------------------------------------------------------------------


def serve_service(load_balancer: Resource) -> dict[str, Any]:
    """The load-balancer Service's manifest (our Service in front of each RayService)."""
    service: dict[str, Any] = load_balancer.props
    return service


def public_service(stack: str) -> Resource:
    """The first RayService's load-balancer Service."""
    return next(
        r
        for r in rendered(stack)
        if r.type == "kubernetes:core/v1:Service" and r.props["spec"].get("type") == "LoadBalancer"
    )


def test_prod_endpoint_without_source_ranges_fails() -> None:
    load_balancer = public_service("prod")
    serve_service(load_balancer)["spec"].pop("loadBalancerSourceRanges")
    messages = rules.check_load_balancers(load_balancer, settings(rules.LB_RULE, "prod"))
    name = load_balancer.props["metadata"]["name"]
    assert messages == [
        f"Service 'llm/{name}' (Service of type LoadBalancer) is internet-facing without "
        "an allow-list; fix: set spec.loadBalancerSourceRanges to the client CIDRs"
    ]


@pytest.mark.parametrize("everywhere", ["0.0.0.0/0", "::/0"])
def test_allow_list_of_everything_fails(everywhere: str) -> None:
    load_balancer = public_service("prod")
    serve_service(load_balancer)["spec"]["loadBalancerSourceRanges"].append(everywhere)
    messages = rules.check_load_balancers(load_balancer, settings(rules.LB_RULE, "prod"))
    assert len(messages) == 1
    assert f"allows {everywhere}, which is not an allow-list" in messages[0]


def test_prod_endpoint_fails_without_the_stacks_consent() -> None:
    # The committed prod stack is internet-facing; the policy default refuses it.
    load_balancer = public_service("prod")
    messages = rules.check_load_balancers(load_balancer, settings(rules.LB_RULE))
    assert len(messages) == 1
    assert "does not allow internet-facing load balancers (allowInternetFacing is false)" in messages[0]


def test_dev_endpoint_made_internet_facing_fails() -> None:
    load_balancer = public_service("dev")
    annotations = serve_service(load_balancer)["metadata"]["annotations"]
    annotations["service.beta.kubernetes.io/aws-load-balancer-scheme"] = "internet-facing"
    serve_service(load_balancer)["spec"]["loadBalancerSourceRanges"] = ["198.51.100.0/24"]
    messages = rules.check_load_balancers(load_balancer, settings(rules.LB_RULE, "dev"))
    assert len(messages) == 1
    assert "(allowInternetFacing is false)" in messages[0]


@pytest.mark.parametrize(
    ("annotations", "spec", "open_"),
    [
        ({}, {}, True),  # the in-tree AWS provider's default scheme is internet-facing
        ({"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}, {}, False),
        ({"service.beta.kubernetes.io/aws-load-balancer-type": "external"}, {}, False),
        ({}, {"loadBalancerClass": "service.k8s.aws/nlb"}, False),
        ({"service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing"}, {}, True),
        (
            {
                "service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing",
                "service.beta.kubernetes.io/load-balancer-source-ranges": "198.51.100.0/24",
            },
            {},
            False,
        ),
    ],
)
def test_service_schemes(annotations: dict[str, str], spec: dict[str, Any], open_: bool) -> None:
    service = manifest(
        "kubernetes:core/v1:Service",
        "Service",
        "api",
        {"type": "LoadBalancer", "ports": [{"port": 443}], **spec},
        annotations=annotations,
    )
    messages = rules.check_load_balancers(service, settings(rules.LB_RULE, allowInternetFacing=True))
    assert (messages != []) is open_, messages
    if open_:
        assert messages[0].startswith("Service 'llm/api' (Service of type LoadBalancer) is internet-facing without")


def test_cluster_ip_services_are_not_load_balancers() -> None:
    service = manifest("kubernetes:core/v1:Service", "Service", "api", {"type": "ClusterIP"})
    assert rules.check_load_balancers(service, settings(rules.LB_RULE)) == []


def test_internet_facing_alb_ingress_without_cidrs_fails() -> None:
    ingress = manifest(
        "kubernetes:networking.k8s.io/v1:Ingress",
        "Ingress",
        "api",
        {"ingressClassName": "alb"},
        annotations={"alb.ingress.kubernetes.io/scheme": "internet-facing"},
    )
    messages = rules.check_load_balancers(ingress, settings(rules.LB_RULE, allowInternetFacing=True))
    assert messages == [
        "Ingress 'llm/api' (ALB) is internet-facing without an allow-list; "
        "fix: set the alb.ingress.kubernetes.io/inbound-cidrs annotation to the client CIDRs"
    ]


@pytest.mark.parametrize(("internal", "fails"), [(None, True), (False, True), (True, False)])
def test_aws_load_balancer_scheme(internal: bool | None, fails: bool) -> None:
    props = (
        {"loadBalancerType": "network"} if internal is None else {"loadBalancerType": "network", "internal": internal}
    )
    lb = Resource(type="aws:lb/loadBalancer:LoadBalancer", name="api", props=props)
    messages = rules.check_load_balancers(lb, settings(rules.LB_RULE))
    assert (messages != []) is fails
    if fails:
        assert messages[0].startswith("LoadBalancer 'api' (internal is not true) is internet-facing")


# --- IMDSv2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_launch_template_with_optional_tokens_fails(stack: str) -> None:
    template = one(rendered(stack), rules.LAUNCH_TEMPLATE)
    props = copy.deepcopy(dict(template.props))
    props["metadataOptions"]["httpTokens"] = "optional"
    messages = rules.check_imds_v2(with_props(template, props), {})
    assert messages == [
        f"LaunchTemplate '{template.name}': metadataOptions.httpTokens is 'optional', so IMDSv1 answers; "
        "fix: set metadataOptions.httpTokens to 'required'"
    ]


def test_launch_template_without_metadata_options_fails() -> None:
    template = one(rendered("dev"), rules.LAUNCH_TEMPLATE)
    props = {k: v for k, v in template.props.items() if k != "metadataOptions"}
    messages = rules.check_imds_v2(with_props(template, props), {})
    assert messages and "httpTokens is None, so IMDSv1 answers" in messages[0]


def test_node_group_without_launch_template_fails() -> None:
    group = one(rendered("dev"), rules.EKS_NODE_GROUP)
    props = {k: v for k, v in group.props.items() if k != "launchTemplate"}
    messages = rules.check_imds_v2(with_props(group, props), {})
    assert messages and messages[0].startswith(f"NodeGroup '{group.name}': no launch template")


def test_cluster_with_default_node_group_fails() -> None:
    cluster = one(rendered("prod"), rules.PULUMI_EKS_CLUSTER)
    props = {**cluster.props, "skipDefaultNodeGroup": False}
    messages = rules.check_imds_v2(with_props(cluster, props), {})
    assert messages and "its default node group does not enforce IMDSv2" in messages[0]


@pytest.mark.parametrize(("props", "fails"), [({}, True), ({"enableIMDSv2": True}, False)])
def test_pulumi_eks_managed_node_group(props: dict[str, Any], fails: bool) -> None:
    group = Resource(type="eks:index:ManagedNodeGroup", name="gpu", props=props)
    messages = rules.check_imds_v2(group, {})
    assert (
        messages
        == ["ManagedNodeGroup 'gpu': IMDSv2 is not enforced; fix: set enableIMDSv2=True (or pass a launch template)"]
    ) is fails


# --- stateful resources ----------------------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_unprotected_model_bucket_fails(stack: str) -> None:
    bucket = one(rendered(stack), rules.BUCKET_TYPES[0])
    assert bucket.protect
    messages = rules.check_stateful_protected(with_props(bucket, bucket.props, protect=False), {})
    assert messages == [
        f"Bucket '{bucket.name}' holds state a redeploy can not recreate but is not protected; "
        "fix: pulumi.ResourceOptions(protect=True, retain_on_delete=True)"
    ]


@pytest.mark.parametrize("stack", STACKS)
def test_unprotected_image_repository_fails(stack: str) -> None:
    repositories = [r for r in rendered(stack) if r.type == rules.ECR_REPOSITORY]
    kept = [r for r in repositories if not r.props.get("forceDelete")]
    # The serving image's, and with routing on the routers' front's copy: pods pull both by digest.
    routed = load_stack_config(stack).serving.routing.enabled
    names = {"serving-image", *(["router-front-image"] if routed else [])}
    assert {r.name for r in kept} == names and all(r.protect for r in kept)
    for repository in kept:
        messages = rules.check_stateful_protected(with_props(repository, repository.props, protect=False), {})
        assert messages and messages[0].startswith(f"Repository '{repository.name}' holds state")


def test_a_disposable_cache_repository_is_exempt() -> None:
    cache_repo = Resource(type=rules.ECR_REPOSITORY, name="cache", props={"forceDelete": True})
    assert rules.check_stateful_protected(cache_repo, {}) == []
    kept = Resource(type=rules.ECR_REPOSITORY, name="cache", props={"forceDelete": False})
    assert rules.check_stateful_protected(kept, {}) != []


# --- Helm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["^1.0", "~1.7.0", "1.7", "1.x", ">=1.7.0", "*", "", None, "latest"])
def test_helm_release_with_a_range_fails(version: str | None) -> None:
    release = one(rendered("dev"), rules.HELM_TYPES[0])
    props = {k: v for k, v in release.props.items() if k != "version"}
    if version is not None:
        props["version"] = version
    messages = rules.check_helm_versions(with_props(release, props), {})
    assert messages == [
        f"Release '{release.name}': chart '{release.props['chart']}' version {version!r} is not one exact version "
        "(Helm would pick whatever is newest in range); fix: pin the exact version in infra/versions.py"
    ]


@pytest.mark.parametrize("version", ["1.7.0", "v26.7.0", "1.0.0-rc.1", "2.20.2+build.5"])
def test_exact_helm_versions_pass(version: str) -> None:
    release = Resource(type=rules.HELM_TYPES[1], name="c", props={"chart": "oci://example/c", "version": version})
    assert rules.check_helm_versions(release, {}) == []


def test_evaluate_names_the_rule() -> None:
    release = Resource(type=rules.HELM_TYPES[0], name="keda", props={"chart": "keda", "version": "^2"})
    assert rules.evaluate([release]) == [
        "helm-charts-pinned: Release 'keda': chart 'keda' version '^2' is not one exact version "
        "(Helm would pick whatever is newest in range); fix: pin the exact version in infra/versions.py"
    ]


def test_zero_gpus_is_not_a_gpu_pod() -> None:
    container = {"name": "c", "image": f"repo@{DIGEST}", "resources": {"limits": {"nvidia.com/gpu": "0"}}}
    pod = manifest("kubernetes:core/v1:Pod", "Pod", "p", {"containers": [container]})
    assert rules.check_gpu_pods(pod, settings(rules.GPU_RULE)) == []
    container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    assert rules.check_gpu_pods(pod, settings(rules.GPU_RULE)) != []


def test_aws_load_balancer_with_security_groups_passes_where_allowed() -> None:
    props = {"loadBalancerType": "application", "internal": False, "securityGroups": ["sg-0123456789abcdef0"]}
    lb = Resource(type="aws:lb/loadBalancer:LoadBalancer", name="api", props=props)
    assert rules.check_load_balancers(lb, settings(rules.LB_RULE, allowInternetFacing=True)) == []
    assert rules.check_load_balancers(lb, settings(rules.LB_RULE)) != []


@pytest.mark.parametrize("stack", STACKS)
def test_a_routed_stack_passes_the_policy_pack(stack: str) -> None:
    """With serving.routing on, every check passes: the routers' front is the stack's own copy, by digest
    (infra/aws/front_image.py), whether or not `make pin-base` has resolved its source yet."""
    from tests.harness import render_routed

    resources = [_resource(r) for r in render_routed(stack).resources]
    routers = [r for r in resources if r.type.endswith("apps/v1:Deployment") and r.name.endswith("-router-deployment")]
    assert routers
    assert rules.evaluate(resources, stack_config(stack)) == []
