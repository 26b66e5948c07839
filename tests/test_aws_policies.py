"""The IAM documents of the AWS layer, read as data: each names only what it must."""

from __future__ import annotations

import json
import re
from typing import Any

from infra import versions
from infra.aws import policies

BUCKET = "arn:aws:s3:::weights"
KEY = "arn:aws:kms:us-east-1:123456789012:key/k"
ARGS = ("aws", "us-east-1", "123456789012", "llm-test")


def _statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["Statement"])


def _actions(stmt: dict[str, Any]) -> list[str]:
    action = stmt["Action"]
    return [action] if isinstance(action, str) else list(action)


def _resources(stmt: dict[str, Any]) -> list[str]:
    res = stmt["Resource"]
    return [res] if isinstance(res, str) else list(res)


def test_model_reader_reads_only_the_models_prefixes() -> None:
    doc = policies.model_reader(BUCKET, ["org/b", "org/a", "org/a"], KEY, "us-east-1")
    get = next(s for s in _statements(doc) if "s3:GetObject" in _actions(s))
    assert _resources(get) == [f"{BUCKET}/org/a/*", f"{BUCKET}/org/b/*"]
    listing = next(s for s in _statements(doc) if "s3:ListBucket" in _actions(s))
    assert _resources(listing) == [BUCKET]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["org/a", "org/a/*", "org/b", "org/b/*"]}}
    # Read-only: no write, delete or ACL action anywhere.
    every = [a for s in _statements(doc) for a in _actions(s)]
    assert sorted(every) == ["kms:Decrypt", "s3:GetObject", "s3:ListBucket"]
    decrypt = next(s for s in _statements(doc) if "kms:Decrypt" in _actions(s))
    assert _resources(decrypt) == [KEY]
    assert decrypt["Condition"] == {"StringEquals": {"kms:ViaService": "s3.us-east-1.amazonaws.com"}}


def test_model_reader_without_s3_models_grants_no_s3() -> None:
    doc = policies.model_reader(BUCKET, [], KEY, "us-east-1")
    assert not [a for s in _statements(doc) for a in _actions(s) if a.startswith("s3:")]


def test_autoscaler_changes_only_groups_tagged_for_its_cluster() -> None:
    doc = policies.cluster_autoscaler(*ARGS)
    for stmt in _statements(doc):
        mutating = {"autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"}
        if mutating & set(_actions(stmt)):
            assert stmt["Condition"] == {
                "StringEquals": {"aws:ResourceTag/k8s.io/cluster-autoscaler/llm-test": "owned"}
            }
            assert _resources(stmt) == [
                "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:*:autoScalingGroupName/*"
            ]
        if _resources(stmt) == ["*"]:
            # Only calls IAM offers no resource-level permission for.
            assert all(a.split(":")[1].startswith(("Describe", "Get")) for a in _actions(stmt)), stmt
    node_groups = next(s for s in _statements(doc) if "eks:DescribeNodegroup" in _actions(s))
    assert _resources(node_groups) == ["arn:aws:eks:us-east-1:123456789012:nodegroup/llm-test/*/*"]


def test_load_balancer_controller_changes_only_its_clusters_resources() -> None:
    doc = policies.load_balancer_controller(*ARGS)
    changes = {
        "elasticloadbalancing:DeleteLoadBalancer",
        "elasticloadbalancing:ModifyLoadBalancerAttributes",
        "elasticloadbalancing:DeleteTargetGroup",
        "ec2:DeleteSecurityGroup",
        "elasticloadbalancing:CreateLoadBalancer",
        "elasticloadbalancing:CreateTargetGroup",
    }
    seen: set[str] = set()
    for stmt in _statements(doc):
        found = changes & set(_actions(stmt))
        if found:
            seen |= found
            cond = stmt["Condition"]["StringEquals"]
            assert "llm-test" in (
                cond.get("aws:ResourceTag/elbv2.k8s.aws/cluster"),
                cond.get("aws:RequestTag/elbv2.k8s.aws/cluster"),
            ), stmt
        for res in _resources(stmt):
            # Every ARN is this account's and region's (or `*` for reads).
            assert res == "*" or ":123456789012:" in res, res
            if res == "*":
                assert not found
    assert seen == changes
    opens = next(s for s in _statements(doc) if s["Sid"] == "NodeSecurityGroupRules")
    assert _resources(opens) == ["arn:aws:ec2:us-east-1:123456789012:security-group/*"]
    scoped = policies.load_balancer_controller(*ARGS, node_security_group_id="sg-0abc")
    opens = next(s for s in _statements(scoped) if s["Sid"] == "NodeSecurityGroupRules")
    assert _resources(opens) == ["arn:aws:ec2:us-east-1:123456789012:security-group/sg-0abc"]


def test_pod_identity_trust_names_one_service_account_of_one_cluster() -> None:
    doc = policies.pod_identity_trust("123456789012", "llm-test", "llm", "model-reader")
    (stmt,) = _statements(doc)
    assert stmt["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(_actions(stmt)) == ["sts:AssumeRole", "sts:TagSession"]
    assert stmt["Condition"]["StringEquals"] == {
        "aws:SourceAccount": "123456789012",
        "aws:RequestTag/eks-cluster-name": "llm-test",
        "aws:RequestTag/kubernetes-namespace": "llm",
        "aws:RequestTag/kubernetes-service-account": "model-reader",
    }


def test_bucket_policy_denies_plain_http_on_bucket_and_objects() -> None:
    (stmt,) = _statements(policies.bucket_tls_only(BUCKET))
    assert stmt["Effect"] == "Deny"
    assert stmt["Principal"] == "*"
    assert stmt["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert _resources(stmt) == [BUCKET, f"{BUCKET}/*"]


def test_no_policy_grants_s3_on_a_wildcard_resource() -> None:
    docs = [
        policies.model_reader(BUCKET, ["a"], KEY, "us-east-1"),
        policies.cluster_autoscaler(*ARGS),
        policies.load_balancer_controller(*ARGS),
        policies.kms_grants_for_ebs(KEY, "us-east-1"),
    ]
    for doc in docs:
        for stmt in _statements(doc):
            if any(a.startswith("s3:") for a in _actions(stmt)):
                assert all(r.startswith(f"{BUCKET}") for r in _resources(stmt)), stmt


def test_load_balancer_controller_policy_follows_the_pinned_controller_version() -> None:
    """The data file is written for one controller version; a new chart pin means re-reading upstream's policy."""
    assert versions.AWS_LOAD_BALANCER_CONTROLLER.version == policies.LOAD_BALANCER_CONTROLLER_POLICY_VERSION


def test_load_balancer_controller_policy_template_fills_every_placeholder() -> None:
    text = policies.LOAD_BALANCER_CONTROLLER_POLICY_FILE.read_text()
    assert set(re.findall(r"\$\{(\w+)\}", text)) == {"partition", "region", "account", "cluster", "node_security_group"}
    doc = policies.load_balancer_controller(*ARGS, node_security_group_id="sg-0abc")
    assert "$" not in json.dumps(doc)
    sids = [s["Sid"] for s in _statements(doc)]
    assert sids == [s["Sid"] for s in policies.LOAD_BALANCER_CONTROLLER_POLICY["Statement"]]
    assert len(set(sids)) == len(sids)
    # Filling in returns a copy: the template itself stays a template.
    doc["Statement"].clear()
    assert policies.LOAD_BALANCER_CONTROLLER_POLICY["Statement"]
    assert "${cluster}" in json.dumps(policies.LOAD_BALANCER_CONTROLLER_POLICY)
