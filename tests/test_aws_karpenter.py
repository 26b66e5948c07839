"""Karpenter's AWS side against upstream's CloudFormation at the pinned version.

The controller's policies are compared statement by statement with the
`KarpenterController<X>Policy` documents of reference/karpenter/cloudformation.yaml
(its `!Sub` variables filled in with this stack's values): every action ours
grants is one upstream grants in the same statement, every resource ours
names is inside one upstream names, and every condition upstream sets is
set here too with the same values.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from functools import cache
from typing import Any

import pytest
import yaml

from infra import mocks
from infra.aws import karpenter as aws_karpenter
from infra.aws import policies
from infra.mocks import ACCOUNT_ID
from infra.render import Rendered
from tests.harness import by_type, manifests_of, reference_dir, render_config, render_stack, stack_config, stack_doc

POLICY_PARTS = ("NodeLifecycle", "IAMIntegration", "EKSIntegration", "Interruption", "ZonalShift", "ResourceDiscovery")


class _CfnLoader(yaml.SafeLoader):
    """Reads CloudFormation's short-form tags as {tag: value}."""


for _tag in ("!Sub", "!GetAtt", "!Ref"):
    _CfnLoader.add_constructor(_tag, lambda loader, node, t=_tag: {t: loader.construct_scalar(node)})


@cache
def cloudformation() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.load((reference_dir() / "karpenter" / "cloudformation.yaml").read_text(), _CfnLoader)
    return doc


# The region each render was made in, by the render's id (the mocks' outputs depend on it).
REGION: dict[int, str] = {}


@cache
def rendered(stack: str) -> Rendered:
    """The stack with Karpenter as its node provisioner."""
    if stack_config(stack).cluster.node_provisioner == "karpenter":
        r = render_stack(stack)
    else:
        doc = copy.deepcopy(stack_doc(stack))
        doc["config"]["llm-platform:cluster"]["node_provisioner"] = "karpenter"
        r = render_config(doc, stack)
    REGION[id(r)] = stack_config(stack).region
    return r


def _one(r: Rendered, type_token: str, name: str) -> dict[str, Any]:
    (found,) = [x for x in by_type(r, type_token) if x["name"] == name]
    return found


def _outputs(r: Rendered, type_token: str, name: str) -> dict[str, Any]:
    """A resource's inputs and the outputs the mocks give it (the render records inputs only)."""
    found = _one(r, type_token, name)
    return {**found["inputs"], **mocks.TYPE_OUTPUTS[type_token](name, found["inputs"], REGION[id(r)])}


def upstream_policies(stack: str) -> dict[str, dict[str, Any]]:
    """Upstream's six controller documents, with this stack's cluster, region, account, queue and node role."""
    r = rendered(stack)
    cfg = stack_config(stack)
    values = {
        "AWS::Partition": "aws",
        "AWS::Region": cfg.region,
        "AWS::AccountId": ACCOUNT_ID,
        "ClusterName": cfg.cluster.name,
        "KarpenterInterruptionQueue.Arn": _queue_arn(r),
        "KarpenterNodeRole.Arn": _node_role_arn(r),
    }
    out = {}
    for resource in cloudformation()["Resources"].values():
        if resource["Type"] != "AWS::IAM::ManagedPolicy":
            continue
        name = resource["Properties"]["ManagedPolicyName"]["!Sub"]
        part = re.fullmatch(r"KarpenterController(\w+)Policy-\$\{ClusterName\}", name)
        assert part, name
        text = re.sub(
            r"\$\{([\w:.]+)\}", lambda m: values[m.group(1)], resource["Properties"]["PolicyDocument"]["!Sub"]
        )
        out[part.group(1)] = json.loads(text)
    return out


def _queue_arn(r: Rendered) -> str:
    arn: str = _outputs(r, "aws:sqs/queue:Queue", "karpenter-interruption")["arn"]
    return arn


def _node_role_arn(r: Rendered) -> str:
    arn: str = _outputs(r, "aws:iam/role:Role", "karpenter-node")["arn"]
    return arn


def ours(stack: str) -> dict[str, dict[str, Any]]:
    r = rendered(stack)
    return {
        part: json.loads(_one(r, "aws:iam/policy:Policy", f"karpenter-controller-{part}")["inputs"]["policy"])
        for part in POLICY_PARTS
    }


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def widening(mine: dict[str, Any], upstream: dict[str, Any]) -> list[str]:
    """Where `mine` grants more than `upstream`: other statements, actions, resources; missing or looser conditions."""
    theirs = {s["Sid"]: s for s in upstream["Statement"]}
    problems = []
    for statement in mine["Statement"]:
        # A statement split off one of upstream's (to carry a condition of its own) answers to that one.
        sid = policies.KARPENTER_SPLIT_FROM.get(statement.get("Sid", ""), statement.get("Sid"))
        if sid not in theirs or statement["Effect"] != "Allow":
            problems.append(f"{sid}: not an upstream Allow statement")
            continue
        up = theirs[sid]
        extra = set(_list(statement["Action"])) - set(_list(up["Action"]))
        problems += [f"{sid}: action {a} not granted upstream" for a in sorted(extra)]
        for resource in _list(statement["Resource"]):
            if not any(fnmatch.fnmatchcase(resource, pattern) for pattern in _list(up["Resource"])):
                problems.append(f"{sid}: resource {resource} outside upstream's {up['Resource']}")
        for operator, keys in (up.get("Condition") or {}).items():
            for key, value in keys.items():
                have = (statement.get("Condition") or {}).get(operator, {}).get(key)
                if have is None or not set(_list(have)) <= set(_list(value)):
                    problems.append(f"{sid}: condition {operator} {key} is {have!r}, upstream {value!r}")
    return problems


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_controller_policies_are_upstreams_or_narrower(stack: str) -> None:
    mine, upstream = ours(stack), upstream_policies(stack)
    assert set(upstream) == set(POLICY_PARTS), "upstream's CloudFormation has other controller policies"
    problems = [f"{part}: {p}" for part in POLICY_PARTS for p in widening(mine[part], upstream[part])]
    assert not problems, "\n".join(problems)
    # Nothing upstream grants is missing either (Karpenter would fail at run time):
    # every upstream statement is here, alone or split, with all of its actions.
    for part in POLICY_PARTS:
        merged: dict[str, set[str]] = {}
        for statement in mine[part]["Statement"]:
            sid = policies.KARPENTER_SPLIT_FROM.get(statement["Sid"], statement["Sid"])
            merged.setdefault(sid, set()).update(_list(statement["Action"]))
        assert list(merged) == [s["Sid"] for s in upstream[part]["Statement"]]
        for up in upstream[part]["Statement"]:
            assert merged[up["Sid"]] == set(_list(up["Action"]))
        for split, parent in policies.KARPENTER_SPLIT_FROM.items():
            statements = {s["Sid"]: s for s in mine[part]["Statement"]}
            if split in statements:
                assert set(_list(statements[split]["Action"])) == set(_list(statements[parent]["Action"]))


def _launch_statements(stack: str) -> tuple[dict[str, Any], dict[str, Any]]:
    statements = {s["Sid"]: s for s in ours(stack)["NodeLifecycle"]["Statement"]}
    return statements["AllowScopedEC2InstanceAccessActions"], statements[policies.KARPENTER_IMAGE_SID]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_a_launch_may_use_only_the_node_classes_subnets_group_and_amazons_images(stack: str) -> None:
    r = rendered(stack)
    vpc = _outputs(r, "awsx:ec2:Vpc", by_type(r, "awsx:ec2:Vpc")[0]["name"])
    cluster = _outputs(r, "eks:index:Cluster", by_type(r, "eks:index:Cluster")[0]["name"])
    region = stack_config(stack).region
    ec2 = f"arn:aws:ec2:{region}:{ACCOUNT_ID}"
    access, images = _launch_statements(stack)
    resources = _list(access["Resource"])
    # Exactly the subnets and the group the EC2NodeClasses select, no other.
    assert sorted(r for r in resources if ":subnet/" in r) == sorted(
        f"{ec2}:subnet/{i}" for i in vpc["privateSubnetIds"]
    )
    assert [r for r in resources if ":security-group/" in r] == [
        f"{ec2}:security-group/{cluster['nodeSecurityGroupId']}"
    ]
    selected = set()
    for node_class in manifests_of(r, "EC2NodeClass"):
        spec = node_class["spec"]
        selected |= {f"{ec2}:subnet/{t['id']}" for t in spec["subnetSelectorTerms"]}
        selected |= {f"{ec2}:security-group/{t['id']}" for t in spec["securityGroupSelectorTerms"]}
        # Amazon's images only: every class takes its AMI by an EKS-optimized alias.
        assert all(t["alias"].split("@")[0] in ("al2023", "bottlerocket") for t in spec["amiSelectorTerms"])
    assert selected == {r for r in resources if ":subnet/" in r or ":security-group/" in r}
    assert not any(":image/" in r for r in resources)
    assert images["Resource"] == f"arn:aws:ec2:{region}::image/*"
    assert images["Condition"] == {"StringEquals": {"ec2:Owner": ["amazon"]}}


def test_launch_targets_must_name_a_subnet_and_a_group() -> None:
    with pytest.raises(ValueError, match="at least one subnet"):
        policies.KarpenterLaunchTargets(subnet_ids=[], security_group_ids=["sg-1"])
    with pytest.raises(ValueError, match="at least one subnet"):
        policies.KarpenterLaunchTargets(subnet_ids=["subnet-1"], security_group_ids=[])


def test_the_comparison_catches_a_wider_policy() -> None:
    mine, upstream = ours("dev"), upstream_policies("dev")
    wider = copy.deepcopy(mine["NodeLifecycle"])
    wider["Statement"][-1]["Action"] = [*wider["Statement"][-1]["Action"], "ec2:DeleteVolume"]
    wider["Statement"][-1]["Resource"] = ["*"]
    del wider["Statement"][-1]["Condition"]["StringEquals"]
    problems = widening(wider, upstream["NodeLifecycle"])
    assert any("ec2:DeleteVolume" in p for p in problems)
    assert any("resource *" in p for p in problems)
    assert any("StringEquals" in p for p in problems)
    passrole = copy.deepcopy(mine["IAMIntegration"])
    passrole["Statement"][0]["Resource"] = "arn:aws:iam::123456789012:role/*"
    assert widening(passrole, upstream["IAMIntegration"])


def test_account_wildcards_are_narrowed_to_this_account() -> None:
    for document in ours("dev").values():
        for statement in document["Statement"]:
            for resource in _list(statement["Resource"]):
                assert ":*:" not in resource, resource


def test_the_policies_fit_iams_managed_policy_size() -> None:
    for part, document in ours("prod").items():
        assert len(json.dumps(document, separators=(",", ":"))) <= 6144, part


def test_the_controller_role_trusts_only_its_service_account_and_the_chart_uses_it() -> None:
    r = rendered("dev")
    cfg = stack_config("dev")
    trust = json.loads(_one(r, "aws:iam/role:Role", "karpenter-controller")["inputs"]["assumeRolePolicy"])
    assert trust == policies.pod_identity_trust(ACCOUNT_ID, cfg.cluster.name, "kube-system", "karpenter")
    association = _one(r, "aws:eks/podIdentityAssociation:PodIdentityAssociation", "karpenter-controller")["inputs"]
    (release,) = [h for h in r.helm if h["chart"] == "karpenter"]
    assert (association["namespace"], association["serviceAccount"]) == (
        release["namespace"],
        release["values"]["serviceAccount"]["name"],
    )
    attached = {
        x["inputs"]["policyArn"]
        for x in by_type(r, "aws:iam/rolePolicyAttachment:RolePolicyAttachment")
        if x["name"].startswith("karpenter-controller-")
    }
    assert len(attached) == len(POLICY_PARTS)


def test_interruption_queue_is_encrypted_tls_only_and_fed_by_upstreams_rules() -> None:
    r = rendered("dev")
    cfg = stack_config("dev")
    queue = _one(r, "aws:sqs/queue:Queue", "karpenter-interruption")["inputs"]
    assert queue["sqsManagedSseEnabled"] is True
    assert queue["name"] == aws_karpenter.interruption_queue_name(cfg.cluster.name)
    (release,) = [h for h in r.helm if h["chart"] == "karpenter"]
    assert release["values"]["settings"]["interruptionQueue"] == queue["name"]
    assert release["values"]["settings"]["clusterName"] == cfg.cluster.name
    policy = json.loads(_one(r, "aws:sqs/queuePolicy:QueuePolicy", "karpenter-interruption")["inputs"]["policy"])
    allow, deny = policy["Statement"]
    # EventBridge alone, and only for this stack's rules in this account: a rule elsewhere
    # can not feed Karpenter forged interruption warnings.
    assert allow["Principal"] == {"Service": "events.amazonaws.com"}
    assert allow["Action"] == "sqs:SendMessage" and allow["Resource"] == _queue_arn(r)
    rule_arns = sorted(
        _outputs(r, "aws:cloudwatch/eventRule:EventRule", x["name"])["arn"]
        for x in by_type(r, "aws:cloudwatch/eventRule:EventRule")
    )
    assert len(rule_arns) == len(aws_karpenter.INTERRUPTION_RULES)
    assert allow["Condition"] == {
        "StringEquals": {"aws:SourceAccount": ACCOUNT_ID},
        "ArnEquals": {"aws:SourceArn": rule_arns},
    }
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    upstream = {
        (res["Properties"]["EventPattern"]["source"][0], res["Properties"]["EventPattern"]["detail-type"][0])
        for res in cloudformation()["Resources"].values()
        if res["Type"] == "AWS::Events::Rule"
    }
    rules = {
        x["name"]: json.loads(x["inputs"]["eventPattern"]) for x in by_type(r, "aws:cloudwatch/eventRule:EventRule")
    }
    assert {(p["source"][0], p["detail-type"][0]) for p in rules.values()} == upstream
    targets = by_type(r, "aws:cloudwatch/eventTarget:EventTarget")
    assert {t["name"] for t in targets} == set(rules)
    assert all(t["inputs"]["arn"] == _queue_arn(r) for t in targets)


def test_karpenter_nodes_join_with_their_own_role_and_access_entry() -> None:
    r = rendered("dev")
    entry = _one(r, "aws:eks/accessEntry:AccessEntry", "karpenter-node")["inputs"]
    assert entry["type"] == "EC2_LINUX" and entry["principalArn"] == _node_role_arn(r)
    role_name = _outputs(r, "aws:iam/role:Role", "karpenter-node")["name"]
    assert {c["spec"]["role"] for c in manifests_of(r, "EC2NodeClass")} == {role_name}
    # PassRole names that role alone, and the system nodes keep the cluster's node role.
    (passrole,) = [s for s in ours("dev")["IAMIntegration"]["Statement"] if s["Action"] == "iam:PassRole"]
    assert passrole["Resource"] == _node_role_arn(r)
    (system,) = by_type(r, "aws:eks/nodeGroup:NodeGroup")
    assert system["inputs"]["nodeRoleArn"] != _node_role_arn(r)


def test_node_classes_select_the_private_subnets_and_node_group_by_id() -> None:
    r = rendered("prod")
    vpc = _outputs(r, "awsx:ec2:Vpc", by_type(r, "awsx:ec2:Vpc")[0]["name"])
    cluster = _outputs(r, "eks:index:Cluster", by_type(r, "eks:index:Cluster")[0]["name"])
    for node_class in manifests_of(r, "EC2NodeClass"):
        spec = node_class["spec"]
        assert [t["id"] for t in spec["subnetSelectorTerms"]] == vpc["privateSubnetIds"]
        assert [t["id"] for t in spec["securityGroupSelectorTerms"]] == [cluster["nodeSecurityGroupId"]]
