"""The AWS layer as the offline render declares it, for the dev and prod stacks and an existing cluster."""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import pytest

from infra import versions
from infra.aws import node_groups as ng
from infra.aws.cluster import NODE_MANAGED_POLICIES
from infra.aws.registry import image_tag
from infra.config import GpuNodeGroupSettings, StackConfig, SystemNodeGroupSettings
from infra.mocks import fake_digest
from infra.render import SECRET, Rendered
from infra.scheduling import GPU_TAINT, gpu_placement, system_placement
from tests.harness import by_type, doc_config, render_config, render_stack, stack_doc

STACKS = ["dev", "prod"]
DIGEST_REF = re.compile(r"^.+@sha256:[0-9a-f]{64}$")
NS = "llm-platform:"


def _config(doc: dict[str, Any]) -> StackConfig:
    return doc_config(doc)


def _one(r: Rendered, type_token: str, name: str) -> dict[str, Any]:
    found = [x for x in by_type(r, type_token) if x["name"] == name]
    assert len(found) == 1, f"expected one {type_token} named {name}, found {len(found)}"
    return found[0]


def _node_group(r: Rendered, group: str) -> dict[str, Any]:
    return _one(r, "aws:eks/nodeGroup:NodeGroup", f"nodes-{group}")


def _policy_docs(r: Rendered) -> dict[str, dict[str, Any]]:
    return {p["name"]: json.loads(p["inputs"]["policy"]) for p in by_type(r, "aws:iam/rolePolicy:RolePolicy")}


def _list(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else list(value)


def _managed_doc(name: str) -> dict[str, Any]:
    """A stack file with its GPU groups as managed node groups (Karpenter's side: tests/test_aws_karpenter.py)."""
    doc = copy.deepcopy(stack_doc(name))
    doc["config"][f"{NS}cluster"]["node_provisioner"] = "managed_node_groups"
    return doc


@functools.cache
def _managed_render(name: str) -> Rendered:
    if _config(stack_doc(name)).cluster.node_provisioner == "managed_node_groups":
        return render_stack(name)
    return render_config(_managed_doc(name), name)


@pytest.fixture(scope="module", params=STACKS)
def stack(request: pytest.FixtureRequest) -> tuple[StackConfig, Rendered]:
    name = str(request.param)
    return _config(_managed_doc(name)), _managed_render(name)


def test_every_gpu_group_carries_the_scheduling_objects_taint_and_labels(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    for group in cfg.node_groups.gpu:
        placement = gpu_placement(group)
        inputs = _node_group(r, group.name)["inputs"]
        assert inputs["labels"] == placement.labels
        assert inputs["taints"] == [
            {"key": t.key, "value": t.value, "effect": ng.TAINT_EFFECTS[t.effect]} for t in placement.taints
        ]
        assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"} in inputs["taints"]
        assert placement.labels["llm-platform/gpu-model"] == group.instance().gpu_model
        assert placement.labels["llm-platform/node-group"] == group.name
        assert inputs["amiType"] == ng.AMI_TYPES[group.ami]
        assert inputs["instanceTypes"] == group.instance_types
        assert inputs["scalingConfig"] == {
            "minSize": group.min_size,
            "desiredSize": group.desired_size,
            "maxSize": group.max_size,
        }
    system = system_placement(cfg)
    sys_inputs = _node_group(r, system.group)["inputs"]
    assert sys_inputs["labels"] == system.labels
    assert sys_inputs.get("taints", []) == []
    assert sys_inputs["amiType"] == "AL2023_x86_64_STANDARD"


def test_capacity_types_and_scale_to_zero_follow_the_stacks() -> None:
    dev = _node_group(_managed_render("dev"), "l4-spot")["inputs"]
    assert dev["capacityType"] == "SPOT"
    assert dev["scalingConfig"]["minSize"] == 0
    prod = render_stack("prod")
    for group in ("l40s-1x", "l40s-4x"):
        assert _node_group(prod, group)["inputs"]["capacityType"] == "ON_DEMAND"


def test_autoscaler_node_template_lets_each_group_scale_from_zero(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    for group in cfg.node_groups.gpu:
        placement = gpu_placement(group)
        tags = _node_group(r, group.name)["inputs"]["tags"]
        template = "k8s.io/cluster-autoscaler/node-template"
        assert tags["k8s.io/cluster-autoscaler/enabled"] == "true"
        assert tags[f"k8s.io/cluster-autoscaler/{cfg.cluster.name}"] == "owned"
        assert tags[f"{template}/resources/nvidia.com/gpu"] == str(group.instance().gpus)
        assert tags[f"{template}/taint/{GPU_TAINT.key}"] == f"{GPU_TAINT.value}:{GPU_TAINT.effect}"
        for key, value in placement.labels.items():
            assert tags[f"{template}/label/{key}"] == value
        assert tags[f"{template}/resources/ephemeral-storage"] == f"{group.disk_size_gib}Gi"
        # The same template is on the Auto Scaling group, where the autoscaler reads it.
        asg_tags = [t for t in by_type(r, "aws:autoscaling/tag:Tag") if t["parent"] == f"nodes-{group.name}"]
        on_asg = {t["inputs"]["tag"]["key"]: t["inputs"]["tag"]["value"] for t in asg_tags}
        assert on_asg == ng.node_template_tags(placement, group.disk_size_gib)
        assert {t["inputs"]["autoscalingGroupName"] for t in asg_tags} != {""}
        assert all(t["inputs"]["tag"]["propagateAtLaunch"] is False for t in asg_tags)


def test_nodes_require_imdsv2_and_encrypted_gp3_sized_from_config(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    groups: list[SystemNodeGroupSettings | GpuNodeGroupSettings] = [cfg.node_groups.system, *cfg.node_groups.gpu]
    for group in groups:
        template = _one(r, "aws:ec2/launchTemplate:LaunchTemplate", f"nodes-{group.name}")["inputs"]
        assert template["metadataOptions"]["httpTokens"] == "required"
        # Only the node (and host-network pods) reach IMDS: pods can not take the node's role.
        assert template["metadataOptions"]["httpPutResponseHopLimit"] == 1
        volumes = template["blockDeviceMappings"]
        assert all(v["ebs"]["encrypted"] == "true" and v["ebs"]["volumeType"] == "gp3" for v in volumes)
        assert group.disk_size_gib in [v["ebs"].get("volumeSize") for v in volumes]
        node_group = _node_group(r, group.name)["inputs"]
        assert node_group["launchTemplate"]["id"] == f"nodes-{group.name}-id"
        assert "diskSize" not in node_group  # the launch template sizes the disk


def test_bottlerocket_sizes_the_data_volume() -> None:
    doc = _managed_doc("dev")
    doc["config"][f"{NS}node_groups"]["gpu"][0]["ami"] = "bottlerocket_nvidia"
    r = render_config(doc, "dev")
    group = _node_group(r, "l4-spot")["inputs"]
    assert group["amiType"] == "BOTTLEROCKET_x86_64_NVIDIA"
    volumes = _one(r, "aws:ec2/launchTemplate:LaunchTemplate", "nodes-l4-spot")["inputs"]["blockDeviceMappings"]
    sizes = {v["deviceName"]: v["ebs"].get("volumeSize") for v in volumes}
    assert sizes == {"/dev/xvda": None, "/dev/xvdb": 200}


def test_every_iam_policy_names_only_the_arns_it_needs(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    bucket_arn = f"arn:aws:s3:::{cfg.storage.model_bucket}"
    results_arn = "arn:aws:s3:::batch-queue-results"  # the mocks' ARN of the results bucket
    docs = _policy_docs(r)
    assert set(docs) >= {
        "pod-identities-model-reader",
        "pod-identities-cluster-autoscaler",
        "pod-identities-load-balancer-controller",
    }
    for name, doc in docs.items():
        for stmt in doc["Statement"]:
            actions = _list(stmt["Action"])
            resources = _list(stmt["Resource"])
            if any(a.startswith("s3:") for a in actions):
                assert "*" not in resources, (name, stmt)
                # The batch workers write to the results bucket; every other role reads the model bucket.
                allowed = results_arn if name == "pod-identities-batch-worker" else bucket_arn
                assert all(res == allowed or res.startswith(f"{allowed}/") for res in resources), name
    reader = docs["pod-identities-model-reader"]["Statement"]
    get = next(s for s in reader if "s3:GetObject" in s["Action"])
    prefixes = sorted({m.source.removeprefix(f"s3://{cfg.storage.model_bucket}/") for m in cfg.models})
    assert get["Resource"] == [f"{bucket_arn}/{p}/*" for p in prefixes]
    listing = next(s for s in reader if "s3:ListBucket" in s["Action"])
    assert listing["Resource"] == [bucket_arn]
    assert set(listing["Condition"]["StringLike"]["s3:prefix"]) == {x for p in prefixes for x in (p, f"{p}/*")}
    lbc = docs["pod-identities-load-balancer-controller"]["Statement"]
    opens = next(s for s in lbc if s["Sid"] == "NodeSecurityGroupRules")
    assert re.fullmatch(rf"arn:aws:ec2:{cfg.region}:123456789012:security-group/sg-[0-9a-f]+", opens["Resource"])
    ca = docs["pod-identities-cluster-autoscaler"]["Statement"]
    scale = next(s for s in ca if "autoscaling:SetDesiredCapacity" in s["Action"])
    assert scale["Condition"]["StringEquals"] == {
        f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cfg.cluster.name}": "owned"
    }


def test_each_role_is_bound_to_the_service_account_its_trust_policy_names(
    stack: tuple[StackConfig, Rendered],
) -> None:
    cfg, r = stack
    associations = {a["name"]: a["inputs"] for a in by_type(r, "aws:eks/podIdentityAssociation:PodIdentityAssociation")}
    # With batch on, the workers and KEDA's operator (which reads the queue length) get roles too.
    batch = {(cfg.serving.namespace, "batch-worker"), ("keda", "keda-operator")} if cfg.batch.enabled else set()
    # With a domain and its hosted zone, external-dns gets a role that may change that zone.
    dns = {("external-dns", "external-dns")} if cfg.endpoint.domain and cfg.endpoint.hosted_zone_id else set()
    assert {(a["namespace"], a["serviceAccount"]) for a in associations.values()} == {
        (cfg.serving.namespace, "model-reader"),
        ("kube-system", "cluster-autoscaler"),
        ("kube-system", "aws-load-balancer-controller"),
        ("kube-system", "ebs-csi-controller-sa"),
        *batch,
        *dns,
    }
    roles = {x["name"]: x for x in by_type(r, "aws:iam/role:Role")}
    for name, assoc in associations.items():
        assert assoc["clusterName"] == cfg.cluster.name
        trust = json.loads(roles[name]["inputs"]["assumeRolePolicy"])
        cond = trust["Statement"][0]["Condition"]["StringEquals"]
        assert cond["aws:RequestTag/kubernetes-namespace"] == assoc["namespace"]
        assert cond["aws:RequestTag/kubernetes-service-account"] == assoc["serviceAccount"]
        assert cond["aws:RequestTag/eks-cluster-name"] == cfg.cluster.name
    ebs = [
        a
        for a in by_type(r, "aws:iam/rolePolicyAttachment:RolePolicyAttachment")
        if a["name"] == "pod-identities-ebs-csi"
    ]
    assert [a["inputs"]["policyArn"] for a in ebs] == ["arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"]


def test_model_bucket_is_private_encrypted_versioned_tls_only_and_kept(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    bucket = _one(r, "aws:s3/bucket:Bucket", "model-bucket")
    assert bucket["inputs"]["bucket"] == cfg.storage.model_bucket
    assert bucket["protect"] and bucket["retain_on_delete"]
    assert not bucket["inputs"].get("forceDestroy")
    key = _one(r, "aws:kms/key:Key", "model-bucket-key")
    assert key["protect"] and key["retain_on_delete"] and key["inputs"]["enableKeyRotation"]

    block = _one(r, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "model-bucket")["inputs"]
    flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
    assert all(block[f] is True for f in flags)
    sse = _one(
        r, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", "model-bucket"
    )["inputs"]["rules"][0]["applyServerSideEncryptionByDefault"]
    assert sse["sseAlgorithm"] == "aws:kms"
    assert sse["kmsMasterKeyId"].startswith("arn:aws:kms:")
    versioning = _one(r, "aws:s3/bucketVersioning:BucketVersioning", "model-bucket")["inputs"]
    assert versioning["versioningConfiguration"]["status"] == "Enabled"
    ownership = _one(r, "aws:s3/bucketOwnershipControls:BucketOwnershipControls", "model-bucket")["inputs"]
    assert ownership["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    policy = json.loads(_one(r, "aws:s3/bucketPolicy:BucketPolicy", "model-bucket")["inputs"]["policy"])
    deny, writers = policy["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    arn = f"arn:aws:s3:::{cfg.storage.model_bucket}"
    assert deny["Resource"] == [arn, f"{arn}/*"]
    # Writes by anyone but the deployer (the mocks deploy as the root) and the listed writers are denied.
    assert writers["Effect"] == "Deny" and "s3:PutObject" in writers["Action"]
    assert writers["Condition"]["ArnNotEquals"]["aws:PrincipalArn"] == sorted(
        ["arn:aws:iam::123456789012:root", *cfg.storage.weights_writer_arns]
    )


def test_image_is_built_without_preview_and_pinned_by_digest(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    repo = _one(r, "aws:ecr/repository:Repository", "serving-image")
    assert repo["inputs"]["imageTagMutability"] == "IMMUTABLE"
    assert repo["inputs"]["imageScanningConfiguration"] == {"scanOnPush": True}
    assert repo["retain_on_delete"] and repo["protect"]
    rules = json.loads(_one(r, "aws:ecr/lifecyclePolicy:LifecyclePolicy", "serving-image")["inputs"]["policy"])["rules"]
    assert [x["selection"]["tagStatus"] for x in rules] == ["untagged", "any"]

    image = _one(r, "docker-build:index:Image", "serving-image")["inputs"]
    assert image["buildOnPreview"] is False
    assert image["push"] is True
    assert image["platforms"] == ["linux/amd64"]
    assert image["buildArgs"] == {"BASE_IMAGE": versions.RAY_LLM_BASE_IMAGE}
    assert image["cacheTo"][0]["registry"]["mode"] == "max"
    assert image["cacheFrom"][0]["registry"]["ref"] == image["cacheTo"][0]["registry"]["ref"]
    url = f"123456789012.dkr.ecr.{cfg.region}.amazonaws.com/{cfg.image.repository_name}"
    assert image["tags"] == [f"{url}:{image_tag()}"]
    assert image["tags"][0].split(":")[-1].startswith(versions.RAY_VERSION)
    assert DIGEST_REF.match(r.outputs["image"])
    assert r.outputs["image"] == f"{url}@{fake_digest('serving-image')}"


def test_cluster_is_pinned_encrypted_and_exposed_as_configured(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    cluster = _one(r, "eks:index:Cluster", "cluster")["inputs"]
    assert cluster["name"] == cfg.cluster.name
    assert cluster["version"] == cfg.cluster.kubernetes_version
    assert cluster["authenticationMode"] == "API"
    assert cluster["skipDefaultNodeGroup"] is True
    assert cluster["enabledClusterLogTypes"] == list(cfg.cluster.log_types)
    assert cluster["endpointPublicAccess"] is cfg.cluster.endpoint_public_access
    assert cluster["endpointPrivateAccess"] is cfg.cluster.endpoint_private_access
    assert cluster.get("publicAccessCidrs", []) == (
        [str(c) for c in cfg.cluster.public_access_cidrs] if cfg.cluster.endpoint_public_access else []
    )
    key = _one(r, "aws:kms/key:Key", "cluster-secrets")["inputs"]
    assert key["enableKeyRotation"] is True
    assert cluster["encryptionConfigKeyArn"].startswith("arn:aws:kms:")
    addons = {a["inputs"]["addonName"]: a["inputs"]["addonVersion"] for a in by_type(r, "aws:eks/addon:Addon")}
    assert addons == versions.EKS_ADDONS
    # NetworkPolicies are enforced only with the CNI's policy agent on.
    cni = _one(r, "aws:eks/addon:Addon", "vpc-cni")["inputs"]
    assert json.loads(cni["configurationValues"]) == {"enableNetworkPolicy": "true"}
    # coredns needs nodes: its component waits for every node group (and so, through
    # the parent, does every add-on in it).
    coredns = _one(r, "aws:eks/addon:Addon", "coredns")
    workload_addons = _one(r, "llm-platform:aws:EksAddons", coredns["parent"])
    groups = {f"nodes-{cfg.node_groups.system.name}", *(f"nodes-{g.name}" for g in cfg.node_groups.gpu)}
    assert groups <= set(workload_addons["depends_on"])
    assert {a["name"] for a in by_type(r, "aws:eks/podIdentityAssociation:PodIdentityAssociation")} <= set(
        workload_addons["depends_on"]
    )


def test_nodes_wait_for_the_node_addons_and_the_node_role_policies(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    node_addons = {"vpc-cni", "kube-proxy", "eks-pod-identity-agent"}
    policies = {f"cluster-node-{p}" for p in NODE_MANAGED_POLICIES}
    for group in [cfg.node_groups.system.name, *(g.name for g in cfg.node_groups.gpu)]:
        # On the component, once: its children register only after it.
        component = _one(r, "llm-platform:aws:NodeGroup", f"nodes-{group}")
        assert node_addons | policies <= set(component["depends_on"]), group
        children = {x["type"] for x in r.resources if x["parent"] == f"nodes-{group}"}
        assert {"aws:eks/nodeGroup:NodeGroup", "aws:ec2/launchTemplate:LaunchTemplate"} <= children
    # The node add-ons wait for the control plane the same way.
    assert "cluster" in _one(r, "llm-platform:aws:EksAddons", "cluster-node-addons")["depends_on"]


def test_network_spans_the_zones_with_the_configured_nat(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    vpc = _one(r, "awsx:ec2:Vpc", "network")["inputs"]
    assert vpc["availabilityZoneNames"] == cfg.network.zones
    assert vpc["cidrBlock"] == str(cfg.network.vpc_cidr)
    assert vpc["natGateways"]["strategy"] == {"single": "Single", "one_per_zone": "OnePerAz"}[cfg.network.nat_gateways]
    specs = {s["type"]: s["tags"] for s in vpc["subnetSpecs"]}
    cluster_tag = f"kubernetes.io/cluster/{cfg.cluster.name}"
    assert specs["Private"] == {"kubernetes.io/role/internal-elb": "1", cluster_tag: "shared"}
    assert specs["Public"] == {"kubernetes.io/role/elb": "1", cluster_tag: "shared"}


def test_stack_outputs_come_from_the_layer(stack: tuple[StackConfig, Rendered]) -> None:
    cfg, r = stack
    assert r.outputs["cluster_name"] == cfg.cluster.name
    assert r.outputs["kubeconfig"] == SECRET
    assert r.outputs["model_bucket"] == cfg.storage.model_bucket
    names = r.outputs["node_groups"]
    assert set(names) == {cfg.node_groups.system.name, *(g.name for g in cfg.node_groups.gpu)}
    assert all(v.startswith(f"{k}-") for k, v in names.items())
    (provider,) = by_type(r, "pulumi:providers:kubernetes")
    assert provider["inputs"]["kubeconfig"] == SECRET


def test_redis_only_in_prod_with_tls_and_a_secret_token() -> None:
    assert not [x for x in render_stack("dev").resources if x["type"].startswith("aws:elasticache")]
    r = render_stack("prod")
    cfg = _config(stack_doc("prod"))
    group = _one(r, "aws:elasticache/replicationGroup:ReplicationGroup", "ray-gcs-redis")["inputs"]
    assert group["transitEncryptionEnabled"] is True
    assert group["atRestEncryptionEnabled"] is True
    assert group["authToken"] == SECRET
    assert group["automaticFailoverEnabled"] is True and group["multiAzEnabled"] is True
    assert group["numCacheClusters"] == 2
    assert len(set(group["preferredCacheClusterAzs"])) == 2
    assert group["nodeType"] == cfg.ray.gcs_fault_tolerance.node_type
    (ingress,) = [
        x
        for x in by_type(r, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        if x["parent"] == "ray-gcs-redis"
    ]
    rule = ingress["inputs"]
    assert (rule["fromPort"], rule["toPort"], rule["ipProtocol"]) == (6379, 6379, "tcp")
    assert rule["referencedSecurityGroupId"].startswith("sg-")
    assert "cidrIpv4" not in rule
    subnets = _one(r, "aws:elasticache/subnetGroup:SubnetGroup", "ray-gcs-redis")["inputs"]["subnetIds"]
    cluster = _one(r, "eks:index:Cluster", "cluster")["inputs"]
    assert subnets == cluster["privateSubnetIds"]


def _existing_doc() -> dict[str, Any]:
    doc = _managed_doc("dev")
    doc["config"][f"{NS}cluster"] = {"mode": "existing", "name": "shared-gpu", "kubeconfig_context": "shared-gpu-admin"}
    doc["config"][f"{NS}image"] = {
        "reference": "registry.example.com/llm-serving@sha256:" + "ab" * 32,
        # Dev routes: the routers' front too, from the same registry.
        "router_front_reference": "registry.example.com/nginx-unprivileged@sha256:" + "cd" * 32,
    }
    return doc


def test_existing_cluster_creates_no_cluster_and_uses_the_context() -> None:
    r = render_config(_existing_doc(), "dev")
    made = {x["type"] for x in r.resources}
    forbidden = ("aws:eks", "eks:", "awsx:", "aws:ec2", "aws:elasticache", "aws:iam", "aws:autoscaling")
    assert not [t for t in made if t.startswith(forbidden)]
    (provider,) = by_type(r, "pulumi:providers:kubernetes")
    assert provider["inputs"].get("context") == "shared-gpu-admin"
    assert "kubeconfig" not in provider["inputs"]
    # The bucket and repository are still made; the given images are used as they are, nothing is built.
    assert _one(r, "aws:s3/bucket:Bucket", "model-bucket")["protect"]
    assert _one(r, "aws:ecr/repository:Repository", "serving-image")
    assert not by_type(r, "docker-build:index:Image")
    assert r.outputs["image"] == "registry.example.com/llm-serving@sha256:" + "ab" * 32
    fronts = {
        c["image"]
        for m in r.manifests
        if m.get("kind") == "Deployment"
        for c in m["spec"]["template"]["spec"]["containers"]
        if c["name"] == "front"
    }
    assert fronts == {"registry.example.com/nginx-unprivileged@sha256:" + "cd" * 32}
    assert "kubeconfig" not in r.outputs
    assert r.outputs["node_groups"] == {}


def test_admin_principals_get_cluster_admin_access_entries() -> None:
    doc = _managed_doc("dev")
    arn = "arn:aws:iam::123456789012:role/platform-admins"
    doc["config"][f"{NS}cluster"]["admin_principal_arns"] = [arn]
    cluster = _one(render_config(doc, "dev"), "eks:index:Cluster", "cluster")["inputs"]
    (entry,) = cluster["accessEntries"].values()
    assert entry["principalArn"] == arn
    (policy,) = entry["accessPolicies"].values()
    assert policy["policyArn"] == "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
    assert policy["accessScope"] == {"type": "cluster"}
