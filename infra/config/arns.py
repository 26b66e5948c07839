"""The ARN rule: every `*_arn` / `*_arns` key names its service and resource, in the stack's partition and region."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from infra.config.problems import Problem
from infra.config.stack import StackConfig

# The partition of a region (the `aws` partition for every other region).
_PARTITIONS = (
    ("cn-", "aws-cn"),
    ("us-gov-", "aws-us-gov"),
    ("us-isob-", "aws-iso-b"),
    ("us-isof-", "aws-iso-f"),
    ("us-iso-", "aws-iso"),
    ("eu-isoe-", "aws-iso-e"),
    ("eusc-", "aws-eusc"),
)
_ARN = re.compile(
    r"^arn:(?P<partition>aws(-[a-z]+)*):(?P<service>[a-z0-9-]+):(?P<region>[a-z0-9-]*):(?P<account>\d{12})?:"
    r"(?P<resource>.+)$"
)
# A resource id as AWS writes them (a UUID, `mrk-...` for multi-Region keys).
_RESOURCE_ID = r"[A-Za-z0-9][A-Za-z0-9-]*"


@dataclass(frozen=True)
class ArnRule:
    """What an ARN field must name: the service, the resource form, and whether it lives in the stack's region."""

    service: str
    resource: str
    example: str
    regional: bool


# Every `*_arn` / `*_arns` field of the config and what it must name.
ARN_RULES: dict[str, ArnRule] = {
    # An IAM user or role: what an EKS access entry takes (not an STS assumed-role session).
    "cluster.admin_principal_arns": ArnRule("iam", r"(user|role)/[\w+=,.@/-]+", "role/<name>", regional=False),
    # The model bucket's policy names them as `aws:PrincipalArn`: a user or a role, never a session.
    "storage.weights_writer_arns": ArnRule("iam", r"(user|role)/[\w+=,.@/-]+", "role/<name>", regional=False),
    # A key, not an alias: the EBS CSI driver's IAM grants name it as a policy resource.
    "storage.storage_class.kms_key_arn": ArnRule("kms", rf"key/{_RESOURCE_ID}", "key/<id>", regional=True),
    # The NLB's TLS listener takes an ACM certificate of its own region.
    "endpoint.certificate_arn": ArnRule("acm", rf"certificate/{_RESOURCE_ID}", "certificate/<id>", regional=True),
}


def region_partition(region: str) -> str:
    """The AWS partition a region belongs to."""
    return next((partition for prefix, partition in _PARTITIONS if region.startswith(prefix)), "aws")


def _arn_problem(arn: str, rule: ArnRule, region: str) -> str | None:
    match = _ARN.match(arn)
    form = f"arn:{region_partition(region)}:{rule.service}:{region if rule.regional else ''}:<account>:{rule.example}"
    if match is None:
        return f"'{arn}' is not an ARN ({form})"
    if match["partition"] != region_partition(region):
        return f"'{arn}' is in partition {match['partition']}, region {region} in {region_partition(region)}"
    if match["service"] != rule.service or not re.fullmatch(rule.resource, match["resource"]):
        return f"'{arn}' is not {form}"
    if not match["account"]:
        return f"'{arn}' names no account ({form})"
    if (match["region"] or None) != (region if rule.regional else None):
        where = f"the stack's region {region}" if rule.regional else "no region (the service is global)"
        return f"'{arn}' must name {where}"
    return None


def _values_at(cfg: StackConfig, path: str) -> list[tuple[str, str]]:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    if isinstance(node, list):
        return [(f"{path}[{i}]", str(v)) for i, v in enumerate(node)]
    return [] if node is None else [(path, str(node))]


def check_arns(cfg: StackConfig) -> Iterable[Problem]:
    """Each ARN in the config follows its rule (ARN_RULES)."""
    for field, rule in ARN_RULES.items():
        for path, arn in _values_at(cfg, field):
            problem = _arn_problem(arn, rule, cfg.region)
            if problem:
                yield Problem(path, problem)
