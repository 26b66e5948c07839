"""The platform's guardrails: pure checks over resources, and the pack's thin wrappers around them.

Each check reads one resource as the engine sends it to a policy pack (its
type token, logical name, its inputs with the provider's camelCase keys, and
the `protect` option) and returns one message per violation, naming the
resource, what is wrong and the fix. The checks import nothing from
pulumi-policy, so the program's tests call them on the offline render
directly; `policies()` wraps them for the pack (policy/__main__.py).

During a preview the engine may not know a value yet (an image digest before
the push, an id before create). The pack hands the checks pulumi-policy's
props proxy, which raises on such a value; the engine then reports that
policy as not run for that resource during the preview, and the same check
runs with the real values during `pulumi up`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_network
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulumi_policy import Policy, ReportViolation, ResourceValidationArgs, StackValidationArgs


@dataclass(frozen=True)
class Resource:
    """One resource as a policy sees it.

    `ref` identifies it among the stack's resources (the URN in the pack, the
    logical name in the render) and `depends_on` holds the refs of the
    resources it depends on; only the stack-wide checks use them.
    """

    type: str
    name: str
    props: Mapping[str, Any]
    protect: bool = False
    ref: str = ""
    depends_on: tuple[str, ...] = ()


ResourceCheck = Callable[[Resource, Mapping[str, Any]], list[str]]
# A stack-wide check returns (ref of the offending resource, message).
StackCheck = Callable[[Sequence[Resource], Mapping[str, Any]], list[tuple[str, str]]]


@dataclass(frozen=True)
class Rule:
    """A mandatory policy: its name, what it enforces, its check and its config (JSON schema properties)."""

    name: str
    description: str
    check: ResourceCheck | None = None
    stack_check: StackCheck | None = None
    config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        """The config every property falls back to when the stack's policy config does not set it."""
        return {key: spec["default"] for key, spec in self.config.items() if "default" in spec}


# --- reading inputs ----------------------------------------------------------------------------
# The pack's props are Mapping/Sequence proxies, not dicts and lists: test
# against the abstract types.


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _seq(value: Any) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return []


def _get(props: Mapping[str, Any], path: str) -> Any:
    value: Any = props
    for key in path.split("."):
        value = _map(value).get(key)
    return value


def _truthy(value: Any) -> bool:
    # Inputs typed as bool by the schema can arrive as strings from untyped providers.
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _what(resource: Resource) -> str:
    kind = resource.type.rsplit(":", 1)[-1]
    if resource.type.startswith("kubernetes:"):
        meta = _map(resource.props.get("metadata"))
        name = meta.get("name") or resource.name
        namespace = meta.get("namespace")
        return f"{kind} '{namespace}/{name}'" if namespace else f"{kind} '{name}'"
    return f"{kind} '{resource.name}'"


def _is_manifest(resource: Resource) -> bool:
    # Helm releases and YAML groups carry values or files, not objects the API server gets.
    return resource.type.startswith("kubernetes:") and not resource.type.startswith(
        ("kubernetes:helm.sh/", "kubernetes:yaml", "kubernetes:kustomize")
    )


def pod_specs(resource: Resource) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every pod spec inside a Kubernetes object, with its path.

    Found by shape (a mapping with a `containers` list), so a Pod, a
    Deployment's template, a CronJob's job template and each head and worker
    group of a RayService, RayCluster or RayJob are all covered without a
    list of kinds to keep up to date.
    """
    if not _is_manifest(resource):
        return

    def walk(value: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        if isinstance(value, Mapping):
            if isinstance(value.get("containers"), Sequence) and not isinstance(value.get("containers"), str):
                yield path, value
                return
            for key, child in value.items():
                yield from walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for i, child in enumerate(value):
                yield from walk(child, f"{path}[{i}]")

    yield from walk(_map(resource.props.get("spec")), "spec")


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for container in _seq(spec.get(key)):
            c = _map(container)
            yield f"{key}[{c.get('name', '?')}]", c


# --- GPU pods ----------------------------------------------------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"


def _tolerates(toleration: Mapping[str, Any], key: str, value: str, effect: str) -> bool:
    # Kubernetes' matching: an empty effect matches every effect, an empty
    # key with Exists matches every taint, Exists ignores the value.
    t_effect = toleration.get("effect") or ""
    if t_effect and t_effect != effect:
        return False
    operator = toleration.get("operator") or "Equal"
    t_key = toleration.get("key") or ""
    if operator == "Exists":
        return t_key in ("", key)
    return t_key == key and (toleration.get("value") or "") == value


def _gpu_count(amounts: Mapping[str, Any]) -> str | None:
    value = amounts.get(GPU_RESOURCE)
    # Zero GPUs asks for none: such a pod does not belong on GPU nodes.
    return None if value is None or str(value) == "0" else str(value)


def check_gpu_pods(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """A pod that asks for GPUs tolerates the GPU nodes' taint and sets the GPU count as a limit."""
    key, value, effect = config["gpuTaintKey"], config["gpuTaintValue"], config["gpuTaintEffect"]
    out: list[str] = []
    for path, spec in pod_specs(resource):
        gpu_containers = []
        for where, container in _containers(spec):
            resources = _map(container.get("resources"))
            requests, limits = _map(resources.get("requests")), _map(resources.get("limits"))
            wanted, limit = _gpu_count(requests), _gpu_count(limits)
            if wanted is None and limit is None:
                continue
            gpu_containers.append(where)
            if limit is None:
                out.append(
                    f"{_what(resource)}: {path}.{where} requests {GPU_RESOURCE} without a limit; "
                    f"fix: set resources.limits['{GPU_RESOURCE}'] (GPUs are only granted through limits)"
                )
            elif wanted is not None and wanted != limit:
                out.append(
                    f"{_what(resource)}: {path}.{where} requests {wanted} {GPU_RESOURCE} but limits {limit}; "
                    "fix: set the request equal to the limit (GPUs can not be overcommitted)"
                )
        if gpu_containers and not any(_tolerates(_map(t), key, value, effect) for t in _seq(spec.get("tolerations"))):
            out.append(
                f"{_what(resource)}: {path} requests {GPU_RESOURCE} but does not tolerate the GPU taint "
                f"{key}={value}:{effect}, so it can never schedule on a GPU node; fix: add the toleration "
                "from the GPU node group's placement (infra/scheduling.py)"
            )
    return out


# --- images ------------------------------------------------------------------------------------

_DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def check_image_digests(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """Every container image is pinned by digest, so what was reviewed is what runs."""
    out: list[str] = []
    for path, spec in pod_specs(resource):
        for where, container in _containers(spec):
            image = container.get("image")
            if not isinstance(image, str) or not _DIGEST.match(image):
                out.append(
                    f"{_what(resource)}: {path}.{where} image '{image}' is not pinned by digest; "
                    "fix: use '<repository>@sha256:<digest>' (a tag can be moved to other bytes)"
                )
    return out


# --- S3 ----------------------------------------------------------------------------------------

BUCKET_TYPES = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
ENCRYPTION_TYPES = (
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
)
ACL_TYPES = ("aws:s3/bucketAcl:BucketAcl", "aws:s3/bucketAclV2:BucketAclV2")
_PUBLIC_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
_PUBLIC_ACLS = ("public-read", "public-read-write", "authenticated-read")
_SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")


def _sse_algorithms(rules: Any) -> list[Any]:
    return [_get(_map(r), "applyServerSideEncryptionByDefault.sseAlgorithm") for r in _seq(rules)]


def check_bucket_settings(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """Public access blocks block everything, encryption configs encrypt, no public ACL."""
    out: list[str] = []
    if resource.type == PUBLIC_ACCESS_BLOCK:
        off = [flag for flag in _PUBLIC_FLAGS if not _truthy(resource.props.get(flag))]
        if off:
            out.append(
                f"{_what(resource)}: {', '.join(off)} not true, so the bucket can be made public; "
                f"fix: set all of {', '.join(_PUBLIC_FLAGS)} to true"
            )
    elif resource.type in ENCRYPTION_TYPES:
        algorithms = _sse_algorithms(resource.props.get("rules"))
        if not algorithms or any(a not in _SSE_ALGORITHMS for a in algorithms):
            out.append(
                f"{_what(resource)}: default encryption algorithm {algorithms or 'missing'}; "
                "fix: set rules[].applyServerSideEncryptionByDefault.sseAlgorithm to one of "
                f"{', '.join(_SSE_ALGORITHMS)}"
            )
    elif resource.type in BUCKET_TYPES + ACL_TYPES:
        acl = resource.props.get("acl")
        if acl in _PUBLIC_ACLS:
            out.append(f"{_what(resource)}: canned ACL '{acl}' makes objects public; fix: drop the ACL (use 'private')")
    return out


def check_buckets_guarded(resources: Sequence[Resource], config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every bucket has a public access block and a default-encryption config of its own.

    A bucket and its guards are separate resources, so this is checked over
    the whole stack: a guard belongs to the bucket it depends on (its
    `bucket` input is the bucket's id, unknown before the bucket exists).
    """
    blocked = {dep for r in resources if r.type == PUBLIC_ACCESS_BLOCK for dep in r.depends_on}
    encrypted = {dep for r in resources if r.type in ENCRYPTION_TYPES for dep in r.depends_on}
    out: list[tuple[str, str]] = []
    for bucket in (r for r in resources if r.type in BUCKET_TYPES):
        # Buckets that still use the provider's inline encryption block count as encrypted.
        inline = _sse_algorithms(_get(bucket.props, "serverSideEncryptionConfiguration.rules"))
        missing = []
        if bucket.ref not in blocked:
            missing.append(f"an aws.s3.BucketPublicAccessBlock with all of {', '.join(_PUBLIC_FLAGS)} true")
        if bucket.ref not in encrypted and not inline:
            missing.append("an aws.s3.BucketServerSideEncryptionConfiguration (aws:kms or AES256)")
        if missing:
            out.append((bucket.ref, f"{_what(bucket)} lacks {' and '.join(missing)}; fix: declare it for this bucket"))
    return out


# --- load balancers ----------------------------------------------------------------------------

LB_ANNOTATION = "service.beta.kubernetes.io/aws-load-balancer"
SOURCE_RANGES_ANNOTATION = "service.beta.kubernetes.io/load-balancer-source-ranges"
ALB_SCHEME = "alb.ingress.kubernetes.io/scheme"
ALB_CIDRS = "alb.ingress.kubernetes.io/inbound-cidrs"
AWS_LB_TYPES = (
    "aws:lb/loadBalancer:LoadBalancer",
    "aws:alb/loadBalancer:LoadBalancer",
    "aws:elb/loadBalancer:LoadBalancer",
)


def _everywhere(cidrs: Sequence[str]) -> list[str]:
    out = []
    for cidr in cidrs:
        try:
            if ip_network(cidr.strip(), strict=False).prefixlen == 0:
                out.append(cidr)
        except ValueError:
            out.append(cidr)  # not a CIDR at all: not an allow-list either
    return out


def _split(value: Any) -> list[str]:
    return [c.strip() for c in value.split(",") if c.strip()] if isinstance(value, str) else []


def _service_is_internet_facing(annotations: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    scheme = annotations.get(f"{LB_ANNOTATION}-scheme")
    if scheme is not None:
        return bool(scheme == "internet-facing")
    if _truthy(annotations.get(f"{LB_ANNOTATION}-internal")):
        return False
    # The AWS Load Balancer Controller (loadBalancerClass or type "external")
    # defaults to internal; Kubernetes' in-tree AWS provider defaults to
    # internet-facing.
    handled_by_controller = spec.get("loadBalancerClass") == "service.k8s.aws/nlb" or annotations.get(
        f"{LB_ANNOTATION}-type"
    ) in ("external", "nlb-ip")
    return not handled_by_controller


def _load_balanced_services(resource: Resource) -> Iterator[tuple[str, Mapping[str, Any]]]:
    # A Service object, or a Service template inside another object
    # (a RayService's spec.serveService, a RayCluster's headService).
    if not _is_manifest(resource):
        return

    def walk(value: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
        if isinstance(value, Mapping):
            if _get(value, "spec.type") == "LoadBalancer":
                yield path, value
            for key, child in value.items():
                yield from walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for i, child in enumerate(value):
                yield from walk(child, f"{path}[{i}]")

    if resource.type.endswith(":Service"):
        if _get(resource.props, "spec.type") == "LoadBalancer":
            yield "", resource.props
        return
    yield from walk(_map(resource.props.get("spec")), "spec")


def _lb_violation(what: str, allowed: bool, cidrs: list[str], field_hint: str, are_cidrs: bool = True) -> str | None:
    if not allowed:
        return (
            f"{what} is internet-facing, and this stack's policy config does not allow internet-facing "
            "load balancers (allowInternetFacing is false); fix: make it internal, or set allowInternetFacing "
            "in the stack's policy config (policy/config/<stack>.json) after review"
        )
    if not cidrs:
        return f"{what} is internet-facing without an allow-list; fix: set {field_hint} to the client CIDRs"
    wide = _everywhere(cidrs) if are_cidrs else []
    if wide:
        return f"{what} allows {', '.join(wide)}, which is not an allow-list; fix: list client CIDRs in {field_hint}"
    return None


def check_load_balancers(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """No internet-facing load balancer without an allow-list, and none at all unless the stack allows it."""
    allowed = _truthy(config["allowInternetFacing"])
    out: list[str] = []
    for path, service in _load_balanced_services(resource):
        annotations = _map(_get(service, "metadata.annotations"))
        spec = _map(service.get("spec"))
        if not _service_is_internet_facing(annotations, spec):
            continue
        cidrs = [str(c) for c in _seq(spec.get("loadBalancerSourceRanges"))] or _split(
            annotations.get(SOURCE_RANGES_ANNOTATION)
        )
        where = f"{_what(resource)}{' ' + path if path else ''} (Service of type LoadBalancer)"
        message = _lb_violation(where, allowed, cidrs, "spec.loadBalancerSourceRanges")
        if message:
            out.append(message)
    if _is_manifest(resource) and resource.type.endswith(":Ingress"):
        annotations = _map(_get(resource.props, "metadata.annotations"))
        if annotations.get(ALB_SCHEME) == "internet-facing":
            message = _lb_violation(
                f"{_what(resource)} (ALB)", allowed, _split(annotations.get(ALB_CIDRS)), f"the {ALB_CIDRS} annotation"
            )
            if message:
                out.append(message)
    if resource.type in AWS_LB_TYPES and not _truthy(resource.props.get("internal")):
        # Its allow-list lives in security group rules this resource does not
        # show: an internet-facing one needs the stack's consent and groups.
        groups = [str(g) for g in _seq(resource.props.get("securityGroups"))]
        what = f"{_what(resource)} (internal is not true)"
        message = _lb_violation(what, allowed, groups, "securityGroups (with CIDR-limited rules)", are_cidrs=False)
        if message:
            out.append(message)
    return out


# --- IMDSv2 ------------------------------------------------------------------------------------

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
EC2_INSTANCE = "aws:ec2/instance:Instance"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
PULUMI_EKS_NODE_GROUPS = ("eks:index:ManagedNodeGroup", "eks:index:NodeGroup", "eks:index:NodeGroupV2")
PULUMI_EKS_CLUSTER = "eks:index:Cluster"
# Karpenter's node settings: IMDS options on the EC2NodeClass, GPU bounds on the NodePool.
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
NODE_POOL = "kubernetes:karpenter.sh/v1:NodePool"


def _imds_v2(options: Mapping[str, Any]) -> bool:
    return options.get("httpTokens") == "required" or options.get("httpEndpoint") == "disabled"


def check_imds_v2(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """Nodes answer instance metadata only with IMDSv2 session tokens (no SSRF path to the node role)."""
    what = _what(resource)
    if resource.type == EC2_NODE_CLASS:
        # Karpenter's default when metadataOptions is absent is httpTokens: required.
        options = _map(_get(resource.props, "spec.metadataOptions"))
        if options and not _imds_v2(options):
            return [
                f"{what}: spec.metadataOptions.httpTokens is {options.get('httpTokens')!r}, so IMDSv1 answers; "
                "fix: set spec.metadataOptions.httpTokens to 'required'"
            ]
    elif resource.type in (LAUNCH_TEMPLATE, EC2_INSTANCE):
        options = _map(resource.props.get("metadataOptions"))
        if not _imds_v2(options):
            return [
                f"{what}: metadataOptions.httpTokens is {options.get('httpTokens')!r}, so IMDSv1 answers; "
                "fix: set metadataOptions.httpTokens to 'required'"
            ]
    elif resource.type == EKS_NODE_GROUP:
        if not _get(resource.props, "launchTemplate.id") and not _get(resource.props, "launchTemplate.name"):
            return [
                f"{what}: no launch template, so EKS' default one decides the metadata settings; "
                "fix: give it a launch template with metadataOptions.httpTokens 'required'"
            ]
    elif resource.type in PULUMI_EKS_NODE_GROUPS:
        if not _truthy(resource.props.get("enableIMDSv2")) and not resource.props.get("launchTemplate"):
            return [f"{what}: IMDSv2 is not enforced; fix: set enableIMDSv2=True (or pass a launch template)"]
    elif resource.type == PULUMI_EKS_CLUSTER:
        skipped = _truthy(resource.props.get("skipDefaultNodeGroup")) or bool(resource.props.get("fargate"))
        if not skipped and not _truthy(_get(resource.props, "nodeGroupOptions.enableIMDSv2")):
            return [
                f"{what}: its default node group does not enforce IMDSv2; "
                "fix: set skipDefaultNodeGroup=True (and declare node groups) or nodeGroupOptions.enableIMDSv2=True"
            ]
    return []


# --- stateful resources ------------------------------------------------------------------------

ECR_REPOSITORY = "aws:ecr/repository:Repository"
AWSX_ECR_REPOSITORY = "awsx:ecr:Repository"
# Inputs with which a resource declares its contents disposable (deleting it empties it first).
_DISPOSABLE = {
    "aws:s3/bucket:Bucket": "forceDestroy",
    "aws:s3/bucketV2:BucketV2": "forceDestroy",
    ECR_REPOSITORY: "forceDelete",
    AWSX_ECR_REPOSITORY: "forceDelete",
}


def check_stateful_protected(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """Buckets and image repositories hold what a redeploy can not recreate: they are protected.

    `protect` is the option a policy can see (the engine does not send
    `retainOnDelete` to policy packs); use both. A bucket or repository that
    sets forceDestroy/forceDelete declares its contents disposable (a build
    cache) and is exempt: that flag is what a reviewer reads in the diff.
    """
    flag = _DISPOSABLE.get(resource.type)
    if flag is None or _truthy(resource.props.get(flag)) or resource.protect:
        return []
    return [
        f"{_what(resource)} holds state a redeploy can not recreate but is not protected; "
        "fix: pulumi.ResourceOptions(protect=True, retain_on_delete=True)"
    ]


# --- Helm --------------------------------------------------------------------------------------

HELM_TYPES = ("kubernetes:helm.sh/v3:Release", "kubernetes:helm.sh/v4:Chart")
# One exact semantic version: Helm reads anything else (1.2, ~1.2.0, ^1, >=1, 1.x, *) as a range.
_EXACT_CHART_VERSION = re.compile(r"^v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def check_helm_versions(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """Every Helm chart is pinned to one exact version, so a preview shows every chart change."""
    if resource.type not in HELM_TYPES:
        return []
    chart = resource.props.get("chart")
    if isinstance(chart, str) and chart.startswith(("./", "../", "/")):
        return []  # a chart in this repository is pinned by the commit
    version = resource.props.get("version")
    if isinstance(version, str) and _EXACT_CHART_VERSION.match(version):
        return []
    return [
        f"{_what(resource)}: chart '{chart}' version {version!r} is not one exact version (Helm would pick "
        "whatever is newest in range); fix: pin the exact version in infra/versions.py"
    ]


def check_node_pools(resource: Resource, config: Mapping[str, Any]) -> list[str]:
    """A Karpenter NodePool bounds its GPUs and consolidates only empty nodes (never one with a replica on it)."""
    if resource.type != NODE_POOL:
        return []
    what, spec = _what(resource), _map(resource.props.get("spec"))
    problems = []
    if GPU_RESOURCE not in _map(spec.get("limits")):
        problems.append(f"{what}: no spec.limits['{GPU_RESOURCE}'], so nothing caps its GPU cost; fix: set the limit")
    policy = _get(spec, "disruption.consolidationPolicy")
    if policy != "WhenEmpty":
        problems.append(
            f"{what}: spec.disruption.consolidationPolicy is {policy!r}, so Karpenter may move serving replicas "
            "to pack nodes; fix: set it to 'WhenEmpty'"
        )
    return problems


# --- the rules ---------------------------------------------------------------------------------

GPU_RULE = Rule(
    name="gpu-pods-tolerate-taint-and-limit-gpus",
    description="Pods that request nvidia.com/gpu tolerate the GPU nodes' taint and set the GPU count as a limit.",
    check=check_gpu_pods,
    config={
        # Defaults equal infra.scheduling.GPU_TAINT (a test holds them together).
        "gpuTaintKey": {"type": "string", "default": "nvidia.com/gpu"},
        "gpuTaintValue": {"type": "string", "default": "true"},
        "gpuTaintEffect": {
            "type": "string",
            "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"],
            "default": "NoSchedule",
        },
    },
)
IMAGE_RULE = Rule(
    name="images-pinned-by-digest",
    description="Every container image (Pods, workload templates, Ray head and worker groups) is pinned by digest.",
    check=check_image_digests,
)
BUCKET_RULE = Rule(
    name="s3-buckets-private-and-encrypted",
    description="S3 public access blocks block all four ways in, default encryption is on, no public ACLs.",
    check=check_bucket_settings,
)
BUCKET_STACK_RULE = Rule(
    name="s3-buckets-have-access-block-and-encryption",
    description="Every S3 bucket has its own public access block and default-encryption configuration.",
    stack_check=check_buckets_guarded,
)
LB_RULE = Rule(
    name="no-open-internet-load-balancers",
    description=(
        "Internet-facing load balancers need a CIDR allow-list, and are refused unless the stack's "
        "policy config sets allowInternetFacing."
    ),
    check=check_load_balancers,
    config={"allowInternetFacing": {"type": "boolean", "default": False}},
)
IMDS_RULE = Rule(
    name="imdsv2-required",
    description="Launch templates, instances, node groups and Karpenter node classes require IMDSv2 tokens.",
    check=check_imds_v2,
)
STATEFUL_RULE = Rule(
    name="stateful-resources-protected",
    description="S3 buckets and ECR repositories are protected unless they declare their contents disposable.",
    check=check_stateful_protected,
)
NODE_POOL_RULE = Rule(
    name="karpenter-node-pools-bounded",
    description="Karpenter NodePools limit their GPUs and consolidate only empty nodes.",
    check=check_node_pools,
)
HELM_RULE = Rule(
    name="helm-charts-pinned",
    description="Every Helm release and chart names one exact chart version.",
    check=check_helm_versions,
)

RULES: tuple[Rule, ...] = (
    GPU_RULE,
    IMAGE_RULE,
    BUCKET_RULE,
    BUCKET_STACK_RULE,
    LB_RULE,
    IMDS_RULE,
    STATEFUL_RULE,
    HELM_RULE,
    NODE_POOL_RULE,
)


def evaluate(resources: Sequence[Resource], config: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Every violation of every rule over a whole stack, as `rule: message` lines.

    `config` is the policy config document (rule name -> properties), as in
    policy/config/<stack>.json.
    """
    out: list[str] = []
    for rule in RULES:
        settings = {**rule.defaults(), **(config or {}).get(rule.name, {})}
        if rule.check is not None:
            out += [f"{rule.name}: {m}" for r in resources for m in rule.check(r, settings)]
        if rule.stack_check is not None:
            out += [f"{rule.name}: {m}" for _, m in rule.stack_check(resources, settings)]
    return out


# --- the pack's wrappers -----------------------------------------------------------------------


def policies() -> list[Policy]:
    """The rules as mandatory pulumi-policy policies (for policy/__main__.py)."""
    # Imported here, not at the top: the checks load without pulumi-policy
    # (it pins protobuf 5.29, which the program's environment need not share).
    from pulumi_policy import EnforcementLevel, PolicyConfigSchema, ResourceValidationPolicy, StackValidationPolicy

    def settings(rule: Rule, given: Mapping[str, Any]) -> dict[str, Any]:
        return {**rule.defaults(), **given}

    def resource_validation(
        rule: Rule, check: ResourceCheck
    ) -> Callable[[ResourceValidationArgs, ReportViolation], None]:
        def validate(args: ResourceValidationArgs, report: ReportViolation) -> None:
            resource = Resource(
                type=args.resource_type, name=args.name, props=args.props, protect=args.opts.protect, ref=args.urn
            )
            for message in check(resource, settings(rule, args.get_config())):
                report(message, None)

        return validate

    def stack_validation(rule: Rule, check: StackCheck) -> Callable[[StackValidationArgs, ReportViolation], None]:
        def validate(args: StackValidationArgs, report: ReportViolation) -> None:
            resources = [
                Resource(
                    type=r.resource_type,
                    name=r.name,
                    props=r.props,
                    protect=r.opts.protect,
                    ref=r.urn,
                    depends_on=tuple(d.urn for d in r.dependencies),
                )
                for r in args.resources
            ]
            for urn, message in check(resources, settings(rule, args.get_config())):
                report(message, urn)

        return validate

    out: list[Policy] = []
    for rule in RULES:
        schema = PolicyConfigSchema(properties={k: dict(v) for k, v in rule.config.items()}) if rule.config else None
        if rule.check is not None:
            out.append(
                ResourceValidationPolicy(
                    name=rule.name,
                    description=rule.description,
                    validate=resource_validation(rule, rule.check),
                    enforcement_level=EnforcementLevel.MANDATORY,
                    config_schema=schema,
                )
            )
        if rule.stack_check is not None:
            out.append(
                StackValidationPolicy(
                    name=rule.name,
                    description=rule.description,
                    validate=stack_validation(rule, rule.stack_check),
                    enforcement_level=EnforcementLevel.MANDATORY,
                    config_schema=schema,
                )
            )
    return out
